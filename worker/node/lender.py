"""The lender's limits and downloads as the node carries them out. Each second the guard's verdict
becomes the relay's cap of requests at once, the limits shown (snapshot) and sent (`hello`,
`status`), and the pause the node should take or lift (`policy.guard_event`); downloads wait while
the node is paused (a game's pause names the game), obey the bandwidth limit and the monthly
budget, and stop when the person cancels. The node gathers the readings and carries the pause
out; this keeps what lies between: the guard, the transfer control, the person's override."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from worker.contract import protocol
from worker.contract.events import DownloadHold, LimitsSnapshot, MeasuredCapacity
from worker.hardware import GpuSample
from worker.node import policy
from worker.node.guard import Guard, GuardInput, limits_message
from worker.node.tuning import on_battery
from worker.node.view import Pause
from worker.provision.transfer import MonthlyBudget, TransferControl, budget_path
from worker.system.config import Paths, Settings

Hold = tuple[DownloadHold, str | None]


class Lender:
    """The guard, the downloads' control, and the limits as they hold now."""

    def __init__(self, settings: Settings, paths: Paths, cap: Callable[[int | None], None], *,
                 monotonic: Callable[[], float] = time.monotonic, clock: Callable[[], float] = time.time) -> None:
        """`cap` sets the relay's limit of requests at once (the lender's own from the start)."""
        self._settings = settings
        self._paths = paths
        self._cap = cap
        self._clock = clock
        self._monotonic = monotonic
        self._guard = Guard(settings, clock=monotonic)
        self.downloads = TransferControl(limit_mib_s=settings.download_limit_mib_s, budget=self._budget(settings))
        self.limits = LimitsSnapshot(settings.max_requests, settings.memory_share_pct)
        self._overridden: str | None = None  # a guard's reason the person resumed over, until it clears
        self._hold: Hold | None = None  # the hold the node's pause puts on downloads
        cap(settings.max_requests)

    def update_settings(self, settings: Settings) -> None:
        self._settings = settings
        self._guard.update_settings(settings)
        self.downloads.set_limit(settings.download_limit_mib_s)
        self.downloads.set_budget(self._budget(settings))

    def judge(self, pause: Pause | None, *, samples: Iterable[GpuSample], capacity: MeasuredCapacity | None,
              price: protocol.Price | None, serving: bool, in_flight: int) -> policy.Event | None:
        """This second's readings (the cards' samples, the measured speed, the network's price):
        the cap and the limits set; the guard's pause to take or lift."""
        verdict = self._guard.judge(self._readings(samples, capacity, price, serving, in_flight))
        self._cap(verdict.max_requests)
        wire = limits_message(self._settings, verdict)
        self.limits = LimitsSnapshot(wire.max_requests, self._settings.memory_share_pct, wire.reason, verdict.words)
        if verdict.pause is None:
            self._overridden = None
        return policy.guard_event(pause, verdict.pause, verdict.pause_detail, self._overridden)

    def _readings(self, samples: Iterable[GpuSample], capacity: MeasuredCapacity | None,
                  price: protocol.Price | None, serving: bool, in_flight: int) -> GuardInput:
        """The lent cards' temperatures and power; gross an hour at the last measured speed."""
        lent = self._settings.gpus_to_lend
        cards = [s for s in samples if lent is None or s.index in lent]
        powers = [s.power_w for s in cards]
        gross = (capacity.tokens_per_s * 3600 * price.per_million_output_tokens / 1e6
                 if capacity is not None and price is not None else None)
        power = sum(p for p in powers if p is not None) if powers and None not in powers else None
        return GuardInput(now=self._monotonic(), temperatures_c={s.index: s.temperature_c for s in cards},
                          on_battery=on_battery(), gross_per_hour=gross, power_w=power,
                          electricity_price_per_kwh=self._settings.electricity_price_per_kwh, serving=serving,
                          in_flight=in_flight)

    def person_resumed(self, pause: Pause | None) -> None:
        """The person's Resume over a guard's pause stands until that reason clears."""
        if pause is not None and pause.reason in policy.GUARD_REASONS:
            self._overridden = pause.reason

    def follow_pause(self, pause: Pause | None) -> None:
        """Downloads wait while the node is paused, so the bandwidth is the person's; changed only
        when the pause changes, so a waiting download never slips a chunk through."""
        hold: Hold | None = None
        if pause is not None:
            hold = ("game", pause.detail) if pause.reason == "game" else ("paused", None)
        if hold != self._hold:
            self.release_downloads()
            if hold is not None:
                self.downloads.hold(*hold)
            self._hold = hold

    def release_downloads(self) -> None:
        """The pause's hold lifted now (a resume that may wait for the engines lock a held download keeps)."""
        if self._hold is not None:
            self.downloads.release(self._hold[0])
            self._hold = None

    def _budget(self, settings: Settings) -> MonthlyBudget | None:
        if settings.monthly_download_gib is None:
            return None
        return MonthlyBudget(budget_path(self._paths), settings.monthly_download_gib, clock=self._clock)
