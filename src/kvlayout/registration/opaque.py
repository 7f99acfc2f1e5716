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

from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["MAX_PAGE_LAYOUT", "OpaquePages", "mark_opaque_pages", "opaque_pages_of", "pages_of_tensors"]

MAX_PAGE_LAYOUT = 1024
"""The longest :attr:`OpaquePages.layout` a description may carry (characters)."""

_ATTRIBUTE = "_kvlayout_opaque_pages"


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

    def __post_init__(self) -> None:
        if not isinstance(self.layout, str) or not 0 < len(self.layout) <= MAX_PAGE_LAYOUT:
            raise ValueError(f"an opaque page layout is a string of 1 to {MAX_PAGE_LAYOUT} characters")
        if not isinstance(self.rows_are_tokens, bool):
            raise TypeError(f"rows_are_tokens must be a bool, not {type(self.rows_are_tokens).__name__}")


def mark_opaque_pages(t: torch.Tensor, pages: OpaquePages) -> None:
    """Say that ``t``'s rows are ``pages``' bytes (the tensor object carries it)."""
    setattr(t, _ATTRIBUTE, pages)


def opaque_pages_of(t: torch.Tensor) -> OpaquePages | None:
    """What :func:`mark_opaque_pages` said of ``t``; None for a tensor as an engine registers it."""
    pages = getattr(t, _ATTRIBUTE, None)
    return pages if isinstance(pages, OpaquePages) else None


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
