"""vLLM: per-layer tensors (flash-attn, flash-infer, MLA, fused K/V, RBLN), per-layer
tuples (Ascend), or one cross-layer tensor.

Quirks that live here and nowhere else:

* Without a ``kv_layout`` hint, the size hints (``num_kv_heads``, ``tokens_per_block``,
  ``head_dim``) decide between NHD and HND where only one reading agrees with them;
  otherwise tensors on the CPU are HND (vLLM's CPU backend allocates HND) and tensors
  elsewhere NHD (:func:`resolve_vllm_kv_layout`). An explicit hint always wins, and size
  hints the result contradicts are an error.
* vLLM's CPU platform always uses CPU_ATTN, whose kernel views a block ``[H, N, 2*hs]``
  as ``[H, 2N, hs]`` (a head's K rows, then its V rows) packed per ISA: under the
  ``attn_backend='CPU_ATTN'`` hint, or on the CPU with neither it nor ``kv_layout``, a
  rank-4 attention layer read HND is its whole pages, ``[NB, N, page_bytes // N]`` int8
  marked opaque (:func:`cpu_attention_pages`), as vLLM's group edits view it too
  (``cpu-attn-pages``). ``kv_layout`` without ``attn_backend`` keeps the plain reading
  (tensors standing in for a GPU backend's cache).
* A 5-D ``[2, 2, ...]`` tensor (two blocks) fits flash-attn and flash-infer alike;
  K/V-first is assumed unless the ``kv_pair_axis`` hint says 1, or dim 0 is padded
  (padding is only ever on the block axis). LMCache 0.5.6 always reads it as
  K/V-first, with no way to say otherwise.
* Rank-4 tensors are the unified fused cache ``[NB, NH, BS, CS]`` / ``[NB, BS, NH, CS]``,
  kept as registered; a single-head uint8 one whose row is the 132-byte blocked-scale
  page is the DSA indexer cache, squeezed to ``[NB, BS, 132]``, and one of 68-byte rows
  its MXFP4 twin (``indexer_kv_dtype="mxfp4"``: every slot's 64 packed e2m1 bytes, then
  every slot's 4 ue8m0 scale bytes), ``[NB, BS, 68]``. vLLM 0.33 views every
  layer as ``[B, H, N, C]`` and registers MLA and indexer layers with one head
  (``[NB, 1, BS, C]``), whose NHD and HND orders are the same bytes: a size-1 dim beside
  the tokens is that one head under either ``kv_layout`` (the tensor is viewed with it on
  the hinted layout's head axis), unless the size hints say otherwise. An MLA layer's
  ``[NB, 1, BS, 576]`` is also a one-head fused K | V cache (a GQA model at TP = KV
  heads), so it reads as fused unless the hints say MLA (``kv_dim=1``, or an MLA
  ``layout_format``): then it is latents, ``NL_X_NB_BS_HS``, squeezed. On the CPU the
  fused reading is CPU_ATTN's whole pages (above), one head as many.
* On ROCm the DSA indexer's pages are not those rows: the fp8 one is written in 16x16
  SHUFFLE tiles where a block holds more than one slot (``rocm_aiter_mla_sparse.py``
  ``indexer_k_quant_and_cache_triton``: ``[BS/16, D/16, 16, 16]`` values, then the scales),
  the MXFP4 one in the order aiter's ``cache_format`` reports (``rocm_paged_mxfp4_indexer``).
  Read on ROCm (:func:`reads_rocm`: an ``attn_backend`` hint naming a ROCm backend, or a
  ROCm torch build's GPU tensors), they are whole pages, ``[NB, BS, row]`` int8 marked
  opaque (:func:`rocm_indexer_pages`); an fp8 one of one-slot blocks stays as read.
* A bare tensor is cross-layer only with the cross-layer rank (LMCache takes any bare
  tensor as format 0). An HND one is ``NB_NL_TWO_NH_BS_HS`` (8): layouts.yaml lists it
  under TRT-LLM, but vLLM's HND cross-layer allocation is that same layout, so every
  cross-layer layout is a candidate here.
* Per-layer tuples are ``(K, V)`` when both tensors match (16), MLA planes when they are
  single-headed and differ or are not two (17); the tuples are kept as tuples.
* Under ``BHLNC`` (layers inside heads inside blocks) vLLM 0.33 views one allocation per
  KV cache group as per-layer ``[NB, H, N, C]`` tensors whose heads sit ``NL`` pages
  apart. Those views, in the allocation's layer order, are read as the one cross-layer
  tensor ``[NB, H, NL, N, C]`` they tile (``NB_NH_NL_BS_CS``, a view: nothing is
  copied). The strides say so, so no hint is needed; views of one allocation that look
  so (or any views under a ``BHLNC`` hint) but do not tile it (layers out of order, KV
  sharing, two groups' layers together) are an error naming the first layer out of
  place, and another hint on views that do tile is one too. One layer, or one head
  without the hint (MLA latents, TP = KV heads), is the same memory as ``BLHNC`` and is
  read so. A bare rank-5 tensor is that cross-layer tensor only under the ``BHLNC`` hint
  (or its ``layout_format``), handed over in memory order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from kvlayout._generated.formats import LAYOUTS, EngineKVFormat
from kvlayout.detection.base import (
    SIZE_HINTS,
    DetectionError,
    Probe,
    engine_formats,
    format_shape,
    match,
    pick,
    probe,
    size_hint_conflict,
)
from kvlayout.layout.description import from_engine_kv_format
from kvlayout.layout.vocabulary import HEAD_OUTER_KV_LAYOUTS, HND_KV_LAYOUTS, Role
from kvlayout.registration.backing import first_without_memory
from kvlayout.registration.contiguity import dim0_padding, physical_order
from kvlayout.registration.nesting import first_leaf
from kvlayout.registration.opaque import (
    MAX_PAGE_LAYOUT,
    OpaquePages,
    mark_opaque_pages,
    page_bytes_view,
    page_of,
    replicated_page,
)
from kvlayout.types import DiscoverableKVCache, EngineType, HintsLike, LayoutHintError, LayoutHints

__all__ = [
    "CPU_ATTENTION",
    "ENGINE",
    "ROCM_BACKENDS",
    "cpu_attention_pages",
    "discover",
    "indexer_format",
    "pool_views",
    "reads_cpu_attention",
    "reads_rocm",
    "resolve_vllm_kv_layout",
    "rocm_indexer_pages",
]

ENGINE = EngineType.VLLM

OWN_HINTS = ("attn_backend",)

CPU_ATTENTION = "CPU_ATTN"
"""vLLM's CPU platform's attention backend (``vllm/v1/attention/backends/cpu_attn.py``)."""

ROCM_BACKENDS = frozenset(
    {
        "ROCM_ATTN",
        "ROCM_SEGMENTED_ATTN",
        "ROCM_AITER_UNIFIED_ATTN",
        "ROCM_OCTAVE",
        "ROCM_AITER_FA",
        "ROCM_AITER_MLA",
        "ROCM_AITER_MLA_SPARSE",
        "AITER_TRITON_MLA",
        "ROCM_FLASHMLA_SPARSE_DSV4",
        "ROCM_FLASHMLA_SPARSE_DSV41",
        "DEEPSEEK_V4_ROCM_MXFP4_INDEXER",
        "DEEPSEEK_V41_ROCM_MXFP4_INDEXER",
    }
)
"""vLLM 0.33's backends that run only on ROCm, as ``get_name()`` spells them. AITER FA
(``rocm_aiter_fa.py``) calls itself ``FLASH_ATTN``, so another name does not say CUDA."""

# What orders a ROCm indexer page's bytes, by its values' dtype: fp8 values in 16-slot x
# 16-byte tiles (rocm_aiter_mla_sparse.py _indexer_k_quant_and_cache_kernel, LAYOUT
# "SHUFFLE" where block_size > 1), MXFP4's packed bytes and scales in aiter's cache_format order.
_ROCM_FP8_INDEXER = "fp8 values in [BS/16, D/16, 16 slots, 16 bytes] SHUFFLE tiles, then every slot's scale"
_ROCM_MXFP4_INDEXER = (
    "MXFP4 values and ue8m0 scales in the order aiter's cache_format reports for the GPU and page size"
)


def resolve_vllm_kv_layout(layout_hints: HintsLike, cpu_attention_backend: bool = False) -> str:
    """The ``kv_layout`` a vLLM registration is read in: the hint when there is one
    (checked: a spelling no format describes, heads outside both the layers and the
    blocks, or an unknown one is a :class:`~kvlayout.types.LayoutHintError`); without one
    ``HND`` on a
    CPU attention backend (vLLM's CPU backend allocates HND) and ``NHD`` elsewhere.

    Detection asks this for the default only after the size hints had their say: without
    a ``kv_layout`` hint, size hints that agree with exactly one reading settle it.
    """
    if not isinstance(cpu_attention_backend, bool):
        raise TypeError(f"cpu_attention_backend must be a bool, not {type(cpu_attention_backend).__name__}")
    hinted = LayoutHints.coerce(layout_hints).kv_layout
    if hinted is not None:
        return hinted
    return "HND" if cpu_attention_backend else "NHD"


def discover(kv: Any, hints: LayoutHints) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    p = probe(kv)
    cpu_attention = reads_cpu_attention(p.device, hints)
    if cpu_attention and hints.attn_backend is not None:
        _check_cpu_attention_hints(hints)
    if hints.kv_layout is None and not (cpu_attention and hints.attn_backend is not None):
        read = _read_by_sizes(kv, p, hints)
        if read is not None:
            return _as_cpu_attention(read, p, hints) if cpu_attention else _as_rocm_indexer(read, p, hints)
    layout = resolve_vllm_kv_layout(hints, cpu_attention_backend=p.device.type == "cpu" or cpu_attention)
    read = _discover(kv, p, hints, _Reading(layout in HND_KV_LAYOUTS, layout in HEAD_OUTER_KV_LAYOUTS))
    return _as_cpu_attention(read, p, hints) if cpu_attention else _as_rocm_indexer(read, p, hints)


def reads_rocm(device: torch.device | str, layout_hints: HintsLike) -> bool:
    """Whether vLLM wrote tensors on ``device`` on ROCm: the ``attn_backend`` hint names a
    ROCm backend (:data:`ROCM_BACKENDS`), or a ROCm torch build (``torch.version.hip``)
    holds them on the GPU, whatever the hint says (AITER FA is ``FLASH_ATTN``, and a DSA
    indexer's writer is the platform's, not the attention backend's)."""
    if _rocm_hinted(LayoutHints.coerce(layout_hints)):
        return True
    return torch.device(device).type == "cuda" and torch.version.hip is not None


def _rocm_hinted(hints: LayoutHints) -> bool:
    """The ``attn_backend`` hint names a backend only ROCm runs."""
    return hints.attn_backend in ROCM_BACKENDS


def rocm_indexer_pages(
    t: torch.Tensor, fmt: EngineKVFormat, layout_hints: HintsLike = None, *, kernel_pages: int = 1
) -> OpaquePages | None:
    """What a DSA indexer page written on ROCm holds, ``t`` its registered (or kernel)
    pages ``[pages, ..., slots, row]`` read as ``fmt``, ``kernel_pages`` of them a block;
    None where the page is the rows ``fmt`` says (not ROCm, not an indexer, or fp8 pages
    of one slot, which the writer keeps flat). The indexer's key is one head every TP
    rank holds whole, so the block is declared one KV head's bytes: it maps between any
    two ranks. Flat, as its tiles are no rows: no CUDA page of rows is taken for it."""
    order = _rocm_indexer_order(t, fmt, layout_hints)
    if order is None:
        return None
    hints = LayoutHints.coerce(layout_hints)
    how = (
        f"layout hint attn_backend={hints.attn_backend!r}"
        if _rocm_hinted(hints)
        else "a ROCm torch build (torch.version.hip)"
    )
    advice = (
        f"the DSA indexer cache was read as written on ROCm, by {how}: its pages hold {order}, so they "
        "move whole, only to an indexer cache paged alike on ROCm (same GPU architecture and aiter)"
    )
    layout = f"rocm-indexer-pages: vLLM's DSA indexer on ROCm, {order}: {page_of(t)}"
    key = replicated_page((kernel_pages * math.prod(t.shape[1:]) * t.element_size(),))
    return OpaquePages(layout[:MAX_PAGE_LAYOUT], rows_are_tokens=False, arrays=key, advice=advice)


def _rocm_indexer_order(t: torch.Tensor, fmt: EngineKVFormat, layout_hints: HintsLike) -> str | None:
    """What orders the bytes of ``t``'s pages read as ``fmt`` where they are a DSA indexer's
    written on ROCm in an order of its own; None where they are ``fmt``'s rows."""
    if not LAYOUTS[fmt].is_indexer or not reads_rocm(t.device, layout_hints):
        return None
    fp8 = str(from_engine_kv_format(fmt).logical_dtype).startswith("float8")
    if fp8 and t.shape[-2] == 1:  # one slot a block: the writer's LAYOUT "NORMAL"
        return None
    return _ROCM_FP8_INDEXER if fp8 else _ROCM_MXFP4_INDEXER


def indexer_format(value: Any) -> EngineKVFormat | None:
    """The DSA indexer format whose rows a registered vLLM layer (or kernel page) holds
    (0.33's ``[pages, 1, N, row]``, earlier ``[pages, N, row]``), as its writer on CUDA lays
    them, before any platform's re-view; None for anything else. Asks no hints: the
    blocked-scale rows say it by themselves."""
    if not isinstance(value, torch.Tensor) or value.dim() not in (3, 4):
        return None
    try:
        fmt, _ = _discover([value], probe([value]), LayoutHints(), _READINGS[0])
    except (DetectionError, LayoutHintError):
        return None
    return fmt if LAYOUTS[fmt].is_indexer else None


def _as_rocm_indexer(
    read: tuple[EngineKVFormat, DiscoverableKVCache], p: Probe, hints: LayoutHints
) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    """The DSA indexer's ``[NB, BS, row]`` pages written on ROCm as whole opaque pages of
    the same rows (:func:`rocm_indexer_pages`); anything else as read."""
    fmt, out = read
    if p.depth != 1 or not isinstance(out, list) or not all(isinstance(t, torch.Tensor) for t in out):
        return read
    if _rocm_indexer_order(out[0], fmt, hints) is None:
        return read
    views = []
    for i, t in enumerate(out):
        nb, slots, row = (int(n) for n in t.shape)
        if t.numel() == 0:  # before its page is declared: a page of no bytes declares nothing
            raise DetectionError(
                f"kv_caches[{i}] {_strided(t)} read as vLLM's DSA indexer on ROCm holds no pages"
            )
        marked = rocm_indexer_pages(t, fmt, hints)
        assert marked is not None  # as the first layer's: one format, one device, one hint
        item = t.element_size()
        # each block one run of its slots' rows: the strided-view check keeps only padding between blocks
        stride = int(t.stride(0)) * item if nb > 1 else slots * row * item
        view = page_bytes_view(t, nb, slots, row * item, stride, int(t.storage_offset()) * item)
        mark_opaque_pages(view, marked, [t])
        views.append(view)
    opaque, _ = _discover(views, probe(views), LayoutHints(), _Reading(True, False))
    return opaque, views


def reads_cpu_attention(device: torch.device | str, layout_hints: HintsLike) -> bool:
    """Whether vLLM's attention layers on ``device`` are read as CPU_ATTN's (whole opaque
    pages a block): the ``attn_backend`` hint says ``CPU_ATTN``, or the tensors are on the
    CPU and neither ``attn_backend`` nor ``kv_layout`` says what stands there (vLLM's CPU
    platform always uses CPU_ATTN)."""
    hints = LayoutHints.coerce(layout_hints)
    if hints.attn_backend is not None:
        return hints.attn_backend == CPU_ATTENTION
    return hints.kv_layout is None and torch.device(device).type == "cpu"


def _check_cpu_attention_hints(hints: LayoutHints) -> None:
    """CPU_ATTN allocates heads before tokens inside each block (``LBHNC``, or ``BLHNC``
    in a cross-layer allocation): another ``kv_layout`` contradicts it."""
    if hints.kv_layout is not None and (
        hints.kv_layout not in HND_KV_LAYOUTS or hints.is_head_outer or hints.is_layer_inner
    ):
        raise LayoutHintError(
            f"layout hints attn_backend={hints.attn_backend!r} and kv_layout={hints.kv_layout!r} disagree: "
            "vLLM's CPU_ATTN allocates each block's heads before its tokens (LBHNC or BLHNC)"
        )


def _as_cpu_attention(
    read: tuple[EngineKVFormat, DiscoverableKVCache], p: Probe, hints: LayoutHints
) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    """vLLM 0.33's per-layer ``[NB, H, N, C]`` attention (heads of K | V, heads before
    tokens) as CPU_ATTN's whole pages, ``[NB, N, page_bytes // N]`` int8 marked opaque;
    anything else (MLA latents, the DSA indexer, older ranks, NHD reads) as read."""
    fmt, out = read
    layout = LAYOUTS[fmt]
    # One head reads so too: without kv_dim=1 (or an MLA layout_format) a one-head layer
    # is attention on every device (an MQA model, or TP = KV heads), and attention on the
    # CPU is CPU_ATTN; MLA latents under those hints are is_mla and stay as read.
    if not (
        p.depth == 1
        and p.rank == 4
        and layout.is_hnd
        and not layout.is_head_outer
        and not layout.is_mla
        and not layout.is_indexer
    ):
        return read
    assert isinstance(out, list)
    _, heads, _, row = out[0].shape
    for hint, size in (("num_kv_heads", heads), ("head_dim", row // 2)):
        stated = getattr(hints, hint)
        if stated is not None and stated != size:
            raise LayoutHintError(
                f"layout hint {hint}={stated}, but kv_caches[0] {_strided(out[0])} read as vLLM's CPU_ATTN "
                f"([NB, H, N, 2*head_dim]) has {size}"
            )
    pages = [_cpu_attention_view(t, hints, i) for i, t in enumerate(out)]
    # read as the rank-3 pages vLLM's group edits make are, under every hint
    opaque, _ = _discover(pages, probe(pages), LayoutHints(), _Reading(True, False))
    return opaque, pages


def _cpu_attention_view(t: torch.Tensor, hints: LayoutHints, i: int) -> torch.Tensor:
    nb, heads, tokens, row = (int(n) for n in t.shape)
    if t.numel() == 0:
        raise DetectionError(f"kv_caches[{i}] {_strided(t)} read as vLLM's CPU_ATTN holds no pages")
    item = t.element_size()
    page = heads * tokens * row * item
    # each block is one run here: the strided-view check refuses interior padding and
    # overlapping blocks first (dim-0 padding, between blocks, is the only kind it keeps)
    stride = int(t.stride(0)) * item if nb > 1 else page
    view = page_bytes_view(t, nb, tokens, page // tokens, stride, int(t.storage_offset()) * item)
    mark_opaque_pages(view, cpu_attention_pages(t, hints), [t])
    return view


def cpu_attention_pages(t: torch.Tensor, layout_hints: HintsLike = None) -> OpaquePages:
    """What a CPU_ATTN page holds (:class:`~kvlayout.registration.opaque.OpaquePages`):
    vLLM 0.33's kernel page ``[H, N, C]`` of ``t`` (``[pages, H, N, C]``), its dtype and
    memory order; rows are no tokens (the kernel views a page as ``[H, 2N, C/2]``, a head's
    K rows then its V rows, and its ISA-specific kernels pack each in their own tiles)."""
    hints = LayoutHints.coerce(layout_hints)
    how = (
        "layout hint attn_backend='CPU_ATTN'"
        if hints.attn_backend is not None
        else "the default for vLLM tensors on the CPU: pass kv_layout='NHD' (or 'HND', or the backend's "
        "attn_backend) if these tensors stand in for a GPU backend's cache"
        + (", or kv_dim=1 if its one head is an MLA layer's latents" if t.shape[1] == 1 else "")
    )
    advice = (
        f"the cache was read as vLLM's CPU_ATTN (its K and V packed per ISA inside each block), by {how}; "
        "such pages move only to a cache paged alike (CPU_ATTN of the same block size, heads, head size "
        "and dtype), and vLLM itself repacks received plain blocks with its platform's pack_kv_cache"
    )
    layout = f"cpu-attn-pages: vLLM's CPU_ATTN, K and V packed per ISA inside each block: {page_of(t)}"
    return OpaquePages(layout[:MAX_PAGE_LAYOUT], rows_are_tokens=False, advice=advice)


class _Reading(NamedTuple):
    """A ``kv_layout`` reading: heads before tokens, and heads outside blocks (LHBNC)."""

    hnd: bool
    head_outer: bool


# NHD, HND and LHBNC (last): what size hints choose among without a kv_layout hint.
_READINGS = (_Reading(False, False), _Reading(True, False), _Reading(True, True))


def _read_by_sizes(
    kv: Any, p: Probe, hints: LayoutHints
) -> tuple[EngineKVFormat, DiscoverableKVCache] | None:
    """The NHD, HND or LHBNC reading the size hints agree with, where exactly one format
    does (None without size hints, or when they do not tell the readings apart)."""
    if all(getattr(hints, hint) is None for hint, _ in SIZE_HINTS):
        return None
    agree: list[tuple[EngineKVFormat, DiscoverableKVCache]] = []
    # heads outside blocks only where a format of this depth and rank has them
    outer = any(
        LAYOUTS[f].is_head_outer and LAYOUTS[f].list_depth == p.depth and format_shape(f).rank == p.rank
        for f in engine_formats(ENGINE)
    )
    for reading in _READINGS if outer else _READINGS[:2]:
        try:
            fmt, out = _discover(kv, p, hints, reading)
        except DetectionError:
            continue
        if size_hint_conflict(fmt, first_leaf(out).shape, hints) is None and fmt not in (f for f, _ in agree):
            agree.append((fmt, out))
    return agree[0] if len(agree) == 1 else None


def _layout_label(p: Probe, hints: LayoutHints) -> str:
    """How messages name the NHD/HND decision: the hint, or the device's default."""
    return "kv_layout" if hints.is_hnd is not None else f"no kv_layout hint, so {{}} on {p.device.type}"


def _discover(
    kv: Any, p: Probe, hints: LayoutHints, reading: _Reading
) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    label = _layout_label(p, hints)
    layout_decision = (label, "is_hnd", reading.hnd)
    head_decision = (label, "is_head_outer", reading.head_outer)
    if p.depth == 0:  # the cross-layer tensor of BHLNC only under its hint (no twin decides it)
        inner = _says_layer_inner(hints)
        decide = [layout_decision, head_decision]
        try:
            return pick(ENGINE, p, decide=decide, only=lambda s: s.layout.is_layer_inner is inner), kv
        except DetectionError as e:
            if inner:
                raise DetectionError(
                    f"{e}; under kv_layout='BHLNC' a bare tensor is [NB, H, NL, N, C]"
                ) from None
            if match(ENGINE, p, only=lambda s: s.layout.is_layer_inner) is not None:
                raise DetectionError(
                    f"{e}; a bare [NB, H, NL, N, C] tensor is vLLM's BHLNC cross-layer tensor only under "
                    "kv_layout='BHLNC'"
                ) from None
            raise
    if p.depth == 1 and p.rank == 4:
        return _rank4(kv, p, reading, hints)
    # Padded block rows say dim 0 is the block axis (flash-infer), whatever the sizes.
    padded = ("dim-0 padding", "has_leading_block_axis", True if dim0_padding(p.first) else None)
    fmt = pick(
        ENGINE,
        p,
        decide=[layout_decision, head_decision, padded, ("kv_pair_axis", "kv_axis", hints.kv_pair_axis)],
        prefer=["is_two_major", "has_kv"],
    )
    if LAYOUTS[fmt].is_kv_second_tuple:
        kv = [tuple(layer) for layer in kv]
    return fmt, kv


def _rank4(
    kv: list[Any], p: Probe, reading: _Reading, hints: LayoutHints
) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    label = _layout_label(p, hints)
    # One head outside the blocks is the same memory as inside them; vLLM's [NB, 1, N, C]
    # reads [NB, 1, N, C] in memory order, and so does one block of H heads, [H, 1, N, C]:
    # one head (TP = KV heads) unless num_kv_heads says dim 0 is the heads.
    head_outer = reading.head_outer and (p.shape[1] != 1 or hints.num_kv_heads == p.shape[0])
    fused = pick(ENGINE, p, decide=[(label, "is_hnd", reading.hnd), (label, "is_head_outer", head_outer)])
    head, token = (LAYOUTS[fused].axis_of(r) for r in (Role.HEAD, Role.TOKEN))
    assert head is not None and token is not None
    one_head = hints.num_kv_heads in (None, 1) and hints.tokens_per_block != 1
    if one_head and p.shape[token] == 1 and p.shape[head] != 1:
        # one head read as one token a block: the same bytes, the 1 on the head axis
        kv = [t.transpose(head, token) for t in kv]
        p = probe(kv)
    latent = _says_latent(hints)
    if p.shape[head] == 1:  # one head: is the row a blocked-scale page (the DSA indexer)?
        squeezed = p.shape[:head] + p.shape[head + 1 :]
        indexer = match(ENGINE, p, shape=squeezed, only=lambda s: s.byte_rows)
        if indexer is None and latent:  # MLA: one latent row a token, not a head's K | V
            indexer = match(ENGINE, p, shape=squeezed, only=lambda s: s.layout.is_mla and not s.byte_rows)
        if indexer is not None:
            return indexer, [t.squeeze(head) for t in kv]
    elif latent:
        raise LayoutHintError(
            f"the layout hints say MLA (one latent row a token: kv_dim=1 or an MLA layout_format), but "
            f"kv_caches[0] {p.describe()} has {p.shape[head]} heads on its head axis"
        )
    return fused, kv


def _says_latent(hints: LayoutHints) -> bool:
    """The hints say MLA: vLLM 0.26+ registers an MLA layer as ``[NB, 1, BS, C]``, the shape
    of a one-head fused K | V cache (any GQA model at TP = KV heads), so only they can."""
    named = hints.layout_format
    return hints.kv_dim == 1 or (named is not None and LAYOUTS[EngineKVFormat[named]].is_mla)


def _says_layer_inner(hints: LayoutHints) -> bool:
    """The hints say BHLNC: the ``kv_layout``, or a ``layout_format`` with layers inside heads."""
    named = hints.layout_format
    return bool(hints.is_layer_inner) or (named is not None and LAYOUTS[EngineKVFormat[named]].is_layer_inner)


def pool_views(kv: Any, hints: LayoutHints) -> tuple[torch.Tensor, LayoutHints] | None:
    """The cross-layer tensor vLLM's ``BHLNC`` views tile and the hints it reads with (see
    the module docstring), asked of the caller's registration before anything else; None
    where it is not such views (nor hinted so). A view of the caller's memory."""
    if isinstance(kv, torch.Tensor):
        if _says_layer_inner(hints):
            _check_pool_order(kv)
        return None
    # Anything but rank-4 views (a hybrid's Mamba or edited groups, tuples, sparse tensors)
    # has no head and layer order to read: detected as usual, under the hint too. Entry 0
    # settles the common case (no BHLNC stride, no hint) in constant time: this is asked
    # of every vLLM registration.
    if not isinstance(kv, (list, tuple)) or len(kv) < 2 or not _rank4_view(kv[0]):
        return None
    hinted = _says_layer_inner(hints)
    first = kv[0]
    page = first.shape[2] * first.shape[3]
    # heads a whole number of pages apart, blocks outside them (LHBNC has heads outside blocks)
    spaced = (
        page > 0
        and first.stride(1) % page == 0
        and first.stride(1) // page > 1
        and first.stride(0) >= first.shape[1] * first.stride(1)
        and first.stride()[2:] == (first.shape[3], 1)
    )
    if not (hinted or spaced) or first.numel() == 0 or not all(_rank4_view(t) for t in kv):
        return None
    # one head unhinted, of latents or of blocked-scale pages (the DSA indexer): BLHNC's
    # memory, read so; one head under the hint is TP = KV heads
    if first.shape[1] == 1 and not (hinted and not _says_latent(hints) and not _indexer_rows(kv)):
        return None
    missing = first_without_memory(kv, "kv_caches")  # before their storages are compared
    if missing is not None:
        raise DetectionError(missing)
    if not hinted and not _one_storage(kv):
        return None  # not views of one allocation: per-layer tensors, read (or refused) as such
    if hinted and not spaced and first.shape[1] > 1:
        raise DetectionError(
            f"layout hint kv_layout='BHLNC', but kv_caches[0] {_strided(first)} is not a BHLNC view: its "
            f"heads are not a whole number (more than one) of {page}-element pages apart inside its blocks, "
            "where every layer's page of a head sits; pass the kv_layout the cache was allocated in"
        )
    problem = _tiling_problem(kv, page)
    if hints.is_layer_inner is False:
        if problem is None:
            raise LayoutHintError(
                f"layout hint kv_layout={hints.kv_layout!r}, but kv_caches are per-layer views of one "
                f"allocation with layers inside heads inside blocks (vLLM's BHLNC: kv_caches[0] "
                f"{_strided(first)}, each layer one page further); pass kv_layout='BHLNC' or no kv_layout"
            )
        return None
    if _says_latent(hints):
        raise LayoutHintError(
            f"the layout hints say MLA (one latent row a token: kv_dim=1 or an MLA layout_format), but "
            f"kv_caches[0] {_strided(first)} are BHLNC views with {first.shape[1]} heads"
        )
    if problem is not None:
        raise DetectionError(
            f"kv_caches read as vLLM's BHLNC (per-layer views of one allocation, each head's rows of "
            f"every layer together in a block, read as one [NB, H, NL, N, C] tensor): {problem}"
        )
    nb, nh, bs, cs = first.shape
    pool = first.as_strided(
        (nb, nh, len(kv), bs, cs), (first.stride(0), len(kv) * page, page, cs, 1), first.storage_offset()
    )
    return pool, dataclasses.replace(hints, kv_layout="BHLNC")


def _rank4_view(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and t.dim() == 4


def _indexer_rows(kv: Sequence[torch.Tensor]) -> bool:
    """One-head views whose rows are the DSA indexer's blocked-scale pages."""
    nb, _, bs, row = kv[0].shape
    return match(ENGINE, probe(list(kv)), shape=(nb, bs, row), only=lambda s: s.byte_rows) is not None


def _one_storage(kv: Sequence[torch.Tensor]) -> bool:
    base = kv[0].untyped_storage().data_ptr()
    return all(t.untyped_storage().data_ptr() == base for t in kv)


def _check_pool_order(t: torch.Tensor) -> None:
    """The ``[NB, H, NL, N, C]`` tensor itself must be handed over in memory order: the
    sizes alone cannot tell its heads from its layers (a BLHNC pool viewed so reads both
    swapped)."""
    order = physical_order(t.shape, t.stride())
    if t.dim() == 5 and order != list(range(5)):
        raise LayoutHintError(
            f"layout hint kv_layout='BHLNC' reads a bare tensor as [NB, H, NL, N, C] in memory order, but "
            f"kv_caches (shape {tuple(t.shape)}, stride {t.stride()}) has its dims in memory in the order "
            f"{order}: its heads and layers cannot be told apart by their sizes"
        )


def _tiling_problem(kv: Sequence[Any], page: int) -> str | None:
    """Why per-layer ``[NB, H, N, C]`` views do not tile one ``[NB, H, NL, N, C]``
    allocation in their order, layer ``l`` one page (``N*C`` elements) after layer 0
    (None when they do)."""
    first = kv[0]
    if first.stride()[2:] != (first.shape[3], 1):
        return f"kv_caches[0] {_strided(first)} does not hold a head's tokens as one run of rows"
    base = first.untyped_storage().data_ptr()
    starts = {first.storage_offset(): 0}
    for i, t in enumerate(kv[1:], start=1):
        if t.untyped_storage().data_ptr() != base:
            return f"kv_caches[{i}] is not in kv_caches[0]'s allocation"
        if t.stride() != first.stride() or t.shape != first.shape or t.dtype != first.dtype:
            return f"kv_caches[{i}] {_strided(t)} is not viewed as kv_caches[0] {_strided(first)} is"
        offset = t.storage_offset() - first.storage_offset()
        earlier = starts.setdefault(t.storage_offset(), i)
        if earlier != i:
            return (
                f"kv_caches[{i}] starts where kv_caches[{earlier}] does (vLLM's KV sharing, or layers of "
                "two KV cache groups, which overlay each other): one cross-layer tensor holds each "
                "layer once, so detect each KV cache group's own layers, without the layers that "
                "share another's KV cache"
            )
        if offset != i * page:
            return (
                f"kv_caches[{i}] starts {offset} elements after kv_caches[0], not {i} pages ({i * page}): "
                "the layers of one allocation (vLLM's KVCacheTensor.layers), in its order, are one "
                "cross-layer tensor; detect each allocation's layers on their own"
            )
    nl = len(kv)
    if first.shape[1] > 1 and first.stride(1) != nl * page:
        return (
            f"kv_caches[0] {_strided(first)} has its heads {first.stride(1)} elements apart, not "
            f"{nl} layers of {page}-element pages ({nl * page})"
        )
    if first.stride(0) < first.shape[1] * nl * page:
        return f"kv_caches[0] {_strided(first)} has blocks closer than the {nl} layers' heads they hold"
    return None


def _strided(t: Any) -> str:
    return f"(shape {tuple(t.shape)}, stride {t.stride()})"
