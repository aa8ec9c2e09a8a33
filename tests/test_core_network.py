"""Communication tasks on network resources (links and named networks) in the core."""

from __future__ import annotations

import dataclasses

import pytest

from pipeopt.core.bounds import link_bounds, lower_bound
from pipeopt.core.cpsat import solve_cpsat
from pipeopt.core.graph import GraphBuilder, GraphError, TaskGraph
from pipeopt.core.greedy import solve_greedy
from pipeopt.core.simulate import DeadlockError, OrderError, simulate
from pipeopt.core.validate import check, validate


def _contended() -> tuple[TaskGraph, dict[str, int]]:
    """A -> B across link 0->1 (2 bytes at 1 B/s, then 0.1 s), and a collective C of 1.5 s
    holding the same link, ready at 0."""
    g = GraphBuilder()
    d0, d1 = g.device(), g.device()
    link = g.link(d0, d1, latency=0.1, bandwidth=1.0)
    ids = {"A": g.task("A", d0, 1.0), "B": g.task("B", d1, 1.0),
           "C": g.comm("C", [link], 1.5)}
    g.edge("A", "B", bytes=2.0)
    return g.build(), ids


def test_simulator_queues_a_collective_and_a_message_on_one_link() -> None:
    graph, ids = _contended()
    assert graph.comm_tasks == (ids["C"],)
    assert graph.device_tasks == ((ids["A"],), (ids["B"],))
    sched = simulate(graph, [[ids["A"]], [ids["B"]]])
    # C is ready first (t = 0) and holds the link 0..1.5; the message, ready at 1, waits:
    # on the link 1.5..3.5, arrives 3.6; B runs 3.6..4.6.
    assert sched.start[ids["C"]] == 0.0 and sched.end[ids["C"]] == 1.5
    (msg,) = sched.messages
    assert (msg.start, msg.end) == (1.5, 3.5)
    assert msg.arrival == pytest.approx(3.6)
    assert sched.objective == pytest.approx(4.6)
    assert check(sched) == []


def test_validator_rejects_a_collective_overlapping_a_message() -> None:
    graph, ids = _contended()
    sched = simulate(graph, [[ids["A"]], [ids["B"]]])
    c = ids["C"]
    start = list(sched.start)
    end = list(sched.end)
    start[c], end[c] = 2.0, 3.5  # on the link while the message is (1.5..3.5)
    bad = dataclasses.replace(sched, start=tuple(start), end=tuple(end))
    found = check(bad)
    assert len(found) == 1 and found[0].startswith("link 0->1: C starts at 2")
    assert "message A -> B is on it until 3.5" in found[0]


def test_cpsat_puts_the_message_first_when_that_is_shorter() -> None:
    graph, _ = _contended()
    # Two orders on the link (brute force): C first -> 4.6 (above); message first: 1..3,
    # arrives 3.1, B ends 4.1, C 3..4.5 -> 4.5.
    sched = solve_cpsat(graph, time_limit=10, workers=1)
    assert sched.objective == pytest.approx(4.5)
    assert sched.status == "optimal"
    assert check(sched) == []
    # The bounds: critical path 1 + 2 + 0.1 + 1 = 4.1; the link holds C and the message,
    # min ready 0 + 1.5 + 2 + min after 0 = 3.5.
    assert lower_bound(graph) == pytest.approx(4.1)
    assert link_bounds(graph) == pytest.approx((3.5,))


def test_named_network_serializes_collectives_and_bounds_count_them() -> None:
    g = GraphBuilder()
    d0, d1, d2, d3 = (g.device() for _ in range(4))
    l01 = g.link(d0, d1)
    l23 = g.link(d2, d3)
    wan = g.network("wan")
    a = g.task("a", d0, 1.0)
    g.comm("x", [l01, wan], 2.0)
    g.comm("y", [l23, wan], 3.0)
    g.edge(a, "x")
    graph = g.build()
    assert graph.networks == ("wan",) and graph.num_resources == 3
    assert graph.holds[1] == (0, 2) and graph.holds[2] == (1, 2)
    sched = simulate(graph, [[a], [], [], []])
    # y is ready at 0 and takes the WAN 0..3; x is ready at 1 and waits: 3..5.
    assert (sched.start[2], sched.end[2]) == (0.0, 3.0)
    assert (sched.start[1], sched.end[1]) == (3.0, 5.0)
    assert check(sched) == []
    # The WAN: min ready 0 + 2 + 3 = 5, a bound met here.
    assert link_bounds(graph) == pytest.approx((3.0, 3.0, 5.0))  # x on 0->1: ready at 1
    assert lower_bound(graph) == pytest.approx(5.0)
    assert solve_greedy(graph).objective == pytest.approx(5.0)
    best = solve_cpsat(graph, time_limit=10, workers=1)
    assert best.objective == pytest.approx(5.0) and best.status == "optimal"
    overlap = dataclasses.replace(sched, start=(0.0, 1.0, 0.0), end=(1.0, 3.0, 3.0))
    assert any(v.startswith("wan: x starts at 1") for v in check(overlap))


def test_greedy_and_cpsat_on_a_contended_pipeline() -> None:
    """Two devices with a message per micro-batch and a collective on the same link after the
    last one: every method gives a valid schedule at or above the bound."""
    g = GraphBuilder()
    d0, d1 = g.device(memory_limit=2.0), g.device()
    link = g.link(d0, d1, latency=0.0, bandwidth=1.0)
    for j in range(3):
        g.task(f"f{j}", d0, 1.0, mem_start=1.0, mem_end=-1.0)
        g.task(f"g{j}", d1, 0.5)
        g.edge(f"f{j}", f"g{j}", bytes=0.5)
    g.comm("reduce", [link], 1.0)
    for j in range(3):
        g.edge(f"f{j}", "reduce")
    graph = g.build()
    for sched in (solve_greedy(graph), solve_cpsat(graph, time_limit=10, workers=1)):
        assert validate(sched) is sched
        assert sched.objective >= lower_bound(graph) - 1e-9
    # By hand: f0..f2 0..3, messages 1..1.5, 2..2.5, 3..3.5; g2 3.5..4; the reduction after
    # f2 (3) but behind the last message: 3.5..4.5. The bound: the link's load from 1:
    # 1 + 3 * 0.5 + 1 = 3.5; the chain f0 f1 f2 reduce = 4; optimum 4.5 (the link is busy
    # 3..3.5 with the last message, or the reduction delays it to 4..4.5 and g2 to 5).
    assert solve_cpsat(graph, time_limit=10, workers=1).objective == pytest.approx(4.5)


def test_deadlock_report_walks_through_a_communication_task() -> None:
    g = GraphBuilder()
    d0, d1 = g.device(), g.device()
    link = g.link(d0, d1, both_ways=True)
    g.task("a", d0, 1.0)
    g.comm("c", [link], 1.0)
    g.task("b", d1, 1.0)
    g.task("x", d0, 1.0)
    g.edge("a", "c")
    g.edge("c", "b")
    g.edge("b", "x")
    graph = g.build()
    with pytest.raises(DeadlockError, match="device 1 waits at b for a"):
        simulate(graph, [[3, 0], [2]])
    with pytest.raises(OrderError, match="tasks missing"):
        simulate(graph, [[0, 3], []])
    with pytest.raises(OrderError, match="c is a communication task, in no device order"):
        simulate(graph, [[0, 3, 1], [2]])


@pytest.mark.parametrize(("change", "message"), [
    ({"holds": ((), (0,))}, r"tasks.holds\[1\]: a task holds network resources exactly when"),
    ({"device": (0, -1), "holds": ((), ())}, r"tasks.holds\[1\]: a task holds network"),
    ({"device": (0, -1)}, r"tasks.device\[1\]: -1 \(a communication task\) needs"),
    ({"device": (0, -1), "holds": ((), (5,))}, r"tasks.holds\[1\]\[0\]: must be in 0..0, got 5"),
    ({"device": (0, -1), "holds": ((), (0, 0))}, r"tasks.holds\[1\]: a resource is listed"),
    ({"device": (0, -1), "holds": ((), (0,)), "mem_start": (0.0, 1.0)},
     r"tasks.mem_start\[1\]: a communication task changes no memory"),
    ({"device": (0, -1), "holds": ((), (0,)), "bytes": (3.0,)},
     r"edges\[0\]: t0 -> t1: an edge of a communication task carries no bytes"),
    ({"device": (0, -2)}, r"tasks.device\[1\]: must be in 0..1, got -2"),
    ({"networks": ("wan", 3)}, r"networks\[1\]: must be a string"),
])
def test_bad_network_columns_are_named(change: dict[str, object], message: str) -> None:
    cols: dict[str, object] = {"memory_limit": (None, None), "link_src": (0,), "link_dst": (1,),
                               "latency": (0.0,), "bandwidth": (1.0,), "device": (0, 1),
                               "duration": (1.0, 1.0), "src": (0,), "dst": (1,)}
    cols.update(change)
    with pytest.raises(GraphError, match=message):
        TaskGraph(**cols)  # type: ignore[arg-type]


def test_a_graph_without_communication_is_unchanged() -> None:
    g = GraphBuilder()
    d0, d1 = g.device(), g.device()
    g.link(d0, d1, bandwidth=1.0)
    g.task("a", d0, 1.0)
    g.task("b", d1, 1.0)
    g.edge("a", "b", bytes=1.0)
    graph = g.build()
    assert graph.holds == () and graph.networks == () and graph.comm_tasks == ()
    assert graph.num_resources == graph.num_links == 1
    assert simulate(graph, [[0], [1]]).objective == 3.0


def test_cpsat_keeps_its_order_on_a_link_off_an_exact_grid() -> None:
    """With a resolution that puts no value on the grid, the solver's own times are not kept;
    its order on the link (message before C) still is, timed in floats."""
    graph, ids = _contended()
    sched = solve_cpsat(graph, time_limit=10, workers=1, resolution=0.07)
    assert check(sched) == []
    assert sched.objective == pytest.approx(4.5)  # FIFO on the link would give 4.6
    (msg,) = sched.messages
    assert msg.end <= sched.start[ids["C"]]
