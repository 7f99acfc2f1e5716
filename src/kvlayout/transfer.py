"""Block transfer between a paged KV cache and token-major chunk buffers, for every format.

A chunk is a tensor ``[kv_size, NL, T, row]`` (``row = num_heads * head_size``, the
packed width for fused and MLA formats; a plane tuple's row is its planes' bytes back to
back), byte-compatible with LMCache's CUDA path. ``block_ids`` is a flat list of engine
blocks: chunk ``c`` holds blocks ``[c*bpc, (c+1)*bpc)`` with ``bpc = T / BS`` of the
first chunk; the last chunk may be shorter (a trailing partial chunk); the first
``skip_prefix_n_blocks`` blocks are left alone in both directions.

Everything is validated before a byte moves; then the native engine (``kvlayout._native``,
GIL released) walks the algebra's copy plan with the generated indexers. Nothing here
knows a format by name: jobs, pieces and strides all come from the layout.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvlayout import algebra
from kvlayout._generated.descriptors import PageBufferShapeDesc
from kvlayout._generated.formats import SIZE_SYMBOLS, EngineKVFormat
from kvlayout.errors import KVLayoutError
from kvlayout.facade import make_page_buffer_shape_desc
from kvlayout.layout import Layout
from kvlayout.registry import FormatLike, as_format, layout_of
from kvlayout.vocabulary import Role

__all__ = ["TransferError", "chunk_shape", "load_blocks", "store_blocks"]

_MAX_LOOPS = 4
_PIECE_FIELDS = 5 + 3 * _MAX_LOOPS


class TransferError(KVLayoutError):
    """Input a transfer cannot serve (raised before any byte is written)."""


@dataclass(frozen=True)
class _Job:
    """Pointers that share one geometry: the whole registration, or one plane."""

    leaves: tuple[torch.Tensor, ...]  # in the job's pointer-table order
    sizes: dict[str, int]
    block_stride: int  # elements, 0 = tight
    element_size: int
    row_offset: int  # bytes from the start of a chunk row


@dataclass(frozen=True)
class _Registration:
    format: EngineKVFormat
    layout: Layout
    jobs: tuple[_Job, ...]
    descriptor: PageBufferShapeDesc  # the whole registration as one kernel group
    dtype: torch.dtype
    device: torch.device

    @property
    def kv_size(self) -> int:
        return self.descriptor.kv_size

    @property
    def num_layers(self) -> int:
        return self.descriptor.nl

    @property
    def num_blocks(self) -> int:
        return self.descriptor.nb

    @property
    def block_size(self) -> int:
        return self.descriptor.bs

    @property
    def row(self) -> int:
        """Elements of a chunk's token row (a plane tuple's planes in the first plane's type)."""
        return self.descriptor.nh * self.descriptor.hs

    @property
    def row_bytes(self) -> int:
        return self.row * self.descriptor.element_size


# -- the registration ---------------------------------------------------------------


def _entries(node: Any, where: str, layout: Layout) -> Sequence[Any]:
    """A list level of the registration, or an error saying what stands there instead."""
    if isinstance(node, torch.Tensor) or not isinstance(node, Sequence) or isinstance(node, str):
        raise TransferError(f"{where} is a {type(node).__name__}, but {layout} has a list level here")
    return node


def _walk(kv: Any, layout: Layout, path: tuple[int, ...]) -> torch.Tensor:
    node = kv
    for depth, index in enumerate(path):
        where = "kv" + "".join(f"[{i}]" for i in path[:depth])
        entries = _entries(node, where, layout)
        if index >= len(entries):
            raise TransferError(
                f"{where} has {len(entries)} entries, but {layout} needs at least {index + 1}"
            )
        node = entries[index]
    if not isinstance(node, torch.Tensor):
        where = "kv" + "".join(f"[{i}]" for i in path)
        raise TransferError(f"{where} is a {type(node).__name__}, not a tensor ({layout})")
    return node


def _list_sizes(kv: Any, layout: Layout) -> dict[str, int]:
    """Sizes of the list levels, read along entry 0 (literal levels checked)."""
    sizes: dict[str, int] = {}
    node = kv
    for depth, level in enumerate(layout.lists):
        where = f"kv{'[0]' * depth}"
        entries = _entries(node, where, layout)
        if level.literal is not None and len(entries) != level.literal:
            raise TransferError(f"{where} has {len(entries)} entries; {layout} needs {level.literal} here")
        if not entries:
            raise TransferError(f"{where} is empty")
        if level.literal is None:
            sizes[level.name] = len(entries)
        node = entries[0]
    return sizes


def _tensor_sizes(layout: Layout, leaf: torch.Tensor, where: str) -> dict[str, int]:
    """Every tensor size of the layout, read off one leaf's axes."""
    rank = layout.tensor_rank
    if leaf.dim() != rank:
        raise TransferError(
            f"{where} has rank {leaf.dim()} (shape {list(leaf.shape)}); {layout} needs rank {rank}"
        )
    sizes: dict[str, int] = {}
    for symbol in SIZE_SYMBOLS:
        axis = layout.axis_of(symbol)
        if axis is not None:
            sizes[symbol] = int(leaf.shape[axis])
    return sizes


def _plane_level(layout: Layout) -> int | None:
    return next((i for i, lv in enumerate(layout.lists) if lv.role is Role.ELEMENT), None)


def _describe(kv: Any, fmt: FormatLike, block_size: int | None) -> _Registration:
    """Check a registration against its format's layout, every leaf, and split it into jobs."""
    fmt = as_format(fmt)
    layout = layout_of(fmt)
    list_sizes = _list_sizes(kv, layout)
    plane = _plane_level(layout)
    planes = list_sizes.get(layout.lists[plane].name, 1) if plane is not None else 1
    job_list_sizes = dict(list_sizes)
    if plane is not None:
        job_list_sizes[layout.lists[plane].name] = 1  # one job per plane, each its own table
    all_paths = layout.pointer_order(list_sizes)
    jobs: list[_Job] = []
    row_offset = 0
    reference: torch.Tensor | None = None
    for p in range(planes):
        paths = [path for path in all_paths if plane is None or path[plane] == p]
        leaves = tuple(_walk(kv, layout, path) for path in paths)
        first_where = "kv" + "".join(f"[{i}]" for i in paths[0])
        sizes = {**job_list_sizes, **_tensor_sizes(layout, leaves[0], first_where)}
        sizes = _resolve_block_size(layout, sizes, block_size)
        expected_shape = layout.tensor_shape(sizes)
        block_stride = int(leaves[0].stride(0)) if layout.has_leading_block_axis else 0
        tight = layout.tensor_strides(sizes)
        if block_stride == tight[0]:
            block_stride = 0
        expected_strides = layout.tensor_strides(sizes, block_stride or None)
        for path, leaf in zip(paths, leaves, strict=True):
            where = "kv" + "".join(f"[{i}]" for i in path)
            if tuple(leaf.shape) != expected_shape:
                raise TransferError(
                    f"{where} has shape {list(leaf.shape)}, but {first_where} makes {layout} "
                    f"{list(expected_shape)}; is this cache in another format?"
                )
            if leaf.stride() != expected_strides:
                raise TransferError(
                    f"{where} has strides {list(leaf.stride())}; {layout} with these sizes needs "
                    f"{list(expected_strides)} (only dim-0 padding is allowed, and the same for every tensor)"
                )
            if leaf.dtype != leaves[0].dtype or leaf.device != leaves[0].device:
                raise TransferError(
                    f"{where} is {leaf.dtype} on {leaf.device}, but {first_where} is "
                    f"{leaves[0].dtype} on {leaves[0].device}"
                )
        if reference is not None and leaves[0].device != reference.device:
            raise TransferError(
                f"{first_where} is on {leaves[0].device}, the first plane on {reference.device}"
            )
        reference = reference if reference is not None else leaves[0]
        element_size = leaves[0].element_size()
        jobs.append(_Job(leaves, sizes, block_stride, element_size, row_offset))
        row_offset += layout.num_heads(sizes) * layout.head_size(sizes) * element_size
    assert reference is not None
    first = jobs[0].sizes
    for job in jobs[1:]:
        if any(job.sizes[k] != first[k] for k in ("NL", "NB", "BS")):
            raise TransferError(
                f"{layout}: the planes of a layer must share NL, NB and BS ({first} vs {job.sizes})"
            )
    descriptor = make_page_buffer_shape_desc(
        kv, fmt, 0, first["NL"], first["NB"], first["BS"], jobs[0].block_stride or None
    )
    if descriptor.nh * descriptor.hs * descriptor.element_size != row_offset:
        raise TransferError(
            f"{layout}: a token row of {row_offset} bytes is not a whole number of "
            f"{reference.dtype} elements (the first plane's type, which chunks use)"
        )
    return _Registration(fmt, layout, tuple(jobs), descriptor, reference.dtype, reference.device)


def _resolve_block_size(layout: Layout, sizes: dict[str, int], block_size: int | None) -> dict[str, int]:
    """NB*BS formats need the block size from the caller (the tensors cannot say it)."""
    if "NB" in sizes and "BS" in sizes:
        if block_size is not None and block_size != sizes["BS"]:
            raise TransferError(
                f"block_size={block_size}, but the {layout} tensors have blocks of {sizes['BS']}"
            )
        return sizes
    if block_size is None:
        raise TransferError(f"{layout} folds NB and BS into one axis: pass block_size= (tokens per block)")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise TransferError(f"block_size must be a positive int, got {block_size!r}")
    fused = next(t for t in layout.tensor if t.fuses and Role.BLOCK in t.roles)
    total = sizes[fused.name]
    if total % block_size:
        raise TransferError(
            f"{layout}: {fused.shape_label}={total} is not a multiple of block_size={block_size}"
        )
    return {**sizes, "NB": total // block_size, "BS": block_size}


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


def _native_sizes(layout: Layout, sizes: Mapping[str, int]) -> list[int]:
    resolved = algebra.resolve_sizes(layout, sizes)
    return [resolved.get(symbol, 0) for symbol in SIZE_SYMBOLS]


# -- chunks and block ids -------------------------------------------------------------


def chunk_shape(
    kv: Any, fmt: FormatLike, num_tokens: int, *, block_size: int | None = None
) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype a chunk of ``num_tokens`` tokens needs for this registration:
    ``[kv_size, nl, num_tokens, nh * hs]`` of its ``PageBufferShapeDesc``."""
    reg = _describe(kv, fmt, block_size)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
        raise TransferError(f"num_tokens must be a positive int, got {num_tokens!r}")
    return (reg.kv_size, reg.num_layers, num_tokens, reg.row), reg.dtype


def _block_ids(block_ids: Any, reg: _Registration) -> np.ndarray:
    ids = block_ids.detach().cpu().numpy() if isinstance(block_ids, torch.Tensor) else np.asarray(block_ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise TransferError(
            f"block_ids must be a 1-D sequence of ints, got {ids.dtype} with shape {list(ids.shape)}"
        )
    ids = ids.astype(np.int64, copy=False)
    bad = np.flatnonzero((ids < 0) | (ids >= reg.num_blocks))
    if bad.size:
        i = int(bad[0])
        raise TransferError(f"block_ids[{i}] = {int(ids[i])} is out of range for {reg.num_blocks} blocks")
    return np.ascontiguousarray(ids)


def _chunks(chunks: Any, reg: _Registration, num_blocks: int) -> tuple[list[torch.Tensor], int]:
    if isinstance(chunks, torch.Tensor):
        chunks = [chunks]
    chunks = list(chunks)
    if not chunks:
        raise TransferError("no chunks given")
    for i, c in enumerate(chunks):
        if not isinstance(c, torch.Tensor):
            raise TransferError(f"chunks[{i}] is a {type(c).__name__}, not a tensor")
        want = (reg.kv_size, reg.num_layers, reg.row)
        if c.dim() != 4 or (c.shape[0], c.shape[1], c.shape[3]) != want:
            raise TransferError(
                f"chunks[{i}] has shape {list(c.shape)}; this registration needs "
                f"[{want[0]}, {want[1]}, T, {want[2]}] (kv_size, layers, tokens, row)"
            )
        if c.dtype != reg.dtype:
            raise TransferError(f"chunks[{i}] is {c.dtype}; the cache is {reg.dtype}")
        if c.device != reg.device:
            raise TransferError(f"chunks[{i}] is on {c.device}; the cache is on {reg.device}")
        if not c.is_contiguous():
            raise TransferError(f"chunks[{i}] is not contiguous (strides {list(c.stride())})")
    tokens = int(chunks[0].shape[2])
    if tokens % reg.block_size or tokens == 0:
        raise TransferError(
            f"chunk size {tokens} is not a positive multiple of the block size {reg.block_size}"
        )
    per_chunk = tokens // reg.block_size
    needed = -(-num_blocks // per_chunk)
    if len(chunks) != needed:
        raise TransferError(
            f"{num_blocks} blocks at {per_chunk} blocks per chunk need {needed} chunks, got {len(chunks)}"
        )
    for i, c in enumerate(chunks):
        last = i == len(chunks) - 1
        holds = min(per_chunk, num_blocks - i * per_chunk)
        t = int(c.shape[2])
        if (not last and t != tokens) or (last and (t % reg.block_size or t < holds * reg.block_size)):
            raise TransferError(
                f"chunks[{i}] holds {t} tokens; it needs {tokens if not last else holds * reg.block_size}"
                + (" or more, a multiple of the block size" if last else " like chunks[0]")
            )
    return chunks, per_chunk


# -- the transfer ---------------------------------------------------------------------


def _transfer(
    direction: int,
    kv: Any,
    fmt: FormatLike,
    block_ids: Any,
    chunks: Any,
    skip_prefix_n_blocks: int,
    num_threads: int,
    block_size: int | None,
) -> None:
    reg = _describe(kv, fmt, block_size)
    layout = reg.layout
    ids = _block_ids(block_ids, reg)
    chunk_list, per_chunk = _chunks(chunks, reg, len(ids))
    if isinstance(skip_prefix_n_blocks, bool) or not isinstance(skip_prefix_n_blocks, int):
        raise TransferError(f"skip_prefix_n_blocks must be an int, got {skip_prefix_n_blocks!r}")
    if not 0 <= skip_prefix_n_blocks <= len(ids):
        raise TransferError(f"skip_prefix_n_blocks={skip_prefix_n_blocks} is outside [0, {len(ids)}]")
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise TransferError(f"num_threads must be a positive int, got {num_threads!r}")
    if reg.device.type != "cpu":
        from kvlayout import cuda_transfer

        cuda_transfer.transfer(direction, reg, ids, chunk_list, per_chunk, skip_prefix_n_blocks)
        return
    from kvlayout import _native

    jobs = []
    for job in reg.jobs:
        sizes_key = tuple(sorted(job.sizes.items()))
        ptrs = np.array([leaf.data_ptr() for leaf in job.leaves], dtype=np.uint64)
        pieces = _pieces(layout, sizes_key, job.element_size, reg.row_bytes)
        pieces = pieces.copy()
        pieces[:, 2] += job.row_offset
        native_sizes = _native_sizes(layout, job.sizes)
        geometry = (reg.kv_size, reg.num_layers, reg.block_size, reg.row_bytes)
        jobs.append(
            (int(reg.format), native_sizes, job.block_stride, job.element_size, ptrs, pieces, *geometry)
        )
    chunk_ptrs = np.array([c.data_ptr() for c in chunk_list], dtype=np.uint64)
    chunk_tokens = np.array([c.shape[2] for c in chunk_list], dtype=np.int64)
    _native.transfer_blocks(
        direction, jobs, ids, chunk_ptrs, chunk_tokens, per_chunk, skip_prefix_n_blocks, num_threads
    )


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

    ``kv`` and ``fmt`` are as detection returns them. ``block_size`` is needed only for
    formats that fold NB and BS into one axis.
    """
    _transfer(0, kv, fmt, block_ids, chunks, skip_prefix_n_blocks, num_threads, block_size)


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
    _transfer(1, kv, fmt, block_ids, chunks, skip_prefix_n_blocks, num_threads, block_size)
