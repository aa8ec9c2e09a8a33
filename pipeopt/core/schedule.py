"""GraphSchedule: start and end times of every task of a TaskGraph, and what follows from them.

Like the chain :class:`~pipeopt.schedule.Schedule`, metrics are derived from the times, never
stored, so a schedule cannot disagree with itself. Times in seconds, memory in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from operator import add
from typing import Literal, NamedTuple

from pipeopt.core.graph import TaskGraph

Status = Literal["optimal", "feasible", "heuristic"]


class MessageTime(NamedTuple):
    """Edge ``edge``'s message: on its link from ``start`` to ``end``, usable at ``arrival``."""

    edge: int
    start: float
    end: float
    arrival: float


@dataclass(frozen=True, eq=False)
class GraphSchedule:
    """Times of every task (``start[i]``, ``end[i]``, seconds) and of the messages that occupy a
    link (edges with a positive transmission), with how they were found.

    ``status``: ``optimal`` (proven), ``feasible`` (a search stopped at its limit) or
    ``heuristic``; ``lower_bound``: a proven lower bound on the objective (s) or None.
    """

    graph: TaskGraph
    start: tuple[float, ...]
    end: tuple[float, ...]
    messages: tuple[MessageTime, ...] = ()
    method: str = "custom"
    status: Status = "heuristic"
    lower_bound: float | None = None
    wall_time: float = 0.0

    @cached_property
    def makespan(self) -> float:
        """Latest task end (seconds)."""
        return max(self.end, default=0.0)

    @cached_property
    def objective(self) -> float:
        """max over tasks of end + tail (seconds): the makespan when every tail is 0."""
        return max(map(add, self.end, self.graph.tail), default=0.0)

    @property
    def gap(self) -> float | None:
        """(objective - lower bound) / objective, or None without a bound."""
        if self.lower_bound is None or self.objective <= 0:
            return None
        return max(0.0, (self.objective - self.lower_bound) / self.objective)

    @cached_property
    def memory_timeline(self) -> tuple[tuple[tuple[float, float], ...], ...]:
        """Per device, the (time s, bytes in use) steps: ``(0, static memory)`` then the level
        after each change; at equal times decreases apply before increases."""
        g = self.graph
        events: list[list[tuple[float, float]]] = [[] for _ in range(g.devices)]
        for d, s, e, a, f in zip(g.device, self.start, self.end, g.mem_start, g.mem_end,
                                 strict=True):
            if a:
                events[d].append((s, a))
            if f:
                events[d].append((e, f))
        out = []
        for d, ev in enumerate(events):
            ev.sort()  # by time, then decreases (negative) first
            cur = g.static_memory[d]
            steps = [(0.0, cur)]
            for t, delta in ev:
                cur += delta
                steps.append((t, cur))
            out.append(tuple(steps))
        return tuple(out)

    @cached_property
    def peak_memory(self) -> tuple[float, ...]:
        """Per device, the highest memory level (bytes, static included); at equal times
        decreases apply before increases."""
        return tuple(max(b for _, b in steps) for steps in self.memory_timeline)

    def device_orders(self) -> list[list[int]]:
        """Per device, its task ids by start time (then end time, then topological position,
        so zero-length tasks keep the data flow's order)."""
        g = self.graph
        pos = [0] * g.num_tasks
        for q, i in enumerate(g.topological_order):
            pos[i] = q
        s, e = self.start, self.end
        return [sorted(tasks, key=lambda i: (s[i], e[i], pos[i])) for tasks in g.device_tasks]

    def summary(self) -> dict[str, object]:
        """A few headline numbers, for printing."""
        return {"method": self.method, "status": self.status, "objective": self.objective,
                "makespan": self.makespan, "lower_bound": self.lower_bound, "gap": self.gap,
                "peak_memory": list(self.peak_memory), "wall_time": self.wall_time}


def task_groups(graph: TaskGraph) -> tuple[str, ...]:
    """Per task, the group plots and traces colour it by: ``meta["task_group"]`` when the
    builder recorded one, else its label without digits and the separators around them
    (``0F3`` -> ``F``, ``allreduce s2 mb5`` -> ``allreduce s mb``; ``t<i>`` -> ``t``)."""
    groups = dict(graph.meta).get("task_group")
    if isinstance(groups, tuple | list) and len(groups) == graph.num_tasks:
        return tuple(map(str, groups))
    digits = str.maketrans("", "", "0123456789")
    cache: dict[str, str] = {}
    out = []
    for label in graph.label:
        g = cache.get(label)
        if g is None:
            g = cache[label] = label.translate(digits).strip(" ._-:/#") or "task"
        out.append(g)
    return tuple(out)
