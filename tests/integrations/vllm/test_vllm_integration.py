"""Group edits on vLLM models, with vLLM 0.33's spec classes and allocation, and the pre-0.26
registrations; every expected number is read from the spec objects."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch

from kvlayout.integrations.vllm import (
    BlockGranularityError,
    KVCacheGroupEditError,
    SubpagedMLAEdit,
    apply_kv_cache_group_edits,
    find_kv_cache_group_edit,
)
from kvlayout.registration.opaque import opaque_pages_of
from tests.integrations.vllm.models import (
    DSV4_INDEXER,
    FLASH_ATTN,
    FLASHINFER,
    FLASHMLA,
    LLAMA_3_2_1B,
    QWEN3_5_0_8B,
    QWEN3_NEXT_80B_A3B,
    Backend,
    Engine,
    HybridModel,
    KVCacheLayout,
    allocate,
    allocate_v033,
    attention_engine,
    dsv4_indexer_spec,
    hints,
    hybrid_engine,
    kvi,
    make_engine,
    mla_hybrid_engine,
    page_region,
    storage_ptr,
    uniform_engine,
)

# (allocation, hnd): vLLM 0.33 with its default LBNHC (NHD) or LBHNC (HND) layout, and
# the pre-0.26 registrations with NHD or HND attention.
ALLOCATIONS = [("v033", False), ("v033", True), ("legacy", False), ("legacy", True)]


def _engine(model: HybridModel, backend: Backend, allocation: str, hnd: bool, **kw: Any) -> Engine:
    layout = KVCacheLayout.LBHNC if hnd else KVCacheLayout.LBNHC
    return hybrid_engine(model, backend, layout=layout if allocation == "v033" else None, **kw)


def _check_opaque_view(
    engine: Engine, bufs: list[torch.Tensor], allocation: str, layer: str, view: Any, value: Any
) -> None:
    """One block of the view = one page of the layer's region, a view of the same storage:
    opaque pages in as many rows as the block has slots (tokens, or tokens / ratio where
    compressed; Mamba's tokens_per_state of -1 cuts its page into block_size rows), or,
    where a block's kernel pages are its tokens in order (NHD, MLA), the block itself in
    the registered dtype."""
    spec = engine.spec_of(layer)
    slots = spec.block_size // max(spec.tokens_per_state, 1)
    row = spec.page_size_bytes // slots
    buf, offset, block_stride = page_region(engine, bufs, allocation, layer)
    base = bufs[buf].data_ptr() + offset
    assert isinstance(view, torch.Tensor)
    assert view.data_ptr() == base
    assert view is not value and storage_ptr(view) == storage_ptr(value)
    if opaque_pages_of(view) is None:  # the block itself: [NB, H, slots, C] or MLA's [NB, slots, C]
        assert view.dtype == spec.dtype and view.shape[0] == engine.config.num_blocks
        assert view.stride(0) * view.element_size() == block_stride and slots in view.shape[1:3]
        assert view.numel() // view.shape[0] * view.element_size() == spec.page_size_bytes
        return
    assert view.dtype == torch.int8
    assert tuple(view.shape) == (engine.config.num_blocks, slots, row)
    assert view.stride() == (block_stride, row, 1)


def _rules(engine: Engine, kv_caches: dict[str, Any], layout_hints: dict[str, str]) -> Counter[str]:
    rules: Counter[str] = Counter()
    for layer, value in kv_caches.items():
        edit = find_kv_cache_group_edit(engine.spec_of(layer), value, layout_hints=layout_hints)
        rules[edit.name if edit else "none"] += 1
    return rules


def _kernel_ratio(engine: Engine) -> dict[int, int]:
    return {
        g: engine.config.kv_cache_groups[g].kv_cache_spec.block_size // kernel
        for g, kernel in enumerate(engine.kernel_block_sizes)
    }


# -- the scenarios --------------------------------------------------------------------


@pytest.mark.parametrize(("allocation", "hnd"), ALLOCATIONS)
@pytest.mark.parametrize("checkpoint_alignment", [1, 64])
def test_qwen3_5_flashinfer_both_edits_fire(allocation: str, hnd: bool, checkpoint_alignment: int) -> None:
    engine = _engine(QWEN3_5_0_8B, FLASHINFER, allocation, hnd, checkpoint_alignment=checkpoint_alignment)
    bufs, kv_caches = allocate(engine, FLASHINFER, allocation, hnd)
    groups = engine.config.kv_cache_groups
    attn_group = next(i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, kvi.FullAttentionSpec))
    assert _kernel_ratio(engine)[attn_group] > 1  # FlashInfer pages the hybrid block finer

    out = apply_kv_cache_group_edits(engine.config, kv_caches, hints(hnd))

    mamba_rule = "mamba-state-rows" if allocation == "v033" else "mamba-state-list"
    num_mamba = sum(len(g.layer_names) for g in groups if isinstance(g.kv_cache_spec, kvi.MambaSpec))
    assert _rules(engine, kv_caches, hints(hnd)) == {
        mamba_rule: num_mamba,
        "subpaged-attention": len(groups[attn_group].layer_names),
    }
    assert out.keys() == kv_caches.keys()
    for layer, view in out.items():
        _check_opaque_view(engine, bufs, allocation, layer, view, kv_caches[layer])


@pytest.mark.parametrize(("allocation", "hnd"), ALLOCATIONS)
def test_qwen3_5_flash_attention_has_no_subpaging(allocation: str, hnd: bool) -> None:
    engine = _engine(QWEN3_5_0_8B, FLASH_ATTN, allocation, hnd)
    assert set(_kernel_ratio(engine).values()) == {1}
    bufs, kv_caches = allocate(engine, FLASH_ATTN, allocation, hnd)
    out = apply_kv_cache_group_edits(engine.config, kv_caches, hints(hnd))
    for layer, value in kv_caches.items():
        if isinstance(engine.spec_of(layer), kvi.MambaSpec):
            _check_opaque_view(engine, bufs, allocation, layer, out[layer], value)
        else:
            assert out[layer] is value  # already paged at the logical block: untouched


@pytest.mark.parametrize(("allocation", "hnd"), ALLOCATIONS)
@pytest.mark.parametrize("checkpoint_alignment", [1, 64])
def test_qwen3_next_tp2(allocation: str, hnd: bool, checkpoint_alignment: int) -> None:
    engine = _engine(
        QWEN3_NEXT_80B_A3B, FLASHINFER, allocation, hnd, tp=2, checkpoint_alignment=checkpoint_alignment
    )
    attn = next(
        g.kv_cache_spec
        for g in engine.config.kv_cache_groups
        if isinstance(g.kv_cache_spec, kvi.FullAttentionSpec)
    )
    assert attn.num_kv_heads == QWEN3_NEXT_80B_A3B.num_key_value_heads // 2
    bufs, kv_caches = allocate(engine, FLASHINFER, allocation, hnd)
    out = apply_kv_cache_group_edits(engine.config, kv_caches, hints(hnd))
    assert _rules(engine, kv_caches, hints(hnd))["none"] == 0
    for layer, view in out.items():
        _check_opaque_view(engine, bufs, allocation, layer, view, kv_caches[layer])


@pytest.mark.parametrize("hnd", [False, True])
def test_pure_attention_model_paged_at_its_block_is_untouched(hnd: bool) -> None:
    # FlashInfer takes a 64-token block whole: nothing to group, and the check passes
    # under the hint that matches the allocation.
    layout = KVCacheLayout.LBHNC if hnd else KVCacheLayout.LBNHC
    engine = attention_engine(LLAMA_3_2_1B, FLASHINFER, block_size=64, layout=layout)
    assert engine.kernel_block_sizes == [64]
    _, kv_caches = allocate_v033(engine)
    assert not engine.config.has_mamba_layers
    out = apply_kv_cache_group_edits(engine.config, kv_caches, hints(hnd))
    assert out is not kv_caches and out.keys() == kv_caches.keys()
    assert all(out[k] is v for k, v in kv_caches.items())


@pytest.mark.parametrize(("allocation", "hnd"), ALLOCATIONS)
def test_pure_attention_model_kernel_paged_is_edited(allocation: str, hnd: bool) -> None:
    # No Mamba layers, but vLLM 0.33 still splits the block for the backend
    # (prepare_kernel_block_sizes runs for every attention group): --block-size 128 on
    # FlashInfer is 64-token kernel pages, two per block id. The edits group them.
    layout = KVCacheLayout.LBHNC if hnd else KVCacheLayout.LBNHC
    engine = attention_engine(LLAMA_3_2_1B, FLASHINFER, block_size=128, layout=layout)
    assert engine.kernel_block_sizes == [64] and _kernel_ratio(engine) == {0: 2}
    bufs, kv_caches = allocate(engine, FLASHINFER, allocation, hnd)
    out = apply_kv_cache_group_edits(engine.config, kv_caches, hints(hnd))
    assert _rules(engine, kv_caches, hints(hnd)) == {"subpaged-attention": LLAMA_3_2_1B.num_hidden_layers}
    for layer, view in out.items():
        _check_opaque_view(engine, bufs, allocation, layer, view, kv_caches[layer])


def test_pure_attention_model_block_outermost_is_not_split() -> None:
    # BLNHC puts the other layers' pages between a layer's blocks, so vLLM keeps the
    # manager block (prepare_kernel_block_sizes) and there is nothing to group.
    engine = attention_engine(LLAMA_3_2_1B, FLASHINFER, block_size=128, layout=KVCacheLayout.BLNHC)
    assert engine.kernel_block_sizes == [128]
    _, kv_caches = allocate_v033(engine)
    out = apply_kv_cache_group_edits(engine.config, kv_caches, hints(False))
    assert all(out[k] is v for k, v in kv_caches.items())


def test_uniform_type_groups_are_unwrapped() -> None:
    engine = hybrid_engine(QWEN3_5_0_8B, FLASHINFER, uniform_type=True)
    groups = engine.config.kv_cache_groups
    assert all(isinstance(g.kv_cache_spec, kvi.UniformTypeKVCacheSpecs) for g in groups)
    bufs, kv_caches = allocate_v033(engine)
    out = apply_kv_cache_group_edits(engine.config, kv_caches, hints(False))
    assert _rules(engine, kv_caches, hints(False))["none"] == 0
    for layer, view in out.items():
        _check_opaque_view(engine, [bufs], "v033", layer, view, kv_caches[layer])


@pytest.mark.parametrize(("allocation", "hnd"), ALLOCATIONS)
def test_edits_are_idempotent(allocation: str, hnd: bool) -> None:
    engine = _engine(QWEN3_5_0_8B, FLASHINFER, allocation, hnd)
    _, kv_caches = allocate(engine, FLASHINFER, allocation, hnd)
    once = apply_kv_cache_group_edits(engine.config, kv_caches, hints(hnd))
    twice = apply_kv_cache_group_edits(engine.config, once, hints(hnd))
    for layer, view in once.items():
        again = twice[layer]
        assert (again.data_ptr(), again.shape, again.stride()) == (view.data_ptr(), view.shape, view.stride())


def test_layers_missing_from_the_dict_are_skipped() -> None:
    engine = hybrid_engine(QWEN3_5_0_8B, FLASHINFER)
    _, kv_caches = allocate_v033(engine)
    some = dict(list(kv_caches.items())[:5])
    assert apply_kv_cache_group_edits(engine.config, some).keys() == some.keys()


# -- MLA sub-paging (an MLA + KDA hybrid) ---------------------------------------------


@pytest.mark.parametrize("allocation", ["v033", "legacy"])
def test_mla_hybrid_subpaged(allocation: str) -> None:
    engine = mla_hybrid_engine(num_blocks=2)
    mla_group = next(
        i
        for i, g in enumerate(engine.config.kv_cache_groups)
        if isinstance(g.kv_cache_spec, kvi.MLAAttentionSpec)
    )
    assert _kernel_ratio(engine)[mla_group] > 1
    bufs, kv_caches = allocate(engine, FLASHMLA, allocation, False)
    out = apply_kv_cache_group_edits(engine.config, kv_caches, hints(False))
    rules = _rules(engine, kv_caches, hints(False))
    assert rules["subpaged-mla-attention"] == len(engine.config.kv_cache_groups[mla_group].layer_names)
    assert rules["none"] == 0
    for layer, view in out.items():
        _check_opaque_view(engine, bufs, allocation, layer, view, kv_caches[layer])


# -- declared compression: never edited ------------------------------------------------


def _dsv4_hybrid() -> Engine:
    """A Mamba group beside a DeepSeek-V4-style MLA group that declares 4 tokens per state
    (its tensors have block_size / 4 states per block, on purpose). The MLA page is
    aligned to 4 KiB so the page both groups share splits into block_size rows."""
    mla = kvi.MLAAttentionSpec(
        block_size=256,
        num_kv_heads=1,
        head_size=512,
        dtype=torch.uint8,
        tokens_per_state=4,
        state_content_bytes=584,
        alignment=4096,
    )
    mamba = kvi.MambaSpec(
        block_size=256,
        shapes=((3, 1024), (4, 32, 32)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=mla.page_size_bytes,
        mamba_cache_mode="align",
    )
    specs = {"layers.0.attn": mla, "layers.1.attn": mla, "layers.0.mamba": mamba, "layers.1.mamba": mamba}
    groups = [["layers.0.attn", "layers.1.attn"], ["layers.0.mamba", "layers.1.mamba"]]
    return make_engine(specs, groups, lambda s: int(s.block_size))


def test_declared_compression_group_is_untouched() -> None:
    engine = _dsv4_hybrid()
    _, kv_caches = allocate_v033(engine)
    attn = kv_caches["layers.0.attn"]
    spec = engine.spec_of("layers.0.attn")
    assert attn.shape[2] == spec.block_size // spec.tokens_per_state != spec.block_size
    out = apply_kv_cache_group_edits(engine.config, kv_caches, hints(False))  # checked in slots, too
    for name in ("layers.0.attn", "layers.1.attn"):  # not re-paged: the latents as bind_kv_cache views them
        value = kv_caches[name]
        assert (out[name].shape, out[name].stride()) == (value.squeeze(1).shape, value.squeeze(1).stride())
        assert out[name].data_ptr() == value.data_ptr()
    assert out["layers.0.mamba"] is not kv_caches["layers.0.mamba"]  # the Mamba group is still edited


@pytest.mark.parametrize("field", ["compress_ratio", "tq_slot_size"])
def test_legacy_declared_compression_is_untouched(field: str) -> None:
    from tests.integrations.vllm.test_vllm_validation import LegacyMLASpec, TQFullAttentionSpec

    if field == "compress_ratio":
        spec = LegacyMLASpec(
            block_size=256, num_kv_heads=1, head_size=576, dtype=torch.uint8, compress_ratio=4
        )
        value = torch.zeros(4, 64, 576, dtype=torch.uint8)  # [NB, block_size / 4, C]
    else:
        spec = TQFullAttentionSpec(
            block_size=64, num_kv_heads=2, head_size=128, dtype=torch.uint8, tq_slot_size=80
        )
        value = torch.zeros(4 * 4, 2, 16, 2, 80, dtype=torch.uint8)  # packed slots, kernel-paged
    mamba = kvi.MambaSpec(
        block_size=spec.block_size, shapes=((8,),), dtypes=(torch.float32,), mamba_cache_mode="align"
    )
    config = kvi.KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[],
        kv_cache_groups=[
            kvi.KVCacheGroupSpec(layer_names=["attn"], kv_cache_spec=spec),
            kvi.KVCacheGroupSpec(layer_names=["mamba"], kv_cache_spec=mamba),
        ],
    )
    assert find_kv_cache_group_edit(spec, value) is None
    assert apply_kv_cache_group_edits(config, {"attn": value})["attn"] is value


# -- declared compression, kernel-paged: grouped, the compression kept ------------------


def _indexer_with_mamba(block_size: int = 512) -> tuple[Engine, Any]:
    """DeepSeek-V4's C4 indexer (4 tokens a slot) at --block-size 512, which its backend
    pages in 256-token kernel blocks of 64 slots, beside a Mamba group (so even a
    hybrid-only code path runs the rules)."""
    indexer = dsv4_indexer_spec(block_size)
    engine = uniform_engine(indexer, DSV4_INDEXER, num_layers=2, layer_name="layers.{}.indexer")
    mamba = kvi.MambaSpec(
        block_size=block_size, shapes=((8,),), dtypes=(torch.float32,), mamba_cache_mode="align"
    )
    config = dataclasses.replace(
        engine.config,
        kv_cache_groups=[
            *engine.config.kv_cache_groups,
            kvi.KVCacheGroupSpec(layer_names=["layers.0.mamba"], kv_cache_spec=mamba),
        ],
    )
    return engine, config


def test_kernel_paged_compressed_indexer_is_grouped_keeping_its_slots() -> None:
    engine, config = _indexer_with_mamba()
    spec = engine.spec_of("layers.0.indexer")
    assert (spec.tokens_per_state, spec.num_states, engine.kernel_block_sizes) == (4, 128, [256])
    buf, kv_caches = allocate_v033(engine)
    value = kv_caches["layers.0.indexer"]
    k = spec.block_size // engine.kernel_block_sizes[0]
    assert tuple(value.shape) == (engine.config.num_blocks * k, 1, 256 // 4, 132)  # kernel pages of slots
    assert isinstance(find_kv_cache_group_edit(spec, value), SubpagedMLAEdit)
    for page in range(value.shape[0]):
        value[page] = page + 1
    out = apply_kv_cache_group_edits(config, kv_caches)
    for layer in ("layers.0.indexer", "layers.1.indexer"):
        _check_opaque_view(engine, [buf], "v033", layer, out[layer], kv_caches[layer])
    view = out["layers.0.indexer"]
    assert tuple(view.shape) == (engine.config.num_blocks, spec.num_states, 132)  # slots, not tokens
    for n in range(engine.config.num_blocks):  # block id n = kernel pages n*k .. n*k+k-1
        assert view[n].view(torch.uint8).view(k, -1).float().mean(dim=1).tolist() == [
            float(n * k + j + 1) for j in range(k)
        ]


def test_legacy_compress_ratio_kernel_paged_is_grouped() -> None:
    from tests.integrations.vllm.test_vllm_validation import LegacyMLASpec

    # Before 0.26 the ratio was MLAAttentionSpec.compress_ratio, the MLA cache
    # [pages, slots, C]: a 256-token block of 64 slots in four 64-token pages of 16.
    spec = LegacyMLASpec(block_size=256, num_kv_heads=1, head_size=132, dtype=torch.uint8, compress_ratio=4)
    raw = torch.arange(4 * spec.page_size_bytes, dtype=torch.int32).to(torch.uint8)
    value = raw.view(4 * 4, 16, 132)
    edit = find_kv_cache_group_edit(spec, value)
    assert isinstance(edit, SubpagedMLAEdit)
    view = edit.apply(spec, value)
    assert tuple(view.shape) == (4, 64, 132) and view.stride() == (spec.page_size_bytes, 132, 1)
    assert torch.equal(view.view(torch.uint8).flatten(), raw)


@pytest.mark.parametrize("hybrid", [False, True])
def test_kernel_paged_compressed_group_no_rule_groups_is_refused(hybrid: bool) -> None:
    # The check counts a compressed group's block in slots too: left as registered, the
    # indexer reads 64-slot blocks where a block id has 128.
    engine, config = _indexer_with_mamba()
    _, kv_caches = allocate_v033(engine)
    with pytest.raises(BlockGranularityError) as info:
        apply_kv_cache_group_edits(config if hybrid else engine.config, kv_caches, edits=[])
    # (what the raw pages read as is detection's business; the block is never 128 slots)
    message = str(info.value)
    assert message.startswith(
        "registered blocks are not block ids under kv_layout=None: group 0: layer 'layers.0.indexer' (and 1 more) "
        "reads as "
    )
    assert ", not 128 (512 tokens at 4 per slot). A wrong kv_layout hint" in message


# -- undeclared packing: loud -----------------------------------------------------------


@pytest.mark.parametrize("how", ["scales", "dtype", "gapped"])
def test_undeclared_packed_layout_raises(how: str) -> None:
    """A kernel-paged attention tensor whose pages are not what the group's spec says."""
    engine = hybrid_engine(QWEN3_5_0_8B, FLASHINFER)
    groups = engine.config.kv_cache_groups
    g = next(i for i, grp in enumerate(groups) if isinstance(grp.kv_cache_spec, kvi.FullAttentionSpec))
    spec, kernel = groups[g].kv_cache_spec, engine.kernel_block_sizes[g]
    layer = groups[g].layer_names[0]
    k = spec.block_size // kernel
    # What the backend really allocated, laid out as vLLM 0.33 does ([pages, H, N, C], NHD memory):
    if how == "scales":  # per-token-head scales carved into each kernel page
        backend_spec = dataclasses.replace(spec, state_content_bytes=spec.state_content_size_bytes + 8)
    elif how == "dtype":  # fp8 pages under a bf16 spec
        backend_spec = dataclasses.replace(spec, dtype=torch.float8_e4m3fn)
    else:  # dense kernel pages, each padded to an alignment
        backend_spec = spec
    pad = 256 if how == "gapped" else 0
    pages = engine.config.num_blocks * k
    page_bytes = kernel * backend_spec.num_heads * backend_spec.state_content_size_bytes
    raw = torch.zeros(pages * (page_bytes + pad), dtype=torch.int8)
    dense = raw.view(pages, page_bytes + pad)[:, :page_bytes].view(backend_spec.dtype)
    value = dense.view(pages, kernel, backend_spec.num_heads, -1).transpose(1, 2)
    _, kv_caches = allocate_v033(engine)
    kv_caches[layer] = value
    with pytest.raises(KVCacheGroupEditError) as info:
        apply_kv_cache_group_edits(engine.config, kv_caches)
    message = str(info.value)
    assert message.startswith(f"layer {layer!r} (KV cache group {g}): ")
    assert info.value.layer == layer and info.value.group == g
    assert isinstance(info.value, ValueError)
    if how == "gapped":
        assert f"kernel pages are {page_bytes + pad} bytes apart but {page_bytes} bytes long" in message
    else:
        assert f"{k} kernel pages of {kernel} tokens ({k} x {page_bytes} = {k * page_bytes} bytes)" in message
        assert f"the logical page ({spec.page_size_bytes} bytes)" in message


# -- views, not copies: writes go through, nothing else moves ---------------------------


@pytest.mark.parametrize(("allocation", "hnd"), ALLOCATIONS)
def test_writes_go_through_to_the_registered_tensors(allocation: str, hnd: bool) -> None:
    engine = _engine(QWEN3_5_0_8B, FLASHINFER, allocation, hnd)
    bufs, kv_caches = allocate(engine, FLASHINFER, allocation, hnd)
    out = apply_kv_cache_group_edits(engine.config, kv_caches, hints(hnd))
    block = engine.config.num_blocks - 1
    for layer, view in out.items():
        spec = engine.spec_of(layer)
        for buf in bufs:
            buf.zero_()
        view[block].view(torch.int8).fill_(7)  # every byte of the block (a block view is bf16)
        assert sum(int(buf.count_nonzero()) for buf in bufs) == spec.page_size_bytes  # the page, no more
        value = kv_caches[layer]
        if isinstance(spec, kvi.MambaSpec):
            states = [value] if isinstance(value, torch.Tensor) else value
            for state in states:  # conv and ssm (or the 0.33 row) of that block, as the engine reads them
                expected = torch.full((state[block].numel() * state.element_size(),), 7, dtype=torch.int8)
                assert torch.equal(state[block].contiguous().view(torch.int8).flatten(), expected)
                assert not state[:block].view(torch.int8).any()
        else:
            k = spec.block_size // engine.kernel_block_sizes[engine.group_of(layer)]
            pages = value.unflatten(0, (-1, k))  # FlashInfer: kernel pages on dim 0
            mine = pages[block].contiguous().view(torch.int8)
            assert bool((mine == 7).all())
            assert not pages[:block].contiguous().view(torch.int8).any()


def test_kernel_pages_of_a_block_are_its_bytes_in_order() -> None:
    # Logical block n is kernel pages n*k .. n*k+k-1 (vLLM's block table expansion):
    # mark each kernel page with its index and read the pages back through the view.
    engine = hybrid_engine(QWEN3_5_0_8B, FLASHINFER)
    _, kv_caches = allocate_v033(engine)
    g = engine.kernel_block_sizes.index(min(engine.kernel_block_sizes))
    layer = engine.config.kv_cache_groups[g].layer_names[0]
    value = kv_caches[layer]
    for page in range(value.shape[0]):
        value[page] = page + 1
    view = apply_kv_cache_group_edits(engine.config, kv_caches, hints(False))[layer]
    k = value.shape[0] // engine.config.num_blocks
    kernel = value.shape[2]  # [pages, H, N, C]; NHD pages are viewed as blocks [NB, H, k*N, C]
    assert opaque_pages_of(view) is None and view.shape[2] == k * kernel
    for n in range(engine.config.num_blocks):
        per_page = [view[n][:, j * kernel : (j + 1) * kernel].float().mean().item() for j in range(k)]
        assert per_page == [float(n * k + j + 1) for j in range(k)]


# -- the rules one by one, on tensors vLLM could hand over -----------------------------


def test_unmatched_layers_pass_through_as_the_same_objects() -> None:
    engine = hybrid_engine(QWEN3_5_0_8B, FLASH_ATTN)
    _, kv_caches = allocate_v033(engine)
    marker = object()
    extra = {"not.in.any.group": marker}
    out = apply_kv_cache_group_edits(engine.config, {**kv_caches, **extra}, hints(False))
    assert out["not.in.any.group"] is marker


# -- transfer_layers: only what the edits returned --------------------------------------


@pytest.mark.parametrize(
    ("case", "rule", "layer", "group"),
    [
        ("hybrid v033", "mamba-state-rows", "model.layers.0.linear_attn", 0),
        ("hybrid legacy", "mamba-state-list", "model.layers.0.linear_attn", 0),
        ("flashinfer --block-size 128", "subpaged-attention", "model.layers.0.self_attn.attn", 0),
    ],
)
def test_transfer_layers_refuses_layers_the_edits_did_not_see(
    case: str, rule: str, layer: str, group: int
) -> None:
    """Handed vLLM's registration without the edits, transfer_layers gave detection the
    kernel pages (32 or 64 tokens where a block id has 544 or 128) and Mamba state rows: a
    registration whose blocks are not block ids, which moves the wrong bytes silently."""
    from kvlayout.integrations.vllm import transfer_layers

    if case.startswith("hybrid"):
        allocation = case.split()[1]
        engine = hybrid_engine(
            QWEN3_5_0_8B, FLASHINFER, layout=KVCacheLayout.LBNHC if allocation == "v033" else None
        )
        _, kv_caches = allocate(engine, FLASHINFER, allocation)
    else:
        engine = attention_engine(LLAMA_3_2_1B, FLASHINFER, block_size=128)
        _, kv_caches = allocate_v033(engine)
    with pytest.raises(KVCacheGroupEditError) as info:
        transfer_layers(engine.config, kv_caches)
    assert str(info.value) == (
        f"layer {layer!r} (KV cache group {group}): is as vLLM registered it, but the {rule!r} edit re-views it "
        "(until then a registered block is not a block id): pass kv_caches through "
        "apply_kv_cache_group_edits(kv_cache_config, kv_caches, hints) first, and its result here"
    )
    edited = apply_kv_cache_group_edits(engine.config, kv_caches, hints(False))
    layers, _ = transfer_layers(engine.config, edited)
    assert len(layers) == len(kv_caches)


def test_transfer_layers_takes_a_registration_no_edit_applies_to() -> None:
    # FlashAttention pages at the block: the edits return the same objects, so the
    # registration as vLLM hands it is the edited one.
    from kvlayout.integrations.vllm import transfer_layers

    engine = attention_engine(LLAMA_3_2_1B, FLASH_ATTN)
    _, kv_caches = allocate_v033(engine)
    layers, groups = transfer_layers(engine.config, kv_caches)
    assert all(a is b for a, b in zip(layers, kv_caches.values(), strict=True))
    assert groups == [list(range(len(kv_caches)))]


def test_the_models_head_hints_pass_a_hybrid_of_opaque_pages() -> None:
    """A connector's ``num_kv_heads`` and ``head_dim`` are the attention layers' (vLLM's spec):
    the Mamba groups' opaque pages have no heads to check them against, and were refused
    ("head_dim=256 contradicts NL_X_NB_BS_HS, whose HS is ..." of a page row's bytes)."""
    import kvlayout
    from kvlayout import EngineKVFormat
    from kvlayout.integrations.vllm import transfer_layers
    from kvlayout.types import LayoutHintError

    engine = hybrid_engine(QWEN3_5_0_8B, FLASH_ATTN, num_blocks=4)
    _, views = allocate_v033(engine)
    groups = engine.config.kv_cache_groups
    spec = next(g.kv_cache_spec for g in groups if isinstance(g.kv_cache_spec, kvi.FullAttentionSpec))
    model = {**hints(False), "head_dim": spec.head_size, "num_kv_heads": spec.num_kv_heads}
    edited = apply_kv_cache_group_edits(engine.config, views, model)
    layers, layer_groups = transfer_layers(engine.config, edited)
    reg = kvlayout.detect(layers, "vllm", model, layer_groups=layer_groups)
    assert [g.format for g in reg.kernel_groups].count(EngineKVFormat.NL_X_NB_BS_NH_CS) == 1
    wrong = {**model, "num_kv_heads": spec.num_kv_heads + 1}  # still checked where there are heads
    with pytest.raises(
        LayoutHintError, match=rf"num_kv_heads={spec.num_kv_heads + 1} contradicts NL_X_NB_BS_NH_CS"
    ):
        kvlayout.detect(layers, "vllm", wrong, layer_groups=layer_groups)
