"""What the readers of pools as opaque pages share (SGLang's Mamba states and AITER
SHUFFLE pools, ATOM's too): a pool's dtype as the algebra names it, and per-layer byte
rows registered as opaque pages of an engine's per-layer list format."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvlayout._generated.engines import EngineType
from kvlayout.detection.base import DetectionError
from kvlayout.detection.discovery import detect
from kvlayout.layout.dtypes import DTYPE_SIZES
from kvlayout.registration.backing import no_memory
from kvlayout.registration.opaque import OpaquePages, mark_opaque_pages
from kvlayout.registration.registration import Registration

__all__ = ["dtype_name", "layer_list", "listed_pages", "page_rows"]


def dtype_name(t: torch.Tensor, what: str, error: type[DetectionError]) -> str:
    """``t``'s dtype by its name in :data:`~kvlayout.layout.dtypes.DTYPE_SIZES` (a page
    array's dtype), or ``error`` naming ``what`` holds it."""
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in DTYPE_SIZES:
        raise error(f"{what} is {dtype}, which kvlayout does not know")
    return dtype


def layer_list(name: str, buffers: Any, origin: str, error: type[DetectionError]) -> list[torch.Tensor]:
    """``buffers`` (the engine's per-layer list ``name``, from ``origin``) as a list of
    tensors alike (shape, dtype, device), or ``error`` naming the first that is not."""
    if isinstance(buffers, torch.Tensor) or not isinstance(buffers, Sequence) or not buffers:
        raise error(
            f"{name} is {type(buffers).__name__}, not a non-empty list of per-layer tensors ({origin})"
        )
    layers = list(buffers)
    for i, t in enumerate(layers):
        if not isinstance(t, torch.Tensor):
            raise error(f"{name}[{i}] is {type(t).__name__}, not a tensor")
        problem = no_memory(t)  # before any view of it: a freed buffer has no pages to read
        if problem is not None:
            raise error(f"{name}[{i}] {list(t.shape)} {problem}")
        first = layers[0]
        if (t.shape, t.dtype, t.device) != (first.shape, first.dtype, first.device):
            raise error(
                f"{name}[{i}] is {list(t.shape)} {t.dtype} on {t.device} and {name}[0] {list(first.shape)} "
                f"{first.dtype} on {first.device}: every layer alike expected"
            )
    return layers


def host_page_layers(
    name: str, host: Any, page_size: int, heads: int, pool: str, what: str, error: type[DetectionError]
) -> tuple[list[torch.Tensor], int]:
    """A HiCache host pool's per-layer ``[pages, page bytes]`` views of ``host`` (uint8
    ``[pages, NL, page bytes]``, a device page's bytes at ``[host_page, layer]``) and the
    bytes a head holds a token (page bytes over ``heads * page_size``). ``pool``: the host
    pool's class, ``what``: the page it holds, for messages."""
    if not isinstance(host, torch.Tensor):
        raise error(
            f"{name} is {type(host).__name__}, not the host pool's tensor [pages, NL, page bytes] ({pool})"
        )
    if host.dtype != torch.uint8 or host.dim() != 3 or host.numel() == 0:
        raise error(f"{name} is {list(host.shape)} {host.dtype}, not uint8 [pages, NL, page bytes] ({pool})")
    page_bytes = int(host.shape[2])
    if page_bytes % (heads * page_size):
        raise error(
            f"{name} is {list(host.shape)}: a page of {page_bytes} bytes, which is no {what} of "
            f"head_num={heads} heads and page_size={page_size} tokens (H * page_size * sf bytes)"
        )
    return [host[:, layer] for layer in range(host.shape[1])], page_bytes // (heads * page_size)


def page_rows(
    name: str, t: torch.Tensor, rows_per_block: int, allocator: str, error: type[DetectionError]
) -> torch.Tensor:
    """Layer ``t``'s blocks (its dim 0) as int8 rows ``[blocks * rows_per_block, 1,
    block_bytes // rows_per_block]``, a view: the blocks must be contiguous, one after
    another, as ``allocator`` allocates them, or ``error`` names ``name``."""
    try:
        return t.view(torch.int8).view(t.shape[0] * rows_per_block, 1, -1)
    except RuntimeError:
        raise error(
            f"{name} {list(t.shape)} (strides {list(t.stride())}) is not contiguous pages, one after "
            f"another, as {allocator} allocates them"
        ) from None


def listed_pages(
    rows: list[torch.Tensor],
    page: OpaquePages,
    over: list[torch.Tensor],
    rows_per_block: int,
    engine: EngineType,
) -> Registration:
    """Per-layer int8 rows ``[blocks * rows_per_block, 1, bytes]`` (each a view of the
    tensor of ``over`` beside it) marked as ``page`` and read as SGLang's per-layer list
    in blocks of ``rows_per_block`` rows (``NL_X_NB_BS_HS``): a layer's blocks may lie any
    distance apart. ATOM's SHUFFLE pool is read so too: ATOM's own detector keeps int8 rows
    ``[NB, 1, bytes]`` as its MP connector's whole blocks, never regrouped in blocks; the
    registration is labelled ``engine``'s, whose cache it is."""
    for view, t in zip(rows, over, strict=True):
        mark_opaque_pages(view, page, (t,))
    return detect(rows, EngineType.SGLANG, {"tokens_per_block": rows_per_block}).labelled(engine)
