"""Lower bounds on the objective max(end + tail) that hold for every schedule of a TaskGraph.

Notation (seconds): ``dur[i]``; for an edge e = (i -> j), ``delay[e] = tx[e] + lat[e]``, the
least time from i's end to j's start (a message occupies its link for ``tx`` at least once,
then travels ``lat``; 0 on one device or to / from a communication task). Memory limits are
not used: every bound below also holds without them, so it holds with them.
"""

from __future__ import annotations

from pipeopt.core.graph import TaskGraph


def heads(graph: TaskGraph) -> list[float]:
    """Per task, the earliest time it can start in any schedule (s).

    ``head[j] = max(0, max over edges e = (i -> j) of head[i] + dur[i] + delay[e])``. Proof by
    induction in topological order: j starts after each input i ends (``>= head[i] + dur[i]``)
    and its message arrives (``delay[e]`` later at least); starts are >= 0."""
    head = [0.0] * graph.num_tasks
    dur, src, delay = graph.duration, graph.src, graph.edge_delay
    poff, pe = graph.pred_offsets, graph.pred_edges
    for j in graph.topological_order:
        t = 0.0
        for q in range(poff[j], poff[j + 1]):
            e = pe[q]
            i = src[e]
            a = head[i] + dur[i] + delay[e]
            if a > t:
                t = a
        head[j] = t
    return head


def tail_paths(graph: TaskGraph) -> list[float]:
    """Per task, the least time from its start to the objective's value (s), its duration
    included: ``q[i] = dur[i] + max(tail[i], max over edges e = (i -> j) of delay[e] + q[j])``.

    Proof by induction in reverse topological order: the objective is at least
    ``end[i] + tail[i]``, and at least ``start[j] + q[j] >= end[i] + delay[e] + q[j]`` for each
    successor j. This is also the greedy's priority (the longest path still ahead of a task)."""
    q = [0.0] * graph.num_tasks
    dur, dst, delay, tail = graph.duration, graph.dst, graph.edge_delay, graph.tail
    soff, se = graph.succ_offsets, graph.succ_edges
    for i in reversed(graph.topological_order):
        t = tail[i]
        for k in range(soff[i], soff[i + 1]):
            e = se[k]
            a = delay[e] + q[dst[e]]
            if a > t:
                t = a
        q[i] = dur[i] + t
    return q


def critical_path(graph: TaskGraph) -> float:
    """``max over tasks of head[i] + q[i]``: the longest chain of durations, delays and a tail.
    Every schedule has ``start[i] >= head[i]`` and objective ``>= start[i] + q[i]``."""
    return max(map(float.__add__, heads(graph), tail_paths(graph)), default=0.0)


def device_bounds(graph: TaskGraph) -> tuple[float, ...]:
    """Per device d: ``min head + sum of durations + min (q - dur)`` over d's tasks.

    Proof: d runs its tasks one at a time, so the last of them to end, l, ends at least the sum
    of their durations after the first of them starts, which is at least the smallest head; the
    objective is at least ``end[l] + q[l] - dur[l]`` (see :func:`tail_paths`), which is at least
    the smallest such after-time over d's tasks. A device without tasks gives 0."""
    head, q, dur = heads(graph), tail_paths(graph), graph.duration
    out = []
    for tasks in graph.device_tasks:
        if not tasks:
            out.append(0.0)
            continue
        out.append(min(head[i] for i in tasks) + sum(dur[i] for i in tasks)
                   + min(q[i] - dur[i] for i in tasks))
    return tuple(out)


def link_bounds(graph: TaskGraph) -> tuple[float, ...]:
    """Per network resource (the directed links, then the named networks): ``min ready + sum of
    busy times + min after`` over what occupies it, 0 when nothing does. A message (an edge
    with a positive transmission) is ready at ``head[src] + dur[src]``, busy ``tx`` and followed
    by ``lat + q[dst]``; a communication task holding the resource is ready at ``head[i]``, busy
    ``dur[i]`` and followed by ``q[i] - dur[i]``.

    Proof: as for a device: the items occupy the resource one at a time, none before it can be
    ready; after the last one leaves it the objective is at least its after-time later (its
    receiver starts no earlier than ``lat`` later and the objective is ``q[dst]`` after that
    start; a communication task's end is ``q - dur`` before the objective at least)."""
    head, q = heads(graph), tail_paths(graph)
    dur, src, dst = graph.duration, graph.src, graph.dst
    tx, lat = graph.edge_transmission, graph.edge_latency
    per: list[list[tuple[float, float, float]]] = [[] for _ in range(graph.num_resources)]
    for e, (k, t) in enumerate(zip(graph.edge_link, tx, strict=True)):
        if t > 0:
            per[k].append((head[src[e]] + dur[src[e]], t, lat[e] + q[dst[e]]))
    for i in graph.comm_tasks:
        for r in graph.holds[i]:
            per[r].append((head[i], dur[i], q[i] - dur[i]))
    return tuple(0.0 if not items else
                 min(a for a, _, _ in items) + sum(b for _, b, _ in items)
                 + min(c for _, _, c in items)
                 for items in per)


def lower_bound(graph: TaskGraph) -> float:
    """The largest of :func:`critical_path`, :func:`device_bounds` and :func:`link_bounds` (s).
    """
    return max(critical_path(graph), *device_bounds(graph), *link_bounds(graph), 0.0)


#: Release thresholds tried per resource by :func:`one_machine_bounds` (every distinct head up
#: to this many, else this many evenly spaced ones): any threshold gives a valid bound, so the
#: cap only trades tightness for time (O(cap x n log n) per resource).
ONE_MACHINE_THRESHOLDS = 256


def one_machine_bounds(graph: TaskGraph) -> tuple[float, ...]:
    """Per device, then per network resource (the directed links, then the named networks):
    the largest ``r + sum of dur over S + a`` over the subsets ``S`` of its tasks with
    ``head >= r`` and ``after >= a`` (``after = q - dur``, :func:`tail_paths`), the one-machine
    head-body-tail bound (Carlier, "The one-machine sequencing problem", EJOR 11, 1982: every
    subset's smallest head + its total duration + its smallest tail). Messages are left out
    (a link's bound counts only the communication tasks holding it); 0 without tasks.

    Proof: the tasks of ``S`` run one at a time on the resource, the first of them starts no
    earlier than ``r``, so the last ends at least ``r + sum dur(S)`` and the objective is at
    least its ``after >= a`` later. :func:`device_bounds` is the case ``S`` = all tasks; a
    subset is tighter when the tasks with a long way ahead (a pipeline's forwards and input
    gradients on the last stage, before the backward's way back) are few enough to fit."""
    head, q, dur = heads(graph), tail_paths(graph), graph.duration
    per: list[list[int]] = [list(ts) for ts in graph.device_tasks]
    held: list[list[int]] = [[] for _ in range(graph.num_resources)]
    for i in graph.comm_tasks:
        for r in graph.holds[i]:
            held[r].append(i)
    out = []
    for tasks in per + held:
        if not tasks:
            out.append(0.0)
            continue
        items = sorted(((q[i] - dur[i], head[i], dur[i]) for i in tasks), reverse=True)
        rs = sorted({h for _, h, _ in items})
        if len(rs) > ONE_MACHINE_THRESHOLDS:
            step = (len(rs) - 1) / (ONE_MACHINE_THRESHOLDS - 1)
            rs = [rs[round(k * step)] for k in range(ONE_MACHINE_THRESHOLDS)]
        best = 0.0
        for r in rs:
            total = 0.0
            for after, h, d in items:  # after decreasing: S = those with after >= this one
                if h >= r:
                    total += d
                    if r + total + after > best:
                        best = r + total + after
        out.append(best)
    return tuple(out)
