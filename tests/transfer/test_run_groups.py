"""Run groups (``csrc/run_groups.h``): how a block map holds its runs.

The builder hands finished runs to a Grouper as single runs, rows and tiles; the map
keeps the groups, and every consumer reads the runs back. What a user relies on: the
runs read back are exactly the runs given, in order, however they were grouped; the
regular maps (permuted, re-sharded) are a few groups per block, not one row per run;
and the copy and the validation over groups give what they give over the runs.
"""

from __future__ import annotations

import ctypes
import random
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlayout import EngineKVFormat as F
from kvlayout import _native
from kvlayout.transfer import Shard, block_map
from tests.transfer.test_block_maps import device_into_page_first, vllm


@st.composite
def run_lists(draw: st.DrawFn) -> np.ndarray:
    """Runs as a builder makes them: stretches of rows at one step, tiles of rows at one
    step, single runs, one after another (steps may be negative; addresses wrap)."""
    out: list[tuple[int, int, int]] = []
    for _ in range(draw(st.integers(1, 6))):
        s, d = draw(st.integers(0, 2**40)), draw(st.integers(0, 2**40))
        n = draw(st.sampled_from([1, 8, 256, 1000]))
        count, rows = draw(st.integers(1, 7)), draw(st.integers(1, 5))
        ss, ds = draw(st.sampled_from([n, 2 * n, -3 * n, 4096])), draw(st.sampled_from([n, 3 * n, 4096]))
        sr, dr = draw(st.sampled_from([0, 64, 65536])), draw(st.sampled_from([0, 7 * n, 65536]))
        for r in range(rows):
            for i in range(count):
                out.append(((s + r * sr + i * ss) % 2**64, (d + r * dr + i * ds) % 2**64, n))
    return np.array(out, dtype=np.uint64).reshape(-1, 3)


@settings(max_examples=300, deadline=None)
@given(run_lists())
def test_groups_read_back_as_the_runs_given(runs: np.ndarray) -> None:
    groups = _native.group_runs(runs)
    assert np.array_equal(_native.expand_groups(groups), runs)
    assert 1 <= len(groups) <= len(runs)


def test_groups_read_back_past_the_tables_growth() -> None:
    """Thousands of groups (the builder's table grows while its open group and row sit in
    its last rows): stretches that join into rows and groups, and lone runs between."""
    rng = random.Random(7)
    out: list[tuple[int, int, int]] = []
    for k in range(3000):
        s, d, n = rng.randrange(2**40), rng.randrange(2**40), rng.choice([8, 256])
        rows, count = (1, 1) if k % 3 else (rng.randint(1, 3), rng.randint(2, 4))
        out += [
            (s + r * 65536 + i * 2 * n, d + r * 4096 + i * n, n) for r in range(rows) for i in range(count)
        ]
    runs = np.array(out, dtype=np.uint64)
    groups = _native.group_runs(runs)
    assert len(groups) > 1000  # two lone runs of one length may make a row
    assert np.array_equal(_native.expand_groups(groups), runs)


def test_a_tile_given_run_by_run_is_one_group() -> None:
    """8 rows (heads) of 16 runs (slots): one group, its steps from the runs."""
    runs = [(1000 + h * 256 + t * 2048, 50000 + h * 4096 + t * 256, 256) for h in range(8) for t in range(16)]
    groups = _native.group_runs(np.array(runs, dtype=np.uint64))
    assert groups.tolist() == [[1000, 50000, 256, 16, 2048, 256, 8, 256, 4096]]


def test_a_table_of_groups_from_python_is_checked() -> None:
    """A group with no runs (or runs beyond 2^40) is a ValueError, not a runaway read."""
    for bad in (
        [0, 0, 8, 0, 0, 0, 1, 0, 0],
        [0, 0, 8, 1, 0, 0, 0, 0, 0],
        [0, 0, 8, 2**30, 0, 0, 2**30, 0, 0],
    ):
        with pytest.raises(ValueError, match="each group needs rows and runs"):
            _native.expand_groups(np.array([bad], dtype=np.uint64))


NHD, HND = F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS
SHAPES = {NHD: (2, 12, 16, 4, 8), HND: (2, 12, 4, 16, 8)}  # 12 blocks of 16 tokens, 4 heads of 8


def _one_tile_per_block(src_fmt: F, dst_fmt: F) -> None:
    src = vllm(*SHAPES[src_fmt], fmt=src_fmt)
    dst = vllm(*SHAPES[dst_fmt], fmt=dst_fmt)
    torch.nn.init.normal_(src.kv[0])
    torch.nn.init.normal_(src.kv[1])
    m = block_map(src, dst, [9, 1, 5, 3], [7, 2, 11, 4])  # no two blocks consecutive on either side
    slabs = 2 * 2  # layers x K/V
    assert m.num_runs == slabs * 4 * 4 * 16  # a run per (slab, block, head, slot)
    assert m.num_groups == slabs * 4  # a tile per (slab, block)
    m.copy()
    assert np.array_equal(m.runs, m._build(force_sort=True))  # the sorting path reads back alike
    for s, d, n in m.runs.tolist():
        assert ctypes.string_at(s, n) == ctypes.string_at(d, n)


def test_a_permuted_map_is_a_tile_per_block() -> None:
    _one_tile_per_block(NHD, HND)
    _one_tile_per_block(HND, NHD)


@pytest.mark.parametrize(("src_fmt", "dst_fmt"), [(NHD, HND), (HND, NHD), (NHD, NHD), (HND, HND)])
@pytest.mark.parametrize(
    ("heads", "bs", "dst_bs", "dst_tp"),
    [(3, 3, 3, 1), (4, 16, 16, 1), (8, 4, 4, 1), (4, 16, 8, 1), (3, 4, 8, 1), (4, 16, 16, 2), (8, 4, 4, 2),
     (6, 4, 8, 2)],
)  # fmt: skip
@pytest.mark.parametrize("ids", ["consecutive", "scattered", "runs of two", "reversed"])
def test_whole_blocks_are_the_general_walks_groups(
    src_fmt: F, dst_fmt: F, heads: int, bs: int, dst_bs: int, ids: str, dst_tp: int
) -> None:
    """The block loops that serve whole destination blocks (a tile after a tile of its
    shape written straight into the Grouper, its first run continuing the last or not,
    its rows continuing the open group or not; a folded block as one emission) give the
    groups of the general walk, block by block, whatever the block ids, with a partial
    last block, destination blocks that span source blocks and a destination holding
    half the heads (a row of a run per slot); and the copy moves the bytes the runs say."""
    blocks, tokens = 12, 5 * 16 + 1

    def side(fmt: F, block_size: int, held: int) -> object:
        nb = blocks * 16 // block_size
        shape = (2, nb, block_size, held, 8) if fmt == NHD else (2, nb, held, block_size, 8)
        return vllm(*shape, fmt=fmt)

    src, dst = side(src_fmt, bs, heads), side(dst_fmt, dst_bs, heads // dst_tp)
    shard = Shard(dst_tp - 1, dst_tp, heads)
    for t in src.kv:  # type: ignore[attr-defined]
        torch.nn.init.normal_(t)
    n_src, n_dst = -(-tokens // bs), -(-tokens // dst_bs)
    orders = {
        "consecutive": lambda n, pool: list(range(n)),
        "scattered": lambda n, pool: random.Random(n).sample(range(pool), n),
        "runs of two": lambda n, pool: [2 * (i // 2) * 2 + i % 2 for i in range(n)],
        "reversed": lambda n, pool: list(range(pool - 1, pool - 1 - n, -1)),
    }
    src_ids = orders[ids](n_src, blocks * 16 // bs)
    dst_ids = orders[ids](n_dst, blocks * 16 // dst_bs)
    m = block_map(src, dst, src_ids, dst_ids, num_tokens=tokens, dst_shard=shard)
    general, _ = m._build_groups(force_sort=False, blocks_one_by_one=True)
    assert np.array_equal(m._groups, general)
    walked, runs = m._build_groups(force_sort=False, slabs_one_by_one=True)
    assert runs == m.num_runs and np.array_equal(_native.expand_groups(walked), m.runs)
    m.copy()
    for s, d, n in m.runs.tolist():
        assert ctypes.string_at(s, n) == ctypes.string_at(d, n)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 300), st.integers(1, 6), st.integers(1, 4)), min_size=1, max_size=12),
    st.integers(1, 4),
    st.randoms(use_true_random=False),
)
def test_copy_over_groups_splits_by_bytes_over_threads(
    pieces: list[tuple[int, int, int]], threads: int, rnd: random.Random
) -> None:
    """Rows of runs gathered from a strided source into shuffled destination places: each
    thread copies its share of the bytes read back from the groups, cutting runs (and
    groups) at its edges; the result is the runs' copy."""
    total = sum(n * c * r for n, c, r in pieces)
    src = np.frombuffer(rnd.randbytes(4 * total + 64), dtype=np.uint8).copy()
    dst = np.zeros(2 * total + 64, dtype=np.uint8)
    order = list(range(len(pieces)))
    rnd.shuffle(order)
    sizes = [pieces[i][0] * pieces[i][1] * pieces[i][2] for i in order]
    place = dict(zip(order, np.cumsum([0, *[2 * z for z in sizes]]).tolist(), strict=False))
    runs, at = [], 0
    for i, (n, count, rows) in enumerate(pieces):
        for r in range(rows):  # rows 3 runs apart in the source, runs 2 apart: strided, never merging
            for k in range(count):
                runs.append(
                    (
                        src.ctypes.data + at + (r * count + k) * 2 * n,
                        dst.ctypes.data + place[i] + (r * count + k) * n,
                        n,
                    )
                )
        at += 2 * n * count * rows
    table = np.array(runs, dtype=np.uint64)
    groups = _native.group_runs(table)

    def spans(a: np.ndarray) -> np.ndarray:
        return np.array([[a.ctypes.data, a.nbytes, a.nbytes, 1]], dtype=np.uint64)

    assert _native.validate_groups(groups, spans(src), spans(dst)) == (_native.MapProblem.none, -1, -1)
    problem, _, _, used = _native.copy_groups(groups, spans(src), spans(dst), threads, 1)
    assert problem is _native.MapProblem.none and 1 <= used <= threads
    want = np.zeros_like(dst)
    for s, d, n in table.tolist():
        want[d - dst.ctypes.data : d - dst.ctypes.data + n] = src[
            s - src.ctypes.data : s - src.ctypes.data + n
        ]
    assert np.array_equal(dst, want)


def test_validation_reads_back_every_group_that_could_leave_a_block() -> None:
    """A group is checked whole only where its runs lie between its first and its last
    and those share a block; a group stepping over padding, or back, is checked run by
    run, and the run outside is named."""
    src = np.zeros(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    s, d = src.ctypes.data, dst.ctypes.data
    spans = np.array([[s, 128, 64, 2]], dtype=np.uint64)  # blocks at 0 and 128, padding between
    dst_spans = np.array([[d, 256, 256, 1]], dtype=np.uint64)

    def check(*rows: tuple[int, ...]) -> tuple[str, int, int]:
        table = np.array([[x % 2**64 for x in row] for row in rows], dtype=np.uint64)
        problem, run, other = _native.validate_groups(table, spans, dst_spans)
        return problem.name, int(run), int(other)

    assert check((s, d, 16, 3, 16, 16, 1, 0, 0)) == ("none", -1, -1)  # 0, 16, 32: in block 0
    assert check((s, d, 16, 3, 64, 16, 1, 0, 0)) == ("src_outside", 1, -1)  # 0, 64 (padding), 128
    back = (s + 16, d, 16, 2, 64, 16, 2, -32, 32)  # 16, 80 (padding), -16, 48: ends in block 0
    assert check(back) == ("src_outside", 1, -1)
    assert check((s, d, 16, 1, 0, 0, 1, 0, 0), (s + 128, d + 16, 16, 2, 16, 16, 1, 0, 0)) == ("none", -1, -1)
    assert (
        check((s, d + 32, 16, 1, 0, 0, 1, 0, 0), (s + 128, d + 16, 16, 2, 16, 16, 1, 0, 0))[0]
        == "dst_overlap"
    )  # overlap
    assert (
        check((s, d + 64, 16, 3, 16, -8, 1, 0, 0))[0] == "dst_overlap"
    )  # destinations stepping back over each other


@pytest.mark.parametrize("fmt", [NHD, HND])
@pytest.mark.parametrize("ids", ["whole pool", "whole pool reversed", "scattered"])
def test_slabs_of_one_shape_are_one_pattern_pasted(fmt: F, ids: str) -> None:
    """Every layer's K and V slab has one shape, so the builder walks the first and pastes
    its runs at the others: a request over a layer's whole pool in order is one run per
    layer (K's last block runs on into V's first, across the slabs' edge), and whatever
    the block ids the runs are those of walking every slab."""
    blocks, layers = 6, 3
    shape = (2, blocks, 4, 2, 8) if fmt == NHD else (2, blocks, 2, 4, 8)
    src, dst = vllm(*shape, fmt=fmt, layers=layers), vllm(*shape, fmt=fmt, layers=layers)
    for t in src.kv:
        torch.nn.init.normal_(t)
    order = {
        "whole pool": list(range(blocks)),
        "whole pool reversed": list(range(blocks))[::-1],
        "scattered": random.Random(3).sample(range(blocks), 4),
    }[ids]
    m = block_map(src, dst, order, order)
    walked, runs = m._build_groups(force_sort=False, slabs_one_by_one=True)
    assert runs == m.num_runs and np.array_equal(_native.expand_groups(walked), m.runs)
    if ids == "whole pool":
        assert m.num_runs == layers and m.runs[:, 2].tolist() == [src.kv[0].numel() * 4] * layers
    m.copy()
    for s, d in zip(src.kv, dst.kv, strict=True):
        held = torch.tensor(order)
        assert torch.equal(s[:, held], d[:, held])


@pytest.mark.parametrize("shapes", [1, 3, 5])  # 5: more shapes than the builder keeps patterns of
def test_slabs_of_alternating_shapes_paste_each_from_its_own_pattern(shapes: int) -> None:
    """A row cut in pieces of several widths makes slabs whose shapes alternate; each
    shape's pattern is kept and pasted, and where the shapes outnumber the patterns kept,
    one is walked again: the runs are those of walking every slab either way."""
    src, dst = vllm(2, 8, 4, 4, 16, layers=3), vllm(2, 8, 4, 4, 16, layers=3)
    m = block_map(src, dst, [5, 1, 6], [2, 7, 3], num_tokens=10)
    p = m._pair
    slabs = p.slabs.copy()
    assert p.order[0] == 0  # the slab level outermost: the builder pastes
    slabs[:, 4] = [4 * (1 + i % shapes) for i in range(len(slabs))]  # widths within a head's 64 bytes
    slabs[:, 9] = 0  # nothing folds: a run per (block, slot, head)
    (src_ids, dst_ids), classes = m._ids, (p.src_classes, p.dst_classes)

    def build(walked: bool) -> Any:
        args = (slabs, p.group_starts, p.order, len(p.heads), 10, src_ids, 4, dst_ids, 4, *classes)
        return _native.build_groups(*args, False, False, walked)

    (pasted, runs, in_order), (walked, walked_runs, _) = build(False), build(True)
    assert in_order and runs == walked_runs == len(slabs) * 10 * 4
    assert np.array_equal(_native.expand_groups(pasted), _native.expand_groups(walked))


@pytest.mark.parametrize("classes", ["one class", "a class per layer"])
def test_a_tokens_slabs_pasted_at_each_token_never_join_two_tensors(classes: str) -> None:
    """Layers interleaved in the destination (SGLang's page_first host pool): the builder
    walks a group's slabs at its first token and pastes them at each token after. Here
    each layer's source is its own tensor, though the layers lie interleaved side by side
    as in the destination, so every run is contiguous with the next on both sides: none
    may join two tensors, within a token or across from one token's last layer to the
    next token's first. Slabs whose token strides differ (a class per layer) are walked
    one by one; either way the runs are those of walking every slab."""
    layers, heads = 3, 2
    m = device_into_page_first(layers, heads)
    p, (src_ids, dst_ids) = m._pair, m._ids
    assert tuple(p.order[:3]) == (1, 2, 0)  # block, slot, then slab: the builder pastes per token
    slabs, dst_classes = p.slabs.copy(), p.dst_classes
    row = int(slabs[0, 4]) * heads  # a token's row of one layer, its heads folded
    src_classes = dst_classes.copy()  # the source laid out as the destination ...
    slabs[:, 0] = slabs[:, 1]
    slabs[:, 2] = np.arange(len(slabs))  # ... but each layer's K and V its own tensor
    if classes == "a class per layer":
        src_classes = np.concatenate([src_classes, src_classes + np.uint64(1)])  # strides never met
        slabs[1::2, 7] = 1
    assert np.all(np.diff(slabs[:layers, 0].astype(np.int64)) == row) and dst_classes[0, 1] == layers * row

    def build(walked: bool) -> Any:
        args = (
            slabs,
            p.group_starts,
            p.order,
            len(p.heads),
            20,
            src_ids,
            8,
            dst_ids,
            8,
            src_classes,
            dst_classes,
        )
        return _native.build_groups(*args, False, False, walked)

    (pasted, runs, in_order), (walked, walked_runs, _) = build(False), build(True)
    assert in_order and runs == walked_runs == 2 * layers * 20
    assert np.array_equal(_native.expand_groups(pasted), _native.expand_groups(walked))
