"""SGLang's DeepSeek-V4 pools whose tokens no format reads, as registrations of whole pages.

Two of ``deepseek_v4_memory_pool.py``'s buffers keep a page's tokens apart from their
bytes, so no token-level format reads them:

* ``DeepSeekV4SingleKVPool.kv_buffer`` (its SWA, C4 and C128 pools): a uint8 ``[pages,
  page bytes]`` per layer, a FlashMLA page of ``page_size`` slots (every slot's data
  bytes, then every slot's scale bytes, padded: ``KVLayout.page_bytes``), in one of the
  layouts of :data:`~kvlayout.detection.sglang.FLASHMLA_LAYOUTS` (V4's 584-byte slots,
  V4.1's 528 or, in FP4, 288).
* ``DeepSeekV4IndexerPool`` under ``uses_aiter_fp4_layout`` (ROCm's FP4 indexer):
  ``index_k_payload_buffer`` ``[pages, 1, 4, page_size, 16]`` and
  ``index_k_scale_buffer`` ``[pages, 1, 4, page_size]`` per layer, a token's 64 payload
  and 4 scale bytes split across the page; SGLang's P/D and HiCache move them flattened,
  ``[pages, page_size * 64]`` and ``[pages, page_size * 4]``
  (``contiguous_page_row_buffers``).

SGLang's own P/D moves either as whole pages (``get_contiguous_buf_infos``: an item is
a page row), and so does a block map here: a layer's page is viewed (no copy) as
``page_size`` int8 rows, the layers as SGLang's per-layer list in blocks of
``page_size`` rows, marked (:func:`~kvlayout.registration.opaque.mark_opaque_pages`)
with what orders its bytes: the layout, the page_size and which buffer. So a page maps
only to a page of the same kind, layout and page_size, and a partly filled last page
moves whole. Every TP rank holds the latents (and the indexer's keys) whole: a page
declares itself an array every rank holds whole, so a map moves it between any two
ranks, whatever their shards.

Its compressor states (``CompressStatePool``) are no pages but rings, a request's state in
``ring_size`` rows of ``kv_score`` (:func:`compress_state_rings`): the ring is a block, whole,
as SGLang's P/D and HiCache move it; the compressor is replicated over TP ranks, so a ring
too is an array every rank holds whole.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvlayout._generated.engines import EngineType
from kvlayout.detection.base import DetectionError
from kvlayout.detection.sglang import FLASHMLA_LAYOUTS, flashmla_page_bytes
from kvlayout.errors import positive
from kvlayout.integrations.page_lists import layer_list, listed_pages, page_rows
from kvlayout.registration.opaque import OpaquePages, replicated_page
from kvlayout.registration.registration import Registration

__all__ = ["DeepSeekV4PoolError", "aiter_fp4_indexer_pages", "compress_state_rings", "flashmla_kv_pages"]


class DeepSeekV4PoolError(DetectionError):
    """Buffers that are not the SGLang DeepSeek-V4 pool they were passed as."""


# The ROCm FP4 indexer's split page: a slot's payload bytes in 4 vectors of 16, and its
# 4 scale bytes (DeepSeekV4IndexerPool._create_buffer under uses_aiter_fp4_layout).
_AITER_GROUPS, _AITER_VECTOR = 4, 16


def _page_size(page_size: object) -> int:
    return positive(page_size, "page_size", "the pool's page_size", DeepSeekV4PoolError)


def _layers(name: str, buffers: Any, origin: str) -> list[torch.Tensor]:
    """Per-layer tensors alike, of one-byte elements (SGLang stores uint8; its kernels view
    fp8 or packed fp4 over them)."""
    layers = layer_list(name, buffers, origin, DeepSeekV4PoolError)
    first = layers[0]
    if first.element_size() != 1 or first.dtype.is_complex or first.dtype == torch.bool:
        raise DeepSeekV4PoolError(f"{name} is {first.dtype}, not bytes (uint8, as SGLang allocates it)")
    if first.numel() == 0:
        raise DeepSeekV4PoolError(f"{name}[0] is {list(first.shape)}: it holds no pages")
    return layers


def _rows(name: str, layers: list[torch.Tensor], page_size: int, page_bytes: int) -> list[torch.Tensor]:
    """Each layer's pages as int8 rows ``[pages * page_size, 1, page_bytes // page_size]``."""
    if page_bytes % page_size:
        raise DeepSeekV4PoolError(
            f"{name}'s {page_bytes}-byte page does not split into page_size={page_size} equal rows "
            f"({page_bytes % page_size} bytes left over), which a block of page_size tokens needs"
        )
    return [
        page_rows(f"{name}[{i}]", t, page_size, "SGLang", DeepSeekV4PoolError) for i, t in enumerate(layers)
    ]


_ADVICE = (
    "SGLang moves these pages whole (get_contiguous_buf_infos); they map only to pages of the same "
    "buffer, layout and page_size; every TP rank holds them whole, so they map between any two ranks"
)


def flashmla_kv_pages(kv_buffer: Any, page_size: int, layout: str | None = None) -> Registration:
    """SGLang's DeepSeek-V4 FlashMLA KV pages (``DeepSeekV4SingleKVPool.kv_buffer``: per
    layer uint8 ``[pages, page bytes]``, the SWA, C4 or C128 pool's; ``page_size`` its
    own, e.g. ``c4_kv_pool.page_size``) as one registration of whole pages. The layout
    (V4, V4.1 or V4.1 FP4) is the one whose page of ``page_size`` slots is the row's size:
    at one page_size no two are; ``layout`` (a name of
    :data:`~kvlayout.detection.sglang.FLASHMLA_LAYOUTS`) pins it. Only FlashMLA pages read
    so: V4.1's page of one slot, 1024 bytes, is the size of the unified pool's compressed
    page of one bf16 row (``unified_region_buffers`` at ``page_size == compress_ratio``),
    which holds other bytes and reads as MLA rows. A layer's pages may lie further apart
    than their size: HiSparse's page_first host pool's layers, ``kv_buffer[:, l]``. Block
    ids are SGLang's page indices. Raises :class:`DeepSeekV4PoolError` for buffers that are no such pool."""
    ps = _page_size(page_size)
    origin = "DeepSeekV4SingleKVPool.kv_buffer"
    layers = _layers("kv_buffer", kv_buffer, origin)
    if layers[0].dim() != 2:
        raise DeepSeekV4PoolError(
            f"kv_buffer[0] is {list(layers[0].shape)}, not [pages, page bytes] ({origin})"
        )
    if layout is not None and (not isinstance(layout, str) or layout not in FLASHMLA_LAYOUTS):
        raise DeepSeekV4PoolError(
            f"layout={layout!r} is no FlashMLA page layout: one of {', '.join(FLASHMLA_LAYOUTS)} (or None)"
        )
    row = int(layers[0].shape[1])
    named = FLASHMLA_LAYOUTS if layout is None else [layout]
    fits = [name for name in named if flashmla_page_bytes(name, ps) == row]
    if len(fits) != 1:
        sizes = ", ".join(f"{name} {flashmla_page_bytes(name, ps)}" for name in named)
        raise DeepSeekV4PoolError(
            f"kv_buffer[0] is {list(layers[0].shape)}: a page of {row} bytes, which is no FlashMLA page of "
            f"page_size={ps} slots (bytes by layout: {sizes}); pass the pool's own page_size"
        )
    name = fits[0]
    data, scale, _ = FLASHMLA_LAYOUTS[name]
    page = OpaquePages(
        f"SGLang DeepSeek-V4 FlashMLA KV page ({name}): {ps} slots of {data} data bytes, then their "
        f"{scale} scale bytes each, in {row} bytes",
        rows_are_tokens=False,
        arrays=replicated_page((ps, data + scale)),
        advice=_ADVICE,
    )
    return listed_pages(_flashmla_rows(layers, ps, row), page, layers, ps, EngineType.SGLANG)


def _flashmla_rows(layers: list[torch.Tensor], page_size: int, row: int) -> list[torch.Tensor]:
    """Each layer's FlashMLA pages as int8 rows: one after another as ``_rows``, or, where
    a layer's pages lie a wider stride apart (HiSparse's ``DeepSeekV4PagedHostPool`` in
    ``page_first`` or ``page_first_direct``: ``kv_buffer[:, layer]`` of ``[pages, NL, (1,)
    page bytes]``), as ``[pages, page_size, 1, row // page_size]`` views at that stride,
    which read as page-major views (their page stride an envelope of every layer's page)."""
    t = layers[0]
    if t.shape[0] < 2 or t.stride(0) == row or t.stride(1) != 1 or t.stride(0) < row:
        return _rows("kv_buffer", layers, page_size, row)  # pages one after another, or refused
    _rows("kv_buffer", [t[:1] for t in layers], page_size, row)  # a page splits into page_size rows
    return [t.view(torch.int8).view(t.shape[0], page_size, 1, row // page_size) for t in layers]


def _indexer_shape(name: str, t: torch.Tensor, page_size: int, split: tuple[int, ...]) -> int:
    """The page bytes of one of the split indexer's buffers, SGLang's ``[pages, *split]``
    or flattened ``[pages, prod(split)]``; the buffer is refused otherwise."""
    page_bytes = math.prod(split)
    flat = (page_bytes,)
    if tuple(t.shape[1:]) not in (split, flat):
        raise DeepSeekV4PoolError(
            f"{name}[0] is {list(t.shape)}, not [pages, {', '.join(map(str, split))}] or flattened [pages, "
            f"{page_bytes}] at page_size={page_size} (DeepSeekV4IndexerPool under uses_aiter_fp4_layout)"
        )
    return page_bytes


def aiter_fp4_indexer_pages(
    payload_buffer: Any, scale_buffer: Any, page_size: int
) -> dict[str, Registration]:
    """SGLang's ROCm FP4 indexer (``DeepSeekV4IndexerPool.uses_aiter_fp4_layout``):
    ``index_k_payload_buffer`` (``[pages, 1, 4, page_size, 16]``, or its uint8 view
    flattened to ``[pages, page_size * 64]``) and ``index_k_scale_buffer`` (``[pages, 1,
    4, page_size]`` or ``[pages, page_size * 4]``) as one registration each,
    ``{"payload": ..., "scale": ...}``. Block ids are SGLang's page indices; a page
    moves whole, payload to payload, scales to scales, at the same page_size (either
    form to the other). Raises :class:`DeepSeekV4PoolError` for anything else."""
    ps = _page_size(page_size)
    origin = "DeepSeekV4IndexerPool.index_k_payload_buffer / index_k_scale_buffer"
    buffers = {
        "payload": _layers("payload_buffer", payload_buffer, origin),
        "scale": _layers("scale_buffer", scale_buffer, origin),
    }
    payload, scale = buffers["payload"][0], buffers["scale"][0]
    splits = {"payload": (1, _AITER_GROUPS, ps, _AITER_VECTOR), "scale": (1, _AITER_GROUPS, ps)}
    if len(buffers["payload"]) != len(buffers["scale"]):
        raise DeepSeekV4PoolError(
            f"payload_buffer has {len(buffers['payload'])} layers and scale_buffer {len(buffers['scale'])}: "
            "one per layer each"
        )
    if (payload.shape[0], payload.device) != (scale.shape[0], scale.device):
        raise DeepSeekV4PoolError(
            f"payload_buffer[0] is {list(payload.shape)} on {payload.device} and scale_buffer[0] "
            f"{list(scale.shape)} on {scale.device}: one pool's pages on one device expected"
        )
    pools = {}
    for kind, layers in buffers.items():
        page_bytes = _indexer_shape(f"{kind}_buffer", layers[0], ps, splits[kind])
        what = "payload: 64 bytes a slot, in 4 runs of 16" if kind == "payload" else "scales: 4 bytes a slot"
        page = OpaquePages(
            f"SGLang DeepSeek-V4 AITER FP4 indexer {what}, each run over the page's {ps} slots, in "
            f"{page_bytes} bytes",
            rows_are_tokens=False,
            arrays=replicated_page(splits[kind][1:]),
            advice=_ADVICE,
        )
        rows = _rows(f"{kind}_buffer", layers, ps, page_bytes)  # SGLang's shape or flattened: one view
        pools[kind] = listed_pages(rows, page, layers, ps, EngineType.SGLANG)
    return pools


_RING_ADVICE = (
    "SGLang moves a compressor state's ring whole (get_state_buf_infos, get_request_state_buf_infos, "
    "DeepSeekV4StateHostPool); a ring maps only to a ring of as many rows of as many bytes. Every TP "
    "rank holds the states whole, so a ring maps between any two ranks"
)


def _ring_size(ring_size: object) -> int:
    return positive(
        ring_size, "ring_size", "the pool's ring_size, get_compress_state_ring_size", DeepSeekV4PoolError
    )


def _state_tensors(states: Any, ring_size: object) -> tuple[list[Any], int]:
    """The per-layer tensors and ring size of ``states``: tensors (``ring_size`` given) or
    SGLang's ``CompressStatePool`` objects, whose ``kv_score_buffer.kv_score`` and
    ``ring_size`` say both (a ``ring_size`` given must be theirs)."""
    if not isinstance(states, list | tuple) or not any(hasattr(s, "kv_score_buffer") for s in states):
        return states, _ring_size(ring_size)  # tensors: layer_list says what else they are not
    tensors, rings = [], set()
    for i, pool in enumerate(states):
        kv_score = getattr(getattr(pool, "kv_score_buffer", None), "kv_score", None)
        ring = getattr(pool, "ring_size", None)
        if kv_score is None or ring is None:
            raise DeepSeekV4PoolError(
                f"states[{i}] is {type(pool).__name__}, not a CompressStatePool (kv_score_buffer.kv_score, "
                "ring_size) like the others: pass one ratio's pools, e.g. [p for p in compress_state_pools "
                "if p is not None and p.ratio == 4]"
            )
        tensors.append(kv_score)
        rings.add(_ring_size(ring))
    if len(rings) != 1:
        raise DeepSeekV4PoolError(
            f"the pools' rings are of {sorted(rings)} rows: one list holds one kind of state (C4's or "
            "C128's, attention's or the indexer's), one ratio's pools"
        )
    ring = rings.pop()
    if ring_size is not None and _ring_size(ring_size) != ring:
        raise DeepSeekV4PoolError(f"ring_size={ring_size!r}, but the pools' rings are of {ring} rows")
    return tensors, ring


def compress_state_rings(states: Any, ring_size: int | None = None) -> Registration:
    """SGLang's DeepSeek-V4 compressor states (``CompressStatePool``, one per C4 or C128
    layer: ``compress_state_pools``, ``indexer_compress_state_pools``) as one registration
    of whole rings: block ``b`` is the ring of ``ring_size`` rows ``[b * ring_size, (b + 1)
    * ring_size)``, where SGLang keeps a request's state (``translate_from_swa_loc_to_state_loc``:
    C4's ring is its SWA page's, ``swa_loc // swa_page_size``; ``translate_from_req_position_to_state_loc``:
    C128's, and C4's in the unified pool, is its request slot's, ``req_pool_idx``). ``states``
    is the layers' pools, or their ``kv_score_buffer.kv_score`` (floating ``[rows, width]``:
    a row's kv, then its score) with ``ring_size``, or the HiCache host pages
    (``DeepSeekV4StateHostPool.kv_buffer``: uint8 ``[pages, ring_size * row bytes]``, a page a
    ring) with ``ring_size``; the device's rows past its last whole ring (padding, the dummy
    row) are no block, as SGLang's host pool views them. Every TP rank holds the states
    whole: a ring maps between any two ranks, whatever their shards. Raises
    :class:`DeepSeekV4PoolError` for anything else."""
    tensors, ring = _state_tensors(states, ring_size)
    origin = "CompressStatePool.kv_score_buffer.kv_score or DeepSeekV4StateHostPool.kv_buffer"
    layers = layer_list("states", tensors, origin, DeepSeekV4PoolError)
    first = layers[0]
    host = first.dtype == torch.uint8  # the host pool's byte pages; a device state holds -inf scores
    if first.dim() != 2 or not (host or first.dtype.is_floating_point):
        raise DeepSeekV4PoolError(
            f"states[0] is {list(first.shape)} {first.dtype}, not a compressor state (floating [rows, "
            "width]) nor its host pages (uint8 [pages, ring bytes])"
        )
    if not first.numel():
        raise DeepSeekV4PoolError(f"states[0] is {list(first.shape)}: it holds no rings")
    if host:
        if first.shape[1] % ring:
            raise DeepSeekV4PoolError(
                f"states[0] is {list(first.shape)} uint8: a host page of {first.shape[1]} bytes, which is no "
                f"ring of ring_size={ring} equal rows (DeepSeekV4StateHostPool: ring_size * row bytes)"
            )
        rows = [
            page_rows(f"states[{i}]", t, ring, "SGLang", DeepSeekV4PoolError) for i, t in enumerate(layers)
        ]
    else:
        whole = first.shape[0] // ring * ring
        if not whole:
            raise DeepSeekV4PoolError(
                f"states[0] is {list(first.shape)}: no whole ring of ring_size={ring} rows"
            )
        rows = [
            page_rows(f"states[{i}]", t[:whole], 1, "SGLang", DeepSeekV4PoolError)
            for i, t in enumerate(layers)
        ]
    row_bytes = int(rows[0].shape[-1])
    page = OpaquePages(
        f"SGLang DeepSeek-V4 compressor state ring: {ring} rows of {row_bytes} bytes",
        rows_are_tokens=False,
        arrays=replicated_page((ring, row_bytes)),
        advice=_RING_ADVICE,
    )
    return listed_pages(rows, page, layers, ring, EngineType.SGLANG)
