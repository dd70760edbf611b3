"""Run by the Python of the cached vLLM: parse `vllm serve /m ARGS…` with vLLM's own parser (the
`serve` subcommand as `vllm/entrypoints/cli/main.py` builds it), one JSON argument list per line
on stdin, and print per line whether it was accepted and every setting it changed (as repr)."""

from __future__ import annotations

import contextlib
import io
import json
import sys

import vllm.entrypoints.cli.serve as serve
from vllm.utils.argparse_utils import FlexibleArgumentParser


def serve_parser() -> FlexibleArgumentParser:
    top = FlexibleArgumentParser()
    commands = top.add_subparsers(dest="subparser")
    for command in serve.cmd_init():
        command.subparser_init(commands)
    return top


def main() -> None:
    parser = serve_parser()
    defaults = vars(parser.parse_args(["serve", "/m"]))
    for line in sys.stdin:
        args = json.loads(line)
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors):
                parsed = vars(parser.parse_args(["serve", "/m", *args]))
        except SystemExit:
            print(json.dumps({"ok": False, "error": errors.getvalue()[-500:]}), flush=True)
            continue
        changed = {key: repr(value) for key, value in parsed.items() if defaults.get(key) != value}
        print(json.dumps({"ok": True, "changed": changed,
                          "values": {key: repr(value) for key, value in parsed.items()}}), flush=True)


if __name__ == "__main__":
    main()
