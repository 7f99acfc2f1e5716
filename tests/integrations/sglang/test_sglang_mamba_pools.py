"""SGLang's Mamba state pools: a request's state between the device pool and HiCache's
host pool, between two instances, and between TP degrees.

The oracle knows nothing of kvlayout's page arrays: it builds the whole model's state
(TP 1) at random and cuts each rank's slices out of it by the model's sub-projections
(:func:`kvlayout.testing.sglang.shard`), as SGLang shards the weights; every destination
byte is checked against it, and every byte outside the request's slots must stay zero.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvlayout
from kvlayout.detection import DetectionError
from kvlayout.integrations.sglang import MambaPoolError, mamba_state_pools
from kvlayout.registration.peers import RegistrationDescription
from kvlayout.testing.sglang import (
    QWEN3_NEXT,
    LinearModel,
    device_pool,
    elastic_mamba_pool,
    host_pool,
    shard,
    unified_device_pool,
)
from kvlayout.transfer import BlockMapError, Shard, block_map

HEADS = 8  # the model's attention KV heads: a state page reads only the rank and the degree
MODELS = {
    # Q and K (4 key heads of 4) narrower than V (8 heads of 6): a split in another order moves other bytes
    "mamba2": LinearModel("mamba2", num_layers=3, num_heads=8, head_dim=6, state_size=4, n_groups=4),
    "gdn": LinearModel("gdn_attn", num_layers=3, num_heads=8, head_dim=6, state_size=4, n_groups=4),
    "kda": LinearModel("kda", num_layers=2, num_heads=4, head_dim=8, state_size=2, n_groups=4),
    "kda fused": LinearModel(
        "kda", num_layers=2, num_heads=4, head_dim=8, state_size=2, n_groups=4, fused=True
    ),
}
SLOTS = 6


def states(pool: object) -> list[torch.Tensor]:
    cache = pool.mamba_cache  # type: ignore[attr-defined]
    return [*cache.conv, cache.temporal]


def whole_state(model: LinearModel, seed: int) -> list[torch.Tensor]:
    return states(device_pool(model, 1, SLOTS, generator=torch.Generator().manual_seed(seed)))


def rank_pool(model: LinearModel, tp: int, rank: int, whole: list[torch.Tensor] | None) -> object:
    pool = device_pool(model, tp, SLOTS)
    if whole is not None:
        for t, part in zip(states(pool), shard(model, whole, tp, rank), strict=True):
            t.copy_(part)
    return pool


def move(
    src: object, dst: object, src_slot: int, dst_slot: int, model: str, shards: tuple[Shard, Shard]
) -> int:
    """Every state of one request from src's slot into dst's; the runs it took."""
    mamba_type = MODELS[model].mamba_type
    a, b = mamba_state_pools(src, mamba_type), mamba_state_pools(dst, mamba_type)
    assert a.keys() == b.keys()
    runs = 0
    for name in a:
        m = block_map(a[name], b[name], [src_slot], [dst_slot], src_shard=shards[0], dst_shard=shards[1])
        m.copy()
        runs += m.num_runs
    return runs


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("tps", [(a, b) for a in (1, 2, 4) for b in (1, 2, 4)], ids=str)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slots=st.tuples(st.integers(0, SLOTS), st.integers(0, SLOTS)), seed=st.integers(0, 2**16))
def test_state_moves_between_tp_degrees_as_sglang_shards_it(
    model: str, tps: tuple[int, int], slots: tuple[int, int], seed: int
) -> None:
    """Every destination rank gathers its slices from every source rank (a rank that
    holds none of them gets an empty map); no byte outside its slot changes."""
    spec = MODELS[model]
    whole = whole_state(spec, seed)
    src_tp, dst_tp = tps
    sources = [rank_pool(spec, src_tp, r, whole) for r in range(src_tp)]
    for d in range(dst_tp):
        dst = rank_pool(spec, dst_tp, d, None)
        for s, src in enumerate(sources):
            move(src, dst, slots[0], slots[1], model, (Shard(s, src_tp, HEADS), Shard(d, dst_tp, HEADS)))
        for got, want in zip(states(dst), shard(spec, whole, dst_tp, d), strict=True):
            assert torch.equal(got[:, slots[1]], want[:, slots[0]])
            others = [i for i in range(SLOTS + 1) if i != slots[1]]
            assert not got[:, others].any()


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_backup_and_load_through_every_host_layout(model: str, layout: str) -> None:
    """A backup (device to host) lands where SGLang's host pool indexes a slot (``[l, h]``
    layer first, ``[h, l, 0]`` page first); a load brings it back into other slots."""
    spec = MODELS[model]
    device = device_pool(spec, 2, SLOTS, generator=torch.Generator().manual_seed(5))
    host = host_pool(device, 4, layout)
    shards = (Shard(1, 2, HEADS), Shard(1, 2, HEADS))
    move(device, host, 5, 2, model, shards)
    move(device, host, 1, 0, model, shards)
    buffers = [*host.conv_buffer, host.temporal_buffer]
    for dev, buf in zip(states(device), buffers, strict=True):
        for d, h in ((5, 2), (1, 0)):
            at_host = buf[:, h] if layout == "layer_first" else buf[h, :, 0]
            assert torch.equal(at_host, dev[:, d])
        untouched = [1, 3]
        assert not (buf[:, untouched] if layout == "layer_first" else buf[untouched]).any()
    loaded = device_pool(spec, 2, SLOTS)
    move(host, loaded, 2, 3, model, shards)
    for dev, back in zip(states(device), states(loaded), strict=True):
        assert torch.equal(back[:, 3], dev[:, 5])


def test_qwen3_next_runs_between_tp_1_and_tp_2() -> None:
    """Qwen3-Next's conv state ``(dim, 3)`` is Q | K | V, each split on its own: rank 1 of
    2 takes three runs a layer from the TP 1 conv state (each slice's three window rows
    together) and one from the SSM state (its 16 heads)."""
    model = LinearModel("gdn_attn", num_layers=4, num_heads=32, head_dim=128, state_size=128, n_groups=16)
    src, dst = device_pool(model, 1, 2), device_pool(model, 2, 2)
    a, b = mamba_state_pools(src, "gdn_attn"), mamba_state_pools(dst, "gdn_attn")
    conv = block_map(a["conv0"], b["conv0"], [1], [2], src_shard=Shard(0, 1, 2), dst_shard=Shard(1, 2, 2))
    ssm = block_map(
        a["temporal"], b["temporal"], [1], [2], src_shard=Shard(0, 1, 2), dst_shard=Shard(1, 2, 2)
    )
    assert (conv.kind, conv.num_runs, ssm.num_runs) == ("resharded state", 3 * 4, 4)
    assert conv.num_bytes == 4 * (1024 + 1024 + 2048) * 3 * 2  # bf16, three window rows
    assert ssm.num_bytes == 4 * 16 * 128 * 128 * 4  # fp32
    assert QWEN3_NEXT.state_shapes(2) == ([(4096, 3)], (16, 128, 128))


def test_pools_read_as_sglang_allocates_them() -> None:
    spec = MODELS["kda"]
    device = device_pool(spec, 1, SLOTS)
    pools = mamba_state_pools(device, "kda")
    assert list(pools) == ["conv0", "conv1", "conv2", "temporal"]
    for name, t in zip(pools, states(device), strict=True):
        group = pools[name].kernel_groups[0]
        assert group.block_size == 1 and group.opaque_pages is not None
        assert group.num_blocks == SLOTS + 1  # slot 0, the padding's, included
        assert pools[name].registered_kv.data_ptr() == t.data_ptr()  # a view: no copy
    req_pool = type("HybridReqToTokenPool", (), {"mamba_pool": device})()
    assert list(mamba_state_pools(req_pool)) == list(pools)


def test_a_description_carries_the_state_arrays_to_a_peer() -> None:
    spec = MODELS["gdn"]
    src, dst = rank_pool(spec, 1, 0, whole_state(spec, 3)), device_pool(spec, 2, SLOTS)
    a, b = mamba_state_pools(src, "gdn_attn"), mamba_state_pools(dst, "gdn_attn")
    peer = RegistrationDescription.from_json(b["conv0"].describe(shard=Shard(0, 2, HEADS)).to_json())
    m = block_map(a["conv0"], peer, [4], [1], src_shard=Shard(0, 1, HEADS), dst_shard=Shard(0, 2, HEADS))
    local = block_map(
        a["conv0"], b["conv0"], [4], [1], src_shard=Shard(0, 1, HEADS), dst_shard=Shard(0, 2, HEADS)
    )
    assert m.kind == "resharded state"
    assert (m.runs == local.runs).all()


def test_cpu_amx_conv_state_reads_in_its_memory_order() -> None:
    """SGLang's CPU AMX kernels store each slot's conv state ``(dim, K - 1)`` as ``(K - 1,
    dim)`` under the same shape (``_init_amx_conv_state``): it reads, and moves between
    TP degrees, in that order."""
    spec = MODELS["mamba2"]
    whole = whole_state(spec, 9)

    def amx(pool: object) -> object:
        conv = pool.mamba_cache.conv[0]  # type: ignore[attr-defined]
        physical = conv.transpose(-1, -2).contiguous()
        pool.mamba_cache.conv[0] = physical.transpose(-1, -2)  # type: ignore[attr-defined]
        return pool

    src = amx(rank_pool(spec, 1, 0, whole))
    dst = amx(device_pool(spec, 2, SLOTS))
    move(src, dst, 3, 4, "mamba2", (Shard(0, 1, HEADS), Shard(1, 2, HEADS)))
    for got, want in zip(states(dst), shard(spec, whole, 2, 1), strict=True):
        assert torch.equal(got[:, 4], want[:, 3])


def test_a_state_without_bytes_is_left_out() -> None:
    """LFM2's short convolutions have an SSM state of no elements (state size 0)."""
    device = device_pool(MODELS["mamba2"], 1, SLOTS)
    device.mamba_cache.temporal = torch.zeros(3, SLOTS + 1, 8, 6, 0)
    assert list(mamba_state_pools(device)) == ["conv0"]


def _pool_error(pool: object, mamba_type: str | None = None) -> str:
    with pytest.raises(MambaPoolError) as caught:
        mamba_state_pools(pool, mamba_type)
    return str(caught.value)


def test_a_state_tensor_given_to_detect_says_where_it_is_read() -> None:
    with pytest.raises(
        DetectionError, match=r"a Mamba state pool's tensors are read by kvlayout\.integrations\.sglang"
    ):
        kvlayout.detect(device_pool(MODELS["gdn"], 1, SLOTS).mamba_cache.temporal, "sglang")


def test_what_is_not_a_pool_is_refused_by_name() -> None:
    assert "object is not an SGLang Mamba pool: a MambaPool (mamba_cache.conv" in _pool_error(object())
    host = host_pool(device_pool(MODELS["gdn"], 1, SLOTS), 4, "page_first")
    host.layout = "page_head"
    assert "the host pool's layout is 'page_head', not one of layer_first, page_first" in _pool_error(host)
    flat = host_pool(device_pool(MODELS["gdn"], 1, SLOTS), 4, "layer_first")
    flat.layout = "page_first"
    assert "conv0 state is [3, 4, 80, 3], not [size, NL, 1, *state] (page_first pool)" in _pool_error(flat)


def test_a_mamba_type_that_does_not_fit_is_refused() -> None:
    device = device_pool(MODELS["mamba2"], 1, SLOTS)
    assert "mamba_type 'mamba1' is not one of mamba2, gdn_attn, kda (or None)" in _pool_error(
        device, "mamba1"
    )
    assert "the conv state [80, 3] does not split into kda's three projections" in _pool_error(device, "kda")
    kda = device_pool(MODELS["kda"], 1, SLOTS)
    assert "a gdn_attn pool has 1 conv state(s) of 2 axes" in _pool_error(kda, "gdn_attn")


def _shaped(
    conv: tuple[int, ...], ssm: tuple[int, ...], convs: int = 1, dtype: torch.dtype = torch.float32
) -> object:
    """A device pool of 2 layers and 4 slots with the given states, as SGLang would hold them."""
    cache = SimpleNamespace(
        conv=[torch.zeros(2, 5, *conv, dtype=dtype) for _ in range(convs)], temporal=torch.zeros(2, 5, *ssm)
    )
    return SimpleNamespace(mamba_cache=cache)


@pytest.mark.parametrize(
    ("mamba_type", "pool", "message"),
    [
        # Mamba2 with one head of one: any odd dim is x | B | C, on either axis
        ("mamba2", _shaped((5, 3), (1, 1, 1)), "the conv state [5, 3] does not split into mamba2's x, B, C "
         "beside the SSM state [1, 1, 1] (on both axes)"),
        # B and C of 16 are no whole groups of a 5-wide state
        ("mamba2", _shaped((80, 3), (8, 6, 5)), "the conv state [80, 3] does not split into mamba2's x, B, C "
         "beside the SSM state [8, 6, 5] (on neither axis)"),
        ("mamba2", _shaped((80, 3), (8, 48)), "a mamba2 pool has 1 conv state(s) of 2 axes and an SSM state of 3"),
        ("kda", _shaped((3, 32), (4, 8, 8), convs=2), "a kda pool has 1 or 3 conv state(s)"),
        # KDA's one conv state: V (4 heads of 8) and two equal K projections, not 1 or 0 more
        ("kda", _shaped((3, 33), (4, 8, 8)), "the conv state [3, 33] does not split into kda's three projections"),
        ("kda", _shaped((3, 32), (4, 8, 8)), "the conv state [3, 32] does not split into kda's three projections"),
        (None, _shaped((80, 3), (8, 6, 4), dtype=torch.complex64), "the pool's conv0 state is complex64, which "
         "kvlayout does not know"),
    ],
)  # fmt: skip
def test_states_that_do_not_split_as_their_type_says_are_refused(
    mamba_type: str | None, pool: object, message: str
) -> None:
    assert message in _pool_error(pool, mamba_type)


def test_only_a_conv_state_reads_transposed() -> None:
    """An SSM state stored in another order than its shape is no SGLang allocation: refused,
    not read in the order that would give the conv state other parts."""
    pool = _shaped((80, 3), (8, 6, 4))
    pool.mamba_cache.temporal = torch.zeros(2, 5, 8, 4, 6).transpose(-1, -2)  # type: ignore[attr-defined]
    assert (
        "temporal state [2, 5, 8, 6, 4] (strides [960, 192, 24, 1, 6]) is not one contiguous"
        in _pool_error(pool, "mamba2")
    )
    host = SimpleNamespace(conv_buffer=[], temporal_buffer=torch.zeros(1, 2, 1, 4), layout=["page_first"])
    assert "the host pool's layout is ['page_first'], not one of" in _pool_error(host)


def test_a_strided_or_ragged_pool_is_refused() -> None:
    device = device_pool(MODELS["gdn"], 1, SLOTS)
    device.mamba_cache.temporal = torch.zeros(3, SLOTS + 1, 8, 6, 8)[..., ::2]
    assert (
        "temporal state [3, 7, 8, 6, 4] (strides [2688, 384, 48, 8, 2]) is not one contiguous"
        in _pool_error(device)
    )
    device.mamba_cache.temporal = torch.zeros(2, SLOTS + 1, 8, 6, 4)
    assert "temporal state is [2, 7, 8, 6, 4], whose axis 0 is not its 3 Mamba layers" in _pool_error(device)
    del device.num_mamba_layers
    assert "temporal state is [2, 7, 8, 6, 4] on cpu and its conv0 state [3, 7, 80, 3]" in _pool_error(device)
    # a state of no slots beside one of 7 is refused, not left out as a state of no elements is
    device.mamba_cache.temporal = torch.zeros(3, SLOTS + 1, 8, 6, 4)
    device.mamba_cache.conv[0] = torch.zeros(3, 0, 80, 3)
    assert "temporal state is [3, 7, 8, 6, 4] on cpu and its conv0 state [3, 0, 80, 3]" in _pool_error(device)


def test_maps_refuse_other_states_and_replicated_groups() -> None:
    spec = MODELS["mamba2"]
    a = mamba_state_pools(device_pool(spec, 1, SLOTS), "mamba2")
    with pytest.raises(
        BlockMapError, match=r"do not hold the same state: state array 0 is bfloat16 \[80, 3\]"
    ):
        block_map(a["conv0"], a["temporal"], [1], [2])
    untyped = mamba_state_pools(device_pool(spec, 1, SLOTS))
    with pytest.raises(
        BlockMapError, match=r"laid out differently \(src SGLang Mamba conv0: bfloat16 \[80, 3\]"
    ):
        block_map(untyped["conv0"], untyped["temporal"], [1], [2])
    # two groups over TP 4: SGLang pads them to 4, each rank's B and C replicated, not sharded
    few = LinearModel("mamba2", num_layers=1, num_heads=8, head_dim=2, state_size=4, n_groups=2)
    one = mamba_state_pools(device_pool(few, 1, 2), "mamba2")
    four = mamba_state_pools(device_pool(few, 4, 2), "mamba2")
    with pytest.raises(BlockMapError, match="replicated rather than sharded"):
        block_map(one["conv0"], four["conv0"], [1], [1], src_shard=Shard(0, 1, 8), dst_shard=Shard(1, 4, 8))
    # two models' conv states of one shape, split otherwise: neither shards nor one TP degree help
    other = LinearModel("mamba2", num_layers=3, num_heads=4, head_dim=8, state_size=8, n_groups=3)
    mine, theirs = (
        mamba_state_pools(device_pool(spec, 1, 2), "mamba2"),
        mamba_state_pools(device_pool(other, 1, 2), "mamba2"),
    )
    for shard_of in (None, Shard(0, 1, 8)):
        with pytest.raises(
            BlockMapError,
            match=r"of the same shapes in other parts \(src bfloat16 \[80, 3\].*: not one model",
        ):
            block_map(mine["conv0"], theirs["conv0"], [1], [1], src_shard=shard_of, dst_shard=shard_of)
    fewer = LinearModel("mamba2", num_layers=3, num_heads=6, head_dim=6, state_size=4, n_groups=4)  # 6 heads
    at_2 = [mamba_state_pools(device_pool(m, 2, 2), "mamba2")["temporal"] for m in (spec, fewer)]
    with pytest.raises(
        BlockMapError, match="both at TP 2: its part 0 is 4 and 3 long, so the pages are not one"
    ):
        block_map(at_2[0], at_2[1], [1], [1], src_shard=Shard(0, 2, 8), dst_shard=Shard(1, 2, 8))
    assert math.prod(four["conv0"].registered_kv.shape) > 0


def test_state_moves_to_a_peer_of_another_tp_degree_through_nixl() -> None:
    """Prefill at TP 1 WRITEs each state of one request to decode rank 1 of 2 through
    NIXL (two agents in this process, UCX on loopback), planned against the decode
    side's description; decode then holds its slices, nothing else changed."""
    from kvlayout.transfer import nixl as nx

    spec = MODELS["mamba2"]
    whole = whole_state(spec, 11)
    src, dst = rank_pool(spec, 1, 0, whole), device_pool(spec, 2, SLOTS)
    a, b = mamba_state_pools(src, "mamba2"), mamba_state_pools(dst, "mamba2")
    prefill, decode = nx.make_agent("sglang-state-prefill"), nx.make_agent("sglang-state-decode")
    held = [(nx.register(prefill, a[n]), nx.register(decode, b[n])) for n in a]
    peer = prefill.add_remote_agent(decode.get_agent_metadata())
    staging = nx.Staging(prefill, 1 << 20)
    for name in a:
        there = RegistrationDescription.from_json(b[name].describe(shard=Shard(1, 2, HEADS)).to_json())
        m = block_map(a[name], there, [2], [4], src_shard=Shard(0, 1, HEADS))
        assert nx.transfer(prefill, peer, m, staging=staging).wait(timeout=60).num_bytes == m.num_bytes
    for got, want in zip(states(dst), shard(spec, whole, 2, 1), strict=True):
        assert torch.equal(got[:, 4], want[:, 2])
        assert not got[:, [i for i in range(SLOTS + 1) if i != 4]].any()
    assert len(held) == 2


@pytest.mark.parametrize("layers", [1, None], ids=["one layer", "the model's"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_unified_pool_reads_slot_major(model: str, layers: int | None) -> None:
    """SGLang's unified memory pool keeps a slot's state of every layer in one envelope
    (every layer of each state, then other states' bytes): its views read slots first, a
    slot's layers one run; a request's state moves into a plain pool at another TP degree
    and back into another slot, and nothing else of the envelope buffer changes."""
    spec = MODELS[model] if layers is None else dataclasses.replace(MODELS[model], num_layers=layers)
    unified = unified_device_pool(spec, 1, 5, pad=24, generator=torch.Generator().manual_seed(4))
    before = unified.raw.clone()
    pools = mamba_state_pools(unified, spec.mamba_type)
    assert all(r.format.name == "NB_BS_NL_ONE_HS" for r in pools.values())
    whole = states(unified)
    for d in range(2):
        plain = rank_pool(spec, 2, d, None)
        runs = move(unified, plain, 3, 1, model, (Shard(0, 1, HEADS), Shard(d, 2, HEADS)))
        assert runs > 0
        for got, want in zip(states(plain), shard(spec, whole, 2, d), strict=True):
            assert torch.equal(got[:, 1], want[:, 3])
    same = states(unified)
    copies = mamba_state_pools(unified, spec.mamba_type)
    for name in copies:
        m = block_map(copies[name], copies[name], [3], [0])
        assert m.num_runs == 1  # a slot's layers, one after another in its envelope
        m.copy()
    moved = [t[:, 0].clone() for t in same]
    for got, t in zip(moved, same, strict=True):
        assert torch.equal(got, t[:, 3])
    envelope = unified.raw.numel() // 5
    assert torch.equal(unified.raw[envelope:], before[envelope:])  # slots 1-4, padding included
    assert torch.equal(unified.raw[envelope - 24 : envelope], before[envelope - 24 : envelope])


def _elastic_states(pool: object) -> list[list[torch.Tensor]]:
    """Each state of kvcached's per-layer pool, a tensor a layer."""
    cache = pool.mamba_cache  # type: ignore[attr-defined]
    return [*cache.conv_per_layer, cache.temporal_per_layer]


def _with_slot(
    pool: object, before: list[torch.Tensor], slot: int, want: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The oracle on kvcached's byte buffers: ``before`` (the pool's buffers, cloned) with
    each state's item of ``slot`` in each layer set to ``want`` (``[NL, *state]``), written
    through the pool's own geometry, every other byte (other slots, the cell's padding)
    as it was."""
    expected = [b.clone() for b in before]
    for layers, whole in zip(_elastic_states(pool), want, strict=True):
        for layer, t in enumerate(layers):
            buffer = expected[layer].view(t.dtype)
            torch.as_strided(buffer, t.shape, t.stride(), t.storage_offset())[slot] = whole[layer]
    return expected


@pytest.mark.parametrize("model", sorted(MODELS))
def test_kvcached_per_layer_pool_moves_to_a_plain_pool_and_back(model: str) -> None:
    """kvcached's non-contiguous ``ElasticMambaPool`` (a buffer per layer, each slot's
    states of one layer packed in one padded cell): each state reads as its layers'
    tensors, slot ids as SGLang's; a request's state moves byte-exact into SGLang's plain
    ``MambaPool`` and back into another slot, and no other byte of kvcached's buffers
    (other slots, the cells' padding) changes."""
    spec = MODELS[model]
    elastic = elastic_mamba_pool(
        spec, 1, SLOTS, contiguous=False, pad=10, generator=torch.Generator().manual_seed(7)
    )
    pools = mamba_state_pools(elastic, spec.mamba_type)
    assert list(pools) == [f"conv{i}" for i in range(len(spec.state_shapes(1)[0]))] + ["temporal"]
    for name, layers in zip(pools, _elastic_states(elastic), strict=True):
        group = pools[name].kernel_groups[0]
        assert (group.block_size, group.num_blocks, group.opaque_pages is not None) == (1, SLOTS + 1, True)
        views = pools[name].registered_kv
        assert [v.data_ptr() for v in views] == [t.data_ptr() for t in layers]  # views: no copy
    whole = [torch.stack(layers) for layers in _elastic_states(elastic)]
    plain = device_pool(spec, 1, SLOTS)
    move(elastic, plain, 4, 2, model, (Shard(0, 1, HEADS), Shard(0, 1, HEADS)))
    for got, want in zip(states(plain), whole, strict=True):
        assert torch.equal(got[:, 2], want[:, 4])
        assert not got[:, [i for i in range(SLOTS + 1) if i != 2]].any()
    before = [r.clone() for r in elastic.raw]
    move(plain, elastic, 2, 1, model, (Shard(0, 1, HEADS), Shard(0, 1, HEADS)))
    expected = _with_slot(elastic, before, 1, [w[:, 4] for w in whole])
    for got, want in zip(elastic.raw, expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_kvcached_per_layer_pool_moves_between_tp_degrees(model: str) -> None:
    """TP 1 into TP 2 with the model's Mamba type: a plain TP 1 pool's request state
    lands in each rank's kvcached per-layer pool as SGLang shards it, and a per-layer TP
    1 pool's in each rank's plain pool; nothing else of the destination changes."""
    spec = MODELS[model]
    whole = whole_state(spec, 21)
    source = rank_pool(spec, 1, 0, whole)
    elastic_src = elastic_mamba_pool(
        spec, 1, SLOTS, contiguous=False, pad=6, generator=torch.Generator().manual_seed(8)
    )
    elastic_whole = [torch.stack(layers) for layers in _elastic_states(elastic_src)]
    for d in range(2):
        shards = (Shard(0, 1, HEADS), Shard(d, 2, HEADS))
        dst = elastic_mamba_pool(
            spec, 2, SLOTS, contiguous=False, pad=6, generator=torch.Generator().manual_seed(d)
        )
        before = [r.clone() for r in dst.raw]
        assert move(source, dst, 3, 5, model, shards) > 0
        want = [w[:, 3] for w in shard(spec, whole, 2, d)]
        for got, expected in zip(dst.raw, _with_slot(dst, before, 5, want), strict=True):
            assert torch.equal(got, expected)
        plain = rank_pool(spec, 2, d, None)
        move(elastic_src, plain, 6, 1, model, shards)
        for got, cut in zip(states(plain), shard(spec, elastic_whole, 2, d), strict=True):
            assert torch.equal(got[:, 1], cut[:, 6])
            assert not got[:, [i for i in range(SLOTS + 1) if i != 1]].any()


def test_kvcached_per_layer_pool_backs_up_to_a_host_pool() -> None:
    """A kvcached per-layer pool's slot backs up into HiCache's host pool (page first),
    one run a layer."""
    spec = MODELS["gdn"]
    elastic = elastic_mamba_pool(spec, 1, SLOTS, contiguous=False, generator=torch.Generator().manual_seed(2))
    host = host_pool(device_pool(spec, 1, SLOTS), 4, "page_first")
    a, h = mamba_state_pools(elastic, "gdn_attn"), mamba_state_pools(host, "gdn_attn")
    for name in a:
        m = block_map(a[name], h[name], [3], [2])
        assert m.num_runs == spec.num_layers
        m.copy()
    for buf, layers in zip([*host.conv_buffer, host.temporal_buffer], _elastic_states(elastic), strict=True):
        assert torch.equal(buf[2, :, 0], torch.stack(layers)[:, 3])
        assert not buf[[0, 1, 3]].any()


@pytest.mark.parametrize("model", sorted(MODELS))
def test_kvcached_contiguous_pool_reads_slot_major(model: str) -> None:
    """kvcached's contiguous ``ElasticMambaPool`` (``KVCACHED_CONTIGUOUS_LAYOUT``): one
    buffer ``[slot][layer][cell]``, each state a ``[NL, size + 1, *state]`` view strided
    over the cells, so a slot's layers are a cell of every state apart: no one tensor of
    rows, each layer reads as its own ``[size + 1]`` view. A request's state moves into a
    plain pool at TP 2 and back, the buffer's other bytes (the cells' other states, their
    padding) kept."""
    spec = MODELS[model]
    elastic = elastic_mamba_pool(
        spec, 1, SLOTS, contiguous=True, pad=12, generator=torch.Generator().manual_seed(3)
    )
    pools = mamba_state_pools(elastic, spec.mamba_type)
    assert all(r.format.name == "NL_X_NB_BS_HS" for r in pools.values())
    assert all(r.kernel_groups[0].num_blocks == SLOTS + 1 for r in pools.values())
    whole = states(elastic)
    for d in range(2):
        plain = rank_pool(spec, 2, d, None)
        move(elastic, plain, 2, 4, model, (Shard(0, 1, HEADS), Shard(d, 2, HEADS)))
        for got, want in zip(states(plain), shard(spec, whole, 2, d), strict=True):
            assert torch.equal(got[:, 4], want[:, 2])
    before = elastic.raw[0].clone()
    saved = [t[:, 2].clone() for t in whole]
    back = device_pool(spec, 1, SLOTS)
    move(elastic, back, 2, 2, model, (Shard(0, 1, HEADS), Shard(0, 1, HEADS)))
    move(back, elastic, 2, 5, model, (Shard(0, 1, HEADS), Shard(0, 1, HEADS)))
    expected = before.clone()
    for t, w in zip(whole, saved, strict=True):
        torch.as_strided(expected.view(t.dtype), t.shape, t.stride(), t.storage_offset())[:, 5] = w
    assert torch.equal(elastic.raw[0], expected)


def test_a_per_layer_pool_out_of_shape_is_refused() -> None:
    """kvcached's per-layer pool whose lists do not hold every layer alike is refused,
    naming the state and the layer; ``conv`` and ``temporal`` (layer 0's alone) are never
    read for it."""
    spec = MODELS["gdn"]

    def pool() -> object:
        return elastic_mamba_pool(spec, 1, SLOTS, contiguous=False)

    short = pool()
    short.mamba_cache.temporal_per_layer.pop()  # type: ignore[attr-defined]
    assert "temporal state has 2 per-layer tensors, not 3: its Mamba layers" in _pool_error(short)
    odd = pool()
    odd.mamba_cache.conv_per_layer[0][2] = torch.zeros(SLOTS + 1, 80, 2, dtype=torch.bfloat16)  # type: ignore[attr-defined]
    assert "conv0 state of layer 2 is [7, 80, 2] torch.bfloat16 on cpu, of layer 0 [7, 80, 3]" in _pool_error(
        odd
    )
    flat = pool()
    flat.mamba_cache.conv_per_layer = [torch.zeros(SLOTS + 1, 80, 3)]  # type: ignore[attr-defined]
    assert "mamba_cache.conv_per_layer is list of Tensor, not a list of per-layer lists" in _pool_error(flat)
    strided = pool()
    strided.mamba_cache.temporal_per_layer[1] = torch.zeros(SLOTS + 1, 8, 6, 8)[..., ::2]  # type: ignore[attr-defined]
    assert (
        "temporal state of layer 1 [7, 8, 6, 4] (strides [384, 48, 8, 2]) is not one contiguous"
        in _pool_error(strided)
    )
    assert "the conv state [80, 3] does not split into kda's three projections" in _pool_error(pool(), "kda")


def test_states_of_one_shape_in_dtypes_of_the_same_bytes_move_without_shards() -> None:
    """An fp8 conv state and one SGLang keeps as uint8 are the same bytes: the map moves
    them whole, rank to rank, with no shards to give."""
    spec = MODELS["gdn"]
    src = mamba_state_pools(_shaped((80, 3), (8, 6, 4), dtype=torch.float8_e4m3fn), "gdn_attn")
    raw = _shaped((80, 3), (8, 6, 4), dtype=torch.uint8)
    dst = mamba_state_pools(raw, "gdn_attn")
    source = src["conv0"].registered_kv
    source.view(torch.uint8).copy_(torch.randint(0, 256, source.shape, dtype=torch.uint8))
    m = block_map(src["conv0"], dst["conv0"], [3], [1])
    assert m.kind == "re-laid" and spec.mamba_type == "gdn_attn"
    m.copy()
    got = raw.mamba_cache.conv[0]  # type: ignore[attr-defined]
    assert torch.equal(got[:, 1].view(torch.uint8).flatten(), source[:, 3].view(torch.uint8).flatten())


def test_a_pool_of_no_bytes_is_refused_naming_its_states() -> None:
    """A pool whose states all hold no elements, or of no slots, has nothing to read:
    refused with each state's shape, in either kind of pool."""
    empty = device_pool(MODELS["gdn"], 1, SLOTS)
    empty.mamba_cache.conv[0] = torch.zeros(3, SLOTS + 1, 80, 0)
    empty.mamba_cache.temporal = torch.zeros(3, SLOTS + 1, 8, 6, 0)
    assert "states hold no bytes (conv0 [3, 7, 80, 0], temporal [3, 7, 8, 6, 0])" in _pool_error(empty)
    no_slots = device_pool(MODELS["gdn"], 1, SLOTS)
    no_slots.mamba_cache.conv[0] = torch.zeros(3, 0, 80, 3)
    no_slots.mamba_cache.temporal = torch.zeros(3, 0, 8, 6, 4)
    assert "states hold no bytes (conv0 [3, 0, 80, 3], temporal [3, 0, 8, 6, 4])" in _pool_error(no_slots)
    elastic = elastic_mamba_pool(MODELS["gdn"], 1, SLOTS, contiguous=False)
    cache = elastic.mamba_cache
    cache.conv_per_layer[0] = [torch.zeros(0, 80, 3) for _ in range(3)]
    cache.temporal_per_layer = [torch.zeros(0, 8, 6, 4) for _ in range(3)]
    assert "states hold no bytes (a layer's conv0 [0, 80, 3], temporal [0, 8, 6, 4])" in _pool_error(elastic)


def test_a_per_layer_pool_of_unlike_states_is_refused() -> None:
    """kvcached's per-layer states must hold the same slots on one device, and a state
    must read in one memory order in every layer (a conv state transposed in one layer
    only is refused, not read as two layouts)."""
    spec = MODELS["gdn"]
    other = elastic_mamba_pool(spec, 1, SLOTS, contiguous=False)
    other.mamba_cache.temporal_per_layer = [torch.zeros(SLOTS, 8, 6, 4) for _ in range(3)]
    assert (
        "temporal state is [6, 8, 6, 4] on cpu a layer and its conv0 state [7, 80, 3] on cpu a layer: the "
        "same slots" in _pool_error(other)
    )
    mixed = elastic_mamba_pool(spec, 1, SLOTS, contiguous=False)
    conv = mixed.mamba_cache.conv_per_layer[0]
    conv[1] = torch.zeros(SLOTS + 1, 3, 80, dtype=conv[0].dtype).transpose(1, 2)
    assert "conv0 state reads in other orders in other layers ([(3, 80), (80, 3)])" in _pool_error(mixed)


def test_a_kv_replica_still_sends_its_state_slices() -> None:
    """With fewer KV heads than prefill ranks (2 heads at TP 4) ``sends_to`` leaves the
    KV to one replica, but each state slice is one rank's: the rank that sends no KV to a
    decode rank holds half of that rank's state, so the state maps go from every pair
    (as pd-connectors.md says), and a connector gating them by ``sends_to`` would leave
    decode rank 0 half a state."""
    spec, kv_heads = MODELS["gdn"], 2
    whole = whole_state(spec, 7)
    sources = [rank_pool(spec, 4, r, whole) for r in range(4)]
    for gated in (False, True):
        for d in range(2):
            dst = rank_pool(spec, 2, d, None)
            for s, src in enumerate(sources):
                src_shard, dst_shard = Shard(s, 4, kv_heads), Shard(d, 2, kv_heads)
                if gated and not src_shard.sends_to(dst_shard):
                    continue
                move(src, dst, 1, 4, "gdn", (src_shard, dst_shard))
            complete = all(
                torch.equal(got[:, 4], want[:, 1])
                for got, want in zip(states(dst), shard(spec, whole, 2, d), strict=True)
            )
            assert complete is not gated, (gated, d)
    assert not Shard(1, 4, kv_heads).sends_to(Shard(0, 2, kv_heads))  # rank 1's KV comes from rank 0
