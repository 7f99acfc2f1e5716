"""What the Python templates print: literals for tokens and layouts, accessor bodies.

Every decision is made here from the layout algebra; the templates only loop and
substitute. An accessor body is a Python expression that reads the right list level or
tensor axis of ``self.kv`` directly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from codegen.catalog import Catalog, FormatEntry
from kvlayout.errors import CatalogError
from kvlayout.layout.algebra import (
    axis_of,
    fold_reason,
    level_of,
    role_problem,
    structure,
    tensor_size_axes,
)
from kvlayout.layout.ast import FACTS, Layout
from kvlayout.layout.vocabulary import Role, Token

__all__ = ["FACTS", "ROLE_ACCESSORS", "PythonFormat", "python_formats", "token_literal"]


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
            dtype = "" if value.dtype is None else f", {json.dumps(value.dtype)}"
            args.append(f"region=Region({value.rows.name}, {value.width}{dtype})")
        elif f.name == "choices":
            args.append(f"choices={value!r}")
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
    def kv_size(self) -> str:
        """kv_size as the format table shows it (a K/V axis of its own size says so)."""
        static = self.entry.layout.kv_size
        if static is not None:
            return str(static)
        pair = next(t for t in (*self.entry.layout.lists, *self.entry.layout.tensor) if t.role is Role.KV)
        return f"{pair.name} ({' or '.join(map(str, pair.choices))})" if pair.choices else pair.name

    @property
    def true_facts(self) -> list[str]:
        return [name for name, value in self.facts if value]


def _path(layout: Layout, layer: str, levels: int | None = None) -> str:
    """``self.kv[...]`` down the first ``levels`` list levels (all: the probe tensor of
    layer ``layer``)."""
    chosen = layout.lists if levels is None else layout.lists[:levels]
    return "self.kv" + "".join(f"[{layer}]" if lv.role is Role.LAYER else "[0]" for lv in chosen)


class UnresolvedError(Exception):
    """A role the accessors cannot read (the catalog reports it first, with its line)."""


# The accessors every spec class has and the role each reads: the one place where roles
# meet accessors (so a renamed or new token changes nothing here). ``per_layer``: the
# accessor takes ``layer_idx``.
ROLE_ACCESSORS: tuple[tuple[str, Role, bool], ...] = (
    ("num_layers", Role.LAYER, False),
    ("num_blocks", Role.BLOCK, True),
    ("block_size", Role.TOKEN, True),
    ("page_buffer_size", Role.PAGE, True),
    ("kv_size", Role.KV, False),
    ("num_heads", Role.HEAD, True),
    ("head_size", Role.ELEMENT, True),
)


def _read(layout: Layout, role: Role, t: str, layer: str) -> str | None:
    """An expression for ``role``'s size, read off a tensor axis or a list length; None
    when the layout has no axis or level of its own for it."""
    axis = axis_of(layout, role)
    if axis is not None:
        return f"{t}.shape[{axis}]"
    level = level_of(layout, role)
    if level is not None:
        return f"len({_path(layout, layer, level)})"
    return None


def _role_body(layout: Layout, accessor: str, role: Role, t: str, layer: str) -> str:
    """The accessor's body (a ``return`` or a ``raise``); :class:`UnresolvedError` if the role
    cannot be read."""
    problem = role_problem(layout, role)
    if problem is not None:
        raise UnresolvedError(f"{accessor}: {problem}")
    if role is Role.ELEMENT:
        return f"return {_head_size(layout, t, layer)}"
    if role is Role.KV:
        static = layout.kv_size
        if static is not None:
            return f"return {static}"
        read = _read(layout, role, t, "0")
        if read is None:
            raise UnresolvedError(f"{accessor}: the K/V pair has no size of its own")
        return f"return {read}"
    if role is Role.HEAD:
        return f"return {_read(layout, role, t, layer) or 1}"
    read = _read(layout, role, t, "0" if role is Role.LAYER else layer)
    if read is not None:
        return f"return {read}"
    if role is Role.PAGE:
        block, token = _read(layout, Role.BLOCK, t, layer), _read(layout, Role.TOKEN, t, layer)
        if block is None or token is None:
            raise UnresolvedError(f"{accessor}: neither a page axis nor block and token axes")
        return f"return {block} * {token}"
    why = fold_reason(layout, role)
    if why is None:
        raise UnresolvedError(f"{accessor}: no axis or list level holds the {role.value} role")
    return f"raise self.undefined({accessor!r}, {why!r})"


def _head_size(layout: Layout, t: str, layer: str) -> str:
    st = structure(layout)
    planes = [e for e in st.elements if e.level is not None]
    factors: list[str] = []
    axes: list[int] = []
    for e in st.elements:
        if e.level is not None:
            continue
        if e.token is None:
            region = axis_of(layout, Role.REGION)
            assert region is not None
            axes.append(region)
        elif e.token.literal is not None:
            factors.append(str(e.token.literal))
        else:
            axis = _token_axis(layout, e.token)
            if axis is None:
                raise UnresolvedError(
                    f"head_size: {e.token} is a factor of a head's row but no axis of its own"
                )
            axes.append(axis)
    if planes:
        plane_path = _path(layout, layer, planes[0].level)
        return " * ".join([*factors, f"self.summed_plane_width({plane_path}, {tuple(axes)!r})"])
    return " * ".join([*factors, *(f"{t}.shape[{a}]" for a in axes)])


def _token_axis(layout: Layout, token: Token) -> int | None:
    """The axis of a sized token (an element factor: HS, or CS that fuses K/V into a row)."""
    return next((a for symbol, a in tensor_size_axes(layout) if symbol == token.name), None)


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
    bodies: dict[str, str] = {}
    for name, role, per_layer in ROLE_ACCESSORS:
        try:  # an accessor without layer_idx reads layer 0
            body = _role_body(
                layout, name, role, t if per_layer else _path(layout, "0"), layer if per_layer else "0"
            )
        except UnresolvedError as exc:
            raise CatalogError(entry.path, entry.line, f"format {entry.name}: {exc}") from None
        bodies[name] = body
        accessors.append((name, ", layer_idx: int = 0" if per_layer else "", body))
    # hidden_dim is hot (kernel groups read it per layer): one expression, one shape read.
    num_heads, head_size = (
        bodies["num_heads"].removeprefix("return "),
        bodies["head_size"].removeprefix("return "),
    )
    hidden = head_size if num_heads == "1" else f"{num_heads} * {head_size}"
    if hidden.count(f"{t}.shape") > 1:
        hidden = f"shape = {t}.shape\n        return " + hidden.replace(f"{t}.shape", "shape")
    else:
        hidden = f"return {hidden}"
    accessors.append(("hidden_dim", ", layer_idx: int = 0", hidden))
    accessors.append(("dtype", ", layer_idx: int = 0", f"return {t}.dtype"))

    # Every size the tensors give: sized list levels, then each axis that is one token.
    sizes: list[tuple[str, str]] = []
    for i, lv in enumerate(layout.lists):
        if lv.literal is None:
            sizes.append((lv.name, f"len({_path(layout, '0' if lv.role is Role.LAYER else layer, i)})"))
    sizes.extend((symbol, f"{t}.shape[{axis}]") for symbol, axis in tensor_size_axes(layout))
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
