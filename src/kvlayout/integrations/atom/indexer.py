"""ATOM's DSA indexer key cache at any physical page size, read in the indexer's pages.

ATOM allocates the indexer cache (``MlaKvPool``'s ``index`` field) per indexer layer as
``[entries, rows_per_block, W]`` uint8 (``W = aligned_index_cache_dim``, the fp8 key and
its fp32 scale padded to 16 bytes); what its connectors register
(``MlaKvPool.region_tensors``) is that, a row a scheduler block, which
``kvlayout.detect(..., "atom")`` reads as pages. Its attention backend pages the cache at
the MLA page size instead (``ATOM_MLA_PAGE_SIZE``, 1 by default): ``[NB * BS, 1, W]``, one
physical page a token. Those rows are no tokens: the indexer re-views the cache as
``[-1, index_block_size, W]`` before every write and read (``index_block_size`` the block
size, times the DCP size where ``ATOM_DCP_REPLICATE_INDEX_CACHE`` replicates the index
over DCP ranks) and writes each such page in 16x16 MFMA tiles then one fp32 scale per token
(``index_staging.gather_dcp_preshuffled_index_pages`` rebuilds a block from
``block_ratio`` physical pages so). :func:`indexer_pages` reads the physical view as those
pages; a one-token row alone is 144 bytes of the tiles and scale plane, nobody's key.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlayout._generated.engines import EngineType
from kvlayout.detection.atom import INDEX_TILE
from kvlayout.detection.base import DetectionError
from kvlayout.detection.discovery import detect
from kvlayout.errors import as_int
from kvlayout.integrations.page_lists import layer_list
from kvlayout.registration.registration import Registration

__all__ = ["IndexerPagesError", "indexer_pages"]


class IndexerPagesError(DetectionError):
    """Tensors that are not ATOM's DSA indexer key cache, or not in the pages asked."""


def _indexer_view(i: int, t: torch.Tensor, rows_per_page: int) -> torch.Tensor:
    """Layer ``i`` re-viewed as ATOM's indexer views it, ``[-1, rows_per_page, W]``."""
    where = f"index_caches[{i}] {list(t.shape)} {t.dtype}"
    if t.dim() != 3 or t.dtype != torch.uint8:
        raise IndexerPagesError(
            f"{where}: ATOM's DSA indexer key cache is uint8 [pages, rows a page, W] per indexer layer"
        )
    physical, width = int(t.shape[1]), int(t.shape[2])
    rows = int(t.shape[0]) * physical
    if width % INDEX_TILE:
        raise IndexerPagesError(
            f"{where}: a row of {width} bytes is no aligned_index_cache_dim (the key and its fp32 scale, "
            f"padded to {INDEX_TILE} bytes)"
        )
    if rows == 0 or rows % rows_per_page:
        raise IndexerPagesError(
            f"{where}: its {rows} rows are not whole pages of rows_per_page={rows_per_page} (ATOM's "
            "indexer views the cache as [-1, rows_per_page, W])"
        )
    if physical == rows_per_page:
        return t
    if t.stride(2) != 1 or t.stride(1) != width or (t.shape[0] > 1 and t.stride(0) != physical * width):
        raise IndexerPagesError(
            f"{where} (strides {list(t.stride())}): its physical pages of {physical} rows are not "
            f"contiguous, so no view groups them in pages of {rows_per_page} rows as ATOM's indexer does"
        )
    return t.view(-1, rows_per_page, width)


def indexer_pages(index_caches: Any, rows_per_page: int) -> Registration:
    """ATOM's DSA indexer key cache, per indexer layer ``[pages, rows, W]`` uint8 at any
    physical page size (``[NB * BS, 1, W]`` at ``ATOM_MLA_PAGE_SIZE=1``, or the pool's
    ``[NB, BS, W]``), read in the pages ATOM's indexer writes: ``rows_per_page`` rows each
    (ATOM's ``index_block_size``: its ``kv_cache_block_size``, times the DCP size under
    ``ATOM_DCP_REPLICATE_INDEX_CACHE=1``), a multiple of 16.

    Block ids are the indexer's pages (ATOM's scheduler block ids); a page moves whole
    (a partly filled one too), every TP rank holding it, only to an indexer cache paged
    alike (same rows a page and row width), as ``detect(..., "atom")`` reads the pool's
    registration. Raises :class:`IndexerPagesError` for tensors that are not such a cache
    or do not split into such pages."""
    rows = as_int(rows_per_page, "rows_per_page")
    if rows <= 0 or rows % INDEX_TILE:
        raise IndexerPagesError(
            f"rows_per_page={rows}: ATOM's indexer writes pages in {INDEX_TILE}x{INDEX_TILE} MFMA tiles, "
            f"so a page is a positive multiple of {INDEX_TILE} rows"
        )
    layers = layer_list(
        "index_caches", index_caches, "ATOM's per-layer DSA indexer key cache", IndexerPagesError
    )
    views = [_indexer_view(i, t, rows) for i, t in enumerate(layers)]
    return detect(views, EngineType.ATOM)
