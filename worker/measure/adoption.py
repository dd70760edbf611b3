"""Whether a tuned candidate beats the baseline by more than the machine's own noise.

Pure. The contract's rule: re-measured interleaved with the baseline, a candidate is adopted only
if it beats it by at least max(`min_gain_pct`, twice the measured run-to-run spread). Here:

- the gain is the median of the interleaved pairs' ratios (candidate ÷ the baseline run beside
  it), so slow drift (a warming CPU, a throttling card) cancels pair by pair;
- the run-to-run spread is how far two runs fall apart, measured two ways and the larger kept:
  between each run of a config and its next (so drift, slow from run to run, hardly counts), and
  between the pairs' ratios (candidate and baseline runs side by side);
- both are medians of absolute deviations, scaled to a standard deviation, so the odd wild run a
  busy machine produces moves neither; and both are taken on the logarithm of tok/s, so a
  doubling and a halving are the same size and a large noise still compounds honestly.

With `REPEATS` pairs a candidate that is no faster is adopted about twice in 100,000 decisions
(Gaussian noise of any size), and one 2 × the threshold faster is adopted 99 % of the time;
`tests/worker/measure/test_adoption.py` simulates it with the spreads measured on a real engine.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

REPEATS = 12  # interleaved baseline/candidate pairs of the re-measure
MAD_TO_SD = 1.4826  # a normal distribution's standard deviation per median absolute deviation
BELOW_THRESHOLD = "below_threshold"  # it gained less than `min_gain_pct`
UNSTABLE = "unstable"  # it gained `min_gain_pct`, but no more than twice what the noise can fake


@dataclass(frozen=True)
class Decision:
    adopted: bool
    gain_pct: float
    noise_pct: float
    reason: str | None  # why not: `BELOW_THRESHOLD` or `UNSTABLE`; None when adopted


def spread_pct(runs: Sequence[float]) -> float:
    """One config's run-to-run spread: one standard deviation of its runs, % (robust, as above)."""
    return _pct(_sd(_logs(runs)))


def decide(baseline: Sequence[float], candidate: Sequence[float], min_gain_pct: float) -> Decision:
    """Adopt the candidate only if its gain over the baseline (aggregate tok/s, runs interleaved
    pair by pair) is at least max(`min_gain_pct`, twice the run-to-run spread)."""
    if len(baseline) != len(candidate) or len(baseline) < 2:
        raise ValueError("deciding takes the same number (two or more) of interleaved runs of each")
    before, after = _logs(baseline), _logs(candidate)
    ratios = [mine - theirs for theirs, mine in zip(before, after)]
    noise = max(_successive_sd(before, after), _sd(ratios))
    gain = statistics.median(ratios)
    figures = (_pct(gain), _pct(noise))
    if gain < math.log1p(min_gain_pct / 100):
        return Decision(False, *figures, BELOW_THRESHOLD)
    if gain < 2 * noise:
        return Decision(False, *figures, UNSTABLE)
    return Decision(True, *figures, None)


def _logs(runs: Sequence[float]) -> list[float]:
    if any(not run > 0 or math.isinf(run) for run in runs):
        raise ValueError("every run's tok/s must be a positive number")
    return [math.log(run) for run in runs]


def _sd(values: Sequence[float]) -> float:
    middle = statistics.median(values)
    return MAD_TO_SD * statistics.median(abs(value - middle) for value in values)


def _successive_sd(first: Sequence[float], second: Sequence[float]) -> float:
    """One standard deviation of the step from a run to the next run of the same config, over
    both configs (each about its own median step, which a steady drift shifts)."""
    deviations: list[float] = []
    for values in (first, second):
        steps = [later - earlier for earlier, later in zip(values, values[1:])]
        middle = statistics.median(steps)
        deviations += [abs(step - middle) for step in steps]
    return MAD_TO_SD * statistics.median(deviations)


def _pct(log_ratio: float) -> float:
    return 100 * math.expm1(log_ratio)
