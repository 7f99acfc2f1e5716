"""SGLang's MXFP8 KV pool's scale buffers (``MHATokenToKVPoolMXFP8``), as registrations.

``--kv-cache-dtype mxfp8`` makes SGLang's MHA pool hold each layer's K and V as
``float8_e4m3fn`` ``[size + page_size, H, D]`` (read as any MHA pool's page buffers) and,
beside them, one UE8M0 scale (``float8_e8m0fnu``) per 32 elements of a head's row in
``k_scale_buffer`` and ``v_scale_buffer`` (``D // 32`` and ``D_v // 32`` a head), which its
P/D registers too (``get_kv_scale_buf_infos``: K's layers, then V's; an item a page) and
its HiCache host pool moves a page at a time (``MHATokenToKVPoolMXFP8Host``). Two layouts:

* At ``page_size == 128`` (``mxfp8_sf_interleaved``, the layout its FA4 kernel reads and
  the only one its host pool and fused store take): ``[pages, H, 32, page_size // 32,
  sf]`` per layer, FA4's ``BlockScaledBasicChunk`` atom: the scales of the page's token
  ``off`` lie at ``[page, h, off % 32, off // 32]`` (``_read_sf_interleaved``, the inverse
  of ``store_sf_interleaved``). A token's scales are scattered over its head's tile, so
  no token-level format reads them: a page is read whole, opaque, its heads outermost (a
  TP-sharded array of the model's KV heads), as SGLang moves it (an item is a page row).
* At any other page_size, flat ``[size + page_size, H, sf]``, a slot's scales a row
  (``_write_scales``: ``k_scale_buffer[idx][loc] = k_scale``): the layout of the pool's
  own page buffers, read as its component format ``NL_X_NB_BS_NH_HS`` in blocks of
  ``page_size`` slots, token by token.

:func:`mxfp8_scale_pools` reads either, K and V apart (their head sizes may differ).
"""

from __future__ import annotations

from typing import Any

import torch

from kvlayout._generated.engines import EngineType
from kvlayout.detection.base import DetectionError
from kvlayout.detection.discovery import detect
from kvlayout.errors import positive
from kvlayout.integrations.page_lists import host_page_layers, layer_list, listed_pages, page_rows
from kvlayout.registration.opaque import OpaquePages, PageArray
from kvlayout.registration.registration import Registration

__all__ = [
    "MXFP8_SCALE_BLOCK",
    "MXFP8_SCALE_TILE",
    "Mxfp8ScaleError",
    "mxfp8_host_scale_pools",
    "mxfp8_scale_pools",
]

MXFP8_SCALE_BLOCK = 32
"""Elements of a head's row that one UE8M0 scale covers (``MXFP8_SCALE_BLOCK_SIZE``)."""
MXFP8_SCALE_TILE = 32
"""Tokens of an interleaved tile's fast axis: token ``off`` of a page is at ``[off %
32, off // 32]`` (``BlockScaledBasicChunk``)."""

_ORIGIN = "SGLang's MHATokenToKVPoolMXFP8.k_scale_buffer / v_scale_buffer"
_ADVICE = (
    "SGLang moves an interleaved scale page whole (get_kv_scale_buf_infos: an item is a page row); it "
    "maps only to an interleaved page of the same kind (K or V), head size and page_size, and between TP "
    "degrees by its heads (give src_shard and dst_shard)"
)


class Mxfp8ScaleError(DetectionError):
    """Lists that are not an SGLang MXFP8 pool's scale buffers."""


def _scale_layers(name: str, buffers: Any) -> list[torch.Tensor]:
    layers = layer_list(name, buffers, _ORIGIN, Mxfp8ScaleError)
    first = layers[0]
    if first.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise Mxfp8ScaleError(
            f"{name}[0] is {first.dtype}, not UE8M0 scales (float8_e8m0fnu, as SGLang allocates them, or "
            "their uint8 bytes)"
        )
    if first.dim() not in (3, 5) or first.numel() == 0:
        raise Mxfp8ScaleError(
            f"{name}[0] is {list(first.shape)}, not [pages, H, 32, page_size // 32, sf] (page_size 128, "
            "interleaved) nor [slots, H, sf] (flat), holding scales"
        )
    return layers


def _scale_page(kind: str, heads: int, chunk: int, sf: int) -> OpaquePages:
    """What an interleaved scale page of ``kind`` (``"K"`` or ``"V"``) holds, the device
    pool's and the host pool's alike: ``heads`` tiles ``[32, chunk, sf]``."""
    dtype = "float8_e8m0fnu"  # the bytes, whether given as scales or as uint8
    # K's tile as [H, 32, page_size // 32, sf], V's as [H, 32, page_size // 32 * sf]: the same
    # bytes in arrays of other ranks on purpose, so a K page never maps to a V page (a map
    # compares the arrays a page declares), even where head_dim == v_head_dim
    tile = MXFP8_SCALE_TILE
    tile_shape = (heads, tile, chunk, sf) if kind == "K" else (heads, tile, chunk * sf)
    return OpaquePages(
        f"SGLang MXFP8 {kind} scale page, interleaved (BlockScaledBasicChunk): H {heads}, then token "
        f"off at [off % {tile}, off // {tile}] of [{tile}, {chunk}], {sf} UE8M0 scales a token (head size "
        f"{sf * MXFP8_SCALE_BLOCK})",
        rows_are_tokens=False,
        arrays=(PageArray(0, tile_shape, dtype, 0, (heads,), kv_heads=True),),
        advice=_ADVICE,
    )


def _interleaved(name: str, layers: list[torch.Tensor], page_size: int) -> Registration:
    """Whole pages ``[H, 32, page_size // 32, sf]``, heads outermost, as opaque pages."""
    t = layers[0]
    _, heads, tile, chunk, sf = (int(n) for n in t.shape)
    if (tile, tile * chunk) != (MXFP8_SCALE_TILE, page_size):
        raise Mxfp8ScaleError(
            f"{name}[0] is {list(t.shape)}, not [pages, H, {MXFP8_SCALE_TILE}, page_size // "
            f"{MXFP8_SCALE_TILE} = {page_size // MXFP8_SCALE_TILE}, sf] at page_size={page_size}: pass the "
            "pool's own page_size"
        )
    page = _scale_page(name[0].upper(), heads, chunk, sf)
    rows = [page_rows(f"{name}[{i}]", x, page_size, "SGLang", Mxfp8ScaleError) for i, x in enumerate(layers)]
    return listed_pages(rows, page, layers, page_size, EngineType.SGLANG)


def _flat(name: str, layers: list[torch.Tensor], page_size: int) -> Registration:
    """Slot rows ``[slots, H, sf]`` in blocks of ``page_size`` slots, token by token."""
    t = layers[0]
    slots, heads, sf = (int(n) for n in t.shape)
    if slots % page_size:
        raise Mxfp8ScaleError(
            f"{name}[0] is {list(t.shape)}: {slots} slots, not whole pages of page_size={page_size} "
            "(SGLang's size + page_size slots)"
        )
    try:
        views = [x.view(slots // page_size, page_size, heads, sf) for x in layers]
    except RuntimeError:
        raise Mxfp8ScaleError(
            f"{name}[0] {list(t.shape)} (strides {list(t.stride())}) is not slot rows one after another, "
            "as SGLang allocates them"
        ) from None
    return detect(views, EngineType.SGLANG, {"kv_list_layout": "unified"})


def mxfp8_scale_pools(k_scale_buffer: Any, v_scale_buffer: Any, page_size: int) -> dict[str, Registration]:
    """SGLang's MXFP8 pool's ``k_scale_buffer`` and ``v_scale_buffer`` (per-layer lists)
    as one registration each, ``{"k": ..., "v": ...}``; block ids are SGLang's page
    indices (page 0 its padding page), ``page_size`` the pool's.

    Interleaved scales (``[pages, H, 32, page_size // 32, sf]``, SGLang's layout at
    ``page_size == 128``) are whole opaque pages: a page moves whole (``num_tokens``
    rounds up to whole pages), only to an interleaved page of the same kind, head size and
    page_size, and between ranks of two TP degrees (given ``src_shard`` and ``dst_shard``)
    by the heads both hold. Flat scales (``[slots, H, sf]``, at any other page_size) read
    token by token, as the pool's K and V page buffers do (so also to and from another page
    size). Raises :class:`Mxfp8ScaleError` for lists that are no such buffers."""
    ps = positive(page_size, "page_size", "the pool's page_size", Mxfp8ScaleError)
    k, v = _scale_layers("k_scale_buffer", k_scale_buffer), _scale_layers("v_scale_buffer", v_scale_buffer)
    if len(k) != len(v):
        raise Mxfp8ScaleError(
            f"k_scale_buffer has {len(k)} layers and v_scale_buffer {len(v)}: one per layer each"
        )
    if (k[0].dim(), k[0].device) != (v[0].dim(), v[0].device):
        raise Mxfp8ScaleError(
            f"k_scale_buffer[0] is {list(k[0].shape)} on {k[0].device} and v_scale_buffer[0] "
            f"{list(v[0].shape)} on {v[0].device}: one pool's scales, in one layout on one device, expected"
        )
    read = _interleaved if k[0].dim() == 5 else _flat
    return {"k": read("k_scale_buffer", k, ps), "v": read("v_scale_buffer", v, ps)}


def mxfp8_host_scale_pools(
    k_scale_host: Any, v_scale_host: Any, page_size: int, head_num: int
) -> dict[str, Registration]:
    """The UE8M0 scales of SGLang's MXFP8 HiCache host pool (``MHATokenToKVPoolMXFP8Host``:
    ``k_scale_host`` and ``v_scale_host``, uint8 ``[pages, NL, page bytes]``, a device page
    row of every layer a host page, page_first like its payload) as one registration each,
    ``{"k": ..., "v": ...}``. Their pages are the interleaved device pages
    :func:`mxfp8_scale_pools` reads (SGLang copies a page row whole each way), so a block
    map moves a request's pages between the device pool and the host pool, whole, block
    ids page indices. ``page_size`` and ``head_num`` (the rank's KV heads) are the device
    pool's, which the host pool's bytes cannot say. Raises :class:`Mxfp8ScaleError` for
    anything else."""
    ps = positive(page_size, "page_size", "the device pool's page_size", Mxfp8ScaleError)
    heads = positive(head_num, "head_num", "the device pool's KV heads", Mxfp8ScaleError)
    pairs = (("k_scale_host", k_scale_host), ("v_scale_host", v_scale_host))
    if all(isinstance(host, torch.Tensor) and host.dim() == 3 for _, host in pairs):
        (k_pages, k_layers, _), (v_pages, v_layers, _) = (host.shape for _, host in pairs)
        if (k_pages, k_layers) != (v_pages, v_layers):
            raise Mxfp8ScaleError(
                f"k_scale_host is {list(k_scale_host.shape)} and v_scale_host {list(v_scale_host.shape)}: "
                "one host pool's scales, of its page_num pages of layer_num layers each, expected "
                "(MHATokenToKVPoolMXFP8Host)"
            )
    pools = {}
    for name, host in pairs:
        layers, sf = host_page_layers(
            name, host, ps, heads, "MHATokenToKVPoolMXFP8Host", "interleaved scale page", Mxfp8ScaleError
        )
        if ps % MXFP8_SCALE_TILE:
            raise Mxfp8ScaleError(
                f"{name} is {list(host.shape)}: no interleaved scale page of head_num={heads} heads and "
                f"page_size={ps} tokens (page_size a multiple of {MXFP8_SCALE_TILE})"
            )
        page = _scale_page(name[0].upper(), heads, ps // MXFP8_SCALE_TILE, sf)
        # a layer's pages lie NL pages apart: views [pages, page_size, 1, row] at that stride,
        # read as page-major views (their page stride an envelope of every layer's page)
        rows = [t.view(torch.int8).view(t.shape[0], ps, 1, t.shape[1] // ps) for t in layers]
        pools[name[0]] = listed_pages(rows, page, layers, ps, EngineType.SGLANG)
    return pools
