"""SGLang's prefill/decode transfer under pipeline parallelism for the pools beside the
plain KV pool: the SWA pool, the Mamba state, the speculative draft pool and the NSA
indexer pool, each from a prefill at PP 2 into a decode at PP 1 and PP 2 (with TP
changes), and a model with both a sliding window and a Mamba-style state (Inkling),
through real NIXL (two agents, UCX loopback), byte-exact against SGLang's indexing.
The connector, pools and oracle helpers are ``test_sglang_pd_nixl``'s.

What SGLang does across stages (read in sgl-project/sglang):

- ``disaggregation/common/conn.py`` ``get_mha_kv_ptrs_with_pp`` /
  ``get_mla_kv_ptrs_with_pp``: a stage's pointer list is paired with the decode's by
  position, ``dst[prefill_start_layer : prefill_start_layer + n]`` where the decode holds
  more entries, one to one where it holds as many. Newer versions publish layer ids
  (``disaggregation/utils.py`` ``get_transfer_kv_layer_ids``, the pools'
  ``get_kv_layer_ids`` / ``get_state_layer_ids``) and pair entries by model layer id
  (``build_transfer_entry_pairs``; ``mooncake/conn.py`` ``_send_kvcache_generic``,
  ``_send_mamba_state``); without ids at PP > 1 and unequal counts that raises "PP-
  heterogeneous transfer requires layer ids on both peers".
- SWA (``mem_cache/kv_cache_configurator.py`` ``_build_hybrid_swa_kv_pool``): a stage's
  ``SWAKVPool`` is given the model's every full and sliding layer (its ids are not cut
  to ``[start_layer, end_layer)``), so each stage's pool holds every layer and writes its
  own; SGLang's one-to-one pairing then sends every layer from every stage (into a
  decode at PP 1 two stages write the same layers).
- Mamba (``_build_hybrid_linear_kv_pool``, ``_build_hybrid_req_pool``): a stage's full
  attention pool and ``MambaPool`` hold its own layers (ids cut to the stage's range).
- The draft pool (``build_kv_layer_ids``): held by the stage of the last layers, its
  entries numbered ``num_hidden_layers + i``, moved with the target's page ids.
- NSA (``NSATokenToKVPool`` of ``start_layer``/``end_layer``): latents and indexer pages
  of the stage's layers, the indexer by the same page ids (state type ``"nsa"``).
- Inkling (``configs/inkling_config.py``): sliding-window ``local_layer_ids`` with their
  own KV heads beside full layers (an ``SWAKVPool``), and on every layer short-conv
  states in the Mamba pool, ``mamba2_cache_params``: six conv states ``(K - 1, dim)``
  (full K, V; local K, V; attention and MLP streams) and an SSM state of no elements;
  ``setup_state_kv_args`` adds it as state ``"mamba"`` from the ``req_to_token_pool``
  beside the ``"swa"`` state.

As a connector: each stage numbers its registrations with the model's layer ids (a pool
holding every layer is cut to the stage's own, ``registration.for_layers``), the decode
describes its pools numbered alike, and each stage maps into the description cut to its
layers (``description.for_layers``), with its own ``req_to_token`` pages and state
slots; a rank pair's maps are joined into one WRITE. Each decode layer then holds what
the stage that ran it wrote; no stage sends a layer it did not run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("nixl")

from kvlayout.integrations.sglang import mamba_state_pools
from kvlayout.testing.sglang import LinearModel, device_pool, shard
from kvlayout.transfer import BlockMap, BlockMapError, Shard, block_map, join_maps
from tests.integrations.sglang.test_sglang_pd_nixl import (
    HEAD_DIM,
    INDEX_DIM,
    NSA_PAGE,
    PAGE,
    PP_LAYERS,
    TOKENS,
    Link,
    Rank,
    agent_pair,
    detect_rank,
    handshake,
    kv_to_page_indices,
    mha_pool,
    mla_pool,
    nsa_pool,
    post,
    rank_heads,
    scattered_pages,
    sglang_targets,
    shard_of,
    slots_of,
    stage_layers,
    swa_rank,
    window_start,
)

PP = 2  # prefill's PP size: stage 0 runs layers 0-1, stage 1 layers 2-3
FULL, SLIDING = (1, 3), (0, 2)  # gpt-oss-like (and Inkling's full and local layers)


@pytest.fixture(scope="module")
def agents() -> Any:
    yield from agent_pair("sgl-pp")


def own(ids: Sequence[int], stage: int, pp: int) -> list[int]:
    """The layers of ``ids`` stage ``stage`` of ``pp`` runs."""
    return [i for i in ids if i in stage_layers(stage, pp)]


def owner(layer: int) -> int:
    """The prefill stage that runs model layer ``layer``."""
    return layer // (PP_LAYERS // PP)


def stages_into(ds: int, dpp: int) -> list[int]:
    """The prefill stages decode stage ``ds`` of ``dpp`` takes layers from: every stage
    into a decode at PP 1, stage to stage at equal PP (``CommonKVReceiver``: decode's PP
    size is prefill's or 1)."""
    return [s for s in range(PP) if dpp == 1 or s == ds]


def full_and_sliding(
    src: Any, dst: Any, there: tuple[Any, Any], stage: int, skipped: int, start: int
) -> tuple[BlockMap, BlockMap] | None:
    """A prefill stage rank's maps into one decode rank (``there``: its full and SWA pools'
    descriptions): the full layers the stage ran, every token, and its sliding layers from
    ``start`` (``skipped`` pages before the window); None where it sends that rank nothing."""
    full_there, swa_there = there
    kv = block_map(
        src.full.registration.for_layers(own(FULL, stage, PP)),
        full_there.for_layers(own(FULL, stage, PP)),
        kv_to_page_indices(src.full_slots, PAGE),
        kv_to_page_indices(dst.full_slots, PAGE),
        num_tokens=TOKENS,
        src_shard=src.full.shard,
    )
    if kv.kind == "empty" or not src.full.shard.sends_to(shard_of(full_there)):
        return None
    swa = block_map(
        src.swa.registration.for_layers(own(SLIDING, stage, PP)),
        swa_there.for_layers(own(SLIDING, stage, PP)),
        [0] * skipped + kv_to_page_indices(src.swa_slots, PAGE),
        [0] * skipped + kv_to_page_indices(dst.swa_slots, PAGE),
        num_tokens=TOKENS,
        first_token=start,
        src_shard=src.swa.shard,
    )
    return kv, swa


def head_sources(d: int, dtp: int, ptp: int, heads: int) -> list[tuple[int, int, int]]:
    """Decode rank ``d``'s heads, each with the prefill rank SGLang takes it from and its
    place there."""
    out = []
    for h_local, h in enumerate(rank_heads(d, dtp, heads)):
        src = next(p for p in sglang_targets(d, dtp, ptp, False) if h in rank_heads(p, ptp, heads))
        out.append((h_local, src, rank_heads(src, ptp, heads).index(h)))
    return out


def tokens_into(
    want: torch.Tensor,
    src: torch.Tensor,
    d_slots: Sequence[int],
    p_slots: Sequence[int],
    heads: Sequence[tuple[int, int]] | None = None,
) -> None:
    """SGLang's indexing: ``want[d_slots[t], head] = src[p_slots[t], its head]`` for each
    token (every head where ``heads`` is None: latents)."""
    for d_slot, p_slot in zip(d_slots, p_slots, strict=True):
        if heads is None:
            want[d_slot] = src[p_slot]
        else:
            for h_local, h_src in heads:
                want[d_slot, h_local] = src[p_slot, h_src]


# --- (a) SWAKVPool: every stage's pool holds every layer ------------------------------------


@pytest.mark.parametrize(("ptp", "dtp", "dpp"), [(2, 4, 1), (4, 2, 2), (2, 2, 1)])
def test_swa_pool_under_pipeline_stages(agents: tuple[Any, Any], ptp: int, dtp: int, dpp: int) -> None:
    """gpt-oss-like (8 KV heads; sliding layers 0, 2, full 1, 3): each stage's
    ``SWAKVPool`` holds the full and sliding pools of every layer, noise in the layers
    another stage runs. Each stage's registrations, numbered with the model's ids, are
    cut to its layers; the full pool moves the request's pages, the SWA pool the window's
    (the pages before it SGLang's padding page 0). SGLang itself refuses the TP changes
    for a non-MLA SWA model (``maybe_send_extra``: "PD Disaggregation does NOT support PD
    different TP sizes for non-MLA SWA hybrid models yet")."""
    heads, start = 8, window_start()
    skipped = start // PAGE
    prefill = {
        (s, p): swa_rank(p, ptp, heads, 100 + 10 * s + p, 12, 5, 60 + 4 * s)
        for s in range(PP)
        for p in range(ptp)
    }
    decode = {
        (ds, d): swa_rank(d, dtp, heads, None, 14, 6, 80 + 4 * ds) for ds in range(dpp) for d in range(dtp)
    }
    for ranks in (prefill, decode):  # every layer of the model, in SGLang's pool order
        for r in ranks.values():
            r.full.registration = r.full.registration.numbered(FULL)
            r.swa.registration = r.swa.registration.numbered(SLIDING)
    link = Link(
        agents,
        [r for x in prefill.values() for r in (x.full, x.swa)],
        [r for x in decode.values() for r in (x.full, x.swa)],
    )
    try:
        maps = {}
        for (ds, d), dr in decode.items():
            full_there, swa_there = handshake(dr.full), handshake(dr.swa)
            for s in stages_into(ds, dpp):
                for p in range(ptp):
                    pr = prefill[s, p]
                    pair = full_and_sliding(pr, dr, (full_there, swa_there), s, skipped, start)
                    if pair is None:
                        continue
                    kv, swa = pair
                    maps[s * ptp + p, ds * dtp + d] = join_maps([kv, swa])
        for p, d in maps:
            assert p % ptp in sglang_targets(d % dtp, dtp, ptp, mla=False), (p, d)
        post(link, maps, "direct", 0)
    finally:
        link.close([r for x in [*prefill.values(), *decode.values()] for r in (x.full, x.swa)])

    for (ds, d), dr in decode.items():
        sources = head_sources(d, dtp, ptp, heads)
        for pool, ids in (("full", FULL), ("swa", SLIDING)):
            for i, t in enumerate(getattr(dr, pool).tensors):  # K of each layer, then V
                g, want = ids[i % len(ids)], torch.zeros_like(t)
                if g in stage_layers(ds, dpp):
                    for h_local, src, h_src in sources:
                        ps = prefill[owner(g), src]
                        src_t = getattr(ps, pool).tensors[i]
                        if pool == "full":
                            tokens_into(want, src_t, dr.full_slots, ps.full_slots, [(h_local, h_src)])
                        else:
                            tokens_into(want, src_t, dr.swa_slots, ps.swa_slots, [(h_local, h_src)])
                assert torch.equal(t, want), (pool, ds, d, i)


# --- (b) HybridLinearKVPool: a stage's full layers and Mamba layers --------------------------


@pytest.mark.parametrize(("ptp", "dtp", "dpp"), [(2, 4, 1), (4, 2, 2)])
def test_mamba_pool_under_pipeline_stages(agents: tuple[Any, Any], ptp: int, dtp: int, dpp: int) -> None:
    """Qwen3-Next-like, Gated DeltaNet at layers 0 and 2, full attention (2 KV heads,
    replicated at TP 4) at 1 and 3: each stage's KV pool and ``MambaPool`` hold its own
    layers. Each registration is numbered with them (the states with the Mamba layers'
    ids), the decode's descriptions are cut to the stage's, the state slice of every
    rank pair SGLang sets up moves with the KV where ``sends_to`` picks the pair. The
    state oracle is SGLang's weight sharding (``shard``) of the whole model's state."""
    heads, slots, mamba = 2, 3, (0, 2)
    model = LinearModel("gdn_attn", num_layers=len(mamba), num_heads=8, head_dim=4, state_size=4, n_groups=4)
    whole = device_pool(model, 1, slots, generator=torch.Generator().manual_seed(51))
    whole_states = [*whole.mamba_cache.conv, whole.mamba_cache.temporal]
    pages = -(-TOKENS // PAGE)
    p_slots = {s: slots_of(scattered_pages(pages, 12, 21 + s), PAGE, TOKENS) for s in range(PP)}
    d_slots = {s: slots_of(scattered_pages(pages, 14, 31 + s), PAGE, TOKENS) for s in range(dpp)}
    p_idx, d_idx = {0: 2, 1: 3}, {0: 1, 1: 2}  # each stage's mamba_pool_idx of the request

    def rank(stage: int, pp: int, r: int, tp: int, seeded: bool) -> tuple[Rank, dict[str, Rank], list[Any]]:
        full, linear = own(FULL, stage, pp), own(mamba, stage, pp)
        h = rank_heads(r, tp, heads)
        seed = 70 + 10 * stage + h[0] if seeded else None  # ranks holding one head hold its bytes
        kv = detect_rank(
            mha_pool(12 if seeded else 14, PAGE, len(h), seed, layers=len(full)), PAGE, Shard(r, tp, heads)
        )
        kv.registration = kv.registration.numbered(full)
        pool = device_pool(dataclasses.replace(model, num_layers=len(linear)), tp, slots)
        states = [*pool.mamba_cache.conv, pool.mamba_cache.temporal]
        if seeded:
            rows = [mamba.index(g) for g in linear]
            for t, part in zip(states, shard(model, [w[rows] for w in whole_states], tp, r), strict=True):
                t.copy_(part)
        regs = {
            n: Rank(states, reg.numbered(linear), kv.shard)
            for n, reg in mamba_state_pools(pool, "gdn_attn").items()
        }
        return kv, regs, states

    prefill = {(s, p): rank(s, PP, p, ptp, True) for s in range(PP) for p in range(ptp)}
    decode = {(ds, d): rank(ds, dpp, d, dtp, False) for ds in range(dpp) for d in range(dtp)}
    every = [r for kv, st, _ in [*prefill.values(), *decode.values()] for r in (kv, *st.values())]
    link = Link(
        agents,
        [r for kv, st, _ in prefill.values() for r in (kv, *st.values())],
        [r for kv, st, _ in decode.values() for r in (kv, *st.values())],
    )
    try:
        maps, state_pairs = {}, set()
        for (ds, d), (dkv, dst, _) in decode.items():
            kv_there = handshake(dkv)
            state_there = {n: handshake(r) for n, r in dst.items()}
            for s in stages_into(ds, dpp):
                for p in range(ptp):
                    pkv, pst, _ = prefill[s, p]
                    parts = []
                    kv = block_map(
                        pkv.registration,
                        kv_there.for_layers(own(FULL, s, PP)),
                        kv_to_page_indices(p_slots[s], PAGE),
                        kv_to_page_indices(d_slots[ds], PAGE),
                        num_tokens=TOKENS,
                        src_shard=pkv.shard,
                    )
                    if kv.kind != "empty" and pkv.shard.sends_to(shard_of(kv_there)):
                        parts.append(kv)
                    for n, r in pst.items():
                        m = block_map(
                            r.registration,
                            state_there[n].for_layers(own(mamba, s, PP)),
                            [p_idx[s]],
                            [d_idx[ds]],
                            src_shard=r.shard,
                        )
                        if m.kind != "empty":
                            assert m.kind == "resharded state" or ptp == dtp
                            parts.append(m)
                            state_pairs.add((s, p, ds, d))
                    if parts:
                        maps[s * ptp + p, ds * dtp + d] = join_maps(parts)
        assert state_pairs == {
            (s, p, ds, d)
            for ds in range(dpp)
            for s in stages_into(ds, dpp)
            for d in range(dtp)
            for p in sglang_targets(d, dtp, ptp, False)
        }
        post(link, maps, "direct", 0)
    finally:
        link.close(every)

    for (ds, d), (dkv, _, states) in decode.items():
        linear = own(mamba, ds, dpp)
        for got, want in zip(states, shard(model, whole_states, dtp, d), strict=True):
            for k, g in enumerate(linear):
                assert torch.equal(got[k, d_idx[ds]], want[mamba.index(g), p_idx[owner(g)]]), (ds, d, g)
            others = [i for i in range(slots + 1) if i != d_idx[ds]]
            assert not got[:, others].any(), (ds, d)
        full = own(FULL, ds, dpp)
        for i, t in enumerate(dkv.tensors):
            g, want = full[i % len(full)], torch.zeros_like(t)
            for h_local, src, h_src in head_sources(d, dtp, ptp, heads):
                src_t = prefill[owner(g), src][0].tensors[i // len(full)]  # the stage's K, then V
                tokens_into(want, src_t, d_slots[ds], p_slots[owner(g)], [(h_local, h_src)])
            assert torch.equal(t, want), (ds, d, i)


# --- (c) speculative decoding: the draft pool beside the last stage's layers ---------------


@pytest.mark.parametrize(
    ("kind", "ptp", "dtp", "dpp"), [("mha", 2, 4, 1), ("mha", 4, 2, 2), ("mla", 1, 2, 1)]
)
def test_draft_pool_under_pipeline_stages(
    agents: tuple[Any, Any], kind: str, ptp: int, dtp: int, dpp: int
) -> None:
    """EAGLE's one-layer draft pool (MHA, the target's 8 KV heads) or DeepSeek's NextN
    layer (MLA) is held by the stage of the last layers on each side, its entries
    numbered past the target's (``build_kv_layer_ids``: ``num_hidden_layers + i``) and
    moved with that stage's page ids: the stage's map and the draft's join into one
    WRITE; the other stage moves its target layers alone."""
    heads, mla = 8, kind == "mla"
    pages = -(-TOKENS // PAGE)
    p_slots = {s: slots_of(scattered_pages(pages, 12, 41 + s), PAGE, TOKENS) for s in range(PP)}
    d_slots = {s: slots_of(scattered_pages(pages, 14, 45 + s), PAGE, TOKENS) for s in range(dpp)}

    def rank(layers: Sequence[int], r: int, tp: int, seed: int | None, total: int) -> Rank:
        if mla:
            got = detect_rank(
                mla_pool(total, PAGE, seed, layers=len(layers)), PAGE, Shard(r, tp, heads), mha=False
            )
        else:
            h = rank_heads(r, tp, heads)
            got = detect_rank(
                mha_pool(total, PAGE, len(h), seed, layers=len(layers)), PAGE, Shard(r, tp, heads)
            )
        got.registration = got.registration.numbered(layers)
        return got

    def side(pp: int, tp: int, seeded: bool, total: int) -> dict[tuple[int, int], tuple[Rank, Rank | None]]:
        out = {}
        for s in range(pp):
            for r in range(tp):
                seed = 90 + 10 * s + r if seeded else None
                target = rank(stage_layers(s, pp), r, tp, seed, total)
                draft = (
                    rank([PP_LAYERS], r, tp, None if seed is None else seed + 5, total)
                    if s == pp - 1
                    else None
                )
                out[s, r] = (target, draft)
        return out

    prefill, decode = side(PP, ptp, True, 12), side(dpp, dtp, False, 14)
    every = [r for pair in [*prefill.values(), *decode.values()] for r in pair if r is not None]
    link = Link(
        agents,
        [r for pair in prefill.values() for r in pair if r is not None],
        [r for pair in decode.values() for r in pair if r is not None],
    )
    try:
        maps = {}
        for (ds, d), (dt, dd) in decode.items():
            target_there = handshake(dt)
            for s in stages_into(ds, dpp):
                for p in range(ptp):
                    pt, pd = prefill[s, p]
                    pages_of = (kv_to_page_indices(p_slots[s], PAGE), kv_to_page_indices(d_slots[ds], PAGE))
                    kv = block_map(
                        pt.registration,
                        target_there.for_layers(stage_layers(s, PP)),
                        *pages_of,
                        num_tokens=TOKENS,
                        src_shard=pt.shard,
                    )
                    if kv.kind == "empty" or not pt.shard.sends_to(
                        shard_of(target_there), latents=kv.latents
                    ):
                        continue
                    parts = [kv]
                    if pd is not None:  # the last stage's: the decode's is its last stage's too
                        assert dd is not None
                        draft = block_map(
                            pd.registration, handshake(dd), *pages_of, num_tokens=TOKENS, src_shard=pd.shard
                        )
                        parts.append(draft)
                    maps[s * ptp + p, ds * dtp + d] = join_maps(parts)
        for p, d in maps:
            assert p % ptp in sglang_targets(d % dtp, dtp, ptp, mla), (p, d)
        post(link, maps, "direct", 0)
    finally:
        link.close(every)

    for (ds, d), (dt, dd) in decode.items():
        pools = [(dt, list(stage_layers(ds, dpp)), 0)] + ([(dd, [PP_LAYERS], 1)] if dd is not None else [])
        for pool, ids, which in pools:  # which: the prefill stage's target pool (0) or draft pool (1)
            for i, t in enumerate(pool.tensors):
                g, want = ids[i % len(ids)], torch.zeros_like(t)
                s = PP - 1 if which else owner(g)
                # the prefill pool's entry: its layer's K (or latents), then V
                j = i // len(ids) * (1 if which else PP_LAYERS // PP) + (
                    0 if which else g - stage_layers(s, PP).start
                )
                if mla:
                    sources = [(0, sglang_targets(d, dtp, ptp, mla=True)[0], 0)]
                else:
                    sources = head_sources(d, dtp, ptp, heads)
                for h_local, src, h_src in sources:
                    src_pool = prefill[s, src][which]
                    assert src_pool is not None
                    heads_of = None if mla else [(h_local, h_src)]
                    tokens_into(want, src_pool.tensors[j], d_slots[ds], p_slots[s], heads_of)
                assert torch.equal(t, want), (ds, d, g, i)


# --- (d) NSA (DeepSeek-V3.2): a stage's latents and indexer pages ----------------------------


@pytest.mark.parametrize(("ptp", "dtp", "dpp"), [(1, 2, 1), (2, 1, 2)])
def test_nsa_pool_under_pipeline_stages(agents: tuple[Any, Any], ptp: int, dtp: int, dpp: int) -> None:
    """``NSATokenToKVPool`` of a stage's layers: its latents (``kv_buffer``) and the
    indexer's key pages (``index_k_with_scale_buffer``, state ``"nsa"``), both numbered
    with the stage's layers and moved by the same page ids into the decode's cut, from
    the one prefill rank SGLang picks for latents (``sends_to(latents=True)``)."""
    model_heads = 16
    pages = -(-TOKENS // NSA_PAGE)
    p_slots = {s: slots_of(scattered_pages(pages, 5, 61 + s), NSA_PAGE, TOKENS) for s in range(PP)}
    d_slots = {s: slots_of(scattered_pages(pages, 6, 65 + s), NSA_PAGE, TOKENS) for s in range(dpp)}

    def side(pp: int, tp: int, seeded: bool, total: int) -> dict[tuple[int, int], tuple[Rank, Rank]]:
        out = {}
        for s in range(pp):
            layers = stage_layers(s, pp)
            for r in range(tp):
                kv, index = nsa_pool(total, 70 + 10 * s + r if seeded else None, layers=len(layers))
                kv_rank, index_rank = (
                    detect_rank(x, NSA_PAGE, Shard(r, tp, model_heads), mha=False) for x in (kv, index)
                )
                for x in (kv_rank, index_rank):
                    x.registration = x.registration.numbered(layers)
                out[s, r] = (kv_rank, index_rank)
        return out

    prefill, decode = side(PP, ptp, True, 5), side(dpp, dtp, False, 6)
    every = [r for pair in [*prefill.values(), *decode.values()] for r in pair]
    link = Link(
        agents, [r for pair in prefill.values() for r in pair], [r for pair in decode.values() for r in pair]
    )
    try:
        maps = {}
        for (ds, d), (dkv, dindex) in decode.items():
            kv_there, index_there = handshake(dkv), handshake(dindex)
            for s in stages_into(ds, dpp):
                layers = stage_layers(s, PP)
                for p in range(ptp):
                    pkv, pindex = prefill[s, p]
                    pages_of = (
                        kv_to_page_indices(p_slots[s], NSA_PAGE),
                        kv_to_page_indices(d_slots[ds], NSA_PAGE),
                    )
                    kv = block_map(
                        pkv.registration,
                        kv_there.for_layers(layers),
                        *pages_of,
                        num_tokens=TOKENS,
                        src_shard=pkv.shard,
                    )
                    index = block_map(
                        pindex.registration,
                        index_there.for_layers(layers),
                        *pages_of,
                        num_tokens=TOKENS,
                        src_shard=pindex.shard,
                    )
                    assert kv.latents and index.latents
                    if pkv.shard.sends_to(shard_of(kv_there), latents=True):
                        maps[s * ptp + p, ds * dtp + d] = join_maps([kv, index])
        assert sorted((p % ptp, d % dtp) for p, d in maps) == sorted(
            (p, d)
            for ds in range(dpp)
            for _ in stages_into(ds, dpp)
            for d in range(dtp)
            for p in sglang_targets(d, dtp, ptp, mla=True)
        )
        post(link, maps, "direct", 0)
    finally:
        link.close(every)

    keys = NSA_PAGE * INDEX_DIM  # where a page's scales start
    for (ds, d), (dkv, dindex) in decode.items():
        (src,) = sglang_targets(d, dtp, ptp, mla=True)
        held = list(stage_layers(ds, dpp))
        for i, (t, u) in enumerate(zip(dkv.tensors, dindex.tensors, strict=True)):
            g = held[i]
            s = owner(g)
            skv, sindex = prefill[s, src]
            j = g - stage_layers(s, PP).start
            want = torch.zeros_like(t)
            tokens_into(want, skv.tensors[j], d_slots[ds], p_slots[s])
            assert torch.equal(t, want), ("latents", ds, d, g)
            want = torch.zeros_like(u)
            src_pages = kv_to_page_indices(p_slots[s], NSA_PAGE)
            dst_pages = kv_to_page_indices(d_slots[ds], NSA_PAGE)
            for tok in range(TOKENS):
                a, b, r = src_pages[tok // NSA_PAGE], dst_pages[tok // NSA_PAGE], tok % NSA_PAGE
                k = slice(r * INDEX_DIM, (r + 1) * INDEX_DIM)
                sc = slice(keys + 4 * r, keys + 4 * r + 4)
                want[b, k], want[b, sc] = sindex.tensors[j][a, k], sindex.tensors[j][a, sc]
            assert torch.equal(u, want), ("indexer", ds, d, g)


# --- (e) Inkling: sliding-window layers and short-conv states on every layer -----------------


def sconv_pool(layers: int, tp: int, slots: int, seed: int | None) -> Any:
    """Inkling's Mamba pool (``mamba2_cache_params``: conv states ``(K - 1, dim)`` of the
    full layers' K and V, the local layers' K and V, the attention and MLP streams; an SSM
    state of no elements), ``[NL, slots + 1, *state]`` each: 4 full and 2 local KV heads
    of ``HEAD_DIM``, hidden size 24, kernel 4."""
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    full, local = max(1, 4 // tp) * HEAD_DIM, max(1, 2 // tp) * HEAD_DIM
    dims = (full, full, local, local, 24, 24)
    conv = [
        torch.zeros(layers, slots + 1, 3, n, dtype=torch.bfloat16)
        if gen is None
        else torch.randn(layers, slots + 1, 3, n, generator=gen).to(torch.bfloat16)
        for n in dims
    ]
    temporal = torch.zeros(layers, slots + 1, 0, 0, 0, dtype=torch.bfloat16)
    return SimpleNamespace(mamba_cache=SimpleNamespace(conv=conv, temporal=temporal), num_mamba_layers=layers)


@pytest.mark.parametrize("dpp", [1, 2])
def test_inkling_sliding_window_and_conv_states_under_pipeline_stages(
    agents: tuple[Any, Any], dpp: int
) -> None:
    """A model with both a sliding window and a Mamba-style state, as SGLang registers
    Inkling: an ``SWAKVPool`` of every layer on each stage (full layers 1, 3 with 4 KV
    heads; local layers 0, 2 with 2 of their own) and the short-conv states of the
    stage's layers (state ``"mamba"`` beside ``"swa"``), TP 2 on both sides. The states
    declare no TP split (none of Mamba2, GDN, KDA), so they move whole, rank to rank: at
    equal TP. Each rank pair's maps (full, SWA with its own heads, six conv states) are
    one WRITE."""
    tp, slots, start = 2, 3, window_start()
    skipped = start // PAGE
    p_idx, d_idx = {0: 1, 1: 3}, {0: 2, 1: 1}

    def rank(
        stage: int, pp: int, r: int, seed: int | None, pages: tuple[int, int]
    ) -> tuple[Any, dict[str, Rank], Any]:
        x = swa_rank(r, tp, 4, seed, *pages, (60 if seed is not None else 80) + 4 * stage)
        local = mha_pool(pages[1], PAGE, max(1, 2 // tp), None if seed is None else seed + 3)
        x = dataclasses.replace(x, swa=detect_rank(local, PAGE, Shard(r, tp, 2)))  # its own KV heads
        x.full.registration = x.full.registration.numbered(FULL)
        x.swa.registration = x.swa.registration.numbered(SLIDING)
        layers = stage_layers(stage, pp)
        pool = sconv_pool(len(layers), tp, slots, None if seed is None else seed + 7)
        states = {
            n: Rank(list(pool.mamba_cache.conv), reg.numbered(layers), x.full.shard)
            for n, reg in mamba_state_pools(pool).items()
        }
        assert sorted(states) == [f"conv{i}" for i in range(6)]  # the SSM state of no bytes is left out
        return x, states, pool

    prefill = {(s, p): rank(s, PP, p, 200 + 10 * s + p, (12, 5)) for s in range(PP) for p in range(tp)}
    decode = {(ds, d): rank(ds, dpp, d, None, (14, 6)) for ds in range(dpp) for d in range(tp)}
    link = Link(
        agents,
        [r for x, st, _ in prefill.values() for r in (x.full, x.swa, *st.values())],
        [r for x, st, _ in decode.values() for r in (x.full, x.swa, *st.values())],
    )
    try:
        maps = {}
        for (ds, d), (dx, dstates, _) in decode.items():
            full_there, swa_there = handshake(dx.full), handshake(dx.swa)
            state_there = {n: handshake(r) for n, r in dstates.items()}
            for s in stages_into(ds, dpp):
                for p in range(tp):
                    px, pstates, _ = prefill[s, p]
                    pair = full_and_sliding(px, dx, (full_there, swa_there), s, skipped, start)
                    if pair is None:
                        continue
                    kv, swa = pair
                    states = [
                        block_map(
                            pstates[n].registration,
                            there.for_layers(stage_layers(s, PP)),
                            [p_idx[s]],
                            [d_idx[ds]],
                            src_shard=pstates[n].shard,
                        )
                        for n, there in state_there.items()
                    ]
                    maps[s * tp + p, ds * tp + d] = join_maps([kv, swa, *states])
        assert sorted(maps) == sorted(
            (s * tp + d, ds * tp + d) for ds in range(dpp) for s in stages_into(ds, dpp) for d in range(tp)
        )
        post(link, maps, "direct", 0)
    finally:
        link.close(
            [r for x, st, _ in [*prefill.values(), *decode.values()] for r in (x.full, x.swa, *st.values())]
        )

    for (ds, d), (dx, _, dpool) in decode.items():
        for pool, ids in (("full", FULL), ("swa", SLIDING)):
            for i, t in enumerate(getattr(dx, pool).tensors):  # equal TP: rank d's heads are rank d's
                g, want = ids[i % len(ids)], torch.zeros_like(t)
                if g in stage_layers(ds, dpp):
                    px = prefill[owner(g), d][0]
                    d_slots, p_slots = (
                        (dx.full_slots, px.full_slots) if pool == "full" else (dx.swa_slots, px.swa_slots)
                    )
                    tokens_into(want, getattr(px, pool).tensors[i], d_slots, p_slots)
                assert torch.equal(t, want), (pool, ds, d, i)
        for c, got in enumerate(dpool.mamba_cache.conv):
            for k, g in enumerate(stage_layers(ds, dpp)):
                s = owner(g)
                src = prefill[s, d][2].mamba_cache.conv[c]
                assert torch.equal(got[k, d_idx[ds]], src[g - stage_layers(s, PP).start, p_idx[s]]), (
                    ds,
                    d,
                    c,
                    g,
                )
            assert not got[:, [i for i in range(slots + 1) if i != d_idx[ds]]].any(), (ds, d, c)


@pytest.mark.parametrize("dtp", [1, 4])
def test_inkling_conv_states_between_tp_degrees_are_refused_by_name(dtp: int) -> None:
    """SGLang moves Inkling between equal TP sizes only: ``maybe_send_extra``
    (``disaggregation/nixl/conn.py``, ``mooncake/conn.py``) raises "PD Disaggregation does
    NOT support PD different TP sizes for non-MLA SWA hybrid models yet" for its ``"swa"``
    state, and its Mamba slice path (``_send_mamba_state_slice``) cuts each state on axis 2
    (``MambaPool.get_state_dim_per_tensor``: ``shape[2]``), for a conv state ``(K - 1,
    dim)`` the kernel, no TP split. The states declare none (not Mamba2's, GDN's or KDA's),
    so between TP degrees each conv state's map is refused, naming the state, whether its
    width differs (the K and V streams) or not (the attention and MLP streams: one rank's
    item); the attention pools map by head slices (``test_swa_pool_under_pipeline_stages``)."""
    ptp = 2
    src = mamba_state_pools(sconv_pool(2, ptp, 3, 5))
    dst = mamba_state_pools(sconv_pool(2, dtp, 3, None))
    assert sorted(src) == sorted(dst) == [f"conv{i}" for i in range(6)]
    for name, reg in src.items():
        there = handshake(Rank([], dst[name], Shard(0, dtp, 4)))
        with pytest.raises(
            BlockMapError, match=rf"^src and dst are opaque pages .*\(.*SGLang Mamba {name}: bfloat16"
        ):
            block_map(reg, there, [1], [2], src_shard=Shard(0, ptp, 4))
