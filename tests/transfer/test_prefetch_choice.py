"""The CPU copies' measured choice of prefetching ahead of themselves or not
(csrc/prefetch_choice.h), through ``kvlayout._native.PrefetchChoice`` and the engines
that keep one: block maps (one per pair of sides and kind of map) and transfer plans (one
per direction). The choice only ever changes speed: either way the bytes are the same.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlayout import EngineKVFormat as F
from kvlayout import _native
from kvlayout.registration.registration import bind
from kvlayout.transfer import block_map, prepare

Choice = _native.PrefetchChoice
BIG = Choice.min_bytes  # the smallest call that is measured
NHD = F.NL_X_TWO_NB_BS_NH_HS


def drive(choice: Any, calls: int, ns_per_byte: dict[bool, float], bytes_: int = BIG) -> list[bool]:
    """`calls` calls whose time per byte is ns_per_byte[the way picked]; the ways picked."""
    picked = []
    for _ in range(calls):
        way = choice.pick(bytes_)
        choice.record(way, bytes_, int(ns_per_byte[way] * bytes_))
        picked.append(way)
    return picked


@pytest.mark.parametrize("faster", [True, False])
@pytest.mark.parametrize(
    ("slower", "period"), [(1.1, 8), (1.25, 13), (1.49, 25), (2.01, 51), (2.5, 64), (100.0, 64)]
)
def test_both_ways_run_in_turns_then_the_faster_and_the_other_every_period_calls(
    faster: bool, slower: float, period: int
) -> None:
    """The slower way runs every (slower / faster - 1) / 2 % calls, within [explore,
    explore_max], so that trying it costs about 2 % of the time (one call in 8 whatever the
    gap cost 7 % of an HND store's mean, where the nested walk runs 0.6x as fast)."""
    choice = Choice()
    times = {faster: 1.0, not faster: slower}
    picked = drive(choice, 2 * Choice.warm + 4 * Choice.explore_max, times)
    warm = picked[: 2 * Choice.warm]
    assert warm.count(True) == warm.count(False) == Choice.warm
    assert choice.period() == period and Choice.explore <= period <= Choice.explore_max
    others = [i for i, way in enumerate(picked) if i >= 2 * Choice.warm and way != faster]
    assert others == list(range(period, len(picked), period))  # exactly the exploring calls
    assert choice.calls() == len(picked)
    assert choice.cost(faster) == pytest.approx(1.0, rel=1e-4)
    assert choice.cost(not faster) == pytest.approx(slower, rel=1e-4)


@pytest.mark.parametrize("slower", [1.02, 1.1, 1.3, 1.6, 2.0, 3.0, 10.0])
def test_exploring_costs_about_two_percent_where_the_ways_differ_and_no_more_than_the_cap(
    slower: float,
) -> None:
    calls = 40 * Choice.explore_max
    picked = drive(Choice(), calls, {True: 1.0, False: slower})
    spent = sum(slower if not way else 1.0 for way in picked) / calls - 1  # beyond the faster alone
    bound = max(0.02, (slower - 1) / Choice.explore_max) + 2 * (slower - 1) / calls  # and the warm-up
    assert spent <= bound * 1.05
    assert spent >= (slower - 1) / Choice.explore_max  # still tried, at least every explore_max calls


def test_a_slow_first_call_does_not_decide() -> None:
    """The first copies into fresh memory pay its page faults: a way's estimate is the
    least of its warm-up measurements, not their average."""
    choice = Choice()
    assert choice.pick(BIG) is False
    choice.record(False, BIG, 20 * BIG)  # the first call, faulting pages in
    picked = drive(choice, 2 * Choice.warm - 1, {False: 0.1, True: 0.15})
    assert picked.count(False) == Choice.warm - 1
    assert choice.cost(False) == pytest.approx(0.1, rel=1e-4)
    assert choice.pick(BIG - 1) is False


def test_a_change_of_the_faster_way_is_followed() -> None:
    choice = Choice()
    drive(choice, 40, {True: 0.1, False: 0.2})
    assert choice.pick(BIG - 1) is True
    # the machine gets busy: prefetching now costs more than it hides; the way chosen is
    # measured at every call, so the choice turns within a few
    picked = drive(choice, 6, {True: 0.3, False: 0.2})
    assert picked[-1] is False and choice.pick(BIG - 1) is False
    picked = drive(choice, 10 * Choice.explore_max, {True: 0.3, False: 0.2})
    assert choice.period() == 25
    assert picked[-100:].count(True) == 4  # only the exploring calls prefetch


def test_a_slower_way_that_speeds_up_is_seen_within_explore_max_calls() -> None:
    choice = Choice()
    drive(choice, 4 * Choice.explore_max, {True: 0.1, False: 1.0})
    assert choice.period() == Choice.explore_max and choice.pick(BIG - 1) is True
    picked = drive(choice, Choice.explore_max + 2, {True: 0.1, False: 0.05})
    assert picked[-1] is False and choice.pick(BIG - 1) is False


def test_small_calls_are_neither_counted_nor_measured_and_take_the_faster_way() -> None:
    choice = Choice()
    assert choice.pick(BIG - 1) is True  # before anything is measured: prefetch, as tuned
    drive(choice, 20, {True: 0.5, False: 0.1}, bytes_=BIG - 1)
    assert choice.calls() == 0 and choice.cost(True) == 0 and choice.cost(False) == 0
    drive(choice, 2 * Choice.warm, {True: 0.5, False: 0.1})
    assert choice.pick(BIG - 1) is False
    assert choice.calls() == 2 * Choice.warm


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.01, 10.0), st.floats(0.01, 10.0)), min_size=1, max_size=6),
    st.integers(2, 12),
)
def test_the_choice_settles_on_the_way_that_is_faster_now(
    phases: list[tuple[float, float]], length: int
) -> None:
    """Whatever came before, after a phase of steady timings long enough for the estimates
    to settle, the calls that do not explore run the faster way."""
    choice = Choice()
    for off, on in phases:
        drive(choice, length * Choice.explore, {False: off, True: on})
    off, on = phases[-1]
    drive(choice, 30 * Choice.explore_max, {False: off, True: on})
    if abs(off - on) > 1e-9 * max(off, on):  # timings equal to rounding prefer neither way
        assert choice.pick(BIG - 1) is (on < off)
        picked = drive(choice, 4 * Choice.explore_max, {False: off, True: on})
        others = [i for i, way in enumerate(picked) if way is not (on < off)]
        gaps = [b - a for a, b in zip([others[0] - Choice.explore, *others], others, strict=False)]
        assert all(Choice.explore <= gap <= Choice.explore_max for gap in gaps) and len(others) >= 3


SRC_IDS, DST_IDS = list(range(0, 64, 2)), list(range(95, 31, -2))


def big_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """Two same-layout caches [2, NB, BS, NH, HS] whose 32 scattered blocks make a 2 MiB map
    of 32 KiB runs: one that is measured."""
    src = torch.randint(0, 127, (2, 96, 16, 8, 128), dtype=torch.int8)
    return src, torch.zeros_like(src)


def moved(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """dst holds src's request blocks where the map puts them, and zeros elsewhere."""
    want = torch.zeros_like(dst)
    want[:, DST_IDS] = src[:, SRC_IDS]
    return torch.equal(dst, want)


@pytest.mark.parametrize("prefetch", [-1, 0, 1])
def test_a_block_map_copies_the_same_bytes_whichever_way(prefetch: int) -> None:
    src, dst = big_pair()
    m = block_map(bind([src], NHD), bind([dst], NHD), SRC_IDS, DST_IDS)
    assert m.num_bytes >= BIG
    for _ in range(3):
        dst.zero_()
        problem, *_ = _native.copy_groups(m._groups, m.src.spans, m.dst.spans, 1, prefetch=prefetch)
        assert problem is _native.MapProblem.none and moved(src, dst)


def test_a_block_maps_copies_measure_in_their_pairs_choice() -> None:
    src, dst = big_pair()
    a, b = bind([src], NHD), bind([dst], NHD)  # registered once, as a connector does
    m = block_map(a, b, SRC_IDS, DST_IDS)
    choice = m._pair.prefetch.of(m.num_bytes, m.num_runs, 1)
    for calls in range(1, 2 * Choice.warm + 3):
        dst.zero_()
        block_map(a, b, SRC_IDS, DST_IDS).copy()  # each request's map is new; the pair is not
        assert choice.calls() == calls and moved(src, dst)
    assert choice.cost(True) > 0 and choice.cost(False) > 0
    # another kind of map between the same sides (consecutive blocks: 1 MiB runs) has its own
    other = block_map(a, b, list(range(32)), list(range(32, 64)))
    assert m._pair.prefetch.of(other.num_bytes, other.num_runs, 1) is not choice


def test_a_transfer_plan_measures_each_direction_and_moves_the_same_bytes() -> None:
    cache = [torch.randint(0, 127, (2, 64, 16, 8, 128), dtype=torch.int8) for _ in range(4)]
    plan = prepare(cache, NHD)
    ids = list(range(63, -1, -2))  # 32 scattered blocks: 4 MiB a call
    (shape, dtype) = plan.chunk_shape(len(ids) * 16)
    chunk = torch.empty(shape, dtype=dtype)
    first = None
    for _ in range(2 * Choice.warm + 2):
        chunk.zero_()
        plan.store_blocks(ids, [chunk])
        first = chunk.clone() if first is None else first
        assert torch.equal(chunk, first)
    calls, off, on = plan._engine.prefetch_costs(0)
    assert calls == 2 * Choice.warm + 2 and off > 0 and on > 0
    assert plan._engine.prefetch_costs(1)[0] == 0  # loads keep their own


def test_a_prefetch_argument_out_of_range_is_refused() -> None:
    src, dst = big_pair()
    m = block_map(bind([src], NHD), bind([dst], NHD), SRC_IDS, DST_IDS)
    with pytest.raises(ValueError, match=r"prefetch is -1 \(measured\), 0 \(off\) or 1 \(on\)"):
        _native.copy_groups(m._groups, m.src.spans, m.dst.spans, 1, prefetch=2)
