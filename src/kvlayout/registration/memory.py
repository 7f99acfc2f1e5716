"""Which bytes a registration's tensors occupy, and whether any two share one.

A tensor is ``blocks`` blocks of ``block`` bytes, ``period`` bytes apart: one block when
it is contiguous, its dim-0 rows when they are padded (the padding between them belongs
to nobody and may hold another tensor: vLLM's blocks-first layers interleave in one
pool). Tensors of one shape and strides form a :class:`Run` that differs only in start
addresses, so the common registration (one tensor per layer, all alike) is checked by
sorting those addresses.

Two layers may share one KV cache (vLLM's cross-layer KV sharing registers the target's
tensor for the sharer too): such exact aliases are found by :func:`memory_keys` and left
out of the check by the caller; any other shared byte is an error that says how the two
views differ.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple, NoReturn

import numpy as np
import torch

from kvlayout.errors import KVLayoutError
from kvlayout.registration.contiguity import dim0_padding
from kvlayout.registration.nesting import Path, describe_path

__all__ = ["Run", "apart", "check_disjoint", "memory_keys", "run_of"]


class Run(NamedTuple):
    """Tensors of one shape and strides: ``blocks`` blocks of ``block`` bytes, ``period``
    bytes apart, from each of ``starts``; ``paths`` say where each sits (for messages)."""

    period: int
    block: int
    blocks: int
    starts: Sequence[int]
    paths: Sequence[Path]
    root: str
    sample: torch.Tensor | None = None  # one of the tensors, for messages (its shape, strides, dtype)

    @property
    def span(self) -> int:
        """Bytes from a tensor's first byte to past its last (padding between blocks included)."""
        return (self.blocks - 1) * self.period + self.block


class _Extent(NamedTuple):
    start: int
    period: int
    block: int
    blocks: int
    position: int  # into the flattened runs, for the message

    @property
    def end(self) -> int:
        return self.start + (self.blocks - 1) * self.period + self.block


def run_of(t: torch.Tensor, starts: Sequence[int], paths: Sequence[Path], root: str) -> Run | None:
    """The run of tensors shaped and strided like ``t`` at ``starts``, or None when they
    occupy no memory (empty, or on the meta device). Tensors are in physical order,
    contiguous but for dim-0 padding."""
    if t.device.type == "meta" or t.numel() == 0:
        return None
    es = t.element_size()
    size = t.numel() * es
    period, block, count = size, size, 1
    if t.dim() >= 2 and dim0_padding(t):
        period, block, count = t.stride(0) * es, size // t.shape[0], int(t.shape[0])
    return Run(period, block, count, starts, paths, root, t)


def memory_keys(leaves: Sequence[torch.Tensor], data_ptrs: Sequence[int]) -> list[Hashable] | None:
    """What each of a plane's tensors (one shape and strides) addresses, equal exactly for
    aliases; None when every tensor has its own. The address is the key; a tensor without
    memory has its own key (it aliases nothing), except on the meta device, where a view
    of the same base at the same storage offset is the same tensor."""
    if len(set(data_ptrs)) == len(data_ptrs):
        return None
    if not leaves or leaves[0].device.type != "meta":
        keys: list[Hashable] = [p if p else ("no memory", k) for k, p in enumerate(data_ptrs)]
    else:
        keys = [(id(b if (b := t._base) is not None else t), t.storage_offset()) for t in leaves]
    return keys if len(set(keys)) < len(keys) else None


def apart(runs: Sequence[Run]) -> bool:
    """Whether the runs plainly share no byte: one shape and strides, start addresses a
    span apart (the common registration: separate allocations, slices of one buffer)."""
    if not runs:
        return True
    shape = runs[0][:3]
    if not all(r[:3] == shape for r in runs):
        return False
    span = runs[0].span
    ordered = sorted(s for r in runs for s in r.starts)
    return all(b - a >= span for a, b in itertools.pairwise(ordered))


def check_disjoint(runs: Iterable[Run | None], error: type[KVLayoutError], why: str) -> None:
    """Raise ``error`` naming two tensors that share a byte."""
    present = [r for r in runs if r is not None]
    if apart(present):
        return
    shape = present[0][:3]
    if shape[2] > 1 and all(r[:3] == shape for r in present):
        _check_pool(present, error, why)
        return
    _check_pairs(present, error, why)


def _name(runs: Sequence[Run], k: int, j: int) -> str:
    return describe_path(runs[k].paths[j], runs[k].root)


def _check_pairs(runs: Sequence[Run], error: type[KVLayoutError], why: str) -> None:
    """A sweep over start addresses, testing every two tensors whose spans overlap."""
    index: list[tuple[int, int]] = []
    items: list[_Extent] = []
    for k, r in enumerate(runs):
        for j, start in enumerate(r.starts):
            items.append(_Extent(start, r.period, r.block, r.blocks, len(index)))
            index.append((k, j))
    items.sort(key=lambda e: e.start)
    active: list[_Extent] = []
    for item in items:
        active = [a for a in active if a.end > item.start]
        for a in active:
            if _meet(a, item):
                _overlap(runs, index[a.position], index[item.position], a, item, error, why)
        active.append(item)


def _meet(a: _Extent, b: _Extent) -> bool:
    """Do two extents whose spans overlap (``a`` starting first) share a byte?"""
    if a.blocks == 1 and b.blocks == 1:
        return True
    if a.period == b.period and a.block == b.block:
        # block k of a meets block j of b only for k = j + q or k = j + q + 1
        q, d = divmod(b.start - a.start, a.period)
        return (d < a.block and q < a.blocks) or (a.period - d < a.block and q + 1 < a.blocks)
    x, y = (a, b) if a.blocks <= b.blocks else (b, a)
    for k in range(x.blocks):
        lo = x.start + k * x.period
        hi = lo + x.block
        j_min = max(0, (lo - y.block - y.start) // y.period + 1)
        j_max = min(y.blocks - 1, -((y.start - hi) // y.period) - 1)
        if j_min <= j_max:
            return True
    return False


def _check_pool(runs: Sequence[Run], error: type[KVLayoutError], why: str) -> None:
    """Every pair of same-shaped padded tensors at once (``_meet``'s rule, vectorized)."""
    period, block, count = runs[0][:3]
    starts = sorted((s, k, j) for k, r in enumerate(runs) for j, s in enumerate(r.starts))
    addr = np.array([s for s, _, _ in starts], dtype=np.int64)
    diff = addr[None, :] - addr[:, None]
    q, d = np.divmod(diff, period)
    hit = (diff >= 0) & (((d < block) & (q < count)) | ((period - d < block) & (q + 1 < count)))
    np.fill_diagonal(hit, False)
    if hit.any():
        i, j = (int(x) for x in np.argwhere(hit)[0])
        a = _Extent(starts[i][0], period, block, count, i)
        b = _Extent(starts[j][0], period, block, count, j)
        _overlap(runs, starts[i][1:], starts[j][1:], a, b, error, why)


def _overlap(
    runs: Sequence[Run],
    first: tuple[int, int],
    second: tuple[int, int],
    a: _Extent,
    b: _Extent,
    error: type[KVLayoutError],
    why: str,
) -> NoReturn:
    later, earlier = _name(runs, *second), _name(runs, *first)
    views = _how_views_differ(runs[second[0]], runs[first[0]], b.start - a.start, later, earlier)
    raise error(
        f"{later} and {earlier} overlap in memory (bytes {b.start:#x}-{b.end:#x} and "
        f"{a.start:#x}-{a.end:#x}): {views}; {why}"
    )


def _how_views_differ(x: Run, y: Run, offset: int, x_name: str, y_name: str) -> str:
    """Why two tensors sharing bytes are not one KV cache shared by two layers."""
    if x.sample is None or y.sample is None:
        return "they share bytes"

    def view(t: torch.Tensor) -> str:
        return f"shape {list(t.shape)}, strides {list(t.stride())}, {t.dtype}"

    a, b = view(x.sample), view(y.sample)
    if offset == 0 and a == b:
        return (
            "they are the same memory and view, but are read apart (another kernel group, or another "
            "part of one layer); layers that share a KV cache are registered alike, a layer's own "
            "tensors are disjoint"
        )
    where = f"{x_name} starts {offset} bytes after {y_name}" if offset else "they start at the same byte"
    return (
        f"they share bytes but their views differ ({where}; {x_name}: {a}; {y_name}: {b}): layers may share "
        "a KV cache only as exact aliases (the same storage offset, shape, strides and dtype)"
    )
