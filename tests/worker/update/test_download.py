from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
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
    server: HttpsServer,
    dest: Path,
    *,
    sha256: str = SHA,
    policy: DownloadPolicy = FAST,
    size: int | None = None,
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
            size=size,
            policy=policy,
        )
    return path, events


class RawHttp:
    """A plain-socket HTTP server that answers every GET with a scripted head and body.

    What no well-behaved file server does (no length, a length it never sends) is what the
    size cap must survive; `body=None` sends nothing after the head and waits for the hang-up.
    """

    def __init__(self, head: bytes, body: Callable[[], AsyncIterator[bytes]] | None) -> None:
        self.head, self.body = head, body
        self.requests = 0
        self.url = ""
        self.handlers: set[asyncio.Task[object]] = set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.requests += 1
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(self.head)
            if self.body is None:
                await reader.read()  # until the client hangs up
            else:
                async for block in self.body():
                    writer.write(block)
                    await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


@asynccontextmanager
async def raw_http(
    head: bytes, body: Callable[[], AsyncIterator[bytes]] | None = None
) -> AsyncIterator[RawHttp]:
    raw = RawHttp(head, body)
    server = await asyncio.start_server(raw.serve, "127.0.0.1", 0)
    raw.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/u.tar.gz"
    async with server:
        yield raw
        if raw.handlers:  # each ends when its client hangs up, which the download must have done
            _, open_still = await asyncio.wait(raw.handlers, timeout=5)
            assert not open_still, "the download kept the connection open"


async def endless_chunks() -> AsyncIterator[bytes]:
    """A chunked body that never ends (up to 1 GB, so a broken cap fails the test's timeout)."""
    block = os.urandom(16_384)
    for _ in range(60_000):
        yield b"%x\r\n%b\r\n" % (len(block), block)


async def fetch_raw(
    raw: RawHttp,
    dest: Path,
    *,
    size: int | None,
    policy: DownloadPolicy = FAST,
    events: list[DownloadProgress] | None = None,
) -> None:
    async with httpx.AsyncClient() as client, asyncio.timeout(10):
        await download_verified(
            client,
            raw.url,
            dest,
            sha256=SHA,
            what="update 0.2.0",
            on_progress=(events if events is not None else []).append,
            size=size,
            policy=policy,
        )


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
    with pytest.raises(
        UpdateRefused,
        match="larger than an update may be: the server announced 700,000 bytes, "
        "the limit is 1,000 bytes; nothing was downloaded",
    ):
        await fetch(
            server,
            tmp_path / "u.archive",
            policy=DownloadPolicy(attempts=1, max_bytes=1000),
        )
    assert list(tmp_path.iterdir()) == []


async def test_an_update_of_exactly_the_offered_size_is_downloaded(
    server: HttpsServer, tmp_path: Path
) -> None:
    path, events = await fetch(server, tmp_path / "u.archive", size=len(BODY))
    assert path.read_bytes() == BODY
    assert events[-1].finished and events[-1].error is None


def test_the_limit_without_an_offered_size_is_the_protocols_1_gib() -> None:
    assert DownloadPolicy().max_bytes == 1024**3


@pytest.mark.parametrize(
    "size, policy, reason",
    [
        (None, DownloadPolicy(attempts=3, max_bytes=100_000), "larger than an update may be"),
        (100_000, FAST, "larger than offered"),
    ],
)
async def test_a_chunked_update_with_no_length_stops_just_past_the_cap(
    tmp_path: Path, size: int | None, policy: DownloadPolicy, reason: str
) -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    events: list[DownloadProgress] = []
    async with raw_http(head, endless_chunks) as raw:
        with pytest.raises(UpdateRefused, match=reason) as refused:
            await fetch_raw(raw, tmp_path / "u.archive", size=size, policy=policy, events=events)
    assert "the server sent more than 100,000 bytes" in str(refused.value)
    assert "stopped and deleted" in str(refused.value)
    assert events[-1].finished and events[-1].error == str(refused.value)
    assert 0 < max(e.done_bytes for e in events[:-1]) <= 100_000  # it stopped at the first block past
    assert list(tmp_path.iterdir()) == []  # no partial file kept to resume
    assert raw.requests == 1  # never retried


@pytest.mark.parametrize(
    "announced, size, reason",
    [
        (5_000, 4_000, "larger than offered: the server announced 5,000 bytes, "
         "the offer said 4,000 bytes"),
        (1024**3 + 1, None, "larger than an update may be: the server announced "
         "1,073,741,825 bytes, the limit is 1 GiB"),
    ],
)
async def test_an_announced_length_over_the_cap_is_refused_before_the_body(
    tmp_path: Path, announced: int, size: int | None, reason: str
) -> None:
    """The server sends its head and then nothing: reading any body would hang the test."""
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % announced
    async with raw_http(head) as raw:
        with pytest.raises(UpdateRefused, match=reason):
            await fetch_raw(raw, tmp_path / "u.archive", size=size)
    assert list(tmp_path.iterdir()) == []
    assert raw.requests == 1


async def test_a_partial_of_an_archive_larger_than_offered_is_deleted(
    server: HttpsServer, tmp_path: Path
) -> None:
    (tmp_path / "u.archive.part").write_bytes(BODY[:123_456])
    with pytest.raises(UpdateRefused, match="larger than offered: the server announced 700,000"):
        await fetch(server, tmp_path / "u.archive", size=len(BODY) - 1)
    assert list(tmp_path.iterdir()) == []


async def test_an_offer_larger_than_an_update_may_be_is_refused_without_downloading(
    server: HttpsServer, tmp_path: Path
) -> None:
    with pytest.raises(UpdateRefused, match="offered at 2 GiB, larger than an update may be"):
        await fetch(server, tmp_path / "u.archive", size=2 * 1024**3)
    assert server.requests_for("u.tar.gz") == []
