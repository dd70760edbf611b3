"""Entry point of the vLLM stand-in (`tests/standin/vllm serve MODEL …`). A test double, not vLLM.

It reads vLLM's CLI, prints vLLM's startup lines, then serves on the Unix socket (`--uds`) or the
host and port given until SIGTERM or SIGINT (or misbehaves as the STANDIN_* variables ask; see behaviour.py). Like vLLM it
runs an engine-core child process, which the API server stops when it exits (and which outlives
an API server killed with SIGKILL, as vLLM's does).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence

from tests.standin.args import CliError, ServeArgs, parse_serve
from tests.standin.behaviour import Behaviour
from tests.standin.server import StandinServer
from tests.standin.startup import Line, effective_max_model_len, startup, uvicorn_ready

USAGE = ("usage: vllm serve MODEL [--host HOST] [--port PORT] [--uds PATH] [--api-key KEY] "
         "[--served-model-name NAME] …")


def _print(lines: Sequence[Line]) -> None:
    for stream, text in lines:
        print(text, file=sys.stdout if stream == "stdout" else sys.stderr, flush=True)


def _engine_core() -> int:
    """Fork vLLM's EngineCore process (its log lines carry its pid) and return that pid. Like the real
    one it runs until signalled: the API server stops it when it exits, but an API server killed
    with SIGKILL leaves it running, re-parented to init (tests/fixtures/vllm/cpu-0.32-processes.json).
    It ignores SIGINT (a terminal's Ctrl-C reaches the API server) and dies of SIGTERM."""
    core = os.fork()
    if core == 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        while True:
            signal.pause()
    return core


def _stop_engine_core(core: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(core, signal.SIGTERM)
        os.waitpid(core, 0)


def _bind_uds(path: str) -> socket.socket:
    """Bound before the engine starts, as vLLM does; a file already at `path` is an error (EADDRINUSE)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    return sock


async def _serve(server: StandinServer, ready: Sequence[Line], ignore_sigterm: bool,
                 uds: socket.socket | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if not ignore_sigterm:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    if uds is not None:
        listener = await asyncio.start_unix_server(server.handle, sock=uds, backlog=1024, limit=256 * 1024)
    else:
        listener = await asyncio.start_server(server.handle, server.args.host, server.args.port, backlog=1024,
                                              limit=256 * 1024)
    _print(ready)
    async with listener:
        await stop.wait()
    if server.args.uds is not None:
        with contextlib.suppress(OSError):
            os.unlink(server.args.uds)
    print(f"(APIServer pid={os.getpid()}) INFO Shutting down FastAPI HTTP server.", flush=True)


def main(argv: Sequence[str]) -> int:
    try:
        args = parse_serve(argv)
        behaviour = Behaviour.from_env()
    except (CliError, ValueError) as exc:
        print(f"{USAGE}\nvllm: error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        uds = _bind_uds(args.uds) if args.uds is not None else None
    except OSError as exc:
        print(f"(APIServer pid={os.getpid()}) ERROR OSError: {exc}", file=sys.stderr, flush=True)
        return 1
    if behaviour.ignore_sigterm:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    core = _engine_core() if behaviour.engine_core else None
    try:
        return _run(args, behaviour, uds, core)
    finally:
        if core is not None:
            _stop_engine_core(core)


def _run(args: ServeArgs, behaviour: Behaviour, uds: socket.socket | None, core: int | None) -> int:
    outcome = startup(args, behaviour, core)
    if behaviour.start_delay_s:
        _print(outcome.lines[:3])
        time.sleep(behaviour.start_delay_s)
        _print(outcome.lines[3:])
    else:
        _print(outcome.lines)
    if outcome.exit_status is not None:
        return outcome.exit_status
    server = StandinServer(args, behaviour, effective_max_model_len(args, behaviour))
    asyncio.run(_serve(server, uvicorn_ready(), behaviour.ignore_sigterm, uds))
    return 0
