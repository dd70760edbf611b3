"""Auto-tune on the real vLLM (its CPU build, installed once per machine): the model assigned as
`gpu-provider tune` assigns it, planned and provisioned as the node does, tuned by the node's tuner
over `--max-num-seqs` and `--max-num-batched-tokens` with two trials, every one a real vLLM start
through the app's supervisor, measured under load (bench/tune_vllm.py, which prints the same
figures). About 4 minutes on 2 cores: three or five starts of ~45 s.

It cannot say which configuration is faster on this shared CPU, and does not try: it holds the run
to completing within its budget and reporting each configuration's real figures in the
`tune.report` shape. A test here that cannot have the real vLLM fails with the reason; it never
skips.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.tune_vllm import MINUTES, tune_real_vllm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

LEVELS = [1, 2, 4]


async def test_two_trials_over_batch_limits_complete_with_real_figures(tmp_path: Path) -> None:
    report = await tune_real_vllm(tmp_path)
    print(report)
    assert report["type"] == "tune.report" and report["engine_id"]
    assert report["outcome"] in ("adopted", "kept_baseline"), report
    trials = report["trials"]
    assert [trial["args"] for trial in trials] == [[], ["--max-num-seqs", "2"], ["--max-num-batched-tokens", "4096"]]
    assert trials[0]["result"] == "baseline"
    assert all(trial["result"] == "adopted" or trial["result"].startswith("lost:") for trial in trials[1:])
    for trial in trials:  # each configuration served every level of the ladder, with tokens to show for it
        assert [level["concurrency"] for level in trial["levels"]] == LEVELS, trial
        assert all(level["aggregate_tok_s"] > 0 and level["ttft_p90_ms"] > 0 for level in trial["levels"]), trial
    assert all(level["failed"] == 0 for level in trials[0]["levels"])
    assert report["baseline"]["args"][:2] == ["--max-model-len", "4096"]
    if report["outcome"] == "adopted":
        assert report["chosen"]["args"] in (trial["args"] for trial in trials[1:])
        assert report["gain_pct"] >= 3
    assert report["elapsed_s"] <= MINUTES * 60
