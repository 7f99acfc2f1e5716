"""CUDA block transfer bandwidth against a device-to-device copy of the same bytes.

The Llama-3-8B-like case of bench_transfer.py, on the GPU: 256 scattered blocks of a
2048-block pool into sixteen 256-token chunks, and back, through a prepared plan, per call
and queued (the device's time alone: a call moves 151-268 MB, about 0.1 ms of an H200's
time, and its checks alone take 0.05 ms of this project's CPU, so per call the host can
set the pace). Then the run executor (``kvlayout.transfer.cuda.copy_runs``) on the same
flash-attn store given as byte runs (one 32 KiB run per block and K/V layer slab), and on
the head-major layout's 256-byte runs: per call (the host splits the runs into work items
and uploads them, then the kernel) and the kernel alone over a table already on the
device. Needs a CUDA device and kvlayout._cuda (see scripts/gpu_check.sh).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import torch

from kvlayout import EngineKVFormat as F
from kvlayout import _cuda, _native
from kvlayout.transfer import prepare
from kvlayout.transfer.cuda import copy_runs

NL, NB, BS, NH, HS = 32, 2048, 16, 8, 128
SLEEP_CYCLES = 200_000_000  # about 0.1 s at the H200's clocks: longer than queuing 20 calls takes
BLOCKS, CHUNK_TOKENS = 256, 256
SHAPES = {
    F.NL_X_TWO_NB_BS_NH_HS: (2, NB, BS, NH, HS),
    F.NL_X_NB_TWO_BS_NH_HS: (NB, 2, BS, NH, HS),
    F.NL_X_TWO_NB_NH_BS_HS: (2, NB, NH, BS, HS),
    F.NL_X_NB_BS_HS: (NB, BS, 576),
    F.NL_X_NB_BS_NH_CS: (NB, BS, NH, 2 * HS),
}


def timed_ms(fn: Callable[[], object], repeats: int = 20, queued: bool = False) -> float:
    """Device milliseconds per call, between events around ``repeats`` calls. ``queued``:
    the calls are queued behind a sleeping kernel, so the device runs them back to back
    and the host's per-call work (checks, staging, launches) is not in the time."""
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    fn()
    torch.cuda.synchronize()
    if queued:
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(repeats):
        fn()
    if queued and start.query():
        raise RuntimeError("the calls took longer to queue than the sleep lasted: raise SLEEP_CYCLES")
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
    times = [
        timed_ms(lambda: plan.store_blocks(block_ids, chunks)),
        timed_ms(lambda: plan.load_blocks(block_ids, chunks)),
        timed_ms(lambda: plan.store_blocks(block_ids, chunks), queued=True),
        timed_ms(lambda: plan.load_blocks(block_ids, chunks), queued=True),
    ]
    copy = timed_ms(lambda: dst.copy_(src), queued=True)
    gbs = "".join(f"{nbytes / ms / 1e6:>10.1f}" for ms in (*times, copy))
    return f"{fmt.name:<24}{gbs}" + "".join(f"{copy / ms:>10.2f}x" for ms in times)


def run_maps(block_ids: list[int]) -> list[str]:
    """copy_runs of the flash-attn store as runs: whole 32 KiB blocks, and 256-byte head runs."""
    layer = torch.ones(NL, 2, NB, BS * NH * HS, dtype=torch.bfloat16, device="cuda")
    chunk = torch.empty(2, NL, BLOCKS, BS * NH * HS, dtype=torch.bfloat16, device="cuda")
    block, head = BS * NH * HS * 2, HS * 2
    nbytes = chunk.numel() * chunk.element_size()
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy = timed_ms(lambda: dst.copy_(src))
    ids = np.array(block_ids, dtype=np.uint64)
    kv, n, i = (a.astype(np.uint64) for a in np.meshgrid(range(2), range(NL), range(BLOCKS), indexing="ij"))
    src_blocks = np.uint64(layer.data_ptr()) + ((n * 2 + kv) * NB + ids[i]) * np.uint64(block)
    dst_blocks = np.uint64(chunk.data_ptr()) + ((kv * NL + n) * BLOCKS + i) * np.uint64(block)
    rows = []
    for label, piece in (("32 KiB block runs", block), ("256-byte head runs", head)):
        at = np.arange(0, block, piece, dtype=np.uint64)
        runs = np.stack(
            [
                (src_blocks.reshape(-1, 1) + at).reshape(-1),
                (dst_blocks.reshape(-1, 1) + at).reshape(-1),
                np.full(src_blocks.size * len(at), piece, dtype=np.uint64),
            ],
            axis=1,
        )
        ms = timed_ms(lambda runs=runs: copy_runs(runs, chunk.device))
        kernel = timed_ms(_kernel_alone(runs))
        gbs = (nbytes / ms / 1e6, nbytes / kernel / 1e6, nbytes / copy / 1e6)
        rows.append(
            f"{label:<26}{len(runs):>12}{gbs[0]:>12.1f}{gbs[1]:>12.1f}{gbs[2]:>15.1f}"
            f"{copy / ms:>11.2f}x{copy / kernel:>11.2f}x"
        )
    return rows


def _kernel_alone(runs: np.ndarray) -> Callable[[], object]:
    """The run kernel over a table already on the device: copy_runs less its per-call host
    work (splitting the runs into items, the pinned staging and the upload)."""
    items = _native.plan_run_items(runs)
    words = np.concatenate([runs.reshape(-1).view(np.int64), items.reshape(-1).view(np.int64)])
    table = torch.from_numpy(words).to("cuda")
    stream = torch.cuda.current_stream().cuda_stream

    def launch() -> None:
        _cuda.copy_runs(table.data_ptr(), table.data_ptr() + 24 * len(runs), len(items), stream)

    return launch


def main() -> None:
    block_ids = random.Random(0).sample(range(NB), BLOCKS)
    print("GB/s per call, and queued (the calls back to back on the device, the host's per-call")
    print("work hidden behind a sleeping kernel); ratios: a device-to-device copy's time over ours")
    names = ("store", "load", "store q", "load q", "d2d")
    print(f"{'format':<24}" + "".join(f"{n:>10}" for n in names) + "".join(f"{n:>11}" for n in names[:4]))
    for fmt, shape in SHAPES.items():
        print(run_format(fmt, shape, block_ids), flush=True)
        torch.cuda.empty_cache()
    head = f"\n{'copy_runs':<26}{'runs':>12}{'GB/s':>12}{'kernel GB/s':>12}{'d2d GB/s':>15}"
    print(f"{head}{'runs/copy':>12}{'kernel/copy':>12}")
    for line in run_maps(block_ids):
        print(line, flush=True)


if __name__ == "__main__":
    main()
