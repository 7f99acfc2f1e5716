"""Hypothesis strategies over layouts, sizes and coordinates.

``layout_names()`` draws valid layout names beyond the catalog (permuted axes, optional
K/V, planes, singletons); ``layouts()`` parses them or draws a catalog format;
``sizes_for(layout)`` gives sizes for every token it needs; ``coords_for(layout, sizes)``
a coordinate inside its logical space, the algebra's ``offset`` input.
"""

from __future__ import annotations

from hypothesis import strategies as st

from kvlayout import EngineKVFormat, Layout, layout_of, parse
from kvlayout.algebra import Coord
from kvlayout.errors import KVLayoutError

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
    kv_place = draw(st.sampled_from(["none", "tensor", "outer", "inner"])) if element == "HS" else "none"
    if kv_place == "tensor":
        axes.append("TWO")
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
    """A catalog format's layout, or (unless ``catalog_only``) one parsed from
    :func:`layout_names`."""
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
    """Positive sizes for every token a layout needs (fused sizes derived)."""
    side = st.integers(1, max_side)
    sizes = {
        "NL": draw(side),
        "NB": draw(side),
        "BS": draw(side),
        "NH": draw(side),
        "HS": draw(side),
        "NP": draw(st.integers(1, 3)),
    }
    if draw(st.booleans()):
        sizes["CS"] = draw(side)  # an opaque state row, not 2*HS
    return sizes


@st.composite
def coords_for(draw: st.DrawFn, layout: Layout, sizes: dict[str, int]) -> Coord:
    """A coordinate inside the layout's logical space."""
    return Coord(
        layer=draw(st.integers(0, sizes["NL"] - 1)),
        kv=draw(st.integers(0, layout.kv_size - 1)),
        block=draw(st.integers(0, sizes["NB"] - 1)),
        token=draw(st.integers(0, sizes["BS"] - 1)),
        head=draw(st.integers(0, layout.num_heads(sizes) - 1)),
        elem=draw(st.integers(0, layout.head_size(sizes) - 1)),
    )
