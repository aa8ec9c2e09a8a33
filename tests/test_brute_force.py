"""CP-SAT against exhaustive search on tiny instances.

Without link contention the simulator's earliest-start timing is optimal for fixed device orders
(every start is as early as the orders allow, so every end time and the iteration time are
minimal), and peak memory depends only on the orders. So the best schedule is the best timed
order combination: enumerate every combination of device orders (each device's order must keep
the dependencies between its own ops, else it deadlocks anyway), time it, keep those within the
memory limits, take the least iteration time. No symmetry assumption is used here.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeopt.bounds import iteration_lower_bound, makespan_lower_bound, memory_bound
from pipeopt.problem import Op, Problem, chain_links, uniform_problem
from pipeopt.simulate import DeadlockError, simulate, validate
from pipeopt.solvers import SolveOptions, fits_memory
from pipeopt.solvers.cpsat import sequential_orders, solve_cpsat
from tests.strategies import inputs


def _ancestors(problem: Problem) -> dict[Op, set[Op]]:
    out: dict[Op, set[Op]] = {}

    def visit(op: Op) -> set[Op]:
        if op not in out:
            acc: set[Op] = set()
            for src in inputs(problem, op):
                acc |= {src} | visit(src)
            out[op] = acc
        return out[op]

    for op in problem.ops():
        visit(op)
    return out


def _device_orders(ops: list[Op], anc: dict[Op, set[Op]]) -> Iterator[tuple[Op, ...]]:
    """Every order of ``ops`` that puts each op after its ancestors among ``ops``."""
    local = {op: anc[op] & set(ops) for op in ops}

    def rec(done: tuple[Op, ...], left: frozenset[Op]) -> Iterator[tuple[Op, ...]]:
        if not left:
            yield done
            return
        placed = set(done)
        for op in sorted(left):
            if local[op] <= placed:
                yield from rec((*done, op), left - {op})

    yield from rec((), frozenset(ops))


def brute_force(problem: Problem) -> tuple[float, int]:
    """(least iteration time over all order combinations that fit memory, combinations tried)."""
    anc = _ancestors(problem)
    per_device = []
    for d in range(problem.devices):
        ops = [op for op in problem.ops() if problem.stage_device[op.stage] == d]
        per_device.append(list(_device_orders(ops, anc)))
    best, tried = math.inf, 0
    for orders in itertools.product(*per_device):
        tried += 1
        try:
            sched = simulate(problem, orders, check=False)
        except DeadlockError:
            continue
        if fits_memory(sched, problem):
            best = min(best, sched.iteration_time)
    return best, tried


def _two_devices(m: int, *, split: bool = True, f=(1.0, 1.5), b=(2.0, 1.0), w=(0.5, 1.0),
                 latency: float = 0.0, act=(1.0, 1.0), wgm=None, limit=None,
                 reduce=()) -> Problem:
    lat, bw = chain_links(2, [latency], [math.inf])
    return Problem(devices=2, microbatches=m, forward=f, backward_input=b, backward_weight=w,
                   split_backward=split, activation_memory=act,
                   weight_grad_memory=wgm or act, latency=lat, bandwidth=bw,
                   memory_limit=limit or (), grad_reduce=reduce)


CASES = {
    "uniform p2 m2": uniform_problem(2, 2, 1, 1, 1),
    "hetero p2 m2 latency": _two_devices(2, latency=0.5),
    "hetero p2 m2 memory": _two_devices(2, latency=0.25, act=(1.0, 2.0), wgm=(0.5, 0.5),
                                        limit=(1.5, 2.5)),
    "hetero p2 m2 reduce": _two_devices(2, reduce=(2.5, 0.5)),
    "fused p2 m3 latency memory": _two_devices(3, split=False, latency=1.0, limit=(2.0, 1.0)),
    "p3 m2 hetero": Problem(devices=3, microbatches=2, forward=(1.0, 2.0, 1.0),
                            backward_input=(1.0, 1.0, 3.0), backward_weight=(2.0, 0.5, 1.0),
                            activation_memory=(1.0, 1.0, 1.0), memory_limit=(1.0, 2.0, None)),
    "vshape p2 v2 m2 fused": uniform_problem(2, 2, 1, 2, 1, virtual_stages=2,
                                             placement="vshape", split_backward=False),
    "vshape p1 v2 m2": uniform_problem(1, 2, 1, 1.5, 0.5, virtual_stages=2,
                                       placement="vshape"),
}


@pytest.mark.parametrize("warm", ["default", "sequential"])
@pytest.mark.parametrize("name", list(CASES))
def test_cpsat_matches_brute_force(name: str, warm: str) -> None:
    problem = CASES[name]
    best, tried = brute_force(problem)
    assert tried > 1 and math.isfinite(best)
    # A poor warm start (one micro-batch at a time) makes the model find the optimum itself.
    hint = (simulate(problem, sequential_orders(problem), "sequential")
            if warm == "sequential" else None)
    sched = validate(solve_cpsat(problem, SolveOptions(time_limit=10, workers=2, hint=hint)))
    assert sched.solver.status == "optimal"
    assert sched.iteration_time == pytest.approx(best, rel=1e-9)
    assert sched.solver.lower_bound == pytest.approx(best, rel=1e-9)
    assert fits_memory(sched, problem)


def test_memory_limit_changes_the_optimum() -> None:
    """The memory case is not trivially the unlimited one (so it tests the memory model)."""
    tight = CASES["hetero p2 m2 memory"]
    loose = tight.replace(memory_limit=())
    assert brute_force(tight)[0] > brute_force(loose)[0]


@st.composite
def tiny_problems(draw) -> Problem:
    """Two devices, one or two micro-batches (three with a fused backward, so that more
    micro-batches exist than fit in memory): small enough to enumerate every order."""
    m = draw(st.integers(1, 3))
    split = m < 3 and draw(st.booleans())
    t = st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0])

    def pair() -> tuple[float, float]:
        return (draw(t), draw(t))

    act = (draw(st.sampled_from([1.0, 2.0])), 1.0)
    limit = tuple(a * draw(st.integers(1, m)) if draw(st.booleans()) else None for a in act)
    return _two_devices(m, split=split, f=pair(), b=pair(), w=pair(),
                        latency=draw(st.sampled_from([0.0, 0.5, 2.0, 5.0])), act=act,
                        wgm=(act[0] / 2, 0.5), limit=limit,
                        reduce=draw(st.sampled_from([(), (1.0, 0.0), (0.0, 4.0)])))


@settings(max_examples=40)
@given(tiny_problems())
def test_analytic_bounds_hold_on_tiny_problems(problem: Problem) -> None:
    best, _ = brute_force(problem)
    assert max(memory_bound(problem)) <= best * (1 + 1e-9)  # (the 5 s latency makes it bind)
    assert makespan_lower_bound(problem) <= best * (1 + 1e-9)
    assert iteration_lower_bound(problem) <= best * (1 + 1e-9)
    sched = validate(solve_cpsat(problem, SolveOptions(time_limit=10, workers=2)))
    assert sched.solver.status == "optimal"
    assert sched.iteration_time == pytest.approx(best, rel=1e-9)


def test_bounds_survive_extreme_memory_values() -> None:
    prob = uniform_problem(4, 2, 1, 1, 1, memory_limit=1.0).replace(
        activation_memory=(0.0, 0.0, 0.0, 1.0), weight_grad_memory=(0.0, 0.0, 0.0, 5e-324))
    assert math.isfinite(iteration_lower_bound(prob))
    least = simulate(prob, sequential_orders(prob))  # fits any feasible memory limit
    assert fits_memory(least, prob)
    assert iteration_lower_bound(prob) <= least.iteration_time
