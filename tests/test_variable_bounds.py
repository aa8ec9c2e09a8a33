"""``bounds.block_bound``: the heavy micro-batches as one block on a stage's device. A value
computed by hand, optima found by exhaustive search (every order combination) and proven by
CP-SAT, per stage x micro-batch tables, and the uniform case."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeopt.bounds import (
    _block_least,
    block_bound,
    lower_bound,
    makespan_lower_bound,
    passing_bound,
)
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
    """Stage 2 and H = the two heavy ones (2.3 and 2.2; the light ones 1.1 in all, which cost
    1 s per unit before the block: F on the stages below, phi_F = 1; 2.2 inside it: F + B on
    stage 2; or 1.2 after it: a B below, phi_B = 1.2). The block holds their F and B (2.2 x
    4.5 = 9.9 s). Who opens it and who closes it:

    * 2.2 opens (it passes stages 0 and 1 in 4.4 s), 2.3 closes (B on stages 1, 0 and W(0):
      3.2 x 2.3 = 7.36 s): 4.4 + 1.1 + 9.9 + 7.36 = 22.76 s, the light ones all before;
    * 2.3 opens (4.6 s), anyone closes (7.04 s for 2.2): 4.6 + 1.1 + 9.9 + 7.04 = 22.64 s;
    * one micro-batch opens and closes it (4.4 and 7.04 s): the other's B(2) ends first, at
      least 2.3 + 2.2 x 2.2 = 7.14 s after the block starts, then its B(1) (2.64 s) and stage
      0's B and W of both (2 x 4.5 = 9 s): 4.4 + 18.78 = 23.18 s, the light ones after the
      block, where they cost nothing more.

    The least case is 22.64 s, CP-SAT's proven optimum; with the least head and tail over H
    for every case (2.2's both: the block opened and closed by one micro-batch with nothing
    else) it was 22.44 s, and passing_bound gives 20.32."""
    prob = _text_image()
    assert block_bound(prob) == pytest.approx(22.64, abs=1e-9)
    assert passing_bound(prob) == pytest.approx(20.32, abs=1e-9)
    assert makespan_lower_bound(prob) == pytest.approx(22.64, abs=1e-9)
    sched = validate(solve_cpsat(prob, SolveOptions(time_limit=30, workers=2)))
    assert sched.solver.status == "optimal"
    assert sched.makespan == pytest.approx(22.64, abs=1e-6)


def test_block_bound_two_heavy_alone_by_hand() -> None:
    """Three devices, two micro-batches of factors 2.37 and 1.92 (F / B / W = 1 / 1.2 / 0.8
    s), so H holds both and nothing else: the block on stage 2 is 2.2 x 4.29 = 9.438 s.

    * 1.92 opens (2 x 1.92 = 3.84 s), 2.37 closes (3.2 x 2.37 = 7.584 s): 20.862 s;
    * 2.37 opens (4.74 s), 1.92's tail (6.144 s): 20.322 s, but the first B(2) to end is
      2.37's (the other would close the block), at least 2.2 x 2.37 = 5.214 s after the
      block starts; then the least B(1) (1.2 x 1.92 = 2.304 s) and stage 0's B and W of
      both (2 x 4.29 = 8.58 s): 4.74 + 16.098 = 20.838 s;
    * 1.92 opens and closes (3.84 and 6.144 s): the other's B(2) ends first, at least 2.37 +
      2.2 x 1.92 = 6.594 s after the start, then 2.304 + 8.58 s: 3.84 + 17.478 = 21.318 s.

    So 20.838 s; the least head and tail over H (1.92's both) gave 3.84 + 9.438 + 6.144 =
    19.422 s. CP-SAT proves 20.862 s (the first case's order)."""
    prob = uniform_problem(3, 2, 1.0, 1.2, 0.8).replace(microbatch_scale=(2.37, 1.92))
    assert block_bound(prob) == pytest.approx(20.838, abs=1e-9)
    assert lower_bound(prob) == pytest.approx(20.838, abs=1e-9)
    sched = validate(solve_cpsat(prob, SolveOptions(time_limit=30, workers=2)))
    assert sched.solver.status == "optimal"
    assert sched.makespan == pytest.approx(20.862, abs=1e-6)


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


@pytest.mark.parametrize(("devices", "scales", "optimum"), [
    (3, (0.26, 2.37, 1.92, 0.42), 21.542), (4, (0.37, 0.34, 0.37, 2.17, 2.07), 26.052),
    (4, (2.37, 0.41, 2.02, 0.39), 26.946), (3, (0.32, 2.35, 0.45, 0.29, 1.91), 21.772),
    (4, (2.3, 0.34, 2.18, 2.16, 0.42, 0.26), 31.792)])
def test_block_bound_below_text_image_optima(devices: int, scales: tuple[float, ...],
                                             optimum: float) -> None:
    """Text / image mixes drawn at random (2-3 images of 1.9-2.4, the rest 0.25-0.45) whose
    optimum CP-SAT proves in seconds. The bound with the least head and tail over H was 0.6-7 %
    below these optima (20.138, 25.726, 25.572, 20.364, 31.612 s); the cases of who opens and
    closes the block bring it to 0.1-2.7 % (21.088, 26.026, 26.502, 21.184, 31.672 s)."""
    prob = uniform_problem(devices, len(scales), 1.0, 1.2, 0.8, activation=1.0,
                           weight_grad=0.5).replace(microbatch_scale=scales)
    sched = validate(solve_cpsat(prob, SolveOptions(time_limit=60, workers=2)))
    assert sched.solver.status == "optimal"
    assert sched.makespan == pytest.approx(optimum, abs=1e-6)
    assert block_bound(prob) <= sched.makespan * (1 + 1e-9)
    assert block_bound(prob) >= 0.97 * sched.makespan


@settings(max_examples=60, deadline=None)
@given(st.floats(0.0, 10.0), st.floats(0.0, 10.0), st.floats(0.0, 3.0),
       st.floats(0.0, 30.0), st.floats(0.0, 3.0), st.floats(0.0, 4.0),
       st.floats(0.0, 10.0), st.floats(0.0, 10.0), st.floats(0.0, 3.0),
       st.floats(0.0, 5.0), st.one_of(st.just(-math.inf), st.floats(0.0, 60.0)))
def test_block_least_is_the_least(a: float, b: float, phi_f: float, p: float, beta: float,
                                  extra: float, tau: float, b2: float, phi_b: float,
                                  rest: float, floor: float) -> None:
    """``_block_least`` (with and without a floor) against a grid over the triangle: never
    above the grid's least, and below it by at most what the function changes within one
    grid step (its slopes are at most phi_F + beta + phi_B + omega per unit)."""
    omega = beta + extra
    total = p / max(beta, 1e-9) + rest

    def g(x: float, y: float) -> float:
        return (max(a, b + phi_f * x)
                + max(p + beta * (rest - x - y) + max(tau, b2 + phi_b * y),
                      omega * total - omega * x, floor))

    got = _block_least((a, b, phi_f), (p, beta, omega * total, omega), (tau, b2, phi_b),
                       rest, floor)
    n = 60
    step = rest / n
    grid = min(g(i * step, j * step) for i in range(n + 1) for j in range(n + 1 - i))
    assert got <= grid + 1e-9 * (1 + abs(grid))
    assert got >= grid - (phi_f + beta + phi_b + omega) * step * 2 - 1e-9 * (1 + abs(grid))
