"""The tray and the dashboard of a REAL node while it tunes: the reference coordinator (offering
`autotune`) on a loop of its own, the node on the core's thread as the app runs it, llama-server on
the CPU with the tiny model. The tray says "Tuning… (trial N of 3)" as the trials go, the dashboard
says so too, then what the search ended with, and the node serves again."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtWidgets import QApplication

from app.bridge import Bridge
from app.core_thread import CoreThread
from app.dashboard import Dashboard
from app.tray import Tray, tray_status
from tests.integration.test_node import TOKEN, free_ports, hardware_file
from tests.integration.test_node_tuning import QUICK, on_request, tuned_assign
from tests.support.engines import LlamaServer
from worker.contract.events import NodeSnapshot
from worker.link.connection import Backoff
from worker.link.local import ReferenceCoordinator
from worker.node.node import Node
from worker.system.config import Paths, Settings

pytestmark = pytest.mark.integration

SEARCH_MS = 240_000


@pytest.fixture
def coordinator_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A loop on a thread of its own for the coordinator, as a remote one would be."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def on(loop: asyncio.AbstractEventLoop, coroutine: Any) -> Any:
    return asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout=30)


def test_the_tray_and_dashboard_follow_a_real_search(qtbot, llama_server_bin: LlamaServer, tiny_gguf: Path,
                                                     tmp_path: Path, coordinator_loop) -> None:
    coordinator = ReferenceCoordinator(token=TOKEN, heartbeat_s=1.0, assign=tuned_assign(tiny_gguf, on_request(3)))
    on(coordinator_loop, coordinator.start())
    node = Node(Paths.under(tmp_path / "node"), Settings(setup_complete=True), coordinator_url=coordinator.url,
                hardware_override=hardware_file(tmp_path, "no-gpu.json"),
                engine_bins={"llamacpp": str(llama_server_bin.executable)}, token_provider=lambda: TOKEN,
                backoff=Backoff(base_s=0.01, cap_s=0.05, reset_after_s=60.0), first_port=free_ports(1),
                tuner_settings=QUICK)
    bridge = Bridge(node)
    tray, dashboard = Tray(bridge), Dashboard(bridge)
    qtbot.addWidget(dashboard)
    said: list[str] = []
    bridge.snapshot_changed.connect(lambda snap: said.append(tray_status(snap)))
    core = CoreThread(node.run, lambda exc: None)
    core.start()
    try:
        wait_until(lambda: bridge.latest.state == "ready", timeout=60_000)
        assert tray_status(bridge.latest) == "Serving · tiny-llama"
        on(coordinator_loop, coordinator.tune("t-1"))
        wait_until(lambda: _tuning(bridge.latest) == "running", timeout=30_000)
        assert re.fullmatch(r"Tuning… \(trial [1-3] of 3\)", tray_status(bridge.latest))
        assert dashboard.text("state") == bridge.latest.headline.title == tray_status(bridge.latest)  # one title
        assert dashboard.text("tuning").startswith("Tuning… (trial ")
        wait_until(lambda: _tuning(bridge.latest) == "done" and bridge.latest.state == "ready",
                        timeout=SEARCH_MS)
        assert tray_status(bridge.latest) == "Serving · tiny-llama"
        tuning = bridge.latest.tuning
        assert tuning is not None and tuning.trial >= 1
        shown = dashboard.text("tuning")
        if tuning.chosen is not None:
            assert shown.startswith("Tuned for this computer: Serves ")
            assert shown.endswith("% faster, measured on this computer")
        else:
            assert shown == "Tried other settings; none was reliably faster here, so the network's settings stay."
        trials = {s for s in said if s.startswith("Tuning…")}
        assert trials and all(re.fullmatch(r"Tuning… \(trial [1-3] of 3\)", s) for s in trials), said
    finally:
        node.shutdown()
        core.join(60)
        tray.icon.hide()
        on(coordinator_loop, coordinator.stop())
    assert not core.is_alive()


def wait_until(test: Callable[[], bool], timeout: int) -> None:
    """Qt's own waits (`qtbot.waitUntil`, `QTest.qWait`) stop delivering the core's queued
    snapshots once an earlier test in this process has run the app's whole `run_app` to its end;
    processing events by hand delivers them whatever came before (the app itself never waits so)."""
    deadline = time.monotonic() + timeout / 1000
    while not test():
        assert time.monotonic() < deadline, f"not within {timeout} ms"
        QApplication.processEvents()
        time.sleep(0.01)


def _tuning(snap: NodeSnapshot) -> str | None:
    return snap.tuning.state if snap.tuning is not None else None
