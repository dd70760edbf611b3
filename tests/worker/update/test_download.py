from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.https_server import HttpsServer
from worker.events import DownloadProgress
from worker.update.download import DownloadPolicy, download_verified
from worker.update.verify import UpdateRefused

BODY = os.urandom(700_000)
SHA = hashlib.sha256(BODY).hexdigest()
FAST = DownloadPolicy(attempts=3, retry_delay_s=0.0, progress_interval_s=0.0)


@pytest.fixture
def server() -> Iterator[HttpsServer]:
    with HttpsServer() as running:
        running.add("u.tar.gz", BODY)
        yield running


async def fetch(
    server: HttpsServer, dest: Path, *, sha256: str = SHA, policy: DownloadPolicy = FAST
) -> tuple[Path, list[DownloadProgress]]:
    events: list[DownloadProgress] = []
    async with httpx.AsyncClient(verify=server.client_context()) as client:
        path = await download_verified(
            client,
            server.url("u.tar.gz"),
            dest,
            sha256=sha256,
            what="update 0.2.0",
            on_progress=events.append,
            policy=policy,
        )
    return path, events


async def test_a_download_reports_progress_and_ends_verified(
    server: HttpsServer, tmp_path: Path
) -> None:
    path, events = await fetch(server, tmp_path / "u.archive")
    assert path.read_bytes() == BODY
    assert not (tmp_path / "u.archive.part").exists()
    assert events[-1].finished and events[-1].error is None
    assert events[-1].done_bytes == events[-1].total_bytes == len(BODY)
    assert any(not e.finished and 0 < e.done_bytes < len(BODY) for e in events)


async def test_a_dropped_connection_resumes_with_range(
    server: HttpsServer, tmp_path: Path
) -> None:
    server.cut_after("u.tar.gz", 200_000)
    path, _ = await fetch(server, tmp_path / "u.archive")
    assert path.read_bytes() == BODY
    ranges = [r.range for r in server.requests_for("u.tar.gz", "GET")]
    assert ranges[0] is None
    assert len(ranges) == 2 and ranges[1] is not None and ranges[1].startswith("bytes=")
    assert 0 < int(ranges[1].removeprefix("bytes=").rstrip("-")) <= 200_000


async def test_a_download_that_keeps_failing_is_refused_and_kept_for_later(
    server: HttpsServer, tmp_path: Path
) -> None:
    server.cut_after("u.tar.gz", 100_000, times=10)
    with pytest.raises(UpdateRefused, match="after 3 attempts"):
        await fetch(server, tmp_path / "u.archive")
    assert not (tmp_path / "u.archive").exists()
    partial = (tmp_path / "u.archive.part").read_bytes()
    assert 0 < len(partial) < len(BODY) and BODY.startswith(partial)


async def test_a_partial_left_by_an_earlier_run_is_resumed(
    server: HttpsServer, tmp_path: Path
) -> None:
    (tmp_path / "u.archive.part").write_bytes(BODY[:123_456])
    path, _ = await fetch(server, tmp_path / "u.archive")
    assert path.read_bytes() == BODY
    assert [r.range for r in server.requests_for("u.tar.gz", "GET")] == [
        "bytes=123456-"
    ]


async def test_a_server_that_ignores_range_restarts_from_zero(tmp_path: Path) -> None:
    with HttpsServer(honour_range=False) as server:
        server.add("u.tar.gz", BODY)
        (tmp_path / "u.archive.part").write_bytes(b"junk from another file")
        path, _ = await fetch(server, tmp_path / "u.archive")
    assert path.read_bytes() == BODY


async def test_a_wrong_hash_deletes_the_download(
    server: HttpsServer, tmp_path: Path
) -> None:
    with pytest.raises(UpdateRefused, match="is not the signed"):
        await fetch(server, tmp_path / "u.archive", sha256="0" * 64)
    assert list(tmp_path.iterdir()) == []


async def test_a_truncated_file_on_the_server_fails_its_hash(tmp_path: Path) -> None:
    with HttpsServer() as server:
        server.add("u.tar.gz", BODY[:-10])
        with pytest.raises(UpdateRefused, match="is not the signed"):
            await fetch(server, tmp_path / "u.archive")
    assert list(tmp_path.iterdir()) == []


async def test_a_missing_file_is_refused_without_retrying(
    server: HttpsServer, tmp_path: Path
) -> None:
    events: list[DownloadProgress] = []
    async with httpx.AsyncClient(verify=server.client_context()) as client:
        with pytest.raises(UpdateRefused, match="HTTP 404"):
            await download_verified(
                client,
                server.url("gone.tar.gz"),
                tmp_path / "u.archive",
                sha256=SHA,
                what="update",
                on_progress=events.append,
                policy=FAST,
            )
    assert len(server.requests_for("gone.tar.gz")) == 1
    assert events[-1].error is not None and "404" in events[-1].error


async def test_an_archive_over_the_size_limit_is_refused(
    server: HttpsServer, tmp_path: Path
) -> None:
    with pytest.raises(UpdateRefused, match="over the 1000-byte limit"):
        await fetch(
            server,
            tmp_path / "u.archive",
            policy=DownloadPolicy(attempts=1, max_bytes=1000),
        )
