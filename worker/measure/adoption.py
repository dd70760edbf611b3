"""Whether a tuned candidate beats the baseline by more than the machine's own noise.

Pure. The contract's rule: re-measured interleaved with the baseline, a candidate is adopted only
if it beats it by at least max(`min_gain_pct`, twice the measured run-to-run spread). Here:

- the gain is the median of the interleaved pairs' ratios (candidate ÷ the baseline run beside
  it), so slow drift (a warming CPU, a throttling card) cancels pair by pair;
- the run-to-run spread is how far two runs of one start fall apart, measured two ways and the
  larger kept: between each run of a config and its next (so drift, slow from run to run, hardly
  counts), and between each pair's ratio and the next's (candidate and baseline side by side);
- both are medians of absolute deviations, scaled to a standard deviation, so the odd wild run a
  busy machine produces moves neither; and both are taken on the logarithm of tok/s, so a
  doubling and a halving are the same size and a large noise still compounds honestly;
- runs come in blocks, each a fresh start of both engines, and a start can shift a config's speed
  as a whole (where its memory landed, a cache, another program), which successive runs of one
  start never show: the noise is the larger of the run-to-run spread and what the spread of the
  blocks' own gains can fake (half the gain that blocks as far apart fake one time in a hundred,
  Student's t: two blocks must agree far more closely than four; a hundred, not forty, as the
  tuner may look again after another block), and blocks that disagree on the gain's sign make the
  result `UNSTABLE` (the tuner measures another block while its budget lasts).

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
# Student's t, one-sided 1 %, for 1, 2, … degrees of freedom (the last stands for more): stricter
# than one in forty, because the tuner may look again after one more block (up to twice as many)
T_99 = (31.821, 6.965, 4.541, 3.747, 3.365, 3.143, 2.998, 2.896, 2.821, 2.764, 2.718, 2.681)
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
    """`decide_blocks` for runs all made on one start of each engine."""
    return decide_blocks([baseline], [candidate], min_gain_pct)


def decide_blocks(baseline: Sequence[Sequence[float]], candidate: Sequence[Sequence[float]],
                  min_gain_pct: float) -> Decision:
    """Adopt the candidate only if its gain over the baseline (aggregate tok/s, runs interleaved
    pair by pair, grouped by block: one fresh start of each engine) is at least
    max(`min_gain_pct`, twice the noise), and every block agrees."""
    if (len(baseline) != len(candidate) or any(len(b) != len(c) or not b for b, c in zip(baseline, candidate))
            or sum(map(len, baseline)) < 2):
        raise ValueError("deciding takes the same number (two or more) of interleaved runs of each, "
                         "in blocks of one or more")
    before = [_logs(block) for block in baseline]
    after = [_logs(block) for block in candidate]
    ratios = [[mine - theirs for theirs, mine in zip(b, a)] for b, a in zip(before, after)]
    flat = [ratio for block in ratios for ratio in block]
    within = max(_successive_sd(before, after), _successive_sd(ratios) / math.sqrt(2)) if len(flat) > len(ratios) else _sd(flat)
    gains = [statistics.median(block) for block in ratios]
    between = _block_sd(gains)
    noise = max(within, between)
    gain = statistics.median(flat)
    figures = (_pct(gain), _pct(noise))
    floor = math.log1p(min_gain_pct / 100)
    if gain < floor:
        return Decision(False, *figures, BELOW_THRESHOLD)
    if min(gains) <= 0 or gain < 2 * noise:
        return Decision(False, *figures, UNSTABLE)
    return Decision(True, *figures, None)


def _block_sd(gains: Sequence[float]) -> float:
    """Half the gain that blocks as far apart as these fake one time in a hundred with no true gain
    (Student's t on the blocks' gains), so that `gain < 2 * noise` holds for as few blocks as given."""
    if len(gains) < 2:
        return 0.0
    return T_99[min(len(gains) - 1, len(T_99)) - 1] * statistics.stdev(gains) / math.sqrt(len(gains)) / 2


def _joined(blocks: Sequence[Sequence[float]]) -> list[float]:
    return [value for block in blocks for value in block]


def _logs(runs: Sequence[float]) -> list[float]:
    if any(not run > 0 or math.isinf(run) for run in runs):
        raise ValueError("every run's tok/s must be a positive number")
    return [math.log(run) for run in runs]


def _sd(values: Sequence[float]) -> float:
    middle = statistics.median(values)
    return MAD_TO_SD * statistics.median(abs(value - middle) for value in values)


def _successive_sd(*series: Sequence[Sequence[float]]) -> float:
    """One standard deviation of the step from a value to the next within one block (one start),
    pooled over the series given (each about its own median step, which a steady drift shifts);
    a step from one block to the next is a start's shift, which `_block_sd` weighs instead."""
    deviations: list[float] = []
    for blocks in series:
        steps = [later - earlier for block in blocks for earlier, later in zip(block, block[1:])]
        if steps:
            middle = statistics.median(steps)
            deviations += [abs(step - middle) for step in steps]
    return MAD_TO_SD * statistics.median(deviations) if deviations else 0.0


def _pct(log_ratio: float) -> float:
    return 100 * math.expm1(log_ratio)
