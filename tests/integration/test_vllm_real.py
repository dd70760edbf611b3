"""The real vLLM (its CPU build, installed once per machine) through the app's own path:
`gpu-provider run --headless --engine-bin vllm=PATH` on this CPU-only machine, assigned a local
Hugging Face folder in a vLLM-only block by the reference coordinator. One engine start (about 40 s
on 2 cores) is shared by the module, in order: ready gated on a real completion,
the KV budget from vLLM's own `CPU KV cache size` line, the context from /v1/models, relayed plain
and streamed requests with usage, /metrics figures, the EngineCore killed and the engine restarted,
then unassign, quit and a SIGKILLed app, each leaving no process of vLLM's tree behind; last, an
assignment with no memory cap of its own, served with the share of RAM the app measured.

A test here that cannot have the real vLLM fails with the reason; it never skips.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import pytest_asyncio

from tests.support.real_vllm import ensure_vllm, tiny_hf_model
from worker.contract import protocol
from worker.system.config import Paths, Settings, save_settings
from worker.link.local import ReferenceCoordinator

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

GPU_PROVIDER = Path(sys.executable).with_name("gpu-provider")
TOKEN = "real-vllm-test-token"
PRICE = protocol.Price(currency="USD", per_million_output_tokens=2.5, per_million_input_tokens=0.5)
START_TIMEOUT_S = 480.0  # ~90 s on 2 idle cores; much more while other work shares them
GONE_TIMEOUT_S = 20.0
MAX_MODEL_LEN = 1024
# A cap on the share of RAM: the machine is shared, and the measured share could be most of it.
# Eager: no torch.compile warm-up, which doubles a start here (about 40 s instead of 80).
BASE_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--gpu-memory-utilization", "0.1", "--enforce-eager"]
CHAT = {"messages": [{"role": "user", "content": "Count: one two three"}], "max_tokens": 6, "temperature": 0}
KV_LINE = re.compile(r"CPU KV cache size: ([\d,]+) tokens")


def assignment(model: Path, assignment_id: str, base_args: list[str] = BASE_ARGS) -> protocol.Assign:
    spec = protocol.EngineModel(source=str(model), weights_mib=2, base_args=base_args, tiers={})
    return protocol.Assign(assignment_id=assignment_id, model=protocol.ModelSpec(name="tiny-llama", vllm=spec))


@dataclass
class Agent:
    """One `gpu-provider run --headless` process and the vLLM process trees it was seen running."""

    process: subprocess.Popen[bytes]
    data_dir: Path
    output: Path
    trees: list[list[int]] = field(default_factory=list)

    def status(self) -> dict[str, Any] | None:
        shown = subprocess.run([str(GPU_PROVIDER), "status", "--json", "--data-dir", str(self.data_dir)],
                               capture_output=True, text=True, timeout=60, check=False)
        return json.loads(shown.stdout) if shown.returncode == 0 else None

    def engine(self) -> dict[str, Any] | None:
        found = self.status()
        engines = found["snapshot"]["engines"] if found else []
        return engines[0] if engines else None

    def tail(self) -> str:
        return self.output.read_text(encoding="utf-8", errors="replace")[-4000:]

    def engine_log(self) -> str:
        engine = self.engine()
        assert engine is not None and engine["log_path"], "no engine log"
        return Path(engine["log_path"]).read_text(encoding="utf-8", errors="replace")


@dataclass
class Served:
    coordinator: ReferenceCoordinator
    agents: list[Agent]  # every app this module started; the last is the one running now
    model: Path
    vllm: Path
    root: Path

    @property
    def agent(self) -> Agent:
        return self.agents[-1]

    async def wait_for(self, check: Callable[[], Any], what: str, timeout: float = START_TIMEOUT_S) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.agent.process.poll() is None, f"the app exited while waiting for {what}:\n{self.agent.tail()}"
            found = await asyncio.to_thread(check)
            if found:
                return found
            await asyncio.sleep(0.5)
        raise AssertionError(f"not {what} within {timeout:.0f} s:\n{self.agent.tail()}")

    async def engine_in(self, *states: str, timeout: float = START_TIMEOUT_S) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            engine = self.agent.engine()
            return engine if engine is not None and engine["state"] in states else None

        found: dict[str, Any] = await self.wait_for(check, f"an engine {'/'.join(states)}", timeout)
        return found

    async def tree_with_worker(self) -> list[int]:
        """The engine's whole process tree once vLLM's Worker is in it (API server → EngineCore → Worker)."""
        def check() -> list[int] | None:
            engine = self.agent.engine()
            tree = vllm_tree(engine["pid"]) if engine and engine["pid"] else []
            return tree if any("VLLM::Worker" in title for title in map(process_title, tree)) else None

        tree: list[int] = await self.wait_for(check, "vLLM's Worker process")
        self.agent.trees.append(tree)
        return tree


def process_title(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def vllm_tree(pid: int) -> list[int]:
    """The API server and every process under it (vLLM renames EngineCore and Worker: `VLLM::…`)."""
    try:
        root = psutil.Process(pid)
        return [root.pid, *(child.pid for child in root.children(recursive=True))]
    except psutil.Error:
        return []


def alive(pids: list[int]) -> list[str]:
    left = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {' '.join(process.cmdline())[:80]}")
        except psutil.Error:
            pass
    return left


async def all_gone(pids: list[int], timeout: float = GONE_TIMEOUT_S) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := alive(pids)) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return left


def start_agent(root: Path, name: str, coordinator: ReferenceCoordinator, vllm: Path) -> Agent:
    data_dir, output = root / name, root / f"{name}.out"
    env = {**os.environ, "GPU_PROVIDER_TOKEN": TOKEN}
    with open(output, "wb") as out:
        process = subprocess.Popen(
            [str(GPU_PROVIDER), "run", "--headless", "--data-dir", str(data_dir), "--coordinator", coordinator.url,
             "--engine-bin", f"vllm={vllm}"],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    return Agent(process, data_dir, output)


async def stop_agent(agent: Agent) -> None:
    if agent.process.poll() is None:
        agent.process.kill()
        await asyncio.to_thread(agent.process.wait)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    vllm = await asyncio.to_thread(ensure_vllm)
    model = await asyncio.to_thread(tiny_hf_model)
    root = tmp_path_factory.mktemp("real-vllm")
    coordinator = ReferenceCoordinator(token=TOKEN, heartbeat_s=1.0, price=PRICE, assign=assignment(model, "a-1"))
    await coordinator.start()
    served = Served(coordinator, [start_agent(root, "node", coordinator, vllm)], model, vllm, root)
    try:
        yield served
    finally:
        for agent in served.agents:
            await stop_agent(agent)
        await coordinator.stop()
        trees = [pid for agent in served.agents for tree in agent.trees for pid in tree]
        assert await all_gone(trees) == [], "vLLM processes outlived the test"


async def test_detect_reports_the_cpu_build_and_the_plan_runs_it_over_ram(served: Served) -> None:
    detected = subprocess.run([str(GPU_PROVIDER), "detect", "--engine-bin", f"vllm={served.vllm}"],
                              capture_output=True, text=True, timeout=120, check=True)
    machine = json.loads(detected.stdout)
    assert machine["platform"]["runtime"] == "cpu" and machine["engines"]["vllm"] == "0.32.0+cpu"
    engine = await served.engine_in("starting", "ready")
    assert engine["engine"] == "vllm" and engine["gpu_indices"] == [] and engine["argv"][0] == str(served.vllm)
    assert engine["argv"][engine["argv"].index("--gpu-memory-utilization") + 1] == "0.1"


async def test_ready_after_a_real_completion_with_kv_from_its_line_and_context_from_models(served: Served) -> None:
    engine = await served.engine_in("ready")
    log = served.agent.engine_log()
    assert "POST /v1/completions HTTP/1.1\" 200" in log  # the readiness probe: a real completion
    [kv_tokens] = KV_LINE.findall(log)
    assert engine["kv_cache_tokens"] == int(kv_tokens.replace(",", "")) > 0
    assert engine["context"]["declared"] == MAX_MODEL_LEN  # /v1/models' max_model_len
    await served.tree_with_worker()


async def test_relayed_plain_and_streamed_requests_carry_usage(served: Served) -> None:
    await served.engine_in("ready")
    plain = await (await served.coordinator.request(CHAT)).collect(timeout=120)
    assert plain.head is not None and plain.head.status == 200, plain.data
    body = json.loads(plain.data)
    assert body["model"] == "tiny-llama" and body["usage"]["completion_tokens"] == 6
    assert plain.end is not None and plain.end.usage is not None and plain.end.usage.completion_tokens == 6

    streamed = await (await served.coordinator.request({**CHAT, "stream": True})).collect(timeout=120)
    assert streamed.head is not None and streamed.head.status == 200, streamed.data
    # Streamed as events (one per token and more); how many relay chunks carry them is up to the
    # socket reads, which a busy machine joins into one.
    assert streamed.data.rstrip().endswith("data: [DONE]") and streamed.data.count("data: ") > 6
    assert streamed.end is not None and streamed.end.usage is not None
    assert streamed.end.usage.completion_tokens == 6 and streamed.end.usage.prompt_tokens > 0


async def test_metrics_figures_are_read_from_the_real_page(served: Served) -> None:
    await served.engine_in("ready")

    def metered() -> dict[str, Any] | None:
        found = served.agent.status()
        engine = found["snapshot"]["engines"][0] if found else None
        return engine if engine and engine["kv_usage_pct"] is not None and engine["requests_running"] == 0 else None

    engine = await served.wait_for(metered, "/metrics figures", timeout=120)
    assert 0.0 <= engine["kv_usage_pct"] <= 100.0 and engine["requests_waiting"] == 0


async def test_engine_core_killed_the_app_sees_it_die_and_restarts_the_engine(served: Served) -> None:
    before = await served.engine_in("ready")
    tree = await served.tree_with_worker()
    [core] = [pid for pid in tree if "VLLM::EngineCore" in process_title(pid)]
    os.kill(core, signal.SIGKILL)
    assert await all_gone(tree, timeout=120) == [], "the old engine's processes outlived its restart"

    def restarted() -> dict[str, Any] | None:  # not the last "ready" the status file still held
        engine = served.agent.engine()
        return engine if engine and engine["state"] == "ready" and engine["restarts"] > before["restarts"] else None

    after = await served.wait_for(restarted, "the engine restarted and ready")
    assert after["restarts"] == before["restarts"] + 1 and after["pid"] != before["pid"]
    await served.tree_with_worker()


async def test_unassign_leaves_no_process_of_the_tree(served: Served) -> None:
    await served.engine_in("ready")
    tree = await served.tree_with_worker()
    await served.coordinator.send(protocol.Unassign(assignment_id="a-1"))
    assert await all_gone(tree) == []
    await served.wait_for(lambda: (s := served.agent.status()) and not s["snapshot"]["engines"], "no engine")


async def test_quit_leaves_no_process_of_the_tree(served: Served) -> None:
    await served.coordinator.send(assignment(served.model, "a-2"))
    tree = await served.tree_with_worker()  # quitting mid-start: the whole tree is there already
    served.agent.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(served.agent.process.wait, 120) == 0, served.agent.tail()
    assert await all_gone(tree) == []


async def test_a_sigkilled_app_leaves_no_process_of_the_tree(served: Served) -> None:
    served.agents.append(start_agent(served.root, "node-2", served.coordinator, served.vllm))  # sent a-1 on connecting
    tree = await served.tree_with_worker()
    served.agent.process.kill()
    assert await all_gone(tree) == []


async def test_an_assignment_without_a_memory_cap_serves_with_the_share_of_ram_measured(served: Served) -> None:
    """No `--gpu-memory-utilization` in the assignment: vLLM is told the share of RAM the app measured
    as usable (its own default, 0.92, refuses wherever other programs hold RAM). This person's
    settings lend a tenth of the RAM free, so the test takes little of a shared machine."""
    paths = Paths.under(served.root / "node-3").ensure()
    save_settings(paths, Settings(gpu_memory_utilization=0.1, memory_reserve_mib=0, setup_complete=True))
    served.coordinator.assign = assignment(served.model, "a-3", ["--max-model-len", str(MAX_MODEL_LEN),
                                                                 "--enforce-eager"])
    served.agents.append(start_agent(served.root, "node-3", served.coordinator, served.vllm))
    engine = await served.engine_in("ready")
    share = float(engine["argv"][engine["argv"].index("--gpu-memory-utilization") + 1])
    assert 0.001 <= share < 0.1  # a tenth of what is free, of all the node's RAM
    assert f"desired CPU memory utilization ({share}" not in served.agent.engine_log()  # never refused
    await served.tree_with_worker()
    plain = await (await served.coordinator.request(CHAT)).collect(timeout=120)
    assert plain.head is not None and plain.head.status == 200, plain.data
    assert json.loads(plain.data)["usage"]["completion_tokens"] == 6
