"""Stage partition search: which contiguous layers form each pipeline stage.

- :mod:`pipeopt.partition.dp` — exact dynamic programs on the chain (min-max stage time, and the
  pipeline objective sum + (m-1)·max of Alpa), with per-stage memory limits;
- :mod:`pipeopt.partition.ilp` — a PuLP/CBC model for per-device memory shared by several
  stages (virtual stages) and heterogeneous devices;
- :mod:`pipeopt.partition.joint` — the top-k partitions, each scheduled by a solver.

A partition is a tuple of ``(first_layer, last_layer_exclusive)`` per stage: every layer in
exactly one stage, in order, no stage empty.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Partition = tuple[tuple[int, int], ...]


class PartitionError(ValueError):
    """No partition satisfies the limits (the message says which stage, by how many bytes)."""


@dataclass(frozen=True)
class ChainCosts:
    """Inputs of the partition search for ``S`` stages and ``L`` layers.

    ``compute[k, l]``: seconds per micro-batch of layer l (forward + both backwards) on the device
    of stage k; ``comm[k, l]``: seconds of the boundary between stages k and k+1 when layer l is
    stage k's last layer (activation forward plus gradient back); ``static[l]``: bytes layer l
    pins on its device (parameters, gradients, optimizer state); ``activation[l]``: bytes per
    micro-batch; ``inflight[k]``: micro-batches whose activations stage k holds at its peak;
    ``device_limit[d]``: bytes available to the stages of device d (inf = unlimited), already
    net of the device's fixed overhead.
    """

    compute: np.ndarray
    comm: np.ndarray
    static: np.ndarray
    activation: np.ndarray
    inflight: np.ndarray
    stage_device: tuple[int, ...]
    device_limit: np.ndarray
    microbatches: int = 1

    @property
    def stages(self) -> int:
        """Number of stages S."""
        return int(self.compute.shape[0])

    @property
    def layers(self) -> int:
        """Number of layers L."""
        return int(self.compute.shape[1])

    @property
    def stage_limit(self) -> np.ndarray:
        """Per-stage memory limit used by the DP: the device's limit split evenly over the
        device's stages (exact with one stage per device)."""
        count = np.bincount(np.asarray(self.stage_device), minlength=len(self.device_limit))
        return np.array([self.device_limit[d] / count[d] for d in self.stage_device], float)


def chain_costs(compute: Sequence[Sequence[float]] | Sequence[float], *, stages: int | None = None,
                comm: Sequence[Sequence[float]] | None = None,
                static: Sequence[float] | None = None,
                activation: Sequence[float] | None = None,
                inflight: Sequence[float] | None = None,
                stage_device: Sequence[int] | None = None,
                device_limit: Sequence[float | None] | float | None = None,
                microbatches: int = 1) -> ChainCosts:
    """Build :class:`ChainCosts`; a 1-D ``compute`` (homogeneous devices) needs ``stages``."""
    comp = np.asarray(compute, dtype=float)
    if comp.ndim == 1:
        if stages is None:
            raise ValueError("stages: needed with per-layer compute times")
        comp = np.tile(comp, (stages, 1))
    s, n = comp.shape
    if s < 1 or n < s:
        raise PartitionError(f"cannot cut {n} layers into {s} non-empty stages")
    sd = tuple(stage_device) if stage_device is not None else tuple(range(s))
    p = max(sd) + 1
    if device_limit is None or isinstance(device_limit, int | float):
        lim = np.full(p, math.inf if device_limit is None else float(device_limit))
    else:
        lim = np.array([math.inf if x is None else float(x) for x in device_limit])
    return ChainCosts(
        compute=comp,
        comm=np.zeros((s - 1, n)) if comm is None else np.asarray(comm, float).reshape(s - 1, n),
        static=np.zeros(n) if static is None else np.asarray(static, float),
        activation=np.zeros(n) if activation is None else np.asarray(activation, float),
        inflight=np.ones(s) if inflight is None else np.asarray(inflight, float),
        stage_device=sd, device_limit=lim, microbatches=microbatches)


def inflight_microbatches(devices: int, virtual_stages: int, microbatches: int,
                          schedule: str = "1f1b") -> list[int]:
    """Micro-batches whose activations each stage holds at its peak.

    GPipe: all m. 1F1B with one stage per device: stage k holds min(p - k, m) (its warm-up
    forwards plus one). With several chunks per device, a micro-batch's activation on stage k
    lives until its backward returns from the S-1-k later stages, so min(S - k, m) is used (an
    upper bound for interleaved and V schedules).
    """
    s = devices * virtual_stages
    if schedule == "gpipe":
        return [microbatches] * s
    return [min(s - k, microbatches) for k in range(s)]


def uniform_partition(layers: int, stages: int) -> Partition:
    """Equal numbers of layers per stage (the first ``layers % stages`` stages get one more)."""
    if layers < stages:
        raise PartitionError(f"cannot cut {layers} layers into {stages} non-empty stages")
    q, r = divmod(layers, stages)
    out, a = [], 0
    for k in range(stages):
        b = a + q + (1 if k < r else 0)
        out.append((a, b))
        a = b
    return tuple(out)


def from_counts(counts: Sequence[int]) -> Partition:
    """Partition from the number of layers of each stage."""
    out, a = [], 0
    for c in counts:
        out.append((a, a + int(c)))
        a += int(c)
    return tuple(out)


def check_partition(partition: Partition, layers: int, stages: int) -> None:
    """Raise :class:`PartitionError` unless ``partition`` covers 0..layers-1 in ``stages``
    non-empty contiguous ranges."""
    if len(partition) != stages:
        raise PartitionError(f"expected {stages} stages, got {len(partition)}")
    pos = 0
    for k, (a, b) in enumerate(partition):
        if a != pos or b <= a:
            raise PartitionError(f"stage {k}: layers [{a}, {b}) do not follow layer {pos} or "
                                 "are empty")
        pos = b
    if pos != layers:
        raise PartitionError(f"the stages cover {pos} layers, the model has {layers}")


@dataclass(frozen=True)
class Evaluation:
    """Analytic figures of a partition (seconds, bytes)."""

    stage_time: tuple[float, ...]
    comm_time: tuple[float, ...]
    stage_memory: tuple[float, ...]
    device_memory: tuple[float, ...]
    max_time: float
    objective: float
    fits: bool


def evaluate(costs: ChainCosts, partition: Partition) -> Evaluation:
    """Stage times, the pipeline objective (sum of stage times and boundary delays, plus m-1
    times the busiest device's time per micro-batch: its largest stage with one stage per
    device, the sum of its stages with virtual stages), and memory of a partition."""
    check_partition(partition, costs.layers, costs.stages)
    times, comms, mems = [], [], []
    for k, (a, b) in enumerate(partition):
        times.append(float(costs.compute[k, a:b].sum()))
        if k < costs.stages - 1:
            comms.append(float(costs.comm[k, b - 1]))
        mems.append(float(costs.static[a:b].sum() + costs.inflight[k]
                          * costs.activation[a:b].sum()))
    dev = [0.0] * len(costs.device_limit)
    for k, mem in enumerate(mems):
        dev[costs.stage_device[k]] += mem
    fits = all(m <= lim * (1 + 1e-9) for m, lim in zip(dev, costs.device_limit, strict=True))
    mx = max(times)
    # The steady state is paced by the busiest device: with several stages per device
    # (virtual stages) that is the sum of its stages' times, not the largest stage.
    load = [0.0] * len(costs.device_limit)
    for k, t in enumerate(times):
        load[costs.stage_device[k]] += t
    obj = sum(times) + sum(comms) + (costs.microbatches - 1) * max(load)
    return Evaluation(tuple(times), tuple(comms), tuple(mems), tuple(dev), mx, obj, fits)
