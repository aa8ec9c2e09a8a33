"""A cyclic (modulo) CP-SAT model of one steady-state pattern: the least period on a time grid.

For a fixed integer period ``T`` (time units of ``unit`` seconds) the model reads like modulo
scheduling on paper (Rau, "Iterative modulo scheduling", 1994; Eichenberger and Davidson's
formulation as a cyclic job shop):

* ``start[i]`` per pattern task and per message on a link (micro-batch 0's copy), with
  ``start[F of stage 0] = 0``;
* dependencies of one micro-batch: ``start[b] >= start[a] + dur[a] (+ transmission + latency
  through the message's node)``;
* resources: on each device of stage k (``r_k`` replicas: every ``r_k``-th micro-batch) the
  copies repeat every ``r_k T``; their offsets ``start mod r_k T`` on that circle must not
  overlap, which for durations ``<= r_k T`` is a linear no-overlap of each interval and its
  copy shifted by ``r_k T`` (``_add_devices``); the same for the messages on a directed link,
  every ``lcm(r_a, r_b) T`` (``_add_links``);
* memory: a micro-batch holds stage k's activations (and, with stashing, a weight version)
  from its forward's start to its last backward task's end, ``hold_k``; at most ``n_k =
  max_in_flight`` of them fit on a device at once, and ``ceil(hold_k / (r_k T))`` are there at
  the peak, so ``hold_k <= n_k r_k T`` (``_add_memory``), the same rule the search keeps.

Unlike the search (:mod:`pipeopt.solvers.periodic`), the order on each device is free.
Durations and delays are rounded *up* to the grid, so a pattern found on it stays valid in
real time (the unrolled validator checks it). The period is found by bisection over ``T``
between the lower bound and the search's period, one feasibility model per step; the last
model also minimises the sum of the holds (less memory and staleness at that period). A step
that ends without an answer counts as infeasible, so the result is never worse than the
search's, which it starts from.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from ortools.sat.python import cp_model

from pipeopt.problem import Op, Problem
from pipeopt.schedules.periodic import one_stage_per_device
from pipeopt.solvers.periodic import solve_periodic
from pipeopt.workloads.periodic import (
    PatternMessage,
    PatternTask,
    PeriodicSchedule,
    check_replicas,
    link_edges,
    max_in_flight,
    pattern_edges,
)

#: Grid steps per heuristic period when no resolution is given: a period found on the grid is
#: at most one step (0.1 % of the search's period) above the grid's best.
_STEPS_PER_PERIOD = 1000


def solve_periodic_cpsat(problem: Problem, weight_bytes: Sequence[float] = (),
                         policy: str = "stash", *, time_limit: float = 10.0,
                         replicas: Sequence[int] = (), resolution: float | None = None,
                         workers: int | None = None, seed: int = 0,
                         sync_s: Sequence[float] = ()) -> PeriodicSchedule:
    """The least period found by the cyclic CP-SAT model (module docstring) within
    ``time_limit`` seconds; ``resolution``: seconds per time unit (default: the search's
    period / 1000); ``sync_s``: the replicas' all-reduce per round (s), which bounds the
    period from below (the bisection starts at the search's bound, which includes it)."""
    t0 = time.monotonic()
    one_stage_per_device(problem)
    reps = check_replicas(problem, replicas)
    wb = tuple(weight_bytes) or (0.0,) * problem.stages
    start_point = solve_periodic(problem, wb, policy, time_limit=time_limit / 4, replicas=reps,
                                 sync_s=sync_s)
    bound = start_point.lower_bound or 0.0
    if start_point.period <= bound * (1 + 1e-9):
        return start_point.replace(method="periodic-cpsat")
    if resolution is not None and not (math.isfinite(resolution) and resolution > 0):
        raise ValueError(f"resolution: must be a number > 0 s, got {resolution!r}")
    unit = resolution or start_point.period / _STEPS_PER_PERIOD
    model_data = _Data(problem, reps, max_in_flight(problem, wb, policy), unit)
    lo = max(1, math.ceil(bound / unit - 1e-9))
    # Grid periods strictly below the search's; ``hi`` itself stands for the search's answer.
    hi = math.ceil(start_point.period / unit - 1e-9)
    best: tuple[int, list[int]] | None = None
    while lo < hi:
        left = time_limit - (time.monotonic() - t0)
        steps = max(1, math.ceil(math.log2(hi - lo + 1)))
        if left <= 0:
            break
        mid = (lo + hi) // 2
        found = _solve(model_data, mid, left / steps, workers, seed, minimise=False)
        if found is None:
            lo = mid + 1
        else:
            best, hi = (mid, found), mid
    if best is None:
        return start_point.replace(method="periodic-cpsat")
    left = time_limit - (time.monotonic() - t0)
    if left > 0:  # at the period found: the least holds (memory, staleness)
        tighter = _solve(model_data, best[0], left, workers, seed, minimise=True)
        if tighter is not None:
            best = (best[0], tighter)
    period, starts = best
    return _schedule(problem, model_data, period, starts, wb, policy, reps, bound,
                     start_point.sync_s)


class _Data:
    """The pattern's nodes and arcs on the integer grid (durations and delays rounded up)."""

    def __init__(self, problem: Problem, reps: tuple[int, ...],
                 caps: tuple[int | None, ...], unit: float) -> None:
        self.problem, self.reps, self.caps, self.unit = problem, reps, caps, unit
        s = problem.stages
        self.tasks = [(kind, k) for kind in problem.kinds for k in range(s)]
        self.index = {t: i for i, t in enumerate(self.tasks)}
        self.links = link_edges(problem)
        nt = len(self.tasks)
        self.dur = [self.up(problem.duration(Op(kind, k, 0))) for kind, k in self.tasks]
        self.stage = [k for _, k in self.tasks]
        # Message nodes: duration = transmission; they sit on links.
        for a, b in self.links:
            self.dur.append(self.up(problem.transfer(a.stage, b.stage)[0]))
            self.stage.append(-1)
        self.arcs: list[tuple[int, int, int]] = []  # (from, to, least distance in units)
        msg = {(a.kind, a.stage, b.stage): nt + q for q, (a, b) in enumerate(self.links)}
        for a, b in pattern_edges(problem):
            ia, ib = self.index[(a.kind, a.stage)], self.index[(b.kind, b.stage)]
            tx, lat = problem.transfer(a.stage, b.stage)
            q = msg.get((a.kind, a.stage, b.stage))
            if q is None:
                self.arcs.append((ia, ib, self.dur[ia] + self.up(tx + lat)))
            else:
                self.arcs += [(ia, q, self.dur[ia]), (q, ib, self.dur[q] + self.up(lat))]
        sd = problem.stage_device
        self.link_nodes: dict[tuple[int, int], list[int]] = {}
        for q, (a, b) in enumerate(self.links):
            self.link_nodes.setdefault((sd[a.stage], sd[b.stage]), []).append(nt + q)
        self.link_every = {ab: math.lcm(reps[ab[0]], reps[ab[1]]) for ab in self.link_nodes}
        self.horizon = sum(self.dur) + sum(d for _, _, d in self.arcs)

    def up(self, seconds: float) -> int:
        """Seconds rounded up to whole units (a float sum of exact multiples stays exact)."""
        return max(0, math.ceil(seconds / self.unit - 1e-9))


def _solve(data: _Data, period: int, time_limit: float, workers: int | None, seed: int,
           *, minimise: bool) -> list[int] | None:
    """Starts (units) of a pattern at ``period`` units, or None (infeasible or no answer)."""
    model = cp_model.CpModel()
    n = len(data.dur)
    most_r = max(data.reps)
    horizon = data.horizon + (n + 2) * most_r * period  # any pattern fits some copies later
    start = [model.NewIntVar(0, horizon, f"start[{i}]") for i in range(n)]
    model.Add(start[data.index[("F", 0)]] == 0)
    for a, b, dist in data.arcs:
        model.Add(start[b] >= start[a] + dist)
    if not _add_devices(model, data, start, period):
        return None
    if not _add_links(model, data, start, period):
        return None
    holds = _add_memory(model, data, start, period)
    if minimise:
        model.Minimize(sum(holds))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, time_limit)
    solver.parameters.random_seed = seed
    if workers is not None:
        solver.parameters.num_workers = workers
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return [solver.Value(x) for x in start]


def _circle(model: cp_model.CpModel, start: list[cp_model.IntVar], nodes: list[int],
            dur: list[int], length: int, name: str) -> bool:
    """No two of ``nodes``' offsets ``start mod length`` overlap on a circle of ``length``
    units: each interval and its copy ``length`` later on a line. False when a duration is
    longer than the circle (no pattern at this period)."""
    intervals = []
    for i in nodes:
        if dur[i] == 0:
            continue
        if dur[i] > length:
            return False
        off = model.NewIntVar(0, length - 1, f"{name}.offset[{i}]")
        model.AddModuloEquality(off, start[i], length)
        intervals.append(model.NewFixedSizeIntervalVar(off, dur[i], f"{name}[{i}]"))
        shifted = model.NewIntVar(length, 2 * length - 1, f"{name}.copy[{i}]")
        model.Add(shifted == off + length)
        intervals.append(model.NewFixedSizeIntervalVar(shifted, dur[i], f"{name}.copy[{i}]"))
    model.AddNoOverlap(intervals)
    return True


def _add_devices(model: cp_model.CpModel, data: _Data, start: list[cp_model.IntVar],
                 period: int) -> bool:
    """Each device of stage k runs its tasks' copies every ``r_k period`` without overlap."""
    p = data.problem
    for k in range(p.stages):
        nodes = [i for i, st in enumerate(data.stage) if st == k]
        if not _circle(model, start, nodes, data.dur, data.reps[k] * period, f"device{k}"):
            return False
    return True


def _add_links(model: cp_model.CpModel, data: _Data, start: list[cp_model.IntVar],
               period: int) -> bool:
    """Each directed link carries its messages' copies every ``lcm(r_a, r_b) period``."""
    for ab, nodes in data.link_nodes.items():
        if not _circle(model, start, nodes, data.dur, data.link_every[ab] * period,
                       f"link{ab[0]}-{ab[1]}"):
            return False
    return True


def _add_memory(model: cp_model.CpModel, data: _Data, start: list[cp_model.IntVar],
                period: int) -> list[cp_model.LinearExpr]:
    """``hold_k <= max_in_flight[k] r_k period`` on every stage with a limit; the holds."""
    p = data.problem
    last = p.kinds[-1]
    holds = []
    for k in range(p.stages):
        f, w = data.index[("F", k)], data.index[(last, k)]
        hold = start[w] + data.dur[w] - start[f]
        holds.append(hold)
        cap = data.caps[k]
        if cap is not None:
            model.Add(hold <= cap * data.reps[k] * period)
    return holds


def _schedule(problem: Problem, data: _Data, period: int, starts: list[int],
              wb: tuple[float, ...], policy: str, reps: tuple[int, ...],
              bound: float, sync_s: tuple[float, ...]) -> PeriodicSchedule:
    """The pattern in seconds."""
    u = data.unit
    nt = len(data.tasks)
    tasks = tuple(PatternTask(kind, k, starts[i] * u) for i, (kind, k) in enumerate(data.tasks))
    msgs = tuple(PatternMessage(a.kind, a.stage, b.stage, starts[nt + q] * u)
                 for q, (a, b) in enumerate(data.links))
    return PeriodicSchedule(problem, period * u, tasks, msgs, policy=policy, weight_bytes=wb,
                            method="periodic-cpsat", lower_bound=bound, replicas=reps,
                            sync_s=sync_s)
