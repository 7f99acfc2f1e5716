"""SGLang integration: its Mamba state pools, read as registrations a block map moves.

SGLang keeps a hybrid model's linear-attention state apart from its KV pool: one state
per request slot and layer, in a device pool (``MambaPool``, also reached as
``req_to_token_pool.mamba_pool``) and, with HiCache, a host pool (``MambaPoolHost``).
:func:`mamba_state_pools` reads either as one registration per state tensor (each conv
state, then the SSM state): block ids are SGLang's slot indices, and a block map moves
a request's state between a device pool and a host pool, two instances, or (given the
model's Mamba type) two TP degrees. :func:`vectorized_kv_pools` reads the KV pool that
ROCm's AITER backend lays out in 5-D vectors (``SGLANG_AITER_KV_CACHE_LAYOUT=vectorized_5d``)
as opaque pages, K and V each a registration; :func:`flashmla_kv_pages` and
:func:`aiter_fp4_indexer_pages` read DeepSeek-V4's FlashMLA KV pages and ROCm FP4 indexer
pages so, whole pages as SGLang's P/D moves them, and :func:`compress_state_rings` its
compressor states (device or HiCache host) a ring at a time, block ids SGLang's SWA pages or
request slots; :func:`mxfp8_scale_pools` reads the UE8M0 scale buffers of its MXFP8 pool
(``MHATokenToKVPoolMXFP8``), whole interleaved pages or flat slot rows, and
:func:`mxfp8_host_scale_pools` its HiCache host pool's, :func:`dynamic_fp8_host_scales`
the dynamic-FP8 pool's host scales; :func:`fp4_scale_pools` reads the block scales of its FP4
pool (``nvfp4`` / ``fp4_mx_block16``), linear slot rows or TRT-LLM's native pages, and
:func:`fp4_host_scale_pools` its HiCache host pool's (``MHATokenToKVPoolFP4Host``). SGLang
itself is not imported: pools are read structurally.
"""

from kvlayout.integrations.sglang.deepseek_v4 import (
    DeepSeekV4PoolError,
    aiter_fp4_indexer_pages,
    compress_state_rings,
    flashmla_kv_pages,
)
from kvlayout.integrations.sglang.dynamic_fp8 import DynamicFp8ScaleError, dynamic_fp8_host_scales
from kvlayout.integrations.sglang.fp4 import Fp4ScaleError, fp4_host_scale_pools, fp4_scale_pools
from kvlayout.integrations.sglang.mamba import MAMBA_TYPES, MambaPoolError, mamba_state_pools
from kvlayout.integrations.sglang.mxfp8 import Mxfp8ScaleError, mxfp8_host_scale_pools, mxfp8_scale_pools
from kvlayout.integrations.sglang.vectorized import VectorizedPoolError, vectorized_kv_pools

__all__ = [
    "MAMBA_TYPES",
    "DeepSeekV4PoolError",
    "DynamicFp8ScaleError",
    "Fp4ScaleError",
    "MambaPoolError",
    "Mxfp8ScaleError",
    "VectorizedPoolError",
    "aiter_fp4_indexer_pages",
    "compress_state_rings",
    "dynamic_fp8_host_scales",
    "flashmla_kv_pages",
    "fp4_host_scale_pools",
    "fp4_scale_pools",
    "mamba_state_pools",
    "mxfp8_host_scale_pools",
    "mxfp8_scale_pools",
    "vectorized_kv_pools",
]
