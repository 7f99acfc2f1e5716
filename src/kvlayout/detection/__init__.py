"""Detection: the only engine-aware layer.

One module per engine (``vllm``, ``sglang``, ``trtllm``, ``atom``), each a single
``discover(kv, hints)``, found by :mod:`kvlayout.detection.registry`; the shared checks
and the algebra-driven format picker are in :mod:`kvlayout.detection.base`; the public
entry points are in :mod:`kvlayout.detection.discovery`; :mod:`kvlayout.detection.indexers`
finds and drops DSA indexer caches by the detected format's ``is_indexer`` fact.

It knows each engine's registration shapes and hints, and uses the registration layer to
bind what it picked. An engine's quirks live only in its own module: a detector must
not know another engine's, and this layer must not know the facade, transfer or tools.
"""

from kvlayout.detection.base import DetectionError
from kvlayout.detection.discovery import (
    normalize_and_discover_per_layer_formats,
    normalize_kv_and_discover_format,
)

__all__ = ["DetectionError", "normalize_and_discover_per_layer_formats", "normalize_kv_and_discover_format"]
