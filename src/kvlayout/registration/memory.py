"""Which bytes a registration's tensors occupy, whether each has them, and whether any
two share one.

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
A tensor with elements must have memory behind its view: not a fake tensor
(``torch._subclasses.fake_tensor``, as torch.compile traces with), a data pointer other
than 0 and a storage that holds every byte the view reaches (a storage resized after the
view was made does not). Meta tensors have no memory by design: detection and the facade
read them (``kvlayout detect`` builds them), transfers refuse them.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import numpy as np
import torch

from kvlayout.errors import KVLayoutError
from kvlayout.registration.backing import (
    _DATA_PTR,
    _STORAGE,
    _STORAGE_BYTES,
    _STORAGE_PTR,
    first_without_memory,
    is_fake,
    memory_problem,
    no_memory,
    view_bytes,
)
from kvlayout.registration.contiguity import dim0_padding
from kvlayout.registration.nesting import Path, describe_path

if TYPE_CHECKING:
    from kvlayout.registration.registration import KernelGroup

__all__ = [
    "Placement",
    "Run",
    "apart",
    "backed_pointers",
    "check_disjoint",
    "first_without_memory",
    "group_placement",
    "is_fake",
    "memory_keys",
    "memory_problem",
    "no_memory",
    "run_of",
    "view_bytes",
]


def backed_pointers(
    leaves: Sequence[torch.Tensor], paths: Sequence[Any], root: str, error: type[KVLayoutError]
) -> tuple[int, ...]:
    """The data pointers of tensors alike (one plane: one shape, the same strides on every
    dim longer than 1), each checked to have memory behind its view; ``error`` names the
    first that has none. Meta tensors pass: they have no memory by design."""
    if set(map(type, leaves)) != {torch.Tensor}:  # subclasses (fake tensors), one by one
        for t, path in zip(leaves, paths, strict=False):
            problem = no_memory(t)  # before any data pointer: reading a fake tensor's warns
            if problem is not None:
                raise error(f"{describe_path(path, root)} {problem}; a KV cache tensor needs its memory")
        return tuple(map(_DATA_PTR, leaves))
    pointers = tuple(map(_DATA_PTR, leaves))
    first = leaves[0]
    if first.device.type == "meta" or first.numel() == 0:
        return pointers
    span = view_bytes(first)
    if 0 not in pointers:  # the common case, in C loops: every view inside its storage
        storages = list(map(_STORAGE, leaves))
        starts = list(map(_STORAGE_PTR, storages))
        ends = map(operator.add, starts, map(_STORAGE_BYTES, storages))
        if min(map(operator.sub, pointers, starts)) >= 0 and min(map(operator.sub, ends, pointers)) >= span:
            return pointers
    for k, (t, pointer) in enumerate(zip(leaves, pointers, strict=True)):
        problem = memory_problem(t, pointer, span)
        if problem is not None:
            raise error(f"{describe_path(paths[k], root)} {problem}; a KV cache tensor needs its memory")
    return pointers


class Placement:
    """Where some tensors' bytes are, to be checked again and again: each tensor's data
    pointer, and the address and size of each of their storages.

    An engine may re-allocate a tensor in place (``t.untyped_storage().resize_(0)``,
    ``t.data = new``, ``t.set_()``, ``t.resize_()``): its data pointer moves, or its
    storage is freed or re-made, possibly at the same address with another size. The
    check reads four values per tensor through torch (a tensor sharing a storage with an
    earlier one reads one), in C loops: torch's accessors are the whole cost (a C++ loop
    calling them measured no faster), 20-30 us for 100 tensors on a busy 2-core
    machine. Holding the storages would save one read, but would keep an old cache's
    memory allocated after ``t.data = new``.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> None:
        self._tensors = tuple(tensors)
        self._names = tuple(names)
        self._ptrs = list(map(_DATA_PTR, self._tensors))
        first: dict[int, int] = {}  # a storage (its StorageImpl's address) -> its first tensor
        for i, t in enumerate(self._tensors):
            first.setdefault(_STORAGE(t)._cdata, i)
        self._owners = tuple(first.values())
        self._owner_tensors = tuple(self._tensors[i] for i in self._owners)
        self._starts, self._sizes = self._storages()

    def _storages(self) -> tuple[list[int], list[int]]:
        storages = list(map(_STORAGE, self._owner_tensors))
        return list(map(_STORAGE_PTR, storages)), list(map(_STORAGE_BYTES, storages))

    def moved(self) -> str | None:
        """None while every tensor and storage is where it was; else what moved."""
        if list(map(_DATA_PTR, self._tensors)) == self._ptrs and self._storages() == (
            self._starts,
            self._sizes,
        ):
            return None
        for name, t, ptr in zip(self._names, self._tensors, self._ptrs, strict=True):
            if t.data_ptr() != ptr:
                return f"{name} was re-allocated (data pointer {t.data_ptr():#x}, was {ptr:#x})"
        starts, sizes = self._storages()
        for k, i in enumerate(self._owners):
            if (starts[k], sizes[k]) != (self._starts[k], self._sizes[k]):
                return (
                    f"the storage of {self._names[i]} was re-allocated or resized ({sizes[k]} bytes at "
                    f"{starts[k]:#x}, was {self._sizes[k]} bytes at {self._starts[k]:#x})"
                )
        return "the tensors' memory changed"  # and changed back while this looked


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


def group_placement(group: KernelGroup, error: type[KVLayoutError], where: str = "") -> Placement | None:
    """A kernel group's tensors (each once, where several layers share one) as a
    :class:`Placement` that every later copy checks again; None for a meta group (no
    memory by design). Where a tensor is no longer where detection read it, or has lost
    its memory, ``error`` says so (``{where}kv_caches[3] was re-allocated after detection
    ...; detect the registration again``). What uses the group's detected addresses (a
    transfer plan, a block map's side, a description, a NIXL registration) asks here."""
    if group.device.type == "meta":
        return None
    tensors: dict[int, torch.Tensor] = {}
    names: list[str] = []
    for plane in group.planes:
        span = view_bytes(plane.leaves[0])
        sources = plane.sources or (None,) * len(plane.leaves)
        for t, source, ptr, path in zip(plane.leaves, sources, plane.data_ptrs, plane.paths, strict=True):
            # the caller's tensor where detection re-viewed it: an engine re-allocates that
            # one (``t.data = new``), and the view would keep the old memory
            watched = t if source is None else source
            if id(watched) in tensors:
                continue  # one tensor registered for several layers
            name = describe_path(path, "kv_caches")
            now = watched.data_ptr()
            problem = (
                f"was re-allocated after detection (data pointer {now:#x}, was {ptr:#x})"
                if now != ptr
                else memory_problem(t, ptr, span)
            )
            if problem is not None:
                raise error(f"{where}{name} {problem}; detect the registration again")
            tensors[id(watched)] = watched
            names.append(name)
    return Placement(list(tensors.values()), names)
