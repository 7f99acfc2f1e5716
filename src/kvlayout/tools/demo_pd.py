"""``kvlayout demo``'s prefill/decode section: one request between two processes over NIXL.

This process is a prefill rank: vLLM's flash-attn NHD cache at TP 2 (rank 0: heads 0-3 of
8), blocks of 16. A child process (:mod:`kvlayout.testing.nixl_peer`) is a decode rank:
vLLM's HND cache at TP 4 (rank 1: heads 2-3), blocks of 32. The decode side sends its
``RegistrationDescription`` as JSON (the handshake); this side plans the request's
``block_map`` against it, posts it through NIXL (UCX on loopback) with the strategy the
cost model picks, and waits. The decode cache is then read back and compared, byte for
byte, with a twin built here from the same seeds into which the same map was copied by
the local block-map engine: every request byte where both layouts put it, every other
byte as it was.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

TITLE = "prefill/decode over NIXL: vLLM NHD at TP 2 into vLLM HND at TP 4, two processes"
TOKENS = 100


def run_pd_demo(say: Callable[[str], None]) -> None:
    try:
        from kvlayout.transfer import nixl as nx

        agent = nx.make_agent("demo-prefill", progress_thread=False)
    except ImportError as e:
        say(f"== {TITLE} == skipped: {e}")
        say("")
        return
    from kvlayout.testing.nixl_peer import CacheSpec, NixlPeer, build_cache
    from kvlayout.transfer import RegistrationDescription, block_map

    say(f"== {TITLE} ==")
    prefill_spec = CacheSpec("NL_X_TWO_NB_BS_NH_HS", 4, 16, 16, 4, 64, shard=(0, 2, 8), seed=1)
    decode_spec = CacheSpec("NL_X_TWO_NB_NH_BS_HS", 4, 8, 32, 2, 64, shard=(1, 4, 8), seed=2)
    t0 = time.perf_counter()
    with NixlPeer("demo-decode", [4096], timeout=60) as peer:
        wire = peer.cache(decode_spec)  # the decode side builds, registers and describes its cache
        there = RegistrationDescription.from_json(wire)
        name = agent.add_remote_agent(peer.metadata)
        prefill, _ = build_cache(prefill_spec)
        say(f"   prefill        {prefill.kernel_groups[0].describe()}, {prefill_spec.the_shard}")
        g = there.groups[0]
        shape = str(list(g.planes[0].shape))
        say(f"   decode         pid {peer.pid}: {g.format.name} {len(g.layers)} x {shape}, {there.shard}")
        say(f"   handshake      a {len(wire)}-byte RegistrationDescription (JSON) and NIXL agent metadata")
        src_ids, dst_ids = [9, 2, 14, 5, 11, 0, 7], [6, 1, 3, 4]
        m = block_map(prefill, there, src_ids, dst_ids, num_tokens=TOKENS, src_shard=prefill_spec.the_shard)
        say(f"   map            {TOKENS} tokens: {m.kind}; {m.num_runs} runs, {m.num_bytes} bytes")
        say(f"                  ({m.reason})")
        with nx.register(agent, prefill), nx.Staging(agent, m.num_bytes) as staging:
            p = nx.plan(m, staging=staging)
            predicted = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in p.predicted_s.items())
            say(f"   plan           {p.op} {p.strategy}: {p.num_descriptors} descriptors")
            say(f"                  (predicted {predicted})")
            result = nx.transfer(agent, name, m, staging=staging, notif=b"demo").wait(timeout=30)
        got = peer.cache_bytes()
        decode_twin, twin_leaves = build_cache(decode_spec)
        block_map(prefill, decode_twin, src_ids, dst_ids, num_tokens=TOKENS,
                  src_shard=prefill_spec.the_shard, dst_shard=decode_spec.the_shard).copy()  # fmt: skip
        want = [_bytes(t) for t in twin_leaves]
        if len(got) != len(want) or not all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)):
            raise AssertionError(f"{TITLE}: the decode cache is not what the map copied locally gives")
        notified = peer.notifs(expect=1)
    total = sum(len(b) for b in want)
    say(
        f"   moved          {result.num_bytes} bytes in {result.descriptors} descriptors, "
        f"{result.seconds * 1e3:.1f} ms; decode notified {notified}"
    )
    say(f"   verified       all {total} bytes of the decode cache equal the same map copied locally")
    say(f"   ({time.perf_counter() - t0:.1f} s with the peer's start)")
    say("")


def _bytes(t: Any) -> np.ndarray:
    import torch

    out: np.ndarray = t.view(-1).view(torch.uint8).numpy()
    return out
