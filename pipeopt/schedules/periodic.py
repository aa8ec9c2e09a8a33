"""Asynchronous (periodic) pipelines: 1F1B-async patterns and the judge of any periodic schedule.

A steady state of one stage per device is described by a *cyclic order*: device k repeats
``F(j + n_k - 1), B(j), W(j)`` (``W`` absent with a fused backward) for j = 0, 1, ..., so
``n_k`` micro-batches are in flight on stage k, and each directed link carries its messages
in micro-batch order. :func:`cyclic_schedule` times such an order as early as possible.

Timing a cyclic order (the max-plus view of cyclic scheduling, Baccelli, Cohen, Olsder and
Quadrat, *Synchronization and Linearity*, 1992, ch. 3; Hanen and Munier, 1995): each constraint
"node b of micro-batch j + h starts at least w after node a of micro-batch j starts" is an arc
(a, b, w, h); with micro-batch j's copy of node i at ``x[i] + j * T``, it reads
``x[b] >= x[a] + w - h * T``. Such x exist iff no cycle has ``sum w - T * sum h > 0``, so the
least period is the largest cycle ratio ``sum w / sum h`` (a cycle with ``sum h <= 0`` and
``sum w > 0`` is a deadlock), and the earliest x are the longest paths at that T. It is found by
cycle-ratio iteration: longest paths (Bellman-Ford) at T; a positive cycle raises T to its ratio;
repeat (T grows at each step and there are finitely many cycles).

``pipedream`` (1F1B-async, Narayanan et al., SOSP'19: ``n_k = p - k``, weight stashing),
``pipedream-2bw`` (the same timing, two weight versions) and ``pipemare`` (the same timing, one
version) are that order with fixed in-flight counts; :mod:`pipeopt.solvers.periodic` searches
the counts. :func:`check_periodic` unrolls any :class:`PeriodicSchedule` into the chain's task
graph and hands it to the core validator, the one judge of timings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from pipeopt.core.validate import check
from pipeopt.problem import Op, Problem
from pipeopt.schedules.base import NotApplicable
from pipeopt.workloads.periodic import (
    PatternMessage,
    PatternTask,
    PeriodicSchedule,
    check_async_problem,
    check_replicas,
    link_edges,
    pattern_edges,
    period_lower_bound,
    unroll,
)

#: Hand-made asynchronous patterns: method name -> weight policy. All three run 1F1B-async.
ASYNC_METHODS: dict[str, str] = {"pipedream": "stash", "pipedream-2bw": "2bw",
                                 "pipemare": "pipemare"}
#: Relative slack on a relaxation in the longest-path passes: float sums of durations must not
#: show a zero-weight cycle as a positive one.
_EPS = 1e-12


class Deadlock(NotApplicable):
    """A cyclic order that no period can time (a cycle of waits within one micro-batch)."""


class Arc(NamedTuple):
    """Node ``dst`` of micro-batch j + ``height`` starts >= ``weight`` s after ``src`` of j."""

    src: int
    dst: int
    weight: float
    height: int


def one_stage_per_device(problem: Problem) -> None:
    """Raise :class:`NotApplicable` unless ``problem`` has one stage per device (the cyclic
    orders here give each device one F, B, W per period)."""
    check_async_problem(problem)
    if problem.virtual_stages != 1:
        raise NotApplicable(f"pipeline.virtual_stages: asynchronous patterns need one stage per "
                            f"device, got {problem.virtual_stages}")


def _arcs(problem: Problem, in_flight: Sequence[int], replicas: Sequence[int] = ()
          ) -> tuple[int, list[Arc]]:
    """(node count, arcs) of the 1F1B-async cyclic order with ``in_flight[k]`` on each device
    of stage k. Nodes: the pattern tasks in (kind, stage) order, then one per message on a
    link. A stage on r replicas gets every r-th micro-batch: its device arcs span r times the
    micro-batches, and a link between replicas carries every lcm(r_a, r_b)-th message."""
    reps = check_replicas(problem, replicas)
    s = problem.stages
    kinds = problem.kinds
    node = {(kind, k): i for i, (kind, k) in
            enumerate((kind, k) for kind in kinds for k in range(s))}
    arcs: list[Arc] = []
    msg_node = {}
    for q, (a, b) in enumerate(link_edges(problem)):
        msg_node[(a.kind, a.stage, b.stage)] = len(node) + q
    for a, b in pattern_edges(problem):
        tx, lat = problem.transfer(a.stage, b.stage)
        ia, ib, da = node[(a.kind, a.stage)], node[(b.kind, b.stage)], problem.duration(a)
        mq = msg_node.get((a.kind, a.stage, b.stage))
        if mq is None:
            arcs.append(Arc(ia, ib, da + tx + lat, 0))
        else:  # producer -> message on the link -> consumer
            every = math.lcm(reps[a.stage], reps[b.stage])
            arcs += [Arc(ia, mq, da, 0), Arc(mq, ib, tx + lat, 0),
                     Arc(mq, mq, tx, every)]  # one copy at a time on a link, in order
    last = kinds[-1]
    for k in range(s):
        n, r = in_flight[k], reps[k]
        f, b = node[("F", k)], node[("B", k)]
        # Device order F(j + r (n - 1)), B(j), [W(j),] F(j + r n): the replica's micro-batches.
        arcs.append(Arc(f, b, problem.duration(Op("F", k, 0)), -r * (n - 1)))
        if last == "W":
            arcs.append(Arc(b, node[("W", k)], problem.duration(Op("B", k, 0)), 0))
        arcs.append(Arc(node[(last, k)], f, problem.duration(Op(last, k, 0)), r * n))
    return len(node) + len(msg_node), arcs


def _longest(n: int, arcs: Sequence[Arc], period: float, scale: float
             ) -> tuple[list[float], list[Arc] | None]:
    """Longest paths from a virtual source (0 to every node) with arc weights
    ``weight - height * period``: (x, None), or (partial x, a positive cycle's arcs)."""
    x = [0.0] * n
    pred: list[Arc | None] = [None] * n
    eps = _EPS * scale
    for _ in range(n + 1):
        changed = -1
        for arc in arcs:
            v = x[arc.src] + arc.weight - arc.height * period
            if v > x[arc.dst] + eps:
                x[arc.dst] = v
                pred[arc.dst] = arc
                changed = arc.dst
        if changed < 0:
            return x, None
    # Still relaxing after n passes: walk back n steps (into the cycle), then around it.
    v = changed
    for _ in range(n):
        v = pred[v].src  # type: ignore[union-attr]
    cycle, u = [], v
    while True:
        arc = pred[u]
        assert arc is not None  # every node on the walk was relaxed
        cycle.append(arc)
        u = arc.src
        if u == v:
            return x, cycle[::-1]


def cyclic_period(n: int, arcs: Sequence[Arc], start: float) -> tuple[float, list[float]]:
    """(least period >= ``start``, earliest node starts at it) of a cyclic order given as arcs
    (see the module docstring); raises :class:`Deadlock` on a cycle with ``sum h <= 0``."""
    scale = max(1.0, sum(abs(a.weight) for a in arcs))
    period = start
    while True:
        x, cycle = _longest(n, arcs, period, scale)
        if cycle is None:
            return period, x
        w = sum(a.weight for a in cycle)
        h = sum(a.height for a in cycle)
        if h <= 0:
            raise Deadlock(f"in_flight: the cyclic order waits on itself (a cycle of {len(cycle)}"
                           f" constraints within one micro-batch); each stage needs at least as "
                           f"many micro-batches in flight as the next")
        period = max(w / h, period * (1 + _EPS))


def cyclic_schedule(problem: Problem, in_flight: Sequence[int], *, policy: str = "stash",
                    weight_bytes: Sequence[float] = (), method: str = "cyclic",
                    update_every: int = 0, replicas: Sequence[int] = (),
                    sync_s: Sequence[float] = ()) -> PeriodicSchedule:
    """The earliest periodic schedule of the 1F1B-async cyclic order with ``in_flight[k]``
    micro-batches in flight on each device of stage k (module docstring), at its least
    period, and no shorter than the replicas' all-reduce allows (``sync_s``, see
    :func:`~pipeopt.workloads.periodic.replica_sync_bound`); ``replicas[k]`` devices run
    stage k round-robin."""
    one_stage_per_device(problem)
    reps = check_replicas(problem, replicas)
    s = problem.stages
    counts = [int(c) for c in in_flight]
    if len(counts) != s or min(counts) < 1:
        raise NotApplicable(f"in_flight: expected {s} integers >= 1 (one per stage), got "
                            f"{list(in_flight)}")
    n, arcs = _arcs(problem, counts, reps)
    lb = period_lower_bound(problem, reps, sync_s)
    period, x = cyclic_period(n, arcs, lb)
    nt = len(problem.kinds) * s
    origin = x[0]  # F of stage 0: every other node follows it within one micro-batch
    starts = [v - origin for v in x]
    tasks = tuple(PatternTask(kind, k, max(0.0, starts[i])) for i, (kind, k) in
                  enumerate((kind, k) for kind in problem.kinds for k in range(s)))
    msgs = tuple(PatternMessage(a.kind, a.stage, b.stage, starts[nt + q])
                 for q, (a, b) in enumerate(link_edges(problem)))
    return PeriodicSchedule(problem, period, tasks, msgs, policy=policy,
                            weight_bytes=tuple(weight_bytes), method=method,
                            lower_bound=lb, update_every=update_every, replicas=reps,
                            sync_s=tuple(sync_s))


def one_f_one_b_async(problem: Problem, replicas: Sequence[int] = ()) -> list[int]:
    """1F1B-async's in-flight counts per device of each stage: ``p - k`` on stage k, and with
    replicated stages ``ceil(devices from stage k on / replicas[k])`` (PipeDream's NOAM,
    "number of optimal active mini-batches", SOSP'19 section 3.2: ceil(workers / replicas
    of the input stage), here for every stage)."""
    reps = check_replicas(problem, replicas)
    return [math.ceil(sum(reps[k:]) / reps[k]) for k in range(problem.stages)]


def async_pattern(problem: Problem, method: str, weight_bytes: Sequence[float] = (),
                  replicas: Sequence[int] = (), sync_s: Sequence[float] = ()
                  ) -> PeriodicSchedule:
    """The hand-made pattern ``method`` (:data:`ASYNC_METHODS`): 1F1B-async with its weight
    policy, on ``replicas[k]`` devices per stage (their all-reduce ``sync_s[k]`` s)."""
    if method not in ASYNC_METHODS:
        raise NotApplicable(f"method: {method!r} is not an asynchronous pattern; choose one of "
                            f"{', '.join(ASYNC_METHODS)}")
    return cyclic_schedule(problem, one_f_one_b_async(problem, replicas),
                           policy=ASYNC_METHODS[method], weight_bytes=weight_bytes,
                           method=method, replicas=replicas, sync_s=sync_s)


def check_periodic(schedule: PeriodicSchedule) -> list[str]:
    """Every rule the pattern breaks (empty when valid): the pattern unrolled over enough
    micro-batches (:func:`~pipeopt.workloads.periodic.unroll`) and judged by the core validator:
    dependencies across periods, one task at a time per device, one message at a time per
    link, and memory with the extra weight versions at the steady-state peak."""
    return check(unroll(schedule))


class InvalidPeriodic(ValueError):
    """A periodic schedule that breaks the rules; ``violations`` lists all of them."""

    def __init__(self, message: str, violations: Sequence[str]) -> None:
        super().__init__(message)
        self.violations = list(violations)


def validate_periodic(schedule: PeriodicSchedule) -> PeriodicSchedule:
    """Return ``schedule`` if :func:`check_periodic` finds nothing, else raise
    :class:`InvalidPeriodic` with the first violation (and how many more)."""
    bad = check_periodic(schedule)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise InvalidPeriodic(f"invalid periodic schedule: {bad[0]}{more}", bad)
    return schedule
