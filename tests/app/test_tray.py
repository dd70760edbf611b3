from __future__ import annotations

import datetime as dt

import pytest

from app.bridge import seconds_until_tomorrow
from app.tray import Tray
from tests.app import snapshots

COMMON = [
    "Pause for 15 min",
    "Pause for 1 hour",
    "Pause until tomorrow",
    "Open dashboard",
    "Settings…",
    "View logs",
    "Quit",
]


def menu_items(tray: Tray) -> list[tuple[str, bool]]:
    tray.menu.aboutToShow.emit()
    return [(a.text(), a.isEnabled()) for a in tray.menu.actions() if not a.isSeparator()]


@pytest.mark.parametrize(
    ("make", "status", "toggle"),
    [
        (snapshots.idle, "Idle", "Pause serving"),
        (snapshots.starting, "Starting · Qwen/Qwen3-8B", "Pause serving"),
        (snapshots.serving, "Serving · Qwen/Qwen3-8B", "Pause serving"),
        (snapshots.degraded, "Degraded · Qwen/Qwen3-8B", "Pause serving"),
        (snapshots.failed, "Failed: The engine ran out of GPU memory", "Pause serving"),
        (snapshots.paused_for_game, "Paused for a game", "Resume serving"),
    ],
)
def test_menu_is_rebuilt_from_the_latest_snapshot(bridge, node, qtbot, make, status, toggle):
    tray = Tray(bridge)
    with qtbot.waitSignal(bridge.snapshot_changed):
        node.emit(make())
    items = menu_items(tray)
    paused = toggle == "Resume serving"
    assert items[0] == (status, False)  # the state line is information, not a command
    assert items[1] == (toggle, True)
    assert [text for text, _ in items[2:]] == COMMON
    timed = dict(items[2:5])
    assert set(timed.values()) == {not paused}
    assert all(enabled for _, enabled in items[5:])


def test_menu_commands_reach_the_node(bridge, node, qtbot):
    tray = Tray(bridge)

    def trigger(text: str) -> None:
        tray.menu.aboutToShow.emit()
        next(a for a in tray.menu.actions() if a.text() == text).trigger()

    trigger("Pause serving")
    trigger("Pause for 15 min")
    trigger("Pause for 1 hour")
    trigger("Pause until tomorrow")
    with qtbot.waitSignal(bridge.snapshot_changed):
        node.emit(snapshots.paused_for_game())
    trigger("Resume serving")
    assert node.commands[0] == ("pause", (None, "user"))
    assert node.commands[1] == ("pause", (900, "timed"))
    assert node.commands[2] == ("pause", (3600, "timed"))
    kind, (seconds, reason) = node.commands[3]
    assert kind == "pause" and reason == "timed" and 6 * 3600 <= seconds <= 30 * 3600
    assert node.commands[4] == ("resume", None)


def test_window_and_quit_items_emit_signals(bridge, qtbot):
    tray = Tray(bridge)
    tray.menu.aboutToShow.emit()
    actions = {a.text(): a for a in tray.menu.actions()}
    for text, signal in (
        ("Open dashboard", tray.open_dashboard),
        ("Settings…", tray.open_settings),
        ("View logs", tray.open_logs),
        ("Quit", tray.quit_requested),
    ):
        with qtbot.waitSignal(signal, timeout=500):
            actions[text].trigger()


def test_until_tomorrow_means_tomorrow_morning():
    assert seconds_until_tomorrow(dt.datetime(2026, 3, 1, 23, 30)) == 6.5 * 3600
    assert seconds_until_tomorrow(dt.datetime(2026, 3, 1, 9, 0)) == 21 * 3600


def test_tooltip_and_icon_follow_the_state(bridge, node, qtbot):
    tray = Tray(bridge)
    idle_icon = tray.icon.icon().pixmap(32).toImage()
    with qtbot.waitSignal(bridge.snapshot_changed):
        node.emit(snapshots.serving())
    assert tray.icon.toolTip() == "GPU Provider — Serving · Qwen/Qwen3-8B\nQwen/Qwen3-8B · 812 tok/s\nToday: $2.23 net"
    assert tray.icon.icon().pixmap(32).toImage() != idle_icon


def test_an_unchanged_state_does_not_touch_the_icon(bridge, node, qtbot, monkeypatch):
    tray = Tray(bridge)
    with qtbot.waitSignal(bridge.snapshot_changed):
        node.emit(snapshots.serving())
    icons: list[object] = []
    monkeypatch.setattr(tray.icon, "setIcon", icons.append)
    with qtbot.waitSignal(bridge.snapshot_changed):
        node.emit(snapshots.serving())
    assert icons == []
    with qtbot.waitSignal(bridge.snapshot_changed):
        node.emit(snapshots.failed())
    assert len(icons) == 1


def test_notifications_fire_once_per_transition(bridge, node, qtbot):
    tray = Tray(bridge)
    for make in (
        snapshots.starting,
        snapshots.serving,
        snapshots.serving,
        snapshots.paused_for_game,
        snapshots.paused_for_game,
        snapshots.failed,
        snapshots.failed,
    ):
        with qtbot.waitSignal(bridge.snapshot_changed):
            node.emit(make())
    assert [n.title for n in tray.shown_notifications] == ["Serving", "Paused for a game", "Serving failed"]
    assert "lowest memory tier" in tray.shown_notifications[-1].message


def test_a_dead_core_turns_the_icon_red_and_says_so(bridge, qtbot):
    tray = Tray(bridge)
    with qtbot.waitSignal(bridge.core_failed):
        bridge.report_core_failure(OSError("disk full"))
    assert tray.shown_notifications[-1].title == "GPU Provider stopped serving"
    assert tray.icon.toolTip() == "GPU Provider — GPU Provider stopped serving"
