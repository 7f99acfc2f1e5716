"""TRT-LLM's Mamba states (conv and SSM), V1's layer-first pools ``[NL, slots, *state]``
and V2's per-layer views: every byte a block map moves is checked against TRT-LLM's own
transceiver addressing (``disaggregation/native/mixers/ssm/peer.py``): a layer's item at
``base + layer * slots * slot_bytes + slot * slot_bytes``, a conv state's sections each
split over the TP ranks, an SSM state's heads contiguous."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kvlayout
from kvlayout import DetectionError
from kvlayout.integrations.trtllm import MambaStateError, mamba_state_pools
from kvlayout.transfer import BlockMapError, Shard, block_map

NL, SLOTS, D_CONV = 3, 5, 4
D_INNER, N_GROUPS, D_STATE, NHEADS, HEAD_DIM = 16, 2, 4, 4, 4  # x is 16 channels, B and C 8 each


def sections(tp: int, model: str = "nemotron_hybrid") -> list[int]:
    """``PythonMambaCacheManager.conv_section_dims`` at TP ``tp``."""
    x, ngds = D_INNER // tp, N_GROUPS * D_STATE // tp
    return [ngds, ngds, x] if model == "qwen3_next" else [x, ngds, ngds]


def v1_manager(tp: int, seed: int, model: str = "nemotron_hybrid", layers: int = NL) -> SimpleNamespace:
    """A ``MixedMambaHybridCacheManager``: its ``_impl`` (a ``PythonMambaCacheManager``)
    holds ``mamba_cache.conv`` and ``mamba_cache.temporal``, ``layers`` Mamba layers (a PP
    stage's ``local_num_mamba_layers``)."""
    g = torch.Generator().manual_seed(seed)
    sec = sections(tp, model)
    conv = torch.randn(layers, SLOTS, sum(sec), D_CONV - 1, generator=g).to(torch.bfloat16)
    ssm = torch.randn(layers, SLOTS, NHEADS // tp, HEAD_DIM, D_STATE, generator=g)
    impl = SimpleNamespace(mamba_cache=SimpleNamespace(conv=conv, temporal=ssm), conv_section_dims=sec)
    return SimpleNamespace(_impl=impl)


def v2_manager(tp: int, scale: int = 3) -> SimpleNamespace:
    """A ``V2MambaHybridCacheManager``: each layer's state a ``[slots, *state]`` view
    whose slots lie ``scale`` coalesced sub-pages apart (``_get_state_buffer``)."""
    sec = sections(tp)
    conv_pages = torch.zeros(SLOTS * scale, sum(sec), D_CONV - 1, dtype=torch.bfloat16)
    ssm_pages = torch.zeros(SLOTS * scale, NHEADS // tp, HEAD_DIM, D_STATE)

    def layer(raw: torch.Tensor, i: int) -> torch.Tensor:
        return raw[i:].as_strided((SLOTS, *raw.shape[1:]), (raw.stride(0) * scale, *raw.stride()[1:]))

    return SimpleNamespace(
        all_conv_states=[layer(conv_pages, i) for i in range(NL)],
        all_ssm_states=[layer(ssm_pages, i) for i in range(NL)],
        conv_section_dims=sec,
    )


def v1_item(manager: SimpleNamespace, name: str, layer: int, slot: int) -> torch.Tensor:
    """TRT-LLM's V1 addressing: ``base + layer * slots * slot_bytes + slot * slot_bytes``."""
    cache = manager._impl.mamba_cache
    t: torch.Tensor = cache.conv if name == "conv" else cache.temporal
    flat = t.reshape(-1).view(torch.uint8)
    slot_bytes = t.stride(1) * t.element_size()
    start = layer * t.shape[1] * slot_bytes + slot * slot_bytes
    return flat[start : start + slot_bytes]


def tp_slices(section_bytes: list[int], peer_bytes: list[int], ratio_rank: int) -> list[tuple[int, int, int]]:
    """``ConvStateMismatchMapper._compute_section_plans`` from the larger side: (offset in
    the larger item, offset in the smaller, bytes) a section."""
    plans, big, small = [], 0, 0
    for b, s in zip(section_bytes, peer_bytes, strict=True):
        plans.append((big + ratio_rank * s, small, s))
        big, small = big + b, small + s
    return plans


@pytest.mark.parametrize("model", ["nemotron_hybrid", "qwen3_next"])
@pytest.mark.parametrize("rank", [0, 1])
def test_v1_states_move_between_tp_degrees_as_trtllms_transceiver_splits_them(model: str, rank: int) -> None:
    src, dst = v1_manager(1, 0, model), v1_manager(2, 1, model)
    for t in (dst._impl.mamba_cache.conv, dst._impl.mamba_cache.temporal):
        t.zero_()
    a, b = mamba_state_pools(src), mamba_state_pools(dst)
    assert set(a) == {"conv", "ssm"}
    for name in ("conv", "ssm"):
        m = block_map(a[name], b[name], [3], [1], src_shard=Shard(0, 1, 8), dst_shard=Shard(rank, 2, 8))
        assert m.kind == "resharded state"
        m.copy()
    row = (D_CONV - 1) * 2  # bf16 bytes of one conv channel
    conv_plan = tp_slices([n * row for n in sections(1, model)], [n * row for n in sections(2, model)], rank)
    head = HEAD_DIM * D_STATE * 4
    ssm_plan = [(rank * 2 * head, 0, 2 * head)]  # MambaHeadMismatchMapper: min(heads) contiguous heads
    for layer in range(NL):
        for name, plan in (("conv", conv_plan), ("ssm", ssm_plan)):
            got, want = v1_item(dst, name, layer, 1), v1_item(src, name, layer, 3)
            assert sum(n for _, _, n in plan) == got.numel()
            for big, small, n in plan:
                assert torch.equal(got[small : small + n], want[big : big + n]), (name, layer)
            for slot in (0, 2, 3, 4):
                assert not v1_item(dst, name, layer, slot).any()


def test_v1_states_map_into_v2s_coalesced_views_whole_items() -> None:
    src, dst = v1_manager(2, 5), v2_manager(2)
    a, b = mamba_state_pools(src), mamba_state_pools(dst)
    for name in ("conv", "ssm"):
        block_map(a[name], b[name], [4, 0], [2, 3]).copy()
    for layer in range(NL):
        for name, views in (("conv", dst.all_conv_states), ("ssm", dst.all_ssm_states)):
            for s, d in ((4, 2), (0, 3)):
                assert torch.equal(
                    views[layer][d].reshape(-1).view(torch.uint8), v1_item(src, name, layer, s)
                )
    # the coalesced neighbours (other layers' sub-pages of slot 2) hold what those layers received only
    conv_pages = dst.all_conv_states[0]
    assert not conv_pages[1].any() and not conv_pages[4].any()


def test_a_states_map_given_the_requests_tokens_says_to_leave_them_out() -> None:
    """A connector joining a hybrid request's maps passes num_tokens to each; a state's
    block is one slot, so the refusal says to map it by its block id alone."""
    a, b = mamba_state_pools(v1_manager(1, 0)), mamba_state_pools(v1_manager(2, 1))
    p, d = Shard(0, 1, 8), Shard(1, 2, 8)
    with pytest.raises(
        BlockMapError,
        match=r"fill 5 blocks of 1: a block of state pages \(TRT-LLM Mamba ssm.*without num_tokens",
    ):
        block_map(a["ssm"], b["ssm"], [3], [0], num_tokens=5, src_shard=p, dst_shard=d)
    with pytest.raises(BlockMapError, match=r"fill 1 block of 1$"):  # no num_tokens: no such advice
        block_map(a["conv"], b["conv"], [3, 4], [0], src_shard=p, dst_shard=d)
    assert block_map(a["ssm"], b["ssm"], [3], [0], num_tokens=1, src_shard=p, dst_shard=d).num_runs == NL


def test_a_python_manager_is_read_as_its_facade_is() -> None:
    facade = v1_manager(1, 2)
    direct = facade._impl  # PythonMambaCacheManager itself holds mamba_cache
    a, b = mamba_state_pools(facade), mamba_state_pools(direct)
    assert [a[n].kernel_groups[0].describe() for n in a] == [b[n].kernel_groups[0].describe() for n in b]


def test_without_section_dims_states_move_whole_at_one_tp_only() -> None:
    src, dst = v1_manager(1, 0), v1_manager(2, 1)
    del src._impl.conv_section_dims, dst._impl.conv_section_dims
    a, b = mamba_state_pools(src), mamba_state_pools(dst)
    block_map(a["ssm"], mamba_state_pools(v1_manager(1, 3))["ssm"], [1], [1]).copy()
    with pytest.raises(BlockMapError):
        block_map(a["conv"], b["conv"], [1], [1], src_shard=Shard(0, 1, 8), dst_shard=Shard(0, 2, 8))


def test_the_pool_detector_refuses_a_mamba_state() -> None:
    """A state handed to ``detect(..., "trtllm")`` is no KV pool: refused, never read as one."""
    cache = v1_manager(1, 0)._impl.mamba_cache
    with pytest.raises(DetectionError, match=r"K/V axis \(dim 2\) is 32"):
        kvlayout.detect(cache.conv, "trtllm")
    with pytest.raises(DetectionError, match="fits no TRT-LLM format"):
        kvlayout.detect(cache.temporal, "trtllm")


def test_bad_managers_are_refused_by_name() -> None:
    with pytest.raises(MambaStateError, match="not a TRT-LLM Mamba cache manager"):
        mamba_state_pools(SimpleNamespace(kv_cache_pool=None))
    m = v1_manager(1, 0)
    m._impl.conv_section_dims = [16, 8, 4]
    with pytest.raises(
        MambaStateError, match=r"conv_section_dims \[16, 8, 4\] are not positive ints summing to"
    ):
        mamba_state_pools(m)
    with pytest.raises(MambaStateError, match="a rank without Mamba layers has none"):
        mamba_state_pools(SimpleNamespace(all_conv_states=[], all_ssm_states=[]))
    m = v1_manager(1, 0)
    m._impl.mamba_cache.temporal = m._impl.mamba_cache.temporal[:, :4]
    with pytest.raises(MambaStateError, match="the same layers and slots on one device expected"):
        mamba_state_pools(m)
    m = v1_manager(1, 0)
    m._impl.mamba_cache.conv = m._impl.mamba_cache.conv.transpose(2, 3)  # (d_conv - 1, conv_dim)
    with pytest.raises(
        MambaStateError, match=r"summing to the conv state's 3 channels \(conv state \[3, 32\]"
    ):
        mamba_state_pools(m)
    m._impl.mamba_cache.conv = torch.zeros(NL, SLOTS, 32, 2 * (D_CONV - 1), dtype=torch.bfloat16)[..., ::2]
    with pytest.raises(MambaStateError, match=r"conv state of layer 0 .* is not one contiguous item a slot"):
        mamba_state_pools(m)
    v2 = v2_manager(1)
    v2.all_ssm_states = v2.all_ssm_states[:2]
    with pytest.raises(MambaStateError, match="3 layers of conv state and 2 of ssm state"):
        mamba_state_pools(v2)


def cpp_manager(tp: int, seed: int, layout: int = 1) -> SimpleNamespace:
    """A ``CppMambaHybridCacheManager``: the C++ recurrent-state pool ``[NL, blocks, 1,
    (ssm_bytes + conv_bytes) / 4]`` of the SSM dtype (``WindowBlockManager::allocatePools``)
    and ``_setup_states``' views of it, its metadata as ``__init__`` sets it."""
    g = torch.Generator().manual_seed(seed)
    ssm_shape = [NHEADS // tp, HEAD_DIM, D_STATE]
    conv_shape = [(D_INNER + 2 * N_GROUPS * D_STATE) // tp, D_CONV - 1]
    ssm_bytes, conv_bytes = 4 * HEAD_DIM * D_STATE * ssm_shape[0], 2 * conv_shape[0] * conv_shape[1]
    raw = torch.randn(NL, SLOTS, 1, (ssm_bytes + conv_bytes) // 4, generator=g)
    pool = raw.view(torch.uint8).reshape(NL, -1, ssm_bytes + conv_bytes)
    meta = SimpleNamespace(
        rnn_conv_section_layout=layout,
        rnn_num_heads=NHEADS,
        rnn_head_dim=HEAD_DIM,
        rnn_n_groups=N_GROUPS,
        rnn_d_state=D_STATE,
    )
    return SimpleNamespace(
        all_ssm_states=pool[:, :, :ssm_bytes].view(torch.float32).view([NL, SLOTS, *ssm_shape]),
        all_conv_states=pool[:, :, ssm_bytes:].view(torch.bfloat16).view([NL, SLOTS, *conv_shape]),
        linear_attention_metadata=meta,
        raw=raw,
        ssm_bytes=ssm_bytes,
        conv_bytes=conv_bytes,
    )


def cpp_item(manager: SimpleNamespace, name: str, layer: int, block: int) -> torch.Tensor:
    """The C++ transceiver's addressing (``splitUnifiedPoolSsm``/``Conv``): a block at
    ``base + layer * blocks * block_bytes + block * block_bytes``, its SSM state first,
    its conv state ``ssm_bytes`` on."""
    flat: torch.Tensor = manager.raw.reshape(-1).view(torch.uint8)
    block_bytes = manager.ssm_bytes + manager.conv_bytes
    start = layer * SLOTS * block_bytes + block * block_bytes
    if name == "conv":
        start += manager.ssm_bytes
    return flat[start : start + (manager.conv_bytes if name == "conv" else manager.ssm_bytes)]


def cpp_plans(layout: int, rank: int) -> dict[str, list[tuple[int, int, int]]]:
    """(offset in the TP 1 item, offset in rank ``rank``'s TP 2 item, bytes) a state:
    each conv section split on its own, the SSM state by heads."""
    model = "qwen3_next" if layout == 2 else "nemotron_hybrid"
    row = (D_CONV - 1) * 2
    conv = tp_slices([n * row for n in sections(1, model)], [n * row for n in sections(2, model)], rank)
    head = HEAD_DIM * D_STATE * 4
    return {"conv": conv, "ssm": [(rank * 2 * head, 0, 2 * head)]}


@pytest.mark.parametrize("layout", [1, 2])
@pytest.mark.parametrize("rank", [0, 1])
def test_cpp_pool_states_move_between_tp_degrees_as_its_transceiver_splits_them(
    layout: int, rank: int
) -> None:
    src, dst = cpp_manager(1, 0, layout), cpp_manager(2, 1, layout)
    dst.raw.zero_()
    a, b = mamba_state_pools(src), mamba_state_pools(dst)
    for name in ("conv", "ssm"):
        m = block_map(a[name], b[name], [3], [1], src_shard=Shard(0, 1, 8), dst_shard=Shard(rank, 2, 8))
        assert m.kind == "resharded state"
        m.copy()
    plans = cpp_plans(layout, rank)
    for layer in range(NL):
        for name, plan in plans.items():
            got, want = cpp_item(dst, name, layer, 1), cpp_item(src, name, layer, 3)
            assert sum(n for _, _, n in plan) == got.numel()
            for big, small, n in plan:
                assert torch.equal(got[small : small + n], want[big : big + n]), (name, layer)
    # block 1 of every layer, SSM and conv, is all that was written
    block_bytes = dst.ssm_bytes + dst.conv_bytes
    written = dst.raw.view(torch.uint8).reshape(NL, SLOTS, block_bytes)
    assert not written[:, [0, 2, 3, 4]].any()


@pytest.mark.parametrize("layout", [1, 2])
def test_cpp_pool_states_gather_from_two_ranks_into_one(layout: int) -> None:
    ranks, dst = [cpp_manager(2, r, layout) for r in range(2)], cpp_manager(1, 9, layout)
    b = mamba_state_pools(dst)
    for r, src in enumerate(ranks):
        a = mamba_state_pools(src)
        for name in ("conv", "ssm"):
            block_map(a[name], b[name], [0], [4], src_shard=Shard(r, 2, 8), dst_shard=Shard(0, 1, 8)).copy()
    for r, src in enumerate(ranks):
        for layer in range(NL):
            for name, plan in cpp_plans(layout, r).items():
                got, want = cpp_item(dst, name, layer, 4), cpp_item(src, name, layer, 0)
                for big, small, n in plan:
                    assert torch.equal(got[big : big + n], want[small : small + n]), (name, layer, r)


def test_cpp_pool_states_map_to_a_python_managers_slots_whole_items() -> None:
    src, dst = cpp_manager(2, 4), v1_manager(2, 5)
    a, b = mamba_state_pools(src), mamba_state_pools(dst)
    for name in ("conv", "ssm"):
        block_map(a[name], b[name], [4, 0], [2, 3]).copy()
    for layer in range(NL):
        for name in ("conv", "ssm"):
            for s, d in ((4, 2), (0, 3)):
                assert torch.equal(v1_item(dst, name, layer, d), cpp_item(src, name, layer, s))


def test_cpp_pool_states_without_sections_move_whole_at_one_tp_only() -> None:
    """Layout 0 (another model type): the C++ transceiver splits no conv state either."""
    src, same, other = cpp_manager(2, 0, 0), cpp_manager(2, 1, 0), cpp_manager(1, 2, 0)
    a = mamba_state_pools(src)
    block_map(a["conv"], mamba_state_pools(same)["conv"], [2], [2]).copy()
    assert torch.equal(cpp_item(same, "conv", 1, 2), cpp_item(src, "conv", 1, 2))
    with pytest.raises(BlockMapError):
        block_map(
            mamba_state_pools(other)["conv"],
            a["conv"],
            [1],
            [1],
            src_shard=Shard(0, 1, 8),
            dst_shard=Shard(0, 2, 8),
        )


def test_bad_cpp_managers_are_refused_by_name() -> None:
    m = cpp_manager(2, 0)
    m.linear_attention_metadata.rnn_num_heads = 6  # 6 heads are no TP share of 2 a rank
    with pytest.raises(MambaStateError, match=r"no TP share of the model .* \(6 heads"):
        mamba_state_pools(m)
    m = cpp_manager(2, 0)
    m.linear_attention_metadata.rnn_conv_section_layout = 3
    with pytest.raises(MambaStateError, match=r"rnn_conv_section_layout 3.* a layout of 0, 1 or 2"):
        mamba_state_pools(m)
    del m.linear_attention_metadata
    with pytest.raises(MambaStateError, match="rnn_conv_section_layout None"):
        mamba_state_pools(m)
    m = cpp_manager(2, 0)
    m.all_ssm_states = m.all_ssm_states[:, :4]
    with pytest.raises(MambaStateError, match="the same layers and slots on one device expected"):
        mamba_state_pools(m)
    m.all_ssm_states = m.all_ssm_states[0, 0, 0]
    with pytest.raises(MambaStateError, match=r"all_ssm_states is \[4, 4\], not a \[NL, blocks"):
        mamba_state_pools(m)
    m.all_ssm_states = None  # shutdown() drops its views
    with pytest.raises(MambaStateError, match="shut down, or a rank without Mamba layers"):
        mamba_state_pools(m)
    attention_only = SimpleNamespace(local_num_mamba_layers=0, kv_cache_pool=None)  # a PP rank, no views
    with pytest.raises(MambaStateError, match=r"rank holds no Mamba layers \(local_num_mamba_layers 0\)"):
        mamba_state_pools(attention_only)


def test_managers_of_no_state_are_refused_by_name() -> None:
    """Zero layers, zero slots, freed pools and conv/SSM slots that differ say so."""
    m = v1_manager(1, 0)
    cache = m._impl.mamba_cache
    cache.conv, cache.temporal = cache.conv[:0], cache.temporal[:0]
    with pytest.raises(MambaStateError, match=r"mamba_cache.conv \[0, 5, 32, 3\] holds no layers"):
        mamba_state_pools(m)
    c = cpp_manager(1, 0)
    c.all_conv_states, c.all_ssm_states = c.all_conv_states[:0], c.all_ssm_states[:0]
    with pytest.raises(MambaStateError, match=r"all_conv_states \[0, 5, 32, 3\] holds no layers"):
        mamba_state_pools(c)
    m = v1_manager(1, 0)
    cache = m._impl.mamba_cache
    cache.conv, cache.temporal = cache.conv[:, :0], cache.temporal[:, :0]
    with pytest.raises(MambaStateError, match="the manager's states hold no bytes"):
        mamba_state_pools(m)
    m = v1_manager(1, 0)
    m._impl.mamba_cache.temporal.untyped_storage().resize_(0)  # shutdown() frees the pools
    with pytest.raises(MambaStateError, match=r"mamba_cache.temporal \[3, 5, 4, 4, 4\] has no memory"):
        mamba_state_pools(m)
    v2 = v2_manager(1)
    v2.all_conv_states[1].untyped_storage().resize_(0)  # every layer's view of one pool
    with pytest.raises(MambaStateError, match=r"all_conv_states\[0\] \[5, 32, 3\] has no memory"):
        mamba_state_pools(v2)
    v2 = v2_manager(1)
    v2.all_ssm_states = [t[:4] for t in v2.all_ssm_states]
    with pytest.raises(
        MambaStateError, match=r"the ssm state \[4, 4, 4, 4\] .* the same slots on one device"
    ):
        mamba_state_pools(v2)


def test_cpp_metadata_that_is_no_tp_share_says_which() -> None:
    """The metadata's own refusals come before its sections are compared with the views."""
    m = cpp_manager(2, 0)
    m.linear_attention_metadata.rnn_d_state = 0
    with pytest.raises(MambaStateError, match=r"rnn_d_state 0\) is not what CppMambaHybridCacheManager sets"):
        mamba_state_pools(m)
    for field, value in (("rnn_d_state", 3), ("rnn_n_groups", 1)):
        # d_state 3: sections of 6 channels are no share of TP 2; n_groups 1: fewer channels than the views
        m = cpp_manager(2, 0)
        setattr(m.linear_attention_metadata, field, value)
        with pytest.raises(
            MambaStateError, match=r"are no TP share of the model its linear_attention_metadata"
        ):
            mamba_state_pools(m)
