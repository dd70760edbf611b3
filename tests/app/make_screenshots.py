"""Render the dashboard and the tray menu in each main state (the GPUs and engines as the real
planner lays them out for a recorded machine: tests/app/snapshots.py), the window as it first opens
on a 1366×768 screen at the system font and at 150 % of it, each page of the first-run flow and the
Settings tabs, in light and dark, into docs/screenshots/, offscreen, and the tray icons into
assets/tray/. Run: `.venv/bin/python -m tests.app.make_screenshots`."""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QEvent, QPoint, QRect, QSize, Qt
from PySide6.QtGui import QColor, QFont, QPainter, QPixmap
from PySide6.QtWidgets import QApplication

from app import theme
from app.bridge import Bridge
from app.dashboard import Dashboard, default_size
from app.first_run import GPUS, HABITS, NETWORK, PRICE, SIGN_IN, FirstRunFlow
from app.format import STATE_COLOURS, tray_state
from app.icons import state_pixmap
from app.settings import SettingsDialog
from app.tray import Tray
from tests.app import snapshots
from tests.app.scripted_node import ScriptedNode
from worker.system import autostart
from worker.system.config import Paths, Settings
from worker.contract.events import NodeSnapshot

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "docs" / "screenshots"
ICONS = ROOT / "assets" / "tray"
WIDTH = 1366  # a laptop's screen: the dashboard's whole length at this width
SCREEN = QSize(1366, 768 - 40)  # less the taskbar: the window's first size follows it
FIT_STATES = ("serving", "failed", "downloading", "setup")


def history(snapshot: NodeSnapshot, now: float) -> dict[str, list[tuple[float, float]]]:
    """Ten plausible minutes for the charts (serving states only; idle states have none)."""
    if tray_state(snapshot) not in ("serving", "degraded"):
        return {}
    times = [now - 600 + 5 * i for i in range(121)]
    wave = [math.sin(i / 7) + 0.4 * math.sin(i / 2.3) for i in range(121)]

    def series(base: float, swing: float) -> list[tuple[float, float]]:
        return [(t, base + swing * w) for t, w in zip(times, wave, strict=True)]

    points = {"tokens_per_s": series(780, 60), "kv_usage": series(36, 9)}
    for gpu in snapshot.gpus:
        points[f"gpu{gpu.index}.util_pct"] = series(84 - 3 * gpu.index, 6)
        points[f"gpu{gpu.index}.power_w"] = series(335 - 35 * gpu.index, 25)
        points[f"gpu{gpu.index}.temperature_c"] = series(66 + 5 * gpu.index, 2)
    return points


def dashboard_shot(snapshot: NodeSnapshot, target: Path, *, whole: bool = True) -> None:
    """The dashboard's whole length at WIDTH, or (`whole` False) the window as it first opens on SCREEN."""
    import time

    node = ScriptedNode(snapshot)
    node.history_points = history(snapshot, time.time())
    window = Dashboard(Bridge(node))
    window.resize(QSize(WIDTH, 900) if whole else default_size(SCREEN))
    window.show()
    for _ in range(3):  # wrapped labels settle their heights over a few passes
        QApplication.processEvents()
    (window.content if whole else window).grab().save(str(target))
    window.charts.timer.stop()
    window.deleteLater()


def tray_shot(snapshot: NodeSnapshot, target: Path) -> None:
    """The menu as it opens under the tray icon, drawn on a neutral panel strip."""
    tray = Tray(Bridge(ScriptedNode(snapshot)))
    tray.menu.aboutToShow.emit()
    tray.menu.adjustSize()
    menu = tray.menu.grab()
    pad, strip = 16, 36
    canvas = QPixmap(menu.width() + 2 * pad, menu.height() + strip + 2 * pad)
    canvas.fill(QColor("#E9ECF1"))
    painter = QPainter(canvas)
    painter.fillRect(QRect(0, 0, canvas.width(), strip), QColor("#1F2430"))
    painter.drawPixmap(QPoint(pad, (strip - 22) // 2), state_pixmap(tray_state(snapshot), 22))
    painter.setPen(QColor(STATE_COLOURS[tray_state(snapshot)]))
    font = QFont()
    font.setPointSize(9)
    font.setBold(True)
    painter.setFont(font)
    painter.drawText(QRect(pad + 30, 0, canvas.width(), strip), Qt.AlignmentFlag.AlignVCenter, tray_state(snapshot))
    painter.drawPixmap(QPoint(pad, strip + pad // 2), menu)
    painter.end()
    canvas.save(str(target))


FIRST_RUN_PAGES = ((NETWORK, "1-network"), (SIGN_IN, "2-sign-in"), (PRICE, "3-price"), (GPUS, "4-gpus"),
                   (HABITS, "5-habits"))


def first_run_shots(suffix: str) -> None:
    """Each page of the first-run flow on a new install with two GPUs, as the person meets it."""
    folder = Path(tempfile.mkdtemp(prefix="gpu-provider-shot-"))
    bridge = Bridge(ScriptedNode(snapshots.idle()))
    for page_id, name in FIRST_RUN_PAGES:
        flow = FirstRunFlow(Settings(), bridge, autostart.for_platform(data_dir=str(folder)))
        flow.setStartId(page_id)
        flow.restart()
        flow.resize(620, 480)
        flow.show()
        for _ in range(3):
            QApplication.processEvents()
        flow.grab().save(str(SCREENSHOTS / f"first-run-{name}{suffix}.png"))
        flow.deleteLater()


def settings_shots(suffix: str) -> None:
    """Each Settings tab over the recorded two-card machine (the memory slider's preview included)."""
    folder = Path(tempfile.mkdtemp(prefix="gpu-provider-shot-"))
    bridge = Bridge(ScriptedNode(snapshots.serving()))
    dialog = SettingsDialog(Settings(setup_complete=True, memory_share_pct=((1, 80),), max_requests=8,
                                     temperature_limit_c=83, monthly_download_gib=200),
                            Paths.under(folder), bridge, autostart.for_platform(data_dir=str(folder)))
    dialog.resize(640, 700)
    dialog.show()
    for index, name in enumerate(("general", "limits")):
        dialog.tabs.setCurrentIndex(index)
        for _ in range(3):
            QApplication.processEvents()
        dialog.grab().save(str(SCREENSHOTS / f"settings-{name}{suffix}.png"))
    dialog.deleteLater()


def at_font_scale(app: QApplication, scale: float, scheme: theme.Scheme) -> QFont:
    """The app font at `scale` times its size (theme re-installed to follow); returns the old font."""
    before = QFont(app.font())
    bigger = QFont(before)
    bigger.setPointSizeF(theme.base_point_size(app) * scale)
    app.setFont(bigger)
    theme.install(app, scheme)
    return before


def main() -> int:
    app = QApplication.instance() or QApplication(sys.argv[:1])
    assert isinstance(app, QApplication)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    ICONS.mkdir(parents=True, exist_ok=True)
    for scheme in ("light", "dark"):
        QApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete.value)  # last scheme's windows go first
        theme.install(app, scheme)
        suffix = "" if scheme == "light" else "-dark"
        for name, make in snapshots.MAIN_STATES.items():
            dashboard_shot(make(), SCREENSHOTS / f"dashboard-{name}{suffix}.png")
            tray_shot(make(), SCREENSHOTS / f"tray-{name}{suffix}.png")
        for name in FIT_STATES:
            dashboard_shot(snapshots.MAIN_STATES[name](), SCREENSHOTS / f"window-1366x768-{name}{suffix}.png",
                           whole=False)
        first_run_shots(suffix)
        settings_shots(suffix)
        before = at_font_scale(app, 1.5, scheme)
        for name in FIT_STATES:
            dashboard_shot(snapshots.MAIN_STATES[name](), SCREENSHOTS / f"window-1366x768-150-{name}{suffix}.png",
                           whole=False)
        app.setFont(before)
    for state in STATE_COLOURS:
        state_pixmap(state, 64).save(str(ICONS / f"{state}.png"))
    print(f"wrote screenshots to {SCREENSHOTS} and icons to {ICONS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
