"""Schedules as Chrome / Perfetto trace-event JSON (open in ui.perfetto.dev or chrome://tracing).

Layout: process 1 "devices" has one track (thread) per device holding its ops; process 2
"links" has one track per directed device link that carries messages (``link 0->1``), holding
the time each message occupies the link. Memory in use is a counter track per device.
Timestamps: the trace format counts microseconds, so every time is the schedule's seconds
times 1e6 (:data:`US_PER_S`).
"""

from __future__ import annotations

import json
import os
from typing import Any

from pipeopt.io import write_atomic
from pipeopt.schedule import Schedule

#: Trace timestamps are microseconds: trace ts = schedule seconds * US_PER_S.
US_PER_S = 1e6
DEVICES_PID = 1
LINKS_PID = 2
KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}
# Chrome's reserved colour names, so kinds keep their colours in chrome://tracing.
_KIND_COLORS = {"F": "thread_state_running", "B": "thread_state_iowait", "W": "good"}


def _us(seconds: float) -> float:
    return seconds * US_PER_S


def _meta(name: str, pid: int, tid: int | None, value: Any) -> dict[str, Any]:
    ev: dict[str, Any] = {"name": name, "ph": "M", "pid": pid, "args": {}}
    if tid is not None:
        ev["tid"] = tid
    ev["args"]["name" if name.endswith("_name") else "sort_index"] = value
    return ev


def link_tracks(schedule: Schedule) -> dict[tuple[int, int], int]:
    """Track id (tid in the links process) of each directed link that carries a message."""
    links = sorted({(mm.src_device, mm.dst_device) for mm in schedule.messages})
    return {link: i for i, link in enumerate(links)}


def to_trace_events(schedule: Schedule) -> dict[str, Any]:
    """The trace-event document of ``schedule``: a dict with ``traceEvents`` (complete events
    ``ph: X`` for ops and link transfers, counters ``ph: C`` for memory, metadata ``ph: M``
    naming processes and tracks), ``displayTimeUnit`` and ``otherData`` (headline metrics)."""
    pr = schedule.problem
    events: list[dict[str, Any]] = [
        _meta("process_name", DEVICES_PID, None, "devices"),
        _meta("process_sort_index", DEVICES_PID, None, 0),
    ]
    for d in range(pr.devices):
        events.append(_meta("thread_name", DEVICES_PID, d, f"device {d}"))
        events.append(_meta("thread_sort_index", DEVICES_PID, d, d))
    chunk = {}
    for stages in pr.device_stages:
        for c, k in enumerate(stages):
            chunk[k] = c
    for o in sorted(schedule.ops, key=lambda o: (o.device, o.start, o.end)):
        events.append({
            "name": f"{o.kind} s{o.stage} mb{o.microbatch}",
            "cat": KIND_NAMES.get(o.kind, o.kind),
            "ph": "X", "pid": DEVICES_PID, "tid": o.device,
            "ts": _us(o.start), "dur": _us(o.end - o.start),
            "cname": _KIND_COLORS.get(o.kind, "generic_work"),
            "args": {"kind": o.kind, "stage": o.stage, "microbatch": o.microbatch,
                     "chunk": chunk[o.stage], "device": o.device,
                     "start_s": o.start, "end_s": o.end},
        })
    tracks = link_tracks(schedule)
    if tracks:
        events.append(_meta("process_name", LINKS_PID, None, "links"))
        events.append(_meta("process_sort_index", LINKS_PID, None, 1))
        for (a, b), tid in tracks.items():
            events.append(_meta("thread_name", LINKS_PID, tid, f"link {a}->{b}"))
            events.append(_meta("thread_sort_index", LINKS_PID, tid, tid))
    for mm in sorted(schedule.messages, key=lambda mm: (mm.start, mm.src_device)):
        what = "activation" if mm.kind == "F" else "gradient"
        events.append({
            "name": f"{what} s{mm.src_stage}->s{mm.dst_stage} mb{mm.microbatch}",
            "cat": "message", "ph": "X", "pid": LINKS_PID,
            "tid": tracks[(mm.src_device, mm.dst_device)],
            "ts": _us(mm.start), "dur": _us(mm.end - mm.start),
            "args": {"kind": mm.kind, "src_stage": mm.src_stage, "dst_stage": mm.dst_stage,
                     "microbatch": mm.microbatch, "src_device": mm.src_device,
                     "dst_device": mm.dst_device, "arrival_s": mm.arrival},
        })
    for d, steps in enumerate(schedule.memory_timeline):
        at: dict[float, float] = {}
        for t, b in steps:  # several changes at one instant: the counter shows the last
            at[t] = b
        last: float | None = None
        for t, b in at.items():
            if b == last:
                continue
            events.append({"name": f"memory device {d}", "ph": "C", "pid": DEVICES_PID,
                           "ts": _us(t), "args": {"bytes": b}})
            last = b
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "method": schedule.method,
            "makespan_s": schedule.makespan,
            "bubble_ratio": schedule.bubble_ratio,
            "devices": pr.devices,
            "microbatches": pr.microbatches,
            "time_unit": "ts and dur are microseconds: schedule seconds x 1e6",
        },
    }


def write_trace(schedule: Schedule, path: str | os.PathLike[str]) -> None:
    """Write :func:`to_trace_events` of ``schedule`` as JSON to ``path`` atomically."""
    write_atomic(path, json.dumps(to_trace_events(schedule), separators=(",", ":")) + "\n")
