"""What the readers of pools as opaque pages share (SGLang's Mamba states and AITER
SHUFFLE pools, ATOM's too): a pool's dtype as the algebra names it, and per-layer byte
rows registered as opaque pages of an engine's per-layer list format."""

from __future__ import annotations

import torch

from kvlayout._generated.engines import EngineType
from kvlayout.detection.base import DetectionError
from kvlayout.detection.discovery import detect
from kvlayout.layout.dtypes import DTYPE_SIZES
from kvlayout.registration.opaque import OpaquePages, mark_opaque_pages
from kvlayout.registration.registration import Registration

__all__ = ["dtype_name", "listed_pages"]


def dtype_name(t: torch.Tensor, what: str, error: type[DetectionError]) -> str:
    """``t``'s dtype by its name in :data:`~kvlayout.layout.dtypes.DTYPE_SIZES` (a page
    array's dtype), or ``error`` naming ``what`` holds it."""
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in DTYPE_SIZES:
        raise error(f"{what} is {dtype}, which kvlayout does not know")
    return dtype


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
