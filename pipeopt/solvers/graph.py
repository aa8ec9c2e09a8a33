"""The methods over a task-graph workload (data parallelism with scheduled collectives, MoE):
hand-made schedules, ``greedy``, ``cpsat`` and ``auto`` on the core, all judged by the core
validator.

A workload is anything with the :class:`GraphWorkload` shape: the graph the searches run on,
the names of its hand-made schedules and, per name, the graph and device orders that schedule
runs (a hand-made schedule may run on a variant of the graph, e.g. 1F1B with a fused
backward), and the names of its own searches with the hook that runs one (the MoE pipeline's
``search``; none for data parallelism). Hand-made orders are timed by
:func:`pipeopt.core.simulate.simulate`, which starts every collective as early as its inputs
and its resources allow (what Megatron does).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar, Protocol

from pipeopt.core.bounds import lower_bound
from pipeopt.core.cpsat import solve_cpsat
from pipeopt.core.graph import TaskGraph
from pipeopt.core.greedy import Stuck, solve_greedy
from pipeopt.core.justify import improve, reversed_graph
from pipeopt.core.schedule import GraphSchedule
from pipeopt.core.simulate import simulate
from pipeopt.core.validate import InvalidSchedule, check, validate
from pipeopt.schedules import NotApplicable
from pipeopt.workloads.dataparallel import iteration_time, iterations_of

#: The searches every graph workload has, beside its hand-made schedules.
SEARCHES: tuple[str, ...] = ("greedy", "cpsat", "auto")
#: Of ``cpsat`` / ``auto``'s time limit, at most this share goes to forward-backward passes
#: over their starts before CP-SAT (examples/dp_cross_dc.yaml: zb-h1:pipelined 4.3333 ->
#: 4.2824 s in 0.4 s, shorter than the 4.2887 s CP-SAT reached from it in 17 s; 2026-12-03).
JUSTIFY_SHARE = 0.25


class UnknownGraphMethod(ValueError):
    """A method name the workload does not have (the message lists those it has)."""


class GraphWorkload(Protocol):
    """What :func:`solve_graph` needs from a workload (see the module docstring)."""

    @property
    def graph(self) -> TaskGraph: ...

    @property
    def hand_made(self) -> tuple[str, ...]: ...

    #: The workload's own searches (may be empty), run by :meth:`search`.
    searches: ClassVar[tuple[str, ...]]

    def hand_made_orders(self, name: str) -> tuple[TaskGraph, list[list[int]]]: ...

    def search(self, name: str, *, time_limit: float, seed: int = 0,
               workers: int | None = None) -> GraphSchedule:
        """Run own search ``name`` on :attr:`graph` within ``time_limit`` seconds."""
        ...


def graph_methods(work: GraphWorkload) -> tuple[str, ...]:
    """The method names of ``work``: its hand-made schedules, its own searches, then
    :data:`SEARCHES`."""
    return (*work.hand_made, *work.searches, *SEARCHES)


def check_graph_method(work: GraphWorkload, name: str) -> None:
    """Raise :class:`UnknownGraphMethod` naming the known methods when ``name`` is not one."""
    if name not in graph_methods(work):
        raise UnknownGraphMethod(f"unknown method {name!r} for this task-graph workload; known: "
                            f"{', '.join(graph_methods(work))}")


def _hand_made(work: GraphWorkload, name: str) -> GraphSchedule:
    t0 = time.perf_counter()
    graph, orders = work.hand_made_orders(name)
    sched = simulate(graph, orders, name)
    return replace(sched, lower_bound=lower_bound(graph), wall_time=time.perf_counter() - t0)


def solve_graph(work: GraphWorkload, method: str, *, time_limit: float = 10.0, seed: int = 0,
                workers: int | None = None, resolution: float | None = None) -> GraphSchedule:
    """Run ``method`` on ``work`` and validate the result (seconds, bytes).

    A name of the workload's own searches runs it (``work.search``). ``cpsat`` starts from the
    best hand-made schedule that runs on the search's graph (or the greedy, whichever is
    shorter); ``auto`` runs every hand-made schedule, then the workload's own searches (half
    the time left, shared equally), then ``cpsat`` from the best of them on the search's graph
    for the time left, and returns the shortest that fits the memory limits. Both first run
    forward-backward passes (:func:`pipeopt.core.justify.improve`) from their starts on the
    search's graph, within :data:`JUSTIFY_SHARE` of the time limit. Raises
    :class:`UnknownGraphMethod`, :class:`NotApplicable` (a hand-made schedule that does not
    fit the workload, an own search that found nothing), or :class:`InvalidSchedule`."""
    check_graph_method(work, method)
    if not (time_limit > 0 and math.isfinite(time_limit)):
        raise ValueError(f"time_limit: must be a positive number of seconds, got {time_limit}")
    t0 = time.perf_counter()
    if method in work.hand_made:
        return validate(_hand_made(work, method))
    if method in work.searches:
        return validate(work.search(method, time_limit=time_limit, seed=seed, workers=workers))
    if method == "greedy":
        try:
            return validate(solve_greedy(work.graph))
        except Stuck as exc:
            raise NotApplicable(f"greedy: {exc}") from None
    starts: list[GraphSchedule] = []
    names = work.hand_made if method == "auto" else ()
    for name in work.hand_made:
        try:
            graph, _ = work.hand_made_orders(name)
        except NotApplicable:
            continue
        if name in names or graph == work.graph:
            sched = _hand_made(work, name)
            if not check(sched):
                starts.append(sched)
    if method == "auto" and work.searches:
        share = max(0.01, time_limit - (time.perf_counter() - t0)) / 2 / len(work.searches)
        for name in work.searches:
            try:
                sched = work.search(name, time_limit=share, seed=seed, workers=workers)
            except NotApplicable:
                continue
            if not check(sched):
                starts.append(sched)
    starts += _justified(work.graph, [s for s in starts if s.graph == work.graph],
                         t0 + JUSTIFY_SHARE * time_limit)
    same = [s for s in starts if s.graph == work.graph]
    hint = min(same, key=lambda s: s.objective, default=None)
    left = max(0.01, time_limit - (time.perf_counter() - t0))
    best = solve_cpsat(work.graph, time_limit=left, resolution=resolution, workers=workers,
                       seed=seed, initial=hint)
    if method == "auto":
        if any(s.objective < best.objective - 1e-12 for s in starts):
            won = min(starts, key=lambda s: s.objective)
            # its own graph's bound: CP-SAT's holds for the search's graph only
            bound = won.lower_bound
            if won.graph == work.graph:  # both bounds hold for it: the larger
                bound = max((b for b in (bound, best.lower_bound) if b is not None),
                            default=None)
            best = replace(won, method=f"auto:{won.method}", lower_bound=bound)
        else:
            best = replace(best, method=f"auto:{best.method}")
        best = replace(best, wall_time=time.perf_counter() - t0)
    return validate(best)


def _justified(graph: TaskGraph, starts: list[GraphSchedule], deadline: float
               ) -> list[GraphSchedule]:
    """Each of ``starts`` (schedules of ``graph``) after forward-backward passes
    (:func:`pipeopt.core.justify.improve`), best start first, until ``deadline``; only those
    it shortened. None when a task has a tail (no mirror image of the objective)."""
    if any(graph.tail) or not starts:
        return []
    reverse = reversed_graph(graph)
    out = []
    for sched in sorted(starts, key=lambda x: x.objective):
        if time.perf_counter() > deadline:
            break
        better = improve(graph, sched, reverse=reverse)
        if better.objective < sched.objective - 1e-12:
            out.append(better)
    return out


@dataclass(frozen=True)
class GraphRow:
    """One method's result in :func:`compare_graph` (``schedule`` None: it failed, ``error``
    says why). ``value``: seconds per iteration (:func:`iteration_time`); ``ratio``: value /
    the best value among the rows that fit memory."""

    method: str
    schedule: GraphSchedule | None
    error: str | None = None
    fits: bool = True
    ratio: float | None = None

    @property
    def value(self) -> float | None:
        """Seconds per iteration (makespan / iterations), or None without a schedule."""
        return None if self.schedule is None else iteration_time(self.schedule)

    def to_dict(self) -> dict[str, object]:
        """The row as JSON-able data."""
        s = self.schedule
        return {"method": self.method, "iteration_time": self.value, "ratio": self.ratio,
                "makespan": None if s is None else s.makespan,
                "iterations": None if s is None else iterations_of(s.graph),
                "peak_memory": None if s is None else max(s.peak_memory, default=0.0),
                "fits": self.fits, "status": None if s is None else s.status,
                "error": self.error}


def compare_graph(work: GraphWorkload, methods: Sequence[str] | None = None, *,
                  time_limit: float = 10.0, seed: int = 0,
                  workers: int | None = None) -> list[GraphRow]:
    """Every method of ``work`` but ``auto`` (or ``methods``), each timed and checked;
    hand-made schedules that break a memory limit are kept with ``fits`` False; ratios
    against the best that fits (seconds per iteration)."""
    names = list(methods) if methods is not None else [*work.hand_made, *work.searches,
                                                        "greedy", "cpsat"]
    for name in names:
        check_graph_method(work, name)
    rows: list[GraphRow] = []
    for name in names:
        try:
            if name in work.hand_made:
                sched = _hand_made(work, name)
                found = check(sched)
                if found and not all("memory" in v for v in found):
                    raise InvalidSchedule(f"{name}: {found[0]}", found)
                rows.append(GraphRow(name, sched, fits=not found))
            else:
                rows.append(GraphRow(name, solve_graph(work, name, time_limit=time_limit,
                                                       seed=seed, workers=workers)))
        except (NotApplicable, InvalidSchedule, ValueError) as exc:
            rows.append(GraphRow(name, None, error=str(exc), fits=False))
    best = min((r.value for r in rows if r.fits and r.value is not None), default=None)
    return [replace(r, ratio=None if best is None or r.value is None or best <= 0
                    else r.value / best) for r in rows]
