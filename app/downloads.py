"""The Downloads card, as Steam's: what is fetched, percent, speed and time left, why it waits
(your pause, a game, the monthly limit), and Pause, Resume and Cancel.

The words come from the core's headline module (`download_detail`, `held_words`), so the card
and the headline above it say the same thing.
"""

from __future__ import annotations

from PySide6.QtWidgets import QFrame, QHBoxLayout, QProgressBar, QPushButton, QVBoxLayout, QWidget

from app.bridge import Bridge
from app.widgets import Values, card, sync_rows
from worker.contract.events import DownloadProgress
from worker.node.headline import download_detail, held_words


def download_title(d: DownloadProgress) -> str:
    """ "Model Qwen/Qwen3-8B · 42 %": what, and how far."""
    what = d.what[:1].upper() + d.what[1:]
    return what if d.fraction is None else f"{what} · {d.fraction * 100:.0f} %"


def download_line(d: DownloadProgress) -> str:
    """The line under the title: the failure, why it waits, or size, speed and time left."""
    if d.error:
        return f"Failed: {d.error}"
    if d.held is not None:
        words = held_words(d)
        return f"Waiting: {words[:1].lower()}{words[1:]}"
    return download_detail(d) or "Starting…"


class DownloadRow(QWidget):
    def __init__(self, values: Values, bridge: Bridge, d: DownloadProgress) -> None:
        super().__init__()
        self.key = f"download:{d.what}"
        self._values = values
        self._bridge = bridge
        column = QVBoxLayout(self)
        column.setContentsMargins(0, 0, 0, 0)
        column.addWidget(values.label(f"{self.key}.title", "rowTitle", wrap=True))
        self.bar = QProgressBar()
        self.bar.setTextVisible(False)
        self.bar.setAccessibleName(f"Download of {d.what}")
        column.addWidget(self.bar)
        row = QHBoxLayout()
        row.addWidget(values.label(self.key, "muted", wrap=True), 1)
        self.pause_button = QPushButton("Pause")
        self.pause_button.clicked.connect(self._pause_or_resume)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setAccessibleName("Cancel the download")
        self.cancel_button.clicked.connect(bridge.cancel_download)
        row.addWidget(self.pause_button)
        row.addWidget(self.cancel_button)
        column.addLayout(row)
        self._held_by_you = False

    def show_download(self, d: DownloadProgress) -> None:
        self._values.set(f"{self.key}.title", download_title(d))
        self._values.set(self.key, download_line(d))
        self.bar.setRange(0, 0 if d.fraction is None else 1000)
        self.bar.setValue(int((d.fraction or 0) * 1000))
        self._held_by_you = d.held == "paused_by_you"
        self.pause_button.setText("Resume" if self._held_by_you else "Pause")
        self.pause_button.setAccessibleName("Resume the download" if self._held_by_you else "Pause the download")
        for button in (self.pause_button, self.cancel_button):
            button.setVisible(not d.error)

    def _pause_or_resume(self) -> None:
        if self._held_by_you:
            self._bridge.resume_download()
        else:
            self._bridge.pause_download()


class DownloadsCard:
    """Builds the card (`frame`, hidden while nothing downloads) with one row per download."""

    def __init__(self, values: Values, bridge: Bridge) -> None:
        self._values = values
        self._bridge = bridge
        self.frame: QFrame
        self.frame, self._layout = card("Downloads")
        self.rows: dict[str, DownloadRow] = {}

    def show(self, downloads: tuple[DownloadProgress, ...]) -> None:
        active = {d.what: d for d in downloads if not d.finished or d.error}
        self.frame.setVisible(bool(active))
        sync_rows(self.rows, active, lambda d: DownloadRow(self._values, self._bridge, d), self._layout,
                  lambda row, d: row.show_download(d))

