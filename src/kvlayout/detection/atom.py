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
tokens; detection refuses them naming the same reader.

ATOM's DSA indexer key cache (DeepSeek-V3.2, GLM-5: ``MlaKvPool``'s ``index`` field, per
indexer layer ``[NB, BS, W]`` uint8, ``W`` the key and its fp32 scale padded to 16 bytes,
``aiter_mla.aligned_index_cache_dim``) is no rows of tokens: the indexer writes a block's
keys in 16x16 MFMA tiles, ``[BS/16, D/16, 16, 16]`` bytes, then the block's ``BS`` fp32
scales, then padding (``kv_transfer/disaggregation/index_staging.py``,
``gather_dcp_preshuffled_index_pages``). Such a list (uint8, more than one row a block, in
multiples of 16 rows of a multiple of 16 bytes) is read as whole opaque pages, one key
head every TP rank holds, so a block moves whole, only to a page laid out alike. ATOM's
attention backend views that cache at the MLA page size, ``[NB*BS, 1, W]`` by default
(``ATOM_MLA_PAGE_SIZE=1``), rows that are neither tokens nor pages:
``kvlayout.integrations.atom.indexer_pages`` reads them in the indexer's pages; given
``tokens_per_block``, detection refuses such rows naming it (without the hint they read
as the MP connector's block rows)."""

from __future__ import annotations

from typing import Any

import torch

from kvlayout._generated.formats import EngineKVFormat
from kvlayout.detection.base import DetectionError, Probe, pick, probe, token_rows_in_blocks
from kvlayout.registration.opaque import (
    MAX_PAGE_LAYOUT,
    OpaquePages,
    mark_opaque_pages,
    page_bytes_view,
    page_of,
    replicated_page,
)
from kvlayout.types import DiscoverableKVCache, EngineType, LayoutHintError, LayoutHints

ENGINE = EngineType.ATOM

SCALE_DTYPE = torch.float32
"""The dtype of ATOM's fp8 MHA dequantization scales (``mha_kv_scale_fields``), which its
KV never has (``--kv_cache_dtype`` is bf16 or fp8)."""

INDEX_TILE = 16
"""The MFMA tile ATOM's DSA indexer writes a block's keys in: 16 tokens of 16 bytes, so a
block's rows and a row's bytes are multiples of it (``index_staging``)."""


def _index_pages(kv: Any, p: Probe) -> list[torch.Tensor] | None:
    """ATOM's DSA indexer key cache as whole opaque pages ``[NB, BS, W]`` int8, views of
    its blocks; None for a registration that is not one."""
    if p.depth != 1 or p.rank != 3 or p.first.dtype != torch.uint8:
        return None
    rows, width = int(p.first.shape[1]), int(p.first.shape[2])
    if rows == 1 or rows % INDEX_TILE or width % INDEX_TILE:
        return None  # [NB, 1, bytes] is a block as one row of bytes (ATOM's MP connector)
    views = []
    for i, t in enumerate(kv):
        if t.numel() == 0:  # a view of no blocks cannot be re-viewed as pages
            raise DetectionError(
                f"ATOM: kv_caches[{i}] {list(t.shape)} is ATOM's DSA indexer key cache by its shape, and "
                "holds no blocks: no pages to read"
            )
        if t.stride(2) != 1 or t.stride(1) != width:  # validation refuses these first; the view needs it
            raise DetectionError(
                f"ATOM: kv_caches[{i}] {list(t.shape)} (strides {list(t.stride())}) is ATOM's DSA indexer "
                "key cache by its shape (uint8 [NB, BS, W] in 16x16 tiles), but not whole pages of "
                "contiguous rows, as MlaKvPool allocates them"
            )
        layout = (
            f"atom-indexer-pages: ATOM's DSA indexer, a block's keys in 16x16 MFMA tiles [BS/16, D/16, 16, "
            f"16], then BS fp32 scales, padded: {page_of(t)}"
        )
        advice = (
            "ATOM's DSA indexer keys are written in MFMA tiles, not token rows: a block moves whole, only to "
            "an indexer cache paged alike (ATOM's, same block size and row width)"
        )
        page = OpaquePages(layout[:MAX_PAGE_LAYOUT], False, replicated_page((rows * width,)), advice)
        stride = int(t.stride(0)) if t.shape[0] > 1 else rows * width
        view = page_bytes_view(t, int(t.shape[0]), rows, width, stride, int(t.storage_offset()))
        mark_opaque_pages(view, page, [t])
        views.append(view)
    return views


def _refuse_byte_rows_in_blocks(p: Probe, tokens_per_block: int | None) -> None:
    """Rows of bytes ``[N, 1, W]`` given a block size are one of two caches, neither of
    which the hint's blocks of rows read: the MP connector's whole blocks (the hint
    contradicts them) or the DSA indexer's one-token physical pages, whose pages the
    indexer groups by its own page size (the block size, times the DCP size where the
    index is replicated), which only the caller knows."""
    if p.depth != 1 or p.rank != 3 or p.first.dtype != torch.uint8 or int(p.first.shape[1]) != 1:
        return
    if tokens_per_block is None or tokens_per_block == 1:
        return
    raise LayoutHintError(
        f"ATOM: {p.describe()}: tokens_per_block={tokens_per_block} contradicts rows of bytes [N, 1, W], "
        "which are either ATOM's MP connector's blocks, one row each (detect them without the hint), or its "
        "DSA indexer key cache at ATOM_MLA_PAGE_SIZE=1, one token a physical page, whose keys and scales "
        "the indexer writes across a page of its block size (times the DCP size where "
        "ATOM_DCP_REPLICATE_INDEX_CACHE=1): kvlayout.integrations.atom.indexer_pages(index_caches, "
        "rows_per_page) reads those"
    )


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
    _refuse_byte_rows_in_blocks(p, hints.tokens_per_block)
    index = _index_pages(kv, p)
    if index is not None:
        return pick(ENGINE, probe(index)), index
    fmt = pick(ENGINE, p, decide=[("kv_layout", "is_hnd", bool(hints.is_hnd))])
    return fmt, token_rows_in_blocks(ENGINE, fmt, kv, hints.tokens_per_block, p.describe)
