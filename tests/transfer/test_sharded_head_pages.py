"""Pages of state sharded by the model's KV heads (ATOM's shuffled pools, aiter's layout):
a rank holds the heads its Shard says, so a template moves head ``h`` of the source's
page to head ``h`` of the destination's, wherever each rank's first head is."""

from __future__ import annotations

import numpy as np
import pytest

from kvlayout.registration.opaque import OpaquePages, PageArray
from kvlayout.registration.shards import Shard
from kvlayout.transfer.sharded_pages import page_template

ROW = 6  # bytes of one head's state


def _pages(shard: Shard) -> tuple[OpaquePages, bytes]:
    """A rank's page: each head it holds a row of ROW bytes, every byte its model head."""
    heads = shard.heads
    array = PageArray(0, (len(heads), ROW), "int8", 0, (len(heads),), kv_heads=True)
    data = bytes(h for h in heads for _ in range(ROW))
    return OpaquePages("heads", False, (array,)), data


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (Shard(1, 2, 4), Shard(3, 4, 4)),  # heads 2-3 to head 3
        (Shard(3, 4, 4), Shard(1, 2, 4)),  # head 3 to heads 2-3
        (Shard(0, 1, 4), Shard(6, 8, 4)),  # all four to head 3, held by ranks 6 and 7 of 8
        (Shard(1, 2, 8), Shard(0, 2, 8)),  # heads 4-7 and 0-3: none in common
    ],
)
def test_a_head_moves_to_the_same_head_of_the_other_rank(src: Shard, dst: Shard) -> None:
    a, src_page = _pages(src)
    b, dst_page = _pages(dst)
    runs = page_template(a, b, src, dst, (len(src_page), len(dst_page)))
    out = bytearray(len(dst_page))
    for s, d, n in runs.tolist():
        out[d : d + n] = src_page[s : s + n]
    both = set(src.heads) & set(dst.heads)
    expected = bytes(h if h in both else 0 for h in dst.heads for _ in range(ROW))
    assert bytes(out) == expected
    assert int(np.sum(runs[:, 2])) == len(both) * ROW
