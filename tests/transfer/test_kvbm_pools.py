"""Dynamo KVBM's fully contiguous pools as an offload tier of vLLM caches, byte for byte.

The oracle is KVBM's block layouts as Dynamo defines them (``lib/kvbm-physical/src/layout/
kv_block_layout.rs``, ``KvBlockLayout::dim_order``; ``lib/kvbm-kernels``' reference
``_make_blocks``): a block of the model's KV, ``[nl, no, nt, nh, hd]`` in operational NHD
order, is permuted to the named layout's order, head_dim innermost. It is written here from
those definitions, not from kvlayout's formats. The vLLM side is vLLM 0.33's own
registration (``kvlayout.testing.vllm``: its spec objects, ``create_kv_cache_views``, the
group edits a connector applies), read back through vLLM's logical ``[B, H, N, 2*hd]``
views (K then V in a row).

The scenario is item 10 of the P/D facts sheet: a Llama-like model served at TP 2 saves a
request into a UniversalTP pool (both ranks write their heads into the same host blocks) and
it is loaded at TP 4 and TP 1, NHD and HND.
"""

from __future__ import annotations

import pytest
import torch

import kvlayout
from kvlayout.registration.registration import Registration
from kvlayout.testing import vllm as vx
from kvlayout.transfer import RegistrationDescription, Shard, block_map

NL, NH, HD, BS = 4, 8, 64, 16
MODEL = vx.AttentionModel("Llama-like", NL, NH, HD, torch.bfloat16)
NHD, HND = vx.KVCacheLayout.LBNHC, vx.KVCacheLayout.LBHNC

# KvBlockLayout::dim_order(), outermost first; hd is innermost in every one.
DIM_ORDER = {
    "universal_tp": ("nh", "nl", "no", "nt"),
    "universal_pp": ("nl", "nh", "no", "nt"),
    "operational_hnd": ("nl", "no", "nh", "nt"),
    "operational_nhd": ("nl", "no", "nt", "nh"),
}
_OPERATIONAL_NHD = ("nl", "no", "nt", "nh")

Rank = tuple[Registration, list[torch.Tensor]]
"""A vLLM rank: its registration, and its logical per-layer views."""


def kvbm_block(name: str, block: torch.Tensor) -> torch.Tensor:
    """A block of the model's KV ``[nl, no, nt, nh, hd]`` in the KVBM layout ``name``."""
    return block.permute(*(_OPERATIONAL_NHD.index(d) for d in DIM_ORDER[name]), 4)


def kvbm_pool(name: str, num_blocks: int, no: int = 2, nh: int = NH, hd: int = HD) -> torch.Tensor:
    sizes = {"nl": NL, "no": no, "nt": BS, "nh": nh}
    return torch.zeros(num_blocks, *(sizes[d] for d in DIM_ORDER[name]), hd, dtype=torch.bfloat16)


def vllm_rank(tp: int, layout: object, seed: int | None = None) -> Rank:
    """One rank of vLLM 0.33 (flash-attn) at TP ``tp``: its registration as a connector
    detects it, and its logical per-layer views ``[B, H, N, 2*hd]``."""
    engine = vx.attention_engine(MODEL, vx.FLASH_ATTN, tp=tp, num_blocks=12, layout=layout)
    buf, kv_caches = vx.allocate_v033(engine)
    if seed is not None:
        vx.fill_random(buf, seed)
    hints = {"kv_layout": layout}
    return vx.detect_registered(engine, kv_caches, hints, edited=True), list(kv_caches.values())


def model_block(ranks: list[list[torch.Tensor]], b: int) -> torch.Tensor:
    """Block ``b`` of the model's KV, ``[nl, no, nt, nh, hd]``, gathered from every rank's
    views (rank ``r`` of ``tp`` holds heads ``r * NH / tp`` on, vLLM's rule)."""
    per_rank = []
    for views in ranks:
        layers = [v[b].reshape(v.shape[1], BS, 2, HD).permute(2, 1, 0, 3) for v in views]  # [no, nt, h, hd]
        per_rank.append(torch.stack(layers))
    return torch.cat(per_rank, dim=3)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bytes (random bytes hold NaNs, which no float comparison calls equal)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def pool_of(name: str, pool: torch.Tensor) -> Registration:
    return kvlayout.detect(pool, "kvbm", {"kvbm_layout": name})


REQUEST = ([3, 5, 6, 7], [0, 9, 2, 3])  # the TP 2 ranks' block ids, the pool's: 64 tokens


@pytest.fixture(scope="module")
def served() -> list[Rank]:
    """vLLM at TP 2, NHD, its caches random."""
    return [vllm_rank(2, NHD, seed=r) for r in range(2)]


def save(name: str, served: list[Rank]) -> torch.Tensor:
    pool = kvbm_pool(name, 12)
    host = pool_of(name, pool)
    for r, (reg, _) in enumerate(served):
        m = block_map(reg, host, *REQUEST, src_shard=Shard(r, 2, NH))
        # vLLM 0.33 packs a head's K and V in one row: a half-row (128 bytes) is a run
        assert m.num_runs == NL * (NH // 2) * 2 * 64
        assert m.copy() == 1
    return pool


@pytest.mark.parametrize("name", ["universal_tp", "universal_pp"])
def test_tp2_ranks_save_into_one_universal_pool(name: str, served: list[Rank]) -> None:
    pool = save(name, served)
    views = [v for _, v in served]
    for src, dst in zip(*REQUEST, strict=True):
        assert same(pool[dst], kvbm_block(name, model_block(views, src)))
    untouched = [b for b in range(len(pool)) if b not in REQUEST[1]]
    assert not pool[untouched].any()


@pytest.mark.parametrize("name", ["universal_tp", "universal_pp"])
@pytest.mark.parametrize("tp", [4, 1])
@pytest.mark.parametrize("layout", [NHD, HND])
def test_a_universal_pool_loads_at_another_tp_degree(
    name: str, tp: int, layout: object, served: list[Rank]
) -> None:
    pool = save(name, served)
    host = pool_of(name, pool)
    dst_ids = [11, 0, 4, 5]
    loaded = [vllm_rank(tp, layout) for _ in range(tp)]
    for r, (reg, _) in enumerate(loaded):
        m = block_map(host, reg, REQUEST[1], dst_ids, dst_shard=Shard(r, tp, NH))
        assert ("head slice" in m.kind) == (tp != 1)
        # a token's K (or V) row of a head: vLLM 0.33 packs K|V in a row, the pool keeps them
        # apart; where both put a head's next head after it (UniversalPP into HND), a head's last
        # V row and the next head's first K row are one run
        heads = NH // tp
        joins = heads - 1 if (name, layout) == ("universal_pp", HND) else 0
        assert m.num_runs == NL * 4 * (heads * BS * 2 - joins)
        assert m.copy() == 1
    views = [v for _, v in loaded]
    for src, dst in zip(REQUEST[0], dst_ids, strict=True):
        assert same(model_block(views, dst), model_block([v for _, v in served], src))
    assert not any(v[[b for b in range(12) if b not in dst_ids]].any() for vs in views for v in vs)


def test_runs_are_one_per_block_layer_and_kv_between_operational_nhd_and_split_kv_caches() -> None:
    """Operational NHD at TP 1 and vLLM's K/V-split flash-attn cache (``[2, NB, BS, NH, hd]``
    a layer, as vLLM before 0.26 registers it): a block's K (or V) of a layer is one run."""
    gen = torch.Generator().manual_seed(7)
    layers = [torch.randn(2, 12, BS, NH, HD, generator=gen).to(torch.bfloat16) for _ in range(NL)]
    cache = kvlayout.detect(layers, "vllm", {"kv_layout": "NHD"})
    pool = kvbm_pool("operational_nhd", 12)
    host = pool_of("operational_nhd", pool)
    store = block_map(cache, host, [4, 5, 1], [7, 8, 9])
    assert (store.num_runs, store.num_bytes // store.num_runs) == (NL * 2 * 3, BS * NH * HD * 2)
    store.copy()
    for src, dst in zip([4, 5, 1], [7, 8, 9], strict=True):
        block = torch.stack([t[:, src] for t in layers])  # [nl, no, nt, nh, hd]
        assert torch.equal(pool[dst], kvbm_block("operational_nhd", block))
    back = [torch.zeros_like(t) for t in layers]
    load = block_map(host, kvlayout.detect(back, "vllm", {"kv_layout": "NHD"}), [7, 8, 9], [4, 5, 1])
    assert load.num_runs == NL * 2 * 3
    load.copy()
    assert all(torch.equal(b[:, [4, 5, 1]], t[:, [4, 5, 1]]) for b, t in zip(back, layers, strict=True))


def test_operational_nhd_and_vllm_033_at_tp1(served: list[Rank]) -> None:
    """vLLM 0.33 packs each head's K and V in one row, operational NHD keeps K apart from V:
    a run is a head's K or V row of a token, both ways, and the bytes round-trip."""
    reg, views = vllm_rank(1, NHD, seed=5)
    pool = kvbm_pool("operational_nhd", 12)
    host = pool_of("operational_nhd", pool)
    store = block_map(reg, host, [2, 3], [5, 6])
    assert store.num_runs == NL * 2 * BS * NH * 2
    store.copy()
    assert same(pool[6], kvbm_block("operational_nhd", model_block([views], 3)))
    back, back_views = vllm_rank(1, NHD)
    block_map(host, back, [5, 6], [8, 1]).copy()
    assert same(model_block([back_views], 1), model_block([views], 3))


@pytest.mark.parametrize("name", sorted(DIM_ORDER))
def test_an_mla_pool_holds_the_latents_every_rank_holds(name: str) -> None:
    """KVBM's MLA pool (``no`` 1, one latent head) reads alike in every block layout; the
    latents of any rank load into any other."""
    gen = torch.Generator().manual_seed(3)
    latents = [torch.randn(12, BS, 576, generator=gen).to(torch.bfloat16) for _ in range(NL)]
    pool = kvbm_pool(name, 6, no=1, nh=1, hd=576)
    host = pool_of(name, pool)
    assert host.format is kvlayout.EngineKVFormat.NB_NL_ONE_BS_HS
    src = kvlayout.detect(latents, "vllm")
    block_map(src, host, [4, 2], [5, 0], src_shard=Shard(1, 2, 1)).copy()
    block = torch.stack(latents)[:, 2].view(NL, 1, BS, 1, 576)
    assert torch.equal(pool[0], kvbm_block(name, block))
    out = [torch.zeros(12, BS, 576, dtype=torch.bfloat16) for _ in range(NL)]
    block_map(host, kvlayout.detect(out, "vllm"), [5, 0], [1, 3], dst_shard=Shard(3, 4, 1)).copy()
    assert all(torch.equal(o[[1, 3]], t[[4, 2]]) for o, t in zip(out, latents, strict=True))


def test_a_described_pool_maps_as_the_pool(served: list[Rank]) -> None:
    """A pool in another process (its description, as NIXL's peer) maps to the same runs."""
    pool = kvbm_pool("universal_tp", 12)
    host = pool_of("universal_tp", pool)
    peer = RegistrationDescription.from_json(host.describe().to_json())
    reg, _ = served[1]
    here = block_map(reg, host, *REQUEST, src_shard=Shard(1, 2, NH))
    there = block_map(reg, peer, *REQUEST, src_shard=Shard(1, 2, NH))
    assert (there.num_runs, there.kind) == (here.num_runs, here.kind)
    assert (there.runs == here.runs).all()


def test_an_aligned_pool_keeps_its_padding(served: list[Rank]) -> None:
    """KVBM aligns a pool's blocks (LayoutConfig's alignment): a block's view is padded, and
    a map writes the block's bytes and never its padding."""
    content = NH * NL * 2 * BS * HD
    raw = torch.zeros(12, content + 2048, dtype=torch.bfloat16)
    pool = raw[:, :content].view(12, NH, NL, 2, BS, HD)
    host = pool_of("universal_tp", pool)
    for r, (reg, _) in enumerate(served):
        block_map(reg, host, *REQUEST, src_shard=Shard(r, 2, NH)).copy()
    views = [v for _, v in served]
    for src, dst in zip(*REQUEST, strict=True):
        assert same(pool[dst], kvbm_block("universal_tp", model_block(views, src)))
    assert not raw[:, content:].any()


@pytest.mark.parametrize("name", sorted(DIM_ORDER))
def test_ranks_that_replicate_heads_save_and_load_a_request_s_tokens(name: str) -> None:
    """A model of 2 KV heads at TP 4 (vLLM replicates each head over 2 ranks: rank ``r``
    holds head ``r * 2 // 4``) saves tokens [5, 19) of a request (its last block partly
    filled, its first 5 tokens a prefix the pool keeps) into the pool, and TP 1 loads them:
    each token of each head lands where KVBM's block layout puts it, and nothing else moves."""
    heads, tp, nl, bs, hd = 2, 4, 3, 8, 32
    gen = torch.Generator().manual_seed(11)
    by_head = [
        [torch.randn(2, 6, bs, 1, hd, generator=gen).to(torch.bfloat16) for _ in range(nl)] for _ in range(2)
    ]
    sizes = {"nl": nl, "no": 2, "nt": bs, "nh": heads}
    pool = torch.zeros(6, *(sizes[d] for d in DIM_ORDER[name]), hd, dtype=torch.bfloat16)
    host = pool_of(name, pool)
    src_ids, dst_ids, first, tokens = [4, 1, 2], [0, 5, 3], 5, 2 * bs + 3
    for r in range(tp):
        rank = kvlayout.detect(by_head[r * heads // tp], "vllm", {"kv_layout": "NHD"})
        m = block_map(
            rank, host, src_ids, dst_ids, num_tokens=tokens, first_token=first, src_shard=Shard(r, tp, 2)
        )
        m.copy()
    moved = {(dst_ids[p // bs], p % bs): src_ids[p // bs] for p in range(first, tokens)}
    for b in range(6):
        for t in range(bs):
            # the pool's block b, token t, as [nl, no, nh, hd], permuted back from the layout's order
            block = pool[b].permute(*(DIM_ORDER[name].index(d) for d in ("nl", "no", "nt", "nh")), 4)[:, :, t]
            if (b, t) not in moved:
                assert not block.any(), (b, t)
                continue
            for h in range(heads):
                want = torch.stack([layer[:, moved[b, t], t, 0] for layer in by_head[h]])  # [nl, no, hd]
                assert same(block[:, :, h], want), (b, t, h)
    out = [torch.zeros(2, 6, bs, heads, hd, dtype=torch.bfloat16) for _ in range(nl)]
    block_map(
        host, kvlayout.detect(out, "vllm", {"kv_layout": "NHD"}), dst_ids, src_ids, num_tokens=tokens,
        first_token=first, dst_shard=Shard(0, 1, 2),
    ).copy()  # fmt: skip
    for layer in range(nl):
        want = torch.zeros_like(out[layer])
        for p in range(first, tokens):
            b, t = src_ids[p // bs], p % bs
            want[:, b, t] = torch.cat([by_head[h][layer][:, b, t] for h in range(heads)], dim=1)
        assert same(out[layer], want), layer
