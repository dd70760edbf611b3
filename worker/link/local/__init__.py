"""The reference coordinator and local mode, in three parts (and `local.py`, which joins them):

- `coordinator.py`: the websocket side, a coordinator for one node (tests and local mode);
- `openai_endpoint.py`: the OpenAI-compatible HTTP endpoint on 127.0.0.1 in front of it;
- `sizing.py`: which model local mode assigns, and how large it is.
"""

from worker.link.local.coordinator import (
    DEFAULT_DEADLINE_S,
    PROVIDER_PATH,
    Collected,
    Exchange,
    NoNode,
    ReferenceCoordinator,
)
from worker.link.local.local import DEFAULT_OPENAI_PORT, HasRuntime, LocalCoordinator, LocalEndpointError
from worker.link.local.openai_endpoint import OpenAIEndpoint, host_problem, origin_problem
from worker.link.local.sizing import DEFAULT_LOCAL_MODEL, LocalModelError, local_assignment, local_tune_block

__all__ = [
    "DEFAULT_DEADLINE_S",
    "DEFAULT_LOCAL_MODEL",
    "DEFAULT_OPENAI_PORT",
    "PROVIDER_PATH",
    "Collected",
    "Exchange",
    "HasRuntime",
    "LocalCoordinator",
    "LocalEndpointError",
    "LocalModelError",
    "NoNode",
    "OpenAIEndpoint",
    "ReferenceCoordinator",
    "host_problem",
    "local_assignment",
    "local_tune_block",
    "origin_problem",
]
