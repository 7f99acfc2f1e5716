"""vLLM 0.33's own offload and staging buffers as block-map destinations.

Each oracle is the connector's own copy, written from its indexing: the OffloadingConnector's
CPU tier (``v1/kv_offload/cpu/gpu_worker.py``, direct and canonical layouts), the
NixlConnector's host staging buffer (``nixl/base_worker.py`` ``initialize_host_xfer_buffer``
and the platforms' ``swap_out_blocks_to_host``) and the Mooncake store's TP-sharded objects
(``mooncake/store/data.py`` ``TPShardedStoreLayout``). kvlayout describes each destination as
views of the buffer (docs/block-maps.md, "vLLM's own tiers") and its map must move the bytes
the connector's copy does."""

from __future__ import annotations

import pytest
import torch

import kvlayout
from kvlayout.integrations.vllm import apply_kv_cache_group_edits, transfer_layers
from kvlayout.testing.vllm import (
    FLASH_ATTN,
    FLASHINFER,
    AttentionModel,
    Backend,
    Engine,
    allocate_v033,
    attention_spec,
    uniform_engine,
)
from kvlayout.transfer import Shard, block_map

pytest.importorskip("vllm.v1.kv_cache_interface")
from vllm.v1.kv_cache_interface import group_kernel_blocks
from vllm.v1.kv_cache_layout import KVCacheLayout

MODEL = AttentionModel("Llama-3-8B-like, 4 layers", 4, 8, 128, torch.bfloat16)
NB, BS = 6, 16


def engine_cache(
    layout: str, tp: int, backend: Backend = FLASH_ATTN, block_size: int = BS, seed: int = 0
) -> tuple[Engine, torch.Tensor, dict[str, torch.Tensor]]:
    """One rank's registration as vLLM 0.33 allocates it, filled with random bytes."""
    spec = attention_spec(MODEL, tp, block_size)
    engine = uniform_engine(
        spec, backend, num_layers=MODEL.num_hidden_layers, num_blocks=NB, layout=KVCacheLayout[layout]
    )
    buf, kv = allocate_v033(engine)
    buf.copy_(
        torch.randint(-128, 128, buf.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
    )
    return engine, buf, kv


def detected(engine: Engine, kv: dict[str, torch.Tensor], layout: str) -> kvlayout.Registration:
    hints = {"kv_layout": layout}
    layers, groups = transfer_layers(engine.config, apply_kv_cache_group_edits(engine.config, kv, hints))
    return kvlayout.detect(layers, "vllm", hints, layer_groups=groups)


# -- OffloadingConnector, direct CPU tier ---------------------------------------------


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC", "BHLNC", "LBNHC"])
@pytest.mark.parametrize(("backend", "block_size"), [(FLASH_ATTN, 16), (FLASHINFER, 128)])
def test_offloading_cpu_tier(layout: str, backend: Backend, block_size: int) -> None:
    """offloading/worker.py:96-160: each layer's ``[num_blocks, page]`` bytes (one region for
    block-outermost layouts, whose layer views are a block's slices); gpu_worker.py:830-850:
    a CPU tensor ``[num_cpu_chunks, page * blocks_per_chunk]`` per region, and
    ``compute_sub_block_ptrs``: sub-block ``j`` of chunk ``c`` at ``c * row + j * page``.
    The tier is the device layout with ``chunks * blocks_per_chunk`` blocks."""
    chunks, per_chunk = 4, 2
    engine, _, kv = engine_cache(layout, 2, backend, block_size)
    tier_engine = uniform_engine(
        attention_spec(MODEL, 2, block_size),
        backend,
        num_layers=MODEL.num_hidden_layers,
        num_blocks=chunks * per_chunk,
        layout=KVCacheLayout[layout],
    )
    page = engine.config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    views = {n: group_kernel_blocks(v, NB) for n, v in kv.items()}
    regions = {}
    for n, v in views.items():
        es = v.element_size()
        regions[n] = torch.tensor([], dtype=torch.int8).set_(
            v.untyped_storage(), v.storage_offset() * es, (NB, page), (v.stride(0) * es, 1)
        )
    packed = next((r for r in regions.values() if r.stride(0) != r.shape[1]), None)
    if packed is not None:  # one region of whole blocks from the allocation's start
        stride = packed.stride(0)
        tensors = {"all": (packed.as_strided((NB, stride), (stride, 1), storage_offset=0), stride)}
        region_of = dict.fromkeys(kv, "all")
    else:
        tensors = {n: (r, page) for n, r in regions.items()}
        region_of = {n: n for n in kv}
    want = {k: torch.zeros(chunks, t.shape[1] * per_chunk, dtype=torch.int8) for k, (t, _) in tensors.items()}
    got = {k: torch.zeros_like(w) for k, w in want.items()}
    gpu_blocks, slots = [5, 1, 2, 0], [(3, 1), (0, 0), (0, 1), (2, 0)]
    for g, (c, j) in zip(gpu_blocks, slots, strict=True):
        for k, (t, size) in tensors.items():
            want[k][c, j * t.shape[1] : j * t.shape[1] + size] = t[g, :size]
    tier = {}
    for n, v in kv.items():
        region, _ = tensors[region_of[n]]
        offset = v.storage_offset() * v.element_size() - region.storage_offset()
        shape = (v.shape[0] * chunks * per_chunk // NB, *v.shape[1:])
        tier[n] = (
            got[region_of[n]].view(-1).view(v.dtype).as_strided(shape, v.stride(), offset // v.element_size())
        )
    src, dst = detected(engine, kv, layout), detected(tier_engine, tier, layout)
    block_map(src, dst, gpu_blocks, [c * per_chunk + j for c, j in slots]).copy()
    for k, w in want.items():
        assert torch.equal(got[k], w), k


@pytest.mark.parametrize("per_chunk", [1, 2])
@pytest.mark.parametrize("tp", [1, 2])
def test_offloading_canonical_nhd_tier(tp: int, per_chunk: int) -> None:
    """The canonical (TP-agnostic) tier, ``canonical_layout=True``: canonical_mapping.py
    ``_packed_kv_regions`` (NHD) puts rank ``r``'s token rows at ``r * row`` in a canonical
    token row of every head; shared_offload_region.py ``create_next_canonical_view`` lays
    each chunk row out as every layer's ``blocks_per_chunk`` canonical pages side by side.
    A layer's chunk is then one NHD block of ``blocks_per_chunk * BS`` tokens of all heads:
    a TP 1 ``LBNHC`` cache whose block stride is the chunk row."""
    chunks, heads, row_bytes = 5, MODEL.num_key_value_heads, 2 * MODEL.head_dim * 2
    layers = MODEL.num_hidden_layers
    cpage = BS * heads * row_bytes
    row = layers * per_chunk * cpage
    want, got = torch.zeros(chunks * row, dtype=torch.int8), torch.zeros(chunks * row, dtype=torch.int8)
    gpu_blocks = [4, 1, 2]
    skip = per_chunk - 1  # a store that starts at the chunk's last sub-block
    slots = [divmod(i + skip, per_chunk) for i in range(len(gpu_blocks))]
    flat = got.view(torch.bfloat16)
    tier = [
        flat.as_strided(
            (chunks, per_chunk * BS, heads, 2 * MODEL.head_dim),
            (row // 2, heads * row_bytes // 2, row_bytes // 2, 1),
            lay * per_chunk * cpage // 2,
        )
        for lay in range(layers)
    ]
    dst = kvlayout.detect(tier, "vllm", {"kv_layout": "LBNHC"})
    for rank in range(tp):
        engine, _, kv = engine_cache("LBNHC", tp, seed=rank)
        local = heads // tp
        for lay, v in enumerate(kv.values()):
            for g, (c, j) in zip(gpu_blocks, slots, strict=True):
                block = (
                    v[g].permute(1, 0, 2).contiguous().view(torch.int8).view(BS, local * row_bytes)
                )  # [N, H_local, 2*hs]
                base = c * row + lay * per_chunk * cpage + j * cpage + rank * local * row_bytes
                for t in range(BS):
                    start = base + t * heads * row_bytes
                    want[start : start + local * row_bytes] = block[t]
        src = detected(engine, kv, "LBNHC")
        block_map(
            src,
            dst,
            [gpu_blocks[0]] * skip + gpu_blocks,
            sorted({c for c, _ in slots}),
            first_token=skip * BS,
            num_tokens=(skip + len(gpu_blocks)) * BS,
            src_shard=Shard(rank, tp, heads),
            dst_block_size=per_chunk * BS,
        ).copy()
    assert torch.equal(got, want)


# -- NixlConnector, kv_buffer_device=cpu ----------------------------------------------


@pytest.mark.parametrize(
    ("layout", "host_layout", "permuted"),
    [
        ("LBHNC", "LBHNC", False),
        ("LBNHC", "LBNHC", True),
        ("LBNHC", "LBHNC", False),
        ("BHLNC", "LBHNC", False),
    ],
)
def test_nixl_host_buffer(layout: str, host_layout: str, permuted: bool) -> None:
    """base_worker.py:1280-1322: a host tensor per registered layer, ``torch.empty`` of its
    logical ``[B, H, N, C]`` shape (HND memory), or under LBNHC without
    ``enable_permute_local_kv`` ``[B, N, H, C]`` permuted back (NHD memory); cuda.py:671-680
    copies by logical block index, so a BHLNC device cache or an LBNHC one with the permute
    flag lands re-laid in HND memory."""
    engine, _, kv = engine_cache(layout, 2)
    host, want = {}, {}
    for n, v in kv.items():
        shape = (v.shape[0], v.shape[2], v.shape[1], v.shape[3]) if permuted else tuple(v.shape)
        host[n], want[n] = (
            torch.zeros(shape, dtype=v.dtype).permute(0, 2, 1, 3)
            if permuted
            else torch.zeros(shape, dtype=v.dtype)
            for _ in range(2)
        )
    src_ids, dst_ids = [5, 0, 1], [2, 3, 0]
    for n, v in kv.items():
        want[n][dst_ids] = v[src_ids]
    block_map(detected(engine, kv, layout), detected(engine, host, host_layout), src_ids, dst_ids).copy()
    for n in kv:  # as bytes: random bf16 holds NaNs
        assert torch.equal(host[n].view(torch.int16), want[n].view(torch.int16)), n


def test_nixl_host_buffer_in_kernel_pages() -> None:
    """FlashInfer's 64-token kernel pages of 128-token blocks in an HND host buffer: the
    group edits' opaque pages declare their heads and tokens, so the host buffer through
    the edits reads as its kernel pages and maps from the NHD device cache by block ids;
    read as it is (kernel pages as blocks), by scheduler block ids (``dst_block_size``).
    Both land the same bytes. Before, the edited host buffer was refused."""
    engine, _, kv = engine_cache("LBNHC", 1, FLASHINFER, 128)
    src_ids, dst_ids = [5, 0], [1, 4]
    want = {n: torch.zeros_like(v) for n, v in kv.items()}
    for n, v in kv.items():  # kernel pages 2b, 2b + 1 of block b
        want[n][[2 * b + i for b in dst_ids for i in (0, 1)]] = v[
            [2 * b + i for b in src_ids for i in (0, 1)]
        ]
    hosts = [{n: torch.zeros(v.shape, dtype=v.dtype) for n, v in kv.items()} for _ in range(2)]
    block_map(detected(engine, kv, "LBNHC"), detected(engine, hosts[0], "LBHNC"), src_ids, dst_ids).copy()
    raw = kvlayout.detect(list(hosts[1].values()), "vllm", {"kv_layout": "LBHNC"})
    block_map(detected(engine, kv, "LBNHC"), raw, src_ids, dst_ids, dst_block_size=128).copy()
    for host in hosts:
        for n in kv:
            assert torch.equal(host[n].view(torch.int16), want[n].view(torch.int16)), n


# -- Mooncake store, TP-sharded objects -----------------------------------------------


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize(("tp", "store_tp"), [(1, 2), (2, 2), (2, 4)])
def test_mooncake_tp_sharded_objects(layout: str, tp: int, store_tp: int) -> None:
    """data.py:418-555: a block's object for store shard ``s`` is every layer's segments in
    order, LBHNC one run of the shard's heads, LBNHC a run of them per token: a buffer of
    objects is a block-outermost cache of the shard's heads (``BLHNC`` / ``BLNHC`` views),
    the store's heads named by ``dst_shard``."""
    heads, layers = MODEL.num_key_value_heads, MODEL.num_hidden_layers
    shard_heads, content = heads // store_tp, 2 * MODEL.head_dim
    objects, gpu_blocks = 4, [5, 2, 0]
    page = shard_heads * BS * content
    for rank in range(tp):
        engine, buf, kv = engine_cache(layout, tp, seed=rank)
        src = detected(engine, kv, layout)
        for local in range(store_tp // tp):
            want = torch.zeros(objects, layers * page * 2, dtype=torch.int8)
            for k, b in enumerate(gpu_blocks):
                parts = []
                for v in kv.values():
                    es = v.element_size()
                    block_stride, head_stride, token_stride, _ = (s * es for s in v.stride())
                    start = (
                        v.data_ptr() - buf.data_ptr() + b * block_stride + local * shard_heads * head_stride
                    )
                    if layout == "LBHNC":
                        parts.append(buf[start : start + shard_heads * head_stride])
                    else:
                        parts += [
                            buf[
                                start + t * token_stride : start
                                + t * token_stride
                                + shard_heads * content * es
                            ]
                            for t in range(BS)
                        ]
                want[k + 1] = torch.cat(parts)
            got = torch.zeros_like(want)
            flat = got.view(-1).view(torch.bfloat16)
            order = (BS * content, content) if layout == "LBHNC" else (content, shard_heads * content)
            views = [
                flat.as_strided((objects, shard_heads, BS, content), (layers * page, *order, 1), lay * page)
                for lay in range(layers)
            ]
            dst = kvlayout.detect(views, "vllm", {"kv_layout": "BL" + layout[2:]})
            shard = rank * (store_tp // tp) + local
            block_map(
                src,
                dst,
                gpu_blocks,
                [1, 2, 3],
                src_shard=Shard(rank, tp, heads),
                dst_shard=Shard(shard, store_tp, heads),
            ).copy()
            assert torch.equal(got, want), (rank, shard)


@pytest.mark.parametrize("tp", [1, 2])
def test_offloading_canonical_hnd_tier_by_sub_block(tp: int) -> None:
    """canonical_mapping.py ``_packed_kv_regions`` (HND): rank ``r``'s head ``h`` is one run
    at head ``r * H / tp + h`` of a canonical page ``[H, BS, 2*hs]``. A chunk of two blocks
    is ``[2, H, BS, 2*hs]`` among the other layers' chunks, so no one block stride reaches
    both sub-blocks: each sub-block position is a registration of its own, chunks as
    blocks, and a store is a map per position."""
    chunks, per_chunk, heads, row_bytes = 4, 2, MODEL.num_key_value_heads, 2 * MODEL.head_dim * 2
    layers, local = MODEL.num_hidden_layers, MODEL.num_key_value_heads // tp
    cpage = heads * BS * row_bytes
    row = layers * per_chunk * cpage
    want, got = torch.zeros(chunks * row, dtype=torch.int8), torch.zeros(chunks * row, dtype=torch.int8)
    gpu_blocks, slots = [4, 1, 2, 5], [(1, 1), (2, 0), (2, 1), (0, 0)]
    flat = got.view(torch.bfloat16)
    positions = [
        kvlayout.detect(
            [
                flat.as_strided(
                    (chunks, heads, BS, 2 * MODEL.head_dim),
                    (row // 2, BS * row_bytes // 2, row_bytes // 2, 1),
                    (lay * per_chunk + j) * cpage // 2,
                )
                for lay in range(layers)
            ],
            "vllm",
            {"kv_layout": "LBHNC"},
        )
        for j in range(per_chunk)
    ]
    for rank in range(tp):
        engine, _, kv = engine_cache("LBHNC", tp, seed=rank)
        for lay, v in enumerate(kv.values()):
            for g, (c, j) in zip(gpu_blocks, slots, strict=True):
                for h in range(local):
                    start = c * row + (lay * per_chunk + j) * cpage + (rank * local + h) * BS * row_bytes
                    want[start : start + BS * row_bytes] = v[g, h].contiguous().view(torch.int8).view(-1)
        src = detected(engine, kv, "LBHNC")
        for j, dst in enumerate(positions):
            pairs = [(g, c) for g, (c, jj) in zip(gpu_blocks, slots, strict=True) if jj == j]
            block_map(
                src, dst, [g for g, _ in pairs], [c for _, c in pairs], src_shard=Shard(rank, tp, heads)
            ).copy()
    assert torch.equal(got, want)
