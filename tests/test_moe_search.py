"""The MoE search's parts (pipeopt.solvers.moe, pipeopt.workloads.moe): admission edges that
keep a stage within the micro-batches its memory holds, the age priority, the forward-backward
passes (pipeopt.core.justify) and the one-machine bound it reports
(pipeopt.core.bounds.one_machine_bounds), by hand and against CP-SAT optima."""

from __future__ import annotations

import dataclasses
import random

import pytest

from pipeopt.core.bounds import lower_bound, one_machine_bounds
from pipeopt.core.cpsat import solve_cpsat
from pipeopt.core.graph import GraphBuilder
from pipeopt.core.greedy import list_schedule
from pipeopt.core.justify import backward_pass, improve, improve_randomly, reversed_graph
from pipeopt.core.simulate import simulate
from pipeopt.core.validate import check
from pipeopt.solvers import moe as sm
from pipeopt.workloads import moe as wl


def pipeline(p: int = 3, m: int = 4, limit: float | None = None) -> wl.MoEPipeline:
    """Per stage and micro-batch 4 + 6 = 10 bytes of activations (attention, experts)."""
    blk = wl.MoEBlock(wl.Work(1.0, 1.0, 1.0, 4.0, 2.0), wl.Work(2.0, 2.0, 2.0, 6.0, 3.0),
                      0.75, 0.5)
    return wl.MoEPipeline(stages=((blk,),) * p, microbatches=m, memory_limit=(limit,) * p,
                          post=(wl.Work(0.0),) * (p - 1) + (wl.Work(0.25, 0.25, 0.25),))


def test_one_machine_bound_by_hand() -> None:
    """Device 0 runs x (3 s, nothing after it), a and b (1 s each), which feed c_a and c_b
    (5 s) on devices 1 and 2. The critical path is 6 s and device 0's load 5 s, but a and b
    run one at a time and the second is followed by 5 s: >= 0 + 2 + 5 = 7 s, which the
    orders [a, b, x], [c_a], [c_b] reach (CP-SAT proves it optimal)."""
    g = GraphBuilder()
    d0, d1, d2 = g.device(), g.device(), g.device()
    g.link(d0, d1)
    g.link(d0, d2)
    x, a, b = g.task("x", d0, 3.0), g.task("a", d0, 1.0), g.task("b", d0, 1.0)
    ca, cb = g.task("c_a", d1, 5.0), g.task("c_b", d2, 5.0)
    g.edge(a, ca)
    g.edge(b, cb)
    graph = g.build()
    assert lower_bound(graph) == pytest.approx(6.0)
    assert one_machine_bounds(graph) == pytest.approx((7.0, 6.0, 6.0, 0.0, 0.0))  # c_*: head 1
    assert simulate(graph, [[a, b, x], [ca], [cb]]).objective == pytest.approx(7.0)
    best = solve_cpsat(graph, time_limit=10, workers=1)
    assert best.status == "optimal" and best.objective == pytest.approx(7.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_machine_bound_is_below_the_optimum(seed: int) -> None:
    """Random 2-stage, 2-micro-batch pipelines (44 tasks): the bound never passes the optimum
    CP-SAT proves, and it is at least the core bound's device part."""
    rng = random.Random(seed)

    def work() -> wl.Work:
        return wl.Work(*(rng.choice((0.5, 1.0, 2.0)) for _ in range(3)))

    blk = wl.MoEBlock(work(), work(), rng.choice((0.5, 1.0, 3.0)), rng.choice((0.5, 2.0)))
    pipe = wl.MoEPipeline(stages=((blk,),) * 2, microbatches=2)
    graph = wl.build(pipe)
    best = solve_cpsat(graph, time_limit=20, workers=1)
    assert best.status == "optimal"
    assert max(one_machine_bounds(graph)) <= best.objective + 1e-9
    found = sm.search(pipe, time_limit=5, workers=1)
    assert found.lower_bound is not None and found.lower_bound <= best.objective + 1e-9


def test_inflight_limits_and_admission_edges_keep_memory() -> None:
    """25 bytes per device and 10 per micro-batch: 2 micro-batches open per stage. The greedy
    on the admitted graph never opens a third (an F starts only after the W two micro-batches
    back ended), so its schedule fits without any memory check of its own."""
    pipe = pipeline(limit=25.0)
    assert [wl.stage_activation(pipe, s) for s in range(3)] == [10.0, 10.0, 10.0]
    assert wl.inflight_limits(pipe) == (2, 2, 2)
    assert wl.inflight_limits(dataclasses.replace(pipe, memory_limit=(None,) * 3)) == (4,) * 3
    g = wl.build(pipe)
    ga = wl.admitted(g, pipe)
    assert ga.num_edges == g.num_edges + 3 * (4 - 2)
    sched = simulate(g, list_schedule(ga.replace(memory_limit=(None,) * 3),
                                      wl.age_priority(g, pipe)))
    assert check(sched) == []  # within 25 bytes with no memory rule in the list scheduler
    assert max(sched.peak_memory) <= 25.0
    index = wl._assemble(pipe).index
    for s in range(3):
        spans = [(sched.start[index[("Fattn", s, j, 0)]], sched.end[index[("Wall", s, j, -1)]])
                 for j in range(4)]
        for t, _ in spans:
            assert sum(1 for a, b in spans if a <= t < b) <= 2
    with pytest.raises(ValueError, match="limits: expected 3 integers >= 1"):
        wl.admitted(g, pipe, (2, 0, 2))


def test_age_priority_prefers_backward_then_older_micro_batches() -> None:
    pipe = pipeline(p=1, m=2)
    g = wl.build(pipe)
    prio = wl.age_priority(g, pipe)
    at = {g.label[i]: prio[i] for i in range(g.num_tasks) if g.device[i] >= 0}
    assert at["0B0.experts0"] > at["0B1.attn0"] > at["0F0.attn0"] > at["0F1.experts0"]
    assert at["0F1.out"] > at["0W0.all"] > at["0W1.all"]
    assert all(prio[i] == 0.0 for i in g.comm_tasks)


def test_search_within_tight_memory_is_no_worse_than_the_admitted_greedy() -> None:
    pipe = pipeline(p=3, m=6, limit=25.0)
    g = wl.build(pipe)
    greedy = simulate(g, list_schedule(wl.admitted(g, pipe), wl.age_priority(g, pipe)))
    found = sm.search(pipe, time_limit=2, workers=1)
    assert check(found) == [] and check(greedy) == []
    assert found.objective <= greedy.objective + 1e-12
    assert found.lower_bound is not None
    assert found.lower_bound >= max(one_machine_bounds(g)) - 1e-12


def test_reversed_graph_mirrors_edges_links_and_memory() -> None:
    pipe = pipeline(p=2, m=2, limit=25.0)
    g = wl.build(pipe)
    r = reversed_graph(g)
    assert (r.src, r.dst) == (g.dst, g.src)
    assert (r.link_src, r.link_dst) == (g.link_dst, g.link_src)
    assert r.mem_start == tuple(-x for x in g.mem_end)
    assert r.mem_end == tuple(-x for x in g.mem_start)
    assert r.static_memory == g.static_memory  # every byte allocated is freed
    # a list schedule of the reversed graph, each device order read backwards, is a valid
    # schedule of the graph with the same peak memory per device
    orders = list_schedule(r, wl.age_priority(g, pipe))
    back = simulate(r, orders)
    forth = backward_pass(g, r, wl.age_priority(g, pipe))
    assert check(forth) == []
    assert forth.peak_memory == pytest.approx(back.peak_memory)
    with pytest.raises(ValueError, match="tail"):
        reversed_graph(g.replace(tail=(1.0, *g.tail[1:])))


def test_forward_backward_passes_reach_the_optimum_by_hand() -> None:
    """Device 0 runs a and b (1 s each), a feeds c (3 s) on device 1. The forward list
    schedule by a priority that prefers b runs b, a, c: 5 s. The backward pass puts c (the
    latest end) first in reverse, b at reverse time 0 and a after c: read backwards a, b and
    c at 1: 4 s, the critical path."""
    gb = GraphBuilder()
    d0, d1 = gb.device(), gb.device()
    gb.link(d0, d1)
    a, b, c = gb.task("a", d0, 1.0), gb.task("b", d0, 1.0), gb.task("c", d1, 3.0)
    gb.edge(a, c)
    graph = gb.build()
    poor = simulate(graph, list_schedule(graph, [0.0, 1.0, 0.0]), "poor")
    assert poor.objective == pytest.approx(5.0)
    better = improve(graph, poor)
    assert better.objective == pytest.approx(4.0) and check(better) == []
    assert better.device_orders()[0] == [a, b]
    assert "backward pass" in better.method
    again = improve_randomly(graph, poor, trials=5, noise=0.1, seed=3)
    assert again.objective == pytest.approx(4.0)
    assert again.start == improve_randomly(graph, poor, trials=5, noise=0.1, seed=3).start
    with pytest.raises(ValueError, match="trials: must be an integer >= 0"):
        improve_randomly(graph, poor, trials=-1, noise=0.1)
