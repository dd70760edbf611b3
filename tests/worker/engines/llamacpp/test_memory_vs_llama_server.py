"""The memory rule against the real llama-server: for each argument list, the context and KV cache
the engine reports allocating at start are what `memory.py` computes from the GGUF header."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.support.engines import LlamaServer
from worker.engines import llamacpp
from worker.engines.base import ContextSize, KvCachePart
from worker.engines.llamacpp.memory import ServerSettings, read_shape

pytestmark = pytest.mark.integration

START_TIMEOUT_S = 60.0


def started(server: LlamaServer, model: Path, args: list[str], log: Path) -> list[str]:
    """llama-server's log lines up to "listening" (or its exit); the server is stopped after."""
    argv = [str(server.executable), "-m", str(model), *args, "--fit", "off", "-lv", "4", "-t", "1",
            "--host", "127.0.0.1", "--port", "0"]
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=server.environment())
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and process.poll() is None and b"listening on" not in log.read_bytes():
            time.sleep(0.1)
    finally:
        process.kill()
        process.wait()
    return log.read_text(encoding="utf-8", errors="replace").splitlines()


@pytest.mark.parametrize(
    "args",
    [
        [], ["-c", "1024"], ["-c", "1000"], ["-c", "1024", "-np", "256"], ["-c", "1024", "-np", "3"],
        ["-c", "1024", "-np", "256", "-kvu"], ["-c", "65536", "-ctk", "bf16", "-ctv", "f32"],
        ["-c", "4096", "-ctk", "f32", "-ctv", "f32", "-np", "-1"],
    ],
    ids=lambda args: " ".join(args) or "defaults",
)
def test_the_rule_matches_what_llama_server_allocates(llama_server_bin: LlamaServer, tiny_gguf: Path,
                                                     tmp_path: Path, args: list[str]) -> None:
    facts = [llamacpp.parse_line(line) for line in started(llama_server_bin, tiny_gguf, args, tmp_path / "log")]
    contexts = [f.n_ctx for f in facts if isinstance(f, ContextSize)]
    kv_mib = sum(f.mib for f in facts if isinstance(f, KvCachePart))
    shape, wanted = read_shape(str(tiny_gguf)), ServerSettings.from_args(args)
    cells = wanted.cells(shape.trained_context)
    assert contexts == [cells]
    assert kv_mib == pytest.approx(cells * shape.cell_bytes(range(shape.layers), wanted.cache_k, wanted.cache_v) / 2**20,
                                   abs=0.01)
