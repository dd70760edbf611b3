"""One owner per data folder: the core holds an OS file lock on it from start to the last engine stopped.

Two copies of the node on one folder would reap each other's engines (pid files), share a ledger
and fight over one coordinator identity. The lock is `filelock`'s (flock / LockFileEx): the OS
drops it when its process dies, so a crash never leaves the folder locked. A sidecar beside it
names the owner's pid and whether it is still running or already stopping, so that a second
start can say who holds the folder and what to do, instead of failing in the dark. Neither is
opened through a link: the lock file is made (or checked) without following one before filelock
opens it, so a link planted there is refused (`DataFolderUnsafe`) whatever filelock's version does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Literal

import psutil
from filelock import FileLock, Timeout

from worker.system.config import PRIVATE_FILE_MODE, Paths, private_opener, read_private_text, write_private_text

LOCK_NAME = "owner.lock"
OWNER_NAME = "owner.json"

OwnerState = Literal["running", "stopping"]


@dataclass(frozen=True)
class Owner:
    """Who holds a data folder: a pid (None when the sidecar is missing, unreadable or stale)."""

    pid: int | None
    state: OwnerState = "running"


class DataFolderInUse(Exception):
    """Another process owns this data folder; the message says which and what to do."""

    def __init__(self, owner: Owner) -> None:
        self.owner = owner
        super().__init__(in_use_message(owner))


def in_use_message(owner: Owner) -> str:
    who = f" (pid {owner.pid})" if owner.pid is not None else ""
    if owner.state == "stopping":
        return (
            f"GPU Provider{who} is still stopping for this data folder: it is letting its requests finish "
            "and stopping its engines. Start it again once it has quit."
        )
    return (
        f"GPU Provider is already running for this data folder{who}; quit it first, "
        "or use --data-dir for a second node"
    )


class DataFolderLock:
    """The lock on one data folder. Not reentrant across instances: a second instance, even in
    this process, is refused while the first holds it."""

    def __init__(self, paths: Paths) -> None:
        self._lock_path = paths.data_dir / LOCK_NAME
        self._owner_path = paths.data_dir / OWNER_NAME
        self._lock = FileLock(self._lock_path, timeout=0, mode=PRIVATE_FILE_MODE, thread_local=False)

    @property
    def held(self) -> bool:
        return self._lock.is_locked

    def acquire(self) -> None:
        """Own the folder now or raise `DataFolderInUse` naming the owner; never waits."""
        if self.held:
            return
        self._check_lock_file()
        try:
            self._lock.acquire()
        except Timeout:
            raise DataFolderInUse(self._read_owner()) from None
        self._write_owner("running")

    def mark_stopping(self) -> None:
        """Say that this owner is on its way out (draining, stopping engines); no-op unless held."""
        if self.held:
            self._write_owner("stopping")

    def release(self) -> None:
        """Give the folder up (the sidecar first, so it never names a later owner wrongly)."""
        if not self.held:
            return
        self._owner_path.unlink(missing_ok=True)
        self._lock.release()

    def owner(self) -> Owner | None:
        """Who owns the folder now; None when nobody does. A free folder is probed by taking the
        lock for an instant, which a starting node may meet as "in use" by no one it can name."""
        if self.held:
            return Owner(os.getpid(), self._read_owner().state)
        self._check_lock_file()
        try:
            self._lock.acquire()
        except Timeout:
            return self._read_owner()
        self._lock.release()
        return None

    def _check_lock_file(self) -> None:
        """The lock file is a plain file of this user's (made 0600 if missing, its folder 0700, as
        filelock would make them), not a link."""
        self._lock_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.close(private_opener(str(self._lock_path), os.O_RDWR | os.O_CREAT))

    def _write_owner(self, state: OwnerState) -> None:
        write_private_text(self._owner_path, json.dumps({"pid": os.getpid(), "state": state}) + "\n")

    def _read_owner(self) -> Owner:
        """The sidecar's owner, if it is believable: a live pid and a known state."""
        try:
            record = json.loads(read_private_text(self._owner_path))
        except (OSError, ValueError):
            return Owner(None)
        pid = record.get("pid") if isinstance(record, dict) else None
        state = record.get("state") if isinstance(record, dict) else None
        if not isinstance(pid, int) or isinstance(pid, bool) or not psutil.pid_exists(pid):
            return Owner(None)
        return Owner(pid, "stopping" if state == "stopping" else "running")
