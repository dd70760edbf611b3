"""The frozen app's entry point (build.spec): run a newer self-updated version if one is installed,
otherwise this build's `gpu-provider` command line (the desktop app when given no command)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from app.launch import main
from worker import __version__
from worker.system.config import Paths
from worker.update import run_installed_if_newer


def data_dir_from(argv: Sequence[str]) -> str | None:
    """`--data-dir DIR` or `--data-dir=DIR` anywhere on the command line, as the CLI accepts it."""
    for index, arg in enumerate(argv):
        if arg == "--data-dir" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--data-dir="):
            return arg.partition("=")[2]
    return None


if __name__ == "__main__":
    arguments = sys.argv[1:]
    run_installed_if_newer(
        Paths.resolve(data_dir_from(arguments)), arguments, __version__
    )
    sys.exit(main(arguments))
