"""Block transfer: the native engine against a reference built from the offset oracle,
round trips for every format, and bad input refused before any byte moves."""

from __future__ import annotations

import contextlib
import itertools
import math
import re
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlayout
from kvlayout import EngineKVFormat, _native
from kvlayout.layout.algebra import Coord, kv_size, offset, with_size
from kvlayout.layout.vocabulary import Role
from kvlayout.testing.strategies import role_size, sizes_for
from kvlayout.transfer import TransferError, chunk_shape, load_blocks, prepare, store_blocks
from tests.transfer.registrations import DTYPES, Registration, make_registration

FORMATS = list(EngineKVFormat)
NBBS = {f for f in FORMATS if kvlayout.layout_of(f).is_pbs_fused}


def geometry(fmt: EngineKVFormat, sizes: dict[str, int]) -> tuple[int, int, int, int]:
    """(kv_size, layers, blocks, tokens per block) of a registration of these sizes."""
    layout = kvlayout.layout_of(fmt)
    return (
        kv_size(layout, sizes),
        role_size(layout, sizes, Role.LAYER),
        role_size(layout, sizes, Role.BLOCK),
        role_size(layout, sizes, Role.TOKEN),
    )


def element_bytes(reg: Registration, ptr: int, off: int, itemsize: int) -> bytes:
    leaf = reg.leaves[ptr]
    start = (leaf.storage_offset() + off) * itemsize
    return bytes(reg.bases[ptr][start : start + itemsize].tolist())


def reference_store(
    fmt: EngineKVFormat, reg: Registration, sizes: dict[str, int], ids: list[int], tokens: list[int],
    per_chunk: int, skip: int, block_stride: int | None,
) -> list[bytearray]:  # fmt: skip
    """Chunks as bytes, element by element from the oracle (no plan, no indexer)."""
    layout = kvlayout.layout_of(fmt)
    itemsize = reg.leaves[0].element_size()
    nh, hs = layout.num_heads(sizes), layout.head_size(sizes)
    row = nh * hs
    kvs, nl, _, bs = geometry(fmt, sizes)
    out = [bytearray(kvs * nl * t * row * itemsize) for t in tokens]
    for i, block in enumerate(ids):
        if i < skip:
            continue
        c, first = divmod(i, per_chunk)
        for kv, layer, j, h, e in itertools.product(range(kvs), range(nl), range(bs), range(nh), range(hs)):
            ptr, off = offset(layout, Coord(layer, kv, block, j, h, e), sizes, block_stride)
            pos = (((kv * nl + layer) * tokens[c] + first * bs + j) * row + h * hs + e) * itemsize
            out[c][pos : pos + itemsize] = element_bytes(reg, ptr, off, itemsize)
    return out


@st.composite
def cases(draw: st.DrawFn) -> tuple[EngineKVFormat, dict[str, int], torch.dtype, int]:
    fmt = draw(st.sampled_from(FORMATS))
    layout = kvlayout.layout_of(fmt)
    sizes = draw(sizes_for(layout, max_side=3))
    sizes = with_size(layout, sizes, Role.BLOCK, draw(st.integers(2, 6)))
    dtype = torch.uint8 if layout.is_indexer else draw(st.sampled_from(DTYPES))
    pad = draw(st.integers(0, 3)) if kvlayout.layout_of(fmt).has_leading_block_axis else 0
    return fmt, sizes, dtype, pad


def chunks_for(
    shape: tuple[int, ...], dtype: torch.dtype, n_blocks: int, per_chunk: int, bs: int, partial: bool
) -> list[torch.Tensor]:
    n = -(-n_blocks // per_chunk)
    tokens = [per_chunk * bs] * n
    if partial:
        tokens[-1] = (n_blocks - (n - 1) * per_chunk) * bs
    return [torch.zeros((shape[0], shape[1], t, shape[3]), dtype=dtype) for t in tokens]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # formats 10 and 11 are deprecated
@settings(max_examples=40)
@given(cases(), st.data())
def test_store_matches_the_oracle_byte_for_byte(
    case: tuple[EngineKVFormat, dict[str, int], torch.dtype, int], data: st.DataObject
) -> None:
    fmt, sizes, dtype, pad = case
    layout = kvlayout.layout_of(fmt)
    reg = make_registration(layout, sizes, dtype, pad=pad)
    _, _, nb, block_size = geometry(fmt, sizes)
    ids = data.draw(st.lists(st.integers(0, nb - 1), min_size=1, max_size=7))  # repeats allowed
    per_chunk = data.draw(st.integers(1, 3))
    skip = data.draw(st.integers(0, len(ids)))
    threads = data.draw(st.integers(1, 2))
    bs = {"block_size": block_size} if fmt in NBBS else {}
    shape, chunk_dtype = chunk_shape(reg.kv, fmt, per_chunk * block_size, **bs)
    assert chunk_dtype == dtype
    chunks = chunks_for(shape, dtype, len(ids), per_chunk, block_size, data.draw(st.booleans()))
    store_blocks(reg.kv, fmt, ids, chunks, skip_prefix_n_blocks=skip, num_threads=threads, **bs)
    block_stride = reg.leaves[0].stride(0) if pad else None
    expected = reference_store(
        fmt, reg, sizes, ids, [c.shape[2] for c in chunks], per_chunk, skip, block_stride
    )
    for got, want in zip(chunks, expected, strict=True):
        assert bytes(got.view(torch.uint8).flatten().tolist()) == bytes(want)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@settings(max_examples=40)
@given(cases(), st.data())
def test_round_trip_restores_exactly_the_selected_blocks(
    case: tuple[EngineKVFormat, dict[str, int], torch.dtype, int], data: st.DataObject
) -> None:
    fmt, sizes, dtype, pad = case
    layout = kvlayout.layout_of(fmt)
    reg = make_registration(layout, sizes, dtype, pad=pad)
    original = [b.clone() for b in reg.bases]
    kvs, nl, nb, block_size = geometry(fmt, sizes)
    ids = data.draw(st.lists(st.integers(0, nb - 1), min_size=1, max_size=nb, unique=True))
    per_chunk = data.draw(st.integers(1, 3))
    skip = data.draw(st.integers(0, len(ids)))
    bs = {"block_size": block_size} if fmt in NBBS else {}
    shape, _ = chunk_shape(reg.kv, fmt, per_chunk * block_size, **bs)
    chunks = chunks_for(shape, dtype, len(ids), per_chunk, block_size, data.draw(st.booleans()))
    store_blocks(reg.kv, fmt, ids, chunks, skip_prefix_n_blocks=skip, **bs)
    for b in reg.bases:
        b.zero_()
    load_blocks(
        reg.kv, fmt, ids, chunks, skip_prefix_n_blocks=skip, num_threads=data.draw(st.integers(1, 2)), **bs
    )
    # The bytes the selected blocks own, per the oracle; everything else (padding too) stays zero.
    itemsize = dtype.itemsize
    block_stride = reg.leaves[0].stride(0) if pad else None
    expected = [torch.zeros_like(b) for b in reg.bases]
    for block in ids[skip:]:
        for kv, layer, j, h, e in itertools.product(
            range(kvs),
            range(nl),
            range(block_size),
            range(layout.num_heads(sizes)),
            range(layout.head_size(sizes)),
        ):
            ptr, off = offset(layout, Coord(layer, kv, block, j, h, e), sizes, block_stride)
            start = (reg.leaves[ptr].storage_offset() + off) * itemsize
            expected[ptr][start : start + itemsize] = original[ptr][start : start + itemsize]
    for got, want in zip(reg.bases, expected, strict=True):
        assert torch.equal(got, want)


def test_planes_of_different_widths_and_dtypes_share_a_row() -> None:
    """NL_X_NP_X_NB_BS_ONE_HS: a token's chunk row is its planes' bytes back to back."""
    gen = torch.Generator().manual_seed(1)
    nb, bs = 5, 4
    layers = [
        (torch.randint(0, 100, (nb, bs, 1, 6), generator=gen).to(torch.uint8),
         torch.randn(nb, bs, 1, 3, generator=gen).to(torch.float16))
        for _ in range(2)
    ]  # fmt: skip
    fmt = EngineKVFormat.NL_X_NP_X_NB_BS_ONE_HS
    shape, dtype = chunk_shape(layers, fmt, 2 * bs)
    assert (shape, dtype) == ((1, 2, 2 * bs, 6 + 3 * 2), torch.uint8)
    chunk = torch.zeros(shape, dtype=dtype)
    store_blocks(layers, fmt, [3, 1], [chunk])
    for layer, (latent, scale) in enumerate(layers):
        for n, block in enumerate([3, 1]):
            rows = chunk[0, layer, n * bs : (n + 1) * bs]
            assert torch.equal(rows[:, :6], latent[block, :, 0])
            assert torch.equal(rows[:, 6:].contiguous().view(torch.float16), scale[block, :, 0])
    restored = [(torch.zeros_like(a), torch.zeros_like(b)) for a, b in layers]
    load_blocks(restored, fmt, [3, 1], [chunk])
    for (a, b), (ra, rb) in zip(layers, restored, strict=True):
        assert torch.equal(ra[[3, 1]], a[[3, 1]]) and torch.equal(rb[[3, 1]], b[[3, 1]])
        assert not ra[[0, 2, 4]].any() and not rb[[0, 2, 4]].any()


def test_dsa_indexer_rows_are_values_then_scale() -> None:
    """The blocked page [BS x 128 values | BS x 4 scales] becomes rows [128 values | 4 scales]."""
    nb, bs = 3, 4
    page = torch.arange(nb * bs * 132, dtype=torch.int32).remainder(251).to(torch.uint8).view(nb, bs, 132)
    fmt = EngineKVFormat.NL_X_NB_BSV_BSS
    chunk = torch.zeros(chunk_shape([page], fmt, bs)[0], dtype=torch.uint8)
    store_blocks([page], fmt, [2], [chunk])
    flat = page[2].reshape(-1)
    for j in range(bs):
        assert torch.equal(chunk[0, 0, j, :128], flat[j * 128 : (j + 1) * 128])
        assert torch.equal(chunk[0, 0, j, 128:], flat[bs * 128 + j * 4 : bs * 128 + (j + 1) * 4])


@pytest.fixture
def flash_attn() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    kv = [torch.randn(2, 8, 4, 2, 16) for _ in range(3)]
    shape, dtype = chunk_shape(kv, 1, 8)
    return kv, [torch.full(shape, 7.0, dtype=dtype) for _ in range(2)]


BAD_INPUT = [
    (dict(block_ids=[0, 8, 1]), "block_ids[1] = 8 is out of range for 8 blocks"),
    (dict(block_ids=[0, -1]), "block_ids[1] = -1 is out of range for 8 blocks"),
    (dict(block_ids=[[0, 1]]), "block_ids must be a 1-D sequence of ints"),
    (dict(chunks="small"), "chunks[1] holds 4 tokens; it needs 8 or more, a multiple of the block size"),
    (dict(chunks="dtype"), "chunks[0] is torch.float16; the cache is torch.float32"),
    (dict(chunks="layout"), "chunks[0] has shape [3, 2, 8, 32]; this registration needs [2, 3, T, 32] (kv_size, layers, tokens, row)"),
    (dict(chunks="transposed"), "chunks[0] is not contiguous"),
    (dict(chunks="odd"), "chunk size 6 is not a positive multiple of the block size 4"),
    (dict(chunks="count"), "3 blocks at 2 blocks per chunk need 2 chunks, got 1"),
    (dict(fmt=6), "has strides"),
    (dict(fmt=3), "kv[0] has rank 5 (shape [2, 8, 4, 2, 16]); NL_X_NB_BS_HS needs rank 3"),
    (dict(fmt=4), "kv has 3 entries; TWO_X_NL_X_NBBS_NH_HS needs 2 here"),
    (dict(fmt=16), "kv[0] is a Tensor, but NL_X_TWO_X_NB_BS_NH_HS has a list level here"),
    (dict(skip=5), "skip_prefix_n_blocks=5 is outside [0, 3]"),
    (dict(threads=0), "num_threads must be a positive int"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "message"), BAD_INPUT, ids=[m[:40] for _, m in BAD_INPUT])
@pytest.mark.parametrize("move", [store_blocks, load_blocks])
def test_bad_input_is_refused_before_any_byte_moves(
    flash_attn: tuple[list[torch.Tensor], list[torch.Tensor]],
    change: dict[str, object],
    message: str,
    move: object,
) -> None:
    kv, chunks = flash_attn
    block_ids = change.get("block_ids", [5, 2, 7])
    kind = change.get("chunks")
    if kind == "small":
        block_ids = [5, 2, 7, 1]
        chunks[1] = chunks[1][:, :, :4].clone()
    elif kind == "dtype":
        chunks = [c.half() for c in chunks]
    elif kind == "layout":
        chunks = [c.transpose(0, 1).contiguous() for c in chunks]
    elif kind == "transposed":
        chunks = [c.transpose(2, 3).contiguous().transpose(2, 3) for c in chunks]
    elif kind == "odd":
        chunks = [c[:, :, :6].clone() for c in chunks]
    elif kind == "count":
        chunks = chunks[:1]
    if change.get("fmt") == 6:  # an NHD cache called HND: other strides (views of the same storage)
        kv = [t.transpose(2, 3) for t in kv]
    cache_before = [t.clone() for t in kv]
    chunks_before = [c.clone() for c in chunks]
    with pytest.raises(TransferError) as info:
        move(kv, change.get("fmt", 1), block_ids, chunks,  # type: ignore[operator]
             skip_prefix_n_blocks=change.get("skip", 0), num_threads=change.get("threads", 1))  # fmt: skip
    assert message in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(cache_before, kv, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(chunks_before, chunks, strict=True))


def test_nbbs_formats_need_the_block_size() -> None:
    kv = [[torch.randn(12, 2, 4) for _ in range(2)] for _ in range(2)]
    fmt = EngineKVFormat.TWO_X_NL_X_NBBS_NH_HS
    with pytest.raises(
        TransferError, match=r"folds its blocks and their tokens into one axis \(NBBS\): pass block_size="
    ):
        chunk_shape(kv, fmt, 8)
    with pytest.raises(TransferError, match=r"PBS=12 token slots are not divisible by block_size=5"):
        chunk_shape(kv, fmt, 10, block_size=5)
    shape, _ = chunk_shape(kv, fmt, 8, block_size=4)
    chunk = torch.zeros(shape)
    store_blocks(kv, fmt, [2, 0], [chunk], block_size=4)
    assert torch.equal(chunk[1, 1, :4], kv[1][1][8:12].reshape(4, 8))


def test_mixed_leaves_are_refused() -> None:
    kv = [torch.randn(2, 8, 4, 2, 16) for _ in range(3)]
    kv[2] = kv[2].double()
    with pytest.raises(
        TransferError,
        match=re.escape(
            "the registration has 2 kernel groups (layers 0-1: NL_X_TWO_NB_BS_NH_HS [2, 8, 4, 2, 16] "
            "torch.float32; layers 2: NL_X_TWO_NB_BS_NH_HS [2, 8, 4, 2, 16] torch.float64); a transfer plan "
            "moves one"
        ),
    ):
        chunk_shape(kv, 1, 8)
    kv[2] = torch.randn(2, 9, 4, 2, 16)
    with pytest.raises(TransferError, match=re.escape("layers 2: NL_X_TWO_NB_BS_NH_HS [2, 9, 4, 2, 16]")):
        chunk_shape(kv, 1, 8)


# -- prepared plans: per-call checks, the worker pool ------------------------------------------


def test_chunks_must_not_overlap_each_other_or_the_cache() -> None:
    kv = [torch.randn(2, 8, 4, 2, 16) for _ in range(3)]
    plan = prepare(kv, 1)
    shape, _ = plan.chunk_shape(4)
    buf = torch.zeros(2 * shape[0] * shape[1] * shape[2] * shape[3])
    first = buf[: buf.numel() // 2].view(shape)
    overlapping = buf[8 : 8 + buf.numel() // 2].view(shape)
    before = [t.clone() for t in kv]
    with pytest.raises(TransferError, match=re.escape("chunks[0] and chunks[1] overlap in memory")):
        plan.load_blocks([1, 2], [first, overlapping])
    inside = kv[1].view(-1)[: first.numel()].view(shape)
    with pytest.raises(TransferError, match=re.escape("chunks[1] overlaps the cache's memory")):
        plan.store_blocks([1, 2], [first, inside])
    assert all(torch.equal(a, b) for a, b in zip(before, kv, strict=True))


def test_blocks_need_chunks_and_no_blocks_none() -> None:
    plan = prepare([torch.randn(2, 8, 4, 2, 16) for _ in range(3)], 1)
    with pytest.raises(TransferError, match=re.escape("no chunks given for 2 block(s)")):
        plan.store_blocks([1, 2], [])
    plan.load_blocks([], [])  # nothing to move


def test_a_plan_is_prepared_once_per_registration() -> None:
    fmt, kv = kvlayout.normalize_kv_and_discover_format(
        [torch.randn(2, 8, 4, 2, 16) for _ in range(3)], "vllm", {"kv_layout": "NHD"}
    )
    plan = prepare(kv, fmt)
    assert prepare(kv, fmt) is plan and prepare(kv.registration, fmt) is plan  # type: ignore[union-attr]
    assert (
        repr(plan)
        == "TransferPlan(NL_X_TWO_NB_BS_NH_HS, layers 3, 8 blocks of 4, chunk rows of 32 torch.float32, cpu)"
    )
    cross = torch.randn(8, 3, 2, 4, 2, 16)
    fmt, view = kvlayout.normalize_kv_and_discover_format(cross, "vllm", {"kv_layout": "NHD"})
    assert view is not cross and view.data_ptr() == cross.data_ptr()  # type: ignore[union-attr]
    assert prepare(view, fmt) is prepare(view, fmt)


def test_a_registration_is_prepared_in_its_own_format_only() -> None:
    """A registration detected NHD was re-read in the HND format a caller named, as blocks
    of 2 tokens of 4 heads, where the group path refused the same contradiction."""
    reg = kvlayout.detect([torch.zeros(2, 8, 4, 2, 8) for _ in range(2)], "vllm", {"kv_layout": "NHD"})
    assert prepare(reg, "NL_X_TWO_NB_BS_NH_HS") is prepare(reg)
    with pytest.raises(
        TransferError,
        match=re.escape(
            "prepare(registration, NL_X_TWO_NB_NH_BS_HS): the registration is NL_X_TWO_NB_BS_NH_HS (pass no "
            "format, or its own; to read its tensors in another, prepare(registration.kv, fmt))"
        ),
    ):
        prepare(reg, "NL_X_TWO_NB_NH_BS_HS")
    with pytest.raises(TransferError, match=r"the kernel group is NL_X_TWO_NB_BS_NH_HS \(pass group\.format"):
        prepare(reg.kernel_groups[0], "NL_X_TWO_NB_NH_BS_HS")
    assert repr(prepare(reg.kv, "NL_X_TWO_NB_NH_BS_HS")).startswith(
        "TransferPlan(NL_X_TWO_NB_NH_BS_HS, layers 2, 8 blocks of 2"
    )


def test_block_ids_come_as_lists_arrays_or_tensors() -> None:
    kv = [torch.randn(2, 8, 4, 2, 16) for _ in range(2)]
    plan = prepare(kv, 1)
    shape, dtype = plan.chunk_shape(8)
    expected = torch.zeros(shape, dtype=dtype)
    plan.store_blocks([3, 5], [expected])
    for ids in (np.array([3, 5], dtype=np.uint32), torch.tensor([3, 5], dtype=torch.int32), (3, 5)):
        got = torch.zeros(shape, dtype=dtype)
        plan.store_blocks(ids, [got])
        assert torch.equal(got, expected)
    with pytest.raises(TransferError, match=re.escape("block_ids must be integers, got torch.float32")):
        plan.store_blocks(torch.tensor([3.0, 5.0]), [got])


def test_the_worker_pool_persists_and_is_capped() -> None:
    from kvlayout import _native

    kv = [torch.randn(2, 64, 4, 2, 16) for _ in range(2)]
    plan = prepare(kv, 1)
    shape, dtype = plan.chunk_shape(4 * 64)
    chunk = torch.zeros(shape, dtype=dtype)
    ids = np.arange(64, dtype=np.int64)
    ptrs = np.array([chunk.data_ptr()], dtype=np.uint64)
    tokens = np.array([shape[2]], dtype=np.int64)
    engine = plan._engine
    bad, used = engine.run(0, ids, ptrs, tokens, 64, 0, 10_000)
    assert bad == -1 and 1 <= used <= _native.max_threads()
    workers = _native.pool_workers()
    for _ in range(5):
        engine.run(0, ids, ptrs, tokens, 64, 0, 10_000)
    assert _native.pool_workers() == workers  # no thread per call
    assert engine.run(0, ids[:1], ptrs, tokens, 64, 0, 10_000)[1] == 1  # one block: one thread


def test_a_refused_thread_means_fewer_threads_not_an_abort() -> None:
    """Thread stacks need address space: with almost none left, the copy runs on the
    threads it has (the caller's), and the bytes are right. In a subprocess, so an abort
    fails this test instead of killing the run."""
    code = textwrap.dedent(
        """
        import resource, torch
        from kvlayout import _native
        from kvlayout.transfer import prepare
        kv = [torch.randn(2, 64, 4, 2, 16) for _ in range(2)]
        plan = prepare(kv, 1)
        shape, dtype = plan.chunk_shape(4 * 64)
        chunk, ids = torch.zeros(shape, dtype=dtype), list(range(64))
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + (4 << 20), hard))  # no room for an 8 MiB stack
        plan.store_blocks(ids, [chunk], num_threads=64)
        workers = _native.pool_workers()
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        ok = all(torch.equal(chunk[k, l].view(64, 4, 32)[b], kv[l][k, b].view(4, 32))
                 for k in range(2) for l in range(2) for b in range(64))
        print(f"ok, {workers} workers" if ok else "wrong bytes")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok, 0 workers"  # no thread could start: the caller copied alone


def test_the_cuda_staging_buffer_is_ids_then_chunk_addresses_then_token_counts() -> None:
    from kvlayout.transfer.cuda import narrow_unit, staging

    out = np.zeros(7, dtype=np.int64)
    staging(
        np.array([4, 9, 2], dtype=np.int64),
        np.array([2**63 + 16, 4096], dtype=np.uint64),
        np.array([32, 16], dtype=np.int64),
        out,
    )
    assert out.tolist() == [4, 9, 2, -(2**63) + 16, 4096, 32, 16]
    assert narrow_unit(16, [4096, 2**20 + 8], 2) == 8
    assert narrow_unit(16, [4096, 3], 1) == 1


def engine_args(
    ids: list[int], chunks: list[torch.Tensor], per_chunk: int, skip: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """A native TransferPlan call's arguments after the direction: block ids, chunk
    addresses, chunk token counts, blocks per chunk, blocks skipped."""
    return (
        np.array(ids, dtype=np.int64),
        np.array([c.data_ptr() for c in chunks], dtype=np.uint64),
        np.array([c.shape[2] for c in chunks], dtype=np.int64),
        per_chunk,
        skip,
    )


def check_engine_choices(
    fmt: EngineKVFormat, sizes: dict[str, int], dtype: torch.dtype, pad: int,
    ids: list[int], per_chunk: int, skip: int, partial: bool,
) -> None:  # fmt: skip
    """Every engine choice (block- or layer-major, streaming stores or not, the coming
    moves' lines prefetched or not, any split over threads, one-run segments listed and
    copied as runs or walked as nests, nested moves gathered for lanes or not) stores the same
    chunks and loads the same cache bytes as the default plan, which the tests above hold
    to the oracle."""
    reg = make_registration(kvlayout.layout_of(fmt), sizes, dtype, pad=pad)
    plan = prepare(reg.kv, fmt, **({"block_size": sizes["BS"]} if fmt in NBBS else {}))
    shape, _ = plan.chunk_shape(per_chunk * sizes["BS"])
    chunks = chunks_for(shape, dtype, len(ids), per_chunk, sizes["BS"], partial)
    plan.store_blocks(ids, chunks, skip_prefix_n_blocks=skip)
    stored = [c.view(torch.uint8).clone() for c in chunks]  # bytes: random floats hold NaNs
    for b in reg.bases:
        b.zero_()
    plan.load_blocks(ids, chunks, skip_prefix_n_blocks=skip)
    loaded = [b.clone() for b in reg.bases]
    jobs = [plan._native_job(job) for job in plan.jobs]
    args = engine_args(ids, chunks, per_chunk, skip)
    choices = itertools.product((0, 1), (0, 1 << 62), (-1, 0, 1), (1, 3), (False, True), (False, True))
    for order, stream_min_bytes, prefetch, threads, listed, lanes in choices:
        engine = _native.TransferPlan(jobs, plan.num_blocks, order, stream_min_bytes, prefetch, listed, lanes)
        choice = (
            f"order {order}, streaming from {stream_min_bytes} bytes, prefetch {prefetch}, {threads} threads, "
            f"listed {listed}, lanes {lanes}"
        )
        for c in chunks:
            c.zero_()
        assert engine.run(0, *args, threads)[0] == -1
        assert all(torch.equal(a.view(torch.uint8), b) for a, b in zip(chunks, stored, strict=True)), choice
        for b in reg.bases:
            b.zero_()
        assert engine.run(1, *args, threads)[0] == -1
        assert all(torch.equal(a, b) for a, b in zip(reg.bases, loaded, strict=True)), choice


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@settings(max_examples=40)
@given(cases(), st.data())
def test_walk_orders_streaming_stores_and_threads_move_the_same_bytes(
    case: tuple[EngineKVFormat, dict[str, int], torch.dtype, int], data: st.DataObject
) -> None:
    fmt, sizes, dtype, pad = case
    ids = data.draw(st.lists(st.integers(0, sizes["NB"] - 1), min_size=1, max_size=sizes["NB"], unique=True))
    per_chunk = data.draw(st.integers(1, 3))
    skip = data.draw(st.integers(0, len(ids)))
    check_engine_choices(fmt, sizes, dtype, pad, ids, per_chunk, skip, data.draw(st.booleans()))


@pytest.mark.parametrize(
    ("fmt", "sizes", "dtype", "pad"),
    [  # runs long enough for the streaming loops, at unaligned chunk offsets too
        (  # 10800-byte runs: split into pieces at the destination's 4 KiB grid
            EngineKVFormat.NL_X_TWO_NB_BS_NH_HS,
            {"NL": 2, "NB": 7, "BS": 9, "NH": 3, "HS": 100},
            torch.float32,
            0,
        ),
        (
            EngineKVFormat.NL_X_NB_BS_HS,
            {"NL": 2, "NB": 7, "BS": 7, "HS": 1001},
            torch.float16,
            3,
        ),  # odd, padded
        (
            EngineKVFormat.NL_X_TWO_NB_BS_NH_HS,
            {"NL": 2, "NB": 7, "BS": 5, "NH": 3, "HS": 37},
            torch.bfloat16,
            0,
        ),
        (
            EngineKVFormat.NL_X_TWO_NB_NH_BS_HS,
            {"NL": 2, "NB": 7, "BS": 3, "NH": 2, "HS": 40},
            torch.float32,
            0,
        ),
        (EngineKVFormat.NB_NL_TWO_BS_NH_HS, {"NL": 3, "NB": 7, "BS": 2, "NH": 2, "HS": 24}, torch.float16, 3),
        (EngineKVFormat.NL_X_NB_BSV_BSS, {"NL": 2, "NB": 7, "BS": 5}, torch.uint8, 1),
        (
            EngineKVFormat.NL_X_NP_X_NB_BS_ONE_HS,
            {"NL": 2, "NB": 7, "BS": 4, "HS": 33, "NP": 2},
            torch.uint8,
            5,
        ),
    ],
)
def test_engine_choices_agree_on_long_runs(
    fmt: EngineKVFormat, sizes: dict[str, int], dtype: torch.dtype, pad: int
) -> None:
    check_engine_choices(fmt, sizes, dtype, pad, [5, 0, 6, 2, 3], per_chunk=2, skip=1, partial=True)


@pytest.mark.parametrize(
    ("fmt", "listed"),
    [  # (store, load): listed where each segment is one run and the source jumps
        (EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, [True, False]),  # layer-major: the cache jumps in a store
        (EngineKVFormat.NL_X_NB_BS_HS, [True, False]),  # an MLA block
        (EngineKVFormat.NB_NL_TWO_BS_NH_HS, [False, True]),  # block-major: the chunk jumps in a load
        (EngineKVFormat.NL_X_TWO_NB_NH_BS_HS, [False, False]),  # HND: a run per head and token
    ],
)
def test_plans_list_their_runs_where_each_segment_is_one_run_and_the_source_jumps(
    fmt: EngineKVFormat, listed: list[bool]
) -> None:
    sizes = {"NL": 4, "NB": 8, "BS": 16, "NH": 2, "HS": 64}  # a cross-layer block outgrows 4 blocks' slab
    reg = make_registration(kvlayout.layout_of(fmt), sizes, torch.float16)
    plan = prepare(reg.kv, fmt)
    assert [plan._engine.listed(d, 4) for d in (0, 1)] == listed
    jobs = [plan._native_job(job) for job in plan.jobs]
    off = _native.TransferPlan(jobs, plan.num_blocks, listed=False)
    assert [off.listed(d, 4) for d in (0, 1)] == [False, False]
    one_run_each = fmt != EngineKVFormat.NL_X_TWO_NB_NH_BS_HS
    # where a segment has several runs, the same orders gather the moves for lanes
    assert [plan._engine.lanes(d, 4) for d in (0, 1)] == [not one_run_each, False]
    assert [_native.TransferPlan(jobs, plan.num_blocks, lanes=False).lanes(d, 4) for d in (0, 1)] == [
        False,
        False,
    ]
    for order in (0, 1):  # block-major lists loads only, layer-major stores only
        forced = _native.TransferPlan(jobs, plan.num_blocks, order=order)
        assert [forced.listed(d, 4) for d in (0, 1)] == [
            one_run_each and order == 1,
            one_run_each and order == 0,
        ]
        assert [forced.lanes(d, 4) for d in (0, 1)] == [
            not one_run_each and order == 1,
            not one_run_each and order == 0,
        ]


@pytest.mark.parametrize(
    ("fmt", "pad", "consecutive_in_lanes"),
    [  # segments of a 256- or 512-byte run per head and token
        (EngineKVFormat.NL_X_TWO_NB_NH_BS_HS, 0, False),  # flash-attn HND: consecutive K blocks continue
        (EngineKVFormat.NL_X_NB_TWO_NH_BS_HS, 8, True),  # flash-infer HND, padded: V lies between K blocks
        (EngineKVFormat.NL_X_NB_NH_BS_TWO_HS, 0, False),  # K and V interleaved, one segment: blocks continue
        (EngineKVFormat.NL_X_NH_NB_BS_CS, 0, True),  # heads outermost: a block's source is not dense
    ],
)
def test_nested_moves_in_lanes_move_what_the_nested_walk_moves(
    fmt: EngineKVFormat, pad: int, consecutive_in_lanes: bool
) -> None:
    """Segments of several runs stored layer-major, the source jumping every 8-64 KiB from
    scattered blocks (copied in lanes), streaming on through consecutive blocks where the
    layout lets it (the nested walk), and both in one call with a skipped prefix and a
    partial last chunk, on one thread and three: every chunk byte where the nested walk
    puts it; and loaded back block-major (the chunk's slabs jumping: lanes too), every
    cache byte where the nested walk's load puts it (the moved blocks, nothing else)."""
    sizes = {"NL": 2, "NB": 300, "BS": 16, "NH": 4, "HS": 128, "CS": 256}
    per_chunk = 16  # 16 consecutive blocks of 16-64 KiB: a stretch of 256 KiB or more, too long for lanes
    reg = make_registration(kvlayout.layout_of(fmt), sizes, torch.float16, pad=pad)
    original = [b.clone() for b in reg.bases]
    plan = prepare(reg.kv, fmt)
    jobs = [plan._native_job(job) for job in plan.jobs]
    shape, _ = plan.chunk_shape(per_chunk * sizes["BS"])

    def engine(order: int, lanes: bool) -> Any:
        return _native.TransferPlan(jobs, plan.num_blocks, order, 0, 1, True, lanes)  # streaming, prefetching

    def call(e: Any, d: int, ids: list[int], chunks: list[torch.Tensor], skip: int, threads: int) -> None:
        assert e.run(d, *engine_args(ids, chunks, per_chunk, skip), threads)[0] == -1

    def in_lanes(e: Any, d: int, ids: list[int], chunks: list[torch.Tensor], skip: int) -> int:
        return int(e.bytes_in_lanes(d, *engine_args(ids, chunks, per_chunk, skip)))

    store, load = engine(1, True), engine(0, True)
    assert store.lanes(0, per_chunk) and load.lanes(1, per_chunk)
    nested_store, nested_load = engine(1, False), engine(0, False)
    assert not nested_store.lanes(0, per_chunk) and not nested_load.lanes(1, per_chunk)
    block_bytes = math.prod(plan.chunk_shape(sizes["BS"])[0]) * 2
    rng = np.random.default_rng(0)
    consecutive = list(range(10, 10 + 4 * per_chunk))
    scattered = (rng.permutation(sizes["NB"] - 80) + 80).tolist()[:150]
    for ids, skip, lanes_bytes in [
        (scattered[:128], 0, 128 * block_bytes),
        (consecutive, 0, 4 * per_chunk * block_bytes if consecutive_in_lanes else 0),
        (consecutive[:40] + scattered, 5, None),  # groups of both kinds, a partial last chunk
    ]:
        chunks = chunks_for(shape, torch.float16, len(ids), per_chunk, sizes["BS"], partial=True)
        if lanes_bytes is not None:
            assert in_lanes(store, 0, ids, chunks, skip) == lanes_bytes
            assert in_lanes(nested_store, 0, ids, chunks, skip) == 0
        call(nested_store, 0, ids, chunks, skip, 1)
        expected = [c.view(torch.uint8).clone() for c in chunks]  # bytes: random floats hold NaNs
        assert any(e.any() for e in expected)
        for b in reg.bases:
            b.zero_()
        call(nested_load, 1, ids, chunks, skip, 1)
        restored = [b.clone() for b in reg.bases]  # the moved blocks' bytes, zeros elsewhere
        assert any(r.any() for r in restored)
        for threads in (1, 3):
            for c in chunks:
                c.zero_()
            call(store, 0, ids, chunks, skip, threads)
            assert all(torch.equal(c.view(torch.uint8), e) for c, e in zip(chunks, expected, strict=True))
            for b in reg.bases:
                b.zero_()
            call(load, 1, ids, chunks, skip, threads)
            assert all(torch.equal(b, r) for b, r in zip(reg.bases, restored, strict=True))
        for b, was in zip(reg.bases, original, strict=True):
            b.copy_(was)


# Formats whose store segments hold several runs (a run per head and token, or per plane).
SEVERAL_RUNS = [
    EngineKVFormat.NL_X_TWO_NB_NH_BS_HS,
    EngineKVFormat.NL_X_NB_TWO_NH_BS_HS,
    EngineKVFormat.NL_X_NB_NH_BS_TWO_HS,
    EngineKVFormat.NL_X_NB_NH_BS_CS,
    EngineKVFormat.NL_X_TWO_NB_NH_ONE_BS_HS,
    EngineKVFormat.NL_X_NP_X_NB_BS_ONE_HS,
    EngineKVFormat.NL_X_NH_NB_BS_CS,
]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@settings(max_examples=15, deadline=None)
@given(st.sampled_from(SEVERAL_RUNS), st.data())
def test_nested_moves_in_lanes_match_the_nested_walk_on_random_shapes(
    fmt: EngineKVFormat, data: st.DataObject
) -> None:
    """Random shapes of the formats whose segments hold several runs, sized so a store of
    scattered blocks moves a few MiB in lanes, with random block ids (some consecutive),
    chunk sizes, skipped prefixes and thread counts: stores and block-major loads leave
    the bytes the nested walk leaves."""
    layout = kvlayout.layout_of(fmt)
    sizes = data.draw(sizes_for(layout, max_side=3))
    roles = (
        (Role.TOKEN, st.integers(8, 24)),
        (Role.HEAD, st.integers(2, 4)),
        (Role.ELEMENT, st.sampled_from([64, 96, 128])),
    )
    for role, values in roles:
        with contextlib.suppress(kvlayout.errors.SizeError):
            sizes = with_size(layout, sizes, role, data.draw(values))
    sizes = with_size(layout, sizes, Role.BLOCK, 160)
    reg = make_registration(layout, sizes, torch.float16)
    plan = prepare(reg.kv, fmt)
    jobs = [plan._native_job(job) for job in plan.jobs]
    bs = plan.block_size
    per_chunk = data.draw(st.integers(1, 8))
    ids = data.draw(st.permutations(range(160)))[: data.draw(st.integers(80, 160))]
    skip = data.draw(st.integers(0, 5))
    threads = data.draw(st.integers(1, 3))
    shape, _ = plan.chunk_shape(per_chunk * bs)
    chunks = chunks_for(shape, torch.float16, len(ids), per_chunk, bs, partial=True)
    args = engine_args(ids, chunks, per_chunk, skip)
    stored, loaded = [], []
    for lanes in (False, True):  # streaming, prefetching: stores layer-major, loads block-major
        store = _native.TransferPlan(jobs, plan.num_blocks, 1, 0, 1, True, lanes)
        for c in chunks:
            c.zero_()
        assert store.run(0, *args, threads)[0] == -1
        stored.append([c.view(torch.uint8).clone() for c in chunks])
        back = _native.TransferPlan(jobs, plan.num_blocks, 0, 0, 1, True, lanes)
        for b in reg.bases:
            b.zero_()
        assert back.run(1, *args, threads)[0] == -1
        loaded.append([b.clone() for b in reg.bases])
    assert all(torch.equal(a, b) for a, b in zip(*stored, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(*loaded, strict=True))


@pytest.mark.parametrize(
    ("sizes", "consecutive", "scattered"),
    [
        ({"NL": 2, "NB": 4000, "BS": 2, "NH": 2, "HS": 8}, 1500, 1500),  # 64-byte slabs: many tables
        ({"NL": 2, "NB": 700, "BS": 4, "NH": 2, "HS": 128}, 40, 400),  # 2 KiB slabs: tables in lanes
    ],
)
def test_a_listed_move_of_more_runs_than_one_table_joins_runs_and_moves_every_byte(
    sizes: dict[str, int], consecutive: int, scattered: int
) -> None:
    """Blocks of 2 layers' K and V, scattered and in runs of consecutive ids (whose slabs
    continue each other on both sides, so the listing joins them): several tables of runs
    (of 2 KiB slabs: scattered enough to be copied several at once, in lanes), each byte
    where the nested walk puts it; and loaded back block-major (listed too), every moved
    block restored and no other touched."""
    fmt = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    reg = make_registration(kvlayout.layout_of(fmt), sizes, torch.float16)
    plan = prepare(reg.kv, fmt)
    assert plan._engine.listed(0, 32)
    rng = np.random.default_rng(0)
    first = sizes["NB"] // 40
    ids = np.concatenate([
        np.arange(first, first + consecutive),
        rng.permutation(np.arange(first + consecutive, sizes["NB"]))[:scattered],
    ]).tolist()  # fmt: skip
    jobs = [plan._native_job(job) for job in plan.jobs]
    nested = _native.TransferPlan(jobs, plan.num_blocks, listed=False)
    chunks = plan.chunks_for(len(ids), 64)
    plan.store_blocks(ids, chunks)
    listed_chunks = [c.view(torch.uint8).clone() for c in chunks]  # bytes: random floats hold NaNs
    plan._engine = nested
    for c in chunks:
        c.zero_()
    plan.store_blocks(ids, chunks)
    assert all(torch.equal(a, b.view(torch.uint8)) for a, b in zip(listed_chunks, chunks, strict=True))
    before = [b.clone() for b in reg.bases]
    for b in reg.bases:
        b.zero_()
    plan._engine = _native.TransferPlan(jobs, plan.num_blocks, order=0)  # block-major: a load lists
    assert plan._engine.listed(1, 32)
    plan.load_blocks(ids, chunks)
    moved = torch.zeros(sizes["NB"], dtype=torch.bool)
    moved[ids] = True
    for b, was in zip(reg.bases, before, strict=True):
        blocks, old = b.view(2, sizes["NB"], -1), was.view(2, sizes["NB"], -1)
        assert torch.equal(blocks[:, moved], old[:, moved])
        assert not blocks[:, ~moved].any()
