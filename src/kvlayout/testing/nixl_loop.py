"""A P/D connector's loop of requests between this process and a :class:`NixlPeer`, for
tests and soaks of what a connector keeps per request.

:func:`connector` sets the pair up as a connector does at the handshake: a real cache on
each side (NHD, seeded), the peer's described to this process, a staging buffer on each
side and the prepped lists. :func:`request` moves one request in one of :data:`MODES`
(every strategy and form, READ and WRITE, prepared ahead and paced), both halves, and
waits for it as the docs say: the peer's halves of a peer-staged request asked for over
its pipe, the notifications each side is sent taken.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from kvlayout.testing.nixl_peer import CacheSpec, NixlPeer, Paced, build_cache

if TYPE_CHECKING:
    from kvlayout.transfer.nixl.sides import Strategy

__all__ = ["MODES", "Connector", "connector", "request"]

# "<strategy> <op>[ <how>]": prepped (the lists), prepared (prepare_transfer, then start),
# paced (a peer-staged request in 2 stages, paced by notifications)
MODES = [
    f"{strategy} {op}{how}"
    for op in ("WRITE", "READ")
    for strategy, how in [
        ("direct", ""), ("direct", " prepped"),
        ("staged", ""), ("staged", " prepped"), ("staged", " prepared"),
        ("peer-staged", ""), ("peer-staged", " paced"),
    ]
] + ["peer-staged WRITE prepared"]  # fmt: skip


@dataclass
class Connector:
    agent: Any
    peer: NixlPeer
    name: str  # the peer's agent name here
    poster: str  # this agent's name in the peer (its stage notifications come here)
    here: Any  # the bound registration here
    there: Any  # the peer's RegistrationDescription, from the handshake
    description: str  # this cache's, as the peer maps its half from it
    staging: Any  # this side's Staging
    peer_staging: Any  # the peer's PeerStaging
    prepped: Any  # the Prepped lists
    block_size: int
    blocks: int
    tokens: int  # each request's


@contextlib.contextmanager
def connector(
    name: str,
    *,
    blocks: int = 16,
    block_size: int = 4,
    heads: int = 2,
    row: int = 8,
    tokens: int = 12,
    staging: int = 1 << 16,
    wrap: Callable[[Any], Any] = lambda agent: agent,
    env: dict[str, str] | None = None,
) -> Iterator[Connector]:
    """Both sides' caches (2 layers of ``blocks`` blocks of ``block_size`` tokens,
    ``heads`` KV heads of ``row`` bf16 elements), each side's ``staging`` bytes of staging
    buffer, requests of ``tokens`` tokens; this process's agent passed through ``wrap``
    (a recorder of its calls, say); ``env`` added to the peer's environment (``UCX_TLS``:
    set it here too, before the call). Everything is let go of on exit, the peer stopped."""
    from kvlayout.transfer import RegistrationDescription
    from kvlayout.transfer import nixl as nx

    spec = CacheSpec("NL_X_TWO_NB_BS_NH_HS", 2, blocks, block_size, heads, row, seed=1)
    with NixlPeer(f"{name}-peer", [4096], env=env) as peer:
        there = RegistrationDescription.from_json(peer.cache(spec))
        peer_staging = peer.staging(staging)
        agent = wrap(nx.make_agent(name, progress_thread=False))
        peer_name = agent.add_remote_agent(peer.metadata).decode()
        here, _ = build_cache(replace(spec, seed=2))
        unit = block_size * heads * row * 2  # a layer's K (or V) of a block: every run is whole units
        with nx.register(agent, here), nx.Staging(agent, staging) as ours:
            poster = peer.add_remote(agent.get_agent_metadata())
            description = here.describe(block_size=block_size).to_json()
            with nx.prep_lists(agent, peer_name, here, there, unit, staging=ours) as prepped:
                yield Connector(
                    agent, peer, peer_name, poster, here, there, description, ours, peer_staging, prepped,
                    block_size, blocks, tokens,
                )  # fmt: skip


def request(c: Connector, mode: str, tag: str, rng: np.random.Generator) -> None:
    """One request of ``mode`` (one of :data:`MODES`) between random blocks of both
    sides, both halves, waited for; ``tag`` names its notifications."""
    from kvlayout.transfer import block_map
    from kvlayout.transfer import nixl as nx

    src_ids, dst_ids = (rng.permutation(c.blocks)[: -(-c.tokens // c.block_size)].tolist() for _ in range(2))
    name, op, *how = mode.split()
    strategy = cast("Strategy", name)
    ends = (c.here, c.there) if op == "WRITE" else (c.there, c.here)
    m = block_map(*ends, src_ids, dst_ids, num_tokens=c.tokens)

    def half(cmd: str, **kw: Any) -> None:  # the peer's: "stage" or "unstage", from the same arguments
        getattr(c.peer, cmd)(c.description, src_ids, dst_ids, expect=m.fingerprint, num_tokens=c.tokens, **kw)

    at, send = c.peer_staging, functools.partial(nx.transfer, c.agent, c.name, m, strategy=strategy)
    if how == ["prepared"]:
        if strategy == "peer-staged":  # the WRITE's notif tells decode it landed
            x = nx.prepare_transfer(
                c.agent, c.name, m, strategy=strategy, peer_staging=at, notif=tag.encode()
            )
        else:
            x = nx.prepare_transfer(c.agent, c.name, m, strategy=strategy, staging=c.staging)
        x.start()
        x.wait(timeout=30)
        if strategy == "peer-staged":
            got = c.peer.notifs(expect=1)
            if got != [tag.encode()]:  # one, and nothing left behind by earlier requests
                raise AssertionError(f"the peer got notifications {got}, not [{tag.encode()!r}]")
            half("unstage")
    elif how == ["paced"] and op == "WRITE":  # the peer scatters each stage as it lands
        half("unstage", paced=Paced(2, c.poster, tag, wait=False))
        send(peer_staging=at, stages=2, notif=tag.encode()).wait(timeout=30)
        c.peer.answer("unstage")
    elif how == ["paced"]:  # posted first, each stage once the peer announces it
        x = send(peer_staging=at, stages=2, peer_ready=tag.encode())
        half("stage", paced=Paced(2, c.poster, tag))
        x.wait(timeout=30)
    elif strategy == "peer-staged":
        if op == "READ":
            half("stage")
        send(peer_staging=at).wait(timeout=30)
        if op == "WRITE":
            half("unstage")
    else:
        send(staging=c.staging, prepped=c.prepped if how == ["prepped"] else None).wait(timeout=30)
