"""An engine never outlives the app: killed with it (PDEATHSIG, and its guard for the processes the
engine started), or reaped at the next start — and a stranger that inherited a recorded pid is
never touched."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.support.engines import REPO, VLLM_STANDIN, free_port
from worker.serve import process as procs
from worker.system.config import Paths
from worker.plan.planner import EnginePlan
from worker.serve.restart_policy import SupervisorTiming
from worker.serve.supervisor import EngineSupervisor

pytestmark = pytest.mark.integration

APP = textwrap.dedent("""
    import asyncio, json, sys
    from worker.system.config import Paths
    from worker.plan.planner import EnginePlan
    from worker.serve.restart_policy import SupervisorTiming
    from worker.serve.supervisor import EngineSupervisor

    async def main(root, standin, port):
        plan = EnginePlan(engine_id="e0", engine="vllm", gpu_indices=(0,), layout="single", memory_mib=1,
                          tier=None, args=("--enforce-eager",), fallbacks=(), port=port, env={},
                          executable=(standin,), model="/models/m", served_name="m")
        sup = EngineSupervisor(plan, paths=Paths.under(root).ensure(),
                               timing=SupervisorTiming(poll_s=0.05, ready_timeout_s=30))
        await sup.start()
        snap = await sup.wait_for_state("ready", "failed", timeout=30)
        print(json.dumps({"state": snap.state, "pid": snap.pid}), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
""")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not all(gone(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def engine_group(pid: int) -> list[int]:
    return procs.group_members(pid, os.getpgid(pid))


def test_engine_dies_with_an_app_killed_by_sigkill(tmp_path: Path) -> None:
    app = subprocess.Popen([sys.executable, "-c", APP, str(tmp_path), str(VLLM_STANDIN), str(free_port())],
                           cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        report = json.loads(app.stdout.readline())
        assert report["state"] == "ready"
        engine = engine_group(report["pid"])
        assert report["pid"] in engine and len(engine) == 2  # the API server and its engine core
        assert os.getpgid(report["pid"]) != os.getpgid(app.pid)
        app.send_signal(signal.SIGKILL)
        assert wait_gone(engine), f"engine processes left behind: {[p for p in engine if not gone(p)]}"
    finally:
        app.kill()
        app.wait()


GRANDPARENT = textwrap.dedent("""
    import asyncio, os, sys, threading
    from pathlib import Path
    from worker.serve import process as procs

    # An engine that starts a child of its own in its process group (as vLLM starts EngineCore and
    # a Worker), spawned from a thread other than the main one (the desktop app's core loop is one).
    ENGINE = ("import subprocess, sys, time; "
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
              "print(child.pid, flush=True); time.sleep(300)")

    async def main(log):
        engine = procs.spawn([sys.executable, "-c", ENGINE], env=dict(os.environ), log_path=Path(log))
        while not engine.tail:
            await asyncio.sleep(0.02)
        print(engine.pid, engine.tail[0], flush=True)
        await asyncio.sleep(3600)

    core = threading.Thread(target=asyncio.run, args=(main(sys.argv[1]),))
    core.start()
    core.join()
""")


def test_an_engines_own_children_die_with_an_app_killed_by_sigkill(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG reaches the engine only; its children were re-parented to init and lived on."""
    app = subprocess.Popen([sys.executable, "-c", GRANDPARENT, str(tmp_path / "engine.log")], cwd=REPO,
                           stdout=subprocess.PIPE, text=True)
    try:
        engine, child = map(int, app.stdout.readline().split())
        assert os.getpgid(child) == os.getpgid(engine) != os.getpgid(app.pid)
        app.send_signal(signal.SIGKILL)
        assert wait_gone([engine, child]), f"left behind: {[p for p in (engine, child) if not gone(p)]}"
    finally:
        app.kill()
        app.wait()


def leftover_engine(argv: list[str], paths: Paths) -> subprocess.Popen[bytes]:
    """An engine as a crashed app would leave it: its own session, nobody watching, a pid file."""
    child = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs.write_pid_file(procs.pid_file(paths.run_dir, "e0"), procs.PidRecord.of(child.pid, argv))
    return child


async def test_leftover_engine_is_reaped_when_the_engine_starts_again(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path).ensure()
    plan = EnginePlan(engine_id="e0", engine="vllm", gpu_indices=(0,), layout="single", memory_mib=1, tier=None,
                      args=("--enforce-eager",), fallbacks=(), port=free_port(), env={},
                      executable=(str(VLLM_STANDIN),), model="/models/m", served_name="m")
    old = leftover_engine(plan.argv(), paths)
    sup = EngineSupervisor(plan, paths=paths, timing=SupervisorTiming(poll_s=0.05, ready_timeout_s=20))
    try:
        await sup.start()
        snap = await sup.wait_for_state("ready", "failed", timeout=20)  # same port: only free if reaped
        assert snap.state == "ready" and old.poll() is not None and snap.pid != old.pid
        assert procs.read_pid_file(procs.pid_file(paths.run_dir, "e0")).pid == snap.pid
    finally:
        await sup.stop()
        old.kill()
        old.wait()
    assert procs.read_pid_file(procs.pid_file(paths.run_dir, "e0")) is None


def test_stranger_with_a_recorded_pid_is_left_alone(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path).ensure()
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        engine_argv = [str(VLLM_STANDIN), "serve", "/models/m", "--host", "127.0.0.1", "--port", "1"]
        reused = procs.PidRecord.of(stranger.pid, engine_argv)  # our old engine's pid, now someone else's
        procs.write_pid_file(procs.pid_file(paths.run_dir, "e0"), reused)
        assert procs.reap_leftovers(paths.run_dir) == []
        time.sleep(0.2)
        assert stranger.poll() is None
        assert not procs.pid_file(paths.run_dir, "e0").exists()
    finally:
        stranger.kill()
        stranger.wait()


def test_reaping_kills_a_matching_engine_group_that_ignores_sigterm(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path).ensure()
    argv = [str(VLLM_STANDIN), "serve", "/models/m", "--host", "127.0.0.1", "--port", str(free_port())]
    env = {**os.environ, "STANDIN_IGNORE_SIGTERM": "1"}
    child = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    try:
        while "Starting vLLM server" not in child.stdout.readline().decode():
            pass
        procs.write_pid_file(procs.pid_file(paths.run_dir, "e0"), procs.PidRecord.of(child.pid, argv))
        group = engine_group(child.pid)
        timing = procs.StopTiming(grace_s=0.3, gone_s=5.0, poll_s=0.02)
        assert procs.reap_leftovers(paths.run_dir, timing) == [child.pid]
        assert child.wait(timeout=5) == -signal.SIGKILL
        assert wait_gone(group)
    finally:
        child.kill()
        child.wait()
