"""Starts SGLang's server in this process with the API key read from the environment.

SGLang 0.5.23 takes its key only as `--api-key`, and any local user can read a command line, so the
app runs this file with the SGLang venv's Python instead of `python -m sglang.launch_server`: the
arguments are SGLang's own, and the key comes from `KEY_VARIABLE`, which is removed from the
environment before SGLang starts its worker processes. It does what `sglang/launch_server.py`'s
`__main__` does, with the key set on the parsed arguments before they are resolved.

Standalone on purpose: it runs inside SGLang's venv, which has no copy of this app, so it imports
only the standard library and SGLang.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

KEY_VARIABLE = "GPU_PROVIDER_SGLANG_KEY"
NO_KEY = f"{KEY_VARIABLE} is not set: SGLang would serve without an API key"
KEY_ON_COMMAND_LINE = "--api-key is the launcher's to set, from the environment, never on a command line"


def argument_problem(argv: Sequence[str]) -> str | None:
    """Why these arguments must not reach SGLang, or None."""
    if any(arg == "--api-key" or arg.startswith("--api-key=") for arg in argv):
        return KEY_ON_COMMAND_LINE
    return None


def main(argv: Sequence[str]) -> int:
    key = os.environ.pop(KEY_VARIABLE, "")
    problem = argument_problem(argv) or (None if key else NO_KEY)
    if problem is not None:
        print(f"launcher: {problem}", file=sys.stderr)
        return 2
    from sglang.launch_server import run_server  # type: ignore[import-not-found]  # only where installed
    from sglang.srt.plugins import load_plugins  # type: ignore[import-not-found]
    from sglang.srt.server_args import prepare_server_args  # type: ignore[import-not-found]
    from sglang.srt.utils import kill_process_tree  # type: ignore[import-not-found]

    load_plugins()
    server_args = prepare_server_args(list(argv))
    server_args.api_key = key  # before `run_server` resolves (and seals) the arguments
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
