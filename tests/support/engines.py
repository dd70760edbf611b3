"""Where the engines used by tests live: a real llama-server (built once per machine) and the
vLLM stand-in under tests/standin/; and a client that reaches a supervised engine where it listens."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
ENSURE_LLAMA_SERVER = REPO / "tests" / "support" / "ensure_llama_server.sh"
VLLM_STANDIN = REPO / "tests" / "standin" / "vllm"
BUILD_TIMEOUT_S = 40 * 60  # the first build on 2 cores takes about 11 minutes; later calls return at once


@dataclass(frozen=True)
class LlamaServer:
    """A built llama-server: the binary needs LD_LIBRARY_PATH pointing at its own folder."""

    bin_dir: Path

    @property
    def executable(self) -> Path:
        return self.bin_dir / "llama-server"

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(self.bin_dir), env.get("LD_LIBRARY_PATH")]))
        return env


def ensure_llama_server() -> LlamaServer:
    """Build (or wait for the build of) llama-server; RuntimeError says what went wrong."""
    result = subprocess.run([str(ENSURE_LLAMA_SERVER)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                            check=False)
    if result.returncode != 0:
        raise RuntimeError(f"could not build llama-server ({ENSURE_LLAMA_SERVER}):\n{result.stderr[-2000:]}")
    bin_dir = Path(result.stdout.strip().splitlines()[-1])
    return LlamaServer(bin_dir)


def engine_client(socket_path: str | None, *, limits: httpx.Limits | None = None, **options: Any) -> httpx.AsyncClient:
    """An httpx client for an engine's `base_url`: through its Unix socket when it has one."""
    transport = httpx.AsyncHTTPTransport(uds=socket_path, limits=limits or httpx.Limits())
    return httpx.AsyncClient(transport=transport, trust_env=False, **options)


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
