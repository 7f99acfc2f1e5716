"""ATOM: one MLA tensor ``[NB, BS, HS]`` per layer; hints are not needed."""

from __future__ import annotations

from typing import Any

from kvlayout._generated.formats import EngineKVFormat
from kvlayout.detection.base import pick, probe
from kvlayout.types import DiscoverableKVCache, EngineType, LayoutHints

ENGINE = EngineType.ATOM


def discover(kv: Any, hints: LayoutHints) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    return pick(ENGINE, probe(kv)), kv
