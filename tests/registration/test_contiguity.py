"""attempt_permute_to_contiguous_view: physical dim order, zero-copy, clear rejections."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvlayout
from kvlayout import KVLayoutError, StridedViewError
from kvlayout.registration.contiguity import dim0_padding, physical_order

recover = kvlayout.attempt_permute_to_contiguous_view


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.data_ptr() == b.data_ptr()


def test_contiguous_tensors_come_back_as_the_same_object() -> None:
    t = torch.zeros(2, 7, 3, 2, 4)
    assert recover(t) is t
    kv = [torch.zeros(7, 3, 4) for _ in range(3)]
    out = recover(kv)
    assert isinstance(out, list) and out is not kv
    assert all(o is i for o, i in zip(out, kv, strict=True))


def test_tuples_become_lists_and_nesting_is_kept() -> None:
    k, v = torch.zeros(7, 3, 2, 4), torch.zeros(7, 3, 2, 4)
    out: Any = recover(((k, v), [k, v]))
    assert type(out) is list and [type(x) for x in out] == [list, list]
    assert [[t is k for t in pair] for pair in out] == [[True, False], [True, False]]


def test_an_hnd_allocation_exposed_as_nhd_is_recovered_without_a_copy() -> None:
    physical = torch.arange(2 * 7 * 2 * 3 * 4, dtype=torch.float32).view(2, 7, 2, 3, 4)  # [2, NB, NH, BS, HS]
    logical = physical.permute(0, 1, 3, 2, 4)  # what vLLM exposes: [2, NB, BS, NH, HS]
    out = recover(logical)
    assert isinstance(out, torch.Tensor)
    assert out.shape == physical.shape and out.stride() == physical.stride()
    assert same_storage(out, logical)
    out[1, 6, 1, 2, 3] = -1.0  # a write through the result reaches the engine's tensor
    assert logical[1, 6, 2, 1, 3] == -1.0


def test_a_size_1_dim_goes_inside_a_dim_of_equal_stride() -> None:
    """vLLM BLNHC with one head: logical [NB, 1, BS, HS], head and token strides both HS."""
    physical = torch.zeros(6, 4, 1, 8)  # [NB, BS, NH=1, HS]
    logical = physical.permute(0, 2, 1, 3)
    assert logical.stride() == (32, 8, 8, 1)
    out = recover(logical)
    assert isinstance(out, torch.Tensor)
    assert tuple(out.shape) == (6, 4, 1, 8)
    # One head under HND: physical [2, NB, 1, BS, HS] exposed as [2, NB, BS, 1, HS].
    hnd = torch.zeros(2, 7, 1, 3, 4)
    out = recover(hnd.permute(0, 1, 3, 2, 4))
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (2, 7, 1, 3, 4)


@pytest.mark.parametrize("shape", [(7, 1, 3, 4), (1, 7, 4), (7, 3, 1), (1, 1, 1), (2, 1, 1, 3, 4)])
def test_size_1_dims_of_a_fresh_tensor_never_move(shape: tuple[int, ...]) -> None:
    t = torch.zeros(shape)
    assert recover(t) is t


@pytest.mark.parametrize("shape", [(0, 3, 4), (3, 0, 4), (2, 7, 0, 2, 4)])
def test_zero_size_dims_never_crash_or_move(shape: tuple[int, ...]) -> None:
    t = torch.zeros(shape)
    assert recover(t) is t
    flipped = t.transpose(0, -1)
    assert recover(flipped) is flipped  # no elements: nothing to misread


def test_dim0_padding_is_accepted_as_is() -> None:
    base = torch.zeros(6, 3 * 2 * 8 + 5)
    padded = base[:, : 3 * 2 * 8].view(6, 3, 2, 8)
    assert recover(padded) is padded
    assert dim0_padding(padded) == 5
    # blocks-first view buf[:, layer] of [NB, NL, ...] with an HND exposure on top
    buf = torch.zeros(6, 3, 2, 4, 8)  # [NB, NL, NH, BS, CS]
    view = buf[:, 1].transpose(1, 2)
    out = recover(view)
    assert isinstance(out, torch.Tensor)
    assert tuple(out.shape) == (6, 2, 4, 8) and out.stride() == (192, 32, 8, 1)
    assert same_storage(out, view)


def test_a_padded_row_of_one_element_is_still_dim0_padding() -> None:
    t = torch.zeros(2, 2)[:, :1].view(2, 1, 1)
    assert recover(t) is t


def _strided(shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    return torch.zeros(256).as_strided(shape, stride)


@pytest.mark.parametrize(
    ("tensor", "reason"),
    [
        (torch.zeros(3, 4, 5)[..., :2], "dim 1 stride 5 != tight 2 (interior padding is not supported)"),
        (torch.zeros(3, 4, 5)[:, :, ::2], "innermost dim 2 has stride 2 != 1 (elements are not contiguous)"),
        (_strided((4, 3), (2, 1)), "dim 0 stride 2 < 3, the elements of one block row (overlapping blocks)"),
        (
            torch.zeros(1, 3, 4).expand(5, 3, 4),
            "dim 0 has stride 0 (a broadcast view: its 5 entries overlap)",
        ),
        (
            torch.zeros(1, 3, 6)[:, :, :4],
            "dim 1 carries padding inside a size-1 outer dim; only dim-0 block rows may be padded",
        ),
        (torch.zeros(8)[::2], "ndim < 2 (a strided vector has no block rows to pad)"),
    ],
)
def test_other_strided_views_are_rejected_with_the_reason(tensor: torch.Tensor, reason: str) -> None:
    with pytest.raises(StridedViewError, match=re.escape(reason)) as info:
        recover([torch.zeros(1), [tensor]])
    message = str(info.value)
    assert message.startswith(
        "kv_caches[1][0]: tensor is non-contiguous and not a supported (dim-0 padding only)"
    )
    assert f"shape={tuple(tensor.shape)}, stride={tensor.stride()}" in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("kv", "error", "message"),
    [
        (None, TypeError, "kv_caches: is None; a KV cache is a tensor or a list/tuple of tensors"),
        ({"layer.0": torch.zeros(2)}, TypeError, "kv_caches: is a dict; pass the tensors as a list"),
        ("kv", TypeError, "kv_caches: is a str, not a tensor or a list/tuple of tensors"),
        ([torch.zeros(2), 3], TypeError, "kv_caches[1]: is a int, not a tensor"),
        ([[torch.zeros(2)], [None]], TypeError, "kv_caches[1][0]: is None"),
    ],
)
def test_non_tensors_are_type_errors(kv: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        recover(kv)


def test_self_referencing_lists_are_an_error_not_a_recursion_error() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(KVLayoutError, match=re.escape("is nested more than 8 list levels deep")):
        recover(loop)


def test_empty_lists_are_kept() -> None:
    assert recover([]) == []
    assert recover([[], []]) == [[], []]


@st.composite
def permuted_views(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(a permuted view, the contiguous or dim-0-padded buffer behind it, the padding)."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=2, max_size=5)))
    pad = draw(st.sampled_from([0, 0, 1, 3]))
    row = math.prod(shape[1:])
    physical = torch.arange(shape[0] * (row + pad), dtype=torch.float32).view(shape[0], row + pad)
    physical = physical[:, :row].view(shape)
    perm = draw(st.permutations(range(len(shape))))
    return physical.permute(*perm), physical, pad


@given(permuted_views())
def test_any_permutation_of_a_buffer_recovers_its_memory_order(
    case: tuple[torch.Tensor, torch.Tensor, int],
) -> None:
    view, physical, _ = case
    out = recover(view)
    assert isinstance(out, torch.Tensor)
    assert same_storage(out, view)
    assert sorted(zip(out.shape, out.stride(), strict=True)) == sorted(
        zip(view.shape, view.stride(), strict=True)
    )
    # The row-major walk of the result is the buffer's memory walk.
    assert torch.equal(out.reshape(-1), physical.reshape(-1))
    if 1 not in physical.shape:
        assert out.shape == physical.shape and out.stride() == physical.stride()
    assert physical_order(out.shape, out.stride()) == list(range(out.dim()))
    out[(0,) * out.dim()] = -1  # writes reach the original
    assert physical[(0,) * physical.dim()] == -1
