"""Every int kvlayout takes is read with ``operator.index`` (NumPy and torch integers
too, never a bool), and ints out of any range get an error of the family, never a
binding's signature dump, a ``KeyError`` or a value read with the wrong sign."""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout.catalog.registry import as_format
from kvlayout.transfer import BlockMapError, TransferError, block_map, prepare


def layers(n: int = 3) -> list[torch.Tensor]:
    return [torch.zeros(7, 3, 16) for _ in range(n)]


def test_num_threads_past_int32_is_capped_not_a_signature_dump() -> None:
    """2**31 threads used to print nanobind's whole signature of ``run()`` (a TypeError)."""
    kv = [torch.randn(7, 3, 16) for _ in range(2)]
    plan = prepare(kv, F.NL_X_NB_BS_HS)
    chunk = torch.zeros(plan.chunk_shape(6)[0])
    for threads in (2**31, 2**63, 10**30):
        plan.store_blocks([1, 2], [chunk], num_threads=threads)
    assert torch.equal(chunk[0, 1, :3], kv[1][1]) and torch.equal(chunk[0, 0, 3:], kv[0][2])


def test_num_threads_past_int32_never_aborts_the_process() -> None:
    code = textwrap.dedent(
        """
        import torch
        from kvlayout.transfer import prepare
        plan = prepare([torch.randn(7, 3, 16)], 3)
        chunk = torch.zeros(plan.chunk_shape(21)[0])
        plan.load_blocks(list(range(7)), [chunk], num_threads=2**40)
        print("done")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-2000:]


@pytest.mark.parametrize(
    "ids", [torch.tensor([0, 2]), np.array([0, 2]), [np.int64(0), np.int32(2)], (torch.tensor(0), 2)]
)
def test_layer_indices_of_a_pointer_table_may_be_numpy_or_torch_integers(ids: Any) -> None:
    """``get_group_data_ptrs(kv, fmt, torch.tensor([0, 1]))`` raised ``KeyError: tensor(0)``."""
    kv = layers()
    fmt, reg = kvlayout.normalize_kv_and_discover_format(kv, "vllm")
    expected = [kv[0].data_ptr(), kv[2].data_ptr()]
    assert kvlayout.get_group_data_ptrs(reg, fmt, ids) == expected
    assert kvlayout.get_group_data_ptrs(kv, fmt, ids) == expected  # bound now, same answer


def test_a_bool_layer_index_is_still_refused() -> None:
    fmt, reg = kvlayout.normalize_kv_and_discover_format(layers(), "vllm")
    with pytest.raises(TypeError, match=re.escape("layer_indices[1] must be an int, not bool")):
        kvlayout.get_group_data_ptrs(reg, fmt, [0, True])


@pytest.mark.parametrize("value", [np.int64(3), np.int32(3), np.uint8(3), torch.tensor(3)])
def test_a_format_may_be_a_numpy_or_torch_integer(value: Any) -> None:
    assert as_format(value) is F.NL_X_NB_BS_HS
    kv = layers()
    assert kvlayout.get_num_blocks(kv, value) == 7
    assert kvlayout.bind(kv, value).format is F.NL_X_NB_BS_HS
    assert kvlayout.get_group_data_ptrs(kv, value, [1]) == [kv[1].data_ptr()]
    with pytest.raises(
        kvlayout.KVLayoutError, match="an engine KV format is an EngineKVFormat, int or str, not"
    ):
        as_format(np.bool_(True))  # type: ignore[arg-type]


def test_descriptor_arguments_may_be_numpy_integers() -> None:
    kv = layers()
    n: Any = np.int64
    desc = kvlayout.make_page_buffer_shape_desc(kv, n(3), n(0), n(3), n(7), n(3), n(48))
    assert (desc.nl, desc.nb, desc.bs, desc.block_stride_elems) == (3, 7, 3, 48)
    assert all(type(v) is int for v in (desc.nl, desc.nb, desc.bs, desc.block_stride_elems))
    with pytest.raises(TypeError, match="num_blocks must be an int, not float"):
        kvlayout.make_page_buffer_shape_desc(kv, 3, 0, 3, 7.0, 3)  # type: ignore[arg-type]


def test_engine_groups_may_be_numpy_integers() -> None:
    kv = layers(4)
    fmt, reg = kvlayout.normalize_kv_and_discover_format(kv, "vllm")
    options: list[Any] = [np.array([0, 0, 1, 1]), [np.int64(0), np.int64(0), np.int8(1), np.int8(1)]]
    for groups in options:
        grouped = kvlayout.group_layers_by_identity(reg, [fmt] * 4, groups)
        assert [(identity.engine_group_idx, members) for identity, members in grouped] == [
            (0, [0, 1]),
            (1, [2, 3]),
        ]
    with pytest.raises(TypeError, match=re.escape("per_layer_engine_group_idx[1] must be an int, not str")):
        kvlayout.group_layers_by_identity(reg, [fmt] * 4, [0, "0", 1, 1])  # type: ignore[list-item]


@pytest.mark.parametrize(
    "groups", [[np.array([0, 1]), np.array([2])], np.array([[0, 1, 2]]), [torch.tensor([0, 2]), [1]]]
)
def test_layer_index_groups_may_be_numpy_or_torch_arrays(groups: Any) -> None:
    kv = layers()
    _, formats = kvlayout.normalize_and_discover_per_layer_formats(kv, groups, "vllm")
    assert formats == [F.NL_X_NB_BS_HS] * 3
    registration = kvlayout.detect(kv, "vllm", layer_groups=groups)
    assert registration.num_layers == 3


def test_a_two_dimensional_layer_group_is_still_refused() -> None:
    with pytest.raises(TypeError, match=re.escape("layer_index_groups[0] is a ndarray, not a sequence")):
        kvlayout.normalize_and_discover_per_layer_formats(
            layers(),
            [np.zeros((1, 3), dtype=np.int64)],  # type: ignore[list-item]
            "vllm",
        )


def test_sizes_may_be_numpy_integers() -> None:
    layout = kvlayout.layout_of(F.NL_X_NB_BS_HS)
    sizes: dict[str, Any] = {"NB": np.int64(7), "BS": np.int32(3), "HS": np.int16(16)}
    assert layout.tensor_shape(sizes) == (7, 3, 16)
    with pytest.raises(kvlayout.KVLayoutError, match=re.escape("size NB=True is not a non-negative int")):
        layout.tensor_shape({"NB": True, "BS": 3, "HS": 16})


def test_torch_uint64_block_ids_past_int64_are_named_not_read_as_negative() -> None:
    """A uint64 id of 2**63 + 5 used to read as -9223372036854775803."""
    plan = prepare(layers(1), F.NL_X_NB_BS_HS)
    chunk = torch.zeros(plan.chunk_shape(6)[0])
    ids = torch.tensor([1, 2**63 + 5], dtype=torch.uint64)
    with pytest.raises(TransferError) as info:
        plan.store_blocks(ids, [chunk])
    assert (
        str(info.value)
        == "block_ids[1] = 9223372036854775813 is out of range for any cache (above 2**63 - 1)"
    )
    plan.store_blocks(torch.tensor([1, 2], dtype=torch.uint64), [chunk])  # in range: moved


def test_a_folded_format_s_block_size_may_be_a_numpy_integer() -> None:
    kv = [torch.randn(12, 2, 8) for _ in range(2)]  # SGLang's [NB*BS, NH, HS] pools, K then V
    plan = prepare([kv[:1], kv[1:]], F.TWO_X_NL_X_NBBS_NH_HS, block_size=np.int64(4))  # type: ignore[arg-type]
    assert (plan.num_blocks, plan.block_size) == (3, 4)
    with pytest.raises(TransferError, match="block_size must be an int, got True"):
        prepare([kv[:1], kv[1:]], F.TWO_X_NL_X_NBBS_NH_HS, block_size=True)


def test_the_kv_pair_axis_hint_may_be_a_numpy_integer() -> None:
    kv = [torch.zeros(2, 7, 3, 2, 4)]
    fmt, _ = kvlayout.normalize_kv_and_discover_format(
        kv, "vllm", {"kv_layout": "NHD", "kv_pair_axis": np.int64(0)}
    )
    assert fmt is F.NL_X_TWO_NB_BS_NH_HS


def test_description_extents_may_be_numpy_integers() -> None:
    from kvlayout.layout.description import Axis, describe

    desc = describe(F.NL_X_NB_BS_HS, {"NL": 2, "NB": 7, "BS": 3, "HS": 16})
    extents: dict[Any, Any] = {**desc.extents, Axis.B: np.int64(7)}
    rebuilt = type(desc)(grouping=desc.grouping, kv_packing=desc.kv_packing, dims=desc.dims, extents=extents)
    assert rebuilt.resolved_strides() == (48, 16, 1)


def test_a_kv_cache_where_the_format_goes_says_which_function_returns_which_order() -> None:
    """``kv, formats = normalize_and_discover_per_layer_formats(...)`` is the reverse of
    ``fmt, kv = normalize_kv_and_discover_format(...)`` (LMCache's orders): a swap said only
    that a format is not a Tensor."""
    kv = layers()
    for wrong in (kv, kv[0]):
        with pytest.raises(
            kvlayout.KVLayoutError, match=r"a KV cache went where the format goes \(normalize_kv"
        ):
            kvlayout.get_num_blocks(kv, wrong)  # type: ignore[arg-type]


BOOL_IDS = [  # (ids, where the message says the bool is)
    ([True, 1], "[0]"),
    ((0, np.True_), "[1]"),
    ([2, torch.tensor(True)], "[1]"),
    ([3, np.array(False)], "[1]"),  # a 0-d NumPy bool array
    (collections.deque([5, True]), "[1]"),  # a sequence that is no list, NumPy reads as one
    (np.array([0, 1], dtype=bool), ""),  # refused by dtype
    (torch.tensor([False, True]), ""),
]


@pytest.mark.parametrize(
    ("ids", "named"),
    BOOL_IDS,
    ids=["list", "tuple", "torch-in-list", "numpy-0d-in-list", "deque", "numpy", "torch"],
)
def test_a_bool_among_block_ids_or_slots_is_refused_not_read_as_0_or_1(ids: Any, named: str) -> None:
    """``[True, 1]`` read as blocks ``[1, 1]``: a silent wrong answer at every entry point
    that takes block ids (a map's blocks or slot mappings, a plan's calls)."""
    kv = [torch.zeros(2, 8, 4, 2, 8) for _ in range(2)]
    cache = kvlayout.bind(kv, F.NL_X_TWO_NB_BS_NH_HS)
    calls: list[tuple[str, Callable[[], object]]] = [
        ("src_blocks", lambda: block_map(cache, cache, ids, [2, 3])),
        ("dst_blocks", lambda: block_map(cache, cache, [2, 3], ids)),
        ("src_slots", lambda: block_map(cache, cache, src_slots=ids, dst_blocks=[2])),
        ("dst_slots", lambda: block_map(cache, cache, [2], dst_slots=ids)),
    ]
    for name, call in calls:
        with pytest.raises(BlockMapError, match=f"^{re.escape(name + named)}.*bool"):
            call()
    plan = prepare([torch.zeros(7, 3, 16)], F.NL_X_NB_BS_HS)
    chunk = torch.zeros(plan.chunk_shape(6)[0])
    with pytest.raises(TransferError, match=f"^{re.escape('block_ids' + named)}.*bool"):
        plan.store_blocks(ids, [chunk])


def test_a_torch_bool_scalar_is_no_int() -> None:
    """``operator.index(torch.tensor(True))`` is 1: a count or token given so read silently."""
    cache = kvlayout.bind([torch.zeros(2, 8, 4, 2, 8) for _ in range(2)], F.NL_X_TWO_NB_BS_NH_HS)
    with pytest.raises(BlockMapError, match=r"^num_tokens must be an int, got tensor\(True\)$"):
        block_map(cache, cache, [0], [1], num_tokens=torch.tensor(True))  # type: ignore[arg-type]
