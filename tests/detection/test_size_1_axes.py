"""Size-1 axes: a size-1 dim never moves axes on its own, but layers laid out alike (every
dim longer than 1 the same size and stride) read as layer 0 reads, wherever their size-1
dims sit; a registration the caller's placement fits no format is tried with its size-1
dims where their strides put them before it is refused; and a single-head view reads as
one head under either ``kv_layout`` hint (vLLM 0.33's ``[NB, 1, BS, C]``)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout.detection.indexers import drop_indexer_caches, is_indexer_cache
from kvlayout.registration.contiguity import stride_order


def _geometry(reg: kvlayout.Registration) -> list[tuple[object, ...]]:
    return [
        (g.format, g.layers, g.geometry.num_blocks, g.geometry.block_size, g.geometry.num_heads)
        for g in reg.kernel_groups
    ]


# The four registrations read silently wrong before: layer 1 is layer 0's memory layout with
# its size-1 dim elsewhere, and was read as what its own placement says.
SILENT_MISREADS = [
    # (layer 0, layer 1's shape, hints, what layer 0 reads: (format, blocks, block size, heads))
    ((1, 16, 576), (16, 1, 576), None, (F.NL_X_NB_BS_HS, 1, 16, 1)),  # a one-block MLA cache as 16 blocks
    ((2, 1, 16, 8, 128), (2, 16, 1, 8, 128), {"kv_layout": "NHD"}, (F.NL_X_TWO_NB_BS_NH_HS, 1, 16, 8)),
    ((2, 4, 16, 1, 128), (2, 4, 1, 16, 128), {"kv_layout": "NHD"}, (F.NL_X_TWO_NB_BS_NH_HS, 4, 16, 1)),
    ((1, 2, 16, 8, 128), (2, 1, 16, 8, 128), {"kv_layout": "NHD"}, (F.NL_X_NB_TWO_BS_NH_HS, 1, 16, 8)),
]


@pytest.mark.parametrize(("first", "moved", "hints", "reading"), SILENT_MISREADS)
def test_layers_laid_out_alike_read_as_layer_0_reads(
    first: tuple[int, ...],
    moved: tuple[int, ...],
    hints: dict[str, str] | None,
    reading: tuple[F, int, int, int],
) -> None:
    layers = [torch.zeros(first), torch.zeros(first).view(moved), torch.zeros(first)]
    fmt, nb, bs, nh = reading
    want = [(fmt, (0, 1, 2), nb, bs, nh)]
    assert _geometry(kvlayout.detect(layers, "vllm", hints)) == want
    assert _geometry(kvlayout.detect(layers, "vllm", hints, layer_groups=[[0, 1, 2]])) == want
    out, formats = kvlayout.normalize_and_discover_per_layer_formats(layers, None, "vllm", hints)
    views = [x for x in out if isinstance(x, torch.Tensor)]
    assert formats == [fmt] * 3 and [tuple(x.shape) for x in views] == [first] * 3
    assert views[1].data_ptr() == layers[1].data_ptr()  # a view, not a copy
    normalized_fmt, kv = kvlayout.normalize_kv_and_discover_format(layers, "vllm", hints)
    assert normalized_fmt == fmt and kvlayout.get_num_blocks(kv, fmt, 1) == nb


@settings(max_examples=60, deadline=None)
@given(
    st.booleans(),  # flash-attn [2, NB, ...] or flash-infer [NB, 2, ...]
    st.lists(st.sampled_from([1, 2, 3]), min_size=3, max_size=3),
    st.integers(2, 4),
    st.data(),
)
def test_size_1_dims_anywhere_read_as_layer_0(
    kv_first: bool, sizes: list[int], layers: int, data: st.DataObject
) -> None:
    nb, bs, nh = sizes
    shape = (2, nb, bs, nh, 4) if kv_first else (nb, 2, bs, nh, 4)
    big = [n for n in shape if n != 1]
    placements = sorted(
        {p for p in itertools.permutations([*big, *[1] * (5 - len(big))]) if [n for n in p if n != 1] == big}
    )
    kv = [torch.zeros(shape)]
    for _ in range(layers - 1):
        kv.append(torch.zeros(shape).view(data.draw(st.sampled_from(placements))))
    hints = {"kv_layout": "NHD"}
    alone = _geometry(kvlayout.detect([torch.zeros(shape)], "vllm", hints))[0]
    assert _geometry(kvlayout.detect(kv, "vllm", hints)) == [(alone[0], tuple(range(layers)), *alone[2:])]


def test_the_by_stride_placement_is_tried_before_refusing() -> None:
    pool = torch.zeros(1, 4, 2, 16, 8, 128)  # a one-block cross-layer pool [NB, NL, 2, BS, NH, HS]
    scrambled = pool.permute(1, 2, 0, 3, 4, 5)  # its NB dim handed over third: [4, 2, 1, 16, 8, 128]
    assert stride_order(scrambled.shape, scrambled.stride()) == [2, 0, 1, 3, 4, 5]
    reg = kvlayout.detect(scrambled, "vllm", {"kv_layout": "NHD"})
    assert reg.format == F.NB_NL_TWO_BS_NH_HS and reg.num_layers == 4
    assert (reg.kernel_groups[0].num_blocks, reg.kernel_groups[0].block_size) == (1, 16)
    # the caller's placement wins where it fits: a size-1 dim never moves axes on its own
    hnd = torch.zeros(2 * 8 * 3 * 8).as_strided((2, 8, 3, 1, 8), (192, 24, 8, 0, 1))
    fmt, kv = kvlayout.normalize_kv_and_discover_format([hnd], "vllm", {"kv_layout": "HND"})
    assert (fmt, kvlayout.get_block_size(kv, fmt)) == (F.NL_X_TWO_NB_NH_BS_HS, 1)


# -- single-head views ---------------------------------------------------------------------------


HINTS: list[dict[str, str] | None] = [None, {"kv_layout": "NHD"}, {"kv_layout": "HND"}]


@pytest.mark.parametrize("hints", HINTS, ids=lambda h: (h or {}).get("kv_layout", "no-hint"))
@pytest.mark.parametrize("one_head_stride", [576, 64 * 576], ids=["NHD-strided", "HND-strided"])
def test_single_head_views_read_one_head_under_every_hint(
    hints: dict[str, str] | None, one_head_stride: int
) -> None:
    """vLLM 0.33's ``[NB, 1, BS, C]`` view of an MLA layer: the head's stride is the row's
    (NHD allocation) or the block's (HND); both are one head of 64 tokens."""
    layers = [
        torch.zeros(4 * 64 * 576).as_strided((4, 1, 64, 576), (64 * 576, one_head_stride, 576, 1))
        for _ in range(2)
    ]
    (group,) = kvlayout.detect(layers, "vllm", hints).kernel_groups
    assert (group.num_blocks, group.block_size) == (4, 64)
    if hints is None:  # on the CPU without hints, one head is vLLM's CPU_ATTN's: whole pages
        assert group.opaque_pages is not None and "CPU_ATTN" in group.opaque_pages.layout
        return
    assert group.geometry.num_heads == 1
    assert group.format.name.endswith("_CS") and group.layout.is_hnd == (hints["kv_layout"] == "HND")


def test_size_hints_still_read_a_size_1_dim_as_the_tokens() -> None:
    """64 heads of one token a block, if the size hints say so (no engine registers it)."""
    hnd = torch.zeros(4, 64, 1, 576)  # [NB, NH, BS, CS]
    sizes = {"kv_layout": "HND", "num_kv_heads": 64, "tokens_per_block": 1}
    (group,) = kvlayout.detect([hnd], "vllm", sizes).kernel_groups
    assert (group.block_size, group.geometry.num_heads) == (1, 64)
    (group,) = kvlayout.detect([hnd], "vllm", {"kv_layout": "HND"}).kernel_groups
    assert (group.block_size, group.geometry.num_heads) == (64, 1)


@pytest.mark.parametrize("hints", HINTS, ids=lambda h: (h or {}).get("kv_layout", "no-hint"))
def test_single_head_indexer_caches_are_found_under_every_hint(hints: dict[str, str] | None) -> None:
    indexer = torch.zeros(4 * 64 * 132, dtype=torch.uint8).as_strided(
        (4, 1, 64, 132), (64 * 132, 132, 132, 1)
    )
    attention = torch.zeros(4, 1, 64, 576, dtype=torch.bfloat16)
    assert is_indexer_cache(indexer, "vllm", hints) and not is_indexer_cache(attention, "vllm", hints)
    kept = drop_indexer_caches({"attn": attention, "indexer": indexer}, "vllm", hints)
    assert list(kept) == ["attn"]
