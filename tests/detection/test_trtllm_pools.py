"""TRT-LLM pools beyond the primary KV pool: the DSA indexer's K pool
(``get_indexer_k_cache_pool()``: uint8, kv factor 1, each block its tokens' fp8 values,
then their scales) is read as records, not as MLA latents; a list of several pools (VSWA,
or layers of different KV head counts) is refused with one message whatever its shapes."""

from __future__ import annotations

import pytest
import torch

import kvlayout
from kvlayout import DetectionError, LayoutHintError
from kvlayout import EngineKVFormat as F
from kvlayout.transfer import block_map

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
    with pytest.raises(DetectionError, match="FP4 indexer"):  # 64 packed bytes and a 4-byte scale a token
        kvlayout.detect(
            torch.zeros(NB, NL, 1, BS * 68, dtype=torch.uint8), "trtllm", {"tokens_per_block": BS}
        )
    with pytest.raises(DetectionError, match=rf"flat dim {BS * 140} != tokens_per_block \({BS}\) \* 132"):
        kvlayout.detect(
            torch.zeros(NB, NL, 1, BS * 140, dtype=torch.uint8), "trtllm", {"tokens_per_block": BS}
        )
    padded = torch.zeros(NB, NL + 1, 1, BS * 132, dtype=torch.uint8)[:, :NL]  # blocks a layer apart
    with pytest.raises(DetectionError, match="with padded rows cannot be split into its tokens' records"):
        kvlayout.detect(padded, "trtllm", {"tokens_per_block": BS})


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
