from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
from pathlib import Path

import httpx
import pytest

from tests.support.https_server import SERVED_HERE, HttpsServer
from tests.worker.provision.conftest import no_sleep, trusting_ca
from tests.worker.provision.hf_endpoint import serve_repo
from worker.contract import protocol
from worker.system.config import Paths, Settings
from worker.contract.events import DownloadProgress
from worker.provision.errors import ProvisionError
from worker.provision.models import UNUSABLE_PATH, ModelOptions, ensure_model

GGUF = b"GGUF" + os.urandom(200_000)
GGUF_SHA = hashlib.sha256(GGUF).hexdigest()
COMMIT = "c" * 40
OPTIONS = ModelOptions(
    hosts=SERVED_HERE, verify=trusting_ca(), free_bytes=lambda _: 10**12, sleep=no_sleep, margin_bytes=0
)


def engine_model(source: str, **fields: object) -> protocol.EngineModel:
    fields.setdefault("weights_mib", 1)
    return protocol.EngineModel(source=source, **fields)  # type: ignore[arg-type]


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
    folder = await ensure_model(
        model, "vllm", paths, Settings(), progress.append, hf_endpoint=server.base_url, options=OPTIONS
    )
    server.close()

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
    with pytest.raises(ProvisionError) as failure:
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
    options = dataclasses.replace(OPTIONS, free_bytes=lambda _: 1024 * 1024)

    with pytest.raises(ProvisionError) as failure:
        await ensure_model(
            engine_model("org/big", weights_mib=3),
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

    with pytest.raises(ProvisionError) as failure:
        await ensure_model(
            engine_model(str(local), sha256="0" * 64), "llamacpp", paths, Settings(), progress.append
        )

    assert local.read_bytes() == GGUF
    assert failure.value.problem.message.startswith(UNUSABLE_PATH)
    assert GGUF_SHA not in failure.value.problem.message and "mine" not in failure.value.problem.message


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

    assert failure.value.problem.message.startswith(UNUSABLE_PATH) and "nowhere" not in failure.value.problem.message


async def test_least_recently_used_models_are_evicted_past_the_limit(
    server: HttpsServer, client: httpx.AsyncClient, paths: Paths, progress: list[DownloadProgress]
) -> None:
    digests = {}
    for name in ("a", "b", "c"):
        body = os.urandom(1024 * 1024)
        server.add(f"{name}.gguf", body)
        digests[name] = hashlib.sha256(body).hexdigest()
    settings = Settings(model_cache_limit_gib=2.5 / 1024)
    got = {}
    for name in ("a", "b"):
        got[name] = await ensure_model(
            engine_model(server.url(f"{name}.gguf"), sha256=digests[name]),
            "llamacpp",
            paths,
            settings,
            progress.append,
            http=client,
            options=OPTIONS,
        )
    await ensure_model(
        engine_model(server.url("a.gguf"), sha256=digests["a"]),
        "llamacpp",
        paths,
        settings,
        progress.append,
        http=client,
        options=OPTIONS,
    )

    got["c"] = await ensure_model(
        engine_model(server.url("c.gguf"), sha256=digests["c"]),
        "llamacpp",
        paths,
        settings,
        progress.append,
        http=client,
        options=OPTIONS,
    )

    assert got["a"].exists() and got["c"].exists()
    assert not got["b"].exists()


MIB = 1024 * 1024
SECRET = b"root:x:0:0:SECRET-MARKER-7f3a9c:/root:/bin/bash\n"


async def failure_of(
    model: protocol.EngineModel, engine: str, paths: Paths, **kwargs: object
) -> ProvisionError:
    """The ProvisionError `ensure_model` raises (within 10 s: a check that blocks on a FIFO fails here)."""
    with pytest.raises(ProvisionError) as failure:
        await asyncio.wait_for(
            ensure_model(model, engine, paths, Settings(), lambda _: None, options=OPTIONS, **kwargs),  # type: ignore[arg-type]
            timeout=10,
        )
    return failure.value


async def test_download_is_saved_under_the_apps_own_name_inside_the_cache(
    server: HttpsServer, client: httpx.AsyncClient, paths: Paths, progress: list[DownloadProgress]
) -> None:
    server.add("m/Startup-x.gguf", GGUF)

    path = await ensure_model(
        engine_model(server.url("m/Startup-x.gguf"), sha256=GGUF_SHA),
        "llamacpp",
        paths,
        Settings(),
        progress.append,
        http=client,
        options=OPTIONS,
    )

    assert path == paths.models_dir / "gguf" / f"{GGUF_SHA}.gguf"
    assert path.read_bytes() == GGUF
    assert "Startup-x.gguf" in progress[-1].what


@pytest.mark.parametrize(
    "tail",
    [
        "..\\..\\..\\AppData\\Roaming\\Microsoft\\Windows\\Start Menu\\Programs\\Startup\\x.bat",
        "..\\..\\..\\AppData\\Roaming\\Microsoft\\Windows\\Start%20Menu\\Programs\\Startup\\x.gguf",
        "..%5c..%5c..%5cStartup%5cx.gguf",
    ],
)
async def test_url_with_backslashes_is_refused_before_anything_is_fetched_or_written(
    server: HttpsServer, client: httpx.AsyncClient, paths: Paths, tmp_path: Path, tail: str
) -> None:
    server.add("m/x.gguf", GGUF)
    url = server.url("m/") + tail

    failure = await failure_of(engine_model(url, sha256=GGUF_SHA), "llamacpp", paths, http=client)

    assert failure.problem.title == "Model source not usable"
    assert "backslash" in failure.problem.message
    assert server.requests == []
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.parent.name != "served"]


@pytest.mark.parametrize(
    "source", ["\\\\host\\share\\m.gguf", "//host/share/m.gguf", "\\\\?\\C:\\m.gguf", "\\\\.\\PhysicalDrive0"]
)
async def test_network_and_device_namespace_paths_are_refused(paths: Paths, source: str) -> None:
    failure = await failure_of(engine_model(source), "llamacpp", paths)

    assert "network (UNC) or device path" in failure.problem.message


async def test_dev_zero_is_refused(paths: Paths) -> None:
    failure = await failure_of(engine_model("/dev/zero"), "llamacpp", paths)

    assert "/dev" in failure.problem.message


async def test_link_to_a_device_is_refused(tmp_path: Path, paths: Paths) -> None:
    link = tmp_path / "m.gguf"
    link.symlink_to("/dev/zero")

    failure = await failure_of(engine_model(str(link)), "llamacpp", paths)

    assert failure.problem.message.startswith(UNUSABLE_PATH) and str(tmp_path) not in failure.problem.message


async def test_fifo_is_refused_without_blocking(tmp_path: Path, paths: Paths) -> None:
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)

    failure = await failure_of(engine_model(str(fifo)), "llamacpp", paths)

    assert failure.problem.message.startswith(UNUSABLE_PATH)


async def test_fifo_named_gguf_in_a_folder_is_refused_without_blocking(tmp_path: Path, paths: Paths) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    os.mkfifo(tmp_path / "pipe")
    (folder / "m.gguf").symlink_to(tmp_path / "pipe")

    failure = await failure_of(engine_model(str(folder)), "llamacpp", paths)

    assert "GGUF" in failure.problem.message


async def test_file_that_is_not_gguf_is_refused_and_the_error_quotes_none_of_it(
    tmp_path: Path, paths: Paths
) -> None:
    secret = tmp_path / "passwd.gguf"
    secret.write_bytes(SECRET)

    failure = await failure_of(engine_model(str(secret)), "llamacpp", paths)

    assert failure.problem.message.startswith(UNUSABLE_PATH) and "passwd" not in failure.problem.message
    assert "SECRET-MARKER" not in str(failure) and "root:x" not in str(failure)


async def test_etc_passwd_is_refused_and_the_error_quotes_none_of_it(paths: Paths) -> None:
    first_line = Path("/etc/passwd").read_bytes().split(b"\n")[0].decode(errors="replace")

    failure = await failure_of(engine_model("/etc/passwd"), "llamacpp", paths)

    assert failure.problem.message.startswith(UNUSABLE_PATH) and "passwd" not in failure.problem.message
    assert first_line[:12] not in str(failure)


async def test_hash_of_a_file_that_is_not_gguf_is_never_reported(tmp_path: Path, paths: Paths) -> None:
    secret = tmp_path / "passwd.gguf"
    secret.write_bytes(SECRET)

    failure = await failure_of(engine_model(str(secret), sha256="0" * 64), "llamacpp", paths)

    assert hashlib.sha256(SECRET).hexdigest() not in str(failure)


async def test_folder_without_config_json_is_refused_for_vllm(tmp_path: Path, paths: Paths) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\0" * 64)

    failure = await failure_of(engine_model(str(folder)), "vllm", paths)

    assert failure.problem.message.startswith(UNUSABLE_PATH) and "config.json" in failure.problem.message
    assert str(folder) not in failure.problem.message


async def test_gguf_file_is_refused_for_vllm(tmp_path: Path, paths: Paths) -> None:
    local = tmp_path / "mine.gguf"
    local.write_bytes(GGUF)

    failure = await failure_of(engine_model(str(local)), "vllm", paths)

    assert "config.json" in failure.problem.message


async def test_download_over_the_assignment_size_is_stopped_and_deleted(
    server: HttpsServer, client: httpx.AsyncClient, paths: Paths
) -> None:
    server.add("m.gguf", os.urandom(4 * MIB), chunked=True)

    failure = await failure_of(
        engine_model(server.url("m.gguf"), sha256=GGUF_SHA), "llamacpp", paths, http=client
    )

    assert "the 1 MiB the network said this model is" in failure.problem.message
    assert "ask the network" not in failure.problem.message  # a person cannot: the advice is what they can do
    assert not [p for p in paths.models_dir.rglob("*") if p.is_file() and p.name != "index.json.lock"]


async def test_download_over_the_cache_limit_is_stopped_and_deleted(
    server: HttpsServer, client: httpx.AsyncClient, paths: Paths
) -> None:
    server.add("m.gguf", os.urandom(4 * MIB), chunked=True)
    settings = Settings(model_cache_limit_gib=1.05 / 1024)

    with pytest.raises(ProvisionError) as failure:
        await ensure_model(
            engine_model(server.url("m.gguf"), sha256=GGUF_SHA),
            "llamacpp",
            paths,
            settings,
            lambda _: None,
            http=client,
            options=OPTIONS,
        )

    assert "model cache limit" in failure.value.problem.message
    assert not list((paths.models_dir / "gguf").iterdir())


async def test_model_larger_than_the_cache_limit_is_refused_before_downloading(
    server: HttpsServer, client: httpx.AsyncClient, paths: Paths
) -> None:
    server.add("m.gguf", GGUF)

    with pytest.raises(ProvisionError) as failure:
        await ensure_model(
            engine_model(server.url("m.gguf"), sha256=GGUF_SHA, weights_mib=10),
            "llamacpp",
            paths,
            Settings(model_cache_limit_gib=2 / 1024),
            lambda _: None,
            http=client,
            options=OPTIONS,
        )

    assert failure.value.problem.action == "settings"
    assert server.requests == []


async def test_hugging_face_repo_announced_over_the_cap_is_refused_before_downloading(
    server: HttpsServer, paths: Paths
) -> None:
    serve_repo(server, "org/big", {"model.safetensors": os.urandom(3 * MIB)}, commit=COMMIT)

    failure = await failure_of(engine_model("org/big"), "vllm", paths, hf_endpoint=server.base_url)

    assert "nothing was downloaded" in failure.problem.message
    assert not server.requests_for(f"org/big/resolve/{COMMIT}/model.safetensors", "GET")


async def test_hugging_face_file_sending_more_than_announced_is_stopped_and_deleted(
    server: HttpsServer, paths: Paths
) -> None:
    serve_repo(server, "org/liar", {"config.json": b"{}", "model.safetensors": b"x" * 1000}, commit=COMMIT)
    headers = {"X-Repo-Commit": COMMIT, "ETag": '"' + "e" * 64 + '"'}
    for ref in (COMMIT, "main"):
        server.add(
            f"org/liar/resolve/{ref}/model.safetensors",
            os.urandom(32 * MIB),
            headers=headers,
            claimed_size=1000,
        )

    failure = await failure_of(engine_model("org/liar"), "vllm", paths, hf_endpoint=server.base_url)

    assert failure.problem.title == "Download larger than expected"
    assert not list((paths.models_dir / "hf").glob("models--org--liar"))
