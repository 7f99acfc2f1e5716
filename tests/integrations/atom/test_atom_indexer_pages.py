"""ATOM's DSA indexer key cache (DeepSeek-V3.2, GLM-5): ``MlaKvPool``'s ``index`` field,
per indexer layer ``[num_blocks, block_size, W]`` uint8, ``W = aligned_index_cache_dim``
(the fp8 key and its fp32 scale, padded to 16 bytes).

The pool is carved as ``MlaKvPool.allocate`` carves it: one buffer, the MLA region (every
layer's ``kv`` ``[num_blocks, block_size, 576]``) then the index region, each layer's
slice contiguous. Keys and scales are written and read by the oracle at the addresses
ATOM's indexer uses (``index_staging.gather_dcp_preshuffled_index_pages``): a block's keys
in 16x16 MFMA tiles ``[BS/16, D/16, 16 tokens, 16 bytes]``, then one fp32 scale per token.
"""

from __future__ import annotations

import pytest
import torch

import kvlayout
from kvlayout.detection import DetectionError
from kvlayout.registration.contiguity import StridedViewError
from kvlayout.transfer import BlockMapError, Shard, block_map

LAYERS, INDEX_LAYERS, BLOCKS, BS, D = 3, 2, 5, 32, 128
W = -(-(D + 4) // 16) * 16  # aligned_index_cache_dim: 144
MLA = 576


def _align(n: int) -> int:
    return -(-n // 256) * 256


def atom_mla_pool(blocks: int = BLOCKS) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The buffer, every layer's MLA ``kv`` and every indexer layer's ``index`` views."""
    kv_bytes = _align(LAYERS * BS * MLA * 2) * blocks
    index_bytes = _align(INDEX_LAYERS * BS * W) * blocks
    buf = torch.zeros(kv_bytes + index_bytes, dtype=torch.uint8)
    kv = buf[:kv_bytes].view(torch.bfloat16)[: LAYERS * blocks * BS * MLA].view(LAYERS, blocks, BS, MLA)
    index = buf[kv_bytes:][: INDEX_LAYERS * blocks * BS * W].view(INDEX_LAYERS, blocks, BS, W)
    return buf, list(kv.unbind(0)), list(index.unbind(0))


def _key_offsets(token: int) -> torch.Tensor:
    """Bytes of a block's page holding ``token``'s key, in key order."""
    tile, row = divmod(token, 16)
    cols = torch.arange(D)
    return ((tile * (D // 16) + cols // 16) * 16 + row) * 16 + cols % 16


def write(layer: torch.Tensor, slot: int, key: torch.Tensor, scale: float) -> None:
    page = layer[slot // BS].view(-1)
    page[_key_offsets(slot % BS)] = key
    page[BS * D + (slot % BS) * 4 : BS * D + (slot % BS) * 4 + 4] = torch.tensor([scale]).view(torch.uint8)


def read(layer: torch.Tensor, slot: int) -> tuple[torch.Tensor, float]:
    page = layer[slot // BS].reshape(-1)
    start = BS * D + (slot % BS) * 4
    return page[_key_offsets(slot % BS)].clone(), float(page[start : start + 4].view(torch.float32))


def assert_blocks_moved(
    src: list[torch.Tensor], dst: list[torch.Tensor], pairs: list[tuple[int, int]]
) -> None:
    """Every token's key and scale of source block ``s`` is at destination block ``d``,
    each ``(s, d)`` of ``pairs``, read at ATOM's addresses."""
    for s_layer, d_layer in zip(src, dst, strict=True):
        for s, d in pairs:
            for tok in range(BS):
                key, scale = read(d_layer, d * BS + tok)
                want_key, want_scale = read(s_layer, s * BS + tok)
                assert torch.equal(key, want_key) and scale == want_scale


def filled(seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    buf, _, index = atom_mla_pool()
    gen = torch.Generator().manual_seed(seed)
    for layer in index:
        for slot in range(BLOCKS * BS):
            key = torch.randint(0, 256, (D,), generator=gen, dtype=torch.uint8)
            write(layer, slot, key, float(torch.rand(1, generator=gen)))
    return buf, index


def test_index_blocks_move_whole_with_every_key_and_scale() -> None:
    _, src = filled(1)
    buf, dst = filled(2)
    before = buf.clone()
    m = block_map(
        kvlayout.detect(src, "atom"),
        kvlayout.detect(dst, "atom", {"tokens_per_block": BS}),
        [3, 1],
        [0, 4],
        num_tokens=BS + 5,
    )
    assert (m.kind, m.num_tokens) == ("same layout", 2 * BS)  # a partly filled block moves whole
    m.copy()
    assert_blocks_moved(src, dst, [(3, 0), (1, 4)])
    moved = torch.zeros_like(before, dtype=torch.bool)
    for layer in dst:
        for d in (0, 4):
            start = layer[d].data_ptr() - buf.data_ptr()
            moved[start : start + BS * W] = True
    assert torch.equal(buf[~moved], before[~moved])


def test_every_tp_rank_holds_the_whole_index() -> None:
    _, src = filled(3)
    _, dst = filled(4)
    m = block_map(
        kvlayout.detect(src, "atom"), kvlayout.detect(dst, "atom"), [2], [1],
        src_shard=Shard(0, 2, 8), dst_shard=Shard(3, 4, 8),
    )  # fmt: skip
    m.copy()
    for s_layer, d_layer in zip(src, dst, strict=True):
        assert torch.equal(d_layer[1], s_layer[2])


def test_index_pages_are_no_token_rows_of_another_cache() -> None:
    _, index = filled(5)
    pages = kvlayout.detect(index, "atom")
    assert "atom-indexer-pages" in str(pages.describe())
    rows = [torch.zeros(BLOCKS, BS, W, dtype=torch.bfloat16) for _ in range(INDEX_LAYERS)]  # token rows
    with pytest.raises(BlockMapError, match=r"opaque pages .* and dst is not"):
        block_map(pages, kvlayout.detect(rows, "atom"), [1], [1])
    _, _, shorter = atom_mla_pool()
    small = [t[:, :16] for t in shorter]  # pages of another block size
    with pytest.raises(BlockMapError):
        block_map(pages, kvlayout.detect([t.contiguous() for t in small], "atom"), [1], [1])


def test_mla_latents_and_mp_rows_read_as_before() -> None:
    _, kv, index = atom_mla_pool()
    assert kvlayout.detect(kv, "atom").describe().groups[0].opaque_pages is None  # bf16 latents
    mp = [t.view(BLOCKS, 1, BS * W) for t in index]  # ATOM's MP connector: a block as one row of bytes
    assert kvlayout.detect(mp, "atom").describe().groups[0].opaque_pages is None


def test_index_caches_without_pages_are_refused() -> None:
    with pytest.raises(
        DetectionError, match=r"ATOM's DSA indexer key cache by its shape, and holds no blocks"
    ):
        kvlayout.detect([torch.zeros(0, BS, W, dtype=torch.uint8)] * 2, "atom")
    padded = torch.zeros(2, BLOCKS, BS, 2 * W, dtype=torch.uint8)[..., :W]  # rows no engine pads
    with pytest.raises(StridedViewError, match=r"interior padding is not supported"):
        kvlayout.detect(list(padded.unbind(0)), "atom")


def test_index_blocks_apart_in_a_larger_entry_move_from_their_own_bytes() -> None:
    """A block's index page inside a larger per-block entry (dim-0 padding: the entry's
    other fields between pages) moves from its own page, not from ``block * BS * W``."""
    entry = BS * W + 256  # another field's bytes after each page
    gen = torch.Generator().manual_seed(6)
    bufs = [torch.randint(0, 256, (BLOCKS * entry,), generator=gen, dtype=torch.uint8) for _ in range(2)]
    src = [b.view(BLOCKS, entry)[:, : BS * W].view(BLOCKS, BS, W) for b in bufs]
    assert src[0].stride(0) == entry
    _, dst = filled(7)
    block_map(kvlayout.detect(src, "atom"), kvlayout.detect(dst, "atom"), [3, 0], [1, 4]).copy()
    assert_blocks_moved(src, dst, [(3, 1), (0, 4)])


@pytest.mark.parametrize("shape", [(BLOCKS, 8, W), (BLOCKS, BS, 40)], ids=["rows", "width"])
def test_uint8_rows_that_are_no_16x16_tiles_read_as_token_rows(shape: tuple[int, ...]) -> None:
    """Only rows and bytes a row that are multiples of ATOM's 16x16 MFMA tile are the
    indexer's pages; other uint8 rows read as token rows, as before."""
    reg = kvlayout.detect([torch.zeros(shape, dtype=torch.uint8) for _ in range(2)], "atom")
    assert reg.describe().groups[0].opaque_pages is None


def test_one_index_tensor_not_in_a_list_is_refused_by_the_list_rule() -> None:
    with pytest.raises(DetectionError, match=r"no ATOM format has list depth 0 and tensor rank 3"):
        kvlayout.detect(torch.zeros(BLOCKS, BS, W, dtype=torch.uint8), "atom")
