"""Page arrays every TP rank holds whole (``replicated``): they move whole between ranks of
any two TP degrees, and only between arrays of the same shape."""

from __future__ import annotations

import pytest

from kvlayout.registration.opaque import OpaquePages, PageArray
from kvlayout.registration.shards import Shard
from kvlayout.transfer import BlockMapError
from kvlayout.transfer.sharded_pages import page_template, structure_problem


def _pages(rows: int) -> OpaquePages:
    return OpaquePages("whole", False, (PageArray(0, (rows, 4), "int8", 0, (rows,), replicated=True),))


@pytest.mark.parametrize(("src", "dst"), [(Shard(0, 1, 2), Shard(1, 2, 2)), (Shard(3, 4, 2), Shard(0, 2, 2))])
def test_an_array_every_rank_holds_moves_whole_between_tp_degrees(src: Shard, dst: Shard) -> None:
    runs = page_template(_pages(3), _pages(3), src, dst, (12, 12))
    assert runs.tolist() == [[0, 0, 12]]


def test_arrays_every_rank_holds_of_other_sizes_are_not_one_state() -> None:
    what = "state array 0 is {} in src and {} in dst: other sizes of an array every rank holds whole"
    a, b = _pages(3), _pages(2)
    assert structure_problem(a, b) == what.format(a.arrays[0], b.arrays[0])
    with pytest.raises(
        BlockMapError, match="other sizes of an array every rank holds whole: not the same state"
    ):
        page_template(a, b, Shard(0, 1, 2), Shard(0, 2, 2), (12, 8))
