"""TRT-LLM: one KV pool tensor for all layers, HND unless the hint says NHD.

TRT-LLM registers ``[NB, NL, kv_factor, NH*BS*HS]`` (``get_unique_primary_pool()``, or a
one-element list of it); the hints ``num_kv_heads``, ``tokens_per_block`` and
``head_dim`` split the flat row into ``[NB, NL, 2, NH, BS, HS]``. Which order the row
holds is the attention backend's: TRT-LLM's own kernels write heads first (HND, the
default here), its FlashInfer and Vanilla backends write through
``get_buffers(layer, kv_layout="NHD")``, tokens first: the hint ``kv_layout="NHD"`` reads
the row as ``[NB, NL, 2, BS, NH, HS]`` (the shape cannot tell the two apart). A 6-D pool
needs no size hints, but hints given are checked against it. Unlike LMCache 0.5.6, the
K/V axis must be 2 or 1 and an NHD hint is honoured (LMCache ignores it and reads HND
bytes where an NHD backend wrote). A kv factor of 1 is TRT-LLM's MLA cache
(``CacheType.SELFKONLY``): one latent head, the row split into ``[NB, NL, 1, BS, HS]``
by ``tokens_per_block`` and ``head_dim`` (``num_kv_heads``, if sent, must be 1); a 6-D
K-only pool may put its head axis of 1 before or after the tokens. A uint8 K-only pool is
the DSA indexer's K pool (``get_indexer_k_cache_pool()``, each block its tokens' values
then their scales), read given ``tokens_per_block`` by its bytes a token: 132 (fp8: 128
values and a float32 scale) as ``[NB, NL, BSxVALS, BSxSCALES]``, 68 (``DSACacheManager``
under ``indexer_k_dtype="fp4"``: ``index_head_dim // 2`` bytes of packed e2m1 values and
one int32 of four ue8m0 exponents) as ``[NB, NL, BSxVALS4, BSxSCALES4]``, its blocks any
distance apart (a ``KVCacheManagerV2`` slot's index keys, other buffers between). NVFP4 KV is
two pools of the primary pool's shape (``createBlockScalePools``), each read on its own by
its bytes per head and token: the int8 data with ``head_dim`` half the model's (two e2m1
values a byte), the e4m3 block scales with a sixteenth of it (a scale per 16 values).
Nothing in a scale pool says it holds scales: it reads as an FP8 KV pool of that
``head_dim``, so only the dtypes or row widths keep it from pairing with a KV pool.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from kvlayout._generated.formats import LAYOUTS, EngineKVFormat
from kvlayout.detection.base import DetectionError, engine_formats, pick, probe
from kvlayout.layout import algebra
from kvlayout.layout.algebra import sizes_by_role
from kvlayout.layout.vocabulary import Role
from kvlayout.types import DiscoverableKVCache, EngineType, LayoutHintError, LayoutHints

ENGINE = EngineType.TRTLLM
_ROW_HINTS = ("num_kv_heads", "tokens_per_block", "head_dim")  # what the flat pool row folds
# KVCacheManagerV2's get_buffers views start at each layer's first buffer and count pages,
# so layers coalesced in a slot overlap and a page slot indexes none of them.
_V2 = (
    "; under KVCacheManagerV2 a connector is handed a KvCacheLayout: read it with "
    "kvlayout.integrations.trtllm.kv_cache_layout_pools"
)


def discover(kv: Any, hints: LayoutHints) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    if isinstance(kv, list):
        refuse_mixed(kv, hints)
        kv = kv[0]
        if isinstance(kv, list):
            raise DetectionError("TRT-LLM registers one KV pool tensor, got a nested list")
    p = probe(kv)
    if p.rank == 5 and p.shape[1] in (1, 2) and p.shape[2] != 1:
        raise DetectionError(
            f"TRT-LLM: {p.describe()} is no pool [NB, NL, kv_factor, ...]: a per-layer "
            "get_buffers(layer, kv_layout) view [NB, kv_factor, ...] is read in a list of every layer's "
            "with engine 'vllm' and the same kv_layout; or detect the pool (get_unique_primary_pool())"
            f"{_V2}"
        )
    hnd, why = _order(p.shape, hints)
    if p.rank == 4 and p.shape[2] == 1 and p.first.dtype == torch.uint8:
        return _indexer(kv, hints)
    if p.rank in (4, 6) and p.shape[2] == 1:
        kv = _latent(kv, hints)
        p = probe(kv)
    elif p.rank == 4:
        kv = _unflatten(kv, hints, hnd)
        p = probe(kv)
    return pick(ENGINE, p, decide=[(why, "is_hnd", hnd)]), kv


def refuse_mixed(kv: list[Any], hints: LayoutHints) -> None:
    """A list of several entries, of one shape or not (the registry's hook, asked before
    layers of different shapes are split): TRT-LLM registers one pool tensor, and a model
    with a pool per attention window or KV head count (VSWA) has each detected alone."""
    if len(kv) != 1:
        raise DetectionError(
            f"TRT-LLM registers one KV pool tensor, got a list of {len(kv)} entries (a model whose layers "
            f"differ in KV heads or attention window has a pool each: detect each on its own){_views(kv)}"
        )


def _views(kv: list[Any]) -> str:
    """What to do with per-layer ``get_buffers(layer)`` views: rank 5, K/V axis at dim 1."""
    if not kv or not all(isinstance(t, torch.Tensor) and t.dim() == 5 and t.shape[1] in (1, 2) for t in kv):
        return ""
    return (
        "; rank-5 entries [NB, kv_factor, ...] look like per-layer get_buffers(layer, kv_layout) views: "
        "detect the pool (get_unique_primary_pool()), or the views with engine 'vllm' and the same "
        f"kv_layout{_V2}"
    )


def _order(shape: tuple[int, ...], hints: LayoutHints) -> tuple[bool, str]:
    """Whether the pool is HND, and how messages name that decision: the ``kv_layout``
    hint; else, for a 6-D pool, the size hints where they fit one order only; else HND,
    as TRT-LLM's own kernels write it."""
    if hints.is_hnd is not None:
        return hints.is_hnd, "kv_layout"
    nh, bs = hints.num_kv_heads, hints.tokens_per_block
    if len(shape) == 6 and (nh, bs) != (None, None):
        fits = [nh in (None, shape[a]) and bs in (None, shape[b]) for a, b in ((3, 4), (4, 3))]
        if fits == [False, True]:
            return False, "no kv_layout hint; the size hints fit {} only"
    return True, "no kv_layout hint, so {} as TRT-LLM's own kernels write"


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
        bs, hs = _split_row(
            shape, hints, _ROW_HINTS[1:], "K-only (MLA) pool", "[NB, NL, 1, BS*HS]", _bytes(pool)
        )
    target = LAYOUTS[
        next(f for f in engine_formats(ENGINE) if LAYOUTS[f].is_mla and not LAYOUTS[f].is_indexer)
    ]
    by_role = {Role.BLOCK: nb, Role.LAYER: nl, Role.TOKEN: bs, Role.ELEMENT: hs}
    return pool.view(target.tensor_shape(sizes_by_role(target, by_role)))


def _indexer(pool: Any, hints: LayoutHints) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    """The DSA indexer's K pool (``get_indexer_k_cache_pool()``): uint8, kv factor 1, each
    block the values of its ``tokens_per_block`` tokens, then their scales. Only this pool
    is uint8 (NVFP4 KV is int8, FP8 KV float8): read as a blocked-scale format, a view,
    never as MLA latents (a token's row is not its record). Which format is the record's
    width: TRT-LLM's ``DSACacheManager`` stores ``index_head_dim`` fp8 bytes a token, or
    ``index_head_dim // 2`` under ``indexer_k_dtype="fp4"`` (two e2m1 codes a byte), then
    ``index_head_dim // 128 * 4`` scale bytes (``get_indexer_k_cache_buffers``)."""
    shape = tuple(pool.shape)
    records = {_record(f): f for f in engine_formats(ENGINE) if LAYOUTS[f].is_indexer}
    widths = _either(f"BS*{v + s}" for v, s in records)
    where = f"TRT-LLM uint8 K-only pool {shape} (the DSA indexer's K pool [NB, NL, 1, {widths}])"
    bs = hints.tokens_per_block
    if bs is None:
        raise LayoutHintError(f"{where} needs layout hint tokens_per_block to split its rows")
    fit = [(v, s) for v, s in records if shape[3] == bs * (v + s)]
    if not fit:
        known = "; ".join(
            f"{v} value bytes and {s} scale bytes a token ({LAYOUTS[f].name})"
            for (v, s), f in records.items()
        )
        raise DetectionError(
            f"{where}: flat dim {shape[3]} != tokens_per_block ({bs}) * {_either(sum(r) for r in records)}; "
            f"kvlayout reads the indexer keys TRT-LLM writes: {known}"
        )
    values, scales = fit[0]
    fmt = records[(values, scales)]
    # head_dim may name the record's bytes, its value bytes or index_head_dim (the values'
    # count: fp4 packs two a byte)
    heads = {values, values + scales, _INDEX_HEAD_DIM}
    if hints.num_kv_heads not in (None, 1) or hints.head_dim not in (None, *heads):
        raise LayoutHintError(
            f"{where}: layout hints num_kv_heads={hints.num_kv_heads} and head_dim={hints.head_dim} "
            f"contradict its one head of {values} value bytes and {scales} scale bytes a token "
            f"(head_dim {_either(sorted(heads))})"
        )
    layout = LAYOUTS[fmt]
    sizes = sizes_by_role(layout, {Role.BLOCK: shape[0], Role.LAYER: shape[1], Role.TOKEN: bs})
    return fmt, pool.view(layout.tensor_shape(sizes))


_INDEX_HEAD_DIM = 128  # DeepSeek-V3.2's index_head_dim, the indexer keys' value count


def _either(items: Iterable[object]) -> str:
    return " or ".join(str(item) for item in items)


def indexer_record_bytes() -> tuple[int, ...]:
    """The bytes a token of each DSA indexer K pool TRT-LLM writes (values, then scale):
    the widths :func:`discover` reads a uint8 K-only pool's rows by."""
    return tuple(sum(_record(f)) for f in engine_formats(ENGINE) if LAYOUTS[f].is_indexer)


def _record(fmt: EngineKVFormat) -> tuple[int, int]:
    """An indexer format's bytes a token: its value region's, then its scale region's."""
    run = algebra.structure(LAYOUTS[fmt]).region_mode
    assert run is not None
    values, scales = (span.token.region.width for span in run.regions if span.token.region)
    return values, scales


def _unflatten(pool: Any, hints: LayoutHints, hnd: bool) -> Any:
    shape = tuple(pool.shape)
    nb, nl, kv = shape[:3]
    if kv != 2:
        raise DetectionError(f"TRT-LLM pool {shape}: the K/V axis (dim 2) is {kv}, not 2 or 1")
    nh, bs, hs = _split_row(
        shape,
        hints,
        _ROW_HINTS,
        "pool",
        "[NB, NL, 2, NH*BS*HS]",
        _bytes(pool),
        pool.dtype == torch.float8_e4m3fn,
    )
    # The pool row folds the heads, tokens and head elements of a cross-layer layout, in the
    # order the attention backend writes them.
    target = LAYOUTS[
        next(f for f in engine_formats(ENGINE) if LAYOUTS[f].is_cross_layer and LAYOUTS[f].is_hnd == hnd)
    ]
    by_role = {Role.BLOCK: nb, Role.LAYER: nl, Role.HEAD: nh, Role.TOKEN: bs, Role.ELEMENT: hs}
    return pool.view(target.tensor_shape(sizes_by_role(target, by_role)))


def _bytes(pool: torch.Tensor) -> bool:
    """An int8/uint8 pool: TRT-LLM stores NVFP4 KV so, two values a byte."""
    return pool.dtype in (torch.int8, torch.uint8)


# NVFP4's block scales: WindowBlockManager::createBlockScalePools gives each data pool a
# twin [NB, NL, kv_factor, NH*BS*(HS/16)] of kFP8 (e4m3), one scale per 16 values
# (kQuantBlockSizeNVFP4), addressed as the data (KVBlockArray::getKVLocalIdx, heads first)
_NVFP4_SCALE_BLOCK = 16


def _split_row(
    shape: tuple[int, ...],
    hints: LayoutHints,
    names: tuple[str, ...],
    pool: str,
    folded: str,
    packed: bool,
    scales: bool = False,
) -> list[int]:
    """The sizes the hints ``names`` split a 4-D ``pool``'s flat row (dim 3, ``folded``) into."""
    missing = [name for name in names if getattr(hints, name) is None]
    if missing:
        raise LayoutHintError(
            f"TRT-LLM's 4-D {pool} {folded} {shape} needs layout hints {_listed(names)} to split its rows; "
            f"missing: {', '.join(missing)}"
        )
    sizes = [int(getattr(hints, name)) for name in names]
    if shape[3] != math.prod(sizes):
        factors = " * ".join(f"{name} ({size})" for name, size in zip(names, sizes, strict=True))
        why = ""
        if "num_kv_heads" in names:  # a TP rank's pool holds its own heads, not the model's
            heads = sizes[names.index("num_kv_heads")]
            fit, rest = divmod(shape[3], math.prod(sizes) // heads)
            if rest == 0 and fit and heads % fit == 0:
                why = (
                    f": num_kv_heads is this rank's KV heads (the model's over the TP degree), and {fit} fits"
                )
        if packed and 2 * shape[3] == math.prod(sizes):
            why = (
                ": a byte pool half that size is NVFP4, two values a byte, whose block scales TRT-LLM keeps "
                f"in another pool; detect it with head_dim={sizes[-1] // 2} (its bytes per head and token), "
                f"and its e4m3 block-scale pool on its own with head_dim={sizes[-1] // _NVFP4_SCALE_BLOCK} "
                "(its scales per head and token), and move both"
            )
        if scales and "head_dim" in names and _NVFP4_SCALE_BLOCK * shape[3] == math.prod(sizes):
            # not a pool of fewer heads: a sixteenth of the row is NVFP4's scale pool
            why = (
                f": an e4m3 pool a {_NVFP4_SCALE_BLOCK}th that size is NVFP4's block-scale pool "
                f"(get_block_scale_pool_pointers), one scale per {_NVFP4_SCALE_BLOCK} values; detect it "
                f"with head_dim={sizes[-1] // _NVFP4_SCALE_BLOCK} (its scales per head and token), and its "
                f"int8 data pool with head_dim={sizes[-1] // 2}, and move both"
            )
        raise LayoutHintError(
            f"TRT-LLM {pool} {shape}: flat dim {shape[3]} != {factors} = {math.prod(sizes)}{why}"
        )
    return sizes


def _listed(names: tuple[str, ...]) -> str:
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]
