"""Reaching inside WSL2 from Windows: a command line that no shell re-parses, and an environment
that crosses only through `WSLENV`.

`wsl.exe -- …` hands the rest of its command line to the distribution's `$SHELL -c` (microsoft/WSL
#41598, by design): a model name holding `$(…)` would run, a JSON argument would split. `-e` runs
the program with the arguments as given. Windows variables reach the Linux side only where
`WSLENV` names them (`/u`: from Windows into WSL only); a value in argv would be readable by every
local user, so secrets go this way and never as arguments.

Which distribution: `wsl.exe -l -v` lists them (UTF-16 unless `WSL_UTF8=1`, which older WSL
ignores); only version 2 has the GPU, and Docker Desktop's own are no place for an engine. Where the
app writes into one (a model, pip's wheel), it uses the Windows path `wslpath -w` gives for a
folder under the user's home: the distribution's own disk, never `/mnt/c`.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from worker.system import children
from worker.system.secrets import ENV_VAR as TOKEN_VARIABLE

WSL_EXE = "wsl.exe"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def command(argv: Sequence[str], *, distro: str | None, cd: str = "~") -> list[str]:
    """`argv` run inside `distro` (its default where None), from `cd` (`~`: the user's home), with
    no shell in between."""
    if not argv:
        raise ValueError("no program to run inside WSL2")
    return [WSL_EXE, *(["-d", distro] if distro else []), "--cd", cd, "-e", *argv]


def with_wslenv(base: Mapping[str, str], passed: Mapping[str, str]) -> dict[str, str]:
    """The environment for `wsl.exe`: `base` plus `passed`, each of `passed` named in `WSLENV` with
    `/u` so it crosses into WSL (and only that way); names already in the user's `WSLENV` are kept."""
    env = dict(base)
    entries = [entry for entry in env.get("WSLENV", "").split(":") if entry]
    kept = [entry for entry in entries if entry.split("/", 1)[0] not in passed]
    for name, value in passed.items():
        if not _NAME.fullmatch(name):
            raise ValueError(f"not a variable name: {name!r}")
        env[name] = value
    env["WSLENV"] = ":".join([*kept, *(f"{name}/u" for name in passed)])
    return env


# --- which distributions there are --------------------------------------------------------------

LISTING_TIMEOUT_S = 30.0  # the first call after the VM stopped boots it, which can take well over 5 s
PROBE_TIMEOUT_S = 30.0
MAX_OUTPUT_BYTES = 64 * 1024  # a listing or a probe answer; more is no answer
MAX_DISTROS = 64
DISTRO_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # what `wsl --install -d`/`--import` accept


@dataclass(frozen=True)
class Distro:
    """One distribution `wsl.exe -l -v` lists: its name, state (`Running`, `Stopped`, localised
    on other Windows languages), WSL version, and whether it is the default one."""

    name: str
    state: str
    version: int
    default: bool = False


def decode(raw: bytes) -> str:
    """wsl.exe's output as text: UTF-8 with `WSL_UTF8=1`, but older WSL ignores that and prints
    UTF-16LE (a BOM, or a NUL after each ASCII letter, says so)."""
    if raw.startswith(b"\xff\xfe") or (len(raw) > 1 and b"\x00" in raw[1::2]):
        return raw.decode("utf-16-le", "replace").lstrip("\ufeff")
    return raw.decode("utf-8", "replace").lstrip("\ufeff")


def parse_listing(text: str) -> tuple[Distro, ...]:
    """The rows of `wsl -l -v` (`* Ubuntu  Running  2`); the header (its last word is no
    number), a name that is no distribution name and rows past `MAX_DISTROS` are skipped."""
    distros = []
    for line in text.splitlines()[: MAX_DISTROS + 1]:
        default = line.lstrip().startswith("*")
        words = line.strip().lstrip("*").split()
        if len(words) < 3 or not words[-1].isdigit() or not DISTRO_NAME.fullmatch(words[0]):
            continue
        distros.append(Distro(words[0], " ".join(words[1:-1]), int(words[-1]), default))
    return tuple(distros)


def usable(distros: Sequence[Distro]) -> tuple[Distro, ...]:
    """The distributions an engine may run in: WSL version 2 only (version 1 has no GPU), never
    Docker Desktop's own (`docker-desktop`, `docker-desktop-data`), the default first."""
    kept = [d for d in distros if d.version == 2 and not d.name.lower().startswith("docker-desktop")]
    return tuple(sorted(kept, key=lambda d: not d.default))


BytesRunner = Callable[[list[str], float, Mapping[str, str]], "subprocess.CompletedProcess[bytes]"]


def list_distros(run: BytesRunner | None = None, base: Mapping[str, str] | None = None) -> tuple[Distro, ...]:
    """The usable WSL2 distributions, default first; none where WSL is missing, has none, hangs or
    answers too much. A Stopped one counts: it starts when a command runs in it."""
    env = {**_without_token(os.environ if base is None else base), "WSL_UTF8": "1"}
    try:
        done = (run or _run_bytes)([WSL_EXE, "-l", "-v"], LISTING_TIMEOUT_S, env)
    except (OSError, subprocess.SubprocessError):
        return ()
    if done.returncode != 0 or len(done.stdout) > MAX_OUTPUT_BYTES:
        return ()
    return usable(parse_listing(decode(done.stdout)))


def _without_token(base: Mapping[str, str]) -> dict[str, str]:
    """A probe is no engine: the app's environment without the provider token."""
    return {name: value for name, value in base.items() if name != TOKEN_VARIABLE}


def _run_bytes(argv: list[str], timeout_s: float, env: Mapping[str, str]) -> subprocess.CompletedProcess[bytes]:
    return children.run_bytes(argv, timeout_s=timeout_s, env=env)


# --- paths inside a distribution ----------------------------------------------------------------


class WslError(Exception):
    """A command inside WSL2 failed or did not answer (the message says which, for the log)."""


def ask(argv: Sequence[str], *, distro: str | None, timeout_s: float = PROBE_TIMEOUT_S,
        env: Mapping[str, str] | None = None) -> str:
    """The stdout of `argv` run inside `distro` (no shell), bounded; raises `WslError`."""
    try:
        done = children.run(command(argv, distro=distro), timeout_s=timeout_s,
                            env=_without_token(os.environ if env is None else env))
    except (OSError, subprocess.SubprocessError) as exc:
        raise WslError(f"{argv[0]} inside WSL2 did not run: {exc}") from None
    if done.returncode != 0 or len(done.stdout) > MAX_OUTPUT_BYTES:
        raise WslError(f"{argv[0]} inside WSL2 failed (exit {done.returncode}): {done.stderr.strip()[-300:]}")
    return done.stdout


def home(distro: str | None) -> PurePosixPath:
    """The distribution user's home (`/home/<user>`), where the app's engines and models live."""
    answer = ask(["printenv", "HOME"], distro=distro).strip()
    if not answer.startswith("/") or "\n" in answer:
        raise WslError(f"WSL2 gave no home folder: {answer[:100]!r}")
    return PurePosixPath(answer)


def host_folder(linux_folder: PurePosixPath, *, distro: str | None) -> Path:
    """The folder inside the distribution as this machine writes to it (`\\\\wsl.localhost\\D\\…`),
    made first (`wslpath -w` answers only for a path that exists)."""
    if not linux_folder.is_absolute():
        raise ValueError(f"not an absolute Linux path: {linux_folder}")
    ask(["mkdir", "-p", "--", str(linux_folder)], distro=distro)
    answer = ask(["wslpath", "-w", str(linux_folder)], distro=distro).strip()
    if not answer or "\n" in answer:
        raise WslError(f"wslpath gave no Windows path for {linux_folder}")
    return Path(answer)
