"""Test double of `sglang.srt.plugins`: no plugins."""


def load_plugins() -> None:
    pass
