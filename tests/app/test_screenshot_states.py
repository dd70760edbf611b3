"""The screenshots show only what the planner does: every engine in the published states is one the
real planner lays out for the recorded machine those states show."""

from __future__ import annotations

import re
from pathlib import Path

from tests.app import snapshots
from worker.plan.planner import Plan, plan
from worker.system.config import Settings

README = Path(__file__).resolve().parents[2] / "docs" / "screenshots" / "README.md"


def test_every_published_engine_is_one_the_planner_lays_out():
    planned = {}
    for machine, assign in ((snapshots.MACHINE, snapshots._assign(17_800, "vllm", "llamacpp")),
                            (snapshots.CPU_MACHINE, snapshots._assign(470, "llamacpp"))):
        result = plan(machine, assign, Settings())
        assert isinstance(result, Plan)
        names = tuple(g.name for g in machine.gpus)
        planned.update({(names, e.engine, e.gpu_indices, e.layout): e.memory_mib for e in result.engines})
    for name, make in snapshots.MAIN_STATES.items():
        snap = make()
        names = tuple(g.name for g in snap.gpus)
        for engine in snap.engines:
            key = (names, engine.engine, engine.gpu_indices, engine.layout)
            assert key in planned, f"{name}: {key} is not what the planner does"
            assert engine.memory_mib == planned[key], name


def test_the_screenshot_index_names_only_files_that_exist():
    linked = set(re.findall(r"\(([\w.-]+\.png)\)", README.read_text()))
    assert linked and all((README.parent / name).is_file() for name in linked)
