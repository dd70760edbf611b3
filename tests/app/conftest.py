"""Qt runs offscreen in these tests; the scripted node and snapshots come from this folder."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

from app import theme
from app.bridge import Bridge
from tests.app import snapshots
from tests.app.scripted_node import ScriptedNode
from worker.system.autostart import XdgAutostart
from worker.system.config import Paths
from worker.system.networks import Network

TOKEN = "gpt_live_3f9c2a7b1e5d4c8a"
REAL = Network("Test Network", "wss://coordinator.example.net/v1/node", "https://example.net/account/tokens", "EUR")


@pytest.fixture
def node(paths: Paths) -> ScriptedNode:
    return ScriptedNode(snapshots.idle(), paths=paths)


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


@pytest.fixture(params=["light", "dark"])
def scheme(request, qapp):
    """A test that asks for it runs in both schemes; the app-wide style is dropped afterwards."""
    theme.install(qapp, request.param)
    yield request.param
    qapp.setStyleSheet("")
    qapp.setPalette(qapp.style().standardPalette())


@pytest.fixture
def paths(tmp_path) -> Paths:
    return Paths.under(tmp_path / "data").ensure()


@pytest.fixture
def login_item(tmp_path) -> XdgAutostart:
    return XdgAutostart(["gpu-provider", "--minimized"], config_home=tmp_path / "xdg")
