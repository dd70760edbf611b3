"""While a real node serves: nothing listens beyond loopback, and the token is in no file or log.

Figures, asserted: listening sockets of the node and its engine children on a non-loopback
address = 0; files under the data folder that hold the token = 0 (of all of them); log lines
(the node's terminal output with --verbose, and its log files) that hold it = 0; engine children
that inherit it = 0.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
from pathlib import Path

import psutil
import pytest

from tests.security.node_process import headless_node, model_folder, vllm_assignment
from tests.support.engines import VLLM_STANDIN
from worker.localnet import ReferenceCoordinator

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
        print(f"\nlistening sockets while serving: {len(listening)}, off loopback: {len(off_loopback)}; "
              f"engine children holding the token: {len(inherited)} of {len(children)}")
        assert listening, "the engine's port should be among them: the check must see sockets at all"
        assert off_loopback == []
        assert children and inherited == []

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
