"""Stage partition as an integer program (PuLP with its bundled CBC).

Variables ``y[j, k]`` = 1 when layer j sits on a stage <= k. Contiguity is then linear:
``y[j, k] >= y[j+1, k]`` (later layers never sit on earlier stages) and ``y[j, k] <= y[j, k+1]``;
layer j belongs to stage k when ``x[j, k] = y[j, k] - y[j, k-1]`` is 1, and stage k ends after
layer j when ``y[j, k] - y[j+1, k]`` is 1. Every stage gets at least one layer.

What the DP cannot do exactly: memory per *device* when a device holds several stages (virtual
stages), each stage with its own in-flight count, and per-stage device speeds at once.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import replace
from typing import Any

import numpy as np
import pulp

from pipeopt.partition import ChainCosts, Partition, PartitionError, evaluate
from pipeopt.partition.dp import PartitionResult, best_partition, explain_infeasible


def _var(prob: pulp.LpProblem, name: str, **kw: Any) -> pulp.LpVariable:
    """A variable attached to ``prob`` (PuLP >= 3.3 API, older PuLP as a fallback)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, **kw)
    return pulp.LpVariable(name, **kw)


def ilp_partition(costs: ChainCosts, objective: str = "pipeline", time_limit: float = 30.0,
                  ) -> PartitionResult:
    """Optimal partition for ``objective`` (``pipeline``: sum + (m-1)·max; ``minmax``) under
    per-device memory limits, searched for at most ``time_limit`` seconds.

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
    # _add_memory: per device, over all of its stages.
    for d, lim in enumerate(costs.device_limit):
        if math.isinf(lim):
            continue
        prob += pulp.lpSum(x(j, k) * float(costs.static[j] + costs.inflight[k]
                                           * costs.activation[j])
                           for k in S if costs.stage_device[k] == d for j in J) <= float(lim)
    # Stage times and the objective.
    stage_time = {k: pulp.lpSum(x(j, k) * float(costs.compute[k, j]) for j in J) for k in S}
    big = _var(prob, "max_time", lowBound=0)
    for k in S:
        prob += big >= stage_time[k]
    if objective == "minmax":
        prob += big
    else:
        comm = pulp.lpSum(cut(j, k) * float(costs.comm[k, j]) for k in range(s - 1) for j in J
                          if costs.comm[k, j] != 0)
        prob += pulp.lpSum(stage_time.values()) + comm + (costs.microbatches - 1) * big
    with warnings.catch_warnings():
        # PuLP 3 announces that its bundled CBC moves to an extra in 4.0; it is what we use.
        warnings.simplefilter("ignore", DeprecationWarning)
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit)
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
    (``dp`` or ``ilp``).

    With one stage per device the DP is exact. With several stages per device, the DP without
    memory limits is tried first: when its optimum fits every device's whole limit it is
    optimal for the limited problem too (a relaxation's optimum that is feasible), found in
    milliseconds where the ILP can take longer than its time limit. Otherwise the ILP decides.
    """
    if len(set(costs.stage_device)) == costs.stages:
        return best_partition(costs, objective), "dp"
    free = best_partition(replace(costs, device_limit=np.full(len(costs.device_limit), math.inf)),
                          objective)
    if free.exact and evaluate(costs, free.partition).fits:
        return replace(free, evaluation=evaluate(costs, free.partition)), "dp"
    return ilp_partition(costs, objective, time_limit=time_limit), "ilp"
