"""The core (`worker/`) runs headless, on servers and in the frozen CLI: it never imports the
desktop app or Qt. Only `app/launch.py`, outside it, chooses between them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parents[1] / "worker"
GUI_PACKAGES = frozenset({"app", "PySide6", "shiboken6", "pyqtgraph"})  # the desktop app and the `gui` extra


def gui_imports(source: str) -> list[str]:
    """Every import of a GUI package in `source`, at any depth (a lazy import inside a function counts)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [name for name in names if name.split(".")[0] in GUI_PACKAGES]
    return found


def test_the_core_never_imports_the_gui() -> None:
    modules = sorted(WORKER.rglob("*.py"))
    assert len(modules) > 30 and WORKER / "node" / "cli.py" in modules
    offenders = {str(path.relative_to(WORKER.parent)): found
                 for path in modules if (found := gui_imports(path.read_text(encoding="utf-8")))}
    assert offenders == {}, "worker/ must not import the desktop app or Qt; let app/launch.py decide"


@pytest.mark.parametrize("source", [
    "import app.main",
    "from app.main import main",
    "from app import launch",
    "def f():\n    from PySide6.QtWidgets import QApplication",
    "import os, pyqtgraph as pg",
])
def test_the_check_finds_gui_imports(source: str) -> None:
    assert gui_imports(source) != []


@pytest.mark.parametrize("source", ["import application", "from .app import x", "from worker import app_state",
                                    "import PySide6_like"])
def test_the_check_reads_module_names_not_prefixes(source: str) -> None:
    assert gui_imports(source) == []
