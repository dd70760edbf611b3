"""The first-run flow, page by page, offscreen and in both schemes, against a scripted node."""

from __future__ import annotations

import os
from dataclasses import replace

import keyring
import pytest
from keyring.backends import fail
from PySide6.QtWidgets import QWizard

from app import theme
from app.bridge import Bridge
from app.first_run import GPUS, HABITS, NETWORK, PRICE, SIGN_IN, FirstRunFlow
from app.format import CPU_ONLY, FINDING_GPUS
from app.signin import NO_KEYRING
from tests.app import snapshots
from tests.app.conftest import REAL, TOKEN
from tests.app.scripted_node import ScriptedNode
from worker.system import networks
from worker.system import secrets
from worker.system.config import Settings, load_settings

CHOICES = (REAL, networks.LOCAL)





def start(qtbot, paths, bridge, login_item, settings: Settings | None = None) -> FirstRunFlow:
    flow = FirstRunFlow(settings or Settings(), bridge, login_item, choices=CHOICES)
    qtbot.addWidget(flow)
    flow.show()
    return flow


def click(flow: FirstRunFlow, which: QWizard.WizardButton) -> None:
    flow.button(which).click()


def next_page(flow: FirstRunFlow) -> int:
    click(flow, QWizard.WizardButton.NextButton)
    return flow.currentId()


def test_the_real_network_signs_in_and_finish_saves_everything(qtbot, scheme, paths, bridge, node, login_item,
                                                               memory_keyring):
    flow = start(qtbot, paths, bridge, login_item)
    assert flow.currentId() == NETWORK and flow.network() == REAL  # the real network is offered first
    background = flow.grab().toImage().pixelColor(3, 3).name()
    assert background == theme.colours().window.lower()  # the flow follows the scheme

    assert next_page(flow) == SIGN_IN
    link = flow.sign_in_page.form.link
    assert 'href="https://example.net/account/tokens"' in link.text() and link.openExternalLinks()
    assert next_page(flow) == SIGN_IN  # no token yet
    assert flow.sign_in_page.form.message.text() == "Paste your provider token first."
    assert flow.sign_in_page.form.message.objectName() == "error"
    flow.sign_in_page.form.token.setText(f" {TOKEN} ")
    assert next_page(flow) == PRICE
    assert list(memory_keyring.passwords.values()) == [TOKEN]

    assert flow.price_page.price_field.currency.text() == "EUR per kWh"  # the network's currency
    flow.price_page.price_field.price.setText("0,31")
    assert next_page(flow) == GPUS
    boxes = flow.gpu_page.choice.boxes
    assert [box.text() for box in boxes.values()] == ["GPU 0: NVIDIA GeForce RTX 4090, 24.0 GiB",
                                                       "GPU 1: NVIDIA GeForce RTX 4090, 24.0 GiB"]
    assert all(box.isChecked() for box in boxes.values())
    boxes[1].setChecked(False)
    assert next_page(flow) == HABITS
    flow.habits_page.start_at_login.setChecked(True)
    assert flow.habits_page.pause_for_games.isChecked()  # on unless the person turns it off
    click(flow, QWizard.WizardButton.FinishButton)

    saved = load_settings(paths)
    assert saved == Settings(coordinator_url=REAL.coordinator_url, currency="EUR", electricity_price_per_kwh=0.31,
                             gpus_to_lend=(0,), start_at_login=True, auto_pause_for_games=True, setup_complete=True)
    assert login_item.is_enabled()
    assert node.commands == [("save_settings", saved), ("token_changed", None)]
    assert flow.result() == QWizard.DialogCode.Accepted and not flow.isVisible()


def test_only_this_computer_skips_signing_in(qtbot, scheme, paths, bridge, node, login_item, memory_keyring):
    flow = start(qtbot, paths, bridge, login_item)
    flow.network_page.buttons[1].setChecked(True)
    assert flow.network() == networks.LOCAL
    assert next_page(flow) == PRICE
    assert flow.price_page.price_field.currency.text() == "USD per kWh"
    assert next_page(flow) == GPUS
    assert next_page(flow) == HABITS
    flow.habits_page.pause_for_games.setChecked(False)
    click(flow, QWizard.WizardButton.FinishButton)

    saved = load_settings(paths)
    assert (saved.coordinator_url, saved.currency, saved.setup_complete) == ("local", "USD", True)
    assert saved.auto_pause_for_games is False and saved.gpus_to_lend is None and not login_item.is_enabled()
    assert node.commands == [("save_settings", saved)]  # no token: nothing to tell the core
    assert memory_keyring.passwords == {}


def test_a_bad_price_is_explained_on_its_page(qtbot, paths, bridge, node, login_item):
    flow = start(qtbot, paths, bridge, login_item)
    flow.network_page.buttons[1].setChecked(True)
    assert next_page(flow) == PRICE
    field, error = flow.price_page.price_field.price, flow.price_page.error
    field.setText("twelve")
    assert next_page(flow) == PRICE
    assert error.isVisible() and error.text() == "Electricity price: “twelve” is not a number."
    field.setText("-0.2")
    assert next_page(flow) == PRICE
    assert "cannot be negative" in error.text()
    field.setText("0.2")
    assert next_page(flow) == GPUS and not error.isVisible()
    assert not paths.settings_file.exists() and node.commands == []


def test_the_gpus_appear_when_detection_finishes(qtbot, scheme, paths, login_item):
    node = ScriptedNode(snapshots.detecting(), paths=paths)
    bridge = Bridge(node)
    flow = start(qtbot, paths, bridge, login_item)
    flow.network_page.buttons[1].setChecked(True)
    next_page(flow)
    assert next_page(flow) == GPUS
    choice = flow.gpu_page.choice
    assert choice.note.isVisible() and choice.note.text() == FINDING_GPUS and choice.boxes == {}
    node.emit(snapshots.idle())
    assert sorted(choice.boxes) == [0, 1] and not choice.note.isVisible()
    qtbot.waitUntil(lambda: all(box.isVisible() for box in choice.boxes.values()), timeout=2000)
    choice.boxes[0].setChecked(False)
    node.emit(replace(snapshots.idle(), at=snapshots.NOW + 5))  # same GPUs: the choice stays
    assert not choice.boxes[0].isChecked() and choice.boxes[1].isChecked()
    for box in choice.boxes.values():
        box.setChecked(False)
    assert next_page(flow) == GPUS
    assert flow.gpu_page.error.text() == "Lend at least one GPU (to stop serving, pause instead)."
    choice.boxes[1].setChecked(True)
    assert next_page(flow) == HABITS
    click(flow, QWizard.WizardButton.FinishButton)
    assert load_settings(paths).gpus_to_lend == (1,)


def test_a_computer_without_a_gpu_serves_on_its_cpu(qtbot, paths, login_item):
    node = ScriptedNode(replace(snapshots.idle(), runtime="cpu", gpus=(), groups=(), effective_vram_mib=0))
    bridge = Bridge(node)
    flow = start(qtbot, paths, bridge, login_item)
    flow.network_page.buttons[1].setChecked(True)
    next_page(flow)
    assert next_page(flow) == GPUS
    choice = flow.gpu_page.choice
    assert choice.note.text() == CPU_ONLY and "small models on its CPU" in CPU_ONLY and choice.boxes == {}
    assert next_page(flow) == HABITS


def test_without_a_secure_keyring_the_token_is_kept_for_the_session_only(qtbot, paths, bridge, node, login_item,
                                                                         memory_keyring, monkeypatch, tmp_path):
    keyring.set_keyring(fail.Keyring())
    monkeypatch.setenv("GPU_PROVIDER_TOKEN", "")
    flow = start(qtbot, paths, bridge, login_item)
    assert next_page(flow) == SIGN_IN
    form = flow.sign_in_page.form
    form.token.setText(TOKEN)
    assert next_page(flow) == SIGN_IN
    assert form.message.text() == NO_KEYRING and form.message.objectName() == "warning"
    assert os.environ["GPU_PROVIDER_TOKEN"] == ""  # nothing kept until the person chooses
    form.session_only.click()
    assert flow.currentId() == PRICE
    assert secrets.get_token() == TOKEN
    next_page(flow)
    next_page(flow)
    click(flow, QWizard.WizardButton.FinishButton)
    assert node.commands[-1] == ("token_changed", None)
    written = [p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()]
    assert written and not any(TOKEN.encode() in data for data in written)  # never in a file


def test_cancel_saves_nothing_and_asks_again(qtbot, paths, bridge, node, login_item, memory_keyring):
    flow = start(qtbot, paths, bridge, login_item)
    flow.network_page.buttons[1].setChecked(True)
    next_page(flow)
    flow.price_page.price_field.price.setText("0.4")
    next_page(flow)
    click(flow, QWizard.WizardButton.CancelButton)
    assert flow.result() == QWizard.DialogCode.Rejected
    assert not paths.settings_file.exists() and node.commands == [] and not login_item.is_enabled()
    assert load_settings(paths).setup_complete is False


def test_an_earlier_setup_is_the_starting_point(qtbot, paths, bridge, login_item, memory_keyring):
    earlier = Settings(electricity_price_per_kwh=0.25, gpus_to_lend=(1,), auto_pause_for_games=False)
    flow = start(qtbot, paths, bridge, login_item, earlier)
    assert flow.price_page.price_field.price.text() == "0.25"
    assert not flow.gpu_page.choice.boxes[0].isChecked() and flow.gpu_page.choice.boxes[1].isChecked()
    assert not flow.habits_page.pause_for_games.isChecked()


def test_a_network_named_on_the_command_line_is_chosen(qtbot, paths, bridge, login_item):
    other = networks.for_url("wss://other.example.org/v1/node")
    flow = FirstRunFlow(Settings(), bridge, login_item, chosen=other, choices=CHOICES)
    qtbot.addWidget(flow)
    assert flow.network() == other and len(flow.network_page.buttons) == 3


def test_a_failed_save_is_explained_and_the_flow_stays_open(qtbot, paths, bridge, node, login_item):
    paths.settings_file.mkdir()  # where the file goes, a folder: the write fails (also as root)
    flow = start(qtbot, paths, bridge, login_item)
    flow.network_page.buttons[1].setChecked(True)
    for _ in range(3):
        next_page(flow)
    click(flow, QWizard.WizardButton.FinishButton)
    assert flow.isVisible() and flow.currentId() == HABITS
    assert flow.habits_page.error.isVisible() and "Could not save the settings" in flow.habits_page.error.text()
    assert node.commands == []


def test_the_last_page_says_what_start_will_do(qtbot, paths, bridge, node, login_item, memory_keyring):
    flow = start(qtbot, paths, bridge, login_item)
    flow.network_page.buttons[1].setChecked(True)  # only this computer
    for _ in range(3):
        next_page(flow)
    assert flow.currentId() == HABITS
    said = flow.habits_page.summary.text()
    assert "small test model (about 0.5 GiB)" in said and "Nothing is earned" in said
    assert "GPU 0 (NVIDIA GeForce RTX 4090), GPU 1 (NVIDIA GeForce RTX 4090) will answer" in said
    click(flow, QWizard.WizardButton.BackButton)
    flow.gpu_page.choice.boxes[1].setChecked(False)
    click(flow, QWizard.WizardButton.BackButton)
    click(flow, QWizard.WizardButton.BackButton)
    flow.network_page.buttons[0].setChecked(True)  # the real network: a model it picks, within the GPUs lent
    next_page(flow)
    flow.sign_in_page.form.token.setText(TOKEN)
    for _ in range(3):
        next_page(flow)
    said = flow.habits_page.summary.text()
    assert "Downloads the model Test Network picks for your GPUs (at most 20.6 GiB" in said  # GPU 0's usable memory
    assert "GPU 1" not in said and "It earns EUR for each answer" in said
    assert node.commands == []  # nothing saved or started while the flow is open


def test_a_price_no_home_pays_is_asked_about_once(qtbot, paths, bridge, node, login_item):
    flow = start(qtbot, paths, bridge, login_item)
    flow.network_page.buttons[1].setChecked(True)
    assert next_page(flow) == PRICE
    flow.price_page.price_field.price.setText("32")
    assert next_page(flow) == PRICE  # asked, not refused
    assert "did you mean $0.32?" in flow.price_page.error.text() and flow.price_page.error.isVisible()
    assert next_page(flow) == GPUS  # the person meant it
    assert flow.price_page.price == 32
    click(flow, QWizard.WizardButton.BackButton)
    flow.price_page.price_field.price.setText("0.32")
    assert next_page(flow) == GPUS and not flow.price_page.error.isVisible()


def test_the_game_pause_is_offered_only_where_games_can_be_seen(qtbot, paths, login_item):
    from worker.node import autopause

    blind = autopause.detection_limit(nvml=False, platform="linux")
    node = ScriptedNode(replace(snapshots.idle(), game_detection=blind), paths=paths)
    flow = start(qtbot, paths, Bridge(node), login_item)
    flow.network_page.buttons[1].setChecked(True)
    for _ in range(3):
        next_page(flow)
    assert not flow.habits_page.pause_for_games.isVisibleTo(flow)
    assert "or play a game" not in flow.habits_page.summary.text()
    seen = ScriptedNode(snapshots.idle(), paths=paths)
    flow = start(qtbot, paths, Bridge(seen), login_item)
    flow.network_page.buttons[1].setChecked(True)
    for _ in range(3):
        next_page(flow)
    assert flow.habits_page.pause_for_games.isVisibleTo(flow)
