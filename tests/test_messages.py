"""Messages that name the right thing: each refusal says what the input looks like, what
was wrong with it and where, in the words a user can act on (one test per finding)."""

from __future__ import annotations

import re

import pytest
import torch

import kvlayout
from kvlayout import DetectionError, KVLayoutError, RegistrationError
from kvlayout import EngineKVFormat as F
from kvlayout.transfer import TransferError, prepare


def test_a_vllm_tensor_that_fits_no_format_is_shown_beside_what_the_formats_look_like() -> None:
    kv = [torch.zeros(3, 7, 16, 8, 128)]
    with pytest.raises(DetectionError) as refused:
        kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
    message = str(refused.value)
    assert "kv_caches[0]: shape (3, 7, 16, 8, 128), dtype torch.float32" in message
    assert "fits no vLLM format (with kv_layout=NHD): " in message and "kv_layout=False" not in message
    assert "NL_X_TWO_NB_BS_NH_HS needs dim 0 == 2 (got 3): NL x [2, NB, BS, NH, HS]" in message
    assert "NL_X_NB_TWO_BS_NH_HS needs dim 1 == 2 (got 7): NL x [NB, 2, BS, NH, HS]" in message
    with pytest.raises(DetectionError, match=re.escape("(with no kv_layout hint, so HND on cpu)")):
        kvlayout.detect(kv, "vllm")


def test_the_binder_names_the_stride_it_refuses() -> None:
    buf = torch.zeros(7 * 60)
    padded_blocks = buf.as_strided((2, 7, 3, 2, 4), (210, 30, 8, 4, 1))  # [2, NB, ...]: NB rows padded
    with pytest.raises(RegistrationError) as refused:
        kvlayout.bind([padded_blocks], F.NL_X_TWO_NB_BS_NH_HS)
    message = str(refused.value)
    assert "only dim-0 padding is allowed" not in message
    assert message.endswith(
        "needs [168, 24, 8, 4, 1]: dim 1 (NB, size 7) has stride 30, not 24 (its dim 0 is not the block "
        "axis, so no dim may be padded)"
    )
    padded_pair = buf.as_strided((7, 2, 3, 2, 4), (60, 30, 8, 4, 1))  # [NB, 2, ...]: K and V apart
    with pytest.raises(
        RegistrationError,
        match=re.escape(
            "dim 1 (TWO, size 2) has stride 30, not 24 (only its blocks, dim 0, may be padded apart"
        ),
    ):
        kvlayout.bind([padded_pair], F.NL_X_NB_TWO_BS_NH_HS)


def test_a_scrambled_blocks_first_pool_is_not_called_layer_major() -> None:
    pool = torch.zeros(4, 3, 2, 16, 8, 8)  # blocks-first [NB, NL, 2, BS, NH, HS]
    with pytest.raises(DetectionError) as refused:
        kvlayout.detect(pool.permute(2, 0, 1, 3, 4, 5), "vllm", {"kv_layout": "NHD"})  # K/V dim handed first
    message = str(refused.value)
    assert "so a layer-major pool" not in message and "register a blocks-first pool" not in message
    assert message.startswith(
        "kv_caches: dim 1 (size 4, stride 6144) is outer to dim 0 (size 2, stride 1024)"
    )
    assert "a blocks-first pool with its dims reordered: hand it over in memory order" in message


def test_a_sparse_chunk_is_called_sparse() -> None:
    plan = prepare([torch.zeros(2, 7, 3, 2, 4)], F.NL_X_TWO_NB_BS_NH_HS)
    shape, dtype = plan.chunk_shape(3)
    with pytest.raises(
        TransferError,
        match=re.escape("chunks[0] is a torch.sparse_coo tensor; a chunk is a dense (strided) tensor"),
    ):
        plan.store_blocks([1], [torch.zeros(shape, dtype=dtype).to_sparse()])


def test_a_layer_listed_twice_in_one_layer_group_is_named() -> None:
    kv = [torch.zeros(2, 7, 3, 2, 4) for _ in range(3)]
    with pytest.raises(KVLayoutError, match=re.escape("layer_index_groups[1] lists layer 2 twice")):
        kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"}, layer_groups=[[0], [1, 2, 2]])
    with pytest.raises(KVLayoutError, match=re.escape("layer 1 is in layer groups 0 and 1")):
        kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"}, layer_groups=[[0, 1], [1, 2]])
