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
  and of seeded perturbations of the best list schedules' priorities; then forward-backward
  passes (:func:`pipeopt.core.justify.improve`) from up to :data:`JUSTIFY_STARTS` of them;
  then core CP-SAT from the best, with the time left, when the graph is small enough for it
  to help, else seeded randomized passes (:func:`pipeopt.core.justify.improve_randomly`)
  until the time limit. The reported bound also counts
  :func:`pipeopt.core.bounds.one_machine_bounds`.

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
from pipeopt.core.justify import improve, improve_randomly, reversed_graph
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
#: Candidates (the best distinct ones, best first, time allowing) improved by
#: forward-backward passes (:func:`pipeopt.core.justify.improve`): the best result does not
#: always come from a good start. On benchmarks/moe.py (no CP-SAT) 6 / 12 / 40 starts gave
#: 0.3774 / 0.3747 / 0.3747 s at m = 8, 1x; 0.4945 / 0.4945 / 0.4824 s at m = 8, 2x (from
#: the op-priority greedy); 0.5509 / 0.5489 / 0.5472 s at m = 16, 1x, in 7 / 9 / 15 s.
JUSTIFY_STARTS = 40
#: Randomized forward-backward rounds when CP-SAT does not run (time allowing), priorities
#: moved by up to RANDOM_PASS_NOISE x the mean device task's seconds (about 1.5 ms at
#: p = 8, m = 16; 2 and 6 ms gave 0.6796 and 0.6836 s at 1x within the hand-made memory).
RANDOM_PASS_TRIALS = 100
RANDOM_PASS_NOISE = 0.5

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
    docstring); its ``lower_bound`` is the largest of :func:`pipeopt.core.bounds.lower_bound`,
    :func:`pipeopt.core.bounds.one_machine_bounds` (and CP-SAT's, when it runs) and its
    ``method`` names the candidate it came from and the passes that improved it."""
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    g = wl.build(pipe)
    ga = wl.admitted(g, pipe)
    found: list[GraphSchedule] = []  # every candidate within the memory limits

    def offer(sched: GraphSchedule) -> None:
        if not check(sched):  # else over a memory limit (the simulator does not check it)
            found.append(sched)

    op_prio = wl.op_priority(g, pipe)
    with contextlib.suppress(Stuck):
        offer(simulate(g, list_schedule(g, op_prio), "greedy"))
    bases: list[_Base] = []

    def listed(graph: TaskGraph, prio: list[float], method: str) -> None:
        """List-schedule ``graph`` by ``prio`` and offer the result; a valid one is also kept
        as a base for the perturbation passes."""
        try:
            sched = simulate(g, list_schedule(graph, prio), method)
        except Stuck:
            return
        offer(sched)
        if not check(sched):
            bases.append((sched.objective, sched.method, graph, prio))

    for rule, prio in (("age", wl.age_priority(g, pipe)), ("op", op_prio)):
        listed(ga, prio, f"admitted greedy ({rule} priority)")
    for name in SEARCH_ORDERS:
        try:
            orders = _orders(pipe, name)
        except (NotApplicable, ValueError):
            continue
        offer(simulate(g, wl.task_orders(pipe, orders), name))
        for window in SEARCH_WINDOWS[1:]:
            if time.perf_counter() > deadline:
                break
            gw, prio = wl.windowed(g, pipe, orders, window)
            listed(gw, prio, f"{name}+overlap(window {window})")
    _perturb(g, sorted(bases, key=lambda x: x[0])[:PERTURB_BASES], offer, seed, deadline)
    if not found:
        raise ValueError("search: no candidate schedule fits the memory limits")
    # forward-backward passes from the best distinct candidates, the forward pass on the
    # admitted graph (no stage opens more micro-batches than its memory holds)
    ranked = sorted(found, key=lambda x: x.objective)
    gr = reversed_graph(ga)
    starts: list[GraphSchedule] = []
    for sched in ranked:
        if len(starts) == JUSTIFY_STARTS:
            break
        if all(abs(sched.objective - x.objective) > 1e-12 for x in starts):
            starts.append(sched)
    for sched in starts:
        if time.perf_counter() > deadline:
            break
        found.append(improve(g, sched, forward=ga, reverse=gr))
    best = min(found, key=lambda x: x.objective)
    bound = max(lower_bound(g), *one_machine_bounds(g))
    left = deadline - time.perf_counter()
    if g.num_tasks <= CPSAT_MAX_TASKS and left > 1.0:
        exact = solve_cpsat(g, time_limit=left, workers=workers, seed=seed, initial=best)
        bound = max(bound, exact.lower_bound or 0.0)
        if exact.objective < best.objective - 1e-12:
            best = replace(exact, method=f"cpsat from {best.method}")
    elif left > 0 and best.objective > bound * (1 + 1e-9):
        noise = RANDOM_PASS_NOISE * _mean_device_task(g)
        best = improve_randomly(g, best, trials=RANDOM_PASS_TRIALS, noise=noise, seed=seed,
                                deadline=deadline, forward=ga, reverse=gr)
    tol = 1e-9 * max(1.0, best.objective)
    state = ("optimal" if best.objective <= bound + tol else
             "feasible" if best.method.startswith("cpsat") else "heuristic")
    return replace(best, status=state,
                   lower_bound=min(bound, best.objective),
                   wall_time=time.perf_counter() - t0)


def _mean_device_task(g: TaskGraph) -> float:
    """The mean duration of the tasks on devices (s)."""
    durations = [g.duration[i] for ts in g.device_tasks for i in ts]
    return sum(durations) / max(1, len(durations))


def _perturb(g: TaskGraph, bases: list[_Base], offer: Callable[[GraphSchedule], None],
             seed: int, deadline: float) -> None:
    """Up to :data:`PERTURB_TRIALS` list schedules of the best list-schedule bases with each
    task's priority moved by a uniform draw in +-:data:`PERTURB_OPS` units (op positions, or
    micro-batches for the age priority; seeded: the same ``seed`` gives the same schedules),
    offered until ``deadline``."""
    rng = random.Random(seed)
    for trial in range(PERTURB_TRIALS if bases else 0):
        if time.perf_counter() > deadline:
            return
        _, method, gw, prio = bases[trial % len(bases)]
        noisy = [x + rng.uniform(-PERTURB_OPS, PERTURB_OPS) for x in prio]
        try:
            offer(simulate(g, list_schedule(gw, noisy), f"{method}, perturbed"))
        except Stuck:
            continue
