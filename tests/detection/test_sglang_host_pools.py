"""SGLang's HiCache host pools (``mem_pool_host.kv_buffer``), read as SGLang allocates and
indexes them: a backup of a request from the device pool into the host pool, and its load
back, move every token's rows where SGLang's own transfer kernels put them."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout.transfer import BlockMapError, block_map

HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = HOST_LAYOUTS[:3]  # SGLang's MLA host pool has no page_head


def host_pool(layout: str, mla: bool, nl: int, pages: int, ps: int, nh: int, hs: int) -> torch.Tensor:
    """``HostKVCache.init_kv_buffer``'s tensor (MHA ``MHATokenToKVPoolHost``, MLA
    ``MLATokenToKVPoolHost``; an MLA row is ``kv_cache_dim`` wide), random bytes."""
    size = pages * ps
    if mla:
        dims = {
            "layer_first": (nl, size, 1, hs),
            "page_first": (size, nl, 1, hs),
            "page_first_direct": (pages, nl, ps, 1, hs),
        }[layout]
    else:
        dims = {
            "layer_first": (2, nl, size, nh, hs),
            "page_first": (2, size, nl, nh, hs),
            "page_first_direct": (2, pages, nl, ps, nh, hs),
            "page_head": (2, pages, nh, ps, nl, hs),
        }[layout]
    return torch.randn(dims).to(torch.bfloat16)


def host_row(pool: torch.Tensor, layout: str, mla: bool, ps: int) -> Callable[[int, int, int], torch.Tensor]:
    """Token ``i``'s row of one layer's K (0) or V (1) in the pool, indexed as SGLang's
    kernels index it (``k_buffer[layer]``; ``k_buffer.transpose(0, 1)[layer]``; page
    ``i // page_size``, slot ``i % page_size``): ``[NH, HS]``, or ``[1, C]`` for MLA."""
    if mla:
        return {
            "layer_first": lambda kv, layer, i: pool[layer, i],
            "page_first": lambda kv, layer, i: pool[i, layer],
            "page_first_direct": lambda kv, layer, i: pool[i // ps, layer, i % ps],
        }[layout]
    return {
        "layer_first": lambda kv, layer, i: pool[kv, layer, i],
        "page_first": lambda kv, layer, i: pool[kv].transpose(0, 1)[layer, i],
        "page_first_direct": lambda kv, layer, i: pool[kv, i // ps, layer, i % ps],
        "page_head": lambda kv, layer, i: pool[kv, i // ps, :, i % ps, layer],
    }[layout]


def device_pool(mla: bool, nl: int, size: int, nh: int, hs: int) -> list[Any]:
    """What SGLang's device pools register: ``[k_buffer, v_buffer]`` (MHA), ``kv_buffer`` (MLA)."""
    if mla:
        return [torch.randn(size, 1, hs).to(torch.bfloat16) for _ in range(nl)]
    return [[torch.randn(size, nh, hs).to(torch.bfloat16) for _ in range(nl)] for _ in range(2)]


def device_row(dev: list[Any], mla: bool) -> Callable[[int, int, int], torch.Tensor]:
    if mla:
        return lambda kv, layer, i: dev[layer][i]
    return lambda kv, layer, i: dev[kv][layer][i]


@st.composite
def requests(draw: st.DrawFn) -> dict:  # type: ignore[type-arg]
    mla = draw(st.booleans())
    return dict(
        layout=draw(st.sampled_from(MLA_LAYOUTS if mla else HOST_LAYOUTS)),
        mla=mla,
        nl=draw(st.integers(1, 3)),
        pages=draw(st.integers(2, 5)),
        ps=draw(st.sampled_from([1, 2, 4])),
        nh=1 if mla else draw(st.integers(1, 3)),
        hs=draw(st.sampled_from([4, 8])),
        in_pages=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=60, deadline=None)
@given(requests())
def test_a_backup_and_its_load_move_each_token_where_sglang_reads_it(r: dict) -> None:  # type: ignore[type-arg]
    torch.manual_seed(r["seed"])
    layout, mla, nl, pages, ps, nh, hs = (r[k] for k in ("layout", "mla", "nl", "pages", "ps", "nh", "hs"))
    host = host_pool(layout, mla, nl, pages, ps, nh, hs)
    dev = device_pool(mla, nl, (pages + 1) * ps, nh, hs)
    hints: dict[str, object] = {"hicache_layout": layout}
    dev_hints: dict[str, object] = {}
    if r["in_pages"]:
        hints["tokens_per_block"] = dev_hints["tokens_per_block"] = ps
    host_reg = kvlayout.detect(host, "sglang", hints)
    dev_reg = kvlayout.detect(dev, "sglang", dev_hints or None)
    gen = torch.Generator().manual_seed(r["seed"])
    n_pages = int(torch.randint(1, pages + 1, (), generator=gen))
    dev_pages = torch.randperm(pages + 1, generator=gen)[:n_pages].tolist()
    host_pages = torch.randperm(pages, generator=gen)[:n_pages].tolist()
    tokens = n_pages * ps - int(torch.randint(0, ps, (), generator=gen))  # a partial last page
    dev_ids, host_ids = dev_pages, host_pages
    dev_bs = host_bs = None
    if not r["in_pages"]:  # token indices, as SGLang's HiCache controller passes them
        dev_ids, dev_bs = [p * ps + j for p in dev_pages for j in range(ps)][:tokens], 1
        if layout in ("layer_first", "page_first"):  # a pool whose pages are one axis of token slots
            host_ids, host_bs = [p * ps + j for p in host_pages for j in range(ps)][:tokens], 1
    dev_idx = [p * ps + j for p in dev_pages for j in range(ps)][:tokens]
    host_idx = [p * ps + j for p in host_pages for j in range(ps)][:tokens]
    read_host, read_dev = host_row(host, layout, mla, ps), device_row(dev, mla)
    kvs = 1 if mla else 2
    before = host.clone()
    backup = block_map(dev_reg, host_reg, dev_ids, host_ids, num_tokens=tokens, src_block_size=dev_bs,
                       dst_block_size=host_bs)  # fmt: skip
    backup.copy()
    written = torch.zeros_like(host, dtype=torch.bool)
    for kv in range(kvs):
        for layer in range(nl):
            for d, h in zip(dev_idx, host_idx, strict=True):
                assert torch.equal(read_host(kv, layer, h), read_dev(kv, layer, d)), (kv, layer, d, h)
    # nothing else in the pool changed: mark the rows written through SGLang's own indexing
    marks = written.view(torch.uint8)
    read_marks = host_row(marks, layout, mla, ps)
    for kv in range(kvs):
        for layer in range(nl):
            for h in host_idx:
                read_marks(kv, layer, h).fill_(1)
    assert torch.equal(host[~written], before[~written])
    assert backup.num_bytes == kvs * nl * tokens * nh * hs * 2
    # and back: the load writes the device rows from the host rows
    tensors: list[torch.Tensor] = dev if mla else [*dev[0], *dev[1]]
    for t in tensors:
        t.zero_()
    block_map(host_reg, dev_reg, host_ids, dev_ids, num_tokens=tokens, src_block_size=host_bs,
              dst_block_size=dev_bs).copy()  # fmt: skip
    for kv in range(kvs):
        for layer in range(nl):
            for d, h in zip(dev_idx, host_idx, strict=True):
                assert torch.equal(read_dev(kv, layer, d), read_host(kv, layer, h))


@pytest.mark.parametrize(
    ("layout", "runs"),
    [
        # a page of 16 consecutive tokens, Llama-like (32 layers, 8 heads): per K/V ...
        ("layer_first", 2 * 32),  # ... a layer's tokens are one run on both sides
        ("page_first", 2 * 32 * 16),  # ... a token's row of a layer sits between other layers'
        ("page_first_direct", 2 * 32),  # ... a layer's page is one run
        ("page_head", 2 * 32 * 16 * 8),  # ... a head's row of a layer and token is its own run
    ],
)
def test_a_page_backs_up_in_as_few_runs_as_the_host_layout_allows(layout: str, runs: int) -> None:
    host = torch.zeros(host_pool(layout, False, 32, 4, 16, 8, 16).shape, dtype=torch.bfloat16)
    dev = [[torch.zeros(128, 8, 16, dtype=torch.bfloat16) for _ in range(32)] for _ in range(2)]
    hints = {"hicache_layout": layout, "tokens_per_block": 16}
    m = block_map(kvlayout.detect(dev, "sglang", {"tokens_per_block": 16}), kvlayout.detect(host, "sglang", hints),
                  [5], [2])  # fmt: skip
    assert m.num_runs == runs and m.num_bytes == 2 * 32 * 16 * 8 * 16 * 2


@pytest.mark.parametrize(
    ("layout", "shape", "fmt", "fmt_in_pages"),
    [
        ("layer_first", (2, 3, 32, 4, 8), F.TWO_NL_NBBS_NH_HS, F.TWO_NL_NB_BS_NH_HS),
        ("page_first", (2, 32, 3, 4, 8), F.TWO_NBBS_NL_NH_HS, F.TWO_NB_BS_NL_NH_HS),
        ("page_first_direct", (2, 8, 3, 4, 4, 8), F.TWO_NB_NL_BS_NH_HS, F.TWO_NB_NL_BS_NH_HS),
        ("page_head", (2, 8, 4, 4, 3, 8), F.TWO_NB_NH_BS_NL_HS, F.TWO_NB_NH_BS_NL_HS),
        ("layer_first", (3, 32, 1, 576), F.NL_NBBS_ONE_HS, F.NL_NB_BS_ONE_HS),
        ("page_first", (32, 3, 1, 576), F.NBBS_NL_ONE_HS, F.NB_BS_NL_ONE_HS),
        ("page_first_direct", (8, 3, 4, 1, 576), F.NB_NL_BS_ONE_HS, F.NB_NL_BS_ONE_HS),
        # one KV head per rank (8 heads at TP 8): still MHA, never an MLA pool read in pages
        ("layer_first", (2, 3, 32, 1, 8), F.TWO_NL_NBBS_NH_HS, F.TWO_NL_NB_BS_NH_HS),
    ],
)
def test_each_host_layout_is_its_format(layout: str, shape: tuple[int, ...], fmt: F, fmt_in_pages: F) -> None:
    pool = torch.zeros(shape, dtype=torch.bfloat16)
    reg = kvlayout.detect(pool, "sglang", {"hicache_layout": layout})
    assert reg.only_group().format is fmt and reg.only_group().layers == (0, 1, 2)
    paged = kvlayout.detect(pool, "sglang", {"hicache_layout": layout, "tokens_per_block": 4})
    group = paged.only_group()
    assert (group.format, group.block_size, group.num_blocks) == (fmt_in_pages, 4, 8)
    assert group.data_ptrs[0] == pool.data_ptr()  # a view of the pool, never a copy


@pytest.mark.parametrize(
    ("kv", "hints", "error", "message"),
    [
        (
            torch.zeros(2, 3, 32, 4, 8),
            None,
            kvlayout.DetectionError,
            "a HiCache host pool's kv_buffer is one tensor: pass layout hint hicache_layout (mem_pool_host.layout)",
        ),
        (
            [torch.zeros(32, 1, 8)],
            {"hicache_layout": "page_first"},
            kvlayout.DetectionError,
            "SGLang: layout hint hicache_layout=page_first names a HiCache host pool, which is one tensor "
            "(mem_pool_host.kv_buffer), not kv_caches[0]: shape (32, 1, 8)",
        ),
        (
            torch.zeros(2, 3, 32, 4, 8),
            {"hicache_layout": "page_head"},
            kvlayout.DetectionError,
            "SGLang HiCache host pool (hicache_layout=page_head): kv_buffer is [2, NB, NH, BS, NL, HS] (an MLA "
            "pool has no page_head layout), not kv_caches: shape (2, 3, 32, 4, 8)",
        ),
        (
            torch.zeros(3, 32, 2, 8),
            {"hicache_layout": "page_first"},
            kvlayout.DetectionError,
            "SGLang HiCache host pool (hicache_layout=page_first): kv_buffer is [2, PBS, NL, NH, HS] or "
            "[PBS, NL, 1, HS] (a DSA indexer pool: uint8 pages of page_size records, given tokens_per_block), "
            "not kv_caches: shape (3, 32, 2, 8), dtype torch.float32 (SGLang: the registration "
            "(kv_caches: shape (3, 32, 2, 8), dtype torch.float32) fits no SGLang format",
        ),
        (
            torch.zeros(2, 3, 30, 4, 8),
            {"hicache_layout": "layer_first", "tokens_per_block": 4},
            kvlayout.DetectionError,
            "SGLang HiCache host pool (hicache_layout=layer_first): PBS=30 token slots are not divisible by "
            "tokens_per_block=4",
        ),
        (
            [torch.zeros(3, 32, 4, 8), torch.zeros(3, 32, 4, 8)],
            None,
            kvlayout.DetectionError,
            "a HiCache host pool's K and V halves (mem_pool_host.kv_buffer[0] and [1]) are one tensor: pass "
            "kv_buffer itself with layout hint hicache_layout",
        ),
        (
            torch.zeros(2, 8, 4, 4, 3, 8),
            {"hicache_layout": "page_head", "kv_layout": "NHD"},
            kvlayout.LayoutHintError,
            "SGLang HiCache host pool (hicache_layout=page_head): layout hint kv_layout=NHD contradicts it: its "
            "heads are before its tokens ([2, NB, NH, BS, NL, HS])",
        ),
        (
            torch.zeros(2, 3, 32, 4, 8),
            {"hicache_layout": "layer_first", "kv_list_layout": "k_v"},
            kvlayout.LayoutHintError,
            "layout hint kv_list_layout=k_v says how a device pool lists its layers; a host pool is one tensor",
        ),
        (
            torch.zeros(2, 3, 32, 4, 8),
            {"hicache_layout": "page_first_split"},
            kvlayout.LayoutHintError,
            "layout hint hicache_layout='page_first_split' is not one of layer_first, page_first, "
            "page_first_direct, page_head, page_first_kv_split",
        ),
        (
            torch.zeros(2, 8, 3, 4, 4, 8),
            {"hicache_layout": "page_first_kv_split"},
            kvlayout.DetectionError,
            "SGLang HiCache host pool (hicache_layout=page_first_kv_split): kv_buffer is [NB, NL, BS, 1, HS] "
            "(Ascend's MLA host pool: k_buffer, its kv_buffer, and v_buffer each such a tensor, read one apart "
            "from the other; an MHA pool has no page_first_kv_split layout), not kv_caches: shape (2, 8, 3, 4, "
            "4, 8)",
        ),
    ],
)
def test_what_is_not_a_host_pool_says_why(
    kv: object, hints: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        kvlayout.detect(kv, "sglang", hints)  # type: ignore[arg-type]


def test_the_hint_is_spelled_in_any_case_and_listed() -> None:
    assert (*HOST_LAYOUTS, "page_first_kv_split") == kvlayout.HICACHE_LAYOUT_NAMES  # Ascend's MLA pool
    assert kvlayout.LayoutHints(hicache_layout="Page_First").hicache_layout == "page_first"  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_a_dsa_indexer_pool_backs_up_and_loads_whole_pages(layout: str) -> None:
    """``DSAIndexerPoolHost``: uint8 pages of page_size 132-byte records (128 fp8 values,
    then a scale, a token), indexed by page: ``[NL, pages, bytes]`` layer_first, ``[pages,
    NL, 1, bytes]`` in both page-first layouts; the device's indexer pages are SGLang's
    ``[pages, page_size * 132]`` a layer."""
    nl, pages, ps = 3, 6, 4
    gen = torch.Generator().manual_seed(3)
    shape = (nl, pages, ps * 132) if layout == "layer_first" else (pages, nl, 1, ps * 132)
    pool = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)

    def page(layer: int, p: int) -> torch.Tensor:
        return pool[layer, p] if layout == "layer_first" else pool[p, layer, 0]

    device = [torch.randint(0, 256, (8, ps * 132), dtype=torch.uint8, generator=gen) for _ in range(nl)]
    host = kvlayout.detect(pool, "sglang", {"hicache_layout": layout, "tokens_per_block": ps})
    assert host.only_group().format is (F.NL_NB_BSV_BSS if layout == "layer_first" else F.NB_NL_BSV_BSS)
    dev = kvlayout.detect(device, "sglang")
    before = pool.clone()
    backup = block_map(dev, host, [5, 2], [1, 4])
    assert backup.num_runs == 2 * nl  # a page's records are one run a layer on both sides
    backup.copy()
    for layer in range(nl):
        assert torch.equal(page(layer, 1), device[layer][5]) and torch.equal(page(layer, 4), device[layer][2])
        for p in (0, 2, 3, 5):
            assert torch.equal(
                page(layer, p), before[layer, p] if layout == "layer_first" else before[p, layer, 0]
            )
    for t in device:
        t.zero_()
    block_map(host, dev, [4, 1], [0, 7]).copy()
    for layer in range(nl):
        assert torch.equal(device[layer][0], page(layer, 4)) and torch.equal(device[layer][7], page(layer, 1))
    if layout == "page_first":  # without the page size it reads as MLA latents, and maps to no indexer
        latents = kvlayout.detect(pool, "sglang", {"hicache_layout": layout})
        with pytest.raises(BlockMapError, match="they do not hold the same data"):
            block_map(dev, latents, [5], [1], dst_block_size=1)


def test_token_slots_given_for_blocks_say_what_a_block_id_is() -> None:
    device = kvlayout.detect([[torch.zeros(64, 2, 8) for _ in range(2)] for _ in range(2)], "sglang")
    pool = kvlayout.detect(torch.zeros(2, 4, 2, 16, 2, 8), "sglang", {"hicache_layout": "page_first_direct"})
    with pytest.raises(
        BlockMapError,
        match=re.escape(
            "dst_blocks has 16 block ids; the request's 16 tokens (what the shorter block list holds) fill 1 block "
            "of 16: a block id names a block of 16 tokens, not a token slot (give a token's slot over 16)"
        ),
    ):
        block_map(device, pool, list(range(16)), list(range(16, 32)), src_block_size=1)


@pytest.mark.parametrize("engine", ["vllm", "trtllm", "atom", "max"])
def test_another_engine_given_the_hint_says_it_does_not_read_it(engine: str) -> None:
    label = {"vllm": "vLLM", "trtllm": "TRT-LLM", "atom": "ATOM", "max": "MAX"}[engine]
    with pytest.raises(
        kvlayout.LayoutHintError,
        match=re.escape(f"layout hint hicache_layout is SGLang's, and {label} does not read it"),
    ):
        kvlayout.detect(torch.zeros(2, 32, 3, 4, 8), engine, {"hicache_layout": "page_first"})


@pytest.mark.parametrize("tokens_per_block", [1, 2])
def test_padded_slots_read_in_blocks_of_one_only(tokens_per_block: int) -> None:
    """A pool whose slots are padded apart (an MLA ``page_first`` pool here, as SGLang's
    unified pool strides its Mamba views) reads in blocks of one slot: the padding lies
    between blocks, and a backup from a device pool writes only the slots' rows. Blocks of
    two would keep the padding between their rows: refused."""
    raw = torch.full((8 * 200,), 7, dtype=torch.int16)
    pool = raw.as_strided((8, 3, 1, 64), (200, 64, 64, 1))  # [slots, NL, 1, C], 8 padding elements a slot
    hints = {"hicache_layout": "page_first", "tokens_per_block": tokens_per_block}
    if tokens_per_block != 1:
        with pytest.raises(kvlayout.DetectionError, match="padded rows cannot be split into blocks"):
            kvlayout.detect(pool, "sglang", hints)
        return
    host = kvlayout.detect(pool, "sglang", hints)
    device = [torch.randn(8, 1, 64).to(torch.int16) for _ in range(3)]
    block_map(kvlayout.detect(device, "sglang"), host, [2, 5], [6, 1], src_block_size=1).copy()
    expected = torch.full_like(raw, 7)
    rows = expected.as_strided((8, 3, 1, 64), (200, 64, 64, 1))
    for s, d in ((2, 6), (5, 1)):
        for layer in range(3):
            rows[d, layer] = device[layer][s]
    assert torch.equal(raw, expected)
