"""What an engine install needs from the machine (the accelerator, the driver's CUDA version) and
what its process needs (the loader path to the libraries shipped beside it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.hardware import Gpu, Machine
from worker.engines import get_adapter
from worker.provision.engine_install import accelerator_of, cuda_version, in_wsl, library_env

CARD = Gpu(index=0, uuid="GPU-0", name="NVIDIA GeForce RTX 4090", memory_total_mib=24564, memory_free_mib=23000,
           usable_mib=20188)


def machine(runtime: str, gpus: tuple[Gpu, ...] = ()) -> Machine:
    return Machine(os="linux", runtime=runtime, arch="x86_64", cpu_model="cpu", cpu_cores=8, ram_mib=65536, gpus=gpus)


@pytest.mark.parametrize(("runtime", "gpus", "expected"), [
    ("apple-silicon", (), "metal"),
    ("native", (CARD,), "cuda"),
    ("wsl2", (CARD,), "cuda"),
    ("cpu", (), "cpu"),
])
def test_accelerator_of_the_machine(runtime: str, gpus: tuple[Gpu, ...], expected: str) -> None:
    assert accelerator_of(machine(runtime, gpus)) == expected


@pytest.mark.parametrize(
    ("text", "expected"), [("12.8", (12, 8)), ("13.0", (13, 0)), ("12", (12, 0)), (None, None), ("", None), ("x.1", None)]
)
def test_cuda_version(text: str | None, expected: tuple[int, int] | None) -> None:
    assert cuda_version(text) == expected


def test_library_env_only_for_a_folder_with_shared_libraries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/existing")
    assert library_env(tmp_path) == {}
    (tmp_path / "libggml-base.so.0").write_bytes(b"")
    assert library_env(tmp_path) == {"LD_LIBRARY_PATH": f"{tmp_path}:/opt/existing"}
    monkeypatch.delenv("LD_LIBRARY_PATH")
    assert library_env(tmp_path) == {"LD_LIBRARY_PATH": str(tmp_path)}


@pytest.mark.parametrize(("engine", "system", "wsl"), [
    ("vllm", "windows", True),  # Linux only: inside WSL2 on Windows (its CPU build on a CPU-only PC too)
    ("sglang", "windows", True),
    ("llamacpp", "windows", False),  # a Windows build of its own
    ("vllm", "linux", False),
    ("llamacpp", "macos", False),
])
def test_an_engine_that_does_not_run_on_windows_installs_inside_wsl2_there(engine: str, system: str, wsl: bool) -> None:
    assert in_wsl(get_adapter(engine).RUNTIMES, system) is wsl
