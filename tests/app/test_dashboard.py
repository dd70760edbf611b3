"""The dashboard rendered offscreen for each state, in light and in dark: texts, what is visible,
which buttons there are and what they send, the reflow to one column, and readable colours."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import replace

import pytest
from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QColor, QFont, QImage
from PySide6.QtWidgets import QLabel, QPushButton, QWidget

from app import charts, theme
from app.dashboard import Dashboard, default_size
from app.format import clock_time
from tests.app import snapshots
from tests.app.scripted_node import headed
from worker.system.config import LocalEndpoint
from worker.contract.events import ConnectionSnapshot, DownloadProgress, Tuned, TuningSnapshot

JARGON = ("tier", "tensor", "Roofline", "runtime", "Groups [", "physical", "KV ", "pid", "Last error", "Traceback")



@pytest.fixture
def dashboard(bridge, qtbot, scheme) -> Dashboard:
    window = Dashboard(bridge)
    qtbot.addWidget(window)
    return window


def show(node, qtbot, bridge, snapshot) -> None:
    node.emit(snapshot)  # on this thread: the bridge hands it on at once (unless it shows nothing new)
    assert bridge.latest.without_clock() == headed(snapshot).without_clock()


def on_screen(dashboard: Dashboard) -> str:
    """Every text a person can see (a Details box folded away is not seen)."""
    texts = [w.text() for w in dashboard.findChildren(QLabel) if w.isVisibleTo(dashboard)]
    texts += [w.text() for w in dashboard.findChildren(QPushButton) if w.isVisibleTo(dashboard)]
    return "\n".join(texts)


def settle(qapp) -> None:
    for _ in range(3):  # wrapped labels take a few passes to settle their heights
        qapp.processEvents()


def test_serving_shows_the_measured_figures_in_plain_words(dashboard, node, bridge, qtbot):
    show(node, qtbot, bridge, snapshots.serving())
    d = dashboard
    assert d.text("state") == "Serving · Qwen/Qwen3-8B"
    assert d.text("tokens_per_s") == "846 tok/s"  # live, not the run's average (812)
    assert d.text("capacity") == "Best sustained 912 tok/s"
    assert d.values.labels["capacity"].property("dimmed") is False
    assert d.text("tokens_per_s.detail") == "each request gets 71.2 tok/s · first word after 0.21 s"
    assert d.text("in_flight") == "3"
    assert d.text("earned_today") == "$2.23"
    assert d.text("earned_today.detail") == "$0.19 per hour · this week $13.48"
    assert d.text("effective_vram") == "40.2 GiB"
    assert d.text("effective_vram.detail") == "2 of 2 GPUs lent · 2 GPUs working as one"
    assert d.text("gpu0.name") == "GPU 0 · NVIDIA GeForce RTX 4090"
    assert d.text("gpu0.memory") == "21.5 GiB used · 20.6 GiB usable of 24.0 GiB"
    assert d.text("gpu1.live") == "Busy 84 %   ·   71 °C   ·   301 W of 450 W"
    assert d.text("groups") == "2 GPUs working as one · 40.2 GiB for models"
    assert d.text("engine:engine-0.title") == "vLLM on 2 GPUs working as one"
    assert d.text("engine:engine-0.state") == "Serving"
    assert d.text("engine:engine-0.context") == "32k tokens per chat, 8 chats at once"
    assert "284,512 tokens" in d.values.labels["engine:engine-0.context"].toolTip()  # the KV budget
    assert d.text("engine:engine-0.memory") == "Up to 40.2 GiB of graphics memory · 37% of its chat memory in use"
    assert not d.values.labels["engine:engine-0.requests"].isVisibleTo(d)  # 3 being answered: one figure, above
    assert d.text("in_flight.detail") == "1,842 answered · 1,204,330 tokens this run"
    assert d.text("earn.week.net") == "$13.48"
    assert d.text("earn.all_time.energy") == "−$22.05"
    assert d.text("earn.per_hour") == "$0.19 per hour while serving (last 24 hours)"
    assert d.text("connection") == "Connected"
    assert d.pause_button.text() == "Pause serving"
    assert not d.banner.isVisibleTo(d) and not d.update_banner.isVisibleTo(d)
    assert not d.earnings.nudge.isVisibleTo(d)  # a price is set


def test_no_engine_jargon_on_screen(dashboard, node, bridge, qtbot):
    for make in (snapshots.serving, snapshots.starting, snapshots.failed_with_retry, snapshots.restarting):
        show(node, qtbot, bridge, make())
        seen = on_screen(dashboard)
        assert not [word for word in JARGON if word in seen], seen


TUNED = Tuned(args=("--max-num-seqs", "64"), gain_pct=41.6, noise_pct=1.2,
              words=("serves up to 64 requests at once instead of 16",))


def test_tuning_shows_its_trial_then_the_chosen_settings_in_words_and_the_gain(dashboard, node, bridge, qtbot):
    running = TuningSnapshot(state="running", trial=4, trials_max=12, best_gain_pct=6.1)
    show(node, qtbot, bridge, replace(snapshots.serving(), engines=(), state="configured", tuning=running))
    assert dashboard.text("state") == "Tuning… (trial 4 of 12)"
    assert dashboard.text("tuning") == ("Tuning… (trial 4 of 12): trying other settings to serve faster on this "
                                        "computer; best so far 6% faster. Requests go to other computers meanwhile.")
    serving = snapshots.serving()
    done = replace(serving, tuning=TuningSnapshot(state="done", chosen=TUNED),
                   engines=(replace(serving.engines[0], tuned=TUNED),))
    show(node, qtbot, bridge, done)
    said = "Serves up to 64 requests at once instead of 16 · 42% faster, measured on this computer"
    assert dashboard.text("tuning") == f"Tuned for this computer: {said}"
    assert dashboard.text("engine:engine-0.tuned") == said
    seen = on_screen(dashboard)
    assert said in seen and not [word for word in JARGON + ("--",) if word in seen], seen
    show(node, qtbot, bridge, serving)
    assert not dashboard.values.labels["tuning"].isVisibleTo(dashboard)
    assert not dashboard.values.labels["engine:engine-0.tuned"].isVisibleTo(dashboard)


def test_an_engine_the_app_does_not_know_is_shown_by_its_name(dashboard, node, bridge, qtbot):
    """A snapshot from a node with another engine (a newer core, an old status file) is no KeyError."""
    serving = snapshots.serving()
    show(node, qtbot, bridge, replace(serving, engines=tuple(replace(e, engine="tgi") for e in serving.engines)))
    assert dashboard.text("engine:engine-0.title") == "tgi on 2 GPUs working as one"


def test_starting_shows_phase_and_download(dashboard, node, bridge, qtbot):
    show(node, qtbot, bridge, snapshots.starting())
    card = dashboard._engine_cards["engine-0"]
    assert dashboard.text("state") == "Downloading the model · 76 %"
    assert dashboard.pause_button.text() == "Pause serving"  # a pause holds the download too
    assert dashboard.text("engine:engine-0.phase") == "Compiling (step 4 of 7)"
    assert card.phase_bar.isVisibleTo(dashboard) and card.phase_bar.value() == 3
    assert dashboard.text("engine:engine-0.context") == "32k tokens per chat"
    assert dashboard.text("download:model Qwen/Qwen3-8B.title") == "Model Qwen/Qwen3-8B · 76 %"
    line = dashboard.text("download:model Qwen/Qwen3-8B")
    assert "15.3 GiB" in line and "90.6 MiB/s" in line and line.endswith("less than a minute left")
    assert dashboard.downloads_card.isVisibleTo(dashboard)
    finished = replace(snapshots.serving(), downloads=(DownloadProgress("model x", 5, 5, finished=True),))
    show(node, qtbot, bridge, finished)
    assert not dashboard.downloads_card.isVisibleTo(dashboard)
    assert not card.phase_bar.isVisibleTo(dashboard)


def test_failed_shows_one_banner_with_retry_and_folded_details(dashboard, node, bridge, qtbot):
    snapshot = snapshots.failed_with_retry()
    show(node, qtbot, bridge, snapshot)
    d, banner = dashboard, dashboard.banner
    assert banner.isVisibleTo(d)
    assert d.text("state") == "Failed: Not enough GPU memory for this model"
    assert d.pause_button.text() == "Try again"  # the failure's remedy, never Pause
    assert d.text("problem_title") == "Not enough GPU memory for this model"
    assert d.text("problem_message").endswith("then Retry.") and "--" not in d.text("problem_message")
    assert not d.values.labels["problem_retry_at"].isVisibleTo(d)  # it gave up: only Retry starts it again
    assert banner.action_button.text() == "Retry" and banner.action_button.isVisibleTo(d)
    assert d.text("engine:engine-0.health") == ""  # no restart count beside a failure
    assert not d.values.labels["engine:engine-0.health"].isVisibleTo(d)
    assert not banner.details.isVisibleTo(d)
    assert "Traceback" not in on_screen(d) and "OutOfMemoryError" not in on_screen(d)
    banner.details_toggle.click()
    assert banner.details.isVisibleTo(d)
    assert "Traceback (most recent call last):" in banner.details.toPlainText()
    with qtbot.waitSignal(d.retry_requested, timeout=500):
        banner.action_button.click()


def test_offline_says_when_it_tries_again_and_keeps_the_address_in_details(dashboard, node, bridge, qtbot):
    snapshot = snapshots.offline()
    show(node, qtbot, bridge, snapshot)
    d, banner = dashboard, dashboard.banner
    assert d.text("state") == "Offline"  # it tries again by itself
    assert d.text("connection") == "Connected · downloads can't reach the internet"  # never a plain "Connected"
    assert d.text("problem_title") == "Waiting for the network"
    assert d.text("problem_retry_at") == f"Trying again at {clock_time(snapshot.problem.retry_at)}"
    assert "https://" not in on_screen(d) and "Errno" not in on_screen(d)
    assert banner.action_button.text() == "Retry"
    banner.details_toggle.click()
    assert "Temporary failure in name resolution" in banner.details.toPlainText()


def test_an_action_other_than_retry_gets_its_own_button(dashboard, node, bridge, qtbot):
    show(node, qtbot, bridge, snapshots.failed())
    assert dashboard.banner.action_button.text() == "Open settings"
    assert not dashboard.banner.details_toggle.isVisibleTo(dashboard)  # nothing to fold
    assert not dashboard.values.labels["problem_retry_at"].isVisibleTo(dashboard)
    assert dashboard.text("engine:engine-0.error") == "Stopped after an error: see Details."
    with qtbot.waitSignal(dashboard.settings_requested, timeout=500):
        dashboard.banner.action_button.click()


def test_restarting_after_failures_counts_the_tries(dashboard, node, bridge, qtbot):
    snapshot = snapshots.restarting()
    show(node, qtbot, bridge, snapshot)
    assert dashboard.text("state") == "Starting"
    assert dashboard.text("subtitle") == "Restarting (3 of 5)"
    assert dashboard.text("engine:engine-0.state") == "Restarting (3 of 5)"
    assert dashboard.text("engine:engine-0.phase") == f"Trying again at {clock_time(snapshot.engines[0].retry_at)}"
    card = dashboard._engine_cards["engine-0"]
    card.argv_toggle.click()
    assert "torch.OutOfMemoryError" in card.argv.toPlainText()


def test_update_ready_offers_a_restart(dashboard, node, bridge, qtbot):
    show(node, qtbot, bridge, snapshots.update_ready())
    assert dashboard.update_banner.isVisibleTo(dashboard)
    assert "0.4.0" in dashboard.text("update")
    assert not dashboard.banner.isVisibleTo(dashboard)
    with qtbot.waitSignal(dashboard.update_requested, timeout=500):
        dashboard.update_banner.restart_button.click()
    show(node, qtbot, bridge, snapshots.serving())
    assert not dashboard.update_banner.isVisibleTo(dashboard)


def test_signed_out_offers_sign_in(dashboard, node, bridge, qtbot):
    show(node, qtbot, bridge, snapshots.signed_out())
    assert dashboard.text("connection") == "Signed out"
    assert dashboard.banner.action_button.text() == "Sign in again"
    with qtbot.waitSignal(dashboard.sign_in_requested, timeout=500):
        dashboard.banner.action_button.click()


def test_paused_for_a_game_keeps_the_last_capacity_dimmed(dashboard, node, bridge, qtbot):
    show(node, qtbot, bridge, snapshots.paused_for_game())
    assert dashboard.text("state") == "Paused for a game"
    assert dashboard.text("subtitle") == "Your GPU is all yours"
    assert dashboard.text("tokens_per_s") == "—"
    capacity = dashboard.values.labels["capacity"]
    assert capacity.isVisibleTo(dashboard) and capacity.text() == "Last measured 912 tok/s"
    assert capacity.property("dimmed") is True
    assert dashboard.text("plan") == "Stopped while paused, so your GPU is all yours."
    assert dashboard.pause_button.text() == "Resume"
    show(node, qtbot, bridge, replace(snapshots.paused_for_game(), pause_detail="Cyberpunk2077.exe"))
    assert dashboard.text("state") == "Paused for Cyberpunk2077.exe"


def test_pause_and_resume(dashboard, node, bridge, qtbot):
    show(node, qtbot, bridge, snapshots.paused_for_game())
    dashboard.pause_button.click()
    show(node, qtbot, bridge, snapshots.serving())
    dashboard.pause_button.click()
    show(node, qtbot, bridge, snapshots.idle())
    assert not dashboard.pause_button.isVisibleTo(dashboard)  # nothing to pause while nothing is assigned
    assert node.commands == [("resume", None), ("pause", (None, "user"))]
    assert dashboard.text("plan") == "Waiting for the network to pick a model."
    assert "engine-0" not in dashboard._engine_cards
    assert dashboard.text("tokens_per_s") == "—"
    assert not dashboard.values.labels["capacity"].isVisibleTo(dashboard)


def test_a_cpu_node_has_no_gpu_charts(dashboard, node, bridge, qtbot):
    show(node, qtbot, bridge, snapshots.cpu_serving())
    assert dashboard.text("engine:engine-0.title") == "llama.cpp on the CPU"
    assert dashboard.values.labels["no_gpus"].isVisibleTo(dashboard)
    assert set(dashboard.charts.curves) == {"tokens_per_s", "kv_usage"}
    assert not any(dashboard.charts.plots[k].isVisibleTo(dashboard) for k in ("util_pct", "power_w", "temperature_c"))


def test_figures_that_agree_on_a_cpu_node(dashboard, node, bridge, qtbot):
    """The tiny demo on the CPU: the memory shown is its chats', not the RAM budget the plan allowed
    (most of the machine's); speeds are labelled as all requests vs each; one in-flight figure."""
    cpu = snapshots.cpu_serving()
    engine = replace(cpu.engines[0], memory_mib=24_064, kv_cache_gib=0.19, requests_running=1, requests_waiting=2)
    show(node, qtbot, bridge, replace(cpu, engines=(engine,), in_flight=0,
                                      throughput=replace(cpu.throughput, live_tokens_per_s=71.2,
                                                         per_request_tokens_per_s=3_768.0)))
    d = dashboard
    assert d.text("engine:engine-0.memory") == "0.2 GiB of memory for chats · 37% of its chat memory in use"
    assert "23.5" not in on_screen(d)
    assert d.text("tokens_per_s") == "71.2 tok/s" and d.text("tokens_per_s.detail").startswith(
        "each request gets 3,768 tok/s")
    assert "ALL REQUESTS" in on_screen(d).upper()
    assert d.text("engine:engine-0.requests") == "2 waiting for a turn"
    assert "running" not in on_screen(d)


def test_a_loss_today_reads_red_on_the_stat_card(dashboard, node, bridge, qtbot, scheme):
    losing = replace(snapshots.EARNINGS, today=0.10, energy_cost_today=0.60)
    show(node, qtbot, bridge, replace(snapshots.serving(), earnings=losing))
    label = dashboard.values.labels["earned_today"]
    assert dashboard.text("earned_today") == "−$0.50" and theme.colours().error in label.styleSheet()
    show(node, qtbot, bridge, snapshots.serving())
    assert label.styleSheet() == ""


def test_detecting_says_so(dashboard, node, bridge, qtbot):
    show(node, qtbot, bridge, snapshots.detecting())
    assert dashboard.text("no_gpus") == "Looking for your GPUs…"


def test_a_line_per_gpu_in_clock_time(dashboard, node, bridge, qtbot, qapp):
    show(node, qtbot, bridge, snapshots.serving())
    now = time.time()
    node.history_points["gpu0.power_w"] = [(now - 30, 338.0)]
    node.history_points["gpu1.power_w"] = [(now - 30, 301.0)]
    dashboard.resize(1120, 1600)  # tall enough that the charts are on screen, not scrolled below
    dashboard.show()  # the axes measure their labels when first painted
    qtbot.waitExposed(dashboard)
    settle(qapp)
    dashboard.charts.refresh()
    assert set(dashboard.charts.curves) == {
        "tokens_per_s", "kv_usage",
        *(f"gpu{i}.{k}" for i in (0, 1) for k in ("util_pct", "power_w", "temperature_c")),
    }  # fmt: skip
    x, y = dashboard.charts.curves["gpu1.power_w"].getData()
    assert list(y) == [301.0] and list(x) == [now - 30]  # clock time, not negative "seconds ago"
    axis = dashboard.charts.plots["power_w"].getAxis("bottom")
    spacing, values = next((s, v) for s, v in axis.tickValues(now - 600, now, 400) if len(v))
    ticks = axis.tickStrings(values, 1.0, spacing)
    assert ticks and ticks == [time.strftime("%H:%M", time.localtime(v)) for v in values]
    assert all(dashboard.charts.plots[k].isVisibleTo(dashboard) for k in ("util_pct", "power_w", "temperature_c"))


def test_earnings_chart_in_the_currency_with_an_honest_empty_state(dashboard, node, bridge, qtbot):
    show(node, qtbot, bridge, snapshots.new_user())
    panel = dashboard.earnings
    assert dashboard.values.labels["earn.empty"].isVisibleTo(dashboard)
    assert dashboard.text("earn.empty") == "No earnings yet — they appear after your first served request."
    assert not panel.chart.isVisibleTo(dashboard)
    assert panel.nudge.isVisibleTo(dashboard)
    assert dashboard.text("earn.nudge") == "Set your electricity price to see real net earnings."
    with qtbot.waitSignal(dashboard.settings_requested, timeout=500):
        panel.price_button.click()
    euros = replace(snapshots.serving(), earnings=replace(snapshots.EARNINGS, currency="EUR"))
    show(node, qtbot, bridge, euros)
    assert panel.chart.isVisibleTo(dashboard) and not dashboard.values.labels["earn.empty"].isVisibleTo(dashboard)
    assert len(panel.chart.days) == 30
    heights = list(panel.chart.bars.opts["height"])
    assert heights[-1] == pytest.approx(snapshots.EARNINGS.days[-1].net) and heights[0] == 0
    assert panel.chart.money_axis.tickStrings([0.0, 1.5], 1.0, 0.5) == ["€0.00", "€1.50"]
    assert dashboard.text("earn.chart_title") == "Net per day, last 30 days (EUR)"
    assert dashboard.text("earned_today").startswith("€") and dashboard.text("earn.week.gross") == "€17.40"


def test_command_line_toggle_survives_updates(dashboard, node, bridge, qtbot):
    show(node, qtbot, bridge, snapshots.serving())
    card = dashboard._engine_cards["engine-0"]
    assert not card.argv.isVisibleTo(dashboard)
    card.argv_toggle.click()
    show(node, qtbot, bridge, snapshots.degraded())
    assert dashboard._engine_cards["engine-0"] is card
    assert card.argv.isVisibleTo(dashboard)
    assert "--tensor-parallel-size 2" in card.argv.toPlainText() and "api-key" not in card.argv.toPlainText()
    assert dashboard.text("engine:engine-0.health") == "Restarted 2 times"


def test_charts_poll_only_while_visible(dashboard, node, qtbot):
    now = time.time()
    node.history_points["tokens_per_s"] = [(now - 20, 800.0), (now - 10, 820.0), (now - 7200, 1.0)]
    assert not dashboard.charts.timer.isActive()
    dashboard.show()
    qtbot.waitExposed(dashboard)
    assert dashboard.charts.timer.isActive()
    assert {series for series, _ in node.history_calls} >= {"tokens_per_s", "kv_usage", "gpu0.util_pct"}
    x, y = dashboard.charts.curves["tokens_per_s"].getData()
    assert list(y) == [800.0, 820.0] and list(x) == pytest.approx([now - 20, now - 10], abs=1.0)
    dashboard.close()  # with a tray, closing hides
    assert not dashboard.isVisible()
    assert not dashboard.charts.timer.isActive()


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


def test_a_flat_idle_line_is_redrawn_only_to_slide(dashboard, node, qtbot, monkeypatch):
    """An idle node records 0 tok/s every second: a new point of the same value is no reason to
    repaint; the line moves every `IDLE_REDRAW_S`, and the refresh asks only for the last seconds."""
    clock = [time.time()]
    dashboard.charts._clock = lambda: clock[0]
    node.history_points["tokens_per_s"] = [(clock[0] - 1, 0.0)]
    dashboard.charts.refresh()
    drawn: list[float] = []
    curve = dashboard.charts.curves["tokens_per_s"]
    monkeypatch.setattr(curve, "setData", lambda *a, **k: drawn.append(clock[0]))
    for _ in range(int(charts.IDLE_REDRAW_S) - 1):
        clock[0] += 1
        node.history_points["tokens_per_s"].append((clock[0], 0.0))
        node.history_calls.clear()
        dashboard.charts.refresh()
        assert all(time.time() - since <= charts.RECENT_S + 1 for series, since in node.history_calls)
    assert drawn == []
    clock[0] += 1
    node.history_points["tokens_per_s"].append((clock[0], 0.0))
    dashboard.charts.refresh()
    assert len(drawn) == 1


def test_a_dead_core_is_reported_even_without_a_snapshot(dashboard, bridge, qtbot):
    with qtbot.waitSignal(bridge.core_failed):
        threading.Thread(target=bridge.report_core_failure, args=(RuntimeError("ledger is locked"),)).start()
    assert dashboard.banner.isVisibleTo(dashboard)
    assert dashboard.text("problem_title") == "GPU Provider stopped serving"
    assert "RuntimeError: ledger is locked" in dashboard.text("problem_message")


# look: colours and reflow -------------------------------------------------------------------


def luminance(colour: QColor) -> float:
    def channel(c: float) -> float:
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    return 0.2126 * channel(colour.redF()) + 0.7152 * channel(colour.greenF()) + 0.0722 * channel(colour.blueF())


def contrast(a: QColor, b: QColor) -> float:
    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def rendered_contrast(widget: QWidget) -> float:
    """Contrast between a rendered widget's commonest colour (its background) and the pixel
    furthest from it (its text): what a person actually sees."""
    image = widget.grab().toImage().convertToFormat(QImage.Format.Format_RGB32)
    inner = [image.pixelColor(x, y) for x in range(3, image.width() - 3) for y in range(3, image.height() - 3)]
    background = QColor(Counter(c.rgb() for c in inner).most_common(1)[0][0])
    return max(contrast(background, c) for c in inner)


def test_the_scheme_changes_what_is_drawn(dashboard, node, bridge, qtbot, scheme, qapp):
    assert dashboard.styleSheet() == ""  # every colour comes from the app-wide theme
    show(node, qtbot, bridge, snapshots.serving())
    dashboard.show()
    qtbot.waitExposed(dashboard)
    settle(qapp)
    window = dashboard.content.grab().toImage().pixelColor(4, 4)
    assert (luminance(window) < 0.05) == (scheme == "dark")
    assert (dashboard.palette().window().color().lightness() < 80) == (scheme == "dark")
    buttons = [b for b in dashboard.findChildren(QPushButton) if b.text() in ("Logs", "Settings", "Pause serving")]
    assert len(buttons) == 3
    for button in buttons:
        assert rendered_contrast(button) >= 4.5, button.text()
    chart_bg = dashboard.charts.plots["tokens_per_s"].backgroundBrush().color()
    assert chart_bg.name().upper() == theme.colours().chart_bg.upper()
    assert (luminance(chart_bg) < 0.05) == (scheme == "dark")


@pytest.fixture
def large_font(qapp, scheme):
    """A person who reads at 14 pt: the theme's sizes follow the app font."""
    before = qapp.font()
    font = QFont(before)
    font.setPointSizeF(14)
    qapp.setFont(font)
    theme.install(qapp, scheme)
    yield
    qapp.setFont(before)


@pytest.mark.usefixtures("large_font")
def test_at_14_pt_headline_figures_are_larger_than_body_text(dashboard, node, bridge, qtbot, qapp):
    show(node, qtbot, bridge, snapshots.serving())
    dashboard.show()
    qtbot.waitExposed(dashboard)
    settle(qapp)
    headline = dashboard.values.labels["tokens_per_s"].fontInfo().pointSizeF()
    body = dashboard.values.labels["engine:engine-0.context"].fontInfo().pointSizeF()
    assert body == pytest.approx(14, abs=0.6)
    assert headline > body * 1.5


@pytest.mark.parametrize("width", [1120, 640])
@pytest.mark.usefixtures("large_font")
def test_nothing_is_cut_off_at_14_pt(dashboard, node, bridge, qtbot, qapp, width):
    show(node, qtbot, bridge, snapshots.failed_with_retry())
    dashboard.resize(width, 900)
    dashboard.show()
    qtbot.waitExposed(dashboard)
    settle(qapp)
    viewport = dashboard.centralWidget().viewport()
    assert dashboard.content.width() <= viewport.width()
    assert dashboard.content.minimumSizeHint().width() <= viewport.width()
    for button in (dashboard.pause_button, dashboard.banner.action_button):
        top_left = button.mapTo(dashboard, button.rect().topLeft())
        assert dashboard.rect().contains(top_left) and dashboard.rect().contains(top_left + button.rect().bottomRight())
        assert button.width() >= button.sizeHint().width()


@pytest.mark.usefixtures("large_font")
def test_the_window_fits_a_1366_by_768_screen(bridge, node, qtbot, qapp):
    """A laptop's 1366×768 less a 40 px taskbar: the first size and the smallest both fit (at 150 %
    of a 9.3 pt font), and nothing is wider than the window there."""
    screen = QSize(1366, 768 - 40)
    assert default_size(screen).height() + 40 <= screen.height() and default_size(screen).width() <= 1366
    assert default_size(QSize(1920, 1040)) == QSize(1120, 680)
    dashboard = Dashboard(bridge)
    qtbot.addWidget(dashboard)
    assert dashboard.height() + 40 <= max(screen.height(), dashboard.screen().availableGeometry().height())
    assert dashboard.minimumSize().width() <= 1366 and dashboard.minimumSize().height() + 40 <= screen.height()
    show(node, qtbot, bridge, snapshots.serving())
    dashboard.resize(default_size(screen))
    dashboard.show()
    qtbot.waitExposed(dashboard)
    settle(qapp)
    assert dashboard.content.width() <= dashboard.centralWidget().viewport().width()
    assert dashboard.minimumSizeHint().height() + 40 <= screen.height()


def test_narrow_windows_stack_the_cards_in_one_column(dashboard, node, bridge, qtbot, qapp):
    show(node, qtbot, bridge, snapshots.serving())
    dashboard.resize(1120, 900)
    dashboard.show()
    qtbot.waitExposed(dashboard)
    settle(qapp)
    gpus, engines = dashboard.middle.widgets
    assert gpus.y() == engines.y() and gpus.x() < engines.x()
    dashboard.resize(700, 900)
    settle(qapp)
    assert dashboard.middle.columns == 1 and dashboard.bottom.columns == 1 and dashboard.header.columns == 1
    assert dashboard.stats.columns == 2 and dashboard.charts.grid.columns == 1
    assert gpus.x() == engines.x() and engines.y() > gpus.y() + gpus.height() - 1
    earnings, connection = dashboard.bottom.widgets
    assert connection.y() > earnings.y() and connection.x() == earnings.x()
    dashboard.resize(1120, 900)
    settle(qapp)
    assert dashboard.middle.columns == 2 and gpus.y() == engines.y()



def test_local_mode_shows_the_endpoint_and_its_key_with_a_copy_button(bridge, node, qtbot, qapp):
    coordinator = "ws://127.0.0.1:5555/v1/provider"  # what the connection names once the node is connected
    endpoint = LocalEndpoint("http://127.0.0.1:8090/v1", "gpk-" + "k" * 43, coordinator)
    reads = []

    def read() -> LocalEndpoint:
        reads.append(1)
        return endpoint

    window = Dashboard(bridge, local_endpoint=read)
    qtbot.addWidget(window)
    show(node, qtbot, bridge, replace(snapshots.idle(), connection=ConnectionSnapshot("local", "connecting")))
    assert f"Programs on this computer can use {endpoint.url} with the key {endpoint.key}" in on_screen(window)
    show(node, qtbot, bridge, replace(snapshots.idle(), connection=ConnectionSnapshot(coordinator, "connected")))
    assert f"with the key {endpoint.key}" in on_screen(window) and "Copy key" in on_screen(window)
    qtbot.mouseClick(window.copy_key_button, Qt.MouseButton.LeftButton)
    assert qapp.clipboard().text() == endpoint.key
    read_while_connecting = len(reads)
    show(node, qtbot, bridge, replace(snapshots.serving(), connection=ConnectionSnapshot(coordinator, "connected")))
    assert len(reads) == read_while_connecting  # this run's once connected: kept, not read again
    show(node, qtbot, bridge, snapshots.serving())  # a network's coordinator: no local endpoint
    assert endpoint.key not in on_screen(window) and "Copy key" not in on_screen(window)


def test_no_key_is_shown_before_the_node_wrote_one(bridge, node, qtbot):
    window = Dashboard(bridge, local_endpoint=lambda: None)
    qtbot.addWidget(window)
    show(node, qtbot, bridge, replace(snapshots.idle(), connection=ConnectionSnapshot("local", "connecting")))
    assert "Programs on this computer" not in on_screen(window) and "Copy key" not in on_screen(window)
