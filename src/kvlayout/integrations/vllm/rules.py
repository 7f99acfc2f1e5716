"""The group edit rules: each re-views one kind of vLLM registration as opaque pages.

A rule matches structurally, from the leaf spec's kind and the registered value, never
from a model name: the same architecture registers differently depending on the vLLM
release, ``mamba_cache_mode``, the attention backend's kernel block size and TP, and
the spec and the tensors already say all of that.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from kvlayout._generated.formats import EngineKVFormat
from kvlayout.detection.vllm import (
    cpu_attention_pages,
    indexer_format,
    reads_cpu_attention,
    rocm_indexer_pages,
)
from kvlayout.errors import KVLayoutError
from kvlayout.integrations.vllm.errors import KVCacheGroupEditError
from kvlayout.integrations.vllm.pages import (
    OPAQUE_PAGE_FORMAT,
    opaque_page_view,
    page_layout,
    page_runs,
    page_text,
)
from kvlayout.integrations.vllm.specs import (
    MLA_KINDS,
    PAGED_ATTENTION_KINDS,
    SpecKind,
    require_size,
    slots_per_block,
    spec_field,
    spec_kind,
    spec_size,
    tokens_per_slot,
)
from kvlayout.integrations.vllm.states import declared_state_arrays, replicated_state_arrays
from kvlayout.layout.dtypes import DTYPE_SIZES
from kvlayout.registration.contiguity import physical_order
from kvlayout.registration.opaque import OpaquePages, PageArray, mark_opaque_pages, page_of
from kvlayout.types import HintsLike, LayoutHints

__all__ = [
    "DEFAULT_RING_KIND",
    "RING_KINDS",
    "STATE_ROWS_DTYPE",
    "CPUAttentionPagesEdit",
    "HeadSlotPagesEdit",
    "KVCacheGroupEdit",
    "MambaStateListEdit",
    "MambaStateRowsEdit",
    "PackedHeadRowsEdit",
    "PagedScaleMLAEdit",
    "RingBufferPagesEdit",
    "RingKind",
    "SubpagedAttentionEdit",
    "SubpagedMLAEdit",
    "declared_ring_pages",
    "declared_state_rows",
    "reads_as_ring",
    "reads_as_state_rows",
]


class KVCacheGroupEdit(ABC):
    """One re-presentation of a registered KV cache value as a view over its storage.

    ``matches`` must not raise; ``apply`` raises :class:`KVCacheGroupEditError` for a
    value it recognises but cannot re-view faithfully. The result must be a view of the
    value's storage whose layout reads as ``output_format`` with the spec's block size.
    ``apply`` gets the layout hints detection will get (LMCache's signature); kvlayout's
    own rules do not need them, since their opaque views read the same under every hint
    (a whole-block view, :meth:`block_view`, reads as its engine's format under the hint
    detection gets, as the registered layer would).

    ``name`` is what the "edits applied" log counts; ``lmcache_name`` is LMCache's name
    for the same rule (None for a rule LMCache does not have), counted beside it.
    """

    name: ClassVar[str]
    lmcache_name: ClassVar[str | None] = None
    output_format: ClassVar[EngineKVFormat] = OPAQUE_PAGE_FORMAT

    @abstractmethod
    def matches(self, spec: Any, value: Any) -> bool: ...

    def matches_with_hints(self, spec: Any, value: Any, layout_hints: HintsLike = None) -> bool:
        """What the edits ask: :meth:`matches`, unless the rule needs the layout hints
        detection will get to know the layer (vLLM's attention backend); must not raise."""
        return self.matches(spec, value)

    @abstractmethod
    def apply(self, spec: Any, value: Any, layout_hints: HintsLike = None) -> torch.Tensor: ...

    def token_axis(self, value: Any) -> int | None:
        """The registered value's axis holding a kernel page's tokens, None where a page
        holds no tokens (state): whether the edited view's rows are tokens follows
        from it (:func:`kvlayout.integrations.vllm.pages.page_layout`)."""
        return None

    def opaque_pages(self, spec: Any, value: Any, layout_hints: HintsLike = None) -> OpaquePages:
        """What :meth:`apply`'s view is marked with: the rule, the registered value's page
        (:func:`~kvlayout.integrations.vllm.pages.page_layout`)."""
        return page_layout(self.name, spec, value, self.token_axis(value))

    def block_view(self, spec: Any, value: Any) -> torch.Tensor | None:
        """The layer as whole blocks in its own dtype and axes, where that is what its
        bytes are (a block's kernel pages are its tokens in order): detection then reads
        the engine's own format at the spec's block size, and the layer is no opaque
        pages. None (the default) where only :meth:`apply`'s opaque pages are faithful."""
        return None

    def __repr__(self) -> str:
        return f"<KVCacheGroupEdit {self.name}>"


STATE_ROWS_DTYPE = torch.int8
"""The dtype vLLM 0.33+ registers a Mamba layer's state in (:class:`MambaStateRowsEdit`:
``[NB, 1, 1, page]``, the page's bytes; a ``MambaSpec`` has no one dtype)."""


def reads_as_state_rows(geometry: Any) -> bool:
    """Whether a kernel group's geometry, detected from a vLLM registration without its
    spec, is what vLLM 0.33+ registers a Mamba layer as: one head of K and V in blocks of
    one token, of :data:`STATE_ROWS_DTYPE` (only the spec, or its fields, reads it as state)."""
    return (geometry.block_size, geometry.num_heads, geometry.dtype) == (1, 1, STATE_ROWS_DTYPE)


def reads_as_ring(geometry: Any) -> bool:
    """Whether a kernel group's geometry, detected from a vLLM registration without its
    spec, is what vLLM 0.33 registers DeepSeek-V4.1's ``CircularBufferSpec`` ring as
    (:data:`RING_KINDS`' :data:`DEFAULT_RING_KIND`): its head slots of its dtype in blocks
    of the ring's capacity. Only the spec, or a declaration of it, tells such a ring from
    one fp32 head of attention."""
    ring, bs = RING_KINDS[DEFAULT_RING_KIND], geometry.block_size
    return (
        (geometry.num_heads, geometry.dtype) == (ring.slots, ring.dtype)
        and isinstance(bs, int)
        and ring.capacity_error(bs) is None
    )


class MambaStateRowsEdit(KVCacheGroupEdit):
    """vLLM 0.33+: a Mamba layer registers one int8 ``[NB, 1, 1, state_bytes]`` view.

    The row holds conv | ssm unpadded; the page (and the block stride) is padded up to
    the attention page. Re-viewed as the whole padded page, so padding round-trips too.
    """

    name = "mamba-state-rows"
    lmcache_name = "mamba-unified-view"

    def matches(self, spec: Any, value: Any) -> bool:
        return spec_kind(spec) is SpecKind.MAMBA and isinstance(value, torch.Tensor)

    def apply(self, spec: Any, value: Any, layout_hints: HintsLike = None) -> torch.Tensor:
        runs = page_runs(value)
        page = require_size(spec, "page_size_bytes")
        if runs.page_bytes > page:
            raise KVCacheGroupEditError(
                f"the registered state row is {runs.page_bytes} bytes, more than the spec's {page}-byte page"
            )
        return opaque_page_view(
            value,
            num_blocks=runs.num_pages,
            block_size=_state_rows(spec),
            page_bytes=page,
            block_stride_bytes=runs.stride_bytes,
            offset_bytes=runs.offset_bytes,
        )


def declared_state_rows(
    value: torch.Tensor,
    kind: str,
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[torch.dtype],
    rows: int,
    page_bytes: int | None = None,
    *,
    tp_replicated: bool = False,
) -> torch.Tensor:
    """A Mamba layer as vLLM 0.33+ registers it (``value``: ``[NB, 1, 1, page]``, each
    block one contiguous run) re-viewed and marked as :class:`MambaStateRowsEdit` and
    :func:`~kvlayout.integrations.vllm.pages.page_layout` do for a ``MambaSpec`` of these
    fields, where there is no spec to read (``kvlayout plan``'s state sides, given on
    the command line): ``kind`` its ``mamba_type`` (``"gdn_attn"``), ``shapes`` and
    ``dtypes`` its states, ``rows`` its slots per block (1 in 'none' mode, ``block_size``
    in 'align' mode). The page is ``page_bytes`` (the spec's ``page_size_bytes``, padded),
    as the edit reads it: vLLM registers the unpadded state as the row, the padding past
    it; None: ``value``'s row (``kvlayout plan``'s, given as the padded page).
    ``tp_replicated``: the spec's (every rank holds the whole state, whatever ``kind``). States
    that do not split as ``kind`` says, or that do not fit the page, raise
    :class:`KVCacheGroupEditError`: a page without its arrays moves only between ranks alike."""
    names = [str(d).removeprefix("torch.") for d in dtypes]
    given = [tuple(s) for s in shapes]
    arrays = (
        replicated_state_arrays(given, names) if tp_replicated else declared_state_arrays(kind, given, names)
    )
    states = ", ".join(f"{list(s)} {n}" for s, n in zip(shapes, names, strict=True))
    if not arrays:
        raise KVCacheGroupEditError(
            f"a {kind!r} state of {states} does not split over TP as vLLM's {kind} state does (conv state "
            "[dim, rows] or [rows, dim] whose dim is the type's sub-projections, then the SSM state [heads, "
            "...]; mamba1, mamba2, gdn_attn, kda, linear, short_conv)"
        )
    runs = page_runs(value)
    page = runs.page_bytes if page_bytes is None else page_bytes
    if runs.page_bytes > page:
        raise KVCacheGroupEditError(
            f"the registered state row is {runs.page_bytes} bytes, more than the {page}-byte page"
        )
    layout = page_text(MambaStateRowsEdit.name, [value], {"shapes": tuple(shapes), "dtypes": tuple(dtypes)})
    pages = OpaquePages(layout, False, arrays)
    if pages.arrays_end > page:
        raise KVCacheGroupEditError(
            f"the states ({states}) take {pages.arrays_end} bytes, more than the {page}-byte page "
            f"{page_of(value)}"
        )
    view = opaque_page_view(
        value, num_blocks=runs.num_pages, block_size=rows, page_bytes=page,
        block_stride_bytes=runs.stride_bytes, offset_bytes=runs.offset_bytes,
    )  # fmt: skip
    mark_opaque_pages(view, pages, [value])
    return view


class MambaStateListEdit(KVCacheGroupEdit):
    """vLLM before 0.26: a Mamba layer registers ``[conv_state, ssm_state]``.

    Each state is an ``as_strided`` view with its own dtype and shape, laid back to
    back from the page base (conv | ssm | padding) and strided by the page. A list of
    two dtypes is not one paged KV, so the page they share is re-viewed instead.
    """

    name = "mamba-state-list"
    lmcache_name = "mamba-page-view"

    def matches(self, spec: Any, value: Any) -> bool:
        return (
            spec_kind(spec) is SpecKind.MAMBA
            and isinstance(value, (list, tuple))
            and len(value) > 0
            and all(isinstance(state, torch.Tensor) for state in value)
        )

    def apply(self, spec: Any, value: Any, layout_hints: HintsLike = None) -> torch.Tensor:
        states: Sequence[torch.Tensor] = value
        runs = [page_runs(state) for state in states]
        base = runs[0]
        end = base.offset_bytes
        for i, (state, r) in enumerate(zip(states, runs, strict=True)):
            if (r.num_pages, r.stride_bytes) != (base.num_pages, base.stride_bytes):
                raise KVCacheGroupEditError(
                    f"state {i} {tuple(state.shape)} has {r.num_pages} blocks {r.stride_bytes} bytes apart, "
                    f"state 0 has {base.num_pages} blocks {base.stride_bytes} bytes apart"
                )
            if r.offset_bytes != end:
                raise KVCacheGroupEditError(
                    f"state {i} {tuple(state.shape)} starts at byte {r.offset_bytes}, not at byte {end} "
                    "right after the previous state: the states are not laid back to back in one page"
                )
            if state.untyped_storage().data_ptr() != states[0].untyped_storage().data_ptr():
                raise KVCacheGroupEditError(f"state {i} lives in another allocation than state 0")
            end += r.page_bytes
        page, used = require_size(spec, "page_size_bytes"), end - base.offset_bytes
        if used > page:
            raise KVCacheGroupEditError(
                f"the states take {used} bytes per block, more than the spec's {page}-byte page"
            )
        return opaque_page_view(
            states[0],
            num_blocks=base.num_pages,
            block_size=_state_rows(spec),
            page_bytes=page,
            block_stride_bytes=base.stride_bytes,
            offset_bytes=base.offset_bytes,
        )


def _state_rows(spec: Any) -> int:
    """The rows a Mamba page is cut into: its slots per block (``block_size`` in align
    mode, one in 'none' mode, where the page is the request's one running state)."""
    rows = slots_per_block(spec)
    if rows is None:
        raise KVCacheGroupEditError(
            f"the spec's block_size {spec_field(spec, 'block_size', None)!r} holds no slot"
        )
    return rows


def _slots(count: int, ratio: int) -> str:
    return f"{count} tokens" if ratio == 1 else f"{count} slots ({count * ratio} tokens)"


def _block(slots: int, ratio: int) -> str:
    return f"{slots}-token block" if ratio == 1 else f"{slots}-slot block ({slots * ratio} tokens)"


def _token_major_blocks(spec: Any, value: torch.Tensor, token_axis: int | None) -> torch.Tensor | None:
    """``k`` kernel pages of a block as that block, when each page is its tokens stored
    token-major (vLLM's NHD ``[pages, H, N, C]`` in memory order pages, N, H, C; MLA
    latents) and the ``k`` pages are one run of exactly the spec's page: the block's
    tokens in order, which is what vLLM maps (token ``t`` of block ``n`` is slot
    ``t % kbs`` of kernel page ``n*k + t // kbs``). None otherwise."""
    if token_axis is None or value.dim() < 3:
        return None
    order = [d for d in physical_order(value.shape, value.stride()) if value.shape[d] != 1]
    if order[:2] != [0, token_axis]:
        return None  # heads or K/V outside the tokens in a page: only whole pages are faithful
    slots, kernel = slots_per_block(spec), int(value.shape[token_axis])
    page = spec_size(spec, "page_size_bytes")
    if slots is None or page is None or kernel <= 0 or slots % kernel:
        return None
    k = slots // kernel
    runs = page_runs(value)
    if runs.page_bytes * k != page or runs.stride_bytes != runs.page_bytes or runs.num_pages % k:
        return None
    shape, stride = list(value.shape), list(value.stride())
    shape[0], shape[token_axis], stride[0] = shape[0] // k, kernel * k, stride[0] * k
    return value.as_strided(shape, stride, value.storage_offset())


def _group_kernel_pages(
    spec: Any, value: torch.Tensor, kernel_slots: int, *, runs_per_block: int = 1
) -> torch.Tensor:
    """View ``k = slots_per_block / kernel_slots`` consecutive kernel pages as one block
    (``runs_per_block`` > 1: as one of that many equal runs of each block, a head slot's).

    vLLM maps logical block ``n`` to kernel blocks ``n*k .. n*k+k-1``, so this is only
    faithful when those k pages are one contiguous run of exactly the spec's page:
    anything else (a packed or padded page the spec does not declare) raises. A spec
    that declares compression keeps it: its block has ``block_size / ratio`` slots, and
    the kernel pages split those slots exactly as they split an uncompressed block's
    tokens (vLLM's kernel block of ``kbs`` tokens holds ``kbs / ratio`` slots).
    """
    slots, ratio = slots_per_block(spec), tokens_per_slot(spec)
    if slots is None or ratio is None:
        block_size, per_state = spec_field(spec, "block_size", None), spec_field(spec, "tokens_per_state", 1)
        raise KVCacheGroupEditError(
            f"{type(spec).__name__} declares no whole number of slots per block (block_size={block_size!r}, "
            f"tokens_per_state={per_state!r}), so its kernel pages cannot be counted into blocks"
        )
    if kernel_slots <= 0 or slots % kernel_slots:
        raise KVCacheGroupEditError(
            f"kernel pages of {_slots(kernel_slots, ratio)} do not divide the {_block(slots, ratio)}"
        )
    k = slots // kernel_slots
    runs = page_runs(value)
    page = require_size(spec, "page_size_bytes")
    if runs.page_bytes * k * runs_per_block != page:
        per_run = "" if runs_per_block == 1 else f" in each of {runs_per_block} head slots"
        raise KVCacheGroupEditError(
            f"{k} kernel pages of {_slots(kernel_slots, ratio)}{per_run} ({runs_per_block * k} x "
            f"{runs.page_bytes} = {runs_per_block * k * runs.page_bytes} bytes) do not tile the logical page "
            f"({page} bytes); a packed or padded page needs its compression declared on the spec"
        )
    if runs.num_pages % k:
        raise KVCacheGroupEditError(f"{runs.num_pages} kernel pages do not make whole blocks of {k} pages")
    if k > 1 and runs.stride_bytes != runs.page_bytes:  # one page a block is its block, whatever its stride
        raise KVCacheGroupEditError(
            f"kernel pages are {runs.stride_bytes} bytes apart but {runs.page_bytes} bytes long, "
            f"so {k} of them are not one contiguous {k * runs.page_bytes}-byte block"
        )
    return opaque_page_view(
        value,
        num_blocks=runs.num_pages // k,
        block_size=slots,
        page_bytes=k * runs.page_bytes,
        block_stride_bytes=k * runs.stride_bytes,
        offset_bytes=runs.offset_bytes,
    )


# Axis 2 holds the kernel block's tokens (slots, when compressed) in every attention
# registration vLLM makes:
# 0.33 ``[pages, H, N, C]`` (a permute view of the memory order), FlashInfer before 0.26
# ``[pages, 2, N, H, D]`` (NHD, or a permute of HND memory), FlashAttention before 0.26
# ``[2, pages, N, H, D]`` (re-strided block-major in hybrids).
_TOKEN_AXIS = 2


def _head_slots(spec: Any) -> bool:
    """The backend's ``H`` counts slots, not heads (``num_head_slots``): B12X's slot 0 holds
    every head's K and slot 1 every V; ROCm attention and AITER FA's shuffle mode tile K
    ``[H, D/x, N, x]`` inside its slot; FlashInfer's nvfp4 has a K and a V slot a head."""
    return spec_field(spec, "num_head_slots", None) is not None


def _packed_heads(spec: Any) -> bool:
    """A head's row is not ``K | V`` of one head size: the backend declares its own content
    (``state_content_bytes``: Triton's per-token-head scales after each side, TurboQuant's
    slots), or V's head is narrower or wider than K's (``head_size_v``)."""
    head_size = spec_field(spec, "head_size", None)
    return (
        spec_field(spec, "state_content_bytes", None) is not None
        or spec_field(spec, "head_size_v", head_size) != head_size
    )


def _heads_outside_pages(value: torch.Tensor) -> bool | None:
    """Where vLLM 0.33's ``[pages, H, N, C]`` keeps its heads (or head slots): inside each
    page (False: LBHNC, LBNHC), outside every page (True: LHBNC, each head's pages one
    after another), or None for another memory order."""
    order = [d for d in physical_order(value.shape, value.stride()) if value.shape[d] != 1]
    if not order or order[0] == 0 or value.shape[0] == 1:  # no axis longer than 1: one element
        return False  # one page holds every head either way
    return True if order[:2] == [1, 0] else None


def _whole_pages(spec: Any, value: torch.Tensor) -> torch.Tensor:
    """A block's kernel pages as one opaque page, ``[NB, BS, row]``; under LHBNC, where a
    block is one run per head slot, as one opaque page per slot, ``[H, NB, BS, row]``
    (detection reads it as heads outside blocks under the ``LHBNC`` hint)."""
    kernel = int(value.shape[_TOKEN_AXIS])
    outside = _heads_outside_pages(value)
    if outside is None:
        raise KVCacheGroupEditError(
            f"its pages (strides {tuple(value.stride())}) are in no memory order vLLM's KVCacheLayout "
            "makes: neither the pages nor the heads outermost"
        )
    if not outside:
        return _group_kernel_pages(spec, value, kernel)
    heads = int(value.shape[1])
    first = _group_kernel_pages(spec, value[:, 0], kernel, runs_per_block=heads)
    head_stride = int(value.stride(1)) * value.element_size()
    return first.as_strided((heads, *first.shape), (head_stride, *first.stride()), first.storage_offset())


class HeadSlotPagesEdit(KVCacheGroupEdit):
    """Attention whose ``H`` counts the backend's slots, re-viewed as whole pages.

    vLLM 0.33 registers every attention layer as ``[pages, H, N, C]``; a backend that
    packs K and V its own way declares ``num_head_slots`` (:func:`_head_slots`). Read as
    heads of ``K | V`` halves, such a page splits K from V in the wrong place. Its pages
    move whole (their rows are never tokens), between registrations that page alike.
    """

    name = "head-slot-pages"

    def matches(self, spec: Any, value: Any) -> bool:
        return _attention_tensor(spec, value) and _head_slots(spec)

    def apply(self, spec: Any, value: Any, layout_hints: HintsLike = None) -> torch.Tensor:
        return _whole_pages(spec, value)

    def opaque_pages(self, spec: Any, value: Any, layout_hints: HintsLike = None) -> OpaquePages:
        # The spec does not say the backend, and backends of one spec lay a slot out
        # differently: ROCM_ATTN tiles K [H, D/x, N, x] and V [H, D, N] (paged_attn.py
        # split_kv_cache), ROCM_SEGMENTED_ATTN keeps both [N, H, D] (_split_kv_cache), AITER
        # FA's shuffle mode (FLASH_ATTN) its own. A hinted backend is part of the mark. vLLM
        # picks the first two only without a KV connector (supports_kv_connector False).
        backend = LayoutHints.coerce(layout_hints).attn_backend
        rule = self.name if backend is None else f"{self.name} of {backend}"
        return page_layout(rule, spec, value, self.token_axis(value))


def _ring_rows(spec: Any) -> bool:
    """A spec whose rows vLLM addresses itself (``uses_slot_mapping`` False, vLLM 0.33): an
    attention-shaped ring, one block a request (``CircularBufferSpec``, DeepSeek-V4.1's
    compressor state), whose row ``position % block_size`` holds a token: no slot mapping
    puts token ``t`` of a block in row ``t``."""
    return spec_field(spec, "uses_slot_mapping", True) is False


class RingBufferPagesEdit(KVCacheGroupEdit):
    """A ring a request owns one block of (:func:`_ring_rows`), re-viewed as whole pages.

    vLLM 0.33 registers it as any attention layer, ``[pages, H, N, C]``
    (``CircularBufferSpec``: DeepSeek-V4.1's ``CompressorStateCache``, ``H`` = 1, ``N`` the
    ring's capacity, ``C`` its fp32 ``[kv_state | score_state]`` row), but its writer puts
    position ``p`` in row ``p % N`` (``CompressorMetadata.ring_write_slots``: ``block * N +
    p % N``) and nothing there is K or V. Read as a block of tokens of ``K | V`` halves, a
    request's partly filled ring moved its first rows and left the rest. Its pages move
    whole, between registrations that page alike, and between any two TP ranks: vLLM
    computes the ring whole on every rank (``CompressorStateCache`` registers one head,
    ``num_kv_heads=1``, whatever the TP degree, filled from ``DeepseekCompressor``'s
    ``fused_wkv_wgate``, a ``disable_tp=True`` linear), so a page declares its rows as
    one array every rank holds whole (:func:`ring_array`), as an MLA page does. So do
    vLLM 0.33's other rings: GLM5-Next's tail ring (``H`` = 2 slots, K and gate score,
    both from unsharded weights), Qwen4's QSA raw keys (a ``ReplicatedLinear``) and
    Step5's CSA tail ring (its one index K head, every rank's; its page is the rank's
    attention page, so rings of ranks holding other KV heads differ and are refused).
    """

    name = "ring-buffer-pages"

    def matches(self, spec: Any, value: Any) -> bool:
        heads = spec_field(spec, "num_head_slots", None) or spec_field(spec, "num_kv_heads", None)
        return (
            _ring_rows(spec)
            and slots_per_block(spec) is not None
            and isinstance(value, torch.Tensor)
            and value.dim() == 4
            and value.shape[1] == heads
        )

    def apply(self, spec: Any, value: Any, layout_hints: HintsLike = None) -> torch.Tensor:
        return _whole_pages(spec, value)

    def opaque_pages(self, spec: Any, value: Any, layout_hints: HintsLike = None) -> OpaquePages:
        advice = (  # the capacity: the spec's block (whatever pages a kernel cuts it in), or its writer's
            f"a ring (vLLM's CircularBufferSpec) is one block a request, position p in row p % its capacity "
            f"(the block's {slots_per_block(spec)} rows; Step5's CSA tail ring: its page's 1 KiB rows, the "
            "page its rank's attention page), whatever tokens the request holds: map a ring by its block "
            "ids, without num_tokens, and only to a ring alike (the same page, which every TP rank holds "
            "whole)"
        )
        pages = super().opaque_pages(spec, value, layout_hints)
        arrays = () if pages.rows_are_tokens else ring_array(value, slots_per_block(spec))
        return dataclasses.replace(pages, advice=advice, arrays=arrays)


def ring_array(value: torch.Tensor, capacity: int | None) -> tuple[PageArray, ...]:
    """A ring's block (``value`` as vLLM 0.33 registers it, ``[pages, H, N, C]``, kernel
    pages of ``N`` rows that make blocks of ``capacity``) as the one array every TP rank
    holds whole: its kernel pages and each page's ``H`` slots, rows and ``C`` values in
    memory order (``H`` 1: ``(pages, N, C)``; GLM5-Next's tail ring, slots ``[K, gate
    score]`` under BLHNC: ``(pages, H, N, C)``; under BLNHC ``(pages, N, H, C)``), in the
    registered dtype (float32 or bf16: the ring's own, which no MLA page's uint8 bytes
    are, so a ring maps only to a ring). Empty where the pages do not make whole blocks,
    or where a block's slots are not inside its pages (heads outermost), so no array ever
    declares part of a page."""
    rows, heads, width = int(value.shape[_TOKEN_AXIS]), int(value.shape[1]), int(value.shape[-1])
    if capacity is None or rows <= 0 or capacity % rows or value.numel() == 0:
        return ()
    page: tuple[int, ...] = (rows, width)
    if heads > 1:
        if _heads_outside_pages(value) is not False:
            return ()
        order = [d for d in physical_order(value.shape, value.stride()) if d in (1, _TOKEN_AXIS)]
        page = (heads, rows, width) if order[0] == 1 else (rows, heads, width)
    shape = (capacity // rows, *page)
    return (PageArray(0, shape, str(value.dtype).removeprefix("torch."), 0, (shape[0],), replicated=True),)


@dataclasses.dataclass(frozen=True)
class RingKind:
    """How one of vLLM 0.33's ``CircularBufferSpec`` producers registers its ring,
    ``[NB, H, N, C]`` (``get_kv_cache_spec``): what the ring is, the class that makes
    it, its head slots ``H`` (and what they hold), its dtype, and where its page is
    rows of its writer's own (Step5: 1 KiB rows, ``N`` the main block size), their bytes
    and the fewest rows its writer takes; ``pow2_capacity``: where the capacity ``N`` is
    a power of two, its least; ``rows_are``: what ``N`` is."""

    what: str
    producer: str
    slots: int
    holds: str
    dtype: torch.dtype
    row_bytes: int = 0
    min_rows: int = 0
    pow2_capacity: int = 0
    rows_are: str = "its capacity"

    def capacity_error(self, rows: int) -> str | None:
        """Why a ring of ``rows`` rows (its ``N``) is not one of this kind's capacities; None
        where it is."""
        if self.pow2_capacity and (rows < self.pow2_capacity or rows & (rows - 1)):
            return f"axis 2 (N) is {rows}, not a power of two of {self.pow2_capacity} or more"
        return None

    @property
    def registered(self) -> str:
        """The registered shape as ``kvlayout plan`` writes it, with its dtype."""
        return f"[NB,{self.slots},N,C] {_dtype_name(self.dtype)}"


RING_KINDS: dict[str, RingKind] = {
    "deepseek-v4.1": RingKind(
        "DeepSeek-V4.1's compressor state", "CompressorStateCache", 1, "[kv_state | score_state]",
        torch.float32, pow2_capacity=8,
    ),  # compressor.py: float32 asserted, block_size max(8, ...) a power of two
    "glm5-next-tail": RingKind(
        "GLM5-Next's indexer tail ring", "Glm5NextTailCache", 2, "[K, gate score]", torch.bfloat16
    ),  # glm5next/common/attention.py: num_kv_heads=2, dtype=torch.bfloat16
    "qwen4-qsa": RingKind("Qwen4's QSA raw-key ring", "QSAKeyStateCache", 1, "raw keys", torch.bfloat16),
    "step5-csa-tail": RingKind(
        "Step5's CSA tail ring", "Step5CSATailRing", 1, "[index_k | index_z] rows", torch.bfloat16,
        row_bytes=1024, min_rows=7, rows_are="the main block size, its capacity the page's 1 KiB rows",
    ),  # csa_tail_ring.py: the main page in _ROW_BYTES rows, 7 + speculative tokens of them
}  # fmt: skip
"""vLLM 0.33's rings by the name ``kvlayout plan --ring-kind`` takes."""

DEFAULT_RING_KIND = "deepseek-v4.1"
"""The ring a shape declares unless its kind is named (``--ring-kind``): the first that
:func:`declared_ring_pages` read, and the one whose shape no attention registers."""


@dataclasses.dataclass(frozen=True)
class _RingFields:
    """The ``CircularBufferSpec`` of a ring given by its registered shape, as its
    producer's ``get_kv_cache_spec`` fills it (vLLM 0.33): its head slots, its
    capacity the block, its row the head, no V; vLLM computes it no slot mapping."""

    block_size: int
    head_size: int
    dtype: torch.dtype
    num_kv_heads: int = 1
    head_size_v: int = 0
    uses_slot_mapping: bool = False

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


def _ring_shape_error(value: torch.Tensor, kind: RingKind) -> str | None:
    """Why ``value`` is not a ring of ``kind`` as vLLM 0.33 registers it, naming the axis
    (or the dtype); None where it is."""
    if value.dim() != 4:
        return f"a tensor of {value.dim()} dims, not 4"
    rows, width = int(value.shape[_TOKEN_AXIS]), int(value.shape[-1])
    if value.shape[1] != kind.slots:
        return f"axis 1 (H) is {value.shape[1]}, not {kind.slots}"
    if value.dtype != kind.dtype:
        return f"its dtype is {_dtype_name(value.dtype)}, not {_dtype_name(kind.dtype)}"
    if (capacity := kind.capacity_error(rows)) is not None:
        return capacity
    page = rows * width * value.element_size()
    if kind.row_bytes and (page % kind.row_bytes or page // kind.row_bytes < kind.min_rows):
        return (
            f"axis 3 (C) is {width}: N x C is {page} bytes, not {kind.min_rows} or more rows of "
            f"{kind.row_bytes} bytes (the page is its rank's attention page)"
        )
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def declared_ring_pages(
    value: torch.Tensor, layout_hints: HintsLike = None, kind: str = DEFAULT_RING_KIND
) -> torch.Tensor:
    """A ring as vLLM 0.33 registers it (``value``: ``[NB, H, N, C]``, a
    :data:`RING_KINDS` ``kind``: DeepSeek-V4.1's ``CompressorStateCache`` by default)
    re-viewed and marked as :class:`RingBufferPagesEdit` does for the
    ``CircularBufferSpec`` of its shape, where there is no spec to read (``kvlayout
    plan``'s ring sides, given on the command line): its head slots, its capacity ``N``,
    its row ``C`` values of its dtype. A tensor that is not such a ring (an axis or a
    dtype the kind's producer does not register) raises :class:`KVCacheGroupEditError`
    naming the axis; a ``kind`` not in :data:`RING_KINDS` raises it naming the kinds."""
    if kind not in RING_KINDS:
        raise KVCacheGroupEditError(f"no vLLM 0.33 ring kind {kind!r}: one of {', '.join(RING_KINDS)}")
    ring = RING_KINDS[kind]
    why = _ring_shape_error(value, ring)
    if why is not None:
        raise KVCacheGroupEditError(
            f"{ring.what} (vLLM's CircularBufferSpec, {ring.producer}) registers as {ring.registered} (H its "
            f"head slots, {ring.holds}; N {ring.rows_are}; C its row), not {_dtype_name(value.dtype)} "
            f"{list(value.shape)}: {why}"
        )
    spec = _RingFields(int(value.shape[_TOKEN_AXIS]), int(value.shape[-1]), value.dtype, ring.slots)
    edit = RingBufferPagesEdit()
    view = edit.apply(spec, value, layout_hints)
    mark_opaque_pages(view, edit.opaque_pages(spec, value, layout_hints), [value])
    return view


class CPUAttentionPagesEdit(KVCacheGroupEdit):
    """vLLM's CPU platform's attention (``CPU_ATTN``), re-viewed as whole pages.

    vLLM 0.33 registers it as ``[pages, H, N, 2*hs]`` in ``LBHNC`` order, but the kernel
    views a page as ``[H, 2N, hs]``: a head's K rows for all N tokens, then its V rows, each
    packed in the ISA kernel's own tiles (AMX prepacks them). Read as tokens of ``K | V``
    halves, every token's bytes would be wrong. Its pages move whole, only to caches paged
    alike. The spec does not say the backend, so the rule asks the layout hints:
    ``attn_backend='CPU_ATTN'``, or tensors on the CPU with neither ``attn_backend`` nor
    ``kv_layout`` (vLLM's CPU platform always uses CPU_ATTN), as detection reads them.
    MLA on the CPU (latents) is not this rule's.
    """

    name = "cpu-attn-pages"

    def matches(self, spec: Any, value: Any) -> bool:
        return False  # only the layout hints say the backend (matches_with_hints)

    def matches_with_hints(self, spec: Any, value: Any, layout_hints: HintsLike = None) -> bool:
        try:
            if not (_attention_tensor(spec, value) and reads_cpu_attention(value.device, layout_hints)):
                return False
            hinted = LayoutHints.coerce(layout_hints).attn_backend is not None
        except (KVLayoutError, TypeError):
            return False  # bad hints: detection says what is wrong with them
        # by the CPU default, only pages CPU_ATTN allocates (each block's heads one run,
        # LBHNC or BLHNC); BHLNC views are the cross-layer tensor detection reads them as
        return hinted or (value.shape[0] > 0 and bool(value[0].is_contiguous()))

    def apply(self, spec: Any, value: Any, layout_hints: HintsLike = None) -> torch.Tensor:
        if _heads_outside_pages(value) is not False:
            raise KVCacheGroupEditError(
                f"read as vLLM's CPU_ATTN, its pages (strides {tuple(value.stride())}) do not hold every "
                "head inside each block, as CPU_ATTN allocates them (LBHNC)"
            )
        return _whole_pages(spec, value)

    def opaque_pages(self, spec: Any, value: Any, layout_hints: HintsLike = None) -> OpaquePages:
        return cpu_attention_pages(value, layout_hints)


class PackedHeadRowsEdit(KVCacheGroupEdit):
    """Attention whose heads' rows are not ``K | V`` of one head size (:func:`_packed_heads`),
    re-viewed as pages: read as two equal halves, K and V (and their scales) would split
    in the wrong place. Its pages move between registrations that page alike; where
    tokens are outermost in a page, its rows are tokens (a request's last block moves
    only its tokens)."""

    name = "packed-head-rows"

    def matches(self, spec: Any, value: Any) -> bool:
        return _attention_tensor(spec, value) and _packed_heads(spec) and not _head_slots(spec)

    def apply(self, spec: Any, value: Any, layout_hints: HintsLike = None) -> torch.Tensor:
        return _whole_pages(spec, value)

    def token_axis(self, value: Any) -> int | None:
        return _TOKEN_AXIS


def _attention_tensor(spec: Any, value: Any) -> bool:
    """vLLM 0.33's attention view ``[pages, H, N, C]``, ``H`` the spec's head slots or
    heads (the releases that declare slots or ``head_size_v`` register no other form)."""
    heads = spec_field(spec, "num_head_slots", None) or spec_field(spec, "num_kv_heads", None)
    return (
        spec_kind(spec) in PAGED_ATTENTION_KINDS
        and slots_per_block(spec) is not None
        and isinstance(value, torch.Tensor)
        and value.dim() == 4
        and value.shape[1] == heads
    )


class SubpagedAttentionEdit(KVCacheGroupEdit):
    """Attention re-paged at the backend's kernel block size (k kernel pages per block).

    Backends with fixed kernel sizes (FlashInfer 16/32/64) page a larger block finer:
    a hybrid's inflated block (Qwen3.5: hundreds of tokens), or any model's
    ``--block-size 128``. Registered raw, the tensor's block size would read as the
    kernel's and the group would look slot-compressed. A declared compression is kept:
    the block is ``block_size / ratio`` slots, in the same k pages.
    """

    name = "subpaged-attention"
    lmcache_name = "subpaged-attention-view"

    def matches(self, spec: Any, value: Any) -> bool:
        return (
            spec_kind(spec) in PAGED_ATTENTION_KINDS
            and slots_per_block(spec) is not None
            and isinstance(value, torch.Tensor)
            and value.dim() in (4, 5)
            and value.shape[_TOKEN_AXIS] != slots_per_block(spec)
        )

    def apply(self, spec: Any, value: Any, layout_hints: HintsLike = None) -> torch.Tensor:
        if value.dim() == 4:  # 0.33's [pages, H, N, C], heads inside or outside the pages
            return _whole_pages(spec, value)
        return _group_kernel_pages(spec, value, int(value.shape[_TOKEN_AXIS]))

    def token_axis(self, value: Any) -> int | None:
        return _TOKEN_AXIS

    def block_view(self, spec: Any, value: Any) -> torch.Tensor | None:
        # 0.33's [pages, H, N, C] (rank 5 is an older FlashInfer or FlashAttention page,
        # whose K/V axis is outside its tokens)
        return _token_major_blocks(spec, value, _TOKEN_AXIS) if value.dim() == 4 else None

    def opaque_pages(self, spec: Any, value: Any, layout_hints: HintsLike = None) -> OpaquePages:
        pages = super().opaque_pages(spec, value, layout_hints)
        heads = _kernel_head_pages(spec, value)
        return dataclasses.replace(pages, arrays=heads) if heads and not pages.arrays else pages


def _kernel_head_pages(spec: Any, value: Any) -> tuple[PageArray, ...]:
    """0.33's ``[pages, H, N, C]`` in HND memory (every head inside a page, its ``N`` token
    rows a run: LBHNC, what vLLM's NixlConnector asks of a model without MLA), a block
    ``k`` such kernel pages: declared as an array of the model's KV heads ``(k, H, N, C)``
    (:func:`~kvlayout.registration.opaque.head_pages`), so that the block reads as its
    kernel pages between ranks of other TP degrees, as vLLM's connector slices each kernel
    page by heads. Empty for other orders (NHD pages are whole blocks already) or dtypes
    no array names."""
    if value.dim() != 4 or _head_slots(spec) or _packed_heads(spec):
        return ()
    order = [d for d in physical_order(value.shape, value.stride()) if value.shape[d] != 1]
    slots, dtype = slots_per_block(spec), str(value.dtype).removeprefix("torch.")
    if order != [0, 1, 2, 3] or dtype not in DTYPE_SIZES or not slots or slots % int(value.shape[2]):
        return ()
    k, heads, tokens, row = slots // int(value.shape[2]), *(int(n) for n in value.shape[1:])
    return (PageArray(0, (k, heads, tokens, row), dtype, 1, (heads,), kv_heads=True),)


def _mla_kernel_states(value: torch.Tensor) -> int | None:
    # MLA keeps one latent row per slot (per token, uncompressed): ``[pages, N, C]`` before
    # 0.26, ``[pages, 1, N, C]`` in 0.33 (one head slot; some releases put it after N).
    # Anything else is not an MLA registration this rule knows.
    if value.dim() == 3:
        return int(value.shape[1])
    if value.dim() == 4 and 1 in (value.shape[1], value.shape[2]):
        return int(value.shape[1] * value.shape[2])
    return None


def _mla_kernel_pages(spec: Any, value: Any) -> int | None:
    """How many of the registered kernel pages make one block (what the rules' views
    join into a page), None where they do not divide it."""
    states, slots = _mla_kernel_states(value), slots_per_block(spec)
    if states is None or slots is None or states <= 0 or slots % states:
        return None
    return slots // states


# DeepSeek-V4's record width: vLLM tells its records apart by the width the spec
# publishes (``models/deepseek_v41/common/ops/cache_utils.py``), and only V4's 584-byte
# record splits a page into a data region and a scale region.
_PAGED_SCALE_RECORD_BYTES = 584


def _paged_scale_latents(spec: Any) -> bool:
    """DeepSeek-V4's packed MLA caches (``model_version='deepseek_v4'``, 584-byte
    ``state_content_bytes`` records: 448 fp8 NoPE, 128 bf16 RoPE, 8 scale bytes; its main,
    compressed and sliding-window caches): the page holds every slot's 576 data bytes,
    then every slot's scales, so the registered ``[pages, 1, N, 584]`` rows are no slots.
    V4.1's 528- and 288-byte records (the same ``model_version``) and DeepSeek-V3.2's
    656-byte ones keep each token's record whole, its scales after its data: not this."""
    return (
        spec_kind(spec) in MLA_KINDS
        and spec_field(spec, "state_content_bytes", None) == _PAGED_SCALE_RECORD_BYTES
        and spec_field(spec, "model_version", None) == "deepseek_v4"
    )


class PagedScaleMLAEdit(KVCacheGroupEdit):
    """DeepSeek-V4's packed MLA pages (:func:`_paged_scale_latents`), re-viewed as whole
    pages: read as the latent rows they are registered as, a request's last, partly filled
    block moved its first rows, which are not its tokens' records, and left their scales
    behind. Its pages move whole, between registrations that page alike (kernel-paged,
    ``k`` kernel pages a block as :class:`SubpagedMLAEdit` counts them)."""

    name = "paged-scale-mla"

    def matches(self, spec: Any, value: Any) -> bool:
        return (
            _paged_scale_latents(spec)
            and slots_per_block(spec) is not None
            and isinstance(value, torch.Tensor)
            and _mla_kernel_states(value) is not None
        )

    def opaque_pages(self, spec: Any, value: Any, layout_hints: HintsLike = None) -> OpaquePages:
        return page_layout(self.name, spec, value, None, kernel_pages=_mla_kernel_pages(spec, value))

    def apply(self, spec: Any, value: Any, layout_hints: HintsLike = None) -> torch.Tensor:
        states, slots = _mla_kernel_states(value), slots_per_block(spec)
        assert states is not None and slots is not None  # matches() said so
        if states != slots:
            return _group_kernel_pages(spec, value, states)
        # One page a block: its records and scales, up to the page's alignment padding
        # (vLLM pads the block stride, not the registered rows).
        runs = page_runs(value)
        page = require_size(spec, "page_size_bytes")
        if runs.page_bytes > page or runs.page_bytes % slots:
            raise KVCacheGroupEditError(
                f"its registered page of {runs.page_bytes} bytes is not {slots} records within the spec's "
                f"{page}-byte page"
            )
        return opaque_page_view(
            value,
            num_blocks=runs.num_pages,
            block_size=slots,
            page_bytes=runs.page_bytes,
            block_stride_bytes=runs.stride_bytes,
            offset_bytes=runs.offset_bytes,
        )


class SubpagedMLAEdit(KVCacheGroupEdit):
    """MLA re-paged at a kernel block size (e.g. a 768-token block in 64-token pages).

    Compressed MLA caches (DeepSeek-V4's indexer: ``tokens_per_state=4``) are paged the
    same way: a 512-token block of 128 slots in two 256-token kernel pages of 64 slots.
    """

    name = "subpaged-mla-attention"
    lmcache_name = "subpaged-mla-attention-view"

    def matches(self, spec: Any, value: Any) -> bool:
        if spec_kind(spec) not in MLA_KINDS:
            return False
        slots = slots_per_block(spec)
        if slots is None or not isinstance(value, torch.Tensor):
            return False
        states = _mla_kernel_states(value)
        return states is not None and states != slots

    def apply(self, spec: Any, value: Any, layout_hints: HintsLike = None) -> torch.Tensor:
        states = _mla_kernel_states(value)
        assert states is not None  # matches() said so
        return _group_kernel_pages(spec, value, states)

    def token_axis(self, value: Any) -> int | None:
        if _blocked_scale_pages(value):
            return None  # a page's values, then its scales: a row is no token's
        # ``[pages, N, C]``, ``[pages, 1, N, C]`` or ``[pages, N, 1, C]``
        return 2 if value.dim() == 4 and value.shape[1] == 1 else 1

    def block_view(self, spec: Any, value: Any) -> torch.Tensor | None:
        return _token_major_blocks(spec, value, self.token_axis(value))

    def opaque_pages(self, spec: Any, value: Any, layout_hints: HintsLike = None) -> OpaquePages:
        # an indexer written on ROCm tiles each kernel page its own way (the detector says how)
        fmt, k = indexer_format(value), _mla_kernel_pages(spec, value)
        rocm = None if fmt is None else rocm_indexer_pages(value, fmt, layout_hints, kernel_pages=k or 1)
        if rocm is not None:
            return rocm
        return page_layout(self.name, spec, value, self.token_axis(value), kernel_pages=k)


def _blocked_scale_pages(value: torch.Tensor) -> bool:
    """Whether vLLM's detector reads the kernel pages as blocked-scale pages (the DSA
    indexer's: every token's values, then every token's scales), asked of the detector
    so the page format's facts stay in one place."""
    return indexer_format(value) is not None
