"""vLLM 0.33 registrations kvlayout must read as vLLM made them: cross-layer KV sharing
(Gemma-3n, YOCO: the sharer registers its target's tensor) and the single-head views of
MLA and DSA-indexer layers (``[NB, 1, BS, C]``), under every ``kv_layout`` hint."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvlayout
from kvlayout.detection.indexers import drop_indexer_caches, is_indexer_cache
from kvlayout.transfer import prepare
from tests.integrations.vllm.models import (
    FLASH_ATTN,
    AttentionModel,
    Engine,
    KVCacheLayout,
    allocate_v033,
    attention_engine,
    kvi,
    make_engine,
    share_kv_caches,
)

GEMMA_3N_LIKE = AttentionModel("Gemma-3n-like", 6, 2, 64, torch.bfloat16)
HINTS: list[dict[str, str] | None] = [None, {"kv_layout": "NHD"}, {"kv_layout": "HND"}]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bytes: random bits hold NaNs


def _layer_groups(engine: Engine, names: list[str]) -> list[list[int]]:
    return [[names.index(n) for n in g.layer_names] for g in engine.config.kv_cache_groups]


def _yoco() -> tuple[Engine, dict[str, Any]]:
    """Six allocated layers; layers 6 and 7 read the KV of layers 2 and 3 (they come last in
    the registration, as ``initialize_kv_cache_tensors`` adds them)."""
    engine = attention_engine(GEMMA_3N_LIKE, FLASH_ATTN)
    _, kv_caches = allocate_v033(engine)
    shared = {"model.layers.6.self_attn.attn": "model.layers.2.self_attn.attn"}
    shared["model.layers.7.self_attn.attn"] = "model.layers.3.self_attn.attn"
    return engine, share_kv_caches(engine, kv_caches, shared)


def test_vllm_cross_layer_kv_sharing_is_accepted_and_says_which_layers_share() -> None:
    engine, kv_caches = _yoco()
    names = list(kv_caches)
    kv = list(kv_caches.values())
    assert kv[6] is kv[2] and kv[7] is kv[3]
    reg = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"}, layer_groups=_layer_groups(engine, names))
    assert reg.shared_layers == ((2, 6), (3, 7))
    assert "KV shared by layers (2, 6), (3, 7)" in repr(reg)
    (group,) = reg.kernel_groups
    assert group.layers == tuple(range(8)) and group.shared_layers == ((2, 6), (3, 7))
    # accessors answer, and the pointer table lists every layer in LMCache's order
    fmt, normalized = kvlayout.normalize_kv_and_discover_format(kv, "vllm", {"kv_layout": "NHD"})
    assert kvlayout.get_num_blocks(normalized, fmt) == 4 and kvlayout.get_num_heads(normalized, fmt) == 2
    ptrs = kvlayout.get_group_data_ptrs(normalized, fmt, range(8))
    assert ptrs == [t.data_ptr() for t in kv] and ptrs[6] == ptrs[2]


@pytest.mark.parametrize("threads", [1, 4])
def test_vllm_shared_layers_store_every_slot_and_load_each_memory_once(threads: int) -> None:
    engine, kv_caches = _yoco()
    kv = list(kv_caches.values())
    reg = kvlayout.detect(
        kv, "vllm", {"kv_layout": "NHD"}, layer_groups=_layer_groups(engine, list(kv_caches))
    )
    plan = prepare(reg.only_group(), reg.format)
    for t in kv[:6]:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    ids = [3, 0, 2]
    (chunk,) = plan.chunks_for(len(ids), len(ids) * plan.block_size)
    plan.store_blocks(ids, [chunk], num_threads=threads)
    assert _same(chunk[:, 6], chunk[:, 2]) and _same(chunk[:, 7], chunk[:, 3])
    # a load writes the shared memory once, from the first layer's slot
    edited = chunk.clone()
    edited[:, 6] = 0
    edited[:, 2] = 1
    plan.load_blocks(ids, [edited], num_threads=threads)
    again = torch.zeros_like(chunk)
    plan.store_blocks(ids, [again])
    assert _same(again[:, 2], edited[:, 2]) and _same(again[:, 6], edited[:, 2])
    assert _same(again[:, 3], chunk[:, 3])


# -- single-head views: MLA and the DSA indexer ---------------------------------------------


def _one_head_engine(dtype: torch.dtype, head_size: int, layout: Any) -> dict[str, Any]:
    spec = kvi.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=head_size, dtype=dtype)
    specs = {f"model.layers.{i}.self_attn": spec for i in range(3)}
    _, kv_caches = allocate_v033(make_engine(specs, [list(specs)], lambda s: 64, layout=layout))
    return kv_caches


@pytest.mark.parametrize("layout_hints", HINTS, ids=lambda h: (h or {}).get("kv_layout", "no-hint"))
@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC], ids=lambda x: x.name)
def test_vllm_single_head_mla_views_read_one_head_under_every_hint(
    layout: Any, layout_hints: dict[str, str] | None
) -> None:
    kv = list(_one_head_engine(torch.bfloat16, 576, layout).values())
    assert tuple(kv[0].shape) == (4, 1, 64, 576)  # vLLM 0.33's [B, H, N, C] view
    (group,) = kvlayout.detect(kv, "vllm", layout_hints).kernel_groups
    assert (group.num_blocks, group.block_size) == (4, 64)
    if layout_hints is None:  # on the CPU without hints, one head is CPU_ATTN's too: whole pages
        assert group.opaque_pages is not None and "CPU_ATTN" in group.opaque_pages.layout
        assert "kv_dim=1 if its one head is an MLA layer's latents" in group.opaque_pages.advice
        return
    assert (group.geometry.num_heads, group.geometry.head_size) == (1, 576)


@pytest.mark.parametrize("layout_hints", HINTS, ids=lambda h: (h or {}).get("kv_layout", "no-hint"))
@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC], ids=lambda x: x.name)
def test_vllm_indexer_caches_are_found_under_every_hint(
    layout: Any, layout_hints: dict[str, str] | None
) -> None:
    indexers = _one_head_engine(torch.uint8, 132, layout)
    attention = _one_head_engine(torch.bfloat16, 576, layout)
    kv_caches = {
        **{f"{n}.attn": t for n, t in attention.items()},
        **{f"{n}.indexer": t for n, t in indexers.items()},
    }
    first = next(iter(indexers.values()))
    assert is_indexer_cache(first, "vllm", layout_hints)
    assert not is_indexer_cache(next(iter(attention.values())), "vllm", layout_hints)
    kept = drop_indexer_caches(kv_caches, "vllm", layout_hints)
    assert list(kept) == [f"{n}.attn" for n in attention]
    (group,) = kvlayout.detect(list(indexers.values()), "vllm", layout_hints).kernel_groups
    assert group.layout.is_indexer and (group.num_blocks, group.block_size) == (4, 64)


def test_sharing_a_layer_that_has_its_own_cache_is_refused_naming_it() -> None:
    """A sharer has no cache of its own in vLLM's config; the helper once appended an
    allocated layer to its target's group again, and detection then refused a layer listed
    twice, naming an index the caller never passed."""
    engine = attention_engine(GEMMA_3N_LIKE, FLASH_ATTN)
    _, kv_caches = allocate_v033(engine)
    groups = [list(g.layer_names) for g in engine.config.kv_cache_groups]
    with pytest.raises(
        ValueError, match=r"sharer 'model.layers.5.self_attn.attn' is a layer with a KV cache"
    ):
        share_kv_caches(engine, kv_caches, {"model.layers.5.self_attn.attn": "model.layers.2.self_attn.attn"})
    with pytest.raises(ValueError, match=r"target 'model.layers.9.self_attn.attn' of 'model.layers.6"):
        share_kv_caches(engine, kv_caches, {"model.layers.6.self_attn.attn": "model.layers.9.self_attn.attn"})
    assert [list(g.layer_names) for g in engine.config.kv_cache_groups] == groups  # nothing half-done


def test_an_attention_engine_at_tp_holds_its_rank_s_heads() -> None:
    for tp, heads in ((1, 2), (2, 1), (4, 1)):  # 2 KV heads: replicated past TP 2
        engine = attention_engine(GEMMA_3N_LIKE, FLASH_ATTN, tp=tp)
        (group,) = engine.config.kv_cache_groups
        assert group.kv_cache_spec.num_kv_heads == heads
