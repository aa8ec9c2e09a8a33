"""Plots, traces and the command line of task-graph schedules with communication tasks
(issue 13): collectives on the rows / tracks of the resources they hold, never on a device."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from pipeopt import plot
from pipeopt.cli import main
from pipeopt.core.schedule import GraphSchedule
from pipeopt.graphio import dump_graph_schedule, graph_schedule_to_dict
from pipeopt.plot import graph_figure_size, plot_graph_schedule, render_graph_schedule
from pipeopt.problem import uniform_problem
from pipeopt.schedules import GENERATORS
from pipeopt.trace import DEVICES_PID, LINKS_PID, NETWORK_PID, thin_trace, to_graph_trace_events
from pipeopt.workloads import dataparallel as dpw
from tests.test_graphio_network import _hand

#: test_graphio_network's 2x2 instance: links 4, 5 are stage 0's ring (0<->2), 6, 7 stage 1's
#: (1<->3), resource 8 the WAN; AG 0 0..0.5, AG 1 0.5..1, RS 1 4.5..6, RS 0 6.5..8.
RESOURCE_ROWS = ["link 0->2", "link 2->0", "link 1->3", "link 3->1", "wan"]


@pytest.fixture(scope="module")
def dp() -> GraphSchedule:
    return _hand("2x2-wan")


def test_plot_rows_of_the_resources(dp: GraphSchedule, tmp_path: Path) -> None:
    fig = render_graph_schedule(dp)
    gantt, memory = fig.axes
    labels = [t.get_text() for t in gantt.get_yticklabels()]
    assert labels == ["dev 0", "dev 1", "dev 2", "dev 3", *RESOURCE_ROWS]
    assert [t.get_text() for t in memory.get_yticklabels()] == ["dev 0", "dev 1", "dev 2",
                                                                "dev 3"]
    assert graph_figure_size(dp) == (graph_figure_size(dp)[0], plot._height(9, 4, True))
    # Each collective is drawn (and labelled) once on every resource it holds: rows 4..8.
    at = {}
    for t in gantt.texts:
        at.setdefault(t.get_text(), []).append(t.get_position())
    assert sorted(at["RS 0"]) == [(7.25, 4), (7.25, 5), (7.25, 8)]
    assert sorted(at["RS 1"]) == [(5.25, 6), (5.25, 7), (5.25, 8)]
    assert all(y < 4 for label, pos in at.items() if label.startswith("r")
               for _, y in pos)  # compute tasks only on device rows
    # No box above device 0 (a communication task's device -1 would be row -1).
    ys = [y for coll in gantt.collections for path in coll.get_paths()
          for _, y in path.vertices]
    assert min(ys) >= -0.5
    assert gantt.get_title(loc="left").startswith("1f1b   12 tasks (4 on the network) on 4 "
                                                  "devices   makespan 8")
    legend = [t.get_text() for t in gantt.get_legend().get_texts()]
    assert "AG (collective)" in legend and "RS (collective)" in legend
    out = tmp_path / "dp.png"
    plot_graph_schedule(dp, out, dpi=40)
    w, h = graph_figure_size(dp)
    assert mpimg.imread(out).shape[:2] == (int(h * 40), int(w * 40))


def test_plot_a_link_with_messages_and_collectives(tmp_path: Path) -> None:
    """Pipeline links that serialize messages keep their rows beside the ring links."""
    from pipeopt.problem import chain_links

    lat, bw = chain_links(2, [0.1], [1e9])
    prob = uniform_problem(2, 2, 1.0, 1.0, 1.0).replace(latency=lat, bandwidth=bw,
                                                       message_size=(1e8,))
    cfg = dpw.DataParallel(replicas=2, grad_bytes=(1e9, 1e9), latency=0.0, bandwidth=1e10)
    g = dpw.build(prob, cfg)
    from pipeopt.core.simulate import simulate

    s = simulate(g, dpw.task_orders(prob, cfg, GENERATORS["1f1b"](prob)))
    assert s.messages
    rows = [t.get_text() for t in render_graph_schedule(s, dpi=40).axes[0].get_yticklabels()]
    assert rows == ["dev 0", "dev 1", "dev 2", "dev 3", "link 0->1", "link 1->0", "link 2->3",
                    "link 3->2", "link 0->2", "link 2->0", "link 1->3", "link 3->1"]


def test_trace_network_tracks(dp: GraphSchedule) -> None:
    g = dp.graph
    ev = to_graph_trace_events(dp)["traceEvents"]
    assert all(e.get("tid", 0) >= 0 for e in ev)
    on_dev = [e for e in ev if e["ph"] == "X" and e["pid"] == DEVICES_PID]
    assert sorted(e["args"]["task"] for e in on_dev) == list(range(8))
    names = {e["tid"]: e["args"]["name"] for e in ev
             if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == NETWORK_PID}
    assert [names[t] for t in sorted(names)] == RESOURCE_ROWS
    assert min(names) == g.devices  # no link lanes here (latency 0): right after the devices
    wan = [e for e in ev if e["ph"] == "X" and e["pid"] == NETWORK_PID
           and names[e["tid"]] == "wan"]
    assert [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in wan] == [
        ("AG 0", 0.0, 5e5), ("AG 1", 5e5, 1e6), ("RS 1", 4.5e6, 6e6), ("RS 0", 6.5e6, 8e6)]
    assert wan[0]["args"]["holds"] == ["link 0->2", "link 2->0", "wan"]
    per_task = [e["args"]["task"] for e in ev if e["ph"] == "X" and e["pid"] == NETWORK_PID]
    assert sorted(per_task) == sorted(i for i in g.comm_tasks for _ in g.holds[i])
    # A flow along each of the 16 edges of a collective: 4 forwards after an all-gather
    # (2 per stage), 4 backwards before a reduce-scatter, each from a device slice to the
    # collective's slice on its first resource (link 0->2 for stage 0, 1->3 for stage 1).
    flows = [e for e in ev if e["ph"] in "sf" and e["name"] == "collective"]
    assert len(flows) == 16 and len({e["id"] for e in flows}) == 8
    ag0 = [e for e in flows if e["pid"] == NETWORK_PID and e["ts"] == 2.5e5]
    assert len(ag0) == 2 and {e["ph"] for e in ag0} == {"s"}
    assert {names[e["tid"]] for e in ag0} == {"link 0->2"}
    rs0 = [e for e in flows if e["pid"] == NETWORK_PID and e["ts"] == 7.25e6]
    assert len(rs0) == 2 and {e["ph"] for e in rs0} == {"f"}
    assert not [e for e in to_graph_trace_events(dp, flows=False)["traceEvents"]
                if e["ph"] in "sf"]
    # Thinning keeps a slice per track, network tracks included.
    thin = thin_trace(to_graph_trace_events(dp), 40)["traceEvents"]
    assert len(thin) <= 40
    assert {e["tid"] for e in thin if e["ph"] == "X" and e["pid"] == NETWORK_PID} == set(names)


def test_trace_tids_unique_with_link_lanes() -> None:
    prob = uniform_problem(2, 2, 1.0, 1.0, 1.0, latency=0.5)
    cfg = dpw.DataParallel(replicas=2, grad_bytes=(1e9, 1e9), latency=0.0, bandwidth=1e10)
    from pipeopt.core.simulate import simulate

    g = dpw.build(prob, cfg)
    s = simulate(g, dpw.task_orders(prob, cfg, GENERATORS["1f1b"](prob)))
    ev = to_graph_trace_events(s)["traceEvents"]
    tracks = [(e["pid"], e["tid"]) for e in ev if e["ph"] == "M" and e["name"] == "thread_name"]
    tids = [t for _, t in tracks]
    assert len(tids) == len(set(tids))  # no tid names two tracks, across processes
    link_tids = [t for p, t in tracks if p == LINKS_PID]
    net_tids = [t for p, t in tracks if p == NETWORK_PID]
    assert link_tids and max(link_tids) < min(net_tids) and len(net_tids) == 4


def test_cli_simulate_plot_trace_of_a_data_parallel_file(
        dp: GraphSchedule, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "dp.json"
    dump_graph_schedule(dp, path)
    assert main(["simulate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "12 tasks" in out and "makespan      8 s" in out
    assert main(["simulate", str(path), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["valid"] and res["makespan"] == 8.0 and res["resimulated_makespan"] == 8.0
    assert main(["plot", str(path), "-o", str(tmp_path / "dp.png"), "--dpi", "30"]) == 0
    assert mpimg.imread(tmp_path / "dp.png").shape[0] > 0
    assert main(["trace", str(path)]) == 0
    trace = json.loads((tmp_path / "dp.trace.json").read_text())
    assert trace["otherData"]["tasks"] == 12
    assert any(e["pid"] == NETWORK_PID and e["ph"] == "X" for e in trace["traceEvents"])
    capsys.readouterr()
    # RS 1 moved onto RS 0's time on the WAN: every command refuses it, naming both.
    doc = graph_schedule_to_dict(dp)
    doc.pop("metrics")
    doc["timeline"]["start"][11], doc["timeline"]["end"][11] = 6.0, 7.5
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    for cmd in (["simulate"], ["plot"], ["trace"]):
        assert main([*cmd, str(bad)]) == 2
        assert "invalid schedule: wan: RS 0 starts at 6.5 while RS 1 is on it until 7.5" in (
            capsys.readouterr().err)
    assert not (tmp_path / "bad.png").exists() and not (tmp_path / "bad.trace.json").exists()
