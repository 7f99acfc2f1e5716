"""Refusals of block_map arguments that would address a cache in blocks it does not have."""

from __future__ import annotations

import pytest
import torch

import kvlayout
from kvlayout.registration.peers import RegistrationDescription
from kvlayout.transfer import BlockMapError, block_map
from tests.transfer.test_block_maps import vllm


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


def test_the_block_first_token_cuts_is_written_and_may_not_repeat() -> None:
    # first_token=2 in blocks of 4: dst_blocks[0] takes tokens 2-3, so it is written, and
    # block 5 again as dst_blocks[1] would take tokens 6-7 into the same slots
    src, dst = vllm(2, 8, 4, 2, 8), vllm(2, 8, 4, 2, 8)
    with pytest.raises(BlockMapError) as info:
        block_map(src, dst, [0, 1], [5, 5], first_token=2)
    assert str(info.value).startswith(
        "dst_blocks[1] = 5 repeats dst_blocks[0]: each destination slot is written once (blocks wholly "
        "before first_token are not written"
    )
    m = block_map(src, dst, [0, 1], [4, 5], first_token=2)
    assert m.num_bytes == 2 * 2 * 6 * 2 * 8 * 4  # tokens 2-7 of 2 layers, K and V, 2 heads of 8 floats


def test_a_request_whose_every_token_was_served_moves_nothing_whatever_its_blocks() -> None:
    # first_token == num_tokens: the prefix cache served all 6 tokens; no block is written,
    # so the last (partly filled) block repeating the first is no conflict
    src, dst = vllm(2, 8, 4, 2, 8), vllm(2, 8, 4, 2, 8)
    m = block_map(src, dst, [0, 1], [7, 7], num_tokens=6, first_token=6)
    assert (m.num_runs, m.num_bytes) == (0, 0)
