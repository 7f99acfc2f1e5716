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

import bisect
import heapq
import itertools
import operator
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, cast

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
from kvlayout.registration.opaque import viewed_over

if TYPE_CHECKING:
    from kvlayout.registration.kernel_groups import KernelGroup

__all__ = [
    "HoldsAddresses",
    "Placement",
    "Run",
    "apart",
    "backed_pointers",
    "check_disjoint",
    "check_in_place",
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


SHARE_WHOLE = (
    "layers may share a KV cache only whole, each tensor the target layer's tensor in the same place"
)


def alias_refusal(
    here: Sequence[int],
    there: Sequence[int],
    level: int | None,
    target: dict[int, int],
    names: tuple[str, str],
    layer_name: Callable[[int], object] = lambda layer: layer,
) -> str | None:
    """Why the tensor at pointer path ``here`` may not be the memory of the one at
    ``there`` (earlier in the table), naming them ``names``, or None: layers may share a KV
    cache only whole, each tensor the target layer's tensor in the same place, one target
    per sharer (``target`` collects sharer -> target layer; ``layer_name`` says a layer
    level's index as the caller's user knows it). Detection and peer descriptions hold
    registrations to this one rule."""
    x, y = names
    if level is None or here[level] == there[level]:
        return (
            f"{x} and {y} overlap in memory: they are one tensor twice within one layer; a layer's own "
            "tensors must be disjoint"
        )
    if tuple(here[:level]) + tuple(here[level + 1 :]) != tuple(there[:level]) + tuple(there[level + 1 :]):
        return f"{x} is the memory of {y}, which holds another part of its layer: {SHARE_WHOLE}"
    sharer = here[level]
    first = target.setdefault(sharer, there[level])
    if first == there[level]:
        return None
    return (
        f"{x} is the memory of {y}, but layer {layer_name(sharer)} shares other tensors with layer "
        f"{layer_name(first)}: a layer shares its KV cache with one layer, whole"
    )


def partly_shared(counts: dict[int, int], tensors: int, layers: int) -> int | None:
    """The first sharer (layer -> how many of its tensors are its target's, in ``counts``)
    that shares only part of its KV cache, of ``tensors`` over ``layers`` layers; None when
    each shares whole (:func:`alias_refusal`'s rule, counted)."""
    per_layer = tensors // layers
    return next((layer for layer, count in counts.items() if count != per_layer), None)


class HoldsAddresses:
    """What holds this process's tensor addresses (a registration, a kernel group, a plan,
    a map): a pickled or deep-copied one would carry addresses that mean nothing in
    another process and watch tensors it does not hold, so both are refused with what to
    send instead; a shallow copy is the object itself (nothing in it changes)."""

    __slots__ = ()

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError(_not_copied(self))

    def __copy__(self) -> Any:
        return self

    def __deepcopy__(self, memo: Any) -> NoReturn:
        raise TypeError(_not_copied(self))


def _not_copied(obj: object) -> str:
    return (
        f"a {type(obj).__name__} holds this process's tensor addresses and cannot be pickled or deep-copied; "
        "another process reads registration.describe().to_json() (RegistrationDescription.from_json) "
        "and detects its own tensors"
    )


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

    def readings(self) -> tuple[list[tuple[torch.Tensor, int]], list[tuple[torch.Tensor, int, int]]]:
        """What this placement read, for a watch that compares it again: each tensor with
        its data pointer, and each storage's first tensor with the storage's address and
        size."""
        tensors = list(zip(self._tensors, self._ptrs, strict=True))
        return tensors, list(zip(self._owner_tensors, self._starts, self._sizes, strict=True))

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


def check_disjoint(
    runs: Iterable[Run | None], error: type[KVLayoutError], why: str, budget: int | None = None
) -> None:
    """Raise ``error`` naming two tensors that share a byte.

    Tensors of one geometry (period, block, blocks) are checked at once, in O(n log n)
    (:func:`_check_pool`); tensors of different geometries pairwise where their spans
    overlap (:func:`_check_pairs`), each pair in O(log) (:func:`_meet`). ``budget`` bounds
    those pairs (an untrusted description could interleave millions): past it, ``error``
    says so. A registration's own memory passes none."""
    present = [r for r in runs if r is not None]
    if apart(present):
        return
    geometries: dict[tuple[int, int, int], list[int]] = {}
    for k, r in enumerate(present):
        geometries.setdefault((r.period, r.block, r.blocks), []).append(k)
    for members in geometries.values():
        _check_pool(present, members, error, why)
    if len(geometries) > 1:
        _check_pairs(present, error, why, budget)


def _name(runs: Sequence[Run], k: int, j: int) -> str:
    return describe_path(runs[k].paths[j], runs[k].root)


def _check_pairs(runs: Sequence[Run], error: type[KVLayoutError], why: str, budget: int | None) -> None:
    """A sweep over start addresses, testing every two tensors of different geometries
    whose spans overlap (those of one geometry are :func:`_check_pool`'s); where a tensor
    meets several, the one starting first is named."""
    index: list[tuple[int, int]] = []
    items: list[_Extent] = []
    for k, r in enumerate(runs):
        for j, start in enumerate(r.starts):
            items.append(_Extent(start, r.period, r.block, r.blocks, len(index)))
            index.append((k, j))
    items_at = [(e.period, e.block, e.blocks) for e in items]  # by position
    items.sort(key=lambda e: e.start)
    active: dict[tuple[int, int, int], dict[int, tuple[int, _Extent]]] = {}  # geometry -> position -> rank
    ends: list[tuple[int, int]] = []  # a heap of (end, position) of the active extents
    checks = 0
    for rank, item in enumerate(items):
        while ends and ends[0][0] <= item.start:
            position = heapq.heappop(ends)[1]
            done = items_at[position]
            members = active[done]
            del members[position]
            if not members:
                del active[done]
        geometry = (item.period, item.block, item.blocks)
        met: tuple[int, _Extent] | None = None
        for other, members in active.items():
            if other == geometry:
                continue
            for entry in members.values():
                checks += 1
                if budget is not None and checks > budget:
                    raise error(
                        f"more than {budget} pairs of tensors of different shapes lie within each other's "
                        f"spans, too many to check that they share no byte; {why}"
                    )
                if _meet(entry[1], item) and (met is None or entry[0] < met[0]):
                    met = entry
        if met is not None:
            _overlap(runs, index[met[1].position], index[item.position], met[1], item, error, why)
        active.setdefault(geometry, {})[item.position] = (rank, item)
        heapq.heappush(ends, (item.end, item.position))


def _meet(a: _Extent, b: _Extent) -> bool:
    """Do two extents whose spans overlap (``a`` starting first) share a byte? In
    O(log) steps, however many blocks they have."""
    if a.blocks == 1 and b.blocks == 1:
        return True
    if a.period == b.period and a.block == b.block:
        # block k of a meets block j of b only for k = j + q or k = j + q + 1
        q, d = divmod(b.start - a.start, a.period)
        return (d < a.block and q < a.blocks) or (a.period - d < a.block and q + 1 < a.blocks)
    # a's blocks k_lo..k_hi reach into b's span; a block (no longer than a's period) of
    # those but the first and last lies inside it, where it meets b's blocks exactly
    # where it meets them repeated without end
    k_lo = max(0, (b.start - a.block - a.start) // a.period + 1)
    k_hi = min(a.blocks - 1, -((a.start - b.end) // a.period) - 1)
    if k_lo > k_hi:
        return False
    if _block_meets(a, k_lo, b) or _block_meets(a, k_hi, b):
        return True
    n = k_hi - k_lo - 1  # blocks inside b's span
    if n <= 0:
        return False
    if a.block + b.block > b.period:  # a block anywhere in b's span meets one of b's
        return True
    # block k starts t = (its start - b.start) mod b.period into a period of b: it meets a
    # block of b for t < b.block or t > b.period - a.block, that is for
    # u = (t + a.block - 1) mod b.period <= a.block + b.block - 2 (a linear congruence in k)
    last = a.block + b.block - 2
    first = (a.start + (k_lo + 1) * a.period - b.start + a.block - 1) % b.period
    step = a.period % b.period
    above = _floor_sum(n, b.period, step, first + b.period - 1 - last) - _floor_sum(n, b.period, step, first)
    return above < n  # the blocks with u > last are ``above``


def _block_meets(x: _Extent, k: int, y: _Extent) -> bool:
    """Does block ``k`` of ``x`` share a byte with a block of ``y``?"""
    lo = x.start + k * x.period
    hi = lo + x.block
    j_min = max(0, (lo - y.block - y.start) // y.period + 1)
    j_max = min(y.blocks - 1, -((y.start - hi) // y.period) - 1)
    return j_min <= j_max


def _floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``sum((a * i + b) // m for i in range(n))`` for ``n, m > 0`` and ``a, b >= 0``, in
    O(log m) steps (Euclid's recursion, as the AtCoder Library's ``floor_sum``)."""
    total = 0
    while True:
        if a >= m:
            total += n * (n - 1) // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        y_max = a * n + b
        if y_max < m:
            return total
        n, b = divmod(y_max, m)
        m, a = a, m


def _check_pool(runs: Sequence[Run], members: Sequence[int], error: type[KVLayoutError], why: str) -> None:
    """Every two tensors of one geometry (``runs[k]`` for ``k`` in ``members``) at once,
    in O(n log n) time and O(n) memory, addresses up to 2**64 exact; names the first
    tensor in address order that meets another, and the first it meets.

    By ``_meet``'s rule, tensors at ``s`` and ``s' >= s`` (``s' - s = q * period + d``)
    meet iff ``d < block and q < blocks`` or ``period - d < block and q + 1 < blocks``.
    Put each tensor at two points, ``(s % period, s // period + 1)`` and
    ``(s % period + period, s // period)``: two tensors meet iff a point of one and a
    point of the other are less than ``block`` apart in x and less than ``blocks`` in y.
    On a grid of ``block`` x ``blocks`` cells, two points in one cell always meet and two
    that meet are in neighbouring cells: where no two meet, each cell holds one point, and
    each point is tested against the one in each of the cells beside it.
    """
    period, block, count = runs[members[0]][:3]
    n = sum(len(runs[k].starts) for k in members)
    if n < 2:
        return
    addr = np.fromiter(itertools.chain.from_iterable(runs[k].starts for k in members), np.uint64, n)
    order = np.argsort(addr, kind="stable")  # by address, then run and position
    addr = addr[order]
    grid = _Grid(addr, period, block, count)
    if not grid.any_meet():
        return
    i = grid.first_meeting()
    # the first tensor after i that meets it, by _meet's rule
    diff = addr[i + 1 :] - addr[i]
    q, d = np.divmod(diff, np.uint64(period))
    p, b, c = np.uint64(period), np.uint64(block), np.uint64(count)
    hit = ((d < b) & (q < c)) | ((d > p - b) & (q + np.uint64(1) < c))
    j = i + 1 + int(np.flatnonzero(hit)[0])
    firsts = list(itertools.accumulate((len(runs[k].starts) for k in members), initial=0))

    def run_and_position(t: int) -> tuple[int, int]:
        flat = int(order[t])
        m = bisect.bisect_right(firsts, flat) - 1
        return members[m], flat - firsts[m]

    a = _Extent(int(addr[i]), period, block, count, i)
    later = _Extent(int(addr[j]), period, block, count, j)
    _overlap(runs, run_and_position(i), run_and_position(j), a, later, error, why)


class _Grid:
    """The points of :func:`_check_pool`'s tensors (point ``t`` is tensor ``t % n``) in
    their cells, the cells sorted."""

    def __init__(self, addr: np.ndarray, period: int, block: int, count: int) -> None:
        self.n = len(addr)
        p, one = np.uint64(period), np.uint64(1)
        q, r = np.divmod(addr, p)
        self.x, self.y = np.concatenate([r, r + p]), np.concatenate([q + one, q])
        self.block, self.count = np.uint64(block), np.uint64(count)
        self.cx, self.cy = self.x // self.block, self.y // self.count
        self.ux, self.uy = _unique(self.cx), _unique(self.cy)
        keys = self._key(self.cx, self.cy)
        self.order = np.argsort(keys, kind="stable")
        self.keys = keys[self.order]
        self.points = np.arange(2 * self.n)

    def _key(self, cx: np.ndarray, cy: np.ndarray) -> np.ndarray:
        """Each cell's rank in x and y as one int64, -1 for a cell no point has."""
        ix, iy = np.searchsorted(self.ux, cx), np.searchsorted(self.uy, cy)
        found = (ix < len(self.ux)) & (iy < len(self.uy))
        ix, iy = np.minimum(ix, len(self.ux) - 1), np.minimum(iy, len(self.uy) - 1)
        found &= (self.ux[ix] == cx) & (self.uy[iy] == cy)
        key: np.ndarray = np.where(found, ix.astype(np.int64) * len(self.uy) + iy, -1)
        return key

    def _beside(self, dx: int, dy: int) -> np.ndarray:
        """Each point's neighbouring cell's key (-1 where no point has it)."""
        one = np.uint64(1)
        cx = self.cx + one if dx > 0 else self.cx - one if dx < 0 else self.cx
        cy = self.cy + one if dy > 0 else self.cy - one if dy < 0 else self.cy  # 0 - 1 wraps: no cell
        return self._key(cx, cy)

    def _meets(self, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Whether points ``u`` and ``v`` (of different tensors) meet."""
        meet: np.ndarray = (
            (_apart(self.x[u], self.x[v]) < self.block)
            & (_apart(self.y[u], self.y[v]) < self.count)
            & (u % self.n != v % self.n)
        )
        return meet

    def any_meet(self) -> bool:
        if bool((self.keys[1:] == self.keys[:-1]).any()):  # two points in one cell
            return True
        for dx, dy in ((0, 1), (1, -1), (1, 0), (1, 1)):  # each two neighbouring cells once
            key = self._beside(dx, dy)
            at = np.minimum(np.searchsorted(self.keys, key), len(self.keys) - 1)
            found = (key >= 0) & (self.keys[at] == key)
            if self._meets(self.points[found], self.order[at[found]]).any():
                return True
        return False

    def first_meeting(self) -> int:
        """The first tensor that meets another: one with a point that shares its cell, or
        a lone point that meets a point of a cell beside it (each of them tested: a cell is
        beside eight, so at most 16n pairs are)."""
        lo = np.searchsorted(self.keys, self.keys, "left")
        hi = np.searchsorted(self.keys, self.keys, "right")
        crowded = np.zeros(2 * self.n, dtype=bool)
        crowded[self.order] = hi - lo > 1
        meeting = crowded.copy()
        alone = self.points[~crowded]
        for dx in (-1, 0, 1):
            for dy in (-1, 0, 1):
                if dx == dy == 0:
                    continue
                key = self._beside(dx, dy)[alone]
                first = np.searchsorted(self.keys, key, "left")
                sizes = np.where(key >= 0, np.searchsorted(self.keys, key, "right") - first, 0)
                total = int(sizes.sum())
                if not total:
                    continue
                point = np.repeat(alone, sizes)
                offsets = np.arange(total) - np.repeat(np.cumsum(sizes) - sizes, sizes)
                other = self.order[np.repeat(first, sizes) + offsets]
                meeting[point[self._meets(point, other)]] = True
        return int((np.flatnonzero(meeting) % self.n).min())


def _unique(a: np.ndarray) -> np.ndarray:
    """``a``'s values, sorted, each once (``np.unique`` hashes first: slower here)."""
    s = np.sort(a)
    keep = np.ones(len(s), dtype=bool)
    keep[1:] = s[1:] != s[:-1]
    out: np.ndarray = s[keep]
    return out


def _apart(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``|u - v|`` of two uint64 arrays, exactly."""
    out: np.ndarray = np.where(u >= v, u - v, v - u)
    return out


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
            # the caller's tensor too where detection re-viewed it: an engine re-allocates
            # that one (``t.data = new``), and the view alone would keep the old memory; the
            # view is watched as well (the LMCache-named functions hand it out)
            shown = (t,) if source is None else (t, source)
            # and what a view kvlayout's vLLM edits made was made over (vLLM's own tensor)
            under = viewed_over(source if source is not None else t)
            for watched, expected, before_edits in [
                *((x, ptr, False) for x in shown),
                *((x, p, True) for x, p in under),
            ]:
                if id(watched) in tensors:
                    continue  # one tensor registered for several layers
                name = describe_path(path, plane.root)
                if before_edits:
                    name += "'s tensor before the group edits"
                now = watched.data_ptr()
                problem = (
                    f"was re-allocated after detection (data pointer {now:#x}, was {expected:#x})"
                    if now != expected
                    else memory_problem(t, ptr, span)
                    if watched is t and span  # no elements, no memory viewed (as detection reads it)
                    else None
                )
                if problem is not None:
                    raise error(f"{where}{name} {problem}; detect the registration again")
                tensors[id(watched)] = watched
                names.append(name)
    return Placement(list(tensors.values()), names)


_PLACEMENT = object()  # a kernel group's memo key: the Placement check_in_place compares with


def check_in_place(group: KernelGroup, error: type[KVLayoutError], use: str) -> None:
    """Raise ``error`` where a kernel group's tensors are no longer where detection read
    them (or have lost their memory): what hands out the group's detected addresses (a
    pointer table) asks first, so a caller never gets addresses that were freed or that
    another tensor now holds. The first call checks in full (:func:`group_placement`) and
    keeps the placement in the group's memo; each later one compares with it (C loops,
    microseconds). ``use`` says what was asked (``data_ptrs()``)."""
    placement = group.memo.get(_PLACEMENT)
    if placement is None:
        made = group_placement(group, error, f"{use}: ")
        group.memo[_PLACEMENT] = made if made is not None else False  # False: a meta group
        return
    if placement is not False:
        moved = cast(Placement, placement).moved()
        if moved is not None:
            raise error(
                f"{use}: {moved} after detection; its addresses would name the old memory: detect the "
                "registration again"
            )
