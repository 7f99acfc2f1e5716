"""Dynamo KVBM: a fully contiguous pool (its host or disk tier, ``LayoutType::FullyContiguous``),
one tensor ``[num_blocks, ...]`` whose every block is laid out in one of KVBM's block layouts
(``lib/kvbm-physical/src/layout/kv_block_layout.rs``, ``KvBlockLayout``): an order of the
layer (``nl``), outer (``no``: 2 for K and V, 1 for MLA's latent), token (``nt``) and head
(``nh``) dims, the head size (``hd``) innermost.

Quirks that live here and nowhere else:

* The ``kvbm_layout`` hint names the block layout as KVBM does (``KvBlockLayout::name()``),
  and is required: ``universal_tp`` ``[nh, nl, no, nt, hd]`` and ``universal_pp``
  ``[nl, nh, no, nt, hd]`` (a universal block holds every one of the model's KV heads, so a
  pool saved under one TP degree loads under another by head slicing) and
  ``operational_nhd`` ``[nl, no, nt, nh, hd]`` / ``operational_hnd`` ``[nl, no, nh, nt, hd]``
  (an operational block holds a rank's heads). Shapes cannot tell them apart (a universal
  block of 4 heads of 4 layers is an operational one's shape), so the name comes from the
  pool's configuration, never from its shape, as the memory's order (a permuted view reads
  in its memory's order).
* The pool is registered as its 6-D tensor ``[num_blocks, *block dims, hd]`` in that order.
  KVBM's own views of it (``[num_blocks, nl, no, inner]``, a region a byte row) say nothing
  of heads and tokens: they are refused, naming the 6-D view to register.
* ``no == 1`` (MLA) holds one latent head: every block layout then orders the same bytes,
  and the pool reads as the cross-layer MLA format ``[NB, NL, 1, BS, HS]`` (a view).

KVBM's layer-separate layouts (``LayerSeparate``) are the serving engine's own device
tensors: detect those with the engine that allocated them.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlayout._generated.formats import LAYOUTS, EngineKVFormat
from kvlayout.detection.base import DetectionError, Probe, engine_formats, pick, probe
from kvlayout.layout.algebra import sizes_by_role
from kvlayout.layout.ast import Layout
from kvlayout.layout.vocabulary import Role
from kvlayout.types import KVBM_LAYOUT_NAMES, DiscoverableKVCache, EngineType, LayoutHintError, LayoutHints

ENGINE = EngineType.KVBM
OWN_HINTS = ("kvbm_layout",)

# KvBlockLayout::dim_order() of each named layout, outermost first, after the pool's block
# axis (head_dim, innermost, is every layout's last dim).
BLOCK_ORDERS: dict[str, tuple[Role, ...]] = {
    "universal_tp": (Role.HEAD, Role.LAYER, Role.KV, Role.TOKEN),
    "universal_pp": (Role.LAYER, Role.HEAD, Role.KV, Role.TOKEN),
    "operational_nhd": (Role.LAYER, Role.KV, Role.TOKEN, Role.HEAD),
    "operational_hnd": (Role.LAYER, Role.KV, Role.HEAD, Role.TOKEN),
}
assert tuple(BLOCK_ORDERS) == KVBM_LAYOUT_NAMES

_SYMBOLS = {Role.LAYER: "nl", Role.KV: "no", Role.TOKEN: "nt", Role.HEAD: "nh"}
_PAGING = (Role.BLOCK, Role.LAYER, Role.KV, Role.TOKEN, Role.HEAD)


def block_shape(name: str) -> str:
    """The pool's shape in KVBM's symbols for the block layout ``name``:
    ``[num_blocks, nh, nl, no, nt, hd]`` for ``universal_tp``."""
    return "[" + ", ".join(["num_blocks", *(_SYMBOLS[r] for r in BLOCK_ORDERS[name]), "hd"]) + "]"


def kvbm_layout(layout: Layout) -> str | None:
    """The ``kvbm_layout`` a layout is (a pool's K/V pair as KVBM's ``no``), None for one
    that is none (a latent pool, with no head and no K/V axis, is every one of them)."""
    roles = layout.role_order(_PAGING)
    return next(
        (n for n, order in BLOCK_ORDERS.items() if not layout.list_depth and roles == (Role.BLOCK, *order)),
        None,
    )


def _pools() -> dict[str, EngineKVFormat]:
    """Each named layout's format (``no == 2``)."""
    out = {}
    for fmt in engine_formats(ENGINE):
        name = kvbm_layout(LAYOUTS[fmt])
        if name is not None:
            out[name] = fmt
    assert set(out) == set(BLOCK_ORDERS), "layouts.yaml lists a format for every KVBM block layout"
    return out


def _latent_format() -> EngineKVFormat:
    return next(f for f in engine_formats(ENGINE) if LAYOUTS[f].is_mla)


def discover(kv: Any, hints: LayoutHints) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    p = probe(kv)
    name = hints.kvbm_layout
    layouts = ", ".join(f"{n} {block_shape(n)}" for n in KVBM_LAYOUT_NAMES)
    if p.depth:
        raise DetectionError(
            f"Dynamo KVBM: {p.describe()}: a fully contiguous pool is one tensor, a block's bytes in "
            f"the block layout the hint kvbm_layout names ({layouts}); KVBM's layer-separate "
            "layouts are the serving engine's own tensors: detect them with that engine"
        )
    if name is None:
        raise DetectionError(
            f"Dynamo KVBM: {p.describe()}: pass layout hint kvbm_layout, the pool's block layout as "
            f"KVBM names it (KvBlockLayout::name()): {layouts}; shapes cannot tell them apart"
        )
    order = BLOCK_ORDERS[name]
    where = f"Dynamo KVBM pool (kvbm_layout={name}, {block_shape(name)})"
    if p.rank != 2 + len(order):
        raise DetectionError(
            f"{where}: {p.describe()} is not the pool's {2 + len(order)}-D view; register "
            f"pool.view({block_shape(name)[1:-1]}) (KVBM's [num_blocks, nl, no, inner] and byte "
            "views say nothing of heads and tokens)"
        )
    dims = dict(zip(order, p.shape[1:-1], strict=True))
    if dims[Role.KV] == 1:
        return _latent(kv, p, dims, where)
    if dims[Role.KV] != 2:
        raise DetectionError(
            f"{where}: {p.describe()}: no (dim {1 + order.index(Role.KV)}) is {dims[Role.KV]}; KVBM's "
            "outer dim is 2 (K and V) or 1 (MLA's latent): is kvbm_layout the pool's block layout?"
        )
    fmt = _pools()[name]
    if hints.kv_layout is not None and hints.is_hnd != LAYOUTS[fmt].is_hnd:
        heads = "before" if LAYOUTS[fmt].is_hnd else "after"
        raise LayoutHintError(
            f"{where}: layout hint kv_layout={hints.kv_layout} contradicts layout hint kvbm_layout={name}, "
            f"whose heads are {heads} its tokens"
        )
    try:
        return pick(ENGINE, p, formats=[fmt]), kv
    except DetectionError as exc:
        raise DetectionError(f"{where}: {exc}") from None


def _latent(kv: torch.Tensor, p: Probe, dims: dict[Role, int], where: str) -> tuple[EngineKVFormat, Any]:
    """An MLA pool (``no == 1``) of one latent head as the cross-layer MLA format, a view."""
    if dims[Role.HEAD] != 1:
        raise DetectionError(
            f"{where}: {p.describe()}: no is 1 (MLA's latent) with nh {dims[Role.HEAD]}; an MLA pool "
            "holds one latent head"
        )
    fmt = _latent_format()
    target = LAYOUTS[fmt]
    by_role = {Role.BLOCK: p.shape[0], Role.LAYER: dims[Role.LAYER], Role.TOKEN: dims[Role.TOKEN]}
    by_role[Role.ELEMENT] = p.shape[-1]
    try:
        view = kv.view(target.tensor_shape(sizes_by_role(target, by_role)))
    except RuntimeError:
        raise DetectionError(
            f"{where}: {p.describe()} (strides {list(kv.stride())}): an MLA pool's single head and outer "
            "dims cannot be dropped from this view"
        ) from None
    return fmt, view
