"""Benchmarks for issue 9: relay throughput and latency, detect + plan, footprint, readiness.

One entry point: `python -m bench` (see bench/README.md). Each section returns `Figure`s, printed
as one table beside their targets and written to `bench/results/latest.json`.
"""
