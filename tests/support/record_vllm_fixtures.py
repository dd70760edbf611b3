"""Record what the real vLLM (its CPU build, 0.32) shows into tests/fixtures/vllm/, so the stand-in
can be held to it (tests/integration/test_vllm_standin_honest.py). Run once per vLLM release:

    python -m tests.support.record_vllm_fixtures

It starts the cached vLLM on the tiny model twice: once to serve (its start-up log, /v1/models,
/metrics after one completion, and its process shape, including what is left when the API server
alone is SIGKILLed), once asking for more memory than is free (its refusal). About 3 minutes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.support.engines import REPO
from tests.support.real_vllm import ensure_vllm, tiny_hf_model

FIXTURES = REPO / "tests" / "fixtures" / "vllm"
SERVED = "tiny"
KEY = "recording-key"
START_TIMEOUT_S = 600.0
ROLES = {"VLLM::EngineCore": "EngineCore", "VLLM::Worker": "Worker"}


def start(vllm: Path, model: Path, socket_path: str, share: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "VLLM_API_KEY": KEY, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "NO_COLOR": "1",
           "VLLM_LOGGING_COLOR": "0", "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        return subprocess.Popen([str(vllm), "serve", str(model), "--max-model-len", "1024", "--gpu-memory-utilization",
                                 share, "--host", "127.0.0.1", "--uds", socket_path, "--served-model-name", SERVED],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_for(log: Path, text: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while text not in log.read_text(encoding="utf-8", errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"vLLM did not print {text!r}:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)


def role(process: psutil.Process) -> str:
    title = " ".join(process.cmdline())
    named = [name for mark, name in ROLES.items() if mark in title]
    if named:
        return named[0]
    return "resource_tracker" if "multiprocessing.resource_tracker" in title else "APIServer"


def shape(api: int) -> dict[str, Any]:
    """Each process of the tree by role: its parent's role and whether it shares the API server's group."""
    root = psutil.Process(api)
    members = [root, *root.children(recursive=True)]
    roles = {p.pid: role(p) for p in members}
    return {"processes": sorted(({"role": roles[p.pid], "parent": roles.get(p.ppid()),
                                  "same_group": os.getpgid(p.pid) == os.getpgid(api)} for p in members),
                                key=lambda entry: str(entry["role"])),
            "pids": {name: pid for pid, name in roles.items()}}


def record_serving(vllm: Path, model: Path, folder: Path) -> None:
    socket_path, log = str(folder / "s.sock"), folder / "serve.log"
    server = start(vllm, model, socket_path, "0.1", log)
    try:
        wait_for(log, "Application startup complete.", server)
        client = httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), base_url="http://vllm",
                              headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        models = client.get("/v1/models").json()
        client.post("/v1/chat/completions", json={"model": SERVED, "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "hello"}]}).raise_for_status()
        metrics = client.get("/metrics").text
        found = shape(server.pid)
        os.kill(server.pid, signal.SIGKILL)  # the API server alone, as PR_SET_PDEATHSIG does when the app dies
        server.wait()
        time.sleep(5)
        found["alive_5s_after_the_api_server_was_sigkilled"] = sorted(
            name for name, pid in found.pop("pids").items() if name != "APIServer" and psutil.pid_exists(pid)
            and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    finally:
        with_group_killed(server.pid)
    (FIXTURES / "cpu-0.32-startup.log").write_text(log.read_text(encoding="utf-8", errors="replace"), encoding="utf-8")
    (FIXTURES / "cpu-0.32-models.json").write_text(json.dumps(models, indent=1) + "\n", encoding="utf-8")
    (FIXTURES / "cpu-0.32-metrics.txt").write_text(metrics, encoding="utf-8")
    (FIXTURES / "cpu-0.32-processes.json").write_text(json.dumps(found, indent=1) + "\n", encoding="utf-8")


def record_refusal(vllm: Path, model: Path, folder: Path) -> None:
    """More than is free: vLLM's CPU build refuses at start-up, as on a card a game holds."""
    log = folder / "refuse.log"
    server = start(vllm, model, str(folder / "r.sock"), "0.99", log)
    try:
        status = server.wait(timeout=START_TIMEOUT_S)
    finally:
        with_group_killed(server.pid)
    text = log.read_text(encoding="utf-8", errors="replace")
    if status == 0 or "less than desired CPU memory utilization" not in text:
        raise RuntimeError(f"vLLM did not refuse as expected (exit {status}):\n{text[-3000:]}")
    (FIXTURES / "cpu-0.32-free-memory.log").write_text(text + f"[exit status {status}]\n", encoding="utf-8")


def with_group_killed(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main() -> None:
    vllm, model = ensure_vllm(), tiny_hf_model()
    with tempfile.TemporaryDirectory(prefix="vllm-record-") as folder:
        record_serving(vllm, model, Path(folder))
        record_refusal(vllm, model, Path(folder))
    print(f"recorded into {FIXTURES}")


if __name__ == "__main__":
    main()
