"""The installer files that cannot be built here are still parsed and cross-checked here."""

from __future__ import annotations

import ast
import configparser
import importlib.util
import plistlib
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from worker.system import autostart

REPO = Path(__file__).resolve().parents[2]
INSTALLER = REPO / "installer"


def load_entry() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "frozen_entry", INSTALLER / "entry.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--data-dir", "/d", "detect"], "/d"),
        (["detect", "--data-dir=/e"], "/e"),
        (["--quit-after", "5"], None),
        (["--data-dir"], None),
    ],
)
def test_the_entry_point_finds_the_data_dir_like_the_cli(
    argv: list[str], expected: str | None
) -> None:
    assert load_entry().data_dir_from(argv) == expected


def test_the_launch_agent_template_matches_what_the_app_writes() -> None:
    template = (INSTALLER / "macos" / "net.gpu-provider.app.plist").read_bytes()
    agent = plistlib.loads(
        template.replace(b"@APP_PATH@", b"/Applications/GPU Provider.app")
    )
    written = autostart.LaunchAgent(
        ["/Applications/GPU Provider.app/Contents/MacOS/gpu-provider", "--minimized"]
    ).plist()
    assert agent["Label"] == written["Label"] == autostart.LAUNCH_AGENT_LABEL
    assert agent["ProgramArguments"] == written["ProgramArguments"]
    assert agent["RunAtLoad"] is True


def test_the_entitlements_parse() -> None:
    entitlements = plistlib.loads(
        (INSTALLER / "macos" / "entitlements.plist").read_bytes()
    )
    assert (
        entitlements["com.apple.security.cs.allow-unsigned-executable-memory"] is True
    )


def test_build_spec_is_python_and_makes_the_bundle_tray_only() -> None:
    tree = ast.parse((REPO / "build.spec").read_text())
    keys = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    assert {"LSUIElement", "keyring.backends", "assets", "PySide6.QtSvg"} <= keys
    assert (INSTALLER / "entry.py").is_file()


def app_console_flag(windows: bool, macos: bool) -> bool:
    """The spec's `console=` for the app executable, evaluated for one platform."""
    tree = ast.parse((REPO / "build.spec").read_text())
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "executable"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == "gpu-provider"
    ]
    assert len(calls) == 1
    (console,) = [k.value for k in calls[0].keywords if k.arg == "console"]
    expression = ast.Expression(console)
    value = eval(compile(expression, "build.spec", "eval"), {"WINDOWS": windows, "MACOS": macos})  # noqa: S307
    assert isinstance(value, bool)
    return value


def test_the_app_is_windowed_on_windows_and_macos() -> None:
    """A console .app bundle may not launch at all (pyinstaller#5154); Linux keeps one executable."""
    assert app_console_flag(windows=False, macos=True) is False
    assert app_console_flag(windows=True, macos=False) is False
    assert app_console_flag(windows=False, macos=False) is True


def test_the_macos_update_archive_is_packed_without_apple_double_files() -> None:
    script = (INSTALLER / "macos" / "build-app.sh").read_text()
    packing = [line for line in script.splitlines() if '-czf "$ARCHIVE"' in line]
    assert len(packing) == 1
    assert packing[0].startswith("COPYFILE_DISABLE=1 tar --no-mac-metadata ")


def test_the_desktop_entry_runs_the_command_with_the_installed_icon() -> None:
    entry = configparser.ConfigParser(interpolation=None)
    entry.optionxform = str  # type: ignore[assignment,method-assign]
    entry.read(INSTALLER / "linux" / "gpu-provider.desktop")
    section = entry["Desktop Entry"]
    assert (section["Type"], section["Exec"], section["Icon"], section["Terminal"]) == (
        "Application",
        "gpu-provider",
        "gpu-provider",
        "false",
    )


def test_the_windows_installer_is_per_user_and_agrees_with_the_apps_autostart() -> None:
    script = (INSTALLER / "windows" / "gpu-provider.iss").read_text()
    assert "PrivilegesRequired=lowest" in script
    assert f'ValueName: "{autostart.APP_ID}"' in script and "--minimized" in script
    assert "function PrepareToInstall" in script and "/F /T /IM" in script
    assert script.count("begin") == script.count("end;") + script.count("end.")


@pytest.mark.parametrize(
    "script",
    [
        "linux/build-deb.sh",
        "linux/smoke-test.sh",
        "macos/build-app.sh",
        "linux/postinst",
        "linux/postrm",
    ],
)
def test_shell_scripts_parse_and_are_executable(script: str) -> None:
    path = INSTALLER / script
    assert path.stat().st_mode & 0o111
    checked = subprocess.run(
        ["bash", "-n", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert checked.returncode == 0, checked.stderr


def test_every_data_file_of_the_core_ships_in_both_builds() -> None:
    """A file the core reads beside its modules (the network, the tuning prompts) is in the wheel's
    package data and in the frozen build's `datas`; one left out works from a checkout only."""
    import tomllib

    data = sorted(path.relative_to(REPO).as_posix() for path in (REPO / "worker").rglob("*")
                  if path.is_file() and path.suffix not in {".py", ".pyc"} and "__pycache__" not in path.parts)
    assert data  # the network file at least
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    spec = (REPO / "build.spec").read_text()
    for name in data:
        folder, file = name.rsplit("/", 1)
        package = ".".join(Path(folder).parts[:2])
        inside = Path(name).relative_to(Path(*Path(folder).parts[:2]))  # as package data names it
        assert any(inside.match(pattern) for pattern in package_data.get(package, [])), name
        assert f'"{file}"' in spec and f'"{folder}"' in spec, name
