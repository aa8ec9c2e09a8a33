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
every later device. Every window is a valid bound; a larger one is never weaker at its optimum
(it keeps a superset of the constraints) but harder to prove.

Order. With identical micro-batches and links whose messages take no transmission time (only
latency: nothing queues, so messages arrive in the order sent), some optimal schedule runs
every stage's F's, B's and W's in one order, that of the F starts on stage 0 (and so on stage
s). Exchanges, stage by stage: (1) F's, k = 1, 2, ...
(the F's before stage k already in order, so the inputs of stage k arrive in that order): where
F(k, j) runs before F(k, i) although i's input arrived no later, i takes the earlier of the two
slots and i and j swap everything they do from there on (F's of stages >= k, B's and W's of
every stage). Both still start after their inputs; every device runs ops at the same times; and
a stage's memory at any time, the activations allocated less those released so far, counts the
same starts and ends (every release still follows its own allocation: the F's are in order), so
the makespan and every limit stay as they were. (2) B's, k = last, ..., 0, the same with the B's
of stages <= k and the W's (B(last, i) is ready when F(last, i) ends, in F order; B(k, i) when
B(k + 1, i) arrives). (3) W's, per stage, by B end. Each step keeps the earlier steps' orders.
So where it holds (``fifo``; not where a link serializes messages) the model also takes:

* ``b_{i+1} >= b_i + B_s`` and the W's of stage s in the same order;
* the lemma's choices in order: F(k, j) before B(k, i) implies F(k, j - 1) before B(k, i) and
  F(k, j) before B(k, i + 1) (i < j - 1);
* device k runs F(k, i..j) and B(k, i..j) between F(k, i)'s start and B(k, j)'s end, so ``b_j
  >= x_i + a_k + (j - i + 1)(F_k + B_k) + c_k - B_k = x_i + R - g_k + (j - i)(F_k + B_k)``
  (the stages with the least ``g_k`` and most ``F_k + B_k``: at xdc, the last stage's F, B
  pairs pace the B's coming back to 2.2 s apart).

Solving. CP-SAT is asked yes/no questions, "a relaxed schedule with a makespan of at most t?",
t stepping up from the analytic bound while refuted, then halving the interval up to a relaxed
schedule found (:func:`_least_span`): a cap near the answer is refuted in seconds where the
minimisation proved the same in minutes. The bound is the least makespan not refuted.

What it gives at ``benchmarks/search.py``'s xdc p = 16, m = 64 (analytic bound 253 s; 2-core
machine shared with other jobs, load 5-8, 60 s each; benchmarks/README.md): the last 24
micro-batches 253.8 s (the model's optimum, in 4 s; 26 s before the order cuts and the
questions), 32: 254.0 s (10 s; 115-148 s before), 40: 254.6 s (42 s; not proven in 300 s
before), 48: 255.0 s (56 s), all 64: 254.6 s in 60 s. 255.0 s is as far as this model goes
there: a relaxed schedule of 255.0 s exists with the last 48 and with all 64.

Cost: a model of 3m intervals, up to ``m * stages`` pair choices per distance and ``m^2 / 2``
pacing rows per kept later stage; a question takes 0.1-1 s at p = 4, m = 12 and 1-15 s at
p = 16 with the last 40-64 micro-batches.

Micro-batches of different cost (:func:`_varied_model`). They cannot be renamed by start, so
the lemma is written for every ordered pair (i, j), i != j, with each micro-batch's own times
(its row of ``Problem.time_table``, its message delays): ``a_k(j)`` from F(s, j)'s start to
F(k, j)'s start, ``c_k(i)`` from B(k, i)'s start to B(s, i)'s start, ``R_j`` j's round trip
(:func:`pipeopt.bounds.round_trip`). F(k, j) and B(k, i) share stage k's device, so

* B(k, i) after F(k, j): ``b_i >= x_j + a_k(j) + F_k(j) + c_k(i)``, or
* F(k, j) after B(k, i), which starts at least ``R_i - c_k(i)`` after x_i:
  ``b_j >= x_i + R_i - c_k(i) + B_k(i) + R_j - a_k(j)``;

and B(k, i), B(k, j) share it too (i < j): ``b_j >= x_i + R_i - c_k(i) + B_k(i) + c_k(j)``
or the same with i and j exchanged. Each F(s, j) starts at or after j's own arrival (its
forward chain), the makespan is at least each B(s, j)'s start plus j's own backward down to
stage 0 and W(0, j), and the memory counts each micro-batch's own demand
(``Problem.memory_table``). Every schedule gives these starts a solution (each condition is
a fact about it), so the model's optimum, and CP-SAT's proven bound on it, is a bound. It
takes no ``window`` (the rounds argument numbers identical micro-batches by start) and no
:func:`pipeopt.bounds.memory_starts`, and CP-SAT minimises it instead of answering questions
(its answer can lie far above the analytic bound, from which the questions step up: p = 4,
m = 6, memory-tight, minimising proved 56.08 s in 0.6 s, the questions reached 55.71 s in 15 s;
benchmarks/README.md).

Identical micro-batches among the others (``fifo``, where no link serializes messages): two
micro-batches i < j of equal rows in the time, memory and message tables can be taken in
index order on every stage (F, B and W) without losing a schedule. "Order"'s exchanges
apply to the pair alone: (1) F's, k = 0, 1, ...: with F(k', i) before F(k', j) for k' < k,
i's input to stage k arrives no later than j's (equal durations and delays, no queue), so
where F(k, j) runs before F(k, i), i and j swap everything they do from there on (F's of
stages >= k, every B and W). Every device runs ops of the same durations at the same times;
each swapped op's inputs are ready (F(k, i) takes F(k, j)'s slot, after i's input; F(k, j)
F(k, i)'s, which began after F(k, j)'s old end, so after j's input; later ops take the
other's slot behind the other's predecessors, now their own); and every device's memory
sees the same amounts allocated and released at the same times (equal demands). (2) B's,
k = last, ..., 0, likewise with the B's of stages <= k and the W's (B(last, i) is ready when
F(last, i) ends, in order after (1)); (3) W's, per stage, by B end. Pairs of other
micro-batches are untouched, so every class of identical ones is ordered at once. The model
then takes ``x_j >= x_i + F_s``, ``b_j >= b_i + B_s``, the W's in that order, and on every
later stage B(k, i) before B(k, j) and B(k, j) after F(k, i) (F(k, i) precedes F(k, j),
which precedes B(k, j)): a schedule at least as good as any satisfies them.

Where memory is tight it is much stronger
than the analytic bounds (tests/test_bounds_relaxation.py: p = 3, m = 4, two image-like
micro-batches among text-like ones, memory 1.5 times the largest activation: 28.40 s at stage 0
where they give 20.26 s, CP-SAT's optimum 29.21 s); without a memory limit it gave the analytic
bound on each of 12 small text / image analogues. At p = 8, m = 32
(``benchmarks/variable_microbatches.py``'s text / image instance) CP-SAT proves nothing above
the analytic 71.26 s in 60 s, at stage 0 (10,416 pairs) or stage 3 (5,952); at stage 3 the
relaxation's optimum is that bound (proven in 84 s), and at stage 0 none was proven in 90 s
(benchmarks/README.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeopt.bounds import _arrival, _free_memory, memory_starts, round_trips, stage_memory_bound
from pipeopt.bounds import makespan_lower_bound as _analytic
from pipeopt.problem import Problem
from pipeopt.solvers.cpsat_grid import Grid, memory_grid, time_grid

#: Most pair choices the model takes (a larger model is not built). The xdc chain of
#: benchmarks/search.py has 16,790 at p = 16, m = 64 (CP-SAT proves nothing there in 60 s);
#: p = 32, m = 128 would have 128,889.
MAX_PAIRS = 20_000
#: Each question of :func:`_least_span` gets at most this share of the time left (so an
#: unanswered one leaves time for a smaller step), and none is asked with less than
#: _LEAST_QUESTION_S seconds left.
_QUESTION_SHARE = 0.5
_LEAST_QUESTION_S = 0.05
#: Grid units for the largest time of a model of micro-batches of different cost when its
#: times share no exact grid: each constant is rounded down by less than one unit (0.05 ms
#: per second of the largest), so 96 ops of one stage lose under 5 ms per 1 s of it.
VARIED_TIME_UNITS = 20_000


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
    #: Yes/no questions put to CP-SAT ("a relaxed schedule within this makespan?").
    questions: int = 0


def memory_can_bind(problem: Problem) -> bool:
    """Whether some stage's device has less free memory than that stage's activations of
    every micro-batch together (each at its own memory factor): where it has more, the
    model's memory constraint holds for any starts."""
    table = problem.memory_table
    for s in range(problem.stages):
        free = _free_memory(problem, problem.stage_device[s])
        if free < problem.activation_memory[s] * math.fsum(table[s]):
            return True
    return False


def _stage(problem: Problem) -> int:
    """The stage whose own memory paces the pipeline most (stage 0 when none does): the model
    keeps that stage's memory alone, not the device's other stages'."""
    per = stage_memory_bound(problem)
    d = max(range(problem.devices), key=lambda x: per[x])
    return problem.device_stages[d][0] if per[d] > 0 else 0


def relaxation_bound(problem: Problem, *, time_limit: float = 10.0, workers: int | None = 2,
                     stage: int | None = None, max_pairs: int = MAX_PAIRS,
                     window: int | None = None, fifo: bool = True) -> RelaxationBound | None:
    """A proven lower bound on the makespan from the relaxation of the module docstring, given
    to CP-SAT for ``time_limit`` seconds with ``workers`` threads (None: CP-SAT's default).
    ``stage``: the stage kept
    exactly (default: the one whose memory bound is the largest, else 0). ``window``: keep only
    the last ``window`` micro-batches by F start on that stage (default: all of them); see the
    module docstring, "Rounds". ``fifo``: take the micro-batches in one order where that loses
    no schedule (module docstring, "Order"; False: the model without it, for comparison).

    Micro-batches of different cost: the model of the module docstring's last part, every
    micro-batch at its own cost, minimised by CP-SAT; ``fifo`` orders only identical ones
    (same time, memory and message factors); ``window`` does not apply to it (None).

    None where it does not apply: a ``window`` with micro-batches of different cost, or a model
    of more than ``max_pairs`` pair choices. Raises ``ValueError`` for a stage or a window out
    of range.
    """
    from ortools.sat.python import cp_model  # lazy: importing OR-Tools takes a second

    t0 = time.perf_counter()
    s = _stage(problem) if stage is None else stage
    if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < problem.stages:
        raise ValueError(f"stage: must be an integer in 0..{problem.stages - 1}, got {stage!r}")
    total = problem.microbatches
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or not 1 <= window <= total):
        raise ValueError(f"window: must be an integer in 1..{total}, got {window!r}")
    if not problem.uniform_microbatches:
        if window is not None:
            return None
        return _varied_model(problem, s, time_limit, workers, max_pairs, t0,
                             fifo and not problem.has_link_contention)
    m, n = (total if window is None else window), problem.stages
    # lo[i]: the least time from the stage's first F start to the start of F number
    # total - m + 1 + i (the i-th kept one), proven for every schedule (bounds.memory_starts).
    lo = memory_starts(problem, s)[total - m:]
    fwd, bwd = problem.forward, problem.durations["B"]
    w_s = problem.backward_weight[s] if problem.split_backward else 0.0
    trip = round_trips(problem, 0)[s]
    arr = _arrival(problem, 0)
    gaps = _gaps(problem, s)  # per later stage k: (g_k, gamma_k)
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
    _add_memory(model, problem, s, x, ends, w_ends, horizon, [1.0] * m)
    in_order = fifo and not problem.has_link_contention
    if in_order:
        for i in range(1, m):
            model.add(b[i] >= b[i - 1] + down(bwd[s]))
            if problem.split_backward:
                model.add(w[i] >= w[i - 1] + down(w_s))
        for g, work in _throttles(gaps, fwd, bwd, s):
            for i in range(m):
                for j in range(i + 1, m):
                    model.add(b[j] >= x[i] + down(trip - g + (j - i) * work))
    span = model.new_int_var(0, horizon, "makespan")
    model.add(span >= down(analytic))
    for i in range(m):
        model.add(span >= w_ends[i])
        model.add(span >= b[i] + down(tail))
    for g, gam in gaps:
        first: dict[tuple[int, int], Any] = {}  # (i, j): B(k, i) after F(k, j)
        for i in range(m):
            for j in range(i + 1, m):
                if (j - i) * fwd[s] >= gam:
                    continue
                first[i, j] = model.new_bool_var("")
                model.add(b[i] >= x[j] + down(trip - g)).only_enforce_if(first[i, j])
                model.add(b[j] >= x[i] + down(trip + gam)).only_enforce_if(~first[i, j])
        if in_order:  # in order on device k: F(k, j) before B(k, i) orders the pairs between
            for (i, j), lit in first.items():
                if (i, j - 1) in first:
                    model.add_implication(lit, first[i, j - 1])
                if (i + 1, j) in first:
                    model.add_implication(lit, first[i + 1, j])
    low, high, checks = _least_span(model, span, down(analytic), horizon,
                                    time_limit - (time.perf_counter() - t0), workers)
    value = max(analytic, low * unit)
    return RelaxationBound(value, low == high, s, pairs, time.perf_counter() - t0, m, checks)


def _minimise(model, span, unit: float, analytic: float, s: int, pairs: int, kept: int,
             time_limit: float, workers: int | None, t0: float) -> RelaxationBound:
    """CP-SAT on ``model`` (minimising ``span``, in grid units of ``unit`` seconds) for what is
    left of ``time_limit``; its proven bound, at least ``analytic``. The bound counts also when
    the time ran out before a relaxed schedule was found (status UNKNOWN: CP-SAT's objective
    bound is proven all the same; 0 before it has one): p = 6, m = 12, text / image factors
    of two kinds, stage 0, 45 s: 56.86 s proven without a relaxed schedule, where the analytic
    bound is 43.6 s."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.1, time_limit - (time.perf_counter() - t0))
    if workers is not None:
        solver.parameters.num_workers = workers
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE, cp_model.UNKNOWN):
        return RelaxationBound(analytic, False, s, pairs, time.perf_counter() - t0, kept)
    value = max(analytic, solver.best_objective_bound * unit)
    return RelaxationBound(value, status == cp_model.OPTIMAL, s, pairs,
                           time.perf_counter() - t0, kept)


def _varied_model(problem: Problem, s: int, time_limit: float, workers: int | None,
                  max_pairs: int, t0: float, in_order: bool) -> RelaxationBound | None:
    """:func:`relaxation_bound` for micro-batches of different cost (the module docstring's
    last part): stage ``s`` exact, every micro-batch at its own cost, the ordered pairs of
    every later stage; ``in_order``: identical micro-batches in index order (the docstring's
    "Identical micro-batches"). None beyond ``max_pairs`` pair choices."""
    from ortools.sat.python import cp_model

    n, m = problem.stages, problem.microbatches
    later = n - 1 - s
    pairs = later * m * (m - 1) + later * m * (m - 1) // 2  # F-B ordered, B-B unordered
    if pairs > max_pairs:
        return None
    tt = problem.time_table
    fwd, bwd = problem.forward, problem.durations["B"]
    wgt = problem.backward_weight if problem.split_backward else (0.0,) * n
    F = [[fwd[k] * tt[k][j] for j in range(m)] for k in range(n)]
    B = [[bwd[k] * tt[k][j] for j in range(m)] for k in range(n)]
    arr = [_arrival(problem, j) for j in range(m)]
    trip = [round_trips(problem, j)[s] for j in range(m)]
    tail = []  # B(s, j) start -> the end of W(0, j)
    for j in range(m):
        t = B[s][j] + wgt[0] * tt[0][j]
        for k in range(s - 1, -1, -1):
            t += problem.delay(k + 1, k, j) + B[k][j]
        tail.append(t)
    back: dict[tuple[int, int], float] = {}  # (k, j): c_k(j), B(k, j) start -> B(s, j) start
    for j in range(m):
        acc = 0.0
        for k in range(s + 1, n):
            acc += B[k][j] + problem.delay(k, k - 1, j)
            back[k, j] = acc
    analytic = _analytic(problem)
    values = [v for row in (F[s], B[s], trip, tail) for v in row]
    values += [wgt[s] * tt[s][j] for j in range(m)] + list(back.values())
    grid = time_grid(values)
    if not grid.exact:
        grid = Grid(max(values) / VARIED_TIME_UNITS, False)
    unit = grid.unit

    def down(x: float) -> int:  # seconds -> grid units, rounded down (the model only eases)
        return math.floor(x / unit + 1e-9)

    # Any schedule ends by the sum of every op and delay of every micro-batch (one at a time).
    one = 0.0
    for j in range(m):
        one += sum(F[k][j] + B[k][j] + wgt[k] * tt[k][j] for k in range(n))
        one += sum(problem.delay(k, k + 1, j) + problem.delay(k + 1, k, j)
                   for k in range(n - 1))
    horizon = math.ceil(one / unit) + 1
    model = cp_model.CpModel()
    x = [model.new_int_var(down(arr[j][s]), horizon, f"x{j}") for j in range(m)]
    b = [model.new_int_var(0, horizon, f"b{j}") for j in range(m)]
    intervals = []
    for j in range(m):
        intervals.append(model.new_fixed_size_interval_var(x[j], down(F[s][j]), f"F{j}"))
        intervals.append(model.new_fixed_size_interval_var(b[j], down(B[s][j]), f"B{j}"))
        model.add(b[j] >= x[j] + down(trip[j]))
    ends = [b[j] + down(B[s][j]) for j in range(m)]
    w_ends = list(ends)
    if problem.split_backward:
        w = [model.new_int_var(0, horizon, f"w{j}") for j in range(m)]
        for j in range(m):
            size = down(wgt[s] * tt[s][j])
            intervals.append(model.new_fixed_size_interval_var(w[j], size, f"W{j}"))
            model.add(w[j] >= ends[j])
        w_ends = [w[j] + down(wgt[s] * tt[s][j]) for j in range(m)]
    model.add_no_overlap(intervals)
    _add_memory(model, problem, s, x, ends, w_ends, horizon, problem.memory_table[s])
    same = _identical_pairs(problem) if in_order else set()
    for i, j in same:  # identical micro-batches in index order on stage s (the docstring)
        model.add(x[j] >= x[i] + down(F[s][i]))
        model.add(b[j] >= ends[i])
        if problem.split_backward:
            model.add(w[j] >= w_ends[i])
    span = model.new_int_var(0, horizon, "makespan")
    model.add(span >= down(analytic))
    for j in range(m):
        model.add(span >= w_ends[j])
        model.add(span >= b[j] + down(tail[j]))
    for k in range(s + 1, n):
        # B(k, i) starts at least R_i - c_k(i) after x_i (its forward, then back down to k).
        at_k = [trip[i] - back[k, i] for i in range(m)]
        ahead = [arr[j][k] - arr[j][s] for j in range(m)]  # a_k(j)
        for i in range(m):
            for j in range(m):
                if i == j:
                    continue
                first = model.new_bool_var("")  # B(k, i) after F(k, j)
                model.add(b[i] >= x[j] + down(ahead[j] + F[k][j] + back[k, i])
                          ).only_enforce_if(first)
                model.add(b[j] >= x[i] + down(at_k[i] + B[k][i] + trip[j] - ahead[j])
                          ).only_enforce_if(~first)
                if (j, i) in same:  # F(k, j) before F(k, i), before B(k, i)
                    model.add_bool_or([first])
                if i < j:
                    first = model.new_bool_var("")  # B(k, j) after B(k, i)
                    model.add(b[j] >= x[i] + down(at_k[i] + B[k][i] + back[k, j])
                              ).only_enforce_if(first)
                    model.add(b[i] >= x[j] + down(at_k[j] + B[k][j] + back[k, i])
                              ).only_enforce_if(~first)
                    if (i, j) in same:
                        model.add_bool_or([first])
    model.minimize(span)
    return _minimise(model, span, unit, analytic, s, pairs, m, time_limit, workers, t0)


def _identical_pairs(problem: Problem) -> set[tuple[int, int]]:
    """Every pair i < j of micro-batches with equal time, memory and message factors on every
    stage (and stage boundary)."""
    tables = (problem.time_table, problem.memory_table, problem.message_table)
    classes: dict[tuple[float, ...], list[int]] = {}
    for j in range(problem.microbatches):
        key = tuple(row[j] for table in tables for row in table)
        classes.setdefault(key, []).append(j)
    return {(i, j) for group in classes.values() for a, i in enumerate(group)
            for j in group[a + 1:]}


def _least_span(model: Any, span: Any, low: int, top: int, time_limit: float,
                workers: int | None) -> tuple[int, int | None, int]:
    """The relaxation's least makespan (grid units) bracketed by yes/no questions to CP-SAT,
    "is there a relaxed schedule with ``span <= cap``?", until ``time_limit`` seconds are spent:
    (``low``, ``high``, questions asked): every makespan below ``low`` is refuted, ``high`` is
    reached by a relaxed schedule (None: none found). A model with no schedule up to ``top``
    (the horizon: then the problem has none) gives back the ``low`` it was given.

    Why questions and not CP-SAT's own minimisation: with a cap near the answer CP-SAT refutes
    a window in seconds (xdc p = 16, m = 64, the last 40 micro-batches: no relaxed schedule of
    254.5 s, in 2.6 s on a loaded 2-core machine) where minimising took 110 s to prove as much.
    The caps step up from ``low`` by a doubling step while refuted (first step: 0.2 % of
    ``low``), then halve the interval between ``low`` and ``high``; a question left unanswered
    at its share of the time left is asked again with half the step, so every answer only
    raises ``low`` or lowers ``high``.
    """
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    given, high = low, None
    step, checks = max(1, low // 500), 0
    while high is None or low < high:
        left = time_limit - (time.perf_counter() - t0)
        if left < _LEAST_QUESTION_S:
            break
        cap = min(top, low + step) if high is None else min(high - 1, low + step)
        trial = model.clone()
        capped = trial.get_int_var_from_proto_index(span.index)
        trial.add(capped <= cap)
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(_LEAST_QUESTION_S, left * _QUESTION_SHARE)
        if workers is not None:
            solver.parameters.num_workers = workers
        status = solver.solve(trial)
        checks += 1
        if status == cp_model.INFEASIBLE:
            if cap >= top:  # no relaxed schedule at all: nothing learnt about the makespan
                return given, None, checks
            low = cap + 1
            step = 2 * step if high is None else max(1, (high - low) // 2)
        elif status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            high = int(solver.value(capped))
            step = max(1, (high - low) // 2)
        elif step > 1:
            step //= 2
        else:
            break
    return low, high, checks


def _gaps(problem: Problem, s: int) -> list[tuple[float, float]]:
    """Per stage k after ``s``: (``g_k``, ``gamma_k``) of the module docstring (seconds)."""
    fwd, bwd = problem.forward, problem.durations["B"]
    trip, arr = round_trips(problem, 0)[s], _arrival(problem, 0)
    out = []
    c = 0.0  # B(k) start -> B(s) start
    for k in range(s + 1, problem.stages):
        c += bwd[k] + problem.delay(k, k - 1, 0)
        g = trip - (arr[k] - arr[s]) - fwd[k] - c
        out.append((g, g + fwd[k] + bwd[k]))
    return out


def largest_window(problem: Problem, max_pairs: int, stage: int | None = None) -> int:
    """The most micro-batches (the last ones by F start) that :func:`relaxation_bound` keeps in
    a model of at most ``max_pairs`` pair choices (at least 1: a one-micro-batch model has
    none), for ``stage`` (default: the one :func:`relaxation_bound` picks)."""
    s = _stage(problem) if stage is None else stage
    gaps, f = _gaps(problem, s), problem.forward[s]
    lo, hi = 1, problem.microbatches  # the pair count only grows with the window
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(_pairs_within(mid, gam, f) for _, gam in gaps) <= max_pairs:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _throttles(gaps: list[tuple[float, float]], fwd: tuple[float, ...],
               bwd: tuple[float, ...], s: int) -> list[tuple[float, float]]:
    """Per later stage k, (g_k, F_k + B_k), the dominated ones left out (a larger g and no
    more work per micro-batch gives a weaker ``b_j >= x_i + R - g_k + (j - i)(F_k + B_k)``)."""
    cands = [(g, fwd[s + 1 + n] + bwd[s + 1 + n]) for n, (g, _) in enumerate(gaps)]
    return sorted({(g, work) for g, work in cands
                   if not any(g2 <= g and w2 >= work and (g2, w2) != (g, work)
                              for g2, w2 in cands)})


def _pairs_within(m: int, gap: float, step: float) -> int:
    """How many pairs i < j of 0..m-1 have ``(j - i) * step < gap`` (O(1))."""
    if gap <= 0:
        return 0
    most = m - 1 if step <= 0 else min(m - 1, math.ceil(gap / step) - 1)
    return max(0, most * m - most * (most + 1) // 2)


def _add_memory(model, problem: Problem, s: int, x, ends, w_ends, horizon: int,
                factors: Sequence[float]) -> None:
    """Stage s's memory on its device: ``act - wgm`` from F's start to B's end, ``wgm`` to W's
    end (the whole activation to B's end when the backward is fused), each times the
    micro-batch's memory factor ``factors[i]``; demands rounded down and the free memory
    (limit less static, with the validator's slack) up."""
    d = problem.stage_device[s]
    free = _free_memory(problem, d)
    if not math.isfinite(free):
        return
    act = problem.activation_memory[s]
    wgm = problem.weight_grad_memory[s] if problem.split_backward else 0.0
    parts = [(act - wgm, ends), (wgm, w_ends)]
    grid = memory_grid([a * f for a in (act - wgm, wgm) for f in set(factors)],
                       problem.memory_limit[d] - problem.static_memory[d])
    tiny = 1e-9 if grid.exact else 0.0  # float noise on an exact grid; else strictly down
    intervals, demands = [], []
    for amount, stops in parts:
        for i, stop in enumerate(stops):
            q = math.floor(amount * factors[i] / grid.unit + tiny)
            if q <= 0:
                continue
            size = model.new_int_var(0, horizon, "")
            intervals.append(model.new_interval_var(x[i], size, stop, ""))
            demands.append(q)
    if intervals:
        # Integer demands within the free memory: their sum is at most its floor.
        model.add_cumulative(intervals, demands, max(0, math.floor(free / grid.unit + 1e-9)))
