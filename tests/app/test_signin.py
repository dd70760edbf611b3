from __future__ import annotations

import os
from dataclasses import replace

import keyring
import pytest
from keyring.backends import fail
from PySide6.QtWidgets import QWidget

from app import theme
from app.bridge import Bridge
from app.format import CPU_ONLY, FINDING_GPUS
from app.signin import SignInDialog
from tests.app import snapshots
from tests.app.conftest import REAL, TOKEN
from tests.app.scripted_node import ScriptedNode
from worker.system import secrets




def dialog(qtbot, bridge: Bridge) -> SignInDialog:
    window = SignInDialog(bridge, REAL)
    qtbot.addWidget(window)
    window.show()
    return window


def test_welcome_shows_what_was_detected_in_plain_words(qtbot, scheme, bridge, memory_keyring):
    window = dialog(qtbot, bridge)
    assert window.summary.text() == (
        "GPU 0: NVIDIA GeForce RTX 4090, 24.0 GiB\nGPU 1: NVIDIA GeForce RTX 4090, 24.0 GiB\n"
        "40.2 GiB of graphics memory usable for serving"
    )
    assert window.grab().toImage().pixelColor(3, 3).name() == theme.colours().window.lower()


def test_the_summary_follows_detection(qtbot, scheme, memory_keyring):
    """Built before detection ended, it said "No GPU detected" on a two-4090 machine."""
    node = ScriptedNode(snapshots.detecting())
    bridge = Bridge(node)  # kept: the dialog listens to it
    window = dialog(qtbot, bridge)
    assert window.summary.text() == FINDING_GPUS
    node.emit(snapshots.idle())
    assert window.summary.text().startswith("GPU 0: NVIDIA GeForce RTX 4090")


def test_the_summary_wraps_instead_of_being_cut_off(qtbot, memory_keyring):
    long_name = "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition (engineering sample, water cooled)"
    gpu = replace(snapshots.GPUS[0], name=long_name)
    bridge = Bridge(ScriptedNode(replace(snapshots.idle(), gpus=(gpu, gpu, gpu))))
    window = dialog(qtbot, bridge)
    window.resize(window.minimumWidth(), window.height())
    qtbot.waitUntil(lambda: window.width() == window.minimumWidth(), timeout=2000)
    summary = window.summary
    assert summary.wordWrap() and summary.width() <= window.width()
    assert summary.heightForWidth(summary.width()) > summary.fontMetrics().height() * 4  # more than 4 lines
    assert summary.height() >= summary.heightForWidth(summary.width())  # all of it shown


def test_the_account_page_is_a_link(qtbot, bridge, memory_keyring):
    window = dialog(qtbot, bridge)
    link = window.form.link
    assert '<a href="https://example.net/account/tokens">your Test Network account page</a>' in link.text()
    assert link.openExternalLinks()


def test_no_colours_are_hard_coded(qtbot, bridge, memory_keyring):
    window = dialog(qtbot, bridge)
    window.sign_in.click()  # shows the error line too
    assert [w for w in [window, *window.findChildren(QWidget)] if w.styleSheet()] == []
    assert window.message.objectName() == "error"


def test_token_goes_to_the_keyring(qtbot, scheme, bridge, memory_keyring):
    window = dialog(qtbot, bridge)
    window.token.setText(f"  {TOKEN}\n")
    window.sign_in.click()
    assert window.outcome == "stored" and window.result() == SignInDialog.DialogCode.Accepted
    assert list(memory_keyring.passwords.values()) == [TOKEN]
    assert secrets.get_token() == TOKEN


def test_empty_token_is_refused_with_a_message(qtbot, bridge, memory_keyring):
    window = dialog(qtbot, bridge)
    window.sign_in.click()
    assert window.message.text() == "Paste your provider token first."
    assert window.isVisible() and memory_keyring.passwords == {}


def test_without_a_secure_keyring_it_asks_before_any_fallback(qtbot, scheme, bridge, memory_keyring, monkeypatch):
    keyring.set_keyring(fail.Keyring())
    monkeypatch.setenv("GPU_PROVIDER_TOKEN", "")
    window = dialog(qtbot, bridge)
    window.token.setText(TOKEN)
    window.sign_in.click()
    assert "no secure keyring" in window.message.text() and window.message.objectName() == "warning"
    assert window.isVisible() and window.outcome == "cancelled"
    assert os.environ["GPU_PROVIDER_TOKEN"] == ""  # nothing kept until the person chooses
    assert window.session_only.isVisibleTo(window) and not window.sign_in.isVisibleTo(window)
    window.session_only.click()
    assert window.outcome == "session" and window.result() == SignInDialog.DialogCode.Accepted
    assert os.environ["GPU_PROVIDER_TOKEN"] == TOKEN
    assert secrets.get_token() == TOKEN
