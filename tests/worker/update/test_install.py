from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.worker.update import builds
from worker.system import children
from worker.system.config import Paths
from worker.update.install import (
    InstallRoot,
    PointerKind,
    hello_reached_by,
    mark_hello_reached,
    newer_installed_executable,
    run_installed_if_newer,
    unpack,
)
from worker.update.verify import UpdateRefused


@pytest.fixture(params=["symlink", "file"])
def install(request: pytest.FixtureRequest, tmp_path: Path) -> InstallRoot:
    kind: PointerKind = request.param
    return InstallRoot(tmp_path / "app", pointer_kind=kind)


def unpacked(
    install: InstallRoot, tmp_path: Path, version: str, data: bytes | None = None
) -> Path:
    archive = tmp_path / f"{version}.archive"
    archive.write_bytes(data if data is not None else builds.tarball(version))
    return unpack(archive, install, version)


def test_unpack_puts_the_build_in_its_version_folder(
    install: InstallRoot, tmp_path: Path
) -> None:
    folder = unpacked(install, tmp_path, "0.2.0")
    assert folder == install.root / "versions" / "0.2.0"
    assert os.access(folder / "gpu-provider", os.X_OK)
    assert (folder / "_internal" / "VERSION").read_text() == "0.2.0"
    assert list(install.staging_dir.iterdir()) == []


def test_unpack_accepts_one_top_level_folder_and_zip_archives(
    install: InstallRoot, tmp_path: Path
) -> None:
    nested = unpacked(
        install, tmp_path, "0.2.0", builds.tarball("0.2.0", folder="gpu-provider-0.2.0")
    )
    zipped = unpacked(install, tmp_path, "0.3.0", builds.zipped("0.3.0"))
    assert (nested / "gpu-provider").is_file()
    assert (zipped / "_internal" / "VERSION").read_text() == "0.3.0"


def test_unpack_refuses_an_archive_without_the_executable(
    install: InstallRoot, tmp_path: Path
) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("README")
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(UpdateRefused, match="no gpu-provider at its top"):
        unpacked(install, tmp_path, "0.2.0", buffer.getvalue())
    assert install.installed() == []


def test_unpack_refuses_entries_that_escape_the_folder(
    install: InstallRoot, tmp_path: Path
) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("../../escaped")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(UpdateRefused, match="unsafe entry"):
        unpacked(install, tmp_path, "0.2.0", buffer.getvalue())
    assert not (tmp_path / "escaped").exists()


def test_unpack_refuses_what_is_not_an_archive(
    install: InstallRoot, tmp_path: Path
) -> None:
    with pytest.raises(UpdateRefused, match="neither"):
        unpacked(install, tmp_path, "0.2.0", b"just bytes")


MAC_EXECUTABLE = "GPU Provider.app/Contents/MacOS/gpu-provider"


def tar_of(*names: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size, info.mode = 1, 0o755
            tar.addfile(info, io.BytesIO(b"x"))
    return buffer.getvalue()


@pytest.mark.parametrize(
    "metadata",
    ["GPU Provider.app/Contents/MacOS/._gpu-provider", "._GPU Provider.app", "./GPU Provider.app/Contents/._Info.plist"],
)
def test_unpack_refuses_apple_double_members(tmp_path: Path, metadata: str) -> None:
    """A Mac's tar turns extended attributes into `._x` files, which break the bundle's seal."""
    install = InstallRoot(tmp_path / "app", executable_name=MAC_EXECUTABLE)
    with pytest.raises(UpdateRefused, match="macOS metadata files"):
        unpacked(install, tmp_path, "0.2.0", tar_of(MAC_EXECUTABLE, metadata))
    assert install.installed() == []


def test_unpack_refuses_a_zip_with_a_macosx_folder(install: InstallRoot, tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("gpu-provider", builds.script("0.2.0"))
        archive.writestr("__MACOSX/._gpu-provider", b"\x00\x05\x16\x07")
    with pytest.raises(UpdateRefused, match=r"macOS metadata files \(__MACOSX/"):
        unpacked(install, tmp_path, "0.2.0", buffer.getvalue())


class Codesign:
    """`subprocess.run` under `worker.system.children`, answering codesign with an exit status."""

    def __init__(self, returncode: int, stderr: str = "") -> None:
        self.returncode, self.stderr = returncode, stderr
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], **options: object) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        return subprocess.CompletedProcess(argv, self.returncode, "", self.stderr)


def on_a_mac(monkeypatch: pytest.MonkeyPatch, codesign: Codesign) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(children.subprocess, "run", codesign)


def test_a_mac_bundle_is_verified_by_codesign_before_it_is_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install = InstallRoot(tmp_path / "app", executable_name=MAC_EXECUTABLE)
    codesign = Codesign(0)
    on_a_mac(monkeypatch, codesign)
    folder = unpacked(install, tmp_path, "0.2.0", tar_of(MAC_EXECUTABLE))
    assert (folder / MAC_EXECUTABLE).is_file()
    assert len(codesign.calls) == 1
    *command, bundle = codesign.calls[0]
    assert command == ["/usr/bin/codesign", "--verify", "--deep", "--strict"]
    assert bundle.startswith(str(install.staging_dir)) and bundle.endswith("/GPU Provider.app")


def test_a_bundle_that_fails_codesign_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install = InstallRoot(tmp_path / "app", executable_name=MAC_EXECUTABLE)
    on_a_mac(monkeypatch, Codesign(1, "GPU Provider.app: a sealed resource is missing or invalid\n"))
    with pytest.raises(UpdateRefused, match="signature is not valid.*sealed resource is missing"):
        unpacked(install, tmp_path, "0.2.0", tar_of(MAC_EXECUTABLE))
    assert install.installed() == [] and list(install.staging_dir.iterdir()) == []


def test_no_codesign_runs_off_macos(install: InstallRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    codesign = Codesign(1)
    monkeypatch.setattr(children.subprocess, "run", codesign)
    unpacked(install, tmp_path, "0.2.0")
    assert codesign.calls == []


def test_switching_keeps_the_previous_version_and_rollback_restores_it(
    install: InstallRoot, tmp_path: Path
) -> None:
    for version in ("0.2.0", "0.3.0"):
        unpacked(install, tmp_path, version)
    assert install.current() is None
    install.switch_to("0.2.0")
    assert (install.current(), install.previous()) == ("0.2.0", None)
    install.switch_to("0.3.0")
    assert (install.current(), install.previous()) == ("0.3.0", "0.2.0")
    assert install.roll_back() == "0.2.0"
    assert (install.current(), install.previous()) == ("0.2.0", None)


def test_rolling_back_the_first_update_returns_to_the_packaged_build(
    install: InstallRoot, tmp_path: Path
) -> None:
    unpacked(install, tmp_path, "0.2.0")
    install.switch_to("0.2.0")
    assert install.roll_back() is None
    assert install.current() is None


def test_the_symlink_pointer_resolves_to_the_version_folder(tmp_path: Path) -> None:
    install = InstallRoot(tmp_path / "app", pointer_kind="symlink")
    unpacked(install, tmp_path, "0.2.0")
    install.switch_to("0.2.0")
    assert (install.root / "current" / "gpu-provider").resolve() == install.executable(
        "0.2.0"
    ).resolve()


def test_switching_to_a_version_not_unpacked_is_refused(install: InstallRoot) -> None:
    with pytest.raises(UpdateRefused, match="not unpacked"):
        install.switch_to("0.9.0")
    assert install.current() is None


def test_prune_keeps_current_and_previous(install: InstallRoot, tmp_path: Path) -> None:
    for version in ("0.2.0", "0.3.0", "0.4.0"):
        unpacked(install, tmp_path, version)
    install.switch_to("0.3.0")
    install.switch_to("0.4.0")
    assert install.prune() == ["0.2.0"]
    assert install.installed() == ["0.3.0", "0.4.0"]


def test_rejected_versions_are_remembered(install: InstallRoot) -> None:
    install.reject("0.3.0")
    install.reject("0.2.0")
    assert install.rejected() == {"0.2.0", "0.3.0"}


def test_the_hello_marker_names_the_version_that_wrote_it(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path)
    assert hello_reached_by(paths) is None
    mark_hello_reached(paths, "0.2.0", now=1.0)
    assert hello_reached_by(paths) == "0.2.0"
    (paths.data_dir / "update-hello.json").write_text("{broken")
    assert hello_reached_by(paths) is None


def test_a_newer_current_version_is_what_starts(
    install: InstallRoot, tmp_path: Path
) -> None:
    unpacked(install, tmp_path, "0.2.0")
    assert newer_installed_executable(install, "0.1.0") is None
    install.switch_to("0.2.0")
    assert newer_installed_executable(install, "0.1.0") == install.executable("0.2.0")
    assert newer_installed_executable(install, "0.2.0") is None
    install.reject("0.2.0")
    assert newer_installed_executable(install, "0.1.0") is None


def test_a_handed_off_start_does_not_hand_off_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = Paths.under(tmp_path)
    install = InstallRoot(paths.data_dir / "app")
    unpacked(install, tmp_path, "0.2.0")
    install.switch_to("0.2.0")
    monkeypatch.setenv("GPU_PROVIDER_HANDED_OFF", "0.1.0")
    assert run_installed_if_newer(paths, ["detect"], "0.1.0") is None


def test_a_packaged_build_hands_over_to_the_newer_installed_version(
    tmp_path: Path,
) -> None:
    paths = Paths.under(tmp_path)
    install = InstallRoot(paths.data_dir / "app")
    unpacked(install, tmp_path, "0.2.0")
    install.switch_to("0.2.0")
    starter = (
        "import sys; from worker.system.config import Paths; from worker.update import run_installed_if_newer; "
        f"run_installed_if_newer(Paths.under({str(tmp_path)!r}), ['--data-dir', {str(tmp_path)!r}], '0.1.0'); "
        "print('the packaged build carried on')"
    )
    env = {k: v for k, v in os.environ.items() if k != "GPU_PROVIDER_HANDED_OFF"}
    result = subprocess.run(
        [sys.executable, "-c", starter],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "carried on" not in result.stdout
    assert hello_reached_by(paths) == "0.2.0"
