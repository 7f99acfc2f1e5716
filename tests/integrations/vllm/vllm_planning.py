"""vLLM 0.33's own KV cache grouping (``get_kv_cache_groups``), run on spec objects: the
oracle ``kvlayout.testing.vllm.planned_engine`` is compared with.

``vllm.v1.core.kv_cache_planning`` imports ``vllm.config`` (pydantic, transformers), which
vLLM installed without its dependencies cannot, so the functions are taken from that
file's source as vLLM ships it and run over the classes of ``vllm.v1.kv_cache_interface``
(which imports). The spec registry the grouping asks (``KVCacheSpecRegistry``) is filled
by vLLM's ``register_all_kvcache_specs``, run the same way with placeholder managers
(grouping asks only for the base classes) and without its last statement, the platform's
custom specs (``current_platform`` needs the full install).

``get_kv_cache_config_from_groups`` (the tensors: offsets, strides, padding) runs the same
way. ``KVCacheSpec.get_block_stride_alignment`` imports ``MultipleOf`` from
``vllm.v1.attention.backend``, which imports the model executor; while vLLM's functions
run, that module is ``kvlayout.testing.vllm``'s ``MultipleOf`` (vLLM's two-line frozen
dataclass), the class the specs under test carry.
"""

from __future__ import annotations

import ast
import functools
import importlib
import math
import sys
from collections import Counter, defaultdict
from dataclasses import replace
from types import ModuleType, SimpleNamespace
from typing import Any
from unittest import mock

from kvlayout.testing import vllm as vx
from tests.integrations.vllm.vllm_source import definitions, run, vllm_source

kvi: Any = importlib.import_module("vllm.v1.kv_cache_interface")
registry: Any = importlib.import_module("vllm.v1.kv_cache_spec_registry")

_PLANNING = (
    "get_kv_cache_groups",
    "is_kv_cache_type_attention_free",
    "is_kv_cache_spec_uniform",
    "create_kv_cache_group_specs",
    "_get_kv_cache_groups_uniform_spec",
    "_get_kv_cache_groups_uniform_type",
    "unify_kv_cache_spec_page_size",
    "_get_kv_cache_groups_uniform_page_size",
    "_try_get_full_allocation_fallback_groups",
    "_promote_local_kv_cache_specs",
    "_approximate_gcd",
    "_get_packed_kv_cache_groups",
)
_CONFIG = (
    "may_override_num_blocks",
    "_get_per_layer_spec",
    "_get_layer_block_stride",
    "_get_kv_cache_bytes_per_block",
    "validate_kv_cache_layout",
    "get_kv_cache_config_from_groups",
)


def _spec_classes() -> dict[str, Any]:
    return {name: getattr(kvi, name) for name in dir(kvi) if name.endswith(("Spec", "Specs"))}


@functools.cache
def _register_specs() -> None:
    """vLLM's ``register_all_kvcache_specs`` (its built-in registrations), once."""
    path, tree = vllm_source("v1/core/single_type_kv_cache_manager.py")
    (register,) = definitions(path, tree, ("register_all_kvcache_specs",), "planning")
    assert isinstance(register, ast.FunctionDef)
    body = register.body
    # the last two statements import vLLM's platform and register its custom specs
    assert isinstance(body[-2], ast.ImportFrom) and body[-2].module == "vllm.platforms", ast.dump(body[-2])
    register.body = body[:-2]
    managers: dict[str, Any] = {}
    for node in ast.walk(register):
        if isinstance(node, ast.Name) and node.id.endswith("Manager") and node.id not in managers:
            managers[node.id] = type(node.id, (), {})
    namespace = {
        **_spec_classes(),
        **managers,
        "KVCacheSpecRegistry": registry.KVCacheSpecRegistry,
        "KVCacheGroupRole": kvi.KVCacheGroupRole,
    }
    run(path, [register], namespace)
    if not registry._REGISTRY_KVCACHESPEC_LIST:
        namespace["register_all_kvcache_specs"](None)


@functools.cache
def _planning() -> dict[str, Any]:
    _register_specs()
    path, tree = vllm_source("v1/core/kv_cache_planning.py")
    namespace: dict[str, Any] = {
        **_spec_classes(),
        "KVCacheSpecRegistry": registry.KVCacheSpecRegistry,
        "KVCacheGroupSpec": kvi.KVCacheGroupSpec,
        "defaultdict": defaultdict,
        "Counter": Counter,
        "math": math,
        "replace": replace,
        "cdiv": lambda a, b: -(-a // b),
        "logger": SimpleNamespace(info=lambda *a: None, warning=lambda *a: None, debug=lambda *a: None),
        # vLLM's own returns None without a HiSparse config, which these configs never have
        "get_hisparse_kv_cache_groups": lambda vllm_config, specs: None,
    }
    run(path, definitions(path, tree, _PLANNING + _CONFIG, "planning"), namespace)
    namespace |= {
        "round_up": lambda x, y: -(-x // y) * y,
        "compute_layout_strides": kvi.compute_layout_strides,
        "KVCacheTensor": kvi.KVCacheTensor,
        "KVCacheConfig": kvi.KVCacheConfig,
    }
    return namespace


def _backend_module() -> ModuleType:
    module = ModuleType("vllm.v1.attention.backend")
    module.MultipleOf = vx.MultipleOf  # type: ignore[attr-defined]
    return module


def _vllm_config(layout: Any, num_blocks: int | None = None) -> Any:
    """What the grouping and the config read of a ``VllmConfig``: no HiSparse, the hybrid
    KV cache manager on, the resolved ``layout``, ``num_blocks`` as
    ``num_gpu_blocks_override``."""
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout,
            num_gpu_blocks_override=num_blocks,
            prefix_cache_retention_interval=None,
        ),
    )


def vllm_kv_cache_groups(specs: dict[str, Any], layout: Any) -> list[Any]:
    """vLLM 0.33's ``get_kv_cache_groups`` for ``specs`` under the resolved ``layout``."""
    return list(_planning()["get_kv_cache_groups"](_vllm_config(layout), dict(specs)))


def vllm_kv_cache_config(groups: list[Any], layout: Any, num_blocks: int) -> Any:
    """vLLM 0.33's ``get_kv_cache_config_from_groups`` for ``groups`` under ``layout``,
    ``num_blocks`` blocks (its ``num_gpu_blocks_override``)."""
    config = _planning()["get_kv_cache_config_from_groups"]
    with mock.patch.dict(sys.modules, {"vllm.v1.attention.backend": _backend_module()}):
        return config(_vllm_config(layout, num_blocks), list(groups), available_memory=0)
