"""Free loopback ports for engines on TCP."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest

from worker.system import ports
from worker.system.ports import free_first_port


def test_free_first_port_skips_ports_another_program_holds() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        assert free_first_port(taken, 1) != taken
        first = free_first_port(taken - 1, 2)
        assert taken not in (first, first + 1)
    assert free_first_port(taken, 1) == taken  # free again once it is closed


def test_a_port_another_socket_holds_with_reuseaddr_reads_busy() -> None:
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # bound, sharing allowed, not listening
        holder.bind(("127.0.0.1", 0))
        taken = holder.getsockname()[1]
        assert free_first_port(taken, 1) != taken


class RecordingSocket:
    """`socket.socket` as winsock would be driven: what options were set before the bind."""

    made: list[RecordingSocket] = []

    def __init__(self, *args: Any) -> None:
        self.calls: list[tuple[Any, ...]] = []
        RecordingSocket.made.append(self)

    def setsockopt(self, *args: Any) -> None:
        self.calls.append(("setsockopt", *args))

    def bind(self, address: tuple[str, int]) -> None:
        self.calls.append(("bind", address))

    def __enter__(self) -> RecordingSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.calls.append(("close",))


def test_on_windows_the_probe_binds_exclusively_and_never_with_reuseaddr(monkeypatch: pytest.MonkeyPatch) -> None:
    RecordingSocket.made.clear()
    assert not hasattr(socket, "SO_EXCLUSIVEADDRUSE")  # Linux's socket module lacks it: winsock's value is used
    with monkeypatch.context() as windows:  # undone before pytest reports: its own paths need the real os.name
        windows.setattr(os, "name", "nt")
        windows.setattr(socket, "socket", RecordingSocket)
        first = ports.free_first_port(41000, 2)
    assert first == 41000
    for probe, port in zip(RecordingSocket.made, (41000, 41001), strict=True):
        assert probe.calls == [("setsockopt", socket.SOL_SOCKET, -5, 1), ("bind", ("127.0.0.1", port)), ("close",)]
