"""Stage partition search: which contiguous layers form each pipeline stage.

- :mod:`pipeopt.partition.dp` — exact dynamic programs on the chain (min-max stage time, and the
  pipeline objective sum + (m-1)·max of Alpa), with per-stage memory limits;
- :mod:`pipeopt.partition.ilp` — a PuLP/CBC model for per-device memory shared by several
  stages (virtual stages) and heterogeneous devices;
- :mod:`pipeopt.partition.joint` — the top-k partitions, each scheduled by a solver.

A partition is a tuple of ``(first_layer, last_layer_exclusive)`` per stage: every layer in
exactly one stage, in order, no stage empty.

Per-stage modes (AdaPipe's adaptive recomputation: Sun et al., ASPLOS 2024): a
:class:`ChainCosts` may carry several named alternatives of its compute and activation
arrays (``mode_names``; e.g. recompute none / selective / full); each stage then runs in one
of them, chosen by the search jointly with the layer split (:func:`evaluate` picks, for a
given partition, the fastest modes that fit each device's memory).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

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

    Per-stage modes: ``mode_names`` names the alternatives a stage may run in,
    ``mode_compute[m]`` (S, L) and ``mode_activation[m]`` (L,) are mode m's arrays (``compute``
    and ``activation`` are mode 0's); empty when every stage has the one cost above. Static
    bytes and boundary delays do not depend on the mode.
    """

    compute: np.ndarray
    comm: np.ndarray
    static: np.ndarray
    activation: np.ndarray
    inflight: np.ndarray
    stage_device: tuple[int, ...]
    device_limit: np.ndarray
    microbatches: int = 1
    mode_names: tuple[str, ...] = ()
    mode_compute: tuple[np.ndarray, ...] = ()
    mode_activation: tuple[np.ndarray, ...] = ()

    @property
    def modes(self) -> int:
        """Number of per-stage modes (1 without alternatives)."""
        return max(len(self.mode_names), 1)

    def compute_of(self, mode: int) -> np.ndarray:
        """(S, L) seconds per micro-batch of every layer in ``mode``."""
        return self.mode_compute[mode] if self.mode_names else self.compute

    def activation_of(self, mode: int) -> np.ndarray:
        """(L,) activation bytes per micro-batch of every layer in ``mode``."""
        return self.mode_activation[mode] if self.mode_names else self.activation

    def only(self, mode: int) -> ChainCosts:
        """These costs with every stage in ``mode`` (no alternatives left)."""
        return replace(self, compute=self.compute_of(mode), activation=self.activation_of(mode),
                       mode_names=(), mode_compute=(), mode_activation=())

    def mode_indices(self, names: Sequence[str]) -> tuple[int, ...]:
        """The indices of mode ``names`` in ``mode_names``."""
        return tuple(self.mode_names.index(n) for n in names)

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


def with_modes(options: Sequence[tuple[str, ChainCosts]]) -> ChainCosts:
    """One :class:`ChainCosts` whose stages may each run in any of ``options`` (name, costs):
    the options must differ only in ``compute`` and ``activation``; the first is mode 0."""
    if not options:
        raise ValueError("options: at least one mode is needed")
    names = tuple(name for name, _ in options)
    if len(set(names)) != len(names):
        raise ValueError(f"options: mode names must be distinct, got {list(names)}")
    base = options[0][1]
    for name, c in options[1:]:
        if c.compute.shape != base.compute.shape or c.stage_device != base.stage_device:
            raise ValueError(f"options[{name!r}]: {c.compute.shape} compute for stages "
                             f"{c.stage_device}, mode 0 has {base.compute.shape} for "
                             f"{base.stage_device}")
        same = (np.array_equal(c.comm, base.comm) and np.array_equal(c.static, base.static)
                and np.array_equal(c.inflight, base.inflight)
                and np.array_equal(c.device_limit, base.device_limit)
                and c.microbatches == base.microbatches)
        if not same:
            raise ValueError(f"options[{name!r}]: only compute and activation may differ "
                             "between modes")
    return ChainCosts(
        compute=base.compute, comm=base.comm, static=base.static, activation=base.activation,
        inflight=base.inflight, stage_device=base.stage_device,
        device_limit=base.device_limit, microbatches=base.microbatches, mode_names=names,
        mode_compute=tuple(c.compute for _, c in options),
        mode_activation=tuple(c.activation for _, c in options))


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
    #: Each stage's mode (a name of ``ChainCosts.mode_names``); () without modes.
    modes: tuple[str, ...] = ()


#: Most mode combinations :func:`choose_modes` enumerates for one device (3 modes x 8 stages);
#: beyond it, stages are chosen one at a time against an even share of the device's limit.
MAX_MODE_COMBINATIONS = 3**8


def _stage_figures(costs: ChainCosts, partition: Partition, k: int, mode: int
                   ) -> tuple[float, float]:
    """(seconds per micro-batch, bytes) of stage k of ``partition`` in ``mode``."""
    a, b = partition[k]
    return (float(costs.compute_of(mode)[k, a:b].sum()),
            float(costs.static[a:b].sum() + costs.inflight[k]
                  * costs.activation_of(mode)[a:b].sum()))


def choose_modes(costs: ChainCosts, partition: Partition) -> tuple[int, ...]:
    """Each stage's mode for ``partition``: per device, the combination of its stages' modes
    with the least total time whose memory fits the device's limit (ties: lower mode
    indices); where none fits, the one with the least memory. Exact: the pipeline objective
    grows with every stage time and devices do not share memory, so each device's least
    load is the best choice. () without modes."""
    if not costs.mode_names:
        return ()
    s, n_modes = costs.stages, costs.modes
    fig = [[_stage_figures(costs, partition, k, m) for m in range(n_modes)] for k in range(s)]
    out = [0] * s
    for d, lim in enumerate(costs.device_limit):
        held = [k for k in range(s) if costs.stage_device[k] == d]
        if not held:
            continue
        if n_modes ** len(held) <= MAX_MODE_COMBINATIONS:
            combos = itertools.product(range(n_modes), repeat=len(held))
            scored = [(sum(fig[k][m][0] for k, m in zip(held, c, strict=True)),
                       sum(fig[k][m][1] for k, m in zip(held, c, strict=True)), c)
                      for c in combos]
            ok = [x for x in scored if x[1] <= lim * (1 + 1e-9)]
            pick = min(ok)[2] if ok else min(scored, key=lambda x: (x[1], x[0], x[2]))[2]
        else:  # too many to enumerate: each stage against an even share of the limit
            share = lim / len(held)
            pick = tuple(min((m for m in range(n_modes) if fig[k][m][1] <= share * (1 + 1e-9)),
                             key=lambda m, k=k: fig[k][m][0],
                             default=min(range(n_modes), key=lambda m, k=k: fig[k][m][1]))
                         for k in held)
        for k, m in zip(held, pick, strict=True):
            out[k] = m
    return tuple(out)


def evaluate(costs: ChainCosts, partition: Partition,
             modes: Sequence[int] | None = None) -> Evaluation:
    """Stage times, the pipeline objective (sum of stage times and boundary delays, plus m-1
    times the busiest device's time per micro-batch: its largest stage with one stage per
    device, the sum of its stages with virtual stages), and memory of a partition; with
    per-stage modes, in ``modes`` (indices, one per stage) or else those
    :func:`choose_modes` picks."""
    check_partition(partition, costs.layers, costs.stages)
    if costs.mode_names:
        chosen = tuple(modes) if modes is not None else choose_modes(costs, partition)
        if len(chosen) != costs.stages or not all(0 <= m < costs.modes for m in chosen):
            raise ValueError(f"modes: expected {costs.stages} indices in [0, {costs.modes}), "
                             f"got {list(chosen)}")
    else:
        chosen = (0,) * costs.stages
    times, comms, mems = [], [], []
    for k, (_, b) in enumerate(partition):
        t, mem = _stage_figures(costs, partition, k, chosen[k])
        times.append(t)
        if k < costs.stages - 1:
            comms.append(float(costs.comm[k, b - 1]))
        mems.append(mem)
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
    names = tuple(costs.mode_names[m] for m in chosen) if costs.mode_names else ()
    return Evaluation(tuple(times), tuple(comms), tuple(mems), tuple(dev), mx, obj, fits, names)
