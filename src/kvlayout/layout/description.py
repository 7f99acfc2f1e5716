"""A layout as plain data for tools: axes, list levels, K/V placement, stride overrides.

:func:`describe` turns any layout (a format or a parsed name) into a
:class:`LayoutDescription`: its physical dims outermost first, each a fold of logical
axes (``(B, N)`` is a page axis of NB*BS slots, ``(KV, C)`` a row holding K and V side by
side, ``()`` a size-1 dim that addresses nothing), the list levels around them, how the
K/V pair is stored, and per-dim stride overrides (a padded block stride). Every fact is
derived from that structure, and :func:`to_engine_kv_format` maps a description back to
its format, so a tool can build one by hand and ask which format it is. The axes and
vLLM's layout spellings (``LBNHC``...) are vocabulary (:mod:`kvlayout.layout.vocabulary`);
this module re-exports them.

This is LMCache's ``KVLayoutDescriptor`` (its branch ``kv_format/descriptor.py``) read off
kvlayout's layouts, under LMCache's names too: ``KVLayoutDescriptor`` (the same class;
its fields by keyword, with ``quant`` and ``logical_dtype``), ``QuantSpec``,
``ScalePlacement``, ``ENGINE_KV_FORMAT_DESCRIPTORS`` (each format's canonical
description, by name), ``from_engine_kv_format``, ``to_engine_kv_format_name`` and
``with_block_stride``. The list levels follow from the grouping, so a description is
built without them. :meth:`LayoutDescription.to_dict` is the JSON form ``kvlayout
describe`` prints. ``kv_layout_axes`` reads vLLM's layout spellings (``LBNHC``...) as an
order of these axes; the hint names kvlayout accepts are derived from it.
"""

from __future__ import annotations

import enum
import math
import numbers
import operator
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from kvlayout.errors import DescriptionError, SizeError, as_int
from kvlayout.layout import algebra
from kvlayout.layout.ast import FACTS, Layout
from kvlayout.layout.dtypes import DTYPE_SIZES
from kvlayout.layout.vocabulary import (
    BLOCKS_FIRST_KV_LAYOUTS,
    HND_KV_LAYOUTS,
    KV_LAYOUT_ALIASES,
    KV_LAYOUT_NAMES,
    Axis,
    Role,
    Token,
    kv_layout_axes,
)

if TYPE_CHECKING:
    from kvlayout._generated.formats import EngineKVFormat

__all__ = [
    "BLOCKS_FIRST_KV_LAYOUTS",
    "ENGINE_KV_FORMAT_DESCRIPTORS",
    "HND_KV_LAYOUTS",
    "KV_LAYOUT_ALIASES",
    "KV_LAYOUT_NAMES",
    "Axis",
    "DescriptionError",
    "Grouping",
    "KVLayoutDescriptor",
    "KVPacking",
    "LayoutDescription",
    "QuantSpec",
    "RegionPart",
    "ScalePlacement",
    "describe",
    "from_engine_kv_format",
    "kv_layout_axes",
    "to_engine_kv_format",
    "to_engine_kv_format_name",
    "with_block_stride",
]


class Grouping(enum.Enum):
    """How the tensors of a registration are nested (list levels, outermost first)."""

    SINGLE_TENSOR = "single_tensor"  # one tensor holds every layer
    PER_LAYER = "per_layer"  # one tensor per layer
    KV_LISTS = "kv_lists"  # [K layers, V layers]
    PER_LAYER_KV_PAIRS = "per_layer_kv_pairs"  # one (K, V) tuple per layer
    PER_LAYER_PLANE_TUPLES = "per_layer_plane_tuples"  # one tuple of row planes per layer


class KVPacking(enum.Enum):
    """Where K and V are."""

    SPLIT = "split"  # a K/V axis or list level of its own: chunks hold K and V apart
    FUSED = "fused"  # inside a head's row, after the token and head axes
    SHARED = "shared"  # one latent plane, no K/V and no heads (MLA)
    SINGLE = "single"  # one of K or V per tensor (heads, no pair)


class ScalePlacement(enum.Enum):
    """Where a quantized layout keeps its scales."""

    BLOCK_REGION = "block_region"  # per block, every token's values, then every token's scales
    INLINE_PER_HEAD = "inline_per_head"  # inside each head's widened row (no format has it yet)


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """How quantized values are scaled (LMCache's ``QuantSpec``): ``values_per_scale``
    values share one ``scale_dtype`` scale, placed as ``placement`` says."""

    scale_dtype: str
    values_per_scale: int
    placement: ScalePlacement


@dataclass(frozen=True, slots=True)
class RegionPart:
    """One region of a blocked page's row (values, then scales): ``width`` bytes per
    token, holding ``dtype`` values (a torch dtype name) where the layout says."""

    name: str
    width: int
    dtype: str | None = None


_ROLE_AXIS = {
    Role.LAYER: Axis.L,
    Role.KV: Axis.KV,
    Role.BLOCK: Axis.B,
    Role.TOKEN: Axis.N,
    Role.HEAD: Axis.H,
    Role.ELEMENT: Axis.C,
}
_GROUPING_LISTS = {
    (): Grouping.SINGLE_TENSOR,
    (Axis.L,): Grouping.PER_LAYER,
    (Axis.KV, Axis.L): Grouping.KV_LISTS,
    (Axis.L, Axis.KV): Grouping.PER_LAYER_KV_PAIRS,
    (Axis.L, Axis.C): Grouping.PER_LAYER_PLANE_TUPLES,
}


def _frozen(mapping: Mapping[Any, int]) -> Mapping[Any, int]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class LayoutDescription:
    """A physical KV-cache layout as data (see the module docstring).

    ``dims`` are the leaf tensor's dims, outermost first, each a fold of axes (row-major);
    the list levels (:attr:`lists`) follow from the ``grouping``; ``extents`` the sizes
    known (literal axes always; the rest when sizes were given); ``dim_strides`` sparse
    stride overrides in elements (missing = tight); ``regions`` the parts of a blocked
    page's row, and ``quant`` (LMCache's spelling of the same fact) how its values are
    scaled: each is derived from the other where it can be. ``storage_dtype`` is what the
    tensor holds, ``logical_dtype`` what its quantized bytes mean. Checked on
    construction (:class:`DescriptionError`).
    """

    grouping: Grouping
    kv_packing: KVPacking
    dims: tuple[tuple[Axis, ...], ...]
    extents: Mapping[Axis, int] = field(default_factory=dict)
    dim_strides: Mapping[int, int] = field(default_factory=dict)
    regions: tuple[RegionPart, ...] = ()
    quant: QuantSpec | None = None
    storage_dtype: str = ""
    logical_dtype: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "extents", _frozen(self.extents))
        object.__setattr__(self, "dim_strides", _frozen(self.dim_strides))
        if isinstance(self.dims, (list, tuple)):  # LMCache's callers pass lists as often as tuples
            dims = tuple(tuple(fold) if isinstance(fold, list) else fold for fold in self.dims)
            object.__setattr__(self, "dims", dims)
        derived = _region_quant(self.regions) if self.regions else None
        if derived is not None:
            quant, logical = derived
            if self.quant is None:
                object.__setattr__(self, "quant", quant)
            elif self.quant != quant:
                raise DescriptionError(f"quant {self.quant} contradicts the regions, which say {quant}")
            if self.logical_dtype is None:
                object.__setattr__(self, "logical_dtype", logical)
        _validate(self)

    @property
    def lists(self) -> tuple[Axis, ...]:
        """The axis each list level carries, outermost first (``C`` for row planes)."""
        return _LISTS[self.grouping]

    @property
    def scale_placement(self) -> ScalePlacement | None:
        """Where the scales are: ``quant``'s placement; a blocked page's regions are one."""
        if self.quant is not None:
            return self.quant.placement
        return ScalePlacement.BLOCK_REGION if self.regions else None

    # -- where things are ---------------------------------------------------------

    def axis_dim(self, axis: Axis) -> int | None:
        """The dim holding ``axis`` (alone or folded), or None."""
        return next((i for i, fold in enumerate(self.dims) if axis in fold), None)

    def dim_extent(self, index: int) -> int:
        """The size of dim ``index`` (the product of its fold; ``()`` is 1)."""
        fold = self.dims[index]
        missing = [a.value for a in fold if a not in self.extents]
        if missing:
            raise DescriptionError(f"dim {index} {_fold(fold)} needs an extent for {', '.join(missing)}")
        return math.prod(self.extents[a] for a in fold)

    def resolved_strides(self) -> tuple[int, ...]:
        """Each dim's stride in elements: tight, inner to outer, except where overridden
        (an override shifts every outer dim, as a padded block does)."""
        strides = [0] * len(self.dims)
        running = 1
        for i in range(len(self.dims) - 1, -1, -1):
            running = self.dim_strides.get(i, running)
            strides[i] = running
            running *= self.dim_extent(i)
        return tuple(strides)

    def with_block_stride(self, block_stride: int) -> LayoutDescription:
        """The description with its block dim's stride overridden (0 drops the override)."""
        b = self.axis_dim(Axis.B)
        if b is None or self.dims[b] != (Axis.B,):
            where = "no dim" if b is None else f"dim {b} {_fold(self.dims[b])}"
            raise DescriptionError(
                f"a block stride needs the blocks on a plain dim of their own, not {where}"
            )
        if (
            isinstance(block_stride, bool)
            or not isinstance(block_stride, numbers.Integral)
            or block_stride < 0
        ):
            raise DescriptionError(f"a block stride is a non-negative int, got {block_stride!r}")
        block_stride = operator.index(block_stride)
        strides = {k: v for k, v in self.dim_strides.items() if k != b}
        if block_stride:
            strides[b] = block_stride
        return replace(self, dim_strides=strides)

    @property
    def kv_placement(self) -> str:
        """``list level i``, ``dim i``, ``inside dim i`` (packed in the row) or ``none``."""
        if Axis.KV in self.lists:
            return f"list level {self.lists.index(Axis.KV)}"
        d = self.axis_dim(Axis.KV)
        if d is None:
            return "none"
        return (
            f"inside dim {d}" if self.kv_packing is KVPacking.FUSED and len(self.dims[d]) > 1 else f"dim {d}"
        )

    # -- facts, from the structure alone ------------------------------------------------

    @property
    def is_cross_layer(self) -> bool:
        return self.grouping is Grouping.SINGLE_TENSOR

    @property
    def is_kv_list(self) -> bool:
        return self.grouping is Grouping.KV_LISTS

    @property
    def is_layer_list(self) -> bool:
        return self.grouping in (
            Grouping.PER_LAYER,
            Grouping.PER_LAYER_KV_PAIRS,
            Grouping.PER_LAYER_PLANE_TUPLES,
        )

    @property
    def is_kv_second_tuple(self) -> bool:
        return self.grouping in (Grouping.PER_LAYER_KV_PAIRS, Grouping.PER_LAYER_PLANE_TUPLES)

    @property
    def is_mla(self) -> bool:
        return self.kv_packing is KVPacking.SHARED

    @property
    def is_single_kv(self) -> bool:
        return self.kv_packing is KVPacking.SINGLE

    @property
    def is_fused_packed(self) -> bool:
        return self.kv_packing is KVPacking.FUSED

    @property
    def is_hnd(self) -> bool:
        h, n = self.axis_dim(Axis.H), self.axis_dim(Axis.N)
        return h is not None and n is not None and h < n and self.dims[h] == (Axis.H,)

    @property
    def is_head_outer(self) -> bool:
        h, b = self.axis_dim(Axis.H), self.axis_dim(Axis.B)
        return h is not None and b is not None and h < b

    @property
    def is_layer_inner(self) -> bool:
        h, layer = self.axis_dim(Axis.H), self.axis_dim(Axis.L)
        return h is not None and layer is not None and h < layer

    @property
    def is_two_major(self) -> bool:
        kv, b = self.axis_dim(Axis.KV), self.axis_dim(Axis.B)
        return self.kv_packing is KVPacking.SPLIT and kv is not None and b is not None and kv < b

    @property
    def is_pbs_fused(self) -> bool:
        return any(Axis.B in fold and Axis.N in fold for fold in self.dims)

    @property
    def has_leading_block_axis(self) -> bool:
        return bool(self.dims) and self.dims[0] == (Axis.B,)

    @property
    def is_indexer(self) -> bool:
        return self.scale_placement is ScalePlacement.BLOCK_REGION

    @property
    def kv_size(self) -> int | None:
        """Planes per chunk row: the K/V pair's extent when split (None if unknown), else 1."""
        return self.extents.get(Axis.KV) if self.kv_packing is KVPacking.SPLIT else 1

    def key(self) -> tuple[object, ...]:
        """What identifies the format: the structure and where scales are, not extents,
        dtypes or strides (LMCache's matching key); regions that say no quantization
        (keys alone, no scale region) are a page of their own, and so is a blocked page
        scaled otherwise (the MXFP4 indexer's ue8m0 bytes, one per 16 packed value bytes,
        beside the fp8 one's float32 scale per 128 values)."""
        unscaled = bool(self.regions) and self.quant is None
        scaled = None if self.quant is None else (self.quant.scale_dtype, self.quant.values_per_scale)
        return (self.grouping, self.kv_packing, self.dims, self.scale_placement, unscaled, scaled)

    def to_dict(self) -> dict[str, object]:
        """The JSON form (what ``kvlayout describe`` prints)."""
        try:
            strides: list[int] | None = list(self.resolved_strides())
        except DescriptionError:
            strides = None
        return {
            "name": self.name,
            "grouping": self.grouping.value,
            "kv_packing": self.kv_packing.value,
            "kv_placement": self.kv_placement,
            "lists": [a.value for a in self.lists],
            "dims": [[a.value for a in fold] for fold in self.dims],
            "extents": {a.value: n for a, n in self.extents.items()},
            "strides": strides,
            "dim_strides": {str(k): v for k, v in sorted(self.dim_strides.items())},
            "regions": [{"name": r.name, "width": r.width, "dtype": r.dtype} for r in self.regions],
            "quant": None
            if self.quant is None
            else {
                "scale_dtype": self.quant.scale_dtype,
                "values_per_scale": self.quant.values_per_scale,
                "placement": self.quant.placement.value,
            },
            "storage_dtype": self.storage_dtype,
            "logical_dtype": self.logical_dtype,
            "facts": {name: bool(getattr(self, name)) for name in FACTS},
        }


KVLayoutDescriptor = LayoutDescription
"""LMCache's name for :class:`LayoutDescription` (the canonical one)."""

_LISTS: dict[Grouping, tuple[Axis, ...]] = {g: lists for lists, g in _GROUPING_LISTS.items()}


def _fold(fold: tuple[Axis, ...]) -> str:
    return "(" + ", ".join(a.value for a in fold) + ")"


def _itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name: torch's (:mod:`kvlayout.layout.dtypes`), else
    the bit width it spells (a layout may name a dtype torch lacks)."""
    if dtype in DTYPE_SIZES:
        return DTYPE_SIZES[dtype]
    bits = re.search(r"\d+", dtype)
    if bits is None or int(bits.group()) % 8 or int(bits.group()) == 0:
        raise DescriptionError(f"dtype {dtype!r} does not spell a whole number of bytes")
    return int(bits.group()) // 8


def _region_quant(regions: tuple[RegionPart, ...]) -> tuple[QuantSpec, str] | None:
    """The quantization a blocked page's regions say (values first, the scales last),
    with the values' dtype; None where a region does not say what it holds."""
    if len(regions) < 2 or any(r.dtype is None for r in regions):
        return None
    *values, scales = regions
    value_dtypes = {r.dtype for r in values}
    if len(value_dtypes) != 1:
        raise DescriptionError(
            f"the value regions hold different dtypes ({', '.join(sorted(map(str, value_dtypes)))})"
        )
    (value_dtype,) = value_dtypes
    assert value_dtype is not None and scales.dtype is not None
    count = sum(r.width for r in values) // _itemsize(value_dtype)
    per_token = scales.width // _itemsize(scales.dtype)
    if per_token == 0 or count % per_token:
        raise DescriptionError(
            f"{count} {value_dtype} values and {per_token} {scales.dtype} scales per token do not "
            "share scales evenly"
        )
    return QuantSpec(scales.dtype, count // per_token, ScalePlacement.BLOCK_REGION), value_dtype


def _validate(d: LayoutDescription) -> None:
    """The checks of LMCache's descriptor, in its order."""
    if not isinstance(d.grouping, Grouping) or not isinstance(d.kv_packing, KVPacking):
        raise DescriptionError(
            f"grouping and kv_packing are a Grouping and a KVPacking, not {d.grouping!r} and {d.kv_packing!r}"
        )
    seen: dict[Axis, int] = {}
    for i, fold in enumerate(d.dims):
        if not isinstance(fold, tuple):
            raise DescriptionError(f"dim {i} is {fold!r}, not a tuple of axes (a fold)")
        for a in fold:
            if not isinstance(a, Axis):
                raise DescriptionError(f"dim {i} holds {a!r}, not an Axis")
            if a in seen:
                raise DescriptionError(f"axis {a.value} is in more than one dim ({seen[a]} and {i})")
            seen[a] = i
    if Axis.C not in seen and Axis.C not in d.lists:
        raise DescriptionError("a layout needs the content axis C in its dims")
    both = [a.value for a in d.lists if a in seen and a is not Axis.C]
    if both:
        raise DescriptionError(f"axis {both[0]} is both a dim and a list level")
    kv_anywhere = Axis.KV in seen or Axis.KV in d.lists
    if d.kv_packing in (KVPacking.SHARED, KVPacking.SINGLE) and kv_anywhere:
        raise DescriptionError(f"{d.kv_packing.name} has no K/V pair, but KV is in its dims or lists")
    if d.kv_packing is KVPacking.SPLIT and not kv_anywhere:
        raise DescriptionError("SPLIT needs KV as a dim, or a KV_LISTS or PER_LAYER_KV_PAIRS grouping")
    if d.kv_packing is KVPacking.FUSED:
        kv = seen.get(Axis.KV)
        if kv is None or any(seen.get(a, -1) > kv for a in (Axis.N, Axis.H)):
            raise DescriptionError("FUSED needs KV in the dims, inner to the token and head axes")
    q = d.quant
    if q is not None:
        if not isinstance(q, QuantSpec) or not isinstance(q.placement, ScalePlacement):
            raise DescriptionError(f"quant is a QuantSpec with a ScalePlacement, not {q!r}")
        if (
            isinstance(q.values_per_scale, bool)
            or not isinstance(q.values_per_scale, int)
            or q.values_per_scale <= 0
        ):
            raise DescriptionError(
                f"quant.values_per_scale must be a positive int, got {q.values_per_scale!r}"
            )
        if d.regions and q.placement is not ScalePlacement.BLOCK_REGION:
            raise DescriptionError(
                f"regions are a blocked page (BLOCK_REGION), but quant says {q.placement.name}"
            )
    for k in d.dim_strides:
        if not 0 <= k < len(d.dims):
            raise DescriptionError(f"a stride override for dim {k} is out of range for {len(d.dims)} dims")
    for a, n in d.extents.items():
        if not isinstance(a, Axis):
            raise DescriptionError(f"extents key {a!r} is not an Axis")
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n <= 0:  # NumPy integers too
            raise DescriptionError(f"extent of {a.value} must be a positive int, got {n!r}")


# -- from a layout ---------------------------------------------------------------------


def _axis(token: Token) -> Axis:
    assert token.role is not None
    return _ROLE_AXIS[token.role]


def _dims(layout: Layout) -> tuple[tuple[tuple[Axis, ...], ...], dict[Axis, int], tuple[RegionPart, ...]]:
    """The dims, the extents literals fix, and the region parts."""
    heads = algebra.symbol_of(layout, Role.HEAD) is not None
    # a singleton outer to the tokens, the blocks or a layer axis stays a bare size-1
    # dim: as the one head it would make the layout read HND, heads outside blocks or
    # layers inside heads, which a layout without heads is not
    inner_at = max(
        *(
            next((i for i, t in enumerate(layout.tensor) if role in t.roles), len(layout.tensor))
            for role in (Role.TOKEN, Role.BLOCK)
        ),
        next((i for i, t in enumerate(layout.tensor) if Role.LAYER in t.roles), -1),
    )
    dims: list[tuple[Axis, ...]] = []
    extents: dict[Axis, int] = {}
    regions: list[RegionPart] = []
    for at, token in enumerate(layout.tensor):
        if token.region is not None:
            if not regions:
                dims.extend([(Axis.N,), (Axis.C,)])
            regions.append(RegionPart(token.name, token.region.width, token.region.dtype))
            continue
        fold: list[Axis] = []
        for part in token.parts:
            if part.role is not None:
                fold.append(_axis(part))
                if part.literal is not None:
                    extents[_axis(part)] = part.literal
            elif not heads and at > inner_at:  # a singleton where a head axis would be: the one head
                fold.append(Axis.H)
                extents[Axis.H] = 1
        dims.append(tuple(fold))
    if regions:
        extents[Axis.C] = sum(r.width for r in regions)
    return tuple(dims), extents, tuple(regions)


def _packing(layout: Layout) -> KVPacking:
    if layout.is_fused_packed:
        return KVPacking.FUSED
    if layout.has_kv:
        return KVPacking.SPLIT
    return KVPacking.SINGLE if layout.is_single_kv else KVPacking.SHARED


def describe(
    layout: Layout | EngineKVFormat | int | str,
    sizes: Mapping[str, int] | None = None,
    *,
    storage_dtype: str = "",
    block_stride: int | None = None,
) -> LayoutDescription:
    """The description of a format (enum, value or name) or a parsed layout.

    ``sizes`` (token names, as everywhere) fill in the extents; ``block_stride`` (elements
    between blocks of dim 0) overrides the block dim's stride when it is not tight. It is
    checked as ``make_page_buffer_shape_desc`` checks one: only a layout whose dim 0 is
    its block axis takes it, and never smaller than a block (so ``sizes`` must give every
    size of a block).
    """
    if isinstance(layout, str) and not _known(layout):
        from kvlayout.layout.parser import parse

        layout = parse(layout)
    elif not isinstance(layout, Layout):
        from kvlayout.layout.formats import layout_of

        layout = layout_of(layout)
    dims, extents, regions = _dims(layout)
    for level in layout.lists:  # a literal list level (the [K, V] pair) fixes its extent
        if level.literal is not None:
            extents[_axis(level)] = level.literal
    if sizes:
        s = algebra.resolve_sizes(layout, sizes)
        for role, axis in _ROLE_AXIS.items():
            n = algebra.size_of(layout, s, role)
            if n is not None and axis not in extents:
                extents[axis] = n
        packed = next((t for t in layout.tensor if t.fuses and set(t.roles) == {Role.KV, Role.ELEMENT}), None)
        if Axis.C not in extents and packed is not None:
            pair = math.prod(p.literal for p in packed.parts if p.literal is not None)  # K and V side by side
            if s.get(packed.name, 1) % pair == 0:
                extents[Axis.C] = s[packed.name] // pair
    lists = tuple(_axis(t) for t in layout.lists)
    grouping = _GROUPING_LISTS.get(lists)
    if grouping is None:
        levels = "".join(f"[{a.value}]" for a in lists)
        raise DescriptionError(f"{layout}: list levels {levels} are none of the groupings")
    desc = LayoutDescription(
        grouping=grouping,
        kv_packing=_packing(layout),
        dims=dims,
        extents=extents,
        regions=regions,
        # region widths count bytes: a blocked page is stored as raw bytes
        storage_dtype=storage_dtype or ("uint8" if regions else ""),
        name=str(layout),
    )
    return (
        desc.with_block_stride(_checked_block_stride(layout, sizes, block_stride)) if block_stride else desc
    )


def _checked_block_stride(layout: Layout, sizes: Mapping[str, int] | None, block_stride: object) -> int:
    """The algebra's checks of a caller's block stride (those the binder applies)."""
    stride = as_int(block_stride, "block_stride")
    if stride < 0:
        raise DescriptionError(f"a block stride is a non-negative int, got {stride}")
    if not layout.has_leading_block_axis:
        raise DescriptionError(f"{layout}: dim 0 is not the block axis, so a block stride cannot apply")
    try:
        algebra.tensor_strides(layout, sizes or {})
    except SizeError as exc:
        raise DescriptionError(
            f"a block stride of {stride} is checked against a block's elements, so it needs the block's "
            f"sizes: {exc}"
        ) from None
    try:
        algebra.tensor_strides(layout, sizes or {}, stride)
    except SizeError as exc:
        raise DescriptionError(str(exc)) from None
    return stride


def _known(name: str) -> bool:
    from kvlayout._generated.formats import EngineKVFormat

    return name in EngineKVFormat.__members__


class _CanonicalDescriptions(Mapping[str, LayoutDescription]):
    """Each format's canonical description by name, built on first use (the formats are
    generated, and this module is imported by the code generator)."""

    def __init__(self) -> None:
        self._table: dict[str, LayoutDescription] | None = None
        self._by_key: dict[tuple[object, ...], str] = {}

    def _built(self) -> dict[str, LayoutDescription]:
        if self._table is None:
            from kvlayout._generated.formats import LAYOUTS

            table = {fmt.name: describe(layout) for fmt, layout in LAYOUTS.items()}
            self._by_key = {d.key(): name for name, d in table.items()}
            self._table = table
        return self._table

    def __getitem__(self, name: str) -> LayoutDescription:
        return self._built()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._built())

    def __len__(self) -> int:
        return len(self._built())

    def __repr__(self) -> str:
        return f"ENGINE_KV_FORMAT_DESCRIPTORS({', '.join(self)})"

    def name_of(self, desc: LayoutDescription) -> str | None:
        self._built()
        return self._by_key.get(desc.key())


ENGINE_KV_FORMAT_DESCRIPTORS: Mapping[str, LayoutDescription] = _CanonicalDescriptions()
"""Every format's canonical description (its structure and literal extents), by name."""


def from_engine_kv_format(fmt: EngineKVFormat | int | str) -> LayoutDescription:
    """A format's canonical description: the entry of :data:`ENGINE_KV_FORMAT_DESCRIPTORS`
    (``describe(fmt)`` builds a fresh one, with sizes if given)."""
    from kvlayout.layout.formats import as_format

    return ENGINE_KV_FORMAT_DESCRIPTORS[as_format(fmt).name]


def to_engine_kv_format_name(desc: LayoutDescription) -> str:
    """The name of the format whose structure the description has (extents, dtypes and
    stride overrides do not matter); :class:`DescriptionError` when no format has it."""
    if not isinstance(desc, LayoutDescription):
        raise TypeError(f"expected a LayoutDescription, not {type(desc).__name__}")
    assert isinstance(ENGINE_KV_FORMAT_DESCRIPTORS, _CanonicalDescriptions)
    name = ENGINE_KV_FORMAT_DESCRIPTORS.name_of(desc)
    if name is None:
        dims = " ".join(_fold(f) for f in desc.dims)
        raise DescriptionError(
            "no EngineKVFormat member has this structure "
            f"({desc.grouping.name}, {desc.kv_packing.name}, dims {dims})"
        )
    return name


def to_engine_kv_format(desc: LayoutDescription) -> EngineKVFormat:
    """The format whose structure the description has (see :func:`to_engine_kv_format_name`)."""
    from kvlayout._generated.formats import EngineKVFormat

    return EngineKVFormat[to_engine_kv_format_name(desc)]


def with_block_stride(desc: LayoutDescription, block_stride_elems: int) -> LayoutDescription:
    """LMCache's function form of :meth:`LayoutDescription.with_block_stride`."""
    return desc.with_block_stride(block_stride_elems)
