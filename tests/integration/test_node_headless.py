"""`gpu-provider run --headless --coordinator local` as a real process with the vLLM stand-in:
it serves an OpenAI client on 127.0.0.1, `gpu-provider status` reads it while it runs, and
SIGTERM drains, stops the engines and exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.test_node import (
    STATE_TIMEOUT_S,
    free_ports,
    hardware_file,
    model_folder,
    processes_mentioning,
)

pytestmark = pytest.mark.integration

GPU_PROVIDER = Path(sys.executable).with_name("gpu-provider")


def status(data_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(GPU_PROVIDER), "status", "--data-dir", str(data_dir), *extra],
                          capture_output=True, text=True, timeout=STATE_TIMEOUT_S, check=False)


def until_ready(data_dir: Path, agent: subprocess.Popen[str]) -> dict[str, Any]:
    """`gpu-provider status --json` once the agent reports ready."""
    deadline = time.monotonic() + STATE_TIMEOUT_S
    while time.monotonic() < deadline:
        assert agent.poll() is None, "the agent exited before it was ready"
        shown = status(data_dir, "--json")
        if shown.returncode == 0 and json.loads(shown.stdout)["snapshot"]["state"] == "ready":
            return json.loads(shown.stdout)
        time.sleep(0.3)
    raise TimeoutError(f"the agent was not ready within {STATE_TIMEOUT_S} s")


def test_headless_agent_serves_reports_status_and_stops_on_sigterm(tmp_path: Path, vllm_standin: Path) -> None:
    data_dir, model, port = tmp_path / "data", model_folder(tmp_path), free_ports(1)
    assert status(data_dir).returncode == 1  # nothing runs yet
    agent = subprocess.Popen(
        [str(GPU_PROVIDER), "run", "--headless", "--data-dir", str(data_dir), "--coordinator", "local",
         "--hardware", str(hardware_file(tmp_path, "rtx4090.json")), "--engine-bin", f"vllm={vllm_standin}",
         "--model", str(model), "--openai-port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        found = until_ready(data_dir, agent)
        assert found["pid"] == agent.pid and found["snapshot"]["model"] == "fake-model"
        table = status(data_dir)
        assert table.returncode == 0 and "State       Serving · fake-model" in table.stdout
        assert "445,888 tokens" in table.stdout  # the KV budget the stand-in printed

        assert found["local_endpoint"]["url"] == f"http://127.0.0.1:{port}/v1"
        assert f"API key     {found['local_endpoint']['key']}" in table.stdout
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", trust_env=False, timeout=STATE_TIMEOUT_S,
                           headers={"Authorization": f"Bearer {found['local_endpoint']['key']}"},
                           json={"model": "fake-model", "max_tokens": 4,
                                 "messages": [{"role": "user", "content": "hello there"}]})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == " the quick brown fox"
        assert reply.json()["usage"]["completion_tokens"] == 4
        assert processes_mentioning(str(model)) != []  # the engine runs…

        agent.send_signal(signal.SIGTERM)
        output, _ = agent.communicate(timeout=STATE_TIMEOUT_S)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert agent.returncode == 0, output
    assert processes_mentioning(str(model)) == []  # …and is gone with the agent
    assert "engine e0: stopped" in output and output.rstrip().endswith("stopped")
    assert status(data_dir).returncode == 1
