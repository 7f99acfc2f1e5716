"""AITER's SHUFFLE ("5-D vectorized") paged KV layout, read as registrations of opaque pages.

ROCm's AITER attention kernels read a paged MHA/GQA cache whose K layer is ``(num_blocks,
H, D // X, block, X)`` and whose V layer is ``(num_blocks, H, block // X, D_v, X)``, ``X =
16 // itemsize`` (8 for bf16 and fp16, 16 for one-byte types). Two engines allocate it:
SGLang under ``SGLANG_AITER_KV_CACHE_LAYOUT=vectorized_5d``
(:func:`kvlayout.integrations.sglang.vectorized_kv_pools`) and ATOM
(:func:`kvlayout.integrations.atom.shuffled_kv_pools`). Both keep one tensor per layer
for K and one for V, blocks outermost.

A token's K is split around the block's token axis (its head dim in ``D // X`` vectors of
``X``), and V's token axis around its head dim: no token-level format reads them, and K
and V differ. So each is read as a list of whole blocks, opaque: a layer's block is
viewed (no copy) as ``block`` int8 rows, the layers as a per-layer list in blocks of
``block`` rows, and marked (:func:`~kvlayout.registration.opaque.mark_opaque_pages`) with
what orders its bytes. The description names the layout, not the engine, so two engines'
pools of one geometry and dtype map to each other: they are the same AITER bytes. Each
page declares its heads as a TP-sharded array (K's ``[H, D // X, block * X]``, V's ``[H,
block // X, D_v, X]``; heads outermost), so a map between ranks of two TP degrees moves
the heads both hold. The two arrays have other ranks on purpose: a K page never maps to
a V page, even where ``D == block == D_v``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvlayout._generated.engines import EngineType
from kvlayout.detection.base import AITER_VECTOR_BYTES, DetectionError
from kvlayout.errors import as_int
from kvlayout.integrations.page_lists import dtype_name, layer_list, listed_pages, page_rows
from kvlayout.layout.dtypes import DTYPE_SIZES
from kvlayout.registration.opaque import OpaquePages, PageArray
from kvlayout.registration.registration import Registration

__all__ = ["VECTOR_BYTES", "ShuffleCaller", "shuffle_kv_pools"]

VECTOR_BYTES = AITER_VECTOR_BYTES
"""The bytes of the layout's innermost vector: ``X = 16 // itemsize`` elements."""


@dataclass(frozen=True)
class ShuffleCaller:
    """Whose lists these are, for error messages: the engine's names for them."""

    error: type[DetectionError]
    """Raised for lists that are not such a pool."""
    pool: str
    """The pool as the engine calls it, e.g. ``"SGLang vectorized_5d pool"``."""
    k_name: str
    v_name: str
    size_name: str
    """The block size's parameter name (``page_size``, ``block_size``)."""
    origin: str
    """Where the lists come from, e.g. ``"SGLang's MHATokenToKVPool.k_buffer"``."""
    allocator: str
    """Who allocates the blocks contiguously, e.g. ``"SGLang"``."""
    engine: EngineType
    """Whose cache the pools are: the registrations' label."""


def _layers(c: ShuffleCaller, name: str, buffers: Any) -> list[torch.Tensor]:
    layers = layer_list(name, buffers, c.origin, c.error)
    first = layers[0]
    if first.dim() != 5:
        raise c.error(
            f"{name}[0] is {list(first.shape)}, not 5-D: the {c.pool}'s K layer is (num_blocks, H, D // X, "
            f"{c.size_name}, X) and its V layer (num_blocks, H, {c.size_name} // X, D_v, X)"
        )
    if first.numel() == 0:  # no page to read (a view of 0 blocks cannot be re-viewed as rows)
        raise c.error(f"{name}[0] is {list(first.shape)}: it holds no elements, so no pages to read")
    return layers


def shuffle_kv_pools(
    k_layers: Any, v_layers: Any, block_size: int, caller: ShuffleCaller
) -> dict[str, Registration]:
    """Per-layer K and V lists in AITER's SHUFFLE layout as one registration each,
    ``{"k": ..., "v": ...}``: block ids index axis 0, a block moves whole, only to a block
    of the same kind (K to K, V to V) and geometry. ``caller`` names the engine's lists in
    errors (raised as ``caller.error``)."""
    c = caller
    ks, vs = _layers(c, c.k_name, k_layers), _layers(c, c.v_name, v_layers)
    k, v = ks[0], vs[0]
    if len(ks) != len(vs):
        raise c.error(f"{c.k_name} has {len(ks)} layers and {c.v_name} {len(vs)}: one per layer each")
    if (k.dtype, k.device) != (v.dtype, v.device):
        raise c.error(
            f"{c.k_name} is {k.dtype} on {k.device} and {c.v_name} {v.dtype} on {v.device}: one pool's "
            "expected"
        )
    dtype = dtype_name(k, "the pool's dtype", c.error)
    itemsize = DTYPE_SIZES[dtype]
    x = VECTOR_BYTES // itemsize
    blocks, heads, k_vectors, k_block, kx = (int(n) for n in k.shape)
    v_blocks, v_heads, v_vectors, v_head_dim, vx = (int(n) for n in v.shape)
    if (kx, vx) != (x, x):
        raise c.error(
            f"{c.k_name}[0] {list(k.shape)} and {c.v_name}[0] {list(v.shape)} end in {kx} and {vx}, not X = "
            f"{VECTOR_BYTES} // {itemsize} = {x} elements of {dtype}: not a {c.pool}"
        )
    if (v_blocks, v_heads, v_vectors * x) != (blocks, heads, k_block):
        raise c.error(
            f"{c.k_name}[0] is {list(k.shape)} (num_blocks, H, D // X, {c.size_name}, X) and {c.v_name}[0] "
            f"{list(v.shape)}, not (num_blocks, H, {c.size_name} // X, D_v, X) = ({blocks}, {heads}, "
            f"{k_block // x}, D_v, {x}): not one {c.pool}"
        )
    try:
        size = as_int(block_size, c.size_name)  # NumPy and torch integers too, never a bool
    except TypeError:
        size = -1
    if size != k_block:
        raise c.error(
            f"{c.size_name} is {block_size!r}, but {c.k_name}[0] {list(k.shape)} (num_blocks, H, D // X, "
            f"{c.size_name}, X) holds pages of {k_block} tokens: pass the pool's {c.size_name}, and "
            f"{c.k_name} before {c.v_name}"
        )
    block_size = size  # a plain int from here on
    head_dim = k_vectors * x
    arrays = {
        "k": PageArray(0, (heads, k_vectors, block_size * x), dtype, 0, (heads,), kv_heads=True),
        "v": PageArray(0, (heads, v_vectors, v_head_dim, x), dtype, 0, (heads,), kv_heads=True),
    }
    what = {
        "k": f"(H {heads}, D//X {k_vectors}, page {block_size}, X {x})",
        "v": f"(H {heads}, page//X {v_vectors}, D_v {v_head_dim}, X {x})",
    }
    pools = {}
    for name, layers, label in (("k", ks, c.k_name), ("v", vs, c.v_name)):
        page = OpaquePages(
            f"AITER SHUFFLE {name.upper()} page {what[name]} of {itemsize}-byte elements "
            f"(head_dim {head_dim}, v_head_dim {v_head_dim})",
            False,
            (arrays[name],),
        )
        rows = [page_rows(f"{label}[{i}]", t, block_size, c.allocator, c.error) for i, t in enumerate(layers)]
        pools[name] = listed_pages(rows, page, layers, block_size, c.engine)
    return pools
