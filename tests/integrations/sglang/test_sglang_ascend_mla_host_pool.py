"""SGLang's Ascend MLA pools: the device pool (``NPUMLATokenToKVPool``) and its HiCache host
pool in ``page_first_kv_split``, the layout SGLang sets on Ascend for an MLA model with
HiCache (``hardware_backend/npu/utils.py``, ``set_default_server_args``).

The device pool splits a token's row: ``k_buffer`` ``[NL, size // page_size + 1,
page_size, 1, kv_lora_rank]`` (the latents) and ``v_buffer`` ``[..., qk_rope_head_dim]``
(the RoPE part), each one tensor; its P/D lists ``k_buffer[l]`` then ``v_buffer[l]``
(``get_contiguous_buf_infos``, an item a page) and ``set_kv_buffer`` writes slot ``loc`` at
``k_buffer[l].view(-1, 1, kv_lora_rank)[loc]``. The host pool (``MLATokenToKVPoolHost``,
``init_kv_buffer``) allocates ``k_buffer`` (also its ``kv_buffer``) and ``v_buffer`` as
``[page_num, NL, page_size, 1, C]``. The oracles index those tensors and nothing else.
"""

from __future__ import annotations

import re

import pytest
import torch

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout.transfer import block_map

LAYERS, PAGE, RANK, ROPE = 3, 16, 512, 64
DEVICE_PAGES, HOST_PAGES = 5, 7


def device_pool(seed: int | None) -> dict[str, torch.Tensor]:
    """``NPUMLATokenToKVPool``'s ``k_buffer`` and ``v_buffer`` (4 pages and the padding page)."""
    gen = None if seed is None else torch.Generator().manual_seed(seed)

    def make(width: int) -> torch.Tensor:
        shape = (LAYERS, DEVICE_PAGES, PAGE, 1, width)
        if gen is None:
            return torch.zeros(shape, dtype=torch.bfloat16)
        return torch.randn(shape, generator=gen).to(torch.bfloat16)

    return {"k": make(RANK), "v": make(ROPE)}


def host_pool() -> dict[str, torch.Tensor]:
    """``MLATokenToKVPoolHost`` in ``page_first_kv_split``: ``k_buffer`` and ``v_buffer``."""
    return {
        n: torch.zeros(HOST_PAGES, LAYERS, PAGE, 1, w, dtype=torch.bfloat16)
        for n, w in (("k", RANK), ("v", ROPE))
    }


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # bytes compare exactly


def device_row(pool: dict[str, torch.Tensor], name: str, layer: int, loc: int) -> torch.Tensor:
    buf = pool[name]
    return raw(buf[layer].view(-1, 1, buf.shape[-1])[loc])  # set_kv_buffer's slot


def host_row(pool: dict[str, torch.Tensor], name: str, layer: int, loc: int) -> torch.Tensor:
    return raw(pool[name][loc // PAGE, layer, loc % PAGE])  # init_kv_buffer's dims


def test_a_backup_and_its_load_move_each_token_where_sglang_reads_it() -> None:
    """Device pages 3 and 1 (21 tokens) into host pages 2 and 6, and back into pages 4 and 2
    of another device pool; K (latents) and V (RoPE) apart, as both pools keep them."""
    src, host, back = device_pool(1), host_pool(), device_pool(None)
    hints = {"hicache_layout": "page_first_kv_split", "tokens_per_block": PAGE}
    tokens = PAGE + 5
    for name in ("k", "v"):
        dev = kvlayout.detect(
            list(src[name]), "sglang"
        )  # the P/D list: k_buffer[l], [pages, page_size, 1, C]
        again = kvlayout.detect(list(back[name]), "sglang")
        on_host = kvlayout.detect(host[name], "sglang", hints)
        group = on_host.only_group()
        assert group.format is F.NB_NL_BS_ONE_HS and group.block_size == PAGE
        assert group.data_ptrs[0] == host[name].data_ptr()
        block_map(dev, on_host, [3, 1], [2, 6], num_tokens=tokens).copy()
        block_map(on_host, again, [2, 6], [4, 2], num_tokens=tokens).copy()
    moves = [(3, 2, 4), (1, 6, 2)]  # device page, host page, device page again
    for name in ("k", "v"):
        for layer in range(LAYERS):
            for i in range(tokens):
                sp, hp, bp = moves[i // PAGE]
                s, h, b = (p * PAGE + i % PAGE for p in (sp, hp, bp))
                assert torch.equal(host_row(host, name, layer, h), device_row(src, name, layer, s))
                assert torch.equal(device_row(back, name, layer, b), device_row(src, name, layer, s))
            # nothing else was written: the rest of the host pool and of the loaded pool are zeros
            written_host = {moves[i // PAGE][1] * PAGE + i % PAGE for i in range(tokens)}
            for h in range(HOST_PAGES * PAGE):
                if h not in written_host:
                    assert not host_row(host, name, layer, h).any(), (name, layer, h)
            assert int((raw(back[name][layer]) != 0).any(-1).sum()) == tokens


def test_an_mha_pool_has_no_page_first_kv_split_layout() -> None:
    """SGLang's MHA host pool raises for it (``MHATokenToKVPoolHost.init_kv_buffer``): a
    K/V tensor given that name is refused, not read as another layout."""
    with pytest.raises(
        kvlayout.DetectionError, match=re.escape("an MHA pool has no page_first_kv_split layout")
    ):
        kvlayout.detect(torch.zeros(2, 8, 3, 16, 4, 8), "sglang", {"hicache_layout": "page_first_kv_split"})
