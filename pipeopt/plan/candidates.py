"""The configurations a plan enumerates, their model-form config, and what is known of each
before it is built: a memory floor and a step-time bound valid for every partition.

A candidate fixes tensor parallelism TP (within a node), pipeline parallelism PP, data
parallelism DP = GPUs / (TP x PP), the micro-batch size b, the micro-batches per step
m = global batch / (DP x b) (an integer), the chunks per device v, the recompute mode and the
ZeRO stage; for a mixture-of-experts model also the expert-parallel size EP, a divisor of
the experts count and of DP (EP carved out of data parallelism, as Megatron-Core and
DeepSpeed-MoE do: :mod:`pipeopt.costs.moe_chain`). Times in seconds, memory in bytes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from pipeopt.costs.build import ModelPlan, make_plan, topology_of
from pipeopt.costs.moe_chain import moe_model_flops
from pipeopt.costs.transformer import model_flops_per_iteration
from pipeopt.costs.zero import zero_bytes_per_param
from pipeopt.errors import MAX_DEVICES, MAX_OPS, ConfigError
from pipeopt.plan.spec import PlanSpec
from pipeopt.schema import ConfigFile
from pipeopt.topology import Topology


@dataclass(frozen=True, order=True)
class Candidate:
    """One parallel configuration (all counts; ``zero`` is the ZeRO stage, 0 to 3; ``ep``
    the expert-parallel size of an MoE model, None for a dense one)."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    microbatches: int
    virtual_stages: int
    recompute: str
    zero: int
    ep: int | None = None

    @property
    def gpus(self) -> int:
        """GPUs the configuration uses: TP x PP x DP."""
        return self.tp * self.pp * self.dp

    @property
    def label(self) -> str:
        """A short name, e.g. ``tp8 pp16 dp8 b1 m192 v1 selective z1`` (``... z1 ep8`` for
        an MoE model)."""
        return (f"tp{self.tp} pp{self.pp} dp{self.dp} b{self.micro_batch_size} "
                f"m{self.microbatches} v{self.virtual_stages} {self.recompute} z{self.zero}"
                + ("" if self.ep is None else f" ep{self.ep}"))

    def as_dict(self) -> dict[str, Any]:
        """The JSON keys of the configuration (``ep`` for an MoE model only)."""
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp,
                **({} if self.ep is None else {"ep": self.ep}),
                "micro_batch_size": self.micro_batch_size, "microbatches": self.microbatches,
                "virtual_stages": self.virtual_stages, "recompute": self.recompute,
                "zero": self.zero, "gpus": self.gpus}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def gpu_counts(spec: PlanSpec) -> list[int]:
    """The GPU counts planned for: ``plan.gpus``, or the whole cluster."""
    return list(spec.plan.gpus or [topology_of(spec.cluster_cfg).num_gpus])


def tensor_sizes(spec: PlanSpec) -> list[int]:
    """TP sizes to try: ``plan.tensor_parallel`` or every divisor of the smallest node's GPU
    count that divides the heads (and the kv heads, or is divided by them), so that a TP group
    never leaves a node and every node holds whole groups (an MoE model's experts are split
    over the same GPUs: :mod:`pipeopt.costs.moe`, "Tensor parallelism")."""
    topo = topology_of(spec.cluster_cfg)
    node = min(size for _, size in topo.nodes)
    heads = spec.model_cfg.heads or 1
    kv = spec.model_cfg.kv_heads or heads
    if spec.plan.tensor_parallel is not None:
        sizes = list(spec.plan.tensor_parallel)
        for t in sizes:
            if any(size % t for _, size in topo.nodes):
                raise ConfigError(f"plan.tensor_parallel: {t} does not divide every node's "
                                  f"GPU count (nodes of {sorted({s for _, s in topo.nodes})}); "
                                  "tensor parallelism stays within a node")
        return sizes
    return [t for t in _divisors(node) if heads % t == 0 and (kv % t == 0 or t % kv == 0)
            and all(size % t == 0 for _, size in topo.nodes)]


def enumerate_candidates(spec: PlanSpec) -> list[Candidate]:
    """Every configuration of the search space that divides the GPUs and the global batch:
    DP = N / (TP x PP) and m = global batch / (DP x b) integers, PP x v stages at most the
    model's pipeline layers (blocks + embedding + head), at most :data:`MAX_DEVICES` pipeline
    ranks and :data:`MAX_OPS` ops; ZeRO 1 to 3 only with DP > 1 (with one replica they are
    ZeRO-0); for an MoE model each EP size of :func:`expert_sizes` that divides DP."""
    pl = spec.plan
    layers = (spec.model_cfg.layers or 0) + 2
    out = []
    for n in gpu_counts(spec):
        for tp in tensor_sizes(spec):
            if n % tp:
                continue
            pps = pl.pipeline_parallel or _divisors(n // tp)
            for pp, b, v, rc, zero in itertools.product(pps, pl.micro_batch_size,
                                                        pl.virtual_stages, pl.recompute,
                                                        pl.zero):
                if (n // tp) % pp or pp * v > layers or pp > MAX_DEVICES or (
                        v > 1 and pp == 1):  # chunks only matter with a pipeline
                    continue
                dp = n // (tp * pp)
                if spec.global_batch_size % (dp * b) or (zero > 0 and dp == 1):
                    continue
                m = spec.global_batch_size // (dp * b)
                if 3 * pp * v * m > MAX_OPS:
                    continue
                if spec.moe is None:
                    out.append(Candidate(tp, pp, dp, b, m, v, rc, zero))
                else:
                    out.extend(Candidate(tp, pp, dp, b, m, v, rc, zero, ep)
                               for ep in expert_sizes(spec) if dp % ep == 0)
    return sorted(set(out))


def expert_sizes(spec: PlanSpec) -> list[int]:
    """EP sizes to try for an MoE model: ``plan.expert_parallel`` or every divisor of
    ``model.moe.experts`` ([] for a dense model)."""
    if spec.moe is None:
        return []
    return list(spec.plan.expert_parallel or _divisors(spec.moe.experts))


def bytes_per_param(spec: PlanSpec, cand: Candidate) -> float:
    """Bytes of weights, gradients and optimizer state per parameter on one GPU under the
    candidate's ZeRO stage, ``total`` = ``training.bytes_per_param`` (16 for mixed-precision
    Adam): ``total`` (ZeRO-0), ``4 + (total - 4) / DP`` (ZeRO-1), ``2 + (total - 2) / DP``
    (ZeRO-2), ``total / DP`` (ZeRO-3) (Rajbhandari et al. 2020, figure 1;
    :func:`pipeopt.costs.zero.zero_bytes_per_param`)."""
    return zero_bytes_per_param(cand.zero, spec.training_cfg.bytes_per_param, cand.dp)


def config_of(spec: PlanSpec, cand: Candidate, stage_layers: Sequence[int] | None = None,
              method: str = "auto", time_limit: float = 60.0, *, uniform: bool = False
              ) -> dict[str, Any]:
    """The model-form config (a mapping, as YAML reads it) of ``cand``: what ``pipeopt solve``
    takes. With ``stage_layers`` the partition is fixed to it; else with ``uniform``
    Megatron's even split, else the planner's rule: the exact chain DP for one chunk per
    device, the even split for more (no ILP)."""
    training: dict[str, Any] = {**spec.training, "data_parallel": cand.dp}
    if cand.zero:
        training["zero_stage"] = cand.zero
    if cand.recompute == "per_stage":
        # Per stage may weigh a split backward (none / selective) against a fused one (full
        # allowed) by scheduling both partitions (costs.build.search_plan): a screening, so
        # it gets round 0's time per candidate, not the model form's 5 s each.
        training["joint_time_limit"] = spec.plan.screen_time_limit
    if stage_layers is not None:
        training["stage_layers"] = list(stage_layers)
    else:
        training["partition"] = "dp" if cand.virtual_stages == 1 and not uniform else "uniform"
    data: dict[str, Any] = {
        "pipeline": {"devices": cand.pp, "microbatches": cand.microbatches,
                     "virtual_stages": cand.virtual_stages, "placement": "loop"},
        "model": {**spec.model, "tensor_parallel": cand.tp,
                  "micro_batch_size": cand.micro_batch_size, "recompute": cand.recompute,
                  **({} if spec.moe is None else {"moe": {
                      **asdict(spec.moe), "expert_parallel": cand.ep or 1}})},
        "cluster": dict(spec.cluster),
        "training": training,
        "solver": {"method": method, "time_limit": time_limit},
    }
    if spec.memory:
        data["memory"] = dict(spec.memory)
    return data


def model_plan(spec: PlanSpec, cand: Candidate, stage_layers: Sequence[int] | None = None,
               *, uniform: bool = False, topology: Topology | None = None) -> ModelPlan:
    """The cost model's :class:`~pipeopt.costs.build.ModelPlan` of ``cand`` (layers placed on
    the cluster; no partition searched yet), on ``topology`` when given (the cluster's, built
    once: its path searches are then shared by every candidate). Raises
    :class:`ConfigError` as the model form does (e.g. ranks that do not fit the cluster)."""
    data = config_of(spec, cand, stage_layers, uniform=uniform)
    cfg = ConfigFile.model_validate({k: v for k, v in data.items() if k != "solver"})
    return make_plan(cfg, spec.source, topology=topology)


@dataclass(frozen=True)
class Estimate:
    """What is known of a candidate before its partition: per-device memory floor averaged
    over the pipeline ranks, the device limit, and a lower bound on the step time (seconds)
    that holds for every partition and every schedule."""

    memory_floor_bytes: float
    memory_limit_bytes: float
    bound_s: float
    model_flops: float

    @property
    def fits(self) -> bool:
        """False when no partition can fit the memory limit."""
        return self.memory_floor_bytes <= self.memory_limit_bytes * (1 + 1e-9)


def estimate(spec: PlanSpec, cand: Candidate, plan: ModelPlan | None = None) -> Estimate:
    """Memory floor and step-time bound of ``cand`` from its layers alone.

    Memory: any schedule holds, on each device, its static bytes (parameters x bytes per
    parameter, plus ``memory.static``) and, when its last forward of a micro-batch starts, that
    micro-batch's activations on all of its stages (:func:`pipeopt.solvers.memory_floor`).
    Summed over the PP devices that is the whole model's static bytes plus one micro-batch's
    activations, whatever the partition; the busiest device needs at least the average, so a
    candidate whose average is over the largest device limit fits no partition.

    Time: every micro-batch runs every layer's F, B and W once on some device. The PP devices
    together are busy m x sum(F + B + W) seconds, each for at most the step time, so the step
    time is at least m x sum(F + B + W) / PP, each layer timed on the fastest of the
    candidate's ranks (GPU model, tensor-parallel and ZeRO collectives; the first stage's
    fused backward and the fused variant of hand-made schedules keep the sum B + W;
    recomputation is inside B).
    """
    plan = plan or model_plan(spec, cand)
    gpus = sorted(set(range(plan.devices)), key=lambda d: plan.rank_gpus[d])
    kinds: dict[tuple[Any, ...], int] = {}
    for d in gpus:  # ranks that time every layer alike: one GPU model, the same rings
        kinds.setdefault((plan.gpu(d).name, plan.tp_links[d] if plan.tp_links else None,
                          plan.dp_links[d] if plan.dp_links else None,
                          plan.a2a_times[d].tobytes() if plan.a2a_times else None), d)
    # With a recompute mode chosen per stage (model.recompute: per_stage) each layer may run
    # in any of the modes: take, per layer, the least time and the least activation bytes
    # over them, which bounds every choice from below.
    worlds = [plan, *(replace(plan, layers=list(o.layers), recompute_options=(),
                              a2a_times=o.a2a_times or plan.a2a_times)
                      for o in getattr(plan, "recompute_options", ()))]
    times = [w.layer_times(d).sum(axis=1) for w in worlds for d in kinds.values()]
    per_mb = sum(min(t[i] for t in times) for i in range(len(plan.layers)))
    static = plan.static_bytes(0, len(plan.layers))
    act = sum(min(w.layers[i].activation_bytes for w in worlds)
              for i in range(len(plan.layers)))
    extra = sum(plan.extra_static)
    floor = (static + act + extra) / plan.devices
    limits = [math.inf if x is None else x for x in plan.memory_limit]
    shape = spec.shape(cand.tp, cand.micro_batch_size, "none")
    flops = (model_flops_per_iteration(shape, cand.microbatches) if spec.moe is None
             else moe_model_flops(shape, spec.moe, cand.microbatches)) * cand.dp
    return Estimate(memory_floor_bytes=floor, memory_limit_bytes=max(limits),
                    bound_s=cand.microbatches * per_mb / cand.pp, model_flops=flops)
