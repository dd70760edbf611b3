"""First run: show what this machine is, then take the provider token.

The token goes to the system keyring through `worker.secrets`. Where no secure keyring exists
the dialog says so and asks before anything else: the only fallbacks are this session's memory
or the person setting `GPU_PROVIDER_TOKEN` themselves; it is never written to a file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Literal

from PySide6.QtWidgets import (
    QDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.format import machine_summary
from worker import secrets
from worker.events import NodeSnapshot

TOKEN_ENV = "GPU_PROVIDER_TOKEN"

NO_KEYRING = (
    "This computer has no secure keyring (such as GNOME Keyring, KWallet, the macOS Keychain or the "
    "Windows Credential Manager), so the token cannot be stored safely. It will not be written to a file.\n\n"
    "You can use it for this session only (you will be asked again next time), or set "
    f"{TOKEN_ENV} in your login environment and restart the app."
)

Outcome = Literal["stored", "session", "cancelled"]


class SignInDialog(QDialog):
    def __init__(self, snapshot: NodeSnapshot, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Welcome to GPU Provider")
        self.setMinimumWidth(520)
        self.outcome: Outcome = "cancelled"
        layout = QVBoxLayout(self)
        layout.setSpacing(12)
        heading = QLabel("Lend this computer's GPU to the network")
        heading.setStyleSheet("font-size: 17px; font-weight: 700;")
        layout.addWidget(heading)
        layout.addWidget(QLabel("This is what we found:"))
        self.summary = QLabel(machine_summary(snapshot))
        self.summary.setStyleSheet("background: #F4F6F9; border-radius: 6px; padding: 10px;")
        layout.addWidget(self.summary)
        layout.addWidget(QLabel("Paste your provider token (from your account page):"))
        self.token = QLineEdit()
        self.token.setEchoMode(QLineEdit.EchoMode.Password)
        self.token.setPlaceholderText("provider token")
        layout.addWidget(self.token)
        self.message = QLabel()
        self.message.setWordWrap(True)
        self.message.hide()
        layout.addWidget(self.message)
        self.buttons = QHBoxLayout()
        self.buttons.addStretch(1)
        self.later = self._button("Later", self.reject)
        self.session_only = self._button("Use for this session only", self.use_for_session)
        self.session_only.hide()
        self.sign_in = self._button("Sign in", self.submit, default=True)
        layout.addLayout(self.buttons)

    def _button(self, text: str, slot: Callable[[], object], default: bool = False) -> QPushButton:
        button = QPushButton(text)
        button.setDefault(default)
        button.clicked.connect(slot)
        self.buttons.addWidget(button)
        return button

    def _say(self, text: str, error: bool) -> None:
        self.message.setText(text)
        self.message.setStyleSheet("color: #B91C1C;" if error else "color: #92400E;")
        self.message.show()

    def submit(self) -> None:
        token = self.token.text().strip()
        if not token:
            self._say("Paste your provider token first.", error=True)
            return
        if not secrets.keyring_is_secure():
            self._say(NO_KEYRING, error=False)
            self.session_only.show()
            self.sign_in.hide()
            return
        try:
            secrets.set_token(token)
        except Exception as exc:  # noqa: BLE001 - any keyring backend failure is shown, not raised
            self._say(f"The keyring refused the token ({exc}). Unlock your keyring and try again.", error=True)
            return
        self.outcome = "stored"
        self.accept()

    def use_for_session(self) -> None:
        """Keep the token in this process's memory only; `worker.secrets` reads it from there."""
        os.environ[TOKEN_ENV] = self.token.text().strip()
        self.outcome = "session"
        self.accept()
