"""The shared downloader's mechanics, against a real HTTPS server that can misbehave."""

from __future__ import annotations

import hashlib
import ipaddress
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import trustme

from tests.support.https_server import HttpsServer, ServedHere
from worker.provision.fetch import (
    Damaged,
    Downloader,
    GaveUp,
    NoSpace,
    Refused,
    TooLarge,
    check_sha256,
    sha256_of,
)
from worker.system.config import DataFolderUnsafe
from worker.provision.hosts import download_client

BODY = os.urandom(700_000)
DIGEST = hashlib.sha256(BODY).hexdigest()
CAP = 1024 * 1024 + 1024 * 1024 // 10
BIG = os.urandom(16 * 1024 * 1024)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def server(ca: trustme.CA) -> Iterator[HttpsServer]:
    with HttpsServer(ca=ca) as running:
        yield running


@pytest.fixture
async def client(server: HttpsServer) -> AsyncIterator[httpx.AsyncClient]:
    async with server.client() as http:
        yield http


@dataclass
class Recorder:
    """A meter that notes every count and, at each, how large the `.part` is on disk."""

    part: Path
    starts: list[tuple[int, int | None]] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    on_disk: list[int] = field(default_factory=list)

    def start(self, done_bytes: int, total_bytes: int | None) -> None:
        self.starts.append((done_bytes, total_bytes))
        self._look()

    def update(self, done_bytes: int) -> None:
        self.counts.append(done_bytes)
        self._look()

    def _look(self) -> None:
        self.on_disk.append(self.part.stat().st_size if self.part.exists() else 0)


class Sleeps(list[float]):
    async def __call__(self, seconds: float) -> None:
        self.append(seconds)


def loader(client: httpx.AsyncClient, **overrides: object) -> Downloader:
    options: dict[str, object] = {"sleep": Sleeps(), "margin_bytes": 0, "free_bytes": lambda _: 10**12}
    options.update(overrides)
    return Downloader(client, **options)  # type: ignore[arg-type]


async def fetch(
    client: httpx.AsyncClient,
    url: str,
    dest: Path,
    *,
    sha256: str = DIGEST,
    max_bytes: int | None = None,
    **overrides: object,
) -> Recorder:
    meter = Recorder(dest.with_name(dest.name + ".part"))
    await loader(client, **overrides).fetch(url, dest, meter, sha256=sha256, max_bytes=max_bytes)
    return meter


def ranges(server: HttpsServer, path: str) -> list[str | None]:
    return [r.range for r in server.requests_for(path, "GET")]


async def test_downloads_verifies_and_renames(server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path) -> None:
    server.add("m.gguf", BODY)
    dest = tmp_path / "cache" / "m.gguf"

    meter = await fetch(client, server.url("m.gguf"), dest, sha256=DIGEST.upper())

    assert dest.read_bytes() == BODY
    assert list(dest.parent.iterdir()) == [dest]
    assert meter.starts == [(0, len(BODY))] and meter.counts[-1] == len(BODY)


async def test_a_host_address_that_cannot_be_reached_gives_way_to_the_next(
    server: HttpsServer, tmp_path: Path
) -> None:
    """The name's first address has nothing listening (as an IPv6 address without a route): the next is tried."""
    server.add("m.gguf", BODY)
    hosts = ServedHere(first=(ipaddress.IPv4Address("127.0.0.2"),))

    async with download_client(hosts, verify=server.client_context()) as client:
        await fetch(client, server.url("m.gguf"), tmp_path / "m.gguf")

    assert (tmp_path / "m.gguf").read_bytes() == BODY and server.connections == 1


async def test_cut_connection_resumes_from_what_arrived(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    server.add("m.gguf", BODY)
    server.cut_after("m.gguf", 300_000)
    dest = tmp_path / "m.gguf"

    meter = await fetch(client, server.url("m.gguf"), dest)

    assert ranges(server, "m.gguf") == [None, "bytes=300000-"]
    assert meter.starts == [(0, len(BODY)), (300_000, len(BODY))]
    assert dest.read_bytes() == BODY


async def test_part_left_by_an_earlier_run_is_resumed(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    server.add("m.gguf", BODY)
    dest = tmp_path / "m.gguf"
    dest.with_name("m.gguf.part").write_bytes(BODY[:123_456])

    await fetch(client, server.url("m.gguf"), dest)

    assert ranges(server, "m.gguf") == ["bytes=123456-"]
    assert dest.read_bytes() == BODY


async def test_a_link_planted_at_the_part_is_never_written_through(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """A `.part` that is a link (planted in the cache before start) must not truncate, append to
    or chmod what it points at: the download fails and the target keeps its bytes and mode."""
    server.add("m.gguf", BODY)
    target = tmp_path / "elsewhere.txt"
    target.write_bytes(b"someone else's file")
    target.chmod(0o644)
    dest = tmp_path / "m.gguf"
    dest.with_name("m.gguf.part").symlink_to(target)

    with pytest.raises(DataFolderUnsafe):
        await fetch(client, server.url("m.gguf"), dest)

    assert target.read_bytes() == b"someone else's file" and target.stat().st_mode & 0o777 == 0o644
    assert not dest.exists()


async def test_server_ignoring_range_starts_over(server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path) -> None:
    server.add("m.gguf", BODY)
    server.honour_range = False
    dest = tmp_path / "m.gguf"
    dest.with_name("m.gguf.part").write_bytes(b"stale bytes from another file")

    await fetch(client, server.url("m.gguf"), dest)

    assert dest.read_bytes() == BODY


async def test_complete_part_is_not_downloaded_again(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    server.add("m.gguf", BODY)
    dest = tmp_path / "m.gguf"
    dest.with_name("m.gguf.part").write_bytes(BODY)

    meter = await fetch(client, server.url("m.gguf"), dest)

    assert dest.read_bytes() == BODY
    assert ranges(server, "m.gguf") == [f"bytes={len(BODY)}-"]
    assert meter.starts == [(len(BODY), len(BODY))]


async def test_part_longer_than_the_file_is_discarded_and_fetched_again(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    server.add("m.gguf", BODY)
    dest = tmp_path / "m.gguf"
    dest.with_name("m.gguf.part").write_bytes(BODY + b"tail of an older file")

    await fetch(client, server.url("m.gguf"), dest)

    assert ranges(server, "m.gguf") == [f"bytes={len(BODY) + 21}-", None]
    assert dest.read_bytes() == BODY


@pytest.mark.parametrize("served, digest", [(BODY, "0" * 64), (BODY[:-10], DIGEST)], ids=["wrong", "truncated"])
async def test_a_file_whose_hash_differs_is_deleted(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, served: bytes, digest: str
) -> None:
    server.add("m.gguf", served)

    with pytest.raises(Damaged) as damaged:
        await fetch(client, server.url("m.gguf"), tmp_path / "m.gguf", sha256=digest)

    assert damaged.value.actual == hashlib.sha256(served).hexdigest() and damaged.value.expected == digest
    assert damaged.value.actual not in str(damaged.value)  # for the log, never for a message
    assert list(tmp_path.iterdir()) == []


async def test_hashing_matches_hashlib_and_leaves_a_mismatching_file_alone(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(BODY)

    assert await sha256_of(path) == DIGEST
    with pytest.raises(Damaged):
        await check_sha256(path, "0" * 64)
    assert path.read_bytes() == BODY


async def test_too_little_disk_space_stops_before_writing(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    server.add("m.gguf", BODY)
    dest = tmp_path / "m.gguf"
    free = len(BODY) - 300_000
    asked: list[Path] = []

    def free_bytes(folder: Path) -> int:
        asked.append(folder)
        return free

    with pytest.raises(NoSpace) as short:
        await fetch(client, server.url("m.gguf"), dest, free_bytes=free_bytes, margin_bytes=1000)

    assert (short.value.need_bytes, short.value.free_bytes) == (len(BODY) + 1000, free)
    assert short.value.folder == tmp_path and asked == [tmp_path]
    assert list(tmp_path.iterdir()) == []


async def test_without_a_length_the_space_needed_is_the_cap(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    server.add("m.gguf", BODY, chunked=True)

    with pytest.raises(NoSpace) as short:
        await fetch(client, server.url("m.gguf"), tmp_path / "m.gguf", max_bytes=CAP, free_bytes=lambda _: CAP - 1)

    assert short.value.need_bytes == CAP


async def test_connection_that_keeps_failing_gives_up_and_keeps_the_part(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    server.add("m.gguf", BODY)
    server.cut_after("m.gguf", 100_000, times=10)
    dest = tmp_path / "m.gguf"
    sleeps = Sleeps()

    with pytest.raises(GaveUp) as gave_up:
        await fetch(client, server.url("m.gguf"), dest, attempts=3, sleep=sleeps)

    assert (gave_up.value.attempts, gave_up.value.kept_bytes) == (3, 300_000)
    assert dest.with_name("m.gguf.part").read_bytes() == BODY[:300_000]
    assert not dest.exists()
    assert sleeps == [1.0, 2.0]  # doubling between attempts, none after the last


async def test_a_final_status_is_refused_without_retrying(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    with pytest.raises(Refused) as refused:
        await fetch(client, server.url("nope.gguf"), tmp_path / "x")

    assert refused.value.status == 404
    assert len(server.requests_for("nope.gguf")) == 1


@pytest.mark.parametrize("status", [408, 429, 503])
async def test_a_busy_server_is_asked_again(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, status: int
) -> None:
    server.add("m.gguf", b"busy", status=status)

    with pytest.raises(GaveUp) as gave_up:
        await fetch(client, server.url("m.gguf"), tmp_path / "m.gguf", attempts=2)

    assert gave_up.value.reason == f"HTTP {status}"
    assert len(server.requests_for("m.gguf")) == 2


@pytest.mark.parametrize(
    "resource, announced",
    [({"chunked": True}, None), ({"claimed_size": 1000}, None), ({}, len(BIG))],
    ids=["no length", "less announced than sent", "more announced than allowed"],
)
async def test_a_body_over_the_cap_is_never_written_past_it_and_is_deleted(
    server: HttpsServer,
    client: httpx.AsyncClient,
    tmp_path: Path,
    resource: dict[str, object],
    announced: int | None,
) -> None:
    server.add("m.gguf", BIG, **resource)
    dest = tmp_path / "m.gguf"
    meter = Recorder(dest.with_name("m.gguf.part"))

    with pytest.raises(TooLarge) as too_large:
        await loader(client).fetch(server.url("m.gguf"), dest, meter, sha256=DIGEST, max_bytes=CAP)

    assert (too_large.value.max_bytes, too_large.value.announced) == (CAP, announced)
    assert max(meter.on_disk + meter.counts, default=0) <= CAP
    assert (meter.starts == []) == (announced is not None)  # an announced excess: refused before the body
    assert list(tmp_path.iterdir()) == []  # no `.part` kept to resume
    assert len(server.requests_for("m.gguf")) == 1  # never retried


async def test_a_resumed_part_of_a_file_over_the_cap_is_deleted(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    server.add("m.gguf", BODY)
    dest = tmp_path / "m.gguf"
    dest.with_name("m.gguf.part").write_bytes(BODY[:123_456])

    with pytest.raises(TooLarge) as too_large:
        await fetch(client, server.url("m.gguf"), dest, max_bytes=len(BODY) - 1)

    assert too_large.value.announced == len(BODY)  # the 206's Content-Range total
    assert list(tmp_path.iterdir()) == []


async def test_a_part_already_over_the_cap_is_deleted_without_asking_the_server(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    server.add("m.gguf", BIG)
    dest = tmp_path / "m.gguf"
    dest.with_name("m.gguf.part").write_bytes(BIG[: CAP + 1])

    with pytest.raises(TooLarge):
        await fetch(client, server.url("m.gguf"), dest, max_bytes=CAP)

    assert list(tmp_path.iterdir()) == []
    assert server.requests_for("m.gguf") == []


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_body_of_exactly_the_cap_arrives(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, chunked: bool
) -> None:
    server.add("m.gguf", BODY, chunked=chunked)

    await fetch(client, server.url("m.gguf"), tmp_path / "m.gguf", max_bytes=len(BODY))

    assert (tmp_path / "m.gguf").read_bytes() == BODY


async def test_a_short_body_is_resumed_and_a_range_from_elsewhere_discards_the_part(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """The server says "bytes 0-999 of 1000" and sends 700: the download asks for the rest, gets
    byte 0 on again, so drops the `.part` rather than append to it, and starts over."""
    server.add("m.gguf", BODY[:700], claimed_size=1000)

    with pytest.raises(GaveUp):
        await fetch(client, server.url("m.gguf"), tmp_path / "m.gguf", attempts=3)

    assert ranges(server, "m.gguf") == [None, "bytes=700-", None]
