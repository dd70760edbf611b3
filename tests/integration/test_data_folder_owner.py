"""One owner per data folder, with real processes: while `gpu-provider run --headless` drains a
request on its engine, a second node on the same folder (the CLI, or `Node.run` in-process) stops
at once with a clear error and leaves that engine and its pid file alone; once the first owner
has stopped, a new one starts. And the folder is this user's alone: one that another account owns
or may write to is refused before anything in it is used."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

from tests.integration.test_node import STATE_TIMEOUT_S, free_ports, hardware_file
from tests.integration.test_node_headless import GPU_PROVIDER, until_ready
from worker.serve import process as procs
from worker.system.config import DataFolderUnsafe, Paths, Settings, read_local_endpoint
from worker.system.datalock import DataFolderInUse, DataFolderLock, Owner
from worker.node.node import Node

pytestmark = pytest.mark.integration

TOKEN_DELAY_S = 0.5  # the stand-in's pace: a 200-token answer outlasts the node's 10 s drain


def model_folder(root: Path) -> Path:
    """A model folder the vLLM stand-in can "load"."""
    folder = root / "fake-model"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}', encoding="utf-8")
    (folder / "model.safetensors").write_bytes(b"\0" * 1024)
    return folder


def headless(data_dir: Path, hardware: Path, vllm_standin: Path, model: Path, port: int) -> list[str]:
    return [str(GPU_PROVIDER), "run", "--headless", "--data-dir", str(data_dir), "--coordinator", "local",
            "--hardware", str(hardware), "--engine-bin", f"vllm={vllm_standin}", "--model", str(model),
            "--openai-port", str(port)]


def slow_request(paths: Paths, first_token: threading.Event) -> None:
    """A streamed answer that is still coming when the node is told to stop; it may be cut."""
    body = {"model": "fake-model", "max_tokens": 200, "stream": True,
            "messages": [{"role": "user", "content": "take your time"}]}
    endpoint = read_local_endpoint(paths)
    assert endpoint is not None, "the node wrote no endpoint file"
    try:
        with httpx.stream("POST", f"{endpoint.url}/chat/completions", json=body, trust_env=False,
                          headers={"Authorization": f"Bearer {endpoint.key}"}, timeout=STATE_TIMEOUT_S) as response:
            for line in response.iter_lines():
                if '"content"' in line:
                    first_token.set()
    except httpx.HTTPError:
        pass


def wait_for(check: Callable[[], bool], what: str, timeout: float = STATE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_second_node_on_a_draining_folder_is_refused_and_touches_nothing(tmp_path: Path,
                                                                           vllm_standin: Path) -> None:
    data_dir, model, port = tmp_path / "node", model_folder(tmp_path), free_ports(1)
    hardware = hardware_file(tmp_path, "rtx4090.json")
    paths = Paths.under(data_dir)
    argv = headless(data_dir, hardware, vllm_standin, model, port)
    first = subprocess.Popen(argv, env={**os.environ, "STANDIN_TOKEN_DELAY_S": str(TOKEN_DELAY_S)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    try:
        until_ready(data_dir, first)
        engine = procs.read_pid_file(procs.pid_file(paths.run_dir, "e0"))
        assert engine is not None and alive(engine.pid)
        first_token = threading.Event()
        threading.Thread(target=slow_request, args=(paths, first_token), daemon=True).start()
        assert first_token.wait(STATE_TIMEOUT_S), "the request never started"

        first.send_signal(signal.SIGTERM)
        wait_for(lambda: DataFolderLock(paths).owner() == Owner(first.pid, "stopping"), "the drain")
        os.kill(first.pid, signal.SIGSTOP)  # held mid-drain, however long the checks below take
        try:
            second = subprocess.run(argv, capture_output=True, text=True, timeout=STATE_TIMEOUT_S, check=False)
            assert second.returncode == 2, second.stderr
            assert (f"gpu-provider: GPU Provider (pid {first.pid}) is still stopping for this data folder"
                    in second.stderr)
            with pytest.raises(DataFolderInUse, match=f"pid {first.pid}"):
                asyncio.run(Node(paths, Settings(), coordinator_url="none", hardware_override=hardware).run())
            assert alive(engine.pid), "the second node reaped the first one's engine"
            assert procs.read_pid_file(procs.pid_file(paths.run_dir, "e0")) == engine
        finally:
            os.kill(first.pid, signal.SIGCONT)
        assert first.wait(timeout=STATE_TIMEOUT_S) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert not alive(engine.pid) and DataFolderLock(paths).owner() is None
    asyncio.run(a_new_owner_starts(paths, hardware))


async def a_new_owner_starts(paths: Paths, hardware: Path) -> None:
    node = Node(paths, Settings(), coordinator_url="none", hardware_override=hardware)
    running = asyncio.create_task(node.run())
    try:
        async with asyncio.timeout(STATE_TIMEOUT_S):
            while DataFolderLock(paths).owner() != Owner(os.getpid(), "running"):
                assert not running.done(), running
                await asyncio.sleep(0.05)
    finally:
        node.shutdown()
        await asyncio.wait_for(running, STATE_TIMEOUT_S)
    assert DataFolderLock(paths).owner() is None


def run_headless_on(data_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(GPU_PROVIDER), "run", "--headless", "--data-dir", str(data_dir), "--coordinator", "none"],
                          capture_output=True, text=True, timeout=STATE_TIMEOUT_S, check=False)


@pytest.mark.parametrize("folder", ["data", "logs", "run", "config"])
def test_a_folder_others_may_write_to_is_refused_before_anything_is_used(tmp_path: Path, folder: str) -> None:
    data_dir = tmp_path / "node"
    paths = Paths.under(data_dir).ensure()
    shared = data_dir / folder
    os.chmod(shared, 0o777)
    planted = shared / "left-by-someone"
    planted.write_text("x")
    refused = run_headless_on(data_dir)
    assert refused.returncode == 2, refused.stderr
    assert f"GPU Provider will not use the folder {shared}: other user accounts" in refused.stderr
    assert f"chmod 700 '{shared}'" in refused.stderr and "Traceback" not in refused.stderr
    assert stat.S_IMODE(shared.stat().st_mode) == 0o777  # left as found: the person decides
    assert not paths.status_file.exists() and not (paths.data_dir / "owner.lock").exists()


def test_a_root_others_may_write_to_is_refused(tmp_path: Path) -> None:
    data_dir = tmp_path / "node"
    Paths.under(data_dir).ensure()
    os.chmod(data_dir, 0o777)  # another account could swap any folder inside for its own
    refused = run_headless_on(data_dir)
    assert refused.returncode == 2, refused.stderr
    assert f"another user account may move or replace {data_dir}" in refused.stderr


def test_a_folder_another_account_owns_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder's owner as the OS reports it against the uid this process runs as (faked at os)."""
    paths = Paths.under(tmp_path / "node").ensure()
    someone_else = os.getuid() + 1
    monkeypatch.setattr(os, "getuid", lambda: someone_else)
    with pytest.raises(DataFolderUnsafe, match="it belongs to another user account"):
        paths.ensure()
    with pytest.raises(DataFolderUnsafe, match="it belongs to another user account"):
        Node(paths, Settings(), coordinator_url="none")
