"""The real vLLM (its CPU build, installed once per machine by ensure_vllm.sh) and a tiny model it
loads. A test that needs them and cannot have them fails with the reason: it never skips."""

from __future__ import annotations

import atexit
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.support.engines import REPO

ENSURE_VLLM = REPO / "tests" / "support" / "ensure_vllm.sh"
TINY_HF_MODEL = REPO / "tests" / "support" / "tiny_hf_model.py"
INSTALL_TIMEOUT_S = 40 * 60  # ~10 minutes the first time on 2 cores; later calls return at once


@functools.cache
def ensure_vllm() -> Path:
    """The `vllm` executable of the cached CPU build (installing it, or waiting for its install)."""
    done = subprocess.run([str(ENSURE_VLLM)], capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the real vLLM is needed and could not be installed ({ENSURE_VLLM}):\n"
                           f"{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def vllm_python() -> Path:
    """The Python of the cached vLLM environment (it imports vllm, torch and transformers)."""
    return ensure_vllm().parent / "python"


@functools.cache
def tiny_hf_model() -> Path:
    """A tiny random-weight Llama folder (head size 64), made once per test session."""
    folder = Path(tempfile.mkdtemp(prefix="tiny-hf-llama-")) / "tiny-llama"
    atexit.register(shutil.rmtree, folder.parent, True)
    done = subprocess.run([str(vllm_python()), str(TINY_HF_MODEL), str(folder)], capture_output=True, text=True,
                          timeout=300, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"could not write the tiny Hugging Face model:\n{done.stderr[-3000:]}")
    return folder
