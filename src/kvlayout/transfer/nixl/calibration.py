"""Measuring the live pair for the cost model (:func:`calibrate`), and making an agent
(:func:`make_agent`, the only place NIXL is imported)."""

from __future__ import annotations

import importlib
import math
import os
import statistics
import time
from collections.abc import Iterable
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from kvlayout import _native
from kvlayout.errors import at_least
from kvlayout.registration.peers import RegistrationDescription
from kvlayout.transfer import TransferError
from kvlayout.transfer.nixl.copies import _KEPT, Staging, _check_copies, _copy, _staging_device
from kvlayout.transfer.nixl.direct import _mem_type, _rows
from kvlayout.transfer.nixl.plans import DEFAULT_COST, CostModel, plan
from kvlayout.transfer.nixl.regions import (
    Region,
    _intervals,
    _pin,
    _reach,
    _refuse_unregistered,
    _unpin,
    register,
)
from kvlayout.transfer.nixl.sides import (
    _MEM_TYPES,
    _U64,
    Agent,
    MapSide,
    NixlError,
    NixlTimeoutError,
    Op,
    _described_side,
    _is_nixl_error,
    _peer_name,
    _seconds,
    local_side,
)

# -- calibration -------------------------------------------------------------------------------


def _timed_xfer(
    agent: Agent,
    op: Op,
    peer: str,
    rows: tuple[np.ndarray, np.ndarray],
    mems: tuple[str, str],
    timeout: float,
) -> float:
    """Seconds of one ``op`` of (local, remote) descriptor ``rows`` of memory types ``mems``.

    Timed out, the transfer is left to finish (NIXL cannot guarantee to cancel one under
    way, and UCX over TCP lands its bytes later): its request is kept, never released, and
    the scratch buffer's region stays pinned, so :func:`calibrate` leaving its ``with``
    block keeps it registered and allocated for good."""
    local, remote = rows
    what = f"a calibration {op} with peer {peer!r}"
    try:
        handle = agent.initialize_xfer(
            op, agent.get_xfer_descs(local, mems[0]), agent.get_xfer_descs(remote, mems[1]), peer
        )
    except Exception as exc:
        if not _is_nixl_error(exc):
            raise
        raise NixlError(f"NIXL refused {what}: {type(exc).__name__}: {exc}") from exc
    pinned = _pin(agent, [_reach(local, mems[0])])
    start = time.perf_counter()
    try:
        state = agent.transfer(handle)
        while state == "PROC":
            if time.perf_counter() - start > timeout:
                _KEPT.append(handle)  # released, NIXL would be asked to cancel what it cannot
                raise NixlTimeoutError(
                    f"{what} was not done after {timeout:g} s; it is left to finish (NIXL cannot guarantee "
                    "to cancel it), and the scratch buffer it reads or writes stays registered and allocated "
                    "for good"
                )
            state = agent.check_xfer_state(handle)
    except Exception as exc:
        if not _is_nixl_error(exc):
            raise
        _release(agent, handle, pinned)  # NIXL's error ends the transfer
        raise NixlError(f"NIXL failed {what}: {type(exc).__name__}: {exc}") from exc
    _release(agent, handle, pinned)
    if state != "DONE":
        raise NixlError(f"{what} ended in {state}")
    return time.perf_counter() - start


def _release(agent: Agent, handle: Any, pinned: tuple[Region, ...]) -> None:
    """Release a calibration transfer that NIXL reported done or failed, and the scratch
    region it pinned (kept for good if NIXL refused: it may still be under way)."""
    try:
        agent.release_xfer_handle(handle)
    except Exception as exc:
        if not _is_nixl_error(exc):
            raise
        _KEPT.append(handle)
        return
    _unpin(agent, pinned)


def calibrate(
    agent: Agent,
    peer: str | bytes,
    remote: MapSide | RegistrationDescription,
    *,
    op: Op = "READ",
    nbytes: int = 4 << 20,
    small: int = 1024,
    count: int = 2048,
    repeats: int = 3,
    timeout: float = 30.0,
    copy_device: str | torch.device = "cpu",
) -> CostModel:
    """A :class:`CostModel` measured on the live pair with ``op`` transfers between a
    scratch buffer registered for the call on ``copy_device`` and the peer's largest
    described tensor: one small descriptor, ``count`` small ones and one of ``nbytes``,
    the fastest of ``repeats`` each; then ``nbytes`` cut into descriptors of each size in
    :data:`_DESCRIPTOR_SIZES` (8 of them at least) against one descriptor of as many
    bytes, which prices a descriptor at each size (``per_descriptor_by_size``, from the
    rounds' ratios: :func:`_added_per_descriptor`); each measurement once a round, in
    ``repeats`` rounds; then the local copy there, a gather's figures and a scatter's
    (:func:`_calibrate_copy`: runs of 1 KiB and 16 KiB spread past a host's last-level
    cache, whatever ``small`` and ``count`` are, and a permuted map's transposed tiles
    of 256 B runs).
    ``copy_device`` is where this side's staging buffer is: a GPU's, for a cache there.
    Every descriptor lies inside that tensor: one of fewer than ``3 * small`` bytes (the
    small descriptors' reach) is refused. A READ's copy's factor (``read_copy_factor``)
    is not measured: the model carries :data:`DEFAULT_COST`'s.

    ``"READ"`` leaves the peer's memory as it is; ``"WRITE"`` (the op a prefill side
    posts) overwrites its first ``2 * nbytes`` bytes (the sized descriptors leave gaps):
    only for a tensor that is scratch to the peer.

    A measurement not done within ``timeout`` seconds raises :class:`NixlTimeoutError`
    and is left to finish (NIXL cannot guarantee to cancel it): the scratch buffer it
    reads or writes stays registered and allocated for good. One that NIXL fails (a peer
    gone) raises :class:`NixlError`.
    """
    if op not in ("READ", "WRITE"):
        raise TransferError(f"op must be 'READ' or 'WRITE', not {op!r}")
    small = at_least(small, "calibrate's small", 1)  # NumPy integers too
    nbytes = at_least(nbytes, "calibrate's nbytes", small)  # one small descriptor at least
    count, repeats = at_least(count, "calibrate's count", 2), at_least(repeats, "calibrate's repeats", 1)
    if isinstance(remote, RegistrationDescription):  # the peer's handshake: its tensors, as a side
        remote = _described_side(remote)
    if not hasattr(remote, "tensor_spans"):
        raise TypeError(
            "remote must be the peer's side (a RegistrationDescription, a block map's side of the peer, or "
            f"an nx.LocalSide(..., is_local=False)), not {type(remote).__name__}"
        )
    peer = _peer_name(peer)
    timeout = _seconds(timeout)
    starts, ends = _intervals(remote.tensor_spans)
    if len(starts) == 0:
        raise TransferError(f"peer {peer!r} described no memory to calibrate against")
    k = int(np.argmax(ends - starts))
    base, span = int(starts[k]), int(ends[k] - starts[k])
    if span < 3 * small:  # "one" and the two "many" spaced 2 * small apart would reach past the tensor
        raise TransferError(
            f"peer {peer!r}'s largest described tensor holds {span} bytes, fewer than calibrate's small "
            f"descriptors reach ({3 * small}: small={small} bytes, two of them 2 * small apart): pass a "
            "smaller small; nothing was posted"
        )
    asked, nbytes = nbytes, min(nbytes, span)
    asked_count, count = count, max(2, min(count, span // (2 * small)))
    rmem, dev = _mem_type(remote, "remote"), remote.device_index
    copy_on = _staging_device(copy_device)

    def spaced(size: int, n: int) -> np.ndarray:  # gaps: nothing merges
        offsets = np.arange(n, dtype=_U64) * np.uint64(2 * size)
        return _rows(base + offsets, np.full(n, size, _U64), dev)

    # each size as nbytes in descriptors of that size, and as one descriptor of as many bytes
    sizes = {size: min(nbytes // size, span // (2 * size)) for size in _DESCRIPTOR_SIZES if size > small}
    sizes = {size: n for size, n in sizes.items() if n >= 8}
    theirs: dict[str | tuple[str, int], np.ndarray] = {
        "one": np.array([[base, small, dev]], _U64),
        "many": spaced(small, count),
        "big": np.array([[base, nbytes, dev]], _U64),
    }
    for size, n in sizes.items():
        theirs["cut", size] = spaced(size, n)
        theirs["whole", size] = np.array([[base, n * size, dev]], _U64)
    _refuse_unregistered(agent, peer, np.concatenate(list(theirs.values())), rmem, "calibration descriptor")
    reach = max([nbytes, 2 * small * count, *(2 * size * n for size, n in sizes.items())])
    scratch = torch.empty(reach, dtype=torch.uint8, device=copy_on)
    addr, here = scratch.data_ptr(), copy_on.index or 0
    ours = {
        name: rows - np.array([base, 0, dev], _U64) + np.array([addr, 0, here], _U64)
        for name, rows in theirs.items()
    }
    mems = (_MEM_TYPES[copy_on.type], rmem)
    rounds: dict[str | tuple[str, int], list[float]] = {name: [] for name in theirs}
    with register(agent, scratch):
        # untimed: the first transfer to a peer connects (UCX connects on first use: 84 ms
        # where the same descriptor took 75 us after), which with repeats=1 was every "one"
        _timed_xfer(agent, op, peer, (ours["one"], theirs["one"]), mems, timeout)
        for _ in range(repeats):  # rounds of every measurement: a burst of load spoils one of each at most
            for name, rows in theirs.items():
                rounds[name].append(_timed_xfer(agent, op, peer, (ours[name], rows), mems, timeout))
        planning = _calibrate_plan(
            agent, op, local_side(scratch), remote, (addr, base), small, repeats, copy_on
        )
    t = {name: min(times) for name, times in rounds.items()}
    gather, scatter, transposed = _calibrate_copy(repeats, copy_on)
    sort, unordered_check = _calibrate_order(repeats)
    per_descriptor, bandwidth, unseen = _wire_figures(t, nbytes, count)
    by_size = [(small, per_descriptor)] + [
        (size, _added_per_descriptor(rounds["cut", size], rounds["whole", size], n))
        for size, n in sizes.items()
    ]
    # what the peer's memory cut short (not what nbytes did), said where the model is from
    unmeasured = [size for size in _DESCRIPTOR_SIZES if size > small and span // (2 * size) < 8]
    limits = []
    if nbytes < asked:
        limits.append(f"{nbytes} bytes a transfer, not {asked}")
    if count < asked_count:
        limits.append(f"{count} small descriptors, not {asked_count}")
    if unmeasured:
        sizes_text = ", ".join(f"{size >> 10} KiB" for size in unmeasured)
        limits.append(f"no descriptors of {sizes_text} priced (8, spaced, do not fit)")
    limited = f" (its largest described tensor holds {span} bytes: {'; '.join(limits)})" if limits else ""
    limited += "".join(f" ({note})" for note in unseen)
    return CostModel(
        per_descriptor_s=per_descriptor,
        bandwidth=bandwidth,
        per_transfer_s=t["one"],
        copy_per_run_s=gather[0],
        copy_bandwidth=gather[1],
        source=f"calibrated against peer {peer!r}{limited}",
        per_descriptor_by_size=tuple(by_size),
        scatter_per_run_s=scatter[0],
        scatter_bandwidth=scatter[1],
        transposed_factor=transposed[0],
        transposed_scatter_factor=transposed[1],
        sort_per_run_s=sort,
        unordered_check_per_run_s=unordered_check,
        staged_plan_s=planning,
        read_copy_factor=DEFAULT_COST.read_copy_factor,  # not measured here (CostModel)
    )


def _wire_figures(t: dict[Any, float], nbytes: int, count: int) -> tuple[float, float, list[str]]:
    """A descriptor's cost and the bandwidth, each the difference of two timings (of
    ``count`` small descriptors and of ``nbytes`` in one, against one small descriptor).
    Where the larger took no longer than the smaller (a burst of load on the one), the
    difference says nothing: it had priced a descriptor at 1 ns and the wire at 3 PB/s.
    The larger's time alone then bounds the figure (the dearest it can be), and a note
    says so."""
    notes = []
    if t["many"] > t["one"]:
        per_descriptor = max((t["many"] - t["one"]) / (count - 1), 1e-9)
    else:
        per_descriptor = t["many"] / count
        notes.append(
            f"{count} small descriptors took no longer than one ({t['many'] * 1e6:.0f} us, one "
            f"{t['one'] * 1e6:.0f} us): a descriptor priced at their time over their count"
        )
    if t["big"] > t["one"]:
        bandwidth = nbytes / max(t["big"] - t["one"], 1e-9)
    else:
        bandwidth = nbytes / t["big"]
        notes.append(
            f"{nbytes} bytes took no longer than one small descriptor ({t['big'] * 1e6:.0f} us, one "
            f"{t['one'] * 1e6:.0f} us): the bandwidth is their bytes over that time"
        )
    return per_descriptor, bandwidth, notes


class _Runs(NamedTuple):
    """A map of hand-made runs (what :func:`plan` reads of one)."""

    runs: np.ndarray
    src: MapSide
    dst: MapSide


def _calibrate_plan(
    agent: Agent,
    op: Op,
    here: MapSide,
    there: MapSide,
    at: tuple[int, int],
    size: int,
    repeats: int,
    device: torch.device,
) -> float:
    """Seconds a staged plan spends beyond a direct plan's, whatever its runs (laying out
    its stretches and stages, checking its copy): two runs of ``size`` bytes, apart here
    (from ``at[0]``) and back to back there (from ``at[1]``), of ``op``, planned both ways
    in ``5 * repeats`` rounds (the fastest of each: a few hundred microseconds a round),
    with a staging buffer of their bytes registered for the call on ``device`` (this side's)."""
    here_at, there_at = at
    rows = np.array([[here_at + 2 * i * size, there_at + i * size, size] for i in range(2)], _U64)
    m = (
        _Runs(rows, here, there)
        if op == "WRITE"
        else _Runs(np.ascontiguousarray(rows[:, [1, 0, 2]]), there, here)
    )
    direct = staged = math.inf
    with Staging(agent, 2 * size, device=device) as staging:
        for _ in range(5 * repeats):
            direct = min(direct, _timed(lambda: plan(m, strategy="direct")))
            staged = min(
                staged, _timed(lambda: plan(m, strategy="staged", staging=staging, stages=1).check_copy())
            )
    return max(staged - direct, 0.0)


def _added_per_descriptor(cut: list[float], whole: list[float], n: int) -> float:
    """Seconds each of ``n`` descriptors adds over one descriptor of their bytes, from
    rounds of both measured back to back: the median of the rounds' ratios, times the
    fastest single descriptor. The load of a busy host stretches both of a round alike,
    so their ratio holds better than their difference: on this project's 2-core loopback
    under other load (2026-12-07), the difference of the fastest of each priced a 32 KiB
    READ descriptor at 0-50 us from one call to the next (over 20 us in 3 of 5), the ratio
    at 3.4-12.2 us in 5 calls alternating with those (64 KiB and up, 8-256 descriptors of
    16 MiB, stayed as scattered either way: 0-250 us)."""
    # a round timed at 0 s (a clock too coarse for it) is a ratio past any other, not a crash
    ratio = statistics.median(a / max(b, 1e-9) for a, b in zip(cut, whole, strict=True))
    return max(ratio - 1.0, 0.0) * min((b for b in whole if b > 0), default=0.0) / (n - 1)


# Descriptor sizes a descriptor's cost is measured at beyond ``small`` (calibrate): a
# transport may change protocol with the size (UCX's rendezvous from 64 KiB over TCP),
# so the sizes either side of that step are measured, not interpolated across it (WRITEs
# on this loopback: 8.2-8.5 us a 32 KiB descriptor, 2.6-6.0 us at 64 KiB, 1.1-2.9 us at
# 128 KiB, in two runs).
_DESCRIPTOR_SIZES = (8 << 10, 32 << 10, 64 << 10, 128 << 10, 512 << 10)


# The local copy is measured as a request's runs are copied: spread over more memory than
# a host's last-level cache (32 MiB on this project's machine), gathered (read with gaps,
# written back to back: a staged WRITE's copy, the peer's before a peer-staged READ) and
# scattered (the reverse: a staged READ's, the peer's after a peer-staged WRITE), in runs
# of 1 KiB (a TP-resharded NHD request's head slices) and of 16 KiB (an HND one's). One
# flat copy of 128 MiB priced every copy before, at 6.2-6.4 GB/s and 0.001-0.17 us a run,
# where (2026-12-07, 2 cores under other load) scattering a TP 2 -> 1 HND request's 4,096
# runs of 16 KiB took 14.5-16.3 ms (predicted 10.5-11.1 ms) and NHD -> HND's 524,224 runs
# of 256 B 161-168 ms (predicted 29 ms at best), against 37-40 ms to gather them.
_COPY_CALIBRATION_BYTES = 32 << 20
_COPY_RUNS = (1 << 10, 16 << 10)
# A permuted map's runs as calibrated: NHD blocks of 16 tokens of 8 heads' 256-byte rows
# (128 bf16) into HND blocks (heads outside tokens), and back: transposed tiles, 8 x 16,
# timed in the same rounds as as many 256-byte runs spaced evenly (the plain pattern), so
# a round's load stretches both alike and their ratio holds (see _added_per_descriptor).
_TILE = (8, 16, 256)  # heads, tokens, bytes a row


def _transposed_copies(way: str, packed_at: int, apart_at: int, total: int) -> np.ndarray:
    """A permuted map's copy of ``total`` bytes as :func:`_calibrate_copy` times it:
    ``"gather"`` reads NHD blocks a block apart from each other at ``apart_at`` into HND
    blocks back to back at ``packed_at``, listed in the order it writes (a staged plan's
    staging order); ``"scatter"`` reads NHD blocks back to back at ``packed_at`` into HND
    blocks a block apart at ``apart_at``, listed in the order it reads."""
    heads, tokens, row = _TILE
    block = heads * tokens * row
    k = np.arange(total // block, dtype=_U64)[:, None, None] * np.uint64(block)
    h = np.arange(heads, dtype=_U64)[None, :, None]
    t = np.arange(tokens, dtype=_U64)[None, None, :]
    nhd, hnd = (t * np.uint64(heads) + h) * np.uint64(row), (h * np.uint64(tokens) + t) * np.uint64(row)
    packed, apart = np.uint64(packed_at), np.uint64(apart_at)
    if way == "gather":  # (block, head, token): the HND order it writes
        src, dst = apart + np.uint64(2) * k + nhd, packed + k + hnd
    else:  # (block, token, head): the NHD order it reads
        src, dst = packed + k + nhd, apart + np.uint64(2) * k + hnd
        src, dst = src.transpose(0, 2, 1), dst.transpose(0, 2, 1)
    n = src.size
    return np.ascontiguousarray(np.stack([src.reshape(n), dst.reshape(n), np.full(n, row, _U64)], axis=1))


def _calibrate_copy(
    repeats: int, device: torch.device
) -> tuple[tuple[float, float], tuple[float, float], tuple[float, float]]:
    """(seconds a run, bytes a second) of the staged strategies' gather and of their
    scatter on ``device`` (the block-map engine on the host, the run executor on a GPU,
    each call until its bytes are there): ``_COPY_CALIBRATION_BYTES`` in runs of each size
    of ``_COPY_RUNS`` (between a buffer where they lie a run's bytes apart and one where
    they lie back to back), and one run of the smaller size alone, in ``repeats`` rounds
    (a burst of load spoils one of each, not every one of one), the fastest of each. The
    two sizes move the same bytes, so their difference is the runs' own cost; the one-run
    copy's time is the call's own (checks, dispatch), taken out of the bandwidth. The
    runs are checked once, as a plan's are, and copied unchecked. Last, what a permuted
    map's copy (:func:`_transposed_copies`) takes over the plain copy of as many 256-byte
    runs spaced evenly, gathered and scattered: the median of the rounds' ratios (each
    past the call's own time)."""
    total, (small, mid) = _COPY_CALIBRATION_BYTES, _COPY_RUNS
    scratch = torch.zeros(3 * total, dtype=torch.uint8, device=device)  # zeros: its pages are touched
    packed_at, apart_at = scratch.data_ptr(), scratch.data_ptr() + total
    packed, apart = np.array([[packed_at, total]], _U64), np.array([[apart_at, 2 * total]], _U64)
    spans = {"gather": (apart, packed), "scatter": (packed, apart)}
    copies: dict[tuple[str, int], np.ndarray] = {}
    for way, (src_span, dst_span) in spans.items():
        for size in _COPY_RUNS:
            n = total // size
            gaps = apart_at + np.arange(n, dtype=_U64) * np.uint64(2 * size)  # gaps: nothing merges
            dense = packed_at + np.arange(n, dtype=_U64) * np.uint64(size)
            src, dst = (gaps, dense) if way == "gather" else (dense, gaps)
            copies[way, size] = np.stack([src, dst, np.full(n, size, _U64)], axis=1)
            _check_copies(copies[way, size], src_span, dst_span)
        copies[way, 0] = copies[way, small][:1]  # the call alone
        row = _TILE[2]
        n = total // row
        gaps = apart_at + np.arange(n, dtype=_U64) * np.uint64(2 * row)
        dense = packed_at + np.arange(n, dtype=_U64) * np.uint64(row)
        src, dst = (gaps, dense) if way == "gather" else (dense, gaps)
        copies[way, row] = np.stack([src, dst, np.full(n, row, _U64)], axis=1)  # the plain pattern
        copies[way, -1] = _transposed_copies(way, packed_at, apart_at, total)
        for pattern in (row, -1):
            _check_copies(copies[way, pattern], src_span, dst_span)
    t = dict.fromkeys(copies, math.inf)
    rounds: dict[tuple[str, int], list[float]] = {key: [] for key in copies}
    for _ in range(repeats):
        for (way, size), runs in copies.items():
            took = _timed(lambda runs=runs, way=way: _copy(runs, *spans[way], 1, False, device))
            t[way, size] = min(t[way, size], took)
            rounds[way, size].append(took)
    figures = []
    for way in spans:
        n_small, n_mid = total // small, total // mid
        per_run = max((t[way, small] - t[way, mid]) / (n_small - n_mid), 1e-9)
        moving = t[way, mid] - t[way, 0] - (n_mid - 1) * per_run  # the mid runs' bytes past the one run's
        figures.append((per_run, (total - small) / max(moving, 1e-9)))
    factors = []
    for way in spans:
        call = t[way, 0]
        tiled, plain = rounds[way, -1], rounds[way, _TILE[2]]
        ratios = (max(a - call, 1e-9) / max(b - call, 1e-9) for a, b in zip(tiled, plain, strict=True))
        factors.append(min(max(statistics.median(ratios), 1e-3), 1e3))  # a clock's freak: bounded
    return figures[0], figures[1], (factors[0], factors[1])


# A plan's ordering work is timed on a request's worth of runs (NHD -> HND's 524,224 for a
# Llama-3-8B-like 1024-token request): a sort's time a run grows with the count, and the
# runs' table past a host's last-level cache (12 MiB here, with its sort's keys) costs
# more a run than one inside it (0.015 us a run to sort 131,072, 0.03-0.06 us 524,288).
_ORDER_CALIBRATION_BYTES = 128 << 20


def _calibrate_order(repeats: int) -> tuple[float, float]:
    """(seconds a run to sort, seconds a run a scatter's check out of order adds over
    one in order): what a plan does on the request's path where the runs do not follow
    the order it needs (:meth:`CostModel.order_s`), timed on addresses alone (nothing
    is copied, no memory read): a permuted map's scatter (:func:`_transposed_copies`,
    its blocks in a seeded random order, as a request's scattered blocks are) sorted by
    its destinations as a plan sorts its runs (``address_order``), and checked against
    its spans as a plan checks its copy, beside the check of as many runs whose
    destinations follow one another (the rounds' fastest of each)."""
    total, row = _ORDER_CALIBRATION_BYTES, _TILE[2]
    packed_at, apart_at = 1 << 32, (1 << 32) + total  # addresses only: never dereferenced
    spans = (np.array([[packed_at, total]], _U64), np.array([[apart_at, 2 * total]], _U64))
    unordered = _transposed_copies("scatter", packed_at, apart_at, total)
    block = 2 * _TILE[0] * _TILE[1] * row  # an NHD block's place among the scattered ones
    blocks = total // (block // 2)  # each tensor's 64 blocks (a 1024-token request's) in a random order
    shuffled = np.random.default_rng(0).permuted(np.arange(blocks).reshape(-1, 64), axis=1).reshape(-1)
    shuffled = shuffled.astype(_U64)
    at = unordered[:, 1] - np.uint64(apart_at)
    unordered[:, 1] = (
        np.uint64(apart_at) + shuffled[at // np.uint64(block)] * np.uint64(block) + at % np.uint64(block)
    )
    n = len(unordered)
    dense = packed_at + np.arange(n, dtype=_U64) * np.uint64(row)
    ordered = np.stack(
        [dense, apart_at + np.arange(n, dtype=_U64) * np.uint64(2 * row), np.full(n, row, _U64)], 1
    )
    sort = check = ordered_check = math.inf
    for _ in range(repeats):
        sort = min(sort, _timed(lambda: _native.address_order(unordered, 1)))
        check = min(check, _timed(lambda: _check_copies(unordered, *spans)))
        ordered_check = min(ordered_check, _timed(lambda: _check_copies(ordered, *spans)))
    return sort / n, max(check - ordered_check, 0.0) / n


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- agents ---------------------------------------------------------------------------------


SyncMode = Literal["none", "strict", "rw", "default"]
_SYNC_MODES = ("none", "strict", "rw", "default")


def make_agent(
    name: str,
    *,
    telemetry: bool = True,
    progress_thread: bool = True,
    backends: Iterable[str] = ("UCX",),
    sync_mode: SyncMode | None = "strict",
) -> Agent:
    """A NIXL agent (``nixl._api.nixl_agent``; the only place this module imports NIXL)
    with telemetry on, so :class:`TransferResult` reports NIXL's merged descriptor count.

    ``progress_thread=False`` suits a process that only initiates and waits: polling a
    transfer's state drives NIXL's progress (and NIXL's thread, which polls without
    pause, is not there to compete for the cores). A target that does not poll needs the
    thread, or must call into NIXL regularly (``update_notifs``, as
    :mod:`kvlayout.testing.nixl_peer` does).

    ``sync_mode`` is NIXL's thread synchronization (``NIXL_THREAD_SYNC_<MODE>``):
    ``"strict"`` (the default: every call serialized) or ``"rw"`` (a reader-writer lock)
    let several threads post and wait on one agent. None keeps NIXL's own default, which
    takes no lock (an agent without a listener thread), as ``"none"`` does: such an agent
    is called from one thread at a time, or NIXL crashes (two threads posting and polling
    on one without a progress thread took the process down with SIGSEGV, 3 runs in 3).
    """
    api = _nixl_api()
    if isinstance(backends, str):  # one backend's name, not its letters
        backends = (backends,)
    kw: dict[str, Any] = {}
    if sync_mode is not None:
        if sync_mode not in _SYNC_MODES:
            raise TypeError(
                f"sync_mode must be one of {', '.join(map(repr, _SYNC_MODES))} or None, not {sync_mode!r}"
            )
        kw["sync_mode"] = api.nixl_thread_sync_t[f"NIXL_THREAD_SYNC_{sync_mode.upper()}"]
    config = api.nixl_agent_config(
        enable_prog_thread=progress_thread, backends=list(backends), capture_telemetry=telemetry, **kw
    )
    try:
        return api.nixl_agent(name, config)
    except Exception as exc:
        if type(exc).__name__ != "nixlBackendError":
            raise
        raise NixlError(_backend_failed(name, list(backends))) from exc


def _nixl_api() -> Any:
    """NIXL's ``_api`` module: the ``nixl`` meta package's, else the CUDA 12 build's
    (``kvlayout[nixl]`` alone), else the CUDA 13 build's (a CUDA 13 torch)."""
    for module in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(module)
        except ImportError:
            continue
    raise ImportError(
        "NIXL is not installed: pip install 'kvlayout[nixl]' (and pip install --no-deps "
        "nixl==1.5.1 for `import nixl`; nixl-cu13 instead for a CUDA 13 torch)"
    )


def _backend_failed(name: str, backends: list[str]) -> str:
    """Why NIXL could not start an agent's backends, and what to change."""
    why = f"NIXL could not start the {', '.join(backends)} backend of agent {name!r}"
    tls = os.environ.get("UCX_TLS")
    if "UCX" not in backends or not tls:
        return f"{why} (NIXL's log above says why)"
    # NIXL's UCX backend serves CUDA memory too: a build with CUDA, on a machine with a GPU,
    # needs a CUDA transport among those allowed (measured: "tcp" fails there, "tcp,cuda_copy"
    # starts, and starts on a CPU-only machine as well).
    return (
        f"{why} with UCX_TLS={tls!r}: UCX could not start on those transports alone. On a "
        "machine with a GPU it needs cuda_copy among them (UCX_TLS=tcp,cuda_copy for TCP); "
        "unset UCX_TLS to let UCX choose"
    )
