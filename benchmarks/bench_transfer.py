"""Block transfer bandwidth: kvlayout's native path against a plain copy and plain torch.

A Llama-3-8B-like cache (32 layers, 8 KV heads of 128, 16-token blocks, bf16, a pool of
2048 blocks per layer, so the source is cold) moves 256 scattered blocks into 256-token
chunks of 16 blocks, and back. In the same run, for the same bytes:
  - plain copy: ``dst.copy_(src)`` of one contiguous buffer of that many bytes;
  - best torch: ``index_select``/``index_copy_`` into preallocated buffers (a strided view
    per K/V half where torch can take one, a gather plus transposing copy where it cannot),
    on the row's thread count or fewer, whichever was faster.
Each figure is the median of several runs, in GB/s; ratios are ours over each baseline.
Ours is a prepared plan (``kvlayout.transfer.prepare`` once, then one call per move).

Then the fixed cost of one prepared call (16 block ids, one chunk, every block skipped:
the per-call checks and the native call, no bytes) beside one detection of the same
registration, for a 32-layer Llama-3-8B and a 61-layer DeepSeek-V3 MLA cache; the target
is at most 0.5x a detection. The unprepared row is ``store_blocks`` on a plain list (not
detection's registration), which checks the whole registration on every call.
Run with ``make bench-transfer``.
"""

from __future__ import annotations

import os

# torch's OpenMP workers spin for a while after each parallel op; on a 2-core machine they
# would steal the cores from whatever runs next (our threads, or torch's next baseline).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import random
import statistics
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import kvlayout
from kvlayout import EngineKVFormat as F
from kvlayout.transfer import prepare, store_blocks

NL, NB, BS, NH, HS, MLA_HS = 32, 2048, 16, 8, 128, 576
BLOCKS, CHUNK_TOKENS = 256, 256
PER_CHUNK = CHUNK_TOKENS // BS
DTYPE = torch.bfloat16


@dataclass
class Case:
    fmt: F
    label: str
    kv: Any
    gather: Callable[[list[torch.Tensor], list[torch.Tensor]], None]  # torch store
    scatter: Callable[[list[torch.Tensor], list[torch.Tensor]], None]  # torch load


def _per_half(
    views: Callable[[int, int], torch.Tensor], kv_size: int, block_shape: tuple[int, ...]
) -> tuple[Any, Any]:
    """torch store/load through a strided view of each (layer, K/V half): no temporaries."""

    def gather(ids: list[torch.Tensor], chunks: list[torch.Tensor]) -> None:
        for c, chunk in enumerate(chunks):
            for layer in range(NL):
                for k in range(kv_size):
                    torch.index_select(
                        views(layer, k), 0, ids[c], out=chunk[k, layer].view(PER_CHUNK, *block_shape)
                    )

    def scatter(ids: list[torch.Tensor], chunks: list[torch.Tensor]) -> None:
        for c, chunk in enumerate(chunks):
            for layer in range(NL):
                for k in range(kv_size):
                    views(layer, k).index_copy_(0, ids[c], chunk[k, layer].view(PER_CHUNK, *block_shape))

    return gather, scatter


def _hnd_halves(kv: list[torch.Tensor]) -> tuple[Any, Any]:
    """HND must transpose heads and tokens: gather into a buffer, then a transposing copy."""
    tmp = torch.empty(PER_CHUNK, NH, BS, HS, dtype=DTYPE)

    def gather(ids: list[torch.Tensor], chunks: list[torch.Tensor]) -> None:
        for c, chunk in enumerate(chunks):
            for layer in range(NL):
                for k in range(2):
                    torch.index_select(kv[layer][k], 0, ids[c], out=tmp)
                    chunk[k, layer].view(PER_CHUNK, BS, NH, HS).copy_(tmp.transpose(1, 2))

    def scatter(ids: list[torch.Tensor], chunks: list[torch.Tensor]) -> None:
        for c, chunk in enumerate(chunks):
            for layer in range(NL):
                for k in range(2):
                    tmp.copy_(chunk[k, layer].view(PER_CHUNK, BS, NH, HS).transpose(1, 2))
                    kv[layer][k].index_copy_(0, ids[c], tmp)

    return gather, scatter


def make_case(fmt: F) -> Case:
    def zeros(*shape: int) -> torch.Tensor:
        return torch.ones(shape, dtype=DTYPE)  # touched, so pages are resident

    if fmt == F.NL_X_TWO_NB_BS_NH_HS:
        kv = [zeros(2, NB, BS, NH, HS) for _ in range(NL)]
        g, s = _per_half(lambda layer, k: kv[layer][k], 2, (BS, NH, HS))
        return Case(fmt, "1 flash-attn NHD", kv, g, s)
    if fmt == F.NL_X_NB_TWO_BS_NH_HS:
        kv = [zeros(NB, 2, BS, NH, HS) for _ in range(NL)]
        g, s = _per_half(lambda layer, k: kv[layer][:, k], 2, (BS, NH, HS))
        return Case(fmt, "2 flash-infer NHD", kv, g, s)
    if fmt == F.NL_X_TWO_NB_NH_BS_HS:
        kv = [zeros(2, NB, NH, BS, HS) for _ in range(NL)]
        g, s = _hnd_halves(kv)
        return Case(fmt, "6 flash-attn HND", kv, g, s)
    if fmt == F.NB_NL_TWO_BS_NH_HS:
        t = zeros(NB, NL, 2, BS, NH, HS)
        g, s = _per_half(lambda layer, k: t[:, layer, k], 2, (BS, NH, HS))
        return Case(fmt, "0 cross-layer", t, g, s)
    if fmt == F.NL_X_NB_BS_HS:
        kv = [zeros(NB, BS, MLA_HS) for _ in range(NL)]
        g, s = _per_half(lambda layer, k: kv[layer], 1, (BS, MLA_HS))
        return Case(fmt, f"3 MLA (HS={MLA_HS})", kv, g, s)
    if fmt == F.NL_X_NB_BS_NH_CS:
        kv = [zeros(NB, BS, NH, 2 * HS) for _ in range(NL)]
        g, s = _per_half(lambda layer, k: kv[layer], 1, (BS, NH, 2 * HS))
        return Case(fmt, "13 fused K/V NHD", kv, g, s)
    raise ValueError(fmt)


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (page faults, thread pools)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def run_format(
    fmt: F, block_ids: list[int], ids: list[torch.Tensor], thread_counts: list[int], repeats: int
) -> list[str]:
    """One format's table rows: store and load, for each thread count."""
    case = make_case(fmt)
    plan = prepare(case.kv, fmt)
    shape, dtype = plan.chunk_shape(CHUNK_TOKENS)
    chunks = [torch.ones(shape, dtype=dtype) for _ in ids]
    nbytes = sum(c.numel() * c.element_size() for c in chunks)
    src = torch.ones(nbytes // 2, dtype=DTYPE)
    dst = torch.empty_like(src)
    rows = []
    torch_best: dict[str, float] = {}  # torch may do better on fewer threads: keep its best
    for threads in thread_counts:
        torch.set_num_threads(threads)
        plain = timed(lambda: dst.copy_(src), repeats)
        moves = (("store", plan.store_blocks, case.gather), ("load", plan.load_blocks, case.scatter))
        for direction, ours_move, torch_move in moves:

            def ours_run(move: Callable[..., None] = ours_move, n: int = threads) -> None:
                move(block_ids, chunks, num_threads=n)

            def torch_run(move: Callable[..., None] = torch_move) -> None:
                move(ids, chunks)

            ours = timed(ours_run, repeats)
            best_torch = min(timed(torch_run, repeats), torch_best.get(direction, float("inf")))
            torch_best[direction] = best_torch
            gbs = [nbytes / t / 1e9 for t in (ours, plain, best_torch)]
            rows.append(
                f"{case.label:<22}{direction:<7}{threads:>4}{gbs[0]:>11.2f}{gbs[1]:>11.2f}{gbs[2]:>12.2f}"
                f"{plain / ours:>8.2f}x{best_torch / ours:>9.2f}x"
            )
    return rows


def fixed_cost(repeats: int) -> list[str]:
    """Rows: one prepared call with no bytes to move, against one detection."""

    def llama() -> list[torch.Tensor]:
        return [torch.zeros(2, 256, BS, NH, HS, dtype=DTYPE) for _ in range(NL)]

    def deepseek() -> list[torch.Tensor]:
        return [torch.zeros(64, 64, MLA_HS, dtype=DTYPE) for _ in range(61)]

    cases = (
        ("Llama-3-8B, 32 layers", llama, {"kv_layout": "NHD"}),
        ("DeepSeek-V3 MLA, 61 layers", deepseek, {}),
    )
    rows = []
    for label, build, hints in cases:
        raw = build()
        fmt, kv = kvlayout.normalize_kv_and_discover_format(raw, "vllm", hints)
        plan = prepare(kv, fmt)
        ids = list(range(CHUNK_TOKENS // plan.block_size))
        chunk = torch.empty(plan.chunk_shape(CHUNK_TOKENS)[0], dtype=DTYPE)
        plain = list(kv)

        def detect(raw: Any = raw, hints: dict[str, str] = hints) -> None:
            kvlayout.normalize_kv_and_discover_format(raw, "vllm", hints)

        def prepared(plan: Any = plan, ids: list[int] = ids, chunk: torch.Tensor = chunk) -> None:
            plan.store_blocks(ids, [chunk], skip_prefix_n_blocks=len(ids))

        def unprepared(
            plain: list[Any] = plain, fmt: F = fmt, ids: list[int] = ids, chunk: Any = chunk
        ) -> None:
            store_blocks(plain, fmt, ids, [chunk], skip_prefix_n_blocks=len(ids))

        us = [best_us(fn, 200, repeats) for fn in (detect, prepared, unprepared)]
        ratios = f"{us[1] / us[0]:>12.2f}x{us[2] / us[0]:>14.2f}x"
        rows.append(f"{label:<28}{us[0]:>10.1f}{us[1]:>12.1f}{us[2]:>13.1f}{ratios}")
    return rows


def best_us(fn: Callable[[], object], number: int, repeats: int) -> float:
    fn()
    return min(timeit.repeat(fn, number=number, repeat=repeats)) / number * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    rng = random.Random(0)
    block_ids = rng.sample(range(NB), BLOCKS)
    ids = [torch.tensor(block_ids[i : i + PER_CHUNK]) for i in range(0, BLOCKS, PER_CHUNK)]
    print(__doc__.split("\n\n")[1].replace("\n", " "))
    print()
    header = (
        f"{'format':<22}{'dir':<7}{'thr':>4}{'ours GB/s':>11}{'copy GB/s':>11}{'torch GB/s':>12}"
        f"{'vs copy':>9}{'vs torch':>10}"
    )
    print(header)
    print("-" * len(header))
    threads = [int(t) for t in args.threads.split(",")]
    for fmt in (F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_TWO_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS,
                F.NB_NL_TWO_BS_NH_HS, F.NL_X_NB_BS_HS, F.NL_X_NB_BS_NH_CS):  # fmt: skip
        for line in run_format(fmt, block_ids, ids, threads, args.repeats):
            print(line, flush=True)
    print(
        "\nvs copy = ours / plain copy bandwidth; vs torch = ours / best torch bandwidth (higher is better)"
    )
    print("\nfixed cost of one call, microseconds (best of several runs; target: prepared <= 0.5x detection)")
    header = (
        f"{'registration':<28}{'detection':>10}{'prepared':>12}{'unprepared':>13}"
        f"{'prepared/det':>13}{'unprepared/det':>15}"
    )
    print(header)
    print("-" * len(header))
    for line in fixed_cost(max(args.repeats, 5)):
        print(line, flush=True)


if __name__ == "__main__":
    main()
