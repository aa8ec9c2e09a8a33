"""Schedules as Chrome / Perfetto trace-event JSON (open in ui.perfetto.dev or chrome://tracing).

Timestamps: the trace format counts microseconds, so every time is the schedule's seconds times
1e6 (:data:`US_PER_S`). An event's ``ts + dur`` never passes its end time, so events that touch
in the schedule (an op starting when the previous one ends) do not overlap by a rounding error.

**Devices.** Process 1 "devices" has one track (thread) per device holding a complete event
(``ph: X``) per op, named like ``F s3 mb5`` (kind, stage, micro-batch). Ops are coloured with
Chrome's reserved colour names to match the Gantt plot of :mod:`pipeopt.plot`: F blue, B orange,
W green (:data:`KIND_COLORS`; Perfetto ignores ``cname`` and colours slices by name). Memory in use
is a counter track per device.

**Links.** Process 2 "links" shows every message between devices: each hop between adjacent
stages held by different devices, i.e. the activation after each F to the next stage and the
gradient after each B to the previous one (:func:`link_messages`). ``Schedule.messages`` only
records the messages that occupy their link for a positive time, so on latency-only links (the
SPEC default: infinite bandwidth) the messages are rebuilt from the op times and
:meth:`~pipeopt.problem.Problem.transfer`. A message is one X event named like ``F s3 mb2 -> s4``
(its producer op, then the receiving stage) from when it leaves (the producer's end, or its
transmission start when the link serializes messages) to when it arrives (transmission end +
latency). Its args give ``transmission_us`` and ``latency_us`` (and ``queued_us``, the wait for
a busy link, when positive); when both parts are positive, a nested child slice
``transmission`` (darker) covers the transmission and the rest of the parent is the latency
(the child has the parent's ``ts`` and a shorter ``dur`` and comes right after it in the file,
which both viewers read as nesting).

Track names say what the link is: ``link 3->4 (latency 160 ms)``, ``link 3->4 (cross-datacenter
0->1, latency 5.01 ms, 12.5 GB/s)``. Datacenters come from ``problem.meta['devices']`` (model /
cluster configs record each device's ``datacenter``); latency and bandwidth from the problem's
matrices.

**Overlapping messages.** X events on one track must nest, but messages on one link overlap
whenever the latency exceeds the gap between sends (a latency-only link pipelines many
messages). So a link gets as many tracks as it ever has messages in flight at once: ``link
3->4 (...)``, ``link 3->4 #2 (...)``, ... Each message goes to the lowest-numbered track of its
link that is free when it leaves (greedy interval partitioning, which uses the fewest tracks);
within a track, events touch at most. Async events (``ph: b/e``) were not used: both viewers
place them on tracks keyed by event name / category / id rather than by link, and the JSON
format cannot name those tracks; X events on named threads render the same way in
chrome://tracing and ui.perfetto.dev.

**Dependencies.** A flow arrow joins each message's producer op to its consumer op: a flow start
(``ph: s``) and finish (``ph: f``, ``bp: e``) with the same ``cat``, ``name`` and ``id``. Both
sit at the middle of their op, so each binds to its op without ambiguity (a flow at an op's end
would also touch the next op, which often starts at that instant): chrome://tracing draws the
arrow between the two midpoints, Perfetto from op to op.

**Size.** Each message costs one X event (about 270 bytes of JSON) and two flow events (about
100 bytes each). Measured on 64 devices, 1024 micro-batches, 160 ms links and 40 / 50 / 34 ms
stages (129k messages, 400 link tracks), :func:`write_trace` writes, for 1F1B (131k ops),
104 MB in 3.3 s, of which 35 MB are the messages and 25 MB the flows (ops and memory counters
alone: 44 MB in 1.3 s); for ZB-H1 (197k ops) 122 MB in 4.8 s (63 MB in 2.0 s without links).
Flows are kept for every message, with no cap; ``flows=False`` leaves them out (1F1B: 79 MB).
ui.perfetto.dev opens such files faster than chrome://tracing. ``max_events`` (``pipeopt trace
--max-events N``) caps the event count: :func:`thin_trace` leaves out flows, then transmission
slices, then merges each track's closest slices (and the memory changes between them, peaks
kept), reporting what it did in ``otherData["thinned"]``.

**Task-graph schedules** (:class:`~pipeopt.core.schedule.GraphSchedule`, schedule JSON v2):
:func:`to_graph_trace_events` lays them out the same way, through the same helpers: a track
per device (named with its ``device_kind`` when the graph's meta has one) with an X event per
task named by its label, ``cat`` its group (:func:`~pipeopt.core.schedule.task_groups`), memory
counters, a track per directed link and lane with a message per cross-device edge (the timed
ones as recorded, latency-only ones from the source's end, :func:`graph_messages`), and a flow
arrow along each of them. Communication tasks (collectives, device -1) are in process 3
"network": a track per resource they hold (``link 0->4``, ``wan``), an X event per task on
each, and flow arrows (``collective``) along their edges. :func:`write_trace` takes either
kind of schedule. A serving plan's schedule (issue 15: the graph's meta records the plan)
also gets, per task, the requests it prefills (``[request, cached, tokens]``) and decodes in
its args, the memory counters as the KV cache per stage (weights left out), process 4
"requests" with a track per request (from its arrival to its first token, then to its last),
and the serving figures (throughput, TTFT p50 / p99, TPOT) in ``otherData``.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from pipeopt.core.schedule import GraphSchedule, MessageTime, task_groups
from pipeopt.io import write_atomic
from pipeopt.problem import Problem
from pipeopt.schedule import Message, Schedule, TimedOp
from pipeopt.workloads.inference import Plan, metrics, serving_plan

#: Trace timestamps are microseconds: trace ts = schedule seconds * US_PER_S.
US_PER_S = 1e6
DEVICES_PID = 1
LINKS_PID = 2
#: Process of the network resources that communication tasks (collectives) hold.
NETWORK_PID = 3
#: Process of the per-request tracks of a serving plan's trace.
REQUESTS_PID = 4
#: ``cname`` of a communication task: one of Chrome's reserved colour names (catapult's colour
#: scheme) not used for ops or messages, so collectives stand apart from both.
COLLECTIVE_COLOR = "rail_animation"
KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}
#: Chrome's reserved colour names (catapult's colour scheme; chrome://tracing accepts only these
#: as ``cname``) chosen like the plot's colour maps: F blue, B orange, W green.
KIND_COLORS = {"F": "thread_state_runnable", "B": "thread_state_iowait", "W": "good"}
#: Colours of a message (mauve) and of its transmission part (magenta, like the plot's links).
MESSAGE_COLOR = "thread_state_uninterruptible"
TRANSMISSION_COLOR = "detailed_memory_dump"
#: ``cat`` of the message events, of their transmission slices, and of the flow events.
MESSAGE_CAT = "message"
TRANSMISSION_CAT = "transmission"
FLOW_CAT = "dependency"


def _us(seconds: float) -> float:
    return seconds * US_PER_S


def _span(start: float, end: float) -> tuple[float, float]:
    """(ts, dur) of the interval ``start..end`` (seconds) with ``ts + dur`` never past the
    trace time of ``end``: an event ending when the next one on its track starts must not
    overlap it by a rounding error (the viewers would nest the next event inside it)."""
    ts, stop = _us(start), _us(end)
    dur = max(stop - ts, 0.0)
    while ts + dur > stop and dur > 0:
        dur = math.nextafter(dur, 0.0)
    return ts, dur


def _meta(name: str, pid: int, tid: int | None, value: Any) -> dict[str, Any]:
    ev: dict[str, Any] = {"name": name, "ph": "M", "pid": pid, "args": {}}
    if tid is not None:
        ev["tid"] = tid
    ev["args"]["name" if name.endswith("_name") else "sort_index"] = value
    return ev


# ----- messages ------------------------------------------------------------------------------
def link_messages(schedule: Schedule) -> list[Message]:
    """Every message between two devices in ``schedule``, as :class:`~pipeopt.schedule.Message`.

    The messages the schedule records (those that occupy a link) are taken as they are. Every
    other hop between adjacent stages on different devices (F of stage k to stage k+1, B of
    stage k to stage k-1) is rebuilt from its producer's end: on a link without transmission
    time it leaves at once and arrives after the latency; a hop that needs transmission time but
    is not recorded (a hand-written schedule file) is sent first-ready-first-served on its link,
    the validator's rule. Hops whose producer op is missing are left out.
    """
    pr = schedule.problem
    sd = pr.stage_device
    m = pr.microbatches
    out = list(schedule.messages)
    seen = {(mm.kind, mm.src_stage, mm.dst_stage, mm.microbatch) for mm in schedule.messages}
    ends = {(o.kind, o.stage, o.microbatch): o.end for o in schedule.ops}
    pending: list[tuple[float, int, int, str, int, float, float]] = []
    for k in range(pr.stages - 1):
        for kind, src, dst in (("F", k, k + 1), ("B", k + 1, k)):
            a, b = sd[src], sd[dst]
            if a == b:
                continue
            for j in range(m):
                if (kind, src, dst, j) in seen:
                    continue
                tx, lat = pr.transfer(src, dst, j)
                t = ends.get((kind, src, j))
                if t is None:
                    continue
                if tx > 0:
                    pending.append((t, src, j, kind, dst, tx, lat))
                else:
                    out.append(Message(a, b, src, dst, j, kind, t, t, t + lat))
    pending.sort()
    free: dict[tuple[int, int], float] = {}
    for t, src, j, kind, dst, tx, lat in pending:
        a, b = sd[src], sd[dst]
        t0 = max(t, free.get((a, b), 0.0))
        free[(a, b)] = t0 + tx
        out.append(Message(a, b, src, dst, j, kind, t0, t0 + tx, t0 + tx + lat))
    return out


def _datacenters(problem: Problem) -> dict[int, Any]:
    """Device -> datacenter, from ``problem.meta['devices']`` when a config recorded it."""
    devs = dict(problem.meta).get("devices")
    out: dict[int, Any] = {}
    if not isinstance(devs, list):
        return out
    for i, entry in enumerate(devs):
        if isinstance(entry, dict) and entry.get("datacenter") is not None:
            d = entry.get("device", i)
            if isinstance(d, int):
                out[d] = entry["datacenter"]
    return out


def _fmt_time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def _fmt_rate(bytes_per_s: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.3g} {unit}"
    return f"{bytes_per_s:.3g} B/s"


def link_name(problem: Problem, src: int, dst: int, lane: int = 0) -> str:
    """Track name of the directed link ``src -> dst`` (``lane`` > 0: its extra tracks for
    overlapping messages, named ``#2``, ``#3``, ...), e.g. ``link 3->4 (latency 160 ms)``."""
    return _link_title(src, dst, problem.latency[src][dst], problem.bandwidth[src][dst],
                       _datacenters(problem), lane)


def _link_title(src: int, dst: int, latency: float, bandwidth: float, dcs: dict[int, Any],
                lane: int = 0) -> str:
    """:func:`link_name` from the link's latency (s), bandwidth (bytes/s) and the devices'
    datacenters (``dcs``, possibly empty)."""
    parts = []
    if src in dcs and dst in dcs and dcs[src] != dcs[dst]:
        parts.append(f"cross-datacenter {dcs[src]}->{dcs[dst]}")
    if latency > 0:
        parts.append(f"latency {_fmt_time(latency)}")
    if not math.isinf(bandwidth):
        parts.append(_fmt_rate(bandwidth))
    name = f"link {src}->{dst}" + (f" #{lane + 1}" if lane else "")
    return name + (f" ({', '.join(parts)})" if parts else "")


def _assign_lanes(spans: list[tuple[float, float]]) -> tuple[list[int], int]:
    """Lane of each (start, end) span so that spans in one lane touch at most: each span takes
    the lowest lane free at its start. Returns the lanes and their number."""
    order = sorted(range(len(spans)), key=lambda i: spans[i])
    lanes = [0] * len(spans)
    busy: list[tuple[float, int]] = []  # (end, lane)
    free: list[int] = []
    n = 0
    for i in order:
        start, end = spans[i]
        while busy and busy[0][0] <= start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            lane = heapq.heappop(free)
        else:
            lane, n = n, n + 1
        lanes[i] = lane
        heapq.heappush(busy, (end, lane))
    return lanes, n


# ----- the document --------------------------------------------------------------------------
def to_trace_events(schedule: Schedule, *, flows: bool = True) -> dict[str, Any]:
    """The trace-event document of ``schedule``: a dict with ``traceEvents`` (complete events
    ``ph: X`` for ops and messages, flow events ``ph: s``/``f`` from producer to consumer op
    unless ``flows`` is false, counters ``ph: C`` for memory, metadata ``ph: M`` naming
    processes and tracks), ``displayTimeUnit`` and ``otherData`` (headline metrics). See the
    module docstring."""
    pr = schedule.problem
    events = _device_tracks([f"device {d}" for d in range(pr.devices)])
    chunk = {}
    for stages in pr.device_stages:
        for c, k in enumerate(stages):
            chunk[k] = c
    for o in sorted(schedule.ops, key=lambda o: (o.device, o.start, o.end)):
        ts, dur = _span(o.start, o.end)
        events.append({
            "name": f"{o.kind} s{o.stage} mb{o.microbatch}",
            "cat": KIND_NAMES.get(o.kind, o.kind),
            "ph": "X", "pid": DEVICES_PID, "tid": o.device,
            "ts": ts, "dur": dur,
            "cname": KIND_COLORS.get(o.kind, "generic_work"),
            "args": {"kind": o.kind, "stage": o.stage, "microbatch": o.microbatch,
                     "chunk": chunk[o.stage], "device": o.device,
                     "start_s": o.start, "end_s": o.end},
        })
    events.extend(_link_events(schedule, flows))
    events.extend(_memory_counters(schedule.memory_timeline))
    return _document(events, {"method": schedule.method, "makespan_s": schedule.makespan,
                              "bubble_ratio": schedule.bubble_ratio, "devices": pr.devices,
                              "microbatches": pr.microbatches})


def _device_tracks(names: Sequence[str]) -> list[dict[str, Any]]:
    """Metadata of process 1 "devices" and of its tracks, one per device, named ``names``."""
    events = [_meta("process_name", DEVICES_PID, None, "devices"),
              _meta("process_sort_index", DEVICES_PID, None, 0)]
    for d, name in enumerate(names):
        events.append(_meta("thread_name", DEVICES_PID, d, name))
        events.append(_meta("thread_sort_index", DEVICES_PID, d, d))
    return events


def _document(events: list[dict[str, Any]], other: dict[str, Any]) -> dict[str, Any]:
    """The trace document: ``events`` and the headline facts ``other`` (with the time unit)."""
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {**other,
                          "time_unit": "ts and dur are microseconds: schedule seconds x 1e6"}}


def _memory_counters(timelines: Sequence[Sequence[tuple[float, float]]],
                     name: str = "memory") -> list[dict[str, Any]]:
    """A counter event (``ph: C``) per change of each device's memory (``timelines``: per
    device, (time s, bytes) steps), named ``{name} device {d}``; several changes at one
    instant show the last level."""
    events: list[dict[str, Any]] = []
    for d, steps in enumerate(timelines):
        at: dict[float, float] = {}
        for t, b in steps:
            at[t] = b
        last: float | None = None
        for t, b in at.items():
            if b == last:
                continue
            events.append({"name": f"{name} device {d}", "ph": "C", "pid": DEVICES_PID,
                           "ts": _us(t), "args": {"bytes": b}})
            last = b
    return events


class _Sent(NamedTuple):
    """A message as the link tracks show it: on ``link`` (sender, receiver device) from
    ``start`` to ``end`` (its transmission), usable at ``arrival`` (seconds); ``producer`` and
    ``consumer``: (device, start, end) of the tasks it joins, when known, for the flow arrow
    named ``flow``."""

    link: tuple[int, int]
    name: str
    args: dict[str, Any]
    start: float
    end: float
    arrival: float
    producer: tuple[int, float, float] | None
    consumer: tuple[int, float, float] | None
    flow: str


def _link_events(schedule: Schedule, with_flows: bool) -> list[dict[str, Any]]:
    """Track metadata, message events and (``with_flows``) flow events of every message
    between devices."""
    pr = schedule.problem
    ops = {(o.kind, o.stage, o.microbatch): o for o in schedule.ops}
    sent = []
    for mm in link_messages(schedule):
        producer = ops.get((mm.kind, mm.src_stage, mm.microbatch))
        consumer = ops.get((mm.kind, mm.dst_stage, mm.microbatch))
        ready = producer.end if producer is not None else mm.start
        args: dict[str, Any] = {
            "kind": mm.kind, "src_stage": mm.src_stage, "dst_stage": mm.dst_stage,
            "microbatch": mm.microbatch,
            "transmission_us": _us(mm.end - mm.start), "latency_us": _us(mm.arrival - mm.end)}
        if mm.start > ready:
            args["queued_us"] = _us(mm.start - ready)
        sent.append(_Sent(
            (mm.src_device, mm.dst_device),
            f"{mm.kind} s{mm.src_stage} mb{mm.microbatch} -> s{mm.dst_stage}", args,
            mm.start, mm.end, mm.arrival, _task(producer), _task(consumer),
            "activation" if mm.kind == "F" else "gradient"))
    return _message_events(sent, pr.devices, lambda a, b, lane: link_name(pr, a, b, lane),
                           with_flows)


def _task(op: TimedOp | None) -> tuple[int, float, float] | None:
    return None if op is None else (op.device, op.start, op.end)


def _message_events(msgs: Sequence[_Sent], first_tid: int,
                    track_name: Callable[[int, int, int], str], with_flows: bool
                    ) -> list[dict[str, Any]]:
    """Process 2 "links": a track per directed link and lane (``track_name(src, dst,
    lane)``; tids from ``first_tid``), an X event per message that takes time (with its
    transmission nested in it), and flow arrows from producer to consumer."""
    if not msgs:
        return []
    # Zero-length messages get no slice (and a link of only those no track), but their flows.
    per_link: dict[tuple[int, int], list[int]] = defaultdict(list)
    spans = []
    for i, mm in enumerate(msgs):
        if mm.arrival > mm.start:  # a message that takes no time has nothing to show
            per_link[mm.link].append(i)
        spans.append(_span(mm.start, mm.arrival))
    events: list[dict[str, Any]] = [
        _meta("process_name", LINKS_PID, None, "links"),
        _meta("process_sort_index", LINKS_PID, None, 1),
    ] if per_link else []
    # Link tids start after the device tids: no tid names two tracks, even across processes.
    tid_of = [0] * len(msgs)
    tid = first_tid
    for link in sorted(per_link):
        idx = per_link[link]
        lanes, n = _assign_lanes([(spans[i][0], spans[i][0] + spans[i][1]) for i in idx])
        for lane in range(n):
            events.append(_meta("thread_name", LINKS_PID, tid + lane, track_name(*link, lane)))
            events.append(_meta("thread_sort_index", LINKS_PID, tid + lane, tid + lane))
        for i, lane in zip(idx, lanes, strict=True):
            tid_of[i] = tid + lane
        tid += n
    flow_id = 0
    flows: list[dict[str, Any]] = []
    for i in sorted(range(len(msgs)), key=lambda i: (tid_of[i], spans[i][0], -spans[i][1])):
        mm = msgs[i]
        ts, dur = spans[i]
        if mm.arrival > mm.start:
            events.append({"name": mm.name, "cat": MESSAGE_CAT, "ph": "X", "pid": LINKS_PID,
                           "tid": tid_of[i], "ts": ts, "dur": dur, "cname": MESSAGE_COLOR,
                           "args": mm.args})
        if mm.end > mm.start and mm.arrival > mm.end:
            # Same ts and shorter, written after its parent: nested in both viewers.
            events.append({"name": "transmission", "cat": TRANSMISSION_CAT, "ph": "X",
                           "pid": LINKS_PID, "tid": tid_of[i], "ts": ts,
                           "dur": min(_span(mm.start, mm.end)[1], dur),
                           "cname": TRANSMISSION_COLOR})
        if not with_flows or mm.producer is None or mm.consumer is None:
            continue
        flow_id += 1
        flows.append({"name": mm.flow, "cat": FLOW_CAT, "ph": "s", "id": flow_id,
                      "pid": DEVICES_PID, "tid": mm.producer[0], "ts": _middle(mm.producer)})
        flows.append({"name": mm.flow, "cat": FLOW_CAT, "ph": "f", "bp": "e", "id": flow_id,
                      "pid": DEVICES_PID, "tid": mm.consumer[0], "ts": _middle(mm.consumer)})
    return events + flows


def _middle(task: tuple[int, float, float]) -> float:
    """Trace time of the middle of ``task`` (device, start, end), to the nanosecond when that
    stays inside it (shorter JSON: a flow end needs no more precision)."""
    a, b = _us(task[1]), _us(task[2])
    mid = (a + b) / 2
    short = round(mid, 3)
    return short if a < short < b else mid


# ----- task-graph schedules (schedule JSON v2) ------------------------------------------------
def graph_messages(schedule: GraphSchedule) -> list[MessageTime]:
    """Every message between two devices of a task-graph schedule: the timed ones it records
    (those that occupy a link), and for each other cross-device edge one that leaves when its
    source ends and arrives the link's latency later."""
    g = schedule.graph
    out = list(schedule.messages)
    seen = {mm.edge for mm in out}
    end = schedule.end
    for e, (k, lat) in enumerate(zip(g.edge_link, g.edge_latency, strict=True)):
        if k >= 0 and e not in seen:
            t = end[g.src[e]]
            out.append(MessageTime(e, t, t, t + lat))
    return out


def to_graph_trace_events(schedule: GraphSchedule, *, flows: bool = True) -> dict[str, Any]:
    """The trace-event document of a task-graph schedule, laid out as :func:`to_trace_events`
    lays out a chain's: a track per device with an X event per task (named by its label,
    ``cat`` its group: :func:`~pipeopt.core.schedule.task_groups`), memory counters, a track
    per directed link (and lane) with the messages, and flow arrows along cross-device edges
    unless ``flows`` is false."""
    g = schedule.graph
    groups = task_groups(g)
    kinds = dict(g.meta).get("device_kind")
    named = isinstance(kinds, tuple) and len(kinds) == g.devices
    events = _device_tracks([f"device {d}" + (f" ({kinds[d]})" if named else "")  # type: ignore[index]
                             for d in range(g.devices)])
    start, end = schedule.start, schedule.end
    on_device = [i for i in range(g.num_tasks) if g.device[i] >= 0]
    plan = serving_plan(g)
    for i in sorted(on_device, key=lambda i: (g.device[i], start[i], end[i])):
        ts, dur = _span(start[i], end[i])
        more: dict[str, Any] = {}
        if plan is not None:  # the iteration's requests (task b * stages + k: iteration b)
            it = plan.iterations[i // g.devices]
            more = {"prefill": [list(c) for c in it.chunks],
                    "decode": [d.request for d in it.decodes]}
        events.append({
            "name": g.label[i], "cat": groups[i], "ph": "X", "pid": DEVICES_PID,
            "tid": g.device[i], "ts": ts, "dur": dur,
            "cname": KIND_COLORS.get(groups[i], "generic_work"),
            "args": {"task": i, "group": groups[i], "device": g.device[i],
                     "start_s": start[i], "end_s": end[i], **more},
        })
    sent = []
    for mm in graph_messages(schedule):
        a, b = g.src[mm.edge], g.dst[mm.edge]
        args: dict[str, Any] = {"edge": mm.edge, "bytes": g.bytes[mm.edge],
                                "transmission_us": _us(mm.end - mm.start),
                                "latency_us": _us(mm.arrival - mm.end)}
        if mm.start > end[a]:
            args["queued_us"] = _us(mm.start - end[a])
        sent.append(_Sent((g.device[a], g.device[b]), f"{g.label[a]} -> {g.label[b]}", args,
                          mm.start, mm.end, mm.arrival, (g.device[a], start[a], end[a]),
                          (g.device[b], start[b], end[b]), groups[a]))
    link = g.link_index

    def track_name(a: int, b: int, lane: int) -> str:
        k = link[(a, b)]
        return _link_title(a, b, g.latency[k], g.bandwidth[k], {}, lane)

    link_events = _message_events(sent, g.devices, track_name, flows)
    events.extend(link_events)
    lanes = sum(1 for e in link_events if e["ph"] == "M" and e["name"] == "thread_name")
    flow_ids = sum(1 for e in link_events if e["ph"] == "s")  # message flows: ids 1..this
    events.extend(_network_events(schedule, groups, g.devices + lanes,
                                  flow_ids + 1 if flows else None))
    other = {"method": schedule.method, "makespan_s": schedule.makespan,
             "objective_s": schedule.objective, "devices": g.devices, "tasks": g.num_tasks}
    plan = serving_plan(g)
    if plan is None:
        events.extend(_memory_counters(schedule.memory_timeline))
        return _document(events, other)
    w0 = g.static_memory
    events.extend(_memory_counters([[(t, b - w0[d]) for t, b in steps] for d, steps
                                    in enumerate(schedule.memory_timeline)], "KV cache"))
    events.extend(_request_events(schedule, plan))
    m = metrics(plan, schedule)
    other.update({k: v for k, v in m.as_dict().items() if k != "makespan_s"},
                 requests=len(plan.requests), policy=plan.policy)
    return _document(events, other)


def _request_events(schedule: GraphSchedule, plan: Plan) -> list[dict[str, Any]]:
    """The requests of a serving plan's schedule: each iteration task's args get its prefill
    chunks and decoding requests (in place, in ``events`` built before), and process
    :data:`REQUESTS_PID` a track per request: ``waiting + prefill`` from its arrival to its
    first token, ``decode`` from then to its last token."""
    s = schedule.graph.devices
    end = schedule.end
    first = [math.nan] * len(plan.requests)
    last = [math.nan] * len(plan.requests)
    for b, it in enumerate(plan.iterations):
        t = end[b * s + s - 1]
        for r in it.first_tokens:
            first[r] = t
        for r in it.finished:
            last[r] = t
    events = [_meta("process_name", REQUESTS_PID, None, "requests"),
              _meta("process_sort_index", REQUESTS_PID, None, 3)]
    for r, req in enumerate(plan.requests):
        events.append(_meta("thread_name", REQUESTS_PID, r,
                            f"r{r} ({req.prompt} in, {req.output} out)"))
        events.append(_meta("thread_sort_index", REQUESTS_PID, r, r))
        for name, a, b in (("waiting + prefill", req.arrival, first[r]),
                           ("decode", first[r], last[r])):
            if b > a:
                ts, dur = _span(a, b)
                events.append({"name": name, "cat": "request", "ph": "X",
                               "pid": REQUESTS_PID, "tid": r, "ts": ts, "dur": dur,
                               "args": {"request": r, "start_s": a, "end_s": b}})
    return events


def _network_events(schedule: GraphSchedule, groups: Sequence[str], first_tid: int,
                    first_flow_id: int | None) -> list[dict[str, Any]]:
    """Process 3 "network": a track per network resource some communication task holds
    (a directed link, or a named network such as a WAN; tids from ``first_tid``, after the
    device and link tracks), with an X event per task on every resource it holds. A resource
    carries one thing at a time (the validator checks it), so one track per resource nests.
    Unless ``first_flow_id`` is None, a flow arrow (ids from it) along each edge into or out
    of a communication task (named ``collective``), from or to its slice on the first
    resource it holds."""
    g = schedule.graph
    per: dict[int, list[int]] = defaultdict(list)
    for i in g.comm_tasks:
        for r in g.holds[i]:
            per[r].append(i)
    if not per:
        return []
    events = [_meta("process_name", NETWORK_PID, None, "network"),
              _meta("process_sort_index", NETWORK_PID, None, 2)]
    start, end = schedule.start, schedule.end
    for tid, r in enumerate(sorted(per), start=first_tid):
        events.append(_meta("thread_name", NETWORK_PID, tid, g.resource_name(r)))
        events.append(_meta("thread_sort_index", NETWORK_PID, tid, tid))
        for i in sorted(per[r], key=lambda i: (start[i], end[i])):
            ts, dur = _span(start[i], end[i])
            events.append({
                "name": g.label[i], "cat": groups[i], "ph": "X", "pid": NETWORK_PID,
                "tid": tid, "ts": ts, "dur": dur, "cname": COLLECTIVE_COLOR,
                "args": {"task": i, "group": groups[i], "resource": r,
                         "holds": [g.resource_name(k) for k in g.holds[i]],
                         "start_s": start[i], "end_s": end[i]}})
    if first_flow_id is not None:
        tid_of = {r: t for t, r in enumerate(sorted(per), start=first_tid)}
        events += _collective_flows(schedule, tid_of, first_flow_id)
    return events


def _collective_flows(schedule: GraphSchedule, tid_of: dict[int, int], first_id: int
                      ) -> list[dict[str, Any]]:
    """Flow start / finish pairs along every edge that joins a communication task, each end
    at the middle of its task's slice: on its device track, or on the network track of the
    first resource a communication task holds; flow ids from ``first_id``."""
    g = schedule.graph
    start, end = schedule.start, schedule.end

    def where(i: int) -> tuple[int, int]:
        d = g.device[i]
        return (DEVICES_PID, d) if d >= 0 else (NETWORK_PID, tid_of[g.holds[i][0]])

    out: list[dict[str, Any]] = []
    fid = first_id - 1
    for a, b in zip(g.src, g.dst, strict=True):
        if g.device[a] >= 0 and g.device[b] >= 0:
            continue
        fid += 1
        for ph, i in (("s", a), ("f", b)):
            pid, tid = where(i)
            ev = {"name": "collective", "cat": FLOW_CAT, "ph": ph, "id": fid, "pid": pid,
                  "tid": tid, "ts": _middle((tid, start[i], end[i]))}
            if ph == "f":
                ev["bp"] = "e"
            out.append(ev)
    return out


# ----- thinning huge traces ------------------------------------------------------------------
class TraceTooSmall(ValueError):
    """``max_events`` below the fewest events a schedule's tracks can be shown with."""


def thin_trace(doc: dict[str, Any], max_events: int) -> dict[str, Any]:
    """``doc`` (a trace document of this module) with at most ``max_events`` events.

    In this order, until it fits: the flow arrows are left out, then the transmission slices
    nested in messages, then on every track the slices separated by at most ``gap`` (trace
    microseconds) are merged into one (named ``N events``, ``args`` counting them by
    ``cat``), and on every memory counter the changes within ``gap`` of each other are kept
    as two: the run's highest level at its start and its last level at its end, so peaks
    stay visible. ``gap`` is the smallest that fits (bisection over the gaps themselves;
    0 merges the slices that touch): idle time longer than it still shows. Track metadata
    is always kept. ``otherData["thinned"]`` says what was done. Raises
    :class:`TraceTooSmall` when even one slice per track and two counter events per device
    do not fit.
    """
    if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 1:
        raise TraceTooSmall(f"max_events: must be an integer >= 1, got {max_events!r}")
    events = doc["traceEvents"]
    note: dict[str, Any] = {"max_events": max_events, "events_before": len(events)}
    out = dict(doc, otherData={**doc.get("otherData", {}), "thinned": note})
    if len(events) <= max_events:
        note["thinned"] = False
        return dict(out, traceEvents=events)
    note["thinned"] = True
    kept = [e for e in events if e["ph"] not in "sf"]
    note["flows_left_out"] = True
    if len(kept) <= max_events:
        return dict(out, traceEvents=kept)
    kept = [e for e in kept if e.get("cat") != TRANSMISSION_CAT]
    note["transmissions_left_out"] = True
    if len(kept) <= max_events:
        return dict(out, traceEvents=kept)
    meta = [e for e in kept if e["ph"] == "M"]
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    counters: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in kept:
        if e["ph"] == "X":
            tracks[(e["pid"], e["tid"])].append(e)
        elif e["ph"] == "C":
            counters[e["name"]].append(e)
    for lst in [*tracks.values(), *counters.values()]:
        lst.sort(key=lambda e: e["ts"])
    import numpy as np  # here: a trace without a cap needs none

    slice_gaps = np.array([g for lst in tracks.values() for g in _slice_gaps(lst)])
    counter_gaps = np.array([b["ts"] - a["ts"] for lst in counters.values()
                             for a, b in itertools.pairwise(lst)])
    room = max_events - len(meta)

    def count(gap: float) -> int:
        """Events after merging at ``gap`` (us): one slice per track and per gap above it,
        at most two counter events per run of changes."""
        return int(len(tracks) + (slice_gaps > gap).sum()
                   + 2 * (len(counters) + (counter_gaps > gap).sum()))

    if count(math.inf) > room:
        least = len(meta) + len(tracks) + 2 * len(counters)
        raise TraceTooSmall(f"max_events: at least {least} events show this schedule's "
                            f"{len(tracks)} tracks and {len(counters)} memory counters, got "
                            f"{max_events}")
    candidates = np.unique(np.concatenate([[0.0], slice_gaps, counter_gaps]))
    lo, hi = 0, len(candidates) - 1  # the smallest candidate gap that fits (the last does)
    while lo < hi:
        mid = (lo + hi) // 2
        if count(float(candidates[mid])) <= room:
            hi = mid
        else:
            lo = mid + 1
    gap = float(candidates[lo])
    note["merged_gap_us"] = gap
    merged = [m for lst in tracks.values() for m in _merge_slices(lst, gap)]
    merged += [c for lst in counters.values() for c in _merge_counters(lst, gap)]
    return dict(out, traceEvents=meta + merged)


def _slice_gaps(lst: Sequence[dict[str, Any]]) -> list[float]:
    """Idle time (us) before each slice of a track but the first (0 when they overlap)."""
    out, end = [], -math.inf
    for e in lst:
        if end > -math.inf:
            out.append(max(0.0, e["ts"] - end))
        end = max(end, e["ts"] + e["dur"])
    return out


def _merge_slices(lst: Sequence[dict[str, Any]], gap: float) -> list[dict[str, Any]]:
    """The track's slices (sorted by ``ts``), those separated by at most ``gap`` us merged."""
    runs: list[list[dict[str, Any]]] = []
    end = -math.inf
    for e in lst:
        if not runs or e["ts"] - end > gap:
            runs.append([])
        runs[-1].append(e)
        end = max(end, e["ts"] + e["dur"])
    return [run[0] if len(run) == 1 else _merged(run) for run in runs]


def _merged(run: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One slice covering ``run``, named ``N events``, counting them by ``cat``."""
    cats: dict[str, int] = defaultdict(int)
    for e in run:
        cats[e.get("cat", "")] += 1
    first = run[0]
    return {"name": f"{len(run)} events", "cat": "merged", "ph": "X", "pid": first["pid"],
            "tid": first["tid"], "ts": first["ts"],
            "dur": max(e["ts"] + e["dur"] for e in run) - first["ts"], "cname": "generic_work",
            "args": {"events": len(run), "by_cat": dict(cats), "first": first["name"],
                     "last": run[-1]["name"]}}


def _merge_counters(lst: Sequence[dict[str, Any]], gap: float) -> list[dict[str, Any]]:
    """The counter's changes, those within ``gap`` us of each other kept as the run's highest
    level at its start and its last level at its end."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(lst):
        j = i
        while j + 1 < len(lst) and lst[j + 1]["ts"] - lst[j]["ts"] <= gap:
            j += 1
        run = lst[i:j + 1]
        if len(run) <= 2:
            out += run
        else:
            top = max(e["args"]["bytes"] for e in run)
            out += [dict(run[0], args={"bytes": top}), run[-1]]
        i = j + 1
    return out


def write_trace(schedule: Schedule | GraphSchedule, path: str | os.PathLike[str], *,
                flows: bool = True, max_events: int | None = None) -> None:
    """Write :func:`to_trace_events` of a chain ``schedule`` (:func:`to_graph_trace_events` of
    a task-graph one) as JSON to ``path`` atomically; ``max_events``: at most that many
    events (:func:`thin_trace`)."""
    if isinstance(schedule, GraphSchedule):
        doc = to_graph_trace_events(schedule, flows=flows)
    else:
        doc = to_trace_events(schedule, flows=flows)
    if max_events is not None:
        doc = thin_trace(doc, max_events)
    write_atomic(path, json.dumps(doc, separators=(",", ":")) + "\n")
