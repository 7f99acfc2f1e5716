"""TRT-LLM: one KV pool tensor for all layers, HND.

TRT-LLM registers ``[NB, NL, kv_factor, NH*BS*HS]`` (``get_unique_primary_pool()``, or a
one-element list of it); the hints ``num_kv_heads``, ``tokens_per_block`` and
``head_dim`` split the flat row into ``[NB, NL, 2, NH, BS, HS]``. A 6-D pool needs no
hints, but hints given are checked against it. Unlike LMCache 0.5.6, the K/V axis must be
2 or 1 and a ``kv_layout`` hint that says NHD is an error (the pool is HND) rather than
ignored. A kv factor of 1 is TRT-LLM's MLA cache (``CacheType.SELFKONLY``): one latent
head, the row split into ``[NB, NL, 1, BS, HS]`` by ``tokens_per_block`` and ``head_dim``
(``num_kv_heads``, if sent, must be 1); a 6-D K-only pool may put its head axis of 1
before or after the tokens.
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
        kv = _latent(kv, hints)
        p = probe(kv)
    elif p.rank == 4:
        kv = _unflatten(kv, hints)
        p = probe(kv)
    return pick(ENGINE, p, decide=[("kv_layout", "is_hnd", True)]), kv


def _latent(pool: Any, hints: LayoutHints) -> Any:
    """A K-only pool (kv factor 1: TRT-LLM's MLA cache) as ``[NB, NL, 1, BS, HS]``, a view."""
    shape = tuple(pool.shape)
    if hints.num_kv_heads not in (None, 1):
        raise LayoutHintError(
            f"TRT-LLM pool {shape}: the K/V axis (dim 2) is 1, a K-only (MLA) pool of one latent head; "
            f"layout hint num_kv_heads={hints.num_kv_heads} contradicts it"
        )
    nb, nl = shape[0], shape[1]
    if len(shape) == 6:
        # [NB, NL, 1, 1, BS, HS], or [NB, NL, 1, BS, 1, HS] (Dynamo KVBM's export): with one
        # head, heads-first and tokens-first hold the same bytes.
        if 1 not in shape[3:5]:
            raise DetectionError(
                f"TRT-LLM pool {shape}: the K/V axis (dim 2) is 1, a K-only (MLA) pool, but neither dim 3 "
                f"nor dim 4 is 1: an MLA pool holds one latent head"
            )
        bs, hs = shape[3] * shape[4], shape[5]  # hints given are checked against the view
    else:
        missing = [hint for hint in ("tokens_per_block", "head_dim") if getattr(hints, hint) is None]
        if missing:
            raise LayoutHintError(
                f"TRT-LLM's 4-D K-only (MLA) pool [NB, NL, 1, BS*HS] {shape} needs layout hints "
                f"tokens_per_block and head_dim to split its rows; missing: {', '.join(missing)}"
            )
        bs, hs = hints.tokens_per_block, hints.head_dim
        assert bs is not None and hs is not None
        if shape[3] != bs * hs:
            raise LayoutHintError(
                f"TRT-LLM K-only (MLA) pool {shape}: flat dim {shape[3]} != tokens_per_block ({bs}) * "
                f"head_dim ({hs}) = {bs * hs}"
            )
    target = LAYOUTS[next(f for f in engine_formats(ENGINE) if LAYOUTS[f].is_mla)]
    by_role = {Role.BLOCK: nb, Role.LAYER: nl, Role.TOKEN: bs, Role.ELEMENT: hs}
    return pool.view(target.tensor_shape(sizes_by_role(target, by_role)))


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
        raise DetectionError(f"TRT-LLM pool {tuple(pool.shape)}: the K/V axis (dim 2) is {kv}, not 2 or 1")
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
