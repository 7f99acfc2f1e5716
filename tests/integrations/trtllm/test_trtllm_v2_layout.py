"""``KVCacheManagerV2``'s ``KvCacheLayout`` (``connectors/kv_cache_layout.py``): what a
connector's ``register_kv_cache_layout`` receives in place of one pool tensor. The fakes
below hold V2's contract verbatim: region bytes of page slot ``i`` at ``base + stride *
i`` for ``size`` bytes, ``as_tensor(dtype)`` a strided ``[num_slots, size // itemsize]``
view, buffers ``(layer_id, role, expansion)`` in memory order. Every byte moved is checked
against that addressing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

import kvlayout
from kvlayout import DetectionError, LayoutHintError
from kvlayout import EngineKVFormat as F
from kvlayout.integrations.trtllm import KvCacheLayoutError, kv_cache_layout_pools
from kvlayout.transfer import BlockMapError, RegistrationDescription, Shard, block_map


@dataclass(frozen=True)
class BufferRef:
    layer_id: int
    role: str
    expansion: int = 1


@dataclass(frozen=True)
class Region:
    storage: torch.Tensor  # the pool's bytes (uint8); ``base`` is an offset into it
    base: int
    size: int
    stride: int
    num_slots: int
    buffers: tuple[BufferRef, ...]

    def as_tensor(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return self.storage.view(dtype).as_strided(
            (self.num_slots, self.size // itemsize), (self.stride // itemsize, 1), self.base // itemsize
        )

    def bytes_of(self, slot: int, offset: int, size: int) -> torch.Tensor:
        start = self.base + self.stride * slot + offset
        return self.storage[start : start + size]


@dataclass(frozen=True)
class Group:
    layer_group_id: int
    layer_ids: tuple[int, ...]
    window_size: int | None
    regions: tuple[Region, ...]
    replicated_regions: tuple[Region, ...] = ()


@dataclass(frozen=True)
class Layout:
    tokens_per_block: int
    groups: tuple[Group, ...]


SLOTS, NH, BS, HD = 6, 2, 4, 8
BUF = NH * BS * HD * 2  # one layer's K (or V) of one slot, bf16


def kv_refs(layers: Sequence[int], roles: tuple[str, ...] = ("key", "value")) -> tuple[BufferRef, ...]:
    return tuple(BufferRef(layer, role) for layer in layers for role in roles)


def pool_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


HINTS = {"num_kv_heads": NH, "head_dim": HD}


def test_a_groups_kv_region_maps_to_a_v1_pool_byte_for_byte() -> None:
    """One slot: every layer's K then V, then a run of other bytes (NVFP4 block scales
    here) the region's stride steps over; the scales are their own opaque region."""
    nl, extra = 3, 64
    slot = nl * 2 * BUF + extra
    storage = pool_bytes(SLOTS * slot, 0)
    kv = Region(storage, 0, nl * 2 * BUF, slot, SLOTS, kv_refs(range(nl)))
    scales = Region(storage, nl * 2 * BUF, extra, slot, SLOTS, kv_refs(range(nl), ("key_block_scale",)))
    pools = kv_cache_layout_pools(
        Layout(BS, (Group(0, (0, 1, 2), None, (kv, scales)),)), torch.bfloat16, HINTS
    )
    assert set(pools) == {"group0", "group0.region1"}
    assert pools["group0"].kernel_groups[0].format is F.NB_NL_TWO_NH_BS_HS
    v1 = torch.zeros(4, nl, 2, NH * BS * HD, dtype=torch.bfloat16)
    dst = kvlayout.detect(v1, "trtllm", {**HINTS, "tokens_per_block": BS})
    block_map(pools["group0"], dst, [5, 2], [0, 3]).copy()
    for s, d in ((5, 0), (2, 3)):
        for layer in range(nl):
            for r in range(2):
                assert torch.equal(
                    v1[d, layer, r].view(torch.uint8), kv.bytes_of(s, (2 * layer + r) * BUF, BUF)
                )
    assert not v1[1].any() and not v1[2].any()


def test_an_nhd_group_maps_to_vllm_caches_by_tokens_and_heads() -> None:
    """``kv_layout="NHD"`` (FlashInfer / Vanilla attention): each buffer ``[BS, NH, HD]``;
    TP 1 into a TP 2 rank's vLLM caches moves its heads."""
    nl = 2
    storage = pool_bytes(SLOTS * nl * 2 * BUF, 1)
    kv = Region(storage, 0, nl * 2 * BUF, nl * 2 * BUF, SLOTS, kv_refs(range(nl)))
    pools = kv_cache_layout_pools(
        Layout(BS, (Group(0, (0, 1), None, (kv,)),)), torch.bfloat16, {**HINTS, "kv_layout": "NHD"}
    )
    caches = [torch.zeros(2, 5, BS, NH // 2, HD, dtype=torch.bfloat16) for _ in range(nl)]
    vllm = kvlayout.detect(caches, "vllm", {"kv_layout": "NHD"})
    block_map(pools["group0"], vllm, [4], [2], dst_shard=Shard(1, 2, NH)).copy()
    for layer in range(nl):
        for r in range(2):
            want = kv.bytes_of(4, (2 * layer + r) * BUF, BUF).view(torch.bfloat16).view(BS, NH, HD)[:, 1:]
            assert torch.equal(caches[layer][r, 2], want)


def test_an_mla_group_holds_keys_alone() -> None:
    nl, c = 2, 576
    buf = BS * c * 2
    storage = pool_bytes(SLOTS * nl * buf, 2)
    latents = Region(storage, 0, nl * buf, nl * buf, SLOTS, kv_refs(range(nl), ("key",)))
    pools = kv_cache_layout_pools(
        Layout(BS, (Group(0, (0, 1), None, (latents,)),)), torch.bfloat16, {"head_dim": c}
    )
    assert pools["group0"].kernel_groups[0].format is F.NB_NL_ONE_BS_HS
    mla = [torch.zeros(3, BS, c, dtype=torch.bfloat16) for _ in range(nl)]
    block_map(pools["group0"], kvlayout.detect(mla, "vllm"), [1], [2]).copy()
    for layer in range(nl):
        assert torch.equal(mla[layer][2].reshape(-1).view(torch.uint8), latents.bytes_of(1, layer * buf, buf))


def test_vswa_groups_are_a_pool_each_with_their_own_page_slots() -> None:
    """Full-attention layers 0 and 2 in one group, sliding-window layer 1 in another, in
    pools of their own slot counts: each maps with its group's page slots, its layers
    numbered as TRT-LLM numbers them. V1's pool of that window numbers its one layer 0:
    refused as it comes, it maps once numbered as layer 1 on purpose."""
    full = Region(pool_bytes(SLOTS * 2 * 2 * BUF, 3), 0, 2 * 2 * BUF, 2 * 2 * BUF, SLOTS, kv_refs([0, 2]))
    swa = Region(pool_bytes(3 * 2 * BUF, 4), 0, 2 * BUF, 2 * BUF, 3, kv_refs([1]))
    layout = Layout(BS, (Group(0, (0, 2), None, (full,)), Group(1, (1,), 128, (swa,))))
    pools = kv_cache_layout_pools(layout, torch.bfloat16, HINTS)
    assert [pools[g].kernel_groups[0].describe() for g in ("group0", "group1")] == [
        "layers 0,2: NB_NL_TWO_NH_BS_HS [6, 2, 2, 2, 4, 8] torch.bfloat16",
        "layers 1: NB_NL_TWO_NH_BS_HS [3, 1, 2, 2, 4, 8] torch.bfloat16",
    ]
    v1 = torch.zeros(2, 1, 2, NH * BS * HD, dtype=torch.bfloat16)
    window_pool = kvlayout.detect(v1, "trtllm", {**HINTS, "tokens_per_block": BS})
    with pytest.raises(
        BlockMapError,
        match=r"^src holds layers 1 and dst layers 0; a map moves layer i to layer i \(.*"
        r"number one side as the other: registration\.numbered\(layer_ids\)\)$",
    ):
        block_map(pools["group1"], window_pool, [2], [1])
    block_map(pools["group1"], window_pool.numbered([1]), [2], [1]).copy()
    assert torch.equal(v1[1].reshape(-1).view(torch.uint8), swa.bytes_of(2, 0, 2 * BUF))
    assert not v1[0].any()


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bytes, not values: random bytes hold NaNs, which never equal themselves."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _interleaved(seed: int | None) -> tuple[Layout, list[Region]]:
    """Full attention on layers 0 and 2, a sliding window on 1 and 3: two groups of one
    size and slot count, each its own pool (random bytes, or zeros without a seed)."""
    size = SLOTS * 4 * BUF
    regions = [
        Region(
            torch.zeros(size, dtype=torch.uint8) if seed is None else pool_bytes(size, seed + g),
            0, 4 * BUF, 4 * BUF, SLOTS, kv_refs(layers),
        )
        for g, layers in enumerate(([0, 2], [1, 3]))
    ]  # fmt: skip
    groups = (Group(0, (0, 2), None, (regions[0],)), Group(1, (1, 3), 128, (regions[1],)))
    return Layout(BS, groups), regions


def test_a_group_maps_only_to_a_cache_of_the_same_trtllm_layers() -> None:
    """The two groups look alike (shape, dtype, slots): a group paired with the peer's
    other group is refused naming both sides' layers, locally and through the peer's
    description, where it would have moved full-attention KV into the window's layers.
    The same group maps byte for byte, as does a vLLM registration of the model's
    layers grouped as TRT-LLM groups them."""
    (src_layout, src_regions), (dst_layout, dst_regions) = _interleaved(10), _interleaved(None)
    src = kv_cache_layout_pools(src_layout, torch.bfloat16, HINTS)
    dst = kv_cache_layout_pools(dst_layout, torch.bfloat16, HINTS)
    refusal = r"^src holds layers 0,2 and dst layers 1,3; a map moves layer i to layer i \("
    with pytest.raises(BlockMapError, match=refusal):
        block_map(src["group0"], dst["group1"], [1], [2])
    there = RegistrationDescription.from_json(dst["group1"].describe().to_json())
    assert there.groups[0].layers == (1, 3)
    with pytest.raises(BlockMapError, match=refusal):
        block_map(src["group0"], there, [1], [2])
    for g in (0, 1):
        block_map(src[f"group{g}"], dst[f"group{g}"], [1, 4], [2, 0]).copy()
        for slot in range(SLOTS):
            moved = {2: 1, 0: 4}.get(slot)
            want = (
                torch.zeros(4 * BUF, dtype=torch.uint8)
                if moved is None
                else src_regions[g].bytes_of(moved, 0, 4 * BUF)
            )
            assert torch.equal(dst_regions[g].bytes_of(slot, 0, 4 * BUF), want)
    # vLLM's per-layer [2, NB, BS, NH, HD] caches (NHD) of layers 0-3, in TRT-LLM's groups
    caches = [torch.zeros(2, 3, BS, NH, HD, dtype=torch.bfloat16) for _ in range(4)]
    vllm = kvlayout.detect(caches, "vllm", {"kv_layout": "NHD"}, layer_groups=[[0, 2], [1, 3]])
    full, window = vllm.kernel_groups
    with pytest.raises(BlockMapError, match=r"^src holds layers 1,3 and dst layers 0,2; "):
        block_map(src["group1"], full, [3], [1])
    block_map(src["group1"], window, [3], [1]).copy()
    for k, layer in enumerate((1, 3)):
        for r in range(2):
            held = src_regions[1].bytes_of(3, (2 * k + r) * BUF, BUF).view(torch.bfloat16).view(NH, BS, HD)
            assert _same_bytes(caches[layer][r, 1], held.transpose(0, 1))
    assert not any(caches[layer].any() for layer in (0, 2)) and not caches[1][:, (0, 2)].any()


def test_a_pipeline_stages_group_is_its_global_layers() -> None:
    """Under pipeline parallelism V2 numbers a stage's layers globally (``pp_layers``):
    stage 1 of a 4-layer model holds layers 2-3. Its group maps to the other engine's
    stage of the same layers: a vLLM stage's list numbered 2-3, not the list as it
    comes (0-1)."""
    region = Region(pool_bytes(SLOTS * 4 * BUF, 20), 0, 4 * BUF, 4 * BUF, SLOTS, kv_refs([2, 3]))
    pools = kv_cache_layout_pools(Layout(BS, (Group(0, (2, 3), None, (region,)),)), torch.bfloat16, HINTS)
    caches = [torch.zeros(2, 2, BS, NH, HD, dtype=torch.bfloat16) for _ in range(2)]
    stage = kvlayout.detect(caches, "vllm", {"kv_layout": "NHD"})
    with pytest.raises(BlockMapError, match=r"^src holds layers 2-3 and dst layers 0-1; "):
        block_map(pools["group0"], stage, [5], [1])
    block_map(pools["group0"], stage.numbered(range(2, 4)), [5], [1]).copy()
    for k in range(2):
        for r in range(2):
            held = region.bytes_of(5, (2 * k + r) * BUF, BUF).view(torch.bfloat16).view(NH, BS, HD)
            assert _same_bytes(caches[k][r, 1], held.transpose(0, 1))


def test_other_regions_move_whole_slots_to_regions_of_the_same_bytes() -> None:
    runs = kv_refs(range(2), ("index_key",))
    a = Region(pool_bytes(SLOTS * 96, 5), 0, 64, 96, SLOTS, runs)
    b = Region(torch.zeros(4 * 64, dtype=torch.uint8), 0, 64, 64, 4, runs)
    kv = Region(pool_bytes(SLOTS * 2 * BUF, 6), 0, 2 * BUF, 2 * BUF, SLOTS, kv_refs([0]))
    src = kv_cache_layout_pools(Layout(BS, (Group(0, (0,), None, (kv,), (a,)),)), torch.bfloat16, HINTS)
    dst = kv_cache_layout_pools(Layout(BS, (Group(0, (0,), None, (), (b,)),)), torch.bfloat16, HINTS)
    block_map(src["group0.replicated0"], dst["group0.replicated0"], [5, 1], [0, 3]).copy()
    assert torch.equal(b.bytes_of(0, 0, 64), a.bytes_of(5, 0, 64)) and torch.equal(
        b.bytes_of(3, 0, 64), a.bytes_of(1, 0, 64)
    )
    with pytest.raises(BlockMapError):  # opaque slots are no K/V pages
        block_map(src["group0.replicated0"], src["group0"], [0], [0])
    # the request's num_tokens, as its K/V map takes them: a slot is a page, not a token
    with pytest.raises(BlockMapError, match=r"fill 40 blocks of 1: a block of opaque pages .* whole page"):
        block_map(src["group0.replicated0"], dst["group0.replicated0"], [5, 1], [0, 3], num_tokens=40)


@pytest.mark.parametrize(("record", "fmt"), [(132, F.NB_NL_BSV_BSS), (68, F.NB_NL_BSV4_BSS4)])
def test_dsa_index_keys_read_as_the_indexer_pool_of_their_layers(record: int, fmt: F) -> None:
    """``DSACacheManagerV2`` (GLM-5.2: full-indexer layers 0, 1 and 5 of 6) keeps one
    ``index_key`` buffer of ``tokens_per_block`` records a full-indexer layer (fp8: 128
    values and a float32 scale a token; ``indexer_k_dtype="fp4"``: 64 and 4), coalesced in
    a slot: its replicated region reads as TRT-LLM's indexer K pool numbered with those
    layers, so a pipeline stage holding layer 5 (a V1 masked pool of one row) takes that
    layer's keys token by token. Index keys whose buffers are no indexer record (MiniMax-M3's)
    stay opaque slots; DSA's keys out of layer order are refused by name."""
    page, full, tail = BS * record, (0, 1, 5), 40
    slot = len(full) * page + tail
    storage = pool_bytes(SLOTS * slot, 30)
    keys = Region(storage, 0, len(full) * page, slot, SLOTS, kv_refs(full, ("index_key",)))
    pools = kv_cache_layout_pools(Layout(BS, (Group(0, tuple(range(6)), None, (), (keys,)),)), torch.bfloat16)
    index = pools["group0.replicated0"]
    assert index.kernel_groups[0].format is fmt and index.layer_ids == full
    stage = torch.zeros(4, 1, 1, page, dtype=torch.uint8)
    dst = kvlayout.detect(stage, "trtllm", {"tokens_per_block": BS}).numbered([5])
    block_map(index.for_layers([5]), dst, [5, 2], [3, 0], num_tokens=BS + 1).copy()
    values = record - 4
    for (s, d), tokens in zip(((5, 3), (2, 0)), (BS, 1), strict=True):
        held = keys.bytes_of(s, 2 * page, page)
        for t in range(tokens):
            assert torch.equal(
                stage[d, 0, 0, t * values : (t + 1) * values], held[t * values : (t + 1) * values]
            )
            at = BS * values + t * 4
            assert torch.equal(stage[d, 0, 0, at : at + 4], held[at : at + 4])
    assert not stage[0, 0, 0, values : BS * values].any() and not stage[1:3].any()
    with pytest.raises(KvCacheLayoutError, match=r"holds the index keys of layers \[1, 0, 5\]: .* ascending"):
        shuffled = Region(storage, 0, len(full) * page, slot, SLOTS, kv_refs((1, 0, 5), ("index_key",)))
        kv_cache_layout_pools(Layout(BS, (Group(0, tuple(range(6)), None, (), (shuffled,)),)), torch.bfloat16)


@pytest.mark.parametrize(
    ("role", "expansion", "tail"),
    [("key_block_scale", 1, 0), ("index_key", 2, 0), ("index_key", 1, 1)],
    ids=["another-role", "expanded", "bytes-past-the-buffers"],
)
def test_regions_of_indexer_record_width_but_no_dsa_index_keys_stay_opaque(
    role: str, expansion: int, tail: int
) -> None:
    """Only a region of ``index_key`` buffers at one tokens_per_block (expansion 1), each
    ``BS * record`` bytes, reads as the indexer pool: buffers of another role, expanded
    ones, or a region with bytes past its buffers, of that width, stay opaque whole slots
    (and never fail to be read)."""
    page, layers = BS * 132, (0, 1)
    size = len(layers) * page + tail
    refs = tuple(BufferRef(layer, role, expansion) for layer in layers)
    region = Region(pool_bytes(SLOTS * size, 31), 0, size, size, SLOTS, refs)
    pools = kv_cache_layout_pools(Layout(BS, (Group(0, layers, None, (), (region,)),)), torch.bfloat16)
    group = pools["group0.replicated0"].kernel_groups[0]
    assert group.opaque_pages is not None and group.opaque_pages.layout.endswith(f"({size} bytes)")


def test_mamba_state_regions_read_whole_and_point_to_the_state_reader_across_tp() -> None:
    """V2MambaHybridCacheManager's MambaRole buffers are regions of the layout: read as
    whole slots, they map at one TP degree, and a map between TP degrees says which
    reader splits them."""
    runs = kv_refs([1], ("ssm_state", "conv_state"))
    tp1 = Region(pool_bytes(SLOTS * 96, 7), 0, 96, 96, SLOTS, runs)
    twin = Region(torch.zeros(SLOTS * 96, dtype=torch.uint8), 0, 96, 96, SLOTS, runs)
    tp2 = Region(torch.zeros(SLOTS * 48, dtype=torch.uint8), 0, 48, 48, SLOTS, runs)
    a, b, c = (
        kv_cache_layout_pools(Layout(BS, (Group(1, (1,), None, (r,)),)), torch.bfloat16, HINTS)[
            "group1.region0"
        ]
        for r in (tp1, twin, tp2)
    )
    block_map(a, b, [4], [0]).copy()
    assert torch.equal(twin.bytes_of(0, 0, 96), tp1.bytes_of(4, 0, 96))
    with pytest.raises(BlockMapError, match=r"laid out differently.*mamba_state_pools\(manager\)") as info:
        block_map(a, c, [4], [0], src_shard=Shard(0, 1, 8), dst_shard=Shard(1, 2, 8))
    assert str(info.value).count("mamba_state_pools") == 1  # both sides' advice, said once


def test_the_pool_detector_refuses_a_region_tensor() -> None:
    """Before this reader a connector had only ``region.as_tensor()``, refused by rank."""
    region = Region(pool_bytes(SLOTS * 2 * BUF, 7), 0, 2 * BUF, 2 * BUF, SLOTS, kv_refs([0]))
    with pytest.raises(DetectionError, match="tensor rank 2"):
        kvlayout.detect(region.as_tensor(), "trtllm", {**HINTS, "tokens_per_block": BS})


def test_layouts_kvlayout_cannot_read_are_refused_by_name() -> None:
    storage = pool_bytes(SLOTS * 4 * BUF, 8)

    def one(buffers: tuple[BufferRef, ...], hints: Mapping[str, object] = HINTS) -> None:
        region = Region(storage, 0, 4 * BUF, 4 * BUF, SLOTS, buffers)
        kv_cache_layout_pools(Layout(BS, (Group(0, (0, 1), None, (region,)),)), torch.bfloat16, hints)

    with pytest.raises(KvCacheLayoutError, match="holds 0:key, 1:key, 0:value, 1:value: a region of K/V"):
        one((BufferRef(0, "key"), BufferRef(1, "key"), BufferRef(0, "value"), BufferRef(1, "value")))
    with pytest.raises(
        KvCacheLayoutError, match=r"holds 1:key, 1:value, 0:key, 0:value: .* layers ascending"
    ):
        one(kv_refs([1, 0]))
    with pytest.raises(KvCacheLayoutError, match=r"0:key x2"):
        one((BufferRef(0, "key", 2), BufferRef(0, "value"), BufferRef(1, "key"), BufferRef(1, "value")))
    with pytest.raises(KvCacheLayoutError, match="tokens_per_block=8 contradicts the layout's 4"):
        one(kv_refs(range(2)), {**HINTS, "tokens_per_block": 8})
    with pytest.raises(LayoutHintError, match=r"flat dim 64 != num_kv_heads \(3\)"):
        one(kv_refs(range(2)), {"num_kv_heads": 3, "head_dim": HD})
    with pytest.raises(KvCacheLayoutError, match="is not a KvCacheLayout"):
        kv_cache_layout_pools(object(), torch.bfloat16, HINTS)
    with pytest.raises(KvCacheLayoutError, match="in 2 regions that are not runs of one slot"):
        halves = [
            Region(storage, i * 2 * BUF, 2 * BUF, (4 - 2 * i) * BUF, SLOTS, kv_refs([i])) for i in range(2)
        ]
        kv_cache_layout_pools(Layout(BS, (Group(0, (0, 1), None, tuple(halves)),)), torch.bfloat16, HINTS)


def test_v2s_per_layer_get_buffers_views_are_refused_with_the_layout_reader_named() -> None:
    """``KVCacheManagerV2.get_buffers(layer)``: ``[page_upper // 2, 2, BS, NH, HD]`` from
    the layer's first buffer, so coalesced layers overlap and a page slot indexes none."""
    nl = 3
    pages = torch.randn(SLOTS * nl * 2, NH * BS * HD)
    views = [
        pages[2 * layer :].view(-1, 2, BS, NH, HD)[: (SLOTS * nl * 2 - 2 * layer) // 2] for layer in range(nl)
    ]
    with pytest.raises(DetectionError, match=r"KvCacheLayout: read it with kvlayout\.integrations\.trtllm"):
        kvlayout.detect(views, "trtllm", {"kv_layout": "NHD"})
    with pytest.raises(DetectionError, match=r"KvCacheLayout: read it with kvlayout\.integrations\.trtllm"):
        kvlayout.detect(views[0], "trtllm", {"kv_layout": "NHD"})
    with pytest.raises(DetectionError, match="overlap in memory"):
        kvlayout.detect(views, "vllm", {"kv_layout": "NHD"})


@dataclass(frozen=True)
class Misviewed(Region):
    """A region whose ``as_tensor`` is not what its fields say (``view`` re-views the rows)."""

    view: str = "strided"

    def as_tensor(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        rows = self.storage[: self.num_slots * 2 * self.size].view(self.num_slots, 2 * self.size)
        return rows[:, : self.size] if self.view == "strided" else rows[:, ::2]


def test_regions_and_arguments_that_are_not_v2s_are_refused_by_name() -> None:
    storage = pool_bytes(SLOTS * 8 * BUF + 1, 9)

    def pools(region: object, bs: int = BS, dtype: object = torch.bfloat16) -> None:
        kv_cache_layout_pools(Layout(bs, (Group(0, (0, 1), None, (region,)),)), dtype, HINTS)  # type: ignore[arg-type]

    good = Region(storage, 0, 4 * BUF, 4 * BUF, SLOTS, kv_refs(range(2)))
    with pytest.raises(KvCacheLayoutError, match=r"steps 1024 bytes a slot where the region says stride 512"):
        pools(Misviewed(storage, 0, 4 * BUF, 4 * BUF, SLOTS, kv_refs(range(2))))
    with pytest.raises(KvCacheLayoutError, match=r"as_tensor\(\) is \[6, 512\] \(strides \[1024, 2\]\), not"):
        pools(Misviewed(storage, 0, 4 * BUF, 4 * BUF, SLOTS, kv_refs(range(2)), "every other byte"))
    with pytest.raises(KvCacheLayoutError, match=r"stride 513 bytes do not hold 2 layers x 2 buffers"):
        pools(Region(storage, 0, 4 * BUF, 4 * BUF + 1, SLOTS, kv_refs(range(2))))
    with pytest.raises(KvCacheLayoutError, match="tokens_per_block 0"):
        pools(good, bs=0)
    with pytest.raises(KvCacheLayoutError, match=r"dtype must be a torch.dtype .* not 'bfloat16'"):
        pools(good, dtype="bfloat16")
    with pytest.raises(
        KvCacheLayoutError, match=r"region 0 is SimpleNamespace \(num_slots None.* not a KvCacheRegion"
    ):
        pools(SimpleNamespace(buffers=kv_refs(range(2))))


def _m3_layout(seed: int | None) -> tuple[Layout, dict[tuple[int, str], int], torch.Tensor]:
    """``MiniMaxM3KVCacheManagerV2`` (``sparse/minimax_m3/cache_manager.py``): layer 0
    dense, layers 1-3 sparse with an ``index_key`` buffer (``Role.INDEX_KEY``, one head of
    ``sparse_index_dim``) after their K and V. Where ``sparse_index_dim`` is ``NH * HD``
    (here 2 * 8) the index key is K's size, so V2's ``create_storage_config`` coalesces it
    with K/V: one pool, a slot the buffers in layer order, each at ``index * BUF``
    (``buffer_attributes``). ``build_kv_cache_layout_v2`` aggregates the sharded (K/V)
    and replicated (``index_key``) buffers apart: three K/V runs, three index-key runs."""
    order = [(0, "key"), (0, "value")] + [
        (layer, r) for layer in (1, 2, 3) for r in ("key", "value", "index_key")
    ]
    slot = len(order) * BUF
    storage = (
        pool_bytes(SLOTS * slot, seed) if seed is not None else torch.zeros(SLOTS * slot, dtype=torch.uint8)
    )
    offset = {ref: i * BUF for i, ref in enumerate(order)}

    def run(refs: list[tuple[int, str]]) -> Region:
        return Region(
            storage, offset[refs[0]], len(refs) * BUF, slot, SLOTS, tuple(BufferRef(*r) for r in refs)
        )

    kv = (run(order[:4]), run(order[5:7]), run(order[8:10]))
    index = tuple(run([(layer, "index_key")]) for layer in (1, 2, 3))
    return Layout(BS, (Group(0, (0, 1, 2, 3), None, kv, index),)), offset, storage


def _m3_kv(
    storage: torch.Tensor,
    offset: dict[tuple[int, str], int],
    slot: int,
    layer: int,
    role: str,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Layer ``layer``'s K or V page of slot ``slot`` as M3's ``get_buffers(kv_layout="NHD")``
    views it: ``[BS, NH, HD // elements a byte]`` of ``dtype`` at ``base + stride * slot +
    offset``."""
    start = slot * (storage.numel() // SLOTS) + offset[(layer, role)]
    return storage[start : start + BUF].view(dtype).view(BS, NH, -1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_minimax_m3_kv_split_by_coalesced_index_keys_reads_as_its_layers(dtype: torch.dtype) -> None:
    """MiniMax-M3's K/V in three runs of one slot (index keys of K's size between them) was
    refused ("K/V buffers in 3 regions"); it reads as the group's four layers, each token's
    heads where M3's NHD view puts them, into vLLM's caches (a TP 2 rank's heads) and into
    a peer's M3 slots, the index keys moving as replicated slots of their own. NVFP4 K/V
    (int8, two values a byte, as M3's ``get_buffers`` views it) reads by its bytes a head:
    the index key (bf16) is then K's size where ``num_kv_heads * head_dim / 2`` is twice
    ``sparse_index_dim``."""
    width = HD * 2 // torch.empty(0, dtype=dtype).element_size()  # elements a head and token
    hints = {"num_kv_heads": NH, "head_dim": width, "kv_layout": "NHD"}
    layout, offset, storage = _m3_layout(11)
    pools = kv_cache_layout_pools(layout, dtype, hints)
    assert set(pools) == {"group0", "group0.replicated0", "group0.replicated1", "group0.replicated2"}
    src = pools["group0"]
    assert src.engine is kvlayout.EngineType.TRTLLM and src.layer_ids == (0, 1, 2, 3)
    caches = [torch.zeros(2, 5, BS, NH // 2, width, dtype=dtype) for _ in range(4)]
    vllm = kvlayout.detect(caches, "vllm", {"kv_layout": "NHD"})
    block_map(src, vllm, [4, 1], [2, 0], dst_shard=Shard(1, 2, NH)).copy()
    for layer in range(4):
        for r, role in enumerate(("key", "value")):
            for s, d in ((4, 2), (1, 0)):
                for t in range(BS):
                    assert torch.equal(
                        caches[layer][r, d, t, 0], _m3_kv(storage, offset, s, layer, role, dtype)[t, 1]
                    )
            assert not caches[layer][r, 1].any() and not caches[layer][r, 3:].any()
    peer_layout, _, peer = _m3_layout(None)
    dst = kv_cache_layout_pools(peer_layout, dtype, hints)
    block_map(src, dst["group0"], [4, 1], [0, 3]).copy()
    for k in range(3):
        block_map(pools[f"group0.replicated{k}"], dst[f"group0.replicated{k}"], [4, 1], [0, 3]).copy()
    slot = storage.numel() // SLOTS
    for s, d in ((4, 0), (1, 3)):
        assert torch.equal(peer[d * slot : (d + 1) * slot], storage[s * slot : (s + 1) * slot])
    assert not peer[slot : 3 * slot].any() and not peer[4 * slot :].any()
    with pytest.raises(BlockMapError):  # an index key is no K/V page
        block_map(pools["group0.replicated0"], dst["group0"], [0], [0])


def test_m3_runs_are_checked_as_one_slots() -> None:
    layout, _, storage = _m3_layout(12)
    kv = layout.groups[0].regions

    def read(*runs: Region, hints: Mapping[str, object] = {**HINTS, "kv_layout": "NHD"}) -> None:
        group = Group(0, (0, 1, 2, 3), None, runs)
        kv_cache_layout_pools(Layout(BS, (group,)), torch.bfloat16, hints)

    other = Region(storage, kv[1].base, kv[1].size, kv[1].stride - BUF, SLOTS, kv[1].buffers)
    with pytest.raises(
        KvCacheLayoutError,
        match=r"in 3 regions that are not runs of one slot \(.*region 1: base 640, size 256, stride 1280",
    ):
        read(kv[0], other, kv[2])
    overlapping = Region(storage, kv[1].base - 2 * BUF, kv[1].size, kv[1].stride, SLOTS, kv[1].buffers)
    with pytest.raises(KvCacheLayoutError, match="not runs of one slot"):
        read(kv[0], overlapping, kv[2])
    with pytest.raises(KvCacheLayoutError, match=r"K/V regions holds 0:key, 0:value, 1:key, 1:value, 3:key"):
        swapped = [
            Region(storage, r.base, r.size, r.stride, SLOTS, o.buffers)
            for r, o in ((kv[1], kv[2]), (kv[2], kv[1]))
        ]
        read(kv[0], *swapped)
    with pytest.raises(LayoutHintError, match=r"flat dim 64 != num_kv_heads \(3\)"):
        read(*kv, hints={"num_kv_heads": 3, "head_dim": HD})
    # an MLA group's keys in runs: each layer's latents, read as vLLM's MLA caches hold them
    keys = tuple(
        Region(storage, r.base, r.size // 2, r.stride, SLOTS, tuple(b for b in r.buffers if b.role == "key"))
        for r in kv
    )
    mla = kv_cache_layout_pools(
        Layout(BS, (Group(0, (0, 1, 2, 3), None, keys),)), torch.bfloat16, {"head_dim": NH * HD}
    )
    caches = [torch.zeros(3, BS, NH * HD, dtype=torch.bfloat16) for _ in range(4)]
    block_map(mla["group0"], kvlayout.detect(caches, "vllm"), [5], [1]).copy()
    where = [(run, j) for run in keys for j in range(len(run.buffers))]  # layers 0-3 in memory order
    for layer, (run, j) in enumerate(where):
        assert torch.equal(caches[layer][1].reshape(-1).view(torch.uint8), run.bytes_of(5, j * BUF, BUF))
        assert not caches[layer][0].any() and not caches[layer][2].any()


def test_rocketkv_kt_buffers_between_layers_leave_the_kv_read_by_heads_and_tokens() -> None:
    """``RocketKVCacheManagerV2`` (``sparse/rocket.py``) appends a ``kt_cache`` buffer to
    every layer, ``tokens_per_block_override`` expanding it (``create_storage_config``:
    ``size * expansion``); where that is K's size (bf16 K/V, ``tokens_per_block`` 32,
    ``page_size`` 3: 16 KT tokens of ``2 * head_dim``) V2 coalesces it with K and V, and
    ``build_kv_cache_layout_v2`` (KT not replicated) hands one region of every layer's K,
    V, KT. That was read as opaque slots alone; its K/V now read by heads and tokens, as
    V1's pool of the same layers holds them, the KT runs as opaque slots of their own."""
    order = [(layer, r) for layer in range(3) for r in ("key", "value", "kt_cache")]
    slot = len(order) * BUF
    refs = tuple(BufferRef(layer, r, 16 if r == "kt_cache" else 1) for layer, r in order)
    storage, peer = pool_bytes(SLOTS * slot, 13), torch.zeros(SLOTS * slot, dtype=torch.uint8)
    src, dst = (
        kv_cache_layout_pools(
            Layout(BS, (Group(0, (0, 1, 2), None, (Region(t, 0, slot, slot, SLOTS, refs),)),)),
            torch.bfloat16,
            HINTS,
        )
        for t in (storage, peer)
    )
    assert set(src) == {"group0", "group0.region0.run1", "group0.region0.run3", "group0.region0.run5"}
    region = Region(storage, 0, slot, slot, SLOTS, refs)
    v1 = torch.zeros(4, 3, 2, NH * BS * HD, dtype=torch.bfloat16)
    block_map(
        src["group0"], kvlayout.detect(v1, "trtllm", {**HINTS, "tokens_per_block": BS}), [5, 2], [0, 3]
    ).copy()
    for s, d in ((5, 0), (2, 3)):
        for layer in range(3):
            for r in range(2):
                assert torch.equal(
                    v1[d, layer, r].view(torch.uint8), region.bytes_of(s, (3 * layer + r) * BUF, BUF)
                )
    assert not v1[1].any() and not v1[2].any()
    for name in src:
        block_map(src[name], dst[name], [5, 2], [0, 3]).copy()
    for s, d in ((5, 0), (2, 3)):
        assert torch.equal(peer[d * slot : (d + 1) * slot], storage[s * slot : (s + 1) * slot])
    assert not peer[slot : 3 * slot].any() and not peer[4 * slot :].any()
    with pytest.raises(BlockMapError):  # KT runs are no K/V pages
        block_map(src["group0.region0.run1"], dst["group0"], [0], [0])
    odd = Region(storage, 0, slot - 2, slot, SLOTS, refs)
    with pytest.raises(
        KvCacheLayoutError, match=r"region 0: 1150 bytes are not 9 buffers of one size, as V2 coalesces"
    ):
        kv_cache_layout_pools(Layout(BS, (Group(0, (0, 1, 2), None, (odd,)),)), torch.bfloat16, HINTS)
