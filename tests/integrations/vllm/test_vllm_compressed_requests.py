"""A request through a compressed group (vLLM 0.33's ``tokens_per_state``: DeepSeek-V4's
compressed MLA latents and its indexer keys): its blocks hold ``block_size / ratio``
slots, and ``get_compressed_slot_mapping`` writes state ``q = p // ratio`` once token
``q * ratio + ratio - 1`` is in, at ``block_table[q // slots] * slots + q % slots``. A map
of such a group counts slots; a request's token count was refused naming only blocks."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import kvlayout
from kvlayout.integrations.vllm import apply_kv_cache_group_edits
from kvlayout.integrations.vllm import transfer_layers as vllm_transfer_layers
from kvlayout.testing.vllm import (
    DSV4_INDEXER,
    FLASHMLA,
    Backend,
    allocate_v033,
    dsv4_indexer_spec,
    dsv4_latent_spec,
    fill_random,
    make_engine,
)
from kvlayout.transfer import BlockMapError, block_map
from kvlayout.transfer.block_maps import chunk_shape_for, chunk_side
from tests.integrations.vllm.models import stored_then_loaded

pytest.importorskip("vllm.v1.kv_cache_interface")

BS, RATIO, NB, NL, TOKENS = 256, 4, 6, 2, 500
HINTS = {"kv_layout": "LBNHC", "kv_dim": 1}


def latent_spec() -> Any:
    return dsv4_latent_spec(BS, RATIO)


def registered(spec: Any, backend: Backend = FLASHMLA) -> tuple[dict[str, torch.Tensor], Any]:
    """vLLM 0.33's views (FlashMLA pages a 256-token block in 64-token kernel pages of 16
    slots; the indexer's backend takes it whole), through the edits."""
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(NL)}
    engine = make_engine(
        specs, [list(specs)], lambda s: backend.kernel_block_size(s.block_size), num_blocks=NB
    )
    buf, kv = allocate_v033(engine)
    fill_random(buf, 3)
    layers, groups = vllm_transfer_layers(engine.config, apply_kv_cache_group_edits(engine.config, kv, HINTS))
    return kv, kvlayout.detect(layers, "vllm", HINTS, layer_groups=groups)


def state_row(view: torch.Tensor, block_table: list[int], q: int, indexer: bool) -> torch.Tensor:
    """State ``q``'s bytes where vLLM wrote them: slot ``block_table[q // slots] * slots +
    q % slots``, addressed in the kernel pages ``bind_kv_cache`` squeezes to ``[pages, kslots, C]``
    (a block's kernel pages in order); the indexer's page is every slot's 128 fp8 values,
    then every slot's fp32 scale (``indexer_k_quant_and_cache``)."""
    pages = view.squeeze(1)
    kslots = pages.shape[1]
    slot = block_table[q // (BS // RATIO)] * (BS // RATIO) + q % (BS // RATIO)
    page = pages[slot // kslots].contiguous().view(torch.uint8).reshape(-1)
    o = slot % kslots
    if indexer:
        return torch.cat(
            [page[o * 128 : (o + 1) * 128], page[kslots * 128 + 4 * o : kslots * 128 + 4 * o + 4]]
        )
    row = page.numel() // kslots
    return page[o * row : (o + 1) * row]


@pytest.mark.parametrize("indexer", [False, True], ids=["latents", "indexer"])
def test_a_request_s_states_store_and_load_where_vllm_s_compressed_slots_are(indexer: bool) -> None:
    kv, registration = (
        registered(dsv4_indexer_spec(BS), DSV4_INDEXER) if indexer else registered(latent_spec())
    )
    group = registration.only_group()
    assert group.block_size == BS // RATIO
    states = TOKENS // RATIO  # the states vLLM has written for 500 tokens
    saved, loaded = [4, 1], [2, 5]
    chunk = stored_then_loaded(group, saved, loaded, states)
    for li, view in enumerate(kv.values()):
        for q in range(states):
            sent = state_row(view, saved, q, indexer)
            assert torch.equal(chunk[:, li, q].contiguous().view(torch.uint8).reshape(-1), sent)
            assert torch.equal(state_row(view, loaded, q, indexer), sent)


def test_a_request_s_token_count_is_refused_saying_that_it_counts_slots() -> None:
    _, registration = registered(latent_spec())
    group = registration.only_group()
    chunk = torch.zeros(chunk_shape_for(group, TOKENS)[0], dtype=torch.bfloat16)
    with pytest.raises(
        BlockMapError,
        match=re.escape(
            "src_blocks has 2 block ids; the request's 500 tokens (num_tokens) fill 8 blocks of 64: num_tokens "
            "and first_token count the rows its blocks hold (64 a block); a compressed cache's rows are slots "
            "of r tokens each (vLLM's tokens_per_state r): give num_tokens // r"
        ),
    ):
        block_map(group, chunk_side(group, chunk), [4, 1], [0], num_tokens=TOKENS)
    # more ids than the tokens fill: no such advice
    with pytest.raises(BlockMapError, match=r"fill 2 blocks of 64$"):
        block_map(group, chunk_side(group, chunk[:, :, :125].contiguous()), [4, 1, 3], [0], num_tokens=125)
