"""Send a request's block map between processes through NIXL: kvlayout computes and
registers, NIXL moves the bytes (nothing of NIXL is re-implemented here).

A map is read through :class:`NixlMap` (its byte runs and its two sides, each a
:class:`MapSide`): exactly one side lives in this process (a registration), the other is
a peer's description. A :class:`~kvlayout.transfer.block_maps.BlockMap` between a live
registration and a peer's :class:`~kvlayout.registration.peers.RegistrationDescription`
is one as it is (its sides answer ``is_local``, ``device_type``, ``device_index`` and
``tensor_spans``). From it come, for ``nixl_agent.get_xfer_descs``, the local and
remote ``(N, 3)`` descriptor arrays (address, length, device id) and the op: ``"WRITE"``
when the local side is the source, ``"READ"`` when it is the destination.

- :func:`register` registers each distinct storage of a registration once (layers that
  share memory, or slices of one pool, are one region), as DRAM or VRAM by its device.
- :func:`descriptors` is the direct form; :func:`prep_lists` the prepped one (both sides
  prepared once, at the handshake, as NIXL lists of fixed-size units; each request then
  passes index arrays, and NIXL merges consecutive dense indices back into long
  descriptors).
- Two strategies: ``"direct"`` posts the map's runs; ``"staged"`` gathers the request
  into a registered :class:`Staging` buffer laid out as the remote side's runs (one
  stretch per run of remote-consecutive runs) and posts one descriptor per stretch (for a
  READ, the mirror: receive into staging, then scatter). :class:`CostModel` (defaults
  from this machine's measurements, or :func:`calibrate` on the live pair) picks one per
  request; the caller can force either.
- :func:`transfer` validates every descriptor before anything is posted (local ones
  inside regions registered on this agent, remote ones inside the peer's described
  tensors and, for the list form, inside what the peer registered with NIXL), then posts;
  :meth:`Transfer.wait` (or :func:`wait`) raises on NIXL's ``"ERR"`` or a timeout.

Nothing here imports NIXL: the caller's agent is the only NIXL object used, so code that
does not move KV through NIXL never loads it (:func:`make_agent` imports it on call).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol, cast

import numpy as np
import torch

from kvlayout import _native
from kvlayout.registration.registration import KernelGroup, Registration
from kvlayout.transfer import TransferError
from kvlayout.transfer.block_maps import BlockMap

__all__ = [
    "DEFAULT_COST",
    "CostModel",
    "Descriptors",
    "Estimate",
    "LocalSide",
    "MapSide",
    "NixlError",
    "NixlMap",
    "NixlTimeoutError",
    "PeerStaging",
    "Plan",
    "Prepped",
    "PreppedList",
    "RefusedDescriptorError",
    "Registered",
    "Stage",
    "StageNotifs",
    "Staging",
    "Transfer",
    "TransferResult",
    "calibrate",
    "copy_byte_runs",
    "descriptors",
    "estimate",
    "local_side",
    "make_agent",
    "plan",
    "prep_lists",
    "register",
    "stage",
    "stage_notif",
    "transfer",
    "unstage",
    "wait",
]

Agent = Any
"""A ``nixl._api.nixl_agent`` (typed loosely: this module never imports NIXL)."""

Op = Literal["READ", "WRITE"]
Strategy = Literal["auto", "direct", "staged", "peer-staged"]

_MEM_TYPES = {"cpu": "DRAM", "cuda": "VRAM"}
_U64 = np.uint64


class NixlError(TransferError):
    """A NIXL transfer that cannot be posted, failed or did not finish."""


class RefusedDescriptorError(NixlError):
    """A descriptor refused before anything is posted: outside the regions registered on
    this agent, outside the tensors the peer described, or outside what the peer
    registered with NIXL (its description lies), or off a prepared list's units."""


class NixlTimeoutError(NixlError):
    """A posted transfer that did not finish in time."""


# -- what this module reads from a map -----------------------------------------------------


class MapSide(Protocol):
    """One side of a map, as this module reads it.

    A live registration in this process (``is_local``) or a peer's description (format,
    sizes, addresses received at the handshake). ``tensor_spans`` is a ``(K, 2)`` uint64 array:
    each tensor's start address and byte span (first byte to past the last); runs must
    fall inside them. ``device_type`` is ``"cpu"`` or ``"cuda"`` (DRAM or VRAM for
    NIXL); ``device_index`` is the device id NIXL is given (0 for the CPU).
    """

    @property
    def is_local(self) -> bool: ...

    @property
    def device_type(self) -> str: ...

    @property
    def device_index(self) -> int: ...

    @property
    def tensor_spans(self) -> np.ndarray: ...


class NixlMap(Protocol):
    """A block map as this module reads it: ``runs`` is an ``(N, 3)`` uint64 array
    (source address, destination address, length in bytes), each run inside one tensor
    of each side; ``src`` and ``dst`` are its sides, exactly one of them local."""

    @property
    def runs(self) -> np.ndarray: ...

    @property
    def src(self) -> MapSide: ...

    @property
    def dst(self) -> MapSide: ...


@dataclass(frozen=True)
class LocalSide:
    """A :class:`MapSide` for tensors of this process (see :func:`local_side`)."""

    device_type: str
    device_index: int
    tensor_spans: np.ndarray
    is_local: bool = True


Holder = Registration | KernelGroup | torch.Tensor | Sequence[torch.Tensor]


def _tensors(obj: Holder) -> list[torch.Tensor]:
    """Every tensor a registration, kernel group, tensor or list of tensors holds."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Registration):
        return [t for g in obj.kernel_groups for p in g.planes for t in p.leaves]
    if isinstance(obj, KernelGroup):
        return [t for p in obj.planes for t in p.leaves]
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(t, torch.Tensor) for t in obj):
        return list(obj)
    raise TypeError(
        "expected a kvlayout Registration or KernelGroup (what detection returns), a tensor or a "
        f"list of tensors, not {type(obj).__name__}"
    )


def _device(tensors: Sequence[torch.Tensor]) -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise TransferError(
            f"the tensors are on {len(devices)} devices ({', '.join(sorted(map(str, devices)))}); "
            "one side of a NIXL transfer is on one"
        )
    (device,) = devices
    if device.type not in _MEM_TYPES:
        raise TransferError(f"NIXL moves DRAM (cpu) or VRAM (cuda) memory, not {device.type} tensors")
    return device


def _span(t: torch.Tensor) -> tuple[int, int]:
    """A tensor's first byte and its byte span (padding between its rows included)."""
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if n > 0) + 1
    return t.data_ptr(), extent * t.element_size() if t.numel() else 0


def local_side(obj: Holder) -> LocalSide:
    """The :class:`MapSide` of a registration (or kernel group, tensor, list of tensors)
    held in this process: its device and each tensor's byte span."""
    tensors = _tensors(obj)
    device = _device(tensors)
    spans = np.array([_span(t) for t in tensors if t.numel()], dtype=_U64).reshape(-1, 2)
    return LocalSide(device.type, device.index or 0, spans)


# -- registering ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Region:
    """One registered stretch of memory: a whole storage."""

    address: int
    nbytes: int
    mem_type: str  # "DRAM" or "VRAM"
    device: int


class _AgentRegions:
    """What :func:`register` registered on one agent: each region with its count of
    holders (a storage registered by two registrations is registered once)."""

    def __init__(self) -> None:
        self.count: dict[Region, int] = {}
        self.reg_lists: dict[Region, Any] = {}

    def intervals(self, mem_type: str, device: int) -> tuple[np.ndarray, np.ndarray]:
        held = sorted(
            (r.address, r.address + r.nbytes)
            for r in self.count
            if (r.mem_type, r.device) == (mem_type, device)
        )
        arr = np.array(held, dtype=_U64).reshape(-1, 2)
        return arr[:, 0], arr[:, 1]


_REGIONS: weakref.WeakKeyDictionary[Any, _AgentRegions] = weakref.WeakKeyDictionary()


class Registered:
    """The NIXL registration of one registration's storages; :meth:`deregister` (or
    leaving a ``with`` block) undoes it. It keeps the tensors alive while registered."""

    def __init__(self, agent: Agent, regions: tuple[Region, ...], tensors: list[torch.Tensor]) -> None:
        self.agent = agent
        self.regions = regions
        self._tensors: list[torch.Tensor] | None = tensors

    def __repr__(self) -> str:
        total = sum(r.nbytes for r in self.regions)
        state = "live" if self._tensors is not None else "deregistered"
        return f"Registered({len(self.regions)} regions, {total} bytes, {state})"

    def deregister(self) -> None:
        if self._tensors is None:
            return
        held = _REGIONS[self.agent]
        for region in self.regions:
            held.count[region] -= 1
            if held.count[region] == 0:
                self.agent.deregister_memory(held.reg_lists.pop(region))
                del held.count[region]
        self._tensors = None

    def __enter__(self) -> Registered:
        return self

    def __exit__(self, *exc: object) -> None:
        self.deregister()


def register(agent: Agent, registration: Holder) -> Registered:
    """Register every distinct storage of ``registration`` with ``agent``, once each.

    Layers that are slices of one pool, or views of one tensor, share a storage and so
    one region; the region is the whole storage (as vLLM registers it), DRAM for CPU
    tensors and VRAM for CUDA ones (device id = the CUDA index). A storage this agent
    already holds through another :func:`register` is counted, not registered again.
    """
    tensors = [t for t in _tensors(registration) if t.numel()]
    if not tensors:
        raise TransferError("the registration holds no memory to register (every tensor is empty)")
    device = _device(tensors)
    if any(t.device.type == "meta" for t in tensors):  # pragma: no cover - _device refuses meta
        raise TransferError("meta tensors have no memory")
    mem_type, dev = _MEM_TYPES[device.type], device.index or 0
    regions = tuple(
        dict.fromkeys(
            Region(s.data_ptr(), s.nbytes(), mem_type, dev) for s in (t.untyped_storage() for t in tensors)
        )
    )
    held = _REGIONS.setdefault(agent, _AgentRegions())
    for region in regions:
        if region not in held.count:
            reg = agent.register_memory([(region.address, region.nbytes, region.device, "")], region.mem_type)
            held.reg_lists[region] = reg
            held.count[region] = 0
        held.count[region] += 1
    return Registered(agent, regions, tensors)


# -- descriptors (the direct form) ---------------------------------------------------------


class Descriptors(NamedTuple):
    """The direct form of a map: ``(N, 3)`` uint64 rows (address, length, device id) for
    ``get_xfer_descs`` on each side, the op, and each side's NIXL memory type."""

    local: np.ndarray
    remote: np.ndarray
    op: Op
    local_mem: str
    remote_mem: str


class _Sides(NamedTuple):
    op: Op
    local: MapSide
    remote: MapSide
    runs: np.ndarray  # (N, 3) uint64, C-contiguous
    local_col: int  # the runs' column of this side's addresses (0 source, 1 destination)
    block_map: NixlMap  # what the runs are of

    @property
    def remote_col(self) -> int:
        return 1 - self.local_col

    @property
    def local_addr(self) -> np.ndarray:
        return self.runs[:, self.local_col]

    @property
    def remote_addr(self) -> np.ndarray:
        return self.runs[:, self.remote_col]

    @property
    def lengths(self) -> np.ndarray:
        return self.runs[:, 2]

    @property
    def num_bytes(self) -> int:
        return int(self.lengths.sum(dtype=_U64))


def _mem_type(side: MapSide, which: str) -> str:
    mem = _MEM_TYPES.get(side.device_type)
    if mem is None:
        raise TransferError(
            f"the {which} side is on a {side.device_type!r} device; NIXL moves cpu or cuda memory"
        )
    return mem


def _sides(block_map: NixlMap) -> _Sides:
    runs = block_map.runs
    if not isinstance(runs, np.ndarray) or runs.ndim != 2 or runs.shape[1] != 3 or runs.dtype != _U64:
        what = (
            f"{runs.dtype} array of shape {runs.shape}"
            if isinstance(runs, np.ndarray)
            else type(runs).__name__
        )
        raise TypeError(
            f"a map's runs must be an (N, 3) uint64 array (source, destination, length), not a {what}"
        )
    src, dst = block_map.src, block_map.dst
    if src.is_local == dst.is_local:
        where = "this process" if src.is_local else "peers"
        raise TransferError(
            f"both sides of the map are in {where}; NIXL moves a map with one side local, the other a peer's"
            + (" (copy a local map with its copy())" if src.is_local else "")
        )
    runs = np.ascontiguousarray(runs)
    problem, run = _native.check_runs(runs)
    if problem == 1:
        raise TransferError(f"run {run} of the map has length 0")
    if problem:
        name = "source" if problem == 2 else "destination"
        raise TransferError(f"run {run} of the map runs past the end of the {name} address space")
    if src.is_local:
        return _Sides("WRITE", src, dst, runs, 0, block_map)
    return _Sides("READ", dst, src, runs, 1, block_map)


def _rows(addr: np.ndarray, lengths: np.ndarray, device: int) -> np.ndarray:
    out = np.empty((len(addr), 3), dtype=_U64)
    out[:, 0], out[:, 1], out[:, 2] = addr, lengths, device
    return out


def _direct_rows(s: _Sides) -> tuple[np.ndarray, np.ndarray]:
    """The local and remote descriptor rows of the direct form: one per run."""
    return (
        _native.descriptor_rows(s.runs, s.local_col, s.local.device_index),
        _native.descriptor_rows(s.runs, s.remote_col, s.remote.device_index),
    )


def descriptors(block_map: NixlMap) -> Descriptors:
    """The map's runs as NIXL descriptors (one per run), its op and memory types."""
    s = _sides(block_map)
    local_mem, remote_mem = _mem_type(s.local, "local"), _mem_type(s.remote, "remote")
    return Descriptors(*_direct_rows(s), s.op, local_mem, remote_mem)


# -- memory intervals and checks -------------------------------------------------------------


def _intervals(spans: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted disjoint (start, end) intervals covering ``spans`` (overlapping spans, such
    as the interleaved layers of one pool, merge; merely touching ones do not)."""
    spans = np.asarray(spans, dtype=_U64).reshape(-1, 2)
    spans = spans[spans[:, 1] > 0]
    if len(spans) == 0:
        return np.empty(0, _U64), np.empty(0, _U64)
    order = np.argsort(spans[:, 0], kind="stable")
    starts, ends = spans[order, 0], spans[order, 0] + spans[order, 1]
    reach = np.maximum.accumulate(ends)
    new = np.ones(len(starts), dtype=bool)
    new[1:] = starts[1:] >= reach[:-1]
    first = np.flatnonzero(new)
    last = np.r_[first[1:], len(starts)] - 1
    return starts[first], reach[last]


def _first_outside(addr: np.ndarray, lengths: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> int:
    """The index of the first ``[addr, addr + length)`` inside no interval, or -1."""
    if len(addr) == 0:
        return -1
    starts, ends = (np.ascontiguousarray(a, dtype=_U64) for a in (starts, ends))
    addr, lengths = addr.astype(_U64, copy=False), lengths.astype(_U64, copy=False)
    return int(_native.first_outside(addr, lengths, starts, ends))


def _refuse_outside(
    what: str, addr: np.ndarray, lengths: np.ndarray, spans: tuple[np.ndarray, np.ndarray], where: str
) -> None:
    """Refuse the first ``(addr, length)`` row outside every ``[start, end)`` of ``spans``."""
    bad = _first_outside(addr, lengths, *spans)
    if bad >= 0:
        a, n = int(addr[bad]), int(lengths[bad])
        raise RefusedDescriptorError(f"{what} {bad} ({a:#x}, {n} bytes) is outside {where}")


def _check_local(
    agent: Agent, addr: np.ndarray, lengths: np.ndarray, mem: str, device: int, what: str
) -> None:
    held = _REGIONS.get(agent)
    spans = held.intervals(mem, device) if held is not None else (np.empty(0, _U64),) * 2
    where = (
        f"every region registered on agent {agent.name!r} ({len(spans[0])} {mem} regions on device {device})"
    )
    _refuse_outside(what, addr, lengths, spans, f"{where}: register the registration (and staging) first")


def _check_described(addr: np.ndarray, lengths: np.ndarray, remote: MapSide, peer: str, what: str) -> None:
    where = f"the {len(remote.tensor_spans)} tensors peer {peer!r} described"
    _refuse_outside(what, addr, lengths, _intervals(remote.tensor_spans), f"{where}; refused before posting")


def _first_unregistered(agent: Agent, peer: str, rows: np.ndarray, mem: str) -> int:
    """The first row the peer did not register with NIXL (by NIXL's own check,
    ``check_remote_metadata``, bisected), or -1 when NIXL accepts every row."""

    def accepted(lo: int, hi: int) -> bool:
        return bool(agent.check_remote_metadata(peer, agent.get_xfer_descs(rows[lo:hi], mem)))

    if len(rows) == 0 or accepted(0, len(rows)):
        return -1
    lo, hi = 0, len(rows)  # rows[lo:hi] holds a refused row
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if not accepted(lo, mid) else (mid, hi)
    return lo


def _refuse_unregistered(agent: Agent, peer: str, rows: np.ndarray, mem: str, what: str) -> None:
    present = np.flatnonzero(rows[:, 1] > 0)  # an empty span holds no memory to check
    bad = _first_unregistered(agent, peer, rows[present], mem)
    if bad >= 0:
        a, n = int(rows[present[bad], 0]), int(rows[present[bad], 1])
        raise RefusedDescriptorError(
            f"{what} {int(present[bad])} ({a:#x}, {n} bytes) is inside what peer {peer!r} described but not "
            "inside memory it registered with NIXL: its description does not match its registration; "
            "refused before posting"
        )


# -- the local copy of the staged strategy ----------------------------------------------------


_COPY_PROBLEMS = {
    1: "reads bytes outside the memory it copies from",
    2: "writes bytes outside the memory it copies to",
    3: "writes bytes another copy writes",
    4: "writes bytes another copy reads",
    5: "has no bytes",
}


def _exact_spans(spans: np.ndarray) -> np.ndarray:
    """``(start, bytes)`` stretches as the native engine's ``(start, period, block,
    blocks)`` spans: one block each, overlapping stretches merged first."""
    starts, ends = _intervals(spans)
    n = ends - starts
    return np.ascontiguousarray(np.stack([starts, n, n, np.ones_like(n)], axis=1), dtype=_U64)


def _refuse_copy(runs: np.ndarray, problem: int, run: int) -> None:
    if problem:
        src, dst, n = (int(x) for x in runs[run])
        raise RefusedDescriptorError(
            f"local copy {run} ({src:#x} -> {dst:#x}, {n} bytes) {_COPY_PROBLEMS[problem]}; "
            "nothing was copied"
        )


def _check_copies(runs: np.ndarray, from_spans: np.ndarray, to_spans: np.ndarray) -> None:
    """Refuse (before any byte moves) copies that leave their memory or overlap."""
    problem, run, _ = _native.validate_runs(runs, _exact_spans(from_spans), _exact_spans(to_spans))
    _refuse_copy(runs, problem, run)


def copy_byte_runs(
    runs: np.ndarray, from_spans: np.ndarray, to_spans: np.ndarray, *, num_threads: int = 1
) -> None:
    """Copy each ``(from, to, length)`` row of an ``(N, 3)`` uint64 array, host memory to
    host memory, on the block-map engine (``kvlayout._native.copy_runs``: native, GIL
    released): the staged strategy's gather and a READ's scatter.

    ``from_spans`` and ``to_spans`` (``(K, 2)``: start, bytes) are the memory the copies
    may read and write; every run is checked against them before a byte moves
    (:class:`RefusedDescriptorError` otherwise)."""
    _copy(runs, from_spans, to_spans, num_threads, validate=True)


def _copy(
    runs: np.ndarray, from_spans: np.ndarray, to_spans: np.ndarray, num_threads: int, validate: bool
) -> None:
    runs = np.ascontiguousarray(runs, dtype=_U64)
    a, b = _exact_spans(from_spans), _exact_spans(to_spans)
    problem, run, _, _ = _native.copy_runs(runs, a, b, num_threads, validate=validate)
    _refuse_copy(runs, problem, run)


class Staging:
    """A registered host buffer the staged strategy gathers a request into (or, for a
    READ, receives it into). One transfer uses it at a time."""

    def __init__(self, agent: Agent, nbytes: int, *, device: str | torch.device = "cpu") -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise TypeError(f"nbytes must be a positive int, got {nbytes!r}")
        dev = torch.device(device)
        if dev.type != "cpu":
            raise TransferError(
                f"staging on {dev} needs a device copy of byte runs (the block-map executor's); "
                "this module stages in host memory only"
            )
        self.agent = agent
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        self.address = self.tensor.data_ptr()
        self.nbytes = nbytes
        self.registered = register(agent, self.tensor)
        self.busy = False

    def __repr__(self) -> str:
        return f"Staging({self.nbytes} bytes at {self.address:#x}{', busy' if self.busy else ''})"

    @property
    def span(self) -> np.ndarray:
        return np.array([[self.address, self.nbytes]], dtype=_U64)

    def close(self) -> None:
        self.registered.deregister()

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- cost model ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """Predicted seconds of a request: ``per_transfer_s + descriptors * per_descriptor_s +
    bytes / bandwidth``, plus, staged, the local copy ``runs * copy_per_run_s + bytes /
    copy_bandwidth``.

    The defaults are this project's measurement of NIXL over UCX's TCP transport on
    loopback (2 cores): 128 MiB in 0.2 s as one descriptor (0.65 GB/s), 9.6 s as 524,288
    of 256 B (about 18 us a descriptor); the copy figures are :func:`copy_byte_runs` (the
    block-map engine) there, one thread: 6 GB/s, and 0.03 us a run (an NHD into HND
    request, 520,000 runs of 256 B, copies 128 MiB in 30-37 ms). :func:`calibrate`
    measures the live pair.
    """

    per_descriptor_s: float = 18e-6
    bandwidth: float = 0.65e9  # bytes/s
    per_transfer_s: float = 2e-4
    copy_per_run_s: float = 0.03e-6
    copy_bandwidth: float = 6e9  # bytes/s
    source: str = "defaults"

    def direct_s(self, descriptors: int, nbytes: int) -> float:
        return self.per_transfer_s + descriptors * self.per_descriptor_s + nbytes / self.bandwidth

    def staged_s(self, descriptors: int, runs: int, nbytes: int, stages: int = 1) -> float:
        """In ``stages`` the local copy of one stage overlaps the wire time of another:
        the slower of the two, plus one stage of the faster (the first gather before a
        WRITE posts, the last scatter after a READ lands)."""
        copy = runs * self.copy_per_run_s + nbytes / self.copy_bandwidth
        wire = self.direct_s(descriptors, nbytes)
        return max(wire, copy) + min(wire, copy) / stages


DEFAULT_COST = CostModel()


# -- plans -----------------------------------------------------------------------------------


class Stage(NamedTuple):
    """One step of a staged plan's pipeline: descriptors ``[lo, hi)`` of the plan, and
    the local copies ``[lo, hi)`` that fill (WRITE) or empty (READ) them."""

    descriptors: tuple[int, int]
    runs: tuple[int, int]


def _stages(first: np.ndarray, stretch_bytes: np.ndarray, num_runs: int, stages: int) -> tuple[Stage, ...]:
    """Cut the stretches (descriptors) into ``stages`` of about equal bytes (never more
    than the stretches); each stage's copies are its stretches' runs (``first`` is the
    first run of each stretch, in the copies' order)."""
    n, total = len(first), int(stretch_bytes.sum(dtype=_U64))
    want = max(1, min(stages, n))
    ends = np.cumsum(stretch_bytes, dtype=_U64)
    cuts = np.searchsorted(ends, np.arange(1, want, dtype=_U64) * np.uint64(total // want), side="right")
    bounds = np.unique(np.r_[0, cuts, n].astype(np.int64))
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
    direct), and the predicted seconds of each strategy considered."""

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
    # check_copy passed: the copies (read-only) are not checked again when they run.
    _copy_checked: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.copies is not None:
            self.copies.setflags(write=False)

    @property
    def num_descriptors(self) -> int:
        return len(self.local)

    def copy_stage(self, stage: int) -> None:
        """The local copy of one stage (its gather or scatter), on the block-map engine."""
        assert self.copies is not None and self.copy_spans is not None
        lo, hi = self.stages[stage].runs
        _copy(self.copies[lo:hi], *self.copy_spans, 1, validate=not self._copy_checked)

    def check_copy(self) -> None:
        """Refuse a staged plan whose local copy leaves its memory (before any byte moves)."""
        if self.copies is not None and not self._copy_checked:
            assert self.copy_spans is not None
            _check_copies(self.copies, *self.copy_spans)
            object.__setattr__(self, "_copy_checked", True)

    def copy(self, num_threads: int = 1) -> None:
        """Run the local copy of a staged plan (the gather before a WRITE, the scatter
        after a READ) on the block-map engine; nothing for a direct plan."""
        if self.copies is not None:
            assert self.copy_spans is not None
            _copy(self.copies, *self.copy_spans, num_threads, validate=not self._copy_checked)


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
    stretches (consecutive there, inside one tensor of ``side``; a stretch that would
    cross from one into the next goes as its runs), laid out stretch after stretch in a
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
    handshake (its address and bytes): where a peer-staged WRITE lands, for the peer to
    scatter with :func:`unstage`, or where a peer-staged READ reads what the peer
    gathered with :func:`stage`. Passing it for a READ says the peer has staged this
    request there (``"auto"`` may then read it)."""

    address: int
    nbytes: int


def plan(
    block_map: NixlMap,
    *,
    strategy: Strategy = "auto",
    staging: Staging | None = None,
    cost: CostModel | None = None,
    stages: int = 1,
    peer_staging: PeerStaging | None = None,
) -> Plan:
    """The descriptors one request posts, by ``strategy`` (``"auto"``: the cheapest by
    ``cost``; staged is considered only with a ``staging`` buffer large enough,
    peer-staged only with a ``peer_staging`` buffer large enough).

    A staged plan of ``stages`` > 1 (never more than its descriptors) is a pipeline:
    :func:`transfer` posts each stage as soon as its gather is done (a READ: scatters
    each as soon as it lands), so the local copy overlaps the wire. The default is one
    stage: on this project's 2-core loopback, where UCX's TCP send and the peer's receive
    take both cores, 8 stages measured 0.77-1.22x one stage, no consistent gain
    (``make bench-pd``); a pipeline is for a host whose wire is a NIC's DMA and whose
    copy has a core to itself.

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
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise TypeError(f"stages must be a positive int, got {stages!r}")
    s = _sides(block_map)
    local_mem, remote_mem = _mem_type(s.local, "local"), _mem_type(s.remote, "remote")
    num_runs, num_bytes = len(s.lengths), s.num_bytes
    model = cost or DEFAULT_COST
    predicted = {"direct": model.direct_s(num_runs, num_bytes)}
    fits = staging is not None and staging.nbytes >= num_bytes
    if strategy == "staged" and not fits:
        have = "no staging buffer" if staging is None else f"a staging buffer of {staging.nbytes} bytes"
        raise TransferError(f"the staged strategy needs a staging buffer of {num_bytes} bytes; got {have}")
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
            "direct", s.op, *_direct_rows(s), local_mem, remote_mem, None, num_runs, num_bytes, predicted
        )
    }
    if strategy in ("auto", "staged") and fits:
        assert staging is not None
        if local_mem != "DRAM":
            raise TransferError("the staged strategy stages host memory; the local side is VRAM")
        builders["staged"] = _staged(s, staging, model, stages, predicted, final=strategy == "staged")
    if strategy in ("auto", "peer-staged") and peer_fits:
        assert peer_staging is not None
        builders["peer-staged"] = _peer_staged(s, peer_staging, model, stages, predicted)
    rank = {k: (predicted[k], _scatters(k, s.op)) for k in builders}
    choice = strategy if strategy != "auto" else min(builders, key=rank.__getitem__)
    return builders[choice]()


def _scatters(strategy: str, op: Op) -> bool:
    """Whether the strategy's copy is a scatter (reads the staging buffer in order, writes
    the runs where they lie): a staged READ's, a peer-staged WRITE's (the peer's). Of two
    strategies predicted alike, ``"auto"`` takes the one whose copy gathers: scattering
    NHD -> HND's 520,000 runs of 256 B measured 48-68 ms standalone and 106-126 ms after a
    READ landed, against 41-46 ms to gather them (``make bench-pd``: a peer-staged READ
    0.21-0.24 s, a staged one 0.36-0.40 s, both 64 descriptors)."""
    return (strategy == "staged" and op == "READ") or (strategy == "peer-staged" and op == "WRITE")


def _staged(
    s: _Sides, staging: Staging, model: CostModel, stages: int, predicted: dict[str, float], *, final: bool
) -> Callable[[], Plan]:
    """Records the staged plan's cost; returns what builds it. The staging buffer is laid
    out as the remote side's stretches; the copy gathers into it before a WRITE and
    scatters out of it after a READ (``final``: it will be built, so the copies are made
    in the same pass)."""
    local_mem, remote_mem = _mem_type(s.local, "local"), _mem_type(s.remote, "remote")
    num_runs, num_bytes = len(s.lengths), s.num_bytes
    copies = 1 if s.op == "WRITE" else 2
    st: _Stretches | None = None
    if final or stages > 1:
        st = _stretches(s.runs, s.remote_col, s.remote, staging.address, copies if final else 0)
        descriptors = len(st.first)
        num_stages = len(_stages(st.first, st.nbytes, num_runs, stages))
    else:  # a candidate of one stage is priced by its descriptor count, laid out only if chosen
        descriptors = _stretch_count(s.block_map, s.runs, s.remote_col, s.remote)
        num_stages = min(descriptors, 1)  # what _stages gives for one stage: none without stretches
    predicted["staged"] = model.staged_s(descriptors, num_runs, num_bytes, num_stages)
    held, staged = s.local.tensor_spans, np.array([[staging.address, staging.nbytes]], dtype=_U64)

    def build() -> Plan:
        done = (
            st if final and st is not None
            else _stretches(s.runs, s.remote_col, s.remote, staging.address, copies, st.order if st else None)
        )  # fmt: skip
        pipeline = _stages(done.first, done.nbytes, num_runs, stages)
        return Plan(
            "staged", s.op, _rows(done.staged, done.nbytes, s.local.device_index),
            _rows(done.addr, done.nbytes, s.remote.device_index), local_mem, remote_mem, done.copies,
            num_runs, num_bytes, predicted, (held, staged) if s.op == "WRITE" else (staged, held), pipeline,
        )  # fmt: skip

    return build


def _peer_staged(
    s: _Sides, peer_staging: PeerStaging, model: CostModel, stages: int, predicted: dict[str, float]
) -> Callable[[], Plan]:
    """Records the peer-staged plan's cost; returns what builds it: the runs in the order
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
    predicted["peer-staged"] = model.staged_s(count, num_runs, num_bytes, max(1, min(stages, count)))

    def build() -> Plan:
        st = _stretches(s.runs, s.local_col, s.local, peer_staging.address)
        return Plan(
            "peer-staged", s.op, _rows(st.addr, st.nbytes, s.local.device_index),
            _rows(st.staged, st.nbytes, s.remote.device_index), _mem_type(s.local, "local"),
            "DRAM", None, num_runs, num_bytes, predicted, None,
            _stages(st.first, st.nbytes, num_runs, stages),
        )  # fmt: skip

    return build


def stage_notif(tag: bytes, stage: int, stages: int) -> bytes:
    """The NIXL notification that announces stage ``stage`` of a ``stages``-stage
    peer-staged request tagged ``tag``: the tag itself for a request of one stage, else
    ``tag + b"#stage/stages"``. A pipelined WRITE's stage lands with it (its poster
    passes ``notif=tag``); a pipelined READ's stage is gathered when the peer sends it
    (:func:`stage` with ``notifs``; its poster passes ``peer_ready=tag``)."""
    return tag if stages == 1 else tag + b"#%d/%d" % (stage, stages)


class StageNotifs(NamedTuple):
    """What paces the peer's half of a pipelined peer-staged request: this side's
    ``agent``, the poster's agent name ``peer`` (loaded with ``add_remote_agent`` where
    notifications go to it) and the request's ``tag``. Notifications are found with
    NIXL's ``check_remote_xfer_done``, which keeps the others in ``agent.notifs``."""

    agent: Agent
    peer: str
    tag: bytes


def _peer_plan(block_map: NixlMap, staging: Staging, op: Op, wrong_side: str, stages: int) -> Plan:
    """This side's staged plan of ``block_map`` (laid out as the poster's runs, cut into
    the poster's ``stages``), which must be ``op``; its copy checked."""
    p = plan(block_map, strategy="staged", staging=staging, stages=stages)
    if p.op != op:
        raise TransferError(wrong_side)
    p.check_copy()
    return p


def _settle(copies: list[Future[None]]) -> None:
    """Cancel the local copies not yet started and wait for the one under way: none
    touches its memory once this returns (the caller may reuse or let go of it)."""
    for fut in copies:
        fut.cancel()
    wait_for(copies)


def _progress_until(fut: Future[None], agent: Agent, deadline: float, what: str) -> None:
    """Wait for a local copy, driving NIXL meanwhile (an agent without a progress thread
    moves bytes only when called); :class:`NixlTimeoutError` past ``deadline``."""
    while not fut.done():
        if time.perf_counter() > deadline:
            raise NixlTimeoutError(f"{what} was not done in time")
        agent.update_notifs()
        time.sleep(1e-4)
    fut.result()


def stage(
    block_map: NixlMap,
    staging: Staging,
    *,
    num_threads: int = 1,
    stages: int = 1,
    notifs: StageNotifs | None = None,
    timeout: float = 30.0,
) -> None:
    """The source half of a peer-staged READ: gather the request from the cache here into
    ``staging`` (this side's staging buffer, the :class:`PeerStaging` the destination was
    given), laid out as the destination's runs, before telling the destination to READ
    it. ``block_map`` is the request's map with this side as its source
    (``block_map(this registration, destination description, ...)``); every copy is
    checked before a byte moves.

    With ``notifs`` each of ``stages`` (the poster's count) is announced to the poster
    once gathered (:func:`stage_notif`), so its READ of one stage overlaps the gather of
    the next (the poster passes ``peer_ready=notifs.tag``); the gathers then run on one
    thread beside this one, which drives NIXL."""
    wrong = "stage runs on the source side of the map (the side a peer-staged READ reads)"
    p = _peer_plan(block_map, staging, "WRITE", wrong, stages)
    if notifs is None:
        p.copy(num_threads)
        return
    n, deadline = len(p.stages), time.perf_counter() + timeout
    gathers = [_copier().submit(p.copy_stage, i) for i in range(n)]
    try:
        for i, fut in enumerate(gathers):
            _progress_until(fut, notifs.agent, deadline, f"the gather of stage {i} of {n}")
            notifs.agent.send_notif(notifs.peer, stage_notif(notifs.tag, i, n))
    finally:
        _settle(gathers)


def unstage(
    block_map: NixlMap,
    staging: Staging,
    *,
    num_threads: int = 1,
    stages: int = 1,
    notifs: StageNotifs | None = None,
    timeout: float = 30.0,
) -> None:
    """The receiving half of a peer-staged WRITE: scatter what landed in ``staging``
    (this side's staging buffer, the :class:`PeerStaging` the source was given) into the
    request's slots here. ``block_map`` is the request's map with this side as its
    destination (``block_map(source description, this registration, ...)``: the same
    runs the source planned); every copy is checked before a byte moves.

    Without ``notifs`` every byte has landed (the caller had the WRITE's notification).
    With ``notifs``, call it before or while the WRITE of ``stages`` (the poster's count,
    its ``notif=notifs.tag``) is under way: each stage is scattered as soon as its
    notification (:func:`stage_notif`) arrives, on one thread beside this one, while this
    one waits for the next; :class:`NixlTimeoutError` if the request has not landed and
    been scattered within ``timeout`` seconds."""
    wrong = "unstage runs on the destination side of the map (the side the peer-staged WRITE reached)"
    p = _peer_plan(block_map, staging, "READ", wrong, stages)
    if notifs is None:
        p.copy(num_threads)
        return
    n, deadline = len(p.stages), time.perf_counter() + timeout
    waiting, scatters = list(range(n)), []
    try:
        while waiting:
            landed = [i for i in waiting if notifs.agent.check_remote_xfer_done(
                notifs.peer, stage_notif(notifs.tag, i, n)
            )]  # fmt: skip
            for i in landed:
                scatters.append(_copier().submit(p.copy_stage, i))
                waiting.remove(i)
            if waiting and time.perf_counter() > deadline:
                raise NixlTimeoutError(
                    f"stages {waiting} of {n} of the peer-staged WRITE {notifs.tag!r} from peer "
                    f"{notifs.peer!r} had not landed after {timeout:g} s"
                )
            if waiting and not landed:
                time.sleep(1e-4)
        for fut in scatters:
            _progress_until(fut, notifs.agent, deadline, f"a scatter of the peer-staged WRITE {notifs.tag!r}")
    finally:
        _settle(scatters)


class Estimate(NamedTuple):
    """What a map would cost before anything exists to post it (:func:`estimate`)."""

    op: Op
    num_runs: int
    num_bytes: int
    descriptors: dict[str, int]  # per strategy
    predicted_s: dict[str, float]  # per strategy
    choice: Strategy


def estimate(
    block_map: NixlMap, *, poster: Literal["src", "dst"] = "dst", cost: CostModel | None = None
) -> Estimate:
    """Descriptors and predicted seconds of each strategy for a map whose sides need not
    be live (two descriptions, at planning time), posted by ``poster`` (``"dst"``: a READ,
    as vLLM's decode side posts; ``"src"``: a WRITE), peer-staged included, and
    the strategy ``"auto"`` picks given staging buffers large enough: what :func:`plan`
    would choose."""
    if poster not in ("src", "dst"):
        raise TransferError(f"poster must be 'src' or 'dst', not {poster!r}")
    runs = np.ascontiguousarray(block_map.runs, dtype=_U64)
    lengths = runs[:, 2]
    num_runs, num_bytes = len(lengths), int(lengths.sum(dtype=_U64))
    model = cost or DEFAULT_COST
    descriptors = {"direct": num_runs}
    predicted = {"direct": model.direct_s(num_runs, num_bytes)}
    remote, col = (block_map.dst, 1) if poster == "src" else (block_map.src, 0)
    staged = _stretch_count(block_map, runs, col, remote)
    descriptors["staged"], predicted["staged"] = staged, model.staged_s(staged, num_runs, num_bytes)
    own_side, own_col = (block_map.src, 0) if poster == "src" else (block_map.dst, 1)
    own = _stretch_count(block_map, runs, own_col, own_side)  # the poster's, to or from the peer's staging
    descriptors["peer-staged"] = own
    predicted["peer-staged"] = model.staged_s(own, num_runs, num_bytes)
    choice = min(predicted, key=lambda k: predicted[k])
    op: Op = "WRITE" if poster == "src" else "READ"
    return Estimate(op, num_runs, num_bytes, descriptors, predicted, cast(Strategy, choice))


# -- the prepped form --------------------------------------------------------------------------


class PreppedList:
    """One side prepared as a NIXL list of ``unit``-byte descriptors (one Nx5 dense row
    per memory interval), indexed by unit: unit ``j`` of interval ``k`` is index
    ``first[k] + j``."""

    def __init__(self, handle: Any, unit: int, starts: np.ndarray, counts: np.ndarray, mem: str) -> None:
        self.handle = handle
        self.unit = unit
        self.starts = starts
        self.counts = counts
        self.first = np.r_[0, np.cumsum(counts)[:-1]].astype(np.int64)
        self.mem = mem

    @property
    def size(self) -> int:
        return int(self.counts.sum())

    def indices(self, rows: np.ndarray, what: str) -> np.ndarray:
        """The int32 unit indices covering each ``(address, length, device)`` row in turn."""
        addr, lengths = rows[:, 0], rows[:, 1]
        u = np.uint64(self.unit)
        k = np.searchsorted(self.starts, addr, side="right").astype(np.int64) - 1
        kk = np.maximum(k, 0)
        offset = addr - self.starts[kk]
        inside = (k >= 0) & (addr + lengths <= self.starts[kk] + self.counts[kk].astype(_U64) * u)
        whole = (offset % u == 0) & (lengths % u == 0)
        outside = f"is outside the {len(self.starts)} stretches of memory prepared at the handshake"
        split = (
            f"is not whole {self.unit}-byte units of the list prepared at the handshake (prepare with a unit "
            "every run is a multiple of, or send in the list form)"
        )
        for ok, problem in ((inside, outside), (whole, split)):
            if not ok.all():
                bad = int(np.argmin(ok))
                raise RefusedDescriptorError(
                    f"{what} {bad} ({int(addr[bad]):#x}, {int(lengths[bad])} bytes) {problem}"
                )
        counts = (lengths // u).astype(np.int64)
        starts = self.first[kk] + (offset // u).astype(np.int64)
        before = np.cumsum(counts) - counts
        idx = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(starts - before, counts)
        out: np.ndarray = idx.astype(np.int32)
        return out


@dataclass(frozen=True)
class Prepped:
    """Both sides of a pair prepared once (at the handshake) for index-array requests."""

    peer: str
    local: PreppedList
    remote: PreppedList


def _prep_list(agent: Agent, name: str, spans: np.ndarray, unit: int, device: int, mem: str) -> PreppedList:
    starts, ends = _intervals(spans)
    counts = ((ends - starts) // np.uint64(unit)).astype(np.int64)
    starts, counts = starts[counts > 0], counts[counts > 0]  # shorter than a unit: no unit to send
    if int(counts.sum()) >= 2**31:
        raise TransferError(
            f"{int(counts.sum())} units of {unit} bytes do not fit NIXL's int32 indices; use a larger unit"
        )
    rows = np.empty((len(starts), 5), dtype=_U64)
    rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 4] = starts, unit, device, unit, counts
    handle = agent.prep_xfer_dlist(name, rows, mem)
    return PreppedList(handle, unit, starts, counts, mem)


def prep_lists(
    agent: Agent,
    peer: str | bytes,
    local: MapSide,
    remote: MapSide,
    unit: int,
    *,
    staging: Staging | None = None,
) -> Prepped:
    """Prepare both sides once, as lists of ``unit``-byte descriptors over each side's
    tensors (and the staging buffer, on the local side), for :func:`transfer`'s
    ``prepped=``. ``unit`` is the block unit every request's runs are whole multiples
    of, at unit-aligned offsets (vLLM's: one layer's K or V of a block). NIXL checks the
    remote list against what the peer registered; a description that lies is refused
    here, naming the tensor."""
    if isinstance(unit, bool) or not isinstance(unit, int) or unit <= 0:
        raise TypeError(f"unit must be a positive int, got {unit!r}")
    peer = _peer_name(peer)
    if not local.is_local or remote.is_local:
        raise TransferError("prep_lists takes the local side first, then the peer's")
    local_mem, remote_mem = _mem_type(local, "local"), _mem_type(remote, "remote")
    held = local.tensor_spans if staging is None else np.concatenate([local.tensor_spans, staging.span])
    starts, ends = _intervals(held)
    _check_local(agent, starts, ends - starts, local_mem, local.device_index, "local stretch")
    spans = np.asarray(remote.tensor_spans, dtype=_U64).reshape(-1, 2)
    _refuse_unregistered(
        agent, peer, _rows(spans[:, 0], spans[:, 1], remote.device_index), remote_mem, "described tensor"
    )
    return Prepped(
        peer,
        _prep_list(agent, "NIXL_INIT_AGENT", held, unit, local.device_index, local_mem),
        _prep_list(agent, peer, remote.tensor_spans, unit, remote.device_index, remote_mem),
    )


# -- posting and waiting ----------------------------------------------------------------------


class TransferResult(NamedTuple):
    """A finished transfer: its strategy, descriptors posted (NIXL's count after its
    merge when the agent captures telemetry, else the count posted), bytes, seconds from
    post to done (including a READ's scatter)."""

    strategy: str
    descriptors: int
    num_bytes: int
    seconds: float


def _peer_name(peer: str | bytes) -> str:
    """An agent name as ``add_remote_agent`` returns it (bytes) or as given (str)."""
    return peer.decode() if isinstance(peer, bytes) else peer


def _is_nixl_error(exc: BaseException) -> bool:
    return type(exc).__module__.split(".")[0].startswith("nixl")


_copier_lock = threading.Lock()
_copier_pool: list[ThreadPoolExecutor] = []  # made on first use


def _copier() -> ThreadPoolExecutor:
    """The thread that runs staged pipelines' local copies (native, GIL released), so a
    stage's gather or scatter overlaps another's wire time while the polling thread
    drives NIXL (every NIXL call stays on the caller's thread)."""
    with _copier_lock:
        if not _copier_pool:
            _copier_pool.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlayout-nixl-copy"))
        return _copier_pool[0]


class Transfer:
    """A posted request: poll with :meth:`done`, finish with :meth:`wait`.

    A staged plan of several stages runs as a pipeline: a WRITE's gathers run on a
    background thread and each stage is posted (by :meth:`done`, on the polling thread)
    once its gather is done; a READ posts every stage at once and scatters each as it
    lands. ``notif`` then goes to the peer (``send_notif``) once every stage has landed,
    so it still means "the whole request is there". A peer-staged plan's stages are the
    peer's: a WRITE posts them all at once, each landing with its own
    :func:`stage_notif`; a READ with ``ready`` posts stage ``i`` once the peer has sent
    ``stage_notif(ready, i, stages)``."""

    def __init__(
        self,
        agent: Agent,
        peer: str,
        plan: Plan,
        handles: list[Any],
        staging: Staging | None = None,
        notif: bytes = b"",
        ready: bytes | None = None,
    ) -> None:
        self.agent = agent
        self.peer = peer
        self.plan = plan
        self.handles = handles  # one per stage, in order
        self.staging = staging
        self.notif = notif  # sent after the last stage (a pipeline); b"" when NIXL sends it
        self.ready = ready  # a peer-staged READ's tag: stage i goes once the peer announced it
        self.posted_at = time.perf_counter()
        self._posted = 0
        self._landed = [False] * len(handles)
        self._copies: list[Future[None]] = []  # a WRITE's gathers, a READ's scatters (a pipeline)
        self._count = 0
        self._result: TransferResult | None = None

    def __repr__(self) -> str:
        return f"Transfer({self._what()})"

    @property
    def _pipelined(self) -> bool:
        return len(self.handles) > 1

    def _what(self) -> str:
        p = self.plan
        counts = f"{p.num_descriptors} descriptors, {p.num_bytes} bytes"
        stages = f", {len(self.handles)} stages" if self._pipelined else ""
        return f"the {p.op} to peer {self.peer!r} ({p.strategy}, {counts}{stages})"

    def _fail(self, why: str) -> NixlError:
        self._release()
        return NixlError(f"NIXL failed {self._what()}: {why}")

    def _nixl(self, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except Exception as exc:
            if not _is_nixl_error(exc):
                raise
            raise self._fail(f"{type(exc).__name__}: {exc}") from exc

    def _post(self) -> None:
        if self._nixl(self.agent.transfer, self.handles[self._posted]) == "ERR":
            raise self._fail('transfer returned "ERR"')
        self._posted += 1

    @property
    def posted(self) -> int:
        """How many of its stages (NIXL requests) have been posted so far."""
        return self._posted

    @property
    def _gathers(self) -> bool:
        """A staged WRITE's pipeline: each stage waits for its gather."""
        return self._pipelined and self.plan.op == "WRITE" and self.plan.copies is not None

    def start(self) -> None:
        """Post the plan (:func:`transfer` calls it once; the handles are made)."""
        p = self.plan
        if self._gathers:
            pool = _copier()
            self._copies = [pool.submit(p.copy_stage, i) for i in range(len(self.handles))]
            self._copied(0, wait=True)
        elif p.op == "WRITE":
            p.copy()  # gather into staging (none peer-staged): validated, nothing posted yet
        self._post_ready()

    def _post_ready(self) -> None:
        """Post, in order, the stages that may go: gathered (a staged WRITE's pipeline),
        announced by the peer (a READ with ``ready``), else all."""
        n = len(self.handles)
        while self._posted < n:
            i = self._posted
            if self._gathers and not self._copied(i):
                return
            if self.ready is not None and not self._nixl(
                self.agent.check_remote_xfer_done, self.peer, stage_notif(self.ready, i, n)
            ):
                return
            self._post()

    def _copied(self, stage: int, *, wait: bool = False) -> bool:
        """Whether the local copy of ``stage`` is done (raising what it raised)."""
        f = self._copies[stage]
        if not wait and not f.done():
            return False
        try:
            f.result()
        except TransferError as exc:
            raise self._fail(f"the local copy of stage {stage}: {exc}") from exc
        return True

    def _poll(self) -> None:
        """Post the stages that may go; note the posted ones that landed."""
        self._post_ready()
        for i in range(self._posted):
            if self._landed[i]:
                continue
            state = self._nixl(self.agent.check_xfer_state, self.handles[i])
            if state == "ERR":
                raise self._fail(
                    'check_xfer_state returned "ERR"' + (f" for stage {i}" if self._pipelined else "")
                )
            if state != "DONE":
                continue
            self._landed[i] = True
            lo, hi = self.plan.stages[i].descriptors if self._pipelined else (0, self.plan.num_descriptors)
            try:
                self._count += int(self.agent.get_xfer_telemetry(self.handles[i]).descCount)
            except Exception as exc:
                if not _is_nixl_error(exc):
                    raise
                self._count += hi - lo
            if self.plan.op == "READ" and self.plan.copies is not None:
                if self._pipelined:
                    self._copies.append(_copier().submit(self.plan.copy_stage, i))
                else:
                    self.plan.copy()  # the scatter out of staging (checked before posting)

    def done(self) -> bool:
        """True once the transfer is complete (a READ's scatter done); raises
        :class:`NixlError` when NIXL reports ``"ERR"`` or an error."""
        if self._result is not None:
            return True
        self._poll()
        if not all(self._landed):
            return False
        if not all(self._copied(i) for i in range(len(self._copies))):
            return False
        if self.notif:
            self._nixl(self.agent.send_notif, self.peer, self.notif)
        seconds = time.perf_counter() - self.posted_at
        self._release()
        self._result = TransferResult(self.plan.strategy, self._count, self.plan.num_bytes, seconds)
        return True

    def wait(self, timeout: float = 30.0) -> TransferResult:
        """Poll until done; :class:`NixlTimeoutError` after ``timeout`` seconds (the
        request is released, which asks NIXL to cancel it)."""
        deadline = time.perf_counter() + timeout
        while not self.done():
            if time.perf_counter() > deadline:
                cancelled = self._release()
                raise NixlTimeoutError(
                    f"{self._what()} was not done after {timeout:g} s; "
                    + ("it was cancelled" if cancelled else "NIXL could not cancel it (the handle is kept)")
                )
            time.sleep(1e-4)  # leave the cores to NIXL's progress thread
        assert self._result is not None
        return self._result

    def _release(self) -> bool:
        """Release the NIXL requests (cancelling the active ones) once no local copy is
        running; False if NIXL refused one."""
        _settle(self._copies)
        released = True
        for h in self.handles:
            try:
                self.agent.release_xfer_handle(h)
            except Exception as exc:
                if not _is_nixl_error(exc):
                    raise
                released = False
        if released and self.staging is not None:
            self.staging.busy = False
        return released


def wait(xfer: Transfer, timeout: float = 30.0) -> TransferResult:
    """:meth:`Transfer.wait`, as a function."""
    return xfer.wait(timeout)


def transfer(
    agent: Agent,
    peer: str | bytes,
    block_map: NixlMap,
    *,
    notif: bytes = b"",
    strategy: Strategy = "auto",
    staging: Staging | None = None,
    prepped: Prepped | None = None,
    cost: CostModel | None = None,
    stages: int = 1,
    peer_staging: PeerStaging | None = None,
    peer_ready: bytes | None = None,
) -> Transfer:
    """Post one request's map to ``peer`` (an agent name loaded with
    ``add_remote_agent``); ``notif`` reaches the peer when the bytes have landed.

    Every descriptor is checked before anything is posted: the local ones inside regions
    registered on ``agent`` (the staging buffer's included), the remote ones inside the
    tensors the peer described and, in the list form, inside what it registered with
    NIXL (NIXL's own check). ``prepped`` sends index arrays into lists prepared by
    :func:`prep_lists` instead of descriptor lists. A ``staging`` buffer still in use by
    an earlier transfer leaves ``"auto"`` direct, and is an error for ``"staged"``.
    ``stages`` cuts a staged plan into a pipeline (:func:`plan`); each stage is one NIXL
    request, all made (and so checked by NIXL) before the first byte moves.
    ``peer_staging`` (the peer's staging buffer, from the handshake) lets the request go
    peer-staged: for a WRITE the peer must then :func:`unstage` it once ``notif`` arrives;
    a READ needs the peer to have run :func:`stage` first (``Transfer.plan.strategy``
    says which strategy went).

    A peer-staged request of ``stages`` > 1 is the peer's pipeline: a WRITE posts every
    stage at once, stage ``i`` landing with ``stage_notif(notif, i, stages)`` so the
    peer's :func:`unstage` (with :class:`StageNotifs`) scatters it while the next is on
    the wire; a READ given ``peer_ready`` (a tag) posts stage ``i`` once the peer's
    :func:`stage` announces it with ``stage_notif(peer_ready, i, stages)`` (with one
    stage, once it announces the whole request), so the peer's gather of one stage
    overlaps the wire of another. Both sides pass the same ``stages``.
    """
    peer = _peer_name(peer)
    if staging is not None and staging.busy:
        if strategy == "staged":
            raise TransferError(f"{staging!r} is in use by a transfer not yet waited for")
        staging = None
    if prepped is not None and strategy != "peer-staged":
        peer_staging = None  # the prepped lists do not reach the peer's staging buffer
    p = plan(
        block_map, strategy=strategy, staging=staging, cost=cost, stages=stages, peer_staging=peer_staging
    )
    if p.strategy == "peer-staged" and prepped is not None:
        raise TransferError(
            "the prepped lists cover the peer's cache, not its staging buffer: post peer-staged as lists"
        )
    if peer_ready is not None and (p.strategy, p.op) != ("peer-staged", "READ"):
        raise TransferError(
            f"peer_ready paces a peer-staged READ by the peer's notifications; this request is a "
            f"{p.strategy} {p.op} (pass strategy='peer-staged' on the destination's side)"
        )
    s = _sides(block_map)
    local_dev = s.local.device_index
    _check_local(agent, s.local_addr, s.lengths, p.local_mem, local_dev, "local run")
    if p.copies is not None:
        _check_local(agent, p.local[:, 0], p.local[:, 1], p.local_mem, local_dev, "staged descriptor")
    _check_described(s.remote_addr, s.lengths, s.remote, peer, "remote run")
    p.check_copy()
    if prepped is not None and prepped.peer != peer:
        raise TransferError(f"the lists were prepared for peer {prepped.peer!r}, not {peer!r}")
    parts = [st.descriptors for st in p.stages] if len(p.stages) > 1 else [(0, p.num_descriptors)]
    # A pipeline sends notif once after its last stage; a peer-staged WRITE's stages each
    # land with their own, which paces the peer's scatter.
    by_stage = p.strategy == "peer-staged" and p.op == "WRITE" and bool(notif)
    stage_notifs = [
        stage_notif(notif, i, len(parts)) if by_stage else notif if len(parts) == 1 else b""
        for i in range(len(parts))
    ]
    handles: list[Any] = []
    try:
        for (lo, hi), one_notif in zip(parts, stage_notifs, strict=True):
            if prepped is not None:
                local_idx = prepped.local.indices(p.local[lo:hi], "local descriptor")
                remote_idx = prepped.remote.indices(p.remote[lo:hi], "remote descriptor")
                handles.append(agent.make_prepped_xfer(
                    p.op, prepped.local.handle, local_idx, prepped.remote.handle, remote_idx, one_notif
                ))  # fmt: skip
            else:
                local = agent.get_xfer_descs(p.local[lo:hi], p.local_mem)
                remote = agent.get_xfer_descs(p.remote[lo:hi], p.remote_mem)
                handles.append(agent.initialize_xfer(p.op, local, remote, peer, one_notif))
    except Exception as exc:
        for h in handles:
            agent.release_xfer_handle(h)
        if not _is_nixl_error(exc):
            raise
        if prepped is None:  # name the descriptor NIXL found outside the peer's registration
            _refuse_unregistered(agent, peer, p.remote, p.remote_mem, "remote descriptor")
        raise NixlError(f"NIXL refused the {p.op} to peer {peer!r}: {type(exc).__name__}: {exc}") from exc
    xfer = Transfer(
        agent, peer, p, handles, staging if p.copies is not None else None,
        notif if len(parts) > 1 and not by_stage else b"", peer_ready,
    )  # fmt: skip
    if xfer.staging is not None:
        xfer.staging.busy = True
    xfer.start()
    return xfer


# -- calibration -------------------------------------------------------------------------------


def _timed_xfer(
    agent: Agent, op: Op, peer: str, local: np.ndarray, remote: np.ndarray, rmem: str, timeout: float
) -> float:
    handle = agent.initialize_xfer(
        op, agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, rmem), peer
    )
    start = time.perf_counter()
    state = agent.transfer(handle)
    while state == "PROC":
        if time.perf_counter() - start > timeout:
            agent.release_xfer_handle(handle)
            raise NixlTimeoutError(f"a calibration {op} with peer {peer!r} was not done after {timeout:g} s")
        state = agent.check_xfer_state(handle)
    agent.release_xfer_handle(handle)
    if state != "DONE":
        raise NixlError(f"a calibration {op} with peer {peer!r} ended in {state}")
    return time.perf_counter() - start


def calibrate(
    agent: Agent,
    peer: str | bytes,
    remote: MapSide,
    *,
    op: Op = "READ",
    nbytes: int = 4 << 20,
    small: int = 1024,
    count: int = 2048,
    repeats: int = 3,
    timeout: float = 30.0,
) -> CostModel:
    """A :class:`CostModel` measured on the live pair with ``op`` transfers between a
    scratch buffer registered for the call and the peer's largest described tensor: one
    small descriptor, ``count`` small ones and one of ``nbytes``, the fastest of
    ``repeats`` each; then the local copy (:func:`_calibrate_copy`).

    ``"READ"`` leaves the peer's memory as it is; ``"WRITE"`` (the op a prefill side
    posts) overwrites its first bytes: only for a tensor that is scratch to the peer.
    """
    if op not in ("READ", "WRITE"):
        raise TransferError(f"op must be 'READ' or 'WRITE', not {op!r}")
    peer = _peer_name(peer)
    starts, ends = _intervals(remote.tensor_spans)
    if len(starts) == 0:
        raise TransferError(f"peer {peer!r} described no memory to calibrate against")
    k = int(np.argmax(ends - starts))
    base, span = int(starts[k]), int(ends[k] - starts[k])
    nbytes = min(nbytes, span)
    count = max(2, min(count, span // (2 * small)))
    rmem, dev = _mem_type(remote, "remote"), remote.device_index
    spaced = np.arange(count, dtype=_U64) * np.uint64(2 * small)  # gaps: nothing merges
    theirs = {
        "one": np.array([[base, small, dev]], _U64),
        "many": _rows(base + spaced, np.full(count, small, _U64), dev),
        "big": np.array([[base, nbytes, dev]], _U64),
    }
    _refuse_unregistered(agent, peer, np.concatenate(list(theirs.values())), rmem, "calibration descriptor")
    scratch = torch.empty(max(nbytes, 2 * small * count), dtype=torch.uint8)
    addr = scratch.data_ptr()
    ours = {
        name: rows - np.array([base, 0, dev], _U64) + np.array([addr, 0, 0], _U64)
        for name, rows in theirs.items()
    }
    with register(agent, scratch):
        t = {
            name: min(
                _timed_xfer(agent, op, peer, ours[name], theirs[name], rmem, timeout) for _ in range(repeats)
            )
            for name in ("one", "many", "big")
        }
    per_run, copy_bandwidth = _calibrate_copy(small, count, repeats)
    return CostModel(
        per_descriptor_s=max((t["many"] - t["one"]) / (count - 1), 1e-9),
        bandwidth=nbytes / max(t["big"] - t["one"], 1e-9),
        per_transfer_s=t["one"],
        copy_per_run_s=per_run,
        copy_bandwidth=copy_bandwidth,
        source=f"calibrated against peer {peer!r}",
    )


# The local copy is measured on buffers larger than a host's caches, as a request's are.
_COPY_CALIBRATION_BYTES = 32 << 20


def _calibrate_copy(small: int, count: int, repeats: int) -> tuple[float, float]:
    """Seconds a run and bytes a second of :func:`copy_byte_runs`: one run, ``count`` runs
    of ``small`` bytes and one of ``_COPY_CALIBRATION_BYTES``, host to host, the fastest of
    ``repeats`` each. The one-run copy's time is the call's own (checks, dispatch), taken
    out of both; the runs' bytes are the bandwidth's (counted per run, they priced a run at
    0.3-0.6 us on the 2-core loopback, where 520,000 runs of 256 B copy in about 35 ms)."""
    half = max(_COPY_CALIBRATION_BYTES, 2 * small * count)
    scratch = torch.zeros(2 * half, dtype=torch.uint8)  # zeros: its pages are touched
    addr = scratch.data_ptr()
    spaced = addr + np.arange(count, dtype=_U64) * np.uint64(2 * small)  # gaps: nothing merges
    runs = np.stack([spaced, spaced + np.uint64(half), np.full(count, small, _U64)], axis=1)
    copies = {"one": runs[:1], "many": runs, "big": np.array([[addr, addr + half, half]], _U64)}
    lo, hi = np.array([[addr, half]], _U64), np.array([[addr + half, half]], _U64)
    c = {
        name: min(_timed(lambda r=r: copy_byte_runs(r, lo, hi)) for _ in range(repeats))
        for name, r in copies.items()
    }
    bandwidth = (half - small) / max(c["big"] - c["one"], 1e-9)
    per_run = (c["many"] - c["one"] - (count - 1) * small / bandwidth) / (count - 1)
    return max(per_run, 1e-9), bandwidth


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- agents ---------------------------------------------------------------------------------


def make_agent(
    name: str, *, telemetry: bool = True, progress_thread: bool = True, backends: Iterable[str] = ("UCX",)
) -> Agent:
    """A NIXL agent (``nixl._api.nixl_agent``; the only place this module imports NIXL)
    with telemetry on, so :class:`TransferResult` reports NIXL's merged descriptor count.

    ``progress_thread=False`` suits a process that only initiates and waits: polling a
    transfer's state drives NIXL's progress (and NIXL's thread, which polls without
    pause, is not there to compete for the cores). A target that does not poll needs the
    thread, or must call ``get_new_notifs`` regularly (as :mod:`kvlayout.testing.nixl_peer` does).
    """
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:  # kvlayout[nixl] alone: the CUDA 12 build, without the `nixl` meta package
            from nixl_cu12._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise ImportError(
                "NIXL is not installed: pip install 'kvlayout[nixl]' (and pip install --no-deps nixl==1.5.1 "
                "for `import nixl`)"
            ) from exc
    config = nixl_agent_config(
        enable_prog_thread=progress_thread, backends=list(backends), capture_telemetry=telemetry
    )
    return nixl_agent(name, config)
