"""Large-neighbourhood search (LNS) on the chain's CP-SAT model.

Starting from an incumbent schedule, re-optimize one *window* of ops at a time with CP-SAT while
the ops outside it keep their starts, those after the window all shifted by one amount
(:func:`_fix_outside`); the window minimises the objective,
then the sum of its start times (:func:`_compact_objective`). Windows, in rotation:

* ``microbatches``: a band of micro-batches consecutive in the incumbent's order
  (:attr:`Schedule.microbatch_order`) across all devices;
* ``devices``: a few consecutive devices across all micro-batches;
* ``ramp-up`` / ``ramp-down``: the ops that start in the first / end in the last share of the
  incumbent's makespan;
* ``time``: the ops that start inside a band of the incumbent's timeline.

A window that does not improve grows the window share (x1.5) after a full rotation; past half
of the ops the search restarts from the smallest windows with new random offsets. Each candidate
is re-timed by the chain simulator (:func:`pipeopt.simulate.simulate`, the single judge of
timings), validated (:func:`pipeopt.simulate.check`, memory limits) and kept only when it is
better on ``(objective, the other of makespan / span, peak memory)``, so the result is never worse
than the start and ties on the objective are broken by the other two. Every improvement is
streamed as a :class:`~pipeopt.solvers.base.Progress` report.

Determinism: window offsets come from a ``random.Random(seed)``; each window is solved by one
CP-SAT worker with a *deterministic* time limit (CP-SAT's work counter, not the clock), so the
sequence of windows and answers depends only on the problem, the start, the seed and the
resolution. Only the wall-clock deadline (the caller's time limit) can cut the sequence short.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from ortools.sat.python import cp_model

from pipeopt.problem import Op, Problem
from pipeopt.schedule import Schedule
from pipeopt.simulate import ScheduleError, check
from pipeopt.solvers.base import Progress, fits_memory
from pipeopt.solvers.cpsat_model import Edge, ScheduleModel, add_hints

logger = logging.getLogger("pipeopt.lns")
logger.addHandler(logging.NullHandler())

#: The window kinds, in the order they rotate.
WINDOWS = ("microbatches", "devices", "ramp-up", "ramp-down", "time")
#: Share of the ops (micro-batches, devices, timeline) the smallest windows cover. Chosen so
#: that a window at p = 16, m = 64 (3072 ops) holds a few hundred ops, the size at which the
#: full model proves optimality in seconds (``auto``'s measurements: 384 ops in 0.1-11 s).
FIRST_SHARE = 0.08
#: Factor by which the window share grows after a rotation without improvement.
GROWTH = 1.5
#: Beyond this share of the ops a window is nearly the full model: restart small instead.
MAX_SHARE = 0.5
#: CP-SAT deterministic time per window (its work units, roughly seconds of one core) at the
#: smallest share; it grows in proportion to the share.
DET_TIME_PER_WINDOW = 0.2
#: Relative tolerance below which two objective values count as equal (float noise of the
#: simulator's sums).
REL_TOL = 1e-9


@dataclass(frozen=True)
class LnsResult:
    """What :func:`improve` found: the best schedule, and counts of windows tried / improved."""

    schedule: Schedule
    windows: int
    improvements: int
    restarts: int
    interrupted: bool = False  # Ctrl-C stopped it (the best so far is kept)


def key(schedule: Schedule, objective: str) -> tuple[float, float, float, float]:
    """The lexicographic order LNS keeps: the objective (seconds), the other of makespan /
    span (seconds), the largest device peak memory (bytes), then the sum of all ops' end times
    (seconds; a more compact schedule of equal quality is a better start for the next
    window)."""
    it, span = schedule.iteration_time, schedule.max_span
    main, other = (span, it) if objective == "span" else (it, span)
    return main, other, max(schedule.peak_memory, default=0.0), sum(o.end for o in schedule.ops)


def better(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """Whether ``a`` is lexicographically smaller than ``b`` beyond float noise."""
    for x, y in zip(a, b, strict=True):
        tol = REL_TOL * max(abs(x), abs(y), 1e-30)
        if x < y - tol:
            return True
        if x > y + tol:
            return False
    return False


def window_ops(problem: Problem, incumbent: Schedule, kind: str, share: float,
               rng: random.Random) -> set[Op]:
    """The ops of one window of ``kind`` covering about ``share`` of the ops (see the module
    docstring); offsets drawn from ``rng``."""
    m, p = problem.microbatches, problem.devices
    if kind == "microbatches":
        # Consecutive in the incumbent's micro-batch order (the order its F ops start on stage
        # 0: the identity for FIFO schedules, a permutation when micro-batches differ in cost),
        # so the window frees micro-batches that run side by side.
        width = min(m, max(2, math.ceil(share * m)))
        lo = rng.randrange(m - width + 1)
        order = incumbent.microbatch_order
        band = set(order[lo:lo + width]) if len(order) == m else set(range(lo, lo + width))
        return {op for op in problem.ops() if op.microbatch in band}
    if kind == "devices":
        width = min(p, max(1, math.ceil(share * p)))
        lo = rng.randrange(p - width + 1)
        sd = problem.stage_device
        return {op for op in problem.ops() if lo <= sd[op.stage] < lo + width}
    end = max((o.end for o in incumbent.ops), default=0.0)
    if kind == "ramp-up":
        lo_t, hi_t = -math.inf, share * end
    elif kind == "ramp-down":
        lo_t, hi_t = (1 - share) * end, math.inf
    else:  # time: a band of the timeline
        lo_t = rng.uniform(0.0, max(0.0, (1 - share) * end))
        hi_t = lo_t + share * end
    out = set()
    for o in incumbent.ops:
        if (kind == "ramp-down" and o.end > lo_t) or (kind != "ramp-down" and lo_t <= o.start
                                                      < hi_t):
            out.add(Op(o.kind, o.stage, o.microbatch))
    return out


def _fix_outside(model: cp_model.CpModel, sm: ScheduleModel, starts_u: dict[Op, int],
                 free: set[Op]) -> None:
    """Fix the ops outside the window ``free`` (in ``model``, a clone of ``sm.model`` with the
    same variable indices) around the hinted starts ``starts_u`` (a solution of the model):
    those that start after every window op ended in the hint move together, each starting
    ``shift`` units earlier than hinted (one variable, >= 0: the window may end sooner and take
    the rest of the iteration with it); every other one keeps its hinted start.

    Presolve then removes them and the window is a small problem (fixing only their device
    orders instead left windows at p = 16, m = 64 taking 9-13 s each). The candidate's device
    orders are re-timed as early as possible by the simulator afterwards, so ops outside move
    earlier wherever the window's new order lets them."""
    data = sm.data
    after = max(starts_u[op] + data.d(op) for op in free)
    shift = model.new_int_var(0, max(0, after), "lns_shift")
    for op, var in sm.start.items():
        if op in free:
            continue
        v = model.get_int_var_from_proto_index(var.index)
        if starts_u[op] >= after:
            model.add(v == starts_u[op] - shift)
        else:
            model.add(v == starts_u[op])


def _compact_objective(model: cp_model.CpModel, sm: ScheduleModel, free: set[Op]) -> None:
    """Minimise the objective first, then the sum of the window's start units: a window that
    cannot shorten the iteration still packs its ops earlier, which frees room for the next
    windows (the weight exceeds any sum of starts, so the objective keeps priority)."""
    assert sm.value is not None  # build_model always sets it
    value = model.get_int_var_from_proto_index(sm.value.index)
    starts = [model.get_int_var_from_proto_index(sm.start[op].index) for op in free]
    weight = len(starts) * (sm.horizon + 1) + 1
    model.minimize(weight * value + sum(starts))


def improve(sm: ScheduleModel, incumbent: Schedule, objective: str, *,
            hint_units: Callable[[Schedule], tuple[dict[Op, int], dict[Edge, int]]],
            read: Callable[[cp_model.CpSolver], list[Schedule]],
            deadline: float, bound: float, seed: int = 0,
            on_progress: Callable[[Progress], None] | None = None, t0: float | None = None,
            max_windows: int | None = None) -> LnsResult:
    """Improve ``incumbent`` (a valid schedule of ``sm.data.problem`` within its memory limits)
    by LNS until ``deadline`` (a :func:`time.perf_counter` value), until it meets ``bound`` (a
    proven lower bound on the objective, seconds), or after ``max_windows`` windows.

    ``hint_units`` turns a schedule into start units for :func:`add_hints`; ``read`` turns a
    solved model into candidate schedules (re-timed by the simulator). ``on_progress`` gets a
    report (seconds since ``t0``) for every improvement. The model ``sm.model`` is left with
    the last incumbent's hints; its constraints are never changed (windows work on clones).
    """
    problem = sm.data.problem
    t0 = time.perf_counter() if t0 is None else t0
    rng = random.Random(seed)
    best, best_key = incumbent, key(incumbent, objective)
    share, failed_in_row, windows, improvements, restarts = FIRST_SHARE, 0, 0, 0, 0
    interrupted = False

    def report() -> None:
        if on_progress is not None:
            on_progress(Progress(time.perf_counter() - t0, best_key[0], bound))

    try:
        while True:
            if best_key[0] <= bound * (1 + REL_TOL):
                break  # meets a proven bound: optimal
            if max_windows is not None and windows >= max_windows:
                break
            left = deadline - time.perf_counter()
            if left <= 0.05:
                break
            kind = WINDOWS[windows % len(WINDOWS)]
            free = window_ops(problem, best, kind, share, rng)
            windows += 1
            if not free:
                continue
            starts_u, msgs_u = hint_units(best)
            sm.model.clear_hints()
            add_hints(sm, starts_u, msgs_u)
            model = sm.model.clone()
            _fix_outside(model, sm, starts_u, free)
            _compact_objective(model, sm, free)
            solver = cp_model.CpSolver()
            prm = solver.parameters
            prm.num_workers = 1  # one worker: deterministic answers for a given seed
            prm.random_seed = seed + windows
            prm.max_deterministic_time = DET_TIME_PER_WINDOW * share / FIRST_SHARE
            prm.max_time_in_seconds = max(0.01, left)
            prm.catch_sigint_signal = False  # Ctrl-C reaches Python once the window ends
            status = solver.solve(model)
            improved = False
            if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                try:
                    cands = read(solver)
                except ScheduleError:
                    cands = []
                for cand in cands:
                    try:
                        if check(cand) or not fits_memory(cand, problem):
                            continue
                    except ScheduleError:
                        continue
                    ck = key(cand, objective)
                    if better(ck, best_key):
                        best, best_key, improved = cand, ck, True
            logger.debug("lns window %d (%s, %.0f%% share, %d ops): %s%s", windows, kind,
                         100 * share, len(free), solver.status_name(status),
                         f", {best_key[0]:.6g} s" if improved else "")
            if improved:
                improvements += 1
                failed_in_row = 0
                report()
                continue
            failed_in_row += 1
            if failed_in_row >= len(WINDOWS):  # a whole rotation without improvement: grow
                failed_in_row = 0
                share *= GROWTH
                if share > MAX_SHARE:
                    share = FIRST_SHARE
                    restarts += 1
    except KeyboardInterrupt:  # keep the best so far
        interrupted = True
    return LnsResult(best, windows, improvements, restarts, interrupted)
