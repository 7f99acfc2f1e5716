"""SGLang: page buffers ``[NB*BS, NH, HS]`` (MHA) and ``[NB*BS, 1, HS]`` (MLA), as
``[K layers, V layers]`` or flat, or the unified connector's per-component views.

Quirks that live here and nowhere else:

* ``kv_list_layout="unified"``: a flat list of components ``[NB, BS, HS]`` (MLA) or
  ``[NB, BS, NH, HS]`` (one K or V each); ``tokens_per_block``, if given, must equal BS.
* ``kv_list_layout="k_v"``: K layers then V layers, flat (split into halves, which must
  be an even count) or already as two lists.
* Otherwise a flat list is MLA and must have one head: LMCache 0.5.6 takes any flat list
  as MLA, so a flat K/V list sent without ``k_v`` was misread with wrong geometry; here
  it is an error that names the missing hint. (A single-head K/V list is shape-identical
  to MLA, which is why SGLang sends ``k_v``.)
* ``tokens_per_block`` un-folds a page buffer into ``[NB, BS, ...]`` (the MP daemon's
  layouts), for MHA and MLA alike; LMCache ignores it for two-list registrations.
"""

from __future__ import annotations

from typing import Any

from kvlayout._generated.formats import LAYOUTS, EngineKVFormat
from kvlayout.detection.base import (
    DetectionError,
    Probe,
    pick,
    probe,
    unfold_shape,
    unfolded_twin,
)
from kvlayout.nesting import leaves, map_leaves
from kvlayout.types import DiscoverableKVCache, EngineType, LayoutHintError, LayoutHints

ENGINE = EngineType.SGLANG


def discover(kv: Any, hints: LayoutHints) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    p = probe(kv)
    if p.depth == 0:
        raise DetectionError(f"SGLang registers lists of per-layer tensors, not one tensor ({p.describe()})")
    if hints.kv_list_layout == "unified":
        return _unified(kv, p, hints)
    if p.depth == 1 and hints.kv_list_layout == "k_v":
        if len(kv) % 2:
            raise DetectionError(
                "SGLang kv_list_layout='k_v' expects K layers then V layers (an even count), "
                f"got {len(kv)} tensors"
            )
        half = len(kv) // 2
        kv = [kv[:half], kv[half:]]
        p = probe(kv)
    elif p.depth == 1 and p.rank == 3 and p.shape[1] != 1:
        raise DetectionError(
            f"SGLang: {p.describe()} is not MLA (an MLA page buffer is [NB*BS, 1, HS]); for K layers "
            "then V layers pass layout hint kv_list_layout='k_v'"
        )
    elif p.depth == 1 and p.rank != 3:
        raise DetectionError(
            f"SGLang: {p.describe()}: a flat list is an MLA page buffer [NB*BS, 1, HS] unless "
            "layout hint kv_list_layout says 'k_v' (K layers then V layers) or 'unified' (components)"
        )
    # A rank-3 leaf here is a folded page buffer; a rank-4 one (two lists) already has NB, BS.
    fmt = pick(ENGINE, p, decide=[("kv_list_layout", "is_pbs_fused", p.rank == 3)])
    tpb = hints.tokens_per_block
    if tpb is None or not LAYOUTS[fmt].is_pbs_fused:
        _check_block_size(fmt, p, tpb)
        return fmt, kv
    twin = unfolded_twin(ENGINE, fmt)
    if not all(t.is_contiguous() for _, t in leaves(kv)):
        raise DetectionError(
            f"SGLang: {p.describe()}: a page buffer with padded rows cannot be split into blocks "
            "by tokens_per_block (the token rows would keep the padding)"
        )
    try:
        shape = unfold_shape(LAYOUTS[fmt], LAYOUTS[twin], p.shape, tpb)
    except DetectionError as exc:
        raise DetectionError(f"SGLang: {p.describe()}: {exc}") from None
    return twin, map_leaves(kv, lambda t: t.view(shape))


def _unified(kv: Any, p: Probe, hints: LayoutHints) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    if p.depth != 1:
        raise DetectionError(
            f"SGLang kv_list_layout='unified' expects a flat list of component tensors ({p.describe()})"
        )
    fmt = pick(ENGINE, p, decide=[("kv_list_layout", "is_pbs_fused", False)])
    _check_block_size(fmt, p, hints.tokens_per_block)
    return fmt, kv


def _check_block_size(fmt: EngineKVFormat, p: Probe, tpb: int | None) -> None:
    axis = LAYOUTS[fmt].axis_of("BS")
    if tpb is not None and axis is not None and p.shape[axis] != tpb:
        raise LayoutHintError(
            f"SGLang: layout hint tokens_per_block={tpb} contradicts {fmt.name}, whose BS is "
            f"{p.shape[axis]} ({p.describe()})"
        )
