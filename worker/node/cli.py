"""`gpu-provider`'s core commands: `detect`, `plan`, `run --headless`, `status`, `tune` and `setup`.

Without a command (or `run` without --headless) `gpu-provider` opens the desktop app. The core
never imports the GUI, so that choice is the launcher's (`app/launch.py`): it asks
`desktop_arguments` whether a command line means the app, and hands every other one to `main`.

Every subcommand accepts `--data-dir DIR` before or after its name. Output meant for programs is
one JSON object on stdout; a refusal or bad input is `{"error": "…"}` with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from worker import __version__
from worker.system.config import Paths, Settings, load_settings

EXIT_REFUSED = 2

Handler = Callable[[argparse.Namespace, Settings], int]
T = TypeVar("T")


class InputError(Exception):
    """A file given on the command line could not be used; the message says which and why."""


class CommandLine(argparse.ArgumentParser):
    """The parser, knowing its command names so that anything else goes to the app."""

    command_names: frozenset[str] = frozenset()


def build_parser() -> CommandLine:
    data_dir = argparse.ArgumentParser(add_help=False)
    data_dir.add_argument(
        "--data-dir", metavar="DIR", default=argparse.SUPPRESS,
        help="keep settings, state, caches and logs under DIR instead of the platform's folders",
    )
    parser = CommandLine(
        prog="gpu-provider",
        description="Lend this machine's GPUs to an inference network. Without a command, opens the desktop app, "
        "which takes the node's options below and --minimized / --quit-after.",
        parents=[data_dir, node_options(), desktop_options()],
    )
    parser.add_argument("--version", action="version", version=f"gpu-provider {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=argparse.ArgumentParser)

    detect = commands.add_parser(
        "detect", parents=[data_dir], help="print this machine as the network sees it (JSON)",
        description="Print this machine's platform, hardware and engines as one JSON object, "
        "in the shapes of the protocol's hello message.",
    )
    detect.add_argument("--pretty", action="store_true", help="print a table for people instead of JSON")
    detect.add_argument(
        "--engine-bin", metavar="NAME=PATH", action="append", default=[],
        help="where an engine lives, NAME=PATH, NAME as `detect` lists the engines; repeatable",
    )
    detect.add_argument(
        "--reading", metavar="FILE",
        help="replay a reading recorded with `python -m worker.hardware.record` instead of this machine's",
    )
    detect.set_defaults(handler=run_detect)

    plan = commands.add_parser(
        "plan", parents=[data_dir], help="show how a machine would serve an assignment (JSON)",
        description="Read a `detect` output and an `assign` message and print the engines this machine "
        "would start, or {\"error\": …} with exit status 2 when it would refuse.",
    )
    plan.add_argument("--hardware", metavar="FILE", required=True, help="a `gpu-provider detect` output")
    plan.add_argument("--assignment", metavar="FILE", required=True, help="an `assign` message from the coordinator")
    plan.set_defaults(handler=run_plan)

    run = commands.add_parser(
        "run", parents=[data_dir, node_options()], help="run the node (add --headless for no GUI)",
        description="Detect, connect to the coordinator, serve assignments and relay requests until "
        "Ctrl-C or SIGTERM, which drain requests, stop the engines and exit 0.",
    )
    run.add_argument("--headless", action="store_true", help="no GUI: log state changes to the terminal")
    run.set_defaults(handler=run_node)

    status = commands.add_parser(
        "status", parents=[data_dir], help="show the running node's figures",
        description="Read the running node's latest snapshot and print it as a table (or JSON).",
    )
    status.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    status.set_defaults(handler=run_status)

    tune = commands.add_parser(
        "tune", parents=[data_dir], help="find this machine's fastest safe engine arguments for a model",
        description="Measure the engine with the baseline arguments, then with candidates, on this machine "
        "with no coordinator, and print what it would adopt: the tune.report with each trial's arguments, "
        "result and figures. Nothing else may run on the data folder meanwhile.",
    )
    tune.add_argument("--model", metavar="SOURCE", required=True, help="a GGUF path or https URL#sha256=HASH, "
                      "a model folder or a Hugging Face repository")
    tune.add_argument("--engine", metavar="NAME", help="the engine to tune (default: the first that runs the model here)")
    tune.add_argument("--base-args", metavar="ARGS", help="the baseline to beat, as one string (default: the "
                      "engine's local defaults and tier)")
    tune.add_argument("--minutes", type=float, default=15.0, help="the time budget (default 15); a longer one "
                      "measures each candidate longer and re-measures the best more often")
    tune.add_argument("--space", metavar="JSON", help='the flags to try and their ranges, as a coordinator\'s '
                      'tune.space: {"-np": {"min": 1, "max": 8}, "-b": {"values": [512, 2048]}} (default: the '
                      "engine's own)")
    tune.add_argument("--trials", type=int, default=12, help="the most candidates tried (default 12)")
    tune.add_argument("--engine-bin", metavar="NAME=PATH", action="append", default=[],
                      help="an engine executable, NAME=PATH; repeatable")
    tune.add_argument("--json", action="store_true", help="print the report as JSON")
    tune.set_defaults(handler=run_tune)

    setup = commands.add_parser(
        "setup", parents=[data_dir], help="the first-run choices in a terminal (network, price, GPUs, habits)",
        description="Choose the network, the electricity price, the GPUs to lend, start at login and pausing "
        "for games, as the desktop app's first-run flow does, and save them as set up: the app then starts work "
        "at once. Asks each in turn (Enter keeps what is shown), or with --yes takes the flags and the current "
        "settings without a question.",
    )
    setup.add_argument("--yes", action="store_true", help="ask nothing: the flags given, else the current settings")
    setup.add_argument("--network", metavar="official|local|URL",
                       help="the network to serve (official), only this computer (local), or a wss:// URL")
    setup.add_argument("--price", metavar="PER_KWH", type=float, help="what one kWh of electricity costs you")
    setup.add_argument("--keep-price", action="store_true", help="with --yes: keep a price far from what homes pay")
    setup.add_argument("--gpus", metavar="all|0,1", help="the GPUs to lend")
    setup.add_argument("--start-at-login", action=argparse.BooleanOptionalAction, default=None,
                       help="start GPU Provider when you log in")
    setup.add_argument("--pause-for-games", action=argparse.BooleanOptionalAction, default=None,
                       help="pause while a game uses the GPU")
    setup.add_argument("--hardware", metavar="FILE", help="use a `detect` output instead of live detection")
    setup.set_defaults(handler=run_setup)
    parser.command_names = frozenset(commands.choices)
    return parser


def desktop_options() -> argparse.ArgumentParser:
    """The desktop app's own options (listed in `gpu-provider --help` with the node's)."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--minimized", action="store_true", help="desktop app: start in the tray, window closed")
    options.add_argument("--quit-after", type=float, metavar="SECONDS",
                         help="desktop app: quit after this long (smoke tests)")
    return options


def node_options() -> argparse.ArgumentParser:
    """Options shared by `run` and the desktop app."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument(
        "--coordinator", metavar="URL|local", default=None,
        help="the coordinator's wss:// URL, or `local` for the built-in one (default: the settings' choice)",
    )
    options.add_argument("--hardware", metavar="FILE", help="use a `detect` output instead of live detection")
    options.add_argument(
        "--engine-bin", metavar="NAME=PATH", action="append", default=[],
        help="an engine executable, NAME=PATH, NAME as `detect` lists the engines; repeatable",
    )
    options.add_argument("--model", metavar="PATH|URL|REPO", help="with --coordinator local: the model to serve")
    options.add_argument(
        "--openai-port", metavar="PORT", type=int, default=None,
        help="with --coordinator local: the OpenAI-compatible endpoint's port on 127.0.0.1 (default 8090; "
        "if another program holds it the endpoint does not start, it never moves elsewhere)",
    )
    options.add_argument(
        "--tune-minutes", metavar="N", type=float, default=None,
        help="with --coordinator local: after the first ready, spend up to N minutes finding this machine's "
        "fastest safe engine arguments; a result is kept and checked again at each start",
    )
    options.add_argument("--verbose", action="store_true", help="log debug lines too")
    return options


def local_tune(args: argparse.Namespace) -> dict[str, Any] | None:
    """The `tune` block `--tune-minutes` asks local mode for; `InputError` where its budget is
    outside what the contract allows (refused here, not after the model has started)."""
    minutes = getattr(args, "tune_minutes", None)
    if minutes is None:
        return None
    from worker.contract.protocol import TuneRefused, parse_tune
    from worker.link.local import local_tune_block

    block = local_tune_block(minutes=minutes)
    if isinstance(refused := parse_tune(block), TuneRefused):
        raise InputError(f"--tune-minutes: {refused}")
    return block


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    arguments = _with_command(parser, list(sys.argv[1:] if argv is None else argv))
    if _names_no_command(parser, arguments):
        return _no_desktop_app()
    args = parser.parse_args(arguments)
    handler: Handler = args.handler
    settings = load_settings(Paths.resolve(getattr(args, "data_dir", None)))
    return handler(args, settings)


def desktop_arguments(argv: Sequence[str]) -> list[str] | None:
    """The desktop app's arguments when this command line asks for the app (no command, or `run`
    without --headless); None when it names a command of the core, which `main` runs."""
    parser = build_parser()
    arguments = _with_command(parser, list(argv))
    if _names_no_command(parser, arguments):
        return arguments  # the app parses its own options (--coordinator, --minimized, …)
    if "run" not in arguments or "--headless" in arguments:
        return None
    args = parser.parse_args(arguments)
    return _app_arguments(args) if args.command == "run" else None


def _with_command(parser: CommandLine, arguments: list[str]) -> list[str]:
    """`gpu-provider --headless …` is `gpu-provider run --headless …`."""
    if "--headless" in arguments and not parser.command_names & set(arguments):
        return ["run", *arguments]
    return arguments


def _names_no_command(parser: CommandLine, arguments: list[str]) -> bool:
    """No command named (and no --help/--version): the command line is the desktop app's."""
    asks_the_cli = {"-h", "--help", "--version"} & set(arguments)
    return not asks_the_cli and not parser.command_names & set(arguments)


def _no_desktop_app() -> int:
    """The desktop app was asked for where it cannot open: no PySide6, no display, or `python -m worker`."""
    print("gpu-provider: the desktop app (no command, or `run` without --headless) cannot open here: it needs "
          "PySide6 (pip install 'gpu-provider[gui]') and a display, and opens from the `gpu-provider` command "
          "or `python -m app`, not `python -m worker`. To run the node without a window: "
          "gpu-provider run --headless", file=sys.stderr)
    return 1


def run_detect(args: argparse.Namespace, settings: Settings) -> int:
    from worker.engines.finding import Finder
    from worker.hardware import detect, load_reading

    try:
        engine_bins = parse_engine_bins(args.engine_bin)
        host, nvml = _load(args.reading, "reading", load_reading) if args.reading else (None, None)
    except InputError as exc:
        return _print_error(str(exc))
    machine = detect(settings, Finder(engine_bins), host=host, nvml=nvml)
    if args.pretty:
        from worker.hardware.pretty import machine_table

        print(machine_table(machine))
    else:
        print(json.dumps(machine.to_detect_json()))
    return 0


def parse_engine_bins(values: Sequence[str]) -> dict[str, str]:
    from worker.engines import registry

    names = registry.names()
    bins: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or name not in names or not path:
            raise InputError(f"--engine-bin {value!r}: expected NAME=PATH with NAME one of {', '.join(names)}")
        bins[name] = path
    return bins


def run_plan(args: argparse.Namespace, settings: Settings) -> int:
    from worker.engines import registry
    from worker.hardware import Machine
    from worker.plan.planner import Refusal, plan
    from worker.contract.protocol import ENGINE_NAMES, Assign

    try:
        machine = _load(args.hardware, "hardware", lambda p: Machine.from_detect_json(_read_json(p)))
        assign = _load(args.assignment, "assignment", lambda p: Assign.model_validate(
            _read_json(p), context={ENGINE_NAMES: registry.names()}))
    except InputError as exc:
        return _print_error(str(exc))
    result = plan(machine, assign, settings)
    if isinstance(result, Refusal):
        return _print_error(result.reason)
    print(json.dumps(result.to_json()))
    return 0


def run_node(args: argparse.Namespace, settings: Settings) -> int:
    if not args.headless:
        return _no_desktop_app()
    from worker.system.config import DataFolderUnsafe
    from worker.system.datalock import DataFolderInUse
    from worker.node.headless import run_headless
    from worker.measure.ledger import LedgerError

    try:
        engine_bins = parse_engine_bins(args.engine_bin)
        tune = local_tune(args)
    except InputError as exc:
        print(f"gpu-provider: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    paths = Paths.resolve(getattr(args, "data_dir", None))
    try:
        return run_headless(
            paths,
            settings,
            coordinator_url=args.coordinator or settings.coordinator_url,
            hardware_override=Path(args.hardware) if args.hardware else None,
            engine_bins=engine_bins,
            model=args.model,
            openai_port=args.openai_port,
            local_tune=tune,
            verbose=args.verbose,
        )
    except (DataFolderInUse, DataFolderUnsafe, LedgerError) as exc:  # nothing was read or written through it
        print(f"gpu-provider: {exc}", file=sys.stderr)
        return EXIT_REFUSED


def _app_arguments(args: argparse.Namespace) -> list[str]:
    """`run` without --headless opens the app with the same options."""
    out: list[str] = []
    if getattr(args, "data_dir", None):
        out += ["--data-dir", args.data_dir]
    for flag in ("coordinator", "hardware", "model"):
        if getattr(args, flag):
            out += [f"--{flag}", getattr(args, flag)]
    for value in args.engine_bin:
        out += ["--engine-bin", value]
    return out


def run_status(args: argparse.Namespace, settings: Settings) -> int:
    from worker.node.status import read_status, status_table

    paths = Paths.resolve(getattr(args, "data_dir", None))
    found = read_status(paths)
    if found is None:
        print("No gpu-provider node is running (start one with `gpu-provider` or `gpu-provider run --headless`).")
        return 1
    print(json.dumps(found) if args.json else status_table(found))
    return 0


def run_tune(args: argparse.Namespace, settings: Settings) -> int:
    import asyncio

    from worker.contract.protocol import TuneRefused
    from worker.node.tune_command import TuneInputError, tune_here
    from worker.system.config import DataFolderUnsafe
    from worker.system.datalock import DataFolderInUse

    try:
        engine_bins = parse_engine_bins(args.engine_bin)
        return asyncio.run(tune_here(Paths.resolve(getattr(args, "data_dir", None)), settings, args.model,
                                     engine=args.engine, base_args=args.base_args, minutes=args.minutes,
                                     trials=args.trials, engine_bins=engine_bins, as_json=args.json,
                                     space=args.space))
    except (InputError, TuneInputError, TuneRefused, DataFolderInUse, DataFolderUnsafe) as exc:
        return _print_error(str(exc))


def run_setup(args: argparse.Namespace, settings: Settings) -> int:
    from worker.node.setup_command import main_setup

    return main_setup(args, settings)


def _load(path: str, what: str, reader: Callable[[str], T]) -> T:
    """Read one input file; any failure becomes an InputError naming the file and the cause."""
    try:
        return reader(path)
    except OSError as exc:
        raise InputError(f"cannot read the {what} file {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise InputError(f"the {what} file {path} is not JSON: {exc}") from exc
    except RecursionError as exc:  # json.loads on brackets nested thousands deep
        raise InputError(f"the {what} file {path} is nested too deeply to be a valid {what}") from exc
    except (ValueError, KeyError, TypeError) as exc:
        detail = " ".join(str(exc).split())[:400]
        raise InputError(f"the {what} file {path} is not a valid {what}: {detail}") from exc


def _read_json(path: str) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _print_error(message: str) -> int:
    print(json.dumps({"error": message}))
    return EXIT_REFUSED
