from __future__ import annotations

from worker.contract.events import DownloadProgress
from worker.provision.progress import ProgressMeter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_events_are_throttled_and_carry_rate_and_eta() -> None:
    clock, events = Clock(), list[DownloadProgress]()
    meter = ProgressMeter("model m", events.append, clock=clock, max_per_s=5)
    meter.start(0, 1000)

    for step in range(1, 11):
        clock.now += 0.05
        meter.update(step * 50)

    assert len(events) == 1 + 2  # the start, then one per 0.2 s of the 0.5 s that passed
    last = events[-1]
    assert last.rate_bps is not None and abs(last.rate_bps - 1000.0) < 1e-6
    assert last.eta_s is not None and abs(last.eta_s - (1000 - last.done_bytes) / 1000.0) < 1e-6


def test_resumed_bytes_do_not_inflate_the_rate() -> None:
    clock, events = Clock(), list[DownloadProgress]()
    meter = ProgressMeter("model m", events.append, clock=clock)
    meter.start(900, 1000)

    clock.now += 1.0
    meter.update(950)

    assert events[-1].rate_bps == 50.0
    assert events[-1].fraction == 0.95


def test_finish_and_fail_are_always_sent() -> None:
    clock, events = Clock(), list[DownloadProgress]()
    meter = ProgressMeter("model m", events.append, clock=clock)
    meter.start(0, 10)
    meter.update(5)
    meter.fail("cut")
    meter.finish()

    assert events[-2] == DownloadProgress("model m", 5, 10, error="cut")
    assert events[-1].finished and events[-1].done_bytes == 10
