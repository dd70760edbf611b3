"""The relay's body rules, pure: which requests are generations, the body an engine is sent, and
the bounds on what a request may ask of an engine.
(Paths, media by URL and the stream filter are tested through the relay in `test_relay.py`.)"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from worker.relay.body import (
    MAX_CONSTRAINT_BYTES,
    beyond_context,
    constrained,
    engine_body,
    is_generation,
    unbounded,
    unrelayable,
)


@pytest.mark.parametrize(("method", "path", "expected"), [
    ("POST", "/v1/chat/completions", True),
    ("POST", "/v1/completions", True),
    ("POST", "/v1/completions?stream=true", True),  # the query string aside
    ("GET", "/v1/chat/completions", False),
    ("GET", "/v1/models", False),
    ("POST", "/v1/embeddings", False),
    ("POST", "/v1/chat/completions/extra", False),
])
def test_is_generation(method: str, path: str, expected: bool) -> None:
    assert is_generation(method, path) is expected


def test_a_generation_path_is_still_checked_like_any_other() -> None:
    assert unrelayable("POST", "/v1/chat/completions") is None
    assert unrelayable("POST", "/v1/../chat/completions") is not None


def test_the_engine_gets_its_served_name_and_usage_is_asked_for_on_the_callers_behalf() -> None:
    content, strip = engine_body({"model": "public", "stream": True, "messages": []}, "served")
    assert content is not None and strip is True
    assert json.loads(content) == {"model": "served", "stream": True, "messages": [],
                                   "stream_options": {"include_usage": True}}


def test_usage_the_caller_asked_for_stays_and_whole_answers_are_left_alone() -> None:
    asked = {"model": "public", "stream": True, "stream_options": {"include_usage": True}}
    assert engine_body(asked, "served")[1] is False
    content, strip = engine_body({"model": "public", "prompt": "hi"}, "served")
    assert content is not None and json.loads(content) == {"model": "served", "prompt": "hi"} and strip is False


def test_bodies_that_are_no_object_pass_as_they_are() -> None:
    assert engine_body(None, "served") == (None, False)
    assert engine_body(["é"], "served") == ('["é"]'.encode(), False)


# --- bounded requests (contract, Relay, "Bounded requests") -------------------------------------

DEEP_GRAMMAR = "root ::= " + "(" * 20_000 + '"a"' + ")" * 20_000  # crashed llama-server with SIGSEGV


# A body nests at most 64 levels (`MAX_BODY_DEPTH`), so what nests deeper is text: a schema's regex.
DEEP_SCHEMA = {"type": "array", "items": {"type": "string", "pattern": "(" * 200 + "a" + ")" * 200}}


def test_the_grammar_that_crashed_llama_server_is_refused_and_says_why() -> None:
    problem = unbounded({"prompt": "hi", "grammar": DEEP_GRAMMAR})
    assert problem is not None and "grammar" in problem and "128" in problem


@pytest.mark.parametrize(("body", "where"), [
    ({"json_schema": {"type": "string", "pattern": "(" * 129 + ")" * 129}}, "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP_SCHEMA}}},
     "response_format"),
    ({"response_format": {"type": "json_object", "schema": DEEP_SCHEMA}}, "response_format"),
    ({"guided_json": DEEP_SCHEMA}, "guided_json"),
    ({"guided_regex": "(" * 200 + "a" + ")" * 200}, "guided_regex"),
    ({"guided_grammar": DEEP_GRAMMAR}, "guided_grammar"),
    ({"guided_choice": ["a", "[" * 200]}, "guided_choice"),
    ({"structured_outputs": {"regex": "[" * 200}}, "structured_outputs"),
    ({"grammar_triggers": [{"type": "pattern", "value": "(" * 200}]}, "grammar_triggers"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
                {"type": "function", "function": {"name": "g", "parameters": DEEP_SCHEMA}}]}, "tools[1]"),
    ({"tools": [{"name": "f", "input_schema": DEEP_SCHEMA}]}, "tools[0]"),  # Anthropic's messages
    ({"text": {"format": {"type": "json_schema", "schema": DEEP_SCHEMA}}}, "text.format"),  # responses
])
def test_constraints_nested_too_deep_are_refused_wherever_an_engine_reads_them(body: dict[str, Any],
                                                                               where: str) -> None:
    problem = unbounded(body)
    assert problem is not None and f"request's {where} " in problem and "128 levels" in problem


def test_stray_closing_brackets_do_not_hide_the_nesting_after_them() -> None:
    assert unbounded({"grammar": ")" * 30_000 + "(" * 129}) is not None
    assert unbounded({"grammar": "\\(" * 300}) is None  # escaped: no nesting at all
    assert unbounded({"grammar": "(" * 128 + ")" * 128}) is None  # exactly at the bound


def test_constraints_over_64_kib_are_refused_and_up_to_it_pass() -> None:
    filler = "x" * (MAX_CONSTRAINT_BYTES - len('root ::= ""'))
    assert unbounded({"grammar": f'root ::= "{filler}"'}) is None
    problem = unbounded({"grammar": f'root ::= "{filler}x"'})
    assert problem is not None and "65,537 bytes" in problem and "64 KiB" in problem
    wide = unbounded({"guided_json": {"enum": ["é" * 40_000]}})  # two bytes a character
    assert wide is not None and "guided_json" in wide


def test_ordinary_constraints_pass() -> None:
    json_grammar = 'root ::= "{" ws ( string ":" ws value ( "," ws string ":" ws value )* )? "}" ws'
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]+( [A-Z][a-z]+)*$"},
                                               "tags": {"type": "array", "items": {"type": "string"}}}}
    assert unbounded({"grammar": json_grammar, "n": 16, "n_probs": 20, "logprobs": True, "top_logprobs": 20}) is None
    assert unbounded({"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}) is None
    assert unbounded({"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}] * 50}) is None


@pytest.mark.parametrize(("body", "words"), [
    ({"n": 17}, "17 answers"),
    ({"n_cmpl": 100}, "100 answers"),
    ({"best_of": 17}, "17 answers"),
    ({"n_probs": 21}, "21 log-probabilities"),
    ({"logprobs": True, "top_logprobs": 21}, "21 log-probabilities"),
    ({"logprobs": 21}, "21 log-probabilities"),  # the completions API's count
    ({"prompt_logprobs": 21}, "21 log-probabilities"),  # vLLM's, for each prompt token
])
def test_too_many_answers_or_log_probabilities_are_refused(body: dict[str, Any], words: str) -> None:
    problem = unbounded({"prompt": "hi", **body})
    assert problem is not None and words in problem


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens"])
def test_more_tokens_than_the_engines_context_are_refused(key: str) -> None:
    problem = beyond_context({key: 1025}, 1024)
    assert problem is not None and "1025" in problem and "1024 tokens" in problem
    assert beyond_context({key: 1024}, 1024) is None
    assert beyond_context({key: 10**9}, None) is None  # the context is not known: nothing to refuse on
    assert beyond_context({key: -1}, 1024) is None  # llama.cpp's "until the context is full"


@pytest.mark.parametrize(("body", "expected"), [
    ({"prompt": "hi"}, False),
    ({"grammar": DEEP_GRAMMAR}, True),
    ({"grammar": ""}, False),
    ({"json_schema": {}}, True),  # llama.cpp: any object
    ({"response_format": {"type": "text"}}, False),
    ({"response_format": {"type": "json_object"}}, True),
    ({"guided_regex": "a+"}, True),
    ({"structured_outputs": {"choice": ["a", "b"]}}, True),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, True),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}, False),
    ({"tools": [{"name": "f"}], "tool_choice": "none", "guided_json": {"type": "object"}}, True),
    ({"text": {"format": {"type": "text"}}}, False),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, True),
])
def test_which_requests_ask_for_constrained_decoding(body: dict[str, Any], expected: bool) -> None:
    assert constrained(body) is expected


def test_more_tools_than_openai_takes_are_refused() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert unbounded({"tools": [tool] * 128}) is None
    problem = unbounded({"tools": [tool] * 129})
    assert problem is not None and "129 tools" in problem


def brackets_everywhere(nesting: int, size: int = MAX_CONSTRAINT_BYTES) -> str:
    """Up to `size` bytes of brackets and nothing else, nested `nesting` deep throughout: the most work."""
    group = "(" * nesting + ")" * nesting
    return group * (size // len(group))


def test_constraints_over_1_mib_together_are_refused() -> None:
    tool = {"type": "function", "function": {"name": "f", "description": "x" * (MAX_CONSTRAINT_BYTES - 100)}}
    assert unbounded({"tools": [tool] * 16}) is None
    problem = unbounded({"tools": [tool] * 17})
    assert problem is not None and "1024 KiB together" in problem


def test_the_checks_stay_fast_at_the_worst_a_body_may_ask() -> None:
    """16 MiB of openers is refused on its size; 1 MiB of brackets and nothing else, nested as
    deep as costs the most, takes well under a second (a walk in Python over every bracket of the
    8 MiB that 128 tools could hold took five)."""
    started = time.perf_counter()
    assert unbounded({"grammar": "(" * (16 << 20)}) is not None
    assert time.perf_counter() - started < 1.0
    for nesting in (9, 127):  # just past the passes at C speed; as deep as may pass
        worst = {"tools": [{"d": brackets_everywhere(nesting, MAX_CONSTRAINT_BYTES - 20)}] * 16}  # {} is one more
        started = time.perf_counter()
        assert unbounded(worst) is None
        assert time.perf_counter() - started < 1.0
