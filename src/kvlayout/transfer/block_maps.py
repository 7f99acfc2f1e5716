"""Block maps: move one request's KV between any two registrations as byte runs.

A side of a map is a kernel group (or a peer's description of one, or a chunk): its
layout says, through the algebra's offsets, where every (layer, K/V, token, head, byte)
lives. Token ``p`` of the request is slot ``p % BS`` of block ``blocks[p // BS]`` on each
side, each side with its own block size (a context-parallel rank holds a slice of the
tokens: :mod:`~kvlayout.transfer.context_parallel`); head ``h`` of the model is held by the
ranks :class:`~kvlayout.registration.shards.Shard` says. A map pairs every byte both sides hold, layer ``i``
to layer ``i``, K to K and V to V, and cuts the pairs into runs that are contiguous on
both sides: the fewest such runs (see docs/block-maps.md).

The work is split by what changes when. Per side, once (cached on the kernel group):
the algebra's offsets of each (layer, K/V, piece of a head's row) and its per-block,
per-slot and per-head strides (:mod:`~kvlayout.transfer.map_sides`). Per pair of sides,
once: the *slabs* (layer, K/V and piece both sides hold, with both sides' bases and
strides), slabs that are contiguous on both sides joined, and the destination's nest
(slab, block, slot, head ordered by its strides) (:mod:`~kvlayout.transfer.map_pairs`).
Per request, here: block ids, and the native builder walks the destination in memory
order, emitting and merging runs (``csrc/block_map.h``).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, NoReturn

import numpy as np
import torch

from kvlayout import _native
from kvlayout.errors import index_ranges
from kvlayout.registration.memory import HoldsAddresses
from kvlayout.registration.opaque import OpaquePages, head_pages
from kvlayout.registration.shards import Shard, ShardError
from kvlayout.transfer.arguments import (
    block_ids_arg,
    check_ids_in_range,
    check_written_once,
    int_arg,
    threads_arg,
)
from kvlayout.transfer.context_parallel import (
    TokenSlice,
    check_servable,
    held,
    overlap,
    repage,
    token_slice,
)
from kvlayout.transfer.map_pairs import _cached_pair, _groups_of, _heads, _Pair, _whole, given_shard
from kvlayout.transfer.map_sides import (
    BlockMapError,
    Side,
    _as_side,
    chunk_shape_for,
    chunk_side,
    kernel_page_side,
    moved_tokens,
    pages_per_block,
)
from kvlayout.transfer.memory_watch import MemoryWatch
from kvlayout.transfer.sharded_pages import page_sides, structure_problem
from kvlayout.transfer.slot_maps import block_rows, check_rows_written_once, slots_arg, token_pages

__all__ = ["BlockMap", "BlockMapError", "Side", "block_map", "chunk_shape_for", "chunk_side"]

_P = _native.MapProblem  # the reasons' one definition is csrc/block_map.h's enum
_PROBLEMS = {
    _P.src_outside: "its source bytes are outside every source tensor's blocks",
    _P.dst_outside: "its destination bytes are outside every destination tensor's blocks",
    _P.dst_overlap: "its destination bytes overlap those of run {other}",
    _P.src_dst_overlap: "it writes bytes run {other} reads (source and destination share memory)",
    _P.empty: "it has no bytes",
}


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
    The map holds its runs as groups (rows of runs at one step, the rows themselves at
    one step: ``csrc/run_groups.h``), so building it writes little; ``copy()`` reads them back a
    buffer at a time, and ``runs`` expands them on first use.
    """

    _fast: Any  # _make_fast()'s (a _native.GroupCopy or None), from the first copy() on

    def __init__(
        self,
        src: Side,
        dst: Side,
        pair: _Pair,
        ids: tuple[np.ndarray, np.ndarray],
        num_tokens: int,
        first_token: int = 0,
        *,
        slots: tuple[int, int] | None = None,
        kind: tuple[str, str] | None = None,
        page_slots: tuple[np.ndarray | None, np.ndarray | None] | None = None,
        page_sizes: tuple[int, int] | None = None,
    ) -> None:
        self.src, self.dst = src, dst
        self.heads = pair.heads
        self.num_tokens = num_tokens
        self.first_token = first_token  # tokens [first_token, num_tokens) move
        # The builder's slots [first, end) of the request: its tokens, or its pages where
        # both sides are re-cut a page a slot (sharded_pages).
        self._slots = (first_token, num_tokens) if slots is None else slots
        self._pair, self._ids = pair, ids
        # Pages finer than blocks (context_parallel.repage): where each page starts in its
        # block (None: whole blocks), and the tokens a page holds on each side; else each
        # side's whole blocks.
        self._page_slots: tuple[np.ndarray | None, np.ndarray | None] = page_slots or (None, None)
        self._page_sizes = page_sizes or (src.block_size, dst.block_size)
        if kind is not None:
            self._kind_and_reason = kind
        self._groups, self._num_runs = self._build_groups(force_sort=False)

    @functools.cached_property
    def _kind_and_reason(self) -> tuple[str, str]:
        p = self._pair  # built of these sides and shards (_cached_pair): its maps' kind is one
        if not p.kind:
            p.kind.append(_kind(self.src, self.dst, p.heads, p.src_shard, p.dst_shard))
        return p.kind[0]

    @property
    def kind(self) -> str:
        """What differs between the sides: ``same layout``, or some of ``head slice``,
        ``re-blocked``, ``permuted``, ``re-laid`` and ``chunk``; ``resharded state`` for
        pages of TP-sharded state between ranks (vLLM's Mamba pages); ``empty`` when no
        head (or slice of state) is in common. It is the pair's: a request of no tokens
        keeps it, with no runs."""
        return self._kind_and_reason[0]

    @property
    def latents(self) -> bool:
        """The map moves a cache without a head axis that every TP rank holds whole (MLA
        latents, an indexer's keys): one source rank sends it to each destination rank,
        ``src_shard.sends_to(dst_shard, latents=m.latents)`` says which, whatever
        ``num_kv_heads`` the shards carry: also opaque pages of arrays every rank holds
        whole (DeepSeek-V4's FlashMLA pages, vLLM's MLA pages through its group edits).
        False for heads, and for pages of TP-sharded state (each rank its own slice: every
        pair's map moves its part)."""
        pages = self.src.opaque_pages
        return not self.src.has_heads and (pages is None or _held_whole(pages))

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
        (src_ids, dst_ids), sizes = self._ids, self._page_sizes
        first, end = self._slots
        return _groups_of(
            self._pair, end, src_ids, sizes[0], dst_ids, sizes[1],
            force_sort, blocks_one_by_one, slabs_one_by_one, first, self._page_slots,
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
        ids, (first, end) = self._ids[col], self._slots
        size, slots = self._page_sizes[col], self._page_slots[col]
        per = one.block_size // size  # pages a block (1 but for re-paged context-parallel maps)
        pages = ids if slots is None else ids * per + slots // size
        if _native.first_repeated_block_id(pages, first // size, one.num_blocks * per) >= 0:
            return None
        if col == 0 and self.dst.repeats.any():
            return None
        if not self.heads or end == first:
            return 0
        pair = _cached_pair(one, one, shard, shard, only=self.heads, whole_blocks=size == one.block_size)
        _, runs = _groups_of(pair, end, ids, size, ids, size, first_token=first, page_slots=(slots, slots))
        return runs

    def __repr__(self) -> str:
        return (
            f"BlockMap({self.kind}: {self._tokens()}, {self.num_runs} runs, {self.num_bytes} bytes; "
            f"{self.src.label} -> {self.dst.label})"
        )

    def _tokens(self) -> str:
        first, n = self.first_token, self.num_tokens
        if first == 0:
            return f"{n} token{'s' * (n != 1)}"
        if first >= n - 1:
            return f"token {first}" if first == n - 1 else f"no tokens (first_token={first})"
        return f"tokens {first}-{n - 1}"

    def copy(self, num_threads: int = 1) -> int:
        """Copy the runs (validated first: every run inside one tensor's blocks on each
        side, destination runs disjoint); GIL released. Returns the threads used. On a GPU
        the copy is queued on the current stream and this returns before the bytes move,
        as any CUDA copy does (``num_threads`` does not apply; 1 is returned).

        A tensor freed or resized before the call is refused; one another thread frees or
        resizes while the copy runs is not seen (the check comes before the copy, as any
        torch copy reads a tensor that is not freed under it): a connector keeps its cache
        allocated while its copies run."""
        try:
            fast = self._fast
        except AttributeError:  # the first call (no cached_property: its lock, held by a
            fast = self._make_fast()  # thread at a fork(), would hang the child)
        # The common call in one native step, its checks there too (from cold caches each
        # Python step costs some microseconds, more than a small map's copy can spare): a
        # plain int thread count up to MAX_THREADS, a CPU map whose runs were validated
        # (once: they and the spans never change), no torch function mode on and every
        # tensor a plain torch.Tensor (no caller code runs in the checks), both sides'
        # memory where the map read it. -2: something else, for the full checks below.
        if fast is not None:
            used = fast.copy_watched(num_threads)
            if used >= 0:
                return used  # type: ignore[no-any-return]
            if used == -1:
                self._raise(*fast.verdict())
        threads = threads_arg(num_threads, BlockMapError)
        # No caller code between the checks and the copy: a tensor subclass's
        # __torch_function__, or a TorchFunctionMode the caller has on, would otherwise
        # run in each data_ptr() the checks read.
        with torch._C.DisableTorchFunction():
            return self._copy(threads)

    def _make_fast(self) -> Any:
        """``_fast``, what a CPU map's ``copy()`` reads on every call, made on the first: the native
        copy of its groups and spans (a ``_native.GroupCopy``, which validates them there,
        once: it holds its own copy of them, which nothing changes after) with both sides'
        memory watched as one (a ``MemoryWatch``'s native comparison). None where ``copy()``
        refuses the map whatever its memory (a side that is a peer's, sides on two devices)
        and off the CPU."""
        src, dst = self.src, self.dst
        fast = None
        if src.live and dst.live and src.device == dst.device and src.device[0] == "cpu":
            watch = MemoryWatch(p for p in (src._placement, dst._placement) if p is not None)
            fast = _native.GroupCopy(self._groups, src.spans, dst.spans, self._pair.prefetch, watch._compare)
        self._fast = fast  # two threads making it at once make two alike: either serves
        return fast

    @property
    def _groups(self) -> np.ndarray:
        """The map's runs as groups (``csrc/run_groups.h``)."""
        return self._group_table

    @_groups.setter
    def _groups(self, groups: np.ndarray) -> None:
        # other groups (a test's tampered ones): what was made of the old ones goes
        self._group_table = groups
        for made in ("_fast", "runs"):
            self.__dict__.pop(made, None)

    def _copy(self, threads: int) -> int:
        self._check_copy()
        self._check_runs()
        return self._copy_checked(threads)

    def _check_runs(self) -> None:
        """Refuse runs that validation refuses (a run outside its tensors' blocks, two
        writing the same bytes, one writing what another reads), before any byte moves:
        a joined map asks each part here before it copies any part. Asked after
        :meth:`_check_copy` (a CPU map's native copy of its runs is made here)."""
        if self.src.device[0] == "cpu":
            fast = self.__dict__.get("_fast") or self._make_fast()
            assert fast is not None  # _check_copy refuses the maps without it
            self._raise(*fast.verdict())
        else:
            self._raise(*_native.validate_groups(self._groups, self.src.spans, self.dst.spans))

    def _copy_checked(self, threads: int) -> int:
        """The copy, once :meth:`_check_copy` and :meth:`_check_runs` passed."""
        if self.src.device[0] == "cpu":
            fast = self.__dict__.get("_fast") or self._make_fast()
            assert fast is not None
            return int(fast.copy(threads))
        from kvlayout.transfer.cuda import copy_runs  # imports kvlayout._cuda only when called

        copy_runs(self.runs, torch.device(_device_name(self.src.device)))
        return 1

    def _check_copy(self) -> None:
        """Refuse a copy() that cannot run: a side that is a peer's description, a live
        side whose memory moved since the map read it, sides on two devices."""
        for where, side in (("src", self.src), ("dst", self.dst)):
            if not side.live:
                raise BlockMapError(
                    f"the {where} side is a RegistrationDescription: its addresses are a peer's, so copy() "
                    "cannot run this map; send its runs through a transfer engine (NIXL) instead"
                )
            moved = side.moved()
            if moved is not None:
                again = (
                    "make its chunk_side() and the map again"
                    if side.layout is None  # a chunk: nothing to detect
                    else "detect the registration again and build a new map"
                )
                raise BlockMapError(
                    f"{where}: {moved} since the map's addresses were read; copy() would copy through the "
                    f"old ones: {again}; nothing was copied"
                )
        if self.src.device != self.dst.device:
            raise BlockMapError(
                f"src is on {_device_name(self.src.device)} and dst on "
                f"{_device_name(self.dst.device)}; copy() "
                "moves bytes within one device"
            )

    def _raise(self, problem: Any, run: int, other: int) -> None:
        if problem is not _P.none:
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


def _given(where: str, blocks: Any, slots: Any) -> tuple[str, Any]:
    """A side's block ids or slot mapping, which of the two was given (exactly one)."""
    if (blocks is None) == (slots is None):
        said = "both" if blocks is not None else "neither"
        raise TypeError(f"block_map takes {where}_blocks or {where}_slots for the {where} side, not {said}")
    return ("blocks", blocks) if slots is None else ("slots", slots)


_SideArgs = tuple[Side, tuple[str, Any], int, TokenSlice, str]  # side, what was given, per, CP, where


def _slot_map(pair: _Pair, sides: tuple[_SideArgs, _SideArgs], num_tokens: Any, first_token: Any) -> BlockMap:
    """:func:`block_map` where a side is a slot mapping: both sides' tokens as rows of their
    side, the tokens either masks dropped, the rest pages the builder walks (slot_maps)."""
    lengths = [(f"{where}_slots", _length(value)) for _, (kind, value), *_, where in sides if kind == "slots"]
    if num_tokens is not None:
        tokens, told = _int("num_tokens", num_tokens), "num_tokens"
        if tokens < 0:
            raise BlockMapError(f"num_tokens must be >= 0, got {tokens}")
    else:
        name, length = lengths[0]
        if length is None:
            raise TypeError(f"{name} must be a sequence of slots (its length gives the tokens to map)")
        tokens, told = length, f"the length of {name}"
        if len(lengths) == 2 and lengths[1][1] != tokens:
            raise BlockMapError(
                f"src_slots has {tokens} slots and dst_slots {lengths[1][1]}: one slot a token on each side "
                "(or give num_tokens)"
            )
    first = _int("first_token", first_token)
    if not 0 <= first <= tokens:
        raise BlockMapError(f"first_token must lie in [0, {tokens}] ({told}), got {first}")
    rows = []
    for side, (kind, value), per, cp, where in sides:
        if kind == "slots":
            rows.append(slots_arg(f"{where}_slots", value, side, tokens, told, where, cp))
        else:
            ids = _ids(f"{where}_blocks", value, side, tokens, per, told, cp)
            rows.append(block_rows(ids, side.block_size * per, cp, tokens))
    src_rows, dst_rows = rows
    kept: np.ndarray | None = None  # the moved tokens where some are not: the rest masked
    if first or (tokens and min(int(src_rows.min()), int(dst_rows.min())) < 0):
        moved = (src_rows >= 0) & (dst_rows >= 0)
        moved[:first] = False  # tokens before first_token: the engine's, as in a block-id map
        kept = np.flatnonzero(moved)
        src_rows, dst_rows = src_rows[kept], dst_rows[kept]
    (a, *_), (b, (kind, _), b_per, *_) = sides
    check_rows_written_once(
        f"dst_{kind}", dst_rows, kept, b, None if kind == "slots" else b.block_size * b_per
    )
    offset = 0 if kept is None or not len(kept) else int(kept[0])  # the first moved token
    pages = token_pages(src_rows, a.block_size, dst_rows, b.block_size, offset)
    whole = pages.sizes == (a.block_size, b.block_size)  # pages that are whole blocks
    pair = _cached_pair(a, b, pair.src_shard, pair.dst_shard, whole_blocks=whole)
    result = BlockMap(
        a, b, pair, (pages.src_ids, pages.dst_ids), tokens, first, slots=(pages.first, pages.end),
        page_slots=(pages.src_slots, pages.dst_slots), page_sizes=pages.sizes,
    )  # fmt: skip
    return _inside_peers(result)


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


_TOLD_BY_BLOCKS = "what the shorter block list holds"  # no num_tokens given


def _ids(name: str, blocks: Any, side: Side, tokens: int, per: int, told: str, cp: TokenSlice) -> np.ndarray:
    """The block ids of the caller's blocks (each ``per`` of the side's) that ``tokens``
    fill, checked (``told``: where the token count came from, for the message; ``cp``: a
    context-parallel side's tokens, each of its blocks ``cp.size`` times a block's tokens of
    the request). A CP rank's list may also stop at the last block its own tokens fill (one
    fewer where it holds none of the request's last round of blocks): an engine that deals
    whole blocks to its ranks (TRT-LLM Helix) gives such a rank that many."""
    count, size = side.num_blocks // per, side.block_size * per * cp.size
    needed = -(-tokens // size)
    own = -(-held(cp, tokens) // (side.block_size * per))  # needed, or one fewer

    def refuse(given: int) -> NoReturn:
        tokens_given = (
            f": a block id names a block of {size} tokens, not a token slot (give a token's slot over {size})"
            if given == tokens and size > 1
            else ""
        )
        pages = side.opaque_pages
        # a connector passes a request's num_tokens to every map it joins; a page of one row is no token
        if pages is not None and (pages.arrays or size == 1) and told != _TOLD_BY_BLOCKS:
            what = (
                "a snapshot of the request's state at its last token"
                if pages.arrays
                else "one whole page (a slot), whatever tokens it holds"
            )
            tokens_given = (
                f": a block of {'state' if pages.arrays else 'opaque'} pages ({pages.layout}) is {what}, not "
                "tokens: map it by its block ids alone, without num_tokens"
            ) + _advice(pages)  # what its reading says besides (a ring's: one block a request)
        elif pages is not None and not pages.rows_are_tokens and pages.advice and told != _TOLD_BY_BLOCKS:
            tokens_given = _advice(pages)  # what its reading says of mapping its pages (a ring's)
        elif not tokens_given and told != _TOLD_BY_BLOCKS and side.layout is not None and cp.size == 1:
            tokens_given = _slots_advice(size, given, needed)
        elif side.layout is None and needed == 1:
            tokens_given = f": {_one_chunk(name, side)}"
        if own != needed:
            tokens_given = (
                f" (or {own}, the blocks of {side.block_size * per} its CP rank's own {held(cp, tokens)} "
                f"tokens fill){tokens_given}"
            )
        raise BlockMapError(
            f"{name} has {given} block ids; the request's {tokens} tokens ({told}) fill {needed} "
            f"block{'s' * (needed != 1)} of {size}{tokens_given}"
        )

    given = _length(blocks)
    if given is not None and given > needed and not isinstance(blocks, (np.ndarray, torch.Tensor)):
        refuse(given)  # before a list or range of too many (range(10**9): 8 GB) is converted
    ids = block_ids_arg(name, blocks, BlockMapError, count)
    if side.layout is None and needed > 1:  # a chunk is one block: its tokens are too few
        raise BlockMapError(
            f"the chunk ({name.removesuffix('_blocks')}) holds {side.block_size} tokens, fewer than the "
            f"request's {tokens} ({told}): give it a token axis of {tokens} or more"
        )
    if len(ids) not in (needed, own):
        refuse(len(ids))
    if side.layout is None and len(ids) and ids[0] != 0:  # the cache's block ids, given for a chunk's
        raise BlockMapError(f"{name}[0] = {int(ids[0])}, but {_one_chunk(name, side)}")
    check_ids_in_range(name, ids, count, BlockMapError)
    return ids


def _one_chunk(name: str, side: Side) -> str:
    """What a chunk side's block list is (``name`` its ``src_blocks``/``dst_blocks``)."""
    return (
        f"the chunk ({name.removesuffix('_blocks')}) is one block, of its {side.block_size} tokens: give [0]"
    )


def _slots_advice(size: int, given: int, needed: int) -> str:
    """For fewer ids (``given``) than the tokens fill (``needed``): what the count is counted
    in (a compressed cache's blocks hold slots of several tokens each: vLLM's ``tokens_per_state``)."""
    if not 0 < given < needed:
        return ""
    return (
        f": num_tokens and first_token count the rows its blocks hold ({size} a block); a compressed "
        "cache's rows are slots of r tokens each (vLLM's tokens_per_state r): give num_tokens // r"
    )


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
            f"src holds model heads {index_ranges(src_shard.heads)} and dst {index_ranges(dst_shard.heads)}: "
            "none in common"
        )
    ta, tb = token_slice(src_shard), token_slice(dst_shard)
    if ta != tb and not overlap(ta, tb):
        return "empty", f"src holds {ta} and dst {tb}: none in common"
    kinds, why = [], []
    if ta != tb:
        kinds.append("token slice")
        why.append(f"src holds {ta} and dst {tb}: the map moves the tokens both hold")
    elif not ta.whole:
        why.append(f"both sides hold {ta}, at the same places")
    if src.has_heads and (len(heads) < src.heads or len(heads) < dst.heads):
        kinds.append("head slice")
        assert src_shard is not None and dst_shard is not None
        why.append(
            f"src holds heads {index_ranges(src_shard.heads)} and dst {index_ranges(dst_shard.heads)}, "
            f"so the map moves heads {index_ranges(heads)}"
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


def _check_opaque_pages(
    src: Side, dst: Side, src_shard: Shard | None, dst_shard: Shard | None, *, running_state: bool = False
) -> tuple[Shard, Shard] | None:
    """Opaque pages (vLLM's group edits: rows that are bytes of a kernel's page) map only
    to pages laid out alike, whole where a row is no token, rank to the same rank; pages
    of TP-sharded state arrays to such pages of any rank, whose shards are returned (the
    map then moves the state both ranks hold: sharded_pages). ``running_state``: the map is
    one state page a side by block id alone (a request's running state), which maps
    between blocks of any size."""
    a, b = src.opaque_pages, dst.opaque_pages
    if (a is None and b is None) or src.layout is None or dst.layout is None:
        return None  # caches as engines register them, or a chunk of the cache's own rows
    how = "see docs/vllm-group-edits.md, the opaque-page contract"
    if a is None or b is None:
        edited, other, pages = ("src", "dst", a) if a is not None else ("dst", "src", b)
        assert pages is not None
        raise BlockMapError(
            f"{edited} is opaque pages ({pages.layout}) and {other} is not: an edited group's rows are bytes "
            f"of the kernel's page, not tokens, so it maps only to a group edited alike ({how})"
            + _advice(pages)
        )
    ranks = given_shard(src, src_shard, "src"), given_shard(dst, dst_shard, "dst")
    if _held_whole(a) and _held_whole(b):
        ranks = None, None  # every rank holds the state whole (MLA latents): shards say nothing of it
    if a.arrays and b.arrays and not a.rows_are_tokens and not b.rows_are_tokens:
        state = _state_ranks(src, dst, ranks, how, running_state=running_state)
        if state is not None:
            return state
    if (a.layout, a.rows_are_tokens) != (b.layout, b.rows_are_tokens):  # state arrays or not: a page alike
        tokens = {True: ", rows are tokens", False: ", rows are no tokens"}
        sa, sb = (f"{p.layout}{tokens[p.rows_are_tokens] if a.layout == b.layout else ''}" for p in (a, b))
        raise BlockMapError(
            f"src and dst are opaque pages laid out differently (src {sa}; dst {sb}): the same "
            f"tokens are other bytes of the page ({how})" + _advices(a, b)
        )
    if not a.rows_are_tokens and src.block_size != dst.block_size:
        raise BlockMapError(
            f"src and dst are opaque pages in blocks of {src.block_size} and {dst.block_size} rows: "
            f"whole pages map only to pages of the same size ({how})"
        )
    if None not in ranks and ranks[0] != ranks[1]:
        raise BlockMapError(
            f"src and dst are opaque pages of {ranks[0]} and {ranks[1]} ({a.layout}): a page holds its "
            f"rank's heads in the kernel's order, so it maps only to the same rank's ({how})"
        )
    return None


def _kernel_pages(
    src: tuple[Side, int | None, Shard | None], dst: tuple[Side, int | None, Shard | None]
) -> tuple[tuple[Side, int | None], tuple[Side, int | None]]:
    """Each side and the caller's block size for it, a side whose pages are an attention
    kernel's pages of KV heads (:func:`~kvlayout.registration.opaque.head_pages`: vLLM's
    HND kernel pages through its edits) read as those kernel pages, each of its blocks
    ``k`` of theirs, where it maps to a cache that is not the same rank's pages alike (one
    of another TP degree, layout or paging, as vLLM's NixlConnector slices every kernel
    page by heads); pages alike of one rank, or a chunk of their own rows, still move whole."""
    (a, a_size, a_shard), (b, b_size, b_shard) = src, dst
    arrays = head_pages(a.opaque_pages), head_pages(b.opaque_pages)
    if arrays == (None, None) or a.layout is None or b.layout is None:
        return (a, a_size), (b, b_size)
    same_rank = given_shard(a, a_shard, "src") == given_shard(b, b_shard, "dst")
    if a.opaque_pages == b.opaque_pages and same_rank:
        return (a, a_size), (b, b_size)  # pages alike of one rank: whole
    read = [
        (side, size) if array is None else (kernel_page_side(side, array, where), size or side.block_size)
        for side, size, array, where in ((a, a_size, arrays[0], "src"), (b, b_size, arrays[1], "dst"))
    ]
    return read[0], read[1]


def _state_pages(side: Side) -> bool:
    """The side is blocks of TP-sharded state of several rows (vLLM's Mamba pages in align
    mode, through its edits): arrays none of which are KV heads, not all held whole (an
    MLA page's), rows no tokens. A request's running state is one such block."""
    pages = side.opaque_pages
    if pages is None or not pages.arrays or pages.rows_are_tokens or side.layout is None:
        return False
    return side.block_size > 1 and not any(x.kv_heads for x in pages.arrays) and not _held_whole(pages)


def _held_whole(pages: OpaquePages) -> bool:
    """The pages declare only arrays every TP rank holds whole."""
    return bool(pages.arrays) and all(x.replicated for x in pages.arrays)


def _advice(pages: OpaquePages) -> str:
    """What the pages' reading says to do where they do not map (vLLM's CPU_ATTN)."""
    return f". {pages.advice[:1].upper()}{pages.advice[1:]}" if pages.advice else ""


def _advices(a: OpaquePages, b: OpaquePages) -> str:
    """Both sides' advice, once where they give the same."""
    return _advice(a) + (_advice(b) if b.advice != a.advice else "")


def _state_ranks(
    src: Side, dst: Side, ranks: tuple[Shard | None, Shard | None], how: str, *, running_state: bool = False
) -> tuple[Shard, Shard] | None:
    """The ranks a map between two pages of state arrays moves the state between, or None
    where the pages are alike and of one rank (they move whole). Pages of blocks of other
    sizes map only as a request's running state (``running_state``)."""
    a, b = src.opaque_pages, dst.opaque_pages
    assert a is not None and b is not None
    if src.block_size != dst.block_size and not running_state:
        raise BlockMapError(
            f"src and dst are pages of state in blocks of {src.block_size} and {dst.block_size} rows: "
            "a block's state is a snapshot at its last token, so pages map only between blocks of "
            "the same size, but for a request's running state: one block id a side without num_tokens, "
            "of the cache's own blocks (no other src_block_size or dst_block_size), each of several rows "
            "(vLLM's align mode at two TP degrees whose hybrid blocks differ; a 'none'-mode state is one "
            f"row) ({how})" + _advices(a, b)  # what their reading says besides (rings of two capacities)
        )
    problem = structure_problem(a, b)
    if problem is not None:
        raise BlockMapError(
            f"src and dst pages do not hold the same state: {problem}; src pages are {a.layout}, dst "
            f"pages {b.layout} ({how})" + _advices(a, b)
        )
    # the same shapes and parts (dtypes of the same bytes, offsets in the page aside): one state alike
    split = [(x.shape, x.parts) for x in a.arrays] == [(y.shape, y.parts) for y in b.arrays]
    if not split and [x.shape for x in a.arrays] == [y.shape for y in b.arrays]:
        raise BlockMapError(
            f"src and dst pages hold state arrays of the same shapes in other parts (src {_arrays(a)}; dst "
            f"{_arrays(b)}): not one model's state, at any TP degrees ({how})"
        )
    if not split and None in ranks:
        raise BlockMapError(
            f"src and dst pages hold state arrays of other sizes (src {_arrays(a)}; dst {_arrays(b)}): "
            "TP-sharded state of two TP degrees; give src_shard and dst_shard, which ranks they are"
        )
    if ranks[0] is not None and ranks[1] is not None:
        if ranks[0].num_kv_heads != ranks[1].num_kv_heads:
            raise ShardError(
                f"src_shard {ranks[0]} and dst_shard {ranks[1]} disagree on the model's KV heads: two models"
            )
        if a != b or ranks[0] != ranks[1]:
            return ranks[0], ranks[1]
        return None
    if a != b or src.row_bytes != dst.row_bytes:
        # the same arrays, laid in other views or padded to other pages (a state every rank holds
        # whole, each TP degree padding it to its own attention page): rank to the same rank
        heads = next((x.parts[0] for x in a.arrays if x.kv_heads), 1)  # KV heads: all the page's
        return _whole(heads), _whole(heads)
    return None


def _arrays(pages: OpaquePages) -> str:
    return ", ".join(map(str, pages.arrays))


def _state_kind(src: Side, dst: Side, ranks: tuple[Shard, Shard], common: bool, runs: int) -> tuple[str, str]:
    a, b = ranks
    at = f"TP {a.tp_size} rank {a.tp_rank}", f"TP {b.tp_size} rank {b.tp_rank}"
    per_page = f"{runs} run{'s' * (runs != 1)} a page"
    if not common:
        return "empty", f"src ({at[0]}) and dst ({at[1]}) hold no slice of the state in common"
    assert src.opaque_pages is not None and dst.opaque_pages is not None
    pages = f"pages of state arrays (src {_arrays(src.opaque_pages)}; dst {_arrays(dst.opaque_pages)})"
    if (a.tp_size, a.tp_rank) != (b.tp_size, b.tp_rank):
        return "resharded state", f"{pages}: the slices {at[0]} and {at[1]} both hold, {per_page}"
    return "re-laid", f"{pages}: the same arrays in other views, {per_page}"


def block_map(
    src: Any,
    dst: Any,
    src_blocks: Any = None,
    dst_blocks: Any = None,
    *,
    num_tokens: int | None = None,
    first_token: int = 0,
    src_shard: Shard | None = None,
    dst_shard: Shard | None = None,
    src_block_size: int | None = None,
    dst_block_size: int | None = None,
    src_slots: Any = None,
    dst_slots: Any = None,
) -> BlockMap:
    """The byte runs that move tokens ``[first_token, num_tokens)`` of one request from
    ``src`` to ``dst``: token ``p`` is slot ``p % BS`` of block ``blocks[p // BS]`` on
    each side.

    ``src`` and ``dst`` are what detection returns (a registration with one kernel group,
    or a kernel group) or a peer's :class:`~kvlayout.registration.peers.RegistrationDescription`
    (then ``copy()`` refuses). Every head both shards hold moves, layer ``i`` to layer
    ``i``, K to K and V to V. ``num_tokens`` defaults to what the shorter block list
    holds; each list must hold exactly the blocks the tokens fill. Destination blocks
    must be distinct.

    ``first_token`` moves only tokens ``[first_token, num_tokens)``, the block lists still
    counting from token 0: a load after the engine's prefix cache served the request's
    first tokens, which their blocks (perhaps shared with other requests) keep. No byte of
    an earlier token is read or written, and the destination's blocks wholly before it
    may be anything in range (repeated too: vLLM's null block for a sliding window's
    dropped blocks) but a block that takes later tokens (whose earlier slots a map would
    overwrite).

    A shard under context parallelism (``Shard(..., cp_rank=, cp_size=, cp_interleave=)``,
    vLLM's DCP) holds a slice of the request's tokens: each of its block ids stands for
    ``cp_size`` blocks of the request (its list may stop at the last block its own tokens
    fill), and the map moves the tokens both sides hold, each where its side keeps it
    (:mod:`~kvlayout.transfer.context_parallel`).

    ``*_block_size`` split a folded page axis (NB*BS formats). Elsewhere the block size
    is the cache's own, or a multiple of it: the block ids are then in blocks of that
    many tokens, block ``b`` being the cache's blocks ``b*k`` to ``b*k + k-1`` (vLLM's
    scheduler blocks over a cache its attention kernel pages ``k`` times finer).

    ``src_slots`` / ``dst_slots`` give a side as a slot mapping instead of block ids (pass
    one or the other a side): token ``t`` is slot ``slots[t]``, block ``slot // BS``, row
    ``slot % BS`` (vLLM's ``block_table[t // BS] * BS + t % BS``, LMCache's in-process
    ``multi_layer_kv_transfer``), and a slot of -1 is a token neither read nor written.
    Slots may be in any order and at any row; source slots may repeat, a destination slot
    may not. ``num_tokens`` defaults to the mapping's length (one slot a token), the other
    side's block ids holding those tokens as above (a context-parallel rank's block ids its
    own share; a slot mapping says for itself where each token is, -1 where another rank
    holds it). The map is built as a block-id map is, its runs as long (see
    :mod:`~kvlayout.transfer.slot_maps`).
    """
    src_given = _given("src", src_blocks, src_slots)
    dst_given = _given("dst", dst_blocks, dst_slots)
    src_block_size, dst_block_size = _block_size("src", src_block_size), _block_size("dst", dst_block_size)
    a = _as_side(src, src_block_size, "src")
    b = _as_side(dst, dst_block_size, "dst")
    (a, src_block_size), (b, dst_block_size) = _kernel_pages(
        (a, src_block_size, src_shard), (b, dst_block_size, dst_shard)
    )
    # a request's running state between Mamba blocks of other sizes: one page a side, by id alone
    # (ids of the cache's own blocks: a scheduler's block of several state pages is no one state)
    running = (
        num_tokens is None and first_token == 0 and _length(src_blocks) == 1 and _length(dst_blocks) == 1
        and src_block_size in (None, a.block_size) and dst_block_size in (None, b.block_size)
        and a.block_size != b.block_size and _state_pages(a) and _state_pages(b)
    )  # fmt: skip
    state = _check_opaque_pages(a, b, src_shard, dst_shard, running_state=running)
    a_per, b_per = (
        pages_per_block(a, src_block_size, "src_block_size", "the src cache"),
        pages_per_block(b, dst_block_size, "dst_block_size", "the dst cache"),
    )
    a_cp, b_cp = token_slice(given_shard(a, src_shard, "src")), token_slice(given_shard(b, dst_shard, "dst"))
    any_pages = a.opaque_pages is not None or b.opaque_pages is not None
    check_servable(a_cp, b_cp, a.block_size * a_per, b.block_size * b_per, any_pages)
    if state is None:
        pair = _cached_pair(a, b, _heads(a, src_shard, "src"), _heads(b, dst_shard, "dst"))
    if running and state is not None:  # each side's one page, its own rows, moved whole
        src_ids = _ids("src_blocks", src_blocks, a, a.block_size, 1, _TOLD_BY_BLOCKS, a_cp)
        dst_ids = _ids("dst_blocks", dst_blocks, b, b.block_size, 1, _TOLD_BY_BLOCKS, b_cp)
        a, b, common = page_sides(a, b, *state)
        pair = _cached_pair(a, b, *state)
        kind = _state_kind(a, b, state, common, len(pair.slabs) // len(a.layers))
        return _inside_peers(
            BlockMap(a, b, pair, (src_ids, dst_ids), 1, 0, slots=(0, int(common)), kind=kind)
        )
    if src_slots is not None or dst_slots is not None:
        paged = next(
            (s.opaque_pages for s in (a, b) if s.opaque_pages and not s.opaque_pages.rows_are_tokens), None
        )
        if paged is not None:  # a slot (a token's row) of a page that moves whole means nothing
            raise BlockMapError(
                f"a slot mapping names token rows, but the map moves opaque pages ({paged.layout}) whose "
                "rows are no tokens (state, or a kernel's page): they move whole pages, by block ids"
            )
        sides = ((a, src_given, a_per, a_cp, "src"), (b, dst_given, b_per, b_cp, "dst"))
        return _slot_map(pair, sides, num_tokens, first_token)
    a_len, b_len = _length(src_blocks), _length(dst_blocks)
    # the caller's blocks, in the request's tokens (a context-parallel rank's block holds
    # cp_size times its own block of the request: its share of them)
    a_size, b_size = a.block_size * a_per * a_cp.size, b.block_size * b_per * b_cp.size
    if num_tokens is None:
        if a_len is None or b_len is None:
            name, blocks = ("src_blocks", src_blocks) if a_len is None else ("dst_blocks", dst_blocks)
            raise TypeError(
                f"{name} must be a sequence of block ids (its length gives the tokens to map), not "
                f"{type(blocks).__name__}"
            )
        tokens = min(a_len * a_size, b_len * b_size)
    else:
        tokens = _int("num_tokens", num_tokens)
        if tokens < 0:
            raise BlockMapError(f"num_tokens must be >= 0, got {tokens}")
    first = _int("first_token", first_token)
    if not 0 <= first <= tokens:
        which = "num_tokens" if num_tokens is not None else "the tokens the shorter block list holds"
        raise BlockMapError(f"first_token must lie in [0, {tokens}] ({which}), got {first}")
    # a row of opaque pages is no token: the last page moves whole (to or from a chunk too)
    opaque = a if a.opaque_pages is not None else b
    if opaque.opaque_pages is not None and not opaque.opaque_pages.rows_are_tokens:
        served, tokens = first == tokens, moved_tokens(opaque, tokens)
        first = tokens if served else first  # every token served already: nothing moves
        chunk = b if opaque is a else a
        if first % opaque.block_size:
            raise BlockMapError(
                f"first_token={first} cuts an opaque page of {opaque.block_size} rows, which moves whole: "
                "start at a page's first token"
            )
        if chunk.layout is None and tokens > chunk.block_size:
            raise BlockMapError(
                f"the chunk holds {chunk.block_size} token rows, but opaque pages move whole pages of "
                f"{opaque.block_size} rows ({tokens} here): a chunk for them holds whole pages"
            )
    told = _TOLD_BY_BLOCKS if num_tokens is None else "num_tokens"
    if num_tokens is not None and tokens != num_tokens:
        told = f"num_tokens={num_tokens} rounded up to whole opaque pages"
    src_ids = _ids("src_blocks", src_blocks, a, tokens, a_per, told, a_cp)
    dst_ids = _ids("dst_blocks", dst_blocks, b, tokens, b_per, told, b_cp)
    written = first // b_size  # dst_blocks[written:] take tokens; those before keep theirs
    why = (
        "each destination slot is written once (blocks wholly before first_token are not written, "
        "and may repeat, as an engine's null block for a sliding window's dropped blocks does)"
    )

    def skip_repeats(again: int) -> str:
        # A sliding window's dropped blocks are its leading ones, one null block id
        # repeated: name the first token after them.
        null = dst_ids[again]
        lead = int(np.argmax(dst_ids != null)) if (dst_ids != null).any() else len(dst_ids)
        if lead <= again or lead * b_size >= tokens:
            return ""
        return (
            f"; if dst_blocks[:{lead}] (block {int(null)}, repeated) are blocks the request no longer "
            f"holds, as a sliding window's dropped blocks, pass first_token={lead * b_size}"
        )

    count = b.num_blocks // b_per
    check_written_once("dst_blocks", dst_ids, written, count, BlockMapError, why, skip_repeats)
    if written and first < tokens:
        kept = np.flatnonzero(np.isin(dst_ids[:written], dst_ids[written:]))
        if len(kept):
            k = int(kept[0])
            later = written + int(np.flatnonzero(dst_ids[written:] == dst_ids[k])[0])
            raise BlockMapError(
                f"dst_blocks[{later}] = {int(dst_ids[k])} takes tokens from first_token={first} on, but "
                f"dst_blocks[{k}], the same block, holds tokens before it, which a map never writes"
                f"{skip_repeats(later)}"
            )
    if a_cp != b_cp:  # sides that hold other tokens, or the same at other places
        cp = repage(
            a_cp, b_cp, _pages(src_ids, a_per, len(src_ids) * a_per), a.block_size,
            _pages(dst_ids, b_per, len(dst_ids) * b_per), b.block_size, tokens, first,
        )  # fmt: skip
        whole = (cp.src_page, cp.dst_page) == (a.block_size, b.block_size)  # pages that are whole blocks
        pair = _cached_pair(a, b, pair.src_shard, pair.dst_shard, whole_blocks=whole)
        result = BlockMap(
            a, b, pair, (cp.src_ids, cp.dst_ids), tokens, first, slots=(cp.first, cp.tokens),
            page_slots=(cp.src_slots, cp.dst_slots), page_sizes=(cp.src_page, cp.dst_page),
        )  # fmt: skip
    elif not a_cp.whole:  # one CP rank's tokens on both sides, at the same places: its own
        local = held(a_cp, first), held(a_cp, tokens)
        src_ids = _pages(src_ids, a_per, -(-local[1] // a.block_size))
        dst_ids = _pages(dst_ids, b_per, -(-local[1] // b.block_size))
        result = BlockMap(a, b, pair, (src_ids, dst_ids), tokens, first, slots=local)
    elif state is None:
        src_ids = _pages(src_ids, a_per, -(-tokens // a.block_size))
        dst_ids = _pages(dst_ids, b_per, -(-tokens // b.block_size))
        result = BlockMap(a, b, pair, (src_ids, dst_ids), tokens, first)
    else:  # a page a slot on both sides, its state's runs the pieces of its row
        src_ids = _pages(src_ids, a_per, -(-tokens // a.block_size))
        dst_ids = _pages(dst_ids, b_per, -(-tokens // b.block_size))
        rows = b.block_size  # both sides' (_check_opaque_pages); tokens are whole pages of it
        a, b, common = page_sides(a, b, *state)
        pair = _cached_pair(a, b, *state)
        pages = (first // rows, tokens // rows) if common else (first // rows,) * 2
        kind = _state_kind(a, b, state, common, len(pair.slabs) // len(a.layers))  # a layer's joined runs
        result = BlockMap(a, b, pair, (src_ids, dst_ids), tokens, first, slots=pages, kind=kind)
    return _inside_peers(result)


def _inside_peers(result: BlockMap) -> BlockMap:
    """``result``, refused where a side is a peer's and a run leaves what it described
    (in another address space, which may repeat this one's addresses: no src/dst overlap)."""
    a, b = result.src, result.dst
    if not (a.live and b.live):
        result._raise(*_native.validate_groups(result._groups, a.spans, b.spans, one_memory=False))
    return result
