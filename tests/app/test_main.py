from __future__ import annotations

import asyncio
import os
import time
import uuid

import pytest
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication

from app.first_run import FirstRunFlow
from app.main import DesktopApp, ask_running_instance_to_show, instance_name, main, parse_args, run_app
from tests.app import snapshots
from tests.app.scripted_node import ScriptedNode
from app.signin import SignInDialog
from tests.worker.system.test_datalock import holder
from worker.system import networks
from worker.system.config import Paths, Settings
from worker.system.datalock import DataFolderLock


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


def test_tune_minutes_asks_local_mode_for_a_search_and_a_refused_budget_is_explained(capsys):
    assert parse_args(["--coordinator", "local"]).local_tune is None
    block = parse_args(["--coordinator", "local", "--tune-minutes", "10"]).local_tune
    assert block["budget"] == {"max_minutes": 10.0, "max_trials": 12}
    with pytest.raises(SystemExit):
        parse_args(["--coordinator", "local", "--tune-minutes", "0"])
    assert "--tune-minutes" in capsys.readouterr().err


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
    dialog = app.sign_in
    assert dialog is not None and dialog.isVisible()
    app.open_sign_in()
    assert app.sign_in is dialog  # one at a time
    dialog.token.setText("gp_live_0123456789abcdef")
    dialog.sign_in.click()
    qtbot.waitUntil(lambda: ("token_changed", None) in node.commands, timeout=2000)
    assert app.sign_in is None


def test_the_dashboard_asks_for_retry_and_update(qtbot, tmp_path, node):
    app = desktop(qtbot, node, tmp_path, tray=False)
    app.dashboard.retry_requested.emit()
    app.dashboard.update_requested.emit()
    assert node.commands == [("retry", None), ("install_update_now", None)]
    app.dashboard.sign_in_requested.emit()
    assert app.sign_in is not None and app.sign_in.isVisible()
    app.sign_in.reject()


def test_the_tray_asks_for_sign_in_retry_and_update(qtbot, tmp_path, node, memory_keyring):
    app = desktop(qtbot, node, tmp_path, tray=True)
    try:
        app.tray.retry_requested.emit()
        app.tray.update_requested.emit()
        assert node.commands == [("retry", None), ("install_update_now", None)]
        app.tray.sign_in_requested.emit()
        assert app.sign_in is not None and app.sign_in.isVisible()
        app.sign_in.reject()
    finally:
        app.tray.icon.hide()
        QApplication.instance().setQuitOnLastWindowClosed(True)


def windows_while_running(qapp, node, tmp_path, settings: Settings, *argv: str) -> list[str]:
    """The dialogs `run_app` opens on start (their classes), seen from inside its event loop."""
    seen: list[str] = []

    def look() -> None:
        seen.extend(type(w).__name__ for w in QApplication.topLevelWidgets()
                    if w.isVisible() and isinstance(w, (FirstRunFlow, SignInDialog)))

    QTimer.singleShot(200, look)
    args = parse_args(["--data-dir", str(tmp_path), "--quit-after", "0.5", "--minimized", *argv])
    assert run_app(qapp, node, Paths.under(tmp_path).ensure(), settings, args) == 0  # the flow blocks nothing
    assert ("shutdown", None) in node.commands
    return seen


def test_a_new_install_opens_the_first_run_flow(qapp, tmp_path, memory_keyring):
    node = ScriptedNode(snapshots.detecting())
    assert windows_while_running(qapp, node, tmp_path, Settings()) == ["FirstRunFlow"]
    assert not Paths.under(tmp_path).settings_file.exists()  # quitting mid-flow saved nothing


def test_a_set_up_app_opens_no_flow(qapp, tmp_path, memory_keyring):
    node = ScriptedNode(snapshots.idle())
    assert windows_while_running(qapp, node, tmp_path, Settings(setup_complete=True)) == []


def test_a_set_up_app_signed_out_of_a_real_network_offers_sign_in(qapp, tmp_path, memory_keyring):
    node = ScriptedNode(snapshots.signed_out())
    real = networks.official().coordinator_url
    seen = windows_while_running(qapp, node, tmp_path, Settings(coordinator_url=real, setup_complete=True))
    assert seen == ["SignInDialog"]


def test_finishing_the_flow_on_a_real_network_without_a_token_offers_sign_in(qtbot, tmp_path, node,
                                                                            memory_keyring):
    app = desktop(qtbot, node, tmp_path, tray=False)
    app.open_first_run()
    flow = app.first_run
    assert flow is not None and flow.isVisible() and flow.network() == networks.official()
    app._settings_saved(Settings(coordinator_url=networks.official().coordinator_url, setup_complete=True))
    assert app.settings.setup_complete and app.sign_in is not None
    flow.reject()
    app.sign_in.reject()


def test_a_network_picked_in_settings_wins_over_the_command_line(qtbot, tmp_path, node, memory_keyring):
    app = DesktopApp(QApplication.instance(), node, Paths.under(tmp_path), Settings(setup_complete=True),
                     tray_available=False, redact=lambda text: text, coordinator="wss://dev.example.org/v1/node")
    qtbot.addWidget(app.dashboard)
    assert app.network.coordinator_url == "wss://dev.example.org/v1/node"
    app._settings_saved(Settings(setup_complete=True, electricity_price_per_kwh=0.2))
    assert app.network.coordinator_url == "wss://dev.example.org/v1/node"  # the network was not changed
    real = networks.official()
    app._settings_saved(Settings(setup_complete=True, coordinator_url=real.coordinator_url))
    assert app.network == real and app.sign_in is not None  # picked now, and no token yet
    app.sign_in.reject()


class NoSecondCore:
    """Stands in for worker.node.node.Node where a relaunch must not build one."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("a second core was started on a data folder that has an owner")


def test_a_relaunch_while_the_owner_stops_starts_no_core_and_says_so(qapp, tmp_path, monkeypatch, capsys):
    """The first app releases nothing until its engines stopped; a relaunch meanwhile is told to wait."""
    monkeypatch.setattr("worker.node.node.Node", NoSecondCore)
    owner = holder(tmp_path, "stopping")
    try:
        assert main(["--data-dir", str(tmp_path), "--quit-after", "0.2"]) == 1
    finally:
        owner.kill()
        owner.wait()
    assert f"GPU Provider (pid {owner.pid}) is still stopping for this data folder" in capsys.readouterr().err


def test_a_relaunch_beside_a_headless_owner_says_who_owns_the_folder(qapp, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("worker.node.node.Node", NoSecondCore)
    owner = holder(tmp_path)  # owns the folder, and has no window to bring forward
    try:
        assert main(["--data-dir", str(tmp_path), "--quit-after", "0.2"]) == 1
    finally:
        owner.kill()
        owner.wait()
    assert (f"GPU Provider is already running for this data folder (pid {owner.pid}); quit it first, "
            "or use --data-dir for a second node") in capsys.readouterr().err


def test_a_data_folder_others_can_write_is_refused_in_words_and_no_core_starts(qapp, tmp_path, monkeypatch, capsys):
    """A world-writable data folder (anyone could plant links in it) ends the app with the reason
    shown, never a traceback; no core is built."""
    monkeypatch.setattr("worker.node.node.Node", NoSecondCore)
    Paths.resolve(tmp_path).ensure()
    tmp_path.chmod(0o777)
    try:
        assert main(["--data-dir", str(tmp_path), "--quit-after", "0.2"]) == 1
    finally:
        tmp_path.chmod(0o700)
    err = capsys.readouterr().err
    assert err.startswith("gpu-provider: ") and "Traceback" not in err and str(tmp_path) in err


def test_a_relaunch_brings_a_running_desktop_owner_forward(qtbot, tmp_path, node, monkeypatch):
    monkeypatch.setattr("worker.node.node.Node", NoSecondCore)
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


def test_quit_keeps_the_app_up_saying_stopping_until_the_core_has_drained(qtbot, tmp_path, node, monkeypatch):
    """The first Quit asks the core to drain; the tray says how many requests are left, and the
    loop ends when the core has ended (not before: the person would see nothing while it drains)."""
    import dataclasses

    app = desktop(qtbot, node, tmp_path, tray=True)
    ended: list[bool] = []
    monkeypatch.setattr(app.qapp, "quit", lambda: ended.append(True))
    app.dashboard.show()
    app.request_quit()  # as SIGTERM does
    assert ("shutdown", None) in node.commands and not ended
    node.emit(dataclasses.replace(snapshots.serving(), stopping=True, in_flight=3))
    qtbot.waitUntil(lambda: app.bridge.latest.stopping)
    app.tray.menu.aboutToShow.emit()
    assert [a.text() for a in app.tray.menu.actions()[:2]] == ["Stopping…", "3 requests finishing"]
    app.quit()  # a second request changes nothing
    assert node.commands.count(("shutdown", None)) == 1 and not ended
    app.core_finished.emit()
    qtbot.waitUntil(lambda: bool(ended))
    assert app.dashboard.hide_on_close is False  # the loop's closing of windows is not refused


def test_a_quit_after_the_core_failed_ends_at_once(qtbot, tmp_path, node, monkeypatch):
    from worker.contract.events import Problem

    app = desktop(qtbot, node, tmp_path, tray=True)
    ended: list[bool] = []
    monkeypatch.setattr(app.qapp, "quit", lambda: ended.append(True))
    app.bridge.core_failed.emit(Problem("GPU Provider stopped serving", "…"))
    qtbot.wait(50)
    assert not ended  # the app stays up to say so
    app.quit()
    assert ended


@pytest.mark.parametrize("on", [True, False])
def test_start_at_login_left_by_an_older_version_is_repaired_at_start(qtbot, tmp_path, node, monkeypatch, on):
    """An entry an earlier version wrote into its own `versions/<v>` folder (pruned two updates
    later) is rewritten to start this app, only while the person has the setting on."""
    from worker.system import autostart

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    stale = autostart.XdgAutostart([str(tmp_path / "app" / "versions" / "1" / "gpu-provider"), "--minimized"])
    stale.enable()
    app = DesktopApp(QApplication.instance(), node, Paths.under(tmp_path),
                     Settings(setup_complete=True, start_at_login=on), tray_available=False, redact=lambda text: text)
    qtbot.addWidget(app.dashboard)
    assert app._login_item().is_current() is on
    assert stale.path.is_file()  # never removed: the person's choice stays


def connections_while_the_app_runs(data_dir, seconds: float) -> int:
    """Runs the real app (its own process, its real core) against a listening socket named as its
    coordinator, and counts the connections it opened there before `--quit-after` ended it."""
    import socket
    import subprocess
    import sys
    import threading

    from tests.app.conftest import TOKEN

    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    url = f"ws://127.0.0.1:{listener.getsockname()[1]}/v1/node"
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "GPU_PROVIDER_TOKEN": TOKEN}  # signed in: only the
    try:  # consent can hold it back
        done = subprocess.run([sys.executable, "-m", "app", "--data-dir", str(data_dir), "--coordinator", url,
                               "--quit-after", str(seconds)], env=env, timeout=seconds + 60, capture_output=True)
        assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    finally:
        listener.close()
        thread.join(5)
    for connection in accepted:
        connection.close()
    return len(accepted)


def test_a_fresh_desktop_app_connects_nowhere_before_the_first_run_flow_is_finished(tmp_path):
    assert connections_while_the_app_runs(tmp_path / "fresh", 4.0) == 0
    done = Paths.resolve(str(tmp_path / "set-up")).ensure()
    from worker.system.config import save_settings

    save_settings(done, Settings(setup_complete=True))
    assert connections_while_the_app_runs(tmp_path / "set-up", 4.0) >= 1  # set up: it connects


def test_later_leaves_finish_setting_up_in_the_dashboard_and_the_tray(qtbot, tmp_path, memory_keyring):
    import dataclasses

    node = ScriptedNode(dataclasses.replace(snapshots.idle(), setup_needed=True))
    app = desktop(qtbot, node, tmp_path, tray=True)
    try:
        app.open_first_run()
        assert app.first_run is not None
        app.first_run.reject()  # Later
        qtbot.waitUntil(lambda: app.first_run is None, timeout=2000)
        assert app.dashboard.pause_button.text() == "Finish setting up"
        app.dashboard.pause_button.click()
        assert app.first_run is not None and app.first_run.isVisible()  # the flow again
        app.first_run.reject()
        qtbot.waitUntil(lambda: app.first_run is None, timeout=2000)
        app.tray.menu.aboutToShow.emit()
        item = next(a for a in app.tray.menu.actions() if a.text() == "Finish setting up" and a.isEnabled())
        item.trigger()
        assert app.first_run is not None and app.first_run.isVisible()
        app.first_run.reject()
        assert node.commands == []  # Later saved nothing and started nothing
    finally:
        app.tray.icon.hide()
        QApplication.instance().setQuitOnLastWindowClosed(True)
