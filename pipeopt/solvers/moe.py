"""Schedules of an MoE pipeline's task graph (:mod:`pipeopt.workloads.moe`): hand-made ones with
and without overlapping the all-to-all, and the search.

* :func:`hand_made` without overlap: a chain schedule's op order (1F1B, ZB-H1, ...) with each
  op's tasks back to back, so a device waits for its own dispatch and combine (Megatron-style
  execution); the all-to-all tasks run as early as allowed (core simulator).
* :func:`hand_made` with overlap: the same op order, but a device may run the next
  ``window - 1`` ops' ready tasks while an op waits on its all-to-all (a list schedule by op
  position over :func:`pipeopt.workloads.moe.windowed`'s graph; ``window = 2`` pairs each op
  with the next, as DualPipe overlaps a forward chunk with a backward chunk).
* :func:`search`: the best of the core greedy by op priority
  (:func:`pipeopt.workloads.moe.op_priority`), of the greedy on the graph with admission edges
  (:func:`pipeopt.workloads.moe.admitted`: no stage opens more micro-batches than its memory
  holds) by age and by op priority, and of windowed list schedules of several hand-made
  orders (1F1B, ZB-H1, ZB-H2, GPipe) with windows 1-6, within the pipeline's memory limits,
  and of seeded perturbations of the best list schedules' priorities; then core CP-SAT from
  the best, with the time left, when the graph is small enough for it to help, else a seeded
  local search over the best one's op priorities (:func:`_descend`) until the time limit.
  The reported bound also counts :func:`pipeopt.core.bounds.one_machine_bounds`.

Every schedule is a :class:`~pipeopt.core.schedule.GraphSchedule` of
:func:`pipeopt.workloads.moe.build`'s graph, checked by :func:`pipeopt.core.validate.check`.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import replace

from pipeopt.core.bounds import lower_bound, one_machine_bounds
from pipeopt.core.cpsat import solve_cpsat
from pipeopt.core.graph import TaskGraph
from pipeopt.core.greedy import Stuck, list_schedule
from pipeopt.core.schedule import GraphSchedule
from pipeopt.core.simulate import simulate
from pipeopt.core.validate import check
from pipeopt.problem import Op
from pipeopt.schedules import GENERATORS
from pipeopt.schedules.base import NotApplicable
from pipeopt.workloads import moe as wl

#: Hand-made op orders the search starts from (each needs a split backward but 1F1B / GPipe).
SEARCH_ORDERS = ("zb-h1", "zb-h2", "1f1b", "gpipe")
#: Windows tried per order: 1 (no overlap) up to 6 ops open at once on a device.
SEARCH_WINDOWS = (1, 2, 3, 4, 6)
#: Perturbed list schedules tried after the portfolio (time allowing), from the best few
#: windowed ones, each task's priority moved by up to PERTURB_OPS op positions: on
#: benchmarks/moe.py at 1x they took the search from 0.7100 to 0.7013 s within the hand-made
#: memory and from 0.5562 to 0.5555 s within the GPU's (2026-12-03).
PERTURB_TRIALS = 48
PERTURB_BASES = 3
PERTURB_OPS = 1.5
#: CP-SAT is run from the best list schedule only on graphs up to this many tasks: on larger
#: ones it found nothing better within 30 s, its presolve alone taking 12 s (p = 8, m = 16:
#: 1408 tasks, 2 workers on a shared 2-core machine, 2026-12-03); on a 0.2 ms grid, 40 s took
#: the search's 0.5555 s to 0.5543 s.
CPSAT_MAX_TASKS = 1000
#: Moves of the local search over the best list schedule's priorities (:func:`_descend`),
#: each shifting 1-3 ops by up to DESCENT_OPS units; about 30 ms each at p = 8, m = 16.
DESCENT_TRIALS = 300
DESCENT_OPS = 2.0

#: A list schedule the search may start from: (objective s, method, graph, priority).
_Base = tuple[float, str, TaskGraph, list[float]]


def _orders(pipe: wl.MoEPipeline, name: str) -> list[list[Op]]:
    if name not in GENERATORS:
        raise ValueError(f"schedule: unknown hand-made schedule {name!r}; known: "
                         f"{', '.join(sorted(GENERATORS))}")
    return GENERATORS[name](pipe.problem())


def hand_made(pipe: wl.MoEPipeline, name: str, *, overlap: bool = False, window: int = 2,
              graph: TaskGraph | None = None) -> GraphSchedule:
    """The hand-made schedule ``name`` (a :data:`pipeopt.schedules.GENERATORS` name) on
    ``pipe``'s graph (``graph``: that graph, when already built), with or without the
    all-to-all overlapped (see the module docstring). Raises ValueError for an unknown name or
    one that does not apply, :class:`~pipeopt.core.greedy.Stuck` when the overlapped list
    schedule is stuck under memory."""
    g = graph if graph is not None else wl.build(pipe)
    try:
        orders = _orders(pipe, name)
    except NotApplicable as exc:
        raise ValueError(f"schedule: {name} does not apply: {exc}") from None
    if not overlap:
        return simulate(g, wl.task_orders(pipe, orders), name)
    gw, prio = wl.windowed(g, pipe, orders, window)
    return simulate(g, list_schedule(gw, prio), f"{name}+overlap")


def search(pipe: wl.MoEPipeline, *, time_limit: float = 30.0, workers: int | None = None,
           seed: int = 0) -> GraphSchedule:
    """The best schedule found for ``pipe`` within ``time_limit`` seconds (see the module
    docstring); its ``lower_bound`` is :func:`pipeopt.core.bounds.lower_bound` (or CP-SAT's,
    when larger) and its ``method`` names the candidate it came from."""
    t0 = time.perf_counter()
    g = wl.build(pipe)
    best: GraphSchedule | None = None

    def offer(sched: GraphSchedule) -> None:
        nonlocal best
        if check(sched):
            return  # over a memory limit (the simulator does not check memory)
        if best is None or sched.objective < best.objective - 1e-12:
            best = sched

    op_prio = wl.op_priority(g, pipe)
    with contextlib.suppress(Stuck):
        offer(simulate(g, list_schedule(g, op_prio), "greedy"))
    windowed: list[_Base] = []
    ga = wl.admitted(g, pipe)
    for rule, prio in (("age", wl.age_priority(g, pipe)), ("op", op_prio)):
        try:
            sched = simulate(g, list_schedule(ga, prio), f"admitted greedy ({rule} priority)")
        except Stuck:
            continue
        offer(sched)
        if not check(sched):
            windowed.append((sched.objective, sched.method, ga, prio))
    for name in SEARCH_ORDERS:
        try:
            orders = _orders(pipe, name)
        except (NotApplicable, ValueError):
            continue
        offer(simulate(g, wl.task_orders(pipe, orders), name))
        for window in SEARCH_WINDOWS[1:]:
            if time.perf_counter() - t0 > time_limit:
                break
            gw, prio = wl.windowed(g, pipe, orders, window)
            try:
                sched = simulate(g, list_schedule(gw, prio), f"{name}+overlap(window {window})")
            except Stuck:
                continue
            offer(sched)
            if not check(sched):
                windowed.append((sched.objective, sched.method, gw, prio))
    bases = sorted(windowed, key=lambda x: x[0])[:PERTURB_BASES]
    start = _perturb(g, bases, offer, seed, t0 + time_limit)
    if start is not None and g.num_tasks > CPSAT_MAX_TASKS:
        # CP-SAT makes better use of the time on the graphs it takes (p = 8, m = 8: 0.374 s
        # from the best list schedule against 0.382 s with half the time spent here first)
        _descend(g, pipe, start, offer, seed, t0 + time_limit)
    if best is None:
        raise ValueError("search: no candidate schedule fits the memory limits")
    bound = max(lower_bound(g), *one_machine_bounds(g))
    left = time_limit - (time.perf_counter() - t0)
    if g.num_tasks <= CPSAT_MAX_TASKS and left > 1.0:
        found = solve_cpsat(g, time_limit=left, workers=workers, seed=seed, initial=best)
        bound = max(bound, found.lower_bound or 0.0)
        if found.objective < best.objective - 1e-12:
            best = replace(found, method=f"cpsat from {best.method}")
    tol = 1e-9 * max(1.0, best.objective)
    state = ("optimal" if best.objective <= bound + tol else
             "feasible" if best.method.startswith("cpsat") else "heuristic")
    return replace(best, status=state,
                   lower_bound=min(bound, best.objective),
                   wall_time=time.perf_counter() - t0)


def _perturb(g: TaskGraph, bases: list[_Base], offer: Callable[[GraphSchedule], None],
             seed: int, deadline: float) -> _Base | None:
    """Up to :data:`PERTURB_TRIALS` list schedules of the best windowed graphs with each
    task's priority moved by a uniform draw in +-:data:`PERTURB_OPS` op positions (seeded:
    the same ``seed`` gives the same schedules), offered until ``deadline``; returns the best
    of ``bases`` and of the perturbed ones that fit memory (None without bases)."""
    rng = random.Random(seed)
    best = min(bases, key=lambda x: x[0], default=None)
    for trial in range(PERTURB_TRIALS if bases else 0):
        if time.perf_counter() > deadline:
            break
        _, method, gw, prio = bases[trial % len(bases)]
        noisy = [x + rng.uniform(-PERTURB_OPS, PERTURB_OPS) for x in prio]
        try:
            sched = simulate(g, list_schedule(gw, noisy), f"{method}, perturbed")
        except Stuck:
            continue
        offer(sched)
        if best is not None and not check(sched) and sched.objective < best[0] - 1e-12:
            best = (sched.objective, sched.method, gw, noisy)
    return best


def _descend(g: TaskGraph, pipe: wl.MoEPipeline, start: _Base,
             offer: Callable[[GraphSchedule], None], seed: int, deadline: float) -> None:
    """A seeded local search over the priorities of ``start``'s list schedule: up to
    :data:`DESCENT_TRIALS` moves, each shifting all tasks of 1 to 3 random ops (a stage's
    forward, backward or W of one micro-batch) by a uniform draw in +-:data:`DESCENT_OPS`
    priority units (op positions, or micro-batches for :func:`~pipeopt.workloads.moe.
    age_priority`), kept when the schedule fits memory and is no longer (sideways moves
    are kept too: they let the search cross plateaus), until ``deadline``."""
    rng = random.Random(seed + 1)
    ops = wl.op_groups(pipe)
    value, method, gw, prio = start
    for _ in range(DESCENT_TRIALS):
        if time.perf_counter() > deadline:
            return
        trial = list(prio)
        for _ in range(rng.randint(1, 3)):
            shift = rng.uniform(-DESCENT_OPS, DESCENT_OPS)
            for t in rng.choice(ops):
                trial[t] += shift
        try:
            sched = simulate(g, list_schedule(gw, trial), f"{method}, descent")
        except Stuck:
            continue
        if check(sched) or sched.objective > value + 1e-12:
            continue
        offer(sched)
        value, prio = sched.objective, trial
