"""Test double of `sglang.launch_server` (tests/standin/sglang_engine.py)."""

import sys

from tests.standin.sglang_engine import main, run_server

__all__ = ["run_server"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
