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
never maps to a V page, even where ``D == page_size == D_v``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvlayout.detection.base import DetectionError
from kvlayout.integrations.sglang.page_lists import dtype_name, listed_pages
from kvlayout.layout.dtypes import DTYPE_SIZES
from kvlayout.registration.opaque import OpaquePages, PageArray
from kvlayout.registration.registration import Registration

__all__ = ["VECTOR_BYTES", "VectorizedPoolError", "vectorized_kv_pools"]

VECTOR_BYTES = 16
"""The bytes of the pool's innermost vector: ``X = 16 // itemsize`` elements."""


class VectorizedPoolError(DetectionError):
    """K and V lists that are not an SGLang ``vectorized_5d`` pool's."""


def _layers(name: str, buffers: Any) -> list[torch.Tensor]:
    if isinstance(buffers, torch.Tensor) or not isinstance(buffers, Sequence) or not buffers:
        raise VectorizedPoolError(
            f"{name} is {type(buffers).__name__}, not a non-empty list of per-layer tensors "
            f"(SGLang's MHATokenToKVPool.{name})"
        )
    layers = list(buffers)
    first = layers[0]
    for i, t in enumerate(layers):
        if not isinstance(t, torch.Tensor):
            raise VectorizedPoolError(f"{name}[{i}] is {type(t).__name__}, not a tensor")
        if t.dim() != 5:
            raise VectorizedPoolError(
                f"{name}[{i}] is {list(t.shape)}, not 5-D: a vectorized_5d pool's K layer is (num_blocks, "
                "H, D // X, page_size, X) and its V layer (num_blocks, H, page_size // X, D_v, X)"
            )
        if (t.shape, t.dtype, t.device) != (first.shape, first.dtype, first.device):
            raise VectorizedPoolError(
                f"{name}[{i}] is {list(t.shape)} {t.dtype} on {t.device} and {name}[0] {list(first.shape)} "
                f"{first.dtype} on {first.device}: every layer alike expected"
            )
    return layers


def _rows(name: str, layer: int, t: torch.Tensor, page_size: int) -> torch.Tensor:
    """A layer's pages as int8 rows ``[num_blocks * page_size, 1, page_bytes // page_size]``,
    a view: the pages contiguous, one after another, as SGLang allocates them."""
    try:
        return t.view(torch.int8).view(t.shape[0] * page_size, 1, -1)
    except RuntimeError:
        raise VectorizedPoolError(
            f"{name}[{layer}] {list(t.shape)} (strides {list(t.stride())}) is not contiguous pages, one "
            "after another, as SGLang allocates them"
        ) from None


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
    ks, vs = _layers("k_buffer", k_buffer), _layers("v_buffer", v_buffer)
    k, v = ks[0], vs[0]
    if len(ks) != len(vs):
        raise VectorizedPoolError(f"k_buffer has {len(ks)} layers and v_buffer {len(vs)}: one per layer each")
    if (k.dtype, k.device) != (v.dtype, v.device):
        raise VectorizedPoolError(
            f"k_buffer is {k.dtype} on {k.device} and v_buffer {v.dtype} on {v.device}: one pool's expected"
        )
    dtype = dtype_name(k, "the pool's dtype", VectorizedPoolError)
    itemsize = DTYPE_SIZES[dtype]
    x = VECTOR_BYTES // itemsize
    blocks, heads, k_vectors, k_page, kx = (int(n) for n in k.shape)
    v_blocks, v_heads, v_vectors, v_head_dim, vx = (int(n) for n in v.shape)
    if (kx, vx) != (x, x):
        raise VectorizedPoolError(
            f"k_buffer[0] {list(k.shape)} and v_buffer[0] {list(v.shape)} end in {kx} and {vx}, not X = "
            f"{VECTOR_BYTES} // {itemsize} = {x} elements of {dtype}: not a vectorized_5d pool"
        )
    if (v_blocks, v_heads, v_vectors * x) != (blocks, heads, k_page):
        raise VectorizedPoolError(
            f"k_buffer[0] is {list(k.shape)} (num_blocks, H, D // X, page_size, X) and v_buffer[0] "
            f"{list(v.shape)}, not (num_blocks, H, page_size // X, D_v, X) = ({blocks}, {heads}, "
            f"{k_page // x}, D_v, {x}): not one vectorized_5d pool"
        )
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size != k_page:
        raise VectorizedPoolError(
            f"page_size is {page_size!r}, but k_buffer[0] {list(k.shape)} (num_blocks, H, D // X, "
            f"page_size, X) holds pages of {k_page} tokens: pass the pool's page_size, and k_buffer "
            "before v_buffer"
        )
    head_dim = k_vectors * x
    arrays = {
        "k": PageArray(0, (heads, k_vectors, page_size * x), dtype, 0, (heads,), kv_heads=True),
        "v": PageArray(0, (heads, v_vectors, v_head_dim, x), dtype, 0, (heads,), kv_heads=True),
    }
    what = {
        "k": f"(H {heads}, D//X {k_vectors}, page {page_size}, X {x})",
        "v": f"(H {heads}, page//X {v_vectors}, D_v {v_head_dim}, X {x})",
    }
    pools = {}
    for name, layers in (("k", ks), ("v", vs)):
        page = OpaquePages(
            f"SGLang AITER vectorized_5d {name.upper()} page {what[name]} of {itemsize}-byte elements "
            f"(head_dim {head_dim}, v_head_dim {v_head_dim})",
            False,
            (arrays[name],),
        )
        rows = [_rows(f"{name}_buffer", i, t, page_size) for i, t in enumerate(layers)]
        pools[name] = listed_pages(rows, page, layers, page_size)
    return pools
