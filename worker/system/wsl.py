"""Reaching inside WSL2 from Windows: a command line that no shell re-parses, and an environment
that crosses only through `WSLENV`.

`wsl.exe -- …` hands the rest of its command line to the distribution's `$SHELL -c` (microsoft/WSL
#41598, by design): a model name holding `$(…)` would run, a JSON argument would split. `-e` runs
the program with the arguments as given. Windows variables reach the Linux side only where
`WSLENV` names them (`/u`: from Windows into WSL only); a value in argv would be readable by every
local user, so secrets go this way and never as arguments.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

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
