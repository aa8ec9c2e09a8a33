"""Device orders -> earliest times, over any TaskGraph.

:func:`simulate` starts every task as early as its device (one task at a time, in the given
order) and its incoming edges allow. A message that occupies its link (positive transmission)
is sent when its producer ends and the link is free, one at a time per directed link, in the
order the messages become ready (ties in the order their producers' end events were handled,
then by edge id): the rule of the chain simulator :mod:`pipeopt.simulate`. When no message
occupies a link, every edge is a fixed delay and a dependency-counting pass (linear in tasks +
edges) does the job.

A communication task (on no device, :class:`~pipeopt.core.graph.TaskGraph`) is in no order: it
starts once its inputs have arrived and every network resource it holds is free, and it queues
on its resources with the messages, in the order they all become ready (what Megatron does with
a collective: issue it as soon as its inputs allow).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Sequence
from itertools import pairwise

from pipeopt._gc import cyclic_gc_paused
from pipeopt.core.graph import TaskGraph
from pipeopt.core.schedule import GraphSchedule, MessageTime

Orders = Sequence[Sequence[int]]


class OrderError(ValueError):
    """Device orders that do not hold every task exactly once on its own device."""


class DeadlockError(OrderError):
    """The orders wait on each other in a cycle; ``cycle`` lists (device, task, waited-for task).
    """

    def __init__(self, message: str, cycle: Sequence[tuple[int, int, int]]) -> None:
        super().__init__(message)
        self.cycle = list(cycle)


def check_orders(graph: TaskGraph, orders: Orders) -> None:
    """Raise :class:`OrderError` unless ``orders`` hold every task once, on its device."""
    p, n = graph.devices, graph.num_tasks
    if len(orders) != p:
        raise OrderError(f"orders: expected {p} device lists, got {len(orders)}")
    dev = graph.device
    seen: set[int] = set()
    for d, order in enumerate(orders):
        if not set(map(type, order)) <= {int}:
            q = next(q for q, i in enumerate(order) if type(i) is not int)
            raise OrderError(f"orders[{d}][{q}]: expected a task id, got {order[q]!r}")
        if order and not (min(order) >= 0 and max(order) < n):
            q = next(q for q, i in enumerate(order) if not 0 <= i < n)
            raise OrderError(f"orders[{d}][{q}]: {order[q]} is not a task id (0..{n - 1})")
        if set(map(dev.__getitem__, order)) - {d}:
            q = next(q for q, i in enumerate(order) if dev[i] != d)
            if dev[order[q]] < 0:
                raise OrderError(f"orders[{d}][{q}]: {graph.label[order[q]]} is a "
                                 f"communication task, in no device order")
            raise OrderError(f"orders[{d}][{q}]: {graph.label[order[q]]} belongs on device "
                             f"{dev[order[q]]}")
        before = len(seen)
        seen.update(order)
        if len(seen) - before < len(order):
            counts = Counter(order)
            q = max(q for q, i in enumerate(order) if counts[i] > 1)
            raise OrderError(f"orders[{d}][{q}]: {graph.label[order[q]]} appears twice")
    comm = len(graph.comm_tasks)
    if len(seen) != n - comm:
        missing = next(i for i in range(n) if i not in seen and dev[i] >= 0)
        raise OrderError(f"orders: {n - comm - len(seen)} tasks missing, e.g. "
                         f"{graph.label[missing]}")


def simulate(graph: TaskGraph, orders: Orders, method: str = "custom", *,
             check: bool = True, events: bool = False) -> GraphSchedule:
    """Time ``orders`` (per device, task ids; communication tasks are in none) as early as
    possible.

    ``events``: use the event-driven path even when no message occupies a link (the fast
    path's cross-check; the times are the same). Raises :class:`OrderError` when an order
    misses, repeats or misplaces a task and :class:`DeadlockError` when the orders wait on
    each other in a cycle.
    """
    with cyclic_gc_paused():
        start, end, msgs = time_orders(graph, orders, check=check, events=events)
        return GraphSchedule(graph, tuple(start), tuple(end), tuple(msgs), method=method)


def time_orders(graph: TaskGraph, orders: Orders, *, check: bool = True, events: bool = False
                ) -> tuple[list[float], list[float], list[MessageTime]]:
    """:func:`simulate`'s timing as bare columns: (start, end) per task id in seconds and the
    timed messages, for a caller that makes its own result type from them (the chain's
    :func:`pipeopt.simulate.simulate`). Same arguments and errors as :func:`simulate`."""
    if check:
        check_orders(graph, orders)
    if events or graph.serialized:
        return _simulate_events(graph, orders)
    start, end = _simulate_fast(graph, orders)
    return start, end, []


def _simulate_fast(graph: TaskGraph, orders: Orders) -> tuple[list[float], list[float]]:
    """Dependency counting: every edge is a fixed delay (no message occupies a link).

    Each task counts its unfinished prerequisites (incoming edges and its device predecessor)
    and keeps the latest time one of them made it ready; timing a task updates its successors.
    """
    n = graph.num_tasks
    dur = graph.duration
    steps = graph.out_steps  # (successor - task, latency): no transmission on this path
    need = list(graph.in_degree)
    nxt = [-1] * n  # next task on the same device
    first = []
    for order in orders:
        for a, b in pairwise(order):
            nxt[a] = b
            need[b] += 1
        if order:
            first.append(order[0])
    ready = [0.0] * n
    start = [math.nan] * n  # NaN until timed (the deadlock report relies on it)
    end = [math.nan] * n
    stack = [i for i in first if not need[i]]
    push, pop = stack.append, stack.pop
    done = 0
    while stack:
        i = pop()
        t = ready[i]
        start[i] = t
        e = t + dur[i]
        end[i] = e
        done += 1
        y = nxt[i]
        if y >= 0:
            if e > ready[y]:
                ready[y] = e
            c = need[y] - 1
            need[y] = c
            if not c:
                push(y)
        for dy, delay in steps[i]:
            y = i + dy
            a = e + delay
            if a > ready[y]:
                ready[y] = a
            c = need[y] - 1
            need[y] = c
            if not c:
                push(y)
    if done < n:
        _raise_deadlock(graph, orders, end)
    return start, end


def _simulate_events(graph: TaskGraph, orders: Orders
                     ) -> tuple[list[float], list[float], list[MessageTime]]:
    """Event-driven timing with serialized links (see the module docstring for the order)."""
    n, p = graph.num_tasks, graph.devices
    dur, dev, dst = graph.duration, graph.device, graph.dst
    tx, lat, link = graph.edge_transmission, graph.edge_latency, graph.edge_link
    poff, pe = graph.pred_offsets, graph.pred_edges
    soff, se = graph.succ_offsets, graph.succ_edges
    holds = graph.holds
    start = [math.nan] * n
    end = [math.nan] * n
    arrival = [math.nan] * graph.num_edges  # per edge: when dst may use it
    ptr = [0] * p
    dev_free = [0.0] * p
    link_free = [0.0] * graph.num_resources  # links, then named networks
    waiting = list(graph.in_degree) if holds else []  # a communication task's missing inputs
    messages: list[MessageTime] = []
    # (time, seq, kind 0 = end / 1 = message / 2 = communication task ready, id)
    heap: list[tuple[float, int, int, int]] = []
    seq = 0

    def try_start(d: int) -> None:
        nonlocal seq
        order = orders[d]
        if ptr[d] >= len(order):
            return
        i = order[ptr[d]]
        t = dev_free[d]
        for q in range(poff[i], poff[i + 1]):
            a = arrival[pe[q]]
            if a != a:  # NaN: not arrived yet
                return
            if a > t:
                t = a
        start[i] = t
        e = end[i] = t + dur[i]
        dev_free[d] = e
        ptr[d] += 1
        heapq.heappush(heap, (e, seq, 0, i))
        seq += 1

    def comm_input(b: int) -> None:
        """One more input of communication task ``b`` arrived."""
        nonlocal seq
        waiting[b] -= 1
        if not waiting[b]:
            heapq.heappush(heap, (max(arrival[pe[q]] for q in range(poff[b], poff[b + 1])),
                                  seq, 2, b))
            seq += 1

    for d in range(p):
        try_start(d)
    for i in graph.comm_tasks:
        if not waiting[i]:
            heapq.heappush(heap, (0.0, seq, 2, i))
            seq += 1
    while heap:
        t, _, kind, x = heapq.heappop(heap)
        if kind == 0:  # task x ended: hand its outputs on, then let its device go on
            for q in range(soff[x], soff[x + 1]):
                e = se[q]
                if tx[e] > 0:
                    heapq.heappush(heap, (t, seq, 1, e))
                    seq += 1
                else:
                    arrival[e] = t + lat[e]
                    d = dev[dst[e]]
                    if d >= 0:
                        try_start(d)
                    else:
                        comm_input(dst[e])
            if dev[x] >= 0:
                try_start(dev[x])
        elif kind == 1:  # edge x's message is ready: queue it on its directed link
            k = link[x]
            t0 = max(t, link_free[k])
            sent = t0 + tx[x]
            link_free[k] = sent
            arrival[x] = sent + lat[x]
            messages.append(MessageTime(x, t0, sent, arrival[x]))
            try_start(dev[dst[x]])  # a message never goes to a communication task
        else:  # communication task x is ready: queue it on every resource it holds
            t0 = max(t, *(link_free[r] for r in holds[x]))
            start[x] = t0
            e = end[x] = t0 + dur[x]
            for r in holds[x]:
                link_free[r] = e
            heapq.heappush(heap, (e, seq, 0, x))
            seq += 1
    if any(map(math.isnan, end)):
        _raise_deadlock(graph, orders, end)
    return start, end, messages


def _raise_deadlock(graph: TaskGraph, orders: Orders, end: Sequence[float]) -> None:
    """Name a cycle of waits among the devices' blocked head tasks and raise it.

    Each blocked head waits for an unfinished predecessor; that predecessor's device is stuck at
    its own head (else it would have run on). Following the waits must revisit a device."""
    head: dict[int, int] = {}
    for d, order in enumerate(orders):
        for i in order:
            if math.isnan(end[i]):
                head[d] = i
                break
    label, dev, src = graph.label, graph.device, graph.src
    d = next(iter(head))
    path: list[tuple[int, int, int]] = []
    visited: dict[int, int] = {}
    while d not in visited:
        visited[d] = len(path)
        i = head[d]
        w = next(src[e] for e in graph.preds(i) if math.isnan(end[src[e]]))
        while dev[w] < 0:  # a communication task waits for an input of its own
            w = next(src[e] for e in graph.preds(w) if math.isnan(end[src[e]]))
        path.append((d, i, w))
        d = dev[w]
    cycle = path[visited[d]:]
    text = "; ".join(f"device {dv} waits at {label[i]} for {label[w]} (device {dev[w]})"
                     for dv, i, w in cycle)
    raise DeadlockError(f"deadlock: {text}", cycle)
