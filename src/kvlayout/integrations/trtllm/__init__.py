"""TRT-LLM integration: what its PyTorch backend hands a connector beyond the one KV pool
tensor ``kvlayout.detect(pool, "trtllm", hints)`` reads.

:func:`kv_cache_layout_pools` reads ``KVCacheManagerV2``'s ``KvCacheLayout`` (what
``register_kv_cache_layout`` receives: regions per layer group, not one pool tensor);
:func:`mamba_state_pools` a hybrid model's Mamba states (conv and SSM, kept apart from
the KV pool, or in V2's pool a view a layer), slot to slot and between TP degrees as
TRT-LLM's transceiver splits them. TRT-LLM is not imported: its objects are read
structurally.
"""

from kvlayout.integrations.trtllm.layout import KvCacheLayoutError, kv_cache_layout_pools
from kvlayout.integrations.trtllm.mamba import MambaStateError, mamba_state_pools

__all__ = ["KvCacheLayoutError", "MambaStateError", "kv_cache_layout_pools", "mamba_state_pools"]
