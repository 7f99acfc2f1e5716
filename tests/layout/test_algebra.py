"""Properties of the layout algebra: offsets against torch's strides, injectivity,
block strides, fusions, copy plans."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvlayout
from kvlayout import EngineKVFormat, Layout, SizeError, parse
from kvlayout.layout.algebra import (
    Coord,
    offset,
    pointer_index,
    resolve_sizes,
    split_pages,
    tensor_index,
    with_size,
)
from kvlayout.layout.vocabulary import Role
from kvlayout.testing.strategies import coord_ranges, coords_for, layouts, sizes_for


def all_coords(layout: Layout, sizes: dict[str, int]) -> list[Coord]:
    return [Coord(*c) for c in itertools.product(*coord_ranges(layout, sizes))]


def leaf(layout: Layout, sizes: dict[str, int], pad: int) -> torch.Tensor:
    """A leaf tensor of the layout's shape whose dim 0 rows are ``pad`` elements wider,
    made the way engines make them: slicing a wider buffer (torch computes the strides)."""
    shape = layout.tensor_shape(sizes)
    row = 1
    for n in shape[1:]:
        row *= n
    base = torch.empty(shape[0], row + pad)
    return base[:, :row].view(shape)


@given(st.data())
def test_offsets_follow_torch_strides(data: st.DataObject) -> None:
    layout = data.draw(layouts())
    sizes = data.draw(sizes_for(layout))
    pad = data.draw(st.integers(0, 3)) if layout.has_leading_block_axis else 0
    t = leaf(layout, sizes, pad)
    assert tuple(t.shape) == layout.tensor_shape(sizes)
    block_stride = t.stride(0) if pad else None
    assert layout.tensor_strides(sizes, block_stride) == t.stride()
    coord = data.draw(coords_for(layout, sizes))
    ptr, index = tensor_index(layout, coord, sizes)
    torch_offset = sum(i * s for i, s in zip(index, t.stride(), strict=True))
    assert offset(layout, coord, sizes, block_stride) == (ptr, torch_offset)
    path = layout.pointer_order(sizes)[ptr]
    for level, level_index in zip(layout.lists, path, strict=True):
        if level.role is Role.LAYER:
            assert level_index == coord.layer


@given(st.data())
def test_every_element_has_its_own_place(data: st.DataObject) -> None:
    """The map coordinate -> (pointer, offset) is injective and stays inside the tensor."""
    layout = data.draw(layouts())
    sizes = data.draw(sizes_for(layout, max_side=3))
    numel = 1
    for n in layout.tensor_shape(sizes):
        numel *= n
    n_pointers = len(layout.pointer_order(sizes))
    seen = set()
    for c in all_coords(layout, sizes):
        ptr, off = offset(layout, c, sizes)
        assert 0 <= ptr < n_pointers and 0 <= off < numel
        seen.add((ptr, off))
    # injective (one place per coordinate) and onto (no place left unaddressed)
    assert len(seen) == len(all_coords(layout, sizes)) == n_pointers * numel


def test_resolved_sizes_are_reused_and_read_only() -> None:
    layout = parse("NL_X_NBBS_NH_HS")
    s = resolve_sizes(layout, {"NB": 4, "BS": 2, "NH": 1, "HS": 8})
    assert s == {"NB": 4, "BS": 2, "NBBS": 8, "NH": 1, "HS": 8}
    assert resolve_sizes(layout, s) is s and resolve_sizes(parse("NL_X_NB_BS_HS"), s) is not s
    with pytest.raises(TypeError, match="resolved sizes are read-only"):
        s["NB"] = 5  # type: ignore[index]  # mypy refuses it too (a Mapping)
    assert {**s, "NB": 5}["NBBS"] == 8 and resolve_sizes(layout, {**s, "NB": 5})["NB"] == 5


def test_fused_axis_indexes_like_its_parts() -> None:
    """NBBS is the CuTe mode (NB, BS): the fused layout addresses like the split one."""
    fused, split = parse("TWO_X_NL_X_NBBS_NH_HS"), parse("TWO_X_NL_X_NB_BS_NH_HS")
    sizes = {"NL": 2, "NB": 3, "BS": 4, "NH": 2, "HS": 3}
    for c in all_coords(split, sizes):
        assert offset(fused, c, sizes) == offset(split, c, sizes)


def test_packed_cs_indexes_like_two_hs() -> None:
    cs, two_hs = parse("NL_X_NB_NH_BS_CS"), parse("NL_X_NB_NH_BS_TWO_HS")
    sizes = {"NL": 2, "NB": 3, "BS": 2, "NH": 2, "HS": 3}
    assert cs.head_size(sizes) == two_hs.head_size(sizes) == 6
    for c in all_coords(cs, sizes):
        assert offset(cs, c, sizes) == offset(two_hs, c, sizes)


def test_region_page_puts_values_before_scales() -> None:
    """NL_X_NB_BSV_BSS: a block is BS*128 value bytes, then BS*4 scale bytes; a token's
    row is [128 values | 4 scales]."""
    layout = kvlayout.layout_of(EngineKVFormat.NL_X_NB_BSV_BSS)
    sizes = {"NL": 1, "NB": 3, "BS": 16}
    assert layout.tensor_shape(sizes) == (3, 16, 132)
    assert layout.head_size(sizes) == 132
    page = 16 * 132
    assert offset(layout, Coord(block=2, token=5, elem=7), sizes) == (0, 2 * page + 5 * 128 + 7)
    assert offset(layout, Coord(block=2, token=5, elem=129), sizes) == (0, 2 * page + 16 * 128 + 5 * 4 + 1)


def test_pointer_tables() -> None:
    sizes = {"NL": 3, "NP": 2}
    assert parse("TWO_X_NL_X_NB_BS_NH_HS").pointer_order(sizes, [0, 2]) == [(0, 0), (0, 2), (1, 0), (1, 2)]
    assert parse("NL_X_TWO_X_NB_BS_NH_HS").pointer_order(sizes, [0, 2]) == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert parse("NL_X_NP_X_NB_BS_ONE_HS").pointer_order(sizes, [1]) == [(1, 0), (1, 1)]
    assert parse("NB_NL_TWO_BS_NH_HS").pointer_order(sizes) == [()]
    layout = parse("NL_X_TWO_X_NB_BS_NH_HS")
    assert pointer_index(layout, Coord(layer=2, kv=1), {"NL": 3}) == 5


@given(st.data())
def test_copy_plans_cover_every_element_once(data: st.DataObject) -> None:
    """Walking a block's copy plan visits exactly the oracle's (chunk, cache) pairs."""
    layout = data.draw(layouts())
    sizes = data.draw(sizes_for(layout, max_side=3))
    plan = layout.copy_plan(sizes)
    row = plan.row
    assert row == layout.num_heads(sizes) * layout.head_size(sizes)
    layers, kvs, blocks, tokens, heads, elems = coord_ranges(layout, sizes)
    kv, layer, block = kvs[-1], layers[-1], blocks[-1]
    expected = {}
    for token, head, elem in itertools.product(tokens, heads, elems):
        ptr, off = offset(layout, Coord(layer, kv, block, token, head, elem), sizes)
        expected[token * row + head * layout.head_size(sizes) + elem] = (ptr, off)
    walked = {}
    for piece in plan.pieces:
        hs = layout.head_size(sizes)
        base_ptr, base = offset(layout, Coord(layer, kv, block, 0, piece.elem // hs, piece.elem % hs), sizes)
        for idx in itertools.product(*(range(lp.extent) for lp in piece.loops)):
            chunk = piece.elem + sum(i * lp.chunk_stride for i, lp in zip(idx, piece.loops, strict=True))
            cache = base + sum(i * lp.cache_stride for i, lp in zip(idx, piece.loops, strict=True))
            for r in range(piece.run):
                assert chunk + r not in walked
                walked[chunk + r] = (base_ptr, cache + r)
    assert walked == expected


@pytest.mark.parametrize(
    ("fmt", "run"),
    [
        (EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, 8 * 128),
        (EngineKVFormat.NL_X_TWO_NB_NH_BS_HS, 128),
        (EngineKVFormat.NL_X_NB_BS_NH_CS, 8 * 256),
        (EngineKVFormat.NL_X_NB_NH_BS_CS, 256),
        (EngineKVFormat.NB_NL_TWO_NH_BS_HS, 128),
        (EngineKVFormat.NL_X_NB_BSV_BSS, 4),
        (EngineKVFormat.NL_X_NP_X_NB_BS_ONE_HS, 128),
    ],
)
def test_row_runs(fmt: EngineKVFormat, run: int) -> None:
    sizes = {"NL": 32, "NB": 64, "BS": 16, "NH": 8, "HS": 128, "NP": 2}
    assert kvlayout.layout_of(fmt).row_run(sizes) == run


def test_nhd_blocks_copy_in_one_piece() -> None:
    sizes = {"NL": 32, "NB": 64, "BS": 16, "NH": 8, "HS": 128}
    plan = kvlayout.layout_of(EngineKVFormat.NL_X_TWO_NB_BS_NH_HS).copy_plan(sizes)
    assert [(p.run, p.loops) for p in plan.pieces] == [(16 * 8 * 128, ())]


def test_size_errors() -> None:
    layout = parse("NL_X_TWO_NB_BS_NH_HS")
    sizes = {"NL": 2, "NB": 3, "BS": 4, "NH": 2, "HS": 3}
    with pytest.raises(SizeError, match=r"NL_X_TWO_NB_BS_NH_HS: token 4 is out of range for BS=4"):
        offset(layout, Coord(token=4), sizes)
    with pytest.raises(SizeError, match=r"NL_X_TWO_NB_BS_NH_HS: this needs a size for HS"):
        layout.tensor_shape({"NL": 2, "NB": 3, "BS": 4, "NH": 2})
    with pytest.raises(SizeError, match=r"dim 0 is not the block axis, so a block stride cannot apply"):
        layout.tensor_strides(sizes, block_stride=100)
    with pytest.raises(SizeError, match=r"block stride 5 is smaller than a block's 48 elements"):
        parse("NL_X_NB_TWO_BS_NH_HS").tensor_strides(sizes, block_stride=5)
    with pytest.raises(SizeError, match=r"size NB=-1 is not a non-negative int"):
        layout.tensor_shape({**sizes, "NB": -1})
    with pytest.raises(
        SizeError, match=r"^NL_X_TWO_NB_BS_NH_HS: a chunk row of 5 elements cannot hold a 6-element row$"
    ):
        layout.copy_plan(sizes, chunk_row=5)
    resolved = resolve_sizes(layout, sizes)
    with pytest.raises(TypeError, match=r"^resolved sizes are read-only; copy them with dict\(\.\.\.\)$"):
        resolved["NB"] = 5  # type: ignore[index]  # a Mapping to mypy, refused at run time too


def test_fused_sizes_resolve_from_parts_or_label() -> None:
    layout = parse("NL_X_NBBS_ONE_HS")
    assert layout.tensor_shape({"NL": 1, "NB": 4, "BS": 8, "HS": 2}) == (32, 1, 2)
    assert layout.tensor_shape({"NL": 1, "PBS": 12, "HS": 2}) == (12, 1, 2)
    assert (
        parse("NL_X_NB_BS_NH_CS").concrete_shape({"NL": 1, "NB": 2, "BS": 3, "NH": 1, "CS": 2000})
        == "1 x [2, 3, 1, 2000]"
    )


def test_a_coordinate_that_is_not_an_int_is_refused_not_truncated() -> None:
    """``Coord(head=1.5)`` read as head 1, ``Coord(elem=True)`` as 1, ``elem=None`` failed in ``int()``."""
    import kvlayout
    from kvlayout.layout.algebra import Coord, offset

    layout = kvlayout.layout_of(kvlayout.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS)
    sizes = {"NL": 2, "NB": 4, "BS": 4, "NH": 2, "HS": 8}
    for bad, field in ((Coord(head=1.5), "head"), (Coord(elem=True), "elem"), (Coord(elem=None), "elem")):  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=rf"Coord\.{field} must be an int"):
            offset(layout, bad, sizes)


def test_a_size_the_layout_cannot_hold_is_refused_naming_the_role_or_the_page() -> None:
    """``with_size`` of a role no token sizes (an MLA latent's heads), and ``split_pages``
    of sizes that leave the page out, name what is missing rather than a KeyError."""
    mla = kvlayout.layout_of(EngineKVFormat.NL_X_NB_BS_HS)
    with pytest.raises(SizeError, match=r"^NL_X_NB_BS_HS: no sized token addresses the head role$"):
        with_size(mla, {"NL": 2, "NB": 3, "BS": 4, "HS": 8}, Role.HEAD, 2)
    assert with_size(mla, {"NL": 2}, Role.LAYER, 5) == {"NL": 5}
    folded = kvlayout.layout_of(EngineKVFormat.NL_X_NBBS_ONE_HS)
    with pytest.raises(SizeError, match=r"^the sizes \['HS', 'NL'\] give no page size: NBBS missing$"):
        split_pages(folded, {"NL": 2, "HS": 8}, 4, "block_size")
    with pytest.raises(SizeError, match=r"^the sizes \['HS', 'NB', 'NL'\] give no page size: BS missing$"):
        split_pages(mla, {"NL": 2, "NB": 3, "HS": 8}, 4, "block_size")
