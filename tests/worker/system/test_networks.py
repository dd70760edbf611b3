import json
from pathlib import Path

from worker.system import networks


def test_the_build_names_a_real_network_with_an_account_page() -> None:
    real = networks.official()
    assert real.coordinator_url.startswith("wss://")
    assert real.account_url.startswith("https://")
    assert not real.is_local
    assert networks.choices() == (real, networks.LOCAL)
    assert networks.LOCAL.is_local


def test_another_build_configuration_is_read(tmp_path: Path) -> None:
    config = tmp_path / "network.json"
    config.write_text(json.dumps({"name": "N", "coordinator_url": "wss://n.example/v1", "account_url": "https://n.example/a",
                                  "currency": "EUR"}))
    assert networks.official(config) == networks.Network("N", "wss://n.example/v1", "https://n.example/a", "EUR")


def test_an_address_from_the_command_line_gets_a_network_named_after_it() -> None:
    other = networks.for_url("wss://elsewhere.example/v1")
    assert other.name == "wss://elsewhere.example/v1" and other.account_url == ""
    assert networks.for_url("local") == networks.LOCAL
