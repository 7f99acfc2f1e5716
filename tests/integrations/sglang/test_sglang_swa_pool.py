"""SGLang's SWAKVPool (gpt-oss, Gemma) in a P/D transfer: the full layers' pool moves the
request's pages, the sliding-window layers' pool (``swa_kv_pool``, its own size, what
``get_state_buf_infos`` hands over as state ``"swa"``) only the window's tokens, the pages
the window dropped given as SGLang's padding page 0 on both sides (pd-connectors.md).

The oracle is SGLang's indexing: token ``p`` is row ``page[p // page_size] * page_size +
p % page_size`` of each per-layer K and V buffer; every other row must stay zero.
"""

from __future__ import annotations

import torch

import kvlayout
from kvlayout.transfer import Shard, block_map, join_maps

LAYERS, HEADS, HEAD_DIM = 3, 4, 16


def pool(rows: int, heads: int, seed: int | None) -> list[torch.Tensor]:
    """An MHA pool's ``k_buffer + v_buffer``: per layer ``[rows, heads, head_dim]``."""
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    if gen is None:
        return [torch.zeros(rows, heads, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2 * LAYERS)]
    return [torch.randn(rows, heads, HEAD_DIM, generator=gen).to(torch.bfloat16) for _ in range(2 * LAYERS)]


def test_swa_layers_move_the_window_and_full_layers_every_token() -> None:
    tokens, window = 100, 30  # the window starts inside a page: token 70 of page 4
    p_size, d_size = 16, 1  # prefill pages of 16 tokens, decode pages of one
    first = tokens - window
    full_src, swa_src = pool(17 * 16, HEADS, 1), pool(9 * 16, HEADS, 2)  # TP 1: every head
    full_dst, swa_dst = pool(200, HEADS // 2, None), pool(120, HEADS // 2, None)  # rank 1 of 2
    hints = {"kv_list_layout": "k_v", "tokens_per_block": p_size}
    dhints = {"kv_list_layout": "k_v", "tokens_per_block": d_size}
    detect = kvlayout.detect
    src = {"full": detect(full_src, "sglang", hints), "swa": detect(swa_src, "sglang", hints)}
    dst = {"full": detect(full_dst, "sglang", dhints), "swa": detect(swa_dst, "sglang", dhints)}
    full_pages = ([9, 2, 14, 3, 5, 11, 1], [1 + (7 * p) % 199 for p in range(tokens)])
    live = 7 - first // p_size  # prefill pages holding window tokens: 4, 5, 6
    swa_pages = (
        [0] * (7 - live) + [6, 2, 8],
        [0] * first + [100 - i for i in range(window)],  # one token a page on decode
    )
    src_shard, dst_shard = Shard(0, 1, HEADS), Shard(1, 2, HEADS)
    request = join_maps(
        [
            block_map(
                src["full"],
                dst["full"],
                *full_pages,
                num_tokens=tokens,
                src_shard=src_shard,
                dst_shard=dst_shard,
            ),
            block_map(
                src["swa"],
                dst["swa"],
                *swa_pages,
                num_tokens=tokens,
                first_token=first,
                src_shard=src_shard,
                dst_shard=dst_shard,
            ),
        ]
    )
    assert request.copy() == 1
    for name, (s_pool, d_pool, (sp, dp), start) in {
        "full": (full_src, full_dst, full_pages, 0),
        "swa": (swa_src, swa_dst, swa_pages, first),
    }.items():
        for s, d in zip(s_pool, d_pool, strict=True):
            want = torch.zeros_like(d)
            for p in range(start, tokens):
                want[dp[p // d_size] * d_size + p % d_size] = s[sp[p // p_size] * p_size + p % p_size, 2:]
            assert torch.equal(d, want), name
    assert request.num_bytes == (tokens + window) * 2 * LAYERS * (HEADS // 2) * HEAD_DIM * 2
