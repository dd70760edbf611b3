"""Serving's electricity from GPU samples: joules drawn between one sample and the next, per card."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Reading:
    at: float
    power_w: float | None
    energy_mj: int | None


class EnergyIntegrator:
    """Power samples → joules drawn since the previous sample, per GPU.

    NVML's total-energy counter (mJ) is exact across any gap and preferred; it is only trusted
    while it moves forward (a driver reload resets it). Otherwise power is integrated with the
    trapezoid rule, but only across gaps up to `max_gap_s`: energy over a longer gap (the app was
    closed, the machine slept) is unknown and left out rather than invented.
    """

    def __init__(self, max_gap_s: float = 10.0) -> None:
        self._max_gap_s = max_gap_s
        self._last: dict[int, _Reading] = {}

    def add(self, gpu_index: int, at: float, power_w: float | None, energy_mj: int | None = None) -> float:
        """Joules this GPU drew between its previous sample and this one (0 for the first)."""
        previous = self._last.get(gpu_index)
        self._last[gpu_index] = _Reading(at, power_w, energy_mj)
        if previous is None or at <= previous.at:
            return 0.0
        if energy_mj is not None and previous.energy_mj is not None and energy_mj >= previous.energy_mj:
            return (energy_mj - previous.energy_mj) / 1000.0
        if power_w is None or previous.power_w is None or at - previous.at > self._max_gap_s:
            return 0.0
        return max(0.0, (power_w + previous.power_w) / 2 * (at - previous.at))
