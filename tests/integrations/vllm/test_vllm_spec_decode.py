"""A target model and its speculative drafter (EAGLE-3, MTP, a draft model) as vLLM 0.33
plans them when their specs differ (``get_kv_cache_groups``): another head count, head
size or dtype is one ``UniformTypeKVCacheSpecs`` group of several allocations (MLA and
full attention are one kind), a sliding-window drafter a group of its own (its page
unified by a larger block), and a drafter sharing a target layer's KV (Gemma-4 MTP)
joins that layer's group. Each is run as a connector runs it (validation, edits, transfer
layers, detection with the groups) and every byte a block map or a CPU chunk moves is
checked against vLLM's own slot mapping of each group into the registered views."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvlayout.testing.vllm as vx
from kvlayout.integrations.vllm import validate_kv_cache_groups
from kvlayout.transfer import Shard, block_map, prepare

kvi = vx.kvi
LLAMA = vx.LLAMA_3_2_1B  # 16 layers, 8 KV heads of 64
# vLLM 0.33 refuses the layer-compact-only and head-outer layouts (LHBNC, BHLNC) for mixed
# page sizes (validate_kv_cache_layout), so these four are every layout a drafter can meet.
LAYOUTS = [vx.KVCacheLayout.LBNHC, vx.KVCacheLayout.LBHNC, vx.KVCacheLayout.BLNHC, vx.KVCacheLayout.BLHNC]
EAGLE3 = "model.layers.16.self_attn.attn"  # llama_eagle3: layers numbered after the target's


def _full(
    heads: int, head: int = 64, dtype: torch.dtype = torch.bfloat16, block: int = 16, *, draft: bool = True
) -> Any:
    """A drafter's spec unless ``draft=False`` (gpu_model_runner marks a draft layer's
    ``is_draft``, which grouping ignores)."""
    return kvi.FullAttentionSpec(
        block_size=block, num_kv_heads=heads, head_size=head, dtype=dtype, is_draft=draft
    )


def _llama(tp: int = 1) -> dict[str, Any]:
    spec = vx.attention_spec(LLAMA, tp, 16)
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(LLAMA.num_hidden_layers)}


class Side:
    """One worker: the engine, its registration as vLLM makes it, and what detection read."""

    def __init__(
        self,
        specs: dict[str, Any],
        layout: Any,
        seed: int,
        *,
        backend: vx.Backend = vx.FLASH_ATTN,
        shared: dict[str, str] | None = None,
    ) -> None:
        self.engine = vx.planned_engine(specs, backend, layout=layout)
        self.buf, kv = vx.allocate_v033(self.engine)
        vx.fill_random(self.buf, seed)
        self.kv = vx.share_kv_caches(self.engine, kv, shared) if shared else kv
        hints = {"kv_layout": layout.name}
        validate_kv_cache_groups(self.engine.config)
        self.names = list(self.kv)
        self.reg = vx.detect_registered(self.engine, self.kv, hints, edited=True)

    def block_size(self, name: str) -> int:
        return int(self.engine.spec_of(name).block_size)

    def rows(self, name: str, blocks: list[int], num_tokens: int, heads: slice = slice(None)) -> torch.Tensor:
        """Tokens ``[0, num_tokens)`` of ``name`` through vLLM's slot mapping of its group
        (``slot = blocks[p // BS] * BS + p % BS``), read from the registered ``[B, H, N, C]``
        view at the group's kernel block size, as bytes."""
        kernel = self.engine.kernel_block_sizes[self.engine.group_of(name)]
        bs = self.block_size(name)
        view = self.kv[name]
        slots = [blocks[p // bs] * bs + p % bs for p in range(num_tokens)]
        return torch.stack([view[s // kernel, heads, s % kernel].clone().view(torch.uint8) for s in slots])

    def layer_names(self, group: Any) -> list[str]:
        return [self.names[i] for i in group.layers]


def _heads(side: Side, name: str) -> int:
    return int(side.engine.spec_of(name).num_kv_heads)


def _check_maps(src: Side, dst: Side, *, tp: tuple[int, int] = (1, 1), dst_rank: int = 0) -> None:
    """Every kernel group mapped on its own (blocks [3, 0] to [1, 2], a block and a half of
    its group's tokens): each layer's tokens land where vLLM's slot mapping puts them,
    the destination rank's heads of the source's, and nothing else changes."""
    assert len(src.reg.kernel_groups) == len(dst.reg.kernel_groups)
    before = dst.buf.clone()
    for s_group, d_group in zip(src.reg.kernel_groups, dst.reg.kernel_groups, strict=True):
        names = src.layer_names(s_group)
        assert names == dst.layer_names(d_group) and s_group.engine_group == d_group.engine_group
        bs = src.block_size(names[0])
        tokens = bs + bs // 2 + 1
        heads = _heads(src, names[0]) * tp[0]  # the model's, as a connector knows them from the spec
        src_shard, dst_shard = Shard(0, tp[0], heads), Shard(dst_rank, tp[1], heads)
        m = block_map(
            s_group, d_group, [3, 0], [1, 2], num_tokens=tokens, src_shard=src_shard, dst_shard=dst_shard
        )
        m.copy()
        for name in names:
            own = _heads(dst, name)
            part = slice(dst_rank * own, (dst_rank + 1) * own) if tp[1] > tp[0] else slice(None)
            assert torch.equal(dst.rows(name, [1, 2], tokens), src.rows(name, [3, 0], tokens, part)), name
    after = dst.buf.clone()
    assert torch.equal(_cleared(dst, after), _cleared(dst, before)), "a map wrote outside its tokens"


def _cleared(side: Side, contents: torch.Tensor) -> torch.Tensor:
    """``contents`` (a copy of ``side``'s buffer) with _check_maps's destination tokens zeroed."""
    side.buf.copy_(contents)
    for name in side.names:
        bs, kernel = side.block_size(name), side.engine.kernel_block_sizes[side.engine.group_of(name)]
        for p in range(bs + bs // 2 + 1):
            slot = [1, 2][p // bs] * bs + p % bs
            side.kv[name][slot // kernel, :, slot % kernel] = 0
    out = side.buf.clone()
    side.buf.copy_(contents)
    return out


def _check_chunks(src: Side, dst: Side) -> None:
    """Each kernel group's blocks [3, 0] stored to a CPU chunk from ``src`` and loaded into
    blocks [2, 1] of ``dst`` (another layout, the same specs): byte for byte by slot."""
    for s_group, d_group in zip(src.reg.kernel_groups, dst.reg.kernel_groups, strict=True):
        store, load = prepare(s_group), prepare(d_group)
        (chunk,) = store.chunks_for(2, 2 * store.block_size)
        store.store_blocks([3, 0], [chunk])
        load.load_blocks([2, 1], [chunk])
        for name in src.layer_names(s_group):
            bs = src.block_size(name)
            assert torch.equal(dst.rows(name, [2, 1], 2 * bs), src.rows(name, [3, 0], 2 * bs)), name


# -- EAGLE-3 of another head count, head size or dtype: one group, several allocations ----


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_an_eagle3_drafter_of_other_heads_is_its_own_allocation_of_the_target_s_group(layout: Any) -> None:
    src = Side({**_llama(), EAGLE3: _full(4)}, layout, 1)
    (group,) = src.engine.config.kv_cache_groups
    assert isinstance(group.kv_cache_spec, kvi.UniformTypeKVCacheSpecs)
    assert [t.layers for t in src.engine.config.kv_cache_tensors][1] == [EAGLE3]
    target, drafter = src.reg.kernel_groups
    assert target.engine_group == drafter.engine_group == 0
    assert drafter.layers == (16,) and (drafter.geometry.num_heads, target.geometry.num_heads) == (4, 8)
    other = LAYOUTS[(LAYOUTS.index(layout) + 1) % len(LAYOUTS)]
    _check_maps(src, Side({**_llama(), EAGLE3: _full(4)}, other, 2))
    _check_chunks(src, Side({**_llama(), EAGLE3: _full(4)}, other, 3))


@pytest.mark.parametrize("layout", [vx.KVCacheLayout.LBNHC, vx.KVCacheLayout.BLHNC], ids=lambda x: x.name)
@pytest.mark.parametrize("rank", [0, 1])
def test_an_eagle3_drafter_reshards_from_tp1_to_tp2_by_its_own_heads(layout: Any, rank: int) -> None:
    """Target 8 heads (4 a rank at TP 2), drafter 4 (2 a rank): each kernel group takes
    its own model's heads."""
    src = Side({**_llama(1), EAGLE3: _full(4)}, layout, 4)
    dst = Side({**_llama(2), EAGLE3: _full(2)}, vx.KVCacheLayout.LBHNC, 5 + rank)
    _check_maps(src, dst, tp=(1, 2), dst_rank=rank)


@pytest.mark.parametrize("drafter", ["head_size", "fp8"])
def test_a_drafter_of_another_head_size_or_dtype_moves_in_its_own_kernel_group(drafter: str) -> None:
    spec = _full(8, head=128) if drafter == "head_size" else _full(8, dtype=torch.float8_e4m3fn)
    src = Side({**_llama(), EAGLE3: spec}, vx.KVCacheLayout.BLNHC, 7)
    assert len(src.reg.kernel_groups) == 2 and src.reg.kernel_groups[1].layers == (16,)
    assert src.reg.kernel_groups[1].dtype == spec.dtype
    _check_maps(src, Side({**_llama(), EAGLE3: spec}, vx.KVCacheLayout.LBHNC, 8))


# -- MLA: an MTP layer, and an attention drafter beside MLA ---------------------------------

MLA = kvi.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=512 + 64, dtype=torch.bfloat16)
DEEPSEEK = {f"model.layers.{i}.self_attn.attn": MLA for i in range(3)}  # DeepSeek-V3's latents
MTP = "model.layers.3.self_attn.attn"  # deepseek_mtp: the MTP layer after the target's


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_an_mtp_layer_of_an_mla_model_is_one_more_layer_of_its_group(layout: Any) -> None:
    src = Side({**DEEPSEEK, MTP: MLA}, layout, 9, backend=vx.FLASHMLA)
    (group,) = src.reg.kernel_groups
    assert group.layers == (0, 1, 2, 3) and (group.geometry.num_heads, group.geometry.head_size) == (1, 576)
    _check_maps(src, Side({**DEEPSEEK, MTP: MLA}, vx.KVCacheLayout.LBNHC, 10, backend=vx.FLASHMLA))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_an_attention_drafter_beside_mla_shares_the_group_in_its_own_allocation(layout: Any) -> None:
    """vLLM's registry groups MLA with full attention: one ``UniformTypeKVCacheSpecs``
    group, the MLA latents and the drafter's K | V heads each an allocation."""
    specs = {**DEEPSEEK, MTP: _full(8, head=128, block=64)}
    src = Side(specs, layout, 11)
    (group,) = src.engine.config.kv_cache_groups
    assert isinstance(group.kv_cache_spec, kvi.UniformTypeKVCacheSpecs)
    mla, drafter = src.reg.kernel_groups
    assert (mla.geometry.num_heads, drafter.geometry.num_heads) == (1, 8)
    _check_maps(src, Side(specs, vx.KVCacheLayout.BLHNC, 12))
    _check_chunks(src, Side(specs, vx.KVCacheLayout.LBNHC, 13))


def _mha_window(block: int) -> Any:
    return kvi.SlidingWindowSpec(
        block_size=block,
        num_kv_heads=8,
        head_size=128,
        dtype=torch.bfloat16,
        sliding_window=128,
        is_draft=True,
    )


@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=lambda x: x.name)
def test_a_window_drafter_beside_mla_whose_pages_do_not_unify_is_allocated_as_full_attention(
    layout: Any,
) -> None:
    """An MLA page (64 x 1152 bytes) neither divides a 64-token window page of 8 heads of
    128 (64 x 4096) nor can be padded to it: vLLM falls back to allocating the window as
    full attention (``_try_get_full_allocation_fallback_groups``), one group with MLA."""
    specs = {**DEEPSEEK, MTP: _mha_window(64)}
    src = Side(specs, layout, 20)
    (group,) = src.engine.config.kv_cache_groups
    assert type(group.kv_cache_spec.kv_cache_specs[MTP]) is kvi.FullAttentionSpec
    mla, drafter = src.reg.kernel_groups
    assert drafter.layers == (3,) and (mla.geometry.num_heads, drafter.geometry.num_heads) == (1, 8)
    _check_maps(src, Side(specs, vx.KVCacheLayout.LBHNC, 21))
    _check_chunks(src, Side(specs, vx.KVCacheLayout.LBNHC, 22))


# -- a sliding-window drafter beside full attention: groups of their own ---------------------


def _sliding(heads: int, *, draft: bool = True) -> Any:
    return kvi.SlidingWindowSpec(
        block_size=16,
        num_kv_heads=heads,
        head_size=64,
        dtype=torch.bfloat16,
        sliding_window=128,
        is_draft=draft,
    )


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("heads", [8, 4])
def test_a_sliding_window_drafter_is_a_group_of_its_own(layout: Any, heads: int) -> None:
    """16 full layers and one window of equal pages: vLLM buckets them apart and, the
    window's bucket being the smaller, makes every group one layer (17 groups). A window
    of half the heads has half the page: layer-outer, vLLM doubles its block to 32 tokens
    to unify pages; block-outermost, it packs the two buckets side by side in each block
    (two groups, the window's block still 16 tokens)."""
    specs = {**_llama(), EAGLE3: _sliding(heads)}
    src = Side(specs, layout, 14)
    packed = heads == 4 and layout.is_block_outermost
    assert len(src.engine.config.kv_cache_groups) == (2 if packed else 17)
    drafter = src.reg.kernel_groups[-1]
    assert drafter.layers == (16,) and drafter.engine_group == (1 if packed else 16)
    assert drafter.block_size == src.block_size(EAGLE3) == (16 if packed else 16 * 8 // heads)
    peer = vx.KVCacheLayout.BLHNC if layout.is_block_outermost else vx.KVCacheLayout.LBHNC
    _check_maps(src, Side(specs, peer, 15))
    _check_chunks(src, Side(specs, peer, 16))


# -- a drafter sharing a target layer's KV (Gemma-4 MTP) -------------------------------------

GEMMA4_LIKE = {
    f"model.layers.{i}.self_attn.attn": _full(2, draft=False) if i % 3 == 2 else _sliding(2, draft=False)
    for i in range(6)
}
# gemma4.py _setup_gemma4_kv_sharing: each draft layer reads the last target layer of its type
MTP_SHARED = {"mtp.layers.0.self_attn.attn": "model.layers.4.self_attn.attn"}
MTP_SHARED["mtp.layers.1.self_attn.attn"] = "model.layers.5.self_attn.attn"


@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=lambda x: x.name)
def test_draft_layers_sharing_target_kv_read_and_move_their_target_s_blocks(layout: Any) -> None:
    src = Side(GEMMA4_LIKE, layout, 17, shared=MTP_SHARED)
    assert src.names[6:] == list(MTP_SHARED)
    pairs = {src.names.index(k): src.names.index(v) for k, v in MTP_SHARED.items()}
    assert src.reg.shared_layers == tuple(sorted((t, s) for s, t in pairs.items()))
    for group in src.reg.kernel_groups:
        for index, target_index in pairs.items():
            assert (index in group.layers) == (target_index in group.layers)
    _check_maps(src, Side(GEMMA4_LIKE, vx.KVCacheLayout.BLNHC, 18, shared=MTP_SHARED))
    dst = Side(GEMMA4_LIKE, vx.KVCacheLayout.LBHNC, 19, shared=MTP_SHARED)
    _check_chunks(src, dst)
    for sharer, target in MTP_SHARED.items():
        assert dst.kv[sharer] is dst.kv[target]
