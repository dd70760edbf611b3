"""SGLang into a virtual environment the app owns, in the place it is given (`installing.InstallPlace`):
this machine, or inside WSL2 on Windows.

The same steps as vLLM's GPU build (`vllm/install.py`, whose venv place, child runner and progress
reporting this reuses): every step a child process with an argument list run through the place,
pip isolated from the user's configuration, a marker written only once pip's result is checked, so
an interrupted install never looks finished. SGLang 0.5.23's wheel pins `torch==2.14.1` and CUDA 13
kernels (`flashinfer_python[cu13]`, `sglang-kernel`), so PyTorch's CUDA 13.0 index is added, and a
driver older than CUDA 13 is refused with a message to update it. The venv's Python is what the
adapter starts, running the app's launcher.
"""

from __future__ import annotations

import sys
from pathlib import Path

from worker.contract.events import Problem
from worker.engines.installing import MARKER, EngineInstall, InstallError, InstallRequest, newest_installed, none_shipped
from worker.engines.venv import StepReporter, VenvPlace, create_steps, pip_step, pip_wheel_inside, run_logged

CUDA_TAG = "cu130"
TORCH_INDEX = f"https://download.pytorch.org/whl/{CUDA_TAG}"
MIN_DRIVER_CUDA = (13, 0)

# Run with the venv's python: exit 0 when the marker names `version` and SGLang's metadata agrees.
_PROBE = """
import importlib.metadata, pathlib, sys
folder, version, marker = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
ok = (folder / marker).is_file() and (folder / marker).read_text().strip() == version
sys.exit(0 if ok and importlib.metadata.version("sglang") == version else 1)
"""
# Run with the venv's python after pip: check what pip installed, then write the marker.
_SEAL = """
import importlib.metadata, pathlib, sys
folder, version, marker = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
found = importlib.metadata.version("sglang")
if found != version:
    sys.exit(f"pip installed sglang {found}, not {version}")
(folder / marker).write_text(version)
"""
_REMOVE = "import shutil, sys; shutil.rmtree(sys.argv[1], ignore_errors=True)"


def venv_place(request: InstallRequest, version: str) -> VenvPlace:
    """The venv of `version` in the request's place, made from its Python here (python3 inside WSL2)."""
    folder = request.place.folder("sglang", version)
    if request.place.wsl:
        return VenvPlace(folder, "python3", wsl=True, wsl_distro=request.place.wsl_distro)
    return VenvPlace(folder, request.base_python or sys.executable)


def install_steps(place: VenvPlace, version: str, request: InstallRequest,
                  pip_wheel: str | None = None) -> list[tuple[str, list[str]]]:
    """(what it is doing, argv) for a fresh install, the unfinished one removed first (`pip_wheel`:
    inside WSL2, the Linux path of the pip wheel the venv gets pip from)."""
    pip = [place.in_venv("python"), "-m", "pip", "install", "--isolated", "--progress-bar", "off"]
    if request.find_links is not None:
        pip += ["--no-index", "--find-links", request.find_links]
    else:
        pip += [*(["--index-url", request.index_url] if request.index_url else []), "--extra-index-url", TORCH_INDEX]
    return [
        ("removing an unfinished install", [place.base_python, "-c", _REMOVE, str(place.folder)]),
        *create_steps(place, pip_wheel),
        ("installing with pip", [*pip, f"sglang=={version}"]),
        ("checking the install", [place.in_venv("python"), "-c", _SEAL, str(place.folder), version, MARKER]),
    ]


def request_problem(request: InstallRequest, version: str) -> Problem | None:
    """Why SGLang cannot be installed for this request: not a release for the runtime, no NVIDIA
    card, or a driver older than CUDA 13."""
    if request.runtime is not None and (problem := request.releases.runtime_problem(version, request.runtime)):
        return Problem("SGLang does not run here", problem)
    if request.accelerator != "cuda":
        return Problem("SGLang needs an NVIDIA graphics card",
                       "SGLang runs only on NVIDIA graphics cards; this computer has none it can use.")
    if request.cuda_driver is not None and request.cuda_driver < MIN_DRIVER_CUDA:
        major, minor = request.cuda_driver
        return Problem("NVIDIA driver too old for SGLang",
                       f"The installed NVIDIA driver supports CUDA {major}.{minor}; SGLang {version} needs a driver "
                       "for CUDA 13 or newer. Update the NVIDIA driver, then resume the app.")
    return None


async def is_installed(place: VenvPlace, version: str) -> bool:
    argv = place.command([place.in_venv("python"), "-c", _PROBE, str(place.folder), version, MARKER])
    try:
        rc, _ = await run_logged(argv, lambda _: None)
    except OSError:
        return False
    return rc == 0


async def install(request: InstallRequest) -> EngineInstall:
    """The release asked for (else the newest installed here, else the default), found in the
    request's place or installed there; its venv's Python is what starts SGLang."""
    version = _version(request)
    place = venv_place(request, version)
    if not await is_installed(place, version):
        if (problem := request_problem(request, version)) is not None:
            raise InstallError(problem)
        await _install(place, version, request)
    if place.wsl:  # the Linux argv from the user's home; the supervisor runs it through `wsl.command`
        return EngineInstall((place.in_venv("python"),), version, place.folder, in_wsl=True,
                             wsl_distro=place.wsl_distro)
    return EngineInstall((place.in_venv("python"),), version, place.folder)


def _version(request: InstallRequest) -> str:
    releases = request.releases
    listed = releases.versions(request.runtime)
    if request.version is not None:
        return releases.normalise(request.version)
    installed = None if request.place.wsl else newest_installed(
        Path(request.place.engines_dir), "sglang", listed, lambda folder: (folder / MARKER).is_file())
    if installed is None and not listed:
        raise InstallError(none_shipped("SGLang"))
    return installed or listed[0]


async def _install(place: VenvPlace, version: str, request: InstallRequest) -> None:
    reporter = StepReporter(f"engine sglang {version}", request.on_progress)
    pip_wheel = await pip_wheel_inside(request) if place.wsl else None
    for description, argv in install_steps(place, version, request, pip_wheel):
        reporter.step(description, force=True)
        try:
            rc, tail = await run_logged(place.command(argv), lambda line: _pip_progress(reporter, line))
        except OSError as exc:
            rc, tail = -1, [str(exc)]
        if rc != 0:
            message = (f"Installing SGLang {version} into {place.folder} failed (exit {rc}). The last lines were:\n"
                       + "\n".join(tail)
                       + "\nCheck the network connection and free disk space, then resume the app to try again.")
            reporter.fail(message)
            raise InstallError(Problem(f"Could not install SGLang {version}", message, action="check_network"))
    reporter.finish()


def _pip_progress(reporter: StepReporter, line: str) -> None:
    if (step := pip_step(line)) is not None:
        reporter.step(step)
