"""What a request holds until it is released (its NIXL requests, staging buffer, local
copies, pinned regions and claim on a peer's staging buffer), and how one dropped
unreleased lets go of it: on the agent's caller's thread, when collected there, else at
the agent's next call (or :func:`drain`), never on another thread the collector happened
to run on."""

from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvlayout.transfer import TransferError
from kvlayout.transfer.nixl.copies import Staging
from kvlayout.transfer.nixl.plans import PeerStaging
from kvlayout.transfer.nixl.regions import (
    _DEFERRED,
    _REGIONS,
    Region,
    _drain_deferred,
    _unpin,
    defer,
    locks_free,
)
from kvlayout.transfer.nixl.sides import (
    Agent,
    _is_nixl_error,
    _seconds,
)

# The peers' staging buffers that each agent's peer-staged requests are using:
# (agent name, peer, first byte, end). A second request through one would land on (or
# read) the bytes of the first before the peer has copied them. A request released in
# flight lets go of its claim: the peer owns the buffer, and reads _NO_CANCEL's rule.
_PEER_STAGINGS: list[tuple[str, str, int, int]] = []
_PEER_STAGINGS_LOCK = threading.Lock()


def _claim_peer_staging(
    agent: Agent, peer: str, peer_staging: PeerStaging | None, must: bool
) -> tuple[str, str, int, int] | None:
    """The peer's staging buffer, taken for a request that may go peer-staged: None when
    there is none, or another request of this agent holds it and the request may go
    another way; refused where it ``must`` go peer-staged."""
    if peer_staging is None:
        return None
    name = str(getattr(agent, "name", id(agent)))
    claim = (name, peer, int(peer_staging.address), int(peer_staging.address) + int(peer_staging.nbytes))
    with _PEER_STAGINGS_LOCK:
        if not any(
            (n, q) == claim[:2] and lo < claim[3] and claim[2] < hi for n, q, lo, hi in _PEER_STAGINGS
        ):
            _PEER_STAGINGS.append(claim)
            return claim
    if not must:
        return None
    raise TransferError(
        f"peer {peer!r}'s staging buffer {peer_staging} is in use by another peer-staged request of "
        f"agent {name!r} not yet waited for: one request at a time goes through a peer's staging buffer "
        "(give each request in flight a buffer of its own)"
    )


def _unclaim_peer_staging(claim: tuple[str, str, int, int] | None) -> None:
    if claim is not None:
        with _PEER_STAGINGS_LOCK:
            _PEER_STAGINGS.remove(claim)


_NO_CANCEL = (
    "NIXL cannot guarantee to cancel a request under way: its bytes may still land (UCX over TCP "
    "finishes it), so do not free or reuse the memory it reads or writes, on either side; a staging "
    "buffer it holds stays busy, registered and allocated for good"
)


@dataclass
class _Hold:
    """What a request holds until it is released: its NIXL requests, its staging buffer,
    the local copies that write or read that buffer, and the regions it posts through."""

    agent: Agent
    handles: list[Any]
    staging: Staging | None
    copies: list[Future[None]] = field(default_factory=list)
    started: bool = False
    released: bool = False
    pinned: tuple[Region, ...] = ()  # regions its posts go through: deregistering them waits
    kept: bool = False  # let go of in flight: the staging buffer and pinned regions are kept for good
    tried: bool = False  # release() ran (NIXL may have refused some of the handles)
    posted: int = 0  # stages posted so far (handles[:posted]): what NIXL may still move
    peer_claim: tuple[str, str, int, int] | None = None  # the peer's staging buffer it posts through

    def release(self, in_flight: bool) -> bool:
        """Release the NIXL requests (the copies are done) and let go of the staging
        buffer and regions, or, ``in_flight`` (NIXL may still move bytes), keep them for
        good; False if NIXL refused one (kept, to try again)."""
        refused, self.tried = [], True
        for h in self.handles:
            try:
                self.agent.release_xfer_handle(h)
            except Exception as exc:
                if not _is_nixl_error(exc):
                    raise
                refused.append(h)
        self.handles, self.released = refused, not refused
        if in_flight:
            self.keep()
        elif self.released and not self.kept:
            if self.staging is not None:
                self.staging._let_go()
            _unpin(self.agent, self.pinned)
            _unclaim_peer_staging(self.peer_claim)
            self.peer_claim = None
        return self.released

    def keep(self) -> None:
        """NIXL may still move the request's bytes: its staging buffer stays busy, and its
        staging buffer and pinned regions registered and allocated, for good."""
        if not self.kept and self.staging is not None:
            self.staging._keep()
        if not self.kept:  # the peer's buffer is the peer's: it reads _NO_CANCEL's rule
            _unclaim_peer_staging(self.peer_claim)
            self.peer_claim = None
        self.kept = True


# Requests dropped in flight (started, never waited for), until NIXL reports each posted
# stage done or failed: NIXL's UCX backend sends a request's notif when the request is
# asked its state once done, where its bytes were not done when it was posted (over
# UCX's TCP, never), and nothing else asks a dropped request. The agent's later requests
# ask them (_progress_dropped), on their caller's thread, as NIXL's calls all are.
_DROPPED: deque[_Hold] = deque()


def _catch_up(agent: Agent) -> None:
    """What the agent's caller is owed before a request of the agent: the work finalizers
    left it (:func:`~kvlayout.transfer.nixl.regions.defer`: requests, staging buffers and
    peer's copies dropped unreleased), then the requests dropped in flight asked their
    state, all on this thread, the caller's."""
    _drain_deferred(agent)
    _progress_dropped(agent)


def drain(agent: Agent, timeout: float = 0.0) -> int:
    """Do now, on this thread, what kvlayout left for ``agent``'s next call, and return
    how much of it is still left (0: kvlayout holds nothing of the agent for later).

    That is the work of objects dropped unreleased where the collector ran on another
    thread (staging buffers, prepared requests, peer's copies and prepped lists: their
    NIXL requests and lists released, their memory deregistered), and the requests dropped
    in flight, each asked its state and released once NIXL reports it over. Until done,
    each keeps the agent alive, and with it its progress thread: an agent no longer called
    keeps them, so a connector calls this at shutdown, once its requests are waited for or
    released and its buffers closed, before it drops the agent. ``timeout`` (seconds)
    keeps asking, driving the agent, until nothing is left or it passes; what is left then
    is a request NIXL still reports under way (or work whose lock another thread holds).
    Called where the agent is called from (one thread at a time, for an agent of NIXL's
    default synchronization)."""
    if not callable(getattr(agent, "release_xfer_handle", None)):
        raise TypeError(f"agent must be a NIXL agent (nx.make_agent), not {type(agent).__name__}")
    deadline = time.perf_counter() + _seconds(timeout)
    while True:
        _catch_up(agent)
        left = _left(agent)
        if not left or time.perf_counter() >= deadline:
            return left
        time.sleep(1e-4)  # leave the cores to NIXL's progress thread


def _left(agent: Agent) -> int:
    """How many pieces of work wait for ``agent``'s next call (deferred, or dropped in
    flight)."""
    while True:
        try:  # a finalizer may append meanwhile (the collector runs on any allocation)
            return sum(a is agent for a, _ in list(_DEFERRED)) + sum(h.agent is agent for h in list(_DROPPED))
        except RuntimeError:  # the deque was mutated while copied: count again
            continue


def _progress_dropped(agent: Agent) -> None:
    """Ask NIXL the state of each posted stage of each request of ``agent`` dropped in
    flight (which drives the agent, and sends a notif NIXL held back, once the stage is
    done); release one whose every posted stage is done or failed and whose local copies
    (a pipeline's, queued before it was dropped) have run.

    A request dropped with its NIXL requests all held then lets go of its staging buffer,
    the regions it posted through and its claim on the peer's buffer, as one waited for
    does: NIXL
    reports it over (``check_xfer_state`` not ``"PROC"``) before any of its requests is
    released, so none is cancelled under way and no byte of it moves after. One whose
    requests were released in flight (``release()`` before it was over, NIXL refusing
    one) keeps them for good: only its NIXL requests are freed."""
    for _ in range(len(_DROPPED)):
        try:
            hold = _DROPPED.popleft()
        except IndexError:  # another thread took the last one
            return
        if hold.agent is not agent:
            _DROPPED.append(hold)
            continue
        over = [_over(agent, h) for h in hold.handles[: hold.posted]]  # each asked: each sends its notif
        if not all(over) or not all(copy.done() for copy in hold.copies):  # a copy still on the buffer
            _DROPPED.append(hold)
        elif hold.kept:
            hold.release(in_flight=True)  # kept already: only its NIXL requests are freed
        elif not hold.release(in_flight=False):  # NIXL refused to free one: kept, as one released in flight
            hold.keep()


def _over(agent: Agent, handle: Any) -> bool:
    """NIXL reports the request done or failed (its error too ends it)."""
    try:
        return bool(agent.check_xfer_state(handle) != "PROC")
    except Exception as exc:
        if not _is_nixl_error(exc):
            raise
        return True


def _abandon(hold: _Hold, what: str) -> None:
    """A request dropped unreleased (its finalizer, on whatever thread the collector
    runs). Prepared and never started: release it, so that its staging buffer is not
    taken for good. Started: leave it to finish (a post must not be cancelled behind the
    caller's back), keeping what it holds. Releasing calls NIXL, which takes an agent's
    calls from one thread at a time, the caller's: done at once on the agent's caller's
    thread, else left to the agent's next call (:func:`_catch_up`)."""
    if hold.released:
        return
    now = defer(hold.agent, lambda: _let_go_abandoned(hold))  # first: a filter may make the warning an error
    if hold.started:
        warnings.warn(
            f"{what} was dropped before wait(): it is left to finish. Its bytes move while the agent "
            "is driven, and its notif reaches the peer only once NIXL is asked its state after they "
            "landed, which the agent's next request made or polled here does (over UCX's TCP, neither "
            "happens before); its staging buffer stays busy, it and the memory it posts through "
            "registered, and a peer's staging buffer it posts through taken from the agent's other "
            "requests, until such a request finds it done or failed, then they are let go of. The "
            "notif of a pipeline (sent here after its last stage) and the stages not yet posted never "
            "go: wait for what you post",
            ResourceWarning,
            stacklevel=1,
        )
    else:
        warnings.warn(
            f"{what} was prepared and dropped without release(); "
            + ("released" if now else "the agent's next request releases it"),
            ResourceWarning,
            stacklevel=1,
        )


def _let_go_abandoned(hold: _Hold) -> bool:
    """:func:`_abandon`'s work, False while a lock it takes is held."""
    regions = _REGIONS.get(hold.agent)
    locks = [_PEER_STAGINGS_LOCK] + ([regions.lock] if regions is not None else [])
    if not locks_free(*locks, *(hold.staging._locks() if hold.staging is not None else [])):
        return False
    if hold.started:
        # Dropped in flight, none of its NIXL requests released: its staging buffer stays
        # busy, it and the regions it posts through registered, and the peer's buffer
        # claimed (its bytes may still land there, or be read), until _progress_dropped
        # finds every posted stage over. One whose release() NIXL refused keeps them for good.
        if hold.tried:
            hold.keep()
        _DROPPED.append(hold)  # asked by the agent's later requests until done
    else:
        hold.release(in_flight=False)
    return True
