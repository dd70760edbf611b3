"""Signing in: show what this machine is, then take the provider token from the network's account page.

The token goes to the system keyring through `worker.system.secrets`. Where no secure keyring exists the
form says so and asks before anything else: the only fallbacks are this session's memory or the
person setting `GPU_PROVIDER_TOKEN` themselves; it is never written to a file. `TokenForm` holds
these rules once, for this dialog and the first-run flow alike.

The dialog may open before the core has detected the machine; it follows the bridge's snapshots,
so "Finding your GPUs…" becomes the GPUs once they are known.
"""

from __future__ import annotations

import html
import os
from collections.abc import Callable
from typing import Literal

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.bridge import Bridge
from app.format import machine_summary
from worker.system import secrets
from worker.contract.events import NodeSnapshot
from worker.system.networks import Network

TOKEN_ENV = secrets.ENV_VAR

NO_KEYRING = (
    "This computer has no secure keyring (such as GNOME Keyring, KWallet, the macOS Keychain or the "
    "Windows Credential Manager), so the token cannot be stored safely. It will not be written to a file.\n\n"
    "You can use it for this session only (you will be asked again next time), or set "
    f"{TOKEN_ENV} in your login environment and restart the app."
)

Outcome = Literal["stored", "session", "cancelled"]


def name_as(widget: QWidget, object_name: str) -> None:
    """Gives `widget` the theme's look for `object_name` now (a stylesheet reads names on polish)."""
    widget.setObjectName(object_name)
    widget.style().unpolish(widget)
    widget.style().polish(widget)


def account_link(network: Network) -> str:
    """Where to find the token, as rich text with a link when the network has an account page."""
    if not network.account_url:
        return "Paste your provider token (from your account page):"
    url = html.escape(network.account_url, quote=True)
    return f'Paste your provider token. You find it on <a href="{url}">your {html.escape(network.name)} account page</a>.'


class TokenForm(QWidget):
    """The token field, the way to the account page, and the keyring's rules."""

    kept = Signal(str)  # Outcome: the token is stored, or kept for this session
    keyring_missing = Signal()  # the person must choose a fallback (session only) or set the variable

    def __init__(self, network: Network, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.outcome: Outcome = "cancelled"
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.link = QLabel(account_link(network))
        self.link.setWordWrap(True)
        self.link.setTextFormat(Qt.TextFormat.RichText)
        self.link.setOpenExternalLinks(True)
        self.link.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        layout.addWidget(self.link)
        self.token = QLineEdit()
        self.token.setEchoMode(QLineEdit.EchoMode.Password)
        self.token.setPlaceholderText("provider token")
        layout.addWidget(self.token)
        self.message = QLabel()
        self.message.setWordWrap(True)
        self.message.hide()
        layout.addWidget(self.message)
        self.session_only = QPushButton("Use for this session only")
        self.session_only.clicked.connect(self.use_for_session)
        self.session_only.hide()
        layout.addWidget(self.session_only, 0, Qt.AlignmentFlag.AlignRight)

    def say(self, text: str, error: bool) -> None:
        self.message.setText(text)
        name_as(self.message, "error" if error else "warning")
        self.message.show()

    def submit(self) -> bool:
        """True once the token is in the keyring; otherwise says why not (and what to do)."""
        token = self.token.text().strip()
        if not token:
            self.say("Paste your provider token first.", error=True)
            return False
        if not secrets.keyring_is_secure():
            self.say(NO_KEYRING, error=False)
            self.session_only.show()
            self.keyring_missing.emit()
            return False
        try:
            secrets.set_token(token)
        except Exception as exc:  # noqa: BLE001 - any keyring backend failure is shown, not raised
            self.say(f"The keyring refused the token ({exc}). Unlock your keyring and try again.", error=True)
            return False
        self.outcome = "stored"
        self.message.hide()
        self.kept.emit(self.outcome)
        return True

    def use_for_session(self) -> None:
        """Keep the token in this process's memory only; `worker.system.secrets` reads it from there."""
        os.environ[TOKEN_ENV] = self.token.text().strip()
        self.outcome = "session"
        self.kept.emit(self.outcome)


class SignInDialog(QDialog):
    def __init__(self, bridge: Bridge, network: Network, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Sign in to GPU Provider")
        self.setMinimumWidth(520)
        layout = QVBoxLayout(self)
        layout.setSpacing(12)
        heading = QLabel(f"Sign in to {network.name}")
        heading.setObjectName("heading")
        heading.setWordWrap(True)
        layout.addWidget(heading)
        layout.addWidget(QLabel("This is what we found:"))
        self.summary = QLabel()
        self.summary.setObjectName("panel")
        self.summary.setWordWrap(True)
        self.summary.setMargin(10)
        layout.addWidget(self.summary)
        self.form = TokenForm(network)
        self.token, self.message, self.session_only = self.form.token, self.form.message, self.form.session_only
        layout.addWidget(self.form)
        layout.addStretch(1)
        self.buttons = QHBoxLayout()
        self.buttons.addStretch(1)
        self.later = self._button("Later", self.reject)
        self.sign_in = self._button("Sign in", self.form.submit, default=True)
        self.sign_in.setObjectName("primary")
        layout.addLayout(self.buttons)
        self.form.keyring_missing.connect(self.sign_in.hide)
        self.form.kept.connect(self.accept)
        self.show_machine(bridge.latest)
        bridge.snapshot_changed.connect(self.show_machine)

    @property
    def outcome(self) -> Outcome:
        return self.form.outcome

    def show_machine(self, snapshot: NodeSnapshot) -> None:
        self.summary.setText(machine_summary(snapshot))

    def _button(self, text: str, slot: Callable[[], object], default: bool = False) -> QPushButton:
        button = QPushButton(text)
        button.setDefault(default)
        button.clicked.connect(slot)
        self.buttons.addWidget(button)
        return button
