"""Zero-copy recovery of a registration's physical dim order.

Engines often hand out a permuted view of their allocation (vLLM exposes an HND buffer
through NHD logical dims). :func:`attempt_permute_to_contiguous_view` re-views every
tensor with its dims in memory order, so detection reads physical axes. It never copies:
a tensor that no permutation makes contiguous is accepted only with dim-0 padding (block
rows wider than their content, which kernels honour through ``block_stride_elems``) and
is otherwise rejected with the reason.

Knows strides and permutations only; nothing about formats or engines.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

import torch

from kvlayout.errors import KVLayoutError
from kvlayout.nesting import LocatedError, map_leaves
from kvlayout.types import DiscoverableKVCache

__all__ = [
    "StridedViewError",
    "attempt_permute_to_contiguous_view",
    "dim0_padding",
    "physical_entries",
    "physical_order",
]


class StridedViewError(KVLayoutError):
    """A tensor whose strides no permutation and no dim-0 padding can explain."""


def attempt_permute_to_contiguous_view(kv: DiscoverableKVCache) -> DiscoverableKVCache:
    """Each tensor of ``kv`` as a view with its dims in physical (memory) order.

    Metadata only, never a copy: results share storage with the input, and a write
    through them reaches the original. Lists and tuples become new lists (the structure
    is rebuilt, the tensors are not). A tensor already in physical order is returned as
    the same object (LMCache 0.5.6 always makes a new view). Physical order sorts dims by
    stride, outermost first; a size-1 dim goes inside a dim of equal stride, because its
    stride is arbitrary (vLLM's HND cache with one head, exposed as NHD, recovers HND).
    Size-1 dims of a tensor already in that order, and tensors with no elements, are
    never moved.

    Raises :class:`StridedViewError` (a ``KVLayoutError``) for views that are neither
    contiguous nor dim-0 padded, naming the tensor, the reason, its shape and strides;
    ``TypeError`` for anything that is not a tensor, list or tuple (dicts, strings,
    ``None``), never ``RecursionError``.
    """
    views: DiscoverableKVCache = map_leaves(kv, _physical_view)
    return views


def physical_entries(entries: Sequence[object], indices: Iterable[int]) -> dict[int, DiscoverableKVCache]:
    """:func:`attempt_permute_to_contiguous_view` of some entries of a list (errors name
    ``kv_caches[i]``); the other entries are not looked at."""
    return {i: map_leaves(entries[i], _physical_view, start=(i,)) for i in indices}


def physical_order(shape: Sequence[int], stride: Sequence[int]) -> list[int]:
    """Dims sorted by stride, outermost first; a size-1 dim after a dim of equal stride;
    full ties keep their order."""
    return sorted(range(len(shape)), key=lambda i: (stride[i], shape[i] != 1), reverse=True)


def _in_physical_order(shape: Sequence[int], stride: Sequence[int]) -> bool:
    # Adjacent keys non-increasing <=> the stable sort above is the identity.
    for i in range(len(shape) - 1):
        a, b = stride[i], stride[i + 1]
        if a < b or (a == b and shape[i] == 1 and shape[i + 1] != 1):
            return False
    return True


def _physical_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` in physical order (the same object when it already is)."""
    shape = t.shape
    contiguous = t.is_contiguous()
    if contiguous and 1 not in shape:
        return t  # row-major with no size-1 dims: already in physical order
    if t.numel() == 0:
        return t  # no memory to misread, and its strides say nothing
    stride = t.stride()
    view, perm = t, list(range(t.dim()))
    if not _in_physical_order(shape, stride):
        perm = physical_order(shape, stride)
        view = t.permute(perm)
        contiguous = view.is_contiguous()
    if contiguous:
        return view
    problem = _padding_problem(view.shape, view.stride(), perm)
    if problem is not None:
        _reject(t, view, problem)
    return view


def _padding_problem(shape: Sequence[int], stride: Sequence[int], perm: Sequence[int]) -> str | None:
    """None when the physically ordered view is contiguous except for dim-0 padding.
    ``perm[i]`` is the caller's dim behind physical dim ``i`` (messages name those)."""
    if len(shape) < 2:
        return "ndim < 2 (a strided vector has no block rows to pad)"
    dims = [i for i, n in enumerate(shape) if n != 1]  # a size-1 dim's stride addresses nothing
    for i in dims:
        if stride[i] == 0:
            return f"dim {perm[i]} has stride 0 (a broadcast view: its {shape[i]} entries overlap)"
    tight = 1
    for i in reversed(dims[1:]):  # every dim inside the outermost one is tight
        if stride[i] != tight:
            if tight == 1:
                return f"innermost dim {perm[i]} has stride {stride[i]} != 1 (elements are not contiguous)"
            return f"dim {perm[i]} stride {stride[i]} != tight {tight} (interior padding is not supported)"
        tight *= shape[i]
    outer = dims[0]
    if outer != 0:
        d = perm[outer]
        return f"dim {d} carries padding inside a size-1 outer dim; only dim-0 block rows may be padded"
    if stride[0] < tight:
        return (
            f"dim {perm[0]} stride {stride[0]} < {tight}, the elements of one block row (overlapping blocks)"
        )
    return None


def _reject(t: torch.Tensor, view: torch.Tensor, problem: str) -> NoReturn:
    physical = "" if view is t else f" (in physical order: shape={tuple(view.shape)}, stride={view.stride()})"
    raise LocatedError(
        StridedViewError,
        f"tensor is non-contiguous and not a supported (dim-0 padding only) layout -- {problem}. "
        f"shape={tuple(t.shape)}, stride={t.stride()}{physical}, storage_offset={t.storage_offset()}, "
        f"dtype={t.dtype}. Transfer kernels address dim-0 block-row padding only; other strided "
        "views would be misread, and kvlayout never copies, so they are rejected.",
    )


def dim0_padding(t: Any) -> int:
    """Elements of padding after each dim-0 row (0 when dim 0 is tight or has one row)."""
    if t.dim() == 0 or t.shape[0] <= 1 or t.numel() == 0:
        return 0
    return max(int(t.stride(0)) - int(math.prod(t.shape[1:])), 0)
