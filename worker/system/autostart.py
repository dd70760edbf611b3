"""Start at login, opt-in: an XDG autostart entry, a LaunchAgent, or a `Run` registry value.

Only `apply_setting` decides when to write: it acts on a change of the setting, never on its
own, so an entry the user removed by hand stays removed until they turn the setting on again.
`refresh` only corrects an entry that is there and starts something else. The entry names the
packaged executable, never an updated version's folder (`packaged_executable`).
"""

from __future__ import annotations

import importlib
import os
import plistlib
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

APP_ID = "gpu-provider"
LAUNCH_AGENT_LABEL = "net.gpu-provider.app"
RUN_KEY = r"Software\Microsoft\Windows\CurrentVersion\Run"
# The packaged executable a self-updated version was started by (set by worker.update.install at
# the hand-over): what start-at-login must run, since versions/<v> is pruned two updates later.
LAUNCHER_ENV = "GPU_PROVIDER_LAUNCHER"
# Where Gatekeeper runs a quarantined app from a read-only random mount (App Translocation).
TRANSLOCATION_FOLDER = "/AppTranslocation/"


def default_command(data_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """The command that starts the app minimised to the tray, on the data folder it runs on now
    (`--data-dir`, absolute, when it is not the default one)."""
    base = [packaged_executable()] if getattr(sys, "frozen", False) else [sys.executable, "-m", "app"]
    folder = ["--data-dir", str(Path(data_dir).expanduser().resolve())] if data_dir else []
    return [*base, *folder, "--minimized"]


def packaged_executable() -> str:
    """The installed build's executable: the launcher that handed over to this updated version
    when there is one (it starts the newest version itself), else this executable."""
    launcher = os.environ.get(LAUNCHER_ENV, "")
    return launcher if launcher and Path(launcher).is_file() else sys.executable


def default_icon() -> str:
    """The entry's icon: the theme name the installed package registers, or the checkout's file."""
    if getattr(sys, "frozen", False):
        return APP_ID  # /usr/share/icons/hicolor/…/apps/gpu-provider.png (installer/linux)
    return str(Path(__file__).resolve().parents[2] / "assets" / "icon.png")


class AutostartRefused(OSError):
    """Start at login cannot be written as asked; the message says what the person should do."""


TRANSLOCATED = (
    "GPU Provider is running from the disk image or the Downloads folder it came in, a place macOS "
    "removes after a restart. Move GPU Provider to the Applications folder, open it from there, "
    "then turn on start at login."
)


class Autostart(Protocol):
    def enable(self) -> None: ...

    def disable(self) -> None: ...

    def is_enabled(self) -> bool: ...

    def is_current(self) -> bool:
        """The entry there now starts what `enable` would write (False when there is none)."""
        ...


class XdgAutostart:
    """`~/.config/autostart/gpu-provider.desktop` (freedesktop autostart spec)."""

    def __init__(self, command: Sequence[str], config_home: Path | None = None, icon: str | None = None) -> None:
        home = config_home or Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
        self.path = home / "autostart" / f"{APP_ID}.desktop"
        self._command = list(command)
        self._icon = icon or default_icon()

    def entry(self) -> str:
        return (
            "[Desktop Entry]\n"
            "Type=Application\n"
            "Name=GPU Provider\n"
            "Comment=Lend this computer's GPU to the inference network\n"
            f"Exec={shlex.join(self._command)}\n"
            f"Icon={self._icon}\n"
            "Terminal=false\n"
            "X-GNOME-Autostart-enabled=true\n"
        )

    def enable(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(self.entry(), encoding="utf-8")

    def disable(self) -> None:
        self.path.unlink(missing_ok=True)

    def is_enabled(self) -> bool:
        return self.path.is_file()

    def is_current(self) -> bool:
        return _reads(self.path) == self.entry().encode()


class LaunchAgent:
    """`~/Library/LaunchAgents/<label>.plist`, loaded by launchd at the next login."""

    def __init__(self, command: Sequence[str], agents_dir: Path | None = None) -> None:
        folder = agents_dir or Path.home() / "Library" / "LaunchAgents"
        self.path = folder / f"{LAUNCH_AGENT_LABEL}.plist"
        self._command = list(command)

    def plist(self) -> dict[str, object]:
        """The keys of the shipped template (installer/macos): started once at login, in the
        user's graphical session only, scheduled as an app the person uses rather than a daemon."""
        return {
            "Label": LAUNCH_AGENT_LABEL,
            "ProgramArguments": self._command,
            "RunAtLoad": True,
            "KeepAlive": False,
            "ProcessType": "Interactive",
            "LimitLoadToSessionType": "Aqua",
        }

    def enable(self) -> None:
        """Refused for an app macOS translocated: its path is gone after a restart."""
        if any(TRANSLOCATION_FOLDER in part for part in self._command):
            raise AutostartRefused(TRANSLOCATED)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_bytes(plistlib.dumps(self.plist()))

    def disable(self) -> None:
        self.path.unlink(missing_ok=True)

    def is_enabled(self) -> bool:
        return self.path.is_file()

    def is_current(self) -> bool:
        return _reads(self.path) == plistlib.dumps(self.plist())


class Registry(Protocol):
    """The three `Run`-key operations, so the Windows backend is tested anywhere."""

    def set_value(self, name: str, value: str) -> None: ...

    def delete_value(self, name: str) -> None: ...

    def get_value(self, name: str) -> str | None: ...


def _winreg() -> Any:
    """winreg exists on Windows only; imported on use so the module loads everywhere."""
    return importlib.import_module("winreg")


class WinregRunKey:
    """`HKCU\\Software\\Microsoft\\Windows\\CurrentVersion\\Run` through winreg."""

    def set_value(self, name: str, value: str) -> None:
        winreg = _winreg()
        with winreg.CreateKey(winreg.HKEY_CURRENT_USER, RUN_KEY) as key:
            winreg.SetValueEx(key, name, 0, winreg.REG_SZ, value)

    def delete_value(self, name: str) -> None:
        winreg = _winreg()
        try:
            with winreg.OpenKey(winreg.HKEY_CURRENT_USER, RUN_KEY, 0, winreg.KEY_SET_VALUE) as key:
                winreg.DeleteValue(key, name)
        except FileNotFoundError:
            return

    def get_value(self, name: str) -> str | None:
        winreg = _winreg()
        try:
            with winreg.OpenKey(winreg.HKEY_CURRENT_USER, RUN_KEY) as key:
                value, _kind = winreg.QueryValueEx(key, name)
        except FileNotFoundError:
            return None
        return str(value)


class WindowsRunValue:
    """A `Run` value named after the app whose data is the quoted command line."""

    def __init__(self, command: Sequence[str], registry: Registry | None = None) -> None:
        self._command = list(command)
        self._registry = registry or WinregRunKey()

    def value(self) -> str:
        return subprocess.list2cmdline(self._command)

    def enable(self) -> None:
        self._registry.set_value(APP_ID, self.value())

    def disable(self) -> None:
        self._registry.delete_value(APP_ID)

    def is_enabled(self) -> bool:
        return self._registry.get_value(APP_ID) is not None

    def is_current(self) -> bool:
        return self._registry.get_value(APP_ID) == self.value()


def for_platform(command: Sequence[str] | None = None, platform: str = sys.platform,
                 data_dir: str | os.PathLike[str] | None = None) -> Autostart:
    cmd = list(command) if command is not None else default_command(data_dir)
    if platform == "win32":
        return WindowsRunValue(cmd)
    if platform == "darwin":
        return LaunchAgent(cmd)
    return XdgAutostart(cmd)


def apply_setting(backend: Autostart, *, was_on: bool, now_on: bool) -> None:
    """Write or remove the entry only when the setting changed; otherwise leave the user's choice."""
    if now_on and not was_on:
        backend.enable()
    elif was_on and not now_on:
        backend.disable()


def refresh(backend: Autostart) -> bool:
    """At start, with the setting on: rewrite an entry that starts something else (one an older
    version pointed into versions/<v>, pruned since); True if rewritten. A removed entry stays
    removed (`apply_setting`)."""
    if not backend.is_enabled() or backend.is_current():
        return False
    backend.enable()
    return True


def _reads(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
