"""ATOM: one MLA tensor ``[NB, BS, HS]`` per layer; hints are not needed (a
``kv_layout`` hint, default NHD, would choose between NHD and HND twins). ATOM's own
connectors get the MLA cache as token rows, ``[NB*BS, 1, HS]`` (its model runner's
view): ``tokens_per_block`` reads those rows in ATOM's blocks.

ATOM's MHA/GQA pool registers per-layer K and V tensors of rank 5 in AITER's SHUFFLE
layout (K ``[NB, H, D // X, BS, X]``, V ``[NB, H, BS // X, D, X]``, ``X`` elements of 16
bytes), whose tokens no format reads: detection refuses them naming
``kvlayout.integrations.atom.shuffled_kv_pools``, which reads their pages."""

from __future__ import annotations

from typing import Any

from kvlayout._generated.formats import EngineKVFormat
from kvlayout.detection.base import DetectionError, pick, probe, token_rows_in_blocks
from kvlayout.types import DiscoverableKVCache, EngineType, LayoutHints

ENGINE = EngineType.ATOM


def discover(kv: Any, hints: LayoutHints) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    p = probe(kv)
    if p.aiter_shuffled:
        raise DetectionError(
            f"ATOM: {p.describe()}: per-layer K and V of rank 5 are ATOM's MHA/GQA pool in AITER's "
            "SHUFFLE layout (mha_kv_fields: K (num_blocks, H, D // X, block_size, X), V (num_blocks, H, "
            "block_size // X, D, X)), whose tokens no format reads; "
            "kvlayout.integrations.atom.shuffled_kv_pools(k_caches, v_caches, block_size) reads its pages"
        )
    fmt = pick(ENGINE, p, decide=[("kv_layout", "is_hnd", bool(hints.is_hnd))])
    return fmt, token_rows_in_blocks(ENGINE, fmt, kv, hints.tokens_per_block, p.describe)
