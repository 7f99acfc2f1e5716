"""Memory registered with NIXL, once per distinct storage, and the checks that every
descriptor lies inside what it may reach (registered here, described by the peer,
registered there)."""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvlayout import _native
from kvlayout.transfer import TransferError
from kvlayout.transfer.nixl.sides import (
    _MEM_TYPES,
    _U64,
    Agent,
    Holder,
    MapSide,
    NixlError,
    RefusedDescriptorError,
    _check_detected,
    _device,
    _tensors,
)

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
    holders (a storage registered by two registrations is registered once), and the
    regions started requests post through (pinned): deregistered while pinned, NIXL keeps
    one (and this keeps its storage) until the last such request lets go."""

    def __init__(self) -> None:
        self.count: dict[Region, int] = {}
        self.reg_lists: dict[Region, Any] = {}
        self.removals = 0  # regions deregistered so far: a request prepared before one re-checks
        self.pins: dict[Region, int] = {}  # requests in flight that post through each region
        # Each region's storage, held: its memory stays allocated while NIXL holds the region
        # (a Registered dropped without deregister() leaves it registered, as long as the
        # agent lives, never on freed memory). The storage, not the tensors viewing it: a
        # tensor re-allocated in place (``t.data = ...``, ``set_``, ``module.to``) lets go
        # of its storage, and a peer may still write there.
        self.owners: dict[Region, torch.UntypedStorage] = {}
        self.retired: dict[Region, torch.UntypedStorage] = {}  # deregistered while pinned: kept
        self.lock = threading.Lock()  # register, deregister, pin and unpin from any thread
        # The thread that first registered with the agent: its caller's, on which a
        # finalizer may let go of what a dropped object held at once (defer).
        self.caller = threading.get_ident()

    def intervals(self, mem_type: str, device: int) -> tuple[np.ndarray, np.ndarray]:
        with self.lock:
            held = sorted(
                (r.address, r.address + r.nbytes)
                for r in self.count
                if (r.mem_type, r.device) == (mem_type, device)
            )
        arr = np.array(held, dtype=_U64).reshape(-1, 2)
        return arr[:, 0], arr[:, 1]


_REGIONS: weakref.WeakKeyDictionary[Any, _AgentRegions] = weakref.WeakKeyDictionary()

# Work a finalizer leaves to the agent's caller. Letting go of what a dropped object held
# calls NIXL (release_xfer_handle, deregister_memory), and the collector runs finalizers
# on whichever thread allocates (the copier thread's, another agent's caller's), while
# the caller may be inside a NIXL call on the agent, which a default agent takes from one
# thread at a time. So a finalizer only queues its work, with its agent, and the next
# call the caller makes on that agent does it (_drain_deferred): every NIXL call is made
# on a thread the caller is calling the agent from. Each attempt returns False while a
# lock it needs is held (by another thread, or by the one that drains), and then waits
# for the call after.
_DEFERRED: deque[tuple[Any, Callable[[], bool]]] = deque()


def locks_free(*locks: Any) -> bool:
    """Whether each lock could be taken now (False for one this thread holds)."""
    for lock in locks:
        if not lock.acquire(blocking=False):
            return False
        lock.release()
    return True


def defer(agent: Agent, attempt: Callable[[], bool], pending: Callable[[], bool] | None = None) -> bool:
    """Run ``attempt`` (a finalizer's work, which may call NIXL on ``agent``) now where the
    collector runs it on the agent's caller's thread (the one that first registered with
    it) and the locks it needs are free; else leave it to the next call made on ``agent``
    (:func:`_drain_deferred`): appending takes no lock, so a finalizer never waits,
    whatever its thread holds. Done at once where it can be, the work holds no agent
    alive: every deferred entry keeps its agent, and with it its progress thread, until
    that agent's next call or ``drain`` (an agent left with work, never called again,
    spins on). ``pending`` (None: always) says whether there is work at all: an object
    let go of before it was dropped (closed, released) queues nothing. True where it was
    done at once (or there was nothing to do)."""
    if pending is not None and not pending():
        return True
    try:
        held = _REGIONS.get(agent)
    except TypeError:  # no weak reference reaches it (a stand-in for an agent): left for later
        held = None
    here = held is not None and held.caller == threading.get_ident()
    if here and not getattr(_DRAINING, "active", False) and _attempted(attempt):
        return True
    _DEFERRED.append((agent, attempt))
    return False


def _attempted(attempt: Callable[[], bool]) -> bool:
    """Whether ``attempt`` ran (False: a lock it needs is held); its error is a warning,
    not the error of whichever call it ran in."""
    try:
        return attempt()
    except Exception as exc:
        warnings.warn(
            f"kvlayout could not release what a dropped NIXL object held: {type(exc).__name__}: {exc}",
            ResourceWarning,
            stacklevel=2,
        )
        return True


_DRAINING = threading.local()


def _drain_deferred(agent: Agent) -> None:
    """Try each attempt deferred for ``agent`` once, on the thread calling it (one still
    waiting goes back for later; another agent's are left to that agent's calls). An
    attempt deregisters, which drains again: this thread's inner drains return at once
    (nested, 400 finalizers' work ran 400 calls deep), and an attempt's error is a
    warning, not the error of whichever call happened to drain."""
    if not _DEFERRED or getattr(_DRAINING, "active", False):  # the common case: nothing deferred
        return
    _DRAINING.active = True
    try:
        for _ in range(len(_DEFERRED)):
            try:
                entry = _DEFERRED.popleft()
            except IndexError:  # another thread took the last one
                return
            if entry[0] is not agent or not _attempted(entry[1]):
                _DEFERRED.append(entry)
    finally:
        _DRAINING.active = False


class Registered:
    """The NIXL registration of one registration's storages; :meth:`deregister` (or
    leaving a ``with`` block) undoes it, once no started request posts through them. Their
    memory stays allocated while registered, whatever the tensors do since (re-allocated
    in place, with ``.data =``, ``set_`` or ``module.to``, they let go of it; NIXL and a
    peer's description still name it), but for a storage resized in place
    (``untyped_storage().resize_``, a tensor's ``resize_`` past its storage), which moves
    or frees its own memory under NIXL: never resize a registered cache. Dropped
    without :meth:`deregister`, the storages stay registered (and allocated) as long as
    the agent lives, so that NIXL never reaches freed memory."""

    def __init__(self, agent: Agent, regions: tuple[Region, ...], tensors: list[torch.Tensor]) -> None:
        self.agent = agent
        self.regions = regions
        self._tensors: list[torch.Tensor] | None = tensors

    def __repr__(self) -> str:
        total = sum(r.nbytes for r in self.regions)
        state = "live" if self._tensors is not None else "deregistered"
        return f"Registered({len(self.regions)} regions, {total} bytes, {state})"

    def deregister(self) -> None:
        """Deregister the storages: now, or, for a region a started request posts
        through (NIXL may still move its bytes), when that request is done or failed (as
        :meth:`Staging.close` defers); until then the region and its storage are kept, for
        good if the request was released in flight (NIXL cannot guarantee its cancel).
        New requests through it are refused at once."""
        _drain_deferred(self.agent)
        held = _REGIONS[self.agent]
        with held.lock:  # checked and marked under it: two threads deregistering count once
            if self._tensors is None:
                return
            self._tensors = None
            for region in self.regions:
                held.count[region] -= 1
                if held.count[region] == 0:
                    del held.count[region]
                    held.removals += 1
                    owners = held.owners.pop(region)
                    if held.pins.get(region):
                        held.retired[region] = owners
                    else:
                        self.agent.deregister_memory(held.reg_lists.pop(region))

    def _registered(self) -> bool:
        """Not yet deregistered (a finalizer's ``pending``: :func:`defer`)."""
        return self._tensors is not None

    def _deregister_when_free(self) -> bool:
        """:meth:`deregister` for a finalizer (through :func:`defer`), False while the
        agent's lock is held (by another thread, or the one draining)."""
        held = _REGIONS.get(self.agent)
        if self._tensors is not None and held is not None:
            if not locks_free(held.lock):
                return False
            self.deregister()
        return True

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
    if not callable(getattr(agent, "register_memory", None)):
        raise TypeError(f"agent must be a NIXL agent (nx.make_agent), not {type(agent).__name__}")
    _check_detected(registration)
    _drain_deferred(agent)
    tensors = [t for t in _tensors(registration) if t.numel()]
    if not tensors:
        raise TransferError("the registration holds no memory to register (every tensor is empty)")
    device = _device(tensors)  # refuses meta tensors too
    mem_type, dev = _MEM_TYPES[device.type], device.index or 0
    # each storage's region, with the storage (its memory, kept while registered)
    storages: dict[Region, torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        storages.setdefault(Region(s.data_ptr(), s.nbytes(), mem_type, dev), s)
    regions = tuple(storages)
    held = _REGIONS.setdefault(agent, _AgentRegions())
    with held.lock:
        for region in regions:  # checked before any is counted: a refusal leaves nothing half done
            owner = held.owners.get(region, held.retired.get(region))
            if resized := _resized(region, owner):
                raise TransferError(
                    f"the {region.nbytes} bytes at {region.address:#x} are registered with this agent for a "
                    f"storage {resized}: deregister what registered it before registering this "
                    "memory, and never resize a registered cache"
                )
        for region in regions:
            kept = held.retired.pop(region, None)
            if kept is not None:  # NIXL still holds it: counted again
                held.count[region], held.owners[region] = 0, kept
            if region not in held.count:
                reg = agent.register_memory(
                    [(region.address, region.nbytes, region.device, "")], region.mem_type
                )
                held.reg_lists[region] = reg
                held.count[region] = 0
                held.owners[region] = storages[region]
            held.count[region] += 1
    return Registered(agent, regions, tensors)


Reach = tuple[str, int, int, int]  # memory type, device, first address, past the last


def _reach(rows: np.ndarray, mem: str) -> Reach | None:
    """What descriptor ``rows`` (address, length, device; one device) of memory type
    ``mem`` reach, for :func:`_pin`: worked out when a request is prepared (half a million
    rows take milliseconds), off the path of its start."""
    if len(rows) == 0:
        return None
    return mem, int(rows[0, 2]), int(rows[:, 0].min()), int((rows[:, 0] + rows[:, 1]).max())


def _pin(agent: Agent, reaches: Sequence[Reach | None]) -> tuple[Region, ...]:
    """Pin the regions registered on ``agent`` that a request in flight may post through
    (those inside its descriptors' ``reaches``): deregistering one then waits for
    :func:`_unpin`. By address range: a region inside it that no descriptor touches is
    kept a little longer."""
    held = _REGIONS.get(agent)
    if held is None:
        return ()
    with held.lock:
        pinned = tuple(
            r
            for r in held.count
            for reach in reaches
            if reach is not None
            and (r.mem_type, r.device) == reach[:2]
            and r.address < reach[3]
            and r.address + r.nbytes > reach[2]
        )
        for r in pinned:
            held.pins[r] = held.pins.get(r, 0) + 1
    return pinned


def _refuse_resized(agent: Agent, reach: Reach | None, what: str) -> None:
    """Refuse a post through a region registered on ``agent`` (inside ``reach``) whose
    storage was resized in place since it was registered: NIXL would move bytes through
    the memory that resize freed. Asked for the rows a map's side does not watch: an agent
    posting to itself, whose remote rows are this process's registered memory."""
    held = _REGIONS.get(agent)
    if held is None or reach is None:
        return
    with held.lock:
        owners = [
            (r, held.owners.get(r, held.retired.get(r)))
            for r in held.count
            if (r.mem_type, r.device) == reach[:2]
            and r.address < reach[3]
            and r.address + r.nbytes > reach[2]
        ]
    for r, owner in owners:
        if resized := _resized(r, owner):
            raise TransferError(
                f"the {what}s reach the {r.nbytes} bytes at {r.address:#x} registered on agent "
                f"{agent.name!r}, whose storage was {resized}: NIXL would move bytes through "
                "freed memory; nothing was posted (never resize a registered cache)"
            )


def _resized(region: Region, owner: torch.UntypedStorage | None) -> str | None:
    """How the storage that registered ``region`` was resized in place since, no longer
    holding its bytes; None while it holds them."""
    if owner is None or (owner.data_ptr(), owner.nbytes()) == (region.address, region.nbytes):
        return None
    return f"resized in place since (it now holds {owner.nbytes()} bytes at {owner.data_ptr():#x})"


def _unpin(agent: Agent, pinned: tuple[Region, ...]) -> None:
    """A request that posted through ``pinned`` moves no more bytes: a region
    deregistered meanwhile is let go of now."""
    held = _REGIONS.get(agent)
    if held is None:
        return
    with held.lock:
        for r in pinned:
            held.pins[r] -= 1
            if held.pins[r] == 0:
                del held.pins[r]
                if held.retired.pop(r, None) is not None:
                    agent.deregister_memory(held.reg_lists.pop(r))


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
    _drain_deferred(agent)  # a dropped staging buffer's region goes first
    held = _REGIONS.get(agent)
    spans = held.intervals(mem, device) if held is not None else (np.empty(0, _U64),) * 2
    where = (
        f"every region registered on agent {agent.name!r} ({len(spans[0])} {mem} regions on device {device})"
    )
    _refuse_outside(what, addr, lengths, spans, f"{where}: register the registration (and staging) first")


def _check_local_rows(agent: Agent, rows: np.ndarray, mem: str, what: str) -> None:
    """:func:`_check_local` for descriptor rows (address, length, device id)."""
    for device in np.unique(rows[:, 2]):
        on = rows[:, 2] == device
        _check_local(agent, rows[on, 0], rows[on, 1], mem, int(device), what)


def _in_process(agent: Agent, peer: str) -> list[Agent]:
    """The agents of this process named ``peer`` (``agent`` itself, posting to itself; or
    others that registered memory through :func:`register`: an agent made again under the
    name of one not yet collected makes two): their memory is this process's, which no map
    side watches (the peer's side is a description), so what they registered is asked
    instead."""
    if peer == getattr(agent, "name", None):
        return [agent]
    return [a for a in list(_REGIONS.keys()) if getattr(a, "name", None) == peer]


def _removals(agent: Agent) -> int:
    """How many regions were deregistered on ``agent`` so far."""
    held = _REGIONS.get(agent)
    return held.removals if held is not None else 0


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


def _refuse_unregistered(
    agent: Agent, peer: str, rows: np.ndarray, mem: str, what: str, staging: bool = False
) -> None:
    """Refuse the first of ``rows`` (address, length, device) outside what ``peer``
    registered with NIXL (``staging``: the rows are the peer's staging buffer, not its
    description); an agent posting to itself holds no metadata of itself, so its rows are
    checked against the regions registered on it."""
    if peer == getattr(agent, "name", None):
        _check_local_rows(agent, rows, mem, what)
        return
    if not agent.check_remote_metadata(peer):
        raise NixlError(
            f"agent {agent.name!r} holds no metadata of peer {peer!r}: load it with add_remote_agent(the "
            "peer's get_agent_metadata()) at the handshake and post to the name that returns; "
            "refused before posting"
        )
    present = np.flatnonzero(rows[:, 1] > 0)  # an empty span holds no memory to check
    bad = _first_unregistered(agent, peer, rows[present], mem)
    if bad >= 0:
        a, n = int(rows[present[bad], 0]), int(rows[present[bad], 1])
        why = (
            f"is inside the staging buffer peer {peer!r} named (PeerStaging) but not inside memory it "
            "registered with NIXL, by the metadata loaded here: the peer registers its staging buffer before "
            "it sends its metadata"
            if staging
            else f"is inside what peer {peer!r} described but not inside memory it registered with NIXL: its "
            "description does not match its registration"
        )
        raise RefusedDescriptorError(
            f"{what} {int(present[bad])} ({a:#x}, {n} bytes) {why}; refused before posting"
        )
