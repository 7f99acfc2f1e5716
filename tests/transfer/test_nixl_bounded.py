"""What kvlayout keeps does not grow with the requests a connector moves.

A connector moves millions of requests through one agent: anything kept per request
and never let go of (a claim on the peer's staging buffer, a NIXL request, a deferred
release, a region pin, a notification nobody takes, an object a registry holds) grows
without bound. Here a connector's loop between this process and a peer
(``kvlayout.testing.nixl_loop``: each side a real cache and a staging buffer) moves
rounds of requests through every strategy and form, READ and WRITE, each waited for as
the docs say; once the first round has warmed up (lazy imports, bounded caches, the
prepped lists), each later round leaves exactly what the first left.

Bounded: caches of a few KiB, one peer for the module, every answer and wait with a
deadline, and a hard limit on the module (faulthandler).
"""

from __future__ import annotations

import faulthandler
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvlayout.testing.nixl_loop import MODES, Connector, connector, request
from kvlayout.testing.nixl_peer import kept
from tests.transfer.test_nixl import _Recording

MODULE_LIMIT_S = 240


@pytest.fixture(scope="module")
def conn() -> Iterator[Connector]:
    faulthandler.dump_traceback_later(MODULE_LIMIT_S, exit=True)
    try:
        with connector("kvl-bounded", wrap=_Recording) as c:
            yield c
    finally:
        faulthandler.cancel_dump_traceback_later()


def nixl_handles(agent: Any) -> tuple[int, int]:
    """NIXL's transfer requests and descriptor lists made on ``agent`` and not released."""
    n = {name: 0 for name in ("initialize_xfer", "make_prepped_xfer", "release_xfer_handle")}
    n |= {name: 0 for name in ("prep_xfer_dlist", "release_dlist_handle")}
    for name, _, _ in agent.calls:
        if name in n:
            n[name] += 1
    xfers = n["initialize_xfer"] + n["make_prepped_xfer"] - n["release_xfer_handle"]
    return xfers, n["prep_xfer_dlist"] - n["release_dlist_handle"]


def test_a_connector_s_requests_leave_nothing_behind_round_after_round(conn: Connector) -> None:
    """Three rounds of every mode, fresh block ids for each request: after the first
    (warm-up), kvlayout keeps exactly what it kept, on both sides (registries, caches,
    region pins, live objects), every NIXL request made here has been released and the prepped lists are the
    only descriptor lists held, and no notification is left over on either side."""
    rng = np.random.default_rng(0)

    def one_round(r: int) -> None:
        for k, mode in enumerate(MODES):
            request(conn, mode, f"req-{r}-{k}", rng)

    one_round(0)
    warm = {"here": kept(conn.agent), "in the peer": conn.peer.kept()}
    for r in (1, 2):
        one_round(r)
        for side, now in (("here", kept(conn.agent)), ("in the peer", conn.peer.kept())):
            was = warm[side]
            grown = {k: (was.get(k, 0), n) for k, n in now.items() if n != was.get(k, 0)}
            assert not grown, (
                f"round {r + 1} of {len(MODES)} requests changed what kvlayout keeps {side}: {grown}"
            )
        assert nixl_handles(conn.agent) == (0, 2)  # the prepped lists: this side's and the peer's
        assert not any(conn.agent.notifs.values()), conn.agent.notifs
        assert conn.peer.notifs(expect=0, wait=0) == []
        assert not conn.staging.busy


def _changed(was: dict[str, int], now: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Each count that differs, as (was, now)."""
    return {
        k: (was.get(k, 0), now.get(k, 0)) for k in was.keys() | now.keys() if was.get(k, 0) != now.get(k, 0)
    }


def test_kept_counts_what_a_request_holds(conn: Connector) -> None:
    """What the rounds compare sees a request's hold: a peer-staged request started and
    not yet waited for keeps its claim on the peer's buffer, pins the regions it posts
    through and lives, here; the peer's copy prepared and not yet run lives in the peer.
    Each is let go of once the request is over."""
    from kvlayout.transfer import block_map
    from kvlayout.transfer import nixl as nx

    src_ids, dst_ids = [0, 1, 2], [5, 6, 7]
    m = block_map(conn.here, conn.there, src_ids, dst_ids, num_tokens=conn.tokens)
    before, peer_before = kept(conn.agent), conn.peer.kept()
    x = nx.prepare_transfer(
        conn.agent, conn.name, m, strategy="peer-staged", peer_staging=conn.peer_staging, notif=b"held"
    )
    conn.peer.prepare(
        "unstage", conn.description, src_ids, dst_ids, expect=m.fingerprint, num_tokens=conn.tokens
    )
    x.start()
    held = _changed(before, kept(conn.agent))
    assert held["kvlayout.transfer.nixl.holds._PEER_STAGINGS"] == (0, 1), held
    assert held["regions.pins"][0] < held["regions.pins"][1], held  # a region's count, not only the region
    assert held["alive Transfer"][1] - held["alive Transfer"][0] == 1, held
    assert conn.peer.kept().get("alive PeerCopy", 0) >= 1
    x.wait(timeout=30)
    assert conn.peer.notifs(expect=1) == [b"held"]
    conn.peer.run_prepared()
    del x
    assert _changed(before, kept(conn.agent)) == {}
    assert _changed(peer_before, conn.peer.kept()) == {}
