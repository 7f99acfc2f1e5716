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
  layouts), for MHA and MLA alike; LMCache ignores it for two-list registrations. It
  also reads token rows with a one-token block axis in blocks: the Ascend NPU pool under
  ``ASCEND_USE_FIA=1`` registers per-layer views ``[NB*BS, 1, NH, HS]`` as K and V lists.
* A DSA indexer key cache is a flat list of 2-D uint8 pages ``[pages, BS * W]``: SGLang
  folds each page's tokens into the row. W is the width of the blocked-scale format's
  record (the algebra's region width, 132 bytes), so BS is the row's width over W; each
  page is re-viewed as the format's ``[NB, BS, W]`` (no hint needed; a
  ``tokens_per_block`` given must agree). Mixed latent + indexer lists are detected per
  layer group (``normalize_and_discover_per_layer_formats``). Under
  ``index_cache_dtype=torch.bfloat16`` the pages are bf16 ``[pages, BS * 128]``, keys
  without scales: a region run of one dtype is stored in it, so the pages are re-viewed
  as their bytes (a region's width counts bytes) and read as that format. DeepSeek-V4's
  FP4 indexer (``DeepSeekV4IndexerPool`` on CUDA) pages are ``[pages, BS * 68]`` uint8, a
  page every slot's 64 packed e2m1 bytes then every slot's 4 ue8m0 bytes: vLLM's MXFP4
  indexer page, read as that format. A row that is whole records of either width is read
  at the ``tokens_per_block`` given, and refused without one. DeepSeek-V4's FlashMLA KV
  pages (``DeepSeekV4SingleKVPool``: uint8 ``[pages, bytes]``, the page padded to a
  multiple of 576) are no indexer's, though at page_size 16 and 32 they are 144 records
  of 68 or 132 bytes: a uint8 row so padded is refused without ``tokens_per_block``, as
  is one the size of a V4.1 page (padded to 512 or 256) at a power-of-two page_size
  (at 16 and 32 slots, 8704 and 16896 bytes: 128 FP4 or FP8 indexer records), and
  any refusal of a uint8 row names them and
  ``kvlayout.integrations.sglang.flashmla_kv_pages``, which reads them as whole pages (as
  ``aiter_fp4_indexer_pages`` reads the ROCm FP4 indexer's split buffers). A bf16 row of
  512 (DeepSeek-V4's ``DeepSeekV4UnifiedKVPool.kv_buffer``, a token a row after the SWA
  ring) is also 4 bf16 indexer keys: it is read so only given ``tokens_per_block``, and
  refused without, naming how its compressed rows read as MLA page buffers; so are the
  two pools of its FP8 form (``SGLANG_DSV4_UNIFIED_KV_FP8``: float8_e4m3fn rows of 512 and
  bf16 rows of 64, ``kv_buffer`` and ``kv_buffer_rope``).
* SGLang's page-major MLA pool (``layout/page_major.py``) registers a flat list of 4-D
  views ``[pages, page_size, 1, C]`` whose page stride is the envelope of every layer's
  latents: each is the folded MLA page buffer split into pages, read as its unfolded
  twin (no hint needed; ``tokens_per_block`` given must be the page_size).
* A HiCache host pool (``mem_pool_host.kv_buffer``) is one tensor, in the layout the
  ``hicache_layout`` hint names (SGLang's ``--hicache-mem-layout``); a name is an order
  of the paging axes (:data:`_HOST_ORDERS`), which picks the format. Ascend's MLA pool
  (``page_first_kv_split``, SGLang's default there) splits the row: ``k_buffer`` (its
  ``kv_buffer``) and ``v_buffer`` are each ``[pages, NL, page_size, 1, C]``, read apart. Its token slots are
  SGLang's host indices; ``tokens_per_block`` (the pool's ``page_size``) reads them in
  pages, as it does a device pool's page buffers. A DSA indexer's host pool (uint8 pages
  of records, indexed by page) is read given ``tokens_per_block`` only: without it, a
  page-first one has an MLA pool's shape.
* An FP4 MHA pool's scale buffers are refused, naming
  ``kvlayout.integrations.sglang.fp4_scale_pools``: its linear ``[size + page_size, H * sf]``
  as K/V lists of 2-D tensors (read as page buffers of ``H`` heads, ``t.view(t.shape[0], H,
  -1)``), and a flat uint8 list of rank 4 (its native ``[pages, H, page_size, sf]``, whose V
  scales interleave 4 tokens, as a refused flat list names it).
* Lists of rank-5 ``float8_e8m0fnu`` tensors (the UE8M0 scales of the MXFP8 pool,
  ``MHATokenToKVPoolMXFP8`` at page_size 128: ``[pages, H, 32, page_size // 32, sf]``, a
  page's token ``off`` at ``[off % 32, off // 32]``) are refused, naming
  ``kvlayout.integrations.sglang.mxfp8_scale_pools``, which reads their pages whole (its
  flat scales at other page sizes, ``[slots, H, sf]``, read as a K/V pool's page buffers).
* Lists of rank-5 tensors (the ROCm AITER ``vectorized_5d`` pool, K ``(num_blocks, H,
  D // X, page_size, X)``, V ``(num_blocks, H, page_size // X, D_v, X)``) are refused,
  naming ``kvlayout.integrations.sglang.vectorized_kv_pools``, which reads their pages
  (and ``aiter_fp4_indexer_pages``, for a ROCm FP4 indexer's payload of the same rank).
* ``kv_layout`` chooses between NHD and HND twins: ``"HND"`` reads a K/V pool of
  per-layer ``[pages, heads, page_size, head_dim]`` tensors (``SGLANG_USE_HND_KVCACHE``,
  trtllm_mha) as ``TWO_X_NL_X_NB_NH_BS_HS``, and refuses a registration no HND format
  fits rather than read its heads as tokens; without it SGLang's caches are NHD.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvlayout._generated.formats import LAYOUTS, EngineKVFormat
from kvlayout.detection.base import (
    Decision,
    DetectionError,
    Probe,
    engine_formats,
    match,
    pick,
    probe,
    token_rows_in_blocks,
    unfold_shape,
    unfolded_twin,
)
from kvlayout.layout import algebra
from kvlayout.layout.algebra import sizes_by_role
from kvlayout.layout.ast import Layout
from kvlayout.layout.vocabulary import Role
from kvlayout.registration.nesting import leaves, map_leaves
from kvlayout.types import HICACHE_LAYOUT_NAMES, DiscoverableKVCache, EngineType, LayoutHintError, LayoutHints

ENGINE = EngineType.SGLANG
OWN_HINTS = ("hicache_layout",)

# SGLang's HiCache host pools (HostKVCache.init_kv_buffer), by the order of their layer,
# block, token and head axes, outermost first (a page axis NB*BS is a block axis, then a
# token axis; an MLA pool's one head is its row); an MHA pool has its K/V axis before
# them, an MLA pool none.
_HOST_ORDERS: dict[str, tuple[Role, ...]] = {
    "layer_first": (Role.LAYER, Role.BLOCK, Role.TOKEN, Role.HEAD),  # [2, NL, size, NH, HS]
    "page_first": (Role.BLOCK, Role.TOKEN, Role.LAYER, Role.HEAD),  # [2, size, NL, NH, HS]
    "page_first_direct": (Role.BLOCK, Role.LAYER, Role.TOKEN, Role.HEAD),  # [2, pages, NL, page_size, NH, HS]
    "page_head": (Role.BLOCK, Role.HEAD, Role.TOKEN, Role.LAYER),  # [2, pages, NH, page_size, NL, HS]
    # Ascend's MLA host pool (pool_host/mla.py): k_buffer (its kv_buffer) and v_buffer, each one
    # tensor [pages, NL, page_size, 1, C] (the latents; the RoPE part), as NPUMLATokenToKVPool
    # splits them; an MHA host pool has no such layout (MHATokenToKVPoolHost raises for it)
    "page_first_kv_split": (Role.BLOCK, Role.LAYER, Role.TOKEN, Role.HEAD),
}
_MLA_ONLY_HOST_LAYOUTS = ("page_first_kv_split",)
assert tuple(_HOST_ORDERS) == HICACHE_LAYOUT_NAMES
# The DSA indexer's host pool (DSAIndexerPoolHost) is indexed by page: both page-first
# layouts keep a page's records together per layer, [pages, NL, 1, page_bytes], and
# layer_first is [NL, pages, page_bytes]; uint8, page_bytes = page_size records.
_INDEXER_ORDERS: dict[str, tuple[Role, ...]] = {
    "layer_first": _HOST_ORDERS["layer_first"],
    "page_first": _HOST_ORDERS["page_first_direct"],
    "page_first_direct": _HOST_ORDERS["page_first_direct"],
}


# What SGLang's state buffers (get_state_buf_infos) look like, and that they are not KV pages.
_NOT_STATE = (
    "; a hybrid's Mamba state buffers (conv [slots, conv_dim, K-1], temporal [slots, H, head_dim, "
    "state]) are one state per request slot, not KV pages: "
    "kvlayout.integrations.sglang.mamba_state_pools(pool) reads them"
)
# DeepSeek-V4's compressor states: their ring size is the pool's, which no shape says.
_NOT_DSV4_STATE = (
    "; a DeepSeek-V4 compressor state (CompressStatePool.kv_score_buffer.kv_score: floating [rows, "
    "width], a request's in a ring of ring_size rows) or its HiCache host pages (DeepSeekV4StateHostPool"
    ".kv_buffer: uint8 [pages, ring bytes]) is no KV page: "
    "kvlayout.integrations.sglang.compress_state_rings(states, ring_size) reads them as whole rings"
)


# DeepSeek-V4's FlashMLA KV page layouts (SGLang's ``dsv4/kv_layout.py`` ``KVLayout``, which
# ``DeepSeekV4SingleKVPool.create_buffer`` sizes its uint8 ``[pages, page bytes]`` by): a
# page is every slot's data bytes, then every slot's scale bytes, padded to the reader's
# row stride. By name: (data bytes, scale bytes, page alignment) a slot.
FLASHMLA_LAYOUTS: dict[str, tuple[int, int, int]] = {
    "v4": (576, 8, 576),  # 448 fp8 NoPE + 64 bf16 RoPE, 7 ue8m0 scales + 1 pad
    "v41": (512, 16, 512),  # 512 fp8, 16 ue8m0 scales
    "v41_fp4": (256, 32, 256),  # 512 e2m1, 32 e4m3 scales
}


def flashmla_page_bytes(layout: str, page_size: int) -> int:
    """A FlashMLA page's bytes (``KVLayout.page_bytes``): ``page_size`` slots padded."""
    data, scale, align = FLASHMLA_LAYOUTS[layout]
    return -(-page_size * (data + scale) // align) * align


_FLASHMLA_PAGE_ALIGN = FLASHMLA_LAYOUTS["v4"][2]
# A V4 slot's data and scale bytes together: the row of DeepSeek-V4's HiSparse host pool
# (DeepSeekV4SingleKVPoolHost.kv_buffer, uint8 [NL, slots, 584], a token's record a row).
_DSV4_TOKEN_BYTES = sum(FLASHMLA_LAYOUTS["v4"][:2])
_HISPARSE_HOST_ORDER = (
    f"; DeepSeek-V4's HiSparse host pool (DeepSeekV4SingleKVPoolHost.kv_buffer, uint8 [NL, slots, "
    f"{_DSV4_TOKEN_BYTES}]) has no layout attribute: it is layer_first"
)
_NOT_FLASHMLA = (
    "; a DeepSeek-V4 KV pool's FlashMLA pages (DeepSeekV4SingleKVPool.kv_buffer: uint8 [pages, page "
    "bytes padded to a multiple of 576, or in V4.1 of 512 or 256]) are no indexer's, and no format reads "
    "their tokens: "
    "kvlayout.integrations.sglang.flashmla_kv_pages(kv_buffer, page_size) reads them as whole pages"
)


# What the ROCm FP4 indexer's split buffers (DeepSeekV4IndexerPool.uses_aiter_fp4_layout) are.
_NOT_AITER_FP4_INDEXER = (
    "; a ROCm DeepSeek-V4 FP4 indexer's index_k_payload_buffer [pages, 1, 4, page_size, 16] and "
    "index_k_scale_buffer [pages, 1, 4, page_size] (uses_aiter_fp4_layout; flattened to [pages, "
    "page_size * 64] and [pages, page_size * 4] for P/D and HiCache) split each token's 64 payload bytes "
    "and 4 scale bytes across the page, so no format reads their tokens: "
    "kvlayout.integrations.sglang.aiter_fp4_indexer_pages(payload, scale, page_size) reads them as whole "
    "pages"
)


# DeepSeek-V4's latent width (448 NoPE + 64 RoPE), one token's row of two of its pools whose
# rows no indexer's are: DeepSeekV4UnifiedKVPool.kv_buffer (bf16 [swa_pages + compressed
# rows, 512], the SWA ring first) and DeepSeekV4UniformFP8KVPool.kv_buffer (float8_e4m3fn
# [pages, page_size * 512]).
DSV4_HEAD_DIM = 512
_NOT_DSV4_UNIFIED = (
    "; a DeepSeek-V4 unified KV pool (DeepSeekV4UnifiedKVPool.kv_buffer: bf16 [swa_pages + compressed "
    f"rows, {DSV4_HEAD_DIM}], a token a row, the SWA ring first) is no indexer's: its compressed rows read "
    f"as MLA page buffers, [b[swa_pages:].view(-1, 1, {DSV4_HEAD_DIM}) for b in kv_buffer] with layout "
    "hint tokens_per_block=page_size // compress_ratio"
)
_NOT_DSV4_UNIFORM_FP8 = (
    "; a DeepSeek-V4 uniform-FP8 pool (DeepSeekV4UniformFP8KVPool.kv_buffer: float8_e4m3fn [pages, "
    f"page_size * {DSV4_HEAD_DIM}], a token's {DSV4_HEAD_DIM} bytes whole) reads as MLA page buffers: "
    f"pass [t.view(-1, 1, {DSV4_HEAD_DIM}) for t in kv_buffer] with layout hint tokens_per_block=page_size"
)
# The unified pool under SGLANG_DSV4_UNIFIED_KV_FP8 splits a token's row in two pools of one
# row count: its FP8 NoPE and scales (DSV4_FP8_NOPE_ROW_BYTES, 512) and its bf16 RoPE (64).
# Read from row 0, as the readings above of a pool of pages would, the SWA ring's rows
# would be counted as pages: the compressed rows start at swa_pages.
DSV4_ROPE_DIM = 64
_NOT_DSV4_UNIFIED_FP8 = (
    "; a DeepSeek-V4 unified KV pool under SGLANG_DSV4_UNIFIED_KV_FP8 is two pools of one row count, the "
    f"SWA ring first (DeepSeekV4UnifiedKVPool.kv_buffer: float8_e4m3fn [swa_pages + compressed rows, "
    f"{DSV4_HEAD_DIM}], a token's FP8 NoPE and scales; kv_buffer_rope: bf16 [the same rows, "
    f"{DSV4_ROPE_DIM}], "
    "its RoPE): its compressed rows read as two MLA page buffers, [b[swa_pages:].view(-1, 1, "
    f"{DSV4_HEAD_DIM}) for b in kv_buffer] and [b[swa_pages:].view(-1, 1, {DSV4_ROPE_DIM}) for b in "
    "kv_buffer_rope], each with layout hint tokens_per_block=page_size // compress_ratio (map both)"
)


# What the interleaved scale buffers of SGLang's MXFP8 pool (MHATokenToKVPoolMXFP8 at page_size 128,
# mxfp8_sf_interleaved) are: a page's tokens' scales scattered over each head's tile.
_NOT_MXFP8_SCALES = (
    "; per-layer float8_e8m0fnu tensors of rank 5 are the UE8M0 scales of SGLang's MXFP8 pool "
    "(MHATokenToKVPoolMXFP8.k_scale_buffer / v_scale_buffer at page_size 128: [pages, H, 32, "
    "page_size // 32, head_dim // 32], a page's token off at [off % 32, off // 32]), whose tokens no "
    "format reads: "
    "kvlayout.integrations.sglang.mxfp8_scale_pools(k_scale_buffer, v_scale_buffer, page_size) reads their "
    "pages whole, as SGLang's P/D moves them (get_kv_scale_buf_infos)"
)


# What a dynamic-FP8 MHA pool's scale buffers are (MHATokenToKVPoolDynamicFP8, which its HiCache host
# pool MHATokenToKVPoolDynamicFP8Host moves a page at a time): one float32 scale a slot and head.
_NOT_DYNAMIC_FP8_SCALES = (
    "; a dynamic-FP8 MHA pool's k_scale_buffer and v_scale_buffer (MHATokenToKVPoolDynamicFP8: float32 "
    "[size + page_size, head_num], a slot's scale a head) read as K/V page buffers of one-element heads: "
    "pass [t.unsqueeze(-1) for t in k_scale_buffer + v_scale_buffer] with the payload's hints"
)
# What an FP4 MHA pool's scale buffers are (MHATokenToKVPoolFP4: k_scale_buffer / v_scale_buffer),
# registered as K/V lists: a token's row is its heads' scales one head after another
# (KVFP4QuantizeUtil.batched_quantize: [tokens, H, D] viewed [tokens, H * D // 16, 16]), so one
# head read from the row would move every head's scales to each rank of another TP degree.
_NOT_FP4_MHA_SCALES = (
    "; an FP4 MHA pool's k_scale_buffer and v_scale_buffer (MHATokenToKVPoolFP4: uint8 [size + page_size, "
    "head_num * head_dim // 16], a token's scales head by head) read as K/V page buffers of head_num heads: "
    "pass [t.view(t.shape[0], head_num, -1) for t in k_scale_buffer + v_scale_buffer] with the payload's "
    "hints, or kvlayout.integrations.sglang.fp4_scale_pools(k_scale_buffer, v_scale_buffer, page_size, "
    "head_num)"
)
# What the native (TRT-LLM) scale buffers of an NVFP4 MHA pool are: uint8 [pages, H, page_size, sf], V's
# scales interleaved over 4 tokens (nvfp4_v_scale_swizzle_indices), so no token-level format reads them.
_NOT_FP4_NATIVE_SCALES = (
    "; an NVFP4 MHA pool's native_k_scale_buffer and native_v_scale_buffer (TRT-LLM's layout: uint8 "
    "[pages, H, page_size, head_dim // 16], V's scales interleaved over 4 tokens) are read as whole pages "
    "by kvlayout.integrations.sglang.fp4_scale_pools(native_k_scale_buffer, native_v_scale_buffer, "
    "page_size, head_num)"
)


# What a dynamic-FP8 MHA pool's HiCache host scales are (MHATokenToKVPoolDynamicFP8Host.scale_host), which
# the host pool keeps apart from kv_buffer.
_NOT_DYNAMIC_FP8_HOST_SCALES = (
    "; a float32 [page_num, 2, layer_num, page_size, head_num] tensor is the dynamic-FP8 pool's host scales "
    "(MHATokenToKVPoolDynamicFP8Host.scale_host), no kv_buffer: "
    "kvlayout.integrations.sglang.dynamic_fp8_host_scales(scale_host) reads it"
)


# What a HiCache host pool's K and V halves (kv_buffer[0], kv_buffer[1]) are, passed as a list.
_NOT_HOST_HALVES = (
    "; a HiCache host pool's K and V halves (mem_pool_host.kv_buffer[0] and [1]) are one tensor: "
    "pass kv_buffer itself with layout hint hicache_layout"
)


def _uint8_rank4(p: Probe) -> bool:
    return p.rank == 4 and p.first.dtype == torch.uint8


def _order(hints: LayoutHints) -> Decision:
    return ("kv_layout", "is_hnd", bool(hints.is_hnd))


def discover(kv: Any, hints: LayoutHints) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    p = probe(kv)
    if p.depth == 0:
        if hints.hicache_layout is None:
            raise DetectionError(
                f"SGLang registers lists of per-layer tensors, not one tensor ({p.describe()}); a HiCache "
                "host pool's kv_buffer is one tensor: pass layout hint hicache_layout "
                "(mem_pool_host.layout); a Mamba state pool's tensors are read by "
                "kvlayout.integrations.sglang.mamba_state_pools(pool)"
                f"{_HISPARSE_HOST_ORDER if _hisparse_host(p) else ''}"
            )
        return _host_pool(kv, p, hints)
    if hints.hicache_layout is not None:
        raise DetectionError(
            f"SGLang: layout hint hicache_layout={hints.hicache_layout} names a HiCache host pool, which is "
            f"one tensor (mem_pool_host.kv_buffer), not {p.describe()}"
        )
    if p.rank == 5 and p.first.dtype == torch.float8_e8m0fnu:
        raise DetectionError(f"SGLang: {p.describe()}{_NOT_MXFP8_SCALES}")
    if p.aiter_shuffled:
        raise DetectionError(
            f"SGLang: {p.describe()}: per-layer K and V of rank 5 are the ROCm AITER pool "
            "(SGLANG_AITER_KV_CACHE_LAYOUT=vectorized_5d: K (num_blocks, H, D // X, page_size, X), "
            "V (num_blocks, H, page_size // X, D_v, X)), whose tokens no format reads; "
            "kvlayout.integrations.sglang.vectorized_kv_pools(k_buffer, v_buffer, page_size) reads its pages"
            f"{_NOT_AITER_FP4_INDEXER}"
        )
    if p.depth == 1 and p.rank == 2 and any(_stores_records(LAYOUTS[f], p.first.dtype) for f in _indexers(p)):
        return _indexer(kv, p, hints)
    if p.rank == 2 and p.depth <= 2 and _k_v_sides(kv, hints) is not None:
        raise DetectionError(
            f"SGLang: {p.describe()}: K and V lists of 2-D tensors are no page buffers [NB*BS, NH, HS]"
            f"{_NOT_DYNAMIC_FP8_SCALES}{_NOT_FP4_MHA_SCALES}"
        )
    if hints.kv_list_layout == "unified":
        return _unified(kv, p, hints)
    if p.depth == 1 and p.rank == 4 and not hints.kv_list_layout:
        page_major = _page_major(kv, p, hints)
        if page_major is not None:
            return page_major
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
            f"then V layers pass layout hint kv_list_layout='k_v'{_NOT_STATE}"
        )
    elif p.depth == 1 and p.rank != 3:
        raise DetectionError(
            f"SGLang: {p.describe()}: a flat list is an MLA page buffer [NB*BS, 1, HS] unless "
            "layout hint kv_list_layout says 'k_v' (K layers then V layers) or 'unified' (components)"
            f"{_NOT_STATE}{_NOT_HOST_HALVES if len(kv) == 2 else ''}"
            f"{_NOT_DSV4_STATE if p.rank == 2 and p.first.dtype.is_floating_point else ''}"
            f"{_NOT_AITER_FP4_INDEXER + _NOT_FP4_NATIVE_SCALES if _uint8_rank4(p) else ''}"
            f"{_NOT_DSV4_UNIFORM_FP8 if p.rank == 2 and p.first.dtype == torch.float8_e4m3fn else ''}"
            f"{_NOT_DSV4_UNIFIED_FP8 if _dsv4_unified_fp8_row(p) else ''}"
        )
    # A rank-3 leaf here is a folded page buffer; a rank-4 one (two lists) already has NB, BS.
    fmt = pick(ENGINE, p, decide=[("kv_list_layout", "is_pbs_fused", p.rank == 3), _order(hints)])
    tpb = hints.tokens_per_block
    if tpb is None or not LAYOUTS[fmt].is_pbs_fused:
        # Ascend's FIA pool: per-layer views [NB*BS, 1, NH, HS] read as one-token blocks
        return fmt, token_rows_in_blocks(ENGINE, fmt, kv, tpb, lambda: f"SGLang: {p.describe()}")
    return _unfolded(kv, p, fmt, tpb)


def hicache_layout(layout: Layout) -> str | None:
    """The HiCache host layout a bare layout is (its ``hicache_layout`` hint), None for
    a layout that is none."""
    return next((name for name, order in _HOST_ORDERS.items() if _is_host_order(layout, order)), None)


def _is_host_order(layout: Layout, order: tuple[Role, ...]) -> bool:
    """Whether ``layout`` is one tensor whose layer, block, token and head axes come in
    ``order`` (a page axis NB*BS is its block, then its token; without a head axis, the
    one head is the row)."""
    roles = layout.role_order(_PAGING_ROLES)
    if Role.HEAD not in roles:
        roles += (Role.HEAD,)
    return not layout.list_depth and roles == order


_PAGING_ROLES = frozenset((Role.LAYER, Role.BLOCK, Role.TOKEN, Role.HEAD))


@functools.cache
def _host_pools() -> tuple[EngineKVFormat, ...]:
    """The host pools as SGLang allocates them: its bare formats but those that read a
    folded pool in pages (reached by ``tokens_per_block``, never by a tensor's shape: an
    MLA pool in pages ``[NL, NB, BS, 1, C]`` has an MHA pool's rank)."""
    bare = [f for f in engine_formats(ENGINE) if not LAYOUTS[f].list_depth]
    in_pages = {unfolded_twin(ENGINE, f) for f in bare if LAYOUTS[f].is_pbs_fused}
    return tuple(f for f in bare if f not in in_pages)


def _host_pool(kv: torch.Tensor, p: Probe, hints: LayoutHints) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    """A HiCache host pool's ``kv_buffer`` in the layout ``hicache_layout`` names."""
    name = hints.hicache_layout
    assert name is not None
    order = _HOST_ORDERS[name]
    where = f"SGLang HiCache host pool (hicache_layout={name})"
    if hints.kv_list_layout is not None:
        raise LayoutHintError(
            f"{where}: layout hint kv_list_layout={hints.kv_list_layout} says how a device pool lists its "
            "layers; a host pool is one tensor"
        )
    indexer = _host_indexer(kv, p, name, hints.tokens_per_block, where)
    if indexer is not None:
        return indexer
    if name == "layer_first" and _hisparse_host(p):
        kv = kv.unsqueeze(2)  # its rows are MLA host rows without the pool's head axis of 1
        p = probe(kv)
    pools = [f for f in _host_pools() if _is_host_order(LAYOUTS[f], order) and not LAYOUTS[f].is_indexer]
    if name in _MLA_ONLY_HOST_LAYOUTS:
        pools = [f for f in pools if LAYOUTS[f].is_mla]
    shapes = " or ".join(LAYOUTS[f].describe_shape() for f in pools)
    if name in _INDEXER_ORDERS:
        shapes += " (a DSA indexer pool: uint8 pages of page_size records, given tokens_per_block)"
    if not any(LAYOUTS[f].is_mla for f in pools):
        shapes += f" (an MLA pool has no {name} layout)"
    if name in _MLA_ONLY_HOST_LAYOUTS:
        shapes += (
            f" (Ascend's MLA host pool: k_buffer, its kv_buffer, and v_buffer each such a tensor, read one "
            f"apart from the other; an MHA pool has no {name} layout)"
        )
    expected = f"{where}: kv_buffer is {shapes}, not {p.describe()}"
    if p.rank == 5 and p.first.dtype == torch.float32 and p.shape[1] == 2:
        expected += _NOT_DYNAMIC_FP8_HOST_SCALES
    if all(LAYOUTS[f].tensor_rank != p.rank for f in pools):
        raise DetectionError(expected)
    try:
        fmt = pick(ENGINE, p, formats=pools)
    except DetectionError as exc:
        raise DetectionError(f"{expected} ({exc})") from None
    layout = LAYOUTS[fmt]
    if (
        hints.kv_layout is not None
        and layout.axis_of(Role.HEAD) is not None
        and hints.is_hnd != layout.is_hnd
    ):
        heads = "before" if layout.is_hnd else "after"
        raise LayoutHintError(
            f"{where}: layout hint kv_layout={hints.kv_layout} contradicts it: its heads are {heads} its "
            f"tokens ({layout.describe_shape()})"
        )
    if hints.tokens_per_block is None or not LAYOUTS[fmt].is_pbs_fused:
        return fmt, kv
    return _unfolded(kv, p, fmt, hints.tokens_per_block, where)


def _hisparse_host(p: Probe) -> bool:
    """Whether the one tensor is DeepSeek-V4's HiSparse host pool, uint8 ``[NL, slots, 584]``
    (``DeepSeekV4SingleKVPoolHost.init_kv_buffer``): a 584-byte row is no DSA indexer page
    (no multiple of 132 or 68 bytes), so nothing else reads it."""
    return p.rank == 3 and p.first.dtype == torch.uint8 and p.shape[-1] == _DSV4_TOKEN_BYTES


def _host_indexer(
    kv: torch.Tensor, p: Probe, name: str, tpb: int | None, where: str
) -> tuple[EngineKVFormat, DiscoverableKVCache] | None:
    """A DSA indexer host pool in layout ``name`` re-viewed as its blocked-scale format's
    tensor: uint8, two leading axes (a third of size 1 after them), rows of ``tpb``
    records; None for any other pool."""
    order = _INDEXER_ORDERS.get(name)
    if order is None or tpb is None or p.first.dtype != torch.uint8 or p.rank not in (3, 4):
        return None
    if p.rank == 4 and p.shape[2] != 1:
        return None
    for fmt in _host_pools():
        layout = LAYOUTS[fmt]
        if (
            not layout.is_indexer
            or not _is_host_order(layout, order)
            or p.shape[-1] != tpb * _record_width(layout)
        ):
            continue
        outer, inner = layout.role_order((Role.LAYER, Role.BLOCK))  # the pool's two leading axes
        sizes = sizes_by_role(layout, {outer: p.shape[0], inner: p.shape[1], Role.TOKEN: tpb})
        if not kv.is_contiguous():
            raise DetectionError(f"{where}: a DSA indexer pool with padded rows cannot be split into records")
        return fmt, kv.view(layout.tensor_shape(sizes))
    return None


def _unfolded(
    kv: Any, p: Probe, fmt: EngineKVFormat, tpb: int, where: str | None = None
) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    """A folded format's registration as its unfolded twin, each page buffer split into
    blocks of ``tpb`` tokens (``where`` names the buffers in messages: the probe's words
    by default)."""
    twin = unfolded_twin(ENGINE, fmt)
    where = where or f"SGLang: {p.describe()}"
    padded = DetectionError(
        f"{where}: a page buffer with padded rows cannot be split into blocks by tokens_per_block (the "
        "token rows would keep the padding)"
    )
    if tpb != 1 and not all(t.is_contiguous() for _, t in leaves(kv)):
        raise padded  # blocks of one row keep any row stride: SGLang's unified Mamba pool
    try:
        shape = unfold_shape(LAYOUTS[fmt], LAYOUTS[twin], p.shape, tpb)
    except DetectionError as exc:
        raise DetectionError(f"{where}: {exc}") from None
    try:
        return twin, map_leaves(kv, lambda t: t.view(shape))
    except RuntimeError:
        raise padded from None


def _page_major(
    kv: list[Any], p: Probe, hints: LayoutHints
) -> tuple[EngineKVFormat, DiscoverableKVCache] | None:
    """SGLang's page-major MLA pool (``layout/page_major.py``, ``build_page_major_mla_views``):
    per-layer views ``[pages, page_size, 1, C]`` over one buffer, a page's latents of every
    layer in one envelope (the views' page stride), layer L's rows ``L * page_size`` rows
    into it. Each view is the folded MLA pool's page buffer ``[NB*BS, 1, C]`` split into
    pages, so it reads as that pool read in pages (its unfolded twin), the block stride
    the envelope; ``tokens_per_block``, if given, must be the views' page_size. None for
    4-D views that are no such pool (the caller says what a flat list is)."""
    pages, page_size, *row = p.shape
    folded_shape = (pages * page_size, *row)
    fmt = match(
        ENGINE, p, shape=folded_shape, only=lambda s: LAYOUTS[s.fmt].is_mla and LAYOUTS[s.fmt].is_pbs_fused
    )
    if fmt is None:
        return None
    tpb = hints.tokens_per_block
    if tpb is not None and tpb != page_size:
        raise LayoutHintError(
            f"SGLang page-major MLA pool {p.describe()}: layout hint tokens_per_block={tpb} contradicts its "
            f"views' page_size {page_size}"
        )
    twin = unfolded_twin(ENGINE, fmt)
    shape = unfold_shape(LAYOUTS[fmt], LAYOUTS[twin], folded_shape, page_size)
    return twin, [t.view(shape) for t in kv]  # drops the one-head axis: any strides view so


def _k_v_sides(kv: list[Any], hints: LayoutHints) -> tuple[list[Any], list[Any]] | None:
    """The K layers and the V layers of a K/V registration: two lists, or a flat ``k_v``
    list split in halves; None for any other registration."""
    if len(kv) == 2 and all(isinstance(side, (list, tuple)) for side in kv):
        return list(kv[0]), list(kv[1])
    if hints.kv_list_layout == "k_v" and len(kv) % 2 == 0:
        return kv[: len(kv) // 2], kv[len(kv) // 2 :]
    return None


def _head_sizes_differ(k: Any, v: Any) -> bool:
    return (
        isinstance(k, torch.Tensor)
        and isinstance(v, torch.Tensor)
        and k.dim() == v.dim() >= 2
        and k.shape[:-1] == v.shape[:-1]
        and k.shape[-1] != v.shape[-1]
    )


def _mixed_pair(kv: list[Any], hints: LayoutHints) -> tuple[Any, Any] | None:
    """The first (K, V) layer whose head sizes differ, where every entry is a tensor."""
    sides = _k_v_sides(kv, hints)
    if sides is None or not all(isinstance(t, torch.Tensor) for side in sides for t in side):
        return None  # validation names what is not a tensor
    return next(((k, v) for k, v in zip(*sides, strict=False) if _head_sizes_differ(k, v)), None)


def _head_sizes(k: torch.Tensor, v: torch.Tensor) -> str:
    return (
        f"SGLang: K layers {list(k.shape)} and V layers {list(v.shape)} differ in head size "
        f"({k.shape[-1]} and {v.shape[-1]}: v_head_dim != head_dim); a layout holds K and V of one "
        "head size, so they are served apart"
    )


def refuse_mixed(kv: list[Any], hints: LayoutHints) -> None:
    """Layers of different shapes, before they are detected apart (the registry's hook).
    ``MHATokenToKVPool(v_head_dim=...)`` (MiMo-V2's K of 192 and V of 128, say) gives
    K and V page buffers of different row widths; one layout holds K and V of one head
    size, so they are served apart (:func:`split_mixed`, which ``detect`` asks first),
    never misread as layers of mismatched shapes."""
    mixed = _mixed_pair(kv, hints)
    if mixed is not None:
        k, _ = mixed
        heads, bs = k.shape[-2], hints.tokens_per_block or "page_size"
        raise DetectionError(
            f"{_head_sizes(*mixed)}: kvlayout.detect reads them as two kernel groups, K then V, given "
            "tokens_per_block (SGLang's page_size); or register each on its own as components: "
            f"detect([t.view(-1, {bs}, {heads}, t.shape[-1]) for t in buffers], 'sglang', "
            "{'kv_list_layout': 'unified'}) for the K buffers, and again for the V buffers"
        )


def split_mixed(kv: list[Any], hints: LayoutHints) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """K and V of different head sizes (:func:`refuse_mixed`'s case) as the unified
    connector's components ``[NB, BS, NH, HS]``: the K layers' views and the V layers',
    which ``detect`` serves as two kernel groups (the registry's hook). None where the
    registration is no such mixture; a :class:`DetectionError` naming what stops the
    split where it is one (no ``tokens_per_block``, a layer unlike the others, lists of
    other lengths, a page buffer that does not split into pages)."""
    mixed = _mixed_pair(kv, hints)
    if mixed is None:
        return None
    k, v = _k_v_sides(kv, hints) or ([], [])
    if len(k) != len(v):
        raise DetectionError(f"{_head_sizes(*mixed)}, but there are {len(k)} K layers and {len(v)} V")
    sides = []
    for name, buffers in (("K", k), ("V", v)):
        first = buffers[0]
        unlike = next((i for i, t in enumerate(buffers) if not _alike(t, first)), None)
        if unlike is not None:
            t = buffers[unlike]
            raise DetectionError(
                f"{_head_sizes(*mixed)}: layer {unlike}'s {name} is {list(t.shape)} {t.dtype} on {t.device}, "
                f"layer 0's {list(first.shape)} {first.dtype} on {first.device}; a kernel group's layers "
                "are alike"
            )
        if first.dim() == 4:  # already [NB, BS, NH, HS] (the MP daemon's), or Ascend FIA's token rows
            fmt = pick(
                ENGINE, probe(buffers), decide=[("kv_list_layout", "is_pbs_fused", False), _order(hints)]
            )
            where = functools.partial(str, f"{_head_sizes(*mixed)}: {name} layers {list(first.shape)}")
            sides.append(
                list(token_rows_in_blocks(ENGINE, fmt, list(buffers), hints.tokens_per_block, where))
            )
            continue
        bs = hints.tokens_per_block
        if bs is None:
            raise DetectionError(f"{_head_sizes(*mixed)}: as two kernel groups, which needs tokens_per_block "
                                 "(SGLang's page_size) to split the page buffers into blocks")  # fmt: skip
        # the side unfolded as the pool's own format unfolds (a K/V list of the side twice)
        pair = [buffers, buffers]
        p = probe(pair)
        fmt = pick(ENGINE, p, decide=[("kv_list_layout", "is_pbs_fused", True), _order(hints)])
        _, unfolded = _unfolded(pair, p, fmt, bs, f"{_head_sizes(*mixed)}: {name} layers {list(first.shape)}")
        sides.append(list(unfolded[0]))
    return sides[0], sides[1]


def _alike(t: Any, first: torch.Tensor) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.shape == first.shape
        and t.dtype == first.dtype
        and t.device == first.device
    )


def _unified(kv: Any, p: Probe, hints: LayoutHints) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    if p.depth != 1:
        raise DetectionError(
            f"SGLang kv_list_layout='unified' expects a flat list of component tensors ({p.describe()})"
        )
    return pick(ENGINE, p, decide=[("kv_list_layout", "is_pbs_fused", False), _order(hints)]), kv


def _indexers(p: Probe) -> list[EngineKVFormat]:
    """The device indexer formats of the probe's list depth (the host pools' are bare)."""
    return [f for f in engine_formats(ENGINE) if LAYOUTS[f].is_indexer and LAYOUTS[f].list_depth == p.depth]


def _stores_records(layout: Layout, dtype: torch.dtype) -> bool:
    """Whether a tensor of ``dtype`` holds the layout's records: a run of regions of one
    dtype is stored in it (SGLang's bf16 index keys), a run of several in bytes (uint8:
    fp8 values, then float32 scales)."""
    held = set(algebra.structure(layout).region_dtypes)
    if len(held) == 1 and None not in held:
        return str(dtype).removeprefix("torch.") == next(iter(held))
    return dtype == torch.uint8


def _indexer(kv: list[Any], p: Probe, hints: LayoutHints) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    """DSA indexer pages ``[pages, BS * W]`` re-viewed as a blocked-scale format's leaves:
    uint8 records of fp8 keys and their scale, or bf16 keys without one (read as their
    bytes: a region's width counts bytes)."""
    padded = DetectionError(
        f"SGLang: {p.describe()}: an indexer page with padded rows cannot be split into its tokens' records"
    )
    try:
        raw = [t.view(torch.uint8) for t in kv]
    except RuntimeError:
        raise padded from None
    q = probe(raw)
    widths: list[int] = []
    found: list[tuple[EngineKVFormat, tuple[int, ...], int]] = []  # format, page shape, page size
    for fmt in _indexers(p):
        layout = LAYOUTS[fmt]
        if not _stores_records(layout, p.first.dtype):
            continue
        width = _record_width(layout)
        widths.append(width)
        pages, row = q.shape
        if row == 0 or row % width:
            continue
        shape = layout.tensor_shape(sizes_by_role(layout, {Role.BLOCK: pages, Role.TOKEN: row // width}))
        if match(ENGINE, q, shape=shape, only=lambda s, f=fmt: s.fmt is f) is not None:  # type: ignore[misc]
            found.append((fmt, shape, row // width))
    tpb = hints.tokens_per_block
    if found and tpb is not None:
        # a row that is page_size records of either width (the FP8 and the FP4 indexer's) is
        # read at the page_size the pool has
        fits = [entry for entry in found if entry[2] == tpb]
        if not fits:
            readings = " or ".join(f"{n} records of {LAYOUTS[f].name}" for f, _, n in found)
            raise LayoutHintError(
                f"SGLang: {p.describe()}: layout hint tokens_per_block={tpb} contradicts its indexer row, "
                f"which is {readings}{_NOT_FLASHMLA if p.first.dtype == torch.uint8 else ''}"
                f"{_NOT_DSV4_UNIFIED if _dsv4_unified_row(p) else ''}"
            )
        found = fits
    elif tpb is None and _another_pools_row(p, q.shape[1]):
        found = []  # only the page_size (tokens_per_block) tells which the row is
    if len(found) != 1:
        what = _why_no_indexer_reading(p, q.shape[1], widths, several=bool(found))
        dtype = str(p.first.dtype).removeprefix("torch.")
        raise DetectionError(
            f"SGLang: {p.describe()}: a flat list of 2-D {dtype} tensors is a DSA indexer cache [pages, "
            f"page_size * W] (W = {' or '.join(map(str, widths)) or 'none'} bytes), but its row {what}"
            f"{_NOT_FLASHMLA + _NOT_AITER_FP4_INDEXER + _NOT_DSV4_STATE if dtype == 'uint8' else ''}; a "
            "buffer of a row per "
            "token slot (an FP4 MLA "
            "pool's kv_scale_buffer [size + page_size, C // 16]) reads as MLA page buffers: pass "
            "[t.unsqueeze(1) for t in buffers]"
            f"{_NOT_FP4_MHA_SCALES if dtype == 'uint8' and hints.kv_list_layout == 'k_v' else ''}"
            f"{_NOT_DSV4_UNIFIED_FP8 if _dsv4_unified_fp8_row(p) else ''}"
        )
    fmt, shape, _ = found[0]
    if not all(t.is_contiguous() for t in raw):
        raise padded
    return fmt, [t.view(shape) for t in raw]


def _another_pools_row(p: Probe, row: int) -> bool:
    """Whether a row of whole indexer records is also a DeepSeek-V4 KV pool's: a FlashMLA
    page padded to 576 bytes (page_size 16: 9792 bytes, 144 records of 68; 32: 19008, 144
    of 132; SGLang's indexer pages hold 64, 128 or 1 tokens, and only a page of a multiple
    of 48 records is so aligned), a V4.1 FlashMLA page (page_size 32: 16896 bytes, 128
    records of 132; 16: 8704, 128 of 68, where an indexer page of 128 tokens is the same
    size), or a unified KV pool's bf16 token row (4 bf16 indexer records)."""
    if p.first.dtype == torch.uint8:
        return row % _FLASHMLA_PAGE_ALIGN == 0 or bool(_flashmla_pages(row))
    return _dsv4_unified_row(p)


def _why_no_indexer_reading(p: Probe, row: int, widths: list[int], *, several: bool) -> str:
    """Why a flat list of 2-D tensors of ``row`` bytes a page is read as no one indexer."""
    if several:
        return "fits several formats: pass layout hint tokens_per_block (the pool's page_size)"
    records = " or ".join(str(row // w) for w in widths if row % w == 0)
    if _dsv4_unified_row(p):
        return (
            f"is a DeepSeek-V4 unified KV pool's token row and also an indexer page of {records} tokens: "
            f"for that indexer, pass layout hint tokens_per_block{_NOT_DSV4_UNIFIED}"
        )
    if all(row % width for width in widths):
        return "is not a positive multiple of any record width"
    if row % _FLASHMLA_PAGE_ALIGN == 0:
        return (
            f"is padded to a multiple of {_FLASHMLA_PAGE_ALIGN} bytes (for an indexer page of such a "
            "page_size, pass layout hint tokens_per_block)"
        )
    flashmla = ", ".join(f"{name} at page_size {ps}" for name, ps in _flashmla_pages(row))
    return (
        f"is a DeepSeek-V4.1 FlashMLA page's size ({flashmla}) and also an indexer page of {records} "
        "tokens (SGLang's DeepSeek-V4.1 indexer pages hold 128 under DeepGEMM's paged MQA logits): for "
        "that indexer, pass layout hint tokens_per_block"
    )


def _dsv4_unified_row(p: Probe) -> bool:
    """Whether the probe's 2-D leaves have DeepSeek-V4's unified KV row (bf16, 512 wide)."""
    return p.first.dtype == torch.bfloat16 and p.shape[-1] == DSV4_HEAD_DIM


def _dsv4_unified_fp8_row(p: Probe) -> bool:
    """Whether the probe's 2-D leaves have a row of the unified pool's FP8 two-pool form: its
    FP8 NoPE (float8_e4m3fn, 512 wide) or its RoPE (bf16, 64 wide)."""
    if p.rank != 2:
        return False
    return (p.first.dtype, p.shape[-1]) in (
        (torch.float8_e4m3fn, DSV4_HEAD_DIM),
        (torch.bfloat16, DSV4_ROPE_DIM),
    )


def _flashmla_pages(row: int) -> list[tuple[str, int]]:
    """The FlashMLA layouts and page sizes whose page is ``row`` bytes. SGLang's page sizes
    are powers of two; at others a layout's page can be any indexer page's size (V4.1
    FP4's of 29 slots is 8448 bytes, the 64-token FP8 indexer page)."""
    pages = []
    for name in FLASHMLA_LAYOUTS:
        ps = 1
        while flashmla_page_bytes(name, ps) <= row:
            if flashmla_page_bytes(name, ps) == row:
                pages.append((name, ps))
            ps *= 2
    return pages


def _record_width(layout: Layout) -> int:
    """Elements of one token's record in a blocked-scale page (the region run's width)."""
    axis = layout.axis_of(Role.REGION)
    assert axis is not None
    return layout.tensor_shape(sizes_by_role(layout, {Role.LAYER: 1, Role.BLOCK: 1, Role.TOKEN: 1}))[axis]
