"""join_maps between a live end and a peer's: the peer's addresses are another process's,
which may be this one's numbers too (two engines that allocate alike), so only the
destinations are compared, never a local source against a peer's destination."""

from __future__ import annotations

import torch

import kvlayout
from kvlayout.registration.peers import RegistrationDescription
from kvlayout.transfer import block_map, join_maps


def test_a_peer_s_destination_at_this_process_s_source_addresses_joins() -> None:
    src = kvlayout.detect([torch.zeros(2, 8, 4, 2, 8) for _ in range(2)], "vllm", {"kv_layout": "NHD"})
    # a peer that allocated alike: its description holds this process's numbers, other memory
    peer = RegistrationDescription.from_json(src.describe().to_json())
    maps = [block_map(src, peer, [0], [1]), block_map(src, peer, [1], [2])]  # the second reads block 1
    joined = join_maps(maps)
    assert joined.num_runs == sum(m.num_runs for m in maps) and joined.num_bytes == 2 * maps[0].num_bytes
