"""An exact search over any TaskGraph with OR-Tools CP-SAT.

The model, in integer time units (see :func:`time_unit`):

* one fixed-size interval per task; one task at a time per device (:func:`_add_devices`);
* an edge waits for its source's end plus its latency (:func:`_add_edges`); a message that
  occupies its link is an interval of its transmission on the directed link, one at a time per
  link, sent after the source ends and arriving ``latency`` after it leaves the link;
* per device with a limit, a reservoir of the memory changes at every start and end
  (:func:`_add_memory`): the level after all changes at one instant stays within the limit,
  which is the decreases-first rule at its highest point;
* the objective max(end + tail) is minimised (:func:`_add_objective`).

Times are rounded *down* to the grid: any real schedule, floored, solves the model (floors of
sums are at least sums of floors), so CP-SAT's bound is a proven bound on the real objective.
Memory is rounded *up* (changes) against a capacity rounded down when it sits on no exact grid:
the model is then a restriction, its schedules keep the real limits, and its bound proves
nothing (only the analytic bound is reported). The solver's device orders are re-timed in
floats by :func:`pipeopt.core.simulate.simulate`; on an exact time grid the solver's own times
are kept instead when they are better. The greedy's schedule is the hint and sets the horizon.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

from ortools.sat.python import cp_model

from pipeopt.core.bounds import lower_bound
from pipeopt.core.graph import TaskGraph
from pipeopt.core.greedy import Stuck, solve_greedy
from pipeopt.core.schedule import GraphSchedule, MessageTime
from pipeopt.core.simulate import simulate
from pipeopt.core.validate import check

#: Time units from 0 to the horizon when the data sits on no exact grid (0.01 %).
APPROX_TIME_UNITS = 10_000
#: Most time units up to the horizon for an exact grid (beyond, an approximate one is used).
MAX_EXACT_TIME_UNITS = 10**9
#: Memory units of the largest value when memory sits on no exact grid.
APPROX_MEMORY_UNITS = 10**6


def _on_grid(values: Iterable[float], unit: float) -> bool:
    for x in values:
        u = x / unit
        if abs(u - round(u)) > 1e-9 * max(1.0, abs(u)):
            return False
    return True


def time_unit(graph: TaskGraph, horizon_s: float, resolution: float | None = None
              ) -> tuple[float, bool]:
    """(seconds per unit, exact): ``resolution`` when given, else the largest power of ten
    (1 s down to 1 us) of which every duration, transmission, latency and tail is a whole
    multiple, else ``horizon / APPROX_TIME_UNITS`` (inexact)."""
    values = [*graph.duration, *graph.edge_transmission, *graph.edge_latency, *graph.tail]
    if resolution is not None:
        if not (resolution > 0 and math.isfinite(resolution)):
            raise ValueError(f"resolution: must be a positive number of seconds, got "
                             f"{resolution}")
        return resolution, _on_grid(values, resolution)
    for k in range(7):
        unit = 10.0 ** -k
        if horizon_s / unit > MAX_EXACT_TIME_UNITS:
            break
        if _on_grid(values, unit):
            return unit, True
    return max(horizon_s, 1e-9) / APPROX_TIME_UNITS, False


def memory_unit(graph: TaskGraph) -> tuple[float, bool]:
    """(bytes per unit, exact) for the devices with a limit: 1, or a power of ten down to
    1e-6 that makes every change, capacity and static size whole; else the largest value over
    ``APPROX_MEMORY_UNITS`` (inexact)."""
    limited = [d for d, lim in enumerate(graph.memory_limit) if lim is not None]
    values = [graph.memory_limit[d] - graph.static_memory[d] for d in limited]  # type: ignore
    values += [x for i, d in enumerate(graph.device) if graph.memory_limit[d] is not None
               for x in (graph.mem_start[i], graph.mem_end[i])]
    for k in range(7):
        unit = 10.0 ** -k
        if _on_grid(values, unit) and max(map(abs, values), default=0.0) / unit < 2**50:
            return unit, True
    return max(max(map(abs, values), default=1.0), 1e-30) / APPROX_MEMORY_UNITS, False


@dataclass
class _Model:
    """The CP-SAT model and its variables (units)."""

    graph: TaskGraph
    unit: float
    dur: list[int]
    tx: list[int]  # per edge; only edges with a positive real transmission occupy a link
    lat: list[int]
    tail: list[int]
    horizon: int
    model: cp_model.CpModel
    start: list[cp_model.IntVar]
    send: dict[int, cp_model.IntVar]  # edge -> message start
    value: cp_model.IntVar | None = None


def _floor(x: float, unit: float, exact: bool) -> int:
    u = x / unit
    n = round(u)
    if exact and abs(u - n) <= 1e-9 * max(1.0, abs(u)):
        return int(n)
    return math.floor(u)


def _heads_tails(m: _Model) -> tuple[list[int], list[int]]:
    """Per task, the earliest start and the least time from start to the objective (units),
    from the model's own (rounded) data, so both hold for every solution of the model."""
    g = m.graph
    head = [0] * g.num_tasks
    for j in g.topological_order:
        head[j] = max((head[g.src[e]] + m.dur[g.src[e]] + m.tx[e] + m.lat[e]
                       for e in g.preds(j)), default=0)
    q = [0] * g.num_tasks
    for i in reversed(g.topological_order):
        q[i] = m.dur[i] + max([m.tail[i]] + [m.tx[e] + m.lat[e] + q[g.dst[e]]
                                            for e in g.succs(i)])
    return head, q


def _add_devices(m: _Model, head: list[int], q: list[int]) -> list[cp_model.IntervalVar]:
    """One fixed-size interval per task, its start within [head, horizon - q]; no overlap per
    device."""
    g, md = m.graph, m.model
    ivs = []
    for i in range(g.num_tasks):
        hi = max(head[i], m.horizon - q[i])
        m.start.append(md.new_int_var(head[i], hi, f"start[{g.label[i]}]"))
        ivs.append(md.new_fixed_size_interval_var(m.start[i], m.dur[i], f"run[{g.label[i]}]"))
    for tasks in g.device_tasks:
        md.add_no_overlap([ivs[i] for i in tasks])
    return ivs


def _add_edges(m: _Model, head: list[int]) -> None:
    """dst starts after src ends + latency; a message that occupies its link is sent after src
    ends, takes ``tx`` units on the link (one at a time) and arrives ``lat`` after."""
    g, md = m.graph, m.model
    per_link: dict[int, list[cp_model.IntervalVar]] = {}
    for e in range(g.num_edges):
        a, b = g.src[e], g.dst[e]
        end_a = m.start[a] + m.dur[a]
        if g.edge_transmission[e] <= 0:
            md.add(m.start[b] >= end_a + m.lat[e])
            continue
        lo = head[a] + m.dur[a]
        s = md.new_int_var(lo, max(lo, m.horizon), f"send[{g.label[a]}->{g.label[b]}]")
        m.send[e] = s
        md.add(s >= end_a)
        md.add(m.start[b] >= s + m.tx[e] + m.lat[e])
        per_link.setdefault(g.edge_link[e], []).append(
            md.new_fixed_size_interval_var(s, m.tx[e], f"link[{g.label[a]}->{g.label[b]}]"))
    for ivs in per_link.values():
        md.add_no_overlap(ivs)


def _add_memory(m: _Model, unit: float, exact: bool) -> None:
    """Per device with a limit: a reservoir of the changes at every start and end, within
    [-(all decreases), capacity]; changes rounded up, the capacity down (see module doc)."""
    g, md = m.graph, m.model
    for d, lim in enumerate(g.memory_limit):
        if lim is None:
            continue
        cap = math.floor((lim - g.static_memory[d]) / unit + (1e-9 if exact else 0.0))
        times, changes = [], []
        low = 0
        for i in g.device_tasks[d]:
            for t, x in ((m.start[i], g.mem_start[i]), (m.start[i] + m.dur[i], g.mem_end[i])):
                c = math.ceil(x / unit - (1e-9 * max(1.0, abs(x / unit)) if exact else 0.0))
                if c:
                    times.append(t)
                    changes.append(c)
                    low += min(c, 0)
        if cap < 0:
            raise ValueError(f"cpsat: device {d}: static memory {g.static_memory[d]:g} is over "
                             f"its limit {lim:g}")
        if times:
            md.add_reservoir_constraint(times, changes, low, cap)


def _add_objective(m: _Model, head: list[int], q: list[int]) -> None:
    """Minimise max(end + tail): the value is at least every sink's and every tailed task's
    end + tail (any other task ends before a successor starts). Its domain starts at the
    bounds of :mod:`pipeopt.core.bounds` on the model's own data (the longest chain, each
    device's load), so the search stops as soon as it meets them."""
    g, md = m.graph, m.model
    lower = max((h + x for h, x in zip(head, q, strict=True)), default=0)
    for tasks in g.device_tasks:
        if tasks:
            lower = max(lower, min(head[i] for i in tasks) + sum(m.dur[i] for i in tasks)
                        + min(q[i] - m.dur[i] for i in tasks))
    lower = min(lower, m.horizon)
    m.value = md.new_int_var(lower, max(lower, m.horizon), "objective")
    for i in range(g.num_tasks):
        if m.tail[i] > 0 or g.succ_offsets[i] == g.succ_offsets[i + 1]:
            md.add(m.value >= m.start[i] + m.dur[i] + m.tail[i])
    md.minimize(m.value)


def _add_hints(m: _Model, warm: GraphSchedule, exact: bool) -> None:
    """Hint every variable from the warm start (floored to units)."""
    md, u = m.model, m.unit
    starts = [_floor(t, u, exact) for t in warm.start]
    for var, s in zip(m.start, starts, strict=True):
        md.add_hint(var, s)
    sent = {mm.edge: _floor(mm.start, u, exact) for mm in warm.messages}
    for e, var in m.send.items():
        a = m.graph.src[e]
        md.add_hint(var, sent.get(e, starts[a] + m.dur[a]))
    if m.value is not None:
        md.add_hint(m.value, max(s + d + t for s, d, t in zip(starts, m.dur, m.tail,
                                                              strict=True)))


def solve_cpsat(graph: TaskGraph, *, time_limit: float = 10.0, resolution: float | None = None,
                workers: int | None = None, seed: int = 0, log: bool = False) -> GraphSchedule:
    """Minimise max(end + tail) over ``graph`` within ``time_limit`` seconds.

    ``resolution``: seconds per time unit (None = chosen by :func:`time_unit`); ``workers``:
    CP-SAT threads (None = its default). The result's ``status`` is ``optimal`` only when its
    objective meets the proven lower bound, else ``feasible`` (or ``heuristic``: the greedy's
    schedule, when the search found nothing better in time). Raises :class:`ValueError` when
    the search proves that no schedule fits the memory limits, or finds none in time and the
    greedy is stuck."""
    t0 = time.perf_counter()
    if not (time_limit > 0 and math.isfinite(time_limit)):
        raise ValueError(f"time_limit: must be a positive number of seconds, got {time_limit}")
    try:
        warm: GraphSchedule | None = solve_greedy(graph)
    except Stuck:
        warm = None
    analytic = lower_bound(graph)
    serial = (sum(graph.duration) + sum(graph.edge_delay) + max(graph.tail, default=0.0))
    horizon_s = warm.objective if warm is not None else serial
    unit, exact = time_unit(graph, horizon_s, resolution)
    mem_unit, mem_exact = memory_unit(graph)
    m = _Model(graph, unit,
               dur=[_floor(x, unit, exact) for x in graph.duration],
               tx=[_floor(x, unit, exact) for x in graph.edge_transmission],
               lat=[_floor(x, unit, exact) for x in graph.edge_latency],
               tail=[_floor(x, unit, exact) for x in graph.tail],
               horizon=math.ceil(horizon_s / unit * (1 + 1e-9)) + 1,
               model=cp_model.CpModel(), start=[], send={})
    head, q = _heads_tails(m)
    _add_devices(m, head, q)
    _add_edges(m, head)
    _add_memory(m, mem_unit, mem_exact)
    _add_objective(m, head, q)
    if warm is not None:
        _add_hints(m, warm, exact)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, time_limit - (time.perf_counter() - t0))
    solver.parameters.random_seed = seed
    if workers is not None:
        solver.parameters.num_workers = workers
    solver.parameters.log_search_progress = log
    status = solver.solve(m.model)
    # The model is a relaxation of the real problem (its bound proven for it) when memory
    # sits on an exact grid or no device has a limit: see the module docstring.
    relaxation = mem_exact or all(x is None for x in graph.memory_limit)
    if status == cp_model.INFEASIBLE and warm is None and relaxation:
        raise ValueError("cpsat: no schedule keeps the memory limits (the model is infeasible)")
    proven = analytic
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) and relaxation:
        proven = max(proven, solver.best_objective_bound * unit)
    best = warm
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        for cand in _candidates(m, solver, exact):
            if best is None or cand.objective < best.objective - 1e-12:
                best = cand
    if best is None:
        raise ValueError(f"cpsat: no schedule found within {time_limit:g} s (CP-SAT status "
                         f"{solver.status_name(status)}) and the greedy is stuck under memory")
    tol = 1e-9 * max(1.0, best.objective)
    found = best is not warm
    state = ("optimal" if best.objective <= proven + tol else
             "feasible" if found else best.status)
    return replace(best, method="cpsat" if found else "cpsat:greedy", status=state,
                   lower_bound=min(proven, best.objective),
                   wall_time=time.perf_counter() - t0)


def _candidates(m: _Model, solver: cp_model.CpSolver, exact: bool) -> list[GraphSchedule]:
    """The solver's device orders re-timed in floats; on an exact grid also its own times."""
    g = m.graph
    su = [solver.value(s) for s in m.start]
    pos = [0] * g.num_tasks
    for k, i in enumerate(g.topological_order):
        pos[i] = k
    orders = [sorted(tasks, key=lambda i: (su[i], su[i] + m.dur[i], pos[i]))
              for tasks in g.device_tasks]
    out = [simulate(g, orders, "cpsat", check=False)]
    if exact:
        start = tuple(x * m.unit for x in su)
        end = tuple(s + d for s, d in zip(start, g.duration, strict=True))
        msgs = []
        for e, var in m.send.items():
            t0 = solver.value(var) * m.unit
            t1 = t0 + g.edge_transmission[e]
            msgs.append(MessageTime(e, t0, t1, t1 + g.edge_latency[e]))
        own = GraphSchedule(g, start, end, tuple(sorted(msgs, key=lambda x: x.start)), "cpsat")
        if not check(own):
            out.append(own)
    return out
