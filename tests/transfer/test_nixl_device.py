"""Staging where the cache is: a staged or peer-staged request gathers and scatters on the
device that holds the cache (the block-map engine in host memory; the run executor into
a staging buffer in VRAM on a GPU), the same code either way.

One process, its agent posting to itself (NIXL's loopback), both caches built from
seeds on the device under test and checked against the offset oracle of
``test_block_maps`` computed on host twins. The host cases run everywhere; the GPU cases
where one is (``scripts/gpu_check.sh`` runs this file there and fails on a skip).
Bounded: caches of tens of KiB and a hard limit on the module (faulthandler).
"""

from __future__ import annotations

import faulthandler
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvlayout import EngineKVFormat as F
from kvlayout.registration.registration import Registration
from kvlayout.testing.nixl_peer import CacheSpec
from kvlayout.transfer import RegistrationDescription, block_map
from kvlayout.transfer import nixl as nx
from tests.transfer.test_nixl_maps import device_request
from tests.transfer.test_transfer_cuda import needs_gpu

MODULE_LIMIT_S = 120
AGENT = "kvl-device"  # posts to itself
NHD, HND = F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=needs_gpu)]
# Source and destination (format, (TP rank, TP size), block size): a head slice whose
# destination rows each take two sources (the pair that needs staging in NHD), and a
# change of layout and block size.
PAIRS = {
    "TP 2 -> 1 NHD": ((NHD, (1, 2), 8), (NHD, (0, 1), 8)),
    "NHD -> HND, block 8 -> 16": ((NHD, (0, 1), 8), (HND, (0, 1), 16)),
}


@pytest.fixture(scope="module")
def agent() -> Iterator[nx.Agent]:
    faulthandler.dump_traceback_later(MODULE_LIMIT_S, exit=True)
    try:
        yield nx.make_agent(AGENT, progress_thread=False)
    finally:
        faulthandler.cancel_dump_traceback_later()


def described(reg: Registration, s: CacheSpec) -> RegistrationDescription:
    """What the other side learns of ``reg`` at the handshake."""
    return RegistrationDescription.from_json(
        reg.describe(shard=s.the_shard, block_size=s.block_size).to_json()
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("strategy", ["staged", "peer-staged"])
@pytest.mark.parametrize("op", ["WRITE", "READ"])
@pytest.mark.parametrize("stages", [1, 3])
def test_a_request_stages_on_the_device_of_its_cache(
    agent: nx.Agent, device: str, pair: str, strategy: str, op: str, stages: int
) -> None:
    r = device_request(PAIRS[pair], device, stages)
    (s_spec, d_spec), src, dst, src_ids, dst_ids, kw = r.specs, r.src, r.dst, r.src_ids, r.dst_ids, r.kw
    # The poster's map (its own cache live, the other described) and the peer's half of it.
    if op == "WRITE":
        posted = block_map(src, described(dst, d_spec), src_ids, dst_ids, **kw)
        peers = block_map(described(src, s_spec), dst, src_ids, dst_ids, **kw)
    else:
        posted = block_map(described(src, s_spec), dst, src_ids, dst_ids, **kw)
        peers = block_map(src, described(dst, d_spec), src_ids, dst_ids, **kw)
    on = torch.device(device)
    with (
        nx.register(agent, src),
        nx.register(agent, dst),
        nx.Staging(agent, 1 << 20, device=on) as here,
        nx.Staging(agent, 1 << 20, device=on) as there,
    ):
        assert here.device.type == on.type and here.registered is not None
        if strategy == "staged":
            xfer = nx.transfer(agent, AGENT, posted, strategy="staged", staging=here, stages=stages)
            xfer.wait(timeout=30)
            assert xfer.plan.copy_device == here.device and len(xfer.plan.stages) == stages
        else:
            at = nx.PeerStaging(there.address, there.nbytes, there.device.type, there.device.index or 0)
            if op == "READ":
                nx.stage(peers, there, stages=stages)  # the peer gathers on its device first
            xfer = nx.transfer(agent, AGENT, posted, strategy="peer-staged", peer_staging=at, stages=stages)
            xfer.wait(timeout=30)
            assert xfer.plan.remote_mem == ("VRAM" if on.type == "cuda" else "DRAM")
            if op == "WRITE":
                nx.unstage(peers, there, stages=stages)  # every stage landed: the peer scatters
    got, want = r.got(), r.want()
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(g, w), f"destination tensor {i} differs from the oracle"
