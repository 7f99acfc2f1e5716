"""What the Python templates print: literals for tokens and layouts, accessor bodies.

Every decision is made here from the layout algebra; the templates only loop and
substitute. An accessor body is a Python expression that reads the right list level or
tensor axis of ``self.kv`` directly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from codegen.catalog import Catalog, FormatEntry
from kvlayout.algebra import axis_of, level_of, row_width_axis, structure
from kvlayout.layout import FACTS, Layout
from kvlayout.vocabulary import Role, Token

__all__ = ["FACTS", "PythonFormat", "python_formats", "token_literal"]


def token_literal(token: Token) -> str:
    """``Token(...)`` source for a vocabulary entry, non-default fields only."""
    args = []
    for f in fields(token):
        value = getattr(token, f.name)
        if value == f.default:
            continue
        if f.name == "role":
            args.append(f"role=Role.{value.name}")
        elif f.name == "fuses":
            args.append(f"fuses=({', '.join(t.name for t in value)})")
        elif f.name == "region":
            args.append(f"region=Region({value.rows.name}, {value.width})")
        elif isinstance(value, str):
            args.append(f"{f.name}={json.dumps(value, ensure_ascii=False)}")
        else:
            args.append(f"{f.name}={value!r}")
    return f"Token({', '.join(args)})"


def layout_literal(layout: Layout) -> str:
    def seq(tokens: tuple[Token, ...]) -> str:
        names = [t.name for t in tokens]
        return "(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"

    return f"Layout(lists={seq(layout.lists)}, tensor={seq(layout.tensor)})"


@dataclass(frozen=True)
class PythonFormat:
    """One format as the Python templates need it."""

    entry: FormatEntry
    class_name: str
    layout_literal: str
    shape: str
    facts: tuple[tuple[str, bool], ...]
    accessors: tuple[tuple[str, str, str], ...]  # (name, signature args, body)
    sizes: tuple[tuple[str, str], ...]  # (symbol, expression)
    pointer_table: str
    display_symbol: str | None
    display_divisor: int

    @property
    def true_facts(self) -> list[str]:
        return [name for name, value in self.facts if value]


def _path(layout: Layout, layer: str) -> str:
    """``self.kv[...]`` down to the probe tensor of layer ``layer``."""
    return "self.kv" + "".join(f"[{layer}]" if lv.role is Role.LAYER else "[0]" for lv in layout.lists)


def _level_len(layout: Layout, level: int, layer: str) -> str:
    prefix = "self.kv" + "".join(
        f"[{layer}]" if lv.role is Role.LAYER else "[0]" for lv in layout.lists[:level]
    )
    return f"len({prefix})"


def _undefined(layout: Layout, accessor: str, symbol: str) -> str:
    fused = next(t for t in layout.tensor if any(p.name == symbol for p in t.parts))
    others = " and ".join(p.name for p in fused.parts if p.name != symbol)
    why = f"{fused.name} folds {symbol} and {others} into one axis"
    return f"raise self.undefined({accessor!r}, {why!r})"


def _size(layout: Layout, symbol: str, t: str, layer: str) -> str | None:
    axis = axis_of(layout, symbol)
    if axis is not None:
        return f"{t}.shape[{axis}]"
    level = level_of(layout, symbol)
    if level is not None:
        return _level_len(layout, level, layer)
    return None


def _head_size(layout: Layout, t: str, layer: str) -> str:
    st = structure(layout)
    planes = [e for e in st.elements if e.level is not None]
    factors: list[str] = []
    axes: list[int] = []
    for e in st.elements:
        if e.level is not None:
            continue
        if e.token is None:
            axes.append(row_width_axis(layout) or 0)
        elif e.token.literal is not None:
            factors.append(str(e.token.literal))
        else:
            axis = axis_of(layout, e.token.name)
            assert axis is not None
            axes.append(axis)
    if planes:
        plane_path = "self.kv" + "".join(
            f"[{layer}]" if lv.role is Role.LAYER else "[0]" for lv in layout.lists[: planes[0].level]
        )
        return " * ".join([*factors, f"self.summed_plane_width({plane_path}, {tuple(axes)!r})"])
    return " * ".join([*factors, *(f"{t}.shape[{a}]" for a in axes)])


def _pointer_table(layout: Layout) -> str:
    """The pointer-table comprehension over a local ``kv`` (bound by the template)."""
    if not layout.lists:
        return "[kv.data_ptr()]"
    names = {Role.LAYER: "layer", Role.KV: "k", Role.ELEMENT: "plane"}
    path = "kv"
    loops = []
    for lv in layout.lists:
        var = names[lv.role]  # type: ignore[index]
        if lv.role is Role.LAYER:
            loops.append(f"for {var} in layers")
        elif lv.literal is not None:
            loops.append(f"for {var} in range({lv.literal})")
        else:
            loops.append(f"for {var} in range(len({path}))")
        path += f"[{var}]"
    return f"[{path}.data_ptr() {' '.join(loops)}]"


def _python_format(entry: FormatEntry) -> PythonFormat:
    layout = entry.layout
    layer = "layer_idx"
    t = _path(layout, layer)
    accessors: list[tuple[str, str, str]] = []

    def add(name: str, body: str, per_layer: bool = True) -> None:
        accessors.append((name, ", layer_idx: int = 0" if per_layer else "", body))

    nl = _size(layout, "NL", t, "0")
    assert nl is not None
    add("num_layers", f"return {nl}", per_layer=False)
    for accessor, symbol in (("num_blocks", "NB"), ("block_size", "BS")):
        read = _size(layout, symbol, t, layer)
        add(accessor, f"return {read}" if read is not None else _undefined(layout, accessor, symbol))
    pbs = _size(layout, "NBBS", t, layer)
    add(
        "page_buffer_size",
        f"return {pbs}"
        if pbs
        else f"return {_size(layout, 'NB', t, layer)} * {_size(layout, 'BS', t, layer)}",
    )
    add("kv_size", f"return {layout.kv_size}", per_layer=False)
    heads = next((p for p in layout.tensor_parts if p.role is Role.HEAD), None)
    num_heads = _size(layout, heads.name, t, layer) if heads else "1"
    head_size = _head_size(layout, t, layer)
    add("num_heads", f"return {num_heads}")
    add("head_size", f"return {head_size}")
    # hidden_dim is hot (kernel groups read it per layer): one expression, one shape read.
    hidden = head_size if num_heads == "1" else f"{num_heads} * {head_size}"
    if hidden.count(f"{t}.shape") > 1:
        hidden = f"shape = {t}.shape\n        return " + hidden.replace(f"{t}.shape", "shape")
    else:
        hidden = f"return {hidden}"
    add("hidden_dim", hidden)
    add("dtype", f"return {t}.dtype")

    sizes: list[tuple[str, str]] = []
    symbols = [lv.name for lv in layout.lists if lv.literal is None]
    for tok in layout.tensor:
        if tok.region is not None:
            if tok.region.rows.name not in symbols:
                symbols.append(tok.region.rows.name)
        elif tok.literal is None:
            symbols.append(tok.name)
    for symbol in symbols:
        read = _size(layout, symbol, t, layer)
        assert read is not None, (layout, symbol)
        sizes.append((symbol, read))
    # The element token a concrete shape shows as a head's row width, divided by the
    # literal factors beside it (a packed K/V axis); planes fold into it.
    element_tokens = [e.token for e in structure(layout).elements if e.token is not None and e.level is None]
    sized = [tok.name for tok in element_tokens if tok.literal is None]
    display = sized[0] if len(sized) == 1 else None
    divisor = 1
    for tok in element_tokens:
        divisor *= tok.literal or 1
    return PythonFormat(
        entry=entry,
        class_name=f"{entry.name}_Spec",
        layout_literal=layout_literal(layout),
        shape=layout.describe_shape(),
        facts=tuple((f, bool(getattr(layout, f))) for f in FACTS),
        accessors=tuple(accessors),
        sizes=tuple(sizes),
        pointer_table=_pointer_table(layout),
        display_symbol=display,
        display_divisor=divisor,
    )


def python_formats(catalog: Catalog) -> list[PythonFormat]:
    return [_python_format(e) for e in catalog.formats]
