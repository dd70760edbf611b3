"""Test double: the stand-in's `sglang` package (tests/standin/sglang_engine.py). Not SGLang."""

__version__ = "0.5.23"
