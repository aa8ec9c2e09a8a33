"""auto's use of the kept-devices bound (pipeopt/solvers/kept_devices.py): on a V behind a slow
link whose turn device's memory sets the analytic bound it raises auto's lower bound, never
above the schedule; everywhere else it is not run at all."""

from __future__ import annotations

import math

import pytest

from pipeopt.bounds import makespan_lower_bound
from pipeopt.errors import ConfigError
from pipeopt.problem import Problem, chain_links, uniform_problem
from pipeopt.simulate import validate
from pipeopt.solvers import SolveOptions, lower_bound
from pipeopt.solvers import auto as auto_mod
from pipeopt.solvers.auto import solve_auto


def _v(p: int, m: int, latency: float, chunks: int = 2) -> Problem:
    """benchmarks/search.py's ``xdc_link`` without transmission: ``latency`` seconds on the
    middle link, F / B / W = 1 / 1.2 / 0.8 s, 1F1B's memory (p activations)."""
    lat = [0.0] * (p - 1)
    lat[p // 2 - 1] = latency
    links, bw = chain_links(p, lat, [math.inf] * (p - 1))
    return uniform_problem(p, m, 1.0, 1.2, 0.8, weight_grad=0.5, virtual_stages=chunks,
                           placement="vshape" if chunks == 2 else "loop",
                           memory_limit=float(p)).replace(latency=links, bandwidth=bw)


def test_auto_bound_rises_to_the_kept_devices_value(no_cpsat):
    """crosspipe-v p = 4, m = 8, latency 8 s (``search.py --analogues``): analytic 67.3 s,
    CP-SAT's proven optimum 72.5 s, which device 3 kept exactly proves in well under a second
    (tests/test_bounds_kept_devices.py). auto reports it, and never above its schedule."""
    prob = _v(4, 8, 8.0)
    assert lower_bound(prob, "makespan") == pytest.approx(67.3)
    got = solve_auto(prob, SolveOptions(time_limit=10.0, workers=2))
    validate(got)
    assert got.solver.detail("kept_devices_bound") == pytest.approx(72.5)
    assert got.solver.lower_bound == pytest.approx(72.5)
    assert got.solver.lower_bound <= got.iteration_time + 1e-9
    if got.iteration_time <= 72.5 + 1e-9:  # the greedy or a hand-made schedule found it
        assert got.solver.status == "optimal"
        assert "proves the best so far optimal" in got.solver.detail("skipped_cpsat")


def test_auto_runs_the_kept_devices_bound_only_inside_its_gate(no_cpsat, monkeypatch):
    """Outside the gate auto takes its old path: the bound is never asked for. A chain with a
    slow link (one stage per device), a V without a slow link, a V whose analytic bound is not
    the kept device's memory (latency 2 s: memory 31.3 s, analytic 31.8 s), and the span
    objective. The V with latency 8 s does ask (the spy sees it)."""
    asked = []
    real = auto_mod._load

    def spy(problem, devices, **kw):
        asked.append(problem)
        return None

    monkeypatch.setattr(auto_mod, "_load", lambda module, func: spy
                        if func == "kept_devices_bound" else real(module, func))
    outside = [(_v(4, 8, 8.0, chunks=1), "makespan"), (_v(4, 8, 0.0), "makespan"),
               (_v(4, 8, 2.0), "makespan"), (_v(4, 8, 8.0), "span")]
    for prob, objective in outside:
        got = solve_auto(prob, SolveOptions(time_limit=5.0, workers=2, objective=objective))
        assert got.solver.detail("kept_devices_bound") is None
        assert got.solver.lower_bound >= lower_bound(prob, objective) - 1e-9
    assert asked == []
    assert makespan_lower_bound(_v(4, 8, 2.0)) == pytest.approx(31.8)
    inside = _v(4, 8, 8.0)
    solve_auto(inside, SolveOptions(time_limit=10.0, workers=2))  # 15 % of it: over 1 s
    assert asked == [inside]


def test_auto_stops_once_cpsat_meets_the_kept_devices_bound():
    """With CP-SAT: auto hands it the kept-devices bound (72.5 s, the optimum), so the search
    ends when a schedule meets it instead of running to the 20 s limit (issue 12: the whole
    time limit unless optimality is proven). A caller's ``known_bound`` above a schedule auto
    found is refused, naming the field."""
    prob = _v(4, 8, 8.0)
    got = solve_auto(prob, SolveOptions(time_limit=20.0, workers=2))
    validate(got)
    assert got.iteration_time == pytest.approx(72.5)
    assert got.solver.status == "optimal"
    assert got.solver.lower_bound == pytest.approx(72.5)
    assert got.solver.wall_time < 10.0
    with pytest.raises(ConfigError, match=r"^known_bound: 1000 s is above the makespan"):
        solve_auto(prob, SolveOptions(time_limit=5.0, workers=2, known_bound=1000.0))
