"""TRT-LLM: one KV pool tensor for all layers, HND.

TRT-LLM registers ``[NB, NL, 2, NH*BS*HS]`` (or a one-element list of it); the hints
``num_kv_heads``, ``tokens_per_block`` and ``head_dim`` split the flat row into
``[NB, NL, 2, NH, BS, HS]``. A 6-D pool needs no hints, but hints given are checked
against it. Unlike LMCache 0.5.6, the K/V axis must be 2 and a ``kv_layout`` hint that
says NHD is an error (the pool is HND) rather than ignored.
"""

from __future__ import annotations

from typing import Any

from kvlayout._generated.formats import LAYOUTS, EngineKVFormat
from kvlayout.detection.base import DetectionError, engine_formats, pick, probe
from kvlayout.layout.algebra import sizes_by_role
from kvlayout.layout.vocabulary import Role
from kvlayout.types import DiscoverableKVCache, EngineType, LayoutHintError, LayoutHints

ENGINE = EngineType.TRTLLM
_ROW_HINTS = ("num_kv_heads", "tokens_per_block", "head_dim")  # what the flat pool row folds


def discover(kv: Any, hints: LayoutHints) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    if hints.is_hnd is False:
        raise LayoutHintError(
            f"TRT-LLM's KV pool is HND (heads before tokens); layout hint kv_layout={hints.kv_layout!r} "
            "contradicts it"
        )
    if isinstance(kv, list):
        if len(kv) != 1:
            raise DetectionError(f"TRT-LLM registers one KV pool tensor, got a list of {len(kv)} entries")
        kv = kv[0]
        if isinstance(kv, list):
            raise DetectionError("TRT-LLM registers one KV pool tensor, got a nested list")
    p = probe(kv)
    if p.rank in (4, 6) and p.shape[2] == 1:
        raise DetectionError(
            f"TRT-LLM pool {p.shape}: the K/V axis (dim 2) is 1, a K-only pool (kv factor 1, TRT-LLM's MLA "
            "cache); TRT-LLM MLA pools are not supported: kvlayout's TRT-LLM formats hold K and V (2)"
        )
    if p.rank == 4:
        kv = _unflatten(kv, hints)
        p = probe(kv)
    return pick(ENGINE, p, decide=[("kv_layout", "is_hnd", True)]), kv


def _unflatten(pool: Any, hints: LayoutHints) -> Any:
    missing = [hint for hint in _ROW_HINTS if getattr(hints, hint) is None]
    if missing:
        raise LayoutHintError(
            "TRT-LLM's 4-D pool [NB, NL, 2, NH*BS*HS] needs layout hints num_kv_heads, tokens_per_block "
            f"and head_dim to split its rows; missing: {', '.join(missing)}"
        )
    nb, nl, kv, flat = pool.shape
    nh, bs, hs = hints.num_kv_heads, hints.tokens_per_block, hints.head_dim
    assert nh is not None and bs is not None and hs is not None
    if kv != 2:
        raise DetectionError(f"TRT-LLM pool {tuple(pool.shape)}: the K/V axis (dim 2) is {kv}, not 2")
    if flat != nh * bs * hs:
        raise LayoutHintError(
            f"TRT-LLM pool {tuple(pool.shape)}: flat dim {flat} != num_kv_heads ({nh}) * "
            f"tokens_per_block ({bs}) * head_dim ({hs}) = {nh * bs * hs}"
        )
    # The pool row folds the heads, tokens and head elements of TRT-LLM's cross-layer HND layout.
    target = LAYOUTS[
        next(f for f in engine_formats(ENGINE) if LAYOUTS[f].is_cross_layer and LAYOUTS[f].is_hnd)
    ]
    by_role = {Role.BLOCK: nb, Role.LAYER: nl, Role.HEAD: nh, Role.TOKEN: bs, Role.ELEMENT: hs}
    return pool.view(target.tensor_shape(sizes_by_role(target, by_role)))
