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
    "Layout": "kvlayout.layout",
    "parse": "kvlayout.parser",
    "Coord": "kvlayout.algebra",
    "CopyPlan": "kvlayout.algebra",
    "KVFormatSpec": "kvlayout.spec",
    "UndefinedSizeError": "kvlayout.spec",
    "as_format": "kvlayout.registry",
    "concrete_shape": "kvlayout.registry",
    "describe_shape": "kvlayout.registry",
    "get_spec": "kvlayout.registry",
    "get_spec_class": "kvlayout.registry",
    "layout_of": "kvlayout.registry",
    "CatalogError": "kvlayout.errors",
    "KVLayoutError": "kvlayout.errors",
    "LayoutSemanticError": "kvlayout.errors",
    "LayoutSyntaxError": "kvlayout.errors",
    "SizeError": "kvlayout.errors",
    "attempt_permute_to_contiguous_view": "kvlayout.contiguity",
    "StridedViewError": "kvlayout.contiguity",
    "DiscoverableKVCache": "kvlayout.types",
    "EngineType": "kvlayout.types",
    "LayoutHints": "kvlayout.types",
    "LayoutHintError": "kvlayout.types",
}

__all__ = [
    "CatalogError",
    "Coord",
    "CopyPlan",
    "DiscoverableKVCache",
    "EngineKVFormat",
    "EngineType",
    "KVFormatSpec",
    "KVLayoutError",
    "Layout",
    "LayoutHintError",
    "LayoutHints",
    "LayoutSemanticError",
    "LayoutSyntaxError",
    "PageBufferShapeDesc",
    "SizeError",
    "StridedViewError",
    "UndefinedSizeError",
    "as_format",
    "attempt_permute_to_contiguous_view",
    "concrete_shape",
    "describe_shape",
    "get_spec",
    "get_spec_class",
    "layout_of",
    "parse",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvlayout' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from kvlayout._generated.descriptors import PageBufferShapeDesc
    from kvlayout._generated.formats import EngineKVFormat
    from kvlayout.algebra import Coord, CopyPlan
    from kvlayout.contiguity import StridedViewError, attempt_permute_to_contiguous_view
    from kvlayout.errors import (
        CatalogError,
        KVLayoutError,
        LayoutSemanticError,
        LayoutSyntaxError,
        SizeError,
    )
    from kvlayout.layout import Layout
    from kvlayout.parser import parse
    from kvlayout.registry import (
        as_format,
        concrete_shape,
        describe_shape,
        get_spec,
        get_spec_class,
        layout_of,
    )
    from kvlayout.spec import KVFormatSpec, UndefinedSizeError
    from kvlayout.types import DiscoverableKVCache, EngineType, LayoutHintError, LayoutHints
