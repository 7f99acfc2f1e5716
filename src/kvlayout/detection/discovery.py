"""The one place a registration's layout is resolved.

``normalize_kv_and_discover_format`` recovers physical dim order (zero-copy), checks the
structure (every leaf, not only the first), hands the registration to its engine's
detector, and returns the format with the normalized registration callers must use from
then on. ``normalize_and_discover_per_layer_formats`` does the same per layer for
hybrid models whose layers differ.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import re
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from kvlayout._generated.formats import LAYOUTS, EngineKVFormat
from kvlayout.catalog.registry import get_spec
from kvlayout.detection.base import DetectionError, check_size_hints, engine_formats, probe, validate
from kvlayout.detection.registry import (
    get_detector,
    hint_owners,
    mixed_check,
    mixed_split,
    size_hint_reading,
    view_pooling,
)
from kvlayout.errors import KVLayoutError
from kvlayout.layout.ast import Layout
from kvlayout.layout.vocabulary import Axis, Role, kv_layout_axes
from kvlayout.registration.contiguity import (
    align_unit_dims,
    attempt_permute_to_contiguous_view,
    physical_entries,
)
from kvlayout.registration.kernel_groups import EXCLUDED_ENGINE_GROUP
from kvlayout.registration.memory import first_without_memory
from kvlayout.registration.nesting import (
    CallerRoot,
    describe_path,
    first_leaf,
    leaves,
    not_a_kv_cache,
    refuse_nested,
)
from kvlayout.registration.opaque import opaque_pages_of
from kvlayout.registration.registration import Registration, RegistrationError, bind
from kvlayout.types import (
    ENGINE_LABELS,
    DiscoverableKVCache,
    EngineLike,
    EngineType,
    HintsLike,
    LayoutHintError,
    LayoutHints,
    as_engine,
)

__all__ = [
    "detect",
    "extract_kv_cache_shapes",
    "normalize_and_discover_per_layer_formats",
    "normalize_kv_and_discover_format",
]

_log = logging.getLogger("kvlayout")


def extract_kv_cache_shapes(kv: DiscoverableKVCache) -> set[torch.Size]:
    """Every distinct tensor shape of a registration, as given (before any recovery of
    the memory order); dtypes do not count. One shape means the layers are uniform."""
    refuse_nested(kv)  # a nested tensor has no shape
    return {t.shape for _, t in leaves(kv)}


def detect(
    kv: DiscoverableKVCache,
    engine: EngineLike,
    layout_hints: HintsLike = None,
    *,
    layer_groups: Sequence[Sequence[int]] | None = None,
) -> Registration:
    """Detect a registration and bind it: its format per layer, its kernel groups, its
    pointer tables, everything checked once. What a connector calls at registration.

    Layers that differ (hybrid models) are detected apart, as
    :func:`normalize_and_discover_per_layer_formats` does; ``layer_groups`` are the
    engine's KV cache groups (lists of indices into ``kv``), and layers of different
    groups never share a kernel group. Raises what the two LMCache-named functions raise,
    and :class:`~kvlayout.registration.registration.RegistrationError` for tensors of one group that
    overlap in memory.
    """
    return _per_layer(kv, layer_groups, as_engine(engine), LayoutHints.coerce(layout_hints))


def normalize_kv_and_discover_format(
    kv: DiscoverableKVCache, engine: EngineLike, layout_hints: HintsLike = None
) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    """The format of a whole registration and the registration as callers must use it.

    The returned structure shares storage with ``kv`` (views only, never copies): dims in
    physical order, engine reshapes applied (TRT-LLM's flat pool row split, SGLang page
    buffers un-folded by ``tokens_per_block``, vLLM's DSA indexer squeezed), lists
    rebuilt (per-layer tuples of the tuple formats stay tuples). It carries its bound
    registration, which the facade and transfer functions read instead of the tensors:
    a list comes back as a read-only :class:`~kvlayout.registration.registration.RegisteredKV`, a bare
    tensor as a new view of the caller's tensor.

    Every leaf is checked: one rank, dtype, device and shape for the whole registration
    (the planes of an MLA tuple may differ from each other), strides the format can
    address, no two tensors overlapping in memory; a mismatch names the index.
    Raises ``KVLayoutError`` subclasses (``DetectionError``, ``LayoutHintError``,
    ``StridedViewError``, ``RegistrationError``) or ``TypeError`` for values that are not
    tensors and lists.
    """
    reg = _detect(kv, as_engine(engine), LayoutHints.coerce(layout_hints))
    return reg.format, reg.registered_kv


def _detect(
    kv: Any, engine: EngineType, hints: LayoutHints, uniform: list[Any] | None = None
) -> Registration:
    """``uniform``: ``kv`` already through :func:`_uniform_contiguous_list`."""
    if isinstance(kv, (list, tuple)):
        refuse_nested(kv)  # before the engine's hooks in _discover read the entries' shapes
    fmt, out, trusted = _discover(kv, engine, hints, uniform)
    return _bind(out, fmt, kv, engine=engine, root="kv_caches", trusted=trusted)


def _bind(kv: Any, formats: Any, registered: Any, **kwargs: Any) -> Registration:
    """:func:`~kvlayout.registration.registration.bind` of the normalized ``kv``, the
    caller's ``registered`` structure watched for re-allocation, its errors raised as
    detection's."""
    try:
        return bind(kv, formats, sources=registered, **kwargs)
    except RegistrationError as exc:
        if isinstance(exc, DetectionError):
            raise
        raise DetectionError(str(exc)) from None


_ORDERED_ROLES = {Axis.L: Role.LAYER, Axis.B: Role.BLOCK, Axis.N: Role.TOKEN, Axis.H: Role.HEAD}


def _in_order(layout: Layout, kv_layout: str | None) -> bool:
    """Whether the layout's layer, block, token and head axes (list levels first, a page
    axis as block then token) come in the order the ``kv_layout`` spelling gives them."""
    assert kv_layout is not None
    want = tuple(_ORDERED_ROLES[a] for a in kv_layout_axes(kv_layout) if a in _ORDERED_ROLES)
    return layout.role_order(want) == want


def _discover(
    kv: Any, engine: EngineType, hints: LayoutHints, uniform: list[Any] | None = None
) -> tuple[EngineKVFormat, Any, bool]:
    """The engine's detector on the physically ordered registration: (format, normalized
    registration, whether every tensor is known alike and contiguous)."""
    pooled = _pooled(kv, engine, hints)
    if pooled is not None:
        kv, hints = pooled
    for hint, owner in hint_owners().items():
        if owner is not engine and getattr(hints, hint) is not None:
            raise LayoutHintError(
                f"layout hint {hint} is {ENGINE_LABELS[owner]}'s, and {ENGINE_LABELS[engine]} does not "
                "read it"
            )
    for fact, where in (("is_head_outer", "heads outside blocks"), ("is_layer_inner", "layers inside heads")):
        if getattr(hints, fact) and not any(
            _in_order(LAYOUTS[f], hints.kv_layout) for f in engine_formats(engine)
        ):
            raise LayoutHintError(
                f"layout hint kv_layout={hints.kv_layout!r} puts {where}, in an order no {engine.value} "
                "format has"
            )
    detector = get_detector(engine)
    normalized: Any = uniform if uniform is not None else _uniform_contiguous_list(kv)
    trusted = normalized is not None

    def run(candidate: Any) -> tuple[EngineKVFormat, Any]:
        try:
            return detector(candidate, hints)
        except RuntimeError:  # a detector's re-view checks the storage: say which tensor has none
            problem = first_without_memory(candidate, "kv_caches")
            if problem is None:
                raise
            raise DetectionError(problem) from None

    if normalized is None and isinstance(kv, (list, tuple)):
        _refuse_mixed(list(kv), engine, hints)  # before the retry below, which would hide it
    try:
        if normalized is None:
            normalized = _physical(kv)
            validate(normalized)
        fmt, out = run(normalized)
    except DetectionError as refused:
        if trusted:  # no size-1 dims to place otherwise
            raise
        try:  # the caller's placement of size-1 dims fits nothing: try where their strides put them
            retry = _physical(kv, by_stride=True)
            if _same_views(retry, normalized):
                raise refused
            validate(retry)
            fmt, out = run(retry)
        except (KVLayoutError, TypeError):
            raise refused from None
        normalized = retry
    # every engine's size hints, checked against the leaves as the format reads them (and
    # as the engine means them, where it says)
    leaf = first_leaf(out)
    reading = size_hint_reading(engine)
    sized = hints if reading is None else reading(out, fmt, hints)
    check_size_hints(engine, fmt, leaf.shape, _page_hints(sized, leaf), lambda: probe(normalized).describe())
    if hints.layout_format is not None and hints.layout_format != fmt.name:
        raise LayoutHintError(
            f"layout hint layout_format={hints.layout_format!r} contradicts the registration, which "
            f"{engine.value} registers as {fmt.name} ({LAYOUTS[fmt].describe_shape()})"
        )
    if LAYOUTS[fmt].is_cross_layer:
        _check_blocks_outermost(kv, fmt)
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("Engine KV Format: %s %s", fmt.name, LAYOUTS[fmt].describe_shape())
    # the detector's re-views (un-folding, squeezing) keep tensors alike, not always contiguous
    return fmt, out, trusted and (out is normalized or _all_contiguous(out))


def _page_hints(hints: LayoutHints, leaf: torch.Tensor) -> LayoutHints:
    """The size hints ``leaf``'s axes can be checked against. An opaque page's axes are
    addressing only (its rows a page's bytes, a head axis the backend's head slots), so
    the model's ``num_kv_heads`` and ``head_dim`` say nothing of them: a detector that
    reads such pages checks those against the pages it read (vLLM's CPU_ATTN)."""
    if opaque_pages_of(leaf) is None:
        return hints
    return dataclasses.replace(hints, num_kv_heads=None, head_dim=None)


def _pooled(kv: Any, engine: EngineType, hints: LayoutHints) -> tuple[Any, LayoutHints] | None:
    """The engine's ``pool_views`` of the caller's registration (vLLM's BHLNC views)."""
    pool = view_pooling(engine)
    return None if pool is None else pool(kv, hints)


def _refuse_mixed(entries: list[Any], engine: EngineType, hints: LayoutHints) -> None:
    """The engine's word on layers of different shapes, before they are split apart."""
    refuse = mixed_check(engine)
    if refuse is not None:
        refuse(entries, hints)


def _physical(kv: Any, *, by_stride: bool = False) -> Any:
    """The registration in physical order, a list's layers laid out alike shaped alike
    (as the first of them reads: :func:`~kvlayout.registration.contiguity.align_unit_dims`)."""
    views = attempt_permute_to_contiguous_view(kv, by_stride=by_stride)
    return align_unit_dims(views) if isinstance(views, list) else views


def _same_views(a: Any, b: Any) -> bool:
    shapes = [(tuple(t.shape), t.stride()) for _, t in leaves(a)]
    return shapes == [(tuple(t.shape), t.stride()) for _, t in leaves(b)]


def _check_blocks_outermost(kv: Any, fmt: EngineKVFormat) -> None:
    """A pool holding every layer is read blocks-first (its dim 0 is the block axis), so
    the caller's dim 0 must be outermost in memory: recovering the physical order of a
    layer-major pool handed over as a blocks-first view would read layers as blocks."""
    pool = kv[0] if isinstance(kv, (list, tuple)) and len(kv) == 1 else kv
    if not isinstance(pool, torch.Tensor) or pool.dim() < 2 or pool.shape[0] <= 1:
        return
    stride = pool.stride()
    outer = max((d for d in range(pool.dim()) if pool.shape[d] > 1), key=lambda d: stride[d])
    if stride[outer] > stride[0]:
        raise DetectionError(
            f"kv_caches: dim {outer} (size {pool.shape[outer]}, stride {stride[outer]}) is outer to dim 0 "
            f"(size {pool.shape[0]}, stride {stride[0]}) in memory: {fmt.name} and every other format that "
            "holds all layers in one tensor read dim 0 as the blocks, outermost, so the tensor must be "
            "handed over with its outermost dim first. Whether dim "
            f"{outer} is the blocks (a blocks-first pool with its dims reordered: hand it over in memory "
            "order) or the layers (a layer-major pool, layers outer to blocks, which no format matches), "
            "its dims cannot be read as given"
        )


def _all_contiguous(kv: Any) -> bool:
    return all(t.is_contiguous() for _, t in leaves(kv))


def _uniform_contiguous_list(kv: Any) -> list[Any] | None:
    """The common registration (one contiguous tensor per layer, all alike) normalized
    and validated in one pass; None sends anything else the long way (which also words
    the errors). Contiguous without size-1 dims means already in physical order."""
    if not isinstance(kv, (list, tuple)) or not kv or not isinstance(kv[0], torch.Tensor):
        return None
    try:
        first = kv[0]
        shape, dtype, device = first.shape, first.dtype, first.device
        if 1 in shape or first.layout is not torch.strided:
            return None
        for t in kv:
            if (
                not isinstance(t, torch.Tensor)
                or not t.is_contiguous()
                or t.size() != shape  # size(): half the cost of .shape
                or t.dtype is not dtype
                or t.device != device
            ):
                return None
    except RuntimeError:  # a tensor that has no sizes or strides (nested, sparse CSR)
        return None
    return list(kv)


def normalize_and_discover_per_layer_formats(
    kv: DiscoverableKVCache,
    layer_index_groups: Sequence[Sequence[int]] | None,
    engine: EngineLike,
    layout_hints: HintsLike = None,
) -> tuple[DiscoverableKVCache, list[EngineKVFormat | None]]:
    """Per-layer formats of a registration whose layers may differ (hybrid models).

    The layers of each group are bucketed by physical structure (each tensor's shape and
    dtype in memory order) and each bucket is detected as one registration; a layer gets
    its bucket's format and normalized entry. When all grouped layers share one
    structure this is exactly :func:`normalize_kv_and_discover_format` on them, so the two
    always agree. ``layer_index_groups=None`` (or empty) puts every entry in one group.

    Registrations that are not one entry per layer (a cross-layer tensor, SGLang's K/V
    lists) are detected whole and every layer gets the format; they cannot be split, so
    their layers must all be grouped (or groups not given).

    A layer in no group (LMCache: cross-layer KV sharing, scratch caches) is returned as
    given, not interpreted, and its format is ``None``. LMCache 0.5.6 gives it the first
    detected format as a placeholder (or raises ``StopIteration``); ``None`` cannot be
    mistaken for a real answer, and ``group_layers_by_identity`` skips it.

    Returns the registration (a list of length ``len(kv)`` for layer lists; the whole
    normalized structure otherwise) and one format (or None) per layer.
    """
    reg = _per_layer(kv, layer_index_groups, as_engine(engine), LayoutHints.coerce(layout_hints))
    return reg.registered_kv, list(reg.formats)


def _per_layer(
    kv: Any, layer_index_groups: Sequence[Sequence[int]] | None, eng: EngineType, hints: LayoutHints
) -> Registration:
    if isinstance(kv, torch.Tensor):
        fmt, out, _ = _discover(kv, eng, hints)
        n = get_spec(out, fmt).num_layers()
        groups = _groups(layer_index_groups, n, "layers")
        owner = {i: g for g, group in enumerate(groups) for i in group}
        per_layer = [fmt if i in owner else None for i in range(n)]
        engine_groups = [owner.get(i, EXCLUDED_ENGINE_GROUP) for i in range(n)]
        return _bind(out, per_layer, kv, engine_groups=engine_groups, engine=eng, root="kv_caches")
    if not isinstance(kv, (list, tuple)):
        raise TypeError(f"kv_caches {not_a_kv_cache(kv)}")
    entries = list(kv)
    if not entries:
        raise DetectionError("kv_caches is empty")
    refuse_nested(entries)  # before the engine's hooks below read the entries' shapes
    groups = _groups(layer_index_groups, len(entries), "entries")
    owner = {i: g for g, group in enumerate(groups) for i in group}
    members = sorted(owner)
    pooled = _pooled(entries, eng, hints)
    if pooled is not None:  # one tensor that every entry (a layer) is a view of
        fmt, out, trusted = _discover(pooled[0], eng, pooled[1])
        if len(members) != len(entries):
            raise _left_out(fmt, entries, members)
        spanned = sorted(set(owner.values()))
        if len(spanned) > 1:
            raise DetectionError(
                f"kv_caches are views of one {fmt.name} tensor, one allocation holding every layer, so they "
                f"are one layer group, but layer_groups put them in groups {spanned}: detect each group's "
                "own allocation"
            )
        engine_groups = [owner[i] for i in range(len(entries))]
        return _bind(
            out, fmt, entries, engine_groups=engine_groups, engine=eng, root="kv_caches", trusted=trusted
        )
    uniform = _uniform_contiguous_list(entries) if len(members) == len(entries) else None
    if uniform is not None:  # the common case: one detection answers for every layer
        fmt, out, trusted = _discover(entries, eng, hints, uniform)
        return _bind_whole(out, fmt, entries, eng, [owner[i] for i in range(len(entries))], trusted)
    split = _split_mixed(entries, eng, hints, groups)
    if split is not None:
        return split
    _refuse_mixed(entries, eng, hints)
    views = physical_entries(entries, members)
    views = dict(zip(members, align_unit_dims([views[i] for i in members]), strict=True))
    _check_one_device(views)
    keys = {i: _key(views[i]) for i in members}
    if len(set(keys.values())) == 1:
        try:
            fmt, out, _ = _detect_subset(views, members, eng, hints, len(entries))
        except (KVLayoutError, TypeError):
            _refuse_left_out(entries, members, eng, hints)
            raise
        if not LAYOUTS[fmt].is_layer_list:
            if len(members) != len(entries):
                raise _left_out(fmt, entries, members)
            return _bind_whole(out, fmt, entries, eng, [owner[i] for i in range(len(entries))], False)
        result: list[Any] = list(entries)
        formats: list[EngineKVFormat | None] = [None] * len(entries)
        for j, i in enumerate(members):
            result[i], formats[i] = out[j], fmt
        return _bind_layers(result, formats, entries, owner, eng)
    result, formats = list(entries), [None for _ in entries]
    named_groups = bool(layer_index_groups)  # without them every layer is in one implicit group
    for g, group in enumerate(groups):
        buckets: dict[Hashable, list[int]] = {}
        for i in group:
            buckets.setdefault(keys[i], []).append(i)
        for idxs in buckets.values():
            fmt, out, _ = _detect_subset(
                views, idxs, eng, hints, len(entries), group=g if named_groups else None
            )
            if not LAYOUTS[fmt].is_layer_list:
                where = f" (layer group {g})" if named_groups else ""
                raise DetectionError(
                    f"{_layers(idxs)}{where} are {fmt.name}, which is not one entry per layer, "
                    "so layers of different shapes cannot be detected apart; register them uniformly"
                )
            for j, i in enumerate(idxs):
                result[i], formats[i] = out[j], fmt
    return _bind_layers(result, formats, entries, owner, eng)


def _split_mixed(
    entries: list[Any], eng: EngineType, hints: LayoutHints, layer_groups: list[list[int]]
) -> Registration | None:
    """A mixture the engine serves apart (SGLang's K and V of different head sizes): the
    two lists of leaves its hook gives, detected as components, one kernel group each
    (one engine group, so their memory is checked disjoint), the caller's tensors watched
    for re-allocation. None where the hook has none or says it is no such mixture."""
    split = mixed_split(eng)
    parts = None if split is None else split(entries, hints)
    if parts is None:
        return None
    first, second = parts
    n = len(entries)
    halves = [[0], [1]] if n == 2 else [list(range(n // 2)), list(range(n // 2, n))]  # two lists, or flat
    if sorted(map(sorted, layer_groups)) not in ([list(range(n))], halves):
        raise DetectionError(
            f"kv_caches holds K and V of different head sizes, served as two kernel groups (K, then V); "
            f"layer_groups {layer_groups} are neither one group of every entry nor the K and V entries"
        )
    views = [*first, *second]
    by_index = dict(enumerate(views))
    caller = list(leaves(entries))  # the caller's tensors, in the views' order, with their paths
    root = CallerRoot("kv_caches", {(i,): path for i, (path, _) in enumerate(caller)})
    _check_one_device(by_index)
    groups = [list(range(len(first))), list(range(len(first), len(views)))]
    components = dataclasses.replace(hints, kv_list_layout="unified")
    result: list[Any] = list(views)
    formats: list[EngineKVFormat | None] = [None] * len(views)
    for g, idxs in enumerate(groups):
        fmt, out, _ = _detect_subset(by_index, idxs, eng, components, len(views), group=g, root=root)
        for j, i in enumerate(idxs):
            result[i], formats[i] = out[j], fmt
    registered = [t for _, t in caller]
    return _bind(result, formats, registered, engine_groups=[0] * len(views), engine=eng, root=root)


def _refuse_left_out(entries: list[Any], members: list[int], eng: EngineType, hints: LayoutHints) -> None:
    """When some entries are in no group and the rest do not detect, say the real reason
    if the whole list is one structure (SGLang's K/V list): its entries cannot be left out."""
    if len(members) == len(entries):
        return
    try:
        fmt, _, _ = _discover(entries, eng, hints)
    except (KVLayoutError, TypeError):
        return
    if not LAYOUTS[fmt].is_layer_list:
        raise _left_out(fmt, entries, members)


def _left_out(fmt: EngineKVFormat, entries: list[Any], members: list[int]) -> DetectionError:
    """The error for a structure holding every layer with entries left out of the groups."""
    missing = next(i for i in range(len(entries)) if i not in members)
    return DetectionError(
        f"{fmt.name} holds every layer in one structure, so its entries cannot be left out "
        f"of the layer groups (kv_caches[{missing}] is in none); pass layer_index_groups=None"
    )


def _bind_whole(
    out: Any, fmt: EngineKVFormat, entries: list[Any], eng: EngineType, entry_groups: list[int], trusted: bool
) -> Registration:
    """A detection of every entry: a layer list keeps each entry's group; a structure
    that holds every layer (K/V lists) is one group."""
    if LAYOUTS[fmt].is_layer_list:
        return _bind(
            out, fmt, entries, engine_groups=entry_groups, engine=eng, root="kv_caches", trusted=trusted
        )
    return _bind(out, fmt, entries, engine=eng, root="kv_caches", trusted=trusted)


def _bind_layers(
    result: list[Any],
    formats: list[EngineKVFormat | None],
    entries: list[Any],
    owner: dict[int, int],
    eng: EngineType,
) -> Registration:
    groups = [owner.get(i, EXCLUDED_ENGINE_GROUP) for i in range(len(result))]
    return _bind(result, formats, entries, engine_groups=groups, engine=eng, root="kv_caches")


def _detect_subset(
    views: dict[int, Any],
    idxs: list[int],
    engine: EngineType,
    hints: LayoutHints,
    total: int,
    group: int | None = None,
    root: str = "kv_caches",
) -> tuple[EngineKVFormat, Any, bool]:
    try:
        return _discover([views[i] for i in idxs], engine, hints)
    except (KVLayoutError, TypeError) as exc:
        if idxs == list(range(total)):
            raise
        # The subset is detected as its own list: put the caller's paths back in its message.
        message = re.sub(
            r"\bkv_caches\[(\d+)\]",
            lambda m: describe_path((idxs[int(m[1])],), root) if int(m[1]) < len(idxs) else m[0],
            str(exc),
        )
        where = f" of layer group {group}" if group is not None else ""
        together = "detected on its own" if len(idxs) == 1 else f"detected together as a list of {len(idxs)}"
        raise type(exc)(f"{_layers(idxs, root)}{where}, {together}: {message}") from exc


def _layers(idxs: list[int], root: str = "kv_caches") -> str:
    """The caller's entries, by their indices (or their paths, where ``root`` maps them)."""
    if len(idxs) == 1:
        return describe_path((idxs[0],), root)
    if isinstance(root, CallerRoot):
        return ", ".join(describe_path((i,), root) for i in idxs)
    return f"kv_caches entries {idxs}"


def _groups(layer_index_groups: Sequence[Sequence[int]] | None, n: int, what: str) -> list[list[int]]:
    """Validated groups; None or empty means one group of everything."""
    if layer_index_groups is None or len(layer_index_groups) == 0:
        return [list(range(n))]
    owner: dict[int, int] = {}
    out: list[list[int]] = []
    for g, group in enumerate(layer_index_groups):
        if not _is_index_list(group):
            raise TypeError(
                f"layer_index_groups[{g}] is a {type(group).__name__}, not a sequence of layer indices"
            )
        idxs = []
        for raw in group:
            if isinstance(raw, bool):
                raise TypeError(f"layer_index_groups[{g}] holds {raw!r}, not a layer index")
            try:
                i = operator.index(raw)  # NumPy and torch integers too
            except TypeError:
                raise TypeError(f"layer_index_groups[{g}] holds {raw!r}, not a layer index") from None
            if not 0 <= i < n:
                raise KVLayoutError(f"layer_index_groups[{g}]: layer {i} is out of range for {n} {what}")
            if i in owner:
                if owner[i] == g:
                    raise KVLayoutError(f"layer_index_groups[{g}] lists layer {i} twice; list a layer once")
                raise KVLayoutError(
                    f"layer {i} is in layer groups {owner[i]} and {g}; a layer belongs to one group"
                )
            owner[i] = g
            idxs.append(i)
        out.append(idxs)
    return out


def _is_index_list(group: object) -> bool:
    """A sequence of layer indices: a list, tuple or range, or a 1-D NumPy or torch array."""
    if isinstance(group, (np.ndarray, torch.Tensor)):
        return group.ndim == 1
    return isinstance(group, (Sequence, range)) and not isinstance(group, (str, bytes))


def _check_one_device(views: dict[int, Any]) -> None:
    first: tuple[int, torch.device] | None = None
    for i, view in views.items():
        device = first_leaf(view, root=f"kv_caches[{i}]").device
        if first is None:
            first = (i, device)
        elif device != first[1]:
            raise DetectionError(
                f"kv_caches[{i}]: device {device} differs from kv_caches[{first[0]}] ({first[1]})"
            )


def _key(node: Any) -> Hashable:
    """A layer's physical structure: where each tensor sits, its shape (in memory order)
    and dtype."""
    return tuple((path, tuple(t.shape), t.dtype) for path, t in leaves(node))
