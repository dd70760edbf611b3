"""The node's second: what is sampled, and where it goes. The GPU is `fake_pynvml` (the `pynvml`
module as the driver answers it), the ledger a real one on disk."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from tests.support.fake_pynvml import FakeCard, FakeNvml
from worker.hardware import PynvmlSource
from worker.measure.gpu_watch import GpuWatch
from worker.measure.ledger import Books
from worker.measure.metering import Metering
from worker.node.sampler import Sampler
from worker.system.config import Settings


class Rig:
    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.card = FakeCard(power_mw=300_000, energy_mj=1_000_000)
        FakeNvml([self.card]).install(monkeypatch)
        self.now = 1_760_000_000.0
        self.cards: set[int] = set()  # the GPUs engines run on
        self.books = Books(tmp_path / "ledger.sqlite", lambda: "EUR", lambda: 0.30)
        self.books.open()
        self.gpus = GpuWatch(PynvmlSource())
        metering = Metering(lambda engine_id: None, self.books, lambda: None, clock=lambda: self.now)
        self.sampler = Sampler(self.gpus, self.books, metering, cards=lambda: self.cards, targets=list,
                               in_flight=lambda: 0, settings=lambda: Settings(electricity_price_per_kwh=0.30),
                               clock=lambda: self.now)

    async def second(self, drawn_j: int) -> None:
        """One second on which the card drew `drawn_j` joules."""
        self.now += 1.0
        assert self.card.energy_mj is not None
        self.card.energy_mj += drawn_j * 1000
        await self.sampler.sample()

    def kwh(self) -> float:
        self.books.flush(self.now)
        summary = self.books.use(lambda ledger: ledger.summary(now=self.now))
        assert summary is not None
        return summary.energy_kwh_today


@pytest.fixture
def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Rig:
    return Rig(tmp_path, monkeypatch)


async def test_energy_counts_only_while_engines_run(rig: Rig) -> None:
    await rig.second(0)  # the counter's first reading: nothing to integrate yet
    await rig.second(360_000)  # 0.1 kWh, not serving (paused: a game's is the player's)
    assert rig.kwh() == 0.0
    rig.cards = {0}
    await rig.second(360_000)
    assert rig.kwh() == pytest.approx(0.1)


async def test_a_card_no_engine_runs_on_is_not_serving_electricity(rig: Rig) -> None:
    """An engine on the CPU (or on another card) beside this one: its draw is the desktop's."""
    rig.cards = {1}
    await rig.second(0)
    await rig.second(360_000)
    assert rig.kwh() == 0.0


async def test_each_card_is_charted_every_second(rig: Rig) -> None:
    await rig.second(0)
    assert rig.books.chart("gpu0.power_w", 0.0)[-1] == (rig.now, pytest.approx(300.0))
    await rig.second(0)
    assert len(rig.books.chart("gpu0.power_w", 0.0)) == 2


async def test_run_samples_then_hands_each_second_to_the_node(rig: Rig) -> None:
    seconds: list[int] = []

    async def each_second() -> None:
        seconds.append(len(rig.books.chart("gpu0.power_w", 0.0)))  # the sample came first
        if len(seconds) == 3:
            raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await rig.sampler.run(each_second, tick_s=0.001)
    assert seconds == [1, 2, 3]


async def test_a_second_that_fails_is_logged_once_per_kind_and_the_next_one_runs(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    seconds: list[int] = []

    async def each_second() -> None:
        seconds.append(len(seconds) + 1)
        if len(seconds) in (1, 2, 3):
            raise PermissionError(13, "Access is denied", "status.json")  # a file Windows keeps locked
        if len(seconds) == 4:
            raise RuntimeError("a bug in one second")
        if len(seconds) == 6:
            raise asyncio.CancelledError

    with caplog.at_level(logging.DEBUG, logger="worker.node.sampler"), pytest.raises(asyncio.CancelledError):
        await rig.sampler.run(each_second, tick_s=0.001)
    assert seconds == [1, 2, 3, 4, 5, 6]
    assert len(rig.books.chart("gpu0.power_w", 0.0)) == 6  # sampling went on through the failures
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.exc_info[0] if r.exc_info else None for r in errors] == [PermissionError, RuntimeError]
    assert any("works again" in r.getMessage() for r in caplog.records)
