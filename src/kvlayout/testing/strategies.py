"""Hypothesis strategies over layouts, sizes and coordinates.

``layout_names()`` draws valid layout names beyond the catalog (permuted axes, optional
K/V, planes, singletons); ``layouts()`` parses them or draws a catalog format;
``sizes_for(layout)`` gives sizes for every token it needs; ``coords_for(layout, sizes)``
a coordinate inside its logical space, the algebra's ``offset`` input.
"""

from __future__ import annotations

from hypothesis import strategies as st

from kvlayout import EngineKVFormat, Layout, layout_of, parse
from kvlayout.errors import KVLayoutError
from kvlayout.layout.algebra import Coord, kv_size, size_of, size_symbols
from kvlayout.layout.vocabulary import Role

__all__ = ["coords_for", "layout_names", "layouts", "sizes_for"]

FORMATS = list(EngineKVFormat)


@st.composite
def layout_names(draw: st.DrawFn) -> str:
    """Valid names beyond the catalog: permuted axes, optional K/V, planes and singletons."""
    block = draw(st.sampled_from([["NB", "BS"], ["NBBS"]]))
    element = draw(st.sampled_from(["HS", "CS"]))
    axes = [*block, element]
    if element == "HS" and draw(st.booleans()):
        axes.append("NH")
    if element == "CS":
        axes.append("NH")
    if draw(st.booleans()):
        axes.append("ONE")
    lists: list[str] = []
    kv_place = (
        draw(st.sampled_from(["none", "tensor", "sized", "outer", "inner"])) if element == "HS" else "none"
    )
    if kv_place == "tensor":
        axes.append("TWO")
    if kv_place == "sized":  # a K/V axis of 1 or 2 planes (MAX)
        axes.append("KV")
    layer_in_tensor = draw(st.booleans())
    if layer_in_tensor:
        axes.append("NL")
    axes = draw(st.permutations(axes))
    if not layer_in_tensor:
        lists.append("NL")
        if kv_place == "outer":
            lists.insert(0, "TWO")
        elif kv_place == "inner":
            lists.append("TWO")
        elif draw(st.booleans()) and element == "HS" and "NH" not in axes:
            lists.append("NP")
    return "_X_".join([*lists, "_".join(axes)])


@st.composite
def layouts(draw: st.DrawFn, *, catalog_only: bool = False) -> Layout:
    if catalog_only or draw(st.booleans()):
        return layout_of(draw(st.sampled_from(FORMATS)))
    name = draw(layout_names())
    try:
        return parse(name)
    except KVLayoutError:
        from hypothesis import reject

        reject()
        raise


@st.composite
def sizes_for(draw: st.DrawFn, layout: Layout, *, max_side: int = 5) -> dict[str, int]:
    """Positive sizes for every sized token the layout names, by what the token is: its
    choices (a K/V axis), 1..3 planes for a list level of row planes, a side otherwise.
    A page axis (NB*BS) is left to its parts; a row that packs K/V beside a literal (CS)
    is sometimes given on its own (an opaque state row, not 2*HS)."""
    side = st.integers(1, max_side)
    planes = {t.name for t in layout.lists if t.role is Role.ELEMENT}
    sizes: dict[str, int] = {}
    for t in size_symbols(layout):
        if t.fuses:
            if any(p.literal is not None for p in t.fuses) and draw(st.booleans()):
                sizes[t.name] = draw(side)
        elif t.choices:
            sizes[t.name] = draw(st.sampled_from(t.choices))
        elif t.name in planes:
            sizes[t.name] = draw(st.integers(1, 3))
        else:
            sizes[t.name] = draw(side)
    return sizes


def fixed_sizes(layout: Layout, sides: tuple[int, ...] = (2, 3)) -> dict[str, int]:
    """Deterministic sizes for every sized token a layout needs: the largest choice, 2
    planes, else ``sides`` in turn (distinct neighbours show a wrong axis)."""
    planes = {t.name for t in layout.lists if t.role is Role.ELEMENT}
    sizes: dict[str, int] = {}
    for i, t in enumerate(u for u in size_symbols(layout) if not u.fuses):
        sizes[t.name] = max(t.choices) if t.choices else 2 if t.name in planes else sides[i % len(sides)]
    return sizes


def role_size(layout: Layout, sizes: dict[str, int], role: Role) -> int:
    """A role's size under sizes that give it (1 where the layout has no such role)."""
    n = size_of(layout, sizes, role)
    return 1 if n is None else n


def coord_ranges(layout: Layout, sizes: dict[str, int]) -> list[range]:
    """The range of each coordinate field (layer, kv, block, token, head, elem)."""
    return [
        range(role_size(layout, sizes, Role.LAYER)),
        range(kv_size(layout, sizes)),
        range(role_size(layout, sizes, Role.BLOCK)),
        range(role_size(layout, sizes, Role.TOKEN)),
        range(layout.num_heads(sizes)),
        range(layout.head_size(sizes)),
    ]


@st.composite
def coords_for(draw: st.DrawFn, layout: Layout, sizes: dict[str, int]) -> Coord:
    """A coordinate inside the layout's logical space."""
    return Coord(*(draw(st.sampled_from(r)) for r in coord_ranges(layout, sizes)))
