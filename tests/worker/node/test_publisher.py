"""Who hears of the node, and when: subscribers, the coordinator's `status`, the status file,
downloads and notices."""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from worker.contract import protocol
from worker.system.config import REPLACE_WAITS_S, Paths
from worker.contract.events import DownloadProgress, NodeSnapshot
from worker.node.publisher import NOTICES_KEPT, Publisher
from worker.node.status import StatusFile, read_status


class Node:
    """What the publisher is given: the node's current snapshot and status, and a wire."""

    def __init__(self, tmp_path: Path) -> None:
        self.snap = NodeSnapshot(at=1.0, state="ready", node_id="n-1", runtime="native")
        self.status = protocol.Status(state="ready")
        self.sent: list[BaseModel] = []
        self.paths = Paths.under(tmp_path).ensure()
        self.publisher = Publisher(lambda: self.with_news(), lambda: self.status, self.send,
                                   StatusFile(self.paths, lambda: True))

    def with_news(self) -> NodeSnapshot:
        return dataclasses.replace(self.snap, downloads=tuple(self.publisher.downloads.values()),
                                   notices=tuple(self.publisher.notices))

    async def send(self, message: BaseModel) -> bool:
        self.sent.append(message)
        return True


def test_subscribers_get_each_snapshot_until_they_leave_and_a_broken_one_stops_nobody(tmp_path: Path) -> None:
    node = Node(tmp_path)
    seen: list[NodeSnapshot] = []

    def broken(snap: NodeSnapshot) -> Any:
        raise RuntimeError("a viewer bug")

    node.publisher.subscribe(broken)
    leave = node.publisher.subscribe(seen.append)
    node.publisher.publish()
    assert seen == [node.snap] and node.publisher.latest == node.snap
    leave()
    leave()  # twice is harmless
    node.publisher.publish()
    assert len(seen) == 1


async def test_a_status_goes_out_when_it_changed_or_when_forced(tmp_path: Path) -> None:
    node = Node(tmp_path)
    assert await node.publisher.send_status()
    assert not await node.publisher.send_status()  # nothing changed
    node.status = protocol.Status(state="ready", throughput=protocol.Throughput(tokens_per_s=9.0))
    assert not await node.publisher.send_status()  # figures alone wait for the heartbeat
    assert await node.publisher.send_status(force=True)
    node.status = protocol.Status(state="degraded")
    assert await node.publisher.send_status()
    assert [s.state for s in node.sent] == ["ready", "ready", "degraded"]  # type: ignore[attr-defined]
    assert node.publisher.latest == node.snap  # published with each


async def test_each_tick_publishes_and_writes_the_status_file_when_due(tmp_path: Path) -> None:
    node = Node(tmp_path)
    seen: list[NodeSnapshot] = []
    node.publisher.subscribe(seen.append)
    await node.publisher.tick(heartbeat=True)
    await node.publisher.tick(heartbeat=False)
    await node.publisher.tick(heartbeat=True)
    assert len(node.sent) == 2 and len(seen) == 3
    data = read_status(node.paths)
    assert data is not None and data["snapshot"]["node_id"] == "n-1"


async def test_a_status_file_held_open_neither_stops_the_ticks_nor_stays_unwritten(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node = Node(tmp_path)
    real = os.replace
    tries: list[str] = []

    def held_open(source: str, target: str) -> None:  # as Windows refuses it while a reader has it open
        tries.append(target)
        if len(tries) <= len(REPLACE_WAITS_S) + 4:  # the first tick's every try, then some of the second's
            raise PermissionError(errno.EACCES, "Access is denied")
        real(source, target)

    monkeypatch.setattr(os, "replace", held_open)
    await node.publisher.tick(heartbeat=True)
    assert read_status(node.paths) is None and len(node.sent) == 1
    await node.publisher.tick(heartbeat=True)  # due again at once: the last write did not happen
    await node.publisher.tick(heartbeat=True)
    assert len(node.sent) == 3
    data = read_status(node.paths)
    assert data is not None and data["snapshot"]["node_id"] == "n-1"


def test_downloads_in_progress_and_the_latest_notices_reach_the_snapshot(tmp_path: Path) -> None:
    node = Node(tmp_path)
    going = DownloadProgress("model qwen3-8b", done_bytes=1, total_bytes=2)
    node.publisher.on_download(going)
    assert node.publisher.latest is not None and node.publisher.latest.downloads == (going,)
    node.publisher.on_download(dataclasses.replace(going, done_bytes=2, finished=True))
    assert node.publisher.latest.downloads == ()
    for n in range(NOTICES_KEPT + 2):
        node.publisher.notice(f"notice {n}")
    assert node.publisher.notices == [f"notice {n}" for n in range(2, NOTICES_KEPT + 2)]
