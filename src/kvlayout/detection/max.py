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

import torch

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
        elif hints.num_layers is not None and _distinct(kv) > hints.num_layers:
            # MAX sends num_layers: per-layer buffers are at most that many (fewer where
            # layers share one), and per-device buffers would otherwise read as layers
            raise DetectionError(
                f"MAX: a list of {_distinct(kv)} distinct buffers is more than the per-layer buffers of "
                f"layout hint num_layers={hints.num_layers} (one [NB, KV, 1, BS, NH, HS] a layer); "
                "per-device buffers, one per TP shard, are each a registration of their own"
            )
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


def _distinct(kv: list[Any]) -> int:
    """The list's buffers, a layer registered twice (sharing another's) counted once."""
    return len({(t.device, t.data_ptr()) if isinstance(t, torch.Tensor) else id(t) for t in kv})
