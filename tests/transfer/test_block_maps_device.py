"""``BlockMap.copy()`` on the device that holds both caches: the native engine on the host,
``kvlayout.transfer.cuda.copy_runs`` on a GPU (queued on the current stream), the same
map either way.

Both caches are built from seeds on the device under test and checked against the
offset oracle of ``test_block_maps`` computed on host twins. The host cases run
everywhere; the GPU cases where one is (``scripts/gpu_check.sh`` runs this file there
and fails on a skip).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlayout import EngineKVFormat as F
from kvlayout.testing.nixl_peer import build_cache
from kvlayout.transfer import block_map
from tests.transfer.test_nixl_maps import HND, MLA, NHD, SGLANG, TOKENS, expected, spec, twin
from tests.transfer.test_transfer_cuda import needs_gpu

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=needs_gpu)]
# (format, (TP rank, TP size), block size) of each side: runs of whole blocks, head slices
# (short runs, packed on the GPU), a change of layout and block size, another engine, MLA.
PAIRS: dict[str, tuple[tuple[F, tuple[int, int], int], tuple[F, tuple[int, int], int]]] = {
    "same layout": ((NHD, (0, 1), 8), (NHD, (0, 1), 8)),
    "TP 2 -> 1 NHD": ((NHD, (1, 2), 8), (NHD, (0, 1), 8)),
    "TP 1 -> 2 HND": ((HND, (0, 1), 8), (HND, (1, 2), 8)),
    "NHD -> HND, block 8 -> 16": ((NHD, (0, 1), 8), (HND, (0, 1), 16)),
    "vLLM -> SGLang": ((NHD, (0, 1), 8), (SGLANG, (0, 1), 8)),
    "MLA": ((MLA, (0, 1), 16), (MLA, (0, 1), 8)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("seed", [1, 2])
def test_a_map_copies_on_the_device_of_its_caches(device: str, pair: str, seed: int) -> None:
    (sf, s_tp, s_bs), (df, d_tp, d_bs) = PAIRS[pair]
    s_spec, d_spec = spec(sf, s_tp, s_bs, seed=3), spec(df, d_tp, d_bs, seed=4)
    (src, src_leaves), (dst, dst_leaves) = build_cache(s_spec, device), build_cache(d_spec, device)
    rng = np.random.default_rng(seed)
    src_ids = [int(b) for b in rng.permutation(s_spec.blocks)[: -(-TOKENS // s_bs)]]
    dst_ids = [int(b) for b in rng.permutation(d_spec.blocks)[: -(-TOKENS // d_bs)]]
    m = block_map(
        src, dst, src_ids, dst_ids, num_tokens=TOKENS, src_shard=s_spec.the_shard, dst_shard=d_spec.the_shard,
        src_block_size=s_bs, dst_block_size=d_bs,
    )  # fmt: skip
    before = [t.contiguous().view(-1).view(torch.uint8).clone() for t in src_leaves]  # random bits: NaNs too
    m.copy()  # on a GPU: queued on the current stream, which the reads below follow
    want = expected(twin(s_spec), twin(d_spec), src_ids, dst_ids)
    got = [t.contiguous().view(-1).view(torch.uint8).cpu().numpy() for t in dst_leaves]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(g, w), f"destination tensor {i} differs from the oracle"
    after = [t.contiguous().view(-1).view(torch.uint8) for t in src_leaves]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "the source changed"
