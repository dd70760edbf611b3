"""Free loopback ports for engines that listen on TCP (where no Unix socket can be used)."""

from __future__ import annotations

import socket


def free_first_port(start: int, count: int, attempts: int = 500) -> int:
    """The first of `count` consecutive ports from `start` up that nothing listens on: an engine
    given a port another program holds would only crash-loop on "address already in use"."""
    for first in range(start, min(start + attempts * count, 65536 - count), count):
        if all(_port_free(first + i) for i in range(count)):
            return first
    return start


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the engines bind: TIME_WAIT is no obstacle
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
