"""SGLang's MHA pools with per-token scales beside their K and V.

The FP4 pool (``MHATokenToKVPoolFP4``, ``_create_buffers``): per layer K and V
of packed e2m1 pairs, uint8 ``[size + page_size, H, D // 2]``, and their UE8M0 scales,
uint8 ``[size + page_size, H * D // 16]``, a token's scales one head after another
(``KVFP4QuantizeUtil.batched_quantize`` views ``[tokens, H, D]`` as ``[tokens, H * D //
16, 16]``; ``set_kv_buffer`` writes row ``loc``).

The oracle reads those tensors as SGLang indexes them: token slot ``loc``'s head ``h`` is
``k_buffer[l][loc, h]`` and its scales ``k_scale_buffer[l][loc, h * D // 16 : (h + 1) * D
// 16]``. The dynamic-FP8 pool (``MHATokenToKVPoolDynamicFP8``): float8_e4m3fn K and V and
one float32 scale a slot and head, ``k_scale_buffer[l]`` ``[size + page_size, H]``
(``_quantize`` returns ``[tokens, H]`` scales; a token's K is ``k_buffer[l][loc] *
k_scale_buffer[l][loc].unsqueeze(-1)``; its HiCache host pool reshapes
``k_scale_buffer[l][device_indices]`` to ``[pages, page_size, H]``). A request moves from a
TP 1 prefill into rank 1 of a TP 2 decode.
"""

from __future__ import annotations

import re

import pytest
import torch

import kvlayout
from kvlayout.transfer import Shard, block_map

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 4, 128, 16
SF = HEAD_DIM // 16  # scales a head


def fp4_pool(heads: int, seed: int | None) -> dict[str, list[torch.Tensor]]:
    slots = 5 * PAGE + PAGE  # size + page_size
    gen = None if seed is None else torch.Generator().manual_seed(seed)

    def make(*shape: int) -> torch.Tensor:
        if gen is None:
            return torch.zeros(shape, dtype=torch.uint8)
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)

    return {
        "k": [make(slots, heads, HEAD_DIM // 2) for _ in range(LAYERS)],
        "v": [make(slots, heads, HEAD_DIM // 2) for _ in range(LAYERS)],
        "k_scale": [make(slots, heads * SF) for _ in range(LAYERS)],
        "v_scale": [make(slots, heads * SF) for _ in range(LAYERS)],
    }


HINTS = {"kv_list_layout": "k_v", "tokens_per_block": PAGE}


def test_payload_and_scales_move_by_heads_between_tp_degrees() -> None:
    whole, dst = fp4_pool(HEADS, 1), fp4_pool(HEADS // 2, None)
    n = HEADS // 2
    payload = [kvlayout.detect(p["k"] + p["v"], "sglang", HINTS) for p in (whole, dst)]
    scales = [
        kvlayout.detect([t.view(t.shape[0], h, -1) for t in p["k_scale"] + p["v_scale"]], "sglang", HINTS)
        for p, h in ((whole, HEADS), (dst, n))
    ]
    for a, b in (payload, scales):
        m = block_map(
            a,
            b,
            [4, 2],
            [1, 3],
            num_tokens=PAGE + 6,
            src_shard=Shard(0, 1, HEADS),
            dst_shard=Shard(1, 2, HEADS),
        )
        m.copy()
    moved = {1 * PAGE + i: 4 * PAGE + i for i in range(PAGE)} | {3 * PAGE + i: 2 * PAGE + i for i in range(6)}
    for layer in range(LAYERS):
        for loc in range(dst["k"][0].shape[0]):
            for h in range(n):
                cols = slice(h * SF, (h + 1) * SF)
                src_cols = slice((n + h) * SF, (n + h + 1) * SF)  # rank 1 holds heads 2 and 3
                for name in ("k", "v"):
                    got, got_sf = dst[name][layer][loc, h], dst[f"{name}_scale"][layer][loc, cols]
                    if loc in moved:
                        assert torch.equal(got, whole[name][layer][moved[loc], n + h])
                        assert torch.equal(got_sf, whole[f"{name}_scale"][layer][moved[loc], src_cols])
                    else:
                        assert not got.any() and not got_sf.any()


def test_detect_names_the_head_major_reading_of_the_scales() -> None:
    p = fp4_pool(HEADS, None)
    with pytest.raises(
        kvlayout.DetectionError, match=re.escape("[t.view(t.shape[0], head_num, -1) for t in")
    ):
        kvlayout.detect(p["k_scale"] + p["v_scale"], "sglang", HINTS)


def test_dynamic_fp8_scales_move_by_heads_between_tp_degrees() -> None:
    slots, n = 6 * PAGE, HEADS // 2
    gen = torch.Generator().manual_seed(3)
    whole = [torch.rand(slots, HEADS, generator=gen) for _ in range(2 * LAYERS)]  # K's layers, then V's
    dst = [torch.zeros(slots, n) for _ in range(2 * LAYERS)]
    a, b = (kvlayout.detect([t.unsqueeze(-1) for t in ts], "sglang", HINTS) for ts in (whole, dst))
    block_map(
        a, b, [5, 1], [2, 4], num_tokens=PAGE + 1, src_shard=Shard(0, 1, HEADS), dst_shard=Shard(1, 2, HEADS)
    ).copy()
    moved = {2 * PAGE + i: 5 * PAGE + i for i in range(PAGE)} | {4 * PAGE: 1 * PAGE}
    for i, t in enumerate(dst):
        want = torch.zeros(slots, n)
        for loc, src_loc in moved.items():
            want[loc] = whole[i][src_loc, n:]  # rank 1's heads
        assert torch.equal(t.view(torch.int32), want.view(torch.int32))


def test_detect_names_the_dynamic_fp8_reading_of_the_scales() -> None:
    scales = [torch.zeros(6 * PAGE, HEADS) for _ in range(2 * LAYERS)]
    with pytest.raises(kvlayout.DetectionError, match=re.escape("[t.unsqueeze(-1) for t in k_scale_buffer")):
        kvlayout.detect(scales, "sglang", HINTS)
    with pytest.raises(kvlayout.DetectionError, match="K and V lists of 2-D tensors are no page buffers"):
        kvlayout.detect([scales[:LAYERS], scales[LAYERS:]], "sglang", {"tokens_per_block": PAGE})
