"""Stage partition as an integer program (PuLP with its bundled CBC).

Variables ``y[j, k]`` = 1 when layer j sits on a stage <= k. Contiguity is then linear:
``y[j, k] >= y[j+1, k]`` (later layers never sit on earlier stages) and ``y[j, k] <= y[j, k+1]``;
layer j belongs to stage k when ``x[j, k] = y[j, k] - y[j, k-1]`` is 1, and stage k ends after
layer j when ``y[j, k] - y[j+1, k]`` is 1. Every stage gets at least one layer.

What the DP cannot do exactly: memory per *device* when a device holds several stages (virtual
stages), each stage with its own in-flight count, and per-stage device speeds at once.

Per-stage modes (``ChainCosts.mode_names``): a binary ``z[k, m]`` per stage and mode, one per
stage, and for every layer whose cost differs between modes a variable
``u[j, k, m] >= x[j, k] + z[k, m] - 1`` (>= 0): 1 exactly when layer j is on stage k run in
mode m (the usual product of two binaries; its cost and bytes are non-negative, so the
least value is the product). Stage times and memory then sum ``u`` times mode m's figures.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import replace
from typing import Any

import pulp

from pipeopt.partition import ChainCosts, Partition, PartitionError, choose_modes, evaluate
from pipeopt.partition.dp import (
    PartitionResult,
    best_partition,
    explain_infeasible,
    neighbours,
)


def _var(prob: pulp.LpProblem, name: str, **kw: Any) -> pulp.LpVariable:
    """A variable attached to ``prob`` (PuLP >= 3.3 API, older PuLP as a fallback)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, **kw)
    return pulp.LpVariable(name, **kw)


def ilp_partition(costs: ChainCosts, objective: str = "pipeline", time_limit: float = 30.0,
                  start: Partition | None = None) -> PartitionResult:
    """Optimal partition for ``objective`` (``pipeline``: sum of stage times and delays +
    (m-1)·the busiest device's time per micro-batch; ``minmax``: that device's time) under
    per-device memory limits, searched for at most ``time_limit`` seconds; ``start`` is a
    partition CBC starts from.

    The result's ``exact`` is False when CBC stopped at the time limit with a partition it had
    not proven optimal. Raises :class:`PartitionError` when nothing fits, or when the time limit
    passes before any partition is found."""
    t0 = time.perf_counter()
    n, s = costs.layers, costs.stages
    J, S = range(n), range(s)
    prob = pulp.LpProblem("partition", pulp.LpMinimize)
    y = {(j, k): _var(prob, f"y_{j}_{k}", cat="Binary") for j in J for k in S}

    def x(j: int, k: int) -> pulp.LpAffineExpression:
        return y[j, k] - (y[j, k - 1] if k > 0 else 0)

    def cut(j: int, k: int) -> pulp.LpAffineExpression:
        return y[j, k] - (y[j + 1, k] if j + 1 < n else 0)

    # _add_contiguity: monotone in layers and in stages; first and last layer pinned.
    for j in J:
        prob += y[j, s - 1] == 1
        for k in S:
            if j + 1 < n:
                prob += y[j, k] >= y[j + 1, k]
            if k + 1 < s:
                prob += y[j, k] <= y[j, k + 1]
    # _add_band: with no empty stage, layer j sits on a stage in [s - n + j, j]; fixing the
    # variables outside that band is implied but helps CBC's presolve.
    for j in J:
        for k in S:
            if k >= j:
                prob += y[j, k] == 1
            elif k < s - n + j:
                prob += y[j, k] == 0
    # _add_nonempty: every stage holds a layer.
    for k in S:
        prob += pulp.lpSum(x(j, k) for j in J) >= 1
    # _add_modes: one mode per stage; u[j, k, m] = x(j, k) * z[k, m] where the modes differ.
    # Without modes the model is the plain partition ILP (no z, no u).
    M = range(costs.modes) if costs.mode_names else range(0)
    z = {(k, m): _var(prob, f"z_{k}_{m}", cat="Binary") for k in S for m in M}
    for k in S:
        if costs.mode_names:
            prob += pulp.lpSum(z[k, m] for m in M) == 1
    varies = [j for j in J if any(
        costs.activation_of(m)[j] != costs.activation[j]
        or (costs.compute_of(m)[:, j] != costs.compute[:, j]).any() for m in M)]
    u = {(j, k, m): _var(prob, f"u_{j}_{k}_{m}", lowBound=0) for j in varies for k in S
         for m in M}
    for (j, k, m), var in u.items():
        prob += var >= x(j, k) + z[k, m] - 1

    u_layers = set(varies)

    def in_modes(j: int, k: int, value: Any) -> pulp.LpAffineExpression:
        """Layer j's figure on stage k: ``value(m)`` of the stage's mode."""
        if j in u_layers:
            return pulp.lpSum(u[j, k, m] * float(value(m)) for m in M)
        return x(j, k) * float(value(0))

    # _add_memory: per device, over all of its stages, in units of the device's limit: byte
    # counts of 1e9-1e11 beside 0/1 variables made CBC's LP on a warm start cycle past its
    # time limit (Llama-2 70B at 128k tokens, v = 2: minutes against 1.5 s).
    for d, lim in enumerate(costs.device_limit):
        if math.isinf(lim):
            continue
        unit = float(lim) if lim > 0 else 1.0
        prob += pulp.lpSum(
            x(j, k) * float((costs.static[j] + costs.inflight[k] * costs.activation[j]) / unit)
            if j not in u_layers else
            x(j, k) * float(costs.static[j] / unit)
            + in_modes(j, k, lambda m, j=j, k=k, unit=unit: costs.inflight[k]
                       * costs.activation_of(m)[j] / unit)
            for k in S if costs.stage_device[k] == d for j in J) <= float(lim) / unit
    # Stage times and the objective.
    stage_time = {k: pulp.lpSum(in_modes(j, k, lambda m, j=j, k=k: costs.compute_of(m)[k, j])
                                for j in J) for k in S}
    big = _var(prob, "max_time", lowBound=0)
    for d in sorted(set(costs.stage_device)):  # the busiest device paces the steady state
        prob += big >= pulp.lpSum(stage_time[k] for k in S if costs.stage_device[k] == d)
    if objective == "minmax":
        prob += big
    else:
        comm = pulp.lpSum(cut(j, k) * float(costs.comm[k, j]) for k in range(s - 1) for j in J
                          if costs.comm[k, j] != 0)
        prob += pulp.lpSum(stage_time.values()) + comm + (costs.microbatches - 1) * big
    with warnings.catch_warnings():
        # PuLP 3 announces that its bundled CBC moves to an extra in 4.0; it is what we use.
        warnings.simplefilter("ignore", DeprecationWarning)
        if start is not None:  # a known partition as CBC's first incumbent
            for k, (_, b) in enumerate(start):
                for j in J:
                    y[j, k].setInitialValue(1 if j < b else 0)
            start_modes = choose_modes(costs, start)
            for k in S if costs.mode_names else ():
                for m in M:
                    z[k, m].setInitialValue(1 if start_modes[k] == m else 0)
            for (j, k, m), var in u.items():
                a, b = start[k]
                var.setInitialValue(1 if a <= j < b and start_modes[k] == m else 0)
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit,
                                   warmStart=start is not None)
    status = prob.solve(solver)
    # CBC stopped by its time limit with an incumbent reports status "Optimal"; only the
    # solution status tells a proven optimum from a merely feasible partition.
    found = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if pulp.LpStatus[status] == "Infeasible":
        raise PartitionError(explain_infeasible(costs) + " (per-device limits, ILP)")
    if not found:
        raise PartitionError(f"partition ILP: no partition found in {time_limit:g} s "
                             f"({pulp.LpStatus[status]} after {time.perf_counter() - t0:.1f} s); "
                             "raise training.ilp_time_limit")
    exact = prob.sol_status == pulp.LpSolutionOptimal
    stage_of = []
    for j in J:
        stage_of.append(next(k for k in S if (y[j, k].value() or 0) > 0.5))
    parts: list[tuple[int, int]] = []
    for k in S:
        ls = [j for j in J if stage_of[j] == k]
        parts.append((min(ls), max(ls) + 1))
    part: Partition = tuple(parts)
    return PartitionResult(part, evaluate(costs, part), objective, exact)


def per_device_partition(costs: ChainCosts, objective: str = "pipeline",
                         time_limit: float = 30.0) -> tuple[PartitionResult, str]:
    """The best partition under per-device memory limits, and which search found it
    (``dp`` or ``ilp``). With one stage per device the DP is exact; with several, the ILP
    decides (see below), within ``time_limit`` seconds."""
    if len(set(costs.stage_device)) == costs.stages:
        return best_partition(costs, objective), "dp"
    # The DP's answers for each stage (its limit split evenly over the device's stages), each
    # improved by moving one boundary at a time on the true objective, start the ILP, which
    # prices the busiest device's whole load and memory: the ILP's answer is never worse, and
    # the start stands if the ILP finds nothing in time.
    start = _best_start(costs, objective)
    try:
        found = ilp_partition(costs, objective, time_limit=time_limit,
                              start=None if start is None else start.partition)
    except PartitionError:
        if start is None:
            raise
        return replace(start, exact=False), "dp"
    if start is not None and (_value(costs, start.evaluation, objective)
                              < _value(costs, found.evaluation, objective) - 1e-12):
        return replace(start, exact=False), "dp"
    return found, "ilp"


def _best_start(costs: ChainCosts, objective: str) -> PartitionResult | None:
    """The best of the DP's partitions (pipeline and min-max objectives), each improved by
    steepest descent over one-layer boundary moves (see :func:`neighbours`)."""
    starts = []
    for how in ("pipeline", "minmax"):
        try:
            starts.append(best_partition(costs, how).partition)
        except PartitionError:
            continue
    best: PartitionResult | None = None
    for part in starts:
        cur, ev = part, evaluate(costs, part)
        value = _value(costs, ev, objective)
        while True:
            step = None
            for nb in neighbours(cur, costs.layers):
                e = evaluate(costs, nb)
                v = _value(costs, e, objective)
                if e.fits and v < value - 1e-12 and (step is None or v < step[2]):
                    step = (nb, e, v)
            if step is None:
                break
            cur, ev, value = step
        if best is None or value < _value(costs, best.evaluation, objective):
            best = PartitionResult(cur, ev, objective, exact=False)
    return best


def _value(costs: ChainCosts, ev: Any, objective: str) -> float:
    """The ILP's objective of an evaluated partition: the pipeline objective, or (minmax)
    the busiest device's time per micro-batch."""
    if objective != "minmax":
        return float(ev.objective)
    load: dict[int, float] = {}
    for k, t in enumerate(ev.stage_time):
        load[costs.stage_device[k]] = load.get(costs.stage_device[k], 0.0) + t
    return max(load.values())
