"""Layout rules on the machines they are for; the Apple case end to end through the plan."""

from __future__ import annotations

from tests.worker.hardware.recorded import replay
from worker.contract import protocol
from worker.engines.layout import APPLE_GPU, Unit, whole_group_units
from worker.plan.planner import Plan, memory_utilization, plan
from worker.system.config import Settings


def test_a_mac_engine_runs_on_its_gpu_over_the_working_set() -> None:
    machine = replay("m4-max-128gb.json")
    assert machine.runtime == "apple-silicon"
    assert whole_group_units(machine, 16500) == [Unit((APPLE_GPU,), "single", machine.effective_vram_mib)]
    assert APPLE_GPU == 0


def test_a_machine_without_gpus_still_runs_on_the_cpu() -> None:
    machine = replay("no-gpu.json")
    assert [unit.gpu_indices for unit in whole_group_units(machine, 6000)] == [()]


def test_the_mac_plan_names_gpu_0_and_what_reads_it_still_works() -> None:
    """The plan on the wire says GPU 0; no memory share is derived from it (no NVML card)."""
    machine = replay("m4-max-128gb.json")
    assignment = protocol.Assign(assignment_id="a-1", model={"name": "q", "llamacpp": {
        "source": "https://example.org/q.gguf", "sha256": "ab" * 32, "weights_mib": 16500,
        "base_args": ["--ctx-size", "32768"]}})
    result = plan(machine, assignment, Settings(), model_path="/cache/q.gguf")
    assert isinstance(result, Plan)
    (engine,) = result.engines
    assert engine.gpu_indices == (0,) and engine.layout == "single"
    assert engine.memory_mib == machine.effective_vram_mib
    assert engine.to_json()["gpu_indices"] == [0]
    assert memory_utilization(machine, whole_group_units(machine, 16500)[0], None) is None
    assert engine.environment({"PATH": "/usr/bin"})["CUDA_VISIBLE_DEVICES"] == "0"
