from __future__ import annotations

import pytest

from app.settings import SettingsDialog
from tests.app import snapshots
from worker.autostart import XdgAutostart
from worker.config import Paths, Settings, load_settings


@pytest.fixture
def paths(tmp_path) -> Paths:
    return Paths.under(tmp_path / "data").ensure()


@pytest.fixture
def login_item(tmp_path) -> XdgAutostart:
    return XdgAutostart(["gpu-provider", "--minimized"], config_home=tmp_path / "xdg")


def dialog_for(qtbot, paths, bridge, login_item, settings: Settings | None = None) -> SettingsDialog:
    dialog = SettingsDialog(settings or Settings(), paths, bridge, login_item, snapshots.GPUS)
    qtbot.addWidget(dialog)
    return dialog


def test_round_trip_saves_applies_and_reloads(qtbot, paths, bridge, node, login_item):
    dialog = dialog_for(qtbot, paths, bridge, login_item)
    dialog.price.setText("0,31")
    dialog.currency.setCurrentText("eur")
    dialog.auto_pause.setChecked(False)
    dialog.resume_after_min.setValue(5)
    dialog.limit_hours.setChecked(True)
    dialog.hours_from.setValue(22)
    dialog.hours_to.setValue(7)
    dialog.gpu_boxes[1].setChecked(False)
    dialog.cache_limit.setText("120")
    dialog.start_at_login.setChecked(True)
    dialog.channel.setCurrentText("beta")
    dialog.ignored.setText(" obs64.exe,, blender ")
    dialog.save_button.click()

    saved = load_settings(paths)
    assert saved.electricity_price_per_kwh == 0.31
    assert saved.currency == "EUR"
    assert saved.auto_pause_for_games is False
    assert saved.auto_resume_after_s == 300
    assert saved.serve_hours == (22, 7)
    assert saved.gpus_to_lend == (0,)
    assert saved.model_cache_limit_gib == 120
    assert saved.start_at_login and login_item.is_enabled()
    assert saved.update_channel == "beta"
    assert saved.allow_remote_code is False
    assert saved.autopause_ignored == ("obs64.exe", "blender")
    assert node.commands == [("apply_settings", saved)]
    assert dialog.result() == SettingsDialog.DialogCode.Accepted

    again = dialog_for(qtbot, paths, bridge, login_item, saved)
    assert again.price.text() == "0.31" and again.hours_from.value() == 22 and not again.gpu_boxes[1].isChecked()
    assert again.ignored.text() == "obs64.exe, blender"


def test_bad_input_is_explained_and_nothing_is_lost(qtbot, paths, bridge, node, login_item):
    dialog = dialog_for(qtbot, paths, bridge, login_item)
    dialog.show()
    dialog.price.setText("twelve")
    dialog.currency.setCurrentText("euros")
    for box in dialog.gpu_boxes.values():
        box.setChecked(False)
    dialog.save_button.click()
    message = dialog.error.text()
    assert "Electricity price: “twelve” is not a number." in message
    assert "three-letter code" in message and "Lend at least one GPU" in message
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
