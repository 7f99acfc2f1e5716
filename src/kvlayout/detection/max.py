"""Modular MAX: one cross-layer buffer ``[NB, KV, NL, BS, NH, HS]`` (a bare tensor, or a
one-element list of it); KV is 2 (K and V) or 1 (MLA, one latent plane).

MAX sends its sizes as hints (``num_layers``, ``kv_dim``, ``tokens_per_block`` and its
alias ``page_size``, ``num_kv_heads``, ``head_dim``, ``total_num_blocks``) and the
format's name as ``layout_format``: the buffer needs none of them, and every one given
is checked against it. LMCache's MAX branch reads no hints.
"""

from __future__ import annotations

from typing import Any

from kvlayout._generated.formats import EngineKVFormat
from kvlayout.detection.base import DetectionError, pick, probe
from kvlayout.types import DiscoverableKVCache, EngineType, LayoutHints

ENGINE = EngineType.MAX


def discover(kv: Any, hints: LayoutHints) -> tuple[EngineKVFormat, DiscoverableKVCache]:
    if isinstance(kv, list):
        if len(kv) != 1 or isinstance(kv[0], list):
            what = f"a list of {len(kv)} entries" if len(kv) != 1 else "a nested list"
            raise DetectionError(f"MAX registers one KV buffer tensor [NB, KV, NL, BS, NH, HS], got {what}")
        kv = kv[0]
    p = probe(kv)
    # size hints are checked after, as for every engine (discovery's check_size_hints)
    return pick(ENGINE, p, decide=[("kv_layout", "is_hnd", bool(hints.is_hnd))]), kv
