"""ATOM: one MLA tensor ``[NB, BS, HS]`` per layer; hints are not needed (a
``kv_layout`` hint, default NHD, would choose between NHD and HND twins)."""

from __future__ import annotations

from typing import Any

from kvlayout._generated.formats import EngineKVFormat
from kvlayout.detection.base import pick, probe
from kvlayout.types import DiscoverableKVCache, EngineType, LayoutHints

ENGINE = EngineType.ATOM


def discover(kv: Any, hints: LayoutHints) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    return pick(ENGINE, probe(kv), decide=[("kv_layout", "is_hnd", bool(hints.is_hnd))]), kv
