"""The bound registration: what detection returns answers like the generated specs read
the tensors, overlapping tensors are refused, formats that do not fit the structure and
descriptors that do not fit the tensors are errors, engine groups never merge, and the
memory rule (which bytes a tensor occupies) is exact."""

from __future__ import annotations

import pickle
import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout import KVLayoutError, RegisteredKV, RegistrationError, UndefinedSizeError
from kvlayout.registration.memory import Run, check_disjoint
from kvlayout.testing.registrations import RegistrationCase, flatten, registrations


def t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


# -- detection's registration answers as the specs read the tensors ----------------------------


def _spec_answers(kv: Any, fmt: F, layer: int) -> dict[str, object]:
    """What the generated spec says about one layer of a plain registration (the
    pre-registration facade read exactly this)."""
    spec = kvlayout.get_spec(kv, fmt)
    out: dict[str, object] = {
        "num_layers": spec.num_layers(),
        "page_buffer_size": spec.page_buffer_size(layer),
        "kv_size": spec.kv_size(),
        "num_heads": spec.num_heads(layer),
        "head_size": spec.head_size(layer),
        "hidden_dim": spec.hidden_dim(layer),
        "dtype": spec.dtype(layer),
    }
    try:
        out["num_blocks"], out["block_size"] = spec.num_blocks(layer), spec.block_size(layer)
    except UndefinedSizeError:
        out["num_blocks"] = out["block_size"] = None
    return out


def _facade_answers(kv: Any, fmt: F, layer: int) -> dict[str, object]:
    out: dict[str, object] = {
        "num_layers": kvlayout.get_num_layers(kv, fmt),
        "page_buffer_size": kvlayout.get_page_buffer_size(kv, fmt, layer),
        "kv_size": kvlayout.get_kv_size(kv, fmt),
        "num_heads": kvlayout.get_num_heads(kv, fmt, layer),
        "head_size": kvlayout.get_head_size(kv, fmt, layer),
        "hidden_dim": kvlayout.get_hidden_dim_size(kv, fmt, layer),
        "dtype": kvlayout.get_dtype(kv, fmt, layer),
    }
    try:
        out["num_blocks"] = kvlayout.get_num_blocks(kv, fmt, layer)
        out["block_size"] = kvlayout.get_block_size(kv, fmt, layer)
    except UndefinedSizeError:
        out["num_blocks"] = out["block_size"] = None
    return out


@settings(max_examples=200)
@given(registrations(), st.data())
def test_the_registration_answers_as_the_specs_read_the_tensors(
    case: RegistrationCase, data: st.DataObject
) -> None:
    fmt, kv = kvlayout.normalize_kv_and_discover_format(case.kv, case.engine, case.hints)
    assert type(kv) is RegisteredKV or isinstance(kv, torch.Tensor)
    plain = list(kv) if isinstance(kv, RegisteredKV) else kv
    for layer in range(case.nl):
        assert _facade_answers(kv, fmt, layer) == _spec_answers(plain, fmt, layer)
        assert _facade_answers(plain, fmt, layer) == _spec_answers(plain, fmt, layer)  # bound now
    layers = data.draw(st.lists(st.integers(0, case.nl - 1), min_size=1, max_size=case.nl, unique=True))
    spec_ptrs = kvlayout.get_spec(plain, fmt).data_ptrs(layers)
    assert kvlayout.get_group_data_ptrs(kv, fmt, layers) == spec_ptrs
    assert kvlayout.get_group_data_ptrs(plain, fmt, layers) == spec_ptrs
    # One kernel group; its identity is LMCache's seven fields read off the spec.
    (identity, members), *rest = kvlayout.group_layers_by_identity(kv, [fmt] * case.nl)
    assert not rest and members == list(range(case.nl))
    a = _spec_answers(plain, fmt, 0)
    assert identity[:7] == (a["kv_size"], a["num_heads"], a["head_size"], a["block_size"], 0, a["dtype"], fmt)
    assert identity.num_blocks == a["num_blocks"]


@settings(max_examples=150)
@given(registrations())
def test_per_layer_and_whole_detection_bind_the_same_kernel_group(case: RegistrationCase) -> None:
    whole = kvlayout.detect(case.kv, case.engine, case.hints)
    fmt, normalized = kvlayout.normalize_kv_and_discover_format(case.kv, case.engine, case.hints)
    per_layer, _ = kvlayout.normalize_and_discover_per_layer_formats(case.kv, None, case.engine, case.hints)
    for reg in (whole, getattr(normalized, "registration", whole), getattr(per_layer, "registration", whole)):
        (group,) = reg.kernel_groups
        assert group.format == fmt and group.layers == tuple(range(case.nl))
        assert group.data_ptrs == whole.kernel_groups[0].data_ptrs
        assert group.identity == whole.kernel_groups[0].identity


@settings(max_examples=100)
@given(registrations())
def test_a_prepared_plan_moves_what_the_functions_move(case: RegistrationCase) -> None:
    from kvlayout.transfer import prepare, store_blocks

    fmt, kv = kvlayout.normalize_kv_and_discover_format(case.kv, case.engine, case.hints)
    folded = None if case.nb is not None else 1
    plan = prepare(kv, fmt, block_size=folded)
    assert prepare(kv, fmt, block_size=folded) is plan  # prepared once
    for leaf in flatten(kv):
        leaf.view(torch.uint8).copy_(torch.randint(0, 256, leaf.view(torch.uint8).shape, dtype=torch.uint8))
    ids = list(range(plan.num_blocks))[::-1]
    shape, dtype = plan.chunk_shape(plan.block_size)  # one block per chunk
    via_plan = [torch.zeros(shape, dtype=dtype) for _ in ids]
    via_function = [torch.zeros(shape, dtype=dtype) for _ in ids]
    plan.store_blocks(ids, via_plan)
    plain = list(kv) if isinstance(kv, RegisteredKV) else kv
    store_blocks(plain, fmt, ids, via_function, block_size=folded)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(via_plan, via_function, strict=True)
    )


# -- overlapping tensors ---------------------------------------------------------------------------


OVERLAP = "overlap in memory"


def test_a_view_overlapping_another_layer_is_refused() -> None:
    """(One tensor registered for two layers is a shared KV cache: tests/detection/test_kv_sharing.py.)"""
    n = 2 * 7 * 3 * 2 * 4
    buf = torch.zeros(3 * n, dtype=torch.bfloat16)
    a, b = buf[:n].view(2, 7, 3, 2, 4), buf[n : 2 * n].view(2, 7, 3, 2, 4)
    shifted = buf[8 : 8 + n].view(2, 7, 3, 2, 4)  # a's bytes from its second token row on
    with pytest.raises(kvlayout.DetectionError, match=r"kv_caches\[2\] and kv_caches\[0\] overlap in memory"):
        kvlayout.normalize_kv_and_discover_format([a, b, shifted], "vllm", {"kv_layout": "NHD"})
    with pytest.raises(RegistrationError, match=r"kv\[2\] and kv\[0\] overlap in memory"):
        kvlayout.get_num_blocks([a, b, shifted], F.NL_X_TWO_NB_BS_NH_HS)
    from kvlayout.transfer import TransferError, store_blocks

    with pytest.raises(TransferError, match=OVERLAP):
        store_blocks([a, b, shifted], F.NL_X_TWO_NB_BS_NH_HS, [0], [torch.zeros(2, 3, 3, 8)])


def test_overlapping_slices_of_one_buffer_are_refused_and_adjacent_ones_are_not() -> None:
    n = 2 * 7 * 3 * 2 * 4
    buf = torch.zeros(4 * n)
    adjacent = [buf[i * n : (i + 1) * n].view(2, 7, 3, 2, 4) for i in range(3)]
    assert kvlayout.detect(adjacent, "vllm", {"kv_layout": "NHD"}).kernel_groups[0].layers == (0, 1, 2)
    shifted = [buf[i * (n - 8) : i * (n - 8) + n].view(2, 7, 3, 2, 4) for i in range(3)]
    with pytest.raises(RegistrationError, match=r"kv_caches\[1\] and kv_caches\[0\] overlap in memory"):
        kvlayout.detect(shifted, "vllm", {"kv_layout": "NHD"})


def test_blocks_first_layers_interleave_without_overlapping() -> None:
    pool = torch.zeros(7, 12, 3, 16)  # [NB, NL, BS, HS]: layer l is pool[:, l], dim-0 padded
    layers = [pool[:, i] for i in range(12)]
    reg = kvlayout.detect(layers, "vllm")
    assert reg.kernel_groups[0].block_stride_elems == 12 * 3 * 16
    assert kvlayout.detect([*layers[:11], layers[3]], "vllm").shared_layers == ((3, 11),)  # one column twice
    half_row = torch.as_strided(pool, layers[3].shape, layers[3].stride(), layers[3].storage_offset() + 8)
    with pytest.raises(RegistrationError, match=r"kv_caches\[11\] and kv_caches\[3\] overlap in memory"):
        kvlayout.detect([*layers[:11], half_row], "vllm")  # column 3 from half a row on


def test_plane_tuples_and_k_v_pairs_must_not_share_memory() -> None:
    k = t(7, 3, 2, 4)
    with pytest.raises(RegistrationError, match=r"kv\[0\]\[1\] and kv\[0\]\[0\] overlap in memory"):
        kvlayout.get_num_heads([(k, k)], F.NL_X_TWO_X_NB_BS_NH_HS)
    buf = torch.zeros(7 * 3 * 7)
    wide, narrow = buf[: 7 * 3 * 5].view(7, 3, 1, 5), buf[7 * 3 * 5 - 1 : 7 * 3 * 7 - 1].view(7, 3, 1, 2)
    with pytest.raises(RegistrationError, match=r"kv\[0\]\[1\] and kv\[0\]\[0\] overlap in memory"):
        kvlayout.bind([(wide, narrow)], F.NL_X_NP_X_NB_BS_ONE_HS)
    assert (
        kvlayout.bind([(wide, buf[7 * 3 * 5 :].view(7, 3, 1, 2))], F.NL_X_NP_X_NB_BS_ONE_HS).num_layers == 1
    )


def test_overlaid_engine_groups_need_layer_groups() -> None:
    """vLLM 0.33 overlays its KV cache groups on one buffer; within a group, layers are apart."""
    buf = torch.zeros(2, 7 * 3 * 16)
    group_a = [buf[0].view(7, 3, 16), buf[1].view(7, 3, 16)]
    group_b = [buf[0].view(7, 3, 16), buf[1].view(7, 3, 16)]  # the same bytes, another group
    reg = kvlayout.detect([*group_a, *group_b], "vllm", layer_groups=[[0, 1], [2, 3]])
    assert [g.layers for g in reg.kernel_groups] == [(0, 1), (2, 3)] and reg.shared_layers == ()
    # without the groups, the same views in one group are layers sharing a KV cache
    assert kvlayout.detect([*group_a, *group_b], "vllm").shared_layers == ((0, 2), (1, 3))
    shifted = [buf.view(-1)[16:].as_strided((7, 3, 16), (48, 16, 1)), buf[1].view(7, 3, 16)]
    with pytest.raises(
        RegistrationError, match="KV cache groups that vLLM overlays must be passed as layer groups"
    ):
        kvlayout.detect([*group_a, *shifted], "vllm")


def test_meta_and_empty_tensors_occupy_no_memory() -> None:
    meta = torch.empty(2, 7, 3, 2, 4, device="meta")
    assert kvlayout.detect([meta, meta], "vllm", {"kv_layout": "NHD"}).num_layers == 2
    empty = t(2, 0, 3, 2, 4)
    assert kvlayout.detect([empty, empty], "vllm", {"kv_layout": "NHD"}).num_layers == 2


@st.composite
def extents(draw: st.DrawFn) -> tuple[int, int, int, int]:
    block = draw(st.integers(1, 6))
    period = block + draw(st.integers(0, 6))
    return draw(st.integers(0, 60)), period, block, draw(st.integers(1, 5))


def _bytes(start: int, period: int, block: int, count: int) -> set[int]:
    return {start + k * period + b for k in range(count) for b in range(block)}


@settings(max_examples=500)
@given(extents(), extents())
def test_the_overlap_rule_is_exact(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> None:
    shared = bool(_bytes(*a) & _bytes(*b))
    runs = [Run(a[1], a[2], a[3], [a[0]], [(0,)], "kv"), Run(b[1], b[2], b[3], [b[0]], [(1,)], "kv")]
    if shared:
        with pytest.raises(KVLayoutError, match=OVERLAP):
            check_disjoint(runs, KVLayoutError, "")
    else:
        check_disjoint(runs, KVLayoutError, "")


@settings(max_examples=100)
@given(st.integers(1, 8), st.integers(1, 5), st.lists(st.integers(0, 200), min_size=9, max_size=20))
def test_the_vectorized_pool_rule_is_exact(block: int, pad: int, starts: list[int]) -> None:
    period, count = block + pad, 3
    shared = any(
        _bytes(x, period, block, count) & _bytes(y, period, block, count)
        for i, x in enumerate(starts)
        for y in starts[i + 1 :]
    )
    run = Run(period, block, count, starts, [(i,) for i in range(len(starts))], "kv")
    if shared:
        with pytest.raises(KVLayoutError, match=OVERLAP):
            check_disjoint([run], KVLayoutError, "")
    else:
        check_disjoint([run], KVLayoutError, "")


# -- formats that do not fit the structure ------------------------------------------------------


@pytest.mark.parametrize(
    ("kv", "fmt", "message"),
    [
        ([t(2, 7, 3, 2, 4)] * 1, F.NL_X_NB_BS_HS, "kv[0] has rank 5 (shape [2, 7, 3, 2, 4]); NL_X_NB_BS_HS needs rank 3"),
        ([t(2, 7, 3, 2, 4)], F.TWO_X_NL_X_NB_BS_NH_HS, "kv has 1 entries; TWO_X_NL_X_NB_BS_NH_HS needs 2 here"),
        ([t(7, 3, 2, 4), t(7, 3, 2, 4)], F.TWO_X_NL_X_NB_BS_NH_HS, "kv[0] is a Tensor, but TWO_X_NL_X_NB_BS_NH_HS has a list level here"),
        ([t(7, 5, 2, 3, 2, 4)], F.NB_NL_TWO_BS_NH_HS, "kv is a list, not a tensor (NB_NL_TWO_BS_NH_HS)"),
        ([t(3, 7, 3, 2, 4)], F.NL_X_TWO_NB_BS_NH_HS, "kv[0] has shape [3, 7, 3, 2, 4], but NL_X_TWO_NB_BS_NH_HS needs [2, 7, 3, 2, 4] there"),
        ([t(7, 3, 2, 4)], F.NL_X_TWO_X_NB_BS_NH_HS, "kv[0] is a Tensor, but NL_X_TWO_X_NB_BS_NH_HS has a list level here"),
        ([t(2, 7, 3, 2, 4).transpose(2, 3)], F.NL_X_TWO_NB_BS_NH_HS, "kv[0] has strides [168, 24, 4, 8, 1]; NL_X_TWO_NB_BS_NH_HS with these sizes needs [168, 24, 12, 4, 1]"),
        ([[t(7, 3, 2, 4)] * 0, [t(7, 3, 2, 4)]], F.TWO_X_NL_X_NB_BS_NH_HS, "kv[0] is empty"),
        ([[t(7, 3, 2, 4), t(7, 3, 2, 4)], [t(7, 3, 2, 4)]], F.TWO_X_NL_X_NB_BS_NH_HS, "kv[1] has 1 entries, so it has no entry 1"),
    ],
)  # fmt: skip
def test_a_format_that_does_not_fit_the_structure_is_an_error(kv: Any, fmt: F, message: str) -> None:
    with pytest.raises(KVLayoutError) as info:
        kvlayout.get_num_heads(kv, fmt)
    assert message in str(info.value)


def test_a_layer_read_in_another_format_than_detected_is_an_error() -> None:
    kv, formats = kvlayout.normalize_and_discover_per_layer_formats(
        [t(2, 7, 3, 2, 4), t(7, 3, 16)], [[0], [1]], "vllm", {"kv_layout": "NHD"}
    )
    assert formats == [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_BS_HS]
    assert kvlayout.get_head_size(kv, F.NL_X_NB_BS_HS, 1) == 16
    with pytest.raises(
        RegistrationError, match=re.escape("layer 1 is NL_X_NB_BS_HS, not NL_X_TWO_NB_BS_NH_HS")
    ):
        kvlayout.get_head_size(kv, F.NL_X_TWO_NB_BS_NH_HS, 1)


def test_a_format_detection_did_not_give_is_read_afresh() -> None:
    """[2, 2, ...] fits flash-attn and flash-infer: a caller may say which it is."""
    kv = [t(2, 2, 3, 2, 4) for _ in range(2)]
    fmt, normalized = kvlayout.normalize_kv_and_discover_format(kv, "vllm", {"kv_layout": "NHD"})
    assert fmt == F.NL_X_TWO_NB_BS_NH_HS
    assert kvlayout.get_num_blocks(normalized, F.NL_X_NB_TWO_BS_NH_HS) == 2
    assert kvlayout.get_block_size(normalized, F.NL_X_NB_TWO_BS_NH_HS) == 3


# -- descriptors that do not fit the tensors ------------------------------------------------------


@pytest.mark.parametrize(
    ("kv", "fmt", "args", "message"),
    [
        ([t(2, 7, 3, 2, 4)], F.NL_X_TWO_NB_BS_NH_HS, (0, 1, 8, 3), "num_blocks=8, but layer 0's tensors (NL_X_TWO_NB_BS_NH_HS) have 7"),
        ([t(2, 7, 3, 2, 4)], F.NL_X_TWO_NB_BS_NH_HS, (0, 1, 7, 4), "block_size=4, but layer 0's tensors (NL_X_TWO_NB_BS_NH_HS) have 3"),
        ([t(2, 7, 3, 2, 4)], F.NL_X_TWO_NB_BS_NH_HS, (0, 2, 7, 3), "num_layers_in_group=2, but the registration has 1 layers"),
        (t(7, 5, 2, 3, 2, 4), F.NB_NL_TWO_BS_NH_HS, (0, 4, 7, 3), "num_layers_in_group=4, but NB_NL_TWO_BS_NH_HS holds 5 layers in one tensor"),
        ([t(21, 1, 4)], F.NL_X_NBBS_ONE_HS, (0, 1, 5, 4), "num_blocks=5 x block_size=4 does not tile the 21 token slots"),
        ([torch.zeros(7, 30)[:, :24].view(7, 3, 2, 4)], F.NL_X_NB_BS_NH_HS, (0, 1, 7, 3), "blocks are padded (30 elements apart); pass block_stride_elems=30"),
        ([torch.zeros(7, 30)[:, :24].view(7, 3, 2, 4)], F.NL_X_NB_BS_NH_HS, (0, 1, 7, 3, 32), "block_stride_elems=32, but layer 0's blocks are 30 elements apart"),
    ],
)  # fmt: skip
def test_a_descriptor_that_does_not_fit_the_tensors_is_an_error(
    kv: Any, fmt: F, args: tuple[int, ...], message: str
) -> None:
    with pytest.raises(KVLayoutError, match=re.escape(message)):
        kvlayout.make_page_buffer_shape_desc(kv, fmt, *args)


def test_folded_formats_take_the_callers_split() -> None:
    desc = kvlayout.make_page_buffer_shape_desc([t(21, 1, 4)], F.NL_X_NBBS_ONE_HS, 0, 1, 7, 3)
    assert (desc.nb, desc.bs, desc.hs) == (7, 3, 4)


# -- engine groups ------------------------------------------------------------------------------


def test_identical_tensors_of_different_engine_groups_stay_apart() -> None:
    kv = [t(7, 3, 16) for _ in range(8)]
    groups = [[0, 2, 4, 6], [1, 3, 5, 7]]
    out, formats = kvlayout.normalize_and_discover_per_layer_formats(kv, groups, "vllm")
    grouped = kvlayout.group_layers_by_identity(out, formats)
    assert [(g.engine_group_idx, layers) for g, layers in grouped] == [(0, [0, 2, 4, 6]), (1, [1, 3, 5, 7])]
    merged = kvlayout.group_layers_by_identity(out, formats, [0] * 8)  # the caller may say otherwise
    assert [layers for _, layers in merged] == [list(range(8))]
    reg = kvlayout.detect(kv, "vllm", layer_groups=groups)
    assert [g.layers for g in reg.kernel_groups] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert reg.group(3).engine_group == 1
    assert kvlayout.get_group_data_ptrs(out, F.NL_X_NB_BS_HS, [1, 3, 5, 7]) == [
        kv[i].data_ptr() for i in (1, 3, 5, 7)
    ]


def test_a_hybrid_has_one_plan_per_kernel_group() -> None:
    from kvlayout.transfer import TransferError, prepare

    kv = [t(2, 7, 3, 2, 4), t(2, 7, 3, 2, 4), t(7, 3, 16)]
    reg = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
    assert [g.format for g in reg.kernel_groups] == [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_BS_HS]
    with pytest.raises(TransferError, match="the registration has 2 kernel groups"):
        prepare(reg, F.NL_X_TWO_NB_BS_NH_HS)
    plans = [prepare(g, g.format) for g in reg.kernel_groups]
    assert [p.chunk_shape(3)[0] for p in plans] == [(2, 2, 3, 8), (1, 1, 3, 16)]


# -- the registration object ---------------------------------------------------------------------


def test_what_detection_returns_is_a_read_only_list_carrying_its_registration() -> None:
    kv = [t(2, 7, 3, 2, 4) for _ in range(3)]
    fmt, out = kvlayout.normalize_kv_and_discover_format(kv, "vllm", {"kv_layout": "NHD"})
    assert isinstance(out, list) and out == kv and all(a is b for a, b in zip(out, kv, strict=True))
    assert isinstance(out, RegisteredKV) and out.registration.format == fmt
    with pytest.raises(TypeError, match="this registration is read-only"):
        out.append(t(2, 7, 3, 2, 4))
    with pytest.raises(TypeError, match="this registration is read-only"):
        out[0] = t(2, 7, 3, 2, 4)
    assert type(pickle.loads(pickle.dumps(out))) is list
    copied = list(out)
    copied.append(kv[0][:, :6])  # a copy is an ordinary list, checked when used
    with pytest.raises(RegistrationError, match=re.escape("kv[3] has dim-0 padding")):
        kvlayout.get_num_layers(copied, fmt)


def test_a_registration_describes_itself() -> None:
    reg = kvlayout.detect([t(7, 3, 16) for _ in range(4)], "vllm")
    assert repr(reg) == "Registration(vllm, 4 layers: layers 0-3: NL_X_NB_BS_HS [7, 3, 16] torch.bfloat16)"
    assert reg.format == F.NL_X_NB_BS_HS and reg.device == torch.device("cpu")
    group = reg.kernel_groups[0]
    assert group.descriptor().nb == 7 and group.concrete_shape() == "4 x [7, 3, 16]"
    with pytest.raises(RegistrationError, match="layer 4 is out of range for 4 layers"):
        reg.group(4)
    with pytest.raises(
        RegistrationError,
        match=re.escape("no layer of the registration is NL_X_TWO_NB_BS_NH_HS (it holds NL_X_NB_BS_HS)"),
    ):
        reg.first_group(F.NL_X_TWO_NB_BS_NH_HS)
    widths = kvlayout.detect([t(7, 3, 16), t(7, 3, 8)], "vllm")
    assert widths.format == F.NL_X_NB_BS_HS and len(widths.kernel_groups) == 2
    hybrid = kvlayout.detect([t(2, 7, 3, 2, 4), t(7, 3, 16)], "vllm", {"kv_layout": "NHD"})
    with pytest.raises(
        RegistrationError, match=re.escape("the registration has 2 formats (NL_X_NB_BS_HS, NL_X")
    ):
        hybrid.format  # noqa: B018


def test_layers_in_no_group_have_no_kernel_group() -> None:
    kv = [t(7, 3, 16) for _ in range(3)]
    out, formats = kvlayout.normalize_and_discover_per_layer_formats(kv, [[0, 2]], "vllm")
    assert formats == [F.NL_X_NB_BS_HS, None, F.NL_X_NB_BS_HS]
    with pytest.raises(
        RegistrationError, match=re.escape("layer 1 has no format (it was in no layer group)")
    ):
        kvlayout.get_num_blocks(out, F.NL_X_NB_BS_HS, 1)


def test_a_structure_that_contains_itself_is_an_error_not_a_hang() -> None:
    loop: list[Any] = []
    loop.append(loop)
    for call in (
        lambda: kvlayout.get_device(loop),
        lambda: kvlayout.normalize_kv_and_discover_format(loop, "vllm"),
        lambda: kvlayout.get_num_layers(loop, F.NL_X_NB_BS_HS),
    ):
        with pytest.raises(
            KVLayoutError, match=r"nested more than 8 list levels deep|is a list, not a tensor"
        ):
            call()


def test_group_by_and_layer_accessors_refuse_what_names_no_layer() -> None:
    """``group_by([0])`` put all 4 layers in group 0, ``[0.5, ...]`` made a group 0.5 and
    ``[0, 1]`` failed in ``zip``; ``layer_tensors(9)`` was ``[]`` and ``layer_ptrs(-1)`` a
    bare ``KeyError``."""
    reg = kvlayout.detect([torch.zeros(2, 8, 4, 2, 16) for _ in range(4)], "vllm", {"kv_layout": "NHD"})
    for groups in ([0], [0, 1]):
        with pytest.raises(RegistrationError, match=rf"engine_groups has {len(groups)} entries for 4 layers"):
            reg.group_by(groups)
    with pytest.raises(TypeError, match=r"engine_groups\[0\] must be an int, not float \(0.5\)"):
        reg.group_by([0.5, 0, 0, 0])  # type: ignore[list-item]
    group = reg.only_group()
    for layer in (9, -1):
        for accessor in (group.layer_tensors, group.layer_ptrs):
            with pytest.raises(
                KVLayoutError, match=rf"layer {layer} is not in this kernel group \(its layers: 0-3\)"
            ):
                accessor(layer)
    assert group.layer_ptrs(2) == [t.data_ptr() for t in group.layer_tensors(2)]


def test_bind_refuses_formats_that_name_no_layer_or_a_list_for_one_tensor() -> None:
    kv = [t(7, 3, 16) for _ in range(2)]
    with pytest.raises(RegistrationError, match=r"^no layer has a format$"):
        kvlayout.bind(kv, [None, None])
    with pytest.raises(
        RegistrationError, match=re.escape("kv is a Tensor, but NL_X_NB_BS_HS is a list of layers")
    ):
        kvlayout.bind(t(2, 7, 3, 16), [F.NL_X_NB_BS_HS] * 2)


def test_numbered_renames_the_layers_maps_pair_and_nothing_else() -> None:
    """``numbered`` keeps tensors, formats and pointer tables; kernel groups, their
    descriptions and ``labelled`` copies carry the engine's numbers. Numbers that are no
    numbering of these layers are refused by name."""
    kv = [torch.zeros(2, 3, 4, 2, 8) for _ in range(4)]
    reg = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"}, layer_groups=[[0, 2], [1, 3]])
    assert reg.numbered(range(4)) is reg
    n = reg.numbered([4, 5, 9, 12])
    assert [g.layer_ids for g in n.kernel_groups] == [(4, 9), (5, 12)]
    assert [g.layers for g in n.kernel_groups] == [(0, 2), (1, 3)]  # positions, as before
    assert [g.data_ptrs for g in n.kernel_groups] == [g.data_ptrs for g in reg.kernel_groups]
    assert [g.layers for g in n.describe().groups] == [(4, 9), (5, 12)]
    assert n.kernel_groups[1].describe().startswith("layers 5,12: ")
    assert n.labelled(kvlayout.EngineType.SGLANG).layer_ids == (4, 5, 9, 12)
    assert reg.layer_ids == (0, 1, 2, 3)  # the registration numbered is left as it was
    for ids, message in (
        ([0, 1, 2], "layer_ids has 3 entries for the registration's 4 layers"),
        ([0, 2, 1, 3], r"layer_ids \[0, 2, 1, 3\] must be distinct layer numbers >= 0, ascending"),
        ([0, 1, 1, 3], r"layer_ids \[0, 1, 1, 3\] must be distinct"),
        ([-1, 0, 1, 2], r"layer_ids \[-1, 0, 1, 2\] must be distinct"),
        ([0, 1, 2, 1 << 16], "layer_ids: layer 65536 is past a description's 65536 layers"),
    ):
        with pytest.raises(RegistrationError, match=message):
            reg.numbered(ids)
    with pytest.raises(TypeError, match=r"layer_ids\[3\] must be an int, not str"):
        reg.numbered([0, 1, 2, "3"])  # type: ignore[list-item]


def test_a_numbered_registration_s_lookups_say_they_take_positions() -> None:
    """Kernel groups and the registration's repr show the engine's numbers, lookups take
    positions: a number out of range says which the registration's layers are."""
    kv = [torch.zeros(2, 3, 4, 2, 8) for _ in range(4)]
    reg = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"}, layer_groups=[[0, 2], [1, 3]])
    n = reg.numbered([10, 20, 30, 40])
    with pytest.raises(KVLayoutError, match=r"^layer 10 is not in this kernel group \(its layers: 0,2; positions, "
                       r"numbered 10,30\)$"):  # fmt: skip
        n.kernel_groups[0].layer_tensors(10)
    with pytest.raises(
        RegistrationError, match=r"^layer 10 is out of range for 4 layers \(positions; the engine numbers them "
        r"10,20,30,40: position\(layer_id\) gives one's position\)$"
    ):  # fmt: skip
        n.group(10)
    assert [n.position(i) for i in (10, 20, 30, 40)] == [0, 1, 2, 3]
    assert n.group(n.position(30)).layer_tensors(n.position(30))[0].data_ptr() == kv[2].data_ptr()
    assert reg.position(3) == 3  # unnumbered: a layer is its position
    with pytest.raises(
        RegistrationError, match=r"^layer 25 is not one of this registration's layers \(10,20,30,40\)$"
    ):
        n.position(25)
    with pytest.raises(TypeError, match=r"layer_id must be an int, not str"):
        n.position("30")  # type: ignore[arg-type]
    assert n.kernel_groups[0].layer_tensors(2)[0].data_ptr() == kv[2].data_ptr()  # position 2: layer 30
    with pytest.raises(KVLayoutError, match=r"^layer 1 is not in this kernel group \(its layers: 0,2\)$"):
        reg.kernel_groups[0].layer_tensors(1)
    with pytest.raises(RegistrationError, match=r"^layer 10 is out of range for 4 layers$"):
        reg.group(10)
