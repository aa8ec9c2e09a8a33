"""Configs whose problem is a task graph beyond the pipeline chain (docs/collectives.md,
docs/moe.md), and :func:`graph_loader`, which maps a parsed config to its loader.

:func:`pipeopt.workload_config.workload_kind` tells the kind of a parsed config (the one test);
:func:`graph_loader` maps the task-graph kinds to their loaders and gives None for the others
(a chain config, synchronous or ``pipeline.mode: async``, or an inference config, which keep
their own routes):

* data parallelism with scheduled collectives, model form: ``training.collectives:
  scheduled`` beside ``training.data_parallel: R`` (the cluster places the R replicas;
  gradient bytes per stage from the partition's parameters); explicit form: a top-level
  ``data_parallel:`` section next to ``stages:`` -> :func:`load_dataparallel`, a
  :class:`DataParallelRun`;
* MoE blocks with scheduled all-to-all: ``workload: {kind: moe}`` -> :func:`load_moe_graph`,
  a :class:`~pipeopt.moe_config.MoERun` (with its own search, ``search``).

Either gives a :class:`GraphConfig`: the workload (an object of the
:class:`~pipeopt.solvers.graph.GraphWorkload` shape), the solver options and what to print.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeopt.config import parse_config
from pipeopt.core.graph import TaskGraph
from pipeopt.core.schedule import GraphSchedule
from pipeopt.costs.collectives import LinkCost
from pipeopt.errors import ConfigError
from pipeopt.moe_config import MoERun, parse_moe
from pipeopt.problem import Problem
from pipeopt.schedules import NotApplicable, generate
from pipeopt.schema import SolverConfig, validate_mapping
from pipeopt.solvers.graph import GraphWorkload
from pipeopt.workload_config import workload_kind
from pipeopt.workloads import dataparallel as dpw

#: PyTorch DDP's default gradient bucket, ``bucket_cap_mb=25`` (torch.nn.parallel.
#: DistributedDataParallel; Li et al., VLDB 2020, section 3.2.3), in bytes.
DDP_BUCKET_BYTES = 25 * 1024 * 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class TrainingCollectives(_Strict):
    """The model form's keys under ``training:`` for scheduled collectives."""

    collectives: Literal["scheduled", "scalar"] = "scalar"
    reduction: Literal["reduce_scatter", "all_reduce"] = "reduce_scatter"
    collective_algorithm: Literal["ring", "tree"] = "ring"
    delayed_reduction: bool = False
    bucket_bytes: float | None = Field(None, gt=0, description="bytes; None: one per stage")
    iterations: int = Field(3, ge=1, le=dpw.MAX_ITERATIONS)


class WanSpec(_Strict):
    """The link between datacenters: latency (s), bandwidth (bytes/s)."""

    latency: float = Field(0.0, ge=0)
    bandwidth: float = Field(gt=0)


class DataParallelSection(_Strict):
    """The explicit form's ``data_parallel:`` section (bytes, seconds, bytes/s)."""

    replicas: int = Field(ge=2, le=1024)
    grad_bytes: float | list[float]
    param_bytes: float | list[float] | None = None
    latency: float = Field(0.0, ge=0)
    bandwidth: float = Field(gt=0, allow_inf_nan=True)
    datacenters: list[int] | None = None
    wan: WanSpec | None = None
    reduction: Literal["reduce_scatter", "all_reduce"] = "reduce_scatter"
    algorithm: Literal["ring", "tree"] = "ring"
    delayed_reduction: bool = False
    buckets: int = Field(1, ge=1, le=1024, description="equal buckets per stage")
    iterations: int = Field(3, ge=1, le=dpw.MAX_ITERATIONS)
    buffer_memory: float | list[float] = Field(
        0.0, description="memory units per stage of the delayed reduction's second buffers")


@dataclass(frozen=True)
class DataParallelRun:
    """Data parallelism with scheduled collectives as a graph workload: ``graph`` (what the
    searches run on) is :func:`pipeopt.workloads.dataparallel.build` of ``problem``; the
    hand-made schedules are 1F1B (fused backward) and, with a split backward, ZB-H1, each with
    its collectives as early as allowed."""

    problem: Problem
    dp: dpw.DataParallel
    graph: TaskGraph

    #: No search of its own: the core greedy / cpsat / auto search it.
    searches: ClassVar[tuple[str, ...]] = ()

    def search(self, name: str, *, time_limit: float, seed: int = 0,
               workers: int | None = None) -> GraphSchedule:
        """No own search: always NotApplicable (see :attr:`searches`)."""
        raise NotApplicable(f"{name}: not a search of this workload (it has none of its own)")

    @property
    def hand_made(self) -> tuple[str, ...]:
        """1F1B, and ZB-H1 when the backward is split; with the delayed reduction and more
        than one iteration also ``NAME:pipelined`` (the iterations as one run of
        iterations x m micro-batches, no flush between them)."""
        names = ("1f1b", "zb-h1") if self.problem.split_backward else ("1f1b",)
        if self.dp.delayed and self.dp.iterations > 1:
            names += tuple(f"{x}:pipelined" for x in names)
        return names

    def hand_made_orders(self, name: str) -> tuple[TaskGraph, list[list[int]]]:
        """The graph and device orders of hand-made schedule ``name`` (1F1B runs the fused
        backward: its own graph)."""
        if name not in self.hand_made:
            raise NotApplicable(f"{name}: not a hand-made schedule of this workload "
                                f"({', '.join(self.hand_made)})")
        family, _, how = name.partition(":")
        prob = self.problem.replace(split_backward=False) if family == "1f1b" else self.problem
        graph = self.graph if prob is self.problem else dpw.build(prob, self.dp)
        if how == "pipelined":
            long = prob.replace(microbatches=prob.microbatches * self.dp.iterations)
            return graph, dpw.task_orders(prob, self.dp, generate(family, long),
                                          pipelined=True)
        return graph, dpw.task_orders(prob, self.dp, generate(family, prob))


def make_run(problem: Problem, dp: dpw.DataParallel) -> DataParallelRun:
    """A :class:`DataParallelRun` with its graph built."""
    return DataParallelRun(problem, dp, dpw.build(problem, dp))


@dataclass(frozen=True)
class GraphConfig:
    """A loaded task-graph config: the workload (any object of the
    :class:`~pipeopt.solvers.graph.GraphWorkload` shape), the solver options, facts to print
    (key, text), ``method_key``: the key that names the method in the file (for messages),
    and ``baselines``: the methods ``pipeopt solve`` also runs and prints beside the chosen
    one (the MoE config's 1F1B / ZB-H1, without and with overlap)."""

    work: GraphWorkload
    solver: SolverConfig
    source: str = "<memory>"
    facts: tuple[tuple[str, str], ...] = ()
    method_key: str = "solver.method"
    baselines: tuple[str, ...] = ()


Loader = Callable[[dict[str, Any], str, "dict[str, Any] | None"], GraphConfig]


def graph_loader(data: Any) -> Loader | None:
    """The loader of the task-graph workload that the parsed config ``data`` describes, or
    None when it is not one (see the module docstring; a bad ``workload:`` section raises
    ConfigError naming the key)."""
    kind = workload_kind(data)
    if kind == "dataparallel":
        return load_dataparallel
    if kind == "moe":
        return load_moe_graph
    return None


def load_graph_config(data: dict[str, Any], source: str = "<memory>",
                      overrides: dict[str, Any] | None = None) -> GraphConfig:
    """Load a task-graph config (a ConfigError naming the key when it is not one)."""
    loader = graph_loader(data)
    if loader is None:
        raise ConfigError(f"{source}: not a task-graph config (give training.collectives: "
                          "scheduled, a data_parallel: section or workload: {kind: moe})")
    return loader(data, source, overrides)


def load_moe_graph(data: dict[str, Any], source: str = "<memory>",
             overrides: dict[str, Any] | None = None) -> GraphConfig:
    """Read an MoE config (:func:`pipeopt.moe_config.parse_moe`). ``overrides`` (``method``,
    ``time_limit``, ``seed``; None: keep) replace ``workload:`` keys; an overriding method is
    checked by the caller, under its own name (the command's ``--method``)."""
    cfg = parse_moe(data, source)
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = sorted(set(given) - {"method", "time_limit", "seed"})
    if unknown:
        raise ConfigError(f"{unknown[0]}: not an option of an MoE config (method, time_limit, "
                          "seed)")
    solver = SolverConfig(method=given.get("method", cfg.method),
                          time_limit=given.get("time_limit", cfg.time_limit),
                          seed=given.get("seed", cfg.seed), workers=cfg.workers)
    return GraphConfig(MoERun(cfg.pipeline), solver, source, cfg.facts,
                       method_key="workload.method", baselines=cfg.baselines)


def _per_stage(key: str, value: float | Sequence[float] | None, stages: int,
               default: tuple[float, ...] = ()) -> tuple[float, ...]:
    if value is None:
        return default
    vals = [value] * stages if isinstance(value, int | float) else list(value)
    if len(vals) != stages:
        raise ConfigError(f"{key}: expected {stages} values (one per stage), got {len(vals)}")
    for i, x in enumerate(vals):
        if isinstance(x, bool) or not isinstance(x, int | float) or not 0 <= x < math.inf:
            raise ConfigError(f"{key}[{i}]: must be a finite number of bytes >= 0, got {x!r}")
    return tuple(map(float, vals))


def _check_problem(problem: Problem, where: str) -> Problem:
    if problem.virtual_stages > 1:
        raise ConfigError(f"{where}: scheduled collectives need one stage per device "
                          f"(pipeline.virtual_stages: 1), got {problem.virtual_stages}")
    return problem.replace(grad_reduce=(0.0,) * problem.stages)


def load_dataparallel(data: dict[str, Any], source: str = "<memory>",
                      overrides: dict[str, Any] | None = None) -> GraphConfig:
    """Read a data-parallel config with scheduled collectives (either form; see the module
    docstring). ``overrides`` replace ``solver:`` keys."""
    if "data_parallel" in data:
        return _explicit(data, source, overrides)
    return _model_form(data, source, overrides)


def _explicit(data: dict[str, Any], source: str, overrides: dict[str, Any] | None
              ) -> GraphConfig:
    if "model" in data or "cluster" in data:
        raise ConfigError("data_parallel: the explicit form's section; with model:/cluster: "
                          "give training.data_parallel and training.collectives: scheduled")
    sec = validate_mapping(DataParallelSection, data["data_parallel"], "data_parallel")
    cfg = parse_config({k: v for k, v in data.items() if k != "data_parallel"}, source,
                       overrides)
    if any(cfg.problem.grad_reduce):
        raise ConfigError("stages.grad_reduce: must be 0 (or left out) with data_parallel: "
                          "(the reduction is scheduled as tasks from grad_bytes)")
    prob = _check_problem(cfg.problem, "data_parallel")
    s = prob.stages
    grads = _per_stage("data_parallel.grad_bytes", sec.grad_bytes, s)
    params = _per_stage("data_parallel.param_bytes", sec.param_bytes, s)
    dcs = tuple(sec.datacenters) if sec.datacenters is not None else ()
    if dcs and len(dcs) != sec.replicas:
        raise ConfigError(f"data_parallel.datacenters: expected {sec.replicas} values (one per "
                          f"replica), got {len(dcs)}")
    if dcs and min(dcs) < 0:
        raise ConfigError(f"data_parallel.datacenters: datacenter numbers are >= 0, got "
                          f"{list(dcs)}")
    if len(set(dcs)) > 1 and sec.wan is None:
        raise ConfigError("data_parallel.wan: missing (the replicas are in more than one "
                          "datacenter: give wan: {latency, bandwidth})")
    n = sec.buckets
    try:
        dp = dpw.DataParallel(
            replicas=sec.replicas, grad_bytes=grads, param_bytes=params, latency=sec.latency,
            bandwidth=sec.bandwidth, datacenter=dcs,
            wan_latency=sec.wan.latency if sec.wan else 0.0,
            wan_bandwidth=sec.wan.bandwidth if sec.wan else math.inf,
            reduction=sec.reduction, delayed=sec.delayed_reduction,
            iterations=sec.iterations, algorithm=sec.algorithm,
            bucket_bytes=tuple((g / n,) * n for g in grads),
            bucket_share=tuple((1.0 / n,) * n for _ in grads),
            buffer_memory=_per_stage("data_parallel.buffer_memory", sec.buffer_memory, s))
    except ValueError as exc:
        raise ConfigError(f"data_parallel.{exc}") from None
    return GraphConfig(make_run(prob, dp), cfg.solver, source, _facts(dp))


def _model_form(data: dict[str, Any], source: str, overrides: dict[str, Any] | None
                ) -> GraphConfig:
    training = data.get("training")
    if not isinstance(training, dict):
        raise ConfigError("training: expected a mapping (key: value)")
    mine = {k: training[k] for k in TrainingCollectives.model_fields if k in training}
    sec = validate_mapping(TrainingCollectives, mine, "training")
    rest = {k: v for k, v in training.items() if k not in mine}
    replicas = rest.get("data_parallel", 1)
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 2:
        raise ConfigError(f"training.data_parallel: scheduled collectives need >= 2 replicas, "
                          f"got {replicas!r}")
    model = data.get("model")
    if isinstance(model, dict) and model.get("moe") is not None:
        raise ConfigError("model.moe: not with training.collectives: scheduled (the routed "
                          "experts' all-reduce over their DP / EP replicas is not a scheduled "
                          "task); use training.collectives: scalar")
    zero = rest.get("zero_stage", 0)
    if zero in (2, 3):
        raise ConfigError(f"training.zero_stage: {zero} is modelled with training.collectives: "
                          "scalar only (its collectives run inside every micro-batch's ops, "
                          "not as the step's reduction tasks); use zero_stage 0 or 1 here")
    if sec.bucket_bytes is not None and sec.bucket_bytes < 1:
        raise ConfigError(f"training.bucket_bytes: must be >= 1 byte, got {sec.bucket_bytes}")
    clean = {**data, "training": rest}
    cfg = parse_config(clean, source, overrides)
    prob = _check_problem(cfg.problem, "training.collectives")
    dp = _model_dataparallel(clean, source, prob, sec, replicas)
    parts = dict(prob.meta).get("partition") or []
    layers = ", ".join(f"{b - a}" for a, b in parts)
    facts = (("stages", f"{layers} layers (the partition of training.partition)"),
             ("gradients", ", ".join(f"{g / 1e9:.3g}" for g in dp.grad_bytes)
              + " GB per stage"), *_facts(dp))
    return GraphConfig(make_run(prob, dp), cfg.solver, source, facts)


def _model_dataparallel(data: dict[str, Any], source: str, prob: Problem,
                        sec: TrainingCollectives, replicas: int) -> dpw.DataParallel:
    """The replicas' rings, gradient bytes and buckets of a model-form config: per stage the
    gradients of its layers (``training.grad_bytes_per_param`` per parameter this rank holds;
    the all-gather moves as many bytes), buckets of layers in backward order filled to
    ``bucket_bytes`` (as DDP fills its buckets), each bucket's share of the stage's last W
    the share of its layers' W time; per device its tensor-parallel group's rings through its
    replicas (:meth:`pipeopt.topology.Topology.ring_links`: those rings share links), the
    slowest of them, and whether they cross datacenters. With the delayed reduction each
    stage keeps a second gradient buffer (its gradient bytes) and, with ZeRO-1, a second
    copy of its parameters at the same precision: ``buffer_memory``."""
    from pipeopt.costs.build import make_plan
    from pipeopt.schema import ConfigFile

    plan = make_plan(ConfigFile.model_validate({k: v for k, v in data.items() if v is not None}),
                     source)
    meta = dict(prob.meta)
    parts = meta.get("partition")
    if not isinstance(parts, list | tuple) or len(parts) != prob.stages:
        raise ConfigError("training.collectives: the model form gave no stage partition")
    per_param = plan.training.grad_bytes_per_param
    grads, sizes, shares = [], [], []
    for k, (a, b) in enumerate(parts):
        layers = plan.layers[a:b]
        w = plan.layer_times(prob.stage_device[k])[a:b, 2]
        nbytes = [lc.params * per_param for lc in layers]
        grads.append(float(sum(nbytes)))
        groups: list[list[int]] = [[]]
        filled = 0.0
        for i in reversed(range(len(layers))):  # backward order: the last layer first
            if sec.bucket_bytes is not None and groups[-1] and filled >= sec.bucket_bytes:
                groups.append([])
                filled = 0.0
            groups[-1].append(i)
            filled += nbytes[i]
        total_w = float(sum(w))
        sizes.append(tuple(float(sum(nbytes[i] for i in g)) for g in groups))
        shares.append(tuple(float(sum(w[i] for i in g)) / total_w if total_w > 0 else
                            1.0 / len(groups) for g in groups))
    topo, group = plan.topology, plan.group
    reps = plan.replica_gpus or [[g] for g in plan.rank_gpus]
    costs, wan = [], []
    for d in range(prob.devices):
        gpus = reps[d]
        chunk = grads[prob.stage_device.index(d)] / replicas if d in prob.stage_device else 0.0
        rings = [([g + j for g in gpus], chunk) for j in range(group)]
        worst = min(topo.ring_links(rings), key=lambda x: (x.bandwidth, -x.latency))
        costs.append(LinkCost(worst.latency, worst.bandwidth))
        wan.append(len({topo.datacenter_of(g) for g in gpus}) > 1)
    try:
        return dpw.DataParallel(
            replicas=replicas, grad_bytes=tuple(grads), latency=0.0, bandwidth=math.inf,
            reduction=sec.reduction, delayed=sec.delayed_reduction, iterations=sec.iterations,
            algorithm=sec.collective_algorithm,
            bucket_bytes=tuple(sizes), bucket_share=tuple(shares), ring_cost=tuple(costs),
            ring_wan=tuple(wan), buffer_memory=tuple(
                g * (2 if sec.reduction == "reduce_scatter" else 1) for g in grads))
    except ValueError as exc:
        msg = str(exc)  # the model form names the algorithm collective_algorithm
        if msg.startswith("algorithm:"):
            msg = "collective_algorithm:" + msg[len("algorithm:"):]
        raise ConfigError(f"training.{msg}") from None


def _facts(dp: dpw.DataParallel) -> tuple[tuple[str, str], ...]:
    buckets = sum(len(b) for b in dp.bucket_bytes)
    wan = "crosses the WAN (one collective at a time on it)" if dp.crosses_datacenters else (
        "in one datacenter")
    return (
        ("replicas", f"{dp.replicas} ({wan})"),
        ("collectives", f"{dp.reduction.replace('_', '-')} ({dp.algorithm}), {buckets} bucket"
         f"{'s' if buckets > 1 else ''} over {len(dp.bucket_bytes)} stages"
         + (", ZeRO-1 all-gather per stage" if dp.reduction == "reduce_scatter" else "")),
        ("reduction", "delayed one step (overlaps the next iteration)" if dp.delayed else
         "synchronous (the next iteration waits for it)"),
        ("iterations", f"{dp.iterations} in one graph"),
    )

