"""Auto-tune's search space, its candidates and the OOM frontier, on the real engines' knobs."""

from __future__ import annotations

import itertools

import pytest

import worker.engines  # noqa: F401 (registers the engines)
from worker.contract import protocol
from worker.contract.protocol import TuneRefused
from worker.engines.base import argument_values, set_arguments, whole_number
from worker.engines.llamacpp.args import ALLOWLIST as LLAMA_ARGS
from worker.hardware.model import Gpu, Machine
from worker.plan.tuning import OomFrontier, Space, build_space, candidates

CPU = Machine(os="linux", runtime="cpu", arch="x86_64", cpu_model="cpu", cpu_cores=8, ram_mib=32768)
GPU = Machine(os="linux", runtime="native", arch="x86_64", cpu_model="cpu", cpu_cores=16, ram_mib=65536,
              gpus=(Gpu(0, "GPU-0", "NVIDIA GeForce RTX 5090", 32607, 32000, 31000),))
LLAMA = "llamacpp"
VLLM = "vllm"


def spec(**fields: object) -> protocol.TuneSpec:
    parsed = protocol.parse_tune(fields)
    assert isinstance(parsed, protocol.TuneSpec), parsed
    return parsed


def draw(engine: str, baseline: tuple[str, ...], machine: Machine, tune: protocol.TuneSpec | None = None,
         limit: int = 200) -> list[tuple[str, ...]]:
    space = build_space(engine, tune, baseline, machine)
    return list(itertools.islice(candidates(space, baseline, machine, OomFrontier(engine, machine)), limit))


# --- the space -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("engine", "key"), [(LLAMA, "-c"), (LLAMA, "--ctx-size"), (VLLM, "--max-model-len"),
                                             (VLLM, "--gpu-memory-utilization"), (VLLM, "--dtype"),
                                             (VLLM, "--kv-cache-dtype"), (VLLM, "--trust-remote-code"),
                                             (LLAMA, "-ngl"), ("sglang", "--context-length")])
def test_a_space_naming_what_is_never_tuned_is_refused(engine: str, key: str) -> None:
    with pytest.raises(TuneRefused, match="never tuned"):
        build_space(engine, spec(space={key: {"min": 1, "max": 2}}), (), CPU)


def test_a_space_naming_a_flag_off_the_list_or_not_tuned_is_refused() -> None:
    with pytest.raises(TuneRefused, match="not an argument this node accepts"):
        build_space(VLLM, spec(space={"--served-model-name": {"values": ["x"]}}), (), GPU)
    with pytest.raises(TuneRefused, match="not one of the arguments this node tunes"):
        build_space(VLLM, spec(space={"--block-size": {"values": [16]}}), (), GPU)


@pytest.mark.parametrize("entry", [{"min": 0, "max": 8}, {"values": [0, 4]}, {"values": ["4"]},
                                   {"min": 1, "max": 300}])
def test_a_value_the_engine_would_not_take_is_refused(entry: dict[str, object]) -> None:
    with pytest.raises(TuneRefused):
        build_space(LLAMA, spec(space={"-np": entry}), ("-np", "1"), CPU)


def test_a_switch_or_choice_takes_only_its_own_words() -> None:
    with pytest.raises(TuneRefused, match="is not one of"):
        build_space(VLLM, spec(space={"--enforce-eager": {"values": ["maybe"]}}), (), GPU)
    with pytest.raises(TuneRefused, match="takes no range"):
        build_space(LLAMA, spec(space={"-fa": {"min": 1, "max": 2}}), (), CPU)


def test_a_seed_is_checked_like_a_tier_and_never_sets_the_context() -> None:
    with pytest.raises(TuneRefused, match="not allowed"):
        build_space(VLLM, spec(seeds=[["--host", "0.0.0.0"]]), (), GPU)
    with pytest.raises(TuneRefused, match="never tuned"):
        build_space(VLLM, spec(seeds=[["--max-model-len=65536"]]), (), GPU)


def test_the_space_narrows_the_engines_knobs_and_a_spelling_finds_its_knob() -> None:
    space = build_space(LLAMA, spec(space={"--parallel": {"min": 1, "max": 8}, "-fa": {"values": ["on"]}}),
                        ("-np", "1"), CPU)
    assert [(k.flag, k.low, k.high, k.choices) for k in space.knobs] == \
        [("-np", 1, 8, ()), ("-fa", None, None, ("on",))]


def test_a_drafters_knob_applies_only_where_a_drafter_is_configured() -> None:
    assert "--spec-tokens" not in {k.flag for k in build_space(VLLM, None, (), GPU).knobs}
    drafting = build_space(VLLM, None, ("--spec-method", "mtp", "--spec-tokens", "3"), GPU)
    assert "--spec-tokens" in {k.flag for k in drafting.knobs}


# --- candidates ----------------------------------------------------------------------------------

def test_seeds_come_first_the_coordinators_before_the_engines() -> None:
    drawn = draw(VLLM, ("--enforce-eager",), GPU, spec(seeds=[["--max-num-seqs", "32"]]))
    assert drawn[:3] == [("--max-num-seqs", "32"), ("--no-enforce-eager",),
                         ("--no-enforce-eager", "--max-num-seqs", "128")]


def test_one_step_up_and_down_per_knob_then_two() -> None:
    space = build_space(LLAMA, spec(space={"-np": {"min": 1, "max": 16}, "-b": {"values": [512, 1024, 2048, 4096]}}),
                        ("-c", "4096", "-np", "2", "-b", "1024"), CPU)
    drawn = list(candidates(space, ("-c", "4096", "-np", "2", "-b", "1024"), CPU, OomFrontier(LLAMA, CPU)))
    assert drawn == [("-np", "4", "-c", "8192"), ("-np", "1", "-c", "2048"), ("-b", "2048"), ("-b", "512"),
                     ("-np", "8", "-c", "16384"), ("-b", "4096"), ("-np", "16", "-c", "32768")]


def test_never_a_repeat_of_the_baseline_or_of_an_earlier_candidate() -> None:
    baseline = ("-c", "2048", "-np", "1", "-t", "8")
    drawn = draw(LLAMA, baseline, CPU)
    runs = [frozenset(argument_values((*baseline, *c), LLAMA_ARGS).items()) for c in drawn]
    assert len(set(runs)) == len(runs) and frozenset(argument_values(baseline, LLAMA_ARGS).items()) not in runs
    assert ("-t", "8") not in drawn  # a step above the cores is held to them: the baseline again


def test_every_candidate_passes_the_allowlist_and_the_engines_constraints() -> None:
    baseline = ("-c", "2048", "-np", "1")
    for tuned in draw(LLAMA, baseline, CPU, limit=1000):
        assert LLAMA_ARGS.check(tuned) is None
        values = argument_values((*baseline, *tuned), LLAMA_ARGS)
        assert int(values.get("-t", "8")) <= 8 and int(values.get("-tb", "8")) <= 8
        assert int(values["-c"]) // int(values["-np"]) == 2048


def test_an_unknown_current_value_tries_a_narrowed_range_and_skips_an_engine_wide_one() -> None:
    drawn = draw(VLLM, (), CPU, spec(space={"--max-cudagraph-capture-size": {"min": 8, "max": 64}}))
    assert drawn[-2:] == [("--max-cudagraph-capture-size", "64"), ("--max-cudagraph-capture-size", "8")]
    assert not any("--max-cudagraph-capture-size" in c for c in draw(VLLM, (), CPU))


def test_vllm_cpu_steps_from_its_own_defaults() -> None:
    """No seed is drawn: graphs and 128 requests are what its CPU build runs anyway."""
    drawn = draw(VLLM, (), CPU, spec(space={"--max-num-seqs": {"min": 16, "max": 512}}))
    assert drawn == [("--max-num-seqs", "256"), ("--max-num-seqs", "64"), ("--max-num-seqs", "512"),
                         ("--max-num-seqs", "32"), ("--max-num-seqs", "16")]


def test_the_candidates_are_bounded_by_the_knobs_ranges() -> None:
    assert len(draw(LLAMA, ("-c", "2048", "-np", "1"), CPU, limit=10_000)) < 200


# --- the OOM frontier ------------------------------------------------------------------------------

def test_an_oom_rules_out_every_config_at_or_above_it_on_the_memory_knobs() -> None:
    frontier = OomFrontier(VLLM, GPU)
    frontier.note_oom(["--max-num-seqs", "128", "--no-enforce-eager"])
    assert frontier.rules_out(["--max-num-seqs", "256", "--no-enforce-eager"])
    assert frontier.rules_out(["--max-num-seqs=128", "--max-num-batched-tokens", "2048"])  # graphs are the default
    assert not frontier.rules_out(["--max-num-seqs", "64", "--no-enforce-eager"])
    assert not frontier.rules_out(["--max-num-seqs", "256", "--enforce-eager"])
    assert not frontier.rules_out(["--max-num-seqs", "256", "--max-num-batched-tokens", "1024"])


def test_candidates_skip_what_an_oom_noted_meanwhile_rules_out() -> None:
    baseline = ("-c", "2048", "-np", "1")
    space = Space(knobs=build_space(LLAMA, spec(space={"-np": {"min": 1, "max": 64}}), baseline, CPU).knobs,
                  seeds=(), engine=LLAMA)
    frontier = OomFrontier(LLAMA, CPU)
    drawn = candidates(space, baseline, CPU, frontier)
    assert next(drawn) == ("-np", "2", "-c", "4096")
    frontier.note_oom((*baseline, "-np", "4", "-c", "8192"))
    assert list(drawn) == []  # -np 4 and above would run out, and -np 1 is the baseline


# --- reading and setting arguments as the engines parse them --------------------------------------

def test_arguments_are_read_last_occurrence_winning_in_any_spelling() -> None:
    from worker.engines.vllm.args import ALLOWLIST as VLLM_ARGS

    args = ("--max-num-seqs=64", "--enforce-eager", "--max-num-seqs", "32", "--no-enforce-eager", "--bogus")
    assert argument_values(args, VLLM_ARGS) == {"--max-num-seqs": "32", "--enforce-eager": "off"}
    assert argument_values(("--parallel", "4", "-np", "2", "-nocb"), LLAMA_ARGS) == {"-np": "2", "-cb": "off"}


def test_setting_an_argument_drops_its_every_earlier_spelling() -> None:
    assert set_arguments(("--parallel", "4", "-b", "512", "-np", "2"), {"-np": "8", "-cb": "off"}, LLAMA_ARGS) == \
        ("-b", "512", "-np", "8", "-nocb")


@pytest.mark.parametrize(("text", "number"), [("2048", 2048), ("32k", 32_000), ("32K", 32_768), ("1M", 2**20),
                                              ("auto", None), ("-1", None), ("1.5k", None)])
def test_whole_numbers_read_as_the_engines_read_them(text: str, number: int | None) -> None:
    assert whole_number(text) == number


def test_a_narrowed_space_keeps_only_the_engines_own_seeds_inside_it() -> None:
    """The coordinator narrowed the search to the token budget: the field notes' recipe (graphs on
    and 128 sequences) is outside it and is not tried; without a space it is."""
    narrowed = build_space(VLLM, spec(space={"--max-num-batched-tokens": {"values": [2048, 4096]}}),
                           ("--enforce-eager",), GPU)
    assert narrowed.seeds == ()
    assert all(set(argument_values(c, narrowed_allowlist()).keys()) <= {"--max-num-batched-tokens"}
               for c in draw(VLLM, ("--enforce-eager",), GPU,
                             spec(space={"--max-num-batched-tokens": {"values": [2048, 4096]}})))
    assert build_space(VLLM, None, ("--enforce-eager",), GPU).seeds  # unnarrowed: the recipes apply


def narrowed_allowlist():  # vLLM's, as the engine parses its arguments
    from worker.engines.vllm.args import ALLOWLIST

    return ALLOWLIST
