"""The page template of TP-sharded state arrays, against a global-index oracle.

Random arrays (axes, the sharded axis, parts, element sizes, gaps between arrays) at two
TP degrees and ranks: the oracle builds the model's global arrays, slices each rank's
page by the sharding rule, applies the template's runs byte by byte, and checks that
every destination element both ranks hold came from the source and no other byte moved.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlayout.registration.opaque import OpaquePages, PageArray
from kvlayout.registration.shards import Shard
from kvlayout.transfer import BlockMapError
from kvlayout.transfer.sharded_pages import page_template

DEGREES = [1, 2, 4, 8]


def _local(global_array: np.ndarray, axis: int, parts: list[int], rank: int, tp: int) -> np.ndarray:
    """Rank ``rank``'s array: its slice of each global part along ``axis``, concatenated."""
    pieces, start = [], 0
    for size in parts:
        n = size // tp
        pieces.append(np.take(global_array, np.arange(start + rank * n, start + (rank + 1) * n), axis=axis))
        start += size
    return np.concatenate(pieces, axis=axis)


@st.composite
def arrays_and_ranks(draw: st.DrawFn) -> dict[str, object]:
    ts, td = draw(st.sampled_from(DEGREES)), draw(st.sampled_from(DEGREES))
    rs, rd = draw(st.integers(0, ts - 1)), draw(st.integers(0, td - 1))
    lcm = math.lcm(ts, td)
    specs = []
    for _ in range(draw(st.integers(1, 3))):
        ndim = draw(st.integers(1, 3))
        axis = draw(st.integers(0, ndim - 1))
        parts = [lcm * draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 3)))]
        shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
        shape[axis] = sum(parts)
        dtype = draw(st.sampled_from([np.int8, np.int16, np.int32, np.int64]))
        gap = draw(st.integers(0, 2)) * np.dtype(dtype).itemsize
        specs.append((shape, axis, parts, dtype, gap))
    return {"ts": ts, "td": td, "rs": rs, "rd": rd, "specs": specs}


def _page(
    specs: list[tuple[list[int], int, list[int], type, int]], rank: int, tp: int, fill: int
) -> tuple[bytearray, list[PageArray], list[np.ndarray]]:
    """A rank's page (its arrays after their gaps, 5 bytes of padding), the arrays it
    declares, and each array's global indices in place of its elements."""
    page, declared, where = bytearray(), [], []
    base = 0
    for k, (shape, axis, parts, dtype, gap) in enumerate(specs):
        base += gap
        numbered = np.arange(math.prod(shape)).reshape(shape)
        mine = _local(numbered, axis, parts, rank, tp)
        values: np.ndarray = (mine + 1000 * k + fill).astype(dtype)
        page += bytes(gap) + values.tobytes()
        declared.append(
            PageArray(base, tuple(mine.shape), np.dtype(dtype).name, axis, tuple(p // tp for p in parts))
        )
        where.append(mine)
        base += values.nbytes
    return page + bytes(5), declared, where


@settings(max_examples=300, deadline=None)
@given(arrays_and_ranks())
def test_template_moves_exactly_the_elements_both_ranks_hold(case: dict[str, object]) -> None:
    ts, td, rs, rd = (int(case[k]) for k in ("ts", "td", "rs", "rd"))  # type: ignore[call-overload]
    specs = case["specs"]
    assert isinstance(specs, list)
    src, src_arrays, src_where = _page(specs, rs, ts, 0)
    dst, dst_arrays, dst_where = _page(specs, rd, td, 7)
    before = bytes(dst)
    runs = page_template(
        OpaquePages("s", False, tuple(src_arrays)), OpaquePages("s", False, tuple(dst_arrays)),
        Shard(rs, ts, 8), Shard(rd, td, 8), (len(src), len(dst)),
    )  # fmt: skip
    assert (np.diff(runs[:, 1]) > 0).all()  # destination order, disjoint
    for s, d, n in runs.tolist():
        dst[d : d + n] = src[s : s + n]
    # the oracle: element by element, in global indices
    expected = bytearray(before)
    for k, ((_, _, _, dtype, _), x, y) in enumerate(zip(specs, src_arrays, dst_arrays, strict=True)):
        held = {int(g): i for i, g in enumerate(src_where[k].ravel())}
        size = np.dtype(dtype).itemsize
        for j, g in enumerate(dst_where[k].ravel()):
            i = held.get(int(g))
            if i is not None:
                expected[y.offset + j * size : y.offset + (j + 1) * size] = src[
                    x.offset + i * size : x.offset + (i + 1) * size
                ]
    assert dst == expected


def test_arrays_that_are_not_one_state_are_refused() -> None:
    a = OpaquePages("s", False, (PageArray(0, (8, 3), "bfloat16", 0, (8,)),))
    for other, message in [
        ((), r"^src pages declare 1 state arrays and dst pages 0: not the same state"),
        (
            (PageArray(0, (4, 3), "float16", 0, (4,)),),
            r"^state array 0 is bfloat16 \[8, 3\] \(axis 0 in parts \[8\]\) in src and float16 \[4, 3\] "
            r"\(axis 0 in parts \[4\]\) in dst: other dtypes \(a map copies bytes\)",
        ),
        ((PageArray(0, (3, 4), "bfloat16", 1, (4,)),), r"in dst: other axes or parts \(another order"),
        ((PageArray(0, (4, 2), "bfloat16", 0, (4,)),), r"in dst: other sizes on an axis TP does not shard"),
        (
            (PageArray(0, (8, 3), "bfloat16", 0, (8,)),),
            r"^state array 0 cannot move between TP 1 rank 0 and TP 2 rank 1: its part 0 is 8 of 8 at TP 1 and "
            r"8 of 16 at TP 2\. The model's sizes differ",
        ),
    ]:
        with pytest.raises(BlockMapError, match=message):
            page_template(a, OpaquePages("s", False, other), Shard(0, 1, 8), Shard(1, 2, 8), (64, 64))


def test_a_template_of_too_many_runs_is_refused() -> None:
    """A peer may declare arrays whose sharded axis is innermost under a huge outer axis."""
    big = (PageArray(0, (70000, 2), "int8", 1, (2,)),)
    small = (PageArray(0, (70000, 1), "int8", 1, (1,)),)
    with pytest.raises(BlockMapError, match=r"cut a page into more than 65536 runs"):
        page_template(OpaquePages("s", False, big), OpaquePages("s", False, small), Shard(0, 1, 2), Shard(1, 2, 2),
                      (140000, 70000))  # fmt: skip
    # refused before anything of that size is made: 2**46 outer indices would be 512 TiB of runs
    huge = (
        (PageArray(0, (1 << 23, 1 << 23, 2), "int8", 2, (2,)),),
        (PageArray(0, (1 << 23, 1 << 23, 1), "int8", 2, (1,)),),
    )
    with pytest.raises(BlockMapError, match=r"cut a page into more than 65536 runs"):
        page_template(OpaquePages("s", False, huge[0]), OpaquePages("s", False, huge[1]), Shard(0, 1, 2),
                      Shard(1, 2, 2), (1 << 47, 1 << 46))  # fmt: skip


def test_page_arrays_are_checked_when_made() -> None:
    with pytest.raises(ValueError, match=r"parts \[3\] must add up to its axis 0 of shape \[4\]"):
        PageArray(0, (4,), "int8", 0, (3,))
    with pytest.raises(TypeError, match=r"shape must be a tuple of positive ints"):
        PageArray(0, (4, 0), "int8", 0, (4,))
    with pytest.raises(ValueError, match=r"dtype 'int4' is not one of bfloat16"):
        PageArray(0, (4,), "int4", 0, (4,))
    with pytest.raises(ValueError, match=r"page array 1 starts at byte 3, inside array 0 \(bytes 0 to 4\)"):
        OpaquePages("s", False, (PageArray(0, (4,), "int8", 0, (4,)), PageArray(3, (4,), "int8", 0, (4,))))
