"""The relay's body rules, pure: which requests are generations, and the body an engine is sent.
(Paths, media by URL and the stream filter are tested through the relay in `test_relay.py`.)"""

from __future__ import annotations

import json

import pytest

from worker.relay_body import engine_body, is_generation, unrelayable


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
