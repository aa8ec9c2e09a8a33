"""Forward-backward improvement of a schedule over any TaskGraph (double justification).

A list schedule built forward in time packs work early and can leave the end ragged; the same
list scheduler run on the *reversed* graph (every edge and link turned around, memory changes
mirrored) packs the end instead, and its device orders read backwards are a schedule of the
original graph. Alternating the two passes, each ordered by the other's times, is the
forward-backward improvement of RCPSP heuristics (Li and Willis, "An iterative scheduling
technique for resource-constrained project scheduling", EJOR 56, 1992; Valls, Ballestin and
Quintanilla, "Justification and RCPSP: a technique that pays", EJOR 165, 2005).

* backward pass: :func:`~pipeopt.core.greedy.list_schedule` on :func:`reversed_graph` with the
  latest-ending task first (priority = the current schedule's end times); its device orders,
  each read backwards, are timed by :func:`~pipeopt.core.simulate.simulate` on the graph;
* forward pass: the list scheduler on the graph with the earliest-starting task of that
  schedule first (priority = minus its start times).

Each pass's schedule is checked by :func:`~pipeopt.core.validate.check` (memory included) and
the best one kept; the passes stop when a round improves nothing. On the MoE pipelines of
``benchmarks/moe.py`` (p = 8) it took the best list schedule from 0.701 to 0.680 s (m = 16,
all-to-all 1x the expert compute, the hand-made schedules' memory) within a few seconds.
"""

from __future__ import annotations

import random
import time

from pipeopt.core.graph import TaskGraph
from pipeopt.core.greedy import Stuck, list_schedule
from pipeopt.core.schedule import GraphSchedule
from pipeopt.core.simulate import simulate
from pipeopt.core.validate import check


def reversed_graph(graph: TaskGraph) -> TaskGraph:
    """``graph`` with every edge and directed link turned around (link k joins the same
    devices the other way, so it is the same network resource id), ``mem_start`` and
    ``mem_end`` swapped and negated, and each device's static memory raised by its tasks' net
    change (0 when every byte allocated is freed).

    A device order's memory levels are those of the original order read backwards, and its
    orders with every edge reversed stay acyclic exactly when the original's are, so the
    device orders of any schedule of the reversed graph, each read backwards, are device
    orders of ``graph`` within its memory limits. Raises ValueError when a task has a tail
    (the objective is then no makespan to mirror) or a device frees more than it allocates
    below zero."""
    if any(graph.tail):
        raise ValueError("reversed_graph: tasks with a tail have no mirror image (the "
                         "objective is not the makespan)")
    net = [0.0] * graph.devices
    for i, d in enumerate(graph.device):
        if d >= 0:
            net[d] += graph.mem_start[i] + graph.mem_end[i]
    static = tuple(s + x for s, x in zip(graph.static_memory, net, strict=True))
    if static and min(static) < 0:
        d = static.index(min(static))
        raise ValueError(f"reversed_graph: device {d} frees more memory than it holds")
    return graph.replace(src=graph.dst, dst=graph.src, link_src=graph.link_dst,
                         link_dst=graph.link_src, static_memory=static,
                         mem_start=tuple(-x for x in graph.mem_end),
                         mem_end=tuple(-x for x in graph.mem_start))


def backward_pass(graph: TaskGraph, reverse: TaskGraph, priority: list[float],
                  method: str = "backward pass") -> GraphSchedule:
    """The list schedule of ``reverse`` (:func:`reversed_graph` of ``graph``, or of a graph
    with more edges) by ``priority`` (higher first), its device orders read backwards and
    timed on ``graph``. Raises :class:`~pipeopt.core.greedy.Stuck` as the list scheduler."""
    orders = list_schedule(reverse, priority)
    return simulate(graph, [order[::-1] for order in orders], method)


def improve(graph: TaskGraph, schedule: GraphSchedule, *, rounds: int = 10,
            forward: TaskGraph | None = None, reverse: TaskGraph | None = None
            ) -> GraphSchedule:
    """The best of ``schedule`` and of up to ``rounds`` rounds of a backward then a forward
    pass (see the module docstring), stopping at the first round that improves nothing.
    ``forward``: the graph the forward pass list-schedules (default ``graph``; a graph with
    more edges, e.g. admission edges, restricts it); ``reverse``: the backward pass's graph
    (default :func:`reversed_graph` of ``forward``). Schedules over a memory limit or stuck
    passes are skipped; the result's ``method`` says which pass found it."""
    fwd = forward if forward is not None else graph
    rev = reverse if reverse is not None else reversed_graph(fwd)
    best = current = schedule
    for _ in range(rounds):
        found = []
        try:
            back = backward_pass(graph, rev, list(current.end),
                                 f"{schedule.method}, backward pass")
            found.append(back)
            found.append(simulate(graph, list_schedule(fwd, [-x for x in back.start]),
                                  f"{schedule.method}, forward-backward"))
        except Stuck:
            pass
        fits = [s for s in found if not check(s)]
        if not fits:
            break
        step = min(fits, key=lambda s: s.objective)
        if step.objective < best.objective - 1e-12:
            best = step
        if step.objective >= current.objective - 1e-12:
            break
        current = step
    return best


def improve_randomly(graph: TaskGraph, schedule: GraphSchedule, *, trials: int, noise: float,
                     seed: int = 0, deadline: float | None = None,
                     forward: TaskGraph | None = None, reverse: TaskGraph | None = None
                     ) -> GraphSchedule:
    """A seeded local search by forward-backward passes: up to ``trials`` rounds, each a
    backward and a forward pass with every priority moved by a uniform draw in +-``noise``
    seconds; a pass's schedule becomes the current one when it fits memory and is no longer
    (sideways moves cross plateaus). Stops at ``deadline`` (a :func:`time.perf_counter`
    value) if given; the same ``seed`` and enough time give the same schedule. ``forward`` /
    ``reverse`` as for :func:`improve`."""
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 0:
        raise ValueError(f"trials: must be an integer >= 0, got {trials!r}")
    if not noise >= 0:
        raise ValueError(f"noise: must be >= 0 seconds, got {noise!r}")
    fwd = forward if forward is not None else graph
    rev = reverse if reverse is not None else reversed_graph(fwd)
    rng = random.Random(seed)
    best = current = schedule
    for _ in range(trials):
        if deadline is not None and time.perf_counter() > deadline:
            break
        try:
            back = backward_pass(graph, rev, [x + rng.uniform(-noise, noise)
                                              for x in current.end],
                                 f"{schedule.method}, randomized passes")
            ahead = simulate(graph, list_schedule(fwd, [-x + rng.uniform(-noise, noise)
                                                        for x in back.start]),
                             f"{schedule.method}, randomized passes")
        except Stuck:
            continue
        for s in (back, ahead):
            if s.objective <= current.objective + 1e-12 and not check(s):
                current = s
        if current.objective < best.objective - 1e-12:
            best = current
    return best
