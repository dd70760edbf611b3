"""The Settings slider's preview: what a card's share leaves for the desktop and what the engine
serving on it could then hold, from that engine's own measured KV cache."""

from __future__ import annotations

import pytest

from worker.contract.events import ContextNumbers, EngineSnapshot, GpuSnapshot
from worker.hardware.detect import card_usable_mib
from worker.plan.share_preview import preview
from worker.system.config import Settings

CARD = GpuSnapshot(index=0, name="NVIDIA GeForce RTX 4090", memory_total_mib=24576, memory_usable_mib=24064)
# Serving at the whole card (24,576 − 512 MiB): 8 GiB of KV cache measured, 131,072 tokens
# (16,384 a GiB), 4 chats of 32,768 tokens at once.
ENGINE = EngineSnapshot(engine_id="e0", engine="vllm", gpu_indices=(0,), layout="single", state="ready",
                        memory_mib=24064, kv_cache_tokens=131072, kv_cache_gib=8.0, max_concurrency=4.0,
                        context=ContextNumbers(requested=32768, declared=32768, physical=131072))


def test_a_share_leaves_the_rest_of_the_card_to_the_desktop_and_the_engine_holds_less() -> None:
    shown = preview(CARD, 75, [ENGINE])
    assert (shown.desktop_left_mib, shown.engine_mib) == (6144, 18432 - 512)
    assert (shown.context_tokens, shown.chats_at_once) == (32768, 1.0)  # 6 GiB less KV: 2 GiB left
    assert shown.words == ("Leaves 6.0 GiB for your desktop and games; the engine could hold 32,768 tokens "
                           "of context, 1 chat at once")


def test_the_whole_card_is_what_the_engine_measured() -> None:
    shown = preview(CARD, 100, [ENGINE])
    assert (shown.desktop_left_mib, shown.context_tokens, shown.chats_at_once) == (0, 131072, 4.0)
    assert shown.words.endswith("131,072 tokens of context, 4 chats at once")


def test_the_engine_limit_is_the_one_detection_applies() -> None:
    settings = Settings(memory_share_pct=((0, 60),))
    assert preview(CARD, 60, []).engine_mib == card_usable_mib(0, 24576, 24576, settings)


def test_a_share_too_small_for_the_model_says_it_would_not_start() -> None:
    shown = preview(CARD, 50, [ENGINE])  # 12 GiB less: more than the 8 GiB of cache
    assert shown.context_tokens == 0
    assert shown.words.endswith("too little for the model it serves now: it would not start")


def test_part_of_a_chat_is_said_as_less_than_one() -> None:
    shown = preview(CARD, 72, [ENGINE])
    assert shown.chats_at_once is not None and shown.chats_at_once < 1
    assert shown.words.endswith("less than one full-length chat")


def test_without_a_measured_concurrency_chats_are_tokens_over_one_requests_context() -> None:
    engine = EngineSnapshot(engine_id="e0", engine="llamacpp", gpu_indices=(0,), layout="single", state="ready",
                            memory_mib=24064, kv_cache_tokens=131072, kv_cache_gib=8.0,
                            context=ContextNumbers(requested=16384))
    shown = preview(CARD, 100, [engine])
    assert shown.chats_at_once == 8.0 and shown.words.endswith("8 chats at once")
    unknown = preview(CARD, 100, [EngineSnapshot(engine_id="e0", engine="llamacpp", gpu_indices=(0,),
                                                 layout="single", state="ready", memory_mib=24064,
                                                 kv_cache_tokens=131072, kv_cache_gib=8.0)])
    assert unknown.chats_at_once is None and unknown.words.endswith("131,072 tokens of context")


def test_a_split_engine_is_held_to_its_smallest_card() -> None:
    split = EngineSnapshot(engine_id="e0", engine="vllm", gpu_indices=(0, 1), layout="tensor", state="ready",
                           memory_mib=2 * 17920, kv_cache_tokens=65536, kv_cache_gib=4.0, max_concurrency=2.0)
    assert preview(CARD, 100, [split]).context_tokens == 65536  # the other card, at 75 %, still holds it
    lower = preview(CARD, 50, [split])  # each card's part shrinks to 11,776 MiB: 12 GiB less in all
    assert lower.context_tokens == 0
    shown = preview(CARD, 70, [split])  # 16,691 per card: 2,458 MiB less on each
    assert shown.context_tokens == int((4.0 - 2 * (17920 - 16691) / 1024) * 16384)


def test_no_engine_on_the_card_or_none_measured_says_only_what_the_share_allows() -> None:
    other = EngineSnapshot(engine_id="e1", engine="vllm", gpu_indices=(1,), layout="single", state="ready",
                           memory_mib=24064, kv_cache_tokens=131072, kv_cache_gib=8.0, max_concurrency=4.0)
    starting = EngineSnapshot(engine_id="e0", engine="vllm", gpu_indices=(0,), layout="single", state="starting",
                              memory_mib=24064)
    for engines in ([], [other], [starting]):
        shown = preview(CARD, 50, engines)
        assert (shown.context_tokens, shown.chats_at_once) == (None, None)
        assert shown.words == "Leaves 12.0 GiB for your desktop and games; an engine could use up to 11.5 GiB"


@pytest.mark.parametrize("pct", [0, 9, 101])
def test_a_share_outside_the_settings_range_is_refused(pct: int) -> None:
    with pytest.raises(ValueError):
        preview(CARD, pct, [ENGINE])
