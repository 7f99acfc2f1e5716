"""TRT-LLM's MLA transceiver where Helix meets attention DP, and DSA's masked indexer pool
meets a TP change and ``KVCacheManagerV2``, written on kvlayout as a connector would and
moved through real NIXL (this process's agent and a peer's, TCP on loopback), byte-exact
against TRT-LLM's own pairing and offsets. The walks of one case at a time are in
``test_trtllm_pd_nixl.py``, whose TRT-LLM helpers these reuse.

What TRT-LLM does (NVIDIA/TensorRT-LLM):

- Helix with attention DP (``tests/integration/defs/accuracy/test_disaggregated_serving.py``
  runs generation ``pp1dp2cp2``): ``TargetRanksInfoForDPImpl`` pairs inside the DP groups
  that hold the request, CP ranks on the generation side only; the generation rank takes
  the latents from ``mIRanks[(dpRank % mDomainTPSize) * mDomainPPSize + i]``
  (``MLACacheFormatter::pickRecvConnections``, its own DP rank spreading generation groups
  over the context's replicas) and ``MLACacheFormatter::needSendCache`` agrees on the
  context side (``tpRankInDpGroup % dup == destDPRank % dup``). The context rank splits the
  request's blocks over the CP ranks (``splitKVCacheForMLAKernel``).
- The masked indexer pool (``DSACacheManager`` with ``indexer_k_cache_layer_mask``) moves
  in the indexer pass after the latents, from the same context rank (TP-replicated, as the
  latents), its rows split in indexer layer space (``targetIRanksForIndexerKCache``).
- ``DSACacheManagerV2`` (``_torch/attention_backend/sparse/dsa.py``) keeps the index keys as
  one ``Role.INDEX_KEY`` buffer of ``tokens_per_block * 132`` bytes a full-indexer layer
  (``_extra_buffers_per_layer``), the bytes V1's indexer pool row holds; V2's Python
  transceiver moves them REPLICATED (``get_disagg_role_mapper_kinds``) by global layer id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("nixl")

import kvlayout
from kvlayout.integrations.trtllm import kv_cache_layout_pools
from kvlayout.testing.nixl_peer import AgentPair
from kvlayout.transfer import Shard, block_map
from kvlayout.transfer import nixl as nx
from tests.integrations.trtllm.test_trtllm_pd_nixl import (
    BLOCKS,
    BUILDER,
    CTX_BLOCKS,
    CTX_IDS,
    FULL_INDEXER,
    GEN_BLOCKS,
    GEN_IDS,
    INDEX_SCALES,
    INDEX_VALUES,
    LATENT,
    LAYERS,
    MASKED_BUILDER,
    MASKED_LAYERS,
    TOKENS,
    TPB,
    gen_bytes,
    handshake,
    helix_blocks,
    hints,
    index_key,
    indexer_space,
    masked_indexer_pool,
    masked_stage,
    mla_sender,
    pair,
    primary_pool,
    split_place,
    trt_row,
    write,
)
from tests.integrations.trtllm.test_trtllm_v2_layout import Group, Layout, Region, kv_refs

__all__ = ["pair"]  # the module's agent pair (a fixture of its own per module)


def request_tokens(blocks: list[int]) -> int:
    """The request's tokens in ``blocks`` (short only in its last block)."""
    return sum(min(TPB, TOKENS - b * TPB) for b in blocks)


# --- (p) Helix beside attention DP ---------------------------------------------------------------


@dataclass(frozen=True)
class Side:
    """One side's attention parallelism: ``tp`` ranks in ``dp`` attention-DP groups (1: DP
    off), the request on DP group ``dp_rank``, ``cp`` Helix CP ranks (the context's 1),
    PP 1; rank ``tp_rank * cp + cp_rank``."""

    tp: int
    dp: int
    dp_rank: int
    cp: int = 1

    @property
    def group(self) -> int:
        """Ranks a DP group: the heads (here the latents' copies) are split over them alone."""
        return self.tp // self.dp

    @property
    def request_dp(self) -> int:
        """``mDPrank`` as the peer reads it: the request's DP group, 0 with DP off."""
        return self.dp_rank if self.dp > 1 else 0

    def ranks(self) -> list[int]:
        """The ranks of the DP group that holds the request."""
        tps = range(self.dp_rank * self.group, (self.dp_rank + 1) * self.group)
        return [t * self.cp + c for t in tps for c in range(self.cp)]


def dp_cp_targets(rank: int, me: Side, peer: Side) -> list[int]:
    """``TargetRanksInfoForDPImpl`` at PP 1: the peer ranks ``rank`` pairs with, CP-major
    then TP, in the peer's DP group that holds the request."""
    t, c = divmod(rank, me.cp)
    if me.group <= peer.group:
        dtp = peer.group // me.group
        start = t % me.group * dtp + peer.request_dp * peer.group
    else:
        dtp, start = 1, t % me.group // (me.group // peer.group) + peer.request_dp * peer.group
    cps = (
        range(c * peer.cp // me.cp, (c + 1) * peer.cp // me.cp)
        if me.cp <= peer.cp
        else [c * peer.cp // me.cp]
    )
    return [j * peer.cp + i for i in cps for j in range(start, start + dtp)]


def helix_dp_sender(g: int, ctx: Side, gen: Side) -> int:
    """The context rank TRT-LLM takes generation rank ``g``'s latents from
    (``MLACacheFormatter::pickRecvConnections``), checked against the context side's
    ``needSendCache`` and ``targetIRanks``."""
    ranks = dp_cp_targets(g, gen, ctx)
    domain_tp = len(ranks)  # the context has no CP: one CP domain
    r = ranks[gen.request_dp % domain_tp]
    ctx_group = ctx.group if ctx.dp > 1 else ctx.tp
    if ctx_group > gen.group:
        dup = ctx_group // gen.group
        assert r % ctx_group % dup == gen.request_dp % dup, (g, r)
    assert g in dp_cp_targets(r, ctx, gen), (g, r)
    return r


@pytest.mark.parametrize(
    ("ctx", "gen", "round_robin"),
    [
        (Side(4, 1, 0), Side(2, 2, 1, 2), False),  # TRT-LLM's own pp1dp2cp2 disaggregated test
        (Side(2, 2, 1), Side(1, 1, 0, 2), True),  # context DP: the request's group of one sends
        (Side(2, 2, 0), Side(2, 2, 1, 2), True),  # DP on both sides, groups of one rank
        (Side(4, 2, 1), Side(2, 1, 0, 4), False),  # context DP groups of 2 -> generation TP 2 x CP 4
        (Side(2, 1, 0), Side(4, 2, 1, 2), False),  # generation DP groups of 2 TP ranks x CP 2
    ],
    ids=["tp4-dp2cp2", "dp2-cp2-rr", "dp2-dp2cp2-rr", "tp4dp2-tp2cp4", "tp2-tp4dp2cp2"],
)
def test_helix_under_attention_dp(pair: AgentPair, ctx: Side, gen: Side, round_robin: bool) -> None:
    """Helix (generation CP, MLA) with attention DP on either side: only the two DP groups
    that hold the request pair. As the docs say, a rank's shard is its place in its DP group,
    ``Shard(rank % group, group, 1)``, the latents' sender ``sends_to(..., latents=True)``
    inside the request's context group, and each CP rank maps its share of the request's
    blocks (``helix_blocks``) into its own blocks. TRT-LLM spreads generation DP groups over
    the context group's copies where kvlayout takes the group's first: the copies are the
    same bytes (replicated latents), which the oracle reads from TRT-LLM's sender."""
    pools = {
        r: primary_pool(CTX_BLOCKS, LAYERS, 1, LATENT, 1, 900 + r // ctx.group) for r in range(ctx.tp)
    }  # a DP group's ranks hold the same latents; another group's are other requests'
    group = [r for r in range(ctx.tp) if r // ctx.group == ctx.dp_rank]
    regs = {r: kvlayout.detect(pools[r], "trtllm", hints(1, 1)) for r in group}
    held = [nx.register(pair.agent, reg) for reg in regs.values()]
    try:
        for g in gen.ranks():
            t, c = divmod(g, gen.cp)
            dst = Shard(t % gen.group, gen.group, 1)
            there = handshake(pair, dst, heads=1, kv_factor=1, layers=LAYERS)
            shape = (GEN_BLOCKS, LAYERS, 1, LATENT * TPB)
            mine = helix_blocks(c, gen.cp, BLOCKS, round_robin)
            trt = helix_dp_sender(g, ctx, gen)
            assert trt in group
            if not mine:
                assert not gen_bytes(pair, shape).any()
                continue
            own = GEN_IDS[: len(mine)]
            maps = {}
            for r, reg in regs.items():
                src = Shard(r % ctx.group, ctx.group, 1)
                m = block_map(reg, there, [CTX_IDS[b] for b in mine], own, num_tokens=request_tokens(mine),
                              src_shard=src)  # fmt: skip
                if src.sends_to(dst, latents=m.latents):
                    maps[r] = m
            assert len(maps) == 1 and torch.equal(pools[next(iter(maps))], pools[trt]), (g, list(maps), trt)
            write(pair, maps, "direct")
            want = torch.zeros(shape, dtype=torch.bfloat16)  # splitKVCacheForMLAKernel's placement
            for b in range(BLOCKS):
                rank, local = split_place(b, gen.cp, BLOCKS, round_robin)
                if rank == c:
                    for layer in range(LAYERS):
                        for tok in range(min(TPB, TOKENS - b * TPB)):
                            src_row = trt_row(pools[trt], CTX_IDS[b], layer, 0, 0, tok)
                            trt_row(want, own[local], layer, 0, 0, tok).copy_(src_row)
            assert torch.equal(gen_bytes(pair, shape), want), g
    finally:
        for h in held:
            h.deregister()


# --- (q) the masked indexer pool across a TP change -----------------------------------------------


def masked_rows(ctx_pp: int, gen_pp: int, stage: int) -> list[tuple[int, int]]:
    """For each row of generation stage ``stage``'s masked pool, (the context stage, its row)
    TRT-LLM fills it from: the overlap of the prefix sums of ``getIndexerLayerNumPerPP``
    (``targetIRanksForIndexerKCache``), rows, not layer ids."""
    ctx_counts, gen_counts = indexer_space(ctx_pp), indexer_space(gen_pp)
    bounds = np.cumsum([0, *ctx_counts])
    start = sum(gen_counts[:stage])
    rows = []
    for at in range(start, start + gen_counts[stage]):
        s = int(np.searchsorted(bounds, at, side="right")) - 1
        rows.append((s, at - int(bounds[s])))
    return rows


def copy_index_keys(want: torch.Tensor, row: int, src: torch.Tensor, src_row: int) -> None:
    """The request's index keys of one layer, token by token (``index_key``'s offsets)."""
    for t in range(TOKENS):
        dst_key = index_key(want, GEN_IDS[t // TPB], row, t % TPB)
        for w, v in zip(dst_key, index_key(src, CTX_IDS[t // TPB], src_row, t % TPB), strict=True):
            w.copy_(v)


@pytest.mark.parametrize(
    ("ctx", "gen"),
    [((2, 1), (1, 1)), ((1, 1), (2, 1)), ((2, 1), (1, 2)), ((4, 2), (2, 1)), ((1, 3), (2, 2))],
    ids=["tp2-tp1", "tp1-tp2", "tp2-tp1pp2", "tp4pp2-tp2", "pp3-tp2pp2"],
)
def test_masked_indexer_pool_across_a_tp_change(
    pair: AgentPair, ctx: tuple[int, int], gen: tuple[int, int]
) -> None:
    """GLM-5.2's masked indexer pool (rows for the full-indexer layers 0, 1 and 5 only),
    whole on every TP rank as the latents are, between TP degrees and PP layouts: each
    generation rank takes a stage's rows from the one context TP rank that sends it the
    latents (``mla_sender``), the connector asking ``sends_to(..., latents=m.latents)`` of
    the indexer map as of the latents' and cutting both sides to the full-indexer layers
    they share. The oracle is TRT-LLM's row arithmetic in indexer layer space."""
    (ctx_tp, ctx_pp), (gen_tp, gen_pp) = ctx, gen
    full = {s: [i for i in masked_stage(s, ctx_pp) if i in FULL_INDEXER] for s in range(ctx_pp)}
    pools = {
        (s, r): masked_indexer_pool(ids, CTX_BLOCKS, 700 + s)
        for s, ids in full.items()
        if ids  # a stage without a full-indexer layer has no pool
        for r in range(ctx_tp)  # TP-replicated: every rank of a stage the same rows
    }
    held = [nx.register(pair.agent, reg) for reg, _ in pools.values()]
    try:
        for g in range(gen_tp * gen_pp):
            stage, d = divmod(g, gen_tp)
            ids = [i for i in masked_stage(stage, gen_pp) if i in FULL_INDEXER]
            if not ids:
                continue  # no pool on this rank: its peers send it nothing
            dst = Shard(d, gen_tp, 1)
            there = handshake(pair, dst, MASKED_BUILDER, layer_ids=ids)
            maps = {}
            for (s, r), (reg, _) in pools.items():
                shared = [i for i in full[s] if i in ids]
                if not shared:
                    continue
                m = block_map(
                    reg.for_layers(shared), there.for_layers(shared), CTX_IDS, GEN_IDS, num_tokens=TOKENS,
                    src_shard=Shard(r, ctx_tp, 1),
                )  # fmt: skip
                assert m.latents  # the indexer keys, as the latents, whole on every rank
                if Shard(r, ctx_tp, 1).sends_to(dst, latents=m.latents):
                    maps[s, r] = m
            rows = masked_rows(ctx_pp, gen_pp, stage)
            sender = mla_sender(d, ctx_tp, gen_tp)
            assert sorted(maps) == sorted({(s, sender) for s, _ in rows}), (g, sorted(maps))
            write(pair, maps, "direct")
            (raw,) = pair.peer.cache_bytes()
            got = torch.from_numpy(np.array(raw)).reshape(GEN_BLOCKS, len(ids), 1, -1)
            want = torch.zeros_like(got)
            for row, (s, src_row) in enumerate(rows):
                copy_index_keys(want, row, pools[s, sender][1][0], src_row)
            assert torch.equal(got, want), g
    finally:
        for h in held:
            h.deregister()


# --- (r) DSACacheManagerV2: the masked index keys as KvCacheLayout regions ----------------------

V2_BUILDER = "tests.integrations.trtllm.test_trtllm_pd_helix_dsa:v2_dsa_rank"
LATENT_PAGE = TPB * LATENT * 2  # one layer's latents of one slot, bf16 bytes
INDEX_PAGE = TPB * (INDEX_VALUES + INDEX_SCALES)  # one full-indexer layer's index keys of one slot
SLOT_TAIL = 64  # other bytes of the slot the regions' stride steps over


@dataclass(frozen=True)
class V2Rank:
    """A ``DSACacheManagerV2`` rank's slots: every layer's latents (``key``), then its
    full-indexer layers' index keys (``index_key``, replicated), then other bytes."""

    layers: tuple[int, ...]
    storage: torch.Tensor
    slots: int

    @property
    def full(self) -> list[int]:
        return [i for i in self.layers if i in FULL_INDEXER]

    @property
    def slot(self) -> int:
        return len(self.layers) * LATENT_PAGE + len(self.full) * INDEX_PAGE + SLOT_TAIL

    def layout(self) -> Layout:
        latents = Region(
            self.storage,
            0,
            len(self.layers) * LATENT_PAGE,
            self.slot,
            self.slots,
            kv_refs(self.layers, ("key",)),
        )
        keys = Region(
            self.storage, len(self.layers) * LATENT_PAGE, len(self.full) * INDEX_PAGE, self.slot, self.slots,
            kv_refs(self.full, ("index_key",)),
        )  # fmt: skip
        return Layout(TPB, (Group(0, self.layers, None, (latents,), (keys,) if self.full else ()),))

    def pools(self) -> dict[str, Any]:
        return kv_cache_layout_pools(self.layout(), torch.bfloat16, {"head_dim": LATENT})

    def latent(self, block: int, layer: int, tok: int) -> torch.Tensor:
        at = block * self.slot + self.layers.index(layer) * LATENT_PAGE + tok * LATENT * 2
        return self.storage[at : at + LATENT * 2]

    def index_page(self, block: int, layer: int) -> torch.Tensor:
        """Layer ``layer``'s index-key page of slot ``block``, as ``[1, 1, 1, page]`` for
        ``index_key``'s offsets."""
        at = block * self.slot + len(self.layers) * LATENT_PAGE + self.full.index(layer) * INDEX_PAGE
        return self.storage[at : at + INDEX_PAGE].view(1, 1, 1, INDEX_PAGE)


def v2_rank(layers: list[int], slots: int, seed: int | None) -> V2Rank:
    rank = V2Rank(tuple(layers), torch.empty(0, dtype=torch.uint8), slots)
    n = rank.slot * slots
    storage = (
        torch.zeros(n, dtype=torch.uint8)
        if seed is None
        else torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    )
    return V2Rank(tuple(layers), storage, slots)


def v2_dsa_rank(layers: list[int], which: str) -> tuple[Any, list[torch.Tensor]]:
    """The peer's builder: a zeroed generation rank on ``DSACacheManagerV2`` holding
    ``layers``, its registration ``which`` (``"group0"``, the latents; or
    ``"group0.replicated0"``, the index keys) and its slots' bytes."""
    rank = v2_rank(layers, GEN_BLOCKS, None)
    return rank.pools()[which], [rank.storage]


@pytest.mark.parametrize(("gen_pp", "v2"), [(2, False), (2, True), (3, True), (1, True)])
def test_v2_masked_index_keys_across_pp(pair: AgentPair, gen_pp: int, v2: bool) -> None:
    """A context rank on ``DSACacheManagerV2`` (GLM-5.2: index keys for layers 0, 1 and 5
    only) hands its connector a ``KvCacheLayout``: ``kv_cache_layout_pools`` reads the
    latents' region as TRT-LLM's K-only pool and the replicated region of index keys as
    TRT-LLM's indexer K pool, both numbered with the layers (they were whole opaque slots,
    which no stage of other layers could take). Each generation stage, a V1 masked pool
    or a V2 rank of its own layers, takes its layers of both, cut with ``for_layers``,
    by V2's page slots; every byte is checked against V2's addressing."""
    ctx = v2_rank(list(range(MASKED_LAYERS)), CTX_BLOCKS, 21)
    src = ctx.pools()
    assert src["group0.replicated0"].kernel_groups[0].format.name == "NB_NL_BSV_BSS"
    assert src["group0.replicated0"].layer_ids == tuple(FULL_INDEXER)
    held = [nx.register(pair.agent, src[name]) for name in ("group0", "group0.replicated0")]
    try:
        for stage in range(gen_pp):
            layers = masked_stage(stage, gen_pp)
            full = [i for i in layers if i in FULL_INDEXER]
            for name in ("group0", "group0.replicated0"):
                if name != "group0" and not full:
                    continue  # a stage without a full-indexer layer holds no index keys
                if v2:
                    there = handshake(pair, Shard(0, 1, 1), V2_BUILDER, layers=layers, which=name)
                elif name == "group0":
                    there = handshake(pair, Shard(0, 1, 1), BUILDER, heads=1, kv_factor=1, layers=len(layers),
                                      ids=layers)  # fmt: skip
                else:
                    there = handshake(pair, Shard(0, 1, 1), MASKED_BUILDER, layer_ids=full)
                shared = [i for group in there.groups for i in group.layers]
                m = block_map(src[name].for_layers(shared), there, CTX_IDS, GEN_IDS, num_tokens=TOKENS)
                write(pair, {(stage, name): m}, "direct")
                (raw,) = pair.peer.cache_bytes()
                got = torch.from_numpy(np.array(raw))
                want = torch.zeros_like(got)
                if v2:
                    gen = V2Rank(tuple(layers), want, GEN_BLOCKS)
                for t in range(TOKENS):
                    b, tok = CTX_IDS[t // TPB], t % TPB
                    for at, layer in enumerate(shared):
                        if name == "group0":
                            dst = (
                                gen.latent(GEN_IDS[t // TPB], layer, tok)
                                if v2
                                else trt_row(want.view(torch.bfloat16).view(GEN_BLOCKS, len(layers), 1, -1),
                                             GEN_IDS[t // TPB], at, 0, 0, tok).view(torch.uint8)
                            )  # fmt: skip
                            dst.copy_(ctx.latent(b, layer, tok))
                            continue
                        page = (
                            gen.index_page(GEN_IDS[t // TPB], layer)
                            if v2
                            else want.view(GEN_BLOCKS, len(full), 1, -1)[GEN_IDS[t // TPB], at].view(
                                1, 1, 1, -1
                            )
                        )
                        for w, v in zip(index_key(page, 0, 0, tok), index_key(ctx.index_page(b, layer), 0, 0, tok),
                                        strict=True):  # fmt: skip
                            w.copy_(v)
                assert torch.equal(got, want), (stage, name)
    finally:
        for h in held:
            h.deregister()
