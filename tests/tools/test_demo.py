"""``kvlayout demo``: every example's round trips verify their bytes, the vLLM hybrid runs
through the group edits (or is skipped in one line without vLLM), and the verification
catches a wrong transfer, on vLLM's overlaid groups too."""

from __future__ import annotations

import ctypes
import importlib
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvlayout.layout.algebra import Coord
from kvlayout.tools import demo
from kvlayout.tools.demo import EXAMPLES, HYBRID_TITLE, Example, run_demo, run_example
from kvlayout.transfer import TransferPlan

NEEDS_VLLM = "kvlayout.testing.vllm needs vllm (pip install --no-deps vllm==0.33.0 numpy packaging regex)"


def _run(ex: Example) -> list[str]:
    lines: list[str] = []
    run_example(ex, lines.append)
    return lines


def _check_verified(lines: list[str]) -> int:
    """Every kernel group got a round trip and every round trip verified; the group count."""
    detected = next(m for line in lines if (m := re.search(r"detected in .*: (\d+) kernel group", line)))
    trips = [line for line in lines if line.startswith("     round trip ")]
    assert len(trips) == int(detected.group(1)) > 0
    assert all(line.endswith("bytes verified") for line in trips), trips
    return len(trips)


def _hybrid() -> Example:
    pytest.importorskip("vllm.v1.kv_cache_interface", reason="vllm is not installed")
    return demo.qwen3_5_hybrid()


@pytest.mark.parametrize("ex", EXAMPLES, ids=[ex.title for ex in EXAMPLES])
def test_example_round_trips_verify(ex: Example) -> None:
    _check_verified(_run(ex))


def test_vllm_hybrid_goes_through_the_group_edits() -> None:
    ex = _hybrid()
    assert ex.groups is not None and sorted(i for g in ex.groups for i in g) == list(range(24))
    lines = _run(ex)
    assert lines[0] == f"== {HYBRID_TITLE} =="
    assert "   group edits    mamba-state-rows x18, subpaged-attention x6" in lines
    # each registered view with its own dtype: the state rows are int8, the attention pages bf16
    assert any(
        line.endswith(
            "registered [B, H, N, C] views 18 x int8 [8, 1, 1, 1085440], 6 x bfloat16 [136, 2, 32, 512]"
        )
        for line in lines
    ), lines
    assert (
        "   registration   24 tensor(s) [8, 2, 544, 512], [8, 544, 2048] torch.bfloat16, torch.int8, "
        "hints {'kv_layout': 'NHD'}"
    ) in lines
    assert _check_verified(lines) == 4  # one kernel group per vLLM KV cache group
    for group in ex.groups:  # layer 3 is attention: its kernel pages viewed as its blocks
        fmt = "13 NL_X_NB_BS_NH_CS" if 3 in group else "3 NL_X_NB_BS_HS"
        assert f"   group          layers {','.join(map(str, group))}: {fmt}" in lines


def test_run_demo_ends_with_the_vllm_hybrid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "EXAMPLES", [])
    lines: list[str] = []
    assert run_demo(lines.append) == 0
    try:
        importlib.import_module("vllm.v1.kv_cache_interface")
    except ImportError:
        assert f"== {HYBRID_TITLE} == skipped: {NEEDS_VLLM}" in lines
    else:
        assert f"== {HYBRID_TITLE} ==" in lines
        assert _check_verified(lines) == 4
    assert lines[-1].startswith("done in ")


def test_without_vllm_the_hybrid_is_skipped_in_one_line() -> None:
    # A fresh interpreter where vllm cannot be imported, installed or not.
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "from kvlayout.tools.demo import OPTIONAL_EXAMPLES, run_optional_example\n"
        "for title, make in OPTIONAL_EXAMPLES: run_optional_example(title, make, print)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout == f"== {HYBRID_TITLE} == skipped: {NEEDS_VLLM}\n\n"


# -- the verification catches wrong transfers ------------------------------------------------


def _tiny() -> Example:
    def build() -> list[torch.Tensor]:
        return [torch.randint(1, 100, (2, 32, 16, 2, 64)).to(torch.bfloat16) for _ in range(4)]

    return Example("tiny NHD", "vllm", build, {"kv_layout": "NHD"}, blocks=8)


def _poke(plan: TransferPlan, block: int) -> None:
    """Write one nonzero element into ``block`` (layer 0, token 0), through the offset oracle."""
    plane = plan.jobs[0].plane
    c = Coord(layer=0, kv=0, block=block, token=0, head=0, elem=0)
    pointer, offset = plan.layout.offset(c, plane.sizes, plane.block_stride)
    leaf = plane.leaves[pointer]
    leaf.as_strided((1,), (1,), leaf.storage_offset() + offset).fill_(1)


Load = Callable[[TransferPlan, list[int], list[torch.Tensor]], None]


def _shifted(load: Load) -> Load:
    def wrong(plan: TransferPlan, ids: list[int], chunks: list[torch.Tensor]) -> None:
        load(plan, ids[1:] + ids[:1], chunks)  # every chunk into another chosen block

    return wrong


def _stray(load: Load) -> Load:
    def wrong(plan: TransferPlan, ids: list[int], chunks: list[torch.Tensor]) -> None:
        load(plan, ids, chunks)
        _poke(plan, min(set(range(plan.num_blocks)) - set(ids)))  # and one element outside them

    return wrong


@pytest.mark.parametrize("fault", [_shifted, _stray], ids=["shifted", "stray"])
@pytest.mark.parametrize("make", [_tiny, _hybrid], ids=["tiny", "vllm-hybrid"])
def test_a_wrong_load_is_caught(
    make: Callable[[], Example],
    fault: Callable[[Load], Load],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ex = make()
    _check_verified(_run(ex))  # right as it is
    monkeypatch.setattr("kvlayout.tools.demo._load", fault(demo._load))
    lines: list[str] = []
    with pytest.raises(AssertionError, match="the round trip did not restore the blocks"):
        run_example(ex, lines.append)
    assert lines[-1].endswith("MISMATCH")


def test_the_pd_section_moves_one_request_between_two_processes() -> None:
    from kvlayout.tools.demo_pd import TITLE, run_pd_demo

    lines: list[str] = []
    run_pd_demo(lines.append)
    assert lines[0] == f"== {TITLE} =="
    assert (
        "   map            100 tokens: head slice, re-blocked, permuted; 1600 runs, 204800 bytes" in lines[4]
    )
    assert lines[6].startswith("   plan           WRITE staged: 32 descriptors")
    assert lines[8].startswith("   moved          204800 bytes in 32 descriptors") and "[b'demo']" in lines[8]
    assert (
        lines[9] == "   verified       all 524288 bytes of the decode cache equal the same map copied locally"
    )


def test_the_pd_section_catches_a_wrong_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlayout.tools.demo_pd import TITLE, run_pd_demo
    from kvlayout.transfer import nixl as nx

    def ungathered(self: nx.Plan, num_threads: int = 1, stream: object = None) -> None:
        """The staging buffer is sent as it is."""

    staging_init = nx.Staging.__init__

    def scribbled(self: nx.Staging, *args: Any, **kwargs: Any) -> None:
        # torch.empty may hand back the pages of an earlier demo's staging buffer, which
        # held exactly this request's bytes (the same seeds): the check must see garbage
        staging_init(self, *args, **kwargs)
        self.tensor.fill_(0xA5)

    monkeypatch.setattr(nx.Plan, "copy", ungathered)
    monkeypatch.setattr(nx.Staging, "__init__", scribbled)
    with pytest.raises(AssertionError, match=f"{TITLE}: the decode cache is not what the map copied locally"):
        run_pd_demo(lambda line: None)


def test_the_state_section_moves_sglang_state_between_tp_degrees() -> None:
    from kvlayout.tools.demo_states import TITLE, run_states_demo

    lines: list[str] = []
    run_states_demo(lines.append)
    assert lines[0] == f"== {TITLE} =="
    assert lines[1] == "   rank 0 conv0    resharded state:  12 runs, 96.0 KiB"  # Q, K, V: 3 a layer
    assert lines[4] == "   rank 1 temporal resharded state:   4 runs, 4.00 MiB"  # 16 heads a layer
    assert lines[5].startswith("   rank 1 backup to host slot 40 (page_first_direct): 8 runs")
    assert lines[6].startswith("   bytes verified")


def test_the_state_section_catches_a_wrong_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlayout.tools.demo_states import run_states_demo
    from kvlayout.transfer.block_maps import BlockMap

    copy = BlockMap.copy

    def flipped(self: BlockMap, num_threads: int = 1) -> int:
        moved = copy(self, num_threads)
        if self.num_runs:  # the first run's last byte lands wrong
            last = ctypes.c_uint8.from_address(int(self.runs[0, 1]) + int(self.runs[0, 2]) - 1)
            last.value ^= 0xFF
        return moved

    monkeypatch.setattr(BlockMap, "copy", flipped)
    with pytest.raises(AssertionError, match="decode rank 0: the state is not its slices of the prefill's"):
        run_states_demo(lambda line: None)
