"""What a person sees and controls, on the real node: the first-run consent (nothing connects or
downloads before setup is finished), one headline through each state (the same words in the
snapshot the app renders and in `gpu-provider status`), the network's routing notice, downloads
held, paused, resumed and cancelled, the lender's limits (requests at once at the relay, a card too hot, the battery, costs, the memory
share's preview) and the reminders.

Real parts: the reference coordinator over real sockets, a real llama-server with the tiny GGUF
fetched from a throttled local https server, the vLLM stand-in on a fake NVML card.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import ipaddress
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from tests.integration.test_node import (
    PRICE,
    STATE_TIMEOUT_S,
    TOKEN,
    Running,
    eventually,
    free_ports,
    model_folder,
    running_node,
    vllm_assign,
)
from tests.support.engines import LlamaServer
from tests.support.fake_pynvml import FakeCard, FakeNvml
from tests.support.https_server import HOST, HttpsServer
from worker.contract import protocol
from worker.contract.events import NodeSnapshot
from worker.hardware import PynvmlSource
from worker.link.connection import Backoff
from worker.link.local import ReferenceCoordinator
from worker.measure.runs import CAPACITY_WINDOW_S
from worker.node.guard import COSTS_WINDOW_S
from worker.node.node import Node
from worker.node.status import read_status, status_table
from worker.provision.hosts import PublicHosts
from worker.system.config import Paths, Settings

pytestmark = pytest.mark.integration

MODEL_NAME = "tiny-llama"


@pytest.fixture
def file_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HttpsServer]:
    """A local https server the node's own download client reaches as a public host and trusts."""
    with HttpsServer() as server:
        ca_file = tmp_path / "ca.pem"
        server.ca.cert_pem.write_to_path(str(ca_file))
        monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
        public = PublicHosts.addresses_for
        monkeypatch.setattr(PublicHosts, "addresses_for", lambda self, host, port: (
            [ipaddress.IPv4Address("127.0.0.1")] if host == HOST else public(self, host, port)))
        yield server


def served_assign(server: HttpsServer, gguf: Path, assignment_id: str = "cpu-1") -> protocol.Assign:
    """The tiny model, fetched from the file server (checked by its sha256)."""
    body = gguf.read_bytes()
    server.add("tiny-llama.gguf", body)
    spec = protocol.EngineModel(source=server.url("tiny-llama.gguf"), sha256=hashlib.sha256(body).hexdigest(),
                                weights_mib=1, base_args=["--ctx-size", "1024", "--threads", "1"])
    return protocol.Assign(assignment_id=assignment_id, model=protocol.ModelSpec(name=MODEL_NAME, llamacpp=spec))


def llama(bin_: LlamaServer) -> dict[str, str]:
    return {"llamacpp": str(bin_.executable)}


def title(run: Running) -> str:
    return run.node.snapshot().headline.title


def status_state_line(node: Node) -> str:
    """The State line `gpu-provider status` prints, from the status file the node wrote."""
    data = read_status(node.paths)
    assert data is not None
    line = next(line for line in status_table(data).splitlines() if line.startswith("  State "))
    return line.removeprefix("  State").strip()


async def headline_becomes(run: Running, words: str | Callable[[str], bool]) -> NodeSnapshot:
    """Waits until the snapshot's headline reads `words`; the snapshot."""
    test = words if callable(words) else (lambda text: text == words)
    await eventually(lambda: test(title(run)))
    return run.node.snapshot()


async def status_says(run: Running, words: str | Callable[[str], bool]) -> None:
    """`gpu-provider status` shows the same title (the file is rewritten within a second of a change)."""
    test = words if callable(words) else (lambda text: text == words)
    await eventually(lambda: test(_state_line_or_none(run.node) or ""))


def table(node: Node) -> str:
    """What `gpu-provider status` prints now ("" before the node wrote its file)."""
    data = read_status(node.paths)
    return status_table(data) if data is not None else ""


def _state_line_or_none(node: Node) -> str | None:
    try:
        return status_state_line(node)
    except (AssertionError, StopIteration):
        return None


# --- consent ------------------------------------------------------------------------------------


async def test_a_fresh_desktop_node_connects_and_downloads_nothing_until_setup_is_finished(
        tmp_path: Path, llama_server_bin: LlamaServer, tiny_gguf: Path, file_server: HttpsServer) -> None:
    assign = served_assign(file_server, tiny_gguf)
    async with running_node(tmp_path, llama(llama_server_bin), fixture="no-gpu.json", assign=assign,
                            wait_for_setup=True) as run:
        await eventually(lambda: not run.node.snapshot().detecting)
        snap = await headline_becomes(run, "Finish setting up")
        assert snap.setup_needed and snap.headline.action == "finish_setup"
        await status_says(run, "Finish setting up")
        await asyncio.sleep(2.0)  # time enough to connect and fetch, had it been allowed to
        assert run.coordinator.hellos == [] and not run.coordinator.node_connected
        assert file_server.connections == 0 and file_server.requests == []
        assert run.node.snapshot().connection.state == "disabled"

        run.node.save_settings(dataclasses.replace(run.node.settings, setup_complete=True))
        await run.coordinator.wait_for_connections(1, timeout=STATE_TIMEOUT_S)
        ready = await run.status("ready", "failed")
        assert ready.state == "ready", ready.last_error
        assert file_server.requests_for("tiny-llama.gguf")
        await headline_becomes(run, f"Serving · {MODEL_NAME}")
        assert not run.node.snapshot().setup_needed


async def test_a_quit_before_setup_starts_nothing(tmp_path: Path, llama_server_bin: LlamaServer, tiny_gguf: Path,
                                                  file_server: HttpsServer) -> None:
    async with running_node(tmp_path, llama(llama_server_bin), fixture="no-gpu.json",
                            assign=served_assign(file_server, tiny_gguf), wait_for_setup=True) as run:
        await eventually(lambda: not run.node.snapshot().detecting)
        await status_says(run, "Finish setting up")
        run.node.shutdown()
        async with asyncio.timeout(STATE_TIMEOUT_S):
            await run.task
    assert run.coordinator.hellos == [] and file_server.connections == 0


async def test_a_headless_node_needs_no_setup(tmp_path: Path, llama_server_bin: LlamaServer, tiny_gguf: Path,
                                              file_server: HttpsServer) -> None:
    async with running_node(tmp_path, llama(llama_server_bin), fixture="no-gpu.json",
                            assign=served_assign(file_server, tiny_gguf)) as run:
        assert not run.node.settings.setup_complete  # the command line is the person's say-so
        await run.coordinator.wait_for_connections(1, timeout=STATE_TIMEOUT_S)
        assert not run.node.snapshot().setup_needed


# --- one headline, everywhere ---------------------------------------------------------------------


async def test_the_headline_follows_the_real_node_through_its_states_and_status_says_the_same(
        tmp_path: Path, llama_server_bin: LlamaServer, tiny_gguf: Path, file_server: HttpsServer) -> None:
    file_server.rate_bytes_per_s = 64 * 1024  # the ~0.5 MB model takes seconds: long enough to watch
    async with running_node(tmp_path, llama(llama_server_bin), fixture="no-gpu.json") as run:
        await headline_becomes(run, "Idle")
        await status_says(run, "Idle")

        await run.coordinator.send(served_assign(file_server, tiny_gguf))
        snap = await headline_becomes(run, lambda t: t.startswith("Downloading the model"))
        assert snap.headline.action == "pause" and snap.headline.not_earning == "Downloading the model"
        await status_says(run, lambda t: t.startswith("Downloading the model · "))
        download = await run.coordinator.wait_for(lambda m: isinstance(m, protocol.Status) and m.download is not None)
        assert download.download.what == "model" and download.state == "configured"

        run.node.pause_download()
        held = await headline_becomes(run, lambda t: t.startswith("Download waiting"))
        assert held.headline.detail == "Paused by you" and held.downloads[0].held == "paused_by_you"
        await run.coordinator.wait_for(lambda m: isinstance(m, protocol.Status) and m.download is not None
                                       and m.download.paused)
        sent = file_server.sent_bytes
        await asyncio.sleep(1.5)
        assert file_server.sent_bytes - sent <= 256 * 1024  # what was already on its way, then nothing
        run.node.resume_download()
        file_server.rate_bytes_per_s = None

        ready = await run.status("ready", "failed")
        assert ready.state == "ready", ready.last_error
        await headline_becomes(run, f"Serving · {MODEL_NAME}")
        await status_says(run, f"Serving · {MODEL_NAME}")

        run.node.pause()
        snap = await headline_becomes(run, "Paused")
        assert (snap.headline.action, snap.headline.action_label) == ("resume", "Resume")
        await status_says(run, "Paused")
        run.node.resume()
        await headline_becomes(run, f"Serving · {MODEL_NAME}")

        run.node._uplink._link._backoff = Backoff(base_s=600.0, cap_s=600.0)  # type: ignore[union-attr]
        await run.coordinator.stop()
        snap = await headline_becomes(run, "Offline")
        assert snap.connection.state == "offline" and snap.headline.action == "retry"
        await status_says(run, "Offline")


async def test_signed_out_and_failed_read_as_such_and_offer_their_remedy(
        tmp_path: Path, vllm_standin: Path) -> None:
    async with running_node(tmp_path, {"vllm": str(vllm_standin)}) as run:
        await run.coordinator.wait_for_connections(1, timeout=STATE_TIMEOUT_S)
        missing = vllm_assign(tmp_path / "no-such-model")
        await run.coordinator.send(missing)
        snap = await headline_becomes(run, lambda t: t.startswith("Failed: "))
        assert snap.headline.action != "pause" and snap.headline.action_label
        await status_says(run, snap.headline.title)
        run.node.sign_out()
        snap = await headline_becomes(run, "Signed out")
        assert (snap.headline.action, snap.headline.not_earning) == ("sign_in", "You're signed out")


# --- the network's routing notice ----------------------------------------------------------------


async def test_the_networks_routing_notice_is_the_reason_until_it_sends_traffic_and_goes_with_the_link(
        tmp_path: Path, vllm_standin: Path) -> None:
    async with running_node(tmp_path, {"vllm": str(vllm_standin)}, assign=vllm_assign(model_folder(tmp_path))) as run:
        await run.status("ready")
        await headline_becomes(run, "Serving · fake-8b")
        assert run.node.snapshot().headline.not_earning is None
        await run.coordinator.routing(0.0, "low_demand", "No demand for this model right now")
        await eventually(lambda: run.node.snapshot().routing is not None)
        snap = run.node.snapshot()
        assert snap.routing is not None and (snap.routing.share, snap.routing.reason) == (0.0, "low_demand")
        assert snap.headline.not_earning == "The network says: No demand for this model right now"
        assert snap.headline.title == "Serving · fake-8b"  # the network's word never changes the node's state
        await eventually(lambda: "  not earning The network says: No demand for this model right now" in table(run.node))

        await run.coordinator.routing(0.5, None, "")
        await eventually(lambda: run.node.snapshot().headline.not_earning is None)

        await run.coordinator.routing(0.0, "probation")
        await eventually(lambda: run.node.snapshot().headline.not_earning is not None)
        await run.coordinator.send(vllm_assign(model_folder(tmp_path), "a-2"))
        await eventually(lambda: run.node.snapshot().routing is None)  # a new model: the old word is void

        await run.coordinator.routing(0.0, "too_slow")
        await eventually(lambda: run.node.snapshot().routing is not None)
        await run.coordinator.restart()
        await eventually(lambda: run.node.snapshot().routing is None)  # the link dropped


# --- downloads: the node's pause holds them, cancel pauses the node ----------------------------


async def test_a_pause_holds_the_download_and_resume_lets_it_finish_and_serve(
        tmp_path: Path, llama_server_bin: LlamaServer, tiny_gguf: Path, file_server: HttpsServer) -> None:
    file_server.rate_bytes_per_s = 64 * 1024
    async with running_node(tmp_path, llama(llama_server_bin), fixture="no-gpu.json",
                            assign=served_assign(file_server, tiny_gguf)) as run:
        await eventually(lambda: any(d.done_bytes > 0 for d in run.node.snapshot().downloads))
        run.node.pause()
        await eventually(lambda: any(d.held == "paused" for d in run.node.snapshot().downloads))
        assert title(run) == "Paused"
        sent = file_server.sent_bytes
        await asyncio.sleep(1.5)
        assert file_server.sent_bytes - sent <= 256 * 1024  # the bandwidth is the person's while paused
        file_server.rate_bytes_per_s = None
        run.node.resume()  # the held download holds the engines lock: the resume must let it go first
        ready = await run.status("ready", "failed", timeout=STATE_TIMEOUT_S * 2)
        assert ready.state == "ready", ready.last_error


async def test_cancel_stops_the_download_and_pauses_the_node_keeping_the_assignment(
        tmp_path: Path, llama_server_bin: LlamaServer, tiny_gguf: Path, file_server: HttpsServer) -> None:
    file_server.rate_bytes_per_s = 32 * 1024
    async with running_node(tmp_path, llama(llama_server_bin), fixture="no-gpu.json",
                            assign=served_assign(file_server, tiny_gguf)) as run:
        await eventually(lambda: any(d.done_bytes > 0 for d in run.node.snapshot().downloads))
        run.node.cancel_download()
        snap = await headline_becomes(run, "Paused")
        assert snap.assignment_id == "cpu-1" and snap.problem is None and snap.downloads == ()
        assert not list(tmp_path.rglob("*.part"))
        file_server.rate_bytes_per_s = None
        run.node.resume()  # fetched again
        ready = await run.status("ready", "failed", timeout=STATE_TIMEOUT_S * 2)
        assert ready.state == "ready", ready.last_error


# --- the lender's limits ------------------------------------------------------------------------


@asynccontextmanager
async def card_node(tmp_path: Path, standin: Path, monkeypatch: pytest.MonkeyPatch, card: FakeCard,
                    settings: Settings, **node_options: Any) -> AsyncIterator[Running]:
    """The vLLM stand-in serving on one fake NVML card, the lender's `settings` in force."""
    FakeNvml([card]).install(monkeypatch)
    monkeypatch.setenv("STANDIN_GPU_TOTAL_MIB", str(card.total_mib))
    monkeypatch.setenv("STANDIN_GPU_FREE_MIB", str(card.total_mib - card.reserved_mib))
    coordinator = await ReferenceCoordinator(token=TOKEN, heartbeat_s=1.0, price=PRICE,
                                             assign=vllm_assign(model_folder(tmp_path))).start()
    node = Node(Paths.under(tmp_path / "node"), settings, coordinator_url=coordinator.url,
                engine_bins={"vllm": str(standin)}, nvml=PynvmlSource(), token_provider=lambda: TOKEN,
                backoff=Backoff(base_s=0.01, cap_s=0.05, reset_after_s=60.0), first_port=free_ports(1),
                **node_options)
    task = asyncio.create_task(node.run())
    run = Running(node, coordinator, task, 0)
    node.subscribe(run.seen)
    try:
        yield run
    finally:
        node.shutdown()
        async with asyncio.timeout(STATE_TIMEOUT_S):
            await task
        await coordinator.stop()
    assert run.live_engine_pids() == []


async def test_requests_over_the_lenders_limit_get_at_capacity_and_hello_says_the_limit(
        tmp_path: Path, vllm_standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_TOKEN_DELAY_S", "0.3")
    async with card_node(tmp_path, vllm_standin, monkeypatch, FakeCard(),
                         Settings(max_requests=1, memory_share_pct=((0, 80),))) as run:
        hello = await run.coordinator.wait_for_connections(1, timeout=STATE_TIMEOUT_S)
        assert hello.limits == protocol.Limits(max_requests=1, memory_share_pct={"0": 80})
        ready = await run.status("ready", "failed")
        assert ready.state == "ready", ready.last_error
        assert ready.limits == protocol.Limits(max_requests=1, memory_share_pct={"0": 80})
        first = await run.coordinator.request({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                               "stream": True})
        await eventually(lambda: run.node.snapshot().in_flight == 1)
        second = await (await run.coordinator.request({"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 2})).collect()
        assert second.error is not None and (second.error.status, second.error.code) == (503, "at_capacity")
        assert (await first.collect(timeout=STATE_TIMEOUT_S)).end is not None


async def test_the_memory_share_preview_answers_from_the_serving_engines_measured_kv(
        tmp_path: Path, vllm_standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with card_node(tmp_path, vllm_standin, monkeypatch, FakeCard(), Settings()) as run:
        await run.status("ready")
        await eventually(lambda: bool(run.node.snapshot().engines[0].kv_cache_tokens))
        [engine] = run.node.snapshot().engines
        assert engine.kv_cache_tokens is not None and engine.kv_cache_gib is not None
        half = run.node.preview_share(0, 50)
        assert half.desktop_left_mib == FakeCard().total_mib - FakeCard().total_mib * 50 // 100
        assert half.context_tokens is not None and 0 < half.context_tokens < engine.kv_cache_tokens
        assert half.words.startswith("Leaves 12.0 GiB for your desktop and games; the engine could hold ")
        assert run.node.preview_share(0, 100).context_tokens >= half.context_tokens  # type: ignore[operator]
        with pytest.raises(ValueError):
            run.node.preview_share(3, 50)


async def test_a_card_too_hot_serves_fewer_requests_then_pauses_and_resumes_once_cool(
        tmp_path: Path, vllm_standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    card = FakeCard(temperature_c=60)
    async with card_node(tmp_path, vllm_standin, monkeypatch, card,
                         Settings(temperature_limit_c=80, max_requests=4)) as run:
        await run.status("ready")
        card.temperature_c = 82  # over the limit: half the requests at once, at once
        limited = await run.coordinator.wait_for(lambda m: isinstance(m, protocol.Status) and m.limits is not None
                                                 and m.limits.reason == "too_hot", timeout=STATE_TIMEOUT_S)
        assert limited.limits is not None and limited.limits.max_requests == 2 and limited.state == "ready"
        snap = run.node.snapshot()
        assert snap.limits.max_requests == 2 and snap.limits.words and "GPU 0 at 82 °C" in snap.limits.words

        card.temperature_c = 86  # five over: paused at once, naming the card
        snap = await headline_becomes(run, "Paused: GPU 0 at 86 °C")
        assert snap.pause_reason == "too_hot" and snap.headline.detail == snap.limits.words
        await status_says(run, "Paused: GPU 0 at 86 °C")
        await eventually(lambda: run.node.snapshot().engines == ())
        card.temperature_c = 77  # under the limit, not yet five under: still paused
        await asyncio.sleep(2.5)
        assert run.node.snapshot().pause_reason == "too_hot"
        mark = run.mark()
        card.temperature_c = 74
        back = await run.status("ready", after=mark)
        assert back.assignment_id == "a-1" and not run.node.snapshot().paused


async def test_on_battery_pauses_and_plugging_in_resumes_but_never_lifts_the_persons_pause(
        tmp_path: Path, vllm_standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    battery: list[Any] = [None]
    monkeypatch.setattr(psutil, "sensors_battery", lambda: battery[0])
    async with card_node(tmp_path, vllm_standin, monkeypatch, FakeCard(), Settings(pause_on_battery=True)) as run:
        await run.status("ready")
        battery[0] = SimpleNamespace(percent=80.0, secsleft=3600, power_plugged=False)
        snap = await headline_becomes(run, "Paused on battery")
        assert snap.pause_reason == "battery" and snap.limits.reason == "on_battery"
        paused = await run.coordinator.wait_for(lambda m: isinstance(m, protocol.Status) and m.state == "paused")
        assert paused.limits is not None and paused.limits.reason == "on_battery"
        battery[0] = SimpleNamespace(percent=80.0, secsleft=3600, power_plugged=True)
        await run.status("ready", after=run.mark())

        run.node.pause()  # the person's own pause
        await headline_becomes(run, "Paused")
        battery[0] = SimpleNamespace(percent=80.0, secsleft=3600, power_plugged=False)
        await asyncio.sleep(2.5)
        assert run.node.snapshot().pause_reason == "user"
        battery[0] = SimpleNamespace(percent=80.0, secsleft=3600, power_plugged=True)
        await asyncio.sleep(2.5)
        assert run.node.snapshot().pause_reason == "user"  # plugging in never lifts the person's pause


async def test_serving_that_costs_more_than_it_earns_pauses_and_a_price_it_beats_resumes_it(
        tmp_path: Path, vllm_standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    later = [0.0]  # minutes of serving pass in a second
    card = FakeCard(power_mw=300_000)  # 300 W: at 1.00 a kWh, 0.30 an hour, far more than a few tokens earn
    async with card_node(tmp_path, vllm_standin, monkeypatch, card, Settings(electricity_price_per_kwh=1.0),
                         monotonic=lambda: time.monotonic() + later[0]) as run:
        await run.status("ready")
        for _ in range(5):  # the first two are warm-up
            assert (await run.ask({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})).error is None
            await asyncio.sleep(1.1)  # answers over several seconds: a rate, not one burst
        later[0] += CAPACITY_WINDOW_S + 2  # a whole capacity window measured: the speed it earns at
        await eventually(lambda: run.node.snapshot().last_capacity is not None)
        await asyncio.sleep(1.5)  # a reading or two of power and gross
        assert not run.node.snapshot().paused  # one reading is never enough
        later[0] += COSTS_WINDOW_S + 2
        snap = await headline_becomes(run, "Paused: electricity costs more than it earns")
        assert snap.pause_reason == "costs" and snap.limits.reason == "costs_more_than_it_earns"
        assert snap.headline.detail.startswith("Paused: electricity (0.30 USD an hour) costs more than serving earns")
        await eventually(lambda: run.node.snapshot().engines == ())
        mark = run.mark()
        run.node.save_settings(dataclasses.replace(run.node.settings, electricity_price_per_kwh=0.0001))
        back = await run.status("ready", after=mark)  # judged from the last measured speed while stopped
        assert back.limits is None and not run.node.snapshot().paused


# --- the reminders a lender asked for ------------------------------------------------------------


async def test_online_and_idle_for_the_chosen_hours_and_back_after_an_outage_are_each_told_once(
        tmp_path: Path, vllm_standin: Path) -> None:
    later = [0.0]
    async with running_node(tmp_path, {"vllm": str(vllm_standin)}, settings=Settings(notify_idle_hours=1.0),
                            monotonic=lambda: time.monotonic() + later[0]) as run:
        await run.coordinator.wait_for_connections(1, timeout=STATE_TIMEOUT_S)
        await headline_becomes(run, "Idle")
        await asyncio.sleep(1.2)
        later[0] += 3600
        idle = "Online but earning nothing for 1 hour: Waiting for the network to assign a model"
        await eventually(lambda: idle in run.node.snapshot().notices)

        run.node._uplink._link._backoff = Backoff(base_s=600.0, cap_s=600.0)  # type: ignore[union-attr]
        await run.coordinator.stop()
        await headline_becomes(run, "Offline")
        await asyncio.sleep(1.2)
        later[0] += 300
        await run.coordinator.start()
        run.node.retry()
        await run.coordinator.wait_for_connections(2, timeout=STATE_TIMEOUT_S)
        await eventually(lambda: "Back online after 5 min offline" in run.node.snapshot().notices)
        await asyncio.sleep(1.5)
        assert run.node.snapshot().notices.count("Back online after 5 min offline") == 1
        assert run.node.snapshot().notices.count(idle) == 1


async def test_a_quit_is_not_turned_into_a_pause_by_the_lenders_limits(
        tmp_path: Path, vllm_standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_TOKEN_DELAY_S", "0.3")
    battery: list[Any] = [None]
    monkeypatch.setattr(psutil, "sensors_battery", lambda: battery[0])
    async with card_node(tmp_path, vllm_standin, monkeypatch, FakeCard(), Settings(pause_on_battery=True)) as run:
        await run.status("ready")
        exchange = await run.coordinator.request({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                                  "stream": True})
        await eventually(lambda: run.node.snapshot().in_flight == 1)
        run.node.shutdown()
        await eventually(lambda: run.node.snapshot().stopping)
        battery[0] = SimpleNamespace(percent=80.0, secsleft=3600, power_plugged=False)
        await asyncio.sleep(1.5)
        assert not run.node.snapshot().paused and title(run) == "Stopping…"
        assert (await exchange.collect(timeout=STATE_TIMEOUT_S)).end is not None  # drained, not cut
