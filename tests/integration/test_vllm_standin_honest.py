"""The vLLM stand-in held to what the real vLLM showed (its CPU build, 0.32, recorded into
tests/fixtures/vllm/cpu-0.32-* by tests/support/record_vllm_fixtures.py): where the stand-in
imitates something the CPU build also shows — the shape of its log lines, the facts the app reads
from its start-up and in which order, its memory refusal, /v1/models, the /metrics families and
labels, its process shape — it must match. What only a GPU shows (the `GPU KV cache size` line,
CUDA out of memory, tensor-parallel) keeps its fixtures from engines.md (startup-0.33.log, oom.log)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.support.engines import VLLM_STANDIN
from worker.engines import vllm
from worker.engines.base import FreeMemoryShort, LogFact, PhaseReached

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
KEY = "standin-key"
# `(Name pid=N) LEVEL MM-DD HH:MM:SS [file.py:N] message` (vllm/logger.py)
LINE = re.compile(r"^\((APIServer|EngineCore|Worker) pid=(\d+)\) (DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                  r"\d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+:\d+\] ")
TYPE = re.compile(r"^# TYPE (\S+) (\S+)$")
SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? ")


def kind(fact: LogFact) -> str:
    return f"{type(fact).__name__}({fact.phase})" if isinstance(fact, PhaseReached) else type(fact).__name__


def fact_kinds(lines: list[str]) -> list[str]:
    kinds = [kind(fact) for fact in map(vllm.parse_line, lines) if fact is not None]
    return [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]  # a phase said twice counts once


def is_subsequence(short: list[str], long: list[str]) -> bool:
    remaining = iter(long)
    return all(item in remaining for item in short)


def families(page: str) -> dict[str, tuple[str, set[str]]]:
    """Each metric family: its type and the label names its samples carry (prometheus-client text)."""
    found: dict[str, tuple[str, set[str]]] = {}
    for line in page.splitlines():
        if match := TYPE.match(line):
            found[match.group(1)] = (match.group(2), set())
    for line in page.splitlines():
        if (match := SAMPLE.match(line)) and not line.startswith("#"):
            name = match.group(1)
            family = next((f for f in (name, re.sub(r"_(total|created|bucket|sum|count)$", "", name)) if f in found),
                          None)
            assert family is not None, f"a sample without its # TYPE line: {line}"
            found[family][1].update(re.findall(r'(\w+)="', match.group(2) or ""))
    return found


class Standin:
    """The stand-in serving on a Unix socket, as the app starts it."""

    def __init__(self, folder: Path, env: dict[str, str] | None = None) -> None:
        self.socket = str(folder / "s.sock")
        self.log = folder / "standin.log"
        model = folder / "tiny-llama"
        model.mkdir(exist_ok=True)
        (model / "model.safetensors").write_bytes(b"\0" * 1024)
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [str(VLLM_STANDIN), "serve", str(model), "--max-model-len", "1024", "--gpu-memory-utilization", "0.1",
                 "--host", "127.0.0.1", "--uds", self.socket, "--served-model-name", "tiny"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "VLLM_API_KEY": KEY, **(env or {})})

    def lines(self) -> list[str]:
        return self.log.read_text(encoding="utf-8").splitlines()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while not any("Application startup complete." in line for line in self.lines()):
            assert self.process.poll() is None and time.monotonic() < deadline, "\n".join(self.lines())
            time.sleep(0.05)

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=self.socket), base_url="http://vllm", timeout=30,
                            headers={"Authorization": f"Bearer {KEY}"})

    def kill_group(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


@pytest.fixture
def standin(tmp_path: Path):  # type: ignore[no-untyped-def]
    served = Standin(tmp_path)
    try:
        served.wait_ready()
        yield served
    finally:
        served.kill_group()


def recorded(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def test_log_lines_have_the_real_shape_and_each_process_logs_under_its_own_pid(standin: Standin) -> None:
    real = [m for line in recorded("cpu-0.32-startup.log").splitlines() if (m := LINE.match(line))]
    ours = [m for line in standin.lines() if (m := LINE.match(line))]
    assert real and ours
    prefixed = [line for line in standin.lines() if line.startswith("(")]
    assert len(ours) == len(prefixed), [line for line in prefixed if not LINE.match(line)]
    for lines in (real, ours):
        pids = {m.group(1): int(m.group(2)) for m in lines}
        assert pids["EngineCore"] != pids["APIServer"]  # the engine core is a process of its own


def test_start_up_gives_the_facts_the_real_one_gives_in_the_same_order(standin: Standin) -> None:
    real = fact_kinds(recorded("cpu-0.32-startup.log").splitlines())
    ours = fact_kinds(standin.lines())
    assert {"MaxModelLen", "KvCacheSize", "Listening", "StartupComplete"} <= set(real)
    assert is_subsequence(real, ours), (real, ours)
    assert any("KV cache size" in line and "Maximum concurrency" in line  # one line, as 0.2x and later print it
               for line in recorded("cpu-0.32-startup.log").splitlines())


def test_models_and_metrics_pages_have_the_real_ones_fields_names_types_and_labels(standin: Standin) -> None:
    with standin.client() as client:
        client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "hello"}]})
        ours_models, ours_metrics = client.get("/v1/models").json(), client.get("/metrics").text
    real_models = json.loads(recorded("cpu-0.32-models.json"))
    assert set(ours_models) == set(real_models)
    assert set(ours_models["data"][0]) == set(real_models["data"][0])
    assert ours_models["data"][0]["max_model_len"] == real_models["data"][0]["max_model_len"] == 1024
    real, ours = families(recorded("cpu-0.32-metrics.txt")), families(ours_metrics)
    for name, (kind_, labels) in ours.items():
        assert name in real, f"{name}: the real page has no such family"
        assert real[name][0] == kind_, f"{name}: {kind_}, the real one is a {real[name][0]}"
        assert labels <= real[name][1], f"{name}: labels {sorted(labels - real[name][1])} are not the real one's"
    for quantity in ("kv_usage", "requests_running", "requests_waiting", "generation_tokens", "prompt_tokens"):
        newest = vllm.METRIC_NAMES[quantity][0]  # a counter's declared name; its family may end in _total
        for page in (real, ours):
            assert newest in page or f"{newest}_total" in page, quantity  # what the app reads is on both pages


def test_process_shape_an_engine_core_in_the_group_that_outlives_a_sigkilled_api_server(standin: Standin) -> None:
    real = json.loads(recorded("cpu-0.32-processes.json"))
    real_roles = {entry["role"]: entry for entry in real["processes"]}
    assert real_roles["EngineCore"]["parent"] == "APIServer" and real_roles["EngineCore"]["same_group"]
    assert "EngineCore" in real["alive_5s_after_the_api_server_was_sigkilled"]
    api = psutil.Process(standin.process.pid)
    [core] = api.children()
    assert os.getpgid(core.pid) == os.getpgid(api.pid)
    core_pids = {int(m.group(2)) for line in standin.lines() if (m := LINE.match(line)) and m.group(1) == "EngineCore"}
    assert core_pids == {core.pid}
    api.kill()
    standin.process.wait()
    time.sleep(1)
    assert core.is_running() and core.status() != psutil.STATUS_ZOMBIE  # as the real one: left running


def test_the_memory_refusal_reads_as_the_real_one(tmp_path: Path) -> None:
    real = recorded("cpu-0.32-free-memory.log").splitlines()
    refused = Standin(tmp_path, {"STANDIN_GPU_TOTAL_MIB": "24564", "STANDIN_GPU_FREE_MIB": "1000"})
    try:
        status = refused.process.wait(timeout=30)
    finally:
        refused.kill_group()
    ours = refused.lines()
    for lines, exit_status in ((real, int(real[-1].removeprefix("[exit status ").rstrip("]"))), (ours, status)):
        facts = [fact for fact in map(vllm.parse_line, lines) if fact is not None]
        assert any(isinstance(fact, FreeMemoryShort) for fact in facts)
        assert any("Engine core initialization failed. See root cause above." in line for line in lines)
        assert exit_status == 1
