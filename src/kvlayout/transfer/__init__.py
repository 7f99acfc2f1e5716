"""The transfer layer: moving a request's blocks between a paged KV cache and token-major
chunks, or another cache.

``plan`` prepares a kernel group's copies once (``prepare``, ``TransferPlan``) and runs
them on the native engine (``kvlayout._native``); ``cuda`` is the CUDA engine the plan
picks for a GPU cache (it is handed the plan and never imports ``plan``); ``block_maps``
maps one request between two registrations (any layout, block size or TP shard) as byte
runs (``slot_maps``: a side given as a slot mapping, re-paged for the same builder), and
``joined_maps`` joins a request's maps (one per kernel group or pool) into one;
``arguments`` checks the block ids and chunks callers pass; ``nixl`` moves block maps
between processes. This package exports the public names of the plans and block maps
(with ``Shard`` and ``RegistrationDescription``, which a map's sides take), so
``from kvlayout.transfer import block_map`` works.

It knows the bound registration's kernel groups, the algebra's copy plans and the
generated indexers. It must not know engines or format names (jobs, pieces and strides
all come from the layout), nor the facade.
"""

from kvlayout.registration.peers import PeerDescriptionError, RegistrationDescription
from kvlayout.registration.shards import Shard, ShardError
from kvlayout.transfer.block_maps import BlockMap, BlockMapError, block_map
from kvlayout.transfer.joined_maps import JoinedMap, join_maps
from kvlayout.transfer.plan import (
    TransferError,
    TransferPlan,
    chunk_shape,
    load_blocks,
    prepare,
    store_blocks,
)

__all__ = [
    "BlockMap",
    "BlockMapError",
    "JoinedMap",
    "PeerDescriptionError",
    "RegistrationDescription",
    "Shard",
    "ShardError",
    "TransferError",
    "TransferPlan",
    "block_map",
    "chunk_shape",
    "join_maps",
    "load_blocks",
    "prepare",
    "store_blocks",
]
