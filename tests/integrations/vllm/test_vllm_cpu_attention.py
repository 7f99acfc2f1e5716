"""vLLM's CPU platform attention (CPU_ATTN): each block's K and V are packed per ISA, so
its pages move whole, only to caches paged alike. Its [B, H, N, 2*hs] layers were read
as heads of K | V halves per token row, and block maps moved wrong bytes for every token."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import torch

import kvlayout
from kvlayout import LayoutHintError
from kvlayout.integrations.vllm import (
    CPUAttentionPagesEdit,
    apply_kv_cache_group_edits,
    find_kv_cache_group_edit,
    transfer_layers,
)
from kvlayout.testing.vllm import FLASH_ATTN, Backend, allocate_v033, uniform_engine
from kvlayout.transfer import BlockMapError, block_map
from kvlayout.types import LayoutHints

pytest.importorskip("vllm.v1.kv_cache_interface")
import vllm.v1.kv_cache_interface as kvi
from vllm.v1.kv_cache_layout import KVCacheLayout

NL, H, D, BS, NB = 2, 2, 32, 32, 6
CPU_ATTN = Backend("CPU_ATTN", multiple_of=32)  # vllm/v1/attention/backends/cpu_attn.py: MultipleOf(32)
SPEC = kvi.FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
CPU_HINTS = {"attn_backend": "CPU_ATTN"}


def allocated(
    seed: int, backend: Backend = CPU_ATTN, layout: Any = KVCacheLayout.LBHNC
) -> tuple[Any, dict[str, Any]]:
    engine = uniform_engine(SPEC, backend, num_layers=NL, num_blocks=NB, layout=layout)
    buf, kv = allocate_v033(engine)
    buf.copy_(
        torch.randint(-128, 128, buf.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
    )
    return engine, kv


def through_edits(engine: Any, kv: dict[str, Any], hints: Any) -> Any:
    edited = apply_kv_cache_group_edits(engine.config, kv, hints)
    layers, groups = transfer_layers(engine.config, edited)
    return kvlayout.detect(layers, "vllm", hints, layer_groups=groups)


def _kernel_kv(view: torch.Tensor, block: int, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ``token`` of block ``block`` as CPU_ATTN's kernel sees it (cpu_attn.py views a
    block [H, N, 2*hs] as [H, 2N, hs] and chunks dim 1: every token's K, then every V)."""
    nb, h, n, c = view.shape
    x = view.view(nb, h, 2 * n, c // 2)[block]
    return x[:, token].view(torch.int16), x[:, n + token].view(torch.int16)


@pytest.mark.parametrize("entry", ["detect", "edits"])
@pytest.mark.parametrize("hints", [CPU_HINTS, None], ids=["hinted", "cpu-default"])
def test_a_cpu_attention_registration_reads_as_whole_pages(entry: str, hints: Any) -> None:
    engine, kv = allocated(1)
    reg = (
        kvlayout.detect(list(kv.values()), "vllm", hints)
        if entry == "detect"
        else through_edits(engine, kv, hints)
    )
    (group,) = reg.kernel_groups
    assert group.format.name == "NL_X_NB_BS_HS"
    assert group.block_size == BS and group.num_blocks == NB
    pages = group.opaque_pages
    assert pages is not None and not pages.rows_are_tokens
    assert pages.layout.startswith("cpu-attn-pages: vLLM's CPU_ATTN")
    assert "K and V packed per ISA" in pages.layout
    # both entry points mark the pages alike: they map to each other
    other = (
        through_edits(engine, kv, CPU_HINTS)
        if entry == "detect"
        else kvlayout.detect(list(kv.values()), "vllm")
    )
    assert other.kernel_groups[0].opaque_pages == pages


def test_the_rule_needs_the_hints_to_match() -> None:
    _, kv = allocated(1)
    value = next(iter(kv.values()))
    assert not CPUAttentionPagesEdit().matches(SPEC, value)
    assert isinstance(find_kv_cache_group_edit(SPEC, value, layout_hints=CPU_HINTS), CPUAttentionPagesEdit)
    assert find_kv_cache_group_edit(SPEC, value, layout_hints={"kv_layout": "HND"}) is None
    assert find_kv_cache_group_edit(SPEC, value, layout_hints={"attn_backend": "FLASH_ATTN"}) is None


@pytest.mark.parametrize("num_tokens", [2 * BS, BS + 8])
def test_cpu_attention_to_cpu_attention_moves_whole_blocks_byte_exactly(num_tokens: int) -> None:
    engine, src_kv = allocated(1)
    _, dst_kv = allocated(2)
    src = through_edits(engine, src_kv, CPU_HINTS)
    dst = kvlayout.detect(list(dst_kv.values()), "vllm")  # the CPU default reads it alike
    before = {name: t.clone() for name, t in dst_kv.items()}
    m = block_map(src, dst, [4, 1], [0, 5], num_tokens=num_tokens)
    assert m.kind == "same layout"
    m.copy()
    for name, s in src_kv.items():
        d = dst_kv[name]
        # a partly filled last block moves whole: its rows are no tokens
        for sb, db in ((4, 0), (1, 5)):
            assert torch.equal(d[db].view(torch.int16), s[sb].view(torch.int16))
            for t in range(BS):
                sk, sv = _kernel_kv(s, sb, t)
                dk, dv = _kernel_kv(d, db, t)
                assert torch.equal(sk, dk) and torch.equal(sv, dv)
        for b in (1, 2, 3, 4):
            assert torch.equal(d[b].view(torch.int16), before[name][b].view(torch.int16))


@pytest.mark.parametrize("hints", [CPU_HINTS, None], ids=["hinted", "cpu-default"])
def test_cpu_attention_to_a_gpu_backend_cache_is_refused(hints: Any) -> None:
    engine, kv = allocated(1)
    src = through_edits(engine, kv, hints)
    gpu, gpu_kv = allocated(2, FLASH_ATTN, KVCacheLayout.LBNHC)
    dst = through_edits(gpu, gpu_kv, {"kv_layout": "NHD"})
    for a, b in ((src, dst), (dst, src)):
        with pytest.raises(BlockMapError) as e:
            block_map(a, b, [4, 1], [0, 5], num_tokens=2 * BS)
        message = str(e.value)
        assert "read as vLLM's CPU_ATTN (its K and V packed per ISA inside each block)" in message
        assert "pack_kv_cache" in message
        standing_in = "if these tensors stand in for a GPU backend's cache" in message
        assert standing_in is (hints is None)
        assert ("kv_layout=" in message) is (hints is None)


@pytest.mark.parametrize("layout, hint", [(KVCacheLayout.LBHNC, "HND"), (KVCacheLayout.LBNHC, "NHD")])
def test_a_kv_layout_hint_keeps_the_plain_reading(layout: Any, hint: str) -> None:
    engine, kv = allocated(1, FLASH_ATTN, layout)
    for reg in (
        kvlayout.detect(list(kv.values()), "vllm", {"kv_layout": hint}),
        through_edits(engine, kv, {"kv_layout": hint}),
    ):
        (group,) = reg.kernel_groups
        assert group.opaque_pages is None
        assert group.format.name == ("NL_X_NB_NH_BS_CS" if hint == "HND" else "NL_X_NB_BS_NH_CS")


def test_another_backend_keeps_the_plain_reading() -> None:
    _, kv = allocated(1)
    reg = kvlayout.detect(list(kv.values()), "vllm", {"attn_backend": "FLASH_ATTN", "kv_layout": "HND"})
    assert reg.kernel_groups[0].opaque_pages is None
    assert reg.kernel_groups[0].format.name == "NL_X_NB_NH_BS_CS"


def test_mla_on_the_cpu_is_not_cpu_attention() -> None:
    latents = [torch.zeros(NB, 1, BS, 576, dtype=torch.bfloat16) for _ in range(NL)]
    for hints in ({"kv_dim": 1}, {"attn_backend": "CPU_MLA", "kv_dim": 1}):
        reg = kvlayout.detect(latents, "vllm", hints)
        assert reg.kernel_groups[0].opaque_pages is None
        assert reg.kernel_groups[0].layout.is_mla


def test_cpu_attention_contradicting_kv_layout_is_refused() -> None:
    _, kv = allocated(1)
    with pytest.raises(LayoutHintError, match="attn_backend='CPU_ATTN' and kv_layout='NHD' disagree"):
        kvlayout.detect(list(kv.values()), "vllm", {"attn_backend": "CPU_ATTN", "kv_layout": "NHD"})


@pytest.mark.parametrize("engine", ["sglang", "trtllm"])
def test_attn_backend_is_vllm_s(engine: str) -> None:
    kv = [torch.zeros(NB * BS, H, D, dtype=torch.bfloat16) for _ in range(2 * NL)]
    with pytest.raises(LayoutHintError, match="attn_backend is vLLM's"):
        kvlayout.detect(kv, engine, {"attn_backend": "CPU_ATTN", "tokens_per_block": BS})


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "layout hint attn_backend is empty: pass vLLM's attn_backend.get_name() (e.g. 'CPU_ATTN')"),
        ("   ", "layout hint attn_backend is empty"),
        (3, "layout hint attn_backend must be a str (vLLM's attn_backend.get_name(), e.g. 'CPU_ATTN'), not int (3)"),
        (b"CPU_ATTN", "layout hint attn_backend must be a str"),
    ],
)  # fmt: skip
def test_bad_attn_backend_values_are_refused(value: Any, message: str) -> None:
    with pytest.raises(LayoutHintError, match=re.escape(message)):
        LayoutHints.coerce({"attn_backend": value})


def test_attn_backend_keeps_its_position_and_is_kept_as_spelled() -> None:
    # positional API: hints added later (KVBM's kvbm_layout) come after it
    assert [f.name for f in dataclasses.fields(LayoutHints)][-2:] == ["attn_backend", "kvbm_layout"]
    assert LayoutHints(attn_backend=" CPU_ATTN ").attn_backend == "CPU_ATTN"
    assert LayoutHints(attn_backend="TRITON_ATTN").attn_backend == "TRITON_ATTN"


def test_size_hints_are_checked_against_the_cpu_attention_layer() -> None:
    _, kv = allocated(1)
    layers = list(kv.values())
    # a CPU_ATTN row is a head's K | V: head_dim is half of it
    assert kvlayout.detect(layers, "vllm", {**CPU_HINTS, "num_kv_heads": H, "head_dim": D}).kernel_groups
    for wrong in ({"num_kv_heads": H + 1}, {"head_dim": 2 * D}):
        stated, size = next(iter(wrong.items())), H if "num_kv_heads" in wrong else D
        with pytest.raises(LayoutHintError, match=rf"layout hint {stated[0]}={stated[1]}, .* has {size}$"):
            kvlayout.detect(layers, "vllm", {**CPU_HINTS, **wrong})


@pytest.mark.parametrize("hints", [CPU_HINTS, None], ids=["hinted", "cpu-default"])
def test_one_kv_head_is_cpu_attention_too(hints: Any) -> None:
    """An MQA model, or TP = KV heads, registers one head a rank; it was read as one head of
    K | V halves and mapped into a plain cache with every token's bytes wrong."""
    spec = dataclasses.replace(SPEC, num_kv_heads=1)
    engine = uniform_engine(spec, CPU_ATTN, num_layers=NL, num_blocks=NB, layout=KVCacheLayout.LBHNC)
    _, kv = allocate_v033(engine)
    for reg in (kvlayout.detect(list(kv.values()), "vllm", hints), through_edits(engine, kv, hints)):
        (group,) = reg.kernel_groups
        assert group.opaque_pages is not None and "CPU_ATTN" in group.opaque_pages.layout
    gpu = uniform_engine(spec, FLASH_ATTN, num_layers=NL, num_blocks=NB, layout=KVCacheLayout.LBNHC)
    plain = kvlayout.detect(list(allocate_v033(gpu)[1].values()), "vllm", {"kv_layout": "NHD"})
    src = kvlayout.detect(list(kv.values()), "vllm", hints)
    with pytest.raises(BlockMapError, match="read as vLLM's CPU_ATTN") as e:
        block_map(src, plain, [4], [0], num_tokens=BS)
    assert ("kv_dim=1 if its one head is an MLA layer's latents" in str(e.value)) is (hints is None)


def test_a_cpu_attention_cache_of_no_blocks_is_named() -> None:
    layers = [torch.zeros(0, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(NL)]
    with pytest.raises(kvlayout.DetectionError, match=r"read as vLLM's CPU_ATTN holds no pages"):
        kvlayout.detect(layers, "vllm", CPU_HINTS)


def test_cpu_attention_with_heads_outside_blocks_is_refused() -> None:
    _, kv = allocated(1)
    kv_layout = "LHBNC"
    hints = {**CPU_HINTS, "kv_layout": kv_layout}
    with pytest.raises(
        LayoutHintError, match=f"attn_backend='CPU_ATTN' and kv_layout='{kv_layout}' disagree"
    ):
        kvlayout.detect(list(kv.values()), "vllm", hints)


def test_the_cpu_attention_rule_refuses_heads_outside_blocks() -> None:
    """Under the hint, an LHBNC allocation (each head's pages one after another) is none
    CPU_ATTN makes: the rule refuses it rather than cut a head's pages as a block's."""
    from kvlayout.integrations.vllm import KVCacheGroupEditError

    engine, kv = allocated(1, CPU_ATTN, KVCacheLayout.LHBNC)
    with pytest.raises(KVCacheGroupEditError, match="do not hold every head inside each block"):
        apply_kv_cache_group_edits(engine.config, kv, CPU_HINTS)


def test_the_rule_asks_a_layer_of_no_blocks_without_indexing_it() -> None:
    """By the CPU default the rule looks at a block's memory; a layer of none is not
    CPU_ATTN's pages to it (and no IndexError)."""
    empty = torch.zeros(0, H, BS, 2 * D, dtype=torch.bfloat16)
    assert not CPUAttentionPagesEdit().matches_with_hints(SPEC, empty, None)
    assert CPUAttentionPagesEdit().matches_with_hints(SPEC, empty, CPU_HINTS)
