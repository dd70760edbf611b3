"""The node's once-a-second sampling: GPU telemetry, the electricity serving drew, the engines'
/metrics and the chart history. Off the loop where it waits (NVML, SQLite): the event loop keeps
relaying while a card is slow to answer or the ledger is written.

Serving's electricity is only what the cards engines run on drew while they ran: none while
paused (a game's is the player's), none from a card no engine uses (an engine on the CPU beside an
idle graphics card draws nothing NVML can tell apart). Points are kept in memory each second and written every few (`Books.flush`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence

from worker.measure.gpu_watch import GpuWatch
from worker.measure.ledger import Books
from worker.measure.metering import Metering
from worker.node.failures import OncePerKind
from worker.node.view import chart_points
from worker.relay.forward import EngineTarget
from worker.system.config import Settings

log = logging.getLogger(__name__)

TICK_S = 1.0


class Sampler:
    """What is sampled each second, and where it goes."""

    def __init__(self, gpus: GpuWatch, books: Books, metering: Metering, *, cards: Callable[[], Collection[int]],
                 targets: Callable[[], Sequence[EngineTarget]], in_flight: Callable[[], int],
                 settings: Callable[[], Settings], clock: Callable[[], float] = time.time) -> None:
        """`cards`: the GPUs running engines use now (serving draws their power); `targets`: the ready engines."""
        self._gpus = gpus
        self._books = books
        self._metering = metering
        self._cards = cards
        self._targets = targets
        self._in_flight = in_flight
        self._settings = settings
        self._clock = clock
        self._failures = OncePerKind(log)

    async def run(self, each_second: Callable[[], Awaitable[None]], tick_s: float = TICK_S) -> None:
        """Sample, then the node's own second (`each_second`: a timed pause's end, heartbeats),
        forever. A second that fails is logged (once per kind) and the next one runs: status
        messages, energy, charts and a timed pause's end never stop for one bad second."""
        while True:
            await asyncio.sleep(tick_s)
            await self._survive("sampling the GPUs and engines", self.sample)
            await self._survive("the node's second", each_second)

    async def _survive(self, where: str, step: Callable[[], Awaitable[None]]) -> None:
        try:
            await step()
        except Exception as exc:
            self._failures.failed(where, exc)
        else:
            self._failures.worked(where)

    async def sample(self) -> None:
        """One second's telemetry, energy, engine /metrics and chart points."""
        now = self._clock()
        by_card = await self._gpus.sample(now)
        serving = self._cards()
        joules = sum(drawn for index, drawn in by_card.items() if index in serving)
        if joules:
            settings = self._settings()
            self._books.add_energy(joules, now, settings.electricity_price_per_kwh, settings.currency)
        await self._metering.scrape(self._targets(), busy=self._in_flight() > 0)
        rows = chart_points(self._metering.figures(), self._metering.mean_kv_usage(), self._gpus.samples.values())
        if self._books.add_samples(rows, now):
            await asyncio.to_thread(self._books.flush, now)
