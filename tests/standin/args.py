"""vLLM's `serve` command line, as its FlexibleArgumentParser reads it.

Last occurrence wins (plain argparse `store`), `_` and `-` are interchangeable in long names,
booleans take `--x` / `--no-x`, and an unknown flag is an error, as in vLLM. `--uds PATH` serves
on a Unix socket and then host and port are ignored; the key comes from `--api-key`, or else from
`VLLM_API_KEY` in the environment, as in vLLM. The stand-in also refuses to listen anywhere but
loopback: vLLM's default host is every interface, so a missing `--host` without `--uds`, or a
non-loopback `--host` at all, is a bug in the caller that a test must see.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class CliError(Exception):
    """A command line vLLM would reject (argparse exits with status 2)."""


@dataclass(frozen=True)
class ServeArgs:
    model: str
    host: str | None
    port: int
    uds: str | None
    api_keys: tuple[str, ...]
    served_names: tuple[str, ...]
    tensor_parallel: int
    max_model_len: int | None
    max_num_seqs: int | None  # None: vLLM's default for the card (performance.py)
    gpu_memory_utilization: float
    enforce_eager: bool
    non_default: dict[str, object]
    max_num_batched_tokens: int | None = None  # None: vLLM's default for the card (performance.py)
    speculative: dict[str, object] | None = None  # `--speculative-config` with `--spec-method/--spec-tokens` merged
    max_cudagraph_capture_size: int | None = None
    cudagraph_mode: str | None = None  # `--compilation-config`'s `cudagraph_mode`; "NONE" turns graphs off

    @property
    def served_name(self) -> str:
        return self.served_names[0] if self.served_names else self.model


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise CliError(message)


def _max_model_len(text: str) -> int:
    """`--max-model-len` takes `32768`, `32k`, `25.6k`, `1M`; `-1`/`auto` mean auto-fit (None here)."""
    lowered = text.strip().lower()
    if lowered in ("-1", "auto"):
        return -1
    scale = {"k": 1000, "m": 1000 * 1000}.get(lowered[-1:], 1)
    number = lowered[:-1] if scale != 1 else lowered
    return int(float(number) * scale)


def _json_object(text: str) -> dict[str, object]:
    """vLLM reads `--speculative-config` and `--compilation-config` as a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _speculative(space: argparse.Namespace) -> dict[str, object] | None:
    """`--spec-method` and `--spec-tokens` set `method` and `num_speculative_tokens` of the config."""
    config: dict[str, object] = dict(space.speculative_config or {})
    if space.spec_method is not None:
        config["method"] = space.spec_method
    if space.spec_tokens is not None:
        config["num_speculative_tokens"] = space.spec_tokens
    return config or None


def _parser() -> _Parser:
    parser = _Parser(prog="vllm serve", add_help=False)
    parser.add_argument("model")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--uds")
    parser.add_argument("--api-key", nargs="+")
    parser.add_argument("--served-model-name", nargs="+")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    parser.add_argument("--max-model-len", type=_max_model_len)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", "-q")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--speculative-config", "-sc", type=_json_object)
    parser.add_argument("--spec-method")
    parser.add_argument("--spec-tokens", type=int)
    parser.add_argument("--compilation-config", "-cc", type=_json_object)
    parser.add_argument("--max-cudagraph-capture-size", type=int)
    parser.add_argument("--generation-config")
    parser.add_argument("--uvicorn-log-level", default="info")
    parser.add_argument("--disable-access-log-for-endpoints")
    for flag in ("--enforce-eager", "--trust-remote-code", "--enable-chunked-prefill", "--disable-log-stats",
                 "--disable-uvicorn-access-log", "--enable-prefix-caching"):
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--disable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    return parser


def _normalise(argv: Sequence[str]) -> list[str]:
    """`--max_model_len=8` → `--max-model-len=8`, as vLLM accepts either spelling."""
    out = []
    for token in argv:
        if token.startswith("--"):
            name, sep, value = token.partition("=")
            token = name.replace("_", "-") + sep + value
        out.append(token)
    return out


def _require_loopback(host: str | None, uds: str | None) -> str | None:
    if host is None:
        if uds is not None:
            return None
        raise CliError("--host is missing: vLLM would listen on every interface; pass --host 127.0.0.1")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise CliError(f"the stand-in refuses --host {host}: engines listen on loopback only")
    return host


def parse_serve(argv: Sequence[str], env: Mapping[str, str] = os.environ) -> ServeArgs:
    """Parse `serve MODEL …`; raises CliError with vLLM's kind of message."""
    if not argv or argv[0] != "serve":
        raise CliError("the stand-in only knows the `serve` subcommand")
    parser = _parser()
    space = parser.parse_args(_normalise(argv[1:]))
    defaults = vars(parser.parse_args([space.model]))
    non_default = {k: v for k, v in vars(space).items() if v != defaults[k] or k == "model"}
    if non_default.get("api_key"):
        non_default["api_key"] = ["***"]
    max_len = space.max_model_len
    return ServeArgs(
        model=space.model,
        host=_require_loopback(space.host, space.uds),
        port=space.port,
        uds=space.uds,
        api_keys=tuple(space.api_key or ([env["VLLM_API_KEY"]] if env.get("VLLM_API_KEY") else ())),
        served_names=tuple(space.served_model_name or ()),
        tensor_parallel=space.tensor_parallel_size,
        max_model_len=None if max_len in (None, -1) else max_len,
        max_num_seqs=space.max_num_seqs,
        gpu_memory_utilization=space.gpu_memory_utilization,
        enforce_eager=bool(space.enforce_eager),
        non_default=non_default,
        max_num_batched_tokens=space.max_num_batched_tokens,
        speculative=_speculative(space),
        max_cudagraph_capture_size=space.max_cudagraph_capture_size,
        cudagraph_mode=str((space.compilation_config or {}).get("cudagraph_mode") or "") or None,
    )
