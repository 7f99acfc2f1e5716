"""A registration as plain data: what a peer needs to plan block maps against it.

:func:`~kvlayout.registration.describing.describe` reads a bound registration
(``registration.describe(shard=...)``) into a :class:`RegistrationDescription`, this
module's data: per kernel group its format, layer indices, engine
group and block size, and per plane its sizes, shape, strides, block stride, dtype and
every tensor's address; the device and the tensor-parallel shard. ``to_json`` and
``RegistrationDescription.from_json`` carry it between processes (the handshake of a
P/D transfer). ``from_json`` treats its input as untrusted: every field is typed and
bounded, the shapes and strides must be what the format's layout gives for the sizes,
and no two described tensors may share a byte (but a layer's that shares another layer's
KV cache whole, its addresses repeated), so every run a block map plans against a
description lies inside tensors the peer said it has. Counts are checked against each
other before any list is built, and the overlap check is bounded (O(n log n) time and O(n)
memory for tensors of one shape, at most MAX_INTERLEAVED pairs of different shapes), so
no description costs much more than its size. ``group(i)`` and ``for_layers(ids)`` take
part of a description after the handshake (one kernel group; some layers, as a pipeline
stage maps them), naming only memory the peer described.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvlayout._generated.formats import LAYOUTS, EngineKVFormat
from kvlayout.errors import KVLayoutError, SizeError, abbreviated, as_int, index_ranges
from kvlayout.layout.algebra import (
    is_latent,
    level_of,
    list_shape,
    num_heads,
    resolve_sizes,
    size_of,
    size_symbols,
    split_pages,
    symbol_of,
    with_size,
)
from kvlayout.layout.ast import Layout
from kvlayout.layout.dtypes import DTYPE_SIZES
from kvlayout.layout.vocabulary import Role
from kvlayout.registration.address_space import MAX_END, MAX_END_TEXT, NULL_PAGE
from kvlayout.registration.memory import (
    SHARE_WHOLE,
    Run,
    alias_refusal,
    check_disjoint,
    partly_shared,
)
from kvlayout.registration.opaque import (
    MAX_ARRAY_DIMS,
    MAX_PAGE_ARRAYS,
    MAX_PAGE_LAYOUT,
    OpaquePages,
    PageArray,
)
from kvlayout.registration.shards import Shard, ShardError, heads_are_the_model_s

__all__ = [
    "GroupDescription",
    "PeerDescriptionError",
    "PlaneDescription",
    "RegistrationDescription",
]

VERSION = 2
"""The newest description version: 2 adds opaque pages' state arrays (a description
without them is still written as :data:`VERSION_WITHOUT_ARRAYS`, which readers before
them read too)."""
VERSION_WITHOUT_ARRAYS = 1
DEVICE_TYPES = ("cpu", "cuda")
MAX_SIZE = 1 << 32  # any one size (blocks, tokens, heads, ...)
MAX_SPAN = 1 << 48  # bytes one tensor may span
MAX_ADDRESS = 1 << 64
MAX_TENSORS = 1 << 20
MAX_LAYERS = 1 << 16
MAX_TEXT = 64 << 20
MAX_INTERLEAVED = 1 << 20  # pairs of tensors of different shapes within each other's spans
_ENGINE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")


class PeerDescriptionError(KVLayoutError):
    """A registration description that is malformed, out of bounds or inconsistent."""


@dataclass(frozen=True)
class PlaneDescription:
    """Tensors of one geometry: ``addresses`` in the layout's pointer order. An address
    that comes again is the same tensor again: a layer that shares an earlier layer's KV
    cache (vLLM's cross-layer KV sharing registers the target's tensor for it)."""

    dtype: str
    sizes: tuple[tuple[str, int], ...]  # the layout's sizes as the tensors give them
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # elements
    block_stride: int | None  # dim 0's stride where dim 0 is the block axis, else None
    addresses: tuple[int, ...]

    @property
    def element_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    def sizes_dict(self) -> dict[str, int]:
        return dict(self.sizes)

    @property
    def repeats(self) -> tuple[int, ...]:
        """Pointer positions whose tensor an earlier position holds (shared layers)."""
        seen: set[int] = set()
        out = []
        for k, a in enumerate(self.addresses):
            if a in seen:
                out.append(k)
            seen.add(a)
        return tuple(out)

    def extent(self) -> tuple[int, int, int]:
        """(period, block, blocks) in bytes: one block when tight, dim-0 rows when padded."""
        es = self.element_size
        size = math.prod(self.shape) * es
        if len(self.shape) >= 2 and self.shape[0] > 1 and self.strides[0] > math.prod(self.shape[1:]):
            return self.strides[0] * es, size // self.shape[0], self.shape[0]
        return size, size, 1

    @property
    def span(self) -> int:
        """Bytes from a tensor's first byte to past its last (padding between blocks included)."""
        period, block, blocks = self.extent()
        return (blocks - 1) * period + block


@dataclass(frozen=True)
class GroupDescription:
    """One kernel group: layers that share a format and a geometry."""

    format: EngineKVFormat
    layers: tuple[int, ...]
    engine_group: int
    block_size: int | None  # tokens per block; None for a folded page axis not split yet
    planes: tuple[PlaneDescription, ...]
    opaque_pages: OpaquePages | None = None  # rows that are a page's bytes (vLLM's group edits)

    @property
    def layout(self) -> Layout:
        return LAYOUTS[self.format]

    def label(self) -> str:
        shapes = " + ".join(str(list(p.shape)) for p in self.planes)
        return f"{self.format.name} {shapes} {self.planes[0].dtype}"


@dataclass(frozen=True)
class RegistrationDescription:
    """A registration as data (see the module docstring); build one with
    ``registration.describe(shard=...)`` or :meth:`from_json`."""

    groups: tuple[GroupDescription, ...]
    device_type: str
    device_index: int | None
    shard: Shard | None
    engine: str | None = None
    # The description this one is a kernel group of (what group() made it from), None for
    # one received whole: every tensor the peer described, which a block map of this group
    # alone does not reach (a peer's staging buffer must lie apart from all of them). Not
    # data: neither compared, hashed nor written to JSON.
    whole: RegistrationDescription | None = field(default=None, compare=False, repr=False)

    def group(self, index: int) -> RegistrationDescription:
        """The description of kernel group ``index`` alone (what a block map takes); its
        ``whole`` is the description it was taken from."""
        index = as_int(index, "group index")
        if not 0 <= index < len(self.groups):
            raise PeerDescriptionError(f"group {index} is out of range for {len(self.groups)} kernel groups")
        return RegistrationDescription(
            (self.groups[index],), self.device_type, self.device_index, self.shard, self.engine,
            self.whole or self,
        )  # fmt: skip

    def for_layers(self, layer_ids: Iterable[int]) -> RegistrationDescription:
        """The description of the layers ``layer_ids`` alone, by the numbers it gives its
        layers (those a block map pairs: the peer's ``numbered`` ids, else positions from
        0), which the cut keeps. What a map from a registration holding only some of the
        peer's layers takes (a pipeline stage against a peer holding every layer): made
        here after the handshake, from what the peer described, it names only memory of
        the peer's tensors. A layer list keeps those layers' tensors (a layer sharing
        another's KV cache keeps its address); a tensor holding a layer axis is cut to the
        range, its address moved by the layer stride, as a view ``pool[:, a:b]`` of it
        would be described, and refused where that view is not contiguous but for padding
        between blocks (layers inside another axis). Kernel groups holding none of the
        layers are left out; ``whole`` is the description it was cut from (a peer's
        staging buffer lies apart from every tensor the peer described)."""
        taken = tuple(itertools.islice(layer_ids, MAX_LAYERS + 1))  # a range(10**9) is not built
        if len(taken) > MAX_LAYERS:
            raise PeerDescriptionError(
                f"for_layers: more than {MAX_LAYERS} layer ids, past any description's"
            )
        ids = [as_int(i, f"layer_ids[{k}]") for k, i in enumerate(taken)]
        if not ids:
            raise PeerDescriptionError("for_layers: layer_ids names no layer")
        held = sorted(i for g in self.groups for i in g.layers)
        wanted = set(ids)
        if len(wanted) != len(ids):
            again = sorted({i for i in ids if ids.count(i) > 1})
            raise PeerDescriptionError(f"for_layers: layer_ids names layer(s) {index_ranges(again)} twice")
        missing = sorted(wanted.difference(held))
        if missing:
            raise PeerDescriptionError(
                f"for_layers: layer(s) {index_ranges(missing)} are not in the description, which holds "
                f"layers {index_ranges(held)} (a cut keeps the description's layer numbers)"
            )
        if len(wanted) == len(held):
            return self
        groups = tuple(
            _group_for_layers(f"kernel group {k}", g, wanted)
            for k, g in enumerate(self.groups)
            if wanted.intersection(g.layers)
        )
        return RegistrationDescription(
            groups, self.device_type, self.device_index, self.shard, self.engine, self.whole or self
        )

    @functools.cached_property
    def tensor_spans(self) -> np.ndarray:
        """``(K, 2)`` uint64, read-only: every described tensor's first byte and byte
        span (padding between blocks included), group by group, plane by plane, in pointer
        order (a shared layer's tensor again where it repeats); worked out once."""
        spans = np.array(
            [(a, plane.span) for g in self.groups for plane in g.planes for a in plane.addresses],
            dtype=np.uint64,
        ).reshape(-1, 2)
        spans.setflags(write=False)
        return spans

    def tensor_label(self, k: int) -> str:
        """Which tensor row ``k`` of :attr:`tensor_spans` is: its kernel group and place there."""
        index, total = as_int(k, "tensor"), len(self.tensor_spans)
        if not 0 <= index < total:  # a negative k would name a tensor that is not its row
            raise PeerDescriptionError(f"tensor {k} is out of range for {total} described tensors")
        for g, group in enumerate(self.groups):
            for i, plane in enumerate(group.planes):
                if index < len(plane.addresses):
                    planes = f", plane {i}" if len(group.planes) > 1 else ""
                    return (
                        f"kernel group {g} (engine group {group.engine_group}, layers "
                        f"{index_ranges(group.layers)}: {group.label()}){planes}, its tensor {index}"
                    )
                index -= len(plane.addresses)
        raise AssertionError(f"tensor {k} of {total} not in the planes")  # tensor_spans lists these rows

    def to_json(self) -> str:
        return json.dumps(to_data(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> RegistrationDescription:
        """Parse and check a description from an untrusted peer (see the module docstring)."""
        if isinstance(text, bytes):
            if len(text) > MAX_TEXT:
                raise PeerDescriptionError(f"the description is {len(text)} bytes, more than {MAX_TEXT}")
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PeerDescriptionError(f"the description is not UTF-8 text: {exc}") from None
        if not isinstance(text, str):
            raise TypeError(f"from_json takes str or bytes, not {type(text).__name__}")
        if len(text) > MAX_TEXT:
            raise PeerDescriptionError(f"the description is {len(text)} characters, more than {MAX_TEXT}")
        try:
            data = json.loads(
                text, parse_constant=_no_constant, parse_int=_int_literal, object_pairs_hook=_object
            )
        except PeerDescriptionError:
            raise
        except RecursionError:  # a real description nests a few levels; this one, thousands
            raise PeerDescriptionError(
                "the description nests its JSON arrays or objects deeper than the parser reaches "
                "(a description nests a few levels)"
            ) from None
        except ValueError as exc:
            raise PeerDescriptionError(f"the description is not valid JSON: {exc}") from None
        return from_data(data)


# -- cut by layers ------------------------------------------------------------------------


def _layers_resized(layout: Layout, plane: PlaneDescription, layers: int) -> tuple[tuple[str, int], ...]:
    """The plane's sizes, the layer role's set to ``layers`` (in its place)."""
    return tuple(with_size(layout, plane.sizes_dict(), Role.LAYER, layers).items())


def _group_for_layers(where: str, group: GroupDescription, wanted: set[int]) -> GroupDescription:
    """``group`` holding only its layers in ``wanted`` (one at least), numbered as before."""
    positions = [k for k, i in enumerate(group.layers) if i in wanted]
    if len(positions) == len(group.layers):
        return group
    layers = tuple(group.layers[k] for k in positions)
    layout = group.layout
    level = level_of(layout, Role.LAYER)
    if level is not None:  # a list of layers: their tensors, in pointer order
        kept = set(positions)
        planes = []
        for p in group.planes:
            paths = layout.pointer_order(p.sizes_dict())
            addresses = tuple(a for a, path in zip(p.addresses, paths, strict=True) if path[level] in kept)
            planes.append(replace(p, sizes=_layers_resized(layout, p, len(kept)), addresses=addresses))
        return replace(group, layers=layers, planes=tuple(planes))
    label = f"{where} ({group.label()}, layers {index_ranges(group.layers)})"
    first, n = positions[0], len(positions)
    if positions != list(range(first, first + n)):
        raise PeerDescriptionError(
            f"for_layers: {label}: layers {index_ranges(layers)} are not consecutive in its tensors' layer "
            f"axis ({symbol_of(layout, Role.LAYER)}); a tensor's layers are cut as one range, as a view "
            "pool[:, a:b] holds them"
        )
    cut = f"{label}: layers {index_ranges(layers)} are" if n > 1 else f"{label}: layer {layers[0]} is"
    return replace(
        group, layers=layers, planes=tuple(_plane_cut(cut, layout, p, first, n) for p in group.planes)
    )


def _plane_cut(cut: str, layout: Layout, plane: PlaneDescription, first: int, n: int) -> PlaneDescription:
    """Layers ``[first, first + n)`` of a plane whose tensors hold a layer axis: the view
    that keeps the tensors' strides, refused where those are not the layout's for the
    smaller layer extent (contiguous but for padding between blocks, dim 0)."""
    axis = layout.axis_of(Role.LAYER)
    assert axis is not None  # a layout's layers are a list level or an axis (REQUIRED_ROLES)
    sizes = _layers_resized(layout, plane, n)
    resolved = resolve_sizes(layout, dict(sizes))
    shape = layout.tensor_shape(resolved)
    block_stride = None
    if layout.has_leading_block_axis:  # as binding reads a view: dim 0's stride, or tight for one block
        block_stride = plane.strides[0] if shape[0] > 1 else layout.tensor_strides(resolved)[0]
    want = layout.tensor_strides(resolved, block_stride)
    wrong = [
        a for a, (m, got, w) in enumerate(zip(shape, plane.strides, want, strict=True)) if m > 1 and got != w
    ]
    if wrong:  # axes outside the layer axis (dim 0 but a block axis): a range of layers is pieces apart
        # (tokens map 1:1 to axes there: only element regions, innermost, take two)
        names = " and ".join(f"{layout.tensor[a].name} (size {shape[a]})" for a in wrong)
        pieces = math.prod(shape[a] for a in wrong)
        per = " a block" if layout.has_leading_block_axis else ""
        raise PeerDescriptionError(
            f"for_layers: {cut} {pieces} strided pieces{per} of its tensors, not one tensor a "
            f"description holds: {layout} keeps its layer axis ({layout.tensor[axis].name}) inside {names}, "
            "and a description's tensors are contiguous but for padding between blocks; map every layer of "
            "it, or have the peer register those layers apart"
        )
    shift = first * plane.strides[axis] * plane.element_size
    return PlaneDescription(
        plane.dtype, sizes, shape, want, block_stride, tuple(a + shift for a in plane.addresses)
    )


# -- JSON ------------------------------------------------------------------------------


def _shard_json(shard: Shard) -> dict[str, int]:
    out = {"tp_rank": shard.tp_rank, "tp_size": shard.tp_size, "num_kv_heads": shard.num_kv_heads}
    if shard.context_parallel:  # written only where used: a reader without CP refuses these fields
        out |= {"cp_rank": shard.cp_rank, "cp_size": shard.cp_size, "cp_interleave": shard.cp_interleave}
    return out


def to_data(d: RegistrationDescription) -> dict[str, Any]:
    return {
        "kvlayout": "registration-description",
        "version": VERSION
        if any(g.opaque_pages and g.opaque_pages.arrays for g in d.groups)
        else VERSION_WITHOUT_ARRAYS,
        "device": {"type": d.device_type, "index": d.device_index},
        "engine": d.engine,
        "shard": None if d.shard is None else _shard_json(d.shard),
        "groups": [
            {
                "format": g.format.name,
                "layers": list(g.layers),
                "engine_group": g.engine_group,
                "block_size": g.block_size,
                "opaque_pages": None if g.opaque_pages is None else _opaque_json(g.opaque_pages),
                "planes": [
                    {
                        "dtype": p.dtype,
                        "sizes": dict(p.sizes),
                        "shape": list(p.shape),
                        "strides": list(p.strides),
                        "block_stride": p.block_stride,
                        "addresses": list(p.addresses),
                    }
                    for p in g.planes
                ],
            }
            for g in d.groups
        ],
    }


def _no_constant(name: str) -> None:
    raise PeerDescriptionError(f"the description holds {name}, which is not JSON")


_MAX_DIGITS = 64  # no field comes near (the widest is an address below 2**64, 20 digits)


def _int_literal(text: str) -> int:
    """A JSON integer. One of more than ``_MAX_DIGITS`` digits is refused by its length:
    Python's own refusal past 4300 advised raising ``sys.set_int_max_str_digits``, and such
    a number would be quoted whole in the field's message. (Shorter ones out of a field's
    range are refused by the field, which the message names.)"""
    digits = len(text) - text.startswith("-")
    if digits > _MAX_DIGITS:
        raise PeerDescriptionError(
            f"the description holds an integer of {digits} digits ({text[:12]}...), more than any field "
            f"takes ({_MAX_DIGITS}; an address is below 2**64)"
        )
    return int(text)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused where a key comes twice (readers differ on which one wins)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise PeerDescriptionError(f"the description has the key {key[:100]!r} twice in one object")
            seen.add(key)
    return out


def _fields(
    where: str, value: object, keys: Sequence[str], optional: Sequence[str] = ()
) -> Mapping[str, Any]:
    """``value`` as an object with exactly the fields ``keys``, and any of ``optional``."""
    if not isinstance(value, dict):
        raise PeerDescriptionError(f"{where} must be an object, not {_kind(value)}")
    missing = [k for k in keys if k not in value]
    if missing:
        raise PeerDescriptionError(f"{where} has no {', '.join(missing)}")
    extra = sorted(str(k) for k in value if k not in keys and k not in optional)
    if extra:
        shown = ", ".join(_shown(k) for k in extra[:8]) + (
            f" and {len(extra) - 8} more" if len(extra) > 8 else ""
        )
        raise PeerDescriptionError(f"{where} has unknown field(s) {shown}")
    return value


def _shown(value: object) -> str:
    """A peer's value as a message quotes it: its repr (control bytes escaped), abbreviated
    (the description is untrusted: a key or a string may be megabytes)."""
    return abbreviated(repr(value))


def _kind(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _int(where: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PeerDescriptionError(f"{where} must be an integer, not {_kind(value)}")
    if not lo <= value < hi:
        raise PeerDescriptionError(f"{where}={value} is outside [{lo}, {hi})")
    return value


def _list(where: str, value: object, max_len: int) -> list[Any]:
    if not isinstance(value, list):
        raise PeerDescriptionError(f"{where} must be a list, not {_kind(value)}")
    if len(value) > max_len:
        raise PeerDescriptionError(f"{where} has {len(value)} entries, more than {max_len}")
    return value


def _ints(where: str, value: object, max_len: int, lo: int, hi: int) -> tuple[int, ...]:
    """A list of at most ``max_len`` integers in ``[lo, hi)``, each named by its index."""
    return tuple(_int(f"{where}[{i}]", v, lo, hi) for i, v in enumerate(_list(where, value, max_len)))


def from_data(data: object) -> RegistrationDescription:
    top = _fields("description", data, ("kvlayout", "version", "device", "engine", "shard", "groups"))
    if top["kvlayout"] != "registration-description":
        raise PeerDescriptionError(
            f"description.kvlayout is {_shown(top['kvlayout'])}, not 'registration-description'"
        )
    version = _int("description.version", top["version"], VERSION_WITHOUT_ARRAYS, VERSION + 1)
    device = _fields("description.device", top["device"], ("type", "index"))
    if device["type"] not in DEVICE_TYPES:
        raise PeerDescriptionError(
            f"description.device.type is {_shown(device['type'])}, not one of {', '.join(DEVICE_TYPES)}"
        )
    index = None if device["index"] is None else _int("description.device.index", device["index"], 0, 1 << 16)
    if device["type"] == "cpu" and index is not None:
        raise PeerDescriptionError(f"description.device.index is {index}; a cpu device has none (null)")
    engine = top["engine"]
    if engine is not None and (not isinstance(engine, str) or not _ENGINE.fullmatch(engine)):
        raise PeerDescriptionError(
            f"description.engine must be null or an engine name (1 to 64 letters, digits and _.+-), "
            f"not {_kind(engine) if not isinstance(engine, str) else repr(engine[:80])}"
        )
    shard = None
    if top["shard"] is not None:
        s = _fields(
            "description.shard",
            top["shard"],
            ("tp_rank", "tp_size", "num_kv_heads"),
            ("cp_rank", "cp_size", "cp_interleave"),
        )
        values = {
            k: _int(f"description.shard.{k}", s[k], 0, MAX_SIZE if k == "cp_interleave" else 1 << 16)
            for k in s
        }
        try:
            shard = Shard(**values)
        except ShardError as exc:
            raise PeerDescriptionError(f"description.shard: {exc}") from None
    groups_data = _list("description.groups", top["groups"], 1 << 10)
    if not groups_data:
        raise PeerDescriptionError("description.groups is empty")
    groups_list: list[GroupDescription] = []
    left = MAX_TENSORS  # tensors the rest of the description may name
    for i, g in enumerate(groups_data):
        groups_list.append(_group_from(f"description.groups[{i}]", g, left))
        left -= sum(len(p.addresses) for p in groups_list[-1].planes)
        pages = groups_list[-1].opaque_pages
        if version == VERSION_WITHOUT_ARRAYS and pages is not None and pages.arrays:
            raise PeerDescriptionError(
                f"description.groups[{i}].opaque_pages.arrays needs description.version {VERSION}, "
                f"not {version}"
            )
    groups = tuple(groups_list)
    misfit = shard_misfit(groups, shard)
    if misfit is not None:
        assert shard is not None
        i, heads = misfit
        raise PeerDescriptionError(
            f"description.shard {shard} holds {len(shard.heads)} KV heads, but "
            f"description.groups[{i}] has {heads}"
        )
    layers = [i for g in groups for i in g.layers]
    if len(set(layers)) != len(layers):
        raise PeerDescriptionError("description.groups: a layer index appears in two kernel groups")
    _check_memory(groups)
    return RegistrationDescription(groups, device["type"], index, shard, engine)


def shard_misfit(groups: Sequence[GroupDescription], shard: Shard | None) -> tuple[int, int] | None:
    """The first group (index, heads) holding another number of KV heads than ``shard``
    says; None where every group fits (latents are held whole by every rank)."""
    if shard is None:
        return None
    for i, g in enumerate(groups):
        sizes = g.planes[0].sizes_dict()
        heads = num_heads(g.layout, sizes)
        if (
            heads_are_the_model_s(not is_latent(g.layout, sizes), g.opaque_pages)
            and len(shard.heads) != heads
        ):
            return i, heads
    return None


def _group_from(where: str, data: object, left: int) -> GroupDescription:
    """Kernel group ``where``, which may name ``left`` tensors at most."""
    g = _fields(where, data, ("format", "layers", "engine_group", "block_size", "opaque_pages", "planes"))
    name = g["format"]
    if not isinstance(name, str) or name not in EngineKVFormat.__members__:
        raise PeerDescriptionError(f"{where}.format {_shown(name)} is not a kvlayout format name")
    fmt = EngineKVFormat[name]
    layout = LAYOUTS[fmt]
    layers = _ints(f"{where}.layers", g["layers"], MAX_LAYERS, 0, MAX_LAYERS)
    if not layers or len(set(layers)) != len(layers):
        raise PeerDescriptionError(f"{where}.layers must be distinct layer indices, at least one")
    engine_group = _int(f"{where}.engine_group", g["engine_group"], -1, 1 << 16)
    planes_data = _list(f"{where}.planes", g["planes"], 16)
    if not planes_data:
        raise PeerDescriptionError(f"{where}.planes is empty")
    planes_list: list[PlaneDescription] = []
    for i, p in enumerate(planes_data):
        planes_list.append(_plane_from(f"{where}.planes[{i}]", layout, p, left))
        left -= len(planes_list[-1].addresses)
    # bound tensors of these formats make one plane; each is read first, within the tensor bound
    if len(planes_data) > 1 and level_of(layout, Role.ELEMENT) is None:
        raise PeerDescriptionError(
            f"{where}.planes holds {len(planes_data)} planes, but {name} has no list level of row planes: "
            "its tensors are one plane"
        )
    planes = tuple(planes_list)
    first = planes[0].sizes_dict()
    for i, p in enumerate(planes[1:], start=1):
        for role in (Role.LAYER, Role.BLOCK, Role.TOKEN, Role.PAGE):
            a, b = size_of(layout, first, role), size_of(layout, p.sizes_dict(), role)
            if a != b:
                raise PeerDescriptionError(
                    f"{where}.planes[{i}] has {symbol_of(layout, role)}={b}; planes[0] has {a} (planes share "
                    "their layers and blocks)"
                )
    nl = size_of(layout, first, Role.LAYER) or 1
    if len(layers) != nl:
        raise PeerDescriptionError(f"{where}.layers has {len(layers)} entries; the tensors hold {nl} layers")
    _check_sharing(where, layout, layers, planes)
    block_size = g["block_size"]
    tokens = size_of(layout, first, Role.TOKEN)
    if layout.axis_of(Role.BLOCK) is not None and tokens is not None:
        if block_size is not None:
            block_size = _int(f"{where}.block_size", block_size, 1, MAX_SIZE)
        if block_size != tokens:
            raise PeerDescriptionError(
                f"{where}.block_size is {_shown(block_size)}; the tensors have blocks of {tokens}"
            )
    elif block_size is not None:
        block_size = _int(f"{where}.block_size", block_size, 1, MAX_SIZE)
        try:
            split_pages(layout, first, block_size, "block_size")
        except SizeError as e:
            raise PeerDescriptionError(f"{where}: {fmt.name}: {e}") from None
    return GroupDescription(
        fmt, layers, engine_group, block_size, planes, _opaque_from(where, g["opaque_pages"])
    )


def _opaque_json(pages: OpaquePages) -> dict[str, Any]:
    out: dict[str, Any] = {"layout": pages.layout, "rows_are_tokens": pages.rows_are_tokens}
    if pages.arrays:  # only where declared: a description without them reads as before
        out["arrays"] = [
            {"offset": x.offset, "shape": list(x.shape), "dtype": x.dtype, "axis": x.axis,
             "parts": list(x.parts), **({"kv_heads": True} if x.kv_heads else {}),
             **({"replicated": True} if x.replicated else {})}
            for x in pages.arrays
        ]  # fmt: skip
    return out


def _page_array_from(where: str, data: object) -> PageArray:
    x = _fields(where, data, ("offset", "shape", "dtype", "axis", "parts"), ("kv_heads", "replicated"))
    flags = {name: x.get(name, False) for name in ("kv_heads", "replicated")}
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise PeerDescriptionError(f"{where}.{name} {_shown(flag)} is not a boolean")
    shape = _ints(f"{where}.shape", x["shape"], MAX_ARRAY_DIMS, 1, MAX_SIZE)
    parts = _ints(f"{where}.parts", x["parts"], MAX_PAGE_ARRAYS, 1, MAX_SIZE)
    dtype = x["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise PeerDescriptionError(f"{where}.dtype {_shown(dtype)} is not one of {', '.join(DTYPE_SIZES)}")
    offset = _int(f"{where}.offset", x["offset"], 0, MAX_SPAN)
    axis = _int(f"{where}.axis", x["axis"], 0, max(len(shape), 1))
    if math.prod(shape) * DTYPE_SIZES[dtype] >= MAX_SPAN:
        raise PeerDescriptionError(f"{where}: shape {list(shape)} of {dtype} spans 2**48 bytes or more")
    try:
        return PageArray(offset, shape, dtype, axis, parts, **flags)
    except ValueError as e:
        raise PeerDescriptionError(f"{where}: {e}") from None


def _opaque_from(where: str, data: object) -> OpaquePages | None:
    if data is None:
        return None
    o = _fields(f"{where}.opaque_pages", data, ("layout", "rows_are_tokens"), optional=("arrays",))
    layout, rows = o["layout"], o["rows_are_tokens"]
    if not isinstance(layout, str) or not 0 < len(layout) <= MAX_PAGE_LAYOUT or not layout.isprintable():
        raise PeerDescriptionError(
            f"{where}.opaque_pages.layout must be printable text of 1 to {MAX_PAGE_LAYOUT} characters"
        )
    if not isinstance(rows, bool):
        raise PeerDescriptionError(
            f"{where}.opaque_pages.rows_are_tokens must be a boolean, not {_kind(rows)}"
        )
    listed = _list(f"{where}.opaque_pages.arrays", o.get("arrays", []), MAX_PAGE_ARRAYS)
    arrays = tuple(_page_array_from(f"{where}.opaque_pages.arrays[{i}]", x) for i, x in enumerate(listed))
    try:
        return OpaquePages(layout, rows, arrays)
    except ValueError as e:
        raise PeerDescriptionError(f"{where}.opaque_pages: {e}") from None


def _plane_from(where: str, layout: Layout, data: object, left: int) -> PlaneDescription:
    """Plane ``where``, which may name ``left`` tensors at most. Its tensors are counted
    (from the sizes) and bounded before any list of them is built."""
    p = _fields(where, data, ("dtype", "sizes", "shape", "strides", "block_stride", "addresses"))
    dtype = p["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise PeerDescriptionError(f"{where}.dtype {_shown(dtype)} is not one of {', '.join(DTYPE_SIZES)}")
    sizes_data = p["sizes"]
    if not isinstance(sizes_data, dict):
        raise PeerDescriptionError(f"{where}.sizes must be an object, not {_kind(sizes_data)}")
    known = {t.name for t in size_symbols(layout)}
    sizes: dict[str, int] = {}
    for key, value in sizes_data.items():
        if key not in known:
            raise PeerDescriptionError(
                f"{where}.sizes.{key}: {layout} has no size {key} (it has {', '.join(sorted(known))})"
            )
        sizes[key] = _int(f"{where}.sizes.{key}", value, 1, MAX_SIZE)
    try:
        resolved = resolve_sizes(layout, sizes)
        want_shape = layout.tensor_shape(resolved)
        pointers = math.prod(list_shape(layout, resolved))
    except KVLayoutError as exc:
        raise PeerDescriptionError(f"{where}.sizes: {exc}") from None
    addresses_data = _list(f"{where}.addresses", p["addresses"], MAX_TENSORS)
    if len(addresses_data) != pointers:
        raise PeerDescriptionError(
            f"{where}.addresses has {len(addresses_data)} entries; {layout} has {pointers} tensors here"
        )
    if pointers > left:
        raise PeerDescriptionError(f"{where}: the description names more than {MAX_TENSORS} tensors")
    shape = _ints(f"{where}.shape", p["shape"], 16, 1, MAX_SIZE)
    if shape != want_shape:
        raise PeerDescriptionError(
            f"{where}.shape is {list(shape)}; {layout} with these sizes is {list(want_shape)}"
        )
    block_stride = p["block_stride"]
    if block_stride is not None:
        block_stride = _int(f"{where}.block_stride", block_stride, 1, MAX_SPAN)
    try:
        want_strides = layout.tensor_strides(resolved, block_stride)
    except KVLayoutError as exc:
        raise PeerDescriptionError(f"{where}.block_stride: {exc}") from None
    if block_stride is not None and want_strides[0] != block_stride:
        raise PeerDescriptionError(
            f"{where}.block_stride={block_stride}, but dim 0 is not {layout}'s block axis"
        )
    strides = _ints(f"{where}.strides", p["strides"], 16, 0, MAX_SPAN)
    # a size-1 dim's stride addresses nothing (torch leaves any there): the layout's is kept
    if len(strides) != len(want_strides) or any(
        s != w for s, w, n in zip(strides, want_strides, shape, strict=True) if n != 1
    ):
        raise PeerDescriptionError(
            f"{where}.strides are {list(strides)}; {layout} stores these sizes with strides "
            f"{list(want_strides)} "
            "(contiguous but for dim-0 padding)"
        )
    strides = want_strides
    plane = PlaneDescription(dtype, tuple(sizes.items()), shape, strides, block_stride, ())
    span = plane.span
    if span > MAX_SPAN:
        raise PeerDescriptionError(f"{where}: each tensor spans {span} bytes, more than {MAX_SPAN}")
    addresses = tuple(
        _int(f"{where}.addresses[{i}]", v, NULL_PAGE, MAX_ADDRESS - span)
        for i, v in enumerate(addresses_data)
    )
    if max(addresses) > MAX_END - span:
        i = next(i for i, a in enumerate(addresses) if a > MAX_END - span)
        raise PeerDescriptionError(
            f"{where}.addresses[{i}]={addresses[i]:#x}: its tensor ends at {addresses[i] + span:#x}, past "
            f"{MAX_END_TEXT}, which no host or device address reaches"
        )
    return PlaneDescription(dtype, tuple(sizes.items()), shape, strides, block_stride, addresses)


def _check_sharing(
    where: str, layout: Layout, layers: Sequence[int], planes: Sequence[PlaneDescription]
) -> None:
    """An address that comes again in a plane is a layer sharing an earlier layer's KV
    cache, whole: each of its tensors, in every plane, the target layer's tensor in the
    same place (what detection accepts of a registration, see ``_find_sharing``)."""
    if all(len(set(p.addresses)) == len(p.addresses) for p in planes):
        return
    level = level_of(layout, Role.LAYER)
    paths = [layout.pointer_order(p.sizes_dict()) for p in planes]  # as many as addresses: bounded
    target: dict[int, int] = {}  # sharer -> target, layer positions
    shared: dict[int, int] = {}  # sharer -> its tensors that are the target's
    own: list[tuple[int, int]] = []  # (plane, pointer) of each first occurrence
    for pi, p in enumerate(planes):
        first: dict[int, int] = {}
        for k, address in enumerate(p.addresses):
            j = first.setdefault(address, k)
            if j == k:
                own.append((pi, k))
                continue
            here, there = paths[pi][k], paths[pi][j]
            x, y = f"{where}.planes[{pi}].addresses[{k}]", f"{where}.planes[{pi}].addresses[{j}]"
            refusal = alias_refusal(
                here, there, level, target, (f"{x} ({address:#x})", y), layers.__getitem__
            )
            if refusal is not None:
                raise PeerDescriptionError(refusal)
            assert level is not None  # alias_refusal refuses a repeat within no layer level
            sharer = here[level]
            shared[sharer] = shared.get(sharer, 0) + 1
    assert level is not None  # a repeat within no layer level was refused above
    partial = partly_shared(shared, sum(len(p.addresses) for p in planes), len(layers))
    if partial is not None:
        pi, k = next((pi, k) for pi, k in own if paths[pi][k][level] == partial)
        raise PeerDescriptionError(
            f"{where}: layer {layers[partial]} shares only part of its KV cache with layer "
            f"{layers[target[partial]]}: {where}.planes[{pi}].addresses[{k}] is its own tensor; {SHARE_WHOLE}"
        )


def _check_memory(groups: Sequence[GroupDescription]) -> None:
    """No two described tensors of one engine group share a byte (the registration's own
    rule: padding between blocks may hold others, and engine groups may overlay), but for
    a tensor described again at the same address in its plane (a shared layer's)."""
    by_engine_group: dict[int, list[Run]] = {}
    for gi, g in enumerate(groups):
        for pi, p in enumerate(g.planes):
            period, block, blocks = p.extent()
            repeats = set(p.repeats)
            own = [j for j in range(len(p.addresses)) if j not in repeats]
            paths = [(gi, pi, j) for j in own]
            run = Run(period, block, blocks, tuple(p.addresses[j] for j in own), paths, "description")
            by_engine_group.setdefault(g.engine_group, []).append(run)
    for runs in by_engine_group.values():
        try:
            check_disjoint(
                runs, PeerDescriptionError, "the tensors a peer describes must be disjoint", MAX_INTERLEAVED
            )
        except (
            PeerDescriptionError
        ) as exc:  # description[g][p][j] -> description.groups[g].planes[p].addresses[j]
            raise PeerDescriptionError(_ADDRESS_PATH.sub(_address_field, str(exc))) from None


_ADDRESS_PATH = re.compile(r"description\[(\d+)\]\[(\d+)\]\[(\d+)\]")


def _address_field(m: re.Match[str]) -> str:
    return f"description.groups[{m[1]}].planes[{m[2]}].addresses[{m[3]}]"
