"""vLLM 0.33 on ROCm: caches whose bytes are not what the same registration holds on CUDA.

* The DSA indexer's fp8 K cache: ``rocm_aiter_mla_sparse.py`` ``indexer_k_quant_and_cache_triton``
  (the only writer ``SparseAttnIndexer.forward_hip`` has) stores a block of more than one
  slot in 16-slot x 16-byte SHUFFLE tiles, ``[BS/16, D/16, 16, 16]``, then the fp32 scales.
* Its MXFP4 K cache (``DEEPSEEK_V4_ROCM_MXFP4_INDEXER``): aiter's ``cache_format`` order.
* ROCM_ATTN and ROCM_SEGMENTED_ATTN declare the same head slots (``customize_spec``) but
  lay a slot out differently (x-packed K, transposed V vs ``[N, H, D]``).

Read on ROCm (a ROCm ``attn_backend`` hint, or a ROCm torch build's GPU tensors), the
indexer is whole opaque pages and head-slot pages carry their backend, so no map moves
them into a cache laid out otherwise."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import vllm.v1.kv_cache_interface as kvi
from vllm.v1.kv_cache_layout import KVCacheLayout

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout.detection import DetectionError
from kvlayout.detection.vllm import indexer_format, reads_rocm
from kvlayout.integrations.vllm import apply_kv_cache_group_edits
from kvlayout.registration.opaque import opaque_pages_of
from kvlayout.transfer import BlockMapError, Shard, block_map
from tests.integrations.vllm.models import (
    Backend,
    allocate_v033,
    detect_registered,
    dsv4_indexer_spec,
    uniform_engine,
)

NB, NL = 6, 2
ROCM = {"attn_backend": "ROCM_AITER_MLA_SPARSE"}
ENTRIES = ["detect", "edits"]
PAGE = 64 * 132  # a 64-slot page's bytes; the 512-byte aligned block stride pads it
TILE = 16  # BLOCK_TILE_SIZE slots x HEAD_TILE_SIZE bytes (fp8: 16 // element_size 1)


def _engine(spec: Any, backend: Backend) -> Any:
    return uniform_engine(spec, backend, num_layers=NL, num_blocks=NB)


def _indexer_engine(block_size: int, kv_dtype: str = "fp8", ratio: int = 1) -> Any:
    spec = dsv4_indexer_spec(block_size, ratio, kv_dtype)
    return _engine(spec, Backend("DEEPSEEK_V32_INDEXER", fixed_sizes=(block_size // ratio * ratio,)))


def _filled(engine: Any, seed: int) -> dict[str, torch.Tensor]:
    buf, kv = allocate_v033(engine)
    gen = torch.Generator().manual_seed(seed)
    buf.copy_(torch.randint(-128, 128, buf.shape, dtype=torch.int8, generator=gen).view(buf.dtype))
    return kv


def _detect(engine: Any, kv: dict[str, torch.Tensor], entry: str, hints: dict[str, Any]) -> Any:
    return detect_registered(engine, kv, hints, edited=entry == "edits")


def _pages(t: torch.Tensor) -> torch.Tensor:
    """The registered layer's pages as bytes, ``[NB, block stride]`` (padding included)."""
    b = t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int8).view(torch.uint8)
    item = t.element_size()
    return b.as_strided((t.shape[0], t.stride(0) * item), (t.stride(0) * item, 1))


def _shuffled_key(page: torch.Tensor, slots: int, slot: int, head_dim: int) -> torch.Tensor:
    """Slot ``slot``'s fp8 key bytes and fp32 scale bytes in a ROCm indexer page, by the
    writer's indexing (_indexer_k_quant_and_cache_kernel, LAYOUT "SHUFFLE"): value byte
    ``d`` at ``(slot // 16) * 16 * D + (d // 16) * 256 + (slot % 16) * 16 + d % 16``, the
    scale at ``slots * D + slot * 4``."""
    d = torch.arange(head_dim)
    at = (slot // TILE) * TILE * head_dim + (d // TILE) * TILE * TILE + (slot % TILE) * TILE + d % TILE
    scale = page[slots * head_dim + slot * 4 : slots * head_dim + slot * 4 + 4]
    return torch.cat([page[at], scale])


@pytest.mark.parametrize("entry", ENTRIES)
def test_rocm_fp8_indexer_is_whole_shuffled_pages(entry: str) -> None:
    engine = _indexer_engine(64)
    kv_a, kv_b = _filled(engine, 1), _filled(engine, 2)
    a, b = _detect(engine, kv_a, entry, ROCM), _detect(engine, kv_b, entry, ROCM)
    pages = a.kernel_groups[0].opaque_pages
    assert pages is not None and not pages.rows_are_tokens and "SHUFFLE" in pages.layout, a
    assert kvlayout.get_block_size(a, a.format) == 64
    src, dst = [3, 1], [0, 5]
    before = {name: _pages(t).clone() for name, t in kv_b.items()}
    # a partly filled last block moves whole: its slots' tiles interleave with the others'
    block_map(a, b, src, dst, num_tokens=64 + 9).copy()
    for name, t in kv_b.items():
        got, want = _pages(t), before[name]
        for s, d in zip(src, dst, strict=True):
            for slot in (0, 5, 17, 63):  # the writer's addressing reads the same key back
                assert torch.equal(
                    _shuffled_key(got[d], 64, slot, 128), _shuffled_key(_pages(kv_a[name])[s], 64, slot, 128)
                )
            want[d, :PAGE] = _pages(kv_a[name])[s, :PAGE]
        assert torch.equal(got, want), name  # whole pages, nothing else touched (padding neither)


@pytest.mark.parametrize("entry", ENTRIES)
def test_rocm_indexer_does_not_map_to_the_cuda_reading(entry: str) -> None:
    engine = _indexer_engine(64)
    kv = _filled(engine, 3)
    rocm, cuda = _detect(engine, kv, entry, ROCM), _detect(engine, kv, entry, {})
    assert cuda.format == F.NL_X_NB_BSV_BSS and cuda.kernel_groups[0].opaque_pages is None
    for one, two in ((rocm, cuda), (cuda, rocm)):
        with pytest.raises(BlockMapError, match="opaque pages"):
            block_map(one, two, [1], [2])


def test_rocm_fp8_indexer_of_one_slot_blocks_stays_rows() -> None:
    # block_size 1: the writer's LAYOUT is "NORMAL", the rows CUDA writes
    kv = [torch.zeros(NB, 1, 1, 132, dtype=torch.uint8) for _ in range(NL)]
    reg = kvlayout.detect(kv, "vllm", ROCM)
    assert reg.format == F.NL_X_NB_BSV_BSS and reg.kernel_groups[0].opaque_pages is None


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("ratio", [1, 4])
def test_rocm_mxfp4_indexer_is_whole_pages(entry: str, ratio: int) -> None:
    engine = _indexer_engine(256 if ratio > 1 else 64, "mxfp4", ratio)
    kv_a, kv_b = _filled(engine, 4), _filled(engine, 5)
    hints = {"attn_backend": "DEEPSEEK_V4_ROCM_MXFP4_INDEXER"}
    a, b = _detect(engine, kv_a, entry, hints), _detect(engine, kv_b, entry, hints)
    pages = a.kernel_groups[0].opaque_pages
    assert pages is not None and "cache_format" in pages.layout and not pages.rows_are_tokens, a
    before = {name: _pages(t).clone() for name, t in kv_b.items()}
    block_map(a, b, [2, 4], [1, 3], num_tokens=70).copy()
    slots = next(iter(kv_a.values())).shape[2]
    for name, t in kv_b.items():
        want = before[name]
        for s, d in ((2, 1), (4, 3)):
            want[d, : slots * 68] = _pages(kv_a[name])[s, : slots * 68]
        assert torch.equal(_pages(t)[:, : slots * 68], want[:, : slots * 68]), name
    cuda = _detect(engine, kv_b, entry, {})
    assert cuda.format == F.NL_X_NB_BSV4_BSS4
    with pytest.raises(BlockMapError, match="opaque pages"):
        block_map(a, cuda, [1], [2])


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize(
    ("kv_dtype", "block", "hints"),
    [("fp8", 64, ROCM), ("mxfp4", 64, {"attn_backend": "DEEPSEEK_V4_ROCM_MXFP4_INDEXER"})],
)
def test_rocm_indexer_pages_move_between_tp_ranks(entry: str, kv_dtype: str, block: int, hints: Any) -> None:
    """The indexer's key is one head every TP rank holds whole: its ROCm pages map between
    any two ranks, whole (they were refused); never into the CUDA reading of the rows."""
    engine = _indexer_engine(block, kv_dtype)
    kv_a = _filled(engine, 7)
    a = _detect(engine, kv_a, entry, hints)
    page = next(iter(kv_a.values()))[0].numel() * next(iter(kv_a.values())).element_size()
    pairs = [
        (Shard(0, 2, 1), Shard(1, 2, 1)),
        (Shard(0, 1, 1), Shard(3, 4, 1)),
        (Shard(0, 2, 2), Shard(1, 2, 2)),
    ]
    for seed, shards in enumerate(pairs, 8):
        kv_b = _filled(engine, seed)
        b = _detect(engine, kv_b, entry, hints)
        before = {name: _pages(t).clone() for name, t in kv_b.items()}
        m = block_map(a, b, [2, 4], [1, 3], num_tokens=block + 5, src_shard=shards[0], dst_shard=shards[1])
        assert m.kind == "same layout"  # the pages alike: whole, whatever the shards say of heads
        m.copy()
        for name, t in kv_b.items():
            want = before[name]
            for s, d in ((2, 1), (4, 3)):
                want[d, :page] = _pages(kv_a[name])[s, :page]
            assert torch.equal(_pages(t), want), name  # whole pages, padding untouched
    cuda = _detect(engine, kv_a, entry, {})
    with pytest.raises(BlockMapError, match="opaque pages"):
        block_map(a, cuda, [1], [2], src_shard=Shard(0, 2, 1), dst_shard=Shard(1, 2, 1))


def test_rocm_subpaged_indexer_pages_move_between_ranks_but_not_into_cuda_pages() -> None:
    # a 128-token block in 64-token kernel pages: the edit's block is two tiled kernel pages
    spec = dsv4_indexer_spec(128, 1, "fp8")
    engine = _engine(spec, Backend("DEEPSEEK_V32_INDEXER", fixed_sizes=(64,)))
    kv_a, kv_b = _filled(engine, 11), _filled(engine, 12)
    a, b = _detect(engine, kv_a, "edits", ROCM), _detect(engine, kv_b, "edits", ROCM)
    pages = a.kernel_groups[0].opaque_pages
    assert pages is not None and pages.arrays_end == 2 * PAGE
    block_map(a, b, [2], [1], num_tokens=70, src_shard=Shard(0, 2, 1), dst_shard=Shard(1, 2, 1)).copy()
    for name, t in kv_b.items():
        assert torch.equal(_pages(t)[2:4], _pages(kv_a[name])[4:6]), name  # both kernel pages
    cuda = _detect(engine, kv_b, "edits", {})
    for src_shard, dst_shard in ((None, None), (Shard(0, 2, 1), Shard(1, 2, 1))):
        with pytest.raises(BlockMapError, match="do not hold the same state") as err:
            block_map(a, cuda, [1], [2], src_shard=src_shard, dst_shard=dst_shard)
        assert "read as written on ROCm" in str(err.value)  # the reading's advice


def test_rocm_subpaged_indexer_pages_say_rocm() -> None:
    # a 128-token block in 64-token kernel pages: the subpaged edit's pages, tiled per kernel page
    spec = dsv4_indexer_spec(128, 1, "fp8")
    engine = _engine(spec, Backend("DEEPSEEK_V32_INDEXER", fixed_sizes=(64,)))
    kv = _filled(engine, 6)
    for hints, rocm in ((ROCM, True), ({}, False)):
        edited = apply_kv_cache_group_edits(engine.config, kv, hints)
        pages = opaque_pages_of(next(iter(edited.values())))
        assert pages is not None and not pages.rows_are_tokens
        assert ("rocm-indexer-pages" in pages.layout) is rocm, pages.layout


def test_reads_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    assert not reads_rocm("cuda", {}) and not reads_rocm("cpu", {"attn_backend": "FLASH_ATTN"})
    assert reads_rocm("cpu", {"attn_backend": "rocm_attn"}) and reads_rocm("cpu", ROCM)
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    # a ROCm build's GPU tensors, whatever backend is named (AITER FA calls itself FLASH_ATTN)
    assert reads_rocm("cuda", {}) and reads_rocm("cuda:1", {"attn_backend": "FLASH_ATTN"})
    assert not reads_rocm("cpu", {}) and not reads_rocm("cpu", {"attn_backend": "CPU_ATTN"})


H, D = 2, 64
PLAIN = kvi.FullAttentionSpec(block_size=16, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
SLOTS = dataclasses.replace(PLAIN, num_head_slots=2, state_content_bytes=H * D * 2)  # customize_spec


def _head_slot_reg(name: str, seed: int, hints: dict[str, Any]) -> tuple[dict[str, torch.Tensor], Any]:
    engine = uniform_engine(
        SLOTS, Backend(name, multiple_of=16), num_layers=NL, num_blocks=NB, layout=KVCacheLayout.LBHNC
    )
    kv = _filled(engine, seed)
    return kv, _detect(engine, kv, "edits", {"kv_layout": "HND", **hints})


def test_rocm_attn_and_segmented_pages_do_not_map_into_each_other() -> None:
    _, attn = _head_slot_reg("ROCM_ATTN", 1, {"attn_backend": "ROCM_ATTN"})
    _, seg = _head_slot_reg("ROCM_SEGMENTED_ATTN", 2, {"attn_backend": "ROCM_SEGMENTED_ATTN"})
    with pytest.raises(BlockMapError, match="laid out differently") as err:
        block_map(attn, seg, [1], [2])
    assert "ROCM_ATTN" in str(err.value) and "ROCM_SEGMENTED_ATTN" in str(err.value)


def test_one_rocm_backend_moves_whole_head_slot_pages() -> None:
    hints = {"attn_backend": "ROCM_ATTN"}
    kv_a, a = _head_slot_reg("ROCM_ATTN", 3, hints)
    kv_b, b = _head_slot_reg("ROCM_ATTN", 4, hints)
    before = {name: _pages(t).clone() for name, t in kv_b.items()}
    block_map(a, b, [1, 4], [2, 0], num_tokens=20).copy()
    for name, t in kv_b.items():
        want = before[name]
        for s, d in ((1, 2), (4, 0)):
            want[d] = _pages(kv_a[name])[s]
        assert torch.equal(_pages(t), want), name


@pytest.mark.parametrize("row", [132, 68])
def test_rocm_indexer_is_still_an_indexer_cache(row: int) -> None:
    # LMCache-style callers drop indexer caches before registering: read on ROCm too
    indexer = torch.zeros(NB, 1, 64, row, dtype=torch.uint8)
    latents = torch.zeros(NB, 1, 64, 576, dtype=torch.bfloat16)
    hints = {**ROCM, "kv_dim": 1}
    assert kvlayout.is_indexer_cache(indexer, "vllm", hints)
    assert not kvlayout.is_indexer_cache(latents, "vllm", hints)
    kept = kvlayout.drop_indexer_caches({"mla": latents, "indexer": indexer}, "vllm", hints)
    assert list(kept) == ["mla"]


@pytest.mark.parametrize("shape", [(0, 1, 64, 132), (NB, 1, 0, 132)])
def test_a_rocm_indexer_of_no_pages_is_refused_naming_the_layer(shape: tuple[int, ...]) -> None:
    """Pages of no blocks or no slots hold nothing to move whole: refused by layer."""
    kv = [torch.zeros(*shape, dtype=torch.uint8) for _ in range(NL)]
    with pytest.raises(
        DetectionError,
        match=r"^kv_caches\[0\] \(shape \(\d+, \d+, 132\), .* read as vLLM's DSA indexer on ROCm "
        "holds no pages$",
    ):
        kvlayout.detect(kv, "vllm", ROCM)


def test_rocm_mxfp4_indexer_of_one_slot_blocks_is_whole_pages() -> None:
    # only the fp8 writer keeps one-slot blocks flat (LAYOUT "NORMAL"); MXFP4's page is
    # aiter's cache_format order whatever its slots
    kv = [torch.zeros(NB, 1, 1, 68, dtype=torch.uint8) for _ in range(NL)]
    reg = kvlayout.detect(kv, "vllm", {"attn_backend": "DEEPSEEK_V4_ROCM_MXFP4_INDEXER"})
    pages = reg.kernel_groups[0].opaque_pages
    assert pages is not None and "cache_format" in pages.layout and not pages.rows_are_tokens, reg


@pytest.mark.parametrize(
    ("shape", "dtype", "fmt"),
    [
        ((NB, 1, 64, 132), torch.uint8, F.NL_X_NB_BSV_BSS),  # vLLM 0.33's [pages, 1, N, row]
        ((NB, 64, 132), torch.uint8, F.NL_X_NB_BSV_BSS),  # earlier [pages, N, row]
        ((NB, 1, 64, 68), torch.uint8, F.NL_X_NB_BSV4_BSS4),
        ((NB, 64, 576), torch.bfloat16, None),  # MLA latents: no indexer
        ((NB, 1, 64, 576), torch.bfloat16, None),
        ((NB, 64 * 132), torch.uint8, None),  # rank 2: no registered layer's
    ],
)
def test_indexer_format_names_indexer_rows_only(
    shape: tuple[int, ...], dtype: torch.dtype, fmt: F | None
) -> None:
    assert indexer_format(torch.zeros(*shape, dtype=dtype)) == fmt


def test_head_slot_pages_of_one_backend_map_however_the_hint_is_cased() -> None:
    # the hint is matched case-insensitively (reads_rocm): one backend is one mark
    kv_a, a = _head_slot_reg("ROCM_ATTN", 5, {"attn_backend": "rocm_attn"})
    kv_b, b = _head_slot_reg("ROCM_ATTN", 6, {"attn_backend": "ROCM_ATTN"})
    block_map(a, b, [1], [2]).copy()
    for name, t in kv_b.items():
        assert torch.equal(_pages(t)[2], _pages(kv_a[name])[1]), name
