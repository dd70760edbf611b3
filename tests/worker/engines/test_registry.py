"""The engine registry: the one list of engines. A third engine (`tests.support.toy_engine`),
registered by the test alone, runs plan → supervise → metrics with no core module changed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import toy_engine
from tests.worker.hardware.recorded import replay
from worker.contract import protocol
from worker.contract.events import Problem
from worker.node.cli import InputError, parse_engine_bins
from worker.system.config import Paths, Settings
from worker.engines import get_adapter, llamacpp, published_args, registry, vllm
from worker.engines.base import EngineAdapter, child_environment
from worker.engines.finding import find_engines
from worker.engines.installing import EngineInstall, InstallError, InstallPlace, InstallRequest
from worker.measure.metrics import parse_metrics, scrape
from worker.plan.planner import Plan, Refusal, plan
from worker.provision.engine_install import ensure_engine
from worker.provision.errors import ProvisionError
from worker.provision.models import ensure_model
from worker.engines.releases import version_problem
from worker.plan.sources import BadSource, check_source
from worker.serve.restart_policy import SupervisorTiming
from worker.serve.supervisor import EngineSupervisor

TOY_BLOCK = {"source": "/models/toy", "weights_mib": 1, "base_args": ["--slots", "3"], "tiers": {"1": ["--slots", "5"]}}
GGUF_BLOCK = {"source": "/models/tiny.gguf", "weights_mib": 1}


@pytest.fixture
def toy() -> Iterator[None]:
    registry.register(toy_engine)
    try:
        yield
    finally:
        registry.unregister(toy_engine.NAME)


def assign_frame(**blocks: Any) -> str:
    return json.dumps({"type": "assign", "assignment_id": "a-3", "model": {"name": "toy-model", **blocks}})


def parsed(**blocks: Any) -> protocol.Assign:
    message = protocol.parse_from_coordinator(assign_frame(**blocks), engine_names=registry.names())
    assert isinstance(message, protocol.Assign)
    return message


def test_the_built_in_engines_are_registered_in_preference_order() -> None:
    assert registry.names() == ("vllm", "sglang", "llamacpp")
    assert get_adapter("vllm") is vllm and get_adapter("llamacpp") is llamacpp
    assert [a.NAME for a in registry.for_runtime("native")] == ["vllm", "sglang"]
    assert [a.NAME for a in registry.for_runtime("cpu")] == ["llamacpp", "vllm"]  # vLLM's CPU build: a fallback
    assert (registry.display_name("vllm"), registry.display_name("llamacpp")) == ("vLLM", "llama.cpp")


def test_every_adapter_has_every_constant_the_protocol_names() -> None:
    """The registry reads each adapter's `FALLBACK_RUNTIMES` as it reads its `RUNTIMES`, with no
    default: an adapter without it would be a bug, not a way to say "none"."""
    constants = [name for name in EngineAdapter.__annotations__ if name.isupper()]
    assert "FALLBACK_RUNTIMES" in constants
    for adapter in (vllm, llamacpp, toy_engine):
        assert [name for name in constants if not hasattr(adapter, name)] == [], adapter.NAME
        assert adapter.FALLBACK_RUNTIMES <= adapter.RUNTIMES
    assert (llamacpp.FALLBACK_RUNTIMES, toy_engine.FALLBACK_RUNTIMES, vllm.FALLBACK_RUNTIMES) == (
        frozenset(), frozenset(), frozenset({"cpu"}))


def test_an_unknown_engine_is_refused_by_name_and_shown_as_its_name() -> None:
    with pytest.raises(ValueError, match="unknown engine 'tgi'; known engines: vllm, sglang, llamacpp"):
        get_adapter("tgi")
    assert registry.display_name("tgi") == "tgi"
    assert version_problem("tgi", "1.0") == "engine 'tgi' is not one this app runs (vllm, sglang, llamacpp)"
    with pytest.raises(BadSource, match="not one this app runs"):
        check_source("org/model", None, "tgi")
    with pytest.raises(InputError, match="NAME one of vllm, sglang, llamacpp"):
        parse_engine_bins(["tgi=/bin/tgi"])


def test_a_name_is_registered_once(toy: None) -> None:
    with pytest.raises(ValueError, match="registered already"):
        registry.register(toy_engine)
    assert registry.names() == ("vllm", "sglang", "llamacpp", "toy")


def test_an_unknown_engine_block_in_assign_is_ignored_and_a_registered_one_read(
        toy: None, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="worker.contract.protocol")
    message = parsed(toy=TOY_BLOCK, tgi={"anything": ["goes", 1]}, llamacpp=None)
    block = message.model.for_engine("toy")
    assert block is not None and block.base_args == ["--slots", "3"]
    assert set(message.model.engines) == {"toy"}  # `llamacpp: null` is no block; `tgi` is none of ours
    assert "'tgi'" in caplog.text and "does not run" in caplog.text
    assert json.loads(protocol.encode(message))["model"]["toy"]["source"] == "/models/toy"


def test_without_its_adapter_the_same_block_is_ignored() -> None:
    message = parsed(toy=TOY_BLOCK)
    assert message.model.for_engine("toy") is None and message.model.engines == {}


def test_a_registered_block_is_still_checked(toy: None) -> None:
    with pytest.raises(protocol.BadMessage, match=r"model\.toy\.weights_mib"):
        parsed(toy={"source": "/models/toy"})


def test_hello_cli_and_detection_take_the_engines_from_the_registry(toy: None) -> None:
    assert set(published_args()) == {"vllm", "sglang", "llamacpp", "toy"} and published_args()["toy"] == ["--slots"]
    assert parse_engine_bins(["toy=/opt/toy"]) == {"toy": "/opt/toy"}
    found = find_engines("Linux", {"toy": "/opt/toy", "vllm": "/nonexistent/vllm",
                                   "llamacpp": "/nonexistent/llama-server"}, lambda *_: None)
    assert found["toy"].path == "/opt/toy" and set(found) == {"vllm", "sglang", "llamacpp", "toy"}
    assert registry.display_name("toy") == "Toy engine"


async def test_provisioning_follows_the_adapter_and_refuses_an_engine_it_cannot_install(
        toy: None, tmp_path: Path) -> None:
    folder = tmp_path / "toy-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    paths = Paths.under(tmp_path)
    block = protocol.EngineModel(source=str(folder), weights_mib=1)
    assert await ensure_model(block, "toy", paths, Settings(), lambda _: None) == folder  # a folder engine
    with pytest.raises(BadSource, match="single GGUF file; Toy engine needs a Hugging Face repo id"):
        check_source("https://h.example/m.gguf", "ab" * 32, "toy")
    assert version_problem("toy", "1.0") is None
    assert version_problem("toy", "2.0") == ("Toy engine version 2.0 is not one this app ships with (1.0); "
                                             "update the app, or ask the network for Toy engine 1.0")
    with pytest.raises(ProvisionError) as failure:
        await ensure_engine("toy", None, paths, lambda _: None)
    assert "--engine-bin toy=PATH" in failure.value.problem.message


def test_plan_picks_the_first_engine_of_the_runtime_that_the_model_has_a_block_for(toy: None) -> None:
    machine = replay("no-gpu.json")
    assert machine.runtime == "cpu"
    both = plan(machine, parsed(toy=TOY_BLOCK, llamacpp=GGUF_BLOCK), Settings())
    assert isinstance(both, Plan) and both.engine == "llamacpp"  # registered first: unchanged
    assert [a.NAME for a in registry.for_runtime("cpu")] == ["llamacpp", "toy", "vllm"]
    vllm_only = plan(machine, parsed(vllm={"source": "org/m", "weights_mib": 1}), Settings())
    assert isinstance(vllm_only, Refusal)  # vLLM's CPU build comes last, and this machine has none
    assert vllm_only.reason == vllm.planning.NO_CPU_BUILD
    refused = plan(machine, parsed(toy={**TOY_BLOCK, "base_args": ["--threads", "2"]}), Settings())
    assert isinstance(refused, Refusal) and refused.reason.startswith("argument not allowed: --threads (in base_args)")


async def test_a_third_engine_runs_plan_supervise_metrics_through_its_adapter(toy: None, tmp_path: Path) -> None:
    machine = replay("no-gpu.json")
    result = plan(machine, parsed(toy=TOY_BLOCK), Settings())
    assert isinstance(result, Plan) and result.engine == "toy", result
    (engine_plan,) = result.engines
    assert (engine_plan.layout, engine_plan.tier, engine_plan.args) == ("single", "1", ("--slots", "3", "--slots", "5"))
    assert engine_plan.env["TOY_RUNTIME"] == "cpu" and engine_plan.memory_utilization is None
    assert result.warnings == ("tier 1: the toy engine runs --slots 3 --slots 5 (base: --slots 3)",)
    assert engine_plan.argv()[:3] == list(toy_engine.DEFAULT_EXECUTABLE)

    phases: list[str | None] = []
    supervisor = EngineSupervisor(engine_plan, paths=Paths.under(tmp_path).ensure(),
                                  on_event=lambda snap, _reason: phases.append(snap.phase),
                                  timing=SupervisorTiming(poll_s=0.05, ready_timeout_s=60))
    await supervisor.start()
    try:
        snapshot = await supervisor.wait_for_state("ready", "failed", timeout=60)
        assert snapshot.state == "ready", snapshot.last_error
        assert "loading" in phases  # its log, read through its `parse_line`
        assert snapshot.max_concurrency == 5.0  # `/toy/props` read through its readiness hook: the tier's slots
        assert snapshot.context.declared == 1024  # /v1/models, as for every engine
        target = supervisor.target()
        assert target is not None
        metrics = await scrape(supervisor.http, f"{target.base_url}/metrics", target.api_key, engine_plan.engine)
        page = (await supervisor.http.get(f"{target.base_url}/metrics")).text
    finally:
        await supervisor.stop()
    # The readiness probe's one completion, counted under the toy engine's own series names.
    assert (metrics.engine, metrics.requests_running, metrics.prompt_tokens, metrics.generation_tokens) == (
        "toy", 0, 1, SupervisorTiming().probe_max_tokens)
    assert parse_metrics(page).engine == "toy"  # a page without a name is told by the adapter's prefix


def test_no_child_inherits_a_registered_engines_key_or_private_settings(toy: None) -> None:
    """The names come from each registered adapter (`KEY_VARIABLE`, `PRIVATE_ENV_PREFIXES`): a new
    engine's key is kept from every child without a shared list to edit."""
    inherited = {"HOME": "/h", "GPU_PROVIDER_TOKEN": "t", "VLLM_API_KEY": "v", "LLAMA_API_KEY": "l",
                 "LLAMA_ARG_HOST": "0.0.0.0", "TOY_API_KEY": "k", "TOY_SETTING_PORT": "1", "TOYS": "kept"}
    assert child_environment(inherited) == {"HOME": "/h", "TOYS": "kept"}
    registry.unregister(toy_engine.NAME)
    assert "TOY_API_KEY" in child_environment(inherited)  # not an engine key any more
    registry.register(toy_engine)


async def test_an_engine_with_an_installer_is_installed_through_the_generic_path(
        toy: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter's `install` is handed its own releases, the version asked for and this machine's
    engines folder as the place; what it cannot do reaches the node as a `ProvisionError`."""
    requests: list[InstallRequest] = []

    async def install(request: InstallRequest) -> EngineInstall:
        requests.append(request)
        if request.runtime == "native":
            raise InstallError(Problem("Toy engine cannot install here", "No toys on a GPU."))
        folder = request.place.folder("toy", request.version or "1.0")
        return EngineInstall((str(folder / "toy"),), "1.0", folder)

    monkeypatch.setattr(toy_engine, "install", install, raising=False)
    paths = Paths.under(tmp_path)
    install_ = await ensure_engine("toy", "1.0", paths, lambda _: None, runtime="cpu", use_wsl=False)
    assert install_ == EngineInstall((str(paths.engines_dir / "toy-1.0" / "toy"),), "1.0", paths.engines_dir / "toy-1.0")
    (request,) = requests
    assert request.releases is toy_engine.RELEASES and request.place == InstallPlace(paths.engines_dir)
    with pytest.raises(ProvisionError) as failure:
        await ensure_engine("toy", None, paths, lambda _: None, runtime="native", use_wsl=False)
    assert failure.value.problem.title == "Toy engine cannot install here"
    with pytest.raises(ProvisionError, match="not one this app ships with"):
        await ensure_engine("toy", "2.0", paths, lambda _: None, use_wsl=False)
    assert len(requests) == 2  # a version not shipped never reaches the installer
