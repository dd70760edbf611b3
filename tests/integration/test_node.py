"""The whole node against the reference coordinator over real sockets, with the vLLM stand-in as
its engine: handshake, assignment, relay, measurement, earnings, restarts, pause, unassign,
refusals, reconnects and the out-of-memory fallback. The Node runs in-process on the test's loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, closing
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support.engines import engine_client
from tests.worker.hardware.recorded import replay
from worker.contract import protocol
from worker.serve import supervisor as supervise
from worker.system.config import Paths, Settings
from worker.contract.events import NodeSnapshot
from worker.measure.ledger import earned
from worker.link.connection import Backoff
from worker.link.local import Collected, ReferenceCoordinator
from worker.node.node import Node
from worker.relay.forward import EngineTarget
from worker.provision.models import UNUSABLE_PATH

pytestmark = pytest.mark.integration

TOKEN = "node-test-token"
PRICE = protocol.Price(currency="USD", per_million_output_tokens=2.5, per_million_input_tokens=0.5)
STATE_TIMEOUT_S = 30.0  # engine start on a loaded 2-core machine; normally a second or two
BASE_ARGS = ["--max-model-len", "4096"]
TIER_ARGS = ["--max-model-len", "16384"]
STREAM = {"messages": [{"role": "user", "content": "say five words"}], "max_tokens": 5, "stream": True}
_PER_REQUEST = re.compile(rb'"id":"(chat)?cmpl-[0-9a-f]+","object":"([a-z.]+)","created":\d+')


def free_ports(count: int) -> int:
    """The first of `count` consecutive ports on 127.0.0.1 that nothing listens on now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = int(probe.getsockname()[1])
        if first + count < 65536 and all(_port_free(first + i) for i in range(count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports")


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def vllm(standin: Path) -> dict[str, str]:
    """`--engine-bin vllm=…`: the stand-in."""
    return {"vllm": str(standin)}


def hardware_file(folder: Path, fixture: str) -> Path:
    """A `detect`-style override file from a recorded NVML reading."""
    path = folder / f"hardware-{fixture}"
    path.write_text(json.dumps(replay(fixture).to_detect_json()), encoding="utf-8")
    return path


def model_folder(folder: Path) -> Path:
    model = folder / "fake-model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}', encoding="utf-8")
    (model / "model.safetensors").write_bytes(b"\0" * 1024)
    return model


def vllm_assign(model: Path, assignment_id: str = "a-1", *, base_args: list[str] | None = None,
                tiers: dict[str, list[str]] | None = None, name: str = "fake-8b") -> protocol.Assign:
    spec = protocol.EngineModel(source=str(model), weights_mib=4000, base_args=base_args or BASE_ARGS,
                                tiers=tiers or {})
    return protocol.Assign(assignment_id=assignment_id, model=protocol.ModelSpec(name=name, vllm=spec))


def normalised(data: bytes) -> bytes:
    """The SSE bytes with the per-request id and creation time blanked (all else must be equal)."""
    return _PER_REQUEST.sub(rb'"id":"ID","object":"\2","created":0', data)


def ledger_rows(path: Path) -> tuple[int, float]:
    """(requests, amount) read straight from the SQLite file, as another process would."""
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        count, amount = db.execute("SELECT COUNT(*), COALESCE(SUM(amount), 0) FROM requests").fetchone()
    return int(count), float(amount)


async def eventually(check: Callable[[], bool], timeout: float = STATE_TIMEOUT_S) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.05)


def _call(command: Callable[[], None]) -> Callable[[], Any]:
    """A node command as a coroutine function, to sit beside the coordinator's `send`."""

    async def call() -> None:
        command()

    return call


def is_status(*states: str) -> Callable[[Any], bool]:
    def test(message: Any) -> bool:
        return isinstance(message, protocol.Status) and message.state in states

    return test


class Running:
    """A Node on the test's loop, its coordinator, and every engine pid it ever reported."""

    def __init__(self, node: Node, coordinator: ReferenceCoordinator, task: asyncio.Task[None],
                 first_port: int) -> None:
        self.node = node
        self.coordinator = coordinator
        self.task = task
        self.first_port = first_port
        self.engine_pids: set[int] = set()
        self.snapshots: list[NodeSnapshot] = []

    def seen(self, snap: NodeSnapshot) -> None:
        self.snapshots.append(snap)
        self.engine_pids.update(e.pid for e in snap.engines if e.pid is not None)

    async def status(self, *states: str, after: int = 0, timeout: float = STATE_TIMEOUT_S) -> protocol.Status:
        return await self.coordinator.wait_for(is_status(*states), after=after, timeout=timeout)

    def mark(self) -> int:
        """Index of the next message from the node (to wait for what comes after now)."""
        return len(self.coordinator.received)

    async def ask(self, body: Any = STREAM, **kwargs: Any) -> Collected:
        """One request through the coordinator, and its whole answer."""
        exchange = await self.coordinator.request(body, **kwargs)
        return await exchange.collect(timeout=STATE_TIMEOUT_S)

    def engine_target(self, engine_id: str) -> EngineTarget:
        """The engine's own address and this run's API key (the secret the argv must hide)."""
        sup = self.node._engines.get(engine_id)
        target = sup.target() if sup is not None else None
        assert target is not None, f"engine {engine_id} is not serving"
        return target

    def live_engine_pids(self) -> list[int]:
        return [pid for pid in self.engine_pids if _alive(pid)]


def processes_mentioning(text: str) -> list[psutil.Process]:
    """Live processes whose command line names `text` (an engine and its children name the model)."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        cmdline = process.info["cmdline"] or []
        if process.info["status"] != psutil.STATUS_ZOMBIE and any(text in arg for arg in cmdline):
            found.append(process)
    return found


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@asynccontextmanager
async def running_node(tmp_path: Path, engine_bins: dict[str, str], *, fixture: str = "rtx4090.json",
                       assign: protocol.Assign | None = None, engines: int = 1,
                       configure: Callable[[Node], None] = lambda node: None, settings: Settings = Settings(),
                       **node_options: Any) -> AsyncIterator[Running]:
    """Starts a coordinator and a Node on a recorded machine (`settings` and `node_options` to
    `Node`, `configure` before it runs); on the way out shuts the node down and checks that no
    engine process is left."""
    coordinator = ReferenceCoordinator(token=TOKEN, heartbeat_s=1.0, price=PRICE, assign=assign)
    await coordinator.start()
    first_port = free_ports(engines)
    node = Node(
        Paths.under(tmp_path / "node"),
        settings,
        coordinator_url=coordinator.url,
        hardware_override=hardware_file(tmp_path, fixture),
        engine_bins=engine_bins,
        token_provider=lambda: TOKEN,
        backoff=Backoff(base_s=0.01, cap_s=0.05, reset_after_s=60.0),
        first_port=first_port,
        **node_options,
    )
    configure(node)
    task = asyncio.create_task(node.run())
    running = Running(node, coordinator, task, first_port)
    node.subscribe(running.seen)
    try:
        yield running
    finally:
        node.shutdown()
        try:
            async with asyncio.timeout(STATE_TIMEOUT_S):
                await task
        finally:
            await coordinator.stop()
        assert running.live_engine_pids() == []
        assert processes_mentioning(str(tmp_path)) == []
        assert not node.paths.status_file.exists()



async def test_hello_first_with_the_token_and_the_override_hardware(tmp_path: Path, vllm_standin: Path) -> None:
    async with running_node(tmp_path, vllm(vllm_standin)) as run:
        hello = await run.coordinator.wait_for_connections(1, timeout=STATE_TIMEOUT_S)
        assert run.coordinator.received[0] is hello
        assert run.coordinator.handshake_headers[0]["Authorization"] == f"Bearer {TOKEN}"
        expected = replay("rtx4090.json").to_detect_json()
        assert hello.platform.model_dump() == expected["platform"]
        assert hello.hardware.model_dump() == expected["hardware"]
        assert hello.node_id == run.node.state.node_id and not hello.paused
        idle = await run.status("idle")
        assert idle.assignment_id is None and idle.engines == []


async def test_assign_reaches_ready_with_the_kv_budget_and_masked_key(tmp_path: Path, vllm_standin: Path) -> None:
    model = model_folder(tmp_path)
    async with running_node(tmp_path, vllm(vllm_standin), fixture="rtx4090x2-no-p2p.json", engines=2,
                            assign=vllm_assign(model)) as run:
        ready = await run.status("ready")
        assert ready.assignment_id == "a-1" and ready.model == "fake-8b" and ready.last_error is None
        assert [(e.engine_id, e.gpu_indices, e.layout) for e in ready.engines] == [
            ("e0", [0], "replica"), ("e1", [1], "replica")]
        for engine in ready.engines:
            assert engine.state == "ready" and engine.restarts == 0
            assert engine.kv_cache_tokens == 445888 and engine.kv_cache_gib == 61.23
            assert engine.max_concurrency == pytest.approx(445888 / 4096, abs=0.01)
            assert engine.max_model_len == 4096  # what /v1/models declared
            assert "--api-key" not in engine.argv and "--port" not in engine.argv
            assert engine.argv[engine.argv.index("--host") + 1] == "127.0.0.1"
            target = run.engine_target(engine.engine_id)
            assert engine.argv[engine.argv.index("--uds") + 1] == target.socket_path
            assert str(model) in engine.argv
            assert not any(target.api_key in arg for arg in engine.argv)
        assert [e.port for e in run.node.snapshot().engines] == [None, None]  # on Unix sockets, not ports


async def test_a_port_another_program_holds_is_skipped(tmp_path: Path, vllm_standin: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervise, "UNIX_SOCKETS", False)  # ports matter where engines are on TCP (Windows)
    async with running_node(tmp_path, vllm(vllm_standin)) as run:
        await run.status("idle")
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", run.first_port))
            squatter.listen()
            await run.coordinator.send(vllm_assign(model_folder(tmp_path)))
            ready = await run.status("ready")
            [engine] = run.node.snapshot().engines
            assert engine.port is not None and engine.port > run.first_port
            assert ready.engines[0].restarts == 0 and f"{engine.port}" in ready.engines[0].argv


async def test_streamed_completion_relayed_byte_for_byte_with_usage(tmp_path: Path, vllm_standin: Path) -> None:
    async with running_node(tmp_path, vllm(vllm_standin), assign=vllm_assign(model_folder(tmp_path))) as run:
        await run.status("ready")
        relayed = await run.ask(STREAM)
        target = run.engine_target("e0")
        async with engine_client(target.socket_path) as client:
            direct = await client.post(f"{target.base_url}/v1/chat/completions", json={**STREAM, "model": "fake-8b"},
                                       headers={"Authorization": f"Bearer {target.api_key}"}, timeout=10)
        assert relayed.error is None and relayed.head is not None
        assert relayed.head.status == 200 and relayed.head.content_type == direct.headers["content-type"]
        assert normalised(relayed.data.encode()) == normalised(direct.content)
        assert relayed.data.endswith("data: [DONE]\n\n") and relayed.data.count("data: ") == 1 + 5 + 1
        assert relayed.end is not None and relayed.end.usage == protocol.Usage(prompt_tokens=3, completion_tokens=5)


async def test_throughput_counts_the_run_and_earnings_are_price_times_tokens(
    tmp_path: Path, vllm_standin: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDIN_TOKEN_DELAY_S", "0.03")  # tokens a caller sees one by one: a decode to time
    async with running_node(tmp_path, vllm(vllm_standin), assign=vllm_assign(model_folder(tmp_path))) as run:
        await run.status("ready")
        await asyncio.sleep(1.2)  # a tick scrapes the idle engine's /metrics: the cross-check's baseline
        answers = [await run.ask({**STREAM, "max_tokens": n}) for n in (3, 4, 5, 6)]
        usages = [a.end.usage for a in answers if a.end is not None and a.end.usage is not None]
        assert [u.completion_tokens for u in usages] == [3, 4, 5, 6]
        mark = run.mark()
        status = await run.coordinator.wait_for(
            lambda m: isinstance(m, protocol.Status) and m.throughput.requests == 4, after=mark, timeout=5)
        assert status.throughput.run_tokens == 18
        assert status.throughput.tokens_per_s is not None and status.throughput.tokens_per_s > 0
        assert status.throughput.per_request_tokens_per_s is not None
        mark = run.mark()
        await run.status("ready", after=mark)  # one more tick: the counts are cross-checked, idle again
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("worker")] == []
        expected = sum(earned(PRICE, u.prompt_tokens, u.completion_tokens) for u in usages)
        ledger = run.node.paths.ledger_file
        await eventually(lambda: ledger_rows(ledger)[0] == 4)
        assert ledger_rows(ledger)[1] == pytest.approx(expected)
        await eventually(lambda: run.node.snapshot().earnings.all_time == pytest.approx(expected))

        first = await run.ask(STREAM, request_id="replayed-1")
        again = await run.ask(STREAM, request_id="replayed-1")
        assert first.end is not None and first.end.usage is not None and again.end is not None
        await eventually(lambda: ledger_rows(ledger)[0] == 5)
        await asyncio.sleep(0.3)  # a second credit, if there were one, would have landed by now
        once = earned(PRICE, first.end.usage.prompt_tokens, first.end.usage.completion_tokens)
        assert ledger_rows(ledger) == (5, pytest.approx(expected + once))


async def test_earnings_and_a_user_pause_survive_a_restart_of_the_node(tmp_path: Path, vllm_standin: Path) -> None:
    assign = vllm_assign(model_folder(tmp_path))
    async with running_node(tmp_path, vllm(vllm_standin), assign=assign) as run:
        await run.status("ready")
        answer = await run.ask(STREAM)
        assert answer.end is not None and answer.end.usage is not None
        run.node.pause()  # shutdown follows at once: the credit must still land before the ledger closes
    expected = earned(PRICE, answer.end.usage.prompt_tokens, answer.end.usage.completion_tokens)
    assert ledger_rows(run.node.paths.ledger_file) == (1, pytest.approx(expected))

    async with running_node(tmp_path, vllm(vllm_standin), assign=assign) as again:
        hello = await again.coordinator.wait_for_connections(1, timeout=STATE_TIMEOUT_S)
        assert hello.paused and hello.node_id == run.node.state.node_id
        assert again.node.snapshot().earnings.all_time == pytest.approx(expected)
        paused = await again.coordinator.wait_for(
            lambda m: is_status("paused")(m) and m.assignment_id == "a-1", timeout=STATE_TIMEOUT_S)
        assert paused.engines == []
        await asyncio.sleep(0.5)
        assert again.engine_pids == set()  # a paused node starts no engine
        mark = again.mark()
        again.node.resume()
        await again.status("ready", after=mark)


async def test_engine_killed_restarts_into_a_new_empty_run(tmp_path: Path, vllm_standin: Path) -> None:
    async with running_node(tmp_path, vllm(vllm_standin), assign=vllm_assign(model_folder(tmp_path))) as run:
        await run.status("ready")
        for _ in range(3):
            assert (await run.ask(STREAM)).end is not None
        await eventually(lambda: run.node.snapshot().throughput.requests == 3)
        [engine] = run.node.snapshot().engines
        assert engine.pid is not None
        mark = run.mark()
        os.kill(engine.pid, signal.SIGKILL)
        starting = await run.status("starting", after=mark)
        ready = await run.status("ready", after=run.coordinator.received.index(starting, mark))
        assert ready.engines[0].restarts == 1
        assert ready.throughput.requests == 0 and ready.throughput.run_tokens == 0
        assert ready.throughput.tokens_per_s is None and ready.throughput.per_request_tokens_per_s is None
        [restarted] = run.node.snapshot().engines
        assert restarted.pid not in (None, engine.pid) and not _alive(engine.pid)
        assert (await run.ask(STREAM)).end is not None


async def test_pause_refuses_and_stops_engines_then_resume_serves_again(tmp_path: Path, vllm_standin: Path) -> None:
    async with running_node(tmp_path, vllm(vllm_standin), assign=vllm_assign(model_folder(tmp_path))) as run:
        await run.status("ready")
        for pause, resume, by_user in (
            (lambda: run.coordinator.send(protocol.Pause()), lambda: run.coordinator.send(protocol.Resume()), False),
            (_call(run.node.pause), _call(run.node.resume), True),
        ):
            mark = run.mark()
            await pause()
            await run.status("paused", after=mark)
            await eventually(lambda: not run.node.snapshot().engines)
            assert run.live_engine_pids() == []
            assert run.node.state.paused is by_user
            refused = await run.ask(STREAM)
            assert refused.error is not None and (refused.error.status, refused.error.code) == (503, "paused")
            mark = run.mark()
            await resume()
            await run.status("ready", after=mark)
            assert (await run.ask(STREAM)).end is not None
            assert run.node.state.paused is False


async def test_the_coordinator_neither_lifts_nor_takes_over_the_persons_pause(
    tmp_path: Path, vllm_standin: Path
) -> None:
    async with running_node(tmp_path, vllm(vllm_standin), assign=vllm_assign(model_folder(tmp_path))) as run:
        await run.status("ready")
        mark = run.mark()
        run.node.pause()
        await run.status("paused", after=mark)
        await eventually(lambda: not run.node.snapshot().engines)
        await run.coordinator.send(protocol.Pause())
        await run.coordinator.send(protocol.Resume())
        await asyncio.sleep(1.5)  # a tick or more: time for a wrong resume to show
        snap = run.node.snapshot()
        assert (snap.state, snap.pause_reason, snap.engines) == ("paused", "user", ())
        assert run.node.state.paused is True  # still saved for the next start
        mark = run.mark()
        run.node.resume()
        await run.status("ready", after=mark)


async def test_shutdown_right_after_a_resume_leaves_no_engine(tmp_path: Path, vllm_standin: Path) -> None:
    async with running_node(tmp_path, vllm(vllm_standin), assign=vllm_assign(model_folder(tmp_path))) as run:
        await run.status("ready")
        mark = run.mark()
        run.node.pause()
        await run.status("paused", after=mark)
        run.node.resume()  # waits for the pause to finish stopping the engine, then starts one
    # running_node checked on the way out that no engine process is left


async def test_unassign_stops_engines_and_a_new_assign_replaces_the_old(tmp_path: Path, vllm_standin: Path) -> None:
    model = model_folder(tmp_path)
    async with running_node(tmp_path, vllm(vllm_standin), assign=vllm_assign(model)) as run:
        await run.status("ready")
        [old] = run.node.snapshot().engines
        mark = run.mark()
        await run.coordinator.send(vllm_assign(model, "a-2", name="other-8b"))
        ready = await run.status("ready", after=mark)
        assert (ready.assignment_id, ready.model) == ("a-2", "other-8b")
        assert old.pid is not None and not _alive(old.pid)
        assert (await run.ask(STREAM)).end is not None

        await run.coordinator.send(protocol.Unassign(assignment_id="a-1"))  # not the current one: ignored
        mark = run.mark()
        await run.coordinator.send(protocol.Unassign(assignment_id="a-2"))
        idle = await run.status("idle", after=mark)
        assert idle.assignment_id is None and idle.engines == []
        assert run.live_engine_pids() == [] and run.node.snapshot().engines == ()
        refused = await run.ask(STREAM)
        assert refused.error is not None and (refused.error.status, refused.error.code) == (503, "not_ready")


async def test_unassign_lets_in_flight_requests_finish_and_refuses_new_ones_as_draining(
    tmp_path: Path, vllm_standin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDIN_TOKEN_DELAY_S", "0.1")
    async with running_node(tmp_path, vllm(vllm_standin), assign=vllm_assign(model_folder(tmp_path))) as run:
        await run.status("ready")
        long = await run.coordinator.request({**STREAM, "max_tokens": 15})
        await eventually(lambda: run.node.snapshot().in_flight == 1)
        mark = run.mark()
        await run.coordinator.send(protocol.Unassign(assignment_id="a-1"))
        await asyncio.sleep(0.2)
        refused = await run.ask(STREAM)
        assert refused.error is not None and (refused.error.status, refused.error.code) == (503, "draining")
        finished = await long.collect(timeout=STATE_TIMEOUT_S)
        assert finished.error is None and finished.end is not None and finished.end.usage is not None
        assert finished.end.usage.completion_tokens == 15
        await run.status("idle", after=mark)
        assert run.live_engine_pids() == []


async def test_refused_assignment_fails_with_the_reason_and_starts_nothing(tmp_path: Path, vllm_standin: Path) -> None:
    assign = vllm_assign(model_folder(tmp_path), base_args=["--max-model-len", "4096", "--host", "0.0.0.0"])
    async with running_node(tmp_path, vllm(vllm_standin), assign=assign) as run:
        failed = await run.status("failed")
        assert failed.assignment_id == "a-1" and failed.engines == []
        assert failed.last_error is not None and "--host" in failed.last_error
        await asyncio.sleep(0.5)
        snap = run.node.snapshot()
        assert snap.state == "failed" and snap.engines == () and run.engine_pids == set()
        assert snap.problem is not None and "--host" in snap.problem.message


async def test_a_refused_replacement_leaves_the_running_engine_serving(tmp_path: Path, vllm_standin: Path) -> None:
    """Closed world, before anything stops: a hostile `assign` is refused while the old one serves on."""
    model = model_folder(tmp_path)
    async with running_node(tmp_path, vllm(vllm_standin), assign=vllm_assign(model)) as run:
        await run.status("ready")
        [serving] = run.node.snapshot().engines
        mark = run.mark()
        await run.coordinator.send(vllm_assign(model, "a-2", base_args=["--max-model-len", "4096",
                                                                        "--log-file", str(tmp_path / "x")]))
        status = await run.coordinator.wait_for(
            lambda m: isinstance(m, protocol.Status) and m.refused is not None, after=mark, timeout=STATE_TIMEOUT_S)
        assert status.refused is not None and status.refused.assignment_id == "a-2"
        assert status.refused.reason.startswith("argument not allowed: --log-file")
        assert (status.state, status.assignment_id, status.last_error) == ("ready", "a-1", None)
        [still] = run.node.snapshot().engines
        assert still.pid == serving.pid is not None and _alive(still.pid)
        answer = await run.ask(STREAM)
        assert answer.error is None and answer.end is not None
        assert not (tmp_path / "x").exists()

        mark = run.mark()  # a tier key that is not ASCII digits does not even parse: refused the same way
        await run.coordinator.send_raw(json.dumps({
            "type": "assign", "assignment_id": "a-3",
            "model": {"name": "m", "vllm": {"source": str(model), "weights_mib": 1000, "tiers": {"\u00b2": []}}}}))
        error = await run.coordinator.wait_for(lambda m: isinstance(m, protocol.Error), after=mark)
        assert error.code == "bad_message" and error.ref == "a-3"
        status = await run.coordinator.wait_for(
            lambda m: isinstance(m, protocol.Status) and m.refused is not None and m.refused.assignment_id == "a-3",
            after=mark)
        assert status.state == "ready" and status.assignment_id == "a-1" and "tier threshold" in status.refused.reason
        assert run.node.snapshot().engines[0].pid == serving.pid

        mark = run.mark()  # a good replacement is accepted, and the refusal is forgotten
        await run.coordinator.send(vllm_assign(model, "a-4", name="other-8b"))
        ready = await run.coordinator.wait_for(
            lambda m: is_status("ready")(m) and m.assignment_id == "a-4", after=mark, timeout=STATE_TIMEOUT_S)
        assert ready.refused is None and ready.model == "other-8b"


async def test_hello_publishes_the_arguments_the_node_accepts(tmp_path: Path, vllm_standin: Path) -> None:
    async with running_node(tmp_path, vllm(vllm_standin)) as run:
        hello = await run.coordinator.wait_for_connections(1)
        assert "--max-model-len" in hello.engine_args["vllm"] and "--ctx-size" in hello.engine_args["llamacpp"]
        published = {flag for flags in hello.engine_args.values() for flag in flags}
        assert not published & {"--host", "--port", "--api-key", "--log-file", "--chat-template-file", "--uds"}


async def test_a_missing_model_fails_with_the_reason_and_a_resume_retries(tmp_path: Path, vllm_standin: Path) -> None:
    model = tmp_path / "not-yet-downloaded"
    async with running_node(tmp_path, vllm(vllm_standin), assign=vllm_assign(model)) as run:
        failed = await run.status("failed")
        assert failed.last_error is not None and failed.engines == []
        assert UNUSABLE_PATH in failed.last_error and str(model) not in failed.last_error  # the path is not told
        assert run.engine_pids == set()
        model_folder(tmp_path).rename(model)
        mark = run.mark()
        run.node.pause()
        await run.status("paused", after=mark)
        run.node.resume()
        ready = await run.status("ready", after=mark)
        assert ready.last_error is None and run.node.snapshot().problem is None


async def test_coordinator_restart_reconnects_and_says_hello_again(tmp_path: Path, vllm_standin: Path) -> None:
    async with running_node(tmp_path, vllm(vllm_standin), assign=vllm_assign(model_folder(tmp_path))) as run:
        await run.status("ready")
        [engine] = run.node.snapshot().engines
        mark = run.mark()
        await run.coordinator.restart()
        hello = await run.coordinator.wait_for_connections(2, timeout=STATE_TIMEOUT_S)
        assert run.coordinator.received[mark:].count(hello) == 1
        assert run.coordinator.handshake_headers[-1]["Authorization"] == f"Bearer {TOKEN}"
        await run.status("ready", after=mark)
        assert (await run.ask(STREAM)).end is not None
        assert [e.pid for e in run.node.snapshot().engines] == [engine.pid]  # the same assignment kept serving


async def test_out_of_memory_on_the_tier_falls_back_to_base_args(
    tmp_path: Path, vllm_standin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDIN_OOM_ABOVE_MAX_MODEL_LEN", "8192")
    assign = vllm_assign(model_folder(tmp_path), tiers={"16000": TIER_ARGS})
    async with running_node(tmp_path, vllm(vllm_standin), assign=assign) as run:
        ready = await run.status("ready")
        [engine] = ready.engines
        flags = [i for i, arg in enumerate(engine.argv) if arg == "--max-model-len"]
        assert [engine.argv[i + 1] for i in flags] == ["4096"]
        assert engine.max_model_len == 4096 and engine.restarts == 0
        assert run.node.snapshot().engines[0].tier is None
        assert (await run.ask(STREAM)).end is not None


async def test_shutdown_while_an_assignment_replaces_another_leaves_no_engine(
    tmp_path: Path, vllm_standin: Path
) -> None:
    model = model_folder(tmp_path)
    async with running_node(tmp_path, vllm(vllm_standin), assign=vllm_assign(model)) as run:
        await run.status("ready")
        await run.coordinator.send(vllm_assign(model, "a-2", name="other-8b"))
        await eventually(lambda: run.node.snapshot().assignment_id == "a-2")
    # running_node checked on the way out that no engine process is left


async def test_shutdown_while_the_engine_starts_leaves_no_engine(
    tmp_path: Path, vllm_standin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDIN_START_DELAY_S", "5")
    async with running_node(tmp_path, vllm(vllm_standin), assign=vllm_assign(model_folder(tmp_path))) as run:
        await run.status("starting")
        await eventually(lambda: bool(run.engine_pids))
        assert run.live_engine_pids() != []
    # running_node checked on the way out that no engine process is left


async def test_snapshots_and_commands_from_other_threads_and_a_failing_subscriber(
    tmp_path: Path, vllm_standin: Path
) -> None:
    failures: list[BaseException] = []
    states: list[str] = []
    chart_points: list[int] = []
    stop = threading.Event()

    def watch(node: Node) -> None:
        """What a GUI thread does: snapshots, log files and chart history, over and over."""
        while not stop.is_set():
            try:
                snap = node.snapshot()
                node.log_files()
                chart_points.append(len(node.history("kv_usage", 0.0)))
                states.append(snap.state)
            except BaseException as exc:  # noqa: BLE001 - any failure is the finding
                failures.append(exc)
                return
            time.sleep(0.005)

    def broken(snap: NodeSnapshot) -> None:
        raise RuntimeError("a viewer that always fails")

    async with running_node(tmp_path, vllm(vllm_standin), assign=vllm_assign(model_folder(tmp_path))) as run:
        run.node.subscribe(broken)
        calls: list[str] = []
        unsubscribe = run.node.subscribe(lambda snap: calls.append(snap.state))
        watcher = threading.Thread(target=watch, args=(run.node,))
        watcher.start()
        try:
            await run.status("ready")
            await eventually(lambda: max(chart_points, default=0) > 0)  # a tick charted the ready engine
            mark = run.mark()
            await asyncio.to_thread(run.node.pause)  # a command from another thread
            await run.status("paused", after=mark)
            mark = run.mark()
            await asyncio.to_thread(run.node.resume)
            await run.status("ready", after=mark)
            assert (await run.ask(STREAM)).end is not None
        finally:
            stop.set()
            await asyncio.to_thread(watcher.join, 10)
        unsubscribe()
        seen = len(calls)
        assert "ready" in calls and "paused" in calls
        await asyncio.sleep(1.5)  # a tick or more: nothing more reaches an unsubscribed callback
        assert len(calls) == seen
        assert failures == [] and "ready" in states
    assert run.node.history("kv_usage", 0.0) == []  # the ledger is closed: nothing is read from it
    assert run.node.snapshot().engines == ()
