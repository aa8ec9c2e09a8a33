"""Exact dynamic programs for partitioning a chain of layers into contiguous stages.

Stage k covering layers [i, j) costs C_k(i, j) = sum of ``compute[k, i:j]`` (per micro-batch,
forward + backward) and fits in memory when static(i, j) + inflight[k]·activation(i, j) is within
the stage's limit. Two objectives:

- ``minmax``: the largest stage time (the steady-state period of a pipeline);
- ``pipeline``: sum_k (C_k + boundary delay) + (m-1)·max_k C_k — the latency of m micro-batches
  through the stages, the objective of Alpa's inter-operator pass (Zheng et al., OSDI'22,
  section 5.2). It is solved exactly by enumerating the candidate maxima T (the distinct
  segment costs) in increasing order and solving min-sum subject to C_k <= T for each, stopping
  once (m-1)·T plus the unconstrained minimum sum can no longer beat the best found.

Each DP is O(S·L²), vectorised with numpy over the (start, end) matrix of every stage.

Per-stage modes (``ChainCosts.mode_names``, e.g. recomputation none / selective / full) leave
the state as it is: stage k on layers [i, j) costs the least C_k(i, j) over the modes whose
memory fits (inf when none does), so the DP is exact over partitions x modes at M times the
work; the chosen modes are those :func:`pipeopt.partition.choose_modes` gives the partition.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from pipeopt.partition import (
    ChainCosts,
    Evaluation,
    Partition,
    PartitionError,
    evaluate,
    uniform_partition,
)

INF = math.inf


@dataclass(frozen=True)
class PartitionResult:
    """A partition with its analytic evaluation; ``candidates`` are the other partitions met
    during the search (distinct, best objective first), for the joint search."""

    partition: Partition
    evaluation: Evaluation
    objective: str
    exact: bool = True
    candidates: tuple[Partition, ...] = ()


class _Segments:
    """Per-stage (L+1)x(L+1) matrices of segment costs; inf where i >= j or memory overflows."""

    def __init__(self, costs: ChainCosts) -> None:
        self.costs = costs
        n = costs.layers
        idx = np.arange(n + 1)
        self.valid = idx[:, None] < idx[None, :]
        zero = np.zeros(1)
        self.pre_c = np.concatenate([np.zeros((costs.stages, 1)),
                                     np.cumsum(costs.compute, axis=1)], axis=1)
        self.mode_pre_c = [np.concatenate([np.zeros((costs.stages, 1)),
                                           np.cumsum(costs.compute_of(m), axis=1)], axis=1)
                           for m in range(costs.modes)]
        ps = np.concatenate([zero, np.cumsum(costs.static)])
        self.static = ps[None, :] - ps[:, None]
        self.mode_act = []
        for m in range(costs.modes):
            pa = np.concatenate([zero, np.cumsum(costs.activation_of(m))])
            self.mode_act.append(pa[None, :] - pa[:, None])
        self.act = self.mode_act[0]
        self.limit = costs.stage_limit

    def time(self, k: int) -> np.ndarray:
        """C_k(i, j): the least over the modes that fit; inf where empty or no mode fits."""
        if self.costs.modes == 1:
            pre = self.mode_pre_c[0][k]
            return np.where(self.valid & self._fits(k, 0), pre[None, :] - pre[:, None], INF)
        out = np.full(self.valid.shape, INF)
        for m in range(self.costs.modes):
            pre = self.mode_pre_c[m][k]
            c = pre[None, :] - pre[:, None]
            out = np.minimum(out, np.where(self.valid & self._fits(k, m), c, INF))
        return out

    def _memory(self, k: int, mode: int) -> np.ndarray:
        return self.static + self.costs.inflight[k] * self.mode_act[mode]

    def memory(self, k: int) -> np.ndarray:
        """Bytes stage k needs for layers [i, j) (in its leanest mode)."""
        out = self._memory(k, 0)
        for m in range(1, self.costs.modes):
            out = np.minimum(out, self._memory(k, m))
        return out

    def _fits(self, k: int, mode: int) -> np.ndarray:
        lim = self.limit[k]
        if math.isinf(lim):
            return np.ones_like(self.valid)
        return self._memory(k, mode) <= lim * (1 + 1e-9)

    def fits(self, k: int) -> np.ndarray:
        """Where some mode of stage k fits its limit."""
        return self.memory(k) <= self.limit[k] * (1 + 1e-9) if not math.isinf(
            self.limit[k]) else np.ones_like(self.valid)

    def comm(self, k: int) -> np.ndarray:
        """Boundary delay after stage k when it ends before layer j (row vector over j)."""
        out = np.zeros(self.costs.layers + 1)
        if k < self.costs.stages - 1:
            out[1:] = self.costs.comm[k]
        return out


def _backtrack(args: list[np.ndarray], n: int) -> Partition:
    parts = []
    j = n
    for k in range(len(args) - 1, -1, -1):
        i = int(args[k][j]) if k > 0 else 0
        parts.append((i, j))
        j = i
    return tuple(reversed(parts))


def _minmax(seg: _Segments, cost: list[np.ndarray]) -> tuple[float, Partition | None]:
    """min over partitions of max_k cost_k(i, j)."""
    s, n = seg.costs.stages, seg.costs.layers
    dp = cost[0][0].copy()
    args: list[np.ndarray] = [np.zeros(n + 1, dtype=int)]
    for k in range(1, s):
        cand = np.maximum(dp[:, None], cost[k])
        args.append(cand.argmin(axis=0))
        dp = cand.min(axis=0)
    if math.isinf(dp[n]):
        return INF, None
    return float(dp[n]), _backtrack(args, n)


def _minsum(seg: _Segments, times: list[np.ndarray], comms: list[np.ndarray],
            cap: float) -> tuple[float, Partition | None]:
    """min over partitions with every stage time <= cap of sum (time + boundary delay)."""
    s, n = seg.costs.stages, seg.costs.layers
    # Ties (equal sums, e.g. every partition whose max is the LM head's time) go to the most
    # balanced stages: a tiny penalty on squared stage times, far below float noise of the sum.
    # The penalty is 1e-12 * t^2 / top, computed as 1e-12 * top * (t / top)^2 so that neither
    # huge nor subnormal times overflow (an inf times 0 would make the cost NaN).
    top = max((float(t[np.isfinite(t)].max(initial=0.0)) for t in times), default=0.0)
    scale = top if top > 0 else 1.0
    cost = [np.where(t <= cap, t + c[None, :]
                     + 1e-12 * top * (np.where(np.isfinite(t), t, 0.0) / scale) ** 2, INF)
            for t, c in zip(times, comms, strict=True)]
    dp = cost[0][0].copy()
    args: list[np.ndarray] = [np.zeros(n + 1, dtype=int)]
    for k in range(1, s):
        cand = dp[:, None] + cost[k]
        args.append(cand.argmin(axis=0))
        dp = cand.min(axis=0)
    if math.isinf(dp[n]):
        return INF, None
    return float(dp[n]), _backtrack(args, n)


def explain_infeasible(costs: ChainCosts) -> str:
    """Why no partition fits: the partition that minimises the largest memory overflow, and its
    worst stage (bytes needed, the limit, by how much it is over)."""
    seg = _Segments(costs)
    over = [np.where(seg.valid, seg.memory(k) - seg.limit[k], INF) for k in range(costs.stages)]
    _, part = _minmax(seg, over)
    if part is None:  # cannot happen with L >= S
        return "no partition exists"
    if len(set(costs.stage_device)) < costs.stages:
        return _explain_per_device(costs, part)
    worst = max(range(costs.stages),
                key=lambda k: seg.memory(k)[part[k][0], part[k][1]] - seg.limit[k])
    a, b = part[worst]
    need = float(seg.memory(worst)[a, b])
    lim = float(seg.limit[worst])
    st = float(costs.static[a:b].sum())
    lean = min(range(costs.modes), key=lambda m: float(costs.activation_of(m)[a:b].sum()))
    act = float(costs.activation_of(lean)[a:b].sum())
    how = f" (recompute {costs.mode_names[lean]}, its leanest mode)" if costs.mode_names else ""
    return (f"no partition into {costs.stages} stages fits in memory; the closest one still has "
            f"stage {worst} (device {costs.stage_device[worst]}, layers [{a}, {b})) needing "
            f"{_gib(need)} = {_gib(st)} static + {costs.inflight[worst]:g} micro-batches x "
            f"{_gib(act)} activations{how}, {_gib(need - lim)} over its limit of {_gib(lim)}")


def _explain_per_device(costs: ChainCosts, part: Partition) -> str:
    """:func:`explain_infeasible` when devices hold several stages: the device of ``part``
    furthest over its whole limit, with its stages."""
    ev = evaluate(costs, part)
    lim = costs.device_limit
    worst = max(range(len(lim)), key=lambda d: ev.device_memory[d] - lim[d])
    held = [k for k, d in enumerate(costs.stage_device) if d == worst]
    what = ", ".join(f"stage {k} (layers [{part[k][0]}, {part[k][1]}), "
                     f"{_gib(ev.stage_memory[k])})" for k in held)
    return (f"no partition into {costs.stages} stages fits in memory; the closest one still has "
            f"device {worst} holding {what}: {_gib(ev.device_memory[worst])} in all, "
            f"{_gib(ev.device_memory[worst] - lim[worst])} over its limit of {_gib(lim[worst])}")


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB ({x:.4g} bytes)"


def min_max_partition(costs: ChainCosts) -> PartitionResult:
    """The partition minimising the largest stage time (ties: the smallest total time)."""
    seg = _Segments(costs)
    times = [seg.time(k) for k in range(costs.stages)]
    best, _ = _minmax(seg, times)
    if math.isinf(best):
        raise PartitionError(explain_infeasible(costs))
    comms = [seg.comm(k) for k in range(costs.stages)]
    _, part = _minsum(seg, times, comms, best)
    assert part is not None
    return PartitionResult(part, evaluate(costs, part), "minmax")


def pipeline_partition(costs: ChainCosts, max_candidates: int = 5000) -> PartitionResult:
    """The partition minimising sum_k (C_k + delay_k) + (m-1)·max_k C_k, exactly.

    ``max_candidates`` caps the candidate maxima tried (``exact`` is False if it is reached).
    """
    seg = _Segments(costs)
    s = costs.stages
    times = [seg.time(k) for k in range(s)]
    comms = [seg.comm(k) for k in range(s)]
    t_star, _ = _minmax(seg, times)
    if math.isinf(t_star):
        raise PartitionError(explain_infeasible(costs))
    m1 = costs.microbatches - 1
    found: dict[Partition, float] = {}

    def consider(part: Partition | None) -> float:
        if part is None:
            return INF
        if part not in found:
            found[part] = evaluate(costs, part).objective
        return found[part]

    sum_lb, part_inf = _minsum(seg, times, comms, INF)
    consider(part_inf)
    _, part_star = _minsum(seg, times, comms, t_star)
    consider(part_star)
    exact = True
    if m1 > 0:
        values = np.unique(np.concatenate([t[np.isfinite(t)] for t in times]))
        values = values[values > t_star]
        for tried, cap in enumerate(values):
            best = min(found.values())
            if sum_lb + m1 * cap >= best:
                break
            if tried >= max_candidates:
                exact = False
                break
            consider(_minsum(seg, times, comms, float(cap))[1])
    ranked = sorted(found, key=found.__getitem__)
    best_part = ranked[0]
    return PartitionResult(best_part, evaluate(costs, best_part), "pipeline", exact,
                           tuple(ranked))


def best_partition(costs: ChainCosts, objective: str = "pipeline") -> PartitionResult:
    """:func:`pipeline_partition` or :func:`min_max_partition`."""
    if objective == "minmax":
        return min_max_partition(costs)
    return pipeline_partition(costs)


def neighbours(partition: Partition, layers: int) -> list[Partition]:
    """Partitions that move one stage boundary by one layer (never emptying a stage)."""
    cuts = [b for _, b in partition[:-1]]
    out = []
    for i, c in enumerate(cuts):
        for d in (-1, 1):
            new = c + d
            lo = cuts[i - 1] if i > 0 else 0
            hi = cuts[i + 1] if i + 1 < len(cuts) else layers
            if lo < new < hi:
                nc = [*cuts[:i], new, *cuts[i + 1:]]
                bounds = [0, *nc, layers]
                out.append(tuple(itertools.pairwise(bounds)))
    return out


def top_partitions(costs: ChainCosts, k: int, objective: str = "pipeline",
                   extra: list[Partition] | None = None) -> list[tuple[Partition, Evaluation]]:
    """Up to ``k`` distinct partitions that fit in memory, best analytic objective first: the
    DP optimum, the other partitions the DP met, one-boundary moves of those, and ``extra``."""
    res = best_partition(costs, objective)
    pool: dict[Partition, Evaluation] = {}
    seeds = [res.partition, *res.candidates, *(extra or [])]
    for part in seeds:
        pool.setdefault(part, evaluate(costs, part))
    for part in list(pool)[:k]:
        for nb in neighbours(part, costs.layers):
            pool.setdefault(nb, evaluate(costs, nb))

    def key(item: tuple[Partition, Evaluation]) -> float:
        ev = item[1]
        return ev.max_time if objective == "minmax" else ev.objective

    ranked = sorted((it for it in pool.items() if it[1].fits), key=key)
    return ranked[:k]


def exhaustive_partition(costs: ChainCosts, objective: str = "pipeline") -> tuple[float, Partition]:
    """Brute force over every partition and, with per-stage modes, every mode of every stage
    (for tests on tiny chains): (best value, partition)."""
    n, s = costs.layers, costs.stages
    best: tuple[float, Partition] = (INF, ())
    for cuts in itertools.combinations(range(1, n), s - 1):
        bounds = [0, *cuts, n]
        part = tuple(itertools.pairwise(bounds))
        for modes in itertools.product(range(costs.modes), repeat=s):
            ev = evaluate(costs, part, modes if costs.mode_names else None)
            if not all(m <= lim * (1 + 1e-9) for m, lim in zip(ev.stage_memory,
                                                               costs.stage_limit, strict=True)):
                continue
            val = ev.max_time if objective == "minmax" else ev.objective
            if val < best[0]:
                best = (val, part)
    return best


__all__ = ["PartitionResult", "best_partition", "exhaustive_partition", "explain_infeasible",
           "min_max_partition", "neighbours", "pipeline_partition", "top_partitions",
           "uniform_partition"]
