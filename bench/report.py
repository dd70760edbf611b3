"""Figures, their targets, the printed table and the JSON record with the machine it came from."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "latest.json"
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_percent(cpu_s: float, window_s: float) -> float:
    """CPU seconds over a window as % of one core, counted in the kernel's clock ticks (the unit
    CPU time is kept in on Linux): two readings' difference is a whole number of ticks, and
    float error must not turn 12 ticks in 60 s into a hair over 0.2 %."""
    ticks = round(cpu_s * CLOCK_TICKS_PER_S)
    return 100.0 * ticks / (CLOCK_TICKS_PER_S * window_s)


@dataclass(frozen=True)
class Figure:
    """One measured figure. `passed` is None where no target applies or nothing was measured."""

    section: str
    name: str
    value: float | None
    unit: str
    target: str = ""
    passed: bool | None = None
    note: str = ""

    def shown(self) -> str:
        if self.value is None:
            return "not measured"
        if abs(self.value) >= 100 or self.value == int(self.value):
            return f"{self.value:,.0f} {self.unit}".strip()
        return f"{self.value:,.3g} {self.unit}".strip()


def at_least(section: str, name: str, value: float, unit: str, target: float, note: str = "") -> Figure:
    return Figure(section, name, value, unit, f"≥ {target:,g} {unit}".strip(), value >= target, note)


def at_most(section: str, name: str, value: float, unit: str, target: float, note: str = "") -> Figure:
    return Figure(section, name, value, unit, f"≤ {target:,g} {unit}".strip(), value <= target, note)


def info(section: str, name: str, value: float, unit: str, note: str = "") -> Figure:
    return Figure(section, name, value, unit, note=note)


def not_measured(section: str, name: str, why: str, target: str = "") -> Figure:
    return Figure(section, name, None, "", target, None, f"not measured: {why}")


def table(figures: list[Figure]) -> str:
    rows = [("section", "figure", "measured", "target", "result", "note")]
    for f in figures:
        verdict = "" if f.passed is None else ("pass" if f.passed else "MISS")
        rows.append((f.section, f.name, f.shown(), f.target, verdict, f.note))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = []
    for number, row in enumerate(rows):
        cells = [cell.ljust(width) for cell, width in zip(row[:5], widths)] + [row[5]]
        lines.append("  ".join(cells).rstrip())
        if number == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def machine_description() -> dict[str, Any]:
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_json(figures: list[Figure], details: dict[str, Any], path: Path = RESULTS) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"machine": machine_description(), "figures": [asdict(f) for f in figures], "details": details}
    path.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path
