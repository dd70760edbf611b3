"""Which model local mode assigns, and how large it is."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import toy_engine
from tests.worker.engines.test_vllm_cpu import cpu_machine
from worker.engines import registry
from worker.system.config import Settings
from worker.engines.vllm.planning import NO_CPU_BUILD
from worker.link.local import DEFAULT_LOCAL_MODEL, LocalModelError, local_assignment
from worker.plan.planner import Plan, Refusal, plan


def test_local_assignment_for_a_gguf_file_uses_llamacpp_and_its_size(tmp_path: Path) -> None:
    model = tmp_path / "Tiny-Chat-Q4_K_M.gguf"
    model.write_bytes(b"\0" * (3 * 2**20))
    assign = local_assignment("cpu", str(model))
    assert assign.model.name == "tiny-chat-q4_k_m"
    block = assign.model.for_engine("llamacpp")
    assert assign.model.for_engine("vllm") is None and block is not None
    assert (block.source, block.weights_mib) == (str(model), 3)


def test_local_assignment_carries_the_tune_block_it_is_given(tmp_path: Path) -> None:
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"\0" * 2**20)
    tune = {"when": ["idle"], "space": {"-np": {"min": 1, "max": 8}}}
    block = local_assignment("cpu", str(model), tune=tune).model.for_engine("llamacpp")
    assert block is not None and block.tune == tune
    untuned = local_assignment("cpu", str(model)).model.for_engine("llamacpp")
    assert untuned is not None and untuned.tune is None


def test_local_assignment_of_a_model_folder_counts_only_weights(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\0" * (2 * 2**20))
    (tmp_path / "notes.txt").write_bytes(b"\0" * (5 * 2**20))
    assign = local_assignment("native", str(tmp_path))
    block = assign.model.for_engine("vllm")
    assert block is not None and block.weights_mib == 2


def test_a_model_folder_on_a_cpu_machine_runs_on_vllms_cpu_build_where_it_is_installed(tmp_path: Path) -> None:
    """`gpu-provider run --coordinator local --model FOLDER` on a machine with no graphics card:
    vLLM's CPU build serves it; without that build the plan says a GGUF file is needed."""
    (tmp_path / "model.safetensors").write_bytes(b"\0" * (2 * 2**20))
    assign = local_assignment("cpu", str(tmp_path))
    assert assign.model.for_engine("llamacpp") is None and assign.model.for_engine("vllm") is not None
    chosen = plan(cpu_machine(), assign, Settings())
    assert isinstance(chosen, Plan) and chosen.engine == "vllm" and chosen.engines[0].gpu_indices == ()
    refused = plan(cpu_machine(None), assign, Settings())
    assert isinstance(refused, Refusal) and refused.reason == NO_CPU_BUILD and "llama.cpp" in refused.reason


def test_local_assignment_default_is_a_small_instruct_gguf() -> None:
    assign = local_assignment("cpu")
    block = assign.model.for_engine("llamacpp")
    assert block is not None
    assert f"{block.source}#sha256={block.sha256}" == DEFAULT_LOCAL_MODEL
    assert assign.model.name == "qwen2.5-0.5b-instruct-q4_k_m"
    assert 300 < block.weights_mib < 1000


def test_local_assignment_of_a_url_needs_its_hash() -> None:
    url = "https://example.org/files/Tiny-1B-Q4_K_M.gguf"
    with pytest.raises(LocalModelError, match="without its sha256"):
        local_assignment("cpu", url)
    with pytest.raises(LocalModelError, match="not a sha256"):
        local_assignment("cpu", url + "#sha256=abc")
    assign = local_assignment("cpu", url + "#sha256=" + "AB" * 32)
    block = assign.model.for_engine("llamacpp")
    assert block is not None and block.sha256 == "ab" * 32
    assert assign.model.name == "tiny-1b-q4_k_m"


def test_local_assignment_for_a_repo_estimates_from_its_name() -> None:
    assign = local_assignment("native", "Qwen/Qwen2.5-7B-Instruct-AWQ")
    block = assign.model.for_engine("vllm")
    assert assign.model.for_engine("llamacpp") is None
    assert block is not None and 3500 < block.weights_mib < 5000


@pytest.mark.parametrize("runtime, model, fragment", [
    ("windows", "Qwen/Qwen2.5-7B-Instruct", "llama.cpp only"),
    ("apple-silicon", "Qwen/Qwen2.5-7B-Instruct", "llama.cpp only"),
    ("native", "Qwen/Qwen2.5-0.5B-Instruct-GGUF", "name one file"),
    ("native", "org/mystery-model", "can't tell how large"),
    ("cpu", "ftp://example.org/m.gguf", "only https://"),
    ("cpu", "/nowhere/at/all.gguf", "does not exist"),
])
def test_local_assignment_refuses_with_a_reason(runtime: str, model: str, fragment: str) -> None:
    with pytest.raises(LocalModelError, match=fragment):
        local_assignment(runtime, model)


def test_a_path_typed_relative_to_the_working_directory_is_used(tmp_path, monkeypatch) -> None:
    """`--model .venv/demo/tiny-demo.gguf`, as people type it, was refused as neither a repo id,
    a URL nor an absolute path."""
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "Tiny-1B-Q4_K_M.gguf").write_bytes(b"GGUF" + b"\0" * (2 * 2**20))
    (tmp_path / "org").mkdir()
    monkeypatch.chdir(tmp_path)
    for typed in ("demo/Tiny-1B-Q4_K_M.gguf", "./demo/Tiny-1B-Q4_K_M.gguf"):
        assign = local_assignment("cpu", typed)
        block = assign.model.for_engine("llamacpp")
        assert block is not None and block.source == str(tmp_path / "demo" / "Tiny-1B-Q4_K_M.gguf")
    repo = local_assignment("native", "Qwen/Qwen2.5-7B-Instruct-AWQ").model.for_engine("vllm")
    assert repo is not None and repo.source == "Qwen/Qwen2.5-7B-Instruct-AWQ"


def test_a_gguf_file_where_no_engine_here_reads_one_says_which_form_is_needed() -> None:
    """On a `native` machine the engines take folders or repositories: a GGUF file (the default
    model too) is refused here, naming them, rather than assigned to an engine this runtime lacks."""
    with pytest.raises(LocalModelError, match=r"this machine runs vLLM.* only \(runtime 'native'\).*model folder"):
        local_assignment("native", "https://example.org/m/Tiny-1B-Q4_K_M.gguf#sha256=" + "ab" * 32)
    with pytest.raises(LocalModelError, match="repository id"):
        local_assignment("native")


@pytest.fixture
def toy() -> Iterator[None]:
    registry.register(toy_engine)
    try:
        yield
    finally:
        registry.unregister(toy_engine.NAME)


def test_the_block_and_its_arguments_are_the_engines_own(toy: None, tmp_path: Path) -> None:
    """A third engine that reads folders on `cpu`, registered before vLLM's fallback there, gets a
    folder with its own local defaults; nothing here names it."""
    (tmp_path / "model.safetensors").write_bytes(b"\0" * (2 * 2**20))
    block = local_assignment("cpu", str(tmp_path)).model.for_engine("toy")
    assert block is not None and block.base_args == list(toy_engine.LOCAL_DEFAULTS.base_args) and block.tiers == {}
    gguf = local_assignment("cpu").model.for_engine("llamacpp")
    assert gguf is not None and gguf.tiers == {"8000": ["--ctx-size", "8192"], "16000": ["--ctx-size", "16384"]}
