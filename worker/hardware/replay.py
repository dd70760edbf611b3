"""Record every reading detection uses to JSON, and serve it back through the same code path.

A reading file is `{"host": HostFacts, "nvml": {"init_error": str | null, "calls": {KEY: VALUE}}}`
where KEY is the query name and its GPU indices (`"memory:0"`, `"p2p:0:1"`) and VALUE is the
answer, or `{"error": "…"}` for a query that failed. A query that was never recorded fails as
"Not Supported", which is what NVML says for a reading a card does not offer.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from worker.hardware.host import HostFacts
from worker.hardware.nvml import NOT_SUPPORTED, NvmlError, NvmlSource


def call_key(name: str, indices: tuple[int, ...]) -> str:
    return ":".join([name, *(str(i) for i in indices)])


class RecordingSource:
    """Wraps a live source and keeps every answer (and every error) it gave."""

    def __init__(self, inner: NvmlSource) -> None:
        self._inner = inner
        self.init_error: str | None = None
        self.calls: dict[str, Any] = {}

    def init(self) -> None:
        try:
            self._inner.init()
        except NvmlError as exc:
            self.init_error = str(exc)
            raise

    def shutdown(self) -> None:
        self._inner.shutdown()

    def query(self, name: str, *indices: int) -> Any:
        key = call_key(name, indices)
        try:
            value = self._inner.query(name, *indices)
        except NvmlError as exc:
            self.calls[key] = {"error": str(exc)}
            raise
        self.calls[key] = value
        return value

    def to_json(self) -> dict[str, Any]:
        return {"init_error": self.init_error, "calls": self.calls}


class ReplaySource:
    """Serves a recorded reading back, errors included."""

    def __init__(self, calls: dict[str, Any], init_error: str | None = None) -> None:
        self._calls = calls
        self._init_error = init_error

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReplaySource:
        return cls(dict(data.get("calls") or {}), data.get("init_error"))

    def init(self) -> None:
        if self._init_error:
            raise NvmlError(self._init_error)

    def shutdown(self) -> None:
        return None

    def query(self, name: str, *indices: int) -> Any:
        key = call_key(name, indices)
        if key not in self._calls:
            raise NvmlError(NOT_SUPPORTED)
        value = self._calls[key]
        if isinstance(value, dict) and set(value) == {"error"}:
            raise NvmlError(str(value["error"]))
        return value


def reading_to_json(host: HostFacts, nvml: RecordingSource) -> dict[str, Any]:
    return {"host": asdict(host), "nvml": nvml.to_json()}


def load_reading(path: str | Path) -> tuple[HostFacts, ReplaySource]:
    """A recorded reading file, ready for `detect(settings, host=…, nvml=…)`."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return HostFacts.from_json(data["host"]), ReplaySource.from_json(data.get("nvml") or {})
