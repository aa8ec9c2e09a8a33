"""Schedule JSON v2: hand-built graphs solved by the core greedy and CP-SAT survive a round trip
exactly; every corruption is refused with the field path and the reason; v1 files are read and
written as before."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipeopt
from pipeopt import graphio
from pipeopt.core.cpsat import solve_cpsat
from pipeopt.core.graph import GraphBuilder, TaskGraph
from pipeopt.core.greedy import solve_greedy
from pipeopt.core.schedule import GraphSchedule
from pipeopt.core.simulate import simulate
from pipeopt.graphio import (
    FORMAT_V2,
    dump_any,
    graph_schedule_from_dict,
    graph_schedule_json,
    graph_schedule_to_dict,
    load_any,
    schedule_from_any_dict,
)
from pipeopt.io import dump_schedule, load_schedule, schedule_json
from pipeopt.problem import uniform_problem
from pipeopt.schedule import Schedule
from pipeopt.simulate import ScheduleError
from pipeopt.workloads import training
from tests.test_core_solvers import _edge_server, graphs


def edge_server() -> TaskGraph:
    """test_core_solvers' edge devices feeding a server, the edge-to-server links made
    serialized (2 bytes/s) and task groups / device kinds recorded in ``meta``."""
    graph = _edge_server()
    groups = tuple("edge" if graph.device[i] < 2 else "server" for i in range(graph.num_tasks))
    bw = tuple(2.0 if (a, b) == (0, 2) else math.inf
               for a, b in zip(graph.link_src, graph.link_dst, strict=True))
    return graph.replace(bandwidth=bw, meta=(("task_group", groups),
                                             ("device_kind", ("edge", "edge", "server"))))


def tiny() -> TaskGraph:
    """x on device 0 sends 1 byte at 2 bytes/s (0.5 s) with 0.5 s latency to y on device 1;
    y returns to z on device 0 (latency only). Hand-computed: x 0-1, message 1-1.5 arrives 2,
    y 2-4, z 4.5-6; objective max(6, 4 + 0.25) = 6; peak memory 2 on device 0 (x holds 2
    bytes), 1 on device 1 (static)."""
    g = GraphBuilder()
    a, b = g.device(memory_limit=4.0), g.device(static_memory=1.0)
    g.link(a, b, latency=0.5, bandwidth=2.0, both_ways=True)
    g.task("x", a, 1.0, mem_start=2.0, mem_end=-2.0)
    g.task("y", b, 2.0, tail=0.25)
    g.task("z", a, 1.5, tail=3.0)
    g.edge("x", "y", bytes=1.0)
    g.edge("y", "z")
    return g.build()


def serialized_chain() -> TaskGraph:
    """The training builder's graph of a 3-stage chain, its links at 2 bytes/s and every
    edge carrying 1 byte (messages contend for the links)."""
    graph = training.build(uniform_problem(3, 4, 1.0, 1.5, 0.5, latency=0.25,
                                           memory_limit=4.0))
    return graph.replace(bandwidth=(2.0,) * graph.num_links, bytes=(1.0,) * graph.num_edges)


GRAPHS: dict[str, Callable[[], TaskGraph]] = {
    "tiny": tiny,
    "edge-server": edge_server,
    "training-serialized": serialized_chain,
}



def _same(a: GraphSchedule, b: GraphSchedule) -> None:
    assert b.graph == a.graph  # every column (meta compared apart: it is not part of ==)
    assert dict(b.graph.meta).keys() == dict(a.graph.meta).keys()
    for key, val in a.graph.meta:
        assert tuple(dict(b.graph.meta)[key]) == tuple(val)
    assert (b.start, b.end, b.method, b.status) == (a.start, a.end, a.method, a.status)
    assert sorted(b.messages) == sorted(a.messages)
    assert (b.lower_bound, b.wall_time) == (a.lower_bound, a.wall_time)


@pytest.mark.parametrize("solver", ["greedy", "cpsat"])
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_round_trip(name: str, solver: str, tmp_path: Path) -> None:
    graph = GRAPHS[name]()
    s = solve_greedy(graph) if solver == "greedy" else solve_cpsat(graph, time_limit=10,
                                                                   workers=1)
    path = tmp_path / "s.json"
    dump_any(s, path)
    text = path.read_text()
    back = load_any(path)
    assert isinstance(back, GraphSchedule)
    _same(s, back)
    assert graph_schedule_json(back) == text  # writing what was read gives the same text
    doc = json.loads(text)
    assert doc["format"] == FORMAT_V2
    assert doc["metrics"]["peak_memory"] == list(s.peak_memory)


def test_hand_computed_document() -> None:
    s = simulate(tiny(), [[0, 2], [1]], method="hand")
    doc = graph_schedule_to_dict(s)
    assert doc["timeline"]["start"] == [0.0, 2.0, 4.5]
    assert doc["timeline"]["end"] == [1.0, 4.0, 6.0]
    assert doc["timeline"]["messages"] == {"edge": [0], "start": [1.0], "end": [1.5],
                                           "arrival": [2.0]}
    assert doc["metrics"] == {"makespan": 6.0, "objective": 9.0, "peak_memory": [2.0, 1.0]}
    assert doc["solver"] == {"status": "heuristic", "lower_bound": None, "gap": None,
                             "wall_time": 0.0}
    assert doc["graph"]["devices"] == {"memory_limit": [4.0, None], "static_memory": [0.0, 1.0]}
    assert doc["graph"]["links"]["bandwidth"] == [2.0, 2.0]


def test_a_graph_without_links_or_edges_may_leave_them_out() -> None:
    doc = {"format": FORMAT_V2, "method": "hand",
           "graph": {"devices": {"memory_limit": [None]},
                     "tasks": {"device": [0, 0], "duration": [1.0, 2.0]}},
           "timeline": {"start": [2.0, 0.0], "end": [3.0, 2.0]}}
    s = graph_schedule_from_dict(doc)
    assert (s.makespan, s.graph.label, s.graph.num_links, s.messages) == (3.0, ("t0", "t1"), 0,
                                                                          ())
    doc["graph"]["edges"] = {"src": [0], "dst": [1]}
    with pytest.raises(ScheduleError, match=r"^invalid schedule: t0 -> t1: t1 starts at 0 "
                                            r"before its input from t0 is available at 3"):
        graph_schedule_from_dict(doc)


def test_infinite_bandwidth_written_as_inf() -> None:
    g = GraphBuilder()
    a, b = g.device(), g.device()
    g.link(a, b, latency=0.1)
    g.task("x", a, 1.0)
    g.task("y", b, 1.0)
    g.edge("x", "y", bytes=5.0)
    s = solve_greedy(g.build())
    doc = json.loads(graph_schedule_json(s))
    assert doc["graph"]["links"]["bandwidth"] == ["inf"]
    assert doc["timeline"]["messages"]["edge"] == []  # latency only: nothing occupies it
    _same(s, graph_schedule_from_dict(doc))


def test_meta_that_is_not_json_is_refused_on_writing() -> None:
    s = solve_greedy(tiny().replace(meta=(("when", object()),)))
    with pytest.raises(ValueError, match=r"graph\.meta\.when: object .* cannot be written"):
        graph_schedule_json(s)
    deep: Any = ()
    for _ in range(40):
        deep = (deep,)
    with pytest.raises(ValueError, match=r"graph\.meta\.x(\[0\])+: nested deeper than 32"):
        graph_schedule_json(solve_greedy(tiny().replace(meta=(("x", deep),))))


def test_bound_and_gap_recorded() -> None:
    s = solve_greedy(tiny())
    assert s.lower_bound is not None
    doc = graph_schedule_to_dict(s)
    assert doc["solver"]["gap"] == pytest.approx((s.objective - s.lower_bound) / s.objective)


# ----- every corruption refused ----------------------------------------------------------------
def _doc() -> dict[str, Any]:
    s = simulate(tiny(), [[0, 2], [1]], method="hand")
    return graph_schedule_to_dict(s)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A corruption: set the field at ``path`` ("graph.tasks.duration[1]") to ``value``."""
    def apply(doc: dict[str, Any]) -> None:
        *parents, last = path.replace("[", ".").replace("]", "").split(".")
        node: Any = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is _DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return apply


_DELETE = object()


def _both(*corruptions: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        for corrupt in corruptions:
            corrupt(doc)
    return apply

CORRUPTIONS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("format", _set("format", "pipeopt.schedule/v3"),
     r"format: expected 'pipeopt\.schedule/v2', got 'pipeopt\.schedule/v3'"),
    ("unknown top field", _set("makespan", 6.0),
     r"^makespan: unknown field; expected one of format, method"),
    ("method type", _set("method", 3), r"^method: expected a string, got 3"),
    ("no graph", _set("graph", _DELETE), r"^graph: missing"),
    ("graph not object", _set("graph", []), r"^graph: expected an object, got \[\]"),
    ("unknown section", _set("graph.nodes", {}), r"^graph\.nodes: unknown field"),
    ("no tasks", _set("graph.tasks", _DELETE), r"^graph\.tasks: missing"),
    ("no duration", _set("graph.tasks.duration", _DELETE), r"^graph\.tasks\.duration: missing"),
    ("column length", _set("graph.tasks.duration", [1.0, 2.0]),
     r"^graph\.tasks\.duration: expected 3 values, got 2"),
    ("string number", _set("graph.tasks.duration[1]", "2.0"),
     r"^graph\.tasks\.duration\[1\]: expected a finite number, got '2\.0'"),
    ("bool number", _set("graph.tasks.mem_start[0]", True),
     r"^graph\.tasks\.mem_start\[0\]: expected a finite number, got true"),
    ("nan", _set("graph.tasks.duration[0]", float("nan")),
     r"^graph\.tasks\.duration\[0\]: expected a finite number, got nan"),
    ("huge integer", _set("graph.tasks.device[0]", graphio.TooLarge("9" * 400)),
     r"^graph\.tasks\.device\[0\]: expected an integer, got an integer of 400 digits"),
    ("negative duration", _set("graph.tasks.duration[2]", -1.0),
     r"^graph\.tasks\.duration\[2\]: must be >= 0, got -1"),
    ("device out of range", _set("graph.tasks.device[1]", 2),
     r"^graph\.tasks\.device\[1\]: must be in 0\.\.1, got 2"),
    ("float index", _set("graph.edges.src[0]", 0.0),
     r"^graph\.edges\.src\[0\]: expected an integer, got 0\.0"),
    ("edge out of range", _set("graph.edges.dst[1]", 3),
     r"^graph\.edges\.dst\[1\]: must be in 0\.\.2, got 3"),
    ("cycle", _set("graph.edges.dst[1]", 0), r"^graph\.edges: the graph has a cycle: y -> x -> y"),
    ("label type", _set("graph.tasks.label[2]", None),
     r"^graph\.tasks\.label\[2\]: expected a string, got null"),
    ("bandwidth zero", _set("graph.links.bandwidth[0]", 0),
     r'^graph\.links\.bandwidth\[0\]: expected a number > 0 or "inf", got 0'),
    ("bandwidth word", _set("graph.links.bandwidth[0]", "Infinity"),
     r'^graph\.links\.bandwidth\[0\]: expected a number > 0 or "inf"'),
    ("link to itself", _set("graph.links.dst[0]", 0),
     r"^graph\.links\[0\]: a link joins two devices, got 0->0"),
    ("missing link", _set("graph.links", {"src": [0], "dst": [1], "latency": [0.5],
                                          "bandwidth": [2.0]}),
     r"^graph\.edges\[1\]: y \(device 1\) -> z \(device 0\) crosses devices without a link"),
    ("negative limit", _set("graph.devices.memory_limit[0]", -1),
     r"^graph\.devices\.memory_limit\[0\]: must be >= 0 or None, got -1"),
    ("limit word", _set("graph.devices.memory_limit[0]", "4 GB"),
     r"^graph\.devices\.memory_limit\[0\]: expected a number >= 0 or null, got '4 GB'"),
    ("meta not object", _set("graph.meta", [1]), r"^graph\.meta: expected an object"),
    ("meta too deep", _set("graph.meta", {"x": json.loads("[" * 40 + "]" * 40)}),
     r"^graph\.meta\.x: nested deeper than 32 levels"),
    ("task groups length", _set("graph.meta", {"task_group": ["a"]}),
     r"^graph\.meta\.task_group: expected 3 values, got 1"),
    ("device kinds type", _set("graph.meta", {"device_kind": ["gpu", 1]}),
     r"^graph\.meta\.device_kind\[1\]: expected a string, got 1"),
    ("no timeline", _set("timeline", _DELETE), r"^timeline: missing"),
    ("start length", _set("timeline.start", [0.0]),
     r"^timeline\.start: expected 3 values, got 1"),
    ("start infinite", _set("timeline.end[0]", float("inf")),
     r"^timeline\.end\[0\]: expected a finite number, got inf"),
    ("message edge range", _set("timeline.messages.edge[0]", 7),
     r"^timeline\.messages\.edge\[0\]: must be in 0\.\.1, got 7"),
    ("message columns", _set("timeline.messages.arrival", []),
     r"^timeline\.messages\.arrival: expected 1 values, got 0"),
    ("unknown message field", _set("timeline.messages.link", [0]),
     r"^timeline\.messages\.link: unknown field"),
    ("message missing", _set("timeline.messages", {"edge": [], "start": [], "end": [],
                                                   "arrival": []}),
     r"^invalid schedule: x -> y: no message carries it across link 0"),
    ("edge broken", _set("timeline", {"start": [0.0, 1.5, 4.5], "end": [1.0, 3.5, 6.0],
                                      "messages": {"edge": [0], "start": [1.0], "end": [1.5],
                                                   "arrival": [2.0]}}),
     r"^invalid schedule: x -> y: y starts at 1\.5 before its input from x is available at 2"),
    ("duration broken", _set("timeline.end[2]", 7.0),
     r"^invalid schedule: z: lasts 2\.5, its duration is 1\.5"),
    ("device overlap", _both(_set("graph.edges", {"src": [0], "dst": [1], "bytes": [1.0]}),
                             _set("timeline.start[2]", 0.5), _set("timeline.end[2]", 2.0)),
     r"^invalid schedule: device 0: z starts at 0\.5 while x runs until 1"),
    ("memory over", _set("graph.devices.memory_limit[0]", 1.0),
     r"^invalid schedule: device 0: memory 2 exceeds the limit 1 at 0"),
    ("makespan", _set("metrics.makespan", 5.0),
     r"^metrics\.makespan: the file says 5\.0, its times give 6"),
    ("objective", _set("metrics.objective", 6.0),
     r"^metrics\.objective: the file says 6\.0, its times give 9"),
    ("peak", _set("metrics.peak_memory", [2.0, 0.0]),
     r"^metrics\.peak_memory: the file says \[2\.0, 0\.0\], its times give \[2\.0, 1\.0\]"),
    ("unknown metric", _set("metrics.bubble_ratio", 0.1), r"^metrics\.bubble_ratio: unknown"),
    ("status word", _set("solver.status", "proven"),
     r"^solver\.status: must be one of optimal, feasible, heuristic, got 'proven'"),
    ("bound above", _set("solver.lower_bound", 10.0),
     r"^solver\.lower_bound: 10 is above the schedule's own objective 9: not a lower bound"),
    ("gap without bound", _set("solver.gap", 0.5),
     r"^solver\.gap: the file says 0\.5, but without a lower bound there is no gap"),
    ("wall time", _set("solver.wall_time", -1),
     r"^solver\.wall_time: expected a finite number >= 0 \(seconds\) or null, got -1"),
]


@pytest.mark.parametrize("name,corrupt,message", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_corruption_refused(name: str, corrupt: Callable[[dict[str, Any]], None],
                            message: str) -> None:
    doc = _doc()
    graph_schedule_from_dict(copy.deepcopy(doc))  # the document itself is valid
    corrupt(doc)
    with pytest.raises(ScheduleError, match=message):
        graph_schedule_from_dict(doc)


def test_optimal_with_a_gap_refused() -> None:
    doc = _doc()
    doc["solver"].update(status="optimal", lower_bound=4.5, gap=0.5)
    with pytest.raises(ScheduleError, match=r"^solver\.status: optimal, but the objective 9 is "
                                            r"50\.00% above the lower bound 4\.5"):
        graph_schedule_from_dict(doc)
    doc["solver"].update(gap=0.25)
    with pytest.raises(ScheduleError, match=r"^solver\.gap: the file says 0\.25, its lower "
                                            r"bound and times give 0\.5"):
        graph_schedule_from_dict(doc)
    doc["solver"].update(status="feasible", gap=0.5)
    assert graph_schedule_from_dict(doc).gap == pytest.approx(0.5)


def test_sizes_capped_before_building(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graphio, "MAX_TASKS", 2)
    with pytest.raises(ScheduleError, match=r"^graph\.tasks\.device: at most 2 values, got 3"):
        graph_schedule_from_dict(_doc())


def test_any_reader_picks_the_type(tmp_path: Path) -> None:
    with pytest.raises(ScheduleError, match=r"format: expected 'pipeopt\.schedule/v1' or "
                                            r"'pipeopt\.schedule/v2', got 'v9'"):
        schedule_from_any_dict({"format": "v9"})
    with pytest.raises(ScheduleError, match="expected a JSON object"):
        schedule_from_any_dict([1])
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ScheduleError, match=r"bad\.json: not valid JSON"):
        load_any(bad)


# ----- v1 is as it was -------------------------------------------------------------------------
def test_chain_schedules_stay_v1(tmp_path: Path) -> None:
    sched = pipeopt.solve(uniform_problem(3, 4, latency=0.1), method="zb-h1")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    dump_schedule(sched, a)
    dump_any(sched, b)
    assert a.read_text() == b.read_text() == schedule_json(sched)
    assert json.loads(a.read_text())["format"] == "pipeopt.schedule/v1"
    back = load_any(b)
    assert isinstance(back, Schedule)
    assert back.ops == load_schedule(a).ops == tuple(sorted(sched.ops, key=lambda o: (
        o.device, o.start, o.end)))


def test_v1_reader_refuses_v2_naming_the_format() -> None:
    with pytest.raises(ScheduleError, match=r"format: expected 'pipeopt\.schedule/v1', got "
                                            r"'pipeopt\.schedule/v2' \(a task-graph schedule: "
                                            r"plot, trace and simulate read it"):
        pipeopt.io.schedule_from_dict(_doc())


# ----- a chain's graph schedule written as v1 ----------------------------------------------------
@pytest.mark.parametrize("method", ["1f1b", "zb-h1"])
def test_a_chain_graph_schedule_is_the_chain_schedule(method: str, tmp_path: Path) -> None:
    """The core simulator's timing of a classic schedule's orders over the training graph,
    written with its problem, is that classic schedule's v1 file (same ops and messages)."""
    from pipeopt.graphio import as_chain_schedule
    from pipeopt.problem import chain_links
    from pipeopt.solvers import run_classic

    prob = uniform_problem(4, 6, 1.0, 1.5, 0.5, latency=0.1)
    lat, bw = chain_links(4, [0.1] * 3, [2.0] * 3)
    prob = prob.replace(latency=lat, bandwidth=bw, message_size=(1.0,) * 3)
    if method == "1f1b":
        prob = prob.replace(split_backward=False)
    chain = run_classic(prob, method)
    graph = training.build(prob)
    timed = simulate(graph, training.task_orders(prob, chain.device_orders()), method)
    back = as_chain_schedule(prob, timed)
    assert sorted(back.ops) == sorted(chain.ops)
    assert sorted(back.messages) == sorted(chain.messages) and chain.messages
    assert back.iteration_time == timed.objective
    path = tmp_path / "c.json"
    dump_any(timed, path, problem=prob)
    assert json.loads(path.read_text())["format"] == "pipeopt.schedule/v1"
    assert sorted(load_any(path).ops) == sorted(chain.ops)  # the v1 reader's checks pass
    # Through a v2 file and back (its graph equal to the builder's, lazy labels and all).
    again = graph_schedule_from_dict(json.loads(graph_schedule_json(timed)))
    assert sorted(as_chain_schedule(prob, again).ops) == sorted(chain.ops)
    with pytest.raises(ValueError, match=r"not workloads\.training\.build"):
        as_chain_schedule(prob.replace(microbatches=5), timed)


def test_a_searched_chain_graph_schedule_keeps_its_status(tmp_path: Path) -> None:
    prob = uniform_problem(2, 3, 1.0, 2.0, 1.0, latency=0.5, memory_limit=3.0)
    s = solve_cpsat(training.build(prob), time_limit=10, workers=1)
    path = tmp_path / "c.json"
    dump_any(s, path, problem=prob)
    back = load_any(path)
    assert isinstance(back, Schedule)
    assert (back.solver.status, back.lower_bound, back.iteration_time) == (
        s.status, s.lower_bound, s.objective)


# ----- random graphs ------------------------------------------------------------------------------
@given(graphs(), st.data())
@settings(max_examples=60, deadline=None)
def test_random_graphs_round_trip_and_a_broken_edge_is_named(graph: TaskGraph,
                                                             data: st.DataObject) -> None:
    s = solve_greedy(graph)
    text = graph_schedule_json(s)
    back = graph_schedule_from_dict(json.loads(text))
    _same(s, back)
    assert graph_schedule_json(back) == text
    late = [e for e in range(graph.num_edges) if s.end[graph.src[e]] > 0]
    if not late:
        return
    # Start an edge's destination before its source ends (keeping its duration): refused,
    # and that edge is among the violations (the message shows the first of them).
    e = data.draw(st.sampled_from(late))
    a, b = graph.src[e], graph.dst[e]
    doc = json.loads(text)
    shift = s.start[b] - (s.end[a] - min(0.25, s.end[a]))
    doc["timeline"]["start"][b] = s.start[b] - shift
    doc["timeline"]["end"][b] = s.end[b] - shift
    doc.pop("metrics")
    with pytest.raises(ScheduleError, match=r"^invalid schedule: ") as info:
        graph_schedule_from_dict(doc)
    name = f"{graph.label[a]} -> {graph.label[b]}: {graph.label[b]} starts at"
    assert any(v.startswith(name) for v in info.value.violations)
