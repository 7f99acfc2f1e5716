"""SGLang's unified memory pool (``--enable-unified-memory``) in a prefill/decode transfer
through real NIXL (two agents, UCX loopback), byte-exact against SGLang's own addressing.
The connector helpers are ``test_sglang_pd_nixl``'s, the page-major MLA views
``test_sglang_page_major_and_bf16_indexer``'s, the state models ``test_sglang_mamba_pools``'.

What SGLang does (sgl-project/sglang, ``mem_cache/unified_memory_pool.py``):

- ``UnifiedKVPool``: one uint8 buffer shared by two sub-pools growing from its two ends,
  each a strided view over it: the KV sub-pool page-major (a page's every layer in one
  envelope; Kimi Linear's MLA latents, ``build_page_major_mla_views``) and the Mamba
  sub-pool slot-major (``build_page_major_mamba_views``: a slot's envelope holds every
  layer of each state, ``MambaSubPoolSpec.entry_bytes``).
- ``UnifiedMambaPool.get_contiguous_buf_infos``: the P/D state item is the whole slot
  envelope, ``raw_ptr + physical_slot * entry_bytes``; "an envelope cannot be
  TP-resliced or PP-subset", so its per-tensor metadata (``get_state_dim_per_tensor``,
  ``get_state_layer_ids``) is empty and both sides must build identical Mamba specs
  (equal attention TP, PP 1); the KV side checks its envelopes alike
  (``disaggregation/mooncake/conn.py`` ``_validate_envelope_kv_layout``).

As a connector: the latents read as the MLA device format (page to page, the rank
``sends_to(latents=True)`` picks), the states with ``mamba_state_pools`` (slot to slot;
a rank pair's maps one WRITE). At equal TP a slot's states of every layer are its whole
envelope, so kvlayout moves what SGLang moves. At a TP change, which SGLang refuses,
kvlayout moves each rank its slices given the Mamba type (``"kda"``), and refuses the
states by name without it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("nixl")

from kvlayout.integrations.sglang import mamba_state_pools
from kvlayout.testing.sglang import device_pool, shard, unified_device_pool
from kvlayout.transfer import BlockMapError, Shard, block_map, join_maps
from tests.integrations.sglang.test_sglang_mamba_pools import MODELS, states
from tests.integrations.sglang.test_sglang_page_major_and_bf16_indexer import NL, PS, page_major_mla
from tests.integrations.sglang.test_sglang_pd_nixl import (
    Link,
    Rank,
    agent_pair,
    detect_rank,
    handshake,
    post,
    sglang_targets,
    shard_of,
)

SPEC = MODELS["kda"]  # Kimi Linear: MLA latents beside Kimi Delta Attention states
PAGES, TOKENS, MODEL_HEADS = 8, 10, 16  # 10 tokens: two whole pages of 4 and 2 tokens of a third
P_PAGES, D_PAGES = [1, 3, 2], [2, 1, 4]  # the KV sub-pool grows from the buffer's start
P_BACK, D_BACK = (
    2,
    4,
)  # the request's slot, counted back from the buffer's end: the Mamba sub-pool grows from there


@pytest.fixture(scope="module")
def agents() -> Iterator[tuple[Any, Any]]:
    yield from agent_pair("sgl-unified")


def unified_rank(
    rank: int, tp: int, mamba_type: str | None, whole: list[torch.Tensor] | None
) -> dict[str, Any]:
    """A rank's ``UnifiedKVPool``: random latents (or zeros), its views, and its TP share of
    the whole model's states in its ``P_BACK`` slot from the end (``whole`` given) as
    registrations; ``raw`` the buffer, ``slot`` the rank's slot ``back`` from the end, past
    every page the request uses (the sub-pools do not meet)."""
    raw, views = page_major_mla(PAGES)
    raw = raw.view(torch.uint8)
    if whole is None:
        raw.zero_()
    latents = raw.clone()
    pool = unified_device_pool(SPEC, tp, None, raw=raw)
    assert torch.equal(raw, latents)  # views over the shared buffer leave the KV sub-pool's bytes
    ssm = pool.mamba_cache.temporal
    slot = ssm.shape[1] - (D_BACK if whole is None else P_BACK)
    page = views[0].stride(0) * views[0].element_size()
    assert slot * ssm.stride(1) * ssm.element_size() >= (max(P_PAGES + D_PAGES) + 1) * page
    if whole is not None:
        for t, part in zip(states(pool), shard(SPEC, whole, tp, rank), strict=True):
            t[:, slot] = part[:, 1]
    at = Shard(rank, tp, MODEL_HEADS)
    regs = {n: Rank([raw], r, at) for n, r in mamba_state_pools(pool, mamba_type).items()}
    return {
        "raw": raw,
        "slot": slot,
        "views": views,
        "pool": pool,
        "latents": detect_rank(views, PS, at, mha=False),
        "states": regs,
    }


@pytest.mark.parametrize(("ptp", "dtp"), [(2, 2), (1, 2), (2, 1)])
def test_unified_pool_latents_and_state_envelopes(agents: tuple[Any, Any], ptp: int, dtp: int) -> None:
    """Kimi Linear's unified pool on both sides: each decode rank's latents from the
    prefill rank SGLang picks, its states' slot from the prefill ranks holding its slices;
    the decode buffer afterwards holds exactly those bytes. At equal TP the decode slot's
    envelope is the prefill slot's byte for byte (SGLang's item), the map needing no
    Mamba type; between TP degrees the maps take it (kind ``resharded state``)."""
    mamba_type = None if ptp == dtp else SPEC.mamba_type
    whole = states(device_pool(SPEC, 1, 1, generator=torch.Generator().manual_seed(9)))
    prefill = [unified_rank(p, ptp, mamba_type, whole) for p in range(ptp)]
    decode = [unified_rank(d, dtp, mamba_type, None) for d in range(dtp)]
    ranks = [[x["latents"], *x["states"].values()] for x in (*prefill, *decode)]
    link = Link(agents, [r for x in ranks[:ptp] for r in x], [r for x in ranks[ptp:] for r in x])
    try:
        maps = {}
        for d, dx in enumerate(decode):
            there = handshake(dx["latents"])
            state_there = {n: handshake(r) for n, r in dx["states"].items()}
            for p in sglang_targets(d, dtp, ptp, mla=False):  # the ranks its receiver pairs it with
                px = prefill[p]
                src = px["latents"]
                kv = block_map(
                    src.registration, there, P_PAGES, D_PAGES, num_tokens=TOKENS, src_shard=src.shard
                )
                parts = [kv] if src.shard.sends_to(shard_of(there), latents=kv.latents) else []
                for n, r in px["states"].items():
                    m = block_map(
                        r.registration, state_there[n], [px["slot"]], [dx["slot"]], src_shard=r.shard
                    )
                    assert m.kind == ("same layout" if ptp == dtp else "resharded state"), (n, m.kind)
                    parts.append(m)
                if parts:
                    maps[p, d] = join_maps(parts)
        post(link, maps, "direct", 0)
    finally:
        link.close([r for x in ranks for r in x])

    for d, dx in enumerate(decode):
        want = torch.zeros_like(dx["raw"])
        (src,) = sglang_targets(d, dtp, ptp, mla=True)
        want_views = [
            torch.as_strided(want.view(v.dtype), v.shape, v.stride(), v.storage_offset()) for v in dx["views"]
        ]
        for layer in range(NL):
            for t in range(TOKENS):
                page, row = t // PS, t % PS
                want_views[layer][D_PAGES[page], row] = prefill[src]["views"][layer][P_PAGES[page], row]
        for state, part in zip(
            states(unified_device_pool(SPEC, dtp, None, raw=want)), shard(SPEC, whole, dtp, d), strict=True
        ):
            state[:, dx["slot"]] = part[:, 1]
        assert torch.equal(dx["raw"], want), d
        if ptp == dtp:  # SGLang's item: the slot's whole envelope
            ssm = dx["pool"].mamba_cache.temporal
            entry = ssm.stride(1) * ssm.element_size()  # a slot's envelope: its views' slot stride
            ds, ps = dx["slot"], prefill[d]["slot"]
            got = dx["raw"][ds * entry : (ds + 1) * entry]
            assert torch.equal(got, prefill[d]["raw"][ps * entry : (ps + 1) * entry]), d


def test_unified_states_between_tp_degrees_need_the_mamba_type() -> None:
    """Without the Mamba type (what SGLang's unified pool publishes: no per-tensor
    metadata) a state page is one rank's whole item: between TP degrees it is refused,
    naming the state and both shapes."""
    src, dst = unified_rank(0, 1, None, None), unified_rank(1, 2, None, None)
    a, b = mamba_state_pools(src["pool"]), mamba_state_pools(dst["pool"])
    with pytest.raises(
        BlockMapError,
        match=re.escape(
            "opaque pages laid out differently (src SGLang Mamba conv0: bfloat16 [3, 32]; dst SGLang Mamba conv0: bfloat16 [3, 16])"
        ),
    ):
        block_map(
            a["conv0"],
            b["conv0"],
            [src["slot"]],
            [dst["slot"]],
            src_shard=Shard(0, 1, MODEL_HEADS),
            dst_shard=Shard(1, 2, MODEL_HEADS),
        )
