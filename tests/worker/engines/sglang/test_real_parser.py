"""Every SGLang flag the app allows or sets, checked against SGLang 0.5.23's own parser (read from
its wheel: real_parser.py). Without the wheel this fails with pip's reason: the allowlist is only
as true as this check."""

from __future__ import annotations

from typing import Any

import pytest

from tests.worker.engines.sglang import real_parser
from worker.engines import sglang
from worker.engines.allowlist import AllowedFlag, Choice, FloatValue, IntValue, Switch
from worker.engines.base import Launch

_KINDS: dict[type, tuple[str, ...]] = {Switch: ("bool", "switch"), IntValue: ("int",), FloatValue: ("float",)}


@pytest.fixture(scope="module")
def parser() -> dict[str, real_parser.Option]:
    return real_parser.options()


def _problem(flag: AllowedFlag, spelling: str, option: real_parser.Option | None) -> str | None:
    """Why SGLang's parser would not take `spelling` with the values the allowlist lets through."""
    if option is None:
        return f"{spelling}: not a flag of SGLang {real_parser.VERSION}"
    value = flag.value
    if isinstance(value, Choice):
        return _choice_problem(spelling, value.values, option)
    if isinstance(value, IntValue) and option.kind == "int" and set(value.words) - {"-1"}:
        return f"{spelling}: SGLang takes no words {value.words}"
    if option.kind not in _KINDS.get(type(value), ()):
        return f"{spelling}: allowed as {type(value).__name__}, but SGLang's is {option.kind}"
    return None


def _choice_problem(spelling: str, values: tuple[Any, ...], option: real_parser.Option) -> str | None:
    """Each allowed value among SGLang's choices; for a free-text flag (the speculative algorithm,
    whose names are registered at run time) each among the built-ins its help names."""
    if option.choices is not None:
        missing = [v for v in values if v not in option.choices]
        return f"{spelling}: {missing} not among SGLang's choices" if missing else None
    if option.kind == "str" and "Builtins:" in option.help:
        builtins = option.help.split("Builtins:", 1)[1].split(".", 1)[0].replace(",", " ").split()
        missing = [v for v in values if v not in builtins]
        return f"{spelling}: {missing} not among SGLang's built-ins {builtins}" if missing else None
    return f"{spelling}: SGLang's is {option.kind} without choices"


def test_every_allowed_flag_is_sglangs_with_the_values_it_takes(parser: dict[str, real_parser.Option]) -> None:
    problems = [problem for flag in sglang.ALLOWED_ARGS.flags for spelling in flag.all_spellings()
                if (problem := _problem(flag, spelling, parser.get(spelling)))]
    assert problems == []


def test_an_integer_flag_that_takes_minus_one_says_so(parser: dict[str, real_parser.Option]) -> None:
    assert "-1" in parser["--chunked-prefill-size"].help  # "Setting this to -1 means disabling chunked prefill."


def test_every_flag_the_app_sets_is_sglangs(parser: dict[str, real_parser.Option]) -> None:
    argv = sglang.command(Launch(("python3",), "/m", (), "name", 8000, tensor_parallel=2, memory_utilization=0.9))
    flags = [arg for arg in argv[2:] if arg.startswith("--")]
    assert [flag for flag in flags if flag not in parser] == []
    assert parser["--api-key"].kind == "str"  # what the launcher sets in-process, never on a command line


def test_the_app_owned_flags_are_not_allowed_to_an_assignment(parser: dict[str, real_parser.Option]) -> None:
    owned = ("--api-key", "--admin-api-key", "--host", "--port", "--tp-size", "--tensor-parallel-size", "--dp-size",
             "--data-parallel-size", "--mem-fraction-static", "--served-model-name", "--model-path", "--model",
             "--enable-metrics", "--speculative-draft-model-path", "--config")
    assert all(spelling in parser for spelling in owned)
    allowed = {spelling for flag in sglang.ALLOWED_ARGS.flags for spelling in flag.all_spellings()}
    assert allowed.isdisjoint(owned)


def test_the_reader_sees_a_flag_it_was_not_told_of(parser: dict[str, real_parser.Option]) -> None:
    """The parser is read, not listed: SGLang's deprecated `--disable-cuda-graph` (a manual
    `add_argument`) and its `Literal` choices both come out of the source."""
    assert parser["--disable-cuda-graph"].kind == "switch"
    assert parser["--cuda-graph-backend-prefill"].choices == ("full", "breakable", "disabled")
    assert len(parser) > 300
