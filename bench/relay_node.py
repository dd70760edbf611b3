"""The node side of the relay benchmark, in its own process: `Link` ⇄ `Relay` ⇄ engine.

It wires the two exactly as `worker.node.node.Node` does (`relay.handle(request, link.sender())`,
`cancel`, `cancel_all` on disconnect) with one fixed ready engine, and pins itself to the CPUs
given, so that "on one core" is literal. With `--profile FILE` it runs under cProfile and writes
the stats on SIGTERM. The relay reads the engine through its shipped client (`worker.relay.loopback_http`).

With `--held FILE` it also times its own part of each token's way, in one of every `HELD_SAMPLE`
frames it writes: from the engine's stamp to the moment the frame is handed to the websocket's
socket (engine → node delivery, the relay's work, and any wait for the socket). On SIGTERM it
writes `[[stamp_ns, held_ns], …]` there. This separates what the node adds from what the
coordinator stand-in adds on the far side, which on a small machine shares a core with the engine.

Run: `python -m bench.relay_node --url ws://127.0.0.1:PORT/v1/provider --engine http://127.0.0.1:P`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import cProfile
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any


from worker.link import connection as link_module
from worker.contract import protocol
from worker.link.connection import Backoff, Link
from worker.link.outgoing import Outgoing, Write
from worker.relay.forward import EngineTarget, Relay, engine_http_client

TOKEN = "bench-token"
HELD_SAMPLE = 4  # one written frame in this many is timed
_STAMP_IN_FRAME = re.compile(r'\\"t\\":(\d+)')  # a chunk's stamp, JSON-escaped inside the frame
HELLO = protocol.Hello(
    node_id="bench-node", app_version="bench",
    platform=protocol.PlatformInfo(os="linux", runtime="cpu", arch="x86_64"),
    hardware=protocol.HardwareInfo(ram_mib=1024, cpu=protocol.CpuInfo(model="bench", cores=1)),
    engines={"vllm": None, "llamacpp": None},
)


class HeldTimer:
    """Times a sample of written frames: each stamp in one against the clock as it is handed on."""

    def __init__(self) -> None:
        self.samples: list[tuple[int, int]] = []
        self._count = 0

    def timed(self, write: Write) -> Write:
        async def write_timed(frame: str) -> None:
            await write(frame)
            self._count += 1
            if self._count % HELD_SAMPLE == 0:
                now = time.monotonic_ns()
                self.samples.extend((int(t), now - int(t)) for t in _STAMP_IN_FRAME.findall(frame))

        return write_timed

    def install(self) -> None:
        """Every connection's `Outgoing` writes through `timed` (the link builds its own)."""
        timer = self

        class TimedOutgoing(Outgoing):
            def __init__(self, write: Write, *, closed: bool = False) -> None:
                super().__init__(timer.timed(write), closed=closed)

        link_module.Outgoing = TimedOutgoing  # type: ignore[misc]


async def serve(url: str, engine_url: str, api_key: str, socket_path: str | None) -> None:
    http = engine_http_client()
    target = EngineTarget("e0", engine_url, api_key, "fake-model", socket_path)
    link: Link | None = None
    relay: Relay | None = None

    async def on_message(message: Any) -> None:
        assert link is not None and relay is not None
        if isinstance(message, protocol.Request):
            relay.handle(message, link.sender())
        elif isinstance(message, protocol.Cancel):
            relay.cancel(message.id)

    def on_disconnect() -> None:
        if relay is not None:
            relay.cancel_all("coordinator gone")

    link = Link(url, lambda: TOKEN, lambda: HELLO, on_message,
                backoff=Backoff(base_s=0.05, cap_s=0.2), on_disconnect=on_disconnect)
    relay = Relay(link, lambda: [target], lambda: None, http=http)
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    running = asyncio.create_task(link.run())
    gc.freeze()  # as `Node` does once it is up
    await stopping.wait()
    await link.close()
    await running
    await http.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--engine-socket", default=None, help="the engine's Unix socket (then --engine gives the Host)")
    parser.add_argument("--api-key", default="bench-engine-key")
    parser.add_argument("--cpus", default="", help="comma-separated CPUs to pin this process to")
    parser.add_argument("--profile", default="", help="write cProfile stats here on exit")
    parser.add_argument("--held", default="", help="write sampled [stamp_ns, held_ns] pairs here on exit")
    args = parser.parse_args()
    if args.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    held = HeldTimer() if args.held else None
    if held is not None:
        held.install()
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    asyncio.run(serve(args.url, args.engine, args.api_key, args.engine_socket))
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    if held is not None:
        Path(args.held).write_text(json.dumps(held.samples))


if __name__ == "__main__":
    main()
