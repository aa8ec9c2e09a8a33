"""Core greedy, CP-SAT and bounds on small graphs: brute force over every device order gives the
optimum, CP-SAT proves it; the greedy is valid on random graphs; the validator catches any
single broken edge."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeopt.core.bounds import critical_path, device_bounds, heads, link_bounds, lower_bound
from pipeopt.core.cpsat import memory_grids_of, solve_cpsat, time_grid_of
from pipeopt.core.graph import GraphBuilder, TaskGraph
from pipeopt.core.greedy import Stuck, list_schedule, reference_order, solve_greedy
from pipeopt.core.simulate import DeadlockError, simulate
from pipeopt.core.validate import check
from pipeopt.problem import uniform_problem
from pipeopt.workloads import training


def _brute_force(graph: TaskGraph) -> float:
    """The least objective over every combination of device orders (timed earliest-start,
    within memory); exact without serialized links, where times follow from the orders."""
    best = math.inf
    for combo in itertools.product(*(itertools.permutations(t) for t in graph.device_tasks)):
        try:
            s = simulate(graph, [list(x) for x in combo], check=False)
        except DeadlockError:
            continue
        if not check(s):
            best = min(best, s.objective)
    return best


def _edge_server(memory: float | None = 3.0) -> TaskGraph:
    """Two edge devices send items to a server and hold each item's 2-byte buffer until the
    server's acknowledgement comes back (``memory`` per edge device); the server then merges."""
    g = GraphBuilder()
    e0, e1 = g.device(memory_limit=memory), g.device(memory_limit=memory)
    srv = g.device(memory_limit=4.0, static_memory=1.0)
    g.link(e0, srv, latency=0.5, both_ways=True)
    g.link(e1, srv, latency=1.0, both_ways=True)
    for name, dev, t_edge, t_srv in (("a0", e0, 1.0, 1.0), ("a1", e0, 2.0, 2.0),
                                     ("b0", e1, 1.5, 1.0)):
        g.task(name, dev, t_edge, mem_start=2.0)
        g.task(f"s{name}", srv, t_srv, mem_start=3.0, mem_end=-3.0)
        g.task(f"ack{name}", dev, 0.25, mem_end=-2.0, tail=0.5)
        g.edge(name, f"s{name}", bytes=1.0)
        g.edge(f"s{name}", f"ack{name}")
    g.task("merge", srv, 0.5)
    for x in ("sa0", "sa1", "sb0"):
        g.edge(x, "merge")
    return g.build()


def _diamond() -> TaskGraph:
    """A diamond over two devices with uneven branches and tails."""
    g = GraphBuilder()
    d0, d1 = g.device(), g.device()
    g.link(d0, d1, latency=0.25, both_ways=True)
    g.task("top", d0, 1.0)
    g.task("l1", d0, 2.0)
    g.task("l2", d0, 1.0, tail=3.0)
    g.task("r1", d1, 1.5)
    g.task("r2", d1, 0.5, tail=1.0)
    g.task("bottom", d1, 1.0)
    for a, b in (("top", "l1"), ("top", "r1"), ("l1", "l2"), ("r1", "r2"), ("l2", "bottom"),
                 ("r2", "bottom"), ("top", "r2")):
        g.edge(a, b)
    return g.build()


TINY = {
    "edge-server": _edge_server(),
    "edge-server-unlimited": _edge_server(None),
    "diamond": _diamond(),
    "chain-2x2-fused": training.build(uniform_problem(2, 2, 1.0, 1.5, 0.5, latency=0.3,
                                                      split_backward=False, memory_limit=1.0)),
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_cpsat_proves_the_brute_force_optimum(name: str) -> None:
    graph = TINY[name]
    opt = _brute_force(graph)
    s = solve_cpsat(graph, time_limit=20, workers=1)
    assert check(s) == []
    assert s.status == "optimal"
    assert s.objective == pytest.approx(opt, abs=1e-9)
    assert s.lower_bound == pytest.approx(opt, abs=1e-9)
    assert lower_bound(graph) <= opt + 1e-9
    g = solve_greedy(graph)
    assert check(g) == [] and g.objective >= opt - 1e-9


def test_memory_changes_the_optimum() -> None:
    tight, free = _brute_force(TINY["edge-server"]), _brute_force(TINY["edge-server-unlimited"])
    assert tight > free
    s = solve_cpsat(TINY["edge-server"], time_limit=20, workers=1)
    assert max(s.peak_memory[:2]) <= 3.0 and s.peak_memory[2] <= 4.0


def test_cpsat_with_serialized_links_is_valid_and_at_most_fifo_orders() -> None:
    g = GraphBuilder()
    d0, d1 = g.device(), g.device()
    g.link(d0, d1, latency=0.1, bandwidth=1.0)
    g.task("x", d0, 1.0)
    g.task("y", d0, 1.0)
    g.task("u", d1, 1.0, tail=4.0)
    g.task("v", d1, 1.0)
    g.edge("x", "v", bytes=2.0)
    g.edge("y", "u", bytes=2.0)
    graph = g.build()
    s = solve_cpsat(graph, time_limit=10, workers=1)
    assert check(s) == [] and s.status == "optimal"
    assert s.objective <= _brute_force(graph) + 1e-9
    assert s.messages and s.lower_bound is not None and s.lower_bound <= s.objective + 1e-9


def test_cpsat_on_a_chain_matches_the_chain_cpsat() -> None:
    from pipeopt.solvers import solve

    prob = uniform_problem(3, 4, 1.0, 1.3, 0.7, latency=0.2, memory_limit=2.0)
    chain = solve(prob, "cpsat", time_limit=20, workers=1)
    core = solve_cpsat(training.build(prob), time_limit=20, workers=1)
    assert chain.solver.status == core.status == "optimal"
    assert core.objective == pytest.approx(chain.iteration_time, abs=1e-9)


def test_resolution_knob_keeps_results_honest() -> None:
    graph = TINY["diamond"]
    assert time_grid_of(graph).exact  # 0.25 s latencies, on an exact grid
    grid = time_grid_of(graph, resolution=0.3)
    assert grid.unit == 0.3 and not grid.exact
    s = solve_cpsat(graph, time_limit=5, workers=1, resolution=0.3)
    assert check(s) == []
    assert s.lower_bound is not None and s.lower_bound <= _brute_force(graph) + 1e-9
    with pytest.raises(ValueError, match="resolution: must be a positive"):
        solve_cpsat(graph, resolution=0.0)
    with pytest.raises(ValueError, match="time_limit: must be a positive"):
        solve_cpsat(graph, time_limit=0)


def test_memory_grid() -> None:
    """Per device with a limit, the grid of pipeopt.solvers.cpsat_grid.memory_grid."""
    assert [g and (g.unit, g.exact) for g in memory_grids_of(TINY["edge-server"])] == [
        (1.0, True), (1.0, True), (3.0, True)]
    halves = TINY["edge-server"].replace(mem_start=tuple(x / 2 for x in
                                                         TINY["edge-server"].mem_start))
    assert [g and (g.unit, g.exact) for g in memory_grids_of(halves)] == [
        (1.0, True), (1.0, True), (1.5, True)]  # gcd of 1.5 (halved starts), 3 and the capacity 3
    thirds = TINY["edge-server"].replace(memory_limit=(None, None, 10 / 3))
    grids = memory_grids_of(thirds)
    assert grids[:2] == [None, None] and grids[2].exact  # 10/3 sits on a 1/3 grid
    odd = TINY["edge-server"].replace(memory_limit=(None, None, 4.1234567891))
    assert not memory_grids_of(odd)[2].exact


def test_bounds_by_hand() -> None:
    g = TINY["diamond"]
    # top 0-1; r1 after top + 0.25 latency: 1.25; r2 after r1 (2.75) and top; bottom after
    # l2 (1+2+1 = 4, +0.25) and r2 (3.25).
    assert heads(g) == [0.0, 1.0, 3.0, 1.25, 2.75, 4.25]
    # Longest chain: top, l1, l2, its 3 s tail: 7; or through bottom: 5.25.
    assert critical_path(g) == 7.0
    # Device 0: 0 + 4 s of work + 0 after l2's... l2's after-time is max(3, 0.25 + 1) = 3.
    assert device_bounds(g)[0] == 7.0
    assert link_bounds(g) == (0.0, 0.0)
    assert lower_bound(g) == 7.0


def test_greedy_reports_when_memory_blocks_everything() -> None:
    g = GraphBuilder()
    d = g.device(memory_limit=3.0)
    g.task("a", d, 1.0, mem_start=2.0, mem_end=0.0)
    g.task("b", d, 1.0, mem_start=2.0, mem_end=0.0)
    g.task("c", d, 1.0, mem_end=-4.0)
    g.edge("a", "c")
    g.edge("b", "c")
    with pytest.raises(Stuck, match=r"greedy: stuck under memory: device 0: b needs 2 more, "
                                    r"2 of 3 in use; even running the tasks one at a time"):
        solve_greedy(g.build())


def test_greedy_reservation_avoids_the_trap_of_two_chunks() -> None:
    """Two stages on one device (v = 2): starting every first-chunk F would leave no room for
    the second chunk's F; the reservation keeps it."""
    prob = uniform_problem(2, 6, virtual_stages=2, memory_limit=1.0)
    graph = training.build(prob)
    ref = reference_order(graph)
    assert sorted(ref) == list(range(graph.num_tasks))
    s = solve_greedy(graph)
    assert check(s) == [] and max(s.peak_memory) <= 1.0 + 1e-9


def test_greedy_on_pipelines_is_valid_and_fits() -> None:
    for prob in (uniform_problem(4, 8, memory_limit=2.0),
                 uniform_problem(4, 8, virtual_stages=2, placement="vshape", memory_limit=1.5),
                 uniform_problem(3, 5, split_backward=False, latency=0.4, memory_limit=2.0)):
        s = solve_greedy(training.build(prob))
        assert check(s) == [], prob
        assert s.lower_bound is not None and s.lower_bound <= s.objective + 1e-9


@st.composite
def graphs(draw: st.DrawFn) -> TaskGraph:
    """Random DAGs on 1-3 devices, links both ways between all of them, memory that each task
    takes at its start and gives back at its end or at a successor's end."""
    p = draw(st.integers(1, 3))
    n = draw(st.integers(1, 8))
    g = GraphBuilder()
    for _ in range(p):
        g.device()
    for a in range(p):
        for b in range(p):
            if a != b:
                g.link(a, b, latency=draw(st.sampled_from([0.0, 0.5, 1.25])),
                       bandwidth=draw(st.sampled_from([math.inf, 1.0, 4.0])))
    dev = [draw(st.integers(0, p - 1)) for _ in range(n)]
    mem = [draw(st.integers(0, 3)) for _ in range(n)]
    for i in range(n):
        g.task(f"t{i}", dev[i], draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
               mem_start=mem[i], mem_end=-mem[i], tail=draw(st.sampled_from([0.0, 1.0])))
    for j in range(n):
        for i in range(j):
            if draw(st.booleans()):
                g.edge(i, j, bytes=draw(st.sampled_from([0.0, 1.0, 3.0])))
    graph = g.build()
    limit = [draw(st.one_of(st.none(), st.integers(3, 8))) for _ in range(p)]
    return graph.replace(memory_limit=tuple(limit))


@given(graphs())
@settings(max_examples=80)
def test_greedy_is_valid_on_random_graphs(graph: TaskGraph) -> None:
    s = solve_greedy(graph)  # each task frees what it took: the depth-first order fits
    assert check(s) == []
    assert lower_bound(graph) <= s.objective + 1e-9
    assert s.lower_bound == lower_bound(graph)
    # The orders it chose are what the returned schedule runs.
    orders = list_schedule(graph)
    assert simulate(graph, orders).start == s.start


@given(graphs(), st.data())
@settings(max_examples=60)
def test_validator_rejects_any_single_broken_edge(graph: TaskGraph, data: st.DataObject
                                                  ) -> None:
    s = solve_greedy(graph)
    assert check(s) == []
    if not graph.num_edges:
        return
    e = data.draw(st.integers(0, graph.num_edges - 1))
    a, b = graph.src[e], graph.dst[e]
    arrival = next((m.arrival for m in s.messages if m.edge == e),
                   s.end[a] + graph.edge_latency[e])
    shift = s.start[b] - arrival + 0.125  # dst starts 0.125 s before its input arrives
    start = list(s.start)
    end = list(s.end)
    start[b] -= shift
    end[b] -= shift
    bad = check(replace(s, start=tuple(start), end=tuple(end)))
    name = f"{graph.label[a]} -> {graph.label[b]}: {graph.label[b]} starts at"
    assert any(v.startswith(name) for v in bad), bad


@given(graphs())
@settings(max_examples=30, deadline=None)
def test_cpsat_never_worse_than_greedy_and_bound_holds(graph: TaskGraph) -> None:
    s = solve_cpsat(graph, time_limit=2, workers=1)
    g = solve_greedy(graph)
    assert check(s) == []
    assert s.objective <= g.objective + 1e-9
    assert s.lower_bound is not None and s.lower_bound <= s.objective + 1e-9
    if not graph.serialized and s.status == "optimal" and graph.num_tasks <= 5:
        assert s.objective == pytest.approx(_brute_force(graph), abs=1e-9)
