"""check_block_granularity checks every paged attention kind vLLM 0.33 groups (a wrong
kv_layout hint on a sliding-window, chunked-local or sink layer moves other tokens'
bytes as surely as on a full-attention one), and refuses nothing vLLM registers."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest
import torch

from kvlayout.integrations.vllm import (
    BlockGranularityError,
    apply_kv_cache_group_edits,
    check_block_granularity,
)
from kvlayout.testing.vllm import FLASH_ATTN, allocate_legacy, allocate_v033, uniform_engine

pytest.importorskip("vllm.v1.kv_cache_interface")
import vllm.v1.kv_cache_interface as kvi
from vllm.v1.kv_cache_layout import KVCacheLayout

HEADS, BLOCK = 8, 16
SIZES: dict[str, Any] = {"block_size": BLOCK, "num_kv_heads": HEADS, "head_size": 64, "dtype": torch.bfloat16}
KINDS = {
    "full": kvi.FullAttentionSpec(**SIZES),
    "sliding window": kvi.SlidingWindowSpec(**SIZES, sliding_window=128),
    "chunked local": kvi.ChunkedLocalAttentionSpec(**SIZES, attention_chunk_size=64),
    "sink full": kvi.SinkFullAttentionSpec(**SIZES, sink_len=4),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_paged_attention_kind_is_checked_under_the_hint(kind: str) -> None:
    # NHD pages (LBNHC) read under the HND hint: 8 heads read as a block of 8 tokens
    engine = uniform_engine(KINDS[kind], FLASH_ATTN, num_layers=3, layout=KVCacheLayout.LBNHC)
    _, kv_caches = allocate_v033(engine)
    check_block_granularity(engine.config, kv_caches, {"kv_layout": "NHD"})
    with pytest.raises(BlockGranularityError) as info:
        check_block_granularity(engine.config, kv_caches, {"kv_layout": "HND"})
    assert str(info.value).startswith(
        "registered blocks are not block ids under kv_layout='HND': group 0: layer "
        f"'model.layers.0.self_attn.attn' (and 2 more) reads as NL_X_NB_NH_BS_CS with block size {HEADS}, "
        f"not {BLOCK}. "
    )


@pytest.mark.parametrize("allocated", [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC])
@pytest.mark.parametrize("hint", ["NHD", "HND"])
def test_one_kv_head_a_rank_reads_alike_under_either_hint(allocated: KVCacheLayout, hint: str) -> None:
    # Llama-3 70B's 8 KV heads at TP 8: one head a rank, whose NHD and HND blocks are the
    # same bytes, so neither hint is wrong (the view's unit head axis orders nothing)
    spec = kvi.FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=128, dtype=torch.bfloat16)
    engine = uniform_engine(spec, FLASH_ATTN, num_layers=2, layout=allocated)
    _, kv_caches = allocate_v033(engine)
    out = apply_kv_cache_group_edits(engine.config, kv_caches, {"kv_layout": hint})
    assert all(out[name] is kv_caches[name] for name in kv_caches)
    check_block_granularity(engine.config, kv_caches, {"kv_layout": hint})


@pytest.mark.parametrize("hnd", [False, True])
def test_a_legacy_registration_with_as_many_blocks_as_heads_passes(hnd: bool) -> None:
    # Pre-0.26 FlashAttention registers (2, blocks, tokens, heads, D): with as many blocks
    # as heads its second axis has the heads' size, but it is no [blocks, heads, tokens, C]
    # view to read vLLM 0.33's allocation from
    spec = kvi.FullAttentionSpec(**SIZES)
    engine = uniform_engine(spec, FLASH_ATTN, num_layers=2, num_blocks=HEADS)
    _, kv_caches = allocate_legacy(engine, FLASH_ATTN, hnd=hnd)
    hint = {"kv_layout": "HND" if hnd else "NHD"}
    check_block_granularity(engine.config, kv_caches, hint)
    with pytest.raises(BlockGranularityError, match=f"with block size {HEADS}, not {BLOCK}"):
        check_block_granularity(engine.config, kv_caches, {"kv_layout": "NHD" if hnd else "HND"})


def test_more_heads_than_tokens_a_block_under_the_wrong_hint_say_the_block_size_read() -> None:
    # 32 heads of an NHD allocation read under HND: blocks of 32 tokens, more than the 16
    # of a block id (too many slots is as wrong as too few)
    spec = kvi.FullAttentionSpec(block_size=BLOCK, num_kv_heads=32, head_size=8, dtype=torch.bfloat16)
    engine = uniform_engine(spec, FLASH_ATTN, num_layers=2, num_blocks=40, layout=KVCacheLayout.LBNHC)
    _, kv_caches = allocate_v033(engine)
    check_block_granularity(engine.config, kv_caches, {"kv_layout": "NHD"})
    with pytest.raises(BlockGranularityError) as info:
        check_block_granularity(engine.config, kv_caches, {"kv_layout": "HND"})
    assert (
        "group 0: layer 'model.layers.0.self_attn.attn' (and 1 more) reads as NL_X_NB_NH_BS_CS with block "
        f"size 32, not {BLOCK}. "
    ) in str(info.value)


def test_vllm_s_cpu_attention_registration_passes_without_a_hint() -> None:
    # vLLM's CPU backend allocates HND (LBHNC); without a hint kvlayout reads a CPU layer as
    # CPU_ATTN's whole pages, which have no head axis for the allocation's order to contradict
    spec = kvi.FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=8, dtype=torch.bfloat16)
    engine = uniform_engine(spec, FLASH_ATTN, num_layers=2, num_blocks=5, layout=KVCacheLayout.LBHNC)
    _, kv_caches = allocate_v033(engine)
    check_block_granularity(engine.config, kv_caches)
    apply_kv_cache_group_edits(engine.config, kv_caches)  # which checks what it will register


def test_a_spec_of_no_whole_slots_a_block_is_not_checked() -> None:
    # Whisper's pooled encoder cache: two slots a token (tokens_per_state 1/2), so a block
    # id's page holds 32 slots of a 16-token block; no whole slot count to check it against
    spec = kvi.FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.bfloat16, tokens_per_state=Fraction(1, 2)
    )
    config = kvi.KVCacheConfig(
        num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[kvi.KVCacheGroupSpec(["enc"], spec)]
    )
    check_block_granularity(config, {"enc": torch.zeros(4, 2, 2 * BLOCK, 32, dtype=torch.bfloat16)}, None)
