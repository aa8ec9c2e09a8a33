"""ZeRO data parallelism (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC'20) in a pipeline: bytes per parameter on a GPU and the
collectives each stage adds, per micro-batch and per step (bytes, seconds).

Memory (the paper's section 5 and figure 1, with Psi parameters on a rank, N_d data-parallel
replicas and K bytes of optimizer state per parameter; ``total`` = 2 + 2 + K, 16 for
mixed-precision Adam):

* stage 0 (plain data parallelism): ``total`` bytes per parameter;
* stage 1 (P_os, optimizer state sharded): ``2 + 2 + K / N_d``;
* stage 2 (P_os+g, gradients sharded too): ``2 + (2 + K) / N_d``;
* stage 3 (P_os+g+p, parameters sharded too): ``(2 + 2 + K) / N_d``.

Communication over the rank's data-parallel ring (alpha-beta ring collectives,
:mod:`pipeopt.costs.collectives`; ``P`` the parameters of a layer on this rank, i.e. of its
tensor-parallel shard):

* stages 0 and 1: one gradient all-reduce per stage after its last backward (ZeRO-1's
  reduce-scatter and parameter all-gather move the same bytes; the paper's section 7.2.1).
* stage 2: a rank keeps only its shard of the gradients, so each micro-batch's gradients are
  reduce-scattered as its backward produces them ("gradient reduction is required after every
  backward because of gradient partitioning", DeepSpeed, issue deepspeedai/DeepSpeed#2252):
  a reduce-scatter of ``P x grad bytes`` in every W (every fused backward); after the step,
  an all-gather of the updated 16-bit weights of the stage. With one micro-batch this is
  the all-reduce's volume (section 7.2.1); with m micro-batches the gradient traffic is
  m times the reduce-scatter.
* stage 3: the weights are gathered before each use and dropped after it: an all-gather of
  ``P x 2`` bytes in every F and again in every B (the weights are needed for the input
  gradient), and the gradients reduce-scattered in every W; nothing after the step. With
  one micro-batch: 1.5 times the all-reduce's volume (section 7.2.2).

The collectives are counted inside the ops that need them, not overlapped with compute: an
upper bound on what prefetching and overlapping (DeepSpeed's) can hide. Gathers are per layer
(as DeepSpeed's stage 3 fetches module by module), so a layer pays the ring's ``(n - 1)``
latency terms on every gather. While a layer runs, its gathered weights (stage 3) and its
full gradients before their reduce-scatter (stages 2 and 3) are held on top of the shards:
:func:`zero_transient_bytes`.

This module imports only :mod:`pipeopt.costs.collectives`.
"""

from __future__ import annotations

from pipeopt.costs.collectives import all_gather_time, all_reduce_time, reduce_scatter_time

#: The ZeRO stages modelled.
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
#: Bytes of a 16-bit weight (fp16 / bf16 mixed precision; ZeRO, section 3.1).
WEIGHT_BYTES = 2.0
#: Bytes of a 16-bit gradient (the same).
GRAD_BYTES = 2.0


def _check(stage: int, dp: int) -> None:
    if stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage: must be one of {ZERO_STAGES}, got {stage!r}")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"data_parallel: must be an integer >= 1, got {dp!r}")


def zero_bytes_per_param(stage: int, total: float, dp: int) -> float:
    """Bytes per parameter a GPU holds (weights, gradients, optimizer state) under ZeRO
    ``stage`` with ``dp`` replicas, ``total`` the unsharded bytes (16 for mixed-precision
    Adam): ``total``, ``4 + (total - 4) / dp``, ``2 + (total - 2) / dp``, ``total / dp``
    for stages 0..3 (ZeRO, figure 1)."""
    _check(stage, dp)
    kept = {0: total, 1: WEIGHT_BYTES + GRAD_BYTES, 2: WEIGHT_BYTES, 3: 0.0}[stage]
    if total < kept:
        raise ValueError(f"bytes_per_param: must be >= {kept:g} (what ZeRO-{stage} keeps "
                         f"whole), got {total:g}")
    return kept + (total - kept) / dp if stage else total


def zero_op_comm_times(stage: int, params: float, dp: int, latency: float, bandwidth: float,
                       grad_bytes: float = GRAD_BYTES) -> tuple[float, float, float]:
    """Seconds of ZeRO collectives one micro-batch adds to a layer of ``params`` parameters
    (on this rank) in its forward, backward-input and backward-weight ops, over a ring of
    ``dp`` replicas whose slowest hop has ``latency`` (s) and ``bandwidth`` (bytes/s): stage 3
    all-gathers the weights in F and in B and reduce-scatters the gradients in W; stage 2
    reduce-scatters the gradients in W; stages 0 and 1 add nothing per micro-batch."""
    _check(stage, dp)
    if stage < 2 or dp == 1:
        return 0.0, 0.0, 0.0
    scatter = reduce_scatter_time(dp, params * grad_bytes, latency, bandwidth)
    if stage == 2:
        return 0.0, 0.0, scatter
    gather = all_gather_time(dp, params * WEIGHT_BYTES, latency, bandwidth)
    return gather, gather, scatter


def zero_step_comm_time(stage: int, params: float, dp: int, latency: float, bandwidth: float,
                        grad_bytes: float = GRAD_BYTES) -> float:
    """Seconds of a stage's collectives after its last backward of the step (``params`` on
    this rank): the gradient all-reduce for stages 0 and 1 (ZeRO-1's reduce-scatter and
    all-gather take as long), the all-gather of the updated 16-bit weights for stage 2,
    nothing for stage 3 (the next step's forwards gather the weights)."""
    _check(stage, dp)
    if dp == 1 or stage == 3:
        return 0.0
    if stage == 2:
        return all_gather_time(dp, params * WEIGHT_BYTES, latency, bandwidth)
    return all_reduce_time(dp, params * grad_bytes, latency, bandwidth)


def zero_comm_bytes(stage: int, params: float, dp: int, microbatches: int,
                    grad_bytes: float = GRAD_BYTES) -> float:
    """Bytes one GPU sends over its data-parallel ring in a step of ``microbatches`` for
    ``params`` parameters (on this rank), ring collectives each sending ``(n - 1) / n`` of
    their buffer: stages 0 and 1 ``2 (n-1)/n G`` (G = params x grad bytes), stage 2
    ``m (n-1)/n G + (n-1)/n W`` (W = params x 2), stage 3 ``m (n-1)/n (2 W + G)``."""
    _check(stage, dp)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches: must be an integer >= 1, got {microbatches!r}")
    share = (dp - 1) / dp
    g, w = params * grad_bytes, params * WEIGHT_BYTES
    if stage < 2:
        return 2 * share * g
    if stage == 2:
        return share * (microbatches * g + w)
    return share * microbatches * (2 * w + g)


def zero_transient_bytes(stage: int, params: float, dp: int,
                         grad_bytes: float = GRAD_BYTES) -> float:
    """Bytes a layer of ``params`` parameters (on this rank) holds on top of its shards while
    it runs: its full gradients before their reduce-scatter (stages 2 and 3) and its
    gathered 16-bit weights (stage 3); 0 for stages 0 and 1 or one replica."""
    _check(stage, dp)
    if stage < 2 or dp == 1:
        return 0.0
    return params * (grad_bytes + (WEIGHT_BYTES if stage == 3 else 0.0))
