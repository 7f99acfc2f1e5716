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
