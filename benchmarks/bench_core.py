"""Core timings: `make codegen` wall time and kvlayout's import time with torch loaded.

Each figure is the median of fresh subprocesses (imports are only cold once per process).
Targets: codegen under 5 s; import plus first use under 50 ms, without loading lark.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = 7

IMPORT_PROBE = """
import sys, time, torch
t0 = time.perf_counter()
import kvlayout
kvlayout.EngineKVFormat, kvlayout.get_spec, kvlayout.parse("NL_X_TWO_NB_BS_NH_HS")
t1 = time.perf_counter()
print((t1 - t0) * 1e3, "lark" in sys.modules)
"""


def main() -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    walls = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "codegen", "--check"], cwd=ROOT, env=env, check=True, capture_output=True
        )
        walls.append(time.perf_counter() - t0)
    imports, lark = [], []
    for _ in range(RUNS):
        out = subprocess.run(
            [sys.executable, "-c", IMPORT_PROBE], check=True, capture_output=True, text=True
        ).stdout
        ms, loaded = out.split()
        imports.append(float(ms))
        lark.append(loaded == "True")
    codegen_s = statistics.median(walls)
    import_ms = statistics.median(imports)
    print(f"codegen (render all outputs, whole process)  {codegen_s:6.2f} s    target < 5 s")
    print(f"import kvlayout + first use, torch loaded    {import_ms:6.1f} ms   target < 50 ms")
    print(f"lark loaded by that import                   {any(lark)}")


if __name__ == "__main__":
    main()
