"""The greedy's own start times stand for the simulator's only when they are its times.

:func:`pipeopt.simulate.from_starts` returns a schedule for a list of starts only when they are
exactly the simulator's earliest times for the device orders they imply; the greedy then skips
timing its chosen orders again. Here every variant of the greedy, on random and on fixed
problems, is timed both ways: whenever ``from_starts`` answers, its ops equal
:func:`~pipeopt.simulate.simulate`'s bit for bit; and where the times are not the earliest it
answers None.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeopt.problem import Problem, chain_links, uniform_problem
from pipeopt.simulate import from_starts, retime, simulate
from pipeopt.solvers import SolveOptions, solve
from pipeopt.solvers.greedy import (
    POLICIES,
    _Context,
    _relabel,
    _relabel_starts,
    _run,
    policies_for,
)
from tests.strategies import problems


def _both_ways(problem: Problem, policy, order: tuple[int, ...] | None = None):
    """(the schedule of the variant's own starts or None, the simulator's schedule)."""
    order = order or tuple(range(problem.microbatches))
    ctx = _Context(problem.permute_microbatches(order))
    ids, makespan, _, starts = _run(ctx, policy)
    own = from_starts(problem, _relabel_starts(starts, order))
    sim = simulate(problem, _relabel(ctx.orders(ids), order))
    return own, sim, makespan


def _xdc(p: int, m: int, latency: float, memory: float | None) -> Problem:
    lat = [0.0] * (p - 1)
    lat[p // 2 - 1] = latency
    links, bw = chain_links(p, lat, [float("inf")] * (p - 1))
    prob = uniform_problem(p, m, 1.0, 1.2, 0.8, weight_grad=0.5, memory_limit=memory)
    return prob.replace(latency=links, bandwidth=bw)


@settings(max_examples=60, deadline=None)
@given(problems(max_devices=4, max_microbatches=6), st.sampled_from(range(len(POLICIES))),
       st.sampled_from((0.0, 0.2)))
def test_own_starts_are_the_simulators_or_refused(prob, i, noise):
    policy = replace(POLICIES[i], noise=noise, seed=i)
    own, sim, _ = _both_ways(prob, policy)
    if own is not None:
        assert own.ops == sim.ops
        assert own.messages == sim.messages == ()
        assert own.peak_memory == sim.peak_memory


def test_the_variants_that_run_at_scale_are_adopted():
    """On one stage per device without link contention the two variants the greedy runs at
    p = 64, m = 1024 keep the simulator's times, and so do most of the others."""
    adopted = total = 0
    for prob in (_xdc(8, 32, 8.0, 8.0), _xdc(16, 64, 2.0, None), _xdc(6, 20, 0.0, 6.0),
                 uniform_problem(4, 12, 1.0, 2.0, 1.0, virtual_stages=2, placement="vshape",
                                 weight_grad=0.5, memory_limit=4.0)):
        for k, policy in enumerate(policies_for(prob)):
            own, sim, _ = _both_ways(prob, policy)
            if k < 2 and prob.virtual_stages == 1:
                assert own is not None, (prob.devices, policy.name)
            if own is not None:
                assert own.ops == sim.ops
                adopted += 1
            total += 1
    assert adopted >= 0.7 * total, (adopted, total)


def test_a_micro_batch_order_maps_the_starts_back():
    prob = uniform_problem(4, 8, 1.0, 2.0, 1.0).replace(
        microbatch_scale=(1.0, 2.0, 1.0, 3.0, 1.0, 1.5, 2.0, 1.0))
    order = (3, 1, 6, 0, 2, 4, 5, 7)
    own, sim, _ = _both_ways(prob, POLICIES[0], order)
    assert own is not None and own.ops == sim.ops


def test_times_that_are_not_the_earliest_are_refused():
    prob = _xdc(4, 8, 2.0, None)
    _, _, _, starts = _run(_Context(prob), POLICIES[0])
    assert from_starts(prob, starts) is not None
    late = list(starts)
    late[-1] += 0.5  # the last W starts later than it could: valid, not the simulator's
    assert from_starts(prob, late) is None
    early = list(starts)
    early[prob.microbatches + 1] -= 0.25  # an F before its input arrives
    assert from_starts(prob, early) is None
    assert from_starts(prob, starts[:-1]) is None  # an op missing
    assert from_starts(prob, [float("nan"), *starts[1:]]) is None
    same = list(starts)
    same[1] = same[0]  # two ops of device 0 at once
    assert from_starts(prob, same) is None


def test_links_that_queue_and_zero_length_ops_are_not_judged():
    queued = uniform_problem(4, 8, 1.0, 1.0, 1.0).replace(
        message_size=(1.0,) * 3, bandwidth=tuple((1.0,) * 4 for _ in range(4)))
    _, _, _, starts = _run(_Context(queued), POLICIES[0])
    assert from_starts(queued, starts) is None
    zero_w = uniform_problem(4, 8, 1.0, 1.0, 0.0)
    _, _, _, starts = _run(_Context(zero_w), POLICIES[0])
    assert from_starts(zero_w, starts) is None


def test_the_greedy_returns_the_simulators_times():
    """solve's greedy schedule is the simulator's timing of its own orders (it skipped
    timing them again where its starts were the simulator's)."""
    for prob in (_xdc(16, 64, 8.0, 16.0), _xdc(8, 32, 0.0, None)):
        sched = solve(prob, "greedy", SolveOptions(time_limit=20.0))
        assert retime(sched).ops == sched.ops
