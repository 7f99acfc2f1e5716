"""The check the edits exist for: every layer's block, as detection reads it, is a block id.

LMCache and kvlayout's consumers take a group's block size from the detected tensors and
the block ids from vLLM's scheduler (``spec.block_size`` tokens each). Where the two
differ, the group looks slot-compressed and transfers move the wrong bytes, silently.
The edits make them agree for the registrations they know; this check proves it for
every layer under the hints detection will use, which also catches a ``kv_layout`` hint
that does not match vLLM's allocation (an NHD page read as HND swaps heads and tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvlayout.detection import normalize_and_discover_per_layer_formats
from kvlayout.errors import KVLayoutError
from kvlayout.facade import get_block_size
from kvlayout.integrations.vllm.errors import DOCS
from kvlayout.integrations.vllm.specs import (
    SpecKind,
    declares_slot_compression,
    iter_group_layer_specs,
    iter_groups,
    require_size,
    spec_field,
    spec_kind,
)
from kvlayout.types import EngineType, HintsLike, LayoutHints

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
    """Layers whose detected block size is not their group's ``block_size``."""


def _one_block_per_block_id(spec: Any) -> bool:
    """Specs whose registered block must hold ``block_size`` token slots: the paged kinds,
    without declared compression or a non-unit state geometry (Mamba's -1 is one state
    per block)."""
    kind = spec_kind(spec)
    if kind not in _PAGED_KINDS or declares_slot_compression(spec):
        return False
    return kind is SpecKind.MAMBA or spec_field(spec, "tokens_per_state", 1) == 1


def check_block_granularity(
    kv_cache_config: Any, kv_caches: Mapping[str, Any], layout_hints: HintsLike = None
) -> None:
    """Raise :class:`BlockGranularityError` unless detection, under ``layout_hints``, reads
    every paged layer's block size as its group's ``block_size``.

    Run it on what will be registered (after :func:`apply_kv_cache_group_edits`, which
    calls it for hybrid models). Layers in no group, and groups that declare slot
    compression, are not checked.
    """
    names = list(kv_caches)
    position = {name: i for i, name in enumerate(names)}
    groups: list[list[int]] = []
    owner: dict[int, tuple[int, str, int]] = {}
    for group_idx, group in iter_groups(kv_cache_config):
        members = []
        for layer, spec in iter_group_layer_specs(group):
            if layer in position and _one_block_per_block_id(spec):
                members.append(position[layer])
                owner[position[layer]] = (group_idx, layer, require_size(spec, "block_size"))
        if members:
            groups.append(members)
    if not groups:
        return
    normalized, formats = normalize_and_discover_per_layer_formats(
        list(kv_caches.values()), groups, EngineType.VLLM, layout_hints
    )
    wrong: dict[int, list[str]] = {}
    first: dict[int, str] = {}
    for i, (group_idx, layer, block_size) in owner.items():
        fmt = formats[i]
        assert fmt is not None  # every checked layer is in a group
        try:
            got: int | str = get_block_size(normalized, fmt, i)
        except KVLayoutError:
            got = "undefined"
        if got != block_size:
            wrong.setdefault(group_idx, []).append(layer)
            first.setdefault(group_idx, f"reads as {fmt.name} with block size {got}, not {block_size}")
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
            "hint (vLLM's LBNHC/BLNHC are NHD, LBHNC/BLHNC are HND; without a hint CPU tensors read as "
            f"HND), or a packing the spec does not declare, would transfer the wrong bytes. See {DOCS}."
        )
