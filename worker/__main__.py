"""`python -m worker …` is `gpu-provider …`."""

from __future__ import annotations

from worker.cli import main

raise SystemExit(main())
