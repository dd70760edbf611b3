"""Provisioning's side of the shared downloader (`worker.provision.fetch`): its failures as `Problem`s.

The mechanics (resume, cap, hash, free space, where a download may go) are `worker.provision.fetch`'s;
this module words what a person reads when a model or engine download fails, and what to do
about it. These words also go to the coordinator, so they carry nothing a server sent: no status,
no hash of a body, no error text; the log has the status and the last error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from worker.provision import fetch as download
from worker.provision.fetch import Downloader, FreeBytes
from worker.provision.hosts import HostRefused
from worker.contract.events import Problem
from worker.engines.installing import human_bytes
from worker.provision.errors import ProvisionError
from worker.provision.progress import ProgressCallback, ProgressMeter
from worker.provision.transfer import BudgetExceeded, DownloadCancelled

__all__ = ["Downloader", "FreeBytes", "SizeCap", "budget_exceeded", "ensure_free_space", "fetch", "host_refused",
           "too_large"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SizeCap:
    """The most bytes a download may bring, and where that figure comes from (for the message)."""

    max_bytes: int
    said: str  # "the 500 MiB the network said this model is (plus 10 %) …"


def ensure_free_space(folder: Path, need_bytes: int, free_bytes: FreeBytes, what: str) -> None:
    """Fail before writing anything when `need_bytes` will not fit, saying how much is missing."""
    try:
        download.check_free_space(folder, need_bytes, free_bytes)
    except download.NoSpace as exc:
        raise ProvisionError(_no_space(exc, what)) from None


def host_refused(what: str, exc: HostRefused) -> Problem:
    """What a person reads when a download (or a redirect) would have gone where downloads may not."""
    return Problem(
        "Download address not allowed",
        f"{what}: the download was stopped before it reached the address, because {exc.reason}. Models "
        "and engines are downloaded over https from public hosts only. There is nothing to do on this "
        "computer: the network sees why in its status and can send another address.",
    )


def budget_exceeded(what: str, exc: BudgetExceeded) -> Problem:
    """What a person reads when a download alone is larger than their whole monthly download budget."""
    return Problem(
        "Larger than your monthly download limit",
        f"{what} is {human_bytes(exc.need_bytes)}, more than your monthly download limit of "
        f"{human_bytes(exc.limit_bytes)}, so it can never start. Raise the limit in Settings.",
        action="settings",
    )


def too_large(what: str, max_bytes: int, size_said: str) -> Problem:
    """What a person reads when a download outgrew its cap (and was deleted)."""
    return Problem(
        title="Download larger than expected",
        message=(
            f"{what}: the download is larger than {human_bytes(max_bytes)}, which is more than {size_said}. "
            "It was stopped and deleted."
        ),
    )


async def fetch(
    downloader: Downloader,
    url: str,
    dest: Path,
    *,
    what: str,
    on_progress: ProgressCallback,
    sha256: str,
    max_bytes: int | None = None,
    size_said: str = "it may be",
    clock: Callable[[], float] = time.monotonic,
) -> Path:
    """Download `url` to `dest` (replacing it) with progress events; raises `ProvisionError`, or
    `DownloadCancelled` (not a failure: the last event says "cancelled") when the person cancels.

    `size_said` says where `max_bytes` comes from and what to do about it ("the 500 MiB the
    network said this model is …"), for the message.
    """
    meter = ProgressMeter(what, on_progress, clock=clock, control=downloader.control)
    try:
        await downloader.fetch(url, dest, meter, sha256=sha256, max_bytes=max_bytes)
    except DownloadCancelled:
        meter.cancelled()
        raise
    except (*download.FAILURES, BudgetExceeded) as exc:
        problem = budget_exceeded(what, exc) if isinstance(exc, BudgetExceeded) else _problem(exc, what, url, size_said)
        meter.fail(problem.message)
        raise ProvisionError(problem) from None
    meter.finish()
    return dest


def _problem(exc: download.DownloadFailure, what: str, url: str, size_said: str) -> Problem:
    host = httpx.URL(url).host or "the server"
    if isinstance(exc, download.TooLarge):
        return too_large(what, exc.max_bytes, size_said)
    if isinstance(exc, HostRefused):
        return host_refused(what, exc)
    if isinstance(exc, download.Damaged):
        log.warning("%s: the download's sha256 is %s", what, exc.actual)
        return Problem(
            "Downloaded file is damaged",
            f"{what}: the file's sha256 is not the {exc.expected} it should be. It was deleted and will not be "
            "used; the next attempt downloads it again.",
            action="check_network",
        )
    if isinstance(exc, download.Refused):
        log.warning("%s: %s answered HTTP %d", what, host, exc.status)
        return Problem(
            "Download refused",
            f"{what}: {host} would not send the file. Check that the address is right.",
            action="check_network",
        )
    if isinstance(exc, download.GaveUp):
        return Problem(
            "Download interrupted",
            f"{what}: the connection to {host} kept failing. What was already downloaded is kept and the "
            "download resumes from there next time. Check the network connection.",
            action="check_network",
        )
    return _no_space(exc, what)


def _no_space(exc: download.NoSpace, what: str) -> Problem:
    return Problem(
        "Not enough disk space",
        f"{what} needs {human_bytes(exc.need_bytes)} free in {exc.folder}, but only {human_bytes(exc.free_bytes)} "
        f"is free. Free up {human_bytes(exc.need_bytes - exc.free_bytes)} more on that disk, or choose another "
        "model cache folder in Settings.",
        action="free_disk",
    )
