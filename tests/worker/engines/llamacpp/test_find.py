"""Finding llama-server: its build from `--version` (on stderr), run with its own folder on the
library path, bounded, and nothing where the binary fails or is not there; one on PATH only at a
build the app ships, else the shipped build is installed."""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import httpx
import pytest

from tests.support.https_server import HttpsServer
from tests.worker.engines.llamacpp.test_llamacpp_install import (
    downloads, pinned, platform_asset_name, release_zip, serve_release,
)
from tests.worker.engines.probes import script
from tests.worker.engines.test_vllm_cpu import GGUF, assign
from tests.worker.hardware.recorded import replay
from tests.worker.provision.conftest import ca, client, no_sleep, server  # noqa: F401 (fixtures)
from worker.engines.finding import find_engines, run_for_version
from worker.engines.llamacpp.find import find_llama_server, parse_llama_version
from worker.engines.llamacpp.releases import SHIPPED
from worker.hardware.model import EngineInstall
from worker.plan.planner import Plan, plan
from worker.provision import assignment
from worker.provision.engine_install import ensure_engine
from worker.provision.problems import Downloader
from worker.system.config import Paths, Settings


def test_llama_server_version_is_read_from_its_stderr(tmp_path):
    server = script(
        tmp_path / "llama-server",
        'echo "version: 6153 (4f1d2c9)" >&2\necho "built with GNU 12.2.0 for Linux x86_64" >&2\n',
    )
    found = find_llama_server(str(server), run_for_version)
    assert (found.version, found.path) == ("b6153", str(server))


def test_llama_server_probe_sees_its_own_folder_on_the_library_path(tmp_path):
    server = script(tmp_path / "llama-server", 'echo "version: $LD_LIBRARY_PATH" >&2\n')
    found = find_llama_server(str(server), run_for_version)
    assert found.version is not None and found.version.startswith(str(tmp_path))


def test_a_hanging_or_failing_binary_gives_no_version(tmp_path):
    failing = script(tmp_path / "llama-server", "exit 3\n")
    assert find_llama_server(str(failing), run_for_version).version is None
    assert run_for_version(["sleep", "5"], 0.2) is None
    assert find_llama_server(str(tmp_path / "missing"), run_for_version).version is None


@pytest.mark.parametrize(
    ("output", "version"),
    [("version: 6153 (4f1d2c9)\nbuilt with …", "b6153"), ("version: 0.6.0-dev\n", "0.6.0-dev"), ("garbage", None)],
)
def test_llama_version_formats(output, version):
    assert parse_llama_version(output) == version


def on_path(folder: Path, build: int, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A llama-server of `build` first on PATH, as winget or scoop would put one."""
    server = script(folder / "llama-server", f'echo "version: {build} (abc1234)" >&2\n')
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return server


def test_a_llama_server_on_path_counts_only_at_a_build_the_app_ships(tmp_path, monkeypatch):
    on_path(tmp_path, 5000, monkeypatch)
    assert find_llama_server(None, run_for_version) == EngineInstall(None)
    shipped = on_path(tmp_path, 10423, monkeypatch)
    assert find_llama_server(None, run_for_version) == EngineInstall("b10423", str(shipped))


def test_a_llama_server_named_by_the_person_counts_at_its_own_build(tmp_path):
    named = script(tmp_path / "llama-server", 'echo "version: 5000 (abc1234)" >&2\n')
    assert find_llama_server(str(named), run_for_version) == EngineInstall("b5000", str(named))


async def test_an_old_llama_server_on_path_gets_the_shipped_build_installed(
    server: HttpsServer, client: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Detection, planning and provisioning as the node runs them: the b5000 on PATH (which would
    refuse `--fit off`) is passed over and the build the app ships is installed and started."""
    (tmp_path / "bin").mkdir()
    on_path(tmp_path / "bin", 5000, monkeypatch)
    build = SHIPPED.default
    assert build is not None
    name = platform_asset_name(build=build)
    serve_release(server, {name: release_zip()}, build=build)
    releases = pinned({name: release_zip()}, build=build)
    monkeypatch.setattr(assignment, "ensure_engine", functools.partial(
        ensure_engine, downloader=Downloader(client, sleep=no_sleep, margin_bytes=0),
        release_api=downloads(server), releases=releases))
    machine = dataclasses.replace(replay("no-gpu.json"), engines=find_engines("Linux"))
    chosen = plan(machine, assign(llamacpp=GGUF), Settings())
    assert isinstance(chosen, Plan), chosen

    engine = await assignment._engine_executable(chosen, machine, Paths.under(tmp_path), print, {})

    assert engine.executable == (str(Paths.under(tmp_path).engines_dir / f"llamacpp-{build}" / "build/bin/llama-server"),)
    assert server.requests_for(f"download/{build}/{name}")
