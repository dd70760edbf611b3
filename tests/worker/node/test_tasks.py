"""The node's background tasks on its loop: kept while they run (asyncio itself keeps only a weak
reference), a failure logged and never lost, all cancelled together at the end; and actions handed
to that loop from other threads (the app's window, auto-pause)."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading

import pytest

from worker.node.tasks import LoopTasks


async def test_a_task_nothing_else_holds_is_kept_until_cancel_all_cancels_it() -> None:
    tasks = LoopTasks()
    seen: list[str] = []

    async def waits_forever() -> None:
        try:
            await asyncio.get_running_loop().create_future()  # nothing else refers to this future
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        except GeneratorExit:
            seen.append("collected")  # destroyed while pending: the work would be lost silently
            raise

    tasks.spawn(waits_forever())  # the returned task is dropped, as the node drops most
    await asyncio.sleep(0)
    gc.collect()
    await tasks.cancel_all()
    assert seen == ["cancelled"]


async def test_cancel_all_waits_for_each_task_to_finish_its_cleanup() -> None:
    tasks = LoopTasks()
    cleaned: list[int] = []

    async def stops_slowly(n: int) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.05)  # closing a connection, stopping a process
            cleaned.append(n)

    spawned = [tasks.spawn(stops_slowly(n)) for n in range(3)]
    await asyncio.sleep(0)
    await tasks.cancel_all()
    assert sorted(cleaned) == [0, 1, 2] and all(t.cancelled() for t in spawned)


async def test_a_failure_is_logged_with_its_exception_and_a_cancel_is_not(caplog: pytest.LogCaptureFixture) -> None:
    tasks = LoopTasks()

    async def breaks() -> None:
        raise ValueError("the sampler broke")

    caplog.set_level(logging.ERROR, logger="worker.node.tasks")
    failed = tasks.spawn(breaks())
    cancelled = tasks.spawn(asyncio.sleep(3600))
    await asyncio.sleep(0)
    cancelled.cancel()
    await asyncio.gather(failed, cancelled, return_exceptions=True)
    [record] = caplog.records
    assert record.getMessage() == "internal task failed"
    assert record.exc_info is not None and str(record.exc_info[1]) == "the sampler broke"
    await tasks.cancel_all()  # the finished ones are gone: nothing left to wait for
    assert len(caplog.records) == 1


async def test_an_action_runs_at_once_on_the_loop_and_soon_from_another_thread() -> None:
    tasks = LoopTasks()
    ran: list[tuple[str, int]] = []
    tasks.call(lambda: ran.append(("before bind", threading.get_ident())))
    assert ran == []  # no loop yet: nowhere to run it
    tasks.bind()
    loop_thread = threading.get_ident()

    tasks.call(lambda: ran.append(("on the loop", threading.get_ident())))
    assert ran == [("on the loop", loop_thread)]  # at once, not on a later turn

    done = asyncio.Event()

    def from_the_window() -> None:
        tasks.call(lambda: (ran.append(("from a thread", threading.get_ident())), done.set()))

    thread = threading.Thread(target=from_the_window)
    thread.start()
    await asyncio.wait_for(done.wait(), 5)
    thread.join()
    assert ran[-1] == ("from a thread", loop_thread)  # run on the loop's thread, not the caller's


def test_an_action_after_the_loop_closed_is_dropped_quietly() -> None:
    tasks = LoopTasks()
    loop = asyncio.new_event_loop()
    loop.run_until_complete(_bind(tasks))
    loop.close()
    ran: list[str] = []
    tasks.call(lambda: ran.append("late"))  # the window clicked while the node shut down
    assert ran == []


async def _bind(tasks: LoopTasks) -> None:
    tasks.bind()
