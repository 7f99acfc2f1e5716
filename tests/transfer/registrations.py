"""Build registrations of any layout for tests: nested lists of leaves cut from 1-D bases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvlayout import Layout

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8)


@dataclass
class Registration:
    kv: Any
    leaves: list[torch.Tensor]  # in pointer-table order
    bases: list[torch.Tensor]  # 1-D byte storage behind each leaf (padding included)


def make_registration(
    layout: Layout,
    sizes: dict[str, int],
    dtype: torch.dtype,
    *,
    pad: int = 0,
    seed: int = 0,
    device: torch.device | None = None,
) -> Registration:
    """Random bytes in every leaf; dim 0 rows ``pad`` elements wider when the layout allows.

    Leaves are made the way engines make them (a wider buffer, sliced and viewed), so
    torch, not the algebra, computes their strides. Inner tuple levels are tuples.
    """
    gen = torch.Generator().manual_seed(seed)
    shape = layout.tensor_shape(sizes)
    row = 1
    for n in shape[1:]:
        row *= n
    leaves, bases = [], []
    for _ in layout.pointer_order(sizes):
        base = torch.randint(
            0, 256, (shape[0] * (row + pad) * dtype.itemsize,), dtype=torch.uint8, generator=gen
        ).to(device or "cpu")  # the same bytes on any device
        wide = base.view(dtype).view(shape[0], row + pad)
        leaves.append(wide[:, :row].view(shape))
        bases.append(base)
    return Registration(_nest(layout, sizes, leaves), leaves, bases)


def _nest(layout: Layout, sizes: dict[str, int], leaves: list[torch.Tensor]) -> Any:
    extents = layout.list_shape(sizes)
    if not extents:
        return leaves[0]

    def build(depth: int, items: list[Any]) -> Any:
        if depth == len(extents):
            return items[0]
        n = extents[depth]
        step = len(items) // n
        parts = [build(depth + 1, items[i * step : (i + 1) * step]) for i in range(n)]
        return tuple(parts) if depth > 0 else parts

    return build(0, leaves)
