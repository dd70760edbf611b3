from __future__ import annotations

import time
from dataclasses import replace

import pytest

from app.dashboard import Dashboard
from tests.app import snapshots
from worker.events import DownloadProgress


@pytest.fixture
def dashboard(bridge, qtbot) -> Dashboard:
    window = Dashboard(bridge)
    qtbot.addWidget(window)
    return window


def show(node, qtbot, bridge, snapshot) -> None:
    with qtbot.waitSignal(bridge.snapshot_changed):
        node.emit(snapshot)


def test_serving_shows_the_measured_figures(dashboard, node, bridge, qtbot):
    show(node, qtbot, bridge, snapshots.serving())
    d = dashboard
    assert d.text("state") == "Serving"
    assert d.text("tokens_per_s") == "812 tok/s"
    assert d.text("tokens_per_s.detail") == "71.2 tok/s per request · first token 0.21 s (median)"
    assert d.text("in_flight") == "3"
    assert d.text("earned_today") == "$2.23"
    assert d.text("effective_vram") == "45.2 GiB"
    assert d.text("gpu0.name") == "GPU 0 · NVIDIA GeForce RTX 4090"
    assert d.text("gpu0.memory") == "21.5 GiB used · 22.6 GiB usable of 24.0 GiB"
    assert d.text("gpu1.live") == "Utilisation 84 %   ·   71 °C   ·   301 W of 350 W"
    assert d.text("groups") == "Groups [GPU 0, GPU 1] → 45.2 GiB effective"
    assert d.text("engine:engine-0.title") == "engine-0 · vLLM · tensor on GPU 0, 1 · tier 24000 MiB"
    assert d.text("engine:engine-0.kv") == "284,512 tokens · 19.5 GiB · 8.7× max concurrency"
    assert d.text("engine:engine-0.context") == (
        "servable 32,768  (requested 32,768 · declared 32,768 · physical 284,512)"
    )
    assert d.text("roofline") == "62%"
    assert d.text("earn.week.net") == "$13.48"
    assert d.text("earn.all_time.energy") == "−$22.05"
    assert d.text("connection") == "Connected"
    assert d.pause_button.text() == "Pause serving"
    assert not d.banner.isVisibleTo(d)


def test_an_engine_the_app_does_not_know_is_shown_by_its_name(dashboard, node, bridge, qtbot):
    """A snapshot from a node with another engine (a newer core, an old status file) is no KeyError."""
    serving = snapshots.serving()
    show(node, qtbot, bridge, replace(serving, engines=tuple(replace(e, engine="sglang") for e in serving.engines)))
    assert dashboard.text("engine:engine-0.title") == "engine-0 · sglang · tensor on GPU 0, 1 · tier 24000 MiB"


def test_starting_shows_phase_and_download(dashboard, node, bridge, qtbot):
    show(node, qtbot, bridge, snapshots.starting())
    card = dashboard._engine_cards["engine-0"]
    assert dashboard.text("engine:engine-0.phase") == "Compiling (step 4 of 7)"
    assert card.phase_bar.isVisibleTo(dashboard) and card.phase_bar.value() == 3
    assert dashboard.text("engine:engine-0.kv") == "— (measured once the engine has loaded)"
    assert dashboard.text("download:model Qwen/Qwen3-8B") == (
        "model Qwen/Qwen3-8B: 11.5 of 15.3 GiB · 91 MiB/s · 42 s left"
    )
    assert dashboard.downloads_card.isVisibleTo(dashboard)
    finished = replace(snapshots.serving(), downloads=(DownloadProgress("model x", 5, 5, finished=True),))
    show(node, qtbot, bridge, finished)
    assert not dashboard.downloads_card.isVisibleTo(dashboard)
    assert not card.phase_bar.isVisibleTo(dashboard)


def test_failed_shows_the_problem_and_its_action(dashboard, node, bridge, qtbot):
    show(node, qtbot, bridge, snapshots.failed())
    assert dashboard.banner.isVisibleTo(dashboard)
    assert dashboard.text("problem_title") == "The engine ran out of GPU memory"
    assert dashboard.banner_action.text() == "Open settings"
    assert dashboard.text("engine:engine-0.error") == "Last error: torch.OutOfMemoryError: CUDA out of memory"
    with qtbot.waitSignal(dashboard.settings_requested, timeout=500):
        dashboard.banner_action.click()


def test_signed_out_offers_sign_in(dashboard, node, bridge, qtbot):
    show(node, qtbot, bridge, snapshots.signed_out())
    assert dashboard.text("connection") == "Signed out"
    with qtbot.waitSignal(dashboard.sign_in_requested, timeout=500):
        dashboard.banner_action.click()


def test_paused_and_idle(dashboard, node, bridge, qtbot):
    show(node, qtbot, bridge, snapshots.paused_for_game())
    assert dashboard.text("state") == "Paused"
    assert dashboard.text("subtitle").startswith("Paused for a game")
    show(node, qtbot, bridge, replace(snapshots.paused_for_game(), pause_detail="Cyberpunk2077.exe"))
    assert dashboard.text("subtitle").startswith("Paused for Cyberpunk2077.exe")
    dashboard.pause_button.click()
    show(node, qtbot, bridge, snapshots.idle())
    dashboard.pause_button.click()
    assert node.commands == [("resume", None), ("pause", (None, "user"))]
    assert dashboard.text("plan") == "No plan yet: waiting for an assignment from the network."
    assert "engine-0" not in dashboard._engine_cards
    assert dashboard.text("tokens_per_s") == "—"


def test_command_line_toggle_survives_updates(dashboard, node, bridge, qtbot):
    show(node, qtbot, bridge, snapshots.serving())
    card = dashboard._engine_cards["engine-0"]
    card.argv_toggle.click()
    show(node, qtbot, bridge, snapshots.degraded())
    assert dashboard._engine_cards["engine-0"] is card
    assert card.argv.isVisibleTo(dashboard)
    assert "--api-key ***" in card.argv.toPlainText()
    assert dashboard.text("engine:engine-0.health") == "2 · pid 48211"


def test_charts_poll_only_while_visible(dashboard, node, qtbot):
    now = time.time()
    node.history_points["tokens_per_s"] = [(now - 20, 800.0), (now - 10, 820.0), (now - 7200, 1.0)]
    assert not dashboard.charts.timer.isActive()
    dashboard.show()
    qtbot.waitExposed(dashboard)
    assert dashboard.charts.timer.isActive()
    assert {series for series, _ in node.history_calls} == {"tokens_per_s", "gpu_util", "power_w", "kv_usage"}
    x, y = dashboard.charts.curves["tokens_per_s"].getData()
    assert list(y) == [800.0, 820.0] and list(x) == pytest.approx([-20.0, -10.0], abs=1.0)
    dashboard.close()  # with a tray, closing hides
    assert not dashboard.isVisible()
    assert not dashboard.charts.timer.isActive()


def test_a_snapshot_that_only_moves_the_clock_is_not_rendered_again(dashboard, node, bridge, qtbot, monkeypatch):
    first = snapshots.serving()
    show(node, qtbot, bridge, first)
    rendered: list[str] = []
    monkeypatch.setattr(dashboard, "_show_stats", lambda snap: rendered.append("stats"))
    later = replace(first, at=first.at + 1, throughput=replace(first.throughput, run_seconds=first.throughput.run_seconds + 1))
    show(node, qtbot, bridge, later)
    assert rendered == []
    show(node, qtbot, bridge, replace(later, in_flight=later.in_flight + 1))
    assert rendered == ["stats"]


def test_charts_redraw_only_what_changed(dashboard, node, qtbot, monkeypatch):
    """An idle node's charts cost no repaints: unchanged series are not redrawn each second."""
    now = time.time()
    node.history_points["tokens_per_s"] = [(now - 20, 800.0)]
    dashboard.charts.refresh()
    drawn: list[str] = []
    for series, curve in dashboard.charts.curves.items():
        monkeypatch.setattr(curve, "setData", lambda *a, series=series, **k: drawn.append(series))
    dashboard.charts.refresh()
    assert drawn == []
    node.history_points["tokens_per_s"].append((now - 1, 810.0))
    dashboard.charts.refresh()
    assert drawn == ["tokens_per_s"]


def test_a_dead_core_is_reported_even_without_a_snapshot(dashboard, bridge, qtbot):
    import threading

    with qtbot.waitSignal(bridge.core_failed):
        threading.Thread(target=bridge.report_core_failure, args=(RuntimeError("ledger is locked"),)).start()
    assert dashboard.banner.isVisibleTo(dashboard)
    assert dashboard.text("problem_title") == "GPU Provider stopped serving"
    assert "RuntimeError: ledger is locked" in dashboard.text("problem_message")
