"""The helper facade: everything a consumer asks about a normalized registration.

Every answer comes from the bound registration (:func:`kvlayout.registration.registration.bound`),
its layout or the algebra; nothing here reads a raw shape axis, sniffs list nesting,
lists formats, or assembles pointers by hand. Pass what detection
(``normalize_kv_and_discover_format``) returned: it carries its registration, so an
answer costs well under a microsecond. Any other form (the engine's own list) is bound
and checked in full on every call, which costs about as much as a detection.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeAlias, overload

import numpy as np
import torch

from kvlayout._generated.descriptors import DESCRIPTOR_ROLES, PageBufferShapeDesc
from kvlayout._generated.formats import EngineKVFormat
from kvlayout._generated.predicates import is_mla  # LMCache names it here too
from kvlayout.catalog.registry import FormatLike, backend_label, get_spec_class
from kvlayout.detection.discovery import (
    extract_kv_cache_shapes,
    normalize_and_discover_per_layer_formats,
    normalize_kv_and_discover_format,
)
from kvlayout.errors import KVLayoutError, as_int
from kvlayout.layout import algebra
from kvlayout.layout.vocabulary import Role
from kvlayout.registration.contiguity import attempt_permute_to_contiguous_view, dim0_padding
from kvlayout.registration.kernel_groups import EXCLUDED_ENGINE_GROUP, KernelGroup, LayerGroupIdentity
from kvlayout.registration.nesting import LocatedError, entry_keys, first_leaf, not_strided
from kvlayout.registration.registration import RegisteredKV, Registration, bound, bound_per_layer
from kvlayout.types import DiscoverableKVCache, EngineLike, as_engine

__all__ = [
    "EXCLUDED_ENGINE_GROUP",
    "LayerGroupIdentity",
    "attempt_permute_to_contiguous_view",
    "extract_kv_cache_shapes",
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
    "get_shape_and_dtype",
    "get_tokens_per_layer",
    "group_layers_by_identity",
    "is_mla",
    "make_page_buffer_shape_desc",
    "normalize_and_discover_per_layer_formats",
    "normalize_kv_and_discover_format",
    "resolve_block_stride_and_log_layout",
]

_log = logging.getLogger("kvlayout")

BoundKV: TypeAlias = DiscoverableKVCache | Registration
"""What the accessors read: a registration's tensors (bound now, or the detection they
came from) or the :class:`Registration` ``kvlayout.detect`` returns."""

ShapeAndDtype: TypeAlias = tuple[tuple[int, ...], torch.dtype]
"""A tensor's structure key: its shape as registered and its dtype."""


def _group(kv: Any, fmt: FormatLike, layer_idx: int) -> KernelGroup:
    """The kernel group of a layer read in ``fmt``: detection's registration when ``kv``
    is what detection returned, else ``kv`` bound now (checked in full)."""
    return bound(kv, fmt).group(layer_idx, fmt)


# -- geometry: read from the bound registration --------------------------------------------


def get_num_layers(kv: BoundKV, fmt: FormatLike) -> int:
    return bound(kv, fmt).num_layers


def get_num_blocks(kv: BoundKV, fmt: FormatLike, layer_idx: int = 0) -> int:
    """Blocks of the layer (raises ``UndefinedSizeError`` for NB*BS formats)."""
    return _group(kv, fmt, layer_idx).num_blocks


def get_block_size(kv: BoundKV, fmt: FormatLike, layer_idx: int = 0) -> int:
    """Token slots per block (raises ``UndefinedSizeError`` for NB*BS formats)."""
    return _group(kv, fmt, layer_idx).block_size


def get_page_buffer_size(kv: BoundKV, fmt: FormatLike, layer_idx: int = 0) -> int:
    """Token slots of the layer (NB*BS). LMCache uses it only in its legacy in-process
    connectors; kernels read a ``PageBufferShapeDesc``."""
    return _group(kv, fmt, layer_idx).geometry.page_buffer_size


def get_kv_size(kv: BoundKV, fmt: FormatLike) -> int:
    """Planes per token row in a chunk: 2 for split K/V, 1 for packed, MLA or single."""
    return bound(kv, fmt).first_group(fmt).geometry.kv_size


def get_num_heads(kv: BoundKV, fmt: FormatLike, layer_idx: int = 0) -> int:
    """KV heads of the layer (1 for MLA)."""
    return _group(kv, fmt, layer_idx).geometry.num_heads


def get_head_size(kv: BoundKV, fmt: FormatLike, layer_idx: int = 0) -> int:
    """Elements of one head's row in a chunk (the packed width for fused and MLA formats)."""
    return _group(kv, fmt, layer_idx).geometry.head_size


def get_hidden_dim_size(kv: BoundKV, fmt: FormatLike, layer_idx: int = 0) -> int:
    """Elements of one token row of one plane (``num_heads * head_size``)."""
    return _group(kv, fmt, layer_idx).geometry.hidden_dim


def get_tokens_per_layer(kv: BoundKV, fmt: FormatLike, layer_idx: int = 0) -> int:
    return _group(kv, fmt, layer_idx).geometry.page_buffer_size


def get_elements_per_layer(kv: BoundKV, fmt: FormatLike, layer_idx: int = 0) -> int:
    """Content elements of one layer, K and V both, padding excluded."""
    g = _group(kv, fmt, layer_idx).geometry
    return g.kv_size * g.page_buffer_size * g.hidden_dim


def get_dtype(kv: BoundKV, fmt: FormatLike, layer_idx: int = 0) -> torch.dtype:
    return _group(kv, fmt, layer_idx).dtype


def get_device(kv: BoundKV) -> torch.device:
    """The device of the registration (detection checked that there is one)."""
    if type(kv) is RegisteredKV:
        return kv.registration.device
    if type(kv) is Registration:
        return kv.device
    return first_leaf(kv).device


# -- diagnostics: strings, never raising for an unknown format -------------------------------


def _unknown(fmt: object) -> str:
    """``Unknown (fmt)``, as LMCache renders a format it has no shape for. Only a format's
    value is written out: anything else by its type (``str()`` of a tensor reads its
    elements, which a freed one has not: torch raised from inside the label)."""
    if isinstance(fmt, EngineKVFormat):
        return f"Unknown ({fmt.name})"
    if isinstance(fmt, (int, str, np.integer)):
        return f"Unknown ({fmt})"
    return f"Unknown (a {type(fmt).__name__})"


def get_attention_backend(fmt: FormatLike, engine: EngineLike | None = None) -> str:
    """An attention backend known to produce the format (a log label only): the
    engine's own when ``engine`` is given (detection's registrations know theirs), else
    the first one layouts.yaml lists."""
    try:
        return backend_label(fmt, None if engine is None else as_engine(engine))
    except (KVLayoutError, TypeError):
        return _unknown(fmt)


def get_engine_kv_shape_description(fmt: FormatLike) -> str:
    """``NL x [2, NB, BS, NH, HS]``."""
    try:
        return get_spec_class(fmt).describe_shape()
    except KVLayoutError:
        return _unknown(fmt)


def get_concrete_engine_kv_shape(kv: BoundKV, fmt: FormatLike) -> str:
    """``32 x [2, 2048, 16, 8, 128]``: every layer of the registration read in ``fmt``,
    whatever kernel groups it is split into. Groups that differ only in their layer
    count count together; different shapes are joined by `` + `` in order of their
    first layer (``4 x [2, 2048, 16, 8, 128] + 3 x [2, 1024, 16, 8, 128]``).
    ``Unknown (<fmt>)`` for an unknown format or a registration that does not fit it."""
    try:
        return bound(kv, fmt).concrete_shape(fmt)
    except (KVLayoutError, TypeError):
        return _unknown(fmt)


def get_concrete_engine_kv_shape_from_shape_desc(shape_desc: PageBufferShapeDesc, fmt: FormatLike) -> str:
    """The group's shape from its descriptor, for every format: the row token (HS, CS or
    a blocked-scale page) shows the descriptor's row width with packed factors divided
    out, so fused (CS) and blocked-scale formats render with numbers where LMCache 0.5.6
    prints ``Unknown``. A descriptor with a field unset or out of range is an error (it
    would render, and address, a wrong shape), not ``Unknown``."""
    if not isinstance(shape_desc, PageBufferShapeDesc):
        raise TypeError(f"shape_desc must be a PageBufferShapeDesc, not {type(shape_desc).__name__}")
    shape_desc.validate()
    try:
        cls = get_spec_class(fmt)
        by_role: dict[Role, int] = {
            role: getattr(shape_desc, name)
            for name, role in DESCRIPTOR_ROLES.items()
            if role is not Role.ELEMENT  # a head's row: the row token below
        }
        sizes = algebra.sizes_by_role(cls.layout, by_role)
        if cls.row_symbol is not None:
            row = next(getattr(shape_desc, n) for n, r in DESCRIPTOR_ROLES.items() if r is Role.ELEMENT)
            sizes[cls.row_symbol] = row // cls.row_divisor
        return cls.layout.concrete_shape(sizes)
    except KVLayoutError:
        return _unknown(fmt)


# -- pointers and descriptors ------------------------------------------------------------------


def get_group_data_ptrs(kv: BoundKV, fmt: FormatLike, layer_indices: Sequence[int]) -> list[int]:
    """The group's pointer table in kernel order: one per layer; ``[K..., V...]`` for
    K/V lists; each layer's tuple in turn for tuple formats; one base for cross-layer."""
    return bound(kv, fmt).data_ptrs(layer_indices, fmt)


def make_page_buffer_shape_desc(
    kv: BoundKV,
    fmt: FormatLike,
    layer_idx: int,
    num_layers_in_group: int,
    num_blocks: int,
    block_size: int,
    block_stride_elems: int | None = None,
) -> PageBufferShapeDesc:
    """The kernel-facing geometry of a group whose first layer is ``layer_idx``.

    ``num_blocks`` and ``block_size`` come from the caller (so NB*BS formats work when
    the caller knows them) and are checked against the tensors, as is
    ``block_stride_elems`` (``tensor.stride(0)`` as ``resolve_block_stride_and_log_layout``
    returns it; None or 0: tightly packed): a descriptor that would misaddress the cache
    is an error here rather than a wrong transfer later.
    """
    return _group(kv, fmt, layer_idx).descriptor(
        num_layers_in_group, num_blocks, block_size, block_stride_elems
    )


def resolve_block_stride_and_log_layout(
    kv: BoundKV, fmt: FormatLike, layer_idx: int, group_idx: int
) -> int | None:
    """The group's ``block_stride_elems``: ``stride(0)`` of the layer's tensors when the
    layout's dim 0 is the block axis (tight for compact caches, wider for padded pools
    and blocks-first views); None otherwise (binding rejected dim-0 padding there).

    Which formats may carry padding comes from the layout (``has_leading_block_axis``):
    every format whose dim 0 is NB, a superset of LMCache 0.5.6's hand list
    {3, 14, 17, 12, 13, 18} that adds the cross-layer formats (0, 8), flash-infer (2, 7),
    SGLang's un-folded K/V lists (9) and the (K, V) tuples (16): kvlayout's transfer
    addresses dim 0 through the algebra, whose block stride is dim 0's stride verbatim
    for any such layout. Logs one INFO audit line; logging never raises.
    """
    group = _group(kv, fmt, layer_idx)
    if _log.isEnabledFor(logging.INFO):  # the layer's tensor is looked up only to be logged
        _audit(group_idx, layer_idx, group)
    return group.block_stride_elems


def _audit(group_idx: int, layer_idx: int, group: KernelGroup) -> None:
    try:
        t = group.layer_tensors(layer_idx)[0]
        _log.info(
            "Group %d first-layer tensor: layer_idx=%d shape=%s stride=%s is_contiguous=%s dtype=%s "
            "device=%s storage_offset=%d numel=%d padding_per_block=%d",
            group_idx, layer_idx, tuple(t.shape), t.stride(), t.is_contiguous(), t.dtype,
            t.device, t.storage_offset(), t.numel(), dim0_padding(t),
        )  # fmt: skip
    except Exception:  # an audit line must never break registration
        pass


# -- grouping ----------------------------------------------------------------------------------


@overload
def get_shape_and_dtype(
    kv: Sequence[torch.Tensor], layer_indices: Sequence[int] | None = None
) -> list[ShapeAndDtype]: ...
@overload
def get_shape_and_dtype(kv: BoundKV, layer_indices: Sequence[int] | None = None) -> list[Any]: ...
def get_shape_and_dtype(kv: BoundKV, layer_indices: Sequence[int] | None = None) -> list[Any]:
    """Each entry's structure key, the one LMCache buckets layers by: ``(shape, dtype)``
    for a tensor, a tuple of its children's keys for a tuple or list (nested as the
    registration is). Every entry, or those at ``layer_indices``, in that order.

    Shapes are as registered, not in memory order; a :class:`Registration` is read as
    its ``registered_kv``. Unlike LMCache (``None`` for anything without a shape) a leaf
    that is not a tensor is a ``TypeError`` naming where it is, and a bare tensor (one
    entry for every layer) is one too. (The keys of nested entries nest as the entries
    do, which only a list of tensors pins statically: hence ``list[Any]`` otherwise.)
    """
    if type(kv) is Registration:
        kv = kv.registered_kv
    return entry_keys(kv, _shape_and_dtype, layer_indices)


def _shape_and_dtype(t: torch.Tensor) -> ShapeAndDtype:
    if t.is_nested:  # no shape: torch's .shape raises "Internal error: NestedTensorImpl ..."
        raise LocatedError(TypeError, str(not_strided(t)))
    return tuple(t.shape), t.dtype


def group_layers_by_identity(
    kv: BoundKV,
    formats: Sequence[FormatLike | None],
    per_layer_engine_group_idx: Sequence[int] | None = None,
) -> list[tuple[LayerGroupIdentity, list[int]]]:
    """Layers bucketed by identity, each layer read in its own format, in order of first
    layer. Layers in ``EXCLUDED_ENGINE_GROUP`` (-1) are skipped, and so are layers whose
    format is None (in no detection group) unless an engine group claims them (an error).

    Engine (KV cache) groups are first-class: without ``per_layer_engine_group_idx``, a
    registration from per-layer detection keeps its ``layer_index_groups`` as engine
    groups, so layers of different groups are never merged even when their tensors are
    identical. Works for every format: cross-layer and K/V-list registrations are read
    per layer, and NB*BS formats get ``block_size=None``.
    """
    n = len(formats)
    if per_layer_engine_group_idx is not None and len(per_layer_engine_group_idx) != n:
        raise KVLayoutError(
            f"per_layer_engine_group_idx has {len(per_layer_engine_group_idx)} entries but "
            f"engine_kv_formats has {n} layers"
        )
    reg = bound_per_layer(kv, formats)
    if per_layer_engine_group_idx is None:
        engine_groups = reg.engine_groups
    else:
        engine_groups = tuple(
            as_int(group, f"per_layer_engine_group_idx[{i}]")
            for i, group in enumerate(per_layer_engine_group_idx)
        )
    return [(g.identity, list(g.layers)) for g in reg.group_by(engine_groups)]
