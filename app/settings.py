"""The settings dialog. Input is checked by `Settings.with_changes`; a mistake is shown next to
the Save button and the dialog stays open with everything the person typed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.bridge import Bridge
from worker import autostart
from worker.config import Paths, Settings, save_settings
from worker.events import GpuSnapshot

CURRENCIES = ("USD", "EUR", "GBP", "CAD", "AUD", "JPY", "CHF", "SEK", "PLN", "INR", "BRL")
UPDATE_CHANNELS = ("stable", "beta")


def parse_number(text: str, what: str, problems: list[str]) -> float | None:
    try:
        return float(text.strip().replace(",", "."))
    except ValueError:
        problems.append(f"{what}: “{text}” is not a number.")
        return None


class SettingsDialog(QDialog):
    def __init__(
        self,
        settings: Settings,
        paths: Paths,
        bridge: Bridge,
        startup: autostart.Autostart,
        gpus: tuple[GpuSnapshot, ...] = (),
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("GPU Provider settings")
        self.setMinimumWidth(540)
        self.settings = settings
        self._paths = paths
        self._bridge = bridge
        self._startup = startup
        layout = QVBoxLayout(self)
        layout.addWidget(self._money_group(settings))
        layout.addWidget(self._serving_group(settings, gpus))
        layout.addWidget(self._models_group(settings))
        layout.addWidget(self._app_group(settings))
        self.error = QLabel()
        self.error.setWordWrap(True)
        self.error.setStyleSheet("color: #B91C1C;")
        self.error.hide()
        layout.addWidget(self.error)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        cancel = QPushButton("Cancel")
        cancel.clicked.connect(self.reject)
        self.save_button = QPushButton("Save")
        self.save_button.setDefault(True)
        self.save_button.clicked.connect(self.save)
        buttons.addWidget(cancel)
        buttons.addWidget(self.save_button)
        layout.addLayout(buttons)

    # fields -------------------------------------------------------------------------------

    def _money_group(self, s: Settings) -> QGroupBox:
        group, form = _group("Electricity")
        self.price = QLineEdit(f"{s.electricity_price_per_kwh:g}")
        form.addRow("Price per kWh", self.price)
        self.currency = QComboBox()
        self.currency.setEditable(True)
        self.currency.addItems(CURRENCIES)
        self.currency.setCurrentText(s.currency)
        form.addRow("Currency", self.currency)
        return group

    def _serving_group(self, s: Settings, gpus: tuple[GpuSnapshot, ...]) -> QGroupBox:
        group, form = _group("Serving")
        self.auto_pause = QCheckBox("Pause when a game or another app uses the GPU")
        self.auto_pause.setChecked(s.auto_pause_for_games)
        form.addRow(self.auto_pause)
        self.resume_after_min = QSpinBox()
        self.resume_after_min.setRange(0, 240)
        self.resume_after_min.setSuffix(" min")
        self.resume_after_min.setValue(round(s.auto_resume_after_s / 60))
        form.addRow("Resume after the game has been closed for", self.resume_after_min)
        self.ignored = QLineEdit(", ".join(s.autopause_ignored))
        self.ignored.setPlaceholderText("e.g. obs64.exe, blender")
        self.ignored.setToolTip("Programs that may use the GPU without pausing serving (process names, comma-separated)")
        form.addRow("Never pause for", self.ignored)
        hours = QHBoxLayout()
        self.limit_hours = QCheckBox("Serve only from")
        self.limit_hours.setChecked(s.serve_hours is not None)
        self.hours_from, self.hours_to = QSpinBox(), QSpinBox()
        start, end = s.serve_hours or (0, 24)
        for box, value in ((self.hours_from, start), (self.hours_to, end)):
            box.setRange(0, 24)
            box.setSuffix(":00")
            box.setValue(value)
        hours.addWidget(self.limit_hours)
        hours.addWidget(self.hours_from)
        hours.addWidget(QLabel("to"))
        hours.addWidget(self.hours_to)
        hours.addStretch(1)
        form.addRow(hours)
        self.gpu_boxes: dict[int, QCheckBox] = {}
        for gpu in gpus:
            lend = QCheckBox(f"GPU {gpu.index}: {gpu.name}")
            lend.setChecked(s.gpus_to_lend is None or gpu.index in s.gpus_to_lend)
            self.gpu_boxes[gpu.index] = lend
            form.addRow("Lend" if len(self.gpu_boxes) == 1 else "", lend)
        return group

    def _models_group(self, s: Settings) -> QGroupBox:
        group, form = _group("Models")
        folder = QHBoxLayout()
        self.cache_dir = QLineEdit(s.model_cache_dir or "")
        self.cache_dir.setPlaceholderText(str(self._paths.models_dir))
        browse = QPushButton("Choose…")
        browse.clicked.connect(self._choose_folder)
        folder.addWidget(self.cache_dir)
        folder.addWidget(browse)
        form.addRow("Model folder", folder)
        self.cache_limit = QLineEdit(f"{s.model_cache_limit_gib:g}")
        form.addRow("Keep at most (GiB)", self.cache_limit)
        self.remote_code = QCheckBox("Allow models that run their own code (trust-remote-code)")
        self.remote_code.setChecked(s.allow_remote_code)
        form.addRow(self.remote_code)
        return group

    def _app_group(self, s: Settings) -> QGroupBox:
        group, form = _group("App")
        self.start_at_login = QCheckBox("Start GPU Provider when I log in")
        self.start_at_login.setChecked(s.start_at_login)
        form.addRow(self.start_at_login)
        self.channel = QComboBox()
        self.channel.addItems(UPDATE_CHANNELS)
        self.channel.setCurrentText(s.update_channel)
        form.addRow("Update channel", self.channel)
        self.auto_install = QCheckBox("Install updates automatically (waits until nothing is being served)")
        self.auto_install.setChecked(s.auto_install_updates)
        form.addRow(self.auto_install)
        return group

    def _choose_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Model folder", self.cache_dir.text() or str(Path.home()))
        if folder:
            self.cache_dir.setText(folder)

    # saving -------------------------------------------------------------------------------

    def changes(self) -> tuple[dict[str, Any], list[str]]:
        """The fields as Settings values, and what is wrong with them in words."""
        problems: list[str] = []
        price = parse_number(self.price.text(), "Electricity price", problems)
        limit = parse_number(self.cache_limit.text(), "Model folder size", problems)
        currency = self.currency.currentText().strip().upper()
        if len(currency) != 3 or not currency.isalpha():
            problems.append(f"Currency: use a three-letter code such as USD or EUR, not “{currency}”.")
        lent = tuple(i for i, box in self.gpu_boxes.items() if box.isChecked())
        if self.gpu_boxes and not lent:
            problems.append("Lend at least one GPU (to stop serving, pause instead).")
        hours = (self.hours_from.value(), self.hours_to.value()) if self.limit_hours.isChecked() else None
        changes: dict[str, Any] = {
            "currency": currency,
            "auto_pause_for_games": self.auto_pause.isChecked(),
            "auto_resume_after_s": float(self.resume_after_min.value() * 60),
            "autopause_ignored": tuple(n.strip() for n in self.ignored.text().split(",") if n.strip()),
            "serve_hours": hours,
            "gpus_to_lend": None if len(lent) == len(self.gpu_boxes) else lent,
            "model_cache_dir": self.cache_dir.text().strip() or None,
            "allow_remote_code": self.remote_code.isChecked(),
            "start_at_login": self.start_at_login.isChecked(),
            "update_channel": self.channel.currentText(),
            "auto_install_updates": self.auto_install.isChecked(),
        }
        if price is not None:
            changes["electricity_price_per_kwh"] = price
        if limit is not None:
            changes["model_cache_limit_gib"] = limit
        return changes, problems

    def save(self) -> None:
        changes, problems = self.changes()
        if problems:
            self._show_error(problems)
            return
        try:
            updated = self.settings.with_changes(**changes)
        except ValueError as exc:
            self._show_error([f"{exc}."])
            return
        try:
            autostart.apply_setting(self._startup, was_on=self.settings.start_at_login, now_on=updated.start_at_login)
            save_settings(self._paths, updated)
        except OSError as exc:
            self._show_error([f"Could not save ({exc}). Check that the folder is writable, then try again."])
            return
        self._bridge.apply_settings(updated)
        self.settings = updated
        self.accept()

    def _show_error(self, problems: list[str]) -> None:
        self.error.setText("Nothing was saved yet:\n• " + "\n• ".join(problems))
        self.error.show()


def _group(title: str) -> tuple[QGroupBox, QFormLayout]:
    group = QGroupBox(title)
    form = QFormLayout(group)
    return group, form
