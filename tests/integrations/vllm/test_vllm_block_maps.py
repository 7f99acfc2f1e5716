"""Block maps between vLLM registrations after the group edits: opaque pages move whole
between caches paged alike where a row is not a token (HND kernel pages, Mamba state), and
HND kernel pages read as their kernel pages to any other cache; NHD kernel pages read as
their blocks. Built with vLLM 0.33's own view functions."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import kvlayout
from kvlayout.integrations.vllm import apply_kv_cache_group_edits
from kvlayout.registration.peers import PeerDescriptionError, RegistrationDescription
from kvlayout.registration.shards import ShardError
from kvlayout.transfer import BlockMapError, Shard, block_map

vx = pytest.importorskip("kvlayout.testing.vllm")  # vLLM's spec classes

pytest.importorskip("vllm")


def edited_cache(
    layout: Any, seed: int, block_size: int = 128, heads: int = 4, head_size: int = 16
) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """A 2-layer model on FlashInfer with ``--block-size 128``: 64-token kernel pages,
    edited into 128-row opaque pages. Returns the raw views, the registration and the
    edited views."""
    spec = vx.kvi.FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16
    )
    engine = vx.uniform_engine(spec, vx.FLASHINFER, num_layers=2, num_blocks=6, layout=layout)
    buf, raw = vx.allocate_v033(engine)
    buf.copy_(
        torch.randint(-128, 128, buf.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
    )
    hints = vx.hints(layout is vx.KVCacheLayout.LBHNC)
    edited = apply_kv_cache_group_edits(engine.config, raw, hints)
    return raw, kvlayout.detect(list(edited.values()), "vllm", hints), edited


def test_hnd_kernel_pages_move_whole_pages_for_a_partly_filled_last_block() -> None:
    """In HND memory row ``r`` of an edited block is not token ``r``: 200 tokens of
    128-token blocks move both blocks whole (the request's own), never 72 rows of bytes
    that hold some heads' tokens past 200 and miss others' before it."""
    hnd = vx.KVCacheLayout.LBHNC
    _, src, s = edited_cache(hnd, 1)
    _, dst, d = edited_cache(hnd, 2)
    before = {name: t.clone() for name, t in d.items()}
    m = block_map(src, dst, [4, 1], [0, 5], num_tokens=200)
    assert src.only_group().opaque_pages is not None and not src.only_group().opaque_pages.rows_are_tokens
    assert m.num_tokens == 256 and "a partly filled last block moves whole" in m.reason
    m.copy()
    for name in d:
        assert torch.equal(d[name][[0, 5]], s[name][[4, 1]])
        untouched = [b for b in range(6) if b not in (0, 5)]
        assert torch.equal(d[name][untouched], before[name][untouched])
    # a prefix ends at a whole page, or the pages move whole from it
    assert block_map(src, dst, [4, 1], [0, 5], num_tokens=200, first_token=128).num_bytes == m.num_bytes // 2
    with pytest.raises(
        BlockMapError, match=r"^first_token=100 cuts an opaque page of 128 rows, which moves whole"
    ):
        block_map(src, dst, [4, 1], [0, 5], num_tokens=200, first_token=100)
    assert block_map(src, dst, [4, 1], [0, 5], num_tokens=200, first_token=200).num_runs == 0  # all served


def unpaged_cache(layout: Any, seed: int) -> tuple[dict[str, Any], Any]:
    """The same model on FlashAttention, which takes ``--block-size 128`` whole."""
    spec = vx.kvi.FullAttentionSpec(block_size=128, num_kv_heads=4, head_size=16, dtype=torch.bfloat16)
    engine = vx.uniform_engine(spec, vx.FLASH_ATTN, num_layers=2, num_blocks=6, layout=layout)
    buf, raw = vx.allocate_v033(engine)
    buf.copy_(
        torch.randint(-128, 128, buf.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
    )
    hints = vx.hints(layout is vx.KVCacheLayout.LBHNC)
    return raw, kvlayout.detect(
        list(apply_kv_cache_group_edits(engine.config, raw, hints).values()), "vllm", hints
    )


def test_nhd_kernel_pages_read_as_their_blocks() -> None:
    """NHD kernel pages are token-major, so a block's two 64-token pages are its 128
    tokens in order: the edits view them as the block itself, which maps like any cache,
    to FlashAttention's unpaged blocks or to an HND cache, from here or from a peer's
    description (as opaque pages they were refused)."""
    nhd, hnd = vx.KVCacheLayout.LBNHC, vx.KVCacheLayout.LBHNC
    raw_src, src, _ = edited_cache(nhd, 1)
    assert src.format.name == "NL_X_NB_BS_NH_CS" and src.only_group().opaque_pages is None
    assert src.only_group().block_size == 128
    for layout, kind in ((nhd, "same layout"), (hnd, "permuted")):
        raw_dst, dst = unpaged_cache(layout, 2)
        before = {name: t.clone() for name, t in raw_dst.items()}
        m = block_map(src, dst, [4, 1], [0, 5], num_tokens=200)
        assert m.num_tokens == 200 and m.kind == kind
        m.copy()
        for name, view in raw_src.items():  # [B * 2, H, 64, C]: token p of block b is page 2b + p // 64
            sent = torch.stack([view[2 * b + p // 64, :, p % 64] for b in (4, 1) for p in range(128)])[:200]
            got = torch.stack([raw_dst[name][b, :, p] for b in (0, 5) for p in range(128)])
            assert torch.equal(got[:200].view(torch.int16), sent.view(torch.int16))  # random bytes hold NaNs
            assert torch.equal(
                got[200:].view(torch.int16),
                torch.stack([before[name][5, :, p] for p in range(72, 128)]).view(torch.int16),
            )
    wire = RegistrationDescription.from_json(src.describe().to_json())  # a peer's, as NIXL sends it
    assert block_map(wire, dst, [4], [0]).kind == "permuted"


def test_hnd_kernel_pages_map_to_other_memory_orders_as_their_kernel_pages() -> None:
    """HND kernel pages (Hopper) interleave heads per page, so their edited blocks declare
    it (an array of KV heads): a map to NHD blocks (Blackwell) reads them as their kernel
    pages, token ``p`` of block ``b`` slot ``p % 64`` of page ``2b + p // 64`` on both
    sides, as vLLM's kernels index them (a permute, not a scramble), from here or from a
    peer's description, which carries the array."""
    raw_src, src, _ = edited_cache(vx.KVCacheLayout.LBNHC, 1)
    raw_dst, dst, _ = edited_cache(vx.KVCacheLayout.LBHNC, 2)
    wire = RegistrationDescription.from_json(dst.describe().to_json())
    pages = wire.groups[0].opaque_pages
    assert pages is not None and pages == dst.only_group().opaque_pages
    assert [str(a) for a in pages.arrays] == ["bfloat16 [2, 4, 64, 32] (axis 1 in KV heads)"]
    assert "permuted" in block_map(src, wire, [4, 1], [0, 5], num_tokens=200).kind
    before = {name: t.clone() for name, t in raw_dst.items()}
    block_map(src, dst, [4, 1], [0, 5], num_tokens=200).copy()
    for name, view in raw_src.items():  # [B * 2, H, 64, C]: token p of block b is page 2b + p // 64
        sent = torch.stack([view[2 * b + p // 64, :, p % 64] for b in (4, 1) for p in range(128)])
        got = torch.stack([raw_dst[name][2 * b + p // 64, :, p % 64] for b in (0, 5) for p in range(128)])
        old = torch.stack([before[name][2 * b + p // 64, :, p % 64] for b in (0, 5) for p in range(128)])
        assert torch.equal(
            got[:200].view(torch.int16), sent[:200].view(torch.int16)
        )  # random bytes hold NaNs
        assert torch.equal(got[200:].view(torch.int16), old[200:].view(torch.int16))  # past the request: kept
        rest = [page for page in range(12) if page // 2 not in (0, 5)]
        assert torch.equal(raw_dst[name][rest].view(torch.int16), before[name][rest].view(torch.int16))


def test_hnd_kernel_pages_of_heads_and_rows_that_divide_no_block_declare_them() -> None:
    """Only the kernel page's tokens divide a block (its 128 slots into 2 pages of 64):
    Phi-3-medium's 10 KV heads of 128 (rows of 256), and the 12 pages, divide none of it,
    and the HND pages still declare their kernel pages of heads, which map as such."""
    raw_src, src, _ = edited_cache(vx.KVCacheLayout.LBNHC, 1, heads=10, head_size=128)
    raw_dst, dst, _ = edited_cache(vx.KVCacheLayout.LBHNC, 2, heads=10, head_size=128)
    pages = dst.only_group().opaque_pages
    assert pages is not None and [str(a) for a in pages.arrays] == [
        "bfloat16 [2, 10, 64, 256] (axis 1 in KV heads)"
    ]
    block_map(src, dst, [4], [5], num_tokens=100).copy()
    for name, view in raw_src.items():  # token p of block b: slot p % 64 of page 2b + p // 64
        sent = torch.stack([view[8 + p // 64, :, p % 64] for p in range(100)])
        got = torch.stack([raw_dst[name][10 + p // 64, :, p % 64] for p in range(100)])
        assert torch.equal(got.view(torch.int16), sent.view(torch.int16))


def test_opaque_pages_map_whole_only_to_opaque_pages_alike_of_the_same_rank() -> None:
    """Pages alike of one rank move whole; HND kernel pages between ranks move the heads
    both hold, read as their kernel pages (none in common: nothing); a cache that is no
    attention stays refused."""
    _, src, _ = edited_cache(vx.KVCacheLayout.LBHNC, 1)
    _, dst, _ = edited_cache(vx.KVCacheLayout.LBHNC, 2)
    plain = json.loads(dst.describe().to_json())
    assert plain["version"] == 2 and plain["groups"][0]["opaque_pages"]["arrays"][0]["kv_heads"] is True
    plain["groups"][0]["opaque_pages"] = None  # the same tensors, as if an engine registered them so
    with pytest.raises(
        BlockMapError, match=r"^src holds K and V rows per head \(MHA\) and dst one latent row per token"
    ):
        block_map(src, RegistrationDescription.from_json(json.dumps(plain)), [1], [2])
    other = block_map(src, dst, [1], [2], src_shard=Shard(0, 2, 8), dst_shard=Shard(1, 2, 8))
    assert (other.kind, other.num_runs) == ("empty", 0)
    same = block_map(src, dst, [1], [2], src_shard=Shard(1, 2, 8), dst_shard=Shard(1, 2, 8))
    assert same.num_runs == 2 and "opaque pages" in same.reason  # whole pages, a layer each
    with pytest.raises(
        ShardError, match=r"^dst_shard Shard\(tp_rank=0, tp_size=4, num_kv_heads=8\) holds 2 KV"
    ):
        block_map(src, dst, [1], [2], src_shard=Shard(0, 2, 8), dst_shard=Shard(0, 4, 8))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"layout": "", "rows_are_tokens": True}, "opaque_pages.layout must be printable text of 1 to 1024"),
        ({"layout": "x" * 1025, "rows_are_tokens": True}, "opaque_pages.layout must be printable"),
        ({"layout": "x", "rows_are_tokens": 1}, "opaque_pages.rows_are_tokens must be a boolean, not int"),
        ({"layout": "x"}, r"opaque_pages has no rows_are_tokens"),
        ("x", "opaque_pages must be an object, not a string"),
    ],
)
def test_a_peer_s_opaque_pages_are_checked(value: object, message: str) -> None:
    _, dst, _ = edited_cache(vx.KVCacheLayout.LBNHC, 2)
    wire = json.loads(dst.describe().to_json())
    wire["groups"][0]["opaque_pages"] = value
    with pytest.raises(PeerDescriptionError, match=r"^description\.groups\[0\]\." + message):
        RegistrationDescription.from_json(json.dumps(wire))


def test_a_mamba_state_page_moves_whole() -> None:
    """Qwen3.5: a 700-token request over 544-token blocks ends in a partly filled block;
    its Mamba page is conv | ssm state, which a cut at row 156 would tear."""
    engines = [vx.hybrid_engine(vx.QWEN3_5_0_8B, vx.FLASHINFER, num_blocks=4) for _ in range(2)]
    hints = {"kv_layout": "NHD"}
    regs, views = [], []
    for seed, engine in enumerate(engines):
        buf, raw = vx.allocate_v033(engine)
        buf.copy_(
            torch.randint(
                -128, 128, buf.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed)
            )
        )
        edited = apply_kv_cache_group_edits(engine.config, raw, hints)
        names = list(edited)
        groups = [[names.index(n) for n in g.layer_names] for g in engine.config.kv_cache_groups]
        regs.append(kvlayout.detect(list(edited.values()), "vllm", hints, layer_groups=groups))
        views.append(edited)
    mamba = next(i for i, g in enumerate(engines[0].config.kv_cache_groups) if "linear" in g.layer_names[0])
    src, dst = (r.kernel_groups[mamba] for r in regs)
    m = block_map(src, dst, [0, 2], [1, 3], num_tokens=700)
    assert m.num_tokens == 1088 and m.num_bytes == 2 * 1114112 * len(src.layers)
    m.copy()
    for name in engines[0].config.kv_cache_groups[mamba].layer_names:
        assert torch.equal(views[1][name][[1, 3]], views[0][name][[0, 2]])


@pytest.mark.parametrize("side", ["src", "dst"])
def test_a_mamba_state_page_is_refused_under_context_parallelism(side: str) -> None:
    """DCP slices attention tokens; a Mamba page is one request's state, no tokens to slice:
    a CP shard on either side of a state group's map is refused, naming the side."""
    engine = vx.hybrid_engine(vx.QWEN3_5_0_8B, vx.FLASHINFER, num_blocks=4)
    hints = {"kv_layout": "NHD"}
    _, raw = vx.allocate_v033(engine)
    edited = apply_kv_cache_group_edits(engine.config, raw, hints)
    names = list(edited)
    groups = [[names.index(n) for n in g.layer_names] for g in engine.config.kv_cache_groups]
    reg = kvlayout.detect(list(edited.values()), "vllm", hints, layer_groups=groups)
    mamba = next(i for i, g in enumerate(engine.config.kv_cache_groups) if "linear" in g.layer_names[0])
    state = reg.kernel_groups[mamba]
    cp, whole = Shard(0, 2, 2, 0, 2, 1), Shard(0, 2, 2)
    src_shard, dst_shard = (cp, whole) if side == "src" else (whole, cp)
    with pytest.raises(
        BlockMapError,
        match=rf"^{side}_shard is context-parallel \(the tokens of CP rank 0 of 2 .*opaque pages",
    ):
        block_map(state, state, [0], [1], num_tokens=100, src_shard=src_shard, dst_shard=dst_shard)


def mla_v033(seed: int, num_layers: int = 3) -> list[torch.Tensor]:
    """vLLM 0.33's DeepSeek registration: one ``[NB, 1, BS, 576]`` view per layer."""
    spec = vx.kvi.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    engine = vx.uniform_engine(spec, vx.FLASHMLA, num_layers=num_layers, num_blocks=6)
    buf, raw = vx.allocate_v033(engine)
    buf.copy_(
        torch.randint(-128, 128, buf.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
    )
    return list(raw.values())


def test_a_v033_mla_cache_reads_as_latents_when_the_hints_say_mla() -> None:
    """``[NB, 1, BS, 576]`` is also a one-head fused K | V cache (Llama at TP 8), so the
    shape cannot tell; ``kv_dim=1`` (or an MLA ``layout_format``) says latents, and the
    cache then maps to SGLang's MLA pool byte for byte."""
    kv = mla_v033(3)
    assert kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"}).format.name == "NL_X_NB_BS_NH_CS"
    for hints in ({"kv_dim": 1}, {"kv_layout": "NHD", "layout_format": "NL_X_NB_BS_HS"}):
        reg = kvlayout.detect(kv, "vllm", hints)
        assert reg.format.name == "NL_X_NB_BS_HS" and kvlayout.is_mla(reg.format)
    sglang = [torch.zeros(6 * 64, 1, 576, dtype=torch.bfloat16) for _ in range(3)]
    pool = kvlayout.detect(sglang, "sglang", {"kv_layout": "NHD"})
    m = block_map(reg, pool, [2, 0, 4], [5, 1, 3], num_tokens=150, dst_block_size=64)
    assert m.kind == "re-laid"
    m.copy()
    for layer in range(3):
        for p in (0, 63, 64, 149):
            src_block, dst_block = [2, 0, 4][p // 64], [5, 1, 3][p // 64]
            moved, sent = sglang[layer][dst_block * 64 + p % 64, 0], kv[layer][src_block, 0, p % 64]
            assert torch.equal(moved.view(torch.int16), sent.view(torch.int16))  # random bytes hold NaNs
        assert not sglang[layer][3 * 64 + 150 - 128 : 4 * 64].any()  # the last block past the request


def test_an_mla_hint_on_a_multi_head_cache_is_an_error() -> None:
    kv = [torch.zeros(6, 8, 64, 256, dtype=torch.bfloat16).transpose(1, 2).transpose(1, 2) for _ in range(2)]
    with pytest.raises(
        kvlayout.LayoutHintError, match=r"the layout hints say MLA .* has 8 heads on its head axis"
    ):
        kvlayout.detect(kv, "vllm", {"kv_layout": "HND", "kv_dim": 1})


def test_vllm_re_allocating_a_tensor_the_edits_re_viewed_is_caught() -> None:
    """The edits make new tensors over vLLM's storage; an engine re-allocates its own
    tensor, so the checks watch that one too, not only the edited view."""
    from kvlayout.transfer import TransferError, prepare

    raw, src, _ = edited_cache(vx.KVCacheLayout.LBHNC, 1)
    _, dst, _ = edited_cache(vx.KVCacheLayout.LBHNC, 2)
    plan = prepare(src.only_group(), src.format)
    chunks = plan.chunks_for(2, 256)
    m = block_map(dst, src, [1, 2], [3, 4])
    name = next(iter(raw))
    raw[name].data = torch.zeros_like(raw[name])  # vLLM's tensor re-allocated in place
    message = r"kv_caches\[0\]'s tensor before the group edits was re-allocated"
    with pytest.raises(TransferError, match=message):
        plan.load_blocks([3, 4], chunks)
    with pytest.raises(BlockMapError, match=message):
        m.copy()
    assert not raw[name].any()


def test_a_chunk_loaded_into_opaque_pages_moves_whole_pages_too() -> None:
    from kvlayout.transfer.block_maps import chunk_side

    _, cache, views = edited_cache(vx.KVCacheLayout.LBHNC, 1)
    group = cache.only_group()
    chunk = torch.randint(-128, 128, (1, 2, 256, 256), dtype=torch.int8)
    m = block_map(chunk_side(group, chunk), group, [0], [0, 5], num_tokens=200)
    assert m.num_tokens == 256 and "moves whole" in m.reason
    m.copy()
    for layer, view in enumerate(views.values()):
        assert torch.equal(view[[0, 5]].reshape(256, 256), chunk[0, layer])


@pytest.mark.parametrize(("layout", "tokens"), [("LBHNC", 256), ("LBNHC", 200)])
def test_chunk_shape_for_sizes_a_request_s_chunk_as_its_map_moves_it(layout: str, tokens: int) -> None:
    """A connector sizes a request's chunk with chunk_shape_for: the request's tokens
    exactly where rows are tokens (NHD kernel pages, read as their blocks), whole pages
    where they are not (HND kernel pages), and the map then fills all of it."""
    from kvlayout.transfer.block_maps import chunk_shape_for, chunk_side

    _, cache, _ = edited_cache(vx.KVCacheLayout[layout], 1)
    group = cache.only_group()
    shape, dtype = chunk_shape_for(group, 200)
    row = 256 if layout == "LBHNC" else 128  # a page's row of bytes, or 4 heads of K | V (bf16)
    assert (shape, dtype) == ((1, 2, tokens, row), torch.int8 if layout == "LBHNC" else torch.bfloat16)
    chunk = torch.full(shape, 7, dtype=dtype)
    m = block_map(group, chunk_side(group, chunk), [4, 1], [0], num_tokens=200)
    assert m.num_bytes == chunk.numel() * chunk.element_size()
    m.copy()
    assert not bool((chunk == 7).all(dim=-1).any())  # every row written


def test_views_of_an_edited_view_keep_its_mark() -> None:
    _, cache, views = edited_cache(vx.KVCacheLayout.LBHNC, 1)
    mark = cache.only_group().opaque_pages
    for again in (lambda v: v[:], lambda v: v.view(v.shape), torch.Tensor.detach):
        other = kvlayout.detect([again(v) for v in views.values()], "vllm", {"kv_layout": "HND"})
        assert other.only_group().opaque_pages == mark


def test_opaque_rounding_is_to_one_page_whatever_the_caller_s_blocks() -> None:
    from kvlayout.transfer.block_maps import chunk_side

    _, src, _ = edited_cache(vx.KVCacheLayout.LBHNC, 1)
    _, dst, _ = edited_cache(vx.KVCacheLayout.LBHNC, 2)
    assert block_map(src, dst, [1], [3], num_tokens=10, src_block_size=256).num_tokens == 128
    short = torch.zeros(1, 2, 10, 256, dtype=torch.int8)
    with pytest.raises(
        BlockMapError, match=r"^the chunk holds 10 token rows, but opaque pages move whole pages of 128"
    ):
        block_map(chunk_side(dst.only_group(), short), dst, [0], [3], num_tokens=10)


def test_a_geometry_mark_dies_with_the_memory_it_was_made_over() -> None:
    """Marks found by a view's geometry hold only while a tensor they were made over
    lives: the allocator reuses freed addresses for unrelated tensors of the same shape."""
    import gc

    from kvlayout.registration.opaque import OpaquePages, mark_opaque_pages, opaque_pages_of

    pages = OpaquePages("rule: demo", rows_are_tokens=False)
    for _ in range(50):
        base = torch.zeros(4, 64, 32, dtype=torch.int8)
        mark_opaque_pages(base[:], pages, over=[base])
        assert opaque_pages_of(base[:]) == pages
        del base
        gc.collect()
        assert opaque_pages_of(torch.zeros(4, 64, 32, dtype=torch.int8)[:]) is None


def test_kernel_paged_mla_reads_as_its_blocks_and_maps_to_an_unpaged_backend() -> None:
    """DeepSeek at ``--block-size 128`` on FlashMLA (64-token kernel pages) beside a decode
    on a backend that takes 128-token blocks whole: a block's two pages are its 128
    latents in order, so the map is one run per block and layer (opaque, it was refused)."""
    spec = vx.kvi.MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    hints = {"kv_layout": "NHD", "kv_dim": 1}
    regs, raws = [], []
    for seed, backend in ((1, vx.FLASHMLA), (2, vx.FLASH_ATTN)):
        engine = vx.uniform_engine(spec, backend, num_layers=2, num_blocks=6)
        buf, raw = vx.allocate_v033(engine)
        buf.copy_(
            torch.randint(
                -128, 128, buf.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed)
            )
        )
        regs.append(
            kvlayout.detect(
                list(apply_kv_cache_group_edits(engine.config, raw, hints).values()), "vllm", hints
            )
        )
        raws.append(raw)
    assert [tuple(next(iter(r.values())).shape) for r in raws] == [(12, 1, 64, 576), (6, 1, 128, 576)]
    src, dst = regs
    assert src.only_group().opaque_pages is None and src.format == dst.format and kvlayout.is_mla(src.format)
    m = block_map(src, dst, [5, 2], [1, 4], num_tokens=150)
    assert m.kind == "same layout" and m.num_runs == 4  # a block and 22 tokens, each layer
    m.copy()
    for name, paged in raws[0].items():
        whole = raws[1][name]
        for p in (0, 63, 64, 127, 128, 149):
            b, d = [5, 2][p // 128], [1, 4][p // 128]
            sent = paged[2 * b + (p % 128) // 64, 0, p % 64]
            assert torch.equal(whole[d, 0, p % 128].view(torch.int16), sent.view(torch.int16))


def test_a_hybrid_without_prefix_caching_moves_each_request_s_state_page_for_p_d() -> None:
    """Mamba in 'none' mode (vLLM's whenever prefix caching is off) keeps one running
    state per request in a block of max_model_len tokens: refused whole before, it is
    served to a P/D connector (prefix_reuse=False), one state page per block id, while an
    offload tier, which finds blocks again by prefix, is still refused."""
    from kvlayout.integrations.vllm import UnsupportedKVCacheGroupsError, transfer_layers

    hints = {"kv_layout": "NHD"}

    def registration(seed: int) -> tuple[Any, list[torch.Tensor]]:
        engine = vx.hybrid_engine(vx.QWEN3_5_0_8B, vx.FLASHINFER, num_blocks=4, mamba_cache_mode="none",
                                  max_model_len=40960)  # fmt: skip
        raw = vx.allocate_v033(engine)[1]
        buffers = list({id(t.untyped_storage()): t for t in raw.values()}.values())
        generator = torch.Generator().manual_seed(seed)
        for t in buffers:  # every byte of the pool, padding included
            t.untyped_storage().copy_(
                torch.randint(
                    -128, 128, (t.untyped_storage().nbytes(),), dtype=torch.int8, generator=generator
                ).untyped_storage()
            )
        with pytest.raises(UnsupportedKVCacheGroupsError, match=r"mamba_cache_mode='none'"):
            apply_kv_cache_group_edits(engine.config, raw, hints)
        kv = apply_kv_cache_group_edits(engine.config, raw, hints, prefix_reuse=False)
        layers, groups = transfer_layers(engine.config, kv)
        return kvlayout.detect(layers, "vllm", hints, layer_groups=groups), layers

    prefill, p_layers = registration(1)
    decode, d_layers = registration(2)
    mamba = [g for g in prefill.kernel_groups if g.block_size == 1]
    assert len(mamba) == 3 and {g.format.name for g in mamba} == {"NL_X_NB_BS_HS"}
    for src, dst in zip(prefill.kernel_groups, decode.kernel_groups, strict=True):
        if src.block_size == 1:  # the request's state: block 2 on prefill, block 0 on decode
            block_map(src, dst, [2], [0]).copy()
            for layer in src.layers:
                assert torch.equal(d_layers[layer][0], p_layers[layer][2])  # its whole page
                assert not torch.equal(d_layers[layer][1], p_layers[layer][2])  # no other block


def test_a_peer_s_kernel_pages_that_are_not_its_pages_are_refused() -> None:
    """A description whose array of kernel pages does not tile its pages (a peer's is
    untrusted) is refused when the map reads it as its kernel pages, naming both."""
    _, src, _ = edited_cache(vx.KVCacheLayout.LBNHC, 1)
    _, dst, _ = edited_cache(vx.KVCacheLayout.LBHNC, 2)
    wire = json.loads(dst.describe().to_json())
    wire["groups"][0]["opaque_pages"]["arrays"][0]["shape"] = [1, 4, 64, 32]  # one kernel page of two
    with pytest.raises(
        BlockMapError,
        match=r"^dst: its pages of 32768 bytes, 32768 apart, are not the 1 kernel pages of 16384 bytes back to "
        r"back its array bfloat16 \[1, 4, 64, 32\] \(axis 1 in KV heads\) says",
    ):
        block_map(src, RegistrationDescription.from_json(json.dumps(wire)), [1], [2])


def padded_peer(pages: int, tokens: int) -> RegistrationDescription:
    """The HND cache's description as a peer that pads each 32 KiB block to 36 KiB
    (4 KiB between blocks), its pages ``pages`` kernel pages of ``tokens`` tokens."""
    _, dst, _ = edited_cache(vx.KVCacheLayout.LBHNC, 2)
    wire = json.loads(dst.describe().to_json())
    plane = wire["groups"][0]["planes"][0]
    plane["block_stride"] = plane["strides"][0] = 36864
    plane["addresses"][1] = plane["addresses"][0] + 6 * 36864  # the layers' padded tensors apart
    wire["groups"][0]["opaque_pages"]["arrays"][0]["shape"] = [pages, 4, tokens, 32]
    return RegistrationDescription.from_json(json.dumps(wire))


def test_a_peer_s_padded_blocks_of_kernel_pages_are_refused_and_a_padded_page_maps() -> None:
    """Two kernel pages a block must be back to back (kernel page ``2b + 1`` is read at
    half the block stride: padding between blocks would put it in the padding); one page
    a block may be padded, each block read at its own stride."""
    _, src, _ = edited_cache(vx.KVCacheLayout.LBNHC, 1)
    with pytest.raises(
        BlockMapError,
        match=r"^dst: its pages of 32768 bytes, 36864 apart, are not the 2 kernel pages of 16384 bytes back to "
        r"back its array bfloat16 \[2, 4, 64, 32\] \(axis 1 in KV heads\) says",
    ):
        block_map(src, padded_peer(2, 64), [1], [2])
    peer = padded_peer(1, 128)
    m = block_map(src, peer, [1, 4], [2, 5])
    bases = peer.groups[0].planes[0].addresses  # a layer's tensor each
    landed = set()
    for at, n in m.runs[:, 1:].tolist():
        offset = next(at - b for b in bases if 0 <= at - b < 6 * 36864)
        landed.add(offset // 36864)
        assert offset % 36864 + n <= 32768  # inside its block's page, never in the padding
    assert landed == {2, 5} and m.num_bytes == 2 * 2 * 32768


def test_a_peer_s_kernel_pages_of_other_tokens_than_its_blocks_are_refused() -> None:
    """A description whose kernel pages fill its pages' bytes with heads traded for
    tokens (4 pages of 64 tokens in a block of 128) is refused, not read as blocks of 256."""
    _, src, _ = edited_cache(vx.KVCacheLayout.LBNHC, 1)
    _, dst, _ = edited_cache(vx.KVCacheLayout.LBHNC, 2)
    wire = json.loads(dst.describe().to_json())
    wire["groups"][0]["opaque_pages"]["arrays"][0].update(shape=[4, 2, 64, 32], parts=[2])
    with pytest.raises(
        BlockMapError,
        match=r"^dst: its blocks of 128 tokens are not the 4 kernel pages of 64 tokens its array bfloat16 "
        r"\[4, 2, 64, 32\] \(axis 1 in KV heads\) says",
    ):
        block_map(
            src,
            RegistrationDescription.from_json(json.dumps(wire)),
            [1],
            [2],
            src_shard=Shard(0, 1, 4),
            dst_shard=Shard(0, 2, 4),
        )


@pytest.mark.parametrize(
    "edit", [{"kv_heads": False}, {"axis": 0, "parts": [2]}], ids=["not-heads", "heads-on-axis-0"]
)
def test_a_peer_s_page_array_that_is_no_kernel_pages_of_heads_stays_opaque(edit: dict[str, Any]) -> None:
    """Only an array of KV heads on axis 1 reads as kernel pages: another array of the same
    shape leaves the pages opaque, refused against a cache of blocks."""
    _, src, _ = edited_cache(vx.KVCacheLayout.LBNHC, 1)
    _, dst, _ = edited_cache(vx.KVCacheLayout.LBHNC, 2)
    wire = json.loads(dst.describe().to_json())
    wire["groups"][0]["opaque_pages"]["arrays"][0].update(edit)
    with pytest.raises(BlockMapError, match=r"dst is opaque pages \(subpaged-attention: .*\) and src is not"):
        block_map(src, RegistrationDescription.from_json(json.dumps(wire)), [1], [2])
