"""A real headless node (`python -m worker run --headless`) against a reference coordinator, for
the security tests: a recorded RTX 4090, engines found on PATH, the token in the environment."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.processes import terminate
from tests.worker.hardware.recorded import replay
from worker.contract import protocol
from worker.link.local import ReferenceCoordinator

REPO = Path(__file__).resolve().parents[2]


def model_folder(root: Path) -> Path:
    """A model folder the vLLM stand-in can "load"."""
    folder = root / "models" / "tiny-1b"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}', encoding="utf-8")
    (folder / "model.safetensors").write_bytes(b"\0" * 4096)
    return folder


def vllm_assignment(source: str, base_args: list[str] | None = None) -> protocol.Assign:
    return protocol.Assign.model_validate({"assignment_id": "sec-1", "model": {"name": "tiny-1b", "vllm": {
        "source": source, "weights_mib": 700, "base_args": base_args or ["--max-model-len", "4096"]}}})


@dataclass
class RunningNode:
    process: asyncio.subprocess.Process
    data_dir: Path
    output: list[str] = field(default_factory=list)

    async def wait_status(self, coordinator: ReferenceCoordinator, *states: str, timeout: float = 60) -> protocol.Status:
        """The first `status` in one of `states`; on a timeout, the node's last lines say why."""
        try:
            return await coordinator.wait_for(
                lambda m: isinstance(m, protocol.Status) and m.state in states, timeout=timeout)
        except TimeoutError:
            seen = [m.state for m in coordinator.received if isinstance(m, protocol.Status)]
            raise AssertionError(f"no status in {states} (saw {seen}); the node printed:\n"
                                 + "".join(self.output[-40:])) from None

    async def wait_ready(self, coordinator: ReferenceCoordinator) -> protocol.Status:
        return await self.wait_status(coordinator, "ready")


@asynccontextmanager
async def headless_node(root: Path, coordinator_url: str, token: str, vllm: Path) -> AsyncIterator[RunningNode]:
    """Starts the node with `vllm` as its vLLM executable; on exit, SIGTERM and wait, with every
    line it printed in `output`."""
    hardware = root / "rtx4090.json"
    hardware.write_text(json.dumps(replay("rtx4090.json").to_detect_json()), encoding="utf-8")
    env = {**os.environ, "GPU_PROVIDER_TOKEN": token, "STANDIN_ENGINE_CORE": "0"}
    data_dir = root / "data"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker", "run", "--headless", "--verbose", "--coordinator", coordinator_url,
        "--hardware", str(hardware), "--data-dir", str(data_dir), "--engine-bin", f"vllm={vllm}",
        cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    running = RunningNode(process, data_dir)

    async def read_output() -> None:
        assert process.stdout is not None
        async for line in process.stdout:
            running.output.append(line.decode("utf-8", "replace"))

    reader = asyncio.create_task(read_output())
    try:
        yield running
    finally:
        await terminate(process)
        await asyncio.wait_for(reader, 10)
