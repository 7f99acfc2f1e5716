"""The CUDA side of ``kvlayout.transfer``: one kernel launch per job on the current stream.

``kvlayout.transfer`` has validated the registration, the chunks and the block ids; here
they become device arrays of addresses, and each job gets the widest copy unit (up to
16 bytes) that every contiguous run, stride, offset and pointer of it is aligned to.
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

__all__ = ["copy_unit", "transfer"]


def copy_unit(
    layout: Layout, sizes: dict[str, int], element_size: int, block_stride: int, addresses: Sequence[int]
) -> int:
    """The widest power-of-two unit (bytes, at most 16) that tiles every copy of a job."""
    g = layout.row_run(sizes) * element_size
    for stride in layout.tensor_strides(sizes, block_stride or None):
        if stride != 1:  # the innermost axis lies inside the runs
            g = math.gcd(g, stride * element_size)
    for address in addresses:
        g = math.gcd(g, address)
    unit = 16
    while unit > element_size and g % unit:
        unit //= 2
    return max(unit, element_size) if g % element_size == 0 else element_size


def transfer(
    direction: int, reg: Any, ids: np.ndarray, chunks: list[torch.Tensor], per_chunk: int, skip: int
) -> None:
    from kvlayout.transfer import TransferError, _native_sizes

    if reg.device.type != "cuda":
        raise TransferError(f"no transfer for tensors on {reg.device} (CPU and CUDA are served)")
    try:
        from kvlayout import _cuda
    except ImportError:
        raise TransferError(
            "kvlayout was built without its CUDA extension (no CUDA toolkit at build time); "
            "rebuild on a machine with nvcc (CMake option KVLAYOUT_CUDA=ON)"
        ) from None
    if _cuda.device_count() == 0:
        raise KVLayoutError("kvlayout._cuda sees no CUDA device")
    device = reg.device
    ids_dev = torch.as_tensor(ids, dtype=torch.int64).to(device)
    chunk_ptrs = torch.tensor([c.data_ptr() for c in chunks], dtype=torch.int64).to(device)
    chunk_tokens = torch.tensor([c.shape[2] for c in chunks], dtype=torch.int64).to(device)
    stream = torch.cuda.current_stream(device).cuda_stream
    layout = reg.layout
    fmt = int(reg.format)
    for job in reg.jobs:
        addresses = [leaf.data_ptr() for leaf in job.leaves]
        ptrs = torch.tensor(addresses, dtype=torch.int64).to(device)
        aligned = [*addresses, reg.row_bytes, job.row_offset, *(c.data_ptr() for c in chunks)]
        unit = copy_unit(layout, job.sizes, job.element_size, job.block_stride, aligned)
        heads, head = layout.num_heads(job.sizes), layout.head_size(job.sizes)
        _cuda.transfer_blocks(
            direction, fmt, _native_sizes(layout, job.sizes), job.block_stride, job.element_size,
            ptrs.data_ptr(), reg.kv_size, reg.num_layers, reg.block_size, heads, head, reg.row_bytes,
            job.row_offset, unit, ids_dev.data_ptr(), len(ids), chunk_ptrs.data_ptr(),
            chunk_tokens.data_ptr(), per_chunk, skip, stream,
        )  # fmt: skip
