"""SGLang's DeepSeek-V4 FlashMLA KV pages and ROCm FP4 indexer pages, read as whole pages.

The oracle reads the tensors as SGLang allocates them (``deepseek_v4_memory_pool.py``):
a page of a layer is ``kv_buffer[l][page]`` (or ``index_k_payload_buffer[l][page]``), its
size ``KVLayout.page_bytes(page_size)`` computed here from the kernel's table, not from
kvlayout's. It knows nothing of rows or runs; every byte outside the moved pages keeps
its value.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest
import torch

import kvlayout
from kvlayout.integrations.sglang import DeepSeekV4PoolError, aiter_fp4_indexer_pages, flashmla_kv_pages
from kvlayout.registration.peers import RegistrationDescription
from kvlayout.transfer import BlockMapError, Shard, block_map

NL, PAGES = 3, 6

# sgl-project/sglang python/sglang/kernels/ops/attention/dsv4/kv_layout.py: a slot's data
# and scale bytes, and the unit the page is padded to
KERNEL_LAYOUTS = {"v4": (576, 8, 576), "v41": (512, 16, 512), "v41_fp4": (256, 32, 256)}


def page_bytes(layout: str, page_size: int) -> int:
    data, scale, align = KERNEL_LAYOUTS[layout]
    return -(-page_size * (data + scale) // align) * align


def kv_pool(layout: str, page_size: int, seed: int | None, pages: int = PAGES) -> list[torch.Tensor]:
    """``DeepSeekV4SingleKVPool.kv_buffer``: uint8 ``[pages, page bytes]`` per layer."""
    row = page_bytes(layout, page_size)
    if seed is None:
        return [torch.zeros(pages, row, dtype=torch.uint8) for _ in range(NL)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (pages, row), dtype=torch.uint8, generator=gen) for _ in range(NL)]


def indexer_pool(page_size: int, seed: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``DeepSeekV4IndexerPool`` under ``uses_aiter_fp4_layout``: payload viewed as packed fp4."""
    gen = torch.Generator().manual_seed(seed or 0)

    def fill(shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.zeros(shape, dtype=torch.uint8)
        return t if seed is None else t.random_(0, 256, generator=gen)

    payload = [fill((PAGES, 1, 4, page_size, 16)).view(torch.float4_e2m1fn_x2) for _ in range(NL)]
    scale = [fill((PAGES, 1, 4, page_size)) for _ in range(NL)]
    return payload, scale


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("layout", list(KERNEL_LAYOUTS))
@pytest.mark.parametrize("page_size", [2, 16, 64])
def test_flashmla_pages_move_whole_between_two_pools(layout: str, page_size: int) -> None:
    src, dst = kv_pool(layout, page_size, 1), kv_pool(layout, page_size, 2)
    before = [t.clone() for t in dst]
    pages = [(4, 1), (1, 3), (5, 0)]  # scattered, out of order
    m = block_map(
        flashmla_kv_pages(src, page_size),
        flashmla_kv_pages(dst, page_size),
        [s for s, _ in pages],
        [d for _, d in pages],
        num_tokens=2 * page_size + 1,  # the last page partly filled: it moves whole
    )
    assert m.kind == "same layout" and m.num_tokens == 3 * page_size
    m.copy()
    for layer in range(NL):
        want = before[layer].clone()
        for s, d in pages:
            want[d] = src[layer][s]
        assert torch.equal(dst[layer], want), layer


def test_page_size_is_any_integer_but_a_bool() -> None:
    """A connector may read page_size from a config as a NumPy or torch integer."""
    src = kv_pool("v4", 16, 1)
    for page_size in (np.int64(16), torch.tensor(16)):
        assert flashmla_kv_pages(src, page_size).only_group().block_size == 16  # type: ignore[arg-type]
    with pytest.raises(DeepSeekV4PoolError, match=r"page_size must be a positive int .*not True"):
        flashmla_kv_pages(src, True)


def test_flashmla_pages_read_their_fp8_view() -> None:
    """``get_key_buffer`` views the uint8 store as the pool's dtype: either reads alike."""
    src, dst = kv_pool("v4", 64, 3), kv_pool("v4", 64, None)
    fp8 = [t.view(torch.float8_e4m3fn) for t in src]
    block_map(flashmla_kv_pages(fp8, 64), flashmla_kv_pages(dst, 64), [2], [5]).copy()
    assert torch.equal(dst[1][5], src[1][2]) and not dst[1][:5].any()


@pytest.mark.parametrize(
    "ranks",
    [(Shard(0, 1, 1), Shard(1, 2, 1)), (Shard(3, 4, 1), Shard(0, 2, 1)), (Shard(0, 2, 2), Shard(1, 2, 2))],
    ids=str,
)
def test_every_rank_holds_the_latents_whole(ranks: tuple[Shard, Shard]) -> None:
    """MLA latents are not sharded: any rank's page is any other's, whatever the shards
    say of the model's KV heads (one a rank, each its own, gave an empty map)."""
    src, dst = kv_pool("v4", 16, 4), kv_pool("v4", 16, None)
    m = block_map(
        flashmla_kv_pages(src, 16),
        flashmla_kv_pages(dst, 16),
        [3, 1],
        [0, 2],
        src_shard=ranks[0],
        dst_shard=ranks[1],
    )
    m.copy()
    for layer in range(NL):
        assert torch.equal(dst[layer][0], src[layer][3]) and torch.equal(dst[layer][2], src[layer][1])
        assert not dst[layer][[1, 3, 4, 5]].any()


def test_indexer_pages_move_whole_between_sglang_and_flattened_buffers() -> None:
    """SGLang's own 5-D / 4-D buffers and the ``[pages, page_size * 64]`` / ``[pages,
    page_size * 4]`` page rows its P/D and HiCache move (``contiguous_page_row_buffers``)
    are one page each."""
    payload, scale = indexer_pool(64, 5)
    flat_payload = [torch.zeros(PAGES, 64 * 64, dtype=torch.uint8) for _ in range(NL)]
    flat_scale = [torch.zeros(PAGES, 64 * 4, dtype=torch.uint8) for _ in range(NL)]
    src, dst = (
        aiter_fp4_indexer_pages(payload, scale, 64),
        aiter_fp4_indexer_pages(flat_payload, flat_scale, 64),
    )
    assert list(src) == ["payload", "scale"]
    for name in src:
        m = block_map(src[name], dst[name], [5, 2], [1, 4], num_tokens=64 + 1)
        assert m.num_tokens == 128
        m.copy()
    for layer in range(NL):
        for s, d in ((5, 1), (2, 4)):
            assert torch.equal(flat_payload[layer][d], raw(payload[layer][s]).flatten())
            assert torch.equal(flat_scale[layer][d], scale[layer][s].flatten())
        assert not flat_payload[layer][[0, 2, 3, 5]].any() and not flat_scale[layer][[0, 2, 3, 5]].any()
    # and back, between two ranks: the indexer's keys are every rank's
    back_payload, back_scale = indexer_pool(64, None)
    back = aiter_fp4_indexer_pages(back_payload, back_scale, 64)
    block_map(
        dst["payload"], back["payload"], [4], [0], src_shard=Shard(0, 2, 1), dst_shard=Shard(1, 2, 1)
    ).copy()
    assert torch.equal(raw(back_payload[2][0]), raw(payload[2][2]))


def test_a_description_round_trips_and_maps_as_the_registration() -> None:
    src, dst = kv_pool("v41", 64, 6), kv_pool("v41", 64, None)
    a, b = flashmla_kv_pages(src, 64), flashmla_kv_pages(dst, 64)
    text = b.describe().to_json()
    peer = RegistrationDescription.from_json(text)
    assert RegistrationDescription.from_json(peer.to_json()).to_json() == text
    assert block_map(a, peer, [1, 2], [3, 4]).kind == block_map(a, b, [1, 2], [3, 4]).kind == "same layout"
    other = RegistrationDescription.from_json(
        flashmla_kv_pages(kv_pool("v4", 64, None), 64).describe().to_json()
    )
    with pytest.raises(BlockMapError, match=re.escape("do not hold the same state")):
        block_map(a, other, [1], [1])


def test_a_peer_that_declares_no_arrays_maps_only_rank_to_rank() -> None:
    """A description without arrays (a peer before they were declared) does not say its
    pages are every rank's, so one side's declaration is not enough to map across ranks."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "arrays"}
        return [strip(v) for v in node] if isinstance(node, list) else node

    src, dst = kv_pool("v4", 16, 4), kv_pool("v4", 16, None)
    a = flashmla_kv_pages(src, 16)
    bare = json.loads(flashmla_kv_pages(dst, 16).describe().to_json())
    peer = RegistrationDescription.from_json(json.dumps(strip(bare)))
    assert block_map(a, peer, [3], [0]).kind == "same layout"
    with pytest.raises(BlockMapError, match="maps only to the same rank's"):
        block_map(a, peer, [3], [0], src_shard=Shard(0, 2, 1), dst_shard=Shard(1, 2, 1))


def test_a_whole_array_of_other_sizes_is_refused_whatever_the_shards() -> None:
    """An array every rank holds whole maps only to one of its sizes: a peer declaring
    fewer rows of it is refused, given shards too (which say nothing of it)."""

    def rows(node: Any) -> Any:
        if isinstance(node, dict):
            if "arrays" in node:
                node["arrays"] = [{**x, "shape": [8, *x["shape"][1:]], "parts": [8]} for x in node["arrays"]]
            return {k: rows(v) for k, v in node.items()}
        return [rows(v) for v in node] if isinstance(node, list) else node

    a = flashmla_kv_pages(kv_pool("v4", 16, 4), 16)
    peer = RegistrationDescription.from_json(json.dumps(rows(json.loads(a.describe().to_json()))))
    for shards in ({}, {"src_shard": Shard(0, 1, 1), "dst_shard": Shard(1, 2, 1)}):
        with pytest.raises(BlockMapError, match="other sizes of an array every rank holds whole"):
            block_map(a, peer, [1], [1], **shards)  # type: ignore[arg-type]
    sharded = json.loads(a.describe().to_json().replace(',"replicated":true', ""))  # TP-sharded rows
    assert "replicated" not in json.dumps(sharded)
    with pytest.raises(BlockMapError, match="other axes or parts"):
        block_map(a, RegistrationDescription.from_json(json.dumps(sharded)), [1], [1])


def refusal(src: Any, dst: Any) -> str:
    with pytest.raises(BlockMapError) as info:
        block_map(src, dst, [1], [2])
    return str(info.value)


def test_maps_between_pages_laid_out_differently_are_refused() -> None:
    v4, v41 = flashmla_kv_pages(kv_pool("v4", 64, None), 64), flashmla_kv_pages(kv_pool("v41", 64, None), 64)
    fp4 = flashmla_kv_pages(kv_pool("v41_fp4", 64, None), 64)
    msg = refusal(v4, v41)
    assert "do not hold the same state" in msg and "FlashMLA KV page (v4)" in msg and "(v41)" in msg
    assert "do not hold the same state" in refusal(v41, fp4)
    half = flashmla_kv_pages(kv_pool("v4", 32, None), 32)
    assert "pages of state in blocks of 64 and 32 rows" in refusal(v4, half)
    payload, scale = indexer_pool(64, None)
    indexer = aiter_fp4_indexer_pages(payload, scale, 64)
    assert "other axes or parts" in refusal(v4, indexer["payload"])
    assert "other axes or parts" in refusal(indexer["payload"], indexer["scale"])
    assert "other sizes on an axis TP does not shard" in refusal(indexer["scale"], v4)
    bf16 = [torch.zeros(PAGES * 64, 1, 576, dtype=torch.bfloat16) for _ in range(NL)]
    tokens = kvlayout.detect(bf16, "sglang", {"tokens_per_block": 64})  # the MLA pool's token rows
    assert "is opaque pages" in refusal(v4, tokens)


def test_shards_of_the_attention_heads_move_the_latents_whole() -> None:
    """Shards over DeepSeek's 128 attention heads hold the one latent head whole on each
    rank too, as an MLA cache's: the pages map whole."""
    src, dst = kv_pool("v4", 64, 5), kv_pool("v4", 64, None)
    block_map(
        flashmla_kv_pages(src, 64),
        flashmla_kv_pages(dst, 64),
        [1],
        [4],
        src_shard=Shard(0, 2, 128),
        dst_shard=Shard(1, 2, 128),
    ).copy()
    for layer in range(NL):
        assert torch.equal(dst[layer][4], src[layer][1]) and not dst[layer][:4].any()


def test_refuses_buffers_that_are_no_flashmla_pool() -> None:
    good = kv_pool("v4", 64, None)
    cases: list[tuple[Any, Any, str]] = [
        (good[0], 64, "kv_buffer is Tensor, not a non-empty list of per-layer tensors"),
        ([], 64, "kv_buffer is list, not a non-empty list"),
        ([good[0], "x"], 64, "kv_buffer[1] is str, not a tensor"),
        (
            [good[0], good[1][:3]],
            64,
            "kv_buffer[1] is [3, 37440] torch.uint8 on cpu and kv_buffer[0] [6, 37440]",
        ),
        ([t.view(torch.int16) for t in good], 64, "kv_buffer is torch.int16, not bytes"),
        ([t.view(PAGES, 2, -1) for t in good], 64, "kv_buffer[0] is [6, 2, 18720], not [pages, page bytes]"),
        (
            good,
            32,
            "no FlashMLA page of page_size=32 slots (bytes by layout: v4 19008, v41 16896, v41_fp4 9216)",
        ),
        (good, 0, "page_size must be a positive int (the pool's page_size), not 0"),
        (good, True, "page_size must be a positive int"),
        (
            [torch.zeros(PAGES * 1728, dtype=torch.uint8).as_strided((PAGES, 1728), (864, 1))],  # overlapping
            2,
            "is not contiguous pages, one after another",
        ),
        ([torch.zeros(0, 37440, dtype=torch.uint8)], 64, "it holds no pages"),
        (
            [good[0], good[1].view(torch.int8)],
            64,
            "kv_buffer[1] is [6, 37440] torch.int8 on cpu and kv_buffer[0]",
        ),
        (
            [good[0], good[1].to("meta")],
            64,
            "kv_buffer[1] is [6, 37440] torch.uint8 on meta and kv_buffer[0]",
        ),
        # a page_size SGLang does not use: the padded page is no whole number of rows
        (
            kv_pool("v4", 7, None),
            7,
            "4608-byte page does not split into page_size=7 equal rows (2 bytes left",
        ),
    ]
    for kv, ps, message in cases:
        with pytest.raises(DeepSeekV4PoolError, match=re.escape(message)):
            flashmla_kv_pages(kv, ps)


def test_refuses_buffers_that_are_no_aiter_fp4_indexer() -> None:
    payload, scale = indexer_pool(64, None)
    cases: list[tuple[Any, Any, int, str]] = [
        (payload, scale[:2], 64, "payload_buffer has 3 layers and scale_buffer 2: one per layer each"),
        (
            payload,
            scale,
            32,
            "payload_buffer[0] is [6, 1, 4, 64, 16], not [pages, 1, 4, 32, 16] or flattened [pages, 2048]",
        ),
        (payload, [t[:4] for t in scale], 64, "one pool's pages on one device expected"),
        (payload, [t.to("meta") for t in scale], 64, "one pool's pages on one device expected"),
        (scale, scale, 64, "payload_buffer[0] is [6, 1, 4, 64], not [pages, 1, 4, 64, 16]"),
    ]
    for p, s, ps, message in cases:
        with pytest.raises(DeepSeekV4PoolError, match=re.escape(message)):
            aiter_fp4_indexer_pages(p, s, ps)


def test_detect_names_the_readings() -> None:
    """What ``detect`` refuses of these pools says which function reads them."""
    with pytest.raises(kvlayout.DetectionError, match=re.escape("flashmla_kv_pages(kv_buffer, page_size)")):
        kvlayout.detect(kv_pool("v4", 64, None), "sglang")
    payload, scale = indexer_pool(64, None)
    flat = [[raw(t).flatten(1) for t in ts] for ts in (payload, scale)]
    for kv in (payload, scale, *flat):
        with pytest.raises(
            kvlayout.DetectionError, match=re.escape("aiter_fp4_indexer_pages(payload, scale, page_size)")
        ):
            kvlayout.detect([raw(t) for t in kv], "sglang")


@pytest.mark.parametrize(("page_size", "records"), [(16, 128), (32, 128), (64, 256), (128, 512)])
def test_v41_flashmla_pages_are_not_read_as_indexer_pages(page_size: int, records: int) -> None:
    """A V4.1 page of 16 slots is 8704 bytes, 128 FP4 indexer records; of 32 or more it is
    whole FP8 records: without tokens_per_block it was read as an indexer page of
    ``records`` tokens. Now it is refused, naming the reading; an indexer page of that
    size reads given its page_size, and the FlashMLA page's contradicts its records."""
    kv = kv_pool("v41", page_size, None)
    with pytest.raises(
        kvlayout.DetectionError,
        match=re.escape(f"FlashMLA page's size (v41 at page_size {page_size}) and also an indexer page of ")
        + f"({records}|.* or {records}) tokens .*pass layout hint tokens_per_block",
    ):
        kvlayout.detect(kv, "sglang")
    reg = kvlayout.detect(kv, "sglang", {"tokens_per_block": records})
    assert kvlayout.get_block_size(reg, reg.format) == records
    with pytest.raises(kvlayout.LayoutHintError, match=re.escape("flashmla_kv_pages(kv_buffer, page_size)")):
        kvlayout.detect(kv, "sglang", {"tokens_per_block": page_size})
    pages = flashmla_kv_pages(kv, page_size)
    assert block_map(pages, pages, [1], [2]).num_bytes == NL * kv[0][0].nbytes  # whole pages


@pytest.mark.parametrize("records", [1, 64])
@pytest.mark.parametrize("width", [132, 68])
def test_sglang_indexer_pages_still_read_without_a_page_size(width: int, records: int) -> None:
    reg = kvlayout.detect(
        [torch.zeros(PAGES, records * width, dtype=torch.uint8) for _ in range(NL)], "sglang"
    )
    assert kvlayout.get_block_size(reg, reg.format) == records


# deepseek_v4_memory_pool.py DeepSeekV4UnifiedKVPool: per layer bf16 [swa_pages +
# compress_rows + page_size // ratio, head_dim]; the P/D region (get_contiguous_buf_infos)
# starts at row swa_pages, a page of page_size // ratio rows
HEAD_DIM, SWA_PAGES = 448 + 64, 3 * 128


@pytest.mark.parametrize("ratio", [4, 128])
def test_unified_kv_rows_are_no_indexer_pages_and_read_as_mla_rows(ratio: int) -> None:
    rows_per_page = 128 // ratio
    rows = SWA_PAGES + 4 * {4: 32, 128: 1}[ratio] + rows_per_page
    gen = torch.Generator().manual_seed(ratio)
    src = [torch.randn(rows, HEAD_DIM, generator=gen).to(torch.bfloat16) for _ in range(NL)]
    dst = [torch.zeros(rows, HEAD_DIM, dtype=torch.bfloat16) for _ in range(NL)]
    # a row of 512 bf16 is also 4 bf16 indexer keys: without the page_size it is refused
    with pytest.raises(kvlayout.DetectionError, match=re.escape("DeepSeekV4UnifiedKVPool.kv_buffer")):
        kvlayout.detect(src, "sglang")
    # nor is it read at the pool's page_size, which no indexer reading of the row has
    with pytest.raises(kvlayout.LayoutHintError, match=re.escape("DeepSeekV4UnifiedKVPool.kv_buffer")):
        kvlayout.detect(src, "sglang", {"tokens_per_block": rows_per_page})

    def region(kv: list[torch.Tensor]) -> Any:
        views = [b[SWA_PAGES:].view(-1, 1, HEAD_DIM) for b in kv]
        return kvlayout.detect(views, "sglang", {"tokens_per_block": rows_per_page})

    pages = [(2, 1), (0, 3)]
    block_map(region(src), region(dst), [s for s, _ in pages], [d for _, d in pages]).copy()
    for layer in range(NL):
        want = torch.zeros_like(dst[layer])
        for s, d in pages:  # SGLang's row of compressed slot i of page p: swa_pages + p * rpp + i
            lo, hi = SWA_PAGES + d * rows_per_page, SWA_PAGES + (d + 1) * rows_per_page
            want[lo:hi] = src[layer][SWA_PAGES + s * rows_per_page : SWA_PAGES + (s + 1) * rows_per_page]
        assert torch.equal(dst[layer], want), layer


def test_uniform_fp8_pool_is_refused_naming_its_token_rows() -> None:
    """DeepSeekV4UniformFP8KVPool: float8_e4m3fn [pages, page_size * 512], a token's 512 bytes
    at ``kv_buffer.view(-1, 512)[loc]`` (set_key_buffer_fused)."""
    ps = 64
    gen = torch.Generator().manual_seed(9)
    src = [
        torch.randint(0, 256, (PAGES, ps * HEAD_DIM), dtype=torch.uint8, generator=gen).view(
            torch.float8_e4m3fn
        )
        for _ in range(NL)
    ]
    dst = [torch.zeros(PAGES, ps * HEAD_DIM, dtype=torch.float8_e4m3fn) for _ in range(NL)]
    with pytest.raises(kvlayout.DetectionError, match=re.escape("DeepSeekV4UniformFP8KVPool.kv_buffer")):
        kvlayout.detect(src, "sglang")

    def rows(kv: list[torch.Tensor]) -> Any:
        return kvlayout.detect([t.view(-1, 1, HEAD_DIM) for t in kv], "sglang", {"tokens_per_block": ps})

    block_map(rows(src), rows(dst), [4, 1], [0, 5]).copy()
    for layer in range(NL):
        s_tok, d_tok = raw(src[layer]).view(-1, HEAD_DIM), raw(dst[layer]).view(-1, HEAD_DIM)
        for s, d in ((4, 0), (1, 5)):
            assert torch.equal(d_tok[d * ps : (d + 1) * ps], s_tok[s * ps : (s + 1) * ps])
        assert not raw(dst[layer])[[1, 2, 3, 4]].any()


def test_a_one_slot_v41_page_reads_and_the_unified_one_row_page_reads_as_mla_rows() -> None:
    """At page_size 1 a V4.1 FlashMLA page (528 bytes padded to 512: 1024) is the size of the
    unified pool's compressed page of one bf16 row of 512 (``unified_region_buffers`` at
    ``page_size // ratio == 1``). A real V4.1 pool of that page_size reads (no hint needed);
    the unified pages read as MLA rows, which never map into FlashMLA pages."""
    assert page_bytes("v41", 1) == HEAD_DIM * 2
    v41 = kv_pool("v41", 1, 11)
    for layout in (None, "v41"):
        dst = kv_pool("v41", 1, None)
        block_map(flashmla_kv_pages(v41, 1, layout=layout), flashmla_kv_pages(dst, 1), [4], [1]).copy()
        assert torch.equal(dst[2][1], v41[2][4]) and not dst[2][[0, 2, 3, 4, 5]].any()
    gen = torch.Generator().manual_seed(10)
    unified = [  # unified_region_buffers(128) at page_size 128: uint8 [pages, 1 * 512 * 2]
        torch.randn(PAGES, HEAD_DIM, generator=gen).to(torch.bfloat16).view(torch.uint8) for _ in range(NL)
    ]

    def rows(kv: list[torch.Tensor]) -> Any:  # the docs' reading of the unified pages
        views = [v.view(torch.bfloat16).view(-1, 1, HEAD_DIM) for v in kv]
        return kvlayout.detect(views, "sglang", {"tokens_per_block": 1})

    host = [torch.zeros(PAGES, HEAD_DIM * 2, dtype=torch.uint8) for _ in range(NL)]
    block_map(rows(unified), rows(host), [3], [0]).copy()
    assert torch.equal(host[1][0], unified[1][3]) and not host[1][1:].any()
    assert "is opaque pages" in refusal(flashmla_kv_pages(v41, 1), rows(unified))


def test_layout_names_a_flashmla_layout_the_page_has() -> None:
    kv = kv_pool("v4", 64, None)
    assert flashmla_kv_pages(kv, 64, layout="v4").only_group().block_size == 64
    with pytest.raises(
        DeepSeekV4PoolError,
        match=re.escape("is no FlashMLA page of page_size=64 slots (bytes by layout: v41 33792)"),
    ):
        flashmla_kv_pages(kv, 64, layout="v41")
    with pytest.raises(
        DeepSeekV4PoolError, match=re.escape("layout='V4' is no FlashMLA page layout: one of v4")
    ):
        flashmla_kv_pages(kv, 64, layout="V4")


def test_hisparse_host_pool_reads_as_one_tensor_and_as_its_layers() -> None:
    """DeepSeekV4SingleKVPoolHost (hisparse_memory_pool.py): ``kv_buffer`` is one uint8
    ``[NL, size + 1, 584]`` (init_kv_buffer), a token's 584-byte record at ``kv_buffer[l][slot]``
    (transfer_kv_all_layer_mla, item_size=kv_cache_total_dim); its ``data_refs`` are the
    layers. The one tensor reads as the layers do, MLA host rows (layer_first)."""
    slots = 9
    gen = torch.Generator().manual_seed(12)
    one = torch.randint(0, 256, (NL, slots, 584), dtype=torch.uint8, generator=gen)
    with pytest.raises(kvlayout.DetectionError, match=re.escape("HiSparse host pool") + ".*layer_first"):
        kvlayout.detect(one, "sglang")
    pool = kvlayout.detect(one, "sglang", {"hicache_layout": "layer_first", "tokens_per_block": 1})
    other = torch.zeros(NL, slots, 584, dtype=torch.uint8)  # another instance's, by its data_refs
    layers = kvlayout.detect([other[i].unsqueeze(1) for i in range(NL)], "sglang", {"tokens_per_block": 1})
    block_map(pool, layers, [5, 7], [1, 2], num_tokens=2).copy()
    for layer in range(NL):
        assert torch.equal(other[layer][1], one[layer][5]) and torch.equal(other[layer][2], one[layer][7])
        assert not other[layer][[0, *range(3, slots)]].any()
    back = torch.zeros(NL, slots, 584, dtype=torch.uint8)
    block_map(
        layers, kvlayout.detect(back, "sglang", {"hicache_layout": "layer_first"}), [2], [8], dst_block_size=1
    ).copy()
    assert torch.equal(back[:, 8], one[:, 7]) and not back[:, :8].any()
    for order in ("page_first", "page_first_direct", "page_head"):  # the pool is layer_first alone
        with pytest.raises(kvlayout.DetectionError):
            kvlayout.detect(one, "sglang", {"hicache_layout": order, "tokens_per_block": 1})
    with pytest.raises(kvlayout.DetectionError) as other_dtype:  # 584 bytes a row: uint8 alone
        kvlayout.detect(one.to(torch.bfloat16), "sglang")
    assert "HiSparse" not in str(other_dtype.value)


@pytest.mark.parametrize(("ratio", "index_page"), [(1, 64), (2, 64), (1, 128)])
def test_v41_low_ratio_indexer_moves_a_full_pages_run_of_index_pages(ratio: int, index_page: int) -> None:
    """V4.1's ratio-1/2 indexer (_make_indexer_pool(force_fp4=True)): FP4 records (68 bytes)
    in pages of DSV41_INDEX_PAGE_SIZE slots (64, or 128 under DeepGEMM's paged MQA logits),
    uint8 [pages, index_page * 68]. P/D addresses it by FULL page id, an item the run of
    page_size // ratio // index_page index pages (get_contiguous_buf_infos): read at its own
    page size, FULL page p is index blocks p * k .. p * k + k - 1."""
    full_page_size = 256
    k = full_page_size // ratio // index_page
    size = (4 * full_page_size + full_page_size) // ratio  # (full_size + page_size) // ratio
    pages = (size + index_page + 1) // index_page  # KVCache's num_pages
    gen = torch.Generator().manual_seed(ratio * index_page)
    src = [
        torch.randint(0, 256, (pages, index_page * 68), dtype=torch.uint8, generator=gen) for _ in range(NL)
    ]
    dst = [torch.zeros(pages, index_page * 68, dtype=torch.uint8) for _ in range(NL)]
    hint = {"tokens_per_block": index_page}
    full_src, full_dst = 2, 1
    block_map(
        kvlayout.detect(src, "sglang", hint),
        kvlayout.detect(dst, "sglang", hint),
        [full_src * k + j for j in range(k)],
        [full_dst * k + j for j in range(k)],
    ).copy()
    item = k * index_page * 68  # item_lens: buf[0].nbytes * index_pages_per_full_page
    for layer in range(NL):
        want = torch.zeros(pages * index_page * 68, dtype=torch.uint8)
        want[full_dst * item : (full_dst + 1) * item] = src[layer].flatten()[
            full_src * item : (full_src + 1) * item
        ]
        assert torch.equal(dst[layer].flatten(), want), layer


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_hisparse_page_first_host_pages_read_as_the_layers_pages(layout: str) -> None:
    """DeepSeekV4PagedHostPool (HiSparse's C4 host mirror) in page_first holds one uint8
    [pages, NL, page bytes] (page_first_direct: [pages, NL, 1, page bytes]), a page's
    layers side by side; its layer l is kv_buffer[:, l] (kv_buffer[:, l, 0]), pages NL page
    sizes apart. They were refused (no contiguous pages); now they map to and from the
    device pool's pages (transfer_kv_all_layer_mla_lf_pf's page rows)."""
    ps, row = 64, page_bytes("v4", 64)
    shape = (PAGES, NL, row) if layout == "page_first" else (PAGES, NL, 1, row)

    def layers(kv: torch.Tensor) -> list[torch.Tensor]:
        return [kv[:, i] if kv.dim() == 3 else kv[:, i, 0] for i in range(NL)]

    gen = torch.Generator().manual_seed(13)
    host = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    dev = kv_pool("v4", ps, None)
    m = block_map(flashmla_kv_pages(layers(host), ps), flashmla_kv_pages(dev, ps), [3, 1], [0, 4])
    assert m.kind == "same layout" and m.num_bytes == 2 * NL * row
    m.copy()
    for i in range(NL):
        assert torch.equal(dev[i][0], layers(host)[i][3]) and torch.equal(dev[i][4], layers(host)[i][1])
        assert not dev[i][1:4].any()
    back = torch.zeros(shape, dtype=torch.uint8)
    block_map(flashmla_kv_pages(dev, ps), flashmla_kv_pages(layers(back), ps), [4], [2]).copy()
    want = torch.zeros(shape, dtype=torch.uint8)
    want[2] = host[1]  # a host page is every layer's page, side by side
    assert torch.equal(back, want)
