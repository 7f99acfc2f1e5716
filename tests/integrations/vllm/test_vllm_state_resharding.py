"""Mamba state pages between TP degrees (P/D of a hybrid model at TP 1 into TP 2, ...).

A Mamba page holds its rank's slices of the model's conv and SSM states; the edits mark
the page with those arrays (read from the MambaSpec), and a block map moves the slices
two ranks both hold. The oracle here knows nothing of the arrays: it places every conv
column and SSM head of both ranks in the model's global order from the model's config
(vLLM's sharding rule) and checks every destination byte against it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
import types
from typing import Any

import numpy as np
import pytest
import torch

import kvlayout
import kvlayout.testing.vllm as vx
from kvlayout.integrations.vllm.states import state_arrays
from kvlayout.registration.opaque import PageArray
from kvlayout.registration.peers import PeerDescriptionError, RegistrationDescription
from kvlayout.registration.shards import ShardError
from kvlayout.transfer import BlockMapError, Shard, block_map

HINTS = {"kv_layout": "NHD"}
MODEL = vx.QWEN3_5_0_8B
KV_HEADS = MODEL.num_key_value_heads


class Rank:
    """One rank of a Qwen3.5 GDN hybrid in vLLM 0.33, its Mamba pages filled at random."""

    def __init__(
        self, tp: int, rank: int, conv_layout: str, mode: str, seed: int, model: vx.HybridModel = MODEL
    ) -> None:
        self.tp, self.rank, self.conv_layout, self.model = tp, rank, conv_layout, model
        self.engine = vx.hybrid_engine(
            model, vx.FLASHINFER, num_blocks=4, tp=tp, conv_layout=conv_layout, mamba_cache_mode=mode,
            max_model_len=40960,
        )  # fmt: skip
        self.buf, self.raw = vx.allocate_v033(self.engine)
        vx.fill_random(self.buf, seed)
        self.registration = vx.detect_registered(
            self.engine, self.raw, HINTS, edited=True, prefix_reuse=mode == "align"
        )
        self.shard = Shard(rank, tp, model.num_key_value_heads)
        self.group = next(g for g in self.registration.kernel_groups if g.opaque_pages is not None)
        self.names = self.engine.config.kv_cache_groups[self.group.engine_group].layer_names
        self.spec = self.engine.spec_of(self.names[0])

    def states(self, buf: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``name``'s conv state ``[NB, dim, rows]`` (dim first whatever the layout)
        and SSM state ``[NB, heads, ...]``, viewed over ``buf`` (this rank's buffer or a
        copy of it) as ``MambaBase.bind_kv_cache`` slices the page."""
        raw = self.raw[name]
        flat = buf.view(-1)
        views = []
        offset = 0
        for shape, dtype in zip(self.spec.shapes, self.spec.dtypes, strict=True):
            size = math.prod(shape) * dtype.itemsize
            page = flat.as_strided((raw.shape[0], size), (raw.stride(0), 1), raw.storage_offset() + offset)
            views.append(page.view(dtype).view(raw.shape[0], *shape))
            offset += size
        conv, ssm = views
        return (conv if self.conv_layout == "DS" else conv.transpose(1, 2)), ssm

    def conv_columns(self) -> torch.Tensor:
        """The model's conv column of each of this rank's: Q, K and V each split over TP."""
        key = self.model.linear_key_head_dim * self.model.linear_num_key_heads
        value = self.model.linear_value_head_dim * self.model.linear_num_value_heads
        out, start = [], 0
        for size in (key, key, value):
            n = size // self.tp
            out.append(torch.arange(start + self.rank * n, start + (self.rank + 1) * n))
            start += size
        return torch.cat(out)

    def ssm_heads(self) -> torch.Tensor:
        n = self.model.linear_num_value_heads // self.tp
        return torch.arange(self.rank * n, (self.rank + 1) * n)


def _common(src_index: torch.Tensor, dst_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions in src and dst of the global indices both hold."""
    where = {int(g): i for i, g in enumerate(src_index)}
    pairs = [(where[int(g)], j) for j, g in enumerate(dst_index) if int(g) in where]
    if not pairs:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    s, d = zip(*pairs, strict=True)
    return torch.tensor(s), torch.tensor(d)


def expected_after(src: Rank, dst: Rank, src_blocks: list[int], dst_blocks: list[int]) -> torch.Tensor:
    """dst's buffer once the state both ranks hold moved from src's blocks into dst's:
    every other byte (other blocks, other ranks' slices, padding, attention) as it was."""
    out = dst.buf.clone()
    cols = _common(src.conv_columns(), dst.conv_columns())
    heads = _common(src.ssm_heads(), dst.ssm_heads())
    for name in dst.names:
        s_conv, s_ssm = src.states(src.buf, name)
        d_conv, d_ssm = dst.states(out, name)
        for b, c in zip(src_blocks, dst_blocks, strict=True):
            d_conv[c, cols[1]] = s_conv[b, cols[0]]
            d_ssm[c, heads[1]] = s_ssm[b, heads[0]]
    return out


PAIRS = [
    ((1, 0), (2, 0)),
    ((1, 0), (2, 1)),
    ((2, 1), (1, 0)),
    ((2, 0), (4, 1)),
    ((4, 3), (2, 1)),
    ((1, 0), (4, 2)),
]


@pytest.mark.parametrize("model", [MODEL, vx.QWEN3_NEXT_80B_A3B], ids=lambda m: m.name)
@pytest.mark.parametrize("conv_layout", ["DS", "SD"])
@pytest.mark.parametrize(("src_at", "dst_at"), PAIRS)
def test_state_moves_between_tp_degrees_byte_exactly(
    conv_layout: str, src_at: tuple[int, int], dst_at: tuple[int, int], model: vx.HybridModel
) -> None:
    """Qwen3-Next's V is twice its Q and K, so a Q | K | V split in another order moves
    other bytes."""
    src = Rank(src_at[0], src_at[1], conv_layout, "none", seed=1, model=model)
    dst = Rank(dst_at[0], dst_at[1], conv_layout, "none", seed=2, model=model)
    expected = expected_after(src, dst, [2], [1])
    m = block_map(src.group, dst.group, [2], [1], src_shard=src.shard, dst_shard=dst.shard)
    assert m.kind == "resharded state"
    rows = 1 if conv_layout == "DS" else model.linear_conv_kernel_dim - 1
    assert m.num_runs == len(m.src.layers) * (3 * rows + 1)  # Q, K, V per conv row, and the SSM heads
    assert m.reason.endswith(f"both hold, {3 * rows + 1} runs a page")
    runs = m.runs.astype(np.int64)
    joinable = (runs[1:, 0] == runs[:-1, 0] + runs[:-1, 2]) & (runs[1:, 1] == runs[:-1, 1] + runs[:-1, 2])
    assert not joinable.any()  # the fewest runs: none continues the one before on both sides
    m.copy()
    assert torch.equal(dst.buf, expected)


def test_every_source_rank_fills_its_slices_of_a_wider_decode_rank() -> None:
    """TP 4 -> TP 2: decode rank 1 gathers from prefill ranks 2 and 3; ranks 0 and 1 hold
    none of its state, so their maps are empty."""
    dst = Rank(2, 1, "DS", "none", seed=9)
    sources = [Rank(4, r, "DS", "none", seed=10 + r) for r in range(4)]
    expected = dst.buf.clone()
    for src in sources:
        dst_before = dst.buf
        dst.buf = expected
        expected = expected_after(src, dst, [3], [0])
        dst.buf = dst_before
    for src in sources:
        m = block_map(src.group, dst.group, [3], [0], src_shard=src.shard, dst_shard=dst.shard)
        assert (m.kind, m.num_runs) == (
            ("empty", 0) if src.rank < 2 else ("resharded state", 4 * len(m.src.layers))
        )
        m.copy()
    assert torch.equal(dst.buf, expected)


def test_align_mode_pages_move_between_tp_degrees_block_by_block() -> None:
    """With prefix caching (align mode) each block holds the state at its last token."""
    src, dst = Rank(1, 0, "DS", "align", seed=3), Rank(2, 1, "DS", "align", seed=4)
    assert src.group.block_size == dst.group.block_size == 544
    expected = expected_after(src, dst, [0, 3], [2, 1])
    m = block_map(
        src.group, dst.group, [0, 3], [2, 1], num_tokens=700, src_shard=src.shard, dst_shard=dst.shard
    )
    assert m.num_tokens == 1088  # whole pages
    m.copy()
    assert torch.equal(dst.buf, expected)


def test_same_rank_pages_still_move_whole() -> None:
    src, dst = Rank(2, 1, "DS", "none", seed=5), Rank(2, 1, "DS", "none", seed=6)
    m = block_map(src.group, dst.group, [0], [3], src_shard=src.shard, dst_shard=dst.shard)
    assert m.kind == "same layout" and m.num_runs == len(m.src.layers)  # one page a layer, padding too


def _vllm_conv_split() -> Any:
    """vLLM 0.33's own ``ssm_conv_transfer_utils``, loaded from its file (its package
    imports the distributed runtime), told that the conv state is "DS"."""
    import vllm

    mamba_utils = types.ModuleType("vllm.model_executor.layers.mamba.mamba_utils")
    mamba_utils.is_conv_state_dim_first = lambda: True  # type: ignore[attr-defined]
    path = f"{vllm.__path__[0]}/distributed/kv_transfer/kv_connector/v1/ssm_conv_transfer_utils.py"
    spec = importlib.util.spec_from_file_location("vllm_ssm_conv_transfer_utils", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved = sys.modules.get(mamba_utils.__name__)
    sys.modules[mamba_utils.__name__] = mamba_utils
    try:
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del sys.modules[mamba_utils.__name__]
        else:
            sys.modules[mamba_utils.__name__] = saved
    return module


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (1, 4), (2, 4), (4, 2), (2, 1)])
def test_runs_are_vllm_s_own_conv_split_offsets(p_tp: int, d_tp: int) -> None:
    """pd-transfer-facts section 8 item 9: decode reads from a prefill page exactly the
    sub-projection slices vLLM's NixlConnector reads ("3-read"), and its SSM slice."""
    split = _vllm_conv_split()
    for d_rank in range(d_tp):
        dst = Rank(d_tp, d_rank, "DS", "none", seed=7)
        p_rank = d_rank * p_tp // d_tp  # the prefill rank vLLM reads from first
        src = Rank(p_tp, p_rank, "DS", "none", seed=8)
        info = split.derive_mamba_conv_split(dst.spec, d_tp)
        ratio = d_tp // p_tp if d_tp >= p_tp else -(p_tp // d_tp)
        m = block_map(src.group, dst.group, [0], [0], src_shard=src.shard, dst_shard=dst.shard)
        name = dst.names[0]
        page = (src.raw[name].data_ptr(), dst.raw[name].data_ptr())  # block 0 of one layer
        runs = m.runs.astype(object)
        layer = [r for r in runs if 0 <= r[1] - page[1] < dst.raw[name].stride(0)]
        assert len(layer) == 4 and all(0 <= r[0] - page[0] < src.raw[name].stride(0) for r in layer)
        conv = [(int(s) - page[0], int(n)) for s, _, n in layer[:3]]
        if ratio >= 1:
            assert conv == info.remote_conv_offsets(d_rank % ratio, ratio)
            assert [(int(d) - page[1], int(n)) for _, d, n in layer[:3]] == info.local_conv_offsets
        else:  # prefill pages are smaller: decode reads each whole, into its slices
            assert conv == info.remote_conv_offsets(0, ratio)
        ssm = info.ssm_sizes[1] if ratio >= 1 else info.ssm_sizes[1] // -ratio  # decode's, or prefill's
        assert int(layer[3][2]) == ssm


def mamba2_spec(tp: int, n_groups: int, block_size: int = 16) -> Any:
    """``mamba2_state_shape`` for a Mamba2 model (64 heads of 64, d_state 128, conv 4),
    its B and C groups replicated where ``n_groups`` is not a multiple of TP."""
    n = n_groups + (0 if n_groups % tp == 0 else tp - n_groups)
    conv_dim = 64 * 64 + 2 * n * 128
    shapes = ((conv_dim // tp, 3), (64 // tp, 64, 128))
    backends = importlib.import_module("vllm.v1.attention.backends.registry").MambaAttentionBackendEnum
    return vx.kvi.MambaSpec(
        block_size=block_size, shapes=shapes, dtypes=(torch.bfloat16, torch.float32),
        mamba_type=backends.MAMBA2, mamba_cache_mode="align",
    )  # fmt: skip


def test_a_mamba2_spec_reads_as_x_b_and_c() -> None:
    conv, ssm = state_arrays(mamba2_spec(2, 8))
    assert conv == PageArray(0, (2048 + 1024, 3), "bfloat16", 0, (2048, 512, 512))
    assert ssm == PageArray(3072 * 3 * 2, (32, 64, 128), "float32", 0, (32,))


def test_specs_without_a_known_split_declare_no_arrays() -> None:
    backends = importlib.import_module("vllm.v1.attention.backends.registry").MambaAttentionBackendEnum
    spec = mamba2_spec(2, 8)
    short_conv = vx.kvi.MambaSpec(block_size=16, shapes=((3, 1024),), dtypes=(torch.bfloat16,))
    assert state_arrays(short_conv) == ()
    assert state_arrays(vx.kvi.MambaSpec(block_size=16, shapes=spec.shapes, dtypes=spec.dtypes,
                                         mamba_type=backends.LINEAR)) == ()  # fmt: skip
    assert (
        state_arrays(vx.kvi.MambaSpec(block_size=16, shapes=((100, 3), (4, 64, 128)), dtypes=spec.dtypes))
        == ()
    )
    assert state_arrays(vx.attention_spec(MODEL, 1, 16)) == ()


def _description(rank: Rank) -> dict[str, Any]:
    wire: dict[str, Any] = json.loads(rank.registration.describe(shard=rank.shard).to_json())
    return wire


def test_replicated_groups_are_refused_naming_the_part() -> None:
    """Mamba2 with one group: at TP 2 each rank holds that group's B and C whole, so the
    model's B is twice as long as at TP 1 and no rank's page says which group it holds."""
    from kvlayout.registration.opaque import OpaquePages
    from kvlayout.transfer.sharded_pages import page_template

    a = OpaquePages("mamba", False, state_arrays(mamba2_spec(1, 1)))
    b = OpaquePages("mamba", False, state_arrays(mamba2_spec(2, 1)))
    with pytest.raises(
        BlockMapError, match=r"state array 0 .* part 1 is 128 of 128 at TP 1 and 128 of 256 at TP 2"
    ):
        page_template(a, b, Shard(0, 1, 8), Shard(1, 2, 8), (1 << 22, 1 << 22))
    # n_groups a multiple of both degrees: sharded, served
    a = OpaquePages("mamba", False, state_arrays(mamba2_spec(1, 8)))
    b = OpaquePages("mamba", False, state_arrays(mamba2_spec(2, 8)))
    runs = page_template(a, b, Shard(0, 1, 8), Shard(1, 2, 8), (1 << 22, 1 << 22))
    assert [int(n) for n in runs[:, 2]] == [2048 * 6, 512 * 6, 512 * 6, 32 * 64 * 128 * 4]


def test_pages_of_two_degrees_without_shards_are_refused() -> None:
    src, dst = Rank(1, 0, "DS", "none", seed=1), Rank(2, 0, "DS", "none", seed=2)
    with pytest.raises(
        BlockMapError, match=r"TP-sharded state of two TP degrees; give src_shard and dst_shard"
    ):
        block_map(src.group, dst.group, [0], [0])


def test_other_block_sizes_are_refused() -> None:
    src = Rank(1, 0, "DS", "none", seed=1)
    dst = Rank(2, 0, "DS", "align", seed=2)
    with pytest.raises(BlockMapError, match=r"pages of state in blocks of 1 and 544 rows"):
        block_map(src.group, dst.group, [0], [0], src_shard=src.shard, dst_shard=dst.shard)


def test_a_peer_s_arrays_travel_in_its_description_and_are_checked() -> None:
    src, dst = Rank(1, 0, "SD", "none", seed=1), Rank(2, 1, "SD", "none", seed=2)
    wire = _description(dst)
    group = wire["groups"][dst.group.engine_group]  # the description lists groups in detection order
    group = next(g for g in wire["groups"] if g["opaque_pages"] is not None)
    assert [a["parts"] for a in group["opaque_pages"]["arrays"]] == [[1024] * 3, [8]]
    peer = RegistrationDescription.from_json(json.dumps(wire))
    index = next(i for i, g in enumerate(peer.groups) if g.opaque_pages is not None)
    remote = block_map(src.group, peer.group(index), [2], [1], src_shard=src.shard)
    local = block_map(src.group, dst.group, [2], [1], src_shard=src.shard, dst_shard=dst.shard)
    assert remote.kind == "resharded state" and (remote.runs[:, 2] == local.runs[:, 2]).all()
    assert (remote.runs[:, 0] == local.runs[:, 0]).all()

    def refused(arrays: object, message: str) -> None:
        bad = json.loads(json.dumps(wire))
        next(g for g in bad["groups"] if g["opaque_pages"] is not None)["opaque_pages"]["arrays"] = arrays
        with pytest.raises(PeerDescriptionError, match=message):
            RegistrationDescription.from_json(json.dumps(bad))

    array = {"offset": 0, "shape": [3, 3072], "dtype": "bfloat16", "axis": 1, "parts": [1024, 1024, 1024]}
    refused("x", r"opaque_pages.arrays must be a list, not a string")
    refused(
        [dict(array, parts=[1024, 1024])], r"arrays\[0\]: a page array's parts \[1024, 1024\] must add up"
    )
    refused([dict(array, axis=2)], r"arrays\[0\].axis=2 is outside \[0, 2\)")
    refused([dict(array, dtype="int4")], r"arrays\[0\].dtype 'int4' is not one of")
    refused(
        [dict(array, shape=[1 << 31, 1 << 31], parts=[1 << 31])], r"arrays\[0\]: shape .* spans 2\*\*48 bytes"
    )
    refused([dict(array, shape=[3, 0])], r"arrays\[0\].shape\[1\]=0 is outside \[1, ")
    refused([array, array], r"page array 1 starts at byte 0, inside array 0")
    refused([dict(array, extra=1)], r"arrays\[0\] has unknown field\(s\) 'extra'")
    refused([dict(array, kv_heads="yes")], r"arrays\[0\].kv_heads 'yes' is not a boolean")
    refused([dict(array, kv_heads=True)], r"arrays\[0\]: a page array of KV heads has one part, not \[1024")
    refused([dict(array, replicated=1)], r"arrays\[0\].replicated 1 is not a boolean")
    refused(
        [dict(array, replicated=True)], r"arrays\[0\]: a page array every rank holds whole has one part, not"
    )
    refused(
        [dict(array, parts=[3072], kv_heads=True, replicated=True)],
        r"arrays\[0\]: a page array is either of KV heads or replicated, not both",
    )
    # arrays past the page: refused by the map, before anything is posted
    bad = json.loads(json.dumps(wire))
    pages = next(g for g in bad["groups"] if g["opaque_pages"] is not None)["opaque_pages"]
    pages["arrays"][1]["offset"] = 1 << 30
    peer = RegistrationDescription.from_json(json.dumps(bad))
    with pytest.raises(
        BlockMapError, match=r"the dst pages' state arrays end at byte \d+, past the 557056-byte page"
    ):
        block_map(src.group, peer.group(index), [2], [1], src_shard=src.shard)


def test_a_peer_s_state_pages_of_heads_are_refused() -> None:
    """A page of state arrays is one row of bytes per block; a peer that declares the
    arrays over pages of two heads is refused by the map, naming the side."""
    src, dst = Rank(1, 0, "SD", "none", seed=1), Rank(2, 1, "SD", "none", seed=2)
    wire = _description(dst)
    group = next(g for g in wire["groups"] if g["opaque_pages"] is not None)
    plane = group["planes"][0]
    assert (group["format"], plane["shape"]) == ("NL_X_NB_BS_HS", [4, 1, 557056])
    group["format"] = "NL_X_NB_BS_NH_HS"
    plane.update(
        sizes={"NL": 6, "NB": 4, "BS": 1, "NH": 2, "HS": 557056},
        shape=[4, 1, 2, 557056],
        strides=[1114112, 1114112, 557056, 1],
        block_stride=1114112,
        addresses=[plane["addresses"][0] + i * (8 << 20) for i in range(6)],
    )
    peer = RegistrationDescription.from_json(json.dumps(wire))
    index = next(i for i, g in enumerate(peer.groups) if g.opaque_pages is not None)
    with pytest.raises(
        BlockMapError,
        match=r"^dst: pages of state arrays are one row of bytes per block \(layers 0-5: NL_X_NB_BS_NH_HS "
        r"\[4, 1, 2, 557056\] int8\)$",
    ):
        block_map(src.group, peer.group(index), [2], [1], src_shard=src.shard)


@pytest.mark.parametrize("strategy", ["direct", "staged"])
def test_state_moves_through_nixl_between_tp_degrees(strategy: str) -> None:
    """Prefill at TP 1 writes the slices decode rank 1 of 2 holds into it through NIXL
    (two agents over loopback in this process), from decode's description."""
    pytest.importorskip("nixl._api")
    import logging

    from kvlayout.transfer import nixl as nx

    logging.getLogger("nixl").setLevel(logging.WARNING)
    src, dst = Rank(1, 0, "SD", "none", seed=11), Rank(2, 1, "SD", "none", seed=12)
    expected = expected_after(src, dst, [1, 3], [2, 0])
    prefill, decode = nx.make_agent(f"state-prefill-{strategy}"), nx.make_agent(f"state-decode-{strategy}")
    held = nx.register(prefill, src.registration), nx.register(decode, dst.registration)
    staging = nx.Staging(prefill, 8 << 20)
    try:
        peer = prefill.add_remote_agent(decode.get_agent_metadata())
        there = RegistrationDescription.from_json(dst.registration.describe(shard=dst.shard).to_json())
        index = next(i for i, g in enumerate(there.groups) if g.opaque_pages is not None)
        m = block_map(src.group, there.group(index), [1, 3], [2, 0], src_shard=src.shard)
        assert m.kind == "resharded state"
        done = nx.transfer(prefill, peer, m, strategy=strategy, staging=staging)  # type: ignore[arg-type]
        assert done.wait(timeout=60).num_bytes == m.num_bytes
        assert torch.equal(dst.buf, expected)
    finally:
        staging.close()
        for h in held:
            h.deregister()


def test_a_state_of_another_dtype_is_refused() -> None:
    """One instance keeps Qwen3-Next's SSM state in float16, the other in bfloat16: bytes of
    the same size, other numbers."""
    fp16 = dataclasses.replace(vx.QWEN3_NEXT_80B_A3B, mamba_ssm_dtype=torch.float16)
    for src_tp, dst_tp in ((2, 2), (1, 2)):
        src = Rank(src_tp, 1 % src_tp, "DS", "none", seed=1, model=vx.QWEN3_NEXT_80B_A3B)
        dst = Rank(dst_tp, 1, "DS", "none", seed=2, model=fp16)
        with pytest.raises(
            BlockMapError, match=r"do not hold the same state: state array 1 is bfloat16 .* float16"
        ):
            block_map(src.group, dst.group, [0], [0], src_shard=src.shard, dst_shard=dst.shard)


def test_shards_are_checked_on_the_state_path() -> None:
    src, dst = Rank(1, 0, "DS", "none", seed=1), Rank(2, 1, "DS", "none", seed=2)
    with pytest.raises(TypeError, match=r"^src_shard must be a kvlayout.transfer.Shard, not str"):
        block_map(src.group, dst.group, [0], [0], src_shard="x", dst_shard=dst.shard)  # type: ignore[arg-type]
    with pytest.raises(ShardError, match=r"disagree on the model's KV heads"):
        block_map(src.group, dst.group, [0], [0], src_shard=Shard(0, 1, 4), dst_shard=dst.shard)
    peer = RegistrationDescription.from_json(dst.registration.describe(shard=dst.shard).to_json())
    index = next(i for i, g in enumerate(peer.groups) if g.opaque_pages is not None)
    with pytest.raises(ShardError, match=r"dst_shard is Shard\(tp_rank=0, .* but the dst description says"):
        block_map(
            src.group, peer.group(index), [0], [0], src_shard=src.shard, dst_shard=Shard(0, 2, KV_HEADS)
        )


def test_one_pair_of_sides_maps_to_each_rank_it_is_asked_for() -> None:
    """The re-cut sides are kept per pair of ranks: a second rank gets its own slices."""
    src = Rank(1, 0, "DS", "none", seed=1)
    dsts = [Rank(2, r, "DS", "none", seed=2) for r in range(2)]
    first = block_map(
        src.group, dsts[0].group, [0], [0], src_shard=src.shard, dst_shard=Shard(0, 2, KV_HEADS)
    )
    second = block_map(
        src.group, dsts[0].group, [0], [0], src_shard=src.shard, dst_shard=Shard(1, 2, KV_HEADS)
    )
    assert not np.array_equal(first.runs[:, 0], second.runs[:, 0])  # rank 1's slices are other source bytes


def test_replicated_groups_are_refused_in_both_directions() -> None:
    from kvlayout.registration.opaque import OpaquePages
    from kvlayout.transfer.sharded_pages import page_template

    one, two = (OpaquePages("mamba", False, state_arrays(mamba2_spec(tp, 1))) for tp in (1, 2))
    with pytest.raises(BlockMapError, match=r"part 1 is 128 of 256 at TP 2 and 128 of 128 at TP 1"):
        page_template(two, one, Shard(1, 2, 8), Shard(0, 1, 8), (1 << 22, 1 << 22))


def test_what_declares_no_arrays() -> None:
    """Specs whose split no rule gives keep their pages whole: a replay ring's extra
    states, shapes that fit the model's split on both axes; a TP-replicated state declares
    arrays every rank holds whole."""
    backends = importlib.import_module("vllm.v1.attention.backends.registry").MambaAttentionBackendEnum
    spec = mamba2_spec(2, 8)
    ring = vx.kvi.MambaSpec(block_size=16, shapes=(*spec.shapes, (4, 8)), dtypes=(*spec.dtypes, torch.float32),
                            mamba_type=backends.MAMBA2)  # fmt: skip
    assert state_arrays(ring) == ()
    replicated = dataclasses.replace(spec, tp_replicated=True)  # every rank's whole: test_vllm_state_kinds
    assert [(x.offset, x.shape, x.replicated) for x in state_arrays(replicated)] == [
        (0, spec.shapes[0], True),
        (math.prod(spec.shapes[0]) * 2, spec.shapes[1], True),
    ]
    # Mamba1: conv (intermediate, rows), SSM (intermediate, state): the dim is the SSM's first axis
    mamba1 = vx.kvi.MambaSpec(block_size=16, shapes=((1024, 3), (1024, 16)), dtypes=(torch.bfloat16, torch.float32),
                              mamba_type=backends.MAMBA1)  # fmt: skip
    assert state_arrays(mamba1) == (
        PageArray(0, (1024, 3), "bfloat16", 0, (1024,)),
        PageArray(1024 * 3 * 2, (1024, 16), "float32", 0, (1024,)),
    )
    sd = dataclasses.replace(mamba1, shapes=((3, 1024), (1024, 16)))
    assert state_arrays(sd)[0] == PageArray(0, (3, 1024), "bfloat16", 1, (1024,))
    both = dataclasses.replace(mamba1, shapes=((16, 16), (16, 16)))  # either axis is the dim
    assert state_arrays(both) == ()


def test_descriptions_with_arrays_are_version_2_and_others_read_as_before() -> None:
    """Readers before state arrays read version 1 only; pages without arrays (an older
    peer's, or the same rank's) still move whole."""
    src, dst = Rank(2, 1, "DS", "none", seed=1), Rank(2, 1, "DS", "none", seed=2)
    wire = _description(dst)
    assert wire["version"] == 2
    index = next(i for i, g in enumerate(wire["groups"]) if g["opaque_pages"] is not None)
    old = json.loads(json.dumps(wire))
    old["version"] = 1
    with pytest.raises(PeerDescriptionError, match=r"opaque_pages.arrays needs description.version 2, not 1"):
        RegistrationDescription.from_json(json.dumps(old))
    for group in old["groups"]:  # what an older kvlayout sends
        if group["opaque_pages"] is not None:
            del group["opaque_pages"]["arrays"]
    peer = RegistrationDescription.from_json(json.dumps(old))
    m = block_map(src.group, peer.group(index), [0], [3], src_shard=src.shard)
    assert m.kind == "same layout" and m.num_runs == len(m.src.layers)  # whole pages, padding too
    # a page in another view of the same arrays moves the arrays only, rank to rank
    other = json.loads(json.dumps(wire))
    other["groups"][index]["opaque_pages"]["layout"] = "mamba-state-list: another view"
    m = block_map(src.group, RegistrationDescription.from_json(json.dumps(other)).group(index), [0], [3])
    assert m.kind == "re-laid" and m.num_runs == len(m.src.layers)  # conv and SSM, back to back
    assert m.reason.endswith("the same arrays in other views, 1 run a page")
    pages = src.group.opaque_pages
    assert pages is not None and m.num_bytes == len(m.src.layers) * pages.arrays_end
    # a registration without state arrays still writes version 1
    plain = kvlayout.detect([torch.zeros(4, 2, 16, 2, 8)], "vllm", {"kv_layout": "NHD"})
    assert json.loads(plain.describe().to_json())["version"] == 1


def test_align_mode_state_maps_are_estimated_for_nixl() -> None:
    from kvlayout.transfer import nixl as nx

    src, dst = Rank(1, 0, "SD", "align", seed=3), Rank(2, 1, "SD", "align", seed=4)
    m = block_map(
        src.group, dst.group, [0, 3], [2, 1], num_tokens=1088, src_shard=src.shard, dst_shard=dst.shard
    )
    estimate = nx.estimate(m, poster="dst")
    assert estimate.descriptors["direct"] == m.num_runs
    assert estimate.descriptors["peer-staged"] == 2 * len(m.src.layers)  # decode's pages are its stretches


def test_a_decode_that_reads_takes_state_from_every_rank_holding_its_slices_attention_from_one() -> None:
    """The rank rule pd-connectors.md gives a READing decode: Qwen3-Next's 2 KV heads at
    prefill TP 4 into decode TP 2. Decode rank 0's head is on prefill ranks 0 and 1
    (replicas: ``sends_to`` picks 0), its state slices on ranks 0 and 1 (no replicas), and
    ranks 2 and 3 hold neither: gating the state by ``sends_to`` would drop rank 1's half."""
    model = vx.QWEN3_NEXT_80B_A3B
    src = [Rank(4, r, "DS", "none", seed=r, model=model) for r in range(4)]
    dst = Rank(2, 0, "DS", "none", seed=9, model=model)
    attention = [g for g in dst.registration.kernel_groups if g.opaque_pages is None]
    assert attention
    kinds = {}
    for r, rank in enumerate(src):
        state = block_map(rank.group, dst.group, [1], [2], src_shard=rank.shard, dst_shard=dst.shard)
        heads = [
            block_map(rank.registration.kernel_groups[dst.registration.kernel_groups.index(g)], g, [0], [3],
                      num_tokens=10, src_shard=rank.shard, dst_shard=dst.shard).kind
            for g in attention
        ]  # fmt: skip
        kinds[r] = (rank.shard.sends_to(dst.shard), state.kind, {k == "empty" for k in heads})
    # (the attention blocks differ in size: a hybrid's block is sized by its TP's state page)
    assert kinds[0] == (True, "resharded state", {False})
    assert kinds[1] == (False, "resharded state", {False})  # the same head: rank 0 sends it
    assert kinds[2][1:] == kinds[3][1:] == ("empty", {True})


@pytest.mark.parametrize("mode", ["none", "align"])
@pytest.mark.parametrize("conv_layout", ["DS", "SD"])
def test_declared_state_rows_mark_a_page_as_the_edits_do(conv_layout: str, mode: str) -> None:
    """A registered Mamba layer read from its spec's fields alone (``kvlayout plan``'s state
    sides) is marked with the arrays and page layout the edits give it from the spec."""
    from kvlayout.integrations.vllm.errors import KVCacheGroupEditError
    from kvlayout.integrations.vllm.rules import MambaStateRowsEdit, declared_state_rows
    from kvlayout.registration.opaque import opaque_pages_of

    rank = Rank(2, 1, conv_layout, mode, seed=1)
    name = rank.names[0]
    # vLLM's MambaSpec: one state a block in 'none' mode, block_size rows (its checkpoints) in align mode
    rows = rank.spec.block_size if mode == "align" else 1
    raw, page = rank.raw[name], rank.spec.page_size_bytes
    # vLLM registers the unpadded state as the row (state_content_size_bytes), the padding past it
    assert raw.dtype == torch.int8 and raw.shape[-1] == rank.spec.real_page_size_bytes < page
    view = declared_state_rows(raw, "gdn_attn", rank.spec.shapes, rank.spec.dtypes, rows, page)
    edited = MambaStateRowsEdit().apply(rank.spec, raw)
    assert opaque_pages_of(view) == rank.group.opaque_pages and rank.group.geometry.block_size == rows
    assert (view.shape, view.stride(), view.data_ptr()) == (edited.shape, edited.stride(), edited.data_ptr())
    assert view.shape == (4, rows, page // rows)
    if mode == "align":  # the row alone does not split into the spec's rows: only the page does
        with pytest.raises(KVCacheGroupEditError, match=r"does not split into block_size"):
            declared_state_rows(raw, "gdn_attn", rank.spec.shapes, rank.spec.dtypes, rows)
    with pytest.raises(
        KVCacheGroupEditError, match=rf"the registered state row is {raw.shape[-1]} bytes, more"
    ):
        declared_state_rows(raw, "gdn_attn", rank.spec.shapes, rank.spec.dtypes, 1, raw.shape[-1] - 1)
    with pytest.raises(KVCacheGroupEditError, match=r"a 'mamba1' state of .* does not split over TP"):
        declared_state_rows(rank.raw[name], "mamba1", rank.spec.shapes, rank.spec.dtypes, 1)
