"""Fetch an update archive with the shared downloader (`worker.provision.fetch`), under the update's cap.

Nothing is trusted until the whole file's hash equals the signed one. A download stops, and its
partial file is deleted, once it passes the offer's size, or 1 GiB when the offer gives none; the
size is not signed, so an offer over 1 GiB is refused: a hostile server cannot fill the disk with
a body that would never verify. Every failure is an `UpdateRefused` worded for the update status,
carrying nothing a server sent (no status, no hash of a body, no announced size); the download
goes only to public https hosts, each redirect checked before it is followed (`worker.provision.fetch`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from worker.provision import fetch as download
from worker.provision.fetch import SPACE_MARGIN_BYTES, FreeBytes, disk_free
from worker.provision.hosts import HostRefused
from worker.contract.events import DownloadProgress
from worker.provision.progress import ProgressCallback, ProgressMeter
from worker.update.verify import UpdateRefused

MAX_ARCHIVE_BYTES = 1024**3  # the protocol's cap on any update ("Update")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DownloadPolicy:
    """How hard to try and how much to take; collaborators injectable so tests run in milliseconds."""

    attempts: int = 5
    retry_delay_s: float = 2.0
    max_bytes: int = MAX_ARCHIVE_BYTES
    free_bytes: FreeBytes = disk_free
    margin_bytes: int = SPACE_MARGIN_BYTES  # left free beside the archive, for unpacking it


@dataclass(frozen=True)
class _Cap:
    """The most bytes a download may take: the offered size, or the policy's limit without one."""

    limit: int
    offered: bool

    @classmethod
    def of(cls, size: int | None, policy: DownloadPolicy, what: str) -> _Cap:
        if size is None:
            return cls(policy.max_bytes, offered=False)
        if size > policy.max_bytes:
            raise UpdateRefused(
                f"{what} is offered at {_amount(size)}, larger than an update may be "
                f"({_amount(policy.max_bytes)}); nothing was downloaded"
            )
        return cls(size, offered=True)

    def refusal(self, exc: download.TooLarge, what: str) -> UpdateRefused:
        larger = "larger than offered" if self.offered else "larger than an update may be"
        amount = _amount(self.limit)
        allowed = f"the offer said {amount}" if self.offered else f"the limit is {amount}"
        if exc.announced is not None:
            return UpdateRefused(f"{what} was {larger}: the server announced more, {allowed}; nothing was downloaded")
        return UpdateRefused(
            f"{what} was {larger}: the server sent more than {amount}, {allowed}; "
            "the download was stopped and deleted"
        )


def _amount(n_bytes: int) -> str:
    whole_gib, rest = divmod(n_bytes, 1024**3)
    return f"{whole_gib} GiB" if whole_gib and not rest else f"{n_bytes:,} bytes"


async def download_verified(
    client: httpx.AsyncClient,
    url: str,
    destination: Path,
    *,
    sha256: str,
    what: str,
    on_progress: ProgressCallback,
    size: int | None = None,
    policy: DownloadPolicy = DownloadPolicy(),
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Path:
    """Download `url` to `destination` (via `destination.part`) and return it once its hash matches.

    `size` is the offer's (bytes, or None when it gives none); the download stops past it."""
    meter = ProgressMeter(what, on_progress, clock=clock)
    loader = download.Downloader(
        client,
        free_bytes=policy.free_bytes,
        sleep=sleep,
        attempts=policy.attempts,
        retry_delay_s=policy.retry_delay_s,
        margin_bytes=policy.margin_bytes,
    )
    try:
        cap = _Cap.of(size, policy, what)
        try:
            await loader.fetch(url, destination, meter, sha256=sha256, max_bytes=cap.limit)
        except download.FAILURES as exc:
            raise _refusal(exc, cap, what, url) from None
    except UpdateRefused as exc:
        on_progress(DownloadProgress(what, meter.done_bytes, meter.total_bytes, finished=True, error=str(exc)))
        raise
    meter.finish()
    return destination


def _refusal(exc: download.DownloadFailure, cap: _Cap, what: str, url: str) -> UpdateRefused:
    if isinstance(exc, download.TooLarge):
        return cap.refusal(exc, what)
    host = httpx.URL(url).host or "the server"
    if isinstance(exc, HostRefused):
        return UpdateRefused(f"downloading {what} was stopped before it reached the address, because {exc.reason}")
    if isinstance(exc, download.Damaged):
        log.warning("update download: its sha256 is %s", exc.actual)
        return UpdateRefused(f"{what}: the download's sha256 is not the signed {exc.expected}; deleted it")
    if isinstance(exc, download.Refused):
        log.warning("update download: %s answered HTTP %d", host, exc.status)
        return UpdateRefused(f"downloading {what} failed: {host} would not send it")
    if isinstance(exc, download.GaveUp):
        return UpdateRefused(
            f"could not download {what} from {host} after {exc.attempts} attempts; what arrived is kept to "
            "resume next time"
        )
    return UpdateRefused(
        f"not enough disk space for {what}: it needs {_amount(exc.need_bytes)} free in {exc.folder}, "
        f"but only {_amount(exc.free_bytes)} is free; free some space on that disk"
    )
