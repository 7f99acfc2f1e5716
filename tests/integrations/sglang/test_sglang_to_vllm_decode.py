"""SGLang prefill (TP 1) into vLLM 0.33 decode (TP 2), and SGLang's HiCache host pool, as a
P/D connector meets them (pd-connectors.md, block-maps.md), byte-exact against each engine's
own indexing.

SGLang (``mem_cache/memory_pool.py``): ``MHATokenToKVPool`` allocates per layer K and V
``[size + page_size, head_num, head_dim]``, ``MLATokenToKVPool`` per layer ``[size +
page_size, 1, kv_lora_rank + qk_rope_head_dim]``; the paged allocator hands out pages from 1
(page 0 is the padded slot's), token ``t`` of a request at slot ``out_cache_loc[t] =
page[t // page_size] * page_size + t % page_size``, and the prefill hands its transfer backend
``kv_to_page_indices(out_cache_loc) = out_cache_loc[::page_size] // page_size``
(``disaggregation/utils.py``), a chunk at a time under chunked prefill (``send_kv_chunk``).
The HiCache host pool (``pool_host/mha.py`` ``init_kv_buffer``) is ``(2, layer_num, size,
head_num, head_dim)`` (``layer_first``) or ``(2, size, layer_num, head_num, head_dim)``
(``page_first``), MLA's (``pool_host/mla.py``) ``(layer_num, size, 1, C)`` or ``(size,
layer_num, 1, C)``, indexed by token slot, allocated in whole pages.

vLLM 0.33 (``v1/attention/backends/flash_attn.py``): each layer is a ``[num_blocks,
num_kv_heads, block_size, 2 * head_size]`` view of LBNHC memory, read as
``kv_cache.transpose(1, 2).split(head_size, dim=-1)``; token ``t`` at slot ``block_ids[t //
block_size] * block_size + t % block_size`` (``v1/worker/block_table.py``); TP rank ``r`` of
``tp`` holds KV heads ``[r * H // tp, (r + 1) * H // tp)``; an MLA layer is ``[num_blocks, 1,
block_size, C]``, the latents whole on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvlayout
from kvlayout.transfer import Shard, block_map, join_maps

pytest.importorskip("vllm.v1.kv_cache_interface")
import vllm.v1.kv_cache_interface as kvi
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvlayout.integrations.vllm import apply_kv_cache_group_edits, transfer_layers
from kvlayout.testing.vllm import FLASH_ATTN, Backend, allocate_v033, uniform_engine

LAYERS, HEADS, HEAD_DIM, LATENT = 3, 4, 16, 72
PAGE, PAGES = 16, 24  # SGLang: page_size, size // page_size
BLOCK, BLOCKS = 32, 14  # vLLM: block_size, num_blocks
TOKENS, TP = 150, 2
TRITON_MLA = Backend("TRITON_MLA", multiple_of=16)


def noise(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def sglang_request(seed: int) -> tuple[list[int], list[int]]:
    """``out_cache_loc`` and the page ids the prefill hands its backend."""
    gen = torch.Generator().manual_seed(seed)
    pages = [int(p) + 1 for p in torch.randperm(PAGES, generator=gen)[: -(-TOKENS // PAGE)]]
    loc = [pages[t // PAGE] * PAGE + t % PAGE for t in range(TOKENS)]
    assert [loc[i] // PAGE for i in range(0, TOKENS, PAGE)] == pages  # kv_to_page_indices
    return loc, pages


def vllm_decode(mla: bool, seed: int) -> tuple[kvlayout.Registration, list[torch.Tensor]]:
    """A decode rank's registration through the group edits, and vLLM's own per-layer views
    (noise: a byte written where it should not be shows)."""
    spec: Any
    if mla:
        spec = kvi.MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=LATENT, dtype=torch.bfloat16)
        engine = uniform_engine(spec, TRITON_MLA, num_layers=LAYERS, num_blocks=BLOCKS)
    else:
        spec = kvi.FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS // TP, head_size=HEAD_DIM, dtype=torch.bfloat16
        )
        engine = uniform_engine(
            spec, FLASH_ATTN, num_layers=LAYERS, num_blocks=BLOCKS, layout=KVCacheLayout.LBNHC
        )
    buf, kv_caches = allocate_v033(engine)
    buf.copy_(
        torch.randint(-128, 128, buf.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int8)
    )
    hints = {"kv_layout": engine.layout.name}
    layers, groups = transfer_layers(
        engine.config, apply_kv_cache_group_edits(engine.config, kv_caches, hints)
    )
    return kvlayout.detect(layers, "vllm", hints, layer_groups=groups), list(kv_caches.values())


def expected(
    before: list[torch.Tensor], planes: list[list[torch.Tensor]], loc: list[int], blocks: list[int], rank: int
) -> list[torch.Tensor]:
    """vLLM's views after the request: token t's SGLang rows at vLLM's slot, the rank's heads."""
    out = []
    for layer, view in enumerate(before):
        t = view.clone()
        if len(planes) == 1:  # MLA: [NB, 1, BS, C], the latents whole
            for tok, slot in enumerate(loc):
                t[blocks[tok // BLOCK], 0, tok % BLOCK] = planes[0][layer][slot, 0]
        else:
            heads = slice(rank * HEADS // TP, (rank + 1) * HEADS // TP)
            rows = t.transpose(1, 2)  # FlashAttention: transpose(1, 2).split(head_size, dim=-1)
            key, value = rows[..., :HEAD_DIM], rows[..., HEAD_DIM:]
            for tok, slot in enumerate(loc):
                key[blocks[tok // BLOCK], tok % BLOCK] = planes[0][layer][slot, heads]
                value[blocks[tok // BLOCK], tok % BLOCK] = planes[1][layer][slot, heads]
        out.append(t)
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("chunk", [None, 48], ids=["whole", "chunked"])
def test_a_request_lands_on_every_decode_rank_where_vllm_reads_it(mla: bool, chunk: int | None) -> None:
    rows = PAGES * PAGE + PAGE  # size + page_size: the padded page 0 included
    if mla:
        planes = [[noise((rows, 1, LATENT), 10 + i) for i in range(LAYERS)]]
        prefill = kvlayout.detect(planes[0], "sglang", {"tokens_per_block": PAGE})
    else:
        planes = [[noise((rows, HEADS, HEAD_DIM), 10 * kv + i) for i in range(LAYERS)] for kv in (1, 2)]
        prefill = kvlayout.detect(
            planes[0] + planes[1], "sglang", {"kv_list_layout": "k_v", "tokens_per_block": PAGE}
        )
    loc, pages = sglang_request(3)
    heads = 1 if mla else HEADS  # latents: Shard(rank, tp, 1), as pd-connectors.md says
    for rank in range(TP):
        decode, views = vllm_decode(mla, 20 + rank)
        before = [v.clone() for v in views]
        blocks = [
            int(b) + 1 for b in torch.randperm(BLOCKS - 1, generator=torch.Generator().manual_seed(rank))
        ]
        blocks = blocks[: -(-TOKENS // BLOCK)]
        src_shard, dst_shard = Shard(0, 1, heads), Shard(rank, TP, heads)
        assert src_shard.sends_to(dst_shard)
        cuts = (
            [(0, TOKENS)] if chunk is None else [(s, min(s + chunk, TOKENS)) for s in range(0, TOKENS, chunk)]
        )
        maps = [  # a chunk: its pages and blocks counted from token 0, its tokens from first_token
            block_map(
                prefill, decode.kernel_groups[0], pages[: -(-end // PAGE)], blocks[: -(-end // BLOCK)],
                num_tokens=end, first_token=start, src_shard=src_shard, dst_shard=dst_shard,
            )
            for start, end in cuts
        ]  # fmt: skip
        request = join_maps(maps) if len(maps) > 1 else maps[0]
        row = LATENT if mla else 2 * (HEADS // TP) * HEAD_DIM
        assert request.num_bytes == TOKENS * LAYERS * row * 2
        request.copy()
        assert same(views, expected(before, planes, loc, blocks, rank)), f"decode rank {rank}"


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("in_pages", [False, True], ids=["slots", "pages"])
def test_a_request_backed_up_to_the_hicache_host_pool_loads_into_a_fresh_device_pool(
    layout: str, mla: bool, in_pages: bool
) -> None:
    rows, host_pages = PAGES * PAGE + PAGE, 32
    shape: tuple[int, ...]
    size = host_pages * PAGE
    if mla:
        planes = [[noise((rows, 1, LATENT), 40 + i) for i in range(LAYERS)]]
        fresh = [[torch.zeros(rows, 1, LATENT, dtype=torch.bfloat16) for _ in range(LAYERS)]]
        shape = (LAYERS, size, 1, LATENT) if layout == "layer_first" else (size, LAYERS, 1, LATENT)
        hints: dict[str, object] = {}
        device_hints = dict(hints)
    else:
        planes = [[noise((rows, HEADS, HEAD_DIM), 40 + 10 * kv + i) for i in range(LAYERS)] for kv in (1, 2)]
        fresh = [
            [torch.zeros(rows, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)] for _ in "kv"
        ]
        first = (2, LAYERS, size) if layout == "layer_first" else (2, size, LAYERS)
        shape = (*first, HEADS, HEAD_DIM)
        hints = {}
        device_hints = {"kv_list_layout": "k_v"}
    if in_pages:
        hints["tokens_per_block"] = device_hints["tokens_per_block"] = PAGE
    kv_buffer = noise(shape, 7)
    host_before = kv_buffer.clone()
    host = kvlayout.detect(kv_buffer, "sglang", {"hicache_layout": layout, **hints})
    device = kvlayout.detect([t for p in planes for t in p], "sglang", device_hints)
    loc, pages = sglang_request(5)
    host_page_ids = [int(p) for p in torch.randperm(host_pages, generator=torch.Generator().manual_seed(6))]
    host_page_ids = host_page_ids[: len(pages)]
    host_loc = [host_page_ids[t // PAGE] * PAGE + t % PAGE for t in range(TOKENS)]
    ids = (pages, host_page_ids) if in_pages else (loc, host_loc)
    one = None if in_pages else 1  # host and device indices are token slots: blocks of 1
    block_map(
        device, host, *ids, num_tokens=TOKENS, src_block_size=one, dst_block_size=one
    ).copy()  # backup_from_device_all_layer
    want = host_before.clone()
    for slot, h in zip(loc, host_loc, strict=True):
        for layer in range(LAYERS):
            for kv, plane in enumerate(planes):
                where: tuple[int, ...]
                if mla:
                    where = (layer, h) if layout == "layer_first" else (h, layer)
                else:
                    where = (kv, layer, h) if layout == "layer_first" else (kv, h, layer)
                want[where] = plane[layer][slot]
    assert torch.equal(kv_buffer.view(torch.int16), want.view(torch.int16))

    back_loc, back_pages = sglang_request(8)
    target = kvlayout.detect([t for p in fresh for t in p], "sglang", device_hints)
    ids = (host_page_ids, back_pages) if in_pages else (host_loc, back_loc)
    block_map(
        host, target, *ids, num_tokens=TOKENS, src_block_size=one, dst_block_size=one
    ).copy()  # load_to_device_per_layer
    for plane, loaded in zip(planes, fresh, strict=True):
        for layer in range(LAYERS):
            wanted = torch.zeros_like(loaded[layer])
            wanted[back_loc] = plane[layer][loc]
            assert torch.equal(loaded[layer].view(torch.int16), wanted.view(torch.int16))
