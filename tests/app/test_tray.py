from __future__ import annotations

import datetime as dt
from dataclasses import replace

import pytest

from app.bridge import seconds_until_tomorrow
from app.tray import Tray
from tests.app import snapshots
from tests.app.scripted_node import headed
from worker.contract.events import (
    ConnectionSnapshot,
    EarningsSnapshot,
    NodeSnapshot,
    Problem,
    ThroughputSnapshot,
    TuningSnapshot,
)

NOW = snapshots.NOW
PAUSES = ["Pause for 15 min", "Pause for 1 hour", "Pause until tomorrow"]
PAUSES_WHILE_PAUSED = ["Pause for 15 more min", "Pause for 1 more hour", "Keep paused until tomorrow"]
WINDOWS = ["Open dashboard", "Settings…", "View logs", "Quit"]


EARNED = EarningsSnapshot(currency="USD", today=2.84, energy_cost_today=0.61, power_measured=True,
                          electricity_price_per_kwh=0.30)  # $2.23 net of the measured electricity


def steady(snap: NodeSnapshot, live: float | None = None) -> NodeSnapshot:
    """The shared sample with the figures these tests read set here: today's earnings, live tok/s."""
    return replace(snap, earnings=EARNED, throughput=replace(snap.throughput, live_tokens_per_s=live))


def live_serving() -> NodeSnapshot:
    return steady(snapshots.serving(), 640.0)


def signed_out() -> NodeSnapshot:
    problem = Problem("Signed out", "The network no longer accepts this node's token.", "sign_in")
    return replace(snapshots.idle(), connection=ConnectionSnapshot(snapshots.CONNECTED.coordinator_url,
                                                                   "signed_out", problem))


def offline_retrying() -> NodeSnapshot:
    problem = Problem("No connection", "Cannot download the engine: this computer seems to be offline.", "retry",
                      retry_at=NOW + 60)
    return replace(snapshots.idle(), state="starting", model=snapshots.MODEL, problem=problem)


def restarting() -> NodeSnapshot:
    snap = snapshots.starting()
    return replace(snap, downloads=(), engines=(replace(snap.engines[0], failures_in_a_row=3, restart_limit=5),))


def setup_needed() -> NodeSnapshot:
    """The first-run flow was closed with Later: the node waits, doing nothing."""
    return replace(snapshots.idle(), setup_needed=True)


def game(detail: str | None = "Cyberpunk2077.exe") -> NodeSnapshot:
    return replace(steady(snapshots.paused_for_game()), pause_detail=detail)


def out_of_memory() -> NodeSnapshot:
    problem = Problem("The engine ran out of GPU memory",
                      "Qwen/Qwen3-8B does not fit in the GPU memory that is free. Close other GPU apps, then Retry.",
                      "retry", details=("torch.OutOfMemoryError: CUDA out of memory",))
    return replace(snapshots.failed(), problem=problem)


def tuning() -> NodeSnapshot:
    """Trial engines hold the card: no engine of the assignment serves meanwhile."""
    running = TuningSnapshot(state="running", trial=4, trials_max=12, elapsed_s=402.0)
    return replace(snapshots.idle(), state="configured", model=snapshots.MODEL, tuning=running)


def stopping(in_flight: int) -> NodeSnapshot:
    return replace(live_serving(), stopping=True, in_flight=in_flight)


def show(tray: Tray, node, qtbot, snapshot: NodeSnapshot) -> list[tuple[str, bool]]:
    node.emit(snapshot)  # on this thread: the bridge hands it on at once (unless it shows nothing new)
    assert tray.bridge.latest.without_clock() == headed(snapshot).without_clock()
    return menu_items(tray)


def menu_items(tray: Tray) -> list[tuple[str, bool]]:
    tray.menu.aboutToShow.emit()
    return [(a.text(), a.isEnabled()) for a in tray.menu.actions() if not a.isSeparator()]


def trigger(tray: Tray, text: str) -> None:
    tray.menu.aboutToShow.emit()
    next(a for a in tray.menu.actions() if a.text() == text and a.isEnabled()).trigger()


@pytest.mark.parametrize(
    ("make", "status", "figures", "commands"),
    [
        (snapshots.idle, "Idle", "$2.23 net today", []),  # nothing to pause while the network assigns nothing
        (snapshots.starting, "Downloading the model · 76 %", "$2.23 net today", ["Pause serving", *PAUSES]),
        (live_serving, "Serving · Qwen/Qwen3-8B", "640 tok/s · $2.23 net today", ["Pause serving", *PAUSES]),
        (lambda: steady(snapshots.degraded(), 320.0), "Serving with problems · Qwen/Qwen3-8B",
         "320 tok/s · $2.23 net today", ["Pause serving", *PAUSES]),
        (restarting, "Starting", "$2.23 net today", ["Pause serving", *PAUSES]),
        (out_of_memory, "Failed: The engine ran out of GPU memory", "$2.23 net today", ["Try again"]),  # never a pause
        (offline_retrying, "Offline", "$2.23 net today", ["Try again"]),
        (signed_out, "Signed out", "$2.23 net today", ["Sign in"]),
        (lambda: replace(live_serving(), update_ready="0.3.0"), "Serving · Qwen/Qwen3-8B",
         "640 tok/s · $2.23 net today", ["Restart to update", "Pause serving", *PAUSES]),
        (game, "Paused for Cyberpunk2077.exe", "$2.23 net today", ["Resume serving", *PAUSES_WHILE_PAUSED]),
        (lambda: game(None), "Paused for a game", "$2.23 net today", ["Resume serving", *PAUSES_WHILE_PAUSED]),
        (tuning, "Tuning… (trial 4 of 12)", "$2.23 net today", ["Pause serving", *PAUSES]),
        (lambda: replace(game(), tuning=tuning().tuning), "Paused for Cyberpunk2077.exe", "$2.23 net today",
         ["Resume serving", *PAUSES_WHILE_PAUSED]),
        (setup_needed, "Finish setting up", "$2.23 net today", ["Finish setting up"]),
    ],
)
def test_menu_is_rebuilt_from_the_latest_snapshot(bridge, node, qtbot, make, status, figures, commands):
    tray = Tray(bridge)
    snap = make()
    items = show(tray, node, qtbot, steady(snap, snap.throughput.live_tokens_per_s))
    assert items[:2] == [(status, False), (figures, False)]  # information, not commands
    assert [text for text, _ in items[2:]] == [*commands, *WINDOWS]
    assert all(enabled for _, enabled in items[2:])


def test_live_rate_is_zero_when_serving_idle_and_earnings_carry_their_currency(bridge, node, qtbot):
    tray = Tray(bridge)
    quiet = replace(snapshots.serving(), throughput=ThroughputSnapshot(tokens_per_s=812.4, live_tokens_per_s=0.0),
                    earnings=EarningsSnapshot(currency="CRD", today=1.5, energy_cost_today=0.25, power_measured=True,
                                              electricity_price_per_kwh=0.3))
    assert show(tray, node, qtbot, quiet)[1] == ("0.0 tok/s · 1.25 CRD net today", False)
    assert tray.icon.toolTip() == "GPU Provider — Serving · Qwen/Qwen3-8B\n0.0 tok/s · 1.25 CRD net today"


def test_commands_reach_the_node(bridge, node, qtbot):
    tray = Tray(bridge)
    show(tray, node, qtbot, snapshots.serving())
    trigger(tray, "Pause serving")
    trigger(tray, "Pause for 15 min")
    trigger(tray, "Pause for 1 hour")
    trigger(tray, "Pause until tomorrow")
    show(tray, node, qtbot, snapshots.paused_for_game())
    trigger(tray, "Resume serving")
    assert node.commands[0] == ("pause", (None, "user"))
    assert node.commands[1] == ("pause", (900, "timed"))
    assert node.commands[2] == ("pause", (3600, "timed"))
    kind, (seconds, reason) = node.commands[3]
    assert kind == "pause" and reason == "timed" and 6 * 3600 <= seconds <= 30 * 3600
    assert node.commands[4] == ("resume", None)


def test_a_pause_chosen_while_paused_adds_to_the_time_left(bridge, node, qtbot):
    tray = Tray(bridge, clock=lambda: NOW)
    show(tray, node, qtbot, snapshots.paused_until(NOW + 600))  # 10 min left
    trigger(tray, "Pause for 1 more hour")
    trigger(tray, "Pause for 15 more min")
    show(tray, node, qtbot, game())  # no end: from now
    trigger(tray, "Pause for 1 more hour")
    assert node.commands == [("pause", (600 + 3600, "timed")), ("pause", (600 + 900, "timed")),
                             ("pause", (3600, "timed"))]


def test_keep_paused_until_tomorrow_never_shortens_a_longer_pause(bridge, node, qtbot):
    tray = Tray(bridge, clock=lambda: NOW)
    tomorrow = NOW + seconds_until_tomorrow(dt.datetime.fromtimestamp(NOW))
    items = dict(show(tray, node, qtbot, snapshots.paused_until(NOW + 600)))
    assert items["Keep paused until tomorrow"] is True
    items = dict(show(tray, node, qtbot, snapshots.paused_until(tomorrow + 3600)))
    assert items["Keep paused until tomorrow"] is False


def test_remedies_and_windows_emit_the_signals_the_app_wires(bridge, node, qtbot):
    tray = Tray(bridge)
    show(tray, node, qtbot, setup_needed())
    with qtbot.waitSignal(tray.setup_requested, timeout=500):
        trigger(tray, "Finish setting up")
    problem = Problem("Signed out", "The token was revoked.", "sign_in")
    everything = replace(out_of_memory(), update_ready="0.3.0",
                         connection=ConnectionSnapshot("wss://x", "signed_out", problem))
    show(tray, node, qtbot, everything)
    for text, signal in (
        ("Sign in", tray.sign_in_requested),
        ("Try again", tray.retry_requested),
        ("Restart to update", tray.update_requested),
        ("Open dashboard", tray.open_dashboard),
        ("Settings…", tray.open_settings),
        ("View logs", tray.open_logs),
        ("Quit", tray.quit_requested),
    ):
        with qtbot.waitSignal(signal, timeout=500):
            trigger(tray, text)
    assert node.commands == []  # the app decides what each one opens or asks the core


def test_quit_says_stopping_at_once_and_is_offered_no_more(bridge, node, qtbot):
    tray = Tray(bridge)
    show(tray, node, qtbot, replace(live_serving(), in_flight=3))
    with qtbot.waitSignal(tray.quit_requested, timeout=500):
        trigger(tray, "Quit")
    assert tray.icon.toolTip().startswith("GPU Provider — Stopping…\n")
    items = menu_items(tray)
    assert items[0] == ("Stopping…", False)
    assert ("Quit", False) in items
    assert not any(text.startswith(("Pause", "Resume", "Try again")) for text, _ in items)


@pytest.mark.parametrize(("in_flight", "line"), [(2, "2 requests finishing"), (1, "1 request finishing"),
                                                 (0, "$0.00 earned today")])
def test_the_cores_drain_shows_what_is_left(bridge, node, qtbot, in_flight, line):
    tray = Tray(bridge)
    items = show(tray, node, qtbot, replace(stopping(in_flight), earnings=EarningsSnapshot(currency="USD")))
    assert items[:2] == [("Stopping…", False), (line, False)]
    assert [text for text, _ in items[2:]] == ["Open dashboard", "View logs", "Quit"]
    assert items[-1] == ("Quit", False)
    assert tray.icon.toolTip() == f"GPU Provider — Stopping…\n{line}"


def test_today_is_called_net_only_where_electricity_is_measured(bridge, node, qtbot):
    tray = Tray(bridge)
    unmeasured = replace(EARNED, power_measured=False, energy_cost_today=0.0)  # a Mac, or a CPU node
    assert show(tray, node, qtbot, replace(snapshots.idle(), earnings=unmeasured))[1] == ("$2.84 earned today", False)


def test_until_tomorrow_means_tomorrow_morning():
    assert seconds_until_tomorrow(dt.datetime(2026, 3, 1, 23, 30)) == 6.5 * 3600
    assert seconds_until_tomorrow(dt.datetime(2026, 3, 1, 9, 0)) == 21 * 3600


def test_tooltip_and_icon_follow_the_state(bridge, node, qtbot):
    tray = Tray(bridge)
    idle_icon = tray.icon.icon().pixmap(32).toImage()
    show(tray, node, qtbot, live_serving())
    assert tray.icon.toolTip() == "GPU Provider — Serving · Qwen/Qwen3-8B\n640 tok/s · $2.23 net today"
    assert tray.icon.icon().pixmap(32).toImage() != idle_icon
    show(tray, node, qtbot, game())
    assert tray.icon.toolTip() == "GPU Provider — Paused for Cyberpunk2077.exe\n$2.23 net today"


def test_an_unchanged_state_does_not_touch_the_icon(bridge, node, qtbot, monkeypatch):
    tray = Tray(bridge)
    show(tray, node, qtbot, snapshots.serving())
    icons: list[object] = []
    monkeypatch.setattr(tray.icon, "setIcon", icons.append)
    show(tray, node, qtbot, snapshots.serving())
    assert icons == []
    show(tray, node, qtbot, snapshots.failed())
    assert len(icons) == 1


def test_notifications_fire_once_per_incident(bridge, node, qtbot, monkeypatch):
    tray = Tray(bridge)
    shown: list[tuple[str, str]] = []
    monkeypatch.setattr(tray.icon, "showMessage", lambda title, message, *_: shown.append((title, message)))
    for make in (snapshots.starting, snapshots.serving, snapshots.serving, game, game, restarting, restarting,
                 out_of_memory, out_of_memory):
        show(tray, node, qtbot, make())
    assert [title for title, _ in shown] == ["Serving · Qwen/Qwen3-8B", "Paused for Cyberpunk2077.exe",
                                             "Failed: The engine ran out of GPU memory"]
    assert shown[-1][1] == "Qwen/Qwen3-8B does not fit in the GPU memory that is free."
    assert [n.title for n in tray.shown_notifications] == [title for title, _ in shown]


def test_a_dead_core_turns_the_icon_red_and_says_so_briefly(bridge, qtbot):
    tray = Tray(bridge)
    with qtbot.waitSignal(bridge.core_failed):
        bridge.report_core_failure(OSError("disk full"))
    note = tray.shown_notifications[-1]
    assert note.title == "GPU Provider stopped serving" and len(note.message) <= 120
    assert tray.icon.toolTip() == "GPU Provider — GPU Provider stopped serving"
