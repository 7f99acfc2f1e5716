"""SGLang's Mamba state pools as registrations of opaque pages, one per state tensor.

SGLang allocates each state of a hybrid model's linear-attention layers as one tensor
over all of them (``MambaPool.__init__``): the device pool's conv states (a list: one
for Mamba2 and Gated DeltaNet, three for Kimi Delta Attention, one in newer SGLang) and
SSM state are ``[NL, size + 1, *state]`` (slot 0 is the padding requests' dummy); its
unified memory pool gives the same views strided over per-slot envelopes (a slot's
state of every layer together); HiCache's host pool (``MambaPoolHost.init_kv_buffer``)
holds ``[NL, size, *state]`` (``layer_first``) or ``[size, NL, 1, *state]``
(``page_first``, ``page_first_direct``: its page is one slot). A slot's state of one
layer is one contiguous item, so each tensor is read as
int8 rows, one row an item, in SGLang's host-pool formats (``NL_NB_BS_ONE_HS``,
``NB_BS_NL_ONE_HS`` with one row a block), and marked as opaque pages: a block map moves
whole items, slot id to slot id, only between tensors of the same state. Slots outside
layers in memory (a host pool's page-first layouts, the unified pool) read slots first.
kvcached's ``ElasticMambaPool`` packs a slot's states of one layer into one cell, either
in a buffer per layer (``mamba_cache.conv_per_layer[i][layer]``,
``temporal_per_layer[layer]``: ``[size + 1, *state]`` each) or, contiguous, in one
buffer whose ``[NL, size + 1, *state]`` views put a slot's layers a cell apart: no one
tensor of rows describes either, so each state reads as its layers' views, a list of
one-row pages (SGLang's per-layer list format), its slots SGLang's slot ids.

Given the model's Mamba type, each page also declares how tensor parallelism shards it
(:class:`~kvlayout.registration.opaque.PageArray`), by the shapes SGLang sizes
(``configs/mamba_utils.py``): a Mamba2 or GDN conv state ``(conv_dim / tp, K - 1)`` is
the model's ``x, B, C`` or ``Q, K, V``, each split on its own; a KDA conv state
``(K - 1, proj / tp)`` is one projection; an SSM state is split by heads. A map between
ranks of two TP degrees then moves the slices both hold, as SGLang's own PD transfer
slices them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvlayout._generated.engines import EngineType
from kvlayout.detection.base import DetectionError
from kvlayout.detection.discovery import detect
from kvlayout.integrations.mamba_splits import conv_parts
from kvlayout.integrations.page_lists import dtype_name, listed_pages
from kvlayout.registration.opaque import OpaquePages, PageArray, mark_opaque_pages
from kvlayout.registration.registration import Registration

__all__ = ["MAMBA_TYPES", "MambaPoolError", "mamba_state_pools"]

MAMBA_TYPES = ("mamba2", "gdn_attn", "kda")
"""The Mamba types whose TP split is known (vLLM's names; ``"kda"``: Kimi Linear, whose
three conv states SGLang keeps apart): Mamba2 (NemotronH, FalconH1, Granite 4), Gated
DeltaNet (Qwen3-Next, Qwen3.5), Kimi Delta Attention."""

_HOST_LAYOUTS = {"layer_first": False, "page_first": True, "page_first_direct": True}  # slots outermost


class MambaPoolError(DetectionError):
    """An SGLang Mamba pool that is not one, or whose states do not split as its Mamba
    type says."""


def _states(pool: Any) -> tuple[str, list[tuple[str, Any]]]:
    """The pool's layout (``device`` or the host pool's) and its state tensors, named."""
    pool = getattr(pool, "mamba_pool", pool)  # HybridReqToTokenPool holds the MambaPool
    cache = getattr(pool, "mamba_cache", None)
    layout: Any
    if cache is not None:
        layout, convs, temporal = "device", getattr(cache, "conv", None), getattr(cache, "temporal", None)
    elif hasattr(pool, "temporal_buffer"):
        layout = getattr(pool, "layout", None)
        convs, temporal = getattr(pool, "conv_buffer", None), pool.temporal_buffer
        if not isinstance(layout, str) or layout not in _HOST_LAYOUTS:
            raise MambaPoolError(
                f"the host pool's layout is {layout!r}, not one of {', '.join(_HOST_LAYOUTS)} "
                "(MambaPoolHost's)"
            )
    else:
        raise MambaPoolError(
            f"{type(pool).__name__} is not an SGLang Mamba pool: a MambaPool (mamba_cache.conv, "
            "mamba_cache.temporal), a HybridReqToTokenPool (mamba_pool) or a MambaPoolHost "
            "(conv_buffer, temporal_buffer, layout)"
        )
    if not isinstance(convs, list | tuple):
        raise MambaPoolError(f"the pool's conv states are {type(convs).__name__}, not a list of tensors")
    named = [(f"conv{i}", t) for i, t in enumerate(convs)] + [("temporal", temporal)]
    layers = getattr(pool, "num_mamba_layers", None)
    axis = 1 if _HOST_LAYOUTS.get(layout, False) else 0  # the layer axis
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise MambaPoolError(f"the pool's {name} state is {type(t).__name__}, not a tensor")
        if isinstance(layers, int) and t.dim() > axis and t.shape[axis] != layers:
            raise MambaPoolError(
                f"the pool's {name} state is {list(t.shape)}, whose axis {axis} is not its {layers} Mamba "
                "layers (num_mamba_layers)"
            )
    return layout, named


def _state_shape(layout: str, name: str, t: torch.Tensor) -> tuple[int, ...]:
    """One slot's state shape of one layer, the tensor's rank and size-1 axis checked."""
    first = 3 if _HOST_LAYOUTS.get(layout, False) else 2
    shape = tuple(int(n) for n in t.shape)
    if len(shape) <= first or (first == 3 and shape[2] != 1):
        expected = "[size, NL, 1, *state]" if first == 3 else "[NL, slots, *state]"
        raise MambaPoolError(f"the pool's {name} state is {list(shape)}, not {expected} ({layout} pool)")
    return shape[first:]


def _dtype(name: str, t: torch.Tensor) -> str:
    return dtype_name(t, f"the pool's {name} state", MambaPoolError)


def _arrays(
    mamba_type: str | None, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str]
) -> dict[str, tuple[PageArray, ...]]:
    """Each state's TP-sharded array (none without a Mamba type: whole, rank to rank)."""
    if mamba_type is None:
        return {name: () for name in shapes}
    if mamba_type not in MAMBA_TYPES:
        raise MambaPoolError(f"mamba_type {mamba_type!r} is not one of {', '.join(MAMBA_TYPES)} (or None)")
    convs = [n for n in shapes if n != "temporal"]
    ssm = shapes.get("temporal", ())
    counts = (1, 3) if mamba_type == "kda" else (1,)
    if len(convs) not in counts or any(len(shapes[n]) != 2 for n in convs) or len(ssm) != 3:
        got = ", ".join(f"{n} {list(shapes[n])}" for n in shapes)
        raise MambaPoolError(
            f"a {mamba_type} pool has {' or '.join(map(str, counts))} conv state(s) of 2 axes and an SSM "
            f"state of 3 (heads, head size, state), not {got}"
        )
    arrays: dict[str, tuple[PageArray, ...]] = {
        "temporal": (PageArray(0, ssm, dtypes["temporal"], 0, (ssm[0],)),)
    }
    for name in convs:
        conv = shapes[name]
        if mamba_type == "kda":  # (K - 1, proj / tp): one projection each, or all three
            parts = (conv[1],) if len(convs) == 3 else conv_parts("kda", conv[1], ssm)
            fits = [(1, parts)] if parts else []
        else:
            fits = [(axis, parts) for axis in (0, 1) if (parts := conv_parts(mamba_type, conv[axis], ssm))]
        if len(fits) != 1:
            sub = {"mamba2": "x, B, C", "gdn_attn": "Q, K, V", "kda": "three projections"}[mamba_type]
            raise MambaPoolError(
                f"the conv state {list(conv)} does not split into {mamba_type}'s {sub} beside the SSM state "
                f"{list(ssm)} ({'on both axes' if fits else 'on neither axis'}): another Mamba type?"
            )
        axis, parts = fits[0]
        arrays[name] = (PageArray(0, conv, dtypes[name], axis, parts),)
    return arrays


def _rows(name: str, t: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The tensor as int8 rows, one a slot's item of one layer; the tensor in its memory's
    order; whether slots are outside layers in memory. SGLang's unified memory pool lays
    a device state slot-major (a slot's envelope holds every layer: ``[NL, slots]`` views
    whose slot stride is the envelope), and its CPU AMX kernels keep a conv state ``(dim,
    K - 1)`` as ``(K - 1, dim)`` in memory under the same shape; no other state is read
    transposed."""
    slots_first = _HOST_LAYOUTS.get(layout, False)
    if layout == "device" and (t.shape[0] == 1 or t.stride(1) > t.stride(0)):  # one layer: either order
        t, slots_first = t.transpose(0, 1), True
    read = _item_rows(name, t, 2)  # [NL, slots, 1, bytes] or, slots first, [slots, NL, 1, bytes]
    if read is None:
        raise MambaPoolError(
            f"the pool's {name} state {list(t.shape)} (strides {list(t.stride())}) is not one contiguous "
            "item per slot and layer, as SGLang allocates it"
        )
    return read[0], read[1], slots_first


def _item_rows(name: str, t: torch.Tensor, lead: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``t``'s ``lead`` leading axes over int8 rows ``[*lead, 1, bytes]``, one row an item,
    and the tensor in its memory's order (a conv state's last two axes either way: SGLang's
    CPU AMX kernels keep ``(dim, K - 1)`` as ``(K - 1, dim)``); None where no item is
    contiguous."""
    views = (t, t.transpose(-1, -2)) if name.startswith("conv") and t.dim() >= lead + 2 else (t,)
    for view in views:
        try:
            return view.view(*(int(n) for n in t.shape[:lead]), 1, -1).view(torch.int8), view
        except RuntimeError:
            continue
    return None


def _per_layer_states(pool: Any, cache: Any) -> list[tuple[str, list[torch.Tensor]]]:
    """kvcached's non-contiguous ``ElasticMambaPool`` (``_PerLayerMambaState``): each
    state a list of per-layer tensors ``[size + 1, *state]`` (``conv_per_layer[i][layer]``,
    ``temporal_per_layer[layer]``), every layer alike; its ``conv`` and ``temporal`` are
    layer 0's alone and are not read."""
    convs, temporal = cache.conv_per_layer, getattr(cache, "temporal_per_layer", None)
    if not isinstance(convs, list | tuple) or not all(isinstance(c, list | tuple) for c in convs):
        kinds = type(convs).__name__
        if isinstance(convs, list | tuple):
            kinds += " of " + ", ".join(type(c).__name__ for c in convs)
        raise MambaPoolError(
            f"the pool's mamba_cache.conv_per_layer is {kinds}, not a list of per-layer lists of tensors "
            "(kvcached's ElasticMambaPool: [conv state][layer])"
        )
    if not isinstance(temporal, list | tuple):
        raise MambaPoolError(
            f"the pool's mamba_cache.temporal_per_layer is {type(temporal).__name__}, not a list of "
            "per-layer tensors (kvcached's ElasticMambaPool keeps conv_per_layer beside it)"
        )
    named = [(f"conv{i}", list(c)) for i, c in enumerate(convs)] + [("temporal", list(temporal))]
    layers = getattr(pool, "num_mamba_layers", None)
    want, source = (
        (layers, "its Mamba layers (num_mamba_layers)")
        if isinstance(layers, int)
        else (len(named[0][1]), f"its {named[0][0]} state's")
    )
    for name, ts in named:
        if len(ts) != want or not ts:
            raise MambaPoolError(
                f"the pool's {name} state has {len(ts)} per-layer tensors, not {want}: {source}"
            )
        for layer, t in enumerate(ts):
            if not isinstance(t, torch.Tensor):
                raise MambaPoolError(
                    f"the pool's {name} state of layer {layer} is {type(t).__name__}, not a tensor"
                )
            first = ts[0]
            if t.dim() < 2 or (t.shape, t.dtype, t.device) != (first.shape, first.dtype, first.device):
                raise MambaPoolError(
                    f"the pool's {name} state of layer {layer} is {list(t.shape)} {t.dtype} on {t.device}, "
                    f"of layer 0 {list(first.shape)} {first.dtype} on {first.device}: every layer's "
                    "[slots, *state] alike expected"
                )
    return named


def _layer_rows(name: str, layer: int, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's state ``[slots, *state]`` as int8 rows ``[slots, 1, bytes]``, one a
    slot's item, and the tensor in its memory's order (a conv state's two axes either
    way, as :func:`_rows`). A slot's item must be contiguous; slots may lie any distance
    apart (kvcached packs a slot's states of one layer into one cell)."""
    read = _item_rows(name, t, 1)
    if read is None:
        raise MambaPoolError(
            f"the pool's {name} state of layer {layer} {list(t.shape)} (strides {list(t.stride())}) is not "
            "one contiguous item per slot, as kvcached allocates it"
        )
    return read


def _per_layer_pools(pool: Any, cache: Any, mamba_type: str | None) -> dict[str, Registration]:
    """kvcached's per-layer pool as one registration per state, its layers a list
    (:func:`~kvlayout.integrations.page_lists.listed_pages`): block ids are slot
    indices, as in SGLang's device pool."""
    named = _per_layer_states(pool, cache)
    head, first = named[0][0], named[0][1][0]
    for name, ts in named[1:]:  # every state, those of no elements too: the same slots
        if ts[0].shape[0] != first.shape[0] or ts[0].device != first.device:
            raise MambaPoolError(
                f"the pool's {name} state is {list(ts[0].shape)} on {ts[0].device} a layer and its {head} "
                f"state {list(first.shape)} on {first.device} a layer: the same slots on one device expected"
            )
    held = ", ".join(f"{name} {list(ts[0].shape)}" for name, ts in named)
    named = [(name, ts) for name, ts in named if math.prod(ts[0].shape[1:])]  # LFM2's SSM state: none
    if not named or not first.shape[0]:
        raise MambaPoolError(f"the pool's states hold no bytes (a layer's {held}): no slot to read")
    rows = {name: [_layer_rows(name, layer, t) for layer, t in enumerate(ts)] for name, ts in named}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, layer_rows in rows.items():
        orders = {tuple(int(n) for n in view.shape[1:]) for _, view in layer_rows}
        if len(orders) != 1:
            raise MambaPoolError(
                f"the pool's {name} state reads in other orders in other layers ({sorted(orders)}): "
                "every layer alike expected"
            )
        shapes[name] = orders.pop()
    dtypes = {name: _dtype(name, ts[0]) for name, ts in named}
    arrays = _arrays(mamba_type, shapes, dtypes)
    pools = {}
    for name, ts in named:
        page = OpaquePages(f"SGLang Mamba {name}: {dtypes[name]} {list(shapes[name])}", False, arrays[name])
        pools[name] = listed_pages([view for view, _ in rows[name]], page, ts, 1, EngineType.SGLANG)
    return pools


def mamba_state_pools(pool: Any, mamba_type: str | None = None) -> dict[str, Registration]:
    """SGLang's Mamba state ``pool`` (a device ``MambaPool``, the ``HybridReqToTokenPool``
    holding one, kvcached's ``ElasticMambaPool`` in either layout, or a HiCache
    ``MambaPoolHost``) as one registration per state tensor:
    ``conv0`` (``conv1``, ``conv2`` for Kimi Linear) and ``temporal``, in SGLang's order.

    Block ids are SGLang's slot indices (a request's ``mamba_pool_idx`` on the device,
    its host indices on the host), one slot a block. Registrations of the same state in
    two pools map whole items, slot to slot, one run a layer where neither side holds
    the layers together. With ``mamba_type`` (one of :data:`MAMBA_TYPES`) each page
    declares how TP shards it, and a map between ranks of two TP degrees, given both
    shards, moves the slices both ranks hold (kind ``resharded state``). Raises
    :class:`MambaPoolError` for anything else."""
    held = getattr(pool, "mamba_pool", pool)
    cache = getattr(held, "mamba_cache", None)
    if cache is not None and hasattr(cache, "conv_per_layer"):  # kvcached's, a buffer per layer
        return _per_layer_pools(held, cache, mamba_type)
    layout, named = _states(pool)
    shapes = {name: _state_shape(layout, name, t) for name, t in named}
    head, first = named[0]
    for name, t in named[1:]:  # every state, those of no elements too: layers and slots alike
        if t.shape[:2] != first.shape[:2] or t.device != first.device:
            raise MambaPoolError(
                f"the pool's {name} state is {list(t.shape)} on {t.device} and its {head} state "
                f"{list(first.shape)} on {first.device}: the same layers and slots on one device expected"
            )
    # a model without the state (LFM2's SSM state): a slot's is of no elements
    held = ", ".join(f"{name} {list(t.shape)}" for name, t in named)
    named = [(name, t) for name, t in named if math.prod(shapes[name])]
    if not named or not first.numel():
        raise MambaPoolError(f"the pool's states hold no bytes ({held}): no slot to read")
    rows = {name: _rows(name, t, layout) for name, t in named}
    shapes = {name: _state_shape(layout, name, rows[name][1]) for name, t in named}
    dtypes = {name: _dtype(name, t) for name, t in named}
    arrays = _arrays(mamba_type, shapes, dtypes)
    pools = {}
    for name, t in named:
        view, ordered, slots_first = rows[name]
        page = OpaquePages(f"SGLang Mamba {name}: {dtypes[name]} {list(shapes[name])}", False, arrays[name])
        if layout == "device" and view.shape[1] > 1 and view.stride(1) != view.shape[-1]:
            # kvcached's contiguous ElasticMambaPool: a slot's layers a cell of every state apart,
            # which no one tensor of rows describes; its layers read as a list, each a view
            layers = ordered.unbind(1 if slots_first else 0)
            rows_of = [x.view(x.shape[0], 1, -1).view(torch.int8) for x in layers]
            pools[name] = listed_pages(rows_of, page, [t] * len(layers), 1, EngineType.SGLANG)
            continue
        mark_opaque_pages(view, page, (t,))
        order = "page_first" if slots_first else "layer_first"
        pools[name] = detect(view, "sglang", {"hicache_layout": order, "tokens_per_block": 1})
    return pools
