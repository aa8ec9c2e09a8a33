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
from itertools import pairwise
from typing import Any, Literal

from pipeopt.core.graph import TaskGraph
from pipeopt.core.schedule import GraphSchedule
from pipeopt.costs.collectives import ALGORITHMS, LinkCost, collective_time
from pipeopt.problem import Op, Problem
from pipeopt.workloads import training

Reduction = Literal["reduce_scatter", "all_reduce"]

#: Most consecutive iterations one graph holds (a steady state shows after 2-3).
MAX_ITERATIONS = 16


@dataclass(frozen=True)
class DataParallel:
    """How the pipeline is replicated and its replicas' links (seconds, bytes, bytes/s).

    ``replicas``: R >= 2 copies of the pipeline; ``grad_bytes[s]`` / ``param_bytes[s]``: bytes
    of stage s's gradients / parameters each replica holds (``param_bytes`` defaults to
    ``grad_bytes``); ``latency`` / ``bandwidth``: a hop between two replicas in one datacenter;
    ``datacenter[r]``: replica r's datacenter (default all 0); ``wan_latency`` /
    ``wan_bandwidth``: a hop between datacenters; ``reduction``: ``reduce_scatter`` (ZeRO-1:
    all-gather + reduce-scatter) or ``all_reduce``.

    Buckets (PyTorch DDP's gradient buckets, ``bucket_cap_mb`` = 25 MB by default: Li et al.,
    "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020,
    section 3.2.3): ``bucket_bytes[s]`` splits stage s's gradient bytes into buckets in
    backward order (the last layers' gradients first; they sum to ``grad_bytes[s]``), and
    ``bucket_share[s][b]`` is the fraction of the stage's last weight-gradient task (its last
    micro-batch's W, or fused B) that computes bucket b's layers. Default: one bucket.

    ``delayed``: one-step delayed reduction (Pipe-SGD, Li et al., NeurIPS 2018; DaSGD, Zhou et
    al., 2020): iteration i + 1 does not wait for iteration i's reduction; see :func:`build`.
    ``iterations``: consecutive iterations built into one graph (a steady state needs >= 2).
    ``ring_cost[d]`` / ``ring_wan[d]`` (optional, one per pipeline device, both or neither):
    device d's ring bottleneck (every hop at it) and whether that ring crosses the WAN; they
    replace the per-hop costs above (the model form derives them from the cluster).
    ``buffer_memory[s]``: with ``delayed``, the memory (in the problem's memory unit) of
    stage s's second gradient buffer and, with ZeRO-1, second parameter copy, added to its
    device's static memory (default 0: not counted).
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
    bucket_bytes: tuple[tuple[float, ...], ...] = ()
    bucket_share: tuple[tuple[float, ...], ...] = ()
    delayed: bool = False
    iterations: int = 1
    ring_cost: tuple[LinkCost, ...] = ()
    ring_wan: tuple[bool, ...] = ()
    buffer_memory: tuple[float, ...] = ()
    algorithm: str = "ring"

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
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm: must be one of {', '.join(ALGORITHMS)}, got "
                             f"{self.algorithm!r}")
        if self.algorithm == "tree" and self.reduction != "all_reduce":
            raise ValueError("algorithm: tree is modelled for the all-reduce only (set "
                             "reduction: all_reduce; ZeRO-1's reduce-scatter runs on a ring)")
        self._check_buckets()
        k = self.iterations
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_ITERATIONS:
            raise ValueError(f"iterations: must be an integer in 1..{MAX_ITERATIONS}, got {k!r}")
        if not isinstance(self.delayed, bool):
            raise ValueError(f"delayed: must be true or false, got {self.delayed!r}")
        costs, wan = tuple(self.ring_cost), tuple(self.ring_wan)
        if len(costs) != len(wan):
            raise ValueError(f"ring_wan: expected {len(costs)} values (one per ring_cost), got "
                             f"{len(wan)}")
        for d, c in enumerate(costs):
            if not (isinstance(c, LinkCost) and 0 <= c.latency < math.inf and c.bandwidth > 0):
                raise ValueError(f"ring_cost[{d}]: must be a LinkCost with latency >= 0 s and "
                                 f"bandwidth > 0 bytes/s, got {c!r}")
        object.__setattr__(self, "ring_cost", costs)
        object.__setattr__(self, "ring_wan", tuple(map(bool, wan)))
        buf = tuple(self.buffer_memory) or (0.0,) * len(self.grad_bytes)
        if len(buf) != len(self.grad_bytes):
            raise ValueError(f"buffer_memory: expected {len(self.grad_bytes)} values (one per "
                             f"stage), got {len(buf)}")
        bad = next((k for k, x in enumerate(buf)
                    if not (isinstance(x, (int, float)) and 0 <= x < math.inf)), None)
        if bad is not None:
            raise ValueError(f"buffer_memory[{bad}]: must be a finite number >= 0, got "
                             f"{buf[bad]!r}")
        object.__setattr__(self, "buffer_memory", tuple(map(float, buf)))

    def _check_buckets(self) -> None:
        s = len(self.grad_bytes)
        sizes = tuple(tuple(map(float, x)) for x in self.bucket_bytes) or tuple(
            (g,) for g in self.grad_bytes)
        shares = tuple(tuple(map(float, x)) for x in self.bucket_share) or tuple(
            (1.0 / len(x),) * len(x) for x in sizes)
        for name, vals in (("bucket_bytes", sizes), ("bucket_share", shares)):
            if len(vals) != s:
                raise ValueError(f"{name}: expected {s} rows (one per stage), got {len(vals)}")
        for k in range(s):
            if not sizes[k] or len(shares[k]) != len(sizes[k]):
                raise ValueError(f"bucket_share[{k}]: expected {len(sizes[k])} values (one per "
                                 f"bucket of bucket_bytes[{k}]), got {len(shares[k])}")
            bad = next((b for b, x in enumerate(sizes[k]) if not 0 <= x < math.inf), None)
            if bad is not None:
                raise ValueError(f"bucket_bytes[{k}][{bad}]: must be a finite number of bytes "
                                 f">= 0, got {sizes[k][bad]}")
            if not math.isclose(sum(sizes[k]), self.grad_bytes[k], rel_tol=1e-9, abs_tol=1e-6):
                raise ValueError(f"bucket_bytes[{k}]: must sum to grad_bytes[{k}] = "
                                 f"{self.grad_bytes[k]:g}, got {sum(sizes[k]):g}")
            bad = next((b for b, x in enumerate(shares[k]) if not 0 <= x <= 1), None)
            if bad is not None or not math.isclose(sum(shares[k]), 1.0, rel_tol=1e-9):
                raise ValueError(f"bucket_share[{k}]: fractions in [0, 1] summing to 1, got "
                                 f"{list(shares[k])}")
        object.__setattr__(self, "bucket_bytes", sizes)
        object.__setattr__(self, "bucket_share", shares)

    @property
    def crosses_datacenters(self) -> bool:
        """True when some ring crosses the WAN (replicas in more than one datacenter)."""
        if self.ring_cost:
            return any(self.ring_wan)
        return len(set(self.datacenter)) > 1

    def ring_crosses(self, device: int) -> bool:
        """Whether pipeline device ``device``'s ring crosses the WAN."""
        if self.ring_cost:
            return self.ring_wan[device]
        return self.crosses_datacenters

    def ring_hop_costs(self, device: int) -> list[LinkCost]:
        """The alpha-beta parameters of each hop of ``device``'s ring (:meth:`ring_hops`)."""
        if self.ring_cost:
            return [self.ring_cost[device]] * len(self.ring_hops())
        return [self.hop_cost(a, b) for a, b in self.ring_hops()]

    def stage_times(self, stage_device: Sequence[int]
                    ) -> tuple[tuple[float, ...], tuple[tuple[float, ...], ...]]:
        """Per stage (on device ``stage_device[s]``), the all-gather seconds (0 without
        ZeRO-1) and each bucket's reduction seconds: every bucket pays the ring's latency
        terms, so more buckets cost more in all."""
        r = self.replicas
        kind = "reduce_scatter" if self.reduction == "reduce_scatter" else "all_reduce"
        gather, reduce = [], []
        for k, d in enumerate(stage_device):
            hops = self.ring_hop_costs(d)
            gather.append(collective_time("all_gather", r, self.param_bytes[k], hops)
                          if kind == "reduce_scatter" else 0.0)
            reduce.append(tuple(collective_time(kind, r, x, hops, self.algorithm)
                                for x in self.bucket_bytes[k]))
        return tuple(gather), tuple(reduce)

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
        """Per stage, (all-gather seconds, reduction seconds, one bucket) over the per-hop
        costs (not ``ring_cost``: :meth:`stage_times` has each device's ring and the
        buckets); all-gathers are 0 without ZeRO-1."""
        hops = [self.hop_cost(a, b) for a, b in self.ring_hops()]
        r = self.replicas
        if self.reduction == "reduce_scatter":
            gather = tuple(collective_time("all_gather", r, x, hops) for x in self.param_bytes)
            reduce = tuple(collective_time("reduce_scatter", r, x, hops)
                           for x in self.grad_bytes)
        else:
            gather = (0.0,) * len(self.grad_bytes)
            reduce = tuple(collective_time("all_reduce", r, x, hops, self.algorithm)
                           for x in self.grad_bytes)
        return gather, reduce



def _split_last_backward(problem: Problem, dp: DataParallel, base: TaskGraph
                         ) -> tuple[dict[str, list[Any]], list[list[int]]]:
    """One replica's task and edge columns, with each bucketed stage's last weight-gradient
    task (its last micro-batch's W, or fused B) cut into one piece per bucket, and per stage
    the task that ends each bucket's gradients (backward order; the last is the op's own
    task, which keeps its successors and the memory it frees; the first piece takes its
    inputs and the memory it allocates)."""
    cols: dict[str, list[Any]] = {
        "device": list(base.device), "duration": list(base.duration),
        "mem_start": list(base.mem_start), "mem_end": list(base.mem_end),
        "label": list(base.label), "src": list(base.src), "dst": list(base.dst),
        "bytes": list(base.bytes)}
    last, m = problem.kinds[-1], problem.microbatches
    pieces: list[list[int]] = []
    first_piece: dict[int, int] = {}
    for k in range(problem.stages):
        t = training.task_id(problem, Op(last, k, m - 1))
        shares = dp.bucket_share[k]
        if len(shares) == 1:
            pieces.append([t])
            continue
        total, ids = cols["duration"][t], []
        for b, share in enumerate(shares[:-1]):
            ids.append(len(cols["device"]))
            for name, val in (("device", cols["device"][t]), ("duration", total * share),
                              ("mem_start", 0.0), ("mem_end", 0.0),
                              ("label", f"{cols['label'][t]}/b{b}")):
                cols[name].append(val)
        cols["mem_start"][ids[0]], cols["mem_start"][t] = cols["mem_start"][t], 0.0
        cols["duration"][t] = total * shares[-1]
        cols["label"][t] = f"{cols['label'][t]}/b{len(shares) - 1}"
        first_piece[t] = ids[0]
        ids.append(t)
        for a, b in pairwise(ids):
            cols["src"].append(a)
            cols["dst"].append(b)
            cols["bytes"].append(0.0)
        pieces.append(ids)
    if first_piece:
        n_edges = len(base.src)
        cols["dst"][:n_edges] = [first_piece.get(x, x) for x in cols["dst"][:n_edges]]
    return cols, pieces


def build(problem: Problem, dp: DataParallel) -> TaskGraph:
    """The training graph of ``problem`` replicated ``dp.replicas`` times with each stage's
    collectives (see the module docstring), for ``dp.iterations`` consecutive iterations.

    Task ids: iteration ``j``'s block starts at ``j * N`` (N = ``meta["iteration_tasks"]``);
    in it, replica ``r``'s copy of one replica's tasks (``n`` of them: the training graph's,
    then the bucket pieces) starts at ``r * n``, then come the iteration's collectives, per
    stage its all-gather (ZeRO-1) and its reduction buckets in order. Labels get ``i<j>.``
    in front when there is more than one iteration, and ``.b<b>`` for a bucket.

    Dependencies between iterations, per stage k (the optimizer step of a stage's shard is
    part of its reduction, as CrossPipe models it; nothing waits for other stages):

    * the buckets of one reduction run in order, and iteration j's reduction before
      iteration j + 1's (one communicator issues them in order);
    * without delay, iteration j + 1 uses the weights iteration j's reduction updates: its
      all-gather (ZeRO-1) or, with all-reduce, every forward of stage k waits for it;
    * with ``dp.delayed``, that edge skips one iteration: iteration j's reduction feeds
      iteration j + 2's all-gather / forwards, so iteration j + 1's forwards (and its
      backward) may start before iteration j's reduction ends, and the update applies one
      step late. The schedule then needs a second gradient buffer (iteration j + 1's weight
      gradients accumulate while iteration j's are reduced) and, with ZeRO-1, a second copy
      of the stage's parameters (gathered for iteration j + 2 while j + 1 runs): their
      ``dp.buffer_memory`` is added to the device's static memory.

    Raises ValueError when ``problem.grad_reduce`` is not 0 (the reduction would count
    twice) or ``dp`` does not have one entry per stage."""
    s, p, rep, m = problem.stages, problem.devices, dp.replicas, problem.microbatches
    if any(problem.grad_reduce):
        raise ValueError("grad_reduce: must be 0 when the gradient reduction is scheduled as "
                         "tasks (workloads.dataparallel); set it to 0 and give grad_bytes")
    if len(dp.grad_bytes) != s:
        raise ValueError(f"grad_bytes: expected {s} values (one per stage), got "
                         f"{len(dp.grad_bytes)}")
    base = training.build(problem)
    one, pieces = _split_last_backward(problem, dp, base)
    n = len(one["device"])
    links = list(zip(base.link_src, base.link_dst, base.latency, base.bandwidth, strict=True))
    cols = [(a + r * p, b + r * p, lat, bw) for r in range(rep) for a, b, lat, bw in links]
    ring: list[list[int]] = [[] for _ in range(p)]  # per device, its ring's link ids
    for d in range(p):
        for (a, b), cost in zip(dp.ring_hops(), dp.ring_hop_costs(d), strict=True):
            ring[d].append(len(cols))
            cols.append((a * p + d, b * p + d, cost.latency, cost.bandwidth))
    networks = ("wan",) if dp.crosses_datacenters else ()
    wan_id = len(cols)
    gather, reduce = dp.stage_times(problem.stage_device)
    sd = problem.stage_device
    first = problem.kinds[0]
    digits = str.maketrans("", "", "0123456789")
    groups = [x.split("/")[0].translate(digits).strip(" ._-:/#") for x in one["label"]]
    rs = "RS" if dp.reduction == "reduce_scatter" else "AR"
    iters, delay = dp.iterations, 1 + int(dp.delayed)
    device: list[int] = []
    duration: list[float] = []
    mem_start: list[float] = []
    mem_end: list[float] = []
    label: list[str] = []
    group: list[str] = []
    holds: list[tuple[int, ...]] = []
    src: list[int] = []
    dst: list[int] = []
    nbytes: list[float] = []
    ag_id: list[list[int]] = []   # [iteration][stage]
    red_id: list[list[list[int]]] = []  # [iteration][stage][bucket]

    def edge(a: int, b: int) -> None:
        src.append(a)
        dst.append(b)
        nbytes.append(0.0)

    for j in range(iters):
        pre = f"i{j}." if iters > 1 else ""
        top = len(device)
        for r in range(rep):
            off = top + r * n
            device.extend(d + r * p for d in one["device"])
            duration.extend(one["duration"])
            mem_start.extend(one["mem_start"])
            mem_end.extend(one["mem_end"])
            label.extend(f"{pre}r{r}.{x}" for x in one["label"])
            group.extend(groups)
            holds.extend([()] * n)
            src.extend(x + off for x in one["src"])
            dst.extend(x + off for x in one["dst"])
            nbytes.extend(one["bytes"])

        def comm(name: str, k: int, seconds: float, kind: str, pre: str = pre) -> int:
            device.append(-1)
            duration.append(seconds)
            mem_start.append(0.0)
            mem_end.append(0.0)
            label.append(f"{pre}{name}")
            group.append(kind)
            holds.append((*ring[sd[k]], *((wan_id,) if dp.ring_crosses(sd[k]) else ())))
            return len(device) - 1

        ag_id.append([])
        red_id.append([])
        for k in range(s):
            if dp.reduction == "reduce_scatter":
                ag = comm(f"AG {k}", k, gather[k], "AG")
                ag_id[j].append(ag)
                f0 = training.task_id(problem, Op(first, k, 0))
                for r in range(rep):
                    for i in range(m):
                        edge(ag, top + r * n + f0 + i)
            nb = len(reduce[k])
            ids = [comm(f"{rs} {k}" + (f".b{b}" if nb > 1 else ""), k, reduce[k][b], rs)
                   for b in range(nb)]
            red_id[j].append(ids)
            w0 = training.task_id(problem, Op(problem.kinds[-1], k, 0))
            for r in range(rep):
                off = top + r * n
                for i in range(m - 1):
                    edge(off + w0 + i, ids[0])
                for b in range(nb):
                    edge(off + pieces[k][b], ids[b])
            for a, b in pairwise(ids):
                edge(a, b)
    block = len(device) // iters
    for j in range(iters):
        for k in range(s):
            if j + 1 < iters:  # reductions in iteration order
                edge(red_id[j][k][-1], red_id[j + 1][k][0])
            if j + delay >= iters:
                continue
            if dp.reduction == "reduce_scatter":
                edge(red_id[j][k][-1], ag_id[j + delay][k])
            else:
                f0 = training.task_id(problem, Op(first, k, 0))
                for r in range(rep):
                    for i in range(m):
                        edge(red_id[j][k][-1], (j + delay) * block + r * n + f0 + i)
    ls, ld, lat, bw = zip(*cols, strict=True) if cols else ((),) * 4
    static = list(base.static_memory)
    if dp.delayed:
        for k, x in enumerate(dp.buffer_memory):
            static[sd[k]] += x
    return TaskGraph(
        memory_limit=tuple(base.memory_limit) * rep, static_memory=tuple(static) * rep,
        link_src=ls, link_dst=ld, latency=lat, bandwidth=bw, device=tuple(device),
        duration=tuple(duration), mem_start=tuple(mem_start), mem_end=tuple(mem_end),
        label=tuple(label), src=tuple(src), dst=tuple(dst), bytes=tuple(nbytes),
        networks=networks, holds=tuple(holds),
        meta=(("workload", "dataparallel"), ("replicas", rep), ("iterations", iters),
              ("iteration_tasks", block), ("delayed_reduction", dp.delayed),
              ("task_group", tuple(group))))


def task_orders(problem: Problem, dp: DataParallel, orders: Sequence[Sequence[Op]], *,
                pipelined: bool = False) -> list[list[int]]:
    """A chain schedule's per-device op orders, the same on every replica, as the device orders
    of :func:`build`'s graph; a bucketed last W (or fused B) becomes its pieces in backward
    order. Collectives are in no order: they run as early as allowed (Megatron).

    ``pipelined`` False: ``orders`` is one iteration's schedule of ``problem``, repeated for
    each iteration (a device ends one iteration's ops before the next one's: a flush).
    ``pipelined`` True: ``orders`` schedules ``problem`` with ``iterations * m`` micro-batches,
    micro-batch ``i`` being iteration ``i // m``'s micro-batch ``i % m`` (no flush between
    iterations; with a synchronous reduction such orders deadlock when a forward of iteration
    j + 1 comes before a W of iteration j on its device)."""
    m = problem.microbatches
    base = training.build(problem)
    _, pieces = _split_last_backward(problem, dp, base)
    cut = {ids[-1]: ids for ids in pieces if len(ids) > 1}
    n = base.num_tasks + sum(len(ids) - 1 for ids in pieces)
    gathers = problem.stages if dp.reduction == "reduce_scatter" else 0
    block = dp.replicas * n + gathers + sum(len(b) for b in dp.bucket_bytes)
    if pipelined:
        iters = dp.iterations
        bad = next((o for order in orders for o in order
                    if not 0 <= o.microbatch < iters * m), None)
        if bad is not None:
            raise ValueError(f"orders: micro-batch {bad.microbatch} of {bad} is not in "
                             f"0..{iters * m - 1} ({iters} iterations x {m})")
        one = []
        for order in orders:
            row = []
            for o in order:
                t = training.task_id(problem, Op(o.kind, o.stage, o.microbatch % m))
                row += [(o.microbatch // m) * block + x for x in cut.get(t, (t,))]
            one.append(row)
        return [[r * n + t for t in order] for r in range(dp.replicas) for order in one]
    flat = training.task_orders(problem, orders)
    one = [[x for t in order for x in cut.get(t, (t,))] for order in flat]
    return [[j * block + r * n + t for j in range(dp.iterations) for t in order]
            for r in range(dp.replicas) for order in one]


def iteration_ends(schedule: GraphSchedule) -> tuple[float, ...]:
    """Per iteration of a :func:`build` graph (``meta["iterations"]``, 1 for other graphs),
    the end of its last task, collectives included (seconds)."""
    g = schedule.graph
    meta = dict(g.meta)
    iters = meta.get("iterations", 1)
    block = meta.get("iteration_tasks", g.num_tasks)
    if not (isinstance(iters, int) and isinstance(block, int) and iters * block == g.num_tasks):
        return (schedule.makespan,)
    return tuple(max(schedule.end[j * block:(j + 1) * block], default=0.0)
                 for j in range(iters))


def iterations_of(graph: TaskGraph) -> int:
    """``meta["iterations"]`` of a :func:`build` graph (consecutive iterations), else 1."""
    k = dict(graph.meta).get("iterations", 1)
    return k if isinstance(k, int) and not isinstance(k, bool) and k >= 1 else 1


def iteration_time(schedule: GraphSchedule) -> float:
    """Seconds per iteration of a schedule of ``K`` consecutive iterations: its makespan / K
    (fill and drain paid once over the K iterations; as K grows it tends to the steady-state
    period, which :func:`periodic_bound` bounds from below). A proven lower bound on it is
    the graph's lower bound / K. The iteration ends (:func:`iteration_ends`) are not used:
    a finite run's first and last iterations differ from the steady state (the first
    delayed all-gather waits for no reduction; the last iteration has nothing after it)."""
    return schedule.makespan / iterations_of(schedule.graph)


def periodic_bound(graph: TaskGraph) -> float:
    """A lower bound on the period of any periodic schedule of :func:`build`'s iterations: in
    each period every device and every network resource does one iteration's work, so the
    period is at least the busiest one's load per iteration (seconds: task durations, plus
    message transmissions on links)."""
    iters = iterations_of(graph)
    device = [0.0] * graph.devices
    resource = [0.0] * graph.num_resources
    for d, x, held in zip(graph.device, graph.duration, graph.holds or [()] * graph.num_tasks,
                          strict=True):
        if d >= 0:
            device[d] += x
        for h in held:
            resource[h] += x
    for k, tx in zip(graph.edge_link, graph.edge_transmission, strict=True):
        if k >= 0:
            resource[k] += tx
    return max(device + resource, default=0.0) / iters
