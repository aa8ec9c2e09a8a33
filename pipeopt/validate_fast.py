"""A vectorised pass of the validator's rules for large schedules (issue 18 item 7).

:func:`pipeopt.simulate.check` walks every op in Python and names each violation; at a million
ops that is seconds that a time limit has to pay. :func:`is_valid` answers only "valid or
not" for the same rules with numpy over whole columns, in a third to a fifth of the CPU time
(0.75 s against 2.7 s at 921,600 ops on the 2-core development machine), so
:func:`pipeopt.simulate.validate` can afford to validate every large schedule and falls back to
the full check (for the messages) only when this pass finds something wrong. The memory peaks
are computed here from the same columns (:attr:`Schedule.peak_memory` walks every op in
Python): at p = 64, m = 1024 (196,608 ops) that and reading the columns field by field cut
the pass from 0.50 s to 0.13 s of CPU (same process, loaded 2-core machine, 2026-12-04).

It applies when no message occupies a link (no ``messages`` in the schedule and no link
contention in the problem: every input is then ready ``latency`` after its producer ends, the
rule the full check applies); otherwise it answers None and the full check runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from pipeopt.problem import Op
from pipeopt.schedule import TimedOps

if TYPE_CHECKING:
    from pipeopt.problem import Problem
    from pipeopt.schedule import Schedule


def is_valid(schedule: Schedule, *, tolerance: float = 1e-9) -> bool | None:
    """True when ``schedule`` obeys every rule :func:`pipeopt.simulate.check` checks, False
    when it breaks one, None when this pass does not apply (messages occupy links, or numpy is
    missing). ``tolerance`` is relative to the makespan, as there."""
    problem = schedule.problem
    if schedule.messages or problem.has_link_contention:
        return None
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency of the cost model
        return None
    ops = schedule.ops
    n = problem.num_ops
    if len(ops) != n:
        return False  # an op missing or scheduled twice
    tol = tolerance * max(1.0, schedule.makespan)
    kinds = problem.kinds
    s, m = problem.stages, problem.microbatches
    if isinstance(ops, TimedOps):  # the simulator's columns as they are (no TimedOp made)
        device, stage, mb, kind, start, end = ops.columns
    else:  # one field of every op at a time (a third of the time of unzipping the ops)
        device, stage, mb, kind, start, end = (tuple(map(itemgetter(f), ops))
                                               for f in range(6))
    code = {k: i for i, k in enumerate(kinds)}
    if (device, stage, mb, kind) == problem.op_table:
        # Every op in op-id order, as the simulator lists them (its columns are the problem's
        # own, so the compare is mostly by identity): kind, stage, micro-batch and device
        # follow from the position.
        op_pos = np.arange(n, dtype=np.int64)
        j, group = op_pos % m, op_pos // m
        st, kc = group % s, group // s
        dev = np.asarray(problem.stage_device, np.int64)[st]
    else:
        try:
            kc = np.fromiter(map(code.__getitem__, kind), np.int64, n)
        except KeyError:
            return False  # not a kind of this problem
        dev = np.fromiter(device, np.int64, n)
        st = np.fromiter(stage, np.int64, n)
        j = np.fromiter(mb, np.int64, n)
    t0 = np.fromiter(start, np.float64, n)
    t1 = np.fromiter(end, np.float64, n)
    if (st.min() < 0 or st.max() >= s or j.min() < 0 or j.max() >= m
            or not (np.isfinite(t0).all() and np.isfinite(t1).all())):
        return False
    # Every op exactly once: n ops with n distinct ids in [0, n) cover them all.
    gid = kc * s + st  # (kind, stage) group
    op_id = gid * m + j
    seen = np.zeros(n, np.bool_)
    seen[op_id] = True
    if not seen.all():
        return False
    sdev = np.asarray(problem.stage_device, np.int64)
    if (dev != sdev[st]).any() or t0.min() < -tol or t0.min() > tol:
        return False  # wrong device, a start < 0, or times not counted from the first op
    dur = np.asarray([problem.durations[k] for k in kinds], np.float64).reshape(-1)
    want = dur[gid]
    if problem.microbatch_scale:
        want = want * np.asarray(problem.time_table, np.float64)[st, j]
    if (np.abs((t1 - t0) - want) > tol).any():
        return False
    # Inputs: in op-id order, each op starts once its inputs (same micro-batch) ended plus
    # the link's latency (the 0 that _inputs_ready starts from was checked above: t0 >= -tol).
    start_id = np.empty(n, np.float64)
    end_id = np.empty(n, np.float64)
    start_id[op_id] = t0
    end_id[op_id] = t1
    if (start_id < _inputs_ready(problem, np, end_id) - tol).any():
        return False
    # One op at a time per device: sorted by (device, start, end), each starts after the
    # previous one on its device ends.
    order = np.lexsort((t1, t0, dev))
    ds, s0, e0 = dev[order], t0[order], t1[order]
    same = ds[1:] == ds[:-1]
    if (same & (s0[1:] < e0[:-1] - tol)).any():
        return False
    limits = problem.memory_limit
    if any(lim is not None for lim in limits):
        # Every op lasting > 0 s and none overlapping the next on its device, even within the
        # tolerance: the memory events follow that device order (see _peak_memory).
        strict = bool((t1 > t0).all()) and not (same & (s0[1:] < e0[:-1])).any()
        peaks = _peak_memory(problem, np, dev, kc * s + st, st, j, t0, t1,
                             order if strict else None)
        for peak, lim in zip(peaks, limits, strict=True):
            if lim is not None and peak > lim * (1 + 1e-9) + 1e-12:
                return False
    return True


def _peak_memory(problem: Problem, np: Any, dev: Any, gid: Any, st: Any, j: Any, t0: Any,
                 t1: Any, order: Any = None) -> list[float]:
    """Per device, static memory plus the peak of memory in use (bytes): the value of
    :attr:`Schedule.peak_memory <pipeopt.schedule.Schedule.peak_memory>` from the op columns
    (device, (kind, stage) group, stage, micro-batch, start, end), without a Python loop over
    the ops (that loop was most of this pass's time at p = 64, m = 1024).

    The same events as :func:`pipeopt.schedule.memory_timeline`: an allocation at an op's
    start, a release at its end, releases first at equal times; each device's running sum is
    accumulated in the same order from its static memory, so the peaks are equal.

    ``order``: the ops sorted by (device, start), given when every op lasts > 0 s and none
    starts before the one before it on its device ends. Then that sort is the events' too
    (each op's allocation, then its release, op after op; a release and the next allocation
    at one time come in that order, as releases go first) and no second sort is needed."""
    deltas = problem.memory_deltas
    alloc = np.asarray([deltas.get((kind, k), (0.0, 0.0))[0] for kind in problem.kinds
                        for k in range(problem.stages)], np.float64)[gid]
    free = np.asarray([deltas.get((kind, k), (0.0, 0.0))[1] for kind in problem.kinds
                       for k in range(problem.stages)], np.float64)[gid]
    if not problem.uniform_microbatches:
        scale = np.asarray(problem.memory_table, np.float64)[st, j]
        alloc = alloc * scale
        free = free * scale
    if order is not None:
        ev_delta = np.empty(2 * len(order), np.float64)
        ev_delta[0::2] = alloc[order]
        ev_delta[1::2] = -free[order]
        keep = ev_delta != 0
        ev_dev, ev_delta = np.repeat(dev[order], 2)[keep], ev_delta[keep]
        return _device_peaks(problem, np, ev_dev, ev_delta)
    a, f = alloc != 0, free != 0
    ev_dev = np.concatenate((dev[a], dev[f]))
    ev_t = np.concatenate((t0[a], t1[f]))
    ev_kind = np.concatenate((np.ones(int(a.sum()), np.int8), np.zeros(int(f.sum()), np.int8)))
    ev_delta = np.concatenate((alloc[a], -free[f]))
    order = np.lexsort((ev_delta, ev_kind, ev_t, ev_dev))
    ev_dev, ev_delta = ev_dev[order], ev_delta[order]
    return _device_peaks(problem, np, ev_dev, ev_delta)


def _device_peaks(problem: Problem, np: Any, ev_dev: Any, ev_delta: Any) -> list[float]:
    """Per device, static memory plus the peak of the running sum of its events' deltas
    (bytes; events grouped by device, in time order within each)."""
    bounds = np.searchsorted(ev_dev, np.arange(problem.devices + 1))
    peaks = []
    for d, static in enumerate(problem.static_memory):
        lo, hi = bounds[d], bounds[d + 1]
        run = np.cumsum(np.concatenate(((static,), ev_delta[lo:hi])))
        peaks.append(max(static, float(run.max())))
    return peaks


def _inputs_ready(problem: Problem, np: Any, end: Any) -> Any:
    """Per op (op-id order), the latest of 0 and each of its inputs' end (``end``: seconds,
    op-id order) plus the link's latency: when its inputs are ready where links only delay
    (seconds). Ops of one (kind, stage) form a block of m ids, and so do their inputs."""
    s, m, kinds = problem.stages, problem.microbatches, problem.kinds
    code = {k: i for i, k in enumerate(kinds)}
    ready = np.zeros(problem.num_ops, np.float64)
    for kind_name in kinds:
        for k in range(s):
            g = (code[kind_name] * s + k) * m
            for src in problem.inputs(Op(kind_name, k, 0)):
                a = (code[src.kind] * s + src.stage) * m
                lat = problem.transfer(src.stage, k)[1]
                np.maximum(ready[g:g + m], end[a:a + m] + lat, out=ready[g:g + m])
    return ready


def earliest_ends(problem: Problem, start: Sequence[float]) -> list[float] | None:
    """The ends (seconds, op-id order) of the ops started at ``start`` (seconds, op-id order),
    when those starts are exactly :func:`pipeopt.simulate.simulate`'s for the device orders
    they imply (each device's ops by start time); else None, and None when this pass does not
    apply (messages occupy links, an op lasts 0 s, or numpy is missing).

    The simulator starts every op at the latest of 0, the end of the op before it on its device
    and each input's end plus the link's latency, and ends it its duration later, in floating
    point as here. Over the acyclic graph of those orders and the inputs that fixed point is
    unique (by induction in topological order), so starts that meet it with equality are the
    simulator's own times, bit for bit: a list scheduler whose event times follow the same
    rules (:mod:`pipeopt.solvers.greedy`) is timed without simulating again. With every
    duration positive, each device's starts are distinct and its order is the one the times
    give; two equal starts on a device fail the check."""
    if problem.has_link_contention:
        return None
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency of the cost model
        return None
    n, s, m = problem.num_ops, problem.stages, problem.microbatches
    if len(start) != n:
        return None
    kinds = problem.kinds
    if problem.uniform_microbatches:  # op_durations' values, read once per (kind, stage)
        dur = np.repeat(np.asarray([problem.duration(Op(kind, k, 0)) for kind in kinds
                                    for k in range(s)], np.float64), m)
    else:
        dur = np.asarray(problem.op_durations(), np.float64)
    if not (dur > 0).all():
        return None
    t0 = np.asarray(start, np.float64)
    t1 = t0 + dur
    ready = _inputs_ready(problem, np, t1)
    # The op before each on its device: ops sorted by (device, start).
    dev = np.repeat(np.tile(np.asarray(problem.stage_device, np.int64), len(kinds)), m)
    order = np.lexsort((t0, dev))
    same = dev[order[1:]] == dev[order[:-1]]
    after = order[1:][same]
    ready[after] = np.maximum(ready[after], t1[order[:-1][same]])
    if not np.array_equal(ready, t0):
        return None
    return t1.tolist()
