"""The CUDA side of ``kvlayout.transfer``: a prepared plan's kernels on the current stream.

At prepare time each job's pointer table is uploaded to the device once, and the widest
copy unit (up to 16 bytes) that the cache side allows is fixed. Per call, the block ids,
chunk addresses and chunk token counts go up in one pinned host buffer with one
non-blocking copy on the current stream, and each job is one kernel launch on that
stream: nothing synchronizes the stream, so a call returns before the bytes move, as
any CUDA copy does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvlayout.errors import KVLayoutError

if TYPE_CHECKING:
    from kvlayout.layout import Layout
    from kvlayout.transfer import TransferPlan

__all__ = ["CudaPlan", "copy_unit", "narrow_unit", "staging"]


def copy_unit(
    layout: Layout, sizes: dict[str, int], element_size: int, block_stride: int, addresses: Sequence[int]
) -> int:
    """The widest power-of-two unit (bytes, at most 16) that tiles every copy of a job."""
    g = layout.row_run(sizes) * element_size
    for stride in layout.tensor_strides(sizes, block_stride or None):
        if stride != 1:  # the innermost axis lies inside the runs
            g = math.gcd(g, stride * element_size)
    return narrow_unit(16, [g, *addresses], element_size)


def narrow_unit(unit: int, values: Sequence[int], element_size: int) -> int:
    """The widest power of two up to ``unit`` dividing every value (never below an element)."""
    g = 0
    for v in values:
        g = math.gcd(g, int(v))
    while unit > element_size and g % unit:
        unit //= 2
    return max(unit, element_size) if g % element_size == 0 else element_size


def staging(ids: np.ndarray, chunk_ptrs: np.ndarray, chunk_tokens: np.ndarray, out: np.ndarray) -> None:
    """One call's uploads in one int64 buffer: ``[ids | chunk addresses | chunk tokens]``."""
    n, c = len(ids), len(chunk_ptrs)
    out[:n] = ids
    out[n : n + c] = chunk_ptrs.view(np.int64)
    out[n + c : n + 2 * c] = chunk_tokens


class CudaPlan:
    """A transfer plan's device half: pointer tables on the device, units fixed."""

    def __init__(self, plan: TransferPlan) -> None:
        from kvlayout.transfer import TransferError, native_sizes

        if plan.device.type != "cuda":
            raise TransferError(f"no transfer for tensors on {plan.device} (CPU and CUDA are served)")
        try:
            from kvlayout import _cuda
        except ImportError:
            raise TransferError(
                "kvlayout was built without its CUDA extension (no CUDA toolkit at build time); "
                "rebuild on a machine with nvcc (CMake option KVLAYOUT_CUDA=ON)"
            ) from None
        if _cuda.device_count() == 0:
            raise KVLayoutError("kvlayout._cuda sees no CUDA device")
        self._cuda = _cuda
        self.plan = plan
        layout = plan.layout
        self._launches: list[tuple[Any, ...]] = []
        self._tables: list[torch.Tensor] = []  # the device pointer tables, kept alive with the plan
        for job in plan.jobs:
            table = torch.tensor(job.plane.data_ptrs, dtype=torch.int64).to(plan.device)
            self._tables.append(table)
            aligned = [*job.plane.data_ptrs, plan.row_bytes, job.row_offset]
            unit = copy_unit(layout, job.sizes, job.element_size, job.block_stride, aligned)
            heads, head = layout.num_heads(job.sizes), layout.head_size(job.sizes)
            self._launches.append((
                int(plan.format), native_sizes(layout, job.sizes), job.block_stride, job.element_size,
                table.data_ptr(), plan.kv_size, plan.num_layers, plan.block_size, heads, head,
                plan.row_bytes, job.row_offset, unit,
            ))  # fmt: skip

    def first_bad_block_id(self, ids: np.ndarray) -> int:
        bad = np.flatnonzero((ids < 0) | (ids >= self.plan.num_blocks))
        return int(bad[0]) if bad.size else -1

    def first_repeated_block_id(self, ids: np.ndarray, skip: int) -> int:
        rest = ids[skip:]
        _, first = np.unique(rest, return_index=True)
        repeated = np.setdiff1d(np.arange(len(rest)), first)
        return int(repeated[0]) + skip if repeated.size else -1

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
        bad = self.first_bad_block_id(ids)
        if bad >= 0:
            return bad, 0
        if skip >= n:
            return -1, 0
        device = self.plan.device
        host = torch.empty(n + 2 * c, dtype=torch.int64, pin_memory=True)
        staging(ids, chunk_ptrs, chunk_tokens, host.numpy())
        # The caching allocators keep both buffers until the stream has used them.
        uploaded = host.to(device, non_blocking=True)
        base = uploaded.data_ptr()
        stream = torch.cuda.current_stream(device).cuda_stream
        for launch in self._launches:
            *head, unit = launch
            element_size = head[3]
            unit = narrow_unit(unit, [int(p) for p in chunk_ptrs], element_size)
            self._cuda.transfer_blocks(
                direction, *head, unit, base, n, base + 8 * n, base + 8 * (n + c), per_chunk, skip, stream
            )
        return -1, 1
