"""ATOM integration: its MHA/GQA KV pool in AITER's SHUFFLE layout, read as registrations
a block map moves.

ATOM (ROCm/ATOM) allocates an MHA or GQA model's paged KV in the order AITER's fused
writer produces and its gather kernel reads in place (``mha_kv_pool.mha_kv_fields``):
per layer, K ``[num_blocks, H, D // X, block_size, X]`` and V ``[num_blocks, H,
block_size // X, D, X]``, ``X = 16 // itemsize``. Its connectors receive each layer as
``KVCacheTensor.k_cache`` / ``v_cache``. :func:`shuffled_kv_pools` reads the two
per-layer lists as opaque pages, K and V each a registration; :func:`indexer_pages` reads
its DSA indexer key cache at the backend's physical page size (one token a page by
default) in the pages the indexer writes. ATOM itself is not
imported: pools are read structurally.
"""

from kvlayout.integrations.atom.indexer import IndexerPagesError, indexer_pages
from kvlayout.integrations.atom.shuffled import ShuffledPoolError, shuffled_kv_pools

__all__ = ["IndexerPagesError", "ShuffledPoolError", "indexer_pages", "shuffled_kv_pools"]
