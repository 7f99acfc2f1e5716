"""ATOM's DSA indexer key cache as its attention backend pages it: ``[NB * BS, 1, W]`` uint8
at ``ATOM_MLA_PAGE_SIZE=1`` (one token a physical page), which the indexer re-views as
``[-1, index_block_size, W]`` (``index_block_size`` the block size, times the DCP size
under ``ATOM_DCP_REPLICATE_INDEX_CACHE=1``) and writes a page at a time.

The oracle reads a token's key and scale as ATOM's
``index_staging.gather_dcp_preshuffled_index_pages`` does from such physical pages: the
cache's bytes as ``[pages, page_bytes]`` (``block_ratio`` physical pages a page), keys
``[:, :P*D]`` as ``[pages, P/16, D/16, 16, 16]`` indexed ``[page, tok // 16, :, tok % 16,
:]``, scales ``[:, P*D : P*D + 4P]`` as float32 ``[pages, P]``.
"""

from __future__ import annotations

import pytest
import torch

import kvlayout
from kvlayout.integrations.atom import IndexerPagesError, indexer_pages
from kvlayout.transfer import BlockMapError, block_map
from kvlayout.types import LayoutHintError

LAYERS, BLOCKS, BS, D = 2, 6, 32, 128
W = -(-(D + 4) // 16) * 16  # aligned_index_cache_dim: 144


def physical(page: int = BS, blocks: int = BLOCKS, seed: int = 0, rows: int = 1) -> list[torch.Tensor]:
    """Every indexer layer's cache of random bytes as the backend views it, ``rows`` a
    physical page, carved from one buffer as ``MlaKvPool`` carves its index region."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (LAYERS * blocks * page * W,), generator=gen, dtype=torch.uint8)
    return list(buf.view(LAYERS, blocks * page // rows, rows, W).unbind(0))


def token(layer: torch.Tensor, page: int, tok: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ``tok`` of indexer page ``page`` (``rows`` tokens a page), as ATOM reads it."""
    pages = layer.reshape(-1, rows * W)
    keys = pages[:, : rows * D].reshape(-1, rows // 16, D // 16, 16, 16)[page, tok // 16, :, tok % 16, :]
    scales = pages[:, rows * D : rows * D + 4 * rows].reshape(-1, rows, 4)[page, tok]
    return keys.reshape(-1).clone(), scales.view(torch.float32).clone()


def test_one_token_pages_move_as_the_indexer_pages_with_every_key_and_scale() -> None:
    src, dst = physical(seed=1), physical(seed=2)
    before = [t.clone() for t in dst]
    m = block_map(indexer_pages(src, BS), indexer_pages(dst, BS), [4, 1], [0, 5], num_tokens=BS + 3)
    assert (m.kind, m.num_tokens) == ("same layout", 2 * BS)  # a partly filled page moves whole
    m.copy()
    for s_layer, d_layer, old in zip(src, dst, before, strict=True):
        for s, d in ((4, 0), (1, 5)):
            for tok in range(BS):
                got, want = token(d_layer, d, tok, BS), token(s_layer, s, tok, BS)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        moved = torch.zeros(BLOCKS * BS, dtype=torch.bool)
        moved[0:BS] = moved[5 * BS : 6 * BS] = True
        assert torch.equal(d_layer[~moved], old[~moved])  # no other physical page written


def test_one_token_pages_are_the_pools_scheduler_blocks() -> None:
    """``MlaKvPool.region_tensors`` (what the connectors register) and the backend's
    one-token pages of the same buffer are one layout: a block maps between them."""
    src = physical(seed=3)
    pool = [t.view(BLOCKS, BS, W) for t in physical(seed=4)]
    kvlayout.detect(pool, "atom")  # the pool's registration reads as pages by itself
    block_map(indexer_pages(src, BS), kvlayout.detect(pool, "atom"), [2], [3]).copy()
    for s_layer, d_layer in zip(src, pool, strict=True):
        assert torch.equal(d_layer[3].reshape(-1), s_layer[2 * BS : 3 * BS].reshape(-1))
        assert torch.equal(token(d_layer, 3, 17, BS)[0], token(s_layer, 2, 17, BS)[0])


@pytest.mark.parametrize("rows", [1, 4, 16, BS], ids=["1", "4", "16", "BS"])
def test_any_physical_page_size_that_groups_into_the_indexers_pages(rows: int) -> None:
    src, dst = physical(seed=5, rows=rows), physical(seed=6)
    block_map(indexer_pages(src, BS), indexer_pages(dst, BS), [5], [2]).copy()
    for s_layer, d_layer in zip(src, dst, strict=True):
        for tok in (0, 15, 16, BS - 1):
            assert torch.equal(token(d_layer, 2, tok, BS)[1], token(s_layer, 5, tok, BS)[1])


def test_replicated_dcp_pages_are_wider_and_map_only_to_pages_alike() -> None:
    """Under ``ATOM_DCP_REPLICATE_INDEX_CACHE=1`` the indexer's page is the block size
    times the DCP size (``index_block_size``): such pages map to each other, not to a
    producer's pages of the block size (ATOM relays those with a byte plan of its own)."""
    dcp = 2
    src, dst = physical(page=BS * dcp, blocks=3, seed=7), physical(page=BS * dcp, blocks=3, seed=8)
    replicated = indexer_pages(src, BS * dcp)
    block_map(replicated, indexer_pages(dst, BS * dcp), [0], [2]).copy()
    for s_layer, d_layer in zip(src, dst, strict=True):
        for tok in (0, BS, 2 * BS - 1):  # a token of the second DCP rank's half too
            got, want = token(d_layer, 2, tok, BS * dcp), token(s_layer, 0, tok, BS * dcp)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(BlockMapError):
        block_map(indexer_pages(physical(seed=9), BS), replicated, [0], [0])


def test_detection_given_a_block_size_names_the_reader_and_without_it_reads_block_rows() -> None:
    rows = physical(seed=10)
    with pytest.raises(
        LayoutHintError,
        match=r"tokens_per_block=32 contradicts rows of bytes \[N, 1, W\].*MP connector's blocks.*"
        r"ATOM_MLA_PAGE_SIZE=1.*kvlayout\.integrations\.atom\.indexer_pages\(index_caches, rows_per_page\)",
    ):
        kvlayout.detect(rows, "atom", {"tokens_per_block": BS})
    # without the hint a row is a block (the MP connector's registration), as before
    group = kvlayout.detect(rows, "atom").describe().groups[0]
    assert (group.block_size, group.opaque_pages) == (1, None)


def test_caches_that_are_not_the_indexers_pages_are_refused() -> None:
    rows = physical(seed=11)
    with pytest.raises(IndexerPagesError, match=r"a positive multiple of 16 rows"):
        indexer_pages(rows, 24)
    with pytest.raises(IndexerPagesError, match=r"its 192 rows are not whole pages of rows_per_page=128"):
        indexer_pages(rows, 128)
    with pytest.raises(
        IndexerPagesError, match=r"index_caches\[0\] \[192, 1, 72\] torch.bfloat16: .* is uint8"
    ):
        indexer_pages([t.view(torch.bfloat16) for t in physical(seed=12, rows=1)], BS)
    with pytest.raises(IndexerPagesError, match=r"a row of 40 bytes is no aligned_index_cache_dim"):
        indexer_pages([torch.zeros(64, 1, 40, dtype=torch.uint8)] * 2, BS)
    apart = torch.zeros(LAYERS, BLOCKS * BS, 2, W, dtype=torch.uint8)[:, :, :1]  # pages apart
    with pytest.raises(IndexerPagesError, match=r"physical pages of 1 rows are not contiguous"):
        indexer_pages(list(apart.unbind(0)), BS)
    with pytest.raises(IndexerPagesError, match=r"not a non-empty list"):
        indexer_pages([], BS)
    with pytest.raises(IndexerPagesError, match=r"its 0 rows are not whole pages"):
        indexer_pages([torch.zeros(0, 1, W, dtype=torch.uint8)] * 2, BS)
    with pytest.raises(TypeError, match=r"rows_per_page must be an int"):
        indexer_pages(rows, 32.0)  # type: ignore[arg-type]
