"""One file over https: streamed into a `.part`, resumed with Range, verified, then renamed.

Nothing is ever served from a `.part`: the final name only appears (atomically) once every byte
arrived and, when a sha256 was given, the hash matched. A cut connection keeps the `.part`, so
the next attempt (now or after a restart) asks only for the missing bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from worker.events import Problem
from worker.provision.errors import ProvisionError, human_bytes
from worker.provision.progress import ProgressCallback, ProgressMeter

FreeBytes = Callable[[Path], int]
CHUNK_BYTES = 1024 * 1024
SPACE_MARGIN_BYTES = 256 * 1024 * 1024
_CONTENT_RANGE = re.compile(r"bytes (?:(\d+)-\d+|\*)/(\d+|\*)")


def disk_free(folder: Path) -> int:
    """Free bytes on the disk that holds `folder` (or its nearest existing parent)."""
    probe = folder
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def ensure_free_space(folder: Path, need_bytes: int, free_bytes: FreeBytes, what: str) -> None:
    """Fail before writing anything when `need_bytes` will not fit, saying how much is missing."""
    free = free_bytes(folder)
    if free >= need_bytes:
        return
    raise ProvisionError(
        Problem(
            title="Not enough disk space",
            message=(
                f"{what} needs {human_bytes(need_bytes)} free in {folder}, but only {human_bytes(free)} is free. "
                f"Free up {human_bytes(need_bytes - free)} more on that disk, or choose another model "
                "cache folder in Settings."
            ),
            action="free_disk",
        )
    )


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while block := source.read(CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


async def sha256_of(path: Path) -> str:
    """The file's sha256, computed in a thread: a large model takes seconds to hash."""
    return await asyncio.to_thread(_hash_file, path)


async def verify_sha256(path: Path, expected: str, what: str) -> None:
    actual = await sha256_of(path)
    if actual != expected.lower():
        raise ProvisionError(
            Problem(
                title="Downloaded file is damaged",
                message=(
                    f"{what}: the file's sha256 is {actual}, not the {expected} it should be. "
                    "It was deleted and will not be used; the next attempt downloads it again."
                ),
                action="check_network",
            )
        )


@dataclass(frozen=True)
class SizeCap:
    """The most bytes a download may bring, and where that figure comes from (for the message)."""

    max_bytes: int
    said: str  # "the 500 MiB the assignment gave (plus 10 %); ask the network …"


class _Retry(Exception):
    """This attempt ended early but the next one may succeed (the `.part` says where to resume)."""


class _TooLarge(Exception):
    """The body (announced or received) is larger than the download may be; nothing of it is kept."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"more than {max_bytes} bytes")
        self.max_bytes = max_bytes


def too_large(what: str, max_bytes: int, size_said: str) -> Problem:
    """What a person reads when a download outgrew its cap (and was deleted)."""
    return Problem(
        title="Download larger than expected",
        message=(
            f"{what}: the download is larger than {human_bytes(max_bytes)}, which is more than {size_said}. "
            "It was stopped and deleted."
        ),
    )


class Downloader:
    """Resumable https downloads into a given file; collaborators injectable for tests."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        *,
        free_bytes: FreeBytes = disk_free,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        attempts: int = 4,
        retry_delay_s: float = 1.0,
        margin_bytes: int = SPACE_MARGIN_BYTES,
    ) -> None:
        self.client = client
        self.free_bytes = free_bytes
        self.clock = clock
        self.margin_bytes = margin_bytes
        self._sleep = sleep
        self._attempts = attempts
        self._retry_delay_s = retry_delay_s

    async def fetch(
        self,
        url: str,
        dest: Path,
        *,
        what: str,
        on_progress: ProgressCallback,
        sha256: str | None = None,
        max_bytes: int | None = None,
        size_said: str = "it may be",
    ) -> Path:
        """Download `url` to `dest` (replacing it) and return `dest`; raises `ProvisionError`.

        A body that grows past `max_bytes` is cut off and its `.part` deleted, whether or not the
        server announced a length; `size_said` says where the limit comes from and what to do about
        it ("the 500 MiB the assignment gave; ask the network …"), for the message.
        """
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(dest.name + ".part")
        meter = ProgressMeter(what, on_progress, clock=self.clock)
        try:
            try:
                await self._transfer_with_retries(url, part, meter, what, max_bytes)
            except _TooLarge as exc:
                part.unlink(missing_ok=True)
                raise ProvisionError(too_large(what, exc.max_bytes, size_said)) from None
            if sha256:
                await self._verify_or_discard(part, sha256, what)
        except ProvisionError as exc:
            meter.fail(exc.problem.message)
            raise
        os.replace(part, dest)
        meter.finish()
        return dest

    async def _verify_or_discard(self, part: Path, sha256: str, what: str) -> None:
        try:
            await verify_sha256(part, sha256, what)
        except ProvisionError:
            part.unlink(missing_ok=True)
            raise

    async def _transfer_with_retries(
        self, url: str, part: Path, meter: ProgressMeter, what: str, max_bytes: int | None
    ) -> None:
        last_error: Exception | None = None
        for attempt in range(self._attempts):
            try:
                await self._transfer(url, part, meter, what, max_bytes)
                return
            except (httpx.TransportError, _Retry) as exc:
                last_error = exc
            if attempt + 1 < self._attempts:
                await self._sleep(self._retry_delay_s * 2**attempt)
        kept = part.stat().st_size if part.exists() else 0
        raise ProvisionError(
            Problem(
                title="Download interrupted",
                message=(
                    f"{what}: the connection to {_host(url)} kept failing ({last_error or 'cut short'}). "
                    f"The {human_bytes(kept)} already downloaded are kept and the download resumes from there "
                    "next time. Check the network connection."
                ),
                action="check_network",
            )
        )

    async def _transfer(
        self, url: str, part: Path, meter: ProgressMeter, what: str, max_bytes: int | None
    ) -> None:
        offset = part.stat().st_size if part.exists() else 0
        if max_bytes is not None and offset > max_bytes:
            raise _TooLarge(max_bytes)
        headers = {"Accept-Encoding": "identity"}
        if offset:
            headers["Range"] = f"bytes={offset}-"
        async with self.client.stream("GET", url, headers=headers) as response:
            start = _resume_offset(response, offset, part, url, what)
            if start is None:
                return
            total = _total_bytes(response, start)
            if max_bytes is not None and total is not None and total > max_bytes:
                raise _TooLarge(max_bytes)
            expected = total if total is not None else max_bytes
            if expected is not None:
                ensure_free_space(part.parent, expected - start + self.margin_bytes, self.free_bytes, what)
            meter.start(start, total)
            done = await self._write_body(response, part, start, meter, max_bytes)
        if total is not None and done != total:
            raise _Retry(f"got {done} of {total} bytes")

    async def _write_body(
        self, response: httpx.Response, part: Path, offset: int, meter: ProgressMeter, max_bytes: int | None
    ) -> int:
        """Append the body to the `.part`; bytes received before a cut are kept for the resume.

        A chunk that would take the file past `max_bytes` is never written: the caller deletes
        the `.part`, so a server cannot fill the disk by sending more than it should.
        """
        done = offset
        pending = bytearray()
        with part.open("ab" if offset else "wb") as out:
            try:
                async for chunk in response.aiter_raw():
                    if max_bytes is not None and done + len(chunk) > max_bytes:
                        raise _TooLarge(max_bytes)
                    pending += chunk
                    done += len(chunk)
                    if len(pending) >= CHUNK_BYTES:
                        await asyncio.to_thread(out.write, bytes(pending))
                        pending.clear()
                    meter.update(done)
            finally:
                out.write(pending)
        return done


def _resume_offset(response: httpx.Response, offset: int, part: Path, url: str, what: str) -> int | None:
    """Where the body starts: `offset` (206), 0 (200, Range ignored), `None` when already complete.

    A server that ignores Range sends the whole file, so the `.part` is started over; a range the
    server cannot satisfy means the `.part` is complete (sizes match) or unusable (discarded).
    """
    status = response.status_code
    if status == 206:
        start, _ = _content_range(response)
        if start == offset:
            return offset
        part.unlink(missing_ok=True)
        raise _Retry(f"server answered a different range (from byte {start}, asked {offset})")
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
    raise ProvisionError(
        Problem(
            title="Download refused",
            message=f"{what}: {_host(url)} answered HTTP {status} for {url}. Check that the address is right.",
            action="check_network",
        )
    )


def _content_range(response: httpx.Response) -> tuple[int | None, int | None]:
    match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", "").strip())
    if not match:
        return None, None
    start, total = match.groups()
    return (int(start) if start else None), (int(total) if total and total != "*" else None)


def _total_bytes(response: httpx.Response, offset: int) -> int | None:
    if response.status_code == 206:
        _, total = _content_range(response)
        return total
    length = response.headers.get("Content-Length")
    return int(length) if length and length.isdigit() else None


def _host(url: str) -> str:
    return httpx.URL(url).host or url
