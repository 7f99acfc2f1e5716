"""vLLM 0.33's ring buffers (``CircularBufferSpec``: DeepSeek-V4.1's compressor state):
one block a request, registered like attention ``[pages, 1, N, C]``, but written by
position ``p`` into row ``p % N`` and holding no K or V. They were read as one head of
fused ``K | V`` tokens: mapped into a plain attention cache of that shape without a word,
and a partly filled ring moved only its first rows."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch

import kvlayout
from kvlayout.integrations.vllm import (
    RingBufferPagesEdit,
    apply_kv_cache_group_edits,
    find_kv_cache_group_edit,
    find_kv_cache_groups_out_of_prefix_reuse,
)
from kvlayout.integrations.vllm import transfer_layers as vllm_transfer_layers
from kvlayout.testing.vllm import Backend, allocate_v033, fill_random, make_engine, uniform_engine
from kvlayout.transfer import BlockMapError, Shard, block_map

pytest.importorskip("vllm.v1.kv_cache_interface")
import vllm.v1.kv_cache_interface as kvi
from vllm.v1.kv_cache_layout import KVCacheLayout

# DeepseekCompressor(compress_ratio > 1).state_cache: CompressorStateCache(state_dim=2 * head_dim,
# dtype=float32), its capacity max(8, next power of two >= num_speculative_tokens + 2): 8
# without speculative decoding; CompressorBackend pages it whole (MultipleOf(1)).
HEAD_DIM, CAPACITY, NB, NL = 64, 8, 5, 2
COMPRESSOR = Backend("CompressorBackend", multiple_of=1)
LAYER = "model.layers.{}.self_attn.compressor.state_cache"


def ring_spec() -> Any:
    # CompressorStateCache.get_kv_cache_spec
    return kvi.CircularBufferSpec(
        block_size=CAPACITY, num_kv_heads=1, head_size=2 * HEAD_DIM, head_size_v=0, dtype=torch.float32
    )


def registered(spec: Any, seed: int, hints: dict[str, str], layout: Any = None) -> tuple[dict[str, Any], Any]:
    """A P/D worker's registration (vLLM's views), detected after the group edits."""
    engine = uniform_engine(spec, COMPRESSOR, num_layers=NL, num_blocks=NB, layer_name=LAYER, layout=layout)
    buf, kv = allocate_v033(engine)
    fill_random(buf, seed)
    edited = apply_kv_cache_group_edits(engine.config, kv, hints, prefix_reuse=False)
    layers, groups = vllm_transfer_layers(engine.config, edited)
    return kv, kvlayout.detect(layers, "vllm", hints, layer_groups=groups)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise (random bytes are NaNs as fp32 too)."""
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def ring_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """The ring as its writer addresses it: ``bind_kv_cache`` squeezes ``[B, 1, N, C]`` to
    ``[B, N, C]``, and ``CompressorMetadata.ring_write_slots`` is ``block * N + p % N``."""
    return kv_cache.squeeze(1).reshape(-1, kv_cache.shape[-1])


def write_positions(kv_cache: torch.Tensor, block: int, positions: range) -> None:
    """Position ``p`` of the request whose ring is ``block``: its row, a value of ``p``."""
    rows = ring_rows(kv_cache)
    for p in positions:
        rows[block * CAPACITY + p % CAPACITY] = float(p) + torch.arange(kv_cache.shape[-1]) / 1024


def test_the_ring_is_a_registration_vllm_makes() -> None:
    """The registered view the rule sees is vLLM's own: one head, the ring's capacity,
    an fp32 ``[kv_state | score_state]`` row; vLLM computes no slot mapping for it."""
    spec = ring_spec()
    assert spec.uses_slot_mapping is False and spec.prefix_cacheable is False
    assert kvi.get_kv_cache_spec_kind(spec) is kvi.KVCacheSpecKind.UNKNOWN
    engine = uniform_engine(spec, COMPRESSOR, num_layers=NL, num_blocks=NB, layer_name=LAYER)
    _, kv = allocate_v033(engine)
    for view in kv.values():
        assert (tuple(view.shape), view.dtype) == ((NB, 1, CAPACITY, 2 * HEAD_DIM), torch.float32)
        assert isinstance(find_kv_cache_group_edit(spec, view), RingBufferPagesEdit)
    plain = kvi.FullAttentionSpec(
        block_size=CAPACITY, num_kv_heads=1, head_size=HEAD_DIM, dtype=torch.float32
    )
    # the same view as plain attention (a GPU's: on the CPU, by default, CPU_ATTN's pages)
    assert find_kv_cache_group_edit(plain, next(iter(kv.values())), layout_hints={"kv_layout": "NHD"}) is None


@pytest.mark.parametrize(
    "hints", [{"kv_layout": "NHD"}, {"kv_layout": "HND"}, {}], ids=["NHD", "HND", "none"]
)
def test_a_request_s_ring_moves_whole_rows_by_its_position(hints: dict[str, str]) -> None:
    """P's ring of a 13-token request (positions 5..12 in rows p % 8) lands whole in D's
    block, every row where vLLM's writer reads it; D's other rings are untouched. A ring
    whose request has fewer tokens than rows (num_tokens 5) moves whole as well."""
    prefill_kv, prefill = registered(ring_spec(), 1, hints)
    decode_kv, decode = registered(ring_spec(), 2, hints)
    for group in prefill.kernel_groups:
        assert group.opaque_pages is not None and not group.opaque_pages.rows_are_tokens
        assert group.opaque_pages.layout.startswith("ring-buffer-pages")
    for view in prefill_kv.values():
        write_positions(view, 3, range(13))
    before = {name: view.clone() for name, view in decode_kv.items()}
    for src, dst in zip(prefill.kernel_groups, decode.kernel_groups, strict=True):
        block_map(src, dst, [3], [0]).copy()
    for name, view in decode_kv.items():
        rows, sent = ring_rows(view), ring_rows(prefill_kv[name])
        for p in range(13 - CAPACITY, 13):  # the ring's rows the next step reads
            assert same(rows[0 * CAPACITY + p % CAPACITY], sent[3 * CAPACITY + p % CAPACITY])
        assert same(view[1:], before[name][1:])
    # a partly filled ring: all of its rows move, not its first num_tokens
    for src, dst in zip(prefill.kernel_groups, decode.kernel_groups, strict=True):
        block_map(src, dst, [3], [4], num_tokens=5).copy()
    for name, view in decode_kv.items():
        assert same(view[4], prefill_kv[name][3])


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 4), (4, 2), (2, 2), (1, 8)])
def test_a_ring_moves_whole_between_ranks_of_any_tp_degrees(src_tp: int, dst_tp: int) -> None:
    """vLLM holds the ring whole on every rank (``CompressorStateCache``: one head at any
    TP degree, written from ``DeepseekCompressor``'s ``disable_tp=True`` linear), so a
    decode rank takes it from any prefill rank. It was refused between ranks of other
    indices ("maps only to the same rank's"), and so between TP degrees for most pairs."""
    hints = {"kv_layout": "NHD"}
    prefill_kv, prefill = registered(ring_spec(), 1, hints)
    for view in prefill_kv.values():
        write_positions(view, 3, range(11))
    for r in range(src_tp):
        for d in range(dst_tp):
            decode_kv, decode = registered(ring_spec(), 2 + d, hints)
            before = {name: view.clone() for name, view in decode_kv.items()}
            m = block_map(
                prefill.kernel_groups[0], decode.kernel_groups[0], [3], [1],
                src_shard=Shard(r, src_tp, 8), dst_shard=Shard(d, dst_tp, 8),
            )  # fmt: skip
            assert m.num_bytes == NL * CAPACITY * 2 * HEAD_DIM * 4  # each layer's ring whole
            m.copy()
            for name, view in decode_kv.items():
                rows, sent = ring_rows(view), ring_rows(prefill_kv[name])
                for p in range(11 - CAPACITY, 11):  # where the next step reads each position
                    assert same(rows[1 * CAPACITY + p % CAPACITY], sent[3 * CAPACITY + p % CAPACITY])
                assert same(view[0], before[name][0]) and same(view[2:], before[name][2:])


def test_a_ring_declared_by_its_shape_reads_as_its_spec_reads_it() -> None:
    """``declared_ring_pages`` (``kvlayout plan --src-ring``: no spec to read) makes of
    vLLM's registered view the pages the edit makes of it with its ``CircularBufferSpec``:
    the same layout and array, so one maps into the other byte for byte. A view that is
    no ring (two heads; bf16, where vLLM asserts float32) is refused, saying what a ring is."""
    from kvlayout.integrations.vllm.errors import KVCacheGroupEditError
    from kvlayout.integrations.vllm.rules import declared_ring_pages

    hints = {"kv_layout": "NHD"}
    prefill_kv, prefill = registered(ring_spec(), 1, hints)
    decode_kv, _ = registered(ring_spec(), 2, hints)
    declared = kvlayout.detect([declared_ring_pages(v, hints) for v in decode_kv.values()], "vllm", hints)
    assert declared.kernel_groups[0].opaque_pages == prefill.kernel_groups[0].opaque_pages
    for view in prefill_kv.values():
        write_positions(view, 2, range(9))
    block_map(prefill.kernel_groups[0], declared.kernel_groups[0], [2], [3]).copy()
    for name, view in decode_kv.items():
        assert same(view[3], prefill_kv[name][2])
    view = next(iter(decode_kv.values()))
    for bad in (view.expand(NB, 2, CAPACITY, 2 * HEAD_DIM), view.to(torch.bfloat16)):
        with pytest.raises(KVCacheGroupEditError, match=r"registers as \[NB,1,N,C\] float32"):
            declared_ring_pages(bad)


@pytest.mark.parametrize(
    ("kind", "shape", "dtype", "why"),
    [
        ("deepseek-v4.1", (NB, 1, 8, 2 * HEAD_DIM, 1), torch.float32, "a tensor of 5 dims, not 4"),
        ("deepseek-v4.1", (NB, 1, 12, 2 * HEAD_DIM), torch.float32, "axis 2 (N) is 12, not a power of two of 8"),
        ("deepseek-v4.1", (NB, 1, 4, 2 * HEAD_DIM), torch.float32, "axis 2 (N) is 4, not a power of two of 8"),
        ("step5-csa-tail", (NB, 1, 64, 48), torch.bfloat16, "N x C is 6144 bytes, not 7 or more rows of 1024"),
    ],
)  # fmt: skip
def test_a_declared_ring_of_a_capacity_its_producer_never_sizes_is_refused(
    kind: str, shape: tuple[int, ...], dtype: torch.dtype, why: str
) -> None:
    """DeepSeek-V4.1's ring holds a power of two of 8 or more rows (``CompressorStateCache``:
    ``max(8, ...)`` rounded up), Step5's at least 7 rows of 1 KiB (``Step5CSATailRing``: 7 +
    the speculative tokens); the least of each is a ring, and a geometry read without a spec
    is taken for DeepSeek-V4.1's ring only at its capacities."""
    from types import SimpleNamespace

    from kvlayout.integrations.vllm.errors import KVCacheGroupEditError
    from kvlayout.integrations.vllm.rules import declared_ring_pages, reads_as_ring

    with pytest.raises(KVCacheGroupEditError, match=re.escape(why)):
        declared_ring_pages(torch.zeros(shape, dtype=dtype), kind=kind)
    least = (NB, 1, 8, 2 * HEAD_DIM) if kind == "deepseek-v4.1" else (NB, 1, 64, 56)  # Step5: 7 KiB
    pages = declared_ring_pages(torch.zeros(least, dtype=dtype), kind=kind)
    assert (
        pages.shape[0] == NB
        and pages[0].numel() * pages.element_size() == least[2] * least[3] * dtype.itemsize
    )
    one_head = {"num_heads": 1, "dtype": torch.float32}
    assert reads_as_ring(SimpleNamespace(block_size=8, **one_head))
    assert not any(reads_as_ring(SimpleNamespace(block_size=n, **one_head)) for n in (4, 12))


def test_rings_of_two_capacities_are_refused_as_rings() -> None:
    """A decode ring of 16 rows (vLLM sizes it by the speculative tokens:
    ``CompressorStateCache.block_size``) keeps position ``p`` in row ``p % 16``, the
    prefill's of 8 in row ``p % 8``: whole pages would put them in the wrong rows, so
    the map is refused, at any ranks, with what a ring is."""
    hints = {"kv_layout": "NHD"}
    wide = kvi.CircularBufferSpec(
        block_size=2 * CAPACITY, num_kv_heads=1, head_size=2 * HEAD_DIM, head_size_v=0, dtype=torch.float32
    )
    _, src = registered(ring_spec(), 1, hints)
    _, dst = registered(wide, 2, hints)
    for src_shard, dst_shard in ((None, None), (Shard(0, 2, 2), Shard(1, 4, 4))):
        with pytest.raises(BlockMapError) as info:
            block_map(
                src.kernel_groups[0], dst.kernel_groups[0], [1], [1], src_shard=src_shard, dst_shard=dst_shard
            )
        assert f"blocks of {CAPACITY} and {2 * CAPACITY} rows" in str(info.value)
        assert f"position p in row p % its capacity (the block's {2 * CAPACITY} rows" in str(info.value)


def test_a_ring_maps_only_to_rings() -> None:
    """A plain one-head fp32 attention cache has the ring's very shape; read as its K | V
    halves, the ring's kv_state went into K and its score_state into V without a word."""
    hints = {"kv_layout": "NHD"}
    _, ring = registered(ring_spec(), 1, hints)
    plain = kvi.FullAttentionSpec(
        block_size=CAPACITY, num_kv_heads=1, head_size=HEAD_DIM, dtype=torch.float32
    )
    _, attention = registered(plain, 2, hints)
    with pytest.raises(BlockMapError, match=r"src is opaque pages \(ring-buffer-pages: .*\) and dst is not"):
        block_map(ring.kernel_groups[0], attention.kernel_groups[0], [1], [2])


def test_a_ring_in_heads_outside_blocks_moves_whole() -> None:
    """Under ``LHBNC`` (one head: the same bytes as LBHNC) the ring still moves whole."""
    hints = {"kv_layout": "LHBNC"}
    src_kv, src = registered(ring_spec(), 1, hints, KVCacheLayout.LHBNC)
    dst_kv, dst = registered(ring_spec(), 2, hints, KVCacheLayout.LHBNC)
    block_map(src.kernel_groups[0], dst.kernel_groups[0], [2], [1]).copy()
    for name, view in dst_kv.items():
        assert same(view[1], src_kv[name][2])


def test_a_prefix_reusing_tier_leaves_the_ring_out_as_vllm_does(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM keeps the ring out of prefix caching (``CircularBufferSpec.prefix_cacheable``
    False): its hash-addressed stores take only ``KVCacheConfig.prefix_cacheable_group_ids``
    (what the OffloadingConnector's ``get_offloading_group_ids`` returns). An offload tier
    (``prefix_reuse=True``) stored the ring by the prefix's block ids, though it holds the
    request's latest positions; now its group is left out, saying why, as vLLM leaves it.
    A P/D connector (``prefix_reuse=False``) still moves it."""
    hints = {"kv_layout": "NHD"}
    attention = kvi.FullAttentionSpec(
        block_size=CAPACITY, num_kv_heads=1, head_size=HEAD_DIM, dtype=torch.float32
    )
    attn = [f"model.layers.{i}.self_attn.attn" for i in range(NL)]
    rings = [LAYER.format(i) for i in range(NL)]
    specs = {**dict.fromkeys(attn, attention), **dict.fromkeys(rings, ring_spec())}
    engine = make_engine(specs, [attn, rings], lambda spec: spec.block_size, num_blocks=NB)
    _, kv = allocate_v033(engine)
    kept = engine.config.prefix_cacheable_group_ids  # vLLM's own answer
    assert kept == (0,)
    left_out = find_kv_cache_groups_out_of_prefix_reuse(engine.config)
    assert [p.group for p in left_out] == [g for g in range(2) if g not in kept]
    with caplog.at_level(logging.INFO, logger="kvlayout.integrations.vllm.edits"):
        edited = apply_kv_cache_group_edits(engine.config, kv, hints)
    assert sorted(edited) == attn and all(edited[n] is kv[n] for n in attn)
    assert (
        "KV cache group left out: group 1: CircularBufferSpec is not prefix-cacheable (vLLM stores only "
        "prefix_cacheable_group_ids by prefix hash): left out of a prefix-reusing tier; a P/D connector "
        f"passes prefix_reuse=False to move it (layers: {rings[0]}, {rings[1]})"
    ) in caplog.messages
    layers, groups = vllm_transfer_layers(engine.config, edited)
    assert groups == [[0, 1], []] and all(t is kv[n] for t, n in zip(layers, attn, strict=True))
    tier = kvlayout.detect(layers, "vllm", hints, layer_groups=groups)
    assert [g.engine_group for g in tier.kernel_groups] == [0]
    # P/D: the ring moves, whole pages
    edited = apply_kv_cache_group_edits(engine.config, kv, hints, prefix_reuse=False)
    layers, groups = vllm_transfer_layers(engine.config, edited)
    assert groups == [[0, 1], [2, 3]]
    pd = kvlayout.detect(layers, "vllm", hints, layer_groups=groups)
    ring = next(g for g in pd.kernel_groups if g.engine_group == 1)
    assert ring.opaque_pages is not None and ring.opaque_pages.layout.startswith("ring-buffer-pages")


def test_a_ring_mapped_by_its_tokens_is_told_to_map_it_by_its_block_ids() -> None:
    """A connector passes a request's num_tokens to every map it joins: 13 tokens are two
    rings' worth of rows, but a request owns one ring, whatever its tokens. The refusal
    gave only the block count; it now says to map a ring by its block ids."""
    hints = {"kv_layout": "NHD"}
    _, src = registered(ring_spec(), 1, hints)
    _, dst = registered(ring_spec(), 2, hints)
    with pytest.raises(BlockMapError) as info:
        block_map(src.kernel_groups[0], dst.kernel_groups[0], [3], [0], num_tokens=13)
    assert str(info.value) == (
        "src_blocks has 1 block ids; the request's 16 tokens (num_tokens=13 rounded up to whole opaque "
        f"pages) fill 2 blocks of {CAPACITY}: a block of state pages (ring-buffer-pages: float32 "
        f"[1, {CAPACITY}, {2 * HEAD_DIM}] in memory order [2, 3]) is a snapshot of the request's state at "
        "its last token, not tokens: map it by its block ids alone, without num_tokens. A ring (vLLM's "
        f"CircularBufferSpec) is one block a request, position p in row p % its capacity (the block's {CAPACITY} "
        "rows; Step5's CSA tail ring: its page's 1 KiB rows, the page its rank's attention page), whatever "
        "tokens the request holds: map a ring by its block ids, without num_tokens, and only to a ring alike "
        "(the same page, which every TP rank holds whole)"
    )
    # by its block ids alone it maps, into a peer's description too
    assert (
        block_map(src.kernel_groups[0], dst.describe().group(0), [3], [0]).num_bytes
        == NL * CAPACITY * 2 * HEAD_DIM * 4
    )


@pytest.mark.parametrize("bounded_replay", [True, False])
def test_a_bounded_replay_window_is_left_out_of_a_prefix_reusing_tier_as_vllm_leaves_it(
    bounded_replay: bool,
) -> None:
    """Not only the ring: vLLM 0.33 keeps DeepSeek-V4.1's sliding-window MLA cache out of
    prefix caching under ``--swa-bounded-replay`` (on by default:
    ``SlidingWindowMLASpec.prefix_cacheable`` is ``not bounded_replay``; vLLM recomputes
    the window after a hit). An offload tier leaves that group out exactly where vLLM's
    own ``prefix_cacheable_group_ids`` does, and keeps it without bounded replay."""
    mla = kvi.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    swa = kvi.SlidingWindowMLASpec(
        block_size=16, sliding_window=32, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
        bounded_replay=bounded_replay,
    )  # fmt: skip
    full, window = [f"model.layers.{i}.attn" for i in range(NL)], [f"model.layers.{i}.swa" for i in range(NL)]
    specs = {**dict.fromkeys(full, mla), **dict.fromkeys(window, swa)}
    engine = make_engine(specs, [full, window], lambda spec: spec.block_size, num_blocks=NB)
    _, kv = allocate_v033(engine)
    kept = engine.config.prefix_cacheable_group_ids  # vLLM's own answer
    assert kept == ((0,) if bounded_replay else (0, 1))
    left_out = find_kv_cache_groups_out_of_prefix_reuse(engine.config)
    assert [p.group for p in left_out] == [g for g in range(2) if g not in kept]
    assert all("SlidingWindowMLASpec is not prefix-cacheable" in p.what for p in left_out)
    edited = apply_kv_cache_group_edits(engine.config, kv)
    assert sorted(edited) == sorted(full + ([] if bounded_replay else window))
    _, groups = vllm_transfer_layers(engine.config, edited)
    assert groups is not None and [bool(g) for g in groups] == [g in kept for g in range(2)]


def test_a_ring_kind_vllm_does_not_have_is_refused_naming_the_kinds() -> None:
    from kvlayout.integrations.vllm.errors import KVCacheGroupEditError
    from kvlayout.integrations.vllm.rules import RING_KINDS, declared_ring_pages

    with pytest.raises(KVCacheGroupEditError) as refused:
        declared_ring_pages(torch.zeros(2, 1, 8, 4), kind="deepseek-v4")
    assert str(refused.value) == f"no vLLM 0.33 ring kind 'deepseek-v4': one of {', '.join(RING_KINDS)}"
