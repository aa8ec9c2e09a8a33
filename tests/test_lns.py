"""Large-neighbourhood search (pipeopt.solvers.lns) on small chains: never worse than its
start, valid, deterministic for a seed, on time, and it reaches the full model's optimum."""

from __future__ import annotations

import math
import time

import pytest

from pipeopt.problem import Problem, chain_links, uniform_problem
from pipeopt.schedule import Schedule
from pipeopt.simulate import check, simulate
from pipeopt.solvers import lns
from pipeopt.solvers.base import SolveOptions, fits_memory, run_classic
from pipeopt.solvers.cpsat import improve, sequential_orders, solve_cpsat


def slow_link(p: int, m: int, latency: float, memory: float | None) -> Problem:
    """A uniform chain (F = B = W = 1 s) whose middle link has ``latency`` seconds."""
    lat = [0.0] * (p - 1)
    lat[p // 2 - 1] = latency
    links, bw = chain_links(p, lat, [math.inf] * (p - 1))
    return uniform_problem(p, m, memory_limit=memory).replace(latency=links, bandwidth=bw)


PROBLEMS = {
    "1f1b memory, slow link": slow_link(4, 8, 3.0, 4.0),
    "tight memory": uniform_problem(4, 6, 1, 1.2, 0.8, memory_limit=2),
    "fused": uniform_problem(3, 5, 1, 1.2, 0.8, split_backward=False, memory_limit=2),
    "vshape": uniform_problem(2, 4, 1, 1.5, 0.5, virtual_stages=2, placement="vshape",
                              memory_limit=2),
}


def sequential(problem: Problem) -> Schedule:
    """One micro-batch at a time: the weakest start there is (and it always fits)."""
    return simulate(problem, sequential_orders(problem), method="sequential")


@pytest.mark.parametrize("name", PROBLEMS)
def test_never_worse_than_its_start_and_valid(name: str) -> None:
    prob = PROBLEMS[name]
    starts = [sequential(prob)]
    if prob.virtual_stages == 1:
        starts.append(run_classic(prob, "gpipe"))
    for start in starts:
        if not fits_memory(start, prob):
            continue
        res = improve(prob, start, SolveOptions(time_limit=30, seed=1), max_windows=10)
        got = res.schedule
        assert check(got) == []
        assert fits_memory(got, prob)
        assert got.iteration_time <= start.iteration_time + 1e-9
        assert not lns.better(lns.key(start, "makespan"), lns.key(got, "makespan"))
        assert res.windows <= 10


def test_improves_a_weak_start() -> None:
    prob = PROBLEMS["1f1b memory, slow link"]
    start = sequential(prob)
    res = improve(prob, start, SolveOptions(time_limit=30), max_windows=20)
    assert res.improvements > 0
    assert res.schedule.iteration_time < start.iteration_time


def test_deterministic_for_a_seed() -> None:
    prob = PROBLEMS["tight memory"]
    start = sequential(prob)
    runs = [improve(prob, start, SolveOptions(time_limit=60, seed=7), max_windows=8)
            for _ in range(2)]
    a, b = (r.schedule for r in runs)
    assert runs[0].windows == runs[1].windows == 8 or a.iteration_time == b.iteration_time
    assert a.ops == b.ops
    assert runs[0].improvements == runs[1].improvements


@pytest.mark.parametrize("name", ["1f1b memory, slow link", "tight memory"])
def test_reaches_the_full_models_proven_optimum(name: str) -> None:
    prob = PROBLEMS[name]
    full = solve_cpsat(prob, SolveOptions(time_limit=60, workers=1))
    assert full.solver.status == "optimal"
    res = improve(prob, sequential(prob), SolveOptions(time_limit=40), max_windows=200)
    assert res.schedule.iteration_time == pytest.approx(full.iteration_time)


def test_stops_within_the_time_limit() -> None:
    prob = slow_link(8, 32, 8.0, 8.0)  # 768 ops: not solved to optimality in 3 s
    t = time.perf_counter()
    sched = solve_cpsat(prob, SolveOptions(time_limit=3.0, workers=1), full_model_share=0.0)
    took = time.perf_counter() - t
    assert took < 3.0 + 2.0
    assert check(sched) == []
    assert sched.solver.detail("lns_windows") is not None


def test_key_breaks_ties_by_span_then_memory() -> None:
    prob = uniform_problem(4, 8, memory_limit=None)
    a, b = run_classic(prob, "1f1b"), run_classic(prob, "gpipe")
    ka, kb = lns.key(a, "makespan"), lns.key(b, "makespan")
    assert ka[:3] == (a.iteration_time, a.max_span, max(a.peak_memory))
    assert lns.key(a, "span")[:2] == (a.max_span, a.iteration_time)
    # Unlimited memory, F = B = W: both take (m + p - 1) * 3 s, and 1F1B holds p activations
    # on device 0 where GPipe holds m, so the memory tie-break prefers 1F1B.
    assert ka[:2] == kb[:2] == (33.0, 33.0)
    assert ka[2] < kb[2] and lns.better(ka, kb)
    same = (1.0, 2.0, 3.0, 4.0)
    assert not lns.better(same, same)
    assert lns.better((1.0, 2.0, 2.0, 9.0), same)
    assert not lns.better((1.0 + 1e-6, 0.0, 0.0, 0.0), same)


def test_microbatch_window_follows_the_incumbents_order() -> None:
    """The ``microbatches`` window frees micro-batches consecutive in the incumbent's order
    (reversed here), not in their numbering."""
    import random

    prob = uniform_problem(3, 6, 1.0, 1.0, 1.0).replace(
        microbatch_scale=(1.0, 2.0, 1.5, 0.5, 3.0, 1.0))
    order = (5, 4, 3, 2, 1, 0)
    inc = run_classic(prob, "1f1b", order=order)
    assert inc.microbatch_order == order
    for seed in range(20):
        free = lns.window_ops(prob, inc, "microbatches", 0.34, random.Random(seed))
        band = sorted({op.microbatch for op in free})
        pos = sorted(order.index(j) for j in band)
        assert len(band) == 3 and pos == list(range(pos[0], pos[0] + 3))
        assert free == {op for op in prob.ops() if op.microbatch in band}
