"""Start the desktop app: one instance per data folder, the core on its own thread, a tray icon
(or the dashboard where there is no tray), and a Quit that stops the engines before exiting.

A new install opens the first-run flow (app/first_run.py) beside the dashboard, never modal to the
whole app: the core detects the machine meanwhile (and does nothing else: no download, engine or
connection until the flow is finished), and Quit, SIGTERM and `--quit-after` work as always. After
"Later" the dashboard's main button and the tray offer "Finish setting up". A set-up app without a token for a real network offers sign-in instead.

The data folder's lock (worker/system/datalock.py, held by the core) decides who runs; a local socket
named after the owner's pid only brings its window forward. Named per process, an updated
version's socket never collides with the one of the version it replaces, which keeps its own
until it exits (or serves on after a rollback).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from PySide6.QtCore import QObject, QSocketNotifier, Qt, QTimer, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket
from PySide6.QtWidgets import QApplication, QMessageBox, QSystemTrayIcon

from app import theme
from app.bridge import Bridge, NodeLike
from app.core_thread import CoreThread
from app.dashboard import Dashboard
from app.first_run import FirstRunFlow
from app.icons import state_icon
from app.logs import LogsWindow, redact_token
from app.settings import SettingsDialog
from app.signin import SignInDialog
from app.tray import Tray
from worker.system import applog
from worker.system import autostart
from worker.system import networks
from worker.system import secrets
from worker.system.config import DataFolderUnsafe, Paths, Settings, load_settings, read_local_endpoint
from worker.system.datalock import DataFolderLock, Owner, in_use_message

log = logging.getLogger(__name__)

SHUTDOWN_WAIT_S = 60.0  # engines drain and stop within their grace period
SHOW_MESSAGE = b"show\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The node's options (shared with `gpu-provider run`) plus the window's own."""
    from worker.node.cli import InputError, desktop_options, local_tune, node_options, parse_engine_bins

    parser = argparse.ArgumentParser(
        prog="gpu-provider", description="GPU Provider desktop app", parents=[node_options(), desktop_options()]
    )
    parser.add_argument("--data-dir", help="keep settings, models and logs under this folder")
    args = parser.parse_args(list(argv))
    try:
        args.engine_bins = parse_engine_bins(args.engine_bin)
        args.local_tune = local_tune(args)
    except InputError as exc:
        parser.error(str(exc))
    return args


def instance_name(paths: Paths, pid: int) -> str:
    """The window-forward socket of the app with `pid` on this data folder."""
    digest = hashlib.sha256(str(paths.data_dir).encode()).hexdigest()[:16]
    return f"gpu-provider-{digest}-{pid}"


def ask_running_instance_to_show(name: str, timeout_ms: int = 500) -> bool:
    """True when another instance answered (and was asked to bring its window forward)."""
    socket = QLocalSocket()
    socket.connectToServer(name)
    if not socket.waitForConnected(timeout_ms):
        return False
    socket.write(SHOW_MESSAGE)
    socket.waitForBytesWritten(timeout_ms)
    socket.disconnectFromServer()
    return True


class DesktopApp(QObject):
    """Wires the bridge to the tray, the windows and the single-instance server."""

    core_finished = Signal()  # emitted on the core's thread; queued to the GUI's, where it quits

    def __init__(
        self,
        qapp: QApplication,
        node: NodeLike,
        paths: Paths,
        settings: Settings,
        *,
        tray_available: bool,
        redact: Callable[[str], str],
        data_dir: str | None = None,
        coordinator: str | None = None,
    ) -> None:
        super().__init__()
        self.qapp = qapp
        self.paths = paths
        self.settings = settings
        self.bridge = Bridge(node)
        self._redact = redact
        self._data_dir = data_dir  # what `--data-dir` said: the login item must start the same node
        self._coordinator = coordinator  # what `--coordinator` said, until the person picks a network
        self.first_run: FirstRunFlow | None = None
        self.sign_in: SignInDialog | None = None
        self.dashboard = Dashboard(self.bridge, hide_on_close=tray_available,
                                   local_endpoint=lambda: read_local_endpoint(paths))
        self.dashboard.setWindowIcon(state_icon("serving"))
        self.dashboard.setup_requested.connect(self.open_first_run)
        self.dashboard.settings_requested.connect(self.open_settings)
        self.dashboard.logs_requested.connect(self.open_logs)
        self.dashboard.sign_in_requested.connect(self.open_sign_in)
        self.dashboard.retry_requested.connect(self.bridge.retry)
        self.dashboard.update_requested.connect(self.bridge.install_update_now)
        self.tray: Tray | None = None
        if tray_available:
            self.tray = Tray(self.bridge)
            self.tray.setup_requested.connect(self.open_first_run)
            self.tray.open_dashboard.connect(self.dashboard.bring_forward)
            self.tray.open_settings.connect(self.open_settings)
            self.tray.open_logs.connect(self.open_logs)
            self.tray.sign_in_requested.connect(self.open_sign_in)
            self.tray.retry_requested.connect(self.bridge.retry)
            self.tray.update_requested.connect(self.bridge.install_update_now)
            self.tray.quit_requested.connect(self.quit)
            self.tray.icon.show()
        qapp.setQuitOnLastWindowClosed(not tray_available)
        self._quitting = False
        self._core_ended = False  # finished or failed: no drain to wait for
        self.core_finished.connect(self._on_core_finished)
        self.bridge.core_failed.connect(self._on_core_failed)
        self.logs: LogsWindow | None = None
        self.server = QLocalServer(self)
        self.server.newConnection.connect(self._on_instance_connection)
        self._refresh_login_item()

    def _refresh_login_item(self) -> None:
        """Start at login names this app as it is installed now (an entry an older version wrote
        into `versions/<v>` stops working once that folder is pruned)."""
        if not self.settings.start_at_login:
            return
        try:
            if autostart.refresh(self._login_item()):
                log.info("start at login now points at this app again")
        except OSError as exc:
            log.warning("could not repair start at login: %s", exc)

    def request_quit(self) -> None:
        """SIGTERM, Ctrl-C, logout, `--quit-after`: as the tray's Quit, which says "Stopping…" at once."""
        if self.tray is not None and not self.tray.quitting:
            self.tray.request_quit()  # emits quit_requested → quit
        else:
            self.quit()

    def quit(self) -> None:
        """Quit on the first request, dashboard open or not. The core drains its requests and stops
        its engines while the windows stay up to say so ("Stopping… (N requests)"); Qt's loop ends
        once the core has ended, or after SHUTDOWN_WAIT_S whatever it does."""
        if self._quitting:
            return
        self._quitting = True
        if self._core_ended:
            self._end_loop()
            return
        self.bridge.request_stop()
        QTimer.singleShot(int(SHUTDOWN_WAIT_S * 1000), self._end_loop)

    def _on_core_finished(self) -> None:
        """The core ended as asked, or by itself (it handed over to an update): so does the app."""
        self._core_ended = True
        self._end_loop()

    def _on_core_failed(self, _problem: object) -> None:
        """A failed core leaves the app up to say so, until the person quits (nothing to drain)."""
        self._core_ended = True
        if self._quitting:
            self._end_loop()

    def _end_loop(self) -> None:
        """Qt 6's quit first closes every window and gives up if one refuses; the dashboard refuses
        a close to hide in the tray, so it must stop doing that first (else the loop went on)."""
        self.dashboard.hide_on_close = False
        self.qapp.quit()

    def listen(self, name: str) -> bool:
        QLocalServer.removeServer(name)  # a stale socket left by a crash
        return self.server.listen(name)

    def _on_instance_connection(self) -> None:
        connection = self.server.nextPendingConnection()
        connection.disconnected.connect(connection.deleteLater)
        self.dashboard.bring_forward()

    @property
    def network(self) -> networks.Network:
        """The network the node serves: the command line's until the person picks one."""
        return networks.for_url(self._coordinator or self.settings.coordinator_url)

    def open_first_run(self) -> None:
        """The first-run flow, window-modal to the dashboard only: the app keeps running under it."""
        if self.first_run is None:
            self.first_run = FirstRunFlow(self.settings, self.bridge, self._login_item(),
                                          chosen=networks.for_url(self._coordinator) if self._coordinator else None,
                                          parent=self.dashboard)
            self.first_run.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
            self.first_run.saved.connect(self._settings_saved)
            self.first_run.finished.connect(self._first_run_closed)
            self.first_run.open()
        self.first_run.raise_()
        self.first_run.activateWindow()

    def _first_run_closed(self) -> None:
        self.first_run = None

    def open_settings(self) -> None:
        dialog = SettingsDialog(self.settings, self.paths, self.bridge, self._login_item(), self.dashboard)
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.saved.connect(self._settings_saved)
        dialog.open()

    def _settings_saved(self, settings: Settings) -> None:
        """Settings (or the first-run flow) saved and applied: a network picked now wins over the
        command line's, and a real network without a token offers sign-in at once."""
        picked_now = settings.coordinator_url != self.settings.coordinator_url or not self.settings.setup_complete
        self.settings = settings
        if picked_now:
            self._coordinator = None
            if not self.network.is_local and secrets.get_token() is None:
                self.open_sign_in()

    def _login_item(self) -> autostart.Autostart:
        return autostart.for_platform(data_dir=self._data_dir)

    def open_logs(self) -> None:
        if self.logs is None:
            self.logs = LogsWindow(self.bridge, self._redact)
        self.logs.refresh()
        self.logs.show()
        self.logs.raise_()

    def open_sign_in(self) -> None:
        """Sign in to the network served now (one dialog at a time, brought forward if open)."""
        if self.sign_in is None:
            self.sign_in = SignInDialog(self.bridge, self.network, self.dashboard)
            self.sign_in.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
            self.sign_in.accepted.connect(self.bridge.token_changed)
            self.sign_in.finished.connect(self._sign_in_closed)
            self.sign_in.open()
        self.sign_in.raise_()
        self.sign_in.activateWindow()

    def _sign_in_closed(self) -> None:
        self.sign_in = None


def run_app(qapp: QApplication, node: NodeLike, paths: Paths, settings: Settings, args: argparse.Namespace) -> int:
    """Run the core and the GUI; whatever ends the event loop, the core is shut down and joined.

    A core that ends by itself (it handed over to an updated version) ends the app too. The
    window-forward socket listens before the core takes the data folder and closes only once the
    engines have stopped, so a second launch always finds this one."""
    desktop = DesktopApp(
        qapp, node, paths, settings, tray_available=QSystemTrayIcon.isSystemTrayAvailable(), redact=redact_token,
        data_dir=getattr(args, "data_dir", None), coordinator=args.coordinator,
    )
    desktop.listen(instance_name(paths, os.getpid()))
    core = CoreThread(node.run, desktop.bridge.report_core_failure, desktop.core_finished.emit)
    core.start()
    try:
        if desktop.tray is None or not args.minimized:
            desktop.dashboard.bring_forward()
        if not settings.setup_complete:
            desktop.open_first_run()
        elif secrets.get_token() is None and not desktop.network.is_local:
            desktop.open_sign_in()
        if args.quit_after is not None:
            QTimer.singleShot(int(args.quit_after * 1000), desktop.request_quit)
        wake = SignalWake(qapp, desktop.request_quit)
        qapp.commitDataRequest.connect(lambda _manager: desktop.request_quit())  # the session is ending (logout)
        try:
            return qapp.exec()
        finally:
            wake.close()
    finally:
        desktop.core_finished.disconnect(desktop._on_core_finished)  # the loop has ended: nothing may outlive it
        desktop.bridge.shutdown()
        core.join(SHUTDOWN_WAIT_S)
        if core.is_alive():
            log.error("the core did not stop within %.0f s; exiting anyway", SHUTDOWN_WAIT_S)
        desktop.server.close()


class SignalWake:
    """Ctrl-C and SIGTERM quit cleanly, without a polling timer: Python runs a signal's handler
    only once the interpreter has control, which Qt's loop would withhold until some event; the
    signal module also writes a byte to a socket Qt watches, and reading it is that event."""

    def __init__(self, qapp: QApplication, quit_app: Callable[[], None]) -> None:
        self._reader, self._writer = socket.socketpair()
        for end in (self._reader, self._writer):
            end.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno())
        self._notifier = QSocketNotifier(self._reader.fileno(), QSocketNotifier.Type.Read, qapp)
        self._notifier.activated.connect(self._drain)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: quit_app())

    def _drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._reader.recv(64):
                pass

    def close(self) -> None:
        self._notifier.setEnabled(False)
        signal.set_wakeup_fd(self._previous_fd)
        self._reader.close()
        self._writer.close()


def defer_to_owner(paths: Paths, owner: Owner, quit_after: float | None = None) -> int:
    """Another process owns the data folder: bring its window forward when it is a desktop app that
    is running (0); otherwise say who it is and what to do (1). Nothing of the folder is touched."""
    if owner.state == "running" and owner.pid is not None:
        if ask_running_instance_to_show(instance_name(paths, owner.pid)):
            log.info("GPU Provider is already running; brought its window forward")
            return 0
    return tell_and_end(in_use_message(owner), QMessageBox.Icon.Information, quit_after)


def tell_and_end(message: str, icon: QMessageBox.Icon, quit_after: float | None = None) -> int:
    """Say why the app cannot start, on the terminal and in a box the person closes (1)."""
    print(f"gpu-provider: {message}", file=sys.stderr)
    box = QMessageBox(icon, "GPU Provider", message)
    if quit_after is not None:
        QTimer.singleShot(int(quit_after * 1000), box.reject)
    box.exec()
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    existing = QApplication.instance()
    qapp = existing if isinstance(existing, QApplication) else QApplication(["gpu-provider"])
    qapp.setApplicationName("GPU Provider")
    theme.install(qapp)
    try:
        paths = Paths.resolve(args.data_dir).ensure()
        owner = DataFolderLock(paths).owner()
        if owner is not None:
            return defer_to_owner(paths, owner, args.quit_after)
        applog.configure(paths, console=False, verbose=args.verbose)
    except DataFolderUnsafe as exc:  # someone else's folder, or a planted link: nothing written through it
        return tell_and_end(str(exc), QMessageBox.Icon.Critical, args.quit_after)
    from worker.node.node import Node  # loaded once this is known to be the only instance

    settings = load_settings(paths)
    node = Node(
        paths,
        settings,
        coordinator_url=args.coordinator or settings.coordinator_url,
        hardware_override=Path(args.hardware) if args.hardware else None,
        engine_bins=args.engine_bins,
        model=args.model,
        openai_port=args.openai_port,
        local_tune=args.local_tune,
        wait_for_setup=True,  # the desktop app: nothing downloads, starts or connects before the first-run flow
    )
    return run_app(qapp, node, paths, settings, args)


if __name__ == "__main__":
    sys.exit(main())
