"""Which model local mode assigns, and how large it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.localnet import DEFAULT_LOCAL_MODEL, LocalModelError, local_assignment


def test_local_assignment_for_a_gguf_file_uses_llamacpp_and_its_size(tmp_path: Path) -> None:
    model = tmp_path / "Tiny-Chat-Q4_K_M.gguf"
    model.write_bytes(b"\0" * (3 * 2**20))
    assign = local_assignment("cpu", str(model))
    assert assign.model.name == "tiny-chat-q4_k_m"
    assert assign.model.vllm is None
    assert assign.model.llamacpp is not None
    assert (assign.model.llamacpp.source, assign.model.llamacpp.weights_mib) == (str(model), 3)


def test_local_assignment_of_a_model_folder_counts_only_weights(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\0" * (2 * 2**20))
    (tmp_path / "notes.txt").write_bytes(b"\0" * (5 * 2**20))
    assign = local_assignment("native", str(tmp_path))
    assert assign.model.vllm is not None and assign.model.vllm.weights_mib == 2


def test_local_assignment_default_is_a_small_instruct_gguf() -> None:
    assign = local_assignment("cpu")
    assert assign.model.llamacpp is not None
    assert f"{assign.model.llamacpp.source}#sha256={assign.model.llamacpp.sha256}" == DEFAULT_LOCAL_MODEL
    assert assign.model.name == "qwen2.5-0.5b-instruct-q4_k_m"
    assert 300 < assign.model.llamacpp.weights_mib < 1000


def test_local_assignment_of_a_url_needs_its_hash() -> None:
    url = "https://example.org/files/Tiny-1B-Q4_K_M.gguf"
    with pytest.raises(LocalModelError, match="without its sha256"):
        local_assignment("cpu", url)
    with pytest.raises(LocalModelError, match="not a sha256"):
        local_assignment("cpu", url + "#sha256=abc")
    assign = local_assignment("cpu", url + "#sha256=" + "AB" * 32)
    assert assign.model.llamacpp is not None and assign.model.llamacpp.sha256 == "ab" * 32
    assert assign.model.name == "tiny-1b-q4_k_m"


def test_local_assignment_for_a_repo_estimates_from_its_name() -> None:
    assign = local_assignment("native", "Qwen/Qwen2.5-7B-Instruct-AWQ")
    assert assign.model.llamacpp is None
    assert assign.model.vllm is not None and 3500 < assign.model.vllm.weights_mib < 5000


@pytest.mark.parametrize("runtime, model, fragment", [
    ("cpu", "Qwen/Qwen2.5-7B-Instruct", "llama.cpp only"),
    ("native", "Qwen/Qwen2.5-0.5B-Instruct-GGUF", "name one file"),
    ("native", "org/mystery-model", "can't tell how large"),
    ("cpu", "ftp://example.org/m.gguf", "only https://"),
    ("cpu", "/nowhere/at/all.gguf", "does not exist"),
])
def test_local_assignment_refuses_with_a_reason(runtime: str, model: str, fragment: str) -> None:
    with pytest.raises(LocalModelError, match=fragment):
        local_assignment(runtime, model)
