"""`gpu-provider status`: the running node's latest snapshot, read from its status file.

The node rewrites `run/status.json` every second; this module only reads it, checks that the
process that wrote it is still alive, and formats it for people.
"""

from __future__ import annotations

import json
from typing import Any

import psutil

from worker.config import Paths


def read_status(paths: Paths) -> dict[str, Any] | None:
    """The snapshot as JSON, or None when no node is running for this data folder."""
    try:
        data = json.loads(paths.status_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    pid = data.get("pid")
    if not isinstance(pid, int) or not psutil.pid_exists(pid):
        return None
    return data


def _num(value: Any, unit: str = "", digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{unit}"
    return f"{value:,}{unit}"


def status_table(data: dict[str, Any]) -> str:
    snap = data["snapshot"]
    lines = [
        f"gpu-provider {data.get('version', '?')} (pid {data['pid']})",
        f"  state       {snap['state']}" + (f" ({snap['pause_reason']})" if snap.get("paused") else ""),
        f"  coordinator {snap['connection']['coordinator_url']} — {snap['connection']['state']}",
        f"  model       {snap.get('model') or '—'}",
        f"  in flight   {snap.get('in_flight', 0)}",
    ]
    if snap.get("problem"):
        lines.append(f"  problem     {snap['problem']['title']}: {snap['problem']['message']}")
    t = snap["throughput"]
    lines += [
        "throughput (current run)",
        f"  tokens/s    {_num(t['tokens_per_s'])}   per request {_num(t['per_request_tokens_per_s'])}"
        f"   TTFT p50 {_num(t['ttft_p50_s'], ' s', 3)}",
        f"  requests    {t['requests']}   tokens {t['run_tokens']:,}   run {t['run_seconds']:.0f} s",
    ]
    for e in snap.get("engines", []):
        ctx = e["context"]
        lines += [
            f"engine {e['engine_id']} ({e['engine']}, {e['layout']}, GPUs {e['gpu_indices'] or 'none'}): {e['state']}",
            f"  KV cache    {_num(e['kv_cache_tokens'])} tokens, {_num(e['kv_cache_gib'], ' GiB', 2)},"
            f" max concurrency {_num(e['max_concurrency'], 'x', 2)}",
            f"  context     requested {_num(ctx['requested'])}, declared {_num(ctx['declared'])},"
            f" physical {_num(ctx['physical'])}",
            f"  tier        {e['tier'] or 'base arguments'}   restarts {e['restarts']}"
            + (f"   last error: {e['last_error']}" if e.get("last_error") else ""),
        ]
    for g in snap.get("gpus", []):
        lines.append(
            f"GPU {g['index']} {g['name']}: {_num(g['memory_usable_mib'])} of {_num(g['memory_total_mib'])} MiB usable,"
            f" util {_num(g['util_pct'], ' %', 0)}, {_num(g['power_w'], ' W', 0)}, {_num(g['temperature_c'], ' °C', 0)}"
        )
    e = snap["earnings"]
    lines += [
        f"earnings ({e['currency']})",
        f"  today {e['today']:.4f} − electricity {e['energy_cost_today']:.4f};"
        f" week {e['week']:.4f}; all time {e['all_time']:.4f}",
    ]
    return "\n".join(lines)
