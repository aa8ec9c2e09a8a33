"""An exact search over any TaskGraph with OR-Tools CP-SAT.

The model, in integer time units on the grid of :mod:`pipeopt.solvers.cpsat_grid` (see
:func:`time_grid_of`; the one place where seconds and bytes become integers):

* one fixed-size interval per task; one task at a time per device (:func:`_add_devices`);
  a communication task's interval is on every network resource it holds (:func:`_add_edges`);
* an edge waits for its source's end plus its latency (:func:`_add_edges`); a message that
  occupies its link is an interval of its transmission on the directed link, sent after the
  source ends and arriving ``latency`` after it leaves the link; one message or communication
  task at a time per network resource;
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
from dataclasses import dataclass, replace

from ortools.sat.python import cp_model

from pipeopt.core.bounds import lower_bound
from pipeopt.core.graph import TaskGraph
from pipeopt.core.greedy import Stuck, solve_greedy
from pipeopt.core.schedule import GraphSchedule, MessageTime
from pipeopt.core.simulate import simulate
from pipeopt.core.validate import check
from pipeopt.solvers.cpsat_grid import Grid, memory_grid, time_grid


def time_grid_of(graph: TaskGraph, resolution: float | None = None) -> Grid:
    """The time grid (:func:`pipeopt.solvers.cpsat_grid.time_grid`) of every duration,
    transmission, latency and tail of ``graph``."""
    values = [*graph.duration, *graph.edge_transmission, *graph.edge_latency, *graph.tail]
    return time_grid(values, resolution)


def memory_grids_of(graph: TaskGraph) -> list[Grid | None]:
    """Per device, the memory grid (:func:`pipeopt.solvers.cpsat_grid.memory_grid`) of its
    changes (by size: decreases count as well as increases) and its free capacity; None for a
    device without a limit."""
    grids: list[Grid | None] = []
    for d, lim in enumerate(graph.memory_limit):
        if lim is None:
            grids.append(None)
            continue
        changes = [abs(x) for i in graph.device_tasks[d]
                   for x in (graph.mem_start[i], graph.mem_end[i])]
        grids.append(memory_grid(changes, lim - graph.static_memory[d]))
    return grids


@dataclass
class _Model:
    """The CP-SAT model and its variables (units)."""

    graph: TaskGraph
    grid: Grid
    dur: list[int]
    tx: list[int]  # per edge; only edges with a positive real transmission occupy a link
    lat: list[int]
    tail: list[int]
    horizon: int
    model: cp_model.CpModel
    start: list[cp_model.IntVar]
    send: dict[int, cp_model.IntVar]  # edge -> message start
    value: cp_model.IntVar | None = None


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


def _add_edges(m: _Model, head: list[int], ivs: list[cp_model.IntervalVar]) -> None:
    """dst starts after src ends + latency; a message that occupies its link is sent after src
    ends, takes ``tx`` units on the link and arrives ``lat`` after; one message or
    communication task (``ivs``: the tasks' intervals) at a time per network resource."""
    g, md = m.graph, m.model
    per_link: dict[int, list[cp_model.IntervalVar]] = {}
    for i in g.comm_tasks:
        for r in g.holds[i]:
            per_link.setdefault(r, []).append(ivs[i])
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


def _add_memory(m: _Model, grids: list[Grid | None]) -> None:
    """Per device with a limit: a reservoir of the changes at every start and end, within
    [-(all decreases), capacity], on the device's memory grid; changes rounded up, the
    capacity down (see module doc)."""
    g, md = m.graph, m.model
    for d, lim in enumerate(g.memory_limit):
        grid = grids[d]
        if lim is None or grid is None:
            continue
        cap = grid.down(lim - g.static_memory[d])
        times, changes = [], []
        low = 0
        for i in g.device_tasks[d]:
            for t, x in ((m.start[i], g.mem_start[i]), (m.start[i] + m.dur[i], g.mem_end[i])):
                c = grid.up(x)
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


def _add_hints(m: _Model, warm: GraphSchedule) -> None:
    """Hint every variable from the warm start (floored to units)."""
    md, grid = m.model, m.grid
    starts = [grid.down(t) for t in warm.start]
    for var, s in zip(m.start, starts, strict=True):
        md.add_hint(var, s)
    sent = {mm.edge: grid.down(mm.start) for mm in warm.messages}
    for e, var in m.send.items():
        a = m.graph.src[e]
        md.add_hint(var, sent.get(e, starts[a] + m.dur[a]))
    if m.value is not None:
        md.add_hint(m.value, max(s + d + t for s, d, t in zip(starts, m.dur, m.tail,
                                                              strict=True)))


def solve_cpsat(graph: TaskGraph, *, time_limit: float = 10.0, resolution: float | None = None,
                workers: int | None = None, seed: int = 0, log: bool = False,
                initial: GraphSchedule | None = None) -> GraphSchedule:
    """Minimise max(end + tail) over ``graph`` within ``time_limit`` seconds.

    ``resolution``: seconds per time unit (None = chosen by :func:`time_grid_of`); ``workers``:
    CP-SAT threads (None = its default). The result's ``status`` is ``optimal`` only when its
    objective meets the proven lower bound, else ``feasible`` (or ``heuristic``: the greedy's
    schedule, when the search found nothing better in time). Raises :class:`ValueError` when
    the search proves that no schedule fits the memory limits, or finds none in time and the
    greedy is stuck. ``initial``: a valid schedule of ``graph`` (e.g. a hand-made one) that
    hints the search instead of the greedy's when it is shorter."""
    t0 = time.perf_counter()
    if not (time_limit > 0 and math.isfinite(time_limit)):
        raise ValueError(f"time_limit: must be a positive number of seconds, got {time_limit}")
    if initial is not None and initial.graph is not graph and initial.graph != graph:
        raise ValueError("initial: a schedule of another graph")
    try:
        warm: GraphSchedule | None = solve_greedy(graph)
    except Stuck:
        warm = None
    if initial is not None and (warm is None or initial.objective < warm.objective):
        warm = replace(initial, status="heuristic")
    analytic = lower_bound(graph)
    serial = (sum(graph.duration) + sum(graph.edge_delay) + max(graph.tail, default=0.0))
    horizon_s = warm.objective if warm is not None else serial
    grid = time_grid_of(graph, resolution)
    mem_grids = memory_grids_of(graph)
    m = _Model(graph, grid,
               dur=[grid.down(x) for x in graph.duration],
               tx=[grid.down(x) for x in graph.edge_transmission],
               lat=[grid.down(x) for x in graph.edge_latency],
               tail=[grid.down(x) for x in graph.tail],
               horizon=math.ceil(horizon_s / grid.unit * (1 + 1e-9)) + 1,
               model=cp_model.CpModel(), start=[], send={})
    head, q = _heads_tails(m)
    ivs = _add_devices(m, head, q)
    _add_edges(m, head, ivs)
    _add_memory(m, mem_grids)
    _add_objective(m, head, q)
    if warm is not None:
        _add_hints(m, warm)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, time_limit - (time.perf_counter() - t0))
    solver.parameters.random_seed = seed
    if workers is not None:
        solver.parameters.num_workers = workers
    solver.parameters.log_search_progress = log
    status = solver.solve(m.model)
    # The model is a relaxation of the real problem (its bound proven for it) when memory
    # sits on an exact grid on every device with a limit: see the module docstring.
    relaxation = all(mg is None or mg.exact for mg in mem_grids)
    if status == cp_model.INFEASIBLE and warm is None and relaxation:
        raise ValueError("cpsat: no schedule keeps the memory limits (the model is infeasible)")
    proven = analytic
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) and relaxation:
        proven = max(proven, grid.seconds(solver.best_objective_bound))
    best = warm
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        for cand in _candidates(m, solver):
            if best is None or cand.objective < best.objective - 1e-12:
                best = cand
    if best is None:
        raise ValueError(f"cpsat: no schedule found within {time_limit:g} s (CP-SAT status "
                         f"{solver.status_name(status)}) and the greedy is stuck under memory")
    tol = 1e-9 * max(1.0, best.objective)
    found = best is not warm
    state = ("optimal" if best.objective <= proven + tol else
             "feasible" if found else best.status)
    start = "greedy" if warm is None or initial is None or warm.method == "greedy" else (
        warm.method)
    return replace(best, method="cpsat" if found else f"cpsat:{start}", status=state,
                   lower_bound=min(proven, best.objective),
                   wall_time=time.perf_counter() - t0)


def _candidates(m: _Model, solver: cp_model.CpSolver) -> list[GraphSchedule]:
    """The solver's device orders re-timed in floats; on an exact grid also its own times."""
    g = m.graph
    su = [solver.value(s) for s in m.start]
    pos = [0] * g.num_tasks
    for k, i in enumerate(g.topological_order):
        pos[i] = k
    orders = [sorted(tasks, key=lambda i: (su[i], su[i] + m.dur[i], pos[i]))
              for tasks in g.device_tasks]
    out = [simulate(g, orders, "cpsat", check=False)]
    if g.comm_tasks:  # the simulator queues these first-ready: keep the solver's own order too
        shifted = _left_shift(m, su, {e: solver.value(var) for e, var in m.send.items()}, pos)
        if not check(shifted):  # valid by construction; checked as the own times are
            out.append(shifted)
    if m.grid.exact:
        start = tuple(m.grid.seconds(x) for x in su)
        end = tuple(s + d for s, d in zip(start, g.duration, strict=True))
        msgs = []
        for e, var in m.send.items():
            t0 = m.grid.seconds(solver.value(var))
            t1 = t0 + g.edge_transmission[e]
            msgs.append(MessageTime(e, t0, t1, t1 + g.edge_latency[e]))
        own = GraphSchedule(g, start, end, tuple(sorted(msgs, key=lambda x: x.start)), "cpsat")
        if not check(own):
            out.append(own)
    return out


def _left_shift(m: _Model, su: list[int], sent: dict[int, int], pos: list[int]
                ) -> GraphSchedule:
    """The solver's sequence on every device and network resource, timed in floats as early as
    it allows: tasks and messages in the order of their start in units (a message right after
    its source, ties in topological order), each at the earliest time its inputs, its device
    and its resources allow. Every edge and one-at-a-time rule holds by construction (an item
    waits for everything before it on its device or resources), so it only differs from the
    solver's own times by the rounding of the grid."""
    g = m.graph
    tx, lat, link = g.edge_transmission, g.edge_latency, g.edge_link
    items = [(su[i], pos[i], 0, i) for i in range(g.num_tasks)]
    items += [(u, pos[g.src[e]], 1, e) for e, u in sent.items()]
    items.sort()
    start = [0.0] * g.num_tasks
    end = [0.0] * g.num_tasks
    arrival = [0.0] * g.num_edges  # when the edge's destination may use it
    dev_free = [0.0] * g.devices
    free = [0.0] * g.num_resources
    msgs = []
    for _, _, kind, x in items:
        if kind:  # edge x's message, after its source ended
            t0 = max(end[g.src[x]], free[link[x]])
            free[link[x]] = t0 + tx[x]
            arrival[x] = t0 + tx[x] + lat[x]
            msgs.append(MessageTime(x, t0, t0 + tx[x], arrival[x]))
            continue
        d = g.device[x]
        t = dev_free[d] if d >= 0 else 0.0
        for e in g.preds(x):
            if e not in sent:
                arrival[e] = end[g.src[e]] + lat[e]
            t = max(t, arrival[e])
        if d < 0:
            t = max(t, *(free[r] for r in g.holds[x]))
        start[x], end[x] = t, t + g.duration[x]
        if d >= 0:
            dev_free[d] = end[x]
        else:
            for r in g.holds[x]:
                free[r] = end[x]
    return GraphSchedule(g, tuple(start), tuple(end),
                         tuple(sorted(msgs, key=lambda x: x.start)), "cpsat")
