"""vLLM's ``LHBNC`` (heads outside blocks, ROCm attention's first choice): read as
``NL_X_NH_NB_BS_CS``, whose blocks are one run per head, and served like any layout.
Before, the hint was refused and the layout could not be registered."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout.transfer import block_map, prepare

L, B, H, N, C = 3, 5, 4, 8, 16


def lhbnc(seed: int, heads: int = H, blocks: int = B) -> list[torch.Tensor]:
    """vLLM 0.33's registration: ``[B, H, N, C]`` views of ``[H, B, N, C]`` memory."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(heads, blocks, N, C, generator=g).permute(1, 0, 2, 3) for _ in range(L)]


@pytest.mark.parametrize(
    "hints",
    [{"kv_layout": "LHBNC"}, {"num_kv_heads": H, "tokens_per_block": N}, {"num_kv_heads": H}],
    ids=["hint", "size hints", "heads alone"],
)
def test_the_hint_or_the_sizes_read_heads_outside_blocks(hints: dict[str, int | str]) -> None:
    """Without a kv_layout hint, size hints that only the LHBNC reading fits settle it."""
    reg = kvlayout.detect(lhbnc(0), "vllm", hints)
    group = reg.only_group()
    assert group.format is F.NL_X_NH_NB_BS_CS
    assert (group.num_blocks, group.block_size, group.descriptor().nh) == (B, N, H)


def test_its_chunk_holds_the_bytes_of_the_same_cache_laid_out_hnd() -> None:
    """A chunk is layout-free: storing blocks of an LHBNC cache gives LMCache's chunk of
    the same data in vLLM's HND layout (format 12)."""
    kv = lhbnc(1)
    hnd = [t.contiguous() for t in kv]  # the same logical [B, H, N, C], heads inside blocks
    a = prepare(kvlayout.detect(kv, "vllm", {"kv_layout": "LHBNC"}))
    b = prepare(kvlayout.detect(hnd, "vllm", {"kv_layout": "HND"}))
    shape, dtype = a.chunk_shape(2 * N)
    got, want = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
    a.store_blocks([3, 1], [got])
    b.store_blocks([3, 1], [want])
    assert torch.equal(got, want)
    for t in kv:
        t.zero_()
    a.load_blocks([4, 0], [want])
    for layer, t in enumerate(kv):
        assert torch.equal(t[4], hnd[layer][3]) and torch.equal(t[0], hnd[layer][1])
        assert not t[1:4].any()


def test_a_map_moves_one_run_per_head_and_block() -> None:
    """Between two LHBNC caches a block is H runs; consecutive blocks merge per head."""
    src_kv = lhbnc(2)
    src = kvlayout.detect(src_kv, "vllm", {"kv_layout": "LHBNC"})
    dst_kv = [torch.zeros(H, B, N, C).permute(1, 0, 2, 3) for _ in range(L)]
    dst = kvlayout.detect(dst_kv, "vllm", {"kv_layout": "LHBNC"})
    scattered = block_map(src, dst, [0, 2], [4, 1], num_tokens=2 * N)
    assert scattered.num_runs == L * H * 2
    consecutive = block_map(src, dst, [1, 2], [3, 4], num_tokens=2 * N)
    assert consecutive.num_runs == L * H
    consecutive.copy()
    for s, d in zip(src_kv, dst_kv, strict=True):
        assert torch.equal(d[3:5], s[1:3]) and not d[:3].any()


def test_one_head_reads_as_heads_inside() -> None:
    """With one head (TP = KV heads) LHBNC is LBHNC's memory: read as heads inside."""
    group = kvlayout.detect(lhbnc(4, heads=1), "vllm", {"kv_layout": "LHBNC"}).only_group()
    assert group.format is F.NL_X_NB_NH_BS_CS
    assert (group.num_blocks, group.descriptor().nh) == (B, 1)


def test_one_block_of_several_heads_needs_num_kv_heads() -> None:
    """One block of H heads is, in memory order, the shape of H blocks of one head; the
    head count tells them apart, and a contradicting one is refused, not misread."""
    kv = lhbnc(5, blocks=1)
    group = kvlayout.detect(kv, "vllm", {"kv_layout": "LHBNC", "num_kv_heads": H}).only_group()
    assert group.format is F.NL_X_NH_NB_BS_CS
    assert (group.num_blocks, group.descriptor().nh) == (1, H)
    with pytest.raises(kvlayout.LayoutHintError, match="num_kv_heads=3"):
        kvlayout.detect(kv, "vllm", {"kv_layout": "LHBNC", "num_kv_heads": 3})


def test_blocks_of_one_token_need_the_size_hints_and_the_refusal_says_so() -> None:
    """A block of one token puts a size-1 dim beside the heads, whose stride says nothing:
    read as the wrong axis, the strides do not fit, and the message names the way out
    (it named the heads dim BS and stopped there)."""
    kv = [torch.randn(H, B, 1, C).permute(1, 0, 2, 3) for _ in range(L)]  # [B, H, 1, C] of [H, B, 1, C]
    with pytest.raises(kvlayout.DetectionError) as err:
        kvlayout.detect(kv, "vllm", {"kv_layout": "LHBNC"})
    assert str(err.value).endswith(
        "may be another axis than the one it was read as: the size hints (num_kv_heads, tokens_per_block) "
        "say which"
    )
    hinted = kvlayout.detect(kv, "vllm", {"kv_layout": "LHBNC", "num_kv_heads": H, "tokens_per_block": 1})
    group = hinted.only_group()
    assert (group.format, group.num_blocks, group.block_size, group.descriptor().nh) == (
        F.NL_X_NH_NB_BS_CS,
        B,
        1,
        H,
    )


@pytest.mark.parametrize(
    ("engine", "kv"),
    [
        ("sglang", [torch.zeros(24, 4, 16) for _ in range(4)]),
        ("trtllm", torch.zeros(2, 3, 2, 4, 8, 16)),
    ],
)
def test_other_engines_refuse_the_hint(engine: str, kv: Any) -> None:
    """No other engine lays heads outside blocks: the hint is a contradiction, not a
    reading to guess around."""
    with pytest.raises(
        kvlayout.LayoutHintError,
        match=f"kv_layout='LHBNC' puts heads outside blocks, in an order no {engine} format has",
    ):
        kvlayout.normalize_kv_and_discover_format(kv, engine, {"kv_layout": "LHBNC"})


def test_a_layer_past_2_gib_prepares_and_moves_its_blocks() -> None:
    """A head's blocks span most of a layer, so a copy's step between heads outgrew the
    plan's 31-bit strides once a layer passed about 2.29 GiB (Llama-3.1-8B on an H200):
    ``prepare`` raised a bare ValueError. The plan now cuts such a copy per head. The
    cache is reserved, not touched: only the moved blocks are written."""
    heads, blocks, cs = 8, 80_000, 256  # 2.4 GiB a layer in bf16 (8-token blocks)
    cache = torch.empty(heads, blocks, N, cs, dtype=torch.bfloat16)
    ids = [5, blocks - 1, 20_000, 7]
    g = torch.Generator().manual_seed(6)
    for b in ids:
        cache[:, b] = torch.randn(heads, N, cs, generator=g)
    logical = cache.permute(1, 0, 2, 3)
    want = torch.stack([logical[b] for b in ids])
    plan = prepare(kvlayout.detect([logical], "vllm", {"kv_layout": "LHBNC"}))
    shape, dtype = plan.chunk_shape(len(ids) * N)
    chunk = torch.empty(shape, dtype=dtype)
    plan.store_blocks(ids, [chunk])
    assert torch.equal(chunk.view(len(ids), N, heads, cs).permute(0, 2, 1, 3), want)
    for b in ids:
        cache[:, b] = 0
    plan.load_blocks([ids[1], 3, 1, ids[0]], [chunk])
    assert torch.equal(logical[ids[1]], want[0]) and torch.equal(logical[3], want[1])
    assert torch.equal(logical[ids[0]], want[3]) and not logical[ids[2]].any()
