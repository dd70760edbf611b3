"""The node as a person runs it: ready→reported-ready latency and the idle footprint.

The node is the real `gpu-provider run --headless` process (the desktop app's idle figures are
`bench.gui_idle`'s, on a real X server), connected to a reference coordinator in this process that
assigns a model. The engine is the vLLM stand-in (`tests/standin/vllm`, given with `--engine-bin`)
on a recorded RTX 4090, so the whole start path runs: plan, provision (a local model folder),
supervise, readiness probe.

- Ready latency: this process polls the engine's `/health` every few milliseconds; the latency
  is from its first 200 to the `status` frame with `state: ready` reaching the coordinator.
- Footprint: once ready and settled, the node process's CPU time over a window (engine children
  excluded; they are the work, not the app) and its resident memory.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.report import Figure, at_most, cpu_percent, not_measured
from tests.support.engines import VLLM_STANDIN
from tests.support.processes import terminate
from tests.worker.hardware.recorded import replay
from worker.contract import protocol
from worker.link.local import ReferenceCoordinator

SECTION = "node"
TOKEN = "bench-node-token"
TARGET_READY_S = 1.0
TARGET_CPU_PCT = 0.2  # headless idle, of one core (issue 16; `bench.gui_idle` measures it beside the GUI)
TARGET_RSS_HEADLESS_MB = 120
ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class Reading:
    ready_s: float
    cpu_pct: float
    rss_mb: float
    window_s: float


def _assignment(model_dir: Path) -> protocol.Assign:
    return protocol.Assign.model_validate({"assignment_id": "bench-1", "model": {
        "name": "tiny-1b",
        "vllm": {"source": str(model_dir), "weights_mib": 700, "base_args": ["--max-model-len", "4096"]}}})


def _prepare(folder: Path) -> tuple[Path, Path]:
    """A model folder the stand-in can "load", and the recorded 4090 as `detect` output."""
    model_dir = folder / "models" / "tiny-1b"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}', encoding="utf-8")
    (model_dir / "model.safetensors").write_bytes(b"\0" * 4096)
    hardware = folder / "rtx4090.json"
    hardware.write_text(json.dumps(replay("rtx4090.json").to_detect_json()), encoding="utf-8")
    return model_dir, hardware


def _environment(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env["GPU_PROVIDER_TOKEN"] = TOKEN
    env["STANDIN_START_DELAY_S"] = "1.0"  # so that "the engine became ready" is a moment after the start
    env["STANDIN_ENGINE_CORE"] = "0"
    return env | extra


def _engine_address(status: protocol.Status) -> str | None:
    """Where the engine listens, from its command line: its Unix socket (`--uds`) or `--port`."""
    for engine in status.engines:
        for flag in ("--uds", "--port"):
            if flag in engine.argv:
                return engine.argv[engine.argv.index(flag) + 1]
    return None


async def _first_health(address: str, give_up: float) -> float:
    """The moment the engine first answers /health (polled every 5 ms)."""
    socket_path = None if address.isdigit() else address
    url = "http://localhost/health" if socket_path else f"http://127.0.0.1:{address}/health"
    transport = httpx.AsyncHTTPTransport(uds=socket_path)
    async with httpx.AsyncClient(transport=transport, trust_env=False, timeout=0.5) as client:
        while time.monotonic() < give_up:
            try:
                if (await client.get(url)).status_code == 200:
                    return time.monotonic()
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.005)
    raise TimeoutError(f"the engine at {address} never answered /health")


async def _read_node(argv: list[str], env: dict[str, str], coordinator: ReferenceCoordinator,
                     window_s: float) -> Reading:
    process = await asyncio.create_subprocess_exec(*argv, cwd=ROOT, env=env, stdout=asyncio.subprocess.DEVNULL,
                                                   stderr=asyncio.subprocess.DEVNULL)
    try:
        give_up = time.monotonic() + START_TIMEOUT_S
        starting = await coordinator.wait_for(
            lambda m: isinstance(m, protocol.Status) and _engine_address(m) is not None, timeout=START_TIMEOUT_S)
        ready = asyncio.ensure_future(coordinator.wait_for(
            lambda m: isinstance(m, protocol.Status) and m.state == "ready", timeout=START_TIMEOUT_S))
        reported: list[float] = []
        ready.add_done_callback(lambda _: reported.append(time.monotonic()))
        engine_ready = await _first_health(_engine_address(starting) or "0", give_up)
        await ready
        ready_s = reported[0] - engine_ready
        await asyncio.sleep(3.0)  # let start-up work settle before the idle window
        node = psutil.Process(process.pid)
        before = node.cpu_times()
        await asyncio.sleep(window_s)
        after = node.cpu_times()
        cpu_s = (after.user - before.user) + (after.system - before.system)
        return Reading(ready_s, cpu_percent(cpu_s, window_s), node.memory_info().rss / 2**20, window_s)
    finally:
        await terminate(process, 40)


async def _one(window_s: float) -> Reading:
    with tempfile.TemporaryDirectory(prefix="bench-node-") as tmp:
        folder = Path(tmp)
        model_dir, hardware = _prepare(folder)
        async with ReferenceCoordinator(token=TOKEN, assign=_assignment(model_dir), ping_interval=None) as coordinator:
            argv = [sys.executable, "-m", "worker", "run", "--headless", "--coordinator", coordinator.url,
                    "--hardware", str(hardware), "--data-dir", str(folder / "data"), "--engine-bin", f"vllm={VLLM_STANDIN}"]
            return await _read_node(argv, _environment({}), coordinator, window_s)


async def measure(quick: bool) -> tuple[list[Figure], dict[str, Any]]:
    """The headless node; the desktop app's idle figures are `bench.gui_idle`'s (a real X server)."""
    window_s = 5.0 if quick else 30.0
    details: dict[str, Any] = {"window_s": window_s}
    try:
        reading = await _one(window_s)
    except (TimeoutError, OSError, psutil.Error) as exc:
        why_not = f"{type(exc).__name__}: {exc}"
        return [not_measured(SECTION, "headless: idle CPU", why_not, f"≤ {TARGET_CPU_PCT} %")], details
    details["headless"] = reading.__dict__
    return [
        at_most(SECTION, "engine ready → node reports ready", reading.ready_s, "s", TARGET_READY_S,
                "first /health 200 → status ready at the coordinator"),
        at_most(SECTION, "headless: idle CPU", reading.cpu_pct, "%", TARGET_CPU_PCT,
                f"of one core, over {window_s:g} s, serving, no requests"),
        at_most(SECTION, "headless: RSS", reading.rss_mb, "MB", TARGET_RSS_HEADLESS_MB, "engine children excluded"),
    ], details
