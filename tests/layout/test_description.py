"""Layouts as data (kvlayout.describe): the structure of every format, facts derived from
it, stride overrides, the way back to a format, and vLLM's layout spellings.

Worked examples from LMCache's descriptor branch (test_kv_layout_descriptor @07a351d7,
facts sheet `lmcache-branch-facts.md` section 6).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import get_args

import pytest
import torch
from hypothesis import given

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout.layout.ast import FACTS
from kvlayout.layout.description import (
    Axis,
    DescriptionError,
    Grouping,
    KVPacking,
    LayoutDescription,
    QuantSpec,
    RegionPart,
    ScalePlacement,
    describe,
    kv_layout_axes,
    to_engine_kv_format,
)
from kvlayout.testing import layout_names
from kvlayout.types import KVLayoutName

B, C, H, KV, L, N = Axis.B, Axis.C, Axis.H, Axis.KV, Axis.L, Axis.N


@pytest.mark.parametrize("fmt", list(F), ids=lambda f: f.name)
def test_example_1_every_format_round_trips_with_its_facts(fmt: F) -> None:
    desc = describe(fmt)
    layout = kvlayout.layout_of(fmt)
    assert to_engine_kv_format(desc) is fmt and desc.name == fmt.name
    assert {name: getattr(desc, name) for name in FACTS} == {name: getattr(layout, name) for name in FACTS}
    assert desc.kv_size == layout.kv_size
    assert len(desc.dims) == layout.tensor_rank
    json.dumps(desc.to_dict())  # plain data for tools


@given(layout_names())
def test_any_layout_describes_with_the_layouts_own_facts(name: str) -> None:
    layout = kvlayout.parse(name)
    try:
        desc = describe(layout)
    except DescriptionError:
        return  # some names are layouts LMCache's descriptor cannot express
    assert {f: getattr(desc, f) for f in FACTS} == {f: getattr(layout, f) for f in FACTS}


def test_example_1_structures_are_unique() -> None:
    keys = [describe(f).key() for f in F]
    assert len(set(keys)) == len(keys)


def test_the_canonical_structures() -> None:
    """A few rows of LMCache's canonical table, and kvlayout's two additions."""
    expected = {
        F.NB_NL_TWO_BS_NH_HS: (
            Grouping.SINGLE_TENSOR,
            KVPacking.SPLIT,
            ((B,), (L,), (KV,), (N,), (H,), (C,)),
        ),
        F.TWO_X_NL_X_NBBS_NH_HS: (Grouping.KV_LISTS, KVPacking.SPLIT, ((B, N), (H,), (C,))),
        F.NL_X_NBBS_ONE_HS: (Grouping.PER_LAYER, KVPacking.SHARED, ((B, N), (H,), (C,))),
        F.NL_X_NB_NH_BS_CS: (Grouping.PER_LAYER, KVPacking.FUSED, ((B,), (H,), (N,), (KV, C))),
        F.NL_X_NB_NH_BS_TWO_HS: (Grouping.PER_LAYER, KVPacking.FUSED, ((B,), (H,), (N,), (KV,), (C,))),
        F.NL_X_TWO_NB_NH_ONE_BS_HS: (
            Grouping.PER_LAYER,
            KVPacking.SPLIT,
            ((KV,), (B,), (H,), (), (N,), (C,)),
        ),
        F.NL_X_TWO_X_NB_BS_NH_HS: (Grouping.PER_LAYER_KV_PAIRS, KVPacking.SPLIT, ((B,), (N,), (H,), (C,))),
        F.NL_X_NP_X_NB_BS_ONE_HS: (
            Grouping.PER_LAYER_PLANE_TUPLES,
            KVPacking.SHARED,
            ((B,), (N,), (H,), (C,)),
        ),
        F.NL_X_NB_BS_NH_HS: (Grouping.PER_LAYER, KVPacking.SINGLE, ((B,), (N,), (H,), (C,))),
        F.NB_KV_NL_BS_NH_HS: (Grouping.SINGLE_TENSOR, KVPacking.SPLIT, ((B,), (KV,), (L,), (N,), (H,), (C,))),
    }
    for fmt, (grouping, packing, dims) in expected.items():
        desc = describe(fmt)
        assert (desc.grouping, desc.kv_packing, desc.dims) == (grouping, packing, dims), fmt
    assert describe(F.TWO_X_NL_X_NB_BS_NH_HS).kv_placement == "list level 0"
    assert describe(F.NL_X_NB_NH_BS_CS).kv_placement == "inside dim 3"
    assert describe(F.NL_X_NB_BS_HS).kv_placement == "none"


def test_example_2_a_kvcached_view() -> None:
    extents = {KV: 2, B: 8, N: 16, H: 2, C: 64}
    view = LayoutDescription(
        Grouping.PER_LAYER,
        KVPacking.SPLIT,
        ((B,), (KV,), (N,), (H,), (C,)),
        extents,
        {0: 4 * 2 * 16 * 2 * 64},
    )
    assert view.resolved_strides() == (16384, 2048, 128, 64, 1)
    assert to_engine_kv_format(view) is F.NL_X_NB_TWO_BS_NH_HS
    assert view.with_block_stride(0).resolved_strides() == (4096, 2048, 128, 64, 1)
    sizes = {"NL": 4, "NB": 8, "BS": 16, "NH": 2, "HS": 64}
    described = describe(F.NL_X_NB_TWO_BS_NH_HS, sizes, block_stride=16384)
    assert described.key() == view.key() and described.dim_strides == {0: 16384}
    assert described.resolved_strides() == view.resolved_strides()
    assert {a: described.extents[a] for a in extents} == extents and described.extents[L] == 4


@pytest.mark.parametrize(
    ("hint", "pool", "fmt", "compact", "strided"),
    [
        ("BLHNC", (6, 3, 2, 4, 8), F.NL_X_NB_NH_BS_CS, (64, 32, 8, 1), (192, 32, 8, 1)),
        ("BLNHC", (6, 3, 4, 2, 8), F.NL_X_NB_BS_NH_CS, (64, 16, 8, 1), (192, 16, 8, 1)),
    ],
)
def test_example_3_blocks_first_pools(
    hint: str, pool: tuple[int, ...], fmt: F, compact: tuple[int, ...], strided: tuple[int, ...]
) -> None:
    buf = torch.zeros(pool)
    views = [buf[:, layer] for layer in range(pool[1])]
    got, kv = kvlayout.normalize_kv_and_discover_format(views, "vllm", {"kv_layout": hint})
    assert got is fmt
    stride = kvlayout.resolve_block_stride_and_log_layout(kv, fmt, 0, 0)
    sizes = kvlayout.get_spec(kv, fmt).sizes()
    tight = describe(fmt, sizes, storage_dtype="float32")
    assert tight.resolved_strides() == compact
    padded = describe(fmt, sizes, storage_dtype="float32", block_stride=stride)
    assert padded.resolved_strides() == strided == views[0].stride()
    assert padded.dim_strides == {0: 192} and to_engine_kv_format(padded) is fmt
    assert padded.with_block_stride(0) == tight


def test_example_4_block_stride_errors() -> None:
    with pytest.raises(DescriptionError, match=re.escape("a plain dim of their own, not dim 0 (B, N)")):
        describe(F.TWO_X_NL_X_NBBS_NH_HS).with_block_stride(64)
    with pytest.raises(DescriptionError, match="a block stride is a non-negative int, got -1"):
        describe(F.NL_X_NB_BS_HS).with_block_stride(-1)


def test_example_5_lmcache_s_chunk_layout_is_no_format() -> None:
    chunk = LayoutDescription(Grouping.SINGLE_TENSOR, KVPacking.SPLIT, ((KV,), (L,), (B, N), (H, C)))
    with pytest.raises(DescriptionError, match="no EngineKVFormat member has this structure"):
        to_engine_kv_format(chunk)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (((B,), (B,), (C,)), "axis B is in more than one dim (0 and 1)"),
        (((B,), (N,)), "a layout needs the content axis C in its dims"),
        (((B,), (N,), (L,), (C,)), "axis L is both a dim and a list level"),
    ],
)
def test_descriptions_are_checked(args: tuple[tuple[Axis, ...], ...], message: str) -> None:
    with pytest.raises(DescriptionError, match=re.escape(message)):
        LayoutDescription(Grouping.PER_LAYER, KVPacking.SHARED, args)
    with pytest.raises(DescriptionError, match="SHARED has no K/V pair"):
        LayoutDescription(Grouping.PER_LAYER, KVPacking.SHARED, ((B,), (KV,), (N,), (C,)))
    with pytest.raises(
        DescriptionError, match="FUSED needs KV in the dims, inner to the token and head axes"
    ):
        LayoutDescription(Grouping.PER_LAYER, KVPacking.FUSED, ((B,), (KV,), (N,), (C,)))
    with pytest.raises(DescriptionError, match="extent of N must be a positive int, got 0"):
        LayoutDescription(Grouping.PER_LAYER, KVPacking.SHARED, ((B,), (N,), (C,)), {N: 0})


def test_dims_given_as_lists_are_the_tuples() -> None:
    listed = _shared([[B], [N], [H, C]])  # as LMCache's callers often spell them
    assert listed.dims == ((B,), (N,), (H, C))
    assert listed == _shared(((B,), (N,), (H, C)))


def _shared(dims: object, **fields: object) -> LayoutDescription:
    return LayoutDescription(Grouping.PER_LAYER, KVPacking.SHARED, dims, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: LayoutDescription("PER_LAYER", KVPacking.SHARED, ((N,), (C,))),  # type: ignore[arg-type]
         "grouping and kv_packing are a Grouping and a KVPacking, not 'PER_LAYER' and "),
        (lambda: _shared([(B,), N, (C,)]), "dim 1 is <Axis.N: 'N'>, not a tuple of axes (a fold)"),
        (lambda: _shared(((B,), ("N",), (C,))), "dim 1 holds 'N', not an Axis"),
        (lambda: LayoutDescription(Grouping.PER_LAYER, KVPacking.SPLIT, ((B,), (N,), (C,))),
         "SPLIT needs KV as a dim, or a KV_LISTS or PER_LAYER_KV_PAIRS grouping"),
        (lambda: _shared(((B,), (N,), (C,)), quant="fp8"),
         "quant is a QuantSpec with a ScalePlacement, not 'fp8'"),
        (lambda: _shared(((B,), (N,), (C,)), quant=QuantSpec("float32", 16, ScalePlacement.INLINE_PER_HEAD),
                         regions=(RegionPart("values", 64), RegionPart("scales", 4))),
         "regions are a blocked page (BLOCK_REGION), but quant says INLINE_PER_HEAD"),
        (lambda: _shared(((B,), (N,), (C,)), extents={"N": 4}), "extents key 'N' is not an Axis"),
        (lambda: _shared(((B,), (N,), (C,)), regions=(RegionPart("k", 64, "uint8"),
                                                      RegionPart("v", 32, "bfloat16"),
                                                      RegionPart("scales", 4, "float32"))),
         "the value regions hold different dtypes (bfloat16, uint8)"),
        (lambda: _shared(((B,), (N,), (C,)), regions=(RegionPart("values", 61, "uint8"),
                                                      RegionPart("scales", 8, "float32"))),
         "61 uint8 values and 2 float32 scales per token do not share scales evenly"),
    ],
)  # fmt: skip
def test_ill_typed_or_inconsistent_descriptions_say_which_field(
    make: Callable[[], LayoutDescription], message: str
) -> None:
    """LMCache's callers build descriptions by hand: a wrong type or a quantization the
    regions cannot hold is named, not left to fail later in arithmetic."""
    with pytest.raises(DescriptionError, match=re.escape(message)):
        make()


def test_a_dim_without_an_extent_is_named() -> None:
    desc = _shared(((B,), (N, H), (C,)), extents={N: 4})
    with pytest.raises(DescriptionError, match=re.escape("dim 1 (N, H) needs an extent for H")):
        desc.dim_extent(1)
    assert _shared(((B,), (N, H), (C,)), extents={N: 4, H: 2}).dim_extent(1) == 8


# -- vLLM's layout spellings (example 6) -------------------------------------------------


def test_example_6_spellings_are_orders_of_axes() -> None:
    assert kv_layout_axes("LBNHC") == kv_layout_axes("NHD") == (L, B, N, H, C)
    assert kv_layout_axes("LBHNC") == kv_layout_axes("HND") == (L, B, H, N, C)
    assert kv_layout_axes("LHBNC").index(H) < kv_layout_axes("LHBNC").index(B)
    for bad in ("LBHN", "LBHNCX", "LBHNN", "NDH", ""):
        with pytest.raises(DescriptionError, match="is not an ordering of L, B, H, N, C"):
            kv_layout_axes(bad)


def test_the_hint_names_are_derived_and_public() -> None:
    assert kvlayout.KV_LAYOUT_NAMES == ("NHD", "HND", "BHLNC", "BLHNC", "BLNHC", "LBHNC", "LBNHC", "LHBNC")
    assert set(get_args(KVLayoutName)) == set(kvlayout.KV_LAYOUT_NAMES)
    assert {"HND", "LBHNC", "BLHNC", "BHLNC", "LHBNC"} == kvlayout.HND_KV_LAYOUTS
    assert {"LHBNC"} == kvlayout.HEAD_OUTER_KV_LAYOUTS
    assert {"BHLNC"} == kvlayout.LAYER_INNER_KV_LAYOUTS
    assert {"BHLNC", "BLHNC", "BLNHC"} == kvlayout.BLOCKS_FIRST_KV_LAYOUTS
    assert kvlayout.KV_LIST_LAYOUT_NAMES == ("k_v", "unified")


@pytest.mark.parametrize("name", ["NHD", "HND", "LBNHC", "LBHNC", "BLNHC", "BLHNC", "LHBNC"])
def test_every_spelling_reads_the_rank_4_unified_cache(name: str) -> None:
    """H before N <=> the fused vLLM member is an HND one: heads outside blocks (21), or
    inside them (12); else 13."""
    kv = [torch.zeros(7, 2, 3, 8) for _ in range(2)]
    fmt, _ = kvlayout.normalize_kv_and_discover_format(kv, "vllm", {"kv_layout": name})
    if name in kvlayout.HEAD_OUTER_KV_LAYOUTS:
        assert fmt is F.NL_X_NH_NB_BS_CS
    else:
        assert fmt is (F.NL_X_NB_NH_BS_CS if name in kvlayout.HND_KV_LAYOUTS else F.NL_X_NB_BS_NH_CS)
    assert kvlayout.LayoutHints(kv_layout=name).is_hnd is (name in kvlayout.HND_KV_LAYOUTS)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "HBLNC",
            "layout hint kv_layout='HBLNC': heads outside both the layers and the blocks split every "
            "layer's blocks per head",
        ),
        ("LNBHC", "layout hint kv_layout='LNBHC': tokens outside the blocks or layers split every block"),
        ("LBNCH", "layout hint kv_layout='LBNCH': a head's row content is not innermost"),
        (
            "XYZ",
            "layout hint kv_layout='XYZ' is not one of NHD, HND, BHLNC, BLHNC, BLNHC, LBHNC, LBNHC, LHBNC",
        ),
    ],
)
def test_untransferable_and_unknown_spellings_are_refused(name: str, message: str) -> None:
    with pytest.raises(kvlayout.LayoutHintError, match=re.escape(message)):
        kvlayout.normalize_kv_and_discover_format([torch.zeros(7, 3, 2, 8)], "vllm", {"kv_layout": name})
