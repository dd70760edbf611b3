"""The core's shape, read from its source with `ast`: `worker/` never imports the desktop app or
Qt (only `app/launch.py`, outside it, chooses between them); each stage of `worker/` imports only
the stages its row below names, so no import circle closes, not even under `TYPE_CHECKING` or
inside a function; `worker/` has at most a dozen stages; and only `worker/engines/` names an engine.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "worker"
GUI_PACKAGES = frozenset({"app", "PySide6", "shiboken6", "pyqtgraph"})  # the desktop app and the `gui` extra


def _stages(names: str) -> frozenset[str]:
    return frozenset(names.split())


# For each stage of `worker/`, the stages it may import (besides its own modules and `worker`'s
# version). Lower stages never import higher ones:
#   contract, system < hardware < engines < plan < provision < serve < measure < update < link < node,
# with relay (it needs only the wire messages) beside hardware. link/local (the reference
# coordinator and its sizing) is link's: it may read plan, engines and hardware like the rest.
MAY_IMPORT: Mapping[str, frozenset[str]] = {
    "contract": _stages(""),
    "system": _stages(""),
    "hardware": _stages("contract system"),
    "relay": _stages("contract system"),
    "engines": _stages("contract system hardware"),
    "plan": _stages("contract system hardware engines"),
    "provision": _stages("contract system hardware engines plan"),
    "serve": _stages("contract system hardware engines plan provision relay"),
    "measure": _stages("contract system hardware engines plan provision relay serve"),
    "update": _stages("contract system hardware engines plan provision relay serve measure"),
    "link": _stages("contract system hardware engines plan provision relay serve measure update"),
    "node": _stages("contract system hardware engines plan provision relay serve measure update link"),
}
MAX_STAGES = 12
# How an engine is named: as text, and (with `_` for `.` and `-`) in an identifier.
ENGINE_NAMES = ("vllm", "llamacpp", "llama.cpp", "llama-server", "sglang")
ENGINE_IDENTIFIERS = tuple(sorted({n.replace(".", "_").replace("-", "_") for n in ENGINE_NAMES}))


# --- the GUI ---------------------------------------------------------------------------------

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
    offenders = {str(path.relative_to(ROOT)): found
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


# --- stages and their imports ------------------------------------------------------------------

def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def worker_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every module of `worker` that `source` (the text of `module`) imports, at any depth: at the
    top, inside a function, under `TYPE_CHECKING`; relative imports resolved. `from a import b`
    counts as `a.b` (b may be a module; a stage is all that is read of it)."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            stem = ".".join(base + ([node.module] if node.module else []))
            found += [f"{stem}.{alias.name}" for alias in node.names]
    return [name for name in found if name.split(".")[0] == "worker"]


def stage_of(module: str, worker: Path = WORKER) -> str | None:
    """`worker.serve.supervisor` → `serve`; None for `worker` itself (its version)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (worker / parts[1]).is_dir()) else None


def stage_edges(worker: Path = WORKER) -> dict[tuple[str, str], list[str]]:
    """(importing stage, imported stage) → the imports that make the edge, as `file: module`."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(worker.rglob("*.py")):
        module = module_name(path, worker.parent)
        source = path.read_text(encoding="utf-8")
        for target in worker_imports(source, module, is_package=path.name == "__init__.py"):
            here, there = stage_of(module, worker), stage_of(target, worker)
            if here is not None and there is not None and here != there:
                edges.setdefault((here, there), []).append(f"{path.relative_to(worker.parent)}: {target}")
    return edges


def forbidden(edges: Mapping[tuple[str, str], list[str]], may_import: Mapping[str, frozenset[str]]) -> list[str]:
    return [f"{stage} may not import {other}: {where}"
            for (stage, other), imports in sorted(edges.items()) if other not in may_import.get(stage, frozenset())
            for where in imports]


def circle(graph: Mapping[str, frozenset[str]]) -> list[str]:
    """One import circle among the stages (its stages in order, the first again at the end), or []."""
    done: set[str] = set()
    path: list[str] = []

    def visit(stage: str) -> list[str]:
        if stage in path:
            return path[path.index(stage):] + [stage]
        if stage in done:
            return []
        path.append(stage)
        for other in sorted(graph.get(stage, frozenset())):
            if found := visit(other):
                return found
        path.pop()
        done.add(stage)
        return []

    for stage in sorted(graph):
        if found := visit(stage):
            return found
    return []


def stages_on_disk(worker: Path = WORKER) -> list[str]:
    """The entries at `worker/`'s top level besides its own `__init__`/`__main__`: packages and modules."""
    return sorted(p.name if p.is_dir() else p.stem for p in worker.iterdir()
                  if (p.is_dir() and (p / "__init__.py").exists())
                  or (p.suffix == ".py" and p.name not in ("__init__.py", "__main__.py")))


def test_each_stage_imports_only_the_stages_its_row_names() -> None:
    edges = stage_edges()
    assert ("node", "serve") in edges  # the check reads the tree
    assert forbidden(edges, MAY_IMPORT) == []


def test_no_import_circle_between_stages() -> None:
    graph: dict[str, frozenset[str]] = {}
    for stage, other in stage_edges():
        graph[stage] = graph.get(stage, frozenset()) | {other}
    found = circle(graph)
    assert found == [], " -> ".join(found)


def test_the_table_is_a_layering_of_the_stages_on_disk() -> None:
    """A graph that keeps to an acyclic table has no circle; every stage has its row."""
    assert circle(MAY_IMPORT) == []
    assert sorted(MAY_IMPORT) == stages_on_disk()


def test_worker_has_at_most_a_dozen_stages() -> None:
    assert len(stages_on_disk()) <= MAX_STAGES, stages_on_disk()


def _plant(tmp_path: Path, files: Mapping[str, str]) -> Path:
    worker = tmp_path / "worker"
    for name, source in files.items():
        path = worker / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source, encoding="utf-8")
        for folder in path.relative_to(worker).parents:
            (worker / folder / "__init__.py").touch()
    return worker


@pytest.mark.parametrize("source", [
    "from worker.serve.supervisor import EngineSupervisor",
    "import worker.serve.supervisor",
    "from worker import serve",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from worker.serve import supervisor",
    "def later():\n    from worker.serve.supervisor import EngineSupervisor",
    "from ...serve import supervisor",
    "from ..serve.supervisor import EngineSupervisor",
])
def test_the_check_finds_an_import_upward_however_written(tmp_path: Path, source: str) -> None:
    where = "plan/deep/planner.py" if source.startswith("from ...") else "plan/planner.py"
    worker = _plant(tmp_path, {where: source, "serve/supervisor.py": ""})
    table = {"plan": frozenset({"contract"}), "serve": frozenset({"plan"})}
    found = forbidden(stage_edges(worker), table)
    assert len(found) == 1 and found[0].startswith("plan may not import serve: worker/plan/")


@pytest.mark.parametrize("source", ["from worker import __version__", "from worker.plan.other import x",
                                    "from . import other", "import os", "# from worker.serve import supervisor",
                                    '"""from worker.serve import supervisor"""'])
def test_the_check_lets_a_stage_read_itself_and_the_version(tmp_path: Path, source: str) -> None:
    worker = _plant(tmp_path, {"plan/planner.py": source, "plan/other.py": "", "serve/supervisor.py": ""})
    assert stage_edges(worker) == {}


def test_the_circle_check_finds_a_circle_of_three_and_passes_a_chain() -> None:
    assert circle({"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}), "d": frozenset({"a"})}) \
        == ["a", "b", "c", "a"]
    assert circle({"a": frozenset({"b", "c"}), "b": frozenset({"c"}), "c": frozenset()}) == []


def test_the_count_sees_packages_and_modules_but_not_the_entry_points(tmp_path: Path) -> None:
    worker = _plant(tmp_path, {f"stage{i}/m.py": "" for i in range(MAX_STAGES)} | {"loose.py": "", "__main__.py": ""})
    (worker / "__pycache__").mkdir()
    (worker / "data").mkdir()  # no __init__: not a package
    assert len(stages_on_disk(worker)) == MAX_STAGES + 1 and "loose" in stages_on_disk(worker)


# --- engine names --------------------------------------------------------------------------------

def engine_names(source: str) -> list[str]:
    """Where `source` names an engine: its strings (not docstrings; comments are not in the tree)
    and its identifiers (names, attributes, definitions, arguments, imports)."""
    tree = ast.parse(source)
    docstrings = {id(body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and (body := node.body) and isinstance(body[0], ast.Expr)
                  and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if any(name in node.value.lower() for name in ENGINE_NAMES):
                found.append(f"{node.lineno}: {node.value!r}")
            continue
        for identifier in _identifiers(node):
            if any(name in identifier.lower() for name in ENGINE_IDENTIFIERS):
                found.append(f"{getattr(node, 'lineno', '?')}: {identifier}")
    return found


def _identifiers(node: ast.AST) -> Iterator[str]:
    for field in ("id", "attr", "name", "arg", "asname", "module"):
        value = getattr(node, field, None)
        if isinstance(value, str):
            yield value
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        yield from node.names


def test_no_file_outside_the_engines_package_names_an_engine() -> None:
    """Adding an engine is one package and its line in the registry's list (which is in there)."""
    engines = WORKER / "engines"
    files = [p for folder in (WORKER, ROOT / "app") for p in sorted(folder.rglob("*.py"))
             if not p.is_relative_to(engines)]
    assert len(files) > 60
    offenders = {str(p.relative_to(ROOT)): found for p in files if (found := engine_names(p.read_text(encoding="utf-8")))}
    assert offenders == {}


@pytest.mark.parametrize("source", [
    'ENGINE = "vllm"',
    'message = f"start llama-server with {flag}"',
    'hint = "llama.cpp could not load it"',
    "def f():\n    '''why'''\n    return 'SGLang'",
    "def ensure_vllm() -> None: ...",
    "class LlamacppBuild: ...",
    "x = releases.vllm_for(runtime)",
    "from worker.engines.llamacpp import install",
    "import worker.engines.vllm as engine",
    "def f(llama_server_bin: str) -> None: ...",
    "f(sglang_port=1)",
])
def test_the_engine_name_check_finds_a_name_in_code(source: str) -> None:
    assert engine_names(source) != []


@pytest.mark.parametrize("source", [
    '"""The engine (vLLM, llama.cpp) is whatever the registry lists."""',
    "def f():\n    '''Starts llama-server or SGLang.'''\n    # vllm, llamacpp\n    return registry.names()",
    "class C:\n    '''Like vLLM's.'''\n    engine = 'registered'",
    "vlm = 'vl-lm'",
])
def test_the_engine_name_check_reads_code_not_prose(source: str) -> None:
    assert engine_names(source) == []
