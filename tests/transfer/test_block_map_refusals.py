"""Refusals of block_map arguments that would address a cache in blocks it does not have."""

from __future__ import annotations

import pytest
import torch

import kvlayout
from kvlayout.registration.peers import RegistrationDescription
from kvlayout.transfer import BlockMapError, block_map


def test_a_peer_s_described_page_size_is_kept_over_a_block_size_that_does_not_divide_it() -> None:
    # SGLang's folded pool, described by its peer in pages of 4 tokens: a block size of 6
    # would re-cut the peer's pages (its block ids name pages of 4), so it is refused as for
    # a live cache; a multiple of 4 addresses two of its pages a block
    live = kvlayout.detect([torch.randn(24, 1, 8) for _ in range(2)], "sglang")
    peer = RegistrationDescription.from_json(
        kvlayout.detect([torch.randn(24, 1, 8) for _ in range(2)], "sglang").describe(block_size=4).to_json()
    )
    with pytest.raises(BlockMapError) as info:
        block_map(peer, live, [1, 0], [2, 3], src_block_size=6, dst_block_size=6)
    assert str(info.value).startswith(
        "src_block_size=6, but the src cache's blocks hold 4 tokens: give its block size or a multiple of it"
    )
    m = block_map(peer, live, [2], [1], src_block_size=8, dst_block_size=8)
    assert (m.num_tokens, m.num_bytes) == (8, 2 * 8 * 8 * 4)
