"""Schedule: the one result type every method returns, with its metrics and its JSON form.

A schedule is a set of timed ops (and the timed messages between devices) for a
:class:`~pipeopt.problem.Problem`. Metrics are derived from the times, never stored separately,
so a schedule cannot disagree with itself. Times in seconds, memory in bytes.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import repeat
from typing import Any, Literal, NamedTuple, overload

from pipeopt._gc import cyclic_gc_paused
from pipeopt.problem import Op, Problem

#: A timed op's end (field 5 of :class:`TimedOp`), read without an attribute lookup per op.
_END = operator.itemgetter(5)

Status = Literal["optimal", "feasible", "heuristic"]

#: The ``format`` of schedule JSON (SPEC section 2).
FORMAT = "pipeopt.schedule/v1"


class TimedOp(NamedTuple):
    """An op placed on ``device`` from ``start`` to ``end`` (seconds)."""

    device: int
    stage: int
    microbatch: int
    kind: str
    start: float
    end: float

    @property
    def op(self) -> Op:
        """The untimed op."""
        return Op(self.kind, self.stage, self.microbatch)


class TimedOps(Sequence[TimedOp]):
    """Timed ops held as columns, the form :func:`pipeopt.simulate.simulate` makes them in:
    per op, ``device``, ``stage``, ``microbatch``, ``kind``, ``start`` and ``end`` (seconds),
    tuples indexed alike. The :class:`TimedOp` tuples are made once, when first read
    (iterating, indexing); a schedule's metrics read the columns and never make them (at
    p = 64, m = 1024 making them is about a quarter of a ``simulate`` call). Equal to, and
    hashed like, the tuple of the same :class:`TimedOp` s; immutable."""

    __slots__ = ("_ops", "device", "end", "kind", "microbatch", "stage", "start")
    _COLUMNS = ("device", "stage", "microbatch", "kind", "start", "end")

    device: tuple[int, ...]
    stage: tuple[int, ...]
    microbatch: tuple[int, ...]
    kind: tuple[str, ...]
    start: tuple[float, ...]
    end: tuple[float, ...]

    def __init__(self, device: Iterable[int], stage: Iterable[int], microbatch: Iterable[int],
                 kind: Iterable[str], start: Iterable[float], end: Iterable[float]) -> None:
        cols = tuple(map(tuple, (device, stage, microbatch, kind, start, end)))
        if len(set(map(len, cols))) > 1:
            raise ValueError("TimedOps: the columns device, stage, microbatch, kind, start, end "
                             f"must have one length, got {[len(c) for c in cols]}")
        set_ = object.__setattr__
        for name, col in zip(self._COLUMNS, cols, strict=True):
            set_(self, name, col)
        set_(self, "_ops", None)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"TimedOps is immutable: cannot set {name}")

    @property
    def columns(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...],
                               tuple[str, ...], tuple[float, ...], tuple[float, ...]]:
        """(device, stage, microbatch, kind, start, end), per op."""
        return self.device, self.stage, self.microbatch, self.kind, self.start, self.end

    def rows(self) -> Iterator[tuple[int, int, int, str, float, float]]:
        """Each op's six fields as a plain tuple, in order, without making the TimedOps."""
        return zip(self.device, self.stage, self.microbatch, self.kind, self.start, self.end,
                   strict=True)

    def as_tuple(self) -> tuple[TimedOp, ...]:
        """The ops as a tuple of :class:`TimedOp` (made on the first call, then kept)."""
        ops = self._ops
        if ops is None:
            with cyclic_gc_paused():  # one tuple per op, no cycles (pipeopt._gc)
                ops = tuple(map(tuple.__new__, repeat(TimedOp), self.rows()))
            object.__setattr__(self, "_ops", ops)
        return ops

    def __len__(self) -> int:
        return len(self.start)

    @overload
    def __getitem__(self, i: int) -> TimedOp: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[TimedOp, ...]: ...

    def __getitem__(self, i: int | slice) -> TimedOp | tuple[TimedOp, ...]:
        return self.as_tuple()[i]

    def __iter__(self) -> Iterator[TimedOp]:
        return iter(self.as_tuple())

    def __reversed__(self) -> Iterator[TimedOp]:
        return reversed(self.as_tuple())

    def __contains__(self, value: object) -> bool:
        return value in self.as_tuple()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TimedOps):
            return self.columns == other.columns
        if isinstance(other, tuple):
            return self.as_tuple() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.as_tuple())

    def __add__(self, other: tuple[TimedOp, ...]) -> tuple[TimedOp, ...]:
        return self.as_tuple() + other

    def __radd__(self, other: tuple[TimedOp, ...]) -> tuple[TimedOp, ...]:
        return other + self.as_tuple()

    def __repr__(self) -> str:
        return repr(self.as_tuple())

    def __reduce__(self) -> tuple[type[TimedOps], tuple[tuple[Any, ...], ...]]:
        return TimedOps, self.columns


def op_rows(ops: Sequence[TimedOp]) -> Iterable[tuple[int, int, int, str, float, float]]:
    """Each op's six fields (device, stage, microbatch, kind, start, end) to unpack: the
    columns' rows of :class:`TimedOps` (no TimedOp made), else the ops themselves."""
    return ops.rows() if isinstance(ops, TimedOps) else ops


class Message(NamedTuple):
    """A p2p message: the output of ``kind`` of ``src_stage`` on ``microbatch`` for ``dst_stage``.

    It occupies the directed link ``src_device -> dst_device`` from ``start`` to ``end`` and is
    usable by the receiver at ``arrival`` (= end + latency), all in seconds.
    """

    src_device: int
    dst_device: int
    src_stage: int
    dst_stage: int
    microbatch: int
    kind: str
    start: float
    end: float
    arrival: float


@dataclass(frozen=True)
class SolverInfo:
    """How a schedule was found.

    ``status`` is ``optimal`` (proven), ``feasible`` (a search stopped at its limit) or
    ``heuristic`` (constructed, no search). ``lower_bound`` is a proven lower bound on the
    objective (seconds) or None; ``objective`` names what was minimised.
    """

    status: Status = "heuristic"
    lower_bound: float | None = None
    wall_time: float = 0.0
    objective: str = "makespan"
    details: tuple[tuple[str, Any], ...] = ()

    def detail(self, key: str, default: Any = None) -> Any:
        """One entry of ``details`` (solver-specific facts, e.g. the time resolution)."""
        return dict(self.details).get(key, default)


@dataclass(frozen=True)
class Schedule:
    """Timed ops for a problem, and the metrics that follow from them."""

    problem: Problem
    method: str
    ops: tuple[TimedOp, ...] | TimedOps
    messages: tuple[Message, ...] = ()
    solver: SolverInfo = field(default_factory=SolverInfo)

    def relabel(self, *, method: str | None = None, solver: SolverInfo | None = None
                ) -> Schedule:
        """The same ops under another method name or solver info; the metrics computed so far
        (they follow from the problem and the ops alone) are kept, not computed again."""
        new = replace(self, method=self.method if method is None else method,
                      solver=self.solver if solver is None else solver)
        fields = {f.name for f in dataclasses.fields(self)}
        new.__dict__.update({k: v for k, v in vars(self).items() if k not in fields})
        return new

    # ----- metrics -------------------------------------------------------------------------
    @cached_property
    def makespan(self) -> float:
        """Latest op end (seconds); every device starts at 0."""
        ops = self.ops
        if isinstance(ops, TimedOps):
            return max(ops.end, default=0.0)
        return max(map(_END, ops), default=0.0)

    @cached_property
    def iteration_time(self) -> float:
        """Makespan, or later if a stage's gradient reduction ends after it (seconds)."""
        red = self.problem.grad_reduce
        if not any(red):
            return self.makespan
        last_w: dict[int, float] = {}
        final = "W" if self.problem.split_backward else "B"
        for _, k, _, kind, _, end in op_rows(self.ops):
            if kind == final and end > last_w.get(k, -1.0):
                last_w[k] = end
        return max([self.makespan] + [t + red[k] for k, t in last_w.items()])

    @cached_property
    def busy_time(self) -> tuple[float, ...]:
        """Per device, the total time spent computing (seconds)."""
        busy = [0.0] * self.problem.devices
        for d, _, _, _, start, end in op_rows(self.ops):  # unpacked: no attribute reads
            busy[d] += end - start
        return tuple(busy)

    @cached_property
    def bubble_ratio(self) -> float:
        """1 - busy time / (devices * makespan)."""
        if self.makespan <= 0:
            return 0.0
        # Clamped: float rounding can make a gap-free schedule's ratio -1e-16.
        return max(0.0, 1.0 - sum(self.busy_time) / (self.problem.devices * self.makespan))

    @cached_property
    def spans(self) -> tuple[float, ...]:
        """Per device, last op end minus first op start (the Zero Bubble papers' span)."""
        first = [float("inf")] * self.problem.devices
        last = [0.0] * self.problem.devices
        for d, _, _, _, start, end in op_rows(self.ops):
            if start < first[d]:
                first[d] = start
            if end > last[d]:
                last[d] = end
        return tuple(max(0.0, b - a) for a, b in zip(first, last, strict=True))

    @cached_property
    def max_span(self) -> float:
        """Largest per-device span (seconds): CrossPipe's objective."""
        return max(self.spans, default=0.0)

    @cached_property
    def memory_timeline(self) -> tuple[tuple[tuple[float, float], ...], ...]:
        """Per device, (time, bytes in use) after each change, static memory included."""
        return memory_timeline(self.problem, op_rows(self.ops))

    @cached_property
    def peak_memory(self) -> tuple[float, ...]:
        """Per device, static memory plus the peak of live activation memory (bytes)."""
        return tuple(max((b for _, b in tl), default=self.problem.static_memory[d])
                     for d, tl in enumerate(self.memory_timeline))

    @cached_property
    def peak_activations(self) -> tuple[float, ...]:
        """Per device, peak activation memory without static memory (bytes)."""
        return tuple(pk - st for pk, st in zip(self.peak_memory, self.problem.static_memory,
                                               strict=True))

    @property
    def lower_bound(self) -> float | None:
        """Proven lower bound on the objective, if any (seconds)."""
        return self.solver.lower_bound

    @property
    def objective_value(self) -> float:
        """The value of the objective the solver minimised (seconds)."""
        if self.solver.objective == "span":
            return self.max_span
        return self.iteration_time

    @property
    def gap(self) -> float | None:
        """(objective - lower bound) / objective, or None without a bound."""
        lb = self.solver.lower_bound
        val = self.objective_value
        if lb is None or val <= 0:
            return None
        return max(0.0, (val - lb) / val)

    @cached_property
    def microbatch_order(self) -> tuple[int, ...]:
        """Micro-batches in the order their F ops start on stage 0 (ties by index): the
        micro-batch order a solver chose (FIFO methods run it on every stage)."""
        first = sorted((start, j) for _, k, j, kind, start, _ in op_rows(self.ops)
                       if kind == "F" and k == 0)
        return tuple(j for _, j in first)

    # ----- views ---------------------------------------------------------------------------
    def device_orders(self) -> tuple[tuple[Op, ...], ...]:
        """Per device, its ops sorted by start time (the input form of the simulator).

        Ops with the same start and end (zero-length ops) keep the order of the data flow:
        F along the stages, then B back along them, each W after its B; so a valid schedule's
        orders never deadlock, whatever order its file lists them in."""
        last = 2 * self.problem.stages
        flow = {"F": lambda k: 2 * k, "B": lambda k: 2 * (last - k),
                "W": lambda k: 2 * (last - k) + 1}
        per: list[list[TimedOp]] = [[] for _ in range(self.problem.devices)]
        for o in self.ops:
            per[o.device].append(o)
        return tuple(tuple(o.op for o in sorted(
            lst, key=lambda o: (o.start, o.end, flow[o.kind](o.stage), o.microbatch)))
            for lst in per)

    def op_times(self) -> dict[Op, tuple[float, float]]:
        """Map from op to its (start, end)."""
        return {o.op: (o.start, o.end) for o in self.ops}

    def to_dict(self) -> dict[str, Any]:
        """The schedule JSON document (SPEC section 2)."""
        return schedule_to_dict(self)

    def to_json(self, indent: int | None = 1) -> str:
        """The schedule JSON text (SPEC section 2)."""
        import json

        return json.dumps(self.to_dict(), indent=indent)

    def summary(self) -> dict[str, Any]:
        """A few headline numbers, for printing."""
        return {
            "method": self.method,
            "makespan": self.makespan,
            "iteration_time": self.iteration_time,
            "bubble_ratio": self.bubble_ratio,
            "max_span": self.max_span,
            "peak_memory": list(self.peak_memory),
            "status": self.solver.status,
            "lower_bound": self.solver.lower_bound,
            "gap": self.gap,
            "wall_time": self.solver.wall_time,
        }


@cyclic_gc_paused()  # one event tuple per op, no cycles (pipeopt._gc)
def memory_timeline(problem: Problem,
                    ops: Iterable[tuple[int, int, int, str, float, float]]
                    ) -> tuple[tuple[tuple[float, float], ...], ...]:
    """Per device, the (time, bytes) steps of memory in use.

    Activation memory is allocated when an F starts and released when its B / W ends; at equal
    times releases happen before allocations, so memory freed by an op ending at t is reusable by
    an op starting at t.
    """
    events: list[list[tuple[float, int, float]]] = [[] for _ in range(problem.devices)]
    delta = problem.memory_deltas  # (allocated at start, released at end) per (kind, stage)
    table = None if problem.uniform_microbatches else problem.memory_table
    m = problem.microbatches
    for device, stage, mb, kind, start, end in ops:
        d = delta.get((kind, stage))
        if d is None or not 0 <= device < problem.devices:
            continue  # not an op of this problem: the validator names it
        alloc, free = d
        if table is not None and 0 <= mb < m:
            c = table[stage][mb]
            alloc, free = alloc * c, free * c
        if alloc:
            events[device].append((start, 1, alloc))
        if free:
            events[device].append((end, 0, -free))
    out = []
    for d, ev in enumerate(events):
        ev.sort()
        cur = problem.static_memory[d]
        steps = [(0.0, cur)]
        for t, _, delta in ev:
            cur += delta
            steps.append((t, cur))
        out.append(tuple(steps))
    return tuple(out)


def order_peak_memory(problem: Problem, orders: Sequence[Sequence[Op]]) -> tuple[float, ...]:
    """Per device, the peak memory (bytes, static included) of running ``orders``, without
    timing them.

    A device runs its ops one after another, allocating at an F's start and releasing at a B's
    or W's end, so its memory changes in the order of its ops: the peak is a running sum over
    the order. When every op lasts > 0 it is the value :func:`memory_timeline` gives for the
    timed schedule; with zero-length ops it is an upper bound (the timeline releases before
    it allocates at equal times, which can reorder a zero-length op's events)."""
    delta = problem.memory_deltas
    table = None if problem.uniform_microbatches else problem.memory_table
    peaks = []
    for d, order in enumerate(orders):
        cur = peak = problem.static_memory[d]
        for op in order:
            alloc, free = delta[(op.kind, op.stage)]
            if table is not None:
                c = table[op.stage][op.microbatch]
                alloc, free = alloc * c, free * c
            cur += alloc
            if cur > peak:
                peak = cur
            cur -= free
        peaks.append(peak)
    return tuple(peaks)


# ----- JSON form (SPEC section 2); reading it back, with every check, is pipeopt.io's ------
def _num(x: float | None) -> float | str | None:
    """JSON has no infinity: write it as the string "inf"."""
    if x is None:
        return None
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def schedule_to_dict(schedule: Schedule) -> dict[str, Any]:
    """The SPEC v1 document for ``schedule`` (metrics computed from its times)."""
    s = schedule
    return {
        **schedule_header(s),
        "ops": [
            {"device": o.device, "stage": o.stage, "microbatch": o.microbatch, "kind": o.kind,
             "start": o.start, "end": o.end}
            for o in sorted(s.ops, key=by_device_and_time)
        ],
        "messages": [m._asdict() for m in sorted(s.messages, key=lambda m: m.start)],
    }


def schedule_header(s: Schedule) -> dict[str, Any]:
    """Every field of the document but its ops and messages."""
    return {
        "format": FORMAT,
        "method": s.method,
        "makespan": s.makespan,
        "iteration_time": s.iteration_time,
        "bubble_ratio": s.bubble_ratio,
        "max_span": s.max_span,
        "peak_memory": list(s.peak_memory),
        "solver": _solver_dict(s),
        "problem": s.problem.to_dict(),
        # Micro-batches of different cost: the order the schedule runs them in (pipeopt extra;
        # left out when every micro-batch costs the same, so those files stay as they were).
        **({} if s.problem.uniform_microbatches
           else {"microbatch_order": list(s.microbatch_order)}),
    }


def _solver_dict(s: Schedule) -> dict[str, Any]:
    """The ``solver`` object. SPEC section 2's ``lower_bound`` and ``gap`` are about the
    makespan; when the solver minimised something else (the iteration time, with a gradient
    reduction, or the largest span) its own bound and gap are ``objective_lower_bound`` and
    ``objective_gap``, and ``lower_bound`` is a proven bound on the makespan."""
    out: dict[str, Any] = {"status": s.solver.status}
    if s.objective_value == s.makespan and s.solver.objective == "makespan":
        out.update(lower_bound=_num(s.solver.lower_bound), gap=s.gap)
    else:
        from pipeopt.bounds import makespan_lower_bound

        lb = min(makespan_lower_bound(s.problem), s.makespan)
        out.update(lower_bound=lb, gap=max(0.0, (s.makespan - lb) / s.makespan)
                   if s.makespan > 0 else None,
                   objective_lower_bound=_num(s.solver.lower_bound), objective_gap=s.gap)
    out.update(wall_time=s.solver.wall_time, objective=s.solver.objective,
               details=dict(s.solver.details))
    return out


def by_device_and_time(o: TimedOp) -> tuple[int, float, float]:
    """The order of the ops in the document: by device, then start and end time."""
    return o[0], o[4], o[5]
