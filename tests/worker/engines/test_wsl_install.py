"""An engine installed into a WSL2 distribution and found there again, run against the fake
`wsl.exe` (real Linux namespaces, stock Ubuntu's python3 without ensurepip, no sudo): every step
through `wsl.exe -e`, the venv made without pip and pip put in from a wheel, nothing outside the
distribution's own home touched, and the model copied onto the distribution's disk once."""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import platform
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest

from tests.support.fake_wsl import TOOLS, FakeDistro, FakeWsl, install_fake_wsl
from tests.support.wheels import fake_vllm_wheel
from tests.worker.engines.test_vllm_cpu import assign
from tests.worker.hardware.recorded import NVML_FIXTURES, replay
from worker.contract import protocol
from worker.contract.events import DownloadProgress
from worker.engines import registry
from worker.engines.finding import Finder, find_engines, run_for_version
from worker.engines.installing import InstallPlace, InstallRequest
from worker.engines.venv import PIP, pip_wheel_inside
from worker.engines.vllm.releases import SHIPPED, VllmReleases
from worker.hardware import IN_WSL, EngineInstall, detect, load_reading
from worker.plan.planner import Plan, plan
from worker.provision import assignment
from worker.provision.engine_install import ensure_engine
from worker.provision.errors import ProvisionError
from worker.provision.models import ensure_model
from worker.system import children, wsl
from worker.system.config import Paths, Settings

pytestmark = pytest.mark.integration

HOME = PurePosixPath("/home/lender")


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeWsl]:
    """Ubuntu (default) and a version-1 distribution; the test's own folders hidden inside."""
    installed = install_fake_wsl(tmp_path / "bin", [FakeDistro("Ubuntu", default=True),
                                                    FakeDistro("Legacy", version=1)], hide=[tmp_path, TOOLS])
    monkeypatch.setenv("PATH", installed.environment()["PATH"])
    monkeypatch.delenv("WSL_UTF8", raising=False)
    monkeypatch.delenv("WSLENV", raising=False)
    yield installed
    installed.kill_all()


def pip_wheel(folder: Path) -> Path:
    """A wheel of the pip this test runs with (the version `PIP` pins), from its installed files."""
    dist = importlib.metadata.distribution("pip")
    assert dist.version == PIP.version, "the pinned pip and the test venv's differ: rebuild the pin"
    wheel = folder / PIP.filename
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as out:
        for file in dist.files or ():
            path = Path(str(dist.locate_file(file)))
            if path.is_file() and not str(file).startswith("..") and "__pycache__" not in str(file):
                out.write(path, str(file))
    return wheel


def test_the_listing_finds_the_default_version_2_distribution(fake: FakeWsl) -> None:
    assert [d.name for d in wsl.list_distros()] == ["Ubuntu"]


async def test_vllm_installs_inside_wsl_without_sudo_or_ensurepip_and_is_found_again(
    fake: FakeWsl, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheels = fake.home("Ubuntu") / "wheels"
    fake_vllm_wheel(wheels, "0.33.0")
    pip_wheel(wheels)
    started: list[list[str]] = []
    real_start = children.start

    async def recorded(argv, **options):  # type: ignore[no-untyped-def]
        started.append(list(argv))
        return await real_start(argv, **options)

    monkeypatch.setattr(children, "start", recorded)
    progress: list[DownloadProgress] = []
    paths = Paths.under(tmp_path / "app")
    install = await ensure_engine("vllm", "0.33.0", paths, progress.append, runtime="wsl2", accelerator="cuda",
                                  machine_os="windows", wsl_distro="Ubuntu", find_links=str(HOME / "wheels"))

    assert install.in_wsl and install.wsl_distro == "Ubuntu"
    assert install.executable == (".local/share/gpu-provider/engines/vllm-0.33.0/bin/vllm",)
    assert (fake.home("Ubuntu") / install.executable[0]).is_file()
    assert not paths.engines_dir.exists()  # nothing on the Windows side
    assert started and all(argv[:6] == ["wsl.exe", "-d", "Ubuntu", "--cd", "~", "-e"] for argv in started)
    assert not any("sudo" in argv for argv in started)
    assert any(argv[6:10] == ["python3", "-m", "venv", "--without-pip"] for argv in started)
    assert "installing pip" in [event.step for event in progress]

    found = find_engines("Windows", {}, run_for_version, wsl_distro="Ubuntu")
    assert (found["vllm"].version, found["vllm"].path) == ("0.33.0", IN_WSL)
    runs = wsl.ask([*install.executable, "--version"], distro="Ubuntu")
    assert runs.strip() == "0.33.0"

    started.clear()  # a second ensure finds it: one probe, nothing installed again
    again = await ensure_engine("vllm", "0.33.0", paths, progress.append, runtime="wsl2", accelerator="cuda",
                                machine_os="windows", wsl_distro="Ubuntu", find_links=str(HOME / "wheels"))
    assert again == install and len(started) == 1


async def test_an_unfinished_install_inside_is_not_found(fake: FakeWsl) -> None:
    folder = fake.home("Ubuntu") / ".local/share/gpu-provider/engines/vllm-0.33.0"
    folder.mkdir(parents=True)
    assert find_engines("Windows", {}, run_for_version, wsl_distro="Ubuntu")["vllm"].version is None
    (folder / ".gpu-provider-installed").write_text("0.33.0")
    assert find_engines("Windows", {}, run_for_version, wsl_distro="Ubuntu")["vllm"].version == "0.33.0"


async def test_the_pip_wheel_is_downloaded_into_the_distributions_own_cache(fake: FakeWsl, tmp_path: Path) -> None:
    """The app's downloader writes it through the Windows path of the folder inside (`wslpath -w`)."""
    source = pip_wheel(tmp_path / "served")
    fetched: list[tuple[str, Path, str]] = []

    async def fetch(url, destination, *, what, sha256, max_bytes, size_said):  # type: ignore[no-untyped-def]
        fetched.append((url, destination, sha256))
        shutil.copyfile(source, destination)
        return destination

    request = InstallRequest("0.33.0", SHIPPED, InstallPlace(PurePosixPath(".local/x"), wsl=True, wsl_distro="Ubuntu"),
                             lambda _: None, None, fetch)  # type: ignore[arg-type]
    linux = await pip_wheel_inside(request)
    assert linux == f"{HOME}/.cache/gpu-provider/wheels/{PIP.filename}"
    ((url, destination, sha256),) = fetched
    assert (url, sha256) == (PIP.url, PIP.sha256)
    assert destination == fake.home("Ubuntu") / ".cache/gpu-provider/wheels" / PIP.filename
    assert fake.linux_path_on_host("Ubuntu", linux).is_file()


async def test_a_local_model_is_copied_onto_the_distributions_disk_once(fake: FakeWsl, tmp_path: Path) -> None:
    model = tmp_path / "my-model"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "sub" / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    engine_model = protocol.EngineModel(source=str(model), weights_mib=1)
    progress: list[DownloadProgress] = []
    settings = Settings()
    paths = Paths.under(tmp_path / "app")

    linux = await ensure_model(engine_model, "vllm", paths, settings, progress.append, wsl_distro="Ubuntu")
    assert isinstance(linux, PurePosixPath) and str(linux).startswith(f"{HOME}/.cache/gpu-provider/models/")
    copied = fake.linux_path_on_host("Ubuntu", str(linux))
    assert (copied / "config.json").read_bytes() == (model / "config.json").read_bytes()
    assert (copied / "sub" / "model.safetensors").read_bytes() == (model / "sub" / "model.safetensors").read_bytes()
    assert progress[-1].finished and progress[-1].done_bytes == 1_048_576 + len('{"model_type": "llama"}')
    assert not (paths.models_dir / "local").exists()  # nothing on the Windows side
    stamp = (copied / "config.json").stat().st_mtime_ns

    progress.clear()
    assert await ensure_model(engine_model, "vllm", paths, settings, progress.append, wsl_distro="Ubuntu") == linux
    assert progress == [] and (copied / "config.json").stat().st_mtime_ns == stamp


async def test_an_assignment_on_a_windows_machine_installs_and_starts_vllm_inside_wsl(
    fake: FakeWsl, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Windows machine (its `os`, as a `--hardware` file gives it, whatever this test runs on):
    vLLM goes into its distribution, the model onto that disk, and the plan says so."""
    wheels = fake.home("Ubuntu") / "wheels"
    fake_vllm_wheel(wheels, "0.33.0")
    pip_wheel(wheels)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    machine = dataclasses.replace(replay("rtx4090.json"), os="windows", runtime="wsl2", wsl_distro="Ubuntu",
                                  engines={name: EngineInstall(None) for name in registry.names()})
    chosen = plan(machine, assign(vllm={"source": str(model), "weights_mib": 1, "engine_version": "0.33.0"}),
                  Settings())
    assert isinstance(chosen, Plan), chosen
    monkeypatch.setattr(assignment, "ensure_engine", functools.partial(ensure_engine, find_links=str(HOME / "wheels")))

    (ready,) = await assignment.provision(chosen, machine, Paths.under(tmp_path / "app"), Settings(), lambda _: None,
                                          engine_bins={})
    assert (ready.in_wsl, ready.wsl_distro) == (True, "Ubuntu")
    assert ready.executable == (".local/share/gpu-provider/engines/vllm-0.33.0/bin/vllm",)
    assert ready.model.startswith(f"{HOME}/.cache/gpu-provider/models/local/")
    assert (fake.linux_path_on_host("Ubuntu", ready.model) / "config.json").is_file()


async def test_too_little_disk_inside_wsl_refuses_the_cpu_build_before_anything_is_made(
    fake: FakeWsl, tmp_path: Path
) -> None:
    """vLLM's CPU build on a CPU-only Windows PC goes into WSL2 too; its disk check measures the
    distribution's disk (here the fake's home folder), not skipped as before."""
    cpu = SHIPPED.build("0.32.0", "cpu")
    assert cpu is not None and cpu.disk_mib is not None
    free_mib = shutil.disk_usage(fake.home("Ubuntu")).free // 2**20
    bigger = VllmReleases((dataclasses.replace(cpu, disk_mib=free_mib + 100 * 1024),))
    with pytest.raises(ProvisionError) as failure:
        await ensure_engine("vllm", None, Paths.under(tmp_path / "app"), lambda _: None, runtime="cpu",
                            machine_os="windows", wsl_distro="Ubuntu", releases=bigger, find_links=str(HOME))
    assert failure.value.problem.title == "Not enough disk space"
    engines = fake.home("Ubuntu") / ".local/share/gpu-provider/engines"
    assert str(engines) in failure.value.problem.message and list(engines.iterdir()) == []


async def test_a_local_model_over_its_size_is_refused_and_a_dangling_link_left_out(fake: FakeWsl, tmp_path: Path) -> None:
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "gone").symlink_to(tmp_path / "nowhere")
    (model / "weights.bin").write_bytes(b"\0" * (2 * 1024 * 1024))
    big = protocol.EngineModel(source=str(model), weights_mib=1)
    with pytest.raises(ProvisionError) as failure:
        await ensure_model(big, "vllm", Paths.under(tmp_path / "app"), Settings(), lambda _: None, wsl_distro="Ubuntu")
    assert failure.value.problem.title == "Model larger than allowed"
    (model / "weights.bin").unlink()
    linux = await ensure_model(big, "vllm", Paths.under(tmp_path / "app"), Settings(), lambda _: None,
                               wsl_distro="Ubuntu")
    assert sorted(p.name for p in fake.linux_path_on_host("Ubuntu", str(linux)).iterdir()) == ["config.json"]


def test_a_windows_pc_with_wsl2_is_detected_as_wsl2_with_its_distribution_and_engines(
    fake: FakeWsl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`detect` as on Windows (`platform.system`), the listing and the probe through the fake."""
    folder = fake.home("Ubuntu") / ".local/share/gpu-provider/engines/sglang-0.5.23"
    folder.mkdir(parents=True)
    (folder / ".gpu-provider-installed").write_text("0.5.23")
    monkeypatch.setattr(platform, "system", lambda: "Windows")
    _, nvml = load_reading(NVML_FIXTURES / "rtx4090.json")
    machine = detect(Settings(), Finder({}), nvml=nvml)
    assert (machine.os, machine.runtime, machine.wsl_distro) == ("windows", "wsl2", "Ubuntu")
    assert machine.engines["sglang"] == EngineInstall("0.5.23", IN_WSL) and machine.engines["vllm"].version is None
