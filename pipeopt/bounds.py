"""Lower bounds on the iteration time that hold for every schedule of a problem.

Used to report how far any schedule can be from optimal and to seed the search. Each bound
counts only work and delays that no schedule can avoid; all in seconds.

Micro-batches of different cost (``Problem.microbatch_scale`` and its memory / message
companions): a bound about one micro-batch's path takes, over the micro-batches, the one that
keeps it valid (the largest for a path every micro-batch must take, the smallest for a path
only some micro-batch must take); device work sums every micro-batch's real cost; the memory
arguments count micro-batches by their own memory. With every scale 1 each bound is computed
exactly as for identical micro-batches. With a table per stage x micro-batch
(``Problem.time_table``, ``memory_table``, ``message_table``) every argument about one stage
reads that stage's row: each proof below is per stage, so it holds row by row. The bounds
that exist only for micro-batches of different cost, :func:`overtaking_bound` and
:func:`passing_bound`, follow one long micro-batch's path and what the others cost it;
:func:`block_bound` the heavy micro-batches together, as one block on a stage's device.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator
from typing import Literal

import numpy as np

from pipeopt.problem import Problem

#: What a solver minimises: the iteration time (``makespan``: the makespan plus any gradient
#: reduction still running after it) or the largest per-device span.
Objective = Literal["makespan", "span"]


def _arrival(problem: Problem, j: int) -> list[float]:
    """Per stage, the earliest start of F(stage, j): micro-batch j's forward chain before it,
    with its link delays (seconds)."""
    tt = problem.time_table
    out = [0.0]
    for k in range(1, problem.stages):
        out.append(out[-1] + problem.forward[k - 1] * tt[k - 1][j] + problem.delay(k - 1, k, j))
    return out


def earliest_arrival(problem: Problem) -> tuple[float, ...]:
    """Per stage, the earliest time its first F can start: the forward chain before it, with
    link delays, of the micro-batch that gets there first (whichever runs first)."""
    arrivals = [_arrival(problem, j) for j in problem.distinct_microbatches]
    if len(arrivals) == 1:
        return tuple(arrivals[0])
    return tuple(min(col) for col in zip(*arrivals, strict=True))


def _path(problem: Problem, j: int) -> float:
    """Micro-batch j's forward and backward chain with link delays, then stage 0's W
    (seconds)."""
    s, tt = problem.stages, problem.time_table
    t = _arrival(problem, j)[-1] + problem.forward[s - 1] * tt[s - 1][j]
    for k in range(s - 1, -1, -1):
        t += problem.durations["B"][k] * tt[k][j]
        if k > 0:
            t += problem.delay(k, k - 1, j)
    if problem.split_backward:
        t += problem.backward_weight[0] * tt[0][j]
    return t


def critical_path(problem: Problem) -> float:
    """One micro-batch all the way forward and back, then stage 0's weight gradient: every
    micro-batch takes this path, so the longest one's is a bound."""
    return max(_path(problem, j) for j in problem.distinct_microbatches)


def device_bound(problem: Problem) -> tuple[float, ...]:
    """Per device: the earliest arrival of its first micro-batch (any of them) plus all of its
    work (every micro-batch at its own cost)."""
    arr = earliest_arrival(problem)
    return tuple(min(arr[k] for k in problem.device_stages[d]) + problem.device_work(d)
                 for d in range(problem.devices))


def round_trip(problem: Problem, stage: int, microbatch: int | None = None) -> float:
    """Least time from the start of F(stage, j) to the start of B(stage, j): the forward through
    the later stages and the backward back down to stage + 1, with link delays. For
    ``microbatch`` j at its own cost; without it, the least over the micro-batches."""
    return round_trips(problem, microbatch)[stage]


def round_trips(problem: Problem, microbatch: int | None = None) -> tuple[float, ...]:
    """:func:`round_trip` of every stage, in one pass from the last stage down (O(stages),
    where calling it per stage is O(stages^2): minutes at 1024 devices). Without
    ``microbatch``, per stage the least over the distinct micro-batches."""
    if microbatch is None:
        per = [round_trips(problem, j) for j in problem.distinct_microbatches]
        return per[0] if len(per) == 1 else tuple(map(min, zip(*per, strict=True)))
    s, j = problem.stages, microbatch
    tt = problem.time_table
    fwd, bwd = problem.forward, problem.durations["B"]
    out = [0.0] * s
    acc = 0.0
    for k in range(s - 1, -1, -1):
        acc += fwd[k] * tt[k][j]
        if k + 1 < s:
            acc += (bwd[k + 1] * tt[k + 1][j] + problem.delay(k, k + 1, j)
                    + problem.delay(k + 1, k, j))
        out[k] = acc
    return tuple(out)


def _backward_work(problem: Problem, stage: int) -> tuple[float, float, float]:
    """A unit micro-batch's (weight-gradient memory held until W, B + W seconds, W seconds) on
    ``stage``; a fused B frees everything and leaves no W (0, B, 0)."""
    if problem.split_backward:
        w = problem.backward_weight[stage]
        return problem.weight_grad_memory[stage], problem.durations["B"][stage] + w, w
    return 0.0, problem.durations["B"][stage], 0.0


def _single_stage(problem: Problem, device: int) -> int | None:
    stages = problem.device_stages[device]
    return stages[0] if len(stages) == 1 else None


def _free_memory(problem: Problem, device: int) -> float:
    """Memory for activations on ``device`` with the validator's slack (inf without a limit)."""
    lim = problem.memory_limit[device]
    if lim is None:
        return math.inf
    return lim * (1 + 1e-9) + 1e-12 - problem.static_memory[device]


def _max_in_flight(problem: Problem, device: int, stage: int) -> int:
    """How many F's of ``stage`` can start on ``device`` before any of them is released (the
    micro-batches of least memory first when they differ)."""
    act = problem.activation_memory[stage]
    free = _free_memory(problem, device)
    if problem.uniform_microbatches:
        return _whole(free, act, problem.microbatches)
    return _prefix_fit(free, [act * x for x in sorted(problem.memory_table[stage])])


def _prefix_fit(amount: float, sizes: list[float]) -> int:
    """How many of ``sizes`` (in the given order) fit in ``amount`` together."""
    used = 0.0
    for n, x in enumerate(sizes):
        used += x
        if used > amount:
            return n
    return len(sizes)


def _largest_sums(values: list[float]) -> list[float]:
    """``out[n]``: the sum of the n largest ``values`` (n = 0 .. len)."""
    out = [0.0]
    for x in sorted(values, reverse=True):
        out.append(out[-1] + x)
    return out


def _whole(amount: float, per: float, most: int) -> int:
    """How many items of size ``per`` fit in ``amount``, capped at ``most`` (safe for tiny,
    zero and infinite values)."""
    if per <= 0:
        return most
    q = amount / per
    if not q < most:  # (an infinite quotient included)
        return most
    return max(0, math.floor(q))


def warmup_idle(problem: Problem) -> tuple[float, ...]:
    """Per device, idle time that no schedule avoids between its first F and its first B.

    For a device holding one stage k: from the start of its first op (an F) to the start of its
    first B at least :func:`round_trip` passes, and in between it can only run F's of stage k.
    Each of those holds its activation until a B or W ends, so at most
    ``L = (limit - static) // activation`` of them fit (and at most m exist). The idle time is
    at least ``round_trip - min(L, m) * forward``. Devices with several stages get 0.

    Micro-batches of different cost: the first B belongs to some micro-batch, so the round trip
    is the least over them; the F's in the window are a set whose memory fits, so L is how many
    of the least-memory micro-batches fit, and their forward time is at most that of the L
    longest micro-batches (and at most ``free / activation`` times the largest time-to-memory
    ratio of a micro-batch, a fractional knapsack: it matters when memory and time differ).

    A device holding several stages (identical micro-batches; 0 otherwise): see
    :func:`_nested_warmup_idle`.
    """
    out = []
    trips = round_trips(problem)
    for d in range(problem.devices):
        k = _single_stage(problem, d)
        if k is None:
            out.append(_nested_warmup_idle(problem, d, trips))
            continue
        n = _max_in_flight(problem, d, k)
        if problem.uniform_microbatches:
            busy = n * problem.forward[k]
        else:
            row = problem.time_table[k]
            busy = problem.forward[k] * _largest_sums(list(row))[n]
            act = problem.activation_memory[k]
            if act > 0:
                ratio = max(c / x for c, x in zip(row, problem.memory_table[k], strict=True))
                busy = min(busy, problem.forward[k] * ratio * _free_memory(problem, d) / act)
        out.append(max(0.0, trips[k] - busy))
    return tuple(out)


def _nested_warmup_idle(problem: Problem, device: int, trips: tuple[float, ...]) -> float:
    """Idle time of a device holding several stages between its first op and its first B
    (seconds; identical micro-batches, else 0).

    Its first op is an F of its lowest stage k0 (an F of a later stage k needs F(k0) of the
    same micro-batch, on this device), at t0 <= every F(k0, j)'s start. Its first B, B(k, j)
    with k on the device, starts no earlier than F(k, j) + ``round_trip(k)`` >= F(k0, j) +
    (arr_k - arr_k0) + ``round_trip(k)``: so R = min over its stages k of (arr_k - arr_k0 +
    round_trip(k)) after t0 (arr: :func:`_arrival`, the forward chain with link delays). Until
    then it runs only F's, and nothing is released (only a B's or W's end releases memory), so
    every F started in the window holds its activation at once: with ``act_k > 0`` their time
    is at most the free memory times the largest ``F_k / act_k`` (a fractional knapsack; a
    stage's F's also number at most m), F's of stages without activation at most m each. The
    idle time is at least R less that."""
    stages = problem.device_stages[device]
    if not problem.uniform_microbatches or len(stages) < 2:
        return 0.0
    m, fwd, acts = problem.microbatches, problem.forward, problem.activation_memory
    arr = _arrival(problem, 0)
    k0 = min(stages)
    window = min(arr[k] - arr[k0] + trips[k] for k in stages)
    free = _free_memory(problem, device)
    held = [k for k in stages if acts[k] > 0]
    busy = math.fsum(m * fwd[k] for k in stages if acts[k] <= 0)
    if held:
        cap = math.fsum(m * fwd[k] for k in held)
        if math.isfinite(free):
            cap = min(cap, max(fwd[k] / acts[k] for k in held) * max(0.0, free))
        busy += cap
    return max(0.0, window - busy)


def cooldown_idle(problem: Problem) -> tuple[float, ...]:
    """Per device, idle time that no schedule avoids between its last F and that micro-batch's B.

    For a device holding one stage k: after its last F starts, at least :func:`round_trip`
    passes before that micro-batch's B starts. In between the device runs only that F and the
    B / W of micro-batches still holding memory when the F started: x of them hold a whole
    activation (B and W still to run), y only the weight-gradient part (W to run), with
    ``(1 + x) * activation + y * weight_grad <= limit - static`` and ``x + y <= m - 1``. The
    idle time is at least ``round_trip - forward - max(x * (B + W) + y * W)``.

    Micro-batches of different cost (see :func:`_cooldown_idle_scaled`): the last F's round
    trip without its own F is the least over the micro-batches, x and y count micro-batches
    whose memory fits with the least-memory ones first, and their work is that of the longest.
    """
    if not problem.uniform_microbatches:
        return _cooldown_idle_scaled(problem)
    out = []
    m = problem.microbatches
    trips = round_trips(problem)
    # Devices with the same memory and op times have the same answer: search once per kind
    # (the loop below is O(m) per device).
    work_in_window: dict[tuple[float, float, float, float, float], float] = {}
    for d in range(problem.devices):
        k = _single_stage(problem, d)
        if k is None:
            out.append(0.0)
            continue
        free = _free_memory(problem, d)
        act = problem.activation_memory[k]
        wgm, bw, w = _backward_work(problem, k)
        key = (free, act, wgm, bw, w)
        if key not in work_in_window:
            best = 0.0
            for x in range(m):
                if (1 + x) * act > free:
                    break
                left = m - 1 - x
                y = _whole(free - (1 + x) * act, wgm, left) if w > 0 else 0
                best = max(best, x * bw + y * w)
            work_in_window[key] = best
        out.append(max(0.0, trips[k] - problem.forward[k] - work_in_window[key]))
    return tuple(out)


def _cooldown_idle_scaled(problem: Problem) -> tuple[float, ...]:
    """:func:`cooldown_idle` with micro-batches of different cost.

    With the last F of micro-batch i starting at t, B(k, i) starts no earlier than
    ``t + round_trip(i)``; the device meanwhile runs F(k, i) and the B / W of a set X (B and W
    to run, holding ``activation * mem_j``) and a set Y (only W, holding ``weight_grad *
    mem_j``), all distinct. For sizes ``|X| = x, |Y| = y``: memory is least with the x + 1
    least-memory micro-batches holding whole activations (activation >= weight_grad) and the
    next y the weight-gradient part; the work is at most (B + W) times the x largest time
    scales plus W times the next y (B + W >= W). So the idle time is at least
    ``min_i (round_trip(i) - forward * time_i) - max over fitting (x, y) of that work``.
    """
    out = []
    m = problem.microbatches
    trips = {j: round_trips(problem, j) for j in problem.distinct_microbatches}
    for d in range(problem.devices):
        k = _single_stage(problem, d)
        if k is None:
            out.append(0.0)
            continue
        least_mem = [0.0]
        for x in sorted(problem.memory_table[k]):
            least_mem.append(least_mem[-1] + x)
        row = problem.time_table[k]
        top = _largest_sums(list(row))
        free = _free_memory(problem, d)
        act = problem.activation_memory[k]
        wgm, bw, w = _backward_work(problem, k)
        best = 0.0
        end = m  # x + 1 + y: the micro-batches holding memory; it shrinks as x grows
        for x in range(m):
            held = act * least_mem[x + 1]
            if held > free:
                break
            y = 0
            if w > 0:  # the most y whose weight-gradient memory fits beside them
                while end > x + 1 and held + wgm * (least_mem[end] - least_mem[x + 1]) > free:
                    end -= 1
                y = max(0, end - x - 1)
            best = max(best, bw * top[x] + w * (top[x + y] - top[x]))
        lead = min(trips[j][k] - problem.forward[k] * row[j] for j in trips)
        out.append(max(0.0, lead - best))
    return tuple(out)


def pipeline_idle(problem: Problem) -> tuple[float, ...]:
    """Per device, the warm-up and cool-down idle times together: their windows do not overlap
    when more micro-batches exist than fit in memory at once (the last F then starts after the
    first B), otherwise the larger of the two."""
    out = []
    for d, (a, b) in enumerate(zip(warmup_idle(problem), cooldown_idle(problem), strict=True)):
        k = _single_stage(problem, d)
        disjoint = k is not None and _max_in_flight(problem, d, k) < problem.microbatches
        out.append(a + b if disjoint else max(a, b))
    return tuple(out)


def warmup_bound(problem: Problem) -> tuple[float, ...]:
    """Per device: :func:`device_bound` plus the :func:`pipeline_idle` it cannot avoid."""
    return tuple(b + i for b, i in zip(device_bound(problem), pipeline_idle(problem),
                                       strict=True))


#: How many of the longest distinct micro-batches :func:`overtaking_bound` takes as the one
#: overtaken (every choice gives a valid bound; the long ones the highest, and a few keep it
#: O(stages) when every micro-batch differs).
_OVERTAKEN = 8


def _subset_sums(values: list[float]) -> list[tuple[float, float]]:
    """Disjoint intervals holding the sum of every subset of ``values``: n of them sum to
    between the n smallest and the n largest (n = 0 .. len)."""
    up, down = sorted(values), sorted(values, reverse=True)
    out = [(0.0, 0.0)]
    lo = hi = 0.0
    for a, b in zip(up, down, strict=True):
        lo, hi = lo + a, hi + b
        if lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _least_split(a: float, b: float, phi: float, omega: float, total: float, r: float,
                 sums: list[tuple[float, float]]) -> float:
    """The least over C in ``sums`` (intervals) of ``max(a, b + phi C) + max(omega (total -
    C), r)``: convex and piecewise linear in C, so on each interval the least is at an end
    or where a max changes its piece."""
    kinks = ([(a - b) / phi] if phi > 0 else []) + ([total - r / omega] if omega > 0 else [])
    best = math.inf
    for lo, hi in sums:
        for x in (lo, hi, *(min(hi, max(lo, y)) for y in kinks)):
            best = min(best, max(a, b + phi * x) + max(omega * (total - x), r))
    return best


def _longest(problem: Problem) -> list[int]:
    """The micro-batches whose path the overtaking and passing bounds delay: the
    :data:`_OVERTAKEN` distinct ones of the largest time scale, longest first."""
    scale = problem.time_scale
    return sorted(problem.distinct_microbatches, key=lambda j: -scale[j])[:_OVERTAKEN]


def overtaking_bound(problem: Problem) -> float:
    """A long micro-batch's path, delayed by the micro-batches that overtake it (seconds; 0
    when every micro-batch costs the same: the other bounds are then exact as before).

    Forward, for a micro-batch L and a stage k: let t_i be the start of F(i, L) and A the
    micro-batches whose F(k, .) runs before F(k, L) on its device, of total time scale C. For
    j in A take the least i with j in front of L on stages i..k: if i = 0, F(0, j) runs in
    [0, t_0]; otherwise F(i-1, j) runs after F(i-1, L), so F(i, j) runs in
    [t_{i-1} + F_{i-1} c_L, t_i]. Per stage these windows are disjoint and each holds its
    overtakers' F's, so ``t_k >= sum_{i<k} F_i c_L + min_{i<=k} F_i * C`` (and >= L's
    arrival). From t_k on, stage k's device runs F, B and W of L and of every micro-batch not
    in A (total scale T - C), and L still has its path after F(k, L) to go, so the makespan is
    at least ``max(arrival, sum F_i c_L + F_min C) + max((F + B + W)_k (T - C), path_L -
    arrival)``; the least over the C that a set of other micro-batches can sum to (n of them
    sum to between the n smallest and the n largest) is a bound.

    Backward, mirrored in time: with u_i the end of B(i, L) and A' the micro-batches whose
    B(k, .) runs after B(k, L), each j in A' runs some B(i, j) in [u_i, u_{i-1} - B_{i-1} c_L]
    (or, at i = 0, beside W(0, L) after u_0), so the makespan minus u_k is at least
    ``W_0 c_L + sum_{i<k} B_i c_L + min_{i<=k} B_i * C'`` (and L's own chain from u_k); and
    by u_k stage k's device has run F and B of L and of every micro-batch not in A'.

    With a table (``time_table[i][j]`` = c_ij): an overtaker j's F in its window lasts
    ``F_i c_ij >= g_j = min_{i<=k} F_i c_ij``, and its work left on stage k is ``(F + B + W)_k
    c_kj``. With ``phi = min_j g_j / c_kj`` the overtakers take at least ``phi * C`` with C the
    sum of their c_kj, so the same minimum over the subset sums C of row k is a bound (phi is
    ``min_{i<=k} F_i`` when the rows are equal); the backward alike with B.
    """
    if problem.uniform_microbatches:
        return 0.0
    s, tt = problem.stages, problem.time_table
    fwd, bwd = problem.forward, problem.durations["B"]
    w0 = problem.backward_weight[0] if problem.split_backward else 0.0
    longest = _longest(problem)
    best = 0.0
    for L in longest:
        path, arr = _path(problem, L), _arrival(problem, L)
        for times, work_of in ((fwd, lambda k: fwd[k] + problem.backward_input[k]
                                + problem.backward_weight[k]),
                               (bwd, lambda k: fwd[k] + bwd[k])):
            # Forward: a = L's arrival, b = sum_{i<k} F_i c_iL without delays. Backward: a =
            # W_0 c_0L + sum_{i<k} (B_i c_iL + delay), b the same without delays.
            backward = times is bwd
            a = b = w0 * tt[0][L] if backward else 0.0
            for k, phi, sums, total in _overtakers(problem, times, L):
                if not backward:
                    a = arr[k]
                best = max(best, _least_split(a, b, phi, work_of(k), total, path - a, sums))
                b += times[k] * tt[k][L]
                if backward and k + 1 < s:
                    a += times[k] * tt[k][L] + problem.delay(k + 1, k, L)
    return best


#: Cells per subset-sum interval in :func:`passing_bound`'s minimisation (a finer grid gives a
#: higher bound, never an invalid one), more at the last stage, where the bound was the largest
#: on every instance of ``benchmarks/variable_microbatches.py`` (there 128 cells instead of 32
#: raise it by up to 1 %), and at most this many intervals (closest ones merged: a larger set to
#: minimise over, so still a bound).
_PASSING_CELLS = 32
_PASSING_CELLS_LAST = 128
_PASSING_INTERVALS = 4


def _cells(sums: list[tuple[float, float]], cells: int = _PASSING_CELLS
           ) -> tuple[np.ndarray, np.ndarray]:
    """(low ends, high ends) of ``cells`` cells per interval covering ``sums``, after merging
    the closest intervals down to :data:`_PASSING_INTERVALS`."""
    parts = list(sums)
    while len(parts) > _PASSING_INTERVALS:
        i = min(range(len(parts) - 1), key=lambda x: parts[x + 1][0] - parts[x][1])
        parts[i:i + 2] = [(parts[i][0], parts[i + 1][1])]
    lo: list[float] = []
    hi: list[float] = []
    for a, b in parts:
        n = cells if b > a else 1
        pts = np.linspace(a, b, n + 1)
        lo.extend(pts[:-1] if n > 1 else [a])
        hi.extend(pts[1:] if n > 1 else [b])
    return np.array(lo), np.array(hi)


def _convex_min(f: Callable[[np.ndarray], np.ndarray], lo: np.ndarray, hi: np.ndarray,
                kink: float | None) -> np.ndarray:
    """Per cell, the least of a convex piecewise-linear ``f`` with at most one kink."""
    out = np.minimum(f(lo), f(hi))
    if kink is not None:
        inside = (lo < kink) & (kink < hi)
        out = np.where(inside, np.minimum(out, f(np.full_like(lo, kink))), out)
    return out


def _overtakers(problem: Problem, times: tuple[float, ...], L: int
                ) -> Iterator[tuple[int, float, list[tuple[float, float]], float]]:
    """Per stage k: (k, phi, subset sums of the others' row-k factors, row k's total), where
    an overtaker j of L on stages <= k costs L at least ``phi * c_kj`` (``times``: F or B per
    stage; see :func:`overtaking_bound`)."""
    s, m, tt = problem.stages, problem.microbatches, problem.time_table
    scale = problem.time_scale
    others = list(scale)
    others.remove(scale[L])
    sums, total = _subset_sums(others), math.fsum(scale)
    least = math.inf
    g = [math.inf] * m
    for k in range(s):
        row = tt[k]
        if problem.stage_scales:
            g = [min(x, times[k] * c) for x, c in zip(g, row, strict=True)]
            phi = min((g[j] / row[j] for j in range(m) if j != L), default=0.0)
            sums = _subset_sums([c for j, c in enumerate(row) if j != L])
            total = math.fsum(row)
        else:
            least = min(least, times[k])
            phi = least
        yield k, phi, sums, total


def _passing_stage(cells: tuple[np.ndarray, np.ndarray], ahead: tuple[float, float, float],
                   behind: tuple[float, float, float], trip: float, f_c: float, b_c: float,
                   fb: float, work: float, total: float, rest: float) -> float:
    """:func:`passing_bound` at one stage: the least over the cells (rows C_A, columns C_A')
    of the largest term. ``ahead`` = (arrival, forward chain without delays, phi_F) gives
    a(C_A); ``behind`` = (chain, chain without delays, phi_B) gives x(C_A')."""
    lo, hi = cells
    arrival, plain_f, phi_f = ahead
    chain, plain_b, phi_b = behind

    def a(v: np.ndarray) -> np.ndarray:
        return np.maximum(arrival, plain_f + phi_f * v)

    def x(v: np.ndarray) -> np.ndarray:
        return np.maximum(chain, plain_b + phi_b * v)

    def own(v: np.ndarray) -> np.ndarray:  # a(C_A) + (F + B + W)(T - C_A)
        return a(v) + work * (total - v)

    def after(v: np.ndarray) -> np.ndarray:  # (F + B)(T - C_A') + x(C_A')
        return fb * (total - v) + x(v)

    t2 = _convex_min(own, lo, hi, (arrival - plain_f) / phi_f if phi_f > 0 else None)
    t3 = _convex_min(after, lo, hi, (chain - plain_b) / phi_b if phi_b > 0 else None)
    n_least = np.maximum(0.0, rest - hi[:, None] - hi[None, :])  # C_N at least, per cell
    t1 = a(lo)[:, None] + np.maximum(trip, f_c + fb * n_least) + b_c + x(lo)[None, :]
    return float(np.maximum(np.maximum(t1, t2[:, None]), t3[None, :]).min())


def passing_bound(problem: Problem) -> float:
    """Every other micro-batch passes a long micro-batch L somewhere (seconds; 0 when every
    micro-batch costs the same).

    Fix L and a stage k; with c_j micro-batch j's factor on stage k (``time_table[k][j]``), T
    their sum, t the start of F(k, L), b the start and u the end of B(k, L). Each other j is in
    A (its F(k, j) runs before F(k, L)), in A' (its B(k, j) runs after B(k, L)) or else in N
    (both its F(k, j) and B(k, j) run between F(k, L) and B(k, L)); C_X sums c_j over X, so
    ``C_N >= T - c_L - C_A - C_A'``. Then, with :func:`overtaking_bound`'s forward and
    backward arguments:

    * ``t >= a(C_A) = max(arrival_k(L), sum_{i<k} F_i c_iL + phi_F C_A)``;
    * ``b >= t + max(round_trip_k(L), F_k c_L + (F_k + B_k) C_N)``: L's own round trip, or
      F(k, L) and then every N's F and B, all on stage k's device;
    * ``makespan >= u + x(C_A')``, ``x(C) = max(chain_k, plain_k + phi_B C)``: L's backward
      below k and W(0, L) (with / without link delays), delayed by the micro-batches that
      overtake it there or trail it to stage 0;
    * ``makespan >= t + (F + B + W)_k (T - C_A)`` (every op of L and of j not in A runs after
      t) and ``u >= (F_k + B_k) (T - C_A')`` (F and B of L and of j not in A' run before u).

    So the makespan is at least the least, over C_A and C_A' in the others' subset sums
    (intervals), of the largest of ``a(C_A) + max(round_trip, F_k c_L + (F_k + B_k)
    max(0, T - c_L - C_A - C_A')) + B_k c_L + x(C_A')``, ``a(C_A) + (F + B + W)_k (T - C_A)``
    and ``(F_k + B_k)(T - C_A') + x(C_A')``. The least is taken over a grid of cells, each
    term at its least in the cell (the first is monotone in each of C_A, C_A', C_N; the others
    are convex with one kink), which can only lower it. At the last stage the round trip is
    F(k, L) alone, so every other micro-batch costs L at least ``min(phi_F, phi_B, F + B)``
    times its factor there, whichever way it passes.
    """
    if problem.uniform_microbatches:
        return 0.0
    s, tt = problem.stages, problem.time_table
    fwd, bwd = problem.forward, problem.durations["B"]
    w0 = problem.backward_weight[0] if problem.split_backward else 0.0
    longest = _longest(problem)
    best = 0.0
    for L in longest:
        arr, trips = _arrival(problem, L), round_trips(problem, L)
        chain, plain_b = [0.0] * s, [0.0] * s  # from u_k: L's backward below k and W(0, L)
        ch = pb = w0 * tt[0][L]
        for k in range(s):
            chain[k], plain_b[k] = ch, pb
            pb += bwd[k] * tt[k][L]
            if k + 1 < s:
                ch += bwd[k] * tt[k][L] + problem.delay(k + 1, k, L)
        plain_f = 0.0
        backward = _overtakers(problem, bwd, L)
        for (k, phi_f, sums, total), (_, phi_b, _, _) in zip(
                _overtakers(problem, fwd, L), backward, strict=True):
            c = tt[k][L]
            work = fwd[k] + problem.backward_input[k] + problem.backward_weight[k]
            grid = _cells(sums, _PASSING_CELLS_LAST if k == s - 1 else _PASSING_CELLS)
            val = _passing_stage(grid, (arr[k], plain_f, phi_f),
                                 (chain[k], plain_b[k], phi_b), trips[k], fwd[k] * c,
                                 bwd[k] * c, fwd[k] + bwd[k], work, total, total - c)
            best = max(best, val)
            plain_f += fwd[k] * c
    return best


#: :func:`block_bound` tries every count h of heavy micro-batches when there are at most this
#: many, else this many counts spread evenly over 1..m (every count gives a valid bound; fewer
#: keep it O(stages * this) at p=64, m=1024).
_BLOCK_SETS = 64


def _block_least(head: tuple[float, float, float], body: tuple[float, float, float, float],
                 tail: tuple[float, float, float], rest: float, floor: float = -math.inf
                 ) -> float:
    """The least over x, y >= 0 with x + y <= ``rest`` of ``max(a, b + phi_F x) + max(P +
    beta (rest - x - y) + max(tau, b' + phi_B y), Omega - omega x, floor)``, with ``head =
    (a, b, phi_F)``, ``body = (P, beta, Omega, omega)``, ``tail = (tau, b', phi_B)``.

    The function is convex and piecewise linear (a sum of maxima of affine functions), so its
    least over the triangle is at a vertex of the pieces: where two of the lines on which a
    maximum changes its piece, or an edge of the triangle, cross. Every such point is
    evaluated (at most 21 without a floor, 45 with one)."""
    a, b, phi_f = head
    p, beta, omega_total, omega = body
    tau, b2, phi_b = tail

    def g(x: float, y: float) -> float:
        return (max(a, b + phi_f * x)
                + max(p + beta * (rest - x - y) + max(tau, b2 + phi_b * y),
                      omega_total - omega * x, floor))

    # Lines u x + v y = w: the triangle's edges, then where each maximum changes its piece.
    lines = [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (1.0, 1.0, rest),
             (phi_f, 0.0, a - b), (0.0, phi_b, tau - b2),
             (omega - beta, -beta, omega_total - p - beta * rest - tau),
             (omega - beta, phi_b - beta, omega_total - p - beta * rest - b2)]
    if floor > -math.inf:  # where the floor meets each of the other pieces
        lines += [(beta, beta, p + beta * rest + tau - floor),
                  (beta, beta - phi_b, p + beta * rest + b2 - floor),
                  (omega, 0.0, omega_total - floor)]
    best = math.inf
    for i, (u1, v1, w1) in enumerate(lines):
        for u2, v2, w2 in lines[i + 1:]:
            det = u1 * v2 - u2 * v1
            if abs(det) < 1e-12:
                continue
            x = (w1 * v2 - w2 * v1) / det
            y = (u1 * w2 - u2 * w1) / det
            tol = 1e-9 * (1.0 + rest)
            if x < -tol or y < -tol or x + y > rest + tol:
                continue
            x, y = max(0.0, x), max(0.0, y)
            if x + y > rest:  # rounding: back onto the edge
                x, y = x * rest / (x + y), y * rest / (x + y)
            best = min(best, g(x, y))
    return best


def block_bound(problem: Problem) -> float:
    """The heavy micro-batches run as one block on a stage's device; every other micro-batch
    lengthens the block's head, its body or its tail (seconds; 0 when every micro-batch costs
    the same). :func:`passing_bound` with a set H in place of one long micro-batch.

    Fix a stage v >= 1 and a set H of micro-batches (the h of the largest factors on row v);
    c_j is j's factor there (``time_table[v][j]``). Let t be the start of the first F(v, .) of
    H on v's device, of micro-batch f, and E the end of the last B(v, .) of H, of micro-batch
    l. Every F(v, j) and B(v, j) of H runs in [t, E]. Each other micro-batch j is in A (its
    F(v, j) runs before t), in C (else, if its B(v, j) runs after B(v, l)) or in I (else: its
    F and B both run in [t, E]); C_X sums c_j over X.

    * ``t >= max(a, b + phi_F C_A)``: a = f's arrival at v (its forward chain with links) and
      b the same without link delays; every j in A passes f on some stage i <= v, and its
      F(i, j) then runs in a window of f's forward chain that holds nothing of f (the windows
      are disjoint: :func:`overtaking_bound`), for at least ``phi_F c_j`` (phi_F = the least
      over j of ``min_{i<=v} F_i c_ij / c_j``).
    * ``E - t >= (F_v + B_v) (sum_H c_j + C_I)``: the F and B of H and I on v's device.
    * ``makespan - E >= max(tau, b' + phi_B C_C)``: l's backward below v and W(0, l) (with /
      without link delays), and every j in C trails l to some stage i < v, where its B(i, j)
      runs in a window of l's backward chain (or beside W(0, l) after B(0, l)) for at least
      ``phi_B c_j`` (phi_B with B_i, i < v: the mirror of the forward case).
    * ``makespan - t >= (F + B + W)_v (sum of all c_j - C_A)``: every op on v of H and of the
      micro-batches not in A runs after t.

    f and l are unknown, so a, b, tau and b' are the least over H. The makespan is at least
    the least over A, C (with C_I = the rest) of the largest of these sums; taking the least
    over any real C_A, C_C >= 0 with C_A + C_C <= the others' total (not only subset sums)
    can only lower it, and :func:`_block_least` finds that least exactly. With H one
    micro-batch this is close to :func:`passing_bound` (which also knows L's own round
    trip); with H the heavy ones it counts that the light ones must run before the first, in
    between, or after the last of them.

    Who opens and who closes the block (H of two or more): taking a, b over all of H and tau,
    b' over all of H lets one micro-batch both start first and end last, the one with the
    shortest chains. Three cases cover every schedule. Let u be the micro-batch of H with the
    least arrival, g the one whose B(v, g) ends first, at x, and c_j, c_(1) <= c_(2) the
    factors of H on row v.

    * f = u and l != u: a, b are u's own, tau, b' the least over H without u.
    * f != u: a, b the least over H without u; tau, b' over H.
    * f = l: a, b, tau, b' over H; then g != f, since |H| >= 2.

    In every case ``x - t >= (F_v + B_v) c_g`` if g = f, else ``F_v c_f + (F_v + B_v) c_g``
    (F(v, f) starts at t; F(v, g) and B(v, g) run after t and end by x, on one device): at
    least ``min((F_v + B_v) c_f, F_v c_f + (F_v + B_v) c_(1))`` with the least c_f that the
    case allows (c_u; the least over H without u), and ``F_v c_(2) + (F_v + B_v) c_(1)``
    when f = l (two distinct micro-batches, the one with the larger weight on the smaller
    factor). Each B(0, j) of H starts after B(v, j) ends (at or after x) and j's B's and
    link delays from stage v - 1 down to 1, and stage 0's device then runs B(0, j) and
    W(0, j) for every j in H one at a time, so ``makespan - t >= (x - t) + min_H chain +
    (B_0 + W_0) sum_H c_0j``: a floor under the second sum above (it holds whatever the
    split of the others). Likewise with the last two B(v, .) of H to end (l last, at E, and
    another at y <= E): both B(0, .) start after y and their chains, so ``makespan >= y +
    min_H chain + (B_0 + W_0)`` times the two least c_0j of H; every F(v, j) and B(v, j) of H
    but l's runs in [t, y], and so does F(v, l) when f = l, so ``y - t >= (F_v + B_v) (sum_H
    c_j - c_l)``, plus ``F_v c_l`` when f = l, with c_l at most the largest factor of H. The
    bound is the least of the three cases (each minimised as
    above; :func:`_block_cases`), never below the value with the least terms over H, and
    with one micro-batch in H that value is kept. On three devices with factors 2.37 and
    1.92 (F / B / W = 1 / 1.2 / 0.8 s) it is 20.838 s against CP-SAT's proven optimum of
    20.862 s, where the least terms over H gave 19.422 s (tests/test_variable_bounds.py).

    Cost O(stages * min(m, _BLOCK_SETS)) evaluations after O(stages * m log m) to sum the
    chains and sort each row (0.14 s of CPU at p=64, m=1024 with one case; 0.26-0.30 s with
    the three, on a loaded machine).
    """
    if problem.uniform_microbatches or problem.stages < 2:
        return 0.0
    s, m, tt = problem.stages, problem.microbatches, problem.time_table
    fwd, bwd = problem.forward, problem.durations["B"]
    wgt = problem.backward_weight if problem.split_backward else (0.0,) * s
    # Per micro-batch, running up the stages: its arrival at v, F before v without delays, B
    # below v and W(0) with / without the links' delays. Links that only delay give every
    # micro-batch the same delay (one call per stage instead of one per micro-batch).
    per_mb = problem.has_link_contention
    arrival = [0.0] * m
    plain_f = [0.0] * m
    plain_b = [wgt[0] * tt[0][j] for j in range(m)]
    chain_b = list(plain_b)
    g_f = [fwd[0] * c for c in tt[0]]  # min_{i<=v} F_i c_ij
    g_b = [math.inf] * m  # min_{i<v} B_i c_ij
    counts = (range(1, m + 1) if m <= _BLOCK_SETS else
              sorted({int(x) for x in np.linspace(1, m, _BLOCK_SETS)}))
    best = 0.0
    for v in range(1, s):
        prev = tt[v - 1]
        up, down = problem.delay(v - 1, v), problem.delay(v, v - 1)
        for j in range(m):
            if per_mb:
                up, down = problem.delay(v - 1, v, j), problem.delay(v, v - 1, j)
            f, b = fwd[v - 1] * prev[j], bwd[v - 1] * prev[j]
            arrival[j] += f + up
            plain_f[j] += f
            plain_b[j] += b
            chain_b[j] += b + down
            g_b[j] = min(g_b[j], b)
        row = tt[v]
        g_f = [min(x, fwd[v] * c) for x, c in zip(g_f, row, strict=True)]
        phi_f = min(x / c for x, c in zip(g_f, row, strict=True))
        phi_b = min(x / c for x, c in zip(g_b, row, strict=True))
        beta = fwd[v] + bwd[v]
        omega = beta + wgt[v]
        total = math.fsum(row)
        order = sorted(range(m), key=lambda j: -row[j])
        # The two least of each head / tail term over H, with their micro-batches, for
        # :func:`_block_cases`; the least chain from B(v) to B(0) and stage 0's B + W of H.
        least: list[list[tuple[float, int]]] = [[], [], [], []]
        reach = math.inf
        drain = 0.0
        two_ends: list[float] = []  # the two least stage 0 B + W of H
        heavy = 0.0
        h = 0
        for count in counts:
            while h < count:
                j = order[h]
                for pair, x in zip(least, (arrival[j], plain_f[j], chain_b[j], plain_b[j]),
                                   strict=True):
                    pair.append((x, j))
                    pair.sort()
                    del pair[2:]
                end0 = (bwd[0] + wgt[0]) * tt[0][j]
                reach = min(reach, chain_b[j] - end0)
                drain += end0
                two_ends = sorted((*two_ends, end0))[:2]
                heavy += row[j]
                h += 1
            body = (beta * heavy, beta, omega * total, omega)
            rest = max(0.0, total - heavy)
            a, b, tau, b2 = (pair[0][0] for pair in least)
            if h == 1:
                val = _block_least((a, b, phi_f), body, (tau, b2, phi_b), rest)
            else:
                u = least[0][0][1]
                c1, c2 = row[order[h - 1]], row[order[h - 2]]
                # The last two B(v) of H to end: all of H but the last one's (at least
                # all but the largest factor's) F and B run before the second last ends.
                last_two = (beta * heavy - bwd[v] * row[order[0]], beta * (heavy - row[order[0]]),
                            reach + sum(two_ends))
                val = _block_cases(least, (arrival[u], plain_f[u]),
                                   (row[u], c1, c2, c2 if u == order[h - 1] else c1),
                                   (fwd[v], beta, phi_f, phi_b), body, rest,
                                   (reach + drain, *last_two), best)
            best = max(best, val)
    return best


def _block_cases(least: list[list[tuple[float, int]]], head_u: tuple[float, float],
                 costs: tuple[float, float, float, float],
                 rates: tuple[float, float, float, float],
                 body: tuple[float, float, float, float], rest: float,
                 after: tuple[float, float, float, float], known: float = -math.inf) -> float:
    """:func:`block_bound`'s value for one set H of two or more micro-batches: the least over
    three cases of which micro-batch opens the block and which closes it (see there).

    ``least``: for each of the head terms (a, b) and the tail terms (tau, b') the two least
    values over H, each with its micro-batch; u is the micro-batch of the least a, and
    ``head_u`` its (a, b). ``costs``: (c_u, the least factor of H on row v, the second least,
    the least other than u's); ``rates``: (F_v, F_v + B_v, phi_F, phi_B); ``after``: (the
    least chain from a B(v, j) of H to its B(0, j) plus stage 0's B and W of all of H; the
    least time from t to the second last B(v) end of H when one micro-batch opens and closes
    the block, and otherwise; the least chain plus the two least of stage 0's B + W over H)
    (seconds). Once a case is at most ``known`` (a bound already proven) the rest are
    skipped: the value returned is then at most ``known`` too, which the caller's maximum
    ignores."""
    c_u, c1, c2, c_rest = costs
    f_v, fb, phi_f, phi_b = rates
    drain, second_nested, second, last_two = after
    u = least[0][0][1]

    def least_of(i: int) -> float:
        return least[i][0][0]

    def least_but_u(i: int) -> float:
        pair = least[i]
        return pair[1][0] if pair[0][1] == u else pair[0][0]

    cases = (
        # the same micro-batch opens and closes it, so another's B(v) ends first (first: it
        # is the least of the three on most instances, and ends the loop below early).
        ((least_of(0), least_of(1)), (least_of(2), least_of(3)),
         max(f_v * c2 + fb * c1 + drain, second_nested + last_two)),
        # u opens the block, another micro-batch closes it.
        (head_u, (least_but_u(2), least_but_u(3)),
         max(min(fb * c_u, f_v * c_u + fb * c1) + drain, second + last_two)),
        # another micro-batch opens it, any closes it.
        ((least_but_u(0), least_but_u(1)), (least_of(2), least_of(3)),
         max(min(fb * c_rest, f_v * c_rest + fb * c1) + drain, second + last_two)),
    )
    out = math.inf
    for (ha, hb), (ta, tb), floor in cases:
        if floor <= body[0] + ta:  # never above the block and its tail: no floor
            floor = -math.inf
        out = min(out, _block_least((ha, hb, phi_f), body, (ta, tb, phi_b), rest, floor))
        if out <= known:
            break  # the maximum over the sets is at least ``known`` already
    return out


def link_bound(problem: Problem) -> float:
    """The busiest directed link's messages, one at a time (seconds; 0 when no message
    occupies its link for a positive time).

    A message from stage k to k + 1 (or its gradient back) on different devices occupies the
    directed link between them for ``message_size_k * c_kj / bandwidth`` seconds, one message at
    a time, then arrives ``latency`` later (the simulator's link model). For a directed link
    take every message it carries, from every stage boundary and micro-batch: none is ready
    before the least over them of its sender's earliest end (an F's: the micro-batch's arrival
    plus F; a B's: arrival, round trip and B of stage k + 1), they then occupy the link for the
    sum of their transmissions, and after the last one leaves it the makespan is at least the
    least over them of ``latency`` plus the receiver's path from its start (the micro-batch's
    path less its earliest start of F(k + 1, j), resp. of B(k, j)). Same argument as a
    device's bound, with the link as the machine.
    """
    if not problem.has_link_contention:
        return 0.0
    m, s = problem.microbatches, problem.stages
    js = problem.distinct_microbatches
    arr = {j: _arrival(problem, j) for j in js}
    trips = {j: round_trips(problem, j) for j in js}
    path = {j: _path(problem, j) for j in js}
    tt, bwd = problem.time_table, problem.durations["B"]
    # Per directed device link: [least ready, busy seconds, least after].
    links: dict[tuple[int, int], list[float]] = {}
    for k in range(s - 1):
        for src, dst in ((k, k + 1), (k + 1, k)):
            tx, lat = problem.transfer(src, dst)
            if tx <= 0:
                continue
            busy = tx * (m if problem.uniform_microbatches
                         else math.fsum(problem.message_table[k]))
            if src == k:  # forward: F(k, j) ends, F(k + 1, j) starts after
                ready = min(arr[j][k] + problem.forward[k] * tt[k][j] for j in js)
                after = min(lat + path[j] - arr[j][k + 1] for j in js)
            else:  # backward: B(k + 1, j) ends, B(k, j) starts after
                ready = min(arr[j][k + 1] + trips[j][k + 1] + bwd[k + 1] * tt[k + 1][j]
                            for j in js)
                after = min(lat + path[j] - arr[j][k] - trips[j][k] for j in js)
            key = (problem.stage_device[src], problem.stage_device[dst])
            if key in links:
                r, b, a = links[key]
                links[key] = [min(r, ready), b + busy, min(a, after)]
            else:
                links[key] = [ready, busy, after]
    return max((r + b + a for r, b, a in links.values()), default=0.0)


#: How many of the largest feasible counts of micro-batches still holding a whole activation
#: :func:`memory_bound` evaluates exactly at each F; smaller counts are bounded below by their
#: chain term alone (a valid, weaker value: any number keeps the bound proven).
_MEMORY_OPTIONS = 3
#: :func:`memory_bound` follows each F in full for this many times M (the micro-batches that fit
#: in memory), then by the least step per M F's (the steady state; the bound stays proven).
_MEMORY_ROUNDS = 3


#: Per micro-batch (distinct ones): round trips, arrivals (per stage) and path (seconds).
_Paths = dict[int, tuple[tuple[float, ...], list[float], float]]


def _nested_activation(problem: Problem, device: int, stage: int) -> float:
    """What one micro-batch holds on ``device`` from the start of its F on ``stage`` to the end
    of its B there (bytes, identical micro-batches): the stage's activation plus those of the
    device's earlier stages (a V's first chunk under its second), which F(stage) follows and
    whose B's come after B(stage); the stage's own activation when micro-batches differ."""
    if not problem.uniform_microbatches:
        return problem.activation_memory[stage]
    return math.fsum(problem.activation_memory[q] for q in problem.device_stages[device]
                     if q <= stage)


def _nested_tail(problem: Problem, device: int, stage: int) -> tuple[float, float, float] | None:
    """What micro-batch j still holds on ``device`` after B(stage, j) ends, and for how long
    at least (identical micro-batches; None where the device holds no earlier stage or the
    micro-batches differ): (the activations of the device's earlier stages, the backward
    chain B(stage - 1) .. B(k1) with its link delays (seconds; k1 the device's highest
    earlier stage), B(k1) in seconds, run on the device). B(q, j) for every earlier q on the
    device ends no earlier than B(k1, j), which ends that chain's time after B(stage, j)."""
    if not problem.uniform_microbatches:
        return None
    below = [q for q in problem.device_stages[device] if q < stage]
    if not below:
        return None
    k1 = max(below)
    bwd = problem.durations["B"]
    chain = math.fsum(bwd[k] for k in range(k1, stage)) + math.fsum(
        problem.delay(k, k - 1) for k in range(k1 + 1, stage + 1))
    part = math.fsum(problem.activation_memory[q] for q in below)
    if part <= 0:
        return None
    return part, chain, bwd[k1]


def _memory_stage(problem: Problem, device: int, stage: int, per: _Paths, nested: bool = True,
                  starts: list[float] | None = None,
                  tail_part: tuple[float, float, float] | None = None
                  ) -> tuple[float, float, float]:
    """(makespan bound, span bound, bound on the end of the stage's last W) of one stage on
    ``device`` by :func:`memory_bound`'s argument, zeros where it does not apply. ``nested``
    False: the stage's own activation only (:func:`stage_memory_bound`). ``starts`` (a list,
    filled here): the recursion's ``lo_1 .. lo_m`` computed in full, without the shortcut that
    skips a stage whose device time sets the pace (left empty where memory admits every
    micro-batch at once). ``tail_part`` (bytes, seconds, device seconds;
    :func:`_nested_tail`): in place of the weight-gradient part, the earlier stages'
    activations, held that long after B ends, whose release runs that much on the device
    (see :func:`memory_bound`); then only the makespan bound is kept (the others are 0)."""
    m, tt = problem.microbatches, problem.time_table[stage]
    free = _free_memory(problem, device)
    act = (_nested_activation(problem, device, stage) if nested
           else problem.activation_memory[stage])
    wgm, _, w_unit = _backward_work(problem, stage)
    w_work = w_unit  # what the release of the part held after B runs on the device
    if tail_part is not None:
        wgm, w_unit, w_work = tail_part
    n_full = (_whole(free, act, m) if problem.uniform_microbatches
              else _max_in_flight(problem, device, stage))
    if n_full >= m or n_full < 1 or act <= 0:  # (< 1: no schedule fits; others say so)
        return 0.0, 0.0, 0.0
    f_u, b_u = problem.forward[stage], problem.durations["B"][stage]
    js = per.keys()
    f, b, w = (x * min(tt[j] for j in js) for x in (f_u, b_u, w_work))
    trips = {j: per[j][0][stage] for j in js}
    hold = min(trips[j] + b_u * tt[j] for j in js)  # F start -> B end
    hold_w = min(trips[j] + (b_u + w_unit) * tt[j] for j in js)  # F start -> W end
    if hold_w <= n_full * (f + b + w) and starts is None:
        return 0.0, 0.0, 0.0  # device time, not memory, sets the pace (see memory_bound)
    arrivals = {j: per[j][1][stage] for j in js}
    a = min(arrivals.values())
    first_b = min(trips.values())  # the first B of the stage starts this long after f_1
    split = w_unit > 0 and wgm > 0  # else everything is free once B ends
    # Per option t (x = n_full - 1 - t micro-batches besides the new one hold a whole
    # activation): the most that hold only the weight-gradient part beside them (the
    # least-memory ones; a larger count only adds options, so rounding up is safe).
    half: list[int] = []
    if problem.uniform_microbatches:
        for t in range(min(_MEMORY_OPTIONS, n_full)):
            x = n_full - 1 - t
            half.append(_whole(free - act * (x + 1), wgm, m - 1 - x) if split else 0)
    else:
        least = [0.0]  # least[n]: the n least memory factors, summed
        for c in sorted(problem.memory_table[stage]):
            least.append(least[-1] + c)
        for t in range(min(_MEMORY_OPTIONS, n_full)):
            x = n_full - 1 - t
            y = 0
            if split:
                room = free - act * least[x + 1]
                y = max(0, bisect.bisect_right(least, least[x + 1] + room / wgm) - x - 2)
                while x + 1 + y < m and wgm * (least[x + 2 + y] - least[x + 1]) <= room:
                    y += 1
            half.append(min(y, m - 1 - x))
    rest = len(half) < n_full
    # lo_i >= lo_{i-M} + step for every i > M: the least term of each option (x = M - 1 with
    # no weight-gradient part beside: the W-chain; smaller x: one more F started since).
    step = min(hold_w if split and half[0] == 0 else hold, hold + f)
    last = m if starts is not None else min(m, _MEMORY_ROUNDS * n_full)  # then by step
    lo = [0.0] * (last + 1)  # lo[i] <= f_i - f_1: the i-th F start after the first (1-based)
    for i in range(2, last + 1):
        best = lo[i - 1] + f
        if i > n_full:
            opt = lo[i - n_full + len(half)] + hold if rest else math.inf
            for t, y_most in enumerate(half):
                u = i - n_full + t  # micro-batches whose B has ended
                z = max(0, u - y_most) if split else 0  # unsplit: B's end frees it all
                done = u * b + z * w
                g = max(lo[u] + hold, (i - 1) * f + done,
                        first_b + max(0, i - 1 - n_full) * f + done)
                if z >= 1 and lo[z] + hold_w > g:
                    g = lo[z] + hold_w
                if g < opt:
                    opt = g
            if opt > best:
                best = opt
        lo[i] = best
    if starts is not None:
        starts.extend(lo[1:])
    end = max(lo[i] + (m - i) // n_full * step for i in range(last - n_full + 1, last + 1)
              if (m - i) % n_full == 0) if last < m else lo[m]
    paths = {j: per[j][2] - arrivals[j] for j in js}
    own = min(trips[j] + (b_u + w_unit) * tt[j] for j in js)  # F(k, j) start -> W(k, j) end
    tail = min(max(paths[j], trips[j] + (b_u + w_unit) * tt[j]) for j in js)
    if tail_part is not None:
        return a + end + tail, 0.0, 0.0
    return a + end + tail, end + own, a + end + own


def memory_starts(problem: Problem, stage: int) -> tuple[float, ...]:
    """Per F number i = 1 .. m of ``stage`` (numbered by start), a lower bound on the time from
    the stage's first F start to its i-th (seconds): :func:`memory_bound`'s ``lo_i`` (its
    recursion computed in full, every round), at least ``(i - 1)`` times the stage's least F
    (its F's run one at a time on its device). Every schedule's F starts meet it, so a model
    of the problem may take it as a constraint (:mod:`pipeopt.solvers.relaxation` does).
    O(m) per call after the round trips."""
    m, d = problem.microbatches, problem.stage_device[stage]
    f = problem.forward[stage] * min(problem.time_table[stage])
    out = [i * f for i in range(m)]
    if problem.memory_limit[d] is not None:
        per = {j: (round_trips(problem, j), _arrival(problem, j), _path(problem, j))
               for j in problem.distinct_microbatches}
        lo: list[float] = []
        _memory_stage(problem, d, stage, per, starts=lo)
        for i, x in enumerate(lo):
            out[i] = max(out[i], x)
    return tuple(out)


def memory_bound(problem: Problem) -> tuple[float, ...]:
    """Per device, a makespan bound from its memory: at most M micro-batches in flight, each
    resident for at least its round trip, cannot start faster than M per round trip (seconds;
    0 where it does not apply).

    Take a stage k on device d and number its F's 1..m by start, f_1 <= ... <= f_m. Memory (the
    simulator's model): F(k, j) allocates ``act * c_j`` at its start, B(k, j) releases all but
    ``wgm * c_j`` at its end, W(k, j) the rest at its end (a fused B releases everything); at
    equal times releases come first. With identical micro-batches ``act`` is the stage's
    activation plus those of the device's earlier stages (:func:`_nested_activation`; a V's
    first chunk under its second): for q < k on d, F(q, j) starts no later than F(k, j) and
    B(q, j), which needs B(k, j) done, ends no earlier than B(k, j) ends, so from F(k, j)'s start
    until B(k, j)'s end micro-batch j holds stage q's activation too; after B(k, j) it is
    counted as holding only ``wgm`` (then nothing after W(k, j)), less than it holds, which
    only admits more (x, y) below. With different micro-batches ``act`` is stage k's alone.
    A device's later stages and what the rest hold only add to it, so at f_i, of the i - 1
    micro-batches already started, x still hold a whole
    activation and y only the weight-gradient part, with ``act * (least x + 1 factors) + wgm *
    (next least y) <= limit - static`` (so x <= M - 1, M = :func:`_max_in_flight`); the other
    u = i - 1 - x have ended their B and z = u - y their W (where B's end frees everything, a
    fused B or a weight-gradient part of 0 bytes, y and z are 0: no W need have ended).
    Writing ``lo_i`` for a bound on ``f_i - f_1``:

    * ``f_i - f_1 >= lo_u + hold``: the u micro-batches that ended B are distinct, so one of
      them is F number >= u, and it held its activation from its F start for at least ``hold =
      min_j (round_trip_k(j) + B_k c_j)``; likewise ``lo_z + hold_w`` with W's end (``+ W_k
      c_j``);
    * ``f_i - f_1 >= (i - 1) F + u B + z W``: those F's, B's and W's all ran on d between f_1
      and f_i (F, B, W: the least over the micro-batches);
    * ``f_i - f_1 >= min_j round_trip_k(j) + max(0, i - 1 - M) F + u B + z W`` when u >= 1:
      until the first B starts nothing is released, so at most M F's start before it; the rest
      of them, and every B and W, run after it;
    * ``f_i >= f_{i-1} + F``.

    For each x the most y is the least case (every term falls as y grows), so f_i - f_1 is at
    least the least over x of the largest term, and ``lo`` follows from ``lo_1 = 0``. Only the
    :data:`_MEMORY_OPTIONS` largest x are evaluated in full, smaller x by their first term
    alone (it grows as x falls), which can only lower the bound. ``lo`` is computed so up to
    i = :data:`_MEMORY_ROUNDS` * M, then stepped: for every i > M, ``f_i - f_{i-M} >= step =
    min(hold_w if no weight-gradient part fits beside M - 1 whole activations and the new one
    else hold, hold + F)`` (x = M - 1 gives u = i - M; a smaller x gives u >= i - M + 1 and
    ``f_{i-M+1} >= f_{i-M} + F``), so ``f_m - f_1 >= lo_j + step * (m - j) / M`` for the j of
    the last M computed with ``m - j`` a multiple of M. Then the makespan is at least
    ``a + lo_m`` plus what follows the last F of the stage (a = the stage's earliest arrival):
    that micro-batch's path from F(k, j) (round trip, its B's down to stage 0 with the links,
    W(0, j), and its own W(k, j)), the least over j. Different micro-batches: F, B, W, hold and
    the path are their least and the memory counts take the least-memory micro-batches first,
    which only enlarges the set of (x, y). A device's bound is the largest over its stages.

    A V's first chunk after its second's B (identical micro-batches; :func:`_nested_tail`):
    for a stage k on d above the device's earlier stages q < k (the highest k1), micro-batch
    j still holds their activations after B(k, j) ends, until B(k1, j) ends, which needs the
    backward chain B(k - 1) .. B(k1) with its link delays (``chain``) after B(k, j)'s end;
    every B(q, j) ends no earlier. So the same recursion holds with that part (the earlier
    stages' activations) in place of the weight-gradient part and ``chain`` in place of W in
    ``hold_w``: counting only the part, not also what W(k, j) keeps, admits more (x, y).
    In the work term the z micro-batches whose part is released ran B(k1) on d between f_1
    and f_i (after their F(k) >= f_1), so B(k1) takes W's place there. Only the makespan
    form is taken (B(k1)'s end is no W(k)'s end). E.g. ``crosspipe-v`` p = 8, m = 32,
    latency 8 F (``benchmarks/search.py --families``): 136.1 -> 138.0 s (device 7).

    Cost O(min(m, M * _MEMORY_ROUNDS)) per stage (and sorting its memory factors when they
    differ), the round trips and paths once per problem. A stage is skipped (0: still a
    bound) where its device time per micro-batch, F + B + W, is at least ``hold_w / M``:
    memory does not pace the steady state there, and :func:`warmup_bound` already counts the
    warm-up and cool-down.
    """
    return tuple(mk for mk, _, _ in _memory_bounds(problem))


def stage_memory_bound(problem: Problem) -> tuple[float, ...]:
    """Per device, :func:`memory_bound` with each stage's own activation only (seconds): what
    one stage's memory alone forces, for a model that keeps one stage exactly (the relaxation
    bound of :mod:`pipeopt.solvers.relaxation` picks its stage by it)."""
    return tuple(mk for mk, _, _ in _memory_bounds(problem, nested=False))


def _memory_bounds(problem: Problem, nested: bool = True) -> list[tuple[float, float, float]]:
    """Per device, (:func:`memory_bound`, its span form: ``lo_m`` plus F(k, j) start to
    W(k, j) end, the device's own ops from its first F to its last W; its iteration form: the
    stage's last W ends no earlier than ``a + lo_m`` plus that, then its gradient reduction
    runs), the largest over the device's stages (``nested``: see :func:`_memory_stage`)."""
    out = []
    per: _Paths = {}
    if any(x is not None for x in problem.memory_limit):
        per = {j: (round_trips(problem, j), _arrival(problem, j), _path(problem, j))
               for j in problem.distinct_microbatches}
    for d in range(problem.devices):
        if problem.memory_limit[d] is None:
            out.append((0.0, 0.0, 0.0))
            continue
        got = [(k, *_memory_stage(problem, d, k, per, nested))
               for k in problem.device_stages[d]]
        if nested:  # a V's first chunk held after its second's B (see memory_bound)
            for k in problem.device_stages[d]:
                part = _nested_tail(problem, d, k)
                if part is not None:
                    got.append((k, *_memory_stage(problem, d, k, per, tail_part=part)))
        out.append((max(x for _, x, _, _ in got), max(y for _, _, y, _ in got),
                    max(z + problem.grad_reduce[k] if z > 0 else 0.0 for k, _, _, z in got)))
    return out


def makespan_lower_bound(problem: Problem) -> float:
    """A lower bound on the makespan (and so on the iteration time) of any schedule."""
    return _makespan_bound(problem, _memory_bounds(problem))


def _makespan_bound(problem: Problem, memory: list[tuple[float, float, float]]) -> float:
    """:func:`makespan_lower_bound` given ``memory = _memory_bounds(problem)``."""
    return max(critical_path(problem), *device_bound(problem), *warmup_bound(problem),
               overtaking_bound(problem), passing_bound(problem), block_bound(problem),
               *(mk for mk, _, _ in memory), link_bound(problem))


def span_lower_bound(problem: Problem) -> float:
    """A lower bound on the largest per-device span: a device's work plus the idle time of its
    warm-up and cool-down (:func:`pipeline_idle`), or :func:`memory_bound`'s span form (from
    the device's first F to its last W)."""
    idle = pipeline_idle(problem)
    return max(*(problem.device_work(d) + idle[d] for d in range(problem.devices)),
               *(span for _, span, _ in _memory_bounds(problem)))


def iteration_lower_bound(problem: Problem) -> float:
    """A lower bound on the iteration time: the makespan bound, and for each device holding one
    stage, its :func:`warmup_bound` plus that stage's gradient reduction (the device's last op
    is the stage's last W, or fused B, after which the reduction runs); and
    :func:`memory_bound`'s bound on each stage's last W plus its reduction."""
    memory = _memory_bounds(problem)
    out = _makespan_bound(problem, memory)
    for d, bound in enumerate(warmup_bound(problem)):
        stages = problem.device_stages[d]
        if len(stages) == 1:
            out = max(out, bound + problem.grad_reduce[stages[0]])
    if any(problem.grad_reduce):
        out = max(out, *(it for _, _, it in memory))
    return out


def lower_bound(problem: Problem, objective: Objective = "makespan") -> float:
    """The analytic lower bound on ``objective`` for ``problem`` (seconds): the largest
    per-device span, or the iteration time (the makespan plus the gradient reduction still
    running after it; the makespan bound when there is none)."""
    return span_lower_bound(problem) if objective == "span" else iteration_lower_bound(problem)
