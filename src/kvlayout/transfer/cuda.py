"""The CUDA side of ``kvlayout.transfer``: a prepared plan's kernels on the current stream,
and ``copy_runs``, the device executor of a table of byte runs (a block map's runs).

At prepare time each job's pointer table and segment table (the CPU engine's plan, built
by ``kvlayout._native.plan_segments``) are uploaded to the device once, and the widest
copy unit (up to 16 bytes) that the segments and the cache's pointers allow is fixed. Per
call, the block ids, chunk addresses and chunk token counts go up in one pinned host
buffer with one non-blocking copy on the current stream, and each job is one kernel
launch on that stream: nothing synchronizes the stream, so a call returns before the
bytes move, as any CUDA copy does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvlayout import _native
from kvlayout.errors import KVLayoutError, TransferError

if TYPE_CHECKING:
    from kvlayout.transfer.plan import TransferPlan, _Job

__all__ = ["CudaPlan", "SegmentTable", "copy_runs", "narrow_unit", "segment_table", "staging"]

_MAX_SEGMENTS = 65535  # one grid row each


@dataclass(frozen=True)
class SegmentTable:
    """One job's segments as the kernels read them, and how to launch them."""

    rows: np.ndarray  # uint8, one row of bytes per segment
    unit: int  # the widest copy unit the segments and the pointer table allow
    largest: int  # bytes of the largest segment (sizes the thread blocks)
    depth: int  # the loop depth the kernels are compiled for


def segment_table(plan: TransferPlan, job: _Job, direction: int = 0) -> SegmentTable:
    """A job's segment table for one direction (0 store, 1 load: a load leaves out the
    pointers of layers sharing an earlier layer's KV cache), unit narrowed by its pointers
    (no device needed)."""
    rows, widest, largest, depth = _native.plan_segments(plan._native_job(job), direction)
    unit = narrow_unit(int(widest), job.plane.data_ptrs, job.element_size)
    return SegmentTable(rows, unit, int(largest), int(depth))


def narrow_unit(unit: int, values: Sequence[int], element_size: int) -> int:
    """The widest power of two up to ``unit`` dividing every value: at least an element
    where every value is element-aligned (torch's own tensors are), below it where one is
    not (a foreign pointer through DLPack), since a GPU faults on a misaligned access."""
    del element_size  # the segments' unit is already a multiple of it; the pointers decide
    g = 0
    for v in values:
        g = math.gcd(g, int(v))
    while unit > 1 and g % unit:
        unit //= 2
    return unit


def staging(ids: np.ndarray, chunk_ptrs: np.ndarray, chunk_tokens: np.ndarray, out: np.ndarray) -> None:
    """One call's uploads in one int64 buffer: ``[ids | chunk addresses | chunk tokens]``."""
    n, c = len(ids), len(chunk_ptrs)
    out[:n] = ids
    out[n : n + c] = chunk_ptrs.view(np.int64)
    out[n + c : n + 2 * c] = chunk_tokens


@dataclass(frozen=True)
class _Launch:
    segments: int  # device address of the segment table
    count: int
    largest: int
    depth: int
    table: int  # device address of the pointer table
    unit: int
    element_size: int


def _cuda_module(device: torch.device) -> Any:
    """kvlayout._cuda, checked: a CUDA device, an extension built with CUDA, a device it sees."""
    if device.type != "cuda":
        raise TransferError(f"no transfer for tensors on {device} (CPU and CUDA are served)")
    try:
        from kvlayout import _cuda
    except ImportError:
        raise TransferError(
            "kvlayout was built without its CUDA extension (no CUDA toolkit at build time); "
            "rebuild on a machine with nvcc (CMake option KVLAYOUT_CUDA=ON)"
        ) from None
    if _cuda.device_count() == 0:
        raise KVLayoutError("kvlayout._cuda sees no CUDA device")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _loaded:
        # CUDA loads a kernel at its first launch, and loading may wait for the work queued on
        # the device: a plan's first copy would block behind a busy stream. Load them now.
        with torch.cuda.device(index):
            try:
                _cuda.load_kernels()
            except ValueError as exc:
                raise TransferError(f"kvlayout._cuda cannot run on cuda:{index}: {exc}") from None
        _loaded.add(index)
    return _cuda


_loaded: set[int] = set()  # the devices whose contexts hold kvlayout's kernels


def copy_runs(runs: np.ndarray, device: torch.device) -> None:
    """Copy byte runs between device addresses on ``device``, in one kernel on its current
    stream: ``runs`` is an ``(N, 3)`` uint64 array of (source address, destination address,
    length), every address on that device (a block map's runs; nothing checks that the
    addresses are allocated). The host splits the runs into thread-block work items
    (``kvlayout._native.plan_run_items``), the table and the items go up in one pinned
    buffer with one non-blocking copy, and the call returns before the bytes move, as any
    CUDA copy does. Runs are copied in no particular order: destinations must not overlap
    each other or any source.
    """
    if not isinstance(runs, np.ndarray):
        raise TypeError(f"copy_runs: runs must be a numpy array, got {type(runs).__name__}")
    if runs.dtype != np.uint64 or runs.ndim != 2 or runs.shape[1] != 3:
        raise TypeError(
            "copy_runs: runs must be an (N, 3) uint64 array of (source, destination, length), "
            f"got {runs.dtype} of shape {runs.shape}"
        )
    table = np.ascontiguousarray(runs)  # the caller's own table, not a KV cache
    try:
        items = _native.plan_run_items(table)
    except ValueError as exc:
        raise TransferError(str(exc)) from None
    device = torch.device(device)
    cuda = _cuda_module(device)
    if len(items) == 0:
        return
    host = torch.empty(3 * (len(table) + len(items)), dtype=torch.int64, pin_memory=True)
    words = host.numpy()
    words[: 3 * len(table)] = table.reshape(-1).view(np.int64)
    words[3 * len(table) :] = items.reshape(-1).view(np.int64)
    with torch.cuda.device(device):
        # The caching allocators keep both buffers until the stream has used them.
        uploaded = host.to(device, non_blocking=True)
        base = uploaded.data_ptr()
        stream = torch.cuda.current_stream(device).cuda_stream
        try:
            cuda.copy_runs(base, base + 24 * len(table), len(items), stream)
        except ValueError as exc:
            raise TransferError(f"copy_runs on {device}: {exc}") from None


class CudaPlan:
    """A transfer plan's device half: pointer and segment tables on the device, units fixed."""

    def __init__(self, plan: TransferPlan) -> None:
        self._cuda = _cuda_module(plan.device)
        self.plan = plan
        self._launches: tuple[list[_Launch], list[_Launch]] = ([], [])  # store, load
        self._tables: list[torch.Tensor] = []  # the device tables, kept alive with the plan
        # The streams the tables were read on besides the one they were made on: the caching
        # allocator then holds their memory, once the plan is gone, until those streams have
        # read them (a plan prepared on one stream and run on a load stream).
        self._streams: set[int] = set()
        for job in plan.jobs:
            pointers = torch.tensor(job.plane.data_ptrs, dtype=torch.int64).to(plan.device)
            self._tables.append(pointers)
            for direction in (0, 1) if job.plane.repeats else (0,):
                segments = segment_table(plan, job, direction)
                count = len(segments.rows)
                if count > _MAX_SEGMENTS:
                    raise TransferError(
                        f"{plan.layout}: {count} segments per block; the CUDA grid holds {_MAX_SEGMENTS}"
                    )
                rows = torch.from_numpy(segments.rows).to(plan.device)
                self._tables.append(rows)
                launch = _Launch(
                    rows.data_ptr(), count, segments.largest, segments.depth, pointers.data_ptr(),
                    segments.unit, job.element_size,
                )  # fmt: skip
                self._launches[direction].append(launch)
                if not job.plane.repeats:
                    self._launches[1].append(launch)  # both directions move the same segments

    def run(
        self,
        direction: int,
        ids: np.ndarray,
        chunk_ptrs: np.ndarray,
        chunk_tokens: np.ndarray,
        per_chunk: int,
        skip: int,
        threads: int,
    ) -> tuple[int, int]:
        """Launch every job; ``(first bad block id index or -1, 1)`` like the CPU plan."""
        n, c = len(ids), len(chunk_ptrs)
        bad = _native.first_bad_block_id(ids, self.plan.num_blocks)
        if bad >= 0:  # kvlayout.transfer asked first; a kernel must never see one
            return bad, 0
        if skip >= n:
            return -1, 0
        plan = self.plan
        host = torch.empty(n + 2 * c, dtype=torch.int64, pin_memory=True)
        staging(ids, chunk_ptrs, chunk_tokens, host.numpy())
        # The kernels launch on the current device: make it the cache's (cuda:1 while cuda:0
        # is current would run them on the wrong GPU, or fail to launch on cuda:1's stream).
        with torch.cuda.device(plan.device):
            current = torch.cuda.current_stream(plan.device)
            if current.cuda_stream not in self._streams:
                for table in self._tables:
                    table.record_stream(current)
                self._streams.add(current.cuda_stream)
            # The caching allocators keep both buffers until the stream has used them.
            uploaded = host.to(plan.device, non_blocking=True)
            base = uploaded.data_ptr()
            for launch in self._launches[direction]:
                unit = narrow_unit(launch.unit, [int(p) for p in chunk_ptrs], launch.element_size)
                try:
                    self._cuda.transfer_blocks(
                        direction, launch.segments, launch.count, launch.largest, launch.depth, launch.table,
                        plan.block_size, plan.row_bytes, unit, base, n, base + 8 * n, base + 8 * (n + c),
                        per_chunk, skip, current.cuda_stream,
                    )  # fmt: skip
                except ValueError as exc:
                    raise TransferError(f"{plan.layout} on {plan.device}: {exc}") from None
        return -1, 1
