"""ATOM's MHA/GQA KV pool in AITER's SHUFFLE layout: blocks between two pools, between TP
degrees, to and from SGLang's ``vectorized_5d`` pool (the same AITER bytes), and the
refusals.

The pool is built as ATOM's ``MhaKvPool`` lays it out: one layer-major allocation, every
layer's K ``[NB, H, D // X, BS, X]`` then every layer's V ``[NB, H, BS // X, D, X]``. The
oracle reads those 5-D tensors only (a block of a layer is ``k[l][block]``, a rank's heads
its axis 1); every byte outside the moved blocks must keep its value.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kvlayout
from kvlayout import EngineType
from kvlayout.detection import DetectionError
from kvlayout.integrations.atom import ShuffledPoolError, shuffled_kv_pools
from kvlayout.integrations.sglang import vectorized_kv_pools
from kvlayout.testing.sglang import vectorized_kv_pool
from kvlayout.transfer import BlockMapError, Shard, block_map

LAYERS, BLOCKS, HEADS, BS, HD = 3, 5, 4, 16, 64


def atom_pool(
    seed: int | None, heads: int = HEADS, dtype: torch.dtype = torch.bfloat16, blocks: int = BLOCKS
) -> Any:
    """ATOM's layer-major arena: K of every layer, then V, per-layer views of one buffer."""
    x = 16 // dtype.itemsize
    k_shape = (blocks, heads, HD // x, BS, x)
    v_shape = (blocks, heads, BS // x, HD, x)
    per = blocks * heads * HD * BS
    gen = torch.Generator().manual_seed(seed or 0)
    if seed is None:
        buf = torch.zeros(2 * LAYERS * per * dtype.itemsize, dtype=torch.uint8)
    elif dtype.itemsize > 1:  # values, not bit patterns: no NaN
        buf = torch.randn(2 * LAYERS * per, generator=gen).to(dtype).view(torch.uint8)
    else:
        buf = torch.randint(0, 256, (2 * LAYERS * per,), generator=gen, dtype=torch.uint8)
    typed = buf.view(dtype)
    k = [typed[i * per : (i + 1) * per].view(k_shape) for i in range(LAYERS)]
    v = [typed[(LAYERS + i) * per : (LAYERS + i + 1) * per].view(v_shape) for i in range(LAYERS)]
    return SimpleNamespace(k_caches=k, v_caches=v, block_size=BS, buf=buf)


def lists(p: Any) -> dict[str, list[torch.Tensor]]:
    return {"k": p.k_caches, "v": p.v_caches}


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def regs(p: Any) -> dict[str, Any]:
    return shuffled_kv_pools(p.k_caches, p.v_caches, p.block_size)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fnuz], ids=str)
def test_blocks_move_whole_between_two_atom_pools(dtype: torch.dtype) -> None:
    src, dst = atom_pool(1, dtype=dtype), atom_pool(2, dtype=dtype)
    before = raw(dst.buf).clone()
    want = {n: [t.clone() for t in ts] for n, ts in lists(dst).items()}
    blocks = [(3, 1), (1, 4)]
    a, b = regs(src), regs(dst)
    for n in ("k", "v"):
        m = block_map(a[n], b[n], [s for s, _ in blocks], [d for _, d in blocks])
        assert m.kind == "same layout" and m.num_tokens == 2 * BS
        m.copy()
    for n, ts in lists(dst).items():
        for layer, t in enumerate(ts):
            for s, d in blocks:
                want[n][layer][d] = lists(src)[n][layer][s]
            assert torch.equal(raw(t), raw(want[n][layer])), (n, layer)
    # untouched blocks keep their bytes
    moved = torch.zeros_like(before, dtype=torch.bool)
    itemsize = dtype.itemsize
    per_block = HEADS * HD * BS * itemsize
    for i in range(2 * LAYERS):
        for _, d in blocks:
            start = (i * BLOCKS + d) * per_block
            moved[start : start + per_block] = True
    assert torch.equal(raw(dst.buf)[~moved], before[~moved])


def test_tp1_to_tp2_moves_the_heads_each_rank_holds() -> None:
    whole = atom_pool(3, heads=HEADS)
    ranks = [atom_pool(None, heads=HEADS // 2) for _ in range(2)]
    w = regs(whole)
    for r, dst in enumerate(ranks):
        d = regs(dst)
        for n in ("k", "v"):
            m = block_map(w[n], d[n], [2], [3], src_shard=Shard(0, 1, HEADS), dst_shard=Shard(r, 2, HEADS))
            assert m.kind == "resharded state"
            m.copy()
        half = HEADS // 2
        for n, ts in lists(dst).items():
            for layer, t in enumerate(ts):
                assert torch.equal(raw(t[3]), raw(lists(whole)[n][layer][2, r * half : (r + 1) * half]))
                assert not raw(t[:3]).any() and not raw(t[4:]).any()
    # and back: rank 1's heads into the whole pool's block 0, the other heads untouched
    back = atom_pool(None, heads=HEADS)
    m = block_map(
        regs(ranks[1])["k"],
        regs(back)["k"],
        [3],
        [0],
        src_shard=Shard(1, 2, HEADS),
        dst_shard=Shard(0, 1, HEADS),
    )
    m.copy()
    for layer in range(LAYERS):
        assert torch.equal(raw(back.k_caches[layer][0, 2:]), raw(ranks[1].k_caches[layer][3]))
        assert not raw(back.k_caches[layer][0, :2]).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_atom_and_sglang_vectorized_pools_map_to_each_other(dtype: torch.dtype) -> None:
    atom = atom_pool(4, dtype=dtype)
    sgl = vectorized_kv_pool(LAYERS, (BLOCKS - 1) * BS, HEADS, HD, page_size=BS, dtype=dtype)
    a = regs(atom)
    s = vectorized_kv_pools(sgl.k_buffer, sgl.v_buffer, sgl.page_size)
    for n in ("k", "v"):  # one reader, each pool labelled as its engine's
        assert (a[n].engine, s[n].engine) == (EngineType.ATOM, EngineType.SGLANG)
        assert (a[n].describe().engine, s[n].describe().engine) == ("atom", "sglang")
        block_map(a[n], s[n], [4, 1], [2, 3]).copy()
    for n, ts in (("k", sgl.k_buffer), ("v", sgl.v_buffer)):
        for layer, t in enumerate(ts):
            assert torch.equal(raw(t[2]), raw(lists(atom)[n][layer][4]))
            assert torch.equal(raw(t[3]), raw(lists(atom)[n][layer][1]))
            assert not raw(t[0]).any() and not raw(t[1]).any() and not raw(t[4]).any()
    # and back, SGLang into ATOM
    again = atom_pool(None, dtype=dtype)
    for n in ("k", "v"):
        block_map(s[n], regs(again)[n], [2], [0]).copy()
    for n in ("k", "v"):
        for layer in range(LAYERS):
            assert torch.equal(raw(lists(again)[n][layer][0]), raw(lists(atom)[n][layer][4]))


def test_k_never_maps_into_v() -> None:
    # D == block_size: K and V blocks hold as many bytes
    p = atom_pool(5)
    r = regs(p)
    with pytest.raises(BlockMapError, match=r"AITER SHUFFLE K page"):
        block_map(r["k"], r["v"], [1], [2])
    with pytest.raises(BlockMapError, match=r"AITER SHUFFLE V page"):
        block_map(r["v"], r["k"], [1], [2])


@pytest.mark.parametrize(
    "spelling",
    [
        lambda p: [[k, v] for k, v in zip(p.k_caches, p.v_caches, strict=True)],
        lambda p: p.k_caches + p.v_caches,
        lambda p: p.k_caches,
    ],
    ids=["pairs", "flat", "k only"],
)
@pytest.mark.parametrize("hints", [{}, {"tokens_per_block": BS}], ids=["no hints", "block size"])
def test_detect_names_the_integration(spelling: Any, hints: dict[str, Any]) -> None:
    kv = spelling(atom_pool(None))
    with pytest.raises(DetectionError) as e:
        kvlayout.detect(kv, "atom", hints)
    text = str(e.value)
    assert "shuffled_kv_pools(k_caches, v_caches, block_size)" in text
    assert "registers a list of tensors of rank 3" not in text


def test_refuses_lists_that_are_not_an_atom_shuffle_pool() -> None:
    p = atom_pool(None)
    k, v = p.k_caches, p.v_caches
    plain_v = [torch.zeros(BLOCKS, HEADS, HD, BS, dtype=torch.bfloat16) for _ in range(LAYERS)]
    cases: list[tuple[Any, Any, Any, str]] = [
        (k[0], v, BS, r"k_caches is Tensor, not a non-empty list of per-layer tensors \(ATOM's"),
        (k, [], BS, r"v_caches is list, not a non-empty list"),
        (k, v[:2], BS, r"k_caches has 3 layers and v_caches 2"),
        (k, plain_v, BS, r"v_caches\[0\] is \[5, 4, 64, 16\]: a non-transposed V"),
        ([t[..., 0] for t in k], v, BS, r"k_caches\[0\] is \[5, 4, 8, 16\], not 5-D: the ATOM SHUFFLE"),
        (k, [t.float() for t in v], BS, r"k_caches is torch.bfloat16 .* and v_caches torch.float32"),
        (
            k,
            [t.to("meta") for t in v],
            BS,
            r"k_caches is torch.bfloat16 on cpu and v_caches torch.bfloat16 on meta",
        ),
        # every layer alike, and each a tensor
        (
            [k[0], k[1].to("meta"), k[2]],
            v,
            BS,
            r"k_caches\[1\] is .* torch.bfloat16 on meta and k_caches\[0\] .*: every",
        ),
        (
            [k[0], k[1].view(torch.float16), k[2]],
            v,
            BS,
            r"k_caches\[1\] is .* torch.float16 on cpu and k_caches\[0\]",
        ),
        (k, [*v[:2], "v"], BS, r"v_caches\[2\] is str, not a tensor"),
        # a 4-D V names the draft builder's V only beside a SHUFFLE K
        ([t[..., 0] for t in k], plain_v, BS, r"k_caches\[0\] is \[5, 4, 8, 16\], not 5-D"),
        (k, [t[:, :2] for t in v], BS, r"not one ATOM SHUFFLE MHA pool"),
        # V alone of other blocks, token vectors or vector width than K says
        (
            k,
            [t[:3] for t in v],
            BS,
            r"v_caches\[0\] \[3, 4, 2, 64, 8\], not .* = \(5, 4, 2, D_v, 8\): not one",
        ),
        (
            k,
            [t[:, :, :1] for t in v],
            BS,
            r"v_caches\[0\] \[5, 4, 1, 64, 8\], not .* = \(5, 4, 2, D_v, 8\): not one",
        ),
        (
            k,
            [t[..., :4] for t in v],
            BS,
            r"v_caches\[0\] \[5, 4, 2, 64, 4\] end in 8 and 4, not X = 16 // 2 = 8",
        ),
        ([t[::2] for t in k], [t[::2] for t in v], BS, r"not contiguous pages, one after another, as ATOM"),
        (k, v, 32, r"block_size is 32, but k_caches\[0\] .* holds pages of 16 tokens"),
        (k, v, True, r"block_size is True"),
    ]
    for kk, vv, bs, message in cases:
        with pytest.raises(ShuffledPoolError, match=message):
            shuffled_kv_pools(kk, vv, bs)
    assert issubclass(ShuffledPoolError, DetectionError)


def test_each_layer_is_registered_at_its_own_tensor() -> None:
    """Layer ``l`` of each registration is ``k_caches[l]`` / ``v_caches[l]``: what a
    connector registers for RDMA and addresses a layer's blocks by (the oracle: the tensors)."""
    p = atom_pool(6)
    r = regs(p)
    for n, ts in lists(p).items():
        assert r[n].data_ptrs(range(LAYERS)) == [t.data_ptr() for t in ts], n


def test_a_pool_of_a_dtype_kvlayout_does_not_know_is_refused_by_name() -> None:
    k = [torch.zeros(BLOCKS, HEADS, HD, BS, 1, dtype=torch.complex128)]  # X = 16 // 16 = 1
    v = [torch.zeros(BLOCKS, HEADS, BS, HD, 1, dtype=torch.complex128)]
    with pytest.raises(
        ShuffledPoolError, match=r"^the pool's dtype is complex128, which kvlayout does not know$"
    ):
        shuffled_kv_pools(k, v, BS)


def test_a_layer_re_allocated_after_detection_is_refused() -> None:
    """Each layer's pages are watched as that layer's tensor: ATOM re-allocating one
    (``t.data = new``) fails the next copy, which would move the old memory's bytes."""
    p = atom_pool(7)
    r, other = regs(p), regs(atom_pool(8))
    p.k_caches[1].data = torch.zeros_like(p.k_caches[1])
    with pytest.raises(
        BlockMapError, match=r"^src: kv_caches\[1\]'s tensor .* was re-allocated after detection"
    ):
        block_map(r["k"], other["k"], [1], [2]).copy()
