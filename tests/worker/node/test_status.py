"""The status file: when the node rewrites it, how (0600, whole, never through a link), and
`gpu-provider status` reading it (with local mode's endpoint and key)."""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

from worker import __version__
from worker.system.config import LocalEndpoint, Paths, local_endpoint_key, save_local_endpoint
from worker.contract.events import (
    ConnectionSnapshot,
    LimitsSnapshot,
    NodeSnapshot,
    RoutingNotice,
    ThroughputSnapshot,
    Tuned,
    TuningSnapshot,
)
from worker.node.headline import headline
from worker.node.status import STATUS_FILE_S, StatusFile, read_status, status_table

SNAP = NodeSnapshot(at=1.0, state="ready", node_id="n-1", runtime="native", model="qwen3-8b")


def headlined(snap: NodeSnapshot) -> NodeSnapshot:
    return dataclasses.replace(snap, headline=headline(snap, snap.at))


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_rewritten_when_more_than_the_clock_changed_else_every_ten_seconds(tmp_path: Path) -> None:
    clock = Clock()
    status_file = StatusFile(Paths.under(tmp_path).ensure(), lambda: True, clock)
    assert not status_file.due(None)
    assert status_file.due(SNAP)
    ticked = dataclasses.replace(SNAP, at=2.0, throughput=ThroughputSnapshot(run_seconds=1.0))
    assert not status_file.due(ticked)  # only the clock moved
    assert status_file.due(dataclasses.replace(SNAP, in_flight=1))
    clock.now += STATUS_FILE_S
    assert status_file.due(dataclasses.replace(SNAP, in_flight=1))


def test_written_private_and_read_back_while_the_writer_lives(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path).ensure()
    StatusFile(paths, lambda: True).write(SNAP)
    assert stat.S_IMODE(os.stat(paths.status_file).st_mode) == 0o600
    data = read_status(paths)
    assert data is not None and (data["pid"], data["version"]) == (os.getpid(), __version__)
    assert data["snapshot"]["model"] == "qwen3-8b"
    assert not list(paths.status_file.parent.glob("*.tmp"))


def test_only_an_owner_writes_or_removes_it(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path).ensure()
    owned = [False]
    status_file = StatusFile(paths, lambda: owned[0])
    status_file.write(SNAP)
    assert not paths.status_file.exists()  # the data folder is another version's during a hand-over
    owned[0] = True
    status_file.write(SNAP)
    owned[0] = False
    status_file.remove()
    assert paths.status_file.exists()
    owned[0] = True
    status_file.remove()
    assert not paths.status_file.exists() and read_status(paths) is None


def test_the_table_shows_what_the_file_says(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path).ensure()
    StatusFile(paths, lambda: True).write(SNAP)
    data = read_status(paths)
    assert data is not None
    table = status_table(data)
    assert "model       qwen3-8b" in table


def test_the_table_says_the_headline_the_reason_it_earns_nothing_and_the_limits(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path).ensure()
    routing = RoutingNotice(share=0.0, reason="low_demand", message="No demand for this model right now", at=1.0)
    snap = headlined(dataclasses.replace(
        SNAP, routing=routing, limits=LimitsSnapshot(max_requests=2, memory_share_pct=((0, 80), (1, 100)),
                                                     reason="too_hot", words="GPU 0 at 84 °C: 2 requests at once")))
    StatusFile(paths, lambda: True).write(snap)
    data = read_status(paths)
    assert data is not None
    table = status_table(data).splitlines()
    assert table[1] == "  State       Serving · qwen3-8b"
    assert "  not earning The network says: No demand for this model right now" in table
    assert ("  limits      at most 2 requests at once; GPU 0 lends 80 % of its memory;"
            " GPU 0 at 84 °C: 2 requests at once") in table
    offline = headlined(dataclasses.replace(SNAP, connection=ConnectionSnapshot("wss://c", "offline")))
    StatusFile(paths, lambda: True).write(offline)
    data = read_status(paths)
    assert data is not None and "  State       Offline" in status_table(data).splitlines()


def test_in_local_mode_status_shows_the_endpoint_and_its_key(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path).ensure()
    key = local_endpoint_key(paths)
    coordinator = "ws://127.0.0.1:5555/v1/provider"
    save_local_endpoint(paths, LocalEndpoint("http://127.0.0.1:8090/v1", key, coordinator))
    for connection in (ConnectionSnapshot("local", "disabled"), ConnectionSnapshot(coordinator, "connected")):
        StatusFile(paths, lambda: True).write(dataclasses.replace(SNAP, connection=connection))
        data = read_status(paths)
        assert data is not None and data["local_endpoint"] == {"url": "http://127.0.0.1:8090/v1", "key": key}
        table = status_table(data)
        assert "local API   http://127.0.0.1:8090/v1" in table and f"API key     {key}" in table
    networked = dataclasses.replace(SNAP, connection=ConnectionSnapshot("wss://example.net/v1/node", "connected"))
    StatusFile(paths, lambda: True).write(networked)  # the endpoint file is a past run's
    data = read_status(paths)
    assert data is not None and "local_endpoint" not in data and key not in status_table(data)


def test_a_link_planted_at_the_status_file_is_replaced_and_its_target_untouched(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path / "node").ensure()
    target = tmp_path / "precious"
    target.write_text("the person's file\n")
    os.chmod(target, 0o644)
    before = (target.read_bytes(), target.stat().st_mtime_ns, stat.S_IMODE(target.stat().st_mode))
    paths.status_file.symlink_to(target)
    paths.status_file.with_suffix(".tmp").symlink_to(target)  # where the writer used to put its next file
    assert read_status(paths) is None  # read through no link either
    StatusFile(paths, lambda: True).write(SNAP)
    assert (target.read_bytes(), target.stat().st_mtime_ns, stat.S_IMODE(target.stat().st_mode)) == before
    assert not paths.status_file.is_symlink() and stat.S_IMODE(paths.status_file.lstat().st_mode) == 0o600
    data = read_status(paths)
    assert data is not None and data["snapshot"]["model"] == "qwen3-8b"


def test_the_table_says_tuning_and_its_trial_then_what_it_chose(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path).ensure()
    running = TuningSnapshot(state="running", trial=4, trials_max=12, elapsed_s=402.0)
    StatusFile(paths, lambda: True).write(dataclasses.replace(SNAP, tuning=running))
    data = read_status(paths)
    assert data is not None and "Tuning… (trial 4 of 12), 402 s so far" in status_table(data)
    chosen = Tuned(args=("-np", "8"), gain_pct=41.5, noise_pct=1.0, words=("serves 8 requests at once instead of 1",))
    StatusFile(paths, lambda: True).write(dataclasses.replace(SNAP, tuning=TuningSnapshot(state="done", chosen=chosen)))
    data = read_status(paths)
    assert data is not None and "serves 8 requests at once instead of 1 (41.5 % faster" in status_table(data)
    refused = TuningSnapshot(state="refused", refused="--max-model-len is never tuned")
    StatusFile(paths, lambda: True).write(dataclasses.replace(SNAP, tuning=refused))
    data = read_status(paths)
    assert data is not None and "refused: --max-model-len is never tuned (serving untuned)" in status_table(data)
