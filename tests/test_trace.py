"""Trace-event export: one complete event per op and per message at the right time, link
tracks that nest, flows from producer to consumer, tracks named, CLI."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from pipeopt import load_config, solve
from pipeopt.cli import main
from pipeopt.io import dump_schedule
from pipeopt.problem import chain_links, uniform_problem
from pipeopt.schedule import Schedule
from pipeopt.trace import DEVICES_PID, LINKS_PID, US_PER_S, to_trace_events
from tests.strategies import SAMPLE_SCHEDULES

SCHEDULES = SAMPLE_SCHEDULES
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


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


def _expected_links(problem) -> set[tuple[int, int]]:
    """Directed device links that carry a message taking some time, from the stage placement
    and the link delays alone."""
    sd = problem.stage_device
    out = set()
    for k in range(problem.stages - 1):
        for a, b in ((k, k + 1), (k + 1, k)):
            if sd[a] != sd[b] and problem.delay(a, b) > 0:
                out.add((sd[a], sd[b]))
    return out


def _threads(events: list[dict]) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in events
            if e["ph"] == "M" and e["name"] == "thread_name"}


_LINK_NAME = re.compile(r"link (\d+)->(\d+)( #\d+)?( \(.+\))?$")


def test_tracks_named(schedule: Schedule) -> None:
    events = to_trace_events(schedule)["traceEvents"]
    threads = _threads(events)
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}
    p = schedule.problem.devices
    dev_tracks = {tid: n for (pid, tid), n in threads.items() if pid == DEVICES_PID}
    assert dev_tracks == {d: f"device {d}" for d in range(p)}
    links = _expected_links(schedule.problem)
    named = set()
    for (pid, tid), n in threads.items():
        if pid == LINKS_PID:
            match = _LINK_NAME.match(n)
            assert match, n
            named.add((int(match[1]), int(match[2])))
            assert tid >= p  # link tids never reuse a device's tid
    assert named == links
    assert procs[DEVICES_PID] == "devices"
    assert (LINKS_PID in procs) == bool(links)
    # Every complete event sits on a named track.
    for e in events:
        if e["ph"] == "X":
            assert (e["pid"], e["tid"]) in threads


def _message_events(events: list[dict]) -> dict[tuple[str, int, int, int], dict]:
    """Message events keyed by (kind, src_stage, dst_stage, microbatch); keys must be unique."""
    msgs = [e for e in events if e["ph"] == "X" and e.get("cat") == "message"]
    assert all(e["pid"] == LINKS_PID for e in msgs)
    out = {(e["args"]["kind"], e["args"]["src_stage"], e["args"]["dst_stage"],
            e["args"]["microbatch"]): e for e in msgs}
    assert len(out) == len(msgs)
    return out


def test_messages_and_memory_counters() -> None:
    sched = SAMPLE_SCHEDULES["contended"]()
    assert sched.messages
    events = to_trace_events(sched)["traceEvents"]
    msgs = _message_events(events)
    assert len(msgs) == len(sched.messages)
    ends = {(o.kind, o.stage, o.microbatch): o.end for o in sched.ops}
    for mm in sched.messages:
        e = msgs[(mm.kind, mm.src_stage, mm.dst_stage, mm.microbatch)]
        # A serialized message is drawn from its transmission start to its arrival.
        assert e["ts"] == pytest.approx(mm.start * 1e6)
        assert e["ts"] + e["dur"] == pytest.approx(mm.arrival * 1e6)
        assert e["args"]["transmission_us"] == pytest.approx((mm.end - mm.start) * 1e6)
        assert e["args"]["latency_us"] == pytest.approx((mm.arrival - mm.end) * 1e6)
        queued = mm.start - ends[(mm.kind, mm.src_stage, mm.microbatch)]
        assert e["args"].get("queued_us", 0.0) == pytest.approx(max(queued, 0.0) * 1e6,
                                                               abs=1e-6)
    # Each has a nested slice for its transmission, on its own track.
    tx = [e for e in events if e["ph"] == "X" and e.get("cat") == "transmission"]
    assert len(tx) == len(sched.messages)
    starts = {(e["tid"], e["ts"]): e for e in msgs.values()}
    for t in tx:
        parent = starts[(t["tid"], t["ts"])]
        assert 0 < t["dur"] < parent["dur"]
        assert t["dur"] == pytest.approx(parent["args"]["transmission_us"])
    counters = [e for e in events if e["ph"] == "C"]
    for d, peak in enumerate(sched.peak_memory):
        vals = [e["args"]["bytes"] for e in counters if e["name"] == f"memory device {d}"]
        assert vals and max(vals) == pytest.approx(peak)
        assert vals[-1] == pytest.approx(sched.problem.static_memory[d])


def test_unrecorded_serialized_messages_rebuilt_fifo() -> None:
    """A schedule file without its messages: the trace sends them first-ready-first-served,
    as the simulator did."""
    sched = SAMPLE_SCHEDULES["contended"]()
    bare = Schedule(sched.problem, sched.method, sched.ops)
    msgs = _message_events(to_trace_events(bare)["traceEvents"])
    assert len(msgs) == len(sched.messages)
    for mm in sched.messages:
        e = msgs[(mm.kind, mm.src_stage, mm.dst_stage, mm.microbatch)]
        assert e["ts"] == pytest.approx(mm.start * 1e6)
        assert e["ts"] + e["dur"] == pytest.approx(mm.arrival * 1e6)


# ----- latency-only links: the cross-datacenter example ----------------------------------------
@pytest.fixture(scope="module", params=["1f1b", "zb-h1"])
def cross_dc(request: pytest.FixtureRequest) -> Schedule:
    problem = load_config(EXAMPLES / "cross_dc.yaml").problem
    assert (problem.devices, problem.microbatches) == (8, 16)
    assert problem.forward[0] == pytest.approx(0.040)
    assert problem.latency[3][4] == pytest.approx(0.160) and problem.latency[2][3] == 0
    sched = solve(problem, request.param)
    assert not sched.messages  # infinite bandwidth: nothing occupies a link
    return sched


def _hops(problem):
    """(kind, src_stage, dst_stage) of every hop between adjacent stages on two devices."""
    sd = problem.stage_device
    for k in range(problem.stages - 1):
        for kind, src, dst in (("F", k, k + 1), ("B", k + 1, k)):
            if sd[src] != sd[dst]:
                yield kind, src, dst


def test_every_message_has_an_event(cross_dc: Schedule) -> None:
    pr = cross_dc.problem
    sd = pr.stage_device
    events = to_trace_events(cross_dc)["traceEvents"]
    threads = _threads(events)
    msgs = _message_events(events)
    times = {(o.kind, o.stage, o.microbatch): o for o in cross_dc.ops}
    expected = 0
    for kind, src, dst in _hops(pr):
        for j in range(pr.microbatches):
            if pr.delay(src, dst) == 0:  # no delay, nothing to show: no slice (flows stay)
                assert (kind, src, dst, j) not in msgs
                continue
            expected += 1
            e = msgs[(kind, src, dst, j)]
            leave = times[(kind, src, j)].end
            arrive = leave + pr.delay(src, dst)
            assert e["ts"] == pytest.approx(leave * 1e6, rel=1e-12, abs=1e-6)
            assert e["ts"] + e["dur"] == pytest.approx(arrive * 1e6, rel=1e-12, abs=1e-6)
            assert times[(kind, dst, j)].start >= arrive - 1e-9  # the consumer waited for it
            assert e["name"] == f"{kind} s{src} mb{j} -> s{dst}"
            assert e["args"]["latency_us"] == pytest.approx(pr.delay(src, dst) * 1e6)
            assert e["args"]["transmission_us"] == 0
            assert threads[(e["pid"], e["tid"])].startswith(f"link {sd[src]}->{sd[dst]}")
    assert expected == 2 * 16 == len(msgs)  # the 3<->4 link both ways, every micro-batch
    # The cross-datacenter delay is visible: 160 ms on the 3<->4 link.
    for (_, src, dst, _), e in msgs.items():
        assert {sd[src], sd[dst]} == {3, 4} and e["dur"] == pytest.approx(160_000.0)
    names = set(threads.values())
    assert {"link 3->4 (latency 160 ms)", "link 4->3 (latency 160 ms)"} <= names
    assert "link 0->1" not in names  # a link that delays nothing gets no track


def _assert_nested(events: list[dict]) -> None:
    """Complete events on one track are disjoint or nested, never partially overlapping."""
    tracks: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in events:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for track, spans in tracks.items():
        stack: list[float] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1], f"{track}: partial overlap at {start}"
            stack.append(end)


def test_link_tracks_never_partially_overlap(cross_dc: Schedule) -> None:
    events = to_trace_events(cross_dc)["traceEvents"]
    _assert_nested(events)
    # 160 ms of latency against 40 ms forwards: several messages in flight on the WAN link,
    # so it needs extra tracks.
    threads = _threads(events)
    wan = [n for (pid, _), n in sorted(threads.items()) if pid == LINKS_PID
           and n.startswith("link 3->4")]  # in tid order
    assert len(wan) > 1
    assert wan == ["link 3->4 (latency 160 ms)"] + [f"link 3->4 #{i} (latency 160 ms)"
                                                    for i in range(2, len(wan) + 1)]


def test_sample_schedules_nest(schedule: Schedule) -> None:
    _assert_nested(to_trace_events(schedule)["traceEvents"])


def test_flows_pair_producer_and_consumer(cross_dc: Schedule) -> None:
    pr = cross_dc.problem
    events = to_trace_events(cross_dc)["traceEvents"]
    starts = [e for e in events if e["ph"] == "s"]
    ends = [e for e in events if e["ph"] == "f"]
    by_start = {e["id"]: e for e in starts}
    by_end = {e["id"]: e for e in ends}
    assert len(by_start) == len(starts) and len(by_end) == len(ends)  # ids unique
    assert set(by_start) == set(by_end)
    ops = [e for e in events if e["ph"] == "X" and e["pid"] == DEVICES_PID]

    def op_at(e: dict) -> tuple[str, int, int]:
        assert e["pid"] == DEVICES_PID
        hit = [o for o in ops if o["tid"] == e["tid"] and o["ts"] < e["ts"] < o["ts"] + o["dur"]]
        assert len(hit) == 1
        a = hit[0]["args"]
        return a["kind"], a["stage"], a["microbatch"]

    pairs = set()
    for fid, s in by_start.items():
        f = by_end[fid]
        assert (s["cat"], s["name"]) == (f["cat"], f["name"])
        assert f.get("bp") == "e"
        pairs.add((op_at(s), op_at(f)))
    expected = {((kind, src, j), (kind, dst, j)) for kind, src, dst in _hops(pr)
                for j in range(pr.microbatches)}
    assert pairs == expected
    # Without flows, the rest of the document is the same.
    bare = to_trace_events(cross_dc, flows=False)["traceEvents"]
    assert bare == [e for e in events if e["ph"] not in ("s", "f")]


def test_kind_colors_differ() -> None:
    sched = solve(uniform_problem(4, 8), "zb-h1")
    events = to_trace_events(sched)["traceEvents"]
    cname: dict[str, set[str]] = {}
    for e in events:
        if e["ph"] == "X" and e["pid"] == DEVICES_PID:
            cname.setdefault(e["args"]["kind"], set()).add(e["cname"])
    assert set(cname) == {"F", "B", "W"}
    assert all(len(c) == 1 for c in cname.values())
    f, b, w = (next(iter(cname[k])) for k in "FBW")
    assert len({f, b, w}) == 3
    # Chrome's reserved colours, close to the plot's Blues / Oranges / Greens.
    assert f in {"thread_state_runnable", "rail_response", "light_memory_dump",
                 "vsync_highlight_color", "background_memory_dump"}
    assert b in {"thread_state_iowait", "rail_idle", "bad"}
    assert w in {"good", "thread_state_running", "rail_load", "cq_build_passed"}


def test_link_names_say_cross_datacenter() -> None:
    devices = [{"device": d, "gpu": f"dc{d // 2}/n0/g{d % 2}", "datacenter": d // 2}
               for d in range(4)]
    lat, bw = chain_links(4, [1e-6, 0.005, 1e-6], [50e9, 12.5e9, 50e9])
    problem = uniform_problem(4, 4).replace(latency=lat, bandwidth=bw,
                                            message_size=(1e6,) * 3,
                                            meta=(("devices", devices),))
    events = to_trace_events(solve(problem, "1f1b"))["traceEvents"]
    names = {n for (pid, _), n in _threads(events).items() if pid == LINKS_PID}
    assert "link 1->2 (cross-datacenter 0->1, latency 5 ms, 12.5 GB/s)" in names
    assert "link 2->1 (cross-datacenter 1->0, latency 5 ms, 12.5 GB/s)" in names
    assert "link 0->1 (latency 1 us, 50 GB/s)" in names
    assert sum("cross-datacenter" in n for n in names) == 2


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
    # --no-flows: the same trace less its flow events.
    assert main(["trace", str(src), "-o", str(out), "--no-flows"]) == 0
    lean = json.loads(out.read_text())["traceEvents"]
    full = doc["traceEvents"]
    assert not [e for e in lean if e["ph"] in ("s", "f")]
    assert [e for e in full if e["ph"] in ("s", "f")]
    assert lean == [e for e in full if e["ph"] not in ("s", "f")]


def test_cli_trace_bad_file(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "pipeopt.schedule/v1", "method": "x"}')
    out = tmp_path / "t.json"
    assert main(["trace", str(bad), "-o", str(out)]) == 2
    assert "problem" in capsys.readouterr().err
    assert not out.exists()
    assert main(["trace", str(tmp_path / "missing.json"), "-o", str(out)]) == 2
