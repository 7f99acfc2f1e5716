"""describe(at=): a meta registration's tensors laid out from a made-up address, as its
docstring says: page-aligned, one after another, a page apart."""

from __future__ import annotations

import torch

import kvlayout


def test_tensors_described_at_an_address_are_page_aligned_and_a_page_apart() -> None:
    kv = [torch.empty(2, 8, 4, 2, 8, device="meta") for _ in range(3)]  # 4096 bytes each
    reg = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
    plane = reg.describe(at=4097).groups[0].planes[0]
    assert plane.span == 4096
    assert plane.addresses == (8192, 16384, 24576)  # the first page from 4097, then a page between
    odd = kvlayout.detect(
        [torch.empty(2, 3, 4, 2, 8, device="meta") for _ in range(2)], "vllm", {"kv_layout": "NHD"}
    )
    plane = odd.describe(at=1 << 40).groups[0].planes[0]
    assert plane.span == 1536 and plane.addresses == ((1 << 40), (1 << 40) + 8192)
