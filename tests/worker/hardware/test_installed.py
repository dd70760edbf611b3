from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from worker.hardware.installed import find_engines, find_llama_server, find_vllm, parse_llama_version, run_for_version


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_llama_server_version_is_read_from_its_stderr(tmp_path):
    server = _script(
        tmp_path / "llama-server",
        'echo "version: 6153 (4f1d2c9)" >&2\necho "built with GNU 12.2.0 for Linux x86_64" >&2\n',
    )
    found = find_llama_server(str(server), run_for_version)
    assert (found.version, found.path) == ("b6153", str(server))


def test_llama_server_probe_sees_its_own_folder_on_the_library_path(tmp_path):
    server = _script(tmp_path / "llama-server", 'echo "version: $LD_LIBRARY_PATH" >&2\n')
    found = find_llama_server(str(server), run_for_version)
    assert found.version is not None and found.version.startswith(str(tmp_path))


def test_a_hanging_or_failing_binary_gives_no_version(tmp_path):
    failing = _script(tmp_path / "llama-server", "exit 3\n")
    assert find_llama_server(str(failing), run_for_version).version is None
    assert run_for_version(["sleep", "5"], 0.2) is None
    assert find_llama_server(str(tmp_path / "missing"), run_for_version).version is None


@pytest.mark.parametrize(
    ("output", "version"),
    [("version: 6153 (4f1d2c9)\nbuilt with …", "b6153"), ("version: 0.6.0-dev\n", "0.6.0-dev"), ("garbage", None)],
)
def test_llama_version_formats(output, version):
    assert parse_llama_version(output) == version


def test_vllm_in_a_given_venv_is_read_from_its_metadata(tmp_path):
    site = tmp_path / "venv" / "lib" / "python3.12" / "site-packages"
    (site / "vllm-0.33.0.dist-info").mkdir(parents=True)
    (tmp_path / "venv" / "bin").mkdir()
    executable = _script(tmp_path / "venv" / "bin" / "vllm", "exit 1\n")  # never run: metadata is enough
    by_folder = find_vllm("Linux", str(tmp_path / "venv"), run_for_version)
    by_executable = find_vllm("Linux", str(executable), run_for_version)
    assert (by_folder.version, by_folder.path) == ("0.33.0", str(executable))
    assert (by_executable.version, by_executable.path) == ("0.33.0", str(executable))


def test_vllm_executable_elsewhere_is_asked_for_its_version(tmp_path):
    vllm = _script(tmp_path / "vllm", 'echo "0.11.0"\n')
    found = find_vllm("Linux", str(vllm), run_for_version)
    assert (found.version, found.path) == ("0.11.0", str(vllm))


def test_engine_bins_override_the_search(tmp_path):
    server = _script(tmp_path / "llama-server", 'echo "version: 7001 (abc)" >&2\n')
    engines = find_engines("Linux", {"llamacpp": str(server)})
    assert engines["llamacpp"].version == "b7001"
    assert os.path.samefile(engines["llamacpp"].path, server)



SECRETS = {"GPU_PROVIDER_TOKEN": "tok-secret", "VLLM_API_KEY": "vk", "LLAMA_API_KEY": "lk",
           "LLAMA_ARG_HOST": "0.0.0.0"}


def test_version_probes_get_no_token_key_or_llama_arg(tmp_path, monkeypatch):
    """The probe runs an engine binary: it gets what an engine child gets, never the provider token."""
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    server = _script(tmp_path / "llama-server", f'env >> "{tmp_path}/seen"\necho "version: 1 (abc)" >&2\n')
    found = find_llama_server(str(server), run_for_version)  # the app's own environment
    run_for_version([str(server)], 5.0, {**SECRETS, "PATH": os.environ["PATH"], "EXTRA": "1"})  # one given
    names = [line.split("=", 1)[0] for line in (tmp_path / "seen").read_text().splitlines()]
    assert found.version == "b1" and names.count("PATH") == 2 and "EXTRA" in names
    assert [name for name in SECRETS if name in names] == []
