"""Fetch an update archive: resumable with HTTP Range, with progress, then checked by sha256.

The partial file survives interruptions (and app restarts), so a dropped connection costs only
what was not yet received. Nothing is trusted until the whole file's hash equals the signed one;
a file that fails that check is deleted, never installed. A download stops, and its partial file
is deleted, once it passes the offer's size, or 1 GiB when the offer gives none; the size is not
signed, so an offer over 1 GiB is refused: a hostile server cannot fill the disk with a body that
would never verify.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import httpx

from worker.events import DownloadProgress
from worker.update.verify import UpdateRefused

log = logging.getLogger(__name__)

ProgressCallback = Callable[[DownloadProgress], None]
MAX_ARCHIVE_BYTES = 1024**3  # the protocol's cap on any update ("Update")
FLUSH_BYTES = 1024 * 1024
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class _Interrupted(Exception):
    """The body ended before its announced length: resume from what arrived."""


class _OverCap(UpdateRefused):
    """The archive is bigger than it may be: never retried, and its partial file is deleted."""


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

    def check_announced(self, total: int | None, what: str) -> None:
        if total is not None and total > self.limit:
            raise _OverCap(
                f"{what} was {self._larger()}: the server announced {_amount(total)}, "
                f"{self._allowed()}; nothing was downloaded"
            )

    def check_received(self, done: int, what: str) -> None:
        if done > self.limit:
            raise _OverCap(
                f"{what} was {self._larger()}: the server sent more than {_amount(self.limit)}, "
                f"{self._allowed()}; the download was stopped and deleted"
            )

    def _larger(self) -> str:
        return "larger than offered" if self.offered else "larger than an update may be"

    def _allowed(self) -> str:
        amount = _amount(self.limit)
        return f"the offer said {amount}" if self.offered else f"the limit is {amount}"


def _amount(n_bytes: int) -> str:
    whole_gib, rest = divmod(n_bytes, 1024**3)
    return f"{whole_gib} GiB" if whole_gib and not rest else f"{n_bytes:,} bytes"


@dataclass(frozen=True)
class DownloadPolicy:
    """How hard to try; delays injectable so tests run in milliseconds."""

    attempts: int = 5
    retry_delay_s: float = 2.0
    progress_interval_s: float = 0.25
    max_bytes: int = MAX_ARCHIVE_BYTES


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
    part = destination.with_name(destination.name + ".part")
    part.parent.mkdir(parents=True, exist_ok=True)
    fetch = _Fetch(client, url, part, what, on_progress, policy, clock)
    try:
        fetch.cap = _Cap.of(size, policy, what)
        await _with_retries(fetch, policy, sleep)
        await _check_hash(part, sha256, what)
    except UpdateRefused as exc:
        on_progress(
            DownloadProgress(
                what, fetch.done_bytes(), fetch.total, finished=True, error=str(exc)
            )
        )
        raise
    os.replace(part, destination)
    on_progress(
        DownloadProgress(what, destination.stat().st_size, fetch.total, finished=True)
    )
    return destination


async def _with_retries(
    fetch: _Fetch, policy: DownloadPolicy, sleep: Callable[[float], Awaitable[None]]
) -> None:
    for attempt in range(1, policy.attempts + 1):
        try:
            await fetch.once()
            return
        except (httpx.TransportError, _Interrupted) as exc:
            if attempt == policy.attempts:
                raise UpdateRefused(
                    f"could not download {fetch.what} after {attempt} attempts ({exc}); "
                    f"{fetch.done_bytes()} bytes are kept to resume next time"
                ) from None
            delay = policy.retry_delay_s * 2 ** (attempt - 1)
            log.info(
                "download of %s interrupted (%s); resuming in %.1f s",
                fetch.what,
                exc,
                delay,
            )
            await sleep(delay)


class _Fetch:
    """One download's state across attempts: where it resumes from and how big it is."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        url: str,
        part: Path,
        what: str,
        on_progress: ProgressCallback,
        policy: DownloadPolicy,
        clock: Callable[[], float],
    ) -> None:
        self.client, self.url, self.part, self.what = client, url, part, what
        self.on_progress, self.policy, self.clock = on_progress, policy, clock
        self.total: int | None = None
        self.cap = _Cap(policy.max_bytes, offered=False)
        self.started = clock()
        self.resumed_from = self.done_bytes()

    def done_bytes(self) -> int:
        return self.part.stat().st_size if self.part.exists() else 0

    async def once(self) -> None:
        offset = self.done_bytes()
        headers = {"Accept-Encoding": "identity"}
        if offset:
            headers["Range"] = f"bytes={offset}-"
        try:
            async with self.client.stream("GET", self.url, headers=headers) as response:
                append = self._accept(response, offset)
                await self._write_body(response, append)
        except _OverCap:
            self.part.unlink(missing_ok=True)  # closed by now; an oversized file is never resumed
            raise
        done = self.done_bytes()
        if self.total is not None and done < self.total:
            raise _Interrupted(f"received {done} of {self.total} bytes")

    def _accept(self, response: httpx.Response, offset: int) -> bool:
        """Check the response and learn the total size; True when it continues the partial file."""
        if response.status_code == 416 and offset:
            self.part.unlink()
            raise _Interrupted("the server refused to resume; starting over")
        if response.status_code >= 500:
            raise _Interrupted(f"the server answered HTTP {response.status_code}")
        if response.status_code not in (200, 206):
            raise UpdateRefused(
                f"downloading {self.what} failed: HTTP {response.status_code} from {self.url}"
            )
        if response.status_code == 206 and offset:
            self.total = _resumed_total(response, offset)
            return True
        length = response.headers.get("content-length")
        self.total = int(length) if length and length.isdigit() else None
        return False

    async def _write_body(self, response: httpx.Response, append: bool) -> None:
        """Append the body to the partial file; disk writes go to a thread, in blocks of FLUSH_BYTES."""
        self.cap.check_announced(self.total, self.what)
        done = self.done_bytes() if append else 0
        out = await asyncio.to_thread(open, self.part, "ab" if append else "wb")
        pending = bytearray()
        last_report = 0.0
        try:
            async for chunk in response.aiter_raw():
                done += len(chunk)
                self.cap.check_received(done, self.what)
                pending += chunk
                if len(pending) >= FLUSH_BYTES:
                    await asyncio.to_thread(out.write, bytes(pending))
                    pending.clear()
                now = self.clock()
                if now - last_report >= self.policy.progress_interval_s:
                    last_report = now
                    self._report(done, now)
        finally:
            await asyncio.to_thread(_finish, out, bytes(pending))

    def _report(self, done: int, now: float) -> None:
        elapsed = now - self.started
        rate = (done - self.resumed_from) / elapsed if elapsed > 0 else None
        eta = (self.total - done) / rate if rate and self.total is not None else None
        self.on_progress(
            DownloadProgress(self.what, done, self.total, rate_bps=rate, eta_s=eta)
        )


def _finish(out: BinaryIO, pending: bytes) -> None:
    """Keep what arrived, even when the connection dropped: the next attempt resumes after it."""
    with out:
        out.write(pending)


def _resumed_total(response: httpx.Response, offset: int) -> int | None:
    match = _CONTENT_RANGE.fullmatch(response.headers.get("content-range", "").strip())
    if match is None or int(match.group(1)) != offset:
        raise _Interrupted(
            "the server's Content-Range does not continue the partial file"
        )
    return None if match.group(3) == "*" else int(match.group(3))


async def _check_hash(part: Path, expected: str, what: str) -> None:
    actual = await asyncio.to_thread(_sha256_of, part)
    if actual != expected:
        part.unlink(missing_ok=True)
        raise UpdateRefused(
            f"{what}: the download's sha256 {actual} is not the signed {expected}; deleted it"
        )


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        for block in iter(lambda: source.read(1024 * 1024), b""):
            digest.update(block)
    return digest.hexdigest()
