"""Free loopback ports for engines that listen on TCP (where no Unix socket can be used).

A port reads free only if a bind that shares with nobody succeeds: no SO_REUSEADDR (on Windows it
lets a bind "succeed" on a port another socket holds, so every port looked free), and on Windows
SO_EXCLUSIVEADDRUSE, which also fails where another socket holds the port on any address."""

from __future__ import annotations

import os
import socket

# winsock.h: #define SO_EXCLUSIVEADDRUSE ((int)(~SO_REUSEADDR)), SO_REUSEADDR being 4
SO_EXCLUSIVEADDRUSE = getattr(socket, "SO_EXCLUSIVEADDRUSE", -5)


def free_first_port(start: int, count: int, attempts: int = 500) -> int:
    """The first of `count` consecutive ports from `start` up that nothing listens on: an engine
    given a port another program holds would only crash-loop on "address already in use"."""
    for first in range(start, min(start + attempts * count, 65536 - count), count):
        if all(_port_free(first + i) for i in range(count)):
            return first
    return start


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        if os.name == "nt":
            probe.setsockopt(socket.SOL_SOCKET, SO_EXCLUSIVEADDRUSE, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
