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

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

import torch

from kvlayout.errors import KVLayoutError
from kvlayout.registration.backing import no_memory
from kvlayout.registration.nesting import LocatedError, Path, map_leaves, not_strided
from kvlayout.types import DiscoverableKVCache

__all__ = [
    "StridedViewError",
    "align_unit_dims",
    "attempt_permute_to_contiguous_view",
    "dim0_padding",
    "physical_entries",
    "physical_order",
    "stride_order",
]


class StridedViewError(KVLayoutError):
    """A tensor whose strides no permutation and no dim-0 padding can explain."""


def attempt_permute_to_contiguous_view(
    kv: DiscoverableKVCache, *, by_stride: bool = False
) -> DiscoverableKVCache:
    """Each tensor of ``kv`` as a view with its dims in physical (memory) order.

    Metadata only, never a copy: results share storage with the input, and a write
    through them reaches the original. Lists and tuples become new lists (the structure
    is rebuilt, the tensors are not). A tensor already in physical order is returned as
    the same object (LMCache 0.5.6 always makes a new view). Physical order sorts dims by
    stride, outermost first; a size-1 dim goes inside a dim of equal stride, because its
    stride is arbitrary (vLLM's HND cache with one head, exposed as NHD, recovers HND),
    and otherwise stays where the caller put it (see :func:`physical_order`). Tensors with
    no elements are never moved.

    ``by_stride`` places every size-1 dim whose stride says where it belongs there instead
    (:func:`stride_order`): detection tries it when the caller's placement fits no format.

    Raises :class:`StridedViewError` (a ``KVLayoutError``) for views that are neither
    contiguous nor dim-0 padded, naming the tensor, the reason, its shape and strides;
    ``TypeError`` for anything that is not a tensor, list or tuple (dicts, strings,
    ``None``), never ``RecursionError``.
    """
    views: DiscoverableKVCache = map_leaves(kv, _stride_view if by_stride else _physical_view)
    return views


def align_unit_dims(entries: Sequence[Any]) -> list[Any]:
    """A list's entries, physically ordered, each tensor re-viewed with the shape of the
    first tensor in the same place of an earlier entry that has the same rank and memory
    layout (dtype, and size and stride of every dim longer than 1): its size-1 dims then sit
    where that one's do, so layers laid out alike read alike, as the first reads. A
    size-1 dim addresses nothing, so the view addresses exactly the same elements."""
    seen: dict[Path, list[torch.Tensor]] = {}

    def align(path: Path, t: torch.Tensor) -> torch.Tensor:
        earlier = seen.setdefault(path[1:], [])
        shape = t.shape
        for ref in earlier:
            if ref.shape == shape:
                return t  # the common case: laid out and shaped alike
        if t.numel() != 0:
            layout = _long_dims(t)
            for ref in earlier:  # of the same rank: another rank is another format (MHA, MLA)
                if ref.dtype == t.dtype and ref.dim() == t.dim() and _long_dims(ref) == layout:
                    return t.as_strided(ref.shape, ref.stride(), t.storage_offset())
        earlier.append(t)
        return t

    aligned: list[Any] = map_leaves(list(entries), lambda t: t, at_path=align)
    return aligned


def _long_dims(t: torch.Tensor) -> tuple[tuple[int, int], ...]:
    return tuple((n, s) for n, s in zip(t.shape, t.stride(), strict=True) if n != 1)


def physical_entries(entries: Sequence[object], indices: Iterable[int]) -> dict[int, DiscoverableKVCache]:
    """:func:`attempt_permute_to_contiguous_view` of some entries of a list (errors name
    ``kv_caches[i]``); the other entries are not looked at."""
    return {i: map_leaves(entries[i], _physical_view, start=(i,)) for i in indices}


def physical_order(shape: Sequence[int], stride: Sequence[int]) -> list[int]:
    """The caller's dims in memory order, outermost first.

    Dims longer than 1 sort by stride (ties keep their order). A size-1 dim addresses
    nothing, so its stride only hints where it belongs (torch calls any stride on it
    contiguous, and DLPack producers emit 0): it goes right inside a longer dim whose
    stride it equals, or between two longer dims where its stride is the tight one, or
    beside a size-1 dim before it of the same stride (vLLM's one-head HND cache, exposed
    as NHD, recovers HND), or right outside the outermost longer dim when its stride is
    that dim's extent and a size-1 dim is already in front; never outermost by its
    stride, never last unless the caller has it last; otherwise it stays after the dim
    the caller put it after. One the caller put in front of padded block rows goes
    inside them if its stride says so, since only dim 0 may be padded.
    """
    n = len(shape)
    big = sorted((i for i in range(n) if shape[i] != 1), key=lambda i: stride[i], reverse=True)
    order = list(big)
    padded = bool(big) and stride[big[0]] > math.prod(shape[d] for d in big[1:])
    ones = [i for i in range(n) if shape[i] == 1]
    for j in ones:
        # inside the innermost dim only where the caller has another size-1 dim behind it
        behind = big and any(k > big[-1] and k != j for k in ones)
        twins = [d for d in big if d != big[-1] or behind]
        pin = next((d for d in twins if stride[d] == stride[j]), None)
        if pin is None:  # between two longer dims, where its stride is the tight one
            pin = next((d for d, e in itertools.pairwise(big) if stride[e] * shape[e] == stride[j]), None)
        if pin is None:
            pin = next((d for d in ones if d < j and stride[d] == stride[j]), None)
        if pin is None and all(shape[k] == 1 for k in range(j + 1, n)):
            order.append(j)  # the caller put it among the last dims: it stays last
            continue
        if pin is None and big and stride[j] == stride[big[0]] * shape[big[0]] and order.index(big[0]) > 0:
            # right outside the outermost longer dim, behind a size-1 dim the caller put
            # first (a one-block, one-head HND layer of a blocks-first pool)
            order.insert(order.index(big[0]), j)
            continue
        if pin is None:
            pin = next((d for d in range(j - 1, -1, -1) if shape[d] != 1), None)
        if pin is None and padded and stride[j] < stride[big[0]]:
            pin = big[0]  # not in front of padded rows its stride puts it inside
        pos = 0 if pin is None else order.index(pin) + 1
        while pos < len(order) and shape[order[pos]] == 1:
            pos += 1  # after the size-1 dims already placed there: they keep the caller's order
        order.insert(pos, j)
    return order


def stride_order(shape: Sequence[int], stride: Sequence[int]) -> list[int]:
    """The caller's dims in memory order with each size-1 dim placed by its stride: right
    outside the outermost longer dim whose extent (stride times size) its stride is,
    innermost for stride 1, as :func:`physical_order` places it when its stride says
    nothing (0, or a stride no longer dim spans)."""
    caller = physical_order(shape, stride)
    big = [d for d in caller if shape[d] != 1]
    placed: dict[int, int] = {}  # size-1 dim -> the position in `big` it goes before
    for j in (d for d in caller if shape[d] == 1):
        extents = [stride[d] * shape[d] for d in big]
        if stride[j] in extents:
            placed[j] = extents.index(stride[j])
        elif stride[j] == 1 and big and stride[big[-1]] == 1:
            placed[j] = len(big)
    if not placed:
        return caller
    order: list[int] = []
    for d in caller:
        if d in placed:
            continue
        if shape[d] != 1:
            order.extend(j for j in caller if placed.get(j) == big.index(d))
        order.append(d)
    order.extend(j for j in caller if placed.get(j) == len(big))
    return order


def _stride_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` in physical order with its size-1 dims placed by stride (:func:`stride_order`)."""
    if t.numel() == 0 or 1 not in t.shape or not_strided(t) is not None:
        return _physical_view(t)
    return _view_in(t, stride_order(t.shape, t.stride()))


def _physical_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` in physical order (the same object when it already is)."""
    problem = not_strided(t)
    if problem is not None:
        raise LocatedError(TypeError, problem)
    shape = t.shape
    contiguous = t.is_contiguous()
    if contiguous and 1 not in shape:
        return t  # row-major with no size-1 dims: already in physical order
    if t.numel() == 0:
        return t  # no memory to misread, and its strides say nothing
    return _view_in(t, physical_order(shape, t.stride()), contiguous)


def _view_in(t: torch.Tensor, perm: list[int], contiguous: bool | None = None) -> torch.Tensor:
    """``t`` permuted to ``perm``; contiguous or dim-0 padded, else rejected."""
    view = t
    if perm != list(range(t.dim())):
        try:
            view = t.permute(perm)
        except RuntimeError:  # a view checks its storage: a tensor without memory fails here
            problem = no_memory(t)
            if problem is None:
                raise
            raise LocatedError(KVLayoutError, f"{problem}; a KV cache tensor needs its memory") from None
        contiguous = None
    if contiguous or (contiguous is None and view.is_contiguous()):
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
