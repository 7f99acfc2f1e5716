"""The NIXL layer's planning, without NIXL: descriptors and op of a map, the staged
strategy's gather and stretches, the prepped form's index arrays and the cost model's
choice. Byte moves are simulated in this process (each descriptor pair as one memmove
between real buffers standing for both sides) and checked against the runs themselves.
The real transfers between two processes are in ``test_nixl.py``."""

from __future__ import annotations

import ctypes
import dataclasses
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal, cast

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvlayout import _native
from kvlayout.errors import KVLayoutError
from kvlayout.transfer import TransferError
from kvlayout.transfer import nixl as nx
from kvlayout.transfer.nixl import calibration, direct, plans, regions

U64 = np.uint64
Pieces = list[tuple[int, int, int, int, int]]  # (src buffer, offset, dst buffer, offset, length)
Case = tuple[list[np.ndarray], list[np.ndarray], Pieces, Literal["WRITE", "READ"]]


@dataclass(frozen=True)
class Side:
    """A map side for tests: buffers standing for a registration or a peer's description."""

    tensor_spans: np.ndarray
    is_local: bool
    device_type: str = "cpu"
    device_index: int = 0

    def moved(self) -> None:
        return None  # numpy buffers the test holds: they do not move


@dataclass(frozen=True)
class Map:
    """A test-only block map: hand-built runs between two sides."""

    runs: np.ndarray
    src: Side
    dst: Side


def side_of(buffers: list[np.ndarray], *, local: bool) -> Side:
    return Side(np.array([[b.ctypes.data, b.nbytes] for b in buffers], dtype=U64), local)


def runs_between(src: list[np.ndarray], dst: list[np.ndarray], pieces: Pieces) -> np.ndarray:
    """Rows (source address, destination address, length) from (src buffer, src offset,
    dst buffer, dst offset, length) pieces."""
    rows = [(src[a].ctypes.data + i, dst[b].ctypes.data + j, n) for a, i, b, j, n in pieces]
    return np.array(rows, dtype=U64).reshape(-1, 3)


def apply(rows_from: np.ndarray, rows_to: np.ndarray) -> None:
    """Post descriptor pairs in this process: one memmove per pair."""
    for (a, n, _), (b, m, _) in zip(rows_from.tolist(), rows_to.tolist(), strict=True):
        assert n == m
        ctypes.memmove(b, a, n)


def post(p: nx.Plan) -> None:
    """What NIXL does with a plan, simulated: gather, move each descriptor, scatter."""
    if p.op == "WRITE":
        p.copy()
    if p.op == "WRITE":
        apply(p.local, p.remote)
    else:
        apply(p.remote, p.local)
    if p.op == "READ":
        p.copy()


@st.composite
def maps(draw: st.DrawFn) -> Case:
    """Two buffers a side, runs of 1-64 bytes at distinct 64-byte slots of each (so they
    never overlap), some laid consecutively on the remote side, and an op."""
    slots = 32
    local = [np.random.default_rng(i).integers(0, 256, slots * 64, dtype=np.uint8) for i in range(2)]
    remote = [np.random.default_rng(9 + i).integers(0, 256, slots * 64, dtype=np.uint8) for i in range(2)]
    n = draw(st.integers(1, 24))
    lslots = draw(st.permutations(range(2 * slots)))[:n]
    rslots = draw(st.permutations(range(2 * slots)))[:n]
    whole = draw(st.booleans())  # whole slots: remote-consecutive slots make one stretch
    pieces = []
    for ls, rs in zip(lslots, rslots, strict=True):
        length = 64 if whole else draw(st.integers(1, 64))
        pieces.append((ls // slots, (ls % slots) * 64, rs // slots, (rs % slots) * 64, length))
    op: Literal["WRITE", "READ"] = draw(st.sampled_from(["WRITE", "READ"]))
    return local, remote, pieces, op


@given(maps(), st.sampled_from(["direct", "staged"]))
def test_a_plan_moves_what_the_runs_say(case: Case, strategy: Literal["direct", "staged"]) -> None:
    """Any runs, either strategy, either op: after the plan's copies and descriptors,
    the destination holds the source's bytes where the runs say, and nothing else moved."""
    local, remote, pieces, op = case
    staging = np.zeros(sum(p[4] for p in pieces), dtype=np.uint8)
    if op == "WRITE":
        src, dst = local, remote
        m = Map(runs_between(local, remote, pieces), side_of(local, local=True), side_of(remote, local=False))
    else:
        src, dst = remote, local
        flipped = [(b, j, a, i, n) for a, i, b, j, n in pieces]
        m = Map(
            runs_between(remote, local, flipped), side_of(remote, local=False), side_of(local, local=True)
        )
    expected = [d.copy() for d in dst]
    for row in m.runs.tolist():
        s = next(b for b in src if b.ctypes.data <= row[0] < b.ctypes.data + b.nbytes)
        d = next(k for k, b in enumerate(dst) if b.ctypes.data <= row[1] < b.ctypes.data + b.nbytes)
        i, j = row[0] - s.ctypes.data, row[1] - dst[d].ctypes.data
        expected[d][j : j + row[2]] = s[i : i + row[2]]
    p = nx.plan(m, strategy=strategy, staging=staging_at(staging))
    assert p.strategy == strategy and p.op == op
    post(p)
    for got, want in zip(dst, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    if strategy == "staged":
        remote_rows = m.runs[:, 1] if op == "WRITE" else m.runs[:, 0]
        assert p.num_descriptors == brute_force_stretches(remote_rows, m.runs[:, 2], remote)


@given(maps(), st.integers(1, 30))
def test_a_pipeline_cuts_the_plan_into_stages_that_move_it_all(case: Case, stages: int) -> None:
    """Stages in order cover every descriptor and every local copy once, each stage's
    copies fill (or empty) exactly its descriptors, there are ``min(stages,
    descriptors)`` of them (stretches of uneven bytes included: a cut that equal bytes
    would put on another moves on), and running them stage by stage moves the runs."""
    local, remote, pieces, _ = case
    m = Map(runs_between(local, remote, pieces), side_of(local, local=True), side_of(remote, local=False))
    staging = np.zeros(sum(p[4] for p in pieces), dtype=np.uint8)
    p = nx.plan(m, strategy="staged", staging=staging_at(staging), stages=stages)
    assert p.copies is not None and len(p.stages) == min(stages, p.num_descriptors)
    d_at, r_at = 0, 0
    for stage in p.stages:
        (dlo, dhi), (rlo, rhi) = stage.descriptors, stage.runs
        assert (dlo, rlo) == (d_at, r_at) and dhi > dlo and rhi > rlo
        assert p.copies[rlo:rhi, 2].sum() == p.local[dlo:dhi, 1].sum()
        d_at, r_at = dhi, rhi
    assert (d_at, r_at) == (p.num_descriptors, p.num_runs)
    expected = [d.copy() for d in remote]
    for a, i, b, j, n in pieces:
        expected[b][j : j + n] = local[a][i : i + n]
    for k, stage in enumerate(p.stages):
        p.copy_stage(k)
        lo, hi = stage.descriptors
        apply(p.local[lo:hi], p.remote[lo:hi])
    for got, want in zip(remote, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_staged_write_runs_a_stage_per_4_mib_by_default_priced_as_one_unless_asked() -> None:
    """A staged WRITE's gather overlaps the wire in a stage per 4 MiB, up to AUTO_STAGES
    (never more stages than stretches); a READ's scatter runs in one stage unless asked."""
    m, buf = scattered_map(64, 1 << 18)  # 16 MiB as 64 remote-consecutive runs: one stretch
    for stages in (None, 4):
        assert len(nx.plan(m, strategy="staged", staging=staging_at(buf), stages=stages).stages) == 1
    split = Map(m.runs[::2], m.src, m.dst)  # every other run: 32 stretches of 256 KiB, 8 MiB
    p = nx.plan(split, strategy="staged", staging=staging_at(buf))
    assert [st.descriptors for st in p.stages] == [(0, 16), (16, 32)]
    assert len(nx.plan(split, strategy="staged", staging=staging_at(buf), stages=1).stages) == 1
    model = nx.DEFAULT_COST
    wire, copy = model.direct_s(32, 8 << 20), 32 * model.copy_per_run_s + (8 << 20) / model.copy_bandwidth
    # a staged plan's own work, and the runs descend on the remote side: it sorts them
    # to lay its staging out
    ordering = model.staged_plan_s + model.order_s(32, sorts=1)
    assert model.order_s(32, sorts=1) == 32 * model.sort_per_run_s > 0 and model.staged_plan_s > 0
    # the default pipeline is priced as one stage (the strategy is what one stage would
    # choose), as estimate() prices it; asked for stages, the overlap is counted
    assert p.predicted_s["staged"] == pytest.approx(wire + copy + ordering)
    assert nx.estimate(split, poster="src").predicted_s["staged"] == pytest.approx(p.predicted_s["staged"])
    with pytest.raises(TransferError, match=r"^poster must be 'src' or 'dst', not 'peer'$"):
        nx.estimate(split, poster="peer")  # type: ignore[arg-type]
    two = nx.plan(split, strategy="staged", staging=staging_at(buf), stages=2)
    assert two.predicted_s["staged"] == pytest.approx(max(wire, copy) + min(wire, copy) / 2 + ordering)
    read = Map(split.runs[:, [1, 0, 2]], split.dst, split.src)  # the same bytes, the peer to here
    r = nx.plan(read, strategy="staged", staging=staging_at(buf))
    assert (r.op, len(r.stages)) == ("READ", 1)
    big, big_buf = scattered_map(512, 1 << 18)  # 64 MiB of 256 stretches: AUTO_STAGES
    big_split = Map(big.runs[::2], big.src, big.dst)
    pipeline = nx.plan(big_split, strategy="staged", staging=staging_at(big_buf))
    assert len(pipeline.stages) == nx.AUTO_STAGES == 8
    # estimate() says the stages each strategy runs in by default, as plan() cuts them
    assert nx.estimate(big_split, poster="src").stages == {"direct": 1, "staged": 8, "peer-staged": 1}
    assert nx.estimate(split, poster="src").stages["staged"] == 2
    assert nx.estimate(big_split, poster="dst").stages == {"direct": 1, "staged": 1, "peer-staged": 8}
    for wrong in (0, True, 2.0):
        with pytest.raises(TypeError, match=f"stages must be a positive int or None, got {wrong}"):
            nx.plan(split, strategy="staged", staging=staging_at(buf), stages=wrong)  # type: ignore[arg-type]


def test_peer_staged_moves_the_local_stretches_and_the_peer_copies() -> None:
    n, length = 256, 256  # consecutive here, scattered on the peer: TP 2 -> 1 in NHD, in miniature
    local, remote = [np.zeros(n * length, np.uint8)], [np.zeros(2 * n * length, np.uint8)]
    pieces = [(0, i * length, 0, 2 * i * length, length) for i in range(n)]
    m = Map(runs_between(local, remote, pieces), side_of(local, local=True), side_of(remote, local=False))
    buf = np.zeros(n * length, np.uint8)
    there = nx.PeerStaging(buf.ctypes.data, buf.nbytes)  # stands for the peer's buffer
    p = nx.plan(m, staging=staging_at(buf), peer_staging=there)
    assert (p.strategy, p.op, p.num_descriptors) == ("peer-staged", "WRITE", 1)
    assert p.predicted_s["peer-staged"] < min(p.predicted_s["direct"], p.predicted_s["staged"])
    assert (p.local[0, 0], p.local[0, 1], p.remote[0, 0]) == (local[0].ctypes.data, n * length, there.address)
    assert nx.plan(m, staging=staging_at(buf)).strategy == "direct"  # staging here cannot help this pair
    # the peer's unstage of the same map (its READ-side plan) reads its staging where this wrote
    flipped = Map(m.runs, side_of(local, local=False), side_of(remote, local=True))
    theirs = nx.plan(flipped, strategy="staged", staging=staging_at(buf), stages=1)
    assert theirs.copies is not None and theirs.copies[0, 0] == there.address
    with pytest.raises(
        TransferError, match="needs a peer staging buffer of 65536 bytes; got one of 65535 bytes"
    ):
        nx.plan(m, strategy="peer-staged", peer_staging=nx.PeerStaging(there.address, buf.nbytes - 1))
    with pytest.raises(TransferError, match="unstage runs on the destination side of the map"):
        nx.unstage(m, staging_at(buf))
    with pytest.raises(TransferError, match="stage runs on the source side of the map"):
        nx.stage(flipped, staging_at(buf))
    # the mirror, a READ into the consecutive side from the scattered one the peer staged
    read = Map(m.runs[:, [1, 0, 2]], side_of(remote, local=False), side_of(local, local=True))
    r = nx.plan(read, strategy="peer-staged", peer_staging=there)
    assert (r.op, r.num_descriptors, int(r.remote[0, 0])) == ("READ", 1, there.address)
    assert nx.plan(read, staging=staging_at(buf), peer_staging=there).strategy == "peer-staged"


def test_a_peer_staging_buffer_on_the_tensors_the_peer_described_is_refused() -> None:
    """A peer's staging buffer is an allocation of its own: one it names on its cache (a
    peer that lies, or a handshake's fields mixed up) would take a peer-staged WRITE onto
    its KV, or a READ its KV for staged bytes. Refused by name, whichever strategy was
    asked for; one that merely touches a tensor's end is the peer's, and goes."""
    n, length = 64, 256
    local, remote = [np.zeros(n * length, np.uint8)], [np.zeros(2 * n * length, np.uint8)]
    pieces = [(0, i * length, 0, 2 * i * length, length) for i in range(n)]
    m = Map(runs_between(local, remote, pieces), side_of(local, local=True), side_of(remote, local=False))
    read = Map(m.runs[:, [1, 0, 2]], side_of(remote, local=False), side_of(local, local=True))
    start, size = remote[0].ctypes.data, remote[0].nbytes
    for at in (start, start + size - 1, start - n * length + 1):
        lie = nx.PeerStaging(at, n * length)
        why = (
            f"PeerStaging({at:#x}, {n * length} bytes) overlaps tensor 0 ({start:#x}, {size} bytes) of the 1 "
            "tensors the peer described: a peer's staging buffer lies apart from its cache (a WRITE there "
            "would land on its KV, a READ take its KV for staged bytes); refused before posting"
        )
        for which, strategy in ((m, "peer-staged"), (read, "peer-staged"), (m, "auto")):
            with pytest.raises(nx.RefusedDescriptorError, match=f"^{re.escape(why)}$"):
                nx.plan(which, strategy=strategy, peer_staging=lie)  # type: ignore[arg-type]
    for at in (start + size, start - n * length):  # right after its end, right before its start
        p = nx.plan(m, strategy="peer-staged", peer_staging=nx.PeerStaging(at, n * length))
        assert int(p.remote[0, 0]) == at


def _two_group_peer() -> tuple[Any, Any, Any]:
    """A live two-group cache (full and sliding-window attention of one format, groups on
    memory apart), a peer's description of another such cache, and that description's
    group 1 moved 1 GiB up (the peer's other group lying elsewhere)."""
    from kvlayout.testing.nixl_peer import CacheSpec, build_cache

    spec = CacheSpec("NL_X_TWO_NB_BS_NH_HS", 4, 8, 4, 2, 8, shard=(0, 1, 2), engine_groups=(0, 0, 1, 1))
    here, _ = build_cache(spec)
    there, _ = build_cache(dataclasses.replace(spec, seed=1))
    d = there.describe(shard=spec.the_shard, block_size=4)
    g1 = d.groups[1]
    moved = dataclasses.replace(
        g1,
        planes=tuple(
            dataclasses.replace(p, addresses=tuple(a + (1 << 30) for a in p.addresses)) for p in g1.planes
        ),
    )
    return here, d, moved


def test_a_group_s_map_checks_the_peer_staging_against_the_description_it_came_from() -> None:
    """A map of ``description.group(0)`` refuses a staging buffer on the peer's group 1,
    by the description that group came from: of two descriptions whose group 0 is the same
    and whose group 1 lies elsewhere, each map answers for its own (the side made for one
    is not the other's, though the groups compare equal), and the honest place of one is
    the other's lie. ``whole`` is not data: a group's JSON reads back equal, with none."""
    from kvlayout.registration.peers import RegistrationDescription
    from kvlayout.transfer import block_map, join_maps

    here, d, moved = _two_group_peer()
    g1 = d.groups[1]
    e = dataclasses.replace(d, groups=(d.groups[0], moved))
    assert d.group(0) == e.group(0) and d.group(0).whole is d and e.group(0).whole is e
    back = RegistrationDescription.from_json(d.group(1).to_json())
    assert back == d.group(1) and back.whole is None
    on_d, on_e = (nx.PeerStaging(g.planes[0].addresses[1] + 128, 256) for g in (g1, moved))
    for desc, lie, honest in ((d, on_d, on_e), (e, on_e, on_d)):
        m = block_map(here.kernel_groups[0], desc.group(0), [1, 3], [2, 0])
        assert m.dst.descriptions == (desc,)
        with pytest.raises(nx.RefusedDescriptorError, match=r"overlaps tensor 3 \(0x[0-9a-f]+, 2048 bytes, kernel "
                           r"group 1 \(engine group 1, layers 2-3: .*\), its tensor 1\) of the 4 tensors"):  # fmt: skip
            nx.plan(m, strategy="peer-staged", peer_staging=lie._replace(nbytes=m.num_bytes))
        p = nx.plan(m, strategy="peer-staged", peer_staging=honest._replace(nbytes=m.num_bytes))
        assert int(p.remote[:, 0].min()) >= honest.address
        joined = join_maps([m])  # a joined map's side names its parts' descriptions
        assert joined.dst.descriptions == (desc,)
        with pytest.raises(nx.RefusedDescriptorError, match=r"kernel group 1 .*its tensor 1\)"):
            nx.plan(joined, strategy="peer-staged", peer_staging=lie._replace(nbytes=m.num_bytes))


def test_a_group_description_replaced_after_group_still_checks_its_own_tensors() -> None:
    """``dataclasses.replace`` of ``d.group(1)`` (its tensors moved, as a caller rebasing a
    peer's addresses would) keeps ``whole``, the description it came from, which does not
    hold the moved tensors: a staging buffer on them is still the peer's lie (the side's own
    tensors are checked too), and one on the original group's is refused by ``whole``."""
    from kvlayout.transfer import block_map

    here, d, moved = _two_group_peer()
    g1 = d.groups[1]
    rebased = dataclasses.replace(d.group(1), groups=(moved,))
    assert rebased.whole is d  # replace() keeps it
    m = block_map(here.kernel_groups[1], rebased, [1, 3], [2, 0])
    own = nx.PeerStaging(moved.planes[0].addresses[1] + 128, m.num_bytes)
    with pytest.raises(
        nx.RefusedDescriptorError, match=r"overlaps tensor 1 \(0x[0-9a-f]+, 2048 bytes\) of the 2 "
    ):
        nx.plan(m, strategy="peer-staged", peer_staging=own)
    with pytest.raises(nx.RefusedDescriptorError, match=r"kernel group 1 .*its tensor 0\) of the 4 tensors"):
        nx.plan(m, strategy="peer-staged", peer_staging=own._replace(address=g1.planes[0].addresses[0]))


def test_a_joined_map_of_two_descriptions_checks_the_peer_staging_against_both() -> None:
    """A request moved as one over maps of two of the peer's descriptions (pools it
    registered apart, as SGLang's KV pool and its state pool): a staging buffer on either
    description's other kernel group is refused, naming that group."""
    from kvlayout.testing.nixl_peer import CacheSpec, build_cache
    from kvlayout.transfer import block_map, join_maps

    spec = CacheSpec("NL_X_TWO_NB_BS_NH_HS", 4, 8, 4, 2, 8, shard=(0, 1, 2), engine_groups=(0, 0, 1, 1))
    parts, descriptions = [], []
    for seed in (0, 1):
        here, _ = build_cache(dataclasses.replace(spec, seed=2 * seed))
        there, _ = build_cache(dataclasses.replace(spec, seed=2 * seed + 1))
        d = there.describe(shard=spec.the_shard, block_size=4)
        parts.append(block_map(here.kernel_groups[0], d.group(0), [1, 3], [2, 0]))
        descriptions.append(d)
    joined = join_maps(parts)
    assert joined.dst.descriptions == tuple(descriptions)
    for d in descriptions:
        lie = nx.PeerStaging(d.groups[1].planes[0].addresses[1] + 128, joined.num_bytes)
        with pytest.raises(
            nx.RefusedDescriptorError, match=r"kernel group 1 .*its tensor 1\) of the 4 tensors"
        ):
            nx.plan(joined, strategy="peer-staged", peer_staging=lie)


def test_a_description_s_tensor_label_names_its_rows_and_refuses_others() -> None:
    """``tensor_label(k)`` names row ``k`` of ``tensor_spans`` (kernel group, engine group,
    layers, place); a row it does not have, a negative one included, is refused."""
    from kvlayout.registration.peers import PeerDescriptionError
    from kvlayout.testing.nixl_peer import CacheSpec, build_cache

    spec = CacheSpec("NL_X_TWO_NB_BS_NH_HS", 4, 8, 4, 2, 8, shard=(0, 1, 2), engine_groups=(0, 0, 1, 1))
    d = build_cache(spec)[0].describe(shard=spec.the_shard, block_size=4)
    assert len(d.tensor_spans) == 4
    assert d.tensor_label(0).startswith("kernel group 0 (engine group 0, layers 0-1: ")
    assert d.tensor_label(3).startswith("kernel group 1 (engine group 1, layers 2-3: ")
    assert d.tensor_label(3).endswith("), its tensor 1")
    for k in (-1, -4, 4):
        with pytest.raises(
            PeerDescriptionError, match=f"^tensor {k} is out of range for 4 described tensors$"
        ):
            d.tensor_label(k)


def test_of_two_plans_predicted_alike_auto_takes_the_one_whose_copy_gathers() -> None:
    """A tile, as NHD -> HND makes them: the runs back to back on each side, in another
    order on each. Staged and peer-staged post one descriptor each and predict alike; a
    WRITE stages here (a gather), a READ lets the peer stage (its gather) rather than
    scatter here after landing. With a scatter priced above a gather (the defaults, and
    what calibrate() measures), the gather is the cheaper by the model too."""
    n, length = 64, 256
    a, b = [np.zeros(n * length, np.uint8)], [np.zeros(n * length, np.uint8)]
    pieces = [(0, ((i % 8) * 8 + i // 8) * length, 0, i * length, length) for i in range(n)]
    buf = np.zeros(n * length, np.uint8)
    there = nx.PeerStaging(buf.ctypes.data, buf.nbytes)
    # descriptors decide (at every size: no table of them by size)
    decide = dataclasses.replace(nx.DEFAULT_COST, per_descriptor_s=1.0, per_descriptor_by_size=())
    alike = nx.CostModel(per_descriptor_s=1.0)  # no scatter figures: a scatter is priced as a gather
    write = Map(runs_between(a, b, pieces), side_of(a, local=True), side_of(b, local=False))
    read = Map(write.runs, side_of(a, local=False), side_of(b, local=True))
    for cost, tie in ((alike, True), (decide, False)):
        w = nx.plan(write, staging=staging_at(buf), peer_staging=there, cost=cost)
        assert (w.predicted_s["staged"] == w.predicted_s["peer-staged"]) is tie and w.strategy == "staged"
        r = nx.plan(read, staging=staging_at(buf), peer_staging=there, cost=cost)
        assert (
            r.predicted_s["staged"] == r.predicted_s["peer-staged"]
        ) is tie and r.strategy == "peer-staged"


def test_a_plans_ordering_work_is_priced_where_the_runs_do_not_follow_its_order() -> None:
    """Maps list their runs in destination order. A staged READ lays its staging out in
    the source's order, so runs in another order there (a tile, as NHD -> HND makes them)
    are sorted before anything posts; its scatter then writes the map's runs out of order,
    known disjoint from the map's own order (not sorted again to check). A peer-staged
    READ lays the peer's staging out in the destination's order, which they follow.
    Priced, the sort picks the peer-staged READ where a scatter priced below the gather
    alone picked staged; a WRITE of the same runs sorts for peer-staged (the source's
    order), for staged not at all."""
    n, length = 64, 256
    a, b = [np.zeros(n * length, np.uint8)], [np.zeros(n * length, np.uint8)]
    tile = [(0, ((i % 8) * 8 + i // 8) * length, 0, i * length, length) for i in range(n)]
    buf = np.zeros(n * length, np.uint8)
    there = nx.PeerStaging(buf.ctypes.data, buf.nbytes)
    # descriptors decide nothing (one each); a scatter priced below a gather
    copies = nx.CostModel(per_descriptor_s=1.0, copy_per_run_s=2e-6, scatter_per_run_s=1e-6)
    ordering = dataclasses.replace(copies, sort_per_run_s=2e-6, unordered_check_per_run_s=3e-6)
    runs = runs_between(a, b, tile)
    read = Map(runs, side_of(a, local=False), side_of(b, local=True))
    write = Map(runs, side_of(a, local=True), side_of(b, local=False))
    before = nx.plan(read, staging=staging_at(buf), peer_staging=there, cost=copies)
    assert before.strategy == "staged" and before.num_descriptors == 1 and before.copy_dst_disjoint
    after = nx.plan(read, staging=staging_at(buf), peer_staging=there, cost=ordering)
    assert after.strategy == "peer-staged" and after.num_descriptors == 1
    assert after.predicted_s["staged"] == pytest.approx(before.predicted_s["staged"] + n * 2e-6)
    assert after.predicted_s["peer-staged"] == before.predicted_s["peer-staged"]
    assert ordering.order_s(n, sorts=1, unordered_check=True) == pytest.approx(n * 5e-6)
    assert ordering.order_s(n) == 0.0
    estimated = nx.estimate(read, poster="dst", cost=ordering)
    assert estimated.choice == "peer-staged"
    for k in ("staged", "peer-staged"):
        assert estimated.predicted_s[k] == pytest.approx(after.predicted_s[k])
    w0 = nx.plan(write, staging=staging_at(buf), peer_staging=there, cost=copies)
    w = nx.plan(write, staging=staging_at(buf), peer_staging=there, cost=ordering)
    assert w.predicted_s["staged"] == w0.predicted_s["staged"]
    assert w.predicted_s["peer-staged"] == pytest.approx(w0.predicted_s["peer-staged"] + n * 2e-6)
    # runs listed out of destination order: the scatter's destinations are sorted to check
    shuffled = Map(runs[::-1].copy(), read.src, read.dst)
    s0 = nx.plan(shuffled, staging=staging_at(buf), strategy="staged", cost=copies)
    s1 = nx.plan(shuffled, staging=staging_at(buf), strategy="staged", cost=ordering)
    assert not s1.copy_dst_disjoint
    assert s1.predicted_s["staged"] == pytest.approx(s0.predicted_s["staged"] + n * 5e-6)
    # runs that follow both sides' order: no ordering work, either way
    straight = runs_between(a, b, [(0, i * length, 0, i * length, length) for i in range(n)])
    for m in (Map(straight, read.src, read.dst), Map(straight, write.src, write.dst)):
        p0 = nx.plan(m, staging=staging_at(buf), peer_staging=there, cost=copies)
        p = nx.plan(m, staging=staging_at(buf), peer_staging=there, cost=ordering)
        assert p.predicted_s == p0.predicted_s


def test_a_staged_read_s_scatter_out_of_order_is_still_checked_for_overlap() -> None:
    """Only runs disjoint in their own order skip the scatter's sort: runs listed out of
    order whose destinations overlap are refused before a byte moves."""
    n, length = 8, 256
    a, b = [np.zeros(n * length, np.uint8)], [np.zeros(n * length, np.uint8)]
    # destinations descending, the last two overlapping by half a run
    rows = [(0, i * length, 0, (n - 1 - i) * length, length) for i in range(n - 1)]
    rows.append((0, (n - 1) * length, 0, length // 2, length))
    m = Map(runs_between(a, b, rows), side_of(a, local=False), side_of(b, local=True))
    buf = np.zeros(2 * n * length, np.uint8)
    p = nx.plan(m, staging=staging_at(buf), strategy="staged")
    assert not p.copy_dst_disjoint
    with pytest.raises(
        nx.RefusedDescriptorError, match="writes bytes another copy writes; nothing was copied"
    ):
        p.check_copy()
    assert not b[0].any()
    # a stage's copy run on its own (transfer's pipeline) checks the whole plan's first
    fresh = nx.plan(m, staging=staging_at(buf), strategy="staged")
    with pytest.raises(
        nx.RefusedDescriptorError, match="writes bytes another copy writes; nothing was copied"
    ):
        fresh.copy_stage(0)
    assert not b[0].any()


def test_a_descriptor_is_priced_at_its_size_where_the_model_measured_sizes() -> None:
    """Over UCX's TCP a WRITE's descriptor cost 4-6 us up to 32 KiB and nothing from 64
    KiB: priced at one figure, a map of 72 KiB runs went staged (a copy to save
    descriptors that cost nothing) at 20 ms against direct's 16 ms."""
    table = ((1 << 10, 4e-6), (32 << 10, 5e-6), (128 << 10, 0.0))
    model = nx.CostModel(per_descriptor_s=4e-6, per_descriptor_by_size=table)
    assert model.descriptor_s(256) == model.descriptor_s(1 << 10) == 4e-6  # below: the first
    assert model.descriptor_s(64 << 10) == pytest.approx(2.5e-6)  # halfway in log size
    assert model.descriptor_s(1 << 20) == 0.0  # above: the last
    assert nx.CostModel(per_descriptor_s=4e-6).descriptor_s(1 << 20) == 4e-6  # no table: one figure
    assert model.direct_s(976, 976 * (72 << 10)) == pytest.approx(
        model.per_transfer_s + 976 * model.descriptor_s(72 << 10) + 976 * (72 << 10) / model.bandwidth
    )
    assert model.direct_s(0, 0) == model.per_transfer_s
    # 64 runs of 128 KiB, scattered here, one stretch there: descriptors that cost nothing
    # are not worth a copy; at 20 us each they are
    m, buf = scattered_map(64, 128 << 10)
    one_figure = nx.CostModel(
        per_descriptor_s=20e-6, bandwidth=1e9, per_transfer_s=1e-3, copy_per_run_s=1e-9, copy_bandwidth=30e9
    )
    by_size = dataclasses.replace(one_figure, per_descriptor_by_size=((1 << 10, 20e-6), (128 << 10, 0.0)))
    assert nx.plan(m, staging=staging_at(buf), cost=by_size).strategy == "direct"
    assert nx.plan(m, staging=staging_at(buf), cost=one_figure).strategy == "staged"


class _FakeStaging:
    """What plan() and the peer's copies read from a Staging (no NIXL in this file)."""

    def __init__(self, buf: np.ndarray, device: torch.device) -> None:
        self.address = buf.ctypes.data
        self.nbytes = buf.nbytes
        self.device = device
        self.agent = None  # no agent: what a dropped copy leaves to its next call stays queued
        self.busy = self.closed = self.kept = False

    def _take(self) -> bool:
        taken, self.busy = not self.busy, True
        return taken

    def _let_go(self) -> None:
        self.busy = False

    def _locks(self) -> list[object]:  # none: no thread shares it
        return []

    def _refuse_moved(self, nothing: str) -> None:
        """A numpy buffer the test holds does not move (a Staging's torch tensor may)."""

    _take_or_refuse = nx.Staging._take_or_refuse


def staging_at(buf: np.ndarray, device: str = "cpu") -> nx.Staging:
    return cast(nx.Staging, _FakeStaging(buf, torch.device(device)))


def brute_force_stretches(remote: np.ndarray, lengths: np.ndarray, buffers: list[np.ndarray]) -> int:
    """Maximal sets of runs that follow one another on the remote side, within one buffer."""
    ends = {int(a) + int(n) for a, n in zip(remote, lengths, strict=True)}
    firsts = {b.ctypes.data for b in buffers}
    return sum(1 for a in remote.tolist() if a not in ends or a in firsts)


def test_descriptors_write_when_local_is_the_source_read_when_it_is_the_destination() -> None:
    local, remote = [np.zeros(256, np.uint8)], [np.zeros(256, np.uint8)]
    pieces = [(0, 0, 0, 128, 16), (0, 64, 0, 0, 32)]
    lo, ro = local[0].ctypes.data, remote[0].ctypes.data
    rside = Side(side_of(remote, local=False).tensor_spans, False, "cuda", 3)
    m = Map(runs_between(local, remote, pieces), side_of(local, local=True), rside)
    d = nx.descriptors(m)
    assert d.op == "WRITE" and (d.local_mem, d.remote_mem) == ("DRAM", "VRAM")
    assert d.local.tolist() == [[lo, 16, 0], [lo + 64, 32, 0]]
    assert d.remote.tolist() == [[ro + 128, 16, 3], [ro, 32, 3]]
    back = Map(runs_between(remote, local, [(0, 128, 0, 0, 16)]), rside, side_of(local, local=True))
    d = nx.descriptors(back)
    assert d.op == "READ" and d.local.tolist() == [[lo, 16, 0]] and d.remote.tolist() == [[ro + 128, 16, 3]]


def test_bad_maps_are_refused_with_the_reason() -> None:
    buf = [np.zeros(64, np.uint8)]
    runs = runs_between(buf, buf, [(0, 0, 0, 32, 8)])
    here, there = side_of(buf, local=True), side_of(buf, local=False)
    with pytest.raises(TransferError, match=r"both sides of the map are in this process.*copy\(\)"):
        nx.descriptors(Map(runs, here, here))
    with pytest.raises(TransferError, match="both sides of the map are in peers"):
        nx.descriptors(Map(runs, there, there))
    with pytest.raises(TypeError, match=r"\(N, 3\) uint64 array .* not a int64 array of shape \(1, 3\)"):
        nx.descriptors(Map(runs.astype(np.int64), here, there))
    zero = runs.copy()
    zero[0, 2] = 0
    with pytest.raises(TransferError, match="run 0 of the map has length 0"):
        nx.descriptors(Map(zero, here, there))
    wrap = runs.copy()
    wrap[0, 1] = 2**64 - 4
    with pytest.raises(
        TransferError, match="run 0 of the map runs past the end of the destination address space"
    ):
        nx.descriptors(Map(wrap, here, there))
    xpu = Side(there.tensor_spans, False, "xpu", 0)
    with pytest.raises(
        TransferError, match="the remote side is on a 'xpu' device; NIXL moves cpu or cuda memory"
    ):
        nx.descriptors(Map(runs, here, xpu))
    # estimate() reads the same runs (its sides may both be descriptions): checked alike, not
    # an AttributeError, an IndexError, or a length of -1 read as 2**64 - 1 bytes
    with pytest.raises(TypeError, match=r"expected a block map .* not int"):
        nx.estimate(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"\(N, 3\) uint64 array .* not a uint64 array of shape \(3,\)"):
        nx.estimate(Map(runs[0], here, there))
    with pytest.raises(TypeError, match=r"not a int64 array of shape \(1, 3\)"):
        nx.estimate(Map(runs.astype(np.int64), here, there))
    with pytest.raises(TransferError, match="run 0 of the map has length 0"):
        nx.estimate(Map(zero, here, there))
    assert nx.estimate(Map(runs, here, there)).num_bytes == 8


def scattered_map(n: int, length: int) -> tuple[Map, np.ndarray]:
    local, remote = [np.zeros(4 * n * length, np.uint8)], [np.zeros(4 * n * length, np.uint8)]
    pieces = [(0, 2 * i * length, 0, (n - 1 - i) * length, length) for i in range(n)]  # remote-consecutive
    m = Map(runs_between(local, remote, pieces), side_of(local, local=True), side_of(remote, local=False))
    return m, np.zeros(n * length, np.uint8)


# What a device copy, or a staging buffer on a GPU, meets where there is none.
NO_GPU = r"kvlayout\._cuda sees no CUDA device|kvlayout was built without its CUDA extension"


def on_gpu(side: Side, index: int) -> Side:
    """The same memory standing for a cache on cuda:``index`` (plans only read addresses)."""
    return dataclasses.replace(side, device_type="cuda", device_index=index)


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_a_cache_on_a_gpu_stages_in_vram_on_that_gpu(op: str) -> None:
    """A staged plan for a cache on cuda:1 copies on cuda:1 (the run executor), into or
    out of a staging buffer there: its descriptors are VRAM of device 1 on both sides of
    the copy. A staging buffer elsewhere (host memory, another GPU) is refused naming
    both devices, whether staged is forced or only a candidate; so is a GPU buffer for a
    host cache."""
    # 512 runs that are one stretch on the remote side: staged by a clear margin (64 runs are a
    # tie over a real pair, within 6 % either way)
    m, buf = scattered_map(512, 256)
    if op == "READ":
        m = Map(m.runs[:, [1, 0, 2]], m.dst, m.src)
    gpu = Map(m.runs, on_gpu(m.src, 1), m.dst) if op == "WRITE" else Map(m.runs, m.src, on_gpu(m.dst, 1))
    p = nx.plan(gpu, strategy="staged", staging=staging_at(buf, "cuda:1"))
    assert (p.op, p.strategy, p.num_descriptors) == (op, "staged", 1)
    assert (p.copy_device, p.local_mem, p.remote_mem) == (torch.device("cuda", 1), "VRAM", "DRAM")
    assert p.local.tolist() == [[buf.ctypes.data, buf.nbytes, 1]]
    assert nx.plan(gpu, staging=staging_at(buf, "cuda:1")).strategy == "staged"  # auto, as on the host
    for where in ("cpu", "cuda:0"):
        for strategy in ("auto", "staged"):
            with pytest.raises(
                TransferError,
                match=re.escape(
                    f"the staged strategy copies within one device: the local side is on cuda:1 and the "
                    f"staging buffer on {where}; give it a Staging(agent, nbytes, device='cuda:1')"
                ),
            ):
                nx.plan(gpu, strategy=strategy, staging=staging_at(buf, where))
    with pytest.raises(TransferError, match="the local side is on cpu and the staging buffer on cuda:0"):
        nx.plan(m, staging=staging_at(buf, "cuda:0"))
    with pytest.raises(TransferError, match="the local side is on cuda:1 and the staging buffer on cpu"):
        here, there = (m.src, m.dst) if op == "WRITE" else (m.dst, m.src)
        nx.prep_lists(cast(nx.Agent, None), "peer", on_gpu(here, 1), there, 256, staging=staging_at(buf))
    assert nx.plan(gpu, strategy="direct", staging=staging_at(buf, "cpu")).strategy == "direct"  # unused


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU refuses the device copy")
def test_a_gpu_copy_where_there_is_no_gpu_is_refused_and_copies_nothing() -> None:
    m, buf = scattered_map(64, 256)
    gpu = dataclasses.replace(m, src=on_gpu(m.src, 0))
    p = nx.plan(gpu, strategy="staged", staging=staging_at(buf, "cuda:0"))
    sentinel = np.arange(buf.nbytes, dtype=np.uint64).astype(np.uint8)
    buf[:] = sentinel
    with pytest.raises(KVLayoutError, match=NO_GPU):
        p.copy()
    with pytest.raises(KVLayoutError, match=NO_GPU):
        p.copy_stage(0)
    assert np.array_equal(buf, sentinel)


def test_a_staging_buffer_goes_in_host_memory_or_on_a_gpu_the_extension_reaches() -> None:
    with pytest.raises(
        TransferError, match="a staging buffer goes in host memory \\(cpu\\) or on a CUDA device, not on meta"
    ):
        nx.Staging(cast(nx.Agent, None), 1 << 10, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(KVLayoutError, match=NO_GPU):
            nx.Staging(cast(nx.Agent, None), 1 << 10, device="cuda")


def test_a_staging_buffer_no_gpu_can_hold_names_the_device_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_device(device: torch.device) -> None:
        raise KVLayoutError("kvlayout._cuda sees no CUDA device")

    monkeypatch.setattr("kvlayout.transfer.cuda._cuda_module", no_device)  # as on a CPU-only machine
    with pytest.raises(KVLayoutError) as caught:
        nx.Staging(cast(nx.Agent, None), 1 << 10, device="cuda:0")
    assert str(caught.value) == (
        "Staging(device='cuda:0'): no staging buffer on cuda:0 here (kvlayout._cuda sees no CUDA device); "
        "pass device='cpu' for a cache in host memory"
    )


def test_a_peer_staging_buffer_on_a_gpu_is_posted_as_vram_of_its_device() -> None:
    n, length = 64, 256  # consecutive here, scattered on the peer (as TP 2 -> 1 in NHD)
    local, remote = [np.zeros(n * length, np.uint8)], [np.zeros(2 * n * length, np.uint8)]
    pieces = [(0, i * length, 0, 2 * i * length, length) for i in range(n)]
    m = Map(runs_between(local, remote, pieces), side_of(local, local=True), side_of(remote, local=False))
    there = nx.PeerStaging(0x7F0000000000, n * length, "cuda", 3)
    p = nx.plan(m, strategy="peer-staged", peer_staging=there)
    assert (p.local_mem, p.remote_mem) == ("DRAM", "VRAM")
    assert p.remote.tolist() == [[there.address, n * length, 3]]
    address, nbytes, index = np.uint64(there.address), np.uint64(there.nbytes), np.int64(3)
    as_numpy = nx.PeerStaging(address, nbytes, "cuda", index)  # type: ignore[arg-type]  # from a handshake
    assert np.array_equal(nx.plan(m, strategy="peer-staged", peer_staging=as_numpy).remote, p.remote)
    for bad, why in (
        (
            there._replace(device_type="xpu"),
            "PeerStaging.device_type must be 'cpu' or 'cuda' (NIXL's DRAM or VRAM), got 'xpu'",
        ),
        (there._replace(device_index=-1), "PeerStaging.device_index must be an int in [0, 2**64), got -1"),
        (there._replace(nbytes=True), "PeerStaging.nbytes must be an int in [0, 2**64), got True"),
        (  # its end past 2**64 used to wrap into plan rows at low addresses
            there._replace(address=np.uint64(2**64 - 100), nbytes=1 << 30),  # type: ignore[arg-type]
            "PeerStaging(0xffffffffffffff9c, 1073741824 bytes) is not memory a process can own: it must lie in "
            "[0x1000, 2**57), past the null page, as a peer's described tensors do",
        ),
        (
            there._replace(address=0),
            "PeerStaging(0x0, 16384 bytes) is not memory a process can own: it must lie in [0x1000, 2**57)",
        ),
    ):
        with pytest.raises(TransferError, match=re.escape(why)):
            nx.plan(m, strategy="peer-staged", peer_staging=bad)
    with pytest.raises(
        TypeError, match=r"peer_staging must be an nx.PeerStaging\(address, nbytes, ...\), not \("
    ):
        nx.plan(m, strategy="peer-staged", peer_staging=(there.address, there.nbytes))  # type: ignore[arg-type]


def test_the_cost_model_picks_staged_for_many_small_runs_and_direct_for_few_long_ones() -> None:
    many, buf = scattered_map(512, 256)  # 512 runs of 256 B, one stretch on the remote side
    p = nx.plan(many, staging=staging_at(buf))
    assert p.strategy == "staged" and p.num_descriptors == 1
    assert p.predicted_s["staged"] < p.predicted_s["direct"]
    few, buf = scattered_map(2, 1 << 16)  # 2 long runs: the gather costs more than a descriptor
    p = nx.plan(few, staging=staging_at(buf))
    assert p.strategy == "direct" and p.num_descriptors == 2
    # forced, either way; and auto without a staging buffer is direct
    assert nx.plan(few, strategy="staged", staging=staging_at(buf)).strategy == "staged"
    assert nx.plan(many, strategy="direct", staging=staging_at(buf)).strategy == "direct"
    assert nx.plan(many).strategy == "direct"
    slow_copy = nx.CostModel(copy_per_run_s=1.0)
    assert nx.plan(many, staging=staging_at(buf), cost=slow_copy).strategy == "direct"


def test_a_staged_plans_own_work_is_priced_once_a_request() -> None:
    """Two runs of 64 KiB, one stretch there: a 128 KiB gather at 10 GB/s (13 us) costs
    less than the descriptor it saves (18 us), but a staged plan's own work on the
    request's path (150-160 us to a direct plan's 45 us) does not: over a real NIXL pair,
    60 rounds each way taking turns, direct took 1.16 ms (medians) against staged's
    1.38 ms (WRITE) and 1.44 ms (READ)."""
    few, buf = scattered_map(2, 1 << 16)
    copies = nx.CostModel(per_descriptor_s=18e-6, copy_per_run_s=0.04e-6, copy_bandwidth=10e9)
    before = nx.plan(few, staging=staging_at(buf), cost=copies)
    assert before.strategy == "staged"
    own = dataclasses.replace(copies, staged_plan_s=120e-6)
    after = nx.plan(few, staging=staging_at(buf), cost=own)
    assert after.strategy == "direct"
    assert after.predicted_s["staged"] == pytest.approx(before.predicted_s["staged"] + 120e-6)
    assert after.predicted_s["direct"] == before.predicted_s["direct"]
    many, many_buf = scattered_map(512, 256)  # 511 descriptors saved: still worth it
    assert nx.plan(many, staging=staging_at(many_buf), cost=own).strategy == "staged"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"bandwidth": 0}, "CostModel.bandwidth must be a positive number of bytes a second, got 0"),
        ({"copy_bandwidth": float("nan")}, "CostModel.copy_bandwidth must be a positive number of bytes a second"),
        ({"per_descriptor_s": -1e-6}, "CostModel.per_descriptor_s must be a non-negative number of seconds"),
        ({"per_transfer_s": True}, "CostModel.per_transfer_s must be a non-negative number of seconds, got True"),
        ({"per_descriptor_by_size": ((0, 1e-6),)},
         "CostModel.per_descriptor_by_size[0]: the sizes must be ints, positive and ascending; got 0"),
        ({"per_descriptor_by_size": ((8192, 1e-6), (4096, 1e-6))},
         "CostModel.per_descriptor_by_size[1]: the sizes must be ints, positive and ascending; got 4096 after 8192"),
        ({"per_descriptor_by_size": ((8192, float("inf")),)},
         "CostModel.per_descriptor_by_size[0]'s seconds must be a non-negative number of seconds, got inf"),
        ({"per_descriptor_by_size": "8192"}, "CostModel.per_descriptor_by_size must be (bytes, seconds) pairs"),
        ({"per_descriptor_by_size": ((8192,),)},
         "CostModel.per_descriptor_by_size[0] must be a (bytes, seconds) pair, not (8192,)"),
        ({"scatter_bandwidth": 0}, "CostModel.scatter_bandwidth must be a positive number of bytes a second, got 0"),
        ({"scatter_per_run_s": -1.0}, "CostModel.scatter_per_run_s must be a non-negative number of seconds"),
        ({"transposed_factor": 0.0},
         "CostModel.transposed_factor must be a positive number (a time's ratio) or None, got 0.0"),
        ({"transposed_scatter_factor": float("nan")},
         "CostModel.transposed_scatter_factor must be a positive number (a time's ratio) or None, got nan"),
        ({"transposed_factor": True}, "CostModel.transposed_factor must be a positive number"),
        ({"read_copy_factor": 0}, "CostModel.read_copy_factor must be a positive number (a time's ratio) or None"),
        ({"sort_per_run_s": -1e-9}, "CostModel.sort_per_run_s must be a non-negative number of seconds"),
        ({"staged_plan_s": float("inf")}, "CostModel.staged_plan_s must be a non-negative number of seconds"),
        ({"unordered_check_per_run_s": None},
         "CostModel.unordered_check_per_run_s must be a non-negative number of seconds, got None"),
    ],
)  # fmt: skip
def test_a_cost_model_refuses_figures_it_cannot_price_with(kw: dict[str, Any], message: str) -> None:
    """A zero bandwidth or size used to raise ZeroDivisionError when a plan was priced, a
    NaN to predict NaN seconds for every strategy (and pick one at random)."""
    with pytest.raises(TypeError) as err:
        nx.CostModel(**kw)
    assert str(err.value).startswith(message)


def test_a_plan_s_copies_take_checked_arguments() -> None:
    """These used to raise AttributeError or AssertionError from inside, run a copy on 0
    threads, or take stage -1 as the last one."""
    many, buf = scattered_map(512, 256)
    with pytest.raises(TypeError, match=r"staging must be an nx.Staging\(agent, nbytes\), not 5"):
        nx.plan(many, staging=5)  # type: ignore[arg-type]
    p = nx.plan(many, strategy="staged", staging=staging_at(buf))
    n = len(p.stages)
    for bad in (-1, n, np.int64(n)):
        with pytest.raises(TransferError) as err:
            p.copy_stage(bad)  # type: ignore[arg-type]
        assert str(err.value) == f"stage must be an int in [0, {n}), the plan's stages; got {bad!r}"
    for wrong in (True, "0"):
        with pytest.raises(TypeError, match="stage must be an int, not"):
            p.copy_stage(wrong)  # type: ignore[arg-type]
    p.copy_stage(np.int64(0))  # type: ignore[arg-type]  # a NumPy integer, as every int argument takes
    for threads in (0, -5):
        with pytest.raises(TransferError, match=f"num_threads must be a positive int, got {threads}"):
            p.copy(num_threads=threads)
    direct = nx.plan(many, strategy="direct")
    with pytest.raises(TransferError, match="a direct plan has no local copy to run a stage of"):
        direct.copy_stage(0)


def test_a_model_given_its_copy_s_figures_alone_prices_a_scatter_by_them() -> None:
    """A model made for another host (a GPU's copy engine) with its gather's figures used
    to price a scatter at this project's 2-core CPU figures (then 0.2 us a run at 4 GB/s:
    a staged READ of 1,000 runs of 1 KiB at 462 us where the caller's figures say 2 us)."""
    gpu = nx.CostModel(copy_per_run_s=1e-9, copy_bandwidth=1e12)
    assert (
        gpu.copy_s(1000, 1 << 20, scatters=True)
        == gpu.copy_s(1000, 1 << 20)
        == pytest.approx(1e-6 + (1 << 20) / 1e12)
    )
    own = dataclasses.replace(gpu, scatter_bandwidth=5e11)  # a figure given is the one used
    assert own.copy_s(1000, 1 << 20, scatters=True) == pytest.approx(1e-6 + (1 << 20) / 5e11)
    default = nx.DEFAULT_COST  # this project's figures, the scatter's measured apart
    assert default.scatter_per_run_s is not None and default.scatter_bandwidth is not None
    assert default.scatter_per_run_s != default.copy_per_run_s
    assert default.copy_s(1000, 1 << 20, scatters=True) == pytest.approx(
        1000 * default.scatter_per_run_s + (1 << 20) / default.scatter_bandwidth
    )
    assert default.copy_s(1000, 1 << 20, scatters=True) != pytest.approx(default.copy_s(1000, 1 << 20))


def test_a_cost_model_s_size_table_may_come_back_from_json() -> None:
    """Lists of pairs (a model written to JSON and read back) and NumPy sizes are the same
    table, held as a tuple of (int, float) pairs (the model stays hashable)."""
    model = nx.CostModel(per_descriptor_by_size=[[1024, 3e-6], [np.int64(65536), 0]])  # type: ignore[arg-type]
    assert model.per_descriptor_by_size == ((1024, 3e-6), (65536, 0.0)) and hash(model)
    assert type(model.per_descriptor_by_size[1][0]) is int


def test_a_plan_prints_as_a_summary_not_its_arrays() -> None:
    """A plan's descriptor and copy arrays run to millions of rows: its repr says what a
    reader looks for (strategy, op, descriptors, runs, predictions) in one line."""
    many, buf = scattered_map(512, 256)
    p = nx.plan(many, staging=staging_at(buf))
    text = repr(p)
    assert text.startswith(
        "Plan(staged WRITE: 1 descriptors (local DRAM, remote DRAM) for 512 runs, 131072 bytes"
    )
    assert "512 copies on cpu" in text and "predicted direct " in text and " staged " in text
    assert "\n" not in text and len(text) < 200


def test_staged_needs_a_staging_buffer_that_fits() -> None:
    m, buf = scattered_map(4, 64)
    with pytest.raises(
        TransferError, match="the staged strategy needs a staging buffer of 256 bytes; got no staging"
    ):
        nx.plan(m, strategy="staged")
    with pytest.raises(
        TransferError, match="needs a staging buffer of 256 bytes; got a staging buffer of 255 bytes"
    ):
        nx.plan(m, strategy="staged", staging=staging_at(buf[:255]))
    with pytest.raises(
        TransferError, match="strategy must be 'auto', 'direct', 'staged' or 'peer-staged', not 'fast'"
    ):
        nx.plan(m, strategy="fast")  # type: ignore[arg-type]


def test_a_stretch_never_crosses_from_one_described_tensor_into_the_next() -> None:
    """Two remote tensors that touch in memory: runs at the end of one and the start of
    the other go as two descriptors (each descriptor must lie in one registration)."""
    pool = np.zeros(256, np.uint8)
    a, b = pool[:128], pool[128:]
    local = [np.zeros(256, np.uint8)]
    rside = side_of([a, b], local=False)
    runs = runs_between(local, [a, b], [(0, 0, 0, 64, 64), (0, 128, 1, 0, 64)])
    p = nx.plan(Map(runs, side_of(local, local=True), rside), strategy="staged", staging=staging_at(local[0]))
    assert p.num_descriptors == 2
    joined = Side(np.array([[pool.ctypes.data, 256]], dtype=U64), False)
    p = nx.plan(
        Map(runs, side_of(local, local=True), joined), strategy="staged", staging=staging_at(local[0])
    )
    assert p.num_descriptors == 1


@given(maps())
def test_prepped_indices_cover_the_same_bytes(case: Case) -> None:
    """The prepped form's index arrays, expanded back into units, are the runs' bytes."""
    local, remote, pieces, _ = case
    pieces = [(a, i - i % 8, b, j - j % 8, max(8, n - n % 8)) for a, i, b, j, n in pieces]  # 8-byte units
    runs = runs_between(local, remote, pieces)
    lspans, rspans = side_of(local, local=True).tensor_spans, side_of(remote, local=False).tensor_spans
    ll = nx.PreppedList(None, 8, *unit_rows(lspans, 8), "DRAM")
    rl = nx.PreppedList(None, 8, *unit_rows(rspans, 8), "DRAM")
    li = ll.indices(direct._rows(runs[:, 0], runs[:, 2], 0), "local")
    ri = rl.indices(direct._rows(runs[:, 1], runs[:, 2], 0), "remote")
    assert li.dtype == np.int32 and len(li) == len(ri) == int(runs[:, 2].sum()) // 8
    want = [(s + k, d + k) for s, d, n in runs.tolist() for k in range(0, n, 8)]
    assert list(zip(unit_addresses(ll, li), unit_addresses(rl, ri), strict=True)) == want


def unit_rows(spans: np.ndarray, unit: int) -> tuple[np.ndarray, np.ndarray]:
    starts, ends = regions._intervals(spans)
    return starts, ((ends - starts) // U64(unit)).astype(np.int64)


def unit_addresses(pl: nx.PreppedList, idx: np.ndarray) -> list[int]:
    """Where each index of a prepped list points, the way NIXL reads its Nx5 rows."""
    row = np.searchsorted(pl.first, idx, side="right") - 1
    return [int(pl.starts[r]) + (int(i) - int(pl.first[r])) * pl.unit for r, i in zip(row, idx, strict=True)]


def test_prepped_indices_refuse_runs_off_the_unit_grid() -> None:
    buf = [np.zeros(256, np.uint8)]
    pl = nx.PreppedList(None, 64, *unit_rows(side_of(buf, local=True).tensor_spans, 64), "DRAM")
    base = buf[0].ctypes.data
    assert pl.indices(np.array([[base + 64, 128, 0]], U64), "run").tolist() == [1, 2]
    for addr, n in ((base + 32, 64), (base, 96)):
        with pytest.raises(
            nx.RefusedDescriptorError, match=r"run 0 \(0x[0-9a-f]+, \d+ bytes\) is not whole 64-byte units"
        ):
            pl.indices(np.array([[addr, n, 0]], U64), "run")
    for addr, n in ((base + 192, 128), (base - 64, 64)):
        with pytest.raises(nx.RefusedDescriptorError, match=r"is outside the 1 stretches of memory prepared"):
            pl.indices(np.array([[addr, n, 0]], U64), "run")


@given(
    st.lists(st.integers(0, 2**16), min_size=0, max_size=300),
    st.sampled_from([1, 64, 4096, 2**40, 2**47]),
    st.integers(0, 2**20),
    st.booleans(),
    st.booleans(),
)
def test_address_order_is_a_stable_sort_of_the_sides_addresses(
    offsets: list[int], align: int, base: int, on_dst: bool, far: bool
) -> None:
    """The staged layout's order of the runs (a radix sort of packed words): numpy's
    stable argsort of the side's column, repeated addresses in run order, aligned or not,
    and past the packing's reach (an address 2^63 bytes from the rest: the comparison
    sort) alike."""
    addr = np.array([base + o * align for o in offsets] + [base + 2**63 + 1] * far, dtype=U64)
    runs = np.zeros((len(addr), 3), dtype=U64)
    runs[:, int(on_dst)] = addr
    runs[:, 1 - int(on_dst)] = np.arange(len(addr), dtype=U64) * np.uint64(8)
    runs[:, 2] = 8
    want = np.argsort(addr, kind="stable")
    assert np.array_equal(_native.address_order(runs, int(on_dst)), want)


@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(1, 3)), min_size=0, max_size=60),
    st.integers(1, 30),
    st.booleans(),
)
def test_a_stretch_count_is_the_stretches_laid_out(
    pieces: list[tuple[int, int]], cut: int, on_dst: bool
) -> None:
    """What prices a staged layout, counted without laying it out: as many stretches as
    ``_stretches`` lays out, with runs back to back, repeated, overlapping, and stretches
    that would cross from one tensor into the next (cut into their runs)."""
    unit, base = 8, 1 << 20
    spans = np.array([[base, cut * unit], [base + cut * unit, (50 - cut) * unit]], dtype=U64)
    runs = np.zeros((len(pieces), 3), dtype=U64)
    runs[:, int(on_dst)] = [base + o * unit for o, _ in pieces]
    runs[:, 1 - int(on_dst)] = np.arange(len(pieces), dtype=U64) * np.uint64(64)
    runs[:, 2] = [n * unit for _, n in pieces]
    side = Side(spans, is_local=True)
    assert plans._stretch_count(None, runs, int(on_dst), side) == len(
        plans._stretches(runs, int(on_dst), side).first
    )


def test_overlapping_spans_merge_touching_ones_do_not() -> None:
    starts, ends = regions._intervals(np.array([[100, 50], [0, 10], [120, 100], [10, 5], [300, 0]], U64))
    assert list(zip(starts.tolist(), ends.tolist(), strict=True)) == [(0, 10), (10, 15), (100, 220)]


def test_importing_kvlayout_and_planning_never_loads_nixl() -> None:
    """NIXL is optional: kvlayout, kvlayout.transfer and this module's planning import
    and run without loading it (a session without the extra never pays for it)."""
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        import kvlayout, kvlayout.transfer
        from kvlayout.transfer import nixl as nx
        kvlayout.detect  # the lazy exports resolve
        side = nx.local_side(__import__("torch").zeros(64, dtype=__import__("torch").uint8))
        loaded = sorted(m for m in sys.modules if m.split(".")[0].startswith("nixl"))
        print(loaded)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout
    assert re.fullmatch(r"\[\]\n?", done.stdout)


def test_the_local_copy_is_refused_outside_its_memory_before_a_byte_moves() -> None:
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    a, b = side_of([src], local=True).tensor_spans, side_of([dst], local=True).tensor_spans
    runs = np.array(
        [[src.ctypes.data, dst.ctypes.data, 16], [src.ctypes.data + 56, dst.ctypes.data + 16, 16]], U64
    )
    with pytest.raises(nx.RefusedDescriptorError, match=r"local copy 1 .* reads bytes outside the memory"):
        nx.copy_byte_runs(runs, a, b)
    assert not dst.any()
    runs[1, 0] -= 8
    nx.copy_byte_runs(runs, a, b, num_threads=2)
    assert np.array_equal(dst[:32], np.r_[src[:16], src[48:64]]) and not dst[32:].any()


@pytest.mark.parametrize(
    ("runs", "threads", "message"),
    [
        (
            "pairs",
            1,
            r"^runs must be an \(N, 3\) integer array of \(from, to, length\), got shape \(1, 2\) of uint64$",
        ),
        ("floats", 1, r"^runs must be an \(N, 3\) integer array .*, got shape \(1, 3\) of float64$"),
        ("negative", 1, r"^runs\[0\] = \(\d+, \d+, -16\) holds a negative value$"),
        ("good", 0, r"^num_threads must be a positive int, got 0$"),
        ("good", 1.5, r"^num_threads must be an int, got 1.5$"),
        ("good", 1 << 40, None),  # capped at the worker pool, as block maps do
    ],
)
def test_copy_byte_runs_names_wrong_runs_and_thread_counts(
    runs: str, threads: Any, message: str | None
) -> None:
    """The runs and num_threads went to the native call as given: a wrong shape, a float or
    a thread count past 2**32 raised nanobind's "copy_runs(): incompatible function
    arguments" listing its signature, and 0 or -1 threads were taken."""
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    a, b = side_of([src], local=True).tensor_spans, side_of([dst], local=True).tensor_spans
    row = [src.ctypes.data, dst.ctypes.data, 16]
    given: Any = {
        "good": np.array([row], U64),
        "pairs": np.array([row[:2]], U64),
        "floats": np.array([row], np.float64),
        "negative": np.array([[*row[:2], -16]], np.int64),
    }[runs]
    if message is None:
        nx.copy_byte_runs(given, a, b, num_threads=threads)
        assert np.array_equal(dst[:16], src[:16])
        return
    with pytest.raises(TransferError, match=message):
        nx.copy_byte_runs(given, a, b, num_threads=threads)
    assert not dst.any()


@pytest.mark.parametrize(
    ("spans", "error", "message"),
    [
        (
            [[0, 2**63]],
            nx.RefusedDescriptorError,
            r"from_spans\[0\] = \(0x0, 9223372036854775808 bytes\) is no memory",
        ),
        (
            [[8, 64]],
            nx.RefusedDescriptorError,
            r"from_spans\[0\] = \(0x8, 64 bytes\) is no memory a process owns",
        ),
        (
            [[2**57 - 8, 16]],
            nx.RefusedDescriptorError,
            r"must start past the null page and end by 0x200000000000000",
        ),
        ([[4096, 8, 0]], TransferError, r"from_spans must be an \(K, 2\) integer array .* shape \(1, 3\)"),
    ],
)
def test_spans_no_process_can_own_are_refused(
    spans: list[list[int]], error: type[Exception], message: str
) -> None:
    """The spans are the caller's word for what the copies may touch; a span in the null
    page or past any address read address 8 (a segfault) instead of being refused."""
    dst = np.zeros(64, dtype=np.uint8)
    runs = np.array([[8, dst.ctypes.data, 16]], U64)
    with pytest.raises(error, match=message):
        nx.copy_byte_runs(runs, np.array(spans, dtype=np.uint64), side_of([dst], local=True).tensor_spans)
    assert not dst.any()


def test_a_block_map_to_a_peer_description_is_a_nixl_map() -> None:
    """A real BlockMap between a live registration and a peer's description is what the
    NIXL layer reads: WRITE when the live side is the source, READ when it is the
    destination, the map's runs as the descriptors, the sides' devices and spans."""
    import torch

    from kvlayout import EngineKVFormat as F
    from kvlayout.registration.registration import bind
    from kvlayout.transfer import RegistrationDescription, Shard, block_map

    here = bind([torch.zeros(2, 4, 16, 8, 8, dtype=torch.bfloat16) for _ in range(2)], F.NL_X_TWO_NB_BS_NH_HS)
    peer = bind([torch.zeros(2, 4, 4, 16, 8, dtype=torch.bfloat16) for _ in range(2)], F.NL_X_TWO_NB_NH_BS_HS)
    there = RegistrationDescription.from_json(peer.describe(shard=Shard(1, 2, 8)).to_json())
    m: nx.NixlMap = block_map(here, there, [2, 0], [3, 1], num_tokens=20, src_shard=Shard(0, 1, 8))
    d = nx.descriptors(m)
    assert d.op == "WRITE" and (d.local_mem, d.remote_mem) == ("DRAM", "DRAM")
    assert np.array_equal(d.local[:, :2], m.runs[:, [0, 2]]) and np.array_equal(
        d.remote[:, :2], m.runs[:, 1:]
    )
    leaves = [t for t in peer.kv]
    assert sorted(map(tuple, m.dst.tensor_spans.tolist())) == sorted((t.data_ptr(), t.nbytes) for t in leaves)
    back = block_map(there, here, [3, 1], [2, 0], num_tokens=20, dst_shard=Shard(0, 1, 8))
    assert nx.descriptors(back).op == "READ"
    both_live = block_map(here, peer, [0], [1], dst_shard=Shard(1, 2, 8))
    with pytest.raises(TransferError, match="both sides of the map are in this process"):
        nx.descriptors(both_live)


@pytest.mark.parametrize(
    "pair",
    ["same layout", "TP 1 -> 2 NHD", "TP 2 -> 1 HND", "NHD -> HND", "cross-layer", "layers of one pool"],
)
@pytest.mark.parametrize("ids", ["consecutive", "scattered", "whole pool"])
def test_a_block_map_counts_its_stretches_without_sorting_its_runs(
    pair: str, ids: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pricing a staged or peer-staged candidate counts the stretches of one side's
    memory; for a block map whose side's tensors lie apart they are the runs of the map
    from that side to itself, counted without sorting this map's runs, and as many as the
    sort counts. Where tensors touch (every layer a slice of one pool), the sort counts
    them, a stretch ending at each tensor's end (one descriptor inside one tensor), so the
    whole pool is a stretch a layer there too, not its runs."""
    import random

    import torch

    from kvlayout import EngineKVFormat as F
    from kvlayout.registration.registration import bind
    from kvlayout.transfer import Shard, block_map

    nhd, hnd = F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS

    def cache(fmt: F, heads: int = 4) -> object:
        if fmt == F.NB_NL_TWO_BS_NH_HS:
            return bind(torch.zeros(12, 3, 2, 4, heads, 8, dtype=torch.bfloat16), fmt)
        shape = (2, 12, 4, heads, 8) if fmt == nhd else (2, 12, heads, 4, 8)
        return bind([torch.zeros(shape, dtype=torch.bfloat16) for _ in range(3)], fmt)

    pool = torch.zeros(3, 2, 12, 4, 4, 8, dtype=torch.bfloat16)
    src, dst, shards = {
        "same layout": (cache(nhd), cache(nhd), {}),
        "TP 1 -> 2 NHD": (cache(nhd), cache(nhd, 2), {"dst_shard": Shard(1, 2, 4)}),
        "TP 2 -> 1 HND": (cache(hnd, 2), cache(hnd), {"src_shard": Shard(0, 2, 4)}),
        "NHD -> HND": (cache(nhd), cache(hnd), {}),
        "cross-layer": (cache(F.NB_NL_TWO_BS_NH_HS), cache(hnd), {}),
        "layers of one pool": (bind(list(pool), nhd), cache(nhd), {}),
    }[pair]
    n = 12 if ids == "whole pool" else 5
    order = random.Random(5).sample(range(12), n) if ids == "scattered" else list(range(n))
    m = block_map(src, dst, order, order[::-1], num_tokens=4 * n - 2 * (n < 12), **shards)  # type: ignore[arg-type]
    runs = np.ascontiguousarray(m.runs)
    sorted_counts = [plans._stretch_count(None, runs, col, side) for col, side in ((0, m.src), (1, m.dst))]
    if pair != "layers of one pool":  # no sort: the native count of sorted runs is not reached
        monkeypatch.setattr(_native, "stretch_count", None)
    elif ids == "whole pool":  # three touching layers: a stretch each, cut where one ends
        assert (m._side_runs(0), sorted_counts[0]) == (3, 3) and m.num_runs == 72
    assert [
        plans._stretch_count(m, runs, col, side) for col, side in ((0, m.src), (1, m.dst))
    ] == sorted_counts


def test_a_stretch_ends_where_a_touching_tensor_does_and_its_runs_still_go_as_stretches() -> None:
    """An HND cache into an NHD one (vLLM's LBHNC prefill into an LBNHC decode), every
    layer a view of one allocation, so layer 0's last block touches layer 1's block 0: the
    request's blocks of layer 0 and of layer 1 are consecutive in memory across that
    boundary. A staged READ's stretches of the source are cut at the boundary (a
    descriptor inside one tensor, which NIXL needs), not into the stretch's runs: 2
    layers x 10 blocks, 8 consecutive (0-7), are 2 x 3 stretches, not the 1,200 runs a
    permuting map has (a token and head each). The staging layout is the runs' in address
    order, whatever the cut: each stretch starts where its first run's copy does."""
    import torch

    from kvlayout import EngineKVFormat as F
    from kvlayout.registration.registration import bind
    from kvlayout.transfer import block_map

    pool = torch.zeros(2, 12, 4, 16, 32, dtype=torch.bfloat16)  # [L, B, H, N, C]: layers touch
    nhd = [torch.zeros(12, 64, 4, 32, dtype=torch.bfloat16) for _ in range(2)]
    src = bind(list(pool), F.NL_X_NB_NH_BS_CS)
    dst = bind(nhd, F.NL_X_NB_BS_NH_CS)
    m = block_map(src, dst, [3, 1, 7, 0, 5, 9, 2, 11, 4, 6], [8, 5, 2], num_tokens=160)
    runs = np.ascontiguousarray(m.runs)
    st = plans._stretches(runs, 0, m.src, copies=1)
    layer = pool[0].numel() * 2
    base = pool.data_ptr()
    assert m.num_runs == 2 * 160 * 4 and len(st.first) == plans._stretch_count(m, runs, 0, m.src) == 2 * 3
    assert all(
        (a - base) // layer == (a + n - 1 - base) // layer for a, n in zip(st.addr, st.nbytes, strict=True)
    )
    assert int(st.nbytes.sum()) == m.num_bytes
    order = st.order if len(st.order) else np.arange(len(runs))
    assert (runs[order[st.first], 0] == st.addr).all()
    assert (st.copies[st.first, 1] == st.staged).all()  # the gather's copies land where each stretch starts


def test_calibration_charges_a_copied_run_its_own_cost_not_its_bytes_or_the_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copy that costs 200 us a call, and 5 ns a run and 5 GB/s gathering, 80 ns a run
    and 3 GB/s scattering: the calibration recovers each term of each direction, so a map
    of many short runs is not priced at its runs' bytes twice, nor a scatter as a gather.
    A permuted map's transposed tiles that take half the time of as many runs spaced
    evenly gathered, and 1.25 times it scattered, are priced at those factors."""
    cost: dict[str, float] = {}
    packed: list[int] = []

    def fake_copy(runs: np.ndarray, lo: np.ndarray, hi: np.ndarray, *_: object) -> None:
        scatters = int(lo[0, 1]) < int(hi[0, 1])  # reads the packed span, writes the spaced one
        per_run, bandwidth = (80e-9, 3e9) if scatters else (5e-9, 5e9)
        steps = np.diff(runs[:, 1 if scatters else 0].astype(np.int64))
        tiled = len(steps) > 1 and bool(np.any(steps != steps[0]))  # the spaced side not evenly spaced
        factor = (1.25 if scatters else 0.5) if tiled else 1.0
        cost["s"] = 200e-6 + (len(runs) * per_run + int(runs[:, 2].sum()) / bandwidth) * factor
        packed.append(int((lo if scatters else hi)[0, 0]))

    def fake_timed(fn: Callable[[], None]) -> float:
        fn()
        return cost["s"]

    monkeypatch.setattr(calibration, "_copy", fake_copy)
    monkeypatch.setattr(calibration, "_timed", fake_timed)
    gather, scatter, transposed = calibration._calibrate_copy(1, torch.device("cpu"))
    assert gather == pytest.approx((5e-9, 5e9), rel=1e-6)
    assert scatter == pytest.approx((80e-9, 3e9), rel=1e-6)
    assert transposed == pytest.approx((0.5, 1.25), rel=1e-3)  # the call timed with its one run
    assert len(packed) == 10 and len(set(packed)) == 1  # both ways, through the same packed buffer


def test_calibration_bounds_a_permuted_copy_factor_a_freak_clock_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A clock that reads no time past the call's for a copy pattern (a coarse timer, a
    freak round) gives a ratio of 1e-9 seconds: the factors are bounded to [1e-3, 1e3],
    not priced at a millionth or a million times the plain copy (here the transposed
    gather reads none, the plain scatter none)."""

    def fake_copy(runs: np.ndarray, lo: np.ndarray, hi: np.ndarray, *_: object) -> None:
        scatters = int(lo[0, 1]) < int(hi[0, 1])
        steps = np.diff(runs[:, 1 if scatters else 0].astype(np.int64))
        tiled = len(steps) > 1 and bool(np.any(steps != steps[0]))
        plain_256 = not tiled and len(runs) == calibration._COPY_CALIBRATION_BYTES // calibration._TILE[2]
        took = 1e-3 + len(runs) * 1e-8
        if (tiled and not scatters) or (plain_256 and scatters):
            took = 1e-3  # the call's own time, nothing past it
        cost["s"] = took

    cost: dict[str, float] = {}

    def fake_timed(fn: Callable[[], None]) -> float:
        fn()
        return cost["s"]

    monkeypatch.setattr(calibration, "_copy", fake_copy)
    monkeypatch.setattr(calibration, "_timed", fake_timed)
    _, _, transposed = calibration._calibrate_copy(2, torch.device("cpu"))
    assert transposed == (1e-3, 1e3)
    nx.CostModel(
        transposed_factor=transposed[0], transposed_scatter_factor=transposed[1]
    )  # a model takes them


def test_calibration_times_a_plans_ordering_work_on_a_requests_worth_of_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sort a run and the out-of-order check a run over an in-order one, from the
    rounds' fastest of each, on a permuted map's scatter whose blocks each tensor's 64
    shuffled among themselves (checked for real: they stay in their spans, no two
    overlap), against as many runs whose destinations follow one another; a clock that
    reads the out-of-order check faster gives 0, not a negative price."""
    from kvlayout.transfer.nixl.copies import _check_copies as real_check

    checked: list[np.ndarray] = []

    def check(runs: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        checked.append(runs)
        real_check(runs, lo, hi)

    clock = iter([0.05, 0.09, 0.02, 0.03, 0.06, 0.01])  # rounds of (sort, out of order, in order)
    monkeypatch.setattr(calibration, "_check_copies", check)
    monkeypatch.setattr(calibration, "_timed", lambda fn: (fn(), next(clock))[1])
    sort, unordered_check = calibration._calibrate_order(2)
    n = calibration._ORDER_CALIBRATION_BYTES // calibration._TILE[2]
    assert sort == pytest.approx(0.03 / n) and unordered_check == pytest.approx((0.06 - 0.01) / n)
    shuffled, ordered = checked[0], checked[1]
    assert len(shuffled) == len(ordered) == n
    assert not _native.runs_sorted_on(shuffled, 1) and _native.runs_sorted_on(ordered, 1)
    block = calibration._TILE[0] * calibration._TILE[1] * calibration._TILE[2]
    src = (shuffled[:, 0] - shuffled[:, 0].min()) // block
    dst = (shuffled[:, 1] - shuffled[:, 1].min()) // (2 * block)
    assert np.array_equal(src // 64, dst // 64) and not np.array_equal(src, dst)  # within a tensor's 64
    clock = iter([0.05, 0.01, 0.02])
    assert calibration._calibrate_order(1)[1] == 0.0


def test_calibrations_transposed_copies_are_an_nhd_block_into_hnd_and_back() -> None:
    """The permuted map's copy calibration times: each NHD block's row (token t, head h)
    goes to HND's (head h, token t), each byte of both buffers once; the gather listed in
    the order it writes, the scatter in the order it reads (as a staged plan lists them)."""
    heads, tokens, row = calibration._TILE
    block = heads * tokens * row
    total, packed, apart = 4 * block, 1 << 30, 2 << 30
    for way in ("gather", "scatter"):
        runs = calibration._transposed_copies(way, packed, apart, total).astype(np.int64)
        assert runs.shape == (total // row, 3) and np.all(runs[:, 2] == row)
        if way == "gather":  # NHD read from the spaced buffer, HND written back to back
            hnd, nhd = runs[:, 1] - packed, runs[:, 0] - apart
            k, at_nhd, at_hnd = nhd // (2 * block), nhd % (2 * block), hnd % block
            assert np.array_equal(hnd // block, k) and np.all(np.diff(runs[:, 1]) == row)
        else:  # NHD read back to back, HND written to the spaced buffer
            nhd, hnd = runs[:, 0] - packed, runs[:, 1] - apart
            k, at_nhd, at_hnd = nhd // block, nhd % block, hnd % (2 * block)
            assert np.array_equal(hnd // (2 * block), k) and np.all(np.diff(runs[:, 0]) == row)
        t, h = at_nhd // row // heads, at_nhd // row % heads
        assert np.array_equal(at_hnd, (h * tokens + t) * row)
        assert len(np.unique(k * block + at_nhd)) == len(runs)


def test_calibration_prices_a_descriptor_by_the_rounds_ratio_not_the_fastest_of_each() -> None:
    """A burst of load that stretched both transfers of one round, and one that sped the
    single descriptor of another, price a descriptor at what the rounds agree on: 11
    descriptors took 1.2x one descriptor of their bytes in two rounds of three, so each
    adds 0.2 x 8 ms (the fastest single descriptor) / 10 = 0.16 ms, where the fastest of
    each priced it at (12 - 8) / 10 = 0.4 ms."""
    cut, whole = [12e-3, 30e-3, 12.6e-3], [10e-3, 25e-3, 8e-3]
    assert calibration._added_per_descriptor(cut, whole, 11) == pytest.approx(0.2 * 8e-3 / 10)
    assert calibration._added_per_descriptor([9e-3], [10e-3], 11) == 0.0  # faster cut: nothing added
    # a round timed at 0 s (a coarse clock) is outvoted, and all of them price nothing: no ZeroDivisionError
    rounds = [12e-3, 1e-3, 12e-3], [10e-3, 0.0, 10e-3]
    assert calibration._added_per_descriptor(*rounds, 11) == pytest.approx(0.2 * 10e-3 / 10)
    assert calibration._added_per_descriptor([0.0, 0.0], [0.0, 0.0], 11) == 0.0


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_the_model_prices_a_scatter_as_a_scatter_and_picks_direct_where_the_copy_costs_more(op: str) -> None:
    """A staged READ scatters, a staged WRITE gathers (and a peer-staged strategy the
    other way, the peer's copy): each is priced at its own figures, and ``"auto"`` takes
    the staged plan only where the descriptors it saves cost more than its copy. The
    map: 64 runs of 64 KiB, one stretch on the remote side (4 MiB), 64 descriptors
    direct against 1 staged."""
    m, buf = scattered_map(64, 1 << 16)
    n, nbytes = 64, 64 << 16
    cheap = nx.CostModel(per_descriptor_s=20e-6, bandwidth=1e9, per_transfer_s=0.0, copy_per_run_s=0.0)
    saved = 63 * 20e-6  # the wire time the staged plan saves
    # gathering at 1e12 B/s costs 4 us, scattering at 1e9 B/s 4.2 ms: more than the 1.26 ms saved
    model = dataclasses.replace(cheap, copy_bandwidth=1e12, scatter_per_run_s=0.0, scatter_bandwidth=1e9)
    assert model.copy_s(n, nbytes) == pytest.approx(nbytes / 1e12)
    assert model.copy_s(n, nbytes, scatters=True) == pytest.approx(nbytes / 1e9)
    wire = model.direct_s(1, nbytes)
    assert model.direct_s(n, nbytes) - wire == pytest.approx(saved)
    mp = m if op == "WRITE" else Map(m.runs[:, [1, 0, 2]], m.dst, m.src)  # READ: the peer's bytes to here
    p = nx.plan(mp, staging=staging_at(buf), cost=model)
    copy = model.copy_s(n, nbytes, scatters=op == "READ")
    assert p.predicted_s["staged"] == pytest.approx(wire + copy)
    assert p.strategy == ("staged" if op == "WRITE" else "direct")
    # the converse: a scatter cheaper than the descriptors it saves is taken
    fast = dataclasses.replace(cheap, copy_bandwidth=1e12, scatter_per_run_s=1e-9, scatter_bandwidth=1e12)
    assert nx.plan(mp, staging=staging_at(buf), cost=fast).strategy == "staged"
    # and a gather dearer than them is not, whichever way the scatter is priced
    slow_gather = dataclasses.replace(
        cheap, copy_bandwidth=1e9, scatter_per_run_s=0.0, scatter_bandwidth=1e12
    )
    assert nx.plan(mp, staging=staging_at(buf), cost=slow_gather).strategy == (
        "direct" if op == "WRITE" else "staged"
    )
    poster: Literal["src", "dst"] = "src" if op == "WRITE" else "dst"
    assert nx.estimate(mp, poster=poster, cost=model).predicted_s["staged"] == pytest.approx(wire + copy)


# make bench-pd's calibration of READs on the quiet 2-core loopback (2026-12-07, pd3)
PD3_READ = nx.CostModel(
    per_descriptor_by_size=((1 << 10, 2.5e-6), (8 << 10, 2.2e-6), (32 << 10, 2.3e-6), (64 << 10, 3.1e-6),
                            (128 << 10, 4.3e-6), (512 << 10, 10.1e-6)),
    bandwidth=2.41e9, per_transfer_s=1.01e-3, copy_per_run_s=0.033e-6, copy_bandwidth=9.5e9,
    scatter_per_run_s=0.021e-6, scatter_bandwidth=9.8e9, staged_plan_s=118e-6, sort_per_run_s=0.036e-6,
    unordered_check_per_run_s=0.031e-6,
)  # fmt: skip


def hnd_head_slices(here_whole: bool, scattered: bool = False) -> Map:
    """TP-resharded HND's READ in shape (64 MiB, 4,096 runs of 16 KiB: 64 blocks of 16
    tokens, 32 layers, K and V, half of 8 heads of 128 bf16): on the side that holds
    every head each run is half a block, a run apart from the next; on the other the
    runs of a tensor follow one another (a stretch of 1 MiB each of its 64 tensors), or
    with ``scattered`` lie in 64 of its 72 blocks drawn at random (as bench-pd draws a
    request's blocks). ``here_whole``: this side (the destination, which READs) holds
    every head (TP 2 -> 1), else the peer does (TP 1 -> 2). The runs in destination
    order, as a map lists them; addresses only (nothing is allocated)."""
    run, per, tensors, blocks = 16 << 10, 64, 64, 72
    i = np.arange(per * tensors, dtype=U64)
    t, k = i // U64(per), i % U64(per)
    slot = np.random.default_rng(7).permutation(blocks)[:per] if scattered else np.arange(per)
    at = slot.astype(U64)[k]
    packed = U64(1 << 40) + t * U64(2 << 20) + at * U64(run)  # tensors 2 MiB apart
    apart = U64(1 << 41) + t * U64(4 << 20) + at * U64(2 * run)  # a run, then the other heads' half
    src, dst = (packed, apart) if here_whole else (apart, packed)
    runs = np.stack([src, dst, np.full(len(i), run, U64)], axis=1)[np.argsort(dst, kind="stable")]
    first = np.arange(tensors, dtype=U64)
    spans = {
        "packed": np.stack(
            [U64(1 << 40) + first * U64(2 << 20), np.full(tensors, blocks * run, U64)], axis=1
        ),
        "apart": np.stack(
            [U64(1 << 41) + first * U64(4 << 20), np.full(tensors, 2 * blocks * run, U64)], axis=1
        ),
    }
    src_spans, dst_spans = (
        (spans["packed"], spans["apart"]) if here_whole else (spans["apart"], spans["packed"])
    )
    return Map(runs, Side(src_spans, False), Side(dst_spans, True))


def test_a_request_is_priced_by_its_op_s_default_figures() -> None:
    """Given no model, a READ is priced by the READs' own medians (DEFAULT_READ_COST), a
    WRITE by DEFAULT_COST. Priced by both ops' (a descriptor of 16 KiB at 4.2 us, a READ's
    2.7 us), TP 1 -> 2 HND's scattered READ went peer-staged (bench-pd: 0.042 s against
    direct's 0.037 s) and TP 2 -> 1's staged (0.040 s against 0.036 s)."""
    both_ops = dataclasses.replace(nx.DEFAULT_COST, read_copy_factor=None)
    for here_whole, before in ((False, "peer-staged"), (True, "staged")):
        m = hnd_head_slices(here_whole, scattered=True)
        assert nx.estimate(m, poster="dst", cost=both_ops).choice == before
        e = nx.estimate(m, poster="dst")
        assert e.choice == "direct" and e.descriptors[before] < 4096
        assert e.predicted_s["direct"] == pytest.approx(nx.DEFAULT_READ_COST.direct_s(4096, 64 << 20))
    assert nx.default_cost("READ") is nx.DEFAULT_READ_COST and nx.default_cost("WRITE") is nx.DEFAULT_COST
    assert nx.DEFAULT_READ_COST.descriptor_s(16 << 10) < nx.DEFAULT_COST.descriptor_s(16 << 10)
    m, _ = scattered_map(64, 1 << 16)
    write, read = nx.plan(m), nx.plan(Map(m.runs[:, [1, 0, 2]], m.dst, m.src))
    assert (write.op, read.op) == ("WRITE", "READ")
    assert write.predicted_s["direct"] == pytest.approx(nx.DEFAULT_COST.direct_s(64, 64 << 16))
    assert read.predicted_s["direct"] == pytest.approx(nx.DEFAULT_READ_COST.direct_s(64, 64 << 16))


def test_a_read_s_copy_is_priced_at_the_read_copy_factor() -> None:
    """A READ's copy (a staged READ's scatter once it landed, the peer's gather before a
    peer-staged READ) costs ``read_copy_factor`` times its own price, a WRITE's its own:
    in a quiet ``make bench-pd`` the READs' copies took a median 1.35x (0.96-2.6x over 21
    rows) their calibrated price. Priced at 1 with that run's READ calibration, TP 1 -> 2
    HND's READ went peer-staged (38-39 ms; direct took 35 ms) and TP 2 -> 1's staged (39
    ms against 35 ms); priced at the factor, both go direct."""
    for here_whole, unpriced in ((False, "peer-staged"), (True, "staged")):
        m = hnd_head_slices(here_whole)
        e = nx.estimate(m, poster="dst", cost=PD3_READ)
        assert (e.op, e.num_runs, e.num_bytes, e.choice) == ("READ", 4096, 64 << 20, unpriced)
        other = "staged" if unpriced == "peer-staged" else "peer-staged"
        assert e.descriptors == {"direct": 4096, unpriced: 64, other: 4096}
        priced = nx.estimate(m, poster="dst", cost=dataclasses.replace(PD3_READ, read_copy_factor=1.35))
        assert priced.choice == "direct"
        scatters = unpriced == "staged"
        copy = PD3_READ.copy_s(4096, 64 << 20, scatters=scatters)
        assert priced.predicted_s[unpriced] == pytest.approx(e.predicted_s[unpriced] + 0.35 * copy)
        assert priced.predicted_s["direct"] == e.predicted_s["direct"]
    assert nx.DEFAULT_COST.read_copy_factor == 1.35
    # a WRITE's copy is priced at its own figures, whatever the factor
    m, buf = scattered_map(64, 1 << 16)
    slow = dataclasses.replace(PD3_READ, read_copy_factor=3.0)
    for op in ("WRITE", "READ"):
        mp = m if op == "WRITE" else Map(m.runs[:, [1, 0, 2]], m.dst, m.src)
        p = nx.plan(mp, staging=staging_at(buf), cost=slow, strategy="staged")
        copy = slow.copy_s(64, 64 << 16, scatters=op == "READ") * (3.0 if op == "READ" else 1.0)
        own = slow.staged_plan_s + slow.order_s(64, sorts=1)  # the runs descend on the remote side
        assert p.predicted_s["staged"] == pytest.approx(slow.direct_s(1, 64 << 16) + copy + own)


@pytest.mark.parametrize("pair", ["NHD -> HND", "same layout"])
def test_a_permuted_maps_copy_is_priced_at_its_transposed_factors(pair: str) -> None:
    """NHD -> HND (kind ``permuted``): its copy, whose runs are transposed tiles, is priced
    at the plain figures times ``transposed_factor`` gathering and ``transposed_scatter_factor``
    scattering; ``"auto"`` then takes the side whose copy its prices make cheaper, which
    the plain figures alone (the same both ways) leave to the tie-break (the gather). A map
    of one layout is priced plain, whatever the factors (and goes direct: its runs are its
    stretches)."""
    from kvlayout import EngineKVFormat as F
    from kvlayout.registration.registration import bind
    from kvlayout.transfer import block_map

    nhd, hnd = F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS
    shape = {nhd: (2, 12, 4, 4, 8), hnd: (2, 12, 4, 4, 8)}
    dst_fmt = hnd if pair == "NHD -> HND" else nhd
    src = bind([torch.zeros(shape[nhd], dtype=torch.bfloat16) for _ in range(3)], nhd)
    dst = bind([torch.zeros(shape[dst_fmt], dtype=torch.bfloat16) for _ in range(3)], dst_fmt)
    m = block_map(src, dst.describe(block_size=4), [2, 3, 4, 5], [6, 7, 8, 9], num_tokens=16)
    assert ("permuted" in m.kind) == (pair == "NHD -> HND")
    n, nbytes = m.num_runs, m.num_bytes
    plain = nx.CostModel(
        per_descriptor_s=20e-6, bandwidth=1e9, per_transfer_s=0.0, copy_per_run_s=1e-6, copy_bandwidth=1e8,
        scatter_per_run_s=1e-6, scatter_bandwidth=1e8,
    )  # fmt: skip
    buf = np.zeros(nbytes, np.uint8)
    there = nx.PeerStaging(buf.ctypes.data, buf.nbytes)
    for gathering, scattering in ((2.0, 0.5), (0.5, 2.0)):
        model = dataclasses.replace(plain, transposed_factor=gathering, transposed_scatter_factor=scattering)
        p = nx.plan(m, staging=staging_at(buf), peer_staging=there, cost=model)
        permuted = pair == "NHD -> HND"
        ways: tuple[tuple[Literal["staged", "peer-staged"], bool], ...] = (
            ("staged", False),
            ("peer-staged", True),
        )
        for strategy, scatters in ways:  # a WRITE: gathers here, scatters there
            factor = (scattering if scatters else gathering) if permuted else 1.0
            copy = model.copy_s(n, nbytes, scatters=scatters, transposed=permuted)
            assert copy == pytest.approx(plain.copy_s(n, nbytes, scatters=scatters) * factor)
            posts = nx.plan(m, strategy=strategy, staging=staging_at(buf), peer_staging=there, cost=model)
            wire = model.direct_s(posts.num_descriptors, nbytes)  # one stage: the copy, then the wire
            assert p.predicted_s[strategy] == pytest.approx(wire + copy)
        cheaper_scatter = scattering < gathering
        # one layout: the runs are the stretches, so direct posts as few descriptors and copies nothing
        assert p.strategy == (("peer-staged" if cheaper_scatter else "staged") if permuted else "direct")
        posters: tuple[Literal["src", "dst"], ...] = ("src", "dst")
        for poster in posters:  # estimate prices both posters alike: a READ's staged copy scatters
            e = nx.estimate(m, poster=poster, cost=model)
            if poster == "src":  # a WRITE, as plan() prices it: each strategy alike
                assert e.predicted_s == pytest.approx(p.predicted_s)
            gathers_here = poster == "src"
            want = "peer-staged" if cheaper_scatter == gathers_here else "staged"
            assert e.choice == (want if permuted else "direct")


def test_a_joined_map_of_permuted_parts_is_priced_as_a_permuted_map() -> None:
    """A request's groups moved as one (``join_maps``), each NHD -> HND: its copy is the
    parts' transposed tiles, priced at the factors as one permuted map's; joined with a
    part of one layout, plain."""
    from kvlayout import EngineKVFormat as F
    from kvlayout.registration.registration import bind
    from kvlayout.transfer import block_map, join_maps

    nhd, hnd = F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS
    src = bind([torch.zeros((2, 12, 4, 4, 8), dtype=torch.bfloat16) for _ in range(3)], nhd)
    # both registrations kept alive: a description of freed tensors may share the next one's addresses
    dsts = [
        bind([torch.zeros((2, 12, 4, 4, 8), dtype=torch.bfloat16) for _ in range(3)], f) for f in (hnd, nhd)
    ]
    to_hnd, to_nhd = (d.describe(block_size=4) for d in dsts)
    model = dataclasses.replace(nx.DEFAULT_COST, transposed_factor=3.0, transposed_scatter_factor=3.0)
    plain = dataclasses.replace(model, transposed_factor=None, transposed_scatter_factor=None)
    first = block_map(src, to_hnd, [2, 3], [6, 7], num_tokens=8)
    for other, permuted in ((block_map(src, to_hnd, [4, 5], [8, 9], num_tokens=8), True),
                            (block_map(src, to_nhd, [4, 5], [8, 9], num_tokens=8), False)):  # fmt: skip
        joined = join_maps([first, other])
        for poster in ("src", "dst"):
            priced, base = (nx.estimate(joined, poster=poster, cost=c).predicted_s for c in (model, plain))
            for strategy in ("staged", "peer-staged"):
                assert (priced[strategy] > base[strategy]) == permuted, (poster, strategy)


def test_each_request_s_map_reads_its_kind_off_the_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan()`` prices every request's map by its kind (a permuted map's copy at its own
    factors). The kind is the pair's (its sides and shards): worked out by the first map of
    the pair asked, then read by every later request's map, not worked out again (9-12 us
    a request, where the map's build is 20-40 us)."""
    from kvlayout import EngineKVFormat as F
    from kvlayout.registration.registration import bind
    from kvlayout.transfer import block_map, block_maps

    nhd, hnd = F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS
    src = bind([torch.zeros((2, 12, 4, 4, 8), dtype=torch.bfloat16) for _ in range(3)], nhd)
    dst = bind([torch.zeros((2, 12, 4, 4, 8), dtype=torch.bfloat16) for _ in range(3)], hnd).describe(
        block_size=4
    )
    first = block_map(src, dst, [2, 3], [6, 7], num_tokens=8)
    assert first.kind == "permuted"
    monkeypatch.setattr(block_maps, "_kind", lambda *_: pytest.fail("the pair's kind worked out again"))
    m = block_map(src, dst, [4, 5, 9], [8, 9, 1], num_tokens=12)
    assert (m.kind, m.reason) == (first.kind, first.reason)
    model = dataclasses.replace(nx.DEFAULT_COST, transposed_factor=3.0)
    plain = dataclasses.replace(model, transposed_factor=None)
    assert (
        nx.estimate(m, poster="src", cost=model).predicted_s["staged"]
        > (nx.estimate(m, poster="src", cost=plain).predicted_s["staged"])
    )


@pytest.mark.parametrize("stages", [1, 3, 8, None])
@pytest.mark.parametrize("pair", ["TP 2 -> 1 NHD", "TP 1 -> 2 HND", "NHD -> HND"])
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_a_paced_peer_staged_request_cuts_its_stages_as_the_peer_does(
    op: str, pair: str, stages: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each side plans the request from its own registration and the other's description.
    The poster's peer-staged stage ``i`` posts the same staging bytes the peer's staged
    plan copies as its stage ``i``; that is what each stage's notification vouches for.
    Neither naming ``stages`` (None), both cut it alike: a READ in the peer's gather's
    default pipeline (a stage per 512 bytes here, for 4 MiB), a WRITE in one stage."""
    import random

    from kvlayout import EngineKVFormat as F
    from kvlayout.testing.nixl_peer import CacheSpec, build_cache
    from kvlayout.transfer import RegistrationDescription, Shard, block_map

    nhd, hnd = F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS
    (sf, s_tp), (df, d_tp) = {
        "TP 2 -> 1 NHD": ((nhd, (1, 2)), (nhd, (0, 1))),
        "TP 1 -> 2 HND": ((hnd, (0, 1)), (hnd, (1, 2))),
        "NHD -> HND": ((nhd, (0, 1)), (hnd, (0, 1))),
    }[pair]

    def cache(fmt: F, tp: tuple[int, int]) -> tuple[Any, Shard]:  # shapes from the layout algebra
        shard = Shard(tp[0], tp[1], 4)
        spec = CacheSpec(fmt.name, 3, 12, 8, len(shard.heads), 16, shard=(tp[0], tp[1], 4))
        return build_cache(spec)[0], shard

    (src, s_shard), (dst, d_shard) = cache(sf, s_tp), cache(df, d_tp)
    rng = random.Random(f"{op} {pair} {stages}")  # fixed ids: a case fails alike on every run
    src_ids, dst_ids = rng.sample(range(12), 5), rng.sample(range(12), 5)
    kw: dict[str, Any] = {"num_tokens": 37, "src_shard": s_shard, "dst_shard": d_shard}

    def described(reg: Any, shard: Shard) -> RegistrationDescription:
        return RegistrationDescription.from_json(reg.describe(shard=shard).to_json())

    buf = np.zeros(1 << 20, np.uint8)  # the peer's staging buffer
    if op == "WRITE":  # the poster holds the source; the peer unstages
        poster_map = block_map(src, described(dst, d_shard), src_ids, dst_ids, **kw)
        peer_map = block_map(described(src, s_shard), dst, src_ids, dst_ids, **kw)
    else:  # the poster holds the destination; the peer stages
        poster_map = block_map(described(src, s_shard), dst, src_ids, dst_ids, **kw)
        peer_map = block_map(src, described(dst, d_shard), src_ids, dst_ids, **kw)
    there = nx.PeerStaging(buf.ctypes.data, buf.nbytes)
    if stages is None:  # each side as its calls default: the poster's transfer, the peer's stage/unstage
        monkeypatch.setattr(plans, "_STAGE_BYTES", 512)
        ours = nx.plan(poster_map, strategy="peer-staged", peer_staging=there)
        peer_half = nx.prepare_unstage if op == "WRITE" else nx.prepare_stage
        theirs = peer_half(peer_map, staging_at(buf)).plan
        wanted = nx.auto_stages(theirs.op, ours.num_bytes)
        assert wanted == (1 if op == "WRITE" else nx.AUTO_STAGES)
    else:
        ours = nx.plan(poster_map, strategy="peer-staged", peer_staging=there, stages=stages)
        theirs = nx.plan(peer_map, strategy="staged", staging=staging_at(buf), stages=stages)
        wanted = stages
    assert ours.op == op and theirs.op == ("READ" if op == "WRITE" else "WRITE")
    assert len(ours.stages) == min(wanted, ours.num_descriptors)
    assert ours.stages == theirs.stages
    assert np.array_equal(ours.remote[:, :2], theirs.local[:, :2])  # the same staging bytes, in order
    assert theirs.copies is not None
    staged_col = 1 if op == "READ" else 0  # the peer's copies: a gather writes staging, a scatter reads it
    for stage in theirs.stages:
        lo, hi = stage.descriptors
        start, end = int(theirs.local[lo, 0]), int(theirs.local[hi - 1, 0] + theirs.local[hi - 1, 1])
        copies = theirs.copies[stage.runs[0] : stage.runs[1]]
        assert int(copies[:, 2].sum()) == end - start
        assert copies[:, staged_col].min() >= start and (copies[:, staged_col] + copies[:, 2]).max() <= end


def test_make_agent_takes_whichever_nixl_build_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """``nixl`` (the meta package), else ``nixl_cu12``, else ``nixl_cu13`` (a CUDA 13 torch's);
    none of them: an ImportError that says what to install."""
    import types

    made: list[tuple[str, object]] = []

    def agent(name: str, config: object) -> str:
        made.append((name, config))
        return "agent"

    cu13 = types.ModuleType("nixl_cu13._api")
    cu13.nixl_agent_config = lambda **kw: kw  # type: ignore[attr-defined]
    cu13.nixl_agent = agent  # type: ignore[attr-defined]
    cu13.nixl_thread_sync_t = {"NIXL_THREAD_SYNC_STRICT": "strict-sync"}  # type: ignore[attr-defined]
    for name in ("nixl", "nixl._api", "nixl_cu12", "nixl_cu12._api"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it raises ImportError
    monkeypatch.setitem(sys.modules, "nixl_cu13", types.ModuleType("nixl_cu13"))
    monkeypatch.setitem(sys.modules, "nixl_cu13._api", cu13)
    assert nx.make_agent("cu13-agent", progress_thread=False) == "agent"
    assert made == [
        (
            "cu13-agent",
            {
                "enable_prog_thread": False,
                "backends": ["UCX"],
                "capture_telemetry": True,
                "sync_mode": "strict-sync",
            },
        )
    ]
    monkeypatch.setitem(sys.modules, "nixl_cu13._api", None)
    with pytest.raises(
        ImportError, match=r"NIXL is not installed: pip install 'kvlayout\[nixl\]'.*nixl-cu13"
    ):
        nx.make_agent("none")


def test_a_local_side_without_moved_is_named() -> None:
    """A connector's own MapSide written before moved() existed: a TypeError that says
    what to add, not an AttributeError from inside."""

    class OldSide(SimpleNamespace):
        pass

    here = OldSide(
        tensor_spans=np.array([[1 << 20, 4096]], dtype=U64), is_local=True, device_type="cpu", device_index=0
    )
    there = Side(np.array([[1 << 30, 4096]], dtype=U64), is_local=False)
    runs = np.array([[1 << 20, 1 << 30, 4096]], dtype=U64)
    with pytest.raises(
        TypeError, match=r"^OldSide has no moved\(\): a MapSide says what of its memory moved"
    ):
        nx.descriptors(Map(runs, here, there))  # type: ignore[arg-type]


class _Named:
    """Stands for an agent in the registry of regions (only its name is read)."""

    def __init__(self, name: str) -> None:
        self.name = name


def _holding(agent: _Named, held: list[regions.Region]) -> regions._AgentRegions:
    """The regions ``agent`` holds, as register() would leave them."""
    out = regions._REGIONS.setdefault(agent, regions._AgentRegions())
    for r in held:
        out.count[r] = 1
    return out


def test_a_request_pins_the_regions_its_descriptors_reach_not_those_that_only_touch_them() -> None:
    """start() pins what a request may post through; a neighbour that merely touches its
    descriptors, or a region on another device or of another memory type, stays free
    to deregister at once."""
    agent = _Named("kvl-pins")
    below, inside, above = (regions.Region(a, 4096, "DRAM", 0) for a in (4096, 8192, 12288))
    elsewhere = [regions.Region(8192, 4096, "DRAM", 1), regions.Region(8192, 4096, "VRAM", 0)]
    held = _holding(agent, [below, inside, above, *elsewhere])
    rows = np.array([[8192, 1024, 0], [8192 + 3072, 1024, 0]], U64)  # the first and last KiB of `inside`
    reach = regions._reach(rows, "DRAM")
    assert reach == ("DRAM", 0, 8192, 12288)
    pinned = regions._pin(agent, [reach, None])
    assert pinned == (inside,) and held.pins == {inside: 1}
    regions._unpin(agent, pinned)
    assert held.pins == {}


def test_descriptors_are_checked_against_the_regions_of_their_own_device() -> None:
    agent = _Named("kvl-devices")
    a, b = regions.Region(1 << 20, 4096, "VRAM", 0), regions.Region(2 << 20, 4096, "VRAM", 1)
    _holding(agent, [a, b])
    regions._check_local_rows(agent, np.array([[1 << 20, 64, 0], [2 << 20, 64, 1]], U64), "VRAM", "local run")
    with pytest.raises(
        nx.RefusedDescriptorError,
        match=r"^local run 0 \(0x200000, 64 bytes\) is outside every region registered on agent 'kvl-devices' "
        r"\(1 VRAM regions on device 0\)",
    ):  # device 1's memory, named as device 0's
        regions._check_local_rows(agent, np.array([[2 << 20, 64, 0]], U64), "VRAM", "local run")


class _Unloaded(_Named):
    """An agent that holds no peer's metadata: a notification or post to one is refused."""

    def check_remote_metadata(self, peer: str, descs: object = None) -> bool:
        return False

    def send_notif(self, peer: str, msg: bytes) -> None:
        raise AssertionError("notified a peer it never loaded")


def test_an_empty_map_to_a_peer_never_loaded_is_refused_before_its_notif_goes() -> None:
    """A map with no run (a rank pair with no heads in common) posts nothing but its
    notif: to a peer whose metadata was never loaded it is refused as any map is."""
    buf = [np.zeros(64, np.uint8)]
    m = Map(np.empty((0, 3), U64), side_of(buf, local=True), side_of(buf, local=False))
    with pytest.raises(
        nx.NixlError, match=r"^agent 'kvl-unloaded' holds no metadata of peer 'kvl-nowhere': load it with"
    ):
        nx.transfer(_Unloaded("kvl-unloaded"), "kvl-nowhere", m, notif=b"done")


class _Poster(_Named):
    """An agent that prepares requests to peer ``"kvl-there"`` (held metadata) and posts nothing."""

    def check_remote_metadata(self, peer: str, descs: object = None) -> bool:
        return peer == "kvl-there"

    def get_xfer_descs(self, rows: np.ndarray, mem: str) -> np.ndarray:
        return rows

    def initialize_xfer(self, *args: object) -> object:
        return object()

    def release_xfer_handle(self, handle: object) -> None:
        pass


def test_a_staging_buffer_auto_took_and_did_not_use_is_free_again() -> None:
    """ "auto" takes the buffer before it plans; a request it then sends direct (one long
    run) lets go of it at once, not when the request is done."""
    local, remote, stage = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
    agent = _Poster("kvl-auto")
    _holding(agent, [regions.Region(b.ctypes.data, b.nbytes, "DRAM", 0) for b in (local, stage)])
    m = Map(runs_between([local], [remote], [(0, 0, 0, 0, 4096)]), side_of([local], local=True),
            side_of([remote], local=False))  # fmt: skip
    staging = staging_at(stage)
    xfer = nx.prepare_transfer(agent, "kvl-there", m, staging=staging)
    assert xfer.plan.strategy == "direct" and xfer.staging is None
    assert not staging.busy
    xfer.release()


class _Lists(_Named):
    """Records the lists prepared (NIXL's prep_xfer_dlist) and accepts, as NIXL's
    check_remote_metadata does, only descriptors inside what the peer ``registered``."""

    def __init__(self, name: str, registered: list[tuple[int, int]] = ()) -> None:  # type: ignore[assignment]
        super().__init__(name)
        self.prepared: list[np.ndarray] = []
        self.released: list[int] = []
        self.registered = registered

    def prep_xfer_dlist(self, name: str, rows: np.ndarray, mem: str) -> int:
        self.prepared.append(rows.copy())
        return len(self.prepared) - 1

    def release_dlist_handle(self, handle: int) -> None:
        self.released.append(handle)

    def get_xfer_descs(self, rows: np.ndarray, mem: str) -> np.ndarray:
        return np.asarray(rows, dtype=U64).reshape(-1, 3)

    def check_remote_metadata(self, peer: str, descs: np.ndarray | None = None) -> bool:
        return descs is None or all(
            any(a <= r[0] and r[0] + r[1] <= a + n for a, n in self.registered) for r in descs.tolist()
        )


def test_a_prepared_list_holds_what_nixl_s_int32_indices_reach_and_no_empty_row() -> None:
    """NIXL indexes a prepared list with int32: 2**31 - 1 units are prepared, 2**31 are
    refused before NIXL is asked. A stretch shorter than a unit holds none, and is left
    out of the list (NIXL is never handed a row of no units)."""
    from kvlayout.transfer.nixl.prepped import _prep_list

    agent = _Lists("kvl-lists")
    base = 1 << 30
    fits = _prep_list(agent, "p", np.array([[base, 2**31 - 1]], U64), 1, 0, "DRAM", "peer 'p''s")
    assert fits.size == 2**31 - 1 and agent.prepared[-1][:, 4].tolist() == [2**31 - 1]
    with pytest.raises(
        TransferError,
        match=r"^2147483648 units of 1 bytes do not fit NIXL's int32 indices; use a larger unit$",
    ):
        _prep_list(agent, "p", np.array([[base, 2**31]], U64), 1, 0, "DRAM", "peer 'p''s")
    assert len(agent.prepared) == 1
    spans = np.array([[base, 1024], [base + 4096, 100], [base + 8192, 512]], U64)  # the middle: < a unit
    pl = _prep_list(agent, "p", spans, 256, 0, "DRAM", "local")
    assert agent.prepared[-1][:, [0, 4]].tolist() == [[base, 4], [base + 8192, 2]]
    assert pl.indices(np.array([[base + 8192, 512, 0]], U64), "run").tolist() == [4, 5]
    fits.release()
    pl.release()
    assert agent.released == [0, 1]  # the two lists NIXL prepared, each once


def test_a_refusal_by_the_peer_s_registration_names_the_first_descriptor_outside_it() -> None:
    """NIXL says only whether a whole list is inside what the peer registered; the
    refusal bisects it to the first descriptor outside, wherever that lies in the list."""
    peer = [(1 << 20, 4096)]
    agent = _Lists("kvl-bisect", peer)
    inside = [(1 << 20) + 64 * k for k in range(16)]
    for bad in range(16):
        addr = list(inside)
        addr[bad] = 2 << 20  # unregistered
        addr[-1] = addr[-1] if bad == 15 else 3 << 20  # and the last, after it
        rows = np.array([[a, 64, 0] for a in addr], U64)
        with pytest.raises(
            nx.RefusedDescriptorError,
            match=rf"^remote descriptor {bad} \({addr[bad]:#x}, 64 bytes\) is inside what peer 'p' described "
            "but not inside memory it registered with NIXL",
        ):
            regions._refuse_unregistered(agent, "p", rows, "DRAM", "remote descriptor")
    regions._refuse_unregistered(agent, "p", np.array([[a, 64, 0] for a in inside], U64), "DRAM", "x")


def test_a_peer_staging_buffer_is_claimed_per_peer_and_by_the_bytes_it_holds() -> None:
    """One request at a time through a peer's staging buffer: another claim of bytes it
    holds is refused (or, for "auto", None); a buffer merely touching it, or the same
    addresses at another peer (another process's memory), is claimed."""
    from kvlayout.transfer.nixl.holds import _claim_peer_staging, _unclaim_peer_staging

    agent = _Named("kvl-claims")
    first = _claim_peer_staging(agent, "p", nx.PeerStaging(1 << 20, 4096), True)
    claims = [first]
    try:
        for other in (nx.PeerStaging((1 << 20) + 4096, 4096), nx.PeerStaging((1 << 20) - 4096, 4096)):
            claims.append(_claim_peer_staging(agent, "p", other, True))
        claims.append(_claim_peer_staging(agent, "q", nx.PeerStaging(1 << 20, 4096), True))
        assert all(c is not None for c in claims)
        overlapping = nx.PeerStaging((1 << 20) + 4095, 2)
        assert _claim_peer_staging(agent, "p", overlapping, False) is None
        with pytest.raises(
            TransferError, match=r"^peer 'p''s staging buffer PeerStaging\(.*is in use by another"
        ):
            _claim_peer_staging(agent, "p", overlapping, True)
    finally:
        for c in claims:
            _unclaim_peer_staging(c)


class _NixlRefusedError(Exception):
    """What NIXL raises (its module is nixl's: kvlayout's sides._is_nixl_error)."""


_NixlRefusedError.__module__ = "nixl._api"


class _Xfers(_Named):
    """An agent whose requests NIXL reports ``state`` and whose handles it releases (or,
    ``refuse``, refuses to), as nixl_agent's check_xfer_state and release_xfer_handle."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.state, self.refuse, self.released = "PROC", False, list[str]()

    def check_xfer_state(self, handle: str) -> str:
        return self.state

    def release_xfer_handle(self, handle: str) -> None:
        if self.refuse:
            raise _NixlRefusedError(f"cannot release {handle}: still in use")
        self.released.append(handle)


@pytest.mark.parametrize("refused", [False, True])
def test_a_request_dropped_in_flight_holds_the_peer_s_staging_buffer_until_nixl_reports_it_over(
    refused: bool,
) -> None:
    """A peer-staged request dropped in flight (started, never waited for) may still write
    the peer's staging buffer, or read it: until NIXL reports every posted stage over and
    its queued copies have run, another request of the agent through that buffer is
    refused ("auto" goes without it), as while it was waited for. Then its NIXL requests
    are released and the buffer is free; where NIXL refuses to release one, what the
    request holds is kept for good and the peer's buffer let go of (the peer's:
    _NO_CANCEL's rule), and it is not asked again."""
    from concurrent.futures import Future

    from kvlayout.transfer.nixl import holds

    agent = _Xfers(f"kvl-dropped-{refused}")
    buf = nx.PeerStaging(1 << 20, 4096)
    copy: Future[None] = Future()  # a pipeline's gather, queued before the drop
    hold = holds._Hold(agent, ["s0", "s1", "s2"], None, [copy], started=True, posted=2)
    hold.peer_claim = holds._claim_peer_staging(agent, "p", buf, True)
    try:
        assert holds._let_go_abandoned(hold) and hold in holds._DROPPED
        for state in ("PROC", "DONE"):  # in flight; then over, but its copy not run
            agent.state = state
            holds._progress_dropped(agent)
            assert hold in holds._DROPPED and agent.released == [] and not hold.kept
            assert (
                holds._claim_peer_staging(agent, "p", buf._replace(address=buf.address + 4095), False) is None
            )
            with pytest.raises(TransferError, match=r"is in use by another peer-staged request of agent"):
                holds._claim_peer_staging(agent, "p", buf, True)
        copy.set_result(None)
        agent.refuse = refused
        holds._progress_dropped(agent)
        assert hold not in holds._DROPPED
        assert agent.released == ([] if refused else ["s0", "s1", "s2"])
        assert (hold.released, hold.kept) == (not refused, refused)
        again = holds._claim_peer_staging(agent, "p", buf, True)
        assert again is not None
        holds._unclaim_peer_staging(again)
        holds._progress_dropped(agent)
        assert agent.released == ([] if refused else ["s0", "s1", "s2"])  # not asked again
    finally:
        if hold in holds._DROPPED:
            holds._DROPPED.remove(hold)
        holds._unclaim_peer_staging(hold.peer_claim)


def test_a_dropped_request_nixl_once_refused_to_release_keeps_what_it_holds_for_good() -> None:
    """A request whose ``release()`` ran and NIXL refused one of its requests, then dropped
    unreleased: what it holds is kept for good at once (its claim on the peer's buffer let
    go of, the peer's rule), and the requests NIXL refused are freed once it reports them
    over, never its staging buffer."""
    from kvlayout.transfer.nixl import holds

    agent = _Xfers("kvl-dropped-tried")
    buf = nx.PeerStaging(2 << 20, 4096)
    hold = holds._Hold(agent, ["s0"], None, started=True, posted=1)
    hold.peer_claim = holds._claim_peer_staging(agent, "p", buf, True)
    agent.refuse, agent.state = True, "DONE"
    try:
        assert hold.release(in_flight=False) is False and hold.tried and not hold.kept
        assert holds._let_go_abandoned(hold)
        assert hold.kept and hold.peer_claim is None and hold in holds._DROPPED
        agent.refuse = False
        holds._progress_dropped(agent)
        assert agent.released == ["s0"] and hold.kept and hold not in holds._DROPPED
    finally:
        if hold in holds._DROPPED:
            holds._DROPPED.remove(hold)
        holds._unclaim_peer_staging(hold.peer_claim)
