"""SGLang's DSA (DeepSeek-V3.2) MLA pool with FP8 latents: ``MLATokenToKVPool(use_dsa=True,
override_kv_cache_dim=656)`` under ``kv_cache_dtype=fp8_e4m3`` keeps per layer uint8
``[size + page_size, 1, 656]``, a token's FlashMLA sparse record whole (``quant_k_cache``:
512 fp8 NoPE bytes, 4 float32 tile scales, 64 bf16 RoPE values), the record vLLM's
``fp8_ds_mla`` cache keeps a token, ``[num_blocks, block_size, 656]`` uint8.

The oracles read SGLang's row ``kv_buffer[l][loc, 0]`` (``set_mla_kv_buffer`` writes row
``loc``), vLLM's ``kv_cache[l][block, slot]``, and the HiCache host pool's
(``MLATokenToKVPoolHost`` with ``override_kv_cache_dim``, ``layer_first``: ``[NL, size, 1,
656]``) ``kv_buffer[l, loc, 0]``.
"""

from __future__ import annotations

import torch

import kvlayout
from kvlayout.transfer import block_map

LAYERS, PAGE, RECORD = 3, 64, 656  # 512 + 4 * 4 + 64 * 2; SGLang's DSA page size on CUDA


def test_a_request_moves_into_vllm_fp8_ds_mla_and_to_the_host_pool_record_for_record() -> None:
    gen = torch.Generator().manual_seed(5)
    sgl = [
        torch.randint(0, 256, (5 * PAGE, 1, RECORD), dtype=torch.uint8, generator=gen) for _ in range(LAYERS)
    ]
    vllm = [torch.zeros(6, PAGE, RECORD, dtype=torch.uint8) for _ in range(LAYERS)]
    host = torch.zeros(LAYERS, 8 * PAGE, 1, RECORD, dtype=torch.uint8)
    a = kvlayout.detect(sgl, "sglang", {"tokens_per_block": PAGE})
    b = kvlayout.detect(vllm, "vllm")
    h = kvlayout.detect(host, "sglang", {"hicache_layout": "layer_first", "tokens_per_block": PAGE})
    tokens = PAGE + 7
    block_map(a, b, [3, 1], [2, 5], num_tokens=tokens).copy()
    block_map(a, h, [3, 1], [6, 2], num_tokens=tokens).copy()
    for layer in range(LAYERS):
        want_v, want_h = torch.zeros_like(vllm[layer]), torch.zeros_like(host[layer])
        for i in range(tokens):
            src = sgl[layer][(3 if i < PAGE else 1) * PAGE + i % PAGE, 0]
            want_v[2 if i < PAGE else 5, i % PAGE] = src
            want_h[(6 if i < PAGE else 2) * PAGE + i % PAGE, 0] = src
        assert torch.equal(vllm[layer], want_v)
        assert torch.equal(host[layer], want_h)
