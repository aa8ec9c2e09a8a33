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
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from pipeopt.bounds import _arrival, _free_memory, memory_starts, round_trips, stage_memory_bound
from pipeopt.bounds import makespan_lower_bound as _analytic
from pipeopt.problem import Problem
from pipeopt.solvers.cpsat_grid import memory_grid, time_grid

#: Most pair choices the model takes (a larger model is not built). The xdc chain of
#: benchmarks/search.py has 16,790 at p = 16, m = 64 (CP-SAT proves nothing there in 60 s);
#: p = 32, m = 128 would have 128,889.
MAX_PAIRS = 20_000
#: Each question of :func:`_least_span` gets at most this share of the time left (so an
#: unanswered one leaves time for a smaller step), and none is asked with less than
#: _LEAST_QUESTION_S seconds left.
_QUESTION_SHARE = 0.5
_LEAST_QUESTION_S = 0.05


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
    _add_memory(model, problem, s, x, ends, w_ends, horizon)
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
