"""vLLM on a gaming PC's card, the one that drives the display (issue 13): the desktop holds 2,950 of
its 24,564 MiB, so vLLM's default share (0.92 of total) is more than is free and vLLM refuses to
start. The plan tells it the share it measured instead. The stand-in is told the same card, and
refuses exactly where vLLM would."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
from pathlib import Path

import pytest

from tests.integration.test_node import model_folder, running_node, vllm, vllm_assign
from tests.worker.hardware.recorded import replay
from worker.contract import protocol
from worker.system.config import Settings
from worker.plan.planner import EnginePlan, Plan, plan

pytestmark = pytest.mark.integration

FIXTURE = "rtx4090-desktop.json"
WEIGHTS_MIB = 4000  # what vllm_assign declares; the stand-in is told the same
MIB = 1 << 20


def standin_card() -> dict[str, str]:
    """The recorded card, as the stand-in's environment describes it."""
    (gpu,) = replay(FIXTURE).gpus
    return {"STANDIN_GPU_TOTAL_MIB": str(gpu.memory_total_mib), "STANDIN_GPU_FREE_MIB": str(gpu.memory_free_mib),
            "STANDIN_WEIGHTS_MIB": str(WEIGHTS_MIB)}


def planned(standin: Path, model: Path) -> EnginePlan:
    result = plan(replay(FIXTURE), vllm_assign(model), Settings(), executable=[str(standin)], model_path=str(model))
    assert isinstance(result, Plan), result
    (engine,) = result.engines
    return engine


async def start(engine: EnginePlan, socket_path: Path) -> tuple[int | None, str]:
    """Starts the engine's command line bare; (None, output) once it listens, (status, output) if it exits."""
    env = {**engine.environment(os.environ), **engine.env, **standin_card(), "STANDIN_ENGINE_CORE": "0"}
    process = await asyncio.create_subprocess_exec(
        *engine.argv(socket_path=str(socket_path)), env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    assert process.stdout is not None
    lines: list[str] = []
    listening = False
    async with asyncio.timeout(10):
        async for raw in process.stdout:
            lines.append(raw.decode().rstrip("\n"))
            if "Starting vLLM server on" in lines[-1]:
                listening = True
                process.terminate()
        status = await process.wait()
    return (None if listening else status), "\n".join(lines)


async def test_without_the_measured_share_vllm_refuses_this_card_and_with_it_starts(
        tmp_path: Path, vllm_standin: Path) -> None:
    engine = planned(vllm_standin, model_folder(tmp_path))
    old = dataclasses.replace(engine, memory_utilization=None)  # what the app passed before issue 13
    assert "--gpu-memory-utilization" not in old.argv()
    status, output = await start(old, tmp_path / "old.sock")
    assert status == 1
    assert ("Free memory on device cuda:0 (21.11/23.99 GiB) on startup is less than desired GPU memory "
            "utilization (0.92, 22.07 GiB)") in output
    status, output = await start(engine, tmp_path / "new.sock")
    assert status is None, output
    assert "Free memory on device" not in output


async def test_the_node_serves_on_a_display_attached_card(
        tmp_path: Path, vllm_standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in standin_card().items():
        monkeypatch.setenv(name, value)
    (gpu,) = replay(FIXTURE).gpus
    share = gpu.usable_mib * 1000 // gpu.memory_total_mib / 1000  # 18,940 / 24,564 → 0.771
    kv_bytes = math.ceil(gpu.memory_total_mib * MIB * share) - (WEIGHTS_MIB + 1536) * MIB
    async with running_node(tmp_path, vllm(vllm_standin), fixture=FIXTURE,
                            assign=vllm_assign(model_folder(tmp_path))) as run:
        ready: protocol.Status = await run.status("ready", "failed")
        assert ready.state == "ready", ready.last_error
        (engine,) = ready.engines
        assert engine.argv.count("--gpu-memory-utilization") == 1
        assert engine.argv[engine.argv.index("--gpu-memory-utilization") + 1] == "0.771" == f"{share:g}"
        assert engine.kv_cache_tokens == kv_bytes // (16 * 147456) * 16  # 95,296 tokens at 144 KiB each
        assert engine.restarts == 0 and engine.last_error is None
        assert (await run.ask()).end is not None
