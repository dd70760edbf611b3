"""The "Your GPUs" card: each GPU's memory and live readings, and how the plan uses them together
("2 GPUs working as one"), or that this computer serves on its CPU."""

from __future__ import annotations

from PySide6.QtWidgets import QFrame, QGridLayout, QProgressBar, QVBoxLayout, QWidget

from app.format import gib, groups_words, number
from app.widgets import Values, card, sync_rows
from worker.contract.events import GpuSnapshot, NodeSnapshot


class GpuRow(QWidget):
    def __init__(self, values: Values, gpu: GpuSnapshot) -> None:
        super().__init__()
        self.key = f"gpu{gpu.index}"
        grid = QGridLayout(self)
        grid.setContentsMargins(0, 4, 0, 4)
        grid.setHorizontalSpacing(18)
        grid.addWidget(values.label(f"{self.key}.name", "rowTitle", wrap=True), 0, 0)
        grid.addWidget(values.label(f"{self.key}.memory", "muted", wrap=True), 1, 0)
        self.memory_bar = QProgressBar()
        self.memory_bar.setTextVisible(False)
        grid.addWidget(self.memory_bar, 2, 0)
        grid.addWidget(values.label(f"{self.key}.live", "caption", wrap=True), 3, 0)
        self._values = values

    def show_gpu(self, gpu: GpuSnapshot) -> None:
        lent = "" if gpu.lent else "  (not lent)"
        self._values.set(f"{self.key}.name", f"GPU {gpu.index} · {gpu.name}{lent}")
        used = "" if gpu.memory_used_mib is None else f"{gib(gpu.memory_used_mib)} used · "
        self._values.set(
            f"{self.key}.memory", f"{used}{gib(gpu.memory_usable_mib)} usable of {gib(gpu.memory_total_mib)}"
        )
        self.memory_bar.setRange(0, max(1, gpu.memory_total_mib))
        self.memory_bar.setValue(gpu.memory_used_mib or 0)
        power = number(gpu.power_w, "W")
        if gpu.power_limit_w is not None and gpu.power_w is not None:
            power += f" of {gpu.power_limit_w:,.0f} W"
        self._values.set(
            f"{self.key}.live",
            f"Busy {number(gpu.util_pct, '%')}   ·   {number(gpu.temperature_c, '°C')}   ·   {power}",
        )


class GpuPanel:
    """Builds the card (`frame`) and keeps one row per GPU, updated in place."""

    def __init__(self, values: Values) -> None:
        self._values = values
        self.frame: QFrame
        self.frame, layout = card("Your GPUs")
        layout.addWidget(values.label("groups", "muted", wrap=True))
        layout.addWidget(values.label("no_gpus", "muted", wrap=True))
        self._rows_layout = QVBoxLayout()
        layout.addLayout(self._rows_layout)
        layout.addStretch(1)
        self.rows: dict[int, GpuRow] = {}

    def show(self, snapshot: NodeSnapshot) -> None:
        no_gpus = self._values.labels["no_gpus"]
        no_gpus.setVisible(snapshot.detecting or not snapshot.gpus)
        no_gpus.setText(
            "Looking for your GPUs…" if snapshot.detecting else "No GPU found: this computer serves on its CPU."
        )
        together = groups_words(snapshot.groups)
        self._values.set(
            "groups", f"{together} · {gib(snapshot.effective_vram_mib)} for models" if together else ""
        )
        self._values.labels["groups"].setVisible(bool(together))
        sync_rows(
            self.rows,
            {g.index: g for g in snapshot.gpus},
            lambda g: GpuRow(self._values, g),
            self._rows_layout,
            lambda row, g: row.show_gpu(g),
        )
