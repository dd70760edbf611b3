from __future__ import annotations

import uuid

import pytest
from PySide6.QtWidgets import QApplication

from app.main import DesktopApp, ask_running_instance_to_show, parse_args, run_app
from tests.app import snapshots
from tests.app.scripted_node import ScriptedNode
from worker.config import Paths, Settings


def test_arguments():
    args = parse_args(
        [
            "--data-dir",
            "/tmp/x",
            "--engine-bin",
            "llamacpp=/opt/llama-server",
            "--quit-after",
            "2",
            "--minimized",
            "--coordinator",
            "local",
            "--hardware",
            "hw.json",
        ]
    )
    assert args.engine_bins == {"llamacpp": "/opt/llama-server"}
    assert args.quit_after == 2.0 and args.minimized and args.coordinator == "local"
    assert str(args.hardware) == "hw.json"


def test_bad_engine_bin_is_explained(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--engine-bin", "llama-server"])
    assert "expected NAME=PATH" in capsys.readouterr().err


def desktop(qtbot, node, tmp_path, tray: bool) -> DesktopApp:
    app = DesktopApp(
        QApplication.instance(), node, Paths.under(tmp_path), Settings(), tray_available=tray, redact=lambda text: text
    )
    qtbot.addWidget(app.dashboard)
    return app


def test_a_second_launch_brings_the_first_window_forward(qtbot, tmp_path, node):
    first = desktop(qtbot, node, tmp_path, tray=True)
    name = f"gpu-provider-test-{uuid.uuid4().hex[:8]}"
    assert first.listen(name)
    assert not first.dashboard.isVisible()
    assert ask_running_instance_to_show(name)
    qtbot.waitUntil(first.dashboard.isVisible, timeout=2000)
    first.server.close()
    assert not ask_running_instance_to_show(name, timeout_ms=100)


def test_without_a_tray_the_window_is_the_app(qtbot, tmp_path, node):
    app = desktop(qtbot, node, tmp_path, tray=False)
    try:
        assert app.tray is None and QApplication.instance().quitOnLastWindowClosed()
        app.dashboard.show()
        assert app.dashboard.close()  # accepted: the event loop ends and run_app shuts the core down
    finally:
        QApplication.instance().setQuitOnLastWindowClosed(True)


def test_with_a_tray_closing_the_window_keeps_serving(qtbot, tmp_path, node):
    app = desktop(qtbot, node, tmp_path, tray=True)
    try:
        assert not QApplication.instance().quitOnLastWindowClosed()
        app.dashboard.show()
        assert not app.dashboard.close()
        assert not app.dashboard.isVisible() and node.commands == []
    finally:
        app.tray.icon.hide()
        QApplication.instance().setQuitOnLastWindowClosed(True)


def test_run_app_starts_the_core_and_shuts_it_down_on_quit(qapp, tmp_path, memory_keyring):
    node = ScriptedNode(snapshots.idle())
    paths = Paths.under(tmp_path).ensure()
    args = parse_args(["--data-dir", str(tmp_path), "--quit-after", "0.3", "--minimized"])
    assert run_app(qapp, node, paths, Settings(), args) == 0
    assert ("shutdown", None) in node.commands
    assert node.commands[-1] == ("run_ended", None)  # the core thread finished before run_app returned
    assert node.subscriber_count == 0


class CrashingNode(ScriptedNode):
    async def run(self) -> None:
        raise RuntimeError("the core fell over")


def test_a_core_that_dies_does_not_take_the_window_down(qapp, tmp_path, memory_keyring):
    node = CrashingNode(snapshots.idle())
    args = parse_args(["--data-dir", str(tmp_path), "--quit-after", "0.3", "--minimized"])
    assert run_app(qapp, node, Paths.under(tmp_path).ensure(), Settings(), args) == 0
    assert ("shutdown", None) in node.commands


def test_signing_in_tells_the_node_to_connect_now(qtbot, tmp_path, node, memory_keyring):
    app = desktop(qtbot, node, tmp_path, tray=False)
    app.open_sign_in()
    dialog = next(w for w in QApplication.topLevelWidgets() if w.windowTitle() == "Welcome to GPU Provider" and w.isVisible())
    dialog.token.setText("gp_live_0123456789abcdef")
    dialog.sign_in.click()
    qtbot.waitUntil(lambda: ("token_changed", None) in node.commands, timeout=2000)
