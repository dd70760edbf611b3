"""`gpu-provider setup`: the first-run choices in a terminal, asked or taken from flags, the
price questioned as the app does, saved with `setup_complete` and the login item following."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from worker.hardware import Gpu, Machine
from worker.hardware.model import GpuGroup
from worker.node.cli import build_parser, main
from worker.node.setup_command import Terminal, run_setup
from worker.system import autostart, networks
from worker.system.config import Paths, Settings, load_settings

CARDS = tuple(Gpu(index=i, uuid=f"GPU-{i}", name="NVIDIA GeForce RTX 4090", memory_total_mib=24564,
                  memory_free_mib=23000, usable_mib=20188) for i in range(2))
MACHINE = Machine(os="linux", runtime="native", arch="x86_64", cpu_model="cpu", cpu_cores=8, ram_mib=65536,
                  gpus=CARDS, groups=(GpuGroup(gpu_indices=(0, 1), name="NVIDIA GeForce RTX 4090",
                                               usable_mib_per_gpu=20188),), effective_vram_mib=40376)


class Script:
    """A person at the terminal: the answers they type, what they were told."""

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.told: list[str] = []
        self.asked: list[str] = []

    def ask(self, question: str) -> str:
        self.asked.append(question)
        return self.answers.pop(0)

    def say(self, text: str) -> None:
        self.told.append(text)

    def terminal(self) -> Terminal:
        return Terminal(ask=self.ask, secret=self.ask, say=self.say)


def flags(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["setup", *argv])


def setup(tmp_path: Path, args: argparse.Namespace, script: Script, games: bool = True,
          settings: Settings = Settings()) -> tuple[int, Paths, autostart.XdgAutostart]:
    paths = Paths.under(tmp_path / "data").ensure()
    login = autostart.XdgAutostart(["gpu-provider"], config_home=tmp_path / "config")
    code = run_setup(args, settings, paths, MACHINE, games, login, script.terminal())
    return code, paths, login


def test_yes_takes_the_flags_saves_as_set_up_and_follows_the_login_choice(tmp_path: Path) -> None:
    script = Script()
    code, paths, login = setup(tmp_path, flags("--yes", "--network", "local", "--price", "0.32", "--gpus", "1",
                                               "--start-at-login", "--no-pause-for-games"), script)
    assert code == 0 and script.asked == []
    saved = load_settings(paths)
    assert (saved.setup_complete, saved.coordinator_url, saved.electricity_price_per_kwh, saved.gpus_to_lend,
            saved.start_at_login, saved.auto_pause_for_games) == (True, "local", 0.32, (1,), True, False)
    assert login.is_enabled()
    assert script.told[0] == ("Set up: GPU 1 (NVIDIA GeForce RTX 4090) will answer chat requests for "
                              f"{networks.LOCAL.name}; nothing is earned: only programs on this computer use it.")


def test_yes_refuses_a_price_no_home_pays_unless_kept(tmp_path: Path) -> None:
    script = Script()
    code, paths, _ = setup(tmp_path, flags("--yes", "--network", "local", "--price", "32"), script)
    assert code == 2 and not paths.settings_file.exists()
    assert "$32.00 per kWh is about 200 times what most homes pay — did you mean $0.32?" in script.told[0]
    assert "--keep-price" in script.told[0]
    code, paths, _ = setup(tmp_path, flags("--yes", "--network", "local", "--price", "32", "--keep-price"), script)
    assert code == 0 and load_settings(paths).electricity_price_per_kwh == 32.0


@pytest.mark.parametrize(("argv", "words"), [
    (("--gpus", "7"), "no GPU 7 on this computer (it has 0,1)"),
    (("--gpus", "one"), "expected all, or GPU numbers such as 0,1"),
    (("--network", "http://example.com"), "expected official, local or a wss:// address"),
    (("--price", "-1"), "the price cannot be negative"),
])
def test_yes_refuses_what_cannot_be_used_and_saves_nothing(tmp_path: Path, argv: tuple[str, ...], words: str) -> None:
    script = Script()
    code, paths, _ = setup(tmp_path, flags("--yes", *argv), script)
    assert code == 2 and words in script.told[0] and not paths.settings_file.exists()


def test_asked_one_by_one_the_price_questioned_and_bad_answers_asked_again(tmp_path: Path) -> None:
    local = str(networks.choices().index(networks.LOCAL) + 1)
    script = Script(local, "32", "0.32", "5", "0", "maybe", "y", "")
    code, paths, login = setup(tmp_path, flags(), script, settings=Settings(auto_pause_for_games=True))
    assert code == 0 and script.answers == []
    saved = load_settings(paths)
    assert (saved.setup_complete, saved.coordinator_url, saved.electricity_price_per_kwh, saved.gpus_to_lend,
            saved.start_at_login, saved.auto_pause_for_games) == (True, "local", 0.32, (0,), True, True)
    told = "\n".join(script.told)
    assert "$32.00 per kWh is about 200 times what most homes pay — did you mean $0.32? Type it again to keep it." in told
    assert "no GPU 5 on this computer" in told and "type y or n" in told
    assert login.is_enabled()


def test_the_game_pause_is_not_asked_where_games_cannot_be_seen(tmp_path: Path) -> None:
    local = str(networks.choices().index(networks.LOCAL) + 1)
    script = Script(local, "", "all", "n")
    code, paths, login = setup(tmp_path, flags(), script, games=False)
    assert code == 0 and not any("game" in q for q in script.asked)
    saved = load_settings(paths)
    assert (saved.gpus_to_lend, saved.auto_pause_for_games, saved.start_at_login) == (None, False, False)
    assert not login.is_enabled()


def test_the_official_network_asks_for_the_token_hidden_and_enter_signs_in_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPU_PROVIDER_TOKEN", raising=False)
    monkeypatch.setattr("worker.system.secrets.get_token", lambda: None)
    official = str(networks.choices().index(networks.official()) + 1)
    script = Script(official, "", "0.30", "", "n", "n")
    code, paths, _ = setup(tmp_path, flags(), script)
    assert code == 0 and any("Paste it (hidden" in q for q in script.asked)
    assert load_settings(paths).coordinator_url == networks.official().coordinator_url


def test_typed_at_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hardware = tmp_path / "machine.json"
    hardware.write_text(json.dumps(MACHINE.to_detect_json()), encoding="utf-8")
    data = tmp_path / "data"
    assert main(["setup", "--data-dir", str(data), "--yes", "--network", "local", "--price", "0.25",
                 "--hardware", str(hardware)]) == 0
    saved = load_settings(Paths.under(data))
    assert saved.setup_complete and saved.electricity_price_per_kwh == 0.25
    assert "will answer chat requests" in capsys.readouterr().out
