"""Compile CUDA code with ptxas's resource report and hold every kernel to a register budget.

Usage: ``ptxas_budget.py MAX_REGISTERS -- NVCC ARGS...``. Runs the nvcc command with
``-Xptxas -v`` added, prints each kernel's registers and spills per architecture, and
exits non-zero when the compile fails, when no kernel is reported, or when any kernel
uses more than MAX_REGISTERS registers or spills to local memory.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")


@dataclass(frozen=True)
class Kernel:
    name: str  # as ptxas prints it (mangled)
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int


def parse(report: str) -> list[Kernel]:
    """The kernels of a ``-Xptxas -v`` report, in order."""
    kernels: list[Kernel] = []
    name = arch = None
    spills = (0, 0)
    for line in report.splitlines():
        if m := _ENTRY.search(line):
            name, arch, spills = m.group(1), m.group(2), (0, 0)
        elif (m := _SPILLS.search(line)) and name is not None:
            spills = (int(m.group(1)), int(m.group(2)))
        elif (m := _USED.search(line)) and name is not None and arch is not None:
            kernels.append(Kernel(name, arch, int(m.group(1)), *spills))
            name = arch = None
    return kernels


def violations(kernels: list[Kernel], budget: int) -> list[str]:
    """Why the kernels miss the budget (empty when they meet it)."""
    if not kernels:
        return ["ptxas reported no kernel"]
    out = []
    for k in kernels:
        if k.registers > budget:
            out.append(f"{k.name} ({k.arch}) uses {k.registers} registers, over {budget}")
        if k.spill_stores or k.spill_loads:
            out.append(f"{k.name} ({k.arch}) spills ({k.spill_stores} bytes stored, {k.spill_loads} loaded)")
    return out


def _demangled(names: list[str]) -> list[str]:
    filt = shutil.which("c++filt")
    if filt is None:
        return names
    done = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True, check=False)
    lines = done.stdout.splitlines()
    return lines if done.returncode == 0 and len(lines) == len(names) else names


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print(__doc__, file=sys.stderr)
        return 2
    budget, command = int(argv[0]), [*argv[2:], "-Xptxas", "-v"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    sys.stdout.write(done.stdout)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        return done.returncode
    parsed = parse(done.stderr)
    names = _demangled([k.name for k in parsed])
    kernels = [
        Kernel(name, k.arch, k.registers, k.spill_stores, k.spill_loads)
        for k, name in zip(parsed, names, strict=True)
    ]
    for k in kernels:
        spills = f", spills {k.spill_stores}/{k.spill_loads} bytes" if k.spill_stores or k.spill_loads else ""
        print(f"ptxas {k.arch}: {k.registers:3d} registers{spills}  {k.name}")
    problems = violations(kernels, budget)
    for p in problems:
        print(f"over the budget: {p}", file=sys.stderr)
    if not problems:
        print(f"ptxas: {len(kernels)} kernels within {budget} registers, no spills")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
