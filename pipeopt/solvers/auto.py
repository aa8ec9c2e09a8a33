"""``auto``: the best schedule among the hand-made ones and the searches that fit the budget."""

from __future__ import annotations

import importlib
import time
from dataclasses import replace

from pipeopt.problem import Problem
from pipeopt.schedule import Schedule
from pipeopt.schedules import GENERATORS, NotApplicable
from pipeopt.solvers import SolveOptions, fits_memory, lower_bound, run_classic


def best_classic(problem: Problem, objective: str = "makespan") -> Schedule | None:
    """The best hand-made schedule that keeps the memory limits, or None if none does."""
    best: Schedule | None = None
    for name in GENERATORS:
        try:
            sched = run_classic(problem, name)
        except NotApplicable:
            continue
        if not fits_memory(sched, problem):
            continue
        val = sched.max_span if objective == "span" else sched.iteration_time
        if best is None or val < (best.max_span if objective == "span" else best.iteration_time):
            best = sched
    return best


def solve_auto(problem: Problem, options: SolveOptions) -> Schedule:
    """Best of: every hand-made schedule that fits, then ``greedy`` and ``cpsat`` when they are
    available. Never worse than the best hand-made schedule under the same limits."""
    t0 = time.perf_counter()
    cands: list[Schedule] = []
    classic = best_classic(problem, options.objective)
    if classic is not None:
        cands.append(classic)
    for module, func in (("pipeopt.solvers.greedy", "solve_greedy"),
                         ("pipeopt.solvers.cpsat", "solve_cpsat")):
        try:
            fn = getattr(importlib.import_module(module), func)
        except (ImportError, AttributeError):
            continue
        hint = min(cands, key=lambda s: s.objective_value) if cands else None
        remaining = max(1.0, options.time_limit - (time.perf_counter() - t0))
        try:
            cands.append(fn(problem, replace(options, time_limit=remaining, hint=hint)))
        except NotApplicable:
            continue
    if not cands:
        raise NotApplicable("auto: no method found a schedule within the memory limits")

    def key(s: Schedule) -> float:
        return s.max_span if options.objective == "span" else s.iteration_time

    best = min(cands, key=key)
    bound = max([lower_bound(problem, options.objective)]
                + [s.solver.lower_bound for s in cands
                   if s.solver.lower_bound is not None and s.solver.objective ==
                   options.objective])
    status = best.solver.status
    if status != "optimal" and bound >= key(best) * (1 - 1e-9):
        status = "optimal"
    info = replace(best.solver, lower_bound=bound, status=status,
                   wall_time=time.perf_counter() - t0, objective=options.objective,
                   details=(*best.solver.details, ("chosen", best.method)))
    return replace(best, method=f"auto:{best.method}", solver=info)


