"""A pair of block-map sides: the *slabs* (layer, K/V and piece both sides hold, with
both sides' bases and strides), slabs contiguous on both sides joined, and the
destination's nest (slab, block, slot, head ordered by its strides): everything a map
needs but the block ids, built once per pair and kept with the source side."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlayout import _native
from kvlayout.errors import index_ranges
from kvlayout.layout.dtypes import same_bytes
from kvlayout.registration.shards import Shard, ShardError, heads_are_the_model_s
from kvlayout.transfer.map_sides import BlockMapError, Side

SLAB, BLOCK, SLOT, HEAD = 0, 1, 2, 3


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
    # The maps' kind and its reason (block_maps._kind: the pair's, not a request's), worked
    # out by the first map that is asked (plan() asks each request's), then kept.
    kind: list[tuple[str, str]] = field(default_factory=list, compare=False, repr=False)


@functools.lru_cache(maxsize=64)
def _whole(heads: int) -> Shard:
    """TP 1 over ``heads`` heads (a Shard is immutable: one per head count serves every
    map; validating a new one was a twentieth of a map's build)."""
    return Shard(0, 1, heads)


def given_shard(side: Side, shard: Shard | None, where: str) -> Shard | None:
    """The side's shard: the one its description says, or the caller's (a Shard, which
    must agree with a description's)."""
    if shard is not None and not isinstance(shard, Shard):
        raise TypeError(f"{where}_shard must be a kvlayout.transfer.Shard, not {type(shard).__name__}")
    if side.shard is not None:
        if shard is not None and shard != side.shard:
            raise ShardError(f"{where}_shard is {shard}, but the {where} description says {side.shard}")
        shard = side.shard
    return shard


def _heads(side: Side, shard: Shard | None, where: str) -> Shard | None:
    shard = given_shard(side, shard, where)
    if not side.has_heads:
        return shard  # latents: every rank holds them whole
    if shard is None or not heads_are_the_model_s(side.has_heads, side.opaque_pages):
        # opaque pages: every head slot moves, the ranks are checked equal (_check_opaque_pages)
        return _whole(side.heads)
    if len(shard.heads) != side.heads:
        raise ShardError(
            f"{where}_shard {shard} holds {len(shard.heads)} KV heads, but the {where} cache has "
            f"{side.heads} "
            f"({side.label})"
        )
    return shard


def _dtypes_differ(a: str, b: str) -> BlockMapError:
    return BlockMapError(
        f"src is {a} and dst is {b}: a map copies bytes, dtypes must agree "
        "(fp8 and uint8 do: the bytes of fp8 stored as uint8)"
    )


def _check_same_data(src: Side, dst: Side) -> None:
    if src.data != dst.data:  # before the dtypes: a bf16 indexer's keys are read as bytes
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
    a, b = set(src.piece_dtypes), set(dst.piece_dtypes)
    if len(a) == len(b) == 1 and not same_bytes(src.piece_dtypes[0], dst.piece_dtypes[0]):
        raise _dtypes_differ(src.piece_dtypes[0], dst.piece_dtypes[0])
    if src.layers != dst.layers:
        hint = ""
        if len(src.layers) == len(dst.layers):
            hint = (
                " (a kernel group keeps its registration's layer numbers: detect the other side with the "
                "same layer_groups, so that its group holds the same layers, or, where these are the "
                "layers to pair, number one side as the other: registration.numbered(layer_ids))"
            )
        elif set(src.layers) < set(dst.layers) or set(dst.layers) < set(src.layers):
            more, fewer = ("src", "dst") if len(src.layers) > len(dst.layers) else ("dst", "src")
            few = index_ranges(src.layers if fewer == "src" else dst.layers)
            if (src if more == "src" else dst).described is not None:  # a peer's: cut it here
                hint = (
                    f" ({fewer} holds only some of {more}'s layers: map them against {more}'s description "
                    f"cut to them, description.for_layers(layer_ids) ({few}), both sides numbering the "
                    "layers alike (the model's layer ids: registration.numbered(layer_ids)))"
                )
            else:
                hint = (
                    f" ({fewer} holds only some of {more}'s layers: map them from a registration of "
                    f"those layers alone, registration.for_layers(layer_ids) ({few}) of {more}'s (both sides "
                    "numbered with the model's layer ids first: a side detected alone numbers its layers "
                    "from 0, so a part of the model pairs by position until numbered), or one "
                    f"detected from that part of {more}'s cache (a list's entries, or a view of a pool's "
                    "layer axis such as TRT-LLM's pool[:, a:b]) and numbered with their layer ids: "
                    "registration.numbered(layer_ids))"
                )
        raise BlockMapError(
            f"src holds layers {index_ranges(src.layers)} and dst layers "
            f"{index_ranges(dst.layers)}; a map moves layer i to layer i{hint}"
        )
    if src.row_bytes != dst.row_bytes:
        raise BlockMapError(
            f"src rows are {src.row_bytes} bytes a head and dst rows {dst.row_bytes} ({src.label}; "
            f"{dst.label})"
        )


def _cached_pair(
    src: Side, dst: Side, src_shard: Shard | None, dst_shard: Shard | None,
    only: range | None = None, whole_blocks: bool = True,
) -> _Pair:  # fmt: skip
    """``_pair`` of these sides and shards, built once and kept with ``src``."""
    per_dst = src._pairs.setdefault(dst, {})
    key = (src_shard, dst_shard, only, whole_blocks)
    pair = per_dst.get(key)
    if pair is None:
        pair = _pair(src, dst, src_shard, dst_shard, only, whole_blocks)
        per_dst[key] = pair
    return pair


def _groups_of(
    pair: _Pair, tokens: int,
    src_ids: np.ndarray, src_block_size: int, dst_ids: np.ndarray, dst_block_size: int,
    force_sort: bool = False, blocks_one_by_one: bool = False, slabs_one_by_one: bool = False,
    first_token: int = 0, page_slots: tuple[np.ndarray | None, np.ndarray | None] = (None, None),
) -> tuple[np.ndarray, int]:  # fmt: skip
    """The native builder's groups (read-only) and the runs they hold, for tokens
    ``[first_token, tokens)`` of a request over a pair (``page_slots``: where each id's
    page starts in its block, on each side, where pages are finer than blocks)."""
    groups, num_runs, _ = _native.build_groups(
        pair.slabs, pair.group_starts, pair.order, len(pair.heads), tokens,
        src_ids, src_block_size, dst_ids, dst_block_size, pair.src_classes, pair.dst_classes,
        force_sort, blocks_one_by_one, slabs_one_by_one, first_token, *page_slots,
    )  # fmt: skip
    groups.setflags(write=False)
    return groups, int(num_runs)


def _pair(
    src: Side,
    dst: Side,
    src_shard: Shard | None,
    dst_shard: Shard | None,
    only: range | None = None,
    whole_blocks: bool = True,
) -> _Pair:
    """The slabs both sides hold, of the model heads both shards hold (and ``only``
    holds, where given: a side's map to itself, of another pair's heads). ``whole_blocks``
    False: the builder is given pages that may be parts of blocks (a context-parallel
    map's), so no fold may count on a page being a whole block."""
    _check_same_data(src, dst)
    if src.has_heads:
        assert src_shard is not None and dst_shard is not None
        if src_shard.num_kv_heads != dst_shard.num_kv_heads:
            raise ShardError(
                f"src_shard {src_shard} and dst_shard {dst_shard} disagree on the model's KV heads (a shard "
                "not given is TP 1 over the cache's own heads): give both sides' Shard(tp_rank, tp_size, "
                "num_kv_heads), num_kv_heads the whole model's"
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
        if not same_bytes(a_dtype, b_dtype):
            raise _dtypes_differ(a_dtype, b_dtype)

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
    # One block cut into pages (a chunk that a slot map's or a context-parallel map's pages
    # cut): the pages are the block level, one outside the slots (a level of one entry
    # would go outside the slabs, each page walking every slab and going back in the chunk).
    pages_of_one = not whole_blocks and dst.block_size > 1  # asked only where num_blocks is 1
    level_steps = {
        SLAB: int(steps.min()) if steps.size else None,
        BLOCK: int(d_sb[0]) if dst.num_blocks > 1 else int(d_sj[0]) if pages_of_one else None,
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
    outer = [step for lvl in order[: order.index(SLAB)] if (step := level_steps[lvl]) is not None]
    if outer:
        # Slabs inside blocks or slots (layers interleaved in the destination: SGLang's
        # page_first host pool) are walked a block or slot at a time, each group's slabs
        # together: slabs a step of an outer level or more apart (its K half and its V
        # half) go to groups of their own, which keeps the walk in destination order (a walk
        # out of order is sorted: 2.7 of the 3.6 ms a 65536-run map took).
        apart = (np.diff(d_base.astype(np.int64)) >= min(outer)) & (d_tensor[1:] == d_tensor[:-1])
        group_starts = np.union1d(group_starts, np.flatnonzero(apart) + 1).astype(np.int64)
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
            if order[-1] == SLOT and order[-2] == HEAD and src.block_size == dst.block_size and whole_blocks:
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
