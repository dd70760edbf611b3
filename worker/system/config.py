"""Where things live, what the user chose (Settings) and what the app writes (State).

Settings and State are kept apart, as Maestral does: a person edits settings (through the app
or the file), the app alone writes state. Both are small JSON files written atomically; a
damaged file is moved aside with a clear log line rather than crashing the app or losing the
other file.

The data folder is this user's alone, and checked to be so before anything in it is used: each
folder owned by this user and writable by no one else (its parents by this user or the system
only), else `DataFolderUnsafe`. Every file in it is opened without following a link (O_NOFOLLOW,
and an lstat where Windows has no such flag) and narrowed through its open descriptor, never by
path: a link planted in the folder never makes the app write, read or chmod what it points to.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import stat
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

import platformdirs

log = logging.getLogger(__name__)

APP_NAME = "gpu-provider"
SETTINGS_VERSION = 1
DEFAULT_COORDINATOR = "local"
PRIVATE_DIR_MODE = 0o700  # the app's folders: this user only
PRIVATE_FILE_MODE = 0o600  # logs, ledger, state, pid and status files
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # 0 on Windows: an lstat stands in for it
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO planted at a file's path never blocks the open
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
MAX_SMALL_FILE_BYTES = 1 << 20  # settings, state, status, owner and key files are a few kB
# Windows refuses to replace a file another program has open (an antivirus scan, the indexer,
# `gpu-provider status` reading it) with ERROR_ACCESS_DENIED, SHARING_VIOLATION or LOCK_VIOLATION;
# such a hold lasts milliseconds, so the replace is tried again: ten tries over about a second.
REPLACE_WAITS_S = (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.13, 0.16, 0.2)
_SHARING_WINERRORS = frozenset({5, 32, 33})
_Record = TypeVar("_Record", "Settings", "State")


@dataclass(frozen=True)
class Paths:
    """Every folder the app uses. `--data-dir DIR` puts all of them under DIR."""

    config_dir: Path
    data_dir: Path
    cache_dir: Path
    log_dir: Path
    run_dir: Path

    @classmethod
    def default(cls) -> Paths:
        dirs = platformdirs.PlatformDirs(APP_NAME, appauthor=False)
        return cls(
            config_dir=Path(dirs.user_config_dir),
            data_dir=Path(dirs.user_data_dir),
            cache_dir=Path(dirs.user_cache_dir),
            log_dir=Path(dirs.user_log_dir),
            run_dir=Path(dirs.user_data_dir) / "run",  # XDG_RUNTIME_DIR is often unset (servers, CI)
        )

    @classmethod
    def under(cls, root: str | os.PathLike[str]) -> Paths:
        base = Path(root).expanduser().resolve()
        return cls(base / "config", base / "data", base / "cache", base / "logs", base / "run")

    @classmethod
    def resolve(cls, data_dir: str | os.PathLike[str] | None) -> Paths:
        if data_dir:
            return cls.under(data_dir)
        env = os.environ.get("GPU_PROVIDER_DATA_DIR")
        return cls.under(env) if env else cls.default()

    def ensure(self) -> Paths:
        """Every folder exists and only this user can open it (0700), including ones an older
        version made readable to all: logs, ledger and engine sockets live in them. A folder (or
        a parent of one) that someone else owns or may write to raises `DataFolderUnsafe`."""
        for folder in (self.config_dir, self.data_dir, self.cache_dir, self.log_dir, self.run_dir):
            private_dir(folder)
            _check_parents(folder)
        return self

    @property
    def settings_file(self) -> Path:
        return self.config_dir / "settings.json"

    @property
    def state_file(self) -> Path:
        return self.data_dir / "state.json"

    @property
    def models_dir(self) -> Path:
        return self.cache_dir / "models"

    @property
    def engines_dir(self) -> Path:
        return self.data_dir / "engines"

    @property
    def ledger_file(self) -> Path:
        return self.data_dir / "ledger.sqlite3"

    @property
    def status_file(self) -> Path:
        """The running agent's latest snapshot, read by `gpu-provider status`."""
        return self.run_dir / "status.json"

    @property
    def local_endpoint_file(self) -> Path:
        """Local mode's endpoint: its key (kept across runs) and its address (this run's)."""
        return self.data_dir / "local-endpoint.json"


@dataclass(frozen=True)
class Settings:
    """What the user chose. Every field has a default; unknown keys in the file are kept aside."""

    version: int = SETTINGS_VERSION
    coordinator_url: str = DEFAULT_COORDINATOR
    electricity_price_per_kwh: float = 0.0
    currency: str = "USD"
    auto_pause_for_games: bool = True
    auto_resume_after_s: float = 120.0
    keep_awake_while_serving: bool = True  # the computer does not sleep by itself while an engine serves
    autopause_ignored: tuple[str, ...] = ()  # process names that never pause serving (a game's launcher, a tool)
    serve_hours: tuple[int, int] | None = None  # (start hour, end hour), local time; None = always
    start_at_login: bool = False
    gpus_to_lend: tuple[int, ...] | None = None  # None = every GPU
    model_cache_dir: str | None = None
    model_cache_limit_gib: float = 200.0
    allow_remote_code: bool = False
    gpu_memory_utilization: float = 0.90
    memory_reserve_mib: int = 512
    update_channel: str = "stable"
    update_feed_url: str | None = None
    auto_install_updates: bool = True
    setup_complete: bool = False  # the first-run flow was finished (or the settings predate it)
    # The lender's limits (issue "what a person controls"): None / () = no limit.
    memory_share_pct: tuple[tuple[int, int], ...] = ()  # (GPU index, % of its memory an engine may use: 10-100)
    max_requests: int | None = None  # requests served at once (1-256)
    temperature_limit_c: int | None = None  # hottest a GPU may run (50-95 °C): fewer requests, then a pause
    pause_on_battery: bool = True
    stop_when_unprofitable: bool = True  # pause while electricity costs more than serving earns
    download_limit_mib_s: float | None = None  # bandwidth a download may use (0.1-10,000 MiB/s)
    monthly_download_gib: float | None = None  # downloads per calendar month (1-100,000 GiB)
    notify_idle_hours: float | None = 6.0  # tell the person once after this long online and earning nothing
    notify_back_online: bool = True  # tell the person once when the node is back after being offline

    def validated(self) -> Settings:
        problems = []
        if not 0.1 <= self.gpu_memory_utilization <= 0.99:
            problems.append("gpu_memory_utilization must be between 0.1 and 0.99")
        if self.electricity_price_per_kwh < 0:
            problems.append("electricity_price_per_kwh cannot be negative")
        if self.model_cache_limit_gib <= 0:
            problems.append("model_cache_limit_gib must be positive")
        if self.serve_hours is not None and not all(0 <= h <= 24 for h in self.serve_hours):
            problems.append("serve_hours must be two hours between 0 and 24")
        problems += self._limit_problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _limit_problems(self) -> list[str]:
        problems = []
        if len(self.memory_share_pct) > 64 or not all(
                len(pair) == 2 and 0 <= pair[0] < 64 and 10 <= pair[1] <= 100 for pair in self.memory_share_pct):
            problems.append("memory_share_pct must be (GPU index, 10-100 %) pairs")
        bounds = (("max_requests", self.max_requests, 1, 256), ("temperature_limit_c", self.temperature_limit_c, 50, 95),
                  ("download_limit_mib_s", self.download_limit_mib_s, 0.1, 10_000),
                  ("monthly_download_gib", self.monthly_download_gib, 1, 100_000),
                  ("notify_idle_hours", self.notify_idle_hours, 1, 168))
        for name, value, low, high in bounds:
            if value is not None and not low <= value <= high:
                problems.append(f"{name} must be between {low:g} and {high:g}")
        return problems

    def memory_share(self, gpu_index: int) -> int:
        """The % of this card's memory the lender lets an engine use (100 where no limit is set)."""
        return dict(self.memory_share_pct).get(gpu_index, 100)

    def with_changes(self, **changes: Any) -> Settings:
        return replace(self, **changes).validated()


@dataclass
class State:
    """What the app writes for itself: the node's identity and small facts between runs."""

    node_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    signed_in: bool = False
    last_assignment: dict[str, Any] | None = None
    paused: bool = False
    pause_until: float | None = None  # epoch seconds of a timed pause; None = until resumed


class DataFolderUnsafe(OSError):
    """A folder or file of the data folder is not this user's alone, or is a link to somewhere
    else; the message names it and says what to do. Nothing was read or written through it."""


def private_dir(folder: Path) -> Path:
    """`folder` (and any parent this makes) created 0700; an existing `folder` of this user's is
    narrowed to 0700. Raises `DataFolderUnsafe` when someone else owns it or may write to it."""
    missing = [parent for parent in (folder, *folder.parents) if not parent.exists()]
    for parent in reversed(missing):
        with contextlib.suppress(FileExistsError):
            parent.mkdir(mode=PRIVATE_DIR_MODE)
    if not hasattr(os, "getuid"):  # Windows: the folder's ACL under the user's profile protects it
        return folder
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))  # a linked folder of this user's is fine
    try:
        info = os.fstat(fd)
        _check_own_folder(folder, info)
        if stat.S_IMODE(info.st_mode) != PRIVATE_DIR_MODE:
            os.fchmod(fd, PRIVATE_DIR_MODE)
    finally:
        os.close(fd)
    return folder


def _check_own_folder(folder: Path, info: os.stat_result) -> None:
    if info.st_uid != os.getuid():
        raise DataFolderUnsafe(
            f"GPU Provider will not use the folder {folder}: it belongs to another user account, who could "
            "read or change what GPU Provider keeps there. Use a folder of your own (--data-dir DIR), "
            "or delete this one and start again.")
    if info.st_mode & _OTHERS_WRITE:
        raise DataFolderUnsafe(
            f"GPU Provider will not use the folder {folder}: other user accounts on this computer may "
            "write to it, so they could have left files or links there. Make it yours alone "
            f"(chmod 700 '{folder}') after checking what is inside, or use another folder (--data-dir DIR).")


def _check_parents(folder: Path) -> None:
    """Each parent is this user's or the system's, and no one else may write to it (or it is
    sticky, as /tmp is): else another account could move the folder and put its own in its place."""
    if not hasattr(os, "getuid"):
        return
    for parent in folder.parents:
        info = parent.stat()
        shared = info.st_mode & _OTHERS_WRITE and not info.st_mode & stat.S_ISVTX
        if info.st_uid not in (0, os.getuid()) or shared:
            raise DataFolderUnsafe(
                f"GPU Provider will not use the folder {folder}: another user account may move or replace "
                f"{parent}, which holds it. Use a folder inside your own home folder (--data-dir DIR).")


def private_opener(path: str, flags: int) -> int:
    """`open(..., opener=private_opener)`: a new file is made 0600, an existing one narrowed to
    0600 (through the descriptor). A link or anything but a plain file at `path` raises
    `DataFolderUnsafe`, its target untouched."""
    _refuse_link(path)
    try:
        fd = os.open(path, flags | NOFOLLOW | _NONBLOCK, PRIVATE_FILE_MODE)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK) or os.path.islink(path):
            raise _link_refused(path) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise DataFolderUnsafe(
                f"{path} is not a file GPU Provider made (something else is in its place); "
                "delete it and start again.")
        if _NONBLOCK:
            os.set_blocking(fd, True)
        if hasattr(os, "fchmod") and stat.S_IMODE(info.st_mode) != PRIVATE_FILE_MODE:
            os.fchmod(fd, PRIVATE_FILE_MODE)  # POSIX; on Windows the folder's ACL protects the file
    except BaseException:
        os.close(fd)
        raise
    return fd


def _refuse_link(path: str) -> None:
    """Where there is no O_NOFOLLOW (Windows): the lstat that stands in for it."""
    if not NOFOLLOW and os.path.islink(path):
        raise _link_refused(path)


def _link_refused(path: str) -> DataFolderUnsafe:
    return DataFolderUnsafe(
        f"{path} is a link to another file, which GPU Provider never makes: someone or something put it "
        "there. GPU Provider did not open it nor what it points to. Delete the link and start again.")


def read_private_text(path: Path, limit: int = MAX_SMALL_FILE_BYTES) -> str:
    """A small file of the data folder, read without following a link (`DataFolderUnsafe`) and
    never past `limit` bytes (ValueError): a reader never blocks or fills memory on what it finds."""
    with open(path, "rb", opener=_reader) as source:
        data = source.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} is over {limit} bytes")
    return data.decode("utf-8")


def _reader(path: str, flags: int) -> int:
    _refuse_link(path)
    try:
        fd = os.open(path, flags | NOFOLLOW | _NONBLOCK)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise _link_refused(path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DataFolderUnsafe(f"{path} is not a file GPU Provider made; delete it and start again.")
    return fd


def narrow_existing(path: Path) -> None:
    """A file some other program made beside ours (SQLite's -wal and -shm) narrowed to 0600 through
    its descriptor, if it exists; a link there raises `DataFolderUnsafe`."""
    try:
        os.close(private_opener(str(path), os.O_RDONLY))
    except FileNotFoundError:
        pass


def write_private_text(path: Path, text: str, *, durable: bool = False) -> None:
    """Replaces `path` atomically with `text`, readable by this user only (0600) from the first byte;
    `durable` also waits until it is on disk (for what must survive a power cut)."""
    if not path.parent.is_dir():
        private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)  # mkstemp: always 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        replace_file(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_file(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """`os.replace`, tried again while another program briefly holds `target` open (Windows).
    Raises OSError naming the file when it stays held past the last try, or for any other cause."""
    for wait_s in (*REPLACE_WAITS_S, None):
        try:
            os.replace(source, target)
            return
        except OSError as exc:
            if not _held_by_another(exc):
                raise
            if wait_s is None:
                raise OSError(exc.errno, f"another program keeps {target} open, so GPU Provider could not "
                              f"update it ({exc.strerror}); it tries again later", str(target)) from exc
            time.sleep(wait_s)


def _held_by_another(exc: OSError) -> bool:
    return isinstance(exc, PermissionError) or getattr(exc, "winerror", None) in _SHARING_WINERRORS


def _atomic_write_json(path: Path, data: dict[str, Any]) -> None:
    write_private_text(path, json.dumps(data, indent=2, sort_keys=True), durable=True)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(read_private_text(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        aside = path.with_suffix(path.suffix + ".damaged")
        log.warning("could not read %s (%s); moved it to %s and started from defaults", path, exc, aside)
        replace_file(path, aside)
        return None
    if not isinstance(data, dict):
        log.warning("%s does not hold a JSON object; ignoring it", path)
        return None
    return data


def _from_dict(cls: type[_Record], data: dict[str, Any]) -> _Record:
    known = {f.name for f in fields(cls)}
    values = {k: v for k, v in data.items() if k in known}
    for name in ("serve_hours", "gpus_to_lend", "autopause_ignored"):
        if isinstance(values.get(name), list):
            values[name] = tuple(values[name])
    if isinstance(values.get("memory_share_pct"), list):
        values["memory_share_pct"] = tuple(tuple(pair) if isinstance(pair, list) else pair
                                           for pair in values["memory_share_pct"])
    return cls(**values)


def load_settings(paths: Paths) -> Settings:
    data = _read_json(paths.settings_file) or {}
    if data and "setup_complete" not in data:  # written before the first-run flow existed: set up already
        data["setup_complete"] = True
    try:
        return _from_dict(Settings, data).validated()
    except (TypeError, ValueError) as exc:
        log.warning("settings in %s are not valid (%s); using defaults", paths.settings_file, exc)
        return Settings()


def save_settings(paths: Paths, settings: Settings) -> None:
    _atomic_write_json(paths.settings_file, asdict(settings.validated()))


def load_state(paths: Paths) -> State:
    """The state, created (with a fresh node id) and saved on first use."""
    data = _read_json(paths.state_file)
    if data is None:
        state = State()
        save_state(paths, state)
        return state
    try:
        return _from_dict(State, data)
    except TypeError as exc:
        log.warning("state in %s is not valid (%s); keeping only the node id", paths.state_file, exc)
        node_id = data.get("node_id")
        return State(node_id=node_id) if isinstance(node_id, str) else State()


def save_state(paths: Paths, state: State) -> None:
    _atomic_write_json(paths.state_file, asdict(state))


@dataclass(frozen=True)
class LocalEndpoint:
    """What a program on this computer needs to use local mode's endpoint: its address and key;
    and the local coordinator's address, which the node's connection names while it runs."""

    url: str
    key: str
    coordinator_url: str = ""

    def serves(self, coordinator_url: str) -> bool:
        """The node connected to `coordinator_url` runs in local mode, with this endpoint."""
        return coordinator_url == DEFAULT_COORDINATOR or (bool(self.coordinator_url)
                                                          and coordinator_url == self.coordinator_url)


def local_endpoint_key(paths: Paths) -> str:
    """This data folder's key for the local endpoint: the one kept in its file, else a new one.
    Kept in the data folder (0600, written and read without following links), not the keyring:
    the person needs to see it (`gpu-provider status`, the dashboard), and it opens only an
    endpoint on 127.0.0.1 of this computer, not the person's account."""
    found = read_local_endpoint(paths)
    return found.key if found is not None else "gpk-" + secrets.token_urlsafe(32)


def save_local_endpoint(paths: Paths, endpoint: LocalEndpoint) -> None:
    write_private_text(paths.local_endpoint_file, json.dumps(asdict(endpoint)) + "\n", durable=True)


def read_local_endpoint(paths: Paths) -> LocalEndpoint | None:
    """The endpoint as the node last wrote it; None when there is none."""
    try:
        data = json.loads(read_private_text(paths.local_endpoint_file))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    url, key, coordinator = data.get("url"), data.get("key"), data.get("coordinator_url", "")
    if not isinstance(url, str) or not isinstance(key, str) or len(key) < 32 or not isinstance(coordinator, str):
        return None
    return LocalEndpoint(url, key, coordinator)
