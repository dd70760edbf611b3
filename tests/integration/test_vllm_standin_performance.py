"""The vLLM stand-in's performance model (tests/standin/performance.py, stepper.py): its figures are
the field notes' (000, 004), and the running stand-in shows each trap the auto-tuner must survive:
graphs against eager, MTP acceptance by prompt class, the prefill chunk that turns the drafter's
CUDA graph off once two requests decode together (decode collapses, acceptance still healthy), and
a CUDA graph capture size that truncates (larger batches run eager)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest

from tests.standin.args import parse_serve
from tests.standin.behaviour import Behaviour
from tests.standin.performance import Capture, Performance, capture, prompt_class, tokens_per_pass
from tests.standin.startup import startup
from tests.support.engines import VLLM_STANDIN, free_port

pytestmark = pytest.mark.integration

SCALE = 10.0
RTX_5090_MIB = "32607"
MTP3 = ["--speculative-config", '{"method":"mtp","num_speculative_tokens":3}']
DSPARK3 = ["--speculative-config", '{"method":"dspark","num_speculative_tokens":3}']
CHAT = "Give me three tips for keeping houseplants alive in winter."
SPEC_LINE = re.compile(r"SpecDecoding metrics: .* Avg Draft acceptance rate: ([\d.]+)%")


def perf(*flags: str, total_mib: str = RTX_5090_MIB) -> Performance:
    behaviour = Behaviour.from_env({"STANDIN_PERF_SCALE": "1", "STANDIN_GPU_TOTAL_MIB": total_mib})
    model = Performance.of(parse_serve(["serve", "m", "--host", "127.0.0.1", *flags], env={}), behaviour)
    assert model is not None
    return model


def decode_tok_s(model: Performance, klass: str = "chat", decoding: int = 1, drafter_graph: bool = True) -> float:
    """One request's decode speed in a batch of `decoding`, from the model alone."""
    per_pass = tokens_per_pass(model.drafts, klass) if model.drafts else 1.0  # type: ignore[arg-type]
    return per_pass / model.step_seconds(decoding, 0, drafter_graph)


# --- the model's figures are the notes' ---

def test_graphs_against_eager_are_note_000s_figures() -> None:
    assert decode_tok_s(perf("--enforce-eager")) == pytest.approx(6.4)
    assert decode_tok_s(perf()) == pytest.approx(61)
    assert decode_tok_s(perf("-cc", '{"cudagraph_mode": "NONE"}')) == pytest.approx(6.4)


def test_mtp_yield_and_acceptance_by_prompt_class() -> None:
    model = perf(*MTP3)
    assert decode_tok_s(model) == pytest.approx(94.7, rel=0.01)  # note 000: 35 passes × 2.7
    assert (tokens_per_pass(3, "chat") - 1) / 3 == pytest.approx(0.56, abs=0.01)  # 56 % on real prompts
    assert tokens_per_pass(3, "count") == pytest.approx(3.96, abs=0.05)  # "count from 1 to 120"
    assert tokens_per_pass(3, "long") < tokens_per_pass(3, "chat") < tokens_per_pass(3, "code")
    four = perf("--speculative-config", '{"method":"mtp","num_speculative_tokens":4}')
    assert decode_tok_s(four) / decode_tok_s(model) == pytest.approx(1.068, abs=0.003)  # note 004: 3 → 4 drafts


def test_prompt_classes() -> None:
    assert prompt_class("Count from 1 to 120.", 6) == "count"
    assert prompt_class("Fix this code: def f(x): return x", 8) == "code"
    assert prompt_class("word " * 600, 600) == "long"
    assert prompt_class(CHAT, 10) == "chat"


def test_the_drafter_trap_is_note_004s_collapse_at_two_requests_and_the_big_chunk_only() -> None:
    big = perf(*MTP3, "--max-num-batched-tokens", "8192")
    assert decode_tok_s(big, drafter_graph=True) / decode_tok_s(big, drafter_graph=False) == pytest.approx(109 / 19)
    assert not big.drafter_graph_breaks(1) and big.drafter_graph_breaks(2)
    assert not perf(*MTP3, "--max-num-batched-tokens", "2048").drafter_graph_breaks(4)
    assert not perf("--max-num-batched-tokens", "8192").drafter_graph_breaks(4)  # no drafter
    assert not perf(*MTP3, "--max-num-batched-tokens", "8192", "--enforce-eager").drafter_graph_breaks(4)


def test_vllms_defaults_for_the_chunk_and_the_largest_captured_batch() -> None:
    assert perf().chunk == 2048 and perf(total_mib="81559").chunk == 8192  # get_batch_defaults
    assert perf().max_capture == 512
    assert perf("--max-num-seqs", "4").max_capture == 8  # min(max_num_seqs × 2, 512)
    assert perf("--max-num-seqs", "4", *MTP3).max_capture == 32  # × (1 + drafts)
    assert perf("--max-num-batched-tokens", "256").max_capture == 256
    assert perf(total_mib="81559").max_num_seqs == 1024 and perf().max_num_seqs == 256
    small = perf("--max-cudagraph-capture-size", "2")
    assert small.on_graph(2) and not small.on_graph(4)
    assert decode_tok_s(small, decoding=4) == pytest.approx(6.4 / (1 + 3 * 0.04))


def test_a_capture_size_off_vllms_list_is_cut_with_vllms_warning() -> None:
    assert capture(12, 256, 0, 2048) == Capture(8, 12)  # sizes 1, 2, 4, 8
    assert capture(300, 256, 0, 2048) == Capture(288, 300)  # … 256, 272, 288
    assert capture(264, 256, 0, 2048) == Capture(256, 264)  # between two sizes: the one below
    assert capture(16, 256, 0, 2048) == Capture(16, None)
    assert capture(4096, 256, 0, 2048) == Capture(2048, 4096)  # never above the step's token budget
    behaviour = Behaviour.from_env({"STANDIN_GPU_TOTAL_MIB": RTX_5090_MIB})

    def lines(*flags: str) -> str:
        args = parse_serve(["serve", "m", "--host", "127.0.0.1", *flags], env={})
        return "\n".join(text for _, text in startup(args, behaviour).lines)

    assert re.search(r"\) WARNING .* \[vllm\.py:2521\] Truncating max_cudagraph_capture_size to 8$",
                     lines("--max-cudagraph-capture-size", "12"), re.MULTILINE)
    assert "Truncating" not in lines("--max-cudagraph-capture-size", "16")
    assert "Truncating" not in lines("--max-cudagraph-capture-size", "12", "--enforce-eager")  # no graphs at all


def test_off_unless_asked() -> None:
    assert Performance.of(parse_serve(["serve", "m", "--host", "127.0.0.1"], env={}), Behaviour.from_env({})) is None
    with pytest.raises(ValueError, match="STANDIN_PERF_SCALE"):
        Behaviour.from_env({"STANDIN_PERF_SCALE": "0"})


# --- the running stand-in paces its tokens by the model ---

@dataclass(frozen=True)
class Done:
    tokens: int
    decode_tok_s: float  # in the notes' time (the stand-in's divided by SCALE)


@dataclass
class Running:
    port: int
    process: subprocess.Popen[str]

    async def requests(self, prompt: str, concurrent: int, max_tokens: int) -> list[Done]:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}", timeout=60, trust_env=False) as http:
            return list(await asyncio.gather(*(_one(http, prompt, max_tokens) for _ in range(concurrent))))

    def stop(self) -> str:
        self.process.send_signal(signal.SIGTERM)
        return self.process.communicate(timeout=20)[0]


async def _one(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> Done:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    first = last = 0.0
    tokens = 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if any(c["delta"].get("content") for c in event["choices"]):
                last = time.monotonic()
                first = first or last
    return Done(tokens, (tokens - 1) / (last - first) / SCALE)


@asynccontextmanager
async def standin(*flags: str, **env: str) -> AsyncIterator[Running]:
    port = free_port()
    environment = {**os.environ, "STANDIN_PERF_SCALE": str(SCALE), "STANDIN_GPU_TOTAL_MIB": RTX_5090_MIB,
                   "STANDIN_ENGINE_CORE": "0", **env}
    process = subprocess.Popen([str(VLLM_STANDIN), "serve", "m", "--host", "127.0.0.1", "--port", str(port), *flags],
                               env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    running = Running(port, process)
    try:
        async with httpx.AsyncClient(trust_env=False) as http:
            for _ in range(200):
                try:
                    if (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    await asyncio.sleep(0.05)
        yield running
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def median(done: Sequence[Done]) -> float:
    speeds = sorted(d.decode_tok_s for d in done)
    return speeds[len(speeds) // 2]


async def test_the_running_stand_in_decodes_ten_times_faster_on_graphs() -> None:
    async with standin("--enforce-eager") as eager:
        slow = median(await eager.requests(CHAT, 1, 24))
    async with standin() as graphs:
        fast = median(await graphs.requests(CHAT, 1, 96))
    assert 5.0 <= slow <= 7.5
    assert fast / slow >= 6  # 9.5 by the model; a busy test machine only slows the faster one


async def test_mtp_acceptance_follows_the_prompt_class() -> None:
    async with standin(*MTP3) as mtp:
        chat = median(await mtp.requests(CHAT, 1, 160))
        counting = median(await mtp.requests("Count from 1 to 120.", 1, 160))
    assert counting / chat == pytest.approx(tokens_per_pass(3, "count") / tokens_per_pass(3, "chat"), rel=0.2)


async def test_a_big_prefill_chunk_turns_dsparks_drafter_graph_off_at_two_requests_with_vllms_line() -> None:
    async with standin(*DSPARK3, "--max-num-batched-tokens", "2048") as small:
        healthy = median(await small.requests(CHAT, 2, 160))
        small_log = small.stop()
    async with standin(*DSPARK3, "--max-num-batched-tokens", "8192", VLLM_LOG_STATS_INTERVAL="0.5") as big:
        alone = median(await big.requests(CHAT, 1, 160))
        trapped = median(await big.requests(CHAT, 2, 48))
        again = median(await big.requests(CHAT, 1, 48))
        log = big.stop()
    assert alone / trapped >= 3 and healthy / trapped >= 3  # 109 → 19 by the model
    assert again < alone / 3  # the wrapper stays disabled, as vLLM's does
    assert "Disabling DSpark draft forward CUDA graph after capture failure" in log
    assert "Disabling DSpark" not in small_log
    rates = [float(m.group(1)) for m in SPEC_LINE.finditer(log)]
    assert rates and min(rates) >= 50  # acceptance still looks healthy


async def test_the_same_chunk_with_mtp_collapses_decode_without_a_line() -> None:
    async with standin(*MTP3, "--max-num-batched-tokens", "8192") as big:
        alone = median(await big.requests(CHAT, 1, 160))
        trapped = median(await big.requests(CHAT, 2, 48))
        log = big.stop()
    assert alone / trapped >= 3
    assert "Disabling" not in log and "CUDA graph" not in log.split("Starting vLLM server")[-1]


async def test_a_capture_size_that_truncates_runs_bigger_batches_eager() -> None:
    async with standin("--max-cudagraph-capture-size", "2") as truncated:
        two = median(await truncated.requests(CHAT, 2, 96))
        four = median(await truncated.requests(CHAT, 4, 24))
    async with standin() as default:
        four_default = median(await default.requests(CHAT, 4, 96))
    assert two / four >= 4 and four_default / four >= 4  # 9.5 by the model
