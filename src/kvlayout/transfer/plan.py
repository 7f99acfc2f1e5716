"""Block transfer between a paged KV cache and token-major chunk buffers, for every format.

A chunk is a tensor ``[kv_size, NL, T, row]`` (``row = num_heads * head_size``, the
packed width for fused and MLA formats; a plane tuple's row is its planes' bytes back to
back), byte-compatible with LMCache's CUDA path. Layers that share one KV cache keep their
own chunk slots: a store fills each, a load writes the shared memory once, from the first
layer's slot. ``block_ids`` is a flat list of engine
blocks: chunk ``c`` holds blocks ``[c*bpc, (c+1)*bpc)`` with ``bpc = T / BS`` of the
first chunk; the last chunk may be shorter (a trailing partial chunk); the first
``skip_prefix_n_blocks`` blocks are left alone in both directions.

Everything is validated before a byte moves; then the native engine (``kvlayout._native``,
GIL released) walks the algebra's copy plan with the generated indexers. Nothing here
knows a format by name: jobs, pieces and strides all come from the layout.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvlayout import _native
from kvlayout._generated.formats import SIZE_SYMBOLS, EngineKVFormat
from kvlayout.catalog.registry import FormatLike
from kvlayout.errors import SizeError, TransferError
from kvlayout.layout import algebra
from kvlayout.layout.ast import Layout
from kvlayout.layout.formats import as_format
from kvlayout.layout.vocabulary import Role
from kvlayout.registration.kernel_groups import KernelGroup, Plane
from kvlayout.registration.memory import (
    HoldsAddresses,
    Placement,
    group_placement,
    memory_problem,
    no_memory,
    run_of,
)
from kvlayout.registration.nesting import not_strided
from kvlayout.registration.registration import Registration, RegistrationError, bound
from kvlayout.transfer.arguments import (
    block_ids_arg,
    check_ids_in_range,
    check_written_once,
    int_arg,
    lmcache_object_hint,
    threads_arg,
)

__all__ = ["TransferError", "TransferPlan", "chunk_shape", "load_blocks", "prepare", "store_blocks"]

_MAX_LOOPS = 4
_PIECE_FIELDS = 5 + 3 * _MAX_LOOPS
_STORE, _LOAD = 0, 1


@dataclass(frozen=True)
class _Job:
    """Pointers that share one geometry: the whole kernel group, or one plane of it."""

    plane: Plane
    sizes: dict[str, int]  # the block count and block size resolved (a page axis split)
    block_stride: int  # elements, 0 = tight
    row_offset: int  # bytes from the start of a chunk row

    @property
    def element_size(self) -> int:
        return self.plane.element_size


# -- preparing ------------------------------------------------------------------------


def prepare(kv: Any, fmt: FormatLike | None = None, *, block_size: int | None = None) -> TransferPlan:
    """The transfer plan of a registration in ``fmt``: checked, split into jobs and
    handed to the native engine once, so each call checks only its block ids and chunks.

    ``kv`` is what detection returned (its bound registration is reused, and so is the
    plan: preparing twice is free), a :class:`~kvlayout.registration.registration.Registration` or
    :class:`~kvlayout.registration.kernel_groups.KernelGroup` (whose format ``fmt`` may leave
    out), or any registration in ``fmt`` (checked now). ``block_size`` is needed only for
    formats that fold NB and BS into one axis. A registration whose layers differ (a
    hybrid) has one plan per kernel group.
    """
    if isinstance(kv, KernelGroup):
        if fmt is not None and as_format(fmt) != kv.format:
            raise TransferError(
                f"prepare(group, {as_format(fmt).name}): the kernel group is {kv.format.name} "
                "(pass group.format, or the registration)"
            )
        return _plan_of(kv, block_size)
    if isinstance(kv, Registration) and fmt is not None and as_format(fmt) not in kv.formats:
        raise TransferError(
            f"prepare(registration, {as_format(fmt).name}): the registration is "
            f"{' + '.join(sorted({f.name for f in kv.formats if f is not None}))} (pass no format, or its "
            "own; to read its tensors in another, prepare(registration.kv, fmt))"
        )
    if fmt is None and not isinstance(kv, Registration):
        raise TypeError(
            f"prepare({type(kv).__name__}) needs its format: prepare(kv, fmt), as detection returned "
            "them (a Registration or a KernelGroup knows its own)"
        )
    try:
        group = (kv if fmt is None else bound(kv, fmt)).only_group()
    except RegistrationError as exc:
        raise TransferError(str(exc)) from None
    return _plan_of(group, block_size)


def _plan_of(group: KernelGroup, block_size: int | None) -> TransferPlan:
    key = ("transfer plan", block_size)
    plan = group.memo.get(key)
    if plan is None:
        plan = TransferPlan(group, block_size)
        group.memo[key] = plan
    assert isinstance(plan, TransferPlan)
    return plan


def _engine(plan: TransferPlan) -> Any:
    """What runs a plan's copies: the native engine for a CPU cache, the CUDA kernels for
    a GPU one (``kvlayout.transfer.cuda`` is handed the plan and never imports this module)."""
    try:
        if plan.device.type == "cpu":
            return _native.TransferPlan([plan._native_job(job) for job in plan.jobs], plan.num_blocks)
        from kvlayout.transfer.cuda import CudaPlan

        return CudaPlan(plan)
    except TransferError:  # a copy plan's own refusal, which names the layout already
        raise
    except ValueError as exc:  # the native plan builder's refusal (a copy no engine can walk)
        raise TransferError(f"{plan.format.name}: {exc}") from None


class TransferPlan(HoldsAddresses):
    """One kernel group's block copies, prepared: geometry, copy plans, pointer tables
    (on the device, for CUDA caches) and the cache's memory extents, all made once.

    ``store_blocks`` and ``load_blocks`` check only what changes per call: the block ids
    (a 1-D int sequence or tensor, each in range) and the chunks (shape
    ``chunk_shape(T)``, the cache's dtype and device, contiguous, disjoint from each other
    and from the cache). The plan holds the cache's tensors (they stay alive while it
    lives) and copies through the addresses they had when it was made: every call first
    checks that each tensor still has its data pointer and each storage its address and
    size, and raises a :class:`TransferError` saying to detect again when the engine has
    re-allocated its cache in place. A plan is read-only after it is made, so one plan
    serves calls from many threads at once.
    """

    def __init__(self, group: KernelGroup, block_size: int | None) -> None:
        self.format: EngineKVFormat = group.format
        self.layout: Layout = group.layout
        if group.layout.is_cross_layer and len(group.layers) != group.registration_layers:
            raise TransferError(
                f"{self.format.name} holds every layer in one tensor, so its plan moves all "
                f"{group.registration_layers} layers; this kernel group has {len(group.layers)}"
            )
        self.jobs = _jobs(group, block_size)
        first = self.jobs[0].sizes
        self.kv_size = group.geometry.kv_size
        self.num_layers = self.layout.size_of(first, Role.LAYER) or 1
        self.num_blocks = _required(self.layout, first, Role.BLOCK)
        self.block_size = _required(self.layout, first, Role.TOKEN)
        self.row_bytes = sum(_row_bytes(self.layout, job) for job in self.jobs)
        self.dtype = group.dtype
        self.device = group.device
        if self.device.type == "meta":
            raise TransferError(
                "the cache is meta tensors, which have no memory by design: detection and the facade "
                "read them, a transfer needs the cache's bytes"
            )
        itemsize = self.dtype.itemsize
        if self.row_bytes % itemsize:
            raise TransferError(
                f"{self.layout}: a token row of {self.row_bytes} bytes is not a whole number of "
                f"{self.dtype} elements (the first plane's type, which chunks use)"
            )
        self.row = self.row_bytes // itemsize
        empty = [
            f"{self.layout.symbol_of(role)}={n}"
            for role, n in ((Role.BLOCK, self.num_blocks), (Role.TOKEN, self.block_size))
            if n == 0
        ]
        if empty or self.row == 0:
            what = ", ".join(empty) if empty else "a token row of 0 elements"
            raise TransferError(f"{self.format.name}: the cache holds no blocks to move ({what})")
        self._placement = _placement(group)
        self._extents = _cache_extents(group)
        self._engine: Any = _engine(self)

    def __repr__(self) -> str:
        return (
            f"TransferPlan({self.format.name}, layers {self.num_layers}, {self.num_blocks} blocks of "
            f"{self.block_size}, chunk rows of {self.row} {self.dtype}, {self.device})"
        )

    def _native_job(self, job: _Job) -> tuple[Any, ...]:
        pieces = _pieces(
            self.layout, tuple(sorted(job.sizes.items())), job.element_size, self.row_bytes
        ).copy()
        pieces[:, 2] += job.row_offset
        return (
            int(self.format), native_sizes(self.layout, job.sizes), job.block_stride, job.element_size,
            np.array(job.plane.data_ptrs, dtype=np.uint64), pieces,
            self.kv_size, self.num_layers, self.block_size, self.row_bytes, list(job.plane.repeats),
        )  # fmt: skip

    # -- what a call needs -------------------------------------------------------------

    def chunk_shape(self, num_tokens: int) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and dtype of a chunk of ``num_tokens`` tokens (a whole number of
        blocks): ``[kv_size, num_layers, num_tokens, row]`` in the cache's dtype."""
        tokens = _int("num_tokens", num_tokens)
        if tokens <= 0:
            raise TransferError(f"num_tokens must be a positive int, got {num_tokens!r}")
        if tokens % self.block_size:
            raise TransferError(
                f"num_tokens={tokens} is not a whole number of blocks of {self.block_size} tokens"
            )
        nbytes = self.kv_size * self.num_layers * tokens * self.row_bytes
        if nbytes >= 1 << 63:  # torch's "Storage size calculation overflowed" otherwise, later
            raise TransferError(
                f"num_tokens={tokens} makes a chunk of {nbytes} bytes, more than any tensor holds (2**63 - 1)"
            )
        return (self.kv_size, self.num_layers, tokens, self.row), self.dtype

    def chunks_for(
        self, num_blocks: int, chunk_tokens: int, *, pin_memory: bool = False
    ) -> list[torch.Tensor]:
        """Empty chunks for a call moving ``num_blocks`` blocks in chunks of
        ``chunk_tokens`` tokens: ``ceil(num_blocks / (chunk_tokens / block_size))`` of
        them, the last one only as long as its blocks need, on the cache's device."""
        count = _int("num_blocks", num_blocks)
        if not 0 <= count <= self.num_blocks:
            raise TransferError(
                f"num_blocks={count} is outside [0, {self.num_blocks}]: a call moves at most the cache's "
                f"{self.num_blocks} blocks (a load writes each once)"
            )
        shape, dtype = self.chunk_shape(chunk_tokens)
        per_chunk = shape[2] // self.block_size
        chunks = []
        for first in range(0, count, per_chunk):
            tokens = min(per_chunk, count - first) * self.block_size
            size = (*shape[:2], tokens, shape[3])
            chunks.append(torch.empty(size, dtype=dtype, device=self.device, pin_memory=pin_memory))
        return chunks

    def store_blocks(
        self, block_ids: Any, chunks: Any, *, skip_prefix_n_blocks: int = 0, num_threads: int = 1
    ) -> None:
        """Copy blocks from the cache into chunks; chunk ``c`` holds blocks
        ``[c*bpc, (c+1)*bpc)`` of ``block_ids`` (``bpc`` = chunk tokens / block size)."""
        self._run(_STORE, block_ids, chunks, skip_prefix_n_blocks, num_threads)

    def load_blocks(
        self, block_ids: Any, chunks: Any, *, skip_prefix_n_blocks: int = 0, num_threads: int = 1
    ) -> None:
        """Copy chunks back into the cache's blocks (the inverse of ``store_blocks``)."""
        self._run(_LOAD, block_ids, chunks, skip_prefix_n_blocks, num_threads)

    def _run(self, direction: int, block_ids: Any, chunks: Any, skip: int, threads: int) -> None:
        # The arguments first (converting them may run the caller's code: __index__, a
        # sequence's items), then the memory checks, then the copy: nothing of the caller's
        # runs between the checks and the copy, which reads kvlayout's own copy of the ids and
        # holds the chunks (another thread dropping one from the caller's list frees nothing;
        # a tensor subclass's __torch_function__ is not called by the checks' data_ptr()).
        ids = _block_ids(block_ids, self.num_blocks)
        self._check_ids(ids)
        skip = _int("skip_prefix_n_blocks", skip)
        if not 0 <= skip <= len(ids):
            raise TransferError(f"skip_prefix_n_blocks={skip} is outside [0, {len(ids)}]")
        threads = threads_arg(threads, TransferError)
        held = tuple(chunks) if isinstance(chunks, list) else chunks  # a list another thread may edit
        with torch._C.DisableTorchFunction():
            self._checked_run(direction, ids, held, skip, threads)

    def _checked_run(self, direction: int, ids: np.ndarray, held: Any, skip: int, threads: int) -> None:
        ptrs, tokens, per_chunk = self._chunks(held, len(ids))
        moved = self._placement.moved()
        if moved is not None:
            raise TransferError(
                f"{moved} after this plan was prepared; it would copy through the old addresses: "
                "detect the registration again and prepare a new plan"
            )
        if direction == _LOAD:
            why = "a load writes each block once (which chunk's copy would land is undefined)"
            check_written_once("block_ids", ids, skip, self.num_blocks, TransferError, why)
        self._engine.run(direction, ids, ptrs, tokens, per_chunk, skip, threads)

    def _check_ids(self, ids: np.ndarray) -> None:
        check_ids_in_range("block_ids", ids, self.num_blocks, TransferError)

    def _chunks(self, chunks: Any, num_blocks: int) -> tuple[np.ndarray, np.ndarray, int]:
        """The chunks' addresses and token counts, every chunk checked; and blocks per chunk."""
        if isinstance(chunks, torch.Tensor):
            chunks = [chunks]
        elif not isinstance(chunks, (list, tuple)):
            raise TransferError(f"chunks is a {type(chunks).__name__}, not a tensor or a list of tensors")
        if not chunks:
            if num_blocks == 0:
                return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64), 1  # nothing to move
            raise TransferError(f"no chunks given for {num_blocks} block(s)")
        kv_size, layers, row, dtype, device = self.kv_size, self.num_layers, self.row, self.dtype, self.device
        conjugable = dtype.is_complex  # only a complex chunk (of a complex cache) has a conjugate bit
        spans: list[tuple[int, int, int]] = []
        tokens: list[int] = []
        for i, c in enumerate(chunks):
            if not isinstance(c, torch.Tensor):
                raise TransferError(f"chunks[{i}] is a {type(c).__name__}, not a tensor")
            if c.is_nested or c.layout is not torch.strided:
                kind = "nested" if c.is_nested else str(c.layout)
                raise TransferError(f"chunks[{i}] is a {kind} tensor; a chunk is a dense (strided) tensor")
            if c.is_neg() or (conjugable and c.is_conj()):
                raise TransferError(f"chunks[{i}] {not_strided(c)}")
            shape = c.shape
            if len(shape) != 4 or shape[0] != kv_size or shape[1] != layers or shape[3] != row:
                raise TransferError(
                    f"chunks[{i}] has shape {list(shape)}; this registration needs "
                    f"[{kv_size}, {layers}, T, {row}] (kv_size, layers, tokens, row)"
                    + lmcache_object_hint(f"chunks[{i}]", shape, kv_size, layers, row)
                )
            if c.dtype != dtype:
                raise TransferError(f"chunks[{i}] is {c.dtype}; the cache is {dtype}")
            if c.device != device:
                raise TransferError(f"chunks[{i}] is on {c.device}; the cache is on {device}")
            if not c.is_contiguous():
                raise TransferError(f"chunks[{i}] is not contiguous (strides {list(c.stride())})")
            if type(c) is not torch.Tensor:  # a subclass (a fake tensor?): before its data pointer
                problem = no_memory(c)
                if problem is not None:
                    raise TransferError(f"chunks[{i}] {problem}")
            start = c.data_ptr()
            size = c.numel() * c.element_size()
            if size:
                problem = memory_problem(c, start, size)
                if problem is not None:
                    raise TransferError(f"chunks[{i}] {problem}")
            spans.append((start, start + size, i))
            tokens.append(int(shape[2]))
        per_chunk = _blocks_per_chunk(tokens, self.block_size, num_blocks)
        self._check_disjoint(spans)
        return (
            np.array([s[0] for s in spans], dtype=np.uint64),
            np.array(tokens, dtype=np.int64),
            per_chunk,
        )

    def _check_disjoint(self, spans: list[tuple[int, int, int]]) -> None:
        """Chunks share no byte with each other or with the cache's tensors."""
        ordered = sorted(spans)
        for (_, a1, i), (b0, _, j) in itertools.pairwise(ordered):
            if b0 < a1:
                first, second = sorted((i, j))
                raise TransferError(f"chunks[{first}] and chunks[{second}] overlap in memory")
        starts, ends = self._extents
        for lo, hi, i in spans:
            k = bisect.bisect_right(starts, lo)
            if (k and ends[k - 1] > lo) or (k < len(starts) and starts[k] < hi):
                raise TransferError(f"chunks[{i}] overlaps the cache's memory; a chunk is a separate buffer")


def _placement(group: KernelGroup) -> Placement:
    """The cache's tensors, checked to be where detection read them and to have their
    memory, as a :class:`~kvlayout.registration.memory.Placement` every call checks again."""
    placement = group_placement(group, TransferError)
    assert placement is not None  # prepare refused a meta cache first
    return placement


def _jobs(group: KernelGroup, block_size: int | None) -> tuple[_Job, ...]:
    layout = group.layout
    jobs = []
    row_offset = 0
    for plane in group.planes:
        sizes = _resolve_block_size(layout, dict(plane.sizes), block_size)
        jobs.append(_Job(plane, sizes, plane.padded_block_stride, row_offset))
        row_offset += _row_bytes(layout, jobs[-1])
    return tuple(jobs)


def _row_bytes(layout: Layout, job: _Job) -> int:
    return layout.num_heads(job.sizes) * layout.head_size(job.sizes) * job.element_size


def _cache_extents(group: KernelGroup) -> tuple[list[int], list[int]]:
    """The cache's memory as sorted, merged [start, end) spans (for chunk checks)."""
    runs = (run_of(p.leaves[0], p.data_ptrs, p.paths, "kv") for p in group.planes)
    spans = sorted((start, start + r.span) for r in runs if r is not None for start in r.starts)
    starts: list[int] = []
    ends: list[int] = []
    for lo, hi in spans:
        if ends and lo <= ends[-1]:
            ends[-1] = max(ends[-1], hi)
        else:
            starts.append(lo)
            ends.append(hi)
    return starts, ends


def _required(layout: Layout, sizes: dict[str, int], role: Role) -> int:
    value = layout.size_of(sizes, role)
    assert value is not None, (layout, role)  # _resolve_block_size made sure
    return value


def _resolve_block_size(layout: Layout, sizes: dict[str, int], block_size: int | None) -> dict[str, int]:
    """Formats that fold their blocks and tokens into one page axis need the block size
    from the caller (the tensors cannot say it)."""
    blocks = layout.axis_of(Role.BLOCK)
    tokens = layout.size_of(sizes, Role.TOKEN)
    if blocks is not None and tokens is not None:
        if block_size is not None and block_size != tokens:
            raise TransferError(f"block_size={block_size}, but the {layout} tensors have blocks of {tokens}")
        return sizes
    page = layout.symbol_of(Role.PAGE)
    if block_size is None:
        raise TransferError(
            f"{layout} folds its blocks and their tokens into one axis ({page}): pass block_size= "
            "(tokens per block)"
        )
    block_size = _int("block_size", block_size)
    if block_size <= 0:
        raise TransferError(f"block_size must be a positive int, got {block_size!r}")
    try:
        return algebra.split_pages(layout, sizes, block_size, "block_size")
    except SizeError as e:
        raise TransferError(f"{layout}: {e}") from None


# -- plans ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _pieces(
    layout: Layout, sizes: tuple[tuple[str, int], ...], element_size: int, row_bytes: int
) -> np.ndarray:
    """The copy plan of one job in bytes, one row per piece (the native engine's input)."""
    s = dict(sizes)
    if row_bytes % element_size:
        raise TransferError(
            f"{layout}: a {element_size}-byte plane does not align in a {row_bytes}-byte chunk row"
        )
    plan = layout.copy_plan(s, chunk_row=row_bytes // element_size)
    hs = layout.head_size(s)
    rows = []
    for piece in plan.pieces:
        if len(piece.loops) > _MAX_LOOPS:
            raise TransferError(f"{layout}: a copy plan with {len(piece.loops)} loops (at most {_MAX_LOOPS})")
        row = [
            piece.elem // hs,
            piece.elem % hs,
            piece.elem * element_size,
            piece.run * element_size,
            len(piece.loops),
        ]
        for loop in piece.loops:
            row += [loop.extent, loop.chunk_stride * element_size, loop.cache_stride * element_size]
        rows.append(row + [0] * (_PIECE_FIELDS - len(row)))
    return np.array(rows, dtype=np.int64).reshape(-1, _PIECE_FIELDS)


def native_sizes(layout: Layout, sizes: Mapping[str, int]) -> list[int]:
    """Sizes in the order the generated indexers take them (0 where the layout has none)."""
    resolved = algebra.resolve_sizes(layout, sizes)
    return [resolved.get(symbol, 0) for symbol in SIZE_SYMBOLS]


# -- per call -------------------------------------------------------------------------


def _int(name: str, value: object) -> int:
    return int_arg(name, value, TransferError)


def _block_ids(block_ids: Any, count: int) -> np.ndarray:
    """Block ids as a contiguous int64 array (ranges are checked natively; a ``range`` of
    ids outside the ``count`` blocks is refused before it is built)."""
    return block_ids_arg("block_ids", block_ids, TransferError, count)


def _blocks_per_chunk(tokens: list[int], block_size: int, num_blocks: int) -> int:
    first = tokens[0]
    if first % block_size or first == 0:
        raise TransferError(f"chunk size {first} is not a positive multiple of the block size {block_size}")
    per_chunk = first // block_size
    needed = -(-num_blocks // per_chunk)
    if len(tokens) != needed and num_blocks:
        raise TransferError(
            f"{num_blocks} blocks at {per_chunk} blocks per chunk need {needed} chunks, got {len(tokens)}"
        )
    for i, t in enumerate(tokens):
        last = i == len(tokens) - 1
        holds = min(per_chunk, num_blocks - i * per_chunk)
        if (not last and t != first) or (last and (t % block_size or t < holds * block_size)):
            raise TransferError(
                f"chunks[{i}] holds {t} tokens; it needs {first if not last else holds * block_size}"
                + (" or more, a multiple of the block size" if last else " like chunks[0]")
            )
    return per_chunk


# -- the functions, over a plan -------------------------------------------------------


def chunk_shape(
    kv: Any, fmt: FormatLike, num_tokens: int, *, block_size: int | None = None
) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype a chunk of ``num_tokens`` tokens needs for this registration:
    ``[kv_size, nl, num_tokens, nh * hs]`` of its ``PageBufferShapeDesc``."""
    return prepare(kv, fmt, block_size=block_size).chunk_shape(num_tokens)


def store_blocks(
    kv: Any,
    fmt: FormatLike,
    block_ids: Any,
    chunks: Any,
    *,
    skip_prefix_n_blocks: int = 0,
    num_threads: int = 1,
    block_size: int | None = None,
) -> None:
    """Copy blocks from the engine cache into chunks (``[kv_size, NL, T, row]`` each).

    ``kv`` and ``fmt`` are as detection returns them (the prepared plan is then reused);
    ``block_size`` is needed only for formats that fold NB and BS into one axis.
    Connectors that move many chunks call :func:`prepare` once instead.
    """
    prepare(kv, fmt, block_size=block_size).store_blocks(
        block_ids, chunks, skip_prefix_n_blocks=skip_prefix_n_blocks, num_threads=num_threads
    )


def load_blocks(
    kv: Any,
    fmt: FormatLike,
    block_ids: Any,
    chunks: Any,
    *,
    skip_prefix_n_blocks: int = 0,
    num_threads: int = 1,
    block_size: int | None = None,
) -> None:
    """Copy chunks back into the engine cache's blocks (the inverse of ``store_blocks``)."""
    prepare(kv, fmt, block_size=block_size).load_blocks(
        block_ids, chunks, skip_prefix_n_blocks=skip_prefix_n_blocks, num_threads=num_threads
    )
