"""What lending a share of a card's memory would mean, shown before the person saves it: what it
leaves for the desktop and games, and what the engine could then hold.

Pure. The card's share is judged as detection judges it (`hardware.detect.share_cap_mib`). What the
engine could hold comes from the engine serving on that card now, from its own measurement: its
KV cache (tokens per GiB) grows or shrinks by the memory the share adds or takes, and its chats at
once are that many tokens over one chat's full context (vLLM's "maximum concurrency"). With no
engine on the card, or none measured, the words say only what the share leaves and allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.contract.events import EngineSnapshot, GpuSnapshot
from worker.hardware.detect import share_cap_mib
from worker.system.config import Settings

GIB = 1024


@dataclass(frozen=True)
class SharePreview:
    desktop_left_mib: int  # the card's memory the engine leaves to everything else
    engine_mib: int  # the most an engine may use of the card at this share
    context_tokens: int | None  # the KV cache tokens the engine on it could hold; None = not measured
    chats_at_once: float | None  # full-length chats those tokens hold at once; None = not known
    words: str  # "Leaves 6.0 GiB for your desktop and games; the engine could hold 32,768 tokens of context, 4 chats at once"


def preview(gpu: GpuSnapshot, pct: int, engines: Sequence[EngineSnapshot], *,
            reserve_mib: int = Settings.memory_reserve_mib) -> SharePreview:
    """`gpu` lent at `pct` % (10-100, the setting's range), judged against the engines serving now."""
    if not 10 <= pct <= 100:
        raise ValueError("a card's memory share is between 10 and 100 %")
    engine_mib = share_cap_mib(gpu.memory_total_mib, pct, reserve_mib)
    desktop_left = gpu.memory_total_mib - gpu.memory_total_mib * pct // 100
    left = f"Leaves {desktop_left / GIB:.1f} GiB for your desktop and games"
    engine = _measured_engine(gpu.index, engines)
    if engine is None:
        return SharePreview(desktop_left, engine_mib, None, None,
                            f"{left}; an engine could use up to {engine_mib / GIB:.1f} GiB")
    tokens = _tokens_at(engine, gpu.index, engine_mib)
    chats = _chats(engine, tokens)
    return SharePreview(desktop_left, engine_mib, tokens, chats, f"{left}; {_holds(tokens, chats)}")


def _measured_engine(index: int, engines: Sequence[EngineSnapshot]) -> EngineSnapshot | None:
    """The engine on this card whose KV cache was measured (tokens and GiB), if any."""
    for engine in engines:
        if (index in engine.gpu_indices and engine.kv_cache_tokens and engine.kv_cache_gib
                and engine.memory_mib > 0):
            return engine
    return None


def _tokens_at(engine: EngineSnapshot, index: int, card_mib: int) -> int:
    """The engine's KV tokens once this card gives it `card_mib`: a one-card engine gets all of the
    change; one split over several cards is held to its smallest card, so a larger share on one
    gains nothing while a smaller one shrinks every card's part to it."""
    assert engine.kv_cache_tokens is not None and engine.kv_cache_gib is not None
    cards = len(engine.gpu_indices)
    per_card = engine.memory_mib // cards
    memory = card_mib * cards if cards == 1 else min(card_mib, per_card) * cards
    kv_gib = engine.kv_cache_gib + (memory - engine.memory_mib) / GIB
    return max(0, int(kv_gib * engine.kv_cache_tokens / engine.kv_cache_gib))


def _chats(engine: EngineSnapshot, tokens: int) -> float | None:
    """Full-length chats at once: the measured concurrency scaled to the tokens, else the tokens
    over one request's context."""
    assert engine.kv_cache_tokens is not None
    if engine.max_concurrency:
        return engine.max_concurrency * tokens / engine.kv_cache_tokens
    per_chat = engine.context.servable or engine.context.requested
    return tokens / per_chat if per_chat else None


def _holds(tokens: int, chats: float | None) -> str:
    if tokens == 0:
        return "too little for the model it serves now: it would not start"
    said = f"the engine could hold {tokens:,} tokens of context"
    if chats is None:
        return said
    if chats < 1:
        return f"{said}, less than one full-length chat"
    whole = int(chats)
    return f"{said}, {whole} chat{'' if whole == 1 else 's'} at once"
