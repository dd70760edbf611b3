"""Quit from the tray and SIGTERM end the app on the first request with the dashboard open.

Qt 6's `quit()` first closes every window and gives up when one refuses; the dashboard refuses a
close to hide into the tray, so before the fix the tray's Quit only hid the window and SIGTERM
was ignored (a second one was needed). Offscreen Qt reports no tray, so the app is told one exists.
Each case runs in its own process, since a finished Qt loop cannot be restarted in one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("how", ["sigterm", "tray-quit"])
def test_quit_with_the_dashboard_open_ends_the_app_and_the_core(tmp_path: Path, how: str) -> None:
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run([sys.executable, "-m", "tests.app.quit_with_dashboard_open", how, str(tmp_path)],
                              capture_output=True, text=True, timeout=30, env=env, cwd=ROOT, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the app ignored the quit request ({how}) for 30 s: {exc.stdout!r}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "quit-returned 0 True" in done.stdout, done.stdout + done.stderr[-2000:]
