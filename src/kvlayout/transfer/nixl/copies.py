"""The staged strategies' local copy (gather or scatter: on the block-map engine in host
memory, on the device's run executor in GPU memory), the staging buffer it fills or
empties, and the thread pipelines copy on."""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from typing import Any

import numpy as np
import torch

from kvlayout import _native
from kvlayout.errors import KVLayoutError
from kvlayout.registration.address_space import MAX_END, unownable
from kvlayout.registration.memory import Placement
from kvlayout.transfer import TransferError
from kvlayout.transfer.arguments import threads_arg
from kvlayout.transfer.nixl.regions import _REGIONS, _drain_deferred, _intervals, defer, register
from kvlayout.transfer.nixl.sides import _U64, Agent, MapSide, NixlError, RefusedDescriptorError, _byte_count

_HOST = torch.device("cpu")

# -- the local copy of the staged strategy ----------------------------------------------------


_P = _native.MapProblem  # the reasons' one definition is csrc/block_map.h's enum
_COPY_PROBLEMS = {
    _P.src_outside: "reads bytes outside the memory it copies from",
    _P.dst_outside: "writes bytes outside the memory it copies to",
    _P.dst_overlap: "writes bytes another copy writes",
    _P.src_dst_overlap: "writes bytes another copy reads",
    _P.empty: "has no bytes",
}


def _exact_spans(spans: np.ndarray) -> np.ndarray:
    """``(start, bytes)`` stretches as the native engine's ``(start, period, block,
    blocks)`` spans: one block each, overlapping stretches merged first."""
    starts, ends = _intervals(spans)
    n = ends - starts
    return np.ascontiguousarray(np.stack([starts, n, n, np.ones_like(n)], axis=1), dtype=_U64)


def _refuse_copy(runs: np.ndarray, problem: Any, run: int) -> None:
    if problem is not _P.none:
        src, dst, n = (int(x) for x in runs[run])
        raise RefusedDescriptorError(
            f"local copy {run} ({src:#x} -> {dst:#x}, {n} bytes) {_COPY_PROBLEMS[problem]}; "
            "nothing was copied"
        )


def _check_copies(
    runs: np.ndarray, from_spans: np.ndarray, to_spans: np.ndarray, *, dst_disjoint: bool = False
) -> None:
    """Refuse (before any byte moves) copies that leave their memory or overlap
    (``dst_disjoint``: their destinations are known disjoint, not sorted to check)."""
    problem, run, _ = _native.validate_runs(
        runs, _exact_spans(from_spans), _exact_spans(to_spans), dst_disjoint=dst_disjoint
    )
    _refuse_copy(runs, problem, run)


def copy_byte_runs(
    runs: np.ndarray, from_spans: np.ndarray, to_spans: np.ndarray, *, num_threads: int = 1
) -> None:
    """Copy each ``(from, to, length)`` row of an ``(N, 3)`` uint64 array, host memory to
    host memory, on the block-map engine (``kvlayout._native.copy_runs``: native, GIL
    released): the staged strategy's gather and a READ's scatter.

    ``from_spans`` and ``to_spans`` (``(K, 2)``: start, bytes) are the memory the copies
    may read and write; every run is checked against them before a byte moves
    (:class:`RefusedDescriptorError` otherwise). The spans themselves are trusted: they
    must be memory this process owns (a tensor's, a registered region's); only spans no
    process can own (:func:`~kvlayout.registration.address_space.unownable`) are refused."""
    for name, spans in (("from_spans", from_spans), ("to_spans", to_spans)):
        _check_spans(name, spans)
    _copy(_checked_runs(runs), from_spans, to_spans, threads_arg(num_threads, TransferError), validate=True)


def _checked_runs(runs: Any) -> np.ndarray:
    """The caller's ``(N, 3)`` runs as uint64, refused by name where they are not unsigned
    integers of that shape (NumPy's cast wraps a negative length, and the native call
    answered a wrong shape or a float with its own signature)."""
    rows = np.asarray(runs)
    if rows.ndim != 2 or rows.shape[1] != 3 or rows.dtype.kind not in "iu":
        raise TransferError(f"runs must be an (N, 3) integer array of (from, to, length), got {_what(rows)}")
    if rows.dtype.kind == "i" and rows.size and int(rows.min()) < 0:
        i = int(np.argwhere(rows < 0)[0][0])
        raise TransferError(f"runs[{i}] = {tuple(int(x) for x in rows[i])} holds a negative value")
    return rows


def _check_spans(name: str, spans: Any) -> None:
    rows = np.asarray(spans)
    if rows.ndim != 2 or rows.shape[1] != 2 or not np.issubdtype(rows.dtype, np.integer):
        raise TransferError(f"{name} must be an (K, 2) integer array of (start, bytes), got {_what(rows)}")
    starts, sizes = rows[:, 0], rows[:, 1]
    bad = unownable(starts, sizes)
    if bad.any():
        i = int(np.argmax(bad))
        raise RefusedDescriptorError(
            f"{name}[{i}] = ({int(starts[i]):#x}, {int(sizes[i])} bytes) is no memory a process owns (it "
            f"must start past the null page and end by {MAX_END:#x}); nothing was copied"
        )


def _what(rows: np.ndarray) -> str:
    return f"shape {rows.shape} of {rows.dtype}"


def _copy(
    runs: np.ndarray,
    from_spans: np.ndarray,
    to_spans: np.ndarray,
    num_threads: int,
    validate: bool,
    device: torch.device = _HOST,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """The copies, on ``device``: host memory on the block-map engine; GPU memory on the
    device's run executor, on ``stream`` (the current one when None), returning once the
    bytes are there (the staging buffer is then posted, or the request reported done)."""
    runs = np.ascontiguousarray(runs, dtype=_U64)
    if device.type == "cpu":
        a, b = _exact_spans(from_spans), _exact_spans(to_spans)
        problem, run, _, _ = _native.copy_runs(runs, a, b, num_threads, validate=validate)
        _refuse_copy(runs, problem, run)
        return
    if validate:  # the executor reads and writes where it is told: checked here first
        _check_copies(runs, from_spans, to_spans)
    from kvlayout.transfer.cuda import _cuda_module, copy_runs  # kvlayout._cuda, only for a device copy

    _cuda_module(device)  # no CUDA extension or no device: an error before anything is copied
    on = stream if stream is not None else torch.cuda.current_stream(device)
    with torch.cuda.device(device), torch.cuda.stream(on):
        copy_runs(runs, device)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record()
    done.synchronize()  # the GIL is released while it waits


def _copy_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream a device copy runs on: the calling thread's current stream on
    ``device``, taken when the request starts, so the gather follows the kernels the
    caller queued before (those that wrote the KV). None for host copies."""
    if device.type == "cpu":
        return None
    from kvlayout.transfer.cuda import _cuda_module

    _cuda_module(device)
    return torch.cuda.current_stream(device)


class Staging:
    """A registered buffer the staged strategy gathers a request into (or, for a READ,
    receives it into), on the device of the cache it serves: host memory (DRAM) for a
    CPU cache, GPU memory (VRAM, ``device="cuda:N"``) for a cache on that GPU, where the
    gather and scatter run on the device (:func:`kvlayout.transfer.cuda.copy_runs`). One
    transfer uses it at a time (taken atomically: threads may share one); closed while
    one does, it stays registered until that transfer is waited for or released. A
    request released while in flight may still write it (NIXL cannot guarantee to cancel
    one under way): the buffer then stays busy, registered and allocated for good."""

    def __init__(self, agent: Agent, nbytes: int, *, device: str | torch.device = "cpu") -> None:
        nbytes = _byte_count(nbytes, "nbytes")
        dev = _staging_device(device)
        self.agent = agent
        self.device = dev
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        self.address = self.tensor.data_ptr()
        self.nbytes = nbytes
        self.registered = register(agent, self.tensor)
        # Its tensor is the caller's to reach (staging.tensor): a resize or a new storage
        # would leave NIXL's region and the planned copies on freed memory.
        self._placement = Placement([self.tensor], ["the staging buffer's tensor"])
        # Dropped without close(), NIXL lets go of its region (and the region of its memory)
        # when collected on the agent's caller's thread, else at the agent's next call
        # (defer: on the caller's thread, never another; one kept for good is never
        # dropped: _KEPT holds it).
        weakref.finalize(
            self, defer, agent, self.registered._deregister_when_free, self.registered._registered
        ).atexit = False
        self.busy = False
        self.closed = False
        self.kept = False  # a request released in flight may still write it: never handed out again
        self.kept_for = ""  # why, for messages
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        where = "" if self.device.type == "cpu" else f" on {self.device}"
        state = ", busy" if self.busy else ""
        state += f", kept for {self.kept_for}" if self.kept else ""
        state += ", closed" if self.closed else ""
        return f"Staging({self.nbytes} bytes at {self.address:#x}{where}{state})"

    @property
    def span(self) -> np.ndarray:
        return np.array([[self.address, self.nbytes]], dtype=_U64)

    def _refuse_moved(self, nothing: str) -> None:
        """Refuse a copy or a post through the buffer once its tensor's memory changed
        (``staging.tensor.untyped_storage().resize_(0)``, say): the planned runs and
        NIXL's region address the old memory."""
        moved = self._placement.moved()
        if moved is not None:
            raise NixlError(
                f"{self!r}: {moved} since the buffer was made, and its plans and NIXL's region address the "
                f"old memory: make a new Staging (and leave staging.tensor's memory alone); {nothing}"
            )

    def close(self) -> None:
        """Deregister the buffer, now or, while a transfer holds it, when that one lets go
        (NIXL would otherwise move its bytes through a region it no longer holds)."""
        _drain_deferred(self.agent)  # a request dropped unreleased may hold it: let go of first
        with self._lock:
            if not self.closed:
                self.closed = True
                if not self.busy:
                    self.registered.deregister()

    def _locks(self) -> list[Any]:
        """The locks letting go of or keeping the buffer takes (a dropped object's deferred
        work must not wait for one its thread may hold)."""
        held = _REGIONS.get(self.agent)
        return [self._lock] + ([held.lock] if held is not None else [])

    def _take(self) -> bool:
        """Take the buffer for one request, atomically (two threads posting through it
        both saw it free, and both gathered into it); False while another holds it."""
        _drain_deferred(self.agent)  # a request dropped unreleased may still hold it
        with self._lock:
            if self.closed and not self.busy:
                raise TransferError(f"{self!r} is closed: NIXL no longer holds its region")
            if self.busy:
                return False
            self.busy = True
            return True

    def _let_go(self) -> None:
        """The transfer that held the buffer is done with it."""
        with self._lock:
            self.busy = False
            if self.closed:
                self.registered.deregister()

    def _keep(self, kept_for: str = "a request released in flight") -> None:
        """The request that held the buffer was let go of while NIXL may still write it
        (or read it): busy, registered and allocated for good (a later request would send
        or scatter the late bytes, a freed buffer would take them)."""
        with self._lock:
            if not self.kept:
                self.kept_for = kept_for
                _KEPT.append(self)
            self.busy = self.kept = True

    def _take_or_refuse(self, what: str) -> None:
        """Take the buffer for ``what`` (a staged transfer, a peer's copy), or say why not."""
        if self._take():
            return
        if self.kept:
            raise TransferError(
                f"{self!r} is kept for good: {self.kept_for} may still move bytes through it; "
                f"{what} needs a new Staging"
            )
        raise TransferError(
            f"{self!r} is in use by another request (a transfer not yet waited for, or a peer's copy "
            f"prepared and not yet run): one request at a time goes through a staging buffer"
        )

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Memory a request released in flight may still be written into: never freed.
_KEPT: list[object] = []


def _staging_device(device: str | torch.device) -> torch.device:
    """Where a staging buffer goes: the CPU, or a CUDA device the extension can copy on
    (its index made explicit, as a cache's device is)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:  # torch's own words, for a name it does not know
        raise TransferError(f"Staging(device={device!r}) is not a device: {exc}") from None
    if dev.type == "cpu":
        return _HOST
    if dev.type != "cuda":
        raise TransferError(f"a staging buffer goes in host memory (cpu) or on a CUDA device, not on {dev}")
    from kvlayout.transfer.cuda import _cuda_module  # refuses a build or machine without CUDA

    try:
        _cuda_module(dev)
    except KVLayoutError as exc:  # name the caller's argument, not the extension's internals
        raise type(exc)(
            f"Staging(device={str(device)!r}): no staging buffer on {dev} here ({exc}); "
            "pass device='cpu' for a cache in host memory"
        ) from exc
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


def _check_staging_device(staging: Staging, local: MapSide) -> None:
    """A staging buffer is on the local side's device: the staged copy moves bytes within
    one device (the block-map engine in host memory, the run executor on a GPU)."""
    want = _HOST if local.device_type == "cpu" else torch.device(local.device_type, local.device_index)
    if staging.device != want:
        raise TransferError(
            f"the staged strategy copies within one device: the local side is on {want} and the staging "
            f"buffer on {staging.device}; give it a Staging(agent, nbytes, device={str(want)!r})"
        )


_copier_lock = threading.Lock()
_copier_pool: list[ThreadPoolExecutor] = []  # made on first use


def _copier() -> ThreadPoolExecutor:
    """The thread that runs staged pipelines' local copies (native, GIL released), so a
    stage's gather or scatter overlaps another's wire time while the polling thread
    drives NIXL (every NIXL call stays on the caller's thread)."""
    with _copier_lock:
        if not _copier_pool:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlayout-nixl-copy")
            try:
                pool.submit(int)  # its one thread starts here, not inside a request's submit
            except BaseException:
                # Interrupted (Ctrl-C) while the thread started, before the pool listed it:
                # nothing at exit would wake it, and the interpreter waited for it for good.
                # Shut down, the pool's queue wakes it to end.
                pool.shutdown(wait=False)
                raise
            _copier_pool.append(pool)
        return _copier_pool[0]


def _settle(copies: list[Future[None]]) -> None:
    """Cancel the local copies not yet started and wait for the one under way: none
    touches its memory once this returns (the caller may reuse or let go of it)."""
    for fut in copies:
        fut.cancel()
    wait_for(copies)
