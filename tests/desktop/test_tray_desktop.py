"""The real app on a real X desktop (Xvfb, openbox, trayer): its tray icon docks in the tray host,
a click opens the dashboard, the icon's menu opens and its Quit ends the app; SIGTERM with the
dashboard open ends it too. Each on the first request, after the drain.

Offscreen Qt has no tray, and there `quit()` closing the windows looked fine: under a desktop the
dashboard refused the close to hide into the tray, which cancelled the quit (issue 15). The app
runs the real core on the built-in local coordinator with the real llama-server and a tiny model
(a settings file marks setup done, so no first-run flow opens), and serves before it is asked to
quit, as a gamer's app would: the drain and the engine's stop are part of what must finish.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.support.desktop import Desktop, DesktopMissing, real_desktop, wait_until
from tests.support.engines import LlamaServer, free_port
from worker.system.config import Paths
from worker.node.status import read_status

ROOT = Path(__file__).resolve().parents[2]
TITLE = "GPU Provider"  # the dashboard's title and the tray icon window's name
DASHBOARD_MIN = (400, 300)  # a notification balloon is a window of the same name, but small
SERVING_TIMEOUT_S = 30.0  # the real core: detect, plan, start llama-server, a test completion
QUIT_TIMEOUT_S = 30.0  # drain (nothing in flight), stop the engine, end the loop
LAST_ITEM_FROM_BOTTOM = 10  # pixels: inside the menu's last item (Quit), below its frame


@pytest.fixture(scope="module")
def desktop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Desktop]:
    try:
        with real_desktop(tmp_path_factory.mktemp("x11")) as running:
            yield running
    except DesktopMissing as exc:
        pytest.fail(str(exc), pytrace=False)  # never a skip: CI installs the tools


class RunningApp:
    """`python -m app` on the desktop, with its own data folder; its output goes to a file."""

    def __init__(self, desktop: Desktop, folder: Path, llama: LlamaServer, model: Path, *extra: str) -> None:
        self.desktop, self.paths = desktop, Paths.under(folder / "data")
        self.paths.config_dir.mkdir(parents=True)
        self.paths.settings_file.write_text(json.dumps(
            {"setup_complete": True, "coordinator_url": "local", "auto_pause_for_games": False}))
        env = desktop.env(llama.environment())
        env.update(PYTHONPATH=str(ROOT), PYTHON_KEYRING_BACKEND="keyring.backends.null.Keyring")
        env.pop("GPU_PROVIDER_TOKEN", None)
        self.output = folder / "app-output.log"
        self.engine_pids: list[int] = []
        argv = [sys.executable, "-m", "app", "--data-dir", str(folder / "data"), "--coordinator", "local",
                "--engine-bin", f"llamacpp={llama.executable}", "--model", str(model),
                "--openai-port", str(free_port()), *extra]
        with open(self.output, "wb") as out:
            self.process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)

    def serving(self) -> bool:
        """Ready, as the status file says; remembers the engines' pids."""
        self.assert_running()
        status = read_status(self.paths)
        if status is None or status["snapshot"]["state"] != "ready":
            return False
        self.engine_pids = [e["pid"] for e in status["snapshot"]["engines"] if e["pid"] is not None]
        return bool(self.engine_pids)

    def assert_running(self) -> None:
        code = self.process.poll()
        assert code is None, f"the app exited by itself ({code})"

    def dashboard(self) -> bool:
        self.assert_running()
        return self.desktop.shown(TITLE, "NORMAL", DASHBOARD_MIN) is not None

    def wait_for_exit(self, what: str) -> int:
        """The exit code, once the app has ended; it must have stopped its engines on the way out
        (the core's orderly stop also removes the status file)."""
        try:
            code = self.process.wait(QUIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the app was still running {QUIT_TIMEOUT_S:.0f} s after {what}") from None
        left = [pid for pid in self.engine_pids if running(pid)]
        assert not left, f"engines still running after {what}: {left}"
        assert not self.paths.status_file.exists(), f"the core did not stop in order after {what}"
        return code

    def explain(self) -> str:
        """What X shows and what the app said: printed when the test fails."""
        try:
            tree = self.desktop.tree()
        except (subprocess.SubprocessError, OSError) as exc:
            tree = f"(xwininfo failed: {exc})"
        log = self.paths.log_dir / "gpu-provider.log"
        app_log = log.read_text(errors="replace")[-4000:] if log.exists() else "(no app log)"
        return (f"--- xwininfo -root -tree ---\n{tree}\n--- app output ---\n"
                f"{self.output.read_text(errors='replace')[-3000:]}\n--- app log ---\n{app_log}")

    def stop(self) -> None:
        """After a failure: the app and the engines it left behind, by pid."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(QUIT_TIMEOUT_S)
        for pid in filter(running, self.engine_pids):
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def start_app(desktop: Desktop, tmp_path: Path, llama_server_bin: LlamaServer,
              tiny_gguf: Path) -> Iterator[Callable[..., RunningApp]]:
    started: list[RunningApp] = []

    def start(*extra: str) -> RunningApp:
        app = RunningApp(desktop, tmp_path / f"run-{len(started)}", llama_server_bin, tiny_gguf, *extra)
        started.append(app)
        return app

    yield start
    for app in started:
        app.stop()


@contextlib.contextmanager
def explained(app: RunningApp) -> Iterator[None]:
    """On failure, print what X shows and the app's logs (pytest shows them with the failure)."""
    try:
        yield
    except BaseException:
        print(app.explain())
        raise


def test_tray_icon_click_menu_and_quit_with_the_dashboard_open(desktop, start_app):
    assert desktop.tray_available()  # QSystemTrayIcon sees the tray host on this display
    app = start_app("--minimized")
    with explained(app):
        quit_from_the_tray_menu(desktop, app)


def quit_from_the_tray_menu(desktop: Desktop, app: RunningApp) -> None:
    icon = wait_until(lambda: desktop.docked_icon(TITLE), "the app's icon docked in the tray host")
    wait_until(app.serving, "the app to serve the model", SERVING_TIMEOUT_S, every_s=0.3)
    assert not app.dashboard()  # --minimized: in the tray only

    desktop.click(icon, 1)
    wait_until(app.dashboard, "the dashboard window after clicking the tray icon")

    desktop.click(icon, 3)
    menu = wait_until(lambda: desktop.shown(TITLE, "POPUP_MENU"), "the tray icon's menu")
    desktop.click_at(menu, menu.width // 2, menu.height - LAST_ITEM_FROM_BOTTOM)  # the last item: Quit
    assert app.wait_for_exit("Quit in the tray menu (dashboard open)") == 0


def test_sigterm_with_the_dashboard_open_ends_the_app(desktop, start_app):
    app = start_app()
    with explained(app):
        sigterm_once(app)


def sigterm_once(app: RunningApp) -> None:
    wait_until(app.dashboard, "the dashboard window at start")
    wait_until(app.serving, "the app to serve the model", SERVING_TIMEOUT_S, every_s=0.3)
    os.kill(app.process.pid, signal.SIGTERM)  # once: a second one would hide the bug
    assert app.wait_for_exit("one SIGTERM (dashboard open)") == 0
