"""The CUDA executor of byte runs (``kvlayout.transfer.cuda.copy_runs``).

Its decomposition, how runs become thread-block work items (``_native.plan_run_items``)
and which units each thread then copies (``_native.run_units``: the kernel's own mapping
from ``csrc/include/kvlayout/run_plan.h``, compiled for the host), is held here to the
runs themselves: every byte of every run copied exactly once, from its source to its
destination, in the widest unit both sides allow. The runs are addresses only: no memory
is touched. The kernel itself runs where a GPU is (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlayout import _native
from kvlayout.errors import KVLayoutError
from kvlayout.transfer import TransferError
from kvlayout.transfer.cuda import copy_runs
from tests.transfer.test_transfer_cuda import needs_gpu

THREADS, WARP, SHORT, SLICE = 256, 32, 2048, 64 << 10


def lanes_for(n: int) -> int:
    """A packed run's lanes: a power of two that moves its 16-byte units 4 at a time."""
    lanes = 1
    while lanes < WARP and lanes * 64 < n:
        lanes *= 2
    return lanes


def items_of(runs: np.ndarray) -> list[tuple[int, int, int, int]]:
    """(offset, bytes, run, count) of each work item (a pack's offset is its lanes per run)."""
    table = _native.plan_run_items(runs)
    return [(int(o), int(b), int(w) & 0xFFFFFFFF, int(w) >> 32) for o, b, w in table.tolist()]


def check_units(runs: np.ndarray) -> None:
    rows = _native.run_units(runs, _native.plan_run_items(runs))
    run, offset, width, src, dst = rows.T
    s, d, n = runs[run].T if len(rows) else (run, run, run)
    assert np.array_equal(src, s + offset) and np.array_equal(dst, d + offset)
    assert np.all(offset + width <= n)
    body = width > 1  # aligned on both sides, as wide as they allow
    assert np.all(src[body] % width[body] == 0) and np.all(dst[body] % width[body] == 0)
    # The widest unit both agree modulo: 16, 8, 4, 2 (a 132-byte row, a 4-byte slice), else bytes.
    apart = (s ^ d) | np.uint64(16)
    widest = apart & (~apart + np.uint64(1))
    assert np.array_equal(width[body], widest[body])
    assert np.all(width[widest == 1] == 1)
    # Sorted by (run, offset), each run's units tile it: no byte twice, none left out.
    order = np.lexsort((offset, run))
    run, offset, width = run[order], offset[order], width[order]
    same = run[1:] == run[:-1]
    assert np.array_equal(offset[1:][same], (offset + width)[:-1][same]), "a byte copied twice or never"
    starts = np.r_[True, ~same] if len(run) else np.zeros(0, dtype=bool)
    ends = np.r_[~same, True] if len(run) else np.zeros(0, dtype=bool)
    assert np.all(offset[starts] == 0)
    assert np.array_equal(run[starts], np.flatnonzero(runs[:, 2]).astype(np.uint64))  # every nonempty run
    assert np.array_equal((offset + width)[ends], runs[run[ends], 2])


@st.composite
def run_tables(draw: st.DrawFn) -> np.ndarray:
    lengths = st.one_of(
        st.just(0),
        st.integers(1, 40),
        st.integers(41, SHORT),  # packed, a group of lanes each
        st.integers(SHORT + 1, 3 * SLICE + 100),  # sliced
    )
    rows = []
    for _ in range(draw(st.integers(0, 24))):
        n = draw(lengths)
        src = draw(st.integers(0, 1 << 40))
        shift = draw(st.sampled_from([0, 16, 8, 24, 4, 12, 2, 6, 1, 5]))  # dst - src modulo 16 and 32
        dst = (draw(st.integers(0, 1 << 40)) & ~31) + (src % 32 + shift) % 32
        rows.append((src, dst, n))
    return np.array(rows, dtype=np.uint64).reshape(len(rows), 3)


@settings(max_examples=40, deadline=None)
@given(run_tables())
def test_the_grid_copies_every_byte_of_every_run_once(runs: np.ndarray) -> None:
    check_units(runs)


@settings(max_examples=60, deadline=None)
@given(run_tables())
def test_runs_become_slices_and_packs_of_short_runs(runs: np.ndarray) -> None:
    items = items_of(runs)
    seen = []
    for offset, nbytes, run, count in items:
        if count == 0:  # a slice: all the block's threads on part of one long run
            src, _, n = (int(v) for v in runs[run])
            assert n > SHORT and 0 < nbytes <= SLICE and offset + nbytes <= n
            assert offset == 0 or (src + offset) % 16 == 0  # only a run's first slice has a head
            seen.append((run, offset, nbytes))
        else:  # a pack: a group of lanes per short run, as wide as its longest run needs
            members = runs[run : run + count, 2].tolist()
            assert all(n <= SHORT for n in members) and members[0] > 0 and nbytes == sum(members)
            assert offset == max(lanes_for(n) for n in members if n) and count * offset <= THREADS
            seen += [(r, 0, int(n)) for r, n in zip(range(run, run + count), members, strict=True) if n]
    # In run order, each nonempty run exactly once, its slices back to back.
    expected: list[tuple[int, int, int]] = []
    for run, (_, _, n) in enumerate(runs.tolist()):
        for offset, nbytes, r, _ in (x for x in items if x[3] == 0 and x[2] == run):
            expected.append((r, offset, nbytes))
        if 0 < n <= SHORT:
            expected.append((run, 0, n))
    assert seen == expected
    for run, (_, _, n) in enumerate(runs.tolist()):
        slices = [(o, b) for o, b, r, c in items if c == 0 and r == run]
        if slices:
            assert slices[0][0] == 0 and sum(b for _, b in slices) == n


def test_a_long_run_is_sliced_on_the_source_grid() -> None:
    runs = np.array([[0x1003, 0x9003, 2 * SLICE]], dtype=np.uint64)
    first = SLICE - 3  # up to the first 16-byte aligned source byte past one slice
    assert items_of(runs) == [(0, first, 0, 0), (first, SLICE, 0, 0), (first + SLICE, 3, 0, 0)]


def test_short_runs_share_a_thread_block_as_many_as_its_lanes_hold() -> None:
    # 256-byte runs take 4 lanes each: 64 to a block of 256 threads, not one per warp.
    heads = np.array([[512 * i, 1 << 30 | 512 * i, 256] for i in range(70)], dtype=np.uint64)
    assert items_of(heads) == [(4, 64 * 256, 0, 64), (4, 6 * 256, 64, 6)]
    # Run 0 is empty and starts nothing; run 3 is empty inside the pack (an idle group);
    # the 2 KiB run 11 needs a warp, and 11 warps are more than a block: a pack of its own.
    runs = np.array(
        [[4096 * i, 1 << 30 | 4096 * i, {0: 0, 3: 0, 11: 2048}.get(i, 100)] for i in range(12)],
        dtype=np.uint64,
    )
    assert items_of(runs) == [(2, 900, 1, 10), (32, 2048, 11, 1)]
    assert items_of(runs[1:10]) == [(2, 800, 0, 9)]  # the empty run in it a group too


def test_a_run_that_wraps_around_the_address_space_is_refused() -> None:
    runs = np.array([[0, 0, 16], [2**64 - 8, 0, 16]], dtype=np.uint64)
    with pytest.raises(ValueError, match="run 1 wraps around the address space"):
        _native.plan_run_items(runs)
    with pytest.raises(TransferError, match="run 1 wraps around the address space"):
        copy_runs(runs, torch.device("cuda"))  # the table is checked before the device


def _has_device() -> bool:
    try:
        from kvlayout import _cuda
    except ImportError:
        return False
    return bool(_cuda.device_count())


@pytest.mark.parametrize(
    ("runs", "message"),
    [
        ([[0, 0, 1]], "must be a numpy array, got list"),
        (np.zeros((2, 3), dtype=np.int64), r"\(N, 3\) uint64 array .* got int64 of shape \(2, 3\)"),
        (np.zeros((2, 2), dtype=np.uint64), r"got uint64 of shape \(2, 2\)"),
        (np.zeros(3, dtype=np.uint64), r"got uint64 of shape \(3,\)"),
    ],
)
def test_copy_runs_wants_an_n_by_3_uint64_table(runs: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        copy_runs(runs, torch.device("cuda"))  # type: ignore[arg-type]


def test_copy_runs_is_for_cuda_devices() -> None:
    runs = np.zeros((1, 3), dtype=np.uint64)
    with pytest.raises(TransferError, match="no transfer for tensors on cpu"):
        copy_runs(runs, torch.device("cpu"))
    if not _has_device():
        with pytest.raises(KVLayoutError, match="CUDA"):
            copy_runs(runs, torch.device("cuda"))


@needs_gpu
@settings(max_examples=25, deadline=None)
@given(st.data())
def test_copy_runs_on_the_device_equals_numpy(data: st.DataObject) -> None:
    size = 1 << 20
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    src_host = rng.integers(0, 256, size, dtype=np.uint8)
    dst_host = rng.integers(0, 256, size, dtype=np.uint8)
    src, dst = torch.from_numpy(src_host).cuda(), torch.from_numpy(dst_host).cuda()
    rows, want, taken = [], dst_host.copy(), np.zeros(size, dtype=bool)
    for _ in range(data.draw(st.integers(0, 30))):
        n = data.draw(st.sampled_from([0, 1, 7, 100, 2048, 2049, 5000, 70_000, 200_000]))
        s = data.draw(st.integers(0, size - n))
        d = data.draw(st.integers(0, size - n))
        if taken[d : d + n].any():  # destinations must not overlap
            continue
        taken[d : d + n] = True
        want[d : d + n] = src_host[s : s + n]
        rows.append((src.data_ptr() + s, dst.data_ptr() + d, n))
    copy_runs(np.array(rows, dtype=np.uint64).reshape(len(rows), 3), dst.device)
    torch.cuda.synchronize()
    assert np.array_equal(dst.cpu().numpy(), want)
    assert np.array_equal(src.cpu().numpy(), src_host)
