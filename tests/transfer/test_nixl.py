"""Real NIXL between two processes: this one and a peer (``kvlayout.testing.nixl_peer``), each
with its own agent, over UCX's TCP transport on loopback (shared-memory transports do
not reach across this sandbox's processes).

One peer serves most of the module (starting one costs seconds); a second, over TCP
alone, is stopped (a timeout) and then killed (a failed transfer). Bounded: a few MiB in all, every answer from a peer
awaited with a deadline (the peer is killed on overrun), every wait with a timeout, and
the whole module under a hard limit that ends the process (faulthandler).
"""

from __future__ import annotations

import faulthandler
import gc
import math
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

import kvlayout
from kvlayout.testing.nixl_peer import NixlPeer, contents, tcp_tls
from kvlayout.transfer import RegistrationDescription, TransferError, block_map
from kvlayout.transfer import nixl as nx

U64 = np.uint64
BUF = 256 << 10  # bytes in each buffer of either side
SLOT = 2048  # runs start at slots of this many bytes
UNIT = 256  # the prepped lists' unit: every run is whole units
MODULE_LIMIT_S = 240  # hard: the process ends (with tracebacks) past this


@dataclass(frozen=True)
class Map:
    """A test-only block map: runs built by hand between this process and the peer."""

    runs: np.ndarray
    src: nx.MapSide
    dst: nx.MapSide


@dataclass
class Pair:
    agent: nx.Agent
    peer: NixlPeer
    name: str  # the peer's agent name, as add_remote_agent returned it
    local: list[torch.Tensor]
    staging: nx.Staging
    prepped: nx.Prepped


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    faulthandler.dump_traceback_later(MODULE_LIMIT_S, exit=True)
    # buffers 0 and 1 registered whole; buffer 2 only its first half (a peer that lies)
    peer = NixlPeer(
        "kvl-peer", [BUF, BUF, 64 << 10], seed=1, registered=[(0, 0, BUF), (1, 0, BUF), (2, 0, 32 << 10)]
    )
    try:
        agent = nx.make_agent("kvl-local", progress_thread=False)
        name = agent.add_remote_agent(peer.metadata)
        local = [torch.zeros(BUF, dtype=torch.uint8), torch.zeros(BUF, dtype=torch.uint8)]
        held = nx.register(agent, local)
        staging = nx.Staging(agent, BUF)
        prepped = nx.prep_lists(agent, name, nx.local_side(local), peer.side([0, 1]), UNIT, staging=staging)
        yield Pair(agent, peer, name, local, staging, prepped)
        staging.close()
        held.deregister()
    finally:
        peer.close()
        faulthandler.cancel_dump_traceback_later()


def pieces(pattern: str, n: int, rng: np.random.Generator) -> list[tuple[int, int, int, int, int]]:
    """(local buffer, offset, peer buffer, offset, length) of ``n`` runs of whole units.

    scattered: random slots on both sides; remote-consecutive: random local slots, one
    after another on the peer (staged sends them as one descriptor); consecutive: one
    after another on both sides (NIXL merges the prepped form's indices into one)."""
    lengths = rng.integers(1, SLOT // UNIT + 1, n) * UNIT
    if pattern == "consecutive":
        at = np.r_[0, np.cumsum(lengths)[:-1]]
        return [(0, int(a) + SLOT, 1, int(a) + 3 * SLOT, int(k)) for a, k in zip(at, lengths, strict=True)]
    slots = BUF // SLOT
    ls = rng.permutation(2 * slots)[:n]
    if pattern == "scattered":
        rs = rng.permutation(2 * slots)[:n]
        return [
            (int(a) // slots, int(a) % slots * SLOT, int(b) // slots, int(b) % slots * SLOT, int(k))
            for a, b, k in zip(ls, rs, lengths, strict=True)
        ]
    at = np.r_[0, np.cumsum(lengths)[:-1]] + 5 * SLOT
    return [
        (int(a) // slots, int(a) % slots * SLOT, 0, int(r), int(k))
        for a, r, k in zip(ls, at, lengths, strict=True)
    ]


def make_map(p: Pair, op: str, runs: list[tuple[int, int, int, int, int]]) -> Map:
    local = [(p.local[a].data_ptr() + i, n) for a, i, _, _, n in runs]
    remote = [p.peer.address(b, j) for _, _, b, j, _ in runs]
    rows = np.array(
        [(lo, r, n) if op == "WRITE" else (r, lo, n) for (lo, n), r in zip(local, remote, strict=True)],
        dtype=U64,
    )
    here, there = nx.local_side(p.local), p.peer.side([0, 1])
    return Map(rows, here, there) if op == "WRITE" else Map(rows, there, here)


def merged_count(rows: np.ndarray) -> int:
    """Descriptors left when consecutive runs (following on both sides) merge, in order."""
    follows = (rows[1:, 0] == rows[:-1, 0] + rows[:-1, 2]) & (rows[1:, 1] == rows[:-1, 1] + rows[:-1, 2])
    return len(rows) - int(follows.sum())


@pytest.mark.parametrize("op", ["WRITE", "READ"])
@pytest.mark.parametrize("form", ["list", "prepped"])
@pytest.mark.parametrize("strategy", ["direct", "staged"])
@pytest.mark.parametrize("pattern", ["scattered", "remote-consecutive", "consecutive"])
def test_requests_move_byte_exactly(pair: Pair, op: str, form: str, strategy: str, pattern: str) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{op} {form} {strategy} {pattern}".encode()))
    runs = pieces(pattern, 48, rng)
    m = make_map(pair, op, runs)
    for t in pair.local:
        t.copy_(torch.from_numpy(rng.integers(0, 256, BUF, dtype=np.uint8)))
    before = [t.clone() for t in pair.local]
    xfer = nx.transfer(
        pair.agent, pair.name, m, strategy=strategy, staging=pair.staging,  # type: ignore[arg-type]
        prepped=pair.prepped if form == "prepped" else None, notif=f"{op}-{pattern}".encode(),
    )  # fmt: skip
    result = xfer.wait(timeout=30)
    assert result.strategy == strategy and result.num_bytes == sum(r[4] for r in runs)
    if strategy == "staged":
        stretches = xfer.plan.num_descriptors
        assert stretches == {"scattered": len(runs), "remote-consecutive": 1, "consecutive": 1}[pattern] or (
            pattern == "scattered" and stretches < len(runs)  # random slots may happen to follow one another
        )
        assert result.descriptors == stretches
    elif form == "prepped":  # NIXL merged consecutive dense indices back into whole runs, and more
        assert result.descriptors == merged_count(m.runs)
        assert pattern != "consecutive" or result.descriptors == 1
    else:
        assert result.descriptors == len(runs)
    assert pair.peer.notifs() == [f"{op}-{pattern}".encode()]
    if op == "READ":
        want, held = [t.numpy().copy() for t in before], [contents(pair.peer.seed, b, BUF) for b in (0, 1)]
        for a, i, b, j, n in runs:
            want[a][i : i + n] = held[b][j : j + n]
        for got, w in zip(pair.local, want, strict=True):
            np.testing.assert_array_equal(got.numpy(), w)
    else:
        want = [contents(pair.peer.seed, b, BUF) for b in (0, 1)]
        for a, i, b, j, n in runs:
            want[b][j : j + n] = before[a].numpy()[i : i + n]
        for b in (0, 1):
            np.testing.assert_array_equal(pair.peer.read(b), want[b])
        pair.peer.fill(pair.peer.seed)


def test_auto_chooses_staged_for_many_small_runs(pair: Pair) -> None:
    runs = [(0, k * SLOT, 0, 8 * SLOT + k * UNIT, UNIT) for k in range(128)]  # 128 runs, one stretch remotely
    m = make_map(pair, "READ", runs)
    result = nx.transfer(pair.agent, pair.name, m, staging=pair.staging, notif=b"auto").wait(timeout=30)
    assert (result.strategy, result.descriptors) == ("staged", 1)
    want = contents(pair.peer.seed, 0, BUF)
    for _, i, _, j, n in runs:
        np.testing.assert_array_equal(pair.local[0][i : i + n].numpy(), want[j : j + n])
    assert pair.peer.notifs() == [b"auto"]


def test_a_staging_buffer_in_use_leaves_auto_direct(pair: Pair) -> None:
    runs = [(0, k * SLOT, 0, 8 * SLOT + k * UNIT, UNIT) for k in range(128)]
    m = make_map(pair, "READ", runs)
    first = nx.transfer(pair.agent, pair.name, m, staging=pair.staging, notif=b"first")
    assert first.plan.strategy == "staged" and pair.staging.busy
    with pytest.raises(TransferError, match=r"Staging\(262144 bytes at 0x[0-9a-f]+, busy\) is in use"):
        nx.transfer(pair.agent, pair.name, m, strategy="staged", staging=pair.staging)
    second = nx.transfer(pair.agent, pair.name, m, staging=pair.staging, notif=b"second")
    assert second.plan.strategy == "direct"
    first.wait(timeout=30)
    second.wait(timeout=30)
    assert not pair.staging.busy
    assert sorted(pair.peer.notifs(expect=2)) == [b"first", b"second"]


def test_a_staging_buffer_of_another_agent_is_named_as_such(pair: Pair) -> None:
    """The peer's Staging handed over as this side's (both agents in one process, say)
    is registered, only not on the agent that posts: the error says so, not "register it"
    (a Staging whose tensor the posting agent registered too serves it: see the race
    test below)."""
    other = nx.make_agent("kvl-other", progress_thread=False)
    theirs = nx.Staging(other, BUF)
    m = make_map(pair, "WRITE", [(0, k * SLOT, 0, 8 * SLOT + k * UNIT, UNIT) for k in range(8)])
    # 8 runs of 256 B go direct by the defaults (a staged plan's own work outweighs 7
    # descriptors): priced so that descriptors decide, "auto" takes the staged candidate
    costly = nx.CostModel(per_descriptor_s=1e-3)
    try:
        for strategy in ("auto", "staged"):
            with pytest.raises(nx.RefusedDescriptorError) as err:  # as documented for local runs outside
                nx.transfer(pair.agent, pair.name, m, strategy=strategy, staging=theirs, cost=costly)
            assert str(err.value).startswith(f"Staging({BUF} bytes at {theirs.address:#x}")  # busy, then
            assert str(err.value).split(") ", 1)[1] == (
                "is registered on agent 'kvl-other', where it was made, not on 'kvl-local', which "
                "posts this request: a Staging serves the agent that made it (a peer's staging buffer goes as "
                "peer_staging=PeerStaging(address, nbytes, ...))"
            )
            assert not theirs.busy
    finally:
        theirs.close()


def test_a_transfer_s_arguments_are_named_when_wrong(pair: Pair) -> None:
    m = make_map(pair, "WRITE", [(0, 0, 0, 0, UNIT)])
    with pytest.raises(TypeError, match=r"staging must be an nx.Staging\(agent, nbytes\), not 5"):
        nx.transfer(pair.agent, pair.name, m, staging=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"prepped must be the lists nx.prep_lists made, not 5"):
        nx.transfer(pair.agent, pair.name, m, prepped=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"peer must be an agent name: b'\\xff' is not UTF-8"):
        nx.transfer(pair.agent, b"\xff", m)
    pair.peer.fill(pair.peer.seed)  # what nothing_arrived compares against
    with pytest.raises(
        TransferError, match=r"^the lists were prepared for peer 'kvl-peer', not 'kvl-local'$"
    ):
        nx.transfer(pair.agent, "kvl-local", m, prepped=pair.prepped)  # a peer's lists for another
    at = nx.PeerStaging(pair.peer.address(2, 0), 8 << 10)
    with pytest.raises(
        TransferError,
        match=r"^the prepped lists cover the peer's cache, not its staging buffer: post peer-staged as lists$",
    ):
        nx.transfer(pair.agent, pair.name, m, strategy="peer-staged", peer_staging=at, prepped=pair.prepped)
    nothing_arrived(pair)
    agent = nx.make_agent("kvl-one-backend", backends="UCX", progress_thread=False)  # not "U", "C", "X"
    assert list(agent.backends) == ["UCX"]
    with pytest.raises(TypeError, match="agent must be a NIXL agent"):
        nx.register(None, pair.local)
    with pytest.raises(TypeError, match=r"unit must be a positive int below 2\*\*57"):
        nx.prep_lists(pair.agent, pair.name, nx.local_side(pair.local), pair.peer.side([0, 1]), 1 << 70)
    with pytest.raises(TypeError, match=r"StageNotifs.agent must be this side's NIXL agent, not NoneType"):
        nx.StageNotifs(None, "p", b"t")._checked()
    with nx.Staging(agent, np.int64(4096)) as staging:  # type: ignore[arg-type]  # a size from an array
        assert staging.nbytes == 4096 and type(staging.nbytes) is int
    with pytest.raises(
        TypeError, match=r"nbytes must be a positive int below 2\*\*57 .*, got 18446744073709551616"
    ):
        nx.Staging(agent, 1 << 64)  # torch's C++ stack trace before
    with pytest.raises(
        TransferError, match=r"Staging\(device='banana'\) is not a device: Expected one of cpu"
    ):
        nx.Staging(agent, 4096, device="banana")


def test_a_staged_plan_holds_its_staging_buffer_and_refuses_one_whose_memory_changed() -> None:
    """A plan's copies address its staging buffer's memory: dropped (and closed), the
    buffer used to be freed under the plan, whose copy then scattered from freed memory
    (a segfault); a buffer whose tensor was resized likewise, by the plan or a transfer."""
    import weakref

    agent = nx.make_agent("kvl-staging-life", progress_thread=False)
    local, theirs = torch.zeros(BUF, dtype=torch.uint8), torch.zeros(BUF, dtype=torch.uint8)
    there = nx.LocalSide("cpu", 0, nx.local_side(theirs).tensor_spans, is_local=False)
    runs = np.array(
        [(theirs.data_ptr() + k * UNIT, local.data_ptr() + k * SLOT, UNIT) for k in range(64)], U64
    )
    read = Map(runs, there, nx.local_side(local))  # a READ: back to back there, scattered here
    with nx.register(agent, local):
        staging = nx.Staging(agent, BUF)
        staging.tensor.fill_(7)
        p = nx.plan(read, strategy="staged", staging=staging)
        held = weakref.ref(staging)
        staging.close()
        del staging
        gc.collect()
        assert held() is not None and p.staging is held()  # the plan holds it
        p.copy()  # the scatter, from memory still allocated
        assert int(local[:UNIT].sum()) == 7 * UNIT and int(local[UNIT : 2 * UNIT].sum()) == 0
        assert p.staging is not None
        p.staging.tensor.untyped_storage().resize_(0)
        copies: list[Callable[[], None]] = [p.copy, lambda: p.copy_stage(0)]
        for copy in copies:
            with pytest.raises(nx.NixlError) as err:
                copy()
            assert "the staging buffer's tensor was re-allocated (data pointer 0x0, was" in str(err.value)
            assert str(err.value).endswith("make a new Staging (and leave staging.tensor's memory alone); "
                                           "nothing was copied")  # fmt: skip


def test_the_peer_s_half_refuses_a_map_other_than_the_poster_s() -> None:
    """Both halves of a peer-staged request lay the staging buffer out by their own map:
    given the poster's fingerprint, a map of other arguments is refused before a byte
    moves (and the buffer is not taken)."""
    from kvlayout.transfer.block_maps import fingerprint

    agent = nx.make_agent("kvl-fingerprint", progress_thread=False)
    local, theirs = torch.zeros(BUF, dtype=torch.uint8), torch.zeros(BUF, dtype=torch.uint8)
    there = nx.LocalSide("cpu", 0, nx.local_side(theirs).tensor_spans, is_local=False)
    runs = np.array(
        [(theirs.data_ptr() + k * UNIT, local.data_ptr() + k * SLOT, UNIT) for k in range(64)], U64
    )
    landed = Map(runs, there, nx.local_side(local))  # this side is the destination: unstage's
    other = Map(runs[::-1].copy(), there, nx.local_side(local))  # the same runs in another order
    with nx.register(agent, local), nx.Staging(agent, BUF) as staging:
        for prepare in (nx.prepare_unstage, nx.unstage):
            with pytest.raises(TransferError) as err:
                prepare(other, staging, expect=fingerprint(runs))
            assert str(err.value) == (
                f"this side's map has fingerprint {fingerprint(other.runs)}, the poster's "
                f"'{fingerprint(runs)}': the two halves of the request were built from other arguments "
                "(block ids, their order, num_tokens, first_token, shards or block sizes), and would lay the staging "
                "buffer out differently; nothing was copied"
            )
            assert not staging.busy
        with pytest.raises(TypeError, match="expect must be the poster's map's fingerprint"):
            nx.prepare_unstage(landed, staging, expect=7)  # type: ignore[arg-type]
        nx.prepare_unstage(landed, staging, expect=fingerprint(runs)).run()


def test_numpy_numbers_serve_where_ints_and_seconds_go_and_other_values_are_named(pair: Pair) -> None:
    """A prepped list's unit and a timeout read from NumPy (np.int64, np.float32) were
    refused as "not a positive int" / "not a non-negative number of seconds", which they
    are; auto_stages took -1 bytes (1 stage) and 1e7 bytes (2.0 stages, a float that
    stages= then refuses)."""
    unit: Any = np.int64(UNIT)  # NumPy's numbers, where the signatures say int and float
    lists = nx.prep_lists(pair.agent, pair.name, nx.local_side(pair.local), pair.peer.side([0, 1]), unit)
    try:
        assert lists.local.size == lists.remote.size == 2 * BUF // UNIT and type(lists.local.unit) is int
    finally:
        lists.release()
    seconds: list[Any] = [np.float32(0.0), np.int64(0)]
    assert [nx.drain(pair.agent, s) for s in seconds] == [0, 0]
    truth: Any = np.True_
    with pytest.raises(TypeError, match=r"^timeout must be a non-negative number of seconds, got np.True_$"):
        nx.drain(pair.agent, truth)
    with pytest.raises(TypeError, match=r"^unit must be a positive int, got 256.0$"):
        nx.prep_lists(pair.agent, pair.name, nx.local_side(pair.local), pair.peer.side([0, 1]), 256.0)  # type: ignore[arg-type]
    many: Any = np.int64(16 << 20)
    assert nx.auto_stages("WRITE", many) == 4 and type(nx.auto_stages("WRITE", 1 << 30)) is int
    with pytest.raises(TypeError, match=r"^num_bytes must be an int of at least 0, got -1$"):
        nx.auto_stages("WRITE", -1)
    with pytest.raises(TypeError, match=r"^num_bytes must be an int of at least 0, got 10000000.0$"):
        nx.auto_stages("WRITE", 1e7)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^op must be 'READ' or 'WRITE', not 'write'$"):
        nx.auto_stages("write", 1 << 20)  # type: ignore[arg-type]


def test_a_transfer_through_a_staging_buffer_whose_memory_changed_posts_nothing(pair: Pair) -> None:
    staging = nx.Staging(pair.agent, BUF)
    m = make_map(pair, "WRITE", [(0, k * SLOT, 0, 8 * SLOT + k * UNIT, UNIT) for k in range(64)])
    x = nx.prepare_transfer(pair.agent, pair.name, m, strategy="staged", staging=staging)
    staging.tensor.untyped_storage().resize_(0)
    with pytest.raises(
        nx.NixlError,
        match=r"the staging buffer's tensor was re-allocated \(data pointer 0x0, .* nothing was posted",
    ):
        x.start()
    assert x.posted == 0 and not staging.busy
    staging.close()


def test_a_staging_buffer_dropped_unclosed_lets_go_of_its_region() -> None:
    """Its memory is freed with it: NIXL's region (and kvlayout's record of it, which the
    local checks read) must go too, or a later descriptor into that freed memory passes."""
    from kvlayout.transfer.nixl.regions import _check_local

    agent = nx.make_agent("kvl-staging-drop", progress_thread=False)
    staging = nx.Staging(agent, BUF)
    at = np.array([staging.address], U64)
    _check_local(agent, at, np.array([BUF], U64), "DRAM", 0, "staged descriptor")
    del staging
    gc.collect()
    with pytest.raises(nx.RefusedDescriptorError, match="is outside every region registered"):
        _check_local(agent, at, np.array([BUF], U64), "DRAM", 0, "staged descriptor")


def test_a_registration_deregistered_from_several_threads_at_once_is_deregistered_once() -> None:
    """Threads that all saw a handle live each took the count of its storage down: a raw
    KeyError, or a storage another handle still registers deregistered under it."""
    from kvlayout.transfer.nixl.regions import _REGIONS, _check_local

    agent = nx.make_agent("kvl-double-deregister", progress_thread=False)
    t = torch.zeros(BUF, dtype=torch.uint8)
    other, handle = nx.register(agent, t), nx.register(agent, t)  # one region, counted twice
    failed: list[BaseException] = []

    def deregister() -> None:
        try:
            handle.deregister()
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=deregister) for _ in range(4)]
    with _REGIONS[agent].lock:  # every thread past its first look before any deregisters
        for thread in threads:
            thread.start()
        time.sleep(0.1)
    for thread in threads:
        thread.join(30)
    assert failed == []
    assert list(_REGIONS[agent].count.values()) == [1]
    _check_local(agent, np.array([t.data_ptr()], U64), np.array([BUF], U64), "DRAM", 0, "local run")
    other.deregister()


def test_a_registration_dropped_without_deregister_keeps_its_memory_while_registered() -> None:
    """NIXL still holds the region of a handle dropped without deregister(): the memory
    stays allocated (freed, NIXL's region and the local checks would point at whatever
    the allocator put there next). The region holds the storage, not the tensor."""
    from kvlayout.transfer.nixl.regions import _REGIONS, _check_local

    agent = nx.make_agent("kvl-dropped-handle", progress_thread=False)
    t = torch.zeros(BUF, dtype=torch.uint8)
    at = t.data_ptr()
    nx.register(agent, t)  # the handle dropped at once
    del t
    gc.collect()
    assert [(s.data_ptr(), s.nbytes()) for s in _REGIONS[agent].owners.values()] == [(at, BUF)]
    _check_local(agent, np.array([at], U64), np.array([BUF], U64), "DRAM", 0, "local run")


def collect_holding(lock: Any) -> None:
    """The cyclic collector run on a thread that holds ``lock``, as register() holds the
    agent's when an allocation collects; a hang fails the run, not the machine."""
    faulthandler.dump_traceback_later(60, exit=True)
    try:
        with lock:
            gc.collect()
    finally:
        faulthandler.cancel_dump_traceback_later()


def test_a_staging_buffer_collected_while_its_agent_s_lock_is_held_is_let_go_after() -> None:
    """The cyclic collector runs finalizers on whatever thread allocates, which may hold
    the agent's lock (inside register, say): a dropped Staging's finalizer that waited for
    it hung that thread for good. It now leaves the deregistration to the next call."""
    from kvlayout.transfer.nixl.regions import _REGIONS, _check_local

    agent = nx.make_agent("kvl-staging-cycle", progress_thread=False)
    staging = nx.Staging(agent, BUF)
    at, n = np.array([staging.address], U64), np.array([BUF], U64)
    cycle: list[Any] = [staging]
    cycle.append(cycle)  # freed only by the cyclic collector
    del staging, cycle
    collect_holding(_REGIONS[agent].lock)
    with pytest.raises(nx.RefusedDescriptorError, match="is outside every region registered"):
        _check_local(agent, at, n, "DRAM", 0, "staged descriptor")  # the next call let it go


def test_a_peer_s_copy_collected_while_the_agent_s_lock_is_held_lets_go_after() -> None:
    """A PeerCopy dropped unrun in a reference cycle, its closed Staging deregistered when
    it lets go: its finalizer took the agent's lock and hung a thread that held it. The
    next call that takes the buffer or reads what is registered lets go instead."""
    from kvlayout.transfer.nixl.regions import _REGIONS, _check_local

    agent = nx.make_agent("kvl-peer-copy-cycle", progress_thread=False)
    local, theirs = torch.zeros(BUF, dtype=torch.uint8), torch.zeros(BUF, dtype=torch.uint8)
    there = nx.LocalSide("cpu", 0, nx.local_side(theirs).tensor_spans, is_local=False)
    runs = np.array(
        [(theirs.data_ptr() + k * UNIT, local.data_ptr() + k * SLOT, UNIT) for k in range(64)], U64
    )
    with nx.register(agent, local):
        staging = nx.Staging(agent, BUF)
        at, n = np.array([staging.address], U64), np.array([BUF], U64)
        cycle: list[Any] = [nx.prepare_unstage(Map(runs, there, nx.local_side(local)), staging)]
        cycle.append(cycle)  # freed only by the cyclic collector
        staging.close()  # busy: deregistered once the copy lets go
        del cycle
        collect_holding(_REGIONS[agent].lock)
        with pytest.raises(nx.RefusedDescriptorError, match="is outside every region registered"):
            _check_local(agent, at, n, "DRAM", 0, "staged descriptor")  # the next call let it go
        assert not staging.busy


def test_a_peer_s_copy_run_drains_first_and_dropped_after_queues_nothing() -> None:
    """PeerCopy.run() is a call on the agent: work a finalizer left it is done first, on
    this thread. Run, its buffer is let go of: dropped after where the collector runs on
    another thread (kvlayout's copy thread), it queues nothing that would hold the agent."""
    from kvlayout.transfer.nixl.copies import _copier
    from kvlayout.transfer.nixl.regions import _DEFERRED, defer

    agent = nx.make_agent("kvl-peer-copy-run", progress_thread=False)
    local, theirs = torch.zeros(BUF, dtype=torch.uint8), torch.zeros(BUF, dtype=torch.uint8)
    there = nx.LocalSide("cpu", 0, nx.local_side(theirs).tensor_spans, is_local=False)
    runs = np.array(
        [(theirs.data_ptr() + k * UNIT, local.data_ptr() + k * SLOT, UNIT) for k in range(8)], U64
    )
    done: list[bool] = []

    def attempt() -> bool:
        done.append(True)
        return True

    with nx.register(agent, local):
        staging = nx.Staging(agent, BUF)
        copy = nx.prepare_unstage(Map(runs, there, nx.local_side(local)), staging)
        queuer = threading.Thread(target=defer, args=(agent, attempt))
        queuer.start()
        queuer.join(timeout=30)
        assert [a for a, _ in _DEFERRED if a is agent] and not done  # queued: not the caller's thread
        copy.run(timeout=30)
        assert done == [True] and not staging.busy
        gc.disable()  # collected below on the copy thread, not by an allocation here
        try:
            cycle: list[Any] = [copy]
            cycle.append(cycle)  # freed only by the cyclic collector
            del copy, cycle
            _copier().submit(gc.collect).result(timeout=30)
        finally:
            gc.enable()
        assert not [a for a, _ in _DEFERRED if a is agent]
        staging.close()


def test_many_deferred_releases_drain_in_one_pass_and_a_failing_one_is_a_warning() -> None:
    """Each deferred release deregisters, which drained the queue again from inside
    itself: 400 buffers collected under the agent's lock made the next register() raise
    RecursionError, the popped releases lost. A release that fails is a ResourceWarning,
    not the error of whichever call drained."""
    from kvlayout.transfer.nixl.regions import _DEFERRED, _REGIONS, defer

    agent = nx.make_agent("kvl-deferred-many", progress_thread=False)
    gc.disable()  # every buffer collected below, under the lock
    try:
        for _ in range(400):
            cycle: list[Any] = [nx.Staging(agent, 64)]
            cycle.append(cycle)  # freed only by the cyclic collector
        del cycle
        with _REGIONS[agent].lock:  # as register() holds it when an allocation collects
            gc.collect()
    finally:
        gc.enable()
    assert len(_REGIONS[agent].count) == 400

    def fails() -> bool:
        raise RuntimeError("the backend refused")

    with _REGIONS[agent].lock:
        defer(agent, lambda: locks_free_or_fail(_REGIONS[agent].lock, fails))
    with (
        pytest.warns(ResourceWarning, match="could not release .*: RuntimeError: the backend refused"),
        nx.register(agent, torch.zeros(64, dtype=torch.uint8)),
    ):
        assert len(_REGIONS[agent].count) == 1 and not [a for a, _ in _DEFERRED if a is agent]


def test_drain_lets_an_agent_left_with_deferred_work_go() -> None:
    """A finalizer that ran off the agent's caller's thread (kvlayout's copy thread) left
    its work to the agent's next call, and the queue held the agent: one dropped after,
    never called again, lived on with its progress thread (3 threads here) and the
    buffer's memory. drain() does that work now, on this thread; the agent dropped after
    is freed, its threads gone. A buffer closed before it was dropped leaves no work (its
    entry would have held the agent all the same)."""
    from kvlayout.transfer.nixl.copies import _copier
    from kvlayout.transfer.nixl.regions import _DEFERRED

    _copier().submit(lambda: None).result(timeout=30)  # the copy thread, started once for good

    def left_alive(how: str) -> tuple[bool, int]:
        threads = len(os.listdir("/proc/self/task"))
        agent = nx.make_agent(f"kvl-drain-{how}")  # with NIXL's progress thread
        gc.disable()  # collected below on the copy thread, not by an allocation here
        try:
            cycle: list[Any] = [nx.Staging(agent, 4096)]
            cycle.append(cycle)  # freed only by the cyclic collector
            if how == "closed":
                cycle[0].close()
            del cycle
            _copier().submit(gc.collect).result(timeout=30)
        finally:
            gc.enable()
        queued = [a for a, _ in _DEFERRED if a is agent]
        assert len(held_regions(agent)) == len(queued) == (how != "closed")  # left for the next call
        if how == "drained":
            assert nx.drain(agent) == 0 and not held_regions(agent)
        ref = weakref.ref(agent)
        del agent, queued
        gc.collect()
        return ref() is not None, len(os.listdir("/proc/self/task")) - threads

    assert left_alive("drained") == (False, 0)
    assert left_alive("closed") == (False, 0)
    alive, more = left_alive("left")  # as before: kept, and its threads with it
    assert alive and more > 0
    kept = next(a for a, _ in _DEFERRED if getattr(a, "name", None) == "kvl-drain-left")
    assert nx.drain(kept) == 0
    del kept
    gc.collect()
    assert not [a for a, _ in _DEFERRED if getattr(a, "name", None) == "kvl-drain-left"]
    with pytest.raises(TypeError, match=r"^agent must be a NIXL agent \(nx.make_agent\), not str$"):
        nx.drain("kvl-local")


def test_drain_counts_the_work_it_could_not_do_yet() -> None:
    """drain() says how much is left: a deferred attempt whose lock is held stays queued
    and counts, through a timeout too, until its lock is free; work whose ``pending`` says
    it was let go of already queues nothing."""
    from kvlayout.transfer.nixl.regions import _DEFERRED, defer, locks_free

    threads = len(os.listdir("/proc/self/task"))
    agent = nx.make_agent("kvl-drain-count", progress_thread=False)
    lock, done = threading.Lock(), []

    def attempt() -> bool:
        if not locks_free(lock):
            return False
        done.append(True)
        return True

    with lock:
        assert defer(agent, attempt, lambda: False)  # nothing to do: not queued
        assert not defer(agent, attempt) and not done  # never registered: left for its next call
        assert nx.drain(agent) == 1 and nx.drain(agent, timeout=0.05) == 1 and not done
    assert nx.drain(agent) == 0 and done == [True]
    assert not [a for a, _ in _DEFERRED if a is agent]
    ref = weakref.ref(agent)
    del agent
    gc.collect()
    assert ref() is None and len(os.listdir("/proc/self/task")) == threads


def test_take_notif_and_a_list_s_release_do_first_what_dropped_objects_left(pair: Pair) -> None:
    """take_notif() and PreppedList.release() are calls on the agent: the work a finalizer
    left it (defer) is done first, on this thread, as a request's is."""
    from kvlayout.transfer.nixl.regions import _DEFERRED, defer

    agent = nx.make_agent("kvl-drain-calls", progress_thread=False)
    name = agent.add_remote_agent(pair.peer.metadata)
    local = torch.zeros(BUF, dtype=torch.uint8)
    done: list[str] = []
    with nx.register(agent, local):
        lists = nx.prep_lists(agent, name, local, pair.peer.side([0, 1]), UNIT)
        for call in ("take_notif", "release"):

            def attempt(call: str = call) -> bool:
                done.append(call)
                return True

            threading.Thread(target=defer, args=(agent, attempt)).start()
            deadline = time.monotonic() + 30
            while not [a for a, _ in _DEFERRED if a is agent]:  # queued: not the caller's thread
                assert time.monotonic() < deadline
                time.sleep(0.01)
            if call == "take_notif":
                assert not nx.take_notif(agent, name, b"none-sent")
            else:
                lists.local.release()
            assert done[-1] == call and not [a for a, _ in _DEFERRED if a is agent]
        lists.release()
    agent.remove_remote_agent(name)


class _TakenMeanwhile(list):  # type: ignore[type-arg]
    """A peer's notifications where each message is seen, then gone: another thread
    took it between the two looks."""

    def __contains__(self, message: object) -> bool:
        return True


class _NotifAgent:
    name = "kvl-notif-stand-in"

    def __init__(self) -> None:
        self.notifs = {"peer": _TakenMeanwhile()}

    def update_notifs(self) -> dict[str, _TakenMeanwhile]:
        return self.notifs


def test_a_notification_another_thread_took_first_is_not_taken_again() -> None:
    """take_notif removes the message in one step: of two threads taking one message, the
    second got list.remove's ValueError where it had seen the message a moment before."""
    assert nx.take_notif(_NotifAgent(), "peer", b"req-1") is False


def locks_free_or_fail(lock: Any, then: Callable[[], bool]) -> bool:
    """An attempt that waits while ``lock`` is held, then runs ``then``."""
    from kvlayout.transfer.nixl.regions import locks_free

    return locks_free(lock) and then()


# 128 runs of one unit, one slot apart here and back to back there: a staged request.
UNIT_RUNS = [(0, k * SLOT, 0, 8 * SLOT + k * UNIT, UNIT) for k in range(128)]


def failing_copy(monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    """Every staged plan's local copy raises ``why`` (a device error, say)."""

    def fails(self: nx.Plan, num_threads: int = 1, stream: object = None) -> None:
        raise RuntimeError(why)

    monkeypatch.setattr(nx.Plan, "copy", fails)


def test_a_gather_that_fails_posts_nothing_and_frees_the_staging_buffer(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The local copy of a staged WRITE fails (a device error, say) after its NIXL request
    was made: nothing is posted, the request is released and the staging buffer is free
    for the next request."""
    pair.peer.fill(pair.peer.seed)
    m = make_map(pair, "WRITE", UNIT_RUNS)
    with monkeypatch.context() as patched:
        failing_copy(patched, "the gather failed")
        with pytest.raises(RuntimeError, match="the gather failed"):
            nx.transfer(pair.agent, pair.name, m, strategy="staged", staging=pair.staging, notif=b"never")
    assert not pair.staging.busy
    nothing_arrived(pair)
    done = nx.transfer(pair.agent, pair.name, m, strategy="staged", staging=pair.staging, notif=b"after")
    assert done.wait(timeout=30).strategy == "staged" and not pair.staging.busy
    assert pair.peer.notifs(expect=1) == [b"after"]
    pair.peer.fill(pair.peer.seed)


def test_a_pipelined_gather_refused_mid_request_names_its_stage(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A staged WRITE of two stages whose second gather is refused (the cache moved, say)
    while the first stage posts: the error names the stage. Where stage 0 was still in
    flight the staging buffer (this test's own, not the pair's) is kept for good; where it
    had landed (a busy machine runs the gather later), the buffer is free again."""
    runs = [(0, k * SLOT, 0, 8 * SLOT + (k + k // 32) * UNIT, UNIT) for k in range(128)]  # 4 stretches there
    m = make_map(pair, "WRITE", runs)
    staging = nx.Staging(pair.agent, BUF)
    copy_stage = nx.Plan.copy_stage

    def refuses_stage_1(self: nx.Plan, stage: int, stream: object = None) -> None:
        if stage == 1:
            raise TransferError("the cache moved")
        copy_stage(self, stage, stream)  # type: ignore[arg-type]

    with monkeypatch.context() as patched:
        patched.setattr(nx.Plan, "copy_stage", refuses_stage_1)
        ahead = nx.prepare_transfer(pair.agent, pair.name, m, strategy="staged", staging=staging, stages=2)
        assert len(ahead.handles) == 2
        with pytest.raises(  # from start or from wait: stage 1's gather runs beside stage 0's post
            nx.NixlError,
            match=r"^NIXL failed the WRITE to peer 'kvl-peer' \(staged, 4 descriptors, 32768 bytes, 2 stages\): "
            "the local copy of stage 1: the cache moved$",
        ):
            ahead.start()
            ahead.wait(timeout=30)
    kept = repr(staging).endswith("busy, kept for a request released in flight)")
    assert kept or repr(staging) == f"Staging({staging.nbytes} bytes at {staging.address:#x})"
    staging.close()  # NIXL lets go of its region once nothing can be in flight
    pair.peer.notifs(expect=1, wait=0.3)  # none is sent for a failed request; drained either way
    pair.peer.fill(pair.peer.seed)


def test_a_scatter_that_fails_raises_from_wait_and_frees_the_staging_buffer(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A staged READ landed but its scatter failed: ``wait`` raises it, the request is
    released and the staging buffer is free; the same request then goes through."""
    m = make_map(pair, "READ", UNIT_RUNS)
    with monkeypatch.context() as patched:
        failing_copy(patched, "the scatter failed")
        xfer = nx.transfer(pair.agent, pair.name, m, strategy="staged", staging=pair.staging)
        with pytest.raises(RuntimeError, match="the scatter failed"):
            xfer.wait(timeout=30)
    assert not pair.staging.busy
    again = nx.transfer(pair.agent, pair.name, m, strategy="staged", staging=pair.staging)
    assert again.wait(timeout=30).strategy == "staged" and not pair.staging.busy


def test_a_staging_buffer_closed_under_a_request_stays_registered_until_it_lets_go(pair: Pair) -> None:
    """close() while a prepared request holds the buffer: NIXL keeps its region until the
    request is waited for (it posted from a region already deregistered); closed and
    idle, it is refused by name; run the other side's way (stage) too."""
    m = make_map(pair, "READ", UNIT_RUNS)
    for t in pair.local:
        t.zero_()
    staging = nx.Staging(pair.agent, BUF)
    ahead = nx.prepare_transfer(pair.agent, pair.name, m, strategy="staged", staging=staging)
    staging.close()
    assert repr(staging).endswith(", busy, closed)") and "live" in repr(staging.registered)
    ahead.start()
    assert ahead.wait(timeout=30).strategy == "staged"
    assert "deregistered" in repr(staging.registered)
    want = contents(pair.peer.seed, 0, BUF)
    for _, local, _, remote, n in UNIT_RUNS:
        assert np.array_equal(pair.local[0][local : local + n].numpy(), want[remote : remote + n])
    with pytest.raises(
        TransferError, match=r"Staging\(262144 bytes at 0x[0-9a-f]+, closed\) is closed: NIXL"
    ):
        nx.transfer(pair.agent, pair.name, m, strategy="staged", staging=staging)
    with pytest.raises(TransferError, match="is closed: NIXL no longer holds its region"):
        nx.prepare_stage(make_map(pair, "WRITE", UNIT_RUNS), staging)
    staging.close()  # again: nothing left to do


def test_a_peer_copy_whose_staging_buffer_closed_copies_nothing(pair: Pair) -> None:
    """A gather prepared, then its staging buffer closed: run() is refused by name, the
    buffer let go; notifs that are not a StageNotifs are a TypeError before any copy."""
    m = make_map(pair, "WRITE", UNIT_RUNS)
    staging = nx.Staging(pair.agent, BUF)
    staging.tensor.fill_(7)
    gather = nx.prepare_stage(m, staging)
    with pytest.raises(TypeError, match=r"^notifs must be a StageNotifs \(agent, poster, tag\), not bytes$"):
        gather.run(notifs=b"tag")  # type: ignore[arg-type]
    staging.close()
    with pytest.raises(
        nx.NixlError,
        match=r"^Staging\(262144 bytes at 0x[0-9a-f]+, closed\) was closed after this copy was prepared; "
        "nothing was copied$",
    ):
        gather.run()
    assert bool((staging.tensor == 7).all()) and "deregistered" in repr(staging.registered)


def test_a_request_dropped_without_release_lets_go_of_its_staging_buffer(pair: Pair) -> None:
    """A connector that abandons a prepared request (its KV request aborted, say) and drops
    it: the staging buffer was taken for good, every later staged request refused it. It
    is released at once where the collector runs on the agent's caller's thread, else by
    the agent's next request (NIXL is called on the caller's thread only:
    test_what_dropped_objects_held_is_let_go_of_on_the_caller_s_thread). A posted one dropped is left
    to finish, not cancelled."""
    m = make_map(pair, "READ", UNIT_RUNS)
    staging = nx.Staging(pair.agent, BUF)
    ahead = nx.prepare_transfer(pair.agent, pair.name, m, strategy="staged", staging=staging)
    assert staging.busy
    with pytest.warns(
        ResourceWarning,
        match=r"the READ to peer 'kvl-peer' \(staged, .*\) was prepared and dropped without release\(\); "
        "released$",
    ):
        del ahead
        gc.collect()
    assert not staging.busy  # collected on this thread, the agent's caller's
    assert (
        nx.transfer(pair.agent, pair.name, m, strategy="staged", staging=staging).wait(timeout=30).strategy
        == "staged"
    )
    # Posted and dropped, the request is not cancelled: its bytes land and its notif
    # arrives once the agent's next request has asked NIXL its state (NIXL's UCX backend
    # sends a notif held back at post only then; over UCX's TCP it always holds it back,
    # and moves the bytes only while the agent is driven).
    pair.peer.fill(pair.peer.seed)
    for t in pair.local:
        t.copy_(torch.from_numpy(np.random.default_rng(9).integers(0, 256, BUF, dtype=np.uint8)))
    with pytest.warns(ResourceWarning, match=r"was dropped before wait\(\): it is left to finish"):
        nx.transfer(pair.agent, pair.name, make_map(pair, "WRITE", UNIT_RUNS), notif=b"fire and forget")
        gc.collect()
    later = nx.transfer(pair.agent, pair.name, make_map(pair, "READ", UNIT_RUNS[:1]), notif=b"later")
    later.wait(timeout=30)
    assert sorted(pair.peer.notifs(expect=2)) == [b"fire and forget", b"later"]
    for _, i, _, j, n in UNIT_RUNS:
        assert np.array_equal(pair.peer.read(0, j, n), pair.local[0][i : i + n].numpy())
    pair.peer.fill(pair.peer.seed)
    staging.close()


@pytest.mark.parametrize(("op", "stages"), [("WRITE", 1), ("WRITE", 2), ("READ", 1)])
def test_a_staged_request_dropped_in_flight_frees_its_staging_buffer_once_nixl_reports_it_done(
    pair: Pair, op: str, stages: int
) -> None:
    """A staged request started and dropped before wait() is left to finish, its staging
    buffer busy meanwhile (a request through it waits for it). The agent's later
    requests ask NIXL its state; once NIXL reports it done (and, a pipeline, its gathers
    have run) its requests are released and the buffer is free again, not kept for good:
    the next staged request through it moves its own bytes, and the dropped one's bytes
    are where it put them (a WRITE's on the peer; a READ's landed in the buffer, never
    scattered here: nothing waits for it)."""
    rng = np.random.default_rng(zlib.crc32(f"dropped {op} {stages}".encode()))
    n = 4 * UNIT
    # both in buffer 0 here and there, apart: the dropped request's runs on odd slots, the next one's on even
    dropped = [(0, 2 * k * SLOT, 0, (2 * k + 1) * SLOT, n) for k in range(16)]
    later = [(0, (2 * k + 1) * SLOT, 0, 2 * k * SLOT, n) for k in range(16)]
    pair.peer.fill(pair.peer.seed)
    pair.peer.notifs(expect=0, wait=0)  # drop what earlier tests left
    for t in pair.local:
        t.copy_(torch.from_numpy(rng.integers(0, 256, BUF, dtype=np.uint8)))
    before = [t.clone() for t in pair.local]
    staging = nx.Staging(pair.agent, BUF)
    xfer = nx.transfer(
        pair.agent, pair.name, make_map(pair, op, dropped), strategy="staged", staging=staging,
        stages=stages, notif=b"dropped",
    )  # fmt: skip
    # what went: the stages posted so far (a pipeline's later ones go only when it is polled)
    posted = xfer.plan.remote[: xfer.plan.stages[xfer.posted - 1].descriptors[1]]
    with pytest.warns(ResourceWarning, match=r"was dropped before wait\(\): it is left to finish"):
        del xfer
        gc.collect()
    assert staging.busy and not staging.kept  # held, not kept for good: nothing asked NIXL since
    probe = make_map(pair, "READ", [(1, 0, 1, 0, UNIT)])  # a request of the agent: it asks the dropped one
    deadline = time.monotonic() + 30
    while staging.busy:
        assert time.monotonic() < deadline, f"{staging!r} was never let go of"
        nx.transfer(pair.agent, pair.name, probe, strategy="direct").wait(timeout=30)
    assert repr(staging) == f"Staging({BUF} bytes at {staging.address:#x})"
    xfer = nx.transfer(pair.agent, pair.name, make_map(pair, op, later), strategy="staged", staging=staging)
    assert xfer.wait(timeout=30).strategy == "staged" and not staging.busy
    peer = pair.peer.read(0)
    if op == "WRITE":
        seeded = contents(pair.peer.seed, 0, BUF)
        for _, i, _, j, k in dropped:  # a posted stage's runs landed; the others never went
            at = pair.peer.address(0, j)
            went = bool(((posted[:, 0] <= at) & (at + k <= posted[:, 0] + posted[:, 1])).any())
            want = before[0][i : i + k].numpy() if went else seeded[j : j + k]
            assert np.array_equal(peer[j : j + k], want), (op, i, j, went)
        assert stages > 1 or len(posted) == len(dropped)  # one stage: all of it went
        for _, i, _, j, k in later:
            assert np.array_equal(peer[j : j + k], before[0][i : i + k].numpy()), (op, i, j)
    else:
        seeded = contents(pair.peer.seed, 0, BUF)
        for _, i, _, j, k in later:  # the next request's bytes, scattered here
            assert np.array_equal(pair.local[0][i : i + k].numpy(), seeded[j : j + k]), (op, i, j)
        for _, i, _, _, k in dropped:  # the dropped one's, never scattered: as they were
            assert np.array_equal(pair.local[0][i : i + k].numpy(), before[0][i : i + k].numpy()), (op, i)
    pair.peer.notifs(expect=1, wait=0.3)
    staging.close()
    assert "deregistered" in repr(staging.registered)
    pair.peer.fill(pair.peer.seed)


@pytest.mark.parametrize("held", ["staging", "regions", "peer stagings"])
def test_a_request_collected_while_a_lock_it_releases_is_held_lets_go_after(pair: Pair, held: str) -> None:
    """A prepared request dropped in a reference cycle was released by the collector, on
    whatever thread allocates: one inside a staging buffer's, the agent's or the peer
    buffers' lock hung for good when the release waited for it. The agent's next call
    releases it, on the caller's thread, the lock free by then."""
    from kvlayout.transfer.nixl.holds import _PEER_STAGINGS_LOCK
    from kvlayout.transfer.nixl.regions import _REGIONS

    m = make_map(pair, "READ", UNIT_RUNS)
    staging = nx.Staging(pair.agent, BUF)
    cycle: list[Any] = [nx.prepare_transfer(pair.agent, pair.name, m, strategy="staged", staging=staging)]
    cycle.append(cycle)  # freed only by the cyclic collector
    del cycle
    lock = {
        "staging": staging._lock,
        "regions": _REGIONS[pair.agent].lock,
        "peer stagings": _PEER_STAGINGS_LOCK,
    }
    with pytest.warns(ResourceWarning, match="was prepared and dropped without release"):
        collect_holding(lock[held])
    assert staging.busy  # left for later: the lock was held
    assert nx.transfer(pair.agent, pair.name, m, strategy="staged", staging=staging).wait(
        timeout=30
    ).strategy == ("staged")
    staging.close()


class _Recording:
    """A real NIXL agent that notes each call made on it: its name, the calling thread
    and the arguments."""

    def __init__(self, agent: nx.Agent) -> None:
        self._agent = agent
        self.name = agent.name
        self.calls: list[tuple[str, int, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._agent, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, threading.get_ident(), args))
            return attr(*args, **kwargs)

        return call

    def called(self, name: str) -> list[Any]:
        """The first argument of each call of ``name`` so far."""
        return [args[0] for n, _, args in self.calls if n == name]


def test_what_dropped_objects_held_is_let_go_of_on_the_caller_s_thread(pair: Pair) -> None:
    """The collector runs finalizers on whichever thread allocates (kvlayout's copy thread
    among them), and letting go of what a dropped request, staging buffer or peer's copy
    held calls NIXL (release_xfer_handle, deregister_memory), which takes a default
    agent's calls from one thread at a time: the finalizers called it from the
    collector's thread, beside the caller's. They now leave it to the agent's next call:
    collected on the copy thread, nothing is called on the agent; the next request
    releases the unstarted request's NIXL requests and staging buffer, deregisters the
    dropped buffer and the closed one the peer's copy held, and asks the request dropped
    in flight its state until NIXL reports it done, then releases it; every call on the
    agent is on this thread. READs only: the peer's memory is left as it is."""
    from kvlayout.transfer.nixl.copies import _copier

    agent = _Recording(nx.make_agent("kvl-one-thread", progress_thread=False))
    name = agent.add_remote_agent(pair.peer.metadata)
    local = torch.zeros(BUF, dtype=torch.uint8)
    here, there, theirs = nx.local_side(local), pair.peer.side([0, 1]), pair.peer.read(1)

    def read(slots: range) -> Map:  # unit runs from peer buffer 1 into slots of ``local``
        rows = [(pair.peer.address(1, k * UNIT), local.data_ptr() + k * SLOT, UNIT) for k in slots]
        return Map(np.array(rows, U64), there, here)

    registered = nx.register(agent, local)
    taken, dropped, copied = nx.Staging(agent, BUF), nx.Staging(agent, 4096), nx.Staging(agent, BUF)
    regions = {s.address: s.registered.regions[0] for s in (dropped, copied)}
    gc.disable()  # collected below on the copy thread, not by an allocation here
    try:
        unstarted = nx.prepare_transfer(agent, name, read(range(0, 32)), strategy="staged", staging=taken)
        flying = nx.transfer(agent, name, read(range(32, 64)), strategy="direct")
        copy = nx.prepare_unstage(read(range(64, 96)), copied)
        copied.close()  # held by the copy: deregistered once it lets go
        handles, flown = list(unstarted.handles), list(flying.handles)
        assert handles and flown and taken.busy and copied.busy
        cycle: list[Any] = [unstarted, flying, dropped, copy]
        cycle.append(cycle)  # freed only by the cyclic collector
        del unstarted, flying, dropped, copy, cycle
        before = len(agent.calls)
        with pytest.warns(ResourceWarning) as caught:
            _copier().submit(gc.collect).result(timeout=30)
    finally:
        gc.enable()
    said = [str(w.message) for w in caught]
    assert any("was prepared and dropped without release(); the agent's next request" in m for m in said)
    assert any("was dropped before wait(): it is left to finish" in m for m in said)
    assert len(agent.calls) == before, agent.calls[before:]  # the collection called nothing
    assert taken.busy and copied.busy and len(held_regions(agent)) == 4  # all still held
    probe = nx.transfer(agent, name, read(range(96, 97)), strategy="direct")  # the next request
    assert set(handles) <= set(agent.called("release_xfer_handle")) and not taken.busy
    assert not copied.busy and len(held_regions(agent)) == 2  # local and taken
    assert len(agent.called("deregister_memory")) == 2
    assert set(flown) <= set(agent.called("check_xfer_state"))  # asked, so its notif goes
    probe.wait(timeout=30)
    deadline = time.monotonic() + 30
    while not set(flown) <= set(agent.called("release_xfer_handle")):
        assert time.monotonic() < deadline, "the request dropped in flight was never released"
        nx.transfer(agent, name, read(range(96, 97)), strategy="direct").wait(timeout=30)
    for k in range(32, 64):  # the one dropped in flight landed; the unstarted one moved nothing
        assert np.array_equal(local[k * SLOT : k * SLOT + UNIT].numpy(), theirs[k * UNIT : (k + 1) * UNIT])
    assert not local[: 32 * SLOT].any()
    assert {thread for _, thread, _ in agent.calls} == {threading.get_ident()}
    assert not set(regions.values()) & set(held_regions(agent))
    taken.close()
    registered.deregister()


def held_regions(agent: Any) -> dict[Any, int]:
    """The regions kvlayout holds registered on ``agent``, with their holders."""
    from kvlayout.transfer.nixl.regions import _REGIONS

    return _REGIONS[agent].count


def test_two_threads_waiting_on_one_request_release_it_once(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A strict agent's request waited for from two threads (a connector's poller and
    its caller): both saw it done and both released its NIXL requests, the second time
    freeing freed memory (a segfault). Now its polls and release take turns: each NIXL
    request is released once and both threads get the one result."""
    real_check, real_release = pair.agent.check_xfer_state, pair.agent.release_xfer_handle
    released: list[int] = []

    def check_slowly(handle: Any) -> str:  # a wide window: both waiters polling at once
        state = real_check(handle)
        time.sleep(0.01)
        return str(state)

    def release_once(handle: Any) -> None:
        released.append(id(handle))
        if released.count(id(handle)) == 1:  # never free one twice, whatever the code does
            real_release(handle)

    monkeypatch.setattr(pair.agent, "check_xfer_state", check_slowly)
    monkeypatch.setattr(pair.agent, "release_xfer_handle", release_once)
    m = make_map(pair, "READ", UNIT_RUNS)
    for _ in range(3):
        xfer = nx.transfer(pair.agent, pair.name, m, strategy="direct")
        results: list[Any] = []
        waiters = [
            threading.Thread(target=lambda x=xfer, got=results: got.append(x.wait(timeout=30)))
            for _ in range(2)
        ]
        for t in waiters:
            t.start()
        for t in waiters:
            t.join(60)
        assert len(results) == 2 and results[0] is results[1]
    assert len(released) == len(set(released)), "a NIXL request was released twice"


def test_a_request_prepared_ahead_posts_nothing_until_started(pair: Pair) -> None:
    """prepare_transfer plans, checks and makes the NIXL requests; nothing moves and the
    staging buffer is taken until start(), which posts exactly what transfer() would."""
    pair.peer.fill(pair.peer.seed)
    runs = [(0, k * SLOT, 0, 8 * SLOT + (k + k // 32) * UNIT, UNIT) for k in range(128)]  # 4 stretches there
    m = make_map(pair, "WRITE", runs)
    for t in pair.local:
        t.copy_(torch.from_numpy(contents(7, 0, BUF)))
    ahead = nx.prepare_transfer(pair.agent, pair.name, m, staging=pair.staging, notif=b"ahead", stages=2)
    assert (ahead.plan.strategy, ahead.posted, len(ahead.handles)) == ("staged", 0, 2) and pair.staging.busy
    with pytest.raises(TransferError, match=r"was prepared but not started: call start\(\) first"):
        ahead.wait(timeout=1)
    nothing_arrived(pair)
    ahead.start()
    assert ahead.wait(timeout=30).num_bytes == 128 * UNIT and not pair.staging.busy
    assert pair.peer.notifs(expect=1) == [b"ahead"]
    got = pair.peer.read(0)
    for _, src_off, _, dst_off, n in runs:
        assert np.array_equal(got[dst_off : dst_off + n], pair.local[0].numpy()[src_off : src_off + n])
    with pytest.raises(TransferError, match="was started already"):
        ahead.start()
    never = nx.prepare_transfer(pair.agent, pair.name, m, staging=pair.staging, notif=b"never")
    assert pair.staging.busy and never.release() and not pair.staging.busy
    pair.peer.fill(pair.peer.seed)
    nothing_arrived(pair)
    for t in pair.local:
        t.zero_()


def nothing_arrived(p: Pair) -> None:
    """The peer's memory as it was and no notification: nothing was posted."""
    for b in (0, 1):
        np.testing.assert_array_equal(p.peer.read(b), contents(p.peer.seed, b, BUF))
    assert p.peer.notifs(expect=1, wait=0.3) == []


BAD_ARGUMENTS = [
    ({"notif": 5}, TypeError, r"notif must be bytes \(or str\), not int \(5\)"),
    ({"cost": "fast"}, TypeError, "cost must be a CostModel"),
    ({"peer": 7}, TypeError, r"peer must be an agent name \(str, or bytes from add_remote_agent\), not 7"),
    ({"peer": "kvl-nobody"}, nx.NixlError,
     "agent 'kvl-local' holds no metadata of peer 'kvl-nobody': load it with add_remote_agent"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "error", "message"), BAD_ARGUMENTS)
def test_a_transfer_names_the_argument_it_cannot_use(
    pair: Pair, change: dict[str, object], error: type[Exception], message: str
) -> None:
    kw: dict[str, Any] = {"peer": pair.name, "notif": b"refused", **change}
    m = make_map(pair, "READ", [(0, 0, 0, 0, UNIT)])
    with pytest.raises(error, match=message):
        nx.transfer(pair.agent, kw.pop("peer"), m, **kw)
    assert b"refused" not in pair.peer.notifs(wait=0.5)  # nothing was posted


@pytest.mark.parametrize("timeout", [-1, float("nan"), "1", True, None])
def test_wait_takes_a_number_of_seconds(pair: Pair, timeout: object) -> None:
    xfer = nx.transfer(pair.agent, pair.name, make_map(pair, "READ", [(0, 0, 0, 0, UNIT)]))
    with pytest.raises(TypeError, match=r"timeout must be a non-negative number of seconds, got"):
        xfer.wait(timeout=timeout)  # type: ignore[arg-type]
    assert xfer.wait(timeout=30).num_bytes == UNIT  # the request is still there to wait for


def test_a_peer_description_that_lies_is_refused_before_posting(pair: Pair) -> None:
    # The peer describes buffer 2 whole but registered only its first half with NIXL.
    liar = pair.peer.side([0, 1, 2])
    here = nx.local_side(pair.local)
    inside = pair.peer.address(2, 0)
    lie = pair.peer.address(2, 40 << 10)
    runs = np.array(
        [
            (pair.local[0].data_ptr(), pair.peer.address(0, 0), 4096),
            (pair.local[0].data_ptr() + 4096, inside, 4096),
            (pair.local[0].data_ptr(), lie, 4096),
        ],
        dtype=U64,
    )
    with pytest.raises(
        nx.RefusedDescriptorError,
        match=r"remote descriptor 2 \(0x[0-9a-f]+, 4096 bytes\) is inside what peer 'kvl-peer' described but not inside memory it registered with NIXL.*refused before posting",
    ):
        nx.transfer(pair.agent, pair.name, Map(runs, here, liar), notif=b"lie", strategy="direct")
    with pytest.raises(
        nx.RefusedDescriptorError,
        match=r"described tensor 2 \(0x[0-9a-f]+, 65536 bytes\) is inside what peer 'kvl-peer' described but not inside memory it registered",
    ):
        nx.prep_lists(pair.agent, pair.name, here, liar, UNIT)
    # A map reaching past the tensors the peer described (buffer 1 is not in this description).
    narrow = pair.peer.side([0])
    runs = np.array(
        [
            (pair.local[0].data_ptr(), pair.peer.address(0, 0), 4096),
            (pair.local[0].data_ptr(), pair.peer.address(1, 0), 64),
        ],
        dtype=U64,
    )
    for strategy in ("direct", "staged"):
        with pytest.raises(
            nx.RefusedDescriptorError,
            match=r"remote run 1 \(0x[0-9a-f]+, 64 bytes\) is outside the 1 tensors peer 'kvl-peer' described",
        ):
            nx.transfer(
                pair.agent,
                pair.name,
                Map(runs, here, narrow),
                notif=b"lie",
                strategy=strategy,
                staging=pair.staging,
            )
    # Local memory this agent never registered.
    stray = torch.zeros(4096, dtype=torch.uint8)
    runs = np.array([(stray.data_ptr(), pair.peer.address(0, 0), 4096)], dtype=U64)
    with pytest.raises(
        nx.RefusedDescriptorError,
        match=r"local run 0 \(0x[0-9a-f]+, 4096 bytes\) is outside every region registered on agent 'kvl-local'",
    ):
        nx.transfer(pair.agent, pair.name, Map(runs, nx.local_side(stray), narrow), notif=b"lie")
    # The prepped lists cover only what was prepared: a run outside them is refused too.
    runs = np.array([(pair.local[0].data_ptr() + 100, pair.peer.address(0, 0), UNIT)], dtype=U64)
    with pytest.raises(
        nx.RefusedDescriptorError,
        match=r"local descriptor 0 \(0x[0-9a-f]+, 256 bytes\) is not whole 256-byte units",
    ):
        nx.transfer(pair.agent, pair.name, Map(runs, here, narrow), prepped=pair.prepped, notif=b"lie")
    nothing_arrived(pair)


def test_an_agent_posting_to_itself_prepares_lists_too() -> None:
    """NIXL's loopback: an agent holds no metadata of itself, so the peer's side is checked
    against the regions registered on it (it was refused as a description that lies)."""
    src = [torch.arange(2 * 16 * 32, dtype=torch.float32).view(2, 16, 4, 2, 4) for _ in range(2)]
    dst = [torch.zeros(2, 16, 4, 2, 4) for _ in range(2)]
    a, b = (kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"}) for kv in (src, dst))
    described = RegistrationDescription.from_json(b.describe().to_json())
    m = block_map(a, described, [1, 2], [3, 4])
    agent = nx.make_agent("kvl-self", progress_thread=False)
    with nx.register(agent, a):
        with pytest.raises(
            nx.RefusedDescriptorError, match="outside every region registered on agent 'kvl-self'"
        ):
            nx.prep_lists(agent, "kvl-self", m.src, m.dst, 128)  # dst is not registered yet
        with nx.register(agent, b):
            lists = nx.prep_lists(agent, "kvl-self", m.src, m.dst, 128)
            assert nx.transfer(agent, "kvl-self", m, prepped=lists).wait(timeout=30).num_bytes == m.num_bytes
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[:, 3:5], s[:, 1:3]) and not d[:, :3].any() and not d[:, 5:].any()


def test_a_transfer_takes_a_map() -> None:
    with pytest.raises(TypeError, match=r"expected a block map \(kvlayout.transfer.block_map\) .* not str"):
        nx.plan("runs")  # type: ignore[arg-type]


def test_a_tensor_without_memory_is_neither_registered_nor_described() -> None:
    """A freed tensor was registered as a region at address 0 of 0 bytes, a FakeTensor
    raised NIXL's bare backend error (or was described at address 0)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    agent = nx.make_agent("kvl-no-memory", progress_thread=False)
    freed = torch.zeros(1024, dtype=torch.uint8)
    freed.untyped_storage().resize_(0)
    with FakeTensorMode():
        fake = torch.zeros(1024)
    for t, problem in (
        (freed, "has no memory: its storage holds 0 bytes (freed, or resized to 0)"),
        (fake, "is a FakeTensor (torch._subclasses.fake_tensor), which has no memory"),
    ):
        for call in (lambda t=t: nx.register(agent, t), lambda t=t: nx.local_side(t)):
            with pytest.raises(TransferError) as err:
                call()
            assert str(err.value) == f"tensor 0 {problem}: NIXL moves the memory a tensor has"


def test_what_holds_no_memory_to_move_is_refused_before_nixl_sees_it() -> None:
    """Meta tensors, a registration of empty tensors, the sides given the other way round
    and a peer side of no memory are each refused by name (no NIXL call is made)."""
    agent = nx.make_agent("kvl-nothing", progress_thread=False)
    meta = torch.zeros(4, device="meta")
    for call in (lambda: nx.register(agent, meta), lambda: nx.local_side(meta)):
        with pytest.raises(
            TransferError, match=r"^NIXL moves DRAM \(cpu\) or VRAM \(cuda\) memory, not meta tensors$"
        ):
            call()
    with pytest.raises(
        TransferError,
        match=r"^the tensors are on 2 devices \(cpu, meta\); one side of a NIXL transfer is on one$",
    ):
        nx.local_side([torch.zeros(4), meta])
    with pytest.raises(
        TransferError, match=r"^the registration holds no memory to register \(every tensor is empty\)$"
    ):
        nx.register(agent, [torch.zeros(0), torch.zeros(0, 3)])
    reg = kvlayout.detect([torch.zeros(2, 3, 4, 2, 8) for _ in range(2)], "vllm")
    with pytest.raises(TransferError, match=r"^prep_lists takes the local side first, then the peer's$"):
        nx.prep_lists(agent, "kvl-nothing", reg, nx.local_side(reg), 64)
    nothing = nx.LocalSide("cpu", 0, np.zeros((0, 2), dtype=np.uint64), is_local=False)
    with pytest.raises(TransferError, match=r"^peer 'kvl-peer' described no memory to calibrate against$"):
        nx.calibrate(agent, "kvl-peer", nothing)


def test_register_makes_one_region_per_storage(pair: Pair) -> None:
    """vLLM layers cut from one pool are one region; separate tensors one each; a storage
    registered twice is counted; deregistering puts its memory out of reach."""
    nl, shape = 4, (2, 8, 4, 2, 16)  # NL x [2, NB, BS, NH, HS]
    per = int(np.prod(shape))
    pool = torch.zeros(nl * per, dtype=torch.bfloat16)
    reg = kvlayout.detect([pool[i * per : (i + 1) * per].view(shape) for i in range(nl)], "vllm")
    with nx.register(pair.agent, reg) as held:
        assert [(r.address, r.nbytes, r.mem_type, r.device) for r in held.regions] == [
            (pool.data_ptr(), pool.nbytes, "DRAM", 0)
        ]
        again = nx.register(pair.agent, reg.kernel_groups[0])
        assert again.regions == held.regions
        again.deregister()
        # still registered (held): a READ into it passes the local check and lands
        runs = np.array([(pair.peer.address(0, 0), pool.data_ptr(), 4096)], dtype=U64)
        m = Map(runs, pair.peer.side([0]), nx.local_side(reg))
        nx.transfer(pair.agent, pair.name, m, notif=b"pool").wait(timeout=30)
        np.testing.assert_array_equal(
            pool.view(torch.uint8)[:4096].numpy(), contents(pair.peer.seed, 0, 4096)
        )
    with pytest.raises(
        nx.RefusedDescriptorError, match="outside every region registered on agent 'kvl-local'"
    ):
        nx.transfer(pair.agent, pair.name, m)
    apart = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(nl)]
    with nx.register(pair.agent, kvlayout.detect(apart, "vllm")) as held:
        assert sorted(r.address for r in held.regions) == sorted(t.data_ptr() for t in apart)
    assert pair.peer.notifs() == [b"pool"]


def test_calibrate_takes_the_peer_s_description_and_checks_its_numbers(pair: Pair) -> None:
    """At the handshake a connector holds the peer's RegistrationDescription; bad numbers
    used to come back as a CostModel of zero bandwidth (a ZeroDivisionError when planning)
    or as ZeroDivisionError, ValueError or OverflowError from inside calibrate."""
    kv = kvlayout.detect([torch.zeros(2, 8, 4, 2, 16) for _ in range(2)], "vllm", {"kv_layout": "NHD"})
    desc = kv.describe(at=pair.peer.address(0))  # as if the peer's cache lay in its first buffer
    nbytes = np.int64(4096)  # a size from an array, as every int argument takes
    model = nx.calibrate(pair.agent, pair.name, desc, nbytes=nbytes, count=4, repeats=1)  # type: ignore[arg-type]
    assert model.bandwidth > 0 and model.source.startswith(  # each of the peer's tensors holds 8 KiB
        "calibrated against peer 'kvl-peer' (its largest described tensor holds 8192 bytes: no descriptors "
        "of 8 KiB, 32 KiB, 64 KiB, 128 KiB, 512 KiB priced (8, spaced, do not fit))"
    )  # then what noise left unmeasured, if any (4 KiB against 1 KiB: close)
    fewer = nx.calibrate(pair.agent, pair.name, desc, nbytes=4096, count=64, repeats=1)
    assert "holds 8192 bytes: 4 small descriptors, not 64; no descriptors of 8 KiB" in fewer.source
    for kw, message in (
        ({"nbytes": 0}, "calibrate's nbytes must be an int of at least 1024, got 0"),
        ({"small": 0}, "calibrate's small must be an int of at least 1, got 0"),
        ({"count": 1}, "calibrate's count must be an int of at least 2, got 1"),
        ({"repeats": 0}, "calibrate's repeats must be an int of at least 1, got 0"),
        ({"nbytes": -5}, "calibrate's nbytes must be an int of at least 1024, got -5"),
    ):
        with pytest.raises(TypeError) as err:
            nx.calibrate(pair.agent, pair.name, desc, **kw)  # type: ignore[arg-type]
        assert str(err.value) == message
    with pytest.raises(TypeError, match=r"remote must be the peer's side \(a RegistrationDescription, "):
        nx.calibrate(pair.agent, pair.name, object())  # type: ignore[arg-type]
    with pytest.raises(TransferError, match=r"^op must be 'READ' or 'WRITE', not 'PUT'$"):
        nx.calibrate(pair.agent, pair.name, desc, op="PUT")  # type: ignore[arg-type]


def test_calibrate_refuses_a_peer_tensor_its_small_descriptors_reach_past(pair: Pair) -> None:
    """A peer whose largest described tensor holds fewer bytes than the small descriptors
    reach (one of ``small`` bytes, two spaced ``2 * small`` apart): calibrate posted them
    past the tensor, a WRITE overwriting 2,040 bytes of the peer's memory it never
    described (its buffer was registered whole). Now refused before anything is posted."""
    tiny = kvlayout.detect([torch.zeros(2, 1, 1, 1, 16) for _ in range(2)], "vllm", {"kv_layout": "NHD"})
    desc = tiny.describe(at=pair.peer.address(0))  # 128-byte tensors in the peer's first buffer
    assert desc.tensor_spans[:, 1].tolist() == [128, 128]
    pair.peer.fill(pair.peer.seed)
    message = (
        r"^peer 'kvl-peer''s largest described tensor holds 128 bytes, fewer than calibrate's small descriptors "
        r"reach \(3072: small=1024 bytes, two of them 2 \* small apart\): pass a smaller small; nothing was "
        r"posted$"
    )
    with pytest.raises(TransferError, match=message):
        nx.calibrate(pair.agent, pair.name, desc, op="WRITE", count=4, repeats=1)
    with pytest.raises(
        TransferError, match=r"holds 128 bytes, fewer than calibrate's small descriptors reach \(129"
    ):
        nx.calibrate(pair.agent, pair.name, desc, small=43, count=4, repeats=1)
    nothing_arrived(pair)
    model = nx.calibrate(pair.agent, pair.name, desc, small=42, count=4, repeats=1)  # 126 bytes: inside
    assert (
        model.per_descriptor_by_size[0][0] == 42 and "holds 128 bytes: 128 bytes a transfer" in model.source
    )


def test_calibrate_measures_the_live_pair(pair: Pair) -> None:
    from kvlayout.transfer.nixl.regions import _REGIONS

    held = dict(_REGIONS[pair.agent].count)
    start = time.perf_counter()
    model = nx.calibrate(pair.agent, pair.name, pair.peer.side([0]), nbytes=512 << 10, count=128, repeats=1)
    took = time.perf_counter() - start
    assert model.source == (  # the peer's buffers hold 256 KiB
        "calibrated against peer 'kvl-peer' (its largest described tensor holds 262144 bytes: 262144 bytes a "
        "transfer, not 524288; no descriptors of 32 KiB, 64 KiB, 128 KiB, 512 KiB priced (8, spaced, do not fit))"
    )
    assert 0 < model.per_descriptor_s < 0.01 and model.bandwidth > 1e6
    # priced by size too: 1 KiB, then the larger sizes 8 or more of which fit (8 KiB does)
    sizes = [size for size, _ in model.per_descriptor_by_size]
    assert sizes[:2] == [1 << 10, 8 << 10] and sizes == sorted(sizes)
    assert model.per_descriptor_by_size[0][1] == model.per_descriptor_s
    assert all(0 <= cost < 0.01 for _, cost in model.per_descriptor_by_size)
    assert 0 < model.copy_per_run_s < 1e-3 and model.copy_bandwidth > 1e7
    # the copy both ways, each finite and bounded; a scatter is priced at its own figures
    per_run, bandwidth = model.scatter_per_run_s, model.scatter_bandwidth
    assert per_run is not None and bandwidth is not None  # measured, never left to the gather's
    assert all(math.isfinite(x) for x in (model.copy_per_run_s, model.copy_bandwidth, per_run, bandwidth))
    assert 0 < per_run < 1e-3 and 1e7 < bandwidth < 1e12
    assert model.copy_s(10, 1 << 20, scatters=True) == pytest.approx(10 * per_run + (1 << 20) / bandwidth)
    # a permuted map's copy over the plain one, both ways: measured, finite, within the clamp
    factors = model.transposed_factor, model.transposed_scatter_factor
    assert all(f is not None and math.isfinite(f) and 1e-3 <= f <= 1e3 for f in factors)
    # a plan's own work: the sort and the out-of-order check a run, a staged plan's beyond direct
    assert 0 < model.sort_per_run_s < 1e-5 and 0 <= model.unordered_check_per_run_s < 1e-5
    assert 0 < model.staged_plan_s < 0.01
    assert dict(_REGIONS[pair.agent].count) == held  # its scratch and the staging it planned with let go
    assert model.order_s(10, sorts=1, unordered_check=True) == pytest.approx(
        10 * (model.sort_per_run_s + model.unordered_check_per_run_s)
    )
    assert took < 10.0  # a handshake's worth (about a second on the loaded 2-core machine)
    # a cost model picks between strategies on its own figures
    m = make_map(pair, "READ", [(0, k * SLOT, 0, k * UNIT, UNIT) for k in range(64)])
    assert nx.plan(m, staging=pair.staging, cost=model).strategy in ("direct", "staged")


def test_calibrate_bounds_what_a_timing_contradicted_by_noise_cannot_say(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under load the one small descriptor took longer than many, and than 256 KiB in one:
    the differences were clamped to 1 ns, a descriptor priced at 1 ns and the wire at
    262 TB/s (3 PB/s against a 3 MiB tensor), said nowhere. Each is bounded by the
    larger timing alone, and the model's source says which. The first transfer to a peer
    connects (84 ms against 75 us after, in one run): it is not one of the timings, which
    with repeats=1 it had been (the small descriptor's)."""
    from kvlayout.transfer.nixl import calibration

    calls: list[int] = []

    def timed(agent: Any, op: str, peer: str, rows: tuple[np.ndarray, np.ndarray], *_: Any) -> float:
        local = rows[0]
        calls.append(len(local))
        if len(calls) == 1:
            return 10.0  # UCX connects
        if len(local) == 1:
            return 0.004 if int(local[0, 1]) == 1024 else 0.003  # one small: 4 ms; 256 KiB: 3 ms
        return 0.002 if len(local) == 128 else 0.001  # the 128 small ones: 2 ms

    monkeypatch.setattr(calibration, "_timed_xfer", timed)
    model = nx.calibrate(pair.agent, pair.name, pair.peer.side([0]), nbytes=256 << 10, count=128, repeats=1)
    assert calls[0] == 1 and model.per_transfer_s == 0.004
    assert model.per_descriptor_s == pytest.approx(0.002 / 128) and model.bandwidth == pytest.approx(
        (256 << 10) / 0.003
    )
    assert model.source.endswith(
        " (128 small descriptors took no longer than one (2000 us, one 4000 us): a descriptor priced at their "
        "time over their count) (262144 bytes took no longer than one small descriptor (3000 us, one 4000 us): "
        "the bandwidth is their bytes over that time)"
    )


@dataclass
class TcpPair:
    agent: nx.Agent
    peer: NixlPeer
    name: str
    local: torch.Tensor


TCP = tcp_tls()  # with cuda_copy on a GPU machine, where NIXL's UCX needs it to start


@pytest.fixture(scope="module")
def tcp_pair() -> Iterator[TcpPair]:
    """A second peer, over TCP alone: between processes of one machine UCX otherwise
    reads and writes the peer's memory by CMA (process_vm_readv), which needs nothing
    from the peer, so a stopped peer would not hold a transfer up."""
    with NixlPeer("kvl-tcp", [256 << 10], seed=2, env={"UCX_TLS": TCP}) as peer:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("UCX_TLS", TCP)  # read when the agent's UCX context starts
            agent = nx.make_agent("kvl-tcp-local", progress_thread=False)
        local = torch.zeros(256 << 10, dtype=torch.uint8)
        with nx.register(agent, local):
            yield TcpPair(agent, peer, agent.add_remote_agent(peer.metadata), local)


def tcp_read(p: TcpPair, offset: int = 0) -> Map:
    runs = np.array(
        [(p.peer.address(0, offset + k * SLOT), p.local.data_ptr() + k * SLOT, SLOT) for k in range(64)],
        dtype=U64,
    )
    return Map(runs, p.peer.side(), nx.local_side(p.local))


def test_an_agent_whose_ucx_cannot_start_names_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "no_such_transport")
    with pytest.raises(
        nx.NixlError,
        match=r"NIXL could not start the UCX backend of agent 'kvl-no-ucx' with UCX_TLS='no_such_transport': "
        r"UCX could not start on those transports alone\. On a machine with a GPU it needs cuda_copy among them",
    ):
        nx.make_agent("kvl-no-ucx", progress_thread=False)


def test_a_request_that_times_out_stays_in_flight_and_is_waited_for_again(tcp_pair: TcpPair) -> None:
    """A timeout says the request is still in flight (NIXL cannot guarantee a cancel: over
    TCP its bytes land later); waited for again once the peer goes on, it is done, its
    bytes there. It was reported cancelled, and a second wait returned a result for bytes
    that had not landed."""
    tcp_pair.local.zero_()
    tcp_pair.peer.pause()
    try:
        xfer = nx.transfer(tcp_pair.agent, tcp_pair.name, tcp_read(tcp_pair), notif=b"late")
        with pytest.raises(
            nx.NixlTimeoutError,
            match=r"the READ to peer 'kvl-tcp' \(direct, 64 descriptors, 131072 bytes\) was not done after 0.5 s; "
            r"it is still in flight: wait\(\) again, or release\(\) it\. NIXL cannot guarantee to cancel a request "
            r"under way: its bytes may still land .* do not free or reuse the memory it reads or writes",
        ):
            nx.wait(xfer, timeout=0.5)
        assert not tcp_pair.local.any()
    finally:
        tcp_pair.peer.resume()
    assert xfer.wait(timeout=30).num_bytes == 64 * SLOT
    np.testing.assert_array_equal(tcp_pair.local[: 64 * SLOT].numpy(), contents(2, 0, 256 << 10)[: 64 * SLOT])
    assert tcp_pair.peer.notifs() == [b"late"]
    result = nx.transfer(tcp_pair.agent, tcp_pair.name, tcp_read(tcp_pair, 1024), notif=b"again").wait(
        timeout=30
    )
    assert result.descriptors == 64
    np.testing.assert_array_equal(
        tcp_pair.local[: 64 * SLOT].numpy(), contents(2, 0, 256 << 10)[1024 : 1024 + 64 * SLOT]
    )
    assert tcp_pair.peer.notifs() == [b"again"]


def test_drain_waits_for_a_request_dropped_in_flight_until_its_timeout(tcp_pair: TcpPair) -> None:
    """A request dropped in flight is asked its state by the agent's next request; at
    shutdown there is none. drain(timeout) asks it until NIXL reports it over (its notif
    then goes, its NIXL requests are freed) and says how many are left when time runs out."""
    tcp_pair.local.zero_()
    tcp_pair.peer.pause()
    try:
        xfer = nx.transfer(tcp_pair.agent, tcp_pair.name, tcp_read(tcp_pair), notif=b"drained")
        with pytest.warns(ResourceWarning, match=r"was dropped before wait\(\): it is left to finish"):
            del xfer
            gc.collect()
        assert nx.drain(tcp_pair.agent, timeout=0.3) == 1  # the peer stopped: still in flight
        assert not tcp_pair.local.any()
    finally:
        tcp_pair.peer.resume()
    assert nx.drain(tcp_pair.agent, timeout=30) == 0
    np.testing.assert_array_equal(tcp_pair.local[: 64 * SLOT].numpy(), contents(2, 0, 256 << 10)[: 64 * SLOT])
    assert tcp_pair.peer.notifs() == [b"drained"]
    with pytest.raises(TypeError, match=r"^timeout must be a non-negative number of seconds, got -1$"):
        nx.drain(tcp_pair.agent, timeout=-1)


def test_a_pipeline_released_in_flight_keeps_its_staging_buffer_for_good(tcp_pair: TcpPair) -> None:
    """A staged READ of 4 stages to a stopped peer times out, still holding its staging
    buffer; released, it keeps the buffer busy (and registered, allocated) for good: NIXL
    may still land the bytes there, which a later request would scatter (the buffer was
    handed out again, and freed by calibrate). The next pipeline, on another buffer, is
    byte-exact."""
    spaced = Map(
        np.array(
            [
                (tcp_pair.peer.address(0, 2 * k * SLOT), tcp_pair.local.data_ptr() + k * SLOT, SLOT)
                for k in range(32)
            ],
            dtype=U64,
        ),
        tcp_pair.peer.side(),
        nx.local_side(tcp_pair.local),
    )
    staging = nx.Staging(tcp_pair.agent, 32 * SLOT)
    tcp_pair.peer.pause()
    try:
        xfer = nx.transfer(
            tcp_pair.agent, tcp_pair.name, spaced, strategy="staged", staging=staging, stages=4
        )
        assert len(xfer.handles) == 4 and staging.busy
        with pytest.raises(
            nx.NixlTimeoutError,
            match=r"the READ to peer 'kvl-tcp' \(staged, 32 descriptors, 65536 bytes, 4 stages\) was not done "
            r"after 0.5 s; it is still in flight",
        ):
            xfer.wait(timeout=0.5)
        assert staging.busy
        assert xfer.release()
        assert staging.busy and staging.kept and "kept for a request released in flight" in repr(staging)
        with pytest.raises(
            TransferError,
            match=r"Staging\(65536 bytes .*\) is kept for good: a request released in flight may still move "
            r"bytes through it; a staged transfer needs a new Staging",
        ):
            nx.prepare_transfer(tcp_pair.agent, tcp_pair.name, spaced, strategy="staged", staging=staging)
        staging.close()  # deferred for good: NIXL may still write it
        assert "live" in repr(staging.registered)
    finally:
        tcp_pair.peer.resume()
    tcp_pair.local.zero_()
    with nx.Staging(tcp_pair.agent, 32 * SLOT) as fresh:
        result = nx.transfer(
            tcp_pair.agent, tcp_pair.name, spaced, strategy="staged", staging=fresh, stages=4, notif=b"all"
        ).wait(timeout=30)
        assert (result.strategy, result.num_bytes) == ("staged", 32 * SLOT)
    peer_bytes = contents(2, 0, 256 << 10)
    want = np.concatenate([peer_bytes[2 * k * SLOT : (2 * k + 1) * SLOT] for k in range(32)])
    np.testing.assert_array_equal(tcp_pair.local[: 32 * SLOT].numpy(), want)
    assert tcp_pair.peer.notifs(expect=1) == [b"all"]  # once, after the last stage
    assert staging.busy and "live" in repr(staging.registered)


def test_memory_deregistered_under_a_request_in_flight_stays_registered_until_it_is_done(
    tcp_pair: TcpPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registered.deregister() while a started request posts through the memory: NIXL
    keeps the region (and kvlayout its tensors) until the request is done, as
    Staging.close() defers; a new request through it is refused at once. It was
    deregistered with NIXL under the request."""
    target = torch.zeros(64 * SLOT, dtype=torch.uint8)
    held = nx.register(tcp_pair.agent, target)
    dropped: list[object] = []
    real = tcp_pair.agent.deregister_memory

    def deregister_memory(reg: object) -> None:
        dropped.append(reg)
        real(reg)

    monkeypatch.setattr(tcp_pair.agent, "deregister_memory", deregister_memory)
    runs = np.array(
        [(tcp_pair.peer.address(0, k * SLOT), target.data_ptr() + k * SLOT, SLOT) for k in range(64)],
        dtype=U64,
    )
    m = Map(runs, tcp_pair.peer.side(), nx.local_side(target))
    tcp_pair.peer.pause()
    try:
        xfer = nx.transfer(tcp_pair.agent, tcp_pair.name, m, strategy="direct")
        held.deregister()
        assert "deregistered" in repr(held) and dropped == []
        with pytest.raises(nx.RefusedDescriptorError, match="outside every region registered on agent"):
            nx.transfer(tcp_pair.agent, tcp_pair.name, m)
    finally:
        tcp_pair.peer.resume()
    assert xfer.wait(timeout=30).num_bytes == 64 * SLOT and len(dropped) == 1
    np.testing.assert_array_equal(target.numpy(), contents(2, 0, 64 * SLOT))


def test_a_peer_that_dies_mid_transfer_fails_the_transfer(tcp_pair: TcpPair) -> None:
    tcp_pair.peer.pause()
    xfer = nx.transfer(tcp_pair.agent, tcp_pair.name, tcp_read(tcp_pair))
    tcp_pair.peer.kill()
    with pytest.raises(
        nx.NixlError,
        match=r"NIXL failed the READ to peer 'kvl-tcp' \(direct, 64 descriptors, 131072 bytes\): nixl\w*Error",
    ):
        xfer.wait(timeout=30)
    with pytest.raises(nx.NixlError, match=r"NIXL (failed|refused) the READ to peer 'kvl-tcp'"):
        nx.transfer(tcp_pair.agent, tcp_pair.name, tcp_read(tcp_pair)).wait(timeout=30)


class _ErrAgent:
    """NIXL's documented states, one of them "ERR", from a stand-in agent (a real one
    reports failures here as exceptions: see the test above)."""

    name = "stand-in"

    def __init__(self, states: list[str]) -> None:
        self.states = states
        self.released = 0

    def transfer(self, handle: object) -> str:
        return "PROC"

    def check_xfer_state(self, handle: object) -> str:
        return self.states.pop(0)

    def release_xfer_handle(self, handle: object) -> None:
        self.released += 1


def test_an_err_state_raises_and_releases() -> None:
    buf = torch.zeros(64, dtype=torch.uint8)
    side = nx.local_side(buf)
    there = nx.LocalSide("cpu", 0, side.tensor_spans, is_local=False)
    p = nx.plan(Map(np.array([(buf.data_ptr(), buf.data_ptr() + 32, 8)], dtype=U64), side, there))
    agent = _ErrAgent(["PROC", "ERR"])
    xfer = nx.Transfer(agent, "peer-x", p, [object()], staging=None)
    xfer.start()
    assert not xfer.done()
    with pytest.raises(
        nx.NixlError,
        match=r'NIXL failed the WRITE to peer \'peer-x\' \(direct, 1 descriptors, 8 bytes\): check_xfer_state returned "ERR"',
    ):
        xfer.wait(timeout=5)
    assert agent.released == 1


class _SlowAgent:
    """A stand-in agent whose request ``h`` reports "PROC" until asked ``h`` times."""

    name = "stand-in"

    def __init__(self) -> None:
        self.asked: dict[int, int] = {}
        self.released: list[int] = []

    def transfer(self, handle: int) -> str:
        return "PROC"

    def check_xfer_state(self, handle: int) -> str:
        self.asked[handle] = self.asked.get(handle, 0) + 1
        return "DONE" if self.asked[handle] >= handle else "PROC"

    def release_xfer_handle(self, handle: int) -> None:
        self.released.append(handle)

    def get_xfer_telemetry(self, handle: int) -> None:
        raise _NoTelemetryError("telemetry is not captured")


class _NoTelemetryError(Exception):
    """NIXL's error for a request's telemetry where none is captured."""

    __module__ = "nixl._bindings"


def test_a_request_dropped_in_flight_is_asked_its_state_by_the_agent_s_next_requests() -> None:
    """NIXL's UCX backend sends a request's notif when it is asked its state once done
    (where its bytes were not done at post: over UCX's TCP, always), and nothing asked a
    request dropped before wait(): its notif never reached the peer. The agent's next
    requests ask each of its posted stages, on their thread, until every one is done,
    then free its NIXL requests; a request of another agent is not asked."""
    buf = torch.zeros(64, dtype=torch.uint8)
    side = nx.local_side(buf)
    there = nx.LocalSide("cpu", 0, side.tensor_spans, is_local=False)
    p = nx.plan(Map(np.array([(buf.data_ptr(), buf.data_ptr() + 32, 8)], dtype=U64), side, there))
    agent, other = _SlowAgent(), _SlowAgent()
    dropped, elsewhere = nx.Transfer(agent, "peer-x", p, [1, 3]), nx.Transfer(other, "peer-x", p, [9])
    dropped.start()  # two stages posted: the first done at its first ask, the second at its third
    elsewhere.start()
    with pytest.warns(ResourceWarning, match=r"was dropped before wait\(\): it is left to finish"):
        del dropped, elsewhere
        gc.collect()
    assert agent.asked == {} and agent.released == []
    later = nx.Transfer(agent, "peer-x", p, [2])
    later.start()
    assert not later.done()  # asks both stages of the dropped request, and its own
    assert agent.asked == {1: 1, 3: 1, 2: 1} and agent.released == []  # a stage in flight: kept
    later.wait(timeout=5)
    assert agent.asked == {1: 2, 3: 2, 2: 2} and agent.released == [2]
    again = nx.Transfer(agent, "peer-x", p, [5])
    again.start()
    again.wait(timeout=5)  # its first poll finds the dropped request done: freed, then never asked again
    assert agent.asked == {1: 3, 3: 3, 2: 2, 5: 5}
    assert sorted(agent.released) == [1, 2, 3, 5]
    assert other.asked == {} and other.released == []


def prepare_at_once(
    agents: list[nx.Agent], names: list[bytes], m: Map, strategy: str, staging: nx.Staging
) -> list[nx.Transfer | TransferError]:
    """prepare_transfer of ``m`` on each agent at once, a thread each: what each got."""
    barrier, got = threading.Barrier(len(agents)), list[nx.Transfer | TransferError]()

    def prepare(k: int) -> None:
        barrier.wait()
        try:
            got.append(nx.prepare_transfer(agents[k], names[k], m, strategy=strategy, staging=staging))  # type: ignore[arg-type]
        except TransferError as exc:
            got.append(exc)

    threads = [threading.Thread(target=prepare, args=(k,)) for k in range(len(agents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def test_two_threads_never_both_take_one_staging_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads, each with its own agent, prepare staged requests through one Staging
    at once: one takes it, the other is refused ("staged") or goes direct ("auto"). The
    buffer was checked free when a request began and taken when it ended (after the
    plan), so both took it, and a staged WRITE went out with the other's bytes."""
    from kvlayout.transfer.nixl import posting

    agents = [nx.make_agent(f"kvl-race-{k}", progress_thread=False) for k in range(2)]
    target = nx.make_agent("kvl-race-peer")
    src, dst = torch.zeros(BUF, dtype=torch.uint8), torch.zeros(BUF, dtype=torch.uint8)
    staging = nx.Staging(agents[0], BUF)
    held = [nx.register(a, src) for a in agents] + [
        nx.register(agents[1], staging.tensor),
        nx.register(target, dst),
    ]
    names = [a.add_remote_agent(target.get_agent_metadata()) for a in agents]
    there = nx.LocalSide("cpu", 0, nx.local_side(dst).tensor_spans, is_local=False)
    runs = np.array([(src.data_ptr() + k * SLOT, dst.data_ptr() + k * UNIT, UNIT) for k in range(128)], U64)
    m = Map(runs, nx.local_side(src), there)  # 128 runs here, one stretch there: "auto" stages it

    def slow_plan(*args: Any, **kw: Any) -> nx.Plan:  # between checking the buffer free and taking it
        time.sleep(0.3)
        return nx.plan(*args, **kw)

    monkeypatch.setattr(posting, "plan", slow_plan)
    for strategy in ("staged", "auto"):
        got = prepare_at_once(agents, names, m, strategy, staging)
        took = [g for g in got if isinstance(g, nx.Transfer) and g.plan.strategy == "staged"]
        assert len(got) == 2 and len(took) == 1, got
        other = next(g for g in got if g is not took[0])
        if strategy == "staged":
            assert isinstance(other, TransferError) and "is in use by another request" in str(other)
        else:
            assert isinstance(other, nx.Transfer) and other.plan.strategy == "direct"
        for g in got:
            if isinstance(g, nx.Transfer):
                g.release()
        assert not staging.busy
    staging.close()
    for h in held:
        h.deregister()


def test_a_unit_larger_than_every_stretch_is_named(pair: Pair) -> None:
    """NIXL refused the empty list with a bare nixlNotFoundError."""
    with pytest.raises(
        TransferError,
        match=r"unit 1048576 is larger than every stretch of local memory \(the largest is 262144 bytes\)",
    ):
        nx.prep_lists(pair.agent, pair.name, nx.local_side(pair.local), pair.peer.side([0, 1]), 4 * BUF)


def test_prep_lists_takes_what_the_handshake_holds(pair: Pair) -> None:
    """A registration (or tensors) for this side; anything else is a TypeError that says
    what to pass, not an AttributeError from inside."""
    lists = nx.prep_lists(pair.agent, pair.name, pair.local, pair.peer.side([0, 1]), UNIT)
    assert lists.local.size == pair.prepped.local.size - BUF // UNIT  # the same, without the staging buffer
    with pytest.raises(
        TypeError, match=r"prep_lists takes for the remote side the peer's RegistrationDescription"
    ):
        nx.prep_lists(pair.agent, pair.name, pair.local, {"tensors": []}, UNIT)  # type: ignore[arg-type]


def test_prepped_lists_are_released_once_and_refused_after(pair: Pair) -> None:
    """prep_xfer_dlist's lists were never released: a connector preparing them per peer at
    each handshake piled them up. release() releases both, once, on this thread; a
    request made from them before still moves its bytes (NIXL copied its descriptors when
    it made it), and one given them after is refused by name, nothing posted."""
    agent = _Recording(nx.make_agent("kvl-prepped-release", progress_thread=False))
    name = agent.add_remote_agent(pair.peer.metadata)
    local = torch.zeros(BUF, dtype=torch.uint8)
    there = pair.peer.side([0, 1])
    rows = [(pair.peer.address(1, k * UNIT), local.data_ptr() + k * SLOT, UNIT) for k in range(32)]
    m = Map(np.array(rows, U64), there, nx.local_side(local))
    with nx.register(agent, local):
        lists = nx.prep_lists(agent, name, local, there, UNIT)
        handles = [lists.local.handle, lists.remote.handle]
        made = nx.prepare_transfer(agent, name, m, strategy="direct", prepped=lists)
        lists.release()
        assert agent.called("release_dlist_handle") == handles and lists.released
        assert all("released=True" in repr(h) for h in handles)  # NIXL's own record
        lists.release()  # once: a second call does nothing
        lists.local.release()
        assert agent.called("release_dlist_handle") == handles
        made.start()
        made.wait(timeout=30)
        theirs = pair.peer.read(1)
        for k in range(32):
            assert np.array_equal(
                local[k * SLOT : k * SLOT + UNIT].numpy(), theirs[k * UNIT : (k + 1) * UNIT]
            )
        with pytest.raises(
            TransferError,
            match=rf"^the lists prepared for peer '{name.decode()}' were released \(Prepped.release\(\)\): prepare them "
            "again with prep_lists; nothing was posted$",
        ):
            nx.transfer(agent, name, m, strategy="direct", prepped=lists)
        with pytest.raises(
            TransferError, match=r"PreppedList\(\d+ units of 256 bytes, DRAM, released\) was released"
        ):
            lists.remote.handle  # noqa: B018
        assert nx.drain(agent) == 0
    assert {thread for _, thread, _ in agent.calls} == {threading.get_ident()}
    agent.remove_remote_agent(name)


def test_prepped_lists_are_released_after_the_peer_left_and_at_a_with_block_s_end(pair: Pair) -> None:
    """A peer that left may have had its metadata removed before its lists are released
    (vLLM releases first, a connector told of a dead peer may not): releasing then is
    safe (NIXL frees the list it made, whatever the peer), and the next handshake
    prepares anew."""
    agent = _Recording(nx.make_agent("kvl-prepped-left", progress_thread=False))
    local = torch.zeros(BUF, dtype=torch.uint8)
    there = pair.peer.side([0, 1])
    with nx.register(agent, local):
        name = agent.add_remote_agent(pair.peer.metadata)
        with nx.prep_lists(agent, name, local, there, UNIT) as lists:
            agent.remove_remote_agent(name)
        assert lists.released and len(agent.called("release_dlist_handle")) == 2
        name = agent.add_remote_agent(pair.peer.metadata)  # the peer back: prepared again
        with nx.prep_lists(agent, name, local, there, UNIT) as again:
            assert again.remote.size == lists.remote.size and not again.released
        assert len(agent.called("release_dlist_handle")) == 4
        agent.remove_remote_agent(name)


def test_prepped_lists_dropped_are_released_on_the_caller_s_thread_or_by_drain(pair: Pair) -> None:
    """Dropped unreleased, the lists are released as other dropped objects are: at once
    where the collector runs on the agent's caller's thread, else (kvlayout's copy thread)
    left to the agent, which holds them, and its progress thread, until its next call or
    drain(); never released on the collector's thread (NIXL's own handle would have, from
    its __del__)."""
    from kvlayout.transfer.nixl.copies import _copier

    agent = _Recording(nx.make_agent("kvl-prepped-drop", progress_thread=False))
    name = agent.add_remote_agent(pair.peer.metadata)
    local = torch.zeros(BUF, dtype=torch.uint8)
    there = pair.peer.side([0, 1])
    with nx.register(agent, local):
        lists = nx.prep_lists(agent, name, local, there, UNIT)
        handles = [lists.local.handle, lists.remote.handle]
        del lists
        gc.collect()
        assert agent.called("release_dlist_handle") == handles  # collected here: released at once
        lists = nx.prep_lists(agent, name, local, there, UNIT)
        handles = [lists.local.handle, lists.remote.handle]
        gc.disable()  # collected below on the copy thread, not by an allocation here
        try:
            cycle: list[Any] = [lists]
            cycle.append(cycle)  # freed only by the cyclic collector
            del lists, cycle
            before = len(agent.calls)
            _copier().submit(gc.collect).result(timeout=30)
        finally:
            gc.enable()
        assert len(agent.calls) == before and not any("released=True" in repr(h) for h in handles)
        assert nx.drain(agent) == 0  # done now, on this thread
        assert agent.called("release_dlist_handle")[-2:] == handles
        assert all("released=True" in repr(h) for h in handles)
        assert nx.drain(agent) == 0 and len(agent.called("release_dlist_handle")) == 4
    assert {thread for _, thread, _ in agent.calls} == {threading.get_ident()}
    agent.remove_remote_agent(name)


def test_prepped_lists_serve_only_the_agent_that_prepared_them(pair: Pair) -> None:
    """A prepared list is NIXL's record on the agent that made it, naming that agent's
    memory keys: another agent given it made a request from it and moved the bytes (NIXL
    does not check), which the first agent's release or end would have left dangling. A
    list of no handle (the indexing alone) was an AttributeError inside NIXL, and one list
    given as both sides hung the request on its own lock. Each is now refused by name,
    nothing posted, and a timeout past any float waits for good, as inf does."""
    threads = len(os.listdir("/proc/self/task"))
    other = nx.make_agent("kvl-prepped-other", progress_thread=False)
    name = other.add_remote_agent(pair.peer.metadata)
    there = pair.peer.side([0, 1])
    rows = [(pair.peer.address(1, k * UNIT), pair.local[0].data_ptr() + k * SLOT, UNIT) for k in range(4)]
    m = Map(np.array(rows, U64), there, nx.local_side(pair.local))
    before = pair.local[0][: 4 * SLOT].clone()
    try:
        with nx.register(other, pair.local):
            with pytest.raises(
                TransferError,
                match=r"^the local prepped list PreppedList\(\d+ units of 256 bytes, DRAM\) was prepared by agent "
                "'kvl-local', not by 'kvl-prepped-other', which posts this request: prepare the lists on it",
            ):
                nx.transfer(other, name, m, strategy="direct", prepped=pair.prepped)
            bare = nx.PreppedList(None, UNIT, pair.prepped.local.starts, pair.prepped.local.counts, "DRAM")
            with pytest.raises(TransferError, match=r"^the local prepped list .* is the indexing alone"):
                nx.transfer(pair.agent, pair.name, m, strategy="direct",
                            prepped=nx.Prepped(pair.prepped.peer, bare, pair.prepped.remote))  # fmt: skip
            with pytest.raises(TypeError, match=r"^Prepped's local and remote lists are one list"):
                nx.Prepped(pair.prepped.peer, pair.prepped.remote, pair.prepped.remote)
            assert torch.equal(pair.local[0][: 4 * SLOT], before)  # nothing moved
            assert nx.drain(other, timeout=10**400) == 0  # nothing left: returns at once
        other.remove_remote_agent(name)
    finally:
        ref = weakref.ref(other)
        del other
        gc.collect()
    assert ref() is None and len(os.listdir("/proc/self/task")) == threads


def test_prepped_lists_released_in_part_are_refused_and_queue_nothing_dropped(pair: Pair) -> None:
    """One list released (PreppedList.release()) makes the pair released: a request is
    refused before any is made. Released lists dropped where the collector runs on another
    thread (kvlayout's copy thread) queue nothing: there is nothing left to release, and an
    entry would hold the agent, and its progress thread, until its next call."""
    from kvlayout.transfer.nixl.copies import _copier
    from kvlayout.transfer.nixl.regions import _DEFERRED

    agent = _Recording(nx.make_agent("kvl-prepped-part", progress_thread=False))
    name = agent.add_remote_agent(pair.peer.metadata)
    local = torch.zeros(BUF, dtype=torch.uint8)
    there = pair.peer.side([0, 1])
    rows = [(pair.peer.address(1, k * UNIT), local.data_ptr() + k * SLOT, UNIT) for k in range(4)]
    m = Map(np.array(rows, U64), there, nx.local_side(local))
    with nx.register(agent, local):
        lists = nx.prep_lists(agent, name, local, there, UNIT)
        lists.remote.release()
        assert lists.released and not lists.local.released
        with pytest.raises(TransferError, match=r"^the lists prepared for peer .* were released \(Prepped"):
            nx.prepare_transfer(agent, name, m, strategy="direct", prepped=lists)
        assert not agent.called("make_prepped_xfer")
        lists.release()
        gc.disable()  # collected below on the copy thread, not by an allocation here
        try:
            cycle: list[Any] = [lists]
            cycle.append(cycle)  # freed only by the cyclic collector
            del lists, cycle
            _copier().submit(gc.collect).result(timeout=30)
        finally:
            gc.enable()
        assert not [a for a, _ in _DEFERRED if a is agent]
        assert len(agent.called("release_dlist_handle")) == 2
    agent.remove_remote_agent(name)


class _RefusingPeerList(_Recording):
    """A recording agent whose ``prep_xfer_dlist`` refuses the peer's list."""

    def __getattr__(self, name: str) -> Any:
        call = super().__getattr__(name)
        if name != "prep_xfer_dlist":
            return call

        def refusing(list_name: Any, *args: Any) -> Any:
            if list_name != "NIXL_INIT_AGENT":
                raise RuntimeError("the peer's list refused")
            return call(list_name, *args)

        return refusing


def test_prep_lists_leaves_no_list_prepared_when_the_peer_s_is_refused(pair: Pair) -> None:
    """The local list is prepared first: the peer's refused after it, the local one is
    released at once (not left to NIXL until the agent ends), and the error is the peer's."""
    agent = _RefusingPeerList(nx.make_agent("kvl-prepped-refused", progress_thread=False))
    name = agent.add_remote_agent(pair.peer.metadata)
    local = torch.zeros(BUF, dtype=torch.uint8)
    with nx.register(agent, local):
        with pytest.raises(RuntimeError, match=r"^the peer's list refused$") as refused:
            nx.prep_lists(agent, name, local, pair.peer.side([0, 1]), UNIT)
        # released by prep_lists, not by the list's finalizer: the traceback still holds the list
        made = [c for c in agent.calls if c[0] == "prep_xfer_dlist"]
        assert len(made) == 1 and len(agent.called("release_dlist_handle")) == 1
        assert "released=True" in repr(agent.called("release_dlist_handle")[0])
        del refused
    agent.remove_remote_agent(name)


class _Gated(_Recording):
    """A recording agent whose ``make_prepped_xfer`` waits for ``go`` once it has begun."""

    def __init__(self, agent: nx.Agent) -> None:
        super().__init__(agent)
        self.entered, self.go = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        call = super().__getattr__(name)
        if name != "make_prepped_xfer":
            return call

        def gated(*args: Any) -> Any:
            self.entered.set()
            assert self.go.wait(timeout=30)
            return call(*args)

        return gated


def test_prepped_lists_released_while_a_request_is_made_from_them_wait_for_it(pair: Pair) -> None:
    """release() on another thread while a request is being made from the lists waits
    until it is made (NIXL reads the list then), then releases each list once, whichever
    of several threads releasing at once does it."""
    agent = _Gated(nx.make_agent("kvl-prepped-race", progress_thread=False))
    threads = len(os.listdir("/proc/self/task"))
    name = agent.add_remote_agent(pair.peer.metadata)
    local = torch.zeros(BUF, dtype=torch.uint8)
    there = pair.peer.side([0, 1])
    rows = [(pair.peer.address(1, k * UNIT), local.data_ptr() + k * SLOT, UNIT) for k in range(8)]
    m = Map(np.array(rows, U64), there, nx.local_side(local))
    with nx.register(agent, local):
        lists = nx.prep_lists(agent, name, local, there, UNIT)
        made: list[Any] = []
        maker = threading.Thread(
            target=lambda: made.append(nx.prepare_transfer(agent, name, m, strategy="direct", prepped=lists))
        )
        maker.start()
        assert agent.entered.wait(timeout=30)
        start = threading.Barrier(4)

        def release() -> None:
            start.wait(timeout=30)
            lists.release()

        releasers = [threading.Thread(target=release) for _ in range(4)]
        for t in releasers:
            t.start()
        time.sleep(0.2)
        assert not agent.called("release_dlist_handle") and not lists.released  # waiting for the request
        agent.go.set()
        for t in (maker, *releasers):
            t.join(timeout=30)
            assert not t.is_alive()
        names = [n for n, _, _ in agent.calls]
        assert names.count("release_dlist_handle") == 2 and lists.released
        assert names.index("make_prepped_xfer") < names.index("release_dlist_handle")
        made[0].start()  # made before the release: still moves its bytes
        made[0].wait(timeout=30)
        theirs = pair.peer.read(1)
        for k in range(8):
            assert np.array_equal(
                local[k * SLOT : k * SLOT + UNIT].numpy(), theirs[k * UNIT : (k + 1) * UNIT]
            )
        assert nx.drain(agent) == 0
    agent.remove_remote_agent(name)
    assert len(os.listdir("/proc/self/task")) == threads  # the threads made here are gone


def test_stage_announcing_to_a_poster_never_loaded_is_refused_before_copying(pair: Pair) -> None:
    """The peer's gather, paced by notifications to a poster whose metadata it never
    loaded: a NixlError naming both agents, nothing copied (it was a bare
    nixlNotFoundError from send_notif, after the first gather)."""
    m = make_map(pair, "WRITE", UNIT_RUNS)
    pair.staging.tensor.fill_(7)
    notifs = nx.StageNotifs(pair.agent, "kvl-nobody", b"tag")
    with pytest.raises(
        nx.NixlError,
        match=r"agent 'kvl-local' holds no metadata of peer 'kvl-nobody', the poster .* nothing was copied",
    ):
        nx.stage(m, pair.staging, stages=2, notifs=notifs)
    assert bool((pair.staging.tensor == 7).all())


def test_a_peer_staging_buffer_the_peer_never_registered_is_named_as_such(pair: Pair) -> None:
    """It was refused as a remote descriptor "inside what peer described", which the
    staging buffer is not part of."""
    m = make_map(pair, "WRITE", [(0, 0, 0, 0, UNIT)])
    unregistered = nx.PeerStaging(pair.peer.address(2, 40 << 10), 8 << 10)  # buffer 2's unregistered half
    with pytest.raises(
        nx.RefusedDescriptorError,
        match=r"remote descriptor 0 \(0x[0-9a-f]+, 256 bytes\) is inside the staging buffer peer 'kvl-peer' named "
        r"\(PeerStaging\) but not inside memory it registered with NIXL",
    ):
        nx.transfer(pair.agent, pair.name, m, strategy="peer-staged", peer_staging=unregistered)


def test_make_agent_refuses_a_sync_mode_nixl_has_not() -> None:
    with pytest.raises(
        TypeError, match=r"sync_mode must be one of 'none', 'strict', 'rw', 'default' or None"
    ):
        nx.make_agent("kvl-bad-sync", sync_mode="locked")  # type: ignore[arg-type]


# -- what would crash this process runs in a child -----------------------------------------

CHILD = """
import faulthandler, logging, os, re, time
faulthandler.dump_traceback_later(CHILD_LIMIT_S, exit=True)
import numpy as np, torch
from dataclasses import dataclass
from kvlayout.testing.nixl_peer import NixlPeer, contents
from kvlayout.transfer import TransferError
from kvlayout.transfer import nixl as nx
logging.getLogger("nixl").setLevel(logging.WARNING)
U64 = np.uint64

@dataclass(frozen=True)
class Map:
    runs: np.ndarray
    src: object
    dst: object

def expect(error, pattern, call, *args, **kw):
    try:
        call(*args, **kw)
    except error as exc:
        assert re.search(pattern, str(exc)), f"{type(exc).__name__}: {exc}"
        return exc
    raise AssertionError(f"{call.__name__} raised no {error.__name__}")

def peer_read(peer, local, first, count, size=4096, spaced=1):
    runs = [(peer.address(0, spaced * k * size), local.data_ptr() + (first + k) * size, size) for k in range(count)]
    return Map(np.array(runs, U64), peer.side(), nx.local_side(local))
"""
CHILD_LIMIT_S = 100


def run_child(code: str) -> str:
    """Run ``code`` after :data:`CHILD` in a new interpreter over TCP alone (a crash there
    fails the test, not pytest); its stdout, where it printed "ok" at its end (UCX may warn after)."""
    script = CHILD.replace("CHILD_LIMIT_S", str(CHILD_LIMIT_S)) + textwrap.dedent(code) + '\nprint("ok")\n'
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", script],
        env={**os.environ, "UCX_TLS": TCP},
        capture_output=True,
        text=True,
        timeout=CHILD_LIMIT_S + 20,
        check=False,
    )
    assert done.returncode == 0 and "ok" in done.stdout.splitlines(), (
        f"the child ended with {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


def test_an_interrupt_while_the_copy_thread_starts_leaves_nothing_to_wait_for_at_exit() -> None:
    """Ctrl-C landing while a staged request's submit started the copy thread (in
    Thread.start, before the pool listed the thread) left a thread nothing at exit would
    wake: the interpreter waited for it for good (1 run in 21 of SIGINT at random times
    during a staged WRITE). The thread starts when the pool is made; interrupted there,
    the pool is shut down, and the next request makes another."""
    run_child(
        """
        import threading
        from kvlayout.transfer.nixl import copies
        start = threading.Thread.start
        def interrupted(self):
            start(self)
            if self.name.startswith("kvlayout-nixl-copy"):
                raise KeyboardInterrupt  # as if SIGINT landed in its _started.wait()
        threading.Thread.start = interrupted
        try:
            copies._copier().submit(int).result()
        except KeyboardInterrupt:
            pass
        threading.Thread.start = start
        assert copies._copier().submit(int, "7").result() == 7
        """
    )


def test_a_request_released_or_failed_never_hands_nixl_its_freed_requests() -> None:
    """Once released (prepared or in flight) or failed, start(), done() and wait() raise
    why. They handed NIXL the freed requests: start() after release() crashed, wait()
    after release() and a second wait() after a timeout reported bytes that had not
    landed, and wait() after a start() that failed on a dead peer crashed."""
    run_child(
        """
        peer = NixlPeer("kvl-child-peer", [1 << 20], seed=3, env={"UCX_TLS": os.environ["UCX_TLS"]}, timeout=30)
        agent = nx.make_agent("kvl-child", progress_thread=False)
        name = agent.add_remote_agent(peer.metadata)
        local = torch.zeros(1 << 20, dtype=torch.uint8)
        held = nx.register(agent, local)
        ahead = nx.prepare_transfer(agent, name, peer_read(peer, local, 0, 64), strategy="direct")
        assert ahead.release()
        for call in (ahead.start, ahead.done, ahead.wait):
            expect(TransferError, r"was released before it was started \\(nothing was posted\\): prepare it again", call)
        peer.pause()
        given_up = nx.transfer(agent, name, peer_read(peer, local, 0, 64), strategy="direct")
        expect(nx.NixlTimeoutError, r"still in flight: wait\\(\\) again, or release\\(\\) it", given_up.wait, 0.3)
        given_up.release()
        for call in (given_up.wait, given_up.done, given_up.start):
            expect(TransferError, r"was released in flight: NIXL was asked to cancel it\\. NIXL cannot guarantee", call)
        later = nx.transfer(agent, name, peer_read(peer, local, 128, 64), strategy="direct")
        expect(nx.NixlTimeoutError, "still in flight", later.wait, 0.3)
        peer.resume()
        assert later.wait(30).num_bytes == 64 * 4096
        assert np.array_equal(local[128 * 4096 : 192 * 4096].numpy(), contents(3, 0, 64 * 4096))
        doomed = nx.prepare_transfer(agent, name, peer_read(peer, local, 192, 64), strategy="direct")
        peer.kill()
        try:
            doomed.start()
            doomed.wait(30)
            raise AssertionError("a request to a dead peer went through")
        except nx.NixlError as exc:
            assert "NIXL failed the READ" in str(exc), exc
        for call in (doomed.wait, doomed.done, doomed.start):
            expect(nx.NixlError, r"failed and was released \\(NIXL failed the READ .*\\); post the request again", call)
        expect(nx.NixlError, r"NIXL (failed|refused) a calibration READ with peer 'kvl-child-peer': nixl\\w+Error",
               nx.calibrate, agent, name, peer.side(), nbytes=64 << 10, count=8, repeats=1, timeout=10)
        """
    )


def test_memory_a_timed_out_request_may_still_write_is_never_freed_or_handed_out() -> None:
    """Over TCP a READ released in flight still lands. Its staging buffer stays busy,
    registered and allocated for good (it was handed to the next staged request, and
    the late bytes landed in it), and calibrate() keeps the scratch buffer of a
    calibration that timed out (it freed it, and the bytes landing there crashed the
    next transfer)."""
    run_child(
        """
        import gc
        peer = NixlPeer("kvl-late-peer", [4 << 20], seed=3, env={"UCX_TLS": os.environ["UCX_TLS"]}, timeout=30)
        agent = nx.make_agent("kvl-late", progress_thread=False)
        name = agent.add_remote_agent(peer.metadata)
        local = torch.zeros(1 << 20, dtype=torch.uint8)
        held = nx.register(agent, local)
        staging = nx.Staging(agent, 1 << 20)
        m = peer_read(peer, local, 0, 128, spaced=2)
        peer.pause()
        late = nx.transfer(agent, name, m, strategy="staged", staging=staging)
        expect(nx.NixlTimeoutError, "still in flight", late.wait, 0.3)
        assert staging.busy
        late.release()
        assert staging.busy and staging.kept
        expect(TransferError, "is kept for good", nx.prepare_transfer, agent, name, m, strategy="staged", staging=staging)
        auto = nx.prepare_transfer(agent, name, m, staging=staging)
        assert auto.plan.strategy == "direct", auto.plan.strategy
        auto.release()
        staging.close()
        del staging, late
        gc.collect()
        expect(nx.NixlTimeoutError, r"left to finish \\(NIXL cannot guarantee to cancel it\\), and the scratch buffer",
               nx.calibrate, agent, name, peer.side(), nbytes=1 << 20, count=64, repeats=1, timeout=0.3)
        gc.collect()
        peer.resume()
        for first in (0, 128):
            got = nx.transfer(agent, name, peer_read(peer, local, first, 128), strategy="direct").wait(30)
            assert got.num_bytes == 128 * 4096
        assert np.array_equal(local[: 128 * 4096].numpy(), contents(3, 0, 128 * 4096))
        assert nx.calibrate(agent, name, peer.side(), nbytes=1 << 20, count=64, repeats=1).bandwidth > 0
        """
    )


def test_an_agent_made_thread_safe_serves_two_threads() -> None:
    """NIXL's default sync mode takes no lock: two threads posting on one agent without a
    progress thread crashed it (SIGSEGV, 3 runs in 3). make_agent asks for "strict" unless
    told otherwise, and "rw" serves too."""
    run_child(
        """
        import threading
        for mode in (None, "strict", "rw"):
            asked = {} if mode is None else {"sync_mode": mode}  # None: make_agent's default
            a = nx.make_agent(f"kvl-mt-{mode}", progress_thread=False, **asked)
            b = nx.make_agent(f"kvl-mt-{mode}-peer")
            srcs = [torch.randint(0, 256, (1 << 20,), dtype=torch.uint8) for _ in range(2)]
            dsts = [torch.zeros(1 << 20, dtype=torch.uint8) for _ in range(2)]
            held = [nx.register(a, s) for s in srcs] + [nx.register(b, d) for d in dsts]
            name = a.add_remote_agent(b.get_agent_metadata())
            n = 256
            maps = [
                Map(np.stack([srcs[k].data_ptr() + np.arange(n, dtype=U64) * U64(4096),
                              dsts[k].data_ptr() + np.arange(n, dtype=U64)[::-1] * U64(4096),
                              np.full(n, 4096, U64)], 1).astype(U64),
                    nx.local_side(srcs[k]), nx.LocalSide("cpu", 0, nx.local_side(dsts[k]).tensor_spans, is_local=False))
                for k in (0, 1)
            ]
            errors = []
            def post(k):
                try:
                    for _ in range(20):
                        nx.transfer(a, name, maps[k], strategy="direct").wait(30)
                except Exception as exc:
                    errors.append(exc)
            threads = [threading.Thread(target=post, args=(k,)) for k in (0, 1)]
            for t in threads: t.start()
            for t in threads: t.join(60)
            assert not errors, errors
            for s, d in zip(srcs, dsts):
                assert torch.equal(d.view(n, 4096).flip(0).reshape(-1), s)
        """
    )


def test_a_cache_re_allocated_in_place_leaves_a_peer_writing_into_its_old_memory_kept() -> None:
    """An engine that re-allocates its registered cache in place (``t.data = ...``, as
    ``module.to()`` does, or ``set_``) lets go of the storage NIXL holds as a region and a
    peer's description names: the regions kept the tensors, not their storages, so the
    peer's WRITE landed in freed heap (an abort, 4 in 4 runs). The storage is now held
    while registered: the bytes land there, and nothing crashes."""
    run_child(
        """
        import kvlayout
        from kvlayout.transfer import RegistrationDescription, block_map
        from kvlayout.transfer.nixl.regions import _REGIONS
        nhd = {"kv_layout": "NHD"}
        kv_d = [torch.zeros(2, 64, 16, 8, 64) for _ in range(2)]  # 512 KiB layers
        reg_d = kvlayout.detect(kv_d, "vllm", nhd)
        kv_p = [torch.full((2, 64, 16, 8, 64), 7.0) for _ in range(2)]
        reg_p = kvlayout.detect(kv_p, "vllm", nhd)
        p, d = nx.make_agent("kvl-realloc-p", progress_thread=False), nx.make_agent("kvl-realloc-d")
        held_d, held_p = nx.register(d, reg_d), nx.register(p, reg_p)
        desc = RegistrationDescription.from_json(reg_d.describe().to_json())
        peer = p.add_remote_agent(d.get_agent_metadata())
        old = [t.data_ptr() for t in kv_d]
        for t in kv_d:
            t.data = torch.zeros_like(t)  # the old storages: held by nothing but the regions
        junk = [torch.full((2, 64, 16, 8, 64), 5.0) for _ in range(8)]
        nx.transfer(p, peer, block_map(reg_p, desc, [0, 1], [2, 3]), strategy="direct").wait(timeout=30)
        kept = {s.data_ptr(): s for s in _REGIONS[d].owners.values()}
        assert sorted(kept) == sorted(old), (kept, old)
        for at in old:
            layer = torch.empty(0).set_(kept[at]).view(torch.float32).view(2, 64, 16, 8, 64)
            assert bool((layer[:, 2:4] == 7.0).all()) and bool((layer[:, :2] == 0).all())
        assert all(bool((t == 0).all()) for t in kv_d)  # the new memory: nothing was written there
        """
    )


def test_memory_of_a_storage_resized_under_its_registration_is_not_counted_as_registered() -> None:
    """A registered storage resized in place moves its memory; a tensor that then lies at
    the old address and size matched the stale region and was counted as registered, its
    storage held by nothing (freed, NIXL's region would be on freed memory)."""
    import ctypes

    from kvlayout.transfer.nixl.regions import _REGIONS

    agent = nx.make_agent("kvl-resized", progress_thread=False)
    t = torch.zeros(BUF, dtype=torch.uint8)
    region_at = t.data_ptr()
    held = nx.register(agent, t)
    t.untyped_storage().resize_(2 * BUF)  # the storage moves (the old memory is freed)
    assert t.data_ptr() != region_at
    # a tensor over the old address, as one the allocator put there next would be (never read)
    there = torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * BUF).from_address(region_at)))
    with pytest.raises(
        TransferError, match=r"registered with this agent for a storage resized in place since"
    ):
        nx.register(agent, there)
    assert list(_REGIONS[agent].count.values()) == [1]  # refused whole: nothing counted
    held.deregister()
    assert _REGIONS[agent].count == {} and _REGIONS[agent].owners == {}


def test_a_prepped_pair_whose_local_list_nixl_refuses_still_releases_the_remote_one() -> None:
    """NIXL's refusal to release one list is raised, and the other is released all the
    same (a list left held would pile up in NIXL as peers come and go)."""
    nixl_error = type("nixlBackendError", (RuntimeError,), {"__module__": "nixl._bindings"})

    class Agent:
        def __init__(self) -> None:
            self.released: list[str] = []

        def release_dlist_handle(self, handle: str) -> None:
            if handle == "local":
                raise nixl_error("NIXL_ERR_BACKEND")
            self.released.append(handle)

    agent = Agent()
    starts, counts = np.array([0], dtype=np.uint64), np.array([1], dtype=np.int64)
    local = nx.PreppedList("local", UNIT, starts, counts, "DRAM", agent=agent)
    remote = nx.PreppedList("remote", UNIT, starts, counts, "DRAM", agent=agent)
    with pytest.raises(nx.NixlError, match="NIXL refused to release a prepared list"):
        nx.Prepped("peer", local, remote).release()
    assert agent.released == ["remote"] and remote.released and not local.released
