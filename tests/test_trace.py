"""Trace-event export: one complete event per op at the right time, tracks named, CLI."""

from __future__ import annotations

import json
import math

import pytest

from pipeopt.cli import main
from pipeopt.io import dump_schedule
from pipeopt.problem import uniform_problem
from pipeopt.schedule import Schedule
from pipeopt.solvers import run_classic
from pipeopt.trace import DEVICES_PID, LINKS_PID, US_PER_S, to_trace_events
from tests.strategies import SAMPLE_SCHEDULES

SCHEDULES = SAMPLE_SCHEDULES


@pytest.fixture(params=list(SCHEDULES))
def schedule(request: pytest.FixtureRequest) -> Schedule:
    return SCHEDULES[request.param]()


def test_one_complete_event_per_op(schedule: Schedule) -> None:
    doc = to_trace_events(schedule)
    json.dumps(doc)  # plain JSON, no infinities or tuples of objects
    ops = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == DEVICES_PID]
    assert len(ops) == len(schedule.ops) == schedule.problem.num_ops
    by_op = {(e["args"]["kind"], e["args"]["stage"], e["args"]["microbatch"]): e for e in ops}
    assert len(by_op) == len(ops)
    for o in schedule.ops:
        e = by_op[(o.kind, o.stage, o.microbatch)]
        assert e["tid"] == o.device
        assert e["name"] == f"{o.kind} s{o.stage} mb{o.microbatch}"
        assert math.isclose(e["ts"], o.start * 1e6, abs_tol=1e-6)
        assert math.isclose(e["dur"], (o.end - o.start) * 1e6, abs_tol=1e-6)
        assert math.isclose(e["ts"] + e["dur"], o.end * US_PER_S, rel_tol=1e-12, abs_tol=1e-6)


def test_tracks_named(schedule: Schedule) -> None:
    events = to_trace_events(schedule)["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta
               if e["name"] == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    p = schedule.problem.devices
    dev_tracks = {tid: n for (pid, tid), n in threads.items() if pid == DEVICES_PID}
    assert dev_tracks == {d: f"device {d}" for d in range(p)}
    links = {(m.src_device, m.dst_device) for m in schedule.messages}
    link_tracks = sorted(n for (pid, _), n in threads.items() if pid == LINKS_PID)
    assert link_tracks == sorted(f"link {a}->{b}" for a, b in links)
    assert procs[DEVICES_PID] == "devices"
    assert (LINKS_PID in procs) == bool(links)
    # Every complete event sits on a named track.
    for e in events:
        if e["ph"] == "X":
            assert (e["pid"], e["tid"]) in threads


def test_messages_and_memory_counters() -> None:
    sched = SAMPLE_SCHEDULES["contended"]()
    assert sched.messages
    events = to_trace_events(sched)["traceEvents"]
    msgs = [e for e in events if e["ph"] == "X" and e["pid"] == LINKS_PID]
    assert len(msgs) == len(sched.messages)
    starts = sorted(e["ts"] for e in msgs)
    assert starts == pytest.approx(sorted(m.start * 1e6 for m in sched.messages))
    counters = [e for e in events if e["ph"] == "C"]
    for d, peak in enumerate(sched.peak_memory):
        vals = [e["args"]["bytes"] for e in counters if e["name"] == f"memory device {d}"]
        assert vals and max(vals) == pytest.approx(peak)
        assert vals[-1] == pytest.approx(sched.problem.static_memory[d])


def test_no_link_tracks_without_messages() -> None:
    sched = run_classic(uniform_problem(4, 8, latency=0.3), "1f1b")
    assert not sched.messages
    events = to_trace_events(sched)["traceEvents"]
    assert all(e["pid"] == DEVICES_PID for e in events)


def test_cli_trace(tmp_path) -> None:
    sched = SAMPLE_SCHEDULES["contended"]()
    src = tmp_path / "s.json"
    dump_schedule(sched, src)
    out = tmp_path / "out" / "trace.json"
    assert main(["trace", str(src), "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc == json.loads(json.dumps(to_trace_events(sched)))
    # Default output name next to the schedule.
    assert main(["trace", str(src)]) == 0
    assert (tmp_path / "s.trace.json").exists()
    assert not list(tmp_path.glob(".*.tmp")) and not list(out.parent.glob(".*.tmp"))


def test_cli_trace_bad_file(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "pipeopt.schedule/v1", "method": "x"}')
    out = tmp_path / "t.json"
    assert main(["trace", str(bad), "-o", str(out)]) == 2
    assert "problem" in capsys.readouterr().err
    assert not out.exists()
    assert main(["trace", str(tmp_path / "missing.json"), "-o", str(out)]) == 2
