"""The Downloads card: percent, speed, time left, why it waits, and Pause, Resume and Cancel
reaching the core."""

from __future__ import annotations

from dataclasses import replace

import pytest
from PySide6.QtWidgets import QPushButton

from app.dashboard import Dashboard
from tests.app import snapshots
from worker.contract.events import DownloadProgress, NodeSnapshot
from worker.node.headline import download_detail

GIB = 2**30
WHAT = f"model {snapshots.MODEL}"


def downloading(**changes: object) -> NodeSnapshot:
    d = DownloadProgress(WHAT, int(1.7 * GIB), int(4.2 * GIB), 8 * 2**20, 320.0)
    return replace(snapshots.idle(), state="configured", model=snapshots.MODEL, assignment_id="as-91",
                   downloads=(replace(d, **changes),))


@pytest.fixture
def dashboard(bridge, qtbot) -> Dashboard:
    window = Dashboard(bridge)
    qtbot.addWidget(window)
    return window


def row(dashboard: Dashboard):
    return dashboard.downloads.rows[WHAT]


def test_percent_speed_and_time_left(dashboard, node):
    node.emit(downloading())
    assert dashboard.downloads_card.isVisibleTo(dashboard)
    assert dashboard.text(f"download:{WHAT}.title") == "Model Qwen/Qwen3-8B · 40 %"
    line = dashboard.text(f"download:{WHAT}")
    assert line == download_detail(downloading().downloads[0])  # the headline module's words
    assert line.startswith("1.7 ") and "4.2 GiB" in line and "8.0 MiB/s" in line and line.endswith("5 min left")
    assert row(dashboard).bar.value() == 404
    assert dashboard.text("state") == "Downloading the model · 40 %"  # the headline agrees


@pytest.mark.parametrize(("held", "detail", "line"), [
    ("game", "Cyberpunk2077.exe", "Waiting: paused while you play Cyberpunk2077.exe"),
    ("budget", "until 1 January", "Waiting: monthly download limit reached: waits until 1 January"),
    ("paused", None, "Waiting: paused while serving is paused"),
    ("paused_by_you", None, "Waiting: paused by you"),
])
def test_a_held_download_says_why_it_waits(dashboard, node, held, detail, line):
    node.emit(downloading(held=held, held_detail=detail, rate_bps=None, eta_s=None))
    assert dashboard.text(f"download:{WHAT}") == line
    assert row(dashboard).pause_button.text() == ("Resume" if held == "paused_by_you" else "Pause")


def test_pause_resume_and_cancel_reach_the_core(dashboard, node):
    node.emit(downloading())
    row(dashboard).pause_button.click()
    node.emit(downloading(held="paused_by_you"))
    row(dashboard).pause_button.click()
    row(dashboard).cancel_button.click()
    assert node.commands == [("pause_download", None), ("resume_download", None), ("cancel_download", None)]


def test_a_failed_download_offers_no_pause_and_a_finished_one_goes(dashboard, node):
    node.emit(downloading(error="the server closed the connection"))
    assert dashboard.text(f"download:{WHAT}") == "Failed: the server closed the connection"
    assert not row(dashboard).pause_button.isVisibleTo(dashboard)
    node.emit(downloading(finished=True, done_bytes=int(4.2 * GIB)))
    assert not dashboard.downloads_card.isVisibleTo(dashboard) and dashboard.downloads.rows == {}
    assert not [b for b in dashboard.findChildren(QPushButton) if b.text() == "Cancel" and b.isVisibleTo(dashboard)]
