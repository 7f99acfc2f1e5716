"""Block maps between context-parallel ranks (vLLM's decode context parallelism): each side
holds the request's tokens its CP rank's slot mapping gives it, and a map moves those both
sides hold, checked against the offset oracle with vLLM's slot mapping
(``test_block_maps.cp_block_slot``: virtual blocks of ``BS * cp_size`` tokens, ``I`` tokens
at a time a rank), every other destination byte unchanged, the fewest runs."""

from __future__ import annotations

import itertools
import json
import math
import tracemalloc
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout import _native
from kvlayout.registration.shards import Shard
from kvlayout.transfer import BlockMapError, RegistrationDescription, ShardError, block_map
from kvlayout.transfer.block_maps import chunk_side
from kvlayout.transfer.context_parallel import TokenSlice, overlap
from tests.transfer.test_block_maps import MHA, MLA, SHARING, TP, check_map, layout, make_side, shards, shared


@st.composite
def cp_shards(draw: st.DrawFn, shard: Shard, bs: int) -> Shard:
    """``shard`` at a CP rank of a random CP split, its interleave a divisor of ``bs``."""
    size = draw(st.sampled_from([1, 1, *TP]))
    interleave = draw(st.sampled_from([i for i in range(1, bs + 1) if bs % i == 0]))
    return Shard(
        shard.tp_rank, shard.tp_size, shard.num_kv_heads, draw(st.integers(0, size - 1)), size, interleave
    )


@st.composite
def cp_requests(draw: st.DrawFn, src: Shard, bs_src: int, dst: Shard, bs_dst: int) -> dict[str, Any]:
    tokens = draw(st.integers(0, 96))
    n_src, n_dst = -(-tokens // (bs_src * src.cp_size)), -(-tokens // (bs_dst * dst.cp_size))
    nb_src, nb_dst = max(n_src, 1) + draw(st.integers(0, 3)), max(n_dst, 1) + draw(st.integers(0, 3))
    src_ids = draw(st.permutations(range(nb_src)))[:n_src]
    if draw(st.booleans()):  # consecutive: runs may merge across blocks
        start = draw(st.integers(0, nb_dst - n_dst))
        dst_ids = list(range(start, start + n_dst))
    else:
        dst_ids = draw(st.permutations(range(nb_dst)))[:n_dst]
    first = draw(st.one_of(st.just(0), st.integers(0, tokens)))
    return dict(
        tokens=tokens, nb_src=nb_src, nb_dst=nb_dst, src_ids=list(src_ids), dst_ids=list(dst_ids), first=first
    )


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_mha_maps_between_cp_ranks_move_the_tokens_both_hold(data: st.DataObject) -> None:
    fmt_src, fmt_dst = data.draw(st.sampled_from(MHA)), data.draw(st.sampled_from(MHA))
    _, src_tp, dst_tp = data.draw(shards())
    bs_src, bs_dst = (
        data.draw(st.sampled_from([1, 2, 4, 6, 8, 16])),
        data.draw(st.sampled_from([1, 2, 4, 8, 12, 16])),
    )
    src_shard, dst_shard = data.draw(cp_shards(src_tp, bs_src)), data.draw(cp_shards(dst_tp, bs_dst))
    r = data.draw(cp_requests(src_shard, bs_src, dst_shard, bs_dst))
    common: dict[str, Any] = dict(layers=data.draw(st.integers(1, 2)), row=data.draw(st.integers(1, 2)), planes=1,
                                  kv=2, dtype=data.draw(st.sampled_from([torch.uint8, torch.bfloat16])))  # fmt: skip
    src = make_side(fmt_src, blocks=r["nb_src"], bs=bs_src, heads=len(src_shard.heads), pad=data.draw(st.integers(0, 1)),
                    shard=src_shard, seed=1, **common)  # fmt: skip
    dst = make_side(fmt_dst, blocks=r["nb_dst"], bs=bs_dst, heads=len(dst_shard.heads), pad=data.draw(st.integers(0, 1)),
                    shard=dst_shard, seed=2, **common)  # fmt: skip
    check_map(src, dst, r["src_ids"], r["dst_ids"], r["tokens"], data.draw(st.integers(1, 2)), r["first"])


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_mla_maps_between_cp_ranks_move_the_tokens_both_hold(data: st.DataObject) -> None:
    """DeepSeek's latents under DCP: every rank holds the latent of its own tokens."""
    fmt_src, fmt_dst = data.draw(st.sampled_from(MLA)), data.draw(st.sampled_from(MLA))
    planes_src = data.draw(st.integers(1, 2)) if fmt_src == F.NL_X_NP_X_NB_BS_ONE_HS else 1
    planes_dst = data.draw(st.integers(1, 2)) if fmt_dst == F.NL_X_NP_X_NB_BS_ONE_HS else 1
    tp_src, tp_dst = data.draw(st.sampled_from(TP)), data.draw(st.sampled_from(TP))
    bs_src, bs_dst = data.draw(st.sampled_from([1, 4, 8, 16])), data.draw(st.sampled_from([2, 4, 16, 32]))
    src_shard = data.draw(cp_shards(Shard(data.draw(st.integers(0, tp_src - 1)), tp_src, 1), bs_src))
    dst_shard = data.draw(cp_shards(Shard(data.draw(st.integers(0, tp_dst - 1)), tp_dst, 1), bs_dst))
    r = data.draw(cp_requests(src_shard, bs_src, dst_shard, bs_dst))
    row = planes_src * planes_dst * data.draw(st.integers(1, 2))
    common: dict[str, Any] = dict(
        layers=data.draw(st.integers(1, 2)), heads=1, row=row, kv=1, dtype=torch.uint8
    )
    src = make_side(fmt_src, blocks=r["nb_src"], bs=bs_src, planes=planes_src, pad=data.draw(st.integers(0, 1)),
                    shard=src_shard, seed=3, **common)  # fmt: skip
    dst = make_side(fmt_dst, blocks=r["nb_dst"], bs=bs_dst, planes=planes_dst, pad=data.draw(st.integers(0, 1)),
                    shard=dst_shard, seed=4, **common)  # fmt: skip
    check_map(src, dst, r["src_ids"], r["dst_ids"], r["tokens"], 1, r["first"])


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_cp_maps_over_kernel_pages_finer_than_the_scheduler_s_blocks(data: st.DataObject) -> None:
    """vLLM's slot mapping runs in the scheduler's blocks (its interleave divides them, not
    necessarily the attention kernel's pages): block ids of blocks ``per`` pages each, CP on
    either side, MHA (NHD and HND) and MLA, checked against vLLM's slot mapping read at the
    kernel's pages (``canonical``'s ``per``)."""
    mla = data.draw(st.booleans())
    pool = MLA if mla else MHA
    fmt_src, fmt_dst = data.draw(st.sampled_from(pool)), data.draw(st.sampled_from(pool))
    if mla:
        src_tp, dst_tp = Shard(0, 1, 1), Shard(0, 1, 1)
        heads, kv, planes = 1, 1, 1
    else:
        _, src_tp, dst_tp = data.draw(shards())
        heads, kv, planes = 0, 2, 1
    page_src, page_dst = data.draw(st.sampled_from([1, 2, 4])), data.draw(st.sampled_from([1, 2, 3, 4]))
    per_src, per_dst = data.draw(st.sampled_from([1, 2, 4])), data.draw(st.sampled_from([1, 2, 3]))
    src_shard = data.draw(cp_shards(src_tp, page_src * per_src))
    dst_shard = data.draw(cp_shards(dst_tp, page_dst * per_dst))
    r = data.draw(cp_requests(src_shard, page_src * per_src, dst_shard, page_dst * per_dst))
    common: dict[str, Any] = dict(layers=data.draw(st.integers(1, 2)), row=2, planes=planes, kv=kv,
                                  dtype=torch.uint8)  # fmt: skip
    src = make_side(fmt_src, blocks=r["nb_src"] * per_src, bs=page_src, heads=heads or len(src_shard.heads),
                    pad=data.draw(st.integers(0, 1)), shard=src_shard, seed=5, **common)  # fmt: skip
    dst = make_side(fmt_dst, blocks=r["nb_dst"] * per_dst, bs=page_dst, heads=heads or len(dst_shard.heads),
                    pad=data.draw(st.integers(0, 1)), shard=dst_shard, seed=6, **common)  # fmt: skip
    check_map(src, dst, r["src_ids"], r["dst_ids"], r["tokens"], 1, r["first"], per=(per_src, per_dst))


def _mla(fmt: F, blocks: int, bs: int, shard: Shard, seed: int) -> Any:
    return make_side(fmt, layers=2, blocks=blocks, bs=bs, heads=1, row=8, planes=1, kv=1, dtype=torch.uint8, pad=0,
                     shard=shard, seed=seed)  # fmt: skip


def test_equal_cp_splits_map_rank_to_rank_as_their_own_caches() -> None:
    """Prefill and decode with one DCP split (vLLM's NixlConnector's one supported case):
    rank r's cache to rank r's, whole blocks, as without context parallelism; rank r to
    another rank: nothing in common."""
    ids = [3, 0, 5]
    runs = []
    for rank in range(4):
        shard = Shard(rank, 4, 1, rank, 4, 16)
        src, dst = _mla(F.NL_X_NB_BS_HS, 6, 16, shard, 1), _mla(F.NL_X_NB_BS_HS, 6, 16, shard, 2)
        check_map(src, dst, ids, ids, 150, 1)
        m = block_map(src.kv, dst.kv, ids, ids, num_tokens=150, src_shard=shard, dst_shard=shard)
        assert m.kind == "same layout" and "at the same places" in m.reason
        runs.append(m.num_runs)
    # tokens 0-149 in virtual blocks of 64: rank 0 holds 0-15, 64-79 and 128-143 (3 blocks), rank 1
    # 16-31, 80-95 and 144-149, ranks 2 and 3 two blocks each: a run a layer and block
    assert runs == [6, 6, 4, 4]
    other = block_map(
        src.kv,
        dst.kv,
        ids,
        ids,
        num_tokens=150,
        src_shard=Shard(0, 4, 1, 0, 4, 16),
        dst_shard=Shard(1, 4, 1, 1, 4, 16),
    )
    assert other.kind == "empty" and other.num_runs == 0
    assert "none in common" in other.reason


def test_a_prefill_without_cp_fans_out_to_decode_cp_ranks_and_they_gather_it_back() -> None:
    """TP 1 prefill into DCP 2 decode, interleave 1 (vLLM's default): each decode rank takes
    every other token, and the two maps back rebuild the prefill's cache."""
    ids_src, ids_dst = [4, 1, 2, 7], [1, 0]
    src = _mla(F.NL_X_NB_BS_HS, 8, 16, Shard(0, 1, 1), 1)
    for rank in range(2):
        shard = Shard(rank, 2, 1, rank, 2, 1)
        dst = _mla(F.NL_X_NB_BS_HS, 3, 16, shard, 2 + rank)
        check_map(src, dst, ids_src, ids_dst, 60, 1)
        m = block_map(src.kv, dst.kv, ids_src, ids_dst, num_tokens=60, dst_shard=shard)
        assert m.kind == "token slice" and "CP rank" in m.reason
        back = block_map(dst.kv, src.kv, ids_dst, ids_src, num_tokens=60, src_shard=shard)
        assert back.num_bytes == m.num_bytes == 2 * 30 * 8  # 2 layers, 30 tokens, 8 bytes


def test_unequal_cp_splits_remap_token_positions() -> None:
    """Prefill DCP 4 into decode DCP 2 (vLLM refuses unequal DCP sizes): decode rank 0
    takes prefill ranks 0 and 2's tokens, each into every other of its slots."""
    src_ids, dst_ids = [2, 0], [3, 1, 0, 2]  # 64 tokens: blocks of 32 of the request, and of 16
    for p_rank in range(4):
        src = _mla(F.NL_X_NB_BS_HS, 3, 8, Shard(p_rank, 4, 1, p_rank, 4, 1), 1)
        for d_rank in range(2):
            dst = _mla(F.NL_X_NB_BS_HS, 4, 8, Shard(d_rank, 2, 1, d_rank, 2, 1), 2)
            check_map(src, dst, src_ids, dst_ids, 64, 1)
            m = block_map(
                src.kv, dst.kv, src_ids, dst_ids, num_tokens=64, src_shard=src.shard, dst_shard=dst.shard
            )
            assert m.num_bytes == (2 * 16 * 8 if p_rank % 2 == d_rank else 0)  # 2 layers, 16 tokens, 8 bytes
            assert m.num_runs == (2 * 16 if p_rank % 2 == d_rank else 0)  # a token a run: every other slot


def test_a_cp_rank_stores_its_tokens_into_the_request_s_chunk() -> None:
    """A chunk holds every token of the request: a CP rank writes its own into it (and a
    store from every rank fills it)."""
    chunk = torch.zeros(1, 2, 40, 8, dtype=torch.uint8)
    for rank in range(2):
        shard = Shard(rank, 2, 1, rank, 2, 4)
        src = _mla(F.NL_X_NB_BS_HS, 4, 8, shard, 5 + rank)
        m = block_map(src.kv, chunk_side(src.kv, chunk), [3, 1, 2], [0], num_tokens=40, src_shard=shard)
        m.copy()
        layers = [b.view(4, 8, 8) for b in src.reg.bases]  # per layer [blocks, slots, bytes]
        for p in range(40):  # vLLM's slot mapping, in virtual blocks of 16 tokens
            if (p % 16 // 4) % 2 == rank:
                block, slot = [3, 1, 2][p // 16], (p % 16 // 8) * 4 + p % 4
                for layer, kv in enumerate(layers):
                    assert torch.equal(chunk[0, layer, p], kv[block, slot])
    assert chunk.count_nonzero() > 0.9 * chunk.numel()  # every token's row written (random bytes)


def test_a_cp_shard_travels_in_a_description() -> None:
    shard = Shard(1, 4, 1, 1, 4, 16)
    src = _mla(F.NL_X_NB_BS_HS, 6, 16, shard, 1)
    text = src.kv.describe(shard=shard).to_json()
    assert json.loads(text)["shard"]["cp_size"] == 4
    peer = RegistrationDescription.from_json(text)
    assert peer.shard == shard
    dst = _mla(F.NL_X_NB_BS_HS, 6, 16, shard, 2)
    local = block_map(src.kv, dst.kv, [0, 1], [4, 5], num_tokens=100, src_shard=shard, dst_shard=shard)
    remote = block_map(peer, dst.kv, [0, 1], [4, 5], num_tokens=100, dst_shard=shard)
    assert np.array_equal(local.runs, remote.runs)
    plain = json.loads(
        _mla(F.NL_X_NB_BS_HS, 6, 16, Shard(0, 1, 1), 3).kv.describe(shard=Shard(0, 1, 1)).to_json()
    )
    assert set(plain["shard"]) == {"tp_rank", "tp_size", "num_kv_heads"}  # readers before CP read it too


@pytest.mark.parametrize(
    ("shard", "bs", "message"),
    [
        (Shard(0, 1, 1, 0, 2, 3), 8, "cp_interleave=3 does not divide the src cache's blocks of 8 tokens"),
    ],
)
def test_what_cp_maps_refuse(shard: Shard, bs: int, message: str) -> None:
    src = _mla(F.NL_X_NB_BS_HS, 4, bs, shard, 1)
    dst = _mla(F.NL_X_NB_BS_HS, 4, bs, Shard(0, 1, 1), 2)
    with pytest.raises(BlockMapError, match=message):
        block_map(src.kv, dst.kv, [0], [0, 1], num_tokens=16, src_shard=shard)


def test_a_cp_block_list_counts_virtual_blocks() -> None:
    """Under DCP a block id stands for ``cp_size * BS`` of the request's tokens: a list of
    one id a local block's tokens is refused, naming the blocks it should have."""
    shard = Shard(0, 2, 1, 0, 2, 1)
    src, dst = _mla(F.NL_X_NB_BS_HS, 4, 8, shard, 1), _mla(F.NL_X_NB_BS_HS, 4, 8, Shard(0, 1, 1), 2)
    with pytest.raises(
        BlockMapError, match=r"src_blocks has 4 block ids; the request's 32 tokens .* fill 2 blocks of 16"
    ):
        block_map(src.kv, dst.kv, [0, 1, 2, 3], [0, 1, 2, 3], num_tokens=32, src_shard=shard)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(cp_rank=2, cp_size=2), "Shard.cp_rank=2 is out of range for cp_size=2"),
        (dict(cp_size=0), "Shard.cp_size must be >= 1, got 0"),
        (dict(cp_interleave=0), "Shard.cp_interleave must be >= 1, got 0"),
        (dict(cp_size=10**30), r"cp_size=10{30} \* cp_interleave=1 tokens a round .* more than 2\*\*62"),
        (dict(cp_size=1 << 31, cp_interleave=1 << 32), "a round of the CP ranks is more than 2"),
    ],
)
def test_a_cp_shard_that_no_split_makes_is_refused(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ShardError, match=message):
        Shard(0, 1, 1, **kwargs)


def test_sends_to_leaves_source_cp_ranks_to_the_maps() -> None:
    with pytest.raises(
        ShardError, match="under context parallelism each source CP rank holds its own tokens"
    ):
        Shard(0, 2, 1, 0, 2, 1).sends_to(Shard(0, 1, 1))
    with pytest.raises(ShardError, match="each source CP rank"):
        Shard(0, 2, 1, 0, 2, 1).sends_to(Shard(0, 2, 1, 0, 2, 1))


@pytest.mark.parametrize("interleave", [1, 16])
def test_a_prefill_without_cp_picks_one_replica_for_each_decode_cp_rank(interleave: int) -> None:
    """MLA prefill at TP 2 without CP into decode at TP 4, DCP 4: both prefill ranks hold
    every token, so ``sends_to`` picks one per decode rank as without CP, vLLM's rule
    (``compute_tp_mapping``: an MLA decode rank reads remote rank ``tp_rank * remote_tp //
    tp``, for a remote DCP of 1, whatever its own DCP): decode ranks 0-1 read prefill rank 0,
    2-3 rank 1, and the chosen map moves the rank's tokens by vLLM's slot mapping."""
    ids_src, ids_dst = [4, 1, 2, 7, 0], [1, 0]  # 70 tokens: 5 blocks of 16, 2 virtual blocks of 64
    srcs = [_mla(F.NL_X_NB_BS_HS, 8, 16, Shard(p, 2, 1), 1) for p in range(2)]
    for rank in range(4):
        shard = Shard(rank, 4, 1, rank, 4, interleave)
        senders = [p for p in range(2) if Shard(p, 2, 1).sends_to(shard)]
        assert senders == [rank * 2 // 4]
        dst = _mla(F.NL_X_NB_BS_HS, 3, 16, shard, 2 + rank)
        check_map(srcs[senders[0]], dst, ids_src, ids_dst, 70, 1)


def test_two_splits_of_many_ranks_cost_what_a_rank_holds_not_the_request() -> None:
    """Two CP splits of 65535 and 65534 ranks: a request that fills four blocks of 16 on each
    rank is 4M tokens, of which the two ranks have one in common. The map finds it from one
    rank's share (64 tokens), not by testing every token of the request (a peer's
    description may say such a split: the request grows with it, the caches do not)."""
    a, b = Shard(0, 1, 1, 0, 65535, 1), Shard(0, 1, 1, 0, 65534, 1)
    src, dst = _mla(F.NL_X_NB_BS_HS, 4, 16, a, 1), _mla(F.NL_X_NB_BS_HS, 4, 16, b, 2)
    tokens = 4 * 16 * 65534
    tracemalloc.start()
    try:
        m = block_map(src.kv, dst.kv, [0, 1, 2, 3], [3, 2, 1, 0], num_tokens=tokens, src_shard=a, dst_shard=b)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert m.kind == "token slice" and m.num_bytes == 2 * 8  # token 0 of 2 layers, 8 bytes each
    assert peak < 8 << 20, peak  # an int64 per token of the request was 32 MiB an array (132 MiB in all)
    m.copy()
    for layer in range(2):
        src_rows = src.reg.bases[layer].view(4, 16, 8)
        assert torch.equal(dst.reg.bases[layer].view(4, 16, 8)[3, 0], src_rows[0, 0])


# vLLM's HND cache, FlashInfer's (K/V inside a block) and cross-layer caches (blocks outside layers)
PREFILL_INTO = [F.NL_X_TWO_NB_NH_BS_HS, F.NL_X_NB_TWO_NH_BS_HS, F.NL_X_NB_TWO_BS_NH_HS, F.NB_NL_TWO_NH_BS_HS,
                F.NB_NL_TWO_BS_NH_HS]  # fmt: skip


@pytest.mark.parametrize("fmt", PREFILL_INTO)
@pytest.mark.parametrize(("interleave", "first"), [(1, 0), (1, 13), (4, 21), (8, 70)])
def test_a_prefill_into_a_cp_rank_walks_the_rank_s_blocks_in_memory_order(
    fmt: F, interleave: int, first: int
) -> None:
    """A side without CP into a DCP rank: every token of the rank's blocks from the first
    moved on is moved, so the builder walks its whole blocks, in memory order whatever the
    destination's nest. Granules inside them were walked a granule at a time and the runs
    sorted: 28 ms for 32 layers of 1024 tokens into HND, 0.2 now. The builder now walks a
    block's granules head by head in order where slabs lie outside blocks (HND), but not
    where blocks lie outside slabs (FlashInfer's K/V inside a block, cross-layer caches):
    there only whole blocks keep the walk in order."""
    whole, shard = Shard(0, 1, 2), Shard(0, 1, 2, 1, 2, interleave)
    common: dict[str, Any] = dict(layers=2, heads=2, row=2, planes=1, kv=2, dtype=torch.uint8, pad=0)
    src = make_side(F.NL_X_TWO_NB_NH_BS_HS, blocks=16, bs=8, shard=whole, seed=7, **common)
    dst = make_side(fmt, blocks=8, bs=8, shard=shard, seed=8, **common)
    src_ids, dst_ids = [9, 3, 0, 12, 5, 6, 1, 2, 14, 7, 4, 8, 11], [6, 1, 7, 2, 0, 3, 4]
    check_map(src, dst, src_ids, dst_ids, 100, 1, first)
    m = block_map(src.kv, dst.kv, src_ids, dst_ids, num_tokens=100, first_token=first, dst_shard=shard)
    (a, b), (sa, sb), (lo, hi) = m._ids, m._page_sizes, m._slots
    pair = m._pair
    _, runs, in_order = _native.build_groups(
        pair.slabs, pair.group_starts, pair.order, len(pair.heads), hi, a, sa, b, sb,
        pair.src_classes, pair.dst_classes, first_token=lo,
        src_page_slots=m._page_slots[0], dst_page_slots=m._page_slots[1],
    )  # fmt: skip
    assert in_order and runs == m.num_runs


HEADS_OUTSIDE_SLOTS = [f for f in MHA if f.name.index("NH") < f.name.index("BS")]  # HND and its kin


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_a_cp_rank_into_heads_outside_slots_moves_its_tokens_in_memory_order(data: st.DataObject) -> None:
    """A DCP rank (any MHA source) into a cache whose heads lie outside its slots, without CP
    or at another split: the rank's granules are pages inside the destination's blocks,
    often several a block. The map is held to vLLM's slot mapping (``check_map``), and
    where the destination's nest is slab, block, head, slot, its build comes out in
    destination order (no sort: each block's heads walked outside its pages)."""
    fmt_src, fmt_dst = data.draw(st.sampled_from(MHA)), data.draw(st.sampled_from(HEADS_OUTSIDE_SLOTS))
    heads = data.draw(st.sampled_from([2, 3, 4]))  # a head level in the nest: two heads in common at least
    dst_tp = Shard(0, 1, heads)
    bs_src, bs_dst = data.draw(st.sampled_from([2, 4, 8, 16])), data.draw(st.sampled_from([4, 8, 16]))
    # a round of the ranks (interleave * size tokens) shorter than a destination block, mostly
    size = data.draw(st.sampled_from([2, 4]))
    interleave = data.draw(st.sampled_from([i for i in (1, 2, 4) if bs_src % i == 0]))
    src_shard = Shard(0, 1, heads, data.draw(st.integers(0, size - 1)), size, interleave)
    # mostly no CP, else any split (cp_shards: 1 rank half the time)
    dst_shard = data.draw(st.one_of(st.just(dst_tp), st.just(dst_tp), cp_shards(dst_tp, bs_dst)))
    r = data.draw(cp_requests(src_shard, bs_src, dst_shard, bs_dst))
    common: dict[str, Any] = dict(
        layers=data.draw(st.integers(1, 2)), row=2, planes=1, kv=2, dtype=torch.uint8
    )
    src = make_side(fmt_src, blocks=r["nb_src"], bs=bs_src, heads=len(src_shard.heads), pad=data.draw(st.integers(0, 1)),
                    shard=src_shard, seed=11, **common)  # fmt: skip
    dst = make_side(fmt_dst, blocks=r["nb_dst"], bs=bs_dst, heads=len(dst_shard.heads), pad=data.draw(st.integers(0, 1)),
                    shard=dst_shard, seed=12, **common)  # fmt: skip
    check_map(src, dst, r["src_ids"], r["dst_ids"], r["tokens"], 1, r["first"])
    m = block_map(
        src.kv, dst.kv, r["src_ids"], r["dst_ids"], num_tokens=r["tokens"], first_token=r["first"],
        src_shard=src_shard, dst_shard=dst_shard, src_block_size=bs_src, dst_block_size=bs_dst,
    )  # fmt: skip
    pair = m._pair
    if pair.order != (0, 1, 3, 2):  # slab, block, head, slot
        return
    (a, b), (sa, sb), (lo, hi) = m._ids, m._page_sizes, m._slots
    _, runs, in_order = _native.build_groups(
        pair.slabs, pair.group_starts, pair.order, len(pair.heads), hi, a, sa, b, sb,
        pair.src_classes, pair.dst_classes, first_token=lo, src_page_slots=m._page_slots[0],
        dst_page_slots=m._page_slots[1],
    )  # fmt: skip
    assert in_order and runs == m.num_runs


@pytest.mark.parametrize("fmt_src", [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS])
@pytest.mark.parametrize(
    ("src_cp", "dst_cp", "bs_dst", "first"),
    [
        ((1, 4, 1), (0, 1, 1), 8, 0),
        ((1, 4, 1), (0, 1, 1), 8, 13),
        ((3, 4, 2), (0, 1, 1), 16, 21),  # two granules of 2 in each destination block of 16
        ((1, 4, 1), (0, 2, 2), 8, 0),  # both CP: every other slot of the destination's blocks
    ],
)
def test_a_cp_rank_into_an_hnd_side_walks_each_block_head_by_head(
    fmt_src: F, src_cp: tuple[int, int, int], dst_cp: tuple[int, int, int], bs_dst: int, first: int
) -> None:
    """A DCP rank into an HND cache (heads outside slots) that holds more of the request
    (no CP, or a coarser split): the rank's granules are pages inside the destination's
    blocks, several a block. Walked a page at a time, each page's heads went back in the
    destination at every page, and the runs were sorted (5.2 ms for 32 layers of 1024
    tokens at interleave 1); the builder walks each block's heads outside its pages, in
    memory order, and the runs are those the sort gave (``check_map`` holds them to vLLM's
    slot mapping, the fewest runs and the sorting path)."""
    common: dict[str, Any] = dict(layers=2, heads=2, row=2, planes=1, kv=2, dtype=torch.uint8, pad=0)
    src_shard, dst_shard = Shard(0, 1, 2, *src_cp), Shard(0, 1, 2, *dst_cp)
    src = make_side(fmt_src, blocks=8, bs=8, shard=src_shard, seed=9, **common)
    dst = make_side(F.NL_X_TWO_NB_NH_BS_HS, blocks=16, bs=bs_dst, shard=dst_shard, seed=10, **common)
    tokens = 100
    src_ids = [5, 2, 7, 0][: -(-tokens // (8 * src_cp[1]))]
    dst_ids = [9, 3, 0, 12, 5, 6, 1, 2, 14, 7, 4, 8, 11][: -(-tokens // (bs_dst * dst_cp[1]))]
    check_map(src, dst, src_ids, dst_ids, tokens, 1, first)
    m = block_map(
        src.kv, dst.kv, src_ids, dst_ids, num_tokens=tokens, first_token=first, src_shard=src_shard,
        dst_shard=dst_shard,
    )  # fmt: skip
    (a, b), (sa, sb), (lo, hi) = m._ids, m._page_sizes, m._slots
    pair, (src_slots, dst_slots) = m._pair, m._page_slots
    assert dst_slots is not None and len(set(b.tolist())) < len(b)  # pages that share blocks
    _, runs, in_order = _native.build_groups(
        pair.slabs, pair.group_starts, pair.order, len(pair.heads), hi, a, sa, b, sb,
        pair.src_classes, pair.dst_classes, first_token=lo, src_page_slots=src_slots, dst_page_slots=dst_slots,
    )  # fmt: skip
    assert in_order and runs == m.num_runs


@pytest.mark.parametrize("case", list(SHARING))
@pytest.mark.parametrize(
    ("src_cp", "dst_cp"), [((0, 1, 1), (1, 2, 2)), ((1, 2, 4), (0, 1, 1)), ((0, 2, 1), (0, 4, 2))]
)
def test_layers_that_share_one_kv_cache_move_once_between_cp_ranks(
    case: str, src_cp: tuple[int, int, int], dst_cp: tuple[int, int, int]
) -> None:
    """vLLM's cross-layer KV sharing under DCP: a shared layer reads and writes as its
    target, once, on re-paged maps as on whole blocks."""
    (sf, s_tp), (df, d_tp), (s_bs, d_bs), s_shares, d_shares = SHARING[case]
    mla = layout(sf).is_mla
    sides = []
    for fmt, bs, tp, cp, shares, seed in (
        (sf, s_bs, s_tp, src_cp, s_shares, 1),
        (df, d_bs, d_tp, dst_cp, d_shares, 2),
    ):
        shard = Shard(0, tp, 4, *cp)
        side = make_side(fmt, layers=4, blocks=8, bs=bs, heads=1 if mla else len(shard.heads), row=8 if mla else 2,
                         planes=1, kv=1 if mla else 2, dtype=torch.uint8, pad=0, shard=shard, seed=seed)  # fmt: skip
        sides.append(shared(side, shares))
    src, dst = sides
    tokens = 29
    src_ids = [5, 0, 3, 1, 7, 2, 6, 4][: -(-tokens // (s_bs * src.shard.cp_size))]
    dst_ids = [2, 4, 1, 0, 6, 7, 3, 5][: -(-tokens // (d_bs * dst.shard.cp_size))]
    check_map(src, dst, src_ids, dst_ids, tokens, 1, 3)


def test_whether_two_splits_share_a_token_is_answered_from_a_rank_s_share() -> None:
    """overlap() (a map's kind 'empty': nothing in common) against every token of one round
    of both patterns, and in bounded memory for splits of thousands of ranks (it tested
    every token of the round: 100 MiB for 2048 against 2047 ranks)."""
    for ca, cb, ia, ib in itertools.product([1, 2, 3, 4, 6], [1, 2, 3, 4, 8], [1, 2, 3, 8], [1, 2, 4, 6]):
        for ra, rb in itertools.product(range(ca), range(cb)):
            a, b = TokenSlice(ca, ra, ia if ca > 1 else 1), TokenSlice(cb, rb, ib if cb > 1 else 1)
            p = np.arange(math.lcm(a.interleave * a.size, b.interleave * b.size))
            assert overlap(a, b) == bool((a.holds(p) & b.holds(p)).any()), (a, b)
    tracemalloc.start()
    try:
        assert overlap(TokenSlice(2048, 5, 1), TokenSlice(2047, 7, 1))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_an_sglang_dcp_rank_moves_its_latents_into_a_vllm_cache_without_cp() -> None:
    """SGLang's DCP (``--dcp-size c``): the allocator pages a widened token space at
    ``page_size * c`` (``req_to_token`` holds those virtual locations, a request's tokens in
    order within a page), and rank ``v % c`` keeps location ``v`` at row ``v // c`` of its
    pool (``layers/dcp/layout.py``: ``plan_dcp_owner_write``, ``dcp_local_kv_block_table``).
    That is ``Shard(cp_interleave=1)`` in blocks of ``page_size``, a block id an allocator
    page: each rank's rows move into vLLM's cache without CP and back, byte for byte."""
    nl, page, c, tokens, vbs = 2, 8, 4, 150, 16
    pages = [5, 1, 3, 7, 2]  # allocator pages of page * c tokens (SGLang leaves page 0 unused)
    p = np.arange(tokens)
    req_to_token = np.array(pages)[p // (page * c)] * (page * c) + p % (page * c)
    latents = torch.randn(nl, tokens, 576, dtype=torch.bfloat16)
    pools = [[torch.zeros(8 * page, 1, 576, dtype=torch.bfloat16) for _ in range(nl)] for _ in range(c)]
    for pos, v in enumerate(req_to_token.tolist()):  # SGLang's owner write
        for layer in range(nl):
            pools[v % c][layer][v // c, 0] = latents[layer, pos]
    dst_ids = [9, 0, 4, 2, 11, 6, 1, 8, 3, 10]  # vLLM, no CP: 10 blocks of 16
    kv = [torch.zeros(12, vbs, 576, dtype=torch.bfloat16) for _ in range(nl)]
    vllm_mla = kvlayout.detect(kv, "vllm")
    for rank in range(c):
        shard = Shard(rank, c, 1, cp_rank=rank, cp_size=c, cp_interleave=1)
        sgl = kvlayout.detect(pools[rank], "sglang")
        m = block_map(sgl, vllm_mla, pages, dst_ids, num_tokens=tokens, src_shard=shard, src_block_size=page)
        assert m.kind.startswith("token slice") and m.num_bytes == nl * len(p[p % c == rank]) * 576 * 2
        m.copy()
        back = [torch.zeros_like(t) for t in pools[rank]]
        block_map(vllm_mla, kvlayout.detect(back, "sglang"), dst_ids, pages, num_tokens=tokens,
                  dst_shard=shard, dst_block_size=page).copy()  # fmt: skip
        assert all(torch.equal(b, t) for b, t in zip(back, pools[rank], strict=True))
    for pos in range(tokens):
        for layer in range(nl):
            assert torch.equal(kv[layer][dst_ids[pos // vbs], pos % vbs], latents[layer, pos])


def test_a_vllm_prefill_without_cp_fans_out_to_atom_dcp_ranks() -> None:
    """ATOM's DCP (``decode_context_parallel_size`` W, ``dcp_config.interleave_size`` S):
    consumer rank r's local token L (block ``L // BS``, slot ``L % BS`` of its block list)
    is the producer's token ``((L // S) * W + r) * S + L % S``, blocks of one size on both
    sides (``kv_transfer/disaggregation/sharded_transfer.py``, ``build_dcp_shard_plan``).
    That is ``Shard(cp_interleave=S)``: a vLLM prefill's latents land where ATOM's plan puts
    them, every other byte of the rank's cache unchanged."""
    nl, bs, w, tokens = 2, 16, 4, 150
    src_ids = [3, 10, 0, 7, 5, 1, 11, 8, 2, 6]  # ceil(150 / 16) producer blocks
    kv = [torch.randn(12, bs, 576, dtype=torch.bfloat16) for _ in range(nl)]
    prefill = kvlayout.detect(kv, "vllm")
    for s, rank in itertools.product([1, 4, 16], range(w)):
        dst_ids = [4, 0, 2]  # build_dcp_shard_plan's dst_pages: ceil(10 / W)
        cache = [torch.randn(6, bs, 576, dtype=torch.bfloat16) for _ in range(nl)]
        before = [t.clone() for t in cache]
        shard = Shard(rank, w, 1, cp_rank=rank, cp_size=w, cp_interleave=s)
        block_map(prefill, kvlayout.detect(cache, "atom"), src_ids, dst_ids, num_tokens=tokens,
                  dst_shard=shard).copy()  # fmt: skip
        written = torch.zeros(6, bs, dtype=torch.bool)
        for local in range(len(dst_ids) * bs):  # ATOM's plan, a token at a time
            global_ = ((local // s) * w + rank) * s + local % s
            if global_ >= tokens:
                continue
            block, slot = dst_ids[local // bs], local % bs
            written[block, slot] = True
            for layer in range(nl):
                assert torch.equal(cache[layer][block, slot], kv[layer][src_ids[global_ // bs], global_ % bs])
        for layer in range(nl):
            assert torch.equal(cache[layer][~written], before[layer][~written])


def test_sglang_page_interleaved_kv_shards_are_a_cp_split_a_page_at_a_time() -> None:
    """SGLang's logical-page KV sharding (``enable_kv_cache_sharding``, MLA over the
    attention-TP group of ``N`` ranks): location ``loc = Q*(N*ps) + r*ps + o`` is owned by rank
    ``r`` at its pool row ``Q*ps + o`` (``mem_cache/page_interleave.py``,
    ``PageInterleavePlacement``), and every location is congruent to its token position mod
    ``N*ps``, a fresh group adopted where a prefix hit ends inside one (the allocator's
    invariant I3, ``allocator/page_interleave.py``). Rank ``r`` thus holds the request's pages
    ``j`` with ``j % N == r`` in order: ``Shard(cp_interleave=ps)`` in blocks of ``ps``, its
    block list the groups of those pages (SGLang's P/D ``filter_kv_indices_for_shard_rank``
    hands rank ``r`` the same), which may differ between ranks across an adoption seam. Each
    rank's rows land in a vLLM cache without CP where the placement puts them, every other
    byte unchanged, and map back byte for byte."""
    nl, ps, n, tokens, vbs = 2, 8, 4, 150, 16
    gs = n * ps
    groups = [3, 9, 7, 2, 11]  # a group a round of gs tokens
    loc = np.empty(tokens, dtype=np.int64)
    for pos in range(tokens):
        # a prefix hit of 48 tokens ends inside round 1's group: its pages 2-3 in an adopted group 12
        q = groups[pos // gs] if pos // gs != 1 or pos % gs < 2 * ps else 12
        loc[pos] = q * gs + pos % gs
    latents = torch.randn(nl, tokens, 576, dtype=torch.bfloat16)
    pools = [[torch.zeros(13 * ps, 1, 576, dtype=torch.bfloat16) for _ in range(nl)] for _ in range(n)]
    for pos, v in enumerate(loc.tolist()):  # PageInterleavePlacement: owner_of, local_index
        owner, row = (v % gs) // ps, (v // gs) * ps + v % ps
        for layer in range(nl):
            pools[owner][layer][row, 0] = latents[layer, pos]
    dst_ids = [9, 0, 4, 2, 11, 6, 1, 8, 3, 10]  # vLLM, no CP: 10 blocks of 16
    kv = [torch.randn(12, vbs, 576, dtype=torch.bfloat16) for _ in range(nl)]
    before = [t.clone() for t in kv]
    vllm_mla = kvlayout.detect(kv, "vllm")
    rounds = -(-tokens // gs)
    for rank in range(n):
        # SGLang's P/D list for the rank (filter_kv_indices_for_shard_rank): the group of each of
        # the request's pages j with j % N == rank, in order (rank 3 holds no page of the last round)
        ids = [int(loc[j * ps]) // gs for j in range(-(-tokens // ps)) if j % n == rank]
        assert len(ids) == (rounds if rank < 3 else rounds - 1)
        assert rank != 2 or ids[1] == 12  # rank 2's page of round 1 is in the adopted group
        shard = Shard(rank, n, 1, cp_rank=rank, cp_size=n, cp_interleave=ps)
        sgl = kvlayout.detect(pools[rank], "sglang")
        m = block_map(sgl, vllm_mla, ids, dst_ids, num_tokens=tokens, src_shard=shard, src_block_size=ps)
        held = [pos for pos in range(tokens) if (pos // ps) % n == rank]
        assert m.kind.startswith("token slice") and m.num_bytes == nl * len(held) * 576 * 2
        m.copy()
        back = [torch.zeros_like(t) for t in pools[rank]]
        block_map(vllm_mla, kvlayout.detect(back, "sglang"), dst_ids, ids, num_tokens=tokens,
                  dst_shard=shard, dst_block_size=ps).copy()  # fmt: skip
        assert all(torch.equal(b, t) for b, t in zip(back, pools[rank], strict=True))
    written = torch.zeros(12, vbs, dtype=torch.bool)
    for pos in range(tokens):
        block, slot = dst_ids[pos // vbs], pos % vbs
        written[block, slot] = True
        for layer in range(nl):
            assert torch.equal(kv[layer][block, slot], latents[layer, pos])
    for layer in range(nl):
        assert torch.equal(kv[layer][~written], before[layer][~written])


def _trtllm_global_block(local: int, cp_size: int, cp_rank: int, num_blocks: int, round_robin: bool) -> int:
    """TRT-LLM's ``getGlobalBlockIdAccountingForCP`` (``cacheSplitConcat.cu``): the request's
    block that a generation CP rank's local block ``local`` receives from a context without CP."""
    if round_robin:  # common::getEnvUseRoundRobinBlockDistForCP()
        return local * cp_size + cp_rank
    fewest = num_blocks // cp_size
    return fewest * cp_rank + min(cp_rank, num_blocks % cp_size) + local


def _trtllm_rank_blocks(cp_size: int, cp_rank: int, num_blocks: int) -> int:
    """TRT-LLM's ``getBlockNumAccountingForCP``: how many of the request's blocks a CP rank gets."""
    return num_blocks // cp_size + (num_blocks % cp_size > cp_rank)


@pytest.mark.parametrize("round_robin", [False, True])
def test_trtllm_helix_ranks_take_the_prompt_s_blocks(round_robin: bool) -> None:
    """TRT-LLM Helix P/D (MLA, a context without CP into generation CP ranks): CP rank ``r``'s
    local block ``i`` receives the request's block ``getGlobalBlockIdAccountingForCP(i, c, r,
    B)`` whole. By default the ranks split the ``B`` blocks into contiguous ranges (the first
    ``B % c`` ranks one more), a range that moves with ``B``: no Shard says it, and a
    connector maps the rank's range as a request of its own, the context's block list cut at
    the range (a plain map, no CP). Under round-robin distribution rank ``r`` holds blocks
    ``r, r + c, ...``: ``Shard(cp_interleave=tokens_per_block)``, each rank's list its own
    blocks (one fewer than a round of the request's blocks where it holds none of the last
    round: accepted). Every received token lands where TRT-LLM puts it, every other byte of
    the rank's pool unchanged."""
    nl, tpb, c, tokens = 3, 16, 4, 150
    num_blocks = -(-tokens // tpb)  # 10: ranks 0-1 get 3 blocks, ranks 2-3 two
    ctx_ids = [3, 10, 0, 7, 5, 1, 11, 8, 2, 6]
    ctx_pool = torch.randn(12, nl, 1, tpb * 576).to(torch.bfloat16)  # TRT-LLM's K-only MLA pool
    ctx = kvlayout.detect(ctx_pool, "trtllm", {"tokens_per_block": tpb, "head_dim": 576})
    for rank in range(c):
        count = _trtllm_rank_blocks(c, rank, num_blocks)
        gen_ids = [4, 0, 2][:count]
        gen_pool = torch.randn(6, nl, 1, tpb * 576).to(torch.bfloat16)
        before = gen_pool.clone()
        gen = kvlayout.detect(gen_pool, "trtllm", {"tokens_per_block": tpb, "head_dim": 576})
        if round_robin:
            shard = Shard(rank, c, 1, cp_rank=rank, cp_size=c, cp_interleave=tpb)
            m = block_map(ctx, gen, ctx_ids, gen_ids, num_tokens=tokens, dst_shard=shard)
        else:
            first = _trtllm_global_block(0, c, rank, num_blocks, round_robin)
            m = block_map(ctx, gen, ctx_ids[first : first + count], gen_ids,
                          num_tokens=min(count * tpb, tokens - first * tpb))  # fmt: skip
        m.copy()
        written = torch.zeros(6, tpb, dtype=torch.bool)
        for local in range(count):
            block = _trtllm_global_block(local, c, rank, num_blocks, round_robin)
            for slot in range(min(tpb, tokens - block * tpb)):
                written[gen_ids[local], slot] = True
                rows = gen_pool[gen_ids[local], :, 0].view(nl, tpb, 576)[:, slot]
                assert torch.equal(rows, ctx_pool[ctx_ids[block], :, 0].view(nl, tpb, 576)[:, slot])
        assert m.num_bytes == int(written.sum()) * nl * 576 * 2
        mask = written[:, None, None, :, None].expand(6, nl, 1, tpb, 576).reshape(gen_pool.shape)
        assert torch.equal(gen_pool[~mask], before[~mask])


def test_a_cp_rank_s_block_list_may_stop_at_its_own_last_block() -> None:
    """A CP rank that holds none of the request's last round of blocks names either a block
    for every round (vLLM's shared block table) or only the blocks its tokens fill (TRT-LLM
    Helix's round-robin ranks): both map its tokens alike; any other count is refused, naming
    both."""
    shard = Shard(3, 4, 1, 3, 4, 16)  # 150 tokens in blocks of 16: rank 3 holds 48-63 and 112-127
    src = _mla(F.NL_X_NB_BS_HS, 12, 16, Shard(0, 1, 1), 1)
    dst = _mla(F.NL_X_NB_BS_HS, 6, 16, shard, 2)
    src_ids = [3, 10, 0, 7, 5, 1, 11, 8, 2, 6]
    check_map(src, dst, src_ids, [4, 0, 2], 150, 1)
    check_map(src, dst, src_ids, [4, 0], 150, 1)
    own = block_map(src.kv, dst.kv, src_ids, [4, 0], num_tokens=150, dst_shard=shard)
    every = block_map(src.kv, dst.kv, src_ids, [4, 0, 2], num_tokens=150, dst_shard=shard)
    assert np.array_equal(own.runs, every.runs) and own.num_bytes == 2 * 32 * 8
    with pytest.raises(
        BlockMapError,
        match=r"dst_blocks has 1 block ids; the request's 150 tokens \(num_tokens\) fill 3 blocks of 64 "
        r"\(or 2, the blocks of 16 its CP rank's own 32 tokens fill\)",
    ):
        block_map(src.kv, dst.kv, src_ids, [4], num_tokens=150, dst_shard=shard)
    # a rank that holds tokens of the last round names a block for it: one fewer is refused
    with pytest.raises(BlockMapError, match=r"dst_blocks has 2 block ids; .* fill 3 blocks of 64$"):
        block_map(src.kv, dst.kv, src_ids, [4, 0], num_tokens=150, dst_shard=Shard(1, 4, 1, 1, 4, 16))
