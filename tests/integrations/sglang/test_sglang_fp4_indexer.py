"""SGLang's DeepSeek-V4 indexer K cache under ``enable_deepseek_v4_fp4_indexer`` on CUDA
(``mem_cache/deepseek_v4_memory_pool.py`` ``DeepSeekV4IndexerPool``): per layer a uint8
``[(size + page_size + 1) // page_size, page_size * 68]`` page list, a page every slot's
64 packed e2m1 bytes, then every slot's 4 ue8m0 scale bytes (``get_index_k_fp4``:
payload at ``off * 64``, scales at ``page_size * 64 + off * 4``). It is read as format
39 ``NL_X_NB_BSV4_BSS4``, vLLM's MXFP4 indexer page, with no hint; the block maps are
checked byte for byte against that indexing."""

from __future__ import annotations

import re

import pytest
import torch

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout.transfer import BlockMapError, block_map

MXFP4 = F.NL_X_NB_BSV4_BSS4
NL = 3
VALUES, SCALES = 64, 4  # DeepSeekV4IndexerPool.packed_bytes_per_token, its scale bytes


def fp4_pool(size: int, page_size: int, seed: int) -> list[torch.Tensor]:
    """``index_k_with_scale_buffer`` as ``_create_buffer`` allocates it, random bytes."""
    pages = (size + page_size + 1) // page_size
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (pages, page_size * (VALUES + SCALES)), dtype=torch.uint8, generator=gen)
        for _ in range(NL)
    ]


def record(buf: torch.Tensor, page_size: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's ``get_index_k_fp4`` of one slot: its payload bytes and its scale bytes."""
    page, off = divmod(slot, page_size)
    scale_at = page_size * VALUES + off * SCALES
    return buf[page, off * VALUES : (off + 1) * VALUES], buf[page, scale_at : scale_at + SCALES]


@pytest.mark.parametrize("page_size", [64, 128, 256])
def test_fp4_pages_read_as_mxfp4_blocked_scale_pages(page_size: int) -> None:
    idx = fp4_pool(8 * page_size, page_size, 0)
    if page_size == 128:  # 8704 bytes: a V4.1 FlashMLA page of 16 slots too, so read given its page_size
        with pytest.raises(kvlayout.DetectionError, match=re.escape("(v41 at page_size 16)")):
            kvlayout.detect(idx, "sglang")
    for hints in ({}, {"tokens_per_block": page_size}) if page_size != 128 else ({"tokens_per_block": 128},):
        reg = kvlayout.detect(idx, "sglang", hints)
        assert reg.format == MXFP4 and kvlayout.is_indexer(reg.format)
        assert kvlayout.get_block_size(reg, reg.format) == page_size
        assert kvlayout.get_num_blocks(reg, reg.format) == idx[0].shape[0]
    assert kvlayout.is_indexer_cache(idx[0], "sglang", {"tokens_per_block": page_size})
    fmt, out = kvlayout.normalize_kv_and_discover_format(idx, "sglang", {"tokens_per_block": page_size})
    assert fmt == MXFP4
    for o, t in zip(out, idx, strict=True):  # views of the pool's pages, no copies
        assert o.shape == (t.shape[0], page_size, 68) and o.data_ptr() == t.data_ptr()


def test_block_map_moves_each_slots_payload_and_scales_where_sglang_reads_them() -> None:
    ps = 64
    src, dst = fp4_pool(6 * ps, ps, 1), fp4_pool(5 * ps, ps, 2)
    a, b = kvlayout.detect(src, "sglang"), kvlayout.detect(dst, "sglang", {"tokens_per_block": ps})
    before = [t.clone() for t in dst]
    src_pages, dst_pages = [3, 1, 5], [0, 4, 2]
    num_tokens = 2 * ps + 13  # the last page partly filled
    block_map(a, b, src_pages, dst_pages, num_tokens=num_tokens).copy()
    for layer in range(NL):
        expect = before[layer].clone()
        for p in range(num_tokens):
            s_slot = src_pages[p // ps] * ps + p % ps
            d_slot = dst_pages[p // ps] * ps + p % ps
            for want, got in zip(record(expect, ps, d_slot), record(src[layer], ps, s_slot), strict=True):
                want.copy_(got)
        assert torch.equal(dst[layer], expect), layer


def test_fp4_pages_move_to_vllms_mxfp4_indexer_and_back() -> None:
    """vLLM's page (``indexer_k_store.py``: values at ``pos * 64``, scales at
    ``block_size * 64 + pos * 4``) is SGLang's: a page moves whole, byte for byte."""
    ps = 64
    sgl = fp4_pool(4 * ps, ps, 3)
    vllm = [torch.zeros(7, ps, 68, dtype=torch.uint8) for _ in range(NL)]
    a, b = kvlayout.detect(sgl, "sglang"), kvlayout.detect(vllm, "vllm", {})
    assert b.format == MXFP4
    block_map(a, b, [2, 0], [6, 1]).copy()
    for layer in range(NL):
        assert torch.equal(vllm[layer][6].flatten(), sgl[layer][2])
        assert torch.equal(vllm[layer][1].flatten(), sgl[layer][0])
        assert not vllm[layer][[0, 2, 3, 4, 5]].any()
    back = [torch.zeros_like(t) for t in sgl]
    block_map(b, kvlayout.detect(back, "sglang"), [6], [4]).copy()
    for layer in range(NL):
        assert torch.equal(back[layer][4], sgl[layer][2])


def test_fp4_and_fp8_indexer_pages_do_not_hold_the_same_data() -> None:
    ps = 64
    fp4 = kvlayout.detect(fp4_pool(4 * ps, ps, 4), "sglang")
    fp8 = kvlayout.detect([torch.zeros(5, ps * 132, dtype=torch.uint8) for _ in range(NL)], "sglang")
    assert fp8.format == F.NL_X_NB_BSV_BSS
    for one, two in ((fp4, fp8), (fp8, fp4)):
        with pytest.raises(BlockMapError, match=re.escape("they do not hold the same data")):
            block_map(one, two, [1], [2])


def test_a_row_of_either_width_is_read_at_the_page_size_given() -> None:
    """2244 bytes are 33 records of 68 bytes or 17 of 132: no real page size, but a row
    that reads two ways is never guessed at."""
    kv = [torch.zeros(5, 2244, dtype=torch.uint8) for _ in range(NL)]
    with pytest.raises(
        kvlayout.DetectionError,
        match=re.escape(
            "(W = 132 or 68 bytes), but its row fits several formats: pass layout hint tokens_per_block"
        ),
    ):
        kvlayout.detect(kv, "sglang")
    for tpb, fmt in ((33, MXFP4), (17, F.NL_X_NB_BSV_BSS)):
        reg = kvlayout.detect(kv, "sglang", {"tokens_per_block": tpb})
        assert reg.format == fmt and kvlayout.get_block_size(reg, fmt) == tpb
    with pytest.raises(
        kvlayout.LayoutHintError,
        match=re.escape(
            "layout hint tokens_per_block=4 contradicts its indexer row, which is 17 records of "
            "NL_X_NB_BSV_BSS or 33 records of NL_X_NB_BSV4_BSS4"
        ),
    ):
        kvlayout.detect(kv, "sglang", {"tokens_per_block": 4})


def flashmla_pages(page_size: int) -> list[torch.Tensor]:
    """DeepSeek-V4's main / C4 / C128 KV pool (``DeepSeekV4SingleKVPool.create_buffer``, the
    V4 layout): uint8 ``[pages, ceil(page_size * 584 / 576) * 576]``."""
    row = -(-page_size * 584 // 576) * 576
    return [torch.zeros(5, row, dtype=torch.uint8) for _ in range(NL)]


@pytest.mark.parametrize("page_size", [16, 32, 64])
def test_deepseek_v4_flashmla_pages_are_not_read_as_indexer_pages(page_size: int) -> None:
    """At page_size 16 a FlashMLA page is 144 FP4 indexer records, at 32 144 FP8 ones: its
    padding to 576 bytes tells it apart, and a page_size given contradicts the records."""
    note = "a DeepSeek-V4 KV pool's FlashMLA pages (DeepSeekV4SingleKVPool.kv_buffer"
    with pytest.raises(kvlayout.DetectionError, match=re.escape(note)):
        kvlayout.detect(flashmla_pages(page_size), "sglang")
    given = kvlayout.LayoutHintError if page_size < 64 else kvlayout.DetectionError  # 64: no records at all
    with pytest.raises(given, match=re.escape(note)):
        kvlayout.detect(flashmla_pages(page_size), "sglang", {"tokens_per_block": page_size})


def test_an_indexer_page_of_576_aligned_bytes_reads_given_its_page_size() -> None:
    kv = [torch.zeros(5, 48 * 132, dtype=torch.uint8) for _ in range(NL)]  # 6336 = 11 * 576
    with pytest.raises(kvlayout.DetectionError, match="is padded to a multiple of 576 bytes"):
        kvlayout.detect(kv, "sglang")
    reg = kvlayout.detect(kv, "sglang", {"tokens_per_block": 48})
    assert reg.format == F.NL_X_NB_BSV_BSS and kvlayout.get_block_size(reg, reg.format) == 48


def test_rocm_split_fp4_indexer_buffers_are_refused_by_name() -> None:
    """``uses_aiter_fp4_layout`` (ROCm): payload ``[pages, 1, 4, page_size, 16]`` (a rank-5
    shape of 16-byte vectors, like the ``vectorized_5d`` K) and scales ``[pages, 1, 4,
    page_size]``; a token's bytes are split across its page."""
    payload = [torch.zeros(9, 1, 4, 64, 16, dtype=torch.uint8) for _ in range(NL)]
    scale = [torch.zeros(9, 1, 4, 64, dtype=torch.uint8) for _ in range(NL)]
    for kv in (payload, scale):
        with pytest.raises(kvlayout.DetectionError, match=re.escape("a ROCm DeepSeek-V4 FP4 indexer's")):
            kvlayout.detect(kv, "sglang")


def test_fp4_mla_scale_rows_read_as_the_error_says() -> None:
    """``MLATokenToKVPoolFP4.kv_scale_buffer``: uint8 ``[size + page_size, C // 16]``, a row per
    token slot (``set_mla_kv_scale_buffer_triton`` writes row ``loc``)."""
    ps, width = 16, 576 // 16
    gen = torch.Generator().manual_seed(7)
    src = [torch.randint(0, 256, (6 * ps, width), dtype=torch.uint8, generator=gen) for _ in range(NL)]
    dst = [torch.zeros(5 * ps, width, dtype=torch.uint8) for _ in range(NL)]
    with pytest.raises(kvlayout.DetectionError, match=re.escape("pass [t.unsqueeze(1) for t in buffers]")):
        kvlayout.detect(src, "sglang", {"tokens_per_block": ps})
    a, b = (
        kvlayout.detect([t.unsqueeze(1) for t in kv], "sglang", {"tokens_per_block": ps}) for kv in (src, dst)
    )
    block_map(a, b, [4, 1], [0, 3], num_tokens=ps + 3).copy()
    for layer in range(NL):
        expect = torch.zeros_like(dst[layer])
        expect[0:ps] = src[layer][4 * ps : 5 * ps]
        expect[3 * ps : 3 * ps + 3] = src[layer][ps : ps + 3]
        assert torch.equal(dst[layer], expect)
