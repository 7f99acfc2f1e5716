"""Telling DSA indexer key caches apart from attention caches, so callers can drop them.

DeepSeek sparse-attention models register one uint8 indexer key cache per sparse layer
beside the attention caches. Whether a tensor is one is a layout fact (``is_indexer``:
its rows are blocked-scale records, values then scales), asked of the format the
engine's detector reads the tensor as: no shape or dtype is listed here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from kvlayout._generated.formats import LAYOUTS
from kvlayout.detection.base import DetectionError
from kvlayout.detection.discovery import normalize_kv_and_discover_format
from kvlayout.detection.registry import indexer_rows
from kvlayout.registration.nesting import first_leaf
from kvlayout.registration.opaque import opaque_pages_of
from kvlayout.types import EngineLike, HintsLike, LayoutHints, as_engine

__all__ = ["drop_indexer_caches", "is_indexer_cache"]

_log = logging.getLogger("kvlayout")


def is_indexer_cache(
    kv_cache: torch.Tensor, serving_engine: EngineLike, layout_hints: HintsLike = None
) -> bool:
    """Whether one layer's tensor is a DSA indexer key cache, as ``serving_engine``'s
    detector reads it (as a one-layer registration).

    False for a tensor the detector reads as another format, and for one it recognizes as
    no format of that engine (a ``DetectionError``; LMCache answers False when its
    detector finds nothing). Bad hints raise ``LayoutHintError`` and a value that is not
    a tensor ``TypeError``, as detection does.
    """
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache is a {type(kv_cache).__name__}, not a tensor (one layer's cache)")
    try:
        fmt, out = normalize_kv_and_discover_format([kv_cache], serving_engine, layout_hints)
    except DetectionError:
        return False
    if LAYOUTS[fmt].is_indexer:
        return True
    # an indexer its detector reads as opaque pages (vLLM's written on ROCm) is one too
    rows = indexer_rows(as_engine(serving_engine))
    return opaque_pages_of(first_leaf(out)) is not None and rows is not None and rows(kv_cache) is not None


def drop_indexer_caches(
    kv_caches: Mapping[str, torch.Tensor], serving_engine: EngineLike, layout_hints: HintsLike = None
) -> dict[str, torch.Tensor]:
    """``kv_caches`` without its indexer caches: the other entries in their order, the
    same tensor objects. Tensors alike (shape, strides, dtype, device) are asked once.
    Logs one INFO line with the counts when something is dropped."""
    if not isinstance(kv_caches, Mapping):
        raise TypeError(f"kv_caches is a {type(kv_caches).__name__}, not a mapping of layer name to tensor")
    engine, hints = as_engine(serving_engine), LayoutHints.coerce(layout_hints)
    answers: dict[tuple[Any, ...], bool] = {}
    kept: dict[str, torch.Tensor] = {}
    for name, tensor in kv_caches.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"kv_caches[{name!r}] is a {type(tensor).__name__}, not a tensor")
        key = (tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)
        if key not in answers:
            answers[key] = is_indexer_cache(tensor, engine, hints)
        if not answers[key]:
            kept[name] = tensor
    dropped = len(kv_caches) - len(kept)
    if dropped:
        _log.info("Dropped %d DSA indexer cache(s); kept %d KV cache(s)", dropped, len(kept))
    return kept
