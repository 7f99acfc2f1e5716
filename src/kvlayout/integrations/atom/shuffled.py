"""ATOM's MHA/GQA KV pool (AITER SHUFFLE layout) as registrations of opaque pages, K and V.

ATOM's ``MhaKvPool`` (``atom/model_ops/attentions/mha_kv_pool.py``, ``mha_kv_fields``)
declares one block of a layer as K ``(H, D // X, block_size, X)`` and V ``(H,
block_size // X, D, X)``, ``X = 16 // kv_dtype.itemsize`` (8 for bf16, 16 for fp8), and
refuses a ``head_dim`` or ``block_size`` that ``X`` does not divide. Its layer-major arena
(``pool_layout/entry_arena.py``, ``LayerMajorArena``) puts every layer's K, then every
layer's V, each layer's ``[num_blocks, ...]`` slice contiguous; the fp8 dequantization
scales are a separate region (``mha_kv_scale_fields``: per layer ``k_scale`` and
``v_scale`` ``[num_blocks, H, block_size]`` float32, one per (KV head, token), allocated
for every cache dtype, bound to ``KVCacheTensor.k_scale`` / ``v_scale`` under
``--kv_cache_dtype fp8``). The connectors take each layer's ``KVCacheTensor.k_cache`` and
``v_cache`` (``kv_transfer/disaggregation/moriio/moriio_connector.py``), the Mooncake one
its ``k_scale`` and ``v_scale`` too (``mooncake/mooncake_connector.py``,
``register_kv_caches``), and address a block as an index of axis 0 (``stride(0)`` bytes a
block).

These are the bytes SGLang's ``vectorized_5d`` pool holds, so the reading is
:func:`kvlayout.integrations.aiter_shuffle.shuffle_kv_pools`: a page of one engine maps
to a page of the other where geometry and dtype agree.

An earlier ATOM draft-model builder declared V non-transposed, ``[num_blocks, H, D,
block_size]`` (4-D; ATOM's reader branches on ``v_cache.ndim`` and relays such a pool
out). :func:`shuffled_kv_pools` refuses it by name: its pages are other bytes, and no
SHUFFLE V page may take them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvlayout._generated.engines import EngineType
from kvlayout.detection.atom import SCALE_DTYPE
from kvlayout.detection.base import DetectionError
from kvlayout.errors import as_int
from kvlayout.integrations.aiter_shuffle import ShuffleCaller, shuffle_kv_pools
from kvlayout.integrations.page_lists import layer_list, listed_pages, page_rows
from kvlayout.registration.opaque import OpaquePages, PageArray
from kvlayout.registration.registration import Registration

__all__ = ["ShuffledPoolError", "shuffled_kv_pools"]


class ShuffledPoolError(DetectionError):
    """K and V lists that are not an ATOM SHUFFLE MHA pool's."""


_ATOM = ShuffleCaller(
    error=ShuffledPoolError,
    pool="ATOM SHUFFLE MHA pool",
    k_name="k_caches",
    v_name="v_caches",
    size_name="block_size",
    origin="ATOM's per-layer KVCacheTensor.k_cache / v_cache",
    allocator="ATOM's MhaKvPool",
    engine=EngineType.ATOM,
)


def _refuse_plain_v(k_caches: Any, v_caches: Any) -> None:
    if isinstance(v_caches, torch.Tensor) or not isinstance(v_caches, Sequence) or not v_caches:
        return
    v = v_caches[0]
    if not (isinstance(v, torch.Tensor) and v.dim() == 4):
        return
    k = k_caches[0] if isinstance(k_caches, Sequence) and not isinstance(k_caches, torch.Tensor) else None
    if isinstance(k, torch.Tensor) and k.dim() == 5:
        raise ShuffledPoolError(
            f"v_caches[0] is {list(v.shape)}: a non-transposed V (num_blocks, H, D, block_size), which "
            "ATOM's draft builder once declared and its reader relays out; kvlayout reads only the "
            "SHUFFLE V (num_blocks, H, block_size // X, D, X) that ATOM's MhaKvPool allocates"
        )


_SCALES = ("k_scale", "v_scale")


def _scale_pools(
    k_scales: Any, v_scales: Any, k_caches: list[torch.Tensor], block_size: int
) -> dict[str, Registration]:
    """The fp8 dequantization scales of ATOM's MhaKvPool, one registration each: a layer's
    block is ``(H, block_size)`` float32, heads outermost (``scale_views``)."""
    if (k_scales is None) != (v_scales is None):
        raise ShuffledPoolError(
            "k_scales and v_scales come together (ATOM's KVCacheTensor.k_scale and v_scale): "
            "pass both or neither"
        )
    k = k_caches[0]
    blocks, heads = int(k.shape[0]), int(k.shape[1])
    want = [blocks, heads, block_size]
    origin = "ATOM's per-layer KVCacheTensor.k_scale / v_scale"
    pools = {}
    for name, buffers in zip(_SCALES, (k_scales, v_scales), strict=True):
        label = f"{name}s"
        layers = layer_list(label, buffers, origin, ShuffledPoolError)
        first = layers[0]
        if len(layers) != len(k_caches):
            raise ShuffledPoolError(
                f"{label} has {len(layers)} layers and k_caches {len(k_caches)}: one per layer each"
            )
        if first.dtype != SCALE_DTYPE or first.device != k.device or list(first.shape) != want:
            raise ShuffledPoolError(
                f"{label}[0] is {list(first.shape)} {first.dtype} on {first.device}, not ATOM's fp8 "
                f"scales of this pool: (num_blocks, H, block_size) = {tuple(want)} {SCALE_DTYPE} on "
                f"{k.device}, one per (KV head, token) of each block"
            )
        # V's (H, 1, page): the same bytes as K's (H, page), another rank on purpose, so that a K
        # scale page never maps to a V scale page (pages of state arrays compare by structure)
        shape = (heads, block_size) if name == "k_scale" else (heads, 1, block_size)
        page = OpaquePages(
            f"ATOM MhaKvPool {name} page (H {heads}, page {block_size}) of float32",
            False,
            (PageArray(0, shape, "float32", 0, (heads,), kv_heads=True),),
        )
        rows = [
            page_rows(f"{label}[{i}]", t, block_size, "ATOM's MhaKvPool", ShuffledPoolError)
            for i, t in enumerate(layers)
        ]
        pools[name] = listed_pages(rows, page, layers, block_size, EngineType.ATOM)
    return pools


def shuffled_kv_pools(
    k_caches: Any, v_caches: Any, block_size: int, k_scales: Any = None, v_scales: Any = None
) -> dict[str, Registration]:
    """ATOM's MHA/GQA pool in AITER's SHUFFLE layout: ``k_caches`` and ``v_caches``, its
    per-layer K ``[num_blocks, H, D // X, block_size, X]`` and V ``[num_blocks, H,
    block_size // X, D, X]`` tensors (``[c.k_cache for c in kv_caches.values()]`` and
    likewise ``v_cache``, as the connectors receive them), as one registration each,
    ``{"k": ..., "v": ...}``. ``block_size`` is ATOM's ``kv_cache_block_size``: K's axis
    3 and V's axis 2 times ``X`` must say it.

    Block ids are ATOM's block ids (axis 0), a block ``block_size`` tokens; a block moves
    whole (``num_tokens`` rounds up to whole blocks), only to a block of the same kind (K
    to K, V to V) of such a pool, ATOM's or SGLang's ``vectorized_5d`` one
    (:func:`kvlayout.integrations.sglang.vectorized_kv_pools`) of the same geometry and
    dtype. Ranks of two TP degrees, given ``src_shard`` and ``dst_shard``, move the heads
    both hold (kind ``resharded state``). Raises :class:`ShuffledPoolError` for lists that
    are not such a pool, the non-transposed V ``[num_blocks, H, D, block_size]`` included.

    ``k_scales`` and ``v_scales`` (both or neither): an fp8 pool's per-layer dequantization
    scales, ``[num_blocks, H, block_size]`` float32 (``KVCacheTensor.k_scale`` /
    ``v_scale``, which ATOM's Mooncake connector registers beside the cache), add
    ``"k_scale"`` and ``"v_scale"`` registrations: a block moves whole, K scales only to K
    scales, between TP degrees by heads as K and V do."""
    _refuse_plain_v(k_caches, v_caches)
    pools = shuffle_kv_pools(k_caches, v_caches, block_size, _ATOM)
    if k_scales is None and v_scales is None:
        return pools
    return pools | _scale_pools(k_scales, v_scales, list(k_caches), as_int(block_size, "block_size"))
