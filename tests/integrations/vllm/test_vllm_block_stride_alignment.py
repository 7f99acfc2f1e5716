"""Specs with a ``block_stride_alignment`` planned as vLLM 0.33 plans them, checked against
vLLM's own ``get_kv_cache_config_from_groups`` on the same groups, then allocated with
vLLM's ``create_kv_cache_views`` and moved as a connector moves them, every byte checked
against vLLM's indexing of the pages.

vLLM 0.33's ``KVCacheSpec.block_stride_alignment`` (``v1/kv_cache_interface.py``) is the
byte alignment of the stride between a layer's blocks: bytes, or ``MultipleOf(n)``, the
page of a kernel block of ``gcd(n, block_size)`` tokens (``get_block_stride_alignment``).
``customize_attention_spec`` (``v1/worker/utils.py``) gives a backend of fixed kernel
block sizes only ``MultipleOf(largest)``; FlashMLA sparse (``flashmla_sparse.py``) gives
its quantized caches ``MultipleOf(64)`` off SM100, else whole rows
(``sparse_utils.align_blocks_to_rows``: ``state_content_size_bytes``); DeepSeek-V4.1's
indexer asks 256-byte-aligned blocks of whole 576-byte TMA rows where its logits are
sparse (``models/deepseek_v41/attention.py``, ``DeepseekV4IndexerCache``), its V4.1 mxfp8
window whole records of both record widths (``sparse_swa.py``). In the config
(``v1/core/kv_cache_planning.py``) a layer-outermost layout strides each layer's blocks
its page rounded up to the alignment (``_get_layer_block_stride``: the padding is
between blocks, the layer's region ``num_blocks`` strides long); a block-outermost one
rounds the whole packed block up to every page's alignment
(``_get_kv_cache_bytes_per_block``: the padding is at the end of each block)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

import kvlayout
import kvlayout.testing.vllm as vx
from kvlayout.integrations.vllm import apply_kv_cache_group_edits, transfer_layers
from tests.integrations.vllm.models import stored_then_loaded

pytest.importorskip("vllm.v1.kv_cache_interface")
from tests.integrations.vllm.test_vllm_dsv41_planned import ring, slot_rows
from tests.integrations.vllm.vllm_planning import vllm_kv_cache_config, vllm_kv_cache_groups

kvi = vx.kvi
NB = 5
LAYER_OUTER = [vx.KVCacheLayout.LBNHC, vx.KVCacheLayout.LBHNC]
PACKED = [vx.KVCacheLayout.BLHNC, vx.KVCacheLayout.BLNHC]


def fp8_latents(ratio: int, record: int, page_alignment: int, block_stride_alignment: Any) -> Any:
    """``DeepseekV4MLAAttention.get_kv_cache_spec`` under ``fp8_ds_mla`` (``record``: 584
    bytes a V4 slot, 528 a V4.1 mxfp8 one; its page aligned to ``page_alignment``), as
    FlashMLA sparse's ``customize_spec`` leaves it."""
    return kvi.MLAAttentionSpec(
        block_size=256,
        num_kv_heads=1,
        head_size=512,
        dtype=torch.uint8,
        tokens_per_state=ratio,
        cache_dtype_str="fp8_ds_mla",
        alignment=page_alignment,
        model_version="deepseek_v4",
        kv_quant_mode=kvi.KVQuantMode.FP8_PER_TENSOR,  # get_kv_quant_mode("fp8_ds_mla")
        state_content_bytes=record,
        block_stride_alignment=block_stride_alignment,
    )


def indexer(page_alignment: int, block_stride_alignment: int | None) -> Any:
    """``DeepseekV4IndexerCache.get_kv_cache_spec`` (C4): sparse logits ask
    ``lcm(256, page_alignment)`` (V4) or 256 (V4.1 mxfp8 records)."""
    return dataclasses.replace(
        vx.dsv4_indexer_spec(256), alignment=page_alignment, block_stride_alignment=block_stride_alignment
    )


def window(record: int, page_alignment: int, block_stride_alignment: int | None) -> Any:
    """``DeepseekV4SWACache.get_kv_cache_spec`` under ``fp8_ds_mla``."""
    return kvi.SlidingWindowMLASpec(
        block_size=32,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=512,
        dtype=torch.uint8,
        sliding_window=128,
        cache_dtype_str="fp8_ds_mla",
        state_content_bytes=record,
        alignment=page_alignment,
        block_stride_alignment=block_stride_alignment,
        model_version="deepseek_v4",
        kv_quant_mode=kvi.KVQuantMode.FP8_PER_TENSOR,  # get_kv_quant_mode("fp8_ds_mla")
    )


V4_OFF_SM100 = fp8_latents(4, 584, 576, vx.MultipleOf(64))  # page 37440 bytes (64 slots)
V4_SM100 = fp8_latents(4, 584, 576, 584)  # whole 584-byte rows: blocks 37960 apart
V4_C128 = fp8_latents(128, 584, 576, 584)  # 2 slots a block: 1168 bytes, page 1728, blocks 2336 apart


def uniform(spec: Any, layers: int = 3) -> dict[str, Any]:
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(layers)}


def v4_layers(ratios: list[int], latents: Any, idx: Any, swa: Any) -> dict[str, Any]:
    """DeepSeek-V4(.1)'s caches a layer, in registration order (as the packed test's)."""
    specs: dict[str, Any] = {}
    for i, ratio in enumerate(ratios):
        attn = f"model.layers.{i}.self_attn"
        specs[f"{attn}.swa_cache"] = swa
        if ratio:
            specs[f"{attn}.attn"] = dataclasses.replace(latents, tokens_per_state=ratio)
            specs[f"{attn}.compressor.state_cache"] = ring(1024 if ratio == 4 else 512)
        if ratio == 4:
            specs[f"{attn}.indexer.k_cache"] = idx
            specs[f"{attn}.indexer.compressor.state_cache"] = ring(256)
    return specs


LAYER_OUTER_MODELS = {
    # pages padded between blocks (a uniform group: every layout takes it)
    "v4-latents-off-sm100": uniform(V4_OFF_SM100),
    "v4-latents-sm100": uniform(V4_SM100),
    "v4-c128-latents": uniform(V4_C128),
    "v4-indexer-sparse-logits": uniform(indexer(576, math.lcm(256, 576))),
    # an alignment the page already meets: no padding, blocks a page apart
    "flashinfer-128": uniform(
        vx.FLASHINFER.customize_spec(vx.attention_spec(vx.LLAMA_3_2_1B, 1, 128)),
        vx.LLAMA_3_2_1B.num_hidden_layers,
    ),
    "flashmla-128": uniform(
        vx.FLASHMLA.customize_spec(
            kvi.MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
        )
    ),
}
C4_C128 = [0, 0, 4, 128, 4, 128, 4, 128]  # DeepSeek-V4.1's pattern (as the packed test's "c4-c128")
PACKED_MODELS = {
    # DeepSeek-V4 fp8_ds_mla off SM100 (sparse logits): latents MultipleOf(64), the
    # indexer lcm(256, 576), the window none
    "v4": v4_layers(C4_C128, V4_OFF_SM100, indexer(576, math.lcm(256, 576)), window(584, 576, None)),
    # DeepSeek-V4.1 mxfp8 records on SM100: latents whole 528-byte rows, the indexer 256,
    # the window lcm(528, 528)
    "v41-mxfp8": v4_layers(
        C4_C128,
        fp8_latents(4, 528, 512, 528),
        indexer(512, 256),
        window(528, 512, 528),
    ),
}
CASES = [(m, layout) for m in LAYER_OUTER_MODELS for layout in LAYER_OUTER] + [
    (m, layout) for m in PACKED_MODELS for layout in PACKED
]
MODELS = LAYER_OUTER_MODELS | PACKED_MODELS


# FlashMLA sparse off SM100 (flashmla_sparse.py: MultipleOf(64)), the DeepSeek-V4 layers'
FLASHMLA_SPARSE = vx.Backend("FLASHMLA_SPARSE", multiple_of=64)
BACKENDS = {"flashinfer-128": vx.FLASHINFER, "flashmla-128": vx.FLASHMLA}


def engine_of(model: str, layout: Any) -> Any:
    backend = BACKENDS.get(model, FLASHMLA_SPARSE)
    return vx.planned_engine(MODELS[model], backend, layout=layout, num_blocks=NB)


@pytest.mark.parametrize(("model", "layout"), CASES, ids=[f"{m}-{layout.name}" for m, layout in CASES])
def test_the_tensors_are_vllm_s_own(model: str, layout: Any) -> None:
    specs = MODELS[model]
    engine = engine_of(model, layout)
    want = vllm_kv_cache_config(vllm_kv_cache_groups(specs, layout), layout, NB)
    assert engine.config.num_blocks == want.num_blocks == NB
    assert engine.config.kv_cache_tensors == want.kv_cache_tensors
    assert [g.layer_names for g in engine.config.kv_cache_groups] == [
        g.layer_names for g in want.kv_cache_groups
    ]


def test_the_padding_is_where_vllm_puts_it() -> None:
    """The strides, worked by hand from vLLM's rules (above), not from the mirror."""
    lbnhc, blhnc = vx.KVCacheLayout.LBNHC, vx.KVCacheLayout.BLHNC
    page = V4_OFF_SM100.page_size_bytes
    assert page == 37440  # 64 slots of 584 bytes, rounded up to 576
    # whole 584-byte rows: 65 of them a block, 520 bytes of padding between blocks
    (t,) = engine_of("v4-latents-sm100", lbnhc).config.kv_cache_tensors
    assert (t.block_stride, t.layer_stride, t.size) == (65 * 584, NB * 65 * 584, 3 * NB * 65 * 584)
    # 64 slots of 132 bytes (8448) make 8640 at the page's 576: 9216 (4 * 2304) apart
    (t,) = engine_of("v4-indexer-sparse-logits", lbnhc).config.kv_cache_tensors
    assert (t.block_stride, t.layer_stride) == (4 * 2304, NB * 4 * 2304)
    # MultipleOf(64) of a uniform group: vLLM's MLAAttentionSpec.merge keeps the padded
    # page but not the page alignment, so its 64-token kernel page is the padded block's
    # (37440), which the page meets: blocks a page apart
    (t,) = engine_of("v4-latents-off-sm100", lbnhc).config.kv_cache_tensors
    assert t.block_stride == page
    # an alignment the page meets: blocks a page apart, the block split into kernel blocks
    engine = engine_of("flashinfer-128", lbnhc)
    (t,) = engine.config.kv_cache_tensors
    assert t.block_stride == MODELS["flashinfer-128"]["model.layers.0.self_attn.attn"].page_size_bytes
    assert engine.kernel_block_sizes == [64]
    # packed (each layer its own spec): every block rounded up to the lcm of its pages'
    # alignments, at its end: the C4 latents' 64-token kernel page (16 slots: 9344 bytes,
    # 9792 at 576), the C128 latents' (no whole slot: the block's padded page, 1728, which
    # copy_with_new_block_size's replace keeps), the indexer's 2304
    engine = engine_of("v4", blhnc)
    strides = {t.block_stride for t in engine.config.kv_cache_tensors}
    assert len(strides) == 1
    widest = max(
        sum(engine.spec_of(n).page_size_bytes for n in g.layer_names) for g in engine.config.kv_cache_groups
    )
    align = math.lcm(9792, 1728, 2304)
    assert strides.pop() == -(-widest // align) * align > widest


def block_start(engine: Any, layer: str, block: int) -> int:
    """Where layer ``layer``'s page of block ``block`` starts as vLLM addresses it: the
    tensor's offset, the layer's place in it, ``block`` block strides on
    (``allocate_kv_cache``: ``offset + l * layer_stride + b * block_stride``)."""
    t = next(t for t in engine.config.kv_cache_tensors if layer in t.layers)
    return int(t.offset + t.layers.index(layer) * t.layer_stride + block * t.block_stride)


LATENT_CASES = [(m, layout) for m, layout in CASES if not m.startswith("flashinfer")]


@pytest.mark.parametrize(
    ("model", "layout"), LATENT_CASES, ids=[f"{m}-{layout.name}" for m, layout in LATENT_CASES]
)
def test_a_connector_moves_the_rows_where_vllm_reads_them_and_no_padding(model: str, layout: Any) -> None:
    engine = engine_of(model, layout)
    buf, kv = vx.allocate_v033(engine)
    vx.fill_random(buf, 5)
    hints = {"kv_layout": layout.name}
    edited = apply_kv_cache_group_edits(engine.config, kv, hints)  # the rings left out
    layers, groups = transfer_layers(engine.config, edited)
    reg = kvlayout.detect(layers, "vllm", hints, layer_groups=groups)
    names = [name for name in kv if name in edited]
    for name in names:  # vLLM's views start each block where its config says
        k = kv[name].shape[0] // NB  # kernel blocks a block (FlashMLA's 64 of a 128-token block)
        for b in range(NB):
            assert kv[name][b * k].data_ptr() - buf.data_ptr() == block_start(engine, name, b)
    before = buf.clone()
    saved, loaded = [3, 1], [2, 4]
    moved = 0
    for group in reg.kernel_groups:
        rows = 2 * group.block_size  # two whole blocks
        chunk = stored_then_loaded(group, saved, loaded, rows)
        is_indexer = kvlayout.is_indexer(group.format)
        for position, i in enumerate(group.layers):
            view = kv[names[i]]
            k = view.shape[0] // NB
            sent = slot_rows(view, [b * k + j for b in saved for j in range(k)], rows, is_indexer)
            got = slot_rows(view, [b * k + j for b in loaded for j in range(k)], rows, is_indexer)
            assert torch.equal(
                chunk[0, position, :rows].contiguous().view(torch.uint8).reshape(rows, -1), sent
            )
            assert torch.equal(got, sent)
            moved += 1
    assert moved == len(names)
    # nothing but the loaded blocks' pages was written: not the padding between blocks
    written = torch.zeros_like(buf, dtype=torch.bool)
    for name in names:
        for b in loaded:
            start = block_start(engine, name, b)
            written[start : start + engine.spec_of(name).page_size_bytes] = True
    assert not torch.equal(buf[written], before[written])
    assert torch.equal(buf[~written], before[~written])


def test_a_layout_that_cannot_pad_pages_is_refused_as_vllm_refuses_it() -> None:
    """LHBNC (heads outside blocks) cannot stride a layer's blocks apart by a padded page:
    vLLM asserts, and the mirror says so, naming the layer, the page and the alignment."""
    specs, lhbnc = MODELS["v4-latents-sm100"], vx.KVCacheLayout.LHBNC
    with pytest.raises(AssertionError, match="LHBNC cannot pad pages"):
        vllm_kv_cache_config(vllm_kv_cache_groups(specs, lhbnc), lhbnc, NB)
    with pytest.raises(
        ValueError,
        match=r"^LHBNC cannot pad pages: model\.layers\.0\.self_attn\.attn's 37440-byte page padded to "
        r"37960 bytes \(block_stride_alignment 584\) needs a block-compact layout$",
    ):
        engine_of("v4-latents-sm100", lhbnc)
