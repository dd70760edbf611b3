"""The engine releases this app version ships with: the only ones an assignment may ask for.

A coordinator names `engine_version`; a version its engine does not list is refused, so nobody
can steer a node to an old, vulnerable engine. Each engine package lists its own releases
(`<engine>/releases.py`) behind the `Releases` view its adapter gives (`RELEASES`); the planner
and the installer ask that view, never an engine's list by name. The lists change only with the app.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

from worker.engines import registry

_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")


class Releases(Protocol):
    """One engine's shipped releases, as the planner and the installer ask them."""

    def versions(self, runtime: str | None) -> tuple[str, ...]:
        """The releases listed for `runtime` (None: every one), the default (newest) first."""

    def normalise(self, version: str) -> str:
        """An assignment's `engine_version` as `versions` spells it."""

    def runtime_problem(self, version: str, runtime: str) -> str | None:
        """Why listed release `version` may not run on `runtime` (its build is another's), or None."""


@dataclass(frozen=True)
class ListedReleases:
    """Releases that are the same on every runtime the engine serves, spelt as listed (one pip
    version per release, say)."""

    listed: tuple[str, ...]  # newest (the default) first

    def versions(self, runtime: str | None) -> tuple[str, ...]:
        return self.listed

    def normalise(self, version: str) -> str:
        return version

    def runtime_problem(self, version: str, runtime: str) -> str | None:
        return None


def version_problem(
    engine: str, version: str | None, runtime: str | None = None, releases: Releases | None = None
) -> str | None:
    """Why `engine` at `version` may not be used on `runtime`, or None (no version: the app's
    default; or a listed one that serves `runtime`; runtime None: any runtime). `releases`: the
    engine's own list unless given."""
    if version is None:
        return None
    if not _VERSION.fullmatch(version):
        return f"engine version {version!r} is not a version number"
    if engine not in registry.names():
        return registry.refusal(engine)
    adapter = registry.get(engine)
    shipped = adapter.RELEASES if releases is None else releases
    listed, wanted, name = shipped.versions(None), shipped.normalise(version), adapter.DISPLAY_NAME
    if wanted not in listed:
        here = shipped.versions(runtime)
        return (
            f"{name} version {version} is not one this app ships with ({', '.join(listed) or 'none'}); "
            f"update the app, or ask the network for {f'{name} {here[0]}' if here else 'another engine'}"
        )
    return None if runtime is None else shipped.runtime_problem(wanted, runtime)
