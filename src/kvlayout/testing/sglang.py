"""SGLang's Mamba state pools as SGLang allocates them, for tests, docs and the demo.

The shapes follow SGLang's sizing (``configs/mamba_utils.py``: ``Mamba2StateShape``,
``KimiLinearStateShape``): its device pool (``MambaPool``: ``[NL, size + 1, *state]``),
its unified memory pool's strided views over per-slot envelopes, and its HiCache host
pool (``MambaPoolHost``: ``[NL, size, *state]`` or ``[size, NL, 1, *state]``), and
kvcached's ``ElasticMambaPool`` in either of its layouts; and the ROCm AITER KV pool
(``SGLANG_AITER_KV_CACHE_LAYOUT=vectorized_5d``: :func:`vectorized_kv_pool`) and the MXFP8
KV pool with its UE8M0 scale buffers (``MHATokenToKVPoolMXFP8``: :func:`mxfp8_kv_pool`). The
pools are duck-typed stand-ins with the attributes kvlayout reads; SGLang itself is not
needed. :func:`shard` is the oracle: a rank's slices of the whole model's state, each
sub-projection split on its own, as SGLang shards the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

__all__ = [
    "QWEN3_NEXT",
    "LinearModel",
    "device_pool",
    "elastic_mamba_pool",
    "fp4_kv_pool",
    "host_pool",
    "mxfp8_kv_pool",
    "shard",
    "unified_device_pool",
    "vectorized_kv_pool",
]


@dataclass(frozen=True)
class LinearModel:
    """A model's linear-attention state sizes, whole (TP 1). ``num_heads``: SSM heads
    (GDN's and KDA's value heads); ``state_size``: Mamba2's ``d_state``, GDN's and KDA's
    key head size; ``n_groups``: Mamba2's groups, GDN's and KDA's key heads."""

    mamba_type: str  # "mamba2", "gdn_attn" or "kda"
    num_layers: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int = 4
    fused: bool = False  # KDA's three conv states as one (SGLang's newer ``KimiLinearStateShape``)

    def conv_parts(self, tp: int) -> list[tuple[int, ...]]:
        """Each conv state's sub-projection lengths at TP ``tp``, in SGLang's channel order."""
        groups = self.n_groups if self.n_groups % tp == 0 else tp  # SGLang replicates the groups
        values, keys = self.num_heads * self.head_dim // tp, groups * self.state_size // tp
        if self.mamba_type == "mamba2":
            return [(values, keys, keys)]  # x, B, C
        if self.mamba_type == "gdn_attn":
            return [(keys, keys, values)]  # Q, K, V
        return [(values, keys, keys)] if self.fused else [(values,), (keys,), (keys,)]  # KDA

    def state_shapes(self, tp: int) -> tuple[list[tuple[int, int]], tuple[int, int, int]]:
        """The conv states' and the SSM state's shapes at TP ``tp``, as SGLang sizes them."""
        rows = self.conv_kernel - 1
        if self.mamba_type == "kda":
            convs = [(rows, sum(parts)) for parts in self.conv_parts(tp)]  # (K - 1, proj / tp)
            return convs, (self.num_heads // tp, self.head_dim, self.head_dim)
        return [(sum(self.conv_parts(tp)[0]), rows)], (self.num_heads // tp, self.head_dim, self.state_size)


QWEN3_NEXT = LinearModel("gdn_attn", num_layers=36, num_heads=32, head_dim=128, state_size=128, n_groups=16)
"""Qwen3-Next-80B-A3B's Gated DeltaNet layers (32 value heads, 16 key heads, 128 each)."""


def _fill(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator | None) -> torch.Tensor:
    if generator is None:
        return torch.zeros(shape, dtype=dtype)
    return torch.randn(shape, generator=generator).to(dtype)


def device_pool(
    model: LinearModel,
    tp: int,
    size: int,
    *,
    conv_dtype: torch.dtype = torch.bfloat16,
    ssm_dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
) -> Any:
    """SGLang's ``MambaPool`` for ``size`` requests at TP ``tp`` (slot 0 the padding's):
    zeros, or random values from ``generator``."""
    convs, temporal = model.state_shapes(tp)
    lead = (model.num_layers, size + 1)
    cache = SimpleNamespace(
        conv=[_fill(lead + c, conv_dtype, generator) for c in convs],
        temporal=_fill(lead + temporal, ssm_dtype, generator),
    )
    return SimpleNamespace(mamba_cache=cache, num_mamba_layers=model.num_layers, size=size)


def unified_device_pool(
    model: LinearModel,
    tp: int,
    slots: int | None,
    *,
    pad: int = 0,
    conv_dtype: torch.dtype = torch.bfloat16,
    ssm_dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
    raw: torch.Tensor | None = None,
) -> Any:
    """The Mamba views of SGLang's unified memory pool (``layout/page_major.py``): one
    byte buffer of ``slots`` envelopes, each every layer of conv state 0 (1, 2), then every
    layer of the SSM state, then ``pad`` bytes (other states of the envelope, random
    where ``generator`` is given), the states ``[NL, slots, *state]`` strided views over
    it, a slot's envelope apart. ``raw`` is the buffer: given (a uint8 buffer the KV
    sub-pool's views share, ``UnifiedKVPool._raw``), the views cover as many envelopes as
    it holds (``max_slots``; ``slots`` None) and its bytes are left as they are."""
    convs, temporal = model.state_shapes(tp)
    layers = model.num_layers
    shapes = [(c, conv_dtype) for c in convs] + [(temporal, ssm_dtype)]
    items = [math.prod(shape) * dtype.itemsize for shape, dtype in shapes]
    entry = layers * sum(items) + pad
    shared = raw is not None
    if raw is None:
        if slots is None:
            raise ValueError("slots: the envelopes of the pool's own buffer (None only with raw)")
        raw = torch.zeros(slots * entry, dtype=torch.uint8)
        if generator is not None:
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    else:
        if slots is not None or raw.dtype != torch.uint8 or raw.dim() != 1:
            raise ValueError(
                f"raw: a 1-D uint8 buffer whose envelopes the views cover, slots None (got {raw.dtype} "
                f"{list(raw.shape)}, slots {slots})"
            )
        slots = raw.numel() // entry
    views, offset = [], 0
    for (shape, dtype), item in zip(shapes, items, strict=True):
        strides = torch.empty(shape).stride()
        view = torch.as_strided(
            raw.view(dtype),
            (layers, slots, *shape),
            (item // dtype.itemsize, entry // dtype.itemsize, *strides),
            offset // dtype.itemsize,
        )
        if not shared:
            view.copy_(_fill(view.shape, dtype, generator))
        views.append(view)
        offset += layers * item
    cache = SimpleNamespace(conv=views[:-1], temporal=views[-1])
    return SimpleNamespace(mamba_cache=cache, num_mamba_layers=layers, size=slots - 1, raw=raw)


class PerLayerMambaState:
    """kvcached's ``_PerLayerMambaState``: ``conv_per_layer[i][layer]`` and
    ``temporal_per_layer[layer]``, each ``[size + 1, *state]``; ``conv`` and ``temporal``
    are layer 0's alone (what SGLang's attention backends read a state's shape from)."""

    def __init__(
        self, conv_per_layer: list[list[torch.Tensor]], temporal_per_layer: list[torch.Tensor]
    ) -> None:
        self.conv_per_layer = conv_per_layer
        self.temporal_per_layer = temporal_per_layer

    @property
    def conv(self) -> list[torch.Tensor]:
        return [c[0] for c in self.conv_per_layer]

    @property
    def temporal(self) -> torch.Tensor:
        return self.temporal_per_layer[0]


def elastic_mamba_pool(
    model: LinearModel,
    tp: int,
    size: int,
    *,
    contiguous: bool,
    pad: int = 0,
    conv_dtype: torch.dtype = torch.bfloat16,
    ssm_dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
) -> Any:
    """kvcached's ``ElasticMambaPool`` for ``size`` requests at TP ``tp``, as kvcached
    allocates it (ovg-project/kvcached ``kvcached/integration/sglang/interfaces.py``,
    ``alloc_mamba_states``; ``kvcached/integration/sglang/patches.py``,
    ``ElasticMambaPoolPatch``): ``size + 1`` slots (slot 0 the padding's, kvcached's null
    block), each slot of each layer one cell of every state, ``[conv0 | conv1 | ... |
    temporal]``, each at its dtype's alignment, the cell padded by ``pad`` bytes (kvcached
    pads it to a divisor of its page size). ``contiguous``: one buffer ``[slot][layer]
    [cell]`` and ``mamba_cache.conv[i]``, ``.temporal`` ``[NL, size + 1, *state]`` views
    strided over it (``KVCACHED_CONTIGUOUS_LAYOUT``); otherwise a buffer per layer
    ``[slot][cell]`` and ``mamba_cache`` a :class:`PerLayerMambaState` of
    ``[size + 1, *state]`` views. ``raw`` is the list of byte buffers; zeros, or random
    bytes (padding included) from ``generator``."""
    convs, temporal = model.state_shapes(tp)
    layers, slots = model.num_layers, size + 1
    shapes = [(c, conv_dtype) for c in convs] + [(temporal, ssm_dtype)]
    offsets, offset = [], 0
    for shape, dtype in shapes:
        offset = -(-offset // dtype.itemsize) * dtype.itemsize
        offsets.append(offset)
        offset += math.prod(shape) * dtype.itemsize
    align = max(conv_dtype.itemsize, ssm_dtype.itemsize)
    cell = -(-(offset + pad) // align) * align
    buffers = 1 if contiguous else layers
    raw = [
        torch.zeros(slots * cell * (layers if contiguous else 1), dtype=torch.uint8) for _ in range(buffers)
    ]
    if generator is not None:
        for r in raw:
            r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=generator))

    def view(buffer: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, at: int) -> torch.Tensor:
        lead = ((layers, slots), (cell, layers * cell)) if contiguous else ((slots,), (cell,))
        strides = [n // dtype.itemsize for n in lead[1]] + list(torch.empty(shape).stride())
        t = torch.as_strided(buffer.view(dtype), (*lead[0], *shape), strides, at // dtype.itemsize)
        t.copy_(_fill(t.shape, dtype, generator))
        return t

    if contiguous:
        states = [view(raw[0], shape, dtype, at) for (shape, dtype), at in zip(shapes, offsets, strict=True)]
        cache: Any = SimpleNamespace(conv=states[:-1], temporal=states[-1])
    else:
        per_layer = [
            [view(r, shape, dtype, at) for r in raw]
            for (shape, dtype), at in zip(shapes, offsets, strict=True)
        ]
        cache = PerLayerMambaState(per_layer[:-1], per_layer[-1])
    return SimpleNamespace(
        mamba_cache=cache, num_mamba_layers=layers, mamba_layer_ids=list(range(layers)), size=size, raw=raw
    )


def host_pool(device: Any, size: int, layout: str) -> Any:
    """HiCache's ``MambaPoolHost`` of ``size`` slots beside ``device``, zeros."""
    states = [*device.mamba_cache.conv, device.mamba_cache.temporal]
    layers = device.num_mamba_layers
    buffers = [
        torch.zeros(
            ((layers, size) if layout == "layer_first" else (size, layers, 1)) + tuple(t.shape[2:]),
            dtype=t.dtype,
        )
        for t in states
    ]
    return SimpleNamespace(conv_buffer=buffers[:-1], temporal_buffer=buffers[-1], layout=layout, page_size=1)


def shard(model: LinearModel, whole: list[torch.Tensor], tp: int, rank: int) -> list[torch.Tensor]:
    """Rank ``rank`` of ``tp``'s slices of ``whole`` (a TP 1 pool's states, conv states
    then the SSM state, ``[NL, slots, *state]``): each sub-projection split on its own,
    the SSM state by heads."""
    axes = [3 if model.mamba_type == "kda" else 2] * (len(whole) - 1) + [2]
    parts = [*model.conv_parts(1), (model.num_heads,)]
    out = []
    for t, axis, lengths in zip(whole, axes, parts, strict=True):
        pieces, start = [], 0
        for n in lengths:
            pieces.append(t.narrow(axis, start + rank * (n // tp), n // tp))
            start += n
        out.append(torch.cat(pieces, axis))
    return out


def vectorized_kv_pool(
    num_layers: int,
    size: int,
    head_num: int,
    head_dim: int,
    v_head_dim: int | None = None,
    *,
    page_size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    generator: torch.Generator | None = None,
) -> Any:
    """SGLang's ``MHATokenToKVPool`` under ``SGLANG_AITER_KV_CACHE_LAYOUT=vectorized_5d``
    (``_create_buffers_normal``), for ``size`` tokens and one rank's ``head_num`` KV heads:
    ``k_buffer[l]`` ``(num_blocks, H, D // X, page_size, X)``, ``v_buffer[l]``
    ``(num_blocks, H, page_size // X, D_v, X)``, ``num_blocks = (size + page_size) //
    page_size``, ``X = 16 // store_dtype.itemsize``; fp8 stored as uint8, as SGLang stores
    it. Zeros, or random bytes from ``generator``."""
    fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    store = torch.uint8 if fp8 else dtype
    x = 16 // store.itemsize
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    if (size + page_size) % page_size or page_size % x or head_dim % x or v_head_dim % x:
        raise ValueError(
            f"size + page_size, page_size and head dims must be multiples of page_size and X={x}"
        )
    blocks = (size + page_size) // page_size
    shapes = (
        (blocks, head_num, head_dim // x, page_size, x),
        (blocks, head_num, page_size // x, v_head_dim, x),
    )

    def make(shape: tuple[int, ...]) -> torch.Tensor:
        if generator is None:
            return torch.zeros(shape, dtype=store)
        if store.is_floating_point:
            return torch.randn(shape, generator=generator).to(store)
        return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)

    return SimpleNamespace(
        k_buffer=[make(shapes[0]) for _ in range(num_layers)],
        v_buffer=[make(shapes[1]) for _ in range(num_layers)],
        page_size=page_size,
        head_num=head_num,
        dtype=dtype,
        store_dtype=store,
    )


def mxfp8_kv_pool(
    num_layers: int,
    size: int,
    head_num: int,
    head_dim: int,
    v_head_dim: int | None = None,
    *,
    page_size: int = 128,
    generator: torch.Generator | None = None,
) -> Any:
    """SGLang's ``MHATokenToKVPoolMXFP8`` (``_create_buffers``) for ``size`` tokens and one
    rank's ``head_num`` KV heads: ``k_buffer[l]`` float8_e4m3fn ``(size + page_size, H,
    D)``, ``v_buffer[l]`` ``(size + page_size, H, D_v)``, and UE8M0 (float8_e8m0fnu)
    ``k_scale_buffer[l]`` / ``v_scale_buffer[l]``, one scale per 32 elements: at
    ``page_size == 128`` interleaved ``(pages, H, 32, page_size // 32, D // 32)``
    (``mxfp8_sf_interleaved``), otherwise flat ``(size + page_size, H, D // 32)``. Zeros,
    or random bytes from ``generator``."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    if head_dim % 32 or v_head_dim % 32 or size % page_size:
        raise ValueError("head dims must be multiples of 32 and size a multiple of page_size")
    slots = size + page_size
    interleaved = page_size == 128

    def scales(dim: int) -> tuple[int, ...]:
        if interleaved:
            return (slots // page_size, head_num, 32, page_size // 32, dim // 32)
        return (slots, head_num, dim // 32)

    def make(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if generator is None:
            return torch.zeros(shape, dtype=dtype)
        return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8).view(dtype)

    fp8, e8m0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
    return SimpleNamespace(
        k_buffer=[make((slots, head_num, head_dim), fp8) for _ in range(num_layers)],
        v_buffer=[make((slots, head_num, v_head_dim), fp8) for _ in range(num_layers)],
        k_scale_buffer=[make(scales(head_dim), e8m0) for _ in range(num_layers)],
        v_scale_buffer=[make(scales(v_head_dim), e8m0) for _ in range(num_layers)],
        page_size=page_size,
        head_num=head_num,
        mxfp8_sf_interleaved=interleaved,
    )


def fp4_kv_pool(
    num_layers: int,
    size: int,
    head_num: int,
    head_dim: int,
    *,
    page_size: int,
    scales: str = "linear",
    generator: torch.Generator | None = None,
) -> Any:
    """SGLang's FP4 MHA pool (``NVFP4KVCacheMethod.create_buffers`` /
    ``FP4MXBlock16KVCacheMethod.create_buffers``) for ``size`` tokens and one rank's
    ``head_num`` KV heads, all uint8: ``k_buffer[l]`` / ``v_buffer[l]`` packed e2m1 pairs
    ``(size + page_size, H, D // 2)`` and their scales, one byte per 16 elements (``sf = D //
    16``), in the layout ``scales`` names: ``"linear"`` ``k_scale_buffer[l]`` ``(size +
    page_size, H, sf)`` (NVFP4's), ``"flat"`` ``(size + page_size, H * sf)``
    (``fp4_mx_block16``'s), ``"native"`` ``native_k_scale_buffer[l]`` ``((size + page_size)
    // page_size, H, page_size, sf)`` (TRT-LLM's, the linear buffers then None). Zeros, or
    random bytes from ``generator``."""
    if head_dim % 16 or size % page_size or scales not in ("linear", "flat", "native"):
        raise ValueError(
            "head_dim must be a multiple of 16, size of page_size; scales linear, flat or native"
        )
    slots, sf = size + page_size, head_dim // 16
    shape = {
        "linear": (slots, head_num, sf),
        "flat": (slots, head_num * sf),
        "native": (slots // page_size, head_num, page_size, sf),
    }[scales]

    def make(shape: tuple[int, ...]) -> torch.Tensor:
        if generator is None:
            return torch.zeros(shape, dtype=torch.uint8)
        return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)

    def layers(shape: tuple[int, ...]) -> list[torch.Tensor]:
        return [make(shape) for _ in range(num_layers)]

    native = scales == "native"
    return SimpleNamespace(
        k_buffer=layers((slots, head_num, head_dim // 2)),
        v_buffer=layers((slots, head_num, head_dim // 2)),
        k_scale_buffer=None if native else layers(shape),
        v_scale_buffer=None if native else layers(shape),
        native_k_scale_buffer=layers(shape) if native else None,
        native_v_scale_buffer=layers(shape) if native else None,
        page_size=page_size,
        head_num=head_num,
        head_dim=head_dim,
    )
