"""Mixture-of-experts blocks as layers of the model form's chain (``model.moe``,
docs/model_config.md), what ``pipeopt plan`` prices for an MoE candidate (docs/plan.md, "MoE
models").

The transformer's pipeline layers (per GPU of a pipeline rank; with tensor parallelism t the
experts are split over the same t GPUs, :mod:`pipeopt.costs.moe`, "Tensor parallelism") have
each MoE block (``MoESpec.is_moe``) replaced by one layer whose costs are
:func:`pipeopt.costs.moe.block_cost`'s attention + router, routed experts and shared experts
summed, its tensor-parallel collectives :func:`pipeopt.costs.moe.tp_collectives` (timed on the
rank's tensor-parallel ring as a dense block's):

* compute: the routed experts of one rank process ``c·k·T`` token copies per micro-batch
  (``k·T`` dropless): :func:`pipeopt.costs.moe.routed_tokens`;
* parameters: the rank stores the attention, the router, the shared experts and ``E / ep``
  routed experts; the routed experts' share is kept apart (``ModelPlan.expert_params``)
  because its replicas are ``dp / ep``, not ``dp``: ZeRO shards their optimizer state over
  ``dp / ep`` ranks and their gradient all-reduce runs over ``dp / ep`` replicas;
* communication: a dispatch and a combine all-to-all in the block's forward, and their two
  gradients in its input-gradient backward (mirrored as :mod:`pipeopt.workloads.moe` does;
  under full recomputation the backward runs the forward's two again first),
  each :func:`pipeopt.costs.collectives.all_to_all_time` of a GPU's buffer (the rank's / t)
  over the ``ep`` GPUs of its expert-parallel group, added to the layer's F and B (not
  scheduled as tasks of their own: the chain problem has no network resources, so they never
  overlap compute here).

Expert parallelism is carved out of data parallelism, as Megatron-Core
(``expert_model_parallel_size`` divides the data-parallel size, before its "parallel folding"
let EP span the tensor-parallel ranks too; the rest is the expert-data-parallel group) and
DeepSpeed-MoE (``ep_size`` divides the data-parallel world; its expert-data-parallel groups)
do: ``ep`` divides DP and the experts count, and an EP group of a pipeline rank's GPU
is that GPU in ``ep`` consecutive data-parallel replicas of the rank (with t > 1 a rank has t
such groups side by side, one per tensor-parallel index). Its link: every EP group of every
pipeline rank runs its all-to-all at once; each is timed on the slowest hop of a ring over its
GPUs, the hops of all groups sharing the links they cross
(:meth:`pipeopt.topology.Topology.ring_links`): within a node NVLink, across nodes a NIC's
share, at which a group spanning nodes then sends all its bytes, though part of them stays
on NVLink (pessimistic). Times in seconds, memory in bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from pipeopt.costs import transformer as tf
from pipeopt.costs.collectives import all_to_all_time
from pipeopt.costs.moe import (
    MoESpec,
    attention_flops,
    block_cost,
    expert_flops,
    gate_flops,
    model_params,
    shared_flops,
    tp_collectives,
)
from pipeopt.costs.transformer import LayerCost, TransformerShape
from pipeopt.topology import Topology


def moe_layer(shape: TransformerShape, spec: MoESpec, name: str) -> tuple[LayerCost, float]:
    """One MoE block as a chain layer on one GPU of an EP rank: (the layer, the parameters of
    its routed experts on the GPU). FLOPs, parameters and activations are the sums of
    :func:`pipeopt.costs.moe.block_cost`'s parts, its tensor-parallel collectives
    :func:`pipeopt.costs.moe.tp_collectives`; the recomputing backward's transient is what
    its recomputation rebuilds: the block's activations without recomputation less those
    kept (selective: the attention core; full: all but the block input)."""
    cost = block_cost(shape, spec, name)
    parts = [p for p in (cost.attention, cost.experts, cost.shared) if p is not None]
    whole = block_cost(replace(shape, recompute="none"), spec, name)
    kept_none = sum(p.activation_bytes for p in (whole.attention, whole.experts, whole.shared)
                    if p is not None)
    layer = LayerCost(
        name=name,
        forward_flops=sum(p.forward_flops for p in parts),
        backward_input_flops=sum(p.backward_input_flops for p in parts),
        backward_weight_flops=sum(p.backward_weight_flops for p in parts),
        params=cost.params,
        activation_bytes=sum(p.activation_bytes for p in parts),
        weight_grad_bytes=sum(p.weight_grad_bytes for p in parts),
        output_bytes=tf.message_bytes(shape),
        backward_transient_bytes=kept_none - sum(p.activation_bytes for p in parts),
        tp_collectives=tp_collectives(shape, spec))
    return layer, cost.experts.params


def ep_groups(replicas: Sequence[Sequence[int]], ep: int, group: int = 1
              ) -> list[list[list[int]]]:
    """Per pipeline rank (its data-parallel replicas' first GPUs in ``replicas``, its own
    first), its EP groups: for each of its ``group`` tensor-parallel GPUs (GPU ``g + j`` of a
    replica starting at ``g``), ``ep`` consecutive replicas' each."""
    return [[[g + j for g in reps[i:i + ep]] for j in range(group)
             for i in range(0, len(reps), ep)] for reps in replicas]


def ep_links(topology: Topology, replicas: Sequence[Sequence[int]], ep: int, nbytes: float,
             group: int = 1) -> list[tuple[float, float]]:
    """Per pipeline rank, (latency s, bandwidth bytes/s) of its slowest EP group's slowest hop
    when every group's all-to-all runs at once (see the module docstring); ``nbytes``: a
    GPU's all-to-all buffer (a ring step carries ``nbytes / ep`` and chooses the paths);
    ``group``: GPUs per pipeline rank (tensor parallelism), each in an EP group of its own."""
    groups = ep_groups(replicas, ep, group)
    rings = [(g, nbytes / ep) for mine in groups for g in mine]
    links = topology.ring_links(rings)
    out, i = [], 0
    for mine in groups:
        worst = min(links[i:i + len(mine)], key=lambda x: (x.bandwidth, -x.latency))
        out.append((worst.latency, worst.bandwidth))
        i += len(mine)
    return out


@dataclass(frozen=True)
class MoELayers:
    """What MoE blocks change in a transformer's pipeline layers (embedding, blocks, head):
    the ``layers`` (MoE blocks replaced by :func:`moe_layer`), per layer the parameters of
    the routed experts a rank stores (``expert_params``), per pipeline rank the (L, 3)
    seconds of each layer's all-to-all in F, B, W (``a2a_times``, () with EP 1), and the
    model's total parameters (``model_params``)."""

    layers: tuple[LayerCost, ...]
    expert_params: tuple[float, ...]
    a2a_times: tuple[np.ndarray, ...]
    model_params: float


def moe_layers(layers: Sequence[LayerCost], shape: TransformerShape, spec: MoESpec,
               topology: Topology, replicas: Sequence[Sequence[int]]) -> MoELayers:
    """The :class:`MoELayers` of a transformer's dense pipeline ``layers`` (of ``shape``, its
    ``tensor_parallel`` GPUs per pipeline rank) with ``spec``'s MoE blocks, EP size
    ``spec.expert_parallel``; ``replicas``: per pipeline rank the first GPUs of its
    data-parallel replicas. Raises ValueError (its message starts with the field) when EP
    does not divide the replicas or when ``layers`` are not the shape's."""
    ep = spec.expert_parallel
    dp = len(replicas[0]) if replicas else 1
    if dp % ep:
        raise ValueError(f"expert_parallel: must divide the data-parallel size ({dp}: expert "
                         f"parallelism is carved out of data parallelism), got {ep}")
    names = [lc.name for lc in layers]
    if len(names) != shape.layers + 2 or names[0] != "embedding" or names[-1] != "head":
        raise ValueError("layers: MoE blocks need the transformer's embedding, blocks and head")
    out = list(layers)
    experts = [0.0] * len(out)
    layer, routed = moe_layer(shape, spec, "moe")  # every MoE block has the same shape
    for i in range(shape.layers):
        if spec.is_moe(i):
            out[i + 1] = replace(layer, name=f"block{i}")
            experts[i + 1] = routed
    times: tuple[np.ndarray, ...] = ()
    if ep > 1:
        cost = block_cost(shape, spec)
        tp = shape.tensor_parallel  # each GPU of a rank sends 1/tp of the rank's buffers
        d_b, c_b = cost.dispatch_bytes / tp, cost.combine_bytes / tp
        rows = []
        for lat, bw in ep_links(topology, replicas, ep, max(d_b, c_b), tp):
            a2a = all_to_all_time(ep, d_b, lat, bw) + all_to_all_time(ep, c_b, lat, bw)
            replay = 2.0 if shape.recompute == "full" else 1.0  # B runs F's again
            t = np.zeros((len(out), 3))
            for i in range(shape.layers):
                if spec.is_moe(i):
                    # F: dispatch + combine; B: their gradients (and F's again under full
                    # recomputation)
                    t[i + 1, 0], t[i + 1, 1] = a2a, replay * a2a
            rows.append(t)
        times = tuple(rows)
    total, _ = model_params(shape, spec)
    return MoELayers(tuple(out), tuple(experts), times, total)


def moe_model_flops(shape: TransformerShape, spec: MoESpec, microbatches: int = 1) -> float:
    """Forward + backward FLOPs of one replica's step (3 x the forward, no recomputation; the
    count of :func:`pipeopt.costs.transformer.model_flops_per_iteration` for MFU) with each
    token's ``top_k`` routed experts dropless: the useful work, not a capacity's padding."""
    dense = replace(spec, capacity_factor=None)
    lin, att = tf.block_flops(shape)
    fwd = tf.head_flops(shape)
    for i in range(shape.layers):
        if spec.is_moe(i):
            a_lin, a_att = attention_flops(shape)
            fwd += (a_lin + a_att + gate_flops(shape, dense) + expert_flops(shape, dense)
                    + shared_flops(shape, dense))
        else:
            fwd += lin + att
    return 3.0 * fwd * microbatches
