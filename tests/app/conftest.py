"""Qt runs offscreen in these tests; the scripted node and snapshots come from this folder."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

from app.bridge import Bridge
from tests.app import snapshots
from tests.app.scripted_node import ScriptedNode


@pytest.fixture
def node() -> ScriptedNode:
    return ScriptedNode(snapshots.idle())


@pytest.fixture
def bridge(qapp, node: ScriptedNode) -> Bridge:
    return Bridge(node)


@pytest.fixture
def memory_keyring(monkeypatch):
    """The in-memory backend, installed for one test; GPU_PROVIDER_TOKEN cleared around it."""
    import keyring

    from tests.support.memory_keyring import MemoryKeyring

    previous = keyring.get_keyring()
    backend = MemoryKeyring()
    keyring.set_keyring(backend)
    monkeypatch.delenv("GPU_PROVIDER_TOKEN", raising=False)
    yield backend
    keyring.set_keyring(previous)
