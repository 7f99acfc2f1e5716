"""TRT-LLM pools beyond the primary KV pool: the DSA indexer's K pool
(``get_indexer_k_cache_pool()``: uint8, kv factor 1, each block its tokens' fp8 values,
then their scales; or, under ``indexer_k_dtype="fp4"``, their packed e2m1 values, then
their ue8m0 exponents) is read as records, not as MLA latents; a list of several pools (VSWA,
or layers of different KV head counts) is refused with one message whatever its shapes."""

from __future__ import annotations

import re

import pytest
import torch

import kvlayout
from kvlayout import DetectionError, LayoutHintError, StridedViewError
from kvlayout import EngineKVFormat as F
from kvlayout.transfer import BlockMapError, block_map

BS, NB, NL = 4, 5, 2


def _indexer_pool() -> torch.Tensor:
    return torch.randint(
        0, 256, (NB, NL, 1, BS * 132), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
    )


def _values(pool: torch.Tensor, block: int, layer: int, token: int) -> torch.Tensor:
    return pool[block, layer, 0, token * 128 : (token + 1) * 128]


def _scale(pool: torch.Tensor, block: int, layer: int, token: int) -> torch.Tensor:
    return pool[block, layer, 0, BS * 128 + token * 4 : BS * 128 + (token + 1) * 4]


@pytest.mark.parametrize("head_dim", [None, 128, 132])
def test_indexer_pool_moves_each_tokens_values_and_scale(head_dim: int | None) -> None:
    src = _indexer_pool()
    hints = {"tokens_per_block": BS} | ({} if head_dim is None else {"head_dim": head_dim})
    a = kvlayout.detect(src, "trtllm", hints)
    assert a.format is F.NB_NL_BSV_BSS
    dst = torch.zeros_like(src)
    # a partial last block: its tokens' scales lie after every value of the block, not beside them
    block_map(a, kvlayout.detect(dst, "trtllm", hints), [3, 1], [0, 2], num_tokens=BS + 1).copy()
    for p in range(BS + 1):
        (sb, db), t = ((3, 0), (1, 2))[p // BS], p % BS
        for layer in range(NL):
            assert torch.equal(_values(dst, db, layer, t), _values(src, sb, layer, t))
            assert torch.equal(_scale(dst, db, layer, t), _scale(src, sb, layer, t))
    assert not _values(dst, 2, 0, 1).any() and not _scale(dst, 2, 0, 1).any()


def test_indexer_pool_maps_to_sglangs_indexer_pages() -> None:
    src = _indexer_pool()
    pages = [torch.zeros(4, BS * 132, dtype=torch.uint8) for _ in range(NL)]
    sg = kvlayout.detect(pages, "sglang", {"page_size": BS})
    block_map(kvlayout.detect(src, "trtllm", {"tokens_per_block": BS}), sg, [3], [1]).copy()
    assert all(torch.equal(pages[layer][1], src[3, layer, 0]) for layer in range(NL))


def test_indexer_pool_hints_are_checked() -> None:
    with pytest.raises(LayoutHintError, match="needs layout hint tokens_per_block"):
        kvlayout.detect(_indexer_pool(), "trtllm")
    with pytest.raises(LayoutHintError, match="contradict"):
        kvlayout.detect(_indexer_pool(), "trtllm", {"tokens_per_block": BS, "head_dim": 64})
    with pytest.raises(
        LayoutHintError,
        match=re.escape(
            "contradict its one head of 64 value bytes and 4 scale bytes a token (head_dim 64 or 68 or 128)"
        ),
    ):
        kvlayout.detect(_fp4_pool(), "trtllm", {"tokens_per_block": BS, "head_dim": 132})
    for pool in (_indexer_pool(), _fp4_pool()):  # one indexer key a token: one head
        with pytest.raises(
            LayoutHintError, match=r"layout hints num_kv_heads=2 and head_dim=None contradict"
        ):
            kvlayout.detect(pool, "trtllm", {"tokens_per_block": BS, "num_kv_heads": 2})
    with pytest.raises(
        DetectionError, match=rf"flat dim {BS * 140} != tokens_per_block \({BS}\) \* 132 or 68"
    ):
        kvlayout.detect(
            torch.zeros(NB, NL, 1, BS * 140, dtype=torch.uint8), "trtllm", {"tokens_per_block": BS}
        )
    apart = torch.zeros(NB, NL, 1, BS * 132 * 2, dtype=torch.uint8)[..., ::2]  # a row's bytes apart
    with pytest.raises(
        StridedViewError, match=r"innermost dim 3 has stride 2 != 1 \(elements are not contiguous\)"
    ):
        kvlayout.detect(apart, "trtllm", {"tokens_per_block": BS})


def test_indexer_pool_blocks_apart_move_each_tokens_values_and_scale() -> None:
    """Blocks a layer's row apart (a ``KVCacheManagerV2`` slot holds other buffers after its
    index keys, the view ``[num_slots, NL, 1, BS * 132]`` steps over them): each row is still
    its tokens' values, then their scales, and maps to a pool without the gaps token by
    token; the gaps are never read."""
    whole = torch.randint(
        0, 256, (NB, NL + 1, 1, BS * 132), dtype=torch.uint8, generator=torch.Generator().manual_seed(8)
    )
    padded = whole[:, :NL]
    dst = torch.zeros(NB, NL, 1, BS * 132, dtype=torch.uint8)
    a = kvlayout.detect(padded, "trtllm", {"tokens_per_block": BS})
    b = kvlayout.detect(dst, "trtllm", {"tokens_per_block": BS})
    assert a.kernel_groups[0].format is F.NB_NL_BSV_BSS
    block_map(a, b, [4, 1], [0, 2], num_tokens=BS + 3).copy()
    for (s, d), tokens in zip(((4, 0), (1, 2)), (BS, 3), strict=True):
        for layer in range(NL):
            for t in range(tokens):
                assert torch.equal(_values(dst, d, layer, t), _values(padded, s, layer, t))
                assert torch.equal(_scale(dst, d, layer, t), _scale(padded, s, layer, t))
    assert not dst[2, :, :, 3 * 128 : BS * 128].any() and not dst[[1, 3, 4]].any()


def test_masked_indexer_pool_rows_are_its_full_indexer_layers() -> None:
    """GLM-5.2's masked pool (``indexer_k_cache_layer_mask``): only full-indexer layers own a
    row, row ``k`` the rank's ``k``-th of them (``get_indexer_k_cache_pool_layer_idx``: layers
    0, 1, 5 of 6 -> rows 0, 1, 2). Nothing in the pool says so: it detects as any indexer
    pool of that many layers, numbered with those layers' ids, and a pipeline stage holding
    layer 5 alone takes row 2 (``for_layers``), not row 0, as by position it would."""
    whole = torch.randint(
        0, 256, (NB, 3, 1, BS * 132), dtype=torch.uint8, generator=torch.Generator().manual_seed(9)
    )
    src = kvlayout.detect(whole, "trtllm", {"tokens_per_block": BS}).numbered([0, 1, 5])
    assert src.format is F.NB_NL_BSV_BSS and src.num_layers == 3
    stage = torch.zeros(NB, 1, 1, BS * 132, dtype=torch.uint8)  # layers 3-5: layer 5's row alone
    dst = kvlayout.detect(stage, "trtllm", {"tokens_per_block": BS}).numbered([5])
    with pytest.raises(BlockMapError, match=r"for_layers\(layer_ids\) \(5\)"):
        block_map(src, dst, [3], [1], num_tokens=BS)
    block_map(src.for_layers([5]), dst, [3], [1], num_tokens=BS).copy()
    assert torch.equal(stage[1, 0], whole[3, 2]) and not stage[[0, 2, 3, 4]].any()


FP4_VALUES, FP4_SCALES = 64, 4  # index_head_dim // 2 packed e2m1 bytes, one int32 of four ue8m0 exponents


def _fp4_pool(nb: int = NB, seed: int = 5) -> torch.Tensor:
    """``DSACacheManager`` under ``indexer_k_dtype="fp4"`` (``dsa/cache_manager.py``): the
    C++ pool ``[NB, NL, 1, BS * 68]`` uint8, ``68 = index_head_dim // 2 + index_head_dim //
    128 * 4``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(
        0, 256, (nb, NL, 1, BS * (FP4_VALUES + FP4_SCALES)), dtype=torch.uint8, generator=gen
    )


def _fp4_record(pool: torch.Tensor, block: int, layer: int, token: int) -> torch.Tensor:
    """Token ``token``'s values and scale in block ``block`` as TRT-LLM lays them out
    (``get_indexer_k_cache_buffers``' non-interleaved block: every token's data bytes,
    then every token's scale bytes)."""
    row = pool[block, layer, 0]
    values = row[token * FP4_VALUES : (token + 1) * FP4_VALUES]
    scale = row[BS * FP4_VALUES + token * FP4_SCALES : BS * FP4_VALUES + (token + 1) * FP4_SCALES]
    return torch.cat([values, scale])


@pytest.mark.parametrize("head_dim", [None, 128, 64, 68])
def test_fp4_indexer_pool_moves_each_tokens_values_and_scale(head_dim: int | None) -> None:
    """Under ``indexer_k_dtype="fp4"`` the indexer pool's records are 68 bytes, read as
    ``NB_NL_BSV4_BSS4``: a request's tokens move between two pools record for record, a
    partly filled last block its tokens only."""
    src, dst = _fp4_pool(), torch.zeros(NB, NL, 1, BS * 68, dtype=torch.uint8)
    hints = {"tokens_per_block": BS} | ({} if head_dim is None else {"head_dim": head_dim})
    a, b = kvlayout.detect(src, "trtllm", hints), kvlayout.detect(dst, "trtllm", hints)
    assert a.format is F.NB_NL_BSV4_BSS4 and a.kernel_groups[0].block_size == BS
    assert block_map(a, b, [3, 1], [0, 2], num_tokens=BS + 1).copy() == 1
    written = torch.zeros(NB, BS, dtype=torch.bool)
    for p in range(BS + 1):
        (sb, db), t = ((3, 0), (1, 2))[p // BS], p % BS
        written[db, t] = True
        for layer in range(NL):
            assert torch.equal(_fp4_record(dst, db, layer, t), _fp4_record(src, sb, layer, t))
    for blk in range(NB):
        for t in range(BS):
            if not written[blk, t]:
                assert not any(_fp4_record(dst, blk, layer, t).any() for layer in range(NL))


def test_fp4_indexer_pool_maps_to_vllms_mxfp4_indexer_pages() -> None:
    """TRT-LLM's FP4 indexer blocks of 4 tokens into vLLM's ``indexer_kv_dtype="mxfp4"``
    pages of 8 (``indexer_k_store.py``: values at ``pos * 64``, scales at ``block_size * 64
    + pos * 4``), 6 tokens: one vLLM block from two TRT-LLM blocks, and back."""
    src = _fp4_pool()
    pages = [torch.zeros(4, 2 * BS * 68, dtype=torch.uint8).view(4, 2 * BS, 68) for _ in range(NL)]
    vllm = kvlayout.detect(pages, "vllm")
    assert vllm.format is F.NL_X_NB_BSV4_BSS4
    trt = kvlayout.detect(src, "trtllm", {"tokens_per_block": BS})
    assert block_map(trt, vllm, [4, 0], [3], num_tokens=BS + 2).copy() == 1

    def vllm_record(layer: int, block: int, pos: int) -> torch.Tensor:
        page = pages[layer][block].reshape(-1)
        n = 2 * BS
        return torch.cat([page[pos * 64 : (pos + 1) * 64], page[n * 64 + pos * 4 : n * 64 + (pos + 1) * 4]])

    for p in range(BS + 2):
        for layer in range(NL):
            assert torch.equal(vllm_record(layer, 3, p), _fp4_record(src, (4, 0)[p // BS], layer, p % BS))
    assert all(not vllm_record(layer, 3, p).any() for layer in range(NL) for p in range(BS + 2, 2 * BS))
    assert not any(pages[layer][:3].any() for layer in range(NL))
    back = torch.zeros_like(src)
    assert (
        block_map(
            vllm, kvlayout.detect(back, "trtllm", {"tokens_per_block": BS}), [3], [1, 2], num_tokens=BS + 2
        ).copy()
        == 1
    )
    for p in range(BS + 2):
        for layer in range(NL):
            assert torch.equal(_fp4_record(back, (1, 2)[p // BS], layer, p % BS), vllm_record(layer, 3, p))


def test_fp8_and_fp4_indexer_pools_do_not_map_to_each_other() -> None:
    """Records of 132 and 68 bytes are other keys: no map pairs them."""
    fp8 = kvlayout.detect(_indexer_pool(), "trtllm", {"tokens_per_block": BS})
    fp4 = kvlayout.detect(_fp4_pool(), "trtllm", {"tokens_per_block": BS})
    with pytest.raises(kvlayout.transfer.BlockMapError):
        block_map(fp8, fp4, [0], [0])


def test_a_bf16_k_only_pool_is_still_mla() -> None:
    pool = torch.zeros(NB, NL, 1, BS * 576, dtype=torch.bfloat16)
    assert (
        kvlayout.detect(pool, "trtllm", {"tokens_per_block": BS, "head_dim": 576}).format is F.NB_NL_ONE_BS_HS
    )


@pytest.mark.parametrize("second", [(9, 3), (17, 2)])
def test_several_pools_are_refused_alike_whatever_their_shapes(second: tuple[int, int]) -> None:
    pools = [torch.zeros(9, 3, 2, 2 * BS * 8), torch.zeros(*second, 2, 2 * BS * 8)]
    with pytest.raises(DetectionError, match="a pool each: detect each on its own"):
        kvlayout.detect(pools, "trtllm", {"tokens_per_block": BS, "num_kv_heads": 2, "head_dim": 8})


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_per_layer_get_buffers_views_are_refused_with_the_way_to_read_them(layout: str) -> None:
    """``get_buffers(layer, kv_layout)`` views ``[NB, 2, ...]`` of one pool: TRT-LLM's detector
    reads the pool; the views read as vLLM's per-layer caches, byte for byte."""
    nb, nl, bs, nh, hs = 6, 3, 4, 2, 8
    pool = torch.randn(nb, nl, 2, nh * bs * hs)
    shape = (nb, 2, bs, nh, hs) if layout == "NHD" else (nb, 2, nh, bs, hs)
    views = [pool[:, layer].reshape(shape) for layer in range(nl)]
    with pytest.raises(DetectionError, match=r"get_buffers.*engine 'vllm'"):
        kvlayout.detect(views, "trtllm", {"kv_layout": layout})
    with pytest.raises(DetectionError, match=r"is no pool.*engine 'vllm'"):
        kvlayout.detect(views[0], "trtllm", {"kv_layout": layout})
    src = kvlayout.detect(views, "vllm", {"kv_layout": layout})
    caches = [torch.zeros(2, 8, bs, nh, hs) for _ in range(nl)]
    block_map(src, kvlayout.detect(caches, "vllm", {"kv_layout": "NHD"}), [3, 0], [7, 6]).copy()
    for layer in range(nl):
        for i, b in enumerate([3, 0]):
            got = caches[layer][:, 7 - i]  # [2, BS, NH, HS]
            want = views[layer][b] if layout == "NHD" else views[layer][b].transpose(1, 2)
            assert torch.equal(got, want)


# NVFP4 KV (V1 KVCacheManager, WindowBlockManager::allocatePools / createBlockScalePools):
# the data pool int8 [NB, NL, 2, NH*BS*HD/2], two e2m1 values a byte, and its twin the
# block-scale pool float8_e4m3fn [NB, NL, 2, NH*BS*HD/16], one scale per 16 values
# (kQuantBlockSizeNVFP4), both addressed by KVBlockArray::getKVLocalIdx(token, head,
# dimsPerHead, channel) = head * BS * dimsPerHead + token % BS * dimsPerHead + channel: the
# data at that index over 2 for dimsPerHead = HD, the scales at it for dimsPerHead = HD / 16
# (tests/unit_tests/kernels/ropeTest.cu's reference writes both so).
FP4_NH, FP4_HD = 2, 32


def _nvfp4_pools(bs: int, nb: int, seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    shapes = ((nb, NL, 2, FP4_NH * bs * FP4_HD // 2), (nb, NL, 2, FP4_NH * bs * FP4_HD // 16))
    if seed is None:
        return torch.zeros(shapes[0], dtype=torch.int8), torch.zeros(shapes[1], dtype=torch.float8_e4m3fn)
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(-128, 128, shapes[0], dtype=torch.int8, generator=gen)
    scales = torch.randint(0, 256, shapes[1], dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    return data, scales


def _local_idx(bs: int, token: int, head: int, dims: int, channel: int) -> int:
    return head * bs * dims + token % bs * dims + channel


def _nvfp4_token(
    pools: tuple[torch.Tensor, torch.Tensor], bs: int, block: int, layer: int, kv: int, token: int, head: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Head ``head`` of token ``token``: its HD/2 packed bytes and HD/16 scales."""
    data, scales = pools
    at = _local_idx(bs, token, head, FP4_HD, 0) // 2
    sat = _local_idx(bs, token, head, FP4_HD // 16, 0)
    return (
        data[block, layer, kv, at : at + FP4_HD // 2],
        scales[block, layer, kv, sat : sat + FP4_HD // 16].view(torch.uint8),
    )


def test_nvfp4_data_and_block_scale_pools_move_each_tokens_heads() -> None:
    """Both pools read by their bytes (scales) per head and token, a request's 6 tokens
    from blocks of 4 into blocks of 8, each head's values and scales where TRT-LLM's
    indexing puts them on both sides."""
    src, dst = _nvfp4_pools(BS, NB, 21), _nvfp4_pools(2 * BS, 3, None)
    for k, dims in ((0, FP4_HD // 2), (1, FP4_HD // 16)):
        hints = {"num_kv_heads": FP4_NH, "head_dim": dims}
        a = kvlayout.detect(src[k], "trtllm", {**hints, "tokens_per_block": BS})
        b = kvlayout.detect(dst[k], "trtllm", {**hints, "tokens_per_block": 2 * BS})
        assert a.format is b.format is F.NB_NL_TWO_NH_BS_HS
        block_map(a, b, [4, 1], [2], num_tokens=BS + 2).copy()
    for p in range(BS + 2):
        for layer in range(NL):
            for kv in range(2):
                for head in range(FP4_NH):
                    got = _nvfp4_token(dst, 2 * BS, 2, layer, kv, p, head)
                    want = _nvfp4_token(src, BS, (4, 1)[p // BS], layer, kv, p % BS, head)
                    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    for p in range(BS + 2, 2 * BS):
        assert not any(
            t.any()
            for layer in range(NL)
            for kv in range(2)
            for t in _nvfp4_token(dst, 2 * BS, 2, layer, kv, p, 0)
        )
    assert not dst[0][:2].any() and not dst[1][:2].view(torch.uint8).any()


def test_nvfp4_block_scale_pool_under_the_models_head_dim_is_named_not_read_as_fewer_heads() -> None:
    """With the model's head_dim the scale pool's row is a sixteenth short; 32 heads of 128
    would fit 2 heads as a TP rank's, which would read the scales as a 2-head FP8 KV
    pool: the message names the scale pool and its head_dim instead."""
    nh, hd = 32, 128
    scales = torch.zeros(NB, NL, 2, nh * BS * hd // 16, dtype=torch.float8_e4m3fn)
    hints = {"num_kv_heads": nh, "tokens_per_block": BS, "head_dim": hd}
    with pytest.raises(LayoutHintError, match="NVFP4's block-scale pool") as info:
        kvlayout.detect(scales, "trtllm", hints)
    assert "detect it with head_dim=8 (its scales per head and token)" in str(info.value)
    assert "fits" not in str(info.value)
    data = torch.zeros(NB, NL, 2, nh * BS * hd // 2, dtype=torch.int8)
    with pytest.raises(LayoutHintError, match=r"head_dim=64 .* block-scale pool on its own with head_dim=8"):
        kvlayout.detect(data, "trtllm", hints)
    # an FP8 KV pool a TP rank's heads short is still told which head count fits
    with pytest.raises(LayoutHintError, match="and 16 fits"):
        kvlayout.detect(scales.view(NB, NL, 2, -1).repeat(1, 1, 1, 8), "trtllm", hints)


def test_nvfp4_block_scale_pool_maps_only_to_scales_of_the_same_model() -> None:
    """A block-scale pool reads as an FP8 KV pool of head_dim HD / 16 (nothing in it says
    scales): paired with the same model's int8 data pool the dtypes differ, and with an
    FP8 KV pool of the model's head_dim the rows do, so either is refused, naming why."""
    hints = {"num_kv_heads": FP4_NH, "tokens_per_block": BS}
    data, scales = _nvfp4_pools(BS, NB, 5)
    s = kvlayout.detect(scales, "trtllm", {**hints, "head_dim": FP4_HD // 16})
    d = kvlayout.detect(data, "trtllm", {**hints, "head_dim": FP4_HD // 2})
    fp8 = torch.zeros(NB, NL, 2, FP4_NH * BS * FP4_HD, dtype=torch.float8_e4m3fn)
    k = kvlayout.detect(fp8, "trtllm", {**hints, "head_dim": FP4_HD})
    with pytest.raises(BlockMapError, match=r"^src is float8_e4m3fn and dst is int8: a map copies bytes"):
        block_map(s, d, [1], [2])
    with pytest.raises(BlockMapError, match=r"^src rows are 2 bytes a head and dst rows 32 "):
        block_map(s, k, [1], [2])
    assert block_map(s, s, [1], [2]).num_bytes == NL * 2 * FP4_NH * BS * FP4_HD // 16
