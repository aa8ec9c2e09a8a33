"""A periodic (asynchronous) schedule as Chrome / Perfetto trace events.

The pattern is unrolled over the window :func:`pipeopt.plot_periodic.steady_window` draws (the
warm-up, then a few steady-state periods). Process 1 has one track per device (one per replica
of a replicated stage) with a complete event (``ph: X``) per task named like ``F s3 mb5``, one
track ``steady state`` holding one event per period after the warm-up (the first named ``one
period``), and per device three counters of memory by kind: ``static``, ``weight versions``
(the extra copies, constant in steady state) and ``activations`` (over time). Times are
microseconds (the trace format's unit), as in :mod:`pipeopt.trace`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pipeopt.io import write_atomic
from pipeopt.plot_periodic import row_names, schedule_length, steady_window
from pipeopt.workloads.periodic import PeriodicSchedule, unroll

#: Microseconds per second (the trace format counts microseconds).
US_PER_S = 1e6
_PID = 1


def trace_events(schedule: PeriodicSchedule) -> list[dict[str, Any]]:
    """The trace events of ``schedule`` (module docstring)."""
    g = unroll(schedule, schedule_length(schedule))
    graph = g.graph
    end, h0, _ = steady_window(schedule)
    names = row_names(schedule)
    steady_tid = graph.devices
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": _PID, "args": {"name": "devices"}}]
    for d, name in enumerate(names):
        events.append({"name": "thread_name", "ph": "M", "pid": _PID, "tid": d,
                       "args": {"name": name}})
    events.append({"name": "thread_name", "ph": "M", "pid": _PID, "tid": steady_tid,
                   "args": {"name": "steady state"}})
    T = schedule.period
    q = 0
    while h0 + (q + 1) * T <= end + 1e-12 * end:
        events.append({"name": "one period" if q == 0 else "period", "ph": "X", "pid": _PID,
                       "tid": steady_tid, "ts": (h0 + q * T) * US_PER_S, "dur": T * US_PER_S,
                       "args": {"period_s": T}})
        q += 1
    level: list[list[tuple[float, float]]] = [[] for _ in range(graph.devices)]
    for i in range(graph.num_tasks):
        s, e = g.start[i], g.end[i]
        if s >= end:
            continue
        label = graph.label[i]
        kind = label.lstrip("0123456789")[0]
        stage, mb = label.split(kind, 1)
        events.append({"name": f"{kind} s{stage} mb{mb}", "ph": "X", "pid": _PID,
                       "tid": graph.device[i], "ts": s * US_PER_S,
                       "dur": (e - s) * US_PER_S})
        d = graph.device[i]
        if graph.mem_start[i]:
            level[d].append((s, graph.mem_start[i]))
        if graph.mem_end[i]:
            level[d].append((e, graph.mem_end[i]))
    p = schedule.problem
    stage_of = [k for k, r in enumerate(schedule.replicas) for _ in range(r)]
    for d, changes in enumerate(level):
        dev = p.stage_device[stage_of[d]]
        base = {"static": p.static_memory[dev], "weight versions": schedule.weight_memory[dev]}
        cur = 0.0
        events.append({"name": f"memory {names[d]}", "ph": "C", "pid": _PID, "ts": 0.0,
                       "args": {**base, "activations": 0.0}})
        for t, delta in sorted(changes):
            if t > end:
                break
            cur += delta
            events.append({"name": f"memory {names[d]}", "ph": "C", "pid": _PID,
                           "ts": t * US_PER_S, "args": {**base, "activations": cur}})
    return events


def write_periodic_trace(schedule: PeriodicSchedule, path: str | os.PathLike[str]) -> None:
    """Write the trace of ``schedule`` to ``path`` atomically (a JSON object with
    ``traceEvents``)."""
    write_atomic(path, json.dumps({"traceEvents": trace_events(schedule),
                                   "displayTimeUnit": "ms"}))
