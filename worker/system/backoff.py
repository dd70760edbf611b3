"""How long to wait before trying again after failures in a row: a delay that doubles up to a
ceiling. Here, below every stage, because two use it: the supervisor restarting an engine and
provisioning trying again after the network cut it short."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DoublingBackoff:
    """Delay before the n-th try in a row: `initial_s` doubling up to `maximum_s`."""

    initial_s: float = 2.0
    maximum_s: float = 300.0
    factor: float = 2.0

    def delay(self, failures_in_a_row: int) -> float:
        return min(self.maximum_s, self.initial_s * self.factor ** max(0, failures_in_a_row - 1))
