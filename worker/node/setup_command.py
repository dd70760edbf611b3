"""`gpu-provider setup`: the desktop app's first-run choices in a terminal (which network, the
provider token, the electricity price, the GPUs to lend, start at login, pause for games), saved
with `setup_complete` so that the app's node starts work at once.

Asked one by one (Enter keeps what is shown), or with `--yes` taken from the flags and the current
settings without a question, for scripts. A price far outside what homes pay gets the same
question as in the app (`measure.prices.price_doubt`); a script keeps such a price only with
`--keep-price`. The token is read hidden, never from the command line, and kept in the keyring.
"""

from __future__ import annotations

import argparse
import getpass
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import keyring.errors

from worker.hardware import Machine
from worker.measure.prices import price_doubt
from worker.system import autostart, networks, secrets
from worker.system.config import Paths, Settings, save_settings
from worker.system.networks import Network

LEND_ONE = "Lend at least one GPU (to stop serving, pause instead)."
MAX_ANSWER = 200  # characters of one typed answer


T = TypeVar("T")


class SetupInputError(Exception):
    """A flag or an answer that cannot be used; the message says why and what would do."""


@dataclass(frozen=True)
class Terminal:
    """Where the questions go and the answers come from (a test's script, or the person)."""

    ask: Callable[[str], str] = input
    secret: Callable[[str], str] = getpass.getpass
    say: Callable[[str], None] = print


@dataclass(frozen=True)
class Choices:
    network: Network
    price_per_kwh: float
    gpus_to_lend: tuple[int, ...] | None  # None: every GPU
    start_at_login: bool
    pause_for_games: bool


def network_named(name: str) -> Network:
    """`official`, `local`, or a coordinator's wss:// (or ws:// on this computer) address."""
    if name == "official":
        return networks.official()
    if name == "local":
        return networks.LOCAL
    if name.startswith("wss://") or name.startswith(("ws://127.0.0.1", "ws://localhost")):
        return networks.for_url(name)
    raise SetupInputError(f"--network {name[:MAX_ANSWER]!r}: expected official, local or a wss:// address")


def parse_gpus(text: str, machine: Machine) -> tuple[int, ...] | None:
    """ "all", or GPU numbers as `detect` lists them ("0,1"); None: every GPU."""
    text = text.strip().lower()
    if text == "all":
        return None
    present = {g.index for g in machine.gpus}
    try:
        chosen = tuple(sorted({int(part) for part in text[:MAX_ANSWER].split(",") if part.strip()}))
    except ValueError:
        raise SetupInputError(f"{text[:40]!r}: expected all, or GPU numbers such as 0,1") from None
    unknown = [i for i in chosen if i not in present]
    if unknown:
        raise SetupInputError(f"no GPU {unknown[0]} on this computer (it has {_numbers(present) or 'none'})")
    if not chosen:
        raise SetupInputError(LEND_ONE)
    return None if set(chosen) == present else chosen


def parse_price(text: str) -> float:
    try:
        price = float(text.strip()[:MAX_ANSWER].replace(",", "."))
    except ValueError:
        raise SetupInputError(f"{text[:40]!r} is not a price: type a number such as 0.32") from None
    if not math.isfinite(price) or price < 0:
        raise SetupInputError("the price cannot be negative: use 0 to leave electricity out")
    return price


def from_flags(args: argparse.Namespace, settings: Settings, machine: Machine, games: bool) -> Choices:
    """`--yes`: the flags given, the current settings for the rest; a doubtful price refused
    unless `--keep-price`."""
    network = network_named(args.network) if args.network else networks.for_url(settings.coordinator_url)
    price = settings.electricity_price_per_kwh if args.price is None else parse_price(str(args.price))
    doubt = price_doubt(price, network.currency)
    if doubt is not None and not args.keep_price:
        raise SetupInputError(f"{doubt} Pass --keep-price to keep it.")
    lent = settings.gpus_to_lend if args.gpus is None else parse_gpus(args.gpus, machine)
    login = settings.start_at_login if args.start_at_login is None else args.start_at_login
    pause = settings.auto_pause_for_games if args.pause_for_games is None else args.pause_for_games
    return Choices(network, price, lent, login, pause and games)


def ask_person(settings: Settings, machine: Machine, games: bool, term: Terminal) -> Choices:
    """The flow's questions one by one; Enter keeps what is shown in brackets."""
    offered = networks.choices()
    current = networks.for_url(settings.coordinator_url)
    term.say("Where should your GPU work?")
    for number, network in enumerate(offered, 1):
        term.say(f"  {number}. {network.name}")
    default = offered.index(current) + 1 if current in offered else 1
    network = offered[_ask(term, "Network", str(default), lambda t: _menu(t, len(offered))) - 1]
    if not network.is_local:
        _ask_token(network, term)
    price = _ask_price(network, settings.electricity_price_per_kwh, term)
    lent: tuple[int, ...] | None = None
    if machine.gpus:
        for gpu in machine.gpus:
            term.say(f"  GPU {gpu.index}: {gpu.name}, {gpu.memory_total_mib / 1024:.1f} GiB")
        shown = "all" if settings.gpus_to_lend is None else _numbers(settings.gpus_to_lend)
        lent = _ask(term, "GPUs to lend (all, or numbers such as 0,1)", shown, lambda t: parse_gpus(t, machine))
    login = _ask(term, "Start GPU Provider when you log in? (y/n)", _yn(settings.start_at_login), _yes_no)
    pause = games and _ask(term, "Pause while you play a game? (y/n)", _yn(settings.auto_pause_for_games), _yes_no)
    return Choices(network, price, lent, login, pause)


def save(paths: Paths, settings: Settings, choices: Choices, login_item: autostart.Autostart) -> Settings:
    """Saved with `setup_complete`, and the login item follows the choice. `OSError`: nothing was."""
    updated = settings.with_changes(
        coordinator_url=choices.network.coordinator_url, currency=choices.network.currency,
        electricity_price_per_kwh=choices.price_per_kwh, gpus_to_lend=choices.gpus_to_lend,
        start_at_login=choices.start_at_login, auto_pause_for_games=choices.pause_for_games, setup_complete=True)
    autostart.apply_setting(login_item, was_on=settings.start_at_login, now_on=updated.start_at_login)
    save_settings(paths, updated)
    return updated


def summary(choices: Choices, machine: Machine) -> list[str]:
    """What the saved choices make the node do, in the flow's words."""
    gpus = [g for g in machine.gpus if choices.gpus_to_lend is None or g.index in choices.gpus_to_lend]
    where = ", ".join(f"GPU {g.index} ({g.name})" for g in gpus) or "this computer's processor"
    earns = ("nothing is earned: only programs on this computer use it" if choices.network.is_local
             else f"it earns {choices.network.currency} for each answer")
    return [f"Set up: {where} will answer chat requests for {choices.network.name}; {earns}.",
            "Start it with `gpu-provider` (the desktop app) or `gpu-provider run --headless`."]


def run_setup(args: argparse.Namespace, settings: Settings, paths: Paths, machine: Machine, games: bool,
              login_item: autostart.Autostart, term: Terminal = Terminal()) -> int:
    """2 with the reason when a flag or the saving fails; 0 once saved."""
    try:
        choices = from_flags(args, settings, machine, games) if args.yes else ask_person(settings, machine, games, term)
        save(paths, settings, choices, login_item)
    except SetupInputError as exc:
        term.say(f"gpu-provider setup: {exc}")
        return 2
    except (EOFError, KeyboardInterrupt):
        term.say("gpu-provider setup: stopped; nothing was saved.")
        return 2
    except (OSError, ValueError) as exc:
        term.say(f"gpu-provider setup: could not save the settings ({exc}); check that {paths.settings_file.parent} "
                 "is writable. Nothing was changed.")
        return 2
    for line in summary(choices, machine):
        term.say(line)
    return 0


def machine_for(settings: Settings, hardware: str | None) -> Machine:
    """This computer as the node will see it (or a `detect` output given with --hardware)."""
    import json

    from worker.engines.finding import Finder
    from worker.hardware import detect

    if hardware:
        return Machine.from_detect_json(json.loads(Path(hardware).read_text(encoding="utf-8")))
    return detect(settings, Finder({}))


# --- asking ----------------------------------------------------------------------------------------


def _ask(term: Terminal, question: str, shown: str, parse: Callable[[str], T]) -> T:
    """Asked until the answer parses (Enter: `shown`), each refusal said in words."""
    while True:
        answer = term.ask(f"{question} [{shown}]: ").strip() or shown
        try:
            return parse(answer)
        except SetupInputError as exc:
            term.say(f"  {exc}")


def _ask_price(network: Network, kept: float, term: Terminal) -> float:
    """The price, with the app's question for one far from what homes pay (the same answer twice keeps it)."""
    term.say(f"What does one kWh of electricity cost you, in {network.currency}? (0 leaves it out)")
    asked: float | None = None
    while True:
        price = _ask(term, "Price per kWh", f"{kept:g}", parse_price)
        doubt = price_doubt(price, network.currency)
        if doubt is None or price == asked:
            return price
        term.say(f"  {doubt} Type it again to keep it.")
        asked = price


def _ask_token(network: Network, term: Terminal) -> None:
    """The provider token, hidden, kept in the keyring; Enter keeps the one there (or signs in later)."""
    if secrets.get_token():
        return
    term.say(f"Your provider token is at {network.account_url}")
    token = term.secret("Paste it (hidden; Enter to sign in later): ").strip()
    if not token:
        return
    try:
        secrets.set_token(token)
    except (secrets.InsecureKeyring, keyring.errors.KeyringError) as exc:
        term.say(f"  Could not keep the token: {exc}")


def _menu(text: str, count: int) -> int:
    if text.isdigit() and 1 <= int(text) <= count:
        return int(text)
    raise SetupInputError(f"type a number from 1 to {count}")


def _yes_no(text: str) -> bool:
    if text.lower() in ("y", "yes"):
        return True
    if text.lower() in ("n", "no"):
        return False
    raise SetupInputError("type y or n")


def _yn(value: bool) -> str:
    return "y" if value else "n"


def _numbers(indices: Sequence[int] | set[int]) -> str:
    return ",".join(str(i) for i in sorted(indices))


def main_setup(args: argparse.Namespace, settings: Settings) -> int:
    """`gpu-provider setup` from the command line: this computer, its login item, the person."""
    from worker.node import autopause

    paths = Paths.resolve(getattr(args, "data_dir", None))
    try:
        machine = machine_for(settings, args.hardware)
    except (OSError, ValueError, KeyError) as exc:
        print(f"gpu-provider setup: cannot read the hardware file {args.hardware}: {exc}", file=sys.stderr)
        return 2
    games = autopause.detection_limit(nvml=bool(machine.gpus)) != autopause.GAMES_NOT_SEEN
    login_item = autostart.for_platform(data_dir=getattr(args, "data_dir", None))
    return run_setup(args, settings, paths, machine, games, login_item)
