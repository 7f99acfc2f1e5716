"""TRT-LLM's context -> generation KV transfer (disaggregated serving) written on kvlayout, as
a connector author would from README.md, docs/pd-connectors.md, docs/nixl.md and
docs/block-maps.md, through real NIXL (this process's agent and a peer process's, TCP on
loopback), byte-exact against an oracle from TRT-LLM's own indexing.

What TRT-LLM does (read in NVIDIA/TensorRT-LLM):

- ``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``, ``BlockManager::allocatePools``: a
  pool per layer group (window size / KV head count), ``[numPrimaryBlocks, pool.numLayers,
  kvFactor, blockSize]`` with ``blockSize = numKvHeads * sizePerHead * tokensPerBlock``,
  contiguous (strides ``(NL * kvf * bs, kvf * bs, bs, 1)``); ``get_unique_primary_pool()``
  is that tensor where there is one pool. kvFactor is 2 (K, V), 1 for MLA (``SELFKONLY``).
  Only the rank's layers are in it (``mAttentionLayerNumPerPP`` of its PP stage) and only
  its KV heads.
- ``cpp/tensorrt_llm/executor/cache_transmission/cacheSplitConcat.cu``: ``BlockInfo``
  addresses a block's layer ``l`` K at ``(2 * l) * H * T * D``, V at ``(2 * l + 1) * ...``,
  and head ``h`` token ``t`` at ``h * T * D + t * D`` in it (HND). ``TargetRanksInfoForDPImpl``
  pairs ranks: rank ``= pp * tp * cp + tp_rank * cp + cp_rank``; PP stages overlap by global
  layer ranges (each stage's layers contiguous, counts from ``mAttentionLayerNumPerPP``); a
  rank of the smaller TP takes ``peer_tp / self_tp`` peer TP ranks (its heads split over
  them), a rank of the larger TP one (``self_tp_rank / (self_tp / peer_tp)``); TP sizes must
  be powers of two. ``mDupHeadFactor`` counts replicated heads (heads * tp over the peer's).
- ``cpp/tensorrt_llm/batch_manager/cacheFormatter.cpp``: ``needSendCache`` sends from the
  first replica only (``tp_rank % dupHeadFactor == 0``); ``inquireSupport`` refuses
  different data types, kv factors, attention types (MLA goes to ``MLACacheFormatter``),
  uneven heads per layer, different ``tokensPerBlock`` or ``sizePerHead``, and layer counts
  that do not sum to the same model or that a PP size does not divide. Whole blocks move.
- ``mlaCacheFormatter.cpp``: the latents are whole on every rank; a generation rank takes
  them from one context rank of its PP domain.
- ``tensorrt_llm/_torch/pyexecutor/resource_manager.py``: ``get_buffers(layer)`` is
  ``impl.get_primary_pool_data(layer)`` (``pool[:, layer's place in its pool]``) viewed as
  ``[NB, kv_factor, ...]``: a per-layer view of the same pool.

- Attention DP (``TargetRanksInfoForDP``): ranks pair inside the DP groups that hold the
  request (``mDPrank``), ``tp / dp`` ranks a group; ``needSendCache`` tests the rank's place
  in its group. Block reuse: ``getBlockRangeForReceiving`` fills the generation rank's newly
  allocated blocks (``fromNewlyAllocatedBlockIds``), ``getBlockRangeForSending`` sends the
  context's last that many (one pool only). DSA: ``MLACacheFormatter::format`` sends the
  indexer K pool (``BlockRange::getBlockRangeForWindow(window, true)``: the same block ids)
  after the latents, from the same rank. Context CP is not supported
  (``MLACacheFormatter::pickRecvConnections`` checks ``mDomainCPSize == 1``); generation CP
  (Helix, MLA) splits the request by whole blocks (``splitKVCacheForMLAKernel``), beside
  generation TP and PP (the same split to every TP rank of the domain, layers by PP stage).
  A masked indexer pool (GLM-5.2's cross-layer indexer sharing) holds rows for its
  full-indexer layers alone, split in that layer space (``targetIRanksForIndexerKCache``). FP8 KV is the
  same pool in float8 (``inquireSupport``: one data type both sides). A V2 context rank's
  ``KvCacheLayout`` region (``kv_cache_layout_pools``) is mapped by page slots like a pool.

The oracle below reads both pools flat with ``BlockInfo``'s offsets: for each token of the
request, each layer the generation rank holds and each head it holds, the generation row
equals the row of the context rank that holds that layer (its PP stage) and head (its first
replica); every other byte of every generation rank stays zero.
"""

from __future__ import annotations

import faulthandler
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("nixl")

import kvlayout
from kvlayout.integrations.trtllm import kv_cache_layout_pools
from kvlayout.testing.nixl_peer import AgentPair, agent_pair, tcp_tls
from kvlayout.transfer import BlockMapError, RegistrationDescription, Shard, block_map
from kvlayout.transfer import nixl as nx

LAYERS, HEADS, HEAD_DIM, LATENT = 4, 8, 16, 48  # LATENT: kv_lora_rank 32 + qk_rope_head_dim 16
TPB = 32  # tokens_per_block, the same on both sides (TRT-LLM's inquireSupport requires it)
TOKENS = 100  # three whole blocks and 4 tokens of a fourth
BLOCKS = -(-TOKENS // TPB)  # the request's blocks: 4 of 32 tokens for 100 tokens
CTX_BLOCKS, GEN_BLOCKS = 6, 8
CTX_IDS, GEN_IDS = [4, 1, 5, 2], [7, 0, 3, 5]  # pool indices (get_memory_pool_block_indices)
BUILDER = "tests.integrations.trtllm.test_trtllm_pd_nixl:generation_pool"
MODULE_LIMIT_S = 300


@pytest.fixture(scope="module")
def pair() -> Iterator[AgentPair]:
    """The context executor's agent (here) and a generation executor in another process."""
    faulthandler.dump_traceback_later(MODULE_LIMIT_S, exit=True)
    try:
        with agent_pair("kvl-trt-pd", [4096], 1 << 20, env={"UCX_TLS": tcp_tls()}) as p:
            yield p
    finally:
        faulthandler.cancel_dump_traceback_later()


# --- TRT-LLM's side: pools, rank heads and layers, the oracle ----------------------------


def primary_pool(
    blocks: int,
    layers: int,
    heads: int,
    dim: int,
    kv_factor: int,
    seed: int | None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``BlockManager::allocatePools``: ``[blocks, layers, kv_factor, heads * dim * TPB]``."""
    shape = (blocks, layers, kv_factor, heads * dim * TPB)
    if seed is None:
        return torch.zeros(shape, dtype=dtype)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def rank_heads(tp_rank: int, tp: int, heads: int) -> list[int]:
    """The model's KV heads a TP rank holds: a contiguous range, or one head replicated over
    ``tp // heads`` ranks (``mDupHeadFactor``)."""
    if tp <= heads:
        return list(range(tp_rank * heads // tp, (tp_rank + 1) * heads // tp))
    return [tp_rank // (tp // heads)]


def trt_senders(gen_rank: int, ctx_tp: int, gen_tp: int, heads: int) -> list[int]:
    """The context TP ranks that send a generation TP rank its KV: ``targetIRanks`` from the
    generation side (``peer_tp / self_tp`` ranks from ``self_tp_rank * that``, or rank
    ``self_tp_rank / (self_tp / peer_tp)``), less those ``needSendCache`` stops
    (``tp_rank % mDupHeadFactor != 0``, the factor the context's heads * TP over the
    generation's)."""
    if gen_tp <= ctx_tp:
        k = ctx_tp // gen_tp
        ranks = list(range(gen_rank * k, (gen_rank + 1) * k))
    else:
        ranks = [gen_rank // (gen_tp // ctx_tp)]
    ctx_heads, gen_heads = len(rank_heads(0, ctx_tp, heads)), len(rank_heads(0, gen_tp, heads))
    dup = max(1, ctx_heads * ctx_tp // (gen_heads * gen_tp))
    return [r for r in ranks if r % dup == 0]


def mla_sender(gen_rank: int, ctx_tp: int, gen_tp: int) -> int:
    """The one context TP rank that sends a generation rank the latents: ``targetIRanks``'
    ranks, less those ``MLACacheFormatter::needSendCache`` stops (where the context has more
    ranks, ``tp_rank % (ctx_tp / gen_tp) != 0``)."""
    if gen_tp >= ctx_tp:
        return gen_rank // (gen_tp // ctx_tp)
    return gen_rank * (ctx_tp // gen_tp)


def stage_layers(pp_rank: int, pp: int) -> list[int]:
    """The model's layers PP stage ``pp_rank`` holds (``mAttentionLayerNumPerPP``: even here)."""
    per = LAYERS // pp
    return list(range(pp_rank * per, (pp_rank + 1) * per))


def hints(heads: int, kv_factor: int) -> dict[str, Any]:
    """The sizes the flat pool row folds, as docs/pd-connectors.md has them."""
    if kv_factor == 1:
        return {"tokens_per_block": TPB, "head_dim": LATENT}
    return {"num_kv_heads": heads, "tokens_per_block": TPB, "head_dim": HEAD_DIM}


def generation_pool(
    heads: int,
    kv_factor: int,
    layers: int,
    part: list[int] | None = None,
    ids: list[int] | None = None,
    seed: int | None = None,
    dtype: str = "bfloat16",
) -> tuple[Any, list[torch.Tensor]]:
    """The peer's builder: a generation rank's primary pool of ``dtype`` (torch's name),
    detected as the docs say, zeroed (or random from ``seed``: blocks that already hold other
    KV); ``part`` ``[a, b)`` describes only those layers of it (``pool[:, a:b]``, the side with
    more layers under PP), numbered ``ids`` (the model's layer ids) where given."""
    dim = LATENT if kv_factor == 1 else HEAD_DIM
    pool = primary_pool(GEN_BLOCKS, layers, heads, dim, kv_factor, seed, getattr(torch, dtype))
    view = pool if part is None else pool[:, part[0] : part[1]]
    reg = kvlayout.detect(view, "trtllm", hints(heads, kv_factor))
    if ids is not None:
        reg = reg.numbered(ids)
    return reg, [pool]


def trt_row(pool: torch.Tensor, block: int, layer: int, kv: int, head: int, tok: int) -> torch.Tensor:
    """One head's row of one token (``BlockInfo::getKDimsPtr`` / ``getVDimsPtr``), read from
    the pool's flat memory: block ``block``, the pool's layer ``layer``, K (0) or V (1)."""
    nl, kvf, row = pool.shape[1], pool.shape[2], pool.shape[3]
    dim = LATENT if kvf == 1 else HEAD_DIM
    heads = row // (TPB * dim)
    at = ((block * nl + layer) * kvf + kv) * heads * TPB * dim + head * TPB * dim + tok * dim
    return pool.reshape(-1)[at : at + dim]


def expected(
    ctx: dict[tuple[int, int], torch.Tensor],
    ctx_tp: int,
    ctx_pp: int,
    gen_shape: Sequence[int],
    gen_tp_rank: int,
    gen_tp: int,
    gen_layers: list[int],
    model_heads: int,
    stages: Sequence[int] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The generation rank's pool after the request, from TRT-LLM's indexing: ``ctx`` maps
    (pp_rank, tp_rank) to that context rank's pool; only the layers of context PP stages
    ``stages`` (None: all) have arrived."""
    want = torch.zeros(tuple(gen_shape), dtype=dtype)
    kvf = gen_shape[2]
    for gl, layer in enumerate(gen_layers):
        pp = next(p for p in range(ctx_pp) if layer in stage_layers(p, ctx_pp))
        if stages is not None and pp not in stages:
            continue
        cl = stage_layers(pp, ctx_pp).index(layer)
        for gh, head in enumerate(rank_heads(gen_tp_rank, gen_tp, model_heads)):
            tp = next(r for r in range(ctx_tp) if head in rank_heads(r, ctx_tp, model_heads))  # first replica
            ch = rank_heads(tp, ctx_tp, model_heads).index(head)
            for kv in range(kvf):
                for t in range(TOKENS):
                    src = trt_row(ctx[pp, tp], CTX_IDS[t // TPB], cl, kv, ch, t % TPB)
                    trt_row(want, GEN_IDS[t // TPB], gl, kv, gh, t % TPB).copy_(src)
    return want


# --- the connector ----------------------------------------------------------------------


def handshake(pair: AgentPair, shard: Shard, builder: str = BUILDER, **args: Any) -> RegistrationDescription:
    """The generation rank builds and describes its pool; its NIXL metadata is loaded again."""
    text = pair.peer.built_cache(builder, (shard.tp_rank, shard.tp_size, shard.num_kv_heads), **args)
    pair.agent.remove_remote_agent(pair.name)
    assert pair.agent.add_remote_agent(pair.peer.metadata) == pair.name.encode()
    there = RegistrationDescription.from_json(text)
    assert there.shard == shard
    return there


def write(pair: AgentPair, maps: dict[Any, Any], strategy: nx.Strategy) -> None:
    """The context side WRITEs each map (as TRT-LLM's sender pushes), one notification each."""
    for key, m in maps.items():
        tag = f"req-{key}".encode()
        x = nx.transfer(pair.agent, pair.name, m, notif=tag, strategy=strategy, staging=pair.staging)
        assert x.wait(timeout=30).strategy == strategy
        assert pair.peer.notifs(expect=1, wait=30) == [tag]


def gen_bytes(pair: AgentPair, shape: Sequence[int], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    (raw,) = pair.peer.cache_bytes()
    return torch.from_numpy(np.array(raw)).view(dtype).reshape(tuple(shape))


def context_ranks(
    tp: int, pp: int, heads: int, kv_factor: int, dtype: torch.dtype = torch.bfloat16
) -> dict[tuple[int, int], torch.Tensor]:
    dim = LATENT if kv_factor == 1 else HEAD_DIM
    return {
        (p, r): primary_pool(
            CTX_BLOCKS,
            LAYERS // pp,
            len(rank_heads(r, tp, heads)),
            dim,
            kv_factor,
            seed(p, r, tp, heads),
            dtype,
        )
        for p in range(pp)
        for r in range(tp)
    }


def seed(pp_rank: int, tp_rank: int, tp: int, heads: int) -> int:
    """Replicas of a head hold the same bytes, as they do in TRT-LLM."""
    return 100 + 10 * pp_rank + rank_heads(tp_rank, tp, heads)[0]


# --- (a) MHA between TP degrees -----------------------------------------------------------


@pytest.mark.parametrize(
    ("ctx_tp", "gen_tp", "heads", "strategy"),
    [(2, 4, 8, "direct"), (4, 2, 8, "direct"), (4, 2, 8, "staged"), (2, 4, 2, "direct"), (4, 2, 2, "staged")],
)
def test_mha_between_tp_degrees(
    pair: AgentPair, ctx_tp: int, gen_tp: int, heads: int, strategy: nx.Strategy
) -> None:
    """Context TP ``ctx_tp`` into generation TP ``gen_tp``, 32 tokens a block on both; 2 KV
    heads replicate at TP 4 (TRT-LLM sends from the first replica, ``needSendCache``)."""
    ctx = context_ranks(ctx_tp, 1, heads, 2)
    regs = {
        r: kvlayout.detect(ctx[0, r], "trtllm", hints(len(rank_heads(r, ctx_tp, heads)), 2))
        for r in range(ctx_tp)
    }
    assert regs[0].kernel_groups[0].format.name == "NB_NL_TWO_NH_BS_HS"
    held = [nx.register(pair.agent, reg) for reg in regs.values()]
    try:
        for d in range(gen_tp):
            gen_heads = len(rank_heads(d, gen_tp, heads))
            dst = Shard(d, gen_tp, heads)  # what the description carries (handshake checks it)
            there = handshake(pair, dst, heads=gen_heads, kv_factor=2, layers=LAYERS)
            maps = {}
            for r, reg in regs.items():
                src = Shard(r, ctx_tp, heads)
                m = block_map(reg, there, CTX_IDS, GEN_IDS, num_tokens=TOKENS, src_shard=src)
                if m.kind != "empty" and src.sends_to(dst):
                    maps[r, d] = m
            assert sorted(r for r, _ in maps) == trt_senders(d, ctx_tp, gen_tp, heads), (d, list(maps))
            write(pair, maps, strategy)
            shape = (GEN_BLOCKS, LAYERS, 2, gen_heads * HEAD_DIM * TPB)
            want = expected(ctx, ctx_tp, 1, shape, d, gen_tp, list(range(LAYERS)), heads)
            assert torch.equal(gen_bytes(pair, shape), want), d
    finally:
        for h in held:
            h.deregister()


# --- (b) PP: layers split over stages -------------------------------------------------------


@pytest.mark.parametrize("numbered", [False, True], ids=["by position", "numbered"])
def test_context_pp2_into_generation_pp1(pair: AgentPair, numbered: bool) -> None:
    """Context PP 2 (layers 0-1 on stage 0, 2-3 on stage 1) into generation PP 1 (TRT-LLM:
    ``targetIRanks`` gives the generation rank both stages, each sending its layers). A map
    moves layer ``i`` to layer ``i``, so the side with more layers (generation) describes
    only the stage's slice, ``pool[:, a:b]`` (docs/pd-connectors.md, pipeline parallelism),
    by position from 0 on both sides or numbered with the model's layers on both."""
    ctx = context_ranks(1, 2, HEADS, 2)
    shape = (GEN_BLOCKS, LAYERS, 2, HEADS * HEAD_DIM * TPB)
    for stage in range(2):
        layers = stage_layers(stage, 2)
        reg = kvlayout.detect(ctx[stage, 0], "trtllm", hints(HEADS, 2))
        if numbered:
            reg = reg.numbered(layers)
        held = nx.register(pair.agent, reg)
        try:
            part = [layers[0], layers[-1] + 1]
            there = handshake(
                pair,
                Shard(0, 1, HEADS),
                heads=HEADS,
                kv_factor=2,
                layers=LAYERS,
                part=part,
                ids=layers if numbered else None,
            )
            m = block_map(reg, there, CTX_IDS, GEN_IDS, num_tokens=TOKENS, src_shard=Shard(0, 1, HEADS))
            write(pair, {stage: m}, "direct")
        finally:
            held.deregister()
        want = expected(ctx, 1, 2, shape, 0, 1, list(range(LAYERS)), HEADS, stages=[stage])
        assert torch.equal(gen_bytes(pair, shape), want), stage


@pytest.mark.parametrize("strategy", ["direct", "staged"])
def test_context_pp2_cuts_the_one_description_of_generation_pp1(
    pair: AgentPair, strategy: nx.Strategy
) -> None:
    """Context PP 2 into generation PP 1, the generation rank sending ONE description (its
    whole pool, layers 0-3 by position, which at PP 1 are the model's): each context stage,
    numbered with its layers (``mAttentionLayerNumPerPP``'s contiguous range), cuts it to
    them (``description.for_layers``) and writes its layers into the generation pool's
    slice, as ``targetIRanks`` pairs overlapping layer ranges."""
    ctx = context_ranks(1, 2, HEADS, 2)
    shape = (GEN_BLOCKS, LAYERS, 2, HEADS * HEAD_DIM * TPB)
    there = handshake(pair, Shard(0, 1, HEADS), heads=HEADS, kv_factor=2, layers=LAYERS)
    for stage in range(2):
        layers = stage_layers(stage, 2)
        reg = kvlayout.detect(ctx[stage, 0], "trtllm", hints(HEADS, 2)).numbered(layers)
        held = nx.register(pair.agent, reg)
        try:
            cut = there.for_layers(layers)
            assert cut.whole is there and cut.groups[0].layers == tuple(layers)
            m = block_map(reg, cut, CTX_IDS, GEN_IDS, num_tokens=TOKENS, src_shard=Shard(0, 1, HEADS))
            write(pair, {stage: m}, strategy)
        finally:
            held.deregister()
        # the stages so far have arrived, and nothing else of the pool was written
        want = expected(ctx, 1, 2, shape, 0, 1, list(range(LAYERS)), HEADS, stages=range(stage + 1))
        assert torch.equal(gen_bytes(pair, shape), want), stage


def test_a_stage_into_a_whole_description_says_to_cut_it() -> None:
    """A context stage (layers 2-3, numbered) against the generation rank's description of
    its whole pool (layers 0-3) is refused, the message naming the cut; against the whole
    pool in this process, a registration of its slice."""
    stage = kvlayout.detect(primary_pool(CTX_BLOCKS, 2, HEADS, HEAD_DIM, 2, 1), "trtllm", hints(HEADS, 2))
    whole, _ = generation_pool(HEADS, 2, LAYERS)
    there = RegistrationDescription.from_json(whole.describe().to_json())
    with pytest.raises(BlockMapError) as err:
        block_map(stage.numbered([2, 3]), there, CTX_IDS, GEN_IDS, num_tokens=TOKENS)
    assert str(err.value) == (
        "src holds layers 2-3 and dst layers 0-3; a map moves layer i to layer i (src holds only some of "
        "dst's layers: map them against dst's description cut to them, description.for_layers(layer_ids) "
        "(2-3), both sides numbering the layers alike (the model's layer ids: registration.numbered(layer_ids)))"
    )
    # the same pools in one process: the poster holds dst's cache and cuts it itself
    with pytest.raises(BlockMapError, match=re.escape("registration.for_layers(layer_ids) (2-3) of dst's")):
        block_map(stage.numbered([2, 3]), whole, CTX_IDS, GEN_IDS, num_tokens=TOKENS)


@pytest.mark.parametrize("numbered", [False, True], ids=["by position", "numbered"])
def test_context_pp1_into_generation_pp2(pair: AgentPair, numbered: bool) -> None:
    """Context PP 1 into generation PP 2: the context side has more layers and maps a view
    of its pool's layer axis, ``pool[:, a:b]``, into each stage's whole pool (NIXL
    registration of the whole pool, which the view's storage is)."""
    ctx = context_ranks(1, 1, HEADS, 2)
    whole = kvlayout.detect(ctx[0, 0], "trtllm", hints(HEADS, 2))
    held = nx.register(pair.agent, whole)
    try:
        for stage in range(2):
            layers = stage_layers(stage, 2)
            part = kvlayout.detect(ctx[0, 0][:, layers[0] : layers[-1] + 1], "trtllm", hints(HEADS, 2))
            if numbered:
                part = part.numbered(layers)
            there = handshake(
                pair,
                Shard(0, 1, HEADS),
                heads=HEADS,
                kv_factor=2,
                layers=len(layers),
                ids=layers if numbered else None,
            )
            m = block_map(part, there, CTX_IDS, GEN_IDS, num_tokens=TOKENS, src_shard=Shard(0, 1, HEADS))
            write(pair, {stage: m}, "direct")
            shape = (GEN_BLOCKS, len(layers), 2, HEADS * HEAD_DIM * TPB)
            assert torch.equal(gen_bytes(pair, shape), expected(ctx, 1, 1, shape, 0, 1, layers, HEADS)), stage
    finally:
        held.deregister()


# --- (c) MLA: the latents whole on every rank ------------------------------------------------


@pytest.mark.parametrize(("ctx_tp", "gen_tp"), [(1, 2), (2, 1), (4, 2)])
def test_mla_between_tp_degrees(pair: AgentPair, ctx_tp: int, gen_tp: int) -> None:
    """TRT-LLM's K-only pool (``[NB, NL, 1, TPB * 576]`` for DeepSeek; 48 here), kv factor 1:
    every rank holds the latents; one context rank sends each generation rank
    (``MLACacheFormatter::needSendCache``: TP rank 0 of the ``ctx_tp / gen_tp`` that could)."""
    ctx = context_ranks(ctx_tp, 1, 1, 1)
    regs = {r: kvlayout.detect(ctx[0, r], "trtllm", hints(1, 1)) for r in range(ctx_tp)}
    assert regs[0].kernel_groups[0].format.name == "NB_NL_ONE_BS_HS"
    held = [nx.register(pair.agent, reg) for reg in regs.values()]
    try:
        for d in range(gen_tp):
            there = handshake(pair, Shard(d, gen_tp, 1), heads=1, kv_factor=1, layers=LAYERS)
            maps = {}
            for r, reg in regs.items():
                m = block_map(reg, there, CTX_IDS, GEN_IDS, num_tokens=TOKENS, src_shard=Shard(r, ctx_tp, 1))
                assert m.latents
                if Shard(r, ctx_tp, 1).sends_to(Shard(d, gen_tp, 1), latents=m.latents):
                    maps[r, d] = m
            assert [r for r, _ in maps] == [mla_sender(d, ctx_tp, gen_tp)]
            write(pair, maps, "direct")
            shape = (GEN_BLOCKS, LAYERS, 1, LATENT * TPB)
            assert torch.equal(
                gen_bytes(pair, shape), expected(ctx, ctx_tp, 1, shape, d, gen_tp, list(range(LAYERS)), 1)
            )
    finally:
        for h in held:
            h.deregister()


# --- (d) variable sliding window: a pool per window ------------------------------------------

WINDOW = 64  # layers 0 and 2 slide (gpt-oss-like alternation), 1 and 3 attend to every token
POOLS = {WINDOW: ([0, 2], [3, 0, 2, 5], [1, 6, 4, 2]), 1 << 20: ([1, 3], CTX_IDS, GEN_IDS)}


def window_start_block(window: int, blocks: int) -> int:
    """``getBlockRangeForSending`` / ``getBlockRangeForReceiving`` (several windows): a window's
    last ``window / tokensPerBlock + 1`` blocks move, whole, on both sides."""
    return max(0, blocks - (window // TPB + 1))


@pytest.mark.parametrize(("ctx_tp", "gen_tp"), [(2, 4), (4, 2)])
def test_variable_sliding_window_pools(pair: AgentPair, ctx_tp: int, gen_tp: int) -> None:
    """A V1 manager of two window sizes holds a pool per window (``[NB, layers of that window,
    2, row]``), each with its own block ids. Each pool is detected on its own (TRT-LLM's
    detector refuses a list of them) and numbered with its layers' model ids; the sliding
    window's dropped blocks are left out with ``first_token`` (block ``window_start_block``),
    its block list still the request's every block id in that window's pool."""
    blocks = BLOCKS
    for window, (layers, ctx_ids, gen_ids) in POOLS.items():
        first = window_start_block(window, blocks) * TPB
        ctx = {
            r: primary_pool(
                CTX_BLOCKS, len(layers), HEADS // ctx_tp, HEAD_DIM, 2, seed(window % 7, r, ctx_tp, HEADS)
            )
            for r in range(ctx_tp)
        }
        regs = {
            r: kvlayout.detect(p, "trtllm", hints(HEADS // ctx_tp, 2)).numbered(layers)
            for r, p in ctx.items()
        }
        held = [nx.register(pair.agent, reg) for reg in regs.values()]
        try:
            for d in range(gen_tp):
                there = handshake(
                    pair,
                    Shard(d, gen_tp, HEADS),
                    heads=HEADS // gen_tp,
                    kv_factor=2,
                    layers=len(layers),
                    ids=layers,
                )
                maps = {}
                for r, reg in regs.items():
                    m = block_map(
                        reg, there, ctx_ids, gen_ids, num_tokens=TOKENS, first_token=first,
                        src_shard=Shard(r, ctx_tp, HEADS),
                    )  # fmt: skip
                    if m.kind != "empty":
                        maps[window, r, d] = m
                assert sorted(r for _, r, _ in maps) == trt_senders(d, ctx_tp, gen_tp, HEADS)
                write(pair, maps, "direct")
                shape = (GEN_BLOCKS, len(layers), 2, HEADS // gen_tp * HEAD_DIM * TPB)
                want = torch.zeros(shape, dtype=torch.bfloat16)
                for gh, head in enumerate(rank_heads(d, gen_tp, HEADS)):
                    r = next(x for x in range(ctx_tp) if head in rank_heads(x, ctx_tp, HEADS))
                    ch = rank_heads(r, ctx_tp, HEADS).index(head)
                    for layer in range(len(layers)):
                        for kv in range(2):
                            for t in range(first, TOKENS):
                                src = trt_row(ctx[r], ctx_ids[t // TPB], layer, kv, ch, t % TPB)
                                trt_row(want, gen_ids[t // TPB], layer, kv, gh, t % TPB).copy_(src)
                assert torch.equal(gen_bytes(pair, shape), want), (window, d)
        finally:
            for h in held:
                h.deregister()


# --- (e) attention DP: each DP group a TP group of its own -----------------------------------


def dp_targets(rank: int, tp: int, dp: int, peer_tp: int, peer_dp: int, peer_dp_rank: int) -> list[int]:
    """``TargetRanksInfoForDP`` at PP 1 and CP 1: the peer ranks a rank of ``tp`` ranks in
    ``dp`` attention-DP groups (``mTensorParallelism / mDPsize`` ranks a group; ``dp`` 1:
    attention DP off) pairs with, in the peer's DP group ``peer_dp_rank`` (the peer state's
    ``mDPrank``, 0 where the peer has attention DP off)."""
    group, peer_group = tp // dp, peer_tp // peer_dp
    in_group = rank % group
    if group <= peer_group:
        k = peer_group // group
        start = in_group * k + peer_dp_rank * peer_group
        return list(range(start, start + k))
    return [in_group // (group // peer_group) + peer_dp_rank * peer_group]


def dp_need_send(rank: int, tp: int, dp: int, peer_tp: int, peer_dp: int, heads: int) -> bool:
    """``CacheFormatter::needSendCache``: ``mDupHeadFactor`` (this side's heads a rank times
    ranks a DP group over the peer's) replicas hold each head; the first of them sends
    (``selfTpRankInDpGroup % mDupHeadFactor == 0``)."""
    group, peer_group = tp // dp, peer_tp // peer_dp
    mine, theirs = len(rank_heads(0, group, heads)), len(rank_heads(0, peer_group, heads))
    dup = max(1, mine * group // (theirs * peer_group))
    return (rank % group) % dup == 0


@pytest.mark.parametrize(
    ("ctx", "gen", "heads"),
    [
        ((2, 2, 1), (2, 1, 0), 8),  # context attention DP 2 (every head on a rank) -> generation TP 2
        ((2, 1, 0), (2, 2, 1), 8),  # context TP 2 -> generation attention DP 2, the request on DP rank 1
        ((4, 2, 1), (2, 2, 0), 8),  # TP 4 in 2 DP groups (4 heads a rank) -> 2 DP groups of one rank
        ((4, 2, 1), (4, 1, 0), 2),  # 2 heads, a head a rank in a DP group -> TP 4, each head on 2 ranks
        ((4, 1, 0), (2, 2, 1), 2),  # context TP 4 (each head on 2 ranks) -> a DP group of one rank
    ],
    ids=["dp2-tp2", "tp2-dp2", "tp4dp2-tp2dp2", "tp4dp2-tp4-replicated", "tp4-replicated-tp2dp2"],
)
def test_attention_dp(
    pair: AgentPair, ctx: tuple[int, int, int], gen: tuple[int, int, int], heads: int
) -> None:
    """Attention DP (``mEnableAttentionDP``): ``tp`` ranks in ``dp`` groups of ``tp / dp``
    ranks, each group its own requests and its heads split over its ranks alone (a group of
    one rank holds every head). ``ctx`` and ``gen`` are ``(tp, dp, the DP rank that holds the
    request)``. As the docs say, a rank's shard is its place in its DP group,
    ``Shard(rank % (tp // dp), tp // dp, heads)``, and only the two groups that hold the
    request pair; the senders are TRT-LLM's (``dp_targets``, ``dp_need_send``)."""
    (ctx_tp, ctx_dp, ctx_dp_rank), (gen_tp, gen_dp, gen_dp_rank) = ctx, gen
    ctx_group, gen_group = ctx_tp // ctx_dp, gen_tp // gen_dp
    ctx_ranks = range(ctx_dp_rank * ctx_group, (ctx_dp_rank + 1) * ctx_group)
    pools = {
        r: primary_pool(
            CTX_BLOCKS, LAYERS, len(rank_heads(r % ctx_group, ctx_group, heads)), HEAD_DIM, 2,
            seed(0, r % ctx_group, ctx_group, heads),
        )
        for r in ctx_ranks
    }  # fmt: skip
    shards = {r: Shard(r % ctx_group, ctx_group, heads) for r in ctx_ranks}
    regs = {
        r: kvlayout.detect(p, "trtllm", hints(p.shape[3] // (HEAD_DIM * TPB), 2)) for r, p in pools.items()
    }
    held = [nx.register(pair.agent, reg) for reg in regs.values()]
    try:
        for g in range(gen_dp_rank * gen_group, (gen_dp_rank + 1) * gen_group):
            mine = rank_heads(g % gen_group, gen_group, heads)
            dst = Shard(g % gen_group, gen_group, heads)
            there = handshake(pair, dst, heads=len(mine), kv_factor=2, layers=LAYERS)
            maps = {}
            for r, reg in regs.items():
                m = block_map(reg, there, CTX_IDS, GEN_IDS, num_tokens=TOKENS, src_shard=shards[r])
                if m.kind != "empty" and shards[r].sends_to(dst):
                    maps[r] = m
            senders = [
                r
                for r in dp_targets(g, gen_tp, gen_dp, ctx_tp, ctx_dp, ctx_dp_rank if ctx_dp > 1 else 0)
                if dp_need_send(r, ctx_tp, ctx_dp, gen_tp, gen_dp, heads)
            ]
            for r in senders:  # the context side pairs the same way round
                assert g in dp_targets(r, ctx_tp, ctx_dp, gen_tp, gen_dp, gen_dp_rank if gen_dp > 1 else 0)
            assert sorted(maps) == senders, (g, sorted(maps))
            write(pair, maps, "direct")
            shape = (GEN_BLOCKS, LAYERS, 2, len(mine) * HEAD_DIM * TPB)
            want = torch.zeros(shape, dtype=torch.bfloat16)
            for gh, head in enumerate(mine):
                (r,) = (x for x in senders if head in rank_heads(x % ctx_group, ctx_group, heads))
                ch = rank_heads(r % ctx_group, ctx_group, heads).index(head)
                for layer in range(LAYERS):
                    for kv in range(2):
                        for t in range(TOKENS):
                            src = trt_row(pools[r], CTX_IDS[t // TPB], layer, kv, ch, t % TPB)
                            trt_row(want, GEN_IDS[t // TPB], layer, kv, gh, t % TPB).copy_(src)
            assert torch.equal(gen_bytes(pair, shape), want), g
    finally:
        for h in held:
            h.deregister()


# --- (f) block reuse on the generation side ----------------------------------------------------


@pytest.mark.parametrize(
    ("ctx_tp", "gen_tp", "reused", "strategy"),
    [(1, 1, 2, "direct"), (2, 4, 1, "direct"), (4, 2, 3, "staged"), (2, 2, 0, "direct")],
)
def test_generation_block_reuse(
    pair: AgentPair, ctx_tp: int, gen_tp: int, reused: int, strategy: nx.Strategy
) -> None:
    """The generation rank's prefix cache already holds the request's first ``reused``
    blocks (shared with other requests: they hold KV that must not change). TRT-LLM's
    receiver fills only the blocks it newly allocated (``getBlockRangeForReceiving``:
    ``fromNewlyAllocatedBlockIds``, the blocks not in its radix tree) and asks for them by
    their hashes; the sender sends its last that many blocks (``getBlockRangeForSending``:
    ``ids.end() - requestBlockNum``). A connector passes both sides' every block id and
    ``first_token`` the reused blocks' tokens (docs/pd-connectors.md)."""
    ctx = context_ranks(ctx_tp, 1, HEADS, 2)
    regs = {r: kvlayout.detect(ctx[0, r], "trtllm", hints(HEADS // ctx_tp, 2)) for r in range(ctx_tp)}
    held = [nx.register(pair.agent, reg) for reg in regs.values()]
    new_ids = GEN_IDS[reused:]  # getNewlyAllocatedBlockIds: the request's blocks not reused
    try:
        for d in range(gen_tp):
            base = 200 + d  # the generation pool's KV before the request
            dst = Shard(d, gen_tp, HEADS)
            there = handshake(pair, dst, heads=HEADS // gen_tp, kv_factor=2, layers=LAYERS, seed=base)
            first = (len(GEN_IDS) - len(new_ids)) * TPB
            maps = {}
            for r, reg in regs.items():
                src = Shard(r, ctx_tp, HEADS)
                m = block_map(
                    reg, there, CTX_IDS, GEN_IDS, num_tokens=TOKENS, first_token=first, src_shard=src
                )
                if m.kind != "empty" and src.sends_to(dst):
                    maps[r] = m
            assert sorted(maps) == trt_senders(d, ctx_tp, gen_tp, HEADS)
            write(pair, maps, strategy)
            shape = (GEN_BLOCKS, LAYERS, 2, HEADS // gen_tp * HEAD_DIM * TPB)
            want = primary_pool(GEN_BLOCKS, LAYERS, HEADS // gen_tp, HEAD_DIM, 2, base)
            sent = CTX_IDS[len(CTX_IDS) - len(new_ids) :]  # the sender's last len(new_ids) blocks
            for i, (cb, gb) in enumerate(zip(sent, new_ids, strict=True)):
                block = len(CTX_IDS) - len(new_ids) + i  # the request's block both are
                for gh, head in enumerate(rank_heads(d, gen_tp, HEADS)):
                    r = next(x for x in range(ctx_tp) if head in rank_heads(x, ctx_tp, HEADS))
                    ch = rank_heads(r, ctx_tp, HEADS).index(head)
                    for layer in range(LAYERS):
                        for kv in range(2):
                            for slot in range(min(TPB, TOKENS - block * TPB)):
                                src_row = trt_row(ctx[0, r], cb, layer, kv, ch, slot)
                                trt_row(want, gb, layer, kv, gh, slot).copy_(src_row)
            got = gen_bytes(pair, shape)
            assert torch.equal(got[GEN_IDS[:reused]], want[GEN_IDS[:reused]]), "a reused block changed"
            assert torch.equal(got, want), d
    finally:
        for h in held:
            h.deregister()


# --- (g) DSA (DeepSeek-V3.2): the indexer K pool beside the latents ----------------------------

INDEX_VALUES, INDEX_SCALES = 128, 4  # index_head_dim fp8 bytes, then a float32 scale (quant block 128)
INDEXER_BUILDER = "tests.integrations.trtllm.test_trtllm_pd_nixl:indexer_pool"


def indexer_pool(
    layers: int, blocks: int = GEN_BLOCKS, seed: int | None = None
) -> tuple[Any, list[torch.Tensor]]:
    """``DSACacheManager``'s indexer K pool (``get_indexer_k_cache_pool()``): uint8
    ``[NB, NL, 1, TPB * (128 + 4)]``, each block's layer row its tokens' fp8 values, then their
    scales (``get_indexer_k_cache_buffers``' non-interleaved layout), detected as the docs say;
    the peer's builder (zeroed) and the context's (random from ``seed``)."""
    shape = (blocks, layers, 1, TPB * (INDEX_VALUES + INDEX_SCALES))
    if seed is None:
        pool = torch.zeros(shape, dtype=torch.uint8)
    else:
        pool = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return kvlayout.detect(pool, "trtllm", {"tokens_per_block": TPB}), [pool]


def index_key(pool: torch.Tensor, block: int, layer: int, tok: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's indexer key, read from the pool's flat bytes: its 128 value bytes at
    ``tok * 128`` of the block's layer row, its 4 scale bytes at ``TPB * 128 + tok * 4``."""
    row = (block * pool.shape[1] + layer) * TPB * (INDEX_VALUES + INDEX_SCALES)
    flat = pool.reshape(-1)
    values = row + tok * INDEX_VALUES
    scale = row + TPB * INDEX_VALUES + tok * INDEX_SCALES
    return flat[values : values + INDEX_VALUES], flat[scale : scale + INDEX_SCALES]


@pytest.mark.parametrize(("ctx_tp", "gen_tp"), [(2, 1), (1, 2), (4, 2)])
def test_dsa_indexer_pool_beside_the_latents(pair: AgentPair, ctx_tp: int, gen_tp: int) -> None:
    """A DSA model's context rank holds the latents (``[NB, NL, 1, TPB * 576]``; 48 here) and
    the indexer K pool, both whole on every rank, under the same block ids
    (``BlockRange::getBlockRangeForWindow(window, useIndexerKCache)``: the request's block ids
    in the indexer pool). ``MLACacheFormatter::format`` sends both from the one context rank
    ``needSendCache`` picks, the KV pass then the indexer pass; here each pool is its own
    registration and map, the indexer map's ``latents`` picking the same sender."""
    latents = context_ranks(ctx_tp, 1, 1, 1)
    index = {r: indexer_pool(LAYERS, CTX_BLOCKS, seed=300 + r)[1][0] for r in range(ctx_tp)}
    regs = {r: kvlayout.detect(latents[0, r], "trtllm", hints(1, 1)) for r in range(ctx_tp)}
    index_regs = {r: kvlayout.detect(p, "trtllm", {"tokens_per_block": TPB}) for r, p in index.items()}
    assert index_regs[0].kernel_groups[0].format.name == "NB_NL_BSV_BSS"
    held = [nx.register(pair.agent, reg) for reg in [*regs.values(), *index_regs.values()]]
    try:
        for d in range(gen_tp):
            dst = Shard(d, gen_tp, 1)
            for pools, builder, args in (
                (regs, BUILDER, {"heads": 1, "kv_factor": 1, "layers": LAYERS}),
                (index_regs, INDEXER_BUILDER, {"layers": LAYERS}),
            ):
                there = handshake(pair, dst, builder, **args)
                maps = {}
                for r, reg in pools.items():
                    m = block_map(
                        reg, there, CTX_IDS, GEN_IDS, num_tokens=TOKENS, src_shard=Shard(r, ctx_tp, 1)
                    )
                    assert m.latents
                    if Shard(r, ctx_tp, 1).sends_to(dst, latents=m.latents):
                        maps[r] = m
                assert list(maps) == [mla_sender(d, ctx_tp, gen_tp)]
                write(pair, maps, "direct")
                if pools is regs:  # the latents, before the peer's cache is the indexer pool
                    shape = (GEN_BLOCKS, LAYERS, 1, LATENT * TPB)
                    want = expected(latents, ctx_tp, 1, shape, d, gen_tp, list(range(LAYERS)), 1)
                    assert torch.equal(gen_bytes(pair, shape), want), d
            # the indexer pass: its pool is the peer's cache now
            (raw,) = pair.peer.cache_bytes()
            got = torch.from_numpy(np.array(raw)).reshape(GEN_BLOCKS, LAYERS, 1, -1)
            want = torch.zeros_like(got)
            src = index[mla_sender(d, ctx_tp, gen_tp)]
            for layer in range(LAYERS):
                for t in range(TOKENS):
                    for w, s in zip(
                        index_key(want, GEN_IDS[t // TPB], layer, t % TPB),
                        index_key(src, CTX_IDS[t // TPB], layer, t % TPB),
                        strict=True,
                    ):
                        w.copy_(s)
            assert torch.equal(got, want), d
    finally:
        for h in held:
            h.deregister()


# --- (h) FP8 KV: one float8 pool, its scales the model's ----------------------------------------


@pytest.mark.parametrize(("ctx_tp", "gen_tp"), [(2, 4), (4, 2)])
def test_fp8_kv_between_tp_degrees(pair: AgentPair, ctx_tp: int, gen_tp: int) -> None:
    """FP8 KV (``kv_cache_dtype="fp8"``): the primary pool is float8_e4m3fn, of the same
    shape; its dequantization scales are per tensor (the checkpoint's
    ``kv_cache_scaling_factor``), in no pool, so the pool alone moves (``inquireSupport``
    wants the same data type on both sides). Byte-exact, as TRT-LLM's split/concat copies it."""
    fp8 = torch.float8_e4m3fn
    ctx = context_ranks(ctx_tp, 1, HEADS, 2, fp8)
    regs = {r: kvlayout.detect(ctx[0, r], "trtllm", hints(HEADS // ctx_tp, 2)) for r in range(ctx_tp)}
    held = [nx.register(pair.agent, reg) for reg in regs.values()]
    try:
        for d in range(gen_tp):
            dst = Shard(d, gen_tp, HEADS)
            there = handshake(
                pair, dst, heads=HEADS // gen_tp, kv_factor=2, layers=LAYERS, dtype="float8_e4m3fn"
            )
            assert there.groups[0].planes[0].dtype == "float8_e4m3fn"
            maps = {}
            for r, reg in regs.items():
                m = block_map(
                    reg, there, CTX_IDS, GEN_IDS, num_tokens=TOKENS, src_shard=Shard(r, ctx_tp, HEADS)
                )
                if m.kind != "empty" and Shard(r, ctx_tp, HEADS).sends_to(dst):
                    maps[r] = m
            assert sorted(maps) == trt_senders(d, ctx_tp, gen_tp, HEADS)
            write(pair, maps, "direct")
            shape = (GEN_BLOCKS, LAYERS, 2, HEADS // gen_tp * HEAD_DIM * TPB)
            want = expected(ctx, ctx_tp, 1, shape, d, gen_tp, list(range(LAYERS)), HEADS, dtype=fp8)
            assert torch.equal(gen_bytes(pair, shape, fp8).view(torch.uint8), want.view(torch.uint8)), d
        # a bf16 peer is refused, as TRT-LLM's inquireSupport refuses another data type
        bf16, _ = generation_pool(HEADS // gen_tp, 2, LAYERS)
        with pytest.raises(BlockMapError, match="src is float8_e4m3fn and dst is bfloat16"):
            block_map(
                regs[0],
                bf16.describe(shard=Shard(0, gen_tp, HEADS)),
                CTX_IDS,
                GEN_IDS,
                num_tokens=TOKENS,
                src_shard=Shard(0, ctx_tp, HEADS),
            )
    finally:
        for h in held:
            h.deregister()


# --- (i) KVCacheManagerV2 on the context side ---------------------------------------------------


@pytest.mark.parametrize("gen_tp", [1, 2])
def test_v2_context_into_v1_generation(pair: AgentPair, gen_tp: int) -> None:
    """A context rank on ``KVCacheManagerV2``: its connector gets a ``KvCacheLayout``, a region
    of page slots ``stride`` bytes apart, each every layer's K then V (HND) and then bytes
    of other buffers the stride steps over (block scales here). ``kv_cache_layout_pools``
    reads ``"group0"``; registered with NIXL (the region's storage) and mapped by page slots
    (``get_aggregated_page_indices``) into a V1 generation pool of each TP rank. Each byte is
    checked against V2's addressing, ``base + stride * slot + (2 * layer + role) * buffer``."""
    from tests.integrations.trtllm.test_trtllm_v2_layout import Group, Layout, Region, kv_refs

    buf = HEADS * TPB * HEAD_DIM * 2  # one layer's K (or V) of one slot, bf16 bytes
    extra = 96
    slot = LAYERS * 2 * buf + extra
    storage = torch.randint(
        0, 256, (CTX_BLOCKS * slot,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)
    )
    kv = Region(storage, 0, LAYERS * 2 * buf, slot, CTX_BLOCKS, kv_refs(range(LAYERS)))
    scales = Region(
        storage, LAYERS * 2 * buf, extra, slot, CTX_BLOCKS, kv_refs(range(LAYERS), ("key_block_scale",))
    )
    layout = Layout(TPB, (Group(0, tuple(range(LAYERS)), None, (kv, scales)),))
    pools = kv_cache_layout_pools(layout, torch.bfloat16, {"num_kv_heads": HEADS, "head_dim": HEAD_DIM})
    reg = pools["group0"]
    held = nx.register(pair.agent, reg)
    try:
        for d in range(gen_tp):
            mine = rank_heads(d, gen_tp, HEADS)
            dst = Shard(d, gen_tp, HEADS)
            there = handshake(pair, dst, heads=len(mine), kv_factor=2, layers=LAYERS)
            m = block_map(reg, there, CTX_IDS, GEN_IDS, num_tokens=TOKENS, src_shard=Shard(0, 1, HEADS))
            write(pair, {d: m}, "direct")
            shape = (GEN_BLOCKS, LAYERS, 2, len(mine) * HEAD_DIM * TPB)
            want = torch.zeros(shape, dtype=torch.bfloat16)
            row = HEAD_DIM * 2  # one head's token row, bytes
            for gh, head in enumerate(mine):
                for layer in range(LAYERS):
                    for r in range(2):
                        for t in range(TOKENS):
                            at = (2 * layer + r) * buf + (head * TPB + t % TPB) * row
                            src = kv.bytes_of(CTX_IDS[t // TPB], at, row).view(torch.bfloat16)
                            trt_row(want, GEN_IDS[t // TPB], layer, r, gh, t % TPB).copy_(src)
            # random bytes read as bf16 hold NaNs: compare the bytes
            assert torch.equal(gen_bytes(pair, shape).view(torch.uint8), want.view(torch.uint8)), d
    finally:
        held.deregister()


# --- (j) Helix: context parallelism on the generation side (MLA) --------------------------------


def helix_blocks(cp_rank: int, cp_size: int, blocks: int, round_robin: bool) -> list[int]:
    """The request's blocks a generation CP rank holds, in its own order:
    ``getBlockNumAccountingForCP`` of them (the first ``blocks % cp_size`` ranks one more),
    local block ``i`` being the request's ``getGlobalBlockIdAccountingForCP(i, ...)``: a
    contiguous run, or every ``cp_size``-th from ``cp_rank`` under
    ``TRTLLM_USE_ROUND_ROBIN_BLOCK_DIST_FOR_CP``."""
    count = blocks // cp_size + (1 if blocks % cp_size > cp_rank else 0)
    if round_robin:
        return [i * cp_size + cp_rank for i in range(count)]
    first = blocks // cp_size * cp_rank + min(cp_rank, blocks % cp_size)
    return list(range(first, first + count))


def split_place(block: int, cp_size: int, blocks: int, round_robin: bool) -> tuple[int, int]:
    """Where ``splitKVCacheForMLAKernel`` puts the request's block ``block``: (the CP rank,
    its local block there), ``block % cp`` and ``block / cp`` round robin, else by the
    prefix sums of ``getBlockNumAccountingForCP`` (``getBlockIdInDomainCPandRankInDomainCP``)."""
    if round_robin:
        return block % cp_size, block // cp_size
    start = 0
    for rank in range(cp_size):
        count = blocks // cp_size + (1 if blocks % cp_size > rank else 0)
        if block < start + count:
            return rank, block - start
        start += count
    raise AssertionError(block)


@pytest.mark.parametrize(("cp", "round_robin"), [(2, False), (2, True), (4, False), (8, False), (3, True)])
def test_helix_generation_cp(pair: AgentPair, cp: int, round_robin: bool) -> None:
    """Helix (``mContextParallelism`` on the generation side; the context side's is 1): the
    context rank's latents split by whole blocks over the generation CP ranks
    (``MLACacheFormatter::format``, ``getBlockNumAccountingForCP``), each rank's share in
    its own blocks; a rank that holds none is skipped. Each CP rank maps the context's ids
    of its blocks onto its own, the request's tokens in them (``num_tokens`` short only where
    it holds the request's last block): a plain block map, each side's block lists as its
    blocks (kvlayout's ``Shard`` CP is vLLM's token interleave, not this)."""
    blocks = BLOCKS
    ctx = context_ranks(1, 1, 1, 1)
    reg = kvlayout.detect(ctx[0, 0], "trtllm", hints(1, 1))
    held = nx.register(pair.agent, reg)
    try:
        for c in range(cp):
            mine = helix_blocks(c, cp, blocks, round_robin)
            there = handshake(pair, Shard(0, 1, 1), heads=1, kv_factor=1, layers=LAYERS)
            shape = (GEN_BLOCKS, LAYERS, 1, LATENT * TPB)
            if not mine:
                assert not gen_bytes(pair, shape).any()
                continue
            own = GEN_IDS[: len(mine)]  # this rank's blocks for the request
            tokens = sum(min(TPB, TOKENS - b * TPB) for b in mine)
            m = block_map(reg, there, [CTX_IDS[b] for b in mine], own, num_tokens=tokens)
            write(pair, {c: m}, "direct")
            want = torch.zeros(shape, dtype=torch.bfloat16)  # the kernel's placement, block by block
            for b in range(blocks):
                rank, local = split_place(b, cp, blocks, round_robin)
                if rank != c:
                    continue
                for layer in range(LAYERS):
                    for t in range(min(TPB, TOKENS - b * TPB)):
                        src = trt_row(ctx[0, 0], CTX_IDS[b], layer, 0, 0, t)
                        trt_row(want, own[local], layer, 0, 0, t).copy_(src)
            assert torch.equal(gen_bytes(pair, shape), want), c
    finally:
        held.deregister()


# --- (k) Helix under generation TP and PP -------------------------------------------------------


def trt_targets(
    rank: int, mine: tuple[int, int, int], peer: tuple[int, int, int]
) -> tuple[list[int], int, int]:
    """``TargetRanksInfoForDPImpl`` without attention DP, for sides ``(tp, pp, cp)`` of even
    stages (``mAttentionLayerNumPerPP``: ``LAYERS // pp`` each): the peer ranks a rank pairs
    with, CP-major then TP then PP (``pp * tp * cp + tp_rank * cp + cp_rank``), and the
    domain's TP and PP sizes. Both sizes powers of two, as TRT-LLM checks."""
    (tp, pp, cp), (peer_tp, peer_pp, peer_cp) = mine, peer
    cp_rank, tp_rank, pp_rank = rank % cp, rank % (tp * cp) // cp, rank // (tp * cp)
    layers = set(stage_layers(pp_rank, pp))
    pps = [p for p in range(peer_pp) if layers.intersection(stage_layers(p, peer_pp))]
    if tp <= peer_tp:
        domain_tp = peer_tp // tp
        tps = list(range(tp_rank * domain_tp, (tp_rank + 1) * domain_tp))
    else:
        domain_tp, tps = 1, [tp_rank // (tp // peer_tp)]
    cps = (
        list(range(cp_rank * (peer_cp // cp), (cp_rank + 1) * (peer_cp // cp)))
        if cp <= peer_cp
        else [cp_rank // (cp // peer_cp)]
    )
    ranks = [k * peer_tp * peer_cp + j * peer_cp + i for i in cps for j in tps for k in pps]
    return ranks, domain_tp, len(pps)


def helix_senders(gen_rank: int, ctx: tuple[int, int], gen: tuple[int, int, int]) -> list[int]:
    """The context ranks that send generation rank ``gen_rank`` its latents:
    ``MLACacheFormatter::pickRecvConnections`` takes ``mIRanks[i + (dp_rank % domain_tp) *
    domain_pp]`` for each PP domain rank ``i`` (DP rank 0: the domain's first TP rank), and
    each is checked against the context side: ``needSendCache`` (a context of more TP ranks
    sends from ``tp_rank % (ctx_tp / gen_tp) == 0``) and its own ``targetIRanks``."""
    (ctx_tp, ctx_pp), gen_tp = ctx, gen[0]
    ranks, _, domain_pp = trt_targets(gen_rank, gen, (ctx_tp, ctx_pp, 1))
    picked = ranks[:domain_pp]
    for r in picked:
        assert ctx_tp <= gen_tp or r % ctx_tp % (ctx_tp // gen_tp) == 0, r
        assert gen_rank in trt_targets(r, (ctx_tp, ctx_pp, 1), gen)[0], (r, gen_rank)
    return picked


@pytest.mark.parametrize(
    ("ctx", "gen", "round_robin"),
    [
        ((1, 1), (2, 1, 2), False),  # TP 2 x CP 2: context rank 0 sends all four
        ((2, 1), (2, 1, 2), True),  # TP 2 -> TP 2 x CP 2: each context rank its TP rank's CP ranks
        ((4, 1), (2, 1, 2), False),  # context TP 4 -> TP 2 x CP 2: context ranks 0 and 2 send
        ((1, 1), (1, 2, 2), False),  # generation PP 2 x CP 2: each stage's layers of each CP share
        ((1, 2), (2, 1, 4), True),  # context PP 2 -> TP 2 x CP 4: both stages into every rank
        ((2, 2), (1, 2, 2), False),  # context TP 2 x PP 2 -> PP 2 x CP 2: TP rank 0 of each stage
    ],
    ids=["tp1-tp2cp2", "tp2-tp2cp2-rr", "tp4-tp2cp2", "pp1-pp2cp2", "pp2-tp2cp4-rr", "tp2pp2-pp2cp2"],
)
def test_helix_with_generation_tp_and_pp(
    pair: AgentPair, ctx: tuple[int, int], gen: tuple[int, int, int], round_robin: bool
) -> None:
    """Helix beside TP and PP: generation rank ``pp * tp * cp + tp_rank * cp + cp_rank``
    holds its stage's layers of the latents (whole on every TP rank) for its CP share of the
    request's blocks (``helix_blocks``). TRT-LLM's context rank (CP 1) splits its blocks over
    the CP domain and its layers over the PP domain (``splitKVCacheForMLAKernel``: output
    ``cp_rank * domain_pp + pp_rank``, block ``block_in_cp`` of it, layer ``layer_in_pp``)
    and sends each TP rank of the domain the same split (``MLACacheFormatter::format``).
    The connector: ``sends_to(..., latents=True)`` picks the context TP rank, both sides
    numbered with the model's layers cut to the layers they share (``for_layers``), and the
    CP rank's blocks as a plain block map. Context ranks hold different bytes here (seeded
    by rank) so a wrong sender shows."""
    (ctx_tp, ctx_pp), (gen_tp, gen_pp, cp) = ctx, gen
    blocks = BLOCKS
    pools = {
        (p, r): primary_pool(CTX_BLOCKS, LAYERS // ctx_pp, 1, LATENT, 1, 500 + 10 * p + r)
        for p in range(ctx_pp)
        for r in range(ctx_tp)
    }
    regs = {
        k: kvlayout.detect(pool, "trtllm", hints(1, 1)).numbered(stage_layers(k[0], ctx_pp))
        for k, pool in pools.items()
    }
    held = [nx.register(pair.agent, reg) for reg in regs.values()]
    try:
        for g in range(gen_tp * gen_pp * cp):
            c, t, p = g % cp, g % (gen_tp * cp) // cp, g // (gen_tp * cp)
            layers = stage_layers(p, gen_pp)
            shape = (GEN_BLOCKS, len(layers), 1, LATENT * TPB)
            dst = Shard(t, gen_tp, 1)
            there = handshake(pair, dst, heads=1, kv_factor=1, layers=len(layers), ids=layers)
            mine = helix_blocks(c, cp, blocks, round_robin)
            senders = helix_senders(g, ctx, gen)
            if not mine:
                assert not gen_bytes(pair, shape).any()
                continue
            own = GEN_IDS[: len(mine)]
            tokens = sum(min(TPB, TOKENS - b * TPB) for b in mine)
            maps = {}
            for (cp_stage, r), reg in regs.items():
                shared = [i for i in stage_layers(cp_stage, ctx_pp) if i in layers]
                if not shared or not Shard(r, ctx_tp, 1).sends_to(dst, latents=True):
                    continue
                m = block_map(
                    reg.for_layers(shared), there.for_layers(shared), [CTX_IDS[b] for b in mine], own,
                    num_tokens=tokens, src_shard=Shard(r, ctx_tp, 1),
                )  # fmt: skip
                maps[cp_stage * ctx_tp + r] = m  # TRT-LLM's context rank number (CP 1)
            assert sorted(maps) == sorted(senders), (g, sorted(maps), senders)
            write(pair, maps, "direct")
            want = torch.zeros(shape, dtype=torch.bfloat16)  # the kernel's placement
            for b in range(blocks):
                rank, local = split_place(b, cp, blocks, round_robin)
                if rank != c:
                    continue
                for gl, layer in enumerate(layers):
                    (r,) = (s for s in senders if layer in stage_layers(s // ctx_tp, ctx_pp))
                    cl = stage_layers(r // ctx_tp, ctx_pp).index(layer)
                    for tok in range(min(TPB, TOKENS - b * TPB)):
                        src = trt_row(pools[r // ctx_tp, r % ctx_tp], CTX_IDS[b], cl, 0, 0, tok)
                        trt_row(want, own[local], gl, 0, 0, tok).copy_(src)
            assert torch.equal(gen_bytes(pair, shape), want), g
    finally:
        for h in held:
            h.deregister()


# --- (l) the masked indexer K pool: only full-indexer layers own a row -------------------------

MASKED_LAYERS = 6
FULL_INDEXER = [0, 1, 5]  # GLM-5.2's schedule (index_topk_freq 4, index_skip_topk_offset 2) on 6 layers
MASKED_BUILDER = "tests.integrations.trtllm.test_trtllm_pd_nixl:masked_indexer_pool"


def masked_stage(pp_rank: int, pp: int) -> list[int]:
    """The model's layers of PP stage ``pp_rank`` of ``MASKED_LAYERS`` (even stages)."""
    per = MASKED_LAYERS // pp
    return list(range(pp_rank * per, (pp_rank + 1) * per))


def masked_indexer_pool(
    layer_ids: list[int], blocks: int = GEN_BLOCKS, seed: int | None = None
) -> tuple[Any, list[torch.Tensor]]:
    """A masked indexer K pool (``DSACacheManager`` with ``indexer_k_cache_layer_mask``):
    ``[NB, full-indexer layers of the rank, 1, TPB * 132]``, row ``k`` the rank's ``k``-th
    full-indexer layer (``get_indexer_k_cache_pool_layer_idx``); detected as any indexer
    pool and numbered with those layers' model ids."""
    reg, tensors = indexer_pool(len(layer_ids), blocks, seed)
    return reg.numbered(layer_ids), tensors


def indexer_space(pp: int) -> list[int]:
    """``getIndexerLayerNumPerPP``: each stage's full-indexer layer count."""
    return [sum(1 for i in masked_stage(s, pp) if i in FULL_INDEXER) for s in range(pp)]


@pytest.mark.parametrize(("ctx_pp", "gen_pp"), [(1, 1), (1, 2), (2, 1), (3, 2), (1, 3)])
def test_masked_indexer_pool_between_pp_layouts(pair: AgentPair, ctx_pp: int, gen_pp: int) -> None:
    """GLM-5.2's cross-layer indexer sharing: only full-indexer layers (``is_full_indexer_layer``)
    own a row of the indexer K pool, so a stage's pool holds its full-indexer layers alone,
    and a stage without one has no pool. TRT-LLM's indexer pass pairs the attention pass's
    ranks but splits rows in "indexer layer space" (``targetIRanksForIndexerKCache``: each
    peer's share is the overlap of the prefix sums of ``getIndexerLayerNumPerPP``); a peer
    whose share is empty is skipped on both sides. The connector numbers each pool with its
    full-indexer layers' model ids and maps the layers the two sides share (``for_layers``);
    the oracle follows TRT-LLM's row arithmetic, not the ids."""
    ctx_counts, gen_counts = indexer_space(ctx_pp), indexer_space(gen_pp)
    ctx_full = {s: [i for i in masked_stage(s, ctx_pp) if i in FULL_INDEXER] for s in range(ctx_pp)}
    pools = {s: masked_indexer_pool(ids, CTX_BLOCKS, 700 + s) for s, ids in ctx_full.items() if ids}
    held = [nx.register(pair.agent, reg) for reg, _ in pools.values()]
    try:
        for g in range(gen_pp):
            ids = [i for i in masked_stage(g, gen_pp) if i in FULL_INDEXER]
            if not ids:  # no pool on this rank: TRT-LLM's manager makes none, its peers send it nothing
                assert gen_counts[g] == 0
                continue
            there = handshake(pair, Shard(0, 1, 1), MASKED_BUILDER, layer_ids=ids)
            maps = {}
            for s, (reg, _) in pools.items():
                shared = [i for i in ctx_full[s] if i in ids]
                if shared:
                    maps[s] = block_map(
                        reg.for_layers(shared), there.for_layers(shared), CTX_IDS, GEN_IDS, num_tokens=TOKENS
                    )
            write(pair, maps, "direct")
            (raw,) = pair.peer.cache_bytes()
            got = torch.from_numpy(np.array(raw)).reshape(GEN_BLOCKS, len(ids), 1, -1)
            want = torch.zeros_like(got)
            start = sum(gen_counts[:g])  # this stage's first row in indexer layer space
            for row in range(gen_counts[g]):
                at = start + row
                s = next(x for x in range(ctx_pp) if sum(ctx_counts[:x]) <= at < sum(ctx_counts[: x + 1]))
                src = pools[s][1][0]
                for t in range(TOKENS):
                    for w, v in zip(
                        index_key(want, GEN_IDS[t // TPB], row, t % TPB),
                        index_key(src, CTX_IDS[t // TPB], at - sum(ctx_counts[:s]), t % TPB),
                        strict=True,
                    ):
                        w.copy_(v)
            assert sorted(maps) == sorted(
                s
                for s in range(ctx_pp)
                if set(range(sum(ctx_counts[:s]), sum(ctx_counts[: s + 1])))
                & set(range(start, start + gen_counts[g]))
            ), (g, sorted(maps))  # the context stages TRT-LLM's indexer pass sends (a non-empty share)
            assert torch.equal(got, want), g
    finally:
        for h in held:
            h.deregister()
