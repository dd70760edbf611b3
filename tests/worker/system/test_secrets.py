from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from typing import ClassVar

import keyring
import keyring.backend
import keyring.backends.chainer
import keyring.backends.fail
import keyring.backends.null
import keyring.errors
import pytest

from tests.support.memory_keyring import MemoryKeyring
from worker.system import secrets


class PlaintextKeyring(MemoryKeyring):
    """Named like keyrings.alt's file backend, which writes passwords in the clear."""


class LockedKeyring(MemoryKeyring):
    def get_password(self, service: str, username: str) -> str | None:
        raise keyring.errors.KeyringLocked("locked")


@pytest.fixture
def memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[MemoryKeyring]:
    monkeypatch.delenv(secrets.ENV_VAR, raising=False)
    previous = keyring.get_keyring()
    backend = MemoryKeyring()
    keyring.set_keyring(backend)
    yield backend
    keyring.set_keyring(previous)


def use(backend: keyring.backend.KeyringBackend) -> None:
    keyring.set_keyring(backend)


def test_token_round_trip_in_the_keyring(memory: MemoryKeyring) -> None:
    assert secrets.get_token() is None
    secrets.set_token("  tok-1  ")
    assert memory.passwords[(secrets.SERVICE, secrets.ACCOUNT)] == "tok-1"
    assert secrets.get_token() == "tok-1"
    secrets.clear_token()
    assert secrets.get_token() is None
    secrets.clear_token()  # clearing twice is fine


def test_environment_overrides_the_keyring(memory: MemoryKeyring, monkeypatch: pytest.MonkeyPatch) -> None:
    secrets.set_token("from-keyring")
    monkeypatch.setenv(secrets.ENV_VAR, "from-env")
    assert secrets.get_token() == "from-env"


def test_empty_token_is_refused(memory: MemoryKeyring) -> None:
    with pytest.raises(ValueError, match="empty"):
        secrets.set_token("   ")


def test_a_locked_keyring_reads_as_no_token(memory: MemoryKeyring) -> None:
    use(LockedKeyring())
    assert secrets.get_token() is None


@pytest.mark.parametrize("backend", [keyring.backends.fail.Keyring(), keyring.backends.null.Keyring(),
                                     PlaintextKeyring()], ids=["fail", "null", "plaintext"])
def test_insecure_backends_are_named_and_never_get_the_token(memory: MemoryKeyring, backend) -> None:
    use(backend)
    assert secrets.keyring_is_secure() is False
    assert "No secure keyring" in secrets.keyring_description()
    with pytest.raises(secrets.InsecureKeyring, match=secrets.ENV_VAR):
        secrets.set_token("tok-2")
    if isinstance(backend, PlaintextKeyring):
        assert backend.passwords == {}


def test_a_memory_keyring_is_secure(memory: MemoryKeyring) -> None:
    assert secrets.keyring_is_secure() is True
    assert "system keyring" in secrets.keyring_description()


def test_a_chain_is_secure_when_one_member_is(memory: MemoryKeyring) -> None:
    class SecureChain(keyring.backends.chainer.ChainerBackend):
        backends: ClassVar = [keyring.backends.null.Keyring(), MemoryKeyring()]

    class InsecureChain(keyring.backends.chainer.ChainerBackend):
        backends: ClassVar = [keyring.backends.null.Keyring(), keyring.backends.fail.Keyring()]

    use(SecureChain())
    assert secrets.keyring_is_secure() is True
    use(InsecureChain())
    assert secrets.keyring_is_secure() is False


def test_log_records_never_show_a_known_token(memory: MemoryKeyring) -> None:
    secrets.set_token("sekrit-token-42")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("test.secrets.redaction")
    logger.addHandler(handler)
    logger.propagate = False
    secrets.install_redaction(logger)
    try:
        logger.warning("header was Bearer %s", "sekrit-token-42")
        try:
            raise RuntimeError("failed with sekrit-token-42")
        except RuntimeError:
            logger.exception("oops")
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert "sekrit-token-42" not in text
    assert "Bearer ***" in text and "failed with ***" in text
