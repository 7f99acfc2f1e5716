"""The register budget check of `make nvcc-check` (scripts/ptxas_budget.py) reads ptxas right."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest

from tests import ROOT


def _script() -> ModuleType:
    path = ROOT / "scripts" / "ptxas_budget.py"
    spec = importlib.util.spec_from_file_location("ptxas_budget", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


budget = _script()

REPORT = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z3fatv' for 'sm_90'
ptxas info    : Function properties for _Z3fatv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 72 registers, used 0 barriers, 384 bytes cmem[0]
ptxas info    : Compiling entry function '_Z4leanv' for 'sm_90'
ptxas info    : Function properties for _Z4leanv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers, 384 bytes cmem[0]
ptxas info    : Compiling entry function '_Z5spillv' for 'sm_80'
ptxas info    : Function properties for _Z5spillv
    8 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 64 registers, used 0 barriers, 384 bytes cmem[0]
"""


def test_the_report_is_parsed_per_kernel() -> None:
    assert budget.parse(REPORT) == [
        budget.Kernel("_Z3fatv", "sm_90", 72, 0, 0),
        budget.Kernel("_Z4leanv", "sm_90", 40, 0, 0),
        budget.Kernel("_Z5spillv", "sm_80", 64, 8, 4),
    ]


def test_kernels_over_the_budget_or_spilling_fail() -> None:
    problems = budget.violations(budget.parse(REPORT), 64)
    assert problems == [
        "_Z3fatv (sm_90) uses 72 registers, over 64",
        "_Z5spillv (sm_80) spills (8 bytes stored, 4 loaded)",
    ]
    assert budget.violations(budget.parse(REPORT)[1:2], 64) == []
    assert budget.violations([], 64) == ["ptxas reported no kernel"]


@pytest.mark.parametrize("argv", [[], ["64"], ["x", "--", "nvcc"], ["64", "nvcc"]])
def test_bad_usage_is_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert budget.main(argv) == 2
    assert "Usage" in capsys.readouterr().err


def test_nvcc_check_holds_every_kernel_source_to_the_budget() -> None:
    """`make nvcc-check` runs ptxas_budget.py over CUDA_KERNELS: all of csrc/cuda/*.cu."""
    makefile = (ROOT / "Makefile").read_text()
    listed = next(line for line in makefile.splitlines() if line.startswith("CUDA_KERNELS :="))
    kernels = set(listed.split(":=", 1)[1].split())
    assert kernels == {str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cuda").glob("*.cu")}
    assert "csrc/cuda/run_kernels.cu" in kernels
    check = makefile.split("nvcc-check: $(TOOLS)", 1)[1].split("\nelse", 1)[0]
    assert "for cu in $(CUDA_KERNELS)" in check and "scripts/ptxas_budget.py 64" in check
