"""Hostile assignments: every one refused, 100 %, before any process starts, each with a clear reason.

The figure: of N hostile assignments (flags the app owns, in every spelling the engine's parser
accepts; code execution; shell metacharacters, newlines and NUL; sources with `..`, `file://` or
plain `http://`), N are refused by `worker.plan.plan` and N by the `gpu-provider plan` command
(exit 2, `{"error": …}`), for vLLM on a native RTX 4090 and llama.cpp on a CPU-only machine.
`plan` is pure, so a refusal there is a refusal before any engine process exists; the last test
sends hostile assignments to a real running node whose engine executable records any start.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.security.node_process import headless_node
from tests.worker.hardware.recorded import replay
from worker import protocol
from worker.config import Settings
from worker.hardware import Machine
from worker.localnet import ReferenceCoordinator
from worker.plan import Plan, Refusal, plan

SAFE_VLLM_ARGS = ["--max-model-len", "8192"]
SAFE_LLAMACPP_ARGS = ["--ctx-size", "4096"]
VLLM_SOURCE = "org/Tiny-1B"
LLAMACPP_SOURCE = "https://example.org/tiny-1b-Q4_K_M.gguf"
MACHINES = {"vllm": "rtx4090.json", "llamacpp": "no-gpu.json"}
ENGINES: tuple[protocol.EngineName, ...] = ("vllm", "llamacpp")


@dataclass(frozen=True)
class Hostile:
    """One hostile assignment: `args` replace the safe ones (in base_args or a tier), or `source`
    replaces the safe source; `names` is what the refusal must mention so a person knows why."""

    engine: protocol.EngineName
    label: str
    args: tuple[str, ...] = ()
    source: str | None = None
    names: tuple[str, ...] = ()

    def assignment(self, where: str = "base_args") -> protocol.Assign:
        safe = SAFE_VLLM_ARGS if self.engine == "vllm" else SAFE_LLAMACPP_ARGS
        default_source = VLLM_SOURCE if self.engine == "vllm" else LLAMACPP_SOURCE
        spec: dict[str, Any] = {"source": self.source or default_source, "weights_mib": 700, "base_args": safe}
        if self.args and where == "base_args":
            spec["base_args"] = safe + list(self.args)
        elif self.args:
            spec["tiers"] = {"1000": list(self.args)}
        return protocol.Assign.model_validate(
            {"assignment_id": "hostile-1", "model": {"name": "tiny-1b", self.engine: spec}})


def _flag_cases(engine: protocol.EngineName, spellings: dict[str, list[list[str]]]) -> list[Hostile]:
    return [
        Hostile(engine, f"{engine}: {' '.join(args)!r}", tuple(args), names=(args[0].split("=", 1)[0],))
        for spelled in spellings.values() for args in spelled
    ]


# vLLM parses with argparse: `--flag=value`, `--flag_with_underscores`, and any unambiguous prefix.
VLLM_FLAGS = {
    "host": [["--host", "0.0.0.0"], ["--host=0.0.0.0"], ["--host", "::"], ["--hos", "0.0.0.0"],
             ["--ho=0.0.0.0"], ["--host=", "0.0.0.0"]],
    "port": [["--port", "80"], ["--port=8000"], ["--por", "80"], ["--po=80"]],
    "api-key": [["--api-key", "known"], ["--api-key=known"], ["--api_key", "known"], ["--api-k", "known"]],
    "served-model-name": [["--served-model-name", "other"], ["--served-model-name=other"],
                          ["--served_model_name", "other"], ["--served-model", "other"]],
    "tensor-parallel": [["--tensor-parallel-size", "8"], ["-tp", "8"]],
    "trust-remote-code": [["--trust-remote-code"], ["--trust_remote_code"], ["--trust-remote"],
                          ["--trust-remote-code=True"]],
    "plugins": [["--worker-cls", "evil.Worker"], ["--middleware", "evil.mw"]],
    "listeners": [["--uds", "/tmp/sock"], ["--config", "/tmp/options.yaml"], ["--model", "other/repo"]],
}
LLAMACPP_FLAGS = {
    "host": [["--host", "0.0.0.0"], ["--host=0.0.0.0"]],
    "port": [["--port", "80"], ["--port=8000"]],
    "api-key": [["--api-key", "known"], ["--api-key=known"], ["--api-key-file", "/tmp/k"]],
    "served name": [["--alias", "other"], ["-a", "other"]],
    "other models": [["-m", "/tmp/other.gguf"], ["--hf-repo", "org/x"], ["--model-url", "https://x/y.gguf"]],
    "tools": [["--tools", "all"], ["--mcp-servers-config", "/tmp/mcp.json"]],
}
TEXT_CASES = [
    ("shell ;", "8192; rm -rf ~"), ("shell &&", "8192 && curl x"), ("shell |", "8192|sh"),
    ("shell $()", "$(id)"), ("shell backticks", "`id`"), ("shell >", ">/etc/passwd"), ("shell <", "</etc/shadow"),
    ("newline", "8192\n--host=0.0.0.0"), ("carriage return", "8192\r--host"), ("NUL", "8192\x00"),
    ("tab", "8192\t--host"), ("env assignment", "LD_PRELOAD=/tmp/evil.so"),
]
SOURCE_CASES = {
    "vllm": [("..", "org/../etc"), ("..", "/models/../etc/passwd"), ("file://", "file:///etc/passwd"),
             ("http://", "http://example.org/org/model"), ("ftp://", "ftp://example.org/m")],
    "llamacpp": [("..", "/models/../../etc/passwd.gguf"), ("..", "https://example.org/a/../b.gguf"),
                 ("file://", "file:///home/u/model.gguf"), ("http://", "http://example.org/tiny-1b-Q4_K_M.gguf")],
}


def hostile_cases() -> list[Hostile]:
    cases = _flag_cases("vllm", VLLM_FLAGS) + _flag_cases("llamacpp", LLAMACPP_FLAGS)
    safe_flag = {"vllm": "--max-model-len", "llamacpp": "--ctx-size"}
    for engine in ENGINES:
        cases += [Hostile(engine, f"{engine}: {label}", (safe_flag[engine], text), names=(repr(text)[1:-1][:6],))
                  for label, text in TEXT_CASES]
        cases += [Hostile(engine, f"{engine}: source {why}", source=source, names=(source,))
                  for why, source in SOURCE_CASES[engine]]
    return cases


CASES = hostile_cases()


def cli_cases() -> list[Hostile]:
    """One case per kind (each flag group's first spelling, two kinds of text, every source): each
    CLI run is a Python start-up, and the spellings are already proven through `plan` above."""
    firsts = [cases[0] for flags in (VLLM_FLAGS, LLAMACPP_FLAGS) for cases in flags.values()]
    picked = {" ".join(args) for args in firsts}
    text = {"8192; rm -rf ~", "8192\n--host=0.0.0.0"}
    return [case for case in CASES
            if case.source or " ".join(case.args) in picked or (len(case.args) == 2 and case.args[1] in text)]


@pytest.fixture(scope="module")
def machines() -> dict[str, Machine]:
    return {engine: replay(name) for engine, name in MACHINES.items()}


def _plan_refusal(machines: dict[str, Machine], case: Hostile, where: str) -> Refusal | Plan:
    return plan(machines[case.engine], case.assignment(where), Settings())


def _mentions(reason: str, case: Hostile) -> bool:
    return all(name.lower() in reason.lower() for name in case.names)


def test_the_safe_assignments_are_planned(machines: dict[str, Machine]) -> None:
    """The control: without the hostile part, each engine's assignment is accepted."""
    for engine in ENGINES:
        result = plan(machines[engine], Hostile(engine, "safe").assignment(), Settings())
        assert isinstance(result, Plan) and result.engine == engine, result


def test_every_hostile_assignment_is_refused_by_plan_with_a_reason(machines: dict[str, Machine]) -> None:
    """Figure: refused / hostile = 100 %, in base_args and in a tier, each reason naming the culprit."""
    attempts, refused, unclear = 0, 0, []
    for case in CASES:
        for where in ("base_args", "tier") if case.args else ("base_args",):
            attempts += 1
            result = _plan_refusal(machines, case, where)
            if isinstance(result, Refusal):
                refused += 1
                if not _mentions(result.reason, case):
                    unclear.append((case.label, where, result.reason))
    print(f"\nhostile assignments refused by plan: {refused}/{attempts} = {refused / attempts:.0%}")
    assert attempts >= 100
    assert refused == attempts, [c.label for c in CASES if not isinstance(_plan_refusal(machines, c, "base_args"), Refusal)]
    assert unclear == []


def test_app_owned_flags_allowed_in_settings_still_end_on_loopback(machines: dict[str, Machine]) -> None:
    """Even where the person allowed app-owned arguments, the app's `--host 127.0.0.1` comes last
    (engines take the last occurrence), so the engine never listens beyond this computer."""
    settings = Settings(allow_app_owned_args=True)
    for engine in ENGINES:
        result = plan(machines[engine], Hostile(engine, "host", ("--host", "0.0.0.0")).assignment(), settings)
        assert isinstance(result, Plan), result
        argv = result.engines[0].argv("key")
        last_host = max(i for i, arg in enumerate(argv) if arg == "--host")
        assert argv[last_host + 1] == "127.0.0.1"


async def _cli_plan(hardware: Path, assignment: Path) -> tuple[int, bytes]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker", "plan", "--hardware", str(hardware), "--assignment", str(assignment),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )
    out, _ = await process.communicate()
    return process.returncode or 0, out


@pytest.mark.integration
async def test_every_hostile_assignment_is_refused_by_the_plan_command(
    machines: dict[str, Machine], tmp_path: Path
) -> None:
    """Figure: `gpu-provider plan` exits 2 with {"error": reason} for 100 % of the cases tried."""
    hardware = {}
    for engine, machine in machines.items():
        hardware[engine] = tmp_path / f"{engine}-machine.json"
        hardware[engine].write_text(json.dumps(machine.to_detect_json()), encoding="utf-8")
    files = []
    for number, case in enumerate(cli_cases()):
        path = tmp_path / f"assign-{number}.json"
        path.write_text(case.assignment().model_dump_json(), encoding="utf-8")
        files.append((case, path))
    limit = asyncio.Semaphore(4)

    async def run(case: Hostile, path: Path) -> tuple[Hostile, int, bytes]:
        async with limit:
            return (case, *await _cli_plan(hardware[case.engine], path))

    results = await asyncio.gather(*(run(case, path) for case, path in files))
    refused = [case for case, code, out in results
               if code == 2 and _mentions(json.loads(out)["error"], case)]
    print(f"\nhostile assignments refused by `gpu-provider plan`: {len(refused)}/{len(results)}")
    assert len(results) >= 25 and len(refused) == len(results), [
        (case.label, code, out[:200]) for case, code, out in results if case not in refused
    ]


async def test_the_plan_command_accepts_the_safe_control(machines: dict[str, Machine], tmp_path: Path) -> None:
    """So that exit 2 above means "refused", not "the command is broken"."""
    hardware = tmp_path / "machine.json"
    hardware.write_text(json.dumps(machines["vllm"].to_detect_json()), encoding="utf-8")
    assignment = tmp_path / "assign.json"
    assignment.write_text(Hostile("vllm", "safe").assignment().model_dump_json(), encoding="utf-8")
    code, out = await _cli_plan(hardware, assignment)
    assert code == 0 and json.loads(out)["engine"] == "vllm"


NODE_CASES = [
    Hostile("vllm", "host", ("--host", "0.0.0.0"), names=("--host",)),
    Hostile("vllm", "abbreviated port", ("--por=80",), names=("--por",)),
    Hostile("vllm", "remote code", ("--trust-remote-code",), names=("--trust-remote-code",)),
    Hostile("vllm", "newline", ("--max-model-len", "8192\n--host=0.0.0.0"), names=("8192\\n",)),
    Hostile("vllm", "shell", ("--max-model-len", "$(id)"), names=("$(id)",)),
    Hostile("vllm", "http source", source="http://example.org/org/model", names=("http://",)),
    Hostile("vllm", "dot-dot source", source="/models/../etc", names=("..",)),
]


@pytest.mark.integration
async def test_a_running_node_refuses_every_hostile_assignment_before_starting_anything(tmp_path: Path) -> None:
    """Figure: of the hostile assignments sent to a real headless node, 100 % end in a `failed`
    status naming the culprit, and the engine executable (a marker that records any start) never runs."""
    marker = tmp_path / "engine-was-started"
    engine = tmp_path / "vllm"
    engine.write_text(f"#!{sys.executable}\nimport pathlib\npathlib.Path({str(marker)!r}).touch()\n", encoding="utf-8")
    engine.chmod(0o755)
    token = "hostile-token"
    async with (
        ReferenceCoordinator(token=token, ping_interval=None) as coordinator,
        headless_node(tmp_path, coordinator.url, token, engine) as node,
    ):
        await coordinator.wait_for_connections(1, timeout=60)
        refused = []
        for case in NODE_CASES:
            after = len(coordinator.received)
            await coordinator.send(case.assignment())
            status = await coordinator.wait_for(
                lambda m: isinstance(m, protocol.Status) and m.state == "failed", after=after, timeout=30)
            if status.last_error and _mentions(status.last_error, case):
                refused.append(case.label)
        await asyncio.sleep(0.5)  # time enough for a wrongly started engine to leave its mark
        children = psutil.Process(node.process.pid).children(recursive=True)
    print(f"\nhostile assignments refused by a running node: {len(refused)}/{len(NODE_CASES)}; "
          f"engine starts: {int(marker.exists())}")
    assert refused == [case.label for case in NODE_CASES]
    assert not marker.exists() and children == []
