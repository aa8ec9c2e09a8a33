"""Partition for inference on heterogeneous devices and links: PipeEdge's DP, and a partition
for serving throughput with a KV cache.

Both choose which devices run the pipeline, in what order, and which contiguous layers each
runs, by one dynamic program over (set of devices used, last device, layers covered): the
recursion of PipeEdge (Hu et al., "PipeEdge: Pipeline Parallelism for Large-Scale Model
Inference on Heterogeneous Edge Devices", DSD 2022, section III):

    h(S, u, j) = min over i < j, v in S - {u} of
                 max(h(S - {u}, v, i), comm(v -> u, cut i), comp(u, layers i..j-1))
    h({u}, u, j) = comp(u, layers 0..j-1)

a stage's ``comp`` infinite where its memory does not fit the device. The answer for k stages
is the least ``h(S, u, L)`` over sets of k devices: the pipeline's bottleneck, whose inverse
is its throughput in micro-batches per second. :func:`bottleneck_dp` runs it on cost tables
(numpy: per set and last device, one vector over the cut and a ``(L + 1) x (L + 1)`` max-min,
so ``2^n n (n L + L^2)`` operations; n devices, L layers).

The two cost models (times in seconds, memory in bytes, a transformer from
:mod:`pipeopt.costs.transformer` priced by :mod:`pipeopt.costs.inference`):

* :func:`pipeedge_partition`, the baseline, PipeEdge's own: a stage's time is its layers'
  compute for one micro-batch (here a decode iteration of ``batch`` requests, as our roofline
  prices it, standing in for PipeEdge's profiled layer times), a cut's time is the micro-batch's
  activations over the link's bandwidth, and a stage fits when its weights fit the device.
* :func:`serving_partition`, ours: the serving throughput in tokens/s of a pipeline with one
  micro-batch group per stage (as :func:`pipeopt.solvers.inference.round_robin` runs it),
  ``k b / max(k T(k, b), R(k, b))`` for k stages, b requests per group, ``T`` the bottleneck
  and ``R`` one group's round trip (each group waits for its own tokens), maximized over k and
  over b up to what memory allows: every stage holds, beside its weights, the KV cache of all
  ``k b`` requests in flight (each reserving its final ``prompt + output - 1`` entries, as the
  policies do), which PipeEdge's memory rule leaves out. For each (k, b) the DP minimizes
  ``T`` under that memory rule; the (k, b) with the highest estimate wins.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from pipeopt.costs.gpus import lookup
from pipeopt.costs.inference import (
    attention_flops_per_key,
    hbm_bandwidth,
    head_flops_per_logit,
    kv_bytes_per_token,
    linear_flops_per_token,
)
from pipeopt.costs.transformer import TransformerShape, block_params

#: Most devices the DP takes: its tables have ``2^n`` rows per device.
MAX_DEVICES = 12


@dataclass(frozen=True)
class EdgePartition:
    """A pipeline over heterogeneous devices: ``devices`` (ids, in pipeline order) and the
    layers each runs (``layers[k]``, contiguous, in order); ``bottleneck_s``: the slowest stage
    or cut under the cost model that chose it; ``batch``: requests per micro-batch group;
    ``throughput_tokens_per_s``: the model's estimate (0 when it has none)."""

    devices: tuple[int, ...]
    layers: tuple[int, ...]
    bottleneck_s: float
    batch: int = 1
    throughput_tokens_per_s: float = 0.0

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        """Per stage ``(first layer, last layer exclusive)``."""
        ends = list(itertools.accumulate(self.layers))
        return tuple(zip([0, *ends[:-1]], ends, strict=True))


@dataclass(frozen=True)
class EdgeCluster:
    """Devices (catalog GPU names) and the links between them: ``bandwidth[u][v]`` bytes/s
    from u to v (u != v; 0 = no link), one-way ``latency`` s on every link; the fractions of
    each GPU's memory, peak FLOP/s and HBM bandwidth reached (as
    :func:`pipeopt.costs.inference.stage_models` takes them)."""

    gpus: tuple[str, ...]
    bandwidth: tuple[tuple[float, ...], ...]
    latency: float = 0.0
    memory_fraction: float = 1.0
    efficiency: float = 1.0
    bandwidth_efficiency: float = 1.0

    def __post_init__(self) -> None:
        n = len(self.gpus)
        if not 1 <= n <= MAX_DEVICES:
            raise ValueError(f"gpus: need 1..{MAX_DEVICES} devices, got {n}")
        for k, g in enumerate(self.gpus):
            try:
                lookup(g)
                hbm_bandwidth(g)
            except KeyError as exc:
                raise ValueError(f"gpus[{k}]: {exc.args[0]}") from None
        if len(self.bandwidth) != n or any(len(row) != n for row in self.bandwidth):
            raise ValueError(f"bandwidth: expected {n} x {n} bytes/s")
        for u, row in enumerate(self.bandwidth):
            for v, b in enumerate(row):
                if u != v and not b >= 0:
                    raise ValueError(f"bandwidth[{u}][{v}]: must be >= 0 bytes/s, got {b!r}")
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise ValueError(f"latency: must be a finite number >= 0 s, got {self.latency!r}")
        for name in ("memory_fraction", "efficiency", "bandwidth_efficiency"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"{name}: must be in (0, 1], got {v!r}")

    def hop(self, u: int, v: int, nbytes: float) -> float:
        """Seconds to send ``nbytes`` from device u to v (inf without a link)."""
        b = self.bandwidth[u][v]
        return math.inf if b <= 0 else self.latency + nbytes / b


# ----- the DP ----------------------------------------------------------------------------------
def bottleneck_dp(comp: np.ndarray, comm: np.ndarray) -> dict[int, EdgePartition]:
    """PipeEdge's recursion (module docstring) on cost tables: ``comp[u, i, j]`` the time of
    layers ``i..j-1`` on device u (inf: does not fit, or ``i >= j``), ``comm[v, u, i]`` the time
    of the cut before layer i from v to u. Returns, per number of stages k that has a
    feasible pipeline, the one of least bottleneck (ties: the first found)."""
    return _chain_dp(comp, comm, np.maximum)


def sum_dp(comp: np.ndarray, comm: np.ndarray) -> dict[int, EdgePartition]:
    """The same recursion with sums for maxima: per number of stages, the pipeline of least
    total time (every stage and cut once: one micro-batch's trip through it), in
    ``bottleneck_s``'s place."""
    return _chain_dp(comp, comm, np.add)


def _chain_dp(comp: np.ndarray, comm: np.ndarray, op: np.ufunc) -> dict[int, EdgePartition]:
    n, lp1, _ = comp.shape
    layers = lp1 - 1
    full = 1 << n
    h = np.full((full, n, lp1), np.inf)
    arg_i = np.zeros((full, n, lp1), dtype=np.int64)
    arg_v = np.zeros((full, n, lp1), dtype=np.int64)
    for u in range(n):
        h[1 << u, u] = comp[u, 0]
    for mask in range(1, full):
        if mask & (mask - 1) == 0:
            continue  # one device: the base case
        members = [u for u in range(n) if mask >> u & 1]
        for u in members:
            rest = mask ^ (1 << u)
            # best[i]: the least max(h(rest, v, i), comm(v -> u, i)) over v, and its v
            cand = np.stack([op(h[rest, v], comm[v, u]) for v in members if v != u])
            vs = [v for v in members if v != u]
            pick = cand.argmin(axis=0)
            best = cand[pick, np.arange(lp1)]
            table = op(best[:, None], comp[u])  # [i, j]
            i_star = table.argmin(axis=0)
            h[mask, u] = table[i_star, np.arange(lp1)]
            arg_i[mask, u] = i_star
            arg_v[mask, u] = np.asarray(vs)[pick][i_star]
    out: dict[int, EdgePartition] = {}
    for mask in range(1, full):
        k = bin(mask).count("1")
        for u in range(n):
            val = h[mask, u, layers]
            if math.isfinite(val) and (k not in out or val < out[k].bottleneck_s):
                out[k] = _unwind(h, arg_i, arg_v, mask, u, layers)
    return out


def _unwind(h: np.ndarray, arg_i: np.ndarray, arg_v: np.ndarray, mask: int, u: int,
            j: int) -> EdgePartition:
    value = float(h[mask, u, j])
    devices, layers = [], []
    while mask & (mask - 1):
        i = int(arg_i[mask, u, j])
        devices.append(u)
        layers.append(j - i)
        u, mask, j = int(arg_v[mask, u, j]), mask ^ (1 << u), i
    devices.append(u)
    layers.append(j)
    return EdgePartition(tuple(reversed(devices)), tuple(reversed(layers)), value)


# ----- cost tables -----------------------------------------------------------------------------
def _weights(shape: TransformerShape) -> np.ndarray:
    """``w[i, j]``: bytes of layers i..j-1's weights, with the embedding on the stage holding
    layer 0 and the final norm and LM head on the one holding the last (as
    :func:`pipeopt.costs.inference.stage_models` places them)."""
    L, h, v, e = shape.layers, shape.hidden, shape.vocab, shape.dtype_bytes
    i = np.arange(L + 1)[:, None]
    j = np.arange(L + 1)[None, :]
    params = (j - i) * block_params(shape) + (i == 0) * v * h + (j == L) * (
        (0 if shape.tie_embeddings else v * h) + h)
    return params * float(e)


def _stage_times(shape: TransformerShape, gpu: str, batch: int, context: float,
                 efficiency: float = 1.0, bandwidth_efficiency: float = 1.0) -> np.ndarray:
    """``t[i, j]``: seconds of one decode iteration of ``batch`` requests (each attending to
    ``context`` keys) through layers i..j-1 on ``gpu``: the roofline of
    :meth:`pipeopt.workloads.inference.StageModel.time`."""
    L = shape.layers
    g = lookup(gpu)
    i = np.arange(L + 1)[:, None]
    j = np.arange(L + 1)[None, :]
    n = (j - i).astype(float)
    flops = batch * n * (linear_flops_per_token(shape) + attention_flops_per_key(shape)
                         * context) + (j == L) * batch * head_flops_per_logit(shape)
    kv = kv_bytes_per_token(shape, 1) * n * batch * context
    return np.maximum(flops / (g.peak_flops(shape.dtype) * efficiency),
                      (_weights(shape) + kv) / (hbm_bandwidth(gpu) * bandwidth_efficiency))


def _tables(shape: TransformerShape, cluster: EdgeCluster, batch: int, context: float,
            kv_tokens: float) -> tuple[np.ndarray, np.ndarray]:
    """(comp, comm) for :func:`bottleneck_dp`: decode iterations of ``batch`` requests at
    ``context`` keys each; a stage fits when its weights and ``kv_tokens`` KV entries of its
    layers fit the device's usable memory."""
    L, n = shape.layers, len(cluster.gpus)
    i = np.arange(L + 1)[:, None]
    j = np.arange(L + 1)[None, :]
    empty = j <= i
    w = _weights(shape)
    comp = np.empty((n, L + 1, L + 1))
    for u, gpu in enumerate(cluster.gpus):
        need = w + kv_bytes_per_token(shape, 1) * (j - i) * kv_tokens
        fits = need <= lookup(gpu).memory_bytes * cluster.memory_fraction
        comp[u] = np.where(empty | ~fits, np.inf, _stage_times(
            shape, gpu, batch, context, cluster.efficiency, cluster.bandwidth_efficiency))
    act = batch * shape.hidden * shape.dtype_bytes  # one token's hidden state per request
    comm = np.empty((n, n, L + 1))
    for v in range(n):
        for u in range(n):
            comm[v, u] = math.inf if u == v else cluster.hop(v, u, act)
    return comp, comm


# ----- the two partitions ----------------------------------------------------------------------
def pipeedge_partition(shape: TransformerShape, cluster: EdgeCluster, *, batch: int = 1,
                       context: float = 512.0) -> EdgePartition:
    """PipeEdge's partition: the least bottleneck (stage compute of one micro-batch of
    ``batch`` decodes at ``context`` keys, or a cut's transfer) over every number of stages,
    each stage's weights within its device's memory (the KV cache is not in its model)."""
    _check_workload(batch, context)
    comp, comm = _tables(shape, cluster, batch, context, 0.0)
    found = bottleneck_dp(comp, comm)
    if not found:
        raise ValueError("no partition: the model's weights do not fit the devices")
    best = min(found.values(), key=lambda p: p.bottleneck_s)
    return EdgePartition(best.devices, best.layers, best.bottleneck_s, batch)


def round_trip(shape: TransformerShape, cluster: EdgeCluster, part: EdgePartition,
               context: float) -> float:
    """Seconds for one group's decode iteration through every stage and back (its next
    iteration needs the sampled token): stage times plus every hop, the last one to the
    first stage (0 for a single stage on one device)."""
    total = 0.0
    k = len(part.devices)
    act = part.batch * shape.hidden * shape.dtype_bytes
    for s, ((a, b), u) in enumerate(zip(part.bounds, part.devices, strict=True)):
        total += float(_stage_times(shape, cluster.gpus[u], part.batch, context,
                                    cluster.efficiency, cluster.bandwidth_efficiency)[a, b])
        if k > 1:
            total += cluster.hop(u, part.devices[(s + 1) % k], act if s < k - 1 else 0.0)
    return total


def serving_partition(shape: TransformerShape, cluster: EdgeCluster, *, prompt: float,
                      output: float, batches: Sequence[int] | None = None) -> EdgePartition:
    """Ours: the partition, number of stages k and requests per group b of the highest
    estimated serving throughput ``k b / max(k T, R)`` tokens/s (module docstring), for
    requests of ``prompt`` and ``output`` tokens on average (decodes attend to ``prompt +
    output / 2`` keys on average; each request reserves ``prompt + output - 1`` KV entries).
    ``batches``: the b tried (default: powers of two up to 1024)."""
    _check_workload(1, prompt)
    if not output >= 1:
        raise ValueError(f"output: must be >= 1 token, got {output!r}")
    context = prompt + output / 2
    reserve = prompt + output - 1
    grid = tuple(batches) if batches is not None else tuple(2 ** p for p in range(11))
    if not grid or any(not isinstance(b, int) or b < 1 for b in grid):
        raise ValueError(f"batches: need integers >= 1, got {list(grid)!r}")
    best: EdgePartition | None = None
    for k in range(1, len(cluster.gpus) + 1):
        for b in grid:
            comp, comm = _tables(shape, cluster, b, context, k * b * reserve)
            part = _least_cycle(comp, comm, k, cluster.latency if k > 1 else 0.0)
            if part is None:
                continue
            trip = round_trip(shape, cluster, replace(part, batch=b), context)
            est = k * b / max(k * part.bottleneck_s, trip)
            if best is None or est > best.throughput_tokens_per_s:
                best = EdgePartition(part.devices, part.layers, part.bottleneck_s, b, est)
    if best is None:
        raise ValueError("no partition: the weights and one request's KV cache do not fit "
                         "the devices")
    return best


def _measure(comp: np.ndarray, comm: np.ndarray, part: EdgePartition) -> tuple[float, float]:
    """(bottleneck, sum) of ``part`` on the tables."""
    vals = [float(comp[u, a, b]) for u, (a, b) in zip(part.devices, part.bounds, strict=True)]
    vals += [float(comm[part.devices[s - 1], part.devices[s], part.bounds[s][0]])
             for s in range(1, len(part.devices))]
    return max(vals), sum(vals)


def _least_cycle(comp: np.ndarray, comm: np.ndarray, k: int, back: float
                 ) -> EdgePartition | None:
    """The k-stage pipeline of least cycle ``max(k T, R)`` (T its bottleneck, R its sum plus
    ``back``, the return hop), exactly: for a threshold t, the least sum among pipelines whose
    every stage and cut is at most t, R(t), falls as t rises while k t rises, so the optimum
    is at one of the two thresholds (among the tables' values) around where k t first reaches
    R(t), found by bisection. ``bottleneck_s`` is the pipeline's T."""
    first = bottleneck_dp(comp, comm).get(k)
    if first is None:
        return None
    values = np.unique(np.concatenate([comp[np.isfinite(comp)], comm[np.isfinite(comm)]]))
    values = values[values >= first.bottleneck_s]
    memo: dict[int, tuple[float, EdgePartition] | None] = {}

    def probe(idx: int) -> tuple[float, EdgePartition] | None:
        """(R(t), the pipeline) at threshold values[idx]."""
        if idx not in memo:
            t = values[idx]
            got = sum_dp(np.where(comp <= t, comp, np.inf),
                         np.where(comm <= t, comm, np.inf)).get(k)
            memo[idx] = None if got is None else (got.bottleneck_s + back, got)
        return memo[idx]

    def reached(idx: int) -> bool:
        got = probe(idx)
        return got is not None and k * values[idx] >= got[0]

    lo, hi = 0, len(values) - 1
    if reached(hi):
        while lo < hi:  # the first threshold where k t reaches R(t)
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if reached(mid) else (mid + 1, hi)
    best: EdgePartition | None = None
    best_cycle = math.inf
    for idx in {hi, max(hi - 1, 0)}:
        got = probe(idx)
        if got is None:
            continue
        bn, total = _measure(comp, comm, got[1])
        cycle = max(k * bn, total + back)
        if cycle < best_cycle:
            best_cycle = cycle
            best = EdgePartition(got[1].devices, got[1].layers, bn)
    return best


def _check_workload(batch: int, context: float) -> None:
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch: must be an integer >= 1, got {batch!r}")
    if not (context >= 1 and math.isfinite(context)):
        raise ValueError(f"context: must be a finite number >= 1 token, got {context!r}")


def link_of(cluster: EdgeCluster, part: EdgePartition) -> tuple[tuple[float, ...],
                                                                  tuple[float, ...]]:
    """(latency s, bandwidth bytes/s) per hop of the pipeline ``part``: stage k to k + 1, then
    the last stage back to the first, as :func:`pipeopt.workloads.inference.build` takes
    them (one stage: its own device, no hop)."""
    d = part.devices
    k = len(d)
    if k == 1:
        return (0.0,), (math.inf,)
    bw = tuple(cluster.bandwidth[d[s]][d[(s + 1) % k]] for s in range(k))
    return (cluster.latency,) * k, bw
