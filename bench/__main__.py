"""Run the benchmarks, print one table of figures beside their targets, and save it as JSON.

`python -m bench [--quick] [--only relay,detect,node,gui] [--no-batch] [--profile] [--no-scenarios]`
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from bench import detect_plan, gui_idle, node, relay
from bench.report import RESULTS, Figure, table, write_json

SECTIONS = ("relay", "detect", "node", "gui")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller loads and shorter windows (about a minute)")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--profile", action="store_true",
                        help="run the relay's node side under cProfile (stats in bench/results/relay-*.prof)")
    parser.add_argument("--levels", default="1,32,128,256", help="relay concurrency levels")
    parser.add_argument("--pace", type=float, default=50.0, metavar="TOK_PER_S",
                        help="latency runs: each stream's decode rate (26: the field notes' H200 per request)")
    parser.add_argument("--no-scenarios", action="store_true",
                        help="skip the field loads (the H200's 128 streams, an 8-GPU node's 1,024) in the relay section")
    parser.add_argument("--no-batch", action="store_true",
                        help="the coordinator does not offer `batch`: one frame per message (default: offered, "
                        "as the reference coordinator does)")
    parser.add_argument("--json", type=Path, default=RESULTS, help="where to write the results")
    args = parser.parse_args(argv)
    unknown = set(args.only.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    only = args.only.split(",")
    figures: list[Figure] = []
    details: dict[str, Any] = {"quick": args.quick}
    if "detect" in only:
        found, details["detect"] = detect_plan.measure(args.quick)
        figures += found
    if "node" in only:
        found, details["node"] = asyncio.run(node.measure(args.quick))
        figures += found
    if "gui" in only:
        found, details["gui"] = asyncio.run(gui_idle.measure(args.quick))
        figures += found
    profiles: list[Path] = []
    if "relay" in only:
        profile = RESULTS.parent / "relay.prof" if args.profile else None
        changes = {"levels": tuple(int(c) for c in args.levels.split(",")), "profile": profile, "batch": not args.no_batch,
                   "paced_delay_s": 1.0 / args.pace, **({"scenarios": ()} if args.no_scenarios else {})}
        settings = relay.RelaySettings.quick(**changes) if args.quick else relay.RelaySettings(**changes)
        found, details["relay"] = asyncio.run(relay.measure(settings))
        figures += found
        profiles += [profile] if profile else []
    print(table(figures))
    for profile in profiles:
        print(f"\nrelay node profile, {profile.name} (top by own time):\n" + relay.profile_summary(profile))
    print(f"\nresults written to {write_json(figures, details, args.json)}")
    missed = [f for f in figures if f.passed is False]
    print(f"{len(missed)} of {sum(f.passed is not None for f in figures)} targets missed" if missed
          else "every target met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
