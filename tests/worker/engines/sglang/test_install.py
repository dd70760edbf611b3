"""SGLang's installer through the generic seam (`provision.engine_install.ensure_engine`): a venv in
the app's engines folder, real pip from a folder of wheels (a tiny `sglang` wheel), the marker
written only after pip's result is checked; refusals before anything is made."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.wheels import write_wheel
from worker.contract.events import DownloadProgress
from worker.engines.installing import InstallPlace, InstallRequest
from worker.engines.sglang import RELEASES
from worker.engines.sglang.install import TORCH_INDEX, install_steps, venv_place
from worker.provision.engine_install import ensure_engine
from worker.provision.errors import ProvisionError
from worker.system.config import Paths


def sglang_wheel(folder: Path, version: str) -> Path:
    return write_wheel(folder, "sglang", version, {"sglang/__init__.py": f"__version__ = {version!r}\n"})


async def test_a_venv_from_a_wheel_folder_whose_python_imports_sglang(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    sglang_wheel(wheels, "0.5.23")
    paths = Paths.under(tmp_path / "app")
    progress: list[DownloadProgress] = []
    found = await ensure_engine("sglang", "0.5.23", paths, progress.append, find_links=str(wheels), use_wsl=False,
                                python=sys.executable, accelerator="cuda", cuda_driver=(13, 0), runtime="native")
    assert found.location == paths.engines_dir / "sglang-0.5.23" and found.version == "0.5.23"
    answer = await asyncio.to_thread(subprocess.run, [*found.executable, "-c", "import sglang; print(sglang.__version__)"],
                                     capture_output=True, text=True, timeout=30, check=True)
    assert answer.stdout.strip() == "0.5.23"
    assert any(p.step == "installing with pip" for p in progress) and progress[-1].finished
    assert {p.what for p in progress} == {"engine sglang 0.5.23"}
    again: list[DownloadProgress] = []
    assert await ensure_engine("sglang", None, paths, again.append, find_links=str(wheels), use_wsl=False,
                               accelerator="cuda", runtime="native") == found
    assert again == []  # found, not installed again


async def test_pip_installing_another_version_leaves_nothing_that_looks_installed(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    sglang_wheel(wheels, "0.5.22")  # the folder has no 0.5.23: pip fails
    paths = Paths.under(tmp_path / "app")
    with pytest.raises(ProvisionError) as failure:
        await ensure_engine("sglang", "0.5.23", paths, lambda _: None, find_links=str(wheels), use_wsl=False,
                            python=sys.executable, accelerator="cuda", runtime="native")
    assert "Installing SGLang 0.5.23" in failure.value.problem.message
    assert not (paths.engines_dir / "sglang-0.5.23" / ".gpu-provider-installed").exists()


@pytest.mark.parametrize(("accelerator", "driver", "words"), [
    ("cuda", (12, 8), "supports CUDA 12.8; SGLang 0.5.23 needs a driver for CUDA 13"),
    ("cpu", None, "SGLang runs only on NVIDIA graphics cards"),
])
async def test_refused_before_anything_is_made(tmp_path: Path, accelerator: str, driver: tuple[int, int] | None,
                                               words: str) -> None:
    paths = Paths.under(tmp_path / "app")
    with pytest.raises(ProvisionError) as failure:
        await ensure_engine("sglang", "0.5.23", paths, lambda _: None, use_wsl=False, python=sys.executable,
                            accelerator=accelerator, cuda_driver=driver, runtime="native")  # type: ignore[arg-type]
    assert words in failure.value.problem.message
    assert not (paths.engines_dir / "sglang-0.5.23").exists()


def request(tmp_path: Path, *, wsl: bool = False, find_links: str | None = None) -> InstallRequest:
    return InstallRequest("0.5.23", RELEASES, InstallPlace(tmp_path, wsl=wsl, wsl_distro="Ubuntu" if wsl else None),
                          lambda _: None, None, None, runtime="native", accelerator="cuda",  # type: ignore[arg-type]
                          find_links=find_links, base_python="/usr/bin/python3")


def test_pip_is_isolated_pins_the_release_and_adds_pytorchs_cuda_13_index(tmp_path: Path) -> None:
    steps = dict(install_steps(venv_place(request(tmp_path), "0.5.23"), "0.5.23", request(tmp_path)))
    pip = steps["installing with pip"]
    assert pip[-1] == "sglang==0.5.23" and "--isolated" in pip
    assert pip[pip.index("--extra-index-url") + 1] == TORCH_INDEX == "https://download.pytorch.org/whl/cu130"
    offline = dict(install_steps(venv_place(request(tmp_path), "0.5.23"), "0.5.23", request(tmp_path, find_links="/w")))
    assert "--no-index" in offline["installing with pip"] and TORCH_INDEX not in offline["installing with pip"]


def test_inside_wsl_every_step_runs_in_the_distro_from_its_home_without_ensurepip(tmp_path: Path) -> None:
    place = venv_place(request(tmp_path, wsl=True), "0.5.23")
    steps = install_steps(place, "0.5.23", request(tmp_path, wsl=True), "/home/u/.cache/gpu-provider/wheels/pip.whl")
    for _, step in steps:
        assert place.command(step)[:6] == ["wsl.exe", "-d", "Ubuntu", "--cd", "~", "-e"]
    by_name = dict(steps)
    assert by_name["creating the virtual environment"][:4] == ["python3", "-m", "venv", "--without-pip"]
    assert by_name["installing pip"][1] == "/home/u/.cache/gpu-provider/wheels/pip.whl/pip"
