"""A kv_layout hint that contradicts vLLM 0.33's allocation is refused even where its
reading has the right block size and block count: 16 KV heads in blocks of 16 (Gemma-3
27B at TP 1) read the same sizes as NHD or HND, and a cache with no more blocks than
heads reads the same sizes with heads inside or outside them. The registered view's
memory order says how vLLM allocated it; those readings moved other tokens' bytes."""

from __future__ import annotations

import pytest
import torch

import kvlayout
from kvlayout.integrations.vllm import BlockGranularityError, apply_kv_cache_group_edits
from kvlayout.testing.vllm import FLASH_ATTN, allocate_v033, uniform_engine

pytest.importorskip("vllm.v1.kv_cache_interface")
import vllm.v1.kv_cache_interface as kvi
from vllm.v1.kv_cache_layout import KVCacheLayout


def registration(heads: int, blocks: int, layout: KVCacheLayout) -> tuple[object, dict[str, torch.Tensor]]:
    spec = kvi.FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=8, dtype=torch.bfloat16)
    engine = uniform_engine(spec, FLASH_ATTN, num_layers=2, num_blocks=blocks, layout=layout)
    _, kv = allocate_v033(engine)
    return engine.config, kv


@pytest.mark.parametrize(
    ("heads", "blocks", "allocated", "hint", "reads"),
    [
        (16, 6, KVCacheLayout.LBNHC, "HND", r"LBNHC \(NHD\) .* but reads as NL_X_NB_NH_BS_CS"),
        (16, 6, KVCacheLayout.LBHNC, "NHD", r"LBHNC \(HND\) .* but reads as NL_X_NB_BS_NH_CS"),
        (4, 4, KVCacheLayout.LHBNC, "HND", r"LHBNC \(strides .*\) but reads as NL_X_NB_NH_BS_CS"),
        (4, 4, KVCacheLayout.LBHNC, "LHBNC", r"LBHNC \(HND\) .* but reads as NL_X_NH_NB_BS_CS"),
    ],
)
def test_a_hint_that_contradicts_the_allocation_is_refused(
    heads: int, blocks: int, allocated: KVCacheLayout, hint: str, reads: str
) -> None:
    config, kv = registration(heads, blocks, allocated)
    with pytest.raises(BlockGranularityError, match=f"is allocated {reads}"):
        apply_kv_cache_group_edits(config, kv, {"kv_layout": hint})


@pytest.mark.parametrize(
    ("allocated", "hint"),
    [(KVCacheLayout.LBNHC, "NHD"), (KVCacheLayout.LBHNC, "HND"), (KVCacheLayout.LHBNC, "LHBNC")],
)
def test_the_matching_hint_reads_the_tokens(allocated: KVCacheLayout, hint: str) -> None:
    config, kv = registration(16, 6, allocated)
    edited = apply_kv_cache_group_edits(config, kv, {"kv_layout": hint})
    group = kvlayout.detect(list(edited.values()), "vllm", {"kv_layout": hint}).only_group()
    assert (group.block_size, group.num_blocks, group.descriptor().nh) == (16, 6, 16)


def test_a_block_size_the_backend_cannot_serve_is_vllm_s_error_not_an_empty_max() -> None:
    """vLLM's ``select_common_block_size`` raises ``No common block size for 32 (...)``
    where no supported kernel block size divides the block (FlashMLA serves 64 only); the
    test engine says the same, where it raised ``max() arg is an empty sequence``."""
    from kvlayout.testing.vllm import FLASHMLA

    spec = kvi.MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^No common block size for 32 \(FLASHMLA: \[64\]\)"):
        uniform_engine(spec, FLASHMLA, num_layers=2, num_blocks=4)
    assert FLASHMLA.kernel_block_size(128) == 64 and FLASHMLA.kernel_block_size(64) == 64
    assert FLASH_ATTN.kernel_block_size(48) == 48
