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

