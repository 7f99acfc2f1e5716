"""Modular MAX: one cross-layer buffer ``[NB, KV, NL, BS, NH, HS]`` (a bare tensor, or a
one-element list of it); KV is 2 (K and V) or 1 (MLA, one latent plane). Under
``per_layer_buffers`` MAX allocates one single-layer buffer per layer instead (its
``values_per_layer``): a list of ``NL`` buffers ``[NB, KV, 1, BS, NH, HS]``.

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
        if any(isinstance(entry, list) for entry in kv):
            raise DetectionError(
                "MAX registers one KV buffer tensor [NB, KV, NL, BS, NH, HS], or a list of "
                "single-layer buffers [NB, KV, 1, BS, NH, HS] (per_layer_buffers), got a nested list"
            )
        if len(kv) == 1:
            kv = kv[0]  # the one buffer, whatever its layers
    p = probe(kv)
    # size hints are checked after, as for every engine (discovery's check_size_hints)
    try:
        return pick(ENGINE, p, decide=[("kv_layout", "is_hnd", bool(hints.is_hnd))]), kv
    except DetectionError as e:
        if not isinstance(kv, list):
            raise
        raise DetectionError(
            f"{e} (a list is MAX's per-layer buffers; its per-device buffers, one per TP shard, "
            "are each a registration of their own)"
        ) from e
