"""The node side of the relay benchmark, in its own process: `Link` ⇄ `Relay` ⇄ engine.

It wires the two exactly as `worker.node.Node` does (`relay.handle(request, link.sender())`,
`cancel`, `cancel_all` on disconnect) with one fixed ready engine, and pins itself to the CPUs
given, so that "on one core" is literal. With `--profile FILE` it runs under cProfile and writes
the stats on SIGTERM. The relay reads the engine through its shipped client (`worker.loopback_http`).

Run: `python -m bench.relay_node --url ws://127.0.0.1:PORT/v1/provider --engine http://127.0.0.1:P`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import cProfile
import os
import signal
from typing import Any


from worker import protocol
from worker.link import Backoff, Link
from worker.relay import EngineTarget, Relay, engine_http_client

TOKEN = "bench-token"
HELLO = protocol.Hello(
    node_id="bench-node", app_version="bench",
    platform=protocol.PlatformInfo(os="linux", runtime="cpu", arch="x86_64"),
    hardware=protocol.HardwareInfo(ram_mib=1024, cpu=protocol.CpuInfo(model="bench", cores=1)),
    engines={"vllm": None, "llamacpp": None},
)


async def serve(url: str, engine_url: str, api_key: str) -> None:
    http = engine_http_client()
    target = EngineTarget("e0", engine_url, api_key, "fake-model")
    link: Link | None = None

    async def send(message: Any) -> bool:
        return link is not None and await link.send(message)

    relay = Relay(send, lambda: [target], lambda: None, http=http)

    async def on_message(message: Any) -> None:
        if isinstance(message, protocol.Request):
            assert link is not None
            relay.handle(message, link.sender())
        elif isinstance(message, protocol.Cancel):
            relay.cancel(message.id)

    def on_disconnect() -> None:
        relay.cancel_all("coordinator gone")

    link = Link(url, lambda: TOKEN, lambda: HELLO, on_message,
                backoff=Backoff(base_s=0.05, cap_s=0.2), on_disconnect=on_disconnect)
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
    parser.add_argument("--api-key", default="bench-engine-key")
    parser.add_argument("--cpus", default="", help="comma-separated CPUs to pin this process to")
    parser.add_argument("--profile", default="", help="write cProfile stats here on exit")
    args = parser.parse_args()
    if args.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    asyncio.run(serve(args.url, args.engine, args.api_key))
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)


if __name__ == "__main__":
    main()
