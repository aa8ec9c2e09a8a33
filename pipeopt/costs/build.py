"""The model/cluster form of ``config.yaml``: layers -> partition -> :class:`Problem`.

Flow: validate ``model:``, ``cluster:``, ``training:``; list the pipeline layers (analytic
transformer, explicit ``layer_costs`` or a measured profile); place the pipeline ranks on the
cluster (:mod:`pipeopt.topology`); search the stage partition (:mod:`pipeopt.partition`); build
the problem with per-stage costs, link matrices and memory, and record the partition in
``Problem.meta`` so that the schedule JSON carries it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from pipeopt.costs.config import (
    ClusterConfig,
    ModelConfig,
    MoESection,
    TrainingConfig,
    parse_cluster,
    parse_model,
    parse_training,
)
from pipeopt.costs.gpus import GPU, lookup
from pipeopt.costs.lengths import (
    MicrobatchRatios,
    MicrobatchTokens,
    microbatch_ratios,
    microbatch_tokens,
    problem_scales,
    split_layers,
)
from pipeopt.costs.moe import MoESpec
from pipeopt.costs.moe_chain import moe_layer, moe_layers
from pipeopt.costs.profile import Overheads
from pipeopt.costs.transformer import (
    LayerCost,
    TransformerShape,
    block_activation_bytes,
    block_weight_grad_held_bytes,
    efficiency_at,
    total_params,
    tp_comm_times,
)
from pipeopt.costs.transformer import transformer_layers as _transformer_layers
from pipeopt.costs.zero import (
    WEIGHT_BYTES,
    zero_bytes_per_param,
    zero_op_comm_times,
    zero_step_comm_time,
    zero_transient_bytes,
)
from pipeopt.errors import ConfigError
from pipeopt.partition import (
    ChainCosts,
    Partition,
    PartitionError,
    check_partition,
    evaluate,
    from_counts,
    inflight_microbatches,
    uniform_partition,
    with_modes,
)
from pipeopt.problem import Problem, ProblemError, Scale, stage_device_map
from pipeopt.schema import Config, ConfigFile, check_totals, memory_values, microbatch_scales
from pipeopt.subblocks import piece_layers
from pipeopt.topology import Datacenter, NodeGroup, TierOverride, Topology, TopologyError


# ----- layers ------------------------------------------------------------------------------
def shape_of(cfg: ModelConfig) -> TransformerShape:
    """The :class:`TransformerShape` of a validated transformer ``model:`` section."""
    assert cfg.layers and cfg.hidden and cfg.heads and cfg.seq_len and cfg.vocab
    return TransformerShape(
        layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads, seq_len=cfg.seq_len,
        vocab=cfg.vocab, kv_heads=cfg.kv_heads, ffn_hidden=cfg.ffn_hidden,
        micro_batch_size=cfg.micro_batch_size, dtype=cfg.dtype, activation=cfg.activation,
        norm=cfg.norm, bias=cfg.bias, position_embedding=cfg.position_embedding,
        tie_embeddings=cfg.tie_embeddings, dropout=cfg.dropout,
        # per_stage: the layers of mode none; each mode's are built by recompute_options
        recompute="none" if cfg.recompute == "per_stage" else cfg.recompute,
        tensor_parallel=cfg.tensor_parallel, sequence_parallel=cfg.sequence_parallel,
        causal=cfg.causal, flash_attention=cfg.flash_attention)


def model_layers(cfg: ModelConfig, base_dir: Path | None = None) -> tuple[list[LayerCost], str]:
    """The pipeline layers of a ``model:`` section and where their costs come from
    (``analytic``, ``layer_costs`` or ``profile``)."""
    if cfg.profile is not None:
        from pipeopt.costs.profile import ProfileError, load_profile

        path = Path(cfg.profile)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        try:
            layers = load_profile(path)
        except ProfileError as exc:
            raise ConfigError(f"model.profile: {exc}") from None
        if len(layers) > MAX_LAYERS:
            raise ConfigError(f"model.profile: {len(layers)} layers, at most {MAX_LAYERS}; "
                              "profile the model with fewer, larger layers")
        return layers, "profile"
    if cfg.layer_costs is not None:
        total = sum(spec.count for spec in cfg.layer_costs)
        if total > MAX_LAYERS:
            raise ConfigError(f"model.layer_costs: {total} layers (counts included), at most "
                              f"{MAX_LAYERS}; merge consecutive layers into one entry with "
                              "their summed costs")
        out = []
        for spec in cfg.layer_costs:
            fwd = spec.forward
            for i in range(spec.count):
                name = spec.name if spec.count == 1 else f"{spec.name}{i}"
                wgb = spec.activation_bytes if spec.weight_grad_bytes is None else min(
                    spec.weight_grad_bytes, spec.activation_bytes)
                ff = spec.forward_flops or 0.0
                out.append(LayerCost(
                    name=name, forward_flops=ff,
                    backward_input_flops=(spec.backward_input_flops
                                          if spec.backward_input_flops is not None else ff),
                    backward_weight_flops=(spec.backward_weight_flops
                                           if spec.backward_weight_flops is not None else ff),
                    params=spec.params, activation_bytes=spec.activation_bytes,
                    weight_grad_bytes=wgb, output_bytes=spec.output_bytes,
                    forward_time=fwd,
                    backward_input_time=(spec.backward_input if spec.backward_input is not None
                                         else fwd),
                    backward_weight_time=(spec.backward_weight if spec.backward_weight
                                          is not None else fwd)))
        return out, "layer_costs"
    return _transformer_layers(shape_of(cfg), block_overrides(cfg)), "analytic"


def model_overheads(cfg: ModelConfig, base_dir: Path | None = None) -> Overheads:
    """The runtime's fixed costs of a ``model:`` section (seconds): ``model.overheads`` when
    given, else those the profile measured, else none."""
    if cfg.overheads is not None:
        return Overheads(**cfg.overheads.model_dump())
    if cfg.profile is None:
        return Overheads()
    from pipeopt.costs.profile import ProfileError, load_overheads

    path = Path(cfg.profile)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        return load_overheads(path)
    except ProfileError as exc:
        raise ConfigError(f"model.profile: {exc}") from None


def block_overrides(cfg: ModelConfig) -> dict[int, dict[str, object]]:
    """``model.overrides`` by block index: the changed shape fields (and ``time_scale``)."""
    overrides: dict[int, dict[str, object]] = {}
    for ov in cfg.overrides:
        change = {k: v for k, v in ov.model_dump(exclude={"layers"}).items() if v is not None}
        for b in ov.layers:
            overrides.setdefault(b, {}).update(change)
    return overrides


# ----- cluster -----------------------------------------------------------------------------
def topology_of(cfg: ClusterConfig) -> Topology:
    """The :class:`Topology` of a validated ``cluster:`` section (a tier key left out keeps
    its default)."""
    tiers = {name: TierOverride(t["bandwidth"], t["latency"])
             for name, t in cfg.tiers.model_dump().items() if t is not None}
    if isinstance(cfg.datacenters, int):
        dcs = [Datacenter(lookup(cfg.gpu), cfg.nodes_per_datacenter, cfg.gpus_per_node,
                          nics=cfg.nics_per_node)] * cfg.datacenters
    else:
        dcs = []
        for dc in cfg.datacenters:
            gpu, per_node = dc.gpu or cfg.gpu, dc.gpus_per_node or cfg.gpus_per_node
            nics = dc.nics_per_node or cfg.nics_per_node
            if isinstance(dc.nodes, list):  # node groups of their own GPUs, one fabric
                dcs.append(Datacenter.of_groups([
                    NodeGroup(lookup(g.gpu or gpu), g.count, g.gpus_per_node or per_node,
                              g.nics_per_node or nics)
                    for g in dc.nodes]))
            else:
                dcs.append(Datacenter(lookup(gpu), dc.nodes or cfg.nodes_per_datacenter,
                                      per_node, nics=nics))
    return Topology(dcs, tiers)


# ----- the plan: everything needed to turn a partition into a Problem ----------------------
#: The recomputation modes a stage may choose with ``model.recompute: per_stage``.
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")


@dataclass(frozen=True)
class RecomputeOption:
    """The pipeline layers (and micro-batch cost ratios) of a transformer model when every
    block runs with recomputation ``mode`` (blocks whose ``overrides`` set their own
    ``recompute`` keep it)."""

    mode: str
    layers: tuple[LayerCost, ...]
    ratios: MicrobatchRatios | None = None
    #: An MoE model's all-to-all seconds in this mode (:attr:`ModelPlan.a2a_times`: full
    #: recomputation runs the forward's again in B); () without them.
    a2a_times: tuple[np.ndarray, ...] = ()


@dataclass
class ModelPlan:
    """Layers, devices and settings of a model/cluster config (times in seconds, bytes)."""

    layers: list[LayerCost]
    source: str
    topology: Topology
    rank_gpus: list[int]
    devices: int
    microbatches: int
    virtual_stages: int
    placement: str
    split_backward: bool
    dtype: str
    efficiency: float | list[tuple[float, float]]
    peak_override: float | None
    memory_limit: list[float | None]
    extra_static: list[float]
    training: TrainingConfig
    model_params: float | None = None
    #: Per pipeline rank, the GPUs of its data-parallel replicas (the rank's own first).
    replica_gpus: list[list[int]] | None = None
    #: GPUs per pipeline rank (its tensor-parallel group, consecutive from its first GPU).
    group: int = 1
    #: Sequences per micro-batch of a transformer model (None for layer_costs / profiles).
    micro_batch_size: int | None = None
    #: What the cost model decided for the user, said in ``problem.meta.notes``.
    notes: tuple[str, ...] = ()
    #: Per micro-batch cost ratios from ``training.sequence_lengths`` (None: all equal).
    ratios: MicrobatchRatios | None = None
    #: ``pipeline.microbatch_scale`` and its kin as given (Problem fields), when given.
    explicit_scales: dict[str, Scale] | None = None
    #: ``model.recompute`` of a transformer model (None for layer_costs and profiles).
    recompute: str | None = None
    #: With ``recompute: per_stage``: every mode's layers (:data:`RECOMPUTE_MODES`).
    recompute_options: tuple[RecomputeOption, ...] = ()
    #: The modes a stage may choose in this plan's backward (split or fused).
    recompute_modes: tuple[str, ...] = ()
    #: Why full recomputation needs a fused backward, when this split-backward plan leaves
    #: ``full`` out and :meth:`fused_world` is its counterpart that allows it; else None.
    fused_alternative: str | None = None
    #: Each stage's recomputation, once chosen for a partition (:meth:`resolved`).
    stage_recompute: tuple[str, ...] | None = None
    #: Per pipeline rank, its tensor-parallel ring's slowest hop (latency s, bandwidth
    #: bytes/s) over the rank's ``group`` GPUs; () without tensor parallelism.
    tp_links: tuple[tuple[float, float], ...] = ()
    #: With ZeRO-2/3 and data parallelism, per pipeline rank the slowest hop (latency s,
    #: bandwidth bytes/s) of its replicas' rings (:meth:`dp_ring_links`), which carry the
    #: collectives of every micro-batch; () otherwise.
    dp_links: tuple[tuple[float, float], ...] = ()
    #: Mixture-of-experts (:func:`pipeopt.costs.moe_chain.moe_plan`): per layer, the
    #: parameters of the routed experts this rank stores (their replicas are DP / EP, not DP);
    #: () for a dense model.
    expert_params: tuple[float, ...] = ()
    #: Expert-parallel size EP (a divisor of the data-parallel size; 1 for a dense model).
    expert_parallel: int = 1
    #: Per pipeline rank, (L, 3) seconds of each MoE layer's all-to-all in its forward,
    #: backward-input and backward-weight ops over the rank's EP group; () without them.
    a2a_times: tuple[np.ndarray, ...] = ()
    #: The runtime's fixed costs (seconds; ``model.overheads`` or the profile's), added to the
    #: problem by :meth:`problem` (:func:`with_overheads`).
    overheads: Overheads = field(default_factory=Overheads)

    @property
    def stages(self) -> int:
        """Global stages p·v."""
        return self.devices * self.virtual_stages

    @property
    def zero_stage(self) -> int:
        """``training.zero_stage`` (0: plain data parallelism)."""
        return self.training.zero_stage

    @property
    def static_bytes_per_param(self) -> float:
        """Bytes per parameter a GPU holds under the ZeRO stage (weights, gradients,
        optimizer state; :func:`pipeopt.costs.zero.zero_bytes_per_param`)."""
        return zero_bytes_per_param(self.zero_stage, self.training.bytes_per_param,
                                    self.training.data_parallel)

    @property
    def expert_bytes_per_param(self) -> float:
        """Bytes per routed-expert parameter a GPU holds: the ZeRO stage's over the experts'
        DP / EP replicas (equal to :attr:`static_bytes_per_param` with ZeRO-0)."""
        return zero_bytes_per_param(self.zero_stage, self.training.bytes_per_param,
                                    self.training.data_parallel // self.expert_parallel)

    def static_bytes(self, a: int, b: int) -> float:
        """Bytes of weights, gradients and optimizer state of layers ``a:b`` on a GPU: their
        parameters x :attr:`static_bytes_per_param`, routed experts at
        :attr:`expert_bytes_per_param`."""
        out = sum(lc.params for lc in self.layers[a:b]) * self.static_bytes_per_param
        if self.expert_params:
            out += sum(self.expert_params[a:b]) * (self.expert_bytes_per_param
                                                   - self.static_bytes_per_param)
        return out

    def zero_transient(self, layers: list[LayerCost] | tuple[LayerCost, ...],
                       experts: Sequence[float] = ()) -> float:
        """Bytes the largest of ``layers`` holds on top of its ZeRO-2/3 shards while it runs
        (:func:`pipeopt.costs.zero.zero_transient_bytes`); 0 otherwise. ``experts``: per
        layer, the parameters of its routed experts (an MoE plan's :attr:`expert_params`),
        sharded over their DP / EP replicas, the rest over DP."""
        dp, gb = self.training.data_parallel, self.training.grad_bytes_per_param
        dpe = dp // self.expert_parallel
        ex = list(experts) or [0.0] * len(layers)
        return max((zero_transient_bytes(self.zero_stage, lc.params - e, dp, gb)
                    + (zero_transient_bytes(self.zero_stage, e, dpe, gb) if e else 0.0)
                    for lc, e in zip(layers, ex, strict=True)), default=0.0)

    @property
    def stage_device(self) -> tuple[int, ...]:
        """Device of each stage."""
        return stage_device_map(self.devices, self.virtual_stages, self.placement)

    def gpu(self, device: int) -> GPU:
        """GPU model of a pipeline rank."""
        return self.topology.gpu_models[self.rank_gpus[device]]

    def peak(self, device: int) -> float:
        """Dense peak FLOP/s of a rank's GPU for the model's dtype."""
        return self.peak_override or self.gpu(device).peak_flops(self.dtype)

    def layer_times(self, device: int) -> np.ndarray:
        """(L, 3) seconds of forward, backward-input, backward-weight of each layer. Without
        split backward, B and W are scaled so that B + W is the fused backward (measured, when
        a profile has it). Each op includes its tensor-parallel collectives
        (:meth:`tp_comm_times`)."""
        peak = self.peak(device)
        rows = []
        for lc in self.layers:
            eff = efficiency_at(lc.forward_flops, self.efficiency)
            f, b, w = lc.times(peak, eff)
            if not self.split_backward and b + w > 0:
                scale = lc.fused_backward(peak, eff) / (b + w)
                b, w = b * scale, w * scale
            rows.append((f, b, w))
        return (np.array(rows, float).reshape(len(self.layers), 3)
                + self.comm_times(device))

    def comm_times(self, device: int) -> np.ndarray:
        """(L, 3) seconds of the collectives inside each layer's ops on pipeline rank
        ``device``: tensor-parallel (:meth:`tp_comm_times`), ZeRO-2/3
        (:meth:`zero_comm_times`) and an MoE layer's all-to-all (:attr:`a2a_times`)."""
        out = self.tp_comm_times(device) + self.zero_comm_times(device)
        if self.a2a_times:  # an MoE layer's dispatch and combine all-to-all
            out = out + self.a2a_times[device]
        return out

    def zero_comm_times(self, device: int) -> np.ndarray:
        """(L, 3) seconds of each layer's per-micro-batch ZeRO collectives in its forward,
        backward-input and backward-weight ops over pipeline rank ``device``'s replicas
        (:func:`pipeopt.costs.zero.zero_op_comm_times`: stage 3 gathers the weights in F and
        B, stages 2 and 3 reduce-scatter the gradients in W); zeros otherwise. An MoE plan's
        routed experts (:attr:`expert_params`) over their DP / EP replicas, on the same link
        (as :meth:`grad_reduce`), the rest over DP."""
        out = np.zeros((len(self.layers), 3))
        if self.zero_stage < 2 or not self.dp_links:
            return out
        lat, bw = self.dp_links[device]
        dp, gb = self.training.data_parallel, self.training.grad_bytes_per_param
        dpe = dp // self.expert_parallel
        for i, lc in enumerate(self.layers):
            ex = self.expert_params[i] if self.expert_params else 0.0
            out[i] = zero_op_comm_times(self.zero_stage, lc.params - ex, dp, lat, bw, gb)
            if ex:
                out[i] += zero_op_comm_times(self.zero_stage, ex, dpe, lat, bw, gb)
        return out

    def tp_comm_times(self, device: int) -> np.ndarray:
        """(L, 3) seconds of each layer's tensor-parallel collectives in its forward,
        backward-input and backward-weight ops on pipeline rank ``device``'s ring
        (:func:`pipeopt.costs.transformer.tp_comm_times`); zeros without tensor parallelism."""
        out = np.zeros((len(self.layers), 3))
        if self.group == 1 or not self.tp_links:
            return out
        lat, bw = self.tp_links[device]
        for i, lc in enumerate(self.layers):
            if lc.tp_collectives:
                out[i] = tp_comm_times(lc, self.group, lat, bw)
        return out

    def sub_block_weights(self, partition: Sequence[Sequence[int]], k: int
                          ) -> list[list[tuple[float, ...]]]:
        """Per stage of ``partition``, per piece of its layers cut into ``k``
        (:func:`pipeopt.subblocks.piece_layers`): the sums of the piece's layers' forward,
        backward-input and backward-weight seconds on the stage's device, activation and
        weight-gradient bytes, and parameters, the ``weights`` of
        :func:`pipeopt.subblocks.split`."""
        sd = self.stage_device
        times = {d: self.layer_times(d) for d in set(sd)}
        out = []
        for st, (a, b) in enumerate(partition):
            row = []
            for lo, hi in piece_layers(a, b, k):
                f, bi, w = (float(x) for x in times[sd[st]][lo:hi].sum(axis=0))
                seg = self.layers[lo:hi]
                row.append((f, bi, w, float(sum(lc.activation_bytes for lc in seg)),
                            float(sum(lc.weight_grad_bytes for lc in seg)),
                            float(sum(lc.params for lc in seg))))
            out.append(row)
        return out

    def first_stage_backward(self, device: int, a: int, b: int) -> float | None:
        """With split backward, the W of a first stage (layers ``a:b``) whose input takes no
        gradient: the whole fused backward, its B being nothing to compute (seconds); None
        when the rule does not apply."""
        if not self.split_backward or a != 0 or self.layers[0].input_grad:
            return None
        peak = self.peak(device)
        comm = self.comm_times(device)[a:b, 1:].sum()
        return float(sum(lc.fused_backward(peak, efficiency_at(lc.forward_flops,
                                                                self.efficiency))
                         for lc in self.layers[a:b]) + comm)

    @property
    def message_bytes(self) -> float:
        """The largest message a stage cut can send (bytes): links between two ranks take the
        path fastest for it (:meth:`pipeopt.topology.Topology.path`)."""
        return max((lc.output_bytes for lc in self.layers[:-1]), default=0.0)

    def dp_ring_links(self, chunks: list[float]) -> list[Any]:
        """Per pipeline rank, the slowest of its tensor-parallel GPUs' rings through the rank's
        replicas (a :class:`~pipeopt.topology.RingLink`), all rings running at once and
        dividing the links they share (:meth:`pipeopt.topology.Topology.ring_links`);
        ``chunks``: per rank, the bytes of one ring step (they choose the paths)."""
        replicas = self.replica_gpus or [[g] for g in self.rank_gpus]
        rings = [([g + j for g in replicas[d]], chunks[d])
                 for d in range(self.devices) for j in range(self.group)]
        links = self.topology.ring_links(rings)
        return [min(links[d * self.group:(d + 1) * self.group],
                    key=lambda x: (x.bandwidth, -x.latency)) for d in range(self.devices)]

    def grad_reduce(self, rows: list[dict[str, Any]]
                    ) -> tuple[list[float], list[dict[str, Any]] | None]:
        """Per stage, the seconds of its data-parallel collectives after its last backward,
        and per device the ring's link (JSON-able; None without data parallelism).

        Every pipeline rank's ``group`` tensor-parallel GPUs each reduce their shard over a
        ring through the rank's replicas (:meth:`dp_ring_links`). With ZeRO 0 or 1 a stage's
        reduction is a ring all-reduce: 2(d-1) steps, each sending 1/d of its bytes over
        every ring link at once, paced by the slowest of the rank's rings; with ZeRO-2 the
        all-gather of the updated weights, with ZeRO-3 nothing (its reduce-scatters are in
        the W ops; :func:`pipeopt.costs.zero.zero_step_comm_time`). An MoE plan's routed
        experts (:attr:`expert_params`) are all-reduced over their DP / EP replicas, on the
        same link."""
        dp = self.training.data_parallel
        if dp == 1:
            return [0.0] * self.stages, None
        sd = self.stage_device
        grads = [r["params"] * self.training.grad_bytes_per_param for r in rows]
        per_device = [0.0] * self.devices
        for k, nbytes in enumerate(grads):
            per_device[sd[k]] += nbytes
        worst = self.dp_ring_links([x / dp for x in per_device])
        if self.zero_stage < 2 and self.expert_params:
            # MoE: the routed experts' gradients are all-reduced over their DP / EP replicas
            # (taken on the same worst ring link), the rest over all DP replicas.
            dpe = dp // self.expert_parallel
            gb = self.training.grad_bytes_per_param
            reduce = []
            for k, r in enumerate(rows):
                link = worst[sd[k]]
                ex = r.get("expert_params", 0.0) * gb
                t = 2 * (dp - 1) * (link.latency + ((grads[k] - ex) / dp) / link.bandwidth)
                if dpe > 1:
                    t += 2 * (dpe - 1) * (link.latency + (ex / dpe) / link.bandwidth)
                reduce.append(t)
        elif self.zero_stage < 2:  # the all-reduce (as zero_step_comm_time, term by term)
            reduce = [2 * (dp - 1) * (worst[sd[k]].latency
                                      + (nbytes / dp) / worst[sd[k]].bandwidth)
                      for k, nbytes in enumerate(grads)]
        else:  # ZeRO-2/3 (an MoE plan's routed experts over their DP / EP replicas)
            dpe = dp // self.expert_parallel
            gb = self.training.grad_bytes_per_param
            reduce = []
            for k, r in enumerate(rows):
                link, ex = worst[sd[k]], r.get("expert_params", 0.0)
                t = zero_step_comm_time(self.zero_stage, r["params"] - ex, dp, link.latency,
                                        link.bandwidth, gb)
                if ex:
                    t += zero_step_comm_time(self.zero_stage, ex, dpe, link.latency,
                                             link.bandwidth, gb)
                reduce.append(t)
        info = [{"device": d, "rings": self.group, "latency_s": x.latency,
                 "bandwidth": None if math.isinf(x.bandwidth) else x.bandwidth,
                 "shared_by": x.shared_by, "link": x.link}
                for d, x in enumerate(worst)]
        return reduce, info

    def _option(self, mode: str) -> ModelPlan:
        """This plan with every stage in recomputation ``mode`` (``recompute: per_stage``)."""
        opt = next(o for o in self.recompute_options if o.mode == mode)
        return replace(self, layers=list(opt.layers), ratios=opt.ratios, recompute=mode,
                       recompute_options=(), recompute_modes=(), fused_alternative=None,
                       a2a_times=opt.a2a_times or self.a2a_times)

    def fused_world(self) -> ModelPlan | None:
        """With ``recompute: per_stage`` on a split backward that leaves ``full`` out: the
        same plan with the backward fused and every mode allowed (None otherwise)."""
        if self.fused_alternative is None:
            return None
        note = ("backward fused (split_backward: false): recompute: per_stage runs full "
                f"recomputation on some stage, and {self.fused_alternative}")
        return replace(self, split_backward=False, fused_alternative=None,
                       recompute_modes=tuple(o.mode for o in self.recompute_options),
                       notes=(*self.notes, note))

    def stage_modes(self, partition: Partition) -> tuple[str, ...]:
        """Each stage's recomputation for ``partition`` as the search picks it: the fastest
        modes that fit each device (:func:`pipeopt.partition.choose_modes`); () without
        ``recompute: per_stage``."""
        if not self.recompute_options:
            return ()
        return evaluate(self.chain_costs(), partition).modes

    def resolved(self, partition: Partition,
                 recompute: tuple[str, ...] | list[str] | None = None) -> ModelPlan:
        """This plan with each stage's layers in its recomputation mode (``recompute``, one
        per stage, or :meth:`stage_modes`); the plan itself without ``per_stage``."""
        if not self.recompute_options:
            return self
        modes = tuple(recompute) if recompute is not None else self.stage_modes(partition)
        if len(modes) != len(partition) or not set(modes) <= set(self.recompute_modes):
            raise ValueError(f"recompute: expected {len(partition)} modes among "
                             f"{list(self.recompute_modes)}, got {list(modes)}")
        opts = {m: self._option(m) for m in set(modes)}
        layers: list[LayerCost] = []
        for (a, b), m in zip(partition, modes, strict=True):
            layers.extend(opts[m].layers[a:b])
        ratios = None
        if self.recompute_options[0].ratios is not None:
            parts = [(opts[m].ratios, a, b) for (a, b), m in zip(partition, modes, strict=True)]

            def cat(field: str) -> np.ndarray:
                return np.concatenate([getattr(r, field)[:, a:b] for r, a, b in parts], axis=1)

            first = self.recompute_options[0].ratios
            ratios = replace(first, flops=cat("flops"), activation=cat("activation"),
                             weight_grad=cat("weight_grad"))
        a2a = self.a2a_times
        if a2a and any(o.a2a_times for o in self.recompute_options):
            # An MoE model: each layer's all-to-all seconds in its stage's mode.
            a2a = tuple(np.concatenate([opts[m].a2a_times[d][a:b]
                                        for (a, b), m in zip(partition, modes, strict=True)])
                        for d in range(self.devices))
        return replace(self, layers=layers, ratios=ratios, recompute_options=(),
                       recompute_modes=(), fused_alternative=None, stage_recompute=modes,
                       a2a_times=a2a)

    def transient_reserve(self) -> float:
        """Bytes the partition search keeps free on every device for a recomputing
        backward's transient (:func:`backward_transient`): the largest layer's, times the
        largest micro-batch's activation ratio. With ``recompute: per_stage`` the largest
        over this world's modes (the modes share the device limits): the search then covers
        every uniform mode's partitions with that mode's reserve or more, and whatever it
        picks fits once the problem counts each stage's own transient."""
        if self.recompute_options:
            return max(self._option(m).transient_reserve() for m in self.recompute_modes)
        out = max((lc.backward_transient_bytes for lc in self.layers), default=0.0)
        if self.ratios is not None and out > 0:
            out *= float(self.ratios.activation.max())
        return out + self.zero_transient(self.layers, self.expert_params)

    def chain_costs(self, reserve: float | None = None) -> ChainCosts:
        """Inputs of the partition search (with ``recompute: per_stage``, one mode per
        allowed recomputation: :func:`pipeopt.partition.with_modes`); each device limit less
        ``reserve`` bytes (default :meth:`transient_reserve`)."""
        if reserve is None:
            reserve = self.transient_reserve()
        if self.recompute_options:
            return with_modes([(m, self._option(m).chain_costs(reserve))
                               for m in self.recompute_modes])
        sd = self.stage_device
        # Micro-batches of different cost: the search sees the average micro-batch (each
        # layer's F, B, W times the mean of their ratios over the micro-batches).
        mean = np.ones((len(self.layers), 3)) if self.ratios is None else (
            self.ratios.flops.mean(axis=0))
        per_dev = {d: (self.layer_times(d) * mean).sum(axis=1) for d in set(sd)}
        compute = np.stack([per_dev[d] for d in sd])
        if self.first_stage_backward(sd[0], 0, 1) is not None:
            # Stage 0 runs its backward fused (no input gradient to hand on, see
            # stage_costs): cost its layers as forward + fused backward, as the problem will.
            peak = self.peak(sd[0])
            comm = self.comm_times(sd[0]).sum(axis=1)
            compute[0] = [(lc.times(peak, efficiency_at(lc.forward_flops, self.efficiency))[0]
                           + lc.fused_backward(peak, efficiency_at(lc.forward_flops,
                                                                   self.efficiency)) + c) * r
                          for lc, r, c in zip(self.layers, mean.mean(axis=1), comm,
                                              strict=True)]
        out_bytes = np.array([lc.output_bytes for lc in self.layers])
        if self.ratios is not None:  # the average micro-batch's messages
            out_bytes = out_bytes * float(self.ratios.message.mean())
        comm = np.zeros((self.stages - 1, len(self.layers)))
        for k in range(self.stages - 1):
            a, b = self.rank_gpus[sd[k]], self.rank_gpus[sd[k + 1]]
            if a != b:
                lat, bw = self.topology.link(a, b, self.message_bytes)
                comm[k] = 2 * (lat + out_bytes / bw)  # activation forward + gradient back
        static = np.array([lc.params * self.static_bytes_per_param for lc in self.layers])
        if self.expert_params:
            static = static + np.array(self.expert_params) * (
                self.expert_bytes_per_param - self.static_bytes_per_param)
        act = np.array([lc.activation_bytes for lc in self.layers])
        if self.ratios is not None:  # the average micro-batch's bytes
            act = act * self.ratios.activation.mean(axis=0)
        inflight = inflight_microbatches(self.devices, self.virtual_stages, self.microbatches,
                                         self.training.inflight)
        lim = [math.inf if x is None else x - s - reserve
               for x, s in zip(self.memory_limit, self.extra_static, strict=True)]
        return ChainCosts(compute=compute, comm=comm, static=static, activation=act,
                          inflight=np.array(inflight, float), stage_device=sd,
                          device_limit=np.array(lim, float), microbatches=self.microbatches)

    def fused_backward(self, partition: Partition) -> list[float] | None:
        """With split backward and a profile that measured the fused backward: per stage, its
        seconds (what a schedule that fuses the backward pays; see
        :func:`pipeopt.schedules.fused_variant`). None otherwise."""
        if not self.split_backward or all(lc.backward_time is None for lc in self.layers):
            return None
        out = []
        for a, b in partition:
            peak = self.peak(self.stage_device[len(out)])
            out.append(float(sum(lc.fused_backward(peak, efficiency_at(lc.forward_flops,
                                                                       self.efficiency))
                                 for lc in self.layers[a:b])))
        return out

    def uniform(self) -> Partition:
        """Megatron's default: transformer blocks split evenly, embedding on the first stage
        and LM head on the last; equal layer counts for other models."""
        names = [lc.name for lc in self.layers]
        n, s = len(names), self.stages
        if names and names[0] == "embedding" and names[-1] == "head" and n - 2 >= s:
            inner = uniform_partition(n - 2, s)
            return tuple((0 if k == 0 else a + 1, n if k == s - 1 else b + 1)
                         for k, (a, b) in enumerate(inner))
        return uniform_partition(n, s)

    def stage_costs(self, partition: Partition) -> list[dict[str, Any]]:
        """Per-stage figures (JSON-able): layers, times, memory."""
        sd = self.stage_device
        times = {d: self.layer_times(d) for d in set(sd)}
        inflight = inflight_microbatches(self.devices, self.virtual_stages, self.microbatches,
                                         self.training.inflight)
        out = []
        for k, (a, b) in enumerate(partition):
            t = times[sd[k]][a:b].sum(axis=0)
            seg = self.layers[a:b]
            act = sum(lc.activation_bytes for lc in seg)
            static = self.static_bytes(a, b)
            wgb = float(sum(lc.weight_grad_bytes for lc in seg))
            whole = self.first_stage_backward(sd[k], a, b) if k == 0 else None
            if whole is not None:
                # Nothing upstream needs stage 0's input gradient: its B is empty and its W
                # runs the whole backward, keeping every activation until then (as the
                # executor and PyTorch's runtime do).
                t = np.array([t[0], 0.0, whole])
                wgb = float(act)
            mode = {} if self.recompute is None else {
                "recompute": (self.stage_recompute[k] if self.stage_recompute is not None
                              else self.recompute)}
            # One block's backward at a time holds its recomputed activations on top.
            transient = max(lc.backward_transient_bytes for lc in seg)
            zero_held = self.zero_transient(seg, self.expert_params[a:b])
            out.append({
                "stage": k, "device": sd[k], "layers": [a, b],
                "first": seg[0].name, "last": seg[-1].name, **mode,
                "forward_s": float(t[0]), "backward_input_s": float(t[1]),
                "backward_weight_s": float(t[2]),
                "activation_bytes": float(act),
                "weight_grad_bytes": wgb,
                "params": float(sum(lc.params for lc in seg)),
                **({"expert_params": float(sum(self.expert_params[a:b]))}
                   if self.expert_params else {}),
                "static_bytes": float(static),
                "inflight_microbatches": inflight[k],
                "backward_transient_bytes": float(transient),
                **({"zero_transient_bytes": float(zero_held)} if zero_held else {}),
                "memory_estimate_bytes": float(static + inflight[k] * act + transient
                                               + zero_held),
                "output_bytes": float(seg[-1].output_bytes),
            })
        return out

    def problem(self, partition: Partition, meta: dict[str, Any] | None = None,
                recompute: tuple[str, ...] | list[str] | None = None) -> Problem:
        """The scheduling problem of ``partition``; with ``recompute: per_stage``, each stage
        in its mode of ``recompute`` (or as :meth:`stage_modes` picks)."""
        check_partition(partition, len(self.layers), self.stages)
        if self.recompute_options:
            return self.resolved(partition, recompute).problem(partition, meta)
        p, sd = self.devices, self.stage_device
        rows = self.stage_costs(partition)
        static = [0.0] * p
        for r in rows:
            static[r["device"]] += r["static_bytes"]
        static = [s + e for s, e in zip(static, self.extra_static, strict=True)]
        scales = self.microbatch_scales(partition)
        transient = backward_transient(rows, p, scales.get("microbatch_memory_scale")
                                       or scales.get("microbatch_scale") or ())
        static = [s + t for s, t in zip(static, transient, strict=True)]
        # ZeRO-2/3: one layer's gathered weights and full gradients at a time, on top.
        held = [0.0] * p
        for r in rows:
            held[r["device"]] = max(held[r["device"]], r.get("zero_transient_bytes", 0.0))
        static = [s + h for s, h in zip(static, held, strict=True)]
        lat, bw = self.topology.matrices(self.rank_gpus, self.message_bytes)
        reduce, rings = self.grad_reduce(rows)
        info = {
            "partition": [list(r["layers"]) for r in rows],
            "layer_names": [lc.name for lc in self.layers],
            "stage_costs": rows,
            "devices": [{"device": d, "gpu": self.topology.gpus[g],
                         "model": self.topology.gpu_models[g].name,
                         "datacenter": self.topology.datacenter_of(g),
                         "memory_limit": self.memory_limit[d]}
                        for d, g in enumerate(self.rank_gpus)],
            "cross_datacenter_cuts": self.topology.cross_datacenter_cuts(
                [self.rank_gpus[d] for d in sd]),
            "cost_model": {"source": self.source, "dtype": self.dtype,
                           "compute_efficiency": self.efficiency,
                           "bytes_per_param": self.static_bytes_per_param,
                           "zero_stage": self.zero_stage,
                           "model_params": self.model_params,
                           "data_parallel": self.training.data_parallel,
                           "micro_batch_size": self.micro_batch_size},
            **(meta or {}),
        }
        if self.ratios is not None:
            info["microbatch_costs"] = self.ratios.summary()
        notes = list(self.notes)
        if any(transient):
            info["backward_transient_bytes"] = transient
            notes.append("memory: a recomputing backward holds one block's recomputed "
                         f"activations while it runs (up to {max(transient) / 2**30:.2f} GiB "
                         "per device); counted in each device's static memory")
        if any(held):
            info["zero_transient_bytes"] = held
            notes.append(f"memory: ZeRO-{self.zero_stage} holds one layer's "
                         + ("gathered weights and " if self.zero_stage == 3 else "")
                         + "full gradients on top of its shards while it runs (up to "
                         f"{max(held) / 2**30:.2f} GiB per device); counted in each device's "
                         "static memory")
        if notes:
            info["notes"] = notes
        if rings is not None:
            info["grad_reduce_rings"] = rings
        fused = self.fused_backward(partition)
        if fused is not None:
            info["fused_backward"] = fused
        step = [self.overheads.step_s + sum(lc.step_time for lc in self.layers[a:b])
                for a, b in partition]
        return with_overheads(Problem(
            devices=p, microbatches=self.microbatches, virtual_stages=self.virtual_stages,
            placement=self.placement,  # type: ignore[arg-type]
            split_backward=self.split_backward,
            forward=tuple(r["forward_s"] for r in rows),
            backward_input=tuple(r["backward_input_s"] for r in rows),
            backward_weight=tuple(r["backward_weight_s"] for r in rows),
            activation_memory=tuple(r["activation_bytes"] for r in rows),
            weight_grad_memory=tuple(min(r["weight_grad_bytes"], r["activation_bytes"])
                                     for r in rows),
            latency=lat, bandwidth=bw,
            message_size=tuple(r["output_bytes"] for r in rows[:-1]),
            memory_limit=tuple(self.memory_limit), static_memory=tuple(static),
            grad_reduce=tuple(reduce), meta=tuple(info.items()), **scales),
            self.overheads, step)

    def microbatch_scales(self, partition: Partition) -> dict[str, Scale]:
        """The :class:`Problem`'s micro-batch factors: as given in ``pipeline:``, or from the
        sequence lengths (:func:`~pipeopt.costs.lengths.problem_scales`, a row per stage of
        ``partition``)."""
        if self.explicit_scales:
            return dict(self.explicit_scales)
        if self.ratios is None:
            return {}
        sd = self.stage_device
        times = {d: self.layer_times(d) for d in set(sd)}
        ref = np.zeros((len(self.layers), 3))
        for k, (a, b) in enumerate(partition):
            ref[a:b] = times[sd[k]][a:b]
        act = np.array([lc.activation_bytes for lc in self.layers])
        return problem_scales(self.ratios, ref, act, stages=list(partition))


def with_overheads(problem: Problem, overheads: Overheads, step_s: Sequence[float]
                   ) -> Problem:
    """``problem`` with the runtime's fixed costs (seconds) priced in: ``overheads.action_s``
    on every F, B and W (once on a fused backward, also on ``meta.fused_backward``, which
    prices the fused schedules of a split problem), ``overheads.message_s`` on the latency of
    every link between two devices, and ``step_s[k]`` (stage k's step tail: the optimizer
    step of its parameters and the step's fixed end) after the stage's last backward, counted
    in the iteration time the way a data-parallel gradient reduction is (``grad_reduce``:
    the two add up, the optimizer stepping once the reduction is done). No overheads: the
    problem unchanged."""
    if not overheads and not any(step_s):
        return problem
    a, p = overheads.action_s, problem.devices
    meta = dict(problem.meta)
    if a and problem.split_backward:
        fused = meta.get("fused_backward")
        if fused is None:  # priced at B + W of the split: one action, not two
            fused = [b + w for b, w in zip(problem.backward_input, problem.backward_weight,
                                           strict=True)]
        meta["fused_backward"] = [float(t) + a for t in fused]
    meta["overheads"] = {"action_s": a, "message_s": overheads.message_s,
                         "step_s": [float(x) for x in step_s]}
    lat = tuple(tuple(x + (overheads.message_s if i != j else 0.0) for j, x in enumerate(row))
                for i, row in enumerate(problem.latency))
    return problem.replace(
        forward=tuple(x + a for x in problem.forward),
        backward_input=tuple(x + a for x in problem.backward_input),
        backward_weight=tuple(x + a if problem.split_backward else x
                              for x in problem.backward_weight),
        latency=lat if overheads.message_s and p > 1 else problem.latency,
        grad_reduce=tuple(r + t for r, t in zip(problem.grad_reduce, step_s, strict=True)),
        meta=tuple(meta.items()))


def with_step_tail(problem: Problem, step_s: Sequence[float], **note: Any) -> Problem:
    """``problem`` with each stage's step tail (seconds after its last backward, see
    :func:`with_overheads`) replaced by ``step_s``: ``grad_reduce`` keeps the data-parallel
    reduction, the tail ``meta.overheads.step_s`` had added is taken back out; ``note`` is
    recorded in ``meta.overheads`` beside it (where the new tail came from)."""
    meta = dict(problem.meta)
    over = dict(meta.get("overheads") or {"action_s": 0.0, "message_s": 0.0})
    old = over.get("step_s") or [0.0] * problem.stages
    red = tuple(max(0.0, r - o) + t
                for r, o, t in zip(problem.grad_reduce, old, step_s, strict=True))
    meta["overheads"] = {**over, "step_s": [float(t) for t in step_s], **note}
    return problem.replace(grad_reduce=red, meta=tuple(meta.items()))


def backward_transient(rows: list[dict[str, Any]], devices: int, memory_scale: Scale
                       ) -> list[float]:
    """Bytes per device to hold on top of the resident activations for the transient of a
    recomputing backward (``backward_transient_bytes`` of ``rows``, :meth:`ModelPlan.
    stage_costs`): the largest over the device's stages and micro-batches (``memory_scale``
    as :class:`Problem` resolves it: ``()``, one factor per micro-batch or a row per stage).

    Counting it as static memory is exact for one stage per device, a fused backward and
    equal micro-batches: the resident peak is reached by a forward and held until the next
    backward ends, and that backward adds its transient. Otherwise it is an upper bound (a W
    may free memory first, or the next backward may be a smaller one).
    """
    out = [0.0] * devices
    for r in rows:
        k, t = r["stage"], r["backward_transient_bytes"]
        if t <= 0:
            continue
        if not memory_scale:
            factor = 1.0
        elif isinstance(memory_scale[0], tuple | list):
            row = memory_scale[k] if len(memory_scale) > 1 else memory_scale[0]
            factor = max(row)  # type: ignore[arg-type]
        else:
            factor = max(memory_scale)  # type: ignore[type-var]
        out[r["device"]] = max(out[r["device"]], t * float(factor))
    return out


#: Most pipeline layers a model may have: real models have a few hundred; the partition
#: search's tables grow with the square of the count.
MAX_LAYERS = 4096
#: Most cells (stages x (layers + 1)^2) the partition DP may tabulate (about 240 MB a table);
#: beyond it the uniform partition is used, with a note.
MAX_DP_CELLS = 30_000_000


def make_plan(cfg: ConfigFile, source: str = "<memory>", *,
              topology: Topology | None = None) -> ModelPlan:
    """Validate the sections of a model/cluster config and collect what the search needs.
    ``topology``: the cluster's, already built from the same ``cluster:`` section (a caller
    that builds many plans of one cluster, such as the planner, shares its path searches)."""
    if cfg.model is None:
        raise ConfigError("model: missing (a cluster: needs a model: to place)")
    mcfg = parse_model(cfg.model)
    ccfg = parse_cluster(cfg.cluster or {})
    tcfg = parse_training(cfg.training or {})
    base = Path(source).parent if source and not source.startswith("<") else None
    layers, origin = model_layers(mcfg, base)
    overheads = model_overheads(mcfg, base)
    pl = cfg.pipeline
    s = pl.devices * pl.virtual_stages
    if len(layers) < s:
        raise ConfigError(f"pipeline.devices: {pl.devices} devices x {pl.virtual_stages} "
                          f"virtual stages need at least {s} layers, the model has "
                          f"{len(layers)}")
    topo = topology if topology is not None else topology_of(ccfg)
    group = mcfg.tensor_parallel if origin == "analytic" else 1
    dp = tcfg.data_parallel
    try:
        placed = topo.place(pl.devices * dp, group)
    except TopologyError as exc:
        where = "training.data_parallel" if dp > 1 else "cluster"
        what = f" ({pl.devices} pipeline ranks x {dp} data-parallel replicas)" if dp > 1 else ""
        raise ConfigError(f"{where}: {exc}{what}") from None
    # Replica i of pipeline rank d sits at placed[i * devices + d]: each replica is a whole
    # pipeline in consecutive slots, and a rank's replicas form its all-reduce ring.
    ranks = placed[:pl.devices]
    replicas = [[placed[i * pl.devices + d] for i in range(dp)] for d in range(pl.devices)]
    tp_links = tp_ring_links(topo, ranks, group, layers)
    try:
        zero_bytes_per_param(tcfg.zero_stage, tcfg.bytes_per_param, dp)
    except ValueError as exc:
        raise ConfigError(f"training.{exc} with training.zero_stage: "
                          f"{tcfg.zero_stage}") from None
    limits, extra = memory_values(cfg.memory, pl.devices)  # checked as in the explicit form
    if cfg.memory.limit is None:
        limits = []
        for g in ranks:
            cap = ccfg.memory_bytes or topo.gpu_models[g].memory_bytes
            limits.append(cap * (1 - ccfg.memory_reserve))
    split, notes = pl.split_backward, []
    short = full_recompute_shortfall(mcfg) if split and origin == "analytic" else None
    if short is not None:
        why = _fused_reason(short)
        if "split_backward" in pl.model_fields_set:
            raise ConfigError(f"pipeline.split_backward: {why}; set split_backward: false (B "
                              "and W fused: nothing deferred) or model.recompute: selective")
        split = False
        notes.append(f"backward fused (split_backward: false): {why}")
    params = total_params(shape_of(mcfg)) if origin == "analytic" else None
    ratios = length_ratios(mcfg, tcfg, pl)
    explicit = microbatch_scales(pl)
    if explicit and ratios is not None:
        raise ConfigError(f"pipeline.{next(iter(explicit))}: cannot be combined with "
                          "training.sequence_lengths (give the lengths or the factors, not both)")
    if tcfg.zero_stage >= 2 and dp > 1 and (explicit or ratios is not None):
        key = (f"pipeline.{next(iter(explicit))}" if explicit
               else "training.sequence_lengths")
        raise ConfigError(f"{key}: cannot be combined with training.zero_stage: "
                          f"{tcfg.zero_stage} (micro-batch factors scale whole ops, but a "
                          "ZeRO-2/3 collective inside them moves the same bytes whatever the "
                          "micro-batch holds)")
    options: tuple[RecomputeOption, ...] = ()
    modes: tuple[str, ...] = ()
    fused_alt = None
    if origin == "analytic" and mcfg.recompute == "per_stage":
        options, modes = recompute_options(mcfg, tcfg, pl), RECOMPUTE_MODES
        full_short = full_recompute_shortfall(mcfg.model_copy(update={"recompute": "full"}))
        if split and full_short is not None:
            # Full recomputation needs a fused backward (docs/model_config.md, "Known
            # simplifications"): this plan keeps the split backward without it; search_plan
            # also searches the fused counterpart and keeps the better.
            modes = tuple(m for m in RECOMPUTE_MODES if m != "full")
            if "split_backward" in pl.model_fields_set:
                notes.append("recompute: per_stage chooses among none and selective only: "
                             "pipeline.split_backward: true was asked, and "
                             + _fused_reason(full_short))
            else:
                fused_alt = _fused_reason(full_short)
    out = ModelPlan(layers=layers, source=origin, topology=topo, rank_gpus=ranks,
                     devices=pl.devices, microbatches=pl.microbatches,
                     virtual_stages=pl.virtual_stages, placement=pl.placement,
                     split_backward=split, dtype=mcfg.dtype,
                     efficiency=ccfg.compute_efficiency, peak_override=ccfg.peak_flops,
                     memory_limit=limits, extra_static=extra, training=tcfg,
                     model_params=params, replica_gpus=replicas, group=group, ratios=ratios,
                     micro_batch_size=mcfg.micro_batch_size if origin == "analytic" else None,
                     notes=tuple(notes),
                     explicit_scales=explicit or None,
                     recompute=mcfg.recompute if origin == "analytic" else None,
                     recompute_options=options, recompute_modes=modes,
                     fused_alternative=fused_alt, tp_links=tp_links,
                     overheads=overheads)
    if mcfg.moe is not None:
        out = _with_moe(out, mcfg, mcfg.moe, tcfg, origin)
    if tcfg.zero_stage >= 2 and dp > 1:
        # The rings of every micro-batch's collectives, their paths chosen for the largest
        # layer's weight shard (one ring step of its gather).
        chunk = max((lc.params for lc in out.layers), default=0.0) * WEIGHT_BYTES / dp
        worst = out.dp_ring_links([chunk] * pl.devices)
        out = replace(out, dp_links=tuple((x.latency, x.bandwidth) for x in worst))
    return out


def _with_moe(plan: ModelPlan, mcfg: ModelConfig, moe: MoESection, tcfg: TrainingConfig,
              origin: str) -> ModelPlan:
    """``plan`` with ``model.moe``'s MoE blocks (:func:`pipeopt.costs.moe_chain.moe_layers`:
    their layers, the routed experts' parameters, the all-to-all in F and B); ConfigError
    naming the key for what the MoE cost model does not cover."""
    refused = [
        (origin != "analytic", "model.moe", "needs a transformer shape (not layer_costs or a "
         "profile)"),
        (bool(mcfg.overrides), "model.overrides", "not with model.moe (every MoE block is "
         "priced alike)"),
        (tcfg.sequence_lengths is not None, "training.sequence_lengths", "not with model.moe "
         "(every micro-batch is priced at model.seq_len)"),
    ]
    for bad, key, why in refused:
        if bad:
            raise ConfigError(f"{key}: {why}")
    replicas = plan.replica_gpus or [[g] for g in plan.rank_gpus]
    try:
        spec = MoESpec(**moe.model_dump())
        priced = moe_layers(plan.layers, shape_of(mcfg), spec, plan.topology, replicas)
        # recompute: per_stage: every mode's layers with its MoE blocks (full recomputation
        # replays the forward's all-to-all in B).
        options = []
        for o in plan.recompute_options:
            mode = moe_layers(o.layers, replace(shape_of(mcfg), recompute=o.mode), spec,
                              plan.topology, replicas)
            options.append(replace(o, layers=mode.layers, a2a_times=mode.a2a_times))
    except ValueError as exc:
        text = str(exc)
        if text.startswith("expert_parallel: must divide the data"):
            text = text.replace("the data-parallel size", "training.data_parallel")
        raise ConfigError(f"model.moe.{text}") from None
    # The tensor-parallel rings' paths are chosen for the largest buffer, now the MoE
    # blocks' all-gather of the dispatched copies.
    return replace(plan, layers=list(priced.layers), expert_params=priced.expert_params,
                   expert_parallel=spec.expert_parallel, a2a_times=priced.a2a_times,
                   model_params=priced.model_params, recompute_options=tuple(options),
                   tp_links=tp_ring_links(plan.topology, plan.rank_gpus, plan.group,
                                          list(priced.layers)))


def tp_ring_links(topo: Topology, ranks: list[int], group: int, layers: list[LayerCost]
                  ) -> tuple[tuple[float, float], ...]:
    """Per pipeline rank (its first GPU in ``ranks``), the slowest hop (latency s, bandwidth
    bytes/s) of the ring over its ``group`` consecutive GPUs, each hop on the path fastest
    for the layers' largest tensor-parallel buffer (:meth:`Topology.link`); () with
    ``group`` 1. A ring within a node of NVLink GPUs has NVLink hops (through NVSwitch, each
    pair of GPUs its own link, so the tensor-parallel groups of a node share none)."""
    if group == 1:
        return ()
    nbytes = max((n for lc in layers for _, _, n in lc.tp_collectives), default=0.0)
    out = []
    for g0 in ranks:
        hops = [topo.link(g0 + j, g0 + (j + 1) % group, nbytes) for j in range(group)]
        out.append((max(h[0] for h in hops), min(h[1] for h in hops)))
    return tuple(out)


def _fused_reason(short: tuple[int, float, float]) -> str:
    """Why a block with full recomputation cannot defer its W (from
    :func:`full_recompute_shortfall`)."""
    block, held, kept = short
    return (f"with recompute: full a deferred W holds what its B recomputed (block{block}: "
            f"{held:.4g} bytes per micro-batch, the linear layers' inputs and output "
            f"gradients) while the forward kept {kept:.4g} bytes; the schedule's memory "
            "model (W keeps part of what F allocated) cannot count the difference")


def recompute_options(mcfg: ModelConfig, tcfg: TrainingConfig,
                      pl: Any) -> tuple[RecomputeOption, ...]:
    """The layers (and micro-batch ratios) of a transformer ``model:`` under each of
    :data:`RECOMPUTE_MODES` (blocks whose override sets ``recompute`` keep theirs)."""
    out = []
    for mode in RECOMPUTE_MODES:
        cfg = mcfg.model_copy(update={"recompute": mode})
        out.append(RecomputeOption(
            mode, tuple(_transformer_layers(shape_of(cfg), block_overrides(cfg))),
            length_ratios(cfg, tcfg, pl)))
    return tuple(out)


def full_recompute_shortfall(mcfg: ModelConfig) -> tuple[int, float, float] | None:
    """The first block with full recomputation whose deferred W would hold more than its
    forward kept: (block index, bytes W needs, bytes F kept), per micro-batch on one
    tensor-parallel rank; None when no block has it (the problem's memory model, where W keeps
    part of F's allocation, is then exact). An MoE block (``model.moe``) holds its parts'
    weight-gradient factors without recomputation (:func:`pipeopt.costs.moe_chain.moe_layer`)."""
    shape, overrides = shape_of(mcfg), block_overrides(mcfg)
    try:  # an invalid model.moe is reported by _with_moe, naming its key
        spec = None if mcfg.moe is None else MoESpec(**mcfg.moe.model_dump())
    except ValueError:
        spec = None
    for i in range(shape.layers):
        change = {k: v for k, v in overrides.get(i, {}).items() if k != "time_scale"}
        sh = replace(shape, **change) if change else shape
        if sh.recompute != "full":
            continue
        held, kept = block_weight_grad_held_bytes(sh), block_activation_bytes(sh)
        if spec is not None and spec.is_moe(i):
            held = moe_layer(replace(sh, recompute="none"), spec, "moe")[0].weight_grad_bytes
        if held > kept:
            return i, held, kept
    return None


def length_ratios(mcfg: ModelConfig, tcfg: TrainingConfig, pl: Any) -> MicrobatchRatios | None:
    """Per micro-batch cost ratios of ``training.sequence_lengths`` against the configured
    micro-batch (``model.micro_batch_size`` sequences of ``model.seq_len`` tokens); None when
    no lengths are given."""
    spec = tcfg.sequence_lengths
    if spec is None:
        return None
    if mcfg.layers is None or mcfg.profile is not None or mcfg.layer_costs is not None:
        raise ConfigError("training.sequence_lengths: needs a transformer model (model.preset "
                          "or its shape) to price each length; with layer_costs or a profile "
                          "give pipeline.microbatch_scale instead")
    m = pl.microbatches
    if isinstance(spec, list) and len(spec) != m:
        raise ConfigError(f"training.sequence_lengths: expected {m} values "
                          f"(pipeline.microbatches), got {len(spec)}")
    shape = shape_of(mcfg)
    mbs = microbatch_tokens(spec, m, shape.seq_len, shape.micro_batch_size)
    return microbatch_ratios(split_layers(shape, block_overrides(mcfg)), mbs,
                             MicrobatchTokens.padded(shape.seq_len, shape.micro_batch_size))


def _fitting(part: Partition, costs: ChainCosts, what: str) -> Partition:
    """``part`` if it fits ``costs``' memory limits, else :class:`PartitionError` naming the
    device furthest over, its stages and bytes."""
    ev = evaluate(costs, part)
    if ev.fits:
        return part
    worst = max(range(len(ev.device_memory)),
                key=lambda d: ev.device_memory[d] - costs.device_limit[d])
    over = ev.device_memory[worst] - costs.device_limit[worst]
    held = [k for k, d in enumerate(costs.stage_device) if d == worst]
    names = ", ".join(f"stage {k} (layers {part[k][0]}..{part[k][1] - 1})" for k in held)
    raise PartitionError(f"the {what} partition does not fit: device {worst}, holding {names}, "
                         f"needs {ev.device_memory[worst]:.4g} bytes, {over:.4g} bytes over its "
                         f"limit of {costs.device_limit[worst]:.4g} bytes")


def _check_transient(plan: ModelPlan) -> None:
    """Refuse, with the figures, a plan whose recomputing backward alone (one block's
    recomputed activations, :meth:`ModelPlan.transient_reserve`) exceeds what a device's memory
    limit leaves after ``memory.static``: no partition could fit, and the search would report
    a negative limit."""
    reserve = plan.transient_reserve()
    if reserve <= 0:
        return
    for d, (lim, extra) in enumerate(zip(plan.memory_limit, plan.extra_static, strict=True)):
        if lim is not None and lim - extra < reserve:
            raise ConfigError(
                f"memory: with recompute: {plan.recompute} a block's backward first rebuilds "
                f"its activations, {_gib(reserve)} GiB per micro-batch held while it runs, more "
                f"than the {_gib(lim - extra)} GiB device {d} has (memory limit less "
                "memory.static); nothing else would fit beside it. With standard attention "
                "that is the s x s attention scores: set model.flash_attention: true if the "
                "model runs FlashAttention, or raise tensor_parallel, or shorten seq_len")


def search_partition(plan: ModelPlan) -> tuple[Partition, dict[str, Any]]:
    """Run the partition search the ``training:`` section asks for; returns the partition and
    a JSON-able report (method, objective values, wall time, the uniform baseline)."""
    from pipeopt.partition.dp import best_partition

    tc = plan.training
    _check_transient(plan)
    costs = plan.chain_costs()
    t0 = time.perf_counter()
    uniform = plan.uniform()
    report: dict[str, Any] = {"method": tc.partition, "objective": tc.partition_objective}

    def search(costs: ChainCosts) -> tuple[Partition, tuple[int, ...] | None]:
        """The partition and, when the search fixed them, each stage's mode (else None:
        the fastest modes that fit, :func:`pipeopt.partition.choose_modes`)."""
        if tc.stage_layers is not None:
            if len(tc.stage_layers) != plan.stages:
                raise ConfigError(f"training.stage_layers: expected {plan.stages} values (one "
                                  f"per stage), got {len(tc.stage_layers)}")
            if sum(tc.stage_layers) != len(plan.layers):
                raise ConfigError(f"training.stage_layers: must add up to the model's "
                                  f"{len(plan.layers)} layers, got {sum(tc.stage_layers)}")
            report["method"] = "explicit"
            return _fitting(from_counts(tc.stage_layers), costs, "explicit"), None
        if tc.partition == "uniform":
            return _fitting(uniform, costs, "uniform"), None
        cells = plan.stages * (len(plan.layers) + 1) ** 2
        if cells > MAX_DP_CELLS:  # too large to tabulate: the uniform split, said so
            report["method"] = "uniform"
            report["note"] = (f"{plan.stages} stages x {len(plan.layers)} layers is too large "
                              f"for the {tc.partition} search ({cells:,} cells > "
                              f"{MAX_DP_CELLS:,}); the uniform partition is used")
            return _fitting(uniform, costs, "uniform"), None
        if tc.partition == "ilp" or (tc.partition == "dp" and plan.virtual_stages > 1):
            from pipeopt.partition.ilp import ilp_partition, per_device_partition

            if tc.partition == "ilp":
                found, how = ilp_partition(costs, tc.partition_objective,
                                           time_limit=tc.ilp_time_limit), "ilp"
            else:  # devices hold several stages: memory is per device
                found, how = per_device_partition(costs, tc.partition_objective,
                                                  time_limit=tc.ilp_time_limit)
            report["method"] = how
            report["exact"] = found.exact
            return found.partition, None
        if tc.partition == "joint":
            return _joint(plan, costs, uniform, report)
        return best_partition(costs, tc.partition_objective).partition, None

    try:
        part, modes = search(costs)
    except PartitionError as exc:
        # The in-flight counts assumed (1F1B's, or GPipe's) fit no partition. A memory-aware
        # method (greedy, cpsat, auto) can keep fewer micro-batches in flight, down to one at
        # a time: search again on that, and refuse only if even that cannot fit.
        lean = replace(costs, inflight=np.ones_like(costs.inflight))
        try:
            part, modes = search(lean)
        except PartitionError as exc1:
            if str(exc1) == str(exc):
                raise ConfigError(f"memory: {exc} (and so with any number of micro-batches in "
                                  "flight)") from None
            raise ConfigError(f"memory: {exc}; even with one micro-batch in flight per stage "
                              f"(the least any schedule needs): {exc1}") from None
        costs = lean
        report["inflight_fallback"] = (
            f"{tc.inflight} in-flight counts fit no partition ({exc}); partitioned for one "
            "micro-batch in flight per stage: a memory-aware method (greedy, cpsat, auto) must "
            "keep fewer in flight")
    ev = evaluate(costs, part, modes)
    uev = evaluate(costs, uniform)
    if ev.modes:
        report["recompute"] = list(ev.modes)
        report["uniform_recompute"] = list(uev.modes)
    report.update({"wall_time_s": time.perf_counter() - t0,
                   "analytic_objective_s": ev.objective, "max_stage_time_s": ev.max_time,
                   "uniform_stage_layers": [b - a for a, b in uniform],
                   "uniform_analytic_objective_s": uev.objective, "uniform_fits": uev.fits})
    return part, report


def _joint(plan: ModelPlan, costs: ChainCosts, uniform: Partition, report: dict[str, Any]
           ) -> tuple[Partition, tuple[int, ...] | None]:
    """``training.partition: joint``: schedule the top-k partitions and the uniform one and
    keep the fastest; with per-stage modes, each stage in its fastest fitting mode, and
    besides, the top-k and uniform partitions of every mode used on all stages (what the
    joint search of that uniform recomputation schedules), so the per-stage result is never
    slower than a uniform one's with the same scheduler. Records every candidate in
    ``report['candidates']``; returns the winner and its modes (None: the fastest fitting)."""
    from pipeopt.partition.joint import JointRow, joint_search

    tc = plan.training
    groups: list[tuple[tuple[int, ...] | None, ChainCosts]] = [(None, costs)]
    if costs.mode_names:
        groups += [((m,) * costs.stages, costs.only(m)) for m in range(costs.modes)]
    rows: list[tuple[JointRow, tuple[int, ...] | None]] = []
    scheduler = ""
    for fixed, group_costs in groups:
        def build(part: Partition, fixed: tuple[int, ...] | None = fixed) -> Problem:
            modes = fixed if fixed is not None else costs.mode_indices(
                evaluate(costs, part).modes)
            names = [costs.mode_names[m] for m in modes] if costs.mode_names else None
            return plan.problem(part, recompute=names)

        try:
            res = joint_search(group_costs, build, top_k=tc.top_k,
                               objective=tc.partition_objective, method=tc.joint_method,
                               time_limit=tc.joint_time_limit, extra=[uniform])
        except PartitionError:
            if fixed is None:  # every mode allowed per stage: nothing fits at all
                raise
            continue  # this mode on every stage fits nothing (or schedules nothing)
        scheduler = res.method
        rows.extend((r, fixed) for r in res.rows)
    report["scheduler"] = scheduler
    report["candidates"] = []
    for r, fixed in rows:
        row = {"stage_layers": [b - a for a, b in r.partition], "analytic_s": r.analytic,
               "iteration_time_s": None if r.schedule is None else r.schedule.iteration_time,
               "uniform": r.partition == uniform, "error": r.error}
        if costs.mode_names:
            modes = fixed or costs.mode_indices(evaluate(costs, r.partition).modes)
            row["recompute"] = [costs.mode_names[m] for m in modes]
            row["uniform_recompute"] = fixed is not None
        report["candidates"].append(row)
    best, fixed = min(((r, f) for r, f in rows if r.schedule is not None),
                      key=lambda x: x[0].value)
    return best.partition, fixed


def search_plan(plan: ModelPlan) -> tuple[ModelPlan, Partition, dict[str, Any]]:
    """:func:`search_partition`, and with ``recompute: per_stage`` on a split backward, also
    on :meth:`ModelPlan.fused_world` (full recomputation allowed, backward fused); returns the
    plan of the world kept, its partition and report (``recompute``: each stage's mode;
    ``recompute_worlds``: both searches).

    The fused world is kept only when its partition uses ``full`` somewhere (else the split
    backward, with the same modes, admits every schedule it does) and its schedule is
    faster: with ``training.partition: joint`` the best of each world's scheduled
    candidates; otherwise both worlds' partitions are scheduled here by
    ``training.joint_method`` for ``training.joint_time_limit`` seconds each, since the
    analytic objective sees neither what a split backward gains in a zero-bubble schedule
    nor what keeping one micro-batch in flight (``inflight_fallback``) costs. Ties keep the
    split backward."""
    fused = plan.fused_world()
    if fused is None:
        part, report = search_partition(plan)
        return plan, part, report
    tried: list[tuple[ModelPlan, tuple[Partition, dict[str, Any]] | None, str]] = []
    for world in (plan, fused):
        try:
            tried.append((world, search_partition(world), ""))
        except ConfigError as exc:
            tried.append((world, None, str(exc)))
    found = [(world, *res) for world, res, _ in tried if res is not None]
    if not found:  # the fused world allows every mode: its reason is the binding one
        raise ConfigError(tried[1][2])
    value: dict[int, float] = {}
    contest = len(found) == 2 and "full" in found[1][2].get("recompute", [])
    for i, (world, part, rep) in enumerate(found):
        times = [c["iteration_time_s"] for c in rep.get("candidates", [])
                 if c["iteration_time_s"] is not None]
        if times:
            value[i] = min(times)
        elif contest:
            value[i] = _scheduled(world, part, rep)
    # One world, or a fused one without full: the first (split when both fit).
    best = 1 if contest and value[1] < value[0] else 0
    worlds = []
    for world, res, err in tried:
        row: dict[str, Any] = {"split_backward": world.split_backward,
                               "modes": list(world.recompute_modes)}
        if res is None:
            row["error"] = err
        else:
            i = next(j for j, f in enumerate(found) if f[0] is world)
            row.update({"recompute": res[1].get("recompute"),
                        "analytic_objective_s": res[1]["analytic_objective_s"],
                        "iteration_time_s": value.get(i),
                        "inflight_fallback": "inflight_fallback" in res[1],
                        "kept": i == best})
        worlds.append(row)
    world, part, rep = found[best]
    return world, part, {**rep, "recompute_worlds": worlds}


def _scheduled(plan: ModelPlan, part: Partition, rep: dict[str, Any]) -> float:
    """Iteration time (seconds) of ``part``'s problem scheduled by ``training.joint_method``
    within ``training.joint_time_limit``; inf when it cannot be scheduled."""
    from pipeopt.partition.joint import default_method, schedule_with
    from pipeopt.schedules import NotApplicable
    from pipeopt.solvers import UnknownMethod

    tc = plan.training
    try:
        problem = plan.problem(part, None, rep.get("recompute"))
        sched = schedule_with(problem, tc.joint_method or default_method(),
                              tc.joint_time_limit)
    except (NotApplicable, UnknownMethod, ProblemError):
        return math.inf
    return sched.iteration_time


def build_from_model(cfg: ConfigFile, data: dict[str, Any], source: str) -> Config:
    """The :class:`Config` of a model/cluster config: search the partition and build the
    problem (its ``meta`` holds the partition and per-stage costs)."""
    if cfg.stages is not None:
        raise ConfigError("stages: cannot be combined with model:/cluster: (give per-stage "
                          "costs or a model, not both)")
    if "links" in data:
        raise ConfigError("links: not used with cluster: (the topology gives the links); "
                          "remove it or set cluster.tiers")
    plan, part, report = search_plan(make_plan(cfg, source))
    try:
        problem = plan.problem(part, {"partition_search": report}, report.get("recompute"))
    except ProblemError as exc:
        raise ConfigError(f"model: {exc}") from None
    check_totals(problem, "model")
    meta = dict(problem.meta)
    # The pipeline leaves the chunking to the planner: auto may cut the model into v = 2.
    open_ = not {"virtual_stages", "placement"} & cfg.pipeline.model_fields_set
    extras = (("partition", meta["partition"]), ("layer_names", meta["layer_names"]),
              ("stage_costs", meta["stage_costs"]), ("partition_search", report),
              ("devices", meta["devices"]), ("plan", plan), ("chunks_open", open_))
    return Config(problem=problem, solver=cfg.solver, source=source, extras=extras)


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:.1f}"


def _recompute_line(rep: dict[str, Any], split: bool) -> str:
    """One line on the per-stage recompute search: the modes chosen, the backward, and what
    the other backward world gave (see :func:`search_plan`)."""
    modes = rep["recompute"]
    counts = ", ".join(f"{m} x{modes.count(m)}" for m in RECOMPUTE_MODES if m in modes)
    line = (f"recompute per stage: {counts}; backward "
            f"{'split' if split else 'fused'}")
    worlds = rep.get("recompute_worlds", [])
    for w in worlds:
        what = ("split backward (none / selective)" if w["split_backward"]
                else "fused backward (full allowed)")
        if "error" in w:
            line += f"; {what}: nothing fits"
            continue
        figure = (f"{w['iteration_time_s']:.6g} s scheduled" if w["iteration_time_s"]
                  is not None else f"{w['analytic_objective_s']:.6g} s analytic")
        line += (f"; {what}{' (kept)' if w['kept'] else ''}: {figure}"
                 f"{', one micro-batch in flight' if w['inflight_fallback'] else ''}")
    return line


def describe_partition(config: Config) -> str:
    """A table of the partition of a model/cluster config ("" for an explicit config)."""
    meta = dict(config.problem.meta)
    rows = meta.get("stage_costs")
    if not rows:
        return ""
    names = meta.get("layer_names", [])
    devs = meta.get("devices", [])
    rep = meta.get("partition_search") or {}
    per_stage = bool(rep.get("recompute"))  # recompute: per_stage chose each stage's mode
    lines = [f"{'stage':>5} {'dev':>3} {'gpu':<16} {'layers':<26} {'F ms':>8} {'B ms':>8} "
             f"{'W ms':>8} {'act GiB':>8} {'static GiB':>10} {'est GiB':>8} {'limit':>6}"
             + (f" {'recompute':<9}" if per_stage else "")]
    for r in rows:
        a, b = r["layers"]
        span = f"{b - a:>3}: {names[a] if names else a}..{names[b - 1] if names else b - 1}"
        dev = devs[r["device"]] if r["device"] < len(devs) else {}
        lines.append(
            f"{r['stage']:>5} {r['device']:>3} {dev.get('gpu', '-'):<16} {span:<26} "
            f"{r['forward_s'] * 1e3:>8.2f} {r['backward_input_s'] * 1e3:>8.2f} "
            f"{r['backward_weight_s'] * 1e3:>8.2f} {_gib(r['activation_bytes']):>8} "
            f"{_gib(r['static_bytes']):>10} {_gib(r['memory_estimate_bytes']):>8} "
            f"{_gib(dev.get('memory_limit')):>6}"
            + (f" {r.get('recompute', '-'):<9}" if per_stage else ""))
    if per_stage:
        lines.append(_recompute_line(rep, config.problem.split_backward))
    if rep:
        proven = " (ILP time limit reached: not proven optimal)" \
            if rep.get("exact") is False else ""
        if rep.get("note"):
            lines.append(f"note: {rep['note']}")
        for note in meta.get("notes", []):
            lines.append(f"note: {note}")
        if rep.get("inflight_fallback"):
            lines.append("note: no partition fits with the assumed in-flight micro-batches; "
                         "partitioned for one in flight per stage (the 'est' column assumes "
                         "the former): use a memory-aware method (auto, greedy, cpsat)")
        mbc = meta.get("microbatch_costs")
        if mbc:
            prob = config.problem
            lines.append(
                f"micro-batches: {len(mbc['tokens'])} of {min(mbc['tokens']):g}.."
                f"{max(mbc['tokens']):g} tokens (training.sequence_lengths): time x"
                f"{min(map(min, prob.time_table)):.2f}..{max(map(max, prob.time_table)):.2f}"
                f", memory x{min(map(min, prob.memory_table)):.2f}.."
                f"{max(map(max, prob.memory_table)):.2f}; the partition "
                "is searched for the average micro-batch")
        rings = meta.get("grad_reduce_rings")
        if rings:
            slow = min(rings, key=lambda x: math.inf if x["bandwidth"] is None
                       else x["bandwidth"])
            if slow["bandwidth"] is not None:
                lines.append(
                    f"gradient all-reduce: {len(rings) * slow['rings']} concurrent rings; the "
                    f"slowest (device {slow['device']}) gets {slow['bandwidth'] / 1e9:.4g} GB/s "
                    f"on {slow['link']}, shared by {slow['shared_by']} flows")
        lines.append(f"partition: {rep.get('method')} ({rep.get('objective')}){proven}, "
                     f"{len(rows)} stages, analytic {rep.get('analytic_objective_s', 0):.4g} s vs "
                     f"uniform {rep.get('uniform_analytic_objective_s', 0):.4g} s"
                     f"{'' if rep.get('uniform_fits', True) else ' (over the memory limit)'}; "
                     f"cross-datacenter cuts {meta.get('cross_datacenter_cuts', 0)}")
    return "\n".join(lines)
