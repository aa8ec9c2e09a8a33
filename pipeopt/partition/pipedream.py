"""PipeDream's planner: which layers form each stage and how many devices replicate it.

The dynamic program of PipeDream (Narayanan et al., SOSP'19, section 3.1, "Partitioning
Algorithm"), over a topology of levels (e.g. 4 GPUs per node, then 2 nodes), each with the
bandwidth between its units. For layers ``i..j`` on ``r`` replicated units of level k:

* ``T_k(i..j, r) = max(unit_k(i..j), sync_k(i..j, r)) / r`` seconds per micro-batch: each
  replica runs every r-th micro-batch and then synchronises the stage's weights; the paper
  takes the larger of the two (computation and synchronisation overlap). ``unit_1`` is the
  layers' compute on one device (F + B + W per micro-batch); ``unit_k`` of a higher level is the
  best pipeline of those layers inside one unit of level k - 1 (all its devices).
  ``sync_k = 2 (r - 1) / r * weight_bytes / bandwidth_k`` (ring all-reduce, Patarasuk and Yuan,
  2009; the paper uses its parameter server's cost, the same shape);
* ``A_k(i..j, m)``: the least period of a pipeline of layers ``i..j`` on m units of level k:
  ``min(T_k(i..j, m), min over s, m' of max(A_k(i..s, m - m'), comm_k(s), T_k(s+1..j, m')))``
  with ``comm_k(s) = output_bytes[s] / bandwidth_k``, the activation crossing the cut (and the
  gradient back on the other direction of a full-duplex link; the paper counts ``2 C`` on a
  shared one).

The answer at the top level is the estimated period (s per micro-batch) and the flattened
stages: a top-level stage on r units whose units each run an inner pipeline gives the inner
stages r times their replicas. :func:`plan_problem` turns a plan into the chain
:class:`~pipeopt.problem.Problem` and ``replicas`` that the asynchronous methods take.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache

from pipeopt.costs.collectives import all_reduce_time
from pipeopt.errors import ConfigError
from pipeopt.problem import Problem, chain_links


@dataclass(frozen=True)
class Layer:
    """One layer's cost per micro-batch: times (s), its output's bytes (the message to the next
    layer), its weights' bytes (what replicas synchronise) and its activation bytes (memory
    held from forward to backward)."""

    name: str
    forward_s: float
    backward_input_s: float
    backward_weight_s: float
    output_bytes: float
    weight_bytes: float
    activation_bytes: float = 0.0

    @property
    def compute_s(self) -> float:
        """F + B + W of one micro-batch (s)."""
        return self.forward_s + self.backward_input_s + self.backward_weight_s


@dataclass(frozen=True)
class Level:
    """``units`` of the level below (devices at the first level) joined by ``bandwidth``
    (bytes/s between two of them)."""

    units: int
    bandwidth: float


@dataclass(frozen=True)
class Stage:
    """Layers ``first..last`` (inclusive) on ``replicas`` devices; ``split_level``: the level
    whose link joins this stage to the next (0 for the last stage); ``sync_bandwidth``: the
    slowest link among the replicas (bytes/s: the bandwidth of the highest level at which
    the plan replicates it; inf with one replica)."""

    first: int
    last: int
    replicas: int
    split_level: int = 0
    sync_bandwidth: float = math.inf


@dataclass(frozen=True)
class Plan:
    """The planner's answer: ``stages`` in order and its estimated ``period`` (s per
    micro-batch)."""

    stages: tuple[Stage, ...]
    period: float

    @property
    def devices(self) -> int:
        """Devices the plan uses."""
        return sum(s.replicas for s in self.stages)

    def config(self) -> str:
        """PipeDream's notation: replicas per stage joined by dashes (e.g. ``7-1``)."""
        return "-".join(str(s.replicas) for s in self.stages)


def _check(layers: Sequence[Layer], levels: Sequence[Level]) -> None:
    if not layers:
        raise ConfigError("layers: the planner needs at least one layer")
    if not levels:
        raise ConfigError("levels: the planner needs at least one level (devices per node)")
    for k, lv in enumerate(levels):
        if not isinstance(lv.units, int) or lv.units < 1:
            raise ConfigError(f"levels[{k}].units: must be an integer >= 1, got {lv.units!r}")
        if not (lv.bandwidth > 0):
            raise ConfigError(f"levels[{k}].bandwidth: must be > 0 bytes/s, got {lv.bandwidth}")
    for i, lay in enumerate(layers):
        for key in ("forward_s", "backward_input_s", "backward_weight_s", "output_bytes",
                    "weight_bytes", "activation_bytes"):
            x = getattr(lay, key)
            if not (math.isfinite(x) and x >= 0):
                raise ConfigError(f"layers[{i}].{key}: must be a finite number >= 0, got {x}")


def plan(layers: Sequence[Layer], levels: Sequence[Level]) -> Plan:
    """PipeDream's partition and replication of ``layers`` over ``levels`` (first: devices per
    node, last: the top), minimising the estimated period (module docstring)."""
    _check(layers, levels)
    layers = tuple(layers)
    levels = tuple(levels)
    compute = [0.0]
    weights = [0.0]
    for lay in layers:
        compute.append(compute[-1] + lay.compute_s)
        weights.append(weights[-1] + lay.weight_bytes)

    def unit(k: int, i: int, j: int) -> float:
        """Period of layers i..j on one unit of level k (one device at level 0)."""
        if k == 0:
            return compute[j + 1] - compute[i]
        return best(k - 1, i, j, levels[k - 1].units)[0]

    def replicated(k: int, i: int, j: int, r: int) -> float:
        """T_k(i..j, r): layers i..j on r units of level k."""
        sync = 2 * (r - 1) / r * (weights[j + 1] - weights[i]) / levels[k].bandwidth
        return max(unit(k, i, j), sync) / r

    @cache
    def best(k: int, i: int, j: int, m: int) -> tuple[float, tuple[tuple[int, int], ...]]:
        """(A_k(i..j, m), cut choices): the cuts as (last layer of the left part, units on
        the right part), left to right, the first part taking the units left over."""
        value, cuts = replicated(k, i, j, m), ()
        for s in range(i, j):
            comm = layers[s].output_bytes / levels[k].bandwidth
            for right in range(1, m):
                tail = replicated(k, s + 1, j, right)
                if max(comm, tail) >= value:
                    continue
                head, head_cuts = best(k, i, s, m - right)
                v = max(head, comm, tail)
                if v < value:
                    value, cuts = v, (*head_cuts, (s, right))
        return value, cuts

    top = len(levels) - 1
    period = best(top, 0, len(layers) - 1, levels[top].units)[0]
    return Plan(tuple(_stages(best, levels, top, 0, len(layers) - 1, levels[top].units, 1)),
                period)


_Best = Callable[[int, int, int, int], tuple[float, tuple[tuple[int, int], ...]]]


def _stages(best: _Best, levels: tuple[Level, ...], k: int, i: int, j: int, m: int,
            times: int, bandwidth: float = math.inf) -> list[Stage]:
    """The flattened stages of the best pipeline of layers i..j on m units of level k, each
    unit replicated ``times`` over by the levels above, whose slowest link among the copies
    has ``bandwidth`` (bytes/s)."""
    _, cuts = best(k, i, j, m)
    parts = []
    start, left = i, m - sum(r for _, r in cuts)
    for s, right in cuts:
        parts.append((start, s, left))
        start, left = s + 1, right
    parts.append((start, j, left))
    out: list[Stage] = []
    for n, (a, b, r) in enumerate(parts):
        bw = min(bandwidth, levels[k].bandwidth) if r > 1 else bandwidth
        inner = ([Stage(a, b, r * times, sync_bandwidth=bw)] if k == 0 else
                 _stages(best, levels, k - 1, a, b, levels[k - 1].units, r * times, bw))
        if n < len(parts) - 1:  # the cut after this part crosses a link of level k
            inner[-1] = replace(inner[-1], split_level=k + 1)
        out += inner
    return out


def plan_problem(layers: Sequence[Layer], result: Plan, levels: Sequence[Level], *,
                 microbatches: int = 1) -> tuple[Problem, tuple[int, ...]]:
    """The chain problem of a plan (one stage per device in it; per stage the sums of its
    layers' times and activation bytes; messages = the last layer's output; each cut's
    bandwidth is its level's) and the stages' ``replicas``, for the asynchronous methods."""
    st = result.stages
    n = len(st)

    def total(s: Stage, key: str) -> float:
        return math.fsum(getattr(layers[x], key) for x in range(s.first, s.last + 1))

    bw = [levels[s.split_level - 1].bandwidth for s in st[:-1]]
    lat, bwm = chain_links(n, [0.0] * (n - 1), bw)
    prob = Problem(devices=n, microbatches=microbatches,
                   forward=tuple(total(s, "forward_s") for s in st),
                   backward_input=tuple(total(s, "backward_input_s") for s in st),
                   backward_weight=tuple(total(s, "backward_weight_s") for s in st),
                   activation_memory=tuple(total(s, "activation_bytes") for s in st),
                   latency=lat, bandwidth=bwm,
                   message_size=tuple(layers[s.last].output_bytes for s in st[:-1]),
                   meta=(("plan", result.config()),))
    return prob, tuple(s.replicas for s in st)


def plan_sync_s(layers: Sequence[Layer], result: Plan) -> tuple[float, ...]:
    """Per stage of a plan, seconds of one ring all-reduce of its layers' weight bytes among
    its replicas over their slowest link (``2 (r - 1) / r * bytes / bandwidth``, the
    planner's own ``sync``, Patarasuk and Yuan, 2009; 0 with one replica): the ``sync_s`` of
    the periodic model (:func:`pipeopt.workloads.periodic.replica_sync_bound`). One flat ring
    over the slowest link is what a stage replicated across levels costs at most; the planner
    counts each level's part apart."""
    out = []
    for s in result.stages:
        w = math.fsum(layers[x].weight_bytes for x in range(s.first, s.last + 1))
        out.append(0.0 if s.replicas == 1 else
                   all_reduce_time(s.replicas, w, 0.0, s.sync_bandwidth))
    return tuple(out)
