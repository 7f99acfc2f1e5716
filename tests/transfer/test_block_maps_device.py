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

from kvlayout.transfer import block_map
from tests.transfer.test_nixl_maps import HND, MLA, NHD, SGLANG, End, device_request
from tests.transfer.test_transfer_cuda import needs_gpu

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=needs_gpu)]
# (format, (TP rank, TP size), block size) of each side: runs of whole blocks, head slices
# (short runs, packed on the GPU), a change of layout and block size, another engine, MLA.
PAIRS: dict[str, tuple[End, End]] = {
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
    r = device_request(PAIRS[pair], device, seed)
    m = block_map(r.src, r.dst, r.src_ids, r.dst_ids, **r.kw)
    before = [
        t.contiguous().view(-1).view(torch.uint8).clone() for t in r.src_leaves
    ]  # random bits: NaNs too
    m.copy()  # on a GPU: queued on the current stream, which the reads below follow
    got, want = r.got(), r.want()
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(g, w), f"destination tensor {i} differs from the oracle"
    after = [t.contiguous().view(-1).view(torch.uint8) for t in r.src_leaves]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "the source changed"
