"""`python -m worker …` is the core's command line: `detect`, `plan`, `run --headless`, `status`.
The desktop app opens from `gpu-provider` or `python -m app`; the core never imports it."""

from __future__ import annotations

from worker.node.cli import main

raise SystemExit(main())
