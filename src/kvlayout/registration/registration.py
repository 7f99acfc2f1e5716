"""A registration bound to its format: walked once, checked once, grouped into kernel groups.

Detection builds one: :func:`kvlayout.detect` returns it, and the LMCache-named
``normalize_*`` functions return a :class:`RegisteredKV` (a read-only list) that carries
it. :func:`bind` builds one for a registration whose format is already known. Everything
after detection reads it instead of the tensors: the facade's accessors, pointer tables,
descriptors and grouping, and the transfer plans made from its kernel groups.

Binding (:mod:`kvlayout.registration.binding`) reads every tensor as the format's layout says; a
layer list is read layer by layer, and layers are grouped by what one kernel must share
(format, shapes, block stride, dtype) within their engine (KV cache) group, so layers of
different engine groups never share a kernel group. No two tensors of one engine group
may overlap in memory (:mod:`kvlayout.registration.memory`), except layers that share one KV cache
(vLLM's cross-layer KV sharing registers the target layer's tensors for the sharer):
exact aliases of a whole layer, listed in ``shared_layers``. Their pointer tables still
list every layer; a store fills each layer's slot of a chunk, and a load writes a shared
memory once, from the first layer's slot.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, cast

import torch

from kvlayout._generated.formats import LAYOUTS, EngineKVFormat
from kvlayout.catalog.registry import FormatLike, as_format, get_spec, is_one_format
from kvlayout.catalog.spec import UndefinedSizeError
from kvlayout.errors import KVLayoutError, abbreviated, as_int, index_ranges
from kvlayout.layout.algebra import level_of, with_size
from kvlayout.layout.vocabulary import Role
from kvlayout.registration.binding import (
    Bound,
    LayerTable,
    PlaneShape,
    RegistrationError,
    bind_layers,
    bind_structure,
)
from kvlayout.registration.describing import describe as describe_registration
from kvlayout.registration.kernel_groups import (
    EXCLUDED_ENGINE_GROUP,
    Geometry,
    KernelGroup,
    Plane,
    _find_sharing,
)
from kvlayout.registration.memory import (
    HoldsAddresses,
    Run,
    apart,
    backed_pointers,
    check_disjoint,
    check_in_place,
    run_of,
)
from kvlayout.registration.nesting import Path, at, entries_at, first_leaf, leaves, map_leaves
from kvlayout.registration.opaque import mark_like
from kvlayout.registration.peers import MAX_LAYERS, RegistrationDescription
from kvlayout.types import EngineType

if TYPE_CHECKING:
    from kvlayout.registration.shards import Shard

__all__ = [
    "RegisteredKV",
    "Registration",
    "RegistrationError",
    "bind",
    "bound",
    "bound_per_layer",
]

# -- the registration -------------------------------------------------------------------------


class Registration(HoldsAddresses):
    """A registration bound to its format(s): the structure, per-layer formats and engine
    groups, and the kernel groups every consumer reads (see the module docstring).

    Build one with :func:`kvlayout.detect` or :func:`bind`; it never copies a tensor.
    """

    __slots__ = (
        "_by_engine_groups",
        "_group_of",
        "_layers",
        "_positions",
        "_registered",
        "_shared",
        "_sources",
        "engine",
        "engine_groups",
        "formats",
        "kernel_groups",
        "kv",
        "layer_ids",
        "num_layers",
        "root",
    )

    def __init__(
        self,
        kv: Any,
        formats: Sequence[EngineKVFormat | None],
        engine_groups: Sequence[int],
        layers: LayerTable | None,
        shared: Bound | None,
        engine: EngineType | None,
        root: str,
        sources: Mapping[Path, torch.Tensor] | None = None,
        layer_ids: tuple[int, ...] | None = None,
    ) -> None:
        self.kv = kv
        self._sources = sources or {}  # the caller's tensors behind re-viewed leaves, by path
        self.formats = tuple(formats)
        self.engine_groups = tuple(engine_groups)
        self.num_layers = len(self.formats)
        # The engine's number of each layer, what maps pair: positions unless numbered().
        self.layer_ids = tuple(range(self.num_layers)) if layer_ids is None else layer_ids
        self._positions: dict[int, int] | None = None  # layer_ids' positions, made on first use
        self.engine = engine
        self.root = root
        self._layers = layers  # a layer list, read layer by layer
        self._shared = shared  # a structure that is not one entry per layer, read whole
        self._by_engine_groups: dict[tuple[int, ...], tuple[KernelGroup, ...]] = {}
        self._registered: weakref.ref[Any] | None = None
        self.kernel_groups = self.group_by(self.engine_groups)
        if len(self.kernel_groups) == 1 and len(self.kernel_groups[0].layers) == self.num_layers:
            self._group_of: tuple[KernelGroup | None, ...] = self.kernel_groups * self.num_layers
        else:
            group_of: list[KernelGroup | None] = [None] * self.num_layers
            for g in self.kernel_groups:
                for i in g.layers:
                    group_of[i] = g
            self._group_of = tuple(group_of)

    def __repr__(self) -> str:
        groups = "; ".join(g.describe() for g in self.kernel_groups)
        engine = f"{self.engine.value}, " if self.engine is not None else ""
        return f"Registration({engine}{self.num_layers} layers: {groups})"

    @property
    def shared_layers(self) -> tuple[tuple[int, ...], ...]:
        """Layers that share one KV cache (vLLM's cross-layer KV sharing), each tuple in
        layer order (vLLM's target first, as it registers its sharers after every layer
        it allocates): every tensor of the others is the first one's, the same memory
        and view. Pointer tables list every layer; a store fills each layer's slot of a
        chunk, a load writes the memory once, from the first one's slot. Empty when no
        layers share."""
        return tuple(sorted(s for g in self.kernel_groups for s in g.shared_layers))

    @property
    def format(self) -> EngineKVFormat:
        """The registration's one format (an error for hybrids: read ``formats``)."""
        found = {f for f in self.formats if f is not None}
        if len(found) != 1:
            names = ", ".join(sorted(f.name for f in found)) or "none"
            raise RegistrationError(f"the registration has {len(found)} formats ({names}); read .formats")
        return next(iter(found))

    @property
    def device(self) -> torch.device:
        return self.kernel_groups[0].device if self.kernel_groups else first_leaf(self.kv).device

    def describe(
        self, *, shard: Shard | None = None, block_size: int | None = None, at: int | None = None
    ) -> RegistrationDescription:
        """The registration as data for a peer: a :class:`kvlayout.registration.peers.RegistrationDescription`
        (``to_json()`` for the wire). ``shard`` is the :class:`kvlayout.transfer.Shard` this
        rank holds; ``block_size`` splits a folded NB*BS page axis (elsewhere it must be
        the cache's own); ``at`` places the
        tensors at made-up addresses from there (planning from meta tensors)."""
        return describe_registration(
            self.kernel_groups, self.engine, shard=shard, block_size=block_size, at=at
        )

    def labelled(self, engine: EngineType) -> Registration:
        """This registration as ``engine``'s: another engine's reader read it (ATOM's
        SHUFFLE pool is read as SGLang's per-layer list of opaque pages), and its label
        (``engine``, each kernel group's backend label, ``describe().engine``) says whose
        cache it is. The same tensors, formats and groups, bound again."""
        if engine is self.engine:
            return self
        return Registration(
            self.kv, self.formats, self.engine_groups, self._layers, self._shared, engine, self.root,
            self._sources, self.layer_ids,
        )  # fmt: skip

    def numbered(self, layer_ids: Iterable[int]) -> Registration:
        """This registration with its layers numbered as the engine numbers them: layer
        ``k`` of it (its ``k``-th entry, or the ``k``-th layer of a pool holding every
        layer) is model layer ``layer_ids[k]``. A block map moves layer ``i`` to layer
        ``i`` by these numbers, and a description carries them to a peer, so a cache that
        holds some of a model's layers (one layer group of a hybrid, one pipeline stage)
        maps only to the same layers. Numbering a side to match another is how a map
        pairs layers on purpose. The same tensors, formats and groups, bound again;
        ``layer_ids`` ascending, one a layer. Lookups by layer (:meth:`group`, a kernel
        group's ``layer_tensors`` and ``layer_ptrs``, the LMCache-named functions) still
        take positions: :meth:`position` gives an engine's layer's."""
        taken = itertools.islice(layer_ids, self.num_layers + 1)  # a range(10**9) is not built
        ids = tuple(as_int(i, f"layer_ids[{k}]") for k, i in enumerate(taken))
        if len(ids) != self.num_layers:
            more = "more than " * (len(ids) > self.num_layers)
            raise RegistrationError(
                f"layer_ids has {more}{self.num_layers if more else len(ids)} entries for the "
                f"registration's {self.num_layers} layers"
            )
        if any(i < 0 for i in ids) or any(a >= b for a, b in itertools.pairwise(ids)):
            raise RegistrationError(f"layer_ids {list(ids)} must be distinct layer numbers >= 0, ascending")
        if ids and ids[-1] >= MAX_LAYERS:
            raise RegistrationError(f"layer_ids: layer {ids[-1]} is past a description's {MAX_LAYERS} layers")
        if ids == self.layer_ids:
            return self
        return Registration(
            self.kv, self.formats, self.engine_groups, self._layers, self._shared, self.engine, self.root,
            self._sources, ids,
        )  # fmt: skip

    def for_layers(self, layer_ids: Iterable[int]) -> Registration:
        """This registration's layers ``layer_ids`` alone (its layer numbers, as
        :meth:`numbered` gives them, which the part keeps): what a map from a pipeline
        stage's cache against this one takes, bound again over the same memory, as a
        registration detected from that part of the cache would be. A layer list keeps
        those entries; a structure holding every layer is cut on its layer list level
        (SGLang's ``[K layers, V layers]``) or narrowed on its tensors' layer axis (a
        consecutive range: TRT-LLM's ``pool[:, a:b]``), refused where that view is not
        the format's (layers inside another axis). ``describe()`` of it is
        ``describe().for_layers(layer_ids)``."""
        taken = tuple(itertools.islice(layer_ids, self.num_layers + 1))
        ids = [as_int(i, f"layer_ids[{k}]") for k, i in enumerate(taken)]
        if not ids or len(set(ids)) != len(ids) or len(ids) > self.num_layers:
            raise RegistrationError(
                f"layer_ids {abbreviated(repr(ids))} must name distinct layers of the registration's "
                f"{self.num_layers} ({index_ranges(self.layer_ids)}), one at least"
            )
        positions = sorted(self.position(i) for i in ids)
        if len(positions) == self.num_layers:
            return self
        kept = tuple(self.layer_ids[p] for p in positions)
        formats = [self.formats[p] for p in positions]
        groups = [self.engine_groups[p] for p in positions]
        layout = None if self._shared is None else LAYOUTS[self._shared.format]
        level = 0 if layout is None else level_of(layout, Role.LAYER)
        if level is not None:  # a layer list, or a list level of layers inside the structure
            part = bind(
                entries_at(self.kv, level, positions), formats, engine_groups=groups, engine=self.engine,
                root=self.root, trusted=True,
            )  # fmt: skip
            part._sources = _sources_at(self._sources, level, positions)
            return part.numbered(kept)
        # a tensor holding the layer axis: a view of a consecutive range of it (a view's
        # memory is the narrowed tensor's: nothing re-viewed to watch)
        assert layout is not None  # a layer list has its layers at level 0
        first, n = positions[0], len(positions)
        if positions != list(range(first, first + n)):
            raise RegistrationError(
                f"layers {index_ranges(kept)} are not consecutive in {self.root}'s layer axis "
                f"({layout.symbol_of(Role.LAYER)}, layers {index_ranges(self.layer_ids)}): a tensor's "
                "layers are cut as one range, as a view pool[:, a:b] holds them"
            )
        axis = layout.axis_of(Role.LAYER)
        assert axis is not None  # a layout's layers are a list level or an axis
        # the view's rows are the tensor's: opaque pages (a Mamba state's) stay marked as the
        # caller's tensor behind the leaf is
        narrowed = map_leaves(
            self.kv,
            lambda t: t,
            root=self.root,
            at_path=lambda path, t: mark_like(t.narrow(axis, first, n), self._sources.get(path, t)),
        )
        try:
            part = bind(narrowed, formats, engine_groups=groups, engine=self.engine, root=self.root)
        except RegistrationError as e:  # the view's strides: layers inside another axis
            what = (
                f"layers {index_ranges(kept)} of {self.root} are"
                if n > 1
                else f"layer {kept[0]} of {self.root} is"
            )
            raise RegistrationError(
                f"{what} not a view {layout} reads ({e}): a range of its layers lies inside another axis; "
                "map every layer of it"
            ) from None
        return part.numbered(kept)

    def position(self, layer_id: int) -> int:
        """The position of the engine's layer ``layer_id`` (:meth:`numbered`; the layer
        itself where the registration is not), which lookups by layer take: a TRT-LLM V2
        group numbered ``[1, 3]`` holds layer 3 at position 1."""
        layer_id = as_int(layer_id, "layer_id")
        if self._positions is None:
            self._positions = {i: k for k, i in enumerate(self.layer_ids)}
        position = self._positions.get(layer_id)
        if position is None:
            raise RegistrationError(
                f"layer {layer_id} is not one of this registration's layers ({index_ranges(self.layer_ids)})"
            )
        return position

    @property
    def registered_kv(self) -> Any:
        """The normalized structure as the LMCache-named functions return it, carrying
        this registration: a :class:`RegisteredKV` for a list, a view of the tensor (not
        the caller's object) for a bare tensor."""
        registered = self._registered() if self._registered is not None else None
        if registered is None:  # held weakly: what was handed out holds the registration
            tensor = isinstance(self.kv, torch.Tensor)
            registered = _tensor_view(self) if tensor else RegisteredKV(self.kv, self)
            self._registered = weakref.ref(registered)
        return registered

    # -- kernel groups --------------------------------------------------------------------

    def group(self, layer_idx: int = 0, fmt: FormatLike | None = None) -> KernelGroup:
        """The kernel group holding a layer; ``fmt``, if given, must be the layer's format."""
        if type(layer_idx) is not int:
            layer_idx = as_int(layer_idx, "layer_idx")
        if not 0 <= layer_idx < self.num_layers:
            ids = self.layer_ids != tuple(range(self.num_layers))
            numbered = (
                f" (positions; the engine numbers them {index_ranges(self.layer_ids)}: position(layer_id) "
                "gives one's position)"
                if ids
                else ""
            )
            raise RegistrationError(
                f"layer {layer_idx} is out of range for {self.num_layers} layers{numbered}"
            )
        group = self._group_of[layer_idx]
        if group is None:
            raise RegistrationError(f"layer {layer_idx} has no format (it was in no layer group)")
        if fmt is not None and group.format is not fmt and group.format is not as_format(fmt):
            raise RegistrationError(
                f"layer {layer_idx} is {group.format.name}, not {as_format(fmt).name} (as detected)"
            )
        return group

    def first_group(self, fmt: FormatLike) -> KernelGroup:
        """The first kernel group in ``fmt`` (a hybrid registration has several formats)."""
        wanted = as_format(fmt)
        for g in self.kernel_groups:
            if g.format is wanted:
                return g
        held = ", ".join(sorted({g.format.name for g in self.kernel_groups})) or "none"
        raise RegistrationError(f"no layer of the registration is {wanted.name} (it holds {held})")

    def concrete_shape(self, fmt: FormatLike) -> str:
        """Every layer read in ``fmt``, with its numbers: ``7 x [2, 2048, 16, 8, 128]``.

        Kernel groups whose layers differ only in how many there are (one shape split
        by engine group) count as one shape; shapes that differ otherwise are listed in
        order of their first layer, joined by `` + ``: ``4 x [2, 2048, 16, 8, 128] + 3 x
        [2, 1024, 16, 8, 128]``. A structure that holds every layer in one tensor
        renders once.
        """
        wanted = as_format(fmt)
        groups = [g for g in self.kernel_groups if g.format is wanted]
        if not groups:
            return self.first_group(wanted).concrete_shape()  # raises, naming what it holds
        layout = LAYOUTS[wanted]
        layer = layout.symbol_of(Role.LAYER)
        if self._shared is not None or layer is None:
            return " + ".join(dict.fromkeys(g.concrete_shape() for g in groups))
        shapes: dict[tuple[tuple[str, int], ...], tuple[dict[str, int], list[int]]] = {}
        for g in groups:
            sizes = g.display_sizes()
            key = tuple(sorted((name, n) for name, n in sizes.items() if name != layer))
            shapes.setdefault(key, (sizes, []))[1].extend(g.layers)
        return " + ".join(
            layout.concrete_shape(with_size(layout, sizes, Role.LAYER, len(layers)))
            for sizes, layers in shapes.values()
        )

    def only_group(self, use: str = "a transfer plan moves one: prepare") -> KernelGroup:
        """The registration's one kernel group (an error naming them when there are several,
        and saying, by ``use``, what to do with each)."""
        if len(self.kernel_groups) != 1:
            listed = "; ".join(g.describe() for g in self.kernel_groups) or "none"
            raise RegistrationError(
                f"the registration has {len(self.kernel_groups)} kernel groups ({listed}); "
                f"{use} each of registration.kernel_groups"
            )
        return self.kernel_groups[0]

    def group_by(self, engine_groups: Sequence[int]) -> tuple[KernelGroup, ...]:
        """Kernel groups for an assignment of layers to engine groups (-1: in none), in
        order of first layer. Layers of different engine groups are never merged."""
        key = tuple(as_int(g, f"engine_groups[{i}]") for i, g in enumerate(engine_groups))
        if len(key) != self.num_layers:
            raise RegistrationError(
                f"engine_groups has {len(key)} entries for {self.num_layers} layers (one engine group per "
                f"layer, {EXCLUDED_ENGINE_GROUP} for a layer in none)"
            )
        cached = self._by_engine_groups.get(key)
        if cached is None:
            cached = self._build_groups(key)
            self._by_engine_groups[key] = cached
        return cached

    def _build_groups(self, engine_groups: tuple[int, ...]) -> tuple[KernelGroup, ...]:
        # Layers read alike share one key object (binding makes them canonical), so
        # buckets are keyed by its identity: hashing shapes and devices per layer is slow.
        buckets: dict[tuple[int, int], list[int]] = {}
        keys = self._layers.keys if self._layers is not None else [()] * self.num_layers
        if (
            len(set(engine_groups)) == 1
            and engine_groups[0] != EXCLUDED_ENGINE_GROUP
            and len(set(map(id, keys))) == 1
            and None not in self.formats
        ):
            buckets[(engine_groups[0], 0)] = list(range(self.num_layers))  # one group: every layer alike
        else:
            for i, (fmt, eg, key) in enumerate(zip(self.formats, engine_groups, keys, strict=True)):
                if eg == EXCLUDED_ENGINE_GROUP:
                    continue
                if fmt is None:
                    raise RegistrationError(
                        f"layer {i} has no format (it was in no detection group) but "
                        f"per_layer_engine_group_idx puts it in engine group {eg}"
                    )
                buckets.setdefault((eg, id(key)), []).append(i)
        groups = tuple(self._kernel_group(eg, layers) for (eg, _), layers in buckets.items())
        for eg in dict.fromkeys(g.engine_group for g in groups):
            members = [g for g in groups if g.engine_group == eg]
            if members[0].device.type != "meta":  # meta tensors: looked for only when asked
                for g in members:
                    g._shared = ()  # real memory: looked for below where bytes repeat, else none
            runs = [r for g in members for p in g.planes if (r := self._run(p)) is not None]
            if apart(runs):
                continue  # the common registration: no byte shared
            for g in members:
                g._shared = _find_sharing(g, self.root, strict=True)
            check_disjoint(
                (self._run(p) for g in members for p in g.planes),
                RegistrationError,
                f"the tensors of engine group {eg} must be disjoint, but for layers sharing one KV cache "
                "(KV cache groups that vLLM overlays must be passed as layer groups)",
            )
        return groups

    def _run(self, plane: Plane) -> Run | None:
        """The plane's tensors as one run of memory, shared layers' repeats left out."""
        if not plane.repeats:
            return run_of(plane.leaves[0], plane.data_ptrs, plane.paths, self.root)
        repeats = set(plane.repeats)
        keep = [k for k in range(len(plane.data_ptrs)) if k not in repeats]
        ptrs, paths = [plane.data_ptrs[k] for k in keep], [plane.paths[k] for k in keep]
        return run_of(plane.leaves[0], ptrs, paths, self.root)

    def _kernel_group(self, engine_group: int, layers: list[int]) -> KernelGroup:
        planes = []
        if self._shared is not None:
            b, kv = self._shared, self.kv
            for p, shape in enumerate(b.shapes):
                planes.append(
                    _plane(shape, b.leaves[p], b.paths[p], dict(shape.sizes), self.root, self._sources)
                )
            ptrs = self._shared_ptrs(layers)
        else:
            table = self._layers
            assert table is not None
            b = table.templates[table.keys[layers[0]]]  # type: ignore[index]
            kv = list(self.kv) if len(layers) == len(self.kv) else [self.kv[i] for i in layers]
            for p, shape in enumerate(b.shapes):
                sizes = with_size(LAYOUTS[b.format], shape.sizes, Role.LAYER, len(layers))
                leaves = table.leaves(self.kv, layers, p)
                paths = table.paths(layers, p)
                planes.append(_plane(shape, leaves, paths, sizes, self.root, self._sources))
            ptrs = _interleave([p.data_ptrs for p in planes], len(layers))
        geometry = _geometry(kv, b)
        return KernelGroup(
            b.format, engine_group, tuple(layers), kv, tuple(planes), tuple(ptrs), geometry, self.num_layers,
            self.engine, tuple(self.layer_ids[i] for i in layers),
        )  # fmt: skip

    def _shared_ptrs(self, layers: Sequence[int]) -> list[int]:
        b = self._shared
        assert b is not None
        by_path = {
            path: leaf
            for ps, ls in zip(b.paths, b.leaves, strict=True)
            for path, leaf in zip(ps, ls, strict=True)
        }
        return [by_path[path].data_ptr() for path in LAYOUTS[b.format].pointer_order(b.list_sizes, layers)]

    # -- pointer tables ---------------------------------------------------------------------

    def data_ptrs(self, layer_indices: Iterable[int], fmt: FormatLike | None = None) -> list[int]:
        """The pointer table of some layers in kernel order: one per layer; ``[K...,
        V...]`` for K/V lists; each layer's tuple in turn; one base for cross-layer.
        Refused once a tensor of their kernel groups was re-allocated or freed since
        detection (the table would name the old memory)."""
        want = None if fmt is None else as_format(fmt)
        # a table lists each layer at most once: an iterable longer than the registration is
        # refused before it is built (a range(10**9) would take its 36 GB first)
        layers = tuple(itertools.islice(layer_indices, self.num_layers + 1))
        if len(layers) > self.num_layers:
            raise RegistrationError(
                f"layer_indices has more than {self.num_layers} entries, but the registration has "
                f"{self.num_layers} layers: a pointer table lists each layer once"
            )
        if layers and type(layers[0]) is int and 0 <= layers[0] < self.num_layers:
            g = self._group_of[layers[0]]
            if g is not None and g.layers == layers and (want is None or g.format is want):
                check_in_place(g, RegistrationError, "data_ptrs()")
                return list(g.data_ptrs)  # a whole kernel group: its table as built
        layers = tuple(as_int(i, f"layer_indices[{k}]") for k, i in enumerate(layers))  # torch ints too
        groups = {id(g): g for g in (self.group(i, want) for i in layers)}
        for g in groups.values():
            check_in_place(g, RegistrationError, "data_ptrs()")
        if self._shared is not None:
            return self._shared_ptrs(layers)
        out: list[int] = []
        for i in layers:
            g = self.group(i)
            out.extend(g._layer_ptrs(g._own_layer(i)))
        return out


def _sources_at(
    sources: Mapping[Path, torch.Tensor], depth: int, positions: Sequence[int]
) -> dict[Path, torch.Tensor]:
    """``sources`` (the caller's tensors behind re-viewed leaves) of the entries
    ``positions`` of the lists ``depth`` levels down, keyed by their paths in the part."""
    new = {p: k for k, p in enumerate(positions)}
    return {
        (*path[:depth], new[path[depth]], *path[depth + 1 :]): t
        for path, t in sources.items()
        if path[depth] in new
    }


def _interleave(plane_ptrs: Sequence[Sequence[int]], num_layers: int) -> list[int]:
    """Per-plane pointer tables of some layers as one table in pointer order: layer 0's
    entries (planes interleaved), then layer 1's, ..."""
    if len(plane_ptrs) == 1:
        return list(plane_ptrs[0])
    per = [len(ptrs) // num_layers for ptrs in plane_ptrs]
    out: list[int] = []
    for layer in range(num_layers):
        for ptrs, n in zip(plane_ptrs, per, strict=True):
            out.extend(ptrs[layer * n : (layer + 1) * n])
    return out


_GEOMETRIES: dict[tuple[object, ...], Geometry] = {}


def _plane(
    shape: PlaneShape,
    leaves: tuple[torch.Tensor, ...],
    paths: Sequence[Path],
    sizes: dict[str, int],
    root: str,
    sources: Mapping[Path, torch.Tensor],
) -> Plane:
    pointers = backed_pointers(leaves, paths, root, RegistrationError)  # memory behind every view
    behind = tuple(sources.get(tuple(path)) for path in paths) if sources else ()
    return Plane(
        leaves, paths, shape.shape, sizes, shape.block_stride, shape.dtype, shape.device, pointers,
        sources=behind if any(t is not None for t in behind) else (), root=root,
    )  # fmt: skip


def _geometry(kv: Any, b: Bound) -> Geometry:
    """The accessors' answers for a group read like ``b`` (remembered by ``b.key``:
    registrations repeat their shapes)."""
    known = _GEOMETRIES.get(b.key)
    if known is not None:
        return known
    spec = get_spec(kv, b.format)
    try:
        nb: int | None = spec.num_blocks()
        bs: int | None = spec.block_size()
    except UndefinedSizeError:
        nb = bs = None
    dtype = spec.dtype()
    assert isinstance(dtype, torch.dtype)
    geometry = Geometry(
        num_blocks=nb,
        block_size=bs,
        page_buffer_size=spec.page_buffer_size(),
        kv_size=spec.kv_size(),
        num_heads=spec.num_heads(),
        head_size=spec.head_size(),
        hidden_dim=spec.hidden_dim(),
        dtype=dtype,
    )
    if len(_GEOMETRIES) < 4096:
        _GEOMETRIES[b.key] = geometry
    return geometry


# -- building -------------------------------------------------------------------------------


def bind(
    kv: Any,
    formats: FormatLike | Sequence[FormatLike | None],
    *,
    engine_groups: Sequence[int] | None = None,
    engine: EngineType | None = None,
    root: str = "kv",
    trusted: bool = False,
    sources: Any = None,
) -> Registration:
    """A normalized registration (as detection returns it) bound to a known format.

    ``formats`` is one format for the whole registration or one per layer (None: the
    layer is in no group and is not read). ``engine_groups`` gives each layer's engine
    (KV cache) group, -1 for none; by default every layer with a format is in group 0.
    Raises :class:`RegistrationError` naming the tensor for anything the format cannot
    describe, and when two tensors of one engine group overlap in memory. ``sources`` is
    the structure the caller registered, where ``kv`` re-views it (detection's physical
    order): later checks for re-allocation watch the caller's tensors, which an engine
    re-allocates, not the views, which keep the old memory.
    """
    if is_one_format(formats):
        per_layer: list[EngineKVFormat | None] | None = None
        present = {as_format(cast(FormatLike, formats))}
    else:
        per_layer = [None if f is None else as_format(f) for f in cast(Sequence[FormatLike | None], formats)]
        present = {f for f in per_layer if f is not None}
        if not present:
            raise RegistrationError("no layer has a format")
    whole = [f for f in present if not LAYOUTS[f].is_layer_list]
    if whole and len(present) > 1:
        names = ", ".join(sorted(f.name for f in present))
        raise RegistrationError(
            f"{whole[0].name} holds every layer in one structure; it cannot mix with {names}"
        )
    shared: Bound | None = None
    if whole:
        shared = bind_structure(kv, whole[0], root, trusted=trusted)
        n = int(get_spec(kv, whole[0]).num_layers())
        fmts: list[EngineKVFormat | None] = [whole[0]] * n if per_layer is None else per_layer
        table: LayerTable | None = None
        if len(fmts) != n:
            raise RegistrationError(
                f"engine_kv_formats has {len(fmts)} layers but the registration has {n} ({whole[0].name})"
            )
    else:
        if isinstance(kv, torch.Tensor) or not isinstance(kv, (list, tuple)):
            name = next(iter(present)).name
            raise RegistrationError(f"{root} is a {type(kv).__name__}, but {name} is a list of layers")
        n = len(kv)
        if n == 0:
            raise RegistrationError(f"{root} is empty")
        fmts = [next(iter(present))] * n if per_layer is None else per_layer
        if len(fmts) != n:
            raise RegistrationError(f"engine_kv_formats has {len(fmts)} layers but the registration has {n}")
        table = bind_layers(kv, fmts, root, trusted)
    if engine_groups is None:
        groups = [0 if f is not None else EXCLUDED_ENGINE_GROUP for f in fmts]
    else:
        groups = list(engine_groups)
        if len(groups) != n:
            raise RegistrationError(f"engine_groups has {len(groups)} entries for {n} layers")
    return Registration(kv, fmts, groups, table, shared, engine, root, _re_viewed(kv, sources))


def _re_viewed(kv: Any, sources: Any) -> dict[Path, torch.Tensor]:
    """The caller's tensors (in ``sources``) that ``kv`` holds as other views of the same
    memory, by path; where the structures differ at a path, nothing is watched there."""
    if sources is None or sources is kv:
        return {}
    out: dict[Path, torch.Tensor] = {}
    try:
        walked = list(leaves(sources))
    except (KVLayoutError, TypeError):  # not a structure of tensors: nothing to watch
        return out
    for path, source in walked:
        try:
            view = at(kv, path)
            if isinstance(view, torch.Tensor) and view is not source and view.data_ptr() == source.data_ptr():
                out[path] = source
        except (KVLayoutError, RuntimeError):  # the structures differ here, a tensor without memory
            continue
    return out


class RegisteredKV(list):  # type: ignore[type-arg]
    """The normalized registration the LMCache-named detection functions return: a
    read-only list of its entries that carries its :class:`Registration`, so the facade
    and transfer functions answer from it without walking or checking again."""

    __slots__ = ("__weakref__", "registration")

    def __init__(self, entries: Iterable[Any], registration: Registration) -> None:
        super().__init__(entries)
        self.registration = registration

    def _read_only(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(
            "this registration is read-only (detection bound it to its tensors); "
            "copy it with list(kv) and detect again to change it"
        )

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only
    append = extend = insert = pop = remove = clear = sort = reverse = _read_only

    def __reduce_ex__(self, protocol: object) -> tuple[type, tuple[list[Any]]]:
        return (list, (list(self),))


_TENSOR_VIEWS: dict[int, tuple[weakref.ref[torch.Tensor], Registration]] = {}
"""Registrations of the bare tensors detection handed out (views it made for them), by
the view's id; an entry goes when its view does. Tensors cannot carry the registration
the way :class:`RegisteredKV` does without putting it in their pickled state."""


def _tensor_view(reg: Registration) -> torch.Tensor:
    view: torch.Tensor = reg.kv[...]  # a new tensor object over the same memory
    key = id(view)

    def forget(ref: weakref.ref[torch.Tensor]) -> None:
        if _TENSOR_VIEWS.get(key, (None,))[0] is ref:
            del _TENSOR_VIEWS[key]

    _TENSOR_VIEWS[key] = (weakref.ref(view, forget), reg)
    return view


def bound(kv: Any, fmt: FormatLike, *, root: str = "kv") -> Registration:
    """The registration of ``kv`` read in ``fmt``: the one detection attached to it when
    ``fmt`` is one of its formats, else ``kv`` bound now (checked in full)."""
    reg: Registration | None = None
    if type(kv) is RegisteredKV:
        reg = kv.registration
    elif type(kv) is Registration:
        reg, kv = kv, kv.kv
    elif isinstance(kv, torch.Tensor):
        entry = _TENSOR_VIEWS.get(id(kv))
        if entry is not None and entry[0]() is kv:
            reg = entry[1]
    if reg is not None and (fmt if type(fmt) is EngineKVFormat else as_format(fmt)) in reg.formats:
        return reg
    return bind(kv, fmt, root=root)


def bound_per_layer(kv: Any, formats: Sequence[FormatLike | None]) -> Registration:
    """The registration of ``kv`` with one format (or None) per layer: the one detection
    attached to it when its formats are exactly these, else ``kv`` bound now."""
    wanted = tuple(None if f is None else as_format(f) for f in formats)
    reg = kv.registration if type(kv) is RegisteredKV else kv if type(kv) is Registration else None
    if reg is not None and reg.formats == wanted:
        return reg
    return bind(kv.kv if type(kv) is Registration else kv, wanted)
