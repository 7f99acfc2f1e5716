"""ATOM: one MLA tensor ``[NB, BS, HS]`` per layer; hints are not needed (a
``kv_layout`` hint, default NHD, would choose between NHD and HND twins). ATOM's own
connectors get the MLA cache as token rows, ``[NB*BS, 1, HS]`` (its model runner's
view): ``tokens_per_block`` reads those rows in ATOM's blocks."""

from __future__ import annotations

from typing import Any

from kvlayout._generated.formats import EngineKVFormat
from kvlayout.detection.base import pick, probe, token_rows_in_blocks
from kvlayout.types import DiscoverableKVCache, EngineType, LayoutHints

ENGINE = EngineType.ATOM


def discover(kv: Any, hints: LayoutHints) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    p = probe(kv)
    fmt = pick(ENGINE, p, decide=[("kv_layout", "is_hnd", bool(hints.is_hnd))])
    return fmt, token_rows_in_blocks(ENGINE, fmt, kv, hints.tokens_per_block, p.describe)
