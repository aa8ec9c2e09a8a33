"""The CP-SAT search: known optima, honest bounds and statuses, and its options."""

from __future__ import annotations

import itertools
import logging
import math
import os
import signal
import threading

import pytest

from pipeopt.bounds import makespan_lower_bound, span_lower_bound, warmup_idle
from pipeopt.errors import ConfigError
from pipeopt.problem import Problem, chain_links, uniform_problem
from pipeopt.schedule import Schedule
from pipeopt.schedules import GENERATORS, NotApplicable
from pipeopt.simulate import check, simulate, validate
from pipeopt.solvers import SolveOptions, fits_memory, methods, run_classic, solve
from pipeopt.solvers.cpsat import sequential_orders, solve_cpsat, solve_lns
from pipeopt.solvers.cpsat_grid import time_grid


def cpsat(problem: Problem, **kw) -> Schedule:
    """Solve with test-sized settings and check what must hold for every result."""
    opts = SolveOptions(**{"time_limit": 10.0, "workers": 2, **kw})
    sched = validate(solve_cpsat(problem, opts))
    assert sched.method == "cpsat"
    assert fits_memory(sched, problem)
    assert sched.solver.objective == opts.objective
    lb = sched.solver.lower_bound
    assert lb is not None and lb <= sched.objective_value * (1 + 1e-9)
    analytic = span_lower_bound(problem) if opts.objective == "span" else \
        makespan_lower_bound(problem)
    assert lb >= analytic * (1 - 1e-9)
    if sched.solver.status == "optimal":
        assert sched.objective_value <= lb * (1 + 1e-9)
    return sched


def classics_that_fit(problem: Problem) -> list[Schedule]:
    out = []
    for name in GENERATORS:
        try:
            sched = run_classic(problem, name)
        except NotApplicable:
            continue
        if fits_memory(sched, problem):
            out.append(sched)
    return out


# ----- known optima on uniform instances --------------------------------------------------

@pytest.mark.parametrize("p,m", [(3, 6), (4, 8)])
def test_unlimited_memory_reaches_the_device_bound(p: int, m: int) -> None:
    # The last device cannot start before p-1 forwards and then has 3m units of work, and
    # ZB-H1's order achieves exactly that with equal times: p - 1 + 3m.
    sched = cpsat(uniform_problem(p, m, 1, 1, 1))
    assert sched.solver.status == "optimal"
    assert sched.makespan == pytest.approx(p - 1 + 3 * m)


@pytest.mark.parametrize("p,m", [(3, 6), (4, 8)])
def test_unlimited_memory_has_zero_bubble_in_span(p: int, m: int) -> None:
    sched = cpsat(uniform_problem(p, m, 1, 1, 1), objective="span")
    assert sched.solver.status == "optimal"
    assert sched.max_span == pytest.approx(3 * m)  # every device busy from its first op on


@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (1, 1.2, 0.8), (1, 1.5, 0.5)])
def test_one_f_one_b_memory_is_at_most_zb_h1(f: float, b: float, w: float) -> None:
    p, m = 3, 6
    prob = uniform_problem(p, m, f, b, w, memory_limit=p)  # 1F1B's peak on device 0
    zb = run_classic(prob, "zb-h1")
    assert fits_memory(zb, prob)
    sched = cpsat(prob)
    assert sched.solver.status == "optimal"
    assert sched.makespan <= zb.makespan * (1 + 1e-9)
    if f == b == w:
        # Equal times: ZB-H1's makespan m(F+B+W) + (p-1)(F+B-W) equals the device bound.
        assert sched.makespan == pytest.approx(zb.makespan)


def test_warmup_memory_bound_is_tight() -> None:
    # Device 0 holds at most L activations while the first micro-batch makes its round trip
    # (p F + (p-1) B), so it idles p F + (p-1) B - L F; with p = 4, L = 4 that is 3 units.
    prob = uniform_problem(4, 8, 1, 1, 1, memory_limit=4)
    assert warmup_idle(prob)[0] == pytest.approx(3.0)
    sched = cpsat(prob, objective="span")
    assert sched.solver.status == "optimal"
    assert sched.max_span == pytest.approx(24 + 3)


CROSS_CHECK = {
    "uniform mem 3": uniform_problem(4, 6, 1, 1, 1, memory_limit=3),
    "unequal mem 4": uniform_problem(4, 6, 1, 1.2, 0.8, memory_limit=4, weight_grad=0.5),
    "latency": uniform_problem(3, 5, 1, 1.5, 0.5, latency=0.3),
    "fused": uniform_problem(3, 5, 1, 1.2, 0.8, split_backward=False, memory_limit=2),
    "interleaved": uniform_problem(2, 4, 1, 1, 1, virtual_stages=2),
    "vshape": uniform_problem(2, 4, 1, 1.5, 0.5, virtual_stages=2, placement="vshape",
                              memory_limit=2),
}


@pytest.mark.parametrize("name", list(CROSS_CHECK))
def test_optimal_is_never_beaten_by_a_classic_schedule(name: str) -> None:
    prob = CROSS_CHECK[name]
    sched = cpsat(prob)
    assert sched.solver.status == "optimal"
    for other in classics_that_fit(prob):
        assert sched.iteration_time <= other.iteration_time * (1 + 1e-9), other.method
    # Nor by the greedy, nor by PyTorch's own schedules that fit the same memory.
    others = [solve(prob, "greedy")]
    for name in (n for n in methods() if n.startswith("torch:")):
        try:
            torch_sched = solve(prob.replace(memory_limit=()), name)
        except NotApplicable:
            continue
        if fits_memory(torch_sched, prob):
            others.append(torch_sched)
    for other in others:
        assert sched.iteration_time <= other.iteration_time * (1 + 1e-9), other.method


def test_span_objective_is_minimised() -> None:
    prob = uniform_problem(3, 5, 1, 1.2, 0.8, memory_limit=3)
    sched = cpsat(prob, objective="span")
    assert sched.solver.status == "optimal"
    assert sched.objective_value == sched.max_span
    for other in classics_that_fit(prob):
        assert sched.max_span <= other.max_span * (1 + 1e-9), other.method


# ----- gradient reduction and links ------------------------------------------------------

def test_big_reduce_makes_its_stage_finish_earlier() -> None:
    prob = uniform_problem(4, 6, 1, 1, 1).replace(grad_reduce=(4.0, 0.0, 0.0, 0.0))
    plain = cpsat(prob.replace(grad_reduce=()))
    sched = cpsat(prob)
    assert sched.solver.status == "optimal"
    last_w = max(o.end for o in sched.ops if o.stage == 0)
    plain_last_w = max(o.end for o in plain.ops if o.stage == 0)
    assert last_w < plain_last_w  # stage 0 finishes its weight gradients earlier ...
    assert sched.iteration_time < plain_last_w + 4.0  # ... and hides part of the reduction
    assert sched.iteration_time == pytest.approx(max(sched.makespan, last_w + 4.0))
    for other in classics_that_fit(prob):
        assert sched.iteration_time <= other.iteration_time


def test_link_contention() -> None:
    p = 3
    lat, bw = chain_links(p, [0.1, 0.1], [2.0, 2.0])
    prob = Problem(devices=p, microbatches=4, forward=(1.0,) * p, backward_input=(1.0,) * p,
                   backward_weight=(0.5,) * p, latency=lat, bandwidth=bw,
                   message_size=(1.0, 1.0))  # 0.5 s on the link per message
    assert prob.has_link_contention
    sched = cpsat(prob)
    assert sched.messages  # the links are part of the schedule
    assert not check(sched)
    for other in classics_that_fit(prob):
        assert sched.iteration_time <= other.iteration_time * (1 + 1e-9)


# ----- infeasibility, limits, resolution, reproducibility -------------------------------

def test_infeasible_memory_explains_the_least_limit() -> None:
    prob = uniform_problem(2, 4, 1, 1, 1, activation=2.0, virtual_stages=2,
                           memory_limit=1.5)
    with pytest.raises(NotApplicable, match=r"device 0 needs at least 2") as exc:
        solve_cpsat(prob, SolveOptions(time_limit=5, workers=2))
    assert "memory.limit[0]" in str(exc.value)


def test_least_memory_is_enough() -> None:
    # Exactly the least memory: only one micro-batch at a time fits.
    prob = uniform_problem(3, 3, 1, 1, 1, memory_limit=1)
    sched = cpsat(prob)
    assert max(sched.peak_memory) <= 1
    assert sched.solver.status == "optimal"


def test_time_limit_returns_a_feasible_schedule() -> None:
    prob = uniform_problem(6, 12, 1, 1.2, 0.8, memory_limit=3, weight_grad=0.5)
    sched = cpsat(prob, time_limit=0.5)
    assert sched.solver.status in ("feasible", "optimal")
    assert sched.solver.wall_time < 8


def test_non_grid_times_still_give_a_valid_schedule_and_bound() -> None:
    lat, bw = chain_links(3, [0.00731, 0.0123456789], [math.inf, math.inf])
    prob = Problem(devices=3, microbatches=4, forward=(0.0417, 0.0391234567, 0.05),
                   backward_input=(0.0833, 0.07654321, 0.1), backward_weight=(0.04, 0.03, 0.0611),
                   latency=lat, bandwidth=bw, activation_memory=(1.0, 1.0, 1.0),
                   memory_limit=(2.0, 2.0, 2.0))
    assert not time_grid([0.0391234567, 0.07654321, 0.0123456789]).exact
    sched = cpsat(prob)
    assert not dict(sched.solver.details)["time_grid_exact"]
    for other in classics_that_fit(prob):
        assert sched.iteration_time <= other.iteration_time * (1 + 1e-9)
    # From a poor warm start the rounded model does the work: still valid, bound still proven.
    searched = cpsat(prob, hint=simulate(prob, sequential_orders(prob)))
    assert dict(searched.solver.details)["cpsat_status"] in ("OPTIMAL", "FEASIBLE")
    assert searched.iteration_time <= sched.iteration_time * 1.01


def test_short_decimals_sit_on_an_exact_grid() -> None:
    prob = uniform_problem(3, 4, 0.0417, 0.05, 0.03, memory_limit=3)
    sched = cpsat(prob)
    details = dict(sched.solver.details)
    assert details["time_grid_exact"] or details["cpsat_status"] == "SKIPPED"
    assert details["resolution_s"] == pytest.approx(0.0001)
    assert sched.solver.status == "optimal"


def test_explicit_resolution() -> None:
    prob = uniform_problem(3, 4, 1, 1.25, 0.75, memory_limit=3)
    coarse = cpsat(prob, resolution=0.5, hint=simulate(prob, sequential_orders(prob)))
    assert dict(coarse.solver.details)["resolution_s"] == 0.5
    fine = cpsat(prob, resolution=0.25)
    assert fine.solver.status == "optimal"
    assert fine.iteration_time <= coarse.iteration_time * (1 + 1e-9)


def test_same_seed_same_result() -> None:
    prob = uniform_problem(4, 6, 1, 1.2, 0.8, memory_limit=3, weight_grad=0.5)
    a = cpsat(prob, workers=1, seed=7, time_limit=2.0)
    b = cpsat(prob, workers=1, seed=7, time_limit=2.0)
    assert a.iteration_time == b.iteration_time
    if a.solver.status == "optimal":
        assert a.ops == b.ops


def test_hint_is_used_and_never_beaten() -> None:
    prob = uniform_problem(4, 6, 1, 1.2, 0.8, memory_limit=4)
    gpipe = run_classic(prob.replace(memory_limit=()), "gpipe")  # a fused, unlimited schedule
    sched = cpsat(prob, hint=gpipe)
    assert dict(sched.solver.details)["warm_start"] in ("gpipe", "sequential")
    assert sched.iteration_time <= run_classic(prob, "zb-h1").iteration_time * (1 + 1e-9)


def test_progress_reports() -> None:
    prob = uniform_problem(4, 6, 1, 1.2, 0.8, memory_limit=3, weight_grad=0.5)
    seen = []
    sched = cpsat(prob, on_progress=seen.append,
                  hint=simulate(prob, sequential_orders(prob)))
    assert seen
    last = seen[-1]
    assert last.objective == pytest.approx(sched.objective_value)
    assert last.bound == pytest.approx(sched.solver.lower_bound)
    assert all(r.bound <= r.objective * (1 + 1e-9) for r in seen if r.objective is not None)
    bounds = [r.bound for r in seen if r.bound is not None]
    # The reported bound never goes down (up to float noise).
    assert all(b >= a * (1 - 1e-12) for a, b in itertools.pairwise(bounds))


def test_log_goes_to_the_pipeopt_cpsat_logger(caplog: pytest.LogCaptureFixture) -> None:
    prob = uniform_problem(3, 4, 1, 1.2, 0.8, memory_limit=2)
    with caplog.at_level(logging.INFO, logger="pipeopt.cpsat"):
        cpsat(prob, log=True, hint=simulate(prob, sequential_orders(prob)))
    assert any("CP-SAT" in r.getMessage() for r in caplog.records
               if r.name == "pipeopt.cpsat")


def test_solve_dispatches_to_cpsat() -> None:
    prob = uniform_problem(3, 4, 1, 1.2, 0.8, memory_limit=2)
    sched = solve(prob, "cpsat", time_limit=5, workers=2)
    assert sched.method == "cpsat"
    assert sched.solver.status == "optimal"


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signals need the main thread")
def test_ctrl_c_stops_and_keeps_the_best() -> None:
    prob = uniform_problem(8, 24, 1, 1.2, 0.8, memory_limit=5, weight_grad=0.5)
    before = signal.getsignal(signal.SIGINT)
    sent = []

    def press_ctrl_c(report) -> None:
        # The first report from inside the search (the solver's own thread): press Ctrl-C.
        if not sent and threading.current_thread() is not threading.main_thread():
            sent.append(report)
            os.kill(os.getpid(), signal.SIGINT)

    sched = cpsat(prob, time_limit=30, on_progress=press_ctrl_c)
    assert signal.getsignal(signal.SIGINT) is before
    details = dict(sched.solver.details)
    assert sent, "the search never reported progress"
    if details["cpsat_status"] != "OPTIMAL":  # (it may have finished before the signal)
        assert details.get("interrupted") is True
        assert sched.solver.status == "feasible"
        assert sched.solver.wall_time < 15


def _slow_v(p: int = 4, m: int = 8, latency: float = 8.0) -> Problem:
    """crosspipe-v behind a slow middle link (tests/test_auto_kept_devices.py's ``_v``): at
    p = 4, m = 8, latency 8 s the analytic bound is 67.3 s and the optimum 72.5 s, which the
    kept-devices bound proves and CP-SAT's own bound does not within seconds."""
    lat = [0.0] * (p - 1)
    lat[p // 2 - 1] = latency
    links, bw = chain_links(p, lat, [math.inf] * (p - 1))
    return uniform_problem(p, m, 1.0, 1.2, 0.8, weight_grad=0.5, virtual_stages=2,
                           placement="vshape", memory_limit=float(p)
                           ).replace(latency=links, bandwidth=bw)


def test_known_bound_ends_the_search_when_met() -> None:
    """A caller's proven bound equal to the optimum: CP-SAT stops as soon as a schedule meets
    it (far below the 20 s limit), reports it as the bound and the schedule as optimal; handed
    that schedule as the hint it does not search at all."""
    prob = _slow_v()
    got = cpsat(prob, time_limit=20.0, known_bound=72.5)
    assert got.iteration_time == pytest.approx(72.5)
    assert got.solver.status == "optimal"
    assert got.solver.lower_bound == pytest.approx(72.5)
    assert got.solver.detail("known_bound") == 72.5
    assert got.solver.wall_time < 10.0
    again = cpsat(prob, time_limit=20.0, known_bound=72.5, hint=got)
    assert again.solver.detail("cpsat_status") == "SKIPPED"
    assert again.solver.status == "optimal" and again.solver.wall_time < 5.0


def test_known_bound_ends_the_search_on_an_inexact_grid() -> None:
    """On an inexact time grid (0.03 s per unit against 1.0 / 1.2 / 0.8 s ops) the bound is
    no model constraint; each solution is re-timed and the search stops at one that meets it
    (measured: 2.3 s, against the whole 15 s limit without the bound)."""
    got = cpsat(_slow_v(), time_limit=20.0, resolution=0.03, known_bound=72.5)
    assert got.solver.detail("time_grid_exact") is False
    assert got.iteration_time == pytest.approx(72.5)
    assert got.solver.status == "optimal" and got.solver.lower_bound == pytest.approx(72.5)
    assert got.solver.wall_time < 10.0


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, "72.5", True])
def test_known_bound_values_are_checked(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"^known_bound: must be a finite number of seconds"):
        SolveOptions(known_bound=bad)  # type: ignore[arg-type]


def test_known_bound_above_a_schedule_is_refused_or_ignored() -> None:
    """A "bound" above the warm start is refused up front, naming the field; one between the
    optimum and the warm start is found out when a better schedule turns up: ignored with a
    note, the reported bound never above the schedule and only the analytic one left."""
    prob = uniform_problem(2, 4, 1.0, 2.0)
    seq = simulate(prob, sequential_orders(prob), method="sequential")
    with pytest.raises(ConfigError, match=r"^known_bound: .* above the makespan of a valid"):
        solve_cpsat(prob, SolveOptions(time_limit=5.0, workers=2, hint=seq,
                                       known_bound=seq.iteration_time + 1))
    best = makespan_lower_bound(prob)  # no memory limit: the device bound is the optimum
    assert best < seq.iteration_time - 1
    # The full model takes the bound as its objective's floor and may stop at a schedule of
    # 18 s >= 17.5 s, which cannot show the bound wrong; LNS packs each window's starts early
    # (deterministic for a seed) and finds the 17 s one.
    got = validate(solve_lns(prob, SolveOptions(time_limit=5.0, workers=2, hint=seq,
                                                known_bound=best + 0.5)))
    assert got.iteration_time == pytest.approx(best)
    assert "not a lower bound" in got.solver.detail("known_bound_ignored")
    assert got.solver.lower_bound == pytest.approx(best)  # the analytic bound, met
