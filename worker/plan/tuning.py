"""Auto-tune's search for one engine on this machine: which arguments it may try, in which order,
and which a start that ran out of memory rules out.

Pure: nothing is started or measured here. The space is the engine's knobs (`EngineTuning`, only
flags its allowlist has) narrowed by the coordinator's `space`; a space naming a flag that is never
tuned (context, memory share, precision, layout, remote code), one this node does not tune, or a
value outside what the engine accepts refuses the tuning, never the assignment. Candidates are
tuned arguments, appended after the tier (last occurrence wins): the seeds first (the
coordinator's, then the engine's), then each knob one step up and down from the baseline, then two
steps, and so on; each made consistent by the engine's `fix`, checked against the allowlist, never
the same run twice, and never one the OOM frontier rules out.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from worker.contract import protocol
from worker.contract.protocol import TuneRefused
from worker.engines import registry
from worker.engines.allowlist import Allowlist, shown
from worker.engines.base import EngineAdapter, EngineTuning, Knob, argument_values, set_arguments, whole_number

if TYPE_CHECKING:
    from worker.hardware.model import Machine

SWITCH = ("on", "off")


@dataclass(frozen=True)
class Space:
    """The knobs one tuning may turn (narrowed), and the seeds it tries first, for `engine`."""

    knobs: tuple[Knob, ...]
    seeds: tuple[tuple[str, ...], ...]
    engine: str


def build_space(engine: str, tune: protocol.TuneSpec | None, baseline: Sequence[str], machine: Machine) -> Space:
    """The space for `engine` from its knobs and the coordinator's `tune`; raises `TuneRefused`."""
    adapter = registry.get(engine)
    present = argument_values(baseline, adapter.ALLOWED_ARGS)
    applying = tuple(knob for knob in adapter.TUNING.knobs if _applies(knob, present))
    if tune is not None and tune.space:
        knobs = tuple(_narrowed(adapter, key, entry) for key, entry in tune.space.items())
        applying = tuple(knob for knob in knobs if _applies(knob, present))
    asked = tuple(_checked_seed(adapter, seed) for seed in (tune.seeds if tune is not None else ()))
    own = adapter.TUNING.seeds
    if tune is not None and tune.space:  # the field notes' recipes too stay inside what the coordinator narrowed
        own = tuple(seed for seed in own if _inside(argument_values(seed, adapter.ALLOWED_ARGS), applying))
    return Space(knobs=applying, seeds=asked + own, engine=engine)


def _inside(values: Mapping[str, str], knobs: Sequence[Knob]) -> bool:
    """Every flag a seed sets is one of `knobs`, at a value the knob allows."""
    by_flag = {knob.flag: knob for knob in knobs}
    for flag, value in values.items():
        knob = by_flag.get(flag)
        if knob is None:
            return False
        if knob.kind == "int" and knob.low is not None and knob.high is not None:
            number = whole_number(value)
            if number is None or not knob.low <= number <= knob.high:
                return False
        elif knob.kind != "int" and value not in knob.choices:
            return False
    return True


def _applies(knob: Knob, present: Mapping[str, str]) -> bool:
    """A knob that needs something (a drafter) applies only where the baseline has it."""
    return not knob.needs or any(flag in present for flag in knob.needs)


def _canonical(adapter: EngineAdapter, spelling: str) -> str | None:
    return next((flag.name for flag in adapter.ALLOWED_ARGS.flags if spelling in flag.all_spellings()), None)


def _narrowed(adapter: EngineAdapter, key: str, entry: protocol.SpaceEntry) -> Knob:
    """The engine's knob for `key`, narrowed to `entry`; raises `TuneRefused`."""
    name = _canonical(adapter, key)
    if key in adapter.TUNING.never or name in adapter.TUNING.never:
        raise TuneRefused(f"{shown(key)} is never tuned: context, memory share, precision, layout and remote code "
                          "stay as the assignment sets them")
    if name is None:
        raise TuneRefused(f"{shown(key)} is not an argument this node accepts for {adapter.DISPLAY_NAME}")
    knob = adapter.TUNING.knob(name)
    if knob is None:
        raise TuneRefused(f"{shown(key)} is not one of the arguments this node tunes for {adapter.DISPLAY_NAME}")
    if entry.values is None:
        return _ranged(knob, shown(key), entry.min, entry.max)
    return _listed(adapter, knob, shown(key), entry.values)


def _ranged(knob: Knob, named: str, low: int | None, high: int | None) -> Knob:
    if knob.kind != "int" or knob.low is None or knob.high is None:
        raise TuneRefused(f"{named} takes no range of numbers; list its values")
    low = knob.low if low is None else low
    high = knob.high if high is None else high
    if low < knob.low or high > knob.high:
        raise TuneRefused(f"{named}: {low} to {high} is outside what it accepts ({knob.low} to {knob.high})")
    return replace(knob, low=low, high=high)


def _listed(adapter: EngineAdapter, knob: Knob, named: str, values: Sequence[int | str]) -> Knob:
    """An int knob's listed values become a choice among them, smallest first (so memory grows
    with the choice, as with the number); a choice or switch keeps its listed values in its order."""
    if knob.kind == "int":
        if any(not isinstance(value, int) for value in values):
            raise TuneRefused(f"{named} takes whole numbers")
        for value in values:
            if problem := adapter.ALLOWED_ARGS.check([knob.flag, str(value)]):
                raise TuneRefused(f"{named}: {problem}")
        return replace(knob, kind="choice", choices=tuple(str(v) for v in sorted(set(values))))
    allowed = knob.choices
    if unknown := [value for value in values if value not in allowed]:
        raise TuneRefused(f"{named}: {unknown[0]!r} is not one of {', '.join(allowed)}")
    return replace(knob, choices=tuple(choice for choice in allowed if choice in values))


def _checked_seed(adapter: EngineAdapter, seed: Sequence[str]) -> tuple[str, ...]:
    """A coordinator's seed, checked like a tier and never naming what is never tuned."""
    if problem := adapter.ALLOWED_ARGS.check(seed, where="a tune seed"):
        raise TuneRefused(problem)
    if never := next((arg for arg in seed if arg.partition("=")[0] in adapter.TUNING.never), None):
        raise TuneRefused(f"a tune seed sets {shown(never)}, which is never tuned")
    return tuple(seed)


def _defaults(tuning: EngineTuning, machine: Machine) -> dict[str, str]:
    """The engine's own value of each knob where the arguments give none, on this machine."""
    return {**{knob.flag: knob.default for knob in tuning.knobs if knob.default is not None},
            **tuning.defaults(machine)}


class OomFrontier:
    """The starts that ran out of memory, and what they rule out: a config at or above one of them
    on every knob that grows memory (a larger number, a later choice) would run out too. Each
    `args` is the whole argument list an engine starts with (the tier, then the tuned arguments)."""

    def __init__(self, engine: str, machine: Machine) -> None:
        adapter = registry.get(engine)
        self._allowlist = adapter.ALLOWED_ARGS
        self._knobs = tuple(knob for knob in adapter.TUNING.knobs if knob.grows_memory)
        self._defaults = _defaults(adapter.TUNING, machine)
        self._ooms: list[tuple[float | None, ...]] = []

    def note_oom(self, args: Sequence[str]) -> None:
        self._ooms.append(self._position(args))

    def rules_out(self, args: Sequence[str]) -> bool:
        position = self._position(args)
        return any(all(_at_or_above(mine, theirs) for mine, theirs in zip(position, oom)) for oom in self._ooms)

    def _position(self, args: Sequence[str]) -> tuple[float | None, ...]:
        values = {**self._defaults, **argument_values(args, self._allowlist)}
        return tuple(_rank(knob, values.get(knob.flag)) for knob in self._knobs)


def _rank(knob: Knob, value: str | None) -> float | None:
    """Where `value` stands in memory order: the number, or the choice's place; None: not known."""
    if value is None:
        return None
    if knob.kind == "int":
        number = whole_number(value)
        return None if number is None else float(number)
    return float(knob.choices.index(value)) if value in knob.choices else None


def _at_or_above(mine: float | None, theirs: float | None) -> bool:
    if mine is None or theirs is None:
        return mine is None and theirs is None
    return mine >= theirs


def candidates(space: Space, baseline: Sequence[str], machine: Machine,
               frontier: OomFrontier) -> Iterator[tuple[str, ...]]:
    """Tuned arguments to try, best guesses first; lazy, so an OOM noted between two draws rules
    out what follows. Each one is a distinct run from the baseline and from every one before."""
    adapter = registry.get(space.engine)
    tuning, allowlist = adapter.TUNING, adapter.ALLOWED_ARGS
    defaults = _defaults(tuning, machine)
    present = {**defaults, **argument_values(baseline, allowlist)}
    seen = {_run(baseline, allowlist, defaults)}

    def admitted(tuned: Sequence[str]) -> tuple[str, ...] | None:
        fixed = tuning.fix(baseline, tuned, machine)
        if fixed is None or allowlist.check(fixed) is not None:
            return None
        run = _run([*baseline, *fixed], allowlist, defaults)
        if run in seen or frontier.rules_out([*baseline, *fixed]):
            return None
        seen.add(run)
        return fixed

    ladders = [(knob, _ladders(knob, present.get(knob.flag), tuning.knob(knob.flag) != knob))
               for knob in space.knobs]
    steps = max((len(ladder) for _, both in ladders for ladder in both), default=0)
    tries = [*space.seeds, *(set_arguments((), {knob.flag: ladder[distance]}, allowlist)
                             for distance in range(steps) for knob, both in ladders
                             for ladder in both if distance < len(ladder))]
    for tuned in tries:
        if (fixed := admitted(tuned)) is not None:
            yield fixed


def _run(args: Sequence[str], allowlist: Allowlist, defaults: Mapping[str, str]) -> frozenset[tuple[str, str]]:
    """What the engine would run with: each flag's last value, whatever the order or spelling, and
    its own value where none is given."""
    return frozenset({**defaults, **argument_values(args, allowlist)}.items())


def _ladders(knob: Knob, current: str | None, narrowed: bool) -> tuple[list[str], list[str]]:
    """The values one, two, … steps up, and one, two, … steps down, from `current`. Where the
    current value is not known, a narrowed knob tries its listed values or its range's ends (an
    engine-wide range would be a blind guess)."""
    if knob.kind == "int":
        assert knob.low is not None and knob.high is not None
        number = None if current is None else whole_number(current)
        if number is None:
            return ([str(knob.high), str(knob.low)] if narrowed else []), []
        return _numbers(knob, number, up=True), _numbers(knob, number, up=False)
    if current in knob.choices:
        at = knob.choices.index(current)
        return list(knob.choices[at + 1:]), list(reversed(knob.choices[:at]))
    number = None if current is None else whole_number(current)
    if number is not None and all(whole_number(choice) is not None for choice in knob.choices):
        above = [choice for choice in knob.choices if (whole_number(choice) or 0) > number]
        below = [choice for choice in reversed(knob.choices) if (whole_number(choice) or 0) < number]
        return above, below
    if knob.kind == "switch" and current is None and knob.off is None:
        return [], []  # a switch that cannot be turned off by appending, in an unknown state
    return list(knob.choices), []


def _numbers(knob: Knob, start: int, *, up: bool) -> list[str]:
    """Doubling (halving) or adding (taking) one from `start`, within the knob's bounds."""
    assert knob.low is not None and knob.high is not None
    values: list[str] = []
    value = start
    while True:
        if knob.scale == "pow2":
            step = max(value * 2, 1) if up else value // 2
        else:
            step = value + 1 if up else value - 1
        step = min(max(step, knob.low), knob.high)
        if (step <= value) if up else (step >= value):
            return values
        values.append(str(step))
        value = step
