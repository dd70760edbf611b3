from __future__ import annotations

import os

import pytest
from PySide6.QtWidgets import QWidget

from app.bridge import Bridge
from app.settings import SettingsDialog
from app.format import FINDING_GPUS
from app.signin import SignInDialog
from tests.app import snapshots
from tests.app.conftest import REAL, TOKEN
from tests.app.scripted_node import ScriptedNode
from worker.system import networks
from worker.system import secrets
from worker.system.config import Settings, load_settings





def dialog_for(qtbot, paths, bridge, login_item, settings: Settings | None = None) -> SettingsDialog:
    dialog = SettingsDialog(settings or Settings(), paths, bridge, login_item, choices=(REAL, networks.LOCAL))
    qtbot.addWidget(dialog)
    return dialog


def test_round_trip_saves_applies_and_reloads(qtbot, paths, bridge, node, login_item):
    dialog = dialog_for(qtbot, paths, bridge, login_item)
    dialog.price.setText("0,31")
    dialog.auto_pause.setChecked(False)
    assert dialog.keep_awake.isChecked()  # on by default: a computer that sleeps stops serving
    dialog.keep_awake.setChecked(False)
    dialog.resume_after_min.setValue(5)
    dialog.limit_hours.setChecked(True)
    dialog.hours_from.setValue(22)
    dialog.hours_to.setValue(7)
    dialog.gpus.boxes[1].setChecked(False)
    dialog.cache_limit.setText("120")
    dialog.start_at_login.setChecked(True)
    dialog.channel.setCurrentText("beta")
    dialog.ignored.setText(" obs64.exe,, blender ")
    dialog.save_button.click()

    saved = load_settings(paths)
    assert saved.electricity_price_per_kwh == 0.31
    assert saved.currency == "USD" and saved.coordinator_url == "local"  # the network's currency
    assert saved.auto_pause_for_games is False
    assert saved.keep_awake_while_serving is False
    assert saved.auto_resume_after_s == 300
    assert saved.serve_hours == (22, 7)
    assert saved.gpus_to_lend == (0,)
    assert saved.model_cache_limit_gib == 120
    assert saved.start_at_login and login_item.is_enabled()
    assert saved.update_channel == "beta"
    assert saved.allow_remote_code is False
    assert saved.autopause_ignored == ("obs64.exe", "blender")
    assert node.commands == [("save_settings", saved)]
    assert dialog.result() == SettingsDialog.DialogCode.Accepted

    again = dialog_for(qtbot, paths, bridge, login_item, saved)
    assert again.price.text() == "0.31" and again.hours_from.value() == 22 and not again.gpus.boxes[1].isChecked()
    assert again.ignored.text() == "obs64.exe, blender"
    assert not again.keep_awake.isChecked()


def test_bad_input_is_explained_and_nothing_is_lost(qtbot, paths, bridge, node, login_item):
    dialog = dialog_for(qtbot, paths, bridge, login_item)
    dialog.show()
    dialog.price.setText("twelve")
    for box in dialog.gpus.boxes.values():
        box.setChecked(False)
    dialog.save_button.click()
    message = dialog.error.text()
    assert "Electricity price: “twelve” is not a number." in message
    assert "Lend at least one GPU" in message
    assert dialog.error.isVisible() and dialog.error.objectName() == "error"
    assert dialog.isVisible() and dialog.price.text() == "twelve"
    assert not paths.settings_file.exists() and node.commands == []


def test_rules_from_settings_are_shown(qtbot, paths, bridge, node, login_item):
    dialog = dialog_for(qtbot, paths, bridge, login_item)
    dialog.cache_limit.setText("-5")
    dialog.save_button.click()
    assert "model_cache_limit_gib must be positive" in dialog.error.text()
    assert not paths.settings_file.exists()


def test_a_removed_login_item_stays_removed_when_other_settings_change(qtbot, paths, bridge, login_item):
    settings = Settings(start_at_login=True)
    dialog = dialog_for(qtbot, paths, bridge, login_item, settings)
    dialog.price.setText("0.2")
    dialog.save_button.click()
    assert load_settings(paths).start_at_login and not login_item.is_enabled()


def test_a_negative_price_is_refused(qtbot, paths, bridge, node, login_item):
    dialog = dialog_for(qtbot, paths, bridge, login_item)
    dialog.price.setText("-0.1")
    dialog.save_button.click()
    assert "cannot be negative" in dialog.error.text()
    assert not paths.settings_file.exists() and node.commands == []


def test_switching_network_saves_it_with_its_currency(qtbot, paths, bridge, node, login_item, memory_keyring):
    dialog = dialog_for(qtbot, paths, bridge, login_item)
    dialog.show()
    assert dialog.chosen_network() == networks.LOCAL and not dialog.account_button.isVisible()
    assert dialog.price_field.currency.text() == "USD per kWh"
    dialog.network.setCurrentIndex(0)
    assert dialog.chosen_network() == REAL
    assert dialog.price_field.currency.text() == "EUR per kWh"
    assert (dialog.account.text(), dialog.account_button.text()) == ("Not signed in", "Sign in…")
    assert dialog.account_button.isVisible()
    dialog.save_button.click()
    saved = load_settings(paths)
    assert (saved.coordinator_url, saved.currency) == (REAL.coordinator_url, "EUR")
    assert node.commands == [("save_settings", saved)]  # the core reconnects to the network applied
    assert dialog.settings == saved


def test_sign_out_forgets_the_token_and_tells_the_core(qtbot, paths, bridge, node, login_item, memory_keyring):
    secrets.set_token(TOKEN)
    dialog = dialog_for(qtbot, paths, bridge, login_item, Settings(coordinator_url=REAL.coordinator_url))
    assert (dialog.account.text(), dialog.account_button.text()) == ("Signed in", "Sign out")
    dialog.account_button.click()
    assert memory_keyring.passwords == {} and secrets.get_token() is None
    assert node.commands == [("sign_out", None)]
    assert (dialog.account.text(), dialog.account_button.text()) == ("Not signed in", "Sign in…")
    assert not paths.settings_file.exists()  # an action, not a setting: nothing to save


def test_sign_out_also_ends_a_session_only_token(qtbot, paths, bridge, node, login_item, memory_keyring,
                                                 monkeypatch):
    monkeypatch.setenv("GPU_PROVIDER_TOKEN", TOKEN)
    dialog = dialog_for(qtbot, paths, bridge, login_item, Settings(coordinator_url=REAL.coordinator_url))
    dialog.sign_out()
    assert "GPU_PROVIDER_TOKEN" not in os.environ and secrets.get_token() is None


def test_sign_in_from_settings(qtbot, paths, bridge, node, login_item, memory_keyring):
    dialog = dialog_for(qtbot, paths, bridge, login_item, Settings(coordinator_url=REAL.coordinator_url))
    dialog.show()
    dialog.account_button.click()
    sign_in = dialog.findChild(SignInDialog)
    assert sign_in is not None and sign_in.isVisible()
    sign_in.token.setText(TOKEN)
    sign_in.sign_in.click()
    assert node.commands == [("token_changed", None)]
    assert (dialog.account.text(), dialog.account_button.text()) == ("Signed in", "Sign out")


def test_the_gpus_appear_when_detection_finishes(qtbot, paths, login_item):
    node = ScriptedNode(snapshots.detecting())
    bridge = Bridge(node)
    dialog = dialog_for(qtbot, paths, bridge, login_item, Settings(gpus_to_lend=(1,)))
    dialog.show()
    assert dialog.gpus.note.text() == FINDING_GPUS and dialog.gpus.boxes == {}
    node.emit(snapshots.idle())
    boxes = dialog.gpus.boxes
    assert not boxes[0].isChecked() and boxes[1].isChecked()
    qtbot.waitUntil(lambda: all(box.isVisible() for box in boxes.values()), timeout=2000)
    qtbot.waitUntil(lambda: all(box.width() >= box.sizeHint().width() for box in boxes.values()), timeout=2000)


def test_no_colours_are_hard_coded(qtbot, paths, bridge, login_item):
    dialog = dialog_for(qtbot, paths, bridge, login_item)
    dialog.price.setText("x")
    dialog.save_button.click()
    assert [w for w in [dialog, *dialog.findChildren(QWidget)] if w.styleSheet()] == []


def test_a_save_the_core_could_not_write_is_explained_and_nothing_is_applied(qtbot, paths, bridge, node, login_item):
    paths.settings_file.mkdir()  # where the file goes, a folder: the core's write fails (also as root)
    dialog = dialog_for(qtbot, paths, bridge, login_item)
    dialog.show()
    dialog.price.setText("0.2")
    dialog.save_button.click()
    assert "Could not save" in dialog.error.text() and dialog.isVisible()
    assert node.commands == [] and dialog.settings == Settings()


def test_the_game_pause_says_where_games_can_be_missed(qtbot, paths, bridge, node, login_item):
    from dataclasses import replace

    from worker.node import autopause

    assert dialog_for(qtbot, paths, bridge, login_item).game_detection.isHidden()  # NVML sees games here
    words = autopause.detection_limit(nvml=False, platform="darwin", window_list=lambda: [])
    assert words
    node.emit(replace(snapshots.idle(), game_detection=words))
    dialog = dialog_for(qtbot, paths, bridge, login_item)
    assert dialog.game_detection.text() == words
    assert not dialog.game_detection.isHidden()


def test_the_lenders_limits_round_trip(qtbot, paths, bridge, node, login_item):
    dialog = dialog_for(qtbot, paths, bridge, login_item)
    assert dialog.max_requests.text() == "No limit" and dialog.temperature.text() == "No limit"
    assert dialog.download_limit.text() == "No limit" and dialog.monthly_budget.text() == "No limit"
    dialog.memory_share.sliders[0].setValue(70)
    dialog.max_requests.setValue(4)
    dialog.temperature.setValue(80)
    dialog.pause_on_battery.setChecked(False)
    dialog.stop_unprofitable.setChecked(False)
    dialog.download_limit.setValue(12.5)
    dialog.monthly_budget.setValue(200)
    dialog.notify_idle.setValue(dialog.notify_idle.minimum())  # never
    dialog.notify_back.setChecked(False)
    dialog.save_button.click()
    saved = load_settings(paths)
    assert saved.memory_share_pct == ((0, 70),)  # GPU 1 lends all of its memory: no entry
    assert (saved.max_requests, saved.temperature_limit_c) == (4, 80)
    assert not saved.pause_on_battery and not saved.stop_when_unprofitable
    assert (saved.download_limit_mib_s, saved.monthly_download_gib) == (12.5, 200)
    assert saved.notify_idle_hours is None and not saved.notify_back_online
    again = dialog_for(qtbot, paths, bridge, login_item, saved)
    assert again.memory_share.sliders[0].value() == 70 and again.memory_share.sliders[1].value() == 100
    assert again.max_requests.value() == 4 and again.temperature.text() == "80 °C"
    assert again.download_limit.text() == "12.5 MiB/s" and again.notify_idle.text() == "Never"
    again.max_requests.setValue(again.max_requests.minimum())
    again.save_button.click()
    assert load_settings(paths).max_requests is None  # back to no limit


def test_the_memory_slider_says_what_it_leaves_before_saving(qtbot, paths, bridge, node, login_item):
    from worker.plan.share_preview import preview

    node.emit(snapshots.serving())
    dialog = dialog_for(qtbot, paths, bridge, login_item, Settings(memory_share_pct=((1, 50),)))
    gpus, engines = bridge.latest.gpus, bridge.latest.engines
    assert dialog.memory_share.words[1].text() == preview(gpus[1], 50, engines).words
    dialog.memory_share.sliders[0].setValue(60)
    words = dialog.memory_share.words[0].text()
    assert words == preview(gpus[0], 60, engines).words and "desktop" in words
    assert not paths.settings_file.exists()  # a preview, nothing saved


def test_a_price_no_home_pays_is_asked_about_before_saving(qtbot, paths, bridge, node, login_item):
    dialog = dialog_for(qtbot, paths, bridge, login_item)
    dialog.price.setText("32")
    dialog.save_button.click()
    assert "did you mean $0.32?" in dialog.error.text()
    assert not paths.settings_file.exists()
    dialog.save_button.click()  # asked once: the person meant it
    assert load_settings(paths).electricity_price_per_kwh == 32


def test_the_game_pause_is_not_offered_where_no_game_can_be_seen(qtbot, paths, bridge, node, login_item):
    from dataclasses import replace

    from worker.node import autopause

    offered = dialog_for(qtbot, paths, bridge, login_item)
    offered.show()
    assert offered.auto_pause.isVisible()  # NVML sees games here
    node.emit(replace(snapshots.idle(), game_detection=autopause.detection_limit(nvml=False, platform="linux")))
    dialog = dialog_for(qtbot, paths, bridge, login_item)
    dialog.show()
    assert not dialog.auto_pause.isVisible() and dialog.game_detection.isVisible()
