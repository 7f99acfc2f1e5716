"""The peer's half of a peer-staged request: the gather before a READ (:func:`stage`),
the scatter after a WRITE (:func:`unstage`), either planned ahead of the request's bytes
(:func:`prepare_stage`, :func:`prepare_unstage`: a :class:`PeerCopy`) and either paced
stage by stage by NIXL notifications (:func:`stage_notif`, :class:`StageNotifs`)."""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvlayout.errors import at_least
from kvlayout.transfer import TransferError
from kvlayout.transfer.block_maps import fingerprint
from kvlayout.transfer.nixl.copies import Staging, _copier, _copy_stream, _settle
from kvlayout.transfer.nixl.direct import _checked_runs
from kvlayout.transfer.nixl.plans import Plan, plan
from kvlayout.transfer.nixl.regions import _drain_deferred, defer, locks_free
from kvlayout.transfer.nixl.sides import (
    Agent,
    NixlError,
    NixlMap,
    NixlTimeoutError,
    Op,
    _is_nixl_error,
    _message,
    _peer_name,
    _seconds,
)


def stage_notif(tag: bytes | str, stage: int, stages: int) -> bytes:
    """The NIXL notification that announces stage ``stage`` of a ``stages``-stage
    peer-staged request tagged ``tag``: the tag itself for a request of one stage, else
    ``tag + b"#stage/stages"``. A pipelined WRITE's stage lands with it (its poster
    passes ``notif=tag``); a pipelined READ's stage is gathered when the peer sends it
    (:func:`stage` with ``notifs``; its poster passes ``peer_ready=tag``)."""
    message = _message(tag, "tag")
    stages, stage = at_least(stages, "stages", 1), at_least(stage, "stage", 0)  # NumPy integers too
    if stage >= stages:
        raise TypeError(f"stage {stage} is not one of {stages} stages (they count from 0)")
    return message if stages == 1 else message + b"#%d/%d" % (stage, stages)


def take_notif(agent: Agent, peer: str | bytes, message: bytes | str) -> bool:
    """Whether ``message`` came from ``peer``: NIXL's notifications fetched, and the first
    equal to ``message`` removed from ``agent.notifs`` (the others stay there). Exactly
    equal: NIXL's ``check_remote_xfer_done`` matches a prefix, so request ``b"req-1"``
    would take ``b"req-10"``'s notification (and a substring, with ``tag_is_prefix=False``)."""
    # NIXL keys agent.notifs by str; add_remote_agent returns the name as bytes
    peer, message = _peer_name(peer), _message(message, "message")
    _drain_deferred(agent)  # a call on the agent: what dropped objects left it goes first
    messages = agent.update_notifs().get(peer)
    if messages is None:
        return False
    try:  # one step (the GIL's): of two threads taking one message, one gets it
        messages.remove(message)
    except ValueError:
        return False
    return True


def _stages_announced(agent: Agent, peer: str | bytes, tag: bytes) -> int | None:
    """Into how many stages ``peer`` cut request ``tag``, by a notification of it already
    fetched into ``agent.notifs`` (:func:`stage_notif`'s form: the tag alone for one
    stage); None where none has come."""
    for message in agent.notifs.get(_peer_name(peer), ()):
        if message == tag:
            return 1
        if message.startswith(tag + b"#"):
            stage, slash, count = message[len(tag) + 1 :].partition(b"/")
            if slash and stage.isdigit() and count.isdigit():
                return int(count)
    return None


def _other_cut(what: str, tag: bytes, theirs: int, ours: int, fix: str) -> TransferError:
    return TransferError(
        f"{what} {tag!r} is cut into {ours} stage(s) here, but its peer cut it into {theirs}: "
        f"{fix} pass the same stages on both sides, or neither (both then take the default cut)"
    )


class StageNotifs(NamedTuple):
    """What paces the peer's half of a pipelined peer-staged request: this side's
    ``agent``, the poster's agent name ``peer`` (loaded with ``add_remote_agent`` where
    notifications go to it) and the request's ``tag``. Notifications are found with
    :func:`take_notif`, which keeps the others in ``agent.notifs``."""

    agent: Agent
    peer: str | bytes
    tag: bytes

    def _checked(self) -> StageNotifs:
        """The same, the peer's name as NIXL keys its notifications (str: the bytes
        ``add_remote_agent`` returns decoded) and the tag as bytes."""
        if not callable(getattr(self.agent, "update_notifs", None)):
            raise TypeError(
                f"StageNotifs.agent must be this side's NIXL agent, not {type(self.agent).__name__}"
            )
        return StageNotifs(self.agent, _peer_name(self.peer), _message(self.tag, "StageNotifs.tag"))


def _progress_until(fut: Future[None], agent: Agent, deadline: float, what: str) -> None:
    """Wait for a local copy, driving NIXL meanwhile (an agent without a progress thread
    moves bytes only when called); :class:`NixlTimeoutError` past ``deadline``."""
    while not fut.done():
        if time.perf_counter() > deadline:
            raise NixlTimeoutError(f"{what} was not done in time")
        agent.update_notifs()
        time.sleep(1e-4)
    fut.result()


class _Taken:
    """The staging buffer one :class:`PeerCopy` holds (from prepared until its run ends),
    whether the run is under way (no second one lets go of the buffer while it still
    copies through it) and whether it copied (then the buffer may hold another request's
    bytes: no second run)."""

    def __init__(self, staging: Staging) -> None:
        self.staging = staging
        self.held = True
        self.running = False
        self.copied = False
        self._lock = threading.Lock()

    def start(self) -> None:
        """A run begins: the buffer held (taken again after a run that copied nothing let
        it go)."""
        with self._lock:
            if self.running:
                raise TransferError(
                    f"this peer's copy through {self.staging!r} is running already (on another thread): "
                    "a PeerCopy runs once at a time"
                )
            if self.copied:
                raise TransferError(
                    f"this peer's copy through {self.staging!r} ran already: a PeerCopy copies one request, "
                    "and its staging buffer, let go when that run returned, may hold another request's bytes "
                    "now; prepare the request again"
                )
            if not self.held:
                self.staging._take_or_refuse("a peer's copy")
                self.held = True
            self.running = True

    def let_go(self, *, run_ended: bool = False, copied: bool = False) -> None:
        """A run ended (``run_ended``; ``copied``: it began copying), or the copy was dropped:
        the buffer is free again, unless kept for good (bytes may still move through it)."""
        with self._lock:
            if run_ended:
                self.running = False
                self.copied = self.copied or copied
            if self.held and not self.running:
                self.held = False
                if not self.staging.kept:
                    self.staging._let_go()

    def holding(self) -> bool:
        """Whether the buffer is held (a finalizer's ``pending``: :func:`defer`)."""
        return self.held

    def dropped(self) -> bool:
        """:meth:`let_go` for the finalizer of a copy dropped (through :func:`defer`: on the
        agent's caller's thread, or its next call; closed, the buffer is deregistered), False while a lock it
        takes is held."""
        if not locks_free(self._lock, *self.staging._locks()):
            return False
        self.let_go()
        return True


@dataclass(frozen=True)
class PeerCopy:
    """The peer's half of one peer-staged request, planned and checked ahead of its bytes
    (:func:`prepare_stage`, :func:`prepare_unstage`): a connector makes it when it learns
    of the request (decode when it allocates the blocks a WRITE will fill, prefill when it
    is asked for a request a READ will take), so that only the copy is left for when the
    bytes move. Its staging buffer is the request's from then until :meth:`run` returns
    (taken as a transfer takes one: another request through it is refused meanwhile), or
    until the copy is dropped. It runs once, as a prepared request posts once: a second
    run, once one began copying, is refused (the buffer may hold another request's bytes
    by then); a run refused before it copied (a closed buffer, a poster's metadata not
    loaded) may be run again."""

    plan: Plan  # this side's staged plan: a gather (op WRITE) or a scatter (op READ)
    # Held so that the memory the checked copies address outlives them: the staging
    # buffer, and the map (which holds this side's registration).
    staging: Staging
    block_map: NixlMap
    _taken: _Taken = field(repr=False, compare=False)

    @property
    def stages(self) -> int:
        return len(self.plan.stages)

    def run(self, *, notifs: StageNotifs | None = None, num_threads: int = 1, timeout: float = 30.0) -> None:
        """The gather (:func:`stage`) or the scatter (:func:`unstage`), paced by
        ``notifs`` when given; on a GPU, on the calling thread's current stream. A paced
        scatter whose stages have not all landed in ``timeout`` keeps its staging buffer
        for good (the WRITE may still land there: :class:`NixlTimeoutError` says so), as
        does a paced gather that fails after announcing a stage (the READ may be reading
        it). A second run, on another thread meanwhile or once this one began copying, is
        a :class:`TransferError`."""
        timeout = _seconds(timeout)
        _drain_deferred(self.staging.agent)  # a call on the agent: what dropped objects left it goes first
        if notifs is not None:
            if not isinstance(notifs, StageNotifs):
                raise TypeError(
                    f"notifs must be a StageNotifs (agent, poster, tag), not {type(notifs).__name__}"
                )
            notifs = notifs._checked()
        if self.staging.closed:
            self._taken.let_go()  # held and not running: closed, it is deregistered now
            raise NixlError(f"{self.staging!r} was closed after this copy was prepared; nothing was copied")
        self._taken.start()
        copied = False
        try:
            if notifs is not None and self.plan.op == "WRITE":
                _check_poster(notifs)
            stream = _copy_stream(self.plan.copy_device)
            copied = True  # from here the buffer's bytes are this request's, read or written
            if notifs is None:
                self.plan.copy(num_threads, stream)
            elif self.plan.op == "WRITE":
                self._gather(notifs, timeout, stream)
            else:
                self._scatter(notifs, timeout, stream)
        finally:
            self._taken.let_go(run_ended=True, copied=copied)

    def _gather(self, notifs: StageNotifs, timeout: float, stream: torch.cuda.Stream | None) -> None:
        p, n, deadline = self.plan, self.stages, time.perf_counter() + timeout
        gathers = [_copier().submit(p.copy_stage, i, stream) for i in range(n)]
        announced = 0
        try:
            for i, fut in enumerate(gathers):
                _progress_until(fut, notifs.agent, deadline, f"the gather of stage {i} of {n}")
                _announce(notifs, i, n)
                announced += 1
        except BaseException:
            if announced:  # the poster may be reading the announced stages: never another request's
                self.staging._keep(f"the peer-staged READ {notifs.tag!r} (stages of it were announced)")
            raise
        finally:
            _settle(gathers)

    def _scatter(self, notifs: StageNotifs, timeout: float, stream: torch.cuda.Stream | None) -> None:
        p, n, deadline = self.plan, self.stages, time.perf_counter() + timeout
        waiting, scatters = list(range(n)), []
        try:
            while waiting:
                landed = [
                    i for i in waiting if take_notif(notifs.agent, notifs.peer, stage_notif(notifs.tag, i, n))
                ]
                for i in landed:
                    scatters.append(_copier().submit(p.copy_stage, i, stream))
                    waiting.remove(i)
                if waiting and not landed:
                    theirs = _stages_announced(notifs.agent, notifs.peer, notifs.tag)
                    if theirs is not None and theirs != n:
                        raise _other_cut(
                            "the peer-staged WRITE",
                            notifs.tag,
                            theirs,
                            n,
                            "its stages may land yet, so "
                            f"{self.staging!r} is kept for good (a later request needs a new Staging);",
                        )
                if waiting and time.perf_counter() > deadline:
                    raise NixlTimeoutError(
                        f"stages {waiting} of {n} of the peer-staged WRITE {notifs.tag!r} from peer "
                        f"{notifs.peer!r} had not landed after {timeout:g} s; they may land yet, so "
                        f"{self.staging!r} is kept for good (a later request needs a new Staging)"
                    )
                if waiting and not landed:
                    time.sleep(1e-4)
            for fut in scatters:
                _progress_until(
                    fut, notifs.agent, deadline, f"a scatter of the peer-staged WRITE {notifs.tag!r}"
                )
        except BaseException:
            if waiting:  # however the wait ended, the WRITE may land yet: never another request's
                self.staging._keep(f"the peer-staged WRITE {notifs.tag!r} (its stages may land yet)")
            raise
        finally:
            _settle(scatters)


def _check_poster(notifs: StageNotifs) -> None:
    """The poster's metadata is loaded: the stages are announced to it (``send_notif``)."""
    if not notifs.agent.check_remote_metadata(notifs.peer):
        raise NixlError(
            f"agent {notifs.agent.name!r} holds no metadata of peer {notifs.peer!r}, the poster its "
            "stages are announced to: load it with add_remote_agent(the poster's get_agent_metadata()) "
            "and name it as that returns; nothing was copied"
        )


def _announce(notifs: StageNotifs, stage: int, stages: int) -> None:
    """Tell the poster stage ``stage`` is gathered."""
    try:
        notifs.agent.send_notif(notifs.peer, stage_notif(notifs.tag, stage, stages))
    except Exception as exc:
        if not _is_nixl_error(exc):
            raise
        raise NixlError(
            f"NIXL could not announce stage {stage} of {stages} to peer {notifs.peer!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _prepare(
    block_map: NixlMap, staging: Staging, op: Op, wrong_side: str, stages: int | None, expect: str | None
) -> PeerCopy:
    """This side's staged plan of ``block_map`` (laid out as the poster's runs, cut into
    the poster's ``stages``, None: the default both sides make), which must be ``op``; its
    copy checked; the map the poster's (its ``fingerprint`` ``expect``) where given."""
    if expect is not None:
        _check_fingerprint(block_map, expect)
    staging._take_or_refuse("a peer's copy")
    taken = _Taken(staging)
    try:
        p = plan(block_map, strategy="staged", staging=staging, stages=stages)
        if p.op != op:
            raise TransferError(wrong_side)
        p.check_copy()
    except BaseException:
        taken.let_go()
        raise
    copy = PeerCopy(p, staging, block_map, taken)
    # dropped unrun: the buffer is free again (collected on the agent's caller's thread, or at its next call)
    weakref.finalize(copy, defer, staging.agent, taken.dropped, taken.holding).atexit = False
    return copy


def _check_fingerprint(block_map: NixlMap, expect: str) -> None:
    """Refuse a map other than the poster's: both lay the staging buffer out by their own
    map, so one of other block ids, tokens or shards would copy the wrong bytes."""
    if not isinstance(expect, str):
        raise TypeError(f"expect must be the poster's map's fingerprint (a str), not {type(expect).__name__}")
    ours = getattr(block_map, "fingerprint", None)
    ours = ours if isinstance(ours, str) else fingerprint(_checked_runs(block_map))
    if ours != expect:
        raise TransferError(
            f"this side's map has fingerprint {ours}, the poster's {expect[:64]!r}: the two halves of the "
            "request were built from other arguments (block ids, their order, num_tokens, first_token, "
            "shards or block sizes), and would lay the staging buffer out differently; nothing was copied"
        )


def prepare_stage(
    block_map: NixlMap, staging: Staging, *, stages: int | None = None, expect: str | None = None
) -> PeerCopy:
    """:func:`stage`'s plan, made and checked now; :meth:`PeerCopy.run` gathers."""
    wrong = "stage runs on the source side of the map (the side a peer-staged READ reads)"
    return _prepare(block_map, staging, "WRITE", wrong, stages, expect)


def prepare_unstage(
    block_map: NixlMap, staging: Staging, *, stages: int | None = None, expect: str | None = None
) -> PeerCopy:
    """:func:`unstage`'s plan, made and checked now; :meth:`PeerCopy.run` scatters."""
    wrong = "unstage runs on the destination side of the map (the side the peer-staged WRITE reached)"
    return _prepare(block_map, staging, "READ", wrong, stages, expect)


def stage(
    block_map: NixlMap,
    staging: Staging,
    *,
    num_threads: int = 1,
    stages: int | None = None,
    notifs: StageNotifs | None = None,
    timeout: float = 30.0,
    expect: str | None = None,
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
    thread beside this one, which drives NIXL. ``stages`` None is the cut both sides make
    by default (:func:`auto_stages`: a stage per 4 MiB, up to 8), so neither names it.
    ``expect`` (the poster's map's ``fingerprint``) refuses a map built from other
    arguments than the poster's. :func:`prepare_stage` plans it ahead."""
    prepare_stage(block_map, staging, stages=stages, expect=expect).run(
        notifs=notifs, num_threads=num_threads, timeout=timeout
    )


def unstage(
    block_map: NixlMap,
    staging: Staging,
    *,
    num_threads: int = 1,
    stages: int | None = None,
    notifs: StageNotifs | None = None,
    timeout: float = 30.0,
    expect: str | None = None,
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
    been scattered within ``timeout`` seconds. ``stages`` None is the cut both sides make
    by default (one stage: a scatter, :func:`auto_stages`). ``expect`` (the poster's map's
    ``fingerprint``) refuses a map built from other arguments than the poster's.
    :func:`prepare_unstage` plans it ahead, when the request is known (before its WRITE
    is posted)."""
    prepare_unstage(block_map, staging, stages=stages, expect=expect).run(
        notifs=notifs, num_threads=num_threads, timeout=timeout
    )
