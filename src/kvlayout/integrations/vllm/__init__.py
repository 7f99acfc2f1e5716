"""vLLM integration: start-up validation and KV cache group edits, for every vLLM model.

Call :func:`validate_kv_cache_groups` when the connector starts, and
:func:`apply_kv_cache_group_edits` on the dict vLLM hands to ``register_kv_caches``,
before detection; give detection and transfer the edited dict. vLLM itself is not
imported: spec objects are read structurally, so any vLLM release (or a duck-typed
stand-in) works, and kvlayout does not depend on vLLM.

Why edits: kvlayout reads a group's block size from the registered tensors, while
vLLM's scheduler hands out block ids in units of the spec's ``block_size``. Two things
break that: a Mamba layer registers state that is not a paged KV (a ``[conv, ssm]``
list before vLLM 0.26, one int8 state row per block since), and attention backends
with fixed kernel sizes page a block finer, in any model (Qwen3.5-0.8B's hybrid block
544 = 17 FlashInfer pages of 32; Llama's ``--block-size 128`` = 2 pages of 64), which
would read as slot compression; and some attention pages are not heads of equal K and V
halves at all (backends that declare head slots, B12X and ROCm's; models whose V head
differs from K's), which would read as heads split in the wrong place; and a ring vLLM
addresses itself (``CircularBufferSpec``, DeepSeek-V4.1's compressor state: position
``p`` in row ``p % N``, no K or V) would read as tokens of K | V. Unlike LMCache,
which edits only hybrids, every model goes through the rules and the check. Where a
block's kernel pages are its tokens in order (NHD attention pages, MLA latents) the
edit views the layer as its blocks, in its own dtype, which detection reads as the
engine's format at the spec's block size. Every other edit re-views its layer as
``[num_blocks, slots, page_bytes // slots]`` int8 over the same storage (``slots`` is
``block_size``, or ``block_size / ratio`` for declared compression), which detection
reads as ``NL_X_NB_BS_HS`` with that block size under any ``kv_layout`` hint. An MLA
spec's one-head latents ``[NB, 1, BS, C]`` (a one-head fused K | V cache's shape) come
back as ``[NB, BS, C]``, as vLLM's ``bind_kv_cache`` views them, so they read as latents
without ``kv_dim=1``; hints a group's spec contradicts are refused.

The opaque-page contract. An opaque view's dims are addressing only: block ``b`` of
the view is exactly the bytes of block id ``b``'s page (padding included), and its rows
are the page cut into ``block_size`` equal byte runs. They are not tokens, heads or K/V:
a Mamba page is conv | ssm | padding, and a sub-paged HND attention block interleaves
heads per kernel page. So:

- valid: storing and retrieving blocks through kvlayout's transfer on the same engine
  configuration (store and load use the same block-id -> bytes mapping, so every byte
  round-trips);
- not valid on edited groups: anything that reads the content (compression or other
  serde, blending, per-head resharding, layout conversion, K-only reads), and sharing
  stored blocks with an engine whose backend, kernel block size, page size, dtypes or
  TP differ (the byte order inside a page depends on them); but a Mamba page whose
  spec says how TP splits its states is marked with them (``states``), and a block map
  moves it between TP degrees.

Invariants, enforced when the edits run: edits are views of the registered storage
(no copy); k kernel pages become one block only when they are one contiguous run of
exactly the spec's ``page_size_bytes``, otherwise :class:`KVCacheGroupEditError`
names the layer, the group and the byte counts; every edited view's block size is its
group's slots per block; specs that declare slot compression (``tokens_per_state > 1``,
``compress_ratio > 1``) keep it, their kernel pages grouped into ``block_size / ratio``
slots; ``tq_slot_size > 0`` packing is never edited. See ``docs/vllm-group-edits.md``.
"""

from __future__ import annotations

from kvlayout.integrations.vllm.edits import (
    KV_CACHE_GROUP_EDITS,
    apply_kv_cache_group_edits,
    find_kv_cache_group_edit,
    transfer_layers,
)
from kvlayout.integrations.vllm.errors import (
    GroupProblem,
    KVCacheGroupEditError,
    UnsupportedKVCacheGroupsError,
)
from kvlayout.integrations.vllm.granularity import BlockGranularityError, check_block_granularity
from kvlayout.integrations.vllm.pages import OPAQUE_PAGE_DTYPE, OPAQUE_PAGE_FORMAT
from kvlayout.integrations.vllm.rules import (
    CPUAttentionPagesEdit,
    HeadSlotPagesEdit,
    KVCacheGroupEdit,
    MambaStateListEdit,
    MambaStateRowsEdit,
    PackedHeadRowsEdit,
    PagedScaleMLAEdit,
    RingBufferPagesEdit,
    SubpagedAttentionEdit,
    SubpagedMLAEdit,
)
from kvlayout.integrations.vllm.specs import SpecKind, declares_slot_compression, spec_kind
from kvlayout.integrations.vllm.validation import (
    find_kv_cache_groups_out_of_offloading,
    find_kv_cache_groups_out_of_prefix_reuse,
    find_unsupported_kv_cache_groups,
    validate_kv_cache_groups,
)

__all__ = [
    "KV_CACHE_GROUP_EDITS",
    "OPAQUE_PAGE_DTYPE",
    "OPAQUE_PAGE_FORMAT",
    "BlockGranularityError",
    "CPUAttentionPagesEdit",
    "GroupProblem",
    "HeadSlotPagesEdit",
    "KVCacheGroupEdit",
    "KVCacheGroupEditError",
    "MambaStateListEdit",
    "MambaStateRowsEdit",
    "PackedHeadRowsEdit",
    "PagedScaleMLAEdit",
    "RingBufferPagesEdit",
    "SpecKind",
    "SubpagedAttentionEdit",
    "SubpagedMLAEdit",
    "UnsupportedKVCacheGroupsError",
    "apply_kv_cache_group_edits",
    "check_block_granularity",
    "declares_slot_compression",
    "find_kv_cache_group_edit",
    "find_kv_cache_groups_out_of_offloading",
    "find_kv_cache_groups_out_of_prefix_reuse",
    "find_unsupported_kv_cache_groups",
    "spec_kind",
    "transfer_layers",
    "validate_kv_cache_groups",
]
