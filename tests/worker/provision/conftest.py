"""Fixtures for provisioning tests: a real HTTPS server on 127.0.0.1 and a client that trusts it."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import trustme

from tests.support.https_server import HttpsServer
from worker.contract.events import DownloadProgress


CA = trustme.CA()  # one for the session: making one per test costs more than the test


def trusting_ca() -> ssl.SSLContext:
    """A client context that trusts `CA` (every `server` here): for `ModelOptions.verify`."""
    context = ssl.create_default_context()
    CA.configure_trust(context)
    return context


@pytest.fixture(scope="session")
def ca() -> trustme.CA:
    return CA


@pytest.fixture
def server(tmp_path: Path, ca: trustme.CA) -> Iterator[HttpsServer]:
    root = tmp_path / "served"
    root.mkdir()
    with HttpsServer(root, ca=ca) as running:
        yield running


@pytest.fixture
async def client(server: HttpsServer) -> AsyncIterator[httpx.AsyncClient]:
    async with server.client() as http:
        yield http


@pytest.fixture
def progress() -> list[DownloadProgress]:
    return []


async def no_sleep(_: float) -> None:
    """Retry delays in tests take no time."""
