"""Recorded NVML readings (tests/fixtures/nvml) replayed through `detect`, for the hardware and plan tests."""

from __future__ import annotations

from pathlib import Path

from worker.engines.finding import Finder
from worker.system.config import Settings
from worker.hardware import Machine, detect, load_reading

NVML_FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "nvml"


def no_engine_probe(argv: list[str], timeout_s: float, env: object = None) -> str | None:
    return None


# Engines are looked for where none are, so a recorded machine reads the same wherever tests run.
NO_ENGINES = {"vllm": "/nonexistent/bin/vllm", "llamacpp": "/nonexistent/bin/llama-server"}
NO_ENGINE_FINDER = Finder(NO_ENGINES, no_engine_probe)


def replay(name: str, settings: Settings | None = None) -> Machine:
    """Detect a recorded machine through the same code path as a live one."""
    host, nvml = load_reading(NVML_FIXTURES / name)
    return detect(settings or Settings(), NO_ENGINE_FINDER, host=host, nvml=nvml)
