"""ATOM's fp8 MHA pool with its dequantization scales: ``k_scale`` / ``v_scale`` per layer
``[num_blocks, H, block_size]`` float32 (``mha_kv_scale_fields``), which ATOM's Mooncake
connector registers beside ``k_cache`` / ``v_cache``.

The pool is carved as ATOM's ``MhaKvPool.allocate`` carves it (``carve_layer_major``): one
buffer, the cache region (every layer's K, then every layer's V) then the scale region
(every layer's K scales, then V scales), each field's region 256-byte aligned and each
layer's slice ``[num_blocks, ...]`` contiguous. The oracle addresses a scale as ATOM's
kernels do, by slot: token ``slot`` of a head is ``k_scale[layer][slot // BS, head, slot %
BS]``; every byte of the buffer outside the moved blocks must keep its value.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kvlayout
from kvlayout.detection import DetectionError
from kvlayout.integrations.atom import ShuffledPoolError, shuffled_kv_pools
from kvlayout.transfer import BlockMapError, Shard, block_map

LAYERS, BLOCKS, HEADS, BS, HD = 3, 5, 4, 16, 64
FP8 = torch.float8_e4m3fnuz  # aiter's fp8 on gfx942 (dtypes.d_dtypes["fp8"])
NAMES = ("k", "v", "k_scale", "v_scale")


Field = tuple[str, tuple[int, ...], torch.dtype]


def _align(n: int) -> int:
    return -(-n // 256) * 256


def _carve(buf: torch.Tensor, fields: list[Field], blocks: int) -> dict[str, Any]:
    """``LayerMajorArena.view`` of every field: ``[LAYERS, blocks, *shape]`` over ``buf``."""
    views, offset = {}, 0
    for name, shape, dtype in fields:
        offset = _align(offset)
        per = math.prod(shape)
        typed = buf.view(dtype)
        inner = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        views[name] = typed.as_strided(
            (LAYERS, blocks, *shape),
            (blocks * per, per, *inner),
            typed.storage_offset() + offset * blocks // dtype.itemsize,
        )
        offset += LAYERS * per * dtype.itemsize
    return views


def atom_fp8_pool(seed: int | None, heads: int = HEADS, blocks: int = BLOCKS) -> Any:
    x = 16 // FP8.itemsize
    cache: list[Field] = [("k", (heads, HD // x, BS, x), FP8), ("v", (heads, BS // x, HD, x), FP8)]
    scale: list[Field] = [("k_scale", (heads, BS), torch.float32), ("v_scale", (heads, BS), torch.float32)]
    cache_bytes = _align(_align(LAYERS * heads * HD * BS) + LAYERS * heads * HD * BS) * blocks
    scale_bytes = _align(_align(LAYERS * heads * BS * 4) + LAYERS * heads * BS * 4) * blocks
    buf = torch.zeros(cache_bytes + scale_bytes, dtype=torch.uint8)
    if seed is not None:  # fp8 bytes anything; scales values, never NaN
        gen = torch.Generator().manual_seed(seed)
        buf[:cache_bytes] = torch.randint(0, 256, (cache_bytes,), generator=gen, dtype=torch.uint8)
        buf[cache_bytes:] = torch.rand(scale_bytes // 4, generator=gen).view(torch.uint8)
    views = _carve(buf[:cache_bytes], cache, blocks) | _carve(buf[cache_bytes:], scale, blocks)
    return SimpleNamespace(buf=buf, **{n: list(views[n].unbind(0)) for n in NAMES})


def regs(p: Any) -> dict[str, Any]:
    return shuffled_kv_pools(p.k, p.v, BS, p.k_scale, p.v_scale)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def scale_of(p: Any, name: str, layer: int, head: int, slot: int) -> float:
    """The scale ATOM's kernels read for a token's head: by slot, ``slot // BS`` its block."""
    return float(getattr(p, name)[layer][slot // BS, head, slot % BS])


def test_blocks_and_their_scales_move_whole_between_two_atom_fp8_pools() -> None:
    src, dst = atom_fp8_pool(1), atom_fp8_pool(2)
    before = dst.buf.clone()
    blocks = [(3, 1), (1, 4)]
    a, b = regs(src), regs(dst)
    assert set(a) == set(NAMES)
    for n in NAMES:
        m = block_map(a[n], b[n], [s for s, _ in blocks], [d for _, d in blocks])
        assert m.kind == "same layout" and m.num_tokens == 2 * BS
        m.copy()
    for name in ("k_scale", "v_scale"):
        for layer in range(LAYERS):
            for s, d in blocks:
                for head in range(HEADS):
                    for tok in range(BS):
                        got = scale_of(dst, name, layer, head, d * BS + tok)
                        assert got == scale_of(src, name, layer, head, s * BS + tok), (name, layer, head)
    for n in ("k", "v"):
        for layer in range(LAYERS):
            for s, d in blocks:
                assert torch.equal(raw(getattr(dst, n)[layer][d]), raw(getattr(src, n)[layer][s]))
    # every byte outside the moved blocks, padding and other regions included, keeps its value
    moved = torch.zeros_like(before, dtype=torch.bool)
    base = dst.buf.data_ptr()
    for n in NAMES:
        for layer in range(LAYERS):
            for _, d in blocks:
                block = getattr(dst, n)[layer][d]
                start = block.data_ptr() - base
                moved[start : start + block.numel() * block.element_size()] = True
    assert torch.equal(dst.buf[~moved], before[~moved])
    assert int(moved.sum()) == 2 * LAYERS * 2 * (HEADS * HD * BS + HEADS * BS * 4)


def test_tp1_to_tp2_moves_the_scales_of_the_heads_each_rank_holds() -> None:
    whole = atom_fp8_pool(3)
    half = HEADS // 2
    w = regs(whole)
    for r in range(2):
        dst = atom_fp8_pool(None, heads=half)
        d = regs(dst)
        for n in NAMES:
            m = block_map(w[n], d[n], [2], [3], src_shard=Shard(0, 1, HEADS), dst_shard=Shard(r, 2, HEADS))
            assert m.kind == "resharded state"
            m.copy()
        for name in ("k_scale", "v_scale"):
            for layer in range(LAYERS):
                for head in range(half):
                    for tok in range(BS):
                        want = scale_of(whole, name, layer, r * half + head, 2 * BS + tok)
                        assert scale_of(dst, name, layer, head, 3 * BS + tok) == want
                scales = getattr(dst, name)[layer]
                assert not scales[:3].any() and not scales[4:].any()
        for n in ("k", "v"):
            for layer in range(LAYERS):
                got = raw(getattr(dst, n)[layer][3])
                assert torch.equal(got, raw(getattr(whole, n)[layer][2, r * half : (r + 1) * half]))


def test_scales_map_only_to_scales_of_their_kind() -> None:
    r = regs(atom_fp8_pool(4))
    for src, dst, page in (("k_scale", "v_scale", "k_scale page"), ("v_scale", "k_scale", "v_scale page")):
        with pytest.raises(BlockMapError, match=re.escape(page)):
            block_map(r[src], r[dst], [1], [2])
    with pytest.raises(BlockMapError, match=r"AITER SHUFFLE K page"):
        block_map(r["k"], r["k_scale"], [1], [2])


def test_without_scales_the_pool_reads_as_before() -> None:
    p = atom_fp8_pool(5)
    assert set(shuffled_kv_pools(p.k, p.v, BS)) == {"k", "v"}


def test_refuses_scales_that_are_not_this_pool_s() -> None:
    p = atom_fp8_pool(None)
    k, v, ks, vs = p.k, p.v, p.k_scale, p.v_scale
    cases: list[tuple[Any, Any, str]] = [
        (ks, None, r"k_scales and v_scales come together"),
        (None, vs, r"k_scales and v_scales come together"),
        (ks[0], vs, r"k_scales is Tensor, not a non-empty list of per-layer tensors \(ATOM's"),
        (ks, vs[:2], r"v_scales has 2 layers and k_caches 3"),
        (
            ks,
            [t.to(torch.bfloat16) for t in vs],
            r"v_scales\[0\] is \[5, 4, 16\] torch.bfloat16 .*, not ATOM's fp8",
        ),
        ([t[:, :, :8] for t in ks], vs, r"k_scales\[0\] is \[5, 4, 8\] torch.float32 .* \(5, 4, 16\)"),
        ([t[:, :2] for t in ks], vs, r"k_scales\[0\] is \[5, 2, 16\]"),
        ([t[:4] for t in ks], vs, r"k_scales\[0\] is \[4, 4, 16\]"),
        (
            [t.transpose(1, 2).contiguous().transpose(1, 2) for t in ks],
            vs,
            r"k_scales\[0\] .* is not contiguous",
        ),
        (  # another device's memory: pages of no transfer of this pool
            [torch.empty(t.shape, device="meta") for t in ks],
            vs,
            r"k_scales\[0\] is \[5, 4, 16\] torch.float32 on meta, not ATOM's fp8 .* on cpu",
        ),
    ]
    for kk, vv, message in cases:
        with pytest.raises(ShuffledPoolError, match=message):
            shuffled_kv_pools(k, v, BS, kk, vv)


def test_detect_refuses_scales_naming_the_reader() -> None:
    p = atom_fp8_pool(None)
    for hints in ({}, {"tokens_per_block": BS}):
        with pytest.raises(DetectionError) as e:
            kvlayout.detect(p.k_scale, "atom", hints)
        assert "dequantization scales" in str(e.value)
        assert "shuffled_kv_pools(k_caches, v_caches, block_size, k_scales, v_scales)" in str(e.value)


def test_tp4_over_two_kv_heads_replicates_each_head_to_two_ranks() -> None:
    # MhaKvPool.from_hf_config: heads < world_size gives every rank one head, the model's
    # head rank // (world_size // heads) (QKVParallelLinear's num_kv_head_replicas)
    whole = atom_fp8_pool(6, heads=2)
    w = regs(whole)
    for r in range(4):
        dst = atom_fp8_pool(None, heads=1)
        d = regs(dst)
        for n in NAMES:
            block_map(w[n], d[n], [4], [0], src_shard=Shard(0, 1, 2), dst_shard=Shard(r, 4, 2)).copy()
        for n in NAMES:
            for layer in range(LAYERS):
                got, want = getattr(dst, n)[layer][0], getattr(whole, n)[layer][4, r // 2 : r // 2 + 1]
                assert torch.equal(raw(got), raw(want)), (r, n, layer)
