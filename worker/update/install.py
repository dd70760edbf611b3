"""The per-user install root: versions side by side, an atomically switched `current` pointer.

    ROOT/versions/<version>/   one unpacked one-folder build each (executable at its top)
    ROOT/current               which version starts: a symlink to versions/<v> (POSIX) or a
                               file holding the version (Windows), replaced atomically
    ROOT/previous              the version to roll back to (absent: the packaged build)
    ROOT/rejected.txt          versions that crashed or hung before reaching `hello`; never started or
                               installed again (one that started but could not connect is not listed)
    ROOT/staging/              downloads in progress and archives being unpacked

No `current` means "run the build the installer put in place". The layout and the rollback rules
are described for people in docs/releasing.md.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Literal

from worker.system import children
from worker.system.autostart import LAUNCHER_ENV
from worker.system.config import Paths, replace_file
from worker.update.verify import UpdateRefused, is_newer, parse_version

log = logging.getLogger(__name__)

PointerKind = Literal["symlink", "file"]
# Where each platform's release archive keeps the executable (macOS ships the .app, so that the
# updated version keeps its Info.plist: tray-only, signed, notarized).
EXECUTABLE_NAME = {
    "win32": "gpu-provider.exe",
    "darwin": "GPU Provider.app/Contents/MacOS/gpu-provider",
}.get(sys.platform, "gpu-provider")
HANDED_OFF_ENV = "GPU_PROVIDER_HANDED_OFF"
HELLO_MARKER_NAME = "update-hello.json"
MACOS_METADATA_FOLDER = "__MACOSX"  # where the Finder's zip keeps AppleDouble files
CODESIGN = "/usr/bin/codesign"  # by its path: a PATH entry must not stand in for the check
CODESIGN_TIMEOUT_S = 300.0  # --deep hashes every file of the bundle: hundreds of MB


def default_pointer_kind() -> PointerKind:
    """Windows cannot rely on symlinks (they need a privilege); a pointer file works everywhere."""
    return "file" if os.name == "nt" else "symlink"


def install_root(paths: Paths) -> Path:
    return paths.data_dir / "app"


@dataclass(frozen=True)
class InstallRoot:
    """One install root; every change to it is a single atomic rename."""

    root: Path
    pointer_kind: PointerKind = field(default_factory=default_pointer_kind)
    executable_name: str = EXECUTABLE_NAME

    @property
    def versions_dir(self) -> Path:
        return self.root / "versions"

    @property
    def staging_dir(self) -> Path:
        return self.root / "staging"

    def version_dir(self, version: str) -> Path:
        return self.versions_dir / str(parse_version(version))

    def executable(self, version: str) -> Path:
        return self.version_dir(version) / self.executable_name

    def current(self) -> str | None:
        return self._read_pointer("current")

    def previous(self) -> str | None:
        return self._read_pointer("previous")

    def installed(self) -> list[str]:
        if not self.versions_dir.is_dir():
            return []
        return sorted(
            (p.name for p in self.versions_dir.iterdir() if p.is_dir()),
            key=parse_version,
        )

    def rejected(self) -> frozenset[str]:
        try:
            lines = (self.root / "rejected.txt").read_text(encoding="utf-8").split()
        except FileNotFoundError:
            return frozenset()
        return frozenset(lines)

    def reject(self, version: str) -> None:
        """Remember a version that failed to start, so neither the feed nor the launcher retries it."""
        versions = sorted(self.rejected() | {version})
        _atomic_write_text(self.root / "rejected.txt", "\n".join(versions) + "\n")

    def switch_to(self, version: str) -> None:
        """Make `version` current and the old current the one to roll back to."""
        if not self.executable(version).is_file():
            raise UpdateRefused(
                f"version {version} is not unpacked in {self.versions_dir}"
            )
        old = self.current()
        if old is not None and old != version:
            self._write_pointer("previous", old)
        elif old is None:
            self._clear_pointer("previous")
        self._write_pointer("current", version)
        log.info(
            "switched %s from %s to %s", self.root, old or "the packaged build", version
        )

    def roll_back(self) -> str | None:
        """Point `current` back at `previous` (or at the packaged build); returns what is current now."""
        before = self._read_pointer("previous")
        if before is None:
            self._clear_pointer("current")
        else:
            self._write_pointer("current", before)
        self._clear_pointer("previous")
        log.warning("rolled %s back to %s", self.root, before or "the packaged build")
        return before

    def prune(self) -> list[str]:
        """Delete unpacked versions other than current and previous; returns what was deleted."""
        keep = {self.current(), self.previous()}
        removed = [v for v in self.installed() if v not in keep]
        for version in removed:
            shutil.rmtree(self.versions_dir / version, ignore_errors=True)
        return removed

    def _pointer_path(self, name: str) -> Path:
        return self.root / name

    def _read_pointer(self, name: str) -> str | None:
        path = self._pointer_path(name)
        if self.pointer_kind == "symlink":
            return Path(os.readlink(path)).name if path.is_symlink() else None
        try:
            text = path.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None
        return text or None

    def _write_pointer(self, name: str, version: str) -> None:
        path = self._pointer_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.pointer_kind == "file":
            _atomic_write_text(path, version + "\n")
            return
        temporary = path.with_name(f".{name}.{os.getpid()}.tmp")
        temporary.unlink(missing_ok=True)
        temporary.symlink_to(Path("versions") / version, target_is_directory=True)
        replace_file(temporary, path)

    def _clear_pointer(self, name: str) -> None:
        self._pointer_path(name).unlink(missing_ok=True)


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        replace_file(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def unpack(archive: Path, install: InstallRoot, version: str) -> Path:
    """Unpack a verified archive into versions/<version> (blocking: run it in a thread).

    The archive is a .tar.gz or .zip of a one-folder build, with the executable at its top or
    inside a single top-level folder. Unpacking happens in staging and ends with one rename; a
    macOS `.app` must pass `codesign --verify` before that rename.
    """
    install.staging_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(
        tempfile.mkdtemp(prefix=f"unpack-{version}-", dir=install.staging_dir)
    )
    try:
        _extract(archive, scratch)
        build = _build_folder(scratch, install.executable_name, version)
        _verify_app_bundle(build, install.executable_name)
        target = install.version_dir(version)
        if target.exists():
            if install.current() == target.name:
                raise UpdateRefused(f"version {version} is already the current one")
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        replace_file(build, target)
        return target
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _extract(archive: Path, into: Path) -> None:
    if tarfile.is_tarfile(archive):
        with tarfile.open(archive) as tar:
            _refuse_mac_metadata(tar.getnames())
            try:
                tar.extractall(into, filter="data")
            except tarfile.FilterError as exc:
                raise UpdateRefused(
                    f"the update archive holds an unsafe entry: {exc}"
                ) from None
    elif zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zipped:
            _refuse_mac_metadata(zipped.namelist())
            zipped.extractall(into)
    else:
        raise UpdateRefused("the update archive is neither a .tar.gz nor a .zip")


def _refuse_mac_metadata(names: Sequence[str]) -> None:
    """AppleDouble files (`._x`, `__MACOSX/`) are what a Mac's tar or zip adds for extended
    attributes; unpacked as files inside a bundle they break its signature seal."""
    for name in names:
        parts = PurePosixPath(name).parts
        if any(part.startswith("._") or part == MACOS_METADATA_FOLDER for part in parts):
            raise UpdateRefused(
                f"the update archive holds macOS metadata files ({name}); they would break the "
                "app's signature, so the update is not installed (the archive must be packed "
                "with COPYFILE_DISABLE=1 and --no-mac-metadata)"
            )


def _verify_app_bundle(build: Path, executable_name: str) -> None:
    """On macOS, the unpacked `.app` must carry an intact signature before it can become
    current: a bundle changed after signing would be refused by Gatekeeper or the keychain."""
    bundle = executable_name.split("/", 1)[0]
    if sys.platform != "darwin" or not bundle.endswith(".app"):
        return
    argv = [CODESIGN, "--verify", "--deep", "--strict", str(build / bundle)]
    try:
        result = children.run(argv, timeout_s=CODESIGN_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UpdateRefused(f"the update's signature could not be checked (codesign: {exc})") from None
    if result.returncode != 0:
        why = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        raise UpdateRefused(f"the update's app signature is not valid, so it is not installed (codesign: {why})")


def _build_folder(scratch: Path, executable_name: str, version: str) -> Path:
    if (scratch / executable_name).is_file():
        return scratch
    entries = list(scratch.iterdir())
    if len(entries) == 1 and (entries[0] / executable_name).is_file():
        return entries[0]
    raise UpdateRefused(f"the archive of {version} has no {executable_name} at its top")


# --- proof of a successful start -------------------------------------------------------------


def hello_marker(paths: Paths) -> Path:
    return paths.data_dir / HELLO_MARKER_NAME


def mark_started(paths: Paths, version: str, *, now: float | None = None) -> None:
    """Called by the node once it owns the data folder and is about to connect: from here on, a
    version that never reaches `hello` is more likely offline than broken."""
    _mark(paths, version, "started", now)


def mark_hello_reached(paths: Paths, version: str, *, now: float | None = None) -> None:
    """Called by the node when it sends `hello`: proves to the updater that this version works."""
    _mark(paths, version, "hello", now)


def hello_reached_by(paths: Paths) -> str | None:
    """The version that last reached `hello`, or None (no marker, an unreadable one, or one that
    only says "started")."""
    record = _read_marker(paths)
    return record[0] if record is not None and record[1] == "hello" else None


def started_by(paths: Paths) -> str | None:
    """The version that last started its core (or got further), or None."""
    record = _read_marker(paths)
    return record[0] if record is not None else None


def _mark(paths: Paths, version: str, stage: Literal["started", "hello"], now: float | None) -> None:
    record = {"version": version, "stage": stage, "at": time.time() if now is None else now}
    _atomic_write_text(hello_marker(paths), json.dumps(record) + "\n")


def _read_marker(paths: Paths) -> tuple[str, str] | None:
    """(version, stage); a record without a stage is an older build's, written at `hello`."""
    try:
        record = json.loads(hello_marker(paths).read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("version"), str):
        return None
    stage = record.get("stage", "hello")
    return (record["version"], stage) if stage in ("started", "hello") else None


# --- handing over to an installed newer version at start -------------------------------------


def newer_installed_executable(
    install: InstallRoot, running_version: str
) -> Path | None:
    """The current version's executable when it is newer than this one and not rejected."""
    current = install.current()
    if (
        current is None
        or current in install.rejected()
        or not is_newer(current, running_version)
    ):
        return None
    executable = install.executable(current)
    return executable if executable.is_file() else None


def run_installed_if_newer(
    paths: Paths, argv: Sequence[str], running_version: str
) -> None:
    """At start of a packaged build: run the self-updated version instead, if there is a newer one.

    Returns when this build should carry on; otherwise never returns. The environment marker stops
    a mislabelled build from handing over to itself forever.
    """
    if os.environ.get(HANDED_OFF_ENV):
        return
    executable = newer_installed_executable(
        InstallRoot(install_root(paths)), running_version
    )
    if executable is None:
        return
    os.environ[HANDED_OFF_ENV] = running_version
    os.environ[LAUNCHER_ENV] = sys.executable
    command = [str(executable), *argv]
    if os.name == "nt":
        sys.exit(children.call(command))
    os.execv(command[0], command)
