"""vLLM 0.33 registrations kvlayout must read as vLLM made them: cross-layer KV sharing
(Gemma-3n, YOCO: the sharer registers its target's tensor)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvlayout
from kvlayout.transfer import prepare
from tests.integrations.vllm.models import (
    FLASH_ATTN,
    AttentionModel,
    Engine,
    allocate_v033,
    attention_engine,
    share_kv_caches,
)

GEMMA_3N_LIKE = AttentionModel("Gemma-3n-like", 6, 2, 64, torch.bfloat16)


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
