"""Stage partition: DP against brute force, ILP against the DP, memory limits, joint search."""

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeopt.partition import (
    PartitionError,
    chain_costs,
    check_partition,
    evaluate,
    from_counts,
    inflight_microbatches,
    uniform_partition,
)
from pipeopt.partition.dp import (
    best_partition,
    exhaustive_partition,
    neighbours,
    pipeline_partition,
    top_partitions,
)
from pipeopt.partition.ilp import ilp_partition
from pipeopt.partition.joint import joint_search
from pipeopt.problem import Problem


@st.composite
def chains(draw, heterogeneous=True, memory=True):
    n = draw(st.integers(2, 8))
    s = draw(st.integers(1, min(n, 4)))
    val = st.floats(0.0, 3.0, allow_nan=False)
    rows = s if heterogeneous else 1
    comp = [[draw(val) for _ in range(n)] for _ in range(rows)]
    comp = comp if heterogeneous else comp[0]
    comm = [[draw(st.floats(0.0, 1.0)) for _ in range(n)] for _ in range(s - 1)]
    kw = {}
    if memory:
        kw = dict(static=[draw(st.floats(0.0, 1.0)) for _ in range(n)],
                  activation=[draw(st.floats(0.0, 1.0)) for _ in range(n)],
                  inflight=inflight_microbatches(s, 1, 4),
                  device_limit=draw(st.sampled_from([None, 2.0, 4.0, 8.0])))
    return chain_costs(comp, stages=s, comm=comm if s > 1 else None,
                       microbatches=draw(st.integers(1, 6)), **kw)


@pytest.mark.parametrize("scale", [5e-324, 1e-310, 1e150])
def test_dp_with_subnormal_or_huge_times(scale):
    """Subnormal or huge layer times: the tie-breaking penalty must neither overflow nor turn
    a cost into NaN (CI once saw ``invalid value encountered in multiply`` here)."""
    costs = chain_costs([[scale, 0.0, 2 * scale, scale]], stages=2, microbatches=3)
    brute, _ = exhaustive_partition(costs, "pipeline")
    with np.errstate(invalid="raise", over="raise"):
        res = best_partition(costs, "pipeline")
    assert res.evaluation.objective == pytest.approx(brute, rel=1e-9, abs=0.0)


@given(chains(), st.sampled_from(["pipeline", "minmax"]))
def test_dp_matches_brute_force(costs, objective):
    brute, _ = exhaustive_partition(costs, objective)
    if brute == float("inf"):
        with pytest.raises(PartitionError, match="over its limit"):
            best_partition(costs, objective)
        return
    res = best_partition(costs, objective)
    check_partition(res.partition, costs.layers, costs.stages)
    ev = res.evaluation
    got = ev.max_time if objective == "minmax" else ev.objective
    assert got == pytest.approx(brute, rel=1e-9, abs=1e-12)
    assert ev.fits


@given(chains(heterogeneous=False, memory=False), st.sampled_from(["pipeline", "minmax"]))
def test_ilp_matches_dp_on_homogeneous_devices(costs, objective):
    dp = best_partition(costs, objective).evaluation
    ilp = ilp_partition(costs, objective).evaluation
    key = (lambda e: e.max_time) if objective == "minmax" else (lambda e: e.objective)
    assert key(ilp) == pytest.approx(key(dp), rel=1e-6, abs=1e-9)


@given(chains(heterogeneous=True, memory=True))
def test_ilp_matches_dp_with_speeds_and_memory(costs):
    brute, _ = exhaustive_partition(costs, "pipeline")
    if brute == float("inf"):
        with pytest.raises(PartitionError):
            ilp_partition(costs)
        return
    assert ilp_partition(costs).evaluation.objective == pytest.approx(brute, rel=1e-6,
                                                                      abs=1e-9)


def test_ilp_with_memory_limits_matches_dp():
    rng = np.random.default_rng(3)
    n, s = 12, 4
    costs = chain_costs(rng.uniform(1, 2, n), stages=s, static=rng.uniform(0, 1, n),
                        activation=rng.uniform(0, 0.5, n), inflight=inflight_microbatches(s, 1, 8),
                        device_limit=4.0, microbatches=8)
    dp = best_partition(costs).evaluation
    ilp = ilp_partition(costs).evaluation
    assert ilp.objective == pytest.approx(dp.objective, rel=1e-6)
    assert ilp.fits


def test_ilp_shares_device_memory_between_virtual_stages():
    n = 8
    # Stages 0 and 2 on device 0, stages 1 and 3 on device 1 (v = 2, loop placement).
    costs = chain_costs([1.0] * n, stages=4, static=[1.0] * n, stage_device=[0, 1, 0, 1],
                        device_limit=[3.0, 5.0], microbatches=4)
    res = ilp_partition(costs, "minmax")
    ev = res.evaluation
    assert ev.device_memory[0] <= 3.0 and ev.device_memory[1] <= 5.0
    assert sum(b - a for a, b in res.partition) == n


def test_ilp_stopped_by_its_time_limit_does_not_claim_optimality():
    # 128 layers x 32 stages: CBC needs seconds to prove the optimum; stopped after 0.2 s it
    # may hold a worse partition, which it must not call exact.
    rng = np.random.default_rng(0)
    costs = chain_costs(rng.uniform(0.5, 1.5, 128), stages=32, microbatches=64)
    best = pipeline_partition(costs).evaluation.objective
    try:
        res = ilp_partition(costs, time_limit=0.2)
    except PartitionError as exc:
        assert "no partition found in 0.2 s" in str(exc)
        return
    if res.evaluation.objective > best * (1 + 1e-9):
        assert res.exact is False
    assert ilp_partition(chain_costs([1.0, 2.0, 3.0], stages=2)).exact is True


def test_virtual_stage_partition_prices_each_devices_whole_load():
    """With two stages per device the steady state is paced by the busiest device's summed
    stages; the search must find the best partition by that measure (brute force here), and
    keep each device's whole memory limit."""
    from pipeopt.partition.ilp import per_device_partition

    rng = np.random.default_rng(5)
    n, s = 9, 4
    for trial in range(4):
        times = rng.uniform(0.5, 2.0, n)
        times[-1] *= 4  # a heavy head, as an LM's
        limit = [100.0, 100.0] if trial % 2 == 0 else [5.0, 100.0]
        costs = chain_costs(times, stages=s, static=[1.0] * n, stage_device=[0, 1, 0, 1],
                            device_limit=limit, microbatches=8)
        best = min((evaluate(costs, p) for p in _all_partitions(n, s)
                    if evaluate(costs, p).fits), key=lambda e: e.objective)
        res, _ = per_device_partition(costs)
        assert res.evaluation.fits
        assert res.evaluation.objective == pytest.approx(best.objective, rel=1e-9)
        # The load term: 7 more micro-batches behind the busiest device's two stages.
        load = [res.evaluation.stage_time[0] + res.evaluation.stage_time[2],
                res.evaluation.stage_time[1] + res.evaluation.stage_time[3]]
        assert res.evaluation.objective == pytest.approx(
            sum(res.evaluation.stage_time) + 7 * max(load))


def _all_partitions(n: int, s: int):
    for cuts in itertools.combinations(range(1, n), s - 1):
        bounds = (0, *cuts, n)
        yield tuple(itertools.pairwise(bounds))


def test_uniform_counts_and_neighbours():
    assert uniform_partition(10, 4) == ((0, 3), (3, 6), (6, 8), (8, 10))
    assert from_counts([2, 3]) == ((0, 2), (2, 5))
    with pytest.raises(PartitionError):
        uniform_partition(3, 4)
    part = ((0, 2), (2, 3), (3, 5))
    nbs = neighbours(part, 5)
    assert ((0, 1), (1, 3), (3, 5)) in nbs and ((0, 2), (2, 4), (4, 5)) in nbs
    assert all(b > a for p in nbs for a, b in p)  # never an empty stage


def test_memory_infeasible_names_stage_and_bytes():
    costs = chain_costs([1.0] * 4, stages=2, static=[10.0] * 4, device_limit=15.0)
    with pytest.raises(PartitionError, match=r"stage \d .* over its limit"):
        pipeline_partition(costs)


def test_heavy_ends_get_fewer_layers():
    comp = [5.0] + [1.0] * 16 + [6.0]
    res = pipeline_partition(chain_costs(comp, stages=4, microbatches=16))
    sizes = [b - a for a, b in res.partition]
    assert sizes[0] < sizes[1] and sizes[-1] < sizes[1]
    assert res.evaluation.max_time < evaluate(
        chain_costs(comp, stages=4, microbatches=16), uniform_partition(18, 4)).max_time


def test_top_partitions_are_distinct_and_sorted():
    costs = chain_costs([3.0] + [1.0] * 10 + [3.0], stages=3, microbatches=8)
    top = top_partitions(costs, 5)
    parts = [p for p, _ in top]
    assert len(set(parts)) == len(parts) == 5
    objs = [ev.objective for _, ev in top]
    assert objs == sorted(objs)
    assert parts[0] == pipeline_partition(costs).partition


def test_128_layers_32_stages_is_exact_and_complete():
    """The benchmark's size (its speed is measured by benchmarks/partition.py, not here)."""
    rng = np.random.default_rng(0)
    costs = chain_costs(rng.uniform(1, 2, 128), stages=32, microbatches=64,
                        comm=rng.uniform(0, 0.05, (31, 128)))
    res = pipeline_partition(costs)
    assert res.exact
    bounds = list(res.partition)
    assert len(bounds) == 32 and bounds[0][0] == 0 and bounds[-1][1] == 128
    assert all(a < b for a, b in bounds)
    assert all(x[1] == y[0] for x, y in itertools.pairwise(bounds))


def test_joint_search_not_worse_than_uniform():
    comp = [4.0] + [1.0] * 10 + [4.0]
    costs = chain_costs(comp, stages=4, microbatches=8)
    per_layer = np.array(comp) / 3

    def build(part):
        f = tuple(float(per_layer[a:b].sum()) for a, b in part)
        return Problem(devices=4, microbatches=8, forward=f, backward_input=f,
                       backward_weight=f)

    uniform = uniform_partition(12, 4)
    res = joint_search(costs, build, top_k=3, method="1f1b", extra=[uniform])
    base = next(r for r in res.rows if r.partition == uniform)
    assert res.schedule.makespan <= base.value
    assert res.schedule.makespan < base.value * 0.9
