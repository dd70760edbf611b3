"""The few facts of a GGUF file's header that llama.cpp's memory rule needs, read with a bound on
everything a hostile file could make grow.

The file comes from a coordinator (a download, or a path it named), so nothing in it is trusted:
only the header is read, never the tensors; every count, string and array is held to a cap before
anything is allocated or skipped for it; the whole header to `MAX_HEADER_BYTES`; and every value
is skipped unless its key is one that is kept. The work is linear in the header's size and a
malformed header is a `GgufError` with a plain reason, never a crash. Layout: GGUF v2/v3,
little-endian (`ggml/include/gguf.h`): magic, version u32, tensor count u64, key-value count u64,
then each pair as key (u64 length + bytes), value type u32, value (an array: element type u32,
count u64, elements).
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Union

from worker.engines.allowlist import shown

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_PAIRS = 65_536  # real models carry a few dozen
MAX_KEY_BYTES = 65_535  # gguf.h: a key is at most 65535 bytes
MAX_STRING_BYTES = 16 * 2**20  # the largest string value (a chat template is tens of kB)
MAX_ARRAY_LENGTH = 16 * 2**20  # the largest array (a vocabulary of 262,144 tokens, its merges)
MAX_KEPT_ARRAY = 4096  # an array kept as a value (one number per layer)
MAX_HEADER_BYTES = 256 * 2**20  # the header of a 262k-token vocabulary is about 20 MiB
CHUNK = 2**20

_STRING, _ARRAY = 8, 9
# Fixed-size value types: struct format (little-endian) by GGUF type number.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_INTEGERS = frozenset({0, 1, 2, 3, 4, 5, 10, 11})

Value = Union[int, float, bool, str, tuple[int, ...]]


class GgufError(ValueError):
    """The file is not a GGUF header this app reads; the message says why, in plain words."""


@dataclass(frozen=True)
class Header:
    """The kept key-value pairs: numbers, strings, and lists of at most `MAX_KEPT_ARRAY` whole
    numbers (any other array is skipped as if it were not kept)."""

    version: int
    values: dict[str, Value]


def read_header(path: str | Path, keep: Callable[[str], bool]) -> Header:
    """The header of the GGUF file at `path` with the values of the keys `keep` accepts; raises
    `GgufError` (a file that cannot be opened or read too)."""
    try:
        # Non-blocking, so a FIFO put where the model was cannot hang the open; then only a plain file.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise GgufError("the model is not a plain file")
            return _Reader(file).header(keep)
    except OSError as exc:
        raise GgufError(f"the model file cannot be read ({exc.strerror or type(exc).__name__})") from None


class _Reader:
    """A forward-only cursor over the header, reading in chunks and never past `MAX_HEADER_BYTES`."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._size = os.fstat(file.fileno()).st_size
        self._buffer = b""
        self._start = 0  # the file offset of the buffer's first byte
        self._at = 0  # the next byte, within the buffer

    def header(self, keep: Callable[[str], bool]) -> Header:
        if self._take(4) != MAGIC:
            raise GgufError("the model file does not start with the GGUF magic")
        version = self._uint(4)
        if version not in VERSIONS:
            raise GgufError(f"GGUF version {version} is not one this app reads ({' or '.join(map(str, VERSIONS))})")
        self._uint(10)  # tensor count: the tensors are never read
        pairs = self._uint(10)
        if pairs > MAX_PAIRS:
            raise GgufError(f"the model file claims {pairs:,} metadata entries, more than {MAX_PAIRS:,}")
        values: dict[str, Value] = {}
        for _ in range(pairs):
            key = self._string(MAX_KEY_BYTES, "a metadata key")
            kind = self._uint(4)
            if not keep(key):
                self._skip_value(kind)
            elif (value := self._value(kind, key)) is not None:
                values[key] = value
        return Header(version, values)

    def _value(self, kind: int, key: str) -> Value | None:
        """A kept key's value; None (skipped) for an array that is not a short list of whole numbers."""
        if kind in _SCALARS:
            return self._scalar(kind)
        if kind == _STRING:
            return self._string(MAX_STRING_BYTES, f"the value of {shown(key)}")
        if kind == _ARRAY:
            element, length = self._uint(4), self._length(MAX_ARRAY_LENGTH, "an array")
            if element in _INTEGERS and length <= MAX_KEPT_ARRAY:
                return tuple(self._uint(element) for _ in range(length))
            self._skip_elements(element, length)
            return None
        raise GgufError(f"{shown(key)} is of an unknown type ({kind})")

    def _skip_value(self, kind: int) -> None:
        if kind in _SCALARS:
            self._skip(struct.calcsize(_SCALARS[kind]))
        elif kind == _STRING:
            self._skip(self._length(MAX_STRING_BYTES, "a string value"))
        elif kind == _ARRAY:
            self._skip_elements(self._uint(4), self._length(MAX_ARRAY_LENGTH, "an array"))
        else:
            raise GgufError(f"a metadata value is of an unknown type ({kind})")

    def _skip_elements(self, element: int, length: int) -> None:
        if element in _SCALARS:
            self._skip(length * struct.calcsize(_SCALARS[element]))
        elif element == _STRING:
            for _ in range(length):
                self._skip(self._length(MAX_STRING_BYTES, "a string in an array"))
        else:
            raise GgufError(f"an array holds values of type {element}, which GGUF arrays may not")

    def _scalar(self, kind: int) -> int | float:
        form = _SCALARS[kind]
        (value,) = struct.unpack(form, self._take(struct.calcsize(form)))
        return value if isinstance(value, (int, float)) else int(value)

    def _uint(self, kind: int) -> int:
        """A whole number of an integer type (a count, a type tag, a kept list's element)."""
        return int(self._scalar(kind))

    def _length(self, cap: int, what: str) -> int:
        length = self._uint(10)
        if length > cap:
            raise GgufError(f"{what} in the model file's header is {length:,} long, more than {cap:,}")
        return length

    def _string(self, cap: int, what: str) -> str:
        raw = self._take(self._length(cap, what))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GgufError(f"{what} in the model file's header is not UTF-8 text") from None

    def _take(self, count: int) -> bytes:
        self._fill(count)
        piece = self._buffer[self._at : self._at + count]
        self._at += count
        return piece

    def _skip(self, count: int) -> None:
        self._bound(count)
        if count <= len(self._buffer) - self._at:
            self._at += count
            return
        self._start += self._at + count
        self._buffer, self._at = b"", 0
        self._file.seek(self._start)

    def _fill(self, count: int) -> None:
        self._bound(count)
        if len(self._buffer) - self._at >= count:
            return
        rest = self._buffer[self._at :]
        self._start += self._at
        self._buffer, self._at = rest + self._file.read(max(CHUNK, count - len(rest))), 0
        if len(self._buffer) < count:  # the file shrank while it was read
            raise GgufError("the model file ends inside its header")

    def _bound(self, count: int) -> None:
        """Refuses a step past the end of the file or past `MAX_HEADER_BYTES`."""
        end = self._start + self._at + count
        if end > self._size:
            raise GgufError("the model file ends inside its header")
        if end > MAX_HEADER_BYTES:
            raise GgufError(f"the model file's header is larger than {MAX_HEADER_BYTES // 2**20} MiB")
