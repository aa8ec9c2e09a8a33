"""A proven makespan bound from whole devices kept exactly, the other devices as least delays
(issue 12 item 5; micro-batches of different cost: issue 11).

:func:`pipeopt.bounds.memory_bound` follows one stage's F starts through a recursion over
counts (how many activations fit, how long each is held at least, how much device time lies
between), and :mod:`pipeopt.solvers.relaxation` keeps one stage's ops exactly. Neither sees a
device that holds two stages whose ops and memory interleave: on a V the device at the turn
runs F, F, B, B, W, W of both chunks of every micro-batch while its memory holds both chunks
of the in-flight ones and their weight-gradient parts, and the freed room is only usable by
the next micro-batch's F, which arrives from the device before. Keeping every op of a device
(or of several neighbouring ones: the hand-off between them) in a CP-SAT model sees all of it.

The relaxation. Keep a set of devices D exactly: every op (F, B and W) of every stage they
hold, for every micro-batch, one at a time per device, and each device's memory (the
simulator's: F allocates the stage's activation at its start, B releases all but the
weight-gradient part at its end, W the rest at its end; a fused B releases everything; the
device's limit less its static memory). Every other stage is dropped and only its least
delays are kept: for kept stages ``k1 < k2`` with no kept stage between them, F(k2, i)
starts at least the forward chain ``F_k1 + sum_{k1<q<k2} F_q`` plus the link delays between
after F(k1, i) starts, and B(k1, i) at least ``B_k2 + sum_{k1<q<k2} B_q`` plus the delays after
B(k2, i) starts; the first kept stage's F at least its earliest arrival
(:func:`pipeopt.bounds.earliest_arrival`), the last kept stage's B at least its round trip
(:func:`pipeopt.bounds.round_trip`) after its F; the makespan at least every kept W's (or
fused B's) end, the first kept stage's B start plus the backward chain down to stage 0 and
W(0), and the analytic bound. Every schedule of the problem, read on the kept ops, satisfies
each of these (they are facts about its times; a queued message only arrives later than its
least delay), so the model's optimum, and any makespan CP-SAT proves infeasible for it, bounds
every schedule. Times are rounded down to an integer grid and memory demands down with the free
memory as the whole grid units it holds: both only ease the model.

Order. With identical micro-batches and no link contention some optimal schedule runs every
stage's F's, B's and W's in one order (the exchange argument of
:mod:`pipeopt.solvers.relaxation`, "Order": it is per stage and holds for any placement of
stages on devices), so the model may also take F(k, i + 1) after F(k, i), and the same for the
B's and W's, on every kept stage: an optimal schedule is among those it keeps.

Rounds. In that order micro-batch i is F number i + 1 of every kept stage k, whose start is at
least the stage's arrival plus ``lo_{i+1}`` of the analytic memory recursion
(:func:`pipeopt.bounds.memory_starts`: a fact about every schedule), so the model takes that as
the least start. And dropping micro-batches only drops constraints (the kept ones' conditions do
not involve the others), so ``window`` = K keeps the last K micro-batches alone, each at least
``arrival + lo_i`` for its number i among all m: the first rounds' cost comes from the
recursion, the last rounds' from the exact devices.

What it gives (benchmarks/README.md, "Whole devices kept exactly"; 2-core machine shared with
other jobs): ``crosspipe-v`` (a V, latency 8 x T_F on the middle link, 1F1B's memory) p = 4,
m = 8: 67.3 -> 72.5 s with device 3 kept (CP-SAT's proven optimum of the problem), m = 16:
109.2 -> 117.1 s, the model's optimum, in 28 s (best schedule known 118 s); p = 8, m = 32:
138.0 -> 148.1 s with the last 16 micro-batches of device 7 (1-3 s), 149.7-150.2 s with all 32
(30-60 s, not settled). Keeping two
neighbouring devices added nothing there (148.0 s with devices 6 and 7). Where memory paces a
chain of one stage per device (xdc p = 16, m = 64) device 0, alone or with device 1, has a
relaxed schedule at the analytic 253 s: the waits there are on the later devices. Keeping the
last ones too (0, 13, 14 and 15: their F's, B's and W's meet every 3 s) proves 255.2 s with
the last 40 micro-batches (the model's optimum, 6-14 s; 254.4 s with the last 32 or 34,
254.6 s unsettled with 48 or all 64 in 60 s) and with the last 36 or 38, the model's optimum
in 3-4 s at load 5 where the last 40 took 20 s (the "yes" answers above 255.2 s take the
time; ``auto.kept_chain`` keeps 36), where :mod:`pipeopt.solvers.relaxation` reaches 255.0 s
at most. Where the analytic bound is a device's work and warm-up
(the V at p = 16, V-Half, V-Min) the windows cannot see the dropped micro-batches' work and
the whole model is not settled in a minute.

Micro-batches of different cost. Every constant above is read per micro-batch: its op times
(``Problem.time_table``), its activation and weight-gradient memory (``memory_table``), its
message delays (``message_table``), so the least delays, the arrival, the round trip and the
tail are micro-batch i's own (:func:`pipeopt.bounds._arrival`,
:func:`pipeopt.bounds.round_trips` of i). Each condition is still a fact about one
micro-batch's ops in every schedule (its own chain, its own ops on a device, its own memory),
so the argument above holds unchanged. What does not carry over: the search may run
micro-batches in any order, so "Order" holds only among identical ones (equal time, memory and
message factors: :attr:`pipeopt.problem.Problem.microbatch_key`); for such a pair i < j the
exchange argument of :mod:`pipeopt.solvers.relaxation` ("Identical micro-batches among the
others": swap what the two do from the first stage where they run out of order; equal
durations, delays and demands leave every device's times and memory as they were) gives an
optimal schedule with F(k, i) before F(k, j), B(k, i) before B(k, j) and W(k, i) before W(k, j)
on every stage, so the model takes those (where no link serializes messages). "Rounds" does
not apply: the F numbers of the analytic recursion and the last-``window`` argument rely on
identical micro-batches (no window, no least start beyond the arrival). Where times share no
exact grid they are rounded down on a grid of the largest over
:data:`pipeopt.solvers.relaxation.VARIED_TIME_UNITS` (each constant loses less than one unit,
which only eases the model).

What it gives there (tests/test_bounds_kept_devices.py): on the memory-tight text / image
chains of tests/test_bounds_relaxation.py device 0 kept proves what the relaxation proves at
stage 0 (28.40, 29.05, 40.10 s, analytic 20.26-26.25 s); on V's behind a slow link, which the
relaxation (one stage) does not see, the device at the turn raises the analytic bound (p = 2,
factors 0.31 / 2.03 / 2.2, latency 1 s: 16.42 -> 17.00 s, optimum 17.15 s; p = 4, m = 8, three
images among texts, latency 8 s: 54.34 -> 54.92 s in 0.1 s, where auto's CP-SAT proved 54.61 s
in 20 s). At ``benchmarks/variable_microbatches.py``'s text / image chain p = 8, m = 32 it
proves only the analytic 71.264 s: devices 0, 3 or 7 alone have relaxed schedules there
(settled in 0.2-9 s), and {0, 7}, {6, 7}, {0, 1}, {5, 6, 7}, {0, 1, 2} refute nothing in
20-40 s, all 8 (the whole problem: no link delays) nothing in 150 s (2 workers, load 1-6). On
the p = 4, m = 6 analogue of that instance whose optimum (25.76 s) lies above the analytic
25.00 s, every proper subset of the devices kept has a relaxed schedule at 25.00 s: the wait
is the texts and images meeting on the middle devices, which only the whole pipeline holds.

Cost: 3 intervals per kept stage and micro-batch (2 with a fused backward), one no-overlap
and one cumulative per device; a question takes 0.01-2 s at p = 4..8 with 16-32
micro-batches of one device.

Solving. As :func:`pipeopt.solvers.relaxation.relaxation_bound`: yes/no questions "a relaxed
schedule of makespan at most t?", t stepping up from the analytic bound while refuted (the
bound is the least makespan not refuted).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pipeopt.bounds import _arrival, _free_memory, memory_bound, memory_starts, round_trips
from pipeopt.bounds import makespan_lower_bound as _analytic
from pipeopt.problem import Problem
from pipeopt.solvers.cpsat_grid import Grid, memory_grid, time_grid
from pipeopt.solvers.relaxation import VARIED_TIME_UNITS, _least_span

#: Most ops (intervals) the model takes; a larger one is not built.
MAX_OPS = 2_000


@dataclass(frozen=True)
class KeptDevicesBound:
    """What :func:`kept_devices_bound` proved.

    ``value``: a lower bound on the makespan of every schedule (seconds; at least the analytic
    makespan bound). ``optimal``: CP-SAT settled the model's least makespan (no larger value
    follows from it). ``devices``: the devices kept exactly. ``ops``: intervals in the model.
    ``questions``: yes/no questions put to CP-SAT. ``wall_s``: seconds spent.
    """

    value: float
    optimal: bool
    devices: tuple[int, ...]
    ops: int
    questions: int
    wall_s: float


def kept_device(problem: Problem) -> int:
    """The device whose memory sets the largest :func:`pipeopt.bounds.memory_bound` (the later
    one on ties: on a V the device at the turn holds both chunks' longest holds), the last
    device where memory sets none."""
    per = memory_bound(problem)
    return max(range(problem.devices), key=lambda d: (per[d], d))


def kept_devices_bound(problem: Problem, devices: Sequence[int], *, time_limit: float = 10.0,
                       workers: int | None = 2, fifo: bool = True, window: int | None = None,
                       max_ops: int = MAX_OPS) -> KeptDevicesBound | None:
    """A proven lower bound on the makespan from the relaxation of the module docstring with
    ``devices`` kept exactly, asked of CP-SAT for ``time_limit`` seconds with ``workers``
    threads (None: CP-SAT's default). ``fifo``: take every kept stage's ops in one order where
    that loses no optimal schedule (identical micro-batches, no link contention; the module
    docstring, "Order"; with micro-batches of different cost only the identical ones among
    them, "Micro-batches of different cost"). ``window``: keep only the last ``window``
    micro-batches (module docstring, "Rounds"; default: all). None for a window where the order
    does not hold or the micro-batches differ in cost, or a model of more than ``max_ops``
    intervals. Raises ``ValueError`` for a device out of range or none given, or a window out
    of range.
    """
    t0 = time.perf_counter()
    kept_devices = tuple(sorted(set(devices)))
    if not kept_devices:
        raise ValueError("devices: must name at least one device, got none")
    for d in kept_devices:
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < problem.devices:
            raise ValueError(f"devices: each must be an integer in 0..{problem.devices - 1}, "
                             f"got {d!r}")
    total = problem.microbatches
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or not 1 <= window <= total):
        raise ValueError(f"window: must be an integer in 1..{total}, got {window!r}")
    in_order = fifo and not problem.has_link_contention
    uniform = problem.uniform_microbatches
    if window is not None and not (in_order and uniform):
        return None
    from ortools.sat.python import cp_model  # lazy: importing OR-Tools takes a second

    m, n = (total if window is None else window), problem.stages
    split = problem.split_backward
    kept = sorted(k for d in kept_devices for k in problem.device_stages[d])
    ops = len(kept) * m * (3 if split else 2)
    if ops > max_ops:
        return None
    # Micro-batch i of the model is micro-batch mb[i] of the problem: with a window, the last
    # ``m`` of identical ones (any m of them: their costs are the same).
    mb = list(range(total - m, total))
    tt = problem.time_table
    fwd = [[problem.forward[k] * tt[k][j] for j in mb] for k in range(n)]
    bwd = [[problem.durations["B"][k] * tt[k][j] for j in mb] for k in range(n)]
    wgt = [[(problem.backward_weight[k] * tt[k][j] if split else 0.0) for j in mb]
           for k in range(n)]
    arrival = [_arrival(problem, j) for j in mb]
    trip = [round_trips(problem, j)[kept[-1]] for j in mb]
    ahead: dict[tuple[int, int, int], float] = {}  # F(k1, i) start -> F(k2, i) start, least
    back: dict[tuple[int, int, int], float] = {}  # B(k2, i) start -> B(k1, i) start, least
    for i, j in enumerate(mb):
        for k1, k2 in itertools.pairwise(kept):
            ahead[k1, k2, i] = (sum(fwd[q][i] for q in range(k1, k2))
                                + sum(problem.delay(q, q + 1, j) for q in range(k1, k2)))
            back[k1, k2, i] = (sum(bwd[q][i] for q in range(k1 + 1, k2 + 1))
                               + sum(problem.delay(q + 1, q, j) for q in range(k1, k2)))
    low_k = kept[0]
    tail = []  # B(low_k, i) start -> the end of W(0, i)
    for i, j in enumerate(mb):
        t = bwd[low_k][i] + sum(problem.delay(q + 1, q, j) + bwd[q][i] for q in range(low_k))
        tail.append(t + (wgt[0][i] if split and low_k > 0 else 0.0))
    analytic = _analytic(problem)
    values = [x for k in kept for i in range(m)
              for x in (fwd[k][i], bwd[k][i], wgt[k][i], arrival[i][k])]
    values += [*trip, *tail, *ahead.values(), *back.values()]
    grid = time_grid([v for v in values if v > 0])
    if not uniform and not grid.exact:  # as relaxation's model for different costs
        grid = Grid(max(values) / VARIED_TIME_UNITS, False)
    unit = grid.unit

    def down(x: float) -> int:  # seconds -> grid units, rounded down (the model only eases)
        return math.floor(x / unit + 1e-9)

    # Any schedule ends by the sum of every op and least delay of every micro-batch run one
    # after another, so this horizon cuts off no schedule at most as long as an optimal one.
    one = 0.0
    for j in range(total):
        one += sum((problem.forward[k] + problem.durations["B"][k]
                    + (problem.backward_weight[k] if split else 0.0)) * tt[k][j]
                   for k in range(n))
        one += sum(problem.delay(k, k + 1, j) + problem.delay(k + 1, k, j)
                   for k in range(n - 1))
    horizon = math.ceil(one / unit) + 1
    model = cp_model.CpModel()
    # F(k, i) is F number total - m + 1 + i of stage k by start: at least the stage's arrival
    # plus the analytic memory recursion's lo for that number (bounds.memory_starts).
    # Without the order micro-batch i need not be F number i + 1: no such bound then.
    lo = {k: (memory_starts(problem, k)[total - m:] if in_order and uniform else (0.0,) * m)
          for k in kept}
    f_at = {(k, i): model.new_int_var(down(arrival[i][k] + lo[k][i]), horizon, f"F{k}_{i}")
            for k in kept for i in range(m)}
    b_at = {(k, i): model.new_int_var(0, horizon, f"B{k}_{i}") for k in kept for i in range(m)}
    w_at = ({(k, i): model.new_int_var(0, horizon, f"W{k}_{i}") for k in kept for i in range(m)}
            if split else {})
    b_end = {(k, i): v + down(bwd[k][i]) for (k, i), v in b_at.items()}
    w_end = ({(k, i): v + down(wgt[k][i]) for (k, i), v in w_at.items()} if split else b_end)
    per_device: dict[int, list] = {d: [] for d in kept_devices}
    for k in kept:
        d = problem.stage_device[k]
        for i in range(m):
            per_device[d].append(model.new_fixed_size_interval_var(
                f_at[k, i], down(fwd[k][i]), ""))
            per_device[d].append(model.new_fixed_size_interval_var(
                b_at[k, i], down(bwd[k][i]), ""))
            if split:
                per_device[d].append(model.new_fixed_size_interval_var(
                    w_at[k, i], down(wgt[k][i]), ""))
                model.add(w_at[k, i] >= b_end[k, i])
    for intervals in per_device.values():
        model.add_no_overlap(intervals)
    for i in range(m):
        for k1, k2 in itertools.pairwise(kept):
            model.add(f_at[k2, i] >= f_at[k1, i] + down(ahead[k1, k2, i]))
            model.add(b_at[k1, i] >= b_at[k2, i] + down(back[k1, k2, i]))
        model.add(b_at[kept[-1], i] >= f_at[kept[-1], i] + down(trip[i]))
    if in_order:  # identical micro-batches in index order on every kept stage
        successive = _successive(problem, mb)
        for k in kept:
            for i, j in successive:
                model.add(f_at[k, j] >= f_at[k, i] + down(fwd[k][i]))
                model.add(b_at[k, j] >= b_end[k, i])
                if split:
                    model.add(w_at[k, j] >= w_end[k, i])
    mem = problem.memory_table
    for d in kept_devices:
        _add_device_memory(model, problem, d, [k for k in kept if problem.stage_device[k] == d],
                           f_at, b_end, w_end, horizon, [[mem[k][j] for j in mb]
                                                         for k in range(n)])
    span = model.new_int_var(0, horizon, "makespan")
    model.add(span >= down(analytic))
    for i in range(m):
        model.add(span >= b_at[low_k, i] + down(tail[i]))
        for k in kept:
            model.add(span >= w_end[k, i])
    low, high, checks = _least_span(model, span, down(analytic), horizon,
                                    time_limit - (time.perf_counter() - t0), workers)
    return KeptDevicesBound(max(analytic, low * unit), low == high, kept_devices, ops, checks,
                            time.perf_counter() - t0)


def _successive(problem: Problem, mb: list[int]) -> list[tuple[int, int]]:
    """Pairs (i, j) of model micro-batches, i < j, each class of identical ones (equal time,
    memory and message factors: :attr:`Problem.microbatch_key`) chained in index order."""
    classes: dict[object, list[int]] = {}
    for i, j in enumerate(mb):
        classes.setdefault(problem.microbatch_key[j], []).append(i)
    return [pair for group in classes.values() for pair in itertools.pairwise(group)]


def _add_device_memory(model, problem: Problem, device: int, stages: list[int], f_at, b_end,
                       w_end, horizon: int, factors: list[list[float]]) -> None:
    """``device``'s memory over its kept ``stages`` and the micro-batches kept: each F's
    activation from its start, all but the weight-gradient part to its B's end, that part to
    its W's end, each times the micro-batch's memory factor ``factors[k][i]``; demands rounded
    down and the free memory (limit less static, with the validator's slack) to whole units."""
    free = _free_memory(problem, device)
    if not math.isfinite(free):
        return
    split = problem.split_backward
    parts = []
    for k in stages:
        act = problem.activation_memory[k]
        wgm = problem.weight_grad_memory[k] if split else 0.0
        parts.append((k, act - wgm, b_end))
        if split:
            parts.append((k, wgm, w_end))
    grid = memory_grid([a * f for k, a, _ in parts for f in set(factors[k])],
                       problem.memory_limit[device] - problem.static_memory[device])
    tiny = 1e-9 if grid.exact else 0.0  # float noise on an exact grid; else strictly down
    intervals, demands = [], []
    for k, amount, stops in parts:
        for i, f in enumerate(factors[k]):
            q = math.floor(amount * f / grid.unit + tiny)
            if q <= 0:
                continue
            size = model.new_int_var(0, horizon, "")
            intervals.append(model.new_interval_var(f_at[k, i], size, stops[k, i], ""))
            demands.append(q)
    if intervals:
        model.add_cumulative(intervals, demands, max(0, math.floor(free / grid.unit + 1e-9)))
