"""PipeDream's planner (partition + replication DP) against brute force and a VGG-like case."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from pipeopt.errors import ConfigError
from pipeopt.partition.pipedream import Layer, Level, plan, plan_problem
from pipeopt.schedules.periodic import check_periodic
from pipeopt.solvers.periodic import solve_periodic


def _compositions(n: int, parts: int) -> list[tuple[int, ...]]:
    """Every way to write n as an ordered sum of ``parts`` positive integers."""
    return [tuple(b - a for a, b in zip((0, *cut), (*cut, n), strict=True))
            for cut in itertools.combinations(range(1, n), parts - 1)]


def _brute(layers: list[Layer], levels: list[Level], k: int, i: int, j: int, m: int) -> float:
    """The planner's objective minimised over every partition of layers i..j into stages and
    every split of the m units of level k among them (the same cost formulas, no DP)."""
    bw = levels[k].bandwidth

    def unit(a: int, b: int) -> float:
        if k == 0:
            return sum(x.compute_s for x in layers[a:b + 1])
        return _brute(layers, levels, k - 1, a, b, levels[k - 1].units)

    def stage(a: int, b: int, r: int) -> float:
        sync = 2 * (r - 1) / r * sum(x.weight_bytes for x in layers[a:b + 1]) / bw
        return max(unit(a, b), sync) / r

    best = math.inf
    n = j - i + 1
    for parts in range(1, min(n, m) + 1):
        for sizes in _compositions(n, parts):
            ends = list(itertools.accumulate(sizes))
            bounds = [(i + e0, i + e1 - 1) for e0, e1 in zip((0, *ends[:-1]), ends, strict=True)]
            comm = max((layers[b].output_bytes / bw for _, b in bounds[:-1]), default=0.0)
            for reps in _compositions(m, parts):
                v = max(comm, *(stage(a, b, r) for (a, b), r in zip(bounds, reps, strict=True)))
                best = min(best, v)
    return best


def _random_layers(rng: random.Random, n: int) -> list[Layer]:
    return [Layer(f"l{i}", rng.uniform(0.1, 1), rng.uniform(0.1, 1), rng.uniform(0, 1),
                  rng.uniform(0, 4e8), rng.uniform(0, 2e9), 1.0) for i in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_one_level_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    layers = _random_layers(rng, rng.randint(1, 6))
    levels = [Level(rng.randint(1, 5), 1e9)]
    got = plan(layers, levels)
    assert got.period == pytest.approx(_brute(layers, levels, 0, 0, len(layers) - 1,
                                              levels[0].units))
    assert got.devices == levels[0].units
    firsts = [s.first for s in got.stages]
    assert firsts == [0] + [s.last + 1 for s in got.stages[:-1]]  # contiguous, in order
    assert got.stages[-1].last == len(layers) - 1


@pytest.mark.parametrize("seed", range(4))
def test_two_levels_match_brute_force(seed: int) -> None:
    rng = random.Random(100 + seed)
    layers = _random_layers(rng, rng.randint(2, 5))
    levels = [Level(2, 1e10), Level(2, 5e8)]
    got = plan(layers, levels)
    assert got.period == pytest.approx(_brute(layers, levels, 1, 0, len(layers) - 1, 2))
    assert got.devices == 4


def _vgg_like() -> list[Layer]:
    """A VGG-16-like profile: 13 convolutions whose work is large and weights small, then 3
    fully connected layers holding ~90 % of the weights with little work (VGG-16: 138 M
    parameters, 124 M of them in the three FC layers; Simonyan and Zisserman, 2015)."""
    conv_ms = [1.7, 3.7, 1.8, 3.7, 1.8, 3.7, 3.7, 1.8, 3.7, 3.7, 0.9, 0.9, 0.9]
    conv_params = [1.7e3, 3.7e4, 7.4e4, 1.5e5, 3e5, 5.9e5, 5.9e5, 1.2e6, 2.4e6, 2.4e6, 2.4e6,
                   2.4e6, 2.4e6]
    out = [Layer(f"conv{i}", t / 1e3, t / 1e3, t / 1e3, 2.56e7 / 2 ** (i // 3), 4 * w, 1.0)
           for i, (t, w) in enumerate(zip(conv_ms, conv_params, strict=True))]
    for i, (t, w) in enumerate([(0.3, 1.03e8), (0.05, 1.7e7), (0.01, 4.1e6)]):
        out.append(Layer(f"fc{i}", t / 1e3, t / 1e3, t / 1e3, 1.0e6, 4 * w, 0.1))
    return out


def test_vgg_like_on_two_nodes_replicates_the_convolutions_not_the_classifier() -> None:
    layers = _vgg_like()
    levels = [Level(4, 10e9), Level(2, 1.25e9)]  # 4 GPUs per node, 10 Gb/s between nodes
    got = plan(layers, levels)
    fc = [s for s in got.stages if s.last >= 13]
    assert len(fc) == 1 and fc[0].replicas == 1 and fc[0].first <= 13  # the FC layers alone
    assert got.stages[0].replicas > 1  # the first convolutions replicated
    assert got.devices == 8
    # Pure data parallelism (one stage on all 8 GPUs, synchronising over the slow link) is
    # slower: it all-reduces the FC weights too.
    weights = sum(x.weight_bytes for x in layers)
    data_parallel = max(sum(x.compute_s for x in layers), 2 * 7 / 8 * weights / 1.25e9) / 8
    assert got.period < data_parallel / 5
    prob, reps = plan_problem(layers, got)
    assert reps == tuple(s.replicas for s in got.stages)
    found = solve_periodic(prob, replicas=reps)
    assert check_periodic(found) == []
    # The steady state reaches the planner's estimate (its compute terms; no sync modelled).
    assert found.period <= got.period * (1 + 1e-9)


def test_bad_planner_inputs_are_named() -> None:
    with pytest.raises(ConfigError, match="layers"):
        plan([], [Level(2, 1e9)])
    with pytest.raises(ConfigError, match=r"levels\[0\]\.units"):
        plan(_vgg_like(), [Level(0, 1e9)])
    bad = Layer("x", -1.0, 0.0, 0.0, 0.0, 0.0)
    with pytest.raises(ConfigError, match=r"layers\[0\]\.forward_s"):
        plan([bad], [Level(1, 1e9)])


def test_the_planner_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    import runpy
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "pipedream_planner.py"
    runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out
    assert out.startswith("plan 4-3-1:")  # convolutions on 4 and 3 GPUs, the classifier on 1
    assert "periodic: period 12.90 ms (bound 12.90 ms)" in out


def test_plan_sync_s_is_the_ring_over_the_replicas_slowest_link() -> None:
    """The all-reduce of each stage's weights among its replicas (the periodic model's
    ``sync_s``): ``2 (r - 1) / r * bytes / bandwidth`` over the highest level the stage is
    replicated across; by hand on the VGG-like example (both replicated stages inside a node)
    and on one layer replicated over 2 nodes x 2 GPUs (pure data parallelism: the ring crosses
    the slow link)."""
    import runpy
    from pathlib import Path

    from pipeopt.partition.pipedream import plan_sync_s

    path = Path(__file__).resolve().parents[1] / "examples" / "pipedream_planner.py"
    layers = runpy.run_path(str(path))["vgg_like"]()
    result = plan(layers, [Level(4, 10e9), Level(2, 1.25e9)])
    assert [s.sync_bandwidth for s in result.stages] == [10e9, 10e9, math.inf]
    assert plan_sync_s(layers, result) == pytest.approx(
        (2 * 3 / 4 * 4.6108e6 / 10e9, 2 * 2 / 3 * 2.636e7 / 10e9, 0.0))
    one = [Layer("x", 1.0, 1.0, 1.0, 1.0, 8.0)]
    dp = plan(one, [Level(2, 100.0), Level(2, 10.0)])
    assert dp.config() == "4" and dp.stages[0].sync_bandwidth == 10.0
    assert plan_sync_s(one, dp) == pytest.approx((2 * 3 / 4 * 8.0 / 10.0,))
