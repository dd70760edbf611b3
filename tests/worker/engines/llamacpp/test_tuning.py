"""llama.cpp's tuning: knobs only from its allowlist, the per-request context kept as slots change,
threads held to the machine's cores."""

from __future__ import annotations

import pytest

from worker.engines.base import argument_values
from worker.engines.llamacpp import tuning
from worker.engines.llamacpp.args import ALLOWLIST
from worker.hardware.model import Machine


def machine(cores: int = 8) -> Machine:
    return Machine(os="linux", runtime="cpu", arch="x86_64", cpu_model="cpu", cpu_cores=cores, ram_mib=32768)


def test_every_knob_and_never_flag_is_an_allowlisted_spelling() -> None:
    names = {flag.name for flag in ALLOWLIST.flags}
    spellings = set(ALLOWLIST.published())
    assert {knob.flag for knob in tuning.KNOBS} <= names
    assert tuning.NEVER <= spellings
    assert not {knob.flag for knob in tuning.KNOBS} & tuning.NEVER
    assert {"-c", "--ctx-size", "-ctk", "-ctv", "-ngl"} <= tuning.NEVER


def test_more_slots_scale_the_context_so_each_request_keeps_its_own() -> None:
    fixed = tuning.fix(("-c", "2048", "-np", "1"), ("-np", "4"), machine())
    assert fixed == ("-np", "4", "-c", "8192")
    assert tuning.fix(("--ctx-size", "8192", "--parallel", "4"), ("-np", "2"), machine()) == ("-np", "2", "-c", "4096")


def test_automatic_slots_share_one_buffer_so_the_context_stays_and_stays_shared() -> None:
    fixed = tuning.fix(("-c", "4096"), ("-np", "8"), machine())
    assert fixed is not None and argument_values(fixed, ALLOWLIST) == {"-np": "8", "-kvu": "on"}
    assert tuning.fix(("-c", "4096", "-np", "2", "-kvu"), ("-np", "8"), machine()) == ("-np", "8")


def test_the_models_own_context_cannot_be_split_over_other_slots() -> None:
    assert tuning.fix(("-np", "1"), ("-np", "2"), machine()) is None
    assert tuning.fix(("-np", "1", "-c", "0"), ("-np", "2"), machine()) is None
    assert tuning.fix(("-np", "1"), ("-b", "1024"), machine()) == ("-b", "1024")


@pytest.mark.parametrize("flag", ["-t", "-tb"])
def test_threads_never_exceed_the_machines_cores(flag: str) -> None:
    assert tuning.fix((), (flag, "16"), machine(cores=6)) == (flag, "6")
    assert tuning.fix((), (flag, "4"), machine(cores=6)) == (flag, "4")


def test_a_physical_batch_above_the_logical_one_is_no_candidate() -> None:
    assert tuning.fix(("-b", "512"), ("-ub", "1024"), machine()) is None
    assert tuning.fix((), ("-b", "256"), machine()) is None  # the default -ub 512 would be clamped
    assert tuning.fix(("--spec-draft-n-min", "8"), ("--spec-draft-n-max", "4"), machine()) is None


def test_threads_default_to_the_cores() -> None:
    assert tuning.defaults(machine(cores=12)) == {"-t": "12", "-tb": "12"}
