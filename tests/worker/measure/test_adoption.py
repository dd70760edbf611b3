"""The adoption rule: its decisions, and its error rates simulated with the run-to-run spreads
measured on the real llama-server (`tests/fixtures/tune/llamacpp-cpu-spread.json`)."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

import pytest

from worker.measure.adoption import BELOW_THRESHOLD, REPEATS, UNSTABLE, decide, decide_blocks, spread_pct
from worker.node.tuner import TunerSettings

SPREADS = Path(__file__).resolve().parents[2] / "fixtures" / "tune" / "llamacpp-cpu-spread.json"
MIN_GAIN_PCT = 3.0
CANDIDATES = 10
SCREEN_RUNS = 3  # each candidate's first measurement, before the best is re-measured


def measured_sigmas() -> list[float]:
    """Each recorded config's spread, as the standard deviation of log tok/s."""
    configs = json.loads(SPREADS.read_text(encoding="utf-8"))["configs"]
    assert configs and all(len(config["runs"]) >= 3 for config in configs)
    return [math.log1p(spread_pct(config["runs"]) / 100) for config in configs]


def runs(rng: random.Random, sigma: float, count: int, factor: float = 1.0) -> list[float]:
    """`count` runs of a config `factor` times as fast as 100 tok/s, with log-normal noise."""
    return [100 * factor * math.exp(rng.gauss(0, sigma)) for _ in range(count)]


def threshold(sigma: float) -> float:
    """The contract's threshold as a log ratio: max(min gain, twice the spread of two runs apart)."""
    return max(math.log1p(MIN_GAIN_PCT / 100), 2 * math.sqrt(2) * sigma)


@pytest.mark.parametrize("sigma", measured_sigmas())
def test_with_no_true_gain_at_most_one_in_forty_is_adopted(sigma: float) -> None:
    rng = random.Random(25)
    adopted = sum(decide(runs(rng, sigma, REPEATS), runs(rng, sigma, REPEATS), MIN_GAIN_PCT).adopted
                  for _ in range(10_000))
    assert adopted <= 250


@pytest.mark.parametrize("sigma", measured_sigmas())
def test_a_true_gain_of_twice_the_threshold_is_adopted_nine_times_in_ten(sigma: float) -> None:
    """Twice as ratios compound: (1 + threshold)²."""
    rng = random.Random(26)
    factor = math.exp(2 * threshold(sigma))
    adopted = sum(decide(runs(rng, sigma, REPEATS), runs(rng, sigma, REPEATS, factor), MIN_GAIN_PCT).adopted
                  for _ in range(10_000))
    assert adopted >= 9_000


def best_of_ten_then_remeasured(rng: random.Random, sigma: float) -> bool:
    """Ten candidates as fast as the baseline: the one that screened best (the luckiest) is
    re-measured interleaved with the baseline, and only that decides."""
    def screened(_: int) -> float:
        return statistics.median(c / b for b, c in zip(runs(rng, sigma, SCREEN_RUNS), runs(rng, sigma, SCREEN_RUNS)))

    luckiest = max(range(CANDIDATES), key=screened)
    assert 0 <= luckiest < CANDIDATES
    return decide(runs(rng, sigma, REPEATS), runs(rng, sigma, REPEATS), MIN_GAIN_PCT).adopted


@pytest.mark.parametrize("sigma", measured_sigmas())
def test_ten_equal_candidates_are_never_adopted(sigma: float) -> None:
    rng = random.Random(27)
    assert sum(best_of_ten_then_remeasured(rng, sigma) for _ in range(1_000)) == 0


def test_the_screening_alone_would_adopt_the_luckiest_of_ten() -> None:
    """Why the re-measure: judged on the runs that picked it, the best of ten equal ones often
    looks faster than the noise allows."""
    rng = random.Random(28)
    sigma = 0.05
    fooled = 0
    for _ in range(200):
        screens = [(runs(rng, sigma, SCREEN_RUNS), runs(rng, sigma, SCREEN_RUNS)) for _ in range(CANDIDATES)]
        base, best = max(screens, key=lambda s: statistics.median(c / b for b, c in zip(*s)))
        fooled += decide(base, best, MIN_GAIN_PCT).adopted
    assert fooled >= 10


# --- blocks: each a fresh start of both engines ------------------------------------------------

QUIET_SIGMA = 0.03  # stated: a quiet machine's run-to-run spread, 3 %
START_SIGMA = 0.15  # stated: a fresh start shifts a config's speed as a whole by 15 % (one sd)
BLOCKINGS = [(TunerSettings().pairs, TunerSettings().blocks), (6, 2), (6, 3)]  # the tuner's, the real test's


def blocked(rng: random.Random, sigma: float, start_sigma: float, pairs: int, blocks: int,
            factor: float = 1.0) -> list[list[float]]:
    """`pairs` runs in `blocks` starts, each start's speed shifted as a whole."""
    sizes = [pairs // blocks + (1 if b < pairs % blocks else 0) for b in range(blocks)]
    return [[run * math.exp(shift) for run in runs(rng, sigma, size, factor)]
            for size, shift in ((size, rng.gauss(0, start_sigma)) for size in sizes)]


@pytest.mark.parametrize(("pairs", "blocks"), BLOCKINGS)
def test_a_shift_from_start_to_start_is_noise_too(pairs: int, blocks: int) -> None:
    """Runs of one start agree closely, starts do not: judged on its runs alone (every run one
    block) a candidate with no true gain is adopted too often; judged with its blocks, seldom."""
    rng = random.Random(29)
    flat = grouped = 0
    for _ in range(10_000):
        base, cand = blocked(rng, QUIET_SIGMA, START_SIGMA, pairs, blocks), blocked(rng, QUIET_SIGMA, START_SIGMA, pairs, blocks)
        flat += decide([r for b in base for r in b], [r for c in cand for r in c], MIN_GAIN_PCT).adopted
        grouped += decide_blocks(base, cand, MIN_GAIN_PCT).adopted
    assert flat > 250 and grouped <= 250, (flat, grouped)


@pytest.mark.parametrize("sigma", measured_sigmas())
def test_in_blocks_a_true_gain_of_twice_the_threshold_is_adopted_nine_times_in_ten(sigma: float) -> None:
    """As the tuner measures at its usual budget and at an hour's (three blocks of two pairs, a
    short budget's, need the tuner's one more block now and then: `test_tune_llamacpp`)."""
    rng = random.Random(30)
    factor = math.exp(2 * threshold(sigma))
    for pairs, blocks in [(s.pairs, s.blocks) for s in (TunerSettings(), TunerSettings.for_budget(60))]:
        adopted = sum(decide_blocks(blocked(rng, sigma, 0.0, pairs, blocks),
                                    blocked(rng, sigma, 0.0, pairs, blocks, factor), MIN_GAIN_PCT).adopted
                      for _ in range(2_000))
        assert adopted >= 1_800, (pairs, blocks, adopted)


def test_blocks_that_disagree_on_the_sign_are_unstable() -> None:
    steady = [100.0, 101.0, 99.0]
    decision = decide_blocks([steady, steady, steady], [[r * 1.3 for r in steady], [r * 1.3 for r in steady],
                                                         [r * 0.98 for r in steady]], MIN_GAIN_PCT)
    assert decision.gain_pct == pytest.approx(30.0) and not decision.adopted and decision.reason == UNSTABLE


def test_two_blocks_must_agree_far_more_closely_than_four() -> None:
    """Four blocks of +20 %, +30 %, +20 %, +30 % pass; two of +20 % and +30 % are as likely a shift
    of the starts as a gain."""
    steady = [100.0, 100.5, 99.5]
    def gains(*pcts: float) -> tuple[list[list[float]], list[list[float]]]:
        return [steady] * len(pcts), [[r * (1 + pct / 100) for r in steady] for pct in pcts]
    assert decide_blocks(*gains(20, 30, 20, 30), MIN_GAIN_PCT).adopted
    two = decide_blocks(*gains(20, 30), MIN_GAIN_PCT)
    assert not two.adopted and two.reason == UNSTABLE and two.noise_pct > 15


# --- decisions ---------------------------------------------------------------------------------

def test_a_clear_gain_is_adopted_with_its_figures() -> None:
    baseline = [100.0, 101.0, 99.0, 100.5, 99.5, 100.0]
    decision = decide(baseline, [run * 1.10 for run in baseline], MIN_GAIN_PCT)
    assert decision.adopted and decision.reason is None
    assert decision.gain_pct == pytest.approx(10.0)
    assert 0 < decision.noise_pct < 2


def test_a_gain_below_the_minimum_is_kept_out_however_steady() -> None:
    baseline = [100.0, 100.1, 99.9, 100.0]
    decision = decide(baseline, [run * 1.02 for run in baseline], MIN_GAIN_PCT)
    assert not decision.adopted and decision.reason == BELOW_THRESHOLD


def test_a_gain_within_twice_the_noise_is_unstable() -> None:
    baseline = [100.0, 108.0, 92.0, 104.0, 96.0, 100.0]
    candidate = [110.0, 98.0, 114.0, 102.0, 106.0, 110.0]
    decision = decide(baseline, candidate, MIN_GAIN_PCT)
    assert decision.gain_pct >= MIN_GAIN_PCT and decision.noise_pct > 5
    assert not decision.adopted and decision.reason == UNSTABLE


def test_one_wild_run_moves_neither_the_gain_nor_the_noise() -> None:
    baseline = [100.0, 100.5, 99.5, 100.2, 99.8, 100.0, 100.1, 99.9]
    candidate = [run * 1.08 for run in baseline]
    steady = decide(baseline, candidate, MIN_GAIN_PCT)
    candidate[3] = 20.0  # a game started during this run
    wild = decide(baseline, candidate, MIN_GAIN_PCT)
    assert wild.adopted and wild.gain_pct == pytest.approx(steady.gain_pct, abs=0.5)
    assert wild.noise_pct < 2


def test_drift_cancels_pair_by_pair() -> None:
    """The machine slows 3 % a run (it warms up), each candidate run beside a baseline run: the
    10 % gain shows as 10 % less one run's drift, and the drift is no noise."""
    baseline = [100.0 * 0.97**i for i in range(0, 24, 2)]
    candidate = [110.0 * 0.97**i for i in range(1, 24, 2)]
    decision = decide(baseline, candidate, MIN_GAIN_PCT)
    assert decision.adopted and decision.gain_pct == pytest.approx(6.7) and decision.noise_pct < 0.1


@pytest.mark.parametrize(("baseline", "candidate"), [([100.0], [110.0]), ([100.0, 101.0], [110.0]),
                                                     ([100.0, 0.0], [110.0, 111.0]),
                                                     ([100.0, float("nan")], [110.0, 111.0])])
def test_too_few_unpaired_or_impossible_runs_are_refused(baseline: list[float], candidate: list[float]) -> None:
    with pytest.raises(ValueError):
        decide(baseline, candidate, MIN_GAIN_PCT)


@pytest.mark.parametrize(("baseline", "candidate"), [([[100.0], [101.0]], [[110.0, 111.0], []]),
                                                     ([[100.0, 101.0], []], [[110.0, 111.0], []]),
                                                     ([[100.0, 101.0]], [[110.0, 111.0], [112.0]])])
def test_blocks_that_do_not_pair_up_are_refused(baseline: list[list[float]], candidate: list[list[float]]) -> None:
    with pytest.raises(ValueError):
        decide_blocks(baseline, candidate, MIN_GAIN_PCT)


def test_one_configs_spread_is_robust_and_in_percent() -> None:
    assert spread_pct([100.0, 100.0, 100.0]) == 0.0
    assert spread_pct([95.0, 100.0, 105.0, 100.0, 98.0]) == pytest.approx(3.0, abs=1.0)
    assert spread_pct([95.0, 100.0, 105.0, 100.0, 5000.0]) < 10  # one run of fifty times: still a few %
