"""MAX's recurrent state pool (``RecurrentStateBuffer``, ``max/nn/kv_cache/cache_params.py``).

A hybrid model's recurrent states (a linear-attention or SSM layer's) share MAX's page
pool with its attention caches: one block holds one request's whole state, every layer of
a state leaf (``RecurrentStateRegion.rows_of(page)``: rows ``page * num_layers`` onward,
``bytes_per_page = num_layers * row_elements * dtype size``). The buffer holds, per leaf,
one ``[num_blocks, bytes_per_page]`` uint8 tensor a device (``pages[leaf_id][device]``),
and ``to_memory()`` hands exactly these (``KVCacheMemory(replicated=False)``) to MAX's
``KVTransferEngine`` and host tier, which copy a page whole. Read so here: opaque whole
pages, block ``b`` the bytes of MAX's block ``b``, mapped only to pages of the same leaf
and size (another replica or process of the same model and TP degree): a state's split
between devices is not in the buffer, so no map reshards it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.dlpack

from kvlayout._generated.engines import EngineType
from kvlayout.detection.base import DetectionError
from kvlayout.integrations.page_lists import listed_pages, page_rows
from kvlayout.registration.opaque import OpaquePages
from kvlayout.registration.registration import Registration

__all__ = ["RecurrentStateError", "recurrent_state_pages"]

_ADVICE = (
    "MAX's recurrent state pages (RecurrentStateBuffer.pages) move whole, to pages of the same state "
    "leaf at the same TP degree: a state's split between devices is not in the buffer"
)


class RecurrentStateError(DetectionError):
    """A ``RecurrentStateBuffer`` (or a device of it) that is not what MAX allocates."""


def recurrent_state_pages(buffer: Any, device: int = 0) -> dict[str, Registration]:
    """Device ``device``'s pages of MAX's ``RecurrentStateBuffer`` as registrations, one a
    state leaf (keyed by its leaf id, as ``leaves()`` and ``to_memory()`` name it): opaque
    whole pages, block ids MAX's block ids (``rows_of(block)``), mapped without
    ``num_tokens`` (a block is a request's whole state). A page is a tensor (or a
    DLPack-capable buffer, MAX's ``Buffer``, read with ``torch.from_dlpack``)
    ``[num_blocks, bytes_per_page]`` uint8. Raises :class:`RecurrentStateError` naming the
    leaf and device of anything else."""
    pages = getattr(buffer, "pages", None)
    if not isinstance(pages, dict) or not pages:
        raise RecurrentStateError(
            f"{type(buffer).__name__} is not a RecurrentStateBuffer: its pages are "
            f"{type(pages).__name__}, not a dict of state leaves to their per-device page tensors"
        )
    if type(device) is not int or device < 0:
        raise RecurrentStateError(f"device must be a non-negative int (a TP shard's index), not {device!r}")
    out: dict[str, Registration] = {}
    for leaf, per_device in pages.items():
        if not isinstance(per_device, list | tuple) or device >= len(per_device):
            held = len(per_device) if isinstance(per_device, list | tuple) else type(per_device).__name__
            raise RecurrentStateError(
                f"RecurrentStateBuffer.pages[{leaf!r}] holds no device {device} (it holds {held})"
            )
        where = f"RecurrentStateBuffer.pages[{leaf!r}][{device}]"
        t = _tensor(per_device[device], where)
        page = OpaquePages(f"MAX recurrent state {leaf} ({t.shape[1]} bytes)", False, advice=_ADVICE)
        rows = page_rows(where, t, 1, "MAX", RecurrentStateError)
        out[str(leaf)] = listed_pages([rows], page, [t], 1, EngineType.MAX)
    return out


def _tensor(value: Any, where: str) -> torch.Tensor:
    """``value`` as the uint8 ``[num_blocks, bytes_per_page]`` tensor it is or shares memory with."""
    if not isinstance(value, torch.Tensor) and hasattr(value, "__dlpack__"):
        value = torch.utils.dlpack.from_dlpack(value)
    if not isinstance(value, torch.Tensor):
        raise RecurrentStateError(f"{where} is {type(value).__name__}, not a tensor of pages")
    if value.dim() != 2 or value.dtype != torch.uint8 or value.shape[0] < 1 or value.shape[1] < 1:
        raise RecurrentStateError(
            f"{where} is {list(value.shape)} {value.dtype}, "
            "not MAX's [num_blocks, bytes_per_page] uint8 pages"
        )
    if value.stride(1) != 1 or value.stride(0) < value.shape[1]:
        raise RecurrentStateError(
            f"{where} has strides {tuple(value.stride())}: a page's bytes are not one run"
        )
    return value
