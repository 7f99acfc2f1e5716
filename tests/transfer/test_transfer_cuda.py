"""The CUDA transfer: byte-equal to the CPU engine, for every format (needs a GPU).

Without a CUDA device these tests skip; `scripts/gpu_check.sh` runs them on a GPU
machine. The kernels' decomposition and unit choice are tested on the host everywhere
(tests/transfer/test_transfer_plan.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlayout
from kvlayout import EngineKVFormat
from kvlayout.transfer import TransferError, chunk_shape, load_blocks, prepare, store_blocks
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


def _cuda_plan() -> tuple[list[torch.Tensor], Any, list[torch.Tensor]]:
    kv = [torch.randn(2, 16, 4, 2, 16, device="cuda") for _ in range(2)]
    fmt, reg = kvlayout.normalize_kv_and_discover_format(kv, "vllm", {"kv_layout": "NHD"})
    plan = prepare(reg, fmt)
    return kv, plan, plan.chunks_for(4, 16)


@needs_gpu
def test_a_cuda_call_runs_on_the_current_stream_and_returns_before_the_bytes_move() -> None:
    """What the README says: the copy is queued on the current stream; num_threads is
    ignored; block ids are read during the call."""
    kv, plan, chunks = _cuda_plan()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]  # the stream is busy a while
        plan.store_blocks([3, 1, 2, 0], chunks, num_threads=1000)
        assert not side.query()  # returned with the copy still queued behind the sleep
    side.synchronize()
    assert torch.equal(chunks[0][1, 0, :4], kv[0][1, 3].reshape(4, 32))


@needs_gpu
def test_cuda_chunks_must_be_on_the_cache_s_device_and_the_cache_where_it_was() -> None:
    kv, plan, chunks = _cuda_plan()
    with pytest.raises(TransferError, match=r"chunks\[0\] is on cpu; the cache is on cuda"):
        plan.store_blocks([0, 1, 2, 3], [c.cpu() for c in chunks])
    kv[1].data = torch.randn(2, 16, 4, 2, 16, device="cuda")
    with pytest.raises(
        TransferError, match=r"kv_caches\[1\] was re-allocated .* detect the registration again"
    ):
        plan.store_blocks([0, 1, 2, 3], chunks)


@needs_gpu
def test_a_plan_prepared_on_one_stream_runs_on_another_and_holds_its_tables_for_it() -> None:
    """A connector prepares once (default stream) and moves on a load stream: the device
    tables are recorded on that stream, so dropping the plan while its copies are queued
    there cannot hand their memory to the next allocation on the default stream."""
    kv, plan, chunks = _cuda_plan()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # type: ignore[no-untyped-call]
        plan.store_blocks([3, 1, 2, 0], chunks)
    del plan  # its device tables go back to the allocator with the copy still queued on `side`
    scribble = [torch.full((1 << 16,), -1, dtype=torch.int64, device="cuda") for _ in range(64)]
    side.synchronize()
    del scribble
    assert torch.equal(chunks[0][1, 0, :4], kv[0][1, 3].reshape(4, 32))


@pytest.mark.skipif(not _cuda_ready() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_cache_on_the_second_gpu_moves_while_the_first_is_current() -> None:
    kv = [torch.randn(2, 16, 4, 2, 16, device="cuda:1") for _ in range(2)]
    fmt, reg = kvlayout.normalize_kv_and_discover_format(kv, "vllm", {"kv_layout": "NHD"})
    plan = prepare(reg, fmt)
    chunks = plan.chunks_for(4, 16)
    torch.cuda.set_device(0)
    plan.store_blocks([3, 1, 2, 0], chunks)
    torch.cuda.synchronize("cuda:1")
    assert torch.equal(chunks[0][1, 0, :4], kv[0][1, 3].reshape(4, 32))
