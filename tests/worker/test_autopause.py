from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from worker.autopause import (
    Action,
    AutoPauser,
    Observation,
    PolicyState,
    decide,
    foreign_processes,
    in_serve_hours,
)
from worker.config import Settings
from worker.events import EngineSnapshot, NodeSnapshot

SETTINGS = Settings(auto_resume_after_s=60)


@dataclass(frozen=True)
class Proc:
    pid: int
    gpu_index: int
    used_mib: int | None = 900


def obs(now: float, *, game: bool = False, paused: bool = False, reason: str | None = None, hour: float = 12.0):
    return Observation(now, hour, foreign_gpu_use=game, fullscreen=False, paused=paused, pause_reason=reason)


@pytest.mark.parametrize(
    ("hours", "hour", "inside"),
    [
        (None, 3, True),
        ((8, 22), 8, True),
        ((8, 22), 21.9, True),
        ((8, 22), 22, False),
        ((8, 22), 7.5, False),
        ((22, 6), 23, True),
        ((22, 6), 5.9, True),
        ((22, 6), 12, False),
        ((0, 24), 23.5, True),
        ((9, 9), 1, True),
    ],
)
def test_serve_hours_window(hours, hour, inside):
    assert in_serve_hours(hours, hour) is inside


def test_foreign_processes_skip_our_engines_and_gpus_not_lent():
    procs = [Proc(100, 0), Proc(200, 0), Proc(300, 1)]
    assert [p.pid for p in foreign_processes(procs, lent_gpus=(0,), own_pids=[100])] == [200]
    assert [p.pid for p in foreign_processes(procs, lent_gpus=None, own_pids=[])] == [100, 200, 300]


def test_game_pauses_then_resumes_only_after_the_delay():
    state, action = decide(SETTINGS, PolicyState(), obs(0, game=True))
    assert action == Action("pause", "game")
    state, action = decide(SETTINGS, state, obs(2, game=True, paused=True, reason="game"))
    assert action is None
    state, action = decide(SETTINGS, state, obs(10, paused=True, reason="game"))  # game closed at t=10
    assert action is None
    state, action = decide(SETTINGS, state, obs(61, paused=True, reason="game"))
    assert action is None  # 59 s after the game was last seen at t=2
    state, action = decide(SETTINGS, state, obs(63, paused=True, reason="game"))
    assert action == Action("resume")


def test_manual_pause_is_never_lifted_or_relabelled():
    state, action = decide(SETTINGS, PolicyState(), obs(0, game=True, paused=True, reason="user"))
    assert action is None
    state, action = decide(SETTINGS, state, obs(500, paused=True, reason="user"))
    assert action is None
    _, action = decide(SETTINGS, state, obs(600, paused=True, reason="timed"))
    assert action is None


def test_user_resume_during_a_game_pause_holds_until_the_game_ends():
    state, _ = decide(SETTINGS, PolicyState(), obs(0, game=True))
    state, action = decide(SETTINGS, state, obs(2, game=True, paused=False))  # the user pressed Resume
    assert action is None and state.game_overridden
    state, action = decide(SETTINGS, state, obs(4, game=False))
    assert action is None and not state.game_overridden  # no re-pause as the game lingers
    _, action = decide(SETTINGS, state, obs(100, game=True))
    assert action == Action("pause", "game")  # a new game is a new episode


def test_auto_pause_off_ignores_games():
    settings = replace(SETTINGS, auto_pause_for_games=False)
    _, action = decide(settings, PolicyState(), obs(0, game=True))
    assert action is None


def test_schedule_pauses_outside_hours_and_resumes_inside():
    settings = replace(SETTINGS, serve_hours=(8, 22))
    state, action = decide(settings, PolicyState(), obs(0, hour=23))
    assert action == Action("pause", "schedule")
    state, action = decide(settings, state, obs(1, hour=23.5, paused=True, reason="schedule"))
    assert action is None
    _, action = decide(settings, state, obs(2, hour=8, paused=True, reason="schedule"))
    assert action == Action("resume")


def test_game_during_schedule_pause_resumes_only_when_both_allow():
    settings = replace(SETTINGS, serve_hours=(8, 22))
    state, action = decide(settings, PolicyState(), obs(0, hour=23, game=True))
    assert action == Action("pause", "game")
    state, action = decide(settings, state, obs(100, hour=23, paused=True, reason="game"))
    assert action == Action("pause", "schedule")  # the game is gone, the night is not
    _, action = decide(settings, state, obs(200, hour=9, paused=True, reason="schedule"))
    assert action == Action("resume")


class FakeNode:
    def __init__(self) -> None:
        engine = EngineSnapshot("engine-0", "vllm", (0,), "single", "ready", pid=4242)
        self.snap = NodeSnapshot(at=0, state="ready", node_id="n", runtime="native", engines=(engine,))
        self.calls: list[tuple] = []

    def snapshot(self) -> NodeSnapshot:
        return self.snap

    def pause(self, duration_s=None, reason="user") -> None:
        self.calls.append(("pause", duration_s, reason))
        self.snap = replace(self.snap, paused=True, pause_reason=reason, state="paused")

    def resume(self) -> None:
        self.calls.append(("resume",))
        self.snap = replace(self.snap, paused=False, pause_reason=None, state="ready")


async def test_poller_pauses_for_a_simulated_foreign_gpu_process_and_resumes():
    node = FakeNode()
    now = [0.0]
    processes = [Proc(4242, 0)]  # only our engine
    pauser = AutoPauser(
        node,
        lambda: SETTINGS,
        lambda: list(processes),
        fullscreen=lambda: False,
        clock=lambda: now[0],
        local_hour=lambda: 12.0,
    )
    assert await pauser.tick() is None
    processes.append(Proc(9001, 0))  # a game opens
    assert await pauser.tick() == Action("pause", "game")
    processes.pop()  # the game closes
    now[0] = 30
    assert await pauser.tick() is None
    now[0] = 61
    assert await pauser.tick() == Action("resume")
    assert node.calls == [("pause", None, "game"), ("resume",)]


async def test_poller_survives_a_failed_reading():
    node = FakeNode()
    sleeps: list[float] = []

    def broken():
        raise OSError("NVML went away")

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise RuntimeError("stop")

    pauser = AutoPauser(node, lambda: SETTINGS, broken, fullscreen=lambda: False, sleep=sleep, interval_s=0.5)
    with pytest.raises(RuntimeError, match="stop"):
        await pauser.run()
    assert sleeps == [0.5, 0.5] and node.calls == []
