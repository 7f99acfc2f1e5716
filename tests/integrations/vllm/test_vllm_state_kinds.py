"""vLLM 0.33's other Mamba state kinds between TP degrees: LFM2's short convolutions, a
BailingMoeV2.5 hybrid's linear attention, Jamba's Mamba1, a Mamba2 of 8 groups
(Nemotron-H's: its ``B`` and ``C`` groups sharded) and a Mamba2 of one group (replicated
on every rank, as vLLM takes ``n_groups`` 1 at any TP: refused between degrees).

Each rank's state shapes come from vLLM's own ``MambaStateShapeCalculator`` (its source,
run with this rank's TP degree and conv order); the oracle places every index of every
state along its split axis in the model's global order, from the model's sizes and
vLLM's sharding (each of a conv dim's sub-projections, or a state's heads, split in
contiguous slices over the ranks), and checks every destination byte. Model sizes are
the public configs' where small, scaled down (heads, widths) where a page would be
megabytes; the structure (parts, orders, dtypes) is the model's.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import kvlayout.testing.vllm as vx
from kvlayout.integrations.vllm.states import state_arrays
from kvlayout.registration.opaque import PageArray
from kvlayout.transfer import BlockMapError, Shard, block_map

HINTS = {"kv_layout": "NHD"}


def _calculator(conv_layout: str) -> Any:
    """vLLM 0.33's ``MambaStateShapeCalculator``, its class run from its file's source
    (the module imports vLLM's runtime), the conv order ``conv_layout``."""
    import vllm

    path = f"{vllm.__path__[0]}/model_executor/layers/mamba/mamba_utils.py"
    with open(path) as f:
        tree = ast.parse(f.read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MambaStateShapeCalculator")

    def divide(a: int, b: int) -> int:
        assert a % b == 0, f"{a} is not divisible by {b}"
        return a // b

    namespace: dict[str, Any] = {
        "divide": divide,
        "is_conv_state_dim_first": lambda: conv_layout == "DS",
        "MambaBackendEnum": object,
    }
    exec(compile(ast.Module(body=[cls], type_ignores=[]), path, "exec"), namespace)
    return namespace["MambaStateShapeCalculator"]


def _slices(sizes: tuple[int, ...], tp: int, rank: int) -> torch.Tensor:
    """The global indices rank ``rank`` of ``tp`` holds of parts ``sizes`` long, each
    split in contiguous slices over the ranks."""
    out, start = [], 0
    for size in sizes:
        n = size // tp
        out.append(torch.arange(start + rank * n, start + (rank + 1) * n))
        start += size
    return torch.cat(out)


@dataclass(frozen=True)
class Family:
    """A hybrid: its attention spec at one token a block (``attn_1(tp)``), its states
    (``states(calculator, tp)``: vLLM's shapes), and for each state the axis TP splits
    (by conv order) and the model's parts on it."""

    name: str
    mamba_type: str
    attn_1: Callable[[int], Any]
    states: Callable[[Any, int], tuple[tuple[int, ...], ...]]
    dtypes: tuple[torch.dtype, ...]
    splits: Callable[[str], tuple[tuple[int, tuple[int, ...]], ...]]  # per state: (axis, model's parts)
    kv_heads: int
    backend: vx.Backend
    layers: tuple[tuple[str, bool], ...]
    min_alignment: int = 1
    tp_replicated: bool = False  # the spec's: every rank holds the whole state, its shapes TP 1's


def _gqa(heads: int, head_dim: int) -> Callable[[int], Any]:
    return lambda tp: vx.kvi.FullAttentionSpec(
        block_size=1, num_kv_heads=max(1, heads // tp), head_size=head_dim, dtype=torch.bfloat16
    )


def _conv_axis(layout: str) -> int:
    return 0 if layout == "DS" else 1


def _layers(n: int, attention: set[int], mixer: str) -> tuple[tuple[str, bool], ...]:
    return tuple(
        (
            f"model.layers.{i}.self_attn.attn" if i in attention else f"model.layers.{i}.{mixer}",
            i in attention,
        )
        for i in range(n)
    )


# LFM2-1.2B: conv_dim 2048, conv_L_cache 3; attention layers 2, 5, 8, 10, 12, 14 (8 KV heads of 64).
LFM2 = Family(
    "LFM2-1.2B", "SHORT_CONV", _gqa(8, 64),
    lambda calc, tp: calc.short_conv_state_shape(tp, 2048, 3),
    (torch.bfloat16,),
    lambda layout: ((_conv_axis(layout), (2048,)),),
    8, vx.FLASHINFER, _layers(16, {2, 5, 8, 10, 12, 14}, "short_conv"),
)  # fmt: skip
# BailingMoeV2.5: linear attention (16 heads of 128 here) with an MLA layer every 4th.
BAILING_LINEAR = Family(
    "BailingMoeV2.5-linear", "LINEAR",
    lambda tp: vx.kvi.MLAAttentionSpec(block_size=1, num_kv_heads=1, head_size=576, dtype=torch.bfloat16),
    lambda calc, tp: calc.linear_attention_state_shape(16, tp, 128),
    (torch.bfloat16,),
    lambda layout: ((0, (16,)),),
    1, vx.FLASHMLA, _layers(8, {3, 7}, "self_attn"), min_alignment=128,
)  # fmt: skip
# Jamba: Mamba1 (intermediate 1024 here, d_state 16, d_conv 4), attention every 8th layer from 4.
JAMBA = Family(
    "Jamba", "MAMBA1", _gqa(8, 128),
    lambda calc, tp: calc.mamba1_state_shape(tp, 1024, 16, 4),
    (torch.bfloat16, torch.float32),
    lambda layout: ((_conv_axis(layout), (1024,)), (0, (1024,))),
    8, vx.FLASH_ATTN, _layers(16, {4, 12}, "mamba"),
)  # fmt: skip
# Nemotron-H: Mamba2 of 8 groups (16 heads of 64 and d_state 32 here, conv 4).
NEMOTRON_H = Family(
    "Nemotron-H", "MAMBA2", _gqa(8, 128),
    lambda calc, tp: calc.mamba2_state_shape(tp, 1024, 8, 16, 64, 32, 4),
    (torch.bfloat16, torch.float32),
    lambda layout: ((_conv_axis(layout), (1024, 256, 256)), (0, (16,))),
    8, vx.FLASH_ATTN, _layers(12, {3, 7, 11}, "mixer"),
)  # fmt: skip
# Mamba2 of one group, which every rank holds whole (mamba_mixer2: n_groups 1 at any TP).
# Qwen4's PLE short convolution (vllm/models/qwen4_exp/nvidia/ple_layer.py): is_kv_cache_tp_replicated,
# its shape short_conv_state_shape(tp_world_size=1, ...) at any TP (hidden 1024, kernel 3 here)
PLE = Family(
    "Qwen4-PLE", "SHORT_CONV", _gqa(8, 64),
    lambda calc, tp: calc.short_conv_state_shape(1, 1024, 3),
    (torch.bfloat16,),
    lambda layout: ((_conv_axis(layout), (1024,)),),
    8, vx.FLASHINFER, _layers(8, {2, 5}, "ple"), tp_replicated=True,
)  # fmt: skip
MAMBA2_ONE_GROUP = Family(
    "Mamba2-one-group", "MAMBA2", _gqa(8, 128),
    lambda calc, tp: calc.mamba2_state_shape(tp, 1024, 1, 16, 64, 32, 4),
    (torch.bfloat16, torch.float32),
    lambda layout: ((_conv_axis(layout), (1024, 32, 32)), (0, (16,))),
    8, vx.FLASH_ATTN, _layers(12, {3, 7, 11}, "mixer"),
)  # fmt: skip


class Rank:
    """One rank of a family's hybrid in vLLM 0.33, its pages filled at random."""

    def __init__(
        self, family: Family, tp: int, rank: int, layout: str, seed: int, mode: str = "none"
    ) -> None:
        self.family, self.tp, self.rank, self.layout = family, tp, rank, layout
        shapes = family.states(_calculator(layout), tp)
        self.engine = vx.state_hybrid_engine(
            family.attn_1(tp), (shapes, family.dtypes), family.mamba_type, family.backend, family.layers,
            mamba_cache_mode=mode, min_alignment=family.min_alignment, tp_replicated=family.tp_replicated,
        )  # fmt: skip
        self.buf, self.raw = vx.allocate_v033(self.engine)
        vx.fill_random(self.buf, seed)
        self.registration = vx.detect_registered(
            self.engine, self.raw, HINTS, edited=True, prefix_reuse=mode == "align"
        )
        self.shard = Shard(rank, tp, family.kv_heads)
        self.groups = [g for g in self.registration.kernel_groups if g.opaque_pages is not None]
        self.spec = self.engine.spec_of(self.names(0)[0])

    def names(self, index: int) -> list[str]:
        names: list[str] = self.engine.config.kv_cache_groups[self.groups[index].engine_group].layer_names
        return names

    def states(self, buf: torch.Tensor, name: str) -> list[torch.Tensor]:
        """Layer ``name``'s states ``[NB, *shape]`` over ``buf``, as
        ``MambaBase.bind_kv_cache`` slices the page."""
        raw, flat, offset, views = self.raw[name], buf.view(-1), 0, []
        for shape, dtype in zip(self.spec.shapes, self.spec.dtypes, strict=True):
            size = math.prod(shape) * dtype.itemsize
            page = flat.as_strided((raw.shape[0], size), (raw.stride(0), 1), raw.storage_offset() + offset)
            views.append(page.view(dtype).view(raw.shape[0], *shape))
            offset += size
        return views

    def held(self, state: int) -> tuple[int, torch.Tensor]:
        """State ``state``'s split axis and the model's indices this rank holds on it."""
        axis, parts = self.family.splits(self.layout)[state]
        if self.family.tp_replicated:  # every rank holds every index
            return axis, _slices(parts, 1, 0)
        return axis, _slices(parts, self.tp, self.rank)


def _common(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    where = {int(g): i for i, g in enumerate(src)}
    pairs = [(where[int(g)], j) for j, g in enumerate(dst) if int(g) in where]
    return torch.tensor([p[0] for p in pairs], dtype=torch.long), torch.tensor(
        [p[1] for p in pairs], dtype=torch.long
    )


def expected_after(
    src: Rank, dst: Rank, index: int, src_blocks: list[int], dst_blocks: list[int]
) -> torch.Tensor:
    """dst's buffer once group ``index``'s state both ranks hold moved from src's blocks
    into dst's; every other byte as it was (between ranks alike, the page's padding moves
    too: the page moves whole; a TP-replicated state's ranks of one degree are alike)."""
    out = dst.buf.clone()
    for name in dst.names(index):
        if (src.tp, src.rank) == (dst.tp, dst.rank) or (src.family.tp_replicated and src.tp == dst.tp):
            for b, c in zip(src_blocks, dst_blocks, strict=True):
                out.view(-1)[_page(dst, name, c)] = src.buf.view(-1)[_page(src, name, b)]
            continue
        s_states, d_states = src.states(src.buf, name), dst.states(out, name)
        for i, (s, d) in enumerate(zip(s_states, d_states, strict=True)):
            axis, s_index = src.held(i)
            _, d_index = dst.held(i)
            spos, dpos = _common(s_index, d_index)
            for b, c in zip(src_blocks, dst_blocks, strict=True):
                d[c].index_copy_(axis, dpos, s[b].index_select(axis, spos))
    return out


def _page(rank: Rank, name: str, block: int) -> slice:
    """Block ``block``'s page of layer ``name`` (padding too) in the rank's buffer."""
    raw = rank.raw[name]
    start = raw.storage_offset() + block * raw.stride(0)
    return slice(start, start + rank.spec.page_size_bytes)


PAIRS = [
    ((1, 0), (2, 1)),
    ((2, 1), (1, 0)),
    ((2, 0), (4, 1)),
    ((4, 3), (2, 1)),
    ((1, 0), (4, 2)),
    ((2, 1), (2, 1)),
]


@pytest.mark.parametrize("family", [LFM2, BAILING_LINEAR, JAMBA, NEMOTRON_H], ids=lambda f: f.name)
@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize(("src_at", "dst_at"), PAIRS)
def test_state_moves_between_tp_degrees_byte_exactly(
    family: Family, layout: str, src_at: tuple[int, int], dst_at: tuple[int, int], monkeypatch: Any
) -> None:
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", layout)  # vLLM lays every conv state out so
    src = Rank(family, *src_at, layout, seed=1)
    dst = Rank(family, *dst_at, layout, seed=2)
    assert len(src.groups) == len(dst.groups) > 0
    for index in range(len(dst.groups)):
        expected = expected_after(src, dst, index, [2], [1])
        m = block_map(
            src.groups[index], dst.groups[index], [2], [1], src_shard=src.shard, dst_shard=dst.shard
        )
        assert m.kind == ("same layout" if src_at == dst_at else "resharded state")
        m.copy()
        assert torch.equal(dst.buf, expected)


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize(("src_at", "dst_at"), [*PAIRS, ((2, 0), (2, 1))])
def test_a_tp_replicated_state_moves_whole_between_any_ranks(
    layout: str, src_at: tuple[int, int], dst_at: tuple[int, int], monkeypatch: Any
) -> None:
    """A ``tp_replicated`` spec (Qwen4's PLE conv: every rank holds the whole state) moves
    whole between ranks of any TP degrees, as vLLM's NixlConnector copies its pages whole;
    each degree pads it to its own attention page, so between degrees it is re-laid. It
    was read as a page of no known split: refused between ranks of two TP degrees."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", layout)
    src, dst = Rank(PLE, *src_at, layout, seed=1), Rank(PLE, *dst_at, layout, seed=2)
    arrays = dst.groups[0].opaque_pages.arrays
    assert arrays and all(x.replicated for x in arrays)
    expected = expected_after(src, dst, 0, [2], [1])
    m = block_map(src.groups[0], dst.groups[0], [2], [1], src_shard=src.shard, dst_shard=dst.shard)
    assert m.kind == ("re-laid" if src_at[0] != dst_at[0] else "same layout") and m.latents
    m.copy()
    assert torch.equal(dst.buf, expected)


def test_align_mode_pages_move_block_by_block(monkeypatch: Any) -> None:
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    src, dst = Rank(LFM2, 1, 0, "DS", seed=3, mode="align"), Rank(LFM2, 2, 1, "DS", seed=4, mode="align")
    expected = expected_after(src, dst, 0, [0, 3], [2, 1])
    m = block_map(src.groups[0], dst.groups[0], [0, 3], [2, 1], src_shard=src.shard, dst_shard=dst.shard)
    assert m.kind == "resharded state" and m.num_runs == len(m.src.layers) * 2  # a run a block a layer
    m.copy()
    assert torch.equal(dst.buf, expected)


def test_one_state_pages_read_as_vllm_s_calculator_splits_them(monkeypatch: Any) -> None:
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    assert Rank(LFM2, 2, 0, "DS", seed=5).groups[0].opaque_pages.arrays == (
        PageArray(0, (1024, 2), "bfloat16", 0, (1024,)),
    )
    monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT")  # vLLM's default: "SD", the dim inside the rows
    assert Rank(LFM2, 2, 0, "SD", seed=5).groups[0].opaque_pages.arrays == (
        PageArray(0, (2, 1024), "bfloat16", 1, (1024,)),
    )
    assert Rank(BAILING_LINEAR, 4, 0, "SD", seed=5).groups[0].opaque_pages.arrays == (
        PageArray(0, (4, 128, 128), "bfloat16", 0, (4,)),
    )


def test_a_short_conv_page_under_a_layout_vllm_refuses_declares_no_arrays(monkeypatch: Any) -> None:
    """vLLM refuses any other value of the variable, so no page is laid out by it; read
    so, the page has no known split and moves only whole, rank to the same rank."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "ds")
    spec = vx.kvi.MambaSpec(
        block_size=16, shapes=((2, 1024),), dtypes=(torch.bfloat16,),
        mamba_type=_backends().SHORT_CONV,
    )  # fmt: skip
    assert state_arrays(spec) == ()
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "SD")
    assert state_arrays(spec) == (PageArray(0, (2, 1024), "bfloat16", 1, (1024,)),)


def _backends() -> Any:
    import importlib

    return importlib.import_module("vllm.v1.attention.backends.registry").MambaAttentionBackendEnum


def test_short_conv_pages_of_two_orders_are_refused(monkeypatch: Any) -> None:
    """A peer that lays its conv states out in the other order holds the same columns in
    other bytes: refused, naming the order."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "SD")
    src = Rank(LFM2, 1, 0, "SD", seed=6)
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    dst = Rank(LFM2, 2, 1, "DS", seed=7)
    with pytest.raises(
        BlockMapError, match=r'other axes or parts \(another order, as vLLM\'s conv states "DS"'
    ):
        block_map(src.groups[0], dst.groups[0], [0], [0], src_shard=src.shard, dst_shard=dst.shard)


@pytest.mark.parametrize(("src_at", "dst_at"), [((1, 0), (2, 1)), ((2, 0), (4, 1)), ((4, 1), (2, 0))])
def test_mamba2_of_one_group_is_refused_between_tp_degrees(
    src_at: tuple[int, int], dst_at: tuple[int, int], monkeypatch: Any
) -> None:
    """``n_groups`` 1 is replicated on every rank
    (``extra_groups_for_head_shards``), so a rank's ``B`` is the model's whole group at
    any degree; the page's sizes cannot say so (a model of as many groups as ranks has the
    same page), and the map refuses rather than move slices that are not there."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    src, dst = Rank(MAMBA2_ONE_GROUP, *src_at, "DS", seed=8), Rank(MAMBA2_ONE_GROUP, *dst_at, "DS", seed=9)
    assert dst.groups[0].opaque_pages.arrays[0].parts == (1024 // dst_at[0], 32, 32)
    with pytest.raises(
        BlockMapError, match=r"its part 1 is 32 of \d+ at TP \d and 32 of \d+ at TP \d\. The model's"
    ):
        block_map(src.groups[0], dst.groups[0], [0], [0], src_shard=src.shard, dst_shard=dst.shard)
    same = Rank(MAMBA2_ONE_GROUP, *dst_at, "DS", seed=10)
    m = block_map(same.groups[0], dst.groups[0], [0], [3], src_shard=same.shard, dst_shard=dst.shard)
    assert m.kind == "same layout"  # a rank's page moves whole to the same rank of the same degree


def test_conv_states_with_speculative_rows_are_refused_beside_ones_without(monkeypatch: Any) -> None:
    """A decode instance drafting 2 tokens (MTP, EAGLE) keeps ``conv_kernel - 1 + 2``
    conv rows (``mamba2_state_shape``'s ``num_spec``); a prefill instance without drafts
    keeps 3: the conv states are other arrays, refused naming the axis."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    drafting = Family(
        "Nemotron-H-MTP", "MAMBA2", NEMOTRON_H.attn_1,
        lambda calc, tp: calc.mamba2_state_shape(tp, 1024, 8, 16, 64, 32, 4, num_spec=2),
        NEMOTRON_H.dtypes, NEMOTRON_H.splits, 8, vx.FLASH_ATTN, NEMOTRON_H.layers,
    )  # fmt: skip
    src, dst = Rank(NEMOTRON_H, 1, 0, "DS", seed=11), Rank(drafting, 2, 1, "DS", seed=12)
    assert dst.groups[0].opaque_pages.arrays[0].shape == (768, 5)
    with pytest.raises(BlockMapError, match=r"state array 0 is .* other sizes on an axis TP does not shard"):
        block_map(src.groups[0], dst.groups[0], [0], [0], src_shard=src.shard, dst_shard=dst.shard)


def _with_mtp(tp: int, seed: int) -> tuple[Any, torch.Tensor, Any]:
    """Qwen3.5-0.8B and its MTP drafter's attention layer, which vLLM 0.33 plans with the
    target's (one spec, so one bucket: ``_get_kv_cache_groups_uniform_page_size``)."""
    model = vx.QWEN3_5_0_8B
    layers = [(model.layer_name(i), model.is_full_attention(i)) for i in range(model.num_hidden_layers)]
    layers.append(("mtp.layers.0.self_attn.attn", True))
    engine = vx.state_hybrid_engine(
        vx.attention_spec(model, tp, 1), vx.gdn_states(model, tp, "DS"), "GDN_ATTN", vx.FLASHINFER, layers,
        mamba_cache_mode="none", max_model_len=40960,
    )  # fmt: skip
    buf, raw = vx.allocate_v033(engine)
    vx.fill_random(buf, seed)
    return engine, buf, vx.detect_registered(engine, raw, HINTS, edited=True, prefix_reuse=False)


def test_an_mtp_drafter_s_attention_layer_moves_with_the_target_s() -> None:
    """The drafter's layer joins the target's attention group; a request's blocks of it
    move with the target layers' (here rank to the same rank: whole pages)."""
    (src_engine, src_buf, src), (dst_engine, dst_buf, dst) = _with_mtp(2, 13), _with_mtp(2, 14)
    index = next(i for i, g in enumerate(dst.kernel_groups) if g.opaque_pages is None)
    names = dst_engine.config.kv_cache_groups[dst.kernel_groups[index].engine_group].layer_names
    assert names[-1] == "mtp.layers.0.self_attn.attn" and len(names) == 7
    expected = dst_buf.clone()
    for name in names:
        page = dst_engine.spec_of(name).page_size_bytes
        (_, s_base, s_stride), (_, d_base, d_stride) = (
            vx.page_region(e, [b], "v033", name) for e, b in ((src_engine, src_buf), (dst_engine, dst_buf))
        )
        expected[d_base + 2 * d_stride : d_base + 2 * d_stride + page] = src_buf[
            s_base + 1 * s_stride : s_base + 1 * s_stride + page
        ]
    shard = Shard(1, 2, vx.QWEN3_5_0_8B.num_key_value_heads)
    block = dst.kernel_groups[index].block_size
    m = block_map(
        src.kernel_groups[index], dst.kernel_groups[index], [1], [2], num_tokens=block, src_shard=shard,
        dst_shard=shard,
    )  # fmt: skip
    assert len(m.src.layers) == 7
    m.copy()
    assert torch.equal(dst_buf, expected)


def test_pages_no_calculator_lays_out_declare_no_arrays(monkeypatch: Any) -> None:
    """Shapes and dtypes of other counts, a short convolution beside an SSM state, and a
    linear-attention state not ``(heads, head_dim, head_dim)``: no vLLM calculator lays
    these out, so no split is known and the page moves whole, rank to the same rank."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "SD")
    kinds = _backends()
    for shapes, dtypes, kind in (
        (((2, 1024), (4, 8, 8)), (torch.bfloat16,), kinds.MAMBA2),
        (((2, 1024),), (torch.bfloat16, torch.float32), kinds.SHORT_CONV),
        (((2, 1024), (8, 4, 4)), (torch.bfloat16, torch.float32), kinds.SHORT_CONV),
        (((4, 1, 1, 128),), (torch.bfloat16,), kinds.LINEAR),
    ):
        spec = vx.kvi.MambaSpec(block_size=16, shapes=shapes, dtypes=dtypes, mamba_type=kind)
        assert state_arrays(spec) == (), (shapes, dtypes, kind)
