"""A memory-aware list scheduler over any TaskGraph.

Time moves forward event by event (a task ends, a message is ready, an input arrives). Whenever
a device is idle it starts, among its tasks whose inputs have all arrived, the one with the
highest priority (default: the longest path still ahead of it, :func:`~pipeopt.core.bounds.
tail_paths`; ties to the lower id) that memory allows:

* the level stays within the limit when the task starts and when it ends (a device runs one
  task at a time, so nothing else changes its memory meanwhile);
* *reservation*: the device's other unstarted tasks could still all run afterwards in the
  *reference order* without passing the limit. The reference order is a serial, depth-first
  topological order (a finished task's newly ready successors go first), which finishes one
  unit of work before opening the next (one micro-batch at a time on a pipeline).

When the reference order itself fits every limit, that rule keeps a way to finish open at all
times (the next unstarted task of the reference order is always allowed once its inputs
arrive), so the scheduler cannot get stuck. When it does not fit, only the first rule applies
and the scheduler may get stuck: :class:`Stuck` says where. The device orders it chose are timed
again by :func:`pipeopt.core.simulate.simulate`, which makes the returned schedule.

Communication tasks (on no device) are not chosen: as in the simulator, each starts once its
inputs have arrived and its network resources are free, queued with the messages.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import replace

from pipeopt.core.bounds import lower_bound, tail_paths
from pipeopt.core.graph import TaskGraph
from pipeopt.core.schedule import GraphSchedule
from pipeopt.core.simulate import simulate


class Stuck(ValueError):
    """The list scheduler found no task that memory allows and nothing left to wait for."""


def reference_order(graph: TaskGraph) -> list[int]:
    """A depth-first topological order: Kahn's algorithm with a stack (lowest id first among
    the sources; a task's successors, made ready by it, next)."""
    n = graph.num_tasks
    indeg = [0] * n
    for b in graph.dst:
        indeg[b] += 1
    stack = [i for i in range(n - 1, -1, -1) if not indeg[i]]
    dst, soff, se = graph.dst, graph.succ_offsets, graph.succ_edges
    out = []
    while stack:
        i = stack.pop()
        out.append(i)
        for q in range(soff[i + 1] - 1, soff[i] - 1, -1):  # first successor on top
            b = dst[se[q]]
            indeg[b] -= 1
            if not indeg[b]:
                stack.append(b)
    return out


class _Reserve:
    """Per device, the unstarted tasks in reference order as a segment tree of (net change,
    highest prefix) pairs: the highest level that running them all in that order reaches,
    above the current level, in O(log n) per change."""

    def __init__(self, steps: Sequence[tuple[float, float]]) -> None:
        size = 1
        while size < max(1, len(steps)):
            size *= 2
        self.size = size
        self.total = [0.0] * (2 * size)
        self.best = [0.0] * (2 * size)  # highest prefix, the empty prefix (0) included
        for k, (ms, me) in enumerate(steps):
            self.total[size + k] = ms + me
            self.best[size + k] = max(0.0, ms, ms + me)
        for x in range(size - 1, 0, -1):
            self._pull(x)

    def _pull(self, x: int) -> None:
        a, b = 2 * x, 2 * x + 1
        self.total[x] = self.total[a] + self.total[b]
        self.best[x] = max(self.best[a], self.total[a] + self.best[b])

    def set(self, k: int, ms: float, me: float) -> None:
        """Replace slot ``k``'s changes (0, 0 once its task started)."""
        x = self.size + k
        self.total[x] = ms + me
        self.best[x] = max(0.0, ms, ms + me)
        x //= 2
        while x:
            self._pull(x)
            x //= 2

    @property
    def peak(self) -> float:
        """Highest rise above the current level while running every slot in order."""
        return self.best[1]


def solve_greedy(graph: TaskGraph, priority: Sequence[float] | None = None) -> GraphSchedule:
    """List-schedule ``graph`` (see the module docstring); ``priority[i]``: higher goes first.

    Raises :class:`Stuck` when memory blocks every remaining task."""
    t0 = time.perf_counter()
    orders = list_schedule(graph, priority)
    sched = simulate(graph, orders, "greedy", check=False)
    return replace(sched, status="heuristic", lower_bound=lower_bound(graph),
                   wall_time=time.perf_counter() - t0)


def list_schedule(graph: TaskGraph, priority: Sequence[float] | None = None) -> list[list[int]]:
    """The device orders the list scheduler chooses (see :func:`solve_greedy`)."""
    n, p = graph.num_tasks, graph.devices
    prio = list(priority) if priority is not None else tail_paths(graph)
    dur, dev, dst = graph.duration, graph.device, graph.dst
    ms, me = graph.mem_start, graph.mem_end
    tx, lat, link = graph.edge_transmission, graph.edge_latency, graph.edge_link
    soff, se = graph.succ_offsets, graph.succ_edges
    # Half the validator's slack: float drift in the running sums still passes it.
    limit = [math.inf if x is None else x * (1 + 5e-10) + 5e-13 for x in graph.memory_limit]
    level = list(graph.static_memory)

    ref = reference_order(graph)
    slot = [0] * n
    per_dev: list[list[int]] = [[] for _ in range(p + 1)]  # [-1]: communication tasks
    for i in ref:
        slot[i] = len(per_dev[dev[i]])
        per_dev[dev[i]].append(i)
    del per_dev[-1]
    holds = graph.holds
    comm = len(graph.comm_tasks)
    reserve = [_Reserve([(ms[i], me[i]) for i in tasks]) if limit[d] < math.inf else None
               for d, tasks in enumerate(per_dev)]
    guarded = all(r is None or level[d] + r.peak <= limit[d] for d, r in enumerate(reserve))

    need = [0] * n
    for b in dst:
        need[b] += 1
    avail = [0.0] * n  # latest input arrival so far
    ready: list[list[tuple[float, int]]] = [[] for _ in range(p)]
    events: list[tuple[float, int, int, int]] = []  # (time, seq, 0 end / 1 message / 2 arrival)
    seq = 0
    for i in range(n):
        if not need[i]:
            if dev[i] < 0:
                heapq.heappush(events, (0.0, seq, 2, i))
                seq += 1
            else:
                ready[dev[i]].append((-prio[i], i))
    for h in ready:
        heapq.heapify(h)
    busy = [False] * p
    link_free = [0.0] * graph.num_resources
    orders: list[list[int]] = [[] for _ in range(p)]
    placed = 0
    now = 0.0

    def allowed(i: int) -> bool:
        d = dev[i]
        a = level[d] + ms[i]
        if a > limit[d] or a + me[i] > limit[d]:
            return False
        r = reserve[d]
        if r is None or not guarded:
            return True
        r.set(slot[i], 0.0, 0.0)
        if a + me[i] + r.peak > limit[d]:
            r.set(slot[i], ms[i], me[i])
            return False
        return True

    def start_some(d: int) -> None:
        nonlocal seq, placed
        h = ready[d]
        skipped = []
        while h:
            item = heapq.heappop(h)
            i = item[1]
            if allowed(i):
                level[d] += ms[i]
                busy[d] = True
                orders[d].append(i)
                placed += 1
                heapq.heappush(events, (now + dur[i], seq, 0, i))
                seq += 1
                break
            skipped.append(item)
        for item in skipped:
            heapq.heappush(h, item)

    def arrived(e: int, t: float) -> None:
        nonlocal seq
        b = dst[e]
        if t > avail[b]:
            avail[b] = t
        need[b] -= 1
        if not need[b]:
            heapq.heappush(events, (avail[b], seq, 2, b))
            seq += 1

    touched = set(range(p))
    while True:
        for d in sorted(touched):
            if not busy[d]:
                start_some(d)
        touched.clear()
        if not events:
            break
        now = events[0][0]
        while events and events[0][0] == now:
            _, _, kind, x = heapq.heappop(events)
            if kind == 0:  # task x ended
                d = dev[x]
                if d >= 0:
                    level[d] += me[x]
                    busy[d] = False
                    touched.add(d)
                for q in range(soff[x], soff[x + 1]):
                    e = se[q]
                    if tx[e] > 0:
                        heapq.heappush(events, (now, seq, 1, e))
                        seq += 1
                    else:
                        arrived(e, now + lat[e])
            elif kind == 1:  # edge x's message is ready: queue it on its link
                k = link[x]
                t = max(now, link_free[k]) + tx[x]
                link_free[k] = t
                arrived(x, t + lat[x])
            elif dev[x] < 0:  # communication task x is ready: queue it on what it holds
                t = max(now, *(link_free[r] for r in holds[x])) + dur[x]
                for r in holds[x]:
                    link_free[r] = t
                heapq.heappush(events, (t, seq, 0, x))
                seq += 1
            else:  # all of task x's inputs have arrived
                heapq.heappush(ready[dev[x]], (-prio[x], x))
                touched.add(dev[x])
    if placed < n - comm:
        raise Stuck(_stuck_message(graph, ready, level, limit, guarded))
    return orders


def _stuck_message(graph: TaskGraph, ready: list[list[tuple[float, int]]], level: list[float],
                   limit: list[float], guarded: bool) -> str:
    lines = []
    for d, h in enumerate(ready):
        if h:
            i = min(h)[1]
            need = max(graph.mem_start[i], graph.mem_start[i] + graph.mem_end[i])
            lines.append(f"device {d}: {graph.label[i]} needs {need:g} more, {level[d]:g} of "
                         f"{graph.memory_limit[d]:g} in use")
    why = ("" if guarded else "; even running the tasks one at a time in a depth-first order "
           "passes a memory limit")
    return ("greedy: stuck under memory: " + ("; ".join(lines) or "no task is ready") + why)
