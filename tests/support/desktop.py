"""A real X desktop for tests: Xvfb, a window manager (openbox) and an XEmbed system tray host
(trayer), plus the X tools that look at it and act on it as a person would (xwininfo, xprop,
xdotool). Offscreen Qt has no tray, so only this shows what a tray icon, its menu and a window
really do. Every wait is bounded; `explain()` says what X shows when one runs out.

Debian packages: xvfb openbox trayer xdotool x11-utils (`.ci/run` installs them).
"""

from __future__ import annotations

import os
import re
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

TOOLS = {"Xvfb": "xvfb", "openbox": "openbox", "trayer": "trayer", "xdotool": "xdotool",
         "xwininfo": "x11-utils", "xprop": "x11-utils"}
STEP_TIMEOUT_S = 10.0  # one X tool call, or one part of the desktop coming up
SCREEN = "1280x800x24"
_TREE_LINE = re.compile(r'^(?P<indent>\s*)(?P<id>0x[0-9a-f]+) (?P<name>"[^"]*"|\(has no name\)): '
                        r'\((?P<cls>[^)]*)\)\s+(?P<w>\d+)x(?P<h>\d+)')
_TRAY_PROBE = ("from PySide6.QtWidgets import QApplication, QSystemTrayIcon; app = QApplication([]); "
               "print(QSystemTrayIcon.isSystemTrayAvailable())")


class DesktopMissing(RuntimeError):
    """The X tools are not installed: the test must fail (CI installs them), never skip."""


@dataclass(frozen=True)
class Window:
    id: str  # "0x600007", as the X tools print and take it
    name: str
    width: int
    height: int
    depth: int  # nesting below the root (0: a child of the root)


def missing_packages() -> list[str]:
    """The Debian packages whose tools are not on PATH."""
    return sorted({package for tool, package in TOOLS.items() if shutil.which(tool) is None})


def parse_tree(text: str) -> list[Window]:
    """The windows of `xwininfo -root -tree` (or `-tree -id`), in order, with their depth."""
    lines = [m for m in map(_TREE_LINE.match, text.splitlines()) if m is not None]
    if not lines:
        return []
    base = min(len(m["indent"]) for m in lines)
    return [Window(m["id"], m["name"].strip('"') if m["name"].startswith('"') else "", int(m["w"]), int(m["h"]),
                   (len(m["indent"]) - base) // 3) for m in lines]


def wait_until(check: Callable[[], T | None], what: str, timeout_s: float = STEP_TIMEOUT_S,
               every_s: float = 0.1) -> T:
    """`check()`'s first truthy value; AssertionError naming `what` once `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


class Desktop:
    """One X display with a window manager and a tray host; the tools run against it."""

    def __init__(self, display: str, folder: Path) -> None:
        self.display = display
        self.folder = folder
        self.processes: list[subprocess.Popen[bytes]] = []

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """An environment for programs on this display: X11 Qt, and no session bus, so Qt's tray
        is the XEmbed one the tray host shows (a bus address that fails at once, so nothing is
        auto-launched), and no Wayland."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if k != "WAYLAND_DISPLAY"}
        env.update(DISPLAY=self.display, QT_QPA_PLATFORM="xcb",
                   DBUS_SESSION_BUS_ADDRESS=f"unix:path={self.folder / 'no-session-bus'}",
                   XDG_CONFIG_HOME=str(self.folder / "config"), XDG_RUNTIME_DIR=str(self.folder))
        return env

    def x(self, *argv: str) -> str:
        """Run an X tool on this display; its output (CalledProcessError/TimeoutExpired if it fails)."""
        return subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=STEP_TIMEOUT_S,
                              check=True).stdout

    def start(self, argv: list[str], log_name: str) -> subprocess.Popen[bytes]:
        with open(self.folder / log_name, "wb") as log:
            process = subprocess.Popen(argv, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL)
        self.processes.append(process)
        return process

    # --- looking ----------------------------------------------------------------------------

    def tree(self) -> str:
        return self.x("xwininfo", "-root", "-tree")

    def windows(self) -> list[Window]:
        return parse_tree(self.tree())

    def viewable(self, window: Window) -> bool:
        try:
            return "Map State: IsViewable" in self.x("xwininfo", "-id", window.id)
        except subprocess.CalledProcessError:  # gone meanwhile
            return False

    def window_type(self, window: Window) -> str | None:
        """Its preferred _NET_WM_WINDOW_TYPE without the prefix ("NORMAL", "POPUP_MENU"), if any."""
        try:
            line = self.x("xprop", "-id", window.id, "_NET_WM_WINDOW_TYPE")
        except subprocess.CalledProcessError:  # gone meanwhile
            return None
        found = re.search(r"= _NET_WM_WINDOW_TYPE_(\w+)", line)
        return found[1] if found else None

    def shown(self, name: str, window_type: str, min_size: tuple[int, int] = (1, 1)) -> Window | None:
        """A viewable window called `name` of that type, at least `min_size` (width, height)."""
        for window in self.windows():
            if (window.name == name and window.width >= min_size[0] and window.height >= min_size[1]
                    and self.window_type(window) == window_type and self.viewable(window)):
                return window
        return None

    def docked_icon(self, name: str) -> Window | None:
        """The tray icon window called `name`, embedded in the tray host's panel and viewable."""
        panels = [w for w in self.windows() if w.name == "panel"]
        for panel in panels:
            for window in parse_tree(self.x("xwininfo", "-tree", "-id", panel.id)):
                if window.name == name and window.depth > 0 and self.viewable(window):
                    return window
        return None

    def tray_available(self) -> bool:
        """What Qt itself says, in a process of its own on this display."""
        probe = subprocess.run([sys.executable, "-c", _TRAY_PROBE], env=self.env(), capture_output=True, text=True,
                               timeout=STEP_TIMEOUT_S, check=False)
        return probe.stdout.strip() == "True"

    # --- acting -----------------------------------------------------------------------------

    def click(self, window: Window, button: int) -> None:
        """Click the middle of the window (button 1 left, 3 right)."""
        self.click_at(window, window.width // 2, window.height // 2, button)

    def click_at(self, window: Window, x: int, y: int, button: int = 1) -> None:
        """Move the pointer to (x, y) inside the window and click there."""
        self.x("xdotool", "mousemove", "--window", window.id, str(x), str(y), "click", str(button))

    def close(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
            try:
                process.wait(STEP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STEP_TIMEOUT_S)


def _start_server(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Xvfb on the first free display number, which it writes to a pipe once it accepts clients."""
    read_end, write_end = os.pipe()
    with open(folder / "xvfb.log", "wb") as log:
        server = subprocess.Popen(["Xvfb", "-screen", "0", SCREEN, "-nolisten", "tcp", "-displayfd", str(write_end)],
                                  pass_fds=(write_end,), stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL)
    os.close(write_end)
    try:
        number = _read_line(read_end, STEP_TIMEOUT_S)  # to its newline: closed earlier, Xvfb dies (EPIPE)
    finally:
        os.close(read_end)
    if not number:
        server.kill()
        server.wait(STEP_TIMEOUT_S)
        raise AssertionError(f"Xvfb did not start: {(folder / 'xvfb.log').read_text(errors='replace')[-1000:]}")
    return server, f":{number}"


def _read_line(descriptor: int, timeout_s: float) -> str:
    """Bytes up to a newline (or end of file, or the timeout), stripped."""
    deadline, data = time.monotonic() + timeout_s, b""
    while not data.endswith(b"\n"):
        ready, _, _ = select.select([descriptor], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(descriptor, 64) if ready else b""
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


@contextmanager
def real_desktop(folder: Path) -> Iterator[Desktop]:
    """Xvfb, openbox and trayer, up and ready (Qt sees a system tray); all stopped on exit."""
    missing = missing_packages()
    if missing:
        raise DesktopMissing("the real-desktop test needs the X tools from these Debian packages: "
                             f"{' '.join(missing)} (apt-get install {' '.join(missing)}; .ci/run does)")
    folder.mkdir(parents=True, exist_ok=True)
    server, display = _start_server(folder)
    desktop = Desktop(display, folder)
    desktop.processes.append(server)
    try:
        desktop.start(["openbox", "--sm-disable"], "openbox.log")
        wait_until(lambda: "_NET_SUPPORTING_WM_CHECK(WINDOW)" in desktop.x("xprop", "-root"),
                   "the window manager (openbox)")
        desktop.start(["trayer", "--edge", "top", "--align", "right", "--widthtype", "request", "--height", "24",
                       "--SetDockType", "true", "--transparent", "false"], "trayer.log")
        wait_until(desktop.tray_available, "Qt to see a system tray (trayer)", every_s=0.3)
        yield desktop
    finally:
        desktop.close()
