from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import subprocess
import tarfile
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.support.https_server import HttpsServer
from tests.worker.provision.conftest import no_sleep
from worker.config import Paths
from worker.events import DownloadProgress
from worker.provision.download import Downloader
from worker.provision.engine_install import ensure_engine
from worker.provision.errors import ProvisionError
from worker.provision.llamacpp_install import (
    ReleaseAsset,
    ReleaseManifest,
    Target,
    choose_assets,
    this_machine,
)

BUILD = "b6500"
SERVER_SCRIPT = b"#!/bin/sh\necho 'version: 6500 (test build)'\n"


def release_zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        script = zipfile.ZipInfo("build/bin/llama-server")
        script.external_attr = 0o755 << 16
        archive.writestr(script, SERVER_SCRIPT)
        archive.writestr("build/bin/libllama.so.0.0.6500", b"\x7fELF not really")
        archive.writestr("build/bin/LICENSE", b"MIT")
    return buffer.getvalue()


def release_tar() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        info = tarfile.TarInfo(f"llama-{BUILD}/llama-server")
        info.size, info.mode = len(SERVER_SCRIPT), 0o755
        archive.addfile(info, io.BytesIO(SERVER_SCRIPT))
    return buffer.getvalue()


def serve_release(
    server: HttpsServer, assets: dict[str, bytes], *, digests: dict[str, str] | None = None
) -> None:
    listed = []
    for name, data in assets.items():
        server.add(f"download/{BUILD}/{name}", data)
        digest = (digests or {}).get(name, hashlib.sha256(data).hexdigest())
        listed.append(
            {
                "name": name,
                "browser_download_url": server.url(f"download/{BUILD}/{name}"),
                "digest": f"sha256:{digest}",
            }
        )
    server.add(
        f"releases/tags/{BUILD}",
        json.dumps({"tag_name": BUILD, "assets": listed}).encode(),
        content_type="application/json",
    )


def platform_asset_name(suffix: str = ".zip") -> str:
    target = this_machine("cpu")
    os_tag = {"linux": "ubuntu", "windows": "win-cpu", "macos": "macos"}[target.os]
    return f"llama-{BUILD}-bin-{os_tag}-{target.arch}{suffix}"


async def test_release_is_downloaded_checked_and_unpacked_with_a_working_server(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    name = platform_asset_name()
    serve_release(server, {name: release_zip(), f"llama-{BUILD}-bin-other-os.zip": b"not for us"})
    paths = Paths.under(tmp_path)
    progress: list[DownloadProgress] = []

    install = await ensure_engine(
        "llamacpp",
        "6500",
        paths,
        progress.append,
        downloader=Downloader(client, sleep=no_sleep, margin_bytes=0),
        release_api=server.url("releases/{ref}"),
    )

    assert install.location == paths.engines_dir / f"llamacpp-{BUILD}" and install.version == BUILD
    answer = await asyncio.to_thread(
        subprocess.run, list(install.executable), capture_output=True, text=True, timeout=10, check=True
    )
    assert "version: 6500" in answer.stdout
    assert install.library_dir is not None
    assert os.readlink(install.library_dir / "libllama.so.0") == "libllama.so.0.0.6500"
    assert os.readlink(install.library_dir / "libllama.so") == "libllama.so.0.0.6500"
    assert progress[-1].finished and progress[-1].total_bytes == len(release_zip())
    assert [p.name for p in paths.engines_dir.iterdir()] == [f"llamacpp-{BUILD}"]

    assert (
        await ensure_engine(
            "llamacpp", BUILD, paths, progress.append, release_api="https://unused.invalid/{ref}"
        )
        == install
    )


async def test_tar_release_unpacks_too(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    serve_release(server, {platform_asset_name(".tar.gz"): release_tar()})

    install = await ensure_engine(
        "llamacpp",
        BUILD,
        Paths.under(tmp_path),
        lambda _: None,
        downloader=Downloader(client, sleep=no_sleep, margin_bytes=0),
        release_api=server.url("releases/{ref}"),
    )

    assert Path(install.executable[0]).read_bytes() == SERVER_SCRIPT


async def test_release_with_a_wrong_hash_is_never_unpacked(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    name = platform_asset_name()
    serve_release(server, {name: release_zip()}, digests={name: "0" * 64})
    paths = Paths.under(tmp_path)

    with pytest.raises(ProvisionError) as failure:
        await ensure_engine(
            "llamacpp",
            BUILD,
            paths,
            lambda _: None,
            downloader=Downloader(client, sleep=no_sleep, margin_bytes=0),
            release_api=server.url("releases/{ref}"),
        )

    assert "sha256" in failure.value.problem.message
    assert not (paths.engines_dir / f"llamacpp-{BUILD}").exists()
    assert not list(paths.engines_dir.rglob("llama-server"))


async def test_unknown_build_is_a_clear_failure(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    with pytest.raises(ProvisionError) as failure:
        await ensure_engine(
            "llamacpp",
            "b1",
            Paths.under(tmp_path),
            lambda _: None,
            downloader=Downloader(client),
            release_api=server.url("releases/{ref}"),
        )

    assert "HTTP 404" in failure.value.problem.message


def manifest(*names: str) -> ReleaseManifest:
    return ReleaseManifest(BUILD, tuple(ReleaseAsset(n, f"https://x/{n}", "a" * 64) for n in names))


WINDOWS = manifest(
    f"llama-{BUILD}-bin-win-cpu-x64.zip",
    f"llama-{BUILD}-bin-win-cuda-12.4-x64.zip",
    f"llama-{BUILD}-bin-win-cuda-13.1-x64.zip",
    "cudart-llama-bin-win-cuda-12.4-x64.zip",
    "cudart-llama-bin-win-cuda-13.1-x64.zip",
    f"llama-{BUILD}-bin-macos-arm64.zip",
    f"llama-{BUILD}-bin-ubuntu-x64.tar.gz",
)


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        (
            Target("windows", "x64", "cuda", (13, 2)),
            [f"llama-{BUILD}-bin-win-cuda-13.1-x64.zip", "cudart-llama-bin-win-cuda-13.1-x64.zip"],
        ),
        (
            Target("windows", "x64", "cuda", (12, 8)),
            [f"llama-{BUILD}-bin-win-cuda-12.4-x64.zip", "cudart-llama-bin-win-cuda-12.4-x64.zip"],
        ),
        (
            Target("windows", "x64", "cuda", None),
            [f"llama-{BUILD}-bin-win-cuda-12.4-x64.zip", "cudart-llama-bin-win-cuda-12.4-x64.zip"],
        ),
        (Target("windows", "x64", "cuda", (11, 8)), [f"llama-{BUILD}-bin-win-cpu-x64.zip"]),
        (Target("macos", "arm64", "metal"), [f"llama-{BUILD}-bin-macos-arm64.zip"]),
        (Target("linux", "x64", "cuda", (12, 4)), [f"llama-{BUILD}-bin-ubuntu-x64.tar.gz"]),
    ],
)
def test_the_build_matching_platform_and_driver_is_chosen(target: Target, expected: list[str]) -> None:
    assert [a.name for a in choose_assets(WINDOWS, target)] == expected


def test_platform_without_a_build_is_refused() -> None:
    with pytest.raises(ProvisionError) as failure:
        choose_assets(WINDOWS, Target("linux", "arm64", "cpu"))

    assert "linux arm64" in failure.value.problem.message


def test_assets_without_a_digest_are_ignored() -> None:
    data = {
        "assets": [
            {"name": "a.zip", "browser_download_url": "https://x/a.zip"},
            {"name": "b.zip", "browser_download_url": "https://x/b.zip", "digest": "sha256:" + "b" * 64},
        ]
    }

    assert [a.name for a in ReleaseManifest.from_release_json(BUILD, data).assets] == ["b.zip"]
