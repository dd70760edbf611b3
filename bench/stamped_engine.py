"""`tests/support/fake_engine.py` with each token's event stamped with the engine's send time.

The stamp (`"t"`: `time.monotonic_ns()`, one clock for every process on the machine) is what
lets the load generator measure each chunk's latency from the engine to the caller, directly and
through the relay, without pairing runs. Everything else is the fake engine's own code; only its
event encoder is swapped for one that adds the stamp with a single bytes format per token.

Run: `python -m bench.stamped_engine --port 0 --tokens 256 [--token-delay 0.02] [--socket PATH]`
prints its URL (with `--socket`, as the app runs engines on Linux and macOS: only the Host).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import replace

from tests.support import fake_engine

API_KEY = "bench-engine-key"


class StampedEvents(fake_engine._Events):
    """Token events with `"t": <ns>` before the closing brace; the framing length follows it."""

    def __init__(self, model: str, chat: bool) -> None:
        super().__init__(model, chat)
        self._templates = [piece[: -len(b"}\n\n")] + b',"t":%d}\n\n' for piece in self._pieces]

    def framed_token(self, i: int) -> bytes:
        event = self._templates[i % len(self._templates)] % time.monotonic_ns()
        return b"%x\r\n%b\r\n" % (len(event), event)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--cpus", default="", help="comma-separated CPUs to run on")
    parser.add_argument("--socket", default=None, help="listen on this Unix socket instead of 127.0.0.1")
    args = parser.parse_args()
    if args.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    fake_engine._Events = StampedEvents  # type: ignore[misc]

    async def serve() -> None:
        behaviour = replace(fake_engine.Behaviour(), tokens=args.tokens, token_delay_s=args.token_delay)
        engine = await fake_engine.FakeEngine(api_key=API_KEY, behaviour=behaviour, port=args.port,
                                              socket_path=args.socket).start()
        print(engine.base_url, flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
