"""vLLM 0.33's own functions, run from its installed source where its modules do not import
on CPU: a file's parsed module, some of its top-level definitions, and those run into a
namespace the caller fills with what they name. The oracles of vLLM's planning
(``vllm_planning``) and of its NixlConnector (``nixl_connector``) are built so."""

from __future__ import annotations
import __future__

import ast
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def vllm_source(relative: str) -> tuple[Path, ast.Module]:
    """The path and parsed module of ``relative`` in the installed vLLM package."""
    path = Path(importlib.import_module("vllm").__file__ or "").parent / relative
    return path, ast.parse(path.read_text())


def definitions(path: Path, tree: ast.Module, names: Sequence[str], what: str) -> list[ast.stmt]:
    """The top-level functions and classes ``names`` of ``tree`` in that order; a file
    without one of them is not the vLLM the oracle was written from (``what``)."""
    found = {
        n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name in names
    }
    missing = set(names) - set(found)
    assert not missing, f"{path} has no {sorted(missing)}: not vLLM 0.33's {what}"
    return [found[name] for name in names]


def run(path: Path, nodes: list[ast.stmt], namespace: dict[str, Any]) -> None:
    """``nodes`` run into ``namespace``, their annotations left unevaluated (they name
    vLLM's runtime and config classes)."""
    flags = __future__.annotations.compiler_flag
    exec(compile(ast.Module(nodes, []), str(path), "exec", flags=flags, dont_inherit=True), namespace)
