"""Dynamo KVBM's fully contiguous pools: each block layout its ``kvbm_layout`` hint names
(``KvBlockLayout::name()``) reads as its format, and what is not such a pool is refused,
naming what was wrong."""

from __future__ import annotations

import re

import pytest
import torch

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout.detection.base import DetectionError
from kvlayout.detection.kvbm import block_shape
from kvlayout.types import LayoutHintError

NB, NL, NO, NT, NH, HD = 5, 3, 2, 4, 6, 8

# KVBM's block layouts (kv_block_layout.rs), the pool's shape and the format each reads as.
POOLS = {
    "universal_tp": ((NB, NH, NL, NO, NT, HD), F.NB_NH_NL_TWO_BS_HS),
    "universal_pp": ((NB, NL, NH, NO, NT, HD), F.NB_NL_NH_TWO_BS_HS),
    "operational_nhd": ((NB, NL, NO, NT, NH, HD), F.NB_NL_TWO_BS_NH_HS),
    "operational_hnd": ((NB, NL, NO, NH, NT, HD), F.NB_NL_TWO_NH_BS_HS),
}
# KvBlockLayout::dim_order(), outermost first, hd innermost
DIM_ORDER = {
    "universal_tp": ("nh", "nl", "no", "nt"),
    "universal_pp": ("nl", "nh", "no", "nt"),
    "operational_nhd": ("nl", "no", "nt", "nh"),
    "operational_hnd": ("nl", "no", "nh", "nt"),
}


@pytest.mark.parametrize("name", sorted(POOLS))
def test_each_block_layout_reads_as_its_format(name: str) -> None:
    shape, fmt = POOLS[name]
    reg = kvlayout.detect(torch.zeros(shape, dtype=torch.bfloat16), "KVBM", {"kvbm_layout": name.upper()})
    group = reg.only_group()
    assert reg.format is fmt
    assert (group.num_blocks, group.block_size, kvlayout.get_num_heads(reg.registered_kv, fmt)) == (
        NB,
        NT,
        NH,
    )
    assert kvlayout.get_num_layers(reg.registered_kv, fmt) == NL


def test_the_same_shape_reads_as_the_layout_named() -> None:
    """A universal_tp pool of as many heads as layers has an operational pool's shape too:
    the hint, not the shape, says which bytes are which."""
    pool = torch.zeros(NB, 4, 4, 2, NT, HD)
    tp = kvlayout.detect(pool, "kvbm", {"kvbm_layout": "universal_tp"})
    pp = kvlayout.detect(pool, "kvbm", {"kvbm_layout": "universal_pp"})
    assert (tp.format, pp.format) == (F.NB_NH_NL_TWO_BS_HS, F.NB_NL_NH_TWO_BS_HS)


@pytest.mark.parametrize("name", sorted(POOLS))
def test_an_mla_pool_reads_as_latents_in_every_layout(name: str) -> None:
    sizes = {"nh": 1, "nl": NL, "no": 1, "nt": NT}
    pool = torch.zeros(NB, *(sizes[d] for d in DIM_ORDER[name]), 576, dtype=torch.bfloat16)
    reg = kvlayout.detect(pool, "kvbm", {"kvbm_layout": name})
    assert reg.format is F.NB_NL_ONE_BS_HS
    assert reg.registered_kv.data_ptr() == pool.data_ptr()
    assert tuple(reg.registered_kv.shape) == (NB, NL, 1, NT, 576)


def test_block_shape_names_kvbm_symbols() -> None:
    assert block_shape("universal_tp") == "[num_blocks, nh, nl, no, nt, hd]"
    assert block_shape("operational_hnd") == "[num_blocks, nl, no, nh, nt, hd]"


REFUSALS = [
    (
        torch.zeros(NB, NH, NL, NO, NT, HD),
        {},
        DetectionError,
        r"pass layout hint kvbm_layout.*shapes cannot tell",
    ),
    (
        [torch.zeros(NB, NH, NL, NO, NT, HD)],
        {"kvbm_layout": "universal_tp"},
        DetectionError,
        r"kv_caches\[0\].*a fully contiguous pool is one tensor.*layer-separate",
    ),
    (
        torch.zeros(NB, NH * NL * NO * NT * HD),
        {"kvbm_layout": "universal_tp"},
        DetectionError,
        re.escape("is not the pool's 6-D view; register pool.view(num_blocks, nh, nl, no, nt, hd)"),
    ),
    (
        torch.zeros(NB, NH, NL, NO, NT * HD),
        {"kvbm_layout": "universal_tp"},
        DetectionError,
        re.escape("is not the pool's 6-D view; register pool.view(num_blocks, nh, nl, no, nt, hd)"),
    ),
    (
        torch.zeros(NB, 1, NH, NL, NO, NT, HD),
        {"kvbm_layout": "universal_tp"},
        DetectionError,
        re.escape("shape (5, 1, 6, 3, 2, 4, 8), dtype torch.float32 is not the pool's 6-D view"),
    ),
    (
        torch.zeros(NB, NL, 3, NT, NH, HD),
        {"kvbm_layout": "operational_nhd"},
        DetectionError,
        r"no \(dim 2\) is 3; KVBM's outer dim is 2 \(K and V\) or 1",
    ),
    (
        torch.zeros(NB, NH, NL, 1, NT, HD),
        {"kvbm_layout": "universal_tp"},
        DetectionError,
        r"no is 1 \(MLA's latent\) with nh 6; an MLA pool holds one latent head",
    ),
    (
        torch.zeros(NB, NH, NL, NO, NT, HD),
        {"kvbm_layout": "universal_tp", "kv_layout": "NHD"},
        LayoutHintError,
        r"kv_layout=NHD contradicts layout hint kvbm_layout=universal_tp, whose heads are before its tokens",
    ),
    (
        torch.zeros(NB, NH, NL, NO, NT, HD),
        {"kvbm_layout": "universal"},
        LayoutHintError,
        r"kvbm_layout='universal' is not one of universal_tp, universal_pp, operational_nhd, operational_hnd",
    ),
]


@pytest.mark.parametrize(("kv", "hints", "error", "message"), REFUSALS)
def test_what_is_no_kvbm_pool_is_refused(
    kv: torch.Tensor | list[torch.Tensor], hints: dict[str, str], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        kvlayout.detect(kv, "kvbm", hints)


def test_the_hint_is_kvbm_s_alone() -> None:
    with pytest.raises(LayoutHintError, match="kvbm_layout is Dynamo KVBM's, and vLLM does not read it"):
        kvlayout.detect(torch.zeros(NB, NL, NO, NT, NH, HD), "vllm", {"kvbm_layout": "operational_nhd"})
