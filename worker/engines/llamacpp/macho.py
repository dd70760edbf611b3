"""The lowest macOS a Mach-O file says it runs on: its `LC_BUILD_VERSION` minos (or the older
`LC_VERSION_MIN_MACOSX`), per architecture of a fat (universal) file.

Why: llama.cpp's arm64 builds b9428–b10141 were stamped for macOS 26 and do not start on
macOS 15 (dyld refuses them before llama-server prints a word). The installer reads every file of
a macOS build before it is put in place, so a Mac gets plain words instead of an engine that cannot
start; a release-time script reads the pinned tarballs the same way.

Pure and bounded: a header, at most `MAX_SLICES` architectures and `MAX_COMMANDS_BYTES` of load
commands per architecture are read, whatever a file claims; a file cut short or malformed raises
`MachOError`, and one that is no Mach-O gives no slices.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

Version = tuple[int, int, int]

CPU_X86_64 = 0x01000007
CPU_ARM64 = 0x0100000C
MAX_SLICES = 16  # a universal file holds a handful; a Java class (also 0xcafebabe) has 45 or more here
MAX_COMMANDS_BYTES = 1 << 20
LC_VERSION_MIN_MACOSX = 0x24
LC_BUILD_VERSION = 0x32
PLATFORM_MACOS = 1
_FAT = {b"\xca\xfe\xba\xbe": False, b"\xca\xfe\xba\xbf": True}  # magic → 64-bit offsets
# magic as the first four bytes → (byte order, 64-bit header)
_THIN = {b"\xce\xfa\xed\xfe": ("<", False), b"\xcf\xfa\xed\xfe": ("<", True),
         b"\xfe\xed\xfa\xce": (">", False), b"\xfe\xed\xfa\xcf": (">", True)}


class MachOError(ValueError):
    """A file that says it is Mach-O but is cut short or malformed."""


@dataclass(frozen=True)
class Slice:
    """One architecture of a Mach-O file and the lowest macOS it runs on (None: it names none)."""

    cpu_type: int
    minos: Version | None


def read_slices(file: BinaryIO) -> tuple[Slice, ...]:
    """Every architecture in `file` (one for a thin file); () for a file that is no Mach-O."""
    head = file.read(8)
    magic = head[:4]
    if magic in _FAT:
        if len(head) < 8:
            raise MachOError("universal header cut short")
        count = int.from_bytes(head[4:8], "big")
        return () if count > MAX_SLICES else _fat_slices(file, count, _FAT[magic])
    if magic in _THIN:
        return (_thin_slice(file, 0),)
    return ()


def _fat_slices(file: BinaryIO, count: int, wide: bool) -> tuple[Slice, ...]:
    entry = struct.Struct(">IIQQII" if wide else ">IIIII")
    table = _read_exact(file, count * entry.size, "architecture table")
    offsets = [entry.unpack_from(table, i * entry.size)[2] for i in range(count)]
    return tuple(_thin_slice(file, offset) for offset in offsets)


def _thin_slice(file: BinaryIO, offset: int) -> Slice:
    file.seek(offset)
    magic = _read_exact(file, 4, "header")
    if magic not in _THIN:
        raise MachOError(f"no Mach-O header at offset {offset}")
    order, wide = _THIN[magic]
    cpu_type, _, _, ncmds, size, _ = struct.unpack(order + "6I", _read_exact(file, 24, "header"))
    if wide:
        _read_exact(file, 4, "header")
    if size > MAX_COMMANDS_BYTES:
        raise MachOError(f"load commands of {size} bytes claimed")
    return Slice(cpu_type, _minimum(_read_exact(file, size, "load commands"), ncmds, order))


def _minimum(commands: bytes, ncmds: int, order: str) -> Version | None:
    """The highest macOS minimum the load commands name (each command is 8 bytes or more, so this
    walks at most `len(commands) / 8` of them, whatever `ncmds` claims)."""
    found: list[Version] = []
    position = 0
    for _ in range(ncmds):
        if position + 8 > len(commands):
            raise MachOError("load commands cut short")
        cmd, size = struct.unpack_from(order + "2I", commands, position)
        if size < 8 or position + size > len(commands):
            raise MachOError(f"load command of {size} bytes")
        if cmd == LC_BUILD_VERSION and size >= 16:
            platform, minos = struct.unpack_from(order + "2I", commands, position + 8)
            if platform == PLATFORM_MACOS:
                found.append(_version(minos))
        elif cmd == LC_VERSION_MIN_MACOSX and size >= 12:
            found.append(_version(struct.unpack_from(order + "I", commands, position + 8)[0]))
        position += size
    return max(found, default=None)


def _version(packed: int) -> Version:
    """`xxxx.yy.zz` packed in nibbles as Mach-O stores it."""
    return (packed >> 16, (packed >> 8) & 0xFF, packed & 0xFF)


def _read_exact(file: BinaryIO, size: int, what: str) -> bytes:
    data = file.read(size)
    if len(data) != size:
        raise MachOError(f"{what} cut short")
    return data


@dataclass(frozen=True)
class Requirement:
    """The highest macOS minimum among a build's files for one architecture, and the file naming it."""

    minos: Version
    file: Path


def build_requirement(files: Iterable[Path], cpu_type: int) -> Requirement | None:
    """The highest minimum among the `cpu_type` slices of `files` (regular files; links are read
    where they point, among `files` too); None where no file names one."""
    best: Requirement | None = None
    for path in files:
        if path.is_symlink() or not path.is_file():
            continue
        with path.open("rb") as file:
            slices = read_slices(file)
        for piece in slices:
            if piece.cpu_type == cpu_type and piece.minos is not None and (best is None or piece.minos > best.minos):
                best = Requirement(piece.minos, path)
    return best


def parse_version(text: str) -> Version | None:
    """`platform.mac_ver()`'s "15.3.1" → (15, 3, 1); None for anything else."""
    parts = text.split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() and len(p) <= 4 for p in parts):
        return None
    numbers = [int(p) for p in parts] + [0] * (3 - len(parts))
    return (numbers[0], numbers[1], numbers[2])


def version_name(version: Version) -> str:
    """(26, 0, 0) → "26", (13, 3, 0) → "13.3", as Apple names macOS releases."""
    parts = list(version)
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return ".".join(str(p) for p in parts)
