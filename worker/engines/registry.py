"""The one list of engines this app runs: each is an adapter (`base.EngineAdapter`) registered here.

Importing `worker.engines` registers the built-in adapters (vLLM, then llama.cpp); nothing else in
the core names an engine. Registration order is preference order: where two engines serve the
same runtime, the first one the assignment has a block for is chosen (`worker.plan.planner`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.engines.base import EngineAdapter

_ADAPTERS: dict[str, EngineAdapter] = {}


def register(adapter: EngineAdapter) -> None:
    """Add an engine; a second adapter under a name already taken is a bug, so it raises."""
    if adapter.NAME in _ADAPTERS:
        raise ValueError(f"engine {adapter.NAME!r} is registered already")
    _ADAPTERS[adapter.NAME] = adapter


def unregister(name: str) -> None:
    """Remove an engine (a test's own adapter, after the test)."""
    _ADAPTERS.pop(name, None)


def get(name: str) -> EngineAdapter:
    """The adapter registered as `name`; ValueError names the known engines otherwise."""
    try:
        return _ADAPTERS[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known engines: {', '.join(_ADAPTERS)}") from None


def names() -> tuple[str, ...]:
    return tuple(_ADAPTERS)


def adapters() -> tuple[EngineAdapter, ...]:
    return tuple(_ADAPTERS.values())


def for_runtime(runtime: str) -> tuple[EngineAdapter, ...]:
    """The engines that serve machines of this runtime, in preference order: registration order,
    except that one serving it only as a fallback (its `FALLBACK_RUNTIMES`: vLLM's CPU build on
    `cpu`) comes after the others."""
    serving = [adapter for adapter in _ADAPTERS.values() if runtime in adapter.RUNTIMES]
    return tuple(sorted(serving, key=lambda adapter: runtime in adapter.FALLBACK_RUNTIMES))


def display_name(name: str) -> str:
    """What a person reads for an engine: its adapter's name for people, or `name` itself for one
    this app does not have (an old status file, a newer node's snapshot)."""
    adapter = _ADAPTERS.get(name)
    return adapter.DISPLAY_NAME if adapter is not None else name


def refusal(name: str) -> str:
    """The reason an engine name that is not registered is refused, naming those that are."""
    return f"engine {name!r} is not one this app runs ({', '.join(_ADAPTERS)})"
