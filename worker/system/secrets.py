"""The provider token: in the OS keyring, never in a plain file or a log line.

`GPU_PROVIDER_TOKEN` in the environment overrides the keyring (headless servers, tests); the
supervisor keeps it out of engine children. A keyring backend that would not protect the token
(keyring's fail and null backends, keyrings.alt's plaintext files) is named as such, and the
token is never stored in one. `RedactTokens`, a logging filter, scrubs every token this module
has seen from log records, in case one slips into a message anyway.
"""

from __future__ import annotations

import logging
import os

import keyring
import keyring.backend
import keyring.errors

log = logging.getLogger(__name__)

SERVICE = "gpu-provider"
ACCOUNT = "provider-token"
ENV_VAR = "GPU_PROVIDER_TOKEN"
REDACTED = "***"

_INSECURE_MODULES = ("keyring.backends.fail", "keyring.backends.null", "keyrings.alt.file")
_INSECURE_NAMES = ("Plaintext", "Unencrypted", "Null", "Fail")
_seen: set[str] = set()


class InsecureKeyring(RuntimeError):
    """There is no keyring that would keep the token safe; the message says what to do."""


def get_token() -> str | None:
    """The token from `GPU_PROVIDER_TOKEN`, else from the keyring; None when there is none."""
    token = os.environ.get(ENV_VAR, "").strip()
    if not token:
        try:
            token = keyring.get_password(SERVICE, ACCOUNT) or ""
        except keyring.errors.KeyringError as exc:
            log.warning("could not read the keyring (%s): %s", type(exc).__name__, _describe_error(exc))
            return None
    if not token:
        return None
    _seen.add(token)
    return token


def set_token(token: str) -> None:
    """Stores the token in the keyring; refuses a keyring that would write it in the clear."""
    token = token.strip()
    if not token:
        raise ValueError("the token is empty")
    _seen.add(token)
    if not keyring_is_secure():
        raise InsecureKeyring(keyring_description() + f" Set {ENV_VAR} in the environment instead.")
    keyring.set_password(SERVICE, ACCOUNT, token)


def clear_token() -> None:
    """Signs out: removes the stored token (the environment variable, if set, still wins)."""
    try:
        keyring.delete_password(SERVICE, ACCOUNT)
    except keyring.errors.PasswordDeleteError:
        pass
    except keyring.errors.KeyringError as exc:
        log.warning("could not clear the keyring (%s)", type(exc).__name__)


def keyring_is_secure() -> bool:
    return not _insecure(keyring.get_keyring())


def keyring_description() -> str:
    """One plain sentence about where the token would be kept."""
    backend = keyring.get_keyring()
    name = f"{type(backend).__module__}.{type(backend).__name__}"
    if _insecure(backend):
        return (f"No secure keyring is available (the keyring backend is {name}), so the token cannot be "
                "stored safely on this computer.")
    return f"The token is kept in the system keyring ({name})."


def _insecure(backend: keyring.backend.KeyringBackend) -> bool:
    chained = getattr(backend, "backends", None)
    if isinstance(chained, (list, tuple)):
        return not chained or all(_insecure(b) for b in chained)
    kind = type(backend)
    return kind.__module__ in _INSECURE_MODULES or any(word in kind.__name__ for word in _INSECURE_NAMES)


def _describe_error(exc: Exception) -> str:
    return redact(str(exc)) or "no details"


def redact(text: str) -> str:
    for token in _seen:
        if token in text:
            text = text.replace(token, REDACTED)
    return text


class RedactTokens(logging.Filter):
    """Replaces every known token in a record's message and traceback with ***."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _seen:
            return True
        message = record.getMessage()
        scrubbed = redact(message)
        if scrubbed != message:
            record.msg, record.args = scrubbed, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


def install_redaction(logger: logging.Logger | None = None) -> RedactTokens:
    """Adds the filter to every handler of `logger` (default: the root logger)."""
    target = logger or logging.getLogger()
    redactor = RedactTokens()
    for handler in target.handlers:
        handler.addFilter(redactor)
    return redactor
