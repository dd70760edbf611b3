"""The whole node on a CPU-only machine with a real llama-server and the tiny GGUF: assign →
ready → a chat completion relayed through the reference coordinator → shutdown leaves nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_node import (
    STATE_TIMEOUT_S,
    processes_mentioning,
    running_node,
)
from tests.support.engines import LlamaServer
from worker.contract import protocol

pytestmark = pytest.mark.integration


def llamacpp_assign(model: Path) -> protocol.Assign:
    spec = protocol.EngineModel(source=str(model), weights_mib=1, base_args=["--ctx-size", "1024", "--threads", "1"])
    return protocol.Assign(assignment_id="cpu-1", model=protocol.ModelSpec(name="tiny-llama", llamacpp=spec))


async def test_cpu_node_serves_the_tiny_model_with_llama_server(
    llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path
) -> None:
    bins = {"llamacpp": str(llama_server_bin.executable)}
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=llamacpp_assign(tiny_gguf)) as run:
        hello = await run.coordinator.wait_for_connections(1, timeout=STATE_TIMEOUT_S)
        assert hello.platform.runtime == "cpu" and hello.hardware.gpus == []
        ready = await run.status("ready", "failed")
        assert ready.state == "ready", ready.last_error
        [engine] = ready.engines
        assert engine.gpu_indices == [] and engine.layout == "single"
        assert engine.argv[0] == str(llama_server_bin.executable) and str(tiny_gguf) in engine.argv
        assert "--api-key" not in engine.argv and engine.argv[engine.argv.index("--host") + 1].endswith("/e0.sock")
        assert engine.max_model_len == 1024 and engine.kv_cache_tokens == 1024 and engine.max_concurrency == 4.0

        whole = await run.ask({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
        assert whole.error is None and whole.head is not None and whole.head.status == 200
        assert whole.end is not None and whole.end.usage is not None and whole.end.usage.completion_tokens >= 1
        assert '"choices"' in whole.data and '"chat.completion"' in whole.data

        streamed = await run.ask({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "stream": True})
        assert streamed.error is None and streamed.head is not None
        assert (streamed.head.content_type or "").startswith("text/event-stream")
        assert streamed.data.rstrip().endswith("data: [DONE]") and '"usage"' not in streamed.data
        assert streamed.end is not None and streamed.end.usage is not None
        assert streamed.end.usage.completion_tokens >= 1
        pids = set(run.engine_pids)
        assert pids and run.live_engine_pids() == list(pids)
    assert run.live_engine_pids() == []
    assert processes_mentioning(str(tiny_gguf)) == []
