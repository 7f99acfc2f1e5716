"""``KVCacheManagerV2``'s KV pools as TRT-LLM hands them to a connector: a
``KvCacheLayout`` (``connectors/kv_cache_layout.py``), not one pool tensor.

V2 allocates pool groups of ``num_slots`` slots; a slot holds the coalesced buffers of
one layer group (a life cycle: full attention, or one sliding window), and a
connector's worker gets ``register_kv_cache_layout(layout)``: per group, regions, each a
run of adjacent ``(layer, role)`` buffers (``KvCacheBufferRef``, in memory order) that
repeats once a slot, slot ``i`` at ``base + stride * i`` for ``size`` bytes, viewed as
``region.as_tensor(dtype)`` ``[num_slots, size // itemsize]`` (strided: a slot may hold
other runs). Page slots are ``get_aggregated_page_indices(layer_group_id)``, one index
space a group. V2's per-layer ``get_buffers(layer)`` views are not this: each starts at
its layer's first buffer and counts pages, so layers coalesced in a slot overlap, and a
slot id does not index them (``get_buffers`` asserts K and V adjacent).

:func:`kv_cache_layout_pools` reads a group's region of K/V buffers, every layer's key
then value (or key alone: MLA, ``CacheType.SELFKONLY``) in layer order, as the pool
TRT-LLM's detector reads, ``[num_slots, NL, kv_factor, NH*BS*HS]`` with the slot's
other bytes as dim-0 padding, so it maps by heads, tokens and layers to any other
engine's cache. A group's K/V in several runs of one slot (V2 coalesces every buffer of
a size in a slot, in layer order: MiniMax-M3's ``index_key`` of K's size lies between its
layers' K/V; RocketKV's ``kt_cache``, expanded to K's size, after each layer's K and V,
one region with them) reads as the list of its layers' K/V views. Its layers are
numbered with TRT-LLM's own ids (``KvCacheBufferRef.layer_id``, the global model layer
index): a map pairs a group only with a cache of the same layers (another group's, or a
peer's group of other layers, is refused naming both), and a cache numbered otherwise
(V1's pool, a pipeline stage's list, both from 0) is paired on purpose with
``registration.numbered(layer_ids)``. A region of DSA's index keys (``DSACacheManagerV2``:
an ``index_key`` buffer of the indexer's records a full-indexer layer) is read as
TRT-LLM's indexer K pool, numbered with its layers. Any other region (NVFP4 block scales,
MiniMax-M3's index keys, a replicated side cache), or run of other buffers in a region of
K/V, is read as opaque pages, whole slots of its bytes, that map only to a region of the
same bytes (its label names its layers).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch

from kvlayout._generated.engines import EngineType
from kvlayout._generated.formats import LAYOUTS
from kvlayout.detection.base import DetectionError
from kvlayout.detection.discovery import detect
from kvlayout.detection.trtllm import indexer_record_bytes
from kvlayout.errors import as_int
from kvlayout.integrations.page_lists import listed_pages
from kvlayout.layout.algebra import axis_of
from kvlayout.layout.vocabulary import Role
from kvlayout.registration.opaque import OpaquePages
from kvlayout.registration.registration import Registration
from kvlayout.types import HintsLike, LayoutHints

__all__ = ["KvCacheLayoutError", "kv_cache_layout_pools"]

_KV_ROLES = ("key", "value")  # V2's Role.KEY / Role.VALUE names (DataRole("key"), DataRole("value"))
# V2MambaHybridCacheManager's MambaRole names: its states are regions of the layout too
_STATE_ROLES = ("ssm_state", "conv_state")
_STATE_ADVICE = (
    "a region of ssm_state / conv_state buffers is V2MambaHybridCacheManager's Mamba states, read here as "
    "whole slots (one TP degree, one layout): kvlayout.integrations.trtllm.mamba_state_pools(manager) "
    "reads them split as TRT-LLM's transceiver splits them between TP degrees; map those instead"
)


class KvCacheLayoutError(DetectionError):
    """A ``KvCacheLayout`` whose groups or regions are not what V2 describes."""


def _refs(region: Any, where: str) -> list[tuple[int, str, int]]:
    """The region's buffers as ``(layer_id, role, expansion)``, in memory order."""
    buffers = getattr(region, "buffers", None)
    if not isinstance(buffers, list | tuple) or not buffers:
        raise KvCacheLayoutError(
            f"{where}'s buffers are {type(buffers).__name__}, not a tuple of KvCacheBufferRef"
        )
    refs = []
    for i, b in enumerate(buffers):
        layer, role, expansion = (getattr(b, n, None) for n in ("layer_id", "role", "expansion"))
        if type(layer) is not int or not isinstance(role, str) or type(expansion) is not int:
            raise KvCacheLayoutError(
                f"{where}'s buffers[{i}] is {b!r}, not a KvCacheBufferRef (layer_id, role, expansion)"
            )
        refs.append((layer, role, expansion))
    return refs


def _rows(region: Any, where: str) -> torch.Tensor:
    """``region.as_tensor()`` (uint8 ``[num_slots, size]``) checked against the
    region's own ``num_slots``, ``size`` and ``stride``."""
    fields = {n: getattr(region, n, None) for n in ("num_slots", "size", "stride")}
    try:
        if not callable(getattr(region, "as_tensor", None)):
            raise TypeError("no as_tensor")
        slots, size = (as_int(fields[n], n) for n in ("num_slots", "size"))
        as_int(fields["stride"], "stride")
    except TypeError:
        raise KvCacheLayoutError(
            f"{where} is {type(region).__name__} ({', '.join(f'{n} {v!r}' for n, v in fields.items())}), "
            "not a KvCacheRegion (as_tensor, int num_slots, size and stride)"
        ) from None
    t = region.as_tensor(torch.uint8)
    want = (slots, size)
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or tuple(t.shape) != want or t.stride(1) != 1:
        what = (
            f"{list(t.shape)} (strides {list(t.stride())})"
            if isinstance(t, torch.Tensor)
            else type(t).__name__
        )
        raise KvCacheLayoutError(f"{where}.as_tensor() is {what}, not [num_slots, size] {list(want)} rows")
    if t.shape[0] > 1 and t.stride(0) != int(region.stride):
        raise KvCacheLayoutError(
            f"{where}.as_tensor() steps {t.stride(0)} bytes a slot where the region says stride "
            f"{region.stride}"
        )
    return t


def _kv_layers(refs: list[tuple[int, str, int]], where: str) -> tuple[list[int], int]:
    """The layers of a region of K/V buffers and its kv factor: every layer's ``key``
    then ``value`` (or ``key`` alone), each buffer once, of expansion 1."""
    kv = 2 if any(role == "value" for _, role, _ in refs) else 1
    roles = _KV_ROLES[:kv]
    layers = [layer for layer, _, _ in refs[::kv]]
    want = [(layer, role, 1) for layer in layers for role in roles]
    # Layers ascending, as V1's pool and get_buffers order them: a map pairs layers by position.
    if refs != want or layers != sorted(set(layers)):
        got = ", ".join(f"{layer}:{role}" + (f" x{e}" if e != 1 else "") for layer, role, e in refs)
        raise KvCacheLayoutError(
            f"{where} holds {got}: a region of K/V buffers is read as each layer's "
            f"{' then '.join(roles)}, layers ascending, at one tokens_per_block (expansion 1)"
        )
    return layers, kv


def _kv_pool(
    region: Any, where: str, refs: list[tuple[int, str, int]], dtype: torch.dtype, hints: LayoutHints
) -> Registration:
    layers, kv = _kv_layers(refs, where)
    rows = _rows(region, where)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    size, stride = int(region.size), int(region.stride)
    if size % (itemsize * len(layers) * kv) or stride % itemsize:
        raise KvCacheLayoutError(
            f"{where}: size {size} and stride {stride} bytes do not hold {len(layers)} layers x {kv} buffers "
            f"of {dtype} elements"
        )
    # The slot's other runs are dim-0 padding of the pool TRT-LLM's detector reads.
    pool = rows.view(dtype).view(rows.shape[0], len(layers), kv, -1)
    return detect(pool, EngineType.TRTLLM, hints).numbered(layers)


def _kv_runs(
    runs: list[tuple[Any, str, list[tuple[int, str, int]]]], g: object, dtype: torch.dtype, hints: LayoutHints
) -> Registration:
    """A group's K/V buffers in several runs of one slot: V2 coalesces every buffer of a
    size in a slot, in layer order, so a side buffer of K's size (MiniMax-M3's
    ``index_key`` where ``num_kv_heads * head_dim`` is its ``sparse_index_dim``) splits the
    layers' K/V into runs, each layer's K then V (or key alone, MLA) whole. Each run reads
    as TRT-LLM's pool of its layers; the group as the list of its layers' ``[num_slots, 2,
    ...]`` views (MLA: ``[num_slots, BS, HS]``), the per-layer caches vLLM's reader reads (a
    layer's views stand any distance apart), labelled TRT-LLM's and numbered with TRT-LLM's
    layer ids."""
    where = f"layer group {g}"
    read = []
    for region, w, held in runs:
        pool = _kv_pool(region, w, held, dtype, hints)  # checks the region and the hints
        try:
            base = as_int(getattr(region, "base", None), "base")
        except TypeError:
            raise KvCacheLayoutError(f"{w}'s base is {getattr(region, 'base', None)!r}, not an int") from None
        read.append((base, region, w, held, pool))
    read.sort(key=lambda run: run[0])
    spans = [(base, base + int(r.size), int(r.stride), int(r.num_slots)) for base, r, *_ in read]
    ends_fit = all(end <= nxt for (_, end, _, _), (nxt, _, _, _) in itertools.pairwise(spans))
    if len({(stride, slots) for _, _, stride, slots in spans}) != 1 or not ends_fit:
        named = "; ".join(
            f"{w}: base {base}, size {end - base}, stride {stride}, {slots} slots"
            for (base, end, stride, slots), (_, _, w, _, _) in zip(spans, read, strict=True)
        )
        raise KvCacheLayoutError(
            f"{where} holds K/V buffers in {len(runs)} regions that are not runs of one slot ({named}); "
            "kvlayout reads a group's K/V as one pool's slots: runs of one stride and slot count, apart "
            "in memory"
        )
    layers, _ = _kv_layers([ref for *_, held, _ in read for ref in held], f"{where}'s K/V regions")
    views: list[torch.Tensor] = []
    order: dict[str, str] = {}
    for *_, pool in read:
        layout = LAYOUTS[pool.format]
        axis = axis_of(layout, Role.LAYER)
        assert axis is not None  # a TRT-LLM K/V pool holds its layers on an axis
        for k in range(pool.num_layers):
            view = pool.kv.select(axis, k)
            # an MLA layer [NB, 1, BS, HS] (its one latent head after the layers) as
            # vLLM's MLA cache [NB, BS, HS]; K/V by the order the pool was read in
            views.append(view.squeeze(axis) if layout.is_mla else view)
        order = {} if layout.is_mla else {"kv_layout": "HND" if layout.is_hnd else "NHD"}
    return detect(views, EngineType.VLLM, order).labelled(EngineType.TRTLLM).numbered(layers)


def _index_key_pool(
    region: Any, where: str, refs: list[tuple[int, str, int]], bs: int
) -> Registration | None:
    """A region of DSA's index keys (``DSACacheManagerV2``: one ``index_key`` buffer of
    ``tokens_per_block`` records a full-indexer layer, coalesced in a slot in layer order)
    as TRT-LLM's indexer K pool ``[num_slots, NL, 1, BS * record]`` uint8, numbered with its
    layers: V2's index pages hold the bytes V1's ``get_indexer_k_cache_pool()`` rows do (the
    same indexer kernels write both), so it maps token by token to V1's pool and to another
    stage's layers. None where the buffers are not index keys of an indexer record's width
    (MiniMax-M3's bf16 index keys: opaque slots)."""
    if any(role != "index_key" or expansion != 1 for _, role, expansion in refs):
        return None
    rows = _rows(region, where)
    width, rest = divmod(rows.shape[1], len(refs))
    if rest or width not in {bs * record for record in indexer_record_bytes()}:
        return None
    layers = [layer for layer, _, _ in refs]
    if layers != sorted(set(layers)):
        raise KvCacheLayoutError(
            f"{where} holds the index keys of layers {layers}: DSA's index keys are read as each "
            "full-indexer layer's, layers ascending"
        )
    pool = rows.view(rows.shape[0], len(layers), 1, width)
    return detect(pool, EngineType.TRTLLM, {"tokens_per_block": bs}).numbered(layers)


@dataclasses.dataclass(frozen=True)
class _Run:
    """Some adjacent buffers of a region, a narrower region of the same slots: V2
    coalesces buffers of one (expanded) size, so a region of ``n`` buffers holds each in
    ``size // n`` bytes, and its buffers ``k..`` start ``k * size // n`` bytes in."""

    region: Any
    offset: int
    size: int
    buffers: tuple[Any, ...]

    @property
    def base(self) -> int:
        return as_int(self.region.base, "base") + self.offset

    @property
    def stride(self) -> int:
        return int(self.region.stride)

    @property
    def num_slots(self) -> int:
        return int(self.region.num_slots)

    def as_tensor(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        rows: torch.Tensor = self.region.as_tensor(torch.uint8)
        return rows[:, self.offset : self.offset + self.size].view(dtype)


def _pieces(region: Any, where: str, name: str, kind: str) -> list[tuple[Any, str, str, Any, bool]]:
    """A region as ``(region, where, name, refs, holds K/V)`` pieces: itself, or, where
    it holds K/V buffers among others of their size (RocketKV's ``kt_cache`` after each
    layer's K and V: ``RocketKVCacheManagerV2``, expanded to K's size), its runs of K/V
    buffers and of the others, each a :class:`_Run` (the others named ``name.run{k}``)."""
    refs = _refs(region, where)
    kv = [role in _KV_ROLES for _, role, _ in refs]
    if kind != "region" or all(kv) or not any(kv):
        return [(region, where, name, refs, kind == "region" and all(kv))]
    size = _rows(region, where).shape[1]
    if size % len(refs):
        raise KvCacheLayoutError(
            f"{where}: {size} bytes are not {len(refs)} buffers of one size, as V2 coalesces them"
        )
    width = size // len(refs)
    pieces = []
    for k, (held, run) in enumerate(itertools.groupby(range(len(refs)), key=lambda b: kv[b])):
        ks = list(run)
        part = _Run(region, ks[0] * width, len(ks) * width, tuple(region.buffers[b] for b in ks))
        part_where = f"{where} buffers {ks[0]}-{ks[-1]}"
        pieces.append((part, part_where, f"{name}.run{k}", [refs[b] for b in ks], held))
    return pieces


def kv_cache_layout_pools(
    layout: Any, dtype: torch.dtype, hints: HintsLike = None
) -> dict[str, Registration]:
    """A ``KvCacheLayout`` (what ``KVCacheManagerV2`` hands ``register_kv_cache_layout``)
    as registrations, one a region: ``"group{g}"`` the region of group ``g``'s K/V
    buffers, read as TRT-LLM's pool ``[num_slots, NL, kv_factor, NH*BS*HS]`` of ``dtype``
    (the cache's element type; ``torch.int8`` for NVFP4, two values a byte) with
    ``hints`` (``num_kv_heads``, ``head_dim``, ``kv_layout`` as for
    ``kvlayout.detect(pool, "trtllm", ...)``; ``tokens_per_block`` is the layout's), or,
    where other buffers of K's size lie between its layers, as the list of each layer's
    ``[num_slots, 2, ...]`` K/V view; its layers numbered with the group's TRT-LLM layer
    ids (``Registration.numbered``); ``"group{g}.region{i}"``
    (``"group{g}.replicated{i}"``) any other region: DSA's index keys as TRT-LLM's indexer
    K pool ``[num_slots, NL, 1, BS * record]`` numbered with their layers, any other opaque
    pages of whole slots (a ``V2MambaHybridCacheManager``'s ``ssm_state`` and
    ``conv_state`` regions too, which
    :func:`mamba_state_pools` reads with their TP splits), and ``"group{g}.region{i}.run{k}"``
    the runs of other buffers in a region that also holds K/V (RocketKV's ``kt_cache``),
    opaque pages of those bytes of each slot. Block ids are group ``g``'s page slots
    (``get_aggregated_page_indices(g)``). Raises :class:`KvCacheLayoutError` for a
    layout that is not V2's."""
    if not isinstance(dtype, torch.dtype):
        raise KvCacheLayoutError(f"dtype must be a torch.dtype (the cache's element type), not {dtype!r}")
    groups = getattr(layout, "groups", None)
    bs = getattr(layout, "tokens_per_block", None)
    if not isinstance(groups, list | tuple) or type(bs) is not int or bs <= 0:
        raise KvCacheLayoutError(
            f"{type(layout).__name__} is not a KvCacheLayout (tokens_per_block, groups): "
            f"tokens_per_block {bs!r}, groups {type(groups).__name__}"
        )
    given = LayoutHints.coerce(hints)
    if given.tokens_per_block not in (None, bs):
        raise KvCacheLayoutError(
            f"layout hint tokens_per_block={given.tokens_per_block} contradicts the layout's {bs}"
        )
    given = dataclasses.replace(given, tokens_per_block=bs)
    pools: dict[str, Registration] = {}
    for group in groups:
        g = getattr(group, "layer_group_id", None)
        regions: dict[str, tuple[Any, ...]] = {}
        for kind, attribute in (("region", "regions"), ("replicated", "replicated_regions")):
            held = getattr(group, attribute, None if kind == "region" else ())
            if not isinstance(held, list | tuple):
                raise KvCacheLayoutError(
                    f"layer group {g}'s {attribute} are {type(held).__name__}, not a tuple"
                )
            regions[kind] = tuple(held)
        pieces = {
            kind: [
                piece
                for i, region in enumerate(held)
                for piece in _pieces(region, f"layer group {g} {kind} {i}", f"group{g}.{kind}{i}", kind)
            ]
            for kind, held in regions.items()
        }
        kv_runs = [(region, where, refs) for region, where, _, refs, kv in pieces["region"] if kv]
        if len(kv_runs) == 1:  # a run of a region reads as the pool with its slot's other bytes
            pools[f"group{g}"] = _kv_pool(*kv_runs[0], dtype, given)
        elif kv_runs:
            pools[f"group{g}"] = _kv_runs(kv_runs, g, dtype, given)
        for kind, held in pieces.items():
            for region, where, name, refs, kv in held:
                if kv:
                    continue
                index_keys = _index_key_pool(region, where, refs, bs)
                if index_keys is not None:
                    pools[name] = index_keys
                    continue
                rows = _rows(region, where)
                named = ", ".join(f"{layer}:{role}" for layer, role, _ in refs)
                states = any(role in _STATE_ROLES for _, role, _ in refs)
                advice = _STATE_ADVICE if states else ""
                page = OpaquePages(
                    f"TRT-LLM V2 {kind}: {named} ({rows.shape[1]} bytes)", False, advice=advice
                )
                view = rows.view(torch.int8).view(rows.shape[0], 1, -1)
                pools[name] = listed_pages([view], page, [rows], 1, EngineType.TRTLLM)
    return pools
