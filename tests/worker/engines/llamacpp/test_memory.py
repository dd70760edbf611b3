"""llama.cpp's memory rule: KV cells as llama-server allocates them (padding, slots, unified or
not), bytes per cell from the GGUF's own shape and the cache types, where each part lands (RAM,
`-ngl`, `-nkvo`), and the thread count against the cores."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.support.tiny_gguf import write_tiny_gguf
from worker.engines import get_adapter
from worker.engines.base import Room, StartCheck
from worker.engines.llamacpp.gguf import GgufError
from worker.engines.llamacpp.memory import ServerSettings, read_shape, start_problem

MIB = 2**20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 layers × 4 KV heads × head length 16, trained context 2048: 512 bytes per cell in f16."""
    return write_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf")


def shaped(path: Path, arch: str, **keys: object) -> Path:
    """A header-only model of `arch` with the given `{arch}.…` keys (and one small tensor)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        name = f"{arch}.{key.replace('__', '.')}"
        if isinstance(value, list):
            writer.add_array(name, value)
        else:
            writer.add_uint32(name, int(value))  # type: ignore[call-overload]
    writer.add_tensor("t", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def settings(*args: str) -> ServerSettings:
    return ServerSettings.from_args(list(args))


@pytest.mark.parametrize(
    ("args", "cells"),
    [
        pytest.param((), 2048, id="unset-is-the-trained-context"),
        pytest.param(("-c", "0"), 2048, id="zero-is-the-trained-context"),
        pytest.param(("-c", "1024"), 1024, id="plain"),
        pytest.param(("--ctx-size", "1000"), 1024, id="padded-to-256"),
        pytest.param(("-c", "2097152", "-np", "-1"), 2097152, id="auto-slots-share-one-buffer"),
        pytest.param(("-c", "1024", "-np", "4"), 1024, id="4-slots-of-256"),
        pytest.param(("-c", "1024", "-np", "3"), 1536, id="3-slots-each-padded-up"),
        pytest.param(("-c", "1024", "-np", "256"), 65536, id="256-slots-each-padded-to-256"),
        pytest.param(("-c", "1024", "-np", "256", "-kvu"), 1024, id="256-slots-unified"),
        pytest.param(("-c", "1024", "-np", "256", "-kvu", "-no-kvu"), 65536, id="last-switch-wins"),
        pytest.param(("-c", "1024", "-no-kvu"), 1024, id="auto-slots-are-unified-whatever-is-said"),
    ],
)
def test_cells_as_llama_server_allocates_them(args: tuple[str, ...], cells: int) -> None:
    assert settings(*args).cells(trained_context=2048) == cells


def test_the_tiny_models_shape(tiny: Path) -> None:
    shape = read_shape(str(tiny))
    assert (shape.layers, shape.trained_context, shape.kv_heads) == (2, 2048, (4, 4))
    assert (shape.key_length, shape.value_length) == (16, 16)  # embedding 64 / 4 heads
    assert shape.file_bytes == tiny.stat().st_size


@pytest.mark.parametrize(
    ("cache_k", "cache_v", "cell_bytes"),
    [
        ("f16", "f16", 512), ("f32", "f32", 1024), ("bf16", "f32", 768), ("q8_0", "q8_0", 272),
        ("q4_0", "f16", 328), ("q4_1", "q5_0", 8 * (10 + 11)), ("iq4_nl", "q5_1", 8 * (9 + 12)),
    ],
)
def test_bytes_per_cell_follow_the_cache_types(tiny: Path, cache_k: str, cache_v: str, cell_bytes: int) -> None:
    shape = read_shape(str(tiny))
    assert shape.cell_bytes(range(shape.layers), cache_k, cache_v) == cell_bytes


def test_per_layer_kv_heads_and_own_head_lengths(tmp_path: Path) -> None:
    """A hybrid model keeps KV in its attention layers only; key and value lengths as the file says."""
    path = shaped(tmp_path / "hybrid.gguf", "qwen3next", block_count=4, context_length=262144,
                  embedding_length=2048, attention__head_count=16, attention__head_count_kv=[0, 0, 0, 2],
                  attention__key_length=256, attention__value_length=128)
    shape = read_shape(str(path))
    assert shape.kv_heads == (0, 0, 0, 2) and shape.trained_context == 262144
    assert shape.cell_bytes(range(4), "f16", "f16") == 2 * (256 + 128) * 2
    # 262,144 cells × 1,536 bytes = 384 MiB: fits 400 MiB of RAM, not 300
    assert start_problem(str(path), [("base_args", [])], Room(None, 400, 8)) is None
    refused = start_problem(str(path), [("base_args", [])], Room(None, 300, 8))
    assert refused is not None and "384 MiB for 262,144 tokens of context" in refused


@pytest.mark.parametrize(
    ("keys", "why"),
    [
        pytest.param({"context_length": 4096}, "how many layers", id="no-block-count"),
        pytest.param({"block_count": 100000}, "block_count in the model file is not a whole number", id="too-many-layers"),
        pytest.param({"block_count": 3, "attention__head_count_kv": [1, 2]}, "2 values for 3 layers", id="short-list"),
    ],
)
def test_a_shape_the_file_does_not_give_is_refused(tmp_path: Path, keys: dict[str, object], why: str) -> None:
    with pytest.raises(GgufError, match=why):
        read_shape(str(shaped(tmp_path / "bad.gguf", "llama", **keys)))


def test_a_model_without_a_context_length_needs_one_given(tmp_path: Path) -> None:
    path = shaped(tmp_path / "noctx.gguf", "llama", block_count=2, embedding_length=64, attention__head_count=4)
    refused = start_problem(str(path), [("base_args", [])], Room(None, 10_000, 8))
    assert refused is not None and "set one with -c" in refused
    assert start_problem(str(path), [("base_args", ["-c", "512"])], Room(None, 10_000, 8)) is None


def test_the_2_gib_context_is_refused_where_the_ram_cannot_hold_it(tiny: Path) -> None:
    runs = [("base_args", ["-c", "2097152", "-ctk", "f32", "-ctv", "f32"])]
    refused = start_problem(str(tiny), runs, Room(None, 1024, 2))
    assert refused == (
        "not enough memory (with base_args): it would need 2,049 MiB (2,048 MiB for 2,097,152 tokens of context "
        "over 4 slots, stored as f32, 1 MiB for the model), but the RAM this computer can spare now is 1,024 MiB, "
        "1,025 MiB short; ask for a shorter context (-c), fewer slots (-np) or a smaller cache type (-ctk/-ctv)")
    assert start_problem(str(tiny), runs, Room(None, 2049, 2)) is None


def test_every_run_is_judged_and_named(tiny: Path) -> None:
    """The chosen tier fits; its fallback (base_args alone) would not: refused, naming base_args."""
    runs = [("tier 24000", ["-c", "2097152", "-c", "1024"]), ("base_args", ["-c", "2097152"])]
    refused = start_problem(str(tiny), runs, Room(None, 512, 2))
    assert refused is not None and refused.startswith("not enough memory (with base_args)")


def test_the_prompt_cache_counts_against_ram(tiny: Path) -> None:
    refused = start_problem(str(tiny), [("base_args", ["-c", "1024", "-cram", "8192"])], Room(None, 4096, 2))
    assert refused is not None and "8,192 MiB for the prompt cache (-cram)" in refused
    assert refused.endswith("ask for a smaller prompt cache (-cram)")
    assert start_problem(str(tiny), [("base_args", ["-c", "1024", "-cram", "2048"])], Room(None, 4096, 2)) is None


@pytest.mark.parametrize(
    ("args", "ram_mib", "card_mib", "fits"),
    [
        pytest.param(["-c", "1048576"], 100, 600, True, id="kv-on-the-card"),
        pytest.param(["-c", "1048576"], 100, 400, False, id="kv-over-the-card"),
        pytest.param(["-c", "1048576", "-nkvo"], 100, 10, False, id="nkvo-puts-kv-in-ram"),
        pytest.param(["-c", "1048576", "-nkvo"], 600, 10, True, id="nkvo-fits-the-ram"),
        pytest.param(["-c", "1048576", "-ngl", "0"], 100, 10, False, id="no-layers-offloaded"),
        pytest.param(["-c", "1048576", "-ngl", "2"], 300, 300, True, id="half-the-layers-each-side"),
        pytest.param(["-c", "1048576", "-ngl", "2"], 200, 300, False, id="half-in-ram-too-much"),
        pytest.param(["-c", "1048576", "-ngl", "all", "-kvo"], 1, 600, True, id="all-on-the-card"),
    ],
)
def test_where_the_kv_cache_lives(tiny: Path, args: list[str], ram_mib: int, card_mib: int, fits: bool) -> None:
    """On a machine with a card: 1,048,576 cells × 512 bytes = 512 MiB, split by layer as `-ngl`
    offloads the last N (counting the output layer), all in RAM with `-nkvo`."""
    refused = start_problem(str(tiny), [("base_args", args)], Room(card_mib, ram_mib, 8))
    assert (refused is None) == fits, refused


def test_where_the_card_is_short_the_reason_says_graphics_memory(tiny: Path) -> None:
    refused = start_problem(str(tiny), [("base_args", ["-c", "1048576"])], Room(400, 100, 8))
    assert refused is not None and "graphics memory usable here is 400 MiB, 113 MiB short" in refused


@pytest.mark.parametrize(
    ("args", "flag"),
    [(["-t", "1024"], "-t"), (["--threads", "3"], "-t"), (["-tb", "64"], "-tb"), (["--threads-batch", "3"], "-tb")],
)
def test_threads_beyond_the_cores_are_refused(tiny: Path, args: list[str], flag: str) -> None:
    refused = start_problem(str(tiny), [("tier 8000", args)], Room(None, 10_000, 2))
    threads = int(args[1])
    assert refused == (f"value not allowed for {flag} (in tier 8000): {threads:,} threads, more than this "
                       "computer's 2 CPU threads")
    assert start_problem(str(tiny), [("tier 8000", [args[0], "2"])], Room(None, 10_000, 2)) is None


def test_an_unreadable_model_is_a_refusal(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 64)
    refused = start_problem(str(path), [("base_args", [])], Room(None, 10_000, 2))
    assert refused is not None and refused.startswith("the model file cannot be used: GGUF version")


def test_the_llama_cpp_adapter_offers_the_start_check() -> None:
    assert isinstance(get_adapter("llamacpp"), StartCheck)
