"""Block maps between pages of TP-sharded state held by ranks of other TP degrees.

An opaque page (vLLM's Mamba state, re-viewed by the group edits) moves whole between
caches paged alike. Where the page declares its arrays (:class:`~kvlayout.registration.
opaque.PageArray`: conv and SSM states, each part sharded over TP on its own), a rank of
one TP degree holds slices of another's: this module intersects the two ranks' slices of
every part into byte runs within a page (the *page template*), then re-cuts both sides so
that a page is one slot of one block and each template run is a piece of its row. The
map builder then does the rest as for any map: runs per block id, merged wherever both
sides are contiguous, validated, copied or posted.
"""

from __future__ import annotations

import math

import numpy as np

from kvlayout.layout.dtypes import same_bytes
from kvlayout.registration.opaque import OpaquePages, PageArray
from kvlayout.registration.shards import Shard
from kvlayout.transfer.map_sides import BlockMapError, Side

__all__ = ["MAX_TEMPLATE_RUNS", "page_sides", "page_template", "structure_problem"]

MAX_TEMPLATE_RUNS = 1 << 16
"""The most runs one page's template may hold (a peer's arrays are untrusted)."""


def _part_starts(array: PageArray) -> list[int]:
    return [sum(array.parts[:j]) for j in range(len(array.parts))]


def structure_problem(a: OpaquePages, b: OpaquePages) -> str | None:
    """Why two pages' arrays are not one model's state at any two TP degrees (the same
    arrays, dtypes, sharded axes and parts, the same sizes on every other axis), or None."""
    if len(a.arrays) != len(b.arrays):
        return f"src pages declare {len(a.arrays)} state arrays and dst pages {len(b.arrays)}"
    for i, (x, y) in enumerate(zip(a.arrays, b.arrays, strict=True)):
        what = f"state array {i} is {x} in src and {y} in dst"
        if not same_bytes(x.dtype, y.dtype):
            return f"{what}: other dtypes (a map copies bytes)"
        if (x.axis, len(x.shape), len(x.parts), x.kv_heads, x.replicated) != (
            y.axis,
            len(y.shape),
            len(y.parts),
            y.kv_heads,
            y.replicated,
        ):
            return f'{what}: other axes or parts (another order, as vLLM\'s conv states "DS" and "SD")'
        if x.shape[: x.axis] + x.shape[x.axis + 1 :] != y.shape[: y.axis] + y.shape[y.axis + 1 :]:
            return f"{what}: other sizes on an axis TP does not shard"
        if x.replicated and x.shape != y.shape:
            return f"{what}: other sizes of an array every rank holds whole"
    return None


def _check_sizes(i: int, x: PageArray, y: PageArray, src: Shard, dst: Shard) -> None:
    """Arrays ``i`` of both pages hold parts of one model's sizes at the two degrees (of
    KV heads: the heads each rank's shard says it holds)."""
    if x.replicated:
        return  # whole on every rank: the shards say nothing of it (structure_problem checked its sizes)
    if x.kv_heads:
        for where, array, shard in (("src", x, src), ("dst", y, dst)):
            if array.parts[0] != len(shard.heads):
                raise BlockMapError(
                    f"state array {i} is {array} in {where}: {array.parts[0]} KV heads a page, but "
                    f"{where}_shard {shard} holds {len(shard.heads)} (heads {shard.heads.start}-"
                    f"{shard.heads.stop - 1})"
                )
        return
    for j, (n, m) in enumerate(zip(x.parts, y.parts, strict=True)):
        if n != m and src.tp_size == dst.tp_size:
            raise BlockMapError(
                f"state array {i} is {x} in src and {y} in dst, both at TP {src.tp_size}: its part {j} is "
                f"{n} and {m} long, so the pages are not one model's state"
            )
        if n * src.tp_size != m * dst.tp_size:
            raise BlockMapError(
                f"state array {i} cannot move between TP {src.tp_size} rank {src.tp_rank} and TP "
                f"{dst.tp_size} rank {dst.tp_rank}: its part {j} is {n} of {n * src.tp_size} at TP "
                f"{src.tp_size} and {m} of {m * dst.tp_size} at TP {dst.tp_size}. The model's sizes differ, "
                "so the part is replicated rather than sharded (vLLM and SGLang replicate a Mamba2 model's B "
                "and C groups where n_groups is not a multiple of TP), and which slice a rank holds is not "
                "in its page; or the pages are not one model's"
            )


def page_template(
    a: OpaquePages, b: OpaquePages, src: Shard, dst: Shard, page_bytes: tuple[int, int]
) -> np.ndarray:
    """``(n, 3)`` int64: source byte in a ``src`` page, destination byte in a ``dst``
    page, length: every byte of the state both ranks hold, in destination order.

    Rank ``r`` of ``T`` holds indices ``[r*n, (r+1)*n)`` of a part ``n*T`` long (of an
    array of KV heads, the heads its shard holds); a run is one part's common indices at
    one index of the axes outside the sharded one."""
    problem = structure_problem(a, b)
    if problem is not None:
        raise BlockMapError(f"{problem}: not the same state")
    for where, pages, size in (("src", a, page_bytes[0]), ("dst", b, page_bytes[1])):
        if pages.arrays_end > size:
            raise BlockMapError(
                f"the {where} pages' state arrays end at byte {pages.arrays_end}, past the {size}-byte page"
            )
    out: list[np.ndarray] = []
    count = 0
    for i, (x, y) in enumerate(zip(a.arrays, b.arrays, strict=True)):
        _check_sizes(i, x, y, src, dst)
        outer = math.prod(x.shape[: x.axis])
        inner = math.prod(x.shape[x.axis + 1 :]) * x.itemsize
        for n, m, xs, ys in zip(x.parts, y.parts, _part_starts(x), _part_starts(y), strict=True):
            # the model's indices each rank holds: [first, first + n)
            if x.replicated:
                first_src = first_dst = 0
            elif x.kv_heads:
                first_src, first_dst = src.heads.start, dst.heads.start
            else:
                first_src, first_dst = src.tp_rank * n, dst.tp_rank * m
            lo, hi = max(first_src, first_dst), min(first_src + n, first_dst + m)
            if lo >= hi:
                continue
            count += outer
            if count > MAX_TEMPLATE_RUNS:  # before any array of them is made
                raise BlockMapError(
                    f"the pages' state arrays cut a page into more than {MAX_TEMPLATE_RUNS} runs"
                )
            at = np.arange(outer, dtype=np.int64)
            s = x.offset + (at * x.shape[x.axis] + xs + lo - first_src) * inner
            d = y.offset + (at * y.shape[y.axis] + ys + lo - first_dst) * inner
            out.append(np.stack([s, d, np.full(outer, (hi - lo) * inner, dtype=np.int64)], axis=1))
    if not out:
        return np.zeros((0, 3), dtype=np.int64)
    runs = np.concatenate(out)
    return runs[np.argsort(runs[:, 1], kind="stable")]


def _one_side(side: Side, offsets: np.ndarray, widths: np.ndarray, page_bytes: int, where: str) -> Side:
    if side.pieces.shape[0] != 1 or side.kv != 1 or side.heads != 1:
        raise BlockMapError(f"{where}: pages of state arrays are one row of bytes per block ({side.label})")
    n = len(widths)
    starts = np.concatenate(([0], np.cumsum(widths)[:-1])).astype(np.int64)  # the same on both sides
    return side.replaced(
        has_heads=False,
        pieces=np.stack([starts, widths.astype(np.int64)], axis=1),
        piece_dtypes=(side.piece_dtypes[0],) * n,
        tensor=np.repeat(side.tensor[:, :, :1], n, axis=2),
        offset=side.offset[:, :, :1] + offsets.astype(side.offset.dtype)[None, None, :],
        strides=np.tile(
            np.array([[side.strides[0, 0], page_bytes, page_bytes]], dtype=side.strides.dtype), (n, 1)
        ),
        block_size=1,
    )


def page_sides(src: Side, dst: Side, src_shard: Shard, dst_shard: Shard) -> tuple[Side, Side, bool]:
    """Both sides re-cut by the page template: a page is one slot of a block, a template
    run a piece of its row; and whether the ranks hold any state in common (where they
    do not, the sides hold one byte of a page, which a map of the ranks never moves).
    Built once per pair of sides and ranks, kept with ``src``."""
    per_dst = src._pairs.setdefault(dst, {})
    key = ("page sides", src_shard, dst_shard)  # KV-head arrays read the shards' heads too
    sides = per_dst.get(key)
    if sides is None:
        a, b = src.opaque_pages, dst.opaque_pages
        assert a is not None and b is not None
        page_bytes = (src.row_bytes * src.block_size, dst.row_bytes * dst.block_size)
        template = page_template(a, b, src_shard, dst_shard, page_bytes)
        common = len(template) > 0
        if not common:
            template = np.array([[0, 0, 1]], dtype=np.int64)
        widths = template[:, 2]
        sides = (
            _one_side(src, template[:, 0], widths, page_bytes[0], "src"),
            _one_side(dst, template[:, 1], widths, page_bytes[1], "dst"),
            common,
        )
        per_dst[key] = sides
    return sides
