"""SGLang's MXFP8 KV pool (``MHATokenToKVPoolMXFP8``, ``--kv-cache-dtype mxfp8``): its fp8
payload and its UE8M0 scale buffers, a request's pages between pools and TP degrees.

SGLang's P/D registers the payload (``get_contiguous_buf_infos``) and the scales
(``get_kv_scale_buf_infos``: K's layers then V's, an item a page); its HiCache host pool
(``MHATokenToKVPoolMXFP8Host``) keeps them as uint8 ``[pages, NL, page bytes]``, a device
page row at ``k_scale_host[host_page, layer]``. The oracles read
SGLang's own indexing and nothing of kvlayout's: a token slot ``loc``'s K is
``k_buffer[l][loc]``; its scales are ``k_scale_buffer[l][loc]`` when flat
(``_write_scales``) and, interleaved at page_size 128, ``[loc // 128, :, off % 32, off //
32]`` with ``off = loc % 128`` (``_read_sf_interleaved``, the inverse of
``store_sf_interleaved``). Every byte outside the moved pages must keep its value.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import kvlayout
from kvlayout.detection import DetectionError
from kvlayout.integrations.sglang import Mxfp8ScaleError, mxfp8_host_scale_pools, mxfp8_scale_pools
from kvlayout.testing.sglang import mxfp8_kv_pool
from kvlayout.transfer import BlockMapError, RegistrationDescription, Shard, block_map

LAYERS, HEADS, HEAD_DIM = 2, 4, 128


def pool(seed: int | None, heads: int = HEADS, page_size: int = 128, v_head_dim: int | None = None) -> Any:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return mxfp8_kv_pool(
        LAYERS, 5 * page_size, heads, HEAD_DIM, v_head_dim, page_size=page_size, generator=gen
    )


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)  # bytes compare exactly (e8m0 0xFF is NaN)


def scale_of(p: Any, name: str, layer: int, loc: int) -> torch.Tensor:
    """Token slot ``loc``'s ``[H, sf]`` scales, as SGLang reads them."""
    buf = getattr(p, f"{name}_scale_buffer")[layer]
    if not p.mxfp8_sf_interleaved:
        return raw(buf[loc])
    off = loc % p.page_size
    return raw(buf[loc // p.page_size, :, off % 32, off // 32])


def ranks(whole: Any, tp: int, page_size: int = 128) -> list[Any]:
    """TP ``tp``'s pools, each its heads of ``whole`` (a TP 1 pool), slot for slot."""
    n = HEADS // tp
    out = []
    for r in range(tp):
        p = pool(None, n, page_size)
        for name in ("k_buffer", "v_buffer", "k_scale_buffer", "v_scale_buffer"):
            for mine, full in zip(getattr(p, name), getattr(whole, name), strict=True):
                mine.copy_(full[:, r * n : (r + 1) * n])
        out.append(p)
    return out


def scales(p: Any) -> dict[str, Any]:
    return mxfp8_scale_pools(p.k_scale_buffer, p.v_scale_buffer, p.page_size)


def snapshot(p: Any) -> dict[str, list[torch.Tensor]]:
    return {n: [raw(t).clone() for t in getattr(p, f"{n}_scale_buffer")] for n in ("k", "v")}


@pytest.mark.parametrize("tps", [(1, 2), (2, 1), (2, 4)], ids=str)
def test_interleaved_scale_pages_move_by_heads_between_tp_degrees(tps: tuple[int, int]) -> None:
    """Page 3 then page 1 of the prefill into pages 2 and 5 of each decode rank; the
    request ends 5 tokens into its second page, which moves whole, as SGLang moves it."""
    src_tp, dst_tp = tps
    whole = pool(1)
    sources = ranks(whole, src_tp)
    pages, n = [(3, 2), (1, 5)], HEADS // dst_tp
    for d in range(dst_tp):
        dst = pool(10 + d, n)
        before = snapshot(dst)
        kinds = set()
        for s, src in enumerate(sources):
            a, b = scales(src), scales(dst)
            for name in ("k", "v"):
                ids = [sp for sp, _ in pages], [dp for _, dp in pages]
                shards = Shard(s, src_tp, HEADS), Shard(d, dst_tp, HEADS)
                m = block_map(
                    a[name], b[name], *ids, num_tokens=128 + 5, src_shard=shards[0], dst_shard=shards[1]
                )
                assert m.num_tokens == 2 * 128
                kinds.add(m.kind)
                m.copy()
        assert "resharded state" in kinds and kinds <= {"resharded state", "empty"}
        moved = {dp * 128 + off: sp * 128 + off for sp, dp in pages for off in range(128)}
        for name in ("k", "v"):
            for layer in range(LAYERS):
                for loc in range(6 * 128):
                    got = scale_of(dst, name, layer, loc)
                    if loc in moved:
                        want = scale_of(whole, name, layer, moved[loc])[d * n : (d + 1) * n]
                    else:
                        off = loc % 128
                        want = before[name][layer][loc // 128, :, off % 32, off // 32]
                    assert torch.equal(got, want), (name, layer, loc)


def test_flat_scales_move_token_by_token_between_tp_degrees() -> None:
    """At page_size 16 the scales are flat slot rows: the request's 35 tokens move, the
    rest of its last page stays as it was."""
    whole, dst = pool(2, page_size=16), pool(3, HEADS // 2, page_size=16)
    assert whole.k_scale_buffer[0].shape == (6 * 16, HEADS, HEAD_DIM // 32)
    before = snapshot(dst)
    a, b = scales(whole), scales(dst)
    for name in ("k", "v"):
        m = block_map(
            a[name], b[name], [4, 1, 2], [1, 3, 5], num_tokens=35, src_shard=Shard(0, 1, HEADS),
            dst_shard=Shard(1, 2, HEADS),
        )  # fmt: skip
        m.copy()
    moved = {dp * 16 + off: sp * 16 + off for sp, dp in [(4, 1), (1, 3), (2, 5)] for off in range(16)}
    for name in ("k", "v"):
        for layer in range(LAYERS):
            for loc in range(6 * 16):
                got = scale_of(dst, name, layer, loc)
                if loc in moved and (loc // 16 != 5 or loc % 16 < 3):
                    want = scale_of(whole, name, layer, moved[loc])[HEADS // 2 :]
                else:
                    want = before[name][layer][loc]
                assert torch.equal(got, want), (name, layer, loc)


def test_flat_scales_read_as_k_v_page_buffers_too() -> None:
    """The flat scales are laid out as the pool's page buffers: a K/V registration of them
    moves the same bytes."""
    src, dst = pool(4, page_size=16), pool(None, page_size=16)
    hints = {"kv_list_layout": "k_v", "tokens_per_block": 16}
    a, b = (kvlayout.detect(p.k_scale_buffer + p.v_scale_buffer, "sglang", hints) for p in (src, dst))
    block_map(a, b, [2], [4], num_tokens=7).copy()
    for name in ("k", "v"):
        for layer in range(LAYERS):
            want = torch.zeros_like(raw(getattr(dst, f"{name}_scale_buffer")[layer]))
            want[4 * 16 : 4 * 16 + 7] = raw(getattr(src, f"{name}_scale_buffer")[layer][2 * 16 : 2 * 16 + 7])
            assert torch.equal(raw(getattr(dst, f"{name}_scale_buffer")[layer]), want)


def test_fp8_payload_reads_as_an_mha_pool_and_maps_to_a_uint8_stored_one() -> None:
    """The payload is float8_e4m3fn itself (SGLang's other fp8 pools store uint8): it reads
    as any MHA pool's page buffers, between TP degrees and into a uint8-stored fp8 pool."""
    whole = pool(5)
    hints = {"kv_list_layout": "k_v", "tokens_per_block": 128}
    a = kvlayout.detect(whole.k_buffer + whole.v_buffer, "sglang", hints)
    dst = [torch.zeros(6 * 128, HEADS // 2, HEAD_DIM, dtype=torch.uint8) for _ in range(2 * LAYERS)]
    b = kvlayout.detect(dst, "sglang", hints)
    block_map(
        a, b, [3], [1], num_tokens=100, src_shard=Shard(0, 1, HEADS), dst_shard=Shard(0, 2, HEADS)
    ).copy()
    for i, src in enumerate(whole.k_buffer + whole.v_buffer):
        want = torch.zeros_like(dst[i])
        want[128 : 128 + 100] = raw(src[3 * 128 : 3 * 128 + 100, : HEADS // 2])
        assert torch.equal(dst[i], want)


def test_detect_refuses_interleaved_scales_naming_their_reader() -> None:
    p = pool(None)
    for hints in ({}, {"kv_list_layout": "k_v", "tokens_per_block": 128}):
        with pytest.raises(
            DetectionError, match=re.escape("kvlayout.integrations.sglang.mxfp8_scale_pools(")
        ):
            kvlayout.detect(p.k_scale_buffer + p.v_scale_buffer, "sglang", hints)


def test_pages_map_only_to_pages_alike() -> None:
    p, q = pool(6), pool(None)
    a, b = scales(p), scales(q)
    with pytest.raises(BlockMapError, match="do not hold the same state"):
        block_map(a["k"], b["v"], [1], [1])  # K never to V, though their pages are alike
    flat = scales(pool(None, page_size=16))
    with pytest.raises(BlockMapError, match="opaque pages"):
        block_map(a["k"], flat["k"], [1], [1])
    other_dim = pool(None, v_head_dim=256)
    assert other_dim.v_scale_buffer[0].shape[-1] == 8
    with pytest.raises(BlockMapError):
        block_map(a["v"], scales(other_dim)["v"], [1], [1])


def test_refuses_what_is_no_mxfp8_scale_buffer() -> None:
    p = pool(None)
    with pytest.raises(
        Mxfp8ScaleError, match=r"not \[pages, H, 32, page_size // 32 = 2, sf\] at page_size=64"
    ):
        mxfp8_scale_pools(p.k_scale_buffer, p.v_scale_buffer, 64)
    with pytest.raises(Mxfp8ScaleError, match="page_size must be a positive int"):
        mxfp8_scale_pools(p.k_scale_buffer, p.v_scale_buffer, True)
    with pytest.raises(Mxfp8ScaleError, match="not UE8M0 scales"):
        mxfp8_scale_pools(p.k_buffer, p.v_buffer, 128)
    with pytest.raises(Mxfp8ScaleError, match="2 layers and v_scale_buffer 1"):
        mxfp8_scale_pools(p.k_scale_buffer, p.v_scale_buffer[:1], 128)
    flat = pool(None, page_size=16)
    with pytest.raises(Mxfp8ScaleError, match="one layout on one device"):
        mxfp8_scale_pools(p.k_scale_buffer, flat.v_scale_buffer, 128)
    with pytest.raises(Mxfp8ScaleError, match="not whole pages of page_size=64"):
        mxfp8_scale_pools(flat.k_scale_buffer[:1], flat.v_scale_buffer[:1], 64)
    as_bytes = mxfp8_scale_pools([raw(t) for t in p.k_scale_buffer], [raw(t) for t in p.v_scale_buffer], 128)
    block_map(as_bytes["k"], scales(pool(None))["k"], [1], [1])  # uint8 bytes are the same pages


def test_interleaved_scale_pages_back_up_to_the_host_pool_and_load_back() -> None:
    """Device pages 4 and 1 into host pages 2 and 6 (SGLang's staged write-back:
    ``k_scale_host[hp, l] = k_scale_buffer[l].view(uint8).reshape(pages, -1)[dp]``), and
    back into pages 3 and 5 of another device pool (``load_to_device_per_layer``, the
    inverse); nothing else is written."""
    src, back = pool(7), pool(None)
    page_bytes = src.k_scale_buffer[0][0].numel()
    host = {n: torch.zeros(8, LAYERS, page_bytes, dtype=torch.uint8) for n in ("k", "v")}
    on_host = mxfp8_host_scale_pools(host["k"], host["v"], 128, HEADS)
    a, b = scales(src), scales(back)
    for name in ("k", "v"):
        up = block_map(a[name], on_host[name], [4, 1], [2, 6], num_tokens=128 + 9)
        assert (up.kind, up.num_tokens, up.num_runs) == ("same layout", 2 * 128, 2 * LAYERS)
        up.copy()
        block_map(on_host[name], b[name], [2, 6], [3, 5], num_tokens=2 * 128).copy()

    def rows(p: Any, name: str, layer: int) -> torch.Tensor:
        return raw(getattr(p, f"{name}_scale_buffer")[layer]).reshape(6, -1)

    for name in ("k", "v"):
        for layer in range(LAYERS):
            want_host = torch.zeros(8, page_bytes, dtype=torch.uint8)
            want_host[2], want_host[6] = rows(src, name, layer)[4], rows(src, name, layer)[1]
            assert torch.equal(host[name][:, layer], want_host)
            want_back = torch.zeros(6, page_bytes, dtype=torch.uint8)
            want_back[3], want_back[5] = rows(src, name, layer)[4], rows(src, name, layer)[1]
            assert torch.equal(rows(back, name, layer), want_back)


def test_the_host_pool_is_refused_where_it_is_no_such_pool() -> None:
    src = pool(None)
    page_bytes = src.k_scale_buffer[0][0].numel()
    host = torch.zeros(8, LAYERS, page_bytes, dtype=torch.uint8)
    with pytest.raises(Mxfp8ScaleError, match="no interleaved scale page of head_num=3 heads"):
        mxfp8_host_scale_pools(host, host, 128, 3)
    with pytest.raises(Mxfp8ScaleError, match=r"not uint8 \[pages, NL, page bytes\]"):
        mxfp8_host_scale_pools(host.float(), host, 128, HEADS)
    with pytest.raises(Mxfp8ScaleError, match="head_num must be a positive int"):
        mxfp8_host_scale_pools(host, host, 128, 0)
    # head_num the bytes allow but not the device pool's: its pages hold other arrays
    wrong = mxfp8_host_scale_pools(host, host.clone(), 128, HEADS // 2)
    with pytest.raises(BlockMapError):
        block_map(scales(src)["k"], wrong["k"], [1], [1])


def test_interleaved_scale_pages_move_to_ranks_that_replicate_heads() -> None:
    """A model of 2 KV heads served at TP 4 (SGLang replicates each head over 2 ranks, rank
    ``r`` holding head ``r * 2 // 4``): each rank's pages get its one head's tile, and the
    4 ranks' pages load back at TP 1 as the whole pages, heads in order."""
    heads, tp = 2, 4
    whole = pool(8, heads)
    rank_pools = [pool(20 + r, 1) for r in range(tp)]
    before = [snapshot(p) for p in rank_pools]
    back = pool(None, heads)
    for r, mine in enumerate(rank_pools):
        one, shard = Shard(0, 1, heads), Shard(r, tp, heads)
        a, b, c = scales(whole), scales(mine), scales(back)
        for name in ("k", "v"):
            block_map(a[name], b[name], [3, 1], [2, 4], num_tokens=130, src_shard=one, dst_shard=shard).copy()
            block_map(b[name], c[name], [2, 4], [1, 5], num_tokens=130, src_shard=shard, dst_shard=one).copy()
    for r, mine in enumerate(rank_pools):
        head = r * heads // tp
        for name in ("k", "v"):
            for layer in range(LAYERS):
                got = raw(getattr(mine, f"{name}_scale_buffer")[layer])
                want = before[r][name][layer].clone()
                full = raw(getattr(whole, f"{name}_scale_buffer")[layer])
                want[2], want[4] = full[3, head : head + 1], full[1, head : head + 1]
                assert torch.equal(got, want), (r, name, layer)
    for name in ("k", "v"):
        for layer in range(LAYERS):
            full = raw(getattr(whole, f"{name}_scale_buffer")[layer])
            want = torch.zeros_like(full)
            want[1], want[5] = full[3], full[1]
            assert torch.equal(raw(getattr(back, f"{name}_scale_buffer")[layer]), want)


def test_a_described_scale_pool_maps_as_the_pool() -> None:
    """A peer's scale pages (its JSON description, as NIXL's peer) map to the same runs as
    the pool itself, device pool and host pool alike."""
    p = pool(9)
    page_bytes = p.k_scale_buffer[0][0].numel()
    host = torch.zeros(4, LAYERS, page_bytes, dtype=torch.uint8)
    device, on_host = scales(p), mxfp8_host_scale_pools(host, host.clone(), 128, HEADS)
    for name in ("k", "v"):
        for src, dst in ((device[name], on_host[name]), (on_host[name], device[name])):
            here = block_map(src, dst, [1, 2], [3, 0], num_tokens=200)
            for peer_src, peer_dst in ((src, _peer(dst)), (_peer(src), dst)):
                there = block_map(peer_src, peer_dst, [1, 2], [3, 0], num_tokens=200)
                assert (there.kind, there.num_runs) == (here.kind, here.num_runs)
                assert (there.runs == here.runs).all()


def _peer(reg: Any) -> Any:
    return RegistrationDescription.from_json(reg.describe().to_json())


def test_zero_size_and_mismatched_scale_buffers_are_refused() -> None:
    e8m0 = torch.float8_e8m0fnu
    for shape, page_size in (((0, HEADS, 32, 4, 4), 128), ((3, 0, 32, 4, 4), 128), ((32, HEADS, 0), 16)):
        empty = [torch.zeros(shape, dtype=e8m0)]
        with pytest.raises(Mxfp8ScaleError, match=re.escape(f"k_scale_buffer[0] is {list(shape)}, not")):
            mxfp8_scale_pools(empty, empty, page_size)
    page_bytes = pool(None).k_scale_buffer[0][0].numel()
    host = torch.zeros(8, LAYERS, page_bytes, dtype=torch.uint8)
    with pytest.raises(
        Mxfp8ScaleError, match=r"k_scale_host is \[8, 2, 2048\] and v_scale_host \[8, 3, 2048\]"
    ):
        mxfp8_host_scale_pools(host, torch.zeros(8, LAYERS + 1, page_bytes, dtype=torch.uint8), 128, HEADS)
    with pytest.raises(Mxfp8ScaleError, match="page_size a multiple of 32"):
        # 4 heads of 48 tokens of 8 scales: the bytes divide, but no interleaved tile is 48 tokens
        odd = torch.zeros(8, LAYERS, HEADS * 48 * 8, dtype=torch.uint8)
        mxfp8_host_scale_pools(odd, odd, 48, HEADS)
    with pytest.raises(Mxfp8ScaleError, match=r"not uint8 \[pages, NL, page bytes\]"):
        mxfp8_host_scale_pools(host[:, :0], host[:, :0], 128, HEADS)
