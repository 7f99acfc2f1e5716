"""The vLLM models and registrations the tests use: re-exported from
:mod:`kvlayout.integrations.vllm.examples` (one copy, shared with ``kvlayout demo``), plus
test-only helpers.

Importing this module skips the importing test module when vLLM is not installed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

# Before the import below: without vLLM the importing test module is skipped, not errored.
pytest.importorskip("vllm.v1.kv_cache_interface", reason="vllm is not installed")

from kvlayout.integrations.vllm.examples import (
    FLASH_ATTN,
    FLASHINFER,
    FLASHMLA,
    LLAMA_3_2_1B,
    NUM_BLOCKS,
    QWEN3_5_0_8B,
    QWEN3_NEXT_80B_A3B,
    AttentionModel,
    Backend,
    Engine,
    HybridModel,
    KVCacheLayout,
    allocate,
    allocate_legacy,
    allocate_v033,
    attention_engine,
    attention_spec,
    cdiv,
    gdn_states,
    group_layers,
    hints,
    hybrid_block_size,
    hybrid_engine,
    kvi,
    legacy_attention,
    legacy_mamba_states,
    make_engine,
    mla_hybrid_engine,
    page_region,
)

__all__ = [
    "FLASHINFER",
    "FLASHMLA",
    "FLASH_ATTN",
    "LLAMA_3_2_1B",
    "NUM_BLOCKS",
    "QWEN3_5_0_8B",
    "QWEN3_NEXT_80B_A3B",
    "AttentionModel",
    "Backend",
    "Engine",
    "HybridModel",
    "KVCacheLayout",
    "allocate",
    "allocate_legacy",
    "allocate_v033",
    "attention_engine",
    "attention_spec",
    "cdiv",
    "first_tensor",
    "gdn_states",
    "group_layers",
    "hints",
    "hybrid_block_size",
    "hybrid_engine",
    "kvi",
    "legacy_attention",
    "legacy_mamba_states",
    "make_engine",
    "mla_hybrid_engine",
    "page_region",
    "storage_ptr",
]


def first_tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else value[0]


def storage_ptr(value: Any) -> int:
    return int(first_tensor(value).untyped_storage().data_ptr())
