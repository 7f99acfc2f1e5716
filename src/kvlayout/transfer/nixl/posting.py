"""Posting a request and waiting for it: :func:`transfer` (or :func:`prepare_transfer`
ahead, then :meth:`Transfer.start`), :class:`Transfer`, :func:`wait`."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Concatenate, NamedTuple, ParamSpec, TypeVar

from kvlayout.transfer import TransferError
from kvlayout.transfer.nixl.copies import Staging, _copier, _copy_stream, _settle
from kvlayout.transfer.nixl.direct import _sides
from kvlayout.transfer.nixl.holds import (
    _NO_CANCEL,
    _abandon,
    _catch_up,
    _claim_peer_staging,
    _Hold,
    _unclaim_peer_staging,
)
from kvlayout.transfer.nixl.peer_staging import _other_cut, _stages_announced, stage_notif, take_notif
from kvlayout.transfer.nixl.plans import CostModel, PeerStaging, Plan, _check_staging_arg, plan
from kvlayout.transfer.nixl.prepped import Prepped
from kvlayout.transfer.nixl.regions import (
    _check_described,
    _check_local,
    _check_local_rows,
    _in_process,
    _pin,
    _reach,
    _refuse_resized,
    _refuse_unregistered,
    _removals,
)
from kvlayout.transfer.nixl.sides import (
    Agent,
    NixlError,
    NixlMap,
    NixlTimeoutError,
    RefusedDescriptorError,
    Strategy,
    _is_nixl_error,
    _message,
    _peer_name,
    _seconds,
)


class TransferResult(NamedTuple):
    """A finished transfer: its strategy, descriptors posted (NIXL's count after its
    merge when the agent captures telemetry, else the count posted), bytes, seconds from
    post to done (including a READ's scatter)."""

    strategy: str
    descriptors: int
    num_bytes: int
    seconds: float


_T = TypeVar("_T")
_P = ParamSpec("_P")


def _locked(method: Callable[Concatenate[Transfer, _P], _T]) -> Callable[Concatenate[Transfer, _P], _T]:
    """``method`` under the request's lock."""

    def locked(self: Transfer, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        with self._lock:
            return method(self, *args, **kwargs)

    locked.__name__, locked.__qualname__ = method.__name__, method.__qualname__
    locked.__doc__ = method.__doc__
    return locked


class Transfer:
    """A posted request: poll with :meth:`done`, finish with :meth:`wait`.

    A staged plan of several stages runs as a pipeline: a WRITE's gathers run on a
    background thread and each stage is posted (by :meth:`done`, on the polling thread)
    once its gather is done; a READ posts every stage at once and scatters each as it
    lands. ``notif`` then goes to the peer (``send_notif``) once every stage has landed,
    so it still means "the whole request is there". A copy on a GPU runs on the stream
    that was current where the request was posted, after what was queued on it before. A
    peer-staged plan's stages are the peer's: a WRITE posts them all at once, each
    landing with its own :func:`stage_notif`; a READ with ``ready`` posts stage ``i``
    once the peer has sent ``stage_notif(ready, i, stages)``.

    Once released or failed, a request holds no NIXL request: every later call raises why
    (NIXL would be handed freed requests)."""

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
        self.posted_at = 0.0  # when start() was called
        self._posted = 0
        self._landed = [False] * len(handles)
        self._settled = [False] * len(handles)  # landed or failed: NIXL moves no more of the stage
        self._stream: Any = None  # the poster's current stream at start(), for a copy on a GPU
        self._count = 0
        self._result: TransferResult | None = None
        self._ended: tuple[type[TransferError], str] | None = None  # released or failed: why, for later calls
        self._removals = _removals(agent)  # the agent's deregistrations when the request was made
        # start, done (each poll of wait) and release from several threads, one at a time:
        # two waiters once both released its NIXL requests, freeing them twice
        self._lock = threading.RLock()
        own = self._own_rows()
        self._reach = [_reach(rows, mem) for _, rows, mem in own]  # what start() pins
        # Posting to itself or to another agent of this process, the remote rows are this
        # process's memory, which no map side watches (the peer's is a description): start()
        # asks the regions they reach on that agent, and whether it deregistered any since.
        owner = _peer_owner(agent, peer, plan)
        self._peer_agent = owner if owner is not agent else None
        self._peer_removals = _removals(owner) if self._peer_agent is not None else 0
        self._unwatched = (
            [] if owner is None else [(owner, "remote descriptor", _reach(plan.remote, plan.remote_mem))]
        )
        # What the request holds until released; dropped, the agent's next call lets go of it.
        self._hold = _Hold(agent, handles, staging)
        weakref.finalize(self, _abandon, self._hold, self._what()).atexit = False

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
        self._hold.posted = self._posted

    def _check_registered(self) -> None:
        """Every local descriptor (and, posting to this agent itself, every remote one)
        still inside a region registered on the agent."""
        after = "; it was deregistered after the request was prepared: nothing was posted"
        for what, r, mem in self._own_rows():
            try:
                _check_local_rows(self.agent, r, mem, what)
            except RefusedDescriptorError as exc:
                raise RefusedDescriptorError(f"{exc}{after}") from None

    def _check_peer_registered(self, peer: Agent) -> None:
        """Every remote descriptor still inside a region registered on the peer, an agent
        of this process (the metadata loaded here still names what it deregistered)."""
        try:
            _check_local_rows(peer, self.plan.remote, self.plan.remote_mem, "remote descriptor")
        except RefusedDescriptorError as exc:
            raise RefusedDescriptorError(
                f"{exc}; peer {self.peer!r} (an agent of this process) deregistered it after the request "
                "was prepared: nothing was posted"
            ) from None

    def _own_rows(self) -> list[tuple[str, Any, str]]:
        """The descriptor rows in this agent's registered memory: the local ones and,
        posting to itself, the remote ones."""
        p = self.plan
        rows = [("local descriptor", p.local, p.local_mem)]
        if self.peer == getattr(self.agent, "name", None):
            rows.append(("remote descriptor", p.remote, p.remote_mem))
        return rows

    @property
    def posted(self) -> int:
        """How many of its stages (NIXL requests) have been posted so far."""
        return self._posted

    @property
    def _gathers(self) -> bool:
        """A staged WRITE's pipeline: each stage waits for its gather."""
        return self._pipelined and self.plan.op == "WRITE" and self.plan.copies is not None

    def _refuse_ended(self) -> None:
        if self._ended is not None:
            kind, why = self._ended
            raise kind(why)

    @_locked
    def start(self) -> None:
        """Post the request: gather it first where it is staged, then post what may go
        (:func:`transfer` calls it; after :func:`prepare_transfer`, the caller does, once
        the KV is written). Once only; a local copy on a GPU runs on the stream current
        here."""
        self._refuse_ended()
        if self._hold.started:
            raise TransferError(f"{self._what()} was started already (a prepared request posts once)")
        self._hold.started, self.posted_at = True, time.perf_counter()
        try:
            # Prepared a while ago, perhaps: the local memory must still be where the map read it,
            # and still registered (NIXL would post through a region it let go of).
            self.plan._refuse_moved("nothing was posted")
            if _removals(self.agent) != self._removals:
                self._check_registered()
            if self._peer_agent is not None and _removals(self._peer_agent) != self._peer_removals:
                self._check_peer_registered(self._peer_agent)
            for owner, what, reach in self._unwatched:
                _refuse_resized(owner, reach, what)
            self._stream = _copy_stream(self.plan.copy_device)
            p = self.plan
            if self._gathers:
                pool = _copier()
                self._hold.copies = [
                    pool.submit(p.copy_stage, i, self._stream) for i in range(len(self.handles))
                ]
                self._copied(0, wait=True)
            elif p.op == "WRITE":
                p.copy(stream=self._stream)  # the gather (none peer-staged): validated, nothing posted yet
            self._hold.pinned = _pin(self.agent, self._reach)  # deregistering it now waits for NIXL
            self._post_ready()
            if not self.handles:  # nothing to post (an empty map): done now, its notif sent
                self._complete()
                self._let_go()
        except BaseException as exc:  # a request that cannot go holds nothing (it cannot be started again)
            self._end(exc)
            raise

    def _post_ready(self) -> None:
        """Post, in order, the stages that may go: gathered (a staged WRITE's pipeline),
        announced by the peer (a READ with ``ready``), else all."""
        n = len(self.handles)
        while self._posted < n:
            i = self._posted
            if self._gathers and not self._copied(i):
                return
            if self.ready is not None and not self._nixl(
                take_notif, self.agent, self.peer, stage_notif(self.ready, i, n)
            ):
                theirs = _stages_announced(self.agent, self.peer, self.ready)
                if theirs is not None and theirs != n:  # it would never announce stage i of n
                    posted = f"{self._posted} stage(s) were posted" if self._posted else "nothing was posted"
                    raise _other_cut("the peer-staged READ", self.ready, theirs, n, f"{posted};")
                return
            self._post()

    def _copied(self, stage: int, *, wait: bool = False) -> bool:
        """Whether the local copy of ``stage`` is done (raising what it raised)."""
        f = self._hold.copies[stage]
        if not wait and not f.done():
            return False
        try:
            f.result()
        except TransferError as exc:
            raise self._fail(f"the local copy of stage {stage}: {exc}") from exc
        return True

    def _state(self, i: int) -> str:
        """NIXL's state of posted stage ``i``; its error (or ``"ERR"``) settles the stage
        (NIXL moves no more of it) and raises."""
        try:
            state = self._nixl(self.agent.check_xfer_state, self.handles[i])
        except NixlError:
            self._settled[i] = True
            raise
        if state == "ERR":
            self._settled[i] = True
            raise self._fail(
                'check_xfer_state returned "ERR"' + (f" for stage {i}" if self._pipelined else "")
            )
        return str(state)

    def _poll(self) -> None:
        """Post the stages that may go; note the posted ones that landed."""
        self._post_ready()
        for i in range(self._posted):
            if self._landed[i] or self._state(i) != "DONE":
                continue
            self._landed[i] = self._settled[i] = True
            lo, hi = self.plan.stages[i].descriptors if self._pipelined else (0, self.plan.num_descriptors)
            try:
                self._count += int(self.agent.get_xfer_telemetry(self.handles[i]).descCount)
            except Exception as exc:
                if not _is_nixl_error(exc):
                    raise
                self._count += hi - lo
            if self.plan.op == "READ" and self.plan.copies is not None:
                if self._pipelined:
                    self._hold.copies.append(_copier().submit(self.plan.copy_stage, i, self._stream))
                else:
                    self.plan.copy(stream=self._stream)  # the scatter out of staging (checked before posting)

    @_locked
    def done(self) -> bool:
        """True once the transfer is complete (a READ's scatter done); raises
        :class:`NixlError` when NIXL reports ``"ERR"`` or an error (the request is then
        released, and later calls raise that it failed)."""
        if self._result is not None:
            return True
        self._refuse_ended()
        _catch_up(self.agent)  # the agent's requests dropped: released, or asked their state (notifs go)
        if not self._hold.started:
            raise TransferError(f"{self._what()} was prepared but not started: call start() first")
        try:
            if not self._complete():
                return False
        except BaseException as exc:  # NIXL's error, or a local copy's: nothing is left held
            self._end(exc)
            raise
        self._let_go()
        return True

    def _complete(self) -> bool:
        """Poll; once every stage landed and every copy is done, send ``notif`` (a
        pipeline's, or a request with nothing to post) and note the result."""
        self._poll()
        if not all(self._landed):
            return False
        if not all(self._copied(i) for i in range(len(self._hold.copies))):
            return False
        if self.notif:
            self._nixl(self.agent.send_notif, self.peer, self.notif)
        seconds = time.perf_counter() - self.posted_at
        self._result = TransferResult(self.plan.strategy, self._count, self.plan.num_bytes, seconds)
        return True

    def wait(self, timeout: float = 30.0) -> TransferResult:
        """Poll until done; :class:`NixlTimeoutError` after ``timeout`` seconds, the request
        still in flight (wait again, or :meth:`release` it)."""
        deadline = time.perf_counter() + _seconds(timeout)
        while not self.done():
            if time.perf_counter() > deadline:
                raise NixlTimeoutError(
                    f"{self._what()} was not done after {timeout:g} s; it is still in flight: wait() again, "
                    f"or release() it. {_NO_CANCEL}"
                )
            time.sleep(1e-4)  # leave the cores to NIXL's progress thread
        assert self._result is not None
        return self._result

    @_locked
    def release(self) -> bool:
        """Let go of a request that will not be waited for: one prepared and never
        started, or one given up on. Its NIXL requests are freed (NIXL is asked to cancel
        what is under way, which it cannot guarantee: bytes of a request released in flight
        may still land, so the caller must not free or reuse the memory it reads or writes,
        and its staging buffer stays busy for good); later calls raise that it was
        released. False if NIXL refused to release one."""
        if self._result is None and self._ended is None:
            self._ended = (TransferError, self._released_why())
        return self._let_go()

    def _released_why(self) -> str:
        what = f"{self._what()} was released"
        if not self._hold.started:
            return f"{what} before it was started (nothing was posted): prepare it again"
        if self._in_flight():
            return f"{what} in flight: NIXL was asked to cancel it. {_NO_CANCEL}"
        return f"{what}: it cannot be waited for"

    def _end(self, exc: BaseException) -> None:
        """A call failed: release what the request holds; later calls raise why."""
        if self._ended is None:
            kind = NixlError if isinstance(exc, NixlError) else TransferError
            why = str(exc) if isinstance(exc, TransferError) else f"{type(exc).__name__}: {exc}"
            self._ended = (kind, f"{self._what()} failed and was released ({why}); post the request again")
        self._let_go()

    def _in_flight(self) -> bool:
        """A posted stage NIXL does not report done or failed, asked once more (before its
        request is released): it may still move bytes."""
        for i in range(self._posted):
            self._settled[i] = self._settled[i] or self._over(i)
        return not all(self._settled[: self._posted])

    def _over(self, stage: int) -> bool:
        """NIXL reports ``stage`` done or failed (its error too ends it)."""
        try:
            return bool(self.agent.check_xfer_state(self.handles[stage]) != "PROC")
        except Exception as exc:
            if not _is_nixl_error(exc):
                raise
            return True

    def _let_go(self) -> bool:
        """Release the NIXL requests once no local copy is running, once; what a stage in
        flight may still write is kept for good. False if NIXL refused one."""
        if self._hold.released:
            return True
        _settle(self._hold.copies)
        # Tried before (NIXL refused a handle): the others are freed, not to be asked again.
        in_flight = self._hold.kept if self._hold.tried else self._in_flight()
        return self._hold.release(in_flight=in_flight)


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
    stages: int | None = None,
    peer_staging: PeerStaging | None = None,
    peer_ready: bytes | None = None,
) -> Transfer:
    """Post one request's map to ``peer`` (an agent name loaded with
    ``add_remote_agent``); ``notif`` reaches the peer when the bytes have landed.
    :func:`prepare_transfer` followed by :meth:`Transfer.start`; see there."""
    xfer = prepare_transfer(
        agent, peer, block_map, notif=notif, strategy=strategy, staging=staging, prepped=prepped, cost=cost,
        stages=stages, peer_staging=peer_staging, peer_ready=peer_ready,
    )  # fmt: skip
    xfer.start()  # which releases what it holds if it fails
    return xfer


def prepare_transfer(
    agent: Agent,
    peer: str | bytes,
    block_map: NixlMap,
    *,
    notif: bytes = b"",
    strategy: Strategy = "auto",
    staging: Staging | None = None,
    prepped: Prepped | None = None,
    cost: CostModel | None = None,
    stages: int | None = None,
    peer_staging: PeerStaging | None = None,
    peer_ready: bytes | None = None,
) -> Transfer:
    """Everything :func:`transfer` does before the first byte moves, done now: the plan,
    every check, the NIXL requests made (``initialize_xfer``, ``make_prepped_xfer``) and
    the staging buffer taken. A connector calls it when it knows both sides' blocks of a
    request (before prefill's forward pass has written the KV, say), and
    :meth:`Transfer.start` when the bytes are ready: the gather, if staged, and the posts
    are then all that is left on the request's path. A prepared request that will not be
    started is let go with :meth:`Transfer.release` (dropped unstarted, it is released
    by the agent's next call once collected, with a ``ResourceWarning``).

    Every descriptor is checked before anything is posted: the local ones inside regions
    registered on ``agent`` (the staging buffer's included), the remote ones inside the
    tensors the peer described and, in the list form, inside what it registered with
    NIXL (NIXL's own check). ``prepped`` sends index arrays into lists prepared by
    :func:`prep_lists` instead of descriptor lists. A ``staging`` buffer still in use by
    an earlier transfer leaves ``"auto"`` direct, and is an error for ``"staged"``.
    ``stages`` cuts a staged plan into a pipeline (:func:`plan`: by default a staged
    WRITE of 8 MiB or more is one); each stage is one NIXL request, all made (and so
    checked by NIXL) before the first byte moves.
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
    notif = _message(notif, "notif")
    if peer_ready is not None:
        peer_ready = _message(peer_ready, "peer_ready")
    _check_staging_arg(staging)
    _catch_up(agent)  # the agent's requests dropped: their staging buffers and claims let go of first
    taken = _take(staging, strategy)
    try:
        xfer = _prepare(
            agent, peer, block_map, notif, strategy, taken if strategy in ("auto", "staged") else staging,
            prepped, cost, stages, peer_staging, peer_ready,
        )  # fmt: skip
    except BaseException:
        if taken is not None:
            taken._let_go()
        raise
    if taken is not None and xfer.staging is None:  # planned without it: direct, or nothing to post
        taken._let_go()
    return xfer


def _take(staging: Staging | None, strategy: Strategy) -> Staging | None:
    """The staging buffer a request that may go staged takes now, atomically (another
    thread may be taking it): None when another request holds it and ``strategy`` is
    ``"auto"`` (which then goes direct); refused for ``"staged"``."""
    if staging is None or strategy not in ("auto", "staged"):
        return None
    if strategy == "staged":
        staging._take_or_refuse("a staged transfer")
        return staging
    return staging if staging._take() else None


def _prepare(
    agent: Agent,
    peer: str,
    block_map: NixlMap,
    notif: bytes,
    strategy: Strategy,
    staging: Staging | None,
    prepped: Prepped | None,
    cost: CostModel | None,
    stages: int | None,
    peer_staging: PeerStaging | None,
    peer_ready: bytes | None,
) -> Transfer:
    """:func:`prepare_transfer` once the staging buffer (if any) is this request's: the
    plan, the checks, the NIXL requests."""
    if prepped is not None and strategy != "peer-staged":
        peer_staging = None  # the prepped lists do not reach the peer's staging buffer
    p = plan(
        block_map, strategy=strategy, staging=staging, cost=cost, stages=stages, peer_staging=peer_staging
    )
    claim = None
    if p.strategy == "peer-staged":  # claimed once chosen: "auto" going another way never holds it
        claim = _claim_peer_staging(
            agent, peer, peer_staging, strategy == "peer-staged" or peer_ready is not None
        )
        if claim is None:  # "auto", and another request of ours is using it: another way
            p = plan(block_map, strategy=strategy, staging=staging, cost=cost, stages=stages)
    try:
        xfer = _checked_transfer(agent, peer, block_map, notif, p, staging, prepped, peer_ready)
    except BaseException:
        _unclaim_peer_staging(claim)
        raise
    xfer._hold.peer_claim = claim  # until the request is done (let go of in flight, too)
    return xfer


def _peer_owner(agent: Agent, peer: str, plan: Plan) -> Agent | None:
    """The agent of this process whose registered memory a request's remote rows are:
    ``agent`` itself, posting to itself, or one named as the peer (several may be: a peer
    shut down and made again under its name, the old agent not yet collected). NIXL
    accepted the rows by the metadata loaded at the handshake, which still names what the
    peer deregistered since: the owner is the one whose registered memory holds them now;
    outside all of them, where one of them deregistered a region, they are refused (stale
    metadata, the memory maybe freed). Outside them while none deregistered one, the rows
    were never theirs: they are registered otherwise (NIXL's own ``register_memory``, or a
    peer of another process that shares the name), and no agent here answers for them."""
    named = _in_process(agent, peer)
    if agent in named:
        return agent
    stale = None
    for owner in named:
        try:
            _check_local_rows(owner, plan.remote, plan.remote_mem, "remote descriptor")
        except RefusedDescriptorError as refused:
            if stale is None and _removals(owner) > 0:
                stale = refused
            continue
        return owner
    if stale is not None:
        raise stale
    return None


def _checked_transfer(
    agent: Agent,
    peer: str,
    block_map: NixlMap,
    notif: bytes,
    p: Plan,
    staging: Staging | None,
    prepped: Prepped | None,
    peer_ready: bytes | None,
) -> Transfer:
    """The checks and the NIXL requests of a planned request."""
    if prepped is not None and not isinstance(prepped, Prepped):
        raise TypeError(f"prepped must be the lists nx.prep_lists made, not {prepped!r}")
    if prepped is not None and prepped.released:
        raise TransferError(
            f"the lists prepared for peer {prepped.peer!r} were released (Prepped.release()): prepare "
            "them again with prep_lists; nothing was posted"
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
        try:
            _check_local(agent, p.local[:, 0], p.local[:, 1], p.local_mem, local_dev, "staged descriptor")
        except RefusedDescriptorError as exc:
            if staging is None or staging.agent is agent:
                raise
            raise RefusedDescriptorError(  # the peer's Staging, say, handed over as this side's
                f"{staging!r} is registered on agent {staging.agent.name!r}, where it was made, not on "
                f"{agent.name!r}, which posts this request: a Staging serves the agent that made it (a "
                "peer's staging buffer goes as peer_staging=PeerStaging(address, nbytes, ...))"
            ) from exc
    _check_described(s.remote_addr, s.lengths, s.remote, peer, "remote run")
    p.check_copy()
    if prepped is not None and prepped.peer != peer:
        raise TransferError(f"the lists were prepared for peer {prepped.peer!r}, not {peer!r}")
    for side, lst in (("local", prepped.local), ("remote", prepped.remote)) if prepped is not None else ():
        if lst.agent is not agent:  # a list is the preparing agent's: another's would name its memory keys
            how = "is the indexing alone (no NIXL list)" if lst.agent is None else (
                f"was prepared by agent {lst.agent.name!r}"
            )  # fmt: skip
            raise TransferError(
                f"the {side} prepped list {lst!r} {how}, not by {agent.name!r}, which posts this request: "
                "prepare the lists on it (prep_lists); nothing was posted"
            )
    if peer == getattr(agent, "name", None):  # posting to itself: the remote rows are its own memory,
        _check_local_rows(agent, p.remote, p.remote_mem, "remote descriptor")  # which prepped lists hold
    # An empty map (a rank pair with no heads in common) makes no NIXL request: notif goes alone.
    parts = [st.descriptors for st in p.stages] if len(p.stages) > 1 else [(0, p.num_descriptors)]
    if not p.num_descriptors:
        parts = []
        _refuse_unregistered(agent, peer, p.remote, p.remote_mem, "remote descriptor")  # a peer never loaded
    # A pipeline sends notif once after its last stage; a peer-staged WRITE's stages each
    # land with their own, which paces the peer's scatter.
    by_stage = p.strategy == "peer-staged" and p.op == "WRITE" and bool(notif)
    stage_notifs = [
        stage_notif(notif, i, len(parts)) if by_stage else notif if len(parts) == 1 else b""
        for i in range(len(parts))
    ]
    handles = _requests(agent, peer, p, parts, stage_notifs, prepped)
    try:
        xfer = Transfer(
            agent, peer, p, handles, staging if p.copies is not None else None,
            notif if not parts or (len(parts) > 1 and not by_stage) else b"", peer_ready,
        )  # fmt: skip
    except BaseException:
        for h in handles:
            agent.release_xfer_handle(h)
        raise
    return xfer


def _requests(
    agent: Agent,
    peer: str,
    p: Plan,
    parts: list[tuple[int, int]],
    stage_notifs: list[bytes],
    prepped: Prepped | None,
) -> list[Any]:
    """One NIXL request per stage (descriptors ``parts``), made and so checked by NIXL;
    none is left made if one is refused."""
    handles: list[Any] = []
    try:
        if prepped is not None:
            indices = [  # worked out before the lists are held: a release elsewhere waits only for NIXL
                (
                    prepped.local.indices(p.local[lo:hi], "local descriptor"),
                    prepped.remote.indices(p.remote[lo:hi], "remote descriptor"),
                )
                for lo, hi in parts
            ]
            # held while requests are made: released on another thread, it waits
            with prepped.local._held() as local_list, prepped.remote._held() as remote_list:
                for (local_idx, remote_idx), one_notif in zip(indices, stage_notifs, strict=True):
                    handles.append(
                        agent.make_prepped_xfer(
                            p.op, local_list, local_idx, remote_list, remote_idx, one_notif
                        )
                    )
        else:
            for (lo, hi), one_notif in zip(parts, stage_notifs, strict=True):
                local = agent.get_xfer_descs(p.local[lo:hi], p.local_mem)
                remote = agent.get_xfer_descs(p.remote[lo:hi], p.remote_mem)
                handles.append(agent.initialize_xfer(p.op, local, remote, peer, one_notif))
    except Exception as exc:
        for h in handles:
            agent.release_xfer_handle(h)
        if not _is_nixl_error(exc):
            raise
        if prepped is None:  # name the descriptor NIXL found outside the peer's registration
            peer_staged = p.strategy == "peer-staged"
            _refuse_unregistered(agent, peer, p.remote, p.remote_mem, "remote descriptor", peer_staged)
        hint = (
            " (prepped lists hold the peer's metadata loaded when they were made: after "
            "remove_remote_agent and add_remote_agent, make them again with prep_lists)"
            if prepped is not None and "NotFound" in type(exc).__name__
            else ""
        )
        raise NixlError(
            f"NIXL refused the {p.op} to peer {peer!r}: {type(exc).__name__}: {exc}{hint}"
        ) from exc
    return handles
