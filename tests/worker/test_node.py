"""The node's pure parts: the node state from its engines', free engine ports, the CUDA version,
the loader path for bundled engines and headless mode's download lines."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from worker.events import DownloadProgress, NodeSnapshot
from worker.node import (
    _cuda_version,
    _library_env,
    _ProgressLines,
    free_first_port,
    summarise,
)


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ([], "configured"),
        (["ready"], "ready"),
        (["ready", "ready"], "ready"),
        (["ready", "degraded"], "degraded"),
        (["degraded"], "degraded"),
        (["ready", "starting"], "degraded"),  # some serve, others do not
        (["ready", "failed"], "degraded"),
        (["starting", "failed"], "starting"),  # none serves, one is (re)starting
        (["starting", "configured"], "starting"),
        (["failed", "failed"], "failed"),
        (["stopped", "stopped"], "stopped"),
        (["configured"], "configured"),
    ],
)
def test_summarise_follows_the_protocol(states: list[str], expected: str) -> None:
    assert summarise(states) == expected  # type: ignore[arg-type]


def test_free_first_port_skips_ports_another_program_holds() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        assert free_first_port(taken, 1) != taken
        first = free_first_port(taken - 1, 2)
        assert taken not in (first, first + 1)
    assert free_first_port(taken, 1) == taken  # free again once it is closed


@pytest.mark.parametrize(
    ("text", "expected"), [("12.8", (12, 8)), ("13.0", (13, 0)), ("12", (12, 0)), (None, None), ("", None), ("x.1", None)]
)
def test_cuda_version(text: str | None, expected: tuple[int, int] | None) -> None:
    assert _cuda_version(text) == expected


def test_library_env_only_for_a_folder_with_shared_libraries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/existing")
    assert _library_env(tmp_path) == {}
    (tmp_path / "libggml-base.so.0").write_bytes(b"")
    assert _library_env(tmp_path) == {"LD_LIBRARY_PATH": f"{tmp_path}:/opt/existing"}
    monkeypatch.delenv("LD_LIBRARY_PATH")
    assert _library_env(tmp_path) == {"LD_LIBRARY_PATH": str(tmp_path)}


def test_progress_lines_log_each_download_at_most_every_few_seconds(caplog: pytest.LogCaptureFixture) -> None:
    lines = _ProgressLines(every_s=60.0)
    download = DownloadProgress("model tiny", done_bytes=50_000_000, total_bytes=200_000_000, rate_bps=10e6, eta_s=15)
    snap = NodeSnapshot(at=0.0, state="configured", node_id="n", runtime="cpu", downloads=(download,))
    with caplog.at_level(logging.INFO, logger="worker.node"):
        lines(snap)
        lines(snap)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["downloading model tiny: 25% (50 MB of 200 MB, 10.0 MB/s, 15 s left)"]
