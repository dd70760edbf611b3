from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import platform
import subprocess
import tarfile
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.support.https_server import HttpsServer
from tests.worker.engines.llamacpp.test_macho import thin
from tests.worker.provision.conftest import ca, client, no_sleep, server  # noqa: F401 (fixtures)
from worker.system.config import Paths
from worker.contract.events import DownloadProgress
from worker.provision.problems import Downloader
from worker.engines.installing import InstallError
from worker.engines.llamacpp.install import (
    ReleaseAsset,
    ReleaseManifest,
    Target,
    choose_assets,
    pinned_manifest,
    this_machine,
)
from worker.engines.llamacpp.macho import CPU_ARM64
from worker.engines.llamacpp.releases import SHIPPED, LlamacppReleases, PinnedAsset
from worker.engines.releases import version_problem
from worker.provision.engine_install import ensure_engine
from worker.provision.errors import ProvisionError

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
    server: HttpsServer, assets: dict[str, bytes], *, digests: dict[str, str] | None = None, build: str = BUILD
) -> None:
    """The assets at their download addresses, and GitHub's API page for the release (with
    `digests` published instead of the assets' own), which the app must never need."""
    listed = []
    for name, data in assets.items():
        server.add(f"download/{build}/{name}", data)
        digest = (digests or {}).get(name, hashlib.sha256(data).hexdigest())
        listed.append(
            {
                "name": name,
                "browser_download_url": server.url(f"download/{build}/{name}"),
                "digest": f"sha256:{digest}",
            }
        )
    server.add(
        f"releases/tags/{build}",
        json.dumps({"tag_name": build, "assets": listed}).encode(),
        content_type="application/json",
    )


def downloads(server: HttpsServer) -> str:
    """Where the installer finds a release's assets on the test server (`release_api`)."""
    return server.url("download/{build}/{name}")


def pinned(assets: dict[str, bytes], build: str = BUILD) -> LlamacppReleases:
    """A pin list (as the app ships) holding exactly these assets of `build`, byte for byte."""
    pins = {name: PinnedAsset(hashlib.sha256(data).hexdigest(), len(data)) for name, data in assets.items()}
    return LlamacppReleases({build: pins})


def platform_asset_name(suffix: str = ".zip", build: str = BUILD) -> str:
    target = this_machine("cpu")
    os_tag = {"linux": "ubuntu", "windows": "win-cpu", "macos": "macos"}[target.os]
    return f"llama-{build}-bin-{os_tag}-{target.arch}{suffix}"


async def test_release_is_downloaded_checked_and_unpacked_with_a_working_server(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    name = platform_asset_name()
    serve_release(server, {name: release_zip(), f"llama-{BUILD}-bin-other-os.zip": b"not for us"})
    paths = Paths.under(tmp_path)
    progress: list[DownloadProgress] = []
    releases = pinned({name: release_zip()})

    install = await ensure_engine(
        "llamacpp",
        "6500",
        paths,
        progress.append,
        downloader=Downloader(client, sleep=no_sleep, margin_bytes=0),
        release_api=downloads(server),
        releases=releases,
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
            "llamacpp",
            BUILD,
            paths,
            progress.append,
            release_api="https://unused.invalid/{build}/{name}",
            releases=releases,
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
        release_api=downloads(server),
        releases=pinned({platform_asset_name(".tar.gz"): release_tar()}),
    )

    assert Path(install.executable[0]).read_bytes() == SERVER_SCRIPT


async def test_assets_are_downloaded_from_their_release_addresses_without_the_github_api(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """GitHub's API allows 60 unauthenticated requests an hour per address (one CGNAT address is
    shared by many homes): the pinned names say where each asset is."""
    name = platform_asset_name()
    serve_release(server, {name: release_zip()})

    await ensure_engine(
        "llamacpp",
        BUILD,
        Paths.under(tmp_path),
        lambda _: None,
        downloader=Downloader(client, sleep=no_sleep, margin_bytes=0),
        release_api=downloads(server),
        releases=pinned({name: release_zip()}),
    )

    assert {r.path for r in server.requests} == {f"/download/{BUILD}/{name}"}
    assert not server.requests_for(f"releases/tags/{BUILD}")


async def test_another_platforms_pin_does_not_stop_this_install(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """Another platform's asset, published with a digest unlike its pin, is neither downloaded nor
    checked: only the assets this machine takes are."""
    name, other = platform_asset_name(), f"llama-{BUILD}-bin-other-os-x64.zip"
    serve_release(server, {name: release_zip(), other: b"replaced"}, digests={other: "0" * 64})
    paths = Paths.under(tmp_path)

    install = await ensure_engine(
        "llamacpp",
        BUILD,
        paths,
        lambda _: None,
        downloader=Downloader(client, sleep=no_sleep, margin_bytes=0),
        release_api=downloads(server),
        releases=pinned({name: release_zip(), other: b"as pinned"}),
    )

    assert install.version == BUILD and Path(install.executable[0]).is_file()
    assert not server.requests_for(f"download/{BUILD}/{other}")


async def test_asset_whose_bytes_differ_from_the_pin_is_never_unpacked(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """The release page agrees with the pin, but the bytes served are not the pinned ones."""
    name = platform_asset_name()
    genuine = release_zip()
    tampered = genuine[:-1] + bytes([genuine[-1] ^ 1])
    serve_release(server, {name: tampered}, digests={name: hashlib.sha256(genuine).hexdigest()})
    paths = Paths.under(tmp_path)

    with pytest.raises(ProvisionError) as failure:
        await ensure_engine(
            "llamacpp",
            BUILD,
            paths,
            lambda _: None,
            downloader=Downloader(client, sleep=no_sleep, margin_bytes=0),
            release_api=downloads(server),
            releases=pinned({name: genuine}),
        )

    assert "sha256" in failure.value.problem.message
    assert not (paths.engines_dir / f"llamacpp-{BUILD}").exists()
    assert not list(paths.engines_dir.rglob("llama-server"))


async def test_asset_larger_than_pinned_is_stopped(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    name = platform_asset_name()
    genuine = release_zip()
    serve_release(
        server,
        {name: genuine + os.urandom(4 * 1024 * 1024)},
        digests={name: hashlib.sha256(genuine).hexdigest()},
    )
    paths = Paths.under(tmp_path)

    with pytest.raises(ProvisionError) as failure:
        await ensure_engine(
            "llamacpp",
            BUILD,
            paths,
            lambda _: None,
            downloader=Downloader(client, sleep=no_sleep, margin_bytes=0),
            release_api=downloads(server),
            releases=pinned({name: genuine}),
        )

    assert "the size this app pins" in failure.value.problem.message
    assert not [p for p in paths.engines_dir.rglob("*") if p.is_file()]


async def test_build_missing_from_the_pin_list_is_refused_without_asking_the_network(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    serve_release(server, {platform_asset_name(): release_zip()})

    with pytest.raises(ProvisionError) as failure:
        await ensure_engine(
            "llamacpp",
            BUILD,
            Paths.under(tmp_path),
            lambda _: None,
            downloader=Downloader(client),
            release_api=downloads(server),
            releases=pinned({}, build="b7000"),
        )

    assert "llama.cpp version b6500 is not one this app ships with (b7000)" in failure.value.problem.message
    assert server.requests == []


async def test_asset_missing_from_the_pin_list_is_refused(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    serve_release(server, {platform_asset_name(): release_zip()})

    with pytest.raises(ProvisionError) as failure:
        await ensure_engine(
            "llamacpp",
            BUILD,
            Paths.under(tmp_path),
            lambda _: None,
            downloader=Downloader(client),
            release_api=downloads(server),
            releases=pinned({f"llama-{BUILD}-bin-some-other-os.zip": b"x"}),
        )

    assert "among those this app ships with" in failure.value.problem.message
    assert not server.requests_for(f"download/{BUILD}/{platform_asset_name()}")


async def test_no_version_installs_the_newest_pinned_build(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    name = platform_asset_name()
    serve_release(server, {name: release_zip()})
    releases = LlamacppReleases({**pinned({name: release_zip()}).builds, "b10": {}})

    install = await ensure_engine(
        "llamacpp",
        None,
        Paths.under(tmp_path),
        lambda _: None,
        downloader=Downloader(client, sleep=no_sleep, margin_bytes=0),
        release_api=downloads(server),
        releases=releases,
    )

    assert install.version == BUILD
    assert not server.requests_for("releases/latest")


async def test_pinned_asset_missing_from_the_release_is_a_clear_failure(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    name = platform_asset_name()

    with pytest.raises(ProvisionError) as failure:
        await ensure_engine(
            "llamacpp",
            BUILD,
            Paths.under(tmp_path),
            lambda _: None,
            downloader=Downloader(client, sleep=no_sleep, margin_bytes=0),
            release_api=downloads(server),
            releases=pinned({name: release_zip()}),
        )

    assert "engine llama.cpp b6500" in failure.value.problem.message
    assert "would not send the file" in failure.value.problem.message
    assert server.requests_for(f"download/{BUILD}/{name}")


def manifest(*names: str) -> ReleaseManifest:
    return ReleaseManifest(BUILD, tuple(ReleaseAsset(n, f"https://x/{n}", "a" * 64, 1) for n in names))


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
    with pytest.raises(InstallError) as failure:
        choose_assets(WINDOWS, Target("linux", "arm64", "cpu"))

    assert "linux arm64" in failure.value.problem.message


@pytest.mark.parametrize(
    ("engine", "version"),
    [("vllm", None), ("vllm", "0.33.0"), ("llamacpp", None), ("llamacpp", "b10423"), ("llamacpp", "10423")],
)
def test_shipped_versions_and_none_are_allowed(engine: str, version: str | None) -> None:
    assert version_problem(engine, version) is None


@pytest.mark.parametrize(
    ("engine", "version", "says"),
    [
        ("vllm", "0.8.5", "vLLM version 0.8.5 is not one this app ships with (0.33.0, 0.32.0)"),
        ("llamacpp", "b6500", "llama.cpp version b6500 is not one this app ships with (b10423)"),
        ("vllm", "../../etc", "is not a version number"),
        ("ollama", "1.0", "engine 'ollama' is not one this app runs"),
    ],
)
def test_unlisted_engine_versions_are_refused_with_what_to_do(engine: str, version: str, says: str) -> None:
    problem = version_problem(engine, version)

    assert problem is not None and says in problem
    if "ships with" in problem:
        assert "update the app" in problem


@pytest.mark.parametrize(
    "target",
    [
        Target("linux", "x64", "cpu"),
        Target("linux", "arm64", "cpu"),
        Target("linux", "x64", "cuda", (12, 4)),
        Target("macos", "arm64", "metal"),
        Target("macos", "x64", "cpu"),
        Target("windows", "x64", "cpu"),
        Target("windows", "x64", "cuda", (12, 8)),
    ],
)
def test_every_platform_finds_a_pinned_build_in_what_the_app_ships(target: Target) -> None:
    """The pin list's names are the ones the installer picks: a typo there would leave a platform without a build."""
    build = SHIPPED.default
    assert build is not None
    pins = SHIPPED.builds[build]

    chosen = choose_assets(pinned_manifest(build, pins), target)

    assert chosen and all(
        pins[a.name].sha256 == a.sha256 and a.size_bytes == pins[a.name].size_bytes for a in chosen
    )
    assert all(a.url == f"https://github.com/ggml-org/llama.cpp/releases/download/{build}/{a.name}" for a in chosen)
    if target.accelerator == "cuda" and target.os == "windows":
        assert [a.name for a in chosen][1].startswith("cudart-")


def mac_release(server_minos: tuple[int, int, int], library_minos: tuple[int, int, int]) -> bytes:
    """A macOS tarball as llama.cpp packs one: llama-server and a dylib beside it, real Mach-O headers."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data, mode in ((f"llama-{BUILD}/llama-server", thin(CPU_ARM64, minos=server_minos), 0o755),
                                 (f"llama-{BUILD}/libggml-metal.0.dylib", thin(CPU_ARM64, minos=library_minos), 0o644)):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def on_a_mac(monkeypatch: pytest.MonkeyPatch, macos: str) -> None:
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    monkeypatch.setattr(platform, "mac_ver", lambda: (macos, ("", "", ""), "arm64"))


async def test_a_mac_refuses_a_build_its_macos_cannot_start(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b9428–b10141 were built for macOS 26: on macOS 15 dyld refuses them before a word is logged."""
    on_a_mac(monkeypatch, "15.3")
    name, tarball = platform_asset_name(".tar.gz"), mac_release((13, 3, 0), (26, 0, 0))
    serve_release(server, {name: tarball})
    paths = Paths.under(tmp_path)

    with pytest.raises(ProvisionError) as failure:
        await ensure_engine(
            "llamacpp",
            BUILD,
            paths,
            lambda _: None,
            downloader=Downloader(client, sleep=no_sleep, margin_bytes=0),
            release_api=downloads(server),
            releases=pinned({name: tarball}),
        )

    assert name == f"llama-{BUILD}-bin-macos-arm64.tar.gz"
    assert failure.value.problem.message == (
        "This llama.cpp build needs macOS 26 or later; this Mac has 15.3. Update macOS or the app.")
    assert "libggml-metal.0.dylib" in failure.value.problem.details[0]
    assert not list(paths.engines_dir.rglob("llama-server"))


@pytest.mark.parametrize("macos", ["15.3", "13.3", "10.16", ""])  # 10.16, "": a Python that cannot tell
async def test_a_mac_installs_a_build_its_macos_starts(
    macos: str, server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_a_mac(monkeypatch, macos)
    name, tarball = platform_asset_name(".tar.gz"), mac_release((13, 3, 0), (11, 0, 0))
    serve_release(server, {name: tarball})

    install = await ensure_engine(
        "llamacpp",
        BUILD,
        Paths.under(tmp_path),
        lambda _: None,
        downloader=Downloader(client, sleep=no_sleep, margin_bytes=0),
        release_api=downloads(server),
        releases=pinned({name: tarball}),
    )

    assert Path(install.executable[0]).read_bytes() == thin(CPU_ARM64, minos=(13, 3, 0))
