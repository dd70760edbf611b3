"""The engines' part of detection: every registered engine looked for (where `--engine-bin` says,
else where it lives), version probes that get what an engine child gets, and the runtime named
for an engine that drives the machine's NVIDIA cards, asked through the adapters."""

from __future__ import annotations

import json
import subprocess
import os
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from tests.support import toy_engine
from tests.worker.engines.probes import script
from tests.worker.hardware.recorded import NO_ENGINE_FINDER, NVML_FIXTURES
from worker.engines import registry
from worker.engines.finding import drives, find_engines, run_for_version
from worker.engines.llamacpp.find import find_llama_server
from worker.hardware import IN_WSL, EngineInstall, GpuGroup, ReplaySource, detect, load_reading
from worker.hardware.host import run_quietly
from worker.system.config import Settings

SECRETS = {"GPU_PROVIDER_TOKEN": "tok-secret", "VLLM_API_KEY": "vk", "LLAMA_API_KEY": "lk",
           "LLAMA_ARG_HOST": "0.0.0.0"}
TURING = GpuGroup((0,), "NVIDIA T4", 14000, compute_capability="7.5")
PASCAL = GpuGroup((0,), "NVIDIA GeForce GTX 1080 Ti", 10000, compute_capability="6.1")


def test_engine_bins_override_the_search(tmp_path):
    server = script(tmp_path / "llama-server", 'echo "version: 7001 (abc)" >&2\n')
    engines = find_engines("Linux", {"llamacpp": str(server)})
    assert engines["llamacpp"].version == "b7001"
    assert os.path.samefile(engines["llamacpp"].path, server)


def test_version_probes_get_no_token_key_or_llama_arg(tmp_path, monkeypatch):
    """The probe runs an engine binary: it gets what an engine child gets, never the provider token."""
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    server = script(tmp_path / "llama-server", f'env >> "{tmp_path}/seen"\necho "version: 1 (abc)" >&2\n')
    found = find_llama_server(str(server), run_for_version)  # the app's own environment
    run_for_version([str(server)], 5.0, {**SECRETS, "PATH": os.environ["PATH"], "EXTRA": "1"})  # one given
    names = [line.split("=", 1)[0] for line in (tmp_path / "seen").read_text().splitlines()]
    assert found.version == "b1" and names.count("PATH") == 2 and "EXTRA" in names
    assert [name for name in SECRETS if name in names] == []


def test_a_hardware_probe_never_gets_the_token(monkeypatch):
    """sysctl and nvidia-smi run with the app's environment, less the provider token."""
    monkeypatch.setenv("GPU_PROVIDER_TOKEN", "tok-secret")
    monkeypatch.setenv("EXTRA_SEEN", "1")
    seen = run_quietly(["env"], 5.0) or ""
    assert "EXTRA_SEEN=1" in seen and "tok-secret" not in seen


def test_the_runtime_is_named_by_the_groups_an_engine_drives():
    """vLLM's own rule (compute capability 7.5 or newer) is asked through its adapter."""
    assert drives(TURING) and not drives(PASCAL)


@pytest.fixture
def gpu_toy() -> Iterator[None]:
    """The toy engine, as one that serves NVIDIA cards on Linux with no rule of its own."""
    adapter = SimpleNamespace(**{name: getattr(toy_engine, name) for name in dir(toy_engine) if not name.startswith("_")})
    adapter.RUNTIMES = frozenset({"native"})
    registry.register(adapter)  # type: ignore[arg-type]
    try:
        yield
    finally:
        registry.unregister(toy_engine.NAME)


def test_an_engine_with_no_rule_of_its_own_drives_every_group(gpu_toy: None):
    """A card too old for vLLM makes a `native` machine once an engine that takes any card is registered."""
    calls = json.loads((NVML_FIXTURES / "h200.json").read_text())["nvml"]["calls"] | {"compute_capability:0": "6.1"}
    host, _ = load_reading(NVML_FIXTURES / "h200.json")
    assert drives(PASCAL)
    assert detect(Settings(), NO_ENGINE_FINDER, host=host, nvml=ReplaySource(calls)).runtime == "native"


# --- on Windows: the app's own installs inside WSL2 ----------------------------------------------

def _inside_wsl(home, asked: list[list[str]]):
    """A version runner standing for wsl.exe: the probe runs here as the distribution's python3
    would, with `home` as the user's home (the prefix must be `-d D --cd ~ -e`, never `--`)."""
    def run(argv, timeout_s, env=None):
        asked.append(list(argv))
        assert argv[:6] == ["wsl.exe", "-d", "Ubuntu", "--cd", "~", "-e"] and timeout_s >= 30
        done = subprocess.run(argv[6:], capture_output=True, text=True, cwd=home, timeout=30,
                              env={"HOME": str(home), "PATH": os.environ["PATH"]})
        return done.stdout + done.stderr if done.returncode == 0 else None
    return run


def _installed(home, folder: str, marker: str | None) -> None:
    path = home / ".local/share/gpu-provider/engines" / folder
    path.mkdir(parents=True)
    if marker is not None:
        (path / ".gpu-provider-installed").write_text(marker)


def test_on_windows_the_apps_own_finished_installs_inside_wsl2_are_found(tmp_path):
    """Not the distribution's system python3 (PEP 668 keeps pip out of it): the app's venvs,
    finished ones only, newest shipped release first; one probe for every such engine."""
    _installed(tmp_path, "vllm-0.33.0", "0.33.0")
    _installed(tmp_path, "vllm-0.32.0+cpu", "0.32.0+cpu")
    _installed(tmp_path, "vllm-9.9.9", "9.9.9")  # no release this app ships
    _installed(tmp_path, "sglang-0.5.23", None)  # unfinished: no marker
    asked: list[list[str]] = []
    found = find_engines("Windows", {}, _inside_wsl(tmp_path, asked), wsl_distro="Ubuntu")
    assert (found["vllm"].version, found["vllm"].path) == ("0.33.0", IN_WSL)
    assert found["sglang"] == EngineInstall(None)
    assert len(asked) == 1 and "importlib.metadata" not in " ".join(asked[0])
    assert set(asked[0][-2:]) == {"vllm", "sglang"}


def test_on_windows_without_a_distribution_nothing_is_asked_of_wsl(tmp_path):
    asked: list[list[str]] = []
    found = find_engines("Windows", {}, _inside_wsl(tmp_path, asked), wsl_distro=None)
    assert asked == [] and found["vllm"] == EngineInstall(None) == found["sglang"]


@pytest.mark.parametrize("answer", [None, "", "not json", '["0.33.0"]', '{"vllm": "0.33.0"}',
                                    '{"vllm": ["0.33.0; rm -rf ~"]}', "x" * 100_000])
def test_an_answer_that_is_no_list_of_installs_finds_nothing(answer):
    found = find_engines("Windows", {}, lambda argv, timeout_s, env=None: answer, wsl_distro="Ubuntu")
    assert found["vllm"] == EngineInstall(None)
