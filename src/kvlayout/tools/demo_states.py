"""``kvlayout demo``'s Mamba state section: SGLang's linear-attention state between TP
degrees and into its HiCache host pool.

Qwen3-Next's Gated DeltaNet layers (4 of them here) keep one state per request slot in
SGLang's device Mamba pool: a conv state ``(Q | K | V columns, 3)`` and an SSM state
``(heads, 128, 128)``. A prefill instance at TP 1 holds a request's state (random); each
rank of a decode instance at TP 2 takes its columns of each of Q, K and V and its half of
the heads through one block map per state, and rank 1 then backs its slot up into a
``page_first_direct`` host pool. Every byte is checked against the whole state cut by the
model's sub-projections (:func:`kvlayout.testing.sglang.shard`), and no other slot may
change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

TITLE = "SGLang Mamba state: Qwen3-Next GDN, prefill TP 1 into decode TP 2, then a HiCache backup"
PREFILL_SLOT, DECODE_SLOT, HOST_SLOT = 3, 5, 40


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def run_states_demo(say: Callable[[str], None]) -> None:
    from kvlayout.integrations.sglang import mamba_state_pools
    from kvlayout.testing.sglang import QWEN3_NEXT, device_pool, host_pool, shard
    from kvlayout.transfer import Shard, block_map

    say(f"== {TITLE} ==")
    model = dataclasses.replace(QWEN3_NEXT, num_layers=4)
    prefill = device_pool(model, 1, 8, generator=torch.Generator().manual_seed(7))
    whole = [*prefill.mamba_cache.conv, prefill.mamba_cache.temporal]
    p = mamba_state_pools(prefill, model.mamba_type)
    for rank in range(2):
        decode = device_pool(model, 2, 8)
        d = mamba_state_pools(decode, model.mamba_type)
        for name in p:
            m = block_map(p[name], d[name], [PREFILL_SLOT], [DECODE_SLOT], src_shard=Shard(0, 1, 2),
                          dst_shard=Shard(rank, 2, 2))  # fmt: skip
            m.copy()
            say(f"   rank {rank} {name:<9}{m.kind}: {m.num_runs:>3} runs, {_size(m.num_bytes)}")
        held = [*decode.mamba_cache.conv, decode.mamba_cache.temporal]
        for got, want in zip(held, shard(model, whole, 2, rank), strict=True):
            others = [s for s in range(got.shape[1]) if s != DECODE_SLOT]
            if not torch.equal(got[:, DECODE_SLOT], want[:, PREFILL_SLOT]) or got[:, others].any():
                raise AssertionError(f"decode rank {rank}: the state is not its slices of the prefill's")
    host = host_pool(decode, 64, "page_first_direct")
    h = mamba_state_pools(host, model.mamba_type)
    runs = 0
    for name in d:
        backup = block_map(d[name], h[name], [DECODE_SLOT], [HOST_SLOT])
        backup.copy()
        runs += backup.num_runs
    for got, want in zip([*host.conv_buffer, host.temporal_buffer], held, strict=True):
        if not torch.equal(got[HOST_SLOT, :, 0], want[:, DECODE_SLOT]) or got[:HOST_SLOT].any():
            raise AssertionError("the host pool's slot is not the decode rank's state")
    say(f"   rank 1 backup to host slot {HOST_SLOT} (page_first_direct): {runs} runs, one a layer and state")
    say("   bytes verified: each decode rank holds its Q, K, V columns and SSM heads; no other slot changed")
    say("")
