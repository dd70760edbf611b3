"""Would llama-server, started with these arguments on this model file, fit this machine? The KV
cache from the GGUF's own shape, the model, the prompt cache and the threads, each against the
memory (or cores) it lands in, before the engine starts.

Pure but for reading the model file's header (`gguf.py`, bounded) and its size. Why it is needed:
llama-server allocates its whole KV cache at start, so `-c 2097152 -ctk f32 -ctv f32` on a 0.5 MB
model takes 2 GiB of RAM before any request; on a machine that cannot spare it the desktop swaps
or the kernel kills something. The rule follows the llama.cpp sources:

- Cells (`src/llama-context.cpp`): `n_ctx` = `-c`, or the model's trained context for 0/unset,
  padded up to 256. `-np` unset is 4 slots sharing one unified buffer (`tools/server/server.cpp`),
  so the cells are `n_ctx`; an explicit `-np N` without `-kvu` gives each slot its own
  `pad(n_ctx / N, 256)` cells, so `-np 256 -c 1024` allocates 65,536 cells, not 1,024.
- Bytes per cell: per layer, KV heads × (key length × K type bytes + value length × V type
  bytes), from `{arch}.block_count`, `.attention.head_count[_kv]` (a number or one per layer),
  `.attention.key_length`/`.value_length` (default `embedding_length / head_count`). An upper
  bound for sliding-window and MLA models, whose caches are smaller.
- Where it lives: RAM on a machine that serves from RAM, and for the layers `-ngl` leaves on
  the CPU (llama.cpp offloads the last N, counting the output layer), all of it under `-nkvo`;
  the rest in the memory the plan judged the process by (its cards, or the Mac's working set).
  The model's file goes the same way, layer by layer.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

from worker.engines.llamacpp.args import ALLOWLIST
from worker.engines.llamacpp.gguf import GgufError, Value, read_header

if TYPE_CHECKING:
    from worker.engines.base import Room, Run

MIB = 2**20
CONTEXT_PAD = 256  # llama.cpp pads n_ctx (and each slot's share) up to a multiple of 256
AUTO_SLOTS = 4  # `-np` unset (-1): 4 slots over one unified KV buffer
MAX_LAYERS = 4096
MAX_SPLITS = 1024
DEFAULT_CACHE_TYPE = "f16"
# Bytes per element of each `-ctk`/`-ctv` type: ggml's block size ÷ elements per block.
CACHE_TYPE_BYTES: dict[str, Fraction] = {
    "f32": Fraction(4), "f16": Fraction(2), "bf16": Fraction(2), "q8_0": Fraction(34, 32),
    "q4_0": Fraction(18, 32), "q4_1": Fraction(20, 32), "iq4_nl": Fraction(18, 32),
    "q5_0": Fraction(22, 32), "q5_1": Fraction(24, 32),
}
_KEPT = ("block_count", "context_length", "embedding_length", "attention.head_count",
         "attention.head_count_kv", "attention.key_length", "attention.value_length")
_INDEX = {spelling: flag for flag in ALLOWLIST.flags for spelling in flag.all_spellings()}


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache's size depends on, per the GGUF header; and the model's size on disk."""

    layers: int
    trained_context: int  # 0 where the file does not say
    kv_heads: tuple[int, ...]  # one per layer (0 for a recurrent layer, which keeps no KV)
    key_length: int
    value_length: int
    file_bytes: int

    def cell_bytes(self, layers: range, cache_k: str, cache_v: str) -> Fraction:
        """Bytes of one KV cell over `layers`."""
        k, v = CACHE_TYPE_BYTES[cache_k], CACHE_TYPE_BYTES[cache_v]
        return sum((self.kv_heads[i] * (self.key_length * k + self.value_length * v) for i in layers), Fraction(0))


@dataclass(frozen=True)
class ServerSettings:
    """What one argument list asks of llama-server's memory and CPU (the last occurrence wins)."""

    context: int = 0  # 0: the model's trained context
    slots: int | None = None  # None: automatic (4 slots, unified)
    unified: bool = False  # `-kvu` given with an explicit `-np`
    cache_k: str = DEFAULT_CACHE_TYPE
    cache_v: str = DEFAULT_CACHE_TYPE
    gpu_layers: int | None = None  # None: every layer (unset, auto, all)
    kv_offload: bool = True
    cache_ram_mib: int | None = None  # `-cram`; None: llama-server's default
    threads: int | None = None
    threads_batch: int | None = None

    @classmethod
    def from_args(cls, args: Sequence[str]) -> ServerSettings:
        """Only for arguments that passed the llama.cpp allowlist (every token known, values typed)."""
        found: dict[str, str | bool] = {}
        i = 0
        while i < len(args):
            flag = _INDEX[args[i]]
            if flag.takes_value:
                found[flag.name] = args[i + 1]
                i += 2
            else:
                found[flag.name] = args[i] in flag.spellings
                i += 1

        def number(name: str, auto: tuple[str, ...] = ()) -> int | None:
            text = found.get(name)
            return None if text is None or text in auto else int(str(text))

        return cls(
            context=number("-c") or 0,
            slots=number("-np", ("-1",)),
            unified=found.get("-kvu") is True,
            cache_k=str(found.get("-ctk", DEFAULT_CACHE_TYPE)),
            cache_v=str(found.get("-ctv", DEFAULT_CACHE_TYPE)),
            gpu_layers=number("-ngl", ("auto", "all")),
            kv_offload=found.get("-kvo", True) is True,
            cache_ram_mib=number("-cram"),
            threads=number("-t"),
            threads_batch=number("-tb"),
        )

    def cells(self, trained_context: int) -> int:
        """KV cells llama-server allocates over all its slots."""
        context = _padded(self.context or trained_context)
        if self.slots is None or self.unified:
            return context
        return _padded(context // self.slots) * self.slots

    def host_layers(self, layers: int, from_ram: bool) -> range:
        """The layers whose weights stay in RAM: all on a machine that serves from RAM; else those
        before the last `-ngl` (which counts the output layer as one)."""
        if from_ram:
            return range(layers)
        if self.gpu_layers is None:
            return range(0)
        return range(max(0, min(layers, layers + 1 - self.gpu_layers)))


@dataclass(frozen=True)
class Demand:
    """What one start would put in one memory: the KV cache, the model, the prompt cache (bytes)."""

    kv: int
    model: int
    prompt_cache: int = 0

    @property
    def total(self) -> int:
        return self.kv + self.model + self.prompt_cache


def read_shape(model_path: str) -> ModelShape:
    """The model file's shape; raises `GgufError` with a plain reason."""
    header = read_header(model_path, lambda key: key in ("general.architecture", "split.count")
                         or key.endswith(tuple(f".{suffix}" for suffix in _KEPT)))
    values = header.values
    arch = values.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise GgufError("the model file does not name its architecture")

    def get(suffix: str) -> Value | None:
        return values.get(f"{arch}.{suffix}")

    layers = _whole(get("block_count"), "block_count", high=MAX_LAYERS)
    if layers == 0:
        raise GgufError("the model file does not say how many layers it has")
    heads = _per_layer(get("attention.head_count"), layers, "attention.head_count")
    kv_raw = get("attention.head_count_kv")
    kv_heads = heads if kv_raw is None else _per_layer(kv_raw, layers, "attention.head_count_kv")
    width = _whole(get("embedding_length"), "embedding_length")
    default_length = width // heads[0] if heads[0] else 0
    key_length = _whole(get("attention.key_length"), "attention.key_length") or default_length
    value_length = _whole(get("attention.value_length"), "attention.value_length") or default_length
    splits = max(1, _whole(values.get("split.count"), "split.count", high=MAX_SPLITS))
    try:
        size = os.stat(model_path).st_size
    except OSError as exc:
        raise GgufError(f"the model file cannot be read ({exc.strerror or type(exc).__name__})") from None
    return ModelShape(layers, _whole(get("context_length"), "context_length"), kv_heads, key_length, value_length,
                      size * splits)


def start_problem(model_path: str, runs: Sequence[Run], room: Room) -> str | None:
    """Why llama-server cannot start with one of `runs` (label, arguments) on this model here: the
    first thread count over the machine's cores, or memory that would not fit (what, by how much);
    None when every run fits."""
    settings = [(label, ServerSettings.from_args(args)) for label, args in runs]
    for label, wanted in settings:
        if problem := _thread_problem(label, wanted, room.cores):
            return problem
    try:
        shape = read_shape(model_path)
    except GgufError as exc:
        return f"the model file cannot be used: {exc}"
    for label, wanted in settings:
        if problem := _memory_problem(label, wanted, shape, room):
            return problem
    return None


def _thread_problem(label: str, wanted: ServerSettings, cores: int) -> str | None:
    for flag, threads in (("-t", wanted.threads), ("-tb", wanted.threads_batch)):
        if threads is not None and threads > cores:
            return (f"value not allowed for {flag} (in {label}): {threads:,} threads, more than this "
                    f"computer's {cores:,} CPU threads")
    return None


def _memory_problem(label: str, wanted: ServerSettings, shape: ModelShape, room: Room) -> str | None:
    cells = wanted.cells(shape.trained_context)
    if cells == 0:
        return f"the model file does not give its context length; set one with -c (in {label})"
    from_ram = room.device_mib is None
    host = wanted.host_layers(shape.layers, from_ram)
    kv_host = host if wanted.kv_offload else range(shape.layers)
    kv_total = math.ceil(cells * shape.cell_bytes(range(shape.layers), wanted.cache_k, wanted.cache_v))
    kv_in_ram = math.ceil(cells * shape.cell_bytes(kv_host, wanted.cache_k, wanted.cache_v))
    model_in_ram = shape.file_bytes * len(host) // shape.layers
    prompt_cache = (wanted.cache_ram_mib or 0) * MIB
    ram = Demand(kv_in_ram, model_in_ram, prompt_cache)
    words = _ContextWords(cells, wanted)
    if ram.total > room.ram_mib * MIB:
        return _short(label, ram, room.ram_mib, "RAM this computer can spare now", words)
    if room.device_mib is not None:
        device = Demand(kv_total - kv_in_ram, shape.file_bytes - model_in_ram)
        if device.total > room.device_mib * MIB:
            return _short(label, device, room.device_mib, "graphics memory usable here", words)
    return None


@dataclass(frozen=True)
class _ContextWords:
    cells: int
    wanted: ServerSettings

    def __str__(self) -> str:
        slots = self.wanted.slots or AUTO_SLOTS
        kinds = {self.wanted.cache_k, self.wanted.cache_v}
        kind = kinds.pop() if len(kinds) == 1 else f"{self.wanted.cache_k} keys, {self.wanted.cache_v} values"
        return f"{self.cells:,} tokens of context over {slots} slot{'s' if slots > 1 else ''}, stored as {kind}"


def _short(label: str, demand: Demand, room_mib: int, where: str, context: _ContextWords) -> str:
    parts = [f"{_mib(demand.kv)} for {context}"]
    if demand.model:
        parts.append(f"{_mib(demand.model)} for the model")
    if demand.prompt_cache:
        parts.append(f"{_mib(demand.prompt_cache)} for the prompt cache (-cram)")
    need = math.ceil(demand.total / MIB)
    fits_without_cache = demand.total - demand.prompt_cache <= room_mib * MIB
    advice = ("a smaller prompt cache (-cram)" if fits_without_cache
              else "a shorter context (-c), fewer slots (-np) or a smaller cache type (-ctk/-ctv)")
    return (f"not enough memory (with {label}): it would need {need:,} MiB ({', '.join(parts)}), but the "
            f"{where} is {room_mib:,} MiB, {need - room_mib:,} MiB short; ask for {advice}")


def _mib(count: int) -> str:
    return f"{math.ceil(count / MIB):,} MiB"


def _padded(tokens: int) -> int:
    return -(-tokens // CONTEXT_PAD) * CONTEXT_PAD


def _whole(value: Value | None, key: str, *, high: int = 2**32) -> int:
    """A whole number from 0 to `high`; 0 where the key is absent."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        raise GgufError(f"{key} in the model file is not a whole number from 0 to {high:,}")
    return value


def _per_layer(value: Value | None, layers: int, key: str) -> tuple[int, ...]:
    """A count for every layer, from one number or a list of one per layer."""
    if isinstance(value, tuple):
        if len(value) != layers:
            raise GgufError(f"{key} in the model file lists {len(value)} values for {layers} layers")
        return tuple(_whole(v, key, high=2**20) for v in value)
    return (_whole(value, key, high=2**20),) * layers
