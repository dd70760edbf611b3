"""The whole node where Windows makes life hard, with real parts (the reference coordinator and
the vLLM stand-in as the engine): a state file another program keeps open never keeps an engine
on the card during a pause, and the computer is kept awake exactly while the node serves."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
from pathlib import Path

import pytest

from tests.integration.test_node import eventually, model_folder, running_node, vllm, vllm_assign
from worker.contract import protocol
from worker.contract.events import NodeSnapshot
from worker.node.node import Node
from worker.system.config import load_state

pytestmark = pytest.mark.integration


async def test_a_pause_frees_the_card_even_when_its_state_cannot_be_saved(
        tmp_path: Path, vllm_standin: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    async with running_node(tmp_path, vllm(vllm_standin), assign=vllm_assign(model_folder(tmp_path))) as run:
        await run.status("ready")
        assert run.live_engine_pids()

        def held_open(source: str, target: str) -> None:  # every file the node replaces is held (Windows)
            raise PermissionError(errno.EACCES, "Access is denied", target)

        with monkeypatch.context() as held, caplog.at_level(logging.ERROR, logger="worker.node.node"):
            held.setattr(os, "replace", held_open)
            mark = run.mark()
            run.node.pause()
            await run.status("paused", after=mark)
            await eventually(lambda: not run.node.snapshot().engines and not run.live_engine_pids())
            await eventually(lambda: any("could not save the node's state" in r.getMessage()
                                         for r in caplog.records))
        assert not load_state(run.node.paths).paused  # not remembered: the card came first
        assert run.node.snapshot().paused


class Power:
    """The platform's power assertion (SetThreadExecutionState, IOKit, logind) as the node drives it."""

    def __init__(self) -> None:
        self.events: list[str] = []

    @property
    def held(self) -> bool:
        return bool(self.events) and self.events[-1] == "acquire"

    def acquire(self) -> None:
        self.events.append("acquire")

    def release(self) -> None:
        self.events.append("release")


async def test_the_computer_is_kept_awake_exactly_while_an_engine_serves(tmp_path: Path, vllm_standin: Path) -> None:
    power = Power()
    wrong: list[NodeSnapshot] = []

    def check(node: Node) -> None:
        def held_as_shown(snap: NodeSnapshot) -> None:
            serving = any(e.state in ("ready", "degraded") for e in snap.engines)
            wanted = node.settings.keep_awake_while_serving and serving and not snap.paused and not snap.stopping
            if power.held != wanted:
                wrong.append(snap)

        node.subscribe(held_as_shown)

    async with running_node(tmp_path, vllm(vllm_standin), assign=vllm_assign(model_folder(tmp_path)),
                            configure=check, power=power) as run:
        await run.status("ready")
        assert power.events == ["acquire"]
        mark = run.mark()
        run.node.pause()
        await run.status("paused", after=mark)
        assert power.events == ["acquire", "release"]  # at the pause, before the engine has even stopped
        mark = run.mark()
        run.node.resume()
        await run.status("ready", after=mark)
        assert power.events == ["acquire", "release", "acquire"]
        run.node.save_settings(dataclasses.replace(run.node.settings, keep_awake_while_serving=False))
        await eventually(lambda: not power.held)
        run.node.save_settings(dataclasses.replace(run.node.settings, keep_awake_while_serving=True))
        await eventually(lambda: power.held)
        mark = run.mark()
        await run.coordinator.send(protocol.Unassign(assignment_id="a-1"))
        await run.status("idle", after=mark)
        assert not power.held
        mark = run.mark()
        await run.coordinator.send(vllm_assign(model_folder(tmp_path), "a-2"))
        await run.status("ready", after=mark)
        assert power.held
    assert power.events == ["acquire", "release", "acquire", "release", "acquire", "release", "acquire", "release"]
    assert wrong == []


async def test_the_snapshot_says_what_the_game_pause_can_see(tmp_path: Path, vllm_standin: Path) -> None:
    """The settings show it beside "Pause for games": a Linux machine without NVML cannot see a
    game, and says so."""
    from worker.node import autopause

    async with running_node(tmp_path, vllm(vllm_standin), assign=vllm_assign(model_folder(tmp_path))) as run:
        await run.status("ready")
        assert run.node._gpus.nvml is None  # no NVIDIA card: a game is seen only by its full screen, or not at all
        assert run.node.snapshot().game_detection == autopause.GAMES_NOT_SEEN
