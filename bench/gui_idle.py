"""Idle CPU as a person runs the app: the desktop app under a real X server, serving, no requests.

Qt's offscreen platform paints nothing and has no system tray, so it can neither show what a
visible dashboard costs nor hide the dashboard at all. Here the app runs on Xvfb with a window
manager (openbox) and a system tray (trayer), as on a desktop:

- `gui-shown`: the dashboard in a real, mapped window (checked with `xdotool`);
- `gui-hidden`: `--minimized`, the app in the tray and no window mapped;
- `headless`: `gpu-provider run --headless`, for comparison in the same run.

Each is the real app connected to a reference coordinator that assigns a model, served by the
vLLM stand-in on a recorded RTX 4090 (as in `bench.node`), with the first-run flow marked done.
After the node reports ready and a settling pause, the app process's own CPU time over the window
(engine children excluded) is the figure; the X server's CPU over the same window is noted, since
painting costs land partly there.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench.node import TOKEN, _assignment, _environment, _prepare
from bench.report import Figure, at_most, cpu_percent, not_measured
from tests.support.desktop import Desktop, missing_packages, real_desktop
from tests.support.engines import VLLM_STANDIN
from tests.support.processes import terminate
from worker.system import config
from worker.contract import protocol
from worker.link.local import ReferenceCoordinator

SECTION = "gui"
TARGET_CPU_PCT = {"gui-shown": 0.5, "gui-hidden": 0.2, "headless": 0.2}
TARGET_RSS_MB = {"gui-shown": 250, "gui-hidden": 250, "headless": 120}
KINDS = tuple(TARGET_CPU_PCT)
SETTLE_S = 5.0  # after ready: start-up work (first charts, first status) is not idle
START_TIMEOUT_S = 90.0
DASHBOARD_TITLE = "GPU Provider"
DASHBOARD_MIN = (400, 300)  # a notification balloon is a window of the same name, but small
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Reading:
    cpu_pct: float  # of one core, the app process only
    x_server_cpu_pct: float
    rss_mb: float
    window_shown: bool  # a mapped dashboard window, as xdotool sees it
    window_s: float


def dashboard_shown(desktop: Desktop) -> bool:
    return desktop.shown(DASHBOARD_TITLE, "NORMAL", DASHBOARD_MIN) is not None


def _argv(kind: str, coordinator_url: str, folder: Path, hardware: Path) -> list[str]:
    common = ["--coordinator", coordinator_url, "--hardware", str(hardware), "--data-dir", str(folder / "data"),
              "--engine-bin", f"vllm={VLLM_STANDIN}"]
    if kind == "headless":
        return [sys.executable, "-m", "worker", "run", "--headless", *common]
    return [sys.executable, "-m", "app", *common] + (["--minimized"] if kind == "gui-hidden" else [])


def _set_up(folder: Path, coordinator_url: str) -> None:
    """The first-run flow done, as for anyone past their first hour: no setup window opens."""
    paths = config.Paths.under(folder / "data").ensure()
    config.save_settings(paths, config.Settings(coordinator_url=coordinator_url, setup_complete=True))


async def _one(kind: str, the_desktop: Desktop, window_s: float) -> Reading:
    with tempfile.TemporaryDirectory(prefix="bench-gui-") as tmp:
        folder = Path(tmp)
        model_dir, hardware = _prepare(folder)
        async with ReferenceCoordinator(token=TOKEN, assign=_assignment(model_dir), ping_interval=None) as coordinator:
            _set_up(folder, coordinator.url)
            env = the_desktop.env(_environment({}))  # the real X11 platform, never offscreen
            process = await asyncio.create_subprocess_exec(
                *_argv(kind, coordinator.url, folder, hardware), cwd=ROOT, env=env,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            try:
                await coordinator.wait_for(lambda m: isinstance(m, protocol.Status) and m.state == "ready",
                                           timeout=START_TIMEOUT_S)
                await asyncio.sleep(SETTLE_S)
                return await _window(process.pid, the_desktop, window_s)
            finally:
                await terminate(process, 40)


async def _window(pid: int, the_desktop: Desktop, window_s: float) -> Reading:
    app, server = psutil.Process(pid), psutil.Process(the_desktop.processes[0].pid)  # the X server first
    shown = await asyncio.to_thread(dashboard_shown, the_desktop)
    app_before, server_before = sum(app.cpu_times()[:2]), sum(server.cpu_times()[:2])
    await asyncio.sleep(window_s)
    app_cpu = sum(app.cpu_times()[:2]) - app_before
    server_cpu = sum(server.cpu_times()[:2]) - server_before
    return Reading(cpu_percent(app_cpu, window_s), cpu_percent(server_cpu, window_s), app.memory_info().rss / 2**20,
                   shown, window_s)


def _why_not() -> str | None:
    if missing := missing_packages():
        return f"needs the Debian packages {' '.join(missing)}"
    try:
        import PySide6  # noqa: F401
    except ImportError:
        return "PySide6 is not installed (pip install 'gpu-provider[gui]')"
    return None


async def measure(quick: bool) -> tuple[list[Figure], dict[str, Any]]:
    window_s = 30.0 if quick else 60.0  # at least the charts' slide (app/charts.py IDLE_REDRAW_S): its repaint counts
    details: dict[str, Any] = {"window_s": window_s}
    why_not = _why_not()
    if why_not is not None:
        return [not_measured(SECTION, f"{kind}: idle CPU", why_not, f"≤ {TARGET_CPU_PCT[kind]} %")
                for kind in KINDS], details
    readings: dict[str, Reading | str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-x11-") as x11, real_desktop(Path(x11)) as the_desktop:
        for kind in KINDS:
            try:
                readings[kind] = await _one(kind, the_desktop, window_s)
            except (TimeoutError, OSError, psutil.Error) as exc:
                readings[kind] = f"{type(exc).__name__}: {exc}"
    figures = []
    for kind, reading in readings.items():
        target = TARGET_CPU_PCT[kind]
        if isinstance(reading, str):
            figures.append(not_measured(SECTION, f"{kind}: idle CPU", reading, f"≤ {target} %"))
            continue
        details[kind] = reading.__dict__
        figures.append(at_most(SECTION, f"{kind}: idle CPU", reading.cpu_pct, "%", target,
                               f"of one core, app process only, over {window_s:g} s, serving, no requests; "
                               f"X server {reading.x_server_cpu_pct:.2f} %; {_window_note(kind, reading)}"))
        figures.append(at_most(SECTION, f"{kind}: RSS", reading.rss_mb, "MB", TARGET_RSS_MB[kind],
                               "engine children excluded"))
    return figures, details


def _window_note(kind: str, reading: Reading) -> str:
    if kind == "headless":
        return "no GUI"
    expected = kind == "gui-shown"
    state = "dashboard window shown" if reading.window_shown else "no dashboard window shown"
    return state if reading.window_shown == expected else f"UNEXPECTED: {state}"
