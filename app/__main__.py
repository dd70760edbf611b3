"""`python -m app …` is `gpu-provider …`: the desktop app with no command (the login item uses
this when not frozen), the core's commands otherwise."""

from __future__ import annotations

import sys

from app.launch import main

sys.exit(main())
