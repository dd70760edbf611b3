from __future__ import annotations

import hashlib
import os
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
