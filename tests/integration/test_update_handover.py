"""A whole self-update through the real desktop app, offscreen, against the reference coordinator.

The "installed" app is `app.main` in a subprocess; the update is a real signed archive served over
HTTPS whose `gpu-provider` starts `app.main` again as the next version. Both trust a release key
made for the test, set the way a build sets it: `RELEASE_PUBLIC_KEY_B64`, before the app starts.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import os
import signal
import sys
import tarfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from packaging.version import Version

from tests.integration.test_data_folder_owner import alive, model_folder
from tests.integration.test_node import hardware_file, vllm_assign
from tests.support.engines import REPO
from tests.support.https_server import HttpsServer
from worker import __version__
from worker.serve import process as procs
from worker.contract import protocol
from worker.system.config import Paths, Settings, save_settings
from worker.system.datalock import DataFolderLock
from worker.link.local import ReferenceCoordinator
from worker.update import InstallRoot, install_root

pytestmark = pytest.mark.integration

TOKEN = "update-test-token"
STEP_S = 60.0  # an app start (Qt, the core, hello) on a loaded 2-core machine; normally 2-3 s
_release = Version(__version__).release + (0, 0)
NEW = f"{_release[0]}.{_release[1]}.{_release[2] + 1}"

BUILD = '''#!{python}
"""GPU Provider {version}, started as a release build starts: the real app, the test's release key
and the test's name for its file server."""
import sys
sys.path.insert(0, {repo!r})
import worker
worker.__version__ = {version!r}
import worker.update.verify
worker.update.verify.RELEASE_PUBLIC_KEY_B64 = {key!r}
import ipaddress, worker.provision.hosts  # the test's file server stands for a public host
worker.provision.hosts.PublicHosts.addresses_for = lambda self, host, port: [ipaddress.IPv4Address("127.0.0.1")]
{body}
'''
APP = "from app.main import main\nsys.exit(main(sys.argv[1:]))"
CRASH = "sys.exit(3)"  # a broken build: exits before it could say hello


@dataclass
class Rig:
    root: Path
    server: HttpsServer
    key: Ed25519PrivateKey
    ca_file: Path

    @property
    def data_dir(self) -> Path:
        return self.root / "node"

    @property
    def paths(self) -> Paths:
        return Paths.under(self.data_dir)

    @property
    def install(self) -> InstallRoot:
        return InstallRoot(install_root(self.paths))

    def engine_pid(self) -> int:
        record = procs.read_pid_file(procs.pid_file(self.paths.run_dir, "e0"))
        assert record is not None, "no engine runs"
        return record.pid

    def build(self, version: str, body: str) -> bytes:
        public = self.key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return BUILD.format(python=sys.executable, repo=str(REPO), version=version,
                            key=base64.b64encode(public).decode(), body=body).encode()

    def offer(self, version: str, body: str) -> protocol.Update:
        """A signed update whose archive holds the build at its top, as a release's does."""
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w:gz") as tar:
            script = self.build(version, body)
            entry = tarfile.TarInfo("gpu-provider")
            entry.size, entry.mode = len(script), 0o755
            tar.addfile(entry, io.BytesIO(script))
        data = archive.getvalue()
        name = f"gpu-provider-{version}-linux-x86_64.tar.gz"
        self.server.add(name, data)
        digest = hashlib.sha256(data).hexdigest()
        signature = self.key.sign(protocol.signed_update_payload(version, digest))
        return protocol.Update(version=version, url=self.server.url(name), sha256=digest,
                               signature=base64.b64encode(signature).decode(), size=len(data))

    def log_text(self) -> str:
        """Both versions' log: they share the data folder's log file."""
        log = self.paths.log_dir / "gpu-provider.log"
        return log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""

    def log_tail(self) -> str:
        return "".join(self.log_text().splitlines(True)[-40:])


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    with HttpsServer() as server:
        ca_file = tmp_path / "ca.pem"
        server.ca.cert_pem.write_to_path(str(ca_file))
        yield Rig(tmp_path, server, Ed25519PrivateKey.generate(), ca_file)


@asynccontextmanager
async def coordinator_for(rig: Rig) -> AsyncIterator[ReferenceCoordinator]:
    """The reference coordinator, assigning a model the vLLM stand-in serves to every connection."""
    async with ReferenceCoordinator(token=TOKEN, assign=vllm_assign(model_folder(rig.root))) as coordinator:
        yield coordinator


@asynccontextmanager
async def installed_app(rig: Rig, coordinator: ReferenceCoordinator,
                        vllm_standin: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """The running version, started like the packaged build; on exit, it and any version it
    started are stopped."""
    save_settings(rig.paths.ensure(), Settings(setup_complete=True))  # a person who finished the first-run flow
    launcher = rig.root / "installed" / "gpu-provider"
    launcher.parent.mkdir()
    launcher.write_bytes(rig.build(__version__, APP))
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "GPU_PROVIDER_TOKEN": TOKEN,
           "SSL_CERT_FILE": str(rig.ca_file)}
    env.pop("GPU_PROVIDER_DATA_DIR", None)
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(launcher), "--data-dir", str(rig.data_dir), "--coordinator", coordinator.url,
        "--hardware", str(hardware_file(rig.root, "rtx4090.json")), "--engine-bin", f"vllm={vllm_standin}",
        "--minimized",
        env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL)
    try:
        yield process
    finally:
        owner = DataFolderLock(rig.paths).owner()  # the new version, when it took over
        for pid in {process.pid} | ({owner.pid} if owner is not None and owner.pid is not None else set()):
            await stop(pid)
        await process.wait()


async def stop(pid: int) -> None:
    """SIGTERM (the app quits as from its tray), then SIGKILL if it lingers."""
    try:
        target = psutil.Process(pid)
        target.send_signal(signal.SIGTERM)
        await asyncio.to_thread(target.wait, 30)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        target.kill()


async def hello(rig: Rig, coordinator: ReferenceCoordinator, count: int) -> protocol.Hello:
    """The `count`-th hello the coordinator saw; on a timeout, the app's log says why."""
    try:
        return await coordinator.wait_for_connections(count, timeout=STEP_S)
    except TimeoutError:
        raise AssertionError(f"no hello #{count}; the app logged:\n{rig.log_tail()}") from None


async def serving_after(rig: Rig, coordinator: ReferenceCoordinator, since: protocol.Hello) -> int:
    """The engine's pid once the connection that began with `since` reported `ready`."""
    after = next(i for i, message in enumerate(coordinator.received) if message is since)
    try:
        await coordinator.wait_for(lambda m: isinstance(m, protocol.Status) and m.state == "ready",
                                   after=after, timeout=STEP_S)
    except TimeoutError:
        raise AssertionError(f"not ready after hello; the app logged:\n{rig.log_tail()}") from None
    return rig.engine_pid()


async def test_an_update_hands_over_to_the_new_version(rig: Rig, vllm_standin: Path) -> None:
    async with coordinator_for(rig) as coordinator, installed_app(rig, coordinator, vllm_standin) as old:
        first = await hello(rig, coordinator, 1)
        assert first.app_version == __version__
        old_engine = await serving_after(rig, coordinator, first)
        await coordinator.send(rig.offer(NEW, APP))
        second = await hello(rig, coordinator, 2)
        assert second.app_version == NEW
        assert not alive(old_engine)
        assert await serving_after(rig, coordinator, second) != old_engine
        assert "left behind" not in rig.log_text()  # the new version found no engine of the old one to reap
        assert await asyncio.wait_for(old.wait(), STEP_S) == 0, rig.log_tail()  # the old version is gone
        owner = DataFolderLock(rig.paths).owner()
        assert owner is not None and owner.pid is not None and owner.pid != old.pid
        assert psutil.pid_exists(owner.pid)
        assert rig.install.current() == NEW and rig.install.rejected() == frozenset()
        assert len(coordinator.hellos) == 2


async def test_a_new_version_that_crashes_is_rolled_back_and_the_old_one_serves_on(rig: Rig,
                                                                                  vllm_standin: Path) -> None:
    async with coordinator_for(rig) as coordinator, installed_app(rig, coordinator, vllm_standin) as old:
        first = await hello(rig, coordinator, 1)
        assert first.app_version == __version__
        old_engine = await serving_after(rig, coordinator, first)
        await coordinator.send(rig.offer(NEW, CRASH))
        second = await hello(rig, coordinator, 2)
        assert second.app_version == __version__  # online again
        assert await serving_after(rig, coordinator, second) != old_engine  # its engine started again
        assert not alive(old_engine) and old.returncode is None
        assert rig.install.current() is None and rig.install.rejected() == {NEW}
        owner = DataFolderLock(rig.paths).owner()
        assert owner is not None and owner.pid == old.pid and owner.state == "running"
