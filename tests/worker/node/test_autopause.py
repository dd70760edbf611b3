from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from worker.node.autopause import (
    FULLSCREEN_APP,
    Action,
    AutoPauser,
    Observation,
    PolicyState,
    SeenProcess,
    decide,
    find_game,
    foreign_processes,
    in_serve_hours,
)
from worker.system.config import Settings
from worker.contract.events import EngineSnapshot, NodeSnapshot

SETTINGS = Settings(auto_resume_after_s=60)
GAME = "Cyberpunk2077.exe"


@dataclass(frozen=True)
class Proc:
    pid: int
    gpu_index: int
    used_mib: int | None = 900
    sm_pct: int | None = 0


def obs(now: float, *, game: str | None = None, paused: bool = False, reason: str | None = None, hour: float = 12.0):
    return Observation(now, hour, game=game, paused=paused, pause_reason=reason)


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


@pytest.mark.parametrize(
    ("name", "used_mib", "sm_pct", "ignored", "is_game"),
    [
        (GAME, 4096, 90, (), True),
        ("Xorg", 900, 5, (), False),  # the desktop at rest
        ("Xorg", 3000, 60, (), False),  # the desktop list is never a game, however busy
        ("gnome-shell", 1200, 30, (), False),
        ("DWM.EXE", 2048, 40, (), False),  # Windows names match whatever their case
        ("chrome", 1500, 40, (), False),  # a browser's GPU process
        ("steamwebhelper", 1100, 26, (), False),
        ("Discord", 180, 3, (), False),  # a desktop app below both thresholds
        ("blender", 1024, 0, (), True),  # memory alone is enough
        ("blender", 1023, 24, (), False),  # just under both
        ("hashcat", 300, 25, (), True),  # utilisation alone is enough
        ("ollama", 5000, None, (), True),  # a card that cannot sample: memory decides
        (GAME, None, 90, (), True),  # Windows (WDDM): no memory, utilisation decides
        ("Spotify.exe", None, 2, (), False),
        (GAME, None, None, (), False),  # neither figure: being listed is no evidence
        (None, 4096, 90, (), True),  # a process the OS will not name is judged by its numbers
        (GAME, 4096, 90, ("cyberpunk2077.EXE",), False),  # the user said it is not a game
        (GAME, 4096, 90, ("witcher3.exe",), True),
    ],
)
def test_what_counts_as_a_game(name, used_mib, sm_pct, ignored, is_game):
    process = SeenProcess(4711, 0, name, used_mib, sm_pct)
    found = find_game(Settings(autopause_ignored=ignored), [process])
    assert found == (process if is_game else None)


def test_the_busiest_game_is_the_one_named():
    launcher = SeenProcess(10, 0, "EpicGamesLauncher.exe", 900, 60)
    small = SeenProcess(11, 0, "Balatro.exe", 1100, 30)
    big = SeenProcess(12, 0, GAME, 6000, 85)
    assert find_game(SETTINGS, [launcher, small, big]) == big
    assert find_game(SETTINGS, [launcher]) is None
    assert SeenProcess(13, 1, None, 2048, None).label == "process 13"


def test_game_pauses_naming_it_then_resumes_only_after_the_delay():
    state, action = decide(SETTINGS, PolicyState(), obs(0, game=GAME))
    assert action == Action("pause", "game", GAME)
    state, action = decide(SETTINGS, state, obs(2, game=GAME, paused=True, reason="game"))
    assert action is None
    state, action = decide(SETTINGS, state, obs(10, paused=True, reason="game"))  # game closed at t=10
    assert action is None
    state, action = decide(SETTINGS, state, obs(61, paused=True, reason="game"))
    assert action is None  # 59 s after the game was last seen at t=2
    state, action = decide(SETTINGS, state, obs(63, paused=True, reason="game"))
    assert action == Action("resume")


def test_a_full_screen_app_pauses_under_its_own_name():
    _, action = decide(SETTINGS, PolicyState(), obs(0, game=FULLSCREEN_APP))
    assert action == Action("pause", "game", "a full-screen app")


def test_manual_pause_is_never_lifted_or_relabelled():
    state, action = decide(SETTINGS, PolicyState(), obs(0, game=GAME, paused=True, reason="user"))
    assert action is None
    state, action = decide(SETTINGS, state, obs(500, paused=True, reason="user"))
    assert action is None
    _, action = decide(SETTINGS, state, obs(600, paused=True, reason="timed"))
    assert action is None


def test_user_resume_during_a_game_pause_holds_until_the_game_ends():
    state, _ = decide(SETTINGS, PolicyState(), obs(0, game=GAME))
    state, action = decide(SETTINGS, state, obs(2, game=GAME, paused=False))  # the user pressed Resume
    assert action is None and state.game_overridden
    state, action = decide(SETTINGS, state, obs(4))
    assert action is None and not state.game_overridden  # no re-pause as the game lingers
    _, action = decide(SETTINGS, state, obs(100, game="Balatro.exe"))
    assert action == Action("pause", "game", "Balatro.exe")  # a new game is a new episode


def test_auto_pause_off_ignores_games():
    settings = replace(SETTINGS, auto_pause_for_games=False)
    _, action = decide(settings, PolicyState(), obs(0, game=GAME))
    assert action is None


def test_schedule_pauses_outside_hours_and_resumes_inside():
    settings = replace(SETTINGS, serve_hours=(8, 22))
    state, action = decide(settings, PolicyState(), obs(0, hour=23))
    assert action == Action("pause", "schedule")  # no name: the hour is the reason
    state, action = decide(settings, state, obs(1, hour=23.5, paused=True, reason="schedule"))
    assert action is None
    _, action = decide(settings, state, obs(2, hour=8, paused=True, reason="schedule"))
    assert action == Action("resume")


def test_game_during_schedule_pause_resumes_only_when_both_allow():
    settings = replace(SETTINGS, serve_hours=(8, 22))
    state, action = decide(settings, PolicyState(), obs(0, hour=23, game=GAME))
    assert action == Action("pause", "game", GAME)
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

    def pause(self, duration_s=None, reason="user", detail=None) -> None:
        self.calls.append(("pause", duration_s, reason, detail))
        self.snap = replace(self.snap, paused=True, pause_reason=reason, state="paused")

    def resume(self) -> None:
        self.calls.append(("resume",))
        self.snap = replace(self.snap, paused=False, pause_reason=None, state="ready")


NAMES = {4242: "vllm", 1712: "Xorg", 2290: "gnome-shell", 3105: "chrome", 9001: GAME, 9002: "Discord"}


def poller(node, processes, *, now, settings=SETTINGS, fullscreen=lambda: []):
    return AutoPauser(
        node,
        lambda: settings,
        lambda: list(processes),
        fullscreen=fullscreen,
        name_of=NAMES.get,
        clock=lambda: now[0],
        local_hour=lambda: 12.0,
    )


async def test_poller_pauses_for_a_game_by_name_not_for_the_desktop_and_resumes():
    node = FakeNode()
    now = [0.0]
    processes = [
        Proc(4242, 0, used_mib=20_000, sm_pct=100),  # our engine
        Proc(1712, 0, used_mib=620, sm_pct=3),
        Proc(2290, 0, used_mib=280, sm_pct=2),
        Proc(3105, 0, used_mib=180, sm_pct=1),
        Proc(9002, 0, used_mib=150, sm_pct=4),
    ]
    pauser = poller(node, processes, now=now)
    assert await pauser.tick() is None
    processes.append(Proc(9001, 0, used_mib=4096, sm_pct=90))  # a game opens
    assert await pauser.tick() == Action("pause", "game", GAME)
    processes.pop()  # the game closes
    now[0] = 30
    assert await pauser.tick() is None
    now[0] = 61
    assert await pauser.tick() == Action("resume")
    assert node.calls == [("pause", None, "game", GAME), ("resume",)]


async def test_poller_ignores_games_on_gpus_not_lent_and_names_a_full_screen_app():
    node = FakeNode()
    settings = replace(SETTINGS, gpus_to_lend=(0,))
    pauser = poller(node, [Proc(9001, 1, used_mib=4096, sm_pct=90)], now=[0.0], settings=settings)
    assert await pauser.tick() is None
    full = poller(FakeNode(), [], now=[0.0], fullscreen=lambda: [FULLSCREEN_APP])
    assert await full.tick() == Action("pause", "game", FULLSCREEN_APP)


async def test_poller_survives_a_failed_reading():
    node = FakeNode()
    sleeps: list[float] = []

    def broken():
        raise OSError("NVML went away")

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise RuntimeError("stop")

    pauser = AutoPauser(node, lambda: SETTINGS, broken, fullscreen=lambda: [], sleep=sleep, interval_s=0.5)
    with pytest.raises(RuntimeError, match="stop"):
        await pauser.run()
    assert sleeps == [0.5, 0.5] and node.calls == []
