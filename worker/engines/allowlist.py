"""Closed-world engine arguments: each engine's tuning flags with typed values; nothing else passes.

Pure. An assignment's `base_args` and `tiers` reach the engine's own parser, and that parser reads
files, opens listeners and imports code for flags the app never wants a coordinator to set. So the
node accepts only the flags on its list, spelled exactly as listed, each with a value of its type
(a number in range, one of some words, a JSON object with listed keys). There is deliberately no
free-text type: a path, URL, host, module or template can never be a valid value.

Every check is linear in the text it reads: a JSON value is measured (length, bracket depth) before
it is parsed, so no value can make the parser recurse or the checks grow with its square.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence, Union

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_DIGITS = re.compile(r"[0-9]{1,12}")
_DECIMAL = re.compile(r"[0-9]{1,12}(?:\.[0-9]{1,12})?|\.[0-9]{1,12}")
# vLLM's human-readable integers (`vllm/utils/argparse_utils.py`, `human_readable_int`), up to M.
_HUMAN_DECIMAL = re.compile(r"([0-9]{1,9}(?:\.[0-9]{1,9})?)([km])")
_HUMAN_BINARY = re.compile(r"([0-9]{1,9})([KM])")
_DECIMAL_FACTOR = {"k": 10**3, "m": 10**6}
_BINARY_FACTOR = {"K": 2**10, "M": 2**20}
SHOWN_LIMIT = 80  # characters of a refused value quoted back in a reason
MAX_JSON_BYTES = 64 * 1024  # a JSON value's size, UTF-8 (contract, Assignment rule 4)
MAX_JSON_DEPTH = 16  # brackets open at once in a JSON value (contract, Assignment rule 4)
_VERSION = re.compile(r"v?([0-9]{1,6}(?:\.[0-9]{1,6}){1,3})")
_PLAIN_VERSION = re.compile(r"[0-9A-Za-z.+-]{1,40}")  # a version quoted as it is in a reason
Version = tuple[int, ...]  # (0, 33): an engine version, compared part by part


def shown(text: str) -> str:
    """`text` quoted safely for a reason: escapes made visible, long values cut."""
    quoted = repr(text)
    return quoted if len(quoted) <= SHOWN_LIMIT else quoted[: SHOWN_LIMIT - 4] + "…" + quoted[-1]


def shown_json(value: object) -> str:
    """A refused JSON value as JSON, cut like `shown` (a 64 KiB list must not become the reason)."""
    text = json.dumps(value)
    return text if len(text) <= SHOWN_LIMIT else text[: SHOWN_LIMIT - 1] + "…"


@dataclass(frozen=True)
class IntValue:
    """A whole number in [low, high]; `words` are also taken as they are (`auto`, `all`, `-1`);
    `suffixes` takes vLLM's `32k` (×1000), `1.5k` and `32K` (×1024) forms."""

    low: int
    high: int
    words: tuple[str, ...] = ()
    suffixes: bool = False

    def problem(self, text: str) -> str | None:
        if text in self.words:
            return None
        number = self._number(text)
        if number is None:
            return f"{shown(text)} is not {self.describe()}"
        if not self.low <= number <= self.high:
            return f"{shown(text)} is out of range ({self.describe()})"
        return None

    def json_problem(self, value: object) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{shown_json(value)} is not a whole number"
        if not self.low <= value <= self.high:
            return f"{value} is out of range ({self.low} to {self.high})"
        return None

    def _number(self, text: str) -> int | None:
        if _DIGITS.fullmatch(text):
            return int(text)
        if not self.suffixes:
            return None
        if match := _HUMAN_DECIMAL.fullmatch(text):
            return int(float(match.group(1)) * _DECIMAL_FACTOR[match.group(2)])
        if match := _HUMAN_BINARY.fullmatch(text):
            return int(match.group(1)) * _BINARY_FACTOR[match.group(2)]
        return None

    def describe(self) -> str:
        text = f"a whole number from {self.low} to {self.high}"
        if self.suffixes:
            text += " (k and m suffixes count ×1000, K and M ×1024: 32k, 1.5k, 32K)"
        return text + "".join(f" or {word}" for word in self.words)


@dataclass(frozen=True)
class FloatValue:
    """A plain decimal number (no exponent, no sign, no `nan`) in its range."""

    low: float
    high: float
    low_inclusive: bool = True

    def problem(self, text: str) -> str | None:
        if not _DECIMAL.fullmatch(text):
            return f"{shown(text)} is not {self.describe()}"
        return None if self._in_range(float(text)) else f"{shown(text)} is out of range ({self.describe()})"

    def json_problem(self, value: object) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"{shown_json(value)} is not a number"
        return None if self._in_range(float(value)) else f"{value} is out of range ({self.describe()})"

    def _in_range(self, number: float) -> bool:
        above_low = number >= self.low if self.low_inclusive else number > self.low
        return above_low and number <= self.high

    def describe(self) -> str:
        low = "from" if self.low_inclusive else "above"
        return f"a decimal number {low} {self.low:g} up to {self.high:g}"


@dataclass(frozen=True)
class Choice:
    """One of `values` (or, with `many`, a comma-separated list of them, as llama.cpp's `--spec-type`);
    `since`: the engine version each value came in, for those newer than the oldest the app runs."""

    values: tuple[str | int, ...]
    many: bool = False
    since: Mapping[str, Version] = field(default_factory=dict)

    def problem(self, text: str) -> str | None:
        words = text.split(",") if self.many else [text]
        allowed = {str(v) for v in self.values}
        if all(word in allowed for word in words):
            return None
        return f"{shown(text)} is not {self.describe()}"

    def json_problem(self, value: object) -> str | None:
        if isinstance(value, bool) or not any(type(value) is type(v) and value == v for v in self.values):
            return f"{shown_json(value)} is not {self.describe()}"
        return None

    def describe(self) -> str:
        quoted = any(isinstance(v, int) for v in self.values)  # mixed words and numbers: JSON-quote the words
        listed = ", ".join(json.dumps(v) if quoted and isinstance(v, str) else str(v) for v in self.values)
        return ("a comma-separated list of " if self.many else "one of ") + listed


JsonValue = Union[IntValue, FloatValue, Choice]


def parse_version(text: str) -> Version | None:
    """`0.32.0+cpu` → (0, 32, 0); None where `text` does not start with a version number."""
    match = _VERSION.match(text)
    return None if match is None else tuple(int(part) for part in match.group(1).split("."))


def shown_version(version: Version) -> str:
    return ".".join(str(part) for part in version)


def too_old(running: str | None, since: Version) -> bool:
    """Whether the engine version the plan will run (None: not known yet, so the newest the app
    ships) lacks what came in `since`; a version that is no version number lacks it too."""
    if running is None:
        return False
    parsed = parse_version(running)
    return parsed is None or parsed < since


@dataclass(frozen=True)
class JsonObject:
    """A JSON object whose keys are all listed, each value of its key's type; nothing nested."""

    keys: Mapping[str, JsonValue]

    def problem(self, text: str) -> str | None:
        if too_big := json_size_problem(text):
            return too_big
        try:
            data = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
        except ValueError as exc:
            return f"{shown(text)} is not a JSON object ({exc})"
        if not isinstance(data, dict):
            return f"{shown(text)} is not a JSON object"
        for key, value in data.items():
            kind = self.keys.get(key)
            if kind is None:
                return f"JSON key {shown(key)} is not allowed (allowed keys: {', '.join(self.keys)})"
            if problem := kind.json_problem(value):
                return f"JSON key {shown(key)}: {problem}"
        return None

    def describe(self) -> str:
        return "JSON object: " + "; ".join(f"`{key}` {kind.describe()}" for key, kind in self.keys.items())


@dataclass(frozen=True)
class Switch:
    """A flag that takes no value."""

    def describe(self) -> str:
        return "no value"


ValueType = Union[IntValue, FloatValue, Choice, JsonObject, Switch]


def utf8_length(text: str) -> int:
    """`text`'s size in UTF-8 bytes (a lone surrogate, which a JSON frame can carry, is counted)."""
    return len(text.encode("utf-8", "surrogatepass"))


def json_size_problem(text: str) -> str | None:
    """Why `text` is too big to parse as a JSON value (over `MAX_JSON_BYTES`, or brackets nested
    over `MAX_JSON_DEPTH`), from one pass over it: checked before `json.loads`, whose time and
    recursion grow with both."""
    size = utf8_length(text)
    if size > MAX_JSON_BYTES:
        return f"a JSON value of {size:,} bytes is over the limit of {MAX_JSON_BYTES:,}"
    if nests_deeper_than(text, MAX_JSON_DEPTH):
        return f"a JSON value nested more than {MAX_JSON_DEPTH} deep is not accepted"
    return None


def nests_deeper_than(text: str, limit: int) -> bool:
    """Whether `{` and `[` open more than `limit` deep in `text`, outside strings (escapes
    followed): one pass, no parsing, so it is safe on any input; a value with few brackets (every
    honest one) is answered by counting them, in C."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth -= 1
    return False


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """The object, or ValueError naming a key given twice (one pass: a set of the keys seen)."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"key {key!r} appears twice")
        seen.add(key)
    return dict(pairs)


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number")


@dataclass(frozen=True)
class AllowedFlag:
    """One tuning flag: every spelling its engine's parser takes for it, and its value's type.

    `negations` (switches only) are the spellings that turn it off; `equals` says the parser also
    reads `--flag=value` for the long spellings; `remote_code` flags (not their negations) pass only
    where the person allowed remote code; a `memory_cap` flag is the assignment's memory cap;
    `since`: the engine version a spelling came in, for those newer than the oldest the app runs
    (refused, with the reason, where the plan runs an older one).
    """

    spellings: tuple[str, ...]
    value: ValueType
    purpose: str
    negations: tuple[str, ...] = ()
    equals: bool = False
    remote_code: bool = False
    memory_cap: bool = False
    since: Mapping[str, Version] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spellings[0]

    @property
    def takes_value(self) -> bool:
        return not isinstance(self.value, Switch)

    def all_spellings(self) -> tuple[str, ...]:
        return self.spellings + self.negations

    def older_spelling(self, spelling: str) -> str | None:
        """A spelling of the same meaning that no version restricts (`--no-enable-X` for `--disable-X`)."""
        same = self.negations if spelling in self.negations else self.spellings
        return next((other for other in same if other not in self.since), None)

    def version_notes(self) -> str:
        """What needs a newer engine, for the docs: `` `--disable-X`: 0.33 and later.``"""
        kind = self.value
        values = kind.since if isinstance(kind, Choice) else {}
        added: dict[Version, list[str]] = {}
        for name, version in (*self.since.items(), *values.items()):
            added.setdefault(version, []).append(f"`{name}`")
        return "".join(f" {', '.join(names)}: {shown_version(version)} and later." for version, names in added.items())


@dataclass(frozen=True)
class Allowlist:
    """One engine's allowed flags; `check` walks an argument list and names the first problem."""

    engine: str
    flags: tuple[AllowedFlag, ...]
    _index: dict[str, AllowedFlag] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[str, AllowedFlag] = {}
        for flag in self.flags:
            if flag.negations and flag.takes_value:
                raise ValueError(f"{flag.name}: only a switch has negated spellings")
            for spelling in flag.all_spellings():
                if spelling in index:
                    raise ValueError(f"{spelling} is listed twice")
                index[spelling] = flag
        object.__setattr__(self, "_index", index)

    def check(self, args: Sequence[str], *, allow_remote_code: bool = False, where: str | None = None,
              version: str | None = None) -> str | None:
        """None when every token is an allowed spelling or that flag's valid value, known to the
        engine `version` the plan will run (None: the newest the app ships); else the first
        problem: `argument not allowed: FLAG (in WHERE): why` or `value not allowed for FLAG …: why`."""
        found = self._problem(args, allow_remote_code, version)
        if found is None:
            return None
        head, why = found
        return f"{head} (in {where}): {why}" if where else f"{head}: {why}"

    def _problem(self, args: Sequence[str], allow_remote_code: bool, version: str | None) -> tuple[str, str] | None:
        i = 0
        while i < len(args):
            token = args[i]
            spelling, equals, inline = token.partition("=") if token.startswith("--") else (token, "", "")
            flag = self._index.get(spelling)
            if flag is None or _CONTROL.search(spelling):
                return self._unknown(token, spelling)
            refused = f"argument not allowed: {spelling}"
            if flag.remote_code and spelling in flag.spellings and not allow_remote_code:
                return refused, "it runs code from the model's repository; allow remote code in settings to accept it"
            if (added := flag.since.get(spelling)) is not None and too_old(version, added):
                older = flag.older_spelling(spelling)
                instead = f"; write {older}" if older else ""
                return refused, f"{self._newer(added, version)}{instead}"
            kind = flag.value
            if isinstance(kind, Switch):
                if equals:
                    return refused, f"it is a switch and takes no value; write {spelling} alone"
                i += 1
                continue
            if equals and not flag.equals:
                return refused, f"{self.engine} does not read {spelling}=VALUE; give the value as the next argument"
            if not equals and i + 1 >= len(args):
                return f"value not allowed for {spelling}", "none is given (it is the last argument)"
            value = inline if equals else args[i + 1]
            i += 1 if equals else 2
            if _CONTROL.search(value):
                return f"value not allowed for {spelling}", f"{shown(value)} contains a newline or control character"
            if problem := kind.problem(value):
                return f"value not allowed for {spelling}", problem
            if isinstance(kind, Choice) and (newer := self._newer_value(kind, value, version)):
                return f"value not allowed for {spelling}", newer
        return None

    def _newer(self, added: Version, version: str | None) -> str:
        running = version or ""
        named = running if _PLAIN_VERSION.fullmatch(running) else shown(running)
        return f"it came in {self.engine} {shown_version(added)}, and this computer runs {self.engine} {named}"

    def _newer_value(self, kind: Choice, value: str, version: str | None) -> str | None:
        """Why a valid value of `kind` is one the engine at `version` lacks, or None."""
        for word in value.split(",") if kind.many else [value]:
            if (added := kind.since.get(word)) is not None and too_old(version, added):
                return f"{shown(word)}: {self._newer(added, version)}"
        return None

    def _unknown(self, token: str, spelling: str) -> tuple[str, str]:
        if _CONTROL.search(token):
            return f"argument not allowed: {shown(token)}", "it contains a newline or control character"
        if not token.startswith("-"):
            return f"argument not allowed: {shown(token)}", "a value with no flag before it"
        named = spelling if len(spelling) <= SHOWN_LIMIT else spelling[: SHOWN_LIMIT - 1] + "…"
        return f"argument not allowed: {named}", self._why_unknown(spelling)

    def _why_unknown(self, spelling: str) -> str:
        dashed = spelling[:2] + spelling[2:].replace("_", "-")
        if "_" in spelling and dashed in self._index:
            return f"spell it {dashed}, with '-' for '_'"
        if "." in spelling.lstrip("-"):
            return "dotted JSON keys are not accepted; pass the whole JSON object to the flag"
        if spelling.startswith("--") and len(spelling) > 2 and any(known.startswith(spelling) for known in self._index):
            return "abbreviations are not accepted; spell the flag out"
        return f"it is not on this node's list of {self.engine} tuning arguments (see docs/engine-args.md)"

    def split_memory_cap(self, args: Sequence[str]) -> tuple[tuple[str, ...], float | None]:
        """`args` without the memory-cap flag and its value, and the cap (the last one wins).

        Only for arguments that passed `check`."""
        kept: list[str] = []
        cap: float | None = None
        i = 0
        while i < len(args):
            spelling, equals, inline = args[i].partition("=") if args[i].startswith("--") else (args[i], "", "")
            flag = self._index[spelling]
            width = 1 if equals or not flag.takes_value else 2
            if flag.memory_cap:
                cap = float(inline if equals else args[i + 1])
            else:
                kept.extend(args[i : i + width])
            i += width
        return tuple(kept), cap

    def published(self, *, allow_remote_code: bool = False) -> list[str]:
        """Every spelling this node accepts, for `hello.engine_args`."""
        return [
            spelling
            for flag in self.flags
            for spelling in flag.all_spellings()
            if allow_remote_code or not (flag.remote_code and spelling in flag.spellings)
        ]

    def markdown(self) -> str:
        """A table of the flags: name, every spelling, and the value's type and range."""
        rows = [
            "| flag | spellings | value | what it tunes |",
            "| --- | --- | --- | --- |",
        ]
        for flag in self.flags:
            spellings = ", ".join(f"`{s}`" for s in flag.all_spellings())
            if flag.equals:
                spellings += f" (also `{flag.name}=VALUE`)"
            value = flag.value.describe().replace("|", "\\|")
            notes = flag.purpose + (" Only where remote code is allowed in settings." if flag.remote_code else "")
            notes += flag.version_notes()
            rows.append(f"| `{flag.name}` | {spellings} | {value} | {notes} |")
        return "\n".join(rows) + "\n"
