"""Does a connector's memory grow with the requests it moves? A soak of the connector's
loop of :mod:`kvlayout.testing.nixl_loop` (every strategy and form, READ and WRITE,
prepared ahead and paced, each request waited for and its notifications taken) between
this process and a peer, on caches of a few MiB, over UCX's TCP transport on loopback.

Every 100 requests (and at the first few, where the warm-up shows) it prints both
processes' RSS (``/proc/<pid>/statm``); with ``--trace``, the Python allocations that
grew most on each side (tracemalloc, since request 50: ``--trace`` slows the loop and
its own traces grow RSS) at 500 and at the end, and on both sides what of
:func:`~kvlayout.testing.nixl_peer.kept` (kvlayout's registries, caches and live objects)
changed since request 50 (that count's own allocations show in the RSS of request 100).
A warm-up (the staging buffers' pages touched by their first request, lazy imports,
caches bounded by design) is over within the first round of modes; anything that keeps
growing after is a leak.
``python benchmarks/soak_pd.py --requests 2400``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import time
import tracemalloc
from typing import Any

import numpy as np

from kvlayout.testing.nixl_loop import MODES, connector, request
from kvlayout.testing.nixl_peer import kept, tcp_tls

PAGE = os.sysconf("SC_PAGE_SIZE")
EARLY = (0, 1, 2, 3, 5, 8, 12, 15, 30, 50)  # requests after which RSS is printed besides every 100th
BASE = 50  # the warm-up is over (3 rounds of the modes): what grows is measured from here


def rss_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2400)
    ap.add_argument("--blocks", type=int, default=64, help="each side's blocks (2 layers, 4 KV heads of 64)")
    ap.add_argument("--tokens", type=int, default=64, help="each request's (blocks of 16)")
    ap.add_argument("--staging", type=int, default=1 << 20, help="each side's staging buffer, bytes")
    ap.add_argument("--trace", action="store_true", help="tracemalloc on both sides (slower)")
    ap.add_argument(
        "--tls", default=None, help="UCX_TLS for both sides (default: TCP, as bench_pd; '': UCX picks)"
    )
    args = ap.parse_args()
    tls = tcp_tls() if args.tls is None else args.tls
    env = {"UCX_TLS": tls} if tls else {}
    os.environ.update(env)  # read when this process's agent starts
    logging.getLogger("nixl").setLevel(logging.WARNING)
    if args.trace:
        tracemalloc.start(8)
    rng = np.random.default_rng(0)
    sizes = {"blocks": args.blocks, "block_size": 16, "heads": 4, "row": 64, "tokens": args.tokens}
    with connector("kvl-soak", staging=args.staging, env=env, **sizes) as c:
        start = time.monotonic()
        for i in range(args.requests + 1):
            if i:
                request(c, MODES[i % len(MODES)], f"req-{i}", rng)
            if i % 100 == 0 or i in EARLY:
                row = {
                    "request": i,
                    "rss_mib": round(rss_mib(), 2),
                    "peer_rss_mib": round(rss_mib(c.peer.pid), 2),
                }
                print(json.dumps(row | {"s": round(time.monotonic() - start, 1)}), flush=True)
            if i == BASE:
                gc.collect()
                base, base_kept, peer_kept = (
                    tracemalloc.take_snapshot() if args.trace else None,
                    kept(c.agent),
                    c.peer.kept(),
                )
                if args.trace:
                    c.peer.trace(str(BASE))
            if i in (500, args.requests) and i > BASE:
                report(c, i, base, base_kept, peer_kept)


def report(
    c: Any, i: int, base: tracemalloc.Snapshot | None, base_kept: dict[str, int], peer_kept: dict[str, int]
) -> None:
    """What grew since request BASE, on both sides."""
    gc.collect()
    for side, was, now in (("here", base_kept, kept(c.agent)), ("peer", peer_kept, c.peer.kept())):
        changed = {k: (was.get(k, 0), n) for k, n in now.items() if n != was.get(k, 0)}
        print(f"request {i}: what kvlayout keeps, changed {side} since {BASE}: {changed}")
    if base is None:
        return
    own = tracemalloc.Filter(False, tracemalloc.__file__)
    grown = tracemalloc.take_snapshot().filter_traces([own]).compare_to(base.filter_traces([own]), "lineno")
    for side, lines in (
        ("here", [str(s) for s in grown[:10]]),
        ("peer", c.peer.trace(str(i), since=str(BASE))),
    ):
        print(f"request {i}: top Python allocation growth {side} since {BASE} (tracemalloc):")
        for line in lines:
            print(f"  {line}")


if __name__ == "__main__":
    main()
