from __future__ import annotations

import plistlib

from worker.system.autostart import (
    APP_ID,
    LAUNCH_AGENT_LABEL,
    LaunchAgent,
    WindowsRunValue,
    XdgAutostart,
    apply_setting,
    default_command,
    for_platform,
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
    assert data == {"Label": LAUNCH_AGENT_LABEL, "ProgramArguments": COMMAND, "RunAtLoad": True}
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
