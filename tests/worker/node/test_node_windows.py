"""The whole node where Windows makes life hard, with real parts (the reference coordinator and
the vLLM stand-in as the engine): a state file another program keeps open never keeps an engine
on the card during a pause, and the computer is kept awake exactly while the node serves."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from tests.integration.test_node import eventually, model_folder, running_node, vllm, vllm_assign
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
