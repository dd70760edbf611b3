"""The settings dialog, and the fields it shares with the first-run flow (price, GPUs to lend).

Input is checked by `Settings.with_changes`; a mistake is shown next to the Save button and the
dialog stays open with everything the person typed. Colours come from app/theme.py through object
names ("error", "muted", ...), so the dialog follows light and dark like every other window.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QAbstractSpinBox,
    QCheckBox,
    QComboBox,
    QDialog,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QFrame,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QScrollArea,
    QSlider,
    QSpinBox,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.bridge import Bridge
from app.format import CPU_ONLY, FINDING_GPUS, games_seen, gpu_line
from app.signin import SignInDialog
from worker.system import autostart
from worker.system import networks
from worker.system import secrets
from worker.measure.prices import price_doubt
from worker.system.config import Paths, Settings
from worker.contract.events import GpuSnapshot, NodeSnapshot
from worker.system.networks import Network

UPDATE_CHANNELS = ("stable", "beta")
SpinBox = TypeVar("SpinBox", QSpinBox, QDoubleSpinBox)
LEND_ONE = "Lend at least one GPU (to stop serving, pause instead)."


def parse_number(text: str, what: str, problems: list[str]) -> float | None:
    try:
        return float(text.strip().replace(",", "."))
    except ValueError:
        problems.append(f"{what}: “{text}” is not a number.")
        return None


class PriceField(QWidget):
    """What a kWh costs, with the network's currency beside it (the price is asked in what it pays)."""

    def __init__(self, price: float, currency: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        self.price = QLineEdit(f"{price:g}")
        self.price.setPlaceholderText("e.g. 0.30")
        self.currency = QLabel()
        row.addWidget(self.price, 1)
        row.addWidget(self.currency)
        self.set_currency(currency)

    def set_currency(self, currency: str) -> None:
        self.currency_code = currency
        self.currency.setText(f"{currency} per kWh")
        self.price.setAccessibleName(f"Electricity price, {currency} per kWh")

    def value(self, problems: list[str]) -> float | None:
        """The price, or None with what is wrong added to `problems` in words."""
        price = parse_number(self.price.text(), "Electricity price", problems)
        if price is not None and price < 0:
            problems.append("Electricity price: it cannot be negative (use 0 if electricity is free for you).")
            return None
        return price


class GpuChoice(QWidget):
    """Which GPUs to lend, one checkbox each. Detection may still run when this is built: it says
    "Finding your GPUs…" and fills in once the core knows the machine, keeping what was ticked."""

    def __init__(self, bridge: Bridge, lent: tuple[int, ...] | None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._lent = lent
        self._shown: tuple[tuple[int, str], ...] | None = None  # the GPUs the boxes are for; None = detecting
        self.boxes: dict[int, QCheckBox] = {}
        self._layout = QVBoxLayout(self)
        self._layout.setContentsMargins(0, 0, 0, 0)
        self.note = QLabel()
        self.note.setObjectName("muted")
        self.note.setWordWrap(True)
        self._layout.addWidget(self.note)
        self._show(bridge.latest, force=True)
        bridge.snapshot_changed.connect(self._show)

    def _show(self, snapshot: NodeSnapshot, force: bool = False) -> None:
        shown = None if snapshot.detecting else tuple((g.index, g.name) for g in snapshot.gpus)
        if shown == self._shown and not force:
            return
        if self.boxes:
            self._lent = self.lent()
        for box in self.boxes.values():
            self._layout.removeWidget(box)
            box.deleteLater()
        self.boxes = {}
        self._shown = shown
        self.note.setText(FINDING_GPUS if snapshot.detecting else CPU_ONLY)
        self.note.setVisible(snapshot.detecting or not snapshot.gpus)
        if snapshot.detecting:
            return
        for gpu in snapshot.gpus:
            box = QCheckBox(gpu_line(gpu))
            box.setChecked(self._lent is None or gpu.index in self._lent)
            self.boxes[gpu.index] = box
            self._layout.addWidget(box)
            box.show()  # at once: a layout shows a late child only once the event loop gets to it

    @property
    def detecting(self) -> bool:
        return self._shown is None

    def lent(self) -> tuple[int, ...] | None:
        """The GPUs ticked; None = every GPU (also while detecting, and on a CPU-only machine)."""
        if not self.boxes:
            return self._lent
        ticked = tuple(i for i, box in self.boxes.items() if box.isChecked())
        return None if len(ticked) == len(self.boxes) else ticked

    def problem(self) -> str | None:
        if self.boxes and not any(box.isChecked() for box in self.boxes.values()):
            return LEND_ONE
        return None


class SettingsDialog(QDialog):
    saved = Signal(object)  # the Settings just saved and applied

    def __init__(
        self,
        settings: Settings,
        paths: Paths,
        bridge: Bridge,
        startup: autostart.Autostart,
        parent: QWidget | None = None,
        choices: tuple[Network, ...] | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("GPU Provider settings")
        self.setMinimumWidth(540)
        self.settings = settings
        self._paths = paths
        self._bridge = bridge
        self._startup = startup
        self._choices = _with_current(choices or networks.choices(), networks.for_url(settings.coordinator_url))
        self._price_asked: float | None = None  # a doubtful price already questioned: a second Save keeps it
        layout = QVBoxLayout(self)
        self.tabs = QTabWidget()
        self.tabs.setAccessibleName("Settings pages")
        self.tabs.addTab(_scrolled(self._network_group(settings), self._money_group(settings),
                                   self._serving_group(settings), self._models_group(settings),
                                   self._app_group(settings)), "General")
        self.tabs.addTab(_scrolled(self._limits_group(settings), self._downloads_group(settings),
                                   self._notify_group(settings)), "Limits")
        layout.addWidget(self.tabs, 1)
        self.error = QLabel()
        self.error.setObjectName("error")
        self.error.setWordWrap(True)
        self.error.hide()
        layout.addWidget(self.error)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        cancel = QPushButton("Cancel")
        cancel.clicked.connect(self.reject)
        self.save_button = QPushButton("Save")
        self.save_button.setObjectName("primary")
        self.save_button.setDefault(True)
        self.save_button.clicked.connect(self.save)
        buttons.addWidget(cancel)
        buttons.addWidget(self.save_button)
        layout.addLayout(buttons)
        self._show_network()

    # fields -------------------------------------------------------------------------------

    def _network_group(self, s: Settings) -> QGroupBox:
        group, form = _group("Network")
        self.network = QComboBox()
        for network in self._choices:
            self.network.addItem(network.name, network.coordinator_url)
        self.network.setCurrentIndex(self.network.findData(s.coordinator_url))
        self.network.currentIndexChanged.connect(self._show_network)
        form.addRow("Lend to", self.network)
        account = QHBoxLayout()
        self.account = QLabel()
        self.account_button = QPushButton()
        self.account_button.clicked.connect(self._account_action)
        account.addWidget(self.account, 1)
        account.addWidget(self.account_button)
        form.addRow("Account", account)
        return group

    def _money_group(self, s: Settings) -> QGroupBox:
        group, form = _group("Electricity")
        self.price_field = PriceField(s.electricity_price_per_kwh, s.currency)
        self.price = self.price_field.price
        form.addRow("Price", self.price_field)
        return group

    def _serving_group(self, s: Settings) -> QGroupBox:
        group, form = _group("Serving")
        self.auto_pause = QCheckBox("Pause when a game or another app uses the GPU")
        self.auto_pause.setChecked(s.auto_pause_for_games)
        form.addRow(self.auto_pause)
        detection = self._bridge.latest.game_detection
        self.game_detection = QLabel(detection or "")
        self.game_detection.setObjectName("hint")
        self.game_detection.setWordWrap(True)
        self.game_detection.setVisible(bool(detection))  # said only where games can be missed
        form.addRow(self.game_detection)
        self.auto_pause.setVisible(games_seen(self._bridge.latest))  # offered only where it can work
        self.keep_awake = QCheckBox("Keep this computer awake while it serves")
        self.keep_awake.setChecked(s.keep_awake_while_serving)
        self.keep_awake.setToolTip("A computer that goes to sleep stops serving. It may sleep again as soon as "
                                   "serving is paused or stopped.")
        form.addRow(self.keep_awake)
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
        self.gpus = GpuChoice(self._bridge, s.gpus_to_lend)
        form.addRow(QLabel("Lend these GPUs:"))
        form.addRow(self.gpus)  # the whole width: a GPU's name is never cut off
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

    def _limits_group(self, s: Settings) -> QGroupBox:
        group, form = _group("What you lend")
        self.memory_share = MemoryShare(self._bridge, s.memory_share_pct)
        form.addRow(self.memory_share)
        self.max_requests = _optional_spin(QSpinBox(), 1, 256, s.max_requests, "No limit")
        self.max_requests.setAccessibleName("Requests at once")
        form.addRow("Requests at once, at most", self.max_requests)
        self.temperature = _optional_spin(QSpinBox(), 50, 95, s.temperature_limit_c, "No limit")
        self.temperature.setSuffix(" °C")
        self.temperature.setAccessibleName("Hottest a GPU may run")
        self.temperature.setToolTip("Above it, fewer requests at once, then a pause; serving resumes once the GPU "
                                    "has cooled a few degrees below it.")
        form.addRow("Hottest a GPU may run", self.temperature)
        self.pause_on_battery = QCheckBox("Pause while this computer runs on battery")
        self.pause_on_battery.setChecked(s.pause_on_battery)
        form.addRow(self.pause_on_battery)
        self.stop_unprofitable = QCheckBox("Stop serving when electricity costs more than it earns")
        self.stop_unprofitable.setChecked(s.stop_when_unprofitable)
        self.stop_unprofitable.setToolTip("Judged over several minutes from the measured power draw and your "
                                          "electricity price; serving resumes once it pays again.")
        form.addRow(self.stop_unprofitable)
        return group

    def _downloads_group(self, s: Settings) -> QGroupBox:
        group, form = _group("Downloads")
        self.download_limit = _optional_spin(QDoubleSpinBox(), 0.1, 10_000, s.download_limit_mib_s, "No limit")
        self.download_limit.setDecimals(1)
        self.download_limit.setSuffix(" MiB/s")
        self.download_limit.setAccessibleName("Download speed limit")
        form.addRow("Download speed, at most", self.download_limit)
        self.monthly_budget = _optional_spin(QSpinBox(), 1, 100_000, s.monthly_download_gib, "No limit")
        self.monthly_budget.setSuffix(" GiB")
        self.monthly_budget.setAccessibleName("Downloads per month")
        self.monthly_budget.setToolTip("A download that would pass it waits until the next month and says so.")
        form.addRow("Downloads per month, at most", self.monthly_budget)
        return group

    def _notify_group(self, s: Settings) -> QGroupBox:
        group, form = _group("Notifications")
        self.notify_idle = _optional_spin(QSpinBox(), 1, 168, s.notify_idle_hours, "Never")
        self.notify_idle.setSuffix(" h")
        self.notify_idle.setAccessibleName("Tell me when online but earning nothing for")
        form.addRow("Tell me when online but earning nothing for", self.notify_idle)
        self.notify_back = QCheckBox("Tell me when it is back online after being offline")
        self.notify_back.setChecked(s.notify_back_online)
        form.addRow(self.notify_back)
        return group

    def _choose_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Model folder", self.cache_dir.text() or str(Path.home()))
        if folder:
            self.cache_dir.setText(folder)

    # the network and its account ----------------------------------------------------------

    def chosen_network(self) -> Network:
        return self._choices[self.network.currentIndex()]

    def _show_network(self) -> None:
        """The account line and the price's currency follow the network picked (not yet saved)."""
        network = self.chosen_network()
        self.price_field.set_currency(network.currency)
        self.account_button.setVisible(not network.is_local)
        if network.is_local:
            self.account.setText("No account needed: nothing leaves this computer.")
        elif secrets.get_token() is None:
            self.account.setText("Not signed in")
            self.account_button.setText("Sign in…")
        else:
            self.account.setText("Signed in")
            self.account_button.setText("Sign out")

    def _account_action(self) -> None:
        if secrets.get_token() is None:
            self._sign_in()
        else:
            self.sign_out()

    def sign_out(self) -> None:
        """Forget the token (keyring, and this session's copy) and tell the core to disconnect."""
        secrets.clear_token()
        os.environ.pop(secrets.ENV_VAR, None)
        self._bridge.sign_out()
        self._show_network()

    def _sign_in(self) -> None:
        dialog = SignInDialog(self._bridge, self.chosen_network(), self)
        dialog.accepted.connect(self._bridge.token_changed)
        dialog.finished.connect(self._show_network)
        dialog.open()

    # saving -------------------------------------------------------------------------------

    def changes(self) -> tuple[dict[str, Any], list[str]]:
        """The fields as Settings values, and what is wrong with them in words."""
        problems: list[str] = []
        price = self.price_field.value(problems)
        limit = parse_number(self.cache_limit.text(), "Model folder size", problems)
        if (gpu_problem := self.gpus.problem()) is not None:
            problems.append(gpu_problem)
        hours = (self.hours_from.value(), self.hours_to.value()) if self.limit_hours.isChecked() else None
        network = self.chosen_network()
        changes: dict[str, Any] = {
            "coordinator_url": network.coordinator_url,
            "currency": network.currency,
            "auto_pause_for_games": self.auto_pause.isChecked(),
            "keep_awake_while_serving": self.keep_awake.isChecked(),
            "auto_resume_after_s": float(self.resume_after_min.value() * 60),
            "autopause_ignored": tuple(n.strip() for n in self.ignored.text().split(",") if n.strip()),
            "serve_hours": hours,
            "gpus_to_lend": self.gpus.lent(),
            "model_cache_dir": self.cache_dir.text().strip() or None,
            "allow_remote_code": self.remote_code.isChecked(),
            "start_at_login": self.start_at_login.isChecked(),
            "update_channel": self.channel.currentText(),
            "auto_install_updates": self.auto_install.isChecked(),
            "memory_share_pct": self.memory_share.shares(),
            "max_requests": _spin_int(self.max_requests),
            "temperature_limit_c": _spin_int(self.temperature),
            "pause_on_battery": self.pause_on_battery.isChecked(),
            "stop_when_unprofitable": self.stop_unprofitable.isChecked(),
            "download_limit_mib_s": _spin_value(self.download_limit),
            "monthly_download_gib": _spin_value(self.monthly_budget),
            "notify_idle_hours": _spin_value(self.notify_idle),
            "notify_back_online": self.notify_back.isChecked(),
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
        if (question := self._price_question(changes)) is not None:
            self.error.setText(question + " Press Save again to keep it.")
            self.error.show()
            return
        try:
            updated = self.settings.with_changes(**changes)
        except ValueError as exc:
            self._show_error([f"{exc}."])
            return
        try:
            autostart.apply_setting(self._startup, was_on=self.settings.start_at_login, now_on=updated.start_at_login)
            self._bridge.save_settings(updated)  # the core saves and applies them
        except autostart.AutostartRefused as exc:  # its words say what to do; the folder is not the problem
            self._show_error([str(exc)])
            return
        except OSError as exc:
            self._show_error([f"Could not save ({exc}). Check that the folder is writable, then try again."])
            return
        self.settings = updated
        self.saved.emit(updated)
        self.accept()

    def _price_question(self, changes: dict[str, Any]) -> str | None:
        """A price far from what homes pay is asked about once before it is saved (a typo of 100×
        would turn every day into a loss)."""
        price = changes.get("electricity_price_per_kwh")
        if price is None or price == self._price_asked or price == self.settings.electricity_price_per_kwh:
            return None
        question = price_doubt(price, changes["currency"])
        self._price_asked = price if question is not None else None
        return question

    def _show_error(self, problems: list[str]) -> None:
        self.error.setText("Nothing was saved yet:\n• " + "\n• ".join(problems))
        self.error.show()


class MemoryShare(QWidget):
    """Per GPU, how much of its memory an engine may use: a slider whose words say, before saving,
    what that leaves for the desktop and what the engine could then hold (the planner's preview)."""

    def __init__(self, bridge: Bridge, shares: tuple[tuple[int, int], ...], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._bridge = bridge
        self._shares = dict(shares)
        self.sliders: dict[int, QSlider] = {}
        self.words: dict[int, QLabel] = {}
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        gpus = () if bridge.latest.detecting else bridge.latest.gpus
        if not gpus:
            layout.addWidget(_note("This computer serves on its CPU: there is no graphics memory to set aside."
                                   if not bridge.latest.detecting else FINDING_GPUS))
        for gpu in gpus:
            layout.addWidget(self._row(gpu))

    def _row(self, gpu: GpuSnapshot) -> QWidget:
        row = QWidget()
        column = QVBoxLayout(row)
        column.setContentsMargins(0, 0, 0, 6)
        title = QLabel(f"Memory of GPU {gpu.index} ({gpu.name}) to lend")
        column.addWidget(title)
        line = QHBoxLayout()
        slider = QSlider(Qt.Orientation.Horizontal)
        slider.setRange(10, 100)
        slider.setSingleStep(5)
        slider.setPageStep(10)
        slider.setValue(self._shares.get(gpu.index, 100))
        slider.setAccessibleName(f"Memory of GPU {gpu.index} to lend, in percent")
        percent = QLabel()
        percent.setMinimumWidth(percent.fontMetrics().horizontalAdvance("100 %") + 4)
        line.addWidget(slider, 1)
        line.addWidget(percent)
        column.addLayout(line)
        words = _note("")
        column.addWidget(words)
        self.sliders[gpu.index] = slider
        self.words[gpu.index] = words

        def show(pct: int) -> None:
            percent.setText(f"{pct} %")
            words.setText(self._bridge.preview_share(gpu.index, pct))
            slider.setAccessibleDescription(words.text())

        slider.valueChanged.connect(show)
        show(slider.value())
        return row

    def shares(self) -> tuple[tuple[int, int], ...]:
        """(GPU, %) for each card lent less than all of its memory (a card not shown keeps its share)."""
        chosen = {**self._shares, **{i: s.value() for i, s in self.sliders.items()}}
        return tuple(sorted((i, pct) for i, pct in chosen.items() if pct < 100))


def _optional_spin(box: SpinBox, low: float, high: float, value: float | None, off: str) -> SpinBox:
    """A spin box (arrows shown) whose lowest step means "no limit": its minimum sits one step below `low`."""
    box.setButtonSymbols(QAbstractSpinBox.ButtonSymbols.UpDownArrows)
    box.setSpecialValueText(off)
    if isinstance(box, QSpinBox):
        box.setRange(int(low) - 1, int(high))
        box.setValue(round(value) if value is not None else box.minimum())
    else:
        box.setRange(low - 0.1, high)
        box.setValue(value if value is not None else box.minimum())
    return box


def _spin_value(box: QSpinBox | QDoubleSpinBox) -> float | None:
    """The box's value, None at its "no limit" step."""
    return None if box.value() == box.minimum() else float(box.value())


def _spin_int(box: QSpinBox) -> int | None:
    value = _spin_value(box)
    return None if value is None else int(value)


def _note(text: str) -> QLabel:
    label = QLabel(text)
    label.setObjectName("muted")
    label.setWordWrap(True)
    return label


def _scrolled(*groups: QWidget) -> QScrollArea:
    """A tab's groups in a scroll area: the dialog fits a 768-pixel screen at any font size."""
    page = QWidget()
    page.setObjectName("content")
    column = QVBoxLayout(page)
    for group in groups:
        column.addWidget(group)
    column.addStretch(1)
    scroll = QScrollArea()
    scroll.setWidgetResizable(True)
    scroll.setFrameShape(QFrame.Shape.NoFrame)
    scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    scroll.setWidget(page)
    return scroll


def _with_current(choices: tuple[Network, ...], current: Network) -> tuple[Network, ...]:
    """The networks offered, plus the one in use when it is none of them (a URL given by hand)."""
    return choices if current in choices else (*choices, current)


def _group(title: str) -> tuple[QGroupBox, QFormLayout]:
    group = QGroupBox(title)
    form = QFormLayout(group)
    return group, form
