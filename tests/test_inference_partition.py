"""Partition for inference on heterogeneous devices (issue 15 item 5): PipeEdge's DP against
brute force, and the serving partition against brute force over its own estimate."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from pipeopt.costs import inference as ci
from pipeopt.costs.config import PRESETS
from pipeopt.costs.transformer import TransformerShape
from pipeopt.partition.pipeedge import (
    EdgeCluster,
    EdgePartition,
    bottleneck_dp,
    link_of,
    pipeedge_partition,
    round_trip,
    serving_partition,
    sum_dp,
)
from pipeopt.workloads.inference import Decode, Iteration


def compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Every way to write ``total`` as ``parts`` positive integers, in order."""
    return [tuple(b - a for a, b in zip((0, *cut), (*cut, total), strict=True))
            for cut in itertools.combinations(range(1, total), parts - 1)]


def brute_bottlenecks(comp: np.ndarray, comm: np.ndarray, combine: object = max
                      ) -> dict[int, float]:
    """Per number of stages, the least bottleneck (``combine`` max) or sum (``sum``) over
    every ordered device subset and layer split."""
    n, lp1, _ = comp.shape
    best: dict[int, float] = {}
    for k in range(1, n + 1):
        for devs in itertools.permutations(range(n), k):
            for lay in compositions(lp1 - 1, k) if k <= lp1 - 1 else []:
                cuts = list(itertools.accumulate(lay))
                starts = [0, *cuts[:-1]]
                vals = [comp[u, a, b] for u, a, b in zip(devs, starts, cuts, strict=True)]
                vals += [comm[devs[s - 1], devs[s], starts[s]] for s in range(1, k)]
                val = combine(vals)  # type: ignore[operator]
                if math.isfinite(val):
                    best[k] = min(best.get(k, math.inf), val)
    return best


@pytest.mark.parametrize("seed", range(8))
def test_bottleneck_dp_equals_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, layers = 3, 5
    comp = rng.uniform(0.1, 2.0, (n, layers + 1, layers + 1))
    i, j = np.indices((layers + 1, layers + 1))
    comp[:, j <= i] = np.inf
    comp[rng.uniform(size=comp.shape) < 0.2] = np.inf  # memory: some stages do not fit
    comm = rng.uniform(0.0, 1.5, (n, n, layers + 1))
    for u in range(n):
        comm[u, u] = np.inf
    found = bottleneck_dp(comp, comm)
    brute = brute_bottlenecks(comp, comm)
    assert set(found) == set(brute)
    for k, part in found.items():
        assert part.bottleneck_s == pytest.approx(brute[k])
        assert len(part.devices) == k == len(set(part.devices)) and sum(part.layers) == layers
        # the partition returned has the value returned
        val = max(comp[u, a, b] for u, (a, b) in zip(part.devices, part.bounds, strict=True))
        for s in range(1, k):
            val = max(val, comm[part.devices[s - 1], part.devices[s], part.bounds[s][0]])
        assert val == pytest.approx(part.bottleneck_s)
    sums = sum_dp(comp, comm)
    brute_sums = brute_bottlenecks(comp, comm, sum)
    assert {k: p.bottleneck_s for k, p in sums.items()} == pytest.approx(brute_sums)


def gpt2() -> TransformerShape:
    keys = TransformerShape.__dataclass_fields__
    return TransformerShape(**{k: v for k, v in PRESETS["gpt2-small"].items() if k in keys},
                            dtype="fp16", causal=True)


CLUSTER = EdgeCluster(("L4", "L40S", "A100-40GB"),
                      ((0, 1.25e9, 0.125e9), (1.25e9, 0, 1.25e9), (0.125e9, 1.25e9, 0)),
                      latency=50e-6, memory_fraction=0.004)


def estimate(shape: TransformerShape, cluster: EdgeCluster, devs: tuple[int, ...],
             lay: tuple[int, ...], b: int, prompt: int, output: int) -> float | None:
    """The serving estimate k b / max(k T, R) of one pipeline, from the stage models of
    :func:`pipeopt.costs.inference.stage_models` (None: it does not fit)."""
    k = len(devs)
    try:
        models = ci.stage_models(shape, [cluster.gpus[d] for d in devs], lay,
                                 memory_fraction=cluster.memory_fraction)
    except ValueError:
        return None
    ctx = prompt + output // 2
    reserve = prompt + output - 1
    it = Iteration(0, decodes=tuple(Decode(r, ctx) for r in range(b)))
    times = [m.time(it) for m in models]
    if any(m.weight_bytes + k * b * reserve * m.kv_bytes_per_token > m.memory_limit
           for m in models):
        return None
    act = b * shape.hidden * shape.dtype_bytes
    hops = [cluster.hop(devs[s], devs[s + 1], act) for s in range(k - 1)]
    back = cluster.hop(devs[-1], devs[0], 0.0) if k > 1 else 0.0
    bottleneck = max(times + hops)
    trip = sum(times) + sum(hops) + back
    return k * b / max(k * bottleneck, trip)


def test_serving_partition_is_the_brute_force_best_of_its_estimate() -> None:
    """On 3 devices, 12 layers and batches 1, 4, 16: every ordered device subset and layer
    split, priced independently by stage_models, gives no higher estimate than the one
    serving_partition returns (whose estimate is that of its own pipeline)."""
    shape = gpt2()
    prompt, output, grid = 100, 20, (1, 4, 16)
    part = serving_partition(shape, CLUSTER, prompt=prompt, output=output, batches=grid)
    own = estimate(shape, CLUSTER, part.devices, part.layers, part.batch, prompt, output)
    assert own == pytest.approx(part.throughput_tokens_per_s)
    best = 0.0
    for k in range(1, 4):
        for devs in itertools.permutations(range(3), k):
            for lay in compositions(shape.layers, k):
                for b in grid:
                    est = estimate(shape, CLUSTER, devs, lay, b, prompt, output)
                    if est is not None:
                        best = max(best, est)
    assert part.throughput_tokens_per_s == pytest.approx(best)


def test_pipeedge_ignores_the_kv_cache_and_ours_does_not() -> None:
    """PipeEdge's memory rule counts weights only; the serving partition keeps room for the
    KV cache of every request in flight, so its smallest KV capacity is at least as large."""
    shape = gpt2()
    pe = pipeedge_partition(shape, CLUSTER, batch=4, context=110)
    ours = serving_partition(shape, CLUSTER, prompt=100, output=20, batches=(1, 4, 16))
    for part in (pe, ours):
        assert sum(part.layers) == shape.layers
        assert round_trip(shape, CLUSTER, part, 110) > 0
        lat, bw = link_of(CLUSTER, part)
        assert len(lat) == len(bw) == max(1, len(part.devices))
    models = ci.stage_models(shape, [CLUSTER.gpus[d] for d in ours.devices], ours.layers,
                             memory_fraction=CLUSTER.memory_fraction)
    k = len(ours.devices)
    assert all(m.weight_bytes + k * ours.batch * 119 * m.kv_bytes_per_token <= m.memory_limit
               for m in models)


def test_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"gpus\[1\]: unknown GPU"):
        EdgeCluster(("L4", "L5"), ((0, 1.0), (1.0, 0)))
    with pytest.raises(ValueError, match=r"bandwidth: expected 2 x 2"):
        EdgeCluster(("L4", "L4"), ((0, 1.0),))
    with pytest.raises(ValueError, match=r"bandwidth\[0\]\[1\]: must be >= 0"):
        EdgeCluster(("L4", "L4"), ((0, -1.0), (1.0, 0)))
    with pytest.raises(ValueError, match="batch: must be an integer >= 1"):
        pipeedge_partition(gpt2(), CLUSTER, batch=0)
    with pytest.raises(ValueError, match="no partition"):
        pipeedge_partition(gpt2(), EdgeCluster(("L4",), ((0,),), memory_fraction=1e-5))
    assert EdgePartition((2, 0), (5, 7), 1.0).bounds == ((0, 5), (5, 12))


def test_efficiencies_price_the_stages_as_stage_models_does() -> None:
    """A cluster at half the peak FLOP/s and 80 % of the HBM bandwidth: the serving estimate of
    the chosen pipeline is what stage_models at those efficiencies gives."""
    shape = gpt2()
    slow = EdgeCluster(CLUSTER.gpus, CLUSTER.bandwidth, CLUSTER.latency,
                       CLUSTER.memory_fraction, efficiency=0.5, bandwidth_efficiency=0.8)
    part = serving_partition(shape, slow, prompt=100, output=20, batches=(4,))
    models = ci.stage_models(shape, [slow.gpus[d] for d in part.devices], part.layers,
                             efficiency=0.5, bandwidth_efficiency=0.8,
                             memory_fraction=slow.memory_fraction)
    it = Iteration(0, decodes=tuple(Decode(r, 110) for r in range(4)))
    assert part.bottleneck_s >= max(m.time(it) for m in models) * (1 - 1e-9)
    trip = round_trip(shape, slow, part, 110)
    hops = [slow.hop(part.devices[s], part.devices[s + 1], 4 * shape.hidden * 2)
            for s in range(len(part.devices) - 1)]
    back = slow.hop(part.devices[-1], part.devices[0], 0.0) if len(part.devices) > 1 else 0
    assert trip == pytest.approx(sum(m.time(it) for m in models) + sum(hops) + back)
    with pytest.raises(ValueError, match=r"efficiency: must be in \(0, 1\]"):
        EdgeCluster(("L4",), ((0,),), efficiency=0.0)
