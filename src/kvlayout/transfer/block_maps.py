"""Block maps: move one request's KV between any two registrations as byte runs.

A side of a map is a kernel group (or a peer's description of one, or a chunk): its
layout says, through the algebra's offsets, where every (layer, K/V, token, head, byte)
lives. Token ``p`` of the request is slot ``p % BS`` of block ``blocks[p // BS]`` on each
side, each side with its own block size; head ``h`` of the model is held by the ranks
:class:`~kvlayout.registration.shards.Shard` says. A map pairs every byte both sides hold, layer ``i``
to layer ``i``, K to K and V to V, and cuts the pairs into runs that are contiguous on
both sides: the fewest such runs (see docs/block-maps.md).

The work is split by what changes when. Per side, once (cached on the kernel group):
the algebra's offsets of each (layer, K/V, piece of a head's row) and its per-block,
per-slot and per-head strides. Per pair of sides, once: the *slabs* (layer, K/V and
piece both sides hold, with both sides' bases and strides), slabs that are contiguous
on both sides joined, and the destination's nest (slab, block, slot, head ordered by its
strides). Per request: block ids, and the native builder walks the destination in memory
order, emitting and merging runs (``csrc/block_map.h``).
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from kvlayout import _native
from kvlayout.errors import KVLayoutError, as_int, index_ranges
from kvlayout.layout import algebra
from kvlayout.layout.ast import Layout
from kvlayout.layout.vocabulary import Role
from kvlayout.registration.memory import HoldsAddresses, Placement, group_placement, no_memory
from kvlayout.registration.nesting import not_strided
from kvlayout.registration.opaque import OpaquePages
from kvlayout.registration.peers import GroupDescription, RegistrationDescription, describe_group
from kvlayout.registration.registration import KernelGroup, RegisteredKV, Registration, RegistrationError
from kvlayout.registration.shards import Shard, ShardError
from kvlayout.transfer.arguments import block_ids_arg, int_arg, threads_arg

__all__ = ["BlockMap", "BlockMapError", "Side", "block_map", "chunk_side"]

SLAB, BLOCK, SLOT, HEAD = 0, 1, 2, 3
_LEVEL_NAMES = ("slab", "block", "slot", "head")
_PROBLEMS = {
    1: "its source bytes are outside every source tensor's blocks",
    2: "its destination bytes are outside every destination tensor's blocks",
    3: "its destination bytes overlap those of run {other}",
    4: "it writes bytes run {other} reads (source and destination share memory)",
    5: "it has no bytes",
}


class BlockMapError(KVLayoutError):
    """A map that cannot be made or run (raised before any byte moves)."""


# -- one job's geometry, from the algebra ------------------------------------------------


@dataclass(frozen=True)
class _JobGeometry:
    """Where one plane's bytes live, per canonical (layer, K/V, piece of a head's row)."""

    kv: int  # K/V planes of the data (2 for a packed K/V row too)
    heads: int
    row_bytes: int  # one head's row of one K/V plane
    pieces: tuple[tuple[int, int], ...]  # (first byte, bytes) of the row's contiguous pieces
    pointer: np.ndarray  # (NL, KV, P) pointer index
    offset: np.ndarray  # (NL, KV, P) bytes from that pointer
    strides: np.ndarray  # (P, 3) bytes per block, slot and head
    num_blocks: int
    block_size: int


@functools.lru_cache(maxsize=256)
def _job_geometry(
    layout: Layout, sizes_items: tuple[tuple[str, int], ...], block_stride: int | None, element_size: int
) -> _JobGeometry:
    s = algebra.resolve_sizes(layout, dict(sizes_items))
    pair = 2 if layout.is_fused_packed else 1  # K and V side by side in one row
    kvs = algebra.kv_size(layout, s)
    hs = algebra.head_size(layout, s)
    if hs % pair:
        raise BlockMapError(f"{layout}: a packed K/V row of {hs} elements does not split into K and V")
    row = hs // pair
    heads = algebra.num_heads(layout, s)
    nl = algebra.size_of(layout, s, Role.LAYER) or 1
    nb = algebra.size_of(layout, s, Role.BLOCK)
    bs = algebra.size_of(layout, s, Role.TOKEN)
    assert nb is not None and bs is not None  # pages were split before

    def at(
        layer: int = 0, kv: int = 0, block: int = 0, token: int = 0, head: int = 0, e: int = 0
    ) -> tuple[int, int]:
        coord = algebra.Coord(layer, kv // pair, block, token, head, (kv % pair) * row + e)
        return algebra.offset(layout, coord, s, block_stride)

    # A row's pieces: the stretches of elements contiguous in one tensor (regions split it).
    probes = {e: at(e=e) for e in _piece_starts(at, row)}
    starts = sorted(probes)
    pieces = tuple((e0, e1 - e0) for e0, e1 in zip(starts, [*starts[1:], row], strict=True))
    pointer = np.zeros((nl, kvs * pair, len(pieces)), dtype=np.int64)
    offset = np.zeros_like(pointer)
    strides = np.zeros((len(pieces), 3), dtype=np.int64)
    for q, (e0, _) in enumerate(pieces):
        p0, o0 = probes[e0]
        for i, (n, step) in enumerate(((nb, {"block": 1}), (bs, {"token": 1}), (heads, {"head": 1}))):
            if n > 1:
                p1, o1 = at(e=e0, **step)
                if p1 != p0:
                    raise BlockMapError(f"{layout}: moving one {_LEVEL_NAMES[i + 1]} changes tensors")
                strides[q, i] = (o1 - o0) * element_size
        for layer in range(nl):
            for kv in range(kvs * pair):
                p, o = at(layer, kv, e=e0)
                pointer[layer, kv, q], offset[layer, kv, q] = p, o * element_size
    for a in (pointer, offset, strides):
        a.setflags(write=False)
    byte_pieces = tuple((e0 * element_size, n * element_size) for e0, n in pieces)
    return _JobGeometry(kvs * pair, heads, row * element_size, byte_pieces, pointer, offset, strides, nb, bs)


def _piece_starts(at: Callable[..., tuple[int, int]], row: int) -> list[int]:
    """The elements of a row where a contiguous piece starts, found by bisection: a row's
    elements lie in order (regions one after another), so a stretch whose ends are as far
    apart in memory as in the row is contiguous. O(pieces x log row) probes, not one per
    element (a peer may describe rows of millions)."""
    starts = [0]
    stack = [(0, row - 1)]  # stretches [a, b] whose pieces are not known yet
    while stack:
        a, b = stack.pop()
        (pa, oa), (pb, ob) = at(e=a), at(e=b)
        if pa == pb and ob - oa == b - a:
            continue  # one piece
        if b == a + 1:
            starts.append(b)
            continue
        mid = (a + b) // 2
        stack += [(mid, b), (a, mid)]
    return sorted(set(starts))


def _split_pages(layout: Layout, sizes: dict[str, int], block_size: int | None, where: str) -> dict[str, int]:
    """Sizes with the block count and block size apart (a folded page axis split)."""
    if layout.axis_of(Role.BLOCK) is not None and layout.size_of(sizes, Role.TOKEN) is not None:
        return sizes
    page = layout.symbol_of(Role.PAGE)
    if block_size is None:
        raise BlockMapError(
            f"{where}: {layout} folds its blocks and their tokens into one axis ({page}): pass its "
            "block size (block_map's src_block_size= / dst_block_size=, or describe(block_size=))"
        )
    total = layout.size_of(sizes, Role.PAGE)
    try:
        block_size = as_int(block_size, "the block size")  # a NumPy integer too
    except TypeError:
        raise BlockMapError(f"{where}: the block size must be a positive int, got {block_size!r}") from None
    if block_size <= 0:
        raise BlockMapError(f"{where}: the block size must be a positive int, got {block_size!r}")
    if total is None or total % block_size:
        raise BlockMapError(
            f"{where}: {layout}'s {total} token slots are not a multiple of blocks of {block_size}"
        )
    return {
        **sizes,
        **algebra.sizes_by_role(layout, {Role.BLOCK: total // block_size, Role.TOKEN: block_size}),
    }


# -- sides --------------------------------------------------------------------------------


class Side:
    """One side of a map: where each (layer, K/V, piece) lives, the tensors and the shard.

    Built from a kernel group (live: ``copy()`` may run), a peer's description (addresses
    only) or a chunk (:func:`chunk_side`). Arrays are over (layer, K/V, piece).
    """

    def __init__(
        self,
        *,
        label: str,
        layout: Layout | None,
        data: str,
        layers: tuple[int, ...],
        kv: int,
        heads: int,
        has_heads: bool,
        pieces: np.ndarray,
        piece_dtypes: tuple[str, ...],
        tensor: np.ndarray,
        offset: np.ndarray,
        strides: np.ndarray,
        addresses: np.ndarray,
        spans: np.ndarray,
        num_blocks: int,
        block_size: int,
        device: tuple[str, int | None],
        shard: Shard | None,
        owner: Any,
        placement: Placement | None = None,
        repeats: np.ndarray | None = None,
        opaque_pages: OpaquePages | None = None,
    ) -> None:
        self.label, self.layout, self.data, self.layers = label, layout, data, layers
        self.kv, self.heads, self.has_heads = kv, heads, has_heads
        self.pieces, self.piece_dtypes = pieces, piece_dtypes
        self.tensor, self.offset, self.strides = tensor, offset, strides
        self.addresses, self.spans = addresses, spans
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device, self.shard, self.owner = device, shard, owner
        self.opaque_pages = opaque_pages  # rows that are a page's bytes, not tokens' (vLLM's group edits)
        self._placement = placement  # a live side's tensors, where its addresses were read
        # Per tensor (index into addresses): an earlier tensor's again, a layer sharing its
        # KV cache. Such a layer's bytes are the earlier one's: a map writes them once.
        self.repeats = np.zeros(len(addresses), dtype=bool) if repeats is None else repeats
        self.row_bytes = int(pieces[-1, 0] + pieces[-1, 1])
        self._pairs: weakref.WeakKeyDictionary[Side, dict[object, _Pair]] = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return f"Side({self.label}, {self.num_blocks} blocks of {self.block_size}, {self.device[0]})"

    @property
    def live(self) -> bool:
        """The side holds its tensors (a registration or a chunk), so ``copy()`` may run."""
        return self.owner is not None

    def moved(self) -> str | None:
        """What of a live side's memory moved since its addresses were read (an engine
        that re-allocated its cache in place: ``kv_caches[3] was re-allocated ...``), or
        None; None for a description (a peer's addresses, nothing here to move). A copy
        through the old addresses would write freed memory, so what copies asks first."""
        return None if self._placement is None else self._placement.moved()

    # What a transfer engine reads of a side (kvlayout.transfer.nixl's MapSide).

    @property
    def is_local(self) -> bool:
        """The side's tensors are in this process (a live side), not a peer's."""
        return self.live

    @property
    def device_type(self) -> str:
        return self.device[0]

    @property
    def device_index(self) -> int:
        """The device id a transfer engine is given (0 for the CPU)."""
        return self.device[1] or 0

    @functools.cached_property
    def tensor_spans(self) -> np.ndarray:
        """``(K, 2)`` uint64: each tensor's first byte and its byte span (first byte to
        past the last, padding between blocks included), from :attr:`spans`."""
        start, period, block, blocks = (self.spans[:, i] for i in range(4))
        out = np.stack([start, (blocks - np.uint64(1)) * period + block], axis=1).astype(np.uint64)
        out.setflags(write=False)
        return out


def _data_kind(layout: Layout, kv: int, has_heads: bool) -> str:
    if layout.is_indexer:
        return "a DSA indexer key row per token"
    if not has_heads:
        return "one latent row per token (MLA)"
    return "K and V rows per head (MHA)" if kv == 2 else "one K or V row per head"


def side_of_group(
    group: GroupDescription,
    device: tuple[str, int | None],
    shard: Shard | None,
    owner: Any,
    where: str,
    placement: Placement | None = None,
) -> Side:
    layout = group.layout
    jobs = []
    for plane in group.planes:
        sizes = _split_pages(layout, plane.sizes_dict(), group.block_size, where)
        jobs.append(
            _job_geometry(layout, tuple(sorted(sizes.items())), plane.block_stride, plane.element_size)
        )
    first = jobs[0]
    has_heads = not algebra.is_latent(layout, group.planes[0].sizes_dict())
    if len(jobs) > 1 and first.heads != 1:
        raise BlockMapError(
            f"{where}: {layout} has planes and {first.heads} heads; a row of planes has one head"
        )
    pieces, dtypes, tensors, offsets, strides = [], [], [], [], []
    row, base = 0, 0
    for plane, job in zip(group.planes, jobs, strict=True):
        pieces += [(row + c0, w) for c0, w in job.pieces]
        dtypes += [plane.dtype] * len(job.pieces)
        tensors.append(job.pointer + base)
        offsets.append(job.offset)
        strides.append(job.strides)
        row += job.row_bytes
        base += len(plane.addresses)
    spans = []
    for plane in group.planes:
        period, block, blocks = plane.extent()
        spans += [(a, period, block, blocks) for a in plane.addresses]
    return Side(
        label=f"layers {index_ranges(group.layers)}: {group.label()}",
        layout=layout,
        data=_data_kind(layout, first.kv, has_heads),
        layers=group.layers,
        kv=first.kv,
        heads=first.heads,
        has_heads=has_heads,
        pieces=np.array(pieces, dtype=np.int64),
        piece_dtypes=tuple(dtypes),
        tensor=np.concatenate(tensors, axis=2),
        offset=np.concatenate(offsets, axis=2),
        strides=np.concatenate(strides, axis=0),
        addresses=np.array([a for p in group.planes for a in p.addresses], dtype=np.uint64),
        repeats=np.concatenate([np.isin(np.arange(len(p.addresses)), p.repeats) for p in group.planes]),
        spans=np.array(spans, dtype=np.uint64).reshape(-1, 4),
        num_blocks=first.num_blocks,
        block_size=first.block_size,
        device=device,
        shard=shard,
        owner=owner,
        placement=placement,
        opaque_pages=group.opaque_pages,
    )


@functools.lru_cache(maxsize=64)
def _side_of_description(desc: RegistrationDescription, block_size: int | None, where: str) -> Side:
    if len(desc.groups) != 1:
        listed = "; ".join(g.label() for g in desc.groups)
        raise BlockMapError(
            f"{where}: the description has {len(desc.groups)} kernel groups ({listed}); a block "
            "map moves one: pass description.group(i)"
        )
    group = desc.groups[0]
    if block_size is not None and group.block_size is None:
        group = replace(group, block_size=block_size)
    return side_of_group(group, (desc.device_type, desc.device_index), desc.shard, None, where)


def _side_of_kernel_group(group: Any, block_size: int | None, where: str) -> Side:
    if not group.layout.is_pbs_fused:
        block_size = None  # blocks of its own: a size given names the caller's blocks (_pages_per_block)
    key = ("block map side", block_size)
    side = group.memo.get(key)
    if side is None and group.device.type == "meta":
        raise BlockMapError(
            f"{where} is a meta registration, which has no addresses: plan from "
            "registration.describe(at=...) (its tensors laid out from a made-up address)"
        )
    if side is None:
        placement = group_placement(group, BlockMapError, f"{where}: ")
        if block_size is not None:  # the caller's, named as theirs (describing checks it as a peer's)
            _split_pages(group.layout, dict(group.planes[0].sizes), block_size, where)
        desc = describe_group(group, block_size=block_size)
        device = (desc.device_type, desc.device_index)
        # The side holds the group's tensors (its placement's), not the group: the group
        # keeps the side in its memo, and a cycle through it would keep a dropped cache's
        # memory until the cyclic collector runs (never seen by it, for GPU memory).
        side = side_of_group(desc.groups[0], device, None, placement, where, placement)
        group.memo[key] = side
    assert isinstance(side, Side)
    return side


def _as_side(obj: Any, block_size: int | None, where: str) -> Side:
    if isinstance(obj, Side):
        return obj
    if isinstance(obj, RegistrationDescription):
        return _side_of_description(obj, block_size, where)
    if isinstance(obj, RegisteredKV):
        obj = obj.registration
    if isinstance(obj, Registration):
        try:
            obj = obj.only_group("a block map moves one: map")
        except RegistrationError as exc:
            raise BlockMapError(f"{where}: {exc}") from None
    if isinstance(obj, KernelGroup):
        return _side_of_kernel_group(obj, block_size, where)
    group = (
        " (a peer's kernel group is description.group(i), a description of its own)"
        if isinstance(obj, GroupDescription)
        else ""
    )
    raise TypeError(
        f"{where} is a {type(obj).__name__}; block_map takes what detection returns (a Registration with one "
        f"kernel group, or a KernelGroup) or a RegistrationDescription{group}"
    )


def chunk_side(group: Any, chunk: torch.Tensor, *, block_size: int | None = None) -> Side:
    """A chunk ``[kv_size, NL, T, row]`` (``kvlayout.transfer``'s token-major buffer) as a
    side: one block of ``T`` tokens whose (layer, K/V) slabs hold token rows of the
    group's planes back to back. ``block_map(group, chunk_side(group, chunk), ids, [0])``
    is ``store_blocks`` of those ids into the chunk."""
    cache = _as_side(group, block_size, "the cache")
    if not isinstance(chunk, torch.Tensor):
        raise TypeError(f"chunk must be a tensor, not {type(chunk).__name__}")
    kv_size = cache.kv if cache.layout is None or not cache.layout.is_fused_packed else 1
    pair = cache.kv // kv_size  # K/V planes one chunk row holds side by side
    nl = len(cache.layers)
    itemsize = chunk.element_size()
    row_bytes = cache.heads * cache.row_bytes * pair
    if (
        chunk.dim() != 4
        or tuple(chunk.shape[:2]) != (kv_size, nl)
        or chunk.shape[3] * itemsize != row_bytes
        or not chunk.is_contiguous()
        or chunk.shape[2] == 0
    ):
        raise BlockMapError(
            f"the chunk has shape {list(chunk.shape)} (contiguous: {chunk.is_contiguous()}); this cache "
            f"needs a contiguous [{kv_size}, {nl}, T, {row_bytes // itemsize}] (kv_size, layers, tokens, row)"
        )
    # paired as block_map pairs two caches (fp8 and the uint8 it is stored as hold the same bytes)
    if not _same_bytes(str(chunk.dtype).removeprefix("torch."), cache.piece_dtypes[0]):
        raise BlockMapError(f"the chunk is {chunk.dtype}; the cache is {cache.piece_dtypes[0]}")
    size = chunk.numel() * itemsize
    problem = not_strided(chunk) or no_memory(chunk)  # fake, freed or shrunk: before its data pointer
    if problem is not None:
        raise BlockMapError(f"the chunk {problem}")
    tokens = int(chunk.shape[2])
    # A token's chunk row: each head's row in turn (K and V side by side where the cache
    # packs them), a head's row its pieces back to back (the planes, one head, for MLA).
    piece_starts = cache.pieces[:, 0]
    k = np.arange(cache.kv)
    layer = np.arange(nl)
    slab = ((k // pair)[None, :] * nl + layer[:, None]) * tokens * row_bytes  # (NL, KV)
    offset = slab[:, :, None] + ((k % pair) * cache.row_bytes)[None, :, None] + piece_starts[None, None, :]
    strides = np.array([[0, row_bytes, cache.row_bytes * pair]] * len(piece_starts), dtype=np.int64)
    return Side(
        label=f"chunk {list(chunk.shape)} {chunk.dtype}",
        layout=None,
        data=cache.data,
        layers=cache.layers,
        kv=cache.kv,
        heads=cache.heads,
        has_heads=cache.has_heads,
        pieces=cache.pieces,
        piece_dtypes=cache.piece_dtypes,
        tensor=np.zeros(offset.shape, dtype=np.int64),
        offset=offset,
        strides=strides,
        addresses=np.array([chunk.data_ptr()], dtype=np.uint64),
        spans=np.array([[chunk.data_ptr(), size, size, 1]], dtype=np.uint64),
        num_blocks=1,
        block_size=tokens,
        device=(chunk.device.type, chunk.device.index),
        shard=cache.shard,
        owner=chunk,
        placement=Placement([chunk], ["the chunk"]),
    )


# -- a pair of sides ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Pair:
    """Everything a map between two sides needs but the block ids."""

    slabs: np.ndarray  # (S, 10) uint64, csrc/block_map.h's Slab rows
    group_starts: np.ndarray
    order: tuple[int, int, int, int]
    heads: range  # model heads mapped
    src_classes: np.ndarray
    dst_classes: np.ndarray
    src_shard: Shard | None
    dst_shard: Shard | None
    # Whether copies between these sides prefetch ahead of themselves, measured per kind
    # of map (csrc/prefetch_choice.h).
    prefetch: Any = field(default_factory=_native.PrefetchChoices, compare=False)


@functools.lru_cache(maxsize=64)
def _whole(heads: int) -> Shard:
    """TP 1 over ``heads`` heads (a Shard is immutable: one per head count serves every
    map; validating a new one was a twentieth of a map's build)."""
    return Shard(0, 1, heads)


def _heads(side: Side, shard: Shard | None, where: str) -> Shard | None:
    if shard is not None and not isinstance(shard, Shard):
        raise TypeError(f"{where}_shard must be a kvlayout.transfer.Shard, not {type(shard).__name__}")
    if side.shard is not None:
        if shard is not None and shard != side.shard:
            raise ShardError(f"{where}_shard is {shard}, but the {where} description says {side.shard}")
        shard = side.shard
    if not side.has_heads:
        return shard  # latents: every rank holds them whole
    if shard is None or side.opaque_pages is not None:
        # an opaque page's head axis (vLLM's LHBNC head slots) counts the kernel's slots, not
        # the model's heads: every slot moves, the ranks are checked equal (_check_opaque_pages)
        return _whole(side.heads)
    if len(shard.heads) != side.heads:
        raise ShardError(
            f"{where}_shard {shard} holds {len(shard.heads)} KV heads, but the {where} cache has "
            f"{side.heads} "
            f"({side.label})"
        )
    return shard


def _same_bytes(a: str, b: str) -> bool:
    """Whether elements of dtypes ``a`` and ``b`` are the same bytes: the same dtype, or an
    fp8 one and uint8, which vLLM and SGLang register fp8 caches as (their kernels view
    the bytes as fp8; which fp8 is the engines' configuration, as on one engine)."""
    pair = {a, b}
    return a == b or ("uint8" in pair and any(d.startswith("float8") for d in pair))


def _check_same_data(src: Side, dst: Side) -> None:
    a, b = set(src.piece_dtypes), set(dst.piece_dtypes)
    if len(a) == len(b) == 1 and not _same_bytes(src.piece_dtypes[0], dst.piece_dtypes[0]):
        raise BlockMapError(
            f"src is {src.piece_dtypes[0]} and dst is {dst.piece_dtypes[0]}: a map copies bytes, "
            "dtypes must agree (fp8 and uint8 do: the bytes of fp8 stored as uint8)"
        )
    if src.data != dst.data:
        one_head = [  # one head of K | V packed: what an MLA cache of that shape reads as unhinted
            w
            for w, side in (("src", src), ("dst", dst))
            if side.has_heads and side.heads == 1 and side.layout is not None and side.layout.is_fused_packed
        ]
        hint = ""
        if one_head and not (src.has_heads and dst.has_heads):
            hint = (
                f" ({one_head[0]} is one head of K and V packed: an MLA cache of that shape reads so unless "
                "detected with the MLA hint kv_dim=1)"
            )
        raise BlockMapError(f"src holds {src.data} and dst {dst.data}: they do not hold the same data{hint}")
    if src.layers != dst.layers:
        raise BlockMapError(
            f"src holds layers {index_ranges(src.layers)} and dst layers "
            f"{index_ranges(dst.layers)}; a map moves layer i to layer i"
        )
    if src.row_bytes != dst.row_bytes:
        raise BlockMapError(
            f"src rows are {src.row_bytes} bytes a head and dst rows {dst.row_bytes} ({src.label}; "
            f"{dst.label})"
        )


def _cached_pair(
    src: Side, dst: Side, src_shard: Shard | None, dst_shard: Shard | None, only: range | None = None
) -> _Pair:
    """``_pair`` of these sides and shards, built once and kept with ``src``."""
    per_dst = src._pairs.setdefault(dst, {})
    key = (src_shard, dst_shard, only)
    pair = per_dst.get(key)
    if pair is None:
        pair = _pair(src, dst, src_shard, dst_shard, only)
        per_dst[key] = pair
    return pair


def _groups_of(
    pair: _Pair, tokens: int,
    src_ids: np.ndarray, src_block_size: int, dst_ids: np.ndarray, dst_block_size: int,
    force_sort: bool = False, blocks_one_by_one: bool = False, slabs_one_by_one: bool = False,
) -> tuple[np.ndarray, int]:  # fmt: skip
    """The native builder's groups (read-only) and the runs they hold, for a request of
    ``tokens`` over a pair."""
    groups, num_runs, _ = _native.build_groups(
        pair.slabs, pair.group_starts, pair.order, len(pair.heads), tokens,
        src_ids, src_block_size, dst_ids, dst_block_size, pair.src_classes, pair.dst_classes,
        force_sort, blocks_one_by_one, slabs_one_by_one,
    )  # fmt: skip
    groups.setflags(write=False)
    return groups, int(num_runs)


def _pair(
    src: Side, dst: Side, src_shard: Shard | None, dst_shard: Shard | None, only: range | None = None
) -> _Pair:
    """The slabs both sides hold, of the model heads both shards hold (and ``only``
    holds, where given: a side's map to itself, of another pair's heads)."""
    _check_same_data(src, dst)
    if src.has_heads:
        assert src_shard is not None and dst_shard is not None
        if src_shard.num_kv_heads != dst_shard.num_kv_heads:
            raise ShardError(
                f"src_shard {src_shard} and dst_shard {dst_shard} disagree on the model's KV heads (a shard "
                "not given is TP 1 over the cache's own heads)"
            )
        a, b = src_shard.heads, dst_shard.heads
        lo = max(a.start, b.start, only.start if only is not None else 0)
        heads = range(lo, max(lo, min(a.stop, b.stop, only.stop if only is not None else b.stop)))
        src_head0, dst_head0 = heads.start - a.start, heads.start - b.start
    else:
        heads, src_head0, dst_head0 = range(1), 0, 0
    # Common pieces of a head's row: cut where either side's pieces are.
    cuts = np.union1d(src.pieces[:, 0], dst.pieces[:, 0])
    widths = np.diff(np.append(cuts, src.row_bytes))
    sp = np.searchsorted(src.pieces[:, 0], cuts, side="right") - 1
    dp = np.searchsorted(dst.pieces[:, 0], cuts, side="right") - 1
    for q in range(len(cuts)):
        a_dtype, b_dtype = src.piece_dtypes[sp[q]], dst.piece_dtypes[dp[q]]
        if not _same_bytes(a_dtype, b_dtype):
            raise BlockMapError(
                f"src is {a_dtype} and dst is {b_dtype}: a map copies bytes, dtypes must agree "
                "(fp8 and uint8 do: the bytes of fp8 stored as uint8)"
            )

    def side_arrays(side: Side, p: np.ndarray, head0: int) -> list[np.ndarray]:
        st = side.strides[p]  # (Q, 3)
        tensor = side.tensor[:, :, p]
        offset = side.offset[:, :, p] + (cuts - side.pieces[p, 0]) + head0 * st[:, 2]
        base = side.addresses[tensor] + offset.astype(np.uint64)
        shape = tensor.shape
        return [
            base.ravel(),
            tensor.ravel(),
            *(np.broadcast_to(st[:, i], shape).ravel() for i in range(3)),
        ]

    s_base, s_tensor, s_sb, s_sj, s_sh = side_arrays(src, sp, src_head0)
    d_base, d_tensor, d_sb, d_sj, d_sh = side_arrays(dst, dp, dst_head0)
    width = np.broadcast_to(widths, src.tensor[:, :, sp].shape).ravel()
    # A destination layer that shares an earlier layer's KV cache is written as that layer.
    by_dst = np.lexsort((d_base, dst.addresses[d_tensor]))
    by_dst = by_dst[~dst.repeats[d_tensor[by_dst]]]
    cols = [
        col[by_dst] for col in (s_base, d_base, s_tensor, d_tensor, width, s_sb, s_sj, s_sh, d_sb, d_sj, d_sh)
    ]
    s_base, d_base, s_tensor, d_tensor, width, s_sb, s_sj, s_sh, d_sb, d_sj, d_sh = cols
    # Join slabs contiguous on both sides (a packed K/V row, consecutive pieces).
    same = np.ones(len(width) - 1, dtype=bool)
    for col in (s_tensor, d_tensor, s_sb, s_sj, s_sh, d_sb, d_sj, d_sh):
        same &= col[1:] == col[:-1]
    joins = same & (d_base[1:] == d_base[:-1] + width[:-1].astype(np.uint64))
    joins &= s_base[1:] == s_base[:-1] + width[:-1].astype(np.uint64)
    first = np.flatnonzero(np.concatenate(([True], ~joins)))
    width = np.add.reduceat(width, first)
    s_base, d_base, s_tensor, d_tensor, s_sb, s_sj, s_sh, d_sb, d_sj, d_sh = (
        col[first] for col in (s_base, d_base, s_tensor, d_tensor, s_sb, s_sj, s_sh, d_sb, d_sj, d_sh)
    )
    n = len(width)
    group_starts = np.flatnonzero(np.concatenate(([True], d_tensor[1:] != d_tensor[:-1])))
    group_starts = np.append(group_starts, n).astype(np.int64)
    # The destination's nest: levels by their strides, outermost first; a level with one
    # entry goes outside (it orders nothing). Block, slot and head steps are one slab's:
    # slabs of unequal width (a latent plane and a rope plane) have unequal strides, and a
    # block step of one beside the slot step of another can sort slots outside blocks.
    steps = np.diff(d_base.astype(np.int64))[d_tensor[1:] == d_tensor[:-1]]
    level_steps = {
        SLAB: int(steps.min()) if steps.size else None,
        BLOCK: int(d_sb[0]) if dst.num_blocks > 1 else None,
        SLOT: int(d_sj[0]) if dst.block_size > 1 else None,
        HEAD: int(d_sh[0]) if len(heads) > 1 else None,
    }
    flat = [lvl for lvl, step in level_steps.items() if step is None and lvl != SLOT]
    nested = sorted(
        (lvl for lvl, step in level_steps.items() if step is not None), key=lambda lv: -(level_steps[lv] or 0)
    )
    levels = [*flat, *nested]
    if SLOT not in levels or levels.index(SLOT) < levels.index(BLOCK):
        # one slot a block, or a block within a slot's stride (the walker counts a block's
        # slots from its block, so blocks are always outside slots): right inside blocks
        levels = [lvl for lvl in levels if lvl != SLOT]
        levels.insert(levels.index(BLOCK) + 1, SLOT)
    order = tuple(levels)
    # Each slab's tail: the innermost levels (inside the slab level) contiguous on both sides.
    tail = np.zeros(n, dtype=np.int64)
    run = width.astype(np.int64)
    ok = np.ones(n, dtype=bool)
    for lvl in reversed(order[order.index(SLAB) + 1 :]):
        if lvl == HEAD:
            ok &= (s_sh == run) & (d_sh == run)
            tail += ok
            run = np.where(ok, run * len(heads), run)
        elif lvl == SLOT:
            ok &= (s_sj == run) & (d_sj == run)
            tail += ok
            if order[-1] == SLOT and order[-2] == HEAD and src.block_size == dst.block_size:
                # heads outside tokens on both sides: a full block's heads are one stretch
                block = run * dst.block_size
                tail += ok & (s_sh == block) & (d_sh == block) & (len(heads) > 1)
            break
        else:
            break
    src_classes, s_class = np.unique(np.stack([s_sb, s_sj], axis=1), axis=0, return_inverse=True)
    dst_classes, d_class = np.unique(np.stack([d_sb, d_sj], axis=1), axis=0, return_inverse=True)
    # each column as uint64 before stacking: uint64 addresses stacked with int64 columns
    # would go through float64, which rounds addresses past 2**53
    slabs = np.stack(
        [
            np.asarray(col).astype(np.uint64, copy=False)
            for col in (
                s_base,
                d_base,
                s_tensor,
                d_tensor,
                width,
                s_sh,
                d_sh,
                s_class.ravel(),
                d_class.ravel(),
                tail,
            )
        ],
        axis=1,
    )
    return _Pair(
        np.ascontiguousarray(slabs),
        group_starts,
        order,  # type: ignore[arg-type]
        heads,
        np.ascontiguousarray(src_classes.astype(np.uint64)),
        np.ascontiguousarray(dst_classes.astype(np.uint64)),
        src_shard,
        dst_shard,
    )


# -- the map ----------------------------------------------------------------------------------


def fingerprint(runs: np.ndarray) -> str:
    """16 hex digits of BLAKE2b over an ``(N, 3)`` uint64 run table (addresses and
    lengths, in order): two tables are the same map exactly when these agree, barring a
    2**-64 chance. About 10 ms for half a million runs (12 MiB)."""
    table = np.ascontiguousarray(runs, dtype=np.uint64)
    return hashlib.blake2b(table.data, digest_size=8).hexdigest()  # its bytes, not a copy


class BlockMap(HoldsAddresses):
    """One request's KV as byte runs from ``src`` to ``dst`` (see :func:`block_map`).

    ``runs`` is an ``(N, 3)`` uint64 array (source address, destination address, length),
    in destination order; ``kind`` says what differs between the sides and ``reason`` how.
    The map holds its runs as groups (rows of runs at one step, rows at one step:
    ``csrc/run_groups.h``), so building it writes little; ``copy()`` reads them back a
    buffer at a time, and ``runs`` expands them on first use.
    """

    def __init__(
        self, src: Side, dst: Side, pair: _Pair, ids: tuple[np.ndarray, np.ndarray], num_tokens: int
    ) -> None:
        self.src, self.dst = src, dst
        self.heads = pair.heads
        self.num_tokens = num_tokens
        self._pair, self._ids = pair, ids
        self._groups, self._num_runs = self._build_groups(force_sort=False)

    @functools.cached_property
    def _kind_and_reason(self) -> tuple[str, str]:
        p = self._pair
        return _kind(self.src, self.dst, p.heads, p.src_shard, p.dst_shard)

    @property
    def kind(self) -> str:
        """What differs between the sides: ``same layout``, or some of ``head slice``,
        ``re-blocked``, ``permuted``, ``re-laid`` and ``chunk``; ``empty`` when no head is
        in common. It is the pair's: a request of no tokens keeps it, with no runs."""
        return self._kind_and_reason[0]

    @property
    def reason(self) -> str:
        """The kind, with the numbers: which heads, which block sizes, which orders."""
        return self._kind_and_reason[1]

    def _build_groups(
        self, force_sort: bool, blocks_one_by_one: bool = False, slabs_one_by_one: bool = False
    ) -> tuple[np.ndarray, int]:
        """The groups from the native builder and the runs they hold; ``force_sort`` takes
        its sorting path, ``blocks_one_by_one`` its general walk for every block,
        ``slabs_one_by_one`` a walk of every slab (none pasted from a slab of its shape)
        (tests hold each path to one answer)."""
        (src_ids, dst_ids), sizes = self._ids, (self.src.block_size, self.dst.block_size)
        return _groups_of(
            self._pair, self.num_tokens, src_ids, sizes[0], dst_ids, sizes[1],
            force_sort, blocks_one_by_one, slabs_one_by_one,
        )  # fmt: skip

    def _build(self, force_sort: bool) -> np.ndarray:
        """The runs of one of the builder's paths, expanded."""
        return _expand(self._build_groups(force_sort)[0])

    @functools.cached_property
    def runs(self) -> np.ndarray:
        """The ``(N, 3)`` uint64 runs (source, destination, length), read-only, expanded
        from the groups on first use (12 MiB for half a million runs)."""
        return _expand(self._groups)

    @property
    def num_runs(self) -> int:
        return self._num_runs

    @functools.cached_property
    def fingerprint(self) -> str:
        """The runs digested (:func:`fingerprint`): equal for the maps both halves of a
        peer-staged request build from the same arguments (the poster's, and the peer's
        against the poster's description), different for other block ids, tokens or
        shards. A connector sends it with the request and the peer passes it as
        ``expect=`` to its copy, the one check that both lay the staging buffer out alike."""
        return fingerprint(self.runs)

    @property
    def num_groups(self) -> int:
        """How many groups the map holds its runs in (at most ``num_runs``): how compact
        it is."""
        return len(self._groups)

    @functools.cached_property
    def num_bytes(self) -> int:
        g = self._groups
        return int((g[:, 2] * g[:, 3] * g[:, 6]).sum()) if len(g) else 0

    def _side_runs(self, col: int) -> int | None:
        """How many runs the map's bytes make on one side alone (``col`` 0: the source,
        1: the destination): stretches of that side's memory, each inside one of its
        tensors, as few as that side allows (the fewest descriptors a transfer engine can
        move the request through there). They are the runs of the map from that side to
        itself, built like any map, with no sort of this map's runs; None where the side's
        block ids repeat (its bytes would be counted twice) and, for the source, where the
        destination has layers that share a KV cache (the source's layers they stand for
        are not read)."""
        one, shard = (self.src, self._pair.src_shard) if col == 0 else (self.dst, self._pair.dst_shard)
        ids = self._ids[col]
        if _native.first_repeated_block_id(ids, 0, one.num_blocks) >= 0:
            return None
        if col == 0 and self.dst.repeats.any():
            return None
        if not self.heads or self.num_tokens == 0:
            return 0
        pair = _cached_pair(one, one, shard, shard, only=self.heads)
        return _groups_of(pair, self.num_tokens, ids, one.block_size, ids, one.block_size)[1]

    def __repr__(self) -> str:
        return (
            f"BlockMap({self.kind}: {self.num_tokens} tokens, {self.num_runs} runs, {self.num_bytes} bytes; "
            f"{self.src.label} -> {self.dst.label})"
        )

    def copy(self, num_threads: int = 1) -> int:
        """Copy the runs (validated first: every run inside one tensor's blocks on each
        side, destination runs disjoint); GIL released. Returns the threads used. On a GPU
        the copy is queued on the current stream and this returns before the bytes move,
        as any CUDA copy does (``num_threads`` does not apply; 1 is returned)."""
        threads = threads_arg(num_threads, BlockMapError)
        # No caller code between the checks and the copy: a tensor subclass's
        # __torch_function__ would otherwise run in each data_ptr() the checks read.
        with torch._C.DisableTorchFunctionSubclass():
            return self._copy(threads)

    def _copy(self, threads: int) -> int:
        for where, side in (("src", self.src), ("dst", self.dst)):
            if not side.live:
                raise BlockMapError(
                    f"the {where} side is a RegistrationDescription: its addresses are a peer's, so copy() "
                    "cannot run this map; send its runs through a transfer engine (NIXL) instead"
                )
            moved = side.moved()
            if moved is not None:
                raise BlockMapError(
                    f"the {where} side's {moved} since the map's addresses were read; copy() would copy "
                    "through the old ones: detect the registration again and build a new map; "
                    "nothing was copied"
                )
        if self.src.device != self.dst.device:
            raise BlockMapError(
                f"src is on {_device_name(self.src.device)} and dst on "
                f"{_device_name(self.dst.device)}; copy() "
                "moves bytes within one device"
            )
        if self.src.device[0] == "cpu":
            problem, run, other, used = _native.copy_groups(
                self._groups, self.src.spans, self.dst.spans, threads, choices=self._pair.prefetch
            )
            self._raise(problem, run, other)
            return int(used)
        self._raise(*_native.validate_groups(self._groups, self.src.spans, self.dst.spans))
        from kvlayout.transfer.cuda import copy_runs  # imports kvlayout._cuda only when called

        copy_runs(self.runs, torch.device(_device_name(self.src.device)))
        return 1

    def _raise(self, problem: int, run: int, other: int) -> None:
        if problem:
            src, dst, length = (int(x) for x in self.runs[run])
            why = (
                _PROBLEMS[problem].format(other=other)
                if other != run
                else "its source and destination overlap"
            )
            raise BlockMapError(
                f"run {run} (source {src:#x}, destination {dst:#x}, {length} bytes) is refused: "
                f"{why}; nothing "
                "was copied"
            )


def _expand(groups: np.ndarray) -> np.ndarray:
    runs = _native.expand_groups(groups)
    runs.setflags(write=False)
    return np.asarray(runs)


def _device_name(device: tuple[str, int | None]) -> str:
    return device[0] if device[1] is None else f"{device[0]}:{device[1]}"


def _int(name: str, value: object) -> int:
    return int_arg(name, value, BlockMapError)


def _block_size(where: str, value: object) -> int | None:
    """``src_block_size`` / ``dst_block_size``: None, or a positive int."""
    if value is None:
        return None
    size = _int(f"{where}_block_size", value)
    if size <= 0:
        raise BlockMapError(f"{where}_block_size must be a positive int, got {value!r}")
    return size


def _length(blocks: Any) -> int | None:
    """How many block ids a sequence holds; None for what has no length (a 0-d tensor)."""
    try:
        return len(blocks)
    except TypeError:
        return None


def _pages_per_block(side: Side, block_size: int | None, where: str) -> int:
    """How many of ``side``'s blocks one of the caller's blocks of ``block_size`` tokens is:
    1 for its own size (or none given); k for a multiple, a block ``b`` of the caller's
    being the side's blocks ``b*k .. b*k + k-1`` (vLLM pages a cache for its attention
    kernel in blocks k times finer than its scheduler's, the k pages of a scheduler
    block contiguous and in order)."""
    if block_size is None or block_size == side.block_size:
        return 1
    if block_size % side.block_size:
        raise BlockMapError(
            f"{where}_block_size={block_size}, but the {where} cache's blocks hold {side.block_size} tokens: "
            f"give its block size or a multiple of it (a block of k of its blocks, in order)"
        )
    per = block_size // side.block_size
    if per > side.num_blocks:
        raise BlockMapError(
            f"{where}_block_size={block_size} is {per} of the {where} cache's blocks, but it has "
            f"{side.num_blocks} ({side.block_size} tokens each)"
        )
    return per


def _ids(name: str, blocks: Any, side: Side, tokens: int, per: int, told: str) -> np.ndarray:
    """The block ids of the caller's blocks (each ``per`` of the side's) that ``tokens``
    fill, checked (``told``: where the token count came from, for the message)."""
    count, size = side.num_blocks // per, side.block_size * per
    needed = -(-tokens // size)
    ids = block_ids_arg(name, blocks, BlockMapError)
    if len(ids) != needed:
        raise BlockMapError(
            f"{name} has {len(ids)} block ids; the request's {tokens} tokens ({told}) fill {needed} "
            f"block{'s' * (needed != 1)} of {size}"
        )
    bad = _native.first_bad_block_id(ids, count)
    if bad >= 0:
        raise BlockMapError(f"{name}[{bad}] = {int(ids[bad])} is out of range for {count} blocks")
    return ids


def _pages(ids: np.ndarray, per: int, pages: int) -> np.ndarray:
    """The first ``pages`` of the side's blocks that the caller's blocks ``ids`` are, each
    ``per`` of the side's in order (the caller's last block may be partly filled)."""
    if per == 1:
        return ids
    return np.ascontiguousarray((ids[:, None] * per + np.arange(per)).ravel()[:pages])


def _kind(
    src: Side, dst: Side, heads: range, src_shard: Shard | None, dst_shard: Shard | None
) -> tuple[str, str]:
    if not heads:
        assert src_shard is not None and dst_shard is not None
        return "empty", (
            f"src holds model heads {_range(src_shard.heads)} and dst {_range(dst_shard.heads)}: "
            "none in common"
        )
    kinds, why = [], []
    if src.has_heads and (len(heads) < src.heads or len(heads) < dst.heads):
        kinds.append("head slice")
        assert src_shard is not None and dst_shard is not None
        why.append(
            f"src holds heads {_range(src_shard.heads)} and dst {_range(dst_shard.heads)}, so the map moves "
            f"heads {_range(heads)}"
        )
    pages = src.opaque_pages or dst.opaque_pages
    if pages is not None:
        whole = "" if pages.rows_are_tokens else ", so a partly filled last block moves whole"
        why.append(f"opaque pages ({pages.layout}): rows are the kernel's page bytes{whole}")
    if src.layout is None or dst.layout is None:
        kinds.append("chunk")
        why.append("between a cache and a token-major chunk [kv_size, NL, T, row]")
        return ", ".join(kinds), "; ".join(why)
    if src.block_size != dst.block_size:
        kinds.append("re-blocked")
        why.append(f"blocks of {src.block_size} tokens into blocks of {dst.block_size}")
    if src.has_heads and len(heads) > 1 and src.layout.is_hnd != dst.layout.is_hnd:
        kinds.append("permuted")  # of one head, NHD and HND blocks hold the same bytes
        order = {True: "HND (heads outside tokens)", False: "NHD (tokens outside heads)"}
        why.append(f"{order[src.layout.is_hnd]} into {order[dst.layout.is_hnd]} within a block")
    elif src.layout != dst.layout:
        kinds.append("re-laid")
        why.append(f"{src.layout} into {dst.layout}: the same order in a block, other tensors and axes")
    elif not np.array_equal(src.pieces[:, 0], dst.pieces[:, 0]):
        kinds.append("re-laid")
        cut = [[int(x) for x in side.pieces[1:, 0]] for side in (src, dst)]
        why.append(f"rows cut into pieces at bytes {cut[0]} and {cut[1]}: other planes")
    if set(src.piece_dtypes) != set(dst.piece_dtypes):  # fp8 and the uint8 it is stored as
        a, b = src.piece_dtypes[0], dst.piece_dtypes[0]
        why.append(f"src stores {a} and dst {b}: the bytes move as they are")
    if not kinds:
        why.insert(0, "both sides store the request alike; runs are as long as the block ids allow")
        return "same layout", "; ".join(why)
    return ", ".join(kinds), "; ".join(why)


def _check_opaque_pages(src: Side, dst: Side, src_shard: Shard | None, dst_shard: Shard | None) -> None:
    """Opaque pages (vLLM's group edits: rows that are bytes of a kernel's page) map only
    to pages laid out alike, whole where a row is no token, rank to the same rank."""
    a, b = src.opaque_pages, dst.opaque_pages
    if (a is None and b is None) or src.layout is None or dst.layout is None:
        return  # caches as engines register them, or a chunk of the cache's own rows
    how = "see docs/vllm-group-edits.md, the opaque-page contract"
    if a is None or b is None:
        edited, other, pages = ("src", "dst", a) if a is not None else ("dst", "src", b)
        assert pages is not None
        raise BlockMapError(
            f"{edited} is opaque pages ({pages.layout}) and {other} is not: an edited group's rows are bytes "
            f"of the kernel's page, not tokens, so it maps only to a group edited alike ({how})"
        )
    if a != b:
        tokens = {True: ", rows are tokens", False: ", rows are no tokens"}
        sa, sb = (f"{p.layout}{tokens[p.rows_are_tokens] if a.layout == b.layout else ''}" for p in (a, b))
        raise BlockMapError(
            f"src and dst are opaque pages laid out differently (src {sa}; dst {sb}): the same "
            f"tokens are other bytes of the page ({how})"
        )
    if not a.rows_are_tokens and src.block_size != dst.block_size:
        raise BlockMapError(
            f"src and dst are opaque pages in blocks of {src.block_size} and {dst.block_size} rows: "
            f"whole pages map only to pages of the same size ({how})"
        )
    ranks = src.shard or src_shard, dst.shard or dst_shard
    if None not in ranks and ranks[0] != ranks[1]:
        raise BlockMapError(
            f"src and dst are opaque pages of {ranks[0]} and {ranks[1]}: a page holds its rank's heads in "
            f"the kernel's order, so it maps only to the same rank's ({how})"
        )


def _range(r: range) -> str:
    return f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start)


def block_map(
    src: Any,
    dst: Any,
    src_blocks: Any,
    dst_blocks: Any,
    *,
    num_tokens: int | None = None,
    src_shard: Shard | None = None,
    dst_shard: Shard | None = None,
    src_block_size: int | None = None,
    dst_block_size: int | None = None,
) -> BlockMap:
    """The byte runs that move tokens ``[0, num_tokens)`` of one request from ``src`` to
    ``dst``: token ``p`` is slot ``p % BS`` of block ``blocks[p // BS]`` on each side.

    ``src`` and ``dst`` are what detection returns (a registration with one kernel group,
    or a kernel group) or a peer's :class:`~kvlayout.registration.peers.RegistrationDescription`
    (then ``copy()`` refuses). Every head both shards hold moves, layer ``i`` to layer
    ``i``, K to K and V to V. ``num_tokens`` defaults to what the shorter block list
    holds; each list must hold exactly the blocks the tokens fill. Destination blocks
    must be distinct.

    ``*_block_size`` split a folded page axis (NB*BS formats). Elsewhere the block size
    is the cache's own, or a multiple of it: the block ids are then in blocks of that
    many tokens, block ``b`` being the cache's blocks ``b*k`` to ``b*k + k-1`` (vLLM's
    scheduler blocks over a cache its attention kernel pages ``k`` times finer).
    """
    src_block_size, dst_block_size = _block_size("src", src_block_size), _block_size("dst", dst_block_size)
    a = _as_side(src, src_block_size, "src")
    b = _as_side(dst, dst_block_size, "dst")
    _check_opaque_pages(a, b, src_shard, dst_shard)
    a_per, b_per = _pages_per_block(a, src_block_size, "src"), _pages_per_block(b, dst_block_size, "dst")
    pair = _cached_pair(a, b, _heads(a, src_shard, "src"), _heads(b, dst_shard, "dst"))
    a_len, b_len = _length(src_blocks), _length(dst_blocks)
    a_size, b_size = a.block_size * a_per, b.block_size * b_per  # the caller's blocks
    if num_tokens is None:
        if a_len is None or b_len is None:
            raise TypeError("src_blocks and dst_blocks must be sequences of block ids")
        tokens = min(a_len * a_size, b_len * b_size)
    else:
        tokens = _int("num_tokens", num_tokens)
        if tokens < 0:
            raise BlockMapError(f"num_tokens must be >= 0, got {tokens}")
    # a row of opaque pages is no token: the last page moves whole (to or from a chunk too)
    opaque = a if a.opaque_pages is not None else b
    if opaque.opaque_pages is not None and not opaque.opaque_pages.rows_are_tokens:
        tokens = -(-tokens // opaque.block_size) * opaque.block_size
        chunk = b if opaque is a else a
        if chunk.layout is None and tokens > chunk.block_size:
            raise BlockMapError(
                f"the chunk holds {chunk.block_size} token rows, but opaque pages move whole pages of "
                f"{opaque.block_size} rows ({tokens} here): a chunk for them holds whole pages"
            )
    told = "what the shorter block list holds" if num_tokens is None else "num_tokens"
    if num_tokens is not None and tokens != num_tokens:
        told = f"num_tokens={num_tokens} rounded up to whole opaque pages"
    src_ids = _ids("src_blocks", src_blocks, a, tokens, a_per, told)
    dst_ids = _ids("dst_blocks", dst_blocks, b, tokens, b_per, told)
    again = _native.first_repeated_block_id(dst_ids, 0, b.num_blocks // b_per)
    if again >= 0:
        earlier = int(np.flatnonzero(dst_ids[:again] == dst_ids[again])[0])
        raise BlockMapError(
            f"dst_blocks[{again}] = {int(dst_ids[again])} repeats dst_blocks[{earlier}]: each "
            "destination slot is written once"
        )
    src_ids = _pages(src_ids, a_per, -(-tokens // a.block_size))
    dst_ids = _pages(dst_ids, b_per, -(-tokens // b.block_size))
    result = BlockMap(a, b, pair, (src_ids, dst_ids), tokens)
    if not (a.live and b.live):  # a peer's addresses: every run must lie inside what it described
        result._raise(*_native.validate_groups(result._groups, a.spans, b.spans))
    return result
