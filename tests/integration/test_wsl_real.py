"""Real engines inside the fake WSL2 (tests/support/fake_wsl), started the way a Windows PC starts
them: `wsl.exe -e python3 -c LAUNCHER run …`, the key crossing through WSLENV only, reached from
the host over TCP through WSL's localhost forwarding, and nothing left inside after a stop, after
the app's `wsl.exe` is killed, or after a reap of what a killed app left."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.support.engines import LlamaServer, free_port
from tests.support.fake_wsl import REPO, TOOLS, FakeDistro, FakeWsl, install_fake_wsl
from tests.support.real_vllm import ensure_vllm, tiny_hf_model
from worker.contract import protocol
from worker.contract.events import EngineSnapshot
from worker.engines.installing import MARKER
from worker.link.local import ReferenceCoordinator
from worker.plan.planner import EnginePlan
from worker.serve.process import StopTiming
from worker.serve.restart_policy import RestartBackoff, SupervisorTiming
from worker.serve.supervisor import EngineSupervisor
from worker.serve.wsl_engine import WslEngine
from worker.system import children
from worker.system.config import Paths

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

GPU_PROVIDER = Path(sys.executable).with_name("gpu-provider")

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
    app's folders are not there inside; the checkout is, read-only, as if installed there (the
    stand-in engine runs from it), wherever it lies. `wsl.exe` is first on PATH."""
    installed = install_fake_wsl(tmp_path / "bin", [FakeDistro(DISTRO, default=True, root=tmp_path / "distro")],
                                 hide=[tmp_path, tiny_gguf.parent, TOOLS], keep=[REPO])
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


# --- vLLM's CPU build inside WSL2, through the app --------------------------------------------

VLLM_BUILD = "0.32.0+cpu"
VLLM_FOLDER = f".local/share/gpu-provider/engines/vllm-{VLLM_BUILD}"  # the app's own venv inside
TOKEN = "wsl-vllm-test-token"
START_TIMEOUT_S = 480.0  # vLLM starts in 60-90 s on 2 idle cores; much more while other work shares them
CHAT = {"messages": [{"role": "user", "content": "Count: one two three"}], "max_tokens": 6, "temperature": 0}
BASE_ARGS = ["--max-model-len", "1024", "--gpu-memory-utilization", "0.1", "--enforce-eager"]


def installed_inside(fake: FakeWsl, venv: Path) -> None:
    """The cached vLLM venv, as a finished install of the app's inside the distribution: its folder
    (pyvenv.cfg, the install marker) with the venv's files linked in (the cache is visible inside)."""
    folder = fake.home(DISTRO) / VLLM_FOLDER
    folder.mkdir(parents=True)
    shutil.copyfile(venv / "pyvenv.cfg", folder / "pyvenv.cfg")
    for part in ("bin", "lib", "include", "share"):
        if (venv / part).exists():
            (folder / part).symlink_to(venv / part)
    (folder / MARKER).write_text(VLLM_BUILD)


def windows_cpu_machine(path: Path) -> Path:
    """This machine's `detect`, as a Windows PC without a usable GPU whose WSL2 has vLLM's CPU build."""
    detected = json.loads(subprocess.run([str(GPU_PROVIDER), "detect"], capture_output=True, text=True, timeout=120,
                                         check=True).stdout)
    detected["platform"] = {"os": "windows", "runtime": "cpu", "arch": "x86_64", "wsl_distro": DISTRO}
    detected["hardware"].update(gpus=[], groups=[], effective_vram_mib=0)
    detected["engines"] = {"vllm": VLLM_BUILD}
    path.write_text(json.dumps(detected))
    return path


def engine_status(data_dir: Path) -> dict[str, Any] | None:
    shown = subprocess.run([str(GPU_PROVIDER), "status", "--json", "--data-dir", str(data_dir)], capture_output=True,
                           text=True, timeout=60, check=False)
    engines = json.loads(shown.stdout)["snapshot"]["engines"] if shown.returncode == 0 else []
    return engines[0] if engines else None


def engine_log(engine: dict[str, Any] | None) -> str:
    return Path(engine["log_path"]).read_text()[-4000:] if engine and engine["log_path"] else "(no engine log)"


async def test_vllm_cpu_build_inside_wsl2_through_the_app(fake: FakeWsl, tmp_path: Path) -> None:
    """`gpu-provider run --headless --hardware FILE` of a Windows PC without a GPU: the assignment's
    vLLM-only block is served by the CPU build the app finds in its distribution, the model copied
    onto the distribution's disk, a request relayed, and quitting leaves nothing inside."""
    vllm, model = await asyncio.to_thread(ensure_vllm), await asyncio.to_thread(tiny_hf_model)
    installed_inside(fake, vllm.parent.parent)
    hardware = windows_cpu_machine(tmp_path / "windows-cpu.json")
    spec = protocol.EngineModel(source=str(model), weights_mib=2, base_args=BASE_ARGS, tiers={})
    coordinator = ReferenceCoordinator(token=TOKEN, heartbeat_s=1.0, assign=protocol.Assign(
        assignment_id="a-1", model=protocol.ModelSpec(name="tiny-llama", vllm=spec)))
    await coordinator.start()
    data_dir, output = tmp_path / "node", tmp_path / "node.out"
    with open(output, "wb") as out:
        app = subprocess.Popen([str(GPU_PROVIDER), "run", "--headless", "--data-dir", str(data_dir), "--coordinator",
                                coordinator.url, "--hardware", str(hardware)],
                               stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "GPU_PROVIDER_TOKEN": TOKEN})
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        engine = None
        while engine is None or engine["state"] != "ready":
            assert app.poll() is None, output.read_text()[-4000:]
            assert time.monotonic() < deadline, f"not ready:\n{output.read_text()[-3000:]}\n{engine_log(engine)}"
            assert engine is None or engine["state"] != "failed", engine_log(engine)
            await asyncio.sleep(1.0)
            engine = await asyncio.to_thread(engine_status, data_dir)
        assert engine["argv"][0] == f"{VLLM_FOLDER}/bin/vllm"
        assert engine["argv"][2].startswith("/home/lender/.cache/gpu-provider/models/")
        assert engine["port"] is not None
        inside = fake.processes(DISTRO)
        assert inside and engine["pid"] not in inside
        reply = await (await coordinator.request(CHAT)).collect(timeout=120)
        assert reply.head is not None and reply.head.status == 200, reply.data
        assert json.loads(reply.data)["usage"]["completion_tokens"] == 6
        app.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(app.wait, 120) == 0, output.read_text()[-4000:]
        assert all_gone([*inside, engine["pid"]], 20), [argv_of(p) for p in inside if alive(p)]
        assert fake.processes(DISTRO) == []
    finally:
        if app.poll() is None:
            app.kill()
            app.wait()
        await coordinator.stop()


# --- what crosses into the distribution -------------------------------------------------------

def environ_of(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(pair.split("=", 1) for pair in pairs if "=" in pair)


async def test_the_engines_own_variables_cross_through_wslenv_and_nothing_else(
        fake: FakeWsl, vllm_standin: Path, tmp_path: Path) -> None:
    """The vLLM stand-in inside: its key, its cards, its settings and telemetry off arrive (only
    WSLENV carries them); the provider token, a VLLM_* of the user's and the app's own
    folders do not, and its user configuration is the launcher's folder inside."""
    plan = EnginePlan(engine_id="e0", engine="vllm", gpu_indices=(1,), layout="single", memory_mib=24000, tier=None,
                      args=("--max-model-len", "4096"), fallbacks=(), port=free_port(),
                      env={"VLLM_WSL2_ENABLE_PIN_MEMORY": "1"}, executable=(sys.executable, str(vllm_standin)),
                      model="/models/Qwen3-8B", served_name="qwen3-8b", in_wsl=True, wsl_distro=DISTRO)
    base = {**os.environ, "GPU_PROVIDER_TOKEN": "the-token", "VLLM_HOST_IP": "0.0.0.0", "WSLENV": "USERPROFILE/p"}
    sup = EngineSupervisor(plan, paths=Paths.under(tmp_path / "app").ensure(), timing=TIMING, base_env=base)
    try:
        await ready(sup)
        target = sup.target()
        assert target is not None
        engine = environ_of(pid_record(fake)["engine"])
        assert engine["VLLM_API_KEY"] == target.api_key
        assert (engine["CUDA_VISIBLE_DEVICES"], engine["CUDA_DEVICE_ORDER"]) == ("1", "PCI_BUS_ID")
        assert engine["VLLM_NO_USAGE_STATS"] == engine["DO_NOT_TRACK"] == engine["VLLM_WSL2_ENABLE_PIN_MEMORY"] == "1"
        assert engine["XDG_CONFIG_HOME"] == "/home/lender/.local/state/gpu-provider/config"
        assert engine["HOME"] == "/home/lender"
        assert not {"GPU_PROVIDER_TOKEN", "VLLM_HOST_IP", "USERPROFILE"} & set(engine)
        assert "USERPROFILE" not in engine["WSLENV"]  # the user's own WSLENV was not carried on
        assert not any(target.api_key.encode() in line for line in every_cmdline())
    finally:
        await sup.stop()
    assert fake.processes(DISTRO) == []
