"""vLLM 0.33 attention pages that are not heads of equal K | V halves, and pages whose
rows are not tokens: each moves whole, between registrations paged alike, or is refused.
They were read as ordinary heads or rows of tokens, and moved wrong bytes with no error."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

import kvlayout
from kvlayout.integrations.vllm import (
    BlockGranularityError,
    apply_kv_cache_group_edits,
)
from kvlayout.registration.peers import RegistrationDescription
from kvlayout.testing.vllm import FLASH_ATTN, Backend, allocate_v033, uniform_engine
from kvlayout.transfer import BlockMapError, Shard, block_map

pytest.importorskip("vllm.v1.kv_cache_interface")
import vllm.v1.kv_cache_interface as kvi
from vllm.v1.kv_cache_layout import KVCacheLayout

NL, H, D, BS, NB = 2, 2, 16, 16, 6


def registered(
    spec: Any, layout: Any, seed: int, backend: Backend = FLASH_ATTN
) -> tuple[Any, dict[str, Any], Any]:
    """A worker's registration, its raw views, and its detection after the group edits."""
    engine = uniform_engine(spec, backend, num_layers=NL, num_blocks=NB, layout=layout)
    buf, kv = allocate_v033(engine)
    buf.copy_(
        torch.randint(-128, 128, buf.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
    )
    hints = {"kv_layout": layout.name}
    edited = apply_kv_cache_group_edits(engine.config, kv, hints)
    return engine, kv, kvlayout.detect(list(edited.values()), "vllm", hints)


def page(view: torch.Tensor, block: int, spec: Any) -> torch.Tensor:
    """Block ``block``'s page, as bytes (its kernel pages in a row)."""
    k = view.shape[0] // NB
    return torch.cat([view[block * k + i].contiguous().view(torch.int8).reshape(-1) for i in range(k)])


def test_head_slot_pages_move_whole_and_only_to_pages_alike() -> None:
    """B12X (and ROCm attention) declare two head slots, every head's K then every V:
    ``[NB, 2, BS, H*D]``. It read as 2 heads of ``K | V`` halves: a map into FlashAttention
    moved half the rows wrong."""
    plain = kvi.FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    b12x = dataclasses.replace(plain, num_head_slots=2, state_content_bytes=H * D * 2)
    _, kv_a, a = registered(b12x, KVCacheLayout.LBHNC, 1)
    _, kv_b, b = registered(b12x, KVCacheLayout.LBHNC, 2)
    _, _, flash = registered(plain, KVCacheLayout.LBNHC, 3)
    before = {n: t.clone() for n, t in kv_b.items()}
    block_map(a, b, [4, 1], [0, 5], num_tokens=BS + 3).copy()  # the last block moves whole
    for name in kv_a:
        assert torch.equal(page(kv_b[name], 0, b12x), page(kv_a[name], 4, b12x))
        assert torch.equal(page(kv_b[name], 5, b12x), page(kv_a[name], 1, b12x))
        for blk in (1, 2, 3, 4):
            assert torch.equal(page(kv_b[name], blk, b12x), page(before[name], blk, b12x))
    with pytest.raises(BlockMapError, match=r"src is opaque pages \(head-slot-pages: .*\) and dst is not"):
        block_map(a, flash, [4], [0])


@pytest.mark.parametrize(
    "packing",
    [
        {"head_size_v": D // 2},  # V narrower than K: C = head_size + head_size_v
        {
            "state_content_bytes": 2 * D * 2 + 2 * 4
        },  # Triton per-token-head: each side's data, then two fp32 scales
    ],
)
def test_packed_head_rows_move_their_tokens_between_pages_alike(packing: dict[str, Any]) -> None:
    """A head's row that is not ``K | V`` of one head size was read as two equal halves,
    splitting K from V (and their scales) in the wrong place. Token-major (NHD), a page's
    rows are still tokens: a partly filled last block moves only its tokens."""
    spec = kvi.FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16, **packing)
    _, kv_a, a = registered(spec, KVCacheLayout.LBNHC, 4)
    _, kv_b, b = registered(spec, KVCacheLayout.LBNHC, 5)
    _, _, hnd = registered(spec, KVCacheLayout.LBHNC, 6)
    before = {n: t.clone() for n, t in kv_b.items()}
    block_map(a, b, [2, 3], [1, 0], num_tokens=BS + 5).copy()
    for name in kv_a:  # [B, H, N, C] views: token t of block b is [b, :, t]
        src, dst, old = (t.view(torch.int16) for t in (kv_a[name], kv_b[name], before[name]))  # NaNs
        assert torch.equal(dst[1], src[2])
        assert torch.equal(dst[0, :, :5], src[3, :, :5]) and torch.equal(dst[0, :, 5:], old[0, :, 5:])
        assert torch.equal(dst[2:], old[2:])
    with pytest.raises(
        BlockMapError, match=r"src and dst are opaque pages laid out differently \(src packed-head-rows: "
    ):
        block_map(a, hnd, [2], [0])


def test_kernel_paged_indexer_pages_move_whole() -> None:
    """DeepSeek-V3.2 at ``--block-size 128``: the DSA indexer pages in 64-token kernel
    pages, each its 64 tokens' values, then their scales. Its rows were taken for tokens,
    so a partly filled last block left its tokens' scales behind."""
    spec = kvi.MLAAttentionSpec(
        block_size=128, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8
    )
    flashmla = Backend("FLASHMLA_SPARSE", fixed_sizes=(64,))
    engine_a, kv_a, a = registered(spec, KVCacheLayout.LBNHC, 7, flashmla)
    _, kv_b, b = registered(spec, KVCacheLayout.LBNHC, 8, flashmla)
    assert engine_a.kernel_block_sizes == [64]
    before = {n: t.clone() for n, t in kv_b.items()}
    block_map(a, b, [3, 1], [2, 4], num_tokens=128 + 70).copy()
    for name in kv_a:
        assert torch.equal(page(kv_b[name], 2, spec), page(kv_a[name], 3, spec))
        assert torch.equal(page(kv_b[name], 4, spec), page(kv_a[name], 1, spec))  # values and scales
        for blk in (0, 1, 3, 5):
            assert torch.equal(page(kv_b[name], blk, spec), page(before[name], blk, spec))


def test_heads_outside_blocks_without_the_hint_are_refused_not_read_as_blocks() -> None:
    """``LHBNC`` puts each layer's heads outside its blocks; read under another hint its
    heads are blocks (2 blocks of 6 heads for 6 blocks of 2), and a map moved head planes."""
    spec = kvi.FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    engine = uniform_engine(spec, FLASH_ATTN, num_layers=NL, num_blocks=NB, layout=KVCacheLayout.LHBNC)
    _, kv = allocate_v033(engine)
    with pytest.raises(
        BlockGranularityError,
        match=r"reads as NL_X_NB_NH_BS_CS with 2 blocks, fewer than the config's num_blocks 6.*"
        r"heads outside blocks need kv_layout='LHBNC'",
    ):
        # HND: the hint these CPU tensors stand in for (without one they read as CPU_ATTN's pages)
        apply_kv_cache_group_edits(engine.config, kv, {"kv_layout": "HND"})


def test_heads_outside_blocks_map_to_any_layout() -> None:
    """``LHBNC`` (ROCm's AITER backends list it) read as its blocks, heads outside them:
    a request moves into an NHD cache token by token, head by head (it was refused)."""
    spec = kvi.FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    _, kv_a, a = registered(spec, KVCacheLayout.LHBNC, 11)
    _, kv_b, b = registered(spec, KVCacheLayout.LBNHC, 12)
    assert a.only_group().format is kvlayout.EngineKVFormat.NL_X_NH_NB_BS_CS
    assert a.only_group().opaque_pages is None
    before = {n: t.clone() for n, t in kv_b.items()}
    m = block_map(a, b, [4, 1], [0, 5], num_tokens=BS + 3)
    assert m.num_runs == NL * (H * BS + H * 3)  # one run per token and head: NHD interleaves heads
    m.copy()
    for name in kv_a:  # both are vLLM's logical [B, H, N, C] views
        src, dst, old = (t.view(torch.int16) for t in (kv_a[name], kv_b[name], before[name]))
        assert torch.equal(dst[0], src[4])
        assert torch.equal(dst[5, :, :3], src[1, :, :3]) and torch.equal(dst[5, :, 3:], old[5, :, 3:])
        assert torch.equal(dst[1:5], old[1:5])


def test_head_slots_outside_the_blocks_move_whole_per_slot() -> None:
    """ROCm attention's first choice, LHBNC: the K slot of every block, then the V slot. A
    block is two runs, moved whole per slot between caches paged alike; it was refused."""
    plain = kvi.FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    rocm = dataclasses.replace(plain, num_head_slots=2, state_content_bytes=H * D * 2)
    _, kv_a, a = registered(rocm, KVCacheLayout.LHBNC, 13)
    _, kv_b, b = registered(rocm, KVCacheLayout.LHBNC, 14)
    _, _, block_compact = registered(rocm, KVCacheLayout.LBHNC, 15)
    pages = a.only_group().opaque_pages
    assert pages is not None and not pages.rows_are_tokens
    before = {n: t.clone() for n, t in kv_b.items()}
    m = block_map(a, b, [4, 1], [0, 5], num_tokens=BS + 3)  # the last block moves whole
    assert m.num_runs == NL * 2 * 2  # a run per layer, slot and block
    m.copy()
    for name in kv_a:  # [B, slot, N, C]: block b's slot s is [b, s]
        src, dst, old = kv_a[name], kv_b[name], before[name]
        assert torch.equal(dst[0].view(torch.int16), src[4].view(torch.int16))
        assert torch.equal(dst[5].view(torch.int16), src[1].view(torch.int16))
        assert torch.equal(dst[1:5].view(torch.int16), old[1:5].view(torch.int16))
    with pytest.raises(BlockMapError, match=r"src and dst are opaque pages laid out differently"):
        block_map(a, block_compact, [4], [0])
    with pytest.raises(
        BlockMapError, match=rf"num_tokens={BS + 1} rounded up to whole opaque pages\) fill 2"
    ):
        block_map(a, b, [4], [0], num_tokens=BS + 1)


def test_head_slots_outside_the_blocks_take_the_model_shard() -> None:
    """The slot axis is no head axis: a ROCm worker at TP 2 passes its real shard (H of
    2H heads) to maps and descriptions, which counted the 2 slots as its heads."""
    heads = 4  # this rank's, beside the 2 slots
    plain = kvi.FullAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=D, dtype=torch.bfloat16)
    rocm = dataclasses.replace(plain, num_head_slots=2, state_content_bytes=heads * D * 2)
    _, kv_a, a = registered(rocm, KVCacheLayout.LHBNC, 18)
    _, kv_b, b = registered(rocm, KVCacheLayout.LHBNC, 19)
    rank1, rank0 = kvlayout.transfer.Shard(1, 2, 2 * heads), kvlayout.transfer.Shard(0, 2, 2 * heads)
    peer = kvlayout.transfer.RegistrationDescription.from_json(a.describe(shard=rank1).to_json())
    m = block_map(peer, b, [3], [2], dst_shard=rank1)
    assert m.num_bytes == NL * 2 * BS * heads * D * 2  # both slots of every layer
    block_map(a, b, [3], [2], src_shard=rank1, dst_shard=rank1).copy()
    for name in kv_a:
        assert torch.equal(kv_b[name][2].view(torch.int16), kv_a[name][3].view(torch.int16))
    with pytest.raises(
        BlockMapError, match=r"src and dst are opaque pages of .* maps only to the same rank's"
    ):
        block_map(a, b, [3], [2], src_shard=rank1, dst_shard=rank0)


def test_packed_head_rows_outside_the_blocks_move_their_tokens() -> None:
    """Under LHBNC a head's page is its tokens in order: a partly filled last block moves
    only its tokens' rows, per head."""
    spec = kvi.FullAttentionSpec(
        block_size=BS, num_kv_heads=H, head_size=D, head_size_v=D // 2, dtype=torch.bfloat16
    )
    _, kv_a, a = registered(spec, KVCacheLayout.LHBNC, 16)
    _, kv_b, b = registered(spec, KVCacheLayout.LHBNC, 17)
    pages = a.only_group().opaque_pages
    assert pages is not None and pages.rows_are_tokens
    before = {n: t.clone() for n, t in kv_b.items()}
    block_map(a, b, [2, 3], [1, 0], num_tokens=BS + 5).copy()
    for name in kv_a:
        src, dst, old = (t.view(torch.int16) for t in (kv_a[name], kv_b[name], before[name]))
        assert torch.equal(dst[1], src[2])
        assert torch.equal(dst[0, :, :5], src[3, :, :5]) and torch.equal(dst[0, :, 5:], old[0, :, 5:])
        assert torch.equal(dst[2:], old[2:])
    from kvlayout.transfer.block_maps import chunk_shape_for

    shape, _ = chunk_shape_for(a.only_group(), BS + 5)  # rows are tokens: the request's, not whole pages
    assert shape[2] == BS + 5


def test_layers_holding_more_blocks_than_num_blocks_are_accepted() -> None:
    """Releases that set num_blocks to the least over ranks keep their tensors whole, and
    HiSparse's host group has blocks of its own: only fewer blocks mean a misread."""
    spec = kvi.FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    engine = uniform_engine(spec, FLASH_ATTN, num_layers=NL, num_blocks=NB, layout=KVCacheLayout.LBNHC)
    _, kv = allocate_v033(engine)
    engine.config.num_blocks = NB - 2  # another rank had less memory
    out = apply_kv_cache_group_edits(engine.config, kv, {"kv_layout": "NHD"})
    assert kvlayout.detect(list(out.values()), "vllm", {"kv_layout": "NHD"}).only_group().num_blocks == NB


def _dsv4_fp8_ds_mla(**kw: Any) -> Any:
    """DeepSeek-V4's ``fp8_ds_mla`` caches: 584-byte records (448 fp8 NoPE, 128 bf16 RoPE,
    8 scale bytes) laid out as every slot's 576 data bytes, then every slot's scales."""
    return dict(
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=512,
        dtype=torch.uint8,
        cache_dtype_str="fp8_ds_mla",
        state_content_bytes=584,
        alignment=576,
        model_version="deepseek_v4",
        **kw,
    )


DSV4_SPECS = [
    kvi.SlidingWindowMLASpec(block_size=64, sliding_window=128, **_dsv4_fp8_ds_mla()),  # its SWA cache
    kvi.MLAAttentionSpec(block_size=256, tokens_per_state=4, **_dsv4_fp8_ds_mla()),  # its C4 cache
]


@pytest.mark.parametrize("spec", DSV4_SPECS, ids=["swa", "compressed"])
def test_deepseek_v4_paged_scale_pages_move_whole(spec: Any) -> None:
    """DeepSeek-V4 with ``fp8_ds_mla`` registers ``[pages, 1, 64, 584]`` uint8, but slot
    ``p``'s data is at ``p * 576`` and its scales at ``64 * 576 + p * 8``. Read as rows of
    slots, a partly filled last block moved rows that are not its slots' records and left
    their scales behind."""
    swa = Backend("DEEPSEEK_SPARSE_SWA", multiple_of=32)
    _, kv_a, a = registered(spec, KVCacheLayout.LBNHC, 9, swa)
    _, kv_b, b = registered(spec, KVCacheLayout.LBNHC, 10, swa)
    (group,) = a.kernel_groups
    assert group.opaque_pages is not None and not group.opaque_pages.rows_are_tokens
    assert group.block_size == 64
    before = {n: t.clone() for n, t in kv_b.items()}
    block_map(a, b, [3, 1], [0, 4], num_tokens=64 + 10).copy()  # the last block moves whole
    for name in kv_a:
        assert torch.equal(page(kv_b[name], 0, spec), page(kv_a[name], 3, spec))
        assert torch.equal(page(kv_b[name], 4, spec), page(kv_a[name], 1, spec))  # records and scales
        for blk in (1, 2, 3, 5):
            assert torch.equal(page(kv_b[name], blk, spec), page(before[name], blk, spec))
    latent = kvi.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    _, _, plain = registered(latent, KVCacheLayout.LBNHC, 11)
    with pytest.raises(BlockMapError, match=r"src is opaque pages \(paged-scale-mla: .*\) and dst is not"):
        block_map(a, plain, [3], [0])


def _moves_between_ranks(spec: Any, backend: Backend, kernel_pages: int) -> None:
    """Pages of one head every rank holds whole map between any two ranks, as from a
    description, byte-exact, a partly filled last block whole, whatever the shards say of
    the model's KV heads (as an MLA cache's latents do): ``Shard(r, tp, tp)``, one head a
    rank, gave an empty map, moving nothing."""
    _, kv_a, a = registered(spec, KVCacheLayout.LBNHC, 21, backend)
    assert len(next(iter(kv_a.values()))) == NB * kernel_pages  # the kernel pages of a block
    (group,) = a.kernel_groups
    pages = group.opaque_pages
    assert pages is not None and len(pages.arrays) == 1 and pages.arrays[0].replicated
    raw = next(iter(kv_a.values()))
    assert pages.arrays_end == kernel_pages * raw[0].numel() * raw.element_size()  # a block's kernel pages
    shards = [
        (Shard(0, 2, 1), Shard(1, 2, 1)),
        (Shard(0, 1, 1), Shard(3, 4, 1)),
        (Shard(0, 2, 2), Shard(1, 2, 2)),  # one head a rank, each its own: what an MHA page would say
        (Shard(5, 8, 128), Shard(13, 16, 128)),  # the model's attention heads
    ]
    for seed, (src_shard, dst_shard) in enumerate(shards, start=22):
        _, kv_b, b = registered(spec, KVCacheLayout.LBNHC, seed, backend)
        before = {n: t.clone() for n, t in kv_b.items()}
        peer = RegistrationDescription.from_json(b.describe(shard=dst_shard).to_json())
        tokens = group.block_size + group.block_size // 2  # in slots, as the view is
        described = block_map(a, peer, [3, 1], [0, 4], num_tokens=tokens, src_shard=src_shard)
        assert described.num_bytes == 2 * len(kv_a) * kernel_pages * raw[0].numel() * raw.element_size()
        block_map(a, b, [3, 1], [0, 4], num_tokens=tokens, src_shard=src_shard, dst_shard=dst_shard).copy()
        for name in kv_a:
            assert torch.equal(page(kv_b[name], 0, spec), page(kv_a[name], 3, spec))
            assert torch.equal(page(kv_b[name], 4, spec), page(kv_a[name], 1, spec))  # the last one whole
            for blk in (1, 2, 3, 5):
                assert torch.equal(page(kv_b[name], blk, spec), page(before[name], blk, spec))


@pytest.mark.parametrize("spec", DSV4_SPECS, ids=["swa", "compressed"])
def test_deepseek_v4_paged_scale_pages_move_between_tp_ranks(spec: Any) -> None:
    """DeepSeek-V4's latents are one head every TP rank holds whole (MLA), so prefill at
    TP 8 maps to decode at TP 16: a map between two ranks' pages was refused. (vLLM
    pages them one kernel page a block: its 576-byte alignment pads the block.)"""
    _moves_between_ranks(spec, Backend("DEEPSEEK_SPARSE_SWA", multiple_of=32), 1)


def test_kernel_paged_indexer_pages_move_between_tp_ranks() -> None:
    """The DSA indexer's key is one head every rank holds whole (vLLM's indexer ``wk`` is
    replicated): its kernel-paged pages map between any two ranks."""
    spec = kvi.MLAAttentionSpec(
        block_size=128, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8
    )
    _moves_between_ranks(spec, Backend("FLASHMLA_SPARSE", fixed_sizes=(64,)), 2)


@pytest.mark.parametrize(
    ("record", "version", "dtype_str"),
    [(656, None, "fp8_ds_mla"), (528, "deepseek_v4", "fp8_ds_mla"), (288, "deepseek_v4", "nvfp4_ds_mla")],
    ids=["v3.2", "v4.1", "v4.1-nvfp4"],
)
def test_interleaved_ds_mla_records_stay_tokens(record: int, version: str | None, dtype_str: str) -> None:
    """DeepSeek-V3.2's 656-byte records and V4.1's 528- and 288-byte ones (V4.1 keeps V4's
    ``model_version``) hold each token's record whole, its scales after its data: no edit."""
    from kvlayout.integrations.vllm import find_kv_cache_group_edit

    spec = kvi.MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        head_size=576,
        dtype=torch.uint8,
        cache_dtype_str=dtype_str,
        state_content_bytes=record,
        model_version=version,
    )
    engine = uniform_engine(spec, Backend("FLASHMLA_SPARSE", fixed_sizes=(64,)), num_layers=NL, num_blocks=NB)
    _, kv = allocate_v033(engine)
    assert find_kv_cache_group_edit(spec, next(iter(kv.values()))) is None


def test_whole_pages_map_only_to_pages_of_the_same_size() -> None:
    """Pages whose rows are no tokens move whole, so a peer's pages laid out alike (its
    description names the same page layout) in blocks of another size are refused, not
    copied a page of one size into a page of the other."""
    plain = kvi.FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    b12x = dataclasses.replace(plain, num_head_slots=2, state_content_bytes=H * D * 2)
    _, _, a = registered(b12x, KVCacheLayout.LBHNC, 1)
    _, _, b = registered(dataclasses.replace(b12x, block_size=2 * BS), KVCacheLayout.LBHNC, 2)
    wire = json.loads(b.describe().to_json())
    wire["groups"][0]["opaque_pages"]["layout"] = a.only_group().opaque_pages.layout
    peer = RegistrationDescription.from_json(json.dumps(wire))
    with pytest.raises(
        BlockMapError,
        match=rf"^src and dst are opaque pages in blocks of {BS} and {2 * BS} rows: whole pages map only to "
        r"pages of the same size",
    ):
        block_map(a, peer, [0], [0])
