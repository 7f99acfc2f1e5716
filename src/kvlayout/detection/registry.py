"""Detectors, found by importing every module of this package that names an ``ENGINE``.

Adding an engine is adding a module with ``ENGINE`` and ``discover(kv, hints)``; nothing
here lists engines.
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

__all__ = ["Detector", "detectors", "get_detector"]

Detector = Callable[[Any, LayoutHints], tuple[EngineKVFormat, DiscoverableKVCache]]


@functools.cache
def detectors() -> Mapping[EngineType, Detector]:
    package = importlib.import_module(__package__ or "kvlayout.detection")
    found: dict[EngineType, Detector] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        engine = getattr(module, "ENGINE", None)
        if engine is None:
            continue
        if not isinstance(engine, EngineType):
            raise KVLayoutError(f"{module.__name__}.ENGINE is {engine!r}, not an EngineType")
        if engine in found:
            raise KVLayoutError(f"two detectors for {engine.value}: {module.__name__} and another module")
        found[engine] = module.discover
    return MappingProxyType(found)


def get_detector(engine: EngineType) -> Detector:
    detector = detectors().get(engine)
    if detector is None:
        raise KVLayoutError(f"no KV cache detector for serving engine {engine.value}")
    return detector
