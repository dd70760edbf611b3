"""The model an assignment names, onto this machine: returns what the engine is started with.

A Hugging Face repo goes through huggingface_hub into the app's model cache; an https GGUF
through the resumable downloader; an absolute local path is checked where it is. Cached
downloads are tracked in the cache index, and the least recently used are evicted when the cache
grows past the user's limit — never a model in use.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx

from worker import protocol
from worker.config import Paths, Settings
from worker.events import Problem
from worker.provision.cache import ModelCache
from worker.provision.download import (
    SPACE_MARGIN_BYTES,
    Downloader,
    FreeBytes,
    disk_free,
    verify_sha256,
)
from worker.provision.errors import ProvisionError
from worker.provision.progress import ProgressCallback
from worker.provision.sources import BadSource, ModelSource, parse_source

EngineKind = Literal["vllm", "llamacpp"]
MIB = 1024 * 1024
GIB = 1024 * MIB
_SHARD = "-00001-of-"


@dataclass(frozen=True)
class ModelOptions:
    """The collaborators a download uses; tests inject the disk reader, clock and retry sleep."""

    free_bytes: FreeBytes = disk_free
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    margin_bytes: int = SPACE_MARGIN_BYTES
    in_use: Collection[Path] = field(default_factory=tuple)


def model_cache_root(paths: Paths, settings: Settings) -> Path:
    return Path(settings.model_cache_dir).expanduser() if settings.model_cache_dir else paths.models_dir


async def ensure_model(
    engine_model: protocol.EngineModel,
    engine: EngineKind,
    paths: Paths,
    settings: Settings,
    on_progress: ProgressCallback,
    *,
    http: httpx.AsyncClient | None = None,
    hf_endpoint: str | None = None,
    options: ModelOptions = ModelOptions(),
) -> Path:
    """The GGUF file or model folder to start `engine` with; raises `ProvisionError`.

    `sha256` is checked for a single file (https or local); a Hugging Face repo is pinned by its
    `revision` instead. Progress events go to `on_progress` on the calling loop.
    """
    source = _parse(engine_model.source)
    if source.kind == "local":
        return await _local_model(Path(source.value), engine_model.sha256, engine)
    cache = ModelCache(model_cache_root(paths, settings))
    limit = int(settings.model_cache_limit_gib * GIB)
    if source.kind == "https":
        path = await _https_model(source, engine_model, cache, limit, on_progress, http, options)
    else:
        path = await _hf_model(source, engine_model, engine, cache, limit, on_progress, hf_endpoint, options)
    await asyncio.to_thread(cache.evict, limit, in_use=(*options.in_use, path))
    return path


def _parse(source: str) -> ModelSource:
    try:
        return parse_source(source)
    except BadSource as exc:
        raise ProvisionError(Problem("Model source not usable", str(exc))) from None


async def _https_model(
    source: ModelSource,
    engine_model: protocol.EngineModel,
    cache: ModelCache,
    limit: int,
    on_progress: ProgressCallback,
    http: httpx.AsyncClient | None,
    options: ModelOptions,
) -> Path:
    key = f"https:{source.value}"
    url_id = hashlib.sha256(source.value.encode()).hexdigest()[:12]
    dest = cache.root / "gguf" / f"{url_id}-{source.file_name}"
    entry = await asyncio.to_thread(cache.get, key)
    if entry is not None and (engine_model.sha256 is None or entry.sha256 == engine_model.sha256):
        await asyncio.to_thread(cache.touch, key)
        return dest
    need = engine_model.weights_mib * MIB
    await asyncio.to_thread(cache.evict, max(0, limit - need), in_use=(*options.in_use, dest))
    async with _client(http) as client:
        await _downloader(client, options).fetch(
            source.value,
            dest,
            what=f"model {source.file_name}",
            on_progress=on_progress,
            sha256=engine_model.sha256,
        )
    await asyncio.to_thread(cache.put, key, dest, sha256=engine_model.sha256)
    return dest


@asynccontextmanager
async def _client(http: httpx.AsyncClient | None) -> AsyncIterator[httpx.AsyncClient]:
    """The caller's client, or one of our own for this download (closed after it)."""
    if http is not None:
        yield http
        return
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), follow_redirects=True) as own:
        yield own


def _downloader(client: httpx.AsyncClient, options: ModelOptions) -> Downloader:
    return Downloader(
        client,
        free_bytes=options.free_bytes,
        clock=options.clock,
        sleep=options.sleep,
        margin_bytes=options.margin_bytes,
    )


async def _hf_model(
    source: ModelSource,
    engine_model: protocol.EngineModel,
    engine: EngineKind,
    cache: ModelCache,
    limit: int,
    on_progress: ProgressCallback,
    hf_endpoint: str | None,
    options: ModelOptions,
) -> Path:
    from worker.provision.hf import RepoRequest, fetch_repo  # huggingface_hub is slow to import: only when needed

    request = RepoRequest(
        repo_id=source.value,
        revision=engine_model.revision,
        cache_dir=cache.root / "hf",
        endpoint=hf_endpoint,
        allow_patterns=("*.gguf",) if engine == "llamacpp" else None,
    )
    key = f"hf:{source.value}"
    cached = await asyncio.to_thread(cache.get, key)
    need = 0 if cached is not None else engine_model.weights_mib * MIB
    await asyncio.to_thread(cache.evict, max(0, limit - need), in_use=(*options.in_use, request.storage))
    snapshot = await fetch_repo(
        request,
        what=f"model {source.value}",
        on_progress=on_progress,
        free_bytes=options.free_bytes,
        margin_bytes=options.margin_bytes,
        clock=options.clock,
    )
    await asyncio.to_thread(cache.put, key, request.storage)
    return _gguf_in(snapshot, source.value) if engine == "llamacpp" else snapshot


async def _local_model(path: Path, sha256: str | None, engine: EngineKind) -> Path:
    if not path.exists():
        raise ProvisionError(
            Problem(
                "Model not found", f"The model path {path} does not exist on this machine.", action="settings"
            )
        )
    if sha256:
        if not path.is_file():
            raise ProvisionError(
                Problem(
                    "Model source not usable",
                    f"{path} is a folder; a sha256 can only be checked for one file.",
                )
            )
        await verify_sha256(path, sha256, f"model {path.name}")
    if engine == "llamacpp" and path.is_dir():
        return _gguf_in(path, str(path))
    return path


def _gguf_in(folder: Path, name: str) -> Path:
    """The one GGUF file llama.cpp loads from a folder (the first shard of a split model)."""
    files = sorted(p for p in folder.rglob("*.gguf") if p.is_file() or p.is_symlink())
    shards = [p for p in files if _SHARD in p.name]
    if len(files) == 1 or (shards and len(shards) == 1):
        return shards[0] if shards else files[0]
    reason = (
        "no GGUF file" if not files else f"{len(files)} GGUF files ({', '.join(p.name for p in files[:4])})"
    )
    raise ProvisionError(
        Problem(
            "Model source not usable",
            f"{name} has {reason}; llama.cpp needs exactly one. Name the file with its https:// URL instead.",
        )
    )
