"""``cpsat``: an exact schedule search with OR-Tools CP-SAT.

The model itself lives in :mod:`pipeopt.solvers.cpsat_model` and the float-to-integer grids in
:mod:`pipeopt.solvers.cpsat_grid`. This module prepares the data, warm-starts the search from the
best heuristic schedule, runs the solver (Ctrl-C stops it and keeps the best schedule so far) and
turns its answer into a :class:`~pipeopt.schedule.Schedule` with an honest status and a proven
lower bound:

* the solver's per-device orders are re-timed exactly (in floats) by the simulator; on an exact
  grid the solver's own timing is kept instead when it is better (serialized links, span);
* the bound combines the analytic bounds, the caller's proven ``options.known_bound`` (``auto``'s
  relaxation / kept-devices bounds) and CP-SAT's bound, which is proven for the real
  problem because durations and delays are rounded *down* on the time grid (any real schedule,
  floored, is a solution of the model);
* memory demands are rounded *up* when they sit on no exact grid, so the orders keep the real
  limits; CP-SAT's bound then proves nothing and only the analytic bound is reported;
* ``optimal`` only when the schedule meets that proven bound (no search at all when the warm
  start already does; the caller's known bound ends the search as soon as a schedule meets it:
  on an exact time grid it is the model's objective floor, so CP-SAT proves optimality there;
  LNS compares the re-timed schedules against it).
"""

from __future__ import annotations

import importlib
import logging
import math
import signal
import threading
import time
from collections import defaultdict
from dataclasses import replace
from typing import Any

from ortools.sat.python import cp_model

from pipeopt.bounds import iteration_lower_bound
from pipeopt.problem import Op, Problem
from pipeopt.schedule import Message, Schedule, SolverInfo, TimedOp
from pipeopt.schedules import GENERATORS, NotApplicable
from pipeopt.simulate import ScheduleError, check, simulate
from pipeopt.solvers import lns
from pipeopt.solvers.base import (
    MAX_MODEL_OPS,
    Progress,
    SolveOptions,
    above,
    checked_known_bound,
    fits_memory,
    known_bound_ignored,
    lower_bound,
    run_classic,
)
from pipeopt.solvers.base import require_memory as _require_memory
from pipeopt.solvers.cpsat_grid import Grid, memory_grid, time_grid
from pipeopt.solvers.cpsat_model import (
    IntData,
    ScheduleModel,
    add_hints,
    build_model,
    edges,
    topological_ops,
)
from pipeopt.subblocks import expand_orders, merge
from pipeopt.workloads.training import ChainGraph, chain_graph

logger = logging.getLogger("pipeopt.cpsat")
logger.addHandler(logging.NullHandler())

#: Share of the time limit the greedy warm start may use.
_GREEDY_SHARE = 0.1
#: Most time units from 0 to the horizon: CP-SAT's integers are 64-bit, and sums of durations
#: must not overflow them.
MAX_HORIZON_UNITS = 10**15
#: Largest instance (ops) whose full model gets the whole time limit; above it the full model
#: gets :data:`FULL_MODEL_SHARE` of it and large-neighbourhood search (:mod:`lns`) the rest.
#: Measured (``auto``'s notes, 2 cores): at 384 ops the full model proves optimality in
#: 0.1-11 s; at 768 ops it improved the greedy by 0.3 % in 10 s, at 1536-3072 ops by 0-0.2 %
#: in 10-30 s, and at p = 16, m = 64 (3072 ops) not at all in 60 s (issue 12).
FULL_MODEL_OPS = 600
#: Share of the time left that the full model gets above :data:`FULL_MODEL_OPS`.
FULL_MODEL_SHARE = 1 / 3
#: The least time (seconds) worth a round of large-neighbourhood search after the full model.
LNS_MIN_TIME_S = 0.5


def solve_cpsat(problem: Problem, options: SolveOptions, *,
                full_model_share: float | None = None) -> Schedule:
    """Search for the schedule minimising ``options.objective`` (see the module docstring).

    The full model runs first, for ``full_model_share`` of the time left (None: all of it up to
    :data:`FULL_MODEL_OPS` ops, else :data:`FULL_MODEL_SHARE`; 0: skipped); then, unless it
    proved optimality, large-neighbourhood search (:mod:`pipeopt.solvers.lns`) improves its best
    schedule until the time limit.

    Raises :class:`~pipeopt.schedules.NotApplicable` when no schedule fits the memory limits.
    """
    t0 = time.perf_counter()
    objective = options.objective
    if objective not in ("makespan", "span"):
        raise ValueError(f"objective: must be 'makespan' or 'span', got {objective!r}")
    require_memory(problem)
    if problem.num_ops > MAX_MODEL_OPS:
        return _fallback(problem, options, t0)
    warm, warm_interrupted = warm_start(problem, options)
    analytic = lower_bound(problem, objective)
    if objective == "makespan":
        analytic = max(analytic, iteration_lower_bound(problem))  # with gradient reductions
    known = _known_bound(options, warm)
    proven = max(analytic, known)  # every bound below is proven for the real problem
    workers = options.workers or _cpu_count()
    tgrid = time_grid(_time_values(problem), options.resolution)

    def warm_only(why: str, interrupted: bool) -> Schedule:
        return _result(warm, "warm start", proven, objective, t0, options, (
            ("resolution_s", tgrid.unit), ("time_grid_exact", tgrid.exact),
            ("cpsat_status", why), ("warm_start", warm.method), ("num_workers", workers),
            *_known_details(options)), interrupted=interrupted)

    if warm_interrupted:  # Ctrl-C while the warm start ran: keep it, search no further
        return warm_only("SKIPPED (interrupted)", True)
    if _objective(warm, objective) <= proven * (1 + 1e-9):
        # The warm start meets a proven bound: it is optimal, no search needed.
        return warm_only("SKIPPED", False)

    horizon = _horizon(problem, warm, tgrid, objective)
    if horizon > MAX_HORIZON_UNITS:
        # CP-SAT works with 64-bit integers; a grid this fine cannot even state the horizon.
        coarsest = _objective(warm, objective) / MAX_HORIZON_UNITS
        raise NotApplicable(f"solver.resolution: {tgrid.unit:g} s per unit is too fine for this "
                            f"problem ({horizon:.3g} units to its horizon, at most "
                            f"{MAX_HORIZON_UNITS:.0e}); use at least {coarsest:.3g} s, or leave "
                            "it unset to have it chosen")
    try:
        data, mem_exact = int_data(problem, tgrid)
        # On an exact time grid every model solution is a real schedule of the same value (a
        # restriction on memory keeps that true), so the proven bounds hold in the model too,
        # and CP-SAT proves optimality as soon as a solution meets them. On an inexact grid the
        # floored durations let model values fall below them: no floor there.
        lower = tgrid.up(proven * (1 - 1e-9)) if tgrid.exact else 0
        sm = build_model(data, objective, horizon, lower)
        starts_u, msgs_u = _hint_units(warm, tgrid, sm)
        add_hints(sm, starts_u, msgs_u)
    except KeyboardInterrupt:  # Ctrl-C while the model was built: the warm start is the best
        return warm_only("SKIPPED (interrupted)", True)

    def bound_s(units: float) -> float:
        """A proven bound in seconds from the model's bound in units."""
        if not mem_exact:
            return proven  # the model is a restriction on memory: its bound proves nothing
        b = math.ceil(units - 1e-6)  # the objective is an integer
        if objective == "span" and not tgrid.exact:
            b -= 1  # floored start and end can stretch a span by one unit
        return max(proven, tgrid.seconds(b))

    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.num_workers = workers
    if full_model_share is None:
        full_model_share = 1.0 if problem.num_ops <= FULL_MODEL_OPS else FULL_MODEL_SHARE
    left = options.time_limit - (time.perf_counter() - t0)
    prm.max_time_in_seconds = max(0.01, full_model_share * left)
    prm.relative_gap_limit = options.relative_gap
    prm.random_seed = options.seed
    prm.catch_sigint_signal = False  # our own handler stops the search and keeps the best
    prm.log_search_progress = options.log
    prm.log_to_stdout = False
    if options.log:
        solver.log_callback = lambda line: logger.info("%s", line)
    meets = None
    if known > analytic and not tgrid.exact:
        # The bound is not in the model here (see ``lower``): each solution's orders are
        # re-timed (the simulator's value is the real one) and the search stops at one that
        # meets it.
        def meets(sol: cp_model.CpSolverSolutionCallback) -> bool:
            try:
                found = _solution_schedules(problem, sm, sol, tgrid)
            except ScheduleError:
                return False
            return min(_objective(c, objective) for c, _ in found) <= proven * (1 + 1e-9)

    cb = _ProgressCallback(t0, tgrid, bound_s, options, meets)
    if options.on_progress is not None:
        solver.best_bound_callback = cb.on_bound  # the bound moves between solutions too
    if full_model_share > 0:
        status, interrupted = _solve_interruptible(solver, sm.model, cb)
    else:
        status, interrupted = cp_model.UNKNOWN, False

    cands: list[tuple[Schedule, str]] = []
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        cands.extend(_solution_schedules(problem, sm, solver, tgrid))
    cands.append((warm, "warm start"))
    best, timing = min(cands, key=lambda c: lns.key(c[0], objective))

    lb = proven
    if status not in (cp_model.INFEASIBLE, cp_model.MODEL_INVALID, cp_model.UNKNOWN):
        lb = max(lb, bound_s(solver.best_objective_bound))
    lns_details: tuple[tuple[str, Any], ...] = ()
    deadline = t0 + options.time_limit
    if (status != cp_model.OPTIMAL and not interrupted
            and _objective(best, objective) > lb * (1 + 1e-9)
            and deadline - time.perf_counter() >= LNS_MIN_TIME_S):
        found = _run_lns(problem, sm, tgrid, best, lb, options, t0, deadline)
        if found.improvements:
            best, timing = found.schedule, "lns"
        interrupted = found.interrupted
        lns_details = (("lns_windows", found.windows), ("lns_improvements", found.improvements),
                       ("lns_restarts", found.restarts))
    details: list[tuple[str, Any]] = [
        ("resolution_s", tgrid.unit), ("time_grid_exact", tgrid.exact),
        ("memory_grid_exact", mem_exact), ("num_workers", workers),
        ("cpsat_status", solver.status_name(status) if full_model_share > 0 else "SKIPPED"),
        *((("cpsat_wall_time", solver.wall_time), ("branches", solver.num_branches),
           ("conflicts", solver.num_conflicts)) if full_model_share > 0 else ()),
        ("warm_start", warm.method), ("warm_start_objective", _objective(warm, objective)),
        ("horizon_units", horizon), ("full_model_share", full_model_share), *lns_details,
        *_known_details(options),
    ]
    if above(known, _objective(best, objective)):
        # The caller's bound is above a real schedule: it was no lower bound. CP-SAT's own
        # bound held it as the model's floor, so only the analytic bound is left.
        lb = analytic
        details.append(known_bound_ignored(known, objective, _objective(best, objective)))
    return _result(best, timing, lb, objective, t0, options, tuple(details), interrupted)


def solve_lns(problem: Problem, options: SolveOptions) -> Schedule:
    """:func:`solve_cpsat` without the full model: large-neighbourhood search from the warm
    start (``options.hint`` or the best heuristic) for the whole time limit (method
    ``cpsat``, ``details['timing'] == 'lns'`` when it improved the start)."""
    return solve_cpsat(problem, options, full_model_share=0.0)


def _known_bound(options: SolveOptions, warm: Schedule) -> float:
    """The caller's proven bound (0 when none), refused (:class:`ConfigError` naming
    ``known_bound``) when the warm start, a real schedule, is already below it."""
    return checked_known_bound(options, warm.method, _objective(warm, options.objective)) or 0.0


def _known_details(options: SolveOptions) -> tuple[tuple[str, Any], ...]:
    return () if options.known_bound is None else (("known_bound", options.known_bound),)


def _run_lns(problem: Problem, sm: ScheduleModel, tgrid: Grid, start: Schedule, bound: float,
             options: SolveOptions, t0: float, deadline: float,
             max_windows: int | None = None) -> lns.LnsResult:
    """Large-neighbourhood search from ``start`` on the model ``sm`` (see :mod:`lns`)."""
    graph = chain_graph(problem)  # every window's answer is timed on it: built once
    return lns.improve(
        sm, start, options.objective, hint_units=lambda s: _hint_units(s, tgrid, sm),
        read=lambda sol: [c for c, _ in _solution_schedules(problem, sm, sol, tgrid, graph)],
        deadline=deadline, bound=bound, seed=options.seed, on_progress=options.on_progress,
        t0=t0, max_windows=max_windows)


def improve(problem: Problem, start: Schedule, options: SolveOptions, *,
            max_windows: int | None = None) -> lns.LnsResult:
    """Large-neighbourhood search alone from ``start`` (a valid schedule of ``problem`` within
    its memory limits) for ``options.time_limit`` seconds or ``max_windows`` windows, whichever
    comes first; it stops early when the schedule meets the analytic lower bound or
    ``options.known_bound`` (refused when above ``start``). The result is
    never worse than ``start`` on (objective, the other of makespan / span, peak memory)."""
    t0 = time.perf_counter()
    objective = options.objective
    given = on_problem(problem, start)
    if given is None:
        raise ValueError("start: not a valid schedule of this problem within its memory limits")
    start = given
    analytic = lower_bound(problem, objective)
    if objective == "makespan":
        analytic = max(analytic, iteration_lower_bound(problem))
    analytic = max(analytic, _known_bound(options, start))
    tgrid = time_grid(_time_values(problem), options.resolution)
    data, _ = int_data(problem, tgrid)
    sm = build_model(data, objective, _horizon(problem, start, tgrid, objective),
                     tgrid.up(analytic * (1 - 1e-9)) if tgrid.exact else 0)
    return _run_lns(problem, sm, tgrid, start, analytic, options, t0,
                    t0 + options.time_limit, max_windows)


def _fallback(problem: Problem, options: SolveOptions, t0: float) -> Schedule:
    """The greedy's schedule for an instance too large for a CP-SAT model
    (:data:`MAX_MODEL_OPS`); status ``heuristic`` unless it meets the lower bound."""
    try:
        fn = importlib.import_module("pipeopt.solvers.greedy").solve_greedy
        greedy = fn(problem, replace(options, hint=None, on_progress=None, log=False))
    except (ImportError, AttributeError):  # the greedy module is absent
        greedy = simulate(problem, sequential_orders(problem), method="sequential")
    bound = lower_bound(problem, options.objective)
    value = _objective(greedy, options.objective)
    if options.known_bound is not None and not above(options.known_bound, value):
        bound = max(bound, options.known_bound)
    note = (f"cpsat: {problem.num_ops} ops is more than a CP-SAT model handles "
            f"({MAX_MODEL_OPS}); returned the {greedy.method} schedule instead")
    info = SolverInfo(
        status="optimal" if value <= bound * (1 + 1e-9) else "heuristic",
        lower_bound=min(bound, value), wall_time=time.perf_counter() - t0,
        objective=options.objective,
        details=(*greedy.solver.details, ("cpsat_status", "SKIPPED"), ("fallback", note)))
    return replace(greedy, solver=info)


def _result(best: Schedule, timing: str, bound: float, objective: str, t0: float,
            options: SolveOptions, details: tuple[tuple[str, Any], ...],
            interrupted: bool) -> Schedule:
    """``best`` labelled with its status: optimal only when it meets the proven ``bound``."""
    value = _objective(best, objective)
    if bound <= value * (1 + 1e-9):
        bound = min(bound, value)  # a proven bound exceeds the value by float noise at most
    optimal = value <= bound * (1 + 1e-9) and not interrupted
    extra: tuple[tuple[str, Any], ...] = (("timing", timing),)
    if interrupted:
        extra += (("interrupted", True),)
    info = SolverInfo(status="optimal" if optimal else "feasible", lower_bound=bound,
                      wall_time=time.perf_counter() - t0, objective=objective,
                      details=details + extra)
    if options.on_progress is not None:
        options.on_progress(Progress(info.wall_time, value, bound))
    return replace(best, method="cpsat", solver=info)


# ----- data on the grids -------------------------------------------------------------------

def require_memory(problem: Problem) -> None:
    """Raise :class:`NotApplicable` unless every device can hold what any schedule needs
    (:func:`pipeopt.solvers.base.memory_floor`: one micro-batch's activations on the device's stages
    plus static memory; running the micro-batches one after another needs exactly that)."""
    _require_memory(problem, "cpsat")


def _time_values(problem: Problem) -> list[float]:
    """Every duration, transmission and latency the model states (seconds), for the grid."""
    vals: list[float] = []
    reps = problem.distinct_microbatches
    ops = [Op(kind, k, j) for kind in problem.kinds for k in range(problem.stages)
           for j in reps]
    vals.extend(problem.duration(op) for op in ops)
    for k in range(problem.stages - 1):
        for a, b in ((k, k + 1), (k + 1, k)):
            for j in reps:
                vals.extend(problem.transfer(a, b, j))
    vals.extend(problem.grad_reduce)
    return vals


def int_data(problem: Problem, tgrid: Grid) -> tuple[IntData, bool]:
    """The problem on the grids, and whether the memory grid is exact.

    Times are rounded down (a relaxation); memory demands up and capacities down (a
    restriction), so that the model's orders always keep the real memory limits. Values are
    per micro-batch; equal micro-batches share one list entry's value.
    """
    m = problem.microbatches
    reps = problem.distinct_microbatches
    key = problem.microbatch_key
    rep_of = {key[j]: j for j in reps}
    group = [rep_of[key[j]] for j in range(m)]  # per micro-batch, its representative

    def per_mb(units: dict[int, Any]) -> list[Any]:
        """Per micro-batch, the value of its representative in ``units``."""
        return [units[reps[0]]] * m if len(reps) == 1 else [units[g] for g in group]

    dur = {kind: [per_mb({j: tgrid.down(problem.duration(Op(kind, k, j))) for j in reps})
                  for k in range(problem.stages)] for kind in problem.kinds}
    tx: dict[tuple[int, int], list[int]] = {}
    lat: dict[tuple[int, int], int] = {}
    for k in range(problem.stages - 1):
        for a, b in ((k, k + 1), (k + 1, k)):
            t, la = problem.transfer(a, b)
            if t > 0:
                tx[(a, b)] = per_mb({j: tgrid.down(problem.transfer(a, b, j)[0]) for j in reps})
            if la > 0:
                lat[(a, b)] = tgrid.down(la)
    reduce = [tgrid.down(x) for x in problem.grad_reduce]
    memory: dict[int, tuple[int, dict[int, list[tuple[int, int]]]]] = {}
    exact = True
    table = problem.memory_table
    for d, lim in enumerate(problem.memory_limit):
        if lim is None:
            continue
        cap = lim - problem.static_memory[d]
        held = {}
        for k in problem.device_stages[d]:
            a, w = problem.activation_memory[k], problem.weight_grad_memory[k]
            held[k] = (a - w, w) if problem.split_backward else (a, 0.0)
        mgrid = memory_grid([x * table[k][j] for k, pair in held.items() for x in pair
                             for j in reps], cap)
        exact = exact and mgrid.exact
        memory[d] = (max(0, mgrid.down(cap)),
                     {k: per_mb({j: (mgrid.up(b * table[k][j]), mgrid.up(w * table[k][j]))
                                 for j in reps})
                      for k, (b, w) in held.items()})
    return IntData(problem, dur, tx, lat, reduce, memory), exact


def _horizon(problem: Problem, warm: Schedule, tgrid: Grid, objective: str) -> int:
    """Units by which every op ends in some optimal schedule.

    ``makespan``: the warm start's iteration time. ``span``: a span-optimal schedule can be
    shifted left until, at every moment, some op runs or some message travels, so all work plus
    every message's delay bounds its makespan.
    """
    if objective == "makespan":
        return tgrid.up(warm.iteration_time)
    total = sum(problem.duration(op) for op in problem.ops())
    total += sum(problem.delay(src.stage, dst.stage, src.microbatch)
                 for src, dst in edges(problem))
    return max(tgrid.up(total), tgrid.up(warm.makespan))


# ----- warm start --------------------------------------------------------------------------

def _objective(schedule: Schedule, objective: str) -> float:
    return schedule.max_span if objective == "span" else schedule.iteration_time


def sequential_orders(problem: Problem) -> list[list[Op]]:
    """One micro-batch at a time, all the way forward and back: the least memory possible."""
    glob: list[Op] = []
    s = problem.stages
    for j in range(problem.microbatches):
        glob += [Op("F", k, j) for k in range(s)]
        glob += [Op("B", k, j) for k in reversed(range(s))]
        if problem.split_backward:
            glob += [Op("W", k, j) for k in reversed(range(s))]
    orders: list[list[Op]] = [[] for _ in range(problem.devices)]
    for op in glob:
        orders[problem.stage_device[op.stage]].append(op)
    return orders


def on_problem(problem: Problem, schedule: Schedule) -> Schedule | None:
    """``schedule`` as a valid schedule of ``problem`` that keeps its memory limits, or None.

    A schedule of the fused (or split) variant is converted through its device orders: a fused
    B becomes B then W, a split B and W become one fused B.
    """
    try:
        if schedule.problem == problem:
            return schedule if not check(schedule) else None
        orders = []
        for order in schedule.device_orders():
            out: list[Op] = []
            for op in order:
                if op.kind == "W" and not problem.split_backward:
                    continue
                out.append(op)
                if op.kind == "B" and problem.split_backward and not \
                        schedule.problem.split_backward:
                    out.append(Op("W", op.stage, op.microbatch))
            orders.append(out)
        sched = simulate(problem, orders, method=schedule.method)
    except (ScheduleError, ValueError):
        return None
    return sched if fits_memory(sched, problem) else None


def warm_start(problem: Problem, options: SolveOptions) -> tuple[Schedule, bool]:
    """The best schedule that fits: ``options.hint`` if given, else the best classic schedule
    and the greedy; the one-micro-batch-at-a-time schedule when nothing else fits. The flag
    is True when Ctrl-C stopped the greedy (its best variant so far is among the candidates).
    """
    cands: list[Schedule] = []
    stopped = False
    if options.hint is not None:
        cands.append(options.hint)
    else:
        classic = _best_classic(problem, options.objective)
        if classic is not None:
            cands.append(classic)
        bound = lower_bound(problem, options.objective)
        if classic is None or _objective(classic, options.objective) > bound * (1 + 1e-9):
            try:
                greedy = _greedy(problem, options)  # only when the classic one is not optimal
            except KeyboardInterrupt:
                if classic is None:
                    raise
                greedy, stopped = None, True  # before its first variant: keep the classic
            if greedy is not None:
                cands.append(greedy)
            if problem.sub_blocks > 1 and not stopped:
                cands += _uncut_greedy(problem, options)
    interrupted = stopped or any(c.solver.detail("interrupted") for c in cands)
    cands.append(simulate(problem, sequential_orders(problem), method="sequential"))
    fitting = [s for s in (on_problem(problem, c) for c in cands) if s is not None]
    return min(fitting, key=lambda s: _objective(s, options.objective)), interrupted


def _best_classic(problem: Problem, objective: str) -> Schedule | None:
    """The best hand-made schedule that fits, each timed on ``problem`` itself (a fused one is
    split into B then W, which is never slower)."""
    best: Schedule | None = None
    for name in GENERATORS:
        try:
            sched = on_problem(problem, run_classic(problem, name))
        except (NotApplicable, ScheduleError):
            continue
        if sched is not None and (best is None or _objective(sched, objective)
                                  < _objective(best, objective)):
            best = sched
    return best


def _uncut_greedy(problem: Problem, options: SolveOptions) -> list[Schedule]:
    """On a problem cut into sub-blocks: the greedy's schedule of the uncut problem with each
    op run piece by piece (:func:`pipeopt.subblocks.expand_orders`; its makespan), which the
    greedy over the pieces may miss; [] when there is none."""
    whole = _greedy(merge(problem), options)
    if whole is None or whole.problem.split_backward != problem.split_backward:
        return []
    try:
        return [simulate(problem, expand_orders(problem, whole.device_orders()),
                         method="uncut-greedy")]
    except ScheduleError:
        return []


def _greedy(problem: Problem, options: SolveOptions) -> Schedule | None:
    """The greedy's schedule, if that module exists (it is optional here)."""
    try:
        fn = importlib.import_module("pipeopt.solvers.greedy").solve_greedy
    except (ImportError, AttributeError):
        return None
    opts = replace(options, hint=None, on_progress=None, log=False,
                   time_limit=max(0.1, _GREEDY_SHARE * options.time_limit))
    try:
        return fn(problem, opts)
    except (NotApplicable, ScheduleError):
        return None


def _hint_units(warm: Schedule, tgrid: Grid, sm: ScheduleModel
                ) -> tuple[dict[Op, int], dict[tuple[Op, Op], int]]:
    """The warm start's start times in units, relabelled so that every (kind, stage) runs its
    equal micro-batches in order (as the model requires; the relabelled schedule is just as
    valid). Micro-batches of different cost keep their labels.

    Times are floored like the durations, so the hint is a solution of the model."""
    # Each group of equal micro-batches, in index order (the model's in-order chains).
    members: dict[int, list[int]] = defaultdict(list)  # first of the group -> the group
    head_of = []
    for j, q in enumerate(sm.data.prev_equal):
        h = j if q < 0 else head_of[q]
        head_of.append(h)
        members[h].append(j)
    groups: dict[tuple[str, int, int], list[TimedOp]] = defaultdict(list)
    for o in warm.ops:
        groups[(o.kind, o.stage, head_of[o.microbatch])].append(o)
    starts: dict[Op, int] = {}
    for (kind, k, h), lst in groups.items():
        lst.sort(key=lambda o: (o.start, o.end, o.microbatch))
        for j, o in zip(members[h], lst, strict=True):
            starts[Op(kind, k, j)] = tgrid.down(o.start)
    mgroups: dict[tuple[str, int, int, int], list[Message]] = defaultdict(list)
    for mm in warm.messages:
        mgroups[(mm.kind, mm.src_stage, mm.dst_stage, head_of[mm.microbatch])].append(mm)
    by_key = {(src.kind, src.stage, dst.stage, src.microbatch): (src, dst)
              for src, dst in sm.msg_start}
    msgs: dict[tuple[Op, Op], int] = {}
    for (kind, a, b, h), lst in mgroups.items():
        lst.sort(key=lambda mm: (mm.start, mm.microbatch))
        for j, mm in zip(members[h], lst, strict=False):
            edge = by_key.get((kind, a, b, j))
            if edge is not None:
                msgs[edge] = tgrid.down(mm.start)
    return starts, msgs


# ----- solving -----------------------------------------------------------------------------

def _cpu_count() -> int:
    import os

    return os.cpu_count() or 1


class _ProgressCallback(cp_model.CpSolverSolutionCallback):
    """Sends each improving solution (objective and bound, seconds) to ``on_progress``; stops
    the search at a solution for which ``meets`` (when given) says it meets a proven bound."""

    def __init__(self, t0: float, tgrid: Grid, bound_s: Any, options: SolveOptions,
                 meets: Any = None) -> None:
        super().__init__()
        self._t0, self._grid, self._bound_s = t0, tgrid, bound_s
        self._on_progress = options.on_progress
        self._meets = meets

        self._objective: float | None = None
        self._bound: float | None = None
        self._lock = threading.Lock()

    def on_solution_callback(self) -> None:
        # The model's objective is a lower-rounded value on an inexact grid; the re-timed
        # schedule is reported at the end.
        obj = self._grid.seconds(round(self.objective_value))
        bound = self._bound_s(self.best_objective_bound)
        logger.debug("solution %.6g s, bound %.6g s", obj, bound)
        self._report(obj, bound)
        if self._meets is not None and self._meets(self):
            self.stop_search()

    def on_bound(self, units: float) -> None:
        """Called by the solver when its best bound improves (units)."""
        self._report(None, self._bound_s(units))

    def _report(self, obj: float | None, bound: float) -> None:
        with self._lock:  # the solver calls from its own threads
            if obj is not None:
                self._objective = obj
            self._bound = bound if self._bound is None else max(self._bound, bound)
            if self._on_progress is not None:
                self._on_progress(Progress(time.perf_counter() - self._t0, self._objective,
                                           self._bound))


def _solve_interruptible(solver: cp_model.CpSolver, model: cp_model.CpModel,
                         cb: _ProgressCallback) -> tuple[int, bool]:
    """Run the search; Ctrl-C stops it (the best solution so far is kept).

    The solve runs in a worker thread so that the main thread stays free to take the signal
    (Python runs signal handlers only in the main thread, between bytecodes)."""
    interrupted = threading.Event()
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["status"] = solver.solve(model, cb)
        except BaseException as exc:  # re-raised in the caller's thread
            result["error"] = exc

    if threading.current_thread() is not threading.main_thread():
        run()
    else:
        def on_sigint(signum: int, frame: Any) -> None:
            interrupted.set()
            solver.stop_search()

        # Ctrl-C or SIGTERM (a job scheduler's stop): end the search, keep its best.
        previous = {sig: signal.signal(sig, on_sigint) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            worker = threading.Thread(target=run, name="pipeopt-cpsat", daemon=True)
            worker.start()
            while worker.is_alive():
                worker.join(0.05)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if "error" in result:
        raise result["error"]
    return result["status"], interrupted.is_set()


def _solution_schedules(problem: Problem, sm: ScheduleModel,
                        solver: cp_model.CpSolver | cp_model.CpSolverSolutionCallback,
                        tgrid: Grid, graph: ChainGraph | None = None
                        ) -> list[tuple[Schedule, str]]:
    """The solver's orders re-timed by the simulator (on ``graph``, the problem's task graph,
    when the caller built it once) and, on an exact grid, the solver's own timing when the
    validator accepts it."""
    start_u = {op: solver.value(var) for op, var in sm.start.items()}
    data = sm.data
    rank = {op: i for i, op in enumerate(topological_ops(problem))}  # ties: zero-length ops
    per_dev: list[list[Op]] = [[] for _ in range(problem.devices)]
    for op in problem.ops():
        per_dev[problem.stage_device[op.stage]].append(op)
    orders = [sorted(lst, key=lambda op: (start_u[op], start_u[op] + data.d(op), rank[op]))
              for lst in per_dev]
    out = [(simulate(problem, orders, method="cpsat", graph=graph), "simulated")]
    if tgrid.exact:
        sd = problem.stage_device
        ops = tuple(TimedOp(sd[op.stage], op.stage, op.microbatch, op.kind,
                            tgrid.seconds(start_u[op]),
                            tgrid.seconds(start_u[op]) + problem.duration(op))
                    for op in problem.ops())
        msgs = []
        for (src, dst), var in sm.msg_start.items():
            t = tgrid.seconds(solver.value(var))
            tx, lat = problem.transfer(src.stage, dst.stage, src.microbatch)
            msgs.append(Message(sd[src.stage], sd[dst.stage], src.stage, dst.stage,
                                src.microbatch, src.kind, t, t + tx, t + tx + lat))
        direct = Schedule(problem, "cpsat", ops, tuple(msgs))
        if not check(direct):
            out.append((direct, "solver"))
    return out
