"""Applying the group edits: one pass over every layer of every model, then the check.

This is the module LMCache's ``kv_cache_group_edits`` maps to. LMCache imports vLLM's
``KVCacheSpecKind`` and ``get_kv_cache_spec_kind`` there, so code written against it
finds them here too when vLLM is importable (looked up on first use: kvlayout reads
spec kinds structurally, :func:`~kvlayout.integrations.vllm.specs.spec_kind`, and never
needs vLLM to import).
"""

from __future__ import annotations

import importlib
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvlayout._generated.formats import LAYOUTS, EngineKVFormat
from kvlayout.catalog.registry import get_spec
from kvlayout.detection.vllm import indexer_format
from kvlayout.errors import as_int
from kvlayout.integrations.vllm.errors import KVCacheGroupEditError
from kvlayout.integrations.vllm.granularity import check_block_granularity
from kvlayout.integrations.vllm.pages import OPAQUE_HEAD_PAGES_FORMAT, OPAQUE_PAGE_FORMAT
from kvlayout.integrations.vllm.rules import (
    CPUAttentionPagesEdit,
    HeadSlotPagesEdit,
    KVCacheGroupEdit,
    MambaStateListEdit,
    MambaStateRowsEdit,
    PackedHeadRowsEdit,
    PagedScaleMLAEdit,
    RingBufferPagesEdit,
    SubpagedAttentionEdit,
    SubpagedMLAEdit,
)
from kvlayout.integrations.vllm.specs import (
    MLA_KINDS,
    PAGED_ATTENTION_KINDS,
    allocations,
    declares_indexer,
    iter_group_layer_specs,
    iter_groups,
    require_layer_dict,
    slots_per_block,
    spec_kind,
    tokens_per_slot,
)
from kvlayout.integrations.vllm.validation import (
    find_kv_cache_groups_out_of_offloading,
    validate_kv_cache_groups,
)
from kvlayout.registration.opaque import is_marked, mark_opaque_pages, opaque_pages_of
from kvlayout.types import HintsLike, LayoutHintError, LayoutHints

__all__ = ["KV_CACHE_GROUP_EDITS", "apply_kv_cache_group_edits", "find_kv_cache_group_edit"]

logger = logging.getLogger(__name__)

KV_CACHE_GROUP_EDITS: tuple[KVCacheGroupEdit, ...] = (
    CPUAttentionPagesEdit(),
    MambaStateRowsEdit(),
    MambaStateListEdit(),
    RingBufferPagesEdit(),
    HeadSlotPagesEdit(),
    PackedHeadRowsEdit(),
    PagedScaleMLAEdit(),
    SubpagedMLAEdit(),
    SubpagedAttentionEdit(),
)
"""The rules, in priority order: the first that matches a layer edits it."""


def find_kv_cache_group_edit(
    spec: Any,
    value: Any,
    edits: Sequence[KVCacheGroupEdit] = KV_CACHE_GROUP_EDITS,
    layout_hints: HintsLike = None,
) -> KVCacheGroupEdit | None:
    """The rule that would edit this (leaf spec, registered value) under the layout hints
    detection will get (:meth:`KVCacheGroupEdit.matches_with_hints`), or ``None``.

    A spec that declares slot compression is edited only for its kernel paging, and
    keeps its compression: the edited block has the spec's ``block_size / ratio`` slots.
    """
    return next((edit for edit in edits if edit.matches_with_hints(spec, value, layout_hints)), None)


def _storage_ptr(value: Any) -> int:
    first = value if isinstance(value, torch.Tensor) else value[0]
    return int(first.untyped_storage().data_ptr())


def _check_storage(edit: KVCacheGroupEdit, value: Any, view: torch.Tensor) -> None:
    if not isinstance(view, torch.Tensor) or view.untyped_storage().data_ptr() != _storage_ptr(value):
        raise KVCacheGroupEditError(f"edit {edit.name!r} did not return a view of the registered storage")


def _check_view(edit: KVCacheGroupEdit, spec: Any, value: Any, view: torch.Tensor) -> None:
    """The invariants every opaque view keeps, whichever rule made it (user rules
    included); a block view is read by the granularity check like any registered layer."""
    _check_storage(edit, value, view)
    fmt = edit.output_format
    if fmt is OPAQUE_PAGE_FORMAT and view.dim() == 4:  # pages per head slot (LHBNC)
        fmt = OPAQUE_HEAD_PAGES_FORMAT
    block_size, wanted = get_spec([view], fmt).block_size(), slots_per_block(spec)
    if wanted is None:
        raise KVCacheGroupEditError(
            f"edit {edit.name!r} edited a {type(spec).__name__}, which declares no whole number of slots "
            "per block to check its view against"
        )
    if block_size != wanted:
        ratio = tokens_per_slot(spec)
        expected = f"block_size {wanted}" if ratio == 1 else f"{wanted} slots per block ({ratio} tokens each)"
        raise KVCacheGroupEditError(
            f"edit {edit.name!r} produced a view whose block size reads as {block_size} under "
            f"{fmt.name}, not the spec's {expected}"
        )


def _edited(edit: KVCacheGroupEdit, spec: Any, value: Any, layout_hints: HintsLike) -> torch.Tensor:
    """One layer as ``edit`` re-views it, marked: whole blocks that read as the engine's
    format, or opaque pages."""
    over = [value] if isinstance(value, torch.Tensor) else list(value)
    view = edit.block_view(spec, value)
    if view is not None:  # whole blocks, read as the engine's own format
        _check_storage(edit, value, view)
        mark_opaque_pages(view, None, over)
        return view
    view = edit.apply(spec, value, layout_hints)
    _check_view(edit, spec, value, view)
    # the view reads as a format, but its rows are the kernel's page bytes: say so
    mark_opaque_pages(view, edit.opaque_pages(spec, value, layout_hints), over)
    return view


def _check_hints_against_spec(spec: Any, hints: LayoutHints, group: int, value: Any = None) -> None:
    """Refuse hints that say of a group's layers what its spec, vLLM's own word, contradicts:
    MLA latents (``kv_dim=1``, an MLA ``layout_format``) for a spec of heads of K and V;
    K and V planes or heads (another ``kv_dim``, a ``layout_format`` that is not one row a
    token) for an MLA spec; and a DSA indexer's key records (an indexer ``layout_format``)
    for an MLA layer that is not an indexer's. ``value`` is the layer as registered (None
    where this worker has none): the spec's ``cache_role`` says indexer where vLLM sets
    it, and where it does not (DeepSeek-V4's indexer keeps the default), the rows do, as
    :func:`_latents` reads them."""
    kind = spec_kind(spec)
    if kind not in MLA_KINDS and kind not in PAGED_ATTENTION_KINDS:
        return  # no heads to say anything of (Mamba state, a ring), or a spec validation refuses
    named = None if hints.layout_format is None else LAYOUTS[EngineKVFormat[hints.layout_format]]
    if kind in MLA_KINDS:
        if hints.kv_dim not in (None, 1):
            hint = f"kv_dim={hints.kv_dim}"
        elif named is not None and not named.is_mla:
            hint = f"layout_format={hints.layout_format!r}"
        elif named is not None and named.is_indexer and not _holds_indexer_keys(spec, value):
            raise LayoutHintError(
                f"layout hint layout_format={hints.layout_format!r} contradicts KV cache group {group}'s "
                f"{type(spec).__name__}: it names a DSA indexer's key records, but the spec's layers hold "
                "MLA latents (its cache_role is not INDEXER, and the registered rows are not an indexer's), "
                "which the group edits read as latents without a hint; leave it out"
            )
        else:
            return
        raise LayoutHintError(
            f"layout hint {hint} contradicts KV cache group {group}'s {type(spec).__name__}: vLLM's MLA "
            "layers hold one latent row a token (no K and V planes, no heads), which the group edits read "
            "as latents without a hint; leave it out"
        )
    if hints.kv_dim == 1:
        hint = "kv_dim=1"
    elif named is not None and named.is_mla:
        hint = f"layout_format={hints.layout_format!r}"
    else:
        return
    raise LayoutHintError(
        f"layout hint {hint} contradicts KV cache group {group}'s {type(spec).__name__}: it says MLA "
        "latents, but the spec's layers hold heads of K and V (the group edits read an MLA spec's layers "
        "as latents without the hint); leave it out"
    )


def _holds_indexer_keys(spec: Any, value: Any) -> bool:
    """An MLA layer of an indexer's keys: its spec says so (``cache_role`` INDEXER), or its
    registered rows are the indexer's (vLLM leaves DeepSeek-V4's indexer spec at the default
    role). A layer this worker did not register is not refused on its rows."""
    return declares_indexer(spec) or value is None or indexer_format(value) is not None


def _latents(spec: Any, value: Any) -> torch.Tensor | None:
    """An MLA layer's one-head ``[NB, 1, BS, C]`` as ``[NB, BS, C]``, the view vLLM's
    ``MLAAttention.bind_kv_cache`` takes (``squeeze(1)``): the shape of a one-head fused
    K | V cache that only a ``kv_dim=1`` hint tells apart, while the spec says it. None
    for anything else (the DSA indexer's rows read as its pages under every hint)."""
    if (
        spec_kind(spec) not in MLA_KINDS
        or not isinstance(value, torch.Tensor)
        or opaque_pages_of(value) is not None
    ):
        return None
    if value.dim() != 4 or value.shape[1] != 1 or indexer_format(value) is not None:
        return None
    return value.squeeze(1)


def apply_kv_cache_group_edits(
    kv_cache_config: Any,
    kv_caches: Mapping[str, Any],
    layout_hints: HintsLike = None,
    *,
    edits: Sequence[KVCacheGroupEdit] = KV_CACHE_GROUP_EDITS,
    prefix_reuse: bool = True,
) -> dict[str, Any]:
    """Re-present a vLLM model's registered KV caches so every block dim is a block id.

    Validates the groups first (:func:`validate_kv_cache_groups`, with ``prefix_reuse``:
    False for a P/D connector, which also serves Mamba outside align mode, one state page
    per block id). Every model goes
    through the rules, not only hybrids: vLLM pages any attention group finer than its
    block when the backend needs it (FlashInfer's 16/32/64 under ``--block-size 128``).
    Layers no rule matches come back as the same objects; each edited layer becomes a
    view over its own storage, never a copy. Under ``prefix_reuse`` the layers of a group
    vLLM keeps out of prefix caching (:func:`find_kv_cache_groups_out_of_prefix_reuse`: a
    ``CircularBufferSpec`` ring, a bounded-replay sliding window) are left out of the
    result, logged with why, so
    :func:`transfer_layers` gives their group no layers, as vLLM's offloading stores none;
    under HiSparse, as vLLM's OffloadingConnector, every group but the HiSparse indexer
    groups (:func:`find_kv_cache_groups_out_of_offloading`).

    The spec is vLLM's own word on what a group holds. An MLA group's one-head latents
    ``[NB, 1, BS, C]`` (edited or not) come back as ``[NB, BS, C]``, the view vLLM's
    ``MLAAttention.bind_kv_cache`` takes, which reads as latents under any hints: as
    registered they have the shape of a one-head fused K | V cache, which detection tells
    apart only by ``kv_dim=1``. Hints a group's spec contradicts raise
    :class:`~kvlayout.types.LayoutHintError` naming the group and its spec class:
    ``kv_dim`` other than 1, or a ``layout_format`` with K and V or heads, on an MLA spec,
    or a DSA indexer's ``layout_format`` on an MLA layer that is not an indexer's;
    ``kv_dim=1``, or an MLA ``layout_format``, on a spec of heads of K and V.

    ``layout_hints`` are the hints detection will get. The opaque views read the same
    under any of them, but the whole-block views (in the engine's own format: NHD
    attention pages, MLA latents) and the layers left as registered read as the hint
    says, so detection must get these same hints, and the result is checked under them
    (:func:`check_block_granularity`): every paged layer's detected block size must be
    its group's slots per block (``block_size``, or ``block_size / ratio`` where
    compression is declared), or this raises before anything is registered. That is
    how a ``kv_layout`` hint that contradicts vLLM's allocation is caught.
    """
    require_layer_dict(kv_caches)
    validate_kv_cache_groups(kv_cache_config, prefix_reuse=prefix_reuse)
    edited = dict(kv_caches)
    if kv_cache_config is None:
        return edited
    if prefix_reuse:  # as vLLM's OffloadingConnector: its prefix-cacheable groups (HiSparse: indexers)
        for problem in find_kv_cache_groups_out_of_offloading(kv_cache_config):
            for name in problem.layers:
                edited.pop(name, None)
            logger.info("KV cache group left out: %s", problem)
    hints = LayoutHints.coerce(layout_hints)
    applied: Counter[KVCacheGroupEdit] = Counter()
    for group_idx, group in iter_groups(kv_cache_config):
        for layer_name, spec in iter_group_layer_specs(group):
            registered = kv_caches.get(layer_name) if layer_name is not None else None
            _check_hints_against_spec(spec, hints, group_idx, registered)
            if layer_name is None or layer_name not in edited:
                continue  # not registered by this worker (e.g. another pipeline stage)
            value = edited[layer_name]
            edit = find_kv_cache_group_edit(spec, value, edits, layout_hints)
            try:
                view = value if edit is None else _edited(edit, spec, value, layout_hints)
            except KVCacheGroupEditError as e:
                raise e.for_layer(layer_name, group_idx) from e
            if edit is not None:
                applied[edit] += 1
            latents = _latents(spec, view)
            if latents is not None:  # as MLA's bind_kv_cache views it; reads as latents under any hints
                mark_opaque_pages(latents, None, [value])
                view = latents
            edited[layer_name] = view
    if applied:
        logger.info(
            "KV cache group edits applied: %s (LMCache's names: %s)",
            {edit.name: n for edit, n in applied.items()},
            {edit.lmcache_name or edit.name: n for edit, n in applied.items()},
        )
    check_block_granularity(kv_cache_config, edited, layout_hints)
    return edited


def transfer_layers(
    kv_cache_config: Any,
    kv_caches: Mapping[str, Any],
    *,
    group: int | None = None,
    allocation: int | None = None,
) -> tuple[list[Any], list[list[int]] | None]:
    """What a connector hands detection: the values of ``kv_caches`` (as the edits
    returned them) whose layers vLLM transfers, in registration order, and their KV
    cache groups as ``detect``'s ``layer_groups`` (indices into that list). A group
    vLLM keeps out of transfer (``enable_kv_transfer=False``) is an empty group and its
    layers are left out, so every other group keeps vLLM's group id as its position;
    a layer this worker did not register (another pipeline stage's) is left out too.

    ``detect(layers, "vllm", hints, layer_groups=groups)`` then reads only what moves.
    Without a config (None, as the edits take it) every layer, and no groups.

    ``group=g``: group ``g``'s layers alone, its groups empty but the last (``g``), so
    that ``detect`` gives one registration of that group under vLLM's group id: what
    ``BHLNC`` needs, whose groups are each one cross-layer tensor (and peers of such a
    side, whose layers then number alike). It leaves out the layers that share another's
    KV cache (vLLM's KV sharing: in the group, in no ``KVCacheTensor``), which a
    cross-layer tensor cannot hold twice; their target's blocks are theirs.

    ``allocation=i``: the layers of ``kv_cache_config.kv_cache_tensors[i]`` that vLLM
    transfers, in its layer order, under their group's id as ``group=g`` gives them: one
    ``BHLNC`` cross-layer tensor each, also where a group is several allocations (vLLM's
    ``UniformTypeKVCacheSpecs`` of different shapes). Every layout has the same
    allocations, so a peer detected the same way numbers its layers alike."""
    require_layer_dict(kv_caches)
    if group is not None and allocation is not None:
        raise ValueError(f"pass group or allocation, not both (group={group}, allocation={allocation})")
    if kv_cache_config is None:
        for name, value in (("group", group), ("allocation", allocation)):
            if value is not None:
                raise ValueError(f"{name}={value} names a part of the config, but there is none")
        return list(kv_caches.values()), None
    transferred = dict(iter_groups(kv_cache_config))
    wanted = {name for group in transferred.values() for name in getattr(group, "layer_names", None) or ()}
    names = [name for name in kv_caches if name in wanted]
    index = {name: i for i, name in enumerate(names)}
    groups = [
        [index[name] for name in getattr(group, "layer_names", None) or () if name in index]
        if position in transferred
        else []
        for position, group in enumerate(kv_cache_config.kv_cache_groups or ())
    ]
    _require_edited(kv_cache_config, kv_caches, wanted)
    layers = [kv_caches[name] for name in names]
    if group is None and allocation is None:
        return layers, groups
    allocated = allocations(kv_cache_config)
    if allocation is not None:
        members = allocated[_index("allocation", allocation, len(allocated), "KVCacheTensor")]
        own = [index[name] for name in members if name in index]
        owners = [set(getattr(g, "layer_names", None) or ()) for g in kv_cache_config.kv_cache_groups or ()]
        group = next((g for g, names_of_g in enumerate(owners) if names_of_g & set(members)), 0)
    else:
        group = _index("group", group, len(groups), "KV cache group")
        owned = {name for members in allocated for name in members}
        own = [i for i in groups[group] if not owned or names[i] in owned]
    return [layers[i] for i in own], [[] for _ in range(group)] + [list(range(len(own)))]


def _require_edited(kv_cache_config: Any, kv_caches: Mapping[str, Any], wanted: set[str]) -> None:
    """Refuse a layer that a rule would still edit, as registered (no edit's mark): its
    blocks are not block ids yet (kernel pages, a Mamba state row), and a transfer by the
    scheduler's block ids would move the wrong bytes without a word."""
    for group_idx, group in iter_groups(kv_cache_config):
        for layer_name, spec in iter_group_layer_specs(group):
            if layer_name not in wanted or layer_name not in kv_caches:
                continue
            value = kv_caches[layer_name]
            # the rules that need no hints (the hints decide CPU_ATTN's, which this cannot ask)
            edit = next((e for e in KV_CACHE_GROUP_EDITS if e.matches(spec, value)), None)
            if edit is None or (isinstance(value, torch.Tensor) and is_marked(value)):
                continue
            raise KVCacheGroupEditError(
                f"is as vLLM registered it, but the {edit.name!r} edit re-views it (until then a "
                "registered block is not a block id): pass kv_caches through "
                "apply_kv_cache_group_edits(kv_cache_config, kv_caches, hints) first, and its result here",
                layer=layer_name,
                group=group_idx,
            )


def _index(name: str, value: object, count: int, what: str) -> int:
    """``value`` as an index of ``count`` things (``what``), checked: any int
    :func:`~kvlayout.errors.as_int` takes (NumPy and torch integers too, never a bool)."""
    try:
        index = as_int(value, name)
    except TypeError:
        raise TypeError(f"{name} must be an int (a {what} id), not {type(value).__name__}") from None
    if not 0 <= index < count:
        raise ValueError(f"{name}={index} is not a {what} id: the config has {count} {what}s")
    return index


_FROM_VLLM = ("KVCacheSpecKind", "get_kv_cache_spec_kind")


def __getattr__(name: str) -> Any:
    """vLLM's ``KVCacheSpecKind`` and ``get_kv_cache_spec_kind``, where LMCache's module
    has them; an ``AttributeError`` (so ``from ... import`` fails cleanly) without vLLM."""
    if name not in _FROM_VLLM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        interface = importlib.import_module("vllm.v1.kv_cache_interface")
    except ImportError as e:
        raise AttributeError(
            f"{name} is vLLM's (vllm.v1.kv_cache_interface), which cannot be imported here ({e}); "
            "kvlayout.integrations.vllm.spec_kind classifies specs without vLLM"
        ) from None
    return getattr(interface, name)
