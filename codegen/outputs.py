"""The declared set of generated files, and rendering them from a catalog.

Each output is a template (or the grammar copy) and a repository-relative path; the
set is declared once here and rendered deterministically (no timestamps, no absolute
paths, no unordered iteration).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2

from codegen.catalog import Catalog
from codegen.cpp_model import COORDS, cpp_formats, role_field, size_fields
from codegen.python_model import python_formats, token_literal
from codegen.writer import stamp
from kvlayout.layout.ast import FACTS, fact_doc
from kvlayout.layout.vocabulary import Role

__all__ = ["GENERATED_PACKAGE", "OUTPUTS", "render_outputs"]

GENERATED_PACKAGE = "src/kvlayout/_generated"
OUTPUTS: tuple[tuple[str, str], ...] = (
    ("__init__.py.j2", f"{GENERATED_PACKAGE}/__init__.py"),
    ("vocabulary.py.j2", f"{GENERATED_PACKAGE}/vocabulary.py"),
    ("engines.py.j2", f"{GENERATED_PACKAGE}/engines.py"),
    ("formats.py.j2", f"{GENERATED_PACKAGE}/formats.py"),
    ("specs.py.j2", f"{GENERATED_PACKAGE}/specs.py"),
    ("predicates.py.j2", f"{GENERATED_PACKAGE}/predicates.py"),
    ("descriptors.py.j2", f"{GENERATED_PACKAGE}/descriptors.py"),
    ("engine_kv_format.h.j2", "csrc/include/kvlayout/engine_kv_format.h"),
    ("indexing.cuh.j2", "csrc/include/kvlayout/indexing.cuh"),
    ("formats.md.j2", "docs/formats.md"),
)
GRAMMAR_COPY = f"{GENERATED_PACKAGE}/kvlayout.lark"


def _pyrepr(value: object) -> str:
    """A Python literal with double-quoted strings (the project's style)."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return repr(value)


def _pytuple(values: tuple[str, ...] | list[str]) -> str:
    items = [_pyrepr(v) for v in values]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["pyrepr"] = _pyrepr
    env.filters["pytuple"] = _pytuple
    return env


def _fact_docs() -> list[tuple[str, str]]:
    return [(name, fact_doc(name)) for name in FACTS]


def _predicates(catalog: Catalog) -> list[tuple[str, str, list[str]]]:
    """Each fact with its meaning and the formats (by name) for which it holds."""
    return [
        (name, fact_doc(name), [e.name for e in catalog.formats if getattr(e.layout, name)]) for name in FACTS
    ]


def render_outputs(catalog: Catalog, grammar_text: str, sources: str) -> dict[str, str]:
    """Every generated file's content, keyed by repository-relative path."""
    py = python_formats(catalog)
    spec_table = ["None"] * (max(e.value for e in catalog.formats) + 1)
    for f in py:
        spec_table[f.entry.value] = f.class_name
    context: dict[str, Any] = {
        "tokens": [
            {
                "name": t.name,
                "source": token_literal(t),
                "shape_label": t.shape_label,
                "meaning": t.meaning,
                "fuses": t.fuses,
                "region": t.region,
            }
            for t in catalog.vocabulary.tokens
        ],
        "token_names": [t.name for t in catalog.vocabulary.tokens],
        "formats": py,
        "spec_table": spec_table,
        "descriptor": catalog.descriptor,
        "size_symbols": [token for token, _ in size_fields(catalog.vocabulary)],
        "fact_docs": _fact_docs(),
        "engines": catalog.engines,
        "predicates": _predicates(catalog),
        "predicate_exports": sorted([*FACTS, "FACT_FORMATS"]),
    }
    cpp_context: dict[str, Any] = {
        **context,
        "formats": cpp_formats(catalog),
        "fact_names": FACTS,
        "size_fields": size_fields(catalog.vocabulary),
        "block_field": role_field(catalog.vocabulary, Role.BLOCK),
        "coords": COORDS,
    }
    env = _environment()
    out: dict[str, str] = {}
    for template, path in OUTPUTS:
        ctx = cpp_context if path.endswith((".h", ".cuh")) else context
        out[path] = stamp(path, env.get_template(template).render(**ctx), sources)
    out[GRAMMAR_COPY] = stamp(GRAMMAR_COPY, grammar_text, sources)
    return out
