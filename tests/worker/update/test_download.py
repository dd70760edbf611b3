"""The update's cap and its words for download failures (the mechanics: tests/worker/provision/test_fetch.py)."""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.https_server import HttpsServer
from worker.contract.events import DownloadProgress
from worker.update.download import DownloadPolicy, download_verified
from worker.update.verify import UpdateRefused

BODY = os.urandom(700_000)
SHA = hashlib.sha256(BODY).hexdigest()
FAST = DownloadPolicy(attempts=3, retry_delay_s=0.0, margin_bytes=0)


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
    events: list[DownloadProgress] | None = None,
) -> Path:
    async with server.client() as client:
        return await download_verified(
            client,
            server.url("u.tar.gz"),
            dest,
            sha256=sha256,
            what="update 0.2.0",
            on_progress=(events if events is not None else []).append,
            size=size,
            policy=policy,
            clock=itertools.count(step=1.0).__next__,  # a second per reading: every count is reported
        )


async def refusal(server: HttpsServer, dest: Path, **options: object) -> tuple[str, list[DownloadProgress]]:
    """The refusal's message, and the progress events, which must end with it."""
    events: list[DownloadProgress] = []
    with pytest.raises(UpdateRefused) as refused:
        await fetch(server, dest, events=events, **options)  # type: ignore[arg-type]
    assert events[-1].finished and events[-1].error == str(refused.value)
    return str(refused.value), events


async def test_a_download_reports_progress_and_ends_verified(server: HttpsServer, tmp_path: Path) -> None:
    events: list[DownloadProgress] = []
    path = await fetch(server, tmp_path / "u.archive", events=events)
    assert path.read_bytes() == BODY
    assert list(tmp_path.iterdir()) == [path]
    assert events[-1].finished and events[-1].error is None
    assert events[-1].done_bytes == events[-1].total_bytes == len(BODY)
    assert any(not e.finished and 0 < e.done_bytes < len(BODY) for e in events)


async def test_a_download_that_keeps_failing_says_what_is_kept(server: HttpsServer, tmp_path: Path) -> None:
    server.cut_after("u.tar.gz", 100_000, times=10)
    message, _ = await refusal(server, tmp_path / "u.archive")
    assert "could not download update 0.2.0 from files.example.net after 3 attempts" in message
    assert "what arrived is kept to resume next time" in message and "300,000" not in message
    assert (tmp_path / "u.archive.part").stat().st_size == 300_000


async def test_a_wrong_hash_is_not_the_signed_one(server: HttpsServer, tmp_path: Path) -> None:
    message, _ = await refusal(server, tmp_path / "u.archive", sha256="0" * 64)
    assert f"the download's sha256 is not the signed {'0' * 64}; deleted it" in message
    assert SHA not in message  # the hash of what the server sent is never repeated


async def test_a_missing_file_names_the_host_not_the_status(server: HttpsServer, tmp_path: Path) -> None:
    server.add("u.tar.gz", b"no such release here", status=404)
    message, _ = await refusal(server, tmp_path / "u.archive")
    assert message == "downloading update 0.2.0 failed: files.example.net would not send it"


async def test_too_little_disk_space_names_both_amounts(server: HttpsServer, tmp_path: Path) -> None:
    policy = DownloadPolicy(attempts=1, free_bytes=lambda _: 1000, margin_bytes=0)
    message, _ = await refusal(server, tmp_path / "u.archive", policy=policy)
    assert f"needs 700,000 bytes free in {tmp_path}, but only 1,000 bytes is free" in message


def test_the_limit_without_an_offered_size_is_the_protocols_1_gib() -> None:
    assert DownloadPolicy().max_bytes == 1024**3


async def test_an_offer_larger_than_an_update_may_be_is_refused_without_downloading(
    server: HttpsServer, tmp_path: Path
) -> None:
    message, _ = await refusal(server, tmp_path / "u.archive", size=2 * 1024**3)
    assert message.startswith("update 0.2.0 is offered at 2 GiB, larger than an update may be (1 GiB)")
    assert server.requests_for("u.tar.gz") == []


async def test_an_update_of_exactly_the_offered_size_is_downloaded(server: HttpsServer, tmp_path: Path) -> None:
    path = await fetch(server, tmp_path / "u.archive", size=len(BODY))
    assert path.read_bytes() == BODY


@pytest.mark.parametrize(
    "size, policy, reason",
    [
        (None, DownloadPolicy(attempts=1, max_bytes=1000), "larger than an update may be: the server announced "
         "more, the limit is 1,000 bytes; nothing was downloaded"),
        (4_000, FAST, "larger than offered: the server announced more, the offer said 4,000 bytes; "
         "nothing was downloaded"),
    ],
)
async def test_an_announced_length_over_the_cap_is_refused(
    server: HttpsServer, tmp_path: Path, size: int | None, policy: DownloadPolicy, reason: str
) -> None:
    message, _ = await refusal(server, tmp_path / "u.archive", size=size, policy=policy)
    assert message == f"update 0.2.0 was {reason}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "size, policy, reason",
    [
        (None, DownloadPolicy(attempts=3, max_bytes=100_000, margin_bytes=0), "larger than an update may be"),
        (100_000, FAST, "larger than offered"),
    ],
)
async def test_an_update_with_no_length_stops_just_past_the_cap(
    tmp_path: Path, size: int | None, policy: DownloadPolicy, reason: str
) -> None:
    with HttpsServer() as server:
        server.add("u.tar.gz", BODY, chunked=True)
        message, events = await refusal(server, tmp_path / "u.archive", size=size, policy=policy)
        assert len(server.requests_for("u.tar.gz")) == 1  # never retried
    assert reason in message
    assert "the server sent more than 100,000 bytes" in message and "stopped and deleted" in message
    assert 0 < max(e.done_bytes for e in events[:-1]) <= 100_000
    assert list(tmp_path.iterdir()) == []
