"""ATOM: one MLA tensor ``[NB, BS, HS]`` per layer; hints are not needed (a
``kv_layout`` hint, default NHD, would choose between NHD and HND twins). ATOM's own
connectors get the MLA cache as token rows, ``[NB*BS, 1, HS]`` (its model runner's
view): ``tokens_per_block`` reads those rows in ATOM's blocks.

ATOM's MHA/GQA pool registers per-layer K and V tensors of rank 5 in AITER's SHUFFLE
layout (K ``[NB, H, D // X, BS, X]``, V ``[NB, H, BS // X, D, X]``, ``X`` elements of 16
bytes), whose tokens no format reads: detection refuses them naming
``kvlayout.integrations.atom.shuffled_kv_pools``, which reads their pages.

ATOM's KV is bf16 or fp8 (``--kv_cache_dtype``), never float32: a float32 tensor of rank 3
is its fp8 MHA pool's dequantization scales (``KVCacheTensor.k_scale`` / ``v_scale``,
``[NB, H, BS]``, a head's tokens innermost), which would read as MLA latents of ``H``
tokens; detection refuses them naming the same reader."""

from __future__ import annotations

from typing import Any

import torch

from kvlayout._generated.formats import EngineKVFormat
from kvlayout.detection.base import DetectionError, pick, probe, token_rows_in_blocks
from kvlayout.types import DiscoverableKVCache, EngineType, LayoutHints

ENGINE = EngineType.ATOM

SCALE_DTYPE = torch.float32
"""The dtype of ATOM's fp8 MHA dequantization scales (``mha_kv_scale_fields``), which its
KV never has (``--kv_cache_dtype`` is bf16 or fp8)."""


def discover(kv: Any, hints: LayoutHints) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    p = probe(kv)
    if p.aiter_shuffled:
        raise DetectionError(
            f"ATOM: {p.describe()}: per-layer K and V of rank 5 are ATOM's MHA/GQA pool in AITER's "
            "SHUFFLE layout (mha_kv_fields: K (num_blocks, H, D // X, block_size, X), V (num_blocks, H, "
            "block_size // X, D, X)), whose tokens no format reads; "
            "kvlayout.integrations.atom.shuffled_kv_pools(k_caches, v_caches, block_size) reads its pages"
        )
    if p.rank == 3 and p.first.dtype == SCALE_DTYPE:
        raise DetectionError(
            f"ATOM: {p.describe()}: ATOM's KV caches are bf16 or fp8, so float32 per-layer tensors of "
            "rank 3 are its fp8 MHA pool's dequantization scales (mha_kv_scale_fields: k_scale / v_scale "
            "(num_blocks, H, block_size)), not MLA latents; kvlayout.integrations.atom.shuffled_kv_pools("
            "k_caches, v_caches, block_size, k_scales, v_scales) reads them with the pool"
        )
    fmt = pick(ENGINE, p, decide=[("kv_layout", "is_hnd", bool(hints.is_hnd))])
    return fmt, token_rows_in_blocks(ENGINE, fmt, kv, hints.tokens_per_block, p.describe)
