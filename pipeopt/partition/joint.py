"""Joint search: schedule the top-k partitions with a real solver and keep the best.

The DP ranks partitions by an analytic pipeline formula; the real schedule also depends on the
split of each stage's time into F, B and W, on memory limits and on link delays. So the best few
partitions (plus the uniform one, as a baseline) are each turned into a
:class:`~pipeopt.problem.Problem` and scheduled; the one with the smallest iteration time wins.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeopt.partition import ChainCosts, Partition, PartitionError
from pipeopt.partition.dp import top_partitions
from pipeopt.problem import Problem
from pipeopt.schedule import Schedule
from pipeopt.schedules import NotApplicable


@dataclass(frozen=True)
class JointRow:
    """One candidate: its partition, analytic objective and schedule (or why none)."""

    partition: Partition
    analytic: float
    schedule: Schedule | None
    error: str | None = None

    @property
    def value(self) -> float:
        """Iteration time of its schedule (seconds); inf without one."""
        return self.schedule.iteration_time if self.schedule is not None else float("inf")


@dataclass(frozen=True)
class JointResult:
    """The winner and every candidate tried (in the order tried)."""

    partition: Partition
    schedule: Schedule
    rows: tuple[JointRow, ...]
    method: str
    wall_time: float


def default_method() -> str:
    """``greedy`` when that solver is installed, else ``classic`` (best hand-made schedule)."""
    return "greedy" if importlib.util.find_spec("pipeopt.solvers.greedy") else "classic"


def schedule_with(problem: Problem, method: str, time_limit: float) -> Schedule:
    """Schedule ``problem`` with ``method``; ``classic`` = the best hand-made schedule that
    keeps the memory limits."""
    if method == "classic":
        from pipeopt.solvers.auto import best_classic

        sched = best_classic(problem)
        if sched is None:
            raise NotApplicable("no hand-made schedule keeps the memory limits")
        return sched
    from pipeopt.solvers import solve

    return solve(problem, method, time_limit=time_limit, workers=1)


def joint_search(costs: ChainCosts, build: Callable[[Partition], Problem], *, top_k: int = 4,
                 objective: str = "pipeline", method: str | None = None,
                 time_limit: float = 5.0, extra: list[Partition] | None = None) -> JointResult:
    """Schedule the ``top_k`` analytic best partitions (plus ``extra``, e.g. the uniform one)
    with ``method`` and return the best by iteration time."""
    t0 = time.perf_counter()
    method = method or default_method()
    cands = top_partitions(costs, top_k, objective)
    seen = {p for p, _ in cands}
    from pipeopt.partition import evaluate

    for part in extra or []:
        if part not in seen:
            ev = evaluate(costs, part)
            if ev.fits:
                cands.append((part, ev))
                seen.add(part)
    rows: list[JointRow] = []
    from pipeopt.solvers import UnknownMethod

    for part, ev in cands:
        try:
            sched = schedule_with(build(part), method, time_limit)
            rows.append(JointRow(part, ev.objective, sched))
        except (NotApplicable, UnknownMethod) as exc:
            rows.append(JointRow(part, ev.objective, None, str(exc)))
    ok = [r for r in rows if r.schedule is not None]
    if not ok:
        why = rows[0].error if rows else "no partition fits in memory"
        raise PartitionError(f"joint partition search: no candidate could be scheduled with "
                             f"{method!r}: {why}")
    best = min(ok, key=lambda r: r.value)
    assert best.schedule is not None
    return JointResult(best.partition, best.schedule, tuple(rows), method,
                       time.perf_counter() - t0)
