from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.support.https_server import HttpsServer
from tests.worker.provision.conftest import no_sleep
from worker.events import DownloadProgress
from worker.provision.download import Downloader, ensure_free_space, sha256_of
from worker.provision.errors import ProvisionError

BODY = os.urandom(700_000)
DIGEST = hashlib.sha256(BODY).hexdigest()


def downloader(client: httpx.AsyncClient, **overrides: object) -> Downloader:
    options: dict[str, object] = {"sleep": no_sleep, "margin_bytes": 0, "free_bytes": lambda _: 10**12}
    options.update(overrides)
    return Downloader(client, **options)  # type: ignore[arg-type]


async def test_downloads_verifies_and_reports_progress(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, progress: list[DownloadProgress]
) -> None:
    server.add("m.gguf", BODY)
    dest = tmp_path / "cache" / "m.gguf"

    result = await downloader(client).fetch(
        server.url("m.gguf"), dest, what="model m", on_progress=progress.append, sha256=DIGEST
    )

    assert result.read_bytes() == BODY
    assert not dest.with_name("m.gguf.part").exists()
    assert progress[0].total_bytes == len(BODY)
    assert progress[-1].finished and progress[-1].done_bytes == len(BODY)


async def test_cut_connection_resumes_from_the_part_without_refetching(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, progress: list[DownloadProgress]
) -> None:
    server.add("m.gguf", BODY)
    server.cut_after("m.gguf", 300_000)
    dest = tmp_path / "m.gguf"

    await downloader(client).fetch(
        server.url("m.gguf"), dest, what="model m", on_progress=progress.append, sha256=DIGEST
    )

    gets = server.requests_for("m.gguf", "GET")
    assert [r.range for r in gets] == [None, "bytes=300000-"]
    assert dest.read_bytes() == BODY
    assert progress[-1].finished


async def test_part_left_by_an_earlier_run_is_resumed(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, progress: list[DownloadProgress]
) -> None:
    assert server.root is not None
    (server.root / "m.gguf").write_bytes(BODY)
    dest = tmp_path / "m.gguf"
    dest.with_name("m.gguf.part").write_bytes(BODY[:123_456])

    await downloader(client).fetch(server.url("m.gguf"), dest, what="model m", on_progress=progress.append)

    assert [r.range for r in server.requests_for("m.gguf", "GET")] == ["bytes=123456-"]
    assert dest.read_bytes() == BODY


async def test_server_ignoring_range_restarts_cleanly(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, progress: list[DownloadProgress]
) -> None:
    server.add("m.gguf", BODY)
    server.honour_range = False
    dest = tmp_path / "m.gguf"
    dest.with_name("m.gguf.part").write_bytes(b"stale bytes from another file")

    await downloader(client).fetch(
        server.url("m.gguf"), dest, what="model m", on_progress=progress.append, sha256=DIGEST
    )

    assert dest.read_bytes() == BODY


async def test_complete_part_is_not_downloaded_again(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, progress: list[DownloadProgress]
) -> None:
    server.add("m.gguf", BODY)
    dest = tmp_path / "m.gguf"
    dest.with_name("m.gguf.part").write_bytes(BODY)

    await downloader(client).fetch(
        server.url("m.gguf"), dest, what="model m", on_progress=progress.append, sha256=DIGEST
    )

    assert dest.read_bytes() == BODY
    assert [r.range for r in server.requests_for("m.gguf")] == [f"bytes={len(BODY)}-"]


async def test_wrong_hash_fails_clearly_and_leaves_nothing_to_serve(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, progress: list[DownloadProgress]
) -> None:
    server.add("m.gguf", BODY)
    dest = tmp_path / "m.gguf"

    with pytest.raises(ProvisionError) as failure:
        await downloader(client).fetch(
            server.url("m.gguf"), dest, what="model m", on_progress=progress.append, sha256="0" * 64
        )

    assert "damaged" in failure.value.problem.title
    assert DIGEST in failure.value.problem.message
    assert not dest.exists() and not dest.with_name("m.gguf.part").exists()
    assert progress[-1].error is not None


async def test_full_disk_fails_before_writing_and_names_the_shortfall(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, progress: list[DownloadProgress]
) -> None:
    server.add("m.gguf", BODY)
    dest = tmp_path / "m.gguf"
    free = len(BODY) - 3 * 1024 * 1024 // 10

    with pytest.raises(ProvisionError) as failure:
        await downloader(client, free_bytes=lambda _: free).fetch(
            server.url("m.gguf"), dest, what="model m", on_progress=progress.append
        )

    problem = failure.value.problem
    assert problem.action == "free_disk"
    assert "Free up 307 KiB more" in problem.message
    assert str(tmp_path) in problem.message
    assert not dest.with_name("m.gguf.part").exists()


def test_free_space_message_says_how_much_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ProvisionError) as failure:
        ensure_free_space(tmp_path, 10 * 1024**3, lambda _: 4 * 1024**3, "model m")

    assert "Free up 6.0 GiB more" in failure.value.problem.message


async def test_connection_that_keeps_failing_keeps_the_part_and_says_so(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, progress: list[DownloadProgress]
) -> None:
    server.add("m.gguf", BODY)
    server.cut_after("m.gguf", 100_000, times=10)
    dest = tmp_path / "m.gguf"

    with pytest.raises(ProvisionError) as failure:
        await downloader(client, attempts=2).fetch(
            server.url("m.gguf"), dest, what="model m", on_progress=progress.append
        )

    assert failure.value.problem.action == "check_network"
    assert dest.with_name("m.gguf.part").stat().st_size == 200_000
    assert not dest.exists()


async def test_missing_file_is_a_clear_refusal(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, progress: list[DownloadProgress]
) -> None:
    with pytest.raises(ProvisionError) as failure:
        await downloader(client).fetch(
            server.url("nope.gguf"), tmp_path / "x", what="model m", on_progress=progress.append
        )

    assert "HTTP 404" in failure.value.problem.message


async def test_hashing_matches_hashlib(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(BODY)

    assert await sha256_of(path) == DIGEST


CAP = 1024 * 1024 + 1024 * 1024 // 10  # weights_mib=1 plus 10 %
BIG = os.urandom(16 * 1024 * 1024)


def watching(part: Path, seen: list[int]) -> Callable[[DownloadProgress], None]:
    """A progress callback that records, at every event, the bytes received and the `.part`'s size on disk."""

    def on_progress(event: DownloadProgress) -> None:
        seen.append(max(event.done_bytes, part.stat().st_size if part.exists() else 0))

    return on_progress


def ticking() -> Callable[[], float]:
    """A clock that moves a second per reading, so the meter reports every chunk."""
    return itertools.count(step=1.0).__next__


async def test_chunked_body_without_a_length_stops_at_the_cap_and_leaves_nothing(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    server.add("m.gguf", BIG, chunked=True)
    dest = tmp_path / "cache" / "m.gguf"
    seen: list[int] = []

    with pytest.raises(ProvisionError) as failure:
        await downloader(client, clock=ticking()).fetch(
            server.url("m.gguf"),
            dest,
            what="model m",
            on_progress=watching(dest.with_name("m.gguf.part"), seen),
            max_bytes=CAP,
            size_said="the 1 MiB the assignment gave (plus 10 %)",
        )

    assert "larger than" in failure.value.problem.message
    assert "the 1 MiB the assignment gave" in failure.value.problem.message
    assert seen and max(seen) <= CAP
    assert list(dest.parent.iterdir()) == []


async def test_server_announcing_a_small_size_and_sending_more_is_stopped_at_the_cap(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    server.add("m.gguf", BIG, claimed_size=1000)
    dest = tmp_path / "cache" / "m.gguf"
    seen: list[int] = []

    with pytest.raises(ProvisionError) as failure:
        await downloader(client, clock=ticking()).fetch(
            server.url("m.gguf"),
            dest,
            what="model m",
            on_progress=watching(dest.with_name("m.gguf.part"), seen),
            max_bytes=CAP,
        )

    assert failure.value.problem.title == "Download larger than expected"
    assert max(seen) <= CAP
    assert list(dest.parent.iterdir()) == []


async def test_announced_length_over_the_cap_is_refused_before_writing(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, progress: list[DownloadProgress]
) -> None:
    server.add("m.gguf", BIG)
    dest = tmp_path / "cache" / "m.gguf"

    with pytest.raises(ProvisionError):
        await downloader(client).fetch(
            server.url("m.gguf"), dest, what="model m", on_progress=progress.append, max_bytes=CAP
        )

    assert all(event.done_bytes == 0 for event in progress)
    assert list(dest.parent.iterdir()) == []


async def test_part_already_over_the_cap_is_deleted_without_asking_the_server(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, progress: list[DownloadProgress]
) -> None:
    server.add("m.gguf", BIG)
    dest = tmp_path / "cache" / "m.gguf"
    dest.parent.mkdir()
    dest.with_name("m.gguf.part").write_bytes(BIG[: CAP + 1])

    with pytest.raises(ProvisionError):
        await downloader(client).fetch(
            server.url("m.gguf"), dest, what="model m", on_progress=progress.append, max_bytes=CAP
        )

    assert list(dest.parent.iterdir()) == []
    assert server.requests_for("m.gguf") == []


async def test_body_within_the_cap_arrives(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, progress: list[DownloadProgress]
) -> None:
    server.add("m.gguf", BODY, chunked=True)
    dest = tmp_path / "cache" / "m.gguf"

    await downloader(client).fetch(
        server.url("m.gguf"), dest, what="model m", on_progress=progress.append, sha256=DIGEST, max_bytes=CAP
    )

    assert dest.read_bytes() == BODY
