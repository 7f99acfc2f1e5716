"""SGLang's FP4 MHA pool's block scales (``--kv-cache-dtype nvfp4`` or ``fp4_mx_block16``),
device and HiCache host, as registrations.

The FP4 pool keeps each layer's K and V as packed e2m1 pairs, uint8 ``[size + page_size,
H, D // 2]`` (read as any MHA pool's page buffers), and one scale byte per 16 elements of a
head's row (``sf = D // 16`` a head: float8_e4m3fn under NVFP4, UE8M0 under
``fp4_mx_block16``, stored uint8) in buffers its P/D registers (``get_kv_scale_buf_infos``)
and its HiCache host pool (``MHATokenToKVPoolFP4Host``, ``pool_host/mha_fp4.py``) moves a
page at a time. Two device layouts:

* Linear (``k_scale_buffer`` / ``v_scale_buffer``, what FlashInfer and XQA read): a slot's
  scales a row, ``[size + page_size, H, sf]`` (``NVFP4KVCacheMethod.create_buffers``) or
  flattened ``[size + page_size, H * sf]`` (``fp4_mx_block16``, the older
  ``MHATokenToKVPoolFP4``), head by head: ``k_scale_buffer[l][loc] = sf`` of the token's
  heads. Read as the pool's own page buffers, ``NL_X_NB_BS_NH_HS`` in blocks of
  ``page_size`` slots, token by token, sharded by heads.
* TRT-LLM's native layout (``native_k_scale_buffer`` / ``native_v_scale_buffer``, what
  trtllm_mha's decode reads, ``nvfp4_kv_cache.store_nvfp4_kv_cache``): ``[pages, H,
  page_size, sf]``, token ``off`` of page ``p``'s K scales at ``[p, h, off]``; V's are
  interleaved over groups of 4 tokens, scale ``j`` of token ``off`` at ``[p, h, off // 4 * 4
  + j // (sf // 4), j % (sf // 4) * 4 + off % 4]`` (``nvfp4_v_scale_swizzle_indices``), so
  no token-level format reads a V page: both are read as whole opaque pages, heads
  outermost (a TP-sharded array of the model's KV heads), K's and V's apart.

The host pool keeps one uint8 ``[page_num, layer_num, page bytes]`` tensor per device scale
buffer (``_scale_host_<name>``), a device page's bytes (``buf.view(uint8).reshape(-1, page
bytes)[page]``) at ``[host_page, layer]``, both ways: a linear page is its ``page_size``
slot rows, token by token, a native page the device's page, opaque.
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
    "FP4_SCALE_BLOCK",
    "FP4_V_SCALE_TOKEN_GROUP",
    "Fp4ScaleError",
    "fp4_host_scale_pools",
    "fp4_scale_pools",
]

FP4_SCALE_BLOCK = 16
"""Elements of a head's row that one scale byte covers (``SCALE_BLOCK_SIZE``)."""
FP4_V_SCALE_TOKEN_GROUP = 4
"""Tokens whose V scales TRT-LLM's native layout interleaves (``nvfp4_v_scale_swizzle_indices``)."""

_ORIGIN = (
    "SGLang's FP4 MHA pool's k_scale_buffer / v_scale_buffer or native_k_scale_buffer / native_v_scale_buffer"
)
_DTYPES = (torch.uint8, torch.float8_e4m3fn, torch.float8_e8m0fnu)
_ADVICE = (
    "SGLang moves a native (TRT-LLM) FP4 scale page whole; it maps only to a native page of the same kind "
    "(K or V), head size and page_size, and between TP degrees by its heads (give src_shard and dst_shard)"
)
_HOST = "MHATokenToKVPoolFP4Host"


class Fp4ScaleError(DetectionError):
    """Lists or tensors that are not an SGLang FP4 pool's scale buffers."""


def _native_page(kind: str, heads: int, page_size: int, sf: int) -> OpaquePages:
    """What a native scale page of ``kind`` (``"K"`` or ``"V"``) holds, the device pool's
    and the host pool's alike: ``heads`` tiles of ``page_size`` tokens' ``sf`` scales."""
    group = FP4_V_SCALE_TOKEN_GROUP
    # K's tile is [page_size, sf], token rows; V's [page_size // 4, 4 * sf], its interleaved
    # 4-token groups: arrays of other shapes, so a K page never maps to a V page
    tile = (heads, page_size, sf) if kind == "K" else (heads, page_size // group, group * sf)
    order = (
        "token off at [off]"
        if kind == "K"
        else f"scale j of token off at [off // {group} * {group} + j // {sf // group}, "
        f"j % {sf // group} * {group} + off % {group}] (4-token interleave)"
    )
    return OpaquePages(
        f"SGLang FP4 {kind} scale page, TRT-LLM native: H {heads}, then [{page_size}, {sf}], {order}, "
        f"{sf} scale bytes a token (head size {sf * FP4_SCALE_BLOCK})",
        rows_are_tokens=False,
        arrays=(PageArray(0, tile, "uint8", 0, (heads,), kv_heads=True),),
        advice=_ADVICE,
    )


def _check_native(what: str, shape: list[int], page_size: int, heads: int, sf: int) -> None:
    if sf % FP4_V_SCALE_TOKEN_GROUP or page_size % FP4_V_SCALE_TOKEN_GROUP:
        raise Fp4ScaleError(
            f"{what} is {shape}: a native scale page of page_size={page_size} tokens of {sf} scales a head, "
            f"where SGLang's native layout needs both multiples of {FP4_V_SCALE_TOKEN_GROUP} "
            "(store_nvfp4_kv_cache: head_dim a multiple of 64)"
        )


def _device_layers(name: str, buffers: Any) -> list[torch.Tensor]:
    layers = layer_list(name, buffers, _ORIGIN, Fp4ScaleError)
    first = layers[0]
    if first.dtype not in _DTYPES:
        raise Fp4ScaleError(
            f"{name}[0] is {first.dtype}, not FP4 block scales (uint8, as SGLang allocates them, or their "
            "float8_e4m3fn / float8_e8m0fnu view)"
        )
    if first.dim() not in (2, 3, 4) or first.numel() == 0:
        raise Fp4ScaleError(
            f"{name}[0] is {list(first.shape)}, not linear [slots, H, sf] or [slots, H * sf], nor native "
            "[pages, H, page_size, sf], holding scales"
        )
    return [t.view(torch.uint8) for t in layers]


def _linear(name: str, layers: list[torch.Tensor], page_size: int, heads: int) -> Registration:
    """Slot rows in blocks of ``page_size`` slots, token by token: ``[pages, page_size, H, sf]``."""
    t = layers[0]
    shape = list(t.shape)
    slots, row = shape[0], (shape[1] * shape[2] if t.dim() == 3 else shape[1])
    if (t.dim() == 3 and shape[1] != heads) or row % heads:
        raise Fp4ScaleError(
            f"{name}[0] is {shape}: no slot rows of head_num={heads} heads' scales (pass the device pool's "
            "head_num, the rank's KV heads)"
        )
    if slots % page_size:
        raise Fp4ScaleError(
            f"{name}[0] is {shape}: {slots} slots, not whole pages of page_size={page_size} (SGLang's size + "
            "page_size slots)"
        )
    sf = row // heads
    for i, x in enumerate(layers):
        if x.stride() != ((row, sf, 1) if x.dim() == 3 else (row, 1)):
            raise Fp4ScaleError(
                f"{name}[{i}] {list(x.shape)} (strides {list(x.stride())}) is not slot rows one after "
                "another, as SGLang allocates them"
            )
    views = [x.view(slots // page_size, page_size, heads, sf) for x in layers]
    return detect(views, EngineType.SGLANG, {"kv_list_layout": "unified"})


def _native(name: str, layers: list[torch.Tensor], page_size: int, heads: int) -> Registration:
    """Whole pages ``[H, page_size, sf]``, heads outermost, as opaque pages."""
    t = layers[0]
    _, h, tokens, sf = (int(n) for n in t.shape)
    if (h, tokens) != (heads, page_size):
        raise Fp4ScaleError(
            f"{name}[0] is {list(t.shape)}, not native [pages, head_num={heads}, page_size={page_size}, sf]: "
            "pass the device pool's own head_num and page_size"
        )
    _check_native(f"{name}[0]", list(t.shape), page_size, heads, sf)
    page = _native_page(name[0].upper(), heads, page_size, sf)
    rows = [page_rows(f"{name}[{i}]", x, page_size, "SGLang", Fp4ScaleError) for i, x in enumerate(layers)]
    return listed_pages(rows, page, layers, page_size, EngineType.SGLANG)


def fp4_scale_pools(
    k_scale_buffer: Any, v_scale_buffer: Any, page_size: int, head_num: int
) -> dict[str, Registration]:
    """SGLang's FP4 pool's K and V scale buffers (per-layer lists: ``k_scale_buffer`` and
    ``v_scale_buffer``, or ``native_k_scale_buffer`` and ``native_v_scale_buffer``) as one
    registration each, ``{"k": ..., "v": ...}``; block ids are SGLang's page indices (page
    0 its padding page), ``page_size`` and ``head_num`` (the rank's KV heads) the pool's.

    Linear scales (``[slots, H, sf]`` or ``[slots, H * sf]``) read token by token, as the
    pool's K and V page buffers do (so also to and from another page size and, by heads,
    another TP degree). Native scales (``[pages, H, page_size, sf]``) are whole opaque
    pages: a page moves whole (``num_tokens`` rounds up to whole pages), only to a native
    page of the same kind, head size and page_size, and between ranks of two TP degrees
    (given ``src_shard`` and ``dst_shard``) by the heads both hold. Raises
    :class:`Fp4ScaleError` for lists that are no such buffers."""
    ps = positive(page_size, "page_size", "the pool's page_size", Fp4ScaleError)
    heads = positive(head_num, "head_num", "the pool's KV heads on this rank", Fp4ScaleError)
    names = ("k_scale_buffer", "v_scale_buffer")
    k, v = (_device_layers(n, b) for n, b in zip(names, (k_scale_buffer, v_scale_buffer), strict=True))
    if len(k) != len(v):
        raise Fp4ScaleError(f"{names[0]} has {len(k)} layers and {names[1]} {len(v)}: one per layer each")
    if (k[0].dim(), k[0].device) != (v[0].dim(), v[0].device):
        raise Fp4ScaleError(
            f"{names[0]}[0] is {list(k[0].shape)} on {k[0].device} and {names[1]}[0] {list(v[0].shape)} on "
            f"{v[0].device}: one pool's scales, in one layout on one device, expected"
        )
    read = _native if k[0].dim() == 4 else _linear
    return {"k": read(names[0], k, ps, heads), "v": read(names[1], v, ps, heads)}


def fp4_host_scale_pools(
    k_scale_host: Any, v_scale_host: Any, page_size: int, head_num: int, *, native: bool
) -> dict[str, Registration]:
    """The scales of SGLang's FP4 HiCache host pool (``MHATokenToKVPoolFP4Host``: uint8
    ``[pages, NL, page bytes]``, one per device scale buffer, a device page's bytes of
    every layer a host page) as one registration each, ``{"k": ..., "v": ...}``, block ids
    host page indices. ``native`` says which device buffers they back up: False for
    ``k_scale_buffer`` / ``v_scale_buffer`` (linear: a page is its slots' rows, read token
    by token, as :func:`fp4_scale_pools` reads the device's), True for
    ``native_k_scale_buffer`` / ``native_v_scale_buffer`` (TRT-LLM's: whole opaque pages,
    as the device's). A block map moves a request's pages between the device pool and the
    host pool. ``page_size`` and ``head_num`` (the rank's KV heads) are the device pool's,
    which the host pool's bytes cannot say. Raises :class:`Fp4ScaleError` for anything
    else."""
    ps = positive(page_size, "page_size", "the device pool's page_size", Fp4ScaleError)
    heads = positive(head_num, "head_num", "the device pool's KV heads on this rank", Fp4ScaleError)
    if not isinstance(native, bool):
        raise Fp4ScaleError(
            f"native must be a bool (True: the host pool of native_k_scale_buffer / native_v_scale_buffer), "
            f"not {native!r}"
        )
    pairs = (("k_scale_host", k_scale_host), ("v_scale_host", v_scale_host))
    both = all(isinstance(host, torch.Tensor) and host.dim() == 3 for _, host in pairs)
    if both and k_scale_host.shape != v_scale_host.shape:
        raise Fp4ScaleError(
            f"k_scale_host is {list(k_scale_host.shape)} and v_scale_host {list(v_scale_host.shape)}: "
            "one host pool's K and V scales, of its page_num pages of layer_num layers each, expected "
            f"({_HOST})"
        )
    pools = {}
    for name, host in pairs:
        layers, sf = host_page_layers(name, host, ps, heads, _HOST, "scale page", Fp4ScaleError)
        kind = name[0].upper()
        if native:
            _check_native(name, list(host.shape), ps, heads, sf)
            # a layer's pages lie NL pages apart: views [pages, page_size, 1, row] at that
            # stride, read as page-major views (their page stride an envelope of every layer's)
            rows = [t.view(torch.int8).view(t.shape[0], ps, 1, t.shape[1] // ps) for t in layers]
            pools[name[0]] = listed_pages(
                rows, _native_page(kind, heads, ps, sf), layers, ps, EngineType.SGLANG
            )
        else:
            views = [t.view(t.shape[0], ps, heads, sf) for t in layers]
            pools[name[0]] = detect(views, EngineType.SGLANG, {"kv_list_layout": "unified"})
    return pools
