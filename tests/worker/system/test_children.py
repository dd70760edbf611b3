"""Every child the app starts goes through `worker.system.children`, which gives each one no
console window on Windows. The lint is the guard: a new `subprocess.run` anywhere else fails it."""

from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from worker.system import children

ROOT = Path(__file__).resolve().parents[3]
_STARTS = {
    ("subprocess", name) for name in ("run", "Popen", "call", "check_call", "check_output", "getoutput",
                                      "getstatusoutput")
} | {("asyncio", "create_subprocess_exec"), ("asyncio", "create_subprocess_shell"),
     ("os", "system"), ("os", "popen"), ("os", "spawnv"), ("os", "spawnve"), ("os", "startfile"),
     ("os", "posix_spawn"), ("os", "posix_spawnp")}


def _starts_in(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        func = node.func if isinstance(node, ast.Call) else None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            if (func.value.id, func.attr) in _STARTS:  # a call: `subprocess.Popen[bytes]` as a type is none
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {func.value.id}.{func.attr}")
        if isinstance(node, ast.ImportFrom) and node.module in {"subprocess", "asyncio", "os"}:
            for alias in node.names:
                if (node.module, alias.name) in _STARTS:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module} import {alias.name}")
    return found


def test_no_child_is_started_outside_the_one_helper() -> None:
    sources = sorted((ROOT / "worker").rglob("*.py")) + sorted((ROOT / "app").rglob("*.py"))
    helper = ROOT / "worker" / "system" / "children.py"
    starts = [start for path in sources if path != helper for start in _starts_in(path)]
    assert starts == []


def test_the_lint_sees_a_start(tmp_path: Path) -> None:
    """The lint above would catch the forms a start takes (else it proves nothing)."""
    sample = ROOT / "worker" / "system" / "children.py"
    assert any("subprocess.run" in start for start in _starts_in(sample))
    assert any("asyncio.create_subprocess_exec" in start for start in _starts_in(sample))


class _Recorder:
    """A stand-in for the `subprocess` functions the helper calls: it records the keyword
    arguments each call got, as Windows would see them."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        return subprocess.CompletedProcess(args, 0, "", "")


@pytest.fixture
def on_windows(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    recorder = _Recorder()
    monkeypatch.setattr(children.os, "name", "nt")
    for name in ("run", "Popen", "call"):
        monkeypatch.setattr(children.subprocess, name, recorder)
    return recorder


def test_every_child_gets_no_window_on_windows(on_windows: _Recorder) -> None:
    children.run(["probe"], timeout_s=1)
    children.run_bytes(["wsl.exe", "-l", "-v"], timeout_s=1)
    children.popen(["engine"], flags=children.CREATE_NEW_PROCESS_GROUP)
    children.call(["other-build"])
    flags = [call["creationflags"] for call in on_windows.calls]
    assert len(flags) == 4
    assert all(flag & children.CREATE_NO_WINDOW for flag in flags)
    assert flags[2] & children.CREATE_NEW_PROCESS_GROUP


def test_the_async_start_gets_no_window_on_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []

    async def fake_exec(*argv: str, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return None

    monkeypatch.setattr(children.os, "name", "nt")
    monkeypatch.setattr(children.asyncio, "create_subprocess_exec", fake_exec)
    asyncio.run(children.start(["pip", "install"], stdin=subprocess.DEVNULL))
    asyncio.run(children.start(["new-version"], flags=children.DETACHED_PROCESS | children.CREATE_NEW_PROCESS_GROUP))
    assert seen[0]["creationflags"] == children.CREATE_NO_WINDOW
    # DETACHED_PROCESS opens no console and Windows ignores CREATE_NO_WINDOW beside it
    assert seen[1]["creationflags"] == children.DETACHED_PROCESS | children.CREATE_NEW_PROCESS_GROUP


def test_no_flags_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    done = children.run([sys.executable, "-c", "print('ok')"], timeout_s=30)
    assert done.stdout.strip() == "ok"
    assert children.creation_flags(children.CREATE_NEW_PROCESS_GROUP, system="posix") == 0


def test_a_child_gets_no_stdin() -> None:
    """A probe that waits on input ends at once instead of hanging until its timeout."""
    done = children.run([sys.executable, "-c", "import sys; print(repr(sys.stdin.read()))"], timeout_s=30)
    assert done.stdout.strip() == "''"
