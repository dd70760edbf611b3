from __future__ import annotations

import os

import keyring
from keyring.backends import fail

from app.signin import SignInDialog
from tests.app import snapshots
from worker import secrets

TOKEN = "gpt_live_3f9c2a7b1e5d4c8a"


def dialog(qtbot) -> SignInDialog:
    window = SignInDialog(snapshots.idle())
    qtbot.addWidget(window)
    window.show()
    return window


def test_welcome_shows_what_was_detected(qtbot, memory_keyring):
    window = dialog(qtbot)
    assert window.summary.text() == (
        "GPU 0: NVIDIA GeForce RTX 4090, 24.0 GiB\nGPU 1: NVIDIA GeForce RTX 3090, 24.0 GiB\n"
        "Runtime native · 45.2 GiB usable for serving"
    )


def test_token_goes_to_the_keyring(qtbot, memory_keyring):
    window = dialog(qtbot)
    window.token.setText(f"  {TOKEN}\n")
    window.sign_in.click()
    assert window.outcome == "stored"
    assert list(memory_keyring.passwords.values()) == [TOKEN]
    assert secrets.get_token() == TOKEN


def test_empty_token_is_refused_with_a_message(qtbot, memory_keyring):
    window = dialog(qtbot)
    window.sign_in.click()
    assert window.message.text() == "Paste your provider token first."
    assert window.isVisible() and memory_keyring.passwords == {}


def test_without_a_secure_keyring_it_asks_before_any_fallback(qtbot, memory_keyring, tmp_path, monkeypatch):
    keyring.set_keyring(fail.Keyring())
    monkeypatch.setenv("GPU_PROVIDER_TOKEN", "")
    window = dialog(qtbot)
    window.token.setText(TOKEN)
    window.sign_in.click()
    assert "no secure keyring" in window.message.text()
    assert window.isVisible() and window.outcome == "cancelled"
    assert os.environ["GPU_PROVIDER_TOKEN"] == ""  # nothing kept until the person chooses
    assert window.session_only.isVisibleTo(window) and not window.sign_in.isVisibleTo(window)
    window.session_only.click()
    assert window.outcome == "session"
    assert os.environ["GPU_PROVIDER_TOKEN"] == TOKEN
    assert secrets.get_token() == TOKEN
