"""The run-copy primitive (csrc/stream_copy.h ``copy_byte_runs``) and the benchmarks' flat
stream, through their test bindings, against numpy.

``kvlayout._native.copy_byte_runs`` takes an ``(N, 3)`` uint64 table of (source address,
destination address, length); both its paths run (streaming stores where the CPU has
AVX2, and memcpy), each with the prefetch cursors ahead and without, on runs of 0 to
100000 bytes at any alignment, long lists of short runs (the cursors walk many runs per
step) included; and with ``any_order=True`` (destinations that never overlap), the lanes
that copy several runs at once where the list pays (``lane_bytes``); and runs that touch
an allocation's first or last byte, between guard pages no byte may be read or written in.
"""

from __future__ import annotations

import subprocess
import sys

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


RUN_LENGTHS = st.one_of(
    st.just(0),
    st.integers(1, 64),  # under a vector: head and tail only
    st.integers(65, 5000),  # a few vectors, page crossings
    st.integers(5001, 100_000),  # many pages, the cursors' long-run path
)


def check_copy_byte_runs(runs: list[tuple[int, int, int]], seed: int, streaming: bool, prefetch: bool,
                         any_order: bool = False) -> None:  # fmt: skip
    """copy_byte_runs leaves numpy's copy of the runs in the destination, and the sources
    as they were (they are only read)."""
    src, dst = buffers(seed)
    want = copy_reference(src, dst, runs)
    _native.copy_byte_runs(table(src, dst, runs), streaming, prefetch, any_order=any_order)
    assert np.array_equal(dst, want)
    assert np.array_equal(src, buffers(seed)[0])


@st.composite
def run_lists(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    runs = []
    for _ in range(draw(st.integers(0, 40))):
        n = draw(RUN_LENGTHS)
        s = draw(st.integers(0, SRC_BYTES - n))
        d = draw(st.integers(0, DST_BYTES - n))
        runs.append((s, d, n))
    return runs


@settings(max_examples=60, deadline=None)
@given(run_lists(), st.booleans(), st.booleans(), st.integers(0, 2**32 - 1))
def test_copy_byte_runs_equals_numpy(
    runs: list[tuple[int, int, int]], streaming: bool, prefetch: bool, seed: int
) -> None:
    check_copy_byte_runs(runs, seed, streaming, prefetch)


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


@pytest.mark.parametrize("prefetch", [True, False])
def test_runs_at_every_offset_in_a_line(prefetch: bool) -> None:
    """Streaming stores go to whole destination lines only (a run's bytes before its first
    whole 64-byte line and after its last go through memcpy): runs of lengths about one,
    two and four lines, at each of a line's 64 offsets on both sides, copy exactly."""
    src, dst = buffers(11)
    base = (-dst.ctypes.data) % 64  # the destination's first line boundary
    lengths = (1, 31, 32, 33, 48, 63, 64, 65, 96, 127, 128, 129, 160, 191, 192, 193, 255, 256, 257, 320)
    runs, at = [], 0
    for offset in range(64):
        for n in lengths:
            runs.append(((at * 7 + offset * 3) % (SRC_BYTES - 512), base + at + offset, n))
            at += 512
    assert base + at < DST_BYTES
    want = copy_reference(src, dst, runs)
    _native.copy_byte_runs(table(src, dst, runs), True, prefetch)
    assert np.array_equal(dst, want)


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("overlap", [0, 5])
def test_short_runs_back_to_back_share_their_lines_and_copy_exactly(prefetch: bool, overlap: int) -> None:
    """Runs of 0-63 bytes, and some of a line or two, written back to back from an odd
    destination byte (each line a run only partly fills is filled by its neighbours: none
    is streamed, where the run beside it writes the rest through memcpy), or each
    overlapping the last by ``overlap`` bytes (the later run wins), from odd sources."""
    src, dst = buffers(13)
    rng = np.random.default_rng(overlap)
    lengths = [*range(64), *rng.integers(0, 200, 400).tolist(), *range(63, -1, -1)]
    runs, at = [], 3 + (-dst.ctypes.data) % 64  # 3 bytes into a line
    for i, n in enumerate(lengths):
        runs.append(((i * 131 + 7) % (SRC_BYTES - 256), at, n))
        at += max(n - overlap, 0)
    assert at < DST_BYTES
    want = copy_reference(src, dst, runs)
    _native.copy_byte_runs(table(src, dst, runs), True, prefetch)
    assert np.array_equal(dst, want)


@st.composite
def disjoint_run_lists(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    """Runs whose destinations never overlap (pieces of the destination buffer with gaps
    between them, in shuffled order) and whose sources lie anywhere: what block maps and
    transfers copy in any order. About a quarter move enough bytes, with a source that
    jumps often enough, for the lanes (``_native.lane_bytes``); some have a source that
    streams on."""
    pieces, at = [], draw(st.integers(0, 64))
    for _ in range(draw(st.integers(0, 120))):
        n = draw(RUN_LENGTHS)
        if at + n > DST_BYTES:
            break
        pieces.append((at, n))
        at += n + draw(st.sampled_from([0, 0, 1, 64, 4096]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rng.shuffle(pieces)
    if draw(st.booleans()):  # sources scattered
        return [(int(rng.integers(0, SRC_BYTES - n + 1)), d, n) for d, n in pieces]
    runs, s = [], int(rng.integers(0, 4096))  # the source streams on, wrapping round
    for d, n in pieces:
        s = 0 if s + n > SRC_BYTES else s
        runs.append((s, d, n))
        s += n
    return runs


@settings(max_examples=60, deadline=None)
@given(disjoint_run_lists(), st.booleans(), st.booleans(), st.integers(0, 2**32 - 1))
def test_copy_in_any_order_equals_numpy(
    runs: list[tuple[int, int, int]], streaming: bool, prefetch: bool, seed: int
) -> None:
    """Runs with disjoint destinations copied in any order (in lanes where the list pays)
    leave exactly what the listed copy leaves."""
    check_copy_byte_runs(runs, seed, streaming, prefetch, any_order=True)


def scattered_runs(length: int, count: int, seed: int) -> list[tuple[int, int, int]]:
    """`count` runs of `length` bytes from shuffled slots of the source, one after another
    in the destination, from 3 bytes in (unaligned)."""
    slots = np.random.default_rng(seed).permutation(SRC_BYTES // length)[:count]
    return [(int(k) * length, 3 + i * length, length) for i, k in enumerate(slots)]


@pytest.mark.parametrize(
    ("length", "count", "lanes"),
    [
        (2048, 256, True),  # 512 KiB, a jump every 2 KiB
        (1024, 512, False),  # a jump every KiB: in order (a strided head slice streams so)
        (32 << 10, 16, True),  # 512 KiB of 32 KiB runs
        (32 << 10, 7, False),  # under the least a lane list moves (4 x 64 KiB)
        (512, 900, False),  # a jump every 512 bytes: the listed copy, tiles and all
        (256 << 10, 2, False),  # 256 KiB runs stream as well one by one
    ],
)
def test_which_lists_go_in_lanes(length: int, count: int, lanes: bool) -> None:
    src, dst = buffers(5)
    runs = scattered_runs(length, count, seed=6)
    t = table(src, dst, runs)
    assert _native.lane_bytes(t) == (length * count if lanes else 0)
    want = copy_reference(src, dst, runs)
    _native.copy_byte_runs(t, any_order=True)
    assert np.array_equal(dst, want)


def test_a_source_that_streams_on_is_not_copied_in_lanes() -> None:
    """One buffer into scattered runs (a load): the source never jumps, and the list is
    copied in order (one stream reads it faster than lanes)."""
    src, dst = buffers(9)
    slots = np.random.default_rng(10).permutation(DST_BYTES // (8 << 10))[:64]
    runs = [(i * (8 << 10), int(k) * (8 << 10), 8 << 10) for i, k in enumerate(slots)]
    t = table(src, dst, runs)
    assert _native.lane_bytes(t) == 0
    scattered = [(d, s, n) for s, d, n in runs]  # the same runs read back: the source jumps
    assert _native.lane_bytes(table(dst, src, scattered)) == 64 * (8 << 10)
    want = copy_reference(src, dst, runs)
    _native.copy_byte_runs(t, any_order=True)
    assert np.array_equal(dst, want)


def test_no_runs_and_empty_runs_move_nothing() -> None:
    src, dst = buffers(1)
    before = dst.copy()
    _native.copy_byte_runs(np.zeros((0, 3), dtype=np.uint64))
    _native.copy_byte_runs(table(src, dst, [(5, 9, 0), (0, 0, 0)]))
    assert np.array_equal(dst, before)


# Runs that touch an allocation's first or last byte, between buffers fenced by PROT_NONE
# pages, so a load or store of even one byte past either end faults; what the runs leave
# is checked against numpy byte for byte (a store before or after a run inside the
# buffer). In a subprocess: a fault fails the test instead of ending the run.
GUARDED = """
import ctypes, mmap
import numpy as np
from kvlayout import _native

libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PAGE = mmap.PAGESIZE


class Guarded:
    def __init__(self, pages):
        self.m = mmap.mmap(-1, (pages + 2) * PAGE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.m))
        assert libc.mprotect(base, PAGE, 0) == 0 and libc.mprotect(base + (pages + 1) * PAGE, PAGE, 0) == 0
        self.start, self.size = base + PAGE, pages * PAGE
        self.bytes = np.frombuffer(self.m, dtype=np.uint8)[PAGE : PAGE + self.size]


rng = np.random.default_rng(7)
src, dst = Guarded(16), Guarded(16)
src.bytes[:] = rng.integers(0, 256, src.size, dtype=np.uint8)


def check(runs, streaming, prefetch, any_order=False):
    dst.bytes[:] = rng.integers(0, 256, dst.size, dtype=np.uint8)
    want = dst.bytes.copy()
    for s, d, n in runs:
        want[d : d + n] = src.bytes[s : s + n]
    rows = [(src.start + s, dst.start + d, n) for s, d, n in runs]
    _native.copy_byte_runs(np.array(rows, dtype=np.uint64).reshape(-1, 3), streaming, prefetch, any_order)
    assert np.array_equal(dst.bytes, want), (runs[:3], streaming, prefetch, any_order)


S, D = src.size, dst.size
for streaming in (True, False):
    for prefetch in (True, False):
        for n in range(301):
            for off in (0, 1, 31, 32, 33, 63):
                check([(off, D - n, n)], streaming, prefetch)  # the destination's last byte
                check([(S - n, off, n)], streaming, prefetch)  # the source's last byte
                check([(0, off, n), (off, 0, n)][off % 2 :][:1], streaming, prefetch)  # a first byte
            check([(S - n, D - n, n)], streaming, prefetch, any_order=True)
        # a transposed tile (8 rows of 16 runs of 256 B, the source a token's row apart)
        # ending on both buffers' last bytes, with a head run that ends in its first run
        rows_, cols, length = 8, 16, 256
        stride = rows_ * length
        s0, d0 = S - (cols - 1) * stride - rows_ * length, D - rows_ * cols * length  # 32 KiB either
        tile = [(s0 + a * length + b * stride, d0 + (a * cols + b) * length, length)
                for a in range(rows_) for b in range(cols)]
        tile[0] = (s0 - 40, d0 - 40, length + 40)
        assert _native.tiles_of(np.array([(src.start + s, dst.start + d, k) for s, d, k in tile],
                                         dtype=np.uint64))
        check(tile, streaming, prefetch)
# lanes: scattered runs of 2-6 KiB (every last one ending on a last byte), destinations apart
big_src, big_dst = Guarded(256), Guarded(256)
src, dst, S, D = big_src, big_dst, big_src.size, big_dst.size
src.bytes[:] = rng.integers(0, 256, S, dtype=np.uint8)
lengths = rng.integers(2048, 6000, 150)
at = D - int(lengths.sum()) - 64 * 149 + np.cumsum(np.r_[0, lengths[:-1] + 64])  # 64 B apart, the last to D
runs = [(int(rng.integers(0, S - k)) if i % 3 else S - int(k), int(d), int(k))
        for i, (d, k) in enumerate(zip(at, lengths))]
assert _native.lane_bytes(np.array([(src.start + s, dst.start + d, k) for s, d, k in runs], dtype=np.uint64))
check(runs, True, True, any_order=True)
print("ok")
"""


def test_runs_at_an_allocation_s_ends_touch_no_byte_past_them() -> None:
    done = subprocess.run(
        [sys.executable, "-c", GUARDED], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-3000:])


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


def tile_runs(
    src0: int, dst0: int, length: int, stride: int, rows: int, cols: int
) -> list[tuple[int, int, int]]:
    """A transposed tile in destination order: run (a, b) reads src0 + a*length + b*stride
    and writes the next `length` bytes from dst0 (an NHD block's heads into HND)."""
    return [
        (src0 + a * length + b * stride, dst0 + (a * cols + b) * length, length)
        for a in range(rows)
        for b in range(cols)
    ]


def merged(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Runs that continue the last on both sides joined, as a block map lists them."""
    out: list[tuple[int, int, int]] = []
    for s, d, n in runs:
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((s, d, n))
    return out


def test_tiles_of_consecutive_blocks_share_their_boundary_runs() -> None:
    """Consecutive blocks on both sides: the last run of one block's tile and the first of
    the next are one 512 B run, split between the two tiles."""
    runs = merged([r for j in range(3) for r in tile_runs(j * 32_768, j * 32_768, 256, 2048, 8, 16)])
    assert len(runs) == 3 * 128 - 2
    assert _native.tiles_of(table(*buffers(0), runs)) == [(0, 8, 16), (127, 8, 16), (254, 8, 16)]


def test_the_copy_finds_the_tiles_of_a_head_major_block_map() -> None:
    """NHD into HND (8 heads of 256 B, 16 tokens): each block's 128 runs are one tile,
    8 heads by 16 tokens; a run off the pattern ends it, and long runs are never tiles."""
    block = tile_runs(0, 0, 256, 2048, 8, 16)
    two_blocks = block + tile_runs(40_960, 32_768, 256, 2048, 8, 16)
    assert _native.tiles_of(table(*buffers(0), two_blocks)) == [(0, 8, 16), (128, 8, 16)]
    broken = [*block[:20], (block[20][0] + 64, *block[20][1:]), *block[21:]]
    found = _native.tiles_of(table(*buffers(0), broken))
    assert all(first + rows * cols <= 20 or first > 20 for first, rows, cols in found)
    assert _native.tiles_of(table(*buffers(0), tile_runs(0, 0, 4096, 8192, 2, 4))) == []  # runs > 2 KiB
    contiguous = [(i * 256, i * 256, 256) for i in range(16)]  # nothing to transpose
    assert _native.tiles_of(table(*buffers(0), contiguous)) == []
    # HND blocks of 32 tokens are tiles; of 64, copied by columns, they measured slower
    # than in list order (kTileColsMax)
    assert _native.tiles_of(table(*buffers(0), tile_runs(0, 0, 256, 2048, 8, 32))) == [(0, 8, 32)]
    assert _native.tiles_of(table(*buffers(0), tile_runs(0, 0, 256, 2048, 8, 64))) == []


@st.composite
def lists_with_tiles(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    """Tiles of random shapes between random runs, some of which overlap the tiles'
    destinations before and after them (where the later run must still win)."""
    runs: list[tuple[int, int, int]] = []
    for _ in range(draw(st.integers(1, 4))):
        rows, cols = draw(st.integers(1, 9)), draw(st.integers(1, 17))
        length = draw(st.integers(1, 600))
        stride = draw(st.integers(1, 3 * length * rows))
        span = (rows - 1) * length + (cols - 1) * stride + length
        src0 = draw(st.integers(0, SRC_BYTES - span))
        dst0 = draw(st.integers(0, DST_BYTES - rows * cols * length))
        for _ in range(draw(st.integers(0, 2))):
            n = draw(st.integers(1, 3000))
            d = draw(
                st.one_of(st.integers(0, DST_BYTES - n), st.integers(dst0, dst0 + rows * cols * length - 1))
            )
            runs.append((draw(st.integers(0, SRC_BYTES - n)), min(d, DST_BYTES - n), n))
        runs += tile_runs(src0, dst0, length, stride, rows, cols)
    n = draw(st.integers(1, 3000))
    runs.append((draw(st.integers(0, SRC_BYTES - n)), draw(st.integers(0, DST_BYTES - n)), n))
    return merged(runs) if draw(st.booleans()) else runs


@settings(max_examples=80, deadline=None)
@given(lists_with_tiles(), st.booleans(), st.integers(0, 2**32 - 1))
def test_tiles_copied_in_source_order_leave_what_list_order_leaves(
    runs: list[tuple[int, int, int]], streaming: bool, seed: int
) -> None:
    src, dst = buffers(seed)
    want = copy_reference(src, dst, runs)
    _native.copy_byte_runs(table(src, dst, runs), streaming)
    assert np.array_equal(dst, want)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 9), st.integers(2, 17), st.integers(1, 400), st.integers(1, 5), st.booleans(),
    st.integers(0, 2**32 - 1),
)  # fmt: skip
def test_chained_tiles_split_their_shared_runs_and_copy_exactly(
    rows: int, cols: int, length: int, blocks: int, streaming: bool, seed: int
) -> None:
    """Blocks back to back on both sides (rows heads, cols tokens, head-major into
    token-major): the boundary runs merge, each tile takes its part of them."""
    block = rows * cols * length
    runs = merged(
        [
            r
            for j in range(blocks)
            for r in tile_runs(7 + j * block, 3 + j * block, length, rows * length, rows, cols)
        ]
    )
    src, dst = buffers(seed)
    want = copy_reference(src, dst, runs)
    assert len(_native.tiles_of(table(src, dst, runs))) == blocks
    _native.copy_byte_runs(table(src, dst, runs), streaming)
    assert np.array_equal(dst, want)


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("prefetch", [True, False])
def test_runs_before_the_first_tile_keep_their_order_and_the_tile_its_head(
    streaming: bool, prefetch: bool
) -> None:
    """The copy takes the runs before the first tile in a loop of their own: short runs
    that are no tile (a DCP rank's slots: 4 of 256 B a KiB apart, then a jump), one of
    them written over by a later run, then a tile whose first run begins inside a longer
    run (its head copied first), then runs that overwrite part of the tile."""
    block = tile_runs(200_000, 300_000, 256, 2048, 8, 16)
    prefix = [(j * 8192 + k * 1024, 100_000 + (4 * j + k) * 256, 256) for j in range(40) for k in range(4)]
    overwritten = (600_000, 100_000 + 37 * 256 + 64, 128)  # lands inside prefix run 37, after it
    lead_in = (200_000 - 512, 300_000 - 512, 512 + 256)  # ends in the tile's first run
    late = [(700_000, 300_000 + 5 * 256 + 17, 300), (710_000, 300_000 + 100 * 256, 256)]
    runs = [*prefix, overwritten, lead_in, *block[1:], *late]
    src, dst = buffers(7)
    assert _native.tiles_of(table(src, dst, runs)) == [(len(prefix) + 1, 8, 16)]
    want = copy_reference(src, dst, runs)
    _native.copy_byte_runs(table(src, dst, runs), streaming, prefetch)
    assert np.array_equal(dst, want)
