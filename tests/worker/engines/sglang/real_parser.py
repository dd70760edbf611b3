"""SGLang 0.5.23's command-line parser, read from its released wheel without importing SGLang.

SGLang cannot be imported here (its modules import CUDA-only packages at import time), so the
parser is read as source: `sglang/srt/server_args.py` builds it from the fields declared in
`sglang/srt/arg_groups/fields/*.py` (`arg_utils.add_cli_args_from_dataclass`: a `bool` field is a
`store_true` switch, a `Literal` or `choices=` field takes one of its values, any other one value
of its type; `no_cli=True` fields have no flag), plus the `parser.add_argument` calls of
`ServerArgs.add_cli_args` (deprecated and dynamic flags). The wheel is fetched once with
`pip download` into the test cache; without it the test fails, saying why.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERSION = "0.5.23"
CACHE = Path.home() / ".cache" / "gpu-provider-tests" / f"sglang-{VERSION}"
FIELDS = "sglang/srt/arg_groups/fields/"
CHOICES = "sglang/srt/arg_groups/choices.py"
CUDA_GRAPH_CONFIG = "sglang/srt/model_executor/cuda_graph_config.py"
SERVER_ARGS = "sglang/srt/server_args.py"


class SourceMissing(Exception):
    """SGLang's wheel could not be had (no network to PyPI, or pip failed)."""


@dataclass(frozen=True)
class Option:
    """One flag of SGLang's parser: its kind (`switch`, `int`, `float`, `str`), its choices (None:
    any value of the kind), and its help text."""

    spellings: tuple[str, ...]
    kind: str
    choices: tuple[Any, ...] | None
    help: str


def wheel() -> Path:
    """The cached wheel, downloaded with pip (no dependencies) the first time."""
    found = sorted(CACHE.glob(f"sglang-{VERSION}-*.whl"))
    if found:
        return found[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "pip", "download", f"sglang=={VERSION}", "--no-deps",
                           "--only-binary", ":all:", "--dest", str(CACHE), "--quiet"],
                          capture_output=True, text=True, timeout=600, check=False)
    found = sorted(CACHE.glob(f"sglang-{VERSION}-*.whl"))
    if done.returncode != 0 or not found:
        raise SourceMissing(f"pip download sglang=={VERSION} failed (status {done.returncode}): "
                            f"{(done.stderr or done.stdout).strip()[-2000:]}")
    return found[0]


def options() -> dict[str, Option]:
    """Every flag spelling of SGLang 0.5.23's server parser → its option."""
    with zipfile.ZipFile(wheel()) as archive:
        def source(name: str) -> ast.Module:
            return ast.parse(archive.read(name).decode())

        scope = _module_constants(source(CHOICES)) | _module_constants(source(CUDA_GRAPH_CONFIG))
        found: dict[str, Option] = {}
        for name in sorted(n for n in archive.namelist() if n.startswith(FIELDS) and n.endswith(".py")):
            module = source(name)
            for option in _field_options(module, scope | _module_constants(module)):
                found.update(dict.fromkeys(option.spellings, option))
        for option in _manual_options(source(SERVER_ARGS)):
            found.update(dict.fromkeys(option.spellings, option))
    return found


def _module_constants(module: ast.Module) -> dict[str, Any]:
    """Module-level names bound to literals, and `Class.NAME` for class-level ones."""
    scope: dict[str, Any] = {}
    for node in module.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if (value := _literal(node.value, scope)) is not None:
                scope[node.targets[0].id] = value
        elif isinstance(node, ast.ClassDef):
            inner: dict[str, Any] = {}
            for item in node.body:
                if isinstance(item, ast.Assign) and len(item.targets) == 1 and isinstance(item.targets[0], ast.Name):
                    if (value := _literal(item.value, inner)) is not None:
                        inner[item.targets[0].id] = value
            scope.update({f"{node.name}.{key}": value for key, value in inner.items()})
    return scope


def _literal(node: ast.expr, scope: dict[str, Any]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [_literal(item, scope) for item in node.elts]
        return None if any(item is None for item in items) else tuple(items)
    if isinstance(node, ast.Name):
        return scope.get(node.id)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return scope.get(f"{node.value.id}.{node.attr}")
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal(node.left, scope), _literal(node.right, scope)
        return None if left is None or right is None else (*left, *right)
    return None


def _field_options(module: ast.Module, scope: dict[str, Any]) -> list[Option]:
    found = []
    for cls in (node for node in module.body if isinstance(node, ast.ClassDef)):
        for item in cls.body:
            if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                    and isinstance(item.annotation, ast.Subscript) and _name(item.annotation.value) == "A"):
                option = _field_option(item.target.id, item.annotation.slice, scope)
                if option is not None:
                    found.append(option)
    return found


def _field_option(field: str, annotation: ast.expr, scope: dict[str, Any]) -> Option | None:
    """`A[T, "help"]` or `A[T, Arg(...)]` as `add_cli_args_from_dataclass` turns it into a flag."""
    if not isinstance(annotation, ast.Tuple) or len(annotation.elts) < 2:
        return None
    hint, meta = annotation.elts[0], annotation.elts[1]
    keywords: dict[str, ast.expr] = {}
    if isinstance(meta, ast.Call) and _name(meta.func) == "Arg":
        keywords = {k.arg: k.value for k in meta.keywords if k.arg}
    elif not _is_text(meta):
        return None
    if _literal(keywords["no_cli"], scope) if "no_cli" in keywords else False:
        return None
    cli = _literal(keywords["cli_name"], scope) if "cli_name" in keywords else None
    aliases = _literal(keywords["aliases"], scope) if "aliases" in keywords else ()
    spellings = (cli or "--" + field.replace("_", "-"), *(aliases or ()))
    kind, literal_choices = _kind(hint)
    choices = _literal(keywords["choices"], scope) if "choices" in keywords else literal_choices
    if "choices" in keywords and choices is None:
        kind = "unresolved choices"  # computed at run time: no allowlisted value can be checked against it
    return Option(spellings, "custom" if "action" in keywords else kind, choices,
                  _text(keywords.get("help", meta)))


def _kind(hint: ast.expr) -> tuple[str, tuple[Any, ...] | None]:
    """`int`, `Optional[float]`, `bool`, `Literal["a", "b"]`, … → (kind, Literal's values)."""
    if isinstance(hint, ast.Subscript):
        outer = _name(hint.value)
        if outer == "Optional":
            return _kind(hint.slice)
        if outer == "Literal":
            values = _literal(hint.slice, {})
            values = values if isinstance(values, tuple) else (values,)
            return type(values[0]).__name__, values
        if outer in ("List", "list"):
            return "list", None
        return "other", None
    name = _name(hint)
    return (name if name in ("bool", "int", "float", "str") else "other"), None


def _manual_options(module: ast.Module) -> list[Option]:
    """`parser.add_argument("--x", action=…, type=…, choices=…)` calls in `ServerArgs.add_cli_args`."""
    found = []
    for call in ast.walk(module):
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument"
                and call.args and all(isinstance(a, ast.Constant) for a in call.args)):
            keywords = {k.arg: k.value for k in call.keywords if k.arg}
            action = keywords.get("action")
            action_name = _name(action) if action is not None and not isinstance(action, ast.Constant) else (
                action.value if isinstance(action, ast.Constant) else None)
            kind = "switch" if action_name in ("store_true", "DeprecatedStoreTrueAction") else (
                _name(keywords["type"]) if "type" in keywords else "str")
            found.append(Option(tuple(a.value for a in call.args), kind or "other", None,
                                _text(keywords.get("help", ast.Constant("")))))
    return found


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_text(node: ast.expr) -> bool:
    return (isinstance(node, ast.Constant) and isinstance(node.value, str)) or isinstance(node, (ast.JoinedStr,
                                                                                                  ast.BinOp))


def _text(node: ast.expr) -> str:
    """Help text, with f-string parts and concatenations as their source."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return ast.unparse(node)
