"""`python -m app` starts the desktop app (the login item uses this when not frozen)."""

from __future__ import annotations

import sys

from app.main import main

sys.exit(main())
