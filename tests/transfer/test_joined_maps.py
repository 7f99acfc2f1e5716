"""Joined maps: a request's block maps (one per kernel group or pool) moved as one, by
``copy()`` or as one NIXL transfer with one notification, as vLLM's NixlConnector posts a
hybrid request (every group's descriptors in one transfer).

Qwen3.5-0.8B in vLLM 0.33 without prefix caching: three Gated DeltaNet state groups and
one attention group over one buffer, prefill at TP 1 into rank 1 of decode at TP 2. Each
group's map has its own block ids; vLLM lays one layer of every group over the same
memory, so a block id names the same bytes in every group, and the scheduler hands each
group its own.
"""

from __future__ import annotations

import ctypes
import json
import logging
import time
from typing import Any, Literal

import numpy as np
import pytest
import torch

import kvlayout
from kvlayout.integrations.vllm import apply_kv_cache_group_edits, transfer_layers
from kvlayout.testing import vllm as vx
from kvlayout.transfer import (
    BlockMap,
    BlockMapError,
    JoinedMap,
    RegistrationDescription,
    Shard,
    block_map,
    join_maps,
)

HINTS = {"kv_layout": "NHD"}
P_SHARD, D_SHARD = Shard(0, 1, 2), Shard(1, 2, 2)
# Per group: (prefill's block ids, decode's, tokens): the state groups one page each.
REQUEST = [([2], [0], None), ([3], [1], None), ([4], [2], None), ([0, 1], [5, 4], 700)]


def instance(tp: int, seed: int | None) -> tuple[Any, torch.Tensor]:
    """A registration of Qwen3.5-0.8B's cache at TP ``tp`` and its one buffer (random
    bytes from ``seed``, or zeros)."""
    engine = vx.hybrid_engine(
        vx.QWEN3_5_0_8B, vx.FLASHINFER, tp=tp, num_blocks=8, mamba_cache_mode="none",
        max_model_len=40960, conv_layout="DS",
    )  # fmt: skip
    buf, views = vx.allocate_v033(engine)
    if seed is not None:
        buf.copy_(
            torch.randint(
                -128, 128, buf.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed)
            )
        )
    kv = apply_kv_cache_group_edits(engine.config, views, HINTS, prefix_reuse=False)
    layers, groups = transfer_layers(engine.config, kv)
    return kvlayout.detect(layers, "vllm", HINTS, layer_groups=groups), buf


def maps(
    src: Any, dst: Any, request: list[tuple[list[int], list[int], int | None]] = REQUEST
) -> list[BlockMap]:
    def group(side: Any, g: int) -> Any:
        return side.group(g) if isinstance(side, RegistrationDescription) else side.kernel_groups[g]

    return [
        block_map(group(src, g), group(dst, g), s, d, num_tokens=n, src_shard=P_SHARD, dst_shard=D_SHARD)
        for g, (s, d, n) in enumerate(request)
    ]


def moved_bytes(runs: np.ndarray, buf: torch.Tensor) -> np.ndarray:
    """A mask over ``buf``'s bytes: those the runs write."""
    mask = np.zeros(buf.numel(), dtype=bool)
    base = buf.data_ptr()
    for _, d, n in runs.tolist():
        mask[d - base : d - base + n] = True
    return mask


def test_a_joined_copy_moves_every_group_s_bytes_and_no_other() -> None:
    (prefill, _), (decode, d_buf) = instance(1, seed=1), instance(2, seed=None)
    parts = maps(prefill, decode)
    joined = join_maps(parts)
    assert isinstance(joined, JoinedMap) and joined.maps == tuple(parts)
    assert [m.kind for m in parts] == ["resharded state"] * 3 + ["head slice"]
    assert joined.num_runs == sum(m.num_runs for m in parts) == len(joined.runs)
    assert joined.num_bytes == sum(m.num_bytes for m in parts)
    assert np.array_equal(joined.runs, np.concatenate([m.runs for m in parts]))
    joined.copy(num_threads=2)
    for s, d, n in joined.runs.tolist():
        assert ctypes.string_at(s, n) == ctypes.string_at(d, n)
    untouched = ~moved_bytes(joined.runs, d_buf)
    assert untouched.sum() > 0 and not d_buf.numpy()[untouched].any()
    # the same bytes as copying each part on its own, into a twin of decode
    twin, twin_buf = instance(2, seed=None)
    for m in maps(prefill, twin):
        m.copy()
    assert torch.equal(twin_buf, d_buf)


def test_join_refuses_maps_that_write_the_same_bytes() -> None:
    """The same block id in two groups is the same memory in vLLM's hybrid layout: the
    two maps would write it both, and the join names the runs and their maps."""
    (prefill, _), (decode, _) = instance(1, seed=1), instance(2, seed=None)
    clash = [REQUEST[0], ([3], [0], None)]  # decode block 0 in groups 0 and 1
    with pytest.raises(
        BlockMapError,
        match=r"run 0 \(maps\[0\]\) is refused: its destination bytes overlap those of run \d+ \(maps\[1\]\)",
    ):
        join_maps(maps(prefill, decode, clash))
    with pytest.raises(BlockMapError, match=r"overlap those of run \d+ \(maps\[1\]\)"):
        join_maps([maps(prefill, decode)[3]] * 2)
    # the same into a peer's description: its addresses are another process's, compared among themselves
    there = RegistrationDescription.from_json(decode.describe(shard=D_SHARD).to_json())
    with pytest.raises(BlockMapError, match=r"run 0 \(maps\[0\]\) is refused: its destination bytes overlap"):
        join_maps(maps(prefill, there, clash))
    assert join_maps(maps(prefill, there)).num_runs == sum(m.num_runs for m in maps(prefill, decode))


def test_join_refuses_a_read_of_what_another_part_writes() -> None:
    """Both ends in this process, one registration: a part that reads bytes another part
    writes would copy what depends on the parts' order."""
    prefill, _ = instance(1, seed=1)
    g = prefill.kernel_groups[3]
    there = block_map(g, g, [0], [1], num_tokens=16)
    back = block_map(g, g, [1], [2], num_tokens=16)  # reads block 1, which `there` writes
    with pytest.raises(BlockMapError, match=r"is refused: it writes bytes run \d+ \(maps\[\d\]\) reads"):
        join_maps([there, back])


def test_join_refuses_mixed_ends_and_what_is_not_a_map() -> None:
    (prefill, _), (decode, _) = instance(1, seed=1), instance(2, seed=None)
    there = RegistrationDescription.from_json(decode.describe(shard=D_SHARD).to_json())
    live, described = maps(prefill, decode)[:1], maps(prefill, there)[1:2]
    with pytest.raises(
        BlockMapError, match=r"maps\[0\]'s dst is in this process but maps\[1\]'s is a peer's description"
    ):
        join_maps(live + described)
    rank0 = RegistrationDescription.from_json(
        instance(2, seed=None)[0].describe(shard=Shard(0, 2, 2)).to_json()
    )
    with pytest.raises(
        BlockMapError, match=r"maps\[1\]'s of one at Shard\(tp_rank=0, tp_size=2.*goes to one peer"
    ):
        to_rank0 = block_map(
            prefill.kernel_groups[3], rank0.group(3), [0, 1], [5, 4], num_tokens=700, src_shard=P_SHARD
        )
        join_maps([maps(prefill, there)[3], to_rank0])  # decode ranks 1 and 0: two peers
    on_gpu1 = json.loads(decode.describe(shard=D_SHARD).to_json())
    on_gpu1["device"] = {"type": "cuda", "index": 1}  # the same peer's pool on another device
    elsewhere = RegistrationDescription.from_json(json.dumps(on_gpu1))
    with pytest.raises(
        BlockMapError, match=r"maps\[0\]'s dst is on cpu but maps\[1\]'s on cuda:1; each end .* one device"
    ):
        join_maps([maps(prefill, there)[0], maps(prefill, elsewhere)[1]])
    with pytest.raises(BlockMapError, match="one block map at least, got none"):
        join_maps([])
    with pytest.raises(TypeError, match=r"maps\[1\] is a list, not a BlockMap"):
        join_maps([live[0], [1, 2]])  # type: ignore[list-item]
    with pytest.raises(
        TypeError, match=r"^join_maps takes an iterable of block maps \(block_map's\), not NoneType"
    ):
        join_maps(None)  # type: ignore[arg-type]


def test_a_joined_copy_checks_every_part_before_copying_any() -> None:
    """The second part's destination was re-allocated in place after the join (its
    storage freed): the copy refuses it, naming it, and the first part copies nothing
    either."""
    (prefill, _), (decode, d_buf) = instance(1, seed=1), instance(2, seed=None)
    other, o_buf = instance(2, seed=None)
    first, second = maps(prefill, decode)[3], maps(prefill, other)[0]
    joined = join_maps([first, second])
    o_buf.untyped_storage().resize_(0)
    with pytest.raises(
        BlockMapError,
        match=r"maps\[1\]: dst: kv_caches\[0\] was re-allocated \(data pointer 0x0, .* nothing was copied",
    ):
        joined.copy()
    assert not d_buf.any()
    there = RegistrationDescription.from_json(decode.describe(shard=D_SHARD).to_json())
    with pytest.raises(BlockMapError, match=r"maps\[0\]: the dst side is a RegistrationDescription"):
        join_maps(maps(prefill, there)).copy()


def test_a_joined_copy_validates_every_part_s_runs_before_copying_any() -> None:
    """A part whose runs validation refuses (groups given to it after the join, here a run
    reading outside every source tensor) is refused before the first part copies a byte:
    the message's "nothing was copied" holds for the joined copy too (the first part
    copied before the second's runs were validated)."""
    from kvlayout import _native

    kv = [torch.randn(2, 8, 4, 2, 16) for _ in range(2)]
    dst_kv = [torch.zeros(2, 8, 4, 2, 16) for _ in range(2)]
    src, dst = (kvlayout.detect(c, "vllm", HINTS) for c in (kv, dst_kv))
    first, second = block_map(src, dst, [0], [2]), block_map(src, dst, [1], [3])
    joined = join_maps([first, second])
    joined.copy()  # both parts' native copies made
    for t in dst_kv:
        t.zero_()
    runs = second.runs.copy()
    runs[0, 0] = 8
    second._groups = _native.group_runs(runs)
    with pytest.raises(
        BlockMapError, match=r"^maps\[1\]: run 0 .* outside every source tensor's blocks; nothing was copied$"
    ):
        joined.copy()
    assert not any(t.any() for t in dst_kv)


@pytest.mark.parametrize("op", ["WRITE", "READ"])
@pytest.mark.parametrize("strategy", ["direct", "staged"])
def test_a_joined_map_is_one_nixl_transfer_with_one_notification(
    op: str, strategy: Literal["direct", "staged"]
) -> None:
    """Two agents in this process (each half of a deployment in its own): the request's
    four maps as one transfer, posted by prefill (WRITE) or by decode (READ, as vLLM's
    decode side posts); the other side receives one notification, and decode's bytes are
    those of the local joined copy."""
    import nixl._api  # noqa: F401  (importing it sets NIXL's logger to INFO)

    from kvlayout.transfer import nixl as nx

    logging.getLogger("nixl").setLevel(logging.WARNING)
    (prefill, _), (decode, d_buf) = instance(1, seed=3), instance(2, seed=None)
    names = f"jm-prefill-{op}-{strategy}", f"jm-decode-{op}-{strategy}"
    p_agent, d_agent = nx.make_agent(names[0]), nx.make_agent(names[1])
    held = nx.register(p_agent, prefill), nx.register(d_agent, decode)
    if op == "WRITE":
        poster, receiver, peer = p_agent, d_agent, p_agent.add_remote_agent(d_agent.get_agent_metadata())
        there = RegistrationDescription.from_json(decode.describe(shard=D_SHARD).to_json())
        joined = join_maps(maps(prefill, there))
    else:
        poster, receiver, peer = d_agent, p_agent, d_agent.add_remote_agent(p_agent.get_agent_metadata())
        there = RegistrationDescription.from_json(prefill.describe(shard=P_SHARD).to_json())
        joined = join_maps(maps(there, decode))
    staging = nx.Staging(poster, joined.num_bytes) if strategy == "staged" else None
    result = nx.transfer(poster, peer, joined, notif=b"req-7", strategy=strategy, staging=staging)
    assert result.wait(timeout=60).num_bytes == joined.num_bytes
    got: dict[str, list[bytes]] = {}
    for _ in range(1000):
        got = receiver.get_new_notifs()
        if got:
            break
        time.sleep(0.01)
    assert got == {names[op == "READ"]: [b"req-7"]}
    twin, twin_buf = instance(2, seed=None)
    join_maps(maps(prefill, twin)).copy()
    assert torch.equal(d_buf, twin_buf) and twin_buf.any()
    result.release()
    if staging is not None:
        staging.close()
    for h in held:
        h.deregister()


def test_a_joined_map_goes_peer_staged_with_the_peer_s_half_joined_alike() -> None:
    """Prefill WRITEs the request's runs as they lie in its cache into decode's staging
    buffer; decode joins its own maps, planned from prefill's description, whose
    fingerprint is the poster's, and scatters them into its cache."""
    import nixl._api  # noqa: F401  (importing it sets NIXL's logger to INFO)

    from kvlayout.transfer import nixl as nx

    logging.getLogger("nixl").setLevel(logging.WARNING)
    (prefill, _), (decode, d_buf) = instance(1, seed=5), instance(2, seed=None)
    p_agent, d_agent = nx.make_agent("jm-prefill-peer"), nx.make_agent("jm-decode-peer")
    held = nx.register(p_agent, prefill), nx.register(d_agent, decode)
    there = RegistrationDescription.from_json(decode.describe(shard=D_SHARD).to_json())
    joined = join_maps(maps(prefill, there))
    landing = nx.Staging(d_agent, joined.num_bytes)  # decode's; its address and size go to prefill
    peer = p_agent.add_remote_agent(d_agent.get_agent_metadata())
    at_decode = nx.PeerStaging(landing.address, landing.nbytes)
    x = nx.transfer(p_agent, peer, joined, strategy="peer-staged", peer_staging=at_decode, notif=b"req-9")
    assert x.wait(timeout=60).strategy == "peer-staged"
    assert not d_buf.any()  # landed in decode's staging buffer, not yet in its cache
    source = RegistrationDescription.from_json(prefill.describe(shard=P_SHARD).to_json())
    mine = join_maps(maps(source, decode))
    assert mine.fingerprint == joined.fingerprint
    nx.unstage(mine, landing, expect=joined.fingerprint)
    twin, twin_buf = instance(2, seed=None)
    join_maps(maps(prefill, twin)).copy()
    assert torch.equal(d_buf, twin_buf) and twin_buf.any()
    x.release()
    landing.close()
    for h in held:
        h.deregister()


def test_sglang_kv_and_mamba_state_go_as_one_nixl_transfer() -> None:
    """SGLang's hybrid request: its KV pool's pages and its Mamba pool's slot, each state
    a tensor of its own, mapped apart and posted as one WRITE into a peer's pools (every
    part's tensors described and registered): the bytes are the local joined copy's."""
    import nixl._api  # noqa: F401  (importing it sets NIXL's logger to INFO)

    from kvlayout.integrations.sglang import mamba_state_pools
    from kvlayout.testing.sglang import LinearModel, device_pool
    from kvlayout.transfer import nixl as nx

    logging.getLogger("nixl").setLevel(logging.WARNING)
    model = LinearModel("gdn_attn", num_layers=2, num_heads=4, head_dim=8, state_size=8, n_groups=2)

    def instance(seed: int | None) -> tuple[dict[str, Any], list[torch.Tensor]]:
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        kv = [[torch.zeros(64, 2, 16, dtype=torch.bfloat16) for _ in range(3)] for _ in range(2)]
        if gen is not None:
            for t in (t for half in kv for t in half):
                t.copy_(torch.randn(t.shape, generator=gen))
        states = mamba_state_pools(device_pool(model, 1, 4, generator=gen), "gdn_attn")
        regs = {"kv": kvlayout.detect(kv, "sglang", {"tokens_per_block": 16}), **states}
        tensors = [t for half in kv for t in half] + [
            leaf for reg in states.values() for g in reg.kernel_groups for p in g.planes for leaf in p.leaves
        ]
        return regs, tensors

    def request(src: dict[str, Any], dst: dict[str, Any]) -> list[BlockMap]:
        group = {k: (v.group(0) if isinstance(v, RegistrationDescription) else v) for k, v in dst.items()}
        kv = block_map(src["kv"], group["kv"], [3, 1], [0, 2], num_tokens=20)
        return [kv] + [block_map(src[n], group[n], [2], [1]) for n in src if n != "kv"]

    (prefill, _), (decode, d_tensors) = instance(11), instance(None)
    p_agent, d_agent = nx.make_agent("jm-sgl-prefill"), nx.make_agent("jm-sgl-decode")
    held = [nx.register(p_agent, reg) for reg in prefill.values()] + [
        nx.register(d_agent, reg) for reg in decode.values()
    ]
    peer = p_agent.add_remote_agent(d_agent.get_agent_metadata())
    there = {n: RegistrationDescription.from_json(reg.describe().to_json()) for n, reg in decode.items()}
    joined = join_maps(request(prefill, there))
    assert len(joined.maps) == 3 and len({int(s) for s in joined.dst.tensor_spans[:, 0]}) > 6
    assert nx.transfer(p_agent, peer, joined, notif=b"req-s").wait(timeout=60).num_bytes == joined.num_bytes
    twin, t_tensors = instance(None)
    join_maps(request(prefill, twin)).copy()
    for got, want in zip(d_tensors, t_tensors, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert any(t.any() for t in t_tensors)
    for h in held:
        h.deregister()


def test_join_takes_one_rank_described_with_two_head_counts() -> None:
    """A decode rank's pools described with their own head counts go to one peer: an
    SGLang KV pool with the model's 2 KV heads and its Mamba state with the state's 4
    (a state reads only the rank and the degree), or an SWA pool whose sliding layers
    have KV heads of their own (MiMo-V2-Flash's ``swa_num_key_value_heads``, 4 beside
    the full layers' 2)."""
    from kvlayout.integrations.sglang import mamba_state_pools
    from kvlayout.testing.sglang import LinearModel, device_pool

    model = LinearModel("gdn_attn", num_layers=2, num_heads=4, head_dim=8, state_size=8, n_groups=2)

    def side(tp: int) -> tuple[Any, Any, Any]:
        kv = [[torch.zeros(64, 2 // tp, 16, dtype=torch.bfloat16) for _ in range(3)] for _ in range(2)]
        swa = [[torch.zeros(64, 4 // tp, 16, dtype=torch.bfloat16) for _ in range(3)] for _ in range(2)]
        state = mamba_state_pools(device_pool(model, tp, 4), "gdn_attn")["temporal"]
        hints = {"tokens_per_block": 16}
        return kvlayout.detect(kv, "sglang", hints), kvlayout.detect(swa, "sglang", hints), state

    (kv, swa, state), (d_kv, d_swa, d_state) = side(1), side(2)
    kv_there = RegistrationDescription.from_json(d_kv.describe(shard=Shard(1, 2, 2)).to_json())
    swa_there = RegistrationDescription.from_json(d_swa.describe(shard=Shard(1, 2, 4)).to_json())
    state_there = RegistrationDescription.from_json(d_state.describe(shard=Shard(1, 2, 4)).to_json())
    parts = [
        block_map(kv, kv_there, [3, 1], [0, 2], num_tokens=20, src_shard=Shard(0, 1, 2)),
        block_map(swa, swa_there, [3, 1], [0, 2], num_tokens=20, src_shard=Shard(0, 1, 4)),
        block_map(state, state_there, [2], [1], src_shard=Shard(0, 1, 4)),
    ]
    assert [m.kind for m in parts] == ["head slice", "head slice", "resharded state"]
    assert join_maps(parts).num_bytes == sum(m.num_bytes for m in parts)
    cp = RegistrationDescription.from_json(
        d_swa.describe(shard=Shard(1, 2, 4, cp_rank=1, cp_size=2)).to_json()
    )
    with pytest.raises(
        BlockMapError, match=r"a joined map goes to one peer"
    ):  # another CP rank: another peer
        join_maps([parts[0], block_map(swa, cp, [3, 1], [0], num_tokens=20, src_shard=Shard(0, 1, 4))])


def test_join_of_one_rank_number_at_two_tp_degrees_names_two_peers() -> None:
    """Rank 1 of TP 2 and rank 1 of TP 4 are two peers, whatever their head counts: the
    refusal says so, not that one rank was described with two head counts."""
    kv = [[torch.zeros(64, 2, 16, dtype=torch.bfloat16) for _ in range(3)] for _ in range(2)]
    src = kvlayout.detect(kv, "sglang", {"tokens_per_block": 16})
    one = [[torch.zeros(64, 1, 16, dtype=torch.bfloat16) for _ in range(3)] for _ in range(2)]
    peer = kvlayout.detect(one, "sglang", {"tokens_per_block": 16})
    parts = [
        block_map(src, peer.describe(shard=shard), [1], [2], src_shard=mine)
        for shard, mine in ((Shard(1, 2, 2), Shard(0, 1, 2)), (Shard(1, 4, 4), Shard(0, 2, 4)))
    ]
    with pytest.raises(BlockMapError) as err:
        join_maps(parts)
    assert "a joined map goes to one peer" in str(err.value)
    assert "model KV heads; describe every pool" not in str(err.value)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (Shard(1, 2, 4, cp_rank=0, cp_size=2), Shard(1, 2, 4, cp_rank=1, cp_size=2)),  # two CP ranks
        (Shard(1, 2, 4, cp_rank=1, cp_size=2), Shard(1, 2, 4, cp_rank=1, cp_size=2, cp_interleave=16)),
        (None, Shard(1, 2, 4)),  # a description that names no rank beside one rank's
        (Shard(1, 2, 4), None),
    ],
    ids=["two-cp-ranks", "two-cp-interleaves", "no-shard-then-shard", "shard-then-no-shard"],
)
def test_join_of_one_tp_rank_goes_to_one_peer_heads_aside(first: Shard | None, second: Shard | None) -> None:
    """Only the head counts of one peer's descriptions may differ: two CP ranks of one TP
    rank are two peers, a rank described at two CP interleaves contradicts itself, and a
    description that names no rank is not known to be that rank's."""

    def pool(heads: int) -> Any:
        kv = [[torch.zeros(64, heads, 16, dtype=torch.bfloat16) for _ in range(3)] for _ in range(2)]
        return kvlayout.detect(kv, "sglang", {"tokens_per_block": 16})

    src = pool(4)
    parts = [
        block_map(src, pool(4).describe(), [1], [dst])
        if shard is None
        else block_map(src, pool(2).describe(shard=shard), [1], [dst], src_shard=Shard(0, 1, 4))
        for shard, dst in ((first, 2), (second, 3))
    ]
    with pytest.raises(BlockMapError, match=r"maps\[1\]'s of one at .*; a joined map goes to one peer"):
        join_maps(parts)
