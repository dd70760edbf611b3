"""The vLLM path without a GPU: the supervisor drives the stand-in (a real child process serving
real HTTP on a Unix socket, or on 127.0.0.1) through start, KV parsing, OOM fallback, refusals,
crash loops and hangs."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.support.engines import engine_client, free_port
from tests.support.wire import Wire
from worker.contract import protocol
from worker.system.config import Paths
from worker.contract.events import EngineSnapshot
from worker.plan.planner import EnginePlan
from worker.serve.process import StopTiming
from worker.relay.forward import Relay, RelayHooks, engine_http_client
from worker.serve.restart_policy import RestartBackoff, SupervisorTiming
from worker.relay.forward import EngineTarget
from worker.serve.supervisor import EngineSupervisor

pytestmark = pytest.mark.integration

FAST = SupervisorTiming(
    ready_timeout_s=10, poll_s=0.05, request_timeout_s=1.0, probe_timeout_s=2.0, health_interval_s=0.1,
    health_timeout_s=1.0, health_failures=2, stable_after_s=30, max_fast_failures=3, output_settle_s=1.0,
    stop=StopTiming(grace_s=2.0, gone_s=2.0, poll_s=0.02))
TINY_BACKOFF = RestartBackoff(initial_s=0.01, maximum_s=0.05)
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


def client(target: EngineTarget, **options: Any) -> httpx.AsyncClient:
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
        assert target is not None and target.served_model_name == "qwen3-8b" and target.engine_id == "e0"
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
                           backoff=RestartBackoff(initial_s=2, maximum_s=300), sleep=sleep)
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
    wire = Wire()
    frames = wire.frames

    try:
        await sup.wait_for_state("ready", timeout=10)
        target = sup.target()
        assert target is not None
        async with engine_http_client() as http:
            relay = Relay(wire, lambda: [target], lambda: None, http=http)
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


class EngineHooks(RelayHooks):
    """What the node tells a supervisor about the requests the relay hands its engine."""

    def __init__(self, sup: EngineSupervisor) -> None:
        self.sup = sup

    def on_start(self, request_id: str, engine_id: str, t: float) -> None:
        self.sup.request_started()

    def on_end(self, request_id: str, engine_id: str, t: float, usage: protocol.Usage | None, ok: bool) -> None:
        self.sup.request_finished()


@pytest.mark.parametrize("stream", [False, True], ids=["whole-answer", "quiet-stream"])
async def test_a_long_quiet_generation_on_a_healthy_engine_runs_to_its_end(
        vllm_standin: Path, tmp_path: Path, stream: bool) -> None:
    """Quiet for 0.6 s before each token (1.2 s in all), six health checks' time: an answer that
    arrives whole, or a stream whose first token is late, is no sign of a dead engine."""
    slow = standin_plan(vllm_standin, env={"STANDIN_TOKEN_DELAY_S": "0.6"})
    sup = supervisor(slow, tmp_path, timing=dataclasses.replace(FAST, probe_timeout_s=5.0))
    await sup.start()
    wire = Wire()
    frames = wire.frames

    try:
        await sup.wait_for_state("ready", timeout=10)
        pid, target = sup.snapshot().pid, sup.target()
        assert target is not None
        async with engine_http_client() as http:
            relay = Relay(wire, lambda: [target], lambda: None, http=http, hooks=EngineHooks(sup))
            body = {"model": "qwen3-8b", "prompt": "hi", "max_tokens": 2, "stream": stream}
            await relay.handle(protocol.Request(id="r-1", method="POST", path="/v1/completions", body=body))
        snap = sup.snapshot()
    finally:
        await sup.stop()
    end = frames[-1]
    assert isinstance(end, protocol.ResponseEnd), end
    assert end.usage is not None and end.usage.completion_tokens == 2
    assert (snap.state, snap.restarts, snap.pid) == ("ready", 0, pid) and sup.in_flight == 0


async def test_a_health_check_that_hangs_three_times_in_a_row_restarts_the_engine(
        vllm_standin: Path, tmp_path: Path) -> None:
    recorder = Recorder()
    timing = dataclasses.replace(FAST, health_failures=3, health_timeout_s=0.3)
    sup = supervisor(standin_plan(vllm_standin, env={"STANDIN_FREEZE_AFTER_REQUESTS": "1"}), tmp_path, recorder,
                     timing)
    await sup.start()
    await sup.wait_for_state("ready", timeout=10)
    first_pid = sup.snapshot().pid
    snap = await _restarted(sup)
    await sup.stop()
    degraded = [reason for state, reason in recorder.events if state == "degraded"]
    assert degraded == ["health check failed: no answer within 0.3 s"]
    assert snap.pid != first_pid
    assert snap.last_error == "stopped answering /health (no answer within 0.3 s, 3 checks in a row)"


def memory_guarded_vllm(tmp_path: Path, standin: Path) -> Path:
    """vLLM's start-up memory check in front of the stand-in: with `--gpu-memory-utilization` above
    the share in FREE_SHARE (a file, so the test can change it) it refuses as vLLM does and exits 1."""
    executable = tmp_path / "vllm"
    executable.write_text(f"""#!{sys.executable}
import os, pathlib, sys
args = sys.argv[1:]
flags = [i for i, a in enumerate(args) if a == "--gpu-memory-utilization"]
wanted = float(args[flags[-1] + 1]) if flags else 0.92
free = float(pathlib.Path({str(tmp_path / "FREE_SHARE")!r}).read_text())
if wanted > free:
    print(f"(EngineCore pid={{os.getpid()}}) ERROR 11-29 12:10:09 [core.py:1584] ValueError: Free memory on device "
          f"cuda:0 ({{free * 23.52:.2f}}/23.52 GiB) on startup is less than desired GPU memory utilization "
          f"({{wanted}}, {{wanted * 23.52:.2f}} GiB). Decrease GPU memory utilization or reduce GPU memory used by "
          "other processes.", file=sys.stderr, flush=True)
    sys.exit(1)
os.execv({str(standin)!r}, [{str(standin)!r}, *args])
""")
    executable.chmod(0o755)
    return executable


async def test_free_memory_refusal_measures_again_and_waits_on_the_same_tier(
        vllm_standin: Path, tmp_path: Path) -> None:
    """Another program holds the card: no tier is dropped; the supervisor waits, measures again,
    and starts with what the card has free now."""
    (tmp_path / "FREE_SHARE").write_text("0.5")
    guarded = memory_guarded_vllm(tmp_path, vllm_standin)
    plan = dataclasses.replace(tiered_plan(guarded, {}), memory_utilization=0.9)
    readings = [0.8, 0.45]  # still held at the first look, freed enough at the second
    measured: list[EnginePlan] = []
    delays: list[float] = []

    async def remeasure(engine_plan: EnginePlan) -> float | None:
        measured.append(engine_plan)
        return readings.pop(0)

    async def sleep(seconds: float) -> None:
        delays.append(seconds)

    recorder = Recorder()
    sup = EngineSupervisor(plan, paths=Paths.under(tmp_path).ensure(), on_event=recorder, timing=FAST,
                           backoff=TINY_BACKOFF, base_env=dict(os.environ), sleep=sleep, remeasure=remeasure)
    await sup.start()
    snap = await sup.wait_for_state("ready", "failed", timeout=20)
    await sup.stop()
    assert snap.state == "ready", snap.last_error
    assert snap.tier == "40000" and snap.argv[snap.argv.index("--max-num-seqs") + 1] == "128"
    assert snap.argv[snap.argv.index("--gpu-memory-utilization") + 1] == "0.45"
    assert delays == [2, 4] and [p.memory_utilization for p in measured] == [0.9, 0.8]
    waiting = [r for state, r in recorder.events if "Another program is using the GPU's memory" in r]
    assert len(waiting) == 2 and all(state == "starting" for state, r in recorder.events if r in waiting)
    assert snap.restarts == 0 and "Free memory on device" in (snap.last_error or "")


# --- the stand-in refuses as vLLM does (engines.md A3), on a card the desktop holds ------------------

# A display-attached RTX 4090 (tests/fixtures/nvml/rtx4090-desktop.json): 2,950 of 24,564 MiB held.
DESKTOP_4090 = {"STANDIN_GPU_TOTAL_MIB": "24564", "STANDIN_GPU_FREE_MIB": "21614", "CUDA_VISIBLE_DEVICES": "0"}
MEASURED_SHARE = 0.771  # what the plan tells vLLM there: usable 18,940 / 24,564, rounded down


async def run_standin(standin: Path, args: list[str], env: dict[str, str], tmp_path: Path) -> tuple[int, str]:
    """The stand-in started bare (no supervisor) as the app would start vLLM: its exit status and
    everything it printed, once it exits or prints that it listens (then it is stopped)."""
    socket_path = tmp_path / f"e{len(list(tmp_path.glob('*.sock')))}.sock"  # a failed start leaves its socket file
    child_env = {**os.environ, "STANDIN_ENGINE_CORE": "0", **env}
    process = await asyncio.create_subprocess_exec(
        str(standin), "serve", "/models/Qwen3-8B", *args, "--host", "127.0.0.1", "--uds", str(socket_path),
        env=child_env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    assert process.stdout is not None
    lines: list[str] = []
    async with asyncio.timeout(10):
        async for raw in process.stdout:
            lines.append(raw.decode().rstrip("\n"))
            if "Starting vLLM server on" in lines[-1]:
                process.terminate()
        status = await process.wait()
    return (0 if any("Starting vLLM server on" in line for line in lines) else status), "\n".join(lines)


def vllm_line(output: str, text: str) -> str:
    """The one line carrying `text`, without vLLM's `(Process pid=N) LEVEL date [file:line] ` prefix."""
    (line,) = [line for line in output.splitlines() if text in line]
    return line.split("] ", 1)[1] if "] " in line else line


async def test_vllms_default_share_is_refused_on_a_card_the_desktop_holds(vllm_standin: Path, tmp_path: Path) -> None:
    """0.92 × 24,564 MiB = 22.07 GiB asked of a card with 21.11 GiB free: vLLM's first check fails."""
    status, output = await run_standin(vllm_standin, ["--max-model-len", "4096"], DESKTOP_4090, tmp_path)
    assert status == 1
    assert vllm_line(output, "Free memory on device") == (
        "ValueError: Free memory on device cuda:0 (21.11/23.99 GiB) on startup is less than desired GPU memory "
        "utilization (0.92, 22.07 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.")
    assert vllm_line(output, "EngineCore failed to start") == "EngineCore failed to start."
    assert "RuntimeError: Engine core initialization failed. See root cause above." in output
    assert "Loading model" not in output  # vLLM checks before it loads anything


async def test_the_measured_share_passes_the_check_and_sizes_the_kv_cache(vllm_standin: Path, tmp_path: Path) -> None:
    """0.771 × 24,564 MiB less 16,000 MiB of weights and the 1,536 MiB activation reserve leaves
    1,403 MiB: 1.37 GiB, 9,968 tokens at 144 KiB a token (whole blocks of 16)."""
    env = {**DESKTOP_4090, "STANDIN_WEIGHTS_MIB": "16000"}
    args = ["--max-model-len", "8192", "--gpu-memory-utilization", str(MEASURED_SHARE)]
    status, output = await run_standin(vllm_standin, args, env, tmp_path)
    assert status == 0, output
    assert vllm_line(output, "Available KV cache memory") == "Available KV cache memory: 1.37 GiB"
    assert vllm_line(output, "GPU KV cache size") == (
        "GPU KV cache size: 9,968 tokens, Maximum concurrency for 8,192 tokens per request: 1.22x")
    assert vllm_line(output, "Model loading took") == "Model loading took 15.62 GiB memory and 0.012000 seconds"


async def test_a_context_the_kv_cache_cannot_hold_is_refused_with_vllms_numbers(
        vllm_standin: Path, tmp_path: Path) -> None:
    env = {**DESKTOP_4090, "STANDIN_WEIGHTS_MIB": "16000"}
    args = ["--max-model-len", "131072", "--gpu-memory-utilization", str(MEASURED_SHARE)]
    status, output = await run_standin(vllm_standin, args, env, tmp_path)
    assert status == 1
    assert vllm_line(output, "To serve at least one request") == (
        "ValueError: To serve at least one request with the model's max seq len (131072), (18.0 GiB KV cache is "
        "needed, which is larger than the available KV cache memory (1.37 GiB). Based on the available memory, the "
        "estimated maximum model length is 9968. Try increasing `gpu_memory_utilization` (which also controls CPU "
        "memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. See "
        "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.")
    assert "EngineCore failed to start." in output


async def test_a_share_that_leaves_nothing_after_the_weights_has_no_cache_blocks(
        vllm_standin: Path, tmp_path: Path) -> None:
    env = {**DESKTOP_4090, "STANDIN_WEIGHTS_MIB": "16000"}
    status, output = await run_standin(vllm_standin, ["--gpu-memory-utilization", "0.6"], env, tmp_path)
    assert status == 1
    assert vllm_line(output, "No available memory") == (
        "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
        "initializing the engine (this flag also controls CPU memory reservation on the CPU backend, despite its "
        "name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.")


async def test_every_tensor_parallel_worker_checks_its_own_card(vllm_standin: Path, tmp_path: Path) -> None:
    """GPU 1 of two (CUDA_VISIBLE_DEVICES=1,2 makes it cuda:0) is fine; GPU 2, cuda:1, is held."""
    env = {"STANDIN_GPU_TOTAL_MIB": "24564", "STANDIN_GPU_FREE_MIB": "24000,24000,21614",
           "CUDA_VISIBLE_DEVICES": "1,2"}
    args = ["--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.9"]
    status, output = await run_standin(vllm_standin, args, env, tmp_path)
    assert status == 1 and "Free memory on device cuda:1 (21.11/23.99 GiB)" in output
    assert "cuda:0" not in output
    status, _ = await run_standin(vllm_standin, [*args[:2], "--gpu-memory-utilization", "0.87"], env, tmp_path)
    assert status == 0


async def test_vllm_011_wording_of_the_free_memory_refusal(vllm_standin: Path, tmp_path: Path) -> None:
    status, output = await run_standin(vllm_standin, [], {**DESKTOP_4090, "STANDIN_VERSION": "0.11"}, tmp_path)
    assert status == 1
    assert vllm_line(output, "Free memory on device") == (
        "ValueError: Free memory on device (21.11/23.99 GiB) on startup is less than desired GPU memory utilization "
        "(0.92, 22.07 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.")


async def test_an_idle_default_card_still_passes_any_share(vllm_standin: Path, tmp_path: Path) -> None:
    status, output = await run_standin(vllm_standin, ["--gpu-memory-utilization", "0.99"], {}, tmp_path)
    assert status == 0 and "GPU KV cache size: 445,888 tokens" in output


async def test_the_supervisor_brings_up_vllm_on_the_desktop_card_with_the_measured_share(
        vllm_standin: Path, tmp_path: Path) -> None:
    plan = dataclasses.replace(standin_plan(vllm_standin, env={**DESKTOP_4090, "STANDIN_WEIGHTS_MIB": "16000"}),
                               memory_utilization=MEASURED_SHARE)
    sup = supervisor(plan, tmp_path)
    await sup.start()
    snap = await sup.wait_for_state("ready", "failed", timeout=10)
    await sup.stop()
    assert snap.state == "ready", snap.last_error
    assert snap.argv[snap.argv.index("--gpu-memory-utilization") + 1] == "0.771"
    assert (snap.kv_cache_tokens, snap.kv_cache_gib) == (9968, 1.37)


async def test_a_context_the_kv_cache_cannot_hold_falls_back_to_the_next_tier(
        vllm_standin: Path, tmp_path: Path) -> None:
    recorder = Recorder()
    sup = supervisor(tiered_plan(vllm_standin, {"STANDIN_KV_TOKENS": "10000"}), tmp_path, recorder)
    await sup.start()
    snap = await sup.wait_for_state("ready", "failed", timeout=15)
    await sup.stop()
    assert snap.state == "ready" and snap.tier == "24000", snap.last_error
    assert snap.argv[snap.argv.index("--max-num-seqs") + 1] == "64" and snap.restarts == 0
    assert ("starting", "the KV cache cannot hold the context on tier 40000; retrying on tier 24000") in recorder.events


async def test_a_fixed_kv_budget_and_a_described_card_together_are_refused(vllm_standin: Path, tmp_path: Path) -> None:
    """Either the KV budget is fixed (STANDIN_KV_*) or it follows from the card, never both at once."""
    status, output = await run_standin(vllm_standin, [], {**DESKTOP_4090, "STANDIN_KV_TOKENS": "3000"}, tmp_path)
    assert status == 2 and "STANDIN_KV_* fix the KV budget of the default card" in output
