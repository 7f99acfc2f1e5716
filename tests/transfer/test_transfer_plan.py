"""The CUDA kernels' piece decomposition, compiled for the host, against the offset oracle.

``kvlayout._native.device_units`` runs the kernels' own mapping (``plan::task_of``,
``plan::with_depth``, ``plan::for_each_unit`` and ``plan::offsets_at`` from
``csrc/include/kvlayout/transfer_plan.h``) over the whole grid of a call and lists every
unit a thread would copy. Every byte of every moved block must appear exactly once, at
the cache address the oracle gives, for every format, so the kernels' logic is tested
without a GPU (``scripts/gpu_check.sh`` runs the kernels themselves).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlayout
from kvlayout import EngineKVFormat, _native
from kvlayout.layout.algebra import Coord, offset
from kvlayout.transfer import TransferError, TransferPlan, prepare
from kvlayout.transfer.cuda import narrow_unit, segment_table
from tests.transfer.registrations import DTYPES, make_registration
from tests.transfer.test_transfer import NBBS

FORMATS = list(EngineKVFormat)

# (pointer index, cache byte from that pointer) of each (chunk index, chunk byte)
ByteMap = dict[tuple[int, int], tuple[int, int]]


def oracle_bytes(
    plan: TransferPlan, ids: list[int], tokens: list[int], per_chunk: int, skip: int
) -> list[ByteMap]:
    """Per job: where each chunk byte of the moved blocks lives in the cache, per the oracle."""
    layout = plan.layout
    maps = []
    for job in plan.jobs:
        sizes, element = job.sizes, job.element_size
        nh, hs = layout.num_heads(sizes), layout.head_size(sizes)
        out: ByteMap = {}
        for i, block in enumerate(ids[skip:], start=skip):
            c, first = divmod(i, per_chunk)
            for kv in range(plan.kv_size):
                for layer in range(plan.num_layers):
                    for j in range(plan.block_size):
                        row = (
                            (kv * plan.num_layers + layer) * tokens[c] + first * plan.block_size + j
                        ) * plan.row_bytes
                        for h in range(nh):
                            for e in range(hs):
                                coord = Coord(layer, kv, block, j, h, e)
                                ptr, off = offset(layout, coord, sizes, job.block_stride or None)
                                at = row + job.row_offset + (h * hs + e) * element
                                for b in range(element):
                                    out[(c, at + b)] = (ptr, off * element + b)
        maps.append(out)
    return maps


def grid_bytes(rows: np.ndarray, unit: int) -> ByteMap:
    """The same map from the units the grid copies; a byte copied twice fails here."""
    out: ByteMap = {}
    for ptr, cache, chunk_index, chunk in rows.tolist():
        for b in range(unit):
            key = (chunk_index, chunk + b)
            assert key not in out, f"chunk byte {key} is copied twice"
            out[key] = (ptr, cache + b)
    return out


def check_grid(plan: TransferPlan, ids: list[int], per_chunk: int, skip: int, partial: bool) -> None:
    n_chunks = -(-len(ids) // per_chunk)
    tokens = [per_chunk * plan.block_size] * n_chunks
    if partial:
        tokens[-1] = (len(ids) - (n_chunks - 1) * per_chunk) * plan.block_size
    expected = oracle_bytes(plan, ids, tokens, per_chunk, skip)
    id_array, token_array = np.array(ids, dtype=np.int64), np.array(tokens, dtype=np.int64)
    for job, want in zip(plan.jobs, expected, strict=True):
        table = segment_table(plan, job)
        unit = table.unit
        while unit >= job.element_size:  # narrower chunk pointers narrow the unit per call
            rows = _native.device_units(plan._native_job(job), id_array, token_array, per_chunk, skip, unit)
            assert grid_bytes(rows, unit) == want, f"{plan} unit {unit}"
            unit //= 2


@st.composite
def sizes(draw: st.DrawFn) -> dict[str, int]:
    side = st.integers(1, 3)
    return {
        "NL": draw(side),
        "NB": draw(st.integers(1, 5)),
        "BS": draw(side),
        "NH": draw(side),
        "HS": draw(st.integers(1, 4)),
        "NP": draw(st.integers(1, 3)),
        "KV": draw(st.sampled_from((1, 2))),  # a K/V axis the tensors size (MAX)
    }


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # formats 10 and 11 are deprecated
@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
@settings(max_examples=12, deadline=None)
@given(sizes(), st.data())
def test_the_kernels_decomposition_copies_every_byte_where_the_oracle_says(
    fmt: EngineKVFormat, sizes: dict[str, int], data: st.DataObject
) -> None:
    layout = kvlayout.layout_of(fmt)
    dtype = torch.uint8 if layout.is_indexer else data.draw(st.sampled_from(DTYPES))
    pad = data.draw(st.integers(0, 5)) if layout.has_leading_block_axis else 0
    reg = make_registration(layout, sizes, dtype, pad=pad)
    plan = prepare(reg.kv, fmt, **({"block_size": sizes["BS"]} if fmt in NBBS else {}))
    ids = data.draw(st.lists(st.integers(0, sizes["NB"] - 1), min_size=1, max_size=4))
    per_chunk = data.draw(st.integers(1, 3))
    skip = data.draw(st.integers(0, len(ids)))
    check_grid(plan, ids, per_chunk, skip, data.draw(st.booleans()))


def test_planes_of_different_widths_and_dtypes_decompose_into_one_row() -> None:
    """Two jobs (one per plane) fill a shared chunk row at their own offsets."""
    layers = [
        (torch.zeros(5, 4, 1, 6, dtype=torch.uint8), torch.zeros(5, 4, 1, 3, dtype=torch.float16))
        for _ in range(2)
    ]
    plan = prepare(layers, EngineKVFormat.NL_X_NP_X_NB_BS_ONE_HS)
    assert len(plan.jobs) == 2
    check_grid(plan, [3, 1, 4], per_chunk=2, skip=1, partial=True)


def test_a_plane_that_does_not_align_in_the_chunk_row_is_refused() -> None:
    """A chunk row is one array of elements: a 4-byte plane beside 6 bytes of bf16 would
    land between two of its elements (the layout was named twice)."""
    layers = [
        (torch.zeros(3, 2, 1, 3, dtype=torch.bfloat16), torch.zeros(3, 2, 1, 1, dtype=torch.float32))
        for _ in range(2)
    ]
    with pytest.raises(
        TransferError,
        match=r"^NL_X_NP_X_NB_BS_ONE_HS: a 4-byte plane does not align in a 10-byte chunk row$",
    ):
        prepare(layers, EngineKVFormat.NL_X_NP_X_NB_BS_ONE_HS)


@pytest.mark.parametrize(
    ("fmt", "sizes", "dtype", "unit", "depth"),
    [
        (
            EngineKVFormat.NL_X_TWO_NB_BS_NH_HS,
            {"NL": 2, "NB": 4, "BS": 16, "NH": 8, "HS": 128},
            torch.bfloat16,
            16,
            0,
        ),
        (
            EngineKVFormat.NL_X_TWO_NB_NH_BS_HS,
            {"NL": 2, "NB": 4, "BS": 16, "NH": 8, "HS": 128},
            torch.bfloat16,
            16,
            2,
        ),
        (EngineKVFormat.NL_X_NB_BSV_BSS, {"NL": 2, "NB": 4, "BS": 16}, torch.uint8, 4, 2),  # 4-byte scales
        (
            EngineKVFormat.NL_X_NB_BS_HS,
            {"NL": 2, "NB": 4, "BS": 16, "HS": 3},
            torch.bfloat16,
            2,
            0,
        ),  # 6-byte rows
        (EngineKVFormat.NL_X_NB_BS_HS, {"NL": 2, "NB": 4, "BS": 16, "HS": 3}, torch.float32, 4, 0),
    ],
)
def test_the_copy_unit_is_the_widest_that_tiles_every_segment(
    fmt: EngineKVFormat, sizes: dict[str, int], dtype: torch.dtype, unit: int, depth: int
) -> None:
    reg = make_registration(kvlayout.layout_of(fmt), sizes, dtype)
    plan = prepare(reg.kv, fmt)
    table = segment_table(plan, plan.jobs[0])
    assert (table.unit, table.depth) == (unit, depth)
    assert table.rows.shape == (
        plan.kv_size * sizes["NL"] * (2 if fmt == EngineKVFormat.NL_X_NB_BSV_BSS else 1),
        128,
    )


def test_pointers_narrow_the_unit() -> None:
    assert narrow_unit(16, [0x1008], 2) == 8  # a pointer 8-byte aligned only
    assert narrow_unit(16, [0x1000, 0x2004], 2) == 4
    assert narrow_unit(16, [0x1002], 4) == 2  # a foreign pointer below its element: what it allows
    assert narrow_unit(4, [0x1000], 2) == 4  # never above what the segments allow


def test_a_plan_the_kernels_cannot_walk_is_refused() -> None:
    reg = make_registration(
        kvlayout.layout_of(1), {"NL": 1, "NB": 2, "BS": 2, "NH": 1, "HS": 2}, torch.float32
    )
    plan = prepare(reg.kv, 1)
    job = list(plan._native_job(plan.jobs[0]))
    pieces = job[5].copy()
    pieces[0, 3] = 1 << 31  # a run past 31 bits
    job[5] = pieces
    with pytest.raises(ValueError, match=r"a run is outside \[0, 2\^31\)"):
        _native.plan_segments(tuple(job))


def test_a_registration_or_kernel_group_is_prepared_without_naming_its_format() -> None:
    """A kernel group knows its format: ``prepare(group)`` was a ``TypeError``."""
    kv = [torch.zeros(2, 8, 4, 2, 16) for _ in range(2)]
    reg = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
    assert prepare(reg) is prepare(reg.only_group()) is prepare(reg.only_group(), reg.format)
    with pytest.raises(TypeError, match=r"prepare\(list\) needs its format: prepare\(kv, fmt\)"):
        prepare(kv)
    hybrid = kvlayout.detect([*kv, torch.zeros(8, 4, 32)], "vllm", {"kv_layout": "NHD"})
    with pytest.raises(kvlayout.KVLayoutError, match="kernel group"):
        prepare(hybrid)


def test_a_copy_past_2_gib_is_cut_into_segments_the_grid_still_copies_exactly() -> None:
    """Format 21 keeps each head's blocks together: two heads of 2.4 GiB each put the
    second head past the segments' 31-bit offsets, so its copy is cut into a segment per
    head (the plan was refused). The cache is reserved, never touched: the grid's
    decomposition is checked against the oracle's addresses."""
    fmt = EngineKVFormat.NL_X_NH_NB_BS_CS
    leaf = torch.empty(2, 600_000, 8, 256, dtype=torch.bfloat16)  # [NH, NB, BS, CS]
    plan = prepare([leaf], fmt)
    (job,) = plan.jobs
    table = segment_table(plan, job)
    assert len(table.rows) == 2  # one segment per head
    check_grid(plan, [599_999, 3], 2, 0, False)
