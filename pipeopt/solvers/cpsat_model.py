"""The CP-SAT model of one pipeline iteration, on integer time and memory units.

Read it like the model on paper. For every op ``o`` (kind F/B/W, stage k, micro-batch j):

* ``start[o]`` is an integer, ``end[o] = start[o] + dur[o]``, one fixed-size interval per op;
* no two ops of a device overlap (:func:`_add_intervals`);
* an op starts after its inputs end plus the link delay (:func:`_add_dependencies`); a message
  with a positive transmission time is an interval on its directed device link, one message at a
  time per direction (:func:`_add_links`);
* per device, the activations alive (F start to B / W end) stay within the free memory
  (:func:`_add_memory`);
* a stage's gradient reduction ends ``grad_reduce`` after its last W (:func:`_add_reduce`);
* micro-batches of equal cost are interchangeable, so each (stage, kind) runs those in order
  (:func:`_add_symmetry`); micro-batches of different cost are ordered freely;
* the objective: the iteration time or the largest per-device span (:func:`_add_objective`).

All numbers here are in grid units (see :mod:`pipeopt.solvers.cpsat_grid`); the caller maps them
back to seconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ortools.sat.python import cp_model

from pipeopt.problem import Op, Problem

Edge = tuple[Op, Op]


@dataclass
class IntData:
    """The problem on the integer grids: durations, delays and memory, all in units, per
    micro-batch (the lists of identical micro-batches share one value)."""

    problem: Problem
    dur: dict[str, list[list[int]]]  # kind -> stage -> micro-batch
    # (src stage, dst stage) -> per micro-batch transmission units (messages on links only)
    tx: dict[tuple[int, int], list[int]]
    lat: dict[tuple[int, int], int]  # (src stage, dst stage) -> latency units
    reduce: list[int]  # per stage, gradient reduction units
    # per device: (free capacity units, {stage: per micro-batch (units held F..B end,
    # units held F..W end)})
    memory: dict[int, tuple[int, dict[int, list[tuple[int, int]]]]]
    # per micro-batch, the previous / next one of equal cost (-1 if none): the in-order rule
    # of :func:`_add_symmetry` holds along these chains
    prev_equal: list[int] = field(default_factory=list)
    next_equal: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prev_equal:
            self.prev_equal, self.next_equal = equal_chains(self.problem)

    @property
    def last_kind(self) -> str:
        """The kind that ends a stage's work on a micro-batch (W, or the fused B)."""
        return "W" if self.problem.split_backward else "B"

    def d(self, op: Op) -> int:
        """Duration of ``op`` in units."""
        return self.dur[op.kind][op.stage][op.microbatch]

    def delay(self, src: int, dst: int, microbatch: int) -> int:
        """Units between the producer's end and the consumer's earliest start on idle links."""
        tx = self.tx.get((src, dst))
        return (tx[microbatch] if tx else 0) + self.lat.get((src, dst), 0)

    @property
    def last_microbatches(self) -> list[int]:
        """The last micro-batch of each group of equal ones: by the in-order rule, the last op
        of a stage is one of theirs (micro-batch m - 1 when all are equal)."""
        return [j for j, n in enumerate(self.next_equal) if n < 0]

    @property
    def first_microbatches(self) -> list[int]:
        """The first micro-batch of each group of equal ones (micro-batch 0 when all are
        equal)."""
        return [j for j, q in enumerate(self.prev_equal) if q < 0]


def equal_chains(problem: Problem) -> tuple[list[int], list[int]]:
    """Per micro-batch, the previous and the next micro-batch with the same scales (-1 when
    none): the chains along which equal micro-batches run in order."""
    m = problem.microbatches
    if problem.uniform_microbatches:
        return list(range(-1, m - 1)), [*range(1, m), -1]
    prev, nxt = [-1] * m, [-1] * m
    last: dict[tuple[float, ...], int] = {}
    for j, key in enumerate(problem.microbatch_key):
        q = last.get(key, -1)
        if q >= 0:
            prev[j], nxt[q] = q, j
        last[key] = j
    return prev, nxt


def edges(problem: Problem) -> Iterator[Edge]:
    """Every (producer, consumer) dependency."""
    for op in problem.ops():
        for src in problem.inputs(op):
            yield src, op


def topological_ops(problem: Problem) -> list[Op]:
    """Ops in an order where inputs and earlier micro-batches of the same (kind, stage) come
    first."""
    s, m = problem.stages, problem.microbatches
    out = [Op("F", k, j) for j in range(m) for k in range(s)]
    out += [Op("B", k, j) for j in range(m) for k in reversed(range(s))]
    if problem.split_backward:
        out += [Op("W", k, j) for j in range(m) for k in range(s)]
    return out


def heads_and_tails(data: IntData, with_reduce: bool) -> tuple[dict[Op, int], dict[Op, int]]:
    """Per op, the earliest start (head) and the least time from its start to the end of the
    iteration (tail, duration included), in units.

    Both follow the dependencies plus the in-order rule of :func:`_add_symmetry` (among equal
    micro-batches), so they hold for every solution of the model.
    """
    p = data.problem
    prev_eq, next_eq = data.prev_equal, data.next_equal
    order = topological_ops(p)
    head: dict[Op, int] = {}
    for op in order:
        t = 0
        for src in p.inputs(op):
            t = max(t, head[src] + data.d(src) + data.delay(src.stage, op.stage, src.microbatch))
        q = prev_eq[op.microbatch]
        if q >= 0:
            t = max(t, head[Op(op.kind, op.stage, q)] + data.d(op))
        head[op] = t
    succ: dict[Op, list[Op]] = {op: [] for op in order}
    for src, dst in edges(p):
        succ[src].append(dst)
    tail: dict[Op, int] = {}
    for op in reversed(order):
        d = data.d(op)
        t = d
        q = next_eq[op.microbatch]
        if with_reduce and op.kind == data.last_kind and q < 0:
            t = d + data.reduce[op.stage]
        for dst in succ[op]:
            t = max(t, d + data.delay(op.stage, dst.stage, op.microbatch) + tail[dst])
        if q >= 0:
            t = max(t, d + tail[Op(op.kind, op.stage, q)])
        tail[op] = t
    return head, tail


@dataclass
class ScheduleModel:
    """The CP-SAT model and its variables (all in units)."""

    data: IntData
    objective: str
    horizon: int
    model: cp_model.CpModel = field(default_factory=cp_model.CpModel)
    start: dict[Op, cp_model.IntVar] = field(default_factory=dict)
    end: dict[Op, Any] = field(default_factory=dict)  # affine expressions start + dur
    interval: dict[Op, cp_model.IntervalVar] = field(default_factory=dict)
    msg_start: dict[Edge, cp_model.IntVar] = field(default_factory=dict)
    lifetime: dict[tuple[Op, Op], cp_model.IntVar] = field(default_factory=dict)  # sizes
    first_start: dict[int, cp_model.IntVar] = field(default_factory=dict)  # span: per device
    value: cp_model.IntVar | None = None  # the objective variable
    lower: int = 0  # a bound on the objective implied by the model's data


def build_model(data: IntData, objective: str, horizon: int, lower: int = 0) -> ScheduleModel:
    """The full model with every op ending by ``horizon`` units; ``lower`` is a known bound on
    the objective in units (it lets the search stop as soon as it meets it)."""
    sm = ScheduleModel(data, objective, horizon, lower=lower)
    head, tail = heads_and_tails(data, with_reduce=objective == "makespan")
    _add_intervals(sm, head, tail)
    _add_dependencies(sm)
    _add_links(sm, head)
    _add_memory(sm)
    _add_symmetry(sm)
    _add_objective(sm, head, tail)
    _add_reduce(sm)
    return sm


def _add_intervals(sm: ScheduleModel, head: dict[Op, int], tail: dict[Op, int]) -> None:
    """One fixed-size interval per op; a device runs one op at a time."""
    p, md = sm.data.problem, sm.model
    per_device: list[list[cp_model.IntervalVar]] = [[] for _ in range(p.devices)]
    for op in p.ops():
        d = sm.data.d(op)
        # Domain from the longest dependency chains before and after the op (both valid for
        # every solution), which prunes the search before it starts.
        hi = max(head[op], sm.horizon - tail[op])
        sm.start[op] = md.new_int_var(head[op], hi, f"start[{op}]")
        sm.end[op] = sm.start[op] + d
        sm.interval[op] = md.new_fixed_size_interval_var(sm.start[op], d, f"run[{op}]")
        per_device[p.stage_device[op.stage]].append(sm.interval[op])
    for ivs in per_device:
        md.add_no_overlap(ivs)


def _add_dependencies(sm: ScheduleModel) -> None:
    """An op starts once its inputs ended, plus the latency when the input crosses devices.

    Messages that occupy a link (transmission > 0) are handled by :func:`_add_links`."""
    data = sm.data
    for src, dst in edges(data.problem):
        if (src.stage, dst.stage) in data.tx:
            continue
        sm.model.add(sm.start[dst] >= sm.end[src] + data.lat.get((src.stage, dst.stage), 0))


def _add_links(sm: ScheduleModel, head: dict[Op, int]) -> None:
    """A message is sent after its producer ends, occupies its directed link for ``tx`` units
    (one message at a time per direction), and is usable ``latency`` units after that."""
    data, md = sm.data, sm.model
    p = data.problem
    per_link: dict[tuple[int, int], list[cp_model.IntervalVar]] = {}
    for src, dst in edges(p):
        key = (src.stage, dst.stage)
        if key not in data.tx:
            continue
        tx, lat = data.tx[key][src.microbatch], data.lat.get(key, 0)
        lo = head[src] + data.d(src)
        ms = md.new_int_var(lo, max(lo, sm.horizon), f"send[{src}->{dst.stage}]")
        sm.msg_start[(src, dst)] = ms
        md.add(ms >= sm.end[src])
        md.add(sm.start[dst] >= ms + tx + lat)
        link = (p.stage_device[src.stage], p.stage_device[dst.stage])
        per_link.setdefault(link, []).append(
            md.new_fixed_size_interval_var(ms, tx, f"link[{src}->{dst.stage}]"))
    for ivs in per_link.values():
        md.add_no_overlap(ivs)


def _add_memory(sm: ScheduleModel) -> None:
    """Per device with a limit: the activation of micro-batch j on stage k is held from F's
    start to B's end (the part B frees) and to W's end (the weight-gradient part), and what is
    held never exceeds the free memory (limit minus static memory).

    A cumulative over these lifetime intervals: an interval ending at t frees its memory for one
    starting at t, as the problem's releases-before-allocations rule says."""
    data, md = sm.data, sm.model
    p = data.problem
    for _d, (cap, stages) in data.memory.items():
        ivs, demands = [], []
        for k, held in stages.items():
            for j, (held_to_b, held_to_w) in enumerate(held):
                f = Op("F", k, j)
                for kind, amount in (("B", held_to_b), ("W", held_to_w)):
                    if amount <= 0:
                        continue
                    rel = Op(kind, k, j)
                    size = md.new_int_var(0, sm.horizon, f"held[{f}..{rel}]")
                    sm.lifetime[(f, rel)] = size
                    ivs.append(md.new_interval_var(sm.start[f], size, sm.end[rel],
                                                   f"alive[{f}..{rel}]"))
                    demands.append(amount)
        if ivs:
            md.add_cumulative(ivs, demands, cap)
        if p.uniform_microbatches:
            _add_memory_precedences(sm, cap, {k: held[0] for k, held in stages.items()})


def _add_memory_precedences(sm: ScheduleModel, cap: int,
                            stages: dict[int, tuple[int, int]]) -> None:
    """Redundant precedences implied by the memory limit and the in-order rule (they let
    propagation see the limit early). Only when all micro-batches are equal (all in order,
    each holding the same memory).

    When F(k, j) starts, stage k alone holds its j+1 activations minus what the finished B's and
    W's released; in order, ``nb`` finished B's are B(k, 0..nb-1), at most j of them, and at most
    ``nb`` W's finished. So with a = to_b + to_w per activation: (j+1)·a - nb·a <= cap needs
    B(k, j - cap//a) finished, and a + (j - nw)·to_w <= cap needs W(k, j - (cap-a)//to_w - 1)
    finished.
    """
    md = sm.model
    m = sm.data.problem.microbatches
    for k, (to_b, to_w) in stages.items():
        a = to_b + to_w
        if a <= 0 or sm.data.dur["F"][k][0] <= 0:
            continue  # (a zero-length F could meet its own B's end; skip that corner)
        for j in range(m):
            f = sm.start[Op("F", k, j)]
            q = j - cap // a
            if q >= 0:
                md.add(f >= sm.end[Op("B", k, q)])
            if to_w > 0 and cap >= a:
                q = j - (cap - a) // to_w - 1
                if q >= 0:
                    md.add(f >= sm.end[Op("W", k, q)])


def _add_symmetry(sm: ScheduleModel) -> None:
    """Micro-batches of equal cost (the same time, memory and message scales) are
    interchangeable, so WLOG every (kind, stage) runs them in order: relabel the ops of any
    schedule among equal micro-batches by their start times, and dependencies, links, memory
    and objective all hold for the relabelled schedule (equal micro-batches have equal
    durations on each stage, so the i-th to start is also the i-th to end). The same holds for
    the messages of each stage pair on a link. Micro-batches of different cost keep any order:
    the search chooses it."""
    data, md = sm.data, sm.model
    nxt_eq = data.next_equal
    for op in data.problem.ops():
        q = nxt_eq[op.microbatch]
        if q >= 0:
            md.add(sm.start[Op(op.kind, op.stage, q)] >= sm.end[op])
    for (src, dst), ms in sm.msg_start.items():
        q = nxt_eq[src.microbatch]
        if q < 0:
            continue
        nxt = (Op(src.kind, src.stage, q), Op(dst.kind, dst.stage, q))
        if nxt in sm.msg_start:
            md.add(sm.msg_start[nxt] >= ms + data.tx[(src.stage, dst.stage)][src.microbatch])


def _last_ops(data: IntData) -> list[Op]:
    """Ops one of which ends each stage's work: the last micro-batch's W or fused B of each
    group of equal micro-batches (by the in-order rule; one per stage when all are equal)."""
    return [Op(data.last_kind, k, j) for k in range(data.problem.stages)
            for j in data.last_microbatches]


def _add_reduce(sm: ScheduleModel) -> None:
    """Each stage's gradient reduction runs after its last W and ends before the iteration does
    (the iteration time only; a span does not include it)."""
    data = sm.data
    if sm.objective != "makespan" or sm.value is None:
        return
    for op in _last_ops(data):
        red = data.reduce[op.stage]
        if red > 0:
            sm.model.add(sm.value >= sm.end[op] + red)


def _add_objective(sm: ScheduleModel, head: dict[Op, int], tail: dict[Op, int]) -> None:
    """``makespan``: minimise the iteration time (every op and reduction ends by it).
    ``span``: minimise the largest per-device time from the first F to the last op."""
    data, md = sm.data, sm.model
    p = data.problem
    last = _last_ops(data)
    if sm.objective == "makespan":
        # Implied bounds: the longest chain through any op; per device, its earliest op plus all
        # its work (it runs one op at a time).
        lower = max(head[op] + tail[op] for op in p.ops())
        for d in range(p.devices):
            ops = [op for op in p.ops() if p.stage_device[op.stage] == d]
            if ops:
                lower = max(lower, min(head[o] for o in ops) + sum(data.d(o) for o in ops))
        sm.lower = min(max(lower, sm.lower), sm.horizon)
        sm.value = md.new_int_var(sm.lower, max(sm.lower, sm.horizon), "iteration")
        for op in last:
            md.add(sm.value >= sm.end[op])
    else:
        # The first op of a device is F of its lowest stage on micro-batch 0 (in order, and
        # its other stages' F need that one's output first); with micro-batches of different
        # cost, on the first of some group of equal ones, so the span counts from the earliest
        # of those (a variable per device).
        lower = 0
        for d in range(p.devices):
            work = sum(data.d(o) for o in p.ops() if p.stage_device[o.stage] == d)
            lower = max(lower, work)
        sm.lower = min(max(lower, sm.lower), sm.horizon)
        sm.value = md.new_int_var(sm.lower, max(sm.lower, sm.horizon), "max_span")
        for d in range(p.devices):
            k0 = p.device_stages[d][0]
            firsts = [sm.start[Op("F", k0, j)] for j in data.first_microbatches]
            if len(firsts) == 1:
                first = firsts[0]
            else:
                first = md.new_int_var(0, sm.horizon, f"first[{d}]")
                md.add_min_equality(first, firsts)
                sm.first_start[d] = first
            for k in p.device_stages[d]:
                for op in last:
                    if op.stage == k:
                        md.add(sm.value >= sm.end[op] - first)
    md.minimize(sm.value)


def add_hints(sm: ScheduleModel, start_units: dict[Op, int],
              msg_units: dict[Edge, int]) -> int:
    """Hint every variable from a warm start (in units); returns the hinted objective.

    The warm start must already be relabelled in order (see :func:`_add_symmetry`)."""
    data, md = sm.data, sm.model
    p = data.problem

    def end(op: Op) -> int:
        return start_units[op] + data.d(op)

    for op, var in sm.start.items():
        md.add_hint(var, start_units[op])
    for e, var in sm.msg_start.items():
        md.add_hint(var, msg_units.get(e, end(e[0])))
    for (f, rel), var in sm.lifetime.items():
        md.add_hint(var, max(0, end(rel) - start_units[f]))
    last = _last_ops(data)
    firsts = data.first_microbatches
    first = [min(start_units[Op("F", p.device_stages[d][0], j)] for j in firsts)
             for d in range(p.devices)]
    for d, var in sm.first_start.items():
        md.add_hint(var, first[d])
    if sm.objective == "makespan":
        val = max([end(op) for op in last] + [end(op) + data.reduce[op.stage] for op in last])
    else:
        val = max(end(op) - first[p.stage_device[op.stage]] for op in last)
    if sm.value is not None:
        md.add_hint(sm.value, val)
    return val
