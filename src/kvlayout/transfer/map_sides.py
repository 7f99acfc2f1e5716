"""One side of a block map: where each (layer, K/V, piece of a head's row) of a kernel
group, a peer's description of one, or a chunk lives, asked of the algebra once per side
and cached on the kernel group (:mod:`kvlayout.transfer.block_maps` pairs two sides)."""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from kvlayout.errors import KVLayoutError, SizeError, as_int, index_ranges
from kvlayout.layout import algebra
from kvlayout.layout.ast import Layout
from kvlayout.layout.dtypes import same_bytes
from kvlayout.layout.formats import layout_of
from kvlayout.layout.vocabulary import Role
from kvlayout.registration.describing import describe_group
from kvlayout.registration.kernel_groups import KernelGroup
from kvlayout.registration.memory import HoldsAddresses, Placement, group_placement, no_memory
from kvlayout.registration.nesting import not_strided
from kvlayout.registration.opaque import OpaquePages, PageArray, head_pages_format
from kvlayout.registration.peers import (
    GroupDescription,
    PeerDescriptionError,
    PlaneDescription,
    RegistrationDescription,
)
from kvlayout.registration.registration import RegisteredKV, Registration, RegistrationError
from kvlayout.registration.shards import Shard
from kvlayout.transfer.arguments import lmcache_object_hint

__all__ = [
    "BlockMapError",
    "Side",
    "chunk_shape_for",
    "chunk_side",
    "kernel_page_side",
    "moved_tokens",
    "side_of_group",
]

_LEVEL_NAMES = ("slab", "block", "slot", "head")


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
            "block size (block_map's src_block_size= / dst_block_size=, chunk_side(block_size=), or "
            "describe(block_size=))"
        )
    try:
        block_size = as_int(block_size, "the block size")  # a NumPy integer too
    except TypeError:
        raise BlockMapError(f"{where}: the block size must be a positive int, got {block_size!r}") from None
    if block_size <= 0:
        raise BlockMapError(f"{where}: the block size must be a positive int, got {block_size!r}")
    try:
        return algebra.split_pages(layout, sizes, block_size, "block_size")
    except SizeError as e:
        raise BlockMapError(f"{where}: {layout}: {e}") from None


# -- sides --------------------------------------------------------------------------------


class Side(HoldsAddresses):
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
        described: RegistrationDescription | None = None,
    ) -> None:
        self.label, self.layout, self.data, self.layers = label, layout, data, layers
        self.kv, self.heads, self.has_heads = kv, heads, has_heads
        self.pieces, self.piece_dtypes = pieces, piece_dtypes
        self.tensor, self.offset, self.strides = tensor, offset, strides
        self.addresses, self.spans = addresses, spans
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device, self.shard, self.owner = device, shard, owner
        self.opaque_pages = opaque_pages  # rows that are a page's bytes, not tokens' (vLLM's group edits)
        # A peer's side: the whole description its group is of (every tensor the peer described)
        self.described = described
        self._placement = placement  # a live side's tensors, where its addresses were read
        # Per tensor (index into addresses): an earlier tensor's again, a layer sharing its
        # KV cache. Such a layer's bytes are the earlier one's: a map writes them once.
        self.repeats = np.zeros(len(addresses), dtype=bool) if repeats is None else repeats
        self.row_bytes = int(pieces[-1, 0] + pieces[-1, 1])
        # map_pairs' _Pair with each destination, per (shards, heads): built once a pair
        self._pairs: weakref.WeakKeyDictionary[Side, dict[object, Any]] = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return f"Side({self.label}, {self.num_blocks} blocks of {self.block_size}, {self.device[0]})"

    def replaced(self, **changes: Any) -> Side:
        """This side with ``changes`` to its fields (a new side: no pair of this one's kept).
        The fields are the constructor's, each read back from the attribute of its name."""
        names = _side_fields()
        unknown = set(changes) - set(names)
        if unknown:
            raise TypeError(f"a Side has no field(s) {', '.join(sorted(unknown))}")
        fields = {name: getattr(self, "_placement" if name == "placement" else name) for name in names}
        return Side(**{**fields, **changes})

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

    @property
    def descriptions(self) -> tuple[RegistrationDescription, ...]:
        """A peer's side: the whole description its group is of, whose ``tensor_spans``
        are every tensor the peer described, this side's among them (a peer's staging
        buffer lies apart from them all); () for a live side or a chunk."""
        return () if self.described is None else (self.described,)


@functools.cache
def _side_fields() -> tuple[str, ...]:
    return tuple(name for name in inspect.signature(Side.__init__).parameters if name != "self")


def _data_kind(layout: Layout, kv: int, has_heads: bool) -> str:
    if layout.is_indexer:  # what its regions hold tells fp8 keys with scales from bf16 keys without
        held = algebra.structure(layout).region_dtypes
        return "a DSA indexer key row per token" + (f" ({' + '.join(map(str, held))})" if held else "")
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
    described: RegistrationDescription | None = None,
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
        described=described,
    )


_KERNEL_PAGE_SIDES: weakref.WeakKeyDictionary[Side, Side] = weakref.WeakKeyDictionary()


def kernel_page_side(side: Side, array: PageArray, where: str) -> Side:
    """An opaque side whose pages are an attention kernel's pages of KV heads
    (:func:`~kvlayout.registration.opaque.head_pages`: ``array`` is ``(k, heads, tokens,
    row)``) read as those kernel pages, ``k`` blocks of ``tokens`` for each of its blocks,
    in :func:`~kvlayout.registration.opaque.head_pages_format` over the same tensors (the
    side's memory, shard and owner), built once per side."""
    known = _KERNEL_PAGE_SIDES.get(side)
    if known is not None:
        return known
    k, heads, tokens, row = array.shape
    page = heads * tokens * row * array.itemsize
    block_stride = int(side.strides[0, 0])
    # k kernel pages back to back a block (one page a block may be padded), in whole elements
    packed = (k == 1 and block_stride >= page) or block_stride == k * page
    if side.row_bytes * side.block_size != k * page or not packed or block_stride // k % array.itemsize:
        raise BlockMapError(
            f"{where}: its pages of {side.row_bytes * side.block_size} bytes, {block_stride} apart, are not "
            f"the {k} kernel pages of {page} bytes back to back its array {array} says"
        )
    if k * tokens != side.block_size:  # bytes alike, but heads traded for tokens: a block is its k pages
        raise BlockMapError(
            f"{where}: its blocks of {side.block_size} tokens are not the {k} kernel pages of {tokens} "
            f"tokens its array {array} says"
        )
    fmt = head_pages_format()
    layout = layout_of(fmt)
    roles = {
        Role.LAYER: len(side.layers),
        Role.BLOCK: side.num_blocks * k,
        Role.HEAD: heads,
        Role.TOKEN: tokens,
    }
    per_element = algebra.tensor_shape(layout, algebra.sizes_by_role(layout, {**roles, Role.ELEMENT: 1}))[-1]
    sizes = algebra.sizes_by_role(layout, {**roles, Role.ELEMENT: row // per_element})  # K and V in a row
    shape = algebra.tensor_shape(layout, sizes)
    if shape != (side.num_blocks * k, heads, tokens, row):
        raise BlockMapError(f"{where}: its kernel pages {array} do not read as {layout} (a row of K and V)")
    stride = block_stride // k // array.itemsize
    strides = algebra.tensor_strides(layout, sizes, stride)
    addresses = tuple(int(a) for a in side.addresses)
    plane = PlaneDescription(array.dtype, tuple(sorted(sizes.items())), shape, strides, stride, addresses)
    group = GroupDescription(fmt, side.layers, 0, tokens, (plane,))
    pages = side_of_group(group, side.device, side.shard, side.owner, where, side._placement, side.described)
    pages.label = f"{pages.label}, the kernel pages of {side.label}"
    _KERNEL_PAGE_SIDES[side] = pages
    return pages


@functools.lru_cache(maxsize=64)
def _side_of_description(
    desc: RegistrationDescription, whole: RegistrationDescription, block_size: int | None, where: str
) -> Side:
    """``desc``'s side, keyed by ``whole`` too (``desc.whole`` is not compared: the same
    group of two descriptions is one side per description)."""
    if len(desc.groups) != 1:
        listed = "; ".join(g.label() for g in desc.groups)
        raise BlockMapError(
            f"{where}: the description has {len(desc.groups)} kernel groups ({listed}); a block "
            "map moves one: pass description.group(i)"
        )
    group = desc.groups[0]
    if block_size is not None and group.block_size is None:
        group = replace(group, block_size=block_size)
    device = (desc.device_type, desc.device_index)
    return side_of_group(group, device, desc.shard, None, where, described=whole)


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
        try:
            desc = describe_group(group, block_size=block_size)
        except PeerDescriptionError as e:  # what describing refuses of a live cache: the map's error
            raise BlockMapError(f"{where}: {e}") from None
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
        return _side_of_description(obj, obj.whole or obj, block_size, where)
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


def _chunk_geometry(cache: Side) -> tuple[int, int]:
    """A chunk's ``kv_size`` (1 where the cache packs K and V in a row) and the bytes of
    one token's row: each head's row in turn, K and V side by side where packed."""
    kv_size = cache.kv if cache.layout is None or not cache.layout.is_fused_packed else 1
    return kv_size, cache.heads * cache.row_bytes * (cache.kv // kv_size)


def moved_tokens(side: Side, num_tokens: int) -> int:
    """The token rows a map of ``num_tokens`` moves on ``side``: where its rows are no
    tokens (opaque pages: state, HND kernel pages), a partly filled last page moves
    whole, so up to whole pages."""
    pages = side.opaque_pages
    if pages is None or pages.rows_are_tokens:
        return num_tokens
    return -(-num_tokens // side.block_size) * side.block_size


def pages_per_block(side: Side, block_size: int | None, arg: str, cache: str) -> int:
    """How many of ``side``'s blocks one of the caller's blocks of ``block_size`` tokens is
    (``arg`` names the argument, ``cache`` the side, for the message): 1 for its own size
    (or none given); k for a multiple, a block ``b`` of the caller's being the side's blocks
    ``b*k .. b*k + k-1`` (vLLM pages a cache for its attention kernel in blocks k times
    finer than its scheduler's, the k pages of a scheduler block contiguous and in order).
    Any other size is refused, never ignored."""
    if block_size is None or block_size == side.block_size:
        return 1
    if block_size % side.block_size:
        raise BlockMapError(
            f"{arg}={block_size}, but {cache}'s blocks hold {side.block_size} tokens: "
            f"give its block size or a multiple of it (a block of k of its blocks, in order)"
        )
    per = block_size // side.block_size
    if per > side.num_blocks:
        raise BlockMapError(
            f"{arg}={block_size} is {per} of {cache}'s blocks, but it has "
            f"{side.num_blocks} ({side.block_size} tokens each)"
        )
    return per


def chunk_shape_for(
    group: Any, num_tokens: int, *, block_size: int | None = None
) -> tuple[tuple[int, int, int, int], torch.dtype]:
    """The shape and dtype of the chunk a :func:`block_map` of ``num_tokens`` tokens moves
    to or from (:func:`chunk_side`): ``[kv_size, layers, tokens, row]`` in the cache's
    dtype, ``tokens`` being ``num_tokens`` (a request's tokens exactly), or whole pages
    where the group's rows are no tokens (opaque pages move whole)."""
    tokens = _count_tokens(num_tokens)
    cache = _chunk_cache("chunk_shape_for", group, block_size)
    kv_size, row_bytes = _chunk_geometry(cache)
    dtype = getattr(torch, cache.piece_dtypes[0])
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = moved_tokens(cache, tokens)
    nbytes = kv_size * len(cache.layers) * rows * row_bytes
    if nbytes >= 1 << 63:  # torch's "Storage size calculation overflowed" otherwise, later
        raise BlockMapError(
            f"num_tokens={tokens} makes a chunk of {nbytes} bytes, more than any tensor holds (2**63 - 1)"
        )
    return (kv_size, len(cache.layers), rows, row_bytes // itemsize), dtype


def _chunk_cache(caller: str, group: Any, block_size: int | None) -> Side:
    """The cache a chunk is of, as a side, its ``block_size`` checked here too (a cache of
    blocks of its own never reads it): its own or a multiple, never ignored."""
    if block_size is not None:
        _positive(block_size, "block_size", f"{caller}: block_size must be None or a positive int")
    cache = _as_side(group, block_size, "the cache")
    pages_per_block(cache, block_size, f"{caller}: block_size", "the cache")
    return cache


def _count_tokens(num_tokens: object) -> int:
    return _positive(num_tokens, "num_tokens", "num_tokens must be a positive int")


def _positive(value: object, name: str, must: str) -> int:
    """``value`` as a positive int (numpy and torch ints too), else ``must``, got what."""
    try:
        n = as_int(value, name)
    except TypeError:
        n = 0
    if n <= 0:
        raise BlockMapError(f"{must}, got {value!r}")
    return n


def chunk_side(group: Any, chunk: torch.Tensor, *, block_size: int | None = None) -> Side:
    """A chunk ``[kv_size, NL, T, row]`` (``kvlayout.transfer``'s token-major buffer) as a
    side: one block of ``T`` tokens whose (layer, K/V) slabs hold token rows of the
    group's planes back to back. ``block_map(group, chunk_side(group, chunk), ids, [0])``
    is ``store_blocks`` of those ids into the chunk."""
    cache = _chunk_cache("chunk_side", group, block_size)
    if not isinstance(chunk, torch.Tensor):
        raise TypeError(f"chunk must be a tensor, not {type(chunk).__name__}")
    kv_size, row_bytes = _chunk_geometry(cache)
    pair = cache.kv // kv_size  # K/V planes one chunk row holds side by side
    nl = len(cache.layers)
    itemsize = chunk.element_size()
    # Paired as block_map pairs two caches (fp8 and the uint8 it is stored as hold the same
    # bytes), and first: the shape check's row size is counted in the chunk's elements.
    if not same_bytes(str(chunk.dtype).removeprefix("torch."), cache.piece_dtypes[0]):
        raise BlockMapError(
            f"the chunk is {chunk.dtype}; the cache is {cache.piece_dtypes[0]}: they must agree"
        )
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
            + lmcache_object_hint("chunk", chunk.shape, kv_size, nl, row_bytes // itemsize)
        )
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
