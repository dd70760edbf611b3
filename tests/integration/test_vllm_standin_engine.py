"""The vLLM path without a GPU: the supervisor drives the stand-in (a real child process serving
real HTTP on a Unix socket, or on 127.0.0.1) through start, KV parsing, OOM fallback, refusals,
crash loops and hangs."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from pydantic import BaseModel

from tests.support.engines import engine_client, free_port
from worker import protocol
from worker.config import Paths
from worker.events import EngineSnapshot
from worker.plan import EnginePlan
from worker.procs import StopTiming
from worker.relay import EngineTarget, Relay, engine_http_client
from worker.supervise import Backoff, EngineSupervisor, SupervisorTiming, Target

pytestmark = pytest.mark.integration

FAST = SupervisorTiming(
    ready_timeout_s=10, poll_s=0.05, request_timeout_s=1.0, probe_timeout_s=2.0, health_interval_s=0.1,
    health_failures=2, stall_s=0.5, stable_after_s=30, max_fast_failures=3, output_settle_s=1.0,
    stop=StopTiming(grace_s=2.0, gone_s=2.0, poll_s=0.02))
TINY_BACKOFF = Backoff(initial_s=0.01, maximum_s=0.05)
BASE = ("--max-model-len", "4096", "--enforce-eager")
TIER_24000 = ("--max-model-len", "8192", "--max-num-seqs", "64")
TIER_40000 = ("--max-model-len", "16384", "--max-num-seqs", "128")


def standin_plan(standin: Path, *, tier: str | None = None, args: tuple[str, ...] = BASE,
                 fallbacks: tuple = (), env: dict[str, str] | None = None) -> EnginePlan:
    return EnginePlan(
        engine_id="e0", engine="vllm", gpu_indices=(0,), layout="single", memory_mib=24000, tier=tier,
        args=args, fallbacks=fallbacks, port=free_port(), env=env or {}, executable=(str(standin),),
        model="/models/Qwen3-8B", served_name="qwen3-8b")


def tiered_plan(standin: Path, env: dict[str, str]) -> EnginePlan:
    return standin_plan(standin, tier="40000", args=BASE + TIER_40000,
                        fallbacks=(("24000", BASE + TIER_24000), (None, BASE)), env=env)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def __call__(self, snapshot: EngineSnapshot, reason: str) -> None:
        self.events.append((snapshot.state, reason))

    def states(self) -> list[str]:
        return [state for state, _ in self.events]


def supervisor(plan: EnginePlan, tmp_path: Path, recorder: Recorder | None = None,
               timing: SupervisorTiming = FAST, *, unix_socket: bool = True) -> EngineSupervisor:
    return EngineSupervisor(plan, paths=Paths.under(tmp_path).ensure(), on_event=recorder, timing=timing,
                            backoff=TINY_BACKOFF, base_env=dict(os.environ), unix_socket=unix_socket)


def client(target: Target, **options: Any) -> httpx.AsyncClient:
    return engine_client(target.socket_path, **options)


def tcp_listeners(pid: int) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP listener of the process and its children."""
    found = []
    root = psutil.Process(pid)
    for member in [root, *root.children(recursive=True)]:
        found += [(member.pid, c.laddr.ip, c.laddr.port) for c in member.net_connections(kind="inet")
                  if c.status == psutil.CONN_LISTEN]
    return found


async def test_ready_after_models_and_a_real_completion(vllm_standin: Path, tmp_path: Path) -> None:
    recorder = Recorder()
    sup = supervisor(standin_plan(vllm_standin), tmp_path, recorder)
    await sup.start()
    snap = await sup.wait_for_state("ready", "failed", timeout=10)
    try:
        assert snap.state == "ready"
        assert recorder.states()[0] == "starting" and recorder.states()[-1] == "ready"
        assert snap.kv_cache_tokens == 445888 and snap.kv_cache_gib == 61.23
        assert snap.max_concurrency == pytest.approx(445888 / 4096, abs=0.01)
        assert snap.context.declared == 4096 and snap.context.physical == 445888
        assert not any(sup.target().api_key in arg for arg in snap.argv) and "--api-key" not in snap.argv
        assert snap.argv[snap.argv.index("--host") + 1] == "127.0.0.1"
        target = sup.target()
        assert target is not None and target.served_name == "qwen3-8b" and target.engine_id == "e0"
        assert snap.argv[snap.argv.index("--uds") + 1] == target.socket_path
        async with client(target) as http:
            denied = await http.get(f"{target.base_url}/v1/models")
            allowed = await http.get(f"{target.base_url}/v1/models",
                                     headers={"Authorization": f"Bearer {target.api_key}"})
        assert denied.status_code == 401 and allowed.json()["data"][0]["id"] == "qwen3-8b"
        assert Path(snap.log_path).read_text().count("GPU KV cache size: 445,888 tokens") == 1
    finally:
        await sup.stop()
    assert sup.snapshot().state == "stopped" and sup.target() is None
    assert not psutil.pid_exists(snap.pid) or psutil.Process(snap.pid).status() == psutil.STATUS_ZOMBIE


async def test_old_vllm_prints_kv_and_concurrency_on_two_lines(vllm_standin: Path, tmp_path: Path) -> None:
    env = {"STANDIN_VERSION": "0.11", "STANDIN_KV_TOKENS": "44880", "STANDIN_KV_GIB": "5.48"}
    sup = supervisor(standin_plan(vllm_standin, env=env), tmp_path)
    await sup.start()
    snap = await sup.wait_for_state("ready", "failed", timeout=10)
    await sup.stop()
    assert (snap.state, snap.kv_cache_tokens, snap.kv_cache_gib) == ("ready", 44880, 5.48)
    assert snap.max_concurrency == pytest.approx(44880 / 4096, abs=0.01)


async def test_new_api_key_and_run_id_for_every_run(vllm_standin: Path, tmp_path: Path) -> None:
    env = {"STANDIN_CRASH_AFTER_REQUESTS": "2"}
    sup = supervisor(standin_plan(vllm_standin, env=env), tmp_path)
    await sup.start()
    await sup.wait_for_state("ready", timeout=10)
    first_run, first_key = sup.run_id, sup.target().api_key
    async with client(sup.target()) as http:  # the probe was request 1; this is the 2nd
        await http.post(f"{sup.target().base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                        headers={"Authorization": f"Bearer {first_key}"})
    await sup.wait_for_state("starting", timeout=5)
    snap = await sup.wait_for_state("ready", timeout=10)
    second_run, second_key = sup.run_id, sup.target().api_key
    await sup.stop()
    assert "exited with status 1" in snap.last_error and "STANDIN_CRASH_AFTER_REQUESTS" in snap.last_error
    assert second_run != first_run and second_key != first_key and sup.target() is None
    assert snap.restarts == 1


async def test_out_of_memory_falls_back_to_the_next_tier(vllm_standin: Path, tmp_path: Path) -> None:
    recorder = Recorder()
    plan = tiered_plan(vllm_standin, {"STANDIN_OOM_ABOVE_MAX_MODEL_LEN": "8192"})
    sup = supervisor(plan, tmp_path, recorder)
    await sup.start()
    snap = await sup.wait_for_state("ready", "failed", timeout=15)
    await sup.stop()
    assert snap.state == "ready" and snap.tier == "24000"
    assert snap.argv[snap.argv.index("--max-num-seqs") + 1] == "64"
    assert any("out of memory while starting on tier 40000; retrying on tier 24000" in r for _, r in recorder.events)
    assert snap.restarts == 0


async def test_out_of_memory_twice_ends_on_base_args(vllm_standin: Path, tmp_path: Path) -> None:
    recorder = Recorder()
    plan = tiered_plan(vllm_standin, {"STANDIN_OOM_ABOVE_MAX_MODEL_LEN": "4096"})
    sup = supervisor(plan, tmp_path, recorder)
    await sup.start()
    snap = await sup.wait_for_state("ready", "failed", timeout=15)
    await sup.stop()
    assert snap.state == "ready" and snap.tier is None and "--max-num-seqs" not in snap.argv
    assert any("retrying on base args" in reason for _, reason in recorder.events)


async def test_out_of_memory_on_base_args_fails_with_advice(vllm_standin: Path, tmp_path: Path) -> None:
    plan = tiered_plan(vllm_standin, {"STANDIN_OOM_ABOVE_MAX_MODEL_LEN": "1000"})
    sup = supervisor(plan, tmp_path)
    await sup.start()
    snap = await sup.wait_for_state("ready", "failed", timeout=15)
    await sup.stop()
    assert snap.state == "failed" and "even with base args" in snap.last_error
    assert "Free GPU memory" in snap.last_error


async def test_max_model_len_refusal_fails_with_the_engines_numbers(vllm_standin: Path, tmp_path: Path) -> None:
    env = {"STANDIN_KV_TOKENS": "3000"}
    sup = supervisor(standin_plan(vllm_standin, env=env), tmp_path)
    await sup.start()
    snap = await sup.wait_for_state("ready", "failed", timeout=10)
    await sup.stop()
    assert snap.state == "failed" and snap.restarts == 0
    assert "4096" in snap.last_error and "3000" in snap.last_error
    assert "--max-model-len" in snap.last_error


async def test_crash_loop_ends_failed_with_the_last_error_lines(vllm_standin: Path, tmp_path: Path) -> None:
    recorder = Recorder()
    delays: list[float] = []

    async def sleep(seconds: float) -> None:
        delays.append(seconds)

    sup = EngineSupervisor(standin_plan(vllm_standin, env={"STANDIN_EXIT_AT_START": "3"}),
                           paths=Paths.under(tmp_path).ensure(), on_event=recorder, timing=FAST,
                           backoff=Backoff(initial_s=2, maximum_s=300), sleep=sleep)
    await sup.start()
    snap = await sup.wait_for_state("failed", timeout=15)
    await sup.stop()
    assert delays == [2, 4]
    assert snap.restarts == FAST.max_fast_failures - 1
    assert "failed 3 times in a row" in snap.last_error
    assert "STANDIN_EXIT_AT_START" in snap.last_error and "status 3" in snap.last_error
    assert recorder.states().count("starting") >= FAST.max_fast_failures


async def test_engine_that_stops_answering_is_restarted(vllm_standin: Path, tmp_path: Path) -> None:
    recorder = Recorder()
    sup = supervisor(standin_plan(vllm_standin, env={"STANDIN_FREEZE_AFTER_REQUESTS": "1"}), tmp_path, recorder)
    await sup.start()
    await sup.wait_for_state("ready", timeout=10)
    first_pid = sup.snapshot().pid
    snap = await _restarted(sup)
    await sup.stop()
    assert "degraded" in recorder.states()
    assert snap.pid != first_pid and "stopped answering /health" in snap.last_error
    assert not psutil.pid_exists(first_pid) or psutil.Process(first_pid).status() == psutil.STATUS_ZOMBIE


async def test_no_token_progress_with_requests_in_flight_restarts(vllm_standin: Path, tmp_path: Path) -> None:
    sup = supervisor(standin_plan(vllm_standin, env={"STANDIN_STALL_AFTER_REQUESTS": "1"}), tmp_path)
    await sup.start()
    await sup.wait_for_state("ready", timeout=10)
    target = sup.target()
    async with client(target, timeout=10) as http:
        sup.request_started()
        with pytest.raises(httpx.HTTPError):
            async with http.stream("POST", f"{target.base_url}/v1/chat/completions",
                                     headers={"Authorization": f"Bearer {target.api_key}"},
                                     json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as rsp:
                async for _chunk in rsp.aiter_bytes():
                    sup.note_progress()
        sup.request_finished()
    snap = await _restarted(sup)
    await sup.stop()
    assert "no token for" in snap.last_error and "1 request(s) in flight" in snap.last_error


async def test_slow_generation_with_progress_is_not_restarted(vllm_standin: Path, tmp_path: Path) -> None:
    sup = supervisor(standin_plan(vllm_standin, env={"STANDIN_TOKEN_DELAY_S": "0.1"}), tmp_path)
    await sup.start()
    await sup.wait_for_state("ready", timeout=10)
    target = sup.target()
    chunks = 0
    async with client(target, timeout=10) as http:
        sup.request_started()
        async with http.stream("POST", f"{target.base_url}/v1/completions",
                                 headers={"Authorization": f"Bearer {target.api_key}"},
                                 json={"prompt": "hi", "max_tokens": 12, "stream": True}) as rsp:
            async for line in rsp.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    sup.note_progress()
        sup.request_finished()
    snap = sup.snapshot()
    await sup.stop()
    assert chunks == 12 and snap.state == "ready" and snap.restarts == 0


async def test_engine_that_cannot_be_started_fails_at_once(tmp_path: Path) -> None:
    sup = supervisor(standin_plan(tmp_path / "no-such-vllm"), tmp_path)
    await sup.start()
    snap = await sup.wait_for_state("failed", timeout=5)
    await sup.stop()
    assert "Could not start" in snap.last_error and "installed" in snap.last_error


async def test_standin_streams_usage_like_vllm(vllm_standin: Path, tmp_path: Path) -> None:
    sup = supervisor(standin_plan(vllm_standin), tmp_path)
    await sup.start()
    await sup.wait_for_state("ready", timeout=10)
    target = sup.target()
    async with client(target, timeout=10) as http:
        body = {"model": "qwen3-8b", "messages": [{"role": "user", "content": "say hi"}], "max_tokens": 5,
                "stream": True, "stream_options": {"include_usage": True}}
        rsp = await http.post(f"{target.base_url}/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {target.api_key}"})
        metrics = (await http.get(f"{target.base_url}/metrics")).text
    await sup.stop()
    events = [line[6:] for line in rsp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert 'vllm:generation_tokens_total{engine="0",model_name="qwen3-8b"}' in metrics


async def _restarted(sup: EngineSupervisor) -> EngineSnapshot:
    await sup.wait_for_state("starting", timeout=10)
    return await sup.wait_for_state("ready", timeout=10)


async def test_standin_serves_a_hundred_concurrent_streams(vllm_standin: Path, tmp_path: Path) -> None:
    sup = supervisor(standin_plan(vllm_standin, env={"STANDIN_TOKEN_DELAY_S": "0.01"}), tmp_path)
    await sup.start()
    await sup.wait_for_state("ready", timeout=10)
    target = sup.target()
    headers = {"Authorization": f"Bearer {target.api_key}"}
    limits = httpx.Limits(max_connections=100)
    async with client(target, timeout=30, limits=limits) as http:
        async def stream() -> int:
            body = {"prompt": "hi", "max_tokens": 4, "stream": True}
            async with http.stream("POST", f"{target.base_url}/v1/completions", json=body, headers=headers) as rsp:
                return sum([line.startswith("data: {") async for line in rsp.aiter_lines()])

        counts = await asyncio.gather(*(stream() for _ in range(100)))
        metrics = (await http.get(f"{target.base_url}/metrics")).text
    await sup.stop()
    assert counts == [4] * 100
    assert 'vllm:generation_tokens_total{engine="0",model_name="qwen3-8b"} 404.0' in metrics  # + the probe's 4


async def test_engine_listens_on_a_private_socket_with_its_key_off_the_command_line(
        vllm_standin: Path, tmp_path: Path) -> None:
    sup = supervisor(standin_plan(vllm_standin), tmp_path)
    await sup.start()
    try:
        snap = await sup.wait_for_state("ready", "failed", timeout=10)
        assert snap.state == "ready", snap.last_error
        target = sup.target()
        socket_path = Path(target.socket_path)
        cmdline = Path(f"/proc/{snap.pid}/cmdline").read_bytes().decode()
        listeners = tcp_listeners(snap.pid)
        folder_mode = stat.S_IMODE(socket_path.parent.stat().st_mode)
        environ = psutil.Process(snap.pid).environ()
        print(f"\nkey on the command line: {target.api_key in cmdline}; TCP listeners: {listeners}; "
              f"socket folder mode: {oct(folder_mode)}")
        assert target.api_key not in cmdline and "--api-key" not in cmdline
        assert environ["VLLM_API_KEY"] == target.api_key  # where vLLM reads it when --api-key is absent
        assert stat.S_ISSOCK(socket_path.stat().st_mode) and socket_path.parent == tmp_path / "run" / "engines"
        assert folder_mode == 0o700 and listeners == []
        assert environ["XDG_CONFIG_HOME"] == str(socket_path.parent)
    finally:
        await sup.stop()
    assert not socket_path.exists()


async def test_a_relayed_completion_reaches_the_engine_through_its_socket(vllm_standin: Path, tmp_path: Path) -> None:
    sup = supervisor(standin_plan(vllm_standin), tmp_path)
    await sup.start()
    frames: list[BaseModel] = []

    async def send(message: BaseModel) -> bool:
        frames.append(message)
        return True

    try:
        await sup.wait_for_state("ready", timeout=10)
        t = sup.target()
        target = EngineTarget(t.engine_id, t.base_url, t.api_key, t.served_name, t.socket_path)
        async with engine_http_client() as http:
            relay = Relay(send, lambda: [target], lambda: None, http=http)
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
            await relay.handle(protocol.Request(id="r-1", method="POST", path="/v1/chat/completions", body=body))
    finally:
        await sup.stop()
    head, *chunks, end = frames
    assert isinstance(head, protocol.ResponseHead) and head.status == 200
    assert isinstance(end, protocol.ResponseEnd) and end.usage is not None and end.usage.completion_tokens == 3
    assert "data: [DONE]" in "".join(c.data for c in chunks if isinstance(c, protocol.ResponseChunk))


async def test_without_sockets_the_engine_is_on_loopback_with_the_key_in_its_environment(
        vllm_standin: Path, tmp_path: Path) -> None:
    plan = standin_plan(vllm_standin)
    sup = supervisor(plan, tmp_path, unix_socket=False)
    await sup.start()
    try:
        snap = await sup.wait_for_state("ready", "failed", timeout=10)
        assert snap.state == "ready", snap.last_error
        target = sup.target()
        cmdline = Path(f"/proc/{snap.pid}/cmdline").read_bytes().decode()
        async with client(target) as http:
            denied = await http.get(f"{target.base_url}/v1/models")
        assert target.socket_path is None and target.base_url == f"http://127.0.0.1:{plan.port}"
        assert tcp_listeners(snap.pid) == [(snap.pid, "127.0.0.1", plan.port)]
        assert target.api_key not in cmdline and denied.status_code == 401
    finally:
        await sup.stop()
