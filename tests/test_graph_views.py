"""Task-graph schedules (schedule JSON v2) on the command line, in plots and in traces: the rows,
tracks, events and counters each graph calls for, checked against the schedule's own times."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from pipeopt.cli import main
from pipeopt.core.cpsat import solve_cpsat
from pipeopt.core.graph import GraphBuilder
from pipeopt.core.greedy import solve_greedy
from pipeopt.core.schedule import GraphSchedule, task_groups
from pipeopt.core.simulate import simulate
from pipeopt.graphio import dump_graph_schedule, graph_schedule_to_dict
from pipeopt.plot import (
    KIND_CMAPS,
    _shade,
    graph_figure_size,
    group_colors,
    plot_graph_schedule,
    render_graph_schedule,
)
from pipeopt.trace import DEVICES_PID, LINKS_PID, graph_messages, to_graph_trace_events
from tests.test_graphio import edge_server, serialized_chain, tiny


@pytest.fixture(scope="module")
def server() -> GraphSchedule:
    return solve_cpsat(edge_server(), time_limit=10, workers=1)


def test_task_groups_from_labels_or_meta() -> None:
    g = GraphBuilder()
    d = g.device()
    for label in ("0F3", "12B0", "allreduce s2 mb5", "t7", "42"):
        g.task(label, d, 1.0)
    graph = g.build()
    assert task_groups(graph) == ("F", "B", "allreduce s mb", "t", "task")
    assert task_groups(edge_server())[:3] == ("edge", "server", "edge")


def test_group_colors() -> None:
    colors = group_colors(["x", "F", "y", "x", "B"])
    assert list(colors) == ["x", "F", "y", "B"]
    assert colors["F"] == _shade("F", 1, 3) and colors["B"] == _shade("B", 1, 3)
    assert len(set(colors.values())) == 4
    many = group_colors([f"g{i}" for i in range(30)])
    assert len(set(many.values())) == 30  # tab10 then tab20b: 30 distinct colours
    assert set(KIND_CMAPS) == {"F", "B", "W"}


def test_plot_rows_and_size(server: GraphSchedule, tmp_path: Path) -> None:
    out = tmp_path / "g.png"
    plot_graph_schedule(server, out, dpi=50)
    w, h = graph_figure_size(server)
    assert mpimg.imread(out).shape[:2] == (int(h * 50), int(w * 50))
    fig = render_graph_schedule(server, dpi=50)
    gantt, memory = fig.axes
    labels = [t.get_text() for t in gantt.get_yticklabels()]
    # Three devices (kinds from meta), then the one link whose messages take time (0 -> 2 at
    # 2 bytes/s; link 1 -> 2 has an infinite bandwidth: latency only, no row).
    assert labels == ["dev 0 edge", "dev 1 edge", "dev 2 server", "link 0->2"]
    assert [t.get_text() for t in memory.get_yticklabels()] == ["dev 0", "dev 1", "dev 2"]
    legend = [t.get_text() for t in gantt.get_legend().get_texts()]
    assert legend[:2] == ["edge", "server"] and "message on its link" in legend
    assert any(x.startswith("tail") for x in legend)
    assert "objective" in gantt.get_title(loc="left")
    assert len(render_graph_schedule(server, show_memory=False, dpi=50).axes) == 1
    # At 100 dpi, 10 inches wide: 83 px per second. The longest label (5 characters) at 5
    # points needs 24 px: the 1-second boxes get theirs, the 0.25-second acks (21 px) none.
    big = render_graph_schedule(server).axes[0]
    shown = {t.get_text() for t in big.texts}
    assert {"a0", "sa0", "merge"} <= shown and not shown & {"acka0", "acka1", "ackb0"}
    assert shown <= set(server.graph.label)


def test_plot_dense_rows_paint_images(tmp_path: Path) -> None:
    from pipeopt.problem import uniform_problem
    from pipeopt.workloads import training

    s = solve_greedy(training.build(uniform_problem(4, 512)))
    fig = render_graph_schedule(s, dpi=40)
    assert len(fig.axes[0].images) == 4  # one averaged image per device row, no polygons


def test_trace_events_follow_the_schedule(server: GraphSchedule) -> None:
    g = server.graph
    doc = to_graph_trace_events(server)
    ev = doc["traceEvents"]
    tasks = [e for e in ev if e["ph"] == "X" and e["pid"] == DEVICES_PID]
    assert sorted(e["args"]["task"] for e in tasks) == list(range(g.num_tasks))
    for e in tasks:
        i = e["args"]["task"]
        assert e["name"] == g.label[i] and e["tid"] == g.device[i]
        assert e["ts"] == pytest.approx(server.start[i] * 1e6)
        assert e["ts"] + e["dur"] <= server.end[i] * 1e6
        assert e["cat"] == task_groups(g)[i]
    names = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"device 0 (edge)", "device 2 (server)"} <= names
    assert "link 0->2 (latency 500 ms, 2 B/s)" in names
    assert "link 1->2 (latency 1 s)" in names
    # One message per cross-device edge: 3 to the server, 3 acknowledgements back.
    msgs = [e for e in ev if e["ph"] == "X" and e["pid"] == LINKS_PID
            and e["cat"] == "message"]
    cross = [e for e in range(g.num_edges) if g.edge_link[e] >= 0]
    assert len(cross) == 6 and len(msgs) == 6 == len(graph_messages(server))
    for e in msgs:
        k = e["args"]["edge"]
        assert e["name"] == f"{g.label[g.src[k]]} -> {g.label[g.dst[k]]}"
    starts = [e for e in ev if e["ph"] == "s"]
    assert len(starts) == 6 and len([e for e in ev if e["ph"] == "f"]) == 6
    counters = [e for e in ev if e["ph"] == "C" and e["name"] == "memory device 2"]
    assert max(e["args"]["bytes"] for e in counters) == server.peak_memory[2]
    assert doc["otherData"]["objective_s"] == server.objective


def test_trace_hand_computed_message() -> None:
    s = simulate(tiny(), [[0, 2], [1]])
    ev = to_graph_trace_events(s, flows=False)["traceEvents"]
    (msg,) = [e for e in ev if e.get("cat") == "message" and e["name"] == "x -> y"]
    # Sent at 1 s, 0.5 s on the link at 2 bytes/s, arrives at 2 s.
    assert (msg["ts"], msg["dur"]) == (1e6, 1e6)
    assert msg["args"]["transmission_us"] == 5e5 and msg["args"]["latency_us"] == 5e5
    (tx,) = [e for e in ev if e.get("cat") == "transmission"]
    assert (tx["ts"], tx["dur"]) == (1e6, 5e5)
    assert not [e for e in ev if e["ph"] in "sf"]


def _write(s: GraphSchedule, path: Path) -> Path:
    dump_graph_schedule(s, path)
    return path


def test_cli_reads_v2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(solve_greedy(serialized_chain()), tmp_path / "g.json")
    assert main(["simulate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "36 tasks" in out and "re-simulated" in out
    assert main(["simulate", str(path), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["valid"] and res["resimulated_makespan"] == pytest.approx(res["makespan"])
    assert main(["plot", str(path), "-o", str(tmp_path / "g.png"), "--dpi", "30"]) == 0
    assert (tmp_path / "g.png").stat().st_size > 0
    assert main(["trace", str(path)]) == 0
    trace = json.loads((tmp_path / "g.trace.json").read_text())
    assert trace["otherData"]["tasks"] == 36


def test_cli_refuses_a_broken_v2_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = graph_schedule_to_dict(simulate(tiny(), [[0, 2], [1]]))
    doc["timeline"]["start"][1] = 1.5
    doc["timeline"]["end"][1] = 3.5
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    for cmd in (["simulate"], ["plot"], ["trace"]):
        assert main([*cmd, str(path)]) == 2
        err = capsys.readouterr().err
        assert "invalid schedule: x -> y: y starts at 1.5 before its input from x" in err
    assert not (tmp_path / "bad.png").exists()
