"""Free loopback ports for engines on TCP."""

from __future__ import annotations

import socket

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
