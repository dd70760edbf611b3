"""One file over https: streamed into a `.part`, resumed with Range, capped, hashed, then renamed.

The one downloader and file hasher: model and engine provisioning and the self-update use it, each
with its own cap and its own words for a `DownloadFailure` (a `Problem`, an update status). Nothing
is ever served from a `.part`: the final name appears (atomically) only once every byte arrived
and the sha256 matched. A cut connection keeps the `.part`, so the next attempt (now or after a
restart) asks only for the missing bytes. A body over the cap — announced or received — is never
written past it, and its `.part` is deleted: a server cannot fill the disk.

Redirects are followed here, one hop at a time (at most `MAX_REDIRECTS`), each `Location` checked
before anything connects to it (`worker.provision.hosts`: https, a public host name; the client from
`download_client` then checks the addresses). A failure carries facts for the caller's own words,
and none of them is something a server sent that the caller should repeat: no body, no hash of one.

Every chunk passes the node's `TransferControl` (`worker.provision.transfer`): while it holds
downloads nothing is read (the connection stays open; if the server closes it meanwhile, the
download resumes from the `.part` once released, and that attempt is not a failure), the speed is
paced to the limit, and the bytes count against the monthly budget. The announced size is checked
against the budget before the first byte is read: one that would pass it closes the connection and
waits for the next month. A cancel raises `DownloadCancelled` and removes the `.part`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

from worker.system.config import private_opener, replace_file
from worker.provision.hosts import HostRefused, url_refusal
from worker.provision.transfer import DownloadCancelled, TransferControl

log = logging.getLogger(__name__)

FreeBytes = Callable[[Path], int]
CHUNK_BYTES = 1024 * 1024
SPACE_MARGIN_BYTES = 256 * 1024 * 1024
_CONTENT_RANGE = re.compile(r"bytes (?:(\d+)-\d+|\*)/(\d+|\*)")
MAX_REDIRECTS = 5
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
TOO_MANY_REDIRECTS = f"it was redirected more than {MAX_REDIRECTS} times"
NO_LOCATION = "it, or a redirect, gives no usable address"


class Meter(Protocol):
    """Where the byte counts go (`worker.provision.progress.ProgressMeter` makes events of them)."""

    def start(self, done_bytes: int, total_bytes: int | None) -> None: ...

    def update(self, done_bytes: int) -> None: ...


class DownloadFailed(Exception):
    """No verified file; the facts of why, for the caller to put in its own words.

    The subclasses are dataclasses with `eq=False`: an exception compares and hashes by identity.
    """

    def __str__(self) -> str:
        return repr(self)  # the dataclass's, with its fields


@dataclass(eq=False)
class Refused(DownloadFailed):
    """The server answered a status no retry will change (404, 403, …): for the log and the retry
    decision, never for a message that leaves this machine."""

    status: int


@dataclass(eq=False)
class GaveUp(DownloadFailed):
    """Every attempt was cut short; `kept_bytes` stay in the `.part` for the next try."""

    attempts: int
    reason: str
    kept_bytes: int


@dataclass(eq=False)
class TooLarge(DownloadFailed):
    """More than `max_bytes`: `announced` by the server before any byte was read, or (None) sent or
    already in the `.part`. The `.part` is deleted: a download that outgrew its cap is never resumed."""

    max_bytes: int
    announced: int | None


@dataclass(eq=False)
class Damaged(DownloadFailed):
    """The file's sha256 is `actual`, not `expected`. `actual` is for this machine's log only (left out
    of the repr): a hash of what a server sent, or of a local file, never goes into a refusal."""

    actual: str = field(repr=False)
    expected: str


@dataclass(eq=False)
class NoSpace(DownloadFailed):
    """The disk holding `folder` has `free_bytes`, fewer than the `need_bytes` the file needs."""

    folder: Path
    need_bytes: int
    free_bytes: int


DownloadFailure = Refused | GaveUp | TooLarge | Damaged | NoSpace | HostRefused
FAILURES = (Refused, GaveUp, TooLarge, Damaged, NoSpace, HostRefused)  # `except FAILURES as exc` types exc as one


class _Retry(Exception):
    """This attempt ended early but the next one may succeed (the `.part` says where to resume)."""


class _NotYet(Exception):
    """The announced bytes still to come would pass this month's budget (or a hold came): wait, then ask again."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(f"{nbytes} bytes must wait")
        self.nbytes = nbytes


def disk_free(folder: Path) -> int:
    """Free bytes on the disk that holds `folder` (or its nearest existing parent)."""
    probe = folder
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def check_free_space(folder: Path, need_bytes: int, free_bytes: FreeBytes) -> None:
    """`NoSpace` before anything is written when `need_bytes` will not fit."""
    free = free_bytes(folder)
    if free < need_bytes:
        raise NoSpace(folder, need_bytes, free)


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while block := source.read(CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


async def sha256_of(path: Path) -> str:
    """The file's sha256, computed in a thread: a large model takes seconds to hash."""
    return await asyncio.to_thread(_hash_file, path)


async def check_sha256(path: Path, expected: str) -> None:
    """`Damaged` unless the file's sha256 is `expected` (hex, either case); the file is left as is."""
    actual = await sha256_of(path)
    if actual != expected.lower():
        raise Damaged(actual, expected)


class Downloader:
    """Resumable https downloads into a given file; collaborators injectable for tests.

    `client` should come from `download_client` (its transport checks every address); this class
    checks every URL's form itself, so a redirect off https or to an IP literal never connects.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        *,
        free_bytes: FreeBytes = disk_free,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        attempts: int = 4,
        retry_delay_s: float = 1.0,
        margin_bytes: int = SPACE_MARGIN_BYTES,
        control: TransferControl | None = None,
    ) -> None:
        self.client = client
        self.control = control or TransferControl()  # none given: nothing holds, paces or counts
        self._free_bytes = free_bytes
        self._sleep = sleep
        self._attempts = attempts
        self._retry_delay_s = retry_delay_s
        self._margin_bytes = margin_bytes

    async def fetch(self, url: str, dest: Path, meter: Meter, *, sha256: str, max_bytes: int | None) -> Path:
        """Download `url` to `dest` (replacing it) and return `dest`; raises one of `FAILURES`,
        `DownloadCancelled` or `transfer.BudgetExceeded`.

        A body that would pass `max_bytes` stops there, whether or not the server announced a
        length; one announced over it is refused before its first byte is read.
        """
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(dest.name + ".part")
        with self.control.transfer():
            try:
                await self._transfer_with_retries(url, part, meter, max_bytes)
                self.control.check_cancelled()
                await check_sha256(part, sha256)
                self.control.check_cancelled()
            except (TooLarge, Damaged, DownloadCancelled):
                part.unlink(missing_ok=True)
                raise
        replace_file(part, dest)
        return dest

    async def _transfer_with_retries(self, url: str, part: Path, meter: Meter, max_bytes: int | None) -> None:
        """Attempts until one completes; an attempt cut while the control held it is not counted."""
        reason, failures = "cut short", 0
        while failures < self._attempts:
            waits = self.control.waits
            try:
                await self.control.wait_until_free_async(0, lambda: meter.update(_size(part)))
                await self._transfer(url, part, meter, max_bytes)
                return
            except _NotYet as over:
                await self.control.wait_until_free_async(over.nbytes, lambda: meter.update(_size(part)))
                continue
            except (httpx.TransportError, _Retry) as exc:
                reason = str(exc) or type(exc).__name__
            if self.control.waits != waits:
                log.info("download from %s was cut while it waited (%s); resuming", _host(url), reason)
                continue
            failures += 1
            if failures < self._attempts:
                delay = self._retry_delay_s * 2 ** (failures - 1)
                log.info("download from %s interrupted (%s); resuming in %.1f s", _host(url), reason, delay)
                await self._sleep(delay)
        log.warning("download from %s failed %d times, the last: %s", _host(url), self._attempts, reason)
        raise GaveUp(self._attempts, reason, _size(part))

    async def _transfer(self, url: str, part: Path, meter: Meter, max_bytes: int | None) -> None:
        offset = _size(part)
        if max_bytes is not None and offset > max_bytes:
            raise TooLarge(max_bytes, None)
        headers = {"Accept-Encoding": "identity"}
        if offset:
            headers["Range"] = f"bytes={offset}-"
        async with self._followed(url, headers) as response:
            start = _resume_offset(response, offset, part)
            if start is None:  # the `.part` is the whole file already
                meter.start(offset, offset)
                return
            total = _total_bytes(response)
            if max_bytes is not None and total is not None and total > max_bytes:
                raise TooLarge(max_bytes, total)
            expected = total if total is not None else max_bytes
            if expected is not None:
                check_free_space(part.parent, expected - start + self._margin_bytes, self._free_bytes)
            if total is not None and not self.control.free_for(total - start):
                raise _NotYet(total - start)
            meter.start(start, total)
            done = await _write_body(response, part, start, meter, max_bytes, self.control)
        if total is not None and done != total:
            raise _Retry(f"got {done} of {total} bytes")

    @asynccontextmanager
    async def _followed(self, url: str, headers: dict[str, str]) -> AsyncIterator[httpx.Response]:
        """The response at the end of `url`'s redirects; each hop's URL checked before it is asked."""
        target = _joined(httpx.URL(), url)
        for _ in range(MAX_REDIRECTS + 1):
            refusal = url_refusal(target.scheme, target.raw_host)
            if refusal is not None:
                raise HostRefused(refusal)
            async with self.client.stream("GET", target, headers=headers, follow_redirects=False) as response:
                if response.status_code not in _REDIRECTS:
                    yield response
                    return
                target = _location(response, target)
        raise HostRefused(TOO_MANY_REDIRECTS)


def _location(response: httpx.Response, base: httpx.URL) -> httpx.URL:
    """Where a redirect points (relative to the URL that answered it); its body is never read."""
    target = _joined(base, response.headers.get("Location", ""))
    log.info("download from %s redirected to %s", base.host, target.host)
    return target


def _joined(base: httpx.URL, reference: str) -> httpx.URL:
    """`reference` read against `base`; `HostRefused` when that names no host."""
    try:
        target = base.join(reference) if reference.strip() else httpx.URL()
    except (httpx.InvalidURL, UnicodeError, ValueError):
        raise HostRefused(NO_LOCATION) from None
    if not target.raw_host:
        raise HostRefused(NO_LOCATION)
    return target


async def _write_body(
    response: httpx.Response, part: Path, offset: int, meter: Meter, max_bytes: int | None, control: TransferControl
) -> int:
    """Append the body to the `.part`; bytes received before a cut (or a cancel) are kept for the resume.

    A chunk that would take the file past `max_bytes` is never written (the caller deletes the
    `.part`). Each chunk passes `control` (held, paced, counted) before the next is read. Disk
    writes go to a thread, a block of CHUNK_BYTES at a time.
    """
    done = offset
    pending = bytearray()
    with open(part, "ab" if offset else "wb", opener=private_opener) as out:  # never through a planted link
        try:
            async for chunk in response.aiter_raw():
                if max_bytes is not None and done + len(chunk) > max_bytes:
                    raise TooLarge(max_bytes, None)
                pending += chunk  # kept even if the wait below ends in a quit or a cancel
                done += len(chunk)
                await control.take_async(len(chunk), lambda: meter.update(done))
                if len(pending) >= CHUNK_BYTES:
                    await asyncio.to_thread(out.write, bytes(pending))
                    pending.clear()
                meter.update(done)
        finally:
            out.write(pending)
    return done


def _resume_offset(response: httpx.Response, offset: int, part: Path) -> int | None:
    """Where the body starts: `offset` (206), 0 (200, Range ignored), `None` when already complete.

    A server that ignores Range sends the whole file, so the `.part` is started over; a 206 that
    does not continue the `.part`, or a range the server cannot satisfy for a `.part` that is not
    the whole file, discards it. Only 408, 429 and 5xx are worth retrying; any other status is final.
    """
    status = response.status_code
    if status == 206:
        start, _ = _content_range(response)
        if start == offset:
            return offset
        part.unlink(missing_ok=True)
        raise _Retry(f"the server answered a different range (from byte {start}, asked {offset})")
    if status == 200:
        return 0
    if status == 416 and offset:
        _, total = _content_range(response)
        if total == offset:
            return None
        part.unlink(missing_ok=True)
        raise _Retry("the partial download no longer fits the file on the server")
    if status in (408, 429) or status >= 500:
        raise _Retry(f"HTTP {status}")
    raise Refused(status)


def _content_range(response: httpx.Response) -> tuple[int | None, int | None]:
    match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", "").strip())
    if not match:
        return None, None
    start, total = match.groups()
    return (int(start) if start else None), (int(total) if total and total != "*" else None)


def _total_bytes(response: httpx.Response) -> int | None:
    if response.status_code == 206:
        return _content_range(response)[1]
    length = response.headers.get("Content-Length")
    return int(length) if length and length.isdigit() else None


def _size(part: Path) -> int:
    return part.stat().st_size if part.exists() else 0


def _host(url: str) -> str:
    return httpx.URL(url).host or url
