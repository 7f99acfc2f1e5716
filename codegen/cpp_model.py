"""What the C++ templates print: the enum, the facts, and one indexer per format.

Each indexer is rendered from :func:`kvlayout.layout.algebra.structure`, the same model the
Python oracle evaluates: a pointer index (mixed radix over the list levels) and an
element offset (the sum over modes of index times a row-major stride, dim 0 widened to
the runtime block stride where the layout allows it).
"""

from __future__ import annotations

from dataclasses import dataclass

from codegen.catalog import Catalog, FormatEntry
from kvlayout.layout.algebra import COORD_FIELDS, Mode, Product, Structure, Term, structure
from kvlayout.layout.ast import FACTS
from kvlayout.layout.vocabulary import Role, Vocabulary

__all__ = ["CppFormat", "cpp_formats", "role_field", "size_fields"]


def size_fields(vocabulary: Vocabulary) -> list[tuple[str, str]]:
    """``(token, field)`` for every token with a size of its own (not a literal or a region)."""
    return [(t.name, t.name.lower()) for t in vocabulary.tokens if t.literal is None and t.region is None]


def role_field(vocabulary: Vocabulary, role: Role) -> str:
    """The ``Sizes`` field of the one sized token with ``role`` (hand C++ asks for a role's
    size through the accessor this names, never by the token's spelling)."""
    fields = [f for (name, f) in size_fields(vocabulary) if vocabulary[name].role is role]
    if len(fields) != 1:
        raise ValueError(f"the vocabulary needs exactly one sized {role.value} token, has {len(fields)}")
    return fields[0]


def _product(p: Product) -> str:
    parts = [str(f) if isinstance(f, int) else f"s.{f.lower()}" for f in p]
    return " * ".join(parts) if parts else "1"


def _term(term: Term, outermost: bool) -> str:
    expr = f"c.{term.coord}"
    if term.div:
        expr = f"({expr} / ({_product(term.div)}))"
    if term.mod is not None and not outermost:
        expr = f"({expr} % ({_product(term.mod)}))"
    if term.weight:
        expr = f"{expr} * {_product(term.weight)}"
    return expr


@dataclass(frozen=True)
class CppFormat:
    entry: FormatEntry
    function: str
    facts: tuple[tuple[str, bool], ...]
    strides: tuple[tuple[str, str], ...]  # (name, expression), innermost first
    locals: tuple[tuple[str, str], ...]  # (name, expression) computed before the offset
    pointer: str
    offset: str
    uses_block_stride: bool


def _region_index(st: Structure, mode: Mode, m: int) -> tuple[str, str]:
    factor = next(e for e in st.elements if e.token is None)
    outermost = st.elements.index(factor) == 0
    col = _term(Term("elem", (), factor.div, factor.extent), outermost)
    expr = "0"
    rows = f"s.{(mode.rows or '').lower()}"
    for span in reversed(mode.regions):
        here = f"{rows} * {span.start} + c.token * {span.width} + (col{m} - {span.start})"
        expr = here if expr == "0" else f"(col{m} < {span.start + span.width} ? {here} : {expr})"
    return col, expr


def _cpp_format(entry: FormatEntry) -> CppFormat:
    layout = entry.layout
    st = structure(layout)
    first_element = st.elements[0] if st.elements else None
    strides: list[tuple[str, str]] = []
    locals_: list[tuple[str, str]] = []
    acc = "1"
    for m in range(len(st.modes) - 1, -1, -1):
        mode = st.modes[m]
        expr = acc
        if m == 0 and layout.has_leading_block_axis:
            expr = f"block_stride > 0 ? block_stride : {acc}"
        strides.append((f"stride{m}", expr))
        acc = f"stride{m} * {_product(mode.extent)}"
    addends: list[str] = []
    for m, mode in enumerate(st.modes):
        if mode.regions:
            col, index = _region_index(st, mode, m)
            locals_.append((f"col{m}", col))
            addends.append(f"({index}) * stride{m}")
            continue
        for term in mode.terms:
            outermost = first_element is not None and term.coord == "elem" and term.div == first_element.div
            addends.append(f"{_term(term, outermost)} * stride{m}")
    pointer = "0"
    for level in st.levels:
        outermost = (
            first_element is not None and level.term.coord == "elem" and level.term.div == first_element.div
        )
        digit = _term(level.term, outermost)
        pointer = digit if pointer == "0" else f"({pointer}) * {_product(level.extent)} + {digit}"
    return CppFormat(
        entry=entry,
        function=entry.name.lower(),
        facts=tuple((f, bool(getattr(layout, f))) for f in FACTS),
        strides=tuple(strides),
        locals=tuple(locals_),
        pointer=pointer,
        offset=" + ".join(addends) if addends else "0",
        uses_block_stride=layout.has_leading_block_axis,
    )


def cpp_formats(catalog: Catalog) -> list[CppFormat]:
    return [_cpp_format(e) for e in catalog.formats]


COORDS = COORD_FIELDS
