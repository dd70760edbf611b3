from __future__ import annotations

import pytest
from PySide6.QtGui import QGuiApplication

from app.bridge import Bridge
from app.logs import LogsWindow, matching_lines, read_tail, redact_token
from tests.app import snapshots
from tests.app.scripted_node import ScriptedNode
from worker.system import secrets

TOKEN = "gpt_live_5b1d8e0c7a9f2e64"


@pytest.fixture
def logs(tmp_path, qtbot, memory_keyring):
    secrets.set_token(TOKEN)
    app_log = tmp_path / "gpu-provider.log"
    app_log.write_text(
        "12:00:01 INFO starting\n"
        f"12:00:02 DEBUG connecting with token {TOKEN}\n"
        "12:00:03 INFO engine-0 ready on 127.0.0.1:41231\n"
        "12:00:09 WARNING coordinator offline, retrying in 4 s\n"
    )
    engine_log = tmp_path / "engine-0.log"
    engine_log.write_text("INFO Loading weights took 4.2 seconds\nINFO # GPU blocks: 17782\n")
    node = ScriptedNode(snapshots.serving(), log_files={"app": app_log, "engine engine-0": engine_log})
    window = LogsWindow(Bridge(node), redact_token)
    qtbot.addWidget(window)
    return window


def test_shows_each_log_without_the_token(logs):
    assert [logs.source.itemText(i) for i in range(logs.source.count())] == ["app", "engine engine-0"]
    text = logs.view.toPlainText()
    assert "engine-0 ready on 127.0.0.1:41231" in text and TOKEN not in text
    logs.source.setCurrentText("engine engine-0")
    assert logs.view.toPlainText().endswith("# GPU blocks: 17782")


def test_search_filters_lines(logs):
    logs.search.setText("WARNING")
    assert logs.view.toPlainText() == "12:00:09 WARNING coordinator offline, retrying in 4 s"
    assert logs.count.text() == "1 of 4 lines"
    logs.search.setText("")
    assert logs.count.text() == "4 lines"


def test_diagnostics_carry_facts_but_never_the_token(logs):
    text = logs.copy_diagnostics()
    assert QGuiApplication.clipboard().text() == text
    assert TOKEN not in text
    assert "GPU 0: NVIDIA GeForce RTX 4090, 24.0 GiB" in text
    assert "state ready" in text and "coordinator offline" in text and "# GPU blocks: 17782" in text


def test_read_tail_starts_at_a_whole_line(tmp_path):
    path = tmp_path / "big.log"
    path.write_text("".join(f"line {i}\n" for i in range(1000)))
    tail = read_tail(path, limit=100)
    assert tail.splitlines()[0].startswith("line ") and tail.endswith("line 999\n")
    assert len(tail) <= 100
    assert read_tail(tmp_path / "missing.log").startswith("(could not read")


def test_matching_lines_ignores_case():
    assert matching_lines("Alpha\nbeta\nALPHABET", "alpha") == ["Alpha", "ALPHABET"]


def test_logs_open_at_the_newest_lines_scrolled_to_the_left(tmp_path, qtbot):
    """A long last line (an engine's command line) once left the window scrolled far to the right."""
    log = tmp_path / "engine-1.log"
    log.write_text("".join(f"line {i}\n" for i in range(400)) + "argv " + "--flag value " * 200 + "\n")
    window = LogsWindow(Bridge(ScriptedNode(snapshots.serving(), log_files={"engine": log})), lambda text: text)
    qtbot.addWidget(window)
    window.show()
    qtbot.waitExposed(window)
    bars = window.view.horizontalScrollBar(), window.view.verticalScrollBar()
    qtbot.waitUntil(lambda: bars[0].maximum() > 0 and bars[1].maximum() > 0, timeout=2000)
    window.load("engine")
    assert bars[0].value() == 0 and bars[1].value() >= bars[1].maximum() - 1  # the last line in view
