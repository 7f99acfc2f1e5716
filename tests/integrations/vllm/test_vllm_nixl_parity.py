"""Parity with the connector vLLM 0.33 ships (``kv_connector/v1/nixl``): every request its
decode worker READs (heterogeneous TP either way, prefill blocks smaller than decode's, a
prefill LBHNC cache into a decode LBNHC one under ``enable_permute_local_kv``, MLA latents
read whole from the one prefill rank ``compute_tp_mapping`` picks, a prefix the
decode's cache already holds, a partly filled last block; a Mamba hybrid's state groups
beside its attention, at TP 1 <-> 2 and 2 <-> 4), mapped by kvlayout as
docs/pd-connectors.md says, lands byte-exact, from the prefill ranks the connector reads,
and a decode READ of it posts no more descriptors than the connector's READs.

Three things are compared, on caches vLLM 0.33 allocates (``kvlayout.testing.vllm``:
``allocate_v033``'s per-layer ``[B, H, N, C]`` views, K and V packed in ``C``):

- the engine's own indexing (the oracle): token ``t`` of the request is slot ``t % BS``
  of block ``block_ids[t // BS]`` on each side (``view[block, head, slot]``), the decode
  rank's heads those ``ModelConfig.get_num_kv_heads`` gives it; a map must write exactly
  those slots of the tokens it moves, and no other byte;
- vLLM's connector itself, its descriptor math run from its source
  (``nixl_connector.decode_read``): where it is right it lands the same tokens; where a
  decode-side prefix hit meets a block-size ratio and the prompt does not fill the
  decode's last block, it end-trims the prefill's block list to the expanded decode list
  (``_apply_prefix_caching`` after ``_map_block_ids_for_block_size_ratio``) and lands
  earlier tokens in their place, which is checked too;
- the descriptors: the connector moves whole prefill blocks (a partly filled last one
  too); mapped with ``num_tokens`` the slots the prefill blocks hold (the recipe in
  docs/pd-connectors.md), the fewer of kvlayout's decode-posted strategies (direct,
  staged) takes no more than the connector's READ from each prefill rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

import kvlayout
from kvlayout.transfer import Shard, block_map, join_maps
from kvlayout.transfer import nixl as nx

vx = pytest.importorskip("kvlayout.testing.vllm")
nc = pytest.importorskip("tests.integrations.vllm.nixl_connector")
ph = pytest.importorskip("tests.integrations.vllm.pd_hybrid")

HEADS = 4
MODEL = vx.AttentionModel("tiny", 2, HEADS, 16, torch.bfloat16)
HND, NHD = vx.KVCacheLayout.LBHNC, vx.KVCacheLayout.LBNHC
PREFILL_IDS = [3, 1, 7, 10, 5, 9, 2, 11, 4, 6]  # a request's blocks of 16 (any order)
DECODE_IDS = [8, 5, 2, 10, 3, 7, 11, 1, 4, 6]  # never vLLM's null block 0


@dataclass(frozen=True)
class Pair:
    prefill_tp: int
    prefill_bs: int
    prefill_layout: Any
    decode_tp: int
    decode_bs: int
    decode_layout: Any
    mla: bool = False  # DeepSeek's latents, [B, 1, N, 576], whole on every rank

    @property
    def kv_heads(self) -> int:
        return 1 if self.mla else HEADS

    @property
    def permute(self) -> bool:  # enable_permute_local_kv: LBHNC prefill into an LBNHC decode
        return self.prefill_layout is HND and self.decode_layout is NHD


PAIRS = {
    "same": Pair(1, 16, HND, 1, 16, HND),
    "TP 1 -> 2": Pair(1, 16, HND, 2, 16, HND),
    "TP 2 -> 1": Pair(2, 16, HND, 1, 16, HND),
    "TP 1 -> 4": Pair(1, 16, HND, 4, 16, HND),
    "blocks 16 -> 64": Pair(1, 16, HND, 1, 64, HND),
    "TP 1 -> 2, blocks 16 -> 64": Pair(1, 16, HND, 2, 64, HND),
    "LBHNC -> LBNHC": Pair(1, 16, HND, 1, 16, NHD),
    "LBHNC -> LBNHC, blocks 16 -> 64": Pair(1, 16, HND, 1, 64, NHD),
    "LBNHC": Pair(1, 16, NHD, 1, 16, NHD),
    "MLA TP 2 -> 4": Pair(2, 64, HND, 4, 64, HND, mla=True),
    "MLA TP 4 -> 2": Pair(4, 64, HND, 2, 64, HND, mla=True),
}
# (prompt tokens, tokens decode's prefix cache holds: whole decode blocks)
REQUESTS = [(150, 0), (160, 64), (150, 128), (128, 128)]


def rank(pair: Pair, side: str, r: int, seed: int) -> Any:
    tp, bs, layout = (
        (pair.prefill_tp, pair.prefill_bs, pair.prefill_layout)
        if side == "prefill"
        else (pair.decode_tp, pair.decode_bs, pair.decode_layout)
    )
    if pair.mla:  # FlashMLA's blocks of 64
        spec = vx.kvi.MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
        engine = vx.uniform_engine(spec, vx.FLASHMLA, num_layers=2, num_blocks=12)
    else:
        engine = vx.attention_engine(MODEL, vx.FLASH_ATTN, block_size=bs, num_blocks=12, layout=layout, tp=tp)
    buf, views = vx.allocate_v033(engine)
    vx.fill_random(buf, seed)
    return nc.Rank(tp, r, bs, layout, buf, views, mla=pair.mla)


def registration(r: Any) -> Any:
    hints = {"kv_dim": 1} if r.mla else vx.hints(r.layout is HND)  # detected without the group edits
    return kvlayout.detect([r.views[n] for n in r.names], "vllm", hints)


def heads(tp: int, r: int, n: int = HEADS) -> list[int]:
    """``get_num_kv_heads``: rank ``r``'s KV heads (one, replicated, past ``n`` ranks;
    MLA's latents are one head every rank holds)."""
    return list(range(r * n // tp, (r + 1) * n // tp)) if tp <= n else [r * n // tp]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)  # random bytes hold NaNs: compare the bits


def rebased(view: torch.Tensor, buf: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``view`` (of ``buf``) over ``other``, a buffer of ``buf``'s size."""
    offset = (view.data_ptr() - buf.data_ptr()) // view.element_size()
    return other.view(view.dtype).as_strided(view.shape, view.stride(), offset)


def expected(
    decode: Any, prefill: list[Any], dids: list[int], pids: list[int], first: int, end: int
) -> torch.Tensor:
    """``decode``'s buffer after tokens ``[first, end)`` land, by the engine's indexing."""
    out: torch.Tensor = decode.buf.clone()
    for name in decode.names:
        view = rebased(decode.views[name], decode.buf, out)
        n = 1 if decode.mla else HEADS
        for j, head in enumerate(heads(decode.tp, decode.rank, n)):
            src = next(p for p in prefill if head in heads(p.tp, p.rank, n))  # replicas hold the same bytes
            k = heads(src.tp, src.rank, n).index(head)
            for t in range(first, end):
                slot = src.views[name][pids[t // src.block_size], k, t % src.block_size]
                view[dids[t // decode.block_size], j, t % decode.block_size] = slot
    return out


def tokens_agree(
    decode: Any, prefill: list[Any], dids: list[int], pids: list[int], first: int, end: int
) -> bool:
    """Whether ``decode`` holds tokens ``[first, end)`` as the engine indexes them (only
    their slots: vLLM zeroes, or fills, the rest of the blocks it reads into)."""
    want = expected(decode, prefill, dids, pids, first, end)
    for name in decode.names:
        got, ref = decode.views[name], rebased(decode.views[name], decode.buf, want)
        for t in range(first, end):
            block, row = dids[t // decode.block_size], t % decode.block_size
            if not torch.equal(bits(got[block, :, row]), bits(ref[block, :, row])):
                return False
    return True


@pytest.mark.parametrize(("num_tokens", "cached"), REQUESTS)
@pytest.mark.parametrize("name", list(PAIRS))
def test_a_decode_read_lands_what_vllm_s_connector_lands(name: str, num_tokens: int, cached: int) -> None:
    pair = PAIRS[name]
    # each rank's heads; MLA's ranks hold the same latents
    prefill = [rank(pair, "prefill", r, 10 + (0 if pair.mla else r)) for r in range(pair.prefill_tp)]
    pids = PREFILL_IDS[: -(-num_tokens // pair.prefill_bs)]
    dids = DECODE_IDS[: -(-num_tokens // pair.decode_bs)]
    computed = cached // pair.decode_bs  # local_num_computed_blocks
    # what vLLM hands the connector: the unhashed blocks alone; kvlayout takes the block
    # list from token 0, the cached blocks as anything (vLLM's null block 0)
    unhashed, kv_dids = dids[computed:], [0] * computed + dids[computed:]
    whole = len(pids) * pair.prefill_bs  # the slots the prefill blocks hold, as the connector moves them
    for d in range(pair.decode_tp):
        ours, theirs, blocks = (rank(pair, "decode", d, 5) for _ in range(3))
        reads = nc.decode_read(
            theirs, prefill, unhashed, pids, pair.kv_heads, enable_permute_local_kv=pair.permute
        )
        dst_shard, dst = Shard(d, pair.decode_tp, pair.kv_heads), registration(ours)
        senders = [p for p in prefill if Shard(p.rank, p.tp, pair.kv_heads).sends_to(dst_shard)]
        if cached == num_tokens:  # a full hit: the connector notifies, posts nothing
            assert reads == []
        else:
            assert [r.remote_rank for r in reads] == [p.rank for p in senders]  # compute_tp_mapping
        for p, read in zip(senders, reads or [None] * len(senders), strict=True):
            src_shard, src = Shard(p.rank, p.tp, pair.kv_heads), registration(p)
            m = block_map(src, dst, pids, kv_dids, num_tokens=num_tokens, first_token=cached,
                          src_shard=src_shard, dst_shard=dst_shard)  # fmt: skip
            assert m.copy() == (1 if m.num_runs else 0)
            # the recipe for the connector's descriptors: whole prefill blocks, the last one's
            # slots past the prompt too (decode writes them before it reads them)
            in_blocks = block_map(src, registration(blocks), pids, kv_dids, num_tokens=whole, first_token=cached,
                                  src_shard=src_shard, dst_shard=dst_shard)  # fmt: skip
            in_blocks.copy()
            described = block_map(src.describe(shard=src_shard), dst.describe(shard=dst_shard), pids, kv_dids,
                                  num_tokens=whole, first_token=cached)  # fmt: skip
            if read is None:
                assert described.num_runs == 0, "a full prefix hit moves nothing"
                continue
            e = nx.estimate(described, poster="dst")
            fewest = min(e.descriptors["direct"], e.descriptors["staged"])
            assert fewest <= read.descriptors, (name, p.rank, e.descriptors, read.descriptors)
        # kvlayout: the tokens from the cached prefix on, every slot by the engine's indexing, no other byte
        assert torch.equal(ours.buf, expected(ours, prefill, dids, pids, cached, num_tokens))
        assert torch.equal(blocks.buf, expected(blocks, prefill, dids, pids, cached, whole))
        # vLLM: the same tokens, but where it end-trims the prefill's blocks to a longer expanded list
        ratio = pair.decode_bs // pair.prefill_bs
        misaligned = (
            ratio > 1 and computed > 0 and len(unhashed) * ratio != len(pids) - cached // pair.prefill_bs
        )
        assert tokens_agree(theirs, prefill, dids, pids, cached, num_tokens) is not misaligned, name


# -- hybrids: Mamba state groups beside the attention of one model -----------------------

# vLLM 0.33's NixlConnector serves a hybrid between TP degrees whose kernel blocks agree (a
# block-size ratio is attention's alone, and "HMA does not support block size post
# processing"): the Qwen3-Next-like GDN model at TP 1 <-> 2 (blocks of 48: FlashInfer's HND
# kernel pages of 16, or FlashAttention's whole), and one whose blocks are 16 at TP 2 and 4,
# its 2 KV heads replicated at TP 4 (decode reads attention from one replica, state from all)
HYBRID_PAIRS = [
    ("gdn-hnd", 1, 2), ("gdn-hnd", 2, 1), ("gdn-fa-hnd", 1, 2), ("gdn-fa-hnd", 2, 1),
    ("small-gdn-hnd", 2, 4), ("small-gdn-hnd", 4, 2),
]  # fmt: skip
HYBRID_TOKENS = 150  # a partly filled last block in every pair


def hybrid_maps(
    p: Any, d: Any, tables: tuple[list[list[int]], list[list[int]]], num_tokens: int
) -> list[Any]:
    """One rank pair's maps, as docs/pd-connectors.md says (``pd_hybrid.pair_maps``)."""
    return [m for *_, m in ph.pair_maps(p.registration, d.registration, p, d, tables, num_tokens)]


@pytest.mark.parametrize(
    ("kind", "ptp", "dtp"), HYBRID_PAIRS, ids=[f"{k} TP {p}->{d}" for k, p, d in HYBRID_PAIRS]
)
def test_a_hybrid_decode_read_lands_what_vllm_s_connector_lands(kind: str, ptp: int, dtp: int) -> None:
    """A GDN hybrid's request (three state groups, one attention group) read by each decode
    rank as vLLM 0.33's NixlConnector reads it (``nixl_connector.hybrid_read``: its own
    descriptor math run from its source) and as kvlayout maps it: the same prefill ranks
    (attention from the one replica ``compute_tp_mapping`` picks, which ``sends_to``
    picks; state from every rank that holds a slice), byte-exact with vLLM's connector
    where the maps move whole prefill blocks as it does, the request's tokens alone by
    the engine's indexing (``pd_hybrid.expected``), in no more descriptors than its READs."""
    prefill = [ph.rank_of(kind, ptp, r, 100 + r) for r in range(ptp)]
    decode = ph.engine_of(kind, dtp)
    rng = np.random.default_rng(3)
    tables = (
        ph.block_tables(prefill[0].engine, HYBRID_TOKENS, rng),
        ph.block_tables(decode, HYBRID_TOKENS, rng),
    )
    specs = [g.kv_cache_spec for g in decode.config.kv_cache_groups]
    attention = next(i for i, s in enumerate(specs) if not ph.is_state(s))
    clipped = [  # what the scheduler hands the connector: a state group's running state alone
        [ph.running_state(t, s) if ph.is_state(s) else t for t, s in zip(table, specs, strict=True)]
        for table in tables
    ]
    whole = len(tables[0][attention]) * specs[attention].block_size  # the prefill blocks' slots
    for d in range(dtp):
        theirs, ours, blocks = (ph.rank_of(kind, dtp, d, 5) for _ in range(3))
        before = ours.buf.clone()
        reads = nc.hybrid_read(theirs, prefill, clipped[1], clipped[0], ph.HEADS[kind])
        heads = ph.HEADS[kind]
        senders, attention_from = [], []
        for p in prefill:
            maps = hybrid_maps(p, ours, tables, HYBRID_TOKENS)
            if not maps:
                continue
            senders.append(p.rank)
            if Shard(p.rank, ptp, heads).sends_to(Shard(d, dtp, heads)):
                attention_from.append(p.rank)
            request = join_maps(maps)
            assert request.copy() == 1
            join_maps(hybrid_maps(p, blocks, tables, whole)).copy()
            e = nx.estimate(request, poster="dst")
            read = next(r for r in reads if r.remote_rank == p.rank)
            assert min(e.descriptors["direct"], e.descriptors["staged"]) <= read.descriptors, (
                p.rank,
                e.descriptors,
            )
        assert [r.remote_rank for r in reads] == senders  # compute_tp_mapping's all_source_ranks
        assert [r.remote_rank for r in reads if attention in r.groups] == attention_from
        assert torch.equal(blocks.buf, theirs.buf), f"{int((blocks.buf != theirs.buf).sum())} bytes differ"
        assert torch.equal(ours.buf, ph.expected(ours, before, prefill, tables, HYBRID_TOKENS))
