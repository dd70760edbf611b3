"""Downloads like Steam's, against a real local https server that can be slow and impatient:
pause and resume, a hold that outlives the connection, a bandwidth limit, a monthly budget, cancel."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import stat
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path, PurePath
from types import FrameType

import pytest
import trustme

from tests.support.https_server import SERVED_HERE, HttpsServer
from tests.worker.provision.conftest import no_sleep, trusting_ca
from tests.worker.provision.hf_endpoint import serve_repo
from worker.contract import protocol
from worker.contract.events import DownloadProgress
from worker.provision.errors import ProvisionError
from worker.provision.fetch import Downloader
from worker.provision.models import ModelOptions, ensure_model
from worker.provision.problems import fetch as provision_fetch
from worker.provision.progress import ProgressMeter
from worker.provision.transfer import (
    GIB,
    MIB,
    BudgetExceeded,
    DownloadCancelled,
    MonthlyBudget,
    TransferControl,
)
from worker.system.config import Paths, Settings

BODY = os.urandom(24 * MIB)
DIGEST = hashlib.sha256(BODY).hexdigest()
DECEMBER_31 = time.mktime((2026, 12, 31, 12, 0, 0, 0, 0, -1))
JANUARY_2 = time.mktime((2027, 1, 2, 12, 0, 0, 0, 0, -1))
COMMIT = "c" * 40
HF_OPTIONS = ModelOptions(hosts=SERVED_HERE, verify=trusting_ca(), free_bytes=lambda _: 10**12, sleep=no_sleep,
                          margin_bytes=0)


class Calendar:
    """A wall clock the test moves (the budget's months)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Watch:
    """The events of one download, and a hook run once when it has `at_bytes`."""

    def __init__(self, at_bytes: int = -1, then: Callable[[], None] = lambda: None) -> None:
        self.events: list[DownloadProgress] = []
        self._at, self._then = at_bytes, then

    def __call__(self, event: DownloadProgress) -> None:
        self.events.append(event)
        if 0 <= self._at <= event.done_bytes:
            self._at = -1
            self._then()

    @property
    def done(self) -> int:
        return self.events[-1].done_bytes if self.events else 0

    def held(self) -> list[DownloadProgress]:
        return [e for e in self.events if e.held is not None]


def budget_in(tmp_path: Path, limit_gib: float | None, calendar: Calendar | None = None) -> MonthlyBudget:
    return MonthlyBudget(tmp_path / "data" / "download-budget.json", limit_gib,
                         clock=calendar or Calendar(DECEMBER_31))


async def download(server: HttpsServer, tmp_path: Path, control: TransferControl, watch: Watch,
                   *, name: str = "m.gguf", sha256: str = DIGEST, attempts: int = 4) -> Path:
    async with server.client() as client:
        loader = Downloader(client, control=control, attempts=attempts, margin_bytes=0,
                            free_bytes=lambda _: 10**12)
        return await provision_fetch(loader, server.url(name), tmp_path / "cache" / name, what="model m",
                                     on_progress=watch, sha256=sha256)


async def until(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.05)


def gets(server: HttpsServer, name: str = "m.gguf") -> list[str | None]:
    return [r.range for r in server.requests_for(name, "GET")]


async def test_pause_mid_download_then_resume_completes_without_fetching_a_byte_twice(
        ca: trustme.CA, tmp_path: Path) -> None:
    budget = budget_in(tmp_path, None)
    control = TransferControl(budget=budget)
    watch = Watch(2 * MIB, lambda: control.hold("paused_by_you"))
    with HttpsServer(ca=ca, rate_bytes_per_s=16 * MIB) as server:
        server.add("m.gguf", BODY)
        task = asyncio.create_task(download(server, tmp_path, control, watch))
        await until(lambda: bool(watch.held()))
        paused_at = watch.done
        await asyncio.sleep(1.0)

        assert watch.done == paused_at < len(BODY)  # nothing moves while paused
        assert len(watch.held()) == 1  # one event says so: a long pause does not flood the snapshot
        assert watch.held()[-1].held == "paused_by_you" and watch.held()[-1].rate_bps is None
        control.release("paused_by_you")
        path = await asyncio.wait_for(task, 30)

    assert hashlib.sha256(path.read_bytes()).hexdigest() == DIGEST
    assert budget.used_bytes() == len(BODY)  # every byte counted once: none was fetched twice
    assert gets(server) == [None]  # the same connection went on where it stopped
    assert watch.events[-1].finished and watch.events[-1].held is None


async def test_a_hold_survives_the_server_closing_the_idle_connection(ca: trustme.CA, tmp_path: Path) -> None:
    budget = budget_in(tmp_path, None)
    control = TransferControl(budget=budget)
    watch = Watch(MIB, lambda: control.hold("game", "Cyberpunk2077.exe"))
    with HttpsServer(ca=ca, rate_bytes_per_s=32 * MIB, idle_close_s=0.5) as server:
        server.add("m.gguf", BODY)
        task = asyncio.create_task(download(server, tmp_path, control, watch, attempts=1))
        await until(lambda: server.idle_closes >= 1)
        assert watch.held()[-1].held_detail == "Cyberpunk2077.exe"
        control.release("game")
        path = await asyncio.wait_for(task, 30)  # one attempt allowed: the cut while held is not a failure

    assert hashlib.sha256(path.read_bytes()).hexdigest() == DIGEST
    ranges = gets(server)
    assert len(ranges) == 2 and ranges[0] is None
    resumed_from = int((ranges[1] or "").removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_from < len(BODY)
    assert budget.used_bytes() == len(BODY)  # the resume asked for exactly the bytes not yet received


async def test_a_limit_of_2_mib_s_is_kept_within_ten_percent(ca: trustme.CA, tmp_path: Path) -> None:
    control = TransferControl(limit_mib_s=2)
    watch = Watch()
    body = BODY[: 6 * MIB]
    with HttpsServer(ca=ca) as server:
        server.add("six.gguf", body)
        began = time.monotonic()
        await download(server, tmp_path, control, watch, name="six.gguf", sha256=hashlib.sha256(body).hexdigest())
        took = time.monotonic() - began

    assert 6 / 2.2 <= took <= 6 / 1.8 + 0.3  # the connection's own setup on top
    shown = [e.rate_bps for e in watch.events if e.rate_bps and e.done_bytes >= 2 * MIB]
    assert shown and all(1.8 * MIB <= rate <= 2.2 * MIB for rate in shown)  # the speed shown: the last seconds


async def test_a_download_that_would_pass_the_monthly_budget_waits_for_next_month(
        ca: trustme.CA, tmp_path: Path) -> None:
    calendar = Calendar(DECEMBER_31)
    budget = budget_in(tmp_path, 30 * MIB / GIB, calendar)
    budget.add(10 * MIB)  # this month's downloads so far: 24 MiB more would pass 30
    control = TransferControl(budget=budget)
    watch = Watch()
    with HttpsServer(ca=ca) as server:
        server.add("m.gguf", BODY)
        task = asyncio.create_task(download(server, tmp_path, control, watch))
        await until(lambda: bool(watch.held()))
        await asyncio.sleep(0.5)

        assert (watch.held()[-1].held, watch.held()[-1].held_detail) == ("budget", "until 1 January")
        assert control.held() == ("budget", "until 1 January")
        assert not (tmp_path / "cache" / "m.gguf.part").exists()  # checked before the first byte
        assert budget.used_bytes() == 10 * MIB
        calendar.now = JANUARY_2
        path = await asyncio.wait_for(task, 30)

    assert path.read_bytes() == BODY
    assert control.held() is None
    assert budget.used_bytes() == len(BODY)  # January's count
    again = budget_in(tmp_path, 30 * MIB / GIB, calendar)  # after a restart
    assert again.used_bytes() == len(BODY)
    assert stat.S_IMODE(budget.path.stat().st_mode) == 0o600


async def test_a_download_larger_than_the_whole_budget_is_refused_before_it_starts(
        ca: trustme.CA, tmp_path: Path) -> None:
    control = TransferControl(budget=budget_in(tmp_path, 16 * MIB / GIB))
    watch = Watch()
    with HttpsServer(ca=ca) as server:
        server.add("m.gguf", BODY)
        with pytest.raises(ProvisionError) as refused:
            await download(server, tmp_path, control, watch)

    assert refused.value.problem.action == "settings"
    assert "monthly download limit" in refused.value.problem.message
    assert watch.events[-1].error and not (tmp_path / "cache" / "m.gguf.part").exists()


async def test_quit_while_paused_then_a_restart_resumes_from_the_part_counting_every_byte_once(
        ca: trustme.CA, tmp_path: Path) -> None:
    budget = budget_in(tmp_path, None)
    control = TransferControl(budget=budget)
    watch = Watch(3 * MIB, lambda: control.hold("paused_by_you"))
    with HttpsServer(ca=ca, rate_bytes_per_s=16 * MIB) as server:
        server.add("m.gguf", BODY)
        task = asyncio.create_task(download(server, tmp_path, control, watch))
        await until(lambda: bool(watch.held()))
        task.cancel()  # the app quits
        with pytest.raises(asyncio.CancelledError):
            await task
        kept = (tmp_path / "cache" / "m.gguf.part").stat().st_size
        budget.flush()

        again = budget_in(tmp_path, None)  # the app starts again
        path = await download(server, tmp_path, TransferControl(budget=again), Watch())
        again.flush()

    assert path.read_bytes() == BODY
    assert gets(server) == [None, f"bytes={kept}-"] and kept >= 3 * MIB
    assert again.used_bytes() == len(BODY)  # what arrived before the quit, and the rest: each byte once


@pytest.mark.parametrize("while_held", [False, True])
async def test_cancel_removes_the_part_and_is_no_failure(ca: trustme.CA, tmp_path: Path, while_held: bool) -> None:
    control = TransferControl()
    watch = Watch(MIB, (lambda: control.hold("paused_by_you")) if while_held else control.cancel)
    with HttpsServer(ca=ca, rate_bytes_per_s=16 * MIB) as server:
        server.add("m.gguf", BODY)
        task = asyncio.create_task(download(server, tmp_path, control, watch))
        if while_held:
            await until(lambda: bool(watch.held()))
            control.cancel()
        with pytest.raises(DownloadCancelled):
            await asyncio.wait_for(task, 30)

        assert not (tmp_path / "cache" / "m.gguf.part").exists()
        assert not (tmp_path / "cache" / "m.gguf").exists()
        last = watch.events[-1]
        assert last.finished and last.step == "cancelled" and last.error is None

        control.release("paused_by_you")
        small = BODY[:MIB]  # the cancel was for that download only
        server.add("next.gguf", small)
        path = await download(server, tmp_path, control, Watch(), name="next.gguf",
                              sha256=hashlib.sha256(small).hexdigest())
    assert path.read_bytes() == small


def test_the_budget_counts_per_calendar_month_in_a_private_file(tmp_path: Path) -> None:
    calendar = Calendar(DECEMBER_31)
    budget = budget_in(tmp_path, 1.0, calendar)
    budget.add(300 * MIB)
    budget.add(200 * MIB)
    budget.flush()

    assert budget.used_bytes() == 500 * MIB
    assert budget.fits(524 * MIB) and not budget.fits(525 * MIB)
    assert json.loads(budget.path.read_text()) == {"month": "2026-12", "bytes": 500 * MIB}
    assert budget.until_words() == "until 1 January"
    assert budget.resets_at() == time.mktime((2027, 1, 1, 0, 0, 0, 0, 0, -1))

    calendar.now = JANUARY_2
    assert budget.used_bytes() == 0 and budget.until_words() == "until 1 February"
    assert budget_in(tmp_path, 1.0, calendar).used_bytes() == 0  # last month's file counts nothing now


@pytest.mark.parametrize("content", ['{"month": "2026-12", "bytes": -5}', "[1, 2]", "not json",
                                     '{"month": "2026-12", "bytes": true}'])
def test_a_budget_file_that_is_not_ours_counts_from_zero(tmp_path: Path, content: str) -> None:
    path = tmp_path / "data" / "download-budget.json"
    path.parent.mkdir()
    path.write_text(content)
    path.chmod(0o600)

    assert budget_in(tmp_path, 1.0).used_bytes() == 0


def test_bytes_count_as_they_arrive_and_a_used_up_budget_holds_until_the_month_turns(tmp_path: Path) -> None:
    calendar = Calendar(DECEMBER_31)
    budget = budget_in(tmp_path, 2 * MIB / GIB, calendar)
    control = TransferControl(budget=budget)
    with pytest.raises(BudgetExceeded):
        control.wait_until_free(3 * MIB)  # announced larger than the whole budget: it could never start

    control.take(MIB)
    stop = threading.Event()
    taker = threading.Thread(target=lambda: control.take(2 * MIB, stop=stop))  # a download without a size
    taker.start()
    deadline = time.monotonic() + 5
    while control.held() is None and time.monotonic() < deadline:
        time.sleep(0.01)

    assert budget.used_bytes() == 3 * MIB  # counted on arrival, over the budget by what came unannounced
    assert control.held() == ("budget", "until 1 January")
    calendar.now = JANUARY_2
    taker.join(5)
    assert not taker.is_alive() and control.held() is None


def test_a_budget_hold_ends_with_the_download_it_held(tmp_path: Path) -> None:
    budget = budget_in(tmp_path, 1.0)
    budget.add(GIB)
    control = TransferControl(budget=budget)
    with control.transfer():
        assert not control.free_for(MIB)
        assert control.held() == ("budget", "until 1 January")

    assert control.held() is None  # cancelled or failed: nothing waits for the budget any more


def test_a_new_budget_goes_on_from_the_old_ones_count(tmp_path: Path) -> None:
    old = budget_in(tmp_path, 1.0)
    control = TransferControl(budget=old)
    control.take(MIB)
    control.take(MIB)  # within a second of the first: not saved yet

    new = budget_in(tmp_path, 2.0)  # the person raised the limit
    control.set_budget(new)
    assert new.used_bytes() == 2 * MIB

    control.take(MIB)
    with control.transfer():
        pass  # a download's end saves the count
    assert budget_in(tmp_path, 2.0).used_bytes() == 3 * MIB


def test_holds_report_the_first_reason_and_release_one_at_a_time() -> None:
    control = TransferControl()
    control.hold("setup")
    control.hold("game", "Elden Ring")
    control.hold("paused_by_you")

    assert control.held() == ("paused_by_you", None)
    control.release("paused_by_you")
    assert control.held() == ("game", "Elden Ring")
    control.release("game")
    control.release("setup")
    assert control.held() is None and control.free_for(10**12)


def test_speed_is_an_average_over_the_last_seconds_and_a_wait_does_not_drag_it_down() -> None:
    clock, events = Calendar(100.0), list[DownloadProgress]()
    control = TransferControl()
    meter = ProgressMeter("model m", events.append, clock=clock, control=control)
    meter.start(0, 1000 * MIB)
    done = 0
    for _ in range(100):  # 10 s at 10 MiB/s, then 10 s at 1 MiB/s
        clock.now += 0.1
        done += MIB
        meter.update(done)
    for _ in range(100):
        clock.now += 0.1
        done += MIB // 10
        meter.update(done)
    assert events[-1].rate_bps is not None and abs(events[-1].rate_bps - MIB) < 0.05 * MIB

    control.hold("paused")
    clock.now += 60
    meter.update(done)
    assert (events[-1].held, events[-1].rate_bps, events[-1].eta_s) == ("paused", None, None)
    control.release("paused")
    for _ in range(20):
        clock.now += 0.1
        done += MIB // 10
        meter.update(done)
    assert events[-1].held is None
    assert events[-1].rate_bps is not None and abs(events[-1].rate_bps - MIB) < 0.05 * MIB
    assert events[-1].kind == "model"


def hf_model(server: HttpsServer, files: dict[str, bytes]) -> protocol.EngineModel:
    serve_repo(server, "org/tiny", files, commit=COMMIT)
    return protocol.EngineModel(source="org/tiny", revision="main", weights_mib=len(BODY) // MIB)


def repo_folder(tmp_path: Path) -> Path:
    return Paths.under(tmp_path / "app").models_dir / "hf" / "models--org--tiny"


async def hf_download(server: HttpsServer, tmp_path: Path, control: TransferControl, watch: Watch,
                      model: protocol.EngineModel) -> PurePath:
    return await ensure_model(model, "vllm", Paths.under(tmp_path / "app"), Settings(), watch,
                              hf_endpoint=server.base_url, options=HF_OPTIONS, control=control)


async def test_a_hugging_face_download_waits_out_a_hold_and_counts_every_byte(
        ca: trustme.CA, tmp_path: Path) -> None:
    budget = budget_in(tmp_path, None)
    control = TransferControl(budget=budget)
    control.hold("game", "Elden Ring")
    watch = Watch()
    files = {"config.json": b'{"model_type": "tiny"}', "model.safetensors": BODY[: 4 * MIB]}
    with HttpsServer(ca=ca) as server:
        model = hf_model(server, files)
        task = asyncio.create_task(hf_download(server, tmp_path, control, watch, model))
        await until(lambda: bool(watch.held()))
        await asyncio.sleep(0.5)

        assert server.requests == []  # held: not even the file list was asked for
        assert (watch.held()[-1].held, watch.held()[-1].held_detail) == ("game", "Elden Ring")
        control.release("game")
        folder = Path(await asyncio.wait_for(task, 30))

    assert (folder / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert budget.used_bytes() >= sum(len(b) for b in files.values())  # the file list and metadata too
    assert watch.events[-1].finished


async def test_a_hugging_face_repo_over_the_budget_waits_and_a_cancel_leaves_nothing(
        ca: trustme.CA, tmp_path: Path) -> None:
    budget = budget_in(tmp_path, 30 * MIB / GIB)
    budget.add(28 * MIB)
    control = TransferControl(budget=budget)
    watch = Watch()
    with HttpsServer(ca=ca) as server:
        model = hf_model(server, {"model.safetensors": BODY[: 4 * MIB]})
        task = asyncio.create_task(hf_download(server, tmp_path, control, watch, model))
        await until(lambda: bool(watch.held()) and watch.held()[-1].held == "budget")

        assert watch.held()[-1].held_detail == "until 1 January"
        assert not server.requests_for(f"org/tiny/resolve/{COMMIT}/model.safetensors", "GET")
        control.cancel()
        with pytest.raises(DownloadCancelled):
            await asyncio.wait_for(task, 30)

    assert watch.events[-1].step == "cancelled" and watch.events[-1].error is None
    assert not repo_folder(tmp_path).exists()


async def test_a_hugging_face_download_cancelled_mid_way_removes_what_it_began(
        ca: trustme.CA, tmp_path: Path) -> None:
    control = TransferControl()
    watch = Watch()
    with HttpsServer(ca=ca, rate_bytes_per_s=4 * MIB) as server:
        model = hf_model(server, {"model.safetensors": BODY[: 16 * MIB]})
        task = asyncio.create_task(hf_download(server, tmp_path, control, watch, model))
        await until(lambda: server.sent_bytes >= 2 * MIB)
        control.cancel()
        with pytest.raises(DownloadCancelled):
            await asyncio.wait_for(task, 30)

    assert watch.events[-1].step == "cancelled"
    assert not repo_folder(tmp_path).exists()  # a repo this download began goes entirely


async def test_an_assigned_model_download_obeys_the_node_control(ca: trustme.CA, tmp_path: Path) -> None:
    budget = budget_in(tmp_path, None)
    control = TransferControl(budget=budget)
    control.hold("setup")
    watch = Watch()
    gguf = b"GGUF" + BODY[: 2 * MIB]
    digest = hashlib.sha256(gguf).hexdigest()
    with HttpsServer(ca=ca) as server:
        server.add("q4.gguf", gguf)
        model = protocol.EngineModel(source=server.url("q4.gguf"), sha256=digest, weights_mib=3)
        task = asyncio.create_task(ensure_model(model, "llamacpp", Paths.under(tmp_path / "app"), Settings(), watch,
                                                options=HF_OPTIONS, control=control))
        await until(lambda: bool(watch.held()))
        await asyncio.sleep(0.3)

        assert server.connections == 0  # nothing connects before setup is finished
        assert (watch.held()[-1].held, watch.held()[-1].kind) == ("setup", "model")
        control.release("setup")
        path = Path(await asyncio.wait_for(task, 30))

    assert path.read_bytes() == gguf and budget.used_bytes() == len(gguf)


async def test_a_hugging_face_download_held_mid_way_lets_its_thread_go_when_the_node_stops(
        ca: trustme.CA, tmp_path: Path) -> None:
    control = TransferControl()
    watch = Watch()
    with HttpsServer(ca=ca, rate_bytes_per_s=8 * MIB) as server:
        model = hf_model(server, {"model.safetensors": BODY[: 16 * MIB]})
        task = asyncio.create_task(hf_download(server, tmp_path, control, watch, model))
        await until(lambda: server.sent_bytes >= 2 * MIB)
        control.hold("paused_by_you")
        await until(lambda: control.waits > 0)  # huggingface_hub's thread waits inside a read
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        try:  # no thread still waits in the control: one would keep the app from quitting
            await until(lambda: not waiting_in_control(), timeout_s=5)
        finally:
            control.release("paused_by_you")  # (so that a failure here does not hang the tests)


def waiting_in_control() -> bool:
    """Whether some thread is blocked in `TransferControl.take` right now."""
    for frame in sys._current_frames().values():
        current: FrameType | None = frame
        while current is not None:
            if current.f_code is TransferControl.take.__code__:
                return True
            current = current.f_back
    return False
