"""Reading a normalized registration as a format's layout: list levels, then the tensors
in pointer-table order, every one checked.

A structure (or one entry of a layer list) is read along the layout's list levels; the
tensors are taken in pointer-table order and split into planes (the entries of a plane
list level, ``NP``; one plane otherwise). Each plane's first tensor gives the sizes;
every tensor of the plane must then have the layout's shape (literal axes and region
widths included), the first's dtype and device, and the layout's strides on every axis
longer than 1, dim 0 widened by one block stride where dim 0 is the block axis.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, NoReturn

import torch

from kvlayout._generated.formats import LAYOUTS, EngineKVFormat
from kvlayout.errors import KVLayoutError, SizeError
from kvlayout.layout import algebra
from kvlayout.layout.ast import Layout
from kvlayout.layout.vocabulary import Role
from kvlayout.registration.nesting import Path, at, describe_path, leaves, not_strided

__all__ = [
    "Bound",
    "LayerPaths",
    "LayerTable",
    "PlaneShape",
    "RegistrationError",
    "bind_layers",
    "bind_structure",
]


class RegistrationError(KVLayoutError):
    """A registration that does not fit the format it is read in, or cannot be served as
    given (tensors of one engine group overlapping in memory, a layer in no group).

    Example::

        kvlayout.bind([t, t], "NL_X_NB_BS_HS")
        RegistrationError: kv[1] and kv[0] overlap in memory (...); the tensors of engine
        group 0 must be disjoint ...
    """


class PlaneShape(NamedTuple):
    """What one plane's tensors share (the same object for every layer bound alike)."""

    shape: tuple[int, ...]
    sizes: Mapping[str, int]  # the layout's sizes read off the tensors (a page axis stays folded)
    block_stride: int | None  # dim 0's stride where dim 0 is the block axis, else None
    dtype: torch.dtype
    device: torch.device


class Bound(NamedTuple):
    """A structure, or one layer of a layer list, read as a format."""

    format: EngineKVFormat
    list_sizes: Mapping[str, int]
    shapes: tuple[PlaneShape, ...]
    key: tuple[object, ...]  # what layers must share to be one kernel group
    leaves: tuple[tuple[torch.Tensor, ...], ...]  # per plane, in pointer-table order
    paths: tuple[tuple[Path, ...], ...]  # where each of them sits


def _fail(problem: str) -> NoReturn:
    raise RegistrationError(problem)


def _read_lists(kv: Any, layout: Layout, root: str, layer: int | None) -> tuple[dict[str, int], list[Path]]:
    """The list levels' sizes (read along entry 0, or along ``layer`` of a layer list)
    and the pointer table's paths, for the whole structure or one layer."""
    sizes: dict[str, int] = {}
    node, path = kv, list[int]()
    for level in layout.lists:
        where = describe_path(path, root)
        if isinstance(node, torch.Tensor) or not isinstance(node, (list, tuple)):
            _fail(f"{where} is a {type(node).__name__}, but {layout} has a list level here")
        n = len(node)
        if level.literal is not None and n != level.literal:
            _fail(f"{where} has {n} entries; {layout} needs {level.literal} here")
        if n == 0:
            _fail(f"{where} is empty")
        if level.literal is None:
            sizes[level.name] = n
        index = layer if layer is not None and level.role is Role.LAYER else 0
        node = node[index]
        path.append(index)
    return sizes, _pointer_paths(layout, tuple(sizes.items()), layer)


@functools.lru_cache(maxsize=1024)
def _pointer_paths(layout: Layout, sizes: tuple[tuple[str, int], ...], layer: int | None) -> list[Path]:
    return layout.pointer_order(dict(sizes), None if layer is None else [layer])


@functools.lru_cache(maxsize=1024)
def _tight(layout: Layout, sizes: tuple[tuple[str, int], ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The tensors' shape and tight strides for some sizes (the algebra's, remembered:
    registrations repeat their shapes)."""
    s = dict(sizes)
    return layout.tensor_shape(s), layout.tensor_strides(s)


def _tensor_sizes(layout: Layout, leaf: torch.Tensor, where: str) -> dict[str, int]:
    """Every size the layout reads off one tensor's axes."""
    rank = layout.tensor_rank
    shape = leaf.shape
    if len(shape) != rank:
        _fail(f"{where} has rank {len(shape)} (shape {list(shape)}); {layout} needs rank {rank}")
    sizes = {symbol: int(shape[axis]) for symbol, axis in algebra.tensor_size_axes(layout)}
    try:
        algebra.check_choices(layout, sizes)
    except SizeError as exc:
        _fail(f"{where} (shape {list(shape)}): {exc}")
    return sizes


_SHARED_ROLES = (Role.LAYER, Role.BLOCK, Role.TOKEN, Role.PAGE)
"""What the planes of one layer must agree on (their rows are concatenated)."""


def _block_stride(layout: Layout, sizes: Mapping[str, int], leaf: torch.Tensor, where: str) -> int | None:
    """The tensor's block stride (None where dim 0 is not the block axis); raises unless
    every axis longer than 1 has the layout's stride, dim 0 widened by one block stride.
    A size-1 axis addresses nothing, so its stride is not read."""
    shape, stride = leaf.shape, leaf.stride()
    expected = tight = _tight(layout, tuple(sizes.items()))[1]
    block: int | None = None
    if leaf.numel() == 0:  # no element to address: its strides say nothing
        return int(tight[0]) if layout.has_leading_block_axis else None
    if layout.has_leading_block_axis:
        block = int(stride[0]) if shape[0] > 1 else int(tight[0])
        if block != tight[0]:
            try:
                expected = layout.tensor_strides(sizes, block)
            except SizeError as exc:
                _fail(f"{where} (shape {list(shape)}, strides {list(stride)}): {exc}")
    pairs = zip(shape, stride, expected, strict=True)
    wrong = [a for a, (n, got, want) in enumerate(pairs) if n > 1 and got != want]
    if not wrong:
        return block
    if wrong == [0] and stride[0] > expected[0]:
        _fail(
            f"{where} has dim-0 padding ({stride[0] - expected[0]} elements per dim-0 row; shape "
            f"{list(shape)}, strides {list(stride)}), but dim 0 of {layout} is not its block axis, so "
            "no block stride can describe it; transfers would misread it"
        )
    axis = wrong[-1]  # the innermost wrong stride: the outer ones follow from it
    allowed = (
        "only its blocks, dim 0, may be padded apart, alike in every tensor"
        if layout.has_leading_block_axis
        else "its dim 0 is not the block axis, so no dim may be padded"
    )
    ones = [a for a, n in enumerate(shape) if n == 1]
    # a size-1 dim's stride is arbitrary, so where it sits was read, not seen (vLLM's one-head
    # [NB, 1, N, C] is also one block of N heads, and a block of one token reads as heads)
    ambiguous = (
        f"; its size-1 dim {ones[0]} may be another axis than the one it was read as: the size hints "
        "(num_kv_heads, tokens_per_block) say which"
        if ones
        else ""
    )
    _fail(
        f"{where} has strides {list(stride)}; {layout} with these sizes needs {list(expected)}: dim {axis} "
        f"({layout.tensor[axis].name}, size {shape[axis]}) has stride {stride[axis]}, not {expected[axis]} "
        f"({allowed}){ambiguous}"
    )


def bind_structure(
    kv: Any, fmt: EngineKVFormat, root: str, layer: int | None = None, *, trusted: bool = False
) -> Bound:
    """Read a structure (or one layer of a layer list) as ``fmt``; every tensor checked.

    ``trusted``: detection already checked that every tensor has the first one's shape,
    dtype and device and is contiguous (the common registration), so the others are
    only collected.
    """
    layout = LAYOUTS[fmt]
    list_sizes, paths = _read_lists(kv, layout, root, layer)
    entries: list[tuple[Path, torch.Tensor]] = []
    for path in paths:
        leaf = at(kv, path, root=root)
        if not isinstance(leaf, torch.Tensor):
            _fail(f"{describe_path(path, root)} is a {type(leaf).__name__}, not a tensor ({layout})")
        problem = not_strided(leaf)
        if problem is not None:
            raise TypeError(f"{describe_path(path, root)} {problem}")
        entries.append((path, leaf))
    under = kv if layer is None else kv[layer]
    if not trusted and not isinstance(under, torch.Tensor):
        top: Path = () if layer is None else (layer,)
        found = sum(1 for _ in leaves(under, root=describe_path(top, root)))
        if found != len(paths):
            lengths = " x ".join(str(n) for n in layout.list_shape(list_sizes)) or "1"
            _fail(
                f"{describe_path(top, root)} holds {found} tensors, but {layout} with list levels {lengths} "
                f"(read along entry 0) has {len(paths)}: its lists are of unequal lengths"
            )
    level = algebra.level_of(layout, Role.ELEMENT)  # a list level of row planes (NP), if any
    count = list_sizes.get(layout.lists[level].name, 1) if level is not None else 1
    planes = []
    for plane in range(count):
        mine = [e for e in entries if level is None or e[0][level] == plane]
        planes.append(_bind_plane(layout, list_sizes, level, mine, root, trusted))
    first = planes[0][0]
    for shape, mine in planes[1:]:
        if shape.device != first.device:
            _fail(
                f"{describe_path(mine[0][0], root)} is on {shape.device}, but the first plane is on "
                f"{first.device}"
            )
        if any(layout.size_of(shape.sizes, r) != layout.size_of(first.sizes, r) for r in _SHARED_ROLES):
            shared = ", ".join(s for r in _SHARED_ROLES if (s := layout.symbol_of(r)) is not None)
            _fail(
                f"{layout}: the planes of a layer must share {shared} "
                f"({dict(first.sizes)} vs {dict(shape.sizes)})"
            )
    shapes = tuple(shape for shape, _ in planes)
    key = (fmt, tuple((s.shape, s.block_stride, s.dtype, s.device) for s in shapes))
    return Bound(
        fmt,
        list_sizes,
        shapes,
        key,
        tuple(tuple(leaf for _, leaf in mine) for _, mine in planes),
        tuple(tuple(path for path, _ in mine) for _, mine in planes),
    )


def _bind_plane(
    layout: Layout,
    list_sizes: Mapping[str, int],
    level: int | None,
    entries: list[tuple[Path, torch.Tensor]],
    root: str,
    trusted: bool,
) -> tuple[PlaneShape, list[tuple[Path, torch.Tensor]]]:
    path0, leaf0 = entries[0]
    first = describe_path(path0, root)
    sizes = dict(list_sizes)
    if level is not None:
        sizes[layout.lists[level].name] = 1  # each plane is its own pointer table (the level's own size)
    sizes.update(_tensor_sizes(layout, leaf0, first))
    try:
        expected = _tight(layout, tuple(sizes.items()))[0]
    except SizeError as exc:
        _fail(f"{first}: {exc}")
    dtype, device = leaf0.dtype, leaf0.device
    if tuple(leaf0.shape) != expected:
        _fail(f"{first} has shape {list(leaf0.shape)}, but {layout} needs {list(expected)} there")
    block = _block_stride(layout, sizes, leaf0, first)
    if not trusted:
        for path, leaf in entries[1:]:
            where = describe_path(path, root)
            if tuple(leaf.shape) != expected:
                _fail(
                    f"{where} has shape {list(leaf.shape)}, but {first} makes {layout} {list(expected)}; "
                    "is this cache in another format?"
                )
            if leaf.dtype != dtype or leaf.device != device:
                _fail(f"{where} is {leaf.dtype} on {leaf.device}, but {first} is {dtype} on {device}")
            other = _block_stride(layout, sizes, leaf, where)
            if other != block:
                _fail(
                    f"{where} and {first} have dim-0 strides {other} and {block}; the tensors of one "
                    "plane share one block stride"
                )
    return PlaneShape(expected, sizes, block, dtype, device), entries


class LayerTable(NamedTuple):
    """A layer list read layer by layer: each layer's key (None: not read) and, per key,
    the layer read in full that stands for every layer alike."""

    keys: list[tuple[object, ...] | None]
    templates: dict[tuple[object, ...], Bound]

    def leaves(self, kv: Sequence[Any], layers: Sequence[int], plane: int) -> tuple[torch.Tensor, ...]:
        """One plane's tensors of some layers (all with one key), in pointer-table order."""
        template = self.templates[self.keys[layers[0]]]  # type: ignore[index]
        paths = template.paths[plane]
        if len(paths) == 1 and len(paths[0]) == 1:  # one tensor per layer: the entry itself
            return tuple(kv) if len(layers) == len(kv) else tuple(kv[i] for i in layers)
        return tuple(at(kv, (i, *p[1:])) for i in layers for p in paths)  # type: ignore[misc]

    def paths(self, layers: Sequence[int], plane: int) -> LayerPaths:
        template = self.templates[self.keys[layers[0]]]  # type: ignore[index]
        return LayerPaths(tuple(layers), tuple(p[1:] for p in template.paths[plane]))


class LayerPaths(Sequence[Path]):
    """Where a plane's tensors sit in a layer list: ``(layer, *inner)`` for each layer and
    each inner path, built only when read (messages rarely need them)."""

    __slots__ = ("inner", "layers")

    def __init__(self, layers: tuple[int, ...], inner: tuple[Path, ...]) -> None:
        self.layers = layers
        self.inner = inner

    def __len__(self) -> int:
        return len(self.layers) * len(self.inner)

    def __getitem__(self, index: int) -> Path:  # type: ignore[override]
        layer, k = divmod(range(len(self))[index], len(self.inner))
        return (self.layers[layer], *self.inner[k])


_TEMPLATES: dict[tuple[object, ...], Bound] = {}
"""Layer entries read before, by signature (tensor-free: shapes, sizes, keys, paths), so
a registration of known shapes is read without the algebra. Keys are interned here, so
layers alike share one key object."""


def _template(kv: Sequence[Any], fmt: EngineKVFormat, root: str, i: int) -> Bound:
    """Layer ``i`` read in full, or its reading remembered from an entry alike."""
    sig = _signature(kv[i], fmt)
    known = _TEMPLATES.get(sig) if sig is not None else None
    if known is not None:
        return known
    b = bind_structure(kv, fmt, root, i)
    b = b._replace(leaves=(), key=_KEYS.setdefault(b.key, b.key))
    if sig is not None:
        if len(_TEMPLATES) >= 4096:  # both caches grow with the shapes seen: start over together
            _TEMPLATES.clear()
            _KEYS.clear()
        _TEMPLATES[sig] = b
    return b


_KEYS: dict[tuple[object, ...], tuple[object, ...]] = {}


def bind_layers(
    kv: Sequence[Any], formats: Sequence[EngineKVFormat | None], root: str, trusted: bool
) -> LayerTable:
    """Each entry of a layer list read in its format (None: not read). Entries alike
    (same format, shapes, strides, dtypes, device) are read once: one template each,
    without tensors (the table takes them from ``kv``)."""
    first = formats[0] if formats else None
    if trusted and first is not None and all(f is first for f in formats):
        # detection saw every tensor alike and contiguous: the first stands for all
        t = _template(kv, first, root, 0)
        return LayerTable([t.key] * len(kv), {t.key: t})
    keys: list[tuple[object, ...] | None] = [None] * len(kv)
    templates: dict[tuple[object, ...], Bound] = {}
    for i, fmt in enumerate(formats):
        if fmt is not None:
            t = _template(kv, fmt, root, i)
            keys[i] = t.key
            templates.setdefault(t.key, t)
    return LayerTable(keys, templates)


def _signature(entry: object, fmt: EngineKVFormat) -> tuple[object, ...] | None:
    """What makes two layer entries read alike (None: read this one in full)."""
    tensors = (
        [entry] if isinstance(entry, torch.Tensor) else entry if isinstance(entry, (list, tuple)) else ()
    )
    if not tensors or not all(isinstance(t, torch.Tensor) and not_strided(t) is None for t in tensors):
        return None
    parts = tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors if isinstance(t, torch.Tensor))
    return (fmt, type(entry), parts)


def check_block_stride(layout: Layout, sizes: Mapping[str, int], stride: int) -> None:
    """The algebra's checks of a block stride given by a caller."""
    try:
        layout.tensor_strides(sizes, stride)
    except SizeError as exc:
        raise RegistrationError(str(exc)) from None


def tight_block(shape: Sequence[int]) -> int:
    """Elements of one dim-0 row without padding."""
    return math.prod(shape[1:])
