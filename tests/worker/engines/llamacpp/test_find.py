"""Finding llama-server: its build from `--version` (on stderr), run with its own folder on the
library path, bounded, and nothing where the binary fails or is not there."""

from __future__ import annotations

import pytest

from tests.worker.engines.probes import script
from worker.engines.finding import run_for_version
from worker.engines.llamacpp.find import find_llama_server, parse_llama_version


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
