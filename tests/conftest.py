"""Fixtures shared across the suite: the real llama-server, a tiny GGUF model, the vLLM stand-in."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.engines import VLLM_STANDIN, LlamaServer, ensure_llama_server
from tests.support.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="session")
def llama_server_bin() -> LlamaServer:
    """A real llama-server built from source once per machine (cached outside the repository)."""
    return ensure_llama_server()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random-weight llama GGUF (about 0.5 MB) that llama-server runs on CPU."""
    return write_tiny_gguf(tmp_path_factory.mktemp("models") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def vllm_standin() -> Path:
    """The executable that stands in for `vllm` (tests/standin/vllm)."""
    return VLLM_STANDIN
