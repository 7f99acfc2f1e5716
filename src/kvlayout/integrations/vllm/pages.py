"""Byte geometry of registered pages, and the opaque page view the edits produce.

Everything here works on bytes of the tensor's storage: a page is a contiguous byte
run, pages sit a fixed byte stride apart, and an edited layer is re-viewed as
``[num_blocks, block_size, page_bytes // block_size]`` int8 over the same storage.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvlayout._generated.formats import EngineKVFormat
from kvlayout.integrations.vllm.errors import KVCacheGroupEditError
from kvlayout.integrations.vllm.specs import MLA_KINDS, spec_field, spec_kind, spec_size
from kvlayout.integrations.vllm.states import state_arrays
from kvlayout.registration.contiguity import (
    StridedViewError,
    attempt_permute_to_contiguous_view,
    physical_order,
)
from kvlayout.registration.opaque import (
    MAX_PAGE_LAYOUT,
    OPAQUE_PAGE_DTYPE,
    OpaquePages,
    PageArray,
    page_bytes_view,
    page_of,
    replicated_page,
)

__all__ = [
    "OPAQUE_HEAD_PAGES_FORMAT",
    "OPAQUE_PAGE_DTYPE",
    "OPAQUE_PAGE_FORMAT",
    "PageRuns",
    "latent_pages",
    "opaque_page_view",
    "page_layout",
    "page_runs",
]

OPAQUE_PAGE_FORMAT = EngineKVFormat.NL_X_NB_BS_HS
"""What every edited view reads as: one plane of ``block_size`` rows per block, no
head axis. Detection reads a rank-3 vLLM tensor as this format under every
``kv_layout`` hint, so the edited views do not depend on the NHD/HND hint (a rank-4 or
rank-5 view with a synthetic head axis would swap its head and token axes under the
other hint)."""

OPAQUE_HEAD_PAGES_FORMAT = EngineKVFormat.NL_X_NH_NB_BS_CS
"""What an edited view of pages per head reads as, ``[H, num_blocks, block_size, row]``:
vLLM's ``LHBNC`` keeps each head (or head slot) outside the blocks, so a block is one
page per head. Detection reads it so under the ``LHBNC`` hint, which such a cache needs."""


@dataclass(frozen=True)
class PageRuns:
    """A tensor read as pages: ``num_pages`` contiguous runs of ``page_bytes`` each,
    ``stride_bytes`` apart, the first ``offset_bytes`` into the storage."""

    num_pages: int
    page_bytes: int
    stride_bytes: int
    offset_bytes: int


def page_runs(t: torch.Tensor) -> PageRuns:
    """Read ``t`` as pages along its outermost axis in memory.

    Every axis inside that one must be tightly packed, so one index of the page axis is
    one contiguous byte run: contiguity recovery's rule (dim-0 padding only). Anything
    else (interior padding, a K/V axis outside the pages) raises
    :class:`KVCacheGroupEditError` with the shape and strides.
    """
    if t.dim() == 0 or t.numel() == 0:
        raise KVCacheGroupEditError(f"expected a non-empty paged tensor, got shape {tuple(t.shape)}")
    try:
        physical = attempt_permute_to_contiguous_view(t)
    except StridedViewError as e:
        raise KVCacheGroupEditError(f"its pages are not one contiguous run each: {e}") from e
    assert isinstance(physical, torch.Tensor)
    item = t.element_size()
    num_pages = int(physical.shape[0])
    page = math.prod(physical.shape[1:])
    stride = int(physical.stride(0)) if num_pages > 1 else page
    return PageRuns(num_pages, page * item, stride * item, int(t.storage_offset()) * item)


def opaque_page_view(
    t: torch.Tensor,
    *,
    num_blocks: int,
    block_size: int,
    page_bytes: int,
    block_stride_bytes: int,
    offset_bytes: int,
) -> torch.Tensor:
    """``[num_blocks, block_size, page_bytes // block_size]`` int8 over ``t``'s storage.

    Block ``b`` is bytes ``[offset + b * stride, offset + b * stride + page_bytes)``:
    the whole page, padding included, and nothing outside it.
    """
    if page_bytes % block_size:
        raise KVCacheGroupEditError(
            f"the {page_bytes}-byte page does not split into block_size={block_size} equal rows "
            f"({page_bytes} % {block_size} = {page_bytes % block_size} bytes left over)"
        )
    if block_stride_bytes < page_bytes:
        raise KVCacheGroupEditError(
            f"blocks are {block_stride_bytes} bytes apart, less than the {page_bytes}-byte page"
        )
    storage = t.untyped_storage()
    end = offset_bytes + (num_blocks - 1) * block_stride_bytes + page_bytes
    if end > storage.nbytes():
        raise KVCacheGroupEditError(
            f"{num_blocks} pages of {page_bytes} bytes, {block_stride_bytes} bytes apart from byte "
            f"{offset_bytes}, end at byte {end}, past the {storage.nbytes()}-byte storage"
        )
    return page_bytes_view(
        t, num_blocks, block_size, page_bytes // block_size, block_stride_bytes, offset_bytes
    )


def page_text(rule: str, tensors: Sequence[Any], declared: Mapping[str, Any]) -> str:
    """An edit's opaque pages' layout text: the rule, each registered tensor's page, then
    the spec's declared fields (``shapes``, ``dtypes``) it has (None: one it has not)."""
    parts = [page_of(t) for t in tensors] + [f"{k} {v}" for k, v in declared.items() if v is not None]
    return f"{rule}: {'; '.join(parts)}"[:MAX_PAGE_LAYOUT]


def page_layout(
    rule: str, spec: Any, value: Any, token_axis: int | None, *, kernel_pages: int | None = None
) -> OpaquePages:
    """What orders the bytes inside the pages an edit made of ``value`` (a tensor, or a
    list of states): the rule, and each registered tensor's dtype, per-page shape and
    memory order (the kernel's page: its block size, heads and NHD or HND order), plus
    the spec's state shapes where it declares them (a Mamba page's conv | ssm split).
    Rows are tokens where ``token_axis`` is the outermost axis inside a page in memory.
    ``kernel_pages``: the edited block is that many of ``value``'s pages, each whole; an
    MLA spec's such block is then one KV head every TP rank holds (:func:`latent_pages`)."""
    tensors = [value] if isinstance(value, torch.Tensor) else list(value)
    text = page_text(rule, tensors, {name: spec_field(spec, name, None) for name in ("shapes", "dtypes")})
    first = tensors[0]
    order = [d for d in physical_order(first.shape, first.stride()) if first.shape[d] != 1]
    inner = order[order.index(0) + 1 :] if 0 in order else order[1:]  # inside a page (heads may be outside)
    rows_are_tokens = token_axis is not None and len(tensors) == 1 and (not inner or inner[0] == token_axis)
    # a Mamba page's TP-sharded states, or an MLA page every rank holds: either may then
    # move between ranks of any TP degrees
    arrays = state_arrays(spec) or latent_pages(spec, value, kernel_pages)
    pages = OpaquePages(text, rows_are_tokens, arrays)
    page = spec_size(spec, "page_size_bytes")
    if pages.arrays and (rows_are_tokens or page is None or pages.arrays_end > page):
        return dataclasses.replace(pages, arrays=())
    return pages


def latent_pages(spec: Any, value: Any, kernel_pages: int | None) -> tuple[PageArray, ...]:
    """An MLA spec's block of ``kernel_pages`` registered pages (``[pages, ..., slots, row]``:
    DeepSeek-V4's packed records, a DSA indexer's values then scales) as an array every
    rank holds whole: vLLM's MLA specs hold one head (the latents, the indexer's key) that
    every TP rank computes whole, so a page maps between any two ranks. The shape is the block's
    pages, their slots and row bytes, so pages cut otherwise (2 kernel pages of 32 slots,
    1 of 64) are no one state; empty for any other spec or value."""
    if spec_kind(spec) not in MLA_KINDS or not isinstance(value, torch.Tensor) or not kernel_pages:
        return ()
    if value.dim() < 3 or value.numel() == 0:
        return ()
    slots, row = math.prod(value.shape[1:-1]), int(value.shape[-1]) * value.element_size()
    return replicated_page((kernel_pages, slots, row))
