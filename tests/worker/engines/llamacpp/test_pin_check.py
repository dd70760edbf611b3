"""The release-time pin check (`scripts/check_llamacpp_pins.py`), on a recorded-shape release page
and synthetic macOS tarballs: it never runs in the tests with the network."""

from __future__ import annotations

import importlib.util
import io
import tarfile
from pathlib import Path
from types import ModuleType

import pytest

from tests.worker.engines.llamacpp.test_macho import fat, thin
from worker.engines.llamacpp.macho import CPU_ARM64, CPU_X86_64
from worker.engines.llamacpp.releases import SHIPPED, PinnedAsset

SCRIPT = Path(__file__).parents[4] / "scripts" / "check_llamacpp_pins.py"


@pytest.fixture(scope="module")
def pin_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_llamacpp_pins", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def page(pins: dict[str, PinnedAsset]) -> dict[str, object]:
    """GitHub's release JSON as it lists the assets."""
    return {"assets": [{"name": n, "size": p.size_bytes, "digest": f"sha256:{p.sha256}",
                        "browser_download_url": f"https://x/{n}"} for n, p in pins.items()]}


def test_pins_the_release_bears_out_raise_nothing(pin_check: ModuleType) -> None:
    pins = SHIPPED.builds["b10423"]
    assert pin_check.published_problems("b10423", page(dict(pins)), pins) == []


def test_each_pin_the_release_contradicts_is_named(pin_check: ModuleType) -> None:
    pins = SHIPPED.builds["b10423"]
    cuda = "llama-b10423-bin-win-cuda-12.4-x64.zip"
    published = page({**pins, cuda: PinnedAsset("ab" * 32, pins[cuda].size_bytes + 1)})
    published["assets"] = [a for a in published["assets"] if a["name"] != "llama-b10423-bin-macos-x64.tar.gz"]

    assert pin_check.published_problems("b10423", published, pins) == [
        "b10423: llama-b10423-bin-macos-x64.tar.gz is not on the release",
        f"b10423: {cuda} is published with sha256 {'ab' * 32}, pinned {pins[cuda].sha256}",
        f"b10423: {cuda} is published at {pins[cuda].size_bytes + 1} bytes, pinned {pins[cuda].size_bytes}",
    ]


def tarball(tmp_path: Path, files: dict[str, bytes]) -> Path:
    path = tmp_path / "release.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def test_a_macos_tarball_for_a_newer_macos_than_the_app_supports_is_named(pin_check: ModuleType,
                                                                           tmp_path: Path) -> None:
    name = "llama-b10141-bin-macos-arm64.tar.gz"
    built = tarball(tmp_path, {"llama-b10141/llama-server": thin(CPU_ARM64, minos=(26, 0, 0)),
                               "llama-b10141/LICENSE": b"MIT"})

    assert pin_check.macos_problem("b10141", name, built, (12, 0, 0)) == (
        f"b10141: {name} needs macOS 26 (llama-b10141/llama-server); the app supports macOS 12")


def test_a_macos_tarball_is_judged_by_its_own_architecture(pin_check: ModuleType, tmp_path: Path) -> None:
    universal = fat(thin(CPU_X86_64, minos=(13, 3, 0)), thin(CPU_ARM64, minos=(26, 0, 0)))
    built = tarball(tmp_path, {"llama-b1/libggml.dylib": universal})

    assert pin_check.macos_problem("b1", "llama-b1-bin-macos-x64.tar.gz", built, (13, 3, 0)) is None
    assert pin_check.macos_problem("b1", "llama-b1-bin-macos-arm64.tar.gz", built, (13, 3, 0)) is not None
    assert pin_check.macos_problem("b1", "llama-b1-bin-ubuntu-x64.tar.gz", built, (13, 3, 0)) is None


def test_the_oldest_macos_is_the_apps_own(pin_check: ModuleType, tmp_path: Path) -> None:
    spec = tmp_path / "build.spec"
    spec.write_text('info_plist={"LSMinimumSystemVersion": "13.3", "LSUIElement": True}')
    assert pin_check.oldest_macos(spec) == (13, 3, 0)
