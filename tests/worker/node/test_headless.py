"""Headless mode's download lines (the whole headless node: `tests/integration/test_node_headless.py`)."""

from __future__ import annotations

import logging

import pytest

from worker.contract.events import DownloadProgress, NodeSnapshot
from worker.node.headless import _ProgressLines


def test_progress_lines_log_each_download_at_most_every_few_seconds(caplog: pytest.LogCaptureFixture) -> None:
    lines = _ProgressLines(every_s=60.0)
    download = DownloadProgress("model tiny", done_bytes=50_000_000, total_bytes=200_000_000, rate_bps=10e6, eta_s=15)
    snap = NodeSnapshot(at=0.0, state="configured", node_id="n", runtime="cpu", downloads=(download,))
    with caplog.at_level(logging.INFO, logger="worker.node.headless"):
        lines(snap)
        lines(snap)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["downloading model tiny: 25% (50 MB of 200 MB, 10.0 MB/s, 15 s left)"]
