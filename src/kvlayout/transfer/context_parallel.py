"""Context parallelism in block maps: sides that hold a slice of a request's tokens.

Under vLLM's decode context parallelism (DCP) CP rank ``r`` of ``c`` holds the request's
tokens ``p`` with ``(p // I) % c == r`` (``I``: ``cp_kv_cache_interleave_size``), packed in
order: its ``k``-th token, ``k = (p // (I*c)) * I + p % I``, is slot ``k % BS`` of block
``blocks[k // BS]`` (vLLM's ``ComputeSlotMappingKernel``; every rank takes the same block
ids, each id ``c * BS`` of the request's tokens). A side without context parallelism is
``c = 1``: ``k = p``.

A map moves the tokens both sides hold. They come in *granules* of ``g`` tokens (``g``
divides both block sizes and each CP side's interleave), each granule whole on both sides
and inside one block of each. The request is re-paged into pages of one granule: page
``i`` is the ``i``-th granule both sides hold, at a slot of its block on each side
(``csrc/block_map.h``'s page slots), and the native builder walks those pages as it walks
blocks, merging runs wherever both sides continue them. Where every destination token from
the first moved on is moved (a side without CP, or a coarser split, into a CP rank), the
destination keeps its whole blocks and only the source is cut into granules: the walk then
stays in the destination's memory order whatever its nest (blocks outside slabs too).
Where the destination holds more of the request (a CP rank into a side without CP, or into
a coarser split), its blocks are cut into the granules, several a block, and the builder
walks each block's heads outside its pages where slabs are outside blocks (HND): in
memory order too, no sort. The common
granules are enumerated from the side that holds the fewer, so a map costs what a rank
holds, not the request (a block id of a CP side is ``cp_size`` blocks of the request).
Two sides that hold the same tokens at the same places (the same CP rank of the same
split, or no CP) need none of this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvlayout.registration.shards import Shard
from kvlayout.transfer.map_sides import BlockMapError

__all__ = ["Repaged", "TokenSlice", "check_servable", "held", "overlap", "repage", "token_slice"]


@dataclass(frozen=True)
class TokenSlice:
    """Which of a request's tokens a side holds: CP rank ``rank`` of ``size``, ``interleave``
    tokens at a time (``size == 1``: every token)."""

    size: int = 1
    rank: int = 0
    interleave: int = 1

    @property
    def whole(self) -> bool:
        return self.size == 1

    def holds(self, p: np.ndarray) -> np.ndarray:
        """Whether request tokens ``p`` are held."""
        if self.whole:
            return np.ones(len(p), dtype=bool)
        held: np.ndarray = (p // self.interleave) % self.size == self.rank
        return held

    def local(self, p: np.ndarray) -> np.ndarray:
        """The side's own token index of held request tokens ``p``."""
        if self.whole:
            return p
        i = self.interleave
        local: np.ndarray = (p // (i * self.size)) * i + p % i
        return local

    def __str__(self) -> str:
        if self.whole:
            return "every token of a request"
        return f"the tokens of CP rank {self.rank} of {self.size} ({self.interleave} at a time)"


def token_slice(shard: Shard | None) -> TokenSlice:
    if shard is None or not shard.context_parallel:
        return TokenSlice()
    return TokenSlice(shard.cp_size, shard.cp_rank, shard.cp_interleave)


@dataclass(frozen=True)
class Repaged:
    """A request re-paged into the granules both sides hold: each side's page ids and the
    slot each page starts at (None: its pages are its whole blocks), ``*_page`` tokens a
    page, and the tokens ``[first, tokens)`` of the re-paged request that move."""

    src_ids: np.ndarray
    src_slots: np.ndarray
    dst_ids: np.ndarray
    dst_slots: np.ndarray | None
    src_page: int
    dst_page: int
    tokens: int
    first: int


def repage(
    a: TokenSlice,
    b: TokenSlice,
    a_pages: np.ndarray,
    a_block_size: int,
    b_pages: np.ndarray,
    b_block_size: int,
    tokens: int,
    first: int,
) -> Repaged:
    """The tokens ``[first, tokens)`` of a request that both ``a`` and ``b`` hold, as pages
    of one granule. ``*_pages``: each side's block (page) ids in its own token order, as
    many as its tokens fill; ``*_block_size``: tokens a page of each side holds."""
    g = math.gcd(a_block_size, b_block_size)
    for side in (a, b):
        if not side.whole:
            g = math.gcd(g, side.interleave)
    p0 = _common_granules(a, b, g, first, tokens)
    ka, kb = a.local(p0), b.local(p0)
    if len(p0) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Repaged(empty, empty, empty, empty, g, g, 0, 0)
    # the block lists were checked to hold the request's tokens
    assert ka[-1] // a_block_size < len(a_pages) and kb[-1] // b_block_size < len(b_pages)
    cut_last = max(0, int(p0[-1]) + g - tokens)  # the last granule the request fills in part
    cut_first = max(0, first - int(p0[0]))  # the first granule first_token cuts
    n = len(p0) * g
    src_ids, src_slots = a_pages[ka // a_block_size], ka % a_block_size
    if g < b_block_size and int(kb[-1] - kb[0]) == n - g:
        # Every destination token from the first moved on is moved (a side without CP, or
        # a coarser split, into a CP rank): the destination's pages are its whole blocks
        # (granules of a whole block are its blocks already, as the general pages below).
        # Granule pages would give the same runs, but the builder walks several pages of
        # a block in memory order only where slabs are outside blocks (heads_over_pages
        # for heads outside slots). Where blocks lie outside slabs (vLLM's cross-layer
        # caches NB_NL_*, FlashInfer's NL_X_NB_TWO_* with K/V inside a block, a cache of
        # one block) a granule's slabs are walked inside it, each granule goes back in the
        # destination and the runs take the builder's sort; whole blocks walk in order.
        # Whole blocks are also fewer pages: bench_maps' HND -> DCP 4 builds in 72 us
        # where granule pages take 79. The re-paged request starts at the first such
        # block; the source pages before the first granule are padding (its first page,
        # never read: first_token is past them).
        base = int(kb[0]) // b_block_size * b_block_size
        pad = (int(kb[0]) - base) // g
        return Repaged(
            np.concatenate([np.full(pad, src_ids[0], dtype=np.int64), src_ids]),
            np.concatenate([np.zeros(pad, dtype=np.int64), src_slots]),
            np.ascontiguousarray(b_pages[base // b_block_size : -(-(int(kb[-1]) + g) // b_block_size)]),
            None,
            g,
            b_block_size,
            pad * g + n - cut_last,
            pad * g + cut_first,
        )
    return Repaged(
        np.ascontiguousarray(src_ids),
        np.ascontiguousarray(src_slots),
        np.ascontiguousarray(b_pages[kb // b_block_size]),
        np.ascontiguousarray(kb % b_block_size),
        g,
        g,
        n - cut_last,
        cut_first,
    )


def _common_granules(a: TokenSlice, b: TokenSlice, g: int, first: int, tokens: int) -> np.ndarray:
    """The first tokens of the granules of ``g`` tokens that hold any of ``[first, tokens)``
    and that both sides hold, in order. Enumerated from the side that holds the fewer
    (its rank's granules, a round of the CP ranks at a time), then kept where the other
    holds them: the cost is that side's share of the request, which its cache holds, not
    the request (two CP splits of many ranks have requests many times either cache)."""
    lo, hi = (first // g) * g, -(-tokens // g) * g
    side, other = (a, b) if a.size >= b.size else (b, a)
    if side.whole:
        p0 = np.arange(lo, hi, g, dtype=np.int64)
    else:  # granules [r*I, (r+1)*I) of each round of I*c tokens (g divides I)
        i, period = side.interleave, side.interleave * side.size
        rounds = np.arange(lo // period, -(-hi // period), dtype=np.int64) * period + side.rank * i
        p0 = (rounds[:, None] + np.arange(0, i, g, dtype=np.int64)[None, :]).ravel()
        p0 = p0[(p0 >= lo) & (p0 < hi)]
    kept: np.ndarray = p0[other.holds(p0)]
    return kept


def held(side: TokenSlice, n: int) -> int:
    """How many of a request's first ``n`` tokens the side holds."""
    if side.whole:
        return n
    period, i = side.interleave * side.size, side.interleave
    return (n // period) * i + min(max(n % period - side.rank * i, 0), i)


def overlap(a: TokenSlice, b: TokenSlice) -> bool:
    """Whether any token is held by both (over one period of the two patterns)."""
    period = math.lcm(a.interleave * a.size, b.interleave * b.size)
    g = math.gcd(a.interleave, b.interleave)  # both hold whole granules of g tokens
    if period // (g * max(a.size, b.size)) > 1 << 22:  # the granules _common_granules looks at
        return True  # too long a pattern to check here: the map's runs say
    return len(_common_granules(a, b, g, 0, period)) > 0


def check_servable(a: TokenSlice, b: TokenSlice, a_block_size: int, b_block_size: int, opaque: bool) -> None:
    """Refuse what context parallelism cannot be mapped for: pages that are no tokens
    (state, opaque kernel pages), and an interleave a block does not hold whole (vLLM
    requires the block size to be a multiple of it). ``*_block_size``: the caller's
    blocks (a scheduler's), in tokens of one rank."""
    for where, side, size in (("src", a, a_block_size), ("dst", b, b_block_size)):
        if side.whole:
            continue
        if opaque:
            raise BlockMapError(
                f"{where}_shard is context-parallel ({side}), but the map moves opaque pages (state or "
                "kernel pages, no token rows): context parallelism slices attention caches' tokens only"
            )
        if size % side.interleave:
            raise BlockMapError(
                f"{where}_shard's cp_interleave={side.interleave} does not divide the {where} cache's "
                f"blocks of {size} tokens (vLLM requires a block size that is a multiple of "
                "cp_kv_cache_interleave_size)"
            )
