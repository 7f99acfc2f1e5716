"""Block maps against the offset oracle: every pair of formats that hold the same data, any
TP split on either side, any two block sizes, random block ids and token counts.

The oracle places every element of the request on both sides from the layouts alone:
``algebra.offset`` on a sample of coordinates per example, and the generated C++ indexer
(``_native.locate_many``, which ``tests/transfer/test_native.py`` holds to ``algebra.offset``
on every coordinate of every format) for all of them. From those byte pairs it predicts
the destination after ``copy()`` (the request's slots hold the source's bytes, every other
byte is as it was) and counts the maximal runs by brute force.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout import _native
from kvlayout.layout.algebra import Coord, kv_size, num_heads, offset, sizes_by_role, with_size
from kvlayout.layout.ast import Layout
from kvlayout.layout.vocabulary import Role
from kvlayout.registration.registration import bind
from kvlayout.registration.shards import Shard
from kvlayout.transfer import (
    BlockMap,
    BlockMapError,
    PeerDescriptionError,
    RegistrationDescription,
    ShardError,
    block_map,
)
from kvlayout.transfer.block_maps import chunk_shape_for, chunk_side
from kvlayout.transfer.map_sides import _piece_starts
from tests.transfer.registrations import Registration, make_registration
from tests.transfer.test_native import native_sizes


def layout(fmt: F) -> Layout:
    return kvlayout.layout_of(fmt)


MHA = [f for f in F if layout(f).has_kv]  # format 19 (a sized K/V axis) with two planes
SINGLE = [F.NL_X_NB_BS_NH_HS, F.NB_KV_NL_BS_NH_HS]  # one K or V plane per tensor; 19 with one plane
MLA = [f for f in F if layout(f).is_mla and not layout(f).is_indexer]
TP = (1, 2, 4, 8)


@dataclass
class Side:
    fmt: F
    sizes: dict[str, int]
    reg: Registration
    kv: object  # the bound registration
    shard: Shard
    block_size: int
    pad: int

    @property
    def layout(self) -> Layout:
        return layout(self.fmt)

    @property
    def block_stride(self) -> int | None:
        return self.reg.leaves[0].stride(0) if self.pad else None


def make_side(
    fmt: F, *, layers: int, blocks: int, bs: int, heads: int, row: int, planes: int, kv: int, dtype: torch.dtype,
    pad: int, shard: Shard, seed: int,
) -> Side:  # fmt: skip
    lay = layout(fmt)
    by_role = {Role.LAYER: layers, Role.BLOCK: blocks, Role.TOKEN: bs, Role.HEAD: heads, Role.KV: kv}
    sizes = sizes_by_role(lay, by_role)
    if not lay.is_indexer:
        sizes.update(sizes_by_role(lay, {Role.ELEMENT: row // planes}))
    if planes > 1 or any(t.role is Role.ELEMENT for t in lay.lists):
        sizes["NP"] = planes
    pad = pad if lay.has_leading_block_axis else 0
    reg = make_registration(lay, sizes, dtype, pad=pad, seed=seed)
    return Side(fmt, sizes, reg, bind(reg.kv, fmt), shard, bs, pad)


def cp_holds(shard: Shard, p: np.ndarray) -> np.ndarray:
    """Whether a context-parallel rank holds request tokens ``p``: vLLM's
    ``ComputeSlotMappingKernel`` (``is_local``), over virtual blocks of ``BS * cp`` tokens."""
    held: np.ndarray = (p // shard.cp_interleave) % shard.cp_size == shard.cp_rank
    return held


def cp_block_slot(shard: Shard, bs: int, ids: list[int], p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Block and slot of request tokens ``p`` (held by the rank), by vLLM's slot mapping: the
    virtual block ``p // (bs * cp)``'s id, at ``(offset // (I * cp)) * I + offset % I``."""
    virtual, i, cp = bs * shard.cp_size, shard.cp_interleave, shard.cp_size
    offset_ = p % virtual
    block = np.array(ids, dtype=np.int64)[p // virtual] if len(p) else p
    return block, (offset_ // (i * cp)) * i + offset_ % i


def canonical(
    side: Side,
    tokens: int,
    ids: list[int],
    heads: range,
    first_token: int = 0,
    held: np.ndarray | None = None,
    per: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """(tensor index, byte address) of every byte of tokens ``[first_token, tokens)`` of the
    request on one side (only those in ``held``, where given), in the order (layer, K/V,
    token, model head, byte of the head's row). ``per``: ``ids`` are a scheduler's blocks of
    ``per`` of the cache's (kernel) pages: vLLM's slot mapping runs in the scheduler's blocks
    and its attention kernel reads slot ``s`` at page ``s // BS`` (``map_to_kernel_block_table``:
    block ``b`` is pages ``b * per + j``)."""
    lay, s = side.layout, side.sizes
    kvs = kv_size(lay, s)
    pair = 2 if lay.is_fused_packed else 1
    hs = lay.head_size(s) // pair
    first = side.shard.heads.start if lay.symbol_of(Role.HEAD) else 0
    nl = lay.size_of(s, Role.LAYER) or 1
    request = np.arange(first_token, tokens) if held is None else held
    grid = np.array(
        np.meshgrid(np.arange(nl), np.arange(kvs * pair), request, np.array(heads, dtype=np.int64), np.arange(hs),
                    indexing="ij"),
    ).reshape(5, -1)  # fmt: skip
    layer, k, p, h, e = grid
    block, slot = cp_block_slot(side.shard, side.block_size * per, ids, p)
    block, slot = block * per + slot // side.block_size, slot % side.block_size
    coords = np.stack([layer, k // pair, block, slot, h - first, (k % pair) * hs + e], axis=1)
    coords = np.ascontiguousarray(coords, dtype=np.int64)
    loc = _native.locate_many(int(side.fmt), native_sizes(lay, s), side.block_stride or 0, coords)
    for i in random.Random(len(coords)).sample(range(len(coords)), min(len(coords), 6)):  # the Python oracle
        c = Coord(*(int(x) for x in coords[i]))
        assert tuple(loc[i]) == offset(lay, c, s, side.block_stride), (side.fmt, c)
    itemsize = side.reg.leaves[0].element_size()
    ptr = loc[:, 0]
    starts = np.array([t.storage_offset() * itemsize for t in side.reg.leaves], dtype=np.int64)
    byte = starts[ptr] + loc[:, 1] * itemsize
    n = itemsize
    return np.repeat(ptr, n), (byte[:, None] + np.arange(n)[None, :]).ravel()


def first_alias(bases: list[torch.Tensor]) -> np.ndarray:
    """For each tensor, the index of the first that is the same tensor (itself, but for a
    layer that shares an earlier layer's KV cache)."""
    first: dict[int, int] = {}
    return np.array([first.setdefault(b.data_ptr(), k) for k, b in enumerate(bases)], dtype=np.int64)


def check_map(
    src: Side,
    dst: Side,
    src_ids: list[int],
    dst_ids: list[int],
    tokens: int,
    threads: int,
    first: int = 0,
    per: tuple[int, int] = (1, 1),
) -> None:
    """``per``: the ids are of blocks of that many of each side's pages (``canonical``)."""
    m = block_map(
        src.kv, dst.kv, src_ids, dst_ids, num_tokens=tokens, src_shard=src.shard, dst_shard=dst.shard,
        src_block_size=src.block_size * per[0], dst_block_size=dst.block_size * per[1], first_token=first,
    )  # fmt: skip
    if src.layout.symbol_of(Role.HEAD):
        a, b = src.shard.heads, dst.shard.heads
        heads = range(max(a.start, b.start), max(a.start, b.start, min(a.stop, b.stop)))
    else:
        heads = range(1)
    assert m.heads == heads
    p = np.arange(first, tokens)
    held = p[cp_holds(src.shard, p) & cp_holds(dst.shard, p)]  # context parallelism: the tokens both hold
    s_ptr, s_byte = canonical(src, tokens, src_ids, heads, first, held, per[0])
    d_ptr, d_byte = canonical(dst, tokens, dst_ids, heads, first, held, per[1])
    # A layer sharing an earlier layer's KV cache (its tensor registered again) reads as
    # that layer and is written as that layer: its destination bytes are not moved twice.
    s_first, d_first = first_alias(src.reg.bases), first_alias(dst.reg.bases)
    once = d_first[d_ptr] == d_ptr
    s_ptr, s_byte, d_ptr, d_byte = s_ptr[once], s_byte[once], d_ptr[once], d_byte[once]
    assert len(s_byte) == len(d_byte) == m.num_bytes
    before = [b.clone() for b in dst.reg.bases]
    m.copy(num_threads=threads)
    expected = [b.numpy().copy() for b in before]
    src_bytes = [b.numpy() for b in src.reg.bases]
    values = np.empty(len(s_byte), dtype=np.uint8)
    for t in np.unique(s_ptr):
        sel = s_ptr == t
        values[sel] = src_bytes[t][s_byte[sel]]
    for t in np.unique(d_ptr):
        sel = d_ptr == t
        expected[t][d_byte[sel]] = values[sel]
    for got, t in zip(dst.reg.bases, d_first, strict=True):
        assert np.array_equal(got.numpy(), expected[t])
    # The fewest runs: byte pairs in destination order, a run starting wherever the
    # previous destination byte is not the previous source byte's successor (or in another tensor).
    s_addr = np.array([b.data_ptr() for b in src.reg.bases], dtype=np.int64)[s_ptr] + s_byte
    d_addr = np.array([b.data_ptr() for b in dst.reg.bases], dtype=np.int64)[d_ptr] + d_byte
    order = np.argsort(d_addr, kind="stable")
    sa, da, st_, dt = s_addr[order], d_addr[order], s_first[s_ptr][order], d_ptr[order]
    cont = (da[1:] == da[:-1] + 1) & (sa[1:] == sa[:-1] + 1) & (st_[1:] == st_[:-1]) & (dt[1:] == dt[:-1])
    assert m.num_runs == (len(da) - int(cont.sum()) if len(da) else 0)
    # Each side alone (what a staged transfer posts there): stretches of its memory, in one tensor.
    for col, ptr, addr, ids in (
        (0, s_ptr, s_addr, src_ids[first // (src.block_size * per[0] * src.shard.cp_size) :]),  # it reads
        (1, d_ptr, d_addr, dst_ids[first // (dst.block_size * per[1] * dst.shard.cp_size) :]),  # it writes
    ):
        if len(set(ids)) < len(ids):
            assert m._side_runs(col) is None
            continue
        if col == 0 and len(set(d_first)) < len(d_first):
            assert m._side_runs(col) is None  # the destination's shared layers leave source layers unread
            continue
        if col == 0 and len(set(s_first)) < len(s_first):
            continue  # shared layers read the same bytes again: a stretch count of that side's memory is not this
        key = np.lexsort((addr, ptr))
        a, t = addr[key], ptr[key]
        assert m._side_runs(col) == (
            int(((a[1:] != a[:-1] + 1) | (t[1:] != t[:-1])).sum()) + 1 if len(a) else 0
        )
    one_by_one, _ = m._build_groups(force_sort=False, blocks_one_by_one=True)
    assert np.array_equal(m._groups, one_by_one)  # whole blocks: the groups of the general walk
    walked, walked_runs = m._build_groups(force_sort=False, slabs_one_by_one=True)
    assert walked_runs == m.num_runs  # slabs pasted from a pattern: the runs of walking each
    assert np.array_equal(_native.expand_groups(walked), m.runs)
    sorted_path = m._build(force_sort=True)
    key = np.lexsort((m.runs[:, 1],))
    assert np.array_equal(m.runs[key], sorted_path[np.lexsort((sorted_path[:, 1],))])


@st.composite
def shards(draw: st.DrawFn) -> tuple[int, Shard, Shard]:
    tp_src, tp_dst = draw(st.sampled_from(TP)), draw(st.sampled_from(TP))
    fits = [h for h in range(1, 17) if all(max(t, h) % min(t, h) == 0 for t in (tp_src, tp_dst))]
    heads = draw(st.sampled_from(fits))
    return (
        heads,
        Shard(draw(st.integers(0, tp_src - 1)), tp_src, heads),
        Shard(draw(st.integers(0, tp_dst - 1)), tp_dst, heads),
    )


@st.composite
def requests(draw: st.DrawFn, bs_src: int, bs_dst: int) -> tuple[int, int, int, list[int], list[int]]:
    tokens = draw(st.integers(0, 80))
    n_src, n_dst = -(-tokens // bs_src), -(-tokens // bs_dst)
    nb_src = max(n_src, 1) + draw(st.integers(0, 3))
    nb_dst = max(n_dst, 1) + draw(st.integers(0, 3))
    src_ids = draw(st.lists(st.integers(0, nb_src - 1), min_size=n_src, max_size=n_src))  # repeats allowed
    consecutive = draw(st.booleans())
    if consecutive:  # runs may merge across blocks
        start = draw(st.integers(0, nb_dst - n_dst))
        dst_ids = list(range(start, start + n_dst))
        src_ids = list(range(nb_src - n_src, nb_src)) if draw(st.booleans()) else src_ids
    else:
        dst_ids = draw(st.permutations(range(nb_dst)))[:n_dst]
    return tokens, nb_src, nb_dst, src_ids, list(dst_ids)


block_sizes = st.one_of(st.integers(1, 8), st.sampled_from([16, 24, 32, 48, 64]))


MHA_PAIRS = [(a, b, kv) for pool, kv in ((MHA, 2), (SINGLE, 1)) for a in pool for b in pool]
MLA_PAIRS = [(a, b) for a in MLA for b in MLA] + [(f, f) for f in (F.NL_X_NB_BSV_BSS, F.NL_X_NB_BSV4_BSS4)]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # formats 10 and 11
@pytest.mark.parametrize(
    ("fmt_src", "fmt_dst", "kv"), MHA_PAIRS, ids=[f"{a}-{b}-kv{k}" for a, b, k in MHA_PAIRS]
)
@settings(max_examples=3, deadline=None)
@given(st.data())
def test_mha_maps_move_every_request_byte_once_in_the_fewest_runs(
    fmt_src: F, fmt_dst: F, kv: int, data: st.DataObject
) -> None:
    _, src_shard, dst_shard = data.draw(shards())
    if kv == 1 and F.NB_KV_NL_BS_NH_HS in (fmt_src, fmt_dst):
        # one plane of one head is MAX's MLA, latents (test_max_mla_maps_...); K or V rows need heads
        assume(len(src_shard.heads) > 1 and len(dst_shard.heads) > 1)
    bs_src, bs_dst = data.draw(block_sizes), data.draw(block_sizes)
    tokens, nb_src, nb_dst, src_ids, dst_ids = data.draw(requests(bs_src, bs_dst))
    common: dict[str, Any] = dict(
        layers=data.draw(st.integers(1, 2)), row=data.draw(st.integers(1, 3)), planes=1,
        kv=kv, dtype=data.draw(st.sampled_from([torch.uint8, torch.bfloat16, torch.float32])),
    )  # fmt: skip
    src = make_side(fmt_src, blocks=nb_src, bs=bs_src, heads=len(src_shard.heads), pad=data.draw(st.integers(0, 2)),
                    shard=src_shard, seed=1, **common)  # fmt: skip
    dst = make_side(fmt_dst, blocks=nb_dst, bs=bs_dst, heads=len(dst_shard.heads), pad=data.draw(st.integers(0, 2)),
                    shard=dst_shard, seed=2, **common)  # fmt: skip
    assert num_heads(src.layout, src.sizes) == len(src_shard.heads)
    first = data.draw(st.one_of(st.just(0), st.integers(0, tokens)))  # a prefix the engine holds, or none
    check_map(src, dst, src_ids, dst_ids, tokens, data.draw(st.integers(1, 3)), first)


@pytest.mark.parametrize(
    ("fmt_src", "fmt_dst"),
    [(F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_BS_NH_HS), (F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_TWO_BS_NH_HS)],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_maps_of_scattered_kib_blocks_move_every_byte_in_lanes(fmt_src: F, fmt_dst: F, threads: int) -> None:
    """Blocks of 2 KiB a K or V slab, scattered on both sides, 640 KiB in all: the copy
    takes several runs at once (lanes), and leaves exactly the oracle's bytes."""
    rnd = random.Random(4)
    tokens, bs = 640, 8
    src_ids, dst_ids = rnd.sample(range(96), tokens // bs), rnd.sample(range(88), tokens // bs)
    common: dict[str, Any] = dict(layers=2, bs=bs, heads=4, row=32, planes=1, kv=2, dtype=torch.bfloat16, pad=0,
                                  shard=Shard(0, 1, 4))  # fmt: skip
    src = make_side(fmt_src, blocks=96, seed=1, **common)
    dst = make_side(fmt_dst, blocks=88, seed=2, **common)
    m = block_map(src.kv, dst.kv, src_ids, dst_ids, num_tokens=tokens)
    assert m.num_bytes == 2 * 2 * tokens * 4 * 32 * 2 and _native.lane_bytes(m.runs) == m.num_bytes
    check_map(src, dst, src_ids, dst_ids, tokens, threads)


@pytest.mark.parametrize("tokens", [1, 17, 33])
def test_a_partial_last_block_of_hnd_maps_each_head_apart(tokens: int) -> None:
    """HND on both sides, same block size: a full block's heads are one stretch, a partial
    last block's are one run a head (the walk's most emissions for the fewest tokens; the
    native builder sizes its table for them)."""
    shard = Shard(0, 1, 8)
    common: dict[str, Any] = dict(layers=2, row=2, planes=1, kv=2, dtype=torch.uint8, pad=0, shard=shard)
    src = make_side(F.NL_X_TWO_NB_NH_BS_HS, blocks=4, bs=16, heads=8, seed=1, **common)
    dst = make_side(F.NL_X_TWO_NB_NH_BS_HS, blocks=4, bs=16, heads=8, seed=2, **common)
    n = -(-tokens // 16)
    check_map(src, dst, [3, 1, 0][:n], [0, 2, 1][:n], tokens, 1)


@pytest.mark.parametrize(("fmt_src", "fmt_dst"), MLA_PAIRS, ids=[f"{a}-{b}" for a, b in MLA_PAIRS])
@settings(max_examples=8, deadline=None)
@given(st.data())
def test_mla_maps_move_every_request_byte_once_in_the_fewest_runs(
    fmt_src: F, fmt_dst: F, data: st.DataObject
) -> None:
    indexer = layout(fmt_src).is_indexer
    _, src_shard, dst_shard = data.draw(shards())  # latents: every rank holds them whole
    bs_src, bs_dst = data.draw(block_sizes), data.draw(block_sizes)
    tokens, nb_src, nb_dst, src_ids, dst_ids = data.draw(requests(bs_src, bs_dst))
    planes_src = data.draw(st.integers(1, 3)) if fmt_src == F.NL_X_NP_X_NB_BS_ONE_HS else 1
    planes_dst = data.draw(st.integers(1, 3)) if fmt_dst == F.NL_X_NP_X_NB_BS_ONE_HS else 1
    row = planes_src * planes_dst * data.draw(st.integers(1, 2))
    dtype = torch.uint8 if indexer else data.draw(st.sampled_from([torch.uint8, torch.float16]))
    layers = data.draw(st.integers(1, 2))
    src = make_side(fmt_src, layers=layers, blocks=nb_src, bs=bs_src, heads=1, row=row, planes=planes_src, kv=1,
                    dtype=dtype, pad=data.draw(st.integers(0, 2)), shard=src_shard, seed=3)  # fmt: skip
    dst = make_side(fmt_dst, layers=layers, blocks=nb_dst, bs=bs_dst, heads=1, row=row, planes=planes_dst, kv=1,
                    dtype=dtype, pad=data.draw(st.integers(0, 2)), shard=dst_shard, seed=4)  # fmt: skip
    first = data.draw(st.one_of(st.just(0), st.integers(0, tokens)))
    check_map(src, dst, src_ids, dst_ids, tokens, data.draw(st.integers(1, 3)), first)


# -- layers that share one KV cache (vLLM's cross-layer KV sharing) ----------------------------


def shared(side: Side, shares: dict[int, int]) -> Side:
    """``side`` as vLLM registers a model whose layer ``s`` reads layer ``t``'s KV cache:
    ``t``'s tensor registered again in ``s``'s place (a format with one tensor a layer)."""
    assert list(side.layout.list_shape(side.sizes)) == [len(side.reg.leaves)]
    leaves, bases = list(side.reg.leaves), list(side.reg.bases)
    for sharer, target in shares.items():
        leaves[sharer], bases[sharer] = leaves[target], bases[target]
    reg = Registration(list(leaves), leaves, bases)
    return replace(side, reg=reg, kv=bind(reg.kv, side.fmt))


SHARING = {  # (src format, TP), (dst format, TP), block sizes, the layers each side shares
    "both share, NHD": ((F.NL_X_TWO_NB_BS_NH_HS, 1), (F.NL_X_TWO_NB_BS_NH_HS, 1), (4, 4), {3: 1}, {3: 1}),
    "prefill shares, into HND TP 2 blocks of 8": (
        (F.NL_X_TWO_NB_BS_NH_HS, 1), (F.NL_X_TWO_NB_NH_BS_HS, 2), (4, 8), {2: 0, 3: 1}, {},
    ),
    "decode shares, from HND TP 2 blocks of 8": (
        (F.NL_X_TWO_NB_NH_BS_HS, 2), (F.NL_X_TWO_NB_BS_NH_HS, 1), (8, 4), {}, {2: 0, 3: 0},
    ),
    "MLA, both share": ((F.NL_X_NB_BS_HS, 1), (F.NL_X_NB_BS_HS, 1), (4, 16), {1: 0, 3: 2}, {1: 0, 3: 2}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(SHARING))
def test_layers_that_share_one_kv_cache_are_moved_once(case: str) -> None:
    """A layer registered with an earlier layer's tensor reads as that layer and is written
    as it: the destination's shared bytes take the target layer's KV, once (twice would be
    a run writing what another writes, which copy() refuses), and a description carries the
    sharing to a peer (the same address again) and maps alike."""
    (sf, s_tp), (df, d_tp), (s_bs, d_bs), s_shares, d_shares = SHARING[case]
    mla = layout(sf).is_mla
    shards = [Shard(0, tp, 4) for tp in (s_tp, d_tp)]
    sides = []
    for fmt, bs, shard, shares, seed in (
        (sf, s_bs, shards[0], s_shares, 1),
        (df, d_bs, shards[1], d_shares, 2),
    ):
        heads = 1 if mla else len(shard.heads)
        side = make_side(fmt, layers=4, blocks=6, bs=bs, heads=heads, row=8 if mla else 2, planes=1,
                         kv=1 if mla else 2, dtype=torch.bfloat16, pad=0, shard=shard, seed=seed)  # fmt: skip
        sides.append(shared(side, shares))
    src, dst = sides
    src_reg, dst_reg = cast(Any, src.kv), cast(Any, dst.kv)
    sharing = {layer: g[0] for g in dst_reg.kernel_groups[0].shared_layers for layer in g[1:]}
    assert sharing == d_shares  # detection reads the sharing as vLLM registers it
    tokens, src_ids, dst_ids = 16, [5, 0, 3, 1], [2, 4, 1, 0]
    src_ids, dst_ids = src_ids[: -(-tokens // s_bs)], dst_ids[: -(-tokens // d_bs)]
    kw: dict[str, Any] = dict(num_tokens=tokens, src_shard=src.shard, dst_shard=dst.shard)
    live = block_map(src.kv, dst.kv, src_ids, dst_ids, **kw)
    peers = [
        RegistrationDescription.from_json(reg.describe(shard=side.shard).to_json())
        for reg, side in ((src_reg, src), (dst_reg, dst))
    ]
    for a, b in ((peers[0], dst_reg), (src_reg, peers[1])):
        described = block_map(a, b, src_ids, dst_ids, **kw)
        assert np.array_equal(described.runs, live.runs)  # the same addresses: the same map
        assert described.fingerprint == live.fingerprint  # what the two halves of a request compare
    check_map(src, dst, src_ids, dst_ids, tokens, 1)


def test_a_shared_layer_is_described_at_its_target_address_wherever_it_is_placed() -> None:
    kv = [torch.empty(2, 8, 4, 2, 8, device="meta") for _ in range(4)]
    kv[3] = kv[1]
    reg = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
    plane = reg.describe(at=1 << 40).groups[0].planes[0]
    assert plane.addresses[3] == plane.addresses[1] and len(set(plane.addresses)) == 3
    assert plane.repeats == (3,)
    text = RegistrationDescription.from_json(reg.describe(at=1 << 40).to_json())
    assert text.groups[0].planes[0].repeats == (3,)


# -- block ids of blocks k times the cache's (vLLM's scheduler over kernel pages) ---------------


@pytest.mark.parametrize(("k_src", "k_dst", "tokens"), [(2, 1, 40), (1, 4, 40), (3, 2, 13), (2, 2, 64)])
def test_block_ids_in_blocks_k_times_the_cache_s_are_its_k_pages_in_order(
    k_src: int, k_dst: int, tokens: int
) -> None:
    """vLLM pages a hybrid model's cache for its attention kernel k times finer than its
    scheduler's blocks (the tensors say the kernel's); a connector holds the scheduler's
    block ids. Given the scheduler's block size, a map takes those ids: block ``b`` is the
    cache's blocks ``b*k .. b*k + k-1``, the last one only as far as the tokens go."""
    src, dst = vllm(2, 24, 4, 2, 8, layers=2), vllm(2, 24, 2, 8, 8, layers=2, fmt=F.NL_X_TWO_NB_NH_BS_HS)
    rng = np.random.default_rng(k_src * 10 + k_dst)
    src_ids = [int(b) for b in rng.permutation(24 // k_src)[: -(-tokens // (4 * k_src))]]
    dst_ids = [int(b) for b in rng.permutation(24 // k_dst)[: -(-tokens // (8 * k_dst))]]
    m = block_map(
        src, dst, src_ids, dst_ids, num_tokens=tokens, src_block_size=4 * k_src, dst_block_size=8 * k_dst
    )
    pages_src = [b * k_src + j for b in src_ids for j in range(k_src)][: -(-tokens // 4)]
    pages_dst = [b * k_dst + j for b in dst_ids for j in range(k_dst)][: -(-tokens // 8)]
    want = block_map(src, dst, pages_src, pages_dst, num_tokens=tokens)
    assert np.array_equal(m.runs, want.runs) and m.num_bytes == tokens * 2 * 2 * 2 * 8 * 4
    default = block_map(src, dst, src_ids, dst_ids, src_block_size=4 * k_src, dst_block_size=8 * k_dst)
    assert default.num_tokens == min(len(src_ids) * 4 * k_src, len(dst_ids) * 8 * k_dst)


@pytest.mark.parametrize(
    ("kw", "ids", "message"),
    [
        (
            {"src_block_size": 6},
            ([0, 1], [0]),
            "src_block_size=6, but the src cache's blocks hold 4 tokens: give",
        ),
        ({"dst_block_size": 4}, ([0, 1], [0]), "dst_block_size=4, but the dst cache's blocks hold 8 tokens"),
        ({"src_block_size": 8}, ([12], [0]), "src_blocks[0] = 12 is out of range for 12 blocks"),
        ({"dst_block_size": 16}, (list(range(8)), [1, 1]), "dst_blocks[1] = 1 repeats dst_blocks[0]"),
        (
            {"src_block_size": 8},
            ([0, 1, 2], [0]),
            "src_blocks has 3 block ids; the request's 8 tokens (num_tokens) fill 1 block of 8",
        ),
    ],
)
def test_block_sizes_that_are_not_the_cache_s_or_a_multiple_are_refused(
    kw: dict[str, Any], ids: tuple[list[int], list[int]], message: str
) -> None:
    src, dst = vllm(2, 24, 4, 2, 8), vllm(2, 24, 8, 2, 8)
    tokens = 8 if "src_block_size" in kw and kw["src_block_size"] == 8 else None
    with pytest.raises(BlockMapError) as info:
        block_map(src, dst, *ids, num_tokens=tokens, **kw)
    assert message in str(info.value)


def test_a_description_in_other_blocks_than_the_cache_s_is_refused() -> None:
    """describe(block_size=) splits a folded page axis; for a cache with a block axis a
    different size was ignored, and a peer told it would read its block ids wrongly."""
    reg = vllm(2, 24, 4, 2, 8)
    assert reg.describe(block_size=4).groups[0].block_size == 4  # its own: accepted
    with pytest.raises(
        PeerDescriptionError, match=r"^block_size=8, but NL_X_TWO_NB_BS_NH_HS's blocks hold 4 tokens"
    ):
        reg.describe(block_size=8)
    with pytest.raises(
        PeerDescriptionError,
        match=re.escape("give block_map's src_block_size=/dst_block_size=8 to address it in blocks of 8"),
    ):
        reg.describe(block_size=8)
    with pytest.raises(PeerDescriptionError, match=re.escape("(block_map's src_block_size=/dst_block_size=a "
                                                             "multiple of 4), never less")):  # fmt: skip
        reg.describe(block_size=2)  # the advice block_map then takes
    with pytest.raises(TypeError, match=r"^block_size must be an int, not bool \(True\)$"):
        vllm(2, 24, 1, 2, 8).describe(block_size=True)  # blocks of 1 token: True == 1 passed


def test_a_peer_s_folded_pages_in_blocks_that_do_not_divide_them_are_refused() -> None:
    sglang = kvlayout.detect([torch.randn(24, 1, 8) for _ in range(2)], "sglang")
    data = json.loads(sglang.describe(block_size=4).to_json())
    assert RegistrationDescription.from_json(json.dumps(data)).groups[0].block_size == 4
    data["groups"][0]["block_size"] = 5
    with pytest.raises(
        PeerDescriptionError,
        match=r"^description\.groups\[0\]: NL_X_NBBS_ONE_HS: PBS=24 token slots are not divisible by "
        r"block_size=5, so they are not a whole number of blocks$",
    ):
        RegistrationDescription.from_json(json.dumps(data))


# -- chunks: store_blocks and load_blocks are maps too -----------------------------------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("fmt", list(F), ids=lambda f: f.name)
def test_a_chunk_is_a_side_and_its_maps_are_store_and_load(fmt: F) -> None:
    from kvlayout.testing.strategies import fixed_sizes
    from kvlayout.transfer import prepare
    from kvlayout.transfer.block_maps import chunk_side

    lay = layout(fmt)
    sizes = with_size(lay, fixed_sizes(lay), Role.BLOCK, 6)
    reg = make_registration(
        lay, sizes, torch.uint8 if lay.is_indexer else torch.float16, pad=int(lay.has_leading_block_axis)
    )
    group = bind(reg.kv, fmt).only_group()
    bs = 2 if lay.is_pbs_fused else None
    plan = prepare(group, fmt, block_size=bs)
    ids = [4, 1, 2]
    shape, dtype = plan.chunk_shape(3 * plan.block_size)
    by_plan, by_map = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    plan.store_blocks(ids, [by_plan])
    m = block_map(group, chunk_side(group, by_map, block_size=bs), ids, [0], src_block_size=bs)
    assert m.kind == "chunk"
    m.copy()
    assert torch.equal(by_plan.view(torch.uint8), by_map.view(torch.uint8))
    for b in reg.bases:
        b.zero_()
    plan.load_blocks(ids, [by_plan])
    loaded = [b.clone() for b in reg.bases]
    for b in reg.bases:
        b.zero_()
    block_map(chunk_side(group, by_map, block_size=bs), group, [0], ids, dst_block_size=bs).copy()
    assert all(torch.equal(a, b) for a, b in zip(loaded, reg.bases, strict=True))


# -- kinds, and what is refused ------------------------------------------------------------------


def vllm(
    *shape: int, dtype: torch.dtype = torch.float32, layers: int = 2, fmt: F = F.NL_X_TWO_NB_BS_NH_HS
) -> Any:
    return bind([torch.zeros(shape, dtype=dtype) for _ in range(layers)], fmt)


def test_fp8_moves_to_and_from_the_uint8_it_is_stored_as() -> None:
    """vLLM and SGLang register fp8 caches as uint8 (their kernels view the bytes as fp8);
    another engine's fp8 cache holds the same bytes, so the pair maps: bytes as they are."""
    stored = [torch.randint(0, 256, (2, 8, 4, 2, 16), dtype=torch.uint8) for _ in range(2)]
    fp8 = [torch.zeros(2, 8, 2, 4, 16, dtype=torch.float8_e4m3fn) for _ in range(2)]
    src, dst = bind(stored, F.NL_X_TWO_NB_BS_NH_HS), bind(fp8, F.NL_X_TWO_NB_NH_BS_HS)
    m = block_map(src, dst, [1, 5], [6, 2])
    assert m.kind == "permuted" and m.reason.endswith(
        "; src stores uint8 and dst float8_e4m3fn: the bytes move as they are"
    )
    m.copy()
    for s, d in zip(stored, fp8, strict=True):  # HND: [2, NB, NH, BS, HS]
        got = d.view(torch.uint8)[:, [6, 2]].transpose(2, 3)
        assert torch.equal(got, s[:, [1, 5]])
    back = block_map(dst, src, [6, 2], [3, 0])
    assert back.kind == "permuted" and "src stores float8_e4m3fn and dst uint8" in back.reason
    with pytest.raises(
        BlockMapError, match="src is float8_e4m3fn and dst is float8_e5m2: a map copies bytes"
    ):
        block_map(dst, vllm(2, 8, 4, 2, 16, dtype=torch.float8_e5m2), [1], [2])  # two encodings
    with pytest.raises(BlockMapError, match="src is uint8 and dst is int8"):
        block_map(src, vllm(2, 8, 4, 2, 16, dtype=torch.int8), [1], [2])
    # a chunk pairs as a cache does: the fp8 cache's bytes into a uint8 chunk (it was refused)
    from kvlayout.transfer.block_maps import chunk_side

    chunk = torch.zeros(2, 2, 4, 2 * 16, dtype=torch.uint8)  # [kv_size, layers, tokens, row]
    block_map(dst, chunk_side(dst, chunk), [6], [0]).copy()
    assert torch.equal(
        chunk[0, 1, 0].view(2, 16), fp8[1][0, 6, :, 0].view(torch.uint8)
    )  # layer 1, K, token 0
    with pytest.raises(BlockMapError, match=r"the chunk is torch.int8; the cache is float8_e4m3fn"):
        chunk_side(dst, chunk.view(torch.int8))
    with pytest.raises(TypeError, match=r"^chunk must be a tensor, not list$"):
        chunk_side(dst, [chunk])  # type: ignore[arg-type]
    # the dtype first: the shape check would ask for a row size counted in the wrong elements
    with pytest.raises(
        BlockMapError, match=r"^the chunk is torch.float32; the cache is float8_e4m3fn: they must"
    ):
        chunk_side(dst, torch.zeros(chunk.shape, dtype=torch.float32))


@pytest.mark.parametrize("size", [0, -4, 4.0, True, "4"])
def test_chunk_side_refuses_a_block_size_that_is_none(size: object) -> None:
    """A cache of blocks of its own never reads chunk_side's block_size, which was then
    taken as it came (0, a float, a string): refused as block_map refuses it."""
    from kvlayout.transfer.block_maps import chunk_side

    group = vllm(2, 8, 4, 2, 16)
    chunk = torch.zeros(2, 2, 4, 2 * 16)  # [kv_size, layers, tokens, row]
    with pytest.raises(BlockMapError, match=r"^chunk_side: block_size must be None or a positive int, got "):
        chunk_side(group, chunk, block_size=size)  # type: ignore[arg-type]
    side = chunk_side(group, chunk, block_size=np.int64(8))  # type: ignore[arg-type]
    assert side.block_size == 4  # a block size the caller counts in (a NumPy int too): fine


def test_a_chunk_shorter_than_the_request_says_so() -> None:
    """A chunk is one block of its tokens: one too short for num_tokens was reported as a
    block list too short, naming blocks of the chunk's length the caller never gave."""
    from kvlayout.transfer.block_maps import chunk_side

    group = vllm(2, 8, 4, 2, 16)
    short = chunk_side(group, torch.zeros(2, 2, 5, 2 * 16))  # [kv_size, layers, tokens, row]
    with pytest.raises(
        BlockMapError,
        match=r"^the chunk \(dst\) holds 5 tokens, fewer than the request's 7 \(num_tokens\): give it a "
        r"token axis of 7 or more$",
    ):
        block_map(group, short, [3, 1], [0], num_tokens=7)
    with pytest.raises(
        BlockMapError, match=r"^the chunk \(src\) holds 5 tokens, fewer than the request's 7 "
    ):
        block_map(short, group, [0], [3, 1], num_tokens=7)
    assert block_map(group, short, [3, 1], [0], num_tokens=5).num_tokens == 5  # it holds 5


def test_a_chunks_block_list_is_zero() -> None:
    """A chunk is one block of its tokens, ``[0]``: a block id or count meant as the cache's
    blocks (the chunk's tokens taken for several blocks of the cache's size) said only
    "out of range for 1 blocks" or "fill 1 block of 8", not what the chunk's list is."""
    from kvlayout.transfer.block_maps import chunk_side

    group = vllm(2, 8, 4, 2, 16)  # blocks of 4 tokens
    chunk = chunk_side(group, torch.zeros(2, 2, 8, 2 * 16))  # [kv_size, layers, tokens, row]
    one = r"the chunk \(dst\) is one block, of its 8 tokens: give \[0\]$"
    with pytest.raises(BlockMapError, match=r"^dst_blocks\[0\] = 1, but " + one):
        block_map(group, chunk, [3, 1], [1])
    with pytest.raises(
        BlockMapError, match=r"^dst_blocks has 2 block ids; the request's 8 tokens .*: " + one
    ):
        block_map(group, chunk, [3, 1], [0, 1], num_tokens=8)
    with pytest.raises(BlockMapError, match=r"^src_blocks\[0\] = 2, but the chunk \(src\) is one block"):
        block_map(chunk, group, [2], [3, 1])
    assert block_map(chunk, group, [0], [3, 1]).num_tokens == 8


def test_chunk_side_refuses_a_block_size_the_cache_does_not_count_in() -> None:
    """A block size neither the cache's nor a multiple of it is an error in block_map; in
    chunk_side and chunk_shape_for, for a cache of blocks of its own, it was ignored
    (block_size=6 over blocks of 4 read as blocks of 4)."""
    from kvlayout.transfer.block_maps import chunk_shape_for, chunk_side

    group = vllm(2, 8, 4, 2, 16)  # blocks of 4 tokens
    chunk = torch.zeros(2, 2, 8, 2 * 16)
    told = r"block_size=6, but the cache's blocks hold 4 tokens: give its block size or a multiple of it"
    with pytest.raises(BlockMapError, match=r"^chunk_side: " + told):
        chunk_side(group, chunk, block_size=6)
    with pytest.raises(BlockMapError, match=r"^chunk_shape_for: " + told):
        chunk_shape_for(group, 8, block_size=6)
    assert chunk_shape_for(group, 8, block_size=8) == chunk_shape_for(group, 8)  # a multiple: fine


def test_chunk_shape_for_is_the_shape_chunk_side_takes() -> None:
    from kvlayout.transfer.block_maps import chunk_shape_for, chunk_side

    for group, shape in [
        (vllm(2, 8, 4, 2, 16), (2, 2, 7, 32)),  # K and V apart: kv_size 2, a row of 2 heads
        (vllm(8, 4, 2, 32, fmt=F.NL_X_NB_BS_NH_CS), (1, 2, 7, 64)),  # packed K | V: kv_size 1
    ]:
        assert chunk_shape_for(group, 7) == (shape, torch.float32)
        assert chunk_shape_for(group, np.int64(7)) == (shape, torch.float32)  # type: ignore[arg-type]
        side = chunk_side(group, torch.zeros(shape))
        assert block_map(group, side, [3, 1], [0], num_tokens=7).num_tokens == 7
    for bad in (0, -3, 2.5, True, "7"):
        with pytest.raises(BlockMapError, match=r"^num_tokens must be a positive int, got "):
            chunk_shape_for(vllm(2, 8, 4, 2, 16), bad)  # type: ignore[arg-type]
    with pytest.raises(BlockMapError, match=r"^chunk_shape_for: block_size must be None or a positive int"):
        chunk_shape_for(vllm(2, 8, 4, 2, 16), 7, block_size=0)


def test_a_repeated_destination_block_names_first_token() -> None:
    """vLLM hands a sliding window's dropped blocks as its null block, repeated: a load into
    them is refused, and the message says what serves it (first_token past them)."""
    group = vllm(2, 8, 4, 2, 16)
    chunk = torch.zeros(2, 2, 12, 2 * 16)  # [kv_size, layers, tokens, row]
    from kvlayout.transfer.block_maps import chunk_side

    with pytest.raises(BlockMapError) as info:
        block_map(chunk_side(group, chunk), group, [0], [0, 0, 5])
    assert str(info.value) == (
        "dst_blocks[1] = 0 repeats dst_blocks[0]: each destination slot is written once (blocks wholly before "
        "first_token are not written, and may repeat, as an engine's null block for a sliding window's dropped "
        "blocks does); if dst_blocks[:2] (block 0, repeated) are blocks the request no longer holds, as a "
        "sliding window's dropped blocks, pass first_token=8"
    )
    assert block_map(chunk_side(group, chunk), group, [0], [0, 0, 5], first_token=8).num_bytes > 0
    # No first_token serves a block repeated past the leading ones, or one block throughout: no advice.
    for dst in ([0, 5, 0], [7, 0, 0], [0, 0, 0]):
        with pytest.raises(BlockMapError) as info:
            block_map(chunk_side(group, chunk), group, [0], dst)
        assert "pass first_token" not in str(info.value)
    with pytest.raises(BlockMapError, match=r"holds tokens before it, which a map never writes$"):
        block_map(chunk_side(group, chunk), group, [0], [0, 5, 0], first_token=4)


def test_kinds_say_what_differs() -> None:
    nhd, hnd = vllm(2, 8, 4, 4, 8), vllm(2, 8, 4, 4, 8, fmt=F.NL_X_TWO_NB_NH_BS_HS)
    assert block_map(nhd, vllm(2, 8, 4, 4, 8), [0], [1]).kind == "same layout"
    m = block_map(nhd, vllm(2, 8, 8, 2, 8), [0, 1], [3], dst_shard=Shard(1, 2, 4))
    assert m.kind == "head slice, re-blocked"
    assert (
        m.reason
        == "src holds heads 0-3 and dst 2-3, so the map moves heads 2-3; blocks of 4 tokens into blocks of 8"
    )
    m = block_map(nhd, hnd, [0], [1])
    assert (m.kind, m.reason) == (
        "permuted",
        "NHD (tokens outside heads) into HND (heads outside tokens) within a block",
    )
    one = block_map(vllm(2, 8, 4, 1, 8), vllm(2, 8, 1, 4, 8, fmt=F.NL_X_TWO_NB_NH_BS_HS), [0], [1])
    assert one.kind == "re-laid" and one.num_runs == 4  # one head: NHD and HND blocks hold the same bytes
    cut = [(torch.zeros(2, 4, 1, 512), torch.zeros(2, 4, 1, 64))]
    recut = [(torch.zeros(2, 4, 1, 448), torch.zeros(2, 4, 1, 128))]
    m = block_map(bind(cut, F.NL_X_NP_X_NB_BS_ONE_HS), bind(recut, F.NL_X_NP_X_NB_BS_ONE_HS), [0], [1])
    assert (m.kind, m.reason) == ("re-laid", "rows cut into pieces at bytes [2048] and [1792]: other planes")
    m = block_map(nhd, vllm(2, 8, 4, 4, 8), [0], [1], src_shard=Shard(1, 2, 8), dst_shard=Shard(0, 2, 8))
    assert (m.kind, m.num_runs, m.num_bytes, m.heads) == ("empty", 0, 0, range(4, 4))
    assert m.reason == "src holds model heads 4-7 and dst 0-3: none in common"
    assert m.copy() == 0


def test_replicated_heads_map_the_one_head_both_hold() -> None:
    """8 ranks over 2 heads: ranks 0-3 hold head 0, ranks 4-7 head 1."""
    src = bind([torch.arange(2 * 4 * 2 * 2 * 4, dtype=torch.float32).view(2, 4, 2, 2, 4)], 1)
    dst = vllm(2, 4, 2, 1, 4, layers=1)
    m = block_map(src, dst, [1], [3], dst_shard=Shard(5, 8, 2))
    assert m.heads == range(1, 2) and m.kind == "head slice"
    m.copy()
    assert torch.equal(dst.kv[0][:, 3, :, 0], src.kv[0][:, 1, :, 1])


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 6, 8, 12, 16])
def test_each_destination_head_is_sent_by_one_source_replica(heads: int) -> None:
    """Where several source ranks hold a head, every one of them mapped it to each
    destination rank: the plan sent (and wrote) the same bytes once per replica. Now one
    replica sends each, and where there are as many (rank, head) pairs to send as source
    ranks, every source rank sends some."""
    for src_tp, dst_tp in itertools.product([1, 2, 3, 4, 6, 8, 12, 16, 32], repeat=2):
        if max(src_tp, heads) % min(src_tp, heads) or max(dst_tp, heads) % min(dst_tp, heads):
            continue  # no TP split of these heads
        srcs = [Shard(r, src_tp, heads) for r in range(src_tp)]
        load = [0] * src_tp
        for d in range(dst_tp):
            dst = Shard(d, dst_tp, heads)
            for h in dst.heads:
                senders = [s.tp_rank for s in srcs if h in s.heads and s.sends_to(dst)]
                assert len(senders) == 1, (h, dst, senders)
                load[senders[0]] += 1
        if sum(load) >= src_tp:
            assert min(load) >= 1, (src_tp, dst_tp, load)


def test_a_replica_that_does_not_send_is_told() -> None:
    """MLA at TP 4 into TP 2: the latents are one head every rank holds."""
    assert [[Shard(r, 4, 1).sends_to(Shard(d, 2, 1)) for r in range(4)] for d in range(2)] == [
        [True, False, False, False],
        [False, False, True, False],  # vLLM's rule: decode rank d reads from prefill rank d * 4 // 2
    ]
    with pytest.raises(ShardError, match=r"count 8 and 4 model KV heads: one model has one count"):
        Shard(0, 2, 8).sends_to(Shard(0, 2, 4))
    with pytest.raises(TypeError, match=r"sends_to takes the destination's Shard, not int"):
        Shard(0, 2, 8).sends_to(1)  # type: ignore[arg-type]


def test_moving_blocks_within_one_cache() -> None:
    reg = bind([torch.randn(2, 8, 4, 4, 8) for _ in range(2)], 1)
    want = [t[:, [0, 1]].clone() for t in reg.kv]
    block_map(reg, reg, [0, 1], [4, 5]).copy()
    assert all(torch.equal(t[:, [4, 5]], w) for t, w in zip(reg.kv, want, strict=True))
    before = [t.clone() for t in reg.kv]
    with pytest.raises(BlockMapError, match=r"run 0 \(source 0x[0-9a-f]+, destination 0x[0-9a-f]+, 1024 bytes\) "
                       r"is refused: its source and destination overlap; nothing was copied"):  # fmt: skip
        block_map(reg, reg, [0, 1], [1, 2]).copy()
    with pytest.raises(
        BlockMapError, match=r"it writes bytes run \d+ reads \(source and destination share memory\)"
    ):
        block_map(reg, reg, [0, 2], [3, 0]).copy()
    assert all(torch.equal(a, b) for a, b in zip(before, reg.kv, strict=True))


BAD_MAPS = [
    (lambda a: block_map(a, vllm(2, 8, 4, 4, 8, dtype=torch.float16), [0], [0]),
     BlockMapError, "src is float32 and dst is float16: a map copies bytes, dtypes must agree"),
    (lambda a: block_map(a, bind([torch.zeros(8, 4, 32) for _ in range(2)], 3), [0], [0]),
     BlockMapError, "src holds K and V rows per head (MHA) and dst one latent row per token (MLA): they do not hold "
     "the same data"),
    (lambda a: block_map(a, vllm(2, 8, 4, 4, 8, layers=3), [0], [0]),
     BlockMapError, "src holds layers 0-1 and dst layers 0-2; a map moves layer i to layer i"),
    (lambda a: block_map(a, vllm(2, 8, 4, 4, 4), [0], [0]),
     BlockMapError, "src rows are 32 bytes a head and dst rows 16"),
    (lambda a: block_map(a, vllm(2, 8, 4, 4, 8), [0], [0], src_shard=Shard(0, 4, 8)),
     ShardError, "src_shard Shard(tp_rank=0, tp_size=4, num_kv_heads=8) holds 2 KV heads, but the src cache has 4"),
    (lambda a: block_map(a, vllm(2, 8, 4, 4, 8), [0], [0], dst_shard=Shard(0, 2, 8)),
     ShardError, "src_shard Shard(tp_rank=0, tp_size=1, num_kv_heads=4) and dst_shard Shard(tp_rank=0, tp_size=2, "
     "num_kv_heads=8) disagree on the model's KV heads (a shard not given is TP 1 over the cache's own heads): give "
     "both sides' Shard(tp_rank, tp_size, num_kv_heads), num_kv_heads the whole model's"),
    (lambda a: block_map(a, a, [0], [0], src_shard=(0, 1, 4)),  # type: ignore[arg-type]
     TypeError, "src_shard must be a kvlayout.transfer.Shard, not tuple"),
    (lambda a: Shard(2, 2, 8), ShardError, "Shard.tp_rank=2 is out of range for tp_size=2"),
    (lambda a: Shard(0, 3, 8), ShardError, "tp_size=3 and num_kv_heads=8: the larger must be a multiple of the smaller "
     "(engines split KV heads evenly"),
    (lambda a: Shard(0, 2, True), ShardError, "Shard.num_kv_heads must be an int, got True"),
    (lambda a: Shard(0, 2, 8.0), ShardError, "Shard.num_kv_heads must be an int, got 8.0"),  # type: ignore[arg-type]
    (lambda a: a.describe().group(True), TypeError, "group index must be an int, not bool (True)"),
    (lambda a: a.describe().group("0"), TypeError, "group index must be an int, not str ('0')"),
    (lambda a: a.describe().group(1), PeerDescriptionError, "group 1 is out of range for 1 kernel groups"),
    (lambda a: a.describe(block_size=0), PeerDescriptionError, "describe(block_size=0): a block holds at least 1"),
    (lambda a: a.describe(at=0), PeerDescriptionError, "at must be a positive address below 2**57, got 0"),
    (lambda a: a.describe(shard=(0, 1, 4)), TypeError, "shard must be a kvlayout.transfer.Shard, not tuple"),
    (lambda a: block_map(a, a, [0, 8], [2, 3]), BlockMapError, "src_blocks[1] = 8 is out of range for 8 blocks"),
    (lambda a: block_map(a, a, [0, 1], [3, 3]), BlockMapError, "dst_blocks[1] = 3 repeats dst_blocks[0]"),
    (lambda a: block_map(a, a, [0, 1], [2]), BlockMapError,
     "src_blocks has 2 block ids; the request's 4 tokens (what the shorter block list holds) fill 1 block of 4"),
    (lambda a: block_map(a, a, [0, 1], [2, 3], num_tokens=9), BlockMapError,
     "src_blocks has 2 block ids; the request's 9 tokens (num_tokens) fill 3 blocks of 4"),
    (lambda a: block_map(a, a, [0.0], [1.0]), BlockMapError, "src_blocks must be a 1-D sequence of ints, got float64"),
    (lambda a: block_map(a, a, [0], [1], src_block_size=0), BlockMapError, "src_block_size must be a positive int, got 0"),
    (lambda a: block_map(a, a, [0], [1], num_tokens=-1), BlockMapError, "num_tokens must be >= 0, got -1"),
    # a bool is no block id (True would read as block 1)
    (lambda a: block_map(a, a, torch.tensor([True]), [1]), BlockMapError, "src_blocks must be integers, got torch.bool"),
    # ints NumPy promotes to float64 (uint64 with a negative one) are read exactly, a negative one named so
    (lambda a: block_map(a, a, [np.uint64(1), -1], [1, 2]), BlockMapError, "src_blocks[1] = -1 is negative"),
    (lambda a: block_map(a, a, [[0]], [[1]]), BlockMapError, "src_blocks must be a 1-D sequence of ints, got shape [1, 1]"),
    (lambda a: block_map(a, a, torch.tensor([0], device="meta"), [1]), BlockMapError,
     "src_blocks must hold values (a list, array or dense tensor)"),
    (lambda a: block_map(a, a, [0], torch.tensor([2**63 + 1], dtype=torch.uint64)), BlockMapError,
     "dst_blocks[0] = 9223372036854775809 is out of range for any cache (above 2**63 - 1)"),
    (lambda a: block_map(a, [torch.zeros(3)], [0], [1]), TypeError, "dst is a list; block_map takes what detection returns"),
    (lambda a: block_map(a, a.describe().groups[0], [0], [1]), TypeError,
     "(a peer's kernel group is description.group(i), a description of its own)"),
    (lambda a: block_map(a, bind([[torch.zeros(32, 4, 8) for _ in range(2)] for _ in range(2)], 4), [0], [0]),
     BlockMapError, "dst: TWO_X_NL_X_NBBS_NH_HS folds its blocks and their tokens into one axis (NBBS): pass its "
     "block size"),
    (lambda a: block_map(a, a, [0], [1]).copy(num_threads=0), BlockMapError, "num_threads must be a positive int"),
    # a live folded cache given a block size that does not divide it: the caller's argument, not a peer's lie
    (lambda a: block_map(kvlayout.detect([torch.randn(21, 1, 8) for _ in range(2)], "sglang"), a, [0], [1],
                         src_block_size=4),
     BlockMapError, "src: NL_X_NBBS_ONE_HS: PBS=21 token slots are not divisible by block_size=4"),
    # a dtype detection takes but no description carries: said of the cache, not of a "description"
    (lambda a: block_map(kvlayout.detect([torch.zeros(2, 8, 4, 2, 8, dtype=torch.complex64) for _ in range(2)],
                                         "vllm", {"kv_layout": "NHD"}), a, [0], [1]),
     BlockMapError, "src: the cache's tensors are complex64: block maps and descriptions carry bfloat16, "),
]  # fmt: skip


@pytest.mark.parametrize(("make", "error", "message"), BAD_MAPS, ids=[m[:48] for _, _, m in BAD_MAPS])
def test_what_a_map_refuses(make: Any, error: type[Exception], message: str) -> None:
    src = vllm(2, 8, 4, 4, 8)
    with pytest.raises(error) as info:
        make(src)
    assert message in str(info.value)


def test_a_tampered_map_is_refused_before_a_byte_moves() -> None:
    """copy() checks the runs themselves (read back from the map's groups), not how they
    were made."""
    src, dst = vllm(2, 8, 4, 4, 8), vllm(2, 8, 4, 4, 8)
    torch.nn.init.normal_(src.kv[0])
    m = block_map(src, dst, [0, 1], [2, 3])
    good = m.runs.copy()
    end = dst.kv[0].data_ptr() + dst.kv[0].numel() * 4  # one past layer 0's tensor
    cases = {
        "run 1 .* its source bytes are outside every source tensor's blocks": [8, good[1, 1], 512],
        "run 1 .* its destination bytes are outside every destination tensor's blocks": [
            good[1, 0],
            end - 4,
            8,
        ],
        "run 0 .* its destination bytes overlap those of run 1": [good[1, 0], good[0, 1] + 4, 4],
        "run 1 .* it has no bytes": [good[1, 0], good[1, 1], 0],
    }
    for message, row in cases.items():
        runs = good.copy()
        runs[1] = row
        m._groups = _native.group_runs(runs)
        with pytest.raises(BlockMapError, match=message):
            m.copy()
    assert all(not t.any() for t in dst.kv)


def test_groups_a_map_is_given_after_its_first_copy_are_validated_before_a_byte_moves() -> None:
    """The first copy() keeps the groups it validated (a copy of its own, which nothing
    changes after); other groups given to the map after are validated in turn, and the
    same groups changed in place are never read again."""
    src, dst = vllm(2, 8, 4, 4, 8), vllm(2, 8, 4, 4, 8)
    torch.nn.init.normal_(src.kv[0])
    m = block_map(src, dst, [0, 1], [2, 3])
    m.copy()
    good = m.runs.copy()
    for t in dst.kv:
        t.zero_()
    runs = good.copy()
    runs[1] = [8, good[1, 1], 512]
    m._groups = _native.group_runs(runs)
    with pytest.raises(
        BlockMapError, match=r"run 1 .* its source bytes are outside every source tensor's blocks"
    ):
        m.copy()
    assert all(not t.any() for t in dst.kv)
    m._groups = _native.group_runs(good)
    m.copy()
    m._groups[:, 1] = 8  # in place: the copy reads the groups it validated
    m.copy()
    assert torch.equal(dst.kv[0][:, 2:4], src.kv[0][:, 0:2])


@pytest.mark.parametrize("earlier_copies", [0, 1])
def test_a_map_s_thread_count_is_read_alike_on_its_first_and_later_copies(earlier_copies: int) -> None:
    """copy()'s num_threads, on a map's first copy and on later ones (which take a shorter
    path once the first has kept what they check): a bool, a float or a count below 1 is
    refused naming it, a count past the worker pool's size is capped to it (2**31 and
    past included), a NumPy or torch integer is read as its value; each copy lands."""
    from kvlayout.transfer.arguments import MAX_THREADS

    src, dst = vllm(2, 8, 4, 4, 8), vllm(2, 8, 4, 4, 8)
    torch.nn.init.normal_(src.kv[0])
    m = block_map(src, dst, [0, 1], [2, 3])
    for _ in range(earlier_copies):
        m.copy()
    for bad, why in [(True, "an int"), (np.True_, "an int"), (2.0, "an int"), (0, "a positive int"),
                     (-3, "a positive int")]:  # fmt: skip
        with pytest.raises(BlockMapError, match=rf"^num_threads must be {why}, got {re.escape(repr(bad))}$"):
            m.copy(bad)  # type: ignore[arg-type]
    for count in (MAX_THREADS + 1, 2**31, 2**64, 10**30, np.int64(2), torch.tensor(3)):
        used = m.copy(count)  # type: ignore[arg-type]
        assert 1 <= used <= MAX_THREADS
    assert torch.equal(dst.kv[0][:, 2:4], src.kv[0][:, 0:2])
    # the later copies' one native step takes a plain int from 1 to MAX_THREADS and leaves
    # every other count (-2, nothing copied) to the full reading above
    for other in (True, np.int64(2), 2.0, 0, -1, MAX_THREADS + 1, 2**64, None):
        assert m._fast.copy_watched(other) == -2
    assert m._fast.copy_watched(MAX_THREADS) >= 1


@pytest.mark.parametrize("earlier_copies", [0, 1])
def test_a_map_whose_sides_are_on_two_devices_is_refused_by_every_copy(earlier_copies: int) -> None:
    """A host side and a device side (the dst side read as on cuda:0 here, where no GPU may
    be): copy() moves bytes within one device, so it is refused naming both, nothing
    copied; the CPU copy must never be handed a device's addresses (a segfault there)."""
    src, dst = vllm(2, 8, 4, 4, 8), vllm(2, 8, 4, 4, 8)
    torch.nn.init.normal_(src.kv[0])
    m = block_map(src, dst, [0, 1], [2, 3])
    for _ in range(earlier_copies):
        m.copy()
    for t in dst.kv:
        t.zero_()
    m.dst = m.dst.replaced(device=("cuda", 0))
    m.__dict__.pop("_fast", None)  # what the first copy kept was of the sides before
    for _ in range(2):
        with pytest.raises(
            BlockMapError, match=r"^src is on cpu and dst on cuda:0; copy\(\) moves bytes within one"
        ):
            m.copy()
    assert not any(t.any() for t in dst.kv)


# -- descriptions ------------------------------------------------------------------------------


def test_a_fingerprint_tells_maps_of_other_arguments_apart() -> None:
    """The peer of a peer-staged request builds its own map of the request: the
    fingerprint is how the two halves find out they were built alike."""
    src, dst = vllm(2, 8, 4, 8, 8), vllm(2, 8, 4, 4, 8, fmt=F.NL_X_TWO_NB_NH_BS_HS)
    kw: dict[str, Any] = {"dst_shard": Shard(1, 2, 8)}
    base = block_map(src, dst, [3, 5], [1, 6], **kw)
    assert base.fingerprint == block_map(src, dst, [3, 5], [1, 6], **kw).fingerprint
    assert len(base.fingerprint) == 16 and int(base.fingerprint, 16) >= 0
    others = [
        block_map(src, dst, [5, 3], [1, 6], **kw),  # the ids in another order
        block_map(src, dst, [3, 5], [1, 6], num_tokens=7, **kw),  # fewer tokens
        block_map(src, dst, [3, 5], [1, 6], dst_shard=Shard(0, 2, 8)),  # other heads
    ]
    assert len({base.fingerprint, *(m.fingerprint for m in others)}) == 4


def test_a_description_round_trips_and_maps_like_the_registration() -> None:
    src, dst = vllm(2, 8, 4, 8, 8), vllm(2, 8, 4, 4, 8, fmt=F.NL_X_TWO_NB_NH_BS_HS)
    torch.nn.init.normal_(src.kv[1])
    desc = dst.describe(shard=Shard(1, 2, 8))
    peer = RegistrationDescription.from_json(desc.to_json())
    assert peer == desc and peer.shard == Shard(1, 2, 8) and peer.groups[0].layers == (0, 1)
    live = block_map(src, dst, [3, 5], [1, 6], dst_shard=Shard(1, 2, 8))
    planned = block_map(src, peer, [3, 5], [1, 6])  # the shard comes with the description
    assert np.array_equal(live.runs, planned.runs) and planned.kind == live.kind == "head slice, permuted"
    with pytest.raises(
        BlockMapError, match="the dst side is a RegistrationDescription: its addresses are a peer's"
    ):
        planned.copy()
    back = block_map(peer, src, [1, 6], [3, 5], dst_shard=Shard(0, 1, 8))
    assert back.num_bytes == live.num_bytes
    with pytest.raises(ShardError, match="src_shard is Shard"):
        block_map(peer, src, [1, 6], [3, 5], src_shard=Shard(0, 2, 8))


def test_a_shard_takes_numpy_and_torch_integers_as_block_ids_do() -> None:
    """Sizes read off a handshake or a config array are NumPy integers: a shard of them is
    the same shard (it was a ShardError)."""
    shard = Shard(np.int64(1), np.int32(2), torch.tensor(8))  # type: ignore[arg-type]
    assert shard == Shard(1, 2, 8) and hash(shard) == hash(Shard(1, 2, 8)) and type(shard.tp_size) is int
    assert str(shard) == "Shard(tp_rank=1, tp_size=2, num_kv_heads=8)"


def test_a_folded_cache_s_block_size_may_be_a_numpy_integer() -> None:
    sglang = kvlayout.detect([torch.randn(24, 1, 8) for _ in range(2)], "sglang")
    sizes: dict[str, Any] = {"src_block_size": np.int64(4), "dst_block_size": np.int32(4)}  # from an array
    m = block_map(sglang, sglang, [0, 1], [3, 4], **sizes)
    assert m.num_bytes == 2 * 8 * 8 * 4  # 8 tokens of one 8-float row, 2 layers


def test_describing_a_registration_with_a_shard_it_does_not_hold_is_a_shard_error() -> None:
    """Describing one's own cache with the wrong shard is a local mistake (a ShardError
    naming the fix), not a peer's description that lies."""
    two_heads = vllm(2, 8, 4, 2, 8)
    with pytest.raises(ShardError) as err:
        two_heads.describe(shard=Shard(0, 2, 8))
    assert str(err.value) == (
        "describe(shard=Shard(tp_rank=0, tp_size=2, num_kv_heads=8)): the shard holds 4 KV heads, but kernel "
        "group 0 of this registration holds 2: pass the Shard(tp_rank, tp_size, num_kv_heads) this rank was "
        "given, with the model's KV heads"
    )
    assert two_heads.describe(shard=Shard(0, 4, 8)).shard == Shard(0, 4, 8)


def test_runs_stay_exact_at_addresses_float64_cannot_hold() -> None:
    """Above 2**53 a float64 rounds to a multiple of 2**(e-52): a map's addresses are
    uint64 throughout, never stacked with signed columns into floats."""
    src, dst = vllm(2, 8, 4, 8, 8), vllm(2, 8, 4, 8, 8)
    text = dst.describe(at=1 << 40).to_json()

    def placed(at: int) -> RegistrationDescription:  # the peer's tensors moved to ``at`` (not 16-aligned)
        wire = json.loads(text)
        for plane in wire["groups"][0]["planes"]:
            plane["addresses"] = [a - (1 << 40) + at for a in plane["addresses"]]
        return RegistrationDescription.from_json(json.dumps(wire))

    near, far = placed((1 << 44) + 248), placed((1 << 56) + 248)
    runs = [block_map(src, peer, [3, 5], [1, 6]).runs for peer in (near, far)]
    assert np.array_equal(runs[1][:, 1] - np.uint64(1 << 56), runs[0][:, 1] - np.uint64(1 << 44))


def test_block_ids_without_a_length_are_refused_by_name() -> None:
    src, dst = vllm(2, 8, 4, 2, 16), vllm(2, 8, 4, 2, 16)
    with pytest.raises(
        TypeError,
        match=r"^src_blocks must be a sequence of block ids \(its length gives the tokens to map\), not "
        r"list_iterator$",
    ):
        block_map(src, dst, iter([0]), [1])
    with pytest.raises(TypeError, match=r"^dst_blocks must be a sequence of block ids .*, not generator$"):
        block_map(src, dst, [0], (i for i in [1]))


def test_a_side_is_replaced_only_in_its_fields() -> None:
    side = block_map(vllm(2, 8, 4, 2, 16), vllm(2, 8, 4, 2, 16), [0], [1]).src
    with pytest.raises(TypeError, match=r"^a Side has no field\(s\) colour, size$"):
        side.replaced(size=2, colour=1)


def test_a_description_needs_one_kernel_group_to_map() -> None:
    kv = [torch.zeros(2, 8, 4, 4, 8), torch.zeros(2, 8, 4, 4, 8, dtype=torch.float64)]
    desc = bind(kv, 1).describe()
    assert len(desc.groups) == 2
    with pytest.raises(BlockMapError, match="the description has 2 kernel groups"):
        block_map(desc, desc, [0], [1])
    block_map(desc.group(1), desc.group(1), [0], [1])


def lie(path: str, value: Any) -> str:
    """A real description's JSON with one field changed (``a.b[0].c``; value ... deletes it)."""
    data = json.loads(vllm(2, 8, 4, 4, 8).describe(shard=Shard(0, 2, 8)).to_json())
    *parents, last = path.replace("[", ".").replace("]", "").split(".")
    node = data
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    if value is ...:
        del node[last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return json.dumps(data)


LIES = [
    ("version", 3, "description.version=3 is outside [1, 3)"),
    ("version", 0, "description.version=0 is outside [1, 3)"),
    ("groups", [], "description.groups is empty"),
    ("kvlayout", "layout", "description.kvlayout is 'layout', not 'registration-description'"),
    ("groups[0].planes", [], "description.groups[0].planes is empty"),
    ("groups[0].planes", [{}] * 17, "description.groups[0].planes has 17 entries, more than 16"),
    ("groups[0].format", "NL_X_MADE_UP", "description.groups[0].format 'NL_X_MADE_UP' is not a kvlayout format name"),
    ("groups[0].planes[0].dtype", "complex64", "description.groups[0].planes[0].dtype 'complex64' is not one of"),
    ("groups[0].planes[0].sizes.NB", -1, "description.groups[0].planes[0].sizes.NB=-1 is outside [1, 4294967296)"),
    ("groups[0].planes[0].sizes.NB", True, "description.groups[0].planes[0].sizes.NB must be an integer, not a boolean"),
    ("groups[0].planes[0].sizes.XX", 3, "description.groups[0].planes[0].sizes.XX: NL_X_TWO_NB_BS_NH_HS has no size XX"),
    ("groups[0].planes[0].sizes.NB", 9, "description.groups[0].planes[0].shape is [2, 8, 4, 4, 8]; "
     "NL_X_TWO_NB_BS_NH_HS with these sizes is [2, 9, 4, 4, 8]"),
    ("groups[0].planes[0].strides[0]", 2048, "description.groups[0].planes[0].strides are [2048, 128, 32, 8, 1]; "
     "NL_X_TWO_NB_BS_NH_HS stores these sizes with strides [1024, 128, 32, 8, 1]"),
    ("groups[0].planes[0].strides[0]", 512, "description.groups[0].planes[0].strides are [512, 128, 32, 8, 1]; "
     "NL_X_TWO_NB_BS_NH_HS stores these sizes with strides [1024, 128, 32, 8, 1]"),  # blocks that would overlap
    ("groups[0].planes[0].block_stride", 256, "description.groups[0].planes[0].block_stride: NL_X_TWO_NB_BS_NH_HS: "
     "dim 0 is not the block axis"),
    ("groups[0].planes[0].addresses[1]", 1 << 64, "description.groups[0].planes[0].addresses[1]=18446744073709551616 "
     "is outside [4096, 18446744073709543424)"),
    ("groups[0].planes[0].addresses[1]", "0x1000", "description.groups[0].planes[0].addresses[1] must be an integer, "
     "not a string"),
    ("groups[0].planes[0].addresses", [4096], "description.groups[0].planes[0].addresses has 1 entries; "
     "NL_X_TWO_NB_BS_NH_HS has 2 tensors here"),
    ("groups[0].planes[0].addresses", [4096, 1 << 20, 1 << 21], "description.groups[0].planes[0].addresses has 3 "
     "entries; NL_X_TWO_NB_BS_NH_HS has 2 tensors here"),
    ("groups[0].planes[0].addresses", [4096, 8192], "description.groups[0].planes[0].addresses[1] and "
     "description.groups[0].planes[0].addresses[0] overlap in memory"),
    ("groups[0].planes[0].addresses", [4096, 4097], "description.groups[0].planes[0].addresses[1] and "
     "description.groups[0].planes[0].addresses[0] overlap in memory"),
    ("groups[0].layers", [0, 0], "description.groups[0].layers must be distinct layer indices"),
    ("groups[0].engine_group", -2, "description.groups[0].engine_group=-2 is outside [-1, 65536)"),
    ("groups[0].layers", [0], "description.groups[0].layers has 1 entries; the tensors hold 2 layers"),
    ("groups[0].block_size", 8, "description.groups[0].block_size is 8; the tensors have blocks of 4"),
    ("groups[0].planes[0].shape", ..., "description.groups[0].planes[0] has no shape"),
    ("groups[0].extra", 1, "description.groups[0] has unknown field(s) 'extra'"),
    ("groups[0].opaque_pages", {"layout": "pages\x1b[2J", "rows_are_tokens": False},  # a terminal escape
     "description.groups[0].opaque_pages.layout must be printable text of 1 to"),
    ("device.type", "tpu", "description.device.type is 'tpu', not one of cpu, cuda"),
    ("shard.tp_rank", 2, "description.shard: Shard.tp_rank=2 is out of range for tp_size=2"),
    ("shard.num_kv_heads", 16, "description.shard Shard(tp_rank=0, tp_size=2, num_kv_heads=16) holds 8 KV heads, "
     "but description.groups[0] has 4"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "value", "message"), LIES, ids=[f"{p}={v!r}"[:40] for p, v, _ in LIES])
def test_from_json_refuses_a_lying_description(path: str, value: Any, message: str) -> None:
    with pytest.raises(PeerDescriptionError) as info:
        RegistrationDescription.from_json(lie(path, value))
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "the description is not valid JSON"),
        ('{"version": NaN}', "the description holds NaN, which is not JSON"),
        ("[]", "description must be an object, not a list"),
        (b"\xff", "the description is not UTF-8 text"),
        ("[" * 100_000 + "]" * 100_000, "the description nests its JSON arrays or objects deeper than"),
    ],
)
def test_from_json_refuses_what_is_not_a_description(text: str | bytes, message: str) -> None:
    with pytest.raises(PeerDescriptionError, match=message):
        RegistrationDescription.from_json(text)
    with pytest.raises(TypeError, match=r"^from_json takes str or bytes, not dict$"):
        RegistrationDescription.from_json(json.loads(lie("version", 1)))


def test_from_json_quotes_a_peer_s_values_cut_short() -> None:
    """An untrusted description's keys and strings may be megabytes (a 200 kB key made a
    200 kB message) or hold control bytes (a NUL was echoed raw)."""
    data = json.loads(vllm(2, 8, 4, 4, 8).describe().to_json())
    data["k" * 200_000] = 1
    data["a\x00b"] = 2
    with pytest.raises(PeerDescriptionError) as err:
        RegistrationDescription.from_json(json.dumps(data))
    assert str(err.value) == (
        f"description has unknown field(s) 'a\\x00b', '{'k' * 99}... (200002 characters)"
    )
    data = json.loads(vllm(2, 8, 4, 4, 8).describe().to_json())
    data["device"]["type"] = ["cpu"] * 100_000
    with pytest.raises(PeerDescriptionError) as err:
        RegistrationDescription.from_json(json.dumps(data))
    assert len(str(err.value)) < 200 and str(err.value).endswith(
        "... (700000 characters), not one of cpu, cuda"
    )


# -- the native executor ----------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=40),
    st.integers(1, 4),
    st.randoms(use_true_random=False),
)
def test_copy_splits_runs_by_bytes_over_threads(lengths: list[int], threads: int, rnd: random.Random) -> None:
    """Each thread copies a contiguous share of the bytes, cutting runs at its edges."""
    src = np.frombuffer(rnd.randbytes(sum(lengths) + 64), dtype=np.uint8).copy()
    dst = np.zeros(2 * sum(lengths) + 64, dtype=np.uint8)
    order = list(range(len(lengths)))
    rnd.shuffle(order)
    starts = np.cumsum([0, *[2 * lengths[i] for i in order]])  # destination runs apart, shuffled
    place = {i: int(starts[k]) for k, i in enumerate(order)}
    runs, at = [], 0
    for i, n in enumerate(lengths):
        runs.append((src.ctypes.data + at, dst.ctypes.data + place[i], n))
        at += n

    def spans(a: np.ndarray) -> np.ndarray:
        return np.array([[a.ctypes.data, a.nbytes, a.nbytes, 1]], dtype=np.uint64)

    problem, _, _, used = _native.copy_runs(
        np.array(runs, dtype=np.uint64), spans(src), spans(dst), threads, 1
    )
    assert problem is _native.MapProblem.none and 1 <= used <= threads
    want = np.zeros_like(dst)
    at = 0
    for i, n in enumerate(lengths):
        want[place[i] : place[i] + n] = src[at : at + n]
        at += n
    assert np.array_equal(dst, want)


def test_validation_knows_padded_blocks_of_interleaved_tensors() -> None:
    """Two tensors whose blocks interleave in one pool (vLLM's blocks-first layers): a run
    in one tensor's block is inside, a run over the padding (the other's block) is not."""
    pool = np.zeros(4 * 64, dtype=np.uint8)
    base = pool.ctypes.data
    a = [base, 128, 64, 2]  # blocks at 0 and 128
    b = [base + 64, 128, 64, 2]  # blocks at 64 and 192
    spans = np.array([a, b], dtype=np.uint64)
    source = np.array([[base + 128, base + 128, 64]], dtype=np.uint64)
    ok = np.array([[base, base + 64, 64], [base + 128, base + 192, 64]], dtype=np.uint64)
    assert _native.validate_runs(ok, spans, spans)[0] is _native.MapProblem.none
    across = np.array([[base + 32, base + 192, 64]], dtype=np.uint64)  # a's block 0 into b's block 0
    assert _native.validate_runs(across, spans, spans)[:2] == (_native.MapProblem.src_outside, 0)
    assert _native.validate_runs(source, spans, spans)[:2] == (
        _native.MapProblem.src_dst_overlap,
        0,
    )  # writes what it reads


def test_a_row_s_pieces_are_found_without_probing_every_element() -> None:
    """A peer may describe rows of millions of elements: the pieces of a row come from a
    few probes (bisection), the same as probing each element would find."""
    calls = []

    def regions(e: int = 0, **_: int) -> tuple[int, int]:  # values [0, V) then scales far away
        calls.append(e)
        return (0, e) if e < 3 * 2**20 else (0, 2**40 + e)

    assert _piece_starts(regions, 2**22) == [0, 3 * 2**20]
    assert len(calls) < 100
    every_element_apart = _piece_starts(lambda e=0, **_: (e % 3, 0), 7)  # each in another tensor
    assert every_element_apart == list(range(7))


def test_max_mla_maps_to_the_other_engines_mla_caches() -> None:
    """MAX registers MLA as its cross-layer buffer with one plane of one head
    (``[NB, 1, NL, BS, 1, 576]``, ``kv_dim=1``): latents, as vLLM's and SGLang's MLA are,
    and held whole by every TP rank."""
    nl, nb, bs = 2, 4, 16
    buf = torch.randn(nb, 1, nl, bs, 1, 576, dtype=torch.bfloat16)
    hints = {"layout_format": "NB_KV_NL_BS_NH_HS", "num_layers": nl, "kv_dim": 1, "tokens_per_block": bs}
    mx = kvlayout.detect(buf, "max", hints)
    kv = [torch.zeros(nb, 1, bs, 576, dtype=torch.bfloat16) for _ in range(nl)]
    vllm_mla = kvlayout.detect(kv, "vllm", {"kv_dim": 1})
    m = block_map(mx, vllm_mla, [1, 2], [3, 0], num_tokens=20)
    assert m.kind == "re-laid"
    m.copy()
    for layer in range(nl):
        assert torch.equal(kv[layer][3, 0], buf[1, 0, layer, :, 0])
        assert torch.equal(kv[layer][0, 0, :4], buf[2, 0, layer, :4, 0]) and not kv[layer][0, 0, 4:].any()
    assert mx.describe(shard=Shard(1, 8, 128)).shard == Shard(1, 8, 128)  # DeepSeek-V3's 128 "heads"
    sglang_mla = kvlayout.detect(
        [torch.zeros(nb * bs, 1, 576, dtype=torch.bfloat16) for _ in range(nl)], "sglang"
    )
    assert block_map(sglang_mla, mx, [2, 0], [1, 3], src_block_size=bs).num_runs == 4


def test_trtllm_mla_pools_map_to_the_other_engines_mla_caches() -> None:
    """TRT-LLM registers MLA (DeepSeek) as its K-only pool, ``[NB, NL, 1, BS*576]`` from
    ``get_unique_primary_pool()``: latents, mapped to vLLM's MLA cache of another block
    size and moved byte for byte, every TP rank holding them whole."""
    nl, nb, bs = 3, 5, 32
    pool = torch.randn(nb, nl, 1, bs * 576, dtype=torch.bfloat16)
    trt = kvlayout.detect(pool, "trtllm", {"tokens_per_block": bs, "head_dim": 576})
    kv = [torch.zeros(2 * nb, 16, 576, dtype=torch.bfloat16) for _ in range(nl)]
    vllm_mla = kvlayout.detect(kv, "vllm")
    m = block_map(trt, vllm_mla, [4, 1], [7, 0, 3], num_tokens=40, src_shard=Shard(0, 1, 128),
                  dst_shard=Shard(3, 4, 128))  # fmt: skip
    m.copy()
    rows = pool.view(nb, nl, bs, 576)
    for layer in range(nl):
        assert torch.equal(kv[layer][7], rows[4, layer, :16])
        assert torch.equal(kv[layer][0], rows[4, layer, 16:])
        assert torch.equal(kv[layer][3, :8], rows[1, layer, :8]) and not kv[layer][3, 8:].any()
    back = torch.zeros_like(pool)
    returned = kvlayout.detect(back, "trtllm", {"tokens_per_block": bs, "head_dim": 576})
    block_map(vllm_mla, returned.describe(), [7, 0, 3], [2, 4], num_tokens=40)  # a peer's description
    block_map(vllm_mla, returned, [7, 0, 3], [2, 4], num_tokens=40).copy()
    got = back.view(nb, nl, bs, 576)
    assert torch.equal(got[2], rows[4]) and torch.equal(got[4, :, :8], rows[1, :, :8])
    assert not got[4, :, 8:].any()


# -- planes of unequal width (vLLM-Ascend's (latent, rope[, dsa]) tuples) ------------------------


def _planes(
    widths: list[int], nl: int, nb: int, bs: int, where: list[int], seed: int
) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's planes ``[NB, BS, 1, w]`` (bf16) carved from one pool in the order
    ``where`` lists (layer-major), so any plane may lie lowest: a latent allocated before
    its rope, or after."""
    sizes = [nb * bs * w * 2 for w in widths]
    pool = torch.randint(
        0, 256, (nl * sum(sizes),), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    made: dict[tuple[int, int], torch.Tensor] = {}
    at = 0
    for k in where:
        layer, plane = divmod(k, len(widths))
        made[layer, plane] = pool[at : at + sizes[plane]].view(torch.bfloat16).view(nb, bs, 1, widths[plane])
        at += sizes[plane]
    return [tuple(made[layer, i] for i in range(len(widths))) for layer in range(nl)]


def _token_bytes(side: Any, layer: int, block: int, slot: int) -> list[tuple[int, int]]:
    """(tensor address, byte address) of each byte of one token's row, in row order."""
    pieces = side[layer] if isinstance(side[layer], tuple) else (side[layer],)
    out = []
    for t in pieces:
        row = t[block, slot].reshape(-1)
        start = t.data_ptr() + (block * t.stride(0) + slot * t.stride(1)) * t.element_size()
        out += [(t.data_ptr(), start + i) for i in range(row.numel() * t.element_size())]
    return out


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_planes_of_unequal_width_map_every_token_in_the_fewest_runs(data: st.DataObject) -> None:
    """Unequal planes strode apart: the latent's block step is no longer above the rope's
    slot step, and an earlier nest took one from each and walked one block of slots."""
    widths = data.draw(st.sampled_from([[512, 64], [64, 512], [448, 128], [512, 64, 132]]))
    nl, bs_p, bs_m = (
        data.draw(st.integers(1, 2)),
        data.draw(st.sampled_from([1, 2, 4])),
        data.draw(st.sampled_from([1, 2, 4, 8])),
    )
    where = data.draw(st.permutations(range(nl * len(widths))))
    planes = _planes(widths, nl, 5, bs_p, list(where), seed=1)
    mla = [
        torch.randint(-99, 99, (6, bs_m, sum(widths)), dtype=torch.int16).view(torch.bfloat16)
        for _ in range(nl)
    ]
    tokens = data.draw(st.integers(1, 2 * min(bs_p * 5, bs_m * 6) // 2))
    p_ids = data.draw(st.permutations(range(5)))[: -(-tokens // bs_p)]
    m_ids = data.draw(st.permutations(range(6)))[: -(-tokens // bs_m)]
    to_planes = data.draw(st.booleans())
    src, dst = (mla, planes) if to_planes else (planes, mla)
    s_fmt, d_fmt = (
        (F.NL_X_NB_BS_HS, F.NL_X_NP_X_NB_BS_ONE_HS)
        if to_planes
        else (F.NL_X_NP_X_NB_BS_ONE_HS, F.NL_X_NB_BS_HS)
    )
    s_ids, d_ids = (m_ids, p_ids) if to_planes else (p_ids, m_ids)
    s_bs, d_bs = (bs_m, bs_p) if to_planes else (bs_p, bs_m)
    pairs = [
        (s, d)
        for layer in range(nl)
        for p in range(tokens)
        for s, d in zip(
            _token_bytes(src, layer, s_ids[p // s_bs], p % s_bs),
            _token_bytes(dst, layer, d_ids[p // d_bs], p % d_bs),
            strict=True,
        )
    ]
    leaves = [t for layer in dst for t in (layer if isinstance(layer, tuple) else (layer,))]
    before = [t.clone() for t in leaves]
    m = block_map(bind(src, s_fmt), bind(dst, d_fmt), list(s_ids), list(d_ids), num_tokens=tokens)
    m.copy()
    assert m.num_bytes == len(pairs)
    s_mem = {t.data_ptr(): t for layer in src for t in (layer if isinstance(layer, tuple) else (layer,))}
    src_byte = {}
    for base, t in s_mem.items():
        raw = t.contiguous().view(torch.uint8).reshape(-1)  # the pool's bytes, dense per tensor
        src_byte[base] = (raw, t)
    expected = [b.view(torch.uint8).reshape(-1).clone() for b in before]
    d_index = {t.data_ptr(): i for i, t in enumerate(leaves)}
    for (s_base, s_at), (d_base, d_at) in pairs:
        expected[d_index[d_base]][d_at - d_base] = src_byte[s_base][0][s_at - s_base]
    for t, e in zip(leaves, expected, strict=True):
        assert torch.equal(t.view(torch.uint8).reshape(-1), e)
    # The fewest runs: byte pairs in destination order, broken where either side jumps or
    # changes tensor.
    arr = np.array([(sb, sa, db, da) for (sb, sa), (db, da) in pairs], dtype=np.int64)
    arr = arr[np.argsort(arr[:, 3], kind="stable")]
    cont = (arr[1:, 3] == arr[:-1, 3] + 1) & (arr[1:, 1] == arr[:-1, 1] + 1)
    cont &= (arr[1:, 0] == arr[:-1, 0]) & (arr[1:, 2] == arr[:-1, 2])
    assert m.num_runs == len(arr) - int(cont.sum())


def test_the_native_builder_refuses_a_nest_with_slots_outside_blocks() -> None:
    """The walk counts a block's slots from its block: a nest with the slot level outside
    the block level would walk one block of slots, so the builder refuses it."""
    kv = [torch.zeros(4, 2, 2, 8) for _ in range(2)]
    m = block_map(
        kvlayout.detect(kv, "vllm"), kvlayout.detect([t.clone() for t in kv], "vllm"), [0, 1], [2, 3]
    )
    pair = m._pair
    block, slot = pair.order.index(1), pair.order.index(2)  # csrc/block_map.h's kBlock, kSlot
    assert block < slot
    swapped = list(pair.order)
    swapped[block], swapped[slot] = swapped[slot], swapped[block]
    m._pair = replace(pair, order=cast(Any, tuple(swapped)))
    with pytest.raises(ValueError, match="order puts the slot level outside the block level"):
        m._build_groups(force_sort=False)


def test_head_major_blocks_that_span_several_source_blocks_are_walked_in_destination_order() -> None:
    """NHD blocks of 16 into HND blocks of 64 (an offload pool's): each destination block's
    tokens lie in four source blocks, and the walk emitted a tile per source block, each
    visiting every head: out of destination order, so every run was sorted (9.7 ms for a
    1024-token request of Llama-3-8B's shape, as long as half its copy). It now walks a
    row per head and source block, in order, with the same runs."""

    def cache(blocks: int, block_size: int, hnd: bool) -> Any:
        shape = (2, blocks, 4, block_size, 16) if hnd else (2, blocks, block_size, 4, 16)
        kv = [torch.randn(shape, dtype=torch.bfloat16) for _ in range(3)]
        kv = [t.transpose(2, 3) for t in kv] if hnd else kv
        return kvlayout.detect(kv, "vllm", {"kv_layout": "HND" if hnd else "NHD"})

    src, dst = cache(32, 16, hnd=False), cache(8, 64, hnd=True)
    m = block_map(src, dst, random.Random(5).sample(range(32), 10), [6, 2, 7], num_tokens=150)
    p, (src_ids, dst_ids) = m._pair, m._ids
    _, runs, in_order = _native.build_groups(
        p.slabs, p.group_starts, p.order, len(p.heads), m.num_tokens, src_ids, 16, dst_ids, 64,
        p.src_classes, p.dst_classes, False, False, False,
    )  # fmt: skip
    assert in_order and runs == m.num_runs == 3 * 2 * 4 * 150
    assert np.array_equal(m.runs, m._build(force_sort=True))


def device_into_page_first(layers: int, heads: int = 2, hs: int = 8, slots: int = 64) -> BlockMap:
    """20 tokens of SGLang's device pool (bf16, random) into its page_first host pool
    (zeros), pages of 8 tokens."""
    device = kvlayout.detect(
        [[torch.randn(slots, heads, hs, dtype=torch.bfloat16) for _ in range(layers)] for _ in range(2)],
        "sglang",
    )
    host = kvlayout.detect(
        torch.zeros(2, slots, layers, heads, hs, dtype=torch.bfloat16),
        "sglang",
        {"hicache_layout": "page_first"},
    )
    return block_map(device, host, [3, 1, 2], [0, 2, 1], src_block_size=8, dst_block_size=8, num_tokens=20)


def test_layers_interleaved_in_the_destination_are_walked_in_destination_order() -> None:
    """SGLang's device pool into its page_first host pool ``[2, size, NL, NH, HS]``: a
    token's row holds every layer's, K's half before V's. The walk goes block, slot, slab;
    with K's and V's slabs in one group it went from K's rows to V's and back at every
    token, out of destination order (every run sorted: 2.7 of 3.6 ms for 1024 tokens of
    Llama-3-8B's shape). K's slabs and V's are now groups of their own, walked in order."""
    layers = 3
    m = device_into_page_first(layers)
    p, (src_ids, dst_ids) = m._pair, m._ids
    _, runs, in_order = _native.build_groups(
        p.slabs, p.group_starts, p.order, len(p.heads), m.num_tokens, src_ids, 8, dst_ids, 8,
        p.src_classes, p.dst_classes, False, False, False,
    )  # fmt: skip
    assert in_order and runs == m.num_runs == 2 * layers * 20
    assert np.array_equal(m.runs, m._build(force_sort=True))


def test_the_sorting_path_leaves_runs_in_destination_order() -> None:
    """A walk out of destination order (heads outside layers in vLLM's BHLNC pool, from
    per-layer NHD caches) is sorted: the walk's ascending stretches merged, every run's
    destination after the last one's."""
    nb, heads, layers, bs, hs = 8, 2, 3, 4, 8
    dst = kvlayout.detect(
        torch.zeros(nb, heads, layers, bs, 2 * hs), "vllm", {"layout_format": "NB_NH_NL_BS_CS"}
    )
    src = kvlayout.detect(
        [torch.randn(2, nb, bs, heads, hs) for _ in range(layers)], "vllm", {"kv_layout": "NHD"}
    )
    m = block_map(src, dst, [3, 1, 6], [5, 0, 2], num_tokens=10)
    p, (src_ids, dst_ids) = m._pair, m._ids
    _, runs, in_order = _native.build_groups(
        p.slabs, p.group_starts, p.order, len(p.heads), m.num_tokens, src_ids, bs, dst_ids, bs,
        p.src_classes, p.dst_classes, False, False, False,
    )  # fmt: skip
    assert not in_order and runs == m.num_runs
    ordered = m._build(force_sort=True)
    assert len(ordered) == m.num_runs and np.all(np.diff(ordered[:, 1].astype(np.int64)) > 0)


def test_some_of_a_pools_layers_map_from_a_view_of_its_layer_axis() -> None:
    """TRT-LLM V1 keeps one primary pool per window size, [NB, NL_window, 2, NH*BS*HS]; vLLM splits
    the same window's layers over KV cache groups of their own block tables (a Gemma-3-like model:
    sliding layers 0, 1, 3, 4 in groups [0, 1] and [3, 4]). The whole pool into one group is refused
    saying how to map it; a view of the pool's layer axis, numbered, maps. Oracles: TRT-LLM's block
    offset ((block * NL + layer) * 2 + kv) * NH*BS*HS + head * BS*HS + slot * HS (setOffsets,
    KVBlockArray::getKVLocalIdx), and vLLM 0.33's FlashAttention reading of its [NB, NH, BS, 2*HS]
    layer views (kv_cache.transpose(1, 2).split(HS, -1))."""
    nh, bs, hs, window_layers = 2, 8, 4, [0, 1, 3, 4]
    pool = torch.randn(6, 4, 2, nh * bs * hs)
    hints = {"num_kv_heads": nh, "tokens_per_block": bs, "head_dim": hs}
    trt = kvlayout.detect(pool, "trtllm", hints).numbered(window_layers)
    vllm_kv = [torch.zeros(9, 4, nh, 2 * hs).permute(0, 2, 1, 3) for _ in range(4)]  # NHD memory
    vllm_reg = kvlayout.detect(vllm_kv, "vllm", {"kv_layout": "NHD"}, layer_groups=[[0, 1], [2, 3]])
    group = vllm_reg.numbered(window_layers).kernel_groups[1]  # layers 3-4
    with pytest.raises(BlockMapError) as err:
        block_map(trt, group, [5, 2], [7, 1, 4, 3], num_tokens=13)
    assert str(err.value) == (
        "src holds layers 0-1,3-4 and dst layers 3-4; a map moves layer i to layer i (dst holds only some of "
        "src's layers: map them from a registration of those layers alone, registration.for_layers(layer_ids) "
        "(3-4) of src's (both sides numbered with the model's layer ids first: a side detected alone numbers "
        "its layers from 0, so a part of the model pairs by position until numbered), or one detected from "
        "that part of src's cache (a list's entries, or a view of a "
        "pool's layer axis such as TRT-LLM's pool[:, a:b]) and numbered with their layer ids: "
        "registration.numbered(layer_ids))"
    )
    part = kvlayout.detect(pool[:, 2:4], "trtllm", hints).numbered([3, 4])
    assert trt.for_layers([3, 4]).describe() == part.describe()  # the cut the hint names: the same view
    assert block_map(part, group, [5, 2], [7, 1, 4, 3], num_tokens=13).copy() == 1
    flat = pool.reshape(-1)
    for layer in (2, 3):  # the pool's layers 3 and 4
        rows = vllm_kv[layer].transpose(1, 2)  # FlashAttention's split(hs, -1): K, then V
        key_value = rows[..., :hs], rows[..., hs:]
        for p in range(13):
            for h in range(nh):
                for kv in (0, 1):
                    at = (([5, 2][p // bs] * 4 + layer) * 2 + kv) * nh * bs * hs + (h * bs + p % bs) * hs
                    got = key_value[kv][[7, 1, 4, 3][p // 4], p % 4, h]
                    assert torch.equal(got, flat[at : at + hs])
    assert all(int(vllm_kv[i].count_nonzero()) == 0 for i in (0, 1))  # the other group: untouched
    assert int(vllm_kv[2][[0, 2, 5, 6, 8]].count_nonzero()) == 0  # and the blocks not the request's
    assert int(vllm_kv[2][3, :, 1:].count_nonzero()) == 0  # and token 13 on, in the last block


def test_a_kernel_group_maps_to_a_group_of_the_same_layers() -> None:
    """A hybrid's second group holds layers 2-3 of its registration: into a pool of two
    layers (0-1) it is refused, saying how to register the pool; detected with the same
    layer_groups, the pool's group holds layers 2-3 and the map moves them."""

    def registration() -> Any:
        kv = [torch.randn(2, 6, 4, 2, 8) for _ in range(4)]
        return kv, kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"}, layer_groups=[[0, 1], [2, 3]])

    (src_kv, src), (pool_kv, pool) = registration(), registration()
    two = kvlayout.detect([torch.zeros(2, 6, 4, 2, 8) for _ in range(2)], "vllm", {"kv_layout": "NHD"})
    with pytest.raises(BlockMapError) as err:
        block_map(src.kernel_groups[1], two, [1], [2])
    assert str(err.value) == (
        "src holds layers 2-3 and dst layers 0-1; a map moves layer i to layer i (a kernel group keeps its "
        "registration's layer numbers: detect the other side with the same layer_groups, so that its group "
        "holds the same layers, or, where these are the layers to pair, number one side as the other: "
        "registration.numbered(layer_ids))"
    )
    block_map(src.kernel_groups[1], pool.kernel_groups[1], [1], [2]).copy()
    assert all(torch.equal(pool_kv[i][:, 2], src_kv[i][:, 1]) for i in (2, 3))
    # the two-layer cache numbered as the hybrid's layers 2-3: the pairing chosen on purpose
    numbered = two.numbered([2, 3])
    assert numbered.kernel_groups[0].describe().startswith("layers 2-3: ")
    assert numbered.describe().groups[0].layers == (2, 3)
    block_map(src.kernel_groups[1], numbered, [1], [2]).copy()
    assert all(torch.equal(two.kv[k][:, 2], src_kv[2 + k][:, 1]) for k in (0, 1))


def test_numbered_layers_travel_in_a_description_and_a_chunk() -> None:
    """A pipeline stage's layers 4-7, numbered so: its description (through JSON) pairs
    only with a cache numbered alike, whose map moves the bytes; a chunk stored from it
    loads only into such a cache; and shared layers are named by the engine's numbers."""
    src_kv = [torch.randn(2, 3, 4, 2, 8) for _ in range(4)]
    src = kvlayout.detect(src_kv, "vllm", {"kv_layout": "NHD"}).numbered(range(4, 8))
    there = RegistrationDescription.from_json(src.describe().to_json())
    assert there.groups[0].layers == (4, 5, 6, 7)
    dst_kv = [torch.zeros(2, 3, 4, 2, 8) for _ in range(4)]
    dst = kvlayout.detect(dst_kv, "vllm", {"kv_layout": "NHD"})
    for a, b in ((there, dst), (dst, there)):
        with pytest.raises(BlockMapError, match=r"holds layers (4-7|0-3) and dst layers (0-3|4-7); a map"):
            block_map(a, b, [1], [2])
    block_map(dst.numbered(range(4, 8)), there, [2], [1])  # numbered alike: the same layers
    shape, dtype = chunk_shape_for(src, 4)
    chunk = torch.zeros(shape, dtype=dtype)
    block_map(src, chunk_side(src, chunk), [1], [0]).copy()
    with pytest.raises(BlockMapError, match=r"src holds layers 4-7 and dst layers 0-3"):
        block_map(chunk_side(src, chunk), dst, [0], [2])
    stage = dst.numbered(range(4, 8))
    block_map(chunk_side(stage, chunk), stage, [0], [2]).copy()
    assert all(torch.equal(dst_kv[i][:, 2], src_kv[i][:, 1]) for i in range(4))
    shared = kvlayout.detect(src_kv[:3] + src_kv[1:2], "vllm", {"kv_layout": "NHD"}).numbered([9, 10, 11, 12])
    assert shared.kernel_groups[0].describe().endswith("KV shared by layers (10, 12)")
    assert RegistrationDescription.from_json(shared.describe().to_json()).groups[0].layers == (9, 10, 11, 12)


def test_a_load_after_the_prefix_cache_moves_only_the_tokens_from_first_token() -> None:
    """The engine's prefix cache holds tokens 0-31 (blocks it may share with other
    requests); the offload pool's 64-token block holds 0-63: tokens 32-99 load, nothing of
    the prefix is read or written, and the destination's blocks before them may repeat
    (vLLM's null block for a sliding window's dropped blocks)."""

    def cache(blocks: int, block_size: int, hnd: bool) -> tuple[list[torch.Tensor], Any]:
        shape = (2, blocks, 4, block_size, 16) if hnd else (2, blocks, block_size, 4, 16)
        kv = [torch.randn(shape) for _ in range(2)]
        kv = [t.transpose(2, 3) for t in kv] if hnd else kv
        return kv, kvlayout.detect(kv, "vllm", {"kv_layout": "HND" if hnd else "NHD"})

    (pool_kv, pool), (kv, engine) = cache(4, 64, hnd=True), cache(10, 16, hnd=False)
    before = [t.clone() for t in kv]
    engine_ids = [0, 0, 5, 3, 8, 1, 9]  # blocks 0-1: the prefix (here the null block twice)
    m = block_map(pool, engine, [2, 0], engine_ids, num_tokens=100, first_token=32)
    assert m.num_bytes == 2 * 2 * 68 * 4 * 16 * 4 and repr(m).startswith(
        "BlockMap(re-blocked, permuted: tokens 32-99,"
    )
    m.copy()
    for layer in range(2):
        for p in range(100):
            got, pool_row = (
                kv[layer][:, engine_ids[p // 16], p % 16],
                pool_kv[layer][:, [2, 0][p // 64], p % 64],
            )
            want = pool_row if p >= 32 else before[layer][:, engine_ids[p // 16], p % 16]
            assert torch.equal(got, want), (layer, p)
    untouched = sorted(set(range(10)) - set(engine_ids[2:]))
    assert all(torch.equal(kv[i][:, untouched], before[i][:, untouched]) for i in range(2))
    with pytest.raises(BlockMapError, match=r"^dst_blocks\[3\] = 5 repeats dst_blocks\[2\]"):
        block_map(pool, engine, [2, 0], [0, 0, 5, 5, 8, 1, 9], num_tokens=100, first_token=32)
    with pytest.raises(BlockMapError, match=r"^dst_blocks\[3\] = 5 repeats dst_blocks\[2\]"):  # not [0]
        block_map(pool, engine, [2, 0], [5, 0, 5, 5, 8, 1, 9], num_tokens=100, first_token=32)
    with pytest.raises(BlockMapError) as err:  # a block the prefix keeps is never written
        block_map(pool, engine, [2, 0], [3, 0, 5, 3, 8, 1, 9], num_tokens=100, first_token=32)
    assert str(err.value) == (
        "dst_blocks[3] = 3 takes tokens from first_token=32 on, but dst_blocks[0], the same block, holds "
        "tokens before it, which a map never writes"
    )
    assert repr(block_map(pool, engine, [2, 0], engine_ids, num_tokens=100, first_token=99)).startswith(
        "BlockMap(re-blocked, permuted: token 99, "
    )
    with pytest.raises(BlockMapError, match=r"^first_token must lie in \[0, 100\] \(num_tokens\), got 101$"):
        block_map(pool, engine, [2, 0], engine_ids, num_tokens=100, first_token=101)
    served = block_map(pool, engine, [2, 0], engine_ids, num_tokens=100, first_token=100)
    assert served.num_runs == 0 and "no tokens (first_token=100)" in repr(served)


def test_a_peer_at_this_process_s_addresses_maps_as_any_peer() -> None:
    """A peer's description is another process's address space: two workers alike (the
    same allocations on the same GPU model) often place their caches at the same
    virtual addresses. A map from our cache to such a peer was refused as a source and
    destination that overlap; it maps as at any other address."""
    src, dst = vllm(2, 8, 4, 2, 8), vllm(2, 8, 4, 2, 8)
    wire = json.loads(dst.describe().to_json())
    ours = json.loads(src.describe().to_json())
    for plane, mine in zip(wire["groups"][0]["planes"], ours["groups"][0]["planes"], strict=True):
        plane["addresses"] = mine["addresses"]  # the peer's cache where ours is
    peer = RegistrationDescription.from_json(json.dumps(wire))
    for src_ids, dst_ids in (([3], [3]), ([0, 1], [1, 2]), ([3], [4])):
        m = block_map(src, peer, src_ids, dst_ids)
        elsewhere = block_map(src, dst, src_ids, dst_ids)  # the same map, the peer's cache elsewhere
        assert m.num_runs == elsewhere.num_runs and m.num_bytes == elsewhere.num_bytes
        assert np.array_equal(np.sort(m.runs[:, 0]), np.sort(elsewhere.runs[:, 0]))
