"""Issue 21, memory: nothing a coordinator sends makes llama-server take more RAM or cores than the
machine has. Before, `-c 2097152 -ctk f32 -ctv f32` on a 0.5 MB model took 2.2 GiB at start, and
`-nkvo`, `-cram -1`, `-np 256`, `-t 1024` were all accepted. Now each start is judged, after the
model is provisioned and before any engine starts, by the KV cache the GGUF's own shape gives,
the model and the prompt cache, against the RAM measured free now (or the card), and the threads
against the cores; a start that would not fit is refused with what and by how much.

The machines are recorded ones (`Machine.from_detect_json`) with their RAM or cores changed, and
the free RAM is what `psutil` reports, faked where a test needs less; the model is the tiny GGUF
(2 layers × 4 KV heads × 16: 512 bytes per token in f16, 1,024 in f32). The last test runs the
whole node with the real llama-server.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.integration.test_node import STATE_TIMEOUT_S, processes_mentioning, running_node
from tests.support.engines import LlamaServer
from tests.worker.hardware.recorded import replay
from worker.contract import protocol
from worker.system.config import Paths, Settings
from worker.hardware import Machine
from worker.plan.planner import Plan, Refusal, plan
from worker.provision.assignment import provision
from worker.provision.errors import ProvisionError

MIB = 2**20
BIG_KV = ["-c", "2097152", "-ctk", "f32", "-ctv", "f32"]  # 2,097,152 tokens × 1,024 bytes = 2 GiB


def machine(fixture: str = "no-gpu.json", *, ram_mib: int | None = None, cores: int | None = None,
            runtime: str | None = None) -> Machine:
    """A recorded machine, read back as the node reads a hardware file, with what a test changes."""
    data: dict[str, Any] = copy.deepcopy(replay(fixture).to_detect_json())
    if ram_mib is not None:
        data["hardware"]["ram_mib"] = ram_mib
    if cores is not None:
        data["hardware"]["cpu"]["cores"] = cores
    if runtime is not None:
        data["platform"].update(os=runtime, runtime=runtime)
    return Machine.from_detect_json(data)


def assign(model: Path, args: list[str], tiers: dict[str, list[str]] | None = None,
           assignment_id: str = "mem-1") -> protocol.Assign:
    spec = protocol.EngineModel(source=str(model), weights_mib=1, base_args=args, tiers=tiers or {})
    return protocol.Assign(assignment_id=assignment_id, model=protocol.ModelSpec(name="tiny-llama", llamacpp=spec))


async def provisioned(here: Machine, model: Path, tmp_path: Path, args: list[str],
                      tiers: dict[str, list[str]] | None = None) -> str | None:
    """None when the assignment would start on `here`; else the refusal's reason."""
    planned = plan(here, assign(model, args, tiers), Settings())
    if isinstance(planned, Refusal):
        return planned.reason
    assert isinstance(planned, Plan)
    try:
        engines = await provision(planned, here, Paths.under(tmp_path / "node"), Settings(), lambda *a: None,
                                  engine_bins={"llamacpp": "/opt/llama/llama-server"})
    except ProvisionError as exc:
        assert exc.problem.title == "Assignment refused"
        return exc.problem.message
    assert [e.model for e in engines] == [str(model)]
    return None


@pytest.fixture
def free_ram(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """What `psutil.virtual_memory().available` reports (MiB); unchanged until a test sets it."""
    real = psutil.virtual_memory
    wanted: dict[str, int] = {}

    def measured() -> Any:
        reading = real()
        return reading._replace(available=wanted["mib"] * MIB) if "mib" in wanted else reading

    monkeypatch.setattr(psutil, "virtual_memory", measured)
    return wanted


async def test_the_2_gib_kv_is_refused_on_a_machine_that_cannot_spare_it(tiny_gguf: Path, tmp_path: Path) -> None:
    small = machine(ram_mib=1536)  # 870 MiB to spare: 90 % of it, less the 512 MiB reserve
    reason = await provisioned(small, tiny_gguf, tmp_path, BIG_KV)
    assert reason is not None and reason.startswith("not enough memory (with base_args)")
    assert "2,048 MiB for 2,097,152 tokens of context over 4 slots, stored as f32" in reason
    assert "the RAM this computer can spare now is 870 MiB, 1,179 MiB short" in reason
    assert await provisioned(small, tiny_gguf, tmp_path, ["-c", "1024"]) is None  # a context that fits starts


async def test_the_free_ram_measured_now_is_what_counts(tiny_gguf: Path, tmp_path: Path,
                                                        free_ram: dict[str, int]) -> None:
    """A machine with 24 GiB of RAM of which only 1.5 GiB is free now cannot spare 2 GiB."""
    roomy = machine(ram_mib=24105)
    free_ram["mib"] = 1536
    reason = await provisioned(roomy, tiny_gguf, tmp_path, BIG_KV)
    assert reason is not None and "can spare now is 870 MiB, 1,179 MiB short" in reason
    free_ram["mib"] = 4096
    assert await provisioned(roomy, tiny_gguf, tmp_path, BIG_KV) is None


async def test_ram_the_serving_engine_holds_counts_for_its_replacement(tiny_gguf: Path, tmp_path: Path,
                                                                      free_ram: dict[str, int]) -> None:
    """A replacement is provisioned while the old engine serves, and that engine stops before the
    new one starts: the RAM it holds on its own (here a real child process holding 400 MiB) is
    counted as free, so 512 MiB of KV fits 1,000 MiB free + 400 held (748 usable) but not 1,000 alone."""
    roomy, kv_512_mib = machine(ram_mib=24105), ["-c", "1048576"]
    free_ram["mib"] = 1000
    assert await provisioned(roomy, tiny_gguf, tmp_path, kv_512_mib) is not None
    code = "import sys; held = b'x' * (400 * 2**20); print('up', flush=True); sys.stdin.read()"
    engine = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert engine.stdout is not None and engine.stdout.readline() == b"up\n"
        assert await provisioned(roomy, tiny_gguf, tmp_path, kv_512_mib) is None
    finally:
        engine.kill()
        engine.wait()


async def test_threads_past_the_cpus_logical_cores_are_refused(tiny_gguf: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`-t` counts logical CPUs: 2 cores with 2 threads each take `-t 4`, not `-t 1024`."""
    real = psutil.cpu_count
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 4 if logical else real(logical=False))
    two_cores = machine(cores=2)
    for args, flag in ((["-t", "1024"], "-t"), (["--threads-batch", "1024"], "-tb")):
        reason = await provisioned(two_cores, tiny_gguf, tmp_path, ["-c", "1024", *args])
        assert reason == (f"value not allowed for {flag} (in base_args): 1,024 threads, more than this "
                          "computer's 4 CPU threads")
    assert await provisioned(two_cores, tiny_gguf, tmp_path, ["-c", "1024", "-t", "4", "-tb", "4"]) is None


async def test_an_unbounded_or_oversized_prompt_cache_is_refused(tiny_gguf: Path, tmp_path: Path) -> None:
    small = machine(ram_mib=1536)
    unbounded = await provisioned(small, tiny_gguf, tmp_path, ["-c", "1024", "-cram", "-1"])
    assert unbounded is not None and unbounded.startswith("value not allowed for -cram (in base_args): '-1'")
    oversized = await provisioned(small, tiny_gguf, tmp_path, ["-c", "1024", "--cache-ram", "8192"])
    assert oversized is not None and "8,192 MiB for the prompt cache (-cram)" in oversized
    assert oversized.endswith("ask for a smaller prompt cache (-cram)")
    assert await provisioned(small, tiny_gguf, tmp_path, ["-c", "1024", "-cram", "256"]) is None


async def test_256_slots_count_the_kv_llama_server_gives_each(tiny_gguf: Path, tmp_path: Path) -> None:
    """`-np 256` splits the cache per slot, each padded to 256 cells: `-c 1024` becomes 65,536 cells
    (64 MiB in f32), which 40 MiB to spare cannot hold, though 1,024 shared cells (1 MiB) fit."""
    tight = machine(ram_mib=614)  # 40 MiB to spare
    f32 = ["-ctk", "f32", "-ctv", "f32"]
    reason = await provisioned(tight, tiny_gguf, tmp_path, ["-c", "1024", "-np", "256", *f32])
    assert reason is not None and "64 MiB for 65,536 tokens of context over 256 slots" in reason
    assert await provisioned(tight, tiny_gguf, tmp_path, ["-c", "1024", *f32]) is None
    assert await provisioned(tight, tiny_gguf, tmp_path, ["-c", "1024", "-np", "256", "-kvu", *f32]) is None


async def test_kv_kept_on_the_host_counts_against_ram(tiny_gguf: Path, tmp_path: Path) -> None:
    """On a Windows PC with an RTX 4090 and 2 GiB of RAM, a 2 GiB KV cache fits the card; `-nkvo`
    (or `-ngl 0`) moves it into RAM, which cannot hold it."""
    gaming = machine("rtx4090.json", ram_mib=2048, runtime="windows")
    assert await provisioned(gaming, tiny_gguf, tmp_path, BIG_KV) is None
    for moved in (["-nkvo"], ["--no-kv-offload"], ["-ngl", "0"]):
        reason = await provisioned(gaming, tiny_gguf, tmp_path, [*BIG_KV, *moved])
        assert reason is not None and "the RAM this computer can spare now is 1,331 MiB" in reason, moved


async def test_a_tier_and_its_fallbacks_are_each_judged(tiny_gguf: Path, tmp_path: Path) -> None:
    """The RTX 4090 clears tier 16000, whose context fits; base_args alone, its out-of-memory
    fallback, asks for 2 GiB in RAM: refused before either starts, naming base_args."""
    gaming = machine("rtx4090.json", ram_mib=2048, runtime="windows")
    reason = await provisioned(gaming, tiny_gguf, tmp_path, [*BIG_KV, "-nkvo"], tiers={"16000": ["-c", "1024"]})
    assert reason is not None and reason.startswith("not enough memory (with base_args)")


async def test_a_malformed_model_file_is_a_refusal_not_a_crash(tmp_path: Path) -> None:
    model = tmp_path / "broken.gguf"
    model.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(8) + (2**40).to_bytes(8, "little"))
    reason = await provisioned(machine(), model, tmp_path, ["-c", "1024"])
    assert reason == ("the model file cannot be used: the model file claims 1,099,511,627,776 metadata entries, "
                      "more than 65,536")


@pytest.mark.integration
async def test_the_real_node_refuses_an_oversized_kv_before_llama_server_starts(
    llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path, free_ram: dict[str, int]
) -> None:
    """The whole node, the real llama-server, a CPU machine whose free RAM (1.5 GiB) cannot spare
    2 GiB: the assignment is `failed` with the reason and no engine ever started; a fitting one then
    serves, and the same oversized assignment sent as its replacement is refused, leaving it serving."""
    free_ram["mib"] = 1536
    bins = {"llamacpp": str(llama_server_bin.executable)}
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=assign(tiny_gguf, BIG_KV)) as run:
        failed = await run.status("failed", "ready")
        assert failed.state == "failed" and failed.last_error is not None
        assert failed.last_error.startswith("not enough memory (with base_args)")
        assert "can spare now is 870 MiB, 1,179 MiB short" in failed.last_error
        assert run.engine_pids == set() and processes_mentioning(str(tiny_gguf)) == []
        statuses = [m for m in run.coordinator.received if isinstance(m, protocol.Status)]
        assert all(m.engines == [] for m in statuses)

        mark = run.mark()
        await run.coordinator.send(assign(tiny_gguf, ["-c", "1024", "-t", "1"], assignment_id="mem-2"))
        ready = await run.status("ready", "failed", after=mark)
        assert ready.state == "ready" and ready.assignment_id == "mem-2", ready.last_error
        argv = ready.engines[0].argv
        assert argv[argv.index("-c") + 1] == "1024" and ready.engines[0].kv_cache_tokens == 1024

        [serving] = run.node.snapshot().engines  # an oversized replacement leaves it serving, untouched
        mark = run.mark()
        await run.coordinator.send(assign(tiny_gguf, BIG_KV, assignment_id="mem-3"))
        refused = await run.coordinator.wait_for(
            lambda m: isinstance(m, protocol.Status) and m.refused is not None, after=mark, timeout=STATE_TIMEOUT_S)
        assert refused.refused is not None and refused.refused.assignment_id == "mem-3"
        assert refused.refused.reason.startswith("not enough memory (with base_args)")
        assert refused.state == "ready" and refused.assignment_id == "mem-2"
        assert run.node.snapshot().engines[0].pid == serving.pid and len(run.engine_pids) == 1
