"""``trace --max-events``: huge traces thinned to a budget (issue 18 item 8), by leaving out
flows and transmission slices, then merging the slices closest together on each track; checked
by hand on a tiny graph and by coverage on a large pipeline."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path

import pytest

import pipeopt
from pipeopt.cli import main
from pipeopt.core.graph import GraphBuilder
from pipeopt.core.schedule import GraphSchedule
from pipeopt.io import dump_schedule
from pipeopt.problem import uniform_problem
from pipeopt.trace import TraceTooSmall, thin_trace, to_graph_trace_events, to_trace_events


def _two_devices() -> GraphSchedule:
    """Device 0 runs a 0-1, b 1-2, c 2-3, d 5-6; device 1 runs e 0-1, f 4-5; each task holds
    1 byte while it runs. Full trace: 6 metadata events, 6 slices, 4 counter events per
    device (levels 1, 0, 1, 0 at 0, 3, 5, 6 s and at 0, 1, 4, 5 s) = 20."""
    g = GraphBuilder()
    d0, d1 = g.device(), g.device()
    for name, dev in (("a", d0), ("b", d0), ("c", d0), ("d", d0), ("e", d1), ("f", d1)):
        g.task(name, dev, 1.0, mem_start=1.0, mem_end=-1.0)
    return GraphSchedule(g.build(), (0.0, 1.0, 2.0, 5.0, 0.0, 4.0), (1.0, 2.0, 3.0, 6.0, 1.0,
                                                                      5.0))


def test_hand_computed_thinning() -> None:
    doc = to_graph_trace_events(_two_devices())
    assert len(doc["traceEvents"]) == 20
    same = thin_trace(doc, 20)
    assert same["traceEvents"] == doc["traceEvents"] and not same["otherData"]["thinned"][
        "thinned"]
    # 18: slices and counters must merge. Counted per gap g (us): 2 tracks + slice gaps
    # above g (0, 0, 2e6 on device 0; 3e6 on device 1) + 2 x (2 counters + counter gaps above
    # g: 3e6, 2e6, 1e6 and 1e6, 3e6, 1e6) must be <= 18 - 6 metadata: 20 at g = 0, 14 at 1e6,
    # 9 at 2e6, the smallest that fits.
    thin = thin_trace(doc, 18)
    note = thin["otherData"]["thinned"]
    assert note["merged_gap_us"] == 2e6 and note["events_before"] == 20
    ev = thin["traceEvents"]
    assert len(ev) == 16 <= 18
    slices = sorted((e["tid"], e["ts"], e["dur"], e["name"]) for e in ev if e["ph"] == "X")
    assert slices == [(0, 0.0, 6e6, "4 events"), (1, 0.0, 1e6, "e"), (1, 4e6, 1e6, "f")]
    (merged,) = [e for e in ev if e["name"] == "4 events"]
    assert merged["args"]["by_cat"] == {"a": 1, "b": 1, "c": 1, "d": 1}
    assert (merged["args"]["first"], merged["args"]["last"]) == ("a", "d")
    dev0 = [(e["ts"], e["args"]["bytes"]) for e in ev if e["name"] == "memory device 0"]
    assert dev0 == [(0.0, 1.0), (3e6, 1.0), (6e6, 0.0)]  # the run 3-6 s: its peak, its last
    dev1 = [(e["ts"], e["args"]["bytes"]) for e in ev if e["name"] == "memory device 1"]
    assert dev1 == [(0.0, 1.0), (1e6, 0.0), (4e6, 1.0), (5e6, 0.0)]
    with pytest.raises(TraceTooSmall, match=r"max_events: at least 12 events show this "
                                            r"schedule's 2 tracks and 2 memory counters, got 5"):
        thin_trace(doc, 5)
    with pytest.raises(TraceTooSmall, match="must be an integer >= 1, got 0"):
        thin_trace(doc, 0)


@pytest.mark.parametrize("budget", [8000, 3000, 800])
def test_large_pipeline_thinned_and_covered(budget: int) -> None:
    sched = pipeopt.solve(uniform_problem(8, 128, latency=0.05), method="zb-h1")
    doc = to_trace_events(sched)
    assert len(doc["traceEvents"]) == 8653
    thin = thin_trace(doc, budget)
    ev = thin["traceEvents"]
    assert len(ev) <= budget
    assert not [e for e in ev if e["ph"] in "sf"]  # flows go first
    per_track: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in ev:
        if e["ph"] == "X":
            per_track[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in per_track.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    # Every op lies inside a slice of its device's track.
    for o in sched.ops:
        spans = per_track[(1, o.device)]
        assert any(a <= o.start * 1e6 + 1e-6 and o.end * 1e6 <= b + 1e-3 for a, b in spans)
    # Peaks survive.
    for d, peak in enumerate(sched.peak_memory):
        levels = [e["args"]["bytes"] for e in ev if e["name"] == f"memory device {d}"]
        assert max(levels) == peak
    json.dumps(thin, allow_nan=False)  # a strict JSON document


def test_cli_max_events(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.json"
    dump_schedule(pipeopt.solve(uniform_problem(4, 64), method="1f1b"), path)
    assert main(["trace", str(path), "--max-events", "400"]) == 0
    doc = json.loads((tmp_path / "s.trace.json").read_text())
    assert len(doc["traceEvents"]) <= 400 and doc["otherData"]["thinned"]["thinned"]
    assert main(["trace", str(path), "--max-events", "3"]) == 2
    assert "--max-events: at least 22 events" in capsys.readouterr().err
    assert main(["trace", str(path), "--max-events", "0"]) == 2
    assert "--max-events: must be >= 1, got '0'" in capsys.readouterr().err
