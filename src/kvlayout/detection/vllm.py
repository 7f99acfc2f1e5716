"""vLLM: per-layer tensors (flash-attn, flash-infer, MLA, fused K/V, RBLN), per-layer
tuples (Ascend), or one cross-layer tensor.

Quirks that live here and nowhere else:

* Without a ``kv_layout`` hint, tensors on the CPU are HND (vLLM's CPU backend allocates
  HND) and tensors elsewhere NHD. An explicit hint always wins.
* A 5-D ``[2, 2, ...]`` tensor (two blocks) fits flash-attn and flash-infer alike;
  K/V-first is assumed unless the ``kv_pair_axis`` hint says 1. LMCache 0.5.6 always
  reads it as K/V-first, with no way to say otherwise.
* Rank-4 tensors are the unified fused cache ``[NB, NH, BS, CS]`` / ``[NB, BS, NH, CS]``,
  kept as registered; a single-head uint8 one whose row is the 132-byte blocked-scale
  page is the DSA indexer cache, squeezed to ``[NB, BS, 132]``.
* A bare tensor is cross-layer only with the cross-layer rank (LMCache takes any bare
  tensor as format 0). An HND one is ``NB_NL_TWO_NH_BS_HS`` (8): layouts.yaml lists it
  under TRT-LLM, but vLLM's HND cross-layer allocation is that same layout, so every
  cross-layer layout is a candidate here.
* Per-layer tuples are ``(K, V)`` when both tensors match (16), MLA planes when they are
  single-headed and differ or are not two (17); the tuples are kept as tuples.
"""

from __future__ import annotations

from typing import Any

from kvlayout._generated.formats import LAYOUTS, EngineKVFormat
from kvlayout.detection.base import Probe, match, pick, probe
from kvlayout.types import DiscoverableKVCache, EngineType, LayoutHints

ENGINE = EngineType.VLLM


def discover(kv: Any, hints: LayoutHints) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    p = probe(kv)
    hnd = hints.is_hnd
    if hnd is None:
        hnd = p.device.type == "cpu"
    layout_decision = ("kv_layout", "is_hnd", hnd)
    if p.depth == 0:
        return pick(ENGINE, p, decide=[layout_decision]), kv
    if p.depth == 1 and p.rank == 4:
        return _rank4(kv, p, hnd)
    fmt = pick(
        ENGINE,
        p,
        decide=[layout_decision, ("kv_pair_axis", "kv_axis", hints.kv_pair_axis)],
        prefer=["is_two_major", "has_kv"],
    )
    if LAYOUTS[fmt].is_kv_second_tuple:
        kv = [tuple(layer) for layer in kv]
    return fmt, kv


def _rank4(kv: list[Any], p: Probe, hnd: bool) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    fused = pick(ENGINE, p, decide=[("kv_layout", "is_hnd", hnd)])
    head = LAYOUTS[fused].axis_of("NH")
    assert head is not None
    if p.shape[head] == 1:  # one head: is the row a blocked-scale page (the DSA indexer)?
        squeezed = p.shape[:head] + p.shape[head + 1 :]
        indexer = match(ENGINE, p, shape=squeezed, only=lambda s: s.byte_rows)
        if indexer is not None:
            return indexer, [t.squeeze(head) for t in kv]
    return fused, kv
