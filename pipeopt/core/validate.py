"""The judge of any GraphSchedule: every rule of the TaskGraph, checked from the times alone.

Written apart from :mod:`pipeopt.core.simulate` (it shares no code with it), so a simulator bug
cannot hide behind a validator that reasons the same way. Messages are never rebuilt here: an
edge whose message occupies its link must have exactly one timed message in the schedule.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

from pipeopt.core.graph import TaskGraph
from pipeopt.core.schedule import GraphSchedule


class InvalidSchedule(ValueError):
    """A schedule that breaks the graph's rules; ``violations`` lists all of them."""

    def __init__(self, message: str, violations: Sequence[str]) -> None:
        super().__init__(message)
        self.violations = list(violations)


def check(schedule: GraphSchedule, *, tolerance: float = 1e-9) -> list[str]:
    """Every violation in ``schedule`` (empty when valid), each naming tasks by label.

    Checks: one finite start and end per task, starts >= 0, each task lasting its duration;
    every edge (the destination starts after the source ends, plus the latency across devices,
    or after its message arrives when the message occupies the link); one message per such
    edge, sent after its source ends, taking ``bytes / bandwidth`` then ``latency``; one task
    at a time per device and one thing at a time (message or communication task) per network
resource; memory within limits.
    ``tolerance`` is relative to max(1, latest end).
    """
    g = schedule.graph
    n = g.num_tasks
    lab = g.label
    start, end = schedule.start, schedule.end
    if len(start) != n or len(end) != n:
        return [f"times: expected {n} starts and ends, got {len(start)} and {len(end)}"]
    bad = [i for i in range(n) if not (math.isfinite(start[i]) and math.isfinite(end[i]))]
    if bad:
        return [f"{lab[i]}: start/end must be finite numbers" for i in bad]
    tol = tolerance * max(1.0, max(end, default=0.0))
    out: list[str] = []
    for i in range(n):
        if start[i] < -tol:
            out.append(f"{lab[i]}: starts at {start[i]:g} < 0")
        if abs(end[i] - start[i] - g.duration[i]) > tol:
            out.append(f"{lab[i]}: lasts {end[i] - start[i]:g}, its duration is "
                       f"{g.duration[i]:g}")
    out += _check_edges(schedule, tol)
    out += _check_devices(schedule, tol)
    out += _check_memory(schedule)
    return out


def _transfer(g: TaskGraph, e: int) -> tuple[int, float, float]:
    """(link id or -1, transmission s, latency s) of edge ``e``, from the graph's columns."""
    a, b = g.device[g.src[e]], g.device[g.dst[e]]
    if a == b:
        return -1, 0.0, 0.0
    if a < 0 or b < 0:  # a communication task's edge: no message
        return -1, 0.0, 0.0
    k = g.link_index[(a, b)]
    bw = g.bandwidth[k]
    size = g.bytes[e]
    return k, (size / bw if size > 0 and bw < math.inf else 0.0), g.latency[k]


def _check_edges(schedule: GraphSchedule, tol: float) -> list[str]:
    g = schedule.graph
    lab = g.label
    start, end = schedule.start, schedule.end
    out: list[str] = []
    msgs: dict[int, tuple[float, float, float]] = {}
    for mm in schedule.messages:
        e = mm.edge
        if not 0 <= e < g.num_edges:
            out.append(f"message on edge {e}: no such edge")
        elif e in msgs:
            out.append(f"message {lab[g.src[e]]} -> {lab[g.dst[e]]}: listed twice")
        else:
            msgs[e] = (mm.start, mm.end, mm.arrival)
    per_link: dict[int, list[tuple[float, float, int]]] = defaultdict(list)
    for i in g.comm_tasks:  # a communication task occupies what it holds; ~i marks a task
        for r in g.holds[i]:
            per_link[r].append((start[i], end[i], ~i))
    for e in range(g.num_edges):
        a, b = g.src[e], g.dst[e]
        name = f"{lab[a]} -> {lab[b]}"
        k, tx, lat = _transfer(g, e)
        if tx > 0:
            mm = msgs.pop(e, None)
            if mm is None:
                out.append(f"{name}: no message carries it across link {k}")
                continue
            t0, t1, arr = mm
            if t0 < end[a] - tol:
                out.append(f"{name}: message sent at {t0:g} before {lab[a]} ends at {end[a]:g}")
            if abs(t1 - t0 - tx) > tol or abs(arr - t1 - lat) > tol:
                out.append(f"{name}: message takes {t1 - t0:g}+{arr - t1:g}, expected "
                           f"{tx:g}+{lat:g}")
            per_link[k].append((t0, t1, e))
            ready = arr
        else:
            ready = end[a] + lat
        if start[b] < ready - tol:
            out.append(f"{name}: {lab[b]} starts at {start[b]:g} before its input from "
                       f"{lab[a]} is available at {ready:g}")
    for e in msgs:
        out.append(f"message {lab[g.src[e]]} -> {lab[g.dst[e]]}: this edge occupies no link")
    for k, lst in per_link.items():
        lst.sort()
        busy_until, prev = -math.inf, -1
        for t0, t1, e in lst:
            if t0 < busy_until - tol:
                out.append(f"{g.resource_name(k)}: {_holder(g, e)} starts at {t0:g} while "
                           f"{_holder(g, prev)} is on it until {busy_until:g}")
            if t1 > busy_until:
                busy_until, prev = t1, e
    return out


def _holder(g: TaskGraph, e: int) -> str:
    """``message a -> b`` for edge ``e`` >= 0, the communication task's label for ``~i``."""
    if e < 0:
        return g.label[~e]
    return f"message {g.label[g.src[e]]} -> {g.label[g.dst[e]]}"


def _check_devices(schedule: GraphSchedule, tol: float) -> list[str]:
    g = schedule.graph
    start, end = schedule.start, schedule.end
    out: list[str] = []
    for d, tasks in enumerate(g.device_tasks):
        busy_until, prev = -math.inf, -1
        for i in sorted(tasks, key=lambda i: (start[i], end[i])):
            if start[i] < busy_until - tol:
                out.append(f"device {d}: {g.label[i]} starts at {start[i]:g} while "
                           f"{g.label[prev]} runs until {busy_until:g}")
            if end[i] > busy_until:
                busy_until, prev = end[i], i
    return out


def _check_memory(schedule: GraphSchedule) -> list[str]:
    """The level after all changes at each instant stays within the limit (changes at the same
    instant count together, which is the decreases-first rule at its highest point)."""
    g = schedule.graph
    out: list[str] = []
    change: list[dict[float, float]] = [defaultdict(float) for _ in range(g.devices)]
    for i, d in enumerate(g.device):
        if d < 0:  # a communication task changes no memory
            continue
        change[d][schedule.start[i]] += g.mem_start[i]
        change[d][schedule.end[i]] += g.mem_end[i]
    for d, lim in enumerate(g.memory_limit):
        if lim is None:
            continue
        level = g.static_memory[d]
        cap = lim * (1 + 1e-9) + 1e-12
        if level > cap:
            out.append(f"device {d}: static memory {level:g} exceeds the limit {lim:g}")
            continue
        for t in sorted(change[d]):
            level += change[d][t]
            if level > cap:
                who = [g.label[i] for i in g.device_tasks[d]
                       if schedule.start[i] <= t < schedule.end[i] or schedule.start[i] == t]
                out.append(f"device {d}: memory {level:g} exceeds the limit {lim:g} at "
                           f"{t:g} (running or starting: {', '.join(who[:4]) or 'none'})")
                break
    return out


def validate(schedule: GraphSchedule, *, tolerance: float = 1e-9) -> GraphSchedule:
    """Return ``schedule`` if it breaks no rule, else raise :class:`InvalidSchedule`."""
    violations = check(schedule, tolerance=tolerance)
    if violations:
        more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
        raise InvalidSchedule(f"invalid schedule: {violations[0]}{more}", violations)
    return schedule
