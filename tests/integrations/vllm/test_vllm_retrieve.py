"""Faithful retrieve, end to end: vLLM registration -> group edits -> per-layer detection ->
store a set of blocks -> zero the cache -> load them back. Every byte of the selected
pages (conv, ssm, padding, K and V of every kernel page) comes back; nothing else moves.
Hybrids, and models without Mamba layers whose blocks vLLM pages for the kernel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvlayout.catalog.registry import get_spec
from kvlayout.detection import normalize_and_discover_per_layer_formats
from kvlayout.integrations.vllm import apply_kv_cache_group_edits
from kvlayout.registration.opaque import opaque_pages_of
from kvlayout.transfer import chunk_shape, load_blocks, store_blocks
from tests.integrations.vllm.models import (
    DSV4_INDEXER,
    FLASH_ATTN,
    FLASHINFER,
    FLASHMLA,
    LLAMA_3_2_1B,
    QWEN3_5_0_8B,
    QWEN3_NEXT_80B_A3B,
    AttentionModel,
    Backend,
    Engine,
    KVCacheLayout,
    allocate,
    attention_engine,
    dsv4_indexer_spec,
    hints,
    hybrid_engine,
    mla_hybrid_engine,
    page_region,
    uniform_engine,
)


@dataclass(frozen=True)
class Case:
    id: str
    backend: Backend
    allocation: str
    hnd: bool = False
    model: Any = QWEN3_5_0_8B
    tp: int = 1
    checkpoint_alignment: int = 1
    layout: Any = None

    def engine(self, num_blocks: int) -> Engine:
        if self.model is None:
            return mla_hybrid_engine(num_blocks=num_blocks)
        layout = self.layout or (KVCacheLayout.LBHNC if self.hnd else KVCacheLayout.LBNHC)
        if isinstance(self.model, AttentionModel):  # --block-size 128: 64-token FlashInfer pages
            return attention_engine(
                self.model, self.backend, block_size=128, num_blocks=num_blocks, layout=layout
            )
        if self.model == "dsv4-indexer":  # 512-token blocks of 128 slots, 256-token kernel pages
            spec = dsv4_indexer_spec(512)
            return uniform_engine(spec, self.backend, num_layers=3, num_blocks=num_blocks, layout=layout)
        return hybrid_engine(
            self.model,
            self.backend,
            tp=self.tp,
            checkpoint_alignment=self.checkpoint_alignment,
            num_blocks=num_blocks,
            layout=layout if self.allocation == "v033" else None,
        )


CASES = [
    Case("qwen3.5-flashinfer-0.33-nhd", FLASHINFER, "v033"),
    Case("qwen3.5-flashinfer-0.33-hnd-align64", FLASHINFER, "v033", hnd=True, checkpoint_alignment=64),
    Case("qwen3.5-flashinfer-legacy-nhd", FLASHINFER, "legacy"),
    Case("qwen3.5-flashinfer-legacy-hnd", FLASHINFER, "legacy", hnd=True),
    Case("qwen3.5-flash-attn-0.33", FLASH_ATTN, "v033"),
    Case("qwen3.5-flash-attn-0.33-blnhc", FLASH_ATTN, "v033", layout=KVCacheLayout.BLNHC),
    Case("qwen3.5-flash-attn-legacy", FLASH_ATTN, "legacy"),
    Case("qwen3-next-tp2-flashinfer-0.33", FLASHINFER, "v033", model=QWEN3_NEXT_80B_A3B, tp=2),
    Case(
        "qwen3-next-tp2-flashinfer-legacy-hnd", FLASHINFER, "legacy", hnd=True, model=QWEN3_NEXT_80B_A3B, tp=2
    ),
    Case("mla-kda-0.33", FLASHMLA, "v033", model=None),
    Case("mla-kda-legacy", FLASHMLA, "legacy", model=None),
    Case("llama-flashinfer-bs128-0.33-nhd", FLASHINFER, "v033", model=LLAMA_3_2_1B),
    Case("llama-flashinfer-bs128-0.33-hnd", FLASHINFER, "v033", hnd=True, model=LLAMA_3_2_1B),
    Case("llama-flashinfer-bs128-legacy-hnd", FLASHINFER, "legacy", hnd=True, model=LLAMA_3_2_1B),
    Case("dsv4-indexer-c4-bs512-0.33", DSV4_INDEXER, "v033", model="dsv4-indexer"),
]


def _owned_blocks(num_groups: int) -> list[list[int]]:
    # A block id is owned by one group at a time (groups overlay the same bytes): group g
    # holds blocks 2g+1 and 2g, listed out of order.
    return [[2 * g + 1, 2 * g] for g in range(num_groups)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_store_zero_load_restores_exactly_the_selected_pages(case: Case) -> None:
    probe = case.engine(num_blocks=1)
    num_groups = len(probe.config.kv_cache_groups)
    engine = case.engine(num_blocks=2 * num_groups + 1)  # the last block is never selected
    bufs, kv_caches = allocate(engine, case.backend, case.allocation, case.hnd)
    gen = torch.Generator().manual_seed(0)
    for buf in bufs:
        buf.copy_(torch.randint(-128, 128, buf.shape, dtype=torch.int8, generator=gen))
    layout_hints = hints(case.hnd)

    out = apply_kv_cache_group_edits(engine.config, kv_caches, layout_hints)
    names = list(out)
    groups = [[names.index(n) for n in g.layer_names] for g in engine.config.kv_cache_groups]
    normalized, formats = normalize_and_discover_per_layer_formats(
        list(out.values()), groups, "vllm", layout_hints
    )
    before = [buf.clone() for buf in bufs]

    chunks, fmts = [], []
    for g, (idxs, block_ids) in enumerate(zip(groups, _owned_blocks(num_groups), strict=True)):
        kv = [normalized[i] for i in idxs]
        fmt = formats[idxs[0]]
        assert fmt is not None and {formats[i] for i in idxs} == {fmt}
        block_size = get_spec(kv, fmt).block_size()
        # a block id's slots: block_size, or block_size / ratio where compression is
        # declared (Mamba's tokens_per_state is -1: its page is cut into block_size rows)
        spec = engine.config.kv_cache_groups[g].kv_cache_spec
        assert block_size == spec.block_size // max(spec.tokens_per_state, 1)
        shape, dtype = chunk_shape(kv, fmt, len(block_ids) * block_size)
        chunk = torch.empty(shape, dtype=dtype)
        store_blocks(kv, fmt, block_ids, [chunk])
        if (
            isinstance(kv[0], torch.Tensor) and opaque_pages_of(kv[0]) is not None
        ):  # the chunk carries each page verbatim, in block-id order
            for layer, view in enumerate(kv):
                assert isinstance(view, torch.Tensor)
                stored = chunk[0, layer].view(len(block_ids), -1)
                assert torch.equal(stored, view[block_ids].flatten(1))
        chunks.append(chunk)
        fmts.append(fmt)
    assert all(torch.equal(b, a) for b, a in zip(bufs, before, strict=True))  # storing reads only

    for buf in bufs:
        buf.zero_()
    for idxs, block_ids, chunk, fmt in zip(groups, _owned_blocks(num_groups), chunks, fmts, strict=True):
        load_blocks([normalized[i] for i in idxs], fmt, block_ids, [chunk])

    expected = [torch.zeros_like(buf) for buf in bufs]
    for group, block_ids in zip(engine.config.kv_cache_groups, _owned_blocks(num_groups), strict=True):
        for layer in group.layer_names:
            page = engine.spec_of(layer).page_size_bytes
            b, offset, stride = page_region(engine, bufs, case.allocation, layer)
            for block in block_ids:
                start = offset + block * stride
                expected[b][start : start + page] = before[b][start : start + page]
    for buf, want in zip(bufs, expected, strict=True):
        assert torch.equal(buf, want)
    assert any(bool(w.any()) for w in expected)
