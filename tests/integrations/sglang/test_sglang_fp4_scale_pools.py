"""SGLang's FP4 MHA pool's block scales (``--kv-cache-dtype nvfp4`` / ``fp4_mx_block16``),
device and HiCache host: a request's pages between pools and TP degrees.

The oracles read SGLang's own indexing and nothing of kvlayout's. Device
(``NVFP4KVCacheMethod.create_buffers``, ``nvfp4_kv_cache.store_nvfp4_kv_cache``): token
slot ``loc``'s scales of head ``h`` are ``k_scale_buffer[l][loc, h]`` (linear ``[slots, H,
sf]``), ``k_scale_buffer[l][loc, h * sf : (h + 1) * sf]`` (flat ``[slots, H * sf]``,
``fp4_mx_block16``) or, native (TRT-LLM's ``[pages, H, page_size, sf]``),
``native_k_scale_buffer[l][p, h, off]`` with ``p, off = divmod(loc, page_size)`` and V's
scale ``j`` at ``[p, h, off // 4 * 4 + j // (sf // 4), j % (sf // 4) * 4 + off % 4]``
(``nvfp4_v_scale_swizzle_indices``). Host (``pool_host/mha_fp4.py``,
``MHATokenToKVPoolFP4Host``): one uint8 ``[page_num, NL, page_bytes]`` per device scale
buffer; ``backup_from_device_all_layer`` copies ``buf.view(uint8).reshape(-1,
page_bytes)[device_page]`` to ``host[host_page, layer]`` and ``load_to_device_per_layer``
the inverse, whole pages only. Every byte outside what moves must keep its value.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kvlayout
from kvlayout.integrations.sglang import Fp4ScaleError, fp4_host_scale_pools, fp4_scale_pools
from kvlayout.testing.sglang import fp4_kv_pool
from kvlayout.transfer import BlockMapError, RegistrationDescription, Shard, block_map

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 4, 128, 16
SF = HEAD_DIM // 16
GROUP = 4  # V's native 4-token interleave
KINDS = ("k", "v")


def pool(seed: int | None, scales: str, heads: int = HEADS, page_size: int = PAGE) -> Any:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return fp4_kv_pool(
        LAYERS, 5 * page_size, heads, HEAD_DIM, page_size=page_size, scales=scales, generator=gen
    )


def buffers(p: Any, name: str) -> list[torch.Tensor]:
    native = p.native_k_scale_buffer is not None
    layers: list[torch.Tensor] = getattr(
        p, f"native_{name}_scale_buffer" if native else f"{name}_scale_buffer"
    )
    return layers


def scale_of(p: Any, name: str, layer: int, loc: int) -> torch.Tensor:
    """Token slot ``loc``'s ``[H, sf]`` scales, as SGLang indexes them."""
    buf = buffers(p, name)[layer]
    heads = p.head_num
    if buf.dim() == 3:
        return buf[loc]
    if buf.dim() == 2:
        return buf[loc].view(heads, SF)
    page, off = divmod(loc, p.page_size)
    if name == "k":
        return buf[page, :, off]
    j = torch.arange(SF)
    token = off // GROUP * GROUP + j // (SF // GROUP)
    scale = j % (SF // GROUP) * GROUP + off % GROUP
    return buf[page][:, token, scale]


def registrations(p: Any) -> dict[str, Any]:
    return fp4_scale_pools(buffers(p, "k"), buffers(p, "v"), p.page_size, p.head_num)


def snapshot(p: Any) -> Any:
    """``p`` with copies of its scale buffers, as they are now."""
    names = ("k_scale_buffer", "v_scale_buffer", "native_k_scale_buffer", "native_v_scale_buffer")
    copies = {n: None if getattr(p, n) is None else [t.clone() for t in getattr(p, n)] for n in names}
    return SimpleNamespace(**copies, head_num=p.head_num, page_size=p.page_size)


def ranks(whole: Any, tp: int, scales: str) -> list[Any]:
    """TP ``tp``'s pools, each its heads of ``whole`` (a TP 1 pool), token for token as
    SGLang's own indexing places them."""
    n = HEADS // tp
    out = []
    for r in range(tp):
        p = pool(None, scales, n)
        for name in KINDS:
            for layer in range(LAYERS):
                for loc in range(6 * PAGE):
                    _write(p, name, layer, loc, scale_of(whole, name, layer, loc)[r * n : (r + 1) * n])
        out.append(p)
    return out


def _write(p: Any, name: str, layer: int, loc: int, value: torch.Tensor) -> None:
    """SGLang's store of token slot ``loc``'s ``[H, sf]`` scales (store_nvfp4_kv_cache)."""
    buf = buffers(p, name)[layer]
    if buf.dim() == 3:
        buf[loc] = value
    elif buf.dim() == 2:
        buf[loc] = value.reshape(-1)
    else:
        page, off = divmod(loc, p.page_size)
        if name == "k":
            buf[page, :, off] = value
        else:
            j = torch.arange(SF)
            buf[page][
                :, off // GROUP * GROUP + j // (SF // GROUP), j % (SF // GROUP) * GROUP + off % GROUP
            ] = value


def test_the_oracle_places_every_native_v_scale_once() -> None:
    """SGLang's V interleave is a bijection of a page's [page_size, sf] (so ranks() and
    the oracle read what SGLang stores, no byte twice)."""
    p = pool(None, "native")
    for loc in range(PAGE):
        _write(p, "v", 0, loc, torch.full((HEADS, SF), loc + 1, dtype=torch.uint8))
    page = buffers(p, "v")[0][0]
    assert sorted(page[0].flatten().tolist()) == sorted(list(range(1, PAGE + 1)) * SF)
    for loc in range(PAGE):
        assert (scale_of(p, "v", 0, loc) == loc + 1).all()


@pytest.mark.parametrize("tps", [(1, 2), (2, 1), (2, 4)], ids=str)
def test_native_scale_pages_move_by_heads_between_tp_degrees(tps: tuple[int, int]) -> None:
    """Page 3 then page 1 of the prefill into pages 2 and 5 of each decode rank; the
    request ends 5 tokens into its second page, which moves whole, as SGLang moves it."""
    src_tp, dst_tp = tps
    whole = pool(1, "native")
    sources = ranks(whole, src_tp, "native")
    pages, n = [(3, 2), (1, 5)], HEADS // dst_tp
    for d in range(dst_tp):
        dst = pool(10 + d, "native", n)
        before = snapshot(dst)
        kinds = set()
        for s, src in enumerate(sources):
            a, b = registrations(src), registrations(dst)
            for name in KINDS:
                m = block_map(
                    a[name],
                    b[name],
                    [sp for sp, _ in pages],
                    [dp for _, dp in pages],
                    num_tokens=PAGE + 5,
                    src_shard=Shard(s, src_tp, HEADS),
                    dst_shard=Shard(d, dst_tp, HEADS),
                )
                assert m.num_tokens == 2 * PAGE
                kinds.add(m.kind)
                m.copy()
        assert "resharded state" in kinds and kinds <= {"resharded state", "empty"}
        moved = {dp * PAGE + off: sp * PAGE + off for sp, dp in pages for off in range(PAGE)}
        for name in KINDS:
            for layer in range(LAYERS):
                for loc in range(6 * PAGE):
                    got = scale_of(dst, name, layer, loc)
                    if loc in moved:
                        want = scale_of(whole, name, layer, moved[loc])[d * n : (d + 1) * n]
                    else:
                        want = scale_of(before, name, layer, loc)
                    assert torch.equal(got, want), (name, layer, loc)


@pytest.mark.parametrize("scales", ["linear", "flat"])
def test_linear_scales_move_token_by_token_between_tp_degrees(scales: str) -> None:
    """Linear scales are slot rows: the request's 35 tokens move into rank 1 of TP 2, the
    rest of its last page stays as it was."""
    whole, dst = pool(2, scales), pool(3, scales, HEADS // 2)
    before = snapshot(dst)
    a, b = registrations(whole), registrations(dst)
    for name in KINDS:
        block_map(
            a[name], b[name], [4, 1, 2], [1, 3, 5], num_tokens=35, src_shard=Shard(0, 1, HEADS),
            dst_shard=Shard(1, 2, HEADS),
        ).copy()  # fmt: skip
    moved = {dp * PAGE + off: sp * PAGE + off for sp, dp in [(4, 1), (1, 3), (2, 5)] for off in range(PAGE)}
    for name in KINDS:
        for layer in range(LAYERS):
            for loc in range(6 * PAGE):
                got = scale_of(dst, name, layer, loc)
                if loc in moved and (loc // PAGE != 5 or loc % PAGE < 3):
                    want = scale_of(whole, name, layer, moved[loc])[HEADS // 2 :]
                else:
                    want = scale_of(before, name, layer, loc)
                assert torch.equal(got, want), (name, layer, loc)


def host_of(p: Any, pages: int) -> dict[str, torch.Tensor]:
    """The host pool's buffers of ``p``'s scales (``_init_scale_buffers``): zeros ``[pages,
    NL, page_bytes]``, ``page_bytes`` a device page's bytes of one layer."""
    page_bytes = buffers(p, "k")[0].numel() // 6  # the device pools hold 6 pages
    return {n: torch.zeros(pages, LAYERS, page_bytes, dtype=torch.uint8) for n in KINDS}


def device_rows(p: Any, name: str, layer: int, page_bytes: int) -> torch.Tensor:
    return buffers(p, name)[layer].view(torch.uint8).reshape(-1, page_bytes)  # SGLang's _scale_rows


@pytest.mark.parametrize("scales", ["linear", "flat", "native"])
def test_scale_pages_back_up_to_the_host_pool_and_load_back(scales: str) -> None:
    """Device pages 4 and 1 into host pages 2 and 6 (backup_from_device_all_layer), and
    back into pages 3 and 5 of another device pool (load_to_device_per_layer); nothing
    else is written."""
    src, back = pool(7, scales), pool(None, scales)
    host = host_of(src, 8)
    on_host = fp4_host_scale_pools(host["k"], host["v"], PAGE, HEADS, native=scales == "native")
    a, b = registrations(src), registrations(back)
    for name in KINDS:
        up = block_map(a[name], on_host[name], [4, 1], [2, 6], num_tokens=2 * PAGE)
        assert up.num_runs == 2 * LAYERS and up.num_tokens == 2 * PAGE
        up.copy()
        block_map(on_host[name], b[name], [2, 6], [3, 5], num_tokens=2 * PAGE).copy()
    page_bytes = host["k"].shape[2]
    for name in KINDS:
        for layer in range(LAYERS):
            rows = device_rows(src, name, layer, page_bytes)
            want_host = torch.zeros(8, page_bytes, dtype=torch.uint8)
            want_host[2], want_host[6] = rows[4], rows[1]
            assert torch.equal(host[name][:, layer], want_host)
            want_back = torch.zeros(6, page_bytes, dtype=torch.uint8)
            want_back[3], want_back[5] = rows[4], rows[1]
            assert torch.equal(device_rows(back, name, layer, page_bytes), want_back)


def test_native_host_pages_move_whole_and_linear_ones_token_by_token() -> None:
    """A request ending 3 tokens into its page: a native host page moves whole (SGLang
    moves no partial scale page), a linear one its first 3 slot rows."""
    for scales, rows_moved in (("native", PAGE), ("linear", 3)):
        src = pool(8, scales)
        host = host_of(src, 4)
        on_host = fp4_host_scale_pools(host["k"], host["v"], PAGE, HEADS, native=scales == "native")
        m = block_map(registrations(src)["k"], on_host["k"], [2], [1], num_tokens=3)
        assert m.num_tokens == (PAGE if scales == "native" else 3)
        m.copy()
        page_bytes = host["k"].shape[2]
        for layer in range(LAYERS):
            row = device_rows(src, "k", layer, page_bytes)[2]
            moved = rows_moved * page_bytes // PAGE
            assert torch.equal(host["k"][1, layer, :moved], row[:moved])
            assert not host["k"][1, layer, moved:].any() and not host["k"][[0, 2, 3], layer].any()


def test_host_scale_pages_move_by_heads_to_a_rank_of_another_tp_degree() -> None:
    """A TP 1 host pool's pages load into rank 1 of TP 2, linear by token rows and native
    by whole pages, each rank's heads."""
    for scales in ("linear", "native"):
        whole = pool(9, scales)
        host = host_of(whole, 8)
        on_host = fp4_host_scale_pools(host["k"], host["v"], PAGE, HEADS, native=scales == "native")
        dst = pool(None, scales, HEADS // 2)
        a, b = registrations(whole), registrations(dst)
        for name in KINDS:
            block_map(a[name], on_host[name], [3], [5], num_tokens=PAGE).copy()
            block_map(
                on_host[name], b[name], [5], [2], num_tokens=PAGE, src_shard=Shard(0, 1, HEADS),
                dst_shard=Shard(1, 2, HEADS),
            ).copy()  # fmt: skip
        for name in KINDS:
            for layer in range(LAYERS):
                for loc in range(6 * PAGE):
                    got = scale_of(dst, name, layer, loc)
                    if loc // PAGE == 2:
                        want = scale_of(whole, name, layer, 3 * PAGE + loc % PAGE)[HEADS // 2 :]
                        assert torch.equal(got, want), (scales, name, layer, loc)
                    else:
                        assert not got.any(), (scales, name, layer, loc)


def test_pages_map_only_to_pages_alike() -> None:
    native, linear = registrations(pool(None, "native")), registrations(pool(None, "linear"))
    with pytest.raises(BlockMapError, match="do not hold the same state"):
        block_map(native["k"], native["v"], [1], [1])  # K never to V: V's scales are interleaved
    with pytest.raises(BlockMapError, match="opaque pages"):
        block_map(native["k"], linear["k"], [1], [1])
    with pytest.raises(BlockMapError):
        block_map(linear["k"], native["k"], [1], [1])
    other_page = registrations(pool(None, "native", page_size=2 * PAGE))
    with pytest.raises(BlockMapError):
        block_map(native["k"], other_page["k"], [1], [1])
    # a host pool read as the other layout's holds other pages
    host = host_of(pool(None, "native"), 4)
    as_linear = fp4_host_scale_pools(host["k"], host["v"], PAGE, HEADS, native=False)
    with pytest.raises(BlockMapError):
        block_map(native["k"], as_linear["k"], [1], [1])


def test_a_described_scale_pool_maps_as_the_pool() -> None:
    """A peer's scale pages (its JSON description, as NIXL's peer) map to the same runs as
    the pool itself, device pool and host pool alike."""
    for scales in ("native", "linear"):
        p = pool(11, scales)
        host = host_of(p, 4)
        device = registrations(p)
        on_host = fp4_host_scale_pools(host["k"], host["v"], PAGE, HEADS, native=scales == "native")
        for name in KINDS:
            for src, dst in ((device[name], on_host[name]), (on_host[name], device[name])):
                here = block_map(src, dst, [1, 2], [3, 0], num_tokens=2 * PAGE)
                for peer_src, peer_dst in ((src, _peer(dst)), (_peer(src), dst)):
                    there = block_map(peer_src, peer_dst, [1, 2], [3, 0], num_tokens=2 * PAGE)
                    assert (there.kind, there.num_runs) == (here.kind, here.num_runs)
                    assert (there.runs == here.runs).all()


def _peer(reg: Any) -> Any:
    return RegistrationDescription.from_json(reg.describe().to_json())


def test_refuses_what_is_no_fp4_scale_buffer() -> None:
    native, linear, flat = pool(None, "native"), pool(None, "linear"), pool(None, "flat")
    k, v = buffers(native, "k"), buffers(native, "v")
    with pytest.raises(Fp4ScaleError, match=re.escape("not native [pages, head_num=4, page_size=32, sf]")):
        fp4_scale_pools(k, v, 2 * PAGE, HEADS)
    with pytest.raises(Fp4ScaleError, match=re.escape("not native [pages, head_num=2, page_size=16, sf]")):
        fp4_scale_pools(k, v, PAGE, HEADS // 2)
    with pytest.raises(Fp4ScaleError, match="page_size must be a positive int"):
        fp4_scale_pools(k, v, True, HEADS)
    with pytest.raises(Fp4ScaleError, match="head_num must be a positive int"):
        fp4_scale_pools(k, v, PAGE, 0)
    with pytest.raises(Fp4ScaleError, match="not FP4 block scales"):
        fp4_scale_pools([t.float() for t in k], [t.float() for t in v], PAGE, HEADS)
    with pytest.raises(Fp4ScaleError, match="2 layers and v_scale_buffer 1"):
        fp4_scale_pools(k, v[:1], PAGE, HEADS)
    with pytest.raises(Fp4ScaleError, match="one layout on one device"):
        fp4_scale_pools(k, buffers(linear, "v"), PAGE, HEADS)
    with pytest.raises(Fp4ScaleError, match="no slot rows of head_num=3 heads"):
        fp4_scale_pools(buffers(linear, "k"), buffers(linear, "v"), PAGE, 3)
    with pytest.raises(Fp4ScaleError, match="no slot rows of head_num=3 heads"):
        fp4_scale_pools(buffers(flat, "k"), buffers(flat, "v"), PAGE, 3)
    with pytest.raises(Fp4ScaleError, match="not whole pages of page_size=64"):
        fp4_scale_pools(buffers(linear, "k"), buffers(linear, "v"), 64, HEADS)
    with pytest.raises(Fp4ScaleError, match="not slot rows one after another"):
        odd = [t[:, :, :4] for t in buffers(linear, "k")]
        fp4_scale_pools(odd, odd, PAGE, HEADS)
    with pytest.raises(Fp4ScaleError, match="needs both multiples of 4"):
        six = [torch.zeros(6, HEADS, 6, SF, dtype=torch.uint8)]
        fp4_scale_pools(six, six, 6, HEADS)
    with pytest.raises(Fp4ScaleError, match=re.escape("k_scale_buffer[0] is [0, 4, 8], not")):
        empty = [torch.zeros(0, HEADS, SF, dtype=torch.uint8)]
        fp4_scale_pools(empty, empty, PAGE, HEADS)
    # their float8 views read as the same pages
    e4m3 = fp4_scale_pools(
        [t.view(torch.float8_e4m3fn) for t in k], [t.view(torch.float8_e4m3fn) for t in v], PAGE, HEADS
    )
    block_map(e4m3["k"], registrations(pool(None, "native"))["k"], [1], [1])


def test_the_host_pool_is_refused_where_it_is_no_such_pool() -> None:
    host = host_of(pool(None, "native"), 8)["k"]
    with pytest.raises(Fp4ScaleError, match="no scale page of head_num=3 heads and page_size=16"):
        fp4_host_scale_pools(host, host, PAGE, 3, native=True)
    with pytest.raises(Fp4ScaleError, match=r"not uint8 \[pages, NL, page bytes\]"):
        fp4_host_scale_pools(host.float(), host, PAGE, HEADS, native=True)
    with pytest.raises(Fp4ScaleError, match=r"not uint8 \[pages, NL, page bytes\]"):
        fp4_host_scale_pools(host[:, :0], host[:, :0], PAGE, HEADS, native=False)
    with pytest.raises(Fp4ScaleError, match="not the host pool's tensor"):
        fp4_host_scale_pools([host], host, PAGE, HEADS, native=False)
    with pytest.raises(Fp4ScaleError, match="native must be a bool"):
        fp4_host_scale_pools(host, host, PAGE, HEADS, native=1)  # type: ignore[arg-type]
    with pytest.raises(Fp4ScaleError, match=r"k_scale_host is \[8, 2, 512\] and v_scale_host \[8, 3, 512\]"):
        fp4_host_scale_pools(
            host, torch.zeros(8, LAYERS + 1, 512, dtype=torch.uint8), PAGE, HEADS, native=True
        )
    with pytest.raises(Fp4ScaleError, match="needs both multiples of 4"):
        six = torch.zeros(4, LAYERS, HEADS * 6 * SF, dtype=torch.uint8)
        fp4_host_scale_pools(six, six, 6, HEADS, native=True)
    # head_num the bytes allow but not the device pool's: its pages hold other arrays
    wrong = fp4_host_scale_pools(host, host.clone(), PAGE, HEADS // 2, native=True)
    with pytest.raises(BlockMapError):
        block_map(registrations(pool(None, "native"))["k"], wrong["k"], [1], [1])


def test_detect_reads_the_linear_scales_as_k_v_page_buffers_too() -> None:
    """NVFP4's linear scales are the pool's page buffers of sf-byte heads: a K/V
    registration of them moves the same bytes as fp4_scale_pools's."""
    src, dst = pool(12, "linear"), pool(None, "linear")
    hints = {"kv_list_layout": "k_v", "tokens_per_block": PAGE}
    a, b = (kvlayout.detect(p.k_scale_buffer + p.v_scale_buffer, "sglang", hints) for p in (src, dst))
    block_map(a, b, [2], [4], num_tokens=7).copy()
    for name in KINDS:
        for layer in range(LAYERS):
            want = torch.zeros_like(buffers(dst, name)[layer])
            want[4 * PAGE : 4 * PAGE + 7] = buffers(src, name)[layer][2 * PAGE : 2 * PAGE + 7]
            assert torch.equal(buffers(dst, name)[layer], want)


def test_detect_names_the_reader_of_the_native_and_linear_scales() -> None:
    native, flat = pool(None, "native"), pool(None, "flat")
    reader = re.escape("kvlayout.integrations.sglang.fp4_scale_pools(")
    with pytest.raises(kvlayout.DetectionError, match=reader):
        kvlayout.detect(native.native_k_scale_buffer + native.native_v_scale_buffer, "sglang")
    hints = {"kv_list_layout": "k_v", "tokens_per_block": PAGE}
    with pytest.raises(kvlayout.DetectionError, match=reader):
        kvlayout.detect(flat.k_scale_buffer + flat.v_scale_buffer, "sglang", hints)


def test_a_token_major_host_scale_pool_reads_as_a_page_first_host_pool() -> None:
    """A fork's MHATokenToKVPoolFP4Host (puntium/sglang-5090; linear scales only,
    ``scale_kv_buffer`` uint8 ``[2, size, NL, H, sf]``, page_first like its payload): its
    staged write-back puts device slot ``device_indices[i]``'s row of layer ``l`` at ``[kv,
    host_indices[i], l]``, so it reads as a page_first host pool and maps token by token."""
    src = pool(13, "linear")
    host = torch.zeros(2, 8 * PAGE, LAYERS, HEADS, SF, dtype=torch.uint8)
    on_host = kvlayout.detect(host, "sglang", {"hicache_layout": "page_first", "tokens_per_block": PAGE})
    hints = {"kv_list_layout": "k_v", "tokens_per_block": PAGE}
    device = kvlayout.detect(src.k_scale_buffer + src.v_scale_buffer, "sglang", hints)
    block_map(device, on_host, [3, 1], [2, 6], num_tokens=PAGE + 4).copy()
    moved = {2 * PAGE + i: 3 * PAGE + i for i in range(PAGE)} | {6 * PAGE + i: PAGE + i for i in range(4)}
    for kv, name in enumerate(KINDS):
        for layer in range(LAYERS):
            for slot in range(8 * PAGE):
                want = buffers(src, name)[layer][moved[slot]] if slot in moved else torch.zeros(HEADS, SF)
                assert torch.equal(host[kv, slot, layer], want.to(torch.uint8)), (name, layer, slot)
