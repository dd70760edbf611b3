"""Earnings net of electricity only where this machine's serving power is measured: the node's
second (`Sampler`) on a card that `fake_pynvml` answers for, and on a node without NVML (a Mac,
a CPU machine), into a real ledger on disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.fake_pynvml import FakeCard, FakeNvml
from worker.contract.events import EarningsSnapshot
from worker.contract.protocol import Price
from worker.hardware import PynvmlSource
from worker.measure.gpu_watch import GpuWatch
from worker.measure.ledger import Books
from worker.measure.metering import Metering
from worker.node.sampler import Sampler
from worker.system.config import Settings

PRICE = Price(currency="USD", per_million_output_tokens=0.40)
WATTS = 300


class Node:
    """The sampling half of a node: an engine run that serves, its minutes on the clock."""

    def __init__(self, tmp_path: Path, gpus: GpuWatch, card: FakeCard | None) -> None:
        self.now = 1_764_064_800.0  # 2025-11-25 10:00 UTC: the day cannot turn during the test
        self.card = card
        self.books = Books(tmp_path / "ledger.sqlite", lambda: "USD", lambda: 0.30)
        self.books.open()
        metering = Metering(lambda engine_id: None, self.books, lambda: None, clock=lambda: self.now)
        metering.start_run("engine-0", "run-1")  # an engine serves: the ledger counts serving minutes
        self.sampler = Sampler(gpus, self.books, metering, cards=lambda: {0}, targets=list,
                               in_flight=lambda: 0, settings=lambda: Settings(electricity_price_per_kwh=0.30),
                               clock=lambda: self.now)

    async def serve(self, minutes: int) -> EarningsSnapshot:
        """`minutes` of serving, a sample a minute (the card's energy counter is exact across the
        gap), 0.40 earned, then the summary the app is shown."""
        for _ in range(minutes):
            self.now += 60
            if self.card is not None and self.card.energy_mj is not None:
                self.card.energy_mj += WATTS * 60 * 1000
            await self.sampler.sample()
        self.books.use(lambda ledger: ledger.record_request("r-1", "run-1", "m", 0, 1_000_000, PRICE, self.now))
        self.books.flush(self.now)
        summary = self.books.use(lambda ledger: ledger.summary(self.now, "USD", 0.30))
        assert summary is not None
        return summary


async def test_a_card_whose_power_reads_makes_earnings_net_of_electricity(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    card = FakeCard(power_mw=WATTS * 1000, energy_mj=1_000_000)
    FakeNvml([card]).install(monkeypatch)
    node = Node(tmp_path, GpuWatch(PynvmlSource()), card)
    summary = await node.serve(30)
    kwh = WATTS * 30 / 60 / 1000  # the first sample starts the count: 29 of the 30 minutes drawn
    assert summary.power_measured
    assert summary.energy_kwh_today == pytest.approx(kwh * 29 / 30)
    assert summary.net_today == pytest.approx(0.40 - kwh * 29 / 30 * 0.30)
    assert summary.net_per_hour is not None and summary.net_per_hour < 0.40 * 2  # the electricity is taken off


async def test_a_node_without_nvml_says_its_power_is_not_measured_and_nets_nothing(tmp_path: Path) -> None:
    node = Node(tmp_path, GpuWatch(None), None)
    summary = await node.serve(30)
    assert not summary.power_measured
    assert summary.energy_kwh_today == 0.0 and summary.net_today == summary.today == pytest.approx(0.40)
    assert summary.net_per_hour == pytest.approx(0.40 * 2)
    assert summary.projected_per_day == pytest.approx(0.40 * 2 * 24)
