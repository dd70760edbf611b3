"""The lender's share of each card's memory (`Settings.memory_share_pct`): detection, the planner,
vLLM's memory flag and its fresh re-measure all judge a card by at most `total × share − reserve`."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.support.fake_pynvml import FakeCard, FakeNvml
from tests.worker.hardware.recorded import NO_ENGINE_FINDER, NVML_FIXTURES, replay
from tests.worker.plan.test_planner import assign, only_engine
from worker.hardware import Machine, PynvmlSource, ReplaySource, detect, load_reading
from worker.hardware.detect import card_usable_mib, usable_mib, with_shares
from worker.measure.gpu_watch import GpuWatch
from worker.plan.planner import EnginePlan, Plan, Refusal, plan
from worker.system.config import Settings

HALF = Settings(memory_share_pct=((0, 50),))


def test_a_cards_usable_memory_is_held_to_its_share_less_the_reserve() -> None:
    assert card_usable_mib(0, 23458, 24564, HALF) == 24564 // 2 - 512 == 11770
    assert card_usable_mib(1, 23458, 24564, HALF) == usable_mib(23458, HALF) == 20600  # card 1 has no limit
    assert card_usable_mib(0, 23458, 24564, Settings()) == 20600  # 100 %: the free reading decides
    assert card_usable_mib(0, 8000, 24564, HALF) == usable_mib(8000, HALF) == 6688  # less free than the share
    assert card_usable_mib(0, 4000, 4096, Settings(memory_share_pct=((0, 10),))) == 0  # never below 0


def detect_fake_card(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> Machine:
    FakeNvml([FakeCard()]).install(monkeypatch)  # a 24 GiB RTX 4090, as the driver answers
    host, _ = load_reading(NVML_FIXTURES / "rtx4090.json")
    return detect(settings, NO_ENGINE_FINDER, host=host, nvml=PynvmlSource())


def test_a_24_gib_card_lent_at_half_plans_an_engine_half_the_size(monkeypatch: pytest.MonkeyPatch) -> None:
    whole = detect_fake_card(monkeypatch, Settings())
    half = detect_fake_card(monkeypatch, HALF)
    (card,) = half.gpus
    assert card.memory_total_mib == 24564 and card.usable_mib == 11770
    assert half.groups[0].usable_mib_per_gpu == 11770 and half.effective_vram_mib == 11770
    full_engine = only_engine(plan(whole, assign(6000), Settings()))
    half_engine = only_engine(plan(half, assign(6000), HALF))
    assert full_engine.memory_mib == whole.gpus[0].usable_mib > 20000
    assert half_engine.memory_mib == 11770 <= card.memory_total_mib // 2
    # vLLM is told the share: 11,770 of 24,564 MiB, rounded down, and never more than the half
    assert half_engine.memory_utilization == 0.479 and (full_engine.memory_utilization or 0) > 0.85
    assert half_engine.argv()[half_engine.argv().index("--gpu-memory-utilization") + 1] == "0.479"


def test_a_share_too_small_for_the_model_refuses_the_assignment(monkeypatch: pytest.MonkeyPatch) -> None:
    tenth = detect_fake_card(monkeypatch, Settings(memory_share_pct=((0, 10),)))
    assert tenth.gpus[0].usable_mib == 24564 // 10 - 512
    refused = plan(tenth, assign(6000), Settings())
    assert isinstance(refused, Refusal) and refused.reason


def test_a_share_changed_later_holds_from_the_next_plan_without_detecting_again() -> None:
    machine = replay("rtx4090x2-no-p2p.json")
    assert with_shares(machine, Settings()) == machine
    one_half = with_shares(machine, Settings(memory_share_pct=((1, 50),)))
    assert [g.usable_mib for g in one_half.gpus] == [21070, 24564 // 2 - 512]
    assert one_half.groups[0].usable_mib_per_gpu == 11770 and one_half.effective_vram_mib == 2 * 11770
    assert [e.memory_mib for e in only_engines(plan(one_half, assign(17800), Settings()))] == [2 * 11770]
    assert with_shares(one_half, Settings()) == machine  # lifting the limit gives the card back


def test_a_card_not_lent_stays_out_whatever_its_share() -> None:
    machine = replay("rtx4090-rtx3060.json", Settings(gpus_to_lend=(1,)))
    shared = with_shares(machine, Settings(gpus_to_lend=(1,), memory_share_pct=((0, 100), (1, 50))))
    assert [g.usable_mib for g in shared.gpus] == [0, shared.gpus[1].memory_total_mib // 2 - 512]
    assert [g.gpu_indices for g in shared.groups] == [(1,)]


def test_apple_and_cpu_machines_are_left_as_they_are() -> None:
    for name in ("m4-max-128gb.json", "no-gpu.json"):
        machine = replay(name)
        assert with_shares(machine, HALF) == machine


async def test_vllms_fresh_memory_share_is_held_to_the_lenders_share() -> None:
    """After vLLM found memory held, the share it restarts with is measured again: within the limit."""
    machine = replay("rtx4090.json")
    engine = only_engine(plan(machine, assign(6000), Settings()))
    calls = {"device_count": 1, "memory:0": {"total_mib": 24564, "free_mib": 23000, "used_mib": 1564}}
    watch = GpuWatch(ReplaySource(dict(calls)))
    assert await watch.memory_share(machine, engine, Settings()) == 0.821  # 0.9 × 23,000 − 512 = 20,188
    assert await watch.memory_share(machine, engine, HALF) == 0.479  # 11,770 of 24,564
    capped = replace(engine, memory_cap=0.3)
    assert await watch.memory_share(machine, capped, HALF) == 0.3


def only_engines(result: Plan | Refusal) -> tuple[EnginePlan, ...]:
    assert isinstance(result, Plan), result
    return tuple(result.engines)
