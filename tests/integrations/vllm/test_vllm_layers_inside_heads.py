"""vLLM's ``BHLNC`` (``VLLM_KV_CACHE_LAYOUT=BHLNC``, which every backend that declares no
layouts accepts): per-layer ``[B, H, N, C]`` views of one allocation whose blocks hold
each head's rows of every layer together. Detection reads the views as the cross-layer
tensor they tile (``NB_NH_NL_BS_CS``, a view), and it is served like any layout. Before,
the hint and the views were refused. Built with vLLM 0.33's own view functions."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout.detection.base import DetectionError
from kvlayout.integrations.vllm import apply_kv_cache_group_edits, transfer_layers
from kvlayout.transfer import block_map, prepare

vx = pytest.importorskip("kvlayout.testing.vllm")  # vLLM's spec classes

pytest.importorskip("vllm")

NL, NB, BS, NH, HS = 3, 6, 16, 4, 16


def cache(layout: Any, seed: int, **spec: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """A 3-layer model on FlashAttention (which declares no layouts, so any is allowed),
    its buffer filled with random bytes; the views as int16 so equal bytes compare equal."""
    args = {"block_size": BS, "num_kv_heads": NH, "head_size": HS, "dtype": torch.bfloat16, **spec}
    engine = vx.uniform_engine(
        vx.kvi.FullAttentionSpec(**args), vx.FLASH_ATTN, num_layers=NL, num_blocks=NB, layout=layout
    )
    buf, raw = vx.allocate_v033(engine)
    g = torch.Generator().manual_seed(seed)
    buf.copy_(torch.randint(-128, 128, buf.shape, dtype=torch.int8, generator=g))
    return engine, {name: v.view(torch.int16) for name, v in raw.items()}


def registration(engine: Any, views: dict[str, torch.Tensor], hints: Any) -> kvlayout.Registration:
    """The documented recipe: the group edits, the layers vLLM transfers, detect."""
    layers, groups = transfer_layers(engine.config, apply_kv_cache_group_edits(engine.config, views, hints))
    return kvlayout.detect(layers, "vllm", hints, layer_groups=groups)


@pytest.mark.parametrize("hints", [None, {"kv_layout": "BHLNC"}, {"kv_layout": "bhlnc", "num_kv_heads": NH}])
def test_the_views_read_as_the_one_tensor_they_tile(hints: Any) -> None:
    engine, views = cache(vx.KVCacheLayout.BHLNC, 0)
    first = next(iter(views.values()))
    assert first.stride(1) == NL * BS * 2 * HS  # heads a page of every layer apart
    reg = registration(engine, views, hints)
    group = reg.only_group()
    assert group.format is F.NB_NH_NL_BS_CS
    assert (group.num_blocks, group.block_size, group.descriptor().nh, group.descriptor().nl) == (
        NB,
        BS,
        NH,
        NL,
    )
    pool = reg.registered_kv
    assert isinstance(pool, torch.Tensor) and pool.data_ptr() == first.data_ptr()  # a view, never a copy
    for layer, v in enumerate(views.values()):
        assert torch.equal(pool[:, :, layer], v)
    assert reg.data_ptrs(range(NL)) == [first.data_ptr()]


def test_its_chunk_holds_the_bytes_of_the_same_cache_laid_out_nhd() -> None:
    """A chunk is layout-free: storing blocks of the BHLNC cache gives the chunk of the
    same data in vLLM's default layout, and loading it back puts it in the same slots."""
    engine, views = cache(vx.KVCacheLayout.BHLNC, 1)
    other, nhd = cache(vx.KVCacheLayout.LBNHC, 2)
    for name in views:
        nhd[name].copy_(views[name])  # the same logical [B, H, N, C] content
    a = prepare(registration(engine, views, None))
    b = prepare(registration(other, nhd, {"kv_layout": "NHD"}))
    shape, dtype = a.chunk_shape(2 * BS)
    got, want = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
    a.store_blocks([4, 1], [got])
    b.store_blocks([4, 1], [want])
    assert torch.equal(got, want)
    before = {name: v.clone() for name, v in views.items()}
    a.load_blocks([0, 5], [want])
    for name, v in views.items():
        assert torch.equal(v[0], nhd[name][4]) and torch.equal(v[5], nhd[name][1])
        assert torch.equal(v[1:5], before[name][1:5])


def test_maps_to_and_from_another_layout_move_the_request_and_nothing_else() -> None:
    engine, src_views = cache(vx.KVCacheLayout.BHLNC, 3)
    other, dst_views = cache(vx.KVCacheLayout.LBNHC, 4)
    src = registration(engine, src_views, None)
    dst = registration(other, dst_views, {"kv_layout": "NHD"})
    before = {name: v.clone() for name, v in dst_views.items()}
    m = block_map(src, dst, [4, 1], [0, 5], num_tokens=BS + 7)
    m.copy()
    for name, d in dst_views.items():
        s = src_views[name]
        assert torch.equal(d[0], s[4]) and torch.equal(d[5][:, :7], s[1][:, :7])
        assert torch.equal(d[5][:, 7:], before[name][5][:, 7:])
        assert torch.equal(d[1:5], before[name][1:5])
    back = block_map(dst, src, [0, 5], [2, 3], num_tokens=2 * BS)
    back.copy()
    for name, d in dst_views.items():
        assert torch.equal(src_views[name][2], d[0]) and torch.equal(src_views[name][3], d[5])


def test_between_two_bhlnc_caches_a_whole_block_of_every_layer_is_one_run() -> None:
    """A block holds every layer's heads together: one run per block, merged across
    consecutive block ids (vLLM's NixlConnector also sends one region per block)."""
    engine, src_views = cache(vx.KVCacheLayout.BHLNC, 5)
    other, dst_views = cache(vx.KVCacheLayout.BHLNC, 6)
    src, dst = registration(engine, src_views, None), registration(other, dst_views, None)
    page = NH * NL * BS * 2 * HS * 2
    m = block_map(src, dst, [4, 1, 2], [0, 5, 3], num_tokens=3 * BS)
    assert (m.num_runs, m.num_bytes) == (3, 3 * page)
    assert block_map(src, dst, [1, 2, 3], [2, 3, 4], num_tokens=3 * BS).num_runs == 1
    m.copy()
    for name, d in dst_views.items():
        assert torch.equal(d[[0, 5, 3]], src_views[name][[4, 1, 2]])


def test_mla_under_bhlnc_is_one_head_read_as_latents() -> None:
    """One head: the views are BLHNC's memory, read per layer as vLLM's MLA latents."""
    spec = vx.kvi.MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    engine = vx.uniform_engine(
        spec, vx.FLASH_ATTN, num_layers=NL, num_blocks=NB, layout=vx.KVCacheLayout.BHLNC
    )
    _, views = vx.allocate_v033(engine)
    reg = kvlayout.detect(list(views.values()), "vllm", {"kv_layout": "BHLNC", "kv_dim": 1})
    assert reg.only_group().format is F.NL_X_NB_BS_HS


def _expect(error: type[Exception], message: str, kv: Any, hints: Any = None) -> None:
    with pytest.raises(error, match="^" + re.escape(message)):
        kvlayout.detect(kv, "vllm", hints)


BHLNC_READ = (
    "kv_caches read as vLLM's BHLNC (per-layer views of one allocation, each head's rows of every layer "
    "together in a block, read as one [NB, H, NL, N, C] tensor): "
)


def test_another_layout_hint_on_bhlnc_views_is_refused() -> None:
    _, views = cache(vx.KVCacheLayout.BHLNC, 7)
    _expect(
        kvlayout.LayoutHintError,
        "layout hint kv_layout='HND', but kv_caches are per-layer views of one allocation with layers inside "
        "heads inside blocks (vLLM's BHLNC: kv_caches[0] (shape (6, 4, 16, 32), stride (6144, 1536, 32, 1)), "
        "each layer one page further); pass kv_layout='BHLNC' or no kv_layout",
        list(views.values()),
        {"kv_layout": "HND"},
    )


def test_views_that_do_not_tile_the_allocation_are_refused_naming_the_layer() -> None:
    engine, views = cache(vx.KVCacheLayout.BHLNC, 8)
    layers = list(views.values())
    _expect(
        DetectionError,
        BHLNC_READ
        + "kv_caches[1] starts 1024 elements after kv_caches[0], not 1 pages (512): the layers of one "
        "allocation (vLLM's KVCacheTensor.layers), in its order, are one cross-layer tensor; detect each "
        "allocation's layers on their own",
        [layers[0], layers[2], layers[1]],
    )
    shared = vx.share_kv_caches(
        engine, views, {"model.layers.3.self_attn.attn": "model.layers.0.self_attn.attn"}
    )
    _expect(
        DetectionError,
        BHLNC_READ + "kv_caches[3] starts where kv_caches[0] does (vLLM's KV sharing, or layers of two KV "
        "cache groups, which overlay each other): one cross-layer tensor holds each layer once, so detect "
        "each KV cache group's own layers, without the layers that share another's KV cache",
        list(shared.values()),
    )
    _expect(
        DetectionError,
        BHLNC_READ + "kv_caches[1] is not in kv_caches[0]'s allocation",
        [torch.zeros(NB, 1, BS, 2 * HS, dtype=torch.int16) for _ in range(NL)],
        {"kv_layout": "BHLNC"},
    )
    _expect(  # some of the allocation's layers: every layer of it is one tensor's
        DetectionError,
        BHLNC_READ + "kv_caches[0] (shape (6, 4, 16, 32), stride (6144, 1536, 32, 1)) has its heads 1536 "
        "elements apart, not 2 layers of 512-element pages (1024)",
        layers[:2],
    )


def test_the_bare_tensor_is_bhlnc_only_under_its_hint() -> None:
    pool = torch.zeros(NB, NH, NL, BS, 2 * HS)
    assert kvlayout.detect(pool, "vllm", {"kv_layout": "BHLNC"}).only_group().format is F.NB_NH_NL_BS_CS
    with pytest.raises(DetectionError, match=re.escape("no vLLM format has list depth 0 and tensor rank 5")):
        kvlayout.detect(pool, "vllm")
    sparse = [torch.zeros(NB, NH, BS, 2 * HS).to_sparse() for _ in range(NL)]
    with pytest.raises(TypeError, match="sparse"):  # validation's word, not a BHLNC reading's
        kvlayout.detect(sparse, "vllm", {"kv_layout": "BHLNC"})


def test_views_of_separate_storages_are_per_layer_tensors_without_the_hint() -> None:
    """Heads spaced like BHLNC's but each layer its own tensor: not one allocation, so
    not read as one; per-layer, their interior padding is what is refused."""
    layers = [torch.zeros(NB, NH, NL, BS, 2 * HS)[:, :, 0] for _ in range(NL)]
    with pytest.raises(kvlayout.StridedViewError, match=re.escape("interior padding is not supported")):
        kvlayout.detect(layers, "vllm")


def gemma_like(layout: Any, seed: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """Sliding-window and full attention in three KV cache groups, overlaid by vLLM."""
    kw = {"block_size": BS, "num_kv_heads": NH, "head_size": HS, "dtype": torch.bfloat16}
    full = vx.kvi.FullAttentionSpec(**kw)
    swa = vx.kvi.SlidingWindowSpec(**kw, sliding_window=4 * BS)
    specs = {f"model.layers.{i}.self_attn.attn": full if i % 3 == 2 else swa for i in range(6)}
    local = [n for n, s in specs.items() if s is swa]
    groups = [local[:2], local[2:], [n for n, s in specs.items() if s is full]]
    engine = vx.make_engine(specs, groups, lambda s: BS, num_blocks=NB, layout=layout)
    buf, raw = vx.allocate_v033(engine)
    buf.copy_(
        torch.randint(-128, 128, buf.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
    )
    return engine, {name: v.view(torch.int16) for name, v in raw.items()}


def test_each_group_of_several_is_its_own_registration_under_its_group_id() -> None:
    """vLLM overlays its groups, each one cross-layer tensor under BHLNC: the edits check
    them one at a time, ``transfer_layers(..., group=g)`` hands each to ``detect`` under
    its group id, and a peer detected the same way maps to it layer for layer."""
    engine, views = gemma_like(vx.KVCacheLayout.BHLNC, 9)
    other, nhd = gemma_like(vx.KVCacheLayout.LBNHC, 10)
    edited = apply_kv_cache_group_edits(engine.config, views)
    nhd_edited = apply_kv_cache_group_edits(other.config, nhd, {"kv_layout": "NHD"})
    layers, groups = transfer_layers(engine.config, edited)
    with pytest.raises(DetectionError, match=re.escape("kv_caches[2] starts where kv_caches[0] does")):
        kvlayout.detect(layers, "vllm", layer_groups=groups)
    for g, group in enumerate(engine.config.kv_cache_groups):
        src_layers, src_groups = transfer_layers(engine.config, edited, group=g)
        dst_layers, dst_groups = transfer_layers(other.config, nhd_edited, group=g)
        src = kvlayout.detect(src_layers, "vllm", layer_groups=src_groups)
        dst = kvlayout.detect(dst_layers, "vllm", {"kv_layout": "NHD"}, layer_groups=dst_groups)
        assert src.only_group().format is F.NB_NH_NL_BS_CS and src.only_group().engine_group == g
        assert dst.only_group().engine_group == g
        block_map(src, dst, [3, 1], [0, 4], num_tokens=2 * BS).copy()
        for name in group.layer_names:
            assert torch.equal(nhd[name][[0, 4]], views[name][[3, 1]])


def test_layer_groups_name_the_pool_s_group_and_may_not_split_it() -> None:
    _, views = cache(vx.KVCacheLayout.BHLNC, 11)
    layers = list(views.values())
    reg = kvlayout.detect(layers, "vllm", layer_groups=[[], [0, 1, 2]])
    assert reg.only_group().engine_group == 1
    _, formats = kvlayout.normalize_and_discover_per_layer_formats(layers, [[], [0, 1, 2]], "vllm")
    assert formats == [F.NB_NH_NL_BS_CS] * NL
    with pytest.raises(
        DetectionError,
        match=re.escape(
            "kv_caches are views of one NB_NH_NL_BS_CS tensor, one allocation holding every layer, so they are "
            "one layer group, but layer_groups put them in groups [0, 1, 2]: detect each group's own allocation"
        ),
    ):
        kvlayout.detect(layers, "vllm", layer_groups=[[0], [1], [2]])


def test_kv_sharing_layers_pass_the_edits_and_are_left_out_of_detection() -> None:
    """A sharer is its target's own tensor: the edits check it as its target; detection
    holds each layer once, so the sharers are left out (their target's blocks are theirs)."""
    engine, views = cache(vx.KVCacheLayout.BHLNC, 12)
    sharer = {"model.layers.3.self_attn.attn": "model.layers.0.self_attn.attn"}
    shared = vx.share_kv_caches(engine, views, sharer)
    edited = apply_kv_cache_group_edits(engine.config, shared)
    owned = {name: v for name, v in edited.items() if name not in sharer}
    assert kvlayout.detect(list(owned.values()), "vllm").only_group().format is F.NB_NH_NL_BS_CS


def test_one_head_is_one_cross_layer_tensor_under_the_hint() -> None:
    """TP = KV heads: one head a rank. Its views are BLHNC's memory too, read per layer
    without the hint; under it, a block of every layer is one run."""
    _, views = cache(vx.KVCacheLayout.BHLNC, 13, num_kv_heads=1)
    layers = list(views.values())
    per_layer = kvlayout.detect(layers, "vllm", {"kv_layout": "HND"})
    pooled = kvlayout.detect(layers, "vllm", {"kv_layout": "BHLNC"})
    assert per_layer.only_group().format is F.NL_X_NB_NH_BS_CS
    assert pooled.only_group().format is F.NB_NH_NL_BS_CS
    assert block_map(pooled, pooled, [0, 1], [3, 4], num_tokens=2 * BS).num_runs == 1
    assert block_map(per_layer, per_layer, [0, 1], [3, 4], num_tokens=2 * BS).num_runs == 2 * NL


def test_hints_that_contradict_bhlnc_views_are_refused() -> None:
    _, views = cache(vx.KVCacheLayout.BHLNC, 14)
    _expect(
        kvlayout.LayoutHintError,
        "the layout hints say MLA (one latent row a token: kv_dim=1 or an MLA layout_format), but kv_caches[0] "
        "(shape (6, 4, 16, 32), stride (6144, 1536, 32, 1)) are BHLNC views with 4 heads",
        list(views.values()),
        {"kv_dim": 1},
    )
    blhnc = torch.zeros(NB, NL, NH, BS, 2 * HS)  # a BLHNC pool viewed [NB, H, NL, N, C]
    _expect(
        kvlayout.LayoutHintError,
        "layout hint kv_layout='BHLNC' reads a bare tensor as [NB, H, NL, N, C] in memory order, but kv_caches "
        "(shape (6, 4, 3, 16, 32), stride (6144, 512, 2048, 32, 1)) has its dims in memory in the order "
        "[0, 2, 1, 3, 4]",
        blhnc.transpose(1, 2),
        {"kv_layout": "BHLNC"},
    )


def test_every_tiling_rule_is_checked_by_name() -> None:
    """Each way views can miss one allocation's tiling names the view and the rule."""
    pool = torch.zeros(NB, NH, NL, BS, 2 * HS, dtype=torch.int16)
    views = [pool[:, :, layer] for layer in range(NL)]
    bhlnc = {"kv_layout": "BHLNC"}
    other = pool.as_strided((NB, NH, BS, HS), (*views[1].stride()[:2], HS, 1), views[1].storage_offset())
    _expect(
        DetectionError,
        BHLNC_READ + "kv_caches[1] (shape (6, 4, 16, 16), stride (6144, 1536, 16, 1)) is not viewed as "
        "kv_caches[0] (shape (6, 4, 16, 32), stride (6144, 1536, 32, 1)) is",
        [views[0], other, views[2]],
    )
    one_head = torch.zeros(NB, 1, NL, BS, 2 * HS)
    halves = [one_head[:, :, layer, :, :HS] for layer in range(NL)]  # K halves: no token run of rows
    _expect(
        DetectionError,
        BHLNC_READ + "kv_caches[0] (shape (6, 1, 16, 16), stride (1536, 1536, 32, 1)) does not hold a head's "
        "tokens as one run of rows",
        halves,
        bhlnc,
    )
    _expect(  # with several heads the hint names what is wrong first
        DetectionError,
        "layout hint kv_layout='BHLNC', but kv_caches[0] (shape (6, 4, 16, 16), stride (6144, 1536, 32, 1)) is "
        "not a BHLNC view",
        [v[..., :HS] for v in views],
        bhlnc,
    )
    row = BS * 2 * HS  # one head's page: blocks one layer's page apart overlap the next layers'
    crowded = [
        one_head.as_strided((NB, 1, BS, 2 * HS), (row, row, 2 * HS, 1), layer * row) for layer in range(NL)
    ]
    _expect(
        DetectionError,
        BHLNC_READ + "kv_caches[0] (shape (6, 1, 16, 32), stride (512, 512, 32, 1)) has blocks closer than "
        "the 3 layers' heads they hold",
        crowded,
        bhlnc,
    )
    _expect(
        DetectionError,
        "layout hint kv_layout='BHLNC', but kv_caches[0] (shape (6, 4, 16, 32), stride (2048, 512, 32, 1)) is "
        "not a BHLNC view",
        [torch.zeros(NB, NH, BS, 2 * HS) for _ in range(NL)],
        bhlnc,
    )
    with pytest.raises(
        DetectionError,
        match=re.escape("its entries cannot be left out of the layer groups (kv_caches[2] is in none)"),
    ):
        kvlayout.detect(views, "vllm", layer_groups=[[0, 1]])


def test_other_engines_refuse_the_hint_as_they_refuse_lhbnc() -> None:
    for engine in ("sglang", "trtllm", "atom", "max"):
        with pytest.raises(
            kvlayout.LayoutHintError,
            match=re.escape(
                f"layout hint kv_layout='BHLNC' puts layers inside heads, in an order no {engine} format has"
            ),
        ):
            kvlayout.detect([torch.zeros(NB, BS, NH, HS)], engine, {"kv_layout": "BHLNC"})


def test_a_bare_pool_named_by_its_format_needs_no_kv_layout() -> None:
    pool = torch.zeros(NB, NH, NL, BS, 2 * HS)
    reg = kvlayout.detect(pool, "vllm", {"layout_format": "NB_NH_NL_BS_CS"})
    assert reg.only_group().format is F.NB_NH_NL_BS_CS
    with pytest.raises(
        DetectionError,
        match=re.escape(
            "a bare [NB, H, NL, N, C] tensor is vLLM's BHLNC cross-layer tensor only under kv_layout='BHLNC'"
        ),
    ):
        kvlayout.detect(pool, "vllm", {"kv_layout": "HND"})
    with pytest.raises(
        DetectionError, match=re.escape("; under kv_layout='BHLNC' a bare tensor is [NB, H, NL, N, C]")
    ):
        kvlayout.detect(torch.zeros(NB, NL, 2, BS, NH, HS), "vllm", {"kv_layout": "BHLNC"})


def test_a_wrong_hint_on_several_bhlnc_groups_names_the_hint() -> None:
    engine, views = gemma_like(vx.KVCacheLayout.BHLNC, 15)
    with pytest.raises(
        kvlayout.LayoutHintError,
        match=re.escape("layout hint kv_layout='HND', but kv_caches are per-layer views"),
    ):
        apply_kv_cache_group_edits(engine.config, views, {"kv_layout": "HND"})


def test_a_hybrid_under_the_hint_reads_its_other_groups_as_usual() -> None:
    """The hint is the model's: a GDN hybrid's Mamba groups have no heads and layers to
    order and read as usual; its attention group is the cross-layer tensor."""
    engine = vx.hybrid_engine(vx.QWEN3_5_0_8B, vx.FLASH_ATTN, num_blocks=4, layout=vx.KVCacheLayout.BHLNC)
    _, views = vx.allocate_v033(engine)
    hints = {"kv_layout": "BHLNC"}
    edited = apply_kv_cache_group_edits(engine.config, views, hints)
    formats = {}
    for g in range(len(engine.config.kv_cache_groups)):
        layers, groups = transfer_layers(engine.config, edited, group=g)
        formats[g] = kvlayout.detect(layers, "vllm", hints, layer_groups=groups).only_group().format
    assert formats == {0: F.NL_X_NB_BS_HS, 1: F.NL_X_NB_BS_HS, 2: F.NL_X_NB_BS_HS, 3: F.NB_NH_NL_BS_CS}
    # each allocation under its own group's id (one allocation a group here), not group 0's
    config = engine.config
    for i, tensor in enumerate(config.kv_cache_tensors):
        g = next(g for g, group in enumerate(config.kv_cache_groups) if tensor.layers[0] in group.layer_names)
        layers, groups = transfer_layers(config, edited, allocation=i)
        by_group, its_groups = transfer_layers(config, edited, group=g)
        assert groups == its_groups == [[] for _ in range(g)] + [list(range(len(layers)))]
        assert [a is b for a, b in zip(layers, by_group, strict=True)] == [True] * len(layers)


def test_transfer_layers_of_one_group_leave_kv_sharers_out() -> None:
    engine, views = cache(vx.KVCacheLayout.BHLNC, 16)
    shared = vx.share_kv_caches(
        engine, views, {"model.layers.3.self_attn.attn": "model.layers.0.self_attn.attn"}
    )
    edited = apply_kv_cache_group_edits(engine.config, shared)
    layers, groups = transfer_layers(engine.config, edited, group=0)
    assert len(layers) == NL and groups == [list(range(NL))]
    assert kvlayout.detect(layers, "vllm", layer_groups=groups).only_group().format is F.NB_NH_NL_BS_CS
    with pytest.raises(
        ValueError, match=r"^group=-1 is not a KV cache group id: the config has 1 KV cache groups$"
    ):
        transfer_layers(engine.config, edited, group=-1)
    with pytest.raises(TypeError, match=r"^group must be an int \(a KV cache group id\), not bool$"):
        transfer_layers(engine.config, edited, group=True)


def test_the_format_named_by_layout_format_pools_one_head_views_too() -> None:
    _, views = cache(vx.KVCacheLayout.BHLNC, 17, num_kv_heads=1)
    reg = kvlayout.detect(list(views.values()), "vllm", {"layout_format": "NB_NH_NL_BS_CS"})
    assert reg.only_group().format is F.NB_NH_NL_BS_CS


def test_one_head_blocked_scale_pages_stay_the_indexer_under_the_hint() -> None:
    """The DSA indexer's one-head uint8 pages read per layer as the indexer cache, never as
    one head's K | V rows pooled across layers."""
    pool = torch.zeros(NB, 1, NL, BS, 132, dtype=torch.uint8)
    views = [pool[:, :, layer] for layer in range(NL)]
    assert kvlayout.detect(views, "vllm", {"kv_layout": "BHLNC"}).only_group().format is F.NL_X_NB_BSV_BSS


def uniform_type_group(layout: Any, seed: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """One group of two sliding windows (vLLM's UniformTypeKVCacheSpecs): one allocation
    per spec, side by side in each block, as vLLM's planner lays them out."""
    kw = {"block_size": BS, "num_kv_heads": NH, "head_size": HS, "dtype": torch.bfloat16}
    near = vx.kvi.SlidingWindowSpec(**kw, sliding_window=4 * BS)
    far = vx.kvi.SlidingWindowSpec(**kw, sliding_window=8 * BS)
    specs = {f"model.layers.{i}.self_attn.attn": near if i < 2 else far for i in range(4)}
    group = vx.kvi.KVCacheGroupSpec(
        layer_names=list(specs),
        kv_cache_spec=vx.kvi.UniformTypeKVCacheSpecs(block_size=BS, kv_cache_specs=specs),
    )
    page = near.page_size_bytes
    size = 4 * page * NB
    interleaved = 4 * page if layout.is_block_outermost else None  # get_kv_cache_config_from_groups
    tensors, offset = [], 0
    for names in (list(specs)[:2], list(specs)[2:]):
        layer_stride, block_stride, *_ = vx.kvi.compute_layout_strides(
            specs[names[0]], NB, 2, layout, fixed_strides=(None, interleaved, None, None, None)
        )
        tensors.append(
            vx.kvi.KVCacheTensor(
                size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride, offset=offset
            )
        )
        offset += 2 * (page if layout.is_block_outermost else layer_stride)
    config = vx.kvi.KVCacheConfig(num_blocks=NB, kv_cache_tensors=tensors, kv_cache_groups=[group])
    buf = torch.randint(-128, 128, (size,), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
    views: dict[str, torch.Tensor] = {}
    for tensor in tensors:
        made = vx.kvi.create_kv_cache_views(buf, specs[tensor.layers[0]], NB, layout, tensor)
        views.update((name, v.view(torch.int16)) for name, v in zip(tensor.layers, made, strict=True))
    return config, views


def test_a_group_of_several_allocations_is_one_registration_each() -> None:
    """``transfer_layers(..., allocation=i)``: each of vLLM's allocations under its group's
    id; the same split of an NHD peer maps to it layer for layer."""
    config, views = uniform_type_group(vx.KVCacheLayout.BHLNC, 18)
    peer_config, peer = uniform_type_group(vx.KVCacheLayout.LBNHC, 19)
    edited = apply_kv_cache_group_edits(config, views)
    peer_edited = apply_kv_cache_group_edits(peer_config, peer, {"kv_layout": "NHD"})
    layers, groups = transfer_layers(config, edited, group=0)
    with pytest.raises(DetectionError, match=re.escape("detect each allocation's layers on their own")):
        kvlayout.detect(layers, "vllm", layer_groups=groups)
    for i, tensor in enumerate(config.kv_cache_tensors):
        src_layers, src_groups = transfer_layers(config, edited, allocation=i)
        dst_layers, dst_groups = transfer_layers(peer_config, peer_edited, allocation=i)
        assert src_groups == dst_groups == [[0, 1]]
        src = kvlayout.detect(src_layers, "vllm", layer_groups=src_groups)
        dst = kvlayout.detect(dst_layers, "vllm", {"kv_layout": "NHD"}, layer_groups=dst_groups)
        assert src.only_group().format is F.NB_NH_NL_BS_CS and src.only_group().engine_group == 0
        block_map(src, dst, [5, 2], [1, 3], num_tokens=2 * BS).copy()
        for name in tensor.layers:
            assert torch.equal(peer[name][[1, 3]], views[name][[5, 2]])
    with pytest.raises(
        ValueError, match=r"^allocation=2 is not a KVCacheTensor id: the config has 2 KVCacheTensors$"
    ):
        transfer_layers(config, edited, allocation=2)
    with pytest.raises(ValueError, match=r"^pass group or allocation, not both \(group=0, allocation=0\)$"):
        transfer_layers(config, edited, group=0, allocation=0)
