"""vLLM 0.33's DSA indexer K cache under ``indexer_kv_dtype="mxfp4"`` (DeepSeek-V4 on
Blackwell): a uint8 page a block of every slot's 64 packed e2m1 value bytes, then every
slot's 4 ue8m0 scale bytes (``indexer_k_store.py``: values at ``pos * 64``, scales at
``block_size * 64 + pos * 4``; the spec's head_size is 68). It is read as format 39
``NL_X_NB_BSV4_BSS4``, token-exact, and maps only to its like."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout.transfer import BlockMapError, block_map
from tests.integrations.vllm.models import (
    Backend,
    allocate_v033,
    detect_registered,
    dsv4_indexer_spec,
    uniform_engine,
)

MXFP4 = F.NL_X_NB_BSV4_BSS4
NB, NL = 6, 2
VALUES, SCALES = 64, 4  # TOKEN_STRIDE and SCALE_DIM of vLLM's writer under use_fp4_cache


def _engine(ratio: int, kv_dtype: str = "mxfp4") -> Any:
    """One kernel page an engine block: 256 tokens (64 slots) compressed, else 64 tokens."""
    block_size = 256 if ratio > 1 else 64
    spec = dsv4_indexer_spec(block_size, ratio, kv_dtype)
    backend = Backend("DEEPSEEK_V4_INDEXER", fixed_sizes=(block_size,))
    return uniform_engine(spec, backend, num_layers=NL, num_blocks=NB)


def _filled(engine: Any, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    buf, kv = allocate_v033(engine)
    gen = torch.Generator().manual_seed(seed)
    buf.copy_(torch.randint(-128, 128, buf.shape, dtype=torch.int8, generator=gen).view(buf.dtype))
    return buf, kv


def _pages(t: torch.Tensor) -> torch.Tensor:
    """The registered layer's pages as bytes, ``[NB, block stride]`` (padding included)."""
    return t.as_strided((t.shape[0], t.stride(0)), (t.stride(0), 1))


def _detect(engine: Any, kv: dict[str, torch.Tensor], entry: str, hints: dict[str, Any]) -> Any:
    return detect_registered(engine, kv, hints, edited=entry == "edits")


ENTRIES = ["detect", "edits"]
HINTS = [{}, {"kv_layout": "NHD"}, {"kv_layout": "NHD", "kv_dim": 1}]


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("hints", HINTS, ids=["none", "NHD", "NHD-MLA"])
def test_mxfp4_indexer_is_read_as_blocked_scale_pages(ratio: int, hints: dict[str, Any]) -> None:
    engine = _engine(ratio)
    _, kv = _filled(engine, 0)
    first = next(iter(kv.values()))
    slots = first.shape[2]
    # the 512-byte alignment pads the C4 block stride (64 slots of 68 bytes: 4352 -> 4608)
    assert first.stride(0) == (slots * 68 + 511) // 512 * 512 if ratio == 4 else slots * 68
    for entry in ENTRIES:
        reg = _detect(engine, kv, entry, hints)
        assert reg.format == MXFP4 and kvlayout.is_indexer(reg.format), (entry, reg)
        assert kvlayout.get_block_size(reg, reg.format) == slots
        assert kvlayout.is_indexer_cache(first, "vllm", hints)


@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("entry", ENTRIES)
def test_block_map_moves_only_the_tokens_values_and_scales(ratio: int, entry: str) -> None:
    engine = _engine(ratio)
    _, kv_a = _filled(engine, 1)
    _, kv_b = _filled(engine, 2)
    hints = {"kv_layout": "NHD"}
    a, b = _detect(engine, kv_a, entry, hints), _detect(engine, kv_b, entry, hints)
    slots = next(iter(kv_a.values())).shape[2]
    src_blocks, dst_blocks = [3, 1, 4], [0, 5, 2]
    num_tokens = 2 * slots + 11  # the last block partly filled
    before = {name: _pages(t).clone() for name, t in kv_b.items()}
    block_map(a, b, src_blocks, dst_blocks, num_tokens=num_tokens).copy()
    for name, t in kv_b.items():
        src, expect = _pages(kv_a[name]), before[name]
        for p in range(num_tokens):  # vLLM's addressing: values at pos * 64, scales at BS * 64 + pos * 4
            s, d, pos = src_blocks[p // slots], dst_blocks[p // slots], p % slots
            v, sc = slice(pos * VALUES, (pos + 1) * VALUES), slice(slots * VALUES + pos * SCALES, None)
            expect[d, v] = src[s, v]
            expect[d, sc][:SCALES] = src[s, sc][:SCALES]
        assert torch.equal(_pages(t), expect), name


def test_both_entry_points_make_the_same_map() -> None:
    engine = _engine(4)
    _, kv_a = _filled(engine, 3)
    _, kv_b = _filled(engine, 4)
    maps = []
    for entry in ENTRIES:
        a, b = _detect(engine, kv_a, entry, {}), _detect(engine, kv_b, entry, {})
        m = block_map(a, b, [2, 0], [1, 3], num_tokens=90)
        maps.append((m.num_runs, m.num_bytes))
    assert maps[0] == maps[1]


def test_mxfp4_indexer_maps_only_to_its_like() -> None:
    engine = _engine(4)
    _, kv = _filled(engine, 5)
    mx = _detect(engine, kv, "edits", {})
    fp8_engine = _engine(4, "fp8")
    _, fp8_kv = _filled(fp8_engine, 6)
    fp8 = _detect(fp8_engine, fp8_kv, "edits", {})
    assert fp8.format == F.NL_X_NB_BSV_BSS
    # an MLA cache of 68-byte latent rows: the same row width, not the same data
    mla = kvlayout.detect([torch.zeros(NB, 64, 68, dtype=torch.bfloat16) for _ in range(NL)], "vllm", {})
    plain = kvlayout.detect(
        [torch.zeros(2, NB, 64, 1, 68, dtype=torch.uint8) for _ in range(NL)], "vllm", {"kv_layout": "NHD"}
    )
    ours = "(uint8 + uint8)"
    others = (
        (fp8, "(float8_e4m3fn + float32)"),
        (mla, "one latent row per token (MLA)"),
        (plain, "per head"),
    )
    for other, holds in others:
        for one, two, first, second in ((mx, other, ours, holds), (other, mx, holds, ours)):
            with pytest.raises(BlockMapError, match=re.escape("they do not hold the same data")) as err:
                block_map(one, two, [1], [2])
            message = str(err.value)
            assert message.index(first) < message.index(second), message
