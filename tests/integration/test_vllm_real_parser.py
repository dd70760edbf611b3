"""The vLLM allowlist against vLLM's own argument parser (0.32, its CPU build, installed once per
machine): every listed spelling and every kind of valid value is accepted and lands on the setting
the allowlist means, and nothing else; the spellings and values new in 0.33 are the only ones 0.32
refuses (so the note in `worker/engines/vllm/args.py` stays true). Fails, never skips, without vLLM."""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import pytest

from tests.support.engines import REPO
from tests.support.real_vllm import vllm_python
from tests.worker.engines.test_allowlist import forms, valid_values
from worker.engines.allowlist import AllowedFlag, Choice, FloatValue, IntValue, JsonObject, Switch
from worker.engines.vllm import args as vllm_args

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

PROBE = REPO / "tests" / "support" / "vllm_arg_probe.py"
HUMAN = {"k": 1000, "K": 1024}
CONTROLS = [["--not-a-flag"], ["--kv-cache-dtype", "bogus"], ["--max-num-seqs", "many"]]


def cases() -> list[tuple[AllowedFlag, list[str]]]:
    found = []
    for flag in vllm_args.ALLOWLIST.flags:
        if isinstance(flag.value, Switch):
            found += [(flag, [spelling]) for spelling in flag.all_spellings()]
        else:
            found += [(flag, args) for value in valid_values(flag.value) for args in forms(flag, value)]
    return found


def new_in_0_33(args: list[str]) -> bool:
    words = {part for arg in args for part in arg.split("=")}
    return bool(words & {*vllm_args.NEW_IN_0_33_SPELLINGS, *vllm_args.NEW_IN_0_33_KV_CACHE_DTYPES})


def setting(flag: AllowedFlag, spelling: str) -> str:
    """The attribute vLLM's parser stores a flag in: `--max-model-len` → `max_model_len`."""
    if re.fullmatch(r"-O\d", spelling):
        return "optimization_level"
    return flag.name.lstrip("-").replace("-", "_")


def meant(flag: AllowedFlag, args: list[str]) -> set[str] | None:
    """The reprs of the value the allowlist means `args` to set (a level may stay text: vLLM validates
    `optimization_level` later); None for a JSON object, which is checked key by key."""
    spelling, _, inline = args[0].partition("=")
    text = inline or (args[1] if len(args) > 1 else "")
    kind = flag.value
    if isinstance(kind, Switch):
        number = re.fullmatch(r"-O(\d)", spelling)
        return {number.group(1), repr(number.group(1))} if number else {repr(spelling not in flag.negations)}
    if isinstance(kind, IntValue):
        if text in kind.words:
            return {"-1"}
        return {repr(int(text[:-1]) * HUMAN[text[-1]]) if text[-1:] in HUMAN else repr(int(text))}
    if isinstance(kind, FloatValue):
        return {repr(float(text))}
    if isinstance(kind, Choice):
        value = next(value for value in kind.values if str(value) == text)
        return {repr(value), repr(str(value))}
    return None


def parse(python: str, argument_lists: list[list[str]]) -> list[dict[str, Any]]:
    done = subprocess.run([python, str(PROBE)], input="".join(json.dumps(a) + "\n" for a in argument_lists),
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_every_listed_flag_and_value_lands_on_the_setting_the_allowlist_means() -> None:
    listed = cases()
    results = parse(str(vllm_python()), [args for _, args in listed] + CONTROLS)
    assert len(results) == len(listed) + len(CONTROLS)
    wrong = []
    for (flag, args), result in zip(listed, results, strict=False):
        if new_in_0_33(args):
            if result["ok"]:
                wrong.append(f"{args}: 0.32 accepts it; drop it from the 0.33-only note")
            continue
        if not result["ok"]:
            wrong.append(f"{args}: refused: {result['error']}")
            continue
        name = setting(flag, args[0].partition("=")[0])
        if set(result["changed"]) - {name}:
            wrong.append(f"{args}: changed {sorted(result['changed'])}, not only {name}")
        expected, got = meant(flag, args), result["values"].get(name)
        if isinstance(flag.value, JsonObject):
            sent = json.loads(args[-1].partition("=")[2] if "=" in args[-1] else args[-1])
            missing = [key for key, value in sent.items()
                       if not re.search(rf"'{key}': [^,]*{re.escape(str(value))}", got or "")]
            if missing:
                wrong.append(f"{args}: {name} lacks {missing}: {got}")
        elif expected is None or got not in expected:
            wrong.append(f"{args}: {name} is {got}, the allowlist means one of {expected}")
    assert wrong == [], "\n".join(wrong)
    assert [result["ok"] for result in results[len(listed):]] == [False] * len(CONTROLS)  # refusals show
    assert any(new_in_0_33(args) for _, args in listed)  # the note names listed spellings and values
