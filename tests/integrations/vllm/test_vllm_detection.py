"""Edited registrations through kvlayout's detector: the views read the same under every
kv_layout hint, every block is a block id, and a hint that does not match vLLM's
allocation is caught before registration."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvlayout import EngineKVFormat as F
from kvlayout.catalog.registry import get_spec
from kvlayout.detection import normalize_and_discover_per_layer_formats, normalize_kv_and_discover_format
from kvlayout.integrations.vllm import (
    OPAQUE_PAGE_FORMAT,
    BlockGranularityError,
    apply_kv_cache_group_edits,
    check_block_granularity,
)
from kvlayout.registration.opaque import opaque_pages_of
from tests.integrations.vllm.models import (
    FLASH_ATTN,
    FLASHINFER,
    LLAMA_3_2_1B,
    QWEN3_5_0_8B,
    Engine,
    KVCacheLayout,
    allocate_legacy,
    allocate_v033,
    attention_engine,
    hints,
    hybrid_engine,
)

ALL_HINTS: list[dict[str, str] | None] = [
    {"kv_layout": "NHD"},
    {"kv_layout": "HND"},
    {"kv_layout": "BLNHC"},
    {"kv_layout": "BLHNC"},
    None,
]


def _groups(engine: Engine, kv_caches: dict[str, Any]) -> list[list[int]]:
    names = list(kv_caches)
    return [[names.index(n) for n in g.layer_names] for g in engine.config.kv_cache_groups]


@pytest.mark.parametrize("layout_hints", ALL_HINTS, ids=lambda h: (h or {}).get("kv_layout", "no-hint"))
@pytest.mark.parametrize("allocation", ["v033-hnd", "legacy-nhd", "legacy-hnd"])
def test_opaque_views_read_the_same_under_every_hint(
    allocation: str, layout_hints: dict[str, str] | None
) -> None:
    # FlashInfer: every layer of the hybrid is edited into opaque pages (HND kernel pages,
    # or the older FlashInfer page with K/V outside its tokens), so no layer depends on the hint.
    # two KV heads: one head's HND page is token-major, and reads as its blocks
    engine = hybrid_engine(QWEN3_5_0_8B, FLASHINFER, layout=KVCacheLayout.LBHNC)
    if allocation == "v033-hnd":
        _, kv_caches = allocate_v033(engine)
    else:
        _, kv_caches = allocate_legacy(engine, FLASHINFER, hnd=allocation.endswith("hnd"))
    out = apply_kv_cache_group_edits(engine.config, kv_caches, layout_hints)
    for group in engine.config.kv_cache_groups:
        views = [out[n] for n in group.layer_names]
        fmt, normalized = normalize_kv_and_discover_format(views, "vllm", layout_hints)
        assert fmt is OPAQUE_PAGE_FORMAT
        spec = get_spec(normalized, fmt)
        assert spec.block_size() == group.kv_cache_spec.block_size
        assert spec.num_blocks() == engine.config.num_blocks
        assert spec.num_heads() * spec.head_size() * spec.block_size() == group.kv_cache_spec.page_size_bytes
        assert all(n.data_ptr() == v.data_ptr() for n, v in zip(normalized, views, strict=True))


@pytest.mark.parametrize(
    ("backend", "layout"),
    [
        (FLASHINFER, KVCacheLayout.LBNHC),
        (FLASHINFER, KVCacheLayout.LBHNC),
        (FLASH_ATTN, KVCacheLayout.LBNHC),
        (FLASH_ATTN, KVCacheLayout.LBHNC),
        (FLASH_ATTN, KVCacheLayout.BLNHC),
        (FLASH_ATTN, KVCacheLayout.BLHNC),
    ],
    ids=lambda x: getattr(x, "name", x),
)
def test_per_layer_detection_infers_no_compression(backend: Any, layout: Any) -> None:
    """The hybrid's whole dict through per-layer detection: every layer's block is its
    group's block_size (compress ratio 1), and the edited groups are opaque pages, or
    (NHD kernel pages) their blocks read as the engine's format."""
    engine = hybrid_engine(QWEN3_5_0_8B, backend, layout=layout)
    _, kv_caches = allocate_v033(engine)
    layout_hints = {"kv_layout": "HND" if layout in (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC) else "NHD"}
    out = apply_kv_cache_group_edits(engine.config, kv_caches, layout_hints)
    normalized, formats = normalize_and_discover_per_layer_formats(
        list(out.values()), _groups(engine, out), "vllm", layout_hints
    )
    for i, name in enumerate(out):
        spec = engine.spec_of(name)
        fmt = formats[i]
        assert fmt is not None
        assert get_spec(normalized, fmt).block_size(i) == spec.block_size
        if out[name] is not kv_caches[name] and opaque_pages_of(out[name]) is not None:
            assert fmt is OPAQUE_PAGE_FORMAT
            # padded pages (blocks-first layouts) keep their block stride
            view = normalized[i]
            assert isinstance(view, torch.Tensor) and view.stride(0) == out[name].stride(0)


@pytest.mark.parametrize("layout_hints", ALL_HINTS, ids=lambda h: (h or {}).get("kv_layout", "no-hint"))
def test_nhd_kernel_pages_read_as_blocks_under_an_nhd_hint_and_are_refused_under_hnd(
    layout_hints: dict[str, str] | None,
) -> None:
    """vLLM 0.33's NHD kernel pages are viewed as their blocks (token-major, the tokens of
    a block's pages in order), which read as the engine's NHD format: like any registered
    layer they need the hint that matches vLLM's allocation, and the check refuses another."""
    engine = hybrid_engine(QWEN3_5_0_8B, FLASHINFER)  # LBNHC, two KV heads
    _, kv_caches = allocate_v033(engine)
    nhd = layout_hints is not None and layout_hints["kv_layout"] in ("NHD", "BLNHC")
    if not nhd:  # HND hints, and no hint on CPU tensors (read as CPU_ATTN's whole pages)
        read = "NL_X_NB_NH_BS_CS" if layout_hints is not None else "NL_X_NB_BS_HS"
        with pytest.raises(BlockGranularityError, match=rf"reads as {read} with block size"):
            apply_kv_cache_group_edits(engine.config, kv_caches, layout_hints)
        return
    out = apply_kv_cache_group_edits(engine.config, kv_caches, layout_hints)
    for group in engine.config.kv_cache_groups:
        views = [out[n] for n in group.layer_names]
        fmt, normalized = normalize_kv_and_discover_format(views, "vllm", layout_hints)
        spec = get_spec(normalized, fmt)
        assert spec.block_size() == group.kv_cache_spec.block_size
        assert spec.num_blocks() == engine.config.num_blocks
        attention = "self_attn" in group.layer_names[0]
        assert (fmt is F.NL_X_NB_BS_NH_CS) if attention else (fmt is OPAQUE_PAGE_FORMAT)


def test_raw_registrations_are_what_the_edits_fix() -> None:
    # Unedited, the kernel-paged attention reads as the kernel's block and a Mamba row as
    # a one-token block: the groups would look slot-compressed.
    engine = hybrid_engine(QWEN3_5_0_8B, FLASHINFER)
    _, kv_caches = allocate_v033(engine)
    with pytest.raises(BlockGranularityError) as info:
        check_block_granularity(engine.config, kv_caches, hints(False))
    message = str(info.value)
    kernel = min(engine.kernel_block_sizes)
    block = engine.config.kv_cache_groups[0].kv_cache_spec.block_size
    for g, group in enumerate(engine.config.kv_cache_groups):
        assert f"group {g}: layer {group.layer_names[0]!r} (and {len(group.layer_names) - 1} more)" in message
    assert f"block size {kernel}, not {block}" in message
    assert f"block size 1, not {block}" in message
    check_block_granularity(
        engine.config, apply_kv_cache_group_edits(engine.config, kv_caches, hints(False)), hints(False)
    )


@pytest.mark.parametrize("allocation", ["v033", "legacy"])
@pytest.mark.parametrize("hnd", [False, True])
def test_a_hint_that_does_not_match_the_allocation_is_caught(allocation: str, hnd: bool) -> None:
    # FlashAttention keeps the attention layers as registered; read with the other
    # layout's hint their heads and tokens swap, and the edits refuse to go on.
    layout = KVCacheLayout.LBHNC if hnd else KVCacheLayout.LBNHC
    engine = hybrid_engine(QWEN3_5_0_8B, FLASH_ATTN, layout=layout)
    if allocation == "v033":
        _, kv_caches = allocate_v033(engine)
    else:
        _, kv_caches = allocate_legacy(engine, FLASH_ATTN, hnd=hnd)
    apply_kv_cache_group_edits(engine.config, kv_caches, hints(hnd))
    attn = next(
        (g, grp) for g, grp in enumerate(engine.config.kv_cache_groups) if "self_attn" in grp.layer_names[0]
    )
    with pytest.raises(BlockGranularityError, match=f"group {attn[0]}: layer {attn[1].layer_names[0]!r}"):
        apply_kv_cache_group_edits(engine.config, kv_caches, hints(not hnd))


@pytest.mark.parametrize("allocation", ["v033", "legacy"])
@pytest.mark.parametrize("hnd", [False, True])
def test_pure_attention_hint_that_does_not_match_the_allocation_is_caught(allocation: str, hnd: bool) -> None:
    # The check runs for models without Mamba layers too: Llama's 8 heads and 16-token
    # blocks swap under the other layout's hint, which would read 8-token blocks.
    layout = KVCacheLayout.LBHNC if hnd else KVCacheLayout.LBNHC
    engine = attention_engine(LLAMA_3_2_1B, FLASH_ATTN, layout=layout)
    if allocation == "v033":
        _, kv_caches = allocate_v033(engine)
    else:
        _, kv_caches = allocate_legacy(engine, FLASH_ATTN, hnd=hnd)
    out = apply_kv_cache_group_edits(engine.config, kv_caches, hints(hnd))
    assert all(out[k] is v for k, v in kv_caches.items())
    heads, block = LLAMA_3_2_1B.num_key_value_heads, engine.config.kv_cache_groups[0].kv_cache_spec.block_size
    with pytest.raises(BlockGranularityError) as info:
        apply_kv_cache_group_edits(engine.config, kv_caches, hints(not hnd))
    assert str(info.value).startswith(
        f"registered blocks are not block ids under kv_layout={hints(not hnd)['kv_layout']!r}: group 0: layer "
        f"'model.layers.0.self_attn.attn' (and {LLAMA_3_2_1B.num_hidden_layers - 1} more) reads as "
    )
    assert f"with block size {heads}, not {block}. A wrong kv_layout hint" in str(info.value)


def test_no_hint_on_cpu_reads_hnd() -> None:
    # kvlayout's vLLM default on the CPU is HND (vLLM's CPU backend); an NHD allocation
    # without a hint is therefore caught, an HND one passes.
    nhd = hybrid_engine(QWEN3_5_0_8B, FLASH_ATTN, layout=KVCacheLayout.LBNHC)
    with pytest.raises(BlockGranularityError, match="kv_layout=None"):
        apply_kv_cache_group_edits(nhd.config, allocate_v033(nhd)[1])
    hnd = hybrid_engine(QWEN3_5_0_8B, FLASH_ATTN, layout=KVCacheLayout.LBHNC)
    out = apply_kv_cache_group_edits(hnd.config, allocate_v033(hnd)[1])
    assert all(isinstance(v, torch.Tensor) for v in out.values())
