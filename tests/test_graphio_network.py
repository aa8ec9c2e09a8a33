"""Schedule JSON v2 with communication tasks (issue 13): data-parallel schedules round trip
exactly through ``graph.networks`` / ``graph.holds``; a hold naming a missing resource, a
collective overlapping another on a network resource and the other corruptions are refused
with the field path (or the tasks) and the reason."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeopt.core.cpsat import solve_cpsat
from pipeopt.core.greedy import solve_greedy
from pipeopt.core.schedule import GraphSchedule
from pipeopt.core.simulate import simulate
from pipeopt.graphio import (
    dump_any,
    graph_schedule_from_dict,
    graph_schedule_json,
    graph_schedule_to_dict,
    load_any,
)
from pipeopt.problem import uniform_problem
from pipeopt.schedules import GENERATORS
from pipeopt.simulate import ScheduleError
from pipeopt.workloads import dataparallel as dpw
from tests.test_dataparallel import _two_by_two
from tests.test_graphio import _DELETE, _set


def _same(a: GraphSchedule, b: GraphSchedule) -> None:
    assert b.graph == a.graph and dict(b.graph.meta) == dict(a.graph.meta)
    assert (b.start, b.end, b.method, b.status) == (a.start, a.end, a.method, a.status)
    assert sorted(b.messages) == sorted(a.messages)
    assert (b.lower_bound, b.wall_time) == (a.lower_bound, a.wall_time)


def _all_reduce_4() -> tuple[Any, dpw.DataParallel]:
    """4 replicas in one datacenter, plain all-reduce: one-way rings of 4 links, no network."""
    return uniform_problem(2, 2, 1.0, 1.0, 1.0), dpw.DataParallel(
        replicas=4, grad_bytes=(1e9, 1e9), latency=5e-6, bandwidth=1e10,
        reduction="all_reduce")


def _wan_4_stages() -> tuple[Any, dpw.DataParallel]:
    """4 stages over two datacenters: the reductions take turns on the shared WAN."""
    return uniform_problem(4, 4, 1.0, 1.0, 1.0), dpw.DataParallel(
        replicas=2, grad_bytes=(4e9,) * 4, latency=0.0, bandwidth=1e11, datacenter=(0, 1),
        wan_latency=0.01, wan_bandwidth=1.25e9)


INSTANCES: dict[str, Callable[[], tuple[Any, dpw.DataParallel]]] = {
    "2x2-wan": _two_by_two,  # type: ignore[dict-item]
    "all-reduce-4": _all_reduce_4,
    "4-stages-wan": _wan_4_stages,
}


def _hand(name: str) -> GraphSchedule:
    prob, dp = INSTANCES[name]()
    g = dpw.build(prob, dp)
    return simulate(g, dpw.task_orders(prob, dp, GENERATORS["1f1b"](prob)), method="1f1b")


@pytest.mark.parametrize("solver", ["hand", "greedy", "cpsat"])
@pytest.mark.parametrize("name", sorted(INSTANCES))
def test_data_parallel_round_trip(name: str, solver: str, tmp_path: Path) -> None:
    prob, dp = INSTANCES[name]()
    g = dpw.build(prob, dp)
    if solver == "hand":
        s = _hand(name)
    elif solver == "greedy":
        s = solve_greedy(g)
    else:
        s = solve_cpsat(g, time_limit=5, workers=1)
    path = tmp_path / "dp.json"
    dump_any(s, path)
    back = load_any(path)
    assert isinstance(back, GraphSchedule)
    _same(s, back)
    assert back.graph.holds == g.holds and back.graph.networks == g.networks
    assert graph_schedule_json(back) == path.read_text()
    doc = json.loads(path.read_text())
    pairs = [(i, r) for i in g.comm_tasks for r in g.holds[i]]
    assert list(zip(doc["graph"]["holds"]["task"], doc["graph"]["holds"]["resource"],
                    strict=True)) == pairs
    assert ("networks" in doc["graph"]) == bool(g.networks)


def test_hand_computed_sections() -> None:
    """2 stages x 2 replicas: 8 links (4 pipeline, then stage 0's ring 0<->2 = links 4, 5 and
    stage 1's ring 1<->3 = links 6, 7), the WAN is resource 8; AG 0 / RS 0 (tasks 8, 9) hold
    stage 0's ring and the WAN, AG 1 / RS 1 (10, 11) stage 1's."""
    doc = graph_schedule_to_dict(_hand("2x2-wan"))
    assert doc["graph"]["networks"] == {"name": ["wan"]}
    assert doc["graph"]["holds"] == {"task": [8, 8, 8, 9, 9, 9, 10, 10, 10, 11, 11, 11],
                                     "resource": [4, 5, 8, 4, 5, 8, 6, 7, 8, 6, 7, 8]}
    assert doc["graph"]["tasks"]["device"][8:] == [-1, -1, -1, -1]
    assert list(doc["graph"]) == ["devices", "links", "networks", "tasks", "holds", "edges",
                                  "meta"]
    # RS 1 hidden behind stage 0's backward (4.5..6), RS 0 after it (6.5..8): test_dataparallel.
    assert doc["timeline"]["start"][9:] == [6.5, 0.5, 4.5]
    assert doc["metrics"]["makespan"] == 8.0


def test_a_graph_without_communication_writes_no_network_sections() -> None:
    from tests.test_graphio import tiny

    doc = graph_schedule_to_dict(solve_greedy(tiny()))
    assert "networks" not in doc["graph"] and "holds" not in doc["graph"]


def _doc() -> dict[str, Any]:
    return graph_schedule_to_dict(_hand("2x2-wan"))


CORRUPTIONS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("missing resource", _set("graph.holds.resource[2]", 9),
     r"^graph\.holds\.resource\[2\]: must be in 0\.\.8 \(the links, then the networks\), "
     r"got 9"),
    ("network left out", _set("graph.networks", _DELETE),
     r"^graph\.holds\.resource\[2\]: must be in 0\.\.7 \(the links, then the networks\), "
     r"got 8"),
    ("missing task", _set("graph.holds.task[0]", 12),
     r"^graph\.holds\.task\[0\]: must be in 0\.\.11 \(the tasks\), got 12"),
    ("negative resource", _set("graph.holds.resource[0]", -1),
     r"^graph\.holds\.resource\[0\]: must be in 0\.\.8"),
    ("resource type", _set("graph.holds.resource[0]", 4.0),
     r"^graph\.holds\.resource\[0\]: expected an integer, got 4\.0"),
    ("columns differ", _set("graph.holds.resource", [4]),
     r"^graph\.holds\.resource: expected 12 values, got 1"),
    ("no task column", _set("graph.holds.task", _DELETE), r"^graph\.holds\.task: missing"),
    ("unknown holds field", _set("graph.holds.link", []), r"^graph\.holds\.link: unknown field"),
    ("holds not object", _set("graph.holds", [[4, 5]]),
     r"^graph\.holds: expected an object, got \[\[4, 5\]\]"),
    ("network name type", _set("graph.networks.name[0]", 1),
     r"^graph\.networks\.name\[0\]: expected a string, got 1"),
    ("unknown networks field", _set("graph.networks.kind", ["wan"]),
     r"^graph\.networks\.kind: unknown field"),
    ("held twice", _set("graph.holds.resource[1]", 4),
     r"^graph\.holds \(task 8\): a resource is listed twice: \(4, 4, 8\)"),
    ("a device task holding", _set("graph.holds.task[0]", 0),
     r"^graph\.holds \(task 0\): a task holds network resources exactly when it is a "
     r"communication task \(device -1\); device 0, holds \(4,\)"),
    ("no holds at all", _set("graph.holds", _DELETE),
     r"^graph\.tasks\.device\[8\]: -1 \(a communication task\) needs graph\.holds pairs "
     r"\(task 8, resource\): the resources it holds$"),
    ("collective with memory", _set("graph.tasks.mem_start[9]", 1.0),
     r"^graph\.tasks\.mem_start\[9\]: a communication task changes no memory"),
    ("collective edge with bytes", _set("graph.edges.bytes[8]", 1.0),
     r"^graph\.edges\[8\]: AG 0 -> r0\.0F0: an edge of a communication task carries no bytes"),
    # RS 1 moved from 4.5..6 to 6..7.5: its inputs allow it, but RS 0 holds the WAN 6.5..8.
    ("overlap on the wan", _set("timeline", {"start": [0.5, 1.5, 4.5, 2.5, 0.5, 1.5, 4.5, 2.5,
                                                       0.0, 6.5, 0.5, 6.0],
                                             "end": [1.5, 2.5, 6.5, 4.5, 1.5, 2.5, 6.5, 4.5,
                                                     0.5, 8.0, 1.0, 7.5]}),
     r"^invalid schedule: wan: RS 0 starts at 6\.5 while RS 1 is on it until 7\.5"),
    ("collective before its input", _set("timeline", {
        "start": [0.5, 1.5, 4.5, 2.5, 0.5, 1.5, 4.5, 2.5, 0.0, 6.0, 0.5, 4.5],
        "end": [1.5, 2.5, 6.5, 4.5, 1.5, 2.5, 6.5, 4.5, 0.5, 7.5, 1.0, 6.0]}),
     r"^invalid schedule: r0\.0B0 -> RS 0: RS 0 starts at 6 before its input from r0\.0B0 "
     r"is available at 6\.5"),
]


def test_the_corrupted_document_is_valid_before() -> None:
    doc = _doc()
    assert doc["timeline"]["start"] == [0.5, 1.5, 4.5, 2.5, 0.5, 1.5, 4.5, 2.5, 0.0, 6.5, 0.5,
                                        4.5]
    graph_schedule_from_dict(copy.deepcopy(doc))


@pytest.mark.parametrize("name,corrupt,message", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_corruption_refused(name: str, corrupt: Callable[[dict[str, Any]], None],
                            message: str) -> None:
    doc = _doc()
    doc.pop("metrics")  # the times changed by some corruptions would change them too
    corrupt(doc)
    with pytest.raises(ScheduleError, match=message):
        graph_schedule_from_dict(doc)


def test_holds_capped_before_building(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeopt import graphio

    monkeypatch.setattr(graphio, "MAX_HOLDS", 11)
    with pytest.raises(ScheduleError, match=r"^graph\.holds\.task: at most 11 values, got 12"):
        graph_schedule_from_dict(_doc())


def test_pairs_in_any_order_are_grouped_by_task() -> None:
    """The writer groups pairs by task; a reader takes them in any order, each task's
    resources in the order listed (RS 1 listed first, AG 0's WAN before its links)."""
    doc = _doc()
    doc["graph"]["holds"] = {"task": [11, 11, 11, 8, 9, 9, 9, 10, 10, 10, 8, 8],
                             "resource": [6, 7, 8, 8, 4, 5, 8, 6, 7, 8, 4, 5]}
    doc.pop("metrics")
    s = graph_schedule_from_dict(doc)
    assert s.graph.holds[8:] == ((8, 4, 5), (4, 5, 8), (6, 7, 8), (6, 7, 8))
    assert graph_schedule_to_dict(s)["graph"]["holds"]["task"] == [8, 8, 8, 9, 9, 9, 10, 10,
                                                                  10, 11, 11, 11]


@pytest.mark.parametrize("seed", range(6))
def test_random_data_parallel_round_trip_and_views(seed: int) -> None:
    """Random small instances (test_dataparallel's family: 2-3 stages and replicas, ring or
    WAN, reduce-scatter or all-reduce), greedy: the document round trips exactly, and the
    trace shows every collective once per resource it holds, on no device track."""
    import dataclasses
    import random

    from pipeopt.trace import NETWORK_PID, to_graph_trace_events

    rng = random.Random(seed)
    p, m = rng.choice([(2, 2), (2, 3), (3, 2)])
    prob = uniform_problem(p, m, rng.uniform(0.5, 1.5), rng.uniform(0.5, 1.5),
                           rng.uniform(0.2, 1.0), latency=rng.choice([0.0, 0.05]))
    cfg = dpw.DataParallel(replicas=rng.choice([2, 3]),
                           grad_bytes=tuple(rng.uniform(0.5e9, 3e9) for _ in range(p)),
                           latency=1e-5, bandwidth=rng.choice([1e9, 1e10]),
                           reduction=rng.choice(["reduce_scatter", "all_reduce"]))
    if cfg.replicas == 2 and rng.random() < 0.5:
        cfg = dataclasses.replace(cfg, datacenter=(0, 1), wan_latency=0.03,
                                  wan_bandwidth=1.25e9)
    s = solve_greedy(dpw.build(prob, cfg))
    back = graph_schedule_from_dict(json.loads(graph_schedule_json(s)))
    _same(s, back)
    g = s.graph
    ev = to_graph_trace_events(back)["traceEvents"]
    on_net = sorted(e["args"]["task"] for e in ev if e["ph"] == "X" and e["pid"] == NETWORK_PID)
    assert on_net == sorted(i for i in g.comm_tasks for _ in g.holds[i])
    assert not [e for e in ev if e["ph"] == "X" and e["pid"] != NETWORK_PID
                and e.get("args", {}).get("task") in g.comm_tasks]


def test_holds_in_a_graph_without_resources() -> None:
    doc = {"format": "pipeopt.schedule/v2", "method": "hand",
           "graph": {"devices": {"memory_limit": [None]},
                     "tasks": {"device": [0, -1], "duration": [1.0, 1.0]},
                     "holds": {"task": [1], "resource": [0]}},
           "timeline": {"start": [0.0, 0.0], "end": [1.0, 1.0]}}
    with pytest.raises(ScheduleError, match=r"^graph\.holds\.resource\[0\]: the graph has no links "
                                            r"and no networks, got 0$"):
        graph_schedule_from_dict(doc)
    doc["graph"]["networks"] = {"name": ["nic"]}
    s = graph_schedule_from_dict(doc)  # a NIC held while device 0 computes: both at once
    assert s.graph.holds == ((), (0,)) and s.graph.resource_name(0) == "nic"
