from __future__ import annotations

import plistlib
import sys
import types
from pathlib import Path

import pytest

from worker.system.autostart import (
    APP_ID,
    LAUNCH_AGENT_LABEL,
    LAUNCHER_ENV,
    RUN_KEY,
    AutostartRefused,
    LaunchAgent,
    WindowsRunValue,
    XdgAutostart,
    apply_setting,
    default_command,
    for_platform,
    refresh,
)

COMMAND = ["/opt/gpu provider/python", "-m", "app", "--minimized"]


class MemoryRegistry:
    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def set_value(self, name: str, value: str) -> None:
        self.values[name] = value

    def delete_value(self, name: str) -> None:
        self.values.pop(name, None)

    def get_value(self, name: str) -> str | None:
        return self.values.get(name)


def test_xdg_entry_round_trip(tmp_path):
    entry = XdgAutostart(COMMAND, config_home=tmp_path)
    assert not entry.is_enabled()
    entry.enable()
    text = (tmp_path / "autostart" / f"{APP_ID}.desktop").read_text()
    assert "Exec='/opt/gpu provider/python' -m app --minimized" in text
    assert text.startswith("[Desktop Entry]\nType=Application\n")
    assert entry.is_enabled()
    entry.disable()
    assert not entry.is_enabled()
    entry.disable()  # already gone: no error


def test_launch_agent_plist(tmp_path):
    agent = LaunchAgent(COMMAND, agents_dir=tmp_path)
    agent.enable()
    data = plistlib.loads((tmp_path / f"{LAUNCH_AGENT_LABEL}.plist").read_bytes())
    assert data["ProgramArguments"] == COMMAND and data["RunAtLoad"] is True
    agent.disable()
    assert not agent.is_enabled()


def test_windows_run_value_is_a_quoted_command_line():
    registry = MemoryRegistry()
    run = WindowsRunValue(["C:\\Program Files\\GPU Provider\\gpu-provider.exe", "--minimized"], registry)
    run.enable()
    assert registry.values == {APP_ID: '"C:\\Program Files\\GPU Provider\\gpu-provider.exe" --minimized'}
    assert run.is_enabled()
    run.disable()
    assert registry.values == {} and not run.is_enabled()


def test_a_removed_entry_is_not_recreated_unless_the_setting_is_turned_on(tmp_path):
    entry = XdgAutostart(COMMAND, config_home=tmp_path)
    apply_setting(entry, was_on=False, now_on=True)
    assert entry.is_enabled()
    entry.path.unlink()  # the user removed it by hand
    apply_setting(entry, was_on=True, now_on=True)  # another setting saved
    assert not entry.is_enabled()
    apply_setting(entry, was_on=True, now_on=False)
    apply_setting(entry, was_on=False, now_on=True)
    assert entry.is_enabled()


def test_platform_choice():
    assert isinstance(for_platform(COMMAND, "linux"), XdgAutostart)
    assert isinstance(for_platform(COMMAND, "darwin"), LaunchAgent)
    assert isinstance(for_platform(COMMAND, "win32"), WindowsRunValue)


def test_the_entry_carries_the_icon_and_the_data_folder(tmp_path, monkeypatch):
    """A login item that drops `--data-dir` starts a different node (other settings, other
    identity); one without `Icon=` shows a blank square in the session's startup list."""
    monkeypatch.chdir(tmp_path)
    entry = for_platform(platform="linux", data_dir="profiles/second")
    assert isinstance(entry, XdgAutostart)
    entry.path = tmp_path / "gpu-provider.desktop"
    entry.enable()
    text = entry.path.read_text()
    exec_line = next(line for line in text.splitlines() if line.startswith("Exec="))
    assert f"--data-dir {tmp_path / 'profiles' / 'second'} --minimized" in exec_line  # absolute: login has another cwd
    icon = next(line for line in text.splitlines() if line.startswith("Icon=")).removeprefix("Icon=")
    assert icon.endswith("icon.png") and (tmp_path / icon).is_file()
    assert "--data-dir" not in " ".join(default_command())


TEMPLATE = Path(__file__).resolve().parents[3] / "installer" / "macos" / f"{LAUNCH_AGENT_LABEL}.plist"


def test_the_launch_agent_has_the_shipped_templates_keys(tmp_path):
    """Interactive scheduling and the Aqua session, as the template a managed install uses."""
    app = "/Applications/GPU Provider.app"
    template = plistlib.loads(TEMPLATE.read_bytes().replace(b"@APP_PATH@", app.encode()))
    LaunchAgent([f"{app}/Contents/MacOS/gpu-provider", "--minimized"], agents_dir=tmp_path).enable()
    assert plistlib.loads((tmp_path / f"{LAUNCH_AGENT_LABEL}.plist").read_bytes()) == template


class FakeWinreg(types.ModuleType):
    """The few winreg calls WinregRunKey makes, over a dict of HKCU keys."""

    HKEY_CURRENT_USER = 1
    KEY_SET_VALUE = 2
    REG_SZ = 1

    def __init__(self) -> None:
        super().__init__("winreg")
        self.keys: dict[str, dict[str, str]] = {}

    class _Key:
        def __init__(self, values: dict[str, str]) -> None:
            self.values = values

        def __enter__(self) -> FakeWinreg._Key:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    def CreateKey(self, root: int, path: str) -> FakeWinreg._Key:
        return self._Key(self.keys.setdefault(path, {}))

    def OpenKey(self, root: int, path: str, *access: int) -> FakeWinreg._Key:
        if path not in self.keys:
            raise FileNotFoundError(path)
        return self._Key(self.keys[path])

    def SetValueEx(self, key: FakeWinreg._Key, name: str, reserved: int, kind: int, value: str) -> None:
        key.values[name] = value

    def QueryValueEx(self, key: FakeWinreg._Key, name: str) -> tuple[str, int]:
        if name not in key.values:
            raise FileNotFoundError(name)
        return key.values[name], self.REG_SZ


def test_an_updated_version_writes_start_at_login_for_the_launcher(tmp_path, monkeypatch):
    """versions/2 is pruned two updates later: every entry names the packaged launcher instead."""
    launcher = tmp_path / "opt" / "gpu-provider" / "gpu-provider"
    updated = tmp_path / "data" / "app" / "versions" / "2" / "gpu-provider"
    for executable in (launcher, updated):
        executable.parent.mkdir(parents=True)
        executable.write_text("")
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "executable", str(updated))
    monkeypatch.setenv(LAUNCHER_ENV, str(launcher))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    winreg = FakeWinreg()
    monkeypatch.setitem(sys.modules, "winreg", winreg)

    for platform in ("linux", "darwin", "win32"):
        for_platform(platform=platform).enable()

    desktop = (tmp_path / "config" / "autostart" / f"{APP_ID}.desktop").read_text()
    agent = plistlib.loads((tmp_path / "home" / "Library" / "LaunchAgents" / f"{LAUNCH_AGENT_LABEL}.plist").read_bytes())
    assert f"Exec={launcher} --minimized\n" in desktop
    assert agent["ProgramArguments"] == [str(launcher), "--minimized"]
    assert winreg.keys[RUN_KEY] == {APP_ID: f"{launcher} --minimized"}


@pytest.mark.parametrize("launcher", [None, "gone"])
def test_without_a_launcher_the_packaged_build_names_itself(tmp_path, monkeypatch, launcher):
    """The installer's build (no hand-over), or a launcher since removed: this executable."""
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "executable", "/opt/gpu-provider/gpu-provider")
    if launcher is None:
        monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    else:
        monkeypatch.setenv(LAUNCHER_ENV, str(tmp_path / launcher))
    assert default_command() == ["/opt/gpu-provider/gpu-provider", "--minimized"]


def test_refresh_corrects_an_entry_pointing_into_an_old_version_only_when_it_is_there(tmp_path):
    """An older version wrote versions/1 into the entry; this one repairs it, never recreates it."""
    launcher = ["/opt/gpu-provider/gpu-provider", "--minimized"]
    stale = ["/home/p/.local/share/gpu-provider/app/versions/1/gpu-provider", "--minimized"]
    XdgAutostart(stale, config_home=tmp_path).enable()
    LaunchAgent(stale, agents_dir=tmp_path).enable()
    registry = MemoryRegistry()
    WindowsRunValue(stale, registry).enable()
    backends = [XdgAutostart(launcher, config_home=tmp_path), LaunchAgent(launcher, agents_dir=tmp_path),
                WindowsRunValue(launcher, registry)]
    assert [b.is_current() for b in backends] == [False, False, False]
    assert [refresh(b) for b in backends] == [True, True, True]
    assert [b.is_current() for b in backends] == [True, True, True]
    assert [refresh(b) for b in backends] == [False, False, False]  # already right: untouched
    for backend in backends:
        backend.disable()
    assert [refresh(b) for b in backends] == [False, False, False]
    assert not any(b.is_enabled() for b in backends)


def test_a_translocated_app_is_told_to_move_to_applications(tmp_path):
    """Run from the disk image or Downloads, macOS gives the app a path gone after a restart."""
    moved = "/private/var/folders/x1/T/AppTranslocation/5E1F/d/GPU Provider.app/Contents/MacOS/gpu-provider"
    agent = LaunchAgent([moved, "--minimized"], agents_dir=tmp_path)
    with pytest.raises(AutostartRefused, match="Move GPU Provider to the Applications folder"):
        agent.enable()
    assert not agent.is_enabled()
