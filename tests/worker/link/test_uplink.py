"""The node's one connection, with real coordinators on loopback: the reference coordinator as the
network's, and local mode's own (`--coordinator local`), started and stopped by the uplink."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from worker import __version__
from worker.contract import events, protocol
from worker.hardware import Machine
from worker.link.connection import Backoff
from worker.link.local import LocalModelError, ReferenceCoordinator, local_tune_block
from worker.link.uplink import Uplink
from worker.system.config import Paths, read_local_endpoint
from worker.update.install import hello_reached_by, started_by

TOKEN = "tok-uplink"
HELLO = protocol.Hello(
    node_id="node-1", app_version=__version__,
    platform=protocol.PlatformInfo(os="linux", runtime="cpu", arch="x86_64"),
    hardware=protocol.HardwareInfo(ram_mib=16000, cpu=protocol.CpuInfo(model="test cpu", cores=4)),
    engines={},
)
MACHINE = Machine(os="linux", runtime="cpu", arch="x86_64", cpu_model="test cpu", cpu_cores=4, ram_mib=16000)


class Node:
    """What the node is told: messages, and the connection after each change."""

    def __init__(self) -> None:
        self.messages: list[Any] = []
        self.connections: list[events.ConnectionSnapshot] = []
        self.uplink: Uplink | None = None

    async def on_message(self, message: Any) -> None:
        self.messages.append(message)

    def on_change(self) -> None:
        assert self.uplink is not None
        self.connections.append(self.uplink.connection)

    async def wait_state(self, state: str, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while self.uplink is None or self.uplink.connection.state != state:
                await asyncio.sleep(0.005)

    async def wait_message(self, kind: type[Any], timeout: float = 5.0) -> Any:
        async with asyncio.timeout(timeout):
            while not any(isinstance(m, kind) for m in self.messages):
                await asyncio.sleep(0.005)
        return next(m for m in self.messages if isinstance(m, kind))


Make = Callable[..., tuple[Uplink, Node]]


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return Paths.under(tmp_path / "data").ensure()


@pytest.fixture
async def make(paths: Paths) -> AsyncIterator[Make]:
    made: list[Uplink] = []

    def build(url: str, *, backoff: Backoff | None = None, local_model: str | None = None,
              local_tune: dict[str, Any] | None = None) -> tuple[Uplink, Node]:
        node = Node()
        uplink = Uplink(url, paths, token_provider=lambda: TOKEN,
                        backoff=backoff or Backoff(base_s=0.01, cap_s=0.05, random_source=lambda: 1.0),
                        local_model=local_model, openai_port=0, local_tune=local_tune, hello=lambda: HELLO,
                        on_message=node.on_message,
                        on_disconnect=lambda: None, on_bad_message=_ignore, on_change=node.on_change)
        node.uplink = uplink
        made.append(uplink)
        return uplink, node

    yield build
    for uplink in made:
        await uplink.close()


async def _ignore(_bad: protocol.BadMessage) -> None:
    return None


@pytest.fixture
async def coordinator() -> AsyncIterator[ReferenceCoordinator]:
    async with ReferenceCoordinator(token=TOKEN) as reference:
        yield reference


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"\0" * 2**20)
    return path


def _refused(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("url", ["", "none"])
async def test_no_coordinator_is_no_link_and_marks_nothing(make: Make, paths: Paths, url: str) -> None:
    uplink, node = make(url)
    assert await uplink.open(MACHINE) is None
    assert not uplink.linked
    await asyncio.wait_for(uplink.run(), 1)  # nothing to serve: returns at once
    assert await uplink.send(protocol.Status(state="idle")) is False
    assert uplink.connection.state == "disabled" and node.connections == []
    assert started_by(paths) is None


async def test_the_network_coordinator_gets_the_token_and_the_version_is_marked_at_each_step(
        make: Make, paths: Paths, coordinator: ReferenceCoordinator) -> None:
    uplink, node = make(coordinator.url)
    assert await uplink.open(MACHINE) is None
    assert uplink.linked
    assert started_by(paths) == __version__ and hello_reached_by(paths) is None  # about to connect: not yet proven
    task = asyncio.create_task(uplink.run())
    await node.wait_state("connected")
    assert coordinator.handshake_headers[0]["Authorization"] == f"Bearer {TOKEN}"
    assert hello_reached_by(paths) == __version__
    assert [c.state for c in node.connections] == ["connected"]
    assert await uplink.send(protocol.Status(state="idle")) is True
    await coordinator.wait_for("status")
    await uplink.close()
    await asyncio.wait_for(task, 5)


async def test_local_mode_starts_its_coordinator_which_assigns_and_close_stops_it(
        make: Make, paths: Paths, model: Path) -> None:
    uplink, node = make("local", local_model=str(model))
    assert await uplink.open(MACHINE) is None
    endpoint = read_local_endpoint(paths)
    assert endpoint is not None  # the address and key `gpu-provider status` shows
    task = asyncio.create_task(uplink.run())
    await node.wait_state("connected")
    assign = await node.wait_message(protocol.Assign)
    assert assign.model.name == "tiny" and [m.source for m in assign.model.engines.values()] == [str(model)]
    port = int(endpoint.coordinator_url.split(":")[2].split("/")[0])
    await uplink.close()
    await asyncio.wait_for(task, 5)
    assert _refused(port)  # the next version needs the port


@pytest.mark.parametrize("tune", [None, local_tune_block(minutes=5, trials=3)])
async def test_local_mode_assigns_with_the_tune_block_the_person_asked_for_and_none_otherwise(
        make: Make, model: Path, tune: dict[str, Any] | None) -> None:
    uplink, node = make("local", local_model=str(model), local_tune=tune)
    assert await uplink.open(MACHINE) is None
    task = asyncio.create_task(uplink.run())
    welcome = await node.wait_message(protocol.Welcome)
    assign = await node.wait_message(protocol.Assign)
    [block] = assign.model.engines.values()
    spec = protocol.parse_tune(block.tune)
    if tune is None:
        assert block.tune is None and spec is None
    else:
        assert protocol.AUTOTUNE_FEATURE in welcome.features  # the node reads the block only where it is offered
        assert isinstance(spec, protocol.TuneSpec) and spec.enabled and spec.when == ("on_assign",)
        assert (spec.budget.max_minutes, spec.budget.max_trials) == (5, 3)
    await uplink.close()
    await asyncio.wait_for(task, 5)


async def test_a_local_model_that_cannot_be_used_is_a_problem_for_settings(make: Make, paths: Paths) -> None:
    uplink, _node = make("local", local_model="/no/such.gguf")
    problem = await uplink.open(MACHINE)
    assert problem is not None and problem.action == "settings" and problem.title == LocalModelError.title
    assert "does not exist" in problem.message
    assert not uplink.linked and started_by(paths) is None


async def test_signed_out_the_link_stays_closed_until_sign_in(make: Make, coordinator: ReferenceCoordinator) -> None:
    uplink, node = make(coordinator.url)
    await uplink.open(MACHINE)
    task = asyncio.create_task(uplink.run())
    await node.wait_state("connected")
    await uplink.sign_out()
    await asyncio.wait_for(task, 5)
    assert uplink.connection.state == "signed_out"  # the closing link's own "disabled" is not shown
    assert node.connections[-1].problem is not None and node.connections[-1].problem.action == "sign_in"
    assert uplink.resume_after_sign_in() is True
    assert uplink.connection.state == "connecting"
    task = asyncio.create_task(uplink.run())
    await node.wait_state("connected")
    assert len(coordinator.hellos) == 2
    await uplink.close()
    await asyncio.wait_for(task, 5)


async def test_switching_network_leaves_the_old_coordinator_and_reaches_the_new(
        make: Make, coordinator: ReferenceCoordinator) -> None:
    async with ReferenceCoordinator(token=TOKEN) as other:
        uplink, node = make(coordinator.url)
        await uplink.open(MACHINE)
        task = asyncio.create_task(uplink.run())
        await node.wait_state("connected")
        assert await uplink.switch(other.url, MACHINE) is None
        assert uplink.url == other.url and uplink.connection == events.ConnectionSnapshot(other.url, "disabled")
        await asyncio.wait_for(task, 5)
        assert uplink.connection.coordinator_url == other.url  # the old link, closing, says nothing more
        task = asyncio.create_task(uplink.run())
        await node.wait_state("connected")
        assert uplink.connection.coordinator_url == other.url and len(other.hellos) == 1
        assert not coordinator.node_connected
        await uplink.close()
        await asyncio.wait_for(task, 5)


async def test_after_a_rolled_back_update_the_local_coordinator_serves_again(make: Make, model: Path) -> None:
    uplink, node = make("local", local_model=str(model))
    await uplink.open(MACHINE)
    task = asyncio.create_task(uplink.run())
    await node.wait_state("connected")
    await uplink.close()
    await asyncio.wait_for(task, 5)
    assert await uplink.reopen(local_stopped=True) is True
    task = asyncio.create_task(uplink.run())
    await node.wait_state("connected")  # on the port the restarted coordinator took
    await uplink.close()
    await asyncio.wait_for(task, 5)


async def test_retry_reaches_a_coordinator_at_once_instead_of_after_the_backoff(make: Make) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
    uplink, node = make(f"ws://127.0.0.1:{port}/v1/provider",
                        backoff=Backoff(base_s=60.0, cap_s=60.0, random_source=lambda: 1.0))
    await uplink.open(MACHINE)
    task = asyncio.create_task(uplink.run())
    await node.wait_state("offline")
    async with ReferenceCoordinator(token=TOKEN, port=port):
        uplink.reconnect_now()
        await node.wait_state("connected", timeout=5.0)  # the backoff alone would wait a minute
        await uplink.close()
        await asyncio.wait_for(task, 5)
