"""Every message of coordinator protocol version 1 as a typed model: parse, validate, serialise.

Pure: no I/O. The connection (`link/connection.py`) and the reference coordinator (`link/local/`) both build
on this module, so the app and its test peer can never disagree about a shape. The contract is
`shared/coordinator-protocol.md`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 16 * 1024 * 1024
SHOWN_LIMIT = 80  # characters of a frame's key or value quoted back in a `bad_message` reason

EngineName = str  # a registered engine's name; checked where it enters, in `ModelSpec`, against those handed in
ENGINE_NAMES = "engine_names"  # the validation context's key for the engines this app runs (`parse_from_coordinator`)
Runtime = Literal["native", "wsl2", "apple-silicon", "windows", "cpu"]
State = Literal["idle", "paused", "configured", "starting", "ready", "degraded", "failed", "stopped"]
Layout = Literal["tensor", "replica", "single", "layers"]
TIER_KEY = re.compile(r"[0-9]{1,9}")  # ASCII digits only: str.isdigit() also takes "²" and "٣"

# Close codes the coordinator uses; see "Connection" in the protocol.
CLOSE_PROTOCOL_ERROR = 4400
CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_TAKEN_OVER = 4409
CLOSE_UPGRADE_REQUIRED = 4426


class _Message(BaseModel):
    """Wire messages ignore fields they do not know, so the coordinator can add some."""

    model_config = ConfigDict(extra="ignore", frozen=True)


# --- hello -----------------------------------------------------------------------------------


class PlatformInfo(_Message):
    os: str
    runtime: Runtime
    arch: str


class Pcie(_Message):
    gen: int | None = None
    width: int | None = None


class GpuInfo(_Message):
    """One card; `null` is accepted for anything a card does not report (an Apple GPU has no PCIe)."""

    index: int
    uuid: str
    name: str
    vendor: str | None = "nvidia"
    memory_total_mib: int
    memory_free_mib: int
    compute_capability: str | None = None
    pcie: Pcie | None = None
    peer_to_peer: bool | None = False
    power_limit_w: float | None = None
    memory_bandwidth_gbps: float | None = None


class GroupInfo(_Message):
    gpu_indices: list[int]
    name: str
    usable_mib_per_gpu: int
    peer_to_peer: bool | None = False


class CpuInfo(_Message):
    model: str
    cores: int


class HardwareInfo(_Message):
    gpus: list[GpuInfo] = []
    groups: list[GroupInfo] = []
    effective_vram_mib: int = 0
    unified_memory: bool = False
    ram_mib: int
    cpu: CpuInfo


LimitReason = Literal["too_hot", "on_battery", "costs_more_than_it_earns"]
MAX_LIMIT_CARDS = 64  # `memory_share_pct` entries: one per card, and no machine has more


class Limits(_Message):
    """What the lender allows now (in `hello` and `status`), so the coordinator routes within it."""

    max_requests: int | None = Field(default=None, ge=1)  # requests at once; None = no limit of the lender's
    memory_share_pct: dict[Annotated[str, Field(pattern=r"^[0-9]{1,2}$")], Annotated[int, Field(ge=10, le=100)]] = Field(
        default={}, max_length=MAX_LIMIT_CARDS)  # per card index: the % of its memory an engine may use
    reason: LimitReason | None = None  # why the node takes fewer requests, or none, right now


class Hello(_Message):
    type: Literal["hello"] = "hello"
    protocol: int = PROTOCOL_VERSION
    node_id: str
    app_version: str
    platform: PlatformInfo
    hardware: HardwareInfo
    engines: dict[str, str | None]
    engine_args: dict[str, list[str]] = {}  # the flags this node accepts in assignments, per engine
    paused: bool = False
    limits: Limits | None = None


class Price(_Message):
    currency: str = "USD"
    per_million_output_tokens: float = 0.0
    per_million_input_tokens: float = 0.0


class Welcome(_Message):
    type: Literal["welcome"] = "welcome"
    node_id: str
    heartbeat_s: float = Field(default=10.0, gt=0)
    features: list[str] = []  # what the coordinator understands beyond the base protocol ("batch")
    price: Price = Price()


# --- assignment ------------------------------------------------------------------------------


class EngineModel(_Message):
    """One engine's way of serving the assigned model."""

    source: str = Field(min_length=1)
    revision: str | None = None
    engine_version: str | None = None
    sha256: str | None = None
    weights_mib: int = Field(gt=0)
    base_args: list[str] = []
    tiers: dict[str, list[str]] = {}
    # Kept raw: a bad `tune` block refuses the tuning only, never the assignment (`parse_tune`).
    tune: Any = None

    @field_validator("tiers")
    @classmethod
    def _thresholds_are_mib(cls, tiers: dict[str, list[str]]) -> dict[str, list[str]]:
        for key in tiers:
            if not TIER_KEY.fullmatch(key):
                raise ValueError(f"tier threshold {_cut(repr(key))} is not a whole number of MiB")
        return tiers

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, value: str | None) -> str | None:
        if not value:
            return None
        value = value.lower()
        if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
            raise ValueError("sha256 must be 64 hexadecimal digits")
        return value

    def tier_thresholds(self) -> list[tuple[int, list[str]]]:
        """Tiers as (threshold MiB, args), lowest threshold first."""
        return sorted(((int(k), list(v)) for k, v in self.tiers.items()), key=lambda t: t[0])


_MODEL_KEYS = frozenset({"name", "prefer"})  # `model`'s own keys: every other key is an engine's block


class ModelSpec(_Message):
    """The model's `name` and, under each engine's name, that engine's block (`EngineModel`).

    The blocks this app knows are those of the engines it runs, handed in with the frame
    (`parse_from_coordinator(engine_names=...)`, or `ENGINE_NAMES` in the validation context); a
    block for any other engine is dropped (logged at info), as a message type this version does not
    know is. Built in code, with no names handed in, every block given is one the code meant:
    `ModelSpec(name="m", vllm=EngineModel(...))`."""

    model_config = ConfigDict(extra="allow", frozen=True)
    __pydantic_extra__: dict[EngineName, EngineModel]
    name: str = Field(min_length=1)
    # where several blocks fit, the engines in the order the network would have them (contract,
    # Assignment: `model.prefer`); a known key of `model`, never an engine block
    prefer: tuple[Annotated[str, Field(max_length=64)], ...] = Field(default=(), max_length=16)

    if TYPE_CHECKING:  # engine blocks are keyword arguments named by engine; at run time pydantic's
        # own `__init__` stays, as a custom one would validate nested models without their context
        def __init__(self, /, **data: Any) -> None: ...

    @model_validator(mode="before")
    @classmethod
    def _known_engine_blocks(cls, data: Any, info: ValidationInfo) -> Any:
        """`name` and the blocks of the engines handed in (a `null` block is no block); nothing else.
        One pass in the frame's order (no sorting): a frame may hold a million unknown blocks."""
        if not isinstance(data, dict):
            return data
        names = info.context.get(ENGINE_NAMES) if isinstance(info.context, dict) else None
        if names is None:  # built in code: its blocks are the ones it names
            return {key: value for key, value in data.items() if value is not None}
        known = set(names)
        if unknown := [key for key in data if key not in _MODEL_KEYS and key not in known]:
            log.info("model %.80r: ignoring %d block(s) for engines this app does not run: %.200s",
                     data.get("name"), len(unknown), ", ".join(repr(str(key)) for key in unknown[:5]))
        return {key: value for key, value in data.items() if key in _MODEL_KEYS or (key in known and value is not None)}

    @property
    def engines(self) -> dict[EngineName, EngineModel]:
        """The engine blocks, by engine name."""
        return dict(self.__pydantic_extra__ or {})

    def for_engine(self, engine: EngineName) -> EngineModel | None:
        return self.engines.get(engine)


class Assign(_Message):
    type: Literal["assign"] = "assign"
    assignment_id: str = Field(min_length=1)
    model: ModelSpec


class Unassign(_Message):
    type: Literal["unassign"] = "unassign"
    assignment_id: str


class Pause(_Message):
    type: Literal["pause"] = "pause"


class Resume(_Message):
    type: Literal["resume"] = "resume"


# --- tuning (optional) -----------------------------------------------------------------------

AUTOTUNE_FEATURE = "autotune"  # in `Welcome.features`: the coordinator reads tuning status and reports
MAX_SPACE_KEYS = 32
MAX_SPACE_VALUES = 64
MAX_SEEDS = 16
MAX_SEED_ARGS = 64
MAX_TUNE_TEXT = 256  # characters of one flag, value or seed argument
MAX_TUNE_REPORT_BYTES = 64 * 1024
TuneWhen = Literal["on_assign", "idle", "on_request"]
TuneText = Annotated[str, Field(max_length=MAX_TUNE_TEXT)]
SpaceValue = Annotated[int, Field(strict=True)] | TuneText


class TuneRefused(Exception):
    """Why this node will not tune (the assignment still serves untuned): sent as
    `status.tuning.refused.reason`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TuneBudget(_Message):
    max_minutes: float = Field(default=15.0, gt=0, le=24 * 60)
    max_trials: int = Field(default=12, ge=1, le=256)


class TuneObjective(_Message):
    ladder_max: int = Field(default=16, ge=1, le=1024)
    per_request_floor_tok_s: float | None = Field(default=None, ge=0)
    ttft_p90_ceiling_ms: float | None = Field(default=None, gt=0)


class SpaceEntry(_Message):
    """One flag's narrowing: a range of whole numbers (`min`/`max`) or listed `values` (a switch
    is `{"values": ["on", "off"]}`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    min: int | None = Field(default=None, strict=True)
    max: int | None = Field(default=None, strict=True)
    values: tuple[SpaceValue, ...] | None = Field(default=None, min_length=1, max_length=MAX_SPACE_VALUES)

    @model_validator(mode="after")
    def _one_form(self) -> SpaceEntry:
        ranged = self.min is not None or self.max is not None
        if ranged == (self.values is not None):
            raise ValueError("give either min/max or values")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError("min is above max")
        return self


class TuneSpec(_Message):
    """An engine block's `tune` object, checked (`parse_tune`)."""

    enabled: bool = True
    when: tuple[TuneWhen, ...] = Field(default=("on_assign", "on_request"), max_length=3)
    budget: TuneBudget = TuneBudget()
    min_gain_pct: float = Field(default=3.0, ge=0, le=100)
    objective: TuneObjective | None = None
    space: dict[TuneText, SpaceEntry] = Field(default={}, max_length=MAX_SPACE_KEYS)
    seeds: tuple[tuple[TuneText, ...], ...] = Field(default=(), max_length=MAX_SEEDS)

    @field_validator("seeds")
    @classmethod
    def _seed_sizes(cls, seeds: tuple[tuple[str, ...], ...]) -> tuple[tuple[str, ...], ...]:
        if any(len(seed) > MAX_SEED_ARGS for seed in seeds):
            raise ValueError(f"a seed has more than {MAX_SEED_ARGS} arguments")
        return seeds


_TUNE_SPEC: TypeAdapter[TuneSpec] = TypeAdapter(TuneSpec)


def parse_tune(raw: Any) -> TuneSpec | TuneRefused | None:
    """An engine block's raw `tune` value → its spec, None where there is none, or why it is
    refused (the assignment stands). The frame bounds the value's size; the model bounds its parts."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        return TuneRefused("the tune block is not a JSON object")
    if not _bounded_before_validation(raw):
        return TuneRefused(f"the tune block's space has more than {MAX_SPACE_KEYS} keys "
                           f"or its seeds more than {MAX_SEEDS} lists")
    try:
        return _TUNE_SPEC.validate_python(raw)
    except ValidationError as exc:
        err = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(_cut(str(part)) for part in err["loc"]) or "(block)"
        return TuneRefused(f"invalid tune block: {where}: {_cut(err['msg'], 2 * SHOWN_LIMIT)}")


def _bounded_before_validation(raw: dict[str, Any]) -> bool:
    """The counts checked before pydantic walks (and reports on) every element."""
    space, seeds = raw.get("space"), raw.get("seeds")
    return not ((isinstance(space, dict) and len(space) > MAX_SPACE_KEYS)
                or (isinstance(seeds, list) and len(seeds) > MAX_SEEDS))


class Tune(_Message):
    """Coordinator → app: start or cancel tuning the assignment, or `forget` its kept result."""

    type: Literal["tune"] = "tune"
    assignment_id: str = Field(min_length=1)
    action: Literal["start", "cancel", "forget"]


class TuneRefusal(_Message):
    reason: str


class TuningStatus(_Message):
    """`status.tuning`: where tuning of the current assignment stands."""

    state: Literal["idle", "running", "done", "cancelled", "refused", "failed"] = "idle"
    trial: int = 0
    trials_max: int = 0
    elapsed_s: float = 0.0
    best_gain_pct: float | None = None
    refused: TuneRefusal | None = None


class Tuned(_Message):
    """An engine's `tuned`: the arguments it runs with beyond its tier, and what they measured."""

    args: list[str]
    gain_pct: float
    noise_pct: float


class TuneLevel(_Message):
    """One concurrency's figures (medians of repeats, warm-up excluded)."""

    concurrency: int
    aggregate_tok_s: float
    per_request_tok_s: float
    ttft_p90_ms: float
    failed: int = 0


class TuneFigures(_Message):
    args: list[str]
    levels: list[TuneLevel] = []
    gain_pct: float | None = None
    noise_pct: float | None = None


class TuneTrial(_Message):
    """One trial: its arguments, its figures per level, and why it lost (None: it won)."""

    args: list[str]
    levels: list[TuneLevel] = []
    lost: str | None = None


class TuneReport(_Message):
    """App → coordinator at the end of a tuning: at most `MAX_TUNE_REPORT_BYTES`, no prompts or answers."""

    type: Literal["tune.report"] = "tune.report"
    assignment_id: str
    engine_id: str
    outcome: Literal["adopted", "kept_baseline", "cancelled", "failed"]
    baseline: TuneFigures | None = None
    chosen: TuneFigures | None = None
    trials: list[TuneTrial] = []
    elapsed_s: float = 0.0

    def fitted(self) -> TuneReport:
        """This report within the size limit: the last trials' figures dropped first, then the last
        trials themselves (each loser's arguments and reason are worth more than its levels).
        Linear: each trial is encoded twice (with and without its figures), never the whole again."""
        full = [len(encode(trial).encode()) for trial in self.trials]
        bare_trials = [trial.model_copy(update={"levels": []}) for trial in self.trials]
        bare = [len(encode(trial).encode()) for trial in bare_trials]
        room = MAX_TUNE_REPORT_BYTES - len(encode(self.model_copy(update={"trials": []})).encode())
        room += len(self.trials) > 0  # the list's commas: one fewer than its trials
        total = sum(full) + len(full)
        stripped = len(full)  # trials[stripped:] go without their figures
        while total > room and stripped > 0:
            stripped -= 1
            total -= full[stripped] - bare[stripped]
        kept = len(full)
        while total > room and kept > 0:
            kept -= 1
            total -= bare[kept] + 1
        if room < 0:
            return self.model_copy(update={"baseline": None, "chosen": None, "trials": []})
        return self.model_copy(update={"trials": [*self.trials[:stripped], *bare_trials[stripped:kept]]})


# --- status ----------------------------------------------------------------------------------


class EngineStatus(_Message):
    engine_id: str
    gpu_indices: list[int]
    layout: Layout
    argv: list[str]
    state: State
    kv_cache_tokens: int | None = None
    kv_cache_gib: float | None = None
    max_model_len: int | None = None
    max_concurrency: float | None = None
    restarts: int = 0
    last_error: str | None = None
    tuned: Tuned | None = None


class Throughput(_Message):
    tokens_per_s: float | None = None
    per_request_tokens_per_s: float | None = None
    run_tokens: int = 0
    run_seconds: float = 0.0
    requests: int = 0


class GpuStatus(_Message):
    index: int
    util_pct: float | None = None
    memory_used_mib: int | None = None
    power_w: float | None = None
    temperature_c: float | None = None


class Refused(_Message):
    """A new assignment this node would not run; the one before it (if any) keeps serving."""

    assignment_id: str
    reason: str


class DownloadStatus(_Message):
    """A model or engine being fetched while the node is `configured`."""

    what: Literal["model", "engine"]
    done_mib: int = Field(ge=0)
    total_mib: int | None = Field(default=None, ge=0)
    mib_per_s: float | None = Field(default=None, ge=0)
    paused: bool = False


class Status(_Message):
    type: Literal["status"] = "status"
    state: State
    assignment_id: str | None = None
    model: str | None = None
    last_error: str | None = None
    refused: Refused | None = None
    engines: list[EngineStatus] = []
    throughput: Throughput = Throughput()
    gpus: list[GpuStatus] = []
    in_flight: int = 0
    tuning: TuningStatus | None = None
    limits: Limits | None = None
    download: DownloadStatus | None = None


# --- relay -----------------------------------------------------------------------------------


class Request(_Message):
    type: Literal["request"] = "request"
    id: str = Field(min_length=1)
    method: str
    path: str
    body: Any = None
    deadline_s: float = Field(default=300.0, gt=0)


class Cancel(_Message):
    type: Literal["cancel"] = "cancel"
    id: str


class ResponseHead(_Message):
    type: Literal["response.head"] = "response.head"
    id: str
    status: int
    content_type: str | None = None


class ResponseChunk(_Message):
    type: Literal["response.chunk"] = "response.chunk"
    id: str
    data: str


class Usage(_Message):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class ResponseEnd(_Message):
    type: Literal["response.end"] = "response.end"
    id: str
    usage: Usage | None = None


class ResponseError(_Message):
    type: Literal["response.error"] = "response.error"
    id: str
    status: int
    code: str
    message: str = ""


# --- update and errors -----------------------------------------------------------------------


class Update(_Message):
    type: Literal["update"] = "update"
    version: str = Field(min_length=1)
    url: str = Field(min_length=1)
    sha256: str
    signature: str
    size: int | None = Field(default=None, gt=0)  # bytes, when the offer says; the download stops there


class Error(_Message):
    type: Literal["error"] = "error"
    code: str
    message: str = ""
    ref: str | None = None


# --- routing notice ---------------------------------------------------------------------------

RoutingReason = Literal["low_demand", "warming_up", "probation", "too_slow", "context_too_small", "capacity_full"]
MAX_ROUTING_MESSAGE = 200  # characters: one line a person reads beside the node's own reasons


class Routing(_Message):
    """How much of the model's traffic the network sends this node now, and why not more. Shown to
    the person beside the node's own reasons; the node never acts on it."""

    type: Literal["routing"] = "routing"
    share: float = Field(ge=0.0, le=1.0)
    reason: RoutingReason | None = None
    message: str = Field(default="", max_length=MAX_ROUTING_MESSAGE, pattern=r"^[^\x00-\x1f\x7f]*$")  # one plain line


CoordinatorMessage = (
    Welcome | Assign | Unassign | Pause | Resume | Request | Cancel | Update | Error | Tune | Routing
)
NodeMessage = Hello | Status | ResponseHead | ResponseChunk | ResponseEnd | ResponseError | Error | TuneReport

BATCH_FEATURE = "batch"  # in `Welcome.features`: the coordinator unpacks `Batch` frames


class Batch(_Message):
    """Node messages packed into one frame, in order (see Relay, "Batching"): one frame per loop
    iteration instead of one per token event. Each element is a message that could be sent alone,
    so a batch inside a batch is refused."""

    type: Literal["batch"] = "batch"
    messages: list[Annotated[NodeMessage, Field(discriminator="type")]] = Field(min_length=1)


_FROM_COORDINATOR: TypeAdapter[CoordinatorMessage] = TypeAdapter(
    Annotated[CoordinatorMessage, Field(discriminator="type")]
)
_FROM_NODE: TypeAdapter[NodeMessage | Batch] = TypeAdapter(
    Annotated[NodeMessage | Batch, Field(discriminator="type")]
)
_COORDINATOR_TYPES = frozenset(
    {"welcome", "assign", "unassign", "pause", "resume", "request", "cancel", "update", "error", "tune",
     "routing"}
)
_NODE_TYPES = frozenset(
    {"hello", "status", "response.head", "response.chunk", "response.end", "response.error", "error", "batch",
     "tune.report"}
)
_Parsed = TypeVar("_Parsed")


class Unknown(BaseModel):
    """A message whose type this version does not know: logged and ignored."""

    type: str
    model_config = ConfigDict(frozen=True)


class BadMessage(Exception):
    """A frame that is not JSON, too large, or does not fit its schema: answered with `error`."""

    def __init__(self, message: str, ref: str | None = None, message_type: str | None = None) -> None:
        super().__init__(message)
        self.ref = ref
        self.message_type = message_type  # the frame's "type", when it had one

    def reply(self) -> Error:
        return Error(code="bad_message", message=str(self), ref=self.ref)


def _decode(frame: str | bytes) -> dict[str, Any]:
    if isinstance(frame, bytes):
        if len(frame) > MAX_FRAME_BYTES:
            raise BadMessage(f"frame of {len(frame)} bytes is over the {MAX_FRAME_BYTES}-byte limit")
        raise BadMessage("binary frames are not part of the protocol; send text")
    if len(frame) > MAX_FRAME_BYTES // 4 and len(frame.encode("utf-8", "surrogatepass")) > MAX_FRAME_BYTES:
        raise BadMessage(f"frame is over the {MAX_FRAME_BYTES}-byte limit")
    try:
        data = json.loads(frame)
    except (ValueError, RecursionError) as exc:
        raise BadMessage(f"frame is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadMessage("a frame must be one JSON object")
    if not isinstance(data.get("type"), str):
        raise BadMessage('the message has no string "type"', _ref(data))
    return data


def _ref(data: dict[str, Any]) -> str | None:
    ref = data.get("id") or data.get("assignment_id")
    return ref if isinstance(ref, str) else None


def _parse(frame: str | bytes, adapter: TypeAdapter[_Parsed], known: frozenset[str],
           context: dict[str, Any] | None = None) -> _Parsed | Unknown:
    data = _decode(frame)
    if data["type"] not in known:
        return Unknown(type=data["type"])
    try:
        return adapter.validate_python(data, context=context)
    except (ValidationError, RecursionError) as exc:
        raise BadMessage(_summarise(exc, data["type"]), _ref(data), data["type"]) from None


def _cut(text: str, limit: int = SHOWN_LIMIT) -> str:
    """`text`, or its start and "…" where longer: a frame's keys and values may be megabytes, and a
    reason is logged and repeated in every `status`."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _summarise(exc: Exception, message_type: str) -> str:
    if isinstance(exc, ValidationError):
        problems = "; ".join(
            f"{'.'.join(_cut(str(p)) for p in err['loc'][1:]) or '(message)'}: {_cut(err['msg'], 2 * SHOWN_LIMIT)}"
            for err in exc.errors(include_url=False, include_input=False)[:5]
        )
        return f"invalid {message_type!r} message: {problems}"
    return f"invalid {message_type!r} message: nested too deeply"


def parse_from_coordinator(frame: str | bytes, *, engine_names: Collection[str]) -> CoordinatorMessage | Unknown:
    """A frame the node received → a typed message or `Unknown`; raises `BadMessage`. An
    assignment's engine blocks are read for `engine_names` (the engines this app runs) only."""
    return _parse(frame, _FROM_COORDINATOR, _COORDINATOR_TYPES, {ENGINE_NAMES: tuple(engine_names)})


def parse_from_node(frame: str | bytes) -> NodeMessage | Batch | Unknown:
    """A frame the coordinator received → a typed message, a `Batch` of them, or `Unknown`;
    raises `BadMessage`."""
    return _parse(frame, _FROM_NODE, _NODE_TYPES)


def unpack(message: NodeMessage | Batch | Unknown) -> list[NodeMessage | Unknown]:
    """The messages one parsed frame carries, in order (a batch's elements, or the message)."""
    return list(message.messages) if isinstance(message, Batch) else [message]


def encode(message: BaseModel) -> str:
    """One message → one text frame (compact JSON; `None` fields kept, as the protocol shows them)."""
    return message.model_dump_json()


def encode_batch(encoded: list[str]) -> str:
    """Messages already `encode`d → one `batch` frame, without decoding and dumping them again
    (the relay's hot path): the same JSON as `encode(Batch(messages=...))`."""
    return '{"type":"batch","messages":[' + ",".join(encoded) + "]}"


class ChunkFrames:
    """`response.chunk` frames of one request, encoded without building a model per chunk (the
    relay's hot path: one per engine read): the same JSON as `encode(ResponseChunk(...))`."""

    __slots__ = ("_prefix",)

    def __init__(self, request_id: str) -> None:
        self._prefix = '{"type":"response.chunk","id":' + _json_string(request_id) + ',"data":'

    def encode(self, data: str) -> str:
        return self._prefix + _json_string(data) + "}"


_json_string: Callable[[str], str] = json.encoder.encode_basestring


def signed_update_payload(version: str, sha256: str) -> bytes:
    """The bytes an update's Ed25519 signature covers (version and hash bound together)."""
    return f"gpu-provider-update:{version}:{sha256.lower()}".encode()
