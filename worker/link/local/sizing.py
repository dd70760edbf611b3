"""Local mode's model rules: which `assign` a person's `--model` becomes, and how large it is.

A GGUF file (a path, or an https URL with its sha256) or a model folder / Hugging Face repository
goes to the first engine of this machine's runtime (`registry.for_runtime`, preference order) whose
`MODEL_FORMAT` reads it, with that engine's `LOCAL_DEFAULTS`; where none does, the person is told
which form the engines here need. (On `cpu` a folder goes to the engine that serves it there only
where installed; where it is not, the plan refuses the folder and says so.) The size is measured
on disk for a local path and estimated from the name otherwise; the plan needs it up front.
Where the person asks local mode to tune, the block carries `local_tune_block()`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from worker.contract import protocol
from worker.engines import registry
from worker.engines.base import EngineAdapter, ModelFormat
from worker.plan.sources import BadSource, parse_source

DEFAULT_LOCAL_MODEL = (
    "https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct-GGUF/resolve/main/qwen2.5-0.5b-instruct-q4_k_m.gguf"
    "#sha256=74a4da8c9fdbcd15bd1f6d01d621410d31c6fc00986f5eb687824e7b93d7a9db"
)
DEFAULT_LOCAL_MODEL_MIB = 470
LOCAL_ASSIGNMENT_ID = "local-1"
_FORMS: dict[ModelFormat, tuple[str, str]] = {  # what a format is, and how a person gives one
    "gguf": ("a .gguf file", "Give a GGUF file's path or https:// URL"),
    "folder": ("a model folder or Hugging Face repository", "Give a model folder's path or a repository id (org/name)"),
}
_PARAMS = re.compile(r"(\d+(?:\.\d+)?)\s*[bB](?![a-zA-Z])")
_BYTES_PER_PARAM = (("q2", 0.35), ("q3", 0.45), ("q4", 0.6), ("q5", 0.7), ("q6", 0.82), ("q8", 1.07),
                    ("awq", 0.6), ("gptq", 0.6), ("w4a16", 0.6), ("int4", 0.6), ("fp8", 1.05), ("w8a8", 1.05))


class LocalModelError(ValueError):
    """The model given for local mode cannot be used; the message says why and what to do."""

    title = "The local model cannot be used"  # the problem's title where a person sees it


def local_assignment(runtime: str, model: str | None = None, *, weights_mib: int | None = None,
                     tune: dict[str, Any] | None = None) -> protocol.Assign:
    """The `assign` local mode sends: the block of the first engine of `runtime` that reads the
    model's form (a GGUF file, path or URL; or a model folder or Hugging Face repo), with `tune` as
    its `tune` block where given. A local path is measured on disk (a few stat calls: call this
    from a thread). A URL carries its hash as `URL#sha256=HEX`: downloads are always verified."""
    text = model or DEFAULT_LOCAL_MODEL
    text, sha256 = _split_hash(text)
    text = typed_path(text)
    try:
        source = parse_source(text)
    except BadSource as exc:
        raise LocalModelError(str(exc)) from None
    gguf = source.label.lower().endswith(".gguf")
    if source.kind == "hf" and "gguf" in source.value.lower():
        raise LocalModelError(
            f"{text!r} is a repository of GGUF files; name one file instead: "
            "https://huggingface.co/ORG/REPO/resolve/main/FILE.gguf#sha256=HASH, or a downloaded file's path")
    if source.kind == "https" and sha256 is None:
        raise LocalModelError(
            f"{text!r} is a download without its sha256; add it as {text}#sha256=HASH (the hash the model's "
            "page lists), or download the file and give its path")
    adapter = _engine_for(runtime, "gguf" if gguf else "folder", text)
    size = weights_mib or _weights_mib(source.kind, source.value, model is None)
    name = re.sub(r"\.gguf$", "", source.label, flags=re.IGNORECASE).lower()
    defaults = adapter.LOCAL_DEFAULTS
    spec = protocol.EngineModel(source=source.value, sha256=sha256 if gguf else None, weights_mib=size,
                                base_args=list(defaults.base_args),
                                tiers={key: list(args) for key, args in defaults.tiers.items()}, tune=tune)
    return protocol.Assign(assignment_id=LOCAL_ASSIGNMENT_ID, model=protocol.ModelSpec(name=name, **{adapter.NAME: spec}))


def local_tune_block(minutes: float = 15.0, trials: int = 12) -> dict[str, Any]:
    """The `tune` block a person's local run carries when they ask for tuning: one search after
    the first ready (a result it keeps is reused at the next start, checked again), within
    `minutes` and `trials`, over the engine's own tuning space: no coordinator is there to narrow
    it or to send a `tune` message."""
    return {"enabled": True, "when": ["on_assign"], "budget": {"max_minutes": minutes, "max_trials": trials}}


def _engine_for(runtime: str, form: ModelFormat, text: str) -> EngineAdapter:
    """The first engine of `runtime` that reads `form`; LocalModelError naming those that run here
    and the form they need where none does."""
    serving = registry.for_runtime(runtime)
    for adapter in serving:
        if adapter.MODEL_FORMAT == form:
            return adapter
    if not serving:
        raise LocalModelError(f"this machine's runtime ({runtime}) runs none of the engines this app has")
    names = " and ".join(dict.fromkeys(adapter.DISPLAY_NAME for adapter in serving))
    needed = next(iter(dict.fromkeys(adapter.MODEL_FORMAT for adapter in serving)))
    what, give = _FORMS[needed]
    verb = "needs" if len(serving) == 1 else "need"
    raise LocalModelError(f"this machine runs {names} only (runtime {runtime!r}), which {verb} {what}; "
                          f"{text!r} is not one. {give}")


def typed_path(text: str) -> str:
    """A path as people type it (`models/x.gguf`, `./m`, `~/m.gguf`) made absolute against the
    working directory; a URL, an absolute path or a repo id (`org/name`, not on disk) unchanged."""
    if "://" in text or Path(text).is_absolute():
        return text
    candidate = Path(text).expanduser()
    typed_as_path = text.startswith(("./", "../", "~", ".\\", "..\\")) or text.lower().endswith(".gguf")
    if typed_as_path or candidate.exists():
        return str(candidate.resolve())
    return text


def _split_hash(text: str) -> tuple[str, str | None]:
    """`URL#sha256=HEX` → (URL, hex); anything else unchanged."""
    base, marker, digest = text.partition("#sha256=")
    if not marker:
        return text, None
    if not re.fullmatch(r"[0-9a-fA-F]{64}", digest):
        raise LocalModelError(f"{digest!r} after #sha256= is not a sha256 (64 hexadecimal digits)")
    return base, digest.lower()


def _weights_mib(kind: str, value: str, is_default: bool) -> int:
    if is_default:
        return DEFAULT_LOCAL_MODEL_MIB
    if kind == "local":
        return _measured_mib(Path(value))
    return _estimated_mib(value)


def _measured_mib(path: Path) -> int:
    if path.is_file():
        total = path.stat().st_size
    elif path.is_dir():
        total = sum(p.stat().st_size for p in path.iterdir()
                    if p.is_file() and p.suffix in (".safetensors", ".bin", ".pt", ".gguf"))
    else:
        raise LocalModelError(f"{str(path)!r} does not exist; give the path of a downloaded model")
    if total == 0:
        raise LocalModelError(f"{str(path)!r} holds no model weights (.safetensors, .bin or .gguf)")
    return max(1, round(total / 2**20))


def _estimated_mib(name: str) -> int:
    """A size from the name (`…-0.5B-…-Q4_K_M`): the parameter count times the bytes a weight takes."""
    match = _PARAMS.search(name.rsplit("/", 1)[-1])
    if match is None:
        raise LocalModelError(
            f"can't tell how large {name!r} is from its name; download it and give its path instead")
    lowered = name.lower()
    per_param = next((b for tag, b in _BYTES_PER_PARAM if tag in lowered), 0.6 if ".gguf" in lowered else 2.0)
    return max(1, round(float(match.group(1)) * 1e9 * per_param / 2**20))
