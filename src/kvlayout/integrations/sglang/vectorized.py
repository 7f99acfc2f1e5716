"""SGLang's ROCm AITER "SHUFFLE 5D" KV pool as registrations of opaque pages, K and V.

Under ``SGLANG_AITER_KV_CACHE_LAYOUT=vectorized_5d`` SGLang's ``MHATokenToKVPool``
(``_create_buffers_normal``) allocates each layer's K as ``(num_blocks, H, D // X,
page_size, X)`` and V as ``(num_blocks, H, page_size // X, D_v, X)``, ``X = 16 //
store_dtype.itemsize`` (8 for bf16 and fp16, 16 for fp8 stored as uint8), ``num_blocks =
(size + page_size) // page_size`` (page 0 absorbs padded tokens' writes), ``page_size``
64 by default there. Its P/D registers these buffers whole, a page an item
(``_build_kv_buffer_descs``: ``tokens_per_row = page_size``; ``get_contiguous_buf_infos``).

A token's K is split around the page's token axis (its head dim in ``D // X`` vectors of
``X``), and V's token axis around its head dim: no token-level format reads them, and K
and V differ. So each is read as SGLang reads it for P/D: whole pages, opaque. A layer's
page is viewed (no copy) as ``page_size`` int8 rows, the layers as SGLang's per-layer
list (``NL_X_NB_BS_HS`` in blocks of ``page_size``), and marked
(:func:`~kvlayout.registration.opaque.mark_opaque_pages`) with what orders its bytes.
Each page declares its heads as a TP-sharded array (K's ``[H, D // X, page_size * X]``,
V's ``[H, page_size // X, D_v, X]``; heads outermost), so a map between ranks of two TP
degrees moves the heads both hold. The two arrays have other ranks on purpose: a K page
never maps to a V page, even where ``D == page_size == D_v``. The reading is
:func:`kvlayout.integrations.aiter_shuffle.shuffle_kv_pools`, shared with ATOM's pool of the
same layout (:func:`kvlayout.integrations.atom.shuffled_kv_pools`): a page's description
names the AITER layout, not the engine, so the two engines' pools map to each other.
"""

from __future__ import annotations

from typing import Any

from kvlayout._generated.engines import EngineType
from kvlayout.detection.base import DetectionError
from kvlayout.integrations.aiter_shuffle import VECTOR_BYTES, ShuffleCaller, shuffle_kv_pools
from kvlayout.registration.registration import Registration

__all__ = ["VECTOR_BYTES", "VectorizedPoolError", "vectorized_kv_pools"]


class VectorizedPoolError(DetectionError):
    """K and V lists that are not an SGLang ``vectorized_5d`` pool's."""


_SGLANG = ShuffleCaller(
    error=VectorizedPoolError,
    pool="vectorized_5d pool",
    k_name="k_buffer",
    v_name="v_buffer",
    size_name="page_size",
    origin="SGLang's MHATokenToKVPool.k_buffer / v_buffer",
    allocator="SGLang",
    engine=EngineType.SGLANG,
)


def vectorized_kv_pools(k_buffer: Any, v_buffer: Any, page_size: int) -> dict[str, Registration]:
    """SGLang's ``vectorized_5d`` pool (``SGLANG_AITER_KV_CACHE_LAYOUT=vectorized_5d``,
    ROCm AITER): ``k_buffer`` and ``v_buffer`` (its per-layer lists, in the store dtype
    or as ``get_key_buffer`` views them) as one registration each, ``{"k": ..., "v": ...}``.
    ``page_size`` is the pool's: K's axis 3 and V's axes 2 and 4 must say it (where
    ``head_dim == v_head_dim`` the lists passed the other way round would read
    self-consistently, with the head size as the page size).

    Block ids are SGLang's page indices (page 0 its padding page), a block ``page_size``
    tokens; a page moves whole (``num_tokens`` rounds up to whole pages), only to a page
    of the same kind (K to K, V to V) of such a pool. Two pools at one TP rank move whole
    pages; ranks of two TP degrees, given ``src_shard`` and ``dst_shard``, move the heads
    both hold (kind ``resharded state``), one run a page and layer. Raises
    :class:`VectorizedPoolError` for lists that are not such a pool."""
    return shuffle_kv_pools(k_buffer, v_buffer, page_size, _SGLANG)
