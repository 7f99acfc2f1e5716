"""Modular MAX: one cross-layer buffer ``[NB, KV, NL, BS, NH, HS]`` (a bare tensor, or a
one-element list of it); KV is 2 (K and V) or 1 (MLA, one latent plane). Under
``per_layer_buffers`` MAX allocates one single-layer buffer per layer instead (its
``values_per_layer``): a list of ``NL`` buffers ``[NB, KV, 1, BS, NH, HS]``.

MAX sends its sizes as hints (``num_layers``, ``kv_dim``, ``tokens_per_block`` and its
alias ``page_size``, ``num_kv_heads``, ``head_dim``, ``total_num_blocks``) and the
format's name as ``layout_format``: the buffer needs none of them, and every one given
is checked against it. LMCache's MAX branch reads no hints. MAX's ``page_size`` is the
tokens a page covers, and the buffer's BS axis its ``slots_per_page`` (``KVCacheParams.
shape_per_block``), fewer where attention caches one entry for each run of ``page_size //
slots_per_page`` tokens (a compressed latent or pooled key, MAX's DSA-style indexer): the
hint must be a multiple of the slots, and the registration's blocks are its slots, a
request's ``n`` tokens ``n // ratio`` entries (the ones MAX has written).

What MAX hands its own copy paths is no registration: ``KVCacheBuffer.to_memory()``
re-views each TP shard's buffer as ``[num_pages, bytes_per_page]`` uint8 (its
``_view_as_uint8_pages``), which its ``KVTransferEngine`` (NIXL descriptors ``base + page *
bytes_per_page``), its host tier (one row a page, the shards' bytes side by side) and dKV
copy whole. Such a view says nothing of what a page holds, and the buffer it views is
always at hand, so it is refused with that advice, as are tensors of different shapes (an
FP8 cache's values and scales, which ``all_buffers`` lists together).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvlayout._generated.formats import LAYOUTS, EngineKVFormat
from kvlayout.detection.base import DetectionError, pick, probe
from kvlayout.layout.vocabulary import Role
from kvlayout.registration.nesting import first_leaf
from kvlayout.types import DiscoverableKVCache, EngineType, LayoutHintError, LayoutHints

ENGINE = EngineType.MAX


def discover(kv: Any, hints: LayoutHints) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    _refuse_byte_pages(kv)
    if isinstance(kv, list):
        if any(isinstance(entry, list) for entry in kv):
            raise DetectionError(
                "MAX registers one KV buffer tensor [NB, KV, NL, BS, NH, HS], or a list of "
                "single-layer buffers [NB, KV, 1, BS, NH, HS] (per_layer_buffers), got a nested list"
            )
        if len(kv) == 1:
            kv = kv[0]  # the one buffer, whatever its layers
        elif hints.num_layers is not None and _distinct(kv) > hints.num_layers:
            # MAX sends num_layers: per-layer buffers are at most that many (fewer where
            # layers share one), and per-device buffers would otherwise read as layers
            raise DetectionError(
                f"MAX: a list of {_distinct(kv)} distinct buffers is more than the per-layer buffers of "
                f"layout hint num_layers={hints.num_layers} (one [NB, KV, 1, BS, NH, HS] a layer); "
                "per-device buffers, one per TP shard, are each a registration of their own"
            )
    if isinstance(kv, torch.Tensor) and kv.dim() == 6 and kv.shape[2] == 1 and (hints.num_layers or 1) > 1:
        # under per_layer_buffers MAX's KVCacheBuffer.values[shard] aliases layer 0's buffer
        raise LayoutHintError(
            f"MAX: kv_caches is one single-layer buffer {list(kv.shape)} where layout hint num_layers="
            f"{hints.num_layers}: under per_layer_buffers KVCacheBuffer.values[shard] is layer 0's buffer "
            "alone (values_per_layer[shard][0]); register values_per_layer[shard], one buffer a layer"
        )
    p = probe(kv)
    # size hints are checked after, as for every engine (discovery's check_size_hints)
    try:
        return pick(ENGINE, p, decide=[("kv_layout", "is_hnd", bool(hints.is_hnd))]), kv
    except DetectionError as e:
        if not isinstance(kv, list):
            raise
        raise DetectionError(
            f"{e} (a list is MAX's per-layer buffers; its per-device buffers, one per TP shard, "
            "are each a registration of their own)"
        ) from e


def size_hints(kv: Any, fmt: EngineKVFormat, hints: LayoutHints) -> LayoutHints:
    """The hints MAX's buffer is checked against: its ``tokens_per_block`` (``page_size``,
    what MAX sends) read as the tokens a page covers, which its slots (the BS axis,
    ``slots_per_page``) divide; ``ratio = page_size // slots_per_page`` tokens make one
    cached entry. Other hints are checked as they are."""
    tokens = hints.tokens_per_block
    axis = LAYOUTS[fmt].axis_of(Role.TOKEN)
    if tokens is None or axis is None:
        return hints
    slots = int(first_leaf(kv).shape[axis])
    if tokens == slots:
        return hints
    if slots < 1 or tokens % slots:
        raise LayoutHintError(
            f"MAX: layout hint tokens_per_block={tokens} contradicts {fmt.name}, whose BS is {slots}: the "
            "slots of a page (KVCacheParams.slots_per_page) divide the tokens it covers (page_size)"
        )
    return dataclasses.replace(hints, tokens_per_block=slots, page_size=None)


def refuse_mixed(kv: list[Any], hints: LayoutHints) -> None:
    """Tensors of different shapes (the registry's hook, asked before layers of different
    shapes are detected apart). MAX allocates one buffer, or one buffer a layer, all of one
    shape; tensors of other shapes are other buffers, never its layers."""
    _refuse_byte_pages(kv)
    shapes = list(dict.fromkeys(tuple(t.shape) for t in kv if isinstance(t, torch.Tensor)))
    if len(shapes) > 1:
        listed = ", ".join(str(list(s)) for s in shapes)
        raise DetectionError(
            f"MAX: kv_caches holds tensors of {len(shapes)} shapes ({listed}), where MAX registers one "
            "buffer [NB, KV, NL, BS, NH, HS] or one single-layer buffer [NB, KV, 1, BS, NH, HS] a layer, "
            "all of one shape: these are buffers MAX keeps apart, an FP8 cache's values and scales "
            "(KVCacheBuffer.values and .scales; all_buffers lists both) or the caches of a "
            "MultiKVCacheBuffer (a draft's, a sliding window's), each a registration of its own"
        )


def _refuse_byte_pages(kv: Any) -> None:
    """MAX's ``[num_pages, bytes_per_page]`` uint8 views (``to_memory()``) are refused with
    what to register instead: the buffer they view."""
    for where, t in (
        [(f"kv_caches[{i}]", t) for i, t in enumerate(kv)] if isinstance(kv, list) else [("kv_caches", kv)]
    ):
        if isinstance(t, torch.Tensor) and t.dim() == 2 and t.dtype == torch.uint8:
            raise DetectionError(
                f"MAX: {where} is a 2-D uint8 tensor {list(t.shape)}, MAX's byte view of its pages "
                "(KVCacheBuffer.to_memory(): [num_pages, bytes_per_page] a TP shard, which its "
                "KVTransferEngine, host tier and dKV copy whole), which says nothing of the K/V planes, "
                "layers, tokens and heads of a page; register the buffer it views, "
                "KVCacheBuffer.values[shard] [NB, KV, NL, BS, NH, HS] (the same memory: a page is the "
                "same bytes), and an FP8 cache's KVCacheBuffer.scales[shard] as a registration of its own; "
                "a RecurrentStateBuffer's pages view no other buffer: read them with "
                "kvlayout.integrations.max.recurrent_state_pages(buffer)"
            )


def _distinct(kv: list[Any]) -> int:
    """The list's buffers, a layer registered twice (sharing another's) counted once."""
    return len({(t.device, t.data_ptr()) if isinstance(t, torch.Tensor) else id(t) for t in kv})
