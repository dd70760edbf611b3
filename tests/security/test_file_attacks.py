"""File attacks: the two of issue 12 against a real node serving a real llama-server on CPU, and
the links of issue 21 planted in a data folder before the node starts.

Before the allowlist, `--log-file ~/.ssh/authorized_keys -v` with an inline chat template that
printed a public key truncated the file to the engine's log (one line of it the attacker's key),
and `--chat-template-file ~/.ssh/id_ed25519 -v` followed by one ordinary completion returned the
private key in `__verbose.prompt`. Here both arrive as a replacement for a serving assignment and
as the first assignment of an idle node: the target file keeps its bytes and its mtime, and no
relayed answer holds the secret.

Before no-follow opens, a link planted in the data folder at the log file, the status file's
temporary, the ledger or its -wal/-shm, or the lock was followed: the target was truncated or
written and chmodded 0600. Here each is planted pointing at a file of the person's: the target
keeps its bytes, its mtime and its mode, and the node either replaces the link (files it rewrites
whole) or refuses with a message that names the link and what to do.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.test_node import STATE_TIMEOUT_S, running_node
from tests.integration.test_node_headless import GPU_PROVIDER
from tests.support.engines import LlamaServer
from worker.system import applog
from worker.contract import protocol
from worker.system.config import (
    DataFolderUnsafe,
    LocalEndpoint,
    Paths,
    Settings,
    load_settings,
    load_state,
    read_local_endpoint,
    save_local_endpoint,
    save_settings,
)
from worker.system.datalock import LOCK_NAME, OWNER_NAME, DataFolderLock
from worker.contract.events import NodeSnapshot
from worker.measure.ledger import Ledger, LedgerError
from worker.node.status import StatusFile, read_status

pytestmark = pytest.mark.integration

ATTACKER_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAttackerAttackerAttackerAttacker attacker@evil"
SECRET = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA-SECRET-MARKER-7f3a\n-----END OPENSSH PRIVATE KEY-----\n"
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


def assign(model: Path, assignment_id: str, extra: list[str]) -> protocol.Assign:
    spec = protocol.EngineModel(source=str(model), weights_mib=1,
                                base_args=["--ctx-size", "1024", "--threads", "1", *extra])
    return protocol.Assign(assignment_id=assignment_id, model=protocol.ModelSpec(name="tiny-llama", llamacpp=spec))


def attacks(home: Path) -> list[list[str]]:
    keys, private = home / ".ssh" / "authorized_keys", home / ".ssh" / "id_ed25519"
    return [
        ["--log-file", str(keys), "-v", "--chat-template", "{{ '" + ATTACKER_KEY + "' }}"],
        ["--chat-template-file", str(private), "-v"],
    ]


def plant(home: Path) -> dict[Path, tuple[bytes, int]]:
    ssh = home / ".ssh"
    ssh.mkdir(parents=True)
    (ssh / "authorized_keys").write_text("ssh-ed25519 AAAAC3Nza-owner owner@home\n", encoding="utf-8")
    (ssh / "id_ed25519").write_text(SECRET, encoding="utf-8")
    return {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in ssh.iterdir()}


def unchanged(before: dict[Path, tuple[bytes, int]]) -> bool:
    return all((p.read_bytes(), p.stat().st_mtime_ns) == seen for p, seen in before.items())


async def test_file_attacks_refused_while_serving_and_the_engine_answers_without_the_secret(
    llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    before = plant(home)
    bins = {"llamacpp": str(llama_server_bin.executable)}
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=assign(tiny_gguf, "ok-1", [])) as run:
        ready = await run.status("ready", "failed")
        assert ready.state == "ready", ready.last_error
        [serving] = run.node.snapshot().engines
        for number, extra in enumerate(attacks(home), start=2):
            mark = run.mark()
            await run.coordinator.send(assign(tiny_gguf, f"evil-{number}", extra))
            status = await run.coordinator.wait_for(
                lambda m, n=number: isinstance(m, protocol.Status) and m.refused is not None
                and m.refused.assignment_id == f"evil-{n}", after=mark, timeout=STATE_TIMEOUT_S)
            assert status.refused is not None
            assert status.refused.reason.startswith(f"argument not allowed: {extra[0]}")
            assert status.state == "ready" and status.assignment_id == "ok-1"
            answer = await run.ask(CHAT)
            assert answer.error is None and answer.end is not None
            assert "SECRET-MARKER" not in answer.data and "__verbose" not in answer.data
        assert run.node.snapshot().engines[0].pid == serving.pid
        argv = " ".join(run.node.snapshot().engines[0].argv)
        assert "--log-file" not in argv and "--chat-template" not in argv
    assert unchanged(before)


@pytest.mark.parametrize("which", [0, 1])
async def test_file_attacks_refused_on_an_idle_node_and_nothing_starts(
    llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path, which: int
) -> None:
    home = tmp_path / "home"
    before = plant(home)
    extra = attacks(home)[which]
    bins = {"llamacpp": str(llama_server_bin.executable)}
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=assign(tiny_gguf, "evil-1", extra)) as run:
        failed = await run.status("failed", "ready")
        assert failed.state == "failed" and failed.engines == []
        assert failed.last_error is not None and failed.last_error.startswith(f"argument not allowed: {extra[0]}")
        assert failed.refused is not None and failed.refused.assignment_id == "evil-1"
        answer = await run.ask(CHAT)
        assert answer.error is not None and answer.error.code == "not_ready"
        assert run.engine_pids == set()
        assert "SECRET-MARKER" not in json.dumps([m.model_dump() for m in run.coordinator.received])
    assert unchanged(before)


# --- links planted in the data folder (issue 21) -----------------------------------------------------

Target = tuple[bytes, int, int]


def person_file(tmp_path: Path) -> Path:
    """A file of the person's that a planted link points at: readable by all, as most are."""
    target = tmp_path / "home" / "notes.txt"
    target.parent.mkdir(exist_ok=True)
    target.write_text("the person's own notes\n", encoding="utf-8")
    os.chmod(target, 0o644)
    return target


def seen(target: Path) -> Target:
    info = target.stat()
    return target.read_bytes(), info.st_mtime_ns, stat.S_IMODE(info.st_mode)


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return Paths.under(tmp_path / "node").ensure()


@pytest.fixture
def restored_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def refused(use: Callable[[], object], error: type[Exception] = DataFolderUnsafe) -> str:
    with pytest.raises(error) as raised:
        use()
    return str(raised.value)


LEDGER_LINKS = ["", "-wal", "-shm", "-journal"]


@pytest.mark.parametrize("suffix", LEDGER_LINKS)
def test_a_link_at_the_ledger_or_its_companions_is_refused_and_its_target_untouched(
        paths: Paths, tmp_path: Path, suffix: str) -> None:
    target = person_file(tmp_path)
    before = seen(target)
    link = Path(f"{paths.ledger_file}{suffix}")
    link.symlink_to(target)
    message = refused(lambda: Ledger(paths.ledger_file), LedgerError)
    assert f"{link} is a link to another file" in message and "Delete the link" in message
    assert seen(target) == before


def test_a_link_at_the_log_file_is_refused_and_no_line_is_written_through_it(
        paths: Paths, tmp_path: Path, restored_logging: None) -> None:
    target = person_file(tmp_path)
    before = seen(target)
    applog.log_file(paths).symlink_to(target)
    message = refused(lambda: applog.configure(paths, console=False))
    assert f"{applog.log_file(paths)} is a link to another file" in message
    logging.getLogger("test").error("a line that must not reach the person's file")
    assert seen(target) == before


def test_a_link_at_a_rotated_log_is_moved_as_a_link_never_written_through(
        paths: Paths, tmp_path: Path, restored_logging: None) -> None:
    target = person_file(tmp_path)
    before = seen(target)
    rotated = Path(f"{applog.log_file(paths)}.1")
    rotated.symlink_to(target)
    applog.configure(paths, console=False)
    logging.getLogger("test").info("one line")
    handler = next(h for h in logging.getLogger().handlers if isinstance(h, logging.handlers.RotatingFileHandler))
    handler.doRollover()
    logging.getLogger("test").info("another line")
    assert seen(target) == before
    assert not applog.log_file(paths).is_symlink() and "another line" in applog.log_file(paths).read_text()


@pytest.mark.parametrize("name", [LOCK_NAME, OWNER_NAME])
def test_a_link_at_the_lock_or_its_sidecar_is_never_followed(paths: Paths, tmp_path: Path, name: str) -> None:
    target = person_file(tmp_path)
    before = seen(target)
    (paths.data_dir / name).symlink_to(target)
    lock = DataFolderLock(paths)
    if name == LOCK_NAME:
        assert f"{paths.data_dir / name} is a link to another file" in refused(lock.acquire)
        assert f"{paths.data_dir / name} is a link to another file" in refused(lock.owner)
    else:  # the sidecar is rewritten whole: the link is replaced, and read through by no one
        lock.acquire()
        assert json.loads((paths.data_dir / name).read_text())["pid"] == os.getpid()
        lock.release()
    assert seen(target) == before


def test_a_link_at_the_status_files_is_replaced_and_its_target_untouched(paths: Paths, tmp_path: Path) -> None:
    target = person_file(tmp_path)
    before = seen(target)
    paths.status_file.symlink_to(target)
    paths.status_file.with_suffix(".tmp").symlink_to(target)
    assert read_status(paths) is None
    StatusFile(paths, lambda: True).write(NodeSnapshot(at=1.0, state="ready", node_id="n", runtime="cpu"))
    assert seen(target) == before and not paths.status_file.is_symlink()


@pytest.mark.parametrize("which", ["settings", "state", "local endpoint"])
def test_a_link_at_settings_state_or_the_endpoint_key_is_set_aside_never_read_or_written_through(
        paths: Paths, tmp_path: Path, which: str) -> None:
    """A link at settings.json could hand the node another coordinator; it is moved aside, as a
    damaged file is, and the node starts from defaults (and a fresh key)."""
    target = tmp_path / "home" / "evil.json"
    target.parent.mkdir()
    planted = {"coordinator_url": "wss://evil.example/v1/node", "node_id": "evil", "setup_complete": True,
               "url": "http://127.0.0.1:8090/v1", "key": "k" * 40}
    target.write_text(json.dumps(planted), encoding="utf-8")
    os.chmod(target, 0o644)
    before = seen(target)
    file = {"settings": paths.settings_file, "state": paths.state_file,
            "local endpoint": paths.local_endpoint_file}[which]
    file.symlink_to(target)
    if which == "settings":
        assert load_settings(paths).coordinator_url != planted["coordinator_url"]
        save_settings(paths, Settings())
    elif which == "state":
        assert load_state(paths).node_id != "evil"
    else:
        assert read_local_endpoint(paths) is None
        save_local_endpoint(paths, LocalEndpoint("http://127.0.0.1:8090/v1", "n" * 40))
    assert seen(target) == before and not file.is_symlink()


def test_the_headless_node_refuses_to_start_on_a_planted_link_and_says_why(tmp_path: Path) -> None:
    data_dir = tmp_path / "node"
    paths = Paths.under(data_dir).ensure()
    target = person_file(tmp_path)
    before = seen(target)
    applog.log_file(paths).symlink_to(target)
    started = subprocess.run([str(GPU_PROVIDER), "run", "--headless", "--data-dir", str(data_dir),
                              "--coordinator", "none"], capture_output=True, text=True, timeout=60, check=False)
    assert started.returncode == 2, started.stderr
    assert f"{applog.log_file(paths)} is a link to another file" in started.stderr
    assert "Traceback" not in started.stderr
    assert seen(target) == before
