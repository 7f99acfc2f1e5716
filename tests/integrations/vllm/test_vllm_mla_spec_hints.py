"""The spec says MLA: the group edits read an MLA group's latents as latents under any
hints, and refuse hints that contradict the spec.

vLLM 0.33 registers an MLA layer as ``[NB, 1, BS, C]`` (``create_kv_cache_views``), the
shape of a one-head fused K | V cache, and its ``MLAAttention.bind_kv_cache`` views it as
``[NB, BS, C]`` (``kv_cache.squeeze(1)``); ``concat_and_cache_mla`` writes token ``p``'s
latent row at slot ``block_table[p // BS] * BS + p % BS`` of that view. The oracle below
is that addressing, on the registered tensors."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import kvlayout
from kvlayout.integrations.vllm import apply_kv_cache_group_edits, transfer_layers
from kvlayout.testing import vllm as vx
from kvlayout.transfer import block_map
from tests.integrations.vllm.models import stored_then_loaded

pytest.importorskip("vllm.v1.kv_cache_interface")
import vllm.v1.kv_cache_interface as kvi

BS, NB, NL, TOKENS = 64, 6, 3, 150

HINTS: list[Any] = [None, {"kv_layout": "NHD"}, {"kv_layout": "HND"}, {"kv_layout": "LBNHC"}, {"kv_dim": 1}]


def mla_spec(kind: str) -> Any:
    """``subpaged``: a 128-token block in FlashMLA's 64-token kernel pages (the
    ``subpaged-mla-attention`` edit joins them into blocks)."""
    if kind == "subpaged":
        return kvi.MLAAttentionSpec(block_size=2 * BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    if kind == "sliding":  # DeepSeek-V4's SWA cache (sparse_swa.py), not a bounded replay
        return kvi.SlidingWindowMLASpec(
            block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, sliding_window=4096
        )
    return kvi.MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)


def engine_of(spec: Any) -> tuple[vx.Engine, dict[str, torch.Tensor]]:
    engine = vx.uniform_engine(spec, vx.FLASHMLA, num_layers=NL, num_blocks=NB)
    buf, kv = vx.allocate_v033(engine)
    vx.fill_random(buf, 5)
    return engine, kv


def latent_row(view: torch.Tensor, block_table: list[int], p: int, bs: int = BS) -> torch.Tensor:
    """Token ``p``'s latent row where vLLM writes it, as int16 (random bytes hold NaNs): a
    block of ``bs`` tokens is ``bs / kernel`` kernel pages in order, so slot-major the
    kernel pages' rows are the blocks' slots."""
    slots = view.squeeze(1).reshape(-1, view.shape[-1])  # bind_kv_cache's [pages, kernel, C]
    return slots[block_table[p // bs] * bs + p % bs].view(torch.int16)


@pytest.mark.parametrize("kind", ["mla", "sliding", "subpaged"])
@pytest.mark.parametrize("hints", HINTS, ids=repr)
def test_an_mla_spec_s_latents_read_as_latents_whatever_the_hints(kind: str, hints: Any) -> None:
    spec = mla_spec(kind)
    bs = spec.block_size
    engine, kv = engine_of(spec)
    edited = apply_kv_cache_group_edits(engine.config, kv, hints)
    for name, value in kv.items():  # a view over vLLM's storage, never a copy
        assert tuple(edited[name].shape) == (NB, bs, 576)
        assert edited[name].data_ptr() == value.data_ptr()
    layers, groups = transfer_layers(engine.config, edited)
    group = kvlayout.detect(layers, "vllm", hints, layer_groups=groups).only_group()
    assert (group.format.name, group.block_size) == ("NL_X_NB_BS_HS", bs)
    saved, loaded = [4, 1, 3][: -(-TOKENS // bs)], [2, 5, 0][: -(-TOKENS // bs)]
    chunk = stored_then_loaded(group, saved, loaded, TOKENS)
    for layer, view in enumerate(kv.values()):
        for p in range(TOKENS):
            sent = latent_row(view, saved, p, bs)
            assert torch.equal(chunk[:, layer, p].reshape(-1).view(torch.int16), sent)
            assert torch.equal(latent_row(view, loaded, p, bs), sent)


def test_the_latents_map_to_sglang_s_mla_pool_without_the_hint() -> None:
    """What a user who left out ``kv_dim=1`` saw refused: vLLM's latents to SGLang's
    ``MLATokenToKVPool`` (``[size, 1, C]`` a layer, token ``t`` of page ``n`` at row
    ``n * page + t``)."""
    engine, kv = engine_of(mla_spec("mla"))
    layers, groups = transfer_layers(engine.config, apply_kv_cache_group_edits(engine.config, kv))
    reg = kvlayout.detect(layers, "vllm", layer_groups=groups)
    sglang = [torch.zeros(NB * BS, 1, 576, dtype=torch.bfloat16) for _ in range(NL)]
    pool = kvlayout.detect(sglang, "sglang", {"kv_layout": "NHD"})
    block_map(reg.only_group(), pool, [2, 0, 4], [5, 1, 3], num_tokens=TOKENS, dst_block_size=BS).copy()
    for layer, view in enumerate(kv.values()):
        for p in range(TOKENS):
            moved = sglang[layer][[5, 1, 3][p // BS] * BS + p % BS, 0]
            assert torch.equal(moved.view(torch.int16), latent_row(view, [2, 0, 4], p))


def test_a_one_head_attention_model_stays_one_head_of_k_and_v() -> None:
    """The same ``[NB, 1, BS, C]`` of a one-KV-head model (TP = KV heads) is heads of K | V:
    the spec says so, and the edits leave it as registered."""
    spec = kvi.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=128, dtype=torch.bfloat16)
    engine = vx.uniform_engine(spec, vx.FLASH_ATTN, num_layers=2, num_blocks=NB)
    _, kv = vx.allocate_v033(engine)
    edited = apply_kv_cache_group_edits(engine.config, kv, {"kv_layout": "NHD"})
    assert all(edited[name] is value for name, value in kv.items())
    layers, groups = transfer_layers(engine.config, edited)
    group = kvlayout.detect(layers, "vllm", {"kv_layout": "NHD"}, layer_groups=groups).only_group()
    assert (group.format.name, group.geometry.num_heads) == ("NL_X_NB_BS_NH_CS", 1)


MLA_CONTRADICTED = (
    "contradicts KV cache group 0's {cls}: vLLM's MLA layers hold one latent row a token (no K and V "
    "planes, no heads), which the group edits read as latents without a hint; leave it out"
)
INDEXER_CONTRADICTED = (
    "contradicts KV cache group {group}'s {cls}: it names a DSA indexer's key records, but the spec's "
    "layers hold MLA latents (its cache_role is not INDEXER, and the registered rows are not an "
    "indexer's), which the group edits read as latents without a hint; leave it out"
)
ATTENTION_CONTRADICTED = (
    "contradicts KV cache group 0's FullAttentionSpec: it says MLA latents, but the spec's layers hold "
    "heads of K and V (the group edits read an MLA spec's layers as latents without the hint); leave it out"
)


@pytest.mark.parametrize("kind", ["mla", "sliding"])
@pytest.mark.parametrize(
    ("hints", "hint"),
    [
        ({"kv_dim": 2}, "kv_dim=2"),
        ({"kv_layout": "NHD", "layout_format": "NL_X_NB_BS_NH_CS"}, "layout_format='NL_X_NB_BS_NH_CS'"),
        # the edits' opaque view of pages per head (OPAQUE_HEAD_PAGES_FORMAT): heads, K | V rows
        ({"kv_layout": "LHBNC", "layout_format": "NL_X_NH_NB_BS_CS"}, "layout_format='NL_X_NH_NB_BS_CS'"),
        # heads of K or V alone (SGLang's split pools): heads all the same
        ({"layout_format": "NL_X_NB_BS_NH_HS"}, "layout_format='NL_X_NB_BS_NH_HS'"),
    ],
)
def test_hints_of_k_and_v_on_an_mla_spec_are_refused(kind: str, hints: Any, hint: str) -> None:
    spec = mla_spec(kind)
    engine, kv = engine_of(spec)
    message = f"layout hint {hint} " + MLA_CONTRADICTED.format(cls=type(spec).__name__)
    with pytest.raises(kvlayout.LayoutHintError, match="^" + re.escape(message) + "$"):
        apply_kv_cache_group_edits(engine.config, kv, hints)


@pytest.mark.parametrize(
    ("hints", "hint"),
    [({"kv_dim": 1}, "kv_dim=1"), ({"layout_format": "NL_X_NB_BS_HS"}, "layout_format='NL_X_NB_BS_HS'")],
)
def test_an_mla_hint_on_an_attention_spec_is_refused(hints: Any, hint: str) -> None:
    spec = kvi.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=128, dtype=torch.bfloat16)
    engine = vx.uniform_engine(spec, vx.FLASH_ATTN, num_layers=2, num_blocks=NB)
    _, kv = vx.allocate_v033(engine)
    message = f"layout hint {hint} " + ATTENTION_CONTRADICTED
    with pytest.raises(kvlayout.LayoutHintError, match="^" + re.escape(message) + "$"):
        apply_kv_cache_group_edits(engine.config, kv, hints)


INDEXER_FORMATS = ["NL_X_NB_BSV_BSS", "NL_X_NB_BSV4_BSS4"]  # vLLM's fp8 and mxfp4 DSA indexer keys


@pytest.mark.parametrize("kind", ["mla", "sliding", "subpaged"])
@pytest.mark.parametrize("fmt", INDEXER_FORMATS)
def test_an_indexer_format_on_an_mla_spec_of_latents_is_refused(kind: str, fmt: str) -> None:
    """An MLA spec of latents (``cache_role`` SPARSE, rows of 576 bf16) named an indexer's
    key records: refused naming the group, the spec class and the hint, before detection
    would refuse the registration without naming either."""
    spec = mla_spec(kind)
    engine, kv = engine_of(spec)
    message = f"layout hint layout_format={fmt!r} " + INDEXER_CONTRADICTED.format(
        group=0, cls=type(spec).__name__
    )
    with pytest.raises(kvlayout.LayoutHintError, match="^" + re.escape(message) + "$"):
        apply_kv_cache_group_edits(engine.config, kv, {"layout_format": fmt})


def indexer_engine(spec: Any, backend: vx.Backend, block: int) -> tuple[vx.Engine, dict[str, torch.Tensor]]:
    name = "model.layers.{}.self_attn.indexer.k_cache"
    engine = vx.uniform_engine(spec, backend, num_layers=2, num_blocks=NB, layer_name=name)
    buf, kv = vx.allocate_v033(engine)
    vx.fill_random(buf, 7)
    assert all(tuple(t.shape) == (NB, 1, block, 132) for t in kv.values())  # vLLM's [B, H=1, N, C]
    return engine, kv


def test_the_indexer_s_own_format_on_its_spec_is_not_refused() -> None:
    """DeepSeek-V4's ``DeepseekV4IndexerCache`` keeps the default ``cache_role`` (SPARSE):
    its registered rows (uint8, 132 bytes a slot) say indexer, and the hint naming their
    format is what detection reads. DeepSeek-V3.2's ``DeepseekV32IndexerCache`` says it in
    its spec (``cache_role`` INDEXER)."""
    v4 = vx.dsv4_indexer_spec(256)
    v32 = kvi.MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=132,
        dtype=torch.uint8,
        cache_role=kvi.SparseCacheRole.INDEXER,
    )
    for spec, backend, slots in ((v4, vx.DSV4_INDEXER, 64), (v32, vx.FLASHMLA, 64)):
        engine, kv = indexer_engine(spec, backend, slots)
        hints = {"layout_format": "NL_X_NB_BSV_BSS"}
        layers, groups = transfer_layers(engine.config, apply_kv_cache_group_edits(engine.config, kv, hints))
        group = kvlayout.detect(layers, "vllm", hints, layer_groups=groups).only_group()
        assert (group.format.name, group.block_size) == ("NL_X_NB_BSV_BSS", slots)


def test_the_indexer_s_format_is_not_refused_for_an_indexer_layer_another_stage_registers() -> None:
    """Under pipeline parallelism a worker registers its own stage's layers only; a
    DeepSeek-V4 indexer layer of another stage (its spec at the default ``cache_role``,
    no rows here to read) is no reason to refuse the indexer's format that this stage's
    indexer layers hold."""
    engine, kv = indexer_engine(vx.dsv4_indexer_spec(256), vx.DSV4_INDEXER, 64)
    names = list(kv)
    hints = {"layout_format": "NL_X_NB_BSV_BSS"}
    mine = {names[0]: kv[names[0]]}  # the other stage's layer is not this worker's
    layers, groups = transfer_layers(engine.config, apply_kv_cache_group_edits(engine.config, mine, hints))
    group = kvlayout.detect(layers, "vllm", hints, layer_groups=groups).only_group()
    assert (group.format.name, group.layers) == ("NL_X_NB_BSV_BSS", (0,))


def test_an_indexer_format_names_the_latents_group_of_a_model_with_an_indexer() -> None:
    """One hint for every group: a DeepSeek-V3.2-like model (latents in group 0, the
    indexer's keys in group 1) given the indexer's format is refused at the latents."""
    latents = mla_spec("mla")
    indexer = kvi.MLAAttentionSpec(
        block_size=BS,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=132,
        dtype=torch.uint8,
        cache_role=kvi.SparseCacheRole.INDEXER,
    )
    specs = {
        f"model.layers.{i}.self_attn.{part}": spec
        for i in range(2)
        for part, spec in (("attn", latents), ("indexer.k_cache", indexer))
    }
    names = list(specs)
    engine = vx.make_engine(specs, [names[0::2], names[1::2]], lambda s: BS, num_blocks=NB)
    _, kv = vx.allocate_v033(engine)
    message = "layout hint layout_format='NL_X_NB_BSV_BSS' " + INDEXER_CONTRADICTED.format(
        group=0, cls="MLAAttentionSpec"
    )
    with pytest.raises(kvlayout.LayoutHintError, match="^" + re.escape(message) + "$"):
        apply_kv_cache_group_edits(engine.config, kv, {"layout_format": "NL_X_NB_BSV_BSS"})


def test_an_indexer_format_on_an_indexer_spec_is_refused_by_its_rows_not_its_role() -> None:
    """MiniMax-M3's indexer (``MLAAttentionSpec``, ``cache_role`` INDEXER, bf16 keys of 128
    without scales) holds an indexer's keys, whose rows no indexer format of scaled records
    reads: named ``NL_X_NB_BSV_BSS``, the spec is not what the hint contradicts (its role
    says indexer), and the edits do not say it is; reading the rows refuses them."""
    spec = kvi.MLAAttentionSpec(
        block_size=BS,
        num_kv_heads=1,
        head_size=128,
        dtype=torch.bfloat16,
        cache_role=kvi.SparseCacheRole.INDEXER,
    )
    engine, kv = indexer_engine_of(spec)
    hints = {"layout_format": "NL_X_NB_BSV_BSS"}
    with pytest.raises(
        kvlayout.LayoutHintError, match="contradicts the registration, which vllm regi"
    ) as refused:
        apply_kv_cache_group_edits(engine.config, kv, hints)  # the rows' reading refuses, not the spec check
    assert "cache_role" not in str(refused.value)


def indexer_engine_of(spec: Any) -> tuple[vx.Engine, dict[str, torch.Tensor]]:
    name = "model.layers.{}.self_attn.indexer.k_cache"
    engine = vx.uniform_engine(spec, vx.FLASHMLA, num_layers=2, num_blocks=NB, layer_name=name)
    return engine, vx.allocate_v033(engine)[1]
