"""The updater end to end: a real HTTPS server, real archives, a real new process per version."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tests.support.https_server import SERVED_HERE, HttpsServer
from tests.worker.update import builds
from worker.contract import protocol
from worker.system.config import Paths, Settings
from worker.provision.hosts import download_client
from worker.contract.events import DownloadProgress
from worker.update import (
    DownloadPolicy,
    InstallRoot,
    NodeHooks,
    Updater,
    UpdaterOptions,
    UpdateStatus,
)
from worker.update.install import hello_reached_by

RELEASE_KEY = Ed25519PrivateKey.generate()


@dataclass
class FakeNode:
    """The node's side of the hooks, recording what the updater asked of it and when."""

    install: InstallRoot
    in_flight_counts: list[int] = field(default_factory=lambda: [0])
    calls: list[str] = field(default_factory=list)
    current_when_stopped: list[str | None] = field(default_factory=list)

    def in_flight(self) -> int:
        return (
            self.in_flight_counts.pop(0)
            if len(self.in_flight_counts) > 1
            else self.in_flight_counts[0]
        )

    async def stop_serving(self) -> None:
        self.calls.append("stop_serving")
        self.current_when_stopped.append(self.install.current())

    async def resume_serving(self) -> None:
        self.calls.append("resume_serving")

    def exit_app(self) -> None:
        self.calls.append("exit_app")

    def hooks(self) -> NodeHooks:
        return NodeHooks(
            self.in_flight, self.stop_serving, self.resume_serving, self.exit_app
        )


@dataclass
class Rig:
    server: HttpsServer
    paths: Paths
    install: InstallRoot
    node: FakeNode
    progress: list[DownloadProgress]
    statuses: list[UpdateStatus]

    def updater(
        self,
        settings: Settings | None = None,
        hooks: NodeHooks | None = None,
        **options: object,
    ) -> Updater:
        context = self.server.client_context()
        defaults: dict[str, object] = {
            "public_key": RELEASE_KEY.public_key(),
            "running_version": "0.1.0",
            "platform_name": "linux-x86_64",
            "client_factory": lambda: download_client(SERVED_HERE, verify=context),
            "launch_args": ("--data-dir", str(self.paths.data_dir.parent)),
            "hello_timeout_s": 30.0,
            "idle_poll_s": 0.01,
            "marker_poll_s": 0.02,
            "download": DownloadPolicy(attempts=3, retry_delay_s=0.0, margin_bytes=0),
        }
        return Updater(
            self.paths,
            settings or Settings(),
            hooks or self.node.hooks(),
            options=UpdaterOptions(**{**defaults, **options}),  # type: ignore[arg-type]
            install=self.install,
            on_progress=self.progress.append,
            on_status=self.statuses.append,
        )

    def publish(
        self,
        version: str,
        behaviour: str = "good",
        *,
        key: Ed25519PrivateKey = RELEASE_KEY,
        sha256: str | None = None,
        size_delta: int | None = None,
    ) -> protocol.Update:
        """Serves a build and offers it; with `size_delta` the offer names its size plus that."""
        archive = builds.tarball(version, behaviour)
        name = f"gpu-provider-{version}-linux-x86_64.tar.gz"
        self.server.add(name, archive)
        digest = sha256 or builds.sha256(archive)
        signature = base64.b64encode(
            key.sign(protocol.signed_update_payload(version, digest))
        ).decode()
        return protocol.Update(
            version=version,
            url=self.server.url(name),
            sha256=digest,
            signature=signature,
            size=None if size_delta is None else len(archive) + size_delta,
        )

    def downloads(self) -> int:
        return sum(1 for r in self.server.requests if r.path.endswith(".tar.gz"))


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    paths = Paths.under(tmp_path).ensure()
    install = InstallRoot(paths.data_dir / "app")
    with HttpsServer() as server:
        yield Rig(server, paths, install, FakeNode(install), [], [])


async def test_a_good_update_is_applied_end_to_end(rig: Rig) -> None:
    update = rig.publish("0.2.0")
    assert await rig.updater().offer(update)
    assert rig.install.current() == "0.2.0"
    assert hello_reached_by(rig.paths) == "0.2.0"
    assert rig.node.calls == ["stop_serving", "exit_app"]
    assert rig.node.current_when_stopped == [None]
    assert [s.phase for s in rig.statuses] == [
        "downloading",
        "ready",
        "installing",
        "installed",
    ]
    assert rig.progress[-1].finished and rig.progress[-1].what == "update 0.2.0"


async def test_a_packaged_build_tells_the_new_version_its_launcher(
    rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new version writes start-at-login; it must name the installed build, not versions/X."""
    update = rig.publish("0.2.0", "launcher")
    packaged = tmp_path / "opt" / "gpu-provider"
    packaged.parent.mkdir()
    packaged.write_text("")
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "executable", str(packaged))
    monkeypatch.delenv("GPU_PROVIDER_LAUNCHER", raising=False)
    assert await rig.updater().offer(update)
    assert (tmp_path / "launcher.txt").read_text() == str(packaged)


async def test_an_update_over_an_earlier_one_keeps_it_as_previous(rig: Rig) -> None:
    assert await rig.updater().offer(rig.publish("0.2.0"))
    assert await rig.updater(running_version="0.2.0").offer(rig.publish("0.3.0"))
    assert (rig.install.current(), rig.install.previous()) == ("0.3.0", "0.2.0")
    assert rig.install.installed() == ["0.2.0", "0.3.0"]


async def test_a_bad_signature_is_refused_before_downloading(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    update = rig.publish("0.2.0", key=Ed25519PrivateKey.generate())
    with caplog.at_level(logging.WARNING):
        assert not await rig.updater().offer(update)
    assert rig.downloads() == 0
    assert rig.install.current() is None and rig.node.calls == []
    assert "signature does not match" in caplog.text
    assert rig.statuses[-1].phase == "refused"


async def test_an_unsigned_update_is_refused(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    update = rig.publish("0.2.0").model_copy(update={"signature": ""})
    with caplog.at_level(logging.WARNING):
        assert not await rig.updater().offer(update)
    assert "unsigned" in caplog.text and rig.downloads() == 0


async def test_a_wrong_hash_is_downloaded_then_discarded(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    update = rig.publish("0.2.0", sha256="1" * 64)
    with caplog.at_level(logging.WARNING):
        assert not await rig.updater().offer(update)
    assert rig.downloads() == 1
    assert rig.install.installed() == [] and rig.install.current() is None
    assert list(rig.install.staging_dir.iterdir()) == []
    assert "is not the signed" in caplog.text and rig.node.calls == []


async def test_an_archive_larger_than_offered_is_refused_and_deleted(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    update = rig.publish("0.2.0", size_delta=-1)
    with caplog.at_level(logging.WARNING):
        assert not await rig.updater().offer(update)
    assert rig.statuses[-1].phase == "refused"
    assert "update 0.2.0 was larger than offered" in (rig.statuses[-1].message or "")
    assert rig.downloads() == 1  # refused outright, not retried
    assert list(rig.install.staging_dir.iterdir()) == []
    assert rig.install.installed() == [] and rig.node.calls == []


async def test_an_archive_of_exactly_the_offered_size_is_applied(rig: Rig) -> None:
    assert await rig.updater().offer(rig.publish("0.2.0", size_delta=0))
    assert rig.install.current() == "0.2.0"


@pytest.mark.parametrize("version", ["0.0.9", "0.1.0"])
async def test_a_downgrade_or_the_same_version_is_refused(
    rig: Rig, version: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert not await rig.updater().offer(rig.publish(version))
    assert "not newer than the running version 0.1.0" in caplog.text
    assert rig.downloads() == 0 and rig.install.current() is None


async def test_a_truncated_download_is_resumed(rig: Rig) -> None:
    update = rig.publish("0.2.0")
    rig.server.cut_after(update.url.rsplit("/", 1)[1], 100)
    assert await rig.updater().offer(update)
    gets = [r for r in rig.server.requests if r.path.endswith(".tar.gz")]
    assert [r.range is not None for r in gets] == [False, True]
    assert rig.install.current() == "0.2.0"


async def test_a_download_cut_every_time_is_refused_cleanly(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    update = rig.publish("0.2.0")
    rig.server.cut_after(update.url.rsplit("/", 1)[1], 100, times=10)
    with caplog.at_level(logging.WARNING):
        assert not await rig.updater().offer(update)
    assert "after 3 attempts" in caplog.text
    assert rig.install.installed() == [] and rig.node.calls == []


async def test_a_new_version_that_crashes_is_rolled_back(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    assert await rig.updater().offer(rig.publish("0.2.0"))
    with caplog.at_level(logging.ERROR):
        assert await rig.updater(running_version="0.2.0").offer(
            rig.publish("0.3.0", "crash")
        )
    assert (rig.install.current(), rig.install.previous()) == ("0.2.0", None)
    assert rig.install.rejected() == {"0.3.0"}
    assert rig.node.calls[-2:] == ["stop_serving", "resume_serving"]
    assert "exited with code 3 before reaching hello" in caplog.text
    assert rig.statuses[-1].phase == "rolled_back"


async def test_a_new_version_that_never_reaches_hello_is_stopped_and_rolled_back(
    rig: Rig,
) -> None:
    updater = rig.updater(hello_timeout_s=3.0)
    assert await updater.offer(rig.publish("0.2.0", "hang"))
    assert rig.install.current() is None
    assert rig.node.calls == ["stop_serving", "resume_serving"]
    assert updater.status().message == "version 0.2.0 did not reach hello within 3 s"
    assert rig.install.rejected() == {"0.2.0"}  # it hung before its core started: never again
    hung = int((rig.paths.data_dir.parent / "hang.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(hung, 0)


OFFLINE = (
    "from worker.system.config import Paths\n"
    "from worker.update import mark_started\n"
    "mark_started(Paths.under(data_dir), VERSION)\n"
    "time.sleep(60)"
)


async def test_a_new_version_that_started_but_could_not_connect_is_rolled_back_not_rejected(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The contract: a version that cannot reach hello because the network is down is rolled back
    but not blacklisted; the same offer is installed again later."""
    monkeypatch.setitem(builds.BEHAVIOURS, "offline", OFFLINE)
    updater = rig.updater(hello_timeout_s=2.0)
    assert await updater.offer(rig.publish("0.2.0", "offline"))
    assert rig.install.current() is None and rig.install.rejected() == frozenset()
    assert rig.node.calls == ["stop_serving", "resume_serving"]
    assert updater.status() == UpdateStatus(
        "rolled_back",
        "0.2.0",
        "version 0.2.0 started but could not reach the coordinator within 2 s "
        "(is the network down?); it will be tried again",
    )
    assert await rig.updater().offer(rig.publish("0.2.0"))
    assert rig.install.current() == "0.2.0"


async def test_an_engine_that_will_not_stop_leaves_the_install_untouched(
    rig: Rig,
) -> None:
    async def stuck() -> None:
        rig.node.calls.append("stop_serving")
        raise TimeoutError("engine 0 did not exit within 30 s")

    updater = rig.updater(
        hooks=NodeHooks(
            rig.node.in_flight, stuck, rig.node.resume_serving, rig.node.exit_app
        )
    )
    assert await updater.offer(rig.publish("0.2.0"))
    assert rig.install.current() is None
    assert rig.node.calls == ["stop_serving", "resume_serving"]
    assert updater.status() == UpdateStatus(
        "refused", "0.2.0", "engine 0 did not exit within 30 s"
    )


async def test_a_rolled_back_version_is_not_offered_again(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    update = rig.publish("0.2.0", "crash")
    await rig.updater().offer(update)
    downloads = rig.downloads()
    with caplog.at_level(logging.WARNING):
        assert not await rig.updater().offer(update)
    assert "failed to start before" in caplog.text and rig.downloads() == downloads


async def test_installing_waits_until_no_request_is_in_flight(rig: Rig) -> None:
    rig.node.in_flight_counts = [2, 1, 1, 0]
    assert await rig.updater().offer(rig.publish("0.2.0"))
    assert rig.node.in_flight_counts == [0]
    assert rig.install.current() == "0.2.0"


async def test_without_auto_install_the_update_waits_for_the_users_click(
    rig: Rig,
) -> None:
    updater = rig.updater(Settings(auto_install_updates=False))
    rig.node.in_flight_counts = [3]
    assert updater.ready_version is None
    assert await updater.offer(rig.publish("0.2.0"))
    assert updater.status().phase == "ready" and rig.install.current() is None
    assert updater.ready_version == "0.2.0"  # the app offers "Restart to update"
    assert await updater.install_now()
    assert rig.install.current() == "0.2.0" and rig.node.calls == [
        "stop_serving",
        "exit_app",
    ]
    assert updater.ready_version is None
    assert not await updater.install_now()


def feed_document(update: protocol.Update) -> bytes:
    build = {
        "url": update.url.rsplit("/", 1)[1],
        "sha256": update.sha256,
        "signature": update.signature,
    }
    return json.dumps(
        {
            "channels": {
                "stable": {"version": update.version, "builds": {"linux-x86_64": build}}
            }
        }
    ).encode()


async def test_the_feed_is_checked_and_its_update_applied(rig: Rig) -> None:
    rig.server.add(
        "feed.json",
        feed_document(rig.publish("0.2.0")),
        content_type="application/json",
    )
    updater = rig.updater(Settings(update_feed_url=rig.server.url("feed.json")))
    assert await updater.check_feed()
    assert rig.install.current() == "0.2.0"


async def test_the_feed_is_checked_periodically(rig: Rig) -> None:
    rig.server.add("feed.json", b'{"channels": {}}')
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise asyncio.CancelledError
        await asyncio.sleep(0)

    updater = rig.updater(
        Settings(update_feed_url=rig.server.url("feed.json")),
        sleep=sleep,
        feed_interval_s=3600.0,
    )
    with pytest.raises(asyncio.CancelledError):
        await updater.run_feed_checks()
    assert sleeps == [3600.0] * 3
    assert len(rig.server.requests_for("feed.json")) == 3


async def test_an_unreachable_or_broken_feed_is_logged_not_raised(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.server.add("feed.json", b"{oops")
    with caplog.at_level(logging.WARNING):
        assert not await rig.updater(
            Settings(update_feed_url=rig.server.url("feed.json"))
        ).check_feed()
        assert not await rig.updater(
            Settings(update_feed_url=rig.server.url("missing.json"))
        ).check_feed()
    assert "not valid JSON" in caplog.text and "404" in caplog.text


async def test_an_offer_no_newer_than_the_staged_one_is_ignored(rig: Rig) -> None:
    updater = rig.updater(Settings(auto_install_updates=False))
    assert await updater.offer(rig.publish("0.3.0"))
    downloads = rig.downloads()
    assert not await updater.offer(rig.publish("0.2.0"))
    assert not await updater.offer(rig.publish("0.3.0"))
    assert rig.downloads() == downloads and updater.status().version == "0.3.0"
