"""A registration's kernel groups: the layers one kernel reads alike (one format, engine
group and geometry), their planes (one pointer table each) and the layers among them
that share one KV cache; :mod:`~kvlayout.registration.registration` builds them."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn

import torch

from kvlayout._generated.descriptors import DESCRIPTOR_ROLES, PageBufferShapeDesc
from kvlayout._generated.formats import LAYOUTS, EngineKVFormat
from kvlayout.catalog.registry import backend_label, get_spec
from kvlayout.catalog.spec import UndefinedSizeError
from kvlayout.errors import KVLayoutError, as_int, index_ranges
from kvlayout.layout.algebra import fold_reason, level_of
from kvlayout.layout.ast import Layout
from kvlayout.layout.vocabulary import Role
from kvlayout.registration.binding import (
    RegistrationError,
    check_block_stride,
    tight_block,
)
from kvlayout.registration.memory import (
    SHARE_WHOLE,
    HoldsAddresses,
    alias_refusal,
    check_in_place,
    memory_keys,
    partly_shared,
)
from kvlayout.registration.nesting import Path, describe_path
from kvlayout.registration.opaque import OpaquePages, opaque_pages_of, pages_of_tensors
from kvlayout.types import EngineType

__all__ = [
    "EXCLUDED_ENGINE_GROUP",
    "Geometry",
    "KernelGroup",
    "KernelGroupIdentity",
    "LayerGroupIdentity",
    "Plane",
    "describe_sharing",
]

EXCLUDED_ENGINE_GROUP = -1
"""An engine group index that keeps a layer out of every kernel group."""


class LayerGroupIdentity(NamedTuple):
    """What layers must share to be moved by one kernel group.

    The first seven fields are LMCache's ``KernelGroupIdentity`` in its order, so it is
    constructible from those seven (``KernelGroupIdentity`` is the same class under
    LMCache's newer name; this one is canonical). ``block_size`` is None for formats that
    fold NB*BS (they have no block size of their own; LMCache raises there).
    ``block_stride_elems`` (dim 0's stride where dim 0 is the block axis, else None) and
    ``num_blocks`` (None for NB*BS formats) are kvlayout's additions: a kernel group has
    one descriptor, so layers from pools with different padding or block counts never
    share one. Kernel groups fill them in, so compare LMCache's seven fields
    (``identity[:7]`` on both sides) with an identity built from those seven.
    """

    kv_size: int
    num_heads: int
    head_size: int
    block_size: int | None
    engine_group_idx: int
    dtype: torch.dtype
    engine_kv_format: EngineKVFormat
    block_stride_elems: int | None = None
    num_blocks: int | None = None


KernelGroupIdentity = LayerGroupIdentity
"""LMCache's newer name for :class:`LayerGroupIdentity` (the canonical one)."""


class Plane(NamedTuple):
    """Tensors of one kernel group that share one geometry: all of its tensors, or one
    plane of per-layer plane tuples (each plane has its own pointer table)."""

    leaves: tuple[torch.Tensor, ...]  # in pointer-table order
    paths: Sequence[Path]  # where each tensor sits in the registration
    shape: tuple[int, ...]
    sizes: dict[str, int]  # the layout's sizes as the tensors give them (NB*BS stays folded)
    block_stride: int | None  # dim 0's stride where dim 0 is the block axis, else None
    dtype: torch.dtype
    device: torch.device
    data_ptrs: tuple[int, ...]
    repeats: tuple[int, ...] = ()  # pointer positions whose memory an earlier one holds (shared layers)
    # the caller's tensor behind each leaf where detection re-viewed it (None: the leaf is
    # the caller's own): what an engine re-allocates, so what later checks watch
    sources: tuple[torch.Tensor | None, ...] = ()
    root: str = "kv_caches"  # what messages name the registration (``paths`` follow it)

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def padded_block_stride(self) -> int:
        """The block stride when blocks are padded apart, 0 when they are tight."""
        if self.block_stride is None or self.block_stride == tight_block(self.shape):
            return 0
        return self.block_stride


@dataclass(frozen=True, slots=True)
class Geometry:
    """A kernel group's answers to the accessors (the generated spec's, read once)."""

    num_blocks: int | None  # None where the format folds NB*BS
    block_size: int | None
    page_buffer_size: int
    kv_size: int
    num_heads: int
    head_size: int
    hidden_dim: int
    dtype: torch.dtype


class KernelGroup(HoldsAddresses):
    """Layers one kernel moves together: one format, one geometry, one engine group.

    ``kv`` is the group's own registration: its layers' entries for a layer list, the
    whole structure otherwise. ``layers`` are positions in the registration's layers;
    ``layer_ids`` the engine's numbers of those layers (the positions unless the
    registration was :meth:`~kvlayout.registration.registration.Registration.numbered`):
    what a block map pairs and a description names. ``data_ptrs`` is the kernel's pointer table (planes
    interleaved as the layout orders them). ``memo`` is where code built on a group
    (transfer plans) keeps what it derives from it.
    """

    __slots__ = (
        "_positions",
        "_shared",
        "data_ptrs",
        "engine",
        "engine_group",
        "format",
        "geometry",
        "kv",
        "layer_ids",
        "layers",
        "memo",
        "planes",
        "registration_layers",
    )

    def __init__(
        self,
        format: EngineKVFormat,
        engine_group: int,
        layers: tuple[int, ...],
        kv: Any,
        planes: tuple[Plane, ...],
        data_ptrs: tuple[int, ...],
        geometry: Geometry,
        registration_layers: int,
        engine: EngineType | None = None,
        layer_ids: tuple[int, ...] | None = None,
    ) -> None:
        self.format = format
        self.engine = engine  # the engine that registered it, for labels
        self.engine_group = engine_group
        self.layers = layers
        self.layer_ids = layers if layer_ids is None else layer_ids
        self.kv = kv
        self.planes = planes
        self.data_ptrs = data_ptrs
        self.geometry = geometry
        self.registration_layers = registration_layers  # layers of the whole registration
        self.memo: dict[object, object] = {}
        self._positions: dict[int, int] | None = None
        self._shared: tuple[tuple[int, ...], ...] | None = None  # None: not looked for yet

    def __repr__(self) -> str:
        return f"KernelGroup({self.describe()}, engine group {self.engine_group})"

    @property
    def shared_layers(self) -> tuple[tuple[int, ...], ...]:
        """Layers that share one KV cache, each tuple in layer order: every tensor of the
        others is the first one's (the same memory and view). Empty without sharing."""
        if self._shared is None:  # meta tensors, looked for when asked (they move no bytes)
            self._shared = _find_sharing(self, "kv", strict=False)
        return self._shared

    @property
    def layout(self) -> Layout:
        return LAYOUTS[self.format]

    @property
    def device(self) -> torch.device:
        return self.planes[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.geometry.dtype

    @property
    def num_blocks(self) -> int:
        if self.geometry.num_blocks is None:
            raise _undefined(self.format, "num_blocks", Role.BLOCK)
        return self.geometry.num_blocks

    @property
    def block_size(self) -> int:
        if self.geometry.block_size is None:
            raise _undefined(self.format, "block_size", Role.TOKEN)
        return self.geometry.block_size

    @property
    def opaque_pages(self) -> OpaquePages | None:
        """What the group's rows hold where its tensors are opaque pages (vLLM's group
        edits mark the views they make: :mod:`kvlayout.registration.opaque`); None for
        tensors as an engine registers them."""
        tensors: list[torch.Tensor] = []
        for plane in self.planes:
            sources = plane.sources or (None,) * len(plane.leaves)
            # a leaf detection re-viewed as opaque pages (vLLM's CPU_ATTN) carries its own mark
            tensors += [
                leaf if source is None or opaque_pages_of(leaf) is not None else source
                for leaf, source in zip(plane.leaves, sources, strict=True)
            ]
        return pages_of_tensors(tensors)

    @property
    def block_stride_elems(self) -> int | None:
        """``stride(0)`` of the group's tensors where dim 0 is the block axis, else None."""
        return self.planes[0].block_stride

    @property
    def identity(self) -> LayerGroupIdentity:
        g = self.geometry
        return LayerGroupIdentity(
            g.kv_size, g.num_heads, g.head_size, g.block_size, self.engine_group, g.dtype, self.format,
            self.block_stride_elems, g.num_blocks,
        )  # fmt: skip

    @property
    def backend(self) -> str:
        """The attention backend to name in logs: the registering engine's own label."""
        return backend_label(self.format, self.engine)

    def _own_layer(self, layer: int) -> int:
        layer = as_int(layer, "layer")
        if self._positions is None:
            self._positions = {layer: i for i, layer in enumerate(self.layers)}
        if layer not in self._positions:
            # a numbered registration shows the engine's numbers: say these are positions
            ids = (
                f"; positions, numbered {index_ranges(self.layer_ids)}"
                if self.layer_ids != self.layers
                else ""
            )
            raise KVLayoutError(
                f"layer {layer} is not in this kernel group (its layers: {index_ranges(self.layers)}{ids})"
            )
        return self._positions[layer]

    def layer_tensors(self, layer: int) -> list[torch.Tensor]:
        """The tensors holding one of the group's layers, in pointer-table order."""
        self._own_layer(layer)
        level = level_of(self.layout, Role.LAYER)
        return [
            leaf
            for plane in self.planes
            for leaf, path in zip(plane.leaves, plane.paths, strict=True)
            if level is None or path[level] == layer
        ]

    def layer_ptrs(self, layer: int) -> list[int]:
        """One layer's part of the pointer table (a layer list's entry, in kernel order);
        refused once a tensor of the group was re-allocated or freed since detection."""
        position = self._own_layer(layer)
        check_in_place(self, RegistrationError, f"layer_ptrs({layer})")
        return self._layer_ptrs(position)

    def _layer_ptrs(self, position: int) -> list[int]:
        """:meth:`layer_ptrs` of the layer at ``position`` in the group, unchecked."""
        per = len(self.data_ptrs) // len(self.layers)
        return list(self.data_ptrs[position * per : (position + 1) * per])

    def concrete_shape(self) -> str:
        """``32 x [2, 2048, 16, 8, 128]``: the group's shape with its numbers."""
        return get_spec(self.kv, self.format).concrete_shape_str()

    def display_sizes(self) -> dict[str, int]:
        """The sizes :meth:`concrete_shape` renders (the layout's token names as keys)."""
        return get_spec(self.kv, self.format).display_sizes()

    def describe(self) -> str:
        """``layers 0-31: NL_X_TWO_NB_BS_NH_HS [2, 2048, 16, 8, 128] torch.bfloat16``, and
        ``, KV shared by layers (2, 4)`` where layers share one KV cache (layer ids)."""
        shapes = " + ".join(str(list(p.shape)) for p in self.planes)
        ids = dict(zip(self.layers, self.layer_ids, strict=True))
        sharing = [[ids[i] for i in s] for s in self.shared_layers]
        shared = f", KV shared by layers {describe_sharing(sharing)}" if sharing else ""
        return f"layers {index_ranges(self.layer_ids)}: {self.format.name} {shapes} {self.dtype}{shared}"

    def descriptor(
        self,
        num_layers: int | None = None,
        num_blocks: int | None = None,
        block_size: int | None = None,
        block_stride_elems: int | None = None,
    ) -> PageBufferShapeDesc:
        """The group's kernel descriptor. Every argument given is checked against the
        tensors (defaults: the group's own); ``block_size`` is needed for NB*BS formats."""
        g = self.geometry
        total = self.registration_layers
        nl = len(self.layers) if num_layers is None else _count("num_layers_in_group", num_layers, 1)
        if self.layout.is_cross_layer and nl != total:
            raise RegistrationError(
                f"num_layers_in_group={nl}, but {self.format.name} holds {total} layers in one tensor "
                "and its descriptor addresses all of them"
            )
        if nl > total:
            raise RegistrationError(f"num_layers_in_group={nl}, but the registration has {total} layers")
        nb = None if num_blocks is None else _count("num_blocks", num_blocks, 0)
        bs = None if block_size is None else _count("block_size", block_size, 1)
        if g.num_blocks is not None and g.block_size is not None:
            for name, given, real in (("num_blocks", nb, g.num_blocks), ("block_size", bs, g.block_size)):
                if given is not None and given != real:
                    raise RegistrationError(
                        f"{name}={given}, but layer {self.layers[0]}'s tensors ({self.format.name}) "
                        f"have {real}"
                    )
            nb, bs = g.num_blocks, g.block_size
        else:  # NB*BS folded: the caller says how the page buffer splits
            if bs is None:
                raise RegistrationError(
                    f"{self.format.name} folds its blocks and their tokens into one axis of "
                    f"{g.page_buffer_size} token slots: pass block_size"
                )
            if g.page_buffer_size % bs or (nb is not None and nb * bs != g.page_buffer_size):
                split = f"num_blocks={nb} x block_size={bs}" if nb is not None else f"block_size={bs}"
                raise RegistrationError(
                    f"{split} does not tile the {g.page_buffer_size} token slots of {self.format.name}"
                )
            nb = g.page_buffer_size // bs
        stride = 0
        if block_stride_elems:
            stride = _count("block_stride_elems", block_stride_elems, 0)
            check_block_stride(self.layout, self.planes[0].sizes, stride)
            if stride != self.block_stride_elems:
                raise RegistrationError(
                    f"block_stride_elems={stride}, but layer {self.layers[0]}'s blocks are "
                    f"{self.block_stride_elems} elements apart"
                )
        elif self.planes[0].padded_block_stride:
            raise RegistrationError(
                f"layer {self.layers[0]}'s blocks are padded ({self.block_stride_elems} elements apart); "
                f"pass block_stride_elems={self.block_stride_elems}"
            )
        by_role = {
            Role.KV: g.kv_size, Role.LAYER: nl, Role.BLOCK: nb, Role.TOKEN: bs, Role.HEAD: g.num_heads,
            Role.ELEMENT: g.head_size,
        }  # fmt: skip
        fields = {name: by_role[role] for name, role in DESCRIPTOR_ROLES.items()}
        return PageBufferShapeDesc.checked(
            **fields, element_size=g.dtype.itemsize, block_stride_elems=stride, dtype=g.dtype
        )


def describe_sharing(shared: Sequence[Sequence[int]]) -> str:
    """``(2, 4), (3, 5)``: layers sharing one KV cache, each tuple in layer order."""
    return ", ".join(f"({', '.join(map(str, layers))})" for layers in shared)


def _find_sharing(group: KernelGroup, root: str, strict: bool) -> tuple[tuple[int, ...], ...]:
    """The group's layers that share one KV cache, each ``(first, *others)`` in layer
    order; records each plane's repeated pointer positions (a load skips them).

    A layer shares whole: each of its tensors is the first layer's in the same place. With
    ``strict``, anything else that repeats memory (a tensor twice within one layer, a
    layer sharing part of its tensors or with two layers) is a
    :class:`RegistrationError`; without it (meta tensors, which move no bytes) it is
    simply not sharing.
    """
    level = level_of(group.layout, Role.LAYER)
    planes = list(group.planes)
    target: dict[int, int] = {}
    counts: dict[int, int] = {}
    try:
        for p, plane in enumerate(planes):
            keys = memory_keys(plane.leaves, plane.data_ptrs)
            if keys is None:
                continue
            seen: dict[Hashable, int] = {}
            repeats = []
            for k, key in enumerate(keys):
                j = seen.setdefault(key, k)
                if j == k:
                    continue
                here, there = plane.paths[k], plane.paths[j]
                _check_alias(here, there, level, target, root)
                assert level is not None  # _check_alias made sure
                counts[here[level]] = counts.get(here[level], 0) + 1
                repeats.append(k)
            planes[p] = plane._replace(repeats=tuple(repeats))
        if not counts:
            return ()
        assert level is not None
        partial = partly_shared(counts, sum(len(p.paths) for p in planes), len(group.layers))
        if partial is not None:
            _fail_partial(planes, level, partial, target[partial], root)
    except RegistrationError:
        if strict:
            raise
        return ()
    group.planes = tuple(planes)
    sharers: dict[int, list[int]] = {}
    for layer, first in sorted(target.items()):
        sharers.setdefault(first, []).append(layer)
    return tuple((first, *layers) for first, layers in sorted(sharers.items()))


def _check_alias(here: Path, there: Path, level: int | None, target: dict[int, int], root: str) -> None:
    """``here`` is the memory and view of ``there``, earlier in the pointer table: fine
    only as the same place of another layer, and one target layer per sharer."""
    refusal = alias_refusal(
        here, there, level, target, (describe_path(here, root), describe_path(there, root))
    )
    if refusal is not None:
        raise RegistrationError(refusal)


def _fail_partial(planes: Sequence[Plane], level: int, layer: int, first: int, root: str) -> NoReturn:
    for plane in planes:
        for k, path in enumerate(plane.paths):
            if path[level] == layer and k not in plane.repeats:
                theirs = (*path[:level], first, *path[level + 1 :])
                raise RegistrationError(
                    f"layer {layer} shares only part of its KV cache with layer {first}: "
                    f"{describe_path(path, root)} is not {describe_path(theirs, root)} (its memory or view "
                    f"differs); {SHARE_WHOLE}"
                )
    raise AssertionError("a partial sharer has a tensor of its own")


def _undefined(fmt: EngineKVFormat, accessor: str, role: Role) -> UndefinedSizeError:
    """The error a generated spec raises for the same accessor (the algebra's reason)."""
    return UndefinedSizeError(
        f"{accessor} is undefined for the fused format {fmt.name}: {fold_reason(LAYOUTS[fmt], role)}"
    )


def _count(name: str, value: object, minimum: int) -> int:
    number = as_int(value, name)
    if number < minimum:
        raise KVLayoutError(f"{name} must be >= {minimum}, got {number}")
    return number
