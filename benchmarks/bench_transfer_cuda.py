"""CUDA block transfer bandwidth against a device-to-device copy of the same bytes.

The Llama-3-8B-like case of bench_transfer.py, on the GPU: 256 scattered blocks of a
2048-block pool into sixteen 256-token chunks, and back, through a prepared plan. Needs a CUDA device and
kvlayout._cuda (see scripts/gpu_check.sh).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from kvlayout import EngineKVFormat as F
from kvlayout.transfer import prepare

NL, NB, BS, NH, HS = 32, 2048, 16, 8, 128
BLOCKS, CHUNK_TOKENS = 256, 256
SHAPES = {
    F.NL_X_TWO_NB_BS_NH_HS: (2, NB, BS, NH, HS),
    F.NL_X_NB_TWO_BS_NH_HS: (NB, 2, BS, NH, HS),
    F.NL_X_TWO_NB_NH_BS_HS: (2, NB, NH, BS, HS),
    F.NL_X_NB_BS_HS: (NB, BS, 576),
    F.NL_X_NB_BS_NH_CS: (NB, BS, NH, 2 * HS),
}


def timed_ms(fn: Callable[[], object], repeats: int = 20) -> float:
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / repeats


def run_format(fmt: F, shape: tuple[int, ...], block_ids: list[int]) -> str:
    kv = [torch.ones(shape, dtype=torch.bfloat16, device="cuda") for _ in range(NL)]
    plan = prepare(kv, fmt)  # once; each call then only checks its ids and chunks
    cshape, dtype = plan.chunk_shape(CHUNK_TOKENS)
    chunks = [torch.empty(cshape, dtype=dtype, device="cuda") for _ in range(BLOCKS * BS // CHUNK_TOKENS)]
    nbytes = sum(c.numel() * c.element_size() for c in chunks)
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    store = timed_ms(lambda: plan.store_blocks(block_ids, chunks))
    load = timed_ms(lambda: plan.load_blocks(block_ids, chunks))
    copy = timed_ms(lambda: dst.copy_(src))
    gbs = [nbytes / ms / 1e6 for ms in (store, load, copy)]
    ratios = f"{copy / store:>11.2f}x{copy / load:>10.2f}x"
    return f"{fmt.name:<26}{gbs[0]:>12.1f}{gbs[1]:>12.1f}{gbs[2]:>15.1f}{ratios}"


def main() -> None:
    block_ids = random.Random(0).sample(range(NB), BLOCKS)
    head = f"{'format':<26}{'store GB/s':>12}{'load GB/s':>12}{'d2d GB/s':>15}"
    print(f"{head}{'store/copy':>12}{'load/copy':>11}")
    for fmt, shape in SHAPES.items():
        print(run_format(fmt, shape, block_ids), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
