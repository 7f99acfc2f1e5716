"""ATOM's MHA/GQA KV pool (AITER SHUFFLE layout) as registrations of opaque pages, K and V.

ATOM's ``MhaKvPool`` (``atom/model_ops/attentions/mha_kv_pool.py``, ``mha_kv_fields``)
declares one block of a layer as K ``(H, D // X, block_size, X)`` and V ``(H,
block_size // X, D, X)``, ``X = 16 // kv_dtype.itemsize`` (8 for bf16, 16 for fp8), and
refuses a ``head_dim`` or ``block_size`` that ``X`` does not divide. Its layer-major arena
(``pool_layout/entry_arena.py``, ``LayerMajorArena``) puts every layer's K, then every
layer's V, each layer's ``[num_blocks, ...]`` slice contiguous; the fp8 dequantization
scales are a separate region, not part of ``k_cache`` / ``v_cache``. The connectors
(e.g. ``kv_transfer/disaggregation/moriio/moriio_connector.py``) take each layer's
``KVCacheTensor.k_cache`` and ``v_cache`` and address a block as an index of axis 0.

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
from kvlayout.detection.base import DetectionError
from kvlayout.integrations.aiter_shuffle import ShuffleCaller, shuffle_kv_pools
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


def shuffled_kv_pools(k_caches: Any, v_caches: Any, block_size: int) -> dict[str, Registration]:
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
    are not such a pool, the non-transposed V ``[num_blocks, H, D, block_size]`` included."""
    _refuse_plain_v(k_caches, v_caches)
    return shuffle_kv_pools(k_caches, v_caches, block_size, _ATOM)
