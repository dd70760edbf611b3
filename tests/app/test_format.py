"""The words figures are shown in: a gamer's, not the engine's."""

from __future__ import annotations

import time
from dataclasses import replace

from PySide6.QtGui import QColor

from app.format import (
    CPU_ONLY,
    FINDING_GPUS,
    STATE_COLOURS,
    context_words,
    engine_state_words,
    gpus_words,
    groups_words,
    kv_tooltip,
    machine_summary,
    retry_words,
    tokens_short,
)
from tests.app import snapshots
from tests.app.test_dashboard import contrast
from worker.contract.events import ContextNumbers


def test_context_in_chats_and_tokens() -> None:
    engine = snapshots.ENGINE
    assert context_words(engine) == "32k tokens per chat, 8 chats at once"
    assert kv_tooltip(engine) == "Memory for conversations (KV cache): 284,512 tokens (19.5 GiB)."
    one = replace(engine, max_concurrency=0.6, context=ContextNumbers(requested=131_072, declared=131_072))
    assert context_words(one) == "128k tokens per chat, 1 chat at once"
    assert context_words(replace(engine, context=ContextNumbers(), max_concurrency=None)) == (
        "Known once the model has loaded"
    )
    assert [tokens_short(n) for n in (512, 4096, 40_000)] == ["512", "4k", "40k"]


def test_how_gpus_work_together() -> None:
    assert gpus_words((0, 1), "tensor") == "2 GPUs working as one"
    assert gpus_words((0, 1, 2), "layers") == "3 GPUs sharing the model"
    assert gpus_words((1,), "single") == "GPU 1"
    assert gpus_words((), "single") == "the CPU"
    assert groups_words(((0, 1),)) == "2 GPUs working as one"
    assert groups_words(((0,), (1,))) == "2 GPUs, each on its own"
    assert groups_words(()) == ""


def test_engine_states_and_retries() -> None:
    engine = snapshots.ENGINE
    assert engine_state_words(engine) == "Serving"
    assert engine_state_words(replace(engine, state="starting", failures_in_a_row=3)) == "Restarting (3 of 5)"
    assert engine_state_words(replace(engine, state="failed", failures_in_a_row=5)) == "Failed"
    now = time.time()
    assert retry_words(now, now) == "Trying again at " + time.strftime("%H:%M", time.localtime(now))
    assert retry_words(now + 86_400, now) == "Trying again at " + time.strftime("%a %H:%M", time.localtime(now + 86_400))
    assert retry_words(None) == ""


def test_machine_summary_has_no_runtime_jargon() -> None:
    assert "runtime" not in machine_summary(snapshots.idle()).lower()
    assert machine_summary(snapshots.detecting()) == FINDING_GPUS
    assert machine_summary(snapshots.cpu_serving()) == CPU_ONLY


def test_white_state_chips_are_readable() -> None:
    for state, colour in STATE_COLOURS.items():
        assert contrast(QColor("#FFFFFF"), QColor(colour)) >= 4.5, state
