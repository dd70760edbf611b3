"""A Hugging Face repo into the model cache, through huggingface_hub, with a space check and progress.

huggingface_hub owns the cache layout (blobs, snapshots, refs) and resumes its own `.incomplete`
files; this module adds what the app needs around it: the size cap and free-space check before
anything is written (from a dry run that lists the files and the sizes the Hub announces), the
size cap again while bytes arrive (huggingface_hub reports every chunk to the progress bar class
it is given before writing it, and ours stops the download there), progress events from how much
of the repo is on disk, and failures a person can act on. Its calls block, so they run in a thread.

Where it connects: huggingface_hub follows redirects itself (to its CDN), so the check is in its
HTTP client: `fetch_repo` installs one whose transport checks every request, each hop included, as
`worker.provision.hosts` does for our own downloads (https, a public host name, public addresses,
connected to the address checked). Xet transfers are turned off: hf_xet is native code with its own
HTTP that nothing here can check, and without it the same files come over plain https.

The same transport passes every chunk it receives through the node's `TransferControl`: held while
downloads are held (huggingface_hub resumes its `.incomplete` file with Range if the server closed the
idle connection meanwhile), paced to the limit, counted against the monthly budget, cancelled. The
repo's announced size (the dry run's) is checked against the budget before anything is fetched.
What it cannot do: huggingface_hub writes its files 10 MiB at a time, and progress is read from the
disk, so the percent moves in 10 MiB steps (the holds and the pacing act on each network chunk).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import shutil
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
from huggingface_hub import constants as hf_constants
from huggingface_hub import set_client_factory, snapshot_download
from huggingface_hub.errors import (
    DisabledRepoError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils._http import hf_request_event_hook
from tqdm.auto import tqdm  # type: ignore[import-untyped]

from worker.provision.hosts import PUBLIC_HOSTS, HostPolicy, HostRefused, IPAddress, checked_addresses
from worker.contract.events import DownloadProgress, Problem
from worker.provision.cache import tree_size
from worker.provision.problems import (
    FreeBytes, SizeCap, budget_exceeded, ensure_free_space, host_refused, too_large,
)
from worker.provision.errors import ProvisionError
from worker.provision.progress import ProgressCallback, ProgressMeter
from worker.provision.transfer import BudgetExceeded, DownloadCancelled, TransferControl

log = logging.getLogger(__name__)


class _SilentBar(tqdm):  # type: ignore[misc]
    """huggingface_hub's bars would write to a console the app does not have; progress goes through events."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


class _TooLarge(Exception):
    """Raised inside huggingface_hub's download threads: the repo brought more bytes than its cap."""


def _capped_bar(max_bytes: int) -> type[_SilentBar]:
    """A bar class that stops the download (by raising) once any one bar counts past `max_bytes`.

    huggingface_hub calls `update(len(chunk))` before writing each chunk, on an aggregate bar for
    the whole snapshot; the other bars count files or the same bytes again, so each counts alone.
    """
    lock = threading.Lock()

    class _CappedBar(_SilentBar):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.counted = 0

        def update(self, n: float | None = 1) -> bool | None:
            with lock:
                self.counted += int(n or 0)
                over = self.counted > max_bytes
            if over:
                raise _TooLarge(f"more than {max_bytes} bytes")
            return super().update(n)  # type: ignore[no-any-return]

    return _CappedBar


class _ControlledStream(httpx2.SyncByteStream):
    """A response body whose every chunk passes the control (held, paced, counted) as it is read."""

    def __init__(self, inner: httpx2.SyncByteStream, control: TransferControl, stop: threading.Event) -> None:
        self._inner = inner
        self._control = control
        self._stop = stop

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._inner:
            self._control.take(len(chunk), stop=self._stop)
            yield chunk

    def close(self) -> None:
        self._inner.close()


class _GuardedTransport(httpx2.BaseTransport):
    """Every request huggingface_hub sends (each redirect hop is one) checked, then sent to the
    address that was checked; called in huggingface_hub's worker threads, so the lookup may block.
    Every response body is read through `control` (`stop` set: the caller gave up, a wait ends)."""

    def __init__(self, hosts: HostPolicy, inner: httpx2.BaseTransport, control: TransferControl,
                 stop: threading.Event) -> None:
        self._hosts = hosts
        self._inner = inner
        self._control = control
        self._stop = stop

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self._send(request)
        if isinstance(response.stream, httpx2.SyncByteStream):
            response.stream = _ControlledStream(response.stream, self._control, self._stop)
        return response

    def _send(self, request: httpx2.Request) -> httpx2.Response:
        url = request.url
        try:
            addresses = checked_addresses(self._hosts, url.scheme, url.raw_host, url.port)
        except OSError as exc:
            raise httpx2.ConnectError(f"cannot look up {url.host} ({exc})", request=request) from exc
        for address in addresses[:-1]:
            try:
                return self._inner.handle_request(_pinned(request, address))
            except httpx2.ConnectError:
                continue
        return self._inner.handle_request(_pinned(request, addresses[-1]))

    def close(self) -> None:
        self._inner.close()


def _pinned(request: httpx2.Request, address: IPAddress) -> httpx2.Request:
    """`request` sent to `address`, still asking for (Host) and verifying (SNI) the name."""
    return httpx2.Request(
        request.method,
        request.url.copy_with(host=str(address)),
        headers=request.headers,
        stream=request.stream,
        extensions={**request.extensions, "sni_hostname": request.url.raw_host.decode("ascii")},
    )


def guard_hub(hosts: HostPolicy = PUBLIC_HOSTS, verify: ssl.SSLContext | bool = True,
              control: TransferControl | None = None, stop: threading.Event | None = None) -> None:
    """Make huggingface_hub's shared client one whose every request goes only where `hosts` allows,
    and whose every response is read through `control`."""
    paced = control or TransferControl()
    given_up = stop or threading.Event()

    def client() -> httpx2.Client:
        return httpx2.Client(
            transport=_GuardedTransport(hosts, httpx2.HTTPTransport(verify=verify), paced, given_up),
            event_hooks={"request": [hf_request_event_hook]},  # as huggingface_hub's own client
            follow_redirects=True,  # bounded by max_redirects; every hop passes the transport
            timeout=None,
            trust_env=False,
        )

    hf_constants.HF_HUB_DISABLE_XET = True
    set_client_factory(client)


@dataclass(frozen=True)
class RepoRequest:
    repo_id: str
    revision: str | None
    cache_dir: Path
    endpoint: str | None = None
    allow_patterns: Sequence[str] | None = None

    def call(self, bar: type[_SilentBar] = _SilentBar, **extra: Any) -> Any:
        return snapshot_download(
            self.repo_id,
            revision=self.revision,
            cache_dir=self.cache_dir,
            endpoint=self.endpoint,
            allow_patterns=list(self.allow_patterns) if self.allow_patterns else None,
            tqdm_class=bar,
            **extra,
        )

    @property
    def storage(self) -> Path:
        return self.cache_dir / repo_folder_name(repo_id=self.repo_id, repo_type="model")


async def fetch_repo(
    request: RepoRequest,
    *,
    what: str,
    on_progress: ProgressCallback,
    free_bytes: FreeBytes,
    margin_bytes: int,
    clock: Callable[[], float] = time.monotonic,
    poll_s: float = 0.2,
    cap: SizeCap | None = None,
    hosts: HostPolicy = PUBLIC_HOSTS,
    verify: ssl.SSLContext | bool = True,
    control: TransferControl | None = None,
) -> Path:
    """Download (or find in the cache) the repo's snapshot and return its folder.

    With a `cap`, a repo whose announced files add up to more is refused before any download, and
    one that brings more while downloading is stopped and its new files deleted. Every request
    goes only where `hosts` allows, every byte through `control` (`guard_hub`); one that would pass
    the monthly budget waits before it starts. A cancel deletes what it left unfinished and raises
    `DownloadCancelled`.
    """
    control = control or TransferControl()
    stop = threading.Event()
    guard_hub(hosts, verify, control, stop)
    existed = request.storage.exists()
    with control.transfer():
        try:
            return await _fetch_controlled(request, what, on_progress, free_bytes, margin_bytes, clock, poll_s, cap,
                                           control, existed)
        except asyncio.CancelledError:
            stop.set()  # the node stops: a thread held inside huggingface_hub must not wait on for a release
            raise


async def _fetch_controlled(
    request: RepoRequest, what: str, on_progress: ProgressCallback, free_bytes: FreeBytes, margin_bytes: int,
    clock: Callable[[], float], poll_s: float, cap: SizeCap | None, control: TransferControl, existed: bool,
) -> Path:
    """`fetch_repo` within its transfer: every failure, a cancel included, ends in one last event."""
    meter = ProgressMeter(what, on_progress, clock=clock, control=control)
    try:
        await control.wait_until_free_async(0, lambda: meter.update(0))  # held: not even the file list is asked for
        files = await _plan_or_none(request)
        if files is None:
            return await _cached_snapshot(request, what, on_progress)
        total = sum(f.file_size or 0 for f in files)
        missing = sum(f.file_size or 0 for f in files if f.will_download)
        if cap is not None and total > cap.max_bytes:
            raise ProvisionError(too_large(what, cap.max_bytes, cap.said + "; nothing was downloaded"))
        request.cache_dir.mkdir(parents=True, exist_ok=True)
        ensure_free_space(request.cache_dir, missing + margin_bytes, free_bytes, what)
        meter.start(total - missing, total)
        await control.wait_until_free_async(missing, lambda: meter.update(total - missing))
        snapshot = await _download_capped(request, meter, total - missing, total, poll_s, cap, what, existed)
    except DownloadCancelled:
        await asyncio.to_thread(_discard_partial, request.storage, existed)
        meter.cancelled()
        raise
    except BudgetExceeded as exc:
        failure = ProvisionError(budget_exceeded(what, exc))
        _report_failure(on_progress, what, failure)
        raise failure from None
    except ProvisionError as exc:
        _report_failure(on_progress, what, exc)
        raise
    except Exception as exc:
        failure = ProvisionError(_problem(exc, request))
        _report_failure(on_progress, what, failure)
        raise failure from exc
    meter.finish()
    return snapshot


async def _plan_or_none(request: RepoRequest) -> list[Any] | None:
    """The files a download would fetch, or None when the Hub cannot be reached right now."""
    try:
        return await asyncio.to_thread(request.call, dry_run=True)
    except (DownloadCancelled, BudgetExceeded):
        raise
    except Exception as exc:
        if _problem(exc, request).action == "check_network":
            return None
        raise


async def _cached_snapshot(request: RepoRequest, what: str, on_progress: ProgressCallback) -> Path:
    """Offline: a snapshot already complete in the cache is good enough (huggingface_hub checks that)."""
    snapshot = Path(await asyncio.to_thread(request.call, local_files_only=True))
    on_progress(DownloadProgress(what, 0, None, finished=True))
    return snapshot


def _report_failure(on_progress: ProgressCallback, what: str, failure: ProvisionError) -> None:
    on_progress(DownloadProgress(what, 0, None, error=failure.problem.message))


async def _download_capped(
    request: RepoRequest,
    meter: ProgressMeter,
    already: int,
    total: int,
    poll_s: float,
    cap: SizeCap | None,
    what: str,
    existed: bool,
) -> Path:
    """The download, stopped when it outgrows `cap`: then what it left behind is deleted.

    A repo folder this download created (`existed` False) goes entirely; in one that was there
    before (another revision, maybe in use), only the unfinished `.incomplete` files.
    """
    if cap is None:
        return await _download_watching(request, meter, already, total, poll_s, _SilentBar)
    try:
        return await _download_watching(request, meter, already, total, poll_s, _capped_bar(cap.max_bytes))
    except _TooLarge:
        await asyncio.to_thread(_discard_partial, request.storage, existed)
        raise ProvisionError(too_large(what, cap.max_bytes, cap.said)) from None


def _discard_partial(storage: Path, existed: bool) -> None:
    if not existed:
        shutil.rmtree(storage, ignore_errors=True)
        return
    for unfinished in storage.glob("blobs/*.incomplete"):
        unfinished.unlink(missing_ok=True)


async def _download_watching(
    request: RepoRequest, meter: ProgressMeter, already: int, total: int, poll_s: float, bar: type[_SilentBar]
) -> Path:
    """Run the download in a thread; meanwhile report the bytes that have landed in the repo folder."""
    size_before = await asyncio.to_thread(_size_or_zero, request.storage)
    task = asyncio.ensure_future(asyncio.to_thread(request.call, bar))
    while not task.done():
        await asyncio.wait({task}, timeout=poll_s)
        landed = await asyncio.to_thread(_size_or_zero, request.storage) - size_before
        meter.update(min(already + max(landed, 0), total))
    return Path(task.result())


def _size_or_zero(path: Path) -> int:
    return tree_size(path) if path.exists() else 0


def _problem(exc: BaseException, request: RepoRequest) -> Problem:
    """Map huggingface_hub's failure (or the one it wraps) to what a person should read and do."""
    refused = _host_refused_in(exc)
    if refused is not None:
        return host_refused(f"model {request.repo_id}", refused)
    cause: BaseException | None = exc
    while cause is not None:
        known = _known_problem(cause, request)
        if known is not None:
            return known
        cause = cause.__cause__
    log.warning("downloading %s from Hugging Face failed: %s", request.repo_id, exc)
    return Problem(
        "Model download failed",
        f"Downloading {request.repo_id} from Hugging Face failed ({exc.__class__.__name__}). Check the network "
        "and try again.",
        action="check_network",
    )


def _host_refused_in(exc: BaseException) -> HostRefused | None:
    """The guard's refusal behind `exc`, however huggingface_hub wrapped it."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, HostRefused):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _known_problem(exc: BaseException, request: RepoRequest) -> Problem | None:
    repo = request.repo_id
    if isinstance(exc, RevisionNotFoundError):
        return Problem(
            "Model revision not found", f"{repo} has no revision {request.revision!r} on Hugging Face."
        )
    if isinstance(exc, (GatedRepoError, DisabledRepoError)):
        return Problem(
            "Model not accessible",
            f"{repo} on Hugging Face is gated or disabled; sign in to Hugging Face with an account that has "
            "access (set HF_TOKEN), or ask the network for another model.",
            action="settings",
        )
    if isinstance(exc, RepositoryNotFoundError):
        return Problem("Model not found", f"There is no model {repo} on Hugging Face (or it is private).")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return Problem(
            "Disk full",
            f"The disk holding {request.cache_dir} filled up while downloading {repo}. Free some space.",
            action="free_disk",
        )
    if isinstance(exc, (LocalEntryNotFoundError, httpx2.TransportError)) or (
        isinstance(exc, HfHubHTTPError) and exc.response is not None and exc.response.status_code >= 500
    ):
        return Problem(
            "Cannot reach Hugging Face",
            f"Downloading {repo} failed ({exc.__class__.__name__}). Check the network; the download resumes "
            "where it stopped.",
            action="check_network",
        )
    return None
