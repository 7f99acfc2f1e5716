"""Properties over every (engine, format) detection can return, with random sizes,
dtypes and allocations (see kvlayout.testing.registrations)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout import UndefinedSizeError
from kvlayout.testing.registrations import CASES, RegistrationCase, flatten, registrations


def test_every_detectable_format_has_a_case() -> None:
    """Every format but the deprecated ones (10 and 11), for each engine it lists."""
    deprecated = {int(f) for f in F if kvlayout.catalog.registry.format_info(f).replaced_by is not None}
    assert deprecated == {10, 11}
    assert {v for _, v in CASES} == {int(f) for f in F} - deprecated
    assert ("sglang", 14) in CASES and ("max", 19) in CASES


def _check_accessors(case: RegistrationCase, kv: Any, fmt: F) -> None:
    assert kvlayout.get_num_layers(kv, fmt) == case.nl
    if case.nb is None:
        with pytest.raises(UndefinedSizeError, match="num_blocks is undefined"):
            kvlayout.get_num_blocks(kv, fmt)
        with pytest.raises(UndefinedSizeError, match="block_size is undefined"):
            kvlayout.get_block_size(kv, fmt)
    else:
        assert kvlayout.get_num_blocks(kv, fmt) == case.nb
        assert kvlayout.get_block_size(kv, fmt) == case.bs
    last = case.nl - 1
    assert kvlayout.get_page_buffer_size(kv, fmt, last) == case.pbs
    assert kvlayout.get_tokens_per_layer(kv, fmt) == case.pbs
    assert kvlayout.get_num_heads(kv, fmt, last) == case.nh
    assert kvlayout.get_head_size(kv, fmt, last) == case.hs
    assert kvlayout.get_hidden_dim_size(kv, fmt) == case.nh * case.hs
    kv_size = case.kv_size
    assert kv_size is not None
    assert kvlayout.get_kv_size(kv, fmt) == kv_size
    assert kvlayout.get_elements_per_layer(kv, fmt) == kv_size * case.pbs * case.nh * case.hs
    assert kvlayout.get_dtype(kv, fmt, last) == case.dtype
    assert kvlayout.get_device(kv) == torch.device("cpu")
    assert kvlayout.is_mla(fmt) == kvlayout.layout_of(fmt).is_mla


@settings(max_examples=400)
@given(registrations())
def test_detection_returns_the_format_and_its_sizes(case: RegistrationCase) -> None:
    fmt, kv = kvlayout.normalize_kv_and_discover_format(case.kv, case.engine, case.hints)
    assert fmt == case.fmt, case
    _check_accessors(case, kv, fmt)
    # Views only: the pointer table is the engine's tensors, in their order.
    ptrs = kvlayout.get_group_data_ptrs(kv, fmt, list(range(case.nl)))
    leaves = case.leaves[:1] if kvlayout.layout_of(fmt).is_cross_layer else case.leaves
    assert ptrs == [t.data_ptr() for t in leaves]
    storages = {t.untyped_storage().data_ptr() for t in case.leaves}
    assert {t.untyped_storage().data_ptr() for t in flatten(kv)} <= storages
    # Leaves have the layout's shape (17's planes have their own widths).
    spec = kvlayout.get_spec(kv, fmt)
    if fmt != F.NL_X_NP_X_NB_BS_ONE_HS:
        expected = kvlayout.layout_of(fmt).tensor_shape(spec.sizes())
        assert {tuple(t.shape) for t in flatten(kv)} == {expected}
    if kvlayout.layout_of(fmt).is_kv_second_tuple:
        assert all(type(layer) is tuple for layer in kv)
    assert kvlayout.get_concrete_engine_kv_shape(kv, fmt) == spec.concrete_shape_str()
    assert not kvlayout.get_concrete_engine_kv_shape(kv, fmt).startswith("Unknown")


@settings(max_examples=300)
@given(registrations())
def test_per_layer_discovery_agrees_with_whole_detection(case: RegistrationCase) -> None:
    fmt, whole = kvlayout.normalize_kv_and_discover_format(case.kv, case.engine, case.hints)
    per_layer, formats = kvlayout.normalize_and_discover_per_layer_formats(
        case.kv, None, case.engine, case.hints
    )
    assert formats == [fmt] * case.nl
    assert [(t.shape, t.stride(), t.data_ptr()) for t in flatten(per_layer)] == [
        (t.shape, t.stride(), t.data_ptr()) for t in flatten(whole)
    ]


@settings(max_examples=150)
@given(registrations(), st.integers(0, 3))
def test_writes_through_the_result_reach_the_engine_tensors(case: RegistrationCase, which: int) -> None:
    _, kv = kvlayout.normalize_kv_and_discover_format(case.kv, case.engine, case.hints)
    out = flatten(kv)[which % len(flatten(kv))]
    index = tuple(n - 1 for n in out.shape)  # the last element: every stride counts
    out[index] = 1
    assert any(bool((t.to(torch.float32) != 0).any()) for t in case.leaves)


@settings(max_examples=150)
@given(registrations())
def test_descriptors_and_grouping_for_every_format(case: RegistrationCase) -> None:
    fmt, kv = kvlayout.normalize_kv_and_discover_format(case.kv, case.engine, case.hints)
    formats = [fmt] * case.nl
    groups = kvlayout.group_layers_by_identity(kv, formats)
    assert [layers for _, layers in groups] == [list(range(case.nl))]
    identity = groups[0][0]
    assert (identity.kv_size, identity.num_heads, identity.head_size, identity.block_size, identity.dtype) == (
        case.kv_size, case.nh, case.hs, case.bs, case.dtype,
    )  # fmt: skip
    stride = kvlayout.resolve_block_stride_and_log_layout(kv, fmt, 0, 0)
    assert (stride is not None) == kvlayout.layout_of(fmt).has_leading_block_axis
    desc = kvlayout.make_page_buffer_shape_desc(
        kv, fmt, 0, case.nl, case.nb or 1, case.bs or case.pbs, stride
    )
    assert (desc.kv_size, desc.nl, desc.nh, desc.hs, desc.element_size) == (
        case.kv_size, case.nl, case.nh, case.hs, case.dtype.itemsize,
    )  # fmt: skip
    rendered = kvlayout.get_concrete_engine_kv_shape_from_shape_desc(desc, fmt)
    if case.nb is not None:
        assert rendered == kvlayout.get_concrete_engine_kv_shape(kv, fmt)
    assert "Unknown" not in rendered
