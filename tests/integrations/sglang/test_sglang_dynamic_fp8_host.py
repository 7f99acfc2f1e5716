"""SGLang's dynamic-FP8 MHA pool's HiCache host scales (``MHATokenToKVPoolDynamicFP8Host.scale_host``,
float32 ``[page_num, 2, layer_num, page_size, head_num]``), read by
``kvlayout.integrations.sglang.dynamic_fp8_host_scales``: a backup and a load move the
bytes SGLang's own copies move (``backup_from_device_all_layer``: a page of device slots,
reshaped ``[pages, page_size, head_num]``, lands at ``scale_host[host_page, 0 or 1, layer]``;
``load_to_device_per_layer`` the reverse)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvlayout
from kvlayout.integrations.sglang import DynamicFp8ScaleError, dynamic_fp8_host_scales
from kvlayout.transfer import block_map

PS, H, NL, DEVICE_PAGES, HOST_PAGES = 16, 4, 3, 9, 7


def device_scales() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``k_scale_buffer`` and ``v_scale_buffer``: per layer ``[size + page_size, head_num]``."""
    g = torch.Generator().manual_seed(5)
    return tuple(  # type: ignore[return-value]
        [torch.rand(DEVICE_PAGES * PS, H, generator=g) + 1 for _ in range(NL)] for _ in range(2)
    )


def device_registration(k: list[torch.Tensor], v: list[torch.Tensor]) -> Any:
    return kvlayout.detect(
        [[t.unsqueeze(-1) for t in k], [t.unsqueeze(-1) for t in v]], "sglang", {"tokens_per_block": PS}
    )


def sglang_backup(
    scale_host: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor], dev: list[int], host: list[int]
) -> None:
    """SGLang's own backup of pages ``dev`` to host pages ``host``."""
    idx = torch.tensor([p * PS + j for p in dev for j in range(PS)])
    for layer in range(NL):
        scale_host[:, 0][host, layer] = k[layer].index_select(0, idx).reshape(len(dev), PS, H)
        scale_host[:, 1][host, layer] = v[layer].index_select(0, idx).reshape(len(dev), PS, H)


def test_a_backup_moves_what_sglang_moves_and_nothing_else() -> None:
    k, v = device_scales()
    dev_pages, host_pages = [5, 1, 7], [2, 6, 3]
    expected = torch.zeros(HOST_PAGES, 2, NL, PS, H)
    sglang_backup(expected, k, v, dev_pages, host_pages)
    scale_host = torch.zeros(HOST_PAGES, 2, NL, PS, H)
    m = block_map(
        device_registration(k, v),
        dynamic_fp8_host_scales(scale_host),
        dev_pages,
        host_pages,
        num_tokens=len(dev_pages) * PS,
    )
    m.copy()
    assert torch.equal(scale_host, expected)
    # a device page's K (or V) scales of a layer are one run: 3 pages x 3 layers x K/V
    assert m.num_runs == len(dev_pages) * NL * 2


def test_a_load_puts_each_host_page_back_where_sglang_would() -> None:
    k, v = device_scales()
    scale_host = torch.zeros(HOST_PAGES, 2, NL, PS, H)
    sglang_backup(scale_host, k, v, [5, 1], [2, 6])
    k2, v2 = [torch.zeros_like(t) for t in k], [torch.zeros_like(t) for t in v]
    block_map(
        dynamic_fp8_host_scales(scale_host), device_registration(k2, v2), [2, 6], [3, 8], num_tokens=2 * PS
    ).copy()
    for layer in range(NL):
        for src, dst in ((5, 3), (1, 8)):
            assert torch.equal(k2[layer][dst * PS : (dst + 1) * PS], k[layer][src * PS : (src + 1) * PS])
            assert torch.equal(v2[layer][dst * PS : (dst + 1) * PS], v[layer][src * PS : (src + 1) * PS])
        untouched = torch.ones(DEVICE_PAGES * PS, dtype=torch.bool)
        for dst in (3, 8):
            untouched[dst * PS : (dst + 1) * PS] = False
        assert not k2[layer][untouched].any() and not v2[layer][untouched].any()


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([torch.zeros(2, 2, 1, 4, 1)], "scale_host is list, not a tensor"),
        (torch.zeros(2, 2, 1, 4, 1, dtype=torch.float16), "not float32 \\[page_num, 2"),
        (torch.zeros(2, 3, 1, 4, 1), "\\[2, 3, 1, 4, 1\\] torch.float32, not float32"),
        (torch.zeros(2, 2, 4, 1), "not float32 \\[page_num, 2"),
        (torch.zeros(0, 2, 1, 4, 1), "\\[0, 2, 1, 4, 1\\]"),
        (torch.zeros(2, 2, 1, 8, 1)[:, :, :, ::2], "SGLang allocates scale_host as one contiguous tensor"),
    ],
)
def test_what_is_no_host_scale_pool_is_refused_naming_it(bad: object, message: str) -> None:
    with pytest.raises(DynamicFp8ScaleError, match=message):
        dynamic_fp8_host_scales(bad)


def test_detect_names_the_reader_for_the_scale_tensor() -> None:
    scale_host = torch.zeros(HOST_PAGES, 2, NL, PS, H)
    with pytest.raises(kvlayout.DetectionError, match="dynamic_fp8_host_scales\\(scale_host\\) reads it"):
        kvlayout.detect(scale_host, "sglang", {"hicache_layout": "page_first_direct"})
