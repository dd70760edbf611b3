"""The dashboard of a REAL node, not scripted snapshots: local coordinator, llama-server on the
CPU, the tiny demo model, a few relayed requests; then a screenshot.

    QT_QPA_PLATFORM=offscreen .venv/bin/python -m tests.app.real_node_screenshot [light|dark]

Writes docs/screenshots/real-node-cpu.png (or real-node-cpu-dark.png). Needs the llama-server
that tests/support builds.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication

from app import theme
from app.core_thread import CoreThread
from app.main import DesktopApp
from tests.support.engines import ensure_llama_server, free_port
from tests.support.tiny_gguf import write_tiny_gguf
from worker.system.config import Paths, Settings, read_local_endpoint
from worker.node.node import Node

SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
GRAB_AFTER_S = 50.0


def main() -> None:
    dark = sys.argv[1:] == ["dark"]
    out = SCREENSHOTS / ("real-node-cpu-dark.png" if dark else "real-node-cpu.png")
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    folder = Path(tempfile.mkdtemp(prefix="gpu-provider-shot-"))
    model = write_tiny_gguf(folder / "tiny-demo.gguf")
    paths = Paths.under(folder / "data").ensure()
    port = free_port()
    qapp = QApplication(["gpu-provider"])
    theme.install(qapp, "dark" if dark else "light")
    settings = Settings(setup_complete=True, electricity_price_per_kwh=0.30)
    node = Node(paths, settings, coordinator_url="local", model=str(model), openai_port=port,
                engine_bins={"llamacpp": str(ensure_llama_server().executable)})
    desktop = DesktopApp(qapp, node, paths, settings, tray_available=False, redact=lambda text: text)
    core = CoreThread(node.run, desktop.bridge.report_core_failure)
    core.start()
    desktop.dashboard.resize(1100, 1250)
    desktop.dashboard.show()
    threading.Thread(target=_load, args=(node, port), daemon=True).start()

    def grab() -> None:
        desktop.dashboard.grab().save(str(out))
        print(f"{out}: state {node.snapshot().state}, {node.snapshot().throughput}")
        node.shutdown()
        qapp.quit()

    QTimer.singleShot(int(GRAB_AFTER_S * 1000), grab)
    qapp.exec()
    core.join(60)  # before interpreter exit, which would shut the core's thread pool under it


def _load(node: Node, port: int) -> None:
    """Wait for ready, then streamed chat completions through the local endpoint until the
    picture is taken: long enough for a measured capacity (a full 30-s window) and a live rate."""
    started = time.monotonic()
    while node.snapshot().state != "ready" and time.monotonic() - started < 20:
        time.sleep(0.5)
    body = {"model": "local", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "stream": True}
    while time.monotonic() - started < GRAB_AFTER_S:
        endpoint = read_local_endpoint(node.paths)
        key = endpoint.key if endpoint is not None else ""
        httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30,
                   headers={"Authorization": f"Bearer {key}"})
        time.sleep(0.3)


if __name__ == "__main__":
    main()
