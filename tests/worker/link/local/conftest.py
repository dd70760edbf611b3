"""A reference coordinator, its OpenAI endpoint, and a node wired to a fake engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.support.fake_engine import FakeEngine
from tests.worker.link.local.nodes import ASSIGN, KEY, TOKEN, MiniNode
from worker.link.local import OpenAIEndpoint, ReferenceCoordinator
from worker.relay.forward import engine_http_client


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    async with FakeEngine(served_name="served-tiny") as fake:
        yield fake


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with engine_http_client() as client:
        yield client


@pytest.fixture
async def coordinator() -> AsyncIterator[ReferenceCoordinator]:
    async with ReferenceCoordinator(token=TOKEN, assign=ASSIGN) as reference:
        yield reference


@pytest.fixture
async def endpoint(coordinator: ReferenceCoordinator) -> AsyncIterator[OpenAIEndpoint]:
    async with OpenAIEndpoint(coordinator, key=KEY) as openai:
        yield openai


@pytest.fixture
async def node(coordinator: ReferenceCoordinator, engine: FakeEngine,
               http: httpx.AsyncClient) -> AsyncIterator[MiniNode]:
    mini = MiniNode(coordinator.url, engine, http)
    task = asyncio.create_task(mini.link.run())
    await coordinator.wait_for_connections(1)
    yield mini
    await mini.link.close()
    await asyncio.wait_for(task, 5)
