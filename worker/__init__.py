"""gpu-provider's headless core. Never imports Qt."""

__version__ = "0.1.0"
