"""SGLang's ROCm AITER ``vectorized_5d`` KV pool: a request's pages between two pools,
between TP degrees, and through a peer's description.

The oracle reads the 5-D tensors only: a page of a layer is ``k_buffer[l][page]``
(``(H, D // X, page_size, X)``), a rank's heads its axis 0. It knows nothing of rows,
page arrays or runs; every byte outside the moved pages must keep its value.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import kvlayout
from kvlayout.detection import DetectionError
from kvlayout.integrations.sglang import VectorizedPoolError, vectorized_kv_pools
from kvlayout.registration.peers import RegistrationDescription
from kvlayout.testing.sglang import vectorized_kv_pool
from kvlayout.transfer import BlockMapError, Shard, block_map

LAYERS, SIZE, HEADS, PAGE = 3, 192, 4, 16  # 4 pages: page 0 SGLang's padding page


def pool(
    seed: int | None,
    heads: int = HEADS,
    dtype: torch.dtype = torch.bfloat16,
    head_dim: int = 64,
    v_head_dim: int | None = None,
) -> Any:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return vectorized_kv_pool(
        LAYERS, SIZE, heads, head_dim, v_head_dim, page_size=PAGE, dtype=dtype, generator=gen
    )


def buffers(p: Any) -> dict[str, list[torch.Tensor]]:
    return {"k": p.k_buffer, "v": p.v_buffer}


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)  # bytes compare exactly (no NaN, no -0.0)


def snapshot(p: Any) -> dict[str, list[torch.Tensor]]:
    return {n: [t.clone() for t in ts] for n, ts in buffers(p).items()}


def move(
    src: Any, dst: Any, pages: list[tuple[int, int]], shards: tuple[Shard, Shard] | None = None
) -> list[Any]:
    a = vectorized_kv_pools(src.k_buffer, src.v_buffer, src.page_size)
    b = vectorized_kv_pools(dst.k_buffer, dst.v_buffer, dst.page_size)
    src_shard, dst_shard = (None, None) if shards is None else shards
    ids = [s for s, _ in pages], [d for _, d in pages]
    maps = [block_map(a[n], b[n], *ids, src_shard=src_shard, dst_shard=dst_shard) for n in ("k", "v")]
    for m in maps:
        m.copy()
    return maps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("v_head_dim", [None, 32], ids=["D_v=D", "D_v<D"])
def test_pages_move_whole_between_two_pools(dtype: torch.dtype, v_head_dim: int | None) -> None:
    src, dst = pool(1, dtype=dtype, v_head_dim=v_head_dim), pool(2, dtype=dtype, v_head_dim=v_head_dim)
    before = snapshot(dst)
    pages = [(3, 1), (1, 2)]  # out of order: runs per page
    maps = move(src, dst, pages)
    assert [m.kind for m in maps] == ["same layout", "same layout"]
    assert maps[0].num_tokens == 2 * PAGE
    for name, ts in buffers(dst).items():
        for layer, t in enumerate(ts):
            want = before[name][layer].clone()
            for s, d in pages:
                want[d] = buffers(src)[name][layer][s]
            assert torch.equal(raw(t), raw(want)), (name, layer)


def test_fp8_is_stored_as_uint8_and_maps_to_its_fp8_view() -> None:
    """SGLang stores fp8 as uint8 (X = 16) and hands kernels ``.view(fp8)``: either reads."""
    src, dst = pool(3, dtype=torch.float8_e4m3fn), pool(None, dtype=torch.float8_e4m3fn)
    assert src.k_buffer[0].dtype == torch.uint8 and src.k_buffer[0].shape[-1] == 16
    fp8 = [[t.view(torch.float8_e4m3fn) for t in ts] for ts in (src.k_buffer, src.v_buffer)]
    a = vectorized_kv_pools(fp8[0], fp8[1], PAGE)
    b = vectorized_kv_pools(dst.k_buffer, dst.v_buffer, np.int64(dst.page_size))  # type: ignore[arg-type]  # any integer but a bool
    m = block_map(a["k"], b["k"], [2], [3])
    m.copy()
    assert torch.equal(dst.k_buffer[1][3], src.k_buffer[1][2])
    assert not dst.k_buffer[1][:3].any()


def test_a_partial_last_page_moves_whole() -> None:
    src, dst = pool(4), pool(None)
    a, b = (
        vectorized_kv_pools(src.k_buffer, src.v_buffer, src.page_size),
        vectorized_kv_pools(dst.k_buffer, dst.v_buffer, dst.page_size),
    )
    m = block_map(a["v"], b["v"], [1, 2], [2, 3], num_tokens=PAGE + 3)
    assert m.num_tokens == 2 * PAGE
    m.copy()
    assert torch.equal(raw(dst.v_buffer[0][3]), raw(src.v_buffer[0][2]))


@pytest.mark.parametrize("tps", [(1, 2), (2, 1), (2, 4), (4, 2)], ids=str)
def test_heads_move_between_tp_degrees(tps: tuple[int, int]) -> None:
    """Each destination rank gathers its heads from every source rank (one map each, an
    empty one where they hold none in common); nothing outside its pages changes."""
    src_tp, dst_tp = tps
    whole = pool(5)  # the model's TP 1 pool: every rank's pages are its heads
    sources = []
    for r in range(src_tp):
        p = pool(None, HEADS // src_tp)
        n = HEADS // src_tp
        for mine, full in zip([*p.k_buffer, *p.v_buffer], [*whole.k_buffer, *whole.v_buffer], strict=True):
            mine.copy_(full[:, r * n : (r + 1) * n])
        sources.append(p)
    pages = [(2, 1), (3, 3)]
    for d in range(dst_tp):
        dst = pool(6 + d, HEADS // dst_tp)
        before = snapshot(dst)
        kinds = set()
        for s, src in enumerate(sources):
            maps = move(src, dst, pages, (Shard(s, src_tp, HEADS), Shard(d, dst_tp, HEADS)))
            kinds |= {m.kind for m in maps}
        assert "resharded state" in kinds and kinds <= {"resharded state", "empty"}
        n = HEADS // dst_tp
        for name, ts in buffers(dst).items():
            for layer, t in enumerate(ts):
                want = before[name][layer].clone()
                for sp, dp in pages:
                    want[dp] = buffers(whole)[name][layer][sp, d * n : (d + 1) * n]
                assert torch.equal(raw(t), raw(want)), (name, layer)


def test_tp_1_to_2_takes_one_run_a_page_and_layer() -> None:
    src, dst = pool(7), pool(None, HEADS // 2)
    a, b = (
        vectorized_kv_pools(src.k_buffer, src.v_buffer, src.page_size),
        vectorized_kv_pools(dst.k_buffer, dst.v_buffer, dst.page_size),
    )
    m = block_map(a["k"], b["k"], [1, 2], [3, 1], src_shard=Shard(0, 1, HEADS), dst_shard=Shard(1, 2, HEADS))
    assert (m.kind, m.num_runs) == ("resharded state", 2 * LAYERS)
    assert m.num_bytes == 2 * LAYERS * (HEADS // 2) * 64 * PAGE * 2
    m.copy()
    assert torch.equal(dst.k_buffer[2][3], src.k_buffer[2][1, 2:])


def test_a_description_round_trips_and_maps_as_the_registration() -> None:
    src, dst = pool(8), pool(None, HEADS // 2)
    a, b = (
        vectorized_kv_pools(src.k_buffer, src.v_buffer, src.page_size),
        vectorized_kv_pools(dst.k_buffer, dst.v_buffer, dst.page_size),
    )
    for name in ("k", "v"):
        text = b[name].describe(shard=Shard(0, 2, HEADS)).to_json()
        peer = RegistrationDescription.from_json(text)
        assert RegistrationDescription.from_json(peer.to_json()).to_json() == text
        ranks = Shard(0, 1, HEADS), Shard(0, 2, HEADS)
        remote = block_map(a[name], peer, [2, 3], [1, 2], src_shard=ranks[0], dst_shard=ranks[1])
        local = block_map(a[name], b[name], [2, 3], [1, 2], src_shard=ranks[0], dst_shard=ranks[1])
        assert remote.kind == "resharded state"
        assert remote.num_bytes == local.num_bytes
        assert (remote.runs == local.runs).all()
        whole_peer = RegistrationDescription.from_json(a[name].describe().to_json())
        assert block_map(a[name], whole_peer, [1], [2]).kind == "same layout"


def test_refuses_maps_to_any_other_layout() -> None:
    src = pool(9)
    a = vectorized_kv_pools(src.k_buffer, src.v_buffer, src.page_size)
    nhd = [torch.zeros(SIZE + PAGE, HEADS, 64, dtype=torch.bfloat16) for _ in range(2 * LAYERS)]
    plain = kvlayout.detect(nhd, "sglang", {"kv_list_layout": "k_v", "tokens_per_block": PAGE})
    with pytest.raises(BlockMapError, match=r"src is opaque pages \(AITER SHUFFLE K page"):
        block_map(a["k"], plain, [1], [1])
    with pytest.raises(BlockMapError, match=r"dst is opaque pages .*AITER SHUFFLE V page.* and src is not"):
        block_map(plain, a["v"], [1], [1])
    # K never maps to V, even where D == page_size == D_v (the same page bytes)
    square = vectorized_kv_pool(1, 3 * 64, 2, 64, page_size=64)
    sq = vectorized_kv_pools(square.k_buffer, square.v_buffer, square.page_size)
    with pytest.raises(BlockMapError, match=r"do not hold the same state: .*src pages are AITER SHUFFLE K"):
        block_map(sq["k"], sq["v"], [1], [2])
    # other page sizes, other head dims, other dtypes
    other_page = vectorized_kv_pool(LAYERS, SIZE, HEADS, 64, page_size=32)
    b = vectorized_kv_pools(other_page.k_buffer, other_page.v_buffer, other_page.page_size)
    with pytest.raises(BlockMapError, match=r"blocks of 16 and 32 rows"):
        block_map(a["k"], b["k"], [1], [1])
    fp16 = pool(None, dtype=torch.float16)
    c = vectorized_kv_pools(fp16.k_buffer, fp16.v_buffer, fp16.page_size)
    with pytest.raises(BlockMapError, match=r"other dtypes"):
        block_map(a["k"], c["k"], [1], [1])
    # another TP degree without shards
    half = pool(None, HEADS // 2)
    h = vectorized_kv_pools(half.k_buffer, half.v_buffer, half.page_size)
    with pytest.raises(BlockMapError, match=r"give src_shard and dst_shard"):
        block_map(a["k"], h["k"], [1], [1])
    # a page cut by first_token
    with pytest.raises(BlockMapError, match=r"cuts an opaque page of 16 rows"):
        block_map(a["k"], a["k"], [1, 2], [2, 3], first_token=3)


def test_refuses_lists_that_are_not_a_vectorized_pool() -> None:
    p = pool(None)
    cases: list[tuple[Any, Any, str]] = [
        (p.k_buffer[0], p.v_buffer, r"k_buffer is Tensor, not a non-empty list"),
        ([], p.v_buffer, r"k_buffer is list, not a non-empty list"),
        (p.k_buffer, p.v_buffer[:2], r"k_buffer has 3 layers and v_buffer 2"),
        ([t[..., 0] for t in p.k_buffer], p.v_buffer, r"k_buffer\[0\] is \[13, 4, 8, 16\], not 5-D"),
        (
            [p.k_buffer[0], p.k_buffer[1][:2], p.k_buffer[2]],
            p.v_buffer,
            r"k_buffer\[1\] is .* every layer alike",
        ),
        (
            p.k_buffer,
            [t.float() for t in p.v_buffer],
            r"k_buffer is torch.bfloat16 .* and v_buffer torch.float32",
        ),
        (
            [t.float() for t in p.k_buffer],
            [t.float() for t in p.v_buffer],
            r"end in 8 and 8, not X = 16 // 4 = 4",
        ),
        (p.k_buffer, [t[:, :2] for t in p.v_buffer], r"not one vectorized_5d pool"),
        ([t[::2] for t in p.k_buffer], [t[::2] for t in p.v_buffer], r"not contiguous pages"),
        ([t[:0] for t in p.k_buffer], [t[:0] for t in p.v_buffer], r"k_buffer\[0\] is \[0, 4, .* no pages"),
        # V and K the other way round read self-consistently (D == D_v): the page size tells
        (p.v_buffer, p.k_buffer, r"page_size is 16, but k_buffer\[0\] .* holds pages of 64 tokens"),
    ]
    for k, v, message in cases:
        with pytest.raises(VectorizedPoolError, match=message):
            vectorized_kv_pools(k, v, PAGE)
    assert issubclass(VectorizedPoolError, DetectionError)


@pytest.mark.parametrize(
    "spelling",
    [
        lambda p: (p.k_buffer + p.v_buffer, {"kv_list_layout": "k_v", "tokens_per_block": PAGE}),
        lambda p: ([p.k_buffer, p.v_buffer], {"tokens_per_block": PAGE}),
        lambda p: ([p.k_buffer, p.v_buffer], {}),
    ],
    ids=["k_v flat", "two lists", "no hints"],
)
def test_detect_names_the_integration(spelling: Any) -> None:
    kv, hints = spelling(pool(None))
    with pytest.raises(
        DetectionError, match=r"vectorized_5d.*vectorized_kv_pools\(k_buffer, v_buffer, page_size\)"
    ):
        kvlayout.detect(kv, "sglang", hints)


def test_registrations_are_views_of_the_pool() -> None:
    p = pool(None)
    regs = vectorized_kv_pools(p.k_buffer, p.v_buffer, p.page_size)
    assert list(regs) == ["k", "v"]
    for name, ts in buffers(p).items():
        b = block_map(regs[name], regs[name], [1], [2])
        assert b.num_bytes == LAYERS * ts[0][0].nbytes
    p.k_buffer[1][2].view(torch.uint8).fill_(7)
    m = block_map(regs["k"], vectorized_kv_pools(p.k_buffer, p.v_buffer, p.page_size)["k"], [2], [3])
    m.copy()
    assert (p.k_buffer[1][3].view(torch.uint8) == 7).all()


def test_heads_replicated_over_ranks_move_as_the_shards_say() -> None:
    """Where TP exceeds the model's KV heads SGLang replicates them: at TP 4 over 2 heads
    ranks 0 and 1 hold head 0, ranks 2 and 3 head 1 (``Shard.heads``). The page arrays are
    KV heads, so a map reads which head a rank holds from its shard: from TP 1 each rank
    of TP 4 takes its head; rank 1 into rank 0 moves the page (the same head), rank 2
    into rank 0 nothing; a shard that disagrees with the page's heads is refused."""
    whole = pool(8, 2)  # the model's 2 KV heads at TP 1
    w = vectorized_kv_pools(whole.k_buffer, whole.v_buffer, whole.page_size)
    ranks = [pool(None, 1) for _ in range(4)]
    for d, dst in enumerate(ranks):
        maps = move(whole, dst, [(2, 1)], (Shard(0, 1, 2), Shard(d, 4, 2)))
        assert {m.kind for m in maps} == {"resharded state"}
        for name, ts in buffers(dst).items():
            for layer, t in enumerate(ts):
                assert torch.equal(raw(t[1]), raw(buffers(whole)[name][layer][2, d // 2 : d // 2 + 1])), (
                    d,
                    name,
                )
                assert not raw(t[2:]).any()
    r = [vectorized_kv_pools(p.k_buffer, p.v_buffer, p.page_size) for p in ranks]
    same = block_map(r[1]["k"], r[0]["k"], [1], [3], src_shard=Shard(1, 4, 2), dst_shard=Shard(0, 4, 2))
    assert same.num_bytes == ranks[0].k_buffer[0][1].nbytes * LAYERS
    same.copy()
    assert torch.equal(ranks[0].k_buffer[2][3], ranks[1].k_buffer[2][1])
    other = block_map(r[2]["k"], r[0]["k"], [1], [3], src_shard=Shard(2, 4, 2), dst_shard=Shard(0, 4, 2))
    assert other.kind == "empty" and other.num_runs == 0
    with pytest.raises(
        BlockMapError, match=r"in src: 2 KV heads a page, but src_shard Shard\(tp_rank=0, tp_size=4"
    ):
        block_map(w["k"], r[0]["k"], [1], [1], src_shard=Shard(0, 4, 2), dst_shard=Shard(0, 4, 2))


def test_the_shards_heads_not_only_their_ranks_key_a_pairs_pages() -> None:
    """Rank 1 into rank 0 at TP 4: over 2 KV heads both hold head 0 (the page moves),
    over 4 heads they hold heads 1 and 0 (nothing in common). The same two pools, maps
    built one after the other: the second is not the first's kept pair."""
    a, b = pool(10, 1), pool(None, 1)
    ra = vectorized_kv_pools(a.k_buffer, a.v_buffer, a.page_size)
    rb = vectorized_kv_pools(b.k_buffer, b.v_buffer, b.page_size)
    two = block_map(ra["k"], rb["k"], [1], [2], src_shard=Shard(1, 4, 2), dst_shard=Shard(0, 4, 2))
    four = block_map(ra["k"], rb["k"], [1], [2], src_shard=Shard(1, 4, 4), dst_shard=Shard(0, 4, 4))
    assert (two.kind, four.kind) == ("resharded state", "empty") and four.num_bytes == 0
