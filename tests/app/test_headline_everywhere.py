"""One state, the same words everywhere: the dashboard's header, the tray's menu and tooltip and the
notifications all show the headline the core's `headline` computes for the snapshot."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.dashboard import Dashboard
from app.tray import Tray
from tests.app import snapshots
from worker.contract.events import ConnectionSnapshot, DownloadProgress, NodeSnapshot, RoutingNotice, TuningSnapshot

NOW = snapshots.NOW


def downloading() -> NodeSnapshot:
    download = DownloadProgress(f"model {snapshots.MODEL}", 1_300_000_000, 4_500_000_000, 8_000_000, 400.0)
    return replace(snapshots.idle(), state="configured", model=snapshots.MODEL, assignment_id="as-91",
                   downloads=(download,))


def held_for_game() -> NodeSnapshot:
    held = replace(downloading().downloads[0], held="game", held_detail="Cyberpunk2077.exe", rate_bps=None)
    return replace(downloading(), downloads=(held,))


STATES = {
    "setup": lambda: replace(snapshots.idle(), setup_needed=True),
    "detecting": snapshots.detecting,
    "stopping": lambda: replace(snapshots.serving(), stopping=True),
    "signed_out": snapshots.signed_out,
    "failed": snapshots.failed_with_retry,
    "offline": snapshots.offline,
    "offline_link": lambda: replace(snapshots.idle(), connection=ConnectionSnapshot(
        snapshots.CONNECTED.coordinator_url, "offline", retry_in_s=12.0)),
    "paused": snapshots.paused_for_named_game,
    "paused_until": lambda: snapshots.paused_until(NOW + 3600),
    "downloading": downloading,
    "download_held": held_for_game,
    "tuning": lambda: replace(snapshots.idle(), state="configured", model=snapshots.MODEL,
                              tuning=TuningSnapshot(state="running", trial=4, trials_max=12)),
    "starting": snapshots.restarting,
    "degraded": snapshots.degraded,
    "serving": snapshots.serving,
    "serving_unrouted": lambda: replace(snapshots.serving(), routing=RoutingNotice(0.0, "low_demand", "", NOW)),
    "idle": snapshots.idle,
}


@pytest.mark.parametrize("state", list(STATES))
def test_tray_dashboard_and_snapshot_say_the_same_words(bridge, node, qtbot, state):
    dashboard = Dashboard(bridge)
    qtbot.addWidget(dashboard)
    tray = Tray(bridge)
    node.emit(STATES[state]())
    headline = bridge.latest.headline
    assert headline.title  # the core's words, from worker.node.headline
    tray.menu.aboutToShow.emit()
    first_line = tray.menu.actions()[0]
    assert (first_line.text(), first_line.isEnabled()) == (headline.title, False)
    assert tray.icon.toolTip().splitlines()[0] == f"GPU Provider — {headline.title}"
    assert dashboard.text("state") == headline.title
    button = dashboard.pause_button
    assert button.isVisibleTo(dashboard) == (headline.action != "none")
    assert button.text() == headline.action_label
    if headline.kind in ("failed", "offline", "signed_out", "setup"):
        offered = [a.text() for a in tray.menu.actions() if a.isEnabled()]
        assert "Pause serving" not in offered and "Pause serving" != button.text()
        assert headline.action_label in offered  # the tray offers the dashboard's remedy
    reason = dashboard.values.labels["not_earning"]
    shown = headline.not_earning is not None and headline.not_earning != headline.title
    assert reason.isVisibleTo(dashboard) == shown
    if shown:
        assert reason.text() == f"Not earning: {headline.not_earning}"


def test_notifications_are_titled_with_the_headline(bridge, node, qtbot, monkeypatch):
    tray = Tray(bridge)
    shown: list[str] = []
    monkeypatch.setattr(tray.icon, "showMessage", lambda title, *_: shown.append(title))
    titles = []
    for make in (snapshots.serving, snapshots.paused_for_named_game, snapshots.failed_with_retry):
        node.emit(make())
        titles.append(bridge.latest.headline.title)
    assert shown == titles


def test_the_main_button_runs_the_headlines_action(bridge, node, qtbot):
    dashboard = Dashboard(bridge)
    qtbot.addWidget(dashboard)
    node.emit(replace(snapshots.idle(), setup_needed=True))
    with qtbot.waitSignal(dashboard.setup_requested, timeout=500):
        dashboard.pause_button.click()
    node.emit(snapshots.signed_out())
    with qtbot.waitSignal(dashboard.sign_in_requested, timeout=500):
        dashboard.pause_button.click()
    node.emit(snapshots.failed_with_retry())
    with qtbot.waitSignal(dashboard.retry_requested, timeout=500):
        dashboard.pause_button.click()
    node.emit(snapshots.serving())
    dashboard.pause_button.click()
    node.emit(snapshots.paused_for_named_game())
    dashboard.pause_button.click()
    assert node.commands == [("pause", (None, "user")), ("resume", None)]
