"""Provisioning's words for the shared downloader's failures (its mechanics: tests/worker/provision/test_fetch.py)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import httpx
import pytest

from tests.support.https_server import HttpsServer
from tests.worker.provision.conftest import no_sleep
from worker.contract.events import DownloadProgress
from worker.provision.problems import Downloader, ensure_free_space, fetch
from worker.provision.errors import ProvisionError

BODY = os.urandom(700_000)
DIGEST = hashlib.sha256(BODY).hexdigest()


def downloader(client: httpx.AsyncClient, **overrides: object) -> Downloader:
    options: dict[str, object] = {"sleep": no_sleep, "margin_bytes": 0, "free_bytes": lambda _: 10**12}
    options.update(overrides)
    return Downloader(client, **options)  # type: ignore[arg-type]


async def failure(
    client: httpx.AsyncClient,
    url: str,
    dest: Path,
    progress: list[DownloadProgress],
    *,
    sha256: str = DIGEST,
    max_bytes: int | None = None,
    **overrides: object,
) -> ProvisionError:
    with pytest.raises(ProvisionError) as failed:
        await fetch(
            downloader(client, **overrides),
            url,
            dest,
            what="model m",
            on_progress=progress.append,
            sha256=sha256,
            max_bytes=max_bytes,
            size_said="the 1 MiB the assignment gave (plus 10 %)",
        )
    assert progress[-1].error == failed.value.problem.message  # the bar ends with what went wrong
    return failed.value


async def test_downloads_and_reports_progress(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, progress: list[DownloadProgress]
) -> None:
    server.add("m.gguf", BODY)
    dest = tmp_path / "cache" / "m.gguf"

    result = await fetch(
        downloader(client), server.url("m.gguf"), dest, what="model m", on_progress=progress.append, sha256=DIGEST
    )

    assert result == dest and dest.read_bytes() == BODY
    assert progress[0].what == "model m" and progress[0].total_bytes == len(BODY)
    assert progress[-1].finished and progress[-1].done_bytes == len(BODY)


async def test_wrong_hash_says_the_file_is_damaged_and_gone(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, progress: list[DownloadProgress]
) -> None:
    server.add("m.gguf", BODY)

    problem = (await failure(client, server.url("m.gguf"), tmp_path / "m.gguf", progress, sha256="0" * 64)).problem

    assert "damaged" in problem.title and problem.action == "check_network"
    assert "0" * 64 in problem.message and "deleted" in problem.message
    assert DIGEST not in problem.message  # the hash of what a server sent is never repeated


async def test_full_disk_names_the_shortfall(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, progress: list[DownloadProgress]
) -> None:
    server.add("m.gguf", BODY)
    free = len(BODY) - 3 * 1024 * 1024 // 10

    problem = (await failure(client, server.url("m.gguf"), tmp_path / "m.gguf", progress, free_bytes=lambda _: free)).problem

    assert problem.action == "free_disk"
    assert "Free up 307 KiB more" in problem.message
    assert str(tmp_path) in problem.message


def test_free_space_message_says_how_much_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ProvisionError) as failed:
        ensure_free_space(tmp_path, 10 * 1024**3, lambda _: 4 * 1024**3, "model m")

    assert "Free up 6.0 GiB more" in failed.value.problem.message


async def test_connection_that_keeps_failing_says_what_is_kept(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, progress: list[DownloadProgress]
) -> None:
    server.add("m.gguf", BODY)
    server.cut_after("m.gguf", 100_000, times=10)

    problem = (await failure(client, server.url("m.gguf"), tmp_path / "m.gguf", progress, attempts=2)).problem

    assert problem.title == "Download interrupted" and problem.action == "check_network"
    assert "files.example.net" in problem.message and "already downloaded is kept" in problem.message
    assert "195 KiB" not in problem.message and "bytes" not in problem.message  # nothing of what arrived
    assert (tmp_path / "m.gguf.part").stat().st_size == 200_000


async def test_missing_file_is_a_clear_refusal(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, progress: list[DownloadProgress]
) -> None:
    problem = (await failure(client, server.url("nope.gguf"), tmp_path / "x", progress)).problem

    assert problem.title == "Download refused" and "files.example.net would not send" in problem.message
    assert "404" not in problem.message and "not found" not in problem.message  # no status, no body


async def test_download_over_its_cap_says_where_the_cap_comes_from(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, progress: list[DownloadProgress]
) -> None:
    server.add("m.gguf", os.urandom(4 * 1024 * 1024), chunked=True)

    problem = (
        await failure(client, server.url("m.gguf"), tmp_path / "cache" / "m.gguf", progress, max_bytes=1024 * 1024)
    ).problem

    assert problem.title == "Download larger than expected"
    assert "larger than 1 MiB" in problem.message and "the 1 MiB the assignment gave" in problem.message
    assert list((tmp_path / "cache").iterdir()) == []
