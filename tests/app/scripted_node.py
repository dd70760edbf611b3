"""A stand-in with the Node's interface: it emits the snapshots a test gives it and records
every command, so app tests check what reaches the core without running one."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from worker.node.headline import headline
from worker.system.config import Paths, Settings, save_settings
from worker.contract.events import NodeSnapshot


def headed(snapshot: NodeSnapshot) -> NodeSnapshot:
    """The snapshot with its headline filled by the core's own `headline`, as the Node's view does."""
    return replace(snapshot, headline=headline(snapshot, snapshot.at))


class ScriptedNode:
    def __init__(self, first: NodeSnapshot, *, log_files: dict[str, Path] | None = None,
                 paths: Paths | None = None) -> None:
        """`paths`: where `save_settings` writes, through the core's own saver."""
        self._snapshot = headed(first)
        self._paths = paths
        self._subscribers: list[Callable[[NodeSnapshot], None]] = []
        self._stopped = threading.Event()
        self.commands: list[tuple[str, Any]] = []
        self.history_points: dict[str, list[tuple[float, float]]] = {}
        self.history_calls: list[tuple[str, float]] = []
        self._log_files = log_files or {}

    # the Node interface --------------------------------------------------------------

    async def run(self) -> None:
        while not self._stopped.is_set():
            await asyncio.sleep(0.01)
        self.commands.append(("run_ended", None))

    def subscribe(self, callback: Callable[[NodeSnapshot], None]) -> Callable[[], None]:
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback)

    def snapshot(self) -> NodeSnapshot:
        return self._snapshot

    def pause(self, duration_s: float | None = None, reason: str = "user") -> None:
        self.commands.append(("pause", (duration_s, reason)))

    def resume(self) -> None:
        self.commands.append(("resume", None))

    def shutdown(self) -> None:
        self.commands.append(("shutdown", None))
        self._stopped.set()

    def save_settings(self, settings: Settings) -> None:
        assert self._paths is not None, "a test that saves settings gives the node its paths"
        save_settings(self._paths, settings)  # raises OSError as the core's does: nothing recorded then
        self.commands.append(("save_settings", settings))

    def token_changed(self) -> None:
        self.commands.append(("token_changed", None))

    def sign_out(self) -> None:
        self.commands.append(("sign_out", None))

    def retry(self) -> None:
        self.commands.append(("retry", None))

    def install_update_now(self) -> None:
        self.commands.append(("install_update_now", None))

    def history(self, series: str, since: float) -> list[tuple[float, float]]:
        self.history_calls.append((series, since))
        return [point for point in self.history_points.get(series, []) if point[0] >= since]  # as the core's

    def log_files(self) -> dict[str, Path]:
        return dict(self._log_files)

    def pause_download(self) -> None:
        self.commands.append(("pause_download", None))

    def resume_download(self) -> None:
        self.commands.append(("resume_download", None))

    def cancel_download(self) -> None:
        self.commands.append(("cancel_download", None))

    def preview_share(self, gpu_index: int, pct: int) -> Any:
        """The planner's own preview for this snapshot's card and engines, as the Node gives it."""
        from worker.plan.share_preview import preview

        gpu = next(g for g in self._snapshot.gpus if g.index == gpu_index)
        return preview(gpu, pct, self._snapshot.engines)

    # the script ----------------------------------------------------------------------

    def emit(self, snapshot: NodeSnapshot) -> None:
        """Publish from the calling thread, as the core does from its loop thread (the headline
        filled from the snapshot, as the core's view fills it)."""
        self._snapshot = snapshot = headed(snapshot)
        for callback in list(self._subscribers):
            callback(snapshot)

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)
