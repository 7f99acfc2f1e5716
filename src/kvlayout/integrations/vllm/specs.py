"""Reading vLLM KV cache spec objects structurally, without importing vLLM.

vLLM is optional for kvlayout users, and its spec classes move between releases
(0.33 renamed ``MLAAttentionSpec.compress_ratio`` to ``tokens_per_state`` and dropped
``TQFullAttentionSpec``). So a spec's kind is read from the class names in its MRO,
the way ``vllm.v1.kv_cache_interface.get_kv_cache_spec_kind`` orders them, and every
optional field through ``getattr`` with the default older releases imply.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from kvlayout.integrations.vllm.errors import KVCacheGroupEditError

__all__ = [
    "INDEXER_CACHE_ROLE",
    "MLA_KINDS",
    "PAGED_ATTENTION_KINDS",
    "SpecKind",
    "allocations",
    "declares_indexer",
    "declares_slot_compression",
    "iter_group_layer_specs",
    "iter_groups",
    "require_layer_dict",
    "require_size",
    "slots_per_block",
    "spec_field",
    "spec_kind",
    "spec_size",
    "tokens_per_slot",
]


class SpecKind(str, enum.Enum):
    """The kind of a leaf spec; values are those of vLLM's ``KVCacheSpecKind``."""

    FULL_ATTENTION = "full_attention"
    MLA_ATTENTION = "mla_attention"
    SLIDING_WINDOW = "sliding_window"
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    MAMBA = "mamba"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    SINK_FULL_ATTENTION = "sink_full_attention"
    ENCODER_ONLY_ATTENTION = "encoder_only_attention"
    CROSS_ATTENTION = "cross_attention"
    UNKNOWN = "unknown"


PAGED_ATTENTION_KINDS = frozenset(
    {
        SpecKind.FULL_ATTENTION,
        SpecKind.SLIDING_WINDOW,
        SpecKind.CHUNKED_LOCAL_ATTENTION,
        SpecKind.SINK_FULL_ATTENTION,
    }
)
"""Paged attention that is not MLA: layers of heads of K | V (or a backend's head slots),
which vLLM 0.33 registers as ``[pages, H, N, C]``."""

MLA_KINDS = frozenset({SpecKind.MLA_ATTENTION, SpecKind.SLIDING_WINDOW_MLA})
"""MLA: one head (the latents, or a DSA indexer's key) that every TP rank holds whole."""

# Subclasses before their bases (SlidingWindowMLASpec is a SlidingWindowSpec, MLA and
# sink specs are FullAttentionSpecs), as vLLM's get_kv_cache_spec_kind checks them.
_KIND_BY_CLASS_NAME: tuple[tuple[str, SpecKind], ...] = (
    ("SlidingWindowMLASpec", SpecKind.SLIDING_WINDOW_MLA),
    ("MLAAttentionSpec", SpecKind.MLA_ATTENTION),
    ("SinkFullAttentionSpec", SpecKind.SINK_FULL_ATTENTION),
    ("FullAttentionSpec", SpecKind.FULL_ATTENTION),
    ("ChunkedLocalAttentionSpec", SpecKind.CHUNKED_LOCAL_ATTENTION),
    ("SlidingWindowSpec", SpecKind.SLIDING_WINDOW),
    ("MambaSpec", SpecKind.MAMBA),
    ("EncoderOnlyAttentionSpec", SpecKind.ENCODER_ONLY_ATTENTION),
    ("CrossAttentionSpec", SpecKind.CROSS_ATTENTION),
)


def spec_kind(spec: Any) -> SpecKind:
    """The kind of one leaf spec (never a ``UniformTypeKVCacheSpecs`` wrapper)."""
    names = {cls.__name__ for cls in type(spec).__mro__}
    for class_name, kind in _KIND_BY_CLASS_NAME:
        if class_name in names:
            return kind
    return SpecKind.UNKNOWN


INDEXER_CACHE_ROLE = "indexer"
"""vLLM 0.33's ``SparseCacheRole.INDEXER`` (a str enum: its value compares equal), the
``cache_role`` of an MLA spec that holds a sparse-attention indexer's keys."""


def declares_indexer(spec: Any) -> bool:
    """Whether a spec says it holds an indexer's keys (``cache_role`` INDEXER: DeepSeek-V3.2's
    ``DeepseekV32IndexerCache``, MiniMax-M3's indexer). False says nothing: DeepSeek-V4's and
    V4.1's ``DeepseekV4IndexerCache`` keep the default role (``SPARSE``), and releases before
    0.33 have no field, so only the registered rows tell their indexer from latents."""
    return bool(spec_field(spec, "cache_role", None) == INDEXER_CACHE_ROLE)


def declares_slot_compression(spec: Any) -> bool:
    """Whether a spec declares that it stores fewer slots than tokens.

    0.33 says so with ``tokens_per_state > 1`` (DeepSeek-V4 slot packing); older
    releases with ``MLAAttentionSpec.compress_ratio > 1`` or
    ``TQFullAttentionSpec.tq_slot_size > 0``. ``> 1``, not ``!= 1``: ``MambaSpec``
    defaults ``tokens_per_state`` to -1 and Whisper's pooling uses fractions below 1.
    """
    return bool(
        spec_field(spec, "tokens_per_state", 1) > 1
        or spec_field(spec, "compress_ratio", 1) > 1
        or spec_field(spec, "tq_slot_size", 0) > 0
    )


def _whole(value: Any) -> int | None:
    """``value`` as an int when it is a whole number (an int, or a Fraction like 4/1)."""
    if isinstance(value, bool):
        return None
    try:
        whole = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return whole if whole == value else None


def tokens_per_slot(spec: Any) -> int | None:
    """How many tokens one registered slot holds: the declared compression ratio
    (``tokens_per_state`` in 0.33, ``compress_ratio`` before 0.26), 1 without one.

    ``None`` where the spec's slots are no whole number of tokens, so a block has no
    slot count to check: Whisper's pooled fractions, a ratio that is not an int, and the
    pre-0.26 ``tq_slot_size`` packing (bytes per slot, in a registration kvlayout does
    not re-view). A Mamba page in align mode counts as ``block_size`` rows (its ``-1``
    means one state per block, and the edits cut the page into that many rows); in any
    other mode ('none', or none named, as before vLLM had the field) it is one slot of
    the whole block (vLLM sets that block to the longest request: one running state per
    request), so its page is one row.
    """
    if spec_kind(spec) is SpecKind.MAMBA:
        block_size = spec_size(spec, "block_size")
        snapshots = spec_field(spec, "mamba_cache_mode", None) in ("align", "all")
        return block_size if not snapshots and block_size is not None else 1
    if spec_field(spec, "tq_slot_size", 0) != 0:
        return None  # pre-0.26 TurboQuant packs bytes per slot in a registration not re-viewed
    per_state = _whole(spec_field(spec, "tokens_per_state", 1))
    ratio = _whole(spec_field(spec, "compress_ratio", 1))
    if per_state is None or ratio is None or per_state < 1 or ratio < 1:
        return None
    if per_state > 1 and ratio > 1 and per_state != ratio:
        return None  # two ratios that disagree: no slot count to trust
    return max(per_state, ratio)


def slots_per_block(spec: Any) -> int | None:
    """Slots one block id's page holds: ``block_size // tokens_per_slot`` (vLLM's
    ``num_states``); ``None`` where :func:`tokens_per_slot` is, or where that is not a
    positive count.

    This, not ``block_size``, is the registered block's size: kernel paging splits the
    slots of a block into pages, compression only makes them fewer.
    """
    block_size, ratio = spec_size(spec, "block_size"), tokens_per_slot(spec)
    if block_size is None or ratio is None or block_size < ratio:
        return None
    return block_size // ratio


def spec_field(spec: Any, name: str, default: Any) -> Any:
    """An optional spec field, or ``default`` where this vLLM release lacks it.

    ``KVCacheSpec`` declares some fields as properties that raise
    ``NotImplementedError`` in the base class (``tokens_per_state``), so absence is more
    than ``AttributeError``; ``None`` also means "not set".
    """
    try:
        value = getattr(spec, name)
    except (AttributeError, NotImplementedError):
        return default
    return default if value is None else value


def iter_groups(kv_cache_config: Any) -> Iterator[tuple[int, Any]]:
    """``(position, group)`` for every KV cache group vLLM transfers; the position is the
    group id. A group vLLM keeps out of transfer (``enable_kv_transfer=False``, vLLM
    0.33: HiSparse's device replicas, rebuilt from their source group after a load) is
    skipped: nothing validates, edits or reads it."""
    if not hasattr(kv_cache_config, "kv_cache_groups"):  # a vllm_config, say: it would edit nothing
        raise TypeError(
            "kv_cache_config must be vLLM's KVCacheConfig (its kv_cache_groups), not a "
            f"{type(kv_cache_config).__name__}"
        )
    groups = kv_cache_config.kv_cache_groups or ()
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Iterable):
        raise TypeError(f"kv_cache_config.kv_cache_groups is a {type(groups).__name__}, not a list of groups")
    for position, group in enumerate(groups):
        if getattr(group, "enable_kv_transfer", True) is not False:
            yield position, group


def require_layer_dict(kv_caches: object) -> None:
    """A ``TypeError`` unless ``kv_caches`` maps layer names to values: layers are found by
    name, so a list of the tensors would find none and leave every layer unchecked."""
    if not isinstance(kv_caches, Mapping):
        raise TypeError(
            "kv_caches must be the dict register_kv_caches gets, by layer name, not a "
            f"{type(kv_caches).__name__}"
        )


def iter_group_layer_specs(group: Any) -> Iterator[tuple[str | None, Any]]:
    """``(layer_name, leaf_spec)`` for a group, unwrapping ``UniformTypeKVCacheSpecs``.

    The wrapper keeps one spec per layer in ``kv_cache_specs``; any other group spec
    describes all of the group's layers. A group without ``layer_names`` (a duck-typed
    config) yields its spec once, with the name None, so it is still checked; a group
    without a spec yields nothing (validation reports it).
    """
    spec = getattr(group, "kv_cache_spec", None)
    if spec is None:
        return
    per_layer = getattr(spec, "kv_cache_specs", None)
    if isinstance(per_layer, Mapping):
        yield from per_layer.items()
        return
    names = getattr(group, "layer_names", None)
    if names is None or isinstance(names, (str, bytes)):
        yield None, spec
        return
    for layer_name in names:
        yield layer_name, spec


def spec_size(spec: Any, name: str) -> int | None:
    """A spec's positive int field (``block_size``, ``page_size_bytes``), or None where
    the spec lacks it or it is not a positive int."""
    value = spec_field(spec, name, None)
    if isinstance(value, bool):
        return None
    try:
        size = operator.index(value)
    except TypeError:
        return None
    return size if size > 0 else None


def require_size(spec: Any, name: str) -> int:
    """:func:`spec_size`, or a :class:`KVCacheGroupEditError` naming the field."""
    size = spec_size(spec, name)
    if size is None:
        raise KVCacheGroupEditError(
            f"{type(spec).__name__} has {name}={spec_field(spec, name, None)!r}; a KV cache spec needs "
            f"a positive int {name}"
        )
    return size


def allocations(kv_cache_config: Any) -> list[tuple[str, ...]]:
    """Each of vLLM's allocations (a ``KVCacheTensor``) as its layer names, in its order;
    none where the config keeps no such records (0.33's ``layers``; older releases list
    ``shared_by`` across groups instead, which say nothing of a layer's place)."""
    tensors = getattr(kv_cache_config, "kv_cache_tensors", None) or ()
    return [tuple(getattr(t, "layers", None) or ()) for t in tensors]
