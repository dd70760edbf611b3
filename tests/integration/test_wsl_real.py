"""Real engines inside the fake WSL2 (tests/support/fake_wsl), started the way a Windows PC starts
them: `wsl.exe -e python3 -c LAUNCHER run …`, the key crossing through WSLENV only, reached from
the host over TCP through WSL's localhost forwarding, and nothing left inside after a stop, after
the app's `wsl.exe` is killed, or after a reap of what a killed app left."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.engines import LlamaServer, free_port
from tests.support.fake_wsl import TOOLS, FakeDistro, FakeWsl, install_fake_wsl
from worker.contract.events import EngineSnapshot
from worker.plan.planner import EnginePlan
from worker.serve.process import StopTiming
from worker.serve.restart_policy import RestartBackoff, SupervisorTiming
from worker.serve.supervisor import EngineSupervisor
from worker.serve.wsl_engine import WslEngine
from worker.system import children
from worker.system.config import Paths

pytestmark = pytest.mark.integration

DISTRO = "Ubuntu"
MODEL_INSIDE = "/home/lender/.cache/gpu-provider/models/tiny-llama.gguf"
PLANTED = "/home/lender/pwned"
ALIAS = f"tiny $(touch {PLANTED})"
JSON_ARGUMENT = '{"enable_thinking": false, "note": "a b {c,d}"}'
TIMING = SupervisorTiming(ready_timeout_s=40, poll_s=0.1, request_timeout_s=3.0, probe_timeout_s=10.0,
                          health_interval_s=0.5, output_settle_s=1.0,
                          stop=StopTiming(grace_s=3.0, gone_s=3.0, poll_s=0.05))


@pytest.fixture
def fake(tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeWsl]:
    """A default Ubuntu whose user has the tiny model in the app's model folder; the test's and the
    app's folders are not there inside. `wsl.exe` is first on PATH."""
    installed = install_fake_wsl(tmp_path / "bin", [FakeDistro(DISTRO, default=True, root=tmp_path / "distro")],
                                 hide=[tmp_path, tiny_gguf.parent, TOOLS])
    model = installed.linux_path_on_host(DISTRO, MODEL_INSIDE)
    model.parent.mkdir(parents=True)
    shutil.copyfile(tiny_gguf, model)
    monkeypatch.setenv("PATH", f"{installed.bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("WSLENV", raising=False)
    yield installed
    installed.kill_all()


def wsl_plan(server: LlamaServer) -> EnginePlan:
    return EnginePlan(engine_id="e0", engine="llamacpp", gpu_indices=(), layout="single", memory_mib=1024,
                      tier=None, args=("--ctx-size", "1024", "--threads", "1", "--chat-template-kwargs", JSON_ARGUMENT),
                      fallbacks=(), port=free_port(), env={"LD_LIBRARY_PATH": str(server.bin_dir)},
                      executable=(str(server.executable),), model=MODEL_INSIDE, served_name=ALIAS, in_wsl=True,
                      wsl_distro=DISTRO)


def supervisor(server: LlamaServer, tmp_path: Path, plan: EnginePlan | None = None) -> EngineSupervisor:
    return EngineSupervisor(plan or wsl_plan(server), paths=Paths.under(tmp_path / "app").ensure(), timing=TIMING,
                            backoff=RestartBackoff(initial_s=0.05, maximum_s=0.1))


def pid_record(fake: FakeWsl) -> dict[str, int]:
    path = fake.home(DISTRO) / ".local/state/gpu-provider/engine-e0.pid"
    record: dict[str, int] = json.loads(path.read_text())
    return record


def every_cmdline() -> list[bytes]:
    lines = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                lines.append(Path(entry.path, "cmdline").read_bytes())
            except OSError:
                continue
    return lines


def argv_of(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def all_gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def ready(sup: EngineSupervisor) -> EngineSnapshot:
    await sup.start()
    snap = await sup.wait_for_state("ready", "failed", timeout=60)
    assert snap.state == "ready", f"{snap.last_error}\n{Path(snap.log_path or '').read_text()[-3000:]}"
    return snap


async def test_llama_server_inside_wsl2_served_over_tcp_with_its_key_then_stopped(
        fake: FakeWsl, llama_server_bin: LlamaServer, tmp_path: Path) -> None:
    sup = supervisor(llama_server_bin, tmp_path)
    try:
        snap = await ready(sup)
        target = sup.target()
        assert target is not None and target.socket_path is None
        assert target.base_url == f"http://127.0.0.1:{sup.plan.port}"
        async with httpx.AsyncClient(timeout=20, trust_env=False) as client:
            reply = await client.post(f"{target.base_url}/v1/chat/completions",
                                      headers={"Authorization": f"Bearer {target.api_key}"},
                                      json={"model": ALIAS, "max_tokens": 8,
                                            "messages": [{"role": "user", "content": "hello"}]})
            refused = await client.get(f"{target.base_url}/props")
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0
        assert refused.status_code == 401
        assert not any(target.api_key.encode() in line for line in every_cmdline())
        engine = pid_record(fake)["engine"]
        argv = argv_of(engine)
        assert argv[0] == str(llama_server_bin.executable)
        assert argv[argv.index("--alias") + 1] == ALIAS
        assert argv[argv.index("--chat-template-kwargs") + 1] == JSON_ARGUMENT
        assert "--api-key" not in argv and argv[argv.index("--host") + 1] == "127.0.0.1"
        inside = fake.processes(DISTRO)
        assert engine in inside and snap.pid not in inside  # the app's child is wsl.exe, on the host
    finally:
        await sup.stop()
    assert fake.processes(DISTRO) == []
    assert not alive(snap.pid)
    assert not fake.linux_path_on_host(DISTRO, PLANTED).exists()
    assert not (fake.home(DISTRO) / ".local/state/gpu-provider/engine-e0.pid").exists()


async def test_killing_the_apps_wsl_exe_ends_the_engine_inside(
        fake: FakeWsl, llama_server_bin: LlamaServer, tmp_path: Path) -> None:
    """What the app's guard does when the app dies: SIGKILL to wsl.exe. The Linux side would live
    on (microsoft/WSL#2496); the launcher sees its output lose its reader and ends the engine."""
    sup = supervisor(llama_server_bin, tmp_path)
    try:
        snap = await ready(sup)
        record = pid_record(fake)
        inside = fake.processes(DISTRO)
        os.kill(snap.pid, signal.SIGKILL)
        assert all_gone([*inside, record["launcher"]], 10), [argv_of(p) for p in inside if alive(p)]
    finally:
        await sup.stop()
    assert fake.processes(DISTRO) == []


async def test_an_engine_a_killed_app_left_inside_is_reaped_before_the_next_start(
        fake: FakeWsl, llama_server_bin: LlamaServer, tmp_path: Path) -> None:
    """wsl.exe and the launcher both killed: only the pid file inside still names the engine; the
    next supervisor's start ends it (never by the host pid file, which names only wsl.exe)."""
    plan = wsl_plan(llama_server_bin)
    linux_argv = plan.argv()
    env = {**os.environ, "LD_LIBRARY_PATH": str(llama_server_bin.bin_dir), "WSLENV": "LD_LIBRARY_PATH/u"}
    orphan = children.popen(WslEngine(DISTRO, "e0").start_argv(linux_argv, 3.0), env=env,
                            stdout=open(os.devnull, "wb"), stderr=open(os.devnull, "wb"))
    try:
        deadline = time.monotonic() + 20
        while not (fake.home(DISTRO) / ".local/state/gpu-provider/engine-e0.pid").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        record = pid_record(fake)
        os.kill(record["launcher"], signal.SIGKILL)
        orphan.kill()
        orphan.wait(5)
        time.sleep(1.0)
        assert alive(record["engine"])  # nothing on the host side stops it now
        sup = supervisor(llama_server_bin, tmp_path, plan)
        try:
            await ready(sup)
            assert not alive(record["engine"])
            assert pid_record(fake)["engine"] != record["engine"]
        finally:
            await sup.stop()
    finally:
        if orphan.poll() is None:
            orphan.kill()
    assert fake.processes(DISTRO) == []
