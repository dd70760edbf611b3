"""Self-update from offer to running new version: verify, download, stage, apply, roll back.

Offers come from the coordinator's `update` message and from a periodic check of the update feed.
An offer is verified before anything is fetched; the archive is checked by hash before it is
unpacked. Feed and archive come only from public https hosts, every redirect checked before it is
followed (`worker.provision.hosts`). Applying waits until no request is in flight (or the user
clicks "install now"), stops the engine children and waits until they are gone (an engine that
outlives its app holds the GPU and the port, and the new version would fail to start), switches
`current`, starts the new version, and switches back if that version does not prove within
`hello_timeout_s` that it reached `hello`. Before it starts the new version, the node gives up its
data folder (the new version must own it to start at all) and takes it back after a rollback. A
version that crashed, or hung before its core started, is never tried again; one that started but
could not reach the coordinator (the network may be down) is rolled back and may be offered again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from worker import __version__
from worker.contract import protocol
from worker.system import children
from worker.system.autostart import LAUNCHER_ENV, packaged_executable
from worker.system.config import Paths, Settings
from worker.provision.hosts import HostRefused, download_client
from worker.contract.events import DownloadProgress
from worker.update.download import DownloadPolicy, download_verified
from worker.update.install import (
    InstallRoot,
    hello_marker,
    hello_reached_by,
    install_root,
    started_by,
    unpack,
)
from worker.update.verify import (
    UpdateOffer,
    UpdateRefused,
    is_newer,
    offer_from_feed,
    platform_key,
    release_public_key,
    verify_offer,
)

log = logging.getLogger(__name__)

Phase = Literal[
    "idle", "downloading", "ready", "installing", "installed", "rolled_back", "refused"
]
FEED_INTERVAL_S = 6 * 3600.0
HELLO_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class UpdateStatus:
    """What the app shows about updates: the phase, the version concerned, and why."""

    phase: Phase = "idle"
    version: str | None = None
    message: str | None = None


@dataclass(frozen=True)
class NodeHooks:
    """What the updater needs from the node.

    `stop_serving` stops the engine children and returns only once they are gone; it also closes
    the coordinator link and gives up the data folder, so that the new version can own it.
    `resume_serving` undoes that after a rollback. `exit_app` ends this process once the new
    version runs.
    """

    in_flight: Callable[[], int]
    stop_serving: Callable[[], Awaitable[None]]
    resume_serving: Callable[[], Awaitable[None]]
    exit_app: Callable[[], None]


@dataclass(frozen=True)
class UpdaterOptions:
    """The updater's collaborators and timings; every one injectable for tests."""

    public_key: Ed25519PublicKey = field(default_factory=release_public_key)
    running_version: str = __version__
    platform_name: str = field(default_factory=platform_key)
    client_factory: Callable[[], httpx.AsyncClient] = lambda: download_client(timeout_s=60)  # public https only
    launch_args: Sequence[str] = field(default_factory=lambda: tuple(sys.argv[1:]))
    hello_timeout_s: float = HELLO_TIMEOUT_S
    feed_interval_s: float = FEED_INTERVAL_S
    idle_poll_s: float = 5.0
    marker_poll_s: float = 0.2
    download: DownloadPolicy = field(default_factory=DownloadPolicy)
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    clock: Callable[[], float] = time.monotonic


@dataclass(frozen=True)
class _Failure:
    """Why a new version was rolled back, and whether it may ever be tried again."""

    reason: str
    blacklist: bool


class Updater:
    """One app's updates. Call `offer` for coordinator messages; run `run_feed_checks` as a task."""

    def __init__(
        self,
        paths: Paths,
        settings: Settings,
        hooks: NodeHooks,
        *,
        options: UpdaterOptions | None = None,
        install: InstallRoot | None = None,
        on_progress: Callable[[DownloadProgress], None] = lambda progress: None,
        on_status: Callable[[UpdateStatus], None] = lambda status: None,
    ) -> None:
        self._paths = paths
        self._settings = settings
        self._hooks = hooks
        self._options = options or UpdaterOptions()
        self._install = install or InstallRoot(install_root(paths))
        self._on_progress = on_progress
        self._on_status = on_status
        self._status = UpdateStatus()
        self._staged: UpdateOffer | None = None
        self._lock = asyncio.Lock()

    def status(self) -> UpdateStatus:
        return self._status

    @property
    def ready_version(self) -> str | None:
        """The version downloaded, verified and unpacked, waiting to be installed (on a restart)."""
        return self._staged.version if self._staged is not None else None

    def apply_settings(self, settings: Settings) -> None:
        self._settings = settings

    async def offer(self, update: protocol.Update) -> bool:
        """Verify, download and stage an offer, then install it if the settings allow; True if staged.

        Installing waits for a moment with no request in flight, so run this as a task.
        """
        async with self._lock:
            try:
                verified = self._verify(update)
                if verified is None:
                    return False
                await self._stage(verified, update.size)
            except (UpdateRefused, httpx.HTTPError, OSError) as exc:
                log.warning("update refused: %s", exc)
                self._set(UpdateStatus("refused", update.version, str(exc)))
                return False
        if self._settings.auto_install_updates:
            await self._install_when_idle()
        return True

    async def check_feed(self) -> bool:
        """Fetch the feed once and offer its entry for our channel and platform; True if staged."""
        url = self._settings.update_feed_url
        if not url:
            return False
        try:
            update = await self._fetch_feed(url)
        except (UpdateRefused, HostRefused, httpx.HTTPError) as exc:
            log.warning("update feed check failed: %s", exc)
            return False
        if update is None:
            log.info(
                "the update feed has no %s build on channel %s",
                self._options.platform_name,
                self._settings.update_channel,
            )
            return False
        return await self.offer(update)

    async def run_feed_checks(self) -> None:
        """Check the feed now and then every `feed_interval_s`, until cancelled."""
        while True:
            await self.check_feed()
            await self._options.sleep(self._options.feed_interval_s)

    async def install_now(self) -> bool:
        """The user's click: install the staged version even while requests are in flight."""
        async with self._lock:
            if self._staged is None:
                return False
            return await self._apply(self._staged)

    def _verify(self, update: protocol.Update) -> UpdateOffer | None:
        verified = verify_offer(
            update,
            public_key=self._options.public_key,
            running_version=self._options.running_version,
        )
        if verified.version in self._install.rejected():
            raise UpdateRefused(
                f"update {verified.version} failed to start before and is not retried"
            )
        if self._staged is not None and not is_newer(
            verified.version, self._staged.version
        ):
            return None
        return verified

    async def _fetch_feed(self, url: str) -> protocol.Update | None:
        async with self._options.client_factory() as client:
            response = await client.get(url, follow_redirects=True)  # each hop checked by the client
            response.raise_for_status()
        return offer_from_feed(
            response.content,
            feed_url=url,
            channel=self._settings.update_channel,
            platform_name=self._options.platform_name,
        )

    async def _stage(self, verified: UpdateOffer, size: int | None) -> None:
        self._set(UpdateStatus("downloading", verified.version))
        archive = self._install.staging_dir / f"gpu-provider-{verified.version}.archive"
        self._discard_other_downloads(archive)
        async with self._options.client_factory() as client:
            await download_verified(
                client,
                verified.url,
                archive,
                sha256=verified.sha256,
                what=f"update {verified.version}",
                on_progress=self._on_progress,
                size=size,  # the offer's: the download stops past it
                policy=self._options.download,
                sleep=self._options.sleep,
                clock=self._options.clock,
            )
        try:
            await asyncio.to_thread(unpack, archive, self._install, verified.version)
        finally:
            archive.unlink(missing_ok=True)
        self._staged = verified
        log.info("update %s downloaded, verified and unpacked", verified.version)
        self._set(UpdateStatus("ready", verified.version, "ready to install"))

    def _discard_other_downloads(self, keep: Path) -> None:
        """Partial downloads of other versions are dead weight once a newer offer arrives."""
        if not self._install.staging_dir.is_dir():
            return
        for leftover in self._install.staging_dir.glob("gpu-provider-*.archive*"):
            if not leftover.name.startswith(keep.name):
                leftover.unlink(missing_ok=True)

    async def _install_when_idle(self) -> None:
        while self._hooks.in_flight() > 0:
            await self._options.sleep(self._options.idle_poll_s)
        async with self._lock:
            if self._staged is not None:
                await self._apply(self._staged)

    async def _apply(self, staged: UpdateOffer) -> bool:
        """Stop serving, switch, start the new version; roll back if it never reaches `hello`."""
        self._set(UpdateStatus("installing", staged.version))
        try:
            await self._hooks.stop_serving()
            self._install.switch_to(staged.version)
        except Exception as exc:  # an engine that would not stop, or a switch that failed: keep serving
            log.exception("update %s not installed", staged.version)
            self._set(UpdateStatus("refused", staged.version, str(exc)))
            await self._hooks.resume_serving()
            return False
        failure = await self._start_and_confirm(staged.version)
        self._staged = None
        if failure is None:
            removed = self._install.prune()
            log.info(
                "update %s is running; removed old versions %s",
                staged.version,
                removed or "none",
            )
            self._set(UpdateStatus("installed", staged.version))
            self._hooks.exit_app()
            return True
        self._install.roll_back()
        if failure.blacklist:
            self._install.reject(staged.version)
        log.error("update %s rolled back: %s", staged.version, failure.reason)
        self._set(UpdateStatus("rolled_back", staged.version, failure.reason))
        await self._hooks.resume_serving()
        return False

    async def _start_and_confirm(self, version: str) -> _Failure | None:
        """Start the new version; None once it wrote the hello marker, else why it failed."""
        marker = hello_marker(self._paths)
        marker.unlink(missing_ok=True)
        executable = self._install.executable(version)
        try:
            process = await children.start(
                [str(executable), *self._options.launch_args],
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
                env=_launcher_environment(),
                **_detached(),
            )
        except OSError as exc:
            return _Failure(f"could not start {executable}: {exc}", blacklist=True)
        failure = await self._await_hello(process, version)
        if failure is not None:
            await _stop(process)
        return failure

    async def _await_hello(
        self, process: asyncio.subprocess.Process, version: str
    ) -> _Failure | None:
        deadline = self._options.clock() + self._options.hello_timeout_s
        while self._options.clock() < deadline:
            if hello_reached_by(self._paths) == version:
                return None
            if process.returncode is not None:
                return _Failure(
                    f"version {version} exited with code {process.returncode} before reaching hello",
                    blacklist=True,
                )
            await self._options.sleep(self._options.marker_poll_s)
        if hello_reached_by(self._paths) == version:
            return None
        waited = f"{self._options.hello_timeout_s:g} s"
        if started_by(self._paths) == version and process.returncode is None:
            return _Failure(
                f"version {version} started but could not reach the coordinator within {waited} "
                "(is the network down?); it will be tried again",
                blacklist=False,
            )
        return _Failure(f"version {version} did not reach hello within {waited}", blacklist=True)

    def _set(self, status: UpdateStatus) -> None:
        self._status = status
        self._on_status(status)


def _launcher_environment() -> dict[str, str] | None:
    """A packaged build tells the version it starts which executable is the installed one, so
    that start-at-login written by that version names it, not versions/<v> (pruned later)."""
    if not getattr(sys, "frozen", False):
        return None
    return {**os.environ, LAUNCHER_ENV: packaged_executable()}


def _detached() -> dict[str, Any]:
    """The new version must outlive this process: its own session (POSIX) or process group."""
    if sys.platform == "win32":
        return {"flags": children.CREATE_NEW_PROCESS_GROUP | children.DETACHED_PROCESS}
    return {"start_new_session": True}


async def _stop(process: asyncio.subprocess.Process, grace_s: float = 5.0) -> None:
    """Stop a failed new version and whatever it started in its session, politely then by force."""
    if process.returncode is not None:
        return
    _signal_group(process, signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), grace_s)
    except TimeoutError:
        _signal_group(process, getattr(signal, "SIGKILL", signal.SIGTERM))
        await process.wait()


def _signal_group(process: asyncio.subprocess.Process, signum: int) -> None:
    try:
        if os.name == "nt":
            process.terminate()
        else:
            os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass
