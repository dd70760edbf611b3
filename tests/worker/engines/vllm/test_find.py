"""Finding vLLM: a venv's metadata (never run), an executable elsewhere asked for its version.
On Windows it is looked for inside WSL2 by `engines.finding` (tests/worker/engines/test_finding.py)."""

from __future__ import annotations

from tests.worker.engines.probes import script
from worker.engines.finding import run_for_version
from worker.engines.vllm.find import find_vllm


def test_vllm_in_a_given_venv_is_read_from_its_metadata(tmp_path):
    site = tmp_path / "venv" / "lib" / "python3.12" / "site-packages"
    (site / "vllm-0.33.0.dist-info").mkdir(parents=True)
    (tmp_path / "venv" / "bin").mkdir()
    executable = script(tmp_path / "venv" / "bin" / "vllm", "exit 1\n")  # never run: metadata is enough
    by_folder = find_vllm("Linux", str(tmp_path / "venv"), run_for_version)
    by_executable = find_vllm("Linux", str(executable), run_for_version)
    assert (by_folder.version, by_folder.path) == ("0.33.0", str(executable))
    assert (by_executable.version, by_executable.path) == ("0.33.0", str(executable))


def test_vllm_executable_elsewhere_is_asked_for_its_version(tmp_path):
    vllm = script(tmp_path / "vllm", 'echo "0.11.0"\n')
    found = find_vllm("Linux", str(vllm), run_for_version)
    assert (found.version, found.path) == ("0.11.0", str(vllm))
