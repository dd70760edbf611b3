"""The node's side of failures and control, with real parts: the reference coordinator over real
sockets and the vLLM stand-in as the engine. A crash loop a person can follow and Retry; a
download the network cut short tried again by itself; Retry, sign-out, switching networks; the
snapshots while detecting and while stopping; an update waiting for a restart."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.test_node import (
    PRICE,
    STATE_TIMEOUT_S,
    STREAM,
    TOKEN,
    Running,
    eventually,
    model_folder,
    running_node,
    vllm,
    vllm_assign,
)
from worker.provision import fetch as download
from worker.node import node as node_module
from worker.contract import protocol
from worker.system.config import Settings, load_settings
from worker.contract.events import Problem
from worker.link.connection import Backoff
from worker.link.local import ReferenceCoordinator
from worker.node.node import Node
from worker.provision import assignment
from worker.provision.errors import ProvisionError
from worker.serve.restart_policy import RestartBackoff, SupervisorTiming

pytestmark = pytest.mark.integration

QUICK_RESTARTS = SupervisorTiming(max_fast_failures=3, poll_s=0.05, output_settle_s=1.0)


@asynccontextmanager
async def controlled_node(tmp_path: Path, standin: Path, *, assign: protocol.Assign | None = None,
                          offline_backoff: RestartBackoff = RestartBackoff(15.0, 600.0),
                          ) -> AsyncIterator[Running]:
    """A Node on a recorded machine and its coordinator, with quick engine restarts."""

    def quick_restarts(node: Node) -> None:
        node._engines.timing, node._engines.backoff = QUICK_RESTARTS, RestartBackoff(initial_s=0.2, maximum_s=0.2)

    async with running_node(tmp_path, vllm(standin), assign=assign, configure=quick_restarts,
                            offline_backoff=offline_backoff) as running:
        yield running


def flaky_provision(monkeypatch: pytest.MonkeyPatch, failures: list[BaseException]) -> list[float]:
    """Provisioning that fails with each of `failures` in turn (as the real one raises: a
    `ProvisionError` while handling the cause), then provisions for real; the times it was called."""
    real = assignment.provision
    calls: list[float] = []

    async def provision(*args: Any, **kwargs: Any) -> Any:
        calls.append(time.time())
        if len(calls) <= len(failures):
            try:
                raise failures[len(calls) - 1]
            except BaseException:
                raise ProvisionError(Problem(
                    "Cannot reach Hugging Face",
                    "Downloading https://huggingface.co/api/models/x failed ([Errno -3] Temporary failure in name "
                    "resolution). Check the network.", "check_network")) from None
        return await real(*args, **kwargs)

    monkeypatch.setattr(node_module, "provision", provision)
    return calls


def problem_of(run: Running, title: str) -> Callable[[], bool]:
    return lambda: any(s.problem is not None and s.problem.title == title for s in run.snapshots)


# --- 1, 2: a crash loop a person can follow, in their words ----------------------------------


async def test_a_crash_loop_counts_restarts_then_fails_with_one_short_notice_and_retry_starts_afresh(
        tmp_path: Path, vllm_standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_EXIT_AT_START", "3")
    async with controlled_node(tmp_path, vllm_standin, assign=vllm_assign(model_folder(tmp_path))) as run:
        await run.status("failed")
        restarting = [e for s in run.snapshots for e in s.engines if e.state == "starting" and e.retry_at]
        assert sorted({(e.failures_in_a_row, e.restart_limit) for e in restarting}) == [(1, 3), (2, 3)]
        during = [s.problem for s in run.snapshots if s.engines and s.engines[0].retry_at]
        assert during and all(p is not None and p.retry_at is not None and "by itself" in p.message for p in during)
        first_start = [s for s in run.snapshots if s.engines and s.engines[0].restarts == 0]
        assert first_start and all(s.problem is None for s in first_start)  # a plain first start shows none
        failed = run.node.snapshot()
        problem = failed.problem
        assert problem is not None and problem.action == "retry" and problem.retry_at is None
        assert problem.title == "The model stopped unexpectedly" and "\n" not in problem.title
        assert problem.message.endswith("then Retry.") and "Last error" not in problem.message
        assert any("STANDIN_EXIT_AT_START" in line for line in problem.details)
        assert problem.title not in problem.details
        assert problem.title not in failed.notices  # the app's one notification comes from the state
        assert failed.engines[0].failures_in_a_row == 3

        monkeypatch.delenv("STANDIN_EXIT_AT_START")
        mark = run.mark()
        run.node.retry()
        await run.status("ready", after=mark)
        [engine] = run.node.snapshot().engines
        assert (engine.restarts, engine.failures_in_a_row, run.node.snapshot().problem) == (0, 0, None)
        assert (await run.ask(STREAM)).end is not None


# --- 3, 4: downloads the network cut short ------------------------------------------------------


async def test_a_download_the_network_cut_short_is_tried_again_by_itself_saying_when(
        tmp_path: Path, vllm_standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = flaky_provision(monkeypatch, [httpx.ConnectError("offline"), httpx.ConnectError("offline")])
    backoff = RestartBackoff(initial_s=0.4, maximum_s=0.8)
    async with controlled_node(tmp_path, vllm_standin, assign=vllm_assign(model_folder(tmp_path)),
                               offline_backoff=backoff) as run:
        await run.status("ready")
        assert len(calls) == 3
        assert calls[1] - calls[0] >= 0.4 and calls[2] - calls[1] >= 0.8  # 0.4 s, then doubled
        waiting = [s.problem for s in run.snapshots if s.problem is not None]
        assert waiting and all(p.title == "Waiting for the network" for p in waiting)
        assert all(s.state != "failed" for s in run.snapshots if s.problem is not None)  # it tries again
        first = waiting[0]
        assert first.retry_at is not None and abs(first.retry_at - (calls[0] + 0.4)) < 1.0
        assert "tries again by itself" in first.message and first.action == "retry"
        assert "https://" not in first.message and "Errno" not in first.message
        assert any("https://huggingface.co" in line for line in first.details)
        assert run.node.snapshot().problem is None


async def test_a_damaged_download_is_not_tried_again_by_itself_but_retry_does(
        tmp_path: Path, vllm_standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = flaky_provision(monkeypatch, [download.Damaged(actual="ab", expected="cd")])
    async with controlled_node(tmp_path, vllm_standin, assign=vllm_assign(model_folder(tmp_path)),
                               offline_backoff=RestartBackoff(initial_s=0.1, maximum_s=0.1)) as run:
        await run.status("failed")
        await asyncio.sleep(1.0)
        assert len(calls) == 1
        problem = run.node.snapshot().problem
        assert problem is not None and problem.retry_at is None
        mark = run.mark()
        run.node.retry()
        await run.status("ready", after=mark)
        assert len(calls) == 2


async def test_retry_while_waiting_for_the_network_tries_now(
        tmp_path: Path, vllm_standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = flaky_provision(monkeypatch, [httpx.ConnectError("offline")])
    async with controlled_node(tmp_path, vllm_standin, assign=vllm_assign(model_folder(tmp_path))) as run:
        await eventually(problem_of(run, "Waiting for the network"))  # the next try is 15 s away
        mark = run.mark()
        run.node.retry()
        await run.status("ready", after=mark, timeout=10.0)
        assert len(calls) == 2


# --- 5, 8: detecting and stopping ----------------------------------------------------------------


async def test_snapshots_say_detecting_until_detection_ends_and_stopping_while_draining(
        tmp_path: Path, vllm_standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_TOKEN_DELAY_S", "0.3")
    async with controlled_node(tmp_path, vllm_standin, assign=vllm_assign(model_folder(tmp_path))) as run:
        await run.status("ready")
        assert run.snapshots[0].detecting and run.snapshots[0].gpus == ()
        assert not run.snapshots[-1].detecting and run.snapshots[-1].gpus
        assert not any(s.stopping for s in run.snapshots)
        exchange = await run.coordinator.request(STREAM)
        await eventually(lambda: run.node.snapshot().in_flight == 1)
        seen = len(run.snapshots)
        run.node.shutdown()
        await eventually(lambda: len(run.snapshots) > seen)
        assert run.snapshots[seen].stopping and run.snapshots[seen].in_flight == 1  # at once, still draining
        assert (await exchange.collect(timeout=STATE_TIMEOUT_S)).end is not None
        async with asyncio.timeout(STATE_TIMEOUT_S):
            await run.task
        stopping = run.snapshots[seen:]
        assert all(s.stopping for s in stopping) and stopping[-1].in_flight == 0 and stopping[-1].engines == ()


# --- 7, 9: sign-out and switching networks --------------------------------------------------


async def test_sign_out_closes_the_link_until_the_token_changes(tmp_path: Path, vllm_standin: Path) -> None:
    async with controlled_node(tmp_path, vllm_standin) as run:
        await run.coordinator.wait_for_connections(1, timeout=STATE_TIMEOUT_S)
        await eventually(lambda: run.node.snapshot().connection.state == "connected")
        run.node.sign_out()
        await eventually(lambda: not run.coordinator.node_connected)
        await asyncio.sleep(0.3)  # the link's backoff is 0.05 s: it would have reconnected by now
        connection = run.node.snapshot().connection
        assert connection.state == "signed_out" and connection.problem is not None
        assert connection.problem.action == "sign_in" and not run.coordinator.node_connected
        run.node.token_changed()
        await run.coordinator.wait_for_connections(2, timeout=STATE_TIMEOUT_S)
        await eventually(lambda: run.node.snapshot().connection.state == "connected")


async def test_a_new_network_in_settings_switches_the_link_and_ends_the_old_assignment(
        tmp_path: Path, vllm_standin: Path) -> None:
    other = ReferenceCoordinator(token=TOKEN, heartbeat_s=1.0, price=PRICE)
    await other.start()
    try:
        async with controlled_node(tmp_path, vllm_standin, assign=vllm_assign(model_folder(tmp_path))) as run:
            await run.status("ready")
            run.node.save_settings(dataclasses.replace(Settings(), coordinator_url=other.url))
            assert load_settings(run.node.paths).coordinator_url == other.url  # saved by the core, then applied
            hello = await other.wait_for_connections(1, timeout=STATE_TIMEOUT_S)
            assert hello.node_id == run.node.state.node_id
            await eventually(lambda: run.node.snapshot().connection.state == "connected")
            snap = run.node.snapshot()
            assert snap.connection.coordinator_url == other.url and snap.engines == ()
            assert snap.assignment_id is None and not run.coordinator.node_connected
            assert run.live_engine_pids() == []
    finally:
        await other.stop()


async def test_retry_reconnects_an_offline_link_now(tmp_path: Path, vllm_standin: Path) -> None:
    async with controlled_node(tmp_path, vllm_standin) as run:
        await run.coordinator.wait_for_connections(1, timeout=STATE_TIMEOUT_S)
        run.node._uplink._link._backoff = Backoff(base_s=600.0, cap_s=600.0)  # type: ignore[union-attr]
        await run.coordinator.restart()
        await eventually(lambda: run.node.snapshot().connection.state == "offline")
        run.node.retry()
        await run.coordinator.wait_for_connections(2, timeout=10.0)

