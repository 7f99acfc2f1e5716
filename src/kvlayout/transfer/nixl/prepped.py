"""The prepped form: both sides prepared once as NIXL lists of fixed-size units; each
request then passes index arrays. The lists are NIXL's until released
(:meth:`Prepped.release`), or dropped."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from kvlayout.registration.kernel_groups import KernelGroup
from kvlayout.registration.peers import RegistrationDescription
from kvlayout.registration.registration import Registration
from kvlayout.transfer import TransferError
from kvlayout.transfer.nixl.copies import Staging, _check_staging_device
from kvlayout.transfer.nixl.direct import _mem_type, _rows
from kvlayout.transfer.nixl.regions import (
    _check_local,
    _drain_deferred,
    _intervals,
    _refuse_unregistered,
    defer,
    locks_free,
)
from kvlayout.transfer.nixl.sides import (
    _U64,
    Agent,
    Holder,
    MapSide,
    NixlError,
    RefusedDescriptorError,
    _byte_count,
    _described_side,
    _is_nixl_error,
    _peer_name,
    local_side,
)


class _Dlist:
    """A list NIXL prepared (``prep_xfer_dlist``'s handle) and whether it was released:
    apart from its :class:`PreppedList`, so that the finalizer of one dropped holds it."""

    def __init__(self, agent: Agent, handle: Any) -> None:
        self.agent = agent
        self.handle = handle
        self.released = False
        # Requests are made from the list under it (make_prepped_xfer reads the list NIXL
        # holds): a release from another thread waits for them, never frees it under one.
        self.lock = threading.Lock()

    def release(self) -> None:
        """``release_dlist_handle``, once (NIXL's refusal leaves it held, to try again)."""
        with self.lock:
            if self.released:
                return
            try:
                self.agent.release_dlist_handle(self.handle)
            except Exception as exc:
                if not _is_nixl_error(exc):
                    raise
                raise NixlError(
                    f"NIXL refused to release a prepared list: {type(exc).__name__}: {exc}"
                ) from exc
            self.released = True

    def held(self) -> bool:
        """Not yet released (a finalizer's ``pending``: :func:`defer`)."""
        return not self.released

    def release_when_free(self) -> bool:
        """:meth:`release` for a finalizer (through :func:`defer`), False while a request
        is being made from the list (on another thread)."""
        if not locks_free(self.lock):
            return False
        self.release()
        return True


class PreppedList:
    """One side prepared as a NIXL list of ``unit``-byte descriptors (one Nx5 dense row
    per memory interval), indexed by unit: unit ``j`` of interval ``k`` is index
    ``first[k] + j``. The list NIXL prepared (``handle``, from ``agent``'s
    ``prep_xfer_dlist``) is NIXL's until :meth:`release`; dropped unreleased, it is
    released as other dropped objects are (on the agent's caller's thread when the
    collector runs there, else by the agent's next call or :func:`drain`). A list of no
    handle (None) is the indexing alone."""

    def __init__(
        self,
        handle: Any,
        unit: int,
        starts: np.ndarray,
        counts: np.ndarray,
        mem: str,
        *,
        agent: Agent | None = None,
    ) -> None:
        self.unit = unit
        self.starts = starts
        self.counts = counts
        self.first = np.r_[0, np.cumsum(counts)[:-1]].astype(np.int64)
        self.mem = mem
        self._dlist: _Dlist | None = None
        if handle is not None:
            if agent is None:
                raise TypeError("a PreppedList of a NIXL list needs the agent that prepared it (agent=...)")
            dlist = self._dlist = _Dlist(agent, handle)
            weakref.finalize(self, defer, agent, dlist.release_when_free, dlist.held).atexit = False

    def __repr__(self) -> str:
        state = ", released" if self.released else ""
        return f"PreppedList({self.size} units of {self.unit} bytes, {self.mem}{state})"

    @property
    def handle(self) -> Any:
        """NIXL's handle of the list (None for a list of no handle); refused once released."""
        if self._dlist is None:
            return None
        if self._dlist.released:
            raise TransferError(
                f"{self!r} was released: NIXL no longer holds it; prepare it again (prep_lists)"
            )
        return self._dlist.handle

    @property
    def released(self) -> bool:
        return self._dlist is not None and self._dlist.released

    @property
    def agent(self) -> Agent | None:
        """The agent that prepared the list (None for a list of no handle)."""
        return None if self._dlist is None else self._dlist.agent

    def release(self) -> None:
        """Release the list NIXL prepared (``release_dlist_handle``), once: a second
        call does nothing, and a request given it after is refused. Requests made from it
        before are not touched (NIXL copies the descriptors a request names when it makes
        it). Safe after the peer's metadata was removed (``remove_remote_agent``)."""
        if self._dlist is None:
            return
        _drain_deferred(self._dlist.agent)
        self._dlist.release()

    @contextmanager
    def _held(self) -> Iterator[Any]:
        """The handle, for making requests from the list: not released meanwhile (a
        release on another thread waits), refused if it was."""
        if self._dlist is None:
            yield None
            return
        with self._dlist.lock:
            yield self.handle

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

    def __post_init__(self) -> None:
        # a request holds each list while it is made from them: one list twice would wait on itself
        if self.local is self.remote:
            raise TypeError(
                "Prepped's local and remote lists are one list: the local list holds this side's memory, "
                "the remote one the peer's (prep_lists makes both)"
            )

    @property
    def released(self) -> bool:
        """Either list was released (:meth:`release`): requests are refused."""
        return self.local.released or self.remote.released

    def release(self) -> None:
        """Release both lists NIXL prepared (``release_dlist_handle``), once: when the
        peer leaves (before ``remove_remote_agent``, as vLLM's connector does; after it
        is safe too) or at shutdown. A request given them after is refused; requests
        made from them before are not touched. Also a ``with`` block's end. NIXL's
        refusal of one list leaves the other released all the same."""
        try:
            self.local.release()
        finally:
            self.remote.release()

    def __enter__(self) -> Prepped:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _prep_list(
    agent: Agent, name: str, spans: np.ndarray, unit: int, device: int, mem: str, side: str
) -> PreppedList:
    starts, ends = _intervals(spans)
    counts = ((ends - starts) // np.uint64(unit)).astype(np.int64)
    if len(starts) and not counts.any():  # NIXL would refuse an empty list as "not found"
        raise TransferError(
            f"unit {unit} is larger than every stretch of {side} memory (the largest is "
            f"{int((ends - starts).max())} bytes): no unit to prepare; use a smaller unit"
        )
    starts, counts = starts[counts > 0], counts[counts > 0]  # shorter than a unit: no unit to send
    if int(counts.sum()) >= 2**31:
        raise TransferError(
            f"{int(counts.sum())} units of {unit} bytes do not fit NIXL's int32 indices; use a larger unit"
        )
    rows = np.empty((len(starts), 5), dtype=_U64)
    rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 4] = starts, unit, device, unit, counts
    try:
        handle = agent.prep_xfer_dlist(name, rows, mem)
    except Exception as exc:
        if not _is_nixl_error(exc):
            raise
        raise NixlError(f"NIXL refused to prepare the {side} list: {type(exc).__name__}: {exc}") from exc
    return PreppedList(handle, unit, starts, counts, mem, agent=agent)


def prep_lists(
    agent: Agent,
    peer: str | bytes,
    local: MapSide | Holder,
    remote: MapSide | RegistrationDescription,
    unit: int,
    *,
    staging: Staging | None = None,
) -> Prepped:
    """Prepare both sides once, as lists of ``unit``-byte descriptors over each side's
    tensors (and the staging buffer, on the local side), for :func:`transfer`'s
    ``prepped=``. ``local`` is this side (a :class:`MapSide`, or a registration or
    tensors as :func:`local_side` takes them), ``remote`` the peer's (a :class:`MapSide`,
    or its :class:`~kvlayout.registration.peers.RegistrationDescription` from the
    handshake). ``unit`` is the block unit every request's runs are whole multiples of,
    at unit-aligned offsets (vLLM's: one layer's K or V of a block). NIXL checks the
    remote list against what the peer registered; a description that lies is refused
    here, naming the tensor."""
    unit = _byte_count(unit, "unit")  # NumPy integers too
    peer = _peer_name(peer)
    local, remote = _map_side(local, "local"), _map_side(remote, "remote")
    if not local.is_local or remote.is_local:
        raise TransferError("prep_lists takes the local side first, then the peer's")
    local_mem, remote_mem = _mem_type(local, "local"), _mem_type(remote, "remote")
    if staging is not None:
        _check_staging_device(staging, local)
    held = local.tensor_spans if staging is None else np.concatenate([local.tensor_spans, staging.span])
    starts, ends = _intervals(held)
    _check_local(agent, starts, ends - starts, local_mem, local.device_index, "local stretch")
    spans = np.asarray(remote.tensor_spans, dtype=_U64).reshape(-1, 2)
    _refuse_unregistered(
        agent, peer, _rows(spans[:, 0], spans[:, 1], remote.device_index), remote_mem, "described tensor"
    )
    here = _prep_list(agent, "NIXL_INIT_AGENT", held, unit, local.device_index, local_mem, "local")
    try:
        there = _prep_list(
            agent, peer, remote.tensor_spans, unit, remote.device_index, remote_mem, f"peer {peer!r}'s"
        )
    except BaseException:
        here.release()  # none is left prepared if one is refused
        raise
    return Prepped(peer, here, there)


_SIDE = ("is_local", "device_type", "device_index", "tensor_spans")


def _map_side(side: object, which: str) -> MapSide:
    """A side as :func:`prep_lists` reads it: a :class:`MapSide` as it is, a peer's
    description (``remote``) or this process's registration or tensors (``local``)."""
    if which == "remote" and isinstance(side, RegistrationDescription):
        return _described_side(side)
    if which == "local" and isinstance(side, (Registration, KernelGroup, torch.Tensor, list, tuple)):
        return local_side(side)
    if not all(hasattr(side, name) for name in _SIDE):
        takes = (
            "a registration, a tensor or tensors (or nx.local_side of them)"
            if which == "local"
            else "the peer's RegistrationDescription (or a MapSide of it, such as a block map's side)"
        )
        raise TypeError(f"prep_lists takes for the {which} side {takes}, not {type(side).__name__}")
    return cast(MapSide, side)
