"""Opaque pages: tensors whose rows are a page's bytes cut into equal runs, not tokens.

vLLM's group edits (:mod:`kvlayout.integrations.vllm`) re-view a Mamba state page or a
block paged finer by its kernel as ``[num_blocks, block_size, page_bytes // block_size]``
int8, so that block ids address whole pages. The view reads as an ordinary format, but
what a row holds is the kernel's business: the byte order inside a page depends on the
backend, its kernel block size, the memory order and the TP degree. The edits mark each
view they make with what fixes that order (:class:`OpaquePages`), registrations carry it
per kernel group and descriptions send it to peers, so a block map moves such pages only
between caches paged alike, and whole pages where a row is not a token.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvlayout._generated.formats import LAYOUTS, EngineKVFormat
from kvlayout.layout.dtypes import DTYPE_SIZES
from kvlayout.layout.vocabulary import Role
from kvlayout.registration.contiguity import physical_order

__all__ = [
    "MAX_ARRAY_DIMS",
    "MAX_PAGE_ARRAYS",
    "MAX_PAGE_LAYOUT",
    "OPAQUE_PAGE_DTYPE",
    "OpaquePages",
    "PageArray",
    "head_pages",
    "head_pages_format",
    "is_marked",
    "mark_like",
    "mark_opaque_pages",
    "opaque_pages_of",
    "page_bytes_view",
    "page_of",
    "pages_of_tensors",
    "replicated_page",
    "viewed_over",
]

MAX_PAGE_LAYOUT = 1024
"""The longest :attr:`OpaquePages.layout` a description may carry (characters)."""

OPAQUE_PAGE_DTYPE = torch.int8
"""Bytes: a page mixes dtypes (bf16 conv, fp32 ssm, padding; K and V of kernel pages),
so no element type describes it. int8, not uint8, so a 132-byte row is never taken for
the DSA indexer's uint8 ``[NB, BS, 132]`` format."""


def page_bytes_view(
    t: torch.Tensor, num_blocks: int, rows: int, row: int, block_stride_bytes: int, offset_bytes: int
) -> torch.Tensor:
    """``[num_blocks, rows, row]`` int8 over ``t``'s storage (no copy): block ``b`` the
    ``rows * row`` bytes from ``offset_bytes + b * block_stride_bytes``. The caller checks
    that they lie inside the storage."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=OPAQUE_PAGE_DTYPE, device=t.device)
    flat.set_(storage, 0, (storage.nbytes(),), (1,))  # the storage as bytes, no copy
    return flat.as_strided((num_blocks, rows, row), (block_stride_bytes, row, 1), offset_bytes)


def page_of(t: torch.Tensor) -> str:
    """How a registered ``[pages, ...]`` tensor orders a page's bytes, for an
    :attr:`OpaquePages.layout`: its dtype, per-page shape and memory order."""
    order = [d for d in physical_order(t.shape, t.stride()) if t.shape[d] != 1]
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)[1:]} in memory order {order[1:]}"


MAX_PAGE_ARRAYS = 16
"""The most :attr:`OpaquePages.arrays` a page may declare (a description is untrusted)."""

MAX_ARRAY_DIMS = 8
"""The most axes a :class:`PageArray` may have."""

_ATTRIBUTE = "_kvlayout_opaque_pages"


@dataclass(frozen=True)
class PageArray:
    """An array of a page's state that tensor parallelism shards: ``shape`` (this rank's)
    elements of ``dtype`` (a name of :data:`~kvlayout.layout.dtypes.DTYPE_SIZES`),
    C-contiguous from byte ``offset`` of the page, whose axis ``axis`` concatenates
    ``parts`` (this rank's lengths along it), each part sharded over the ranks on its
    own: rank ``r`` of ``T`` holds indices ``[r*n, (r+1)*n)`` of a part ``n*T`` long. A
    Mamba2 conv state in vLLM's "DS" order is ``(conv_dim, rows)`` with parts
    ``(x, B, C)`` on axis 0; in "SD" order ``(rows, conv_dim)`` on axis 1; its SSM state
    ``(heads, head_dim, d_state)`` is one part on axis 0. What a page declares so lets a
    block map move it between ranks of other TP degrees.

    ``kv_heads``: the sharded axis is the model's attention KV heads, one part (a KV
    cache page of heads, as SGLang's AITER ``vectorized_5d`` pool holds): a rank holds
    the heads its :class:`~kvlayout.registration.shards.Shard` says, which past
    ``num_kv_heads`` ranks are replicated (two ranks of TP 4 over 2 heads hold head 0),
    where ``[r*n, (r+1)*n)`` would say other heads.

    ``replicated``: every TP rank holds the whole array (MLA latents, a DSA indexer's one
    key head), one part: it moves whole between any two ranks, whatever their shards say
    of the model's KV heads (as an MLA cache's latents do).

    A page's one array of KV heads of four axes on axis 1, from its first byte, is an
    attention kernel's pages of heads: ``(kernel pages, heads, tokens, row)``, each head's
    tokens in a run of rows inside its kernel page (:func:`head_pages`)."""

    offset: int
    shape: tuple[int, ...]
    dtype: str
    axis: int
    parts: tuple[int, ...]
    kv_heads: bool = False
    replicated: bool = False

    def __post_init__(self) -> None:
        for name in ("kv_heads", "replicated"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"a page array's {name} must be a bool, not {type(getattr(self, name)).__name__}"
                )
        for name in ("offset", "axis"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise TypeError(f"a page array's {name} must be an int")
        for name in ("shape", "parts"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(type(x) is int and x > 0 for x in value):
                raise TypeError(f"a page array's {name} must be a tuple of positive ints")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"a page array's dtype {self.dtype!r} is not one of {', '.join(DTYPE_SIZES)}")
        if self.offset < 0 or not 0 < len(self.shape) <= MAX_ARRAY_DIMS:
            raise ValueError(
                f"a page array has offset >= 0 and 1 to {MAX_ARRAY_DIMS} axes, not offset {self.offset}, "
                f"shape {list(self.shape)}"
            )
        if not 0 <= self.axis < len(self.shape) or sum(self.parts) != self.shape[self.axis]:
            raise ValueError(
                f"a page array's parts {list(self.parts)} must add up to its axis {self.axis} of shape "
                f"{list(self.shape)}"
            )
        if self.kv_heads and self.replicated:
            raise ValueError("a page array is either of KV heads or replicated, not both")
        if (self.kv_heads or self.replicated) and len(self.parts) != 1:
            what = "of KV heads" if self.kv_heads else "every rank holds whole"
            raise ValueError(f"a page array {what} has one part, not {list(self.parts)}")

    def __str__(self) -> str:
        if self.replicated:
            return f"{self.dtype} {list(self.shape)} (every rank's whole)"
        split = "KV heads" if self.kv_heads else f"parts {list(self.parts)}"
        return f"{self.dtype} {list(self.shape)} (axis {self.axis} in {split})"

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@functools.cache
def head_pages_format() -> EngineKVFormat:
    """How the kernel pages of a :func:`head_pages` array read, asked of the catalog by
    role: a list of layers of ``[kernel pages, heads, tokens, row]`` tensors, the row a
    head's K and V side by side (the array's axes in order, as vLLM 0.33 registers an
    attention layer)."""
    axes = (Role.BLOCK, Role.HEAD, Role.TOKEN)
    return next(
        fmt
        for fmt, layout in LAYOUTS.items()
        if layout.is_layer_list and layout.list_depth == 1 and layout.tensor_rank == 4
        and layout.is_fused_packed and tuple(layout.axis_of(r) for r in axes) == (0, 1, 2)
    )  # fmt: skip


def head_pages(pages: OpaquePages | None) -> PageArray | None:
    """The array of pages that are an attention kernel's pages of KV heads, ``(kernel
    pages, heads, tokens, row)`` (heads outside their tokens in a page: vLLM's HND pages a
    block holds several of), or None. Such a block reads as its kernel pages
    (:func:`head_pages_format`), a cache of heads whose tokens are rows, so a block map
    can slice it by heads and tokens as it slices any cache
    (:func:`kvlayout.transfer.map_sides.kernel_page_side`)."""
    if pages is None or len(pages.arrays) != 1:
        return None
    x = pages.arrays[0]
    return x if x.kv_heads and len(x.shape) == 4 and x.axis == 1 and x.offset == 0 else None


def replicated_page(shape: tuple[int, ...]) -> tuple[PageArray, ...]:
    """A page's bytes (its padding aside), ``shape`` uint8, as an array every TP rank
    holds whole (MLA latents, a DSA indexer's one key head), so the page maps between any
    two ranks, whatever their shards say. Pages of other shapes (rank or sizes) are other
    states: a reader gives each kind of page a shape of its own, so no two layouts of one
    size are taken for one state laid out two ways."""
    return (PageArray(0, shape, "uint8", 0, (shape[0],), replicated=True),)


@dataclass(frozen=True)
class OpaquePages:
    """What a tensor of opaque pages holds.

    ``layout`` names what orders the bytes inside a page (the edit and the registered
    value's dtype, per-page shape and memory order): two caches whose layouts differ store
    the same tokens in other bytes. ``rows_are_tokens`` says row ``r`` of a block is token
    ``r``: a kernel page stored token-major (vLLM's NHD, MLA latents), where a partial last
    block can move its first tokens' rows; otherwise only whole pages mean anything.
    """

    layout: str
    rows_are_tokens: bool
    arrays: tuple[PageArray, ...] = ()
    """The page's TP-sharded state (:class:`PageArray`), disjoint, in page order, where
    the edit knows it (a Mamba page's conv and SSM states); empty otherwise."""
    advice: str = field(default="", compare=False)
    """How the pages came to be read so and what to do where they do not map (local: a
    description does not carry it, and pages alike compare equal whatever it says)."""

    def __post_init__(self) -> None:
        if not isinstance(self.layout, str) or not 0 < len(self.layout) <= MAX_PAGE_LAYOUT:
            raise ValueError(f"an opaque page layout is a string of 1 to {MAX_PAGE_LAYOUT} characters")
        if not isinstance(self.rows_are_tokens, bool):
            raise TypeError(f"rows_are_tokens must be a bool, not {type(self.rows_are_tokens).__name__}")
        arrays = self.arrays
        if not isinstance(arrays, tuple) or not all(isinstance(a, PageArray) for a in arrays):
            raise TypeError("an opaque page's arrays must be a tuple of PageArray")
        if len(arrays) > MAX_PAGE_ARRAYS:
            raise ValueError(f"an opaque page declares at most {MAX_PAGE_ARRAYS} arrays, not {len(arrays)}")
        for i in range(1, len(arrays)):
            if arrays[i].offset < arrays[i - 1].offset + arrays[i - 1].nbytes:
                raise ValueError(
                    f"page array {i} starts at byte {arrays[i].offset}, inside array {i - 1} "
                    f"(bytes {arrays[i - 1].offset} to {arrays[i - 1].offset + arrays[i - 1].nbytes})"
                )

    @property
    def arrays_end(self) -> int:
        """The byte past the last array (0 without arrays): the page is at least this long."""
        return self.arrays[-1].offset + self.arrays[-1].nbytes if self.arrays else 0


class _Mark(NamedTuple):
    pages: OpaquePages | None  # None: a view read as its format, made over other tensors
    over: tuple[tuple[weakref.ref[torch.Tensor], int], ...]  # the tensors viewed, their data pointers


# Marks by view geometry as well as on the tensor object: ``view[:]``, ``.view(shape)`` or
# ``.detach()`` of a marked view is a new object over the same bytes, read the same way.
# An entry holds while a tensor it was made over lives (so its storage, and the addresses
# in the key, cannot be reused by another tensor); a lock keeps the bounded dict whole.
_BY_GEOMETRY: dict[tuple[object, ...], _Mark] = {}
_MAX_MARKS = 1 << 16
_LOCK = threading.Lock()


def _geometry(t: torch.Tensor) -> tuple[object, ...] | None:
    if t.layout is not torch.strided or t.is_nested or t.device.type == "meta" or type(t) is not torch.Tensor:
        return None  # a subclass (a fake tensor) may have no storage to read
    storage = t.untyped_storage()
    return (storage._cdata, storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def mark_opaque_pages(t: torch.Tensor, pages: OpaquePages | None, over: Iterable[torch.Tensor] = ()) -> None:
    """Say that ``t``'s rows are ``pages``' bytes (None: that ``t`` reads as its format,
    a view the edits made of whole blocks), ``t`` being a view made over the tensors
    ``over`` (the registered value the edits re-viewed: an engine re-allocates those, so
    re-allocation checks watch them too). The mark travels with the tensor object and,
    while a tensor of ``over`` lives, with any view of the same bytes, shape and strides."""
    mark = _Mark(pages, tuple((weakref.ref(x), x.data_ptr()) for x in over))
    setattr(t, _ATTRIBUTE, mark)
    key = _geometry(t)
    if key is None or not mark.over:
        return
    with _LOCK:
        if len(_BY_GEOMETRY) >= _MAX_MARKS:
            _BY_GEOMETRY.pop(next(iter(_BY_GEOMETRY)), None)
        _BY_GEOMETRY[key] = mark


def _mark_of(t: torch.Tensor) -> _Mark | None:
    mark = getattr(t, _ATTRIBUTE, None)
    if isinstance(mark, _Mark):
        return mark
    key = _geometry(t)
    if key is None:
        return None
    with _LOCK:
        mark = _BY_GEOMETRY.get(key)
        if mark is not None and all(ref() is None for ref, _ in mark.over):
            del _BY_GEOMETRY[key]  # its memory is gone: these addresses may be another tensor's now
            return None
    return mark


def mark_like(part: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``part``, a view of whole rows of ``t``'s (some of its layers), marked as ``t`` is,
    if it is: its rows hold the same pages, and it watches the tensors ``t`` was made
    over. Returns ``part``."""
    mark = _mark_of(t)
    if mark is not None:
        mark_opaque_pages(part, mark.pages, [x for x, _ in viewed_over(t)])
    return part


def opaque_pages_of(t: torch.Tensor) -> OpaquePages | None:
    """What :func:`mark_opaque_pages` said of ``t`` (or of a view of the same bytes read
    the same way); None for a tensor as an engine registers it."""
    mark = _mark_of(t)
    return None if mark is None else mark.pages


def is_marked(t: torch.Tensor) -> bool:
    """Whether :func:`mark_opaque_pages` marked ``t`` (or a view of the same bytes read the
    same way): a view an edit made, opaque pages or whole blocks."""
    return _mark_of(t) is not None


def viewed_over(t: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """The tensors a marked view was made over that are still alive, each with its data
    pointer when the view was made (empty for a tensor as an engine registers it)."""
    mark = _mark_of(t)
    if mark is None:
        return []
    alive = [(ref(), ptr) for ref, ptr in mark.over]
    return [(x, ptr) for x, ptr in alive if x is not None]


def pages_of_tensors(tensors: Iterable[torch.Tensor]) -> OpaquePages | None:
    """The opaque pages of a kernel group's tensors: None when none is marked, the mark
    when all agree; tensors marked differently (or some not at all) read alike only to
    a group of exactly the same mix, and none of their rows is taken for a token."""
    marks = {opaque_pages_of(t) for t in tensors}
    if marks == {None} or not marks:
        return None
    if len(marks) == 1:
        return next(iter(marks))
    names = sorted("as registered" if m is None else m.layout for m in marks)
    return OpaquePages(" | ".join(names)[:MAX_PAGE_LAYOUT], rows_are_tokens=False)
