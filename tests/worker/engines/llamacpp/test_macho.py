"""The Mach-O reader on synthetic headers: thin and universal files, both load commands that name
a minimum macOS, and input cut short or lying about its sizes read within a fixed bound."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import pytest

from worker.engines.llamacpp import macho
from worker.engines.llamacpp.macho import CPU_ARM64, CPU_X86_64, MachOError, Slice

MH_EXECUTE = 2
LC_SEGMENT_64 = 0x19


def packed(version: tuple[int, int, int]) -> int:
    return version[0] << 16 | version[1] << 8 | version[2]


def thin(cpu: int, *, minos: tuple[int, int, int] | None = None, legacy: tuple[int, int, int] | None = None,
         wide: bool = True, order: str = "<", platform: int = macho.PLATFORM_MACOS) -> bytes:
    """A Mach-O file's header and load commands (a segment, then the version commands asked for)."""
    commands = struct.pack(order + "2I", LC_SEGMENT_64, 72) + bytes(64)
    if minos is not None:
        commands += struct.pack(order + "6I", macho.LC_BUILD_VERSION, 24, platform, packed(minos), packed((26, 0, 0)), 0)
    if legacy is not None:
        commands += struct.pack(order + "4I", macho.LC_VERSION_MIN_MACOSX, 16, packed(legacy), packed((14, 0, 0)))
    count = 1 + (minos is not None) + (legacy is not None)
    magic = 0xFEEDFACF if wide else 0xFEEDFACE
    header = struct.pack(order + "7I", magic, cpu, 0, MH_EXECUTE, count, len(commands), 0)
    return header + (bytes(4) if wide else b"") + commands + b"\x90" * 256


def fat(*slices: bytes, wide: bool = False) -> bytes:
    """A universal file: its header, then each slice at a 4 KiB boundary."""
    entry = ">IIQQII" if wide else ">IIIII"
    offset, table, body = 4096, b"", b""
    for piece in slices:
        cpu = struct.unpack_from("<I", piece, 4)[0]
        fields = (cpu, 0, offset, len(piece), 12) + ((0,) if wide else ())
        table += struct.pack(entry, *fields)
        padded = piece + bytes(-len(piece) % 4096)
        body += padded
        offset += len(padded)
    header = struct.pack(">II", 0xCAFEBABF if wide else 0xCAFEBABE, len(slices)) + table
    return header + bytes(4096 - len(header)) + body


def slices(data: bytes) -> tuple[Slice, ...]:
    return macho.read_slices(io.BytesIO(data))


class Counting(io.BytesIO):
    """A file that counts the bytes read from it."""

    read_bytes = 0

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self.read_bytes += len(data)
        return data


def test_thin_arm64_build_version_gives_its_minimum() -> None:
    assert slices(thin(CPU_ARM64, minos=(26, 0, 0))) == (Slice(CPU_ARM64, (26, 0, 0)),)
    assert slices(thin(CPU_ARM64, minos=(13, 3, 0))) == (Slice(CPU_ARM64, (13, 3, 0)),)


def test_older_files_name_their_minimum_with_version_min_in_either_byte_order() -> None:
    assert slices(thin(CPU_X86_64, legacy=(10, 15, 0), wide=False, order=">")) == (Slice(CPU_X86_64, (10, 15, 0)),)
    assert slices(thin(CPU_X86_64, legacy=(11, 0, 0), minos=(13, 3, 0))) == (Slice(CPU_X86_64, (13, 3, 0)),)


def test_a_file_that_names_no_minimum_or_another_platforms_has_none() -> None:
    assert slices(thin(CPU_ARM64)) == (Slice(CPU_ARM64, None),)
    assert slices(thin(CPU_ARM64, minos=(17, 0, 0), platform=2)) == (Slice(CPU_ARM64, None),)  # iOS


@pytest.mark.parametrize("wide", [False, True])
def test_universal_file_gives_each_architecture_its_own_minimum(wide: bool) -> None:
    data = fat(thin(CPU_X86_64, minos=(13, 3, 0)), thin(CPU_ARM64, minos=(26, 0, 0)), wide=wide)
    assert slices(data) == (Slice(CPU_X86_64, (13, 3, 0)), Slice(CPU_ARM64, (26, 0, 0)))


def test_a_builds_requirement_is_its_highest_minimum_for_this_architecture(tmp_path: Path) -> None:
    (tmp_path / "llama-server").write_bytes(thin(CPU_ARM64, minos=(13, 3, 0)))
    (tmp_path / "libggml-metal.dylib").write_bytes(fat(thin(CPU_X86_64, minos=(15, 0, 0)),
                                                       thin(CPU_ARM64, minos=(26, 0, 0))))
    (tmp_path / "libggml.dylib").symlink_to("libggml-metal.dylib")
    (tmp_path / "LICENSE").write_text("MIT")
    files = sorted(tmp_path.iterdir())

    assert macho.build_requirement(files, CPU_ARM64) == macho.Requirement((26, 0, 0), tmp_path / "libggml-metal.dylib")
    assert macho.build_requirement(files, CPU_X86_64) == macho.Requirement((15, 0, 0), tmp_path / "libggml-metal.dylib")
    assert macho.build_requirement([tmp_path / "LICENSE"], CPU_ARM64) is None


@pytest.mark.parametrize("data", [b"", b"\x7fELF\x02\x01\x01" + bytes(64), b"#!/bin/sh\n", b"\xca\xfe",
                                  b"\xca\xfe\xba\xbe\x00\x00\x00\x34" + bytes(64)])  # the last: a Java class
def test_what_is_no_mach_o_has_no_slices(data: bytes) -> None:
    assert slices(data) == ()


@pytest.mark.parametrize("data", [thin(CPU_ARM64, minos=(26, 0, 0)),
                                  fat(thin(CPU_X86_64, minos=(13, 3, 0)), thin(CPU_ARM64, minos=(26, 0, 0)))])
def test_every_cut_of_a_file_is_read_or_refused_cleanly(data: bytes) -> None:
    """Cut anywhere, a file is either no Mach-O (too short to say), read whole, or `MachOError`."""
    for length in range(len(data)):
        try:
            slices(data[:length])
        except MachOError:
            continue


def test_claimed_sizes_never_make_it_read_more_than_the_bound() -> None:
    huge_commands = bytearray(thin(CPU_ARM64, minos=(26, 0, 0)))
    struct.pack_into("<I", huge_commands, 20, 0xFFFFFFFF)  # sizeofcmds
    many_commands = bytearray(thin(CPU_ARM64, minos=(26, 0, 0)))
    struct.pack_into("<I", many_commands, 16, 0xFFFFFFFF)  # ncmds
    far_slice = bytearray(fat(thin(CPU_ARM64)))
    struct.pack_into(">I", far_slice, 16, 0xFFFFFFF0)  # the slice's offset
    zero_sized = bytearray(thin(CPU_ARM64, minos=(26, 0, 0)))
    struct.pack_into("<I", zero_sized, 32 + 4, 0)  # the first command's cmdsize
    big_file = bytes(huge_commands) + bytes(8 << 20)

    for data in (big_file, bytes(many_commands), bytes(far_slice), bytes(zero_sized)):
        file = Counting(data)
        with pytest.raises(MachOError):
            macho.read_slices(file)
        assert file.read_bytes <= 4096  # the file holds 8 MiB past its header, or claims 4 GiB


def test_a_universal_file_claiming_many_slices_is_not_read() -> None:
    file = Counting(b"\xca\xfe\xba\xbe" + struct.pack(">I", 0xFFFFFFFF) + bytes(1 << 20))
    assert macho.read_slices(file) == () and file.read_bytes == 8


@pytest.mark.parametrize(("text", "version"), [("15.3.1", (15, 3, 1)), ("26.0", (26, 0, 0)), ("14", (14, 0, 0)),
                                               ("", None), ("15.x", None), ("1.2.3.4", None)])
def test_mac_ver_is_read(text: str, version: tuple[int, int, int] | None) -> None:
    assert macho.parse_version(text) == version


def test_versions_are_named_as_apple_names_them() -> None:
    assert [macho.version_name(v) for v in ((26, 0, 0), (13, 3, 0), (15, 3, 1))] == ["26", "13.3", "15.3.1"]
