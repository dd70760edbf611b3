"""A third engine, for tests only: its adapter, and the small server process it starts.

The adapter (this module, as `worker.engines.vllm` is one) is everything an engine gives the
registry; a test registers it (`registry.register(toy_engine)`) and unregisters it after, so that
no core module is changed to run it. The process (`python -m tests.support.toy_engine`) is a real
child: it listens on a Unix socket or a port, prints the log lines `parse_line` reads, checks the
API key the adapter put in its environment on everything but `/health` and `/metrics`, answers
`/v1/models` and `/v1/completions`, counts what it generated in `/metrics` under its own series
names, and tells its slot count at `/toy/props`, which the supervisor reads once ready.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from worker.engines import layout
from worker.engines.allowlist import AllowedFlag, Allowlist, IntValue
from worker.engines.base import (
    Endpoint,
    EngineTuning,
    FailureHint,
    Knob,
    Launch,
    Listening,
    LocalDefaults,
    LogFact,
    ModelFormat,
    PhaseReached,
    SeriesLabels,
    Slots,
    cuda_environment,
)
from worker.engines.layout import Unit
from worker.engines.releases import ListedReleases
from worker.contract.events import EngineSnapshot
from worker.hardware.model import EngineInstall, Machine

REPO = Path(__file__).resolve().parents[2]
KEY_VARIABLE = "TOY_API_KEY"
PROPS = "/toy/props"

NAME = "toy"
DISPLAY_NAME = "Toy engine"
ARGS_TITLE = "Toy engine (tests only)"
RUNTIMES: frozenset[str] = frozenset({"cpu"})  # llama.cpp serves `cpu` too, and is registered first
FALLBACK_RUNTIMES: frozenset[str] = frozenset()
MODEL_FORMAT: ModelFormat = "folder"
UNIX_SOCKET = True
MEMORY_SHARE = False
DEFAULT_EXECUTABLE: tuple[str, ...] = (sys.executable, "-m", "tests.support.toy_engine")
ALLOWED_ARGS = Allowlist("toy", (AllowedFlag(("--slots",), IntValue(1, 64), "Requests served at once."),))
ENDPOINTS: Mapping[str, Endpoint] = {
    "health": Endpoint("/health", needs_api_key=False),
    "models": Endpoint("/v1/models", needs_api_key=True),
    "metrics": Endpoint("/metrics", needs_api_key=False),
    "props": Endpoint(PROPS, needs_api_key=True),
}
METRICS_PREFIX = "toy_"
METRIC_NAMES: Mapping[str, tuple[str, ...]] = {
    "requests_running": ("toy_requests_active",),
    "prompt_tokens": ("toy_prompt_tokens",),
    "generation_tokens": ("toy_generated_tokens",),
}
READY_READS: tuple[str, ...] = (PROPS,)
LOCAL_DEFAULTS = LocalDefaults(("--slots", "2"))
FAILURE_HINTS: tuple[FailureHint, ...] = (FailureHint(re.compile(r"^toy: no room for \d+ slots"), "out_of_memory"),)
PRIVATE_ENV_PREFIXES: tuple[str, ...] = ("TOY_SETTING_",)
RELEASES = ListedReleases(("1.0",))  # no installer: it runs from `--engine-bin`
TUNING = EngineTuning(knobs=(Knob("--slots", "int", 1, 64, grows_memory=True),), never=frozenset())

_LOADING = re.compile(r"^toy: loading (\S+)")
_LISTENING = re.compile(r"^toy: serving on (\S+)")


def command(launch: Launch) -> list[str]:
    listen = ["--socket", launch.socket_path] if launch.socket_path is not None else ["--port", str(launch.port)]
    return [*launch.executable, "--model", launch.model, *launch.args, "--served-name", launch.served_name, *listen]


def environment(base: Mapping[str, str], gpu_indices: Sequence[int], *, api_key: str | None = None,
                config_home: str | None = None) -> dict[str, str]:
    env = cuda_environment(base, gpu_indices)
    env["PYTHONPATH"] = str(REPO)  # `-m tests.support.toy_engine` from any working folder
    if api_key is not None:
        env[KEY_VARIABLE] = api_key
    return env


def parse_line(line: str) -> LogFact | None:
    if _LOADING.search(line):
        return PhaseReached("loading")
    if match := _LISTENING.search(line):
        return Listening(match.group(1))
    return None


def units(machine: Machine, weights_mib: int, cap: float | None) -> list[Unit] | str:
    return layout.whole_group_units(machine, weights_mib)


def capacity(machine: Machine, cap: float | None) -> str:
    return layout.whole_group_capacity(machine)


def runtime_environment(machine: Machine, version: str | None) -> dict[str, str]:
    return {"TOY_RUNTIME": machine.runtime}


def tier_warning(machine: Machine, gpu_indices: Sequence[int], tier: str | None, args: Sequence[str],
                 base_args: Sequence[str]) -> str | None:
    return None if tier is None else f"tier {tier}: the toy engine runs {' '.join(args)} (base: {' '.join(base_args)})"


def derive_metrics(values: dict[str, float | None], labels: SeriesLabels) -> dict[str, float | None]:
    return values


def ready_snapshot(reads: Mapping[str, Any], snapshot: EngineSnapshot, slots: Slots | None) -> EngineSnapshot:
    return dataclasses.replace(snapshot, max_concurrency=float(reads[PROPS]["slots"]))


def find_installed(system: str, where: str | None, run: Any) -> EngineInstall:
    return EngineInstall(version="1.0" if where else None, path=where)




# --- the process --------------------------------------------------------------------------------


class _Counters:
    def __init__(self) -> None:
        self.active = 0
        self.prompt_tokens = 0
        self.generated = 0


async def _serve(options: argparse.Namespace) -> None:
    from aiohttp import web

    key = os.environ.get(KEY_VARIABLE)
    counters = _Counters()

    def authorised(request: web.Request) -> bool:
        return key is not None and request.headers.get("Authorization") == f"Bearer {key}"

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(request: web.Request) -> web.Response:
        if not authorised(request):
            return web.json_response({"error": "unauthorised"}, status=401)
        return web.json_response({"data": [{"id": options.served_name, "max_model_len": 1024}]})

    async def completions(request: web.Request) -> web.Response:
        if not authorised(request):
            return web.json_response({"error": "unauthorised"}, status=401)
        body = await request.json()
        tokens = int(body.get("max_tokens") or 8)
        counters.prompt_tokens += 1
        counters.generated += tokens
        return web.json_response({"choices": [{"index": 0, "text": " toy" * tokens, "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": tokens}})

    async def props(request: web.Request) -> web.Response:
        if not authorised(request):
            return web.json_response({"error": "unauthorised"}, status=401)
        return web.json_response({"slots": options.slots})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=(
            "# TYPE toy_requests_active gauge\n"
            f"toy_requests_active {counters.active}\n"
            "# TYPE toy_prompt_tokens_total counter\n"
            f"toy_prompt_tokens_total {counters.prompt_tokens}\n"
            "# TYPE toy_generated_tokens_total counter\n"
            f"toy_generated_tokens_total {counters.generated}\n"
        ))

    print(f"toy: loading {options.model}", flush=True)
    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/v1/models", models), web.post("/v1/completions", completions),
                    web.get(PROPS, props), web.get("/metrics", metrics)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    if options.socket:
        site: web.BaseSite = web.UnixSite(runner, options.socket)
    else:
        site = web.TCPSite(runner, "127.0.0.1", options.port)
    await site.start()
    print(f"toy: serving on {options.socket or f'http://127.0.0.1:{options.port}'}", flush=True)
    await asyncio.Event().wait()


def _main() -> None:
    parser = argparse.ArgumentParser(description="the toy engine's server (tests only)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-name", required=True)
    parser.add_argument("--slots", type=int, default=1)
    listen = parser.add_mutually_exclusive_group(required=True)
    listen.add_argument("--socket")
    listen.add_argument("--port", type=int)
    asyncio.run(_serve(parser.parse_args()))


if __name__ == "__main__":
    _main()
