"""TRT-LLM's cache transceiver where several attention windows, pipeline stages and a
generation rank's reused prefix meet, written on kvlayout as a connector would and moved
through real NIXL (this process's agent and a peer's, TCP on loopback), byte-exact
against TRT-LLM's own pairing. The walks of one case at a time are in
``test_trtllm_pd_nixl.py``, whose TRT-LLM helpers these reuse.

What TRT-LLM does (NVIDIA/TensorRT-LLM, ``cpp/tensorrt_llm/batch_manager/cacheFormatter.cpp``
and ``executor/cache_transmission/cacheSplitConcat.cu``):

- VSWA under a PP change: ``checkAlternateWindow`` allows only alternating windows
  (gpt-oss: layer ``i`` in pool ``i % numPools``) and a layer count each PP size divides;
  ``splitKVCacheForWindowKernel`` / ``concatKVCacheForWindowKernel`` (``getPosId``) split a
  window pool's layers evenly over the PP domain in order: the pool's layer ``k`` goes to
  domain rank ``k // (layersInWindow / domainPP)``, at ``k % (layersInWindow / domainPP)``
  there. Each window moves its last ``window / tokensPerBlock + 1`` blocks.
- Block reuse on the generation side (``getBlockRangeForReceiving`` /
  ``getBlockRangeForSending``): the reuse path (``srcEnableBlockReuse &&
  srcEnablePartialReuse && !recvSideHasCP && srcPpSize == 1``) fills per window only the
  blocks from ``max(reusedBlocks, usedBlocks - (window / tokensPerBlock + 1))`` on, the
  reused ones ``getCurrentPrepopulatedPromptLenForWindow(window) / tokensPerBlock``, and
  the context sends its last that many (``indexFromEndPerWindow``); a context under PP
  takes the fallback: every block (each window's last ``window / tokensPerBlock + 1``),
  the reused ones written again with the context's bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

pytest.importorskip("nixl")

import kvlayout
from kvlayout.registration.registration import Registration
from kvlayout.testing.nixl_peer import AgentPair
from kvlayout.transfer import BlockMap, RegistrationDescription, Shard, block_map
from kvlayout.transfer import nixl as nx
from tests.integrations.trtllm.test_trtllm_pd_nixl import (
    BLOCKS,
    CTX_BLOCKS,
    CTX_IDS,
    GEN_BLOCKS,
    GEN_IDS,
    HEAD_DIM,
    HEADS,
    LAYERS,
    POOLS,
    TOKENS,
    TPB,
    gen_bytes,
    handshake,
    hints,
    pair,
    primary_pool,
    rank_heads,
    stage_layers,
    trt_row,
    trt_senders,
    window_start_block,
    write,
)

__all__ = ["pair"]  # the module's agent pair (a fixture of its own per module)


def window_layers(layers: Sequence[int], window: int) -> list[int]:
    """The layers of ``layers`` in ``window``'s pool: gpt-oss's alternation, as ``POOLS``."""
    return [layer for layer in layers if layer in POOLS[window][0]]


def ctx_window_pools(tp: int, pp: int, window: int) -> dict[tuple[int, int], torch.Tensor]:
    """Each context rank's pool of ``window``: its stage's layers of that window, its heads;
    replicas of a head hold the same bytes."""
    return {
        (p, r): primary_pool(
            CTX_BLOCKS,
            len(window_layers(stage_layers(p, pp), window)),
            HEADS // tp,
            HEAD_DIM,
            2,
            1000 + 97 * p + 13 * r + window % 11,
        )
        for p in range(pp)
        for r in range(tp)
    }


def domain(stage: int, pp: int, peer_pp: int) -> list[int]:
    """``TargetRanksInfoForDPImpl``: the peer stages whose layers overlap stage ``stage``'s
    (``mAttentionLayerNumPerPP``, even stages here), ascending."""
    mine = set(stage_layers(stage, pp))
    return [p for p in range(peer_pp) if mine.intersection(stage_layers(p, peer_pp))]


def trt_window_source(gen_stage: int, gen_pp: int, ctx_pp: int, window: int, at: int) -> tuple[int, int]:
    """Where TRT-LLM fills layer ``at`` of generation stage ``gen_stage``'s ``window`` pool
    from: (context stage, layer of that stage's ``window`` pool), by ``getPosId``'s
    arithmetic on pool positions alone (no layer ids). Context PP 1 splits its pool's layers
    evenly over its domain (``concatKVCacheForWindowKernel`` reads them back at ``k %
    per``); generation PP 1 concatenates its domain's pools, ``per`` layers each."""
    if ctx_pp <= gen_pp:  # the context stage splits over the generation stages of its domain
        (ctx_stage,) = domain(gen_stage, gen_pp, ctx_pp)
        held = window_layers(stage_layers(ctx_stage, ctx_pp), window)
        peers = domain(ctx_stage, ctx_pp, gen_pp)
        per = len(held) // len(peers)
        return ctx_stage, peers.index(gen_stage) * per + at
    peers = domain(gen_stage, gen_pp, ctx_pp)
    per = len(window_layers(stage_layers(gen_stage, gen_pp), window)) // len(peers)
    return peers[at // per], at % per


def fill(
    want: torch.Tensor,
    src: torch.Tensor,
    gen_layer: int,
    ctx_layer: int,
    heads: list[tuple[int, int]],
    ids: tuple[Sequence[int], Sequence[int]],
    blocks: range,
) -> None:
    """Copy the request's tokens of ``blocks`` of one layer (K and V) for each ``(gen head,
    ctx head)`` pair from the context pool ``src`` into ``want``, by ``BlockInfo``'s
    offsets (``trt_row``); ``ids`` the two sides' block ids."""
    ctx_ids, gen_ids = ids
    for gh, ch in heads:
        for kv in range(2):
            for b in blocks:
                for t in range(min(TPB, TOKENS - b * TPB)):
                    row = trt_row(src, ctx_ids[b], ctx_layer, kv, ch, t)
                    trt_row(want, gen_ids[b], gen_layer, kv, gh, t).copy_(row)


def head_pairs(gen_rank: int, gen_tp: int, ctx_rank: int, ctx_tp: int) -> list[tuple[int, int]]:
    """The (generation head, context head) positions the two ranks share."""
    ctx = rank_heads(ctx_rank, ctx_tp, HEADS)
    return [(gh, ctx.index(h)) for gh, h in enumerate(rank_heads(gen_rank, gen_tp, HEADS)) if h in ctx]


# --- (m) VSWA across a PP change: alternating windows split by layers -------------------------


def stage_maps(
    regs: Mapping[tuple[int, int], Registration],
    there: RegistrationDescription,
    layers: list[int],
    ctx_tp: int,
    dst: Shard,
    ids: tuple[Sequence[int], Sequence[int]],
    first: int | None,
) -> dict[tuple[int, int], BlockMap]:
    """What each context (stage, rank) sends one generation rank: the layers the two share,
    from block ``first`` on (None: state pages, a request's slot mapped by its id alone);
    nothing where it holds none of them or none of the rank's heads."""
    maps = {}
    tokens: dict[str, Any] = {} if first is None else {"num_tokens": TOKENS, "first_token": first * TPB}
    for (p, r), reg in regs.items():
        shared = [i for i in reg.layer_ids if i in layers]
        src = Shard(r, ctx_tp, HEADS)
        if not shared or not src.sends_to(dst):
            continue
        m = block_map(reg.for_layers(shared), there.for_layers(shared), *ids, src_shard=src, **tokens)
        if m.kind != "empty":
            maps[p, r] = m
    return maps


@pytest.mark.parametrize(
    ("ctx", "gen"),
    [((1, 1), (1, 2)), ((1, 2), (1, 1)), ((2, 1), (1, 2)), ((2, 2), (4, 1))],
    ids=["pp1-pp2", "pp2-pp1", "tp2pp1-tp1pp2", "tp2pp2-tp4pp1"],
)
def test_vswa_across_a_pp_change(pair: AgentPair, ctx: tuple[int, int], gen: tuple[int, int]) -> None:
    """gpt-oss's alternating windows (layers 0 and 2 slide, 1 and 3 attend to all) under a
    PP change, with a TP change beside it: every stage holds a pool per window of its layers
    of that window, numbered with their model ids. The connector maps each window pool into
    the peer's pool of the same window, both cut to the layers they share (``for_layers``),
    with that window's block ids and its ``first_token``; the oracle is TRT-LLM's
    ``getPosId`` split by pool positions, and the senders its ``targetIRanks`` /
    ``needSendCache``."""
    (ctx_tp, ctx_pp), (gen_tp, gen_pp) = ctx, gen
    for window, (_, ctx_ids, gen_ids) in POOLS.items():
        first = window_start_block(window, BLOCKS)
        pools = ctx_window_pools(ctx_tp, ctx_pp, window)
        regs = {
            (p, r): kvlayout.detect(pool, "trtllm", hints(HEADS // ctx_tp, 2)).numbered(
                window_layers(stage_layers(p, ctx_pp), window)
            )
            for (p, r), pool in pools.items()
        }
        held = [nx.register(pair.agent, reg) for reg in regs.values()]
        try:
            for g in range(gen_tp * gen_pp):
                stage, d = g // gen_tp, g % gen_tp
                layers = window_layers(stage_layers(stage, gen_pp), window)
                there = handshake(
                    pair, Shard(d, gen_tp, HEADS), heads=HEADS // gen_tp, kv_factor=2,
                    layers=len(layers), ids=layers,
                )  # fmt: skip
                maps = stage_maps(
                    regs, there, layers, ctx_tp, Shard(d, gen_tp, HEADS), (ctx_ids, gen_ids), first
                )
                senders = trt_senders(d, ctx_tp, gen_tp, HEADS)
                assert sorted(maps) == [(p, r) for p in domain(stage, gen_pp, ctx_pp) for r in senders]
                write(pair, maps, "direct")
                shape = (GEN_BLOCKS, len(layers), 2, HEADS // gen_tp * HEAD_DIM * TPB)
                want = torch.zeros(shape, dtype=torch.bfloat16)
                for at in range(len(layers)):
                    p, cl = trt_window_source(stage, gen_pp, ctx_pp, window, at)
                    for r in senders:
                        fill(want, pools[p, r], at, cl, head_pairs(d, gen_tp, r, ctx_tp), (ctx_ids, gen_ids),
                             range(first, BLOCKS))  # fmt: skip
                assert torch.equal(gen_bytes(pair, shape), want), (window, g)
        finally:
            for h in held:
                h.deregister()


# --- (n) block reuse on the generation side, under PP -------------------------------------------


@pytest.mark.parametrize(
    ("ctx", "gen", "reused"),
    [((1, 1), (1, 2), 2), ((2, 1), (1, 2), 1), ((1, 2), (1, 1), 2), ((2, 2), (4, 1), 3)],
    ids=["pp1-pp2", "tp2pp1-tp1pp2", "pp2-pp1", "tp2pp2-tp4pp1"],
)
def test_generation_block_reuse_under_pp(
    pair: AgentPair, ctx: tuple[int, int], gen: tuple[int, int], reused: int
) -> None:
    """Every generation stage's prefix cache holds the request's first ``reused`` blocks
    (other requests' KV of the same prefix: random bytes here, which must stay where TRT-LLM
    leaves them). A context at PP 1 takes TRT-LLM's reuse path: each stage receives only
    the blocks after the reused ones, from the context's last that many; a context under PP
    takes the fallback (``srcPpSize == 1`` fails) and every block moves, the reused ones
    written again. The connector passes both sides' every block id, ``first_token`` the
    reused blocks' tokens where TRT-LLM takes its reuse path and 0 where it does not, each
    side cut to the layers the two share."""
    (ctx_tp, ctx_pp), (gen_tp, gen_pp) = ctx, gen
    start = reused if ctx_pp == 1 else 0  # getBlockRangeForReceiving's reuse path, or its fallback
    pools = {
        (p, r): primary_pool(CTX_BLOCKS, LAYERS // ctx_pp, HEADS // ctx_tp, HEAD_DIM, 2, 1500 + 10 * p + r)
        for p in range(ctx_pp)
        for r in range(ctx_tp)
    }
    regs = {
        k: kvlayout.detect(pool, "trtllm", hints(HEADS // ctx_tp, 2)).numbered(stage_layers(k[0], ctx_pp))
        for k, pool in pools.items()
    }
    held = [nx.register(pair.agent, reg) for reg in regs.values()]
    try:
        for g in range(gen_tp * gen_pp):
            stage, d = g // gen_tp, g % gen_tp
            layers, base = stage_layers(stage, gen_pp), 1600 + g
            there = handshake(
                pair, Shard(d, gen_tp, HEADS), heads=HEADS // gen_tp, kv_factor=2, layers=len(layers),
                ids=layers, seed=base,
            )  # fmt: skip
            maps = stage_maps(regs, there, layers, ctx_tp, Shard(d, gen_tp, HEADS), (CTX_IDS, GEN_IDS), start)
            senders = trt_senders(d, ctx_tp, gen_tp, HEADS)
            assert sorted(maps) == [(p, r) for p in domain(stage, gen_pp, ctx_pp) for r in senders]
            write(pair, maps, "direct")
            shape = (GEN_BLOCKS, len(layers), 2, HEADS // gen_tp * HEAD_DIM * TPB)
            want = primary_pool(GEN_BLOCKS, len(layers), HEADS // gen_tp, HEAD_DIM, 2, base)
            for at, layer in enumerate(layers):
                p = layer // (LAYERS // ctx_pp)  # the context stage that holds it
                for r in senders:
                    fill(want, pools[p, r], at, stage_layers(p, ctx_pp).index(layer),
                         head_pairs(d, gen_tp, r, ctx_tp), (CTX_IDS, GEN_IDS), range(start, BLOCKS))  # fmt: skip
            got = gen_bytes(pair, shape)
            if start:
                reused_ids = GEN_IDS[:reused]
                assert torch.equal(got[reused_ids], want[reused_ids]), "a reused block changed"
            assert torch.equal(got, want), g
    finally:
        for h in held:
            h.deregister()


# --- (o) block reuse on the generation side, under VSWA -----------------------------------------


@pytest.mark.parametrize(
    ("ctx_tp", "gen_tp", "reused"),
    [(1, 1, (2, 2)), (2, 1, (0, 1)), (1, 2, (1, 3)), (4, 2, (3, 0))],
    ids=["both-2", "window-0-full-1", "window-1-full-3", "window-3-full-0"],
)
def test_generation_block_reuse_under_vswa(
    pair: AgentPair, ctx_tp: int, gen_tp: int, reused: tuple[int, int]
) -> None:
    """A V1 manager of two windows whose prefix cache holds, per window, the request's
    first ``reused`` blocks (``getCurrentPrepopulatedPromptLenForWindow``: the sliding
    window's first, then the full window's). TRT-LLM's reuse path fills each window's blocks
    from ``max(reused, usedBlocks - (window / tokensPerBlock + 1))`` on, the context sending
    its last that many of the window's pool. The connector maps each window pool with that
    window's block ids and ``first_token`` the later of its reused tokens and its window's
    start; the reused blocks keep their bytes."""
    for (window, (layers, ctx_ids, gen_ids)), kept in zip(POOLS.items(), reused, strict=True):
        start = max(kept, window_start_block(window, BLOCKS))
        pools = {
            r: primary_pool(CTX_BLOCKS, len(layers), HEADS // ctx_tp, HEAD_DIM, 2, 1700 + r + window % 7)
            for r in range(ctx_tp)
        }
        regs = {
            r: kvlayout.detect(pool, "trtllm", hints(HEADS // ctx_tp, 2)).numbered(layers)
            for r, pool in pools.items()
        }
        held = [nx.register(pair.agent, reg) for reg in regs.values()]
        try:
            for d in range(gen_tp):
                base = 1800 + d + window % 5
                dst = Shard(d, gen_tp, HEADS)
                there = handshake(
                    pair, dst, heads=HEADS // gen_tp, kv_factor=2, layers=len(layers), ids=layers, seed=base
                )
                maps = {}
                for r, reg in regs.items():
                    src = Shard(r, ctx_tp, HEADS)
                    m = block_map(
                        reg,
                        there,
                        ctx_ids,
                        gen_ids,
                        num_tokens=TOKENS,
                        first_token=start * TPB,
                        src_shard=src,
                    )
                    if m.kind != "empty" and src.sends_to(dst):
                        maps[r] = m
                senders = trt_senders(d, ctx_tp, gen_tp, HEADS)
                assert sorted(maps) == senders
                write(pair, maps, "direct")
                shape = (GEN_BLOCKS, len(layers), 2, HEADS // gen_tp * HEAD_DIM * TPB)
                want = primary_pool(GEN_BLOCKS, len(layers), HEADS // gen_tp, HEAD_DIM, 2, base)
                for r in senders:
                    for layer in range(len(layers)):
                        fill(want, pools[r], layer, layer, head_pairs(d, gen_tp, r, ctx_tp), (ctx_ids, gen_ids),
                             range(start, BLOCKS))  # fmt: skip
                got = gen_bytes(pair, shape)
                assert torch.equal(got[gen_ids[:start]], want[gen_ids[:start]]), "a reused block changed"
                assert torch.equal(got, want), (window, d)
        finally:
            for h in held:
                h.deregister()
