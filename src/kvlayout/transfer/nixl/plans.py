"""What one request posts: the cost model, the strategies' plans (direct, staged,
peer-staged; a pipeline's stages) and the estimate made from descriptions alone."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, cast

import numpy as np
import torch

from kvlayout import _native
from kvlayout.errors import as_int, at_least
from kvlayout.registration.address_space import MAX_END_TEXT, NULL_PAGE, unownable
from kvlayout.transfer import TransferError
from kvlayout.transfer.arguments import threads_arg
from kvlayout.transfer.block_maps import BlockMap
from kvlayout.transfer.joined_maps import JoinedMap
from kvlayout.transfer.nixl.copies import (
    _HOST,
    Staging,
    _check_copies,
    _check_staging_device,
    _copy,
)
from kvlayout.transfer.nixl.direct import _checked_runs, _direct_rows, _mem_type, _rows, _Sides, _sides
from kvlayout.transfer.nixl.regions import _intervals
from kvlayout.transfer.nixl.sides import (
    _MEM_TYPES,
    _U64,
    MapSide,
    NixlMap,
    Op,
    RefusedDescriptorError,
    Strategy,
    _refuse_moved,
)

# -- cost model ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """Predicted seconds of a request: ``per_transfer_s + descriptors * per_descriptor_s +
    bytes / bandwidth``, plus, staged, the local copy: a gather (a staged WRITE's, the
    peer's before a peer-staged READ) ``runs * copy_per_run_s + bytes / copy_bandwidth``,
    a scatter (a staged READ's, the peer's after a peer-staged WRITE) ``runs *
    scatter_per_run_s + bytes / scatter_bandwidth`` (:meth:`copy_s`).

    A descriptor's cost depends on its size where the transport changes protocol with
    it: over UCX's TCP on loopback a WRITE's descriptor cost 4-6 us up to 32 KiB and
    nothing from 64 KiB (the rendezvous protocol overlaps them), a READ's 3-6 us up to
    256 KiB and 1 us at 1 MiB. :func:`calibrate` measures it at several sizes
    (``per_descriptor_by_size``, ascending ``(bytes, seconds)``); a request's descriptors
    are priced at their mean size, interpolated in log size between the measured ones
    and clamped to the ends (:meth:`descriptor_s`). Without them, ``per_descriptor_s``
    at every size.

    The defaults (:data:`DEFAULT_COST`, which ``plan`` and ``estimate`` use for a WRITE
    when given no model, and :data:`DEFAULT_READ_COST` for a READ) are this project's
    measurement of NIXL over UCX's TCP transport on loopback (2 cores), as
    :func:`calibrate` measures it (16 MiB transfers, as bench-pd asks): the medians of
    128 calls, 64 WRITE and 64 READ taking turns, under other load (a 1-minute load
    average of 1.8-4.0; 2026-12-07): a descriptor of 1 KiB 1.6 us, 8 KiB 2.8 us, 32 KiB
    5.5 us, 64 KiB 5.7 us, 128 KiB 8.6 us, 512 KiB 1.1 us; 1.9 GB/s; 0.6 ms a transfer.
    The ops differ: the WRITEs' medians 1.8, 3.6, 7.8, 7.9, 11.4 and 0 us, 2.8 GB/s,
    0.8 ms; the READs' 1.4, 2.0, 3.4, 2.9, 5.4 and 8.4 us, 1.7 GB/s, 0.5 ms, which price
    a READ (:data:`DEFAULT_READ_COST`; both ops' price a WRITE). Priced by both ops' (a
    descriptor of 8-32 KiB near twice a READ's), every scattered READ of ``make
    bench-pd`` of 4,032-4,096 runs of 16-32 KiB went staged or peer-staged where direct
    measured fastest, by 1.1-1.25x (same layout NHD, TP 1 -> 2 and 2 -> 1 HND, block
    16 -> 64 and 64 -> 16, vLLM -> SGLang); priced by the READs' they go direct. A call's
    figure is noisy past 8 KiB (interquartile 2-9 us at 32 KiB, 0-26 us at 512 KiB, over
    the 128): :func:`calibrate` the live pair where strategies
    come close. They had been 18 us a descriptor at every size (9.6 s for 524,288 of
    256 B), 0.65 GB/s and 0.2 ms, measured before the loopback got faster; priced so, a
    map of 976 descriptors of 72 KiB (MLA TP 1 -> 4, scattered) went staged by 2 %, where
    bench-pd measured direct in 0.79-0.85x the staged plans' time. The copy's are the
    block-map engine's (:func:`copy_byte_runs`) there, one thread, as :func:`calibrate`
    measured them on the quiet machine once the copy streamed whole lines only
    (2026-12-07): a gather at 10 GB/s
    and 0.038 us a run (0.036-0.041 us, 10.0-10.4 GB/s), a scatter at 10 GB/s and 0.018
    us a run (0.016-0.019 us, 9.9-10.4 GB/s). They had been 6 GB/s and 0.03 us, and for
    the scatter 4 GB/s and 0.2 us, measured under other load while the scatter still
    streamed partial lines (NHD -> HND's 524,224 runs of 256 B in 161-168 ms).
    :func:`calibrate` measures the live pair.

    A permuted map's copy (NHD <-> HND within a block: each block's runs, a head's row of
    a token each, form a transposed tile) costs its plain price times a factor of its
    own, by direction (``transposed_factor`` gathering, ``transposed_scatter_factor``
    scattering; None: 1). The copy engine gathers a tile a column at a time, reading one
    stream (csrc/stream_copy.h, ``Tile``), and scatters it in list order, writing a stream
    per head: NHD -> HND's 520,256 runs of 256 B gathered in 17 ms where as many 256 B
    runs spaced evenly took 34 ms (one process, taking turns, 2026-12-07), and scattered
    (line-aligned) in 28.7 ms against 28.8 ms spaced evenly. Calibrated plain figures
    priced that gather at 32 ms and the scatter at 23 ms, so both posters picked the side
    that scatters, 2-2.5x slower end to end in ``make bench-pd`` (where the scatter also
    streamed partial lines: 61-64 ms then). The defaults are :func:`calibrate`'s ratios
    on the quiet machine: 0.75 gathering (0.74-0.76), 1.0 scattering (1.00-1.01); they
    had been 0.5 and 1.0, the ratios above.

    A plan's own work on the request's path, before anything posts, is priced apart
    (:meth:`staged_s`): ``staged_plan_s`` a staged or peer-staged plan's beyond a direct
    plan's, whatever its runs, and its ordering work where the runs do not follow the
    order it needs (:meth:`order_s`: ``sort_per_run_s``, ``unordered_check_per_run_s``).
    Unpriced, a staged READ of NHD -> HND predicted alike with the peer-staged READ took
    1.5x it end to end (its plan sorting and checking 524,224 runs in 60-90 ms).

    A READ's copy (a staged READ's scatter once the READ landed, the peer's gather before
    a peer-staged READ) costs ``read_copy_factor`` times its own price (:meth:`staged_s`;
    None: 1): in a quiet ``make bench-pd`` (2026-12-07, 20 scenarios a side) the staged
    and peer-staged READs each took over the one-descriptor limit 0.96-2.6x the copy's
    calibrated price (past their own descriptors'), the median of 21 such rows 1.35
    (staged 1.40, peer-staged 1.34), where the WRITEs' gathers took 0.06-1.8x, median 0.5.
    Priced at 1, a TP 1 -> 2 HND READ of 4,096 runs of 16 KiB went peer-staged, predicted
    36.8 ms against direct's 38.1 ms, and took 38-39 ms against direct's 35 ms; TP 2 -> 1
    went staged, 39 ms against 35 ms. The default is that median; :func:`calibrate` does
    not measure it (a scatter timed right after a READ landed, against alone, took
    0.7-3.1x, median 1.15, under other load) and carries the default.
    """

    per_descriptor_s: float = 1.6e-6
    bandwidth: float = 1.9e9  # bytes/s
    per_transfer_s: float = 6e-4
    copy_per_run_s: float = 0.038e-6
    copy_bandwidth: float = 10e9  # bytes/s
    source: str = "defaults"
    per_descriptor_by_size: tuple[tuple[int, float], ...] = ()
    # None: as the gather's (a model given one copy's figures prices both directions by
    # them, never by another machine's scatter); DEFAULT_COST carries this project's
    scatter_per_run_s: float | None = None
    scatter_bandwidth: float | None = None  # bytes/s
    # A permuted map's copy (transposed tiles) over the plain price, gathered and scattered; None: 1.
    transposed_factor: float | None = None
    transposed_scatter_factor: float | None = None
    # A plan's own work on the request's path where the runs do not follow the order it
    # needs (order_s): a sort by an address, and a scatter's check out of order; 0: unpriced.
    sort_per_run_s: float = 0.0
    unordered_check_per_run_s: float = 0.0
    # A staged (or peer-staged) plan's own work beyond a direct plan's, whatever its runs; 0: unpriced.
    staged_plan_s: float = 0.0
    # A READ's copy (a staged READ's scatter, the peer's gather before a peer-staged READ)
    # over the copy's own price (copy_s), as it runs on the READ's path; None: 1.
    read_copy_factor: float | None = None

    def __post_init__(self) -> None:
        # A zero or NaN here would surface as a ZeroDivisionError or a NaN prediction later.
        optional = (
            "scatter_per_run_s",
            "scatter_bandwidth",
            "transposed_factor",
            "transposed_scatter_factor",
            "read_copy_factor",
        )
        seconds = ("per_descriptor_s", "per_transfer_s", "copy_per_run_s", "scatter_per_run_s")
        for name in (*seconds, "sort_per_run_s", "unordered_check_per_run_s", "staged_plan_s"):
            if getattr(self, name) is not None or name not in optional:
                _finite(f"CostModel.{name}", getattr(self, name), "a non-negative number of seconds", 0.0)
        for name in ("bandwidth", "copy_bandwidth", "scatter_bandwidth"):
            if getattr(self, name) is not None or name not in optional:
                _finite(f"CostModel.{name}", getattr(self, name), "a positive number of bytes a second", None)
        for name in ("transposed_factor", "transposed_scatter_factor", "read_copy_factor"):
            if getattr(self, name) is not None:
                _finite(
                    f"CostModel.{name}",
                    getattr(self, name),
                    "a positive number (a time's ratio) or None",
                    None,
                )
        points = self.per_descriptor_by_size
        if not isinstance(points, (tuple, list)):
            raise TypeError(
                f"CostModel.per_descriptor_by_size must be (bytes, seconds) pairs, not {points!r}"
            )
        pairs, last = [], 0
        for i, point in enumerate(points):  # lists too (a model read back from JSON), kept as tuples
            where = f"CostModel.per_descriptor_by_size[{i}]"
            if not isinstance(point, (tuple, list)) or len(point) != 2:
                raise TypeError(f"{where} must be a (bytes, seconds) pair, not {point!r}")
            try:
                size = as_int(point[0], where)
            except TypeError:
                size = -1
            if size <= last:
                raise TypeError(
                    f"{where}: the sizes must be ints, positive and ascending; got {point[0]!r} after {last}"
                )
            _finite(f"{where}'s seconds", point[1], "a non-negative number of seconds", 0.0)
            pairs.append((size, float(point[1])))
            last = size
        object.__setattr__(self, "per_descriptor_by_size", tuple(pairs))

    def descriptor_s(self, size: float) -> float:
        """Seconds one descriptor of ``size`` bytes costs beyond its bytes' time."""
        points = self.per_descriptor_by_size
        if not points:
            return self.per_descriptor_s
        if size <= points[0][0]:
            return points[0][1]
        for (a, cost_a), (b, cost_b) in itertools.pairwise(points):
            if size <= b:
                f = math.log(size / a) / math.log(b / a)
                return cost_a + f * (cost_b - cost_a)
        return points[-1][1]

    def direct_s(self, descriptors: int, nbytes: int) -> float:
        each = self.descriptor_s(nbytes / descriptors) if descriptors else 0.0
        return self.per_transfer_s + descriptors * each + nbytes / self.bandwidth

    def copy_s(self, runs: int, nbytes: int, *, scatters: bool = False, transposed: bool = False) -> float:
        """Seconds of the local copy of ``runs`` runs, ``nbytes`` bytes: a gather (reads
        the runs where they lie, writes staging in order), or with ``scatters`` a scatter
        (reads staging in order, writes the runs where they lie), which writes where the
        runs jump and was measured slower (``scatter_per_run_s``, ``scatter_bandwidth``;
        either None: the gather's). ``transposed``: the runs are a permuted map's
        (transposed tiles), priced at that times ``transposed_factor`` gathered or
        ``transposed_scatter_factor`` scattered (None: 1)."""
        per_run, bandwidth = self.copy_per_run_s, self.copy_bandwidth
        if scatters:
            per_run = per_run if self.scatter_per_run_s is None else self.scatter_per_run_s
            bandwidth = bandwidth if self.scatter_bandwidth is None else self.scatter_bandwidth
        factor = (
            (self.transposed_scatter_factor if scatters else self.transposed_factor) if transposed else None
        )
        return (runs * per_run + nbytes / bandwidth) * (1.0 if factor is None else factor)

    def order_s(self, runs: int, *, sorts: int = 0, unordered_check: bool = False) -> float:
        """Seconds a plan of ``runs`` runs spends on the request's path, before anything
        is posted, where the runs do not follow the order it needs: ``sorts`` sorts by
        an address (``sort_per_run_s`` a run each: a staged plan's stretches by the
        remote side's, a peer-staged one's by this side's), and with ``unordered_check``
        the check of a scatter whose destinations do not follow the staging's order,
        which sorts them to find overlaps (``unordered_check_per_run_s`` a run over a
        check in order). Maps list their runs in destination order, disjoint, so a staged
        READ of runs another order on the source (NHD -> HND) pays the sort (17 ms of its
        524,224 runs, where its scatter took 25-50 ms) and not the check's, its scatter's
        destinations known disjoint (docs/nixl.md, "Measuring")."""
        return runs * (sorts * self.sort_per_run_s + unordered_check * self.unordered_check_per_run_s)

    def staged_s(
        self,
        descriptors: int,
        runs: int,
        nbytes: int,
        stages: int = 1,
        *,
        scatters: bool = False,
        transposed: bool = False,
        sorts: int = 0,
        unordered_check: bool = False,
        reads: bool = False,
    ) -> float:
        """In ``stages`` the local copy of one stage overlaps the wire time of another:
        the slower of the two, plus one stage of the faster (the first gather before a
        WRITE posts, the last scatter after a READ lands). ``scatters``: the copy is a
        scatter (:meth:`copy_s`): a staged READ's, a peer-staged WRITE's (the peer's);
        ``transposed``: its runs are a permuted map's. The plan's own work before it
        posts overlaps nothing: ``staged_plan_s`` beyond a direct plan's (laying out its
        stretches and stages, checking its copy: 150-160 us to a direct plan's 45 us for
        2 runs), and with ``sorts`` and ``unordered_check`` its ordering work
        (:meth:`order_s`). ``reads``: the plan is a READ's, whose copy costs
        ``read_copy_factor`` times its own price (None: 1)."""
        copy = self.copy_s(runs, nbytes, scatters=scatters, transposed=transposed)
        if reads and self.read_copy_factor is not None:
            copy *= self.read_copy_factor
        wire = self.direct_s(descriptors, nbytes)
        own = self.staged_plan_s + self.order_s(runs, sorts=sorts, unordered_check=unordered_check)
        return max(wire, copy) + min(wire, copy) / stages + own


def _finite(name: str, value: object, what: str, least: float | None) -> None:
    """``value`` a finite real, at least ``least`` (None: above zero)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or (value < least if least is not None else value <= 0):  # type: ignore[operator]
        raise TypeError(f"{name} must be {what}, got {value!r}")


# This project's figures (the class's docstring), the scatter's and a descriptor's by size among
# them: calibrate()'s medians over 128 calls on this loopback, 64 of each op (2026-12-07).
DEFAULT_COST = CostModel(
    per_descriptor_by_size=(
        (1 << 10, 1.6e-6),
        (8 << 10, 2.8e-6),
        (32 << 10, 5.5e-6),
        (64 << 10, 5.7e-6),
        (128 << 10, 8.6e-6),
        (512 << 10, 1.1e-6),
    ),
    scatter_per_run_s=0.018e-6,
    scatter_bandwidth=10e9,
    transposed_factor=0.75,
    transposed_scatter_factor=1.0,
    sort_per_run_s=0.03e-6,
    unordered_check_per_run_s=0.07e-6,
    staged_plan_s=120e-6,
    read_copy_factor=1.35,
)

# The same, with the READs' own medians of those calls for the wire (the class's docstring).
DEFAULT_READ_COST = dataclasses.replace(
    DEFAULT_COST,
    per_descriptor_by_size=(
        (1 << 10, 1.4e-6),
        (8 << 10, 2.0e-6),
        (32 << 10, 3.4e-6),
        (64 << 10, 2.9e-6),
        (128 << 10, 5.4e-6),
        (512 << 10, 8.4e-6),
    ),
    bandwidth=1.7e9,
    per_transfer_s=5e-4,
)


def default_cost(op: Op) -> CostModel:
    """The model ``plan`` and ``estimate`` price an ``op`` request by when given none:
    :data:`DEFAULT_READ_COST` for a READ, :data:`DEFAULT_COST` for a WRITE."""
    return DEFAULT_READ_COST if op == "READ" else DEFAULT_COST


def _transposed(block_map: NixlMap) -> bool:
    """Whether the map's copy runs are transposed tiles: a block map whose kind says
    ``permuted`` (NHD <-> HND, :attr:`BlockMap.kind`), or a joined map whose every part's
    does (a request's groups moved as one); any other map's are priced plain, a joined
    map of permuted and other parts too."""
    parts = block_map.maps if isinstance(block_map, JoinedMap) else (block_map,)
    return bool(parts) and all(isinstance(m, BlockMap) and "permuted" in m.kind.split(", ") for m in parts)


# -- plans -----------------------------------------------------------------------------------


class Stage(NamedTuple):
    """One step of a staged plan's pipeline: descriptors ``[lo, hi)`` of the plan, and
    the local copies ``[lo, hi)`` that fill (WRITE) or empty (READ) them."""

    descriptors: tuple[int, int]
    runs: tuple[int, int]


def _stages(first: np.ndarray, stretch_bytes: np.ndarray, num_runs: int, stages: int) -> tuple[Stage, ...]:
    """Cut the stretches (descriptors) into ``stages`` of about equal bytes, exactly
    that many (never more than the stretches): a cut that equal bytes would put where
    another is moves to the next stretch. Each stage's copies are its stretches' runs
    (``first`` is the first run of each stretch, in the copies' order)."""
    n, total = len(first), int(stretch_bytes.sum(dtype=_U64))
    want = max(1, min(stages, n))
    ends = np.cumsum(stretch_bytes, dtype=_U64)
    cuts = np.searchsorted(ends, np.arange(1, want, dtype=_U64) * np.uint64(total // want), side="right")
    # cut i after at least i stretches and before the last want - i: stretch counts
    # past the i-th cut (cuts - i) never decrease, so every stage keeps one stretch
    step = np.arange(1, want, dtype=np.int64)
    cuts = np.maximum.accumulate(np.clip(cuts.astype(np.int64) - step, 0, n - want)) + step
    bounds = np.r_[0, cuts, n].astype(np.int64)
    runs = np.r_[first, num_runs].astype(np.int64)[bounds]
    return tuple(
        Stage((int(bounds[i]), int(bounds[i + 1])), (int(runs[i]), int(runs[i + 1])))
        for i in range(len(bounds) - 1)
        if bounds[i + 1] > bounds[i]
    )


@dataclass(frozen=True)
class Plan:
    """What one request posts: the strategy, op, descriptors on each side (``(N, 3)``
    uint64), the local copy (gather before a WRITE, scatter after a READ; None for
    direct) and the device it runs on, and the predicted seconds of each strategy
    considered."""

    strategy: Literal["direct", "staged", "peer-staged"]
    op: Op
    local: np.ndarray
    remote: np.ndarray
    local_mem: str
    remote_mem: str
    copies: np.ndarray | None
    num_runs: int
    num_bytes: int
    predicted_s: dict[str, float] = field(default_factory=dict)
    copy_spans: tuple[np.ndarray, np.ndarray] | None = None  # (K, 2) memory copies read, write
    stages: tuple[Stage, ...] = ()  # a staged plan's pipeline, in order; () for direct
    copy_device: torch.device = _HOST  # where the local copy runs: the staging buffer's device
    # The local side, asked before each copy whether its memory moved since the map was built.
    local_side: MapSide | None = field(default=None, compare=False, repr=False)
    # A staged plan's buffer, held so that the memory its copies address outlives the plan,
    # and asked before each copy whether that memory changed.
    staging: Staging | None = field(default=None, compare=False, repr=False)
    # The copies' destinations are known disjoint (a staged READ's scatter writes the map's
    # runs, disjoint in the map's own order): check_copy does not sort them to check again.
    copy_dst_disjoint: bool = field(default=False, compare=False, repr=False)
    # check_copy passed: the copies (read-only) are not checked again when they run.
    _copy_checked: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.copies is not None:
            self.copies.setflags(write=False)

    def __repr__(self) -> str:  # a summary: the descriptor and copy arrays run to millions of rows
        stages = f" in {len(self.stages)} stages" if len(self.stages) > 1 else ""
        copies = "" if self.copies is None else f", {len(self.copies)} copies on {self.copy_device}"
        predicted = ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in self.predicted_s.items())
        return (
            f"Plan({self.strategy} {self.op}{stages}: {self.num_descriptors} descriptors "
            f"(local {self.local_mem}, remote {self.remote_mem}) for {self.num_runs} runs, "
            f"{self.num_bytes} bytes{copies}; predicted {predicted or 'nothing'})"
        )

    @property
    def num_descriptors(self) -> int:
        return len(self.local)

    def copy_stage(self, stage: int, stream: torch.cuda.Stream | None = None) -> None:
        """The local copy of one stage (its gather or scatter), on the block-map engine
        (host memory) or the device's run executor (on ``stream``, the current one when
        None), returning once its bytes are there."""
        if self.copies is None:
            raise TransferError(f"a {self.strategy} plan has no local copy to run a stage of")
        given = stage
        stage = as_int(stage, "stage")  # a NumPy integer too; TypeError otherwise
        if not 0 <= stage < len(self.stages):
            raise TransferError(
                f"stage must be an int in [0, {len(self.stages)}), the plan's stages; got {given!r}"
            )
        assert self.copy_spans is not None
        self._refuse_moved("nothing was copied")
        self.check_copy()
        lo, hi = self.stages[stage].runs
        _copy(self.copies[lo:hi], *self.copy_spans, 1, False, self.copy_device, stream)

    def _refuse_moved(self, nothing: str) -> None:
        """Refuse to copy or post once the local cache's or the staging buffer's memory
        changed since the plan read its addresses."""
        _refuse_moved(self.local_side, nothing)
        if self.staging is not None:
            self.staging._refuse_moved(nothing)

    def check_copy(self) -> None:
        """Refuse a staged plan whose local copy leaves its memory (before any byte moves)."""
        if self.copies is not None and not self._copy_checked:
            assert self.copy_spans is not None
            _check_copies(self.copies, *self.copy_spans, dst_disjoint=self.copy_dst_disjoint)
            object.__setattr__(self, "_copy_checked", True)

    def copy(self, num_threads: int = 1, stream: torch.cuda.Stream | None = None) -> None:
        """Run the local copy of a staged plan (the gather before a WRITE, the scatter
        after a READ) where its staging buffer is: on the block-map engine, or on the
        device's run executor (on ``stream``, the current one when None); returns once
        the bytes are there. Nothing for a direct plan."""
        threads = threads_arg(num_threads, TransferError)
        if self.copies is not None:
            assert self.copy_spans is not None
            self._refuse_moved("nothing was copied")
            self.check_copy()
            _copy(self.copies, *self.copy_spans, threads, False, self.copy_device, stream)


class _Stretches(NamedTuple):
    order: np.ndarray  # the runs by the side's address (empty: in their own order)
    first: np.ndarray  # each stretch's first run, as a position in the side's address order
    addr: np.ndarray  # each stretch's address on the side
    staged: np.ndarray  # each stretch's address in the staging buffer (its offset from base)
    nbytes: np.ndarray  # each stretch's bytes
    copies: np.ndarray  # (N, 3): the runs' copies to or from staging, in address order ((0, 3): none)


_NO_ORDER = np.empty(0, np.int64)


def _stretches(
    runs: np.ndarray, col: int, side: MapSide, base: int = 0, copies: int = 0, order: np.ndarray | None = None
) -> _Stretches:
    """The runs by their address on side ``col`` (0 source, 1 destination) cut into
    stretches (consecutive there, inside one tensor of ``side``: where two tensors touch,
    a stretch ends at the boundary and the next begins there), laid out stretch after stretch in a
    staging buffer at ``base``; with ``copies`` 1 (2), each run's copy from the other
    side into (out of) its staging bytes, in that order (``csrc/staging.h``). ``order``
    is an earlier call's, to skip the sort."""
    if order is None:
        order = _NO_ORDER if _native.runs_sorted_on(runs, col) else _native.address_order(runs, col)
    starts, ends = _intervals(side.tensor_spans)
    copy_rows, first, addr, staged, nbytes = _native.stretches(runs, order, col, starts, ends, base, copies)
    return _Stretches(order, first, addr, staged, nbytes, copy_rows)


def _stretch_count(block_map: NixlMap | None, runs: np.ndarray, col: int, side: MapSide) -> int:
    """``len(_stretches(runs, col, side).first)``, without laying the stretches out
    (``block_map``: what the runs are of; None counts them by the sort).

    Where the map is a block map and the side's tensors lie apart (no two overlap or
    touch, so no stretch runs from one into another), the stretches are the runs of the
    map from that side to itself, which its builder counts from the walk: pricing a
    candidate no longer sorts the runs (520,000 for NHD -> HND)."""
    starts, ends = _intervals(side.tensor_spans)
    spans = np.asarray(side.tensor_spans).reshape(-1, 2)
    apart = len(starts) == int((spans[:, 1] > 0).sum()) and bool(np.all(starts[1:] > ends[:-1]))
    if apart and isinstance(block_map, BlockMap):
        count = block_map._side_runs(col)
        if count is not None:
            return count
    return int(_native.stretch_count(runs, col, starts, ends))


class PeerStaging(NamedTuple):
    """A staging buffer the peer registered with NIXL and told this side of at the
    handshake (its address and bytes, and its device: ``"cpu"``, or ``"cuda"`` with the
    device id the peer registered it under): where a peer-staged WRITE lands, for the
    peer to scatter with :func:`unstage`, or where a peer-staged READ reads what the peer
    gathered with :func:`stage`. Passing it for a READ says the peer has staged this
    request there (``"auto"`` may then read it)."""

    address: int
    nbytes: int
    device_type: str = "cpu"
    device_index: int = 0


def plan(
    block_map: NixlMap,
    *,
    strategy: Strategy = "auto",
    staging: Staging | None = None,
    cost: CostModel | None = None,
    stages: int | None = None,
    peer_staging: PeerStaging | None = None,
) -> Plan:
    """The descriptors one request posts, by ``strategy`` (``"auto"``: the cheapest by
    ``cost``; staged is considered only with a ``staging`` buffer large enough,
    peer-staged only with a ``peer_staging`` buffer large enough).

    A staged plan of ``stages`` > 1 (never more than its descriptors) is a pipeline:
    :func:`transfer` posts each stage as soon as its gather is done (a READ: scatters
    each as soon as it lands), so the local copy overlaps the wire. By default (None) a
    gather runs in a stage per 4 MiB, up to :data:`AUTO_STAGES` (8), a scatter in one
    (:func:`auto_stages`): a staged WRITE gathers here, a peer-staged READ is the peer's
    gather (its :func:`stage`, whose default is the same cut, paced stage by stage with
    ``peer_ready``); a staged READ and a peer-staged WRITE scatter. The strategy is chosen
    on one stage's price unless ``stages`` is given: on a loopback the copy shares the
    cores with the wire, so the overlap is not credited before it is asked for. On a host
    whose wire is a NIC's DMA the gather has a core to itself; on this project's 2-core
    loopback, where UCX's TCP send and the peer's receive take both cores, 8 stages
    measured 1.06-1.09x one stage on the consecutive staged WRITEs of ``make bench-pd``,
    0.91-1.02x on the scattered ones (medians), 0.93-0.98x on staged READs, and gained on
    most peer-staged READs (docs/nixl.md, "Measuring").

    A peer-staged plan moves the runs, as they lie here, between this side and the peer's
    staging buffer (local runs that follow one another back to back: one descriptor per
    local stretch), the peer doing the copy: a WRITE lands there and the peer scatters it
    into its cache with :func:`unstage` once told; a READ reads what the peer gathered
    there with :func:`stage` before. It is for a pair whose other side is what scatters
    (TP 2 -> 1 in NHD posted by prefill, each decode row half written by each prefill
    rank; TP 1 -> 2 posted by decode), where neither direct nor staged can cut the
    descriptors."""
    if strategy not in ("auto", "direct", "staged", "peer-staged"):
        raise TransferError(f"strategy must be 'auto', 'direct', 'staged' or 'peer-staged', not {strategy!r}")
    if stages is not None:
        try:
            stages = as_int(stages, "stages")  # a NumPy integer too
        except TypeError:
            raise TypeError(f"stages must be a positive int or None, got {stages!r}") from None
        if stages < 1:
            raise TypeError(f"stages must be a positive int or None, got {stages!r}")
    if cost is not None and not isinstance(cost, CostModel):
        raise TypeError(f"cost must be a CostModel (calibrate() makes one), not {type(cost).__name__}")
    s = _sides(block_map)
    local_mem, remote_mem = _mem_type(s.local, "local"), _mem_type(s.remote, "remote")
    num_runs, num_bytes = len(s.lengths), s.num_bytes
    model = cost or default_cost(s.op)
    predicted = {"direct": model.direct_s(num_runs, num_bytes)}
    if num_runs == 0:  # a rank pair with no heads in common: nothing to post, whatever the strategy
        none = np.empty((0, 3), _U64)
        chosen = "direct" if strategy == "auto" else strategy
        return Plan(
            chosen, s.op, none, none, local_mem, remote_mem, None, 0, 0, predicted, local_side=s.local
        )
    _check_staging_arg(staging)
    if staging is not None and staging.closed and not staging.busy:
        raise TransferError(f"{staging!r} is closed: NIXL no longer holds its region")
    if staging is not None and strategy in ("auto", "staged"):
        _check_staging_device(staging, s.local)
    fits = staging is not None and staging.nbytes >= num_bytes
    if strategy == "staged" and not fits:
        have = "no staging buffer" if staging is None else f"a staging buffer of {staging.nbytes} bytes"
        raise TransferError(f"the staged strategy needs a staging buffer of {num_bytes} bytes; got {have}")
    if peer_staging is not None:
        _check_peer_staging(peer_staging)
        _refuse_peer_staging_on_cache(peer_staging, s.remote)
    peer_fits = peer_staging is not None and peer_staging.nbytes >= num_bytes
    if strategy == "peer-staged" and not peer_fits:
        have = "no peer staging buffer" if peer_staging is None else f"one of {peer_staging.nbytes} bytes"
        raise TransferError(
            f"the peer-staged strategy needs a peer staging buffer of {num_bytes} bytes; got {have}"
        )
    # Every candidate's cost first (from its descriptor count), then only the chosen
    # plan's descriptors and copies (a direct plan of half a million runs is 25 MB).
    builders: dict[str, Callable[[], Plan]] = {
        "direct": lambda: Plan(
            "direct",
            s.op,
            *_direct_rows(s),
            local_mem,
            remote_mem,
            None,
            num_runs,
            num_bytes,
            predicted,
            local_side=s.local,
        )
    }
    if strategy in ("auto", "staged") and fits:
        assert staging is not None
        # The default pipeline is priced as one stage: where the copy shares the cores with
        # the wire (loopback TCP) the overlap the model would credit is not there, and the
        # strategy stays what one stage would choose.
        pipeline = stages if stages is not None else _default_stages("staged", s.op, num_bytes)
        builders["staged"] = _staged(
            s, staging, model, pipeline, predicted, final=strategy == "staged", priced=stages or 1
        )
    if strategy in ("auto", "peer-staged") and peer_fits:
        assert peer_staging is not None
        # By default both sides cut it as the peer's staged plan of it does; priced as one stage.
        pipeline = stages if stages is not None else _default_stages("peer-staged", s.op, num_bytes)
        builders["peer-staged"] = _peer_staged(
            s, peer_staging, model, pipeline, predicted, priced=stages or 1
        )
    rank = {k: (predicted[k], _scatters(k, s.op)) for k in builders}
    choice = strategy if strategy != "auto" else min(builders, key=rank.__getitem__)
    return builders[choice]()


AUTO_STAGES = 8
"""The most stages a gather runs in by default (:func:`auto_stages`)."""
_STAGE_BYTES = 4 << 20


def auto_stages(op: Op, num_bytes: int) -> int:
    """The stages of a staged plan of ``op`` by default: a WRITE's gather overlaps the
    wire, a stage per 4 MiB up to :data:`AUTO_STAGES`; a READ's scatter, measured slower
    in stages on loopback, in one. A peer-staged plan takes the peer's: its staged plan of
    the same map has the other op (a peer-staged READ is the peer's gather), so both sides
    cut it alike without naming ``stages``."""
    if op not in ("READ", "WRITE"):
        raise TypeError(f"op must be 'READ' or 'WRITE', not {op!r}")
    num_bytes = at_least(num_bytes, "num_bytes", 0)  # an int, NumPy's too: what stages= takes
    return max(1, min(AUTO_STAGES, num_bytes // _STAGE_BYTES)) if op == "WRITE" else 1


def _default_stages(strategy: str, op: Op, num_bytes: int) -> int:
    """The stages a ``strategy`` plan of ``op`` runs in by default: its copy's
    (:func:`auto_stages`), which for a peer-staged plan is the peer's staged plan of the
    same map, of the other op (a READ here is a gather there); a direct plan's one."""
    if strategy == "direct":
        return 1
    copy_op: Op = op if strategy == "staged" else ("WRITE" if op == "READ" else "READ")
    return auto_stages(copy_op, num_bytes)


def _check_staging_arg(staging: object) -> None:
    """``staging`` is None or a staging buffer (what plan() and a transfer read of one)."""
    if staging is not None and not all(hasattr(staging, k) for k in ("address", "nbytes", "device", "_take")):
        raise TypeError(f"staging must be an nx.Staging(agent, nbytes), not {staging!r}")


def _check_peer_staging(peer: PeerStaging) -> None:
    """A peer staging buffer is described in range (memory a process can own, as a peer's
    description's tensors are), its device a NIXL memory type."""
    if not isinstance(peer, PeerStaging):
        raise TypeError(f"peer_staging must be an nx.PeerStaging(address, nbytes, ...), not {peer!r}")
    for name in ("address", "nbytes", "device_index"):
        value = getattr(peer, name)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < 1 << 64:
            raise TransferError(f"PeerStaging.{name} must be an int in [0, 2**64), got {value!r}")
    address, nbytes = int(peer.address), int(peer.nbytes)
    if unownable(np.array([address], _U64), np.array([nbytes], _U64))[0]:
        raise TransferError(
            f"PeerStaging({address:#x}, {nbytes} bytes) is not memory a process can own: it must "
            f"lie in [{NULL_PAGE:#x}, {MAX_END_TEXT}), past the null page, as a peer's described tensors do"
        )
    if not isinstance(peer.device_type, str) or peer.device_type not in _MEM_TYPES:
        raise TransferError(
            f"PeerStaging.device_type must be 'cpu' or 'cuda' (NIXL's DRAM or VRAM), got {peer.device_type!r}"
        )


def _refuse_peer_staging_on_cache(peer: PeerStaging, remote: MapSide) -> None:
    """A peer's staging buffer is memory of its own, apart from the tensors it described
    (a :class:`Staging` is an allocation of its own): one that overlaps them is a peer's
    lie, whose WRITE would land on its KV and whose READ would take its KV for staged bytes.
    Every tensor of the peer's description, every kernel group's (the side's
    ``descriptions``, whose spans each description works out once), not only those of the
    group the map moves: a hybrid peer's NIXL registration holds its other groups too, so
    NIXL's own check would let a buffer on them through. The side's own ``tensor_spans``
    too, last: a side that names no description (a :class:`MapSide` of the caller's own),
    and a description whose ``whole`` does not hold its group (one ``dataclasses.replace``
    made from ``group(i)``, which keeps ``whole``) leave it to them."""
    nbytes = int(peer.nbytes)
    if not nbytes:
        return
    start, end = int(peer.address), int(peer.address) + nbytes
    described = getattr(remote, "descriptions", ())
    for d in (*described, None):
        spans = np.asarray(remote.tensor_spans if d is None else d.tensor_spans, dtype=_U64).reshape(-1, 2)
        hit = np.flatnonzero((spans[:, 1] > 0) & (spans[:, 0] < end) & (spans[:, 0] + spans[:, 1] > start))
        if len(hit):
            k = int(hit[0])
            a, n = int(spans[k, 0]), int(spans[k, 1])
            which = "" if d is None else f", {d.tensor_label(k)}"
            raise RefusedDescriptorError(
                f"PeerStaging({start:#x}, {nbytes} bytes) overlaps tensor {k} ({a:#x}, {n} bytes{which}) of "
                f"the {len(spans)} tensors the peer described: a peer's staging buffer lies apart from its "
                "cache (a WRITE there would land on its KV, a READ take its KV for staged bytes); refused "
                "before posting"
            )


def _scatters(strategy: str, op: Op) -> bool:
    """Whether the strategy's copy is a scatter (reads the staging buffer in order, writes
    the runs where they lie): a staged READ's, a peer-staged WRITE's (the peer's). Of two
    strategies predicted alike, ``"auto"`` takes the one whose copy gathers: scattering
    NHD -> HND's 520,000 runs of 256 B measured 48-68 ms standalone and 106-126 ms after a
    READ landed, against 41-46 ms to gather them (``make bench-pd``: a peer-staged READ
    0.21-0.24 s, a staged one 0.36-0.40 s, both 64 descriptors)."""
    return (strategy == "staged" and op == "READ") or (strategy == "peer-staged" and op == "WRITE")


def _ordering(runs: np.ndarray, strategy: str, op: Op, remote_col: int) -> tuple[int, bool]:
    """(sorts, whether its scatter is checked out of order): the ordering work the plan
    of ``strategy`` does on the request's path (:meth:`CostModel.order_s`). A staged plan
    lays its staging out in the remote side's address order (a sort, unless the runs
    follow it) and checks its copy before posting: a WRITE's gather writes the staging,
    in order; a READ's scatter writes the runs here in that order, sorted to check unless
    the runs, in their own order, are disjoint and ascending here (a map's are: then they
    are known disjoint). A peer-staged plan lays the peer's staging out in this side's
    address order (a sort, unless the runs follow it); the peer's copy is checked there,
    when the peer plans it."""
    local_col = 1 - remote_col
    if strategy != "staged":
        return int(not _native.runs_sorted_on(runs, local_col)), False
    sorts = int(not _native.runs_sorted_on(runs, remote_col))
    return sorts, op == "READ" and not _native.runs_disjoint_on(runs, local_col)


def _staged(
    s: _Sides,
    staging: Staging,
    model: CostModel,
    stages: int,
    predicted: dict[str, float],
    *,
    final: bool,
    priced: int,
) -> Callable[[], Plan]:
    """Records the staged plan's cost, as a pipeline of ``priced`` stages; returns what
    builds it, in ``stages``. The staging buffer is laid out as the remote side's
    stretches; the copy gathers into it before a WRITE and scatters out of it after a
    READ (``final``: it will be built, so the copies are made in the same pass)."""
    local_mem, remote_mem = _mem_type(s.local, "local"), _mem_type(s.remote, "remote")
    num_runs, num_bytes = len(s.lengths), s.num_bytes
    copies = 1 if s.op == "WRITE" else 2
    st: _Stretches | None = None
    sorts, unordered = _ordering(s.runs, "staged", s.op, s.remote_col)
    known = None if sorts else _NO_ORDER  # runs already in the remote side's order: not checked again
    if final:
        st = _stretches(s.runs, s.remote_col, s.remote, staging.address, copies, known)
        descriptors = len(st.first)
        num_stages = len(_stages(st.first, st.nbytes, num_runs, priced))
    else:  # a candidate is priced by its descriptor count, laid out only if chosen
        descriptors = _stretch_count(s.block_map, s.runs, s.remote_col, s.remote)
        num_stages = min(descriptors, priced)  # at most what _stages gives: never more than the stretches
    predicted["staged"] = model.staged_s(
        descriptors,
        num_runs,
        num_bytes,
        num_stages,
        scatters=_scatters("staged", s.op),
        transposed=_transposed(s.block_map),
        sorts=sorts,
        unordered_check=unordered,
        reads=s.op == "READ",
    )
    held, staged = s.local.tensor_spans, np.array([[staging.address, staging.nbytes]], dtype=_U64)

    def build() -> Plan:
        done = (
            st if final and st is not None
            else _stretches(s.runs, s.remote_col, s.remote, staging.address, copies, known)
        )  # fmt: skip
        pipeline = _stages(done.first, done.nbytes, num_runs, stages)
        return Plan(
            "staged", s.op, _rows(done.staged, done.nbytes, s.local.device_index),
            _rows(done.addr, done.nbytes, s.remote.device_index), local_mem, remote_mem, done.copies,
            num_runs, num_bytes, predicted, (held, staged) if s.op == "WRITE" else (staged, held), pipeline,
            staging.device, s.local, staging,
            copy_dst_disjoint=s.op == "READ" and not unordered,
        )  # fmt: skip

    return build


def _peer_staged(
    s: _Sides,
    peer_staging: PeerStaging,
    model: CostModel,
    stages: int,
    predicted: dict[str, float],
    *,
    priced: int,
) -> Callable[[], Plan]:
    """Records the peer-staged plan's cost, as a pipeline of ``priced`` stages; returns
    what builds it, in ``stages``: the runs in the order
    and at the offsets the peer's own staged plan of the same map lays its staging out in
    (both sort this side's runs by address and stretch them alike), so :func:`unstage`
    there scatters what this WRITE put, and this READ finds what :func:`stage` there
    gathered. Its ``stages`` are the peer's plan's too (the same cut of the same
    stretches): stage ``i`` here is what the peer gathers or scatters as its stage ``i``
    (their ``runs`` are the peer's copies)."""
    num_runs, num_bytes = len(s.lengths), s.num_bytes
    # Priced by its descriptor count alone (the runs' order by local address is laid out
    # only if it is chosen). The copy is the peer's: its gather before a READ, its scatter
    # after a WRITE.
    count = _stretch_count(s.block_map, s.runs, s.local_col, s.local)
    sorts, _ = _ordering(s.runs, "peer-staged", s.op, s.remote_col)
    predicted["peer-staged"] = model.staged_s(
        count,
        num_runs,
        num_bytes,
        max(1, min(priced, count)),
        scatters=_scatters("peer-staged", s.op),
        transposed=_transposed(s.block_map),
        sorts=sorts,
        reads=s.op == "READ",
    )

    def build() -> Plan:
        st = _stretches(s.runs, s.local_col, s.local, peer_staging.address)
        return Plan(
            "peer-staged", s.op, _rows(st.addr, st.nbytes, s.local.device_index),
            _rows(st.staged, st.nbytes, peer_staging.device_index), _mem_type(s.local, "local"),
            _MEM_TYPES[peer_staging.device_type], None, num_runs, num_bytes, predicted, None,
            _stages(st.first, st.nbytes, num_runs, stages), local_side=s.local,
        )  # fmt: skip

    return build


class Estimate(NamedTuple):
    """What a map would cost before anything exists to post it (:func:`estimate`)."""

    op: Op
    num_runs: int
    num_bytes: int
    descriptors: dict[str, int]  # per strategy
    predicted_s: dict[str, float]  # per strategy
    choice: Strategy
    # per strategy: the stages it is pipelined in by default (auto_stages), at most: a
    # plan cuts them at its stretches' bounds, so one stretch longer than a stage makes fewer
    stages: dict[str, int]


def estimate(
    block_map: NixlMap, *, poster: Literal["src", "dst"] = "dst", cost: CostModel | None = None
) -> Estimate:
    """Descriptors and predicted seconds of each strategy for a map whose sides need not
    be live (two descriptions, at planning time), posted by ``poster`` (``"dst"``: a READ,
    as vLLM's decode side posts; ``"src"``: a WRITE), peer-staged included, and
    the strategy ``"auto"`` picks given staging buffers large enough: what :func:`plan`
    would choose; and the stages each runs in by default (:func:`auto_stages`: a gather
    here for a staged WRITE, there for a peer-staged READ, in a stage per 4 MiB)."""
    if poster not in ("src", "dst"):
        raise TransferError(f"poster must be 'src' or 'dst', not {poster!r}")
    runs = _checked_runs(block_map)  # both sides may be descriptions here: no local side asked for
    lengths = runs[:, 2]
    num_runs, num_bytes = len(lengths), int(lengths.sum(dtype=_U64))
    remote, col = (block_map.dst, 1) if poster == "src" else (block_map.src, 0)
    op: Op = "WRITE" if poster == "src" else "READ"
    model = cost or default_cost(op)
    descriptors = {"direct": num_runs}
    predicted = {"direct": model.direct_s(num_runs, num_bytes)}
    staged = _stretch_count(block_map, runs, col, remote)
    descriptors["staged"] = staged
    transposed = _transposed(block_map)
    sorts, unordered = _ordering(runs, "staged", op, col)
    predicted["staged"] = model.staged_s(
        staged, num_runs, num_bytes, scatters=_scatters("staged", op), transposed=transposed,
        sorts=sorts, unordered_check=unordered, reads=op == "READ",
    )  # fmt: skip
    own_side, own_col = (block_map.src, 0) if poster == "src" else (block_map.dst, 1)
    own = _stretch_count(block_map, runs, own_col, own_side)  # the poster's, to or from the peer's staging
    descriptors["peer-staged"] = own
    sorts, _ = _ordering(runs, "peer-staged", op, col)
    predicted["peer-staged"] = model.staged_s(
        own,
        num_runs,
        num_bytes,
        scatters=_scatters("peer-staged", op),
        transposed=transposed,
        sorts=sorts,
        reads=op == "READ",
    )
    choice = min(predicted, key=lambda k: predicted[k])
    stages = {k: max(1, min(_default_stages(k, op, num_bytes), n)) for k, n in descriptors.items()}
    return Estimate(op, num_runs, num_bytes, descriptors, predicted, cast(Strategy, choice), stages)
