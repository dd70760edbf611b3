from __future__ import annotations

import hashlib
import os
from pathlib import Path

import httpx
import pytest

from tests.support.https_server import HttpsServer
from tests.worker.provision.conftest import no_sleep
from tests.worker.provision.hf_endpoint import hub_trusting, serve_repo
from worker import protocol
from worker.config import Paths, Settings
from worker.events import DownloadProgress
from worker.provision.errors import ProvisionError
from worker.provision.models import ModelOptions, ensure_model

GGUF = b"GGUF" + os.urandom(200_000)
GGUF_SHA = hashlib.sha256(GGUF).hexdigest()
COMMIT = "c" * 40
OPTIONS = ModelOptions(free_bytes=lambda _: 10**12, sleep=no_sleep, margin_bytes=0)


def engine_model(source: str, **fields: object) -> protocol.EngineModel:
    return protocol.EngineModel(source=source, weights_mib=1, **fields)  # type: ignore[arg-type]


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return Paths.under(tmp_path / "app")


async def test_https_gguf_arrives_verified_with_progress(
    server: HttpsServer, client: httpx.AsyncClient, paths: Paths, progress: list[DownloadProgress]
) -> None:
    server.add("q4.gguf", GGUF)
    model = engine_model(server.url("q4.gguf"), sha256=GGUF_SHA)

    path = await ensure_model(
        model, "llamacpp", paths, Settings(), progress.append, http=client, options=OPTIONS
    )

    assert path.read_bytes() == GGUF
    assert path.is_relative_to(paths.models_dir)
    assert progress[-1].finished and progress[-1].total_bytes == len(GGUF)


async def test_cached_gguf_is_served_without_a_second_download(
    server: HttpsServer, client: httpx.AsyncClient, paths: Paths, progress: list[DownloadProgress]
) -> None:
    server.add("q4.gguf", GGUF)
    model = engine_model(server.url("q4.gguf"), sha256=GGUF_SHA)

    first = await ensure_model(
        model, "llamacpp", paths, Settings(), progress.append, http=client, options=OPTIONS
    )
    second = await ensure_model(
        model, "llamacpp", paths, Settings(), progress.append, http=client, options=OPTIONS
    )

    assert first == second
    assert len(server.requests_for("q4.gguf", "GET")) == 1


async def test_https_gguf_with_wrong_hash_fails_and_nothing_is_served(
    server: HttpsServer, client: httpx.AsyncClient, paths: Paths, progress: list[DownloadProgress]
) -> None:
    server.add("q4.gguf", GGUF)
    model = engine_model(server.url("q4.gguf"), sha256="f" * 64)

    with pytest.raises(ProvisionError) as failure:
        await ensure_model(
            model, "llamacpp", paths, Settings(), progress.append, http=client, options=OPTIONS
        )

    assert "sha256" in failure.value.problem.message
    assert not [p for p in paths.models_dir.rglob("*") if p.is_file() and p.name.endswith(".gguf")]
    assert not list(paths.models_dir.rglob("*.part"))


async def test_hugging_face_repo_arrives_in_the_app_cache_with_progress(
    server: HttpsServer, paths: Paths, progress: list[DownloadProgress]
) -> None:
    files = {"config.json": b'{"model_type": "tiny"}', "model.safetensors": os.urandom(150_000)}
    serve_repo(server, "org/tiny", files, commit=COMMIT)
    model = engine_model("org/tiny", revision="main")

    with hub_trusting(server):
        folder = await ensure_model(
            model, "vllm", paths, Settings(), progress.append, hf_endpoint=server.base_url, options=OPTIONS
        )

    assert folder.is_relative_to(paths.models_dir)
    assert folder.name == COMMIT
    assert (folder / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert progress[0].total_bytes == sum(len(b) for b in files.values())
    assert progress[-1].finished
    assert server.requests_for(f"org/tiny/resolve/{COMMIT}/model.safetensors", "GET")


async def test_cached_hugging_face_repo_is_served_while_the_hub_is_unreachable(
    server: HttpsServer, paths: Paths, progress: list[DownloadProgress]
) -> None:
    serve_repo(server, "org/tiny", {"config.json": b"{}"}, commit=COMMIT)
    model = engine_model("org/tiny")
    with hub_trusting(server):
        folder = await ensure_model(
            model, "vllm", paths, Settings(), progress.append, hf_endpoint=server.base_url, options=OPTIONS
        )
    server.close()

    with hub_trusting(server):
        again = await ensure_model(
            model, "vllm", paths, Settings(), progress.append, hf_endpoint=server.base_url, options=OPTIONS
        )

    assert again == folder
    assert progress[-1].finished


async def test_hugging_face_repo_for_llamacpp_gives_its_gguf_file(
    server: HttpsServer, paths: Paths, progress: list[DownloadProgress]
) -> None:
    serve_repo(server, "org/tiny-gguf", {"tiny-Q4_K_M.gguf": GGUF, "README.md": b"# tiny"}, commit=COMMIT)
    model = engine_model("org/tiny-gguf")

    with hub_trusting(server):
        path = await ensure_model(
            model,
            "llamacpp",
            paths,
            Settings(),
            progress.append,
            hf_endpoint=server.base_url,
            options=OPTIONS,
        )

    assert path.name == "tiny-Q4_K_M.gguf" and path.read_bytes() == GGUF
    assert not server.requests_for(f"org/tiny-gguf/resolve/{COMMIT}/README.md")


async def test_missing_hugging_face_repo_says_so(
    server: HttpsServer, paths: Paths, progress: list[DownloadProgress]
) -> None:
    with hub_trusting(server), pytest.raises(ProvisionError) as failure:
        await ensure_model(
            engine_model("org/absent"),
            "vllm",
            paths,
            Settings(),
            progress.append,
            hf_endpoint=server.base_url,
            options=OPTIONS,
        )

    assert "org/absent" in failure.value.problem.message


async def test_hugging_face_download_short_of_disk_names_the_shortfall(
    server: HttpsServer, paths: Paths, progress: list[DownloadProgress]
) -> None:
    serve_repo(server, "org/big", {"model.safetensors": os.urandom(3 * 1024 * 1024)}, commit=COMMIT)
    options = ModelOptions(free_bytes=lambda _: 1024 * 1024, margin_bytes=0)

    with hub_trusting(server), pytest.raises(ProvisionError) as failure:
        await ensure_model(
            engine_model("org/big"),
            "vllm",
            paths,
            Settings(),
            progress.append,
            hf_endpoint=server.base_url,
            options=options,
        )

    assert failure.value.problem.action == "free_disk"
    assert "Free up 2 MiB more" in failure.value.problem.message
    assert not server.requests_for(f"org/big/resolve/{COMMIT}/model.safetensors", "GET")


async def test_local_gguf_is_verified_in_place(
    tmp_path: Path, paths: Paths, progress: list[DownloadProgress]
) -> None:
    local = tmp_path / "mine.gguf"
    local.write_bytes(GGUF)

    path = await ensure_model(
        engine_model(str(local), sha256=GGUF_SHA), "llamacpp", paths, Settings(), progress.append
    )

    assert path == local


async def test_local_file_with_wrong_hash_is_refused(
    tmp_path: Path, paths: Paths, progress: list[DownloadProgress]
) -> None:
    local = tmp_path / "mine.gguf"
    local.write_bytes(GGUF)

    with pytest.raises(ProvisionError):
        await ensure_model(
            engine_model(str(local), sha256="0" * 64), "llamacpp", paths, Settings(), progress.append
        )

    assert local.exists()


async def test_local_folder_for_vllm_and_its_gguf_for_llamacpp(
    tmp_path: Path, paths: Paths, progress: list[DownloadProgress]
) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "m-00001-of-00002.gguf").write_bytes(GGUF)
    (folder / "m-00002-of-00002.gguf").write_bytes(GGUF)

    assert await ensure_model(engine_model(str(folder)), "vllm", paths, Settings(), progress.append) == folder
    assert (
        await ensure_model(engine_model(str(folder)), "llamacpp", paths, Settings(), progress.append)
    ).name == "m-00001-of-00002.gguf"


async def test_missing_local_path_is_a_clear_failure(
    tmp_path: Path, paths: Paths, progress: list[DownloadProgress]
) -> None:
    with pytest.raises(ProvisionError) as failure:
        await ensure_model(
            engine_model(str(tmp_path / "nowhere")), "vllm", paths, Settings(), progress.append
        )

    assert "does not exist" in failure.value.problem.message


async def test_least_recently_used_models_are_evicted_past_the_limit(
    server: HttpsServer, client: httpx.AsyncClient, paths: Paths, progress: list[DownloadProgress]
) -> None:
    for name in ("a", "b", "c"):
        server.add(f"{name}.gguf", os.urandom(1024 * 1024))
    settings = Settings(model_cache_limit_gib=2.5 / 1024)
    got = {}
    for name in ("a", "b"):
        got[name] = await ensure_model(
            engine_model(server.url(f"{name}.gguf")),
            "llamacpp",
            paths,
            settings,
            progress.append,
            http=client,
            options=OPTIONS,
        )
    await ensure_model(
        engine_model(server.url("a.gguf")),
        "llamacpp",
        paths,
        settings,
        progress.append,
        http=client,
        options=OPTIONS,
    )

    got["c"] = await ensure_model(
        engine_model(server.url("c.gguf")),
        "llamacpp",
        paths,
        settings,
        progress.append,
        http=client,
        options=OPTIONS,
    )

    assert got["a"].exists() and got["c"].exists()
    assert not got["b"].exists()
