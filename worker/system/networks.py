"""The networks a person can lend to: the real one this build was made for, and "this computer
only" (the built-in local coordinator, to try the app without an account).

The real network's addresses are the build's configuration (`network.json` beside this module,
replaced by whoever builds an installer for another network), never the coordinator's word.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = Path(__file__).with_name("network.json")


@dataclass(frozen=True)
class Network:
    name: str
    coordinator_url: str  # wss://…, or "local"
    account_url: str  # where a provider finds their token; "" where there is no account
    currency: str  # what the network pays in; the electricity price is asked in it too

    @property
    def is_local(self) -> bool:
        return self.coordinator_url == "local"


LOCAL = Network("Only this computer (try it out)", "local", "", "USD")


def official(config: Path = CONFIG_FILE) -> Network:
    """The network this build serves, from its configuration file."""
    data = json.loads(config.read_text(encoding="utf-8"))
    return Network(
        name=str(data["name"]),
        coordinator_url=str(data["coordinator_url"]),
        account_url=str(data["account_url"]),
        currency=str(data["currency"]),
    )


def choices() -> tuple[Network, ...]:
    """What the first-run flow and Settings offer, the real network first."""
    return (official(), LOCAL)


def for_url(url: str) -> Network:
    """The known network at `url`, or one named after the address (a URL given on the command line)."""
    for network in choices():
        if network.coordinator_url == url:
            return network
    return Network(url, url, "", official().currency)
