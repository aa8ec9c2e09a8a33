"""``bounds.block_bound``: the heavy micro-batches as one block on a stage's device. A value
computed by hand, optima found by exhaustive search (every order combination) and proven by
CP-SAT, per stage x micro-batch tables, and the uniform case."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeopt.bounds import block_bound, lower_bound, makespan_lower_bound, passing_bound
from pipeopt.problem import Problem, chain_links, uniform_problem
from pipeopt.simulate import validate
from pipeopt.solvers import SolveOptions
from pipeopt.solvers.cpsat import solve_cpsat
from tests.test_brute_force import brute_force
from tests.test_microbatch_scale import tiny_scaled_problems


def _text_image() -> Problem:
    """Three devices, F / B / W = 1 / 1.2 / 0.8 s; two heavy micro-batches (2.3, 2.2) and
    three light ones (0.4, 0.3, 0.4): a small text / image mix."""
    return uniform_problem(3, 5, 1.0, 1.2, 0.8).replace(
        microbatch_scale=(0.4, 2.3, 0.3, 2.2, 0.4))


def test_block_bound_by_hand() -> None:
    """Stage 2 and H = the two heavy ones: the block starts after the first of them passed
    stages 0 and 1 (2 x 2.2 = 4.4 s), holds their F and B (2.2 x 4.5 = 9.9 s) and ends with
    the last one's B on stages 1, 0 and W(0) (3.2 x 2.2 = 7.04 s). The light ones (1.1 in all)
    cost 1 s per unit before the block (F on the stages below: phi_F = 1), 2.2 inside it (F + B
    on stage 2) or 1.2 after it (a B below: phi_B = 1.2); the least is all before: 4.4 + 1.1
    + 9.9 + 7.04 = 22.44 s. The other bounds give 20.32 (passing_bound); CP-SAT proves 22.64."""
    prob = _text_image()
    assert block_bound(prob) == pytest.approx(22.44, abs=1e-9)
    assert passing_bound(prob) == pytest.approx(20.32, abs=1e-9)
    assert makespan_lower_bound(prob) == pytest.approx(22.44, abs=1e-9)
    sched = validate(solve_cpsat(prob, SolveOptions(time_limit=30, workers=2)))
    assert sched.solver.status == "optimal"
    assert sched.makespan == pytest.approx(22.64, abs=1e-6)


def test_block_bound_uniform_is_zero() -> None:
    """Every micro-batch the same: the other bounds alone, computed as before."""
    assert block_bound(uniform_problem(4, 8, 1.0, 1.2, 0.8)) == 0.0
    assert block_bound(uniform_problem(1, 3).replace(microbatch_scale=(1, 2, 3))) == 0.0


@settings(max_examples=80, deadline=None)
@given(tiny_scaled_problems())
def test_block_bound_below_the_least_makespan(problem: Problem) -> None:
    """Brute force (every order combination on every device) without gradient reductions,
    where the iteration time is the makespan."""
    problem = problem.replace(grad_reduce=())
    best, _ = brute_force(problem)
    if math.isfinite(best):
        assert block_bound(problem) <= best * (1 + 1e-9)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0]), min_size=4, max_size=4),
       st.booleans())
def test_block_bound_with_a_table(cells: list[float], fused: bool) -> None:
    """A stage x micro-batch table (the rows differ): brute force on two devices, two
    micro-batches."""
    prob = uniform_problem(2, 2, 1.0, 1.2, 0.8, split_backward=not fused).replace(
        microbatch_scale=(tuple(cells[:2]), tuple(cells[2:])))
    best, _ = brute_force(prob)
    assert block_bound(prob) <= best * (1 + 1e-9)


@pytest.mark.parametrize(("devices", "scales", "latency"), [
    (3, (0.4, 2.3, 0.3, 2.2, 0.4), 0.5), (4, (1.9, 0.3, 0.3, 1.9), 0.0),
    (4, (0.4, 2.3, 0.3, 2.3), 0.25), (3, (2.0, 0.25, 0.5, 2.0, 0.25), 0.0)])
def test_block_bound_below_cpsat_optimum(devices: int, scales: tuple[float, ...],
                                         latency: float) -> None:
    """Beyond brute force: CP-SAT's proven optimum is at least the bound (text / image-like
    mixes, where the bound is 0-6 % below the optimum and the earlier bounds 11-21 %)."""
    lat, bw = chain_links(devices, [latency] * (devices - 1), [math.inf] * (devices - 1))
    prob = uniform_problem(devices, len(scales), 1.0, 1.2, 0.8).replace(
        microbatch_scale=scales, latency=lat, bandwidth=bw)
    sched = validate(solve_cpsat(prob, SolveOptions(time_limit=30, workers=2)))
    assert sched.solver.status == "optimal"
    assert block_bound(prob) <= sched.makespan * (1 + 1e-9)
    assert lower_bound(prob) <= sched.makespan * (1 + 1e-9)
