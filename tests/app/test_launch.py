"""`gpu-provider`: the desktop app where it can open, the core's command line everywhere else."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from app import launch
from worker import __version__

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The arguments each time the desktop app was started (a stand-in for app.main)."""
    seen: list[list[str]] = []
    fake = types.ModuleType("app.main")
    fake.main = lambda args: seen.append(list(args)) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "app.main", fake)
    return seen


@pytest.mark.parametrize(("argv", "desktop"), [
    (["--data-dir", "/tmp/x", "--coordinator", "local", "--minimized"],
     ["--data-dir", "/tmp/x", "--coordinator", "local", "--minimized"]),
    (["run", "--data-dir", "/tmp/x", "--coordinator", "local"], ["--data-dir", "/tmp/x", "--coordinator", "local"]),
])
def test_the_app_opens_where_it_can(monkeypatch: pytest.MonkeyPatch, opened: list[list[str]],
                                    argv: list[str], desktop: list[str]) -> None:
    monkeypatch.setattr(launch, "can_open_the_app", lambda: True)
    assert launch.main(argv) == 0
    assert opened == [desktop]


def test_where_it_cannot_the_core_says_what_to_do(monkeypatch: pytest.MonkeyPatch, opened: list[list[str]],
                                                   tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(launch, "can_open_the_app", lambda: False)
    assert launch.main(["--data-dir", str(tmp_path)]) == 1
    assert opened == []
    assert "gpu-provider run --headless" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["status"], ["run", "--headless", "--hardware", "/no/such.json"], ["--version"]])
def test_core_commands_never_open_the_app(monkeypatch: pytest.MonkeyPatch, opened: list[list[str]],
                                          tmp_path: Path, argv: list[str]) -> None:
    monkeypatch.setattr(launch, "can_open_the_app", lambda: True)
    ran: list[list[str]] = []
    monkeypatch.setattr(launch.cli, "main", lambda arguments: ran.append(arguments) or 0)
    assert launch.main([*argv, "--data-dir", str(tmp_path)]) == 0
    assert (ran, opened) == ([[*argv, "--data-dir", str(tmp_path)]], [])


@pytest.mark.parametrize(("platform", "environ", "display"), [
    ("win32", {}, True),
    ("darwin", {}, True),
    ("linux", {"DISPLAY": ":0"}, True),
    ("linux", {"WAYLAND_DISPLAY": "wayland-0"}, True),
    ("linux", {"QT_QPA_PLATFORM": "offscreen"}, True),
    ("linux", {}, False),
    ("linux", {"DISPLAY": ""}, False),
    ("freebsd14", {"TERM": "xterm"}, False),
])
def test_has_display(platform: str, environ: dict[str, str], display: bool) -> None:
    assert launch.has_display(platform, environ) is display


@pytest.mark.parametrize(("missing", "can"), [((), True), (("PySide6",), False), (("pyqtgraph",), False)])
def test_the_app_needs_the_gui_extra(missing: tuple[str, ...], can: bool) -> None:
    assert launch.can_open_the_app("linux", {"DISPLAY": ":0"}, lambda name: name not in missing) is can
    assert launch.can_open_the_app("linux", {}, lambda name: True) is False


def test_installed_asks_the_import_system() -> None:
    assert launch.installed("json") and not launch.installed("no_such_module_here")


def test_python_m_app_is_the_gpu_provider_command(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "app", "--version"], capture_output=True, text=True, timeout=30,
                          cwd=ROOT, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert (done.returncode, done.stdout.strip()) == (0, f"gpu-provider {__version__}"), done.stderr
