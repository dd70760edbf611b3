from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest

from tests.support.wheels import fake_vllm_wheel
from worker.system.config import Paths
from worker.contract.events import DownloadProgress
from worker.engines.installing import EngineInstall, InstallError
from worker.engines.venv import VenvPlace, child_env, pip_step
from worker.engines.vllm.install import MARKER, host_place, pip_install_argv, venv_place
from worker.provision.engine_install import ensure_engine, remove_unused, wsl_place
from worker.provision.errors import ProvisionError


@pytest.mark.integration
async def test_vllm_venv_from_a_wheel_folder_gives_a_working_executable(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    fake_vllm_wheel(wheels, "0.33.0")
    fake_vllm_wheel(wheels, "0.30.0")
    paths = Paths.under(tmp_path / "app")
    progress: list[DownloadProgress] = []

    install = await ensure_engine(
        "vllm", "0.33.0", paths, progress.append, find_links=str(wheels), use_wsl=False, python=sys.executable
    )

    assert install.location == paths.engines_dir / "vllm-0.33.0"
    assert install.version == "0.33.0"
    answer = await asyncio.to_thread(
        subprocess.run,
        [*install.executable, "--version"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert answer.stdout.strip() == "0.33.0"
    assert any(p.step == "installing with pip" for p in progress)
    assert {p.what for p in progress} == {"engine vllm 0.33.0"}  # one row that says what it is doing
    assert progress[-1].finished

    again: list[DownloadProgress] = []
    assert (
        await ensure_engine("vllm", None, paths, again.append, find_links=str(wheels), use_wsl=False)
        == install
    )
    assert again == []


async def test_several_versions_coexist_and_unused_ones_are_removed(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path)
    for name in ("vllm-0.30.0", "vllm-0.33.0", "llamacpp-b6500", "llamacpp-b6600.partial", "notes"):
        (paths.engines_dir / name).mkdir(parents=True)
    (paths.engines_dir / "vllm-0.30.0" / MARKER).write_text("0.30.0")
    keep = EngineInstall(("vllm",), "0.30.0", paths.engines_dir / "vllm-0.30.0")

    removed = await remove_unused(paths, [keep])

    assert [p.name for p in removed] == ["llamacpp-b6500", "llamacpp-b6600.partial", "vllm-0.33.0"]
    assert sorted(p.name for p in paths.engines_dir.iterdir()) == ["notes", "vllm-0.30.0"]


async def test_failed_install_says_what_happened_and_leaves_nothing_installed(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path / "app")
    progress: list[DownloadProgress] = []

    with pytest.raises(ProvisionError) as failure:
        await ensure_engine(
            "vllm", "0.33.0", paths, progress.append, use_wsl=False, python=str(tmp_path / "no-python")
        )

    assert "Installing vLLM 0.33.0" in failure.value.problem.message
    assert "no-python" in failure.value.problem.message
    assert not (paths.engines_dir / "vllm-0.33.0" / MARKER).exists()
    assert progress[-1].error is not None


async def test_version_that_is_not_a_version_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ProvisionError):
        await ensure_engine("vllm", "../../etc", Paths.under(tmp_path), lambda _: None, use_wsl=False)


def test_pip_is_isolated_and_pins_the_version_with_the_cuda_torch_index(tmp_path: Path) -> None:
    argv = pip_install_argv(host_place(tmp_path, "0.33.0", "/usr/bin/python3"), "0.33.0", cuda_driver=(12, 4))

    assert argv[0] == str(tmp_path / "vllm-0.33.0" / "bin" / "python")
    assert "--isolated" in argv and argv[-1] == "vllm==0.33.0"
    assert argv[argv.index("--extra-index-url") + 1] == "https://download.pytorch.org/whl/cu129"


def test_offline_wheel_folder_uses_no_index(tmp_path: Path) -> None:
    argv = pip_install_argv(host_place(tmp_path, "1.0", "py"), "1.0", find_links="/wheels")

    assert argv[argv.index("--find-links") + 1] == "/wheels" and "--no-index" in argv


def test_driver_older_than_cuda_12_is_refused_with_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(InstallError) as failure:
        pip_install_argv(host_place(tmp_path, "0.33.0", "py"), "0.33.0", cuda_driver=(11, 8))

    assert "Update the NVIDIA driver" in failure.value.problem.message


def test_wsl_commands_run_inside_the_distro_from_its_home() -> None:
    place = venv_place(wsl_place("vLLM", "Ubuntu", which=lambda _: "C:/Windows/System32/wsl.exe"), "0.33.0")

    assert place.command([place.in_venv("vllm"), "serve"]) == [
        "wsl.exe",
        "-d",
        "Ubuntu",
        "--cd",
        "~",
        "-e",
        ".local/share/gpu-provider/engines/vllm-0.33.0/bin/vllm",
        "serve",
    ]
    assert place.folder == PurePosixPath(".local/share/gpu-provider/engines/vllm-0.33.0")


def test_wsl_default_distro_is_left_to_wsl() -> None:
    place = VenvPlace(PurePosixPath("v"), "python3", wsl=True)

    assert place.command(["python3", "-V"]) == ["wsl.exe", "--cd", "~", "-e", "python3", "-V"]


@pytest.mark.parametrize(("distro", "wsl_exe"), [("Ubuntu", None), (None, "C:/Windows/System32/wsl.exe")])
def test_missing_wsl_or_distribution_guides_the_person_to_install_it(distro: str | None, wsl_exe: str | None) -> None:
    with pytest.raises(ProvisionError) as failure:
        wsl_place("vLLM", distro, which=lambda _: wsl_exe)

    assert "wsl --install" in failure.value.problem.message and failure.value.problem.title == "vLLM needs WSL2"


@pytest.mark.parametrize(
    ("line", "step"),
    [
        ("Collecting torch==2.14.0", "collecting torch==2.14.0"),
        (
            "  Downloading torch-2.14.0-cp311-manylinux.whl (900.1 MB)",
            "downloading torch-2.14.0-cp311-manylinux.whl",
        ),
        ("Processing /tmp/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
         "processing torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"),
        ("Installing collected packages: a, b, vllm", "installing 3 packages"),
        ("Successfully installed vllm-0.33.0", "installed"),
        ("Requirement already satisfied: pip", None),
    ],
)
def test_pip_output_becomes_short_steps(line: str, step: str | None) -> None:
    assert pip_step(line) == step


def test_child_environment_keeps_the_token_and_user_python_settings_out() -> None:
    env = child_env(
        {"PATH": "/bin", "GPU_PROVIDER_TOKEN": "secret", "PYTHONPATH": "/home/u/lib", "PIP_INDEX_URL": "x"}
    )

    assert env["PATH"] == "/bin" and env["PYTHONNOUSERSITE"] == "1"
    assert "GPU_PROVIDER_TOKEN" not in env and "PYTHONPATH" not in env and "PIP_INDEX_URL" not in env
