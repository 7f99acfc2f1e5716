"""The CUDA transfer: byte-equal to the CPU engine, for every format (needs a GPU).

Without a CUDA device these tests skip; `scripts/gpu_check.sh` runs them on a GPU
machine. The unit choice is plain Python and is tested everywhere.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlayout
from kvlayout import EngineKVFormat
from kvlayout.cuda_transfer import copy_unit
from kvlayout.transfer import chunk_shape, load_blocks, store_blocks
from tests.registrations import make_registration
from tests.test_transfer import NBBS, cases, chunks_for, geometry


def _cuda_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from kvlayout import _cuda
    except ImportError:
        return False
    return bool(_cuda.device_count())


needs_gpu = pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device and kvlayout._cuda")

SIZES = {"NL": 32, "NB": 64, "BS": 16, "NH": 8, "HS": 128}


@pytest.mark.parametrize(
    ("fmt", "element_size", "unit"),
    [
        (EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, 2, 16),  # 2 KiB rows
        (EngineKVFormat.NL_X_TWO_NB_NH_BS_HS, 2, 16),  # 256-byte head rows
        (EngineKVFormat.NL_X_NB_BSV_BSS, 1, 4),  # 4-byte scales
    ],
)
def test_copy_unit_is_the_widest_that_tiles_every_run(
    fmt: EngineKVFormat, element_size: int, unit: int
) -> None:
    layout = kvlayout.layout_of(fmt)
    assert copy_unit(layout, SIZES, element_size, 0, [0x1000]) == unit


def test_copy_unit_respects_odd_widths_and_pointers() -> None:
    layout = kvlayout.layout_of(EngineKVFormat.NL_X_NB_BS_HS)
    assert copy_unit(layout, {**SIZES, "HS": 3}, 2, 0, [0x1000]) == 2  # 6-byte rows
    assert copy_unit(layout, SIZES, 2, 0, [0x1008]) == 8  # a pointer 8-byte aligned only
    assert copy_unit(layout, SIZES, 4, 0, [0x1002]) == 4  # never below the element


@needs_gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@settings(max_examples=60, deadline=None)
@given(cases(), st.data())
def test_cuda_store_and_load_equal_the_cpu_engine(
    case: tuple[EngineKVFormat, dict[str, int], torch.dtype, int], data: st.DataObject
) -> None:
    fmt, sizes, dtype, pad = case
    layout = kvlayout.layout_of(fmt)
    cpu = make_registration(layout, sizes, dtype, pad=pad)
    gpu = make_registration(layout, sizes, dtype, pad=pad, device=torch.device("cuda"))
    _, _, nb, block_size = geometry(fmt, sizes)
    ids = data.draw(st.lists(st.integers(0, nb - 1), min_size=1, max_size=nb, unique=True))
    per_chunk = data.draw(st.integers(1, 3))
    skip = data.draw(st.integers(0, len(ids)))
    bs = {"block_size": block_size} if fmt in NBBS else {}
    shape, _ = chunk_shape(cpu.kv, fmt, per_chunk * block_size, **bs)
    partial = data.draw(st.booleans())
    cpu_chunks = chunks_for(shape, dtype, len(ids), per_chunk, block_size, partial)
    gpu_chunks = [c.cuda() for c in cpu_chunks]
    store_blocks(cpu.kv, fmt, ids, cpu_chunks, skip_prefix_n_blocks=skip, **bs)
    store_blocks(gpu.kv, fmt, ids, gpu_chunks, skip_prefix_n_blocks=skip, **bs)
    torch.cuda.synchronize()
    for a, b in zip(cpu_chunks, gpu_chunks, strict=True):
        assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8))
    for base in (*cpu.bases, *gpu.bases):
        base.zero_()
    load_blocks(cpu.kv, fmt, ids, cpu_chunks, skip_prefix_n_blocks=skip, **bs)
    load_blocks(gpu.kv, fmt, ids, gpu_chunks, skip_prefix_n_blocks=skip, **bs)
    torch.cuda.synchronize()
    for a, b in zip(cpu.bases, gpu.bases, strict=True):
        assert torch.equal(a, b.cpu())
