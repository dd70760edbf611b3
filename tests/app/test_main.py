from __future__ import annotations

import asyncio
import os
import time
import uuid

import pytest
from PySide6.QtWidgets import QApplication

from app.main import DesktopApp, ask_running_instance_to_show, instance_name, main, parse_args, run_app
from tests.app import snapshots
from tests.app.scripted_node import ScriptedNode
from tests.worker.test_datalock import holder
from worker.config import Paths, Settings
from worker.datalock import DataFolderLock


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


class NoSecondCore:
    """Stands in for worker.node.Node where a relaunch must not build one."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("a second core was started on a data folder that has an owner")


def test_a_relaunch_while_the_owner_stops_starts_no_core_and_says_so(qapp, tmp_path, monkeypatch, capsys):
    """The first app releases nothing until its engines stopped; a relaunch meanwhile is told to wait."""
    monkeypatch.setattr("worker.node.Node", NoSecondCore)
    owner = holder(tmp_path, "stopping")
    try:
        assert main(["--data-dir", str(tmp_path), "--quit-after", "0.2"]) == 1
    finally:
        owner.kill()
        owner.wait()
    assert f"GPU Provider (pid {owner.pid}) is still stopping for this data folder" in capsys.readouterr().err


def test_a_relaunch_beside_a_headless_owner_says_who_owns_the_folder(qapp, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("worker.node.Node", NoSecondCore)
    owner = holder(tmp_path)  # owns the folder, and has no window to bring forward
    try:
        assert main(["--data-dir", str(tmp_path), "--quit-after", "0.2"]) == 1
    finally:
        owner.kill()
        owner.wait()
    assert (f"GPU Provider is already running for this data folder (pid {owner.pid}); quit it first, "
            "or use --data-dir for a second node") in capsys.readouterr().err


def test_a_relaunch_brings_a_running_desktop_owner_forward(qtbot, tmp_path, node, monkeypatch):
    monkeypatch.setattr("worker.node.Node", NoSecondCore)
    paths = Paths.under(tmp_path).ensure()
    first = desktop(qtbot, node, tmp_path, tray=True)
    assert first.listen(instance_name(paths, os.getpid()))
    lock = DataFolderLock(paths)
    lock.acquire()
    try:
        assert main(["--data-dir", str(tmp_path)]) == 0
        first.server.waitForNewConnection(2000)  # handled here: an earlier run_app may have ended the loop
        qtbot.waitUntil(first.dashboard.isVisible, timeout=2000)
    finally:
        lock.release()
        first.server.close()
        first.tray.icon.hide()
        QApplication.instance().setQuitOnLastWindowClosed(True)


class HandingOverNode(ScriptedNode):
    """A core that ends by itself, as one does once an updated version reached hello."""

    async def run(self) -> None:
        await asyncio.sleep(0.2)
        self.commands.append(("run_ended", None))


def test_a_core_that_hands_over_ends_the_app(qapp, tmp_path, memory_keyring):
    node = HandingOverNode(snapshots.idle())
    args = parse_args(["--data-dir", str(tmp_path), "--quit-after", "30", "--minimized"])
    started = time.monotonic()
    assert run_app(qapp, node, Paths.under(tmp_path).ensure(), Settings(), args) == 0
    assert time.monotonic() - started < 10
    assert ("run_ended", None) in node.commands


class DrainingNode(ScriptedNode):
    """After `shutdown`, rings its own app's window-forward socket while it "drains"."""

    def __init__(self, name: str) -> None:
        super().__init__(snapshots.idle())
        self.name = name
        self.answered_while_draining: bool | None = None

    async def run(self) -> None:
        await super().run()
        self.answered_while_draining = ask_running_instance_to_show(self.name, timeout_ms=2000)


def test_the_window_socket_stays_until_the_core_has_stopped(qapp, tmp_path, memory_keyring):
    paths = Paths.under(tmp_path).ensure()
    node = DrainingNode(instance_name(paths, os.getpid()))
    args = parse_args(["--data-dir", str(tmp_path), "--quit-after", "0.3", "--minimized"])
    assert run_app(qapp, node, paths, Settings(), args) == 0
    assert node.answered_while_draining is True
    assert not ask_running_instance_to_show(node.name, timeout_ms=100)  # closed once the core stopped
