"""SGLang's DeepSeek-V4 unified KV pool: its FP8 two-pool form and its SWA ring, as P/D and
HiCache move them.

The oracle allocates as ``DeepSeekV4UnifiedKVPool.__init__`` does (sgl-project/sglang
``deepseek_v4_memory_pool.py``): per layer ``rows = swa_pages + num_blocks * K_PER_BLOCK[ratio]
+ page_size // ratio``, bf16 ``[rows, 512]``, or under ``SGLANG_DSV4_UNIFIED_KV_FP8`` two pools
of those rows, ``kv_buffer`` float8_e4m3fn ``[rows, 512]`` (``DSV4_FP8_NOPE_ROW_BYTES``) and
``kv_buffer_rope`` bf16 ``[rows, 64]``. It addresses bytes as SGLang's P/D does
(``get_contiguous_buf_infos``: an item of ``page_size // ratio`` rows from row ``swa_pages``
on, one entry per pool; ``get_unified_swa_ring_buf_infos``: an item a row of ``[0,
swa_pages)``, row ``req * swa_ring + pos % swa_ring``) and as HiCache views the region
(``_unified_page_views``: ``[pages, rows_per_page * width]`` uint8). It knows nothing of
kvlayout's rows or runs; every byte outside the moved items keeps its value.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import kvlayout
from kvlayout.transfer import BlockMapError, Shard, block_map

NL, PAGE_SIZE, SWA_RING, SLOTS, NUM_BLOCKS = 2, 128, 16, 3, 4
NOPE_ROW, ROPE_DIM = 512, 64  # DSV4_FP8_NOPE_ROW_BYTES; qk_rope_head_dim
K_PER_BLOCK = {4: 32, 128: 1}
SWA_PAGES = SLOTS * SWA_RING


def rows(ratio: int) -> int:
    return SWA_PAGES + NUM_BLOCKS * K_PER_BLOCK[ratio] + PAGE_SIZE // ratio


def two_pool(ratio: int, seed: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(kv_buffer, kv_buffer_rope)`` of an FP8 unified pool's layers of one ratio."""
    n = rows(ratio)
    if seed is None:
        return (
            [torch.zeros(n, NOPE_ROW, dtype=torch.float8_e4m3fn) for _ in range(NL)],
            [torch.zeros(n, ROPE_DIM, dtype=torch.bfloat16) for _ in range(NL)],
        )
    gen = torch.Generator().manual_seed(seed)
    nope = [torch.randint(0, 256, (n, NOPE_ROW), dtype=torch.uint8, generator=gen) for _ in range(NL)]
    rope = [torch.randn(n, ROPE_DIM, generator=gen).to(torch.bfloat16) for _ in range(NL)]
    return [t.view(torch.float8_e4m3fn) for t in nope], rope


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).reshape(t.shape[0], -1)


def region(kv: list[torch.Tensor], rows_per_page: int) -> Any:
    """The docs' reading of a pool's compressed region (rows from swa_pages on)."""
    width = kv[0].shape[1]
    return kvlayout.detect(
        [b[SWA_PAGES:].view(-1, 1, width) for b in kv], "sglang", {"tokens_per_block": rows_per_page}
    )


def pd_item(buf: torch.Tensor, page: int, rows_per_page: int) -> torch.Tensor:
    """get_contiguous_buf_infos' item ``page``: data_ptr + swa_pages * row bytes, items of
    rows_per_page rows."""
    flat = raw(buf).flatten()
    row_bytes = raw(buf).shape[1]
    start = SWA_PAGES * row_bytes + page * rows_per_page * row_bytes
    return flat[start : start + rows_per_page * row_bytes]


@pytest.mark.parametrize("ratio", [4, 128])
def test_fp8_two_pool_regions_move_as_sglangs_pd_items(ratio: int) -> None:
    """Under SGLANG_DSV4_UNIFIED_KV_FP8 P/D ships each layer's NoPE region and RoPE region
    (item page_size // ratio rows of 512 and of 128 bytes): both read as MLA rows from
    swa_pages on, block ids SGLang's compressed page indices, and move apart."""
    rpp = PAGE_SIZE // ratio
    (s_nope, s_rope), (d_nope, d_rope) = two_pool(ratio, ratio), two_pool(ratio, None)
    pages = [(2, 0), (0, 3), (4, 1)]
    for src, dst in ((s_nope, d_nope), (s_rope, d_rope)):
        m = block_map(region(src, rpp), region(dst, rpp), [s for s, _ in pages], [d for _, d in pages])
        assert m.num_bytes == NL * len(pages) * rpp * raw(src[0]).shape[1]
        m.copy()
    for src, dst in ((s_nope, d_nope), (s_rope, d_rope)):
        for layer in range(NL):
            want = torch.zeros_like(raw(dst[layer]).flatten())
            for s, d in pages:
                item = pd_item(src[layer], s, rpp)
                start = SWA_PAGES * raw(dst[layer]).shape[1] + d * item.numel()
                want[start : start + item.numel()] = item
            assert torch.equal(raw(dst[layer]).flatten(), want), layer


def test_fp8_nope_and_rope_never_map_into_each_other() -> None:
    nope, rope = two_pool(4, None)
    with pytest.raises(BlockMapError):
        block_map(region(nope, 32), region(rope, 32), [1], [1])


@pytest.mark.parametrize("fp8", [False, True])
def test_swa_ring_rows_move_as_sglangs_swa_ring_items(fp8: bool) -> None:
    """get_unified_swa_ring_buf_infos (StateType.SWA_RING): rows [0, swa_pages) of each pool,
    an item a row, request slot r's ring rows r * swa_ring on. Read a row a block, block ids
    are SGLang's ring rows; read swa_ring rows a block, they are request slots."""
    if fp8:
        src_pools, dst_pools = list(two_pool(4, 7)), list(two_pool(4, None))
    else:
        gen = torch.Generator().manual_seed(8)
        src_pools = [[torch.randn(rows(4), 512, generator=gen).to(torch.bfloat16) for _ in range(NL)]]
        dst_pools = [[torch.zeros(rows(4), 512, dtype=torch.bfloat16) for _ in range(NL)]]

    def ring(kv: list[torch.Tensor], tpb: int) -> Any:
        width = kv[0].shape[1]
        return kvlayout.detect(
            [b[:SWA_PAGES].view(-1, 1, width) for b in kv], "sglang", {"tokens_per_block": tpb}
        )

    src_req, dst_req, positions = 2, 0, torch.arange(100, 100 + SWA_RING)  # the window of a long request
    src_rows = (src_req * SWA_RING + positions % SWA_RING).tolist()
    dst_rows = (dst_req * SWA_RING + positions % SWA_RING).tolist()
    for src, dst in zip(src_pools, dst_pools, strict=True):
        block_map(ring(src, 1), ring(dst, 1), src_rows[:5], dst_rows[:5]).copy()  # SGLang's row items
        block_map(ring(src, SWA_RING), ring(dst, SWA_RING), [src_req], [dst_req]).copy()  # a slot's ring
        for layer in range(NL):
            s, d = raw(src[layer]), raw(dst[layer])
            assert torch.equal(d[dst_rows], s[src_rows])
            assert not d[SWA_RING:].any()


@pytest.mark.parametrize("ratio", [4, 128])
def test_fp8_two_pool_regions_move_to_and_from_hicache_pages(ratio: int) -> None:
    """_unified_page_views: each pool's region as uint8 [pages, rows_per_page * row bytes], the
    NoPE's and the RoPE's host pools apart; read back in their dtypes as MLA rows."""
    rpp = PAGE_SIZE // ratio
    nope, rope = two_pool(ratio, 20 + ratio)
    pages = (rows(ratio) - SWA_PAGES) // rpp
    for dev, dtype in ((nope, torch.float8_e4m3fn), (rope, torch.bfloat16)):
        width = dev[0].shape[1]
        host = [torch.zeros(pages, rpp * raw(dev[0]).shape[1], dtype=torch.uint8) for _ in range(NL)]

        def host_rows(h: list[torch.Tensor], dtype: torch.dtype = dtype, width: int = width) -> Any:
            views = [v.view(dtype).view(-1, 1, width) for v in h]
            return kvlayout.detect(views, "sglang", {"tokens_per_block": rpp})

        block_map(region(dev, rpp), host_rows(host), [3, 1], [0, 2]).copy()
        for layer in range(NL):
            assert torch.equal(host[layer][0], pd_item(dev[layer], 3, rpp))
            assert torch.equal(host[layer][2], pd_item(dev[layer], 1, rpp))
            assert not host[layer][[1, *range(3, pages)]].any()
        back = two_pool(ratio, None)[0 if dtype == torch.float8_e4m3fn else 1]
        block_map(host_rows(host), region(back, rpp), [2], [4], src_shard=Shard(0, 2, 1)).copy()
        assert torch.equal(pd_item(back[1], 4, rpp), pd_item(dev[1], 1, rpp))


def test_detect_names_the_two_pool_readings() -> None:
    """Passed as allocated, either pool is refused naming the reading of its compressed rows
    from swa_pages on (the uniform-FP8 pool's reading, or one of a row per slot, would count
    the SWA ring's rows as pages)."""
    nope, rope = two_pool(4, None)
    for kv in (nope, rope):
        with pytest.raises(kvlayout.DetectionError) as info:
            kvlayout.detect(kv, "sglang")
        message = str(info.value)
        assert "SGLANG_DSV4_UNIFIED_KV_FP8" in message
        assert re.search(r"\[b\[swa_pages:\]\.view\(-1, 1, 512\) for b in kv_buffer\]", message)
        assert "[b[swa_pages:].view(-1, 1, 64) for b in kv_buffer_rope]" in message
