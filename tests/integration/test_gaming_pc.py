"""A gaming PC end to end: a display-attached RTX 4090 seen through the real pynvml adapter.

The GPU is `tests/support/fake_pynvml` (the `pynvml` module as the driver answers it: the desktop
holds ~2.4 GiB, so vLLM's default 0.92 share would be refused); the engine is the vLLM stand-in,
told the same card, enforcing vLLM's free-memory and KV checks with vLLM's messages; the
processes on the card are real ones under the names a desktop shows. The node serves, a long
non-streaming answer completes, a game starting pauses it (naming the game) and serving comes
back after the game ends.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.test_node import (
    PRICE,
    STATE_TIMEOUT_S,
    TOKEN,
    Running,
    eventually,
    free_ports,
    model_folder,
    vllm_assign,
)
from tests.support.fake_pynvml import FakeCard, FakeNvml, FakeProcess
from worker.system.config import Paths, Settings
from worker.hardware import PynvmlSource
from worker.link.connection import Backoff
from worker.link.local import ReferenceCoordinator
from worker.node.node import Node

pytestmark = pytest.mark.integration

GAME = "Cyberpunk2077.exe"


def serving_kwh(node: Node) -> float:
    """Energy charged to serving today, with what the node holds in memory written first."""
    node._books.flush(time.time())
    summary = node._books.use(lambda ledger: ledger.summary())
    return summary.energy_kwh_today if summary else 0.0


def free_mib(card: FakeCard) -> int:
    return card.total_mib - card.reserved_mib - sum(p.used_mib for p in card.processes)


async def test_a_display_attached_4090_serves_answers_long_and_pauses_for_a_game(
    tmp_path: Path, vllm_standin: Path, monkeypatch: pytest.MonkeyPatch, spawn: Callable[[str], subprocess.Popen[bytes]]
) -> None:
    card = FakeCard(processes=[FakeProcess(spawn("Xorg").pid, used_mib=618, sm_pct=3),
                               FakeProcess(spawn("gnome-shell").pid, used_mib=287, sm_pct=2),
                               FakeProcess(spawn("chrome").pid, used_mib=1150, sm_pct=12)])
    assert free_mib(card) < 0.92 * card.total_mib  # vLLM's default share would be refused on this card
    FakeNvml([card]).install(monkeypatch)
    monkeypatch.setenv("STANDIN_GPU_TOTAL_MIB", str(card.total_mib))
    monkeypatch.setenv("STANDIN_GPU_FREE_MIB", str(free_mib(card)))
    monkeypatch.setenv("STANDIN_TOKEN_DELAY_S", "0.2")

    coordinator = await ReferenceCoordinator(token=TOKEN, heartbeat_s=1.0, price=PRICE,
                                             assign=vllm_assign(model_folder(tmp_path))).start()
    node = Node(Paths.under(tmp_path / "node"), Settings(auto_resume_after_s=1.0),
                coordinator_url=coordinator.url, engine_bins={"vllm": str(vllm_standin)},
                nvml=PynvmlSource(), token_provider=lambda: TOKEN,
                backoff=Backoff(base_s=0.01, cap_s=0.05, reset_after_s=60.0), first_port=free_ports(1))
    task = asyncio.create_task(node.run())
    run = Running(node, coordinator, task, 0)
    node.subscribe(run.seen)
    try:
        hello = await coordinator.wait_for_connections(1, timeout=STATE_TIMEOUT_S)
        assert hello.platform.runtime == "native" and hello.hardware.gpus[0].name == card.name
        ready = await run.status("ready", "failed")
        assert ready.state == "ready", ready.last_error
        [engine] = ready.engines
        share = float(engine.argv[engine.argv.index("--gpu-memory-utilization") + 1])
        assert share * card.total_mib <= free_mib(card) and share < 0.92

        long = await run.ask({"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 25})
        assert long.error is None and long.end is not None and long.end.usage is not None
        assert long.end.usage.completion_tokens == 25  # ~5 s of silence on a non-streaming request: not a stall

        card.energy_mj += 36_000_000  # 10 Wh drawn while serving: serving's electricity
        await eventually(lambda: serving_kwh(node) > 0.0)

        mark = run.mark()
        game = spawn(GAME)
        card.processes.append(FakeProcess(game.pid, used_mib=4096, sm_pct=90))
        await run.status("paused", after=mark)
        assert node.snapshot().pause_detail == GAME and node.snapshot().pause_reason == "game"
        await eventually(lambda: node.snapshot().engines == ())  # drained and stopped: the GPU is the player's
        refused = await run.ask({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert refused.error is not None and refused.error.code == "paused"
        before = serving_kwh(node)
        card.energy_mj += 360_000_000  # 100 Wh of gaming: the player's, not charged against earnings
        await asyncio.sleep(2.5)  # two samples and more
        assert serving_kwh(node) == before

        mark = run.mark()
        card.processes.pop()
        game.kill()
        game.wait()
        back = await run.status("ready", after=mark)
        assert back.assignment_id == "a-1" and node.snapshot().pause_detail is None
    finally:
        node.shutdown()
        async with asyncio.timeout(STATE_TIMEOUT_S):
            await task
        await coordinator.stop()
    assert run.live_engine_pids() == []
