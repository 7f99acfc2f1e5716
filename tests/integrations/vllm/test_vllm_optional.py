"""vLLM stays optional: the integration imports without it and reads duck-typed specs
(these tests never import vLLM, so they run where it is not installed)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kvlayout.catalog.registry import get_spec
from kvlayout.integrations.vllm import (
    OPAQUE_PAGE_FORMAT,
    UnsupportedKVCacheGroupsError,
    apply_kv_cache_group_edits,
    validate_kv_cache_groups,
)


def test_importing_the_integration_does_not_import_vllm() -> None:
    code = "import sys, kvlayout.integrations.vllm; sys.exit('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# Stand-ins named like vLLM's classes (kinds are read from class names), with only the
# fields the integration reads.


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int = 1
    head_size: int = 8
    dtype: torch.dtype = torch.bfloat16

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * 2 * self.head_size * self.dtype.itemsize


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    pass


@dataclass(frozen=True)
class CrossAttentionSpec(AttentionSpec):
    pass


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    page_size_bytes: int = 0
    mamba_cache_mode: str = "none"


@dataclass
class Group:
    layer_names: list[str]
    kv_cache_spec: Any


@dataclass
class Config:
    kv_cache_groups: list[Group] = field(default_factory=list)


def test_duck_typed_hybrid_is_edited() -> None:
    attn = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8)
    mamba = MambaSpec(block_size=16, page_size_bytes=attn.page_size_bytes, mamba_cache_mode="align")
    config = Config([Group(["attn"], attn), Group(["mamba"], mamba)])
    nb, k = 3, 4
    raw = torch.zeros(nb * attn.page_size_bytes, dtype=torch.int8)
    kernel_paged = raw.view(torch.bfloat16).view(nb * k, 2, 16 // k, 2, 8)  # pre-0.26 FlashInfer
    conv = torch.as_strided(raw.view(torch.bfloat16), (nb, 3, 8), (attn.page_size_bytes // 2, 8, 1))
    ssm = torch.as_strided(raw.view(torch.float32), (nb, 4, 4), (attn.page_size_bytes // 4, 4, 1), 12)
    out = apply_kv_cache_group_edits(
        config, {"attn": kernel_paged, "mamba": [conv, ssm]}, {"kv_layout": "NHD"}
    )
    for view in out.values():
        assert get_spec([view], OPAQUE_PAGE_FORMAT).block_size() == 16
        assert view.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()


def test_duck_typed_validation() -> None:
    config = Config(
        [
            Group(["attn"], FullAttentionSpec(block_size=16)),
            Group(["cross"], CrossAttentionSpec(block_size=16)),
            Group(["mamba"], MambaSpec(block_size=16)),
        ]
    )
    with pytest.raises(
        UnsupportedKVCacheGroupsError, match=r"group 1: CrossAttentionSpec.*; group 2: MambaSpec"
    ):
        validate_kv_cache_groups(config)
