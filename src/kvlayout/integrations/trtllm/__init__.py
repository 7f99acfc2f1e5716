"""TRT-LLM integration: what its PyTorch backend hands a connector beyond the one KV pool
tensor ``kvlayout.detect(pool, "trtllm", hints)`` reads.

:func:`mamba_state_pools` reads a hybrid model's Mamba states (conv and SSM, kept apart
from the KV pool, or in V2's pool a view a layer), slot to slot and between TP degrees as
TRT-LLM's transceiver splits them. TRT-LLM is not imported: its objects are read
structurally.
"""

from kvlayout.integrations.trtllm.mamba import MambaStateError, mamba_state_pools

__all__ = ["MambaStateError", "mamba_state_pools"]
