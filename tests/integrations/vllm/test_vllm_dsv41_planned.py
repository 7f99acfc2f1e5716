"""A DeepSeek-V4.1-like engine planned as vLLM 0.33 plans it (``planned_engine``), checked
against vLLM's own ``get_kv_cache_groups`` on the same specs, then run as a connector runs
it, every moved byte checked against vLLM's slot mapping of its group.

DeepSeek-V4.1's layers (``models/deepseek_v41``) register: the sliding window on every
layer (``DeepseekV4SWACache``: ``SlidingWindowMLASpec``); on a compressed layer the
compressed latents (``DeepseekV4MLAAttention``: ``MLAAttentionSpec``, ``tokens_per_state``
its ratio) and the compressor's state ring (``CompressorStateCache``:
``CircularBufferSpec``); on a C4 layer also the indexer's keys (``DeepseekV4IndexerCache``,
at the same ratio) and the indexer compressor's ring. The DeepSeek-V4 indexer backend
supports only block-outermost layouts (``DeepseekV4IndexerBackend.
supported_kv_cache_layouts``: BLHNC, BLNHC), so the pages of several sizes are packed
(``_get_packed_kv_cache_groups``); vLLM refuses to unify them under a layer-outermost
layout (the indexer's page divides no latent page), and so does the mirror."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import kvlayout
import kvlayout.testing.vllm as vx
from kvlayout.integrations.vllm import apply_kv_cache_group_edits, transfer_layers, validate_kv_cache_groups
from tests.integrations.vllm.models import stored_then_loaded

pytest.importorskip("vllm.v1.kv_cache_interface")
from tests.integrations.vllm.vllm_planning import vllm_kv_cache_config, vllm_kv_cache_groups

kvi = vx.kvi
NB, BLOCK = 5, 256
PACKED = [vx.KVCacheLayout.BLHNC, vx.KVCacheLayout.BLNHC]


def latents(ratio: int) -> Any:
    return vx.dsv4_latent_spec(BLOCK, ratio)


SWA = kvi.SlidingWindowMLASpec(
    block_size=64,
    num_kv_heads=1,
    max_tp_shards=1,
    head_size=512,
    dtype=torch.bfloat16,
    sliding_window=128,
    cache_dtype_str="auto",
    alignment=512,
    model_version="deepseek_v4",
)


def ring(state_dim: int) -> Any:
    return kvi.CircularBufferSpec(
        block_size=8, num_kv_heads=1, head_size=state_dim, head_size_v=0, dtype=torch.float32
    )


def dsv41_specs(ratios: list[int], rings: tuple[int, int, int] = (1024, 256, 512)) -> dict[str, Any]:
    """One layer a ratio (0: the window alone), its caches in registration order; ``rings``
    the state widths of a C4 layer's compressor, its indexer's compressor and a C128 layer's
    compressor."""
    specs: dict[str, Any] = {}
    for i, ratio in enumerate(ratios):
        attn = f"model.layers.{i}.self_attn"
        specs[f"{attn}.swa_cache"] = SWA
        if ratio:
            specs[f"{attn}.attn"] = latents(ratio)
            specs[f"{attn}.compressor.state_cache"] = ring(rings[0] if ratio == 4 else rings[2])
        if ratio == 4:
            specs[f"{attn}.indexer.k_cache"] = vx.dsv4_indexer_spec(BLOCK)
            specs[f"{attn}.indexer.compressor.state_cache"] = ring(rings[1])
    return specs


def first_window(specs: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """``specs`` with layer 0's window spec changed."""
    name = "model.layers.0.self_attn.swa_cache"
    return {**specs, name: dataclasses.replace(specs[name], **changes)}


MODELS = {
    "c4": dsv41_specs([4, 4, 4]),  # the docs' offload example: latents beside their indexer
    # DeepSeek-V4.1's pattern: two pure-window layers first, then C4 and C128 in turn
    "c4-c128": dsv41_specs([0, 0, 4, 128, 4, 128, 4, 128]),
    # 2 C4 and 3 C128 layers: buckets that repeat no pattern, rings of one width
    "uneven": dsv41_specs([4, 128, 128, 4, 128], rings=(1024, 1024, 1024)),
    # 4 windows beside 3 repeats of latents and indexer: _approximate_gcd's padding ties
    # at 3 and 4 repeats a group (2 layers each), where vLLM takes the larger
    "window-tie": dsv41_specs([0, 4, 4, 4]),
    # a window of another size, or not DCP-sharded, is a bucket of its own
    # (UniformTypeKVCacheSpecs.is_uniform_type: the spec class's rule, dcp_sharded)
    "two-windows": first_window(dsv41_specs([0, 4, 4, 4]), sliding_window=256),
    "unsharded-window": first_window(dsv41_specs([0, 4, 4, 4]), dcp_sharded=False),
}


def leaves(group: Any) -> dict[str, Any]:
    spec = group.kv_cache_spec
    return (
        dict(spec.kv_cache_specs)
        if isinstance(spec, kvi.UniformTypeKVCacheSpecs)
        else dict.fromkeys(group.layer_names, spec)
    )


@pytest.mark.parametrize("layout", PACKED, ids=lambda layout: layout.name)
@pytest.mark.parametrize("model", list(MODELS))
def test_the_groups_are_vllm_s_own(model: str, layout: Any) -> None:
    specs = MODELS[model]
    engine = vx.planned_engine(specs, vx.FLASHMLA, layout=layout, num_blocks=NB)
    want = vllm_kv_cache_groups(specs, layout)
    got = engine.config.kv_cache_groups
    assert [g.layer_names for g in got] == [g.layer_names for g in want]
    assert [leaves(g) for g in got] == [leaves(g) for g in want]
    assert [type(g.kv_cache_spec) for g in got] == [type(g.kv_cache_spec) for g in want]
    # and the tensors vLLM's get_kv_cache_config_from_groups makes of them
    assert engine.config.kv_cache_tensors == vllm_kv_cache_config(want, layout, NB).kv_cache_tensors
    validate_kv_cache_groups(engine.config)


def test_a_layer_outermost_layout_is_refused_as_vllm_refuses_it() -> None:
    specs = MODELS["c4"]
    with pytest.raises(NotImplementedError, match="page size is not divisible"):
        vllm_kv_cache_groups(specs, vx.KVCacheLayout.LBNHC)
    with pytest.raises(NotImplementedError, match="cannot unify"):
        vx.planned_engine(specs, vx.FLASHMLA, layout=vx.KVCacheLayout.LBNHC)


def slot_rows(view: torch.Tensor, blocks: list[int], rows: int, indexer: bool) -> torch.Tensor:
    """Rows ``[0, rows)`` where vLLM writes them, as bytes: ``bind_kv_cache``'s
    ``[NB, N, C]`` (``squeeze(1)``), row ``q`` at slot ``q % N`` of block ``blocks[q // N]``;
    an indexer's page is every slot's 128 fp8 values, then every slot's fp32 scale
    (``indexer_k_quant_and_cache``), so its row is the two joined."""
    pages = view.squeeze(1)
    n = pages.shape[1]
    out = []
    for q in range(rows):
        page, o = pages[blocks[q // n]].contiguous().view(torch.uint8).reshape(-1), q % n
        if indexer:
            out.append(
                torch.cat([page[o * 128 : (o + 1) * 128], page[n * 128 + 4 * o : n * 128 + 4 * o + 4]])
            )
        else:
            row = page.numel() // n
            out.append(page[o * row : (o + 1) * row])
    return torch.stack(out)


@pytest.mark.parametrize("layout", PACKED, ids=lambda layout: layout.name)
def test_a_connector_moves_each_group_s_rows_where_vllm_reads_them(layout: Any) -> None:
    specs = MODELS["c4-c128"]
    engine = vx.planned_engine(specs, vx.FLASHMLA, layout=layout, num_blocks=NB)
    buf, kv = vx.allocate_v033(engine)
    vx.fill_random(buf, 11)
    hints = {"kv_layout": layout.name}
    edited = apply_kv_cache_group_edits(engine.config, kv, hints)  # the rings left out
    layers, groups = transfer_layers(engine.config, edited)
    reg = kvlayout.detect(layers, "vllm", hints, layer_groups=groups)
    names = [name for name in kv if name in edited]
    assert not any(isinstance(engine.spec_of(n), kvi.CircularBufferSpec) for n in names)
    saved, loaded, tokens = [3, 1], [2, 4], 2 * 64 * 4  # two blocks of C4 slots
    moved = 0
    for group in reg.kernel_groups:
        spec = engine.spec_of(names[group.layers[0]])
        rows = min(tokens // int(spec.tokens_per_state), 2 * group.block_size)
        chunk = stored_then_loaded(group, saved, loaded, rows)
        indexer = kvlayout.is_indexer(group.format)
        for position, i in enumerate(group.layers):
            view = kv[names[i]]
            sent = slot_rows(view, saved, rows, indexer)
            assert torch.equal(
                chunk[0, position, :rows].contiguous().view(torch.uint8).reshape(rows, -1), sent
            )
            assert torch.equal(slot_rows(view, loaded, rows, indexer), sent)
            moved += 1
    assert moved == len(names)


def test_ring_buckets_vllm_cannot_split_are_refused_as_vllm_refuses_them() -> None:
    """Rings of uneven page sizes that one group of the block cannot hold: vLLM's
    ``_get_packed_kv_cache_groups`` zips them into whole repeats of its page sizes, so it
    leaves a layer out (which core's ``_check_exact_partition`` refuses) or a group empty
    (whose ``UniformTypeKVCacheSpecs`` fails on no specs); the mirror says so."""
    uneven = dsv41_specs([4, 128, 128, 4, 128])  # 2 C4 rings of each width, 3 C128 rings
    grouped = {
        name for group in vllm_kv_cache_groups(uneven, vx.KVCacheLayout.BLHNC) for name in group.layer_names
    }
    assert set(uneven) - grouped == {"model.layers.4.self_attn.compressor.state_cache"}
    empty = {
        "model.layers.0.self_attn.attn": kvi.MLAAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=512, dtype=torch.bfloat16
        ),
        **{f"model.layers.{i}.self_attn.compressor.state_cache": ring(1024) for i in range(3)},
        "model.layers.3.self_attn.indexer.compressor.state_cache": ring(256),
    }
    with pytest.raises(StopIteration):
        vllm_kv_cache_groups(empty, vx.KVCacheLayout.BLHNC)
    for specs, count in ((uneven, 2), (empty, 4)):
        with pytest.raises(
            ValueError, match=rf"^planned_engine: vLLM 0\.33 cannot pack .* into {count} groups"
        ):
            vx.planned_engine(specs, vx.FLASHMLA, layout=vx.KVCacheLayout.BLHNC)


def test_planned_engine_names_a_plan_of_no_layers_or_no_blocks() -> None:
    """No layers fell out of next() as StopIteration (which ends a caller's loop without a
    word); a count of blocks under 1, or not an int, became a config vLLM never makes (it
    refuses a cache of no blocks)."""
    with pytest.raises(ValueError, match=r"^planned_engine takes the spec of one layer at least, got none$"):
        vx.planned_engine({}, vx.FLASHMLA, layout=vx.KVCacheLayout.BLHNC)
    for num_blocks in (0, -1, 1.5):
        with pytest.raises(TypeError, match=rf"^num_blocks must be an int of at least 1, got {num_blocks}$"):
            vx.planned_engine(
                MODELS["c4"],
                vx.FLASHMLA,
                layout=vx.KVCacheLayout.BLHNC,
                num_blocks=num_blocks,  # type: ignore[arg-type]
            )


@pytest.mark.parametrize("spec", [vx.dsv4_latent_spec, vx.dsv4_indexer_spec])
def test_deepseek_v4_specs_name_a_block_size_or_ratio_that_is_no_count(spec: Any) -> None:
    """vLLM's spec took a ratio of 0 or -1 as one state a block (a latent page of 1,024
    bytes for 256 tokens), and a float ratio or block size into a float page, where the
    model takes max(1, its config's rate)."""
    for kw, message in (
        ({"compress_ratio": 0}, "compress_ratio must be an int of at least 1, got 0"),
        ({"compress_ratio": -1}, "compress_ratio must be an int of at least 1, got -1"),
        ({"compress_ratio": 1.5}, "compress_ratio must be an int of at least 1, got 1.5"),
    ):
        with pytest.raises(TypeError, match=f"^{message}$"):
            spec(BLOCK, **kw)
    for block_size in (0, -256, 2.0):
        with pytest.raises(TypeError, match=rf"^block_size must be an int of at least 1, got {block_size}$"):
            spec(block_size)


@pytest.mark.parametrize("layout", PACKED, ids=lambda layout: layout.name)
def test_a_p_d_connector_moves_the_packed_rings_whole(layout: Any) -> None:
    """A P/D connector (``prefix_reuse=False``) registers the rings too. vLLM packs them
    beside each other in its blocks (``_get_packed_kv_cache_groups``), so a ring's
    ``[NB, 1, 8, C]`` view is one page a block at the packed block's stride: it was refused
    ("kernel pages are 228864 bytes apart but 32768 bytes long"), though its block is that
    one page. Each ring moves whole, into the decode rank's block, from any prefill rank
    (vLLM computes it on every rank), each row where ``bind_kv_cache``'s ``[NB, N, C]``
    view has it."""
    from kvlayout.transfer import Shard, block_map

    specs = MODELS["c4-c128"]
    hints = {"kv_layout": layout.name}
    sides = []
    for seed in (5, 6):
        engine = vx.planned_engine(specs, vx.FLASHMLA, layout=layout, num_blocks=NB)
        buf, kv = vx.allocate_v033(engine)
        vx.fill_random(buf, seed)
        edited = apply_kv_cache_group_edits(engine.config, kv, hints, prefix_reuse=False)
        layers, groups = transfer_layers(engine.config, edited)
        names = [n for n in kv if n in edited]
        sides.append((kv, names, kvlayout.detect(layers, "vllm", hints, layer_groups=groups)))
    (src_kv, src_names, src), (dst_kv, dst_names, dst) = sides
    rings = [n for n in src_names if isinstance(specs[n], kvi.CircularBufferSpec)]
    assert len(rings) == 9  # 3 C4 layers' two rings, 3 C128 layers' one
    before = {n: dst_kv[n].clone() for n in rings}
    moved: list[str] = []
    for g, h in zip(src.kernel_groups, dst.kernel_groups, strict=True):
        if g.opaque_pages is None or not g.opaque_pages.layout.startswith("ring-buffer-pages"):
            continue
        block_map(g, h, [3], [1], src_shard=Shard(1, 2, 2), dst_shard=Shard(3, 4, 4)).copy()
        assert [src_names[i] for i in g.layers] == [dst_names[i] for i in h.layers]
        moved += [src_names[i] for i in g.layers]
    assert sorted(moved) == sorted(rings)
    for n in rings:
        sent, got, was = src_kv[n].squeeze(1), dst_kv[n].squeeze(1), before[n].squeeze(1)
        assert torch.equal(got[1].view(torch.int32), sent[3].view(torch.int32))
        for b in (0, 2, 3, 4):
            assert torch.equal(got[b].view(torch.int32), was[b].view(torch.int32))
