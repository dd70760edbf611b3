"""Test double of `sglang.srt.server_args` (tests/standin/sglang_engine.py)."""

from tests.standin.sglang_engine import ServerArgs, prepare_server_args

__all__ = ["ServerArgs", "prepare_server_args"]
