"""vLLM registrations built the way vLLM allocates them, for demos and tests (on the CPU).

Specs, configs and the 0.33 per-layer views come from vLLM's own classes and functions
(``vllm.v1.kv_cache_interface``: the spec classes, ``compute_layout_strides``,
``create_kv_cache_views``). The parts of vLLM that need its full dependency set (model
classes, platform, worker) are mirrored here in a few lines each, with the source they
follow: hybrid block sizing (``Platform._align_hybrid_block_size``), kernel block
selection (``select_common_block_size``), grouping
(``_get_kv_cache_groups_uniform_page_size``), the config's tensors
(``get_kv_cache_config_from_groups``), allocation (``allocate_kv_cache``), cross-layer KV
sharing (``add_kv_sharing_layers_to_kv_cache_groups`` and ``initialize_kv_cache_tensors``),
and the pre-0.26 registrations (``_reshape_kv_cache_tensors``, the Mamba ``as_strided``
lists).

This module needs vLLM (0.33; installed without its dependencies is enough) and raises
``ImportError`` saying so without it; only ``kvlayout demo`` imports it (for its hybrid).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlayout.errors import at_least

__all__ = [
    "DSV4_INDEXER",
    "FLASHINFER",
    "FLASHMLA",
    "FLASH_ATTN",
    "LLAMA_3_2_1B",
    "NUM_BLOCKS",
    "QWEN3_5_0_8B",
    "QWEN3_NEXT_80B_A3B",
    "AttentionModel",
    "Backend",
    "Engine",
    "HybridModel",
    "KVCacheLayout",
    "MultipleOf",
    "allocate",
    "allocate_legacy",
    "allocate_v033",
    "attention_engine",
    "attention_spec",
    "block_stride_alignment",
    "cdiv",
    "detect_registered",
    "dsv4_indexer_spec",
    "dsv4_latent_spec",
    "fill_random",
    "gdn_states",
    "group_layers",
    "hints",
    "hybrid_block_size",
    "hybrid_engine",
    "kvi",
    "legacy_attention",
    "legacy_mamba_states",
    "make_engine",
    "mla_hybrid_engine",
    "page_region",
    "planned_engine",
    "share_kv_caches",
    "state_hybrid_engine",
    "uniform_engine",
]

try:
    # Imported by name, so type checking does not walk vLLM: its objects are used as Any.
    kvi: Any = importlib.import_module("vllm.v1.kv_cache_interface")
    KVCacheLayout: Any = importlib.import_module("vllm.v1.kv_cache_layout").KVCacheLayout
except ImportError as e:
    raise ImportError(
        "kvlayout.testing.vllm needs vllm (pip install --no-deps vllm==0.33.0 numpy packaging regex)"
    ) from e

NUM_BLOCKS = 4


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- model configs (the public HF configs' numbers) -----------------------------------


@dataclass(frozen=True)
class HybridModel:
    """A Gated-DeltaNet + full-attention model (Qwen3.5 / Qwen3-Next text config)."""

    name: str
    num_hidden_layers: int
    full_attention_interval: int  # layer i is full attention when (i + 1) % interval == 0
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    dtype: torch.dtype
    mamba_ssm_dtype: torch.dtype

    def is_full_attention(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval == 0

    def layer_name(self, layer: int) -> str:
        kind = "self_attn.attn" if self.is_full_attention(layer) else "linear_attn"
        return f"model.layers.{layer}.{kind}"


QWEN3_5_0_8B = HybridModel("Qwen3.5-0.8B", 24, 4, 2, 256, 16, 16, 128, 128, 4, torch.bfloat16, torch.float32)
# Qwen3-Next has no mamba_ssm_dtype, so vLLM keeps the ssm state in the model dtype.
QWEN3_NEXT_80B_A3B = HybridModel(
    "Qwen3-Next-80B-A3B", 48, 4, 2, 256, 16, 32, 128, 128, 4, torch.bfloat16, torch.bfloat16
)


@dataclass(frozen=True)
class AttentionModel:
    name: str
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    dtype: torch.dtype


LLAMA_3_2_1B = AttentionModel("Llama-3.2-1B", 16, 8, 64, torch.bfloat16)


# -- attention backends (0.33 ``get_supported_kernel_block_sizes``) -------------------


@dataclass(frozen=True)
class MultipleOf:
    """vLLM's ``MultipleOf`` (``vllm/v1/attention/backend.py``, a module that imports the
    model executor, which vLLM installed without its dependencies cannot): a kernel block
    size of any multiple of ``base`` tokens, or as a spec's ``block_stride_alignment``,
    blocks that hold whole kernel blocks of up to ``base`` tokens."""

    base: int

    def __repr__(self) -> str:
        return f"MultipleOf({self.base})"


@dataclass(frozen=True)
class Backend:
    name: str
    fixed_sizes: tuple[int, ...] = ()  # plain ints: exact kernel block sizes
    multiple_of: int | None = None  # MultipleOf(n)

    @property
    def smallest_base(self) -> int:
        return min([*self.fixed_sizes, *([self.multiple_of] if self.multiple_of else [])])

    def accepts(self, block_size: int) -> bool:
        return block_size in self.fixed_sizes or bool(self.multiple_of and block_size % self.multiple_of == 0)

    def kernel_block_size(self, block_size: int) -> int:
        """``select_common_block_size`` for one backend: the block itself if accepted,
        else the largest fixed size dividing it; none is vLLM's ``ValueError`` (a block size
        the backend cannot serve, FlashMLA's 64 for blocks of 32)."""
        if self.accepts(block_size):
            return block_size
        divisors = [s for s in self.fixed_sizes if block_size % s == 0]
        if not divisors:
            supported = [
                *self.fixed_sizes,
                *([f"MultipleOf({self.multiple_of})"] if self.multiple_of else []),
            ]
            raise ValueError(
                f"No common block size for {block_size} ({self.name}: {supported}): vLLM refuses this "
                "block size for this backend at start-up; give a block size the backend supports"
            )
        return max(divisors)

    def customize_spec(self, spec: Any) -> Any:
        """``customize_attention_spec``'s own rule (not a backend's ``customize_spec``):
        a backend of fixed kernel block sizes only gives a spec without a
        ``block_stride_alignment`` ``MultipleOf`` its largest size, so that blocks split
        into its kernel blocks stay whole kernel blocks apart."""
        if spec.block_stride_alignment is None and self.fixed_sizes and self.multiple_of is None:
            return dataclasses.replace(spec, block_stride_alignment=MultipleOf(max(self.fixed_sizes)))
        return spec


FLASHINFER = Backend("FLASHINFER", fixed_sizes=(16, 32, 64))
FLASH_ATTN = Backend("FLASH_ATTN", multiple_of=16)
FLASHMLA = Backend("FLASHMLA", fixed_sizes=(64,))
# DeepseekV4IndexerBackend: sizes count uncompressed tokens (a C4 page of 256 holds 64 slots).
DSV4_INDEXER = Backend("DEEPSEEK_V4_INDEXER", fixed_sizes=(256,))


# -- specs ---------------------------------------------------------------------------


def attention_spec(model: HybridModel | AttentionModel, tp: int, block_size: int) -> Any:
    """A full-attention layer's spec at TP ``tp`` (``ModelConfig.get_num_kv_heads``: one
    head a rank, replicated, where there are more ranks than KV heads)."""
    return kvi.FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=max(1, model.num_key_value_heads // tp),
        head_size=model.head_dim,
        dtype=model.dtype,
    )


def dsv4_indexer_spec(block_size: int, compress_ratio: int = 4, indexer_kv_dtype: str = "fp8") -> Any:
    """``DeepseekV4IndexerCache.get_kv_cache_spec``: one fp8 index key per slot with its
    scales (132 bytes), or under ``indexer_kv_dtype="mxfp4"`` its 64 packed e2m1 bytes
    and 4 ue8m0 scales (68 bytes), ``compress_ratio`` tokens per slot, the page aligned
    to 512 bytes (FlashInfer sparse; 576 with FlashMLA's fp8_ds_mla)."""
    if indexer_kv_dtype not in ("fp8", "mxfp4"):
        raise ValueError(f"indexer_kv_dtype {indexer_kv_dtype!r} is not fp8 or mxfp4")
    block_size, compress_ratio = _dsv4_sizes(block_size, compress_ratio)
    return kvi.MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=68 if indexer_kv_dtype == "mxfp4" else 132,
        dtype=torch.uint8,
        tokens_per_state=compress_ratio,
        alignment=512,
    )


def _dsv4_sizes(block_size: int, compress_ratio: int) -> tuple[int, int]:
    """A DeepSeek-V4 cache's block size and compress ratio, each an int of at least 1 (the
    model takes ``max(1, config.compress_rates[...])``): vLLM's spec takes any number and
    prices a ratio of 0 or less as 1 state a block, and a float as a float page."""
    return at_least(block_size, "block_size", 1), at_least(compress_ratio, "compress_ratio", 1)


def dsv4_latent_spec(block_size: int, compress_ratio: int = 1) -> Any:
    """``DeepseekV4MLAAttention.get_kv_cache_spec`` with cache_dtype "auto": one bf16
    latent row of 512 a slot, ``compress_ratio`` tokens per slot (1: the uncompressed
    layers), the page aligned to 512 bytes."""
    block_size, compress_ratio = _dsv4_sizes(block_size, compress_ratio)
    return kvi.MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=512,
        dtype=torch.bfloat16,
        tokens_per_state=compress_ratio,
        cache_dtype_str="auto",
        alignment=512,
        model_version="deepseek_v4",
    )


def gdn_states(
    model: HybridModel, tp: int, conv_layout: str = "SD"
) -> tuple[tuple[tuple[int, ...], ...], tuple[torch.dtype, ...]]:
    """``MambaStateShapeCalculator.gated_delta_net_state_shape``: the conv state in
    ``VLLM_SSM_CONV_STATE_LAYOUT`` ``conv_layout`` ("SD", vLLM's default: rows outside
    the dim; "DS": the dim outside)."""
    conv_dim = (
        model.linear_key_head_dim * model.linear_num_key_heads * 2
        + model.linear_value_head_dim * model.linear_num_value_heads
    )
    conv = (model.linear_conv_kernel_dim - 1, conv_dim // tp)
    if conv_layout == "DS":
        conv = conv[::-1]
    ssm = (model.linear_num_value_heads // tp, model.linear_value_head_dim, model.linear_key_head_dim)
    return (conv, ssm), (model.dtype, model.mamba_ssm_dtype)


def hybrid_block_size(
    attn_page_1_token: int,
    mamba_page: int,
    backend: Backend,
    *,
    checkpoint_alignment: int = 1,
    min_alignment: int = 1,
    cache_block_size: int = 16,
) -> int:
    """``Platform._align_hybrid_block_size`` for one backend in ``align`` mode.

    ``checkpoint_alignment`` is ``get_mamba_prefill_checkpoint_alignment()`` (64 with the
    FlashInfer GDN prefill kernel, else 1); ``min_alignment`` is 128 for MLA models.
    """
    align = max(backend.smallest_base, cache_block_size, min_alignment)
    align = math.lcm(align, checkpoint_alignment)
    block = align * cdiv(mamba_page, align * attn_page_1_token)
    block = backend.smallest_base * cdiv(block, backend.smallest_base)
    return max(cache_block_size, block)


# -- configs -------------------------------------------------------------------------


@dataclass
class Engine:
    """One worker's KV cache: the config and what allocation needs besides it."""

    config: Any  # KVCacheConfig
    layout: Any  # KVCacheLayout
    kernel_block_sizes: list[int]
    layer_specs: dict[str, Any] = field(default_factory=dict)

    def group_of(self, layer: str) -> int:
        return next(i for i, g in enumerate(self.config.kv_cache_groups) if layer in g.layer_names)

    def spec_of(self, layer: str) -> Any:
        return self.layer_specs[layer]


def group_layers(layer_specs: dict[str, Any]) -> list[list[str]]:
    """``_get_kv_cache_groups_uniform_page_size``: bucket equal specs, split each bucket
    into groups of the smallest bucket's size, layers ``i::num_groups``."""
    buckets: dict[Any, list[str]] = {}
    for name, spec in layer_specs.items():
        buckets.setdefault(spec, []).append(name)
    sizes = [len(b) for b in buckets.values()]
    group_size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    groups: list[list[str]] = []
    for layers in buckets.values():
        num_groups = cdiv(len(layers), group_size)
        groups.extend(layers[i::num_groups] for i in range(num_groups))
    return groups


def block_stride_alignment(spec: Any) -> int:
    """``KVCacheSpec.get_block_stride_alignment``: the bytes a block stride must be a
    multiple of: ``block_stride_alignment`` itself (bytes; none: 1), or for
    ``MultipleOf(n)`` the page of a kernel block of ``gcd(n, block_size)`` tokens (1 where
    that is the whole block)."""
    alignment = spec.block_stride_alignment
    if not isinstance(alignment, MultipleOf):
        return int(alignment or 1)
    kernel_block_size = math.gcd(alignment.base, spec.block_size)
    if kernel_block_size == spec.block_size:
        return 1
    return int(spec.copy_with_new_block_size(kernel_block_size).page_size_bytes)


def _round_up(x: int, multiple: int) -> int:
    return cdiv(x, multiple) * multiple


def _merged_group(specs: dict[str, Any], names: Sequence[str]) -> Any:
    """``create_kv_cache_group_specs``: a group of equal specs carries their ``merge``
    (MLA's keeps the padded page but not the page ``alignment``, so a kernel block's page
    is the padded block's: ``get_block_stride_alignment`` of the merged spec)."""
    layer_specs = [specs[n] for n in names]
    return kvi.KVCacheGroupSpec(layer_names=list(names), kv_cache_spec=layer_specs[0].merge(layer_specs))


def _layers_by_spec(group: Any) -> dict[Any, list[str]]:
    """A group's layers by the spec vLLM allocates them with, in order: a
    ``UniformTypeKVCacheSpecs``' own spec a layer, else the group's (merged) spec."""
    spec = group.kv_cache_spec
    if isinstance(spec, kvi.UniformTypeKVCacheSpecs):
        out: dict[Any, list[str]] = {}
        for name, layer_spec in spec.kv_cache_specs.items():
            out.setdefault(layer_spec, []).append(name)
        return out
    return {spec: list(group.layer_names)}


def _allocations(groups: Sequence[Any], layout: Any, num_blocks: int) -> list[Any]:
    """``get_kv_cache_config_from_groups``' tensors for KV cache groups: a group's
    layers of one spec (its own, or each layer's of a ``UniformTypeKVCacheSpecs``) side by
    side from byte 0, every group overlaying the others in one buffer
    of the largest group's bytes a block. Block-outermost layouts pack every layer's page
    of a block together, the block rounded up to every page's ``block_stride_alignment``
    (``_get_kv_cache_bytes_per_block``); layer-outermost ones give each layer its pages
    padded to its own alignment (``_get_layer_block_stride``): blocks farther apart than a
    page, the padding between them. ``num_blocks`` is at least 1, as vLLM's own count is
    (it refuses a cache of no blocks)."""
    num_blocks = at_least(num_blocks, "num_blocks", 1)
    by_spec = [_layers_by_spec(g) for g in groups]
    if layout.is_block_outermost:
        alignment = math.lcm(*(block_stride_alignment(s) for g in by_spec for s in g))
        widest = max(sum(s.page_size_bytes * len(names) for s, names in g.items()) for g in by_spec)
        bytes_per_block = _round_up(widest, alignment)
    else:
        bytes_per_block = max(
            sum(
                _round_up(s.page_size_bytes, block_stride_alignment(s)) * len(names) for s, names in g.items()
            )
            for g in by_spec
        )
    interleaved = bytes_per_block if layout.is_block_outermost else None
    tensors = []
    for group in by_spec:
        offset = 0
        for spec, names in group.items():
            block_stride = interleaved
            padded_page = _round_up(spec.page_size_bytes, block_stride_alignment(spec))
            if block_stride is None and padded_page != spec.page_size_bytes:
                if not layout.is_block_compact:  # vLLM's assert
                    raise ValueError(
                        f"{layout.name} cannot pad pages: {names[0]}'s {spec.page_size_bytes}-byte page "
                        f"padded to {padded_page} bytes (block_stride_alignment "
                        f"{spec.block_stride_alignment!r}) needs a block-compact layout"
                    )
                block_stride = padded_page
            layer_stride, block_stride, *_ = kvi.compute_layout_strides(
                spec, num_blocks, len(names), layout, fixed_strides=(None, block_stride, None, None, None)
            )
            tensors.append(
                kvi.KVCacheTensor(
                    size=bytes_per_block * num_blocks,
                    layers=names,
                    layer_stride=layer_stride,
                    block_stride=block_stride,
                    offset=offset,
                )
            )
            offset += len(names) * (spec.page_size_bytes if layout.is_block_outermost else layer_stride)
    return tensors


def make_engine(
    layer_specs: dict[str, Any],
    groups: Sequence[Sequence[str]],
    kernel_block_size: Callable[[Any], int],
    *,
    num_blocks: int = NUM_BLOCKS,
    layout: Any = None,
    uniform_type: bool = False,
) -> Engine:
    """``get_kv_cache_config_from_groups`` for one spec per group (:func:`_allocations`):
    every group's tensor starts at byte 0, so groups overlay each other."""
    layout = layout or KVCacheLayout.LBNHC
    kv_groups = []
    for names in groups:
        if uniform_type:  # the per-layer wrapper vLLM uses when a group's specs differ
            spec = kvi.UniformTypeKVCacheSpecs(
                block_size=layer_specs[names[0]].block_size, kv_cache_specs={n: layer_specs[n] for n in names}
            )
            kv_groups.append(kvi.KVCacheGroupSpec(layer_names=list(names), kv_cache_spec=spec))
        else:
            kv_groups.append(_merged_group(layer_specs, names))
    tensors = _allocations(kv_groups, layout, num_blocks)
    config = kvi.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=kv_groups)
    # prepare_kernel_block_sizes: other layers' pages between blocks, never split
    kernels = [
        int(layer_specs[names[0]].block_size)
        if tensor.block_stride > tensor.layer_stride
        else kernel_block_size(layer_specs[names[0]])
        for names, tensor in zip(groups, tensors, strict=True)
    ]
    return Engine(config, layout, kernels, dict(layer_specs))


def _uniform_type_base(spec: Any) -> type:
    """``KVCacheSpecRegistry.get_uniform_type_base_spec`` (``register_all_kvcache_specs``):
    MLA and sink-full layers are grouped with full attention, every other kind alone."""
    bases = {
        kvi.FullAttentionSpec: kvi.FullAttentionSpec,
        kvi.MLAAttentionSpec: kvi.FullAttentionSpec,
        kvi.SinkFullAttentionSpec: kvi.FullAttentionSpec,
        kvi.SlidingWindowSpec: kvi.SlidingWindowSpec,
        kvi.SlidingWindowMLASpec: kvi.SlidingWindowMLASpec,
        kvi.ChunkedLocalAttentionSpec: kvi.ChunkedLocalAttentionSpec,
        kvi.CircularBufferSpec: kvi.CircularBufferSpec,
        kvi.MambaSpec: kvi.MambaSpec,
    }
    base: type | None = next((bases[c] for c in type(spec).__mro__ if c in bases), None)
    if base is None:
        raise ValueError(f"planned_engine: no grouping rule mirrored for {type(spec).__name__}")
    return base


def _is_uniform_type(specs: dict[str, Any]) -> bool:
    """``UniformTypeKVCacheSpecs.is_uniform_type``: one block size, one DCP sharding, and
    the first spec's ``is_uniform_with_collection``: a spec class's own rule where it has
    one (a window's size, a ring, Mamba's state fields: vLLM's code, which asks no
    registry), else every spec of its registered base (:func:`_uniform_type_base`)."""
    values = list(specs.values())
    if len({s.block_size for s in values}) > 1 or len({s.dcp_sharded for s in values}) > 1:
        return False
    first = values[0]
    if type(first).is_uniform_with_collection is not kvi.KVCacheSpec.is_uniform_with_collection:
        return bool(first.is_uniform_with_collection(specs))
    base = _uniform_type_base(first)
    return all(isinstance(s, base) for s in values)


def _unify_page_size(specs: dict[str, Any]) -> dict[str, Any]:
    """``unify_kv_cache_spec_page_size`` for attention layers: a smaller page whose size
    divides the largest takes proportionally more tokens a block; another non-MLA page is
    padded to it; MLA is refused (vLLM's ``NotImplementedError``)."""
    largest = max(s.page_size_bytes for s in specs.values())
    out = {}
    for name, spec in specs.items():
        page = spec.page_size_bytes
        if page == largest:
            out[name] = spec
        elif largest % page == 0:
            out[name] = dataclasses.replace(spec, block_size=spec.block_size * (largest // page))
        elif not isinstance(spec, kvi.MLAAttentionSpec):
            out[name] = dataclasses.replace(spec, page_size_padded=largest)
        else:
            raise NotImplementedError(f"Layer {name}: page size is not divisible by the maximum page size")
    return out


def _full_allocation_fallback(specs: dict[str, Any]) -> dict[str, Any]:
    """``_try_get_full_allocation_fallback_groups``: MLA beside a plain sliding window whose
    pages cannot be unified allocates the window as full attention at the full layers'
    block size (``_promote_local_kv_cache_specs``; its compute keeps the window), so every
    layer is one kind; anything else vLLM refuses."""
    values = list(specs.values())
    window = [s for s in values if isinstance(s, kvi.SlidingWindowSpec)]
    if (
        not any(isinstance(s, kvi.MLAAttentionSpec) for s in values)
        or not window
        or any(isinstance(s, (kvi.SlidingWindowMLASpec, kvi.ChunkedLocalAttentionSpec)) for s in values)
    ):
        raise NotImplementedError("vLLM 0.33 cannot unify these pages and has no fallback for them")
    full_blocks = {s.block_size for s in values if isinstance(s, kvi.FullAttentionSpec)}
    block = next(iter(full_blocks)) if len(full_blocks) == 1 else None

    def promoted(spec: Any) -> Any:
        if not isinstance(spec, kvi.SlidingWindowSpec):
            return spec
        size = block or spec.block_size
        padded = spec.page_size_padded
        if padded is not None:
            padded = max(padded, spec.unpadded_page_size_bytes * size // spec.block_size)
        return kvi.replace_as(
            spec,
            kvi.FullAttentionSpec,
            drop=("extra_retained_tokens",),
            block_size=size,
            page_size_padded=padded,
        )

    out = {name: promoted(spec) for name, spec in specs.items()}
    if len({s.block_size for s in out.values()}) > 1:
        raise NotImplementedError("vLLM 0.33 cannot unify these pages and has no fallback for them")
    return out


def _approximate_gcd(values: Sequence[int], lower_bound: int) -> int:
    """``_approximate_gcd``: the ``d`` in ``[lower_bound, max(values)]`` that pads the
    values least when each is rounded up to a multiple of it (ties: the larger)."""
    best_d, best_pad = max(1, lower_bound), None
    for d in range(best_d, max(values) + 1):
        pad = sum((d - x % d) % d for x in values)
        if best_pad is None or pad <= best_pad:
            best_d, best_pad = d, pad
    return best_d


def _packed_groups(specs: dict[str, Any]) -> list[Any]:
    """``_get_packed_kv_cache_groups`` (a block-outermost layout, pages of several sizes):
    layers bucketed greedily by uniform type (:func:`_is_uniform_type`); a bucket with as
    many layers of each page size (one repeat of a layer pattern, DeepSeek-V4's latents
    beside their indexer) is split into groups of whole repeats, as many repeats a group
    as ``_approximate_gcd`` picks; a state bucket (Mamba, a ``CircularBufferSpec`` ring, a
    window where no bucket repeats) into as many groups as the block other buckets need
    holds; every other bucket is one group."""
    buckets: list[dict[str, Any]] = []
    for name, spec in specs.items():
        bucket = next((b for b in buckets if _is_uniform_type({**b, name: spec})), None)
        if bucket is None:
            buckets.append({name: spec})
        else:
            bucket[name] = spec
    by_page: list[dict[int, list[str]]] = []
    for bucket in buckets:
        pages: dict[int, list[str]] = {}
        for name, spec in bucket.items():
            pages.setdefault(spec.page_size_bytes, []).append(name)
        by_page.append(pages)
    balanced = [len({len(names) for names in pages.values()}) == 1 for pages in by_page]
    repeats = [max(len(names) for names in pages.values()) for pages in by_page]
    floor = max(
        (r for r, b, p in zip(repeats, balanced, by_page, strict=True) if b and len(p) > 1), default=0
    )
    per_group = (
        _approximate_gcd([r for r, b in zip(repeats, balanced, strict=True) if b], floor) if floor else None
    )

    def is_state(bucket: dict[str, Any]) -> bool:
        first = next(iter(bucket.values()))
        window = per_group is None and isinstance(first, kvi.SlidingWindowSpec)
        return isinstance(first, (kvi.MambaSpec, kvi.CircularBufferSpec)) or window

    def num_groups_for(i: int) -> int:
        return cdiv(repeats[i], per_group) if balanced[i] and per_group is not None else 1

    def widest(pages: dict[int, list[str]], n: int) -> int:
        return sum(cdiv(len(names), n) * page for page, names in pages.items())

    anchor = max(
        widest(pages, len(bucket) if is_state(bucket) else num_groups_for(i))
        for i, (bucket, pages) in enumerate(zip(buckets, by_page, strict=True))
    )
    groups = []
    for i, (bucket, pages) in enumerate(zip(buckets, by_page, strict=True)):
        count = num_groups_for(i)
        if anchor and is_state(bucket):
            fits = max(anchor // next(iter(bucket.values())).page_size_bytes, 1)
            count = max(count, cdiv(len(bucket), fits))
        pattern = list(zip(*pages.values(), strict=False))  # each repeat's layers, one a page size (as vLLM)
        parts = (
            [list(bucket)]
            if count == 1
            else [[name for repeat in pattern[k::count] for name in repeat] for k in range(count)]
        )
        if not all(parts) or sum(map(len, parts)) != len(bucket):
            # a state bucket of uneven page sizes: vLLM's zip drops layers, or leaves a group
            # empty (its UniformTypeKVCacheSpecs.from_specs then fails on no specs)
            raise ValueError(
                f"planned_engine: vLLM 0.33 cannot pack {sorted(bucket)} into {count} groups of whole "
                f"repeats of its page sizes ({ {page: len(names) for page, names in pages.items()} } "
                "layers a page size in bytes)"
            )
        for names in parts:
            wrapper = kvi.UniformTypeKVCacheSpecs(
                block_size=bucket[names[0]].block_size, kv_cache_specs={n: bucket[n] for n in names}
            )
            groups.append(kvi.KVCacheGroupSpec(layer_names=names, kv_cache_spec=wrapper))
    return groups


def planned_engine(
    layer_specs: dict[str, Any],
    backend: Backend,
    *,
    num_blocks: int = NUM_BLOCKS,
    layout: Any = None,
) -> Engine:
    """Layers of differing specs (a target and its speculative drafter; a
    DeepSeek-V4.1-like model's latents, indexer, window and rings) planned as vLLM 0.33
    plans them (``get_kv_cache_groups``): one group where every spec is equal or of one
    kind at one block size (``UniformTypeKVCacheSpecs``: full attention and MLA are one
    kind), else pages unified and layers bucketed (``unify_kv_cache_spec_page_size``,
    ``_get_kv_cache_groups_uniform_page_size``), or under a block-outermost layout (the
    only ones DeepSeek-V4's indexer backend takes) packed side by side in each block
    (``_packed_groups``). ``get_kv_cache_config_from_groups`` then
    gives each spec of a group its own allocation, side by side from the group's byte 0."""
    layout = layout or KVCacheLayout.LBNHC
    specs = dict(layer_specs)
    if not specs:  # next() below would raise StopIteration, which ends a caller's loop silently
        raise ValueError("planned_engine takes the spec of one layer at least, got none")
    first = next(iter(specs.values()))
    if all(s == first for s in specs.values()):
        groups = [_merged_group(specs, list(specs))]
    elif _is_uniform_type(specs):
        wrapper = kvi.UniformTypeKVCacheSpecs(block_size=first.block_size, kv_cache_specs=specs)
        groups = [kvi.KVCacheGroupSpec(layer_names=list(specs), kv_cache_spec=wrapper)]
    elif layout.is_block_outermost and len({s.page_size_bytes for s in specs.values()}) > 1:
        groups = _packed_groups(specs)
    else:
        try:
            specs = _unify_page_size(specs)
            groups = [_merged_group(specs, names) for names in group_layers(specs)]
        except NotImplementedError:
            specs = _full_allocation_fallback(specs)
            wrapper = kvi.UniformTypeKVCacheSpecs(block_size=first.block_size, kv_cache_specs=specs)
            groups = [kvi.KVCacheGroupSpec(layer_names=list(specs), kv_cache_spec=wrapper)]
    tensors = _allocations(groups, layout, num_blocks)
    config = kvi.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)
    # prepare_kernel_block_sizes: a block interleaved with other layers' pages is never split
    kernels = [
        int(specs[g.layer_names[0]].block_size)
        if any(
            t.block_stride > t.layer_stride for t in tensors if not set(t.layers).isdisjoint(g.layer_names)
        )
        else backend.kernel_block_size(specs[g.layer_names[0]].block_size)
        for g in groups
    ]
    return Engine(config, layout, kernels, specs)


def _mamba_backends() -> Any:
    """vLLM's ``MambaAttentionBackendEnum`` (a spec's ``mamba_type``)."""
    return importlib.import_module("vllm.v1.attention.backends.registry").MambaAttentionBackendEnum


def _state_spec(
    states: tuple[tuple[tuple[int, ...], ...], tuple[torch.dtype, ...]],
    mamba_type: str,
    block: int,
    page: int,
    mamba_cache_mode: str,
    max_model_len: int,
    tp_replicated: bool = False,
) -> Any:
    """A hybrid's ``MambaSpec`` as vLLM 0.33 plans it: padded to ``page`` bytes (the
    attention page), a ``max_model_len`` block in 'none' mode (one running state a
    request, ``model_executor/models/config.py``), ``block`` tokens otherwise."""
    shapes, dtypes = states
    own = kvi.MambaSpec(block_size=-1, shapes=shapes, dtypes=dtypes).page_size_bytes
    return kvi.MambaSpec(
        block_size=max_model_len if mamba_cache_mode == "none" else block,
        shapes=shapes,
        dtypes=dtypes,
        page_size_padded=page if page != own else None,
        mamba_cache_mode=mamba_cache_mode,
        mamba_type=getattr(_mamba_backends(), mamba_type),
        tp_replicated=tp_replicated,
    )


def _kernel_blocks(backend: Backend) -> Callable[[Any], int]:
    """prepare_kernel_block_sizes: Mamba keeps the manager block; attention takes the
    backend's size (make_engine keeps it where blocks interleave layers)."""

    def kernel(spec: Any) -> int:
        if isinstance(spec, kvi.MambaSpec):
            return int(spec.block_size)
        return backend.kernel_block_size(spec.block_size)

    return kernel


def hybrid_engine(
    model: HybridModel,
    backend: Backend,
    *,
    tp: int = 1,
    checkpoint_alignment: int = 1,
    mamba_cache_mode: str = "align",
    max_model_len: int = 8192,
    num_blocks: int = NUM_BLOCKS,
    layout: Any = None,
    uniform_type: bool = False,
    conv_layout: str = "SD",
) -> Engine:
    """A GDN hybrid as vLLM 0.33 plans it: block size unified, Mamba page padded. In
    'none' mode (prefix caching off) the Mamba block is ``max_model_len`` tokens, one
    running state per request (``model_executor/models/config.py``)."""
    attn_page_1 = attention_spec(model, tp, 1).page_size_bytes
    shapes, dtypes = gdn_states(model, tp, conv_layout)
    mamba_page = kvi.MambaSpec(block_size=-1, shapes=shapes, dtypes=dtypes).page_size_bytes
    align = (
        checkpoint_alignment if mamba_cache_mode == "align" else 1
    )  # vLLM aligns checkpoints in align mode only
    block = hybrid_block_size(attn_page_1, mamba_page, backend, checkpoint_alignment=align)
    padded = block * attn_page_1
    attn = attention_spec(model, tp, block)
    mamba = _state_spec((shapes, dtypes), "GDN_ATTN", block, padded, mamba_cache_mode, max_model_len)
    specs = {
        model.layer_name(i): attn if model.is_full_attention(i) else mamba
        for i in range(model.num_hidden_layers)
    }
    layout = layout or KVCacheLayout.LBNHC
    kernel = _kernel_blocks(backend)
    return make_engine(
        specs, group_layers(specs), kernel, num_blocks=num_blocks, layout=layout, uniform_type=uniform_type
    )


def state_hybrid_engine(
    attn_1: Any,
    states: tuple[tuple[tuple[int, ...], ...], tuple[torch.dtype, ...]],
    mamba_type: str,
    backend: Backend,
    layers: Sequence[tuple[str, bool]],
    *,
    mamba_cache_mode: str = "align",
    max_model_len: int = 8192,
    min_alignment: int = 1,
    num_blocks: int = NUM_BLOCKS,
    tp_replicated: bool = False,
) -> Engine:
    """A hybrid of attention layers (``attn_1``: their spec at one token a block) and
    Mamba layers of one state kind (``states``: this rank's shapes and dtypes, as
    ``MambaStateShapeCalculator`` gives them; ``mamba_type``: a
    ``MambaAttentionBackendEnum`` member's name), as vLLM 0.33 plans it: the block size
    unified, the Mamba page padded to the attention page, a ``max_model_len`` Mamba block
    in 'none' mode. ``layers``: each layer's name and whether it is attention.
    ``tp_replicated``: the spec's (every rank holds the whole state: Qwen4's PLE conv)."""
    shapes, dtypes = states
    mamba_page = kvi.MambaSpec(block_size=-1, shapes=shapes, dtypes=dtypes).page_size_bytes
    block = hybrid_block_size(attn_1.page_size_bytes, mamba_page, backend, min_alignment=min_alignment)
    attn = dataclasses.replace(attn_1, block_size=block)
    padded = attn.page_size_bytes
    mamba = _state_spec(states, mamba_type, block, padded, mamba_cache_mode, max_model_len, tp_replicated)
    specs = {name: attn if is_attention else mamba for name, is_attention in layers}
    return make_engine(specs, group_layers(specs), _kernel_blocks(backend), num_blocks=num_blocks)


def mla_hybrid_engine(*, num_blocks: int = NUM_BLOCKS) -> Engine:
    """An MLA + Kimi-Delta-Attention hybrid (Kimi-Linear's shapes: MLA latent 512 + rope
    64, KDA 32 heads of 128, conv 4; 8 MLA and 16 KDA layers to keep it small), on a
    FlashMLA-style backend with 64-token kernel pages."""
    mla_1 = kvi.MLAAttentionSpec(block_size=1, num_kv_heads=1, head_size=512 + 64, dtype=torch.bfloat16)
    conv_dim = 32 * 128 + 2 * 32 * 128  # kda_state_shape: proj + 2 * proj_k
    shapes, dtypes = ((3, conv_dim), (32, 128, 128)), (torch.bfloat16, torch.float32)
    mamba_page = kvi.MambaSpec(block_size=-1, shapes=shapes, dtypes=dtypes).page_size_bytes
    block = hybrid_block_size(mla_1.page_size_bytes, mamba_page, FLASHMLA, min_alignment=128)
    mla = dataclasses.replace(mla_1, block_size=block)
    kda = kvi.MambaSpec(
        block_size=block,
        shapes=shapes,
        dtypes=dtypes,
        page_size_padded=mla.page_size_bytes,
        mamba_cache_mode="align",
        mamba_type=_mamba_backends().GDN_ATTN,  # vLLM 0.33's KDA layers report GDN's backend
    )
    specs = {
        f"model.layers.{i}.{'self_attn' if i % 3 == 2 else 'linear_attn'}": mla if i % 3 == 2 else kda
        for i in range(24)
    }
    return make_engine(specs, group_layers(specs), _kernel_blocks(FLASHMLA), num_blocks=num_blocks)


def uniform_engine(
    spec: Any,
    backend: Backend,
    *,
    num_layers: int,
    layer_name: str = "model.layers.{}.self_attn.attn",
    num_blocks: int = NUM_BLOCKS,
    layout: Any = None,
) -> Engine:
    """A model whose layers all have one spec (one KV cache group), as vLLM 0.33 pages it:
    ``prepare_kernel_block_sizes`` keeps the manager block where blocks are farther apart
    than layers (other layers' pages between them) and otherwise takes
    ``select_common_block_size``, which splits the block into kernel
    pages whenever the backend does not take it whole (FlashInfer: ``--block-size 128``
    becomes 64-token pages)."""
    layout = layout or KVCacheLayout.LBNHC
    specs = {layer_name.format(i): spec for i in range(num_layers)}

    def kernel(s: Any) -> int:
        return backend.kernel_block_size(s.block_size)

    return make_engine(specs, [list(specs)], kernel, num_blocks=num_blocks, layout=layout)


def attention_engine(
    model: AttentionModel,
    backend: Backend,
    *,
    block_size: int = 16,
    num_blocks: int = NUM_BLOCKS,
    layout: Any = None,
    tp: int = 1,
) -> Engine:
    """One worker's cache of an attention-only model at TP ``tp`` (its rank's KV heads)."""
    return uniform_engine(
        attention_spec(model, tp, block_size),
        backend,
        num_layers=model.num_hidden_layers,
        num_blocks=num_blocks,
        layout=layout,
    )


# -- registrations -------------------------------------------------------------------


def allocate_v033(engine: Engine) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``allocate_kv_cache``: one int8 buffer, per-layer ``[B, H, N, C]`` views of it."""
    config = engine.config
    buf = torch.zeros(config.kv_cache_tensors[0].size, dtype=torch.int8)
    kv_caches: dict[str, torch.Tensor] = {}
    for tensor in config.kv_cache_tensors:
        group_id = engine.group_of(tensor.layers[0])
        spec = config.kv_cache_groups[group_id].kv_cache_spec  # the group's, as vLLM's
        if isinstance(spec, kvi.UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[tensor.layers[0]]
        views = kvi.create_kv_cache_views(
            buf,
            spec,
            config.num_blocks,
            engine.layout,
            tensor,
            kernel_block_size=engine.kernel_block_sizes[group_id],
        )
        kv_caches.update(zip(tensor.layers, views, strict=True))
    return buf, kv_caches


def fill_random(buf: torch.Tensor, seed: int) -> torch.Tensor:
    """``allocate_v033``'s buffer filled with random bytes of ``seed``, in place."""
    generator = torch.Generator().manual_seed(seed)
    return buf.copy_(torch.randint(-128, 128, buf.shape, dtype=torch.int8, generator=generator))


def detect_registered(
    engine: Engine, kv_caches: dict[str, torch.Tensor], hints: Any, *, edited: bool, prefix_reuse: bool = True
) -> Any:
    """``kv_caches`` (``allocate_v033``'s) detected as a connector does: through vLLM's
    group edits (``prefix_reuse`` as theirs) and its transfer layers (``edited``), or the
    registered tensors as they are, in order."""
    import kvlayout
    from kvlayout.integrations.vllm import apply_kv_cache_group_edits, transfer_layers

    if not edited:
        return kvlayout.detect(list(kv_caches.values()), "vllm", hints)
    layers, groups = transfer_layers(
        engine.config, apply_kv_cache_group_edits(engine.config, kv_caches, hints, prefix_reuse=prefix_reuse)
    )
    return kvlayout.detect(layers, "vllm", hints, layer_groups=groups)


def share_kv_caches(engine: Engine, kv_caches: dict[str, Any], shared: dict[str, str]) -> dict[str, Any]:
    """Cross-layer KV sharing (Gemma-3n, YOCO) as vLLM 0.33 sets it up: each sharer joins
    its target's KV cache group (``add_kv_sharing_layers_to_kv_cache_groups``), and the
    registration maps it to the target's own tensor (``initialize_kv_cache_tensors``:
    ``kv_caches[layer_name] = kv_caches[target_layer_name]``, after every allocated layer).

    A sharer is a layer vLLM allocates no cache for (its spec is not in the config): one
    the engine already holds is refused, as is a target it does not."""
    allocated = {name for g in engine.config.kv_cache_groups for name in g.layer_names}
    for sharer, target in shared.items():
        if sharer in allocated:
            raise ValueError(
                f"share_kv_caches: sharer {sharer!r} is a layer with a KV cache of its own in this "
                "engine; a sharing layer has none (build the engine without it, then share it)"
            )
        if target not in allocated:
            raise ValueError(
                f"share_kv_caches: target {target!r} of {sharer!r} is not a layer of this engine"
            )
    for sharer, target in shared.items():
        engine.config.kv_cache_groups[engine.group_of(target)].layer_names.append(sharer)
        engine.layer_specs[sharer] = engine.spec_of(target)
    out = dict(kv_caches)
    for sharer, target in shared.items():
        out[sharer] = out[target]
    return out


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def legacy_mamba_states(raw: torch.Tensor, spec: Any, num_blocks: int) -> list[torch.Tensor]:
    """Pre-0.26 ``_reshape_kv_cache_tensors`` for a Mamba layer: states back to back
    from the page base, each strided by the (padded) page."""
    states, offset = [], 0
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        item = dtype.itemsize
        states.append(
            torch.as_strided(
                raw.view(dtype),
                size=(num_blocks, *shape),
                stride=(spec.page_size_bytes // item, *_contiguous_strides(shape)),
                storage_offset=offset // item,
            )
        )
        offset += math.prod(shape) * item
    return states


def legacy_attention(
    raw: torch.Tensor, spec: Any, num_blocks: int, kernel: int, backend: Backend, *, hnd: bool = False
) -> torch.Tensor:
    """Pre-0.26 attention: FlashInfer ``(N*k, 2, kb, H, D)`` (HND: a permute of
    ``(N*k, 2, H, kb, D)``); FlashAttention ``(2, N, B, H, D)`` (HND: a permute of
    ``(2, N, H, B, D)``) re-strided block-major for hybrids
    (``_update_hybrid_attention_mamba_layout``)."""
    pages = num_blocks * (spec.block_size // kernel)
    heads, head = spec.num_kv_heads, spec.head_size
    t = raw.view(spec.dtype)
    if backend is FLASH_ATTN:
        hidden = kernel * heads * head
        if hnd:
            kv = t.view(2, pages, heads, kernel, head).permute(0, 1, 3, 2, 4)
        else:
            kv = t.view(2, pages, kernel, heads, head)
        return kv.as_strided(kv.shape, (hidden, 2 * hidden, *kv.stride()[2:]))
    if hnd:
        return t.view(pages, 2, heads, kernel, head).permute(0, 1, 3, 2, 4)
    return t.view(pages, 2, kernel, heads, head)


def allocate_legacy(
    engine: Engine, backend: Backend, *, hnd: bool = False
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Pre-0.26: one raw int8 tensor per ``KVCacheTensor(shared_by=...)``, shared by
    layer ``i`` of every group, each layer reshaped from it."""
    config = engine.config
    groups = config.kv_cache_groups
    width = len(groups[0].layer_names)
    page = engine.spec_of(groups[0].layer_names[0]).page_size_bytes
    raws = [torch.zeros(page * config.num_blocks, dtype=torch.int8) for _ in range(width)]
    kv_caches: dict[str, Any] = {}
    for group_id, group in enumerate(groups):
        for i, name in enumerate(group.layer_names):
            spec = engine.spec_of(name)
            if isinstance(spec, kvi.MambaSpec):
                kv_caches[name] = legacy_mamba_states(raws[i], spec, config.num_blocks)
            elif isinstance(spec, kvi.MLAAttentionSpec):
                kernel = engine.kernel_block_sizes[group_id]
                pages = config.num_blocks * (spec.block_size // kernel)
                kv_caches[name] = raws[i].view(spec.dtype).view(pages, kernel, spec.head_size)
            else:
                kernel = engine.kernel_block_sizes[group_id]
                kv_caches[name] = legacy_attention(raws[i], spec, config.num_blocks, kernel, backend, hnd=hnd)
    return raws, kv_caches


def allocate(
    engine: Engine, backend: Backend, allocation: str, hnd: bool = False
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """("v033" | "legacy") registrations and the buffers behind them."""
    if allocation == "v033":
        buf, kv_caches = allocate_v033(engine)
        return [buf], kv_caches
    return allocate_legacy(engine, backend, hnd=hnd)


def page_region(
    engine: Engine, bufs: list[torch.Tensor], allocation: str, layer: str
) -> tuple[int, int, int]:
    """(buffer index, byte offset of the layer's block 0 in it, bytes between blocks),
    from the config's records, not from the tensors."""
    if allocation == "v033":
        tensor = next(t for t in engine.config.kv_cache_tensors if layer in t.layers)
        return 0, tensor.offset + tensor.layers.index(layer) * tensor.layer_stride, tensor.block_stride
    group = engine.config.kv_cache_groups[engine.group_of(layer)]
    return group.layer_names.index(layer), 0, engine.spec_of(layer).page_size_bytes


def hints(hnd: bool) -> dict[str, str]:
    """The kv_layout hint matching an allocation (vLLM's LBNHC is NHD, LBHNC is HND)."""
    return {"kv_layout": "HND" if hnd else "NHD"}
