"""Prefill -> decode over NIXL: one request's KV written into a peer process, as kvlayout
sends it beside the descriptor lists vLLM and SGLang post for the same bytes.

A Llama-3-8B-like cache (32 layers, 8 KV heads of 128, bf16, 16-token blocks, vLLM's
flash-attn layout: per layer ``[2, NB, BS, NH, HS]`` in NHD, ``[2, NB, NH, BS, HS]`` in
HND) in this process; the decode side's cache lives in a peer process
(:mod:`kvlayout.testing.nixl_peer`) holding the heads of its TP rank. One 1024-token request
moves over UCX on loopback (TCP alone by default, as the facts sheet measured it; ``--tls
''`` lets UCX pick, which moves the data by CMA between processes of one machine). In the
same run, for the same bytes, each row a WRITE from this process:
  - kvlayout direct: the request's runs (byte runs as long as both sides allow), one
    descriptor each, in the list form and in the prepped form (both sides prepared as
    256-byte units; NIXL merges the request's consecutive indices back into runs);
  - kvlayout staged: the runs gathered here into a registered staging buffer laid out as
    the peer's runs, then one descriptor per stretch of peer-consecutive runs;
  - kvlayout chosen: what the cost model picks, calibrated on this pair first;
  - vLLM-style: one descriptor per layer, K/V and block (per head slice under TP
    resharding, which vLLM serves in HND only);
  - SGLang-style: one per token, layer and K/V under TP resharding (SGLang's pools are
    NHD); else one per layer, K/V and run of consecutive pages;
  - the limit: one contiguous descriptor of the same bytes.
Each row is the best of ``--repeats`` (and the spread), from ``transfer()`` to done (the
gather included); ratios are the baseline's time over ours (>1: ours is faster) and the
limit's over ours. The maps here are built by hand for these scenarios (numpy over the
layouts' strides); kvlayout's block maps will replace them. Run with ``make bench-pd``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvlayout.testing.nixl_peer import NixlPeer, contents
from kvlayout.transfer import nixl as nx

NL, NH, HS, BS, ES = 32, 8, 128, 16, 2  # bf16
U64 = np.uint64


@dataclass(frozen=True)
class Cache:
    """One side's cache as addresses: vLLM flash-attn per-layer tensors cut from one pool."""

    base: int
    layout: str  # "NHD" or "HND"
    nb: int
    heads: int  # heads this rank holds

    @property
    def block_bytes(self) -> int:
        return BS * self.heads * HS * ES

    @property
    def layer_bytes(self) -> int:
        return 2 * self.nb * self.block_bytes

    @property
    def nbytes(self) -> int:
        return NL * self.layer_bytes

    def address(
        self, layer: np.ndarray, kv: np.ndarray, block: np.ndarray, slot: np.ndarray, head: np.ndarray
    ) -> np.ndarray:
        token, head_stride = (
            (self.heads * HS * ES, HS * ES) if self.layout == "NHD" else (HS * ES, BS * HS * ES)
        )
        at = layer * self.layer_bytes + kv * (self.nb * self.block_bytes) + block * self.block_bytes
        return (self.base + at + slot * token + head * head_stride).astype(U64)


@dataclass(frozen=True)
class Map:
    runs: np.ndarray
    src: nx.MapSide
    dst: nx.MapSide


def merge(rows: np.ndarray) -> np.ndarray:
    """Maximal runs: pieces sorted by source, each joined to the previous one where it
    follows it on both sides."""
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    follows = (rows[1:, 0] == rows[:-1, 0] + rows[:-1, 2]) & (rows[1:, 1] == rows[:-1, 1] + rows[:-1, 2])
    first = np.flatnonzero(np.r_[True, ~follows])
    out = rows[first].copy()
    out[:, 2] = np.add.reduceat(rows[:, 2], first)
    return out


def pieces(
    src: Cache, dst: Cache, src_ids: np.ndarray, dst_ids: np.ndarray, tokens: int, head0: int
) -> np.ndarray:
    """One row per (layer, K/V, token, destination head): the head's 256 bytes."""
    layer, kv, token, head = np.meshgrid(
        np.arange(NL), np.arange(2), np.arange(tokens), np.arange(dst.heads), indexing="ij"
    )
    s = src.address(layer, kv, src_ids[token // BS], token % BS, head + head0)
    d = dst.address(layer, kv, dst_ids[token // BS], token % BS, head)
    return np.stack([s.ravel(), d.ravel(), np.full(s.size, HS * ES, U64)], axis=1)


def vllm_style(
    src: Cache, dst: Cache, src_ids: np.ndarray, dst_ids: np.ndarray, head0: int
) -> np.ndarray | None:
    """One descriptor per layer, K/V and block (the destination's head slice of it), or
    None where that slice is not one run of the source (vLLM refuses NHD resharding)."""
    if src.heads != dst.heads and src.layout != "HND":
        return None
    layer, kv, b = np.meshgrid(np.arange(NL), np.arange(2), np.arange(len(dst_ids)), indexing="ij")
    zero = np.zeros_like(b)
    s = src.address(layer, kv, src_ids[b], zero, zero + head0)
    d = dst.address(layer, kv, dst_ids[b], zero, zero)
    return np.stack([s.ravel(), d.ravel(), np.full(s.size, dst.block_bytes, U64)], axis=1)


def sglang_style(
    src: Cache, dst: Cache, all_pieces: np.ndarray, head0: int, tokens: int
) -> np.ndarray | None:
    """Under TP resharding one descriptor per token, layer and K/V (a token's head slice,
    NHD pools only); else per layer, K/V and run of consecutive pages."""
    if src.layout != "NHD" or dst.layout != "NHD":
        return None
    if src.heads == dst.heads:
        per_lk = all_pieces.reshape(NL * 2, -1, 3)
        return np.concatenate([merge(p) for p in per_lk])
    per_token = all_pieces.reshape(-1, dst.heads, 3)[:, 0, :].copy()  # a token's first head ...
    per_token[:, 2] = dst.heads * HS * ES  # ... and the rest of its slice, contiguous in NHD
    return per_token


@dataclass
class Row:
    label: str
    run: Callable[[], nx.TransferResult]
    descriptors: int = 0
    times: list[float] = field(default_factory=list)

    @property
    def best(self) -> float:
        return min(self.times)


def measure(rows: list[Row], repeats: int) -> None:
    """Each row once untimed (first-use costs: connections, page faults on the peer's
    side), then ``repeats`` rounds of every row in turn, so the machine's load changes
    land on all rows alike."""
    for row in rows:
        row.descriptors = row.run().descriptors
    for _ in range(repeats):
        for row in rows:
            start = time.perf_counter()
            row.run()
            row.times.append(time.perf_counter() - start)


@dataclass
class Context:
    agent: nx.Agent
    peer_name: str
    peer: NixlPeer
    pool: torch.Tensor  # this side's cache
    staging: nx.Staging
    cost: nx.CostModel
    prepped: nx.Prepped


def scenario(
    name: str,
    src_layout: str,
    dst_layout: str,
    dst_heads: int,
    consecutive: bool,
    args: argparse.Namespace,
    c: Context,
) -> None:
    blocks = args.tokens // BS
    nb = blocks + args.spare_blocks
    rng = np.random.default_rng(7)
    if consecutive:
        src_ids, dst_ids = np.arange(3, 3 + blocks), np.arange(5, 5 + blocks)
    else:
        src_ids, dst_ids = rng.permutation(nb)[:blocks], rng.permutation(nb)[:blocks]
    src = Cache(c.pool.data_ptr(), src_layout, nb, NH)
    dst = Cache(c.peer.address(0), dst_layout, nb, dst_heads)
    assert src.nbytes <= c.pool.nbytes and dst.nbytes <= c.peer.buffers[0][1]
    head0 = 0  # decode rank 0 of NH / dst_heads
    all_pieces = pieces(src, dst, src_ids, dst_ids, args.tokens, head0)
    runs = merge(all_pieces)
    here = nx.LocalSide("cpu", 0, np.array([[src.base, src.nbytes]], U64))
    there = c.peer.side()
    request = Map(runs, here, there)
    nbytes = int(runs[:, 2].sum())
    mean = nbytes / len(runs) / 1024
    print(f"\n{name}: {nbytes / 2**20:.0f} MiB, kvlayout runs {len(runs)} (mean {mean:.1f} KiB)")

    def send(m: Map, **kw: Any) -> Callable[[], nx.TransferResult]:
        return lambda: nx.transfer(c.agent, c.peer_name, m, **kw).wait(timeout=600)

    chosen = nx.plan(request, staging=c.staging, cost=c.cost).strategy
    ours = [
        Row("kvlayout direct (list)", send(request, strategy="direct")),
        Row("kvlayout direct (prepped)", send(request, strategy="direct", prepped=c.prepped)),
        Row("kvlayout staged (list)", send(request, strategy="staged", staging=c.staging)),
        Row(f"kvlayout chosen: {chosen}", send(request, staging=c.staging, cost=c.cost)),
    ]
    baselines: dict[str, Row | None] = {}
    for label, rows_of in (
        ("vLLM", vllm_style(src, dst, src_ids, dst_ids, head0)),
        ("SGLang", sglang_style(src, dst, all_pieces, head0, args.tokens)),
    ):
        assert rows_of is None or int(rows_of[:, 2].sum()) == nbytes
        baselines[label] = (
            None
            if rows_of is None
            else Row(f"{label}-style list", send(Map(rows_of, here, there), strategy="direct"))
        )
    limit = Map(
        np.array([[c.staging.address, c.peer.address(0), nbytes]], U64),
        nx.local_side(c.staging.tensor),
        there,
    )
    baselines["limit"] = Row("one descriptor (limit)", send(limit, strategy="direct"))
    rows = [*ours, *(b for b in baselines.values() if b is not None)]
    measure(rows, args.repeats)
    ours[-1].run()
    check(c.peer, c.pool, src, dst, runs, rng)
    print(
        f"  {'':28} {'descriptors':>11} {'best s':>8} {'spread':>13}"
        + "".join(f" {'vs ' + k:>10}" for k in baselines)
    )
    for row in rows:
        spread = f"{min(row.times):.3f}-{max(row.times):.3f}"
        ratios = "".join(
            f" {b.best / row.best:9.2f}x" if b is not None else f" {'n/a':>10}" for b in baselines.values()
        )
        print(f"  {row.label:28} {row.descriptors:11d} {row.best:8.3f} {spread:>13}{ratios}")
    for label, b in baselines.items():
        if b is None:
            why = "vLLM serves TP resharding in HND only" if label == "vLLM" else "SGLang pools are NHD"
            print(f"  {label}-style list: n/a ({why})")


def check(
    peer: NixlPeer, pool: torch.Tensor, src: Cache, dst: Cache, runs: np.ndarray, rng: np.random.Generator
) -> None:
    """Sampled runs of the last kvlayout transfer landed byte-exactly on the peer."""
    raw = pool.numpy()
    for i in rng.choice(len(runs), size=min(16, len(runs)), replace=False):
        s, d, n = (int(x) for x in runs[i])
        got = peer.read(0, d - dst.base, n)
        if not np.array_equal(got, raw[s - src.base : s - src.base + n]):
            sys.exit(f"run {i} did not arrive byte-exactly")


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--spare-blocks", type=int, default=32, help="blocks beyond the request in each pool")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tls", default="tcp", help="UCX_TLS for both processes ('' lets UCX choose)")
    parser.add_argument(
        "--peer-thread", action="store_true", help="NIXL's progress thread in the peer (it takes a core here)"
    )
    args = parser.parse_args()
    import nixl._api  # configures NIXL's logger, which says INFO on stdout otherwise

    logging.getLogger("nixl").setLevel(logging.WARNING)
    env = {"UCX_TLS": args.tls} if args.tls else {}
    nb = args.tokens // BS + args.spare_blocks
    pool_bytes = NL * 2 * nb * BS * NH * HS * ES
    request_bytes = NL * 2 * args.tokens * NH * HS * ES
    model = f"{NL} layers, {NH} KV heads of {HS}, bf16, blocks of {BS}"
    print(f"Llama-3-8B-like: {model}; {args.tokens}-token request")
    tls = args.tls or "(UCX chooses)"
    print(f"UCX_TLS={tls}; best of {args.repeats} after a warm-up; pools {pool_bytes / 2**20:.0f} MiB a side")
    with NixlPeer(
        "bench-decode", [pool_bytes], env=env, timeout=600, progress_thread=args.peer_thread
    ) as peer:
        with environment(env):  # UCX reads it when the agent's context starts
            agent = nx.make_agent("bench-prefill", progress_thread=False)
        peer_name = agent.add_remote_agent(peer.metadata)
        pool = torch.from_numpy(contents(3, 0, pool_bytes))
        with nx.register(agent, pool), nx.Staging(agent, request_bytes) as staging:
            cost = nx.calibrate(agent, peer_name, peer.side(), op="WRITE", nbytes=16 << 20)
            nixl = f"{cost.per_descriptor_s * 1e6:.1f} us a descriptor, {cost.bandwidth / 1e9:.2f} GB/s"
            gather = f"{cost.copy_per_run_s * 1e6:.2f} us a run, {cost.copy_bandwidth / 1e9:.1f} GB/s"
            print(f"calibrated: {nixl}, {cost.per_transfer_s * 1e3:.2f} ms a transfer; gather {gather}")
            local = nx.LocalSide("cpu", 0, np.array([[pool.data_ptr(), pool.nbytes]], U64))
            prepped = nx.prep_lists(agent, peer_name, local, peer.side(), HS * ES, staging=staging)
            c = Context(agent, peer_name, peer, pool, staging, cost, prepped)
            scenario("same layout NHD, TP 1 -> 1, scattered blocks", "NHD", "NHD", NH, False, args, c)
            scenario("same layout NHD, TP 1 -> 1, consecutive blocks", "NHD", "NHD", NH, True, args, c)
            scenario(
                "NHD, TP 1 -> 2 (decode rank 0), scattered blocks", "NHD", "NHD", NH // 2, False, args, c
            )
            scenario(
                "HND, TP 1 -> 2 (decode rank 0), scattered blocks", "HND", "HND", NH // 2, False, args, c
            )


if __name__ == "__main__":
    main()
