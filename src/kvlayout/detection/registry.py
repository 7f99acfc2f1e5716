"""Detectors, found by importing every module of this package that names an ``ENGINE``.

Adding an engine is adding a module with ``ENGINE`` and ``discover(kv, hints)``; nothing
here lists engines. A module may also define ``refuse_mixed(kv, hints)``, asked before
layers of different shapes are detected apart: it raises where the engine knows the
mixture for what it is (SGLang's K and V of different head sizes), not layers to split;
and ``split_mixed(kv, hints)``, which ``detect`` asks first: the two lists of leaves such
a mixture is served as, one kernel group each; and ``pool_views(kv, hints)``, asked of the
caller's registration before anything else: the one tensor a list of per-layer views
tiles (vLLM's ``BHLNC``), detected in its place, and the hints it reads with;
``indexer_format(tensor)``, the DSA indexer format a layer its detector re-views as opaque
pages holds (vLLM's on ROCm), or None; ``size_hints(kv, fmt, hints)``, the size hints the
detected leaves are checked against where a hint the engine sends means other than an
axis (MAX's ``page_size``: the tokens a page covers, whose slot axis may hold fewer);
and ``OWN_HINTS``, the layout hints no other
engine reads (SGLang's ``hicache_layout``): one given to another engine is an error, not
ignored.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from kvlayout._generated.formats import EngineKVFormat
from kvlayout.errors import KVLayoutError
from kvlayout.types import DiscoverableKVCache, EngineType, LayoutHints

__all__ = [
    "Detector",
    "IndexerRows",
    "MixedCheck",
    "MixedSplit",
    "SizeHints",
    "ViewPooling",
    "detectors",
    "get_detector",
    "hint_owners",
    "indexer_rows",
    "mixed_check",
    "mixed_split",
    "size_hint_reading",
    "view_pooling",
]

Detector = Callable[[Any, LayoutHints], tuple[EngineKVFormat, DiscoverableKVCache]]
MixedCheck = Callable[[Any, LayoutHints], None]
MixedSplit = Callable[[Any, LayoutHints], "tuple[list[Any], list[Any]] | None"]
"""Two lists of leaves a mixed registration splits into, each detected as its own kernel
group (SGLang's K and V of different head sizes), or None."""
IndexerRows = Callable[[Any], "EngineKVFormat | None"]
"""The DSA indexer format a layer holds where its detector reads it as opaque pages, or None."""
ViewPooling = Callable[[Any, LayoutHints], "tuple[Any, LayoutHints] | None"]
"""The tensor a registration's views tile and the hints it reads with, or None."""
SizeHints = Callable[[Any, EngineKVFormat, LayoutHints], LayoutHints]
"""The size hints a detected registration's leaves are checked against."""


@functools.cache
def _modules() -> Mapping[EngineType, Any]:
    package = importlib.import_module(__package__ or "kvlayout.detection")
    found: dict[EngineType, Any] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        engine = getattr(module, "ENGINE", None)
        if engine is None:
            continue
        if not isinstance(engine, EngineType):
            raise KVLayoutError(f"{module.__name__}.ENGINE is {engine!r}, not an EngineType")
        if engine in found:
            raise KVLayoutError(f"two detectors for {engine.value}: {module.__name__} and another module")
        found[engine] = module
    return MappingProxyType(found)


@functools.cache
def detectors() -> Mapping[EngineType, Detector]:
    return MappingProxyType({engine: module.discover for engine, module in _modules().items()})


def mixed_check(engine: EngineType) -> MixedCheck | None:
    """The engine's ``refuse_mixed``, if its detector module has one."""
    module = _modules().get(engine)
    return None if module is None else getattr(module, "refuse_mixed", None)


def mixed_split(engine: EngineType) -> MixedSplit | None:
    """The engine's ``split_mixed``, if its detector module has one."""
    module = _modules().get(engine)
    return None if module is None else getattr(module, "split_mixed", None)


def view_pooling(engine: EngineType) -> ViewPooling | None:
    """The engine's ``pool_views``, if its detector module has one."""
    module = _modules().get(engine)
    return None if module is None else getattr(module, "pool_views", None)


def indexer_rows(engine: EngineType) -> IndexerRows | None:
    """The engine's ``indexer_format``, if its detector module has one."""
    module = _modules().get(engine)
    return None if module is None else getattr(module, "indexer_format", None)


@functools.cache
def hint_owners() -> Mapping[str, EngineType]:
    """Each layout hint one engine reads and no other, with that engine (``OWN_HINTS``)."""
    return MappingProxyType(
        {hint: engine for engine, module in _modules().items() for hint in getattr(module, "OWN_HINTS", ())}
    )


def get_detector(engine: EngineType) -> Detector:
    detector = detectors().get(engine)
    if detector is None:
        raise KVLayoutError(f"no KV cache detector for serving engine {engine.value}")
    return detector


def size_hint_reading(engine: EngineType) -> SizeHints | None:
    """The engine's ``size_hints``, if its detector module has one."""
    module = _modules().get(engine)
    return None if module is None else getattr(module, "size_hints", None)
