"""auto's use of the kept-devices bound (pipeopt/solvers/kept_devices.py): on a V behind a slow
link whose turn device's memory sets the analytic bound, and on a large chain paced by memory
(instead of the relaxation's window), it raises auto's lower bound, never above the schedule;
everywhere else it is not run at all."""

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


def _chain(p: int, m: int, latency: float = 8.0) -> Problem:
    return _v(p, m, latency, chunks=1)


def test_kept_chain_picks_the_memory_device_and_the_last_ones(monkeypatch):
    """benchmarks/search.py's xdc p = 16, m = 64 (3,072 ops, device 0's memory sets the
    analytic 253 s): devices 0, 13, 14, 15 and the last 36 micro-batches (432 intervals: 3 per
    kept device and micro-batch). Not where memory paces no stage (p = 32, m = 128), below
    RESTART_MIN_OPS ops (p = 8, m = 32: the relaxation's whole model runs there), on a V, or
    with KEPT_TAIL = 0; the window is every micro-batch once they all fit."""
    assert auto_mod.kept_chain(_chain(16, 64)) == ((0, 13, 14, 15), 36)
    assert auto_mod.kept_chain(_chain(32, 128)) is None
    assert auto_mod.kept_chain(_chain(8, 32)) is None
    assert auto_mod.kept_chain(_v(16, 64, 8.0)) is None
    monkeypatch.setattr(auto_mod, "RESTART_MIN_OPS", 1000)
    assert auto_mod.kept_chain(_chain(8, 48)) == ((0, 5, 6, 7), 36)
    monkeypatch.setattr(auto_mod, "KEPT_CHAIN_OPS", 12 * 48)
    assert auto_mod.kept_chain(_chain(8, 48)) == ((0, 5, 6, 7), None)
    monkeypatch.setattr(auto_mod, "KEPT_TAIL", 0)
    assert auto_mod.kept_chain(_chain(8, 48)) is None


def test_auto_takes_the_kept_chain_instead_of_the_relaxation_window(no_cpsat, monkeypatch):
    """xdc p = 8, m = 48 with RESTART_MIN_OPS lowered to take the large-chain path (1,152 ops):
    auto asks the kept-devices bound (devices 0, 5, 6, 7, the last 36) instead of the
    relaxation's window, reports it above the analytic 227.4 s (229.6 s with the last 40 in
    10 s, loaded), and never above its schedule."""
    prob = _chain(8, 48)
    monkeypatch.setattr(auto_mod, "RESTART_MIN_OPS", 1000)
    assert makespan_lower_bound(prob) == pytest.approx(227.4)
    got = solve_auto(prob, SolveOptions(time_limit=30.0, workers=2))
    validate(got)
    assert got.solver.detail("relaxation_bound") is None
    kept = got.solver.detail("kept_devices_bound")
    assert kept is not None and kept > 227.4 + 1e-6
    assert got.solver.lower_bound >= kept - 1e-9
    assert kept <= got.iteration_time * (1 + 1e-9)


def _varied_v(chunks: int = 2) -> Problem:
    """The p = 4, m = 8 V (latency 8 s) with three image-like micro-batches among texts,
    memory 4 times the largest activation."""
    prob = _v(4, 8, 8.0, chunks).replace(
        microbatch_scale=(0.4, 2.0, 0.35, 0.45, 2.1, 0.3, 0.4, 1.9))
    return prob.replace(memory_limit=(4 * max(prob.memory_scale),) * 4)


def test_auto_kept_devices_for_varied_microbatches(no_cpsat, monkeypatch):
    """Micro-batches of different cost on a V behind a slow link: device 3 kept (48
    intervals, every micro-batch) raises auto's bound from the analytic 54.34 s to 54.92 s
    (tests/test_bounds_kept_devices.py), never above its schedule (with CP-SAT, 30 s: 55.87 s,
    its bound 54.925 s; 54.605 s in 20 s before). On the same micro-batches
    in a chain (one stage per device, as every instance of benchmarks/variable_microbatches.py)
    it is never asked."""
    prob = _varied_v()
    assert lower_bound(prob, "makespan") == pytest.approx(54.34)
    # 30 s: the greedy's search over micro-batch orders takes about half of it where CP-SAT
    # would follow (at 10 s it took all of it under load and the bound got no time).
    got = solve_auto(prob, SolveOptions(time_limit=30.0, workers=2))
    validate(got)
    assert got.solver.detail("kept_devices_bound") == pytest.approx(54.92)
    assert got.solver.lower_bound >= 54.92 - 1e-9
    assert got.solver.lower_bound <= got.iteration_time + 1e-9
    asked = []
    real = auto_mod._load
    monkeypatch.setattr(auto_mod, "_load", lambda module, func: (
        lambda problem, devices, **kw: asked.append(problem))
        if func == "kept_devices_bound" else real(module, func))
    chain = _varied_v(chunks=1)
    got = solve_auto(chain, SolveOptions(time_limit=5.0, workers=2))
    assert got.solver.detail("kept_devices_bound") is None and asked == []
