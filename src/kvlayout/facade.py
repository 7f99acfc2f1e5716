"""The helper facade: everything a consumer asks about a normalized registration.

Every answer comes from the format's spec (``get_spec(kv, fmt)``), its layout or the
algebra; nothing here reads a raw shape axis, sniffs list nesting, lists formats, or
assembles pointers by hand. Detection (``normalize_kv_and_discover_format``) is the one
place a layout is resolved; pass its returned registration here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from kvlayout._generated.descriptors import PageBufferShapeDesc
from kvlayout._generated.formats import EngineKVFormat
from kvlayout.contiguity import attempt_permute_to_contiguous_view, dim0_padding
from kvlayout.detection.base import first_leaf
from kvlayout.detection.discovery import (
    normalize_and_discover_per_layer_formats,
    normalize_kv_and_discover_format,
)
from kvlayout.errors import KVLayoutError
from kvlayout.registry import FormatLike, as_format, get_spec, get_spec_class
from kvlayout.spec import KVFormatSpec, UndefinedSizeError
from kvlayout.types import DiscoverableKVCache

__all__ = [
    "EXCLUDED_ENGINE_GROUP",
    "LayerGroupIdentity",
    "attempt_permute_to_contiguous_view",
    "get_attention_backend",
    "get_block_size",
    "get_concrete_engine_kv_shape",
    "get_concrete_engine_kv_shape_from_shape_desc",
    "get_device",
    "get_dtype",
    "get_elements_per_layer",
    "get_engine_kv_shape_description",
    "get_group_data_ptrs",
    "get_head_size",
    "get_hidden_dim_size",
    "get_kv_size",
    "get_num_blocks",
    "get_num_heads",
    "get_num_layers",
    "get_page_buffer_size",
    "get_tokens_per_layer",
    "group_layers_by_identity",
    "is_mla",
    "make_page_buffer_shape_desc",
    "normalize_and_discover_per_layer_formats",
    "normalize_kv_and_discover_format",
    "resolve_block_stride_and_log_layout",
]

_log = logging.getLogger("kvlayout")

EXCLUDED_ENGINE_GROUP = -1
"""An engine group index that keeps a layer out of every kernel group."""


def _misfit(kv: Any, fmt: FormatLike, exc: Exception) -> KVLayoutError:
    """A spec that indexed past the registration: it is not in ``fmt``. (The facade
    trusts the pair detection returned; a wrong pair is caught only when it indexes out
    of range, so always pass detection's format with detection's registration.)"""
    name = as_format(fmt).name
    return KVLayoutError(f"the registration does not fit {name} (or the layer index is out of range): {exc}")


# -- geometry: thin delegations to the spec ------------------------------------------------


def get_num_layers(kv: DiscoverableKVCache, fmt: FormatLike) -> int:
    try:
        return get_spec(kv, fmt).num_layers()
    except (IndexError, AttributeError) as exc:
        raise _misfit(kv, fmt, exc) from None


def get_num_blocks(kv: DiscoverableKVCache, fmt: FormatLike, layer_idx: int = 0) -> int:
    """Blocks of the layer (raises ``UndefinedSizeError`` for NB*BS formats)."""
    try:
        return get_spec(kv, fmt).num_blocks(layer_idx)
    except (IndexError, AttributeError) as exc:
        raise _misfit(kv, fmt, exc) from None


def get_block_size(kv: DiscoverableKVCache, fmt: FormatLike, layer_idx: int = 0) -> int:
    """Token slots per block (raises ``UndefinedSizeError`` for NB*BS formats)."""
    try:
        return get_spec(kv, fmt).block_size(layer_idx)
    except (IndexError, AttributeError) as exc:
        raise _misfit(kv, fmt, exc) from None


def get_page_buffer_size(kv: DiscoverableKVCache, fmt: FormatLike, layer_idx: int = 0) -> int:
    """Token slots of the layer (NB*BS). LMCache uses it only in its legacy in-process
    connectors; kernels read a ``PageBufferShapeDesc``."""
    try:
        return get_spec(kv, fmt).page_buffer_size(layer_idx)
    except (IndexError, AttributeError) as exc:
        raise _misfit(kv, fmt, exc) from None


def get_kv_size(kv: DiscoverableKVCache, fmt: FormatLike) -> int:
    """Planes per token row in a chunk: 2 for split K/V, 1 for packed, MLA or single."""
    return get_spec(kv, fmt).kv_size()


def get_num_heads(kv: DiscoverableKVCache, fmt: FormatLike, layer_idx: int = 0) -> int:
    """KV heads of the layer (1 for MLA)."""
    try:
        return get_spec(kv, fmt).num_heads(layer_idx)
    except (IndexError, AttributeError) as exc:
        raise _misfit(kv, fmt, exc) from None


def get_head_size(kv: DiscoverableKVCache, fmt: FormatLike, layer_idx: int = 0) -> int:
    """Elements of one head's row in a chunk (the packed width for fused and MLA formats)."""
    try:
        return get_spec(kv, fmt).head_size(layer_idx)
    except (IndexError, AttributeError) as exc:
        raise _misfit(kv, fmt, exc) from None


def get_hidden_dim_size(kv: DiscoverableKVCache, fmt: FormatLike, layer_idx: int = 0) -> int:
    """Elements of one token row of one plane (``num_heads * head_size``)."""
    try:
        return get_spec(kv, fmt).hidden_dim(layer_idx)
    except (IndexError, AttributeError) as exc:
        raise _misfit(kv, fmt, exc) from None


def get_tokens_per_layer(kv: DiscoverableKVCache, fmt: FormatLike, layer_idx: int = 0) -> int:
    try:
        return get_spec(kv, fmt).tokens_per_layer(layer_idx)
    except (IndexError, AttributeError) as exc:
        raise _misfit(kv, fmt, exc) from None


def get_elements_per_layer(kv: DiscoverableKVCache, fmt: FormatLike, layer_idx: int = 0) -> int:
    """Content elements of one layer, K and V both, padding excluded."""
    try:
        return get_spec(kv, fmt).elements_per_layer(layer_idx)
    except (IndexError, AttributeError) as exc:
        raise _misfit(kv, fmt, exc) from None


def get_dtype(kv: DiscoverableKVCache, fmt: FormatLike, layer_idx: int = 0) -> torch.dtype:
    try:
        dtype = get_spec(kv, fmt).dtype(layer_idx)
    except (IndexError, AttributeError) as exc:
        raise _misfit(kv, fmt, exc) from None
    assert isinstance(dtype, torch.dtype)
    return dtype


def get_device(kv: DiscoverableKVCache) -> torch.device:
    """The device of the registration (detection checked that there is one)."""
    return first_leaf(kv).device


def is_mla(fmt: FormatLike) -> bool:
    return get_spec_class(fmt).is_mla


# -- diagnostics: strings, never raising for an unknown format -------------------------------


def _unknown(fmt: object) -> str:
    return f"Unknown ({fmt.name if isinstance(fmt, EngineKVFormat) else fmt})"


def get_attention_backend(fmt: FormatLike) -> str:
    """The first attention backend known to produce the format (a log label only)."""
    try:
        backends = get_spec_class(fmt).attention_backends
    except KVLayoutError:
        return _unknown(fmt)
    return backends[0] if backends else _unknown(fmt)


def get_engine_kv_shape_description(fmt: FormatLike) -> str:
    """``NL x [2, NB, BS, NH, HS]``."""
    try:
        return get_spec_class(fmt).describe_shape()
    except KVLayoutError:
        return _unknown(fmt)


def get_concrete_engine_kv_shape(kv: DiscoverableKVCache, fmt: FormatLike) -> str:
    """``32 x [2, 2048, 16, 8, 128]``; ``Unknown (<fmt>)`` for an unknown format or a
    registration that does not fit it."""
    try:
        return get_spec(kv, fmt).concrete_shape_str()
    except (KVLayoutError, IndexError, AttributeError, TypeError):
        return _unknown(fmt)


def get_concrete_engine_kv_shape_from_shape_desc(shape_desc: PageBufferShapeDesc, fmt: FormatLike) -> str:
    """The group's shape from its descriptor, for every format: the row token (HS, CS or
    a blocked-scale page) shows the descriptor's row width with packed factors divided
    out, so fused (CS) and blocked-scale formats render with numbers where LMCache 0.5.6
    prints ``Unknown``."""
    try:
        cls = get_spec_class(fmt)
        sizes = {"NL": shape_desc.nl, "NB": shape_desc.nb, "BS": shape_desc.bs, "NH": shape_desc.nh}
        if cls.row_symbol is not None:
            sizes[cls.row_symbol] = shape_desc.hs // cls.row_divisor
        return cls.layout.concrete_shape(sizes)
    except KVLayoutError:
        return _unknown(fmt)


# -- pointers and descriptors ------------------------------------------------------------------


def get_group_data_ptrs(kv: DiscoverableKVCache, fmt: FormatLike, layer_indices: Sequence[int]) -> list[int]:
    """The group's pointer table in kernel order: one per layer; ``[K..., V...]`` for
    K/V lists; each layer's tuple in turn for tuple formats; one base for cross-layer."""
    try:
        return get_spec(kv, fmt).data_ptrs(layer_indices)
    except (IndexError, AttributeError) as exc:
        raise _misfit(kv, fmt, exc) from None


def _layer_tensors(kv: Any, spec: KVFormatSpec, layer_idx: int) -> list[torch.Tensor]:
    """The tensors holding one layer, found by walking the layout's pointer order."""
    out = []
    for path in spec.layout.pointer_order(spec.sizes(layer_idx), [layer_idx]):
        node = kv
        for i in path:
            node = node[i]
        out.append(node)
    return out


def make_page_buffer_shape_desc(
    kv: DiscoverableKVCache,
    fmt: FormatLike,
    layer_idx: int,
    num_layers_in_group: int,
    num_blocks: int,
    block_size: int,
    block_stride_elems: int | None = None,
) -> PageBufferShapeDesc:
    """The kernel-facing geometry of a group whose first layer is ``layer_idx``.

    ``num_blocks`` and ``block_size`` come from the caller (so NB*BS formats work when
    the caller knows them); ``block_stride_elems`` is ``tensor.stride(0)`` verbatim as
    ``resolve_block_stride_and_log_layout`` returns it (None or 0: tightly packed). A
    block stride on a format whose dim 0 is not the block axis, or narrower than a
    block, is an error here rather than a wrong transfer later.
    """
    nl = _count("num_layers_in_group", num_layers_in_group, minimum=1)
    nb = _count("num_blocks", num_blocks, minimum=0)
    bs = _count("block_size", block_size, minimum=1)
    stride = 0 if block_stride_elems is None else _count("block_stride_elems", block_stride_elems, minimum=0)
    spec = get_spec(kv, fmt)
    try:
        dtype = spec.dtype(layer_idx)
        assert isinstance(dtype, torch.dtype)
        nh, hs = spec.num_heads(layer_idx), spec.head_size(layer_idx)
        if stride:
            spec.layout.tensor_strides(spec.sizes(layer_idx), stride)  # raises if it cannot apply
    except (IndexError, AttributeError) as exc:
        raise _misfit(kv, fmt, exc) from None
    return PageBufferShapeDesc(spec.kv_size(), nl, nb, bs, nh, hs, dtype.itemsize, stride)


def _count(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < minimum:
        raise KVLayoutError(f"{name} must be >= {minimum}, got {value}")
    return value


def resolve_block_stride_and_log_layout(
    kv: DiscoverableKVCache, fmt: FormatLike, layer_idx: int, group_idx: int
) -> int | None:
    """The group's ``block_stride_elems``: ``stride(0)`` of the layer's first tensor when
    the layout's dim 0 is the block axis (tight for compact caches, wider for padded
    pools and blocks-first views); None otherwise, where dim-0 padding is an error.

    Which formats may carry padding comes from the layout (``has_leading_block_axis``):
    every format whose dim 0 is NB, a superset of LMCache 0.5.6's hand list
    {3, 14, 17, 12, 13, 18} that adds the cross-layer formats (0, 8), flash-infer (2, 7),
    SGLang's un-folded K/V lists (9) and the (K, V) tuples (16): kvlayout's transfer
    addresses dim 0 through the algebra, whose block stride is dim 0's stride verbatim
    for any such layout. Tensors of one layer with equal shapes (K and V) must agree on
    it. Logs one INFO audit line; logging never raises.
    """
    spec = get_spec(kv, fmt)
    try:
        tensors = _layer_tensors(kv, spec, layer_idx)
    except (IndexError, AttributeError) as exc:
        raise _misfit(kv, fmt, exc) from None
    probe = tensors[0]
    padding = dim0_padding(probe)
    _audit(group_idx, layer_idx, probe, padding)
    if spec.has_leading_block_axis:
        stride = int(probe.stride(0))
        for t in tensors[1:]:
            if t.shape == probe.shape and dim0_padding(t) != padding:
                raise KVLayoutError(
                    f"group {group_idx}: layer {layer_idx}'s tensors of shape {tuple(t.shape)} have dim-0 "
                    f"strides {probe.stride(0)} and {t.stride(0)}; one group has one block stride"
                )
        return stride
    for t in tensors:
        extra = dim0_padding(t)
        if extra:
            raise KVLayoutError(
                f"group {group_idx}: layer {layer_idx} has dim-0 padding ({extra} elements per dim-0 row; "
                f"shape {tuple(t.shape)}, stride {t.stride()}), but dim 0 of {spec.engine_kv_format.name} "
                "is not its block axis, so no block stride can describe it; transfers would misread it"
            )
    return None


def _audit(group_idx: int, layer_idx: int, t: torch.Tensor, padding: int) -> None:
    try:
        if _log.isEnabledFor(logging.INFO):
            _log.info(
                "Group %d first-layer tensor: layer_idx=%d shape=%s stride=%s is_contiguous=%s dtype=%s "
                "device=%s storage_offset=%d numel=%d padding_per_block=%d",
                group_idx, layer_idx, tuple(t.shape), t.stride(), t.is_contiguous(), t.dtype,
                t.device, t.storage_offset(), t.numel(), padding,
            )  # fmt: skip
    except Exception:  # an audit line must never break registration
        pass


# -- grouping ----------------------------------------------------------------------------------


class LayerGroupIdentity(NamedTuple):
    """What layers must share to be moved by one kernel group.

    The first seven fields are LMCache's ``KernelGroupIdentity`` in its order.
    ``block_size`` is None for formats that fold NB*BS (they have no block size of their
    own; LMCache raises there). ``block_stride_elems`` (dim 0's stride where dim 0 is the
    block axis, else None) is kvlayout's addition: a group has one block stride, so
    layers from pools with different padding must not share one.
    """

    kv_size: int
    num_heads: int
    head_size: int
    block_size: int | None
    engine_group_idx: int
    dtype: torch.dtype
    engine_kv_format: EngineKVFormat
    block_stride_elems: int | None


def group_layers_by_identity(
    kv: DiscoverableKVCache,
    formats: Sequence[FormatLike | None],
    per_layer_engine_group_idx: Sequence[int] | None = None,
) -> list[tuple[LayerGroupIdentity, list[int]]]:
    """Layers bucketed by identity, each layer read in its own format, in order of first
    layer. Layers in ``EXCLUDED_ENGINE_GROUP`` (-1) are skipped, and so are layers whose
    format is None (in no detection group) unless an engine group claims them (an error).
    Works for every format: cross-layer and K/V-list registrations are read per layer
    through their spec, and NB*BS formats get ``block_size=None``.
    """
    n = len(formats)
    if per_layer_engine_group_idx is not None and len(per_layer_engine_group_idx) != n:
        raise KVLayoutError(
            f"per_layer_engine_group_idx has {len(per_layer_engine_group_idx)} entries but "
            f"engine_kv_formats has {n} layers"
        )
    groups: dict[LayerGroupIdentity, list[int]] = {}
    checked = False
    for i, fmt in enumerate(formats):
        group = 0 if per_layer_engine_group_idx is None else per_layer_engine_group_idx[i]
        if isinstance(group, bool) or not isinstance(group, int):
            raise TypeError(f"per_layer_engine_group_idx[{i}] is {group!r}, not an int")
        if group == EXCLUDED_ENGINE_GROUP:
            continue
        if fmt is None:
            if per_layer_engine_group_idx is not None:
                raise KVLayoutError(
                    f"layer {i} has no format (it was in no detection group) but "
                    f"per_layer_engine_group_idx puts it in engine group {group}"
                )
            continue
        spec = get_spec(kv, fmt)
        if not checked:
            if spec.num_layers() != n:
                raise KVLayoutError(
                    f"engine_kv_formats has {n} layers but the registration has {spec.num_layers()} "
                    f"({as_format(fmt).name})"
                )
            checked = True
        groups.setdefault(_identity(kv, spec, i, group), []).append(i)
    return list(groups.items())


def _identity(kv: Any, spec: KVFormatSpec, layer: int, group: int) -> LayerGroupIdentity:
    try:
        try:
            block_size: int | None = spec.block_size(layer)
        except UndefinedSizeError:
            block_size = None
        dtype = spec.dtype(layer)
        assert isinstance(dtype, torch.dtype)
        stride = int(_layer_tensors(kv, spec, layer)[0].stride(0)) if spec.has_leading_block_axis else None
        return LayerGroupIdentity(
            spec.kv_size(), spec.num_heads(layer), spec.head_size(layer), block_size, group, dtype,
            spec.engine_kv_format, stride,
        )  # fmt: skip
    except (IndexError, AttributeError) as exc:
        raise _misfit(kv, spec.engine_kv_format, exc) from None
