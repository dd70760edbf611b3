"""Test double of `sglang.srt.utils` (tests/standin/sglang_engine.py)."""

from tests.standin.sglang_engine import kill_process_tree

__all__ = ["kill_process_tree"]
