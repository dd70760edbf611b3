"""The allowlist machinery, and the two engines' tables checked through it (and, for llama.cpp,
through the real `llama-server` parser)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.engines import LlamaServer
from worker.engines import args_markdown, published_args
from worker.engines.llamacpp import args as llamacpp_args
from worker.engines.sglang import args as sglang_args
from worker.engines.vllm import args as vllm_args
from worker.engines.allowlist import (
    AllowedFlag,
    Allowlist,
    Choice,
    FloatValue,
    IntValue,
    MAX_JSON_BYTES,
    JsonObject,
    Switch,
    ValueType,
)

ROOT = Path(__file__).resolve().parents[3]
TABLES = {"vllm": vllm_args.ALLOWLIST, "sglang": sglang_args.ALLOWLIST, "llamacpp": llamacpp_args.ALLOWLIST}

SAMPLE = Allowlist(
    "sample",
    (
        AllowedFlag(("--size", "-s"), IntValue(1, 100, words=("auto",)), "a size", equals=True),
        AllowedFlag(("--tokens",), IntValue(1, 100_000, suffixes=True), "tokens", equals=True),
        AllowedFlag(("--share",), FloatValue(0, 1, low_inclusive=False), "a share", equals=True, memory_cap=True),
        AllowedFlag(("--other-share",), FloatValue(0, 1, low_inclusive=False), "the cap's alias", memory_cap=True),
        AllowedFlag(("--mode",), Choice(("on", "off")), "a mode"),
        AllowedFlag(("--kinds",), Choice(("a", "b", "c"), many=True), "kinds"),
        AllowedFlag(("--eager",), Switch(), "a switch", negations=("--no-eager", "--disable-eager")),
        AllowedFlag(("--remote",), Switch(), "remote code", negations=("--no-remote",), remote_code=True),
        AllowedFlag(("--config",), JsonObject({"method": Choice(("x", "y")), "n": IntValue(1, 8),
                                               "p": FloatValue(0, 1), "mode": Choice((0, 1, "NONE"))}),
                    "json", equals=True),
    ),
)


def refused(args: list[str], **options: bool) -> str:
    problem = SAMPLE.check(args, **options)
    assert problem is not None, args
    return problem


@pytest.mark.parametrize(
    "args",
    [
        [], ["--size", "5"], ["-s", "100"], ["--size=1"], ["--size", "auto"], ["--tokens", "32k"],
        ["--tokens", "1.5k"], ["--tokens", "32K"], ["--tokens=2048"], ["--share", "0.9"], ["--share", "1"],
        ["--share", ".5"], ["--share=1.0"], ["--mode", "on"], ["--kinds", "a,c"], ["--kinds", "b"], ["--eager"],
        ["--no-eager"], ["--disable-eager"], ["--no-remote"], ["--config", '{"method": "x", "n": 8, "p": 0.5}'],
        ["--config={}"], ["--config", '{"mode": 0}'], ["--config", '{"mode": "NONE"}'], ["--config", '{"p": 1}'],
        ["--size", "5", "--eager", "--size", "6", "--mode", "off"],
    ],
)
def test_allowed_spellings_with_values_of_their_type_pass(args: list[str]) -> None:
    assert SAMPLE.check(args) is None


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--log-file", "/x"], "argument not allowed: --log-file: it is not on this node's list of sample"),
        (["--siz", "5"], "argument not allowed: --siz: abbreviations are not accepted"),
        (["--si=5"], "argument not allowed: --si: abbreviations are not accepted"),
        (["--Size", "5"], "argument not allowed: --Size: it is not on"),
        (["--no_eager"], "argument not allowed: --no_eager: spell it --no-eager, with '-' for '_'"),
        (["--config.method", "x"], "argument not allowed: --config.method: dotted JSON keys are not accepted"),
        (["--config.n+", "1"], "argument not allowed: --config.n+: dotted JSON keys"),
        (["-s=5"], "argument not allowed: -s=5: it is not on"),
        (["--mode=on"], "argument not allowed: --mode: sample does not read --mode=VALUE"),
        (["--eager=true"], "argument not allowed: --eager: it is a switch and takes no value"),
        (["--eager", "true"], "argument not allowed: 'true': a value with no flag before it"),
        (["model.gguf"], "argument not allowed: 'model.gguf': a value with no flag before it"),
        (["--", "--size"], "argument not allowed: --: it is not on"),
        (["-"], "argument not allowed: -: it is not on"),
        (["--size"], "value not allowed for --size: none is given (it is the last argument)"),
        (["--eager", "--size"], "value not allowed for --size: none is given"),
        (["--size\n", "5"], "argument not allowed: '--size\\n': it contains a newline or control character"),
        (["--size", "5\n--host"], "value not allowed for --size: '5\\n--host' contains a newline or control"),
        (["--size", "5\x00"], "value not allowed for --size: '5\\x00' contains"),
        (["--size=5\r"], "value not allowed for --size: '5\\r' contains"),
        (["--remote"], "argument not allowed: --remote: it runs code from the model's repository"),
        (["--size", "--eager"], "value not allowed for --size: '--eager' is not a whole number from 1 to 100 or auto"),
    ],
)
def test_refusals_name_the_flag_and_say_why(args: list[str], reason: str) -> None:
    assert refused(args).startswith(reason)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("0", "is out of range"), ("101", "is out of range"), ("-1", "is not"), ("+5", "is not"), (" 5", "is not"),
        ("5 ", "is not"), ("0x10", "is not"), ("1e2", "is not"), ("5.0", "is not"), ("AUTO", "is not"),
        ("", "is not"), ("٣", "is not"), ("1" * 13, "is not"),
    ],
)
def test_integers_are_plain_digits_in_range(text: str, why: str) -> None:
    assert f"value not allowed for --size: {text!r} {why}" in refused(["--size", text])


@pytest.mark.parametrize(("text", "number"), [("32k", 32_000), ("1.5k", 1_500), ("32K", 32_768), ("0.1m", 100_000)])
def test_vllm_human_readable_integers(text: str, number: int) -> None:
    assert SAMPLE.check(["--tokens", text]) is None
    assert IntValue(number, number, suffixes=True).problem(text) is None
    assert IntValue(1, number - 1, suffixes=True).problem(text) == (
        f"{text!r} is out of range (a whole number from 1 to {number - 1} (k and m suffixes count ×1000, K and M "
        "×1024: 32k, 1.5k, 32K))"
    )


@pytest.mark.parametrize("text", ["1.5K", "2g", "1e3", "k", "1.k", "-1k", "1kk", "1,000"])
def test_malformed_human_readable_integers_are_refused(text: str) -> None:
    assert refused(["--tokens", text]).startswith(f"value not allowed for --tokens: {text!r}")


@pytest.mark.parametrize("text", ["0", "0.0", "1.01", "2", "-0.5", "nan", "inf", "1e-1", "0,5", "", "."])
def test_float_values_are_plain_decimals_in_range(text: str) -> None:
    assert refused(["--share", text]).startswith(f"value not allowed for --share: {text!r}")


@pytest.mark.parametrize("text", ["ON", "on,off", "", "yes"])
def test_choices_are_exact(text: str) -> None:
    assert refused(["--mode", text]).startswith(f"value not allowed for --mode: {text!r} is not one of on, off")


@pytest.mark.parametrize("text", ["a,", ",a", "a,,b", "a b", "a,d", ""])
def test_choice_lists_are_exact_words_between_commas(text: str) -> None:
    assert "is not a comma-separated list of a, b, c" in refused(["--kinds", text])


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ('{"model": "/path"}', "JSON key 'model' is not allowed (allowed keys: method, n, p, mode)"),
        ('{"method": "z"}', "JSON key 'method': \"z\" is not one of x, y"),
        ('{"n": 9}', "JSON key 'n': 9 is out of range (1 to 8)"),
        ('{"n": "2"}', "JSON key 'n': \"2\" is not a whole number"),
        ('{"n": 2.0}', "JSON key 'n': 2.0 is not a whole number"),
        ('{"n": true}', "JSON key 'n': true is not a whole number"),
        ('{"p": "0.5"}', "JSON key 'p': \"0.5\" is not a number"),
        ('{"p": false}', "JSON key 'p': false is not a number"),
        ('{"p": 2}', "JSON key 'p': 2 is out of range"),
        ('{"mode": "0"}', "JSON key 'mode': \"0\" is not one of 0, 1, \"NONE\""),
        ('{"mode": true}', "JSON key 'mode': true is not one of"),
        ('{"n": {"a": 1}}', "JSON key 'n': {\"a\": 1} is not a whole number"),
        ('{"method": ["x"]}', "JSON key 'method': [\"x\"] is not one of"),
        ('{"method": "x", "method": "y"}', "is not a JSON object (key 'method' appears twice)"),
        ('{"p": NaN}', "is not a JSON object (NaN is not a number)"),
        ('{"p": Infinity}', "is not a JSON object (Infinity is not a number)"),
        ('["x"]', "is not a JSON object"),
        ('"x"', "is not a JSON object"),
        ("{'method': 'x'}", "is not a JSON object"),
        ("/etc/passwd", "is not a JSON object"),
    ],
)
def test_json_objects_have_listed_keys_with_typed_values(value: str, why: str) -> None:
    reason = refused(["--config", value])
    assert reason.startswith("value not allowed for --config: ") and why in reason


def test_a_json_value_of_64_kib_passes_and_one_byte_more_is_refused_before_parsing() -> None:
    at_limit = '{"n": 1' + " " * (MAX_JSON_BYTES - 8) + "}"
    assert len(at_limit) == MAX_JSON_BYTES and SAMPLE.check(["--config", at_limit]) is None
    over = at_limit[:-2] + "é}"  # the same length in characters, one byte more in UTF-8
    assert refused(["--config", over]) == (
        "value not allowed for --config: a JSON value of 65,537 bytes is over the limit of 65,536")


@pytest.mark.parametrize("depth", [17, 5_000, 9_000])
@pytest.mark.parametrize(("opening", "closing"), [("[", "]"), ('{"n": ', "}")])
def test_json_nested_over_16_deep_is_refused_before_parsing(depth: int, opening: str, closing: str) -> None:
    """`json.loads` recurses per level: 5,000 deep raised RecursionError out of the check."""
    value = opening * depth + "1" + closing * depth
    assert refused(["--config", value]) == (
        "value not allowed for --config: a JSON value nested more than 16 deep is not accepted")


def test_depth_counts_brackets_outside_strings_only() -> None:
    sixteen = '{"n": ' + "[" * 15 + "1" + "]" * 15 + "}"
    assert "nested" not in refused(["--config", sixteen])  # refused for its type, not its depth
    in_strings = '{"method": "' + "[{" * 100 + '\\"' + "[" * 100 + '"}'
    assert refused(["--config", in_strings]).startswith("value not allowed for --config: JSON key 'method': ")


def test_a_refused_json_value_is_quoted_short() -> None:
    reason = refused(["--config", '{"n": [' + ",".join(["12345"] * 5000) + "]}"])
    assert reason.startswith("value not allowed for --config: JSON key 'n': [12345, ") and len(reason) < 200


@pytest.mark.parametrize("flag", ["--" + "x" * 60_000, "-" + "y" * 5_000 + "=1", "--a." + "b" * 5_000])
def test_a_long_unknown_flag_is_named_short(flag: str) -> None:
    """The reason is repeated in every `status`: an unknown flag is cut like a value."""
    reason = refused([flag])
    assert reason.startswith(f"argument not allowed: {flag[:79]}…: ") and len(reason) < 300


def test_duplicate_keys_are_found_in_one_pass() -> None:
    """A 64 KiB object of distinct keys, one given twice at the end, is refused at once (the old
    check counted every key against every other: quadratic)."""
    keys = [f'"k{i}": 1' for i in range(5_500)]
    value = "{" + ", ".join(keys + ['"k0": 1']) + "}"
    started = time.perf_counter()
    assert "key 'k0' appears twice" in refused(["--config", value])
    assert time.perf_counter() - started < 2


def test_remote_code_passes_only_where_allowed_and_its_negation_always() -> None:
    assert SAMPLE.check(["--remote"], allow_remote_code=True) is None
    assert SAMPLE.check(["--no-remote"], allow_remote_code=False) is None
    assert "--remote" not in SAMPLE.published() and "--no-remote" in SAMPLE.published()
    assert "--remote" in SAMPLE.published(allow_remote_code=True)


def test_where_is_named_after_the_flag() -> None:
    assert SAMPLE.check(["--log-file", "x"], where="tier 24000") == (
        "argument not allowed: --log-file (in tier 24000): it is not on this node's list of sample tuning "
        "arguments (see docs/engine-args.md)"
    )


def test_long_values_are_cut_in_reasons() -> None:
    reason = refused(["--size", "9" * 5 + "x" * 500])
    assert len(reason) < 200 and "…" in reason


def test_the_memory_cap_leaves_the_args_and_the_last_one_wins() -> None:
    args = ["--share", "0.8", "--size", "5", "--eager", "--other-share", "0.7", "--share=0.6", "--mode", "on"]
    assert SAMPLE.split_memory_cap(args) == (("--size", "5", "--eager", "--mode", "on"), 0.6)
    assert SAMPLE.split_memory_cap(["--size", "5"]) == (("--size", "5"), None)


def test_published_lists_every_spelling_and_negation() -> None:
    assert SAMPLE.published() == [
        "--size", "-s", "--tokens", "--share", "--other-share", "--mode", "--kinds", "--eager", "--no-eager",
        "--disable-eager", "--no-remote", "--config",
    ]


def test_markdown_has_one_row_per_flag_with_every_spelling() -> None:
    lines = SAMPLE.markdown().splitlines()
    assert lines[0] == "| flag | spellings | value | what it tunes |" and len(lines) == 2 + len(SAMPLE.flags)
    assert "| `--size` | `--size`, `-s` (also `--size=VALUE`) | a whole number from 1 to 100 or auto | a size |" in lines


VERSIONED = Allowlist("Eng", (
    AllowedFlag(("--eager",), Switch(), "eager", negations=("--disable-eager", "--no-eager"),
                since={"--disable-eager": (0, 33)}),
    AllowedFlag(("--kinds",), Choice(("a", "b", "c"), many=True, since={"c": (0, 33)}), "kinds", equals=True),
))


@pytest.mark.parametrize("version", ["0.33.0", "0.33", "1.0.0", "0.34.1+cpu", "v0.33.2", None])
def test_a_spelling_or_value_that_came_in_a_version_passes_from_that_version(version: str | None) -> None:
    for args in (["--disable-eager"], ["--kinds", "a,c"], ["--kinds=c"]):
        assert VERSIONED.check(args, version=version) is None, (args, version)


@pytest.mark.parametrize("version", ["0.32.0+cpu", "0.9.2", "0.32", "nightly", ""])
def test_a_spelling_or_value_newer_than_the_engine_the_plan_runs_is_refused_with_the_reason(version: str) -> None:
    """Compared part by part (0.9 is older than 0.33); a version that is no number knows none of them."""
    assert VERSIONED.check(["--disable-eager"], version=version, where="base_args") == (
        f"argument not allowed: --disable-eager (in base_args): it came in Eng 0.33, and this computer runs Eng "
        f"{version or repr('')}; write --no-eager")
    assert VERSIONED.check(["--kinds", "a,c"], version=version) == (
        f"value not allowed for --kinds: 'c': it came in Eng 0.33, and this computer runs Eng {version or repr('')}")
    assert VERSIONED.check(["--no-eager", "--eager", "--kinds=a,b"], version=version) is None  # the rest passes


def test_a_version_is_quoted_safely_and_the_docs_say_what_needs_a_newer_one() -> None:
    refused = VERSIONED.check(["--disable-eager"], version="0.1\n" + "x" * 200)
    assert refused is not None and "\n" not in refused and len(refused) < 250
    lines = VERSIONED.markdown().splitlines()
    assert lines[2].endswith("| eager `--disable-eager`: 0.33 and later. |")
    assert lines[3].endswith("| kinds `c`: 0.33 and later. |")


def test_a_table_cannot_list_a_spelling_twice_or_negate_a_valued_flag() -> None:
    with pytest.raises(ValueError, match="-s is listed twice"):
        Allowlist("x", (AllowedFlag(("-s",), Switch(), ""), AllowedFlag(("--size", "-s"), IntValue(1, 2), "")))
    with pytest.raises(ValueError, match="only a switch"):
        Allowlist("x", (AllowedFlag(("--size",), IntValue(1, 2), "", negations=("--no-size",)),))


# --- the engines' tables ---------------------------------------------------------------------------------

HOSTILE_VALUES = [
    "/etc/passwd", "~/.ssh/id_ed25519", "../x", "./x", "C:\\Windows\\x", "\\\\server\\share", "file:///etc/passwd",
    "http://evil.example/x", "https://evil.example/m.gguf", "0.0.0.0", "127.0.0.1:8000", "[::]:80", "localhost",
    "evil.module.Class", "evil.mod:func", "{{ config }}", "{% for x in y %}", "$(id)", "`id`", "a;b", "x|y",
    "LD_PRELOAD=/x.so", "", " ", "None", "null", "true", "org/model",
]


def valid_values(kind: ValueType) -> list[str]:
    """Every edge of a type: a range's ends, every word and choice, a JSON object with every key."""
    if isinstance(kind, IntValue):
        return [str(kind.low), str(kind.high), *kind.words] + (["1k", "1K"] if kind.suffixes else [])
    if isinstance(kind, FloatValue):
        return [str(kind.high), "0.5"]
    if isinstance(kind, Choice):
        words = [str(v) for v in kind.values]
        return words + ([",".join(words)] if kind.many else [])
    if isinstance(kind, JsonObject):
        return [json.dumps({key: _json_example(value) for key, value in kind.keys.items()})]
    return []


def _json_example(kind: IntValue | FloatValue | Choice) -> object:
    return kind.values[-1] if isinstance(kind, Choice) else kind.high


def forms(flag: AllowedFlag, value: str) -> list[list[str]]:
    spelled = [[spelling, value] for spelling in flag.spellings]
    return spelled + [[f"{s}={value}"] for s in flag.spellings if flag.equals and s.startswith("--")]


@pytest.mark.parametrize("engine", TABLES)
def test_every_spelling_of_every_listed_flag_passes_with_every_kind_of_valid_value(engine: str) -> None:
    table, accepted = TABLES[engine], 0
    for flag in table.flags:
        if isinstance(flag.value, Switch):
            cases = [[spelling] for spelling in flag.all_spellings()]
        else:
            cases = [args for value in valid_values(flag.value) for args in forms(flag, value)]
        for args in cases:
            assert table.check(args, allow_remote_code=True) is None, args
            accepted += 1
    assert accepted > 2 * len(table.flags)


@pytest.mark.parametrize("engine", TABLES)
def test_no_value_type_takes_a_path_url_host_module_or_template(engine: str) -> None:
    """There is no free-text type: every hostile value fails every valued flag's type."""
    table = TABLES[engine]
    for flag in table.flags:
        if isinstance(flag.value, Switch):
            continue
        for value in HOSTILE_VALUES:
            reason = table.check([flag.name, value])
            assert reason is not None and reason.startswith(f"value not allowed for {flag.name}: "), (flag.name, value)


APP_OWNED = {
    "vllm": ["--host", "--port", "--uds", "--api-key", "--served-model-name", "-tp", "--tensor-parallel-size", "-dp",
             "--data-parallel-size", "-pp", "--pipeline-parallel-size", "--kv-cache-memory-bytes", "--model",
             "--config", "--download-dir", "--tokenizer", "--chat-template", "--speculative-model",
             "--num-speculative-tokens", "--swap-space", "--calculate-kv-scales"],
    "sglang": ["--host", "--port", "--api-key", "--admin-api-key", "--served-model-name", "--tp-size",
               "--tensor-parallel-size", "--dp-size", "--data-parallel-size", "--pp-size", "--mem-fraction-static",
               "--enable-metrics", "--model-path", "--model", "--config", "--tokenizer-path", "--chat-template",
               "--speculative-draft-model-path", "--load-format", "--max-total-tokens"],
    "llamacpp": ["--host", "--port", "--api-key", "--api-key-file", "--alias", "-a", "-sm", "--split-mode", "-ts",
                 "--tensor-split", "-mg", "--main-gpu", "-fit", "--fit", "-m", "--model", "-md", "--rpc", "--mmproj",
                 "--log-file", "--chat-template", "--chat-template-file", "--draft-max", "--slot-save-path"],
}


@pytest.mark.parametrize("engine", TABLES)
def test_the_app_owned_and_removed_flags_are_not_on_the_tables(engine: str) -> None:
    listed = set(TABLES[engine].published(allow_remote_code=True))
    assert listed.isdisjoint(APP_OWNED[engine])


def test_published_args_per_engine_and_remote_code_only_when_allowed() -> None:
    published = published_args()
    assert set(published) == {"vllm", "sglang", "llamacpp"}
    assert {"--max-model-len", "--max-num-seqs", "--no-enforce-eager", "-sc"} <= set(published["vllm"])
    assert {"-c", "--ctx-size", "-np", "-fa", "-ctk", "--jinja"} <= set(published["llamacpp"])
    assert "--trust-remote-code" not in published["vllm"] and "--no-trust-remote-code" in published["vllm"]
    assert "--trust-remote-code" in published_args(allow_remote_code=True)["vllm"]


def test_docs_engine_args_is_generated_from_the_tables() -> None:
    """Fails when a table changed and docs/engine-args.md was not regenerated (the command is in the file)."""
    assert (ROOT / "docs" / "engine-args.md").read_text(encoding="utf-8") == args_markdown()


@pytest.mark.integration
def test_the_real_llama_server_parses_every_listed_flag_and_value(llama_server_bin: LlamaServer) -> None:
    """llama-server parses arguments in order and reads `--help` last: exit 0 means every spelling
    and value before it was accepted by `common/arg.cpp` itself (a refused one exits 1)."""
    args: list[str] = []
    for flag in llamacpp_args.ALLOWLIST.flags:
        if isinstance(flag.value, Switch):
            args += flag.all_spellings()
        else:
            args += [arg for value in valid_values(flag.value) for spelling in flag.spellings
                     for arg in (spelling, value)]

    def parse(extra: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(llama_server_bin.executable), *extra, "--help"], env=llama_server_bin.environment(),
                              capture_output=True, text=True, timeout=60, check=False)

    accepted = parse(args)
    assert accepted.returncode == 0, accepted.stderr[-2000:]
    for control in (["--not-a-flag"], ["--ctx-size=4096"], ["-fa", "maybe"]):  # the control: refusals show
        assert parse(control).returncode != 0, control
