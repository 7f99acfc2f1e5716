"""Slot mappings in block maps: a side given as one slot per token instead of block ids.

A slot mapping is what an engine's attention kernel writes through and LMCache's
in-process path moves by (``multi_layer_kv_transfer``): token ``t`` of the request is slot
``slots[t]`` of the side, block ``slot // BS``, row ``slot % BS``, and a slot of -1 is a
token neither read nor written (vLLM's ``ComputeSlotMappingKernel`` pads with it, and
gives it to the tokens another context-parallel rank holds; LMCache masks a stored prefix
with it). A slot is a row of the side's page axis, whatever the block size it was counted
in: vLLM's ``block_table[p // BS] * BS + p % BS`` over blocks ``k`` kernel pages each is the
same number over the kernel pages (block ``b`` is pages ``b*k .. b*k + k-1``).

There is no second builder: both sides' tokens become rows of their side (a block-id side's
token ``t``, or its context-parallel rank's own ``k``, is row ``blocks[k // BS] * BS + k % BS``),
the tokens either side masks are dropped, and what is left is a request of *pages* of ``g``
tokens each, a page at a row of a block on each side: the pages context parallelism re-pages
a request into (:mod:`~kvlayout.transfer.context_parallel`), which the native builder walks
as it walks blocks, in the destination's memory order, merging runs wherever both sides
continue them. ``g`` is the two block sizes' common divisor where every page of that many
tokens is whole on both sides (vLLM's aligned slot mappings, no mask inside a page), else 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlayout import _native
from kvlayout.transfer.arguments import block_ids_arg
from kvlayout.transfer.context_parallel import TokenSlice
from kvlayout.transfer.map_sides import BlockMapError, Side

__all__ = ["TokenPages", "block_rows", "check_rows_written_once", "slots_arg", "token_pages"]


def _where(side: Side, where: str) -> str:
    if side.layout is None:
        return f"the {where} chunk's {side.block_size} token rows"
    blocks = f"{side.num_blocks} blocks of {side.block_size}"
    return f"the {where} cache's {side.num_blocks * side.block_size} slots ({blocks})"


def slots_arg(
    name: str, value: Any, side: Side, tokens: int, told: str, where: str, cp: TokenSlice
) -> np.ndarray:
    """A slot mapping as int64 rows of ``side``, -1 for a token not moved: as many as the
    request's ``tokens`` (``told``: where that count came from), each -1 or a row of the side,
    and -1 for each token another context-parallel rank holds (``cp``: the side's)."""
    slots = block_ids_arg(name, value, BlockMapError)  # lists, arrays, tensors, read alike
    if len(slots) != tokens:
        raise BlockMapError(
            f"{name} has {len(slots)} slots; the request has {tokens} tokens ({told}): a slot mapping holds "
            "one slot per token, -1 for a token not moved"
        )
    count = side.num_blocks * side.block_size
    if len(slots) and (int(slots.min()) < -1 or int(slots.max()) >= count):
        t = int(np.flatnonzero((slots < -1) | (slots >= count))[0])
        s = int(slots[t])
        what = (
            "negative: -1 marks a token not moved, no other slot is negative"
            if s < 0
            else f"out of range for {_where(side, where)}"
        )
        raise BlockMapError(f"{name}[{t}] = {s} (token {t}) is {what}")
    if not cp.whole and len(slots):  # vLLM's compute_slot_mapping: np.where(mask, slot_mapping, -1)
        elsewhere = np.flatnonzero((slots >= 0) & ~cp.holds(np.arange(len(slots), dtype=np.int64)))
        if len(elsewhere):
            t = int(elsewhere[0])
            raise BlockMapError(
                f"{name}[{t}] = {int(slots[t])}, but token {t} is not among {cp} ({where}_shard): a "
                "context-parallel rank's slot mapping is -1 for the tokens other ranks hold (vLLM's "
                "compute_slot_mapping)"
            )
    return slots


def block_rows(ids: np.ndarray, size: int, cp: TokenSlice, tokens: int) -> np.ndarray:
    """The row of its side each of the request's ``tokens`` is at, -1 for a token the side
    does not hold (another context-parallel rank's), from block ids in blocks of ``size``
    tokens (of the side's own tokens: a CP rank's ``k``-th is row ``k % size`` of block
    ``ids[k // size]``). A block of ``size`` tokens is ``size // BS`` of the side's blocks
    in order, so its rows are ``ids[b] * size`` on: the row counts the same either way."""
    if cp.whole:  # each block's rows in turn
        rows: np.ndarray = (ids[:, None] * size + np.arange(size, dtype=np.int64)).ravel()[:tokens]
        return rows
    t = np.arange(tokens, dtype=np.int64)
    held = cp.holds(t)
    k = cp.local(t[held])
    rows = np.full(tokens, -1, dtype=np.int64)
    rows[held] = ids[k // size] * size + k % size
    return rows


def check_rows_written_once(
    name: str, rows: np.ndarray, tokens: np.ndarray | None, side: Side, per_block: int | None
) -> None:
    """Refuse two of the moved tokens (``tokens``, None: every token; their destination
    ``rows``) that write one row, naming both tokens: the row holds whichever copy lands
    last. ``per_block``: the tokens a block id of a block-id side names (None: a slot mapping)."""
    count = side.num_blocks * side.block_size
    again = _native.first_repeated_block_id(rows, 0, count)
    if again < 0:
        return
    earlier = int(np.flatnonzero(rows[:again] == rows[again])[0])
    t, u, s = earlier, again, int(rows[again])
    if tokens is not None:
        t, u = int(tokens[t]), int(tokens[u])
    at = f"slot {s} (block {s // side.block_size}, row {s % side.block_size})"
    if per_block is None:
        said = f"{name}[{u}] = {s} repeats {name}[{t}]: tokens {t} and {u} both write {at}"
    else:
        said = (
            f"{name}[{u // per_block}] and {name}[{t // per_block}] are block {s // per_block}: tokens "
            f"{t} and {u} both write {at}"
        )
    raise BlockMapError(f"{said}; each destination slot is written once")


@dataclass(frozen=True)
class TokenPages:
    """The moved tokens as pages: each side's block ids, the row each page starts at in its
    block (None: pages that are whole blocks) and tokens a page (``sizes``), and the
    builder's tokens ``[first, end)`` (the moved tokens, ``first`` of padding before them)."""

    src_ids: np.ndarray
    src_slots: np.ndarray | None
    dst_ids: np.ndarray
    dst_slots: np.ndarray | None
    sizes: tuple[int, int]
    first: int
    end: int


def token_pages(
    src_rows: np.ndarray, src_block_size: int, dst_rows: np.ndarray, dst_block_size: int, offset: int
) -> TokenPages:
    """The moved tokens (rows of both sides, masked ones dropped) as pages the builder walks,
    moved token ``i`` the builder's token ``offset + i`` (``offset``: where the first moved
    token is in the request, so that a block table's rows keep their blocks' phase past a
    masked prefix). A side's pages are of the most tokens ``g`` (a divisor of its block
    size) for which every page is rows in order from a row ``g*k``: wherever its rows jump
    (a block table's next block, a hole), ``g`` divides the row and the token. A block
    table's pages are its blocks (or a chunk's whole), an arbitrary mapping's single tokens."""
    n = len(src_rows)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return TokenPages(empty, None, empty, None, (src_block_size, dst_block_size), 0, 0)
    sides = ((src_rows, src_block_size), (dst_rows, dst_block_size))
    sizes = []
    for rows, size in sides:
        jumps = np.flatnonzero(rows[1:] != rows[:-1] + 1) + 1
        terms = np.concatenate(([size, rows[0] - offset], rows[jumps], jumps + offset))
        sizes.append(int(np.gcd.reduce(terms)))
    offset %= math.lcm(*sizes)  # the pages' phase is all that counts: padding pages before it fewer
    pages: list[tuple[np.ndarray, np.ndarray | None]] = []
    for (rows, size), g in zip(sides, sizes, strict=True):
        pad, cut = divmod(offset, g)  # pages before the first moved token; its row in its page
        start = rows[np.arange(g - cut if cut else 0, n, g, dtype=np.int64)]  # each page's first row
        if cut:  # the first page, cut: its first row is before the first moved token's
            start = np.concatenate(([rows[0] - cut], start))
        if pad:  # pages the builder skips (before its first token): any rows in range
            start = np.concatenate((np.full(pad, start[0], dtype=np.int64), start))
        pages.append((start // size, None if g == size else start % size))
    (src_ids, src_slots), (dst_ids, dst_slots) = pages
    return TokenPages(src_ids, src_slots, dst_ids, dst_slots, (sizes[0], sizes[1]), offset, offset + n)
