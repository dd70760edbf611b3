"""SGLang's tuning: knobs only from its allowlist, note 004's seed, its own drafter-graph warnings."""

from __future__ import annotations

from worker.engines.sglang import tuning
from worker.engines.sglang.args import ALLOWLIST


def test_every_knob_seed_and_never_flag_is_on_the_allowlist() -> None:
    names = {flag.name for flag in ALLOWLIST.flags}
    assert {knob.flag for knob in tuning.KNOBS} <= names
    assert tuning.NEVER <= set(ALLOWLIST.published(allow_remote_code=True))
    assert all(ALLOWLIST.check(seed) is None for seed in tuning.SEEDS)
    assert "--disable-cuda-graph" not in {knob.flag for knob in tuning.KNOBS}  # appended, it could never be undone


def test_the_drafter_losing_its_graph_is_a_trap() -> None:
    line = ("[2026-12-02 02:40:01] Disable DSpark draft cuda graph because only 0.62 GB GPU memory is available "
            "after target backend initialization.")
    assert tuning.TUNING.trap(line) == "trap:drafter_graph_off"
    assert tuning.TUNING.trap("can't use cuda graph for draft extend! may have correctness issue!") \
        == "trap:drafter_graph_off"
    assert tuning.TUNING.trap("Capture cuda graph end. Time elapsed: 12.3 s") is None
