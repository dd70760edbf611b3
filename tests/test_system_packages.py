"""The test command installs the Debian packages the tests need where it can, and otherwise stops at
once with the one command to run (a new user's `./scripts/test` used to run 192 tests and then fail
in the desktop tests for want of xvfb, openbox, trayer and xdotool)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "_system_packages.sh"


def fake_tools(folder: Path, *, uid: int, installed: set[str], sudo: bool) -> Path:
    """`id`, `dpkg`, `apt-get` (and `sudo`) that record what they were asked, on a PATH of their own."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    tools = {
        "id": f'echo {uid}\n',
        "dpkg": 'case " {} " in *" $2 "*) exit 0;; *) exit 1;; esac\n'.format(" ".join(sorted(installed))),
        "apt-get": f'echo "apt-get $*" >> {folder / "calls"}\n',
    }
    if sudo:
        tools["sudo"] = f'echo "sudo $*" >> {folder / "calls"}\n[ "$2" = true ] && exit 0\nshift; exec "$@"\n'
    for name, body in tools.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}", encoding="utf-8")
        (bin_dir / name).chmod(0o755)
    for name in ("bash", "cat", "env"):
        os.symlink(f"/usr/bin/{name}", bin_dir / name)
    return bin_dir


def run(folder: Path, bin_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["/bin/bash", "-c", f"source {SCRIPT}; install_system_packages; echo went-on"],
                          env={"PATH": str(bin_dir)}, capture_output=True, text=True, timeout=30, check=False)


def all_packages() -> set[str]:
    listed = subprocess.run(["/bin/bash", "-c", f'source {SCRIPT}; echo "${{SYSTEM_PACKAGES[@]}}"'],
                            capture_output=True, text=True, timeout=30, check=True)
    return set(listed.stdout.split())


def test_the_desktop_tests_packages_are_listed() -> None:
    assert {"xvfb", "openbox", "trayer", "xdotool", "cmake", "g++", "libegl1"} <= all_packages()


def test_without_root_or_sudo_it_stops_at_once_with_the_one_command(tmp_path: Path) -> None:
    bin_dir = fake_tools(tmp_path, uid=1000, installed=all_packages() - {"xvfb", "trayer"}, sudo=False)
    done = run(tmp_path, bin_dir)
    assert done.returncode == 1 and "went-on" not in done.stdout
    assert "  sudo apt-get install -y xvfb trayer" in done.stderr
    assert not (tmp_path / "calls").exists()


def test_as_root_it_installs_what_is_missing_and_goes_on(tmp_path: Path) -> None:
    bin_dir = fake_tools(tmp_path, uid=0, installed=all_packages() - {"openbox"}, sudo=False)
    done = run(tmp_path, bin_dir)
    assert done.returncode == 0 and "went-on" in done.stdout
    assert (tmp_path / "calls").read_text().splitlines() == ["apt-get update -qq", "apt-get install -y -qq openbox"]


def test_with_passwordless_sudo_it_installs_through_sudo(tmp_path: Path) -> None:
    bin_dir = fake_tools(tmp_path, uid=1000, installed=all_packages() - {"xdotool"}, sudo=True)
    done = run(tmp_path, bin_dir)
    assert done.returncode == 0 and "went-on" in done.stdout
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[-2:] == ["sudo -n env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq xdotool",
                          "apt-get install -y -qq xdotool"]


def test_nothing_missing_asks_nobody(tmp_path: Path) -> None:
    bin_dir = fake_tools(tmp_path, uid=1000, installed=all_packages(), sudo=False)
    done = run(tmp_path, bin_dir)
    assert done.returncode == 0 and "went-on" in done.stdout and not (tmp_path / "calls").exists()
