"""Which engine executable an accepted plan starts: the one found at the release asked for (its
build tag aside), else the build installed for this machine's runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.worker.engines.test_vllm_cpu import FOLDER, assign, cpu_machine
from worker.system.config import Paths, Settings
from worker.hardware.model import EngineInstall
from worker.plan.planner import Plan, plan
from worker.provision import assignment


def cpu_plan(version: str | None) -> Plan:
    block = {**FOLDER, "engine_version": version} if version else FOLDER
    chosen = plan(cpu_machine(), assign(vllm=block), Settings())
    assert isinstance(chosen, Plan), chosen
    return chosen


class Installs:
    """Stands in for the installer: records what it was asked for (installing is tested apart)."""

    def __init__(self) -> None:
        self.asked: list[dict[str, Any]] = []

    async def __call__(self, engine: str, version: str | None, *args: Any, **kwargs: Any) -> EngineInstall:
        self.asked.append({"engine": engine, "version": version, **kwargs})
        raise AssertionError("the installed CPU build should have been used")


@pytest.mark.parametrize("wanted", [None, "0.32.0", "0.32.0+cpu"])
async def test_the_cpu_build_found_is_the_release_asked_for_whatever_its_build_tag(
    wanted: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    installs = Installs()
    monkeypatch.setattr(assignment, "ensure_engine", installs)
    chosen = cpu_plan(wanted)
    engine = await assignment._engine_executable(chosen, cpu_machine(), Paths.under(tmp_path), print, {})
    executable, env = engine.executable, engine.env
    assert executable == ("/venv/bin/vllm",) and env == {} and installs.asked == []


async def test_an_engine_not_found_is_installed_for_this_machines_runtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the runtime the installer would pick the GPU build on a machine that has no GPU."""
    installs = Installs()
    monkeypatch.setattr(assignment, "ensure_engine", installs)
    chosen = cpu_plan("0.32.0")
    with pytest.raises(AssertionError):
        await assignment._engine_executable(chosen, cpu_machine("0.31.0+cpu"), Paths.under(tmp_path), print, {})
    assert [(a["engine"], a["version"], a["runtime"]) for a in installs.asked] == [("vllm", "0.32.0", "cpu")]
