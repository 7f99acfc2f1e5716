"""Block maps whose two sides' strides coincide by accident: a source's head stride that
equals the destination's block of heads, in other block sizes. The property tests draw
few examples a pair of formats; these pin the coincidences byte for byte against the
offset oracle (``check_map``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvlayout import EngineKVFormat as F
from kvlayout.registration.shards import Shard
from tests.transfer.test_block_maps import check_map, make_side


@pytest.mark.parametrize("tokens", [16, 29, 48])
def test_bhlnc_heads_as_far_apart_as_an_hnd_block_are_not_one_stretch(tokens: int) -> None:
    # vLLM's BHLNC (layers inside heads inside blocks) of 2 layers in blocks of 8: a head's
    # rows of one block are 16 rows apart, as an HND block of 16 tokens spaces its heads;
    # still the source's 16 rows are two layers' 8 tokens, not one layer's 16
    shard = Shard(0, 1, 2)
    common: dict[str, Any] = dict(layers=2, row=2, planes=1, kv=2, dtype=torch.uint8, pad=0, shard=shard)
    src = make_side(F.NB_NH_NL_BS_CS, blocks=8, bs=8, heads=2, seed=1, **common)
    dst = make_side(F.NL_X_NB_NH_BS_CS, blocks=4, bs=16, heads=2, seed=2, **common)
    n_src, n_dst = -(-tokens // 8), -(-tokens // 16)
    check_map(src, dst, [5, 2, 7, 0, 3, 1][:n_src], [2, 0, 3][:n_dst], tokens, 1)
