"""SGLang registrations read in pages beside the plain pools: the page-major MLA pool
(``mem_cache/layout/page_major.py`` ``build_page_major_mla_views``: per-layer views
``(num_pages, page_size, 1, C)`` whose page stride is the envelope of every layer's
latents, layer L ``L * page_size`` rows into it) and the NSA/DSA indexer's bf16 key
cache (``NSATokenToKVPool`` under ``index_cache_dtype=torch.bfloat16``: per layer
``[pages, page_size * 128]`` bf16, no scales). Each block map is checked byte for byte
against torch indexing of the same tensors, and nothing else of the destination moves."""

from __future__ import annotations

import re

import pytest
import torch

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout.transfer import BlockMapError, block_map

NL, PS, C = 3, 4, 576


def page_major_mla(
    pages: int, *, anchor: int = 0, pad: int = 0, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The raw buffer and its views as ``build_page_major_mla_views`` makes them:
    ``anchor`` elements before the first page, ``pad`` elements of a wider envelope
    (``page_stride_bytes``) after each page's latents (another sub-pool's)."""
    page = PS * NL * C + pad
    raw = torch.randn(anchor + pages * page).to(dtype)
    views = [
        torch.as_strided(raw, (pages, PS, 1, C), (page, C, C, 1), anchor + layer * PS * C)
        for layer in range(NL)
    ]
    return raw, views


def oracle_page(views: list[torch.Tensor], layer: int, page: int) -> torch.Tensor:
    return views[layer][page, :, 0, :]


@pytest.mark.parametrize(("anchor", "pad"), [(0, 0), (8, 24)])
def test_page_major_mla_pool_reads_as_the_mla_device_format(anchor: int, pad: int) -> None:
    raw, views = page_major_mla(5, anchor=anchor, pad=pad)
    for hints in ({}, {"tokens_per_block": PS}):
        reg = kvlayout.detect(views, "sglang", hints)
        assert reg.format == F.NL_X_NB_BS_HS
        assert len(reg.kernel_groups) == 1 and kvlayout.get_block_size(reg, reg.format) == PS
    fmt, out = kvlayout.normalize_kv_and_discover_format(views, "sglang")
    assert fmt == F.NL_X_NB_BS_HS
    for layer, (o, v) in enumerate(zip(out, views, strict=True)):  # views of the user's buffer, no copies
        assert o.shape == (5, PS, C) and o.stride() == (PS * NL * C + pad, C, 1)
        assert o.data_ptr() == v.data_ptr() == raw.data_ptr() + (anchor + layer * PS * C) * raw.element_size()
    with pytest.raises(
        kvlayout.LayoutHintError, match=re.escape("tokens_per_block=8 contradicts its views' page_size 4")
    ):
        kvlayout.detect(views, "sglang", {"tokens_per_block": 8})


@pytest.mark.parametrize(("anchor", "pad"), [(0, 0), (8, 24)])
def test_page_major_mla_pool_maps_to_a_plain_sglang_mla_pool_and_back(anchor: int, pad: int) -> None:
    raw, views = page_major_mla(5, anchor=anchor, pad=pad)
    dense = [torch.randn(6 * PS, 1, C).to(torch.bfloat16) for _ in range(NL)]
    d = kvlayout.detect(dense, "sglang", {"tokens_per_block": PS})
    pm = kvlayout.detect(views, "sglang")
    before = [t.clone() for t in dense]
    block_map(pm, d, [1, 3], [5, 0]).copy()
    for layer in range(NL):
        expect = before[layer].clone()
        expect.view(6, PS, 1, C)[5] = views[layer][1]
        expect.view(6, PS, 1, C)[0] = views[layer][3]
        assert torch.equal(dense[layer], expect)
    # back: into pages 0 and 4 of the page-major pool; the rest of its buffer (other pages,
    # the anchor, the envelope's padding) keeps its bytes
    for t in dense:
        t.copy_(torch.randn(t.shape).to(t.dtype))
    raw_before = raw.clone()
    block_map(d, pm, [2, 5], [4, 0]).copy()
    expect_raw = raw_before.clone()
    expect_views = [torch.as_strided(expect_raw, v.shape, v.stride(), v.storage_offset()) for v in views]
    for layer in range(NL):
        expect_views[layer][4] = dense[layer].view(6, PS, 1, C)[2]
        expect_views[layer][0] = dense[layer].view(6, PS, 1, C)[5]
    assert torch.equal(raw, expect_raw)


def test_page_major_mla_pool_maps_to_vllm_mla_cache_byte_exactly() -> None:
    raw, views = page_major_mla(5, pad=16)
    vllm = [torch.randn(4, PS, C).to(torch.bfloat16) for _ in range(NL)]
    v = kvlayout.detect(vllm, "vllm")
    assert v.format == F.NL_X_NB_BS_HS
    pm = kvlayout.detect(views, "sglang", {"tokens_per_block": PS})
    before = [t.clone() for t in vllm]
    block_map(pm, v, [0, 2, 4], [3, 1, 2]).copy()
    for layer in range(NL):
        expect = before[layer].clone()
        for s, d in ((0, 3), (2, 1), (4, 2)):
            expect[d] = oracle_page(views, layer, s)
        assert torch.equal(vllm[layer], expect)
    raw_before = raw.clone()
    block_map(v, pm, [0], [1]).copy()
    changed = (raw != raw_before).nonzero().flatten()
    page = PS * NL * C + 16
    assert changed.numel() and all(
        page <= int(i) < page + NL * PS * C for i in changed
    )  # page 1's latents only
    for layer in range(NL):
        assert torch.equal(oracle_page(views, layer, 1), vllm[layer][0])


# -- the DSA indexer's bf16 key cache ------------------------------------------------------------

IPS = 64  # SGLang's NSA page size on CUDA (1 on HIP)


def bf16_indexer(pages: int, ps: int = IPS) -> list[torch.Tensor]:
    return [torch.randn(pages, ps * 128).to(torch.bfloat16) for _ in range(NL)]


@pytest.mark.parametrize("ps", [IPS, 1])
def test_bf16_indexer_reads_as_keys_without_scales(ps: int) -> None:
    size = 16 * ps
    idx = bf16_indexer((size + ps + 1) // ps, ps)
    for hints in ({}, {"tokens_per_block": ps}):
        reg = kvlayout.detect(idx, "sglang", hints)
        assert reg.format == F.NL_X_NB_BSK and kvlayout.is_indexer(reg.format)
        assert kvlayout.is_indexer_cache(idx[0], "sglang")
        assert kvlayout.get_block_size(reg, reg.format) == ps
    fmt, out = kvlayout.normalize_kv_and_discover_format(idx, "sglang")
    assert fmt == F.NL_X_NB_BSK
    for o, t in zip(out, idx, strict=True):  # byte views of the user's pages
        assert o.dtype == torch.uint8 and o.shape == (t.shape[0], ps, 256) and o.data_ptr() == t.data_ptr()


def test_bf16_indexer_maps_to_a_bf16_indexer_only() -> None:
    src, dst = bf16_indexer(9), bf16_indexer(7)
    a = kvlayout.detect(src, "sglang")
    b = kvlayout.detect(dst, "sglang", {"tokens_per_block": IPS})
    before = [t.clone() for t in dst]
    block_map(a, b, [1, 8, 4], [6, 0, 2]).copy()
    for layer in range(NL):
        expect = before[layer].clone()
        for s, d in ((1, 6), (8, 0), (4, 2)):
            expect[d] = src[layer][s]  # token rows of a page: [page, token * 128 + i]
        assert torch.equal(dst[layer], expect)

    fp8 = kvlayout.detect([torch.zeros(9, IPS * 132, dtype=torch.uint8) for _ in range(NL)], "sglang")
    assert fp8.format == F.NL_X_NB_BSV_BSS
    # an MLA pool of 128-wide bf16 latents: rows of the same bytes, not the same data
    mla = kvlayout.detect([torch.zeros(9 * IPS, 1, 128, dtype=torch.bfloat16) for _ in range(NL)], "sglang",
                          {"tokens_per_block": IPS})  # fmt: skip
    for other, holds in ((fp8, "(float8_e4m3fn + float32)"), (mla, "one latent row per token (MLA)")):
        for one, two, first, second in ((a, other, "(bfloat16)", holds), (other, a, holds, "(bfloat16)")):
            with pytest.raises(BlockMapError, match=re.escape("they do not hold the same data")) as err:
                block_map(one, two, [1], [2])
            message = str(err.value)
            assert message.index(first) < message.index(second)
