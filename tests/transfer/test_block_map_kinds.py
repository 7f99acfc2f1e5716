"""A map's kind names what differs whichever side holds fewer heads: a TP 2 prefill rank
into a TP 1 decode cache is a head slice as much as the reverse."""

from __future__ import annotations

from kvlayout.registration.shards import Shard
from kvlayout.transfer import block_map
from tests.transfer.test_block_maps import vllm


def test_a_rank_of_half_the_heads_into_a_whole_cache_is_a_head_slice() -> None:
    half, whole = vllm(2, 8, 4, 2, 8), vllm(2, 8, 4, 4, 8)
    m = block_map(half, whole, [0], [1], src_shard=Shard(1, 2, 4))
    assert (m.kind, m.reason) == ("head slice", "src holds heads 2-3 and dst 0-3, so the map moves heads 2-3")
    assert m.num_bytes == 2 * 2 * 4 * 2 * 8 * 4  # layers, K/V, tokens, heads moved, head size, float32
