"""A proven lower bound from a relaxation solved by CP-SAT: one stage's device exactly, the later
stages only through the waits they force (issue 12 item 5).

The analytic memory bound (:func:`pipeopt.bounds.memory_bound`) lets every micro-batch make its
round trip through the later stages in the least time. But a later device runs one op at a time:
the F of one micro-batch and the B of another meet there whenever their stage-``s`` starts are a
certain distance apart, and then one of the two waits, so its round trip is longer. This module
keeps stage ``s``'s device exactly (its F, B and W of every micro-batch, one at a time, and its
memory) and counts every later stage only through that pairwise rule, then lets CP-SAT find the
least makespan of what is left. Whatever CP-SAT proves about that model (its best objective
bound) holds for every schedule of the problem.

The lemma. Number the micro-batches 0, 1, ... by the start of their F on stage ``s`` (identical
micro-batches can be renamed so). Write ``x_i`` for that start, ``b_i`` for the start of
B(s, i), ``R`` for the least time from an F start to its B start on stage ``s`` (the round trip,
:func:`pipeopt.bounds.round_trip`). For a later stage k: ``a_k`` is the least time from F(s, i)'s
start to F(k, i)'s start (the forwards between, with link delays), ``c_k`` from B(k, i)'s start
to B(s, i)'s start, ``g_k = R - a_k - F_k - c_k`` the least time from F(k, i)'s end to B(k, i)'s
start, and ``gamma_k = g_k + F_k + B_k``. For i < j, F(k, j) and B(k, i) run on one device, so
one ends before the other starts:

* B(k, i) after F(k, j): ``b_i >= B(k, i) + c_k >= F(k, j) + F_k + c_k >= x_j + a_k + F_k + c_k
  = x_j + R - g_k``;
* F(k, j) after B(k, i): ``b_j >= F(k, j) + R - a_k >= B(k, i) + B_k + R - a_k >= x_i + a_k +
  F_k + g_k + B_k + R - a_k = x_i + R + gamma_k``.

So ``b_i >= x_j + R - g_k`` or ``b_j >= x_i + R + gamma_k``. Both hold at once when
``x_j - x_i <= g_k`` or ``>= gamma_k``; in between, one of the two micro-batches waits. Times
are the simulator's: link delays are the least ones (a queued message only arrives later).

The model. Per micro-batch i: F(s, i), B(s, i), W(s, i) as intervals on one machine (stage s's
device, its other stages left out), ``x_{i+1} >= x_i + F_s``, ``b_i >= x_i + R``, W after B;
the memory of stage s on its device (the activation from F's start, all but the weight-gradient
part freed at B's end, that part at W's end; the device's limit less its static memory); the
lemma for every pair i < j and later stage k with ``(j - i) F_s < gamma_k`` (beyond that the
second option holds anyway, as ``x_j >= x_i + (j - i) F_s``); the makespan at least each W's
end, each B's start plus the backward down to stage 0 and W(0) (stage s > 0), and at least the
analytic bound. Dropping ops and conditions only makes it easier, so its optimum, and CP-SAT's
proven bound on it, is at most the optimum of the problem. Times are rounded down to an integer
grid and memory demands down; the free memory becomes the whole grid units it holds (integer
demands fit in that exactly when their sum fits in the real amount). Both only ease the model.

Rounds. Two more facts hold for every schedule, so the model may take them as well. (1) The
i-th F start on stage s is at least the stage's arrival plus ``lo_i``
(:func:`pipeopt.bounds.memory_starts`, the analytic memory bound's recursion: memory, not this
model, proves it). (2) Dropping micro-batches only drops constraints: the ops of the others
leave the kept ones' conditions (one at a time on the device, the memory they hold, the lemma
between two kept micro-batches, the makespan after their B's and W's) as they are. So the model
may keep only the last K micro-batches by F start (``window``), numbered within the window,
each with its F start at least ``arrival + lo_i`` for its F number i among all m. This carries
what the first rounds of in-flight micro-batches cost (the analytic recursion) into a small
model of the last rounds, where the waits of the lemma add up: from the third round of M
micro-batches on, each round's F's going out and the previous round's B's coming back cross on
every later device. At p = 16, m = 64 (``benchmarks/search.py``'s xdc) the full model proves
nothing above the analytic 253 s, while the last 24 micro-batches prove 253.8 s (CP-SAT's
optimum of that model, 26 s on a loaded 2-core machine) and the last 32 254.0 s (its optimum,
2-2.5 minutes; 40 are not proven in 5 minutes; benchmarks/README.md). Every window is a valid
bound; a larger one is never weaker at its optimum (it keeps a superset of the constraints)
but harder to prove.

Cost: a model of 3m intervals and up to ``m * stages`` pair choices per distance; CP-SAT proves
its optimum in 1-2 s at p = 4, m = 12 and in 40-65 s at p = 8, m = 24 on a loaded 2-core
machine, and the full model not in 60-240 s at p = 16, m = 64 (there its bound stays the
analytic one).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from pipeopt.bounds import _arrival, _free_memory, memory_starts, round_trips, stage_memory_bound
from pipeopt.bounds import makespan_lower_bound as _analytic
from pipeopt.problem import Problem
from pipeopt.solvers.cpsat_grid import memory_grid, time_grid

#: Most pair choices the model takes (a larger model is not built). The xdc chain of
#: benchmarks/search.py has 16,790 at p = 16, m = 64 (CP-SAT proves nothing there in 60 s);
#: p = 32, m = 128 would have 128,889.
MAX_PAIRS = 20_000


@dataclass(frozen=True)
class RelaxationBound:
    """What :func:`relaxation_bound` proved.

    ``value``: a lower bound on the makespan of every schedule (seconds; at least the analytic
    makespan bound). ``optimal``: CP-SAT proved the relaxation's optimum (so no larger value
    follows from this model). ``stage``: the stage kept exactly. ``pairs``: pair choices in the
    model. ``wall_s``: seconds spent.
    """

    value: float
    optimal: bool
    stage: int
    pairs: int
    wall_s: float
    #: How many micro-batches the model kept (the last ones by F start; m: all of them).
    window: int = 0


def _stage(problem: Problem) -> int:
    """The stage whose own memory paces the pipeline most (stage 0 when none does): the model
    keeps that stage's memory alone, not the device's other stages'."""
    per = stage_memory_bound(problem)
    d = max(range(problem.devices), key=lambda x: per[x])
    return problem.device_stages[d][0] if per[d] > 0 else 0


def relaxation_bound(problem: Problem, *, time_limit: float = 10.0, workers: int | None = 2,
                     stage: int | None = None, max_pairs: int = MAX_PAIRS,
                     window: int | None = None) -> RelaxationBound | None:
    """A proven lower bound on the makespan from the relaxation of the module docstring, given
    to CP-SAT for ``time_limit`` seconds with ``workers`` threads (None: CP-SAT's default).
    ``stage``: the stage kept
    exactly (default: the one whose memory bound is the largest, else 0). ``window``: keep only
    the last ``window`` micro-batches by F start on that stage (default: all of them); see the
    module docstring, "Rounds".

    None where it does not apply: micro-batches of different cost (they cannot be renamed by
    start) or a model of more than ``max_pairs`` pair choices. Raises ``ValueError`` for a
    stage out of range.
    """
    from ortools.sat.python import cp_model  # lazy: importing OR-Tools takes a second

    t0 = time.perf_counter()
    if not problem.uniform_microbatches:
        return None
    s = _stage(problem) if stage is None else stage
    if not 0 <= s < problem.stages:
        raise ValueError(f"stage: must be in 0..{problem.stages - 1}, got {stage}")
    total = problem.microbatches
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or not 1 <= window <= total):
        raise ValueError(f"window: must be an integer in 1..{total}, got {window!r}")
    m, n = (total if window is None else window), problem.stages
    # lo[i]: the least time from the stage's first F start to the start of F number
    # total - m + 1 + i (the i-th kept one), proven for every schedule (bounds.memory_starts).
    lo = memory_starts(problem, s)[total - m:]
    fwd, bwd = problem.forward, problem.durations["B"]
    w_s = problem.backward_weight[s] if problem.split_backward else 0.0
    trip = round_trips(problem, 0)[s]
    arr = _arrival(problem, 0)
    gaps: list[tuple[float, float]] = []  # per later stage k: (g_k, gamma_k)
    c = 0.0  # B(k) start -> B(s) start
    for k in range(s + 1, n):
        c += bwd[k] + problem.delay(k, k - 1, 0)
        g = trip - (arr[k] - arr[s]) - fwd[k] - c
        gaps.append((g, g + fwd[k] + bwd[k]))
    tail = bwd[s]  # B(s) start -> the end of W(0): the backward down to stage 0, then W(0)
    for k in range(s - 1, -1, -1):
        tail += problem.delay(k + 1, k, 0) + bwd[k]
    if problem.split_backward:
        tail += problem.backward_weight[0]
    pairs = sum(_pairs_within(m, gam, fwd[s]) for _, gam in gaps)
    if pairs > max_pairs:
        return None
    analytic = _analytic(problem)
    unit = time_grid([fwd[s], bwd[s], w_s, trip, arr[s], tail]
                     + [x for gg in gaps for x in gg if x > 0]).unit

    def down(x: float) -> int:  # seconds -> grid units, rounded down (the model only eases)
        return math.floor(x / unit + 1e-9)

    # Any schedule ends by the sum of every op and delay of every micro-batch (one at a time),
    # so a horizon there cuts off no solution at most as long as an optimal one.
    one = sum(fwd) + sum(bwd) + (sum(problem.backward_weight) if problem.split_backward else 0)
    one += sum(problem.delay(k, k + 1, 0) + problem.delay(k + 1, k, 0) for k in range(n - 1))
    horizon = math.ceil(total * one / unit) + 1
    model = cp_model.CpModel()
    x = [model.new_int_var(down(arr[s] + lo[i]), horizon, f"x{i}") for i in range(m)]
    b = [model.new_int_var(0, horizon, f"b{i}") for i in range(m)]
    intervals = []
    for i in range(m):
        intervals.append(model.new_fixed_size_interval_var(x[i], down(fwd[s]), f"F{i}"))
        intervals.append(model.new_fixed_size_interval_var(b[i], down(bwd[s]), f"B{i}"))
        model.add(b[i] >= x[i] + down(trip))
        if i:
            model.add(x[i] >= x[i - 1] + down(fwd[s]))
    ends = [b[i] + down(bwd[s]) for i in range(m)]
    w_ends = list(ends)
    if problem.split_backward:
        w = [model.new_int_var(0, horizon, f"w{i}") for i in range(m)]
        for i in range(m):
            intervals.append(model.new_fixed_size_interval_var(w[i], down(w_s), f"W{i}"))
            model.add(w[i] >= b[i] + down(bwd[s]))
        w_ends = [w[i] + down(w_s) for i in range(m)]
    model.add_no_overlap(intervals)
    _add_memory(model, problem, s, x, ends, w_ends, horizon)
    span = model.new_int_var(0, horizon, "makespan")
    model.add(span >= down(analytic))
    for i in range(m):
        model.add(span >= w_ends[i])
        model.add(span >= b[i] + down(tail))
    for i in range(m):
        for j in range(i + 1, m):
            for g, gam in gaps:
                if (j - i) * fwd[s] >= gam:
                    continue
                first = model.new_bool_var("")  # B(k, i) after F(k, j)
                model.add(b[i] >= x[j] + down(trip - g)).only_enforce_if(first)
                model.add(b[j] >= x[i] + down(trip + gam)).only_enforce_if(~first)
    model.minimize(span)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.1, time_limit - (time.perf_counter() - t0))
    if workers is not None:
        solver.parameters.num_workers = workers
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return RelaxationBound(analytic, False, s, pairs, time.perf_counter() - t0, m)
    value = max(analytic, solver.best_objective_bound * unit)
    return RelaxationBound(value, status == cp_model.OPTIMAL, s, pairs,
                           time.perf_counter() - t0, m)


def _pairs_within(m: int, gap: float, step: float) -> int:
    """How many pairs i < j of 0..m-1 have ``(j - i) * step < gap`` (O(1))."""
    if gap <= 0:
        return 0
    most = m - 1 if step <= 0 else min(m - 1, math.ceil(gap / step) - 1)
    return max(0, most * m - most * (most + 1) // 2)


def _add_memory(model, problem: Problem, s: int, x, ends, w_ends, horizon: int) -> None:
    """Stage s's memory on its device: ``act - wgm`` from F's start to B's end, ``wgm`` to W's
    end (the whole activation to B's end when the backward is fused); demands rounded down and
    the free memory (limit less static, with the validator's slack) up."""
    d = problem.stage_device[s]
    free = _free_memory(problem, d)
    if not math.isfinite(free):
        return
    act = problem.activation_memory[s]
    wgm = problem.weight_grad_memory[s] if problem.split_backward else 0.0
    parts = [(act - wgm, ends), (wgm, w_ends)]
    grid = memory_grid([act - wgm, wgm], problem.memory_limit[d] - problem.static_memory[d])
    tiny = 1e-9 if grid.exact else 0.0  # float noise on an exact grid; else strictly down
    intervals, demands = [], []
    for amount, stops in parts:
        q = math.floor(amount / grid.unit + tiny)
        if q <= 0:
            continue
        for i, stop in enumerate(stops):
            size = model.new_int_var(0, horizon, "")
            intervals.append(model.new_interval_var(x[i], size, stop, ""))
            demands.append(q)
    if intervals:
        # Integer demands within the free memory: their sum is at most its floor.
        model.add_cumulative(intervals, demands, max(0, math.floor(free / grid.unit + 1e-9)))
