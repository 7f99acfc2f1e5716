"""The one place a registration's layout is resolved.

``normalize_kv_and_discover_format`` recovers physical dim order (zero-copy), checks the
structure (every leaf, not only the first), hands the registration to its engine's
detector, and returns the format with the normalized registration callers must use from
then on. ``normalize_and_discover_per_layer_formats`` does the same per layer for
hybrid models whose layers differ.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from kvlayout._generated.formats import LAYOUTS, EngineKVFormat
from kvlayout.contiguity import attempt_permute_to_contiguous_view, not_a_kv_cache, physical_entries
from kvlayout.detection.base import DetectionError, check_levels, first_leaf, validate
from kvlayout.detection.registry import get_detector
from kvlayout.errors import KVLayoutError
from kvlayout.registry import get_spec
from kvlayout.types import DiscoverableKVCache, EngineLike, EngineType, HintsLike, LayoutHints, as_engine

__all__ = ["normalize_and_discover_per_layer_formats", "normalize_kv_and_discover_format"]

_log = logging.getLogger("kvlayout")


def normalize_kv_and_discover_format(
    kv: DiscoverableKVCache, engine: EngineLike, layout_hints: HintsLike = None
) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    """The format of a whole registration and the registration as callers must use it.

    The returned structure shares storage with ``kv`` (views only, never copies): dims in
    physical order, engine reshapes applied (TRT-LLM's flat pool row split, SGLang page
    buffers un-folded by ``tokens_per_block``, vLLM's DSA indexer squeezed), lists
    rebuilt (per-layer tuples of the tuple formats stay tuples).

    Every leaf is checked: one rank, dtype, device and shape for the whole registration
    (the planes of an MLA tuple may differ from each other); a mismatch names the index.
    Raises ``KVLayoutError`` subclasses (``DetectionError``, ``LayoutHintError``,
    ``StridedViewError``) or ``TypeError`` for values that are not tensors and lists.
    """
    return _detect(kv, as_engine(engine), LayoutHints.coerce(layout_hints))


def _detect(
    kv: Any, engine: EngineType, hints: LayoutHints, uniform: list[Any] | None = None
) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    """``uniform``: ``kv`` already through :func:`_uniform_contiguous_list`."""
    detector = get_detector(engine)
    normalized: Any = uniform if uniform is not None else _uniform_contiguous_list(kv)
    if normalized is None:
        normalized = attempt_permute_to_contiguous_view(kv)
        validate(normalized)
    fmt, out = detector(normalized, hints)
    check_levels(out, LAYOUTS[fmt])
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("Engine KV Format: %s %s", fmt.name, LAYOUTS[fmt].describe_shape())
    return fmt, out


def _uniform_contiguous_list(kv: Any) -> list[Any] | None:
    """The common registration (one contiguous tensor per layer, all alike) normalized
    and validated in one pass; None sends anything else the long way (which also words
    the errors). Contiguous without size-1 dims means already in physical order."""
    if not isinstance(kv, (list, tuple)) or not kv or not isinstance(kv[0], torch.Tensor):
        return None
    first = kv[0]
    shape, dtype, device = first.shape, first.dtype, first.device
    if 1 in shape:
        return None
    for t in kv:
        if (
            not isinstance(t, torch.Tensor)
            or not t.is_contiguous()
            or t.shape != shape
            or t.dtype is not dtype
            or t.device != device
        ):
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
    eng, hints = as_engine(engine), LayoutHints.coerce(layout_hints)
    if isinstance(kv, torch.Tensor):
        fmt, out = _detect(kv, eng, hints)
        n = get_spec(out, fmt).num_layers()
        groups = _groups(layer_index_groups, n, "layers")
        grouped = {i for group in groups for i in group}
        return out, [fmt if i in grouped else None for i in range(n)]
    if not isinstance(kv, (list, tuple)):
        raise TypeError(f"kv_caches {not_a_kv_cache(kv)}")
    entries = list(kv)
    if not entries:
        raise DetectionError("kv_caches is empty")
    groups = _groups(layer_index_groups, len(entries), "entries")
    members = sorted({i for group in groups for i in group})
    uniform = _uniform_contiguous_list(entries) if len(members) == len(entries) else None
    if uniform is not None:  # the common case: one detection answers for every layer
        fmt, out = _detect(entries, eng, hints, uniform)
        if LAYOUTS[fmt].is_layer_list:
            return list(out), [fmt] * len(entries)
        return out, [fmt] * get_spec(out, fmt).num_layers()
    views = physical_entries(entries, members)
    _check_one_device(views)
    keys = {i: _key(views[i]) for i in members}
    if len(set(keys.values())) == 1:
        fmt, out = _detect_subset(views, members, eng, hints, len(entries))
        if not LAYOUTS[fmt].is_layer_list:
            if len(members) != len(entries):
                missing = next(i for i in range(len(entries)) if i not in views)
                raise DetectionError(
                    f"{fmt.name} holds every layer in one structure, so its entries cannot be left out "
                    f"of the layer groups (kv_caches[{missing}] is in none); pass layer_index_groups=None"
                )
            return out, [fmt] * get_spec(out, fmt).num_layers()
        result: list[Any] = list(entries)
        formats: list[EngineKVFormat | None] = [None] * len(entries)
        for j, i in enumerate(members):
            result[i], formats[i] = out[j], fmt
        return result, formats
    result, formats = list(entries), [None] * len(entries)
    for g, group in enumerate(groups):
        buckets: dict[Hashable, list[int]] = {}
        for i in group:
            buckets.setdefault(keys[i], []).append(i)
        for idxs in buckets.values():
            fmt, out = _detect_subset(views, idxs, eng, hints, len(entries), group=g)
            if not LAYOUTS[fmt].is_layer_list:
                raise DetectionError(
                    f"layers {idxs} (layer group {g}) are {fmt.name}, which is not one entry per layer, "
                    "so layers of different shapes cannot be detected apart; register them uniformly"
                )
            for j, i in enumerate(idxs):
                result[i], formats[i] = out[j], fmt
    return result, formats


def _detect_subset(
    views: dict[int, Any],
    idxs: list[int],
    engine: EngineType,
    hints: LayoutHints,
    total: int,
    group: int | None = None,
) -> tuple[EngineKVFormat, Any]:
    try:
        return _detect([views[i] for i in idxs], engine, hints)
    except (KVLayoutError, TypeError) as exc:
        if idxs == list(range(total)):
            raise
        where = f" of layer group {group}" if group is not None else ""
        raise type(exc)(
            f"layers {idxs}{where}, detected together (kv_caches[k] below is layer {idxs[0]}, "
            f"{idxs[1] if len(idxs) > 1 else '...'}, ... in that order): {exc}"
        ) from exc


def _groups(layer_index_groups: Sequence[Sequence[int]] | None, n: int, what: str) -> list[list[int]]:
    """Validated groups; None or empty means one group of everything."""
    if layer_index_groups is None or len(layer_index_groups) == 0:
        return [list(range(n))]
    owner: dict[int, int] = {}
    out: list[list[int]] = []
    for g, group in enumerate(layer_index_groups):
        if isinstance(group, (str, bytes)) or not isinstance(group, (Sequence, range)):
            raise TypeError(
                f"layer_index_groups[{g}] is a {type(group).__name__}, not a sequence of layer indices"
            )
        idxs = []
        for raw in group:
            if isinstance(raw, bool):
                raise TypeError(f"layer_index_groups[{g}] holds {raw!r}, not a layer index")
            try:
                i = operator.index(raw)
            except TypeError:
                raise TypeError(f"layer_index_groups[{g}] holds {raw!r}, not a layer index") from None
            if not 0 <= i < n:
                raise KVLayoutError(f"layer_index_groups[{g}]: layer {i} is out of range for {n} {what}")
            if i in owner:
                raise KVLayoutError(
                    f"layer {i} is in layer groups {owner[i]} and {g}; a layer belongs to one group"
                )
            owner[i] = g
            idxs.append(i)
        out.append(idxs)
    return out


def _check_one_device(views: dict[int, Any]) -> None:
    first: tuple[int, torch.device] | None = None
    for i, view in views.items():
        device = first_leaf(view).device
        if first is None:
            first = (i, device)
        elif device != first[1]:
            raise DetectionError(
                f"kv_caches[{i}]: device {device} differs from kv_caches[{first[0]}] ({first[1]})"
            )


def _key(node: Any) -> Hashable:
    """A layer's physical structure: each tensor's shape (in memory order) and dtype."""
    if isinstance(node, torch.Tensor):
        return (tuple(node.shape), node.dtype)
    return tuple(_key(child) for child in node)
