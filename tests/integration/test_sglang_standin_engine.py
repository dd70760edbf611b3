"""The SGLang path without a GPU, through the app's generic path: plan → supervise → ready → relay
→ metrics → stop. The app's own launcher (`worker/engines/sglang/launcher.py`) really runs, with
the SGLang stand-in (tests/standin/sglang_engine.py) as the `sglang` it imports: SGLang's command
line, start-up checks and messages, start-up lines, key rule and /metrics names."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil
import pytest

from tests.support.engines import engine_client, free_port
from tests.support.wire import Wire
from worker.contract import protocol
from worker.contract.events import EngineSnapshot
from worker.engines.sglang.launcher import KEY_VARIABLE
from worker.measure.metrics import parse_metrics
from worker.plan.planner import EnginePlan
from worker.relay.forward import Relay, engine_http_client
from worker.serve.process import StopTiming
from worker.serve.restart_policy import RestartBackoff, SupervisorTiming
from worker.serve.supervisor import EngineSupervisor
from worker.system.config import Paths

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SITE = REPO / "tests" / "standin" / "sglang_site"
FAST = SupervisorTiming(
    ready_timeout_s=15, poll_s=0.05, request_timeout_s=1.0, probe_timeout_s=2.0, health_interval_s=0.1,
    health_timeout_s=1.0, health_failures=2, stable_after_s=30, max_fast_failures=3, output_settle_s=1.0,
    stop=StopTiming(grace_s=2.0, gone_s=2.0, poll_s=0.02))
TINY_BACKOFF = RestartBackoff(initial_s=0.01, maximum_s=0.05)
BASE = ("--context-length", "8192")
TIER_24000 = ("--context-length", "32768", "--cuda-graph-max-bs-decode", "64")
TIER_40000 = ("--context-length", "131072", "--cuda-graph-max-bs-decode", "256")
# The stand-in's 24 GiB card with 15.5 GiB of weights, told 0.9 usable: SGLang gets 0.75, and the
# KV pool is (0.75 × 24564 MiB − 15872 MiB) / 147456 bytes per token.
KV_TOKENS = (int(0.75 * 24564 * 2**20) - 15872 * 2**20) // 147456


def standin_plan(*, tier: str | None = None, args: tuple[str, ...] = BASE, fallbacks: tuple = (),
                 env: dict[str, str] | None = None) -> EnginePlan:
    return EnginePlan(
        engine_id="e0", engine="sglang", gpu_indices=(0,), layout="single", memory_mib=22000, tier=tier,
        args=args, fallbacks=fallbacks, port=free_port(), env={"PYTHONPATH": f"{SITE}{os.pathsep}{REPO}", **(env or {})},
        executable=(sys.executable,), model="/models/Qwen3-8B", served_name="qwen3-8b", memory_utilization=0.9)


def tiered_plan(env: dict[str, str]) -> EnginePlan:
    return standin_plan(tier="40000", args=BASE + TIER_40000,
                        fallbacks=(("24000", BASE + TIER_24000), (None, BASE)), env=env)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def __call__(self, snapshot: EngineSnapshot, reason: str) -> None:
        self.events.append((snapshot.state, reason))


def supervisor(plan: EnginePlan, tmp_path: Path, recorder: Recorder | None = None,
               base_env: dict[str, str] | None = None) -> EngineSupervisor:
    """The platform's default (a Unix socket on Linux and macOS): SGLang, which listens on TCP only,
    is kept on 127.0.0.1 by its adapter's `UNIX_SOCKET`, not by the test."""
    return EngineSupervisor(plan, paths=Paths.under(tmp_path).ensure(), on_event=recorder, timing=FAST,
                            backoff=TINY_BACKOFF, base_env=base_env or dict(os.environ))


async def test_plan_supervise_ready_relay_metrics_stop(tmp_path: Path) -> None:
    sup = supervisor(standin_plan(), tmp_path)
    await sup.start()
    snap = await sup.wait_for_state("ready", "failed", timeout=20)
    wire = Wire()
    try:
        assert snap.state == "ready", snap.last_error
        assert snap.kv_cache_tokens == KV_TOKENS and snap.context.physical == KV_TOKENS
        assert snap.max_concurrency == round(KV_TOKENS / 8192, 2)
        target = sup.target()
        assert target is not None and target.socket_path is None and target.served_model_name == "qwen3-8b"
        cmdline = Path(f"/proc/{snap.pid}/cmdline").read_bytes().decode()
        assert target.api_key not in cmdline and "--api-key" not in snap.argv
        assert snap.argv[snap.argv.index("--mem-fraction-static") + 1] == "0.75"
        async with engine_client(None) as http:
            denied = await http.get(f"{target.base_url}/v1/models")
            page = await http.get(f"{target.base_url}/metrics")
        assert denied.status_code == 401 and page.status_code == 200
        async with engine_http_client() as http:
            relay = Relay(wire, lambda: [target], lambda: None, http=http)
            body = {"model": "qwen3-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                    "stream": True}
            await relay.handle(protocol.Request(id="r-1", method="POST", path="/v1/chat/completions", body=body))
        async with engine_client(None) as http:
            after = parse_metrics((await http.get(f"{target.base_url}/metrics")).text)
        before = parse_metrics(page.text)
    finally:
        await sup.stop()
    head, *chunks, end = wire.frames
    assert isinstance(head, protocol.ResponseHead) and head.status == 200
    assert isinstance(end, protocol.ResponseEnd) and end.usage is not None and end.usage.completion_tokens == 3
    assert before.engine == "sglang" and before.kv_cache_tokens == KV_TOKENS and before.requests_running == 0
    assert after.generation_tokens is not None and before.generation_tokens is not None
    assert after.generation_tokens - before.generation_tokens == 3
    assert sup.snapshot().state == "stopped" and sup.target() is None
    assert not psutil.pid_exists(snap.pid) or psutil.Process(snap.pid).status() == psutil.STATUS_ZOMBIE


async def test_a_context_longer_than_the_models_falls_back_to_the_next_tier(tmp_path: Path) -> None:
    """SGLang refuses a `--context-length` above the model's own (40960 here) at start; the tier
    below asks for 32768 and starts."""
    recorder = Recorder()
    sup = supervisor(tiered_plan({}), tmp_path, recorder)
    await sup.start()
    snap = await sup.wait_for_state("ready", "failed", timeout=25)
    await sup.stop()
    assert snap.state == "ready" and snap.tier == "24000", snap.last_error
    assert ("starting", "the KV cache cannot hold the context on tier 40000; retrying on tier 24000") in recorder.events


async def test_out_of_memory_capturing_cuda_graphs_falls_back_to_the_next_tier(tmp_path: Path) -> None:
    """The model's context is long enough for every tier here; tier 40000's 256-request CUDA graph
    runs out of memory while capturing, tier 24000's 64 does not."""
    recorder = Recorder()
    env = {"STANDIN_MODEL_MAX_LEN": "262144", "STANDIN_GRAPH_BS_LIMIT": "128"}
    sup = supervisor(tiered_plan(env), tmp_path, recorder)
    await sup.start()
    snap = await sup.wait_for_state("ready", "failed", timeout=25)
    await sup.stop()
    assert snap.state == "ready" and snap.tier == "24000", snap.last_error
    assert ("starting", "out of memory while starting on tier 40000; retrying on tier 24000") in recorder.events


async def test_no_room_for_a_kv_cache_fails_with_sglangs_words(tmp_path: Path) -> None:
    """Weights of 20 GiB on the 24 GiB card leave nothing of a 0.75 share for the KV cache: SGLang
    says so, and no tier can help."""
    sup = supervisor(standin_plan(env={"STANDIN_WEIGHTS_MIB": "20480"}), tmp_path)
    await sup.start()
    snap = await sup.wait_for_state("ready", "failed", timeout=20)
    await sup.stop()
    assert snap.state == "failed"
    assert "Not enough memory. Please try to increase --mem-fraction-static" in snap.last_error


async def test_an_inherited_sglang_variable_does_not_lift_its_checks(tmp_path: Path) -> None:
    """`SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1` in the app's environment would let SGLang serve
    past the model's context; the engine never sees it, nor an inherited key."""
    base = {**os.environ, "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1", KEY_VARIABLE: "planted"}
    sup = supervisor(standin_plan(args=("--context-length", "131072")), tmp_path, base_env=base)
    await sup.start()
    snap = await sup.wait_for_state("ready", "failed", timeout=20)
    await sup.stop()
    assert snap.state == "failed" and "derived context_length (40960)" in Path(snap.log_path).read_text()
