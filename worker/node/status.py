"""`gpu-provider status`: the running node's latest snapshot, through its status file.

The node writes `run/status.json` through `StatusFile` whenever more than the clock changed, and
every `STATUS_FILE_S` regardless; `read_status` reads it, checks that the process that wrote it
is still alive, adds local mode's endpoint (its address and key) when the node runs in local
mode, and `status_table` formats it for people. Neither follows a link in the data folder.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import psutil

from worker import __version__
from worker.system.config import Paths, read_local_endpoint, read_private_text, write_private_text
from worker.contract.events import NodeSnapshot
from worker.node.failures import OncePerKind

log = logging.getLogger(__name__)

STATUS_FILE_S = 10.0  # `gpu-provider status` reads at most this stale a clock


class StatusFile:
    """The node's side of the file: when to rewrite it, and the writing. Only while the node owns
    the data folder (`owned`): during an update hand-over the new version does, and the file."""

    def __init__(self, paths: Paths, owned: Callable[[], bool],
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._path = paths.status_file
        self._owned = owned
        self._monotonic = monotonic
        self._written: NodeSnapshot | None = None  # without its clock
        self._written_at = float("-inf")
        self._failures = OncePerKind(log)

    def due(self, snap: NodeSnapshot | None) -> bool:
        """Rewrite when more than the clock changed, else every `STATUS_FILE_S`."""
        if snap is None:
            return False
        visible = snap.without_clock()
        due = visible != self._written or self._monotonic() - self._written_at >= STATUS_FILE_S
        if due:
            self._written, self._written_at = visible, self._monotonic()
        return due

    def write(self, snap: NodeSnapshot | None) -> None:
        """0600, like every file the app writes, and replaced whole (a reader never sees half); a
        link planted at its path is replaced, never written through. A write that fails (a file
        another program keeps open on Windows) is logged once and tried again at the next tick:
        the file is only what `gpu-provider status` shows, never a reason to stop the node."""
        if snap is None or not self._owned():
            return
        data = {"pid": os.getpid(), "version": __version__, "snapshot": asdict(snap)}
        try:
            write_private_text(self._path, json.dumps(data, default=str))
        except OSError as exc:
            self._written, self._written_at = None, float("-inf")  # due again at the next tick
            self._failures.failed(f"writing {self._path}", exc)
            return
        self._failures.worked(f"writing {self._path}")

    def remove(self) -> None:
        """The node stopped: no file says it runs (unless the folder is another version's now)."""
        if self._owned():
            self._path.unlink(missing_ok=True)


def read_status(paths: Paths) -> dict[str, Any] | None:
    """The snapshot as JSON, or None when no node is running for this data folder. In local mode
    `local_endpoint` has the endpoint's `url` and `key`."""
    try:
        data = json.loads(read_private_text(paths.status_file))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    pid = data.get("pid")
    if not isinstance(pid, int) or not psutil.pid_exists(pid):
        return None
    endpoint = read_local_endpoint(paths)
    if endpoint is not None and endpoint.serves(_coordinator_url(data)):
        data["local_endpoint"] = {"url": endpoint.url, "key": endpoint.key}
    return data


def _coordinator_url(data: dict[str, Any]) -> str:
    snapshot = data.get("snapshot")
    connection = snapshot.get("connection") if isinstance(snapshot, dict) else None
    url = connection.get("coordinator_url") if isinstance(connection, dict) else None
    return url if isinstance(url, str) else ""


def _num(value: Any, unit: str = "", digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{unit}"
    return f"{value:,}{unit}"


def _limits_lines(limits: Any) -> list[str]:
    """The lender's limits as they hold now, and the step taken (too hot: fewer requests)."""
    if not isinstance(limits, dict):
        return []
    parts = [f"at most {limits['max_requests']} requests at once"] if limits.get("max_requests") else []
    parts += [f"GPU {index} lends {pct} % of its memory" for index, pct in limits.get("memory_share_pct") or ()
              if pct < 100]
    if limits.get("words"):
        parts.append(str(limits["words"]))
    return [f"  limits      {'; '.join(parts)}"] if parts else []


def _tuning_lines(tuning: Any) -> list[str]:
    """ "Tuning… (trial 4 of 12)" while a search runs; else what it adopted, refused or ended as."""
    if not isinstance(tuning, dict):
        return []
    state = tuning.get("state")
    if state == "running":
        trial, most = tuning.get("trial") or 0, tuning.get("trials_max") or 0
        line = f"Tuning… (trial {max(1, trial)} of {most})" if most else "Tuning…"
        return [f"  tuning      {line}, {_num(tuning.get('elapsed_s'), ' s', 0)} so far"]
    if state == "refused":
        return [f"  tuning      refused: {tuning.get('refused') or 'no reason given'} (serving untuned)"]
    chosen = tuning.get("chosen")
    if isinstance(chosen, dict):
        words = "; ".join(chosen.get("words") or ()) or " ".join(chosen.get("args") or ())
        return [f"  tuning      {words} ({_num(chosen.get('gain_pct'), ' %', 1)} faster, measured here)"]
    ended = {"done": "done: nothing measured reliably faster, so the tier's arguments stay",
             "cancelled": "cancelled before it finished (it carries on later)",
             "failed": "failed: serving with the tier's arguments"}
    return [f"  tuning      {ended[state]}"] if state in ended else []


def _headline_lines(snap: dict[str, Any]) -> list[str]:
    """The node's one state, the very words the tray and the dashboard show (`headline`), and
    the one reason it earns nothing now."""
    head = snap.get("headline")
    if not isinstance(head, dict):  # written by a version before the headline (an update's hand-over)
        return [f"  State       {snap['state']}"]
    lines = [f"  State       {head.get('title')}"]
    if head.get("detail"):
        lines.append(f"              {head['detail']}")
    if head.get("not_earning"):
        lines.append(f"  not earning {head['not_earning']}")
    return lines


def status_table(data: dict[str, Any]) -> str:
    snap = data["snapshot"]
    lines = [
        f"gpu-provider {data.get('version', '?')} (pid {data['pid']})",
        *_headline_lines(snap),
        f"  coordinator {snap['connection']['coordinator_url']} — {snap['connection']['state']}",
        f"  model       {snap.get('model') or '—'}",
        f"  in flight   {snap.get('in_flight', 0)}",
    ]
    if snap.get("problem"):
        lines.append(f"  problem     {snap['problem']['title']}: {snap['problem']['message']}")
    lines += _limits_lines(snap.get("limits"))
    lines += _tuning_lines(snap.get("tuning"))
    if data.get("local_endpoint"):
        local = data["local_endpoint"]
        lines += [f"  local API   {local['url']}   (programs on this computer only)",
                  f"  API key     {local['key']}   (send it as: Authorization: Bearer KEY)"]
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
