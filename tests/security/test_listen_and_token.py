"""While a real node serves: only the app can reach its engine, and the token is in no file or log.

Figures, asserted: TCP listeners of the node and its engine children = 0 (the engine is on a Unix
socket in a 0700 folder) and none on a non-loopback address; engine command lines that hold the
engine's key = 0; files under the data folder that hold the token = 0 (of all of them); log lines
(the node's terminal output with --verbose, and its log files) that hold it = 0; engine children
that inherit it = 0; the data folders are 0700 and the app's own files (logs, ledger, state, pid
and status files) 0600.
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import socket
import stat
from pathlib import Path

import psutil
import pytest

from tests.security.node_process import headless_node, model_folder, vllm_assignment
from tests.support.engines import VLLM_STANDIN
from worker.link.local import ReferenceCoordinator

pytestmark = pytest.mark.integration


def _listening(process: psutil.Process) -> list[tuple[int, str]]:
    """(pid, address) of every TCP listener and unconnected UDP socket of the process and its children."""
    found = []
    for member in [process, *process.children(recursive=True)]:
        try:
            connections = member.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        for c in connections:
            if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr):
                found.append((member.pid, c.laddr.ip))
    return found


def _unix_listeners(process: psutil.Process) -> list[str]:
    """Paths of the Unix sockets the process and its children have bound (each accepted
    connection names its listener's path too)."""
    found = []
    for member in [process, *process.children(recursive=True)]:
        try:
            found += [str(c.laddr) for c in member.net_connections(kind="unix") if c.laddr]
        except psutil.NoSuchProcess:
            continue
    return found


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_serving_node_listens_on_loopback_only_and_never_writes_the_token(tmp_path: Path) -> None:
    token = f"tok-{secrets.token_hex(20)}"
    assign = vllm_assignment(str(model_folder(tmp_path)))
    async with (
        ReferenceCoordinator(token=token, assign=assign, ping_interval=None) as coordinator,
        headless_node(tmp_path, coordinator.url, token, VLLM_STANDIN) as node,
    ):
        await node.wait_ready(coordinator)
        exchange = await coordinator.request({"model": "tiny-1b", "prompt": "hi", "max_tokens": 8, "stream": True},
                                             path="/v1/completions")
        answer = await exchange.collect(timeout=20)
        assert answer.end is not None and answer.data, answer

        family = psutil.Process(node.process.pid)
        listening = _listening(family)
        off_loopback = [(pid, ip) for pid, ip in listening if not ipaddress.ip_address(ip).is_loopback]
        children = family.children(recursive=True)
        inherited = [c.pid for c in children if token in "\0".join(c.environ().values())
                     or "GPU_PROVIDER_TOKEN" in c.environ()]
        keys = {c.environ()["VLLM_API_KEY"] for c in children if "VLLM_API_KEY" in c.environ()}
        keys_on_argv = [c.pid for c in children for key in keys if key in "\0".join(c.cmdline())]
        engine_sockets = sorted({Path(path) for path in _unix_listeners(family) if path.endswith(".sock")})
        print(f"\nlistening sockets while serving: {len(listening)}, off loopback: {len(off_loopback)}; "
              f"engine sockets: {[str(p) for p in engine_sockets]}; engine keys on a command line: "
              f"{len(keys_on_argv)}; engine children holding the token: {len(inherited)} of {len(children)}")
        assert engine_sockets == [node.data_dir / "run" / "engines" / "e0.sock"], "the check must see the engine"
        assert _mode(engine_sockets[0].parent) == 0o700
        assert listening == [] and off_loopback == []
        assert len(keys) == 1 and keys_on_argv == []
        assert children and inherited == []
        run_files = [node.data_dir / "run" / name for name in ("status.json", "engine-e0.pid.json")]
        async with asyncio.timeout(10):
            while not all(p.exists() for p in run_files):  # the status file follows the snapshot
                await asyncio.sleep(0.05)
        assert {p.name: _mode(p) for p in run_files} == {p.name: 0o600 for p in run_files}

    files = [p for p in node.data_dir.rglob("*") if p.is_file()]
    holding = [p for p in files if token.encode() in p.read_bytes()]
    log_lines = node.output + [line for p in files if p.suffix == ".log" or ".log" in p.name
                               for line in p.read_text(encoding="utf-8", errors="replace").splitlines()]
    leaking = [line for line in log_lines if token in line]
    print(f"files under the data folder holding the token: {len(holding)} of {len(files)}; "
          f"log lines holding it: {len(leaking)} of {len(log_lines)}")
    assert any(".log" in p.name for p in files), "the node should have written a log file to check"
    assert len(log_lines) > 10
    assert holding == [] and leaking == []

    folders = [node.data_dir / name for name in ("config", "data", "cache", "logs", "run")]
    own = [p for p in files if ".log" in p.name or p.name.startswith("ledger") or p.suffix == ".json"]
    wide = [str(p) for p in folders if _mode(p) != 0o700] + [str(p) for p in own if _mode(p) != 0o600]
    print(f"app folders and files wider than 0700/0600: {wide} (of {len(folders)} folders, {len(own)} files)")
    assert {p.name for p in own} >= {"gpu-provider.log", "engine-e0.log", "state.json", "ledger.sqlite3"}
    assert wide == []
