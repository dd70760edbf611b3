"""Run by tests/app/test_quit.py in its own process: the desktop app with a tray (reported as
available) and the dashboard open, on a new install (so the first-run flow is open over it too),
then a quit request of the kind named in argv[1]. Prints `quit-returned` once Qt's loop has
ended; a quit that only hides the window, or waits for the flow, never prints it."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QSystemTrayIcon

import app.main
from tests.app import snapshots
from tests.app.scripted_node import ScriptedNode
from worker.system.config import Paths, Settings


def main() -> None:
    how, data = sys.argv[1], Path(sys.argv[2])
    QSystemTrayIcon.isSystemTrayAvailable = staticmethod(lambda: True)  # type: ignore[method-assign]
    qapp = QApplication(["gpu-provider"])
    node = ScriptedNode(snapshots.serving())
    args = argparse.Namespace(minimized=False, quit_after=None, coordinator="local")
    created: list[app.main.DesktopApp] = []
    original = app.main.DesktopApp

    def remember(*a: object, **k: object) -> app.main.DesktopApp:
        desktop = original(*a, **k)  # type: ignore[arg-type]
        created.append(desktop)
        return desktop

    app.main.DesktopApp = remember  # type: ignore[assignment,misc]

    def request() -> None:
        assert created and created[0].dashboard.isVisible(), "the dashboard should be open"
        flow = created[0].first_run
        assert flow is not None and flow.isVisible(), "a new install should show the first-run flow"
        if how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            assert created[0].tray is not None
            created[0].tray.quit_requested.emit()

    QTimer.singleShot(500, request)
    code = app.main.run_app(qapp, node, Paths.under(data), Settings(), args)
    print("quit-returned", code, ("run_ended", None) in node.commands, flush=True)


if __name__ == "__main__":
    main()
