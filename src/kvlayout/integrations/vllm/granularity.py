"""The check the edits exist for: every layer's block, as detection reads it, is a block id.

LMCache and kvlayout's consumers take a group's block size from the detected tensors and
the block ids from vLLM's scheduler (``spec.block_size`` tokens each, ``block_size /
ratio`` slots where the spec declares compression). Where the two differ, the group
looks slot-compressed (or compressed by the wrong ratio) and transfers move the wrong
bytes, silently.
The edits make them agree for the registrations they know; this check proves it for
every layer under the hints detection will use, which also catches a ``kv_layout`` hint
that does not match vLLM's allocation (an NHD page read as HND swaps heads and tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvlayout._generated.formats import LAYOUTS, EngineKVFormat
from kvlayout.detection import normalize_and_discover_per_layer_formats
from kvlayout.errors import KVLayoutError
from kvlayout.facade import get_block_size, get_num_blocks
from kvlayout.integrations.vllm.errors import DOCS
from kvlayout.integrations.vllm.specs import (
    PAGED_ATTENTION_KINDS,
    SpecKind,
    allocations,
    iter_group_layer_specs,
    iter_groups,
    require_layer_dict,
    slots_per_block,
    spec_field,
    spec_kind,
    spec_size,
    tokens_per_slot,
)
from kvlayout.layout.vocabulary import (
    HEAD_OUTER_KV_LAYOUTS,
    HND_KV_LAYOUTS,
    KV_LAYOUT_ALIASES,
    KV_LAYOUT_NAMES,
    Axis,
    Role,
    kv_layout_axes,
)
from kvlayout.registration.contiguity import physical_order
from kvlayout.registration.opaque import viewed_over
from kvlayout.types import EngineType, HintsLike, LayoutHintError, LayoutHints

__all__ = ["BlockGranularityError", "check_block_granularity"]

_PAGED_KINDS = frozenset(
    {
        SpecKind.FULL_ATTENTION,
        SpecKind.MLA_ATTENTION,
        SpecKind.SLIDING_WINDOW,
        SpecKind.SLIDING_WINDOW_MLA,
        SpecKind.CHUNKED_LOCAL_ATTENTION,
        SpecKind.SINK_FULL_ATTENTION,
        SpecKind.MAMBA,
    }
)


class BlockGranularityError(KVLayoutError):
    """Layers whose detected block size is not their group's slots per block (``block_size``,
    or ``block_size / ratio`` where the spec declares compression)."""


def _slots_of_a_block_id(spec: Any) -> int | None:
    """The slots a paged spec's registered block must hold (:func:`slots_per_block`:
    ``block_size``, or ``block_size / ratio`` for declared compression); None for kinds
    that are not paged and for slot geometries that are no whole number (Whisper's
    pooled fractions, the pre-0.26 ``tq_slot_size`` packing), which are not checked."""
    return slots_per_block(spec) if spec_kind(spec) in _PAGED_KINDS else None


# vLLM 0.33's attention view is [blocks, heads, tokens, C] in every KVCacheLayout; the
# memory order of its first three axes is the layout (BLHNC and BLNHC order a layer like
# their L-first twins, which come first in KV_LAYOUT_NAMES' aliases).
_VIEW_AXES = (Axis.B, Axis.H, Axis.N)


def _allocation_by_order() -> dict[tuple[int, ...], tuple[str, bool, bool]]:
    """Each accepted spelling's memory order of the view's first axes: (how messages name
    it, heads before tokens, heads outside blocks)."""
    aliases = {letters: alias for alias, letters in KV_LAYOUT_ALIASES.items()}
    out: dict[tuple[int, ...], tuple[str, bool, bool]] = {}
    for name in KV_LAYOUT_NAMES:
        letters = KV_LAYOUT_ALIASES.get(name, name)
        order = tuple(_VIEW_AXES.index(a) for a in kv_layout_axes(letters) if a in _VIEW_AXES)
        label = f"{letters} ({aliases[letters]})" if letters in aliases else letters
        out.setdefault(order, (label, letters in HND_KV_LAYOUTS, letters in HEAD_OUTER_KV_LAYOUTS))
    return out


_ALLOCATED = _allocation_by_order()


def _allocated(spec: Any, value: Any) -> tuple[str, bool, bool] | None:
    """How vLLM 0.33 allocated a registered attention layer, from its view's memory order:
    (spelling, heads before tokens, heads outside blocks); None for a layer an edit
    re-viewed, another release's registration, or unit axes that leave it open."""
    if (
        spec_kind(spec) not in PAGED_ATTENTION_KINDS
        or not isinstance(value, torch.Tensor)
        or value.dim() != 4
        or value.shape[1] != spec_field(spec, "num_kv_heads", None)
        or 1 in value.shape[:3]
        or viewed_over(value)
    ):
        return None
    order = tuple(d for d in physical_order(value.shape, value.stride()) if d < 3)
    return _ALLOCATED.get(order)


def _wanted(slots: int, spec: Any) -> str:
    ratio = tokens_per_slot(spec) or 1  # a checked spec has one
    return f"{slots}" if ratio == 1 else f"{slots} ({slots * ratio} tokens at {ratio} per slot)"


def _read_layers(
    kv_cache_config: Any, kv_caches: Mapping[str, Any], groups: list[list[int]], layout_hints: HintsLike
) -> dict[int, tuple[Any, EngineKVFormat | None, int]]:
    """Each grouped layer's detection: (normalized registration, format, index in it).

    The layers are read together, as ``detect`` reads them. Where that fails, each of
    vLLM's allocations (a ``KVCacheTensor``'s layers of one group) is read on its own, as
    vLLM lays out layers that only tile their own allocation (``BHLNC``: one cross-layer
    tensor per allocation, which ``detect`` takes one at a time); a layer in no allocation
    shares another's KV cache (vLLM's KV sharing registers the target's own tensor) and
    reads as that one. If that fails too, the error of reading them together is raised
    (it names layers by their place in ``kv_caches``), or an allocation's hint error."""
    values = list(kv_caches.values())
    try:
        normalized, formats = normalize_and_discover_per_layer_formats(
            values, groups, EngineType.VLLM, layout_hints
        )
        return {i: (normalized, formats[i], i) for group in groups for i in group}
    except KVLayoutError as together:
        units = _allocations(kv_cache_config, list(kv_caches), groups)
        if len(units) == 1 and len(units[0]) == len(values):
            raise  # nothing else to try
        readings: dict[int, tuple[Any, EngineKVFormat | None, int]] = {}
        try:
            for unit in units:
                alone, fmts = normalize_and_discover_per_layer_formats(
                    [values[i] for i in unit], None, EngineType.VLLM, layout_hints
                )
                readings.update((i, (alone, fmts[j], j)) for j, i in enumerate(unit))
        except LayoutHintError:
            raise  # a hint one allocation contradicts: the cause, which reading them together hid
        except KVLayoutError:
            raise together from None
        for i in (i for group in groups for i in group if i not in readings):
            twin = next((j for j in readings if values[j] is values[i]), None)
            if twin is None:
                raise together from None
            readings[i] = readings[twin]
        return readings


def _allocations(kv_cache_config: Any, names: list[str], groups: list[list[int]]) -> list[list[int]]:
    """Each group's layers split by the ``KVCacheTensor`` that allocates them, in its
    layer order (a whole group where the config has no tensors); layers of no tensor
    left out."""
    records = allocations(kv_cache_config)
    tensor_of = {name: (t, at) for t, members in enumerate(records) for at, name in enumerate(members)}
    if not tensor_of:
        return [list(group) for group in groups]
    units: list[list[int]] = []
    for group in groups:
        by_tensor: dict[int, list[int]] = {}
        for i in sorted((i for i in group if names[i] in tensor_of), key=lambda i: tensor_of[names[i]][1]):
            by_tensor.setdefault(tensor_of[names[i]][0], []).append(i)
        units.extend(by_tensor.values())
    return units


def check_block_granularity(
    kv_cache_config: Any, kv_caches: Mapping[str, Any], layout_hints: HintsLike = None
) -> None:
    """Raise :class:`BlockGranularityError` unless detection, under ``layout_hints``, reads
    every paged layer's block size as its group's slots per block: ``block_size``, or
    ``block_size / ratio`` where the spec declares compression.

    Run it on what will be registered (after :func:`apply_kv_cache_group_edits`, which
    calls it for every model). Layers in no group, and specs whose slots per block are
    no whole number, are not checked.
    """
    require_layer_dict(kv_caches)
    names = list(kv_caches)
    position = {name: i for i, name in enumerate(names)}
    groups: list[list[int]] = []
    owner: dict[int, tuple[int, str, int, Any]] = {}
    for group_idx, group in iter_groups(kv_cache_config):
        members = []
        for layer, spec in iter_group_layer_specs(group):
            slots = _slots_of_a_block_id(spec)
            if layer in position and slots is not None:
                members.append(position[layer])
                owner[position[layer]] = (group_idx, layer, slots, spec)
        if members:
            groups.append(members)
    if not groups:
        return
    readings = _read_layers(kv_cache_config, kv_caches, groups, layout_hints)
    wrong: dict[int, list[str]] = {}
    first: dict[int, str] = {}
    # Every layer holds at least that many blocks (more: a release that set num_blocks to
    # the least over ranks without shrinking the tensors, or HiSparse's host group).
    num_blocks = spec_size(kv_cache_config, "num_blocks")
    for i, (group_idx, layer, slots, spec) in owner.items():
        normalized, fmt, at = readings[i]
        assert fmt is not None  # every checked layer is in a group
        try:
            got: int | str = get_block_size(normalized, fmt, at)
            blocks: int | str = get_num_blocks(normalized, fmt, at)
        except KVLayoutError:
            got = blocks = "undefined"
        problem = None
        if got != slots:
            problem = f"reads as {fmt.name} with block size {got}, not {_wanted(slots, spec)}"
        elif num_blocks is not None and (not isinstance(blocks, int) or blocks < num_blocks):
            # heads outside blocks (LHBNC) under another hint: its heads read as blocks
            problem = (
                f"reads as {fmt.name} with {blocks} blocks, fewer than the config's num_blocks {num_blocks}"
            )
        allocated = _allocated(spec, kv_caches[layer])
        read = (LAYOUTS[fmt].is_hnd, LAYOUTS[fmt].is_head_outer)
        # a layer read as opaque pages (vLLM's CPU_ATTN) has no heads to order
        headed = LAYOUTS[fmt].axis_of(Role.HEAD) is not None
        if problem is None and allocated is not None and headed and allocated[1:] != read:
            # a wrong hint whose reading has the right block size (heads == block size, or
            # at least as many heads as blocks): the memory order says otherwise
            problem = (
                f"is allocated {allocated[0]} (strides {tuple(kv_caches[layer].stride())} of [blocks, heads, "
                f"tokens, C]) but reads as {fmt.name}"
            )
        if problem is not None:
            wrong.setdefault(group_idx, []).append(layer)
            first.setdefault(group_idx, problem)
    if wrong:
        hint = LayoutHints.coerce(layout_hints).kv_layout
        items = "; ".join(
            f"group {g}: layer {layers[0]!r}"
            + (f" (and {len(layers) - 1} more)" if len(layers) > 1 else "")
            + f" {first[g]}"
            for g, layers in sorted(wrong.items())
        )
        raise BlockGranularityError(
            f"registered blocks are not block ids under kv_layout={hint!r}: {items}. A wrong kv_layout "
            "hint (vLLM's LBNHC/BLNHC are NHD, LBHNC/BLHNC are HND, BHLNC needs its own or none; without "
            "a hint CPU tensors read as vLLM's CPU_ATTN, HND whole pages; heads outside blocks need "
            "kv_layout='LHBNC'), or a packing the spec does not declare, would transfer the wrong bytes. "
            f"See {DOCS}."
        )
