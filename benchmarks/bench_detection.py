"""Detection, accessor and pointer-table timings, against a baseline written here.

The registration is vLLM flash-attn's: one ``[2, NB, BS, NH, HS]`` bf16 tensor per layer
(NB=2048, BS=16, NH=8, HS=128), 32 and 128 layers. Detection is metadata only, so those
tensors live on the meta device; the pointer table needs real addresses, so it reads
CPU tensors with NB=4 (a pointer does not depend on NB).

The baseline is detection the way the LMCache 0.5.6 facts sheet (section 4, 5.1, 5.2)
describes it: for every tensor sort the dims by ``(stride, size != 1)``, permute, and
re-view (a new view per tensor, always), then follow element 0 to the first leaf and
dispatch on its rank. LMCache itself measures about 940 us for 128 layers; the baseline
leaves out its logging and spec machinery, so it is faster than LMCache.

Targets on a 2-core machine: 128-layer detection under 300 us, accessors under 0.6 us,
the 128-layer pointer table under 10 us. Each figure is the best of several repeats.
Run: ``.venv/bin/python benchmarks/bench_detection.py``.
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

import kvlayout
from kvlayout import EngineKVFormat as F

NB, BS, NH, HS = 2048, 16, 8, 128
HINTS = {"kv_layout": "NHD"}


def best_us(fn: Callable[[], object], number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


# -- the baseline: stride sort + permute + view per tensor, then a first-leaf dispatch ----------


def baseline_view(t: torch.Tensor) -> torch.Tensor:
    stride, shape = t.stride(), t.shape
    perm = sorted(range(t.dim()), key=lambda i: (stride[i], shape[i] != 1), reverse=True)
    result = t.permute(perm)
    if not result.is_contiguous():
        return result  # (dim-0 padding check left out: these tensors are contiguous)
    s = result.stride()
    expected = [t.numel() // s[0]] + [s[i] // s[i + 1] for i in range(len(s) - 1)]
    return result.view(expected)


def baseline_contiguity(kv: Any) -> Any:
    if isinstance(kv, torch.Tensor):
        return baseline_view(kv)
    return [baseline_contiguity(x) for x in kv]


def baseline_detect(kv: Any, hints: dict[str, str]) -> tuple[int, Any]:
    kv = baseline_contiguity(kv)
    layout = hints.get("kv_layout") or ("HND" if kv[0].device.type == "cpu" else "NHD")
    hnd = layout in ("HND", "BLHNC")
    if isinstance(kv, list) and kv and isinstance(kv[0], torch.Tensor) and kv[0].dim() == 4:
        return (12 if hnd else 13), kv
    depth, node = 0, kv
    while isinstance(node, list):
        if not node:
            raise ValueError("encountered an empty kv_caches list")
        depth, node = depth + 1, node[0]
    if depth == 1 and node.dim() == 5 and node.shape[0] == 2:
        return (6 if hnd else 1), kv
    if depth == 1 and node.dim() == 5 and node.shape[1] == 2:
        return (7 if hnd else 2), kv
    raise ValueError("unsupported kv_caches structure")


# -- the run ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    args = parser.parse_args()
    repeat = 3 if args.quick else 9
    rows: list[tuple[str, float, float, str]] = []

    for nl in (32, 128):
        kv = [torch.empty(2, NB, BS, NH, HS, dtype=torch.bfloat16, device="meta") for _ in range(nl)]
        fmt, normalized = kvlayout.normalize_kv_and_discover_format(kv, "vllm", HINTS)
        out: list[torch.Tensor] = normalized  # type: ignore[assignment]  # what callers keep
        assert fmt == F.NL_X_TWO_NB_BS_NH_HS and baseline_detect(kv, HINTS)[0] == int(fmt)
        number = 2000 if nl == 32 else 500
        ours = best_us(partial(kvlayout.normalize_kv_and_discover_format, kv, "vllm", HINTS), number, repeat)
        base = best_us(partial(baseline_detect, kv, HINTS), number, repeat)
        target = "< 300 us (LMCache 0.5.6: ~940 us)" if nl == 128 else ""
        rows.append((f"detect {nl}-layer vLLM flash-attn", ours, base, target))
        if nl == 128:
            discover = partial(kvlayout.normalize_and_discover_per_layer_formats, kv, None, "vllm", HINTS)
            per_layer = best_us(discover, 500, repeat)
            rows.append(("per-layer discovery, 128 layers", per_layer, base, ""))

    accessors: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
        ("get_num_layers", lambda: kvlayout.get_num_layers(out, fmt), lambda: len(out)),
        ("get_num_blocks", lambda: kvlayout.get_num_blocks(out, fmt), lambda: out[0].shape[1]),
        ("get_block_size", lambda: kvlayout.get_block_size(out, fmt), lambda: out[0].shape[2]),
        ("get_num_heads(layer 5)", lambda: kvlayout.get_num_heads(out, fmt, 5), lambda: out[5].shape[3]),
        ("get_head_size", lambda: kvlayout.get_head_size(out, fmt), lambda: out[0].shape[4]),
        ("get_hidden_dim_size", lambda: kvlayout.get_hidden_dim_size(out, fmt), lambda: out[0].shape[3] * HS),
        ("get_kv_size", lambda: kvlayout.get_kv_size(out, fmt), lambda: 2),
        ("get_dtype", lambda: kvlayout.get_dtype(out, fmt), lambda: out[0].dtype),
    ]  # fmt: skip
    for name, ours_fn, raw_fn in accessors:
        rows.append((name, best_us(ours_fn, 100_000, repeat), best_us(raw_fn, 100_000, repeat), "< 0.6 us"))

    tensors = [torch.empty(2, 4, BS, NH, HS, dtype=torch.bfloat16) for _ in range(128)]
    _, normalized = kvlayout.normalize_kv_and_discover_format(tensors, "vllm", HINTS)
    cpu: list[torch.Tensor] = normalized  # type: ignore[assignment]
    layers = list(range(128))
    table = best_us(lambda: kvlayout.get_group_data_ptrs(cpu, fmt, layers), 20_000, repeat)
    raw = best_us(lambda: [cpu[i].data_ptr() for i in layers], 20_000, repeat)
    rows.append(("get_group_data_ptrs, 128 layers", table, raw, "< 10 us"))

    print(f"{'measure':36} {'kvlayout':>10} {'baseline':>10} {'ratio':>7}  target")
    for name, ours, base, target in rows:
        print(f"{name:36} {ours:8.2f}us {base:8.2f}us {base / ours:6.2f}x  {target}")
    print(
        "baseline: detection = stride sort + permute + view per tensor and a first-leaf dispatch "
        "(facts sheet 4, 5.2); accessors and pointer table = the raw expression (kv[0].shape[1], "
        "[t.data_ptr() for t in kv]); ratio = baseline / kvlayout."
    )


if __name__ == "__main__":
    main()
