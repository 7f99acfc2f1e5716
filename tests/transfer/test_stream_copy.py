"""The run-copy primitive (csrc/stream_copy.h ``copy_byte_runs``) and the benchmarks' flat
stream, through their test bindings, against numpy.

``kvlayout._native.copy_byte_runs`` takes an ``(N, 3)`` uint64 table of (source address,
destination address, length); both its paths run (streaming stores with the prefetch
cursors where the CPU has AVX2, and memcpy), on runs of 0 to 100000 bytes at any
alignment, long lists of short runs (the cursors walk many runs per step) included.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlayout import _native

SRC_BYTES = 1 << 20
DST_BYTES = 1 << 20


def copy_reference(src: np.ndarray, dst: np.ndarray, runs: list[tuple[int, int, int]]) -> np.ndarray:
    """What copying the runs in order leaves in dst (a later run wins where two overlap)."""
    out = dst.copy()
    for s, d, n in runs:
        out[d : d + n] = src[s : s + n]
    return out


def table(src: np.ndarray, dst: np.ndarray, runs: list[tuple[int, int, int]]) -> np.ndarray:
    base_s, base_d = src.ctypes.data, dst.ctypes.data
    rows = [(base_s + s, base_d + d, n) for s, d, n in runs]
    return np.array(rows, dtype=np.uint64).reshape(len(rows), 3)


def buffers(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 256, SRC_BYTES, dtype=np.uint8),
        rng.integers(0, 256, DST_BYTES, dtype=np.uint8),
    )


@st.composite
def run_lists(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    lengths = st.one_of(
        st.just(0),
        st.integers(1, 64),  # under a vector: head and tail only
        st.integers(65, 5000),  # a few vectors, page crossings
        st.integers(5001, 100_000),  # many pages, the cursors' long-run path
    )
    runs = []
    for _ in range(draw(st.integers(0, 40))):
        n = draw(lengths)
        s = draw(st.integers(0, SRC_BYTES - n))
        d = draw(st.integers(0, DST_BYTES - n))
        runs.append((s, d, n))
    return runs


@settings(max_examples=60, deadline=None)
@given(run_lists(), st.booleans(), st.integers(0, 2**32 - 1))
def test_copy_byte_runs_equals_numpy(runs: list[tuple[int, int, int]], streaming: bool, seed: int) -> None:
    src, dst = buffers(seed)
    want = copy_reference(src, dst, runs)
    _native.copy_byte_runs(table(src, dst, runs), streaming)
    assert np.array_equal(dst, want)
    assert np.array_equal(src, buffers(seed)[0])  # the sources are only read


@pytest.mark.parametrize("streaming", [True, False])
def test_many_short_scattered_runs_across_pages(streaming: bool) -> None:
    """Thousands of short runs (the head-major block pattern: sources back to back,
    destinations strided), zero-length runs between them, every alignment."""
    src, dst = buffers(7)
    rng = np.random.default_rng(8)
    runs = []
    at = 3
    for i in range(6000):
        n = 0 if i % 97 == 0 else int(rng.integers(1, 300))
        d = int(rng.integers(0, DST_BYTES - n))
        runs.append((at, d, n))
        at += n if i % 50 else int(rng.integers(1, 70_000))  # a jump now and then
        if at + 300 > SRC_BYTES:
            at = int(rng.integers(0, 4096))
    want = copy_reference(src, dst, runs)
    _native.copy_byte_runs(table(src, dst, runs), streaming)
    assert np.array_equal(dst, want)


def test_no_runs_and_empty_runs_move_nothing() -> None:
    src, dst = buffers(1)
    before = dst.copy()
    _native.copy_byte_runs(np.zeros((0, 3), dtype=np.uint64))
    _native.copy_byte_runs(table(src, dst, [(5, 9, 0), (0, 0, 0)]))
    assert np.array_equal(dst, before)


def test_the_run_table_is_an_n_by_3_uint64_array() -> None:
    with pytest.raises(TypeError):
        _native.copy_byte_runs(np.zeros((2, 2), dtype=np.uint64))
    with pytest.raises(TypeError):
        _native.copy_byte_runs(np.zeros((2, 3), dtype=np.int32))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(("offset", "nbytes"), [(0, SRC_BYTES), (5, 12_345), (33, 1), (0, 0)])
def test_flat_stream_copies_the_range(threads: int, offset: int, nbytes: int) -> None:
    src, dst = buffers(3)
    want = dst.copy()
    want[offset : offset + nbytes] = src[offset : offset + nbytes]
    used = _native.flat_stream(dst.ctypes.data + offset, src.ctypes.data + offset, nbytes, threads)
    assert np.array_equal(dst, want)
    assert (used == 0) if nbytes == 0 else (1 <= used <= min(threads, _native.max_threads()))
