"""`gpu-provider` (and `python -m app`, and the frozen executable): the desktop app when the
command line asks for it and it can open here, the core's command line otherwise.

The core (`worker/`) never imports the GUI, so the choice is made here, outside it. The app
opens when PySide6 is installed and there is a display; anywhere else (a server, an SSH
session, an install without the `gui` extra) `worker.node.cli.main` runs, and says what to do.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Mapping, Sequence

from worker.node import cli

GUI_MODULES = ("PySide6", "pyqtgraph")  # the `gui` extra
DISPLAY_VARIABLES = ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")
ALWAYS_A_DISPLAY = frozenset({"win32", "darwin"})  # a logged-in user's session has one


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    desktop = cli.desktop_arguments(arguments)
    if desktop is not None and can_open_the_app():
        from app.main import main as app_main  # Qt is imported only now

        return int(app_main(desktop) or 0)
    return cli.main(arguments)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def can_open_the_app(platform: str = sys.platform, environ: Mapping[str, str] = os.environ,
                     is_installed: Callable[[str], bool] = installed) -> bool:
    """PySide6 is installed and there is a display to open a window on."""
    return all(is_installed(name) for name in GUI_MODULES) and has_display(platform, environ)


def has_display(platform: str, environ: Mapping[str, str]) -> bool:
    """Windows and macOS: always. Elsewhere X11 or Wayland says where, or QT_QPA_PLATFORM names a
    Qt platform on purpose (offscreen, vnc, …)."""
    return platform in ALWAYS_A_DISPLAY or any(environ.get(name) for name in DISPLAY_VARIABLES)
