"""One owner per data folder: the real OS lock, held by this process or by another one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.engines import REPO
from worker.system.config import Paths
from worker.system.datalock import OWNER_NAME, DataFolderInUse, DataFolderLock, Owner

HOLDER = textwrap.dedent("""
    import sys, time
    from worker.system.config import Paths
    from worker.system.datalock import DataFolderLock
    lock = DataFolderLock(Paths.under(sys.argv[1]))
    lock.acquire()
    if sys.argv[2] == "stopping":
        lock.mark_stopping()
    print("held", flush=True)
    time.sleep(60)
""")


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return Paths.under(tmp_path).ensure()


def holder(root: Path, state: str = "running") -> subprocess.Popen[str]:
    """Another process that owns the folder until killed."""
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(root), state], cwd=REPO, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None and child.stdout.readline() == "held\n"
    return child


def test_the_owner_is_named_in_the_sidecar_and_a_second_lock_is_refused(paths: Paths) -> None:
    first = DataFolderLock(paths)
    first.acquire()
    try:
        record = json.loads((paths.data_dir / OWNER_NAME).read_text(encoding="utf-8"))
        assert record == {"pid": os.getpid(), "state": "running"}
        with pytest.raises(DataFolderInUse) as refused:
            DataFolderLock(paths).acquire()
        assert refused.value.owner == Owner(os.getpid(), "running")
        assert str(refused.value) == (
            f"GPU Provider is already running for this data folder (pid {os.getpid()}); quit it first, "
            "or use --data-dir for a second node")
    finally:
        first.release()


def test_an_owner_that_is_stopping_says_so(paths: Paths) -> None:
    first = DataFolderLock(paths)
    first.acquire()
    first.mark_stopping()
    try:
        with pytest.raises(DataFolderInUse, match=rf"GPU Provider \(pid {os.getpid()}\) is still stopping"):
            DataFolderLock(paths).acquire()
        assert DataFolderLock(paths).owner() == Owner(os.getpid(), "stopping")
    finally:
        first.release()


def test_released_the_folder_is_free_and_the_sidecar_gone(paths: Paths) -> None:
    first = DataFolderLock(paths)
    first.acquire()
    first.release()
    assert not (paths.data_dir / OWNER_NAME).exists()
    second = DataFolderLock(paths)
    assert second.owner() is None
    second.acquire()  # the probe above did not keep the lock
    assert second.held
    second.release()


def test_releasing_a_lock_not_held_leaves_the_owner_alone(paths: Paths) -> None:
    owner, bystander = DataFolderLock(paths), DataFolderLock(paths)
    owner.acquire()
    try:
        bystander.release()
        bystander.mark_stopping()
        assert DataFolderLock(paths).owner() == Owner(os.getpid(), "running")
    finally:
        owner.release()


@pytest.mark.parametrize("state", ["running", "stopping"])
def test_a_folder_owned_by_another_process_is_refused_with_its_pid(tmp_path: Path, paths: Paths,
                                                                   state: str) -> None:
    child = holder(tmp_path, state)
    try:
        with pytest.raises(DataFolderInUse) as refused:
            DataFolderLock(paths).acquire()
        assert refused.value.owner.pid == child.pid and refused.value.owner.state == state
        assert f"(pid {child.pid})" in str(refused.value)
    finally:
        child.kill()
        child.wait()


def test_a_killed_owner_leaves_the_folder_free(tmp_path: Path, paths: Paths) -> None:
    child = holder(tmp_path)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert (paths.data_dir / OWNER_NAME).exists()  # a crash leaves the sidecar, not the lock
    lock = DataFolderLock(paths)
    lock.acquire()
    try:
        assert json.loads((paths.data_dir / OWNER_NAME).read_text(encoding="utf-8"))["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_stale_or_unreadable_sidecar_names_no_pid(paths: Paths) -> None:
    first = DataFolderLock(paths)
    first.acquire()
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        (paths.data_dir / OWNER_NAME).write_text(json.dumps({"pid": dead.pid, "state": "running"}))
        assert DataFolderLock(paths).owner() == Owner(None, "running")
        (paths.data_dir / OWNER_NAME).write_text("{oops")
        with pytest.raises(DataFolderInUse) as refused:
            DataFolderLock(paths).acquire()
        assert str(refused.value).startswith("GPU Provider is already running for this data folder; quit it first")
    finally:
        first.release()
