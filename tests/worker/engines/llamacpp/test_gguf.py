"""The bounded GGUF header reader: real files written by the `gguf` package read back; every
malformed or oversized header is a `GgufError` with a reason, read in time linear in its size."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.support.tiny_gguf import write_tiny_gguf
from worker.engines.llamacpp import gguf as reader
from worker.engines.llamacpp.gguf import GgufError, read_header

EVERYTHING = lambda key: True  # noqa: E731
NOTHING = lambda key: False  # noqa: E731


def u32(n: int) -> bytes:
    return struct.pack("<I", n)


def u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def text(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return u64(len(raw)) + raw


def head(pairs: int, version: int = 3) -> bytes:
    return b"GGUF" + u32(version) + u64(0) + u64(pairs)


def file(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    return path


def test_the_tiny_model_reads_back(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    header = read_header(path, lambda key: key.startswith(("llama.", "general.architecture")))
    values = header.values
    assert header.version == 3 and values["general.architecture"] == "llama"
    assert values["llama.block_count"] == 2 and values["llama.attention.head_count_kv"] == 4
    assert values["llama.context_length"] == 2048 and values["llama.embedding_length"] == 64
    assert "tokenizer.ggml.tokens" not in values  # skipped, not kept


def test_per_layer_arrays_and_other_types_are_kept_or_skipped(tmp_path: Path) -> None:
    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3next")
    writer.add_block_count(4)
    writer.add_head_count_kv([0, 0, 0, 2])
    writer.add_array("x.floats", [1.5, 2.5])
    writer.add_array("x.strings", ["a", "bc", ""])
    writer.add_float64("x.double", 0.25)
    writer.add_bool("x.flag", True)
    writer.add_tensor("t", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    values = read_header(path, lambda key: key.startswith("qwen3next.") or key in ("x.double", "x.flag")).values
    assert values["qwen3next.attention.head_count_kv"] == (0, 0, 0, 2) and values["qwen3next.block_count"] == 4
    assert values["x.double"] == 0.25 and values["x.flag"] is True


@pytest.mark.parametrize(
    ("data", "why"),
    [
        pytest.param(b"GGML" + bytes(20), "GGUF magic", id="other-magic"),
        pytest.param(b"", "ends inside its header", id="empty"),
        pytest.param(head(0, version=1), "version 1", id="version-1"),
        pytest.param(b"GGUF" + struct.pack(">I", 3) + bytes(16), "version 50331648", id="big-endian"),
        pytest.param(head(1)[:-3], "ends inside its header", id="truncated-count"),
        pytest.param(head(2**40), "1,099,511,627,776 metadata entries", id="huge-pair-count"),
        pytest.param(head(1) + u64(2**62), "a metadata key", id="huge-key-length"),
        pytest.param(head(1) + text("k") + u32(8) + u64(2**40), "a string value", id="huge-string"),
        pytest.param(head(1) + text("k") + u32(9) + u32(4) + u64(2**40), "an array", id="huge-array"),
        pytest.param(head(1) + text("k") + u32(9) + u32(9) + u64(1) + u32(4) + u64(0), "type 9", id="nested-array"),
        pytest.param(head(1) + text("k") + u32(13) + u32(0), "unknown type (13)", id="unknown-type"),
        pytest.param(head(1) + text("k") + u32(9) + u32(4) + u64(1000), "ends inside its header", id="array-past-end"),
        pytest.param(head(1) + text("k") + u32(8) + u64(100) + b"short", "ends inside its header", id="string-past-end"),
        pytest.param(head(2) + text("k") + u32(4) + u32(1), "ends inside its header", id="fewer-pairs-than-said"),
        pytest.param(head(1) + text(b"\xff\xfe") + u32(4) + u32(1), "not UTF-8", id="key-not-utf8"),
    ],
)
def test_a_malformed_header_is_refused_with_a_reason(tmp_path: Path, data: bytes, why: str) -> None:
    """Values skipped, as all but a few are: each cap holds before anything is skipped for it."""
    with pytest.raises(GgufError, match=why.replace("(", r"\(").replace(")", r"\)")):
        read_header(file(tmp_path, data), NOTHING)


def test_a_kept_array_that_is_no_short_list_of_numbers_is_left_out(tmp_path: Path) -> None:
    """Skipped as if not kept (with the same caps), so a sub-model's key of the same name cannot
    refuse the file; the rule then finds the key absent."""
    strings = head(2) + text("clip.attention.head_count") + u32(9) + u32(8) + u64(2) + text("x") + text("y")
    strings += text("llama.block_count") + u32(4) + u32(3)
    assert read_header(file(tmp_path, strings), EVERYTHING).values == {"llama.block_count": 3}
    long = head(1) + text("llama.attention.head_count_kv") + u32(9) + u32(4) + u64(5000) + bytes(20000)
    assert read_header(file(tmp_path, long), EVERYTHING).values == {}
    huge_array = head(1) + text("llama.attention.head_count_kv") + u32(9) + u32(4) + u64(2**40)
    with pytest.raises(GgufError, match="an array in the model file's header is 1,099,511,627,776 long"):
        read_header(file(tmp_path, huge_array), EVERYTHING)
    huge = head(1) + text("general.architecture") + u32(8) + u64(2**40)
    with pytest.raises(GgufError, match="more than 16,777,216"):
        read_header(file(tmp_path, huge), EVERYTHING)


def test_a_key_quoted_in_a_reason_shows_its_control_characters(tmp_path: Path) -> None:
    """Keys come from the file: one quoted in a reason (sent to the coordinator) is escaped."""
    data = head(1) + text("x\nstatus: ok\x1b[2J") + u32(13)
    with pytest.raises(GgufError) as raised:
        read_header(file(tmp_path, data), EVERYTHING)
    assert str(raised.value) == "'x\\nstatus: ok\\x1b[2J' is of an unknown type (13)"


def test_the_header_is_held_to_its_size_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader, "MAX_HEADER_BYTES", 1000)
    big = head(1) + text("k") + u32(9) + u32(0) + u64(2000) + bytes(2000)
    with pytest.raises(GgufError, match="larger than"):
        read_header(file(tmp_path, big), EVERYTHING)


def test_tensors_are_never_read(tmp_path: Path) -> None:
    """A header that says it has a billion tensors, followed by no tensor data at all, reads fine."""
    data = b"GGUF" + u32(3) + u64(10**9) + u64(1) + text("general.architecture") + u32(8) + text("llama")
    assert read_header(file(tmp_path, data), EVERYTHING).values == {"general.architecture": "llama"}


def test_a_fifo_in_place_of_the_model_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    with pytest.raises(GgufError, match="not a plain file"):
        read_header(fifo, EVERYTHING)


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(GgufError, match="cannot be read"):
        read_header(tmp_path / "absent.gguf", EVERYTHING)


def test_a_large_vocabulary_header_reads_in_linear_time(tmp_path: Path) -> None:
    """500,000 strings (a large vocabulary and its merges) are skipped well under a second or two."""
    count = 500_000
    strings = b"".join(text(f"t{i}") for i in range(count))
    data = head(2) + text("tokenizer.ggml.tokens") + u32(9) + u32(8) + u64(count) + strings
    data += text("llama.block_count") + u32(4) + u32(7)
    started = time.perf_counter()
    values = read_header(file(tmp_path, data), lambda key: key.startswith("llama.")).values
    assert values == {"llama.block_count": 7}
    assert time.perf_counter() - started < 5.0


def test_a_file_that_shrinks_while_it_is_read_is_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    with open(path, "rb") as opened:
        cursor = reader._Reader(opened)  # sized as it was when opened
        os.truncate(path, 40)
        with pytest.raises(GgufError, match="ends inside its header"):
            cursor.header(EVERYTHING)
