"""What the app writes is this user's alone: folders 0700, and logs, ledger (with SQLite's -wal and
-shm), state, settings, pid and status files 0600, from the first byte and after an older version
left them wider; a folder others may write to is refused, and no file is opened through a link."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import sys
from pathlib import Path

import pytest

from worker.system import applog
from worker.serve import process as procs
from worker.system.config import (
    DataFolderUnsafe,
    Paths,
    Settings,
    load_settings,
    load_state,
    private_dir,
    private_opener,
    read_private_text,
    save_settings,
    write_private_text,
)
from worker.measure.ledger import Ledger

pytestmark = pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX; Windows uses the folder's ACL")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(autouse=True)
def wide_umask():
    """The usual 022: a file made without care would be world-readable (0644)."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_every_data_folder_is_made_private(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path / "root").ensure()
    folders = [paths.config_dir, paths.data_dir, paths.cache_dir, paths.log_dir, paths.run_dir]
    assert {folder: mode(folder) for folder in folders} == {folder: 0o700 for folder in folders}
    assert mode(tmp_path / "root") == 0o700  # made by the app, so its own too


def test_existing_readable_folders_are_narrowed(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path)
    paths.log_dir.mkdir(mode=0o755)
    paths.run_dir.mkdir(mode=0o711)
    paths.ensure()
    assert (mode(paths.log_dir), mode(paths.run_dir)) == (0o700, 0o700)


@pytest.mark.parametrize("wide", [0o777, 0o770, 0o702])
def test_a_folder_others_may_write_to_is_refused_and_left_as_found(tmp_path: Path, wide: int) -> None:
    paths = Paths.under(tmp_path)
    paths.run_dir.mkdir(parents=True)
    os.chmod(paths.run_dir, wide)
    with pytest.raises(DataFolderUnsafe, match="other user accounts on this computer may write to it"):
        paths.ensure()
    assert mode(paths.run_dir) == wide


def test_a_sticky_shared_parent_like_tmp_is_fine_and_a_plain_shared_one_is_not(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    Paths.under(shared / "node").ensure()
    os.chmod(shared, 0o777)
    with pytest.raises(DataFolderUnsafe, match=f"another user account may move or replace {shared}"):
        Paths.under(shared / "node").ensure()


def test_a_fifo_at_a_file_path_is_refused_without_blocking(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path).ensure()
    os.mkfifo(paths.data_dir / "owner.lock")
    with pytest.raises(DataFolderUnsafe, match="not a file GPU Provider made"):
        os.close(private_opener(str(paths.data_dir / "owner.lock"), os.O_RDWR | os.O_CREAT))
    os.mkfifo(paths.state_file)
    with pytest.raises(DataFolderUnsafe, match="not a file GPU Provider made"):
        read_private_text(paths.state_file)


def test_a_link_is_not_opened_and_an_older_file_is_narrowed_through_its_descriptor(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep\n")
    os.chmod(target, 0o644)
    link = tmp_path / "log"
    link.symlink_to(target)
    with pytest.raises(DataFolderUnsafe, match="is a link to another file"):
        private_opener(str(link), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    with pytest.raises(DataFolderUnsafe, match="is a link to another file"):
        read_private_text(link)
    assert (target.read_text(), mode(target)) == ("keep\n", 0o644)
    os.close(private_opener(str(target), os.O_RDONLY))
    assert mode(target) == 0o600


def test_a_small_file_read_stops_at_its_limit(tmp_path: Path) -> None:
    big = tmp_path / "status.json"
    big.write_bytes(b"x" * 101)
    with pytest.raises(ValueError, match="over 100 bytes"):
        read_private_text(big, limit=100)
    assert read_private_text(big, limit=101) == "x" * 101


def test_settings_and_state_files_are_private(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path).ensure()
    save_settings(paths, Settings())
    load_state(paths)  # creates the state file with a fresh node id
    assert (mode(paths.settings_file), mode(paths.state_file)) == (0o600, 0o600)


def test_status_and_pid_files_are_private(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path).ensure()
    write_private_text(paths.status_file, '{"pid": 1}')
    pid_path = procs.pid_file(paths.run_dir, "e0")
    procs.write_pid_file(pid_path, procs.PidRecord(4242, 1.5, "vllm", "ab" * 32, 7))
    assert (mode(paths.status_file), mode(pid_path)) == (0o600, 0o600)
    assert paths.status_file.read_text() == '{"pid": 1}'


def test_a_private_file_in_a_missing_folder_gets_a_private_folder(tmp_path: Path) -> None:
    write_private_text(tmp_path / "new" / "status.json", "{}")
    assert (mode(tmp_path / "new"), mode(tmp_path / "new" / "status.json")) == (0o700, 0o600)


def test_the_app_log_is_private_even_after_a_rollover(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path).ensure()
    old = applog.log_file(paths)
    old.write_text("an older, world-readable log\n")
    os.chmod(old, 0o644)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        applog.configure(paths, console=False)
        logging.getLogger("test").info("one line")
        handler = next(h for h in root.handlers if isinstance(h, logging.handlers.RotatingFileHandler))
        handler.doRollover()
        logging.getLogger("test").info("another line")
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
    logs = sorted(paths.log_dir.glob("gpu-provider.log*"))
    assert len(logs) == 2 and {log.name: mode(log) for log in logs} == {log.name: 0o600 for log in logs}


def test_the_ledger_and_its_wal_and_shm_are_private(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    with Ledger(path) as ledger:
        ledger.record_sample("tokens_per_s", 1.0, 1_795_000_000.0)
        files = [path, Path(f"{path}-wal"), Path(f"{path}-shm")]
        assert all(f.exists() for f in files)
        assert {f.name: mode(f) for f in files} == {f.name: 0o600 for f in files}


def test_a_ledger_left_readable_by_an_older_version_is_narrowed(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    with Ledger(path) as ledger:
        ledger.record_sample("tokens_per_s", 1.0, 1_795_000_000.0)
    for name in (path, Path(f"{path}-wal")):
        if name.exists():
            os.chmod(name, 0o644)
    with Ledger(path):
        pass
    assert mode(path) == 0o600


async def test_engine_logs_are_private(tmp_path: Path) -> None:
    log_dir = private_dir(tmp_path / "logs")
    older = log_dir / "engine-e0.log"
    older.write_text("the last run\n")
    os.chmod(older, 0o644)
    log_path = procs.rotate_logs(log_dir, "e0")
    process = procs.spawn([sys.executable, "-c", "print('engine line')"], env=dict(os.environ), log_path=log_path)
    await asyncio.wait_for(process.wait(), 10)
    await asyncio.wait_for(process.output_closed(), 10)
    assert log_path.read_text().strip() == "engine line"
    assert (mode(log_path), mode(log_dir / "engine-e0.1.log")) == (0o600, 0o600)


def test_a_new_install_starts_with_the_first_run_flow_and_an_existing_one_does_not(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path / "new").ensure()
    assert load_settings(paths).setup_complete is False
    paths = Paths.under(tmp_path / "old").ensure()
    paths.settings_file.write_text(json.dumps({"electricity_price_per_kwh": 0.3}))
    assert load_settings(paths).setup_complete is True  # written by a version without the flow
    save_settings(paths, Settings(setup_complete=False))
    assert load_settings(paths).setup_complete is False
