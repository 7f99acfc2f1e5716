"""kvlayout: describe, detect and address the paged KV caches of LLM serving engines.

A format's name is its layout (``NL_X_TWO_NB_BS_NH_HS`` is a list of NL tensors
``[2, NB, BS, NH, HS]``); everything about it is derived from the name. Names are
exported lazily, so ``import kvlayout`` is cheap and the code generator can import the
core while the generated modules are missing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "EngineKVFormat": "kvlayout._generated.formats",
    "PageBufferShapeDesc": "kvlayout._generated.descriptors",
    "Layout": "kvlayout.layout.ast",
    "parse": "kvlayout.layout.parser",
    "Coord": "kvlayout.layout.algebra",
    "CopyPlan": "kvlayout.layout.algebra",
    "KVFormatSpec": "kvlayout.catalog.spec",
    "UndefinedSizeError": "kvlayout.catalog.spec",
    "as_format": "kvlayout.catalog.registry",
    "concrete_shape": "kvlayout.catalog.registry",
    "describe_shape": "kvlayout.catalog.registry",
    "get_spec": "kvlayout.catalog.registry",
    "get_spec_class": "kvlayout.catalog.registry",
    "layout_of": "kvlayout.catalog.registry",
    "CatalogError": "kvlayout.errors",
    "KVLayoutError": "kvlayout.errors",
    "LayoutSemanticError": "kvlayout.errors",
    "LayoutSyntaxError": "kvlayout.errors",
    "SizeError": "kvlayout.errors",
    "EXCLUDED_ENGINE_GROUP": "kvlayout.facade",
    "LayerGroupIdentity": "kvlayout.facade",
    "KernelGroupIdentity": "kvlayout.registration.kernel_groups",
    "extract_kv_cache_shapes": "kvlayout.detection.discovery",
    "get_shape_and_dtype": "kvlayout.facade",
    "resolve_vllm_kv_layout": "kvlayout.detection.vllm",
    "KVLayerGroupInfo": "kvlayout.layer_groups",
    "KVLayerGroupsManager": "kvlayout.layer_groups",
    "KernelGroupInfo": "kvlayout.layer_groups",
    "ENGINE_KV_FORMAT_DESCRIPTORS": "kvlayout.layout.description",
    "KVLayoutDescriptor": "kvlayout.layout.description",
    "QuantSpec": "kvlayout.layout.description",
    "ScalePlacement": "kvlayout.layout.description",
    "from_engine_kv_format": "kvlayout.layout.description",
    "to_engine_kv_format_name": "kvlayout.layout.description",
    "get_attention_backend": "kvlayout.facade",
    "get_block_size": "kvlayout.facade",
    "get_concrete_engine_kv_shape": "kvlayout.facade",
    "get_concrete_engine_kv_shape_from_shape_desc": "kvlayout.facade",
    "get_device": "kvlayout.facade",
    "get_dtype": "kvlayout.facade",
    "get_elements_per_layer": "kvlayout.facade",
    "get_engine_kv_shape_description": "kvlayout.facade",
    "get_group_data_ptrs": "kvlayout.facade",
    "get_head_size": "kvlayout.facade",
    "get_hidden_dim_size": "kvlayout.facade",
    "get_kv_size": "kvlayout.facade",
    "get_num_blocks": "kvlayout.facade",
    "get_num_heads": "kvlayout.facade",
    "get_num_layers": "kvlayout.facade",
    "get_page_buffer_size": "kvlayout.facade",
    "get_tokens_per_layer": "kvlayout.facade",
    "group_layers_by_identity": "kvlayout.facade",
    "is_mla": "kvlayout.facade",
    "make_page_buffer_shape_desc": "kvlayout.facade",
    "resolve_block_stride_and_log_layout": "kvlayout.facade",
    "normalize_kv_and_discover_format": "kvlayout.detection.discovery",
    "detect": "kvlayout.detection.discovery",
    "bind": "kvlayout.registration.registration",
    "Registration": "kvlayout.registration.registration",
    "RegisteredKV": "kvlayout.registration.registration",
    "KernelGroup": "kvlayout.registration.kernel_groups",
    "RegistrationError": "kvlayout.registration.registration",
    "normalize_and_discover_per_layer_formats": "kvlayout.detection.discovery",
    "DetectionError": "kvlayout.detection.base",
    "attempt_permute_to_contiguous_view": "kvlayout.registration.contiguity",
    "StridedViewError": "kvlayout.registration.contiguity",
    "DiscoverableKVCache": "kvlayout.types",
    "EngineType": "kvlayout.types",
    "LayoutHints": "kvlayout.types",
    "LayoutHintError": "kvlayout.types",
    "KV_LAYOUT_NAMES": "kvlayout.types",
    "KV_LIST_LAYOUT_NAMES": "kvlayout.types",
    "HICACHE_LAYOUT_NAMES": "kvlayout.types",
    "KVBM_LAYOUT_NAMES": "kvlayout.types",
    "HEAD_OUTER_KV_LAYOUTS": "kvlayout.layout.vocabulary",
    "LAYER_INNER_KV_LAYOUTS": "kvlayout.layout.vocabulary",
    "HND_KV_LAYOUTS": "kvlayout.layout.vocabulary",
    "BLOCKS_FIRST_KV_LAYOUTS": "kvlayout.layout.vocabulary",
    "LayoutDescription": "kvlayout.layout.description",
    "describe": "kvlayout.layout.description",
    "kv_layout_axes": "kvlayout.layout.vocabulary",
    "to_engine_kv_format": "kvlayout.layout.description",
    "is_indexer_cache": "kvlayout.detection.indexers",
    "drop_indexer_caches": "kvlayout.detection.indexers",
    **{
        name: "kvlayout._generated.predicates"
        for name in (
            "has_leading_block_axis",
            "is_cross_layer",
            "is_fused_packed",
            "is_head_outer",
            "is_layer_inner",
            "is_hnd",
            "is_indexer",
            "is_kv_list",
            "is_kv_second_tuple",
            "is_layer_list",
            "is_pbs_fused",
            "is_single_kv",
            "is_two_major",
        )
    },
}

__all__ = [
    "BLOCKS_FIRST_KV_LAYOUTS",
    "ENGINE_KV_FORMAT_DESCRIPTORS",
    "EXCLUDED_ENGINE_GROUP",
    "HEAD_OUTER_KV_LAYOUTS",
    "HICACHE_LAYOUT_NAMES",
    "HND_KV_LAYOUTS",
    "KVBM_LAYOUT_NAMES",
    "KV_LAYOUT_NAMES",
    "KV_LIST_LAYOUT_NAMES",
    "LAYER_INNER_KV_LAYOUTS",
    "CatalogError",
    "Coord",
    "CopyPlan",
    "DetectionError",
    "DiscoverableKVCache",
    "EngineKVFormat",
    "EngineType",
    "GPUKVFormat",
    "KVFormatSpec",
    "KVLayerGroupInfo",
    "KVLayerGroupsManager",
    "KVLayoutDescriptor",
    "KVLayoutError",
    "KernelGroup",
    "KernelGroupIdentity",
    "KernelGroupInfo",
    "LayerGroupIdentity",
    "Layout",
    "LayoutDescription",
    "LayoutHintError",
    "LayoutHints",
    "LayoutSemanticError",
    "LayoutSyntaxError",
    "PageBufferShapeDesc",
    "QuantSpec",
    "RegisteredKV",
    "Registration",
    "RegistrationError",
    "ScalePlacement",
    "SizeError",
    "StridedViewError",
    "UndefinedSizeError",
    "as_format",
    "attempt_permute_to_contiguous_view",
    "bind",
    "concrete_shape",
    "describe",
    "describe_shape",
    "detect",
    "drop_indexer_caches",
    "extract_kv_cache_shapes",
    "from_engine_kv_format",
    "get_attention_backend",
    "get_block_size",
    "get_concrete_engine_kv_shape",
    "get_concrete_engine_kv_shape_from_shape_desc",
    "get_device",
    "get_dtype",
    "get_elements_per_layer",
    "get_engine_kv_shape_description",
    "get_group_data_ptrs",
    "get_head_size",
    "get_hidden_dim_size",
    "get_kv_size",
    "get_num_blocks",
    "get_num_heads",
    "get_num_layers",
    "get_page_buffer_size",
    "get_shape_and_dtype",
    "get_spec",
    "get_spec_class",
    "get_tokens_per_layer",
    "group_layers_by_identity",
    "has_leading_block_axis",
    "is_cross_layer",
    "is_fused_packed",
    "is_head_outer",
    "is_hnd",
    "is_indexer",
    "is_indexer_cache",
    "is_kv_list",
    "is_kv_second_tuple",
    "is_layer_inner",
    "is_layer_list",
    "is_mla",
    "is_pbs_fused",
    "is_single_kv",
    "is_two_major",
    "kv_layout_axes",
    "layout_of",
    "make_page_buffer_shape_desc",
    "normalize_and_discover_per_layer_formats",
    "normalize_kv_and_discover_format",
    "parse",
    "resolve_block_stride_and_log_layout",
    "resolve_vllm_kv_layout",
    "to_engine_kv_format",
    "to_engine_kv_format_name",
]


# LMCache's other name for the enum (lmcache_native exports both).
_ALIASES: dict[str, str] = {"GPUKVFormat": "EngineKVFormat"}


def __getattr__(name: str) -> Any:
    if name in _ALIASES:
        globals()[name] = alias = __getattr__(_ALIASES[name])
        return alias
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvlayout' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS, *_ALIASES])


if TYPE_CHECKING:
    from kvlayout._generated.descriptors import PageBufferShapeDesc
    from kvlayout._generated.formats import EngineKVFormat

    GPUKVFormat = EngineKVFormat
    from kvlayout._generated.predicates import (
        has_leading_block_axis,
        is_cross_layer,
        is_fused_packed,
        is_head_outer,
        is_hnd,
        is_indexer,
        is_kv_list,
        is_kv_second_tuple,
        is_layer_inner,
        is_layer_list,
        is_pbs_fused,
        is_single_kv,
        is_two_major,
    )
    from kvlayout.catalog.registry import (
        as_format,
        concrete_shape,
        describe_shape,
        get_spec,
        get_spec_class,
        layout_of,
    )
    from kvlayout.catalog.spec import KVFormatSpec, UndefinedSizeError
    from kvlayout.detection.base import DetectionError
    from kvlayout.detection.discovery import (
        detect,
        extract_kv_cache_shapes,
        normalize_and_discover_per_layer_formats,
        normalize_kv_and_discover_format,
    )
    from kvlayout.detection.indexers import drop_indexer_caches, is_indexer_cache
    from kvlayout.detection.vllm import resolve_vllm_kv_layout
    from kvlayout.errors import (
        CatalogError,
        KVLayoutError,
        LayoutSemanticError,
        LayoutSyntaxError,
        SizeError,
    )
    from kvlayout.facade import (
        EXCLUDED_ENGINE_GROUP,
        LayerGroupIdentity,
        get_attention_backend,
        get_block_size,
        get_concrete_engine_kv_shape,
        get_concrete_engine_kv_shape_from_shape_desc,
        get_device,
        get_dtype,
        get_elements_per_layer,
        get_engine_kv_shape_description,
        get_group_data_ptrs,
        get_head_size,
        get_hidden_dim_size,
        get_kv_size,
        get_num_blocks,
        get_num_heads,
        get_num_layers,
        get_page_buffer_size,
        get_shape_and_dtype,
        get_tokens_per_layer,
        group_layers_by_identity,
        is_mla,
        make_page_buffer_shape_desc,
        resolve_block_stride_and_log_layout,
    )
    from kvlayout.layer_groups import KernelGroupInfo, KVLayerGroupInfo, KVLayerGroupsManager
    from kvlayout.layout.algebra import Coord, CopyPlan
    from kvlayout.layout.ast import Layout
    from kvlayout.layout.description import (
        BLOCKS_FIRST_KV_LAYOUTS,
        ENGINE_KV_FORMAT_DESCRIPTORS,
        HND_KV_LAYOUTS,
        KVLayoutDescriptor,
        LayoutDescription,
        QuantSpec,
        ScalePlacement,
        describe,
        from_engine_kv_format,
        kv_layout_axes,
        to_engine_kv_format,
        to_engine_kv_format_name,
    )
    from kvlayout.layout.parser import parse
    from kvlayout.layout.vocabulary import HEAD_OUTER_KV_LAYOUTS, LAYER_INNER_KV_LAYOUTS
    from kvlayout.registration.contiguity import StridedViewError, attempt_permute_to_contiguous_view
    from kvlayout.registration.kernel_groups import KernelGroup, KernelGroupIdentity
    from kvlayout.registration.registration import RegisteredKV, Registration, RegistrationError, bind
    from kvlayout.types import (
        HICACHE_LAYOUT_NAMES,
        KV_LAYOUT_NAMES,
        KV_LIST_LAYOUT_NAMES,
        KVBM_LAYOUT_NAMES,
        DiscoverableKVCache,
        EngineType,
        LayoutHintError,
        LayoutHints,
    )
