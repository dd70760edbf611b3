"""A real llama-server on CPU with the tiny GGUF, run by the supervisor: on a Unix socket in a
private folder with its key in the environment, ready only after a real completion, context and
slots read from the server, back after kill -9, nothing left after stop; deaf to a config file
planted in the user's ~/.config/llama.cpp/."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import psutil
import pytest

from tests.support.engines import LlamaServer, engine_client, free_port
from worker.system.config import Paths
from worker.contract.events import EngineSnapshot
from worker.plan.planner import EnginePlan
from worker.serve.process import StopTiming
from worker.serve.restart_policy import RestartBackoff, SupervisorTiming
from worker.serve.supervisor import EngineSupervisor

pytestmark = pytest.mark.integration

TIMING = SupervisorTiming(ready_timeout_s=20, poll_s=0.05, request_timeout_s=2.0, probe_timeout_s=5.0,
                          health_interval_s=0.1, output_settle_s=1.0,
                          stop=StopTiming(grace_s=3.0, gone_s=3.0, poll_s=0.02))


def llama_plan(server: LlamaServer, model: Path) -> EnginePlan:
    return EnginePlan(engine_id="cpu0", engine="llamacpp", gpu_indices=(), layout="single", memory_mib=1024,
                      tier=None, args=("--ctx-size", "2048", "--threads", "1"), fallbacks=(),
                      port=free_port(), env={}, executable=(str(server.executable),), model=str(model),
                      served_name="tiny-llama")


def tcp_listeners(pid: int) -> list[tuple[str, int]]:
    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode()


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_llama_server_lifecycle(llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path) -> None:
    events: list[tuple[str, str]] = []

    def record(snapshot: EngineSnapshot, reason: str) -> None:
        events.append((snapshot.state, reason))

    sup = EngineSupervisor(llama_plan(llama_server_bin, tiny_gguf), paths=Paths.under(tmp_path).ensure(),
                           on_event=record, timing=TIMING, backoff=RestartBackoff(initial_s=0.01, maximum_s=0.05),
                           base_env=llama_server_bin.environment())
    await sup.start()
    try:
        snap = await sup.wait_for_state("ready", "failed", timeout=20)
        assert snap.state == "ready", snap.last_error
        assert snap.max_concurrency == 4.0  # llama-server's default: 4 slots sharing one KV buffer
        assert snap.context.declared == 2048 and snap.kv_cache_tokens == 2048 and snap.context.physical == 2048
        target = sup.target()
        socket_path = Path(target.socket_path)
        assert snap.argv[snap.argv.index("--host") + 1] == str(socket_path) and "--port" not in snap.argv
        assert "--api-key" not in snap.argv and target.api_key not in cmdline(snap.pid)
        assert stat.S_IMODE(socket_path.parent.stat().st_mode) == 0o700 and tcp_listeners(snap.pid) == []
        async with engine_client(target.socket_path, timeout=10) as client:
            reply = await client.post(f"{target.base_url}/v1/chat/completions",
                                      headers={"Authorization": f"Bearer {target.api_key}"},
                                      json={"model": target.served_model_name, "max_tokens": 8,
                                            "messages": [{"role": "user", "content": "hello"}]})
            refused = await client.get(f"{target.base_url}/props")
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0
        assert refused.status_code == 401  # LLAMA_API_KEY from the environment guards it

        first_pid, first_run = snap.pid, sup.run_id
        os.kill(first_pid, signal.SIGKILL)
        await sup.wait_for_state("starting", timeout=5)
        again = await sup.wait_for_state("ready", "failed", timeout=20)
        assert again.state == "ready" and again.restarts == 1 and again.pid != first_pid
        assert sup.run_id != first_run and "status -9" in again.last_error
        assert sup.target().api_key != target.api_key
    finally:
        await sup.stop()
    assert gone(again.pid) and gone(first_pid)
    assert events[-1] == ("stopped", "stopped") and sup.target() is None
    log_text = Path(again.log_path).read_text()
    assert f"listening on unix://{socket_path}" in log_text  # after kill -9, the leftover socket file was removed
    assert not socket_path.exists()


async def test_a_config_file_planted_in_the_users_config_folder_is_not_read(
        llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    planted = home / ".config" / "llama.cpp" / "config.ini"
    planted.parent.mkdir(parents=True)
    port = free_port()
    planted.write_text(f"host = 0.0.0.0\nport = {port}\nparallel = 1\napi-key = planted-key\n")
    base_env = llama_server_bin.environment({**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")})
    for unix_socket in (True, False):
        sup = EngineSupervisor(llama_plan(llama_server_bin, tiny_gguf), paths=Paths.under(tmp_path / "data").ensure(),
                               timing=TIMING, base_env=base_env, unix_socket=unix_socket)
        await sup.start()
        try:
            snap = await sup.wait_for_state("ready", "failed", timeout=20)
            assert snap.state == "ready", snap.last_error
            target = sup.target()
            async with engine_client(target.socket_path, timeout=10) as client:
                planted_key = await client.get(f"{target.base_url}/props", headers={"Authorization": "Bearer planted-key"})
            listeners = tcp_listeners(snap.pid)
        finally:
            await sup.stop()
        print(f"\nunix socket: {unix_socket}; slots: {snap.max_concurrency}; TCP listeners: {listeners}")
        assert "using config file" not in Path(snap.log_path).read_text()
        assert snap.max_concurrency == 4.0  # not the planted parallel = 1
        assert planted_key.status_code == 401
        assert listeners == ([] if unix_socket else [("127.0.0.1", sup.plan.port)])
