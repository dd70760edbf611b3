"""Relay benchmark: streamed tokens/s and per-chunk latency, through the relay and direct.

Three processes: the stamped fake engine, the node side (`bench.relay_node`: Link ⇄ Relay ⇄
engine client, pinned to one CPU), and this one, which is the load generator *and* the reference
coordinator: it sends `request` frames from `worker.link.local.ReferenceCoordinator` over the real
websocket and reads the `response.*` frames, as the coordinator's caller would. "Direct" is the
same load sent from this process straight to the engine with `worker.relay.loopback_http` (a client
cheap enough that direct measures the engine, not the client).

- Throughput: closed loop, C streams at once, each asking for `tokens` tokens, until about
  `budget` tokens have streamed. Counted by the engine's stamps that reached the caller.
- Node CPU: the node process's CPU seconds over the run, so "tokens per node CPU-second" is what
  one core can relay even when this machine's other cores (load generator, engine) are the limit.
- Latency: a paced engine (one token per `paced_delay_s`, as a real decode), each chunk's arrival
  minus the engine's stamp; the relay's *added* latency is its percentile minus direct's.
- Field loads also time the node's own part (`bench.relay_node --held`): from the engine's stamp
  to the frame handed to the websocket's socket, so that what the node adds is told apart from
  what the coordinator stand-in adds when it shares a saturated core with the engine.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import pstats
import re
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from io import StringIO
from pathlib import Path
from typing import Any

import psutil

from bench.relay_node import TOKEN
from bench.report import Figure, at_least, at_most, info
from bench.stamped_engine import API_KEY
from tests.support.processes import terminate
from worker.contract import protocol
from worker.link.local import ReferenceCoordinator
from worker.relay.loopback_http import LoopbackClient
from worker.serve.supervisor import UNIX_SOCKETS

SECTION = "relay"
TARGET_TOKENS_PER_S = 33_000
TARGET_CAPACITY = 150_000  # tokens per node CPU-second: an 8-GPU node's 26,000 tok/s with room to spare
TARGET_SHARE_OF_DIRECT = 0.95
TARGET_ADDED_P99_MS = 2.0
RAMP_SETTLE_S = 0.2
_STAMP = re.compile(r'"t":(\d+)')
_STAMP_BYTES = re.compile(rb'"t":(\d+)')
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Scenario:
    """A load from the field notes, paced as real decodes, through the relay and direct side by side."""

    name: str
    streams: int
    tok_per_s: float  # each stream's decode rate
    max_added_p99_ms: float


SCENARIOS = (
    Scenario("H200 load", 128, 26.0, 2.0),  # the field notes' busiest node: 3,342 tok/s over 128 requests
    Scenario("8-GPU load", 1024, 26.0, 10.0),  # eight such replicas behind one app
)
TARGET_SCENARIO_SHARE = 0.99


@dataclass(frozen=True)
class RelaySettings:
    levels: tuple[int, ...] = (1, 32, 128, 256)
    tokens: int = 256  # per stream, throughput runs
    budget: int = 200_000  # tokens per level and mode, throughput runs
    paced_tokens: int = 250  # per stream, latency runs
    paced_delay_s: float = 0.02
    ramp_s: float = 1.0  # latency runs: stream starts spread over this, as requests arrive in service
    profile: Path | None = None
    batch: bool = True  # the coordinator's welcome lists "batch", as the reference one's does; off (`--no-batch`): one frame per message
    scenarios: tuple[Scenario, ...] = SCENARIOS
    scenario_s: float = 10.0  # how long each stream of a scenario decodes
    scenario_ramp_s: float = 2.0

    @classmethod
    def quick(cls, **changes: Any) -> RelaySettings:
        return cls(budget=40_000, paced_tokens=100, scenario_s=4.0, **changes)


@dataclass
class Run:
    """One load at one concurrency, through one path."""

    mode: str
    concurrency: int
    tokens: int = 0
    seconds: float = 0.0
    errors: int = 0
    latencies_ns: list[int] = field(default_factory=list)
    node_cpu_s: float | None = None
    engine_cpu_s: float | None = None
    loadgen_cpu_s: float | None = None
    node_waited_s: float | None = None  # runnable but waiting for a CPU (Linux schedstat): contention
    measure_from_ns: int = 0  # chunks the engine stamped earlier (the ramp-up) are left out of latency
    held_ns: list[int] = field(default_factory=list)  # the node's own part, sampled (field loads)

    def record(self, now_ns: int, stamps: list[str] | list[bytes]) -> None:
        self.tokens += len(stamps)
        start = self.measure_from_ns
        self.latencies_ns.extend(now_ns - t for t in map(int, stamps) if t >= start)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def percentile_ms(self, q: float) -> float:
        return _percentile_ms(self.latencies_ns, q)

    def held_percentile_ms(self, q: float) -> float:
        return _percentile_ms(self.held_ns, q)


def _percentile_ms(values_ns: list[int], q: float) -> float:
    if not values_ns:
        return float("nan")
    ordered = sorted(values_ns)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6


@functools.cache
def cpu_split() -> tuple[str, str]:
    """(the node's CPU, everyone else's CPUs): the node gets one core to itself where possible.
    Worked out once, from the CPUs this process had before it moved itself off the node's."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cpus:
        return "", ""
    node = cpus[-1]
    others = [c for c in cpus if c != node] or [node]
    return str(node), ",".join(map(str, others))


async def _child(argv: list[str]) -> tuple[asyncio.subprocess.Process, str]:
    """Starts a helper process; returns it and the first line it prints (a URL, or "")."""
    process = await asyncio.create_subprocess_exec(
        *argv, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 60)
    return process, line.decode().strip()


@dataclass
class Rig:
    """A running engine, coordinator and node, ready for load."""

    engine_url: str
    engine_socket: str | None
    coordinator: ReferenceCoordinator
    node: asyncio.subprocess.Process
    engine: asyncio.subprocess.Process
    http: LoopbackClient

    def cpu_s(self) -> tuple[float, float, float]:
        """CPU seconds so far of the node, the engine and this process (the load generator)."""
        return tuple(sum(psutil.Process(pid).cpu_times()[:2])  # type: ignore[return-value]
                     for pid in (self.node.pid, self.engine.pid, os.getpid()))

    def node_waited_s(self) -> float | None:
        """Seconds the node's threads spent runnable but off a CPU, so far (None off Linux)."""
        total = 0
        try:
            for task in Path(f"/proc/{self.node.pid}/task").iterdir():
                total += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            return None
        return total / 1e9


def node_command(url: str, engine_url: str, socket: str | None, cpus: str, profile: Path | None,
                 held: Path | None = None) -> list[str]:
    return ([sys.executable, "-m", "bench.relay_node", "--url", url, "--engine", engine_url, "--cpus", cpus]
            + (["--engine-socket", socket] if socket else [])
            + (["--profile", str(profile)] if profile else []) + (["--held", str(held)] if held else []))


def engine_socket(folder: str) -> str | None:
    """Where the engine listens: a Unix socket where the app runs engines on one (Linux, macOS),
    so both paths cross the same kind of socket the node really reads; else None (127.0.0.1)."""
    return os.path.join(folder, "engine.sock") if UNIX_SOCKETS else None


@asynccontextmanager
async def rig(*, tokens: int, token_delay_s: float, profile: Path | None, batch: bool = False,
              held: Path | None = None) -> AsyncIterator[Rig]:
    node_cpu, other_cpus = cpu_split()
    with tempfile.TemporaryDirectory(prefix="gpb-") as folder:
        socket = engine_socket(folder)
        engine, engine_url = await _child([sys.executable, "-m", "bench.stamped_engine", "--tokens", str(tokens),
                                           "--token-delay", str(token_delay_s), "--cpus", other_cpus]
                                          + (["--socket", socket] if socket else []))
        coordinator = await ReferenceCoordinator(token=TOKEN, ping_interval=None, batch=batch, record=False).start()
        node = await asyncio.create_subprocess_exec(
            *node_command(coordinator.url, engine_url, socket, node_cpu, profile, held),
            cwd=ROOT, stdout=asyncio.subprocess.DEVNULL)
        http = LoopbackClient()
        try:
            await coordinator.wait_for_connections(1, timeout=60)
            yield Rig(engine_url, socket, coordinator, node, engine, http)
        finally:
            await terminate(node)
            await coordinator.stop()
            await http.aclose()
            await terminate(engine)


def _body(tokens: int) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "bench"}], "stream": True,
            "max_tokens": tokens}


async def _through_relay(coordinator: ReferenceCoordinator, tokens: int, run: Run) -> None:
    exchange = await coordinator.request(_body(tokens))
    async for frame in exchange.frames():
        if isinstance(frame, protocol.ResponseChunk):
            run.record(time.monotonic_ns(), _STAMP.findall(frame.data))
        elif isinstance(frame, protocol.ResponseError):
            run.errors += 1


async def _direct(client: LoopbackClient, engine_url: str, socket: str | None, tokens: int, run: Run) -> None:
    body = _body(tokens) | {"stream_options": {"include_usage": True}}  # what the relay asks the engine for
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    request = client.build_request("POST", engine_url + "/v1/chat/completions",
                                   content=json.dumps(body).encode(), headers=headers, socket_path=socket)
    response = await client.send(request)
    held = b""
    try:
        if response.status_code != 200:
            run.errors += 1
        async for raw in response.aiter_raw():
            now = time.monotonic_ns()
            data = held + raw
            end = data.rfind(b"\n\n") + 2  # stamps only from whole events: a read may split one
            held, data = data[end:], data[:end]
            run.record(now, _STAMP_BYTES.findall(data))
    finally:
        await response.aclose()


async def load(the_rig: Rig, mode: str, concurrency: int, tokens: int, requests_each: int,
               ramp_s: float = 0.0) -> Run:
    """C workers, each streaming `requests_each` answers one after another; with `ramp_s` the
    workers start evenly spread over that time, and latency counts only what follows the ramp."""
    run = Run(mode, concurrency)
    if ramp_s:
        run.measure_from_ns = time.monotonic_ns() + int((ramp_s + RAMP_SETTLE_S) * 1e9)

    async def worker(number: int) -> None:
        await asyncio.sleep(ramp_s * number / concurrency)
        for _ in range(requests_each):
            if mode == "relay":
                await _through_relay(the_rig.coordinator, tokens, run)
            else:
                await _direct(the_rig.http, the_rig.engine_url, the_rig.engine_socket, tokens, run)

    cpu_before, waited_before = the_rig.cpu_s(), the_rig.node_waited_s()
    started = time.perf_counter()
    await asyncio.gather(*(worker(n) for n in range(concurrency)))
    run.seconds = time.perf_counter() - started
    run.node_cpu_s, run.engine_cpu_s, run.loadgen_cpu_s = (
        after - before for after, before in zip(the_rig.cpu_s(), cpu_before))
    waited_after = the_rig.node_waited_s()
    if waited_before is not None and waited_after is not None:
        run.node_waited_s = waited_after - waited_before
    return run


async def _levels(the_rig: Rig, settings: RelaySettings, tokens: int, budget: int | None) -> list[Run]:
    """Every level, direct then relay; throughput runs (a budget) start at once, paced runs ramp."""
    runs = []
    ramp_s = 0.0 if budget is not None else settings.ramp_s
    await load(the_rig, "relay", 8, tokens, 1)  # warm both paths' connections
    await load(the_rig, "direct", 8, tokens, 1)
    for concurrency in settings.levels:
        each = 1 if budget is None else max(1, round(budget / (concurrency * tokens)))
        for mode in ("direct", "relay"):
            runs.append(await load(the_rig, mode, concurrency, tokens, each, ramp_s))
    return runs


@contextmanager
def _load_generator_off_the_node_cpu() -> Iterator[None]:
    """This process runs on the engine's CPUs while it measures, so the node's core is its own."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    others = cpu_split()[1]
    if others:
        os.sched_setaffinity(0, {int(c) for c in others.split(",")})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


async def measure(settings: RelaySettings) -> tuple[list[Figure], dict[str, Any]]:
    cpu_split()  # before this process leaves the node's CPU: asked later, it would see only the others
    with _load_generator_off_the_node_cpu():
        return await _measure(settings)


async def _measure(settings: RelaySettings) -> tuple[list[Figure], dict[str, Any]]:
    async with rig(tokens=settings.tokens, token_delay_s=0.0, profile=settings.profile, batch=settings.batch) as fast:
        throughput = await _levels(fast, settings, settings.tokens, settings.budget)
    async with rig(tokens=settings.paced_tokens, token_delay_s=settings.paced_delay_s, profile=None,
                   batch=settings.batch) as paced:
        latency = await _levels(paced, settings, settings.paced_tokens, None)
    loads = [(scenario, await _scenario(scenario, settings)) for scenario in settings.scenarios]
    details: dict[str, Any] = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in settings.__dict__.items()} | {
            "scenarios": [scenario.__dict__ for scenario in settings.scenarios]},
        "cpus": dict(zip(("node", "others"), cpu_split())),
        "throughput": [_run_json(r) for r in throughput],
        "latency": [_run_json(r) for r in latency],
        "scenarios": {scenario.name: [_run_json(r) for r in runs] for scenario, runs in loads},
    }
    if settings.profile:
        details["profile_top"] = profile_summary(settings.profile)
    return figures(settings, throughput, latency) + scenario_figures(loads), details


async def _scenario(scenario: Scenario, settings: RelaySettings) -> list[Run]:
    """Direct, then through the relay: every stream decoding at the scenario's pace."""
    tokens = max(1, round(scenario.tok_per_s * settings.scenario_s))
    with tempfile.TemporaryDirectory() as folder:
        held = Path(folder) / "held.json"
        async with rig(tokens=tokens, token_delay_s=1.0 / scenario.tok_per_s, profile=None, batch=settings.batch,
                       held=held) as paced:
            await load(paced, "relay", 8, tokens, 1)  # warm both paths' connections
            await load(paced, "direct", 8, tokens, 1)
            runs = [await load(paced, mode, scenario.streams, tokens, 1, settings.scenario_ramp_s)
                    for mode in ("direct", "relay")]
        relayed = runs[1]  # the only run through the node after the warm-up, which the stamps leave out
        relayed.held_ns = [held_ns for stamp, held_ns in json.loads(held.read_text())
                           if stamp >= relayed.measure_from_ns] if held.exists() else []
    return runs


def scenario_figures(loads: list[tuple[Scenario, list[Run]]]) -> list[Figure]:
    out: list[Figure] = []
    for scenario, runs in loads:
        direct, relayed = _pair(runs, scenario.streams)
        ratio = relayed.tokens_per_s / direct.tokens_per_s if direct.tokens_per_s else 0.0
        added_p99 = relayed.percentile_ms(0.99) - direct.percentile_ms(0.99)
        load_words = f"{scenario.streams:,} streams × {scenario.tok_per_s:g} tok/s"
        errors = f"; {relayed.errors + direct.errors} errors" if relayed.errors + direct.errors else ""
        out.append(info(SECTION, f"{scenario.name}: direct tok/s", direct.tokens_per_s, "tok/s", load_words))
        out.append(info(SECTION, f"{scenario.name}: relay tok/s", relayed.tokens_per_s, "tok/s",
                        f"node CPU {_busy(relayed.node_cpu_s, relayed)}, waited for a CPU "
                        f"{_busy(relayed.node_waited_s, relayed)} of the time{errors}"))
        out.append(at_least(SECTION, f"{scenario.name}: relay / direct", ratio, "", TARGET_SCENARIO_SHARE))
        out.append(at_most(SECTION, f"{scenario.name}: p99 held at the node", relayed.held_percentile_ms(0.99), "ms",
                           scenario.max_added_p99_ms,
                           f"engine stamp → frame handed to the websocket, {len(relayed.held_ns):,} tokens sampled; "
                           f"p50 {relayed.held_percentile_ms(0.5):.2f} ms; direct's own p99 (engine → caller) "
                           f"{direct.percentile_ms(0.99):.2f} ms"))
        rig_busy = sum(x or 0.0 for x in (relayed.engine_cpu_s, relayed.loadgen_cpu_s)) / (relayed.seconds or 1.0)
        out.append(info(SECTION, f"{scenario.name}: added p99, end to end", added_p99, "ms",
                        f"direct p99 {direct.percentile_ms(0.99):.2f} ms, relay p99 {relayed.percentile_ms(0.99):.2f} ms "
                        f"(at the caller, through the coordinator stand-in); engine + load generator + coordinator "
                        f"{rig_busy:.0%} of {_rig_cpus()} CPU(s)"))
    return out


def _rig_cpus() -> int:
    others = cpu_split()[1]
    return len(others.split(",")) if others else 1


def _run_json(run: Run) -> dict[str, Any]:
    return {"mode": run.mode, "concurrency": run.concurrency, "tokens": run.tokens,
            "seconds": round(run.seconds, 4), "tokens_per_s": round(run.tokens_per_s), "errors": run.errors,
            "node_cpu_s": run.node_cpu_s, "engine_cpu_s": run.engine_cpu_s, "loadgen_cpu_s": run.loadgen_cpu_s,
            "node_waited_for_cpu_s": run.node_waited_s,
            "p50_ms": round(run.percentile_ms(0.5), 3), "p99_ms": round(run.percentile_ms(0.99), 3)} | (
            {"held_samples": len(run.held_ns), "held_p50_ms": round(run.held_percentile_ms(0.5), 3),
             "held_p99_ms": round(run.held_percentile_ms(0.99), 3)} if run.held_ns else {})


def _pair(runs: list[Run], concurrency: int) -> tuple[Run, Run]:
    direct = next(r for r in runs if r.mode == "direct" and r.concurrency == concurrency)
    relayed = next(r for r in runs if r.mode == "relay" and r.concurrency == concurrency)
    return direct, relayed


def figures(settings: RelaySettings, throughput: list[Run], latency: list[Run]) -> list[Figure]:
    section = SECTION
    out: list[Figure] = []
    best_capacity = 0.0
    for c in settings.levels:
        direct, relayed = _pair(throughput, c)
        node_busy = (relayed.node_cpu_s or 0.0) / relayed.seconds if relayed.seconds else 0.0
        capacity = relayed.tokens / relayed.node_cpu_s if relayed.node_cpu_s else 0.0
        best_capacity = max(best_capacity, capacity)
        errors = f"; {relayed.errors + direct.errors} errors" if relayed.errors + direct.errors else ""
        out.append(info(section, f"direct tok/s @{c}", direct.tokens_per_s, "tok/s"))
        out.append(Figure(section, f"relay tok/s @{c}", relayed.tokens_per_s, "tok/s",
                          f"≥ {TARGET_TOKENS_PER_S:,}" if c > 1 else "",
                          relayed.tokens_per_s >= TARGET_TOKENS_PER_S if c > 1 else None,
                          f"node CPU {node_busy:.0%} of its core, waited for it "
                          f"{_busy(relayed.node_waited_s, relayed)} of the time{errors}"))
        ratio = relayed.tokens_per_s / direct.tokens_per_s if direct.tokens_per_s else 0.0
        out.append(at_least(section, f"relay / direct @{c}", ratio, "", TARGET_SHARE_OF_DIRECT))
        out.append(info(section, f"node tok per CPU-s @{c}", capacity, "tok/s",
                        "what one core relays when it is the limit"))
    out.append(at_least(section, "node capacity, one core (best)", best_capacity, "tok/s", TARGET_CAPACITY,
                        "tokens ÷ node CPU-seconds"))
    for c in settings.levels:
        direct, relayed = _pair(latency, c)
        added_p50 = relayed.percentile_ms(0.5) - direct.percentile_ms(0.5)
        added_p99 = relayed.percentile_ms(0.99) - direct.percentile_ms(0.99)
        note = (f"direct p50 {direct.percentile_ms(0.5):.2f} p99 {direct.percentile_ms(0.99):.2f} ms, relay p50 "
                f"{relayed.percentile_ms(0.5):.2f} p99 {relayed.percentile_ms(0.99):.2f} ms; CPU node "
                f"{_busy(relayed.node_cpu_s, relayed)}, engine {_busy(relayed.engine_cpu_s, relayed)}, "
                f"load generator + coordinator {_busy(relayed.loadgen_cpu_s, relayed)}; node waited for a CPU "
                f"{_busy(relayed.node_waited_s, relayed)} of the time")
        out.append(info(section, f"added latency p50 @{c}", added_p50, "ms",
                        f"{c} streams at {1 / settings.paced_delay_s:g} tok/s each, starts spread over {settings.ramp_s:g} s"))
        out.append(at_most(section, f"added latency p99 @{c}", added_p99, "ms", TARGET_ADDED_P99_MS, note))
    return out


def _busy(cpu_s: float | None, run: Run) -> str:
    return "?" if cpu_s is None or not run.seconds else f"{cpu_s / run.seconds:.0%}"


def profile_summary(path: Path, top: int = 25) -> str:
    """The node's hottest functions by their own time, as text."""
    if not path.exists():
        return f"no profile at {path}"
    text = StringIO()
    stats = pstats.Stats(str(path), stream=text)
    stats.sort_stats("tottime").print_stats(top)
    return text.getvalue()
