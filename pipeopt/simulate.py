"""The simulator, single source of truth for timings, and the validator.

:func:`simulate` turns an ordered list of ops per device into a timed :class:`Schedule`: every op
starts as early as its device and its inputs allow. Inputs are:

* F of stage k+1 needs F of stage k of the same micro-batch, plus the link delay;
* B of stage k needs its own F and B of stage k+1 (plus the link delay); the last stage's B
  needs only its F (the loss);
* W needs its own B;
* a device runs one op at a time, in the given order;
* a message occupies its directed link for ``message_size / bandwidth`` seconds, one message at
  a time per direction, in the order the messages became ready; latency is a pure delay after.

Micro-batch j's op durations and message bytes are scaled by the problem's per-micro-batch
factors (:attr:`Problem.time_table`, :attr:`Problem.message_table`).

The timing is the core simulator's (:mod:`pipeopt.core.simulate`, the judge of timings for
every workload) over the problem's task graph (:func:`pipeopt.workloads.training.build`, task
id = op id), and so is the report of a deadlock; this module speaks the chain's language around
it: orders of ops in, a :class:`Schedule` out, errors naming ops. A caller that times several
orders of one problem builds the graph once (:func:`pipeopt.workloads.training.chain_graph`)
and hands it to every call; without one, the problem object's cached graph is used
(:func:`pipeopt.workloads.training.graph_of`).

:func:`validate` checks any timed schedule (from any solver, or a file) against the problem with
code that shares nothing with the simulator.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from functools import partial
from itertools import pairwise

from pipeopt._gc import cyclic_gc_paused
from pipeopt.core.simulate import DeadlockError as CoreDeadlock
from pipeopt.core.simulate import OrderError, time_orders
from pipeopt.problem import Op, Problem
from pipeopt.schedule import Message, Schedule, SolverInfo, TimedOp, TimedOps
from pipeopt.workloads import training


class ScheduleError(ValueError):
    """A schedule that breaks the problem's rules; the message names the first violation."""

    def __init__(self, message: str, violations: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.violations = list(violations) or [message]


class DeadlockError(ScheduleError):
    """The device orders wait on each other in a cycle; ``cycle`` lists the waiting ops."""

    def __init__(self, message: str, cycle: Sequence[tuple[int, Op, Op]]) -> None:
        super().__init__(message)
        self.cycle = list(cycle)


Orders = Sequence[Sequence[Op]]


def _check_orders(problem: Problem, orders: Orders) -> None:
    """Every op exactly once, each on the device that holds its stage: raises
    :class:`ScheduleError` naming the first offending position, in device and order order."""
    p = problem.devices
    if len(orders) != p:
        raise ScheduleError(f"orders: expected {p} device lists, got {len(orders)}")
    seen: set[Op] = set()
    kinds = set(problem.kinds)
    s, m = problem.stages, problem.microbatches
    for d, order in enumerate(orders):
        for pos, op in enumerate(order):
            if op.kind not in kinds or not (0 <= op.stage < s) or not (0 <= op.microbatch < m):
                raise ScheduleError(f"orders[{d}][{pos}]: {op} is not an op of this problem")
            if problem.stage_device[op.stage] != d:
                raise ScheduleError(
                    f"orders[{d}][{pos}]: {op} belongs on device {problem.stage_device[op.stage]}")
            if op in seen:
                raise ScheduleError(f"orders[{d}][{pos}]: {op} appears twice")
            seen.add(op)
    if len(seen) != problem.num_ops:
        missing = next(op for op in problem.ops() if op not in seen)
        raise ScheduleError(f"orders: {problem.num_ops - len(seen)} ops missing, e.g. {missing}")


def _task_orders(problem: Problem, orders: Orders, check: bool) -> list[list[int]]:
    """The orders as task ids of :func:`pipeopt.workloads.training.build`'s graph. With
    ``check``, every op's fields are in range (an op outside the problem has no id, and a
    wrong one could alias another op's); then the core checks devices, repeats and gaps."""
    kinds = {k: i for i, k in enumerate(problem.kinds)}
    s, m = problem.stages, problem.microbatches
    if check:
        if len(orders) != problem.devices:
            _check_orders(problem, orders)  # raises, naming the fault
        for order in orders:
            if not order:
                continue
            try:
                kind, stage, mb = zip(*order, strict=True)
            except (TypeError, ValueError):
                _check_orders(problem, orders)
                raise
            if not (set(kind) <= kinds.keys() and min(stage) >= 0 and max(stage) < s
                    and min(mb) >= 0 and max(mb) < m):
                _check_orders(problem, orders)
    return training.task_orders(problem, orders)


def simulate(problem: Problem, orders: Orders, method: str = "custom",
             solver: SolverInfo | None = None, *, check: bool = True,
             graph: training.ChainGraph | None = None) -> Schedule:
    """Time the per-device op ``orders`` as early as possible.

    The timing is the core simulator's (:func:`pipeopt.core.simulate.simulate`) over the
    problem's task graph (:func:`pipeopt.workloads.training.build`). ``graph``: that graph
    built once (:func:`pipeopt.workloads.training.chain_graph`) by a caller that times several
    orders of one problem; ``None`` takes the problem object's graph from
    :func:`pipeopt.workloads.training.graph_of` (built on the first call, about 0.02-0.03 s of
    CPU at p = 64, m = 1024, then kept while the problem lives). ``check=False`` skips the
    order checks (for orders a generator or a search made whole). The schedule's ops are
    :class:`~pipeopt.schedule.TimedOps` (columns; each op made when first read).

    Raises :class:`ScheduleError` when an order misses or repeats an op,
    :class:`DeadlockError` when the orders wait on each other in a cycle, and
    :class:`ValueError` when ``graph`` was built for another problem.
    """
    with cyclic_gc_paused():
        ops, msgs = _time(problem, orders, check=check, graph=graph)
        return Schedule(problem=problem, method=method, ops=ops, messages=msgs,
                        solver=solver or SolverInfo())


def _time(problem: Problem, orders: Orders, *, check: bool = True, events: bool = False,
          graph: training.ChainGraph | None = None
          ) -> tuple[TimedOps, tuple[Message, ...]]:
    """Timed ops (in op id order, as columns) and messages of ``orders``, from the core
    simulator, with its errors in the chain's terms (ops, not task ids). ``graph``: the
    problem's graph built once (:func:`pipeopt.workloads.training.chain_graph`), else the
    problem's cached one (:func:`pipeopt.workloads.training.graph_of`)."""
    if graph is not None and graph.problem is not problem and graph.problem != problem:
        raise ValueError("simulate: graph: built for another problem (make it with "
                         "pipeopt.workloads.training.chain_graph(problem))")
    tg = training.graph_of(problem) if graph is None else graph.graph
    tasks = _task_orders(problem, orders, check)
    try:
        start, end, timed = time_orders(tg, tasks, check=check, events=events)
    except CoreDeadlock as exc:
        op = partial(training.task_op, problem)
        cycle = [(d, op(i), op(w)) for d, i, w in exc.cycle]
        raise DeadlockError(str(exc), cycle) from None
    except OrderError as exc:
        _check_orders(problem, orders)  # names the fault as the chain always has
        raise ScheduleError(str(exc)) from None
    dev, stage, mb, kind = problem.op_table
    ops = TimedOps(dev, stage, mb, kind, start, end)  # each TimedOp made when first read
    src, dst = tg.src, tg.dst
    msgs = tuple(Message(dev[a], dev[b], stage[a], stage[b], mb[a], kind[a], t0, t1, arrival)
                 for a, b, t0, t1, arrival in ((src[mm.edge], dst[mm.edge], *mm[1:])
                                               for mm in timed))
    return ops, msgs


def from_starts(problem: Problem, start: Sequence[float], method: str = "custom",
                solver: SolverInfo | None = None) -> Schedule | None:
    """The schedule :func:`simulate` returns for the device orders that ``start`` (seconds per
    op, in op-id order: :attr:`Problem.op_table`) implies, when those starts are exactly its
    times; else None (and None where the check does not apply: messages occupy links, an op
    lasts 0 s). The check (:func:`pipeopt.validate_fast.earliest_ends`) proves equality with
    the simulator's fixed point in a few numpy passes instead of timing the orders again: for
    a list scheduler that times its ops by the simulator's rules (the greedy)."""
    from pipeopt.validate_fast import earliest_ends

    with cyclic_gc_paused():
        end = earliest_ends(problem, start)
        if end is None:
            return None
        dev, stage, mb, kind = problem.op_table
        return Schedule(problem=problem, method=method,
                        ops=TimedOps(dev, stage, mb, kind, start, end), messages=(),
                        solver=solver or SolverInfo())


def _simulate_events(problem: Problem, orders: Orders
                     ) -> tuple[TimedOps, tuple[Message, ...]]:
    """The event-driven path of the core simulator, even when no message occupies a link (the
    fast path's cross-check)."""
    return _time(problem, orders, events=True)


# ----- validation --------------------------------------------------------------------------

def check(schedule: Schedule, *, tolerance: float = 1e-9) -> list[str]:
    """Every violation of the problem's rules in ``schedule`` (an empty list when valid).

    Checks: every op exactly once on its stage's device, durations, starts >= 0, inputs
    finished (plus link delays) before each op starts, links carrying one message at a time, no
    overlap on a device, memory within the limits. ``tolerance`` is relative to the makespan.
    """
    problem = schedule.problem
    tol = tolerance * max(1.0, schedule.makespan)
    out: list[str] = []
    # Keyed by (kind, stage, microbatch) tuples, which equal and hash like the Op of the
    # same fields: Op objects are made only for messages.
    times: dict[tuple[str, int, int], TimedOp] = {}
    kinds = set(problem.kinds)
    durations = problem.durations
    # Per stage, per micro-batch time factors; None when every micro-batch takes the unit time.
    table = problem.time_table if problem.microbatch_scale else None
    s, m, sdev = problem.stages, problem.microbatches, problem.stage_device
    for o in schedule.ops:
        d, k, j, kind, start, end = o
        key = (kind, k, j)
        if kind not in kinds or not (0 <= k < s) or not (0 <= j < m):
            out.append(f"{o.op}: not an op of this problem")
            continue
        if key in times:
            out.append(f"{o.op}: scheduled twice")
            continue
        times[key] = o
        if d != sdev[k]:
            out.append(f"{o.op}: on device {d}, its stage is on device {sdev[k]}")
        if not (math.isfinite(start) and math.isfinite(end)):
            out.append(f"{o.op}: start/end must be finite numbers")
            continue
        if start < -tol:
            out.append(f"{o.op}: starts at {start:g} < 0")
        want = durations[kind][k] * table[k][j] if table else durations[kind][k]
        if abs((end - start) - want) > tol:
            out.append(f"{o.op}: lasts {end - start:g}, its duration is {want:g}")
    missing = [] if len(times) == problem.num_ops else [
        op for op in problem.ops() if op not in times]
    if missing:
        out.append(f"{len(missing)} ops missing, first {missing[0]}")
    first = min((o for o in schedule.ops if math.isfinite(o.start)), key=lambda o: o.start,
                default=None)
    if first is not None and first.start > tol:
        out.append(f"{first.op}: the first op starts at {first.start:g}; times count from the "
                   "iteration's start, so the first op starts at 0")

    # Messages on links: given by the schedule, or rebuilt first-come-first-served.
    msgs = {(mm.src_stage, mm.dst_stage, mm.microbatch, mm.kind): mm for mm in schedule.messages}
    if len(msgs) < len(schedule.messages):  # each message crosses its link once
        seen: set[tuple[int, int, int, str]] = set()
        for mm in schedule.messages:
            key = (mm.src_stage, mm.dst_stage, mm.microbatch, mm.kind)
            if key in seen:
                out.append(f"message {mm.kind} {mm.src_stage}->{mm.dst_stage} mb "
                           f"{mm.microbatch}: listed more than once")
                break
            seen.add(key)
    if problem.has_link_contention and not schedule.messages and not missing:
        # A file without messages (SPEC section 2 has none): find one-at-a-time sending
        # orders, first-ready-first-served (the simulator's rule), else in deadline order
        # (a receiver that starts early needs its message first).
        msgs = _sent_messages(problem, times, "ready")
        if _late_messages(problem, msgs, times, tol):
            edf = _sent_messages(problem, times, "due")
            if not _late_messages(problem, edf, times, tol):
                msgs = edf
    out.extend(_check_links(problem, msgs, times, tol))

    # Inputs of every op, from Problem.inputs: the same kinds and stages for every micro-batch.
    # Its latency is the same for every micro-batch too, and whether its message occupies the
    # link (tx > 0), except when a scale rounds a tiny transmission time to 0.
    sources = {}
    for kind in problem.kinds:
        for k in range(s):
            sources[(kind, k)] = [(src.kind, src.stage, problem.transfer(src.stage, k))
                                  for src in problem.inputs(Op(kind, k, 0))]
    scaled_msgs = not problem.uniform_microbatches
    for (kind, k, j), o in times.items():
        for src_kind, src_stage, (tx, lat) in sources[(kind, k)]:
            so = times.get((src_kind, src_stage, j))
            if so is None:
                continue
            if scaled_msgs and tx > 0:  # (a tiny message scaled down can round to no time)
                tx = problem.transfer(src_stage, k, j)[0]
            if tx > 0:
                mm = msgs.get((src_stage, k, j, src_kind))
                if mm is None:
                    out.append(f"{o.op}: no message carries its input "
                               f"{Op(src_kind, src_stage, j)} across the link")
                    continue
                ready = mm.arrival
            else:
                ready = so.end + lat
            if o.start < ready - tol:
                out.append(f"{o.op}: starts at {o.start:g} before its input "
                           f"{Op(src_kind, src_stage, j)} is available at {ready:g}")

    per_dev: list[list[TimedOp]] = [[] for _ in range(problem.devices)]
    for o in times.values():
        if 0 <= o.device < problem.devices:
            per_dev[o.device].append(o)
    for d, lst in enumerate(per_dev):
        lst.sort(key=lambda o: (o.start, o.end))
        for a, b in pairwise(lst):
            if b.start < a.end - tol:
                out.append(f"device {d}: {b.op} starts at {b.start:g} while {a.op} runs until "
                           f"{a.end:g}")

    if not missing:
        for d, (peak, lim) in enumerate(zip(schedule.peak_memory, problem.memory_limit,
                                            strict=True)):
            if lim is not None and peak > lim * (1 + 1e-9) + 1e-12:
                out.append(f"device {d}: peak memory {peak:g} exceeds the limit {lim:g}")
    return out


def _sent_messages(problem: Problem, times: dict[tuple[str, int, int], TimedOp],
                   order: str = "ready") -> dict[tuple[int, int, int, str], Message]:
    """The messages of a timed schedule sent one at a time on each directed link, each as soon
    as its producer has ended and the link is free, in the ``order``: ``ready``, first ready
    first served (the simulator's rule), or ``due``, by deadline (the latest start that still
    reaches the receiver in time: the order that serves a receiver which starts early)."""
    per_link: dict[tuple[int, int], list[tuple[float, float, int, int, str, int, float,
                                               float]]] = {}
    sd = problem.stage_device
    for o in times.values():
        op = o.op
        for dst in _dependents(problem, op):
            tx, lat = problem.transfer(op.stage, dst.stage, op.microbatch)
            if tx > 0:
                recv = times.get((dst.kind, dst.stage, dst.microbatch))
                due = (recv.start if recv is not None else math.inf) - tx - lat
                per_link.setdefault((sd[op.stage], sd[dst.stage]), []).append(
                    (o.end, due, op.stage, op.microbatch, op.kind, dst.stage, tx, lat))
    out = {}
    for (a, b), lst in per_link.items():
        lst.sort(key=(lambda e: (e[1], e)) if order == "due" else (lambda e: (e[0], e[2:])))
        t = 0.0
        for ready, _, k, j, kind, dk, tx, lat in lst:
            t = max(t, ready)
            out[(k, dk, j, kind)] = Message(a, b, k, dk, j, kind, t, t + tx, t + tx + lat)
            t += tx
    return out


def _late_messages(problem: Problem, msgs: dict[tuple[int, int, int, str], Message],
                   times: dict[tuple[str, int, int], TimedOp], tol: float) -> int:
    """How many of ``msgs`` arrive after their receiver starts."""
    late = 0
    for (k, dk, j, kind), mm in msgs.items():
        for dst in _dependents(problem, Op(kind, k, j)):
            recv = times.get((dst.kind, dst.stage, dst.microbatch))
            if dst.stage == dk and recv is not None and mm.arrival > recv.start + tol:
                late += 1
    return late


def _dependents(problem: Problem, op: Op) -> list[Op]:
    """The ops that take ``op``'s output as an input (the reverse of :func:`_inputs`)."""
    k, j = op.stage, op.microbatch
    if op.kind == "F":
        return ([Op("F", k + 1, j)] if k < problem.stages - 1 else []) + [Op("B", k, j)]
    if op.kind == "B":
        out = [Op("B", k - 1, j)] if k > 0 else []
        return out + ([Op("W", k, j)] if problem.split_backward else [])
    return []


def _check_links(problem: Problem, msgs: dict[tuple[int, int, int, str], Message],
                 times: dict[tuple[str, int, int], TimedOp], tol: float) -> list[str]:
    out = []
    per_link: dict[tuple[int, int], list[Message]] = {}
    sd = problem.stage_device
    for (k, dk, j, kind), mm in msgs.items():
        if not (0 <= k < problem.stages and 0 <= dk < problem.stages) or abs(k - dk) != 1:
            out.append(f"message {k}->{dk} mb {j}: not between adjacent stages")
            continue
        tx, lat = problem.transfer(k, dk, j if 0 <= j < problem.microbatches else None)
        name = f"message {kind} {k}->{dk} mb {j}"
        if kind != ("F" if dk == k + 1 else "B"):
            out.append(f"{name}: a message from stage {k} to {dk} carries "
                       f"{'an activation (kind F)' if dk == k + 1 else 'a gradient (kind B)'}")
            continue
        if (mm.src_device, mm.dst_device) != (sd[k], sd[dk]):
            out.append(f"{name}: on link {mm.src_device}->{mm.dst_device}, expected "
                       f"{sd[k]}->{sd[dk]}")
        if abs((mm.end - mm.start) - tx) > tol or abs(mm.arrival - mm.end - lat) > tol:
            out.append(f"{name}: takes {mm.end - mm.start:g}+{mm.arrival - mm.end:g}, "
                       f"expected {tx:g}+{lat:g}")
        src = times.get((kind, k, j))
        if src is not None and mm.start < src.end - tol:
            out.append(f"{name}: sent at {mm.start:g} before {src.op} ends at {src.end:g}")
        per_link.setdefault((mm.src_device, mm.dst_device), []).append(mm)
    for (a, b), lst in per_link.items():
        lst.sort(key=lambda mm: mm.start)
        for x, y in pairwise(lst):
            if y.start < x.end - tol:
                out.append(f"link {a}->{b}: message {y.kind} {y.src_stage}->{y.dst_stage} mb "
                           f"{y.microbatch} overlaps the previous one")
    return out


#: From this many ops on, :func:`validate` first runs the vectorised pass
#: (:func:`pipeopt.validate_fast.is_valid`) and the per-op check only when it finds a violation
#: (to name it) or does not apply. CPU time of a valid ZB-H1 schedule on the 2-core development
#: machine, 2026-12-03: check / is_valid = 1.3 at 96 ops, 3.3 at 1,536, 3.6 at 921,600 (2.7 s
#: against 0.75 s).
FAST_CHECK_MIN_OPS = 1_000
#: ... once numpy is imported; before, from this many ops: importing it takes about 0.095 s of
#: CPU, what the per-op check spends on about 60,000 ops, and the vectorised pass saves about
#: 1.2 us per op, so it pays from about 80,000 ops.
FAST_CHECK_IMPORT_OPS = 80_000


def validate(schedule: Schedule, *, tolerance: float = 1e-9) -> Schedule:
    """Return ``schedule`` if it obeys every rule, else raise :class:`ScheduleError` naming the
    first violation."""
    n = schedule.problem.num_ops
    if n >= FAST_CHECK_MIN_OPS and ("numpy" in sys.modules or n >= FAST_CHECK_IMPORT_OPS):
        from pipeopt.validate_fast import is_valid

        with cyclic_gc_paused():
            if is_valid(schedule, tolerance=tolerance):
                return schedule
    with cyclic_gc_paused():
        violations = check(schedule, tolerance=tolerance)
    if violations:
        more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
        raise ScheduleError(f"invalid schedule: {violations[0]}{more}", violations)
    return schedule


def retime(schedule: Schedule) -> Schedule:
    """Re-simulate a schedule's device orders (the earliest-start timing of the same orders)."""
    return simulate(schedule.problem, schedule.device_orders(), schedule.method, schedule.solver)
