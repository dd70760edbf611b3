"""Pause for games and outside serve hours; resume only what was paused here.

The policy (`decide`) is a pure function of the settings, what the previous tick remembered and
what this tick observed, so every rule is tested without a GPU or a clock. `AutoPauser` is the
thin poller the node runs on its loop: it reads the GPU process list in a thread (NVML blocks),
asks the policy, and calls `pause` / `resume` on the node.

Rules a person can rely on:
- a foreign process on a lent GPU (or a full-screen app, where the platform says so) pauses
  with reason ``game``; serving resumes once it has been gone for ``auto_resume_after_s``;
- outside ``serve_hours`` the node pauses with reason ``schedule``;
- a pause the user (or the coordinator) made is never lifted here, and when the user resumes
  during an automatic pause, that episode is left alone until its cause goes away.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Literal, Protocol

from worker.config import Settings
from worker.events import NodeSnapshot

log = logging.getLogger(__name__)

AutoReason = Literal["game", "schedule"]
AUTO_REASONS: frozenset[str] = frozenset(("game", "schedule"))


class GpuProcessLike(Protocol):
    """What `worker.hardware.gpu_processes` returns per process (only these fields are read)."""

    pid: int
    gpu_index: int
    used_mib: int | None


@dataclass(frozen=True)
class Observation:
    """One tick's facts: time, what runs on the GPUs, and the node's pause as it stands."""

    now: float
    local_hour: float  # 0 <= h < 24, local time, minutes as a fraction
    foreign_gpu_use: bool
    fullscreen: bool
    paused: bool
    pause_reason: str | None


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between ticks."""

    last_game_at: float | None = None  # last tick a game (foreign GPU use or full screen) was seen
    holding: AutoReason | None = None  # the pause this policy asked for, if any
    game_overridden: bool = False  # the user resumed during a game pause: wait for the game to end
    schedule_overridden: bool = False  # the user resumed outside serve hours: wait for the window


@dataclass(frozen=True)
class Action:
    kind: Literal["pause", "resume"]
    reason: AutoReason | None = None


def in_serve_hours(serve_hours: tuple[int, int] | None, local_hour: float) -> bool:
    """True inside the window; a window such as (22, 6) wraps past midnight; None = always."""
    if serve_hours is None:
        return True
    start, end = serve_hours
    if start == end:
        return True
    if start < end:
        return start <= local_hour < end
    return local_hour >= start or local_hour < end


def foreign_processes(
    processes: Iterable[GpuProcessLike], *, lent_gpus: Iterable[int] | None, own_pids: Iterable[int]
) -> list[GpuProcessLike]:
    """Processes on a lent GPU that are not our engines (None = every GPU is lent)."""
    lent = None if lent_gpus is None else set(lent_gpus)
    ours = set(own_pids)
    return [p for p in processes if p.pid not in ours and (lent is None or p.gpu_index in lent)]


def decide(settings: Settings, state: PolicyState, obs: Observation) -> tuple[PolicyState, Action | None]:
    """The next policy state and the command to send, if any."""
    game_now = settings.auto_pause_for_games and (obs.foreign_gpu_use or obs.fullscreen)
    last_game_at = obs.now if game_now else state.last_game_at
    game_lingers = last_game_at is not None and obs.now - last_game_at < settings.auto_resume_after_s
    out_of_hours = not in_serve_hours(settings.serve_hours, obs.local_hour)
    state = replace(state, last_game_at=last_game_at if (game_now or game_lingers) else None)

    if obs.paused and obs.pause_reason not in AUTO_REASONS:
        return replace(state, holding=None), None
    if state.holding is not None and not obs.paused:
        state = replace(
            state,
            holding=None,
            game_overridden=state.game_overridden or state.holding == "game",
            schedule_overridden=state.schedule_overridden or state.holding == "schedule",
        )
    state = replace(
        state,
        game_overridden=state.game_overridden and game_now,
        schedule_overridden=state.schedule_overridden and out_of_hours,
    )

    holding_for_game = obs.paused and obs.pause_reason == "game"
    wanted: AutoReason | None = None
    if (game_now or (game_lingers and holding_for_game)) and not state.game_overridden:
        wanted = "game"
    elif out_of_hours and not state.schedule_overridden:
        wanted = "schedule"

    if wanted is None:
        if obs.paused:
            return replace(state, holding=None), Action("resume")
        return state, None
    if obs.paused and obs.pause_reason == wanted:
        return replace(state, holding=wanted), None
    return replace(state, holding=wanted), Action("pause", wanted)


def windows_fullscreen() -> bool:
    """True when Windows reports a full-screen D3D app, presentation mode or a busy full screen.

    Windows is the only platform that says this: macOS has no public "another app is full
    screen" query for background apps, and on Linux it depends on the window manager (and is
    meaningless on a headless box), so there the GPU process list is the only signal.
    """
    import ctypes

    state = ctypes.c_int(0)
    shell32 = ctypes.windll.shell32  # type: ignore[attr-defined]
    if shell32.SHQueryUserNotificationState(ctypes.byref(state)) != 0:
        return False
    busy, d3d_full_screen, presentation = 2, 3, 4
    return state.value in (busy, d3d_full_screen, presentation)


def default_fullscreen_probe() -> Callable[[], bool]:
    """The platform's full-screen check; a constant False where the platform cannot tell us."""
    return windows_fullscreen if sys.platform == "win32" else (lambda: False)


def local_hour_now() -> float:
    now = datetime.now()
    return now.hour + now.minute / 60


class PausableNode(Protocol):
    def snapshot(self) -> NodeSnapshot: ...

    def pause(self, duration_s: float | None = None, reason: str = "user") -> None: ...

    def resume(self) -> None: ...


class AutoPauser:
    """Polls the GPU process list (and full-screen state) and applies `decide` to the node."""

    def __init__(
        self,
        node: PausableNode,
        settings: Callable[[], Settings],
        list_processes: Callable[[], Iterable[GpuProcessLike]],
        *,
        fullscreen: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.time,
        local_hour: Callable[[], float] = local_hour_now,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        interval_s: float = 2.0,
    ) -> None:
        self._node = node
        self._settings = settings
        self._list_processes = list_processes
        self._fullscreen = fullscreen or default_fullscreen_probe()
        self._clock = clock
        self._local_hour = local_hour
        self._sleep = sleep
        self._interval_s = interval_s
        self.state = PolicyState()

    async def run(self) -> None:
        """Tick until cancelled; one failed reading is logged and the next tick tries again."""
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("auto-pause could not read the GPU process list; trying again")
            await self._sleep(self._interval_s)

    async def tick(self) -> Action | None:
        settings = self._settings()
        snapshot = self._node.snapshot()
        foreign = await asyncio.to_thread(self._foreign_now, settings, snapshot)
        fullscreen = settings.auto_pause_for_games and await asyncio.to_thread(self._fullscreen)
        obs = Observation(
            now=self._clock(),
            local_hour=self._local_hour(),
            foreign_gpu_use=bool(foreign),
            fullscreen=fullscreen,
            paused=snapshot.paused,
            pause_reason=snapshot.pause_reason,
        )
        self.state, action = decide(settings, self.state, obs)
        if action is not None:
            self._apply(action, foreign)
        return action

    def _foreign_now(self, settings: Settings, snapshot: NodeSnapshot) -> list[GpuProcessLike]:
        if not settings.auto_pause_for_games:
            return []
        own_pids = [e.pid for e in snapshot.engines if e.pid is not None]
        return foreign_processes(self._list_processes(), lent_gpus=settings.gpus_to_lend, own_pids=own_pids)

    def _apply(self, action: Action, foreign: list[GpuProcessLike]) -> None:
        if action.kind == "pause":
            pids = ", ".join(str(p.pid) for p in foreign) or "none"
            log.info("auto-pause: pausing (%s; foreign GPU pids: %s)", action.reason, pids)
            self._node.pause(None, action.reason or "game")
        else:
            log.info("auto-pause: resuming serving")
            self._node.resume()
