"""The one exception provisioning raises, carrying what a person should read and do."""

from __future__ import annotations

from worker.contract.events import Problem


class ProvisionError(Exception):
    """Getting a model or an engine onto the machine failed in a way a person can act on.

    The node turns this into a `failed` state whose `problem` is shown as is, so the message
    says what happened and `problem.action` what to do about it.
    """

    def __init__(self, problem: Problem) -> None:
        super().__init__(f"{problem.title}: {problem.message}")
        self.problem = problem


def human_bytes(n_bytes: float) -> str:
    """Bytes as a short figure for messages ("1.5 GiB", "300 MiB", "12 KiB")."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n_bytes) >= size:
            return f"{n_bytes / size:.1f} GiB" if unit == "GiB" else f"{n_bytes / size:.0f} {unit}"
    return f"{n_bytes:.0f} bytes"
