"""Modular MAX: one cross-layer buffer [NB, KV, NL, BS, NH, HS], KV 2 or 1 (MLA).

Worked examples from LMCache's MAX branch (test_max_layout_utils @b4ac09c2, facts sheet
`lmcache-branch-facts.md` section 1), then kvlayout's own: the hints MAX sends are
checked, the description, and a store/load round trip for both K/V sizes.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import kvlayout
from kvlayout import DetectionError, EngineType
from kvlayout import EngineKVFormat as F
from kvlayout.layout.description import Axis, Grouping, KVPacking
from kvlayout.transfer import prepare

MAX = F.NB_KV_NL_BS_NH_HS


def detect(kv: Any, engine: str | EngineType, hints: Any = None) -> tuple[F, Any]:
    """Detection, its normalized registration typed loosely (tests index into it)."""
    return kvlayout.normalize_kv_and_discover_format(kv, engine, hints)


def test_the_format_and_the_engine() -> None:
    assert int(MAX) == 19  # LMCache's branch says 9, which 0.5.6 already uses
    assert EngineType.MAX.value == "max" and EngineType("max") is EngineType.MAX
    assert kvlayout.describe_shape(MAX) == "[NB, KV, NL, BS, NH, HS]"
    assert kvlayout.get_attention_backend(MAX) == "Modular MAX cross-layer"
    assert kvlayout.is_cross_layer(MAX) and not kvlayout.is_hnd(MAX) and not kvlayout.is_mla(MAX)
    assert kvlayout.has_leading_block_axis(MAX)
    assert kvlayout.layout_of(MAX).kv_size is None  # the buffer says: 2, or 1 for MLA


def test_example_1_detection_and_geometry() -> None:
    t = torch.zeros(32, 2, 4, 16, 8, 64, dtype=torch.bfloat16)
    fmt, kv = detect(t, EngineType.MAX)
    assert fmt is MAX
    assert kv.data_ptr() == t.data_ptr() and kv.shape == t.shape  # a view of the caller's tensor
    got = (
        kvlayout.get_num_blocks(kv, fmt), kvlayout.get_num_layers(kv, fmt), kvlayout.get_block_size(kv, fmt),
        kvlayout.get_num_heads(kv, fmt), kvlayout.get_head_size(kv, fmt), kvlayout.get_dtype(kv, fmt),
    )  # fmt: skip
    assert got == (32, 4, 16, 8, 64, torch.bfloat16)
    assert kvlayout.get_concrete_engine_kv_shape(kv, fmt) == "[32, 2, 4, 16, 8, 64]"
    # example 5: tokens, hidden and elements per layer
    assert kvlayout.get_tokens_per_layer(kv, fmt) == kvlayout.get_page_buffer_size(kv, fmt) == 512
    assert kvlayout.get_hidden_dim_size(kv, fmt) == 512
    assert kvlayout.get_elements_per_layer(kv, fmt) == 524_288
    # example 4: one base pointer whatever the layers
    assert kvlayout.get_group_data_ptrs(kv, fmt, [0, 1, 2, 3]) == [t.data_ptr()]
    # a one-element list is the same buffer
    assert detect([t], "max")[0] is MAX


def test_examples_2_and_3_descriptors_carry_the_kv_size() -> None:
    t = torch.zeros(32, 2, 4, 16, 8, 64, dtype=torch.float16)
    fmt, kv = detect(t, "max")
    desc = kvlayout.make_page_buffer_shape_desc(kv, fmt, 0, 4, 32, 16)
    got = (desc.kv_size, desc.nl, desc.nb, desc.bs, desc.nh, desc.hs, desc.element_size)
    assert got == (2, 4, 32, 16, 8, 64, 2)
    assert kvlayout.get_concrete_engine_kv_shape_from_shape_desc(desc, fmt) == "[32, 2, 4, 16, 8, 64]"
    mla = torch.zeros(32, 1, 4, 16, 1, 512, dtype=torch.bfloat16)
    fmt, kv = detect(mla, "max")
    desc = kvlayout.make_page_buffer_shape_desc(kv, fmt, 0, 4, 32, 16)
    assert (desc.kv_size, desc.nh, desc.hs) == (1, 1, 512)
    assert kvlayout.get_kv_size(kv, fmt) == 1
    assert kvlayout.get_concrete_engine_kv_shape_from_shape_desc(desc, fmt) == "[32, 1, 4, 16, 1, 512]"


def test_example_6_what_max_does_not_register() -> None:
    with pytest.raises(
        kvlayout.DetectionError, match=re.escape("NB_KV_NL_BS_NH_HS needs dim 1 in 1 or 2 (got 3)")
    ):
        detect(torch.zeros(32, 3, 4, 16, 8, 64), "max")
    t = torch.zeros(2, 2, 2, 2, 2, 2)
    with pytest.raises(
        kvlayout.DetectionError,
        match=re.escape(
            "NL_X_NB_KV_ONE_BS_NH_HS needs dim 2 == 1 (got 2): NL x [NB, KV, 1, BS, NH, HS] (a list is MAX's "
            "per-layer buffers; its per-device buffers, one per TP shard, are each a registration of their own)"
        ),
    ):
        detect([t, t.clone()], "max")  # two devices' buffers (KVCacheBuffer.values) are not one cache
    with pytest.raises(
        kvlayout.DetectionError, match=r"MAX: no MAX format has list depth 0 and tensor rank 5"
    ):
        detect(torch.zeros(2, 2, 2, 2, 2), "max")
    with pytest.raises(kvlayout.RegistrationError, match=r"size KV=3 is not one of 1 or 2"):
        kvlayout.bind(torch.zeros(4, 3, 2, 2, 2, 2), MAX)


SENT = {  # what MAX's connector sends with example 1
    "layout_format": "NB_KV_NL_BS_NH_HS", "num_layers": 4, "kv_dim": 2, "tokens_per_block": 16,
    "page_size": 16, "num_kv_heads": 8, "head_dim": 64, "total_num_blocks": 32,
}  # fmt: skip


def test_the_hints_max_sends_are_checked() -> None:
    t = torch.zeros(32, 2, 4, 16, 8, 64, dtype=torch.bfloat16)
    assert detect(t, "max", SENT)[0] is MAX
    for hint, wrong, token in (("num_layers", 5, "NL"), ("kv_dim", 1, "KV"), ("total_num_blocks", 31, "NB"),
                               ("num_kv_heads", 4, "NH"), ("head_dim", 128, "HS")):  # fmt: skip
        with pytest.raises(
            kvlayout.LayoutHintError,
            match=re.escape(
                f"MAX: layout hint {hint}={wrong} contradicts NB_KV_NL_BS_NH_HS, whose {token} is "
            ),
        ):
            detect(t, "max", {**SENT, hint: wrong})
    with pytest.raises(
        kvlayout.LayoutHintError,
        match=re.escape("layout hints tokens_per_block=16 and page_size=8 disagree"),
    ):
        detect(t, "max", {**SENT, "page_size": 8})
    with pytest.raises(
        kvlayout.LayoutHintError,
        match=re.escape("layout hint tokens_per_block=8 contradicts NB_KV_NL_BS_NH_HS, whose BS is 16"),
    ):
        detect(t, "max", {"page_size": 8})
    with pytest.raises(
        kvlayout.LayoutHintError,
        match=re.escape(
            "layout hint layout_format='NB_NL_TWO_BS_NH_HS' contradicts the registration, which max registers "
            "as NB_KV_NL_BS_NH_HS"
        ),
    ):
        detect(t, "max", {**SENT, "layout_format": "NB_NL_TWO_BS_NH_HS"})
    with pytest.raises(
        kvlayout.LayoutHintError, match="layout hint layout_format='MAX' is not an engine KV format"
    ):
        detect(t, "max", {"layout_format": "MAX"})


def test_the_description() -> None:
    desc = kvlayout.describe(MAX)
    assert desc.grouping is Grouping.SINGLE_TENSOR and desc.kv_packing is KVPacking.SPLIT
    assert desc.dims == ((Axis.B,), (Axis.KV,), (Axis.L,), (Axis.N,), (Axis.H,), (Axis.C,))
    assert desc.kv_placement == "dim 1" and desc.lists == ()
    assert kvlayout.to_engine_kv_format(desc) is MAX
    sized = kvlayout.describe(MAX, {"NB": 32, "KV": 1, "NL": 4, "BS": 16, "NH": 1, "HS": 512})
    assert sized.extents[Axis.KV] == 1 and sized.kv_size == 1
    assert sized.resolved_strides() == (4 * 16 * 512, 4 * 16 * 512, 16 * 512, 512, 512, 1)


@pytest.mark.parametrize(("kv_dim", "heads"), [(2, 8), (1, 1)])
def test_a_round_trip_restores_the_blocks(kv_dim: int, heads: int) -> None:
    t = torch.randn(6, kv_dim, 3, 4, heads, 8)
    fmt, kv = detect(t, "max")
    plan = prepare(kv, fmt)
    shape, dtype = plan.chunk_shape(8)
    assert shape == (kv_dim, 3, 8, heads * 8)
    chunks = [torch.zeros(shape, dtype=dtype) for _ in range(2)]
    ids = [5, 1, 2, 0]
    original = t.clone()
    plan.store_blocks(ids, chunks)
    # LMCache's chunk layout: [kv, layer, token, head * HS + element]
    assert torch.equal(chunks[0][:, :, :4].reshape(kv_dim, 3, 4, heads, 8), original[5])
    assert torch.equal(chunks[1][:, :, 4:].reshape(kv_dim, 3, 4, heads, 8), original[0])
    t.zero_()
    plan.load_blocks(ids, chunks)
    assert torch.equal(t[ids], original[ids]) and not t[[3, 4]].any()


@pytest.mark.parametrize(("kv_dim", "heads", "hs"), [(2, 4, 64), (1, 1, 576)])
def test_per_layer_buffers(kv_dim: int, heads: int, hs: int) -> None:
    """``per_layer_buffers``: MAX allocates one ``[NB, KV, 1, BS, NH, HS]`` buffer per layer
    (``KVCacheBuffer.values_per_layer``); it was refused as a list of several buffers. It
    maps into vLLM's flash-attention cache (K/V) or vLLM's MLA cache (one latent plane)."""
    nl, nb, bs = 3, 6, 16
    layers = [
        torch.randn(nb, kv_dim, 1, bs, heads, hs, generator=torch.Generator().manual_seed(i)).to(
            torch.bfloat16
        )
        for i in range(nl)
    ]
    sent = {"num_layers": nl, "kv_dim": kv_dim, "page_size": bs, "num_kv_heads": heads, "head_dim": hs,
            "total_num_blocks": nb}  # fmt: skip
    src = kvlayout.detect(layers, "max", sent)
    group = src.kernel_groups[0]
    assert (group.format, group.block_size, group.num_blocks) == (F.NL_X_NB_KV_ONE_BS_NH_HS, bs, nb)
    assert kvlayout.get_num_layers(layers, group.format) == nl
    if kv_dim == 2:
        dst_kv = [torch.zeros(2, nb, bs, heads, hs, dtype=torch.bfloat16) for _ in range(nl)]
        dst = kvlayout.detect(dst_kv, "vllm", {"kv_layout": "NHD"})
    else:
        dst_kv = [torch.zeros(nb, bs, hs, dtype=torch.bfloat16) for _ in range(nl)]
        dst = kvlayout.detect(dst_kv, "vllm")
    kvlayout.transfer.block_map(src, dst, [4, 1], [2, 5]).copy()
    for layer, d in zip(layers, dst_kv, strict=True):
        for s_block, d_block in ((4, 2), (1, 5)):
            for kv in range(kv_dim):
                want = layer[s_block, kv, 0]  # [BS, NH, HS]
                got = d[kv, d_block] if kv_dim == 2 else d[d_block].view(bs, 1, hs)
                assert torch.equal(got, want)
        others = [b for b in range(nb) if b not in (2, 5)]
        assert not (d[:, others] if kv_dim == 2 else d[others]).count_nonzero()
    with pytest.raises(
        kvlayout.LayoutHintError, match=r"layout hint head_dim=32 contradicts NL_X_NB_KV_ONE_BS_NH_HS"
    ):
        kvlayout.detect(layers, "max", {**sent, "head_dim": 32})
    devices = [torch.zeros(nb, 2, 1, bs, heads, hs, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(
        DetectionError,
        match=r"a list of 2 distinct buffers is more than the per-layer buffers of layout hint "
        r"num_layers=1 .* per-device buffers, one per TP shard, are each a registration",
    ):
        kvlayout.detect(devices, "max", {**sent, "num_layers": 1, "kv_dim": 2})  # a one-layer model at TP 2
    assert kvlayout.detect(layers, "max", {**sent, "num_layers": 7}).kernel_groups  # fewer: layers may share


def _shards(tp: int, kv_dim: int, heads: int, hs: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """One TP shard's ``KVCacheBuffer.values`` each: ``[pages, kv_dim, NL, page_size,
    n_kv_heads_per_device, head_dim]`` (MAX's ``shape_per_block``; MLA's one head on every shard)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, kv_dim, 3, 16, heads, hs, generator=g).to(dtype) for _ in range(tp)]


def _sent(heads: int = 8, hs: int = 64, kv_dim: int = 2) -> dict[str, Any]:
    """What MAX's connector sends with a :func:`_shards` buffer."""
    return {
        **SENT,
        "num_layers": 3,
        "total_num_blocks": 6,
        "kv_dim": kv_dim,
        "num_kv_heads": heads,
        "head_dim": hs,
    }


@pytest.mark.parametrize(
    ("dtype", "hs"),
    [(torch.bfloat16, 64), (torch.float8_e4m3fn, 128), (torch.float32, 1), (torch.float8_e8m0fnu, 1)],
    ids=["bf16", "fp8-values", "fp32-scales", "e8m0-scales"],
)
def test_tp_shards_map_by_heads(dtype: torch.dtype, hs: int) -> None:
    """MAX's MHA shards split 8 KV heads evenly (``MHAKVCacheParams.n_kv_heads_per_device``),
    values and a quantized cache's scales (``shape_per_scale_block``: ``head_dim /
    granularity`` a head) alike: TP 2 into TP 1, byte for byte as MAX indexes them."""
    src = _shards(2, 2, 4, hs, dtype, seed=1)
    whole = torch.zeros(6, 2, 3, 16, 8, hs, dtype=dtype)
    dst = kvlayout.detect(whole, "max", _sent(8, hs))
    for r, shard in enumerate(src):
        m = kvlayout.transfer.block_map(
            kvlayout.detect(shard, "max", _sent(4, hs)), dst, [4, 1], [2, 5], num_tokens=20,
            src_shard=kvlayout.transfer.Shard(r, 2, 8), dst_shard=kvlayout.transfer.Shard(0, 1, 8),
        )  # fmt: skip
        assert m.kind == "head slice" and m.copy() == 1
    written = torch.zeros(6, 16, dtype=torch.bool)
    for p in range(20):
        s_block, d_block, slot = (4, 1)[p // 16], (2, 5)[p // 16], p % 16
        written[d_block, slot] = True
        for r, shard in enumerate(src):  # shard r holds heads [4r, 4r + 4)
            got = whole[d_block, :, :, slot, 4 * r : 4 * r + 4].view(torch.uint8)
            assert torch.equal(got, shard[s_block, :, :, slot].view(torch.uint8))
    assert not whole.view(torch.uint8).permute(0, 3, 1, 2, 4, 5)[~written].any()


def test_mla_latents_map_from_any_shard() -> None:
    """MLA: ``kv_dim`` 1, one head of 576 on every shard (``replicates_kv_across_tp``), so
    rank 2 of TP 4 maps whole into TP 1, and a partly filled block moves its tokens only."""
    src = _shards(1, 1, 1, 576, torch.bfloat16, seed=3)[0]
    whole = torch.zeros_like(src)
    sent = _sent(1, 576, kv_dim=1)
    m = kvlayout.transfer.block_map(
        kvlayout.detect(src, "max", sent), kvlayout.detect(whole, "max", sent), [3], [0], num_tokens=10,
        src_shard=kvlayout.transfer.Shard(2, 4, 1), dst_shard=kvlayout.transfer.Shard(0, 1, 1),
    )  # fmt: skip
    assert m.copy() == 1
    assert torch.equal(whole[0, :, :, :10], src[3, :, :, :10])
    assert not whole[0, :, :, 10:].any() and not whole[1:].any()


def test_padded_pages_map_over_their_padding() -> None:
    """A pool that pads its pages (``page_view(slab, shape, dtype, padded_page_bytes)``:
    a page-grid slice, dim-0 stride wider than a page) is read with its stride."""
    page = 2 * 3 * 16 * 8 * 64
    grid = torch.randn(6, page + 512).to(torch.bfloat16)
    padded = grid[:, :page].view(6, 2, 3, 16, 8, 64)
    assert padded.stride(0) == page + 512 and not padded.is_contiguous()
    dense = torch.zeros(6, 2, 3, 16, 8, 64, dtype=torch.bfloat16)
    pad = grid[:, page:].clone()
    sent = _sent()
    src, dst = kvlayout.detect(padded, "max", sent), kvlayout.detect(dense, "max", sent)
    assert kvlayout.transfer.block_map(src, dst, [5, 0], [0, 5]).copy() == 1
    assert torch.equal(dense[0], padded[5]) and torch.equal(dense[5], padded[0]) and not dense[1:5].any()
    dense[1].normal_()
    assert kvlayout.transfer.block_map(dst, src, [1], [3]).copy() == 1
    assert torch.equal(padded[3], dense[1]) and torch.equal(grid[:, page:], pad)  # padding untouched


def test_byte_views_are_refused_for_the_buffer_they_view() -> None:
    """``KVCacheBuffer.to_memory()`` re-views a shard as ``[num_pages, bytes_per_page]``
    uint8 (``_view_as_uint8_pages``) for MAX's transfer engine and host tier: no page
    structure, so it is refused naming the buffer it views; that buffer's page ``b`` is
    the run MAX's NIXL descriptor ``(base + b * bytes_per_page, bytes_per_page)`` names."""
    values = _shards(2, 2, 4, 64, torch.bfloat16, seed=5)
    pages = [v.view(torch.uint8).view(6, -1) for v in values]
    advice = "MAX's byte view of its pages (KVCacheBuffer.to_memory(): [num_pages, bytes_per_page] a TP shard"
    with pytest.raises(
        DetectionError, match=re.escape(f"MAX: kv_caches is a 2-D uint8 tensor [6, 49152], {advice}")
    ):
        kvlayout.detect(pages[0], "max", _sent(4))
    for kv in ([pages[0]], pages):  # KVCacheMemory.buffers: one a shard
        with pytest.raises(
            DetectionError, match=re.escape(f"MAX: kv_caches[0] is a 2-D uint8 tensor [6, 49152], {advice}")
        ):
            kvlayout.detect(kv, "max")
    with pytest.raises(
        DetectionError,
        match=re.escape("register the buffer it views, KVCacheBuffer.values[shard] [NB, KV, NL, BS, NH, HS]"),
    ):
        kvlayout.detect([values[0], pages[1]], "max")  # asked before shapes are told apart
    with pytest.raises(DetectionError) as other:  # a 2-D buffer of values is no byte view
        kvlayout.detect(pages[0].view(torch.bfloat16), "max")
    assert "to_memory" not in str(other.value)
    bpp = pages[0].shape[1]
    twin = torch.zeros_like(values[0])
    m = kvlayout.transfer.block_map(
        kvlayout.detect(values[0], "max"), kvlayout.detect(twin, "max"), [4, 1], [2, 5]
    )
    runs = [(int(s) - values[0].data_ptr(), int(d) - twin.data_ptr(), int(n)) for s, d, n in m.runs]
    assert runs == [(4 * bpp, 2 * bpp, bpp), (1 * bpp, 5 * bpp, bpp)]
    assert m.copy() == 1 and torch.equal(twin.view(torch.uint8).view(6, -1)[5], pages[0][1])


def test_values_and_scales_together_are_refused() -> None:
    """``KVCacheBuffer.all_buffers`` lists every shard's values, then every shard's
    scales: buffers MAX keeps apart, not layers of one cache."""
    values = torch.zeros(6, 2, 3, 16, 4, 128, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(6, 2, 3, 16, 4, 1, dtype=torch.float32)
    message = (
        "MAX: kv_caches holds tensors of 2 shapes ([6, 2, 3, 16, 4, 128], [6, 2, 3, 16, 4, 1]), where MAX "
        "registers one buffer [NB, KV, NL, BS, NH, HS] or one single-layer buffer [NB, KV, 1, BS, NH, HS] a "
        "layer, all of one shape: these are buffers MAX keeps apart, an FP8 cache's values and scales"
    )
    for kv in ([values, scales], [values, values.clone(), scales, scales.clone()]):
        with pytest.raises(DetectionError, match=re.escape(message)):
            kvlayout.detect(kv, "max")
    layers = [torch.zeros(6, 2, 1, 16, 4, 128, dtype=torch.float8_e4m3fn) for _ in range(3)]
    layer_scales = [torch.zeros(6, 2, 1, 16, 4, 1) for _ in range(3)]  # per_layer_buffers' scales_per_layer
    with pytest.raises(DetectionError, match=r"MAX: kv_caches holds tensors of 2 shapes"):
        kvlayout.detect(layers + layer_scales, "max")
    assert kvlayout.detect(layer_scales, "max").kernel_groups[0].format is F.NL_X_NB_KV_ONE_BS_NH_HS


def test_layer_zeros_alias_under_per_layer_buffers_is_refused() -> None:
    """Under ``per_layer_buffers`` ``KVCacheBuffer.values[shard]`` aliases layer 0's buffer
    (``values_per_layer[shard][0]``): with MAX's ``num_layers`` it is refused naming the
    list to register, not read as a one-layer model."""
    layers = _shards(3, 2, 4, 64, torch.bfloat16, seed=7)  # stand-ins: three layers' buffers
    layers = [t[:, :, :1].contiguous() for t in layers]
    message = (
        "MAX: kv_caches is one single-layer buffer [6, 2, 1, 16, 4, 64] where layout hint num_layers=3: under "
        "per_layer_buffers KVCacheBuffer.values[shard] is layer 0's buffer alone (values_per_layer[shard][0]); "
        "register values_per_layer[shard], one buffer a layer"
    )
    for kv in (layers[0], [layers[0]]):
        with pytest.raises(kvlayout.LayoutHintError, match=re.escape(message)):
            kvlayout.detect(kv, "max", _sent(4))
    with pytest.raises(kvlayout.LayoutHintError, match=r"where layout hint num_layers=2: under"):
        kvlayout.detect(layers[0], "max", {**_sent(4), "num_layers": 2})  # two layers alias one too
    per_layer = {k: v for k, v in _sent(4).items() if k != "layout_format"}  # format 38's own name
    assert kvlayout.detect(layers, "max", per_layer).kernel_groups[0].format is F.NL_X_NB_KV_ONE_BS_NH_HS
    assert kvlayout.detect(layers[0], "max", {**_sent(4), "num_layers": 1}).kernel_groups[0].format is MAX


def _compressed(pages: int, page_size: int, ratio: int, seed: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """An MLA cache whose attention caches one entry for each ``ratio`` tokens
    (``KVCacheParams.slots_per_page = page_size // ratio``, ``cache_params.py``): the buffer is
    ``shape_per_block`` ``[kv_dim 1, NL, slots_per_page, 1, head_dim]`` a page, and MAX's
    LMCache MP connector (``_register_kv_caches``) sends ``tokens_per_block`` and
    ``page_size`` = ``params.page_size``, the tokens a page covers."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(pages, 1, 3, page_size // ratio, 1, 64, generator=g).to(torch.bfloat16)
    sent = {
        **SENT, "num_layers": 3, "kv_dim": 1, "tokens_per_block": page_size, "page_size": page_size,
        "num_kv_heads": 1, "head_dim": 64, "total_num_blocks": pages,
    }  # fmt: skip
    return buf, sent


def test_compressed_pages_read_with_the_page_size_max_sends() -> None:
    """A page of ``page_size`` tokens holds ``slots_per_page`` entries: MAX's hints name the
    tokens, the buffer's BS axis the entries; the registration's blocks are its entries,
    and a request of ``n`` tokens holds ``n // ratio`` of them (MAX writes entry ``e`` once
    its tokens are in: ``cutoff = (pos + 1) // RATIO`` in MAX's indexer test). Entry ``e``
    of a request sits in page ``lut[e // spp]``, slot ``e % spp`` (its numpy reference:
    ``blocks[lut[e // spp], 0, layer, e % spp, 0]``); a map moves them, entry for entry,
    into a cache of pages twice as long."""
    src, sent = _compressed(8, 16, 4, seed=11)  # 4 entries a page
    dst, dst_sent = _compressed(5, 32, 4, seed=12)  # 8 entries a page
    dst.zero_()
    a, b = kvlayout.detect(src, "max", sent), kvlayout.detect(dst, "max", dst_sent)
    assert (a.format, a.kernel_groups[0].block_size, b.kernel_groups[0].block_size) == (MAX, 4, 8)
    tokens, src_lut, dst_lut = 37, [5, 2, 7], [1, 3]
    entries = tokens // 4  # 9: the last token's run is not complete
    assert kvlayout.transfer.block_map(a, b, src_lut, dst_lut, num_tokens=entries).copy() == 1
    written = torch.zeros(5, 8, dtype=torch.bool)
    for e in range(entries):
        page, slot = dst_lut[e // 8], e % 8
        written[page, slot] = True
        assert torch.equal(dst[page, 0, :, slot, 0], src[src_lut[e // 4], 0, :, e % 4, 0])
    assert not dst.permute(0, 3, 1, 2, 4, 5)[~written].any()
    back = torch.zeros_like(src)
    assert kvlayout.transfer.block_map(b, kvlayout.detect(back, "max", sent), dst_lut, [0, 1, 4]).copy() == 1
    assert torch.equal(back[[0, 1]], src[[5, 2]]) and torch.equal(back[4, :, :, :1], src[7, :, :, :1])


def test_a_page_size_its_slots_do_not_divide_is_refused() -> None:
    buf, sent = _compressed(8, 16, 4, seed=13)
    with pytest.raises(
        kvlayout.LayoutHintError,
        match=re.escape(
            "MAX: layout hint tokens_per_block=18 contradicts NB_KV_NL_BS_NH_HS, whose BS is 4: the slots of a "
            "page (KVCacheParams.slots_per_page) divide the tokens it covers (page_size)"
        ),
    ):
        kvlayout.detect(buf, "max", {**sent, "tokens_per_block": 18, "page_size": 18})
    with pytest.raises(kvlayout.LayoutHintError, match="whose BS is 4"):
        kvlayout.detect(buf, "max", {**sent, "tokens_per_block": 2, "page_size": 2})
