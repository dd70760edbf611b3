"""Auto-pause end to end on a display-attached RTX 4090: real pynvml adapter, real process names.

The GPU is `tests/support/fake_pynvml` (the `pynvml` module as a driver answers it); the
processes on it are real, started under the names a desktop shows (Xorg, gnome-shell, chrome,
Cyberpunk2077.exe), so `psutil` names them as it would on a gaming PC.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import replace

import pytest

from tests.support.fake_pynvml import FakeCard, FakeNvml, FakeProcess
from worker.node.autopause import Action, AutoPauser, process_name
from worker.system.config import Settings
from worker.contract.events import EngineSnapshot, NodeSnapshot
from worker.hardware import PynvmlSource, gpu_processes

GAME = "Cyberpunk2077.exe"
ENGINE_PID = 4242  # our engine: never a game, whatever it holds
SETTINGS = Settings(auto_resume_after_s=60)


class Node:
    """What the AutoPauser sees of the node: its snapshot, pause and resume."""

    def __init__(self) -> None:
        engine = EngineSnapshot("engine-0", "llamacpp", (0,), "single", "ready", pid=ENGINE_PID)
        self.snap = NodeSnapshot(at=0, state="ready", node_id="n", runtime="native", engines=(engine,))
        self.calls: list[tuple[object, ...]] = []

    def snapshot(self) -> NodeSnapshot:
        return self.snap

    def pause(self, duration_s: float | None = None, reason: str = "user", detail: str | None = None) -> None:
        self.calls.append(("pause", reason, detail))
        self.snap = replace(self.snap, paused=True, pause_reason=reason, state="paused")

    def resume(self) -> None:
        self.calls.append(("resume",))
        self.snap = replace(self.snap, paused=False, pause_reason=None, state="ready")


def desktop(spawn: Callable[..., subprocess.Popen[bytes]]) -> FakeCard:
    """A 4090 driving the screen: Xorg and gnome-shell hold ~900 MiB, a browser plays 4K video."""
    return FakeCard(
        processes=[
            FakeProcess(ENGINE_PID, used_mib=18_000, graphics=False, compute=True, sm_pct=97),
            FakeProcess(spawn("Xorg").pid, used_mib=618, sm_pct=3),
            FakeProcess(spawn("gnome-shell").pid, used_mib=287, sm_pct=2),
            FakeProcess(spawn("chrome").pid, used_mib=1150, sm_pct=12),
        ]
    )


def pauser(node: Node, settings: Settings, now: list[float]) -> AutoPauser:
    return AutoPauser(
        node,
        lambda: settings,
        lambda: gpu_processes(PynvmlSource()),
        fullscreen=lambda: (),  # no full-screen app: names of none
        clock=lambda: now[0],
        local_hour=lambda: 12.0,
    )


@pytest.mark.parametrize("wddm", [False, True], ids=["linux", "windows-wddm"])
async def test_the_desktop_never_pauses_a_game_does_by_name_and_serving_resumes_after_it(monkeypatch, spawn, wddm):
    card = desktop(spawn)
    FakeNvml([card], wddm=wddm).install(monkeypatch)
    node, now = Node(), [0.0]
    auto = pauser(node, SETTINGS, now)

    assert await auto.tick() is None
    now[0] = 2
    assert await auto.tick() is None and node.calls == []

    game = spawn(GAME)
    card.processes.append(FakeProcess(game.pid, used_mib=4096, sm_pct=90))
    now[0] = 4
    assert await auto.tick() == Action("pause", "game", GAME)
    now[0] = 6
    assert await auto.tick() is None  # still playing

    card.processes.pop()
    game.kill()
    game.wait()
    now[0] = 65
    assert await auto.tick() is None  # 59 s since the game was last seen
    now[0] = 66.5
    assert await auto.tick() == Action("resume")
    assert node.calls == [("pause", "game", GAME), ("resume",)]


async def test_a_game_the_user_ignores_does_not_pause(monkeypatch, spawn):
    card = desktop(spawn)
    card.processes.append(FakeProcess(spawn(GAME).pid, used_mib=4096, sm_pct=90))
    FakeNvml([card]).install(monkeypatch)
    node, now = Node(), [0.0]
    settings = Settings(auto_resume_after_s=60, autopause_ignored=("cyberpunk2077.exe",))

    assert await pauser(node, settings, now).tick() is None
    assert await pauser(node, SETTINGS, now).tick() == Action("pause", "game", GAME)  # not ignored: pauses


def test_names_come_whole_past_linux_15_characters_wine_included(spawn):
    native = spawn(GAME)
    under_proton = spawn("BaldursGate3.exe", argv0="Z:\\games\\Baldurs Gate 3\\bin\\BaldursGate3.exe")
    assert process_name(native.pid) == GAME
    assert process_name(under_proton.pid) == "BaldursGate3.exe"  # the kernel kept "BaldursGate3.ex"
    assert process_name(spawn("Xorg").pid) == "Xorg"
    native.kill()
    native.wait()
    assert process_name(native.pid) is None
