"""The CUDA transfer: byte-equal to the CPU engine, for every format (needs a GPU).

Without a CUDA device these tests skip; `scripts/gpu_check.sh` runs them on a GPU
machine. The kernels' decomposition and unit choice are tested on the host everywhere
(tests/transfer/test_transfer_plan.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlayout
from kvlayout import EngineKVFormat
from kvlayout.transfer import chunk_shape, load_blocks, store_blocks
from tests.transfer.registrations import make_registration
from tests.transfer.test_transfer import NBBS, cases, chunks_for, geometry


def _cuda_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from kvlayout import _cuda
    except ImportError:
        return False
    return bool(_cuda.device_count())


needs_gpu = pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device and kvlayout._cuda")


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
