"""The model an assignment names, onto this machine: returns what the engine is started with.

A Hugging Face repo goes through huggingface_hub into the app's model cache; an https GGUF through
the resumable downloader, saved under the app's own name (its sha256); an absolute local path is
checked where it is — a GGUF file for an engine that loads one (`MODEL_FORMAT` "gguf"), a folder
with config.json for one that loads a model folder ("folder"), never a device or other special file.
Every local path the node cannot use gets the same words (`UNUSABLE_PATH`), whether it is missing,
unreadable, special, not a model, a folder with no or several GGUF files, or of another sha256: the
refusal goes to the coordinator, which must not learn what exists on this machine. Downloads go only
to public https hosts (`ModelOptions.hosts`, `worker.provision.hosts`). A download may bring at most
the assignment's `weights_mib` plus 10 %, and never more than the cache limit. Cached downloads are
tracked in the cache index, and the least recently used are evicted when the cache grows past the
user's limit — never a model in use.

An engine inside WSL2 (`wsl_distro`) reads its model from the distribution's own disk: a model
read across `/mnt/c` goes through WSL's 9P file server, many times slower than the distribution's
ext4. So its cache is `~/.cache/gpu-provider/models` inside the distribution, written by the app
through the Windows path `wslpath -w` gives for it (the same downloader, hash checks, progress,
eviction and disk-space check, which then measures the distribution's disk); a local path is copied
in once (keyed by what it is, so a second start reuses the copy); the engine is given the Linux path.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import ssl
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePath, PurePosixPath
from typing import Literal

import httpx

from worker.provision import fetch as download
from worker.contract import protocol
from worker.system.config import Paths, Settings
from worker.provision.fetch import SPACE_MARGIN_BYTES, FreeBytes, disk_free
from worker.provision.hosts import PUBLIC_HOSTS, HostPolicy, download_client
from worker.engines import EngineAdapter, registry
from worker.contract.events import Problem
from worker.provision.cache import ModelCache
from worker.provision.problems import Downloader, SizeCap, fetch
from worker.engines.installing import human_bytes
from worker.provision.errors import ProvisionError
from worker.provision.progress import ProgressCallback, ProgressMeter
from worker.provision.transfer import TransferControl
from worker.plan.sources import BadSource, ModelSource, check_source, under_system_folder
from worker.system import wsl

MIB = 1024 * 1024
GIB = 1024 * MIB
GGUF_MAGIC = b"GGUF"
_SHARD = "-00001-of-"
UNUSABLE_PATH = "The model path given cannot be used on this machine."
WSL_MODELS_DIR = PurePosixPath(".cache/gpu-provider/models")  # under the distro user's home
COPY_CHUNK_BYTES = 16 * MIB
MAX_COPIED_FILES = 10_000  # a model folder to copy into WSL2: more files is no model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelOptions:
    """The collaborators a download uses; tests inject the disk reader, clock and retry sleep, and
    (serving files on 127.0.0.1) their own host policy and certificate authority."""

    hosts: HostPolicy = PUBLIC_HOSTS
    verify: ssl.SSLContext | bool = True
    free_bytes: FreeBytes = disk_free
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    margin_bytes: int = SPACE_MARGIN_BYTES
    in_use: Collection[Path] = field(default_factory=tuple)


def model_cache_root(paths: Paths, settings: Settings) -> Path:
    return Path(settings.model_cache_dir).expanduser() if settings.model_cache_dir else paths.models_dir


async def ensure_model(
    engine_model: protocol.EngineModel,
    engine: str,
    paths: Paths,
    settings: Settings,
    on_progress: ProgressCallback,
    *,
    http: httpx.AsyncClient | None = None,
    hf_endpoint: str | None = None,
    options: ModelOptions = ModelOptions(),
    wsl_distro: str | None = None,
    control: TransferControl | None = None,
) -> PurePath:
    """The GGUF file or model folder to start `engine` with; raises `ProvisionError`. With
    `wsl_distro`, the engine runs inside that WSL2 distribution: the model goes there and the
    path returned is the Linux one.

    `sha256` is checked for a single file (https or local); a Hugging Face repo is pinned by its
    `revision` instead. Progress events go to `on_progress` on the calling loop. A download obeys
    `control` (held, paced, counted against the monthly budget, cancelled: `DownloadCancelled`).
    """
    source = _checked(engine_model, engine)
    adapter = registry.get(engine)
    if wsl_distro is not None:
        inside = await _wsl_cache(wsl_distro)
        path = await _fetched(source, engine_model, adapter, ModelCache(inside.host_root), settings, on_progress,
                              http, hf_endpoint, options, control)
        return inside.linux_root / path.relative_to(inside.host_root).as_posix()
    if source.kind == "local":
        return await _local_model(Path(source.value), source.sha256, adapter)
    return await _fetched(source, engine_model, adapter, ModelCache(model_cache_root(paths, settings)), settings,
                          on_progress, http, hf_endpoint, options, control)


@dataclass(frozen=True)
class _WslCache:
    """The model cache inside a WSL2 distribution: as this machine writes it, and as Linux reads it."""

    host_root: Path
    linux_root: PurePosixPath


async def _wsl_cache(distro: str) -> _WslCache:
    try:
        home = await asyncio.to_thread(wsl.home, distro)
        host_root = await asyncio.to_thread(wsl.host_folder, home / WSL_MODELS_DIR, distro=distro)
    except wsl.WslError as exc:
        log.warning("the model folder inside WSL2 could not be prepared: %s", exc)
        raise ProvisionError(Problem(
            "WSL2 did not answer",
            "The app could not prepare the model folder inside WSL2. Open your Linux distribution once from "
            "the Start menu to finish its setup (or run `wsl --update` in PowerShell), then resume the app.",
            action="settings",
        )) from None
    return _WslCache(host_root, home / WSL_MODELS_DIR)


async def _fetched(
    source: ModelSource,
    engine_model: protocol.EngineModel,
    adapter: EngineAdapter,
    cache: ModelCache,
    settings: Settings,
    on_progress: ProgressCallback,
    http: httpx.AsyncClient | None,
    hf_endpoint: str | None,
    options: ModelOptions,
    control: TransferControl | None,
) -> Path:
    """The model in `cache` (a local one copied in), downloaded or copied where missing."""
    limit = int(settings.model_cache_limit_gib * GIB)
    cap = size_cap(engine_model.weights_mib, limit)
    if source.kind == "local":
        local = await _local_model(Path(source.value), source.sha256, adapter)
        path = await _copied_in(local, source.sha256, cache, cap, on_progress, options)
    elif source.kind == "https":
        path = await _https_model(source, engine_model, cache, limit, cap, on_progress, http, options, control)
    else:
        path = await _hf_model(
            source, engine_model, adapter, cache, limit, cap, on_progress, hf_endpoint, options, control
        )
    await asyncio.to_thread(cache.evict, limit, in_use=(*options.in_use, path))
    return path


async def _copied_in(model: Path, sha256: str | None, cache: ModelCache, cap: SizeCap,
                     on_progress: ProgressCallback, options: ModelOptions) -> Path:
    """`model` (a checked file or folder here) copied into `cache` once, under a key of what it is
    (its sha256, else its real path, size and change time), with progress; the copy where it is."""
    files, identity = await asyncio.to_thread(_files_to_copy, model, cap)
    digest = hashlib.sha256((f"sha256:{sha256}" if sha256 else identity).encode()).hexdigest()[:32]
    key, folder = f"local:{digest}", cache.root / "local" / digest
    dest = folder / model.name
    if await asyncio.to_thread(cache.get, key) is not None:
        await asyncio.to_thread(cache.touch, key)
        return dest
    total = sum(size for _, size in files)
    free = await asyncio.to_thread(options.free_bytes, cache.root)
    if free < total + options.margin_bytes:
        need = total + options.margin_bytes
        raise ProvisionError(Problem(
            "Not enough disk space",
            f"Copying the model {model.name} needs {human_bytes(need)} free in {cache.root}, but only "
            f"{human_bytes(free)} is free. Free up {human_bytes(need - free)} more on that disk.",
            action="free_disk",
        ))
    staging = cache.root / "local" / f".{digest}.partial"
    await asyncio.to_thread(_remove_tree, staging)
    meter = ProgressMeter(f"model {model.name}", on_progress, total_bytes=total, clock=options.clock)
    meter.start(0, total)
    done = 0
    try:
        for source, _ in files:
            target = staging / model.name / source.relative_to(model) if source != model else staging / model.name
            done = await _copy_file(source, target, meter, done)
        await asyncio.to_thread(os.replace, staging, folder)
    except OSError as exc:
        log.warning("copying the model into %s failed: %s", cache.root, exc)
        problem = Problem("Could not copy the model",
                          f"Copying the model {model.name} to {cache.root} failed. Check that the disk has room "
                          "and that the model files can be read, then resume the app.", action="free_disk")
        meter.fail(problem.message)
        raise ProvisionError(problem) from None
    meter.finish()
    await asyncio.to_thread(cache.put, key, folder, sha256=sha256)
    return dest


def _files_to_copy(model: Path, cap: SizeCap) -> tuple[list[tuple[Path, int]], str]:
    """The regular files of `model` with their sizes (a folder's links to files followed, no
    folder link; anything else, a dangling link included, left out), at most `MAX_COPIED_FILES`
    and `cap`, and what identifies this model here."""
    found: list[tuple[Path, int]] = []
    walk = [(str(model.parent), [], [model.name])] if _local_kind(model) == "file" else os.walk(model)
    for top, folders, names in walk:
        folders[:] = [f for f in folders if not Path(top, f).is_symlink()]
        for name in names:
            path = Path(top, name)
            try:
                info = os.stat(path)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                found.append((path, info.st_size))
            if len(found) > MAX_COPIED_FILES:
                raise _unusable()
    total = sum(size for _, size in found)
    if total > cap.max_bytes:
        raise ProvisionError(Problem("Model larger than allowed",
                                     f"The model is {human_bytes(total)}, more than {cap.said}."))
    return found, f"{os.path.realpath(model)}:{total}:{os.stat(model).st_mtime_ns}"


async def _copy_file(source: Path, target: Path, meter: ProgressMeter, done: int) -> int:
    """One file copied in chunks (each in a thread, the progress on this loop); the bytes done
    after it. Opened without blocking and checked again, so a file swapped for a FIFO is never waited on."""
    await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
    fd = os.open(source, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    with open(fd, "rb") as reader, open(target, "wb") as writer:  # noqa: ASYNC230 - chunks go through threads
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _unusable()
        while chunk := await asyncio.to_thread(reader.read, COPY_CHUNK_BYTES):
            await asyncio.to_thread(writer.write, chunk)
            done += len(chunk)
            meter.update(done)
    return done


def _remove_tree(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)


def size_cap(weights_mib: int, limit_bytes: int) -> SizeCap:
    """The most a download may bring: the assignment's size plus 10 %, within the cache limit.

    A model that alone is larger than the cache limit is refused before anything is fetched.
    """
    weights = weights_mib * MIB
    if weights > limit_bytes:
        raise ProvisionError(
            Problem(
                "Model larger than the cache limit",
                f"The model is {human_bytes(weights)}, more than the model cache limit of "
                f"{human_bytes(limit_bytes)}. Raise the limit in Settings to serve it.",
                action="settings",
            )
        )
    allowed = weights + weights // 10
    if allowed <= limit_bytes:
        return SizeCap(
            allowed,
            f"the {weights_mib} MiB the network said this model is (plus 10 %). There is nothing to do on this "
            "computer: the network sees why in its status and can correct the size or offer another model",
        )
    return SizeCap(
        limit_bytes,
        f"the model cache limit of {human_bytes(limit_bytes)}; raise the limit in Settings",
    )


def _checked(engine_model: protocol.EngineModel, engine: str) -> ModelSource:
    try:
        return check_source(engine_model.source, engine_model.sha256, engine)
    except BadSource as exc:
        raise ProvisionError(Problem("Model source not usable", str(exc))) from None


async def _https_model(
    source: ModelSource,
    engine_model: protocol.EngineModel,
    cache: ModelCache,
    limit: int,
    cap: SizeCap,
    on_progress: ProgressCallback,
    http: httpx.AsyncClient | None,
    options: ModelOptions,
    control: TransferControl | None,
) -> Path:
    """The file under the app's own name (its sha256) in the cache: no URL decides where it lands."""
    key = f"gguf:{source.sha256}"
    dest = cache.root / "gguf" / source.file_name
    if await asyncio.to_thread(cache.get, key) is not None:
        await asyncio.to_thread(cache.touch, key)
        return dest
    need = engine_model.weights_mib * MIB
    await asyncio.to_thread(cache.evict, max(0, limit - need), in_use=(*options.in_use, dest))
    async with _client(http, options) as client:
        await fetch(
            Downloader(client, free_bytes=options.free_bytes, sleep=options.sleep, margin_bytes=options.margin_bytes,
                       control=control),
            source.value,
            dest,
            what=f"model {source.label}",
            on_progress=on_progress,
            sha256=source.sha256 or "",  # check_source always sets it for https; "" would match no file
            max_bytes=cap.max_bytes,
            size_said=cap.said,
            clock=options.clock,
        )
    await asyncio.to_thread(cache.put, key, dest, sha256=source.sha256)
    return dest


@asynccontextmanager
async def _client(http: httpx.AsyncClient | None, options: ModelOptions) -> AsyncIterator[httpx.AsyncClient]:
    """The caller's client, or one of our own for this download (closed after it)."""
    if http is not None:
        yield http
        return
    async with download_client(options.hosts, verify=options.verify) as own:
        yield own


async def _hf_model(
    source: ModelSource,
    engine_model: protocol.EngineModel,
    adapter: EngineAdapter,
    cache: ModelCache,
    limit: int,
    cap: SizeCap,
    on_progress: ProgressCallback,
    hf_endpoint: str | None,
    options: ModelOptions,
    control: TransferControl | None,
) -> Path:
    from worker.provision.hf import RepoRequest, fetch_repo  # huggingface_hub is slow to import: only when needed

    request = RepoRequest(
        repo_id=source.value,
        revision=engine_model.revision,
        cache_dir=cache.root / "hf",
        endpoint=hf_endpoint,
        allow_patterns=("*.gguf",) if adapter.MODEL_FORMAT == "gguf" else None,
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
        cap=cap,
        hosts=options.hosts,
        verify=options.verify,
        control=control,
    )
    await asyncio.to_thread(cache.put, key, request.storage)
    if adapter.MODEL_FORMAT != "gguf":
        return snapshot
    model = await asyncio.to_thread(_gguf_in, snapshot, recursive=True)
    if model is None:
        raise ProvisionError(
            Problem(
                "Model source not usable",
                f"{source.value} has no single GGUF file to load; {adapter.DISPLAY_NAME} needs exactly one. "
                "Name the file with its https:// URL instead.",
            )
        )
    return model


async def _local_model(path: Path, sha256: str | None, adapter: EngineAdapter) -> Path:
    """The model at `path` if it is one for the engine; never reads a device, FIFO or non-model file.

    Whatever is wrong, the refusal is `UNUSABLE_PATH`: only this machine's log says what.
    """
    model = await asyncio.to_thread(_usable_local, path, adapter.MODEL_FORMAT, sha256 is not None)
    if model is None:
        raise _unusable()
    if sha256:
        try:
            await download.check_sha256(model, sha256)
        except download.Damaged:
            log.info("local model refused: its sha256 is not the assignment's")
            raise _unusable() from None
    return model


def _usable_local(path: Path, model_format: str, one_file: bool) -> Path | None:
    """The file or folder to load from `path`, or None (the reason logged here, never sent)."""
    kind = _local_kind(path)
    if kind is None or (one_file and kind == "folder"):
        log.info("local model refused: %s", "not a regular file or folder" if kind is None else "a sha256 for a folder")
        return None
    if model_format == "folder":
        usable = kind == "folder" and _is_regular_file(path / "config.json")
        if not usable:
            log.info("local model refused: not a folder with a config.json")
        return path if usable else None
    model = path if kind == "file" else _gguf_in(path, recursive=False)
    if model is None or not _starts_with_gguf_magic(model):
        log.info("local model refused: no single GGUF file there")
        return None
    return model


def _local_kind(path: Path) -> Literal["file", "folder"] | None:
    """Regular file or folder (links followed); anything else — missing, unreadable, special, in
    /dev, /proc or /sys — None."""
    try:
        mode = os.stat(path).st_mode
        real = Path(os.path.realpath(path))
    except (OSError, ValueError):
        return None
    if os.name != "nt" and under_system_folder(PurePosixPath(real)):
        return None
    if stat.S_ISREG(mode):
        return "file"
    return "folder" if stat.S_ISDIR(mode) else None


def _is_regular_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _starts_with_gguf_magic(path: Path) -> bool:
    """Whether `path` is a regular file whose first bytes are the GGUF magic.

    Opened without blocking and checked again through the descriptor, so a file swapped for a
    FIFO or device since it was looked at is never waited on or read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False
    finally:
        os.close(fd)


_FORMAT_WORDS = {"gguf": "a GGUF file", "folder": "a model folder with config.json"}


def _unusable() -> ProvisionError:
    """The one refusal for every local path: what is wanted, nothing about what is there."""
    wanted = ", or of ".join(f"{_FORMAT_WORDS[a.MODEL_FORMAT]} for {a.DISPLAY_NAME}" for a in registry.adapters())
    return ProvisionError(
        Problem("Model source not usable", f"{UNUSABLE_PATH} Give the path of {wanted}.", action="settings")
    )


def _gguf_in(folder: Path, *, recursive: bool) -> Path | None:
    """The one GGUF file a GGUF engine loads from a folder (the first shard of a split model), or None.

    A downloaded repo is searched through; a local folder only at its top, so a path such as `/`
    never sets off a walk of the whole disk.
    """
    try:
        found = folder.rglob("*.gguf") if recursive else folder.glob("*.gguf")
        files = sorted(p for p in found if p.is_file() or p.is_symlink())
    except OSError:
        return None
    shards = [p for p in files if _SHARD in p.name]
    if len(files) == 1 or (shards and len(shards) == 1):
        return shards[0] if shards else files[0]
    return None
