"""Data parallelism as CrossPipe models it: replicas of the training graph and, per stage, its
collectives as communication tasks on the stage's data-parallel ring.

:func:`build` copies :func:`pipeopt.workloads.training.build`'s graph once per replica (replica
``r``'s device ``d`` is device ``r * p + d``, its task ``t`` is task ``r * n + t``) and adds,
per pipeline stage ``s`` (a chunk when ``virtual_stages > 1``):

* with ``reduction="reduce_scatter"`` (ZeRO-1, as CrossPipe schedules it: Chen et al.,
  "CrossPipe: Towards Optimal Pipeline Schedules for Cross-Datacenter Training", 2025): a
  parameter all-gather ``AG s`` that must end before any of the stage's forwards on any replica
  starts, and a gradient reduce-scatter ``RS s`` that starts after the stage's last weight
  gradient (W, or the fused B) on every replica ends;
* with ``reduction="all_reduce"`` (plain data parallelism): a gradient all-reduce ``AR s`` after
  the last W, and no all-gather.

Each collective is a communication task over the replicas of the stage's device: it holds the
directed ring links ``r * p + d -> ((r + 1) % R) * p + d`` (both directions for two replicas)
and, when the ring spans datacenters, the shared network resource ``wan``, so the collectives of
different stages crossing the WAN run one at a time (each at the WAN's full bandwidth, which is
the same total time as sharing it). Its duration is the ring's alpha-beta time
(:mod:`pipeopt.costs.collectives`) on the ring's slowest link. The objective is the makespan:
the iteration time with every collective in it. Hand-made device orders timed by
:func:`pipeopt.core.simulate.simulate` get each collective as early as its inputs and its links
allow (what Megatron does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pipeopt.core.graph import TaskGraph
from pipeopt.costs.collectives import LinkCost, collective_time
from pipeopt.problem import Op, Problem
from pipeopt.workloads import training

Reduction = Literal["reduce_scatter", "all_reduce"]


@dataclass(frozen=True)
class DataParallel:
    """How the pipeline is replicated and its replicas' links (seconds, bytes, bytes/s).

    ``replicas``: R >= 2 copies of the pipeline; ``grad_bytes[s]`` / ``param_bytes[s]``: bytes
    of stage s's gradients / parameters each replica holds (``param_bytes`` defaults to
    ``grad_bytes``); ``latency`` / ``bandwidth``: a hop between two replicas in one datacenter;
    ``datacenter[r]``: replica r's datacenter (default all 0); ``wan_latency`` /
    ``wan_bandwidth``: a hop between datacenters; ``reduction``: ``reduce_scatter`` (ZeRO-1:
    all-gather + reduce-scatter) or ``all_reduce``.
    """

    replicas: int
    grad_bytes: tuple[float, ...]
    latency: float
    bandwidth: float
    param_bytes: tuple[float, ...] = ()
    datacenter: tuple[int, ...] = ()
    wan_latency: float = 0.0
    wan_bandwidth: float = math.inf
    reduction: Reduction = "reduce_scatter"

    def __post_init__(self) -> None:
        r = self.replicas
        if isinstance(r, bool) or not isinstance(r, int) or r < 2:
            raise ValueError(f"replicas: must be an integer >= 2, got {r!r}")
        for name in ("grad_bytes", "param_bytes"):
            vals = tuple(getattr(self, name))
            bad = next((k for k, x in enumerate(vals)
                        if not (isinstance(x, (int, float)) and 0 <= x < math.inf)), None)
            if bad is not None:
                raise ValueError(f"{name}[{bad}]: must be a finite number of bytes >= 0, "
                                 f"got {vals[bad]!r}")
            object.__setattr__(self, name, tuple(map(float, vals)))
        if not self.param_bytes:
            object.__setattr__(self, "param_bytes", self.grad_bytes)
        if len(self.param_bytes) != len(self.grad_bytes):
            raise ValueError(f"param_bytes: expected {len(self.grad_bytes)} values (one per "
                             f"stage, as grad_bytes), got {len(self.param_bytes)}")
        for name in ("latency", "wan_latency"):
            x = getattr(self, name)
            if not (isinstance(x, (int, float)) and 0 <= x < math.inf):
                raise ValueError(f"{name}: must be a finite number of seconds >= 0, got {x!r}")
        for name in ("bandwidth", "wan_bandwidth"):
            x = getattr(self, name)
            if not (isinstance(x, (int, float)) and x > 0):
                raise ValueError(f"{name}: must be > 0 bytes/s, got {x!r}")
        dc = tuple(self.datacenter) or (0,) * r
        if len(dc) != r or not all(isinstance(x, int) and x >= 0 for x in dc):
            raise ValueError(f"datacenter: expected {r} integers >= 0 (one per replica), "
                             f"got {self.datacenter!r}")
        object.__setattr__(self, "datacenter", dc)
        if self.reduction not in ("reduce_scatter", "all_reduce"):
            raise ValueError(f"reduction: must be 'reduce_scatter' or 'all_reduce', got "
                             f"{self.reduction!r}")

    @property
    def crosses_datacenters(self) -> bool:
        """True when the replicas are in more than one datacenter (the rings cross the WAN)."""
        return len(set(self.datacenter)) > 1

    def ring_hops(self) -> list[tuple[int, int]]:
        """The ring's directed replica pairs ``(r, r + 1 mod R)``; both ways for R = 2."""
        r = self.replicas
        return [(0, 1), (1, 0)] if r == 2 else [(a, (a + 1) % r) for a in range(r)]

    def hop_cost(self, a: int, b: int) -> LinkCost:
        """The alpha-beta parameters of a hop from replica a to replica b."""
        if self.datacenter[a] != self.datacenter[b]:
            return LinkCost(self.wan_latency, self.wan_bandwidth)
        return LinkCost(self.latency, self.bandwidth)

    def collective_times(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per stage, (all-gather seconds, reduction seconds); all-gathers are 0 without
        ZeRO-1."""
        hops = [self.hop_cost(a, b) for a, b in self.ring_hops()]
        r = self.replicas
        if self.reduction == "reduce_scatter":
            gather = tuple(collective_time("all_gather", r, x, hops) for x in self.param_bytes)
            reduce = tuple(collective_time("reduce_scatter", r, x, hops)
                           for x in self.grad_bytes)
        else:
            gather = (0.0,) * len(self.grad_bytes)
            reduce = tuple(collective_time("all_reduce", r, x, hops) for x in self.grad_bytes)
        return gather, reduce


def build(problem: Problem, dp: DataParallel) -> TaskGraph:
    """The training graph of ``problem`` replicated ``dp.replicas`` times with each stage's
    collectives (see the module docstring). Raises ValueError when ``problem.grad_reduce`` is
    not 0 (the reduction would count twice) or ``dp`` does not have one entry per stage."""
    s, p, rep = problem.stages, problem.devices, dp.replicas
    if any(problem.grad_reduce):
        raise ValueError("grad_reduce: must be 0 when the gradient reduction is scheduled as "
                         "tasks (workloads.dataparallel); set it to 0 and give grad_bytes")
    if len(dp.grad_bytes) != s:
        raise ValueError(f"grad_bytes: expected {s} values (one per stage), got "
                         f"{len(dp.grad_bytes)}")
    base = training.build(problem)
    n = base.num_tasks
    links = list(zip(base.link_src, base.link_dst, base.latency, base.bandwidth, strict=True))
    cols = [(a + r * p, b + r * p, lat, bw) for r in range(rep) for a, b, lat, bw in links]
    ring: list[list[int]] = [[] for _ in range(p)]  # per device, its ring's link ids
    for d in range(p):
        for a, b in dp.ring_hops():
            cost = dp.hop_cost(a, b)
            ring[d].append(len(cols))
            cols.append((a * p + d, b * p + d, cost.latency, cost.bandwidth))
    networks = ("wan",) if dp.crosses_datacenters else ()
    wan = (len(cols),) if networks else ()
    device = [d + r * p for r in range(rep) for d in base.device]
    label = [f"r{r}.{x}" for r in range(rep) for x in base.label]
    src = [x + r * n for r in range(rep) for x in base.src]
    dst = [x + r * n for r in range(rep) for x in base.dst]
    nbytes = list(base.bytes) * rep
    duration = list(base.duration) * rep
    holds: list[tuple[int, ...]] = [()] * (n * rep)
    gather, reduce = dp.collective_times()
    sd = problem.stage_device
    first, last = problem.kinds[0], problem.kinds[-1]
    m = problem.microbatches

    def comm(name: str, k: int, seconds: float) -> int:
        device.append(-1)
        label.append(f"{name} {k}")
        duration.append(seconds)
        holds.append((*ring[sd[k]], *wan))
        return len(device) - 1

    for k in range(s):
        if dp.reduction == "reduce_scatter":
            ag = comm("AG", k, gather[k])
            f0 = training.task_id(problem, Op(first, k, 0))
            for r in range(rep):
                for j in range(m):
                    src.append(ag)
                    dst.append(r * n + f0 + j)
                    nbytes.append(0.0)
        red = comm("RS" if dp.reduction == "reduce_scatter" else "AR", k, reduce[k])
        w0 = training.task_id(problem, Op(last, k, 0))
        for r in range(rep):
            for j in range(m):
                src.append(r * n + w0 + j)
                dst.append(red)
                nbytes.append(0.0)
    ls, ld, lat, bw = zip(*cols, strict=True) if cols else ((),) * 4
    return TaskGraph(
        memory_limit=tuple(base.memory_limit) * rep, static_memory=base.static_memory * rep,
        link_src=ls, link_dst=ld, latency=lat, bandwidth=bw, device=tuple(device),
        duration=tuple(duration), mem_start=base.mem_start * rep + (0.0,) * (len(device) - n * rep),
        mem_end=base.mem_end * rep + (0.0,) * (len(device) - n * rep), label=tuple(label),
        src=tuple(src), dst=tuple(dst), bytes=tuple(nbytes), networks=networks,
        holds=tuple(holds), meta=(("workload", "dataparallel"), ("replicas", rep)))


def task_orders(problem: Problem, dp: DataParallel,
                orders: Sequence[Sequence[Op]]) -> list[list[int]]:
    """A chain schedule's per-device op orders, the same on every replica, as the device orders
    of :func:`build`'s graph (its collectives are in no order: they run as early as allowed)."""
    one = training.task_orders(problem, orders)
    n = len(problem.kinds) * problem.stages * problem.microbatches
    return [[t + r * n for t in order] for r in range(dp.replicas) for order in one]
