"""PipeDream's planner (partition + replication DP) against brute force and a VGG-like case."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest

from pipeopt.errors import ConfigError
from pipeopt.partition.pipedream import (
    DeviceType,
    Layer,
    Level,
    plan,
    plan_cluster,
    plan_problem,
)
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


# ----- heterogeneous devices (HetPipe) -------------------------------------------------------
def _random_case(seed: int) -> tuple[list[Layer], list[tuple[int, int, int, int, float]]]:
    """Seeded instances of the homogeneous planner (1 to 3 levels, 3 to 9 layers)."""
    rng = random.Random(1000 + seed)
    layers = _random_layers(rng, rng.randint(3, 9))
    levels = [Level(rng.randint(2, 3), rng.choice([1e9, 1e10, 5e8])) for _ in range(1 + seed % 3)]
    return layers, levels


#: ``plan``'s answers at main 6b0ce4e, before device types: (seed, period, stages as
#: (first, last, replicas, split_level, sync_bandwidth)); the last row is the VGG-like example.
BEFORE_TYPES = [
    (0, 7.232145867618058, [(0, 8, 2, 0, 1e10)]),
    (1, 3.458257373225748, [(0, 1, 1, 1, math.inf), (2, 2, 1, 2, math.inf),
                            (3, 5, 2, 1, 1e9), (6, 8, 2, 0, 1e9)]),
    (2, 0.8542583661267843, [(0, 2, 6, 2, 1e9), (3, 3, 3, 3, 1e9), (4, 4, 3, 2, 1e9),
                             (5, 5, 3, 2, 1e9), (6, 6, 3, 0, 1e9)]),
    (3, 3.073576514601417, [(0, 5, 3, 0, 1e10)]),
    (4, 1.152363717756801, [(0, 3, 6, 2, 1e9), (4, 5, 3, 0, 1e10)]),
    (5, 0.39350370965261416, [(0, 1, 9, 2, 1e10), (2, 4, 9, 2, 1e10), (5, 5, 9, 0, 1e10)]),
    (6, 4.4288346044084514, [(0, 4, 2, 0, 1e10)]),
    (7, 3.620246953709999, [(0, 4, 2, 2, 1e10), (5, 8, 2, 0, 1e10)]),
    ("vgg", 0.012899999999999997, [(0, 5, 4, 2, 1e10), (6, 9, 3, 1, 1e10),
                                   (10, 15, 1, 0, math.inf)]),
]


@pytest.mark.parametrize(("seed", "period", "stages"), BEFORE_TYPES)
def test_homogeneous_plans_are_unchanged(seed: int | str, period: float,
                                         stages: list[tuple[int, int, int, int, float]]) -> None:
    """One device type gives exactly the plans of the planner before types: the same float
    period (the same sums in the same order) and the same stages, through ``plan`` and
    through ``plan_cluster`` with the top level as the type's units."""
    if seed == "vgg":
        layers, levels = _vgg_like_example(), [Level(4, 10e9), Level(2, 1.25e9)]
    else:
        layers, levels = _random_case(int(seed))
    got = plan(layers, levels)
    one = plan_cluster(layers, [DeviceType("gpu", levels[-1].units, tuple(levels[:-1]))],
                       levels[-1].bandwidth)
    for p in (got, one):
        assert p.period == period
        assert [(s.first, s.last, s.replicas, s.split_level, s.sync_bandwidth)
                for s in p.stages] == stages
        assert {s.device_type for s in p.stages} == {0}
    assert got.period == pytest.approx(_brute(layers, levels, len(levels) - 1, 0,
                                              len(layers) - 1, levels[-1].units))


def _vgg_like_example() -> list[Layer]:
    import runpy
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "pipedream_planner.py"
    return runpy.run_path(str(path))["vgg_like"]()


def _fits(layers: list[Layer], a: int, b: int, ty: DeviceType, replicas: int, on: int,
          policy: str, static: float) -> bool:
    """PipeDream's NOAM, ceil(on / replicas) in flight per replica, each with the stage's
    activations and (stash) its own weight version, within the type's memory."""
    if ty.memory is None:
        return True
    n = math.ceil(on / replicas)
    versions = {"stash": n, "2bw": 2, "pipemare": 1}[policy]
    w = sum(x.weight_bytes for x in layers[a:b + 1])
    act = sum(x.activation_bytes for x in layers[a:b + 1])
    return static + versions * w + n * act <= ty.memory * (1 + 1e-9)


def _brute_hetero(layers: list[Layer], types: list[DeviceType], bw: float,
                  policy: str = "stash", static: float = 0.0) -> float:
    """Every ordered partition of the layers into stages, every type and replica count per
    stage using each type's units exactly, each stage's period max(compute / speed, sync) / r
    (inner levels through :func:`_brute` on the type's levels, its times scaled by speed),
    each cut's output over ``bw``; memory by :func:`_fits` for one-level types only."""
    best = math.inf
    n = len(layers)
    units = [t.units for t in types]
    total = sum(t.devices for t in types)
    for parts in range(1, n + 1):
        for sizes in _compositions(n, parts):
            ends = list(itertools.accumulate(sizes))
            bounds = [(e0, e1 - 1) for e0, e1 in zip((0, *ends[:-1]), ends, strict=True)]
            comm = max((layers[b].output_bytes / bw for _, b in bounds[:-1]), default=0.0)
            for kinds in itertools.product(range(len(types)), repeat=parts):
                for reps in itertools.product(range(1, max(units) + 1), repeat=parts):
                    if any(sum(r for k, r in zip(kinds, reps, strict=True) if k == t) != units[t]
                           for t in range(len(types))):
                        continue
                    v, on = comm, total
                    for (a, b), k, r in zip(bounds, kinds, reps, strict=True):
                        ty = types[k]
                        if ty.levels:
                            scaled = [replace(x, forward_s=x.forward_s / ty.speed,
                                              backward_input_s=x.backward_input_s / ty.speed,
                                              backward_weight_s=x.backward_weight_s / ty.speed)
                                      for x in layers]
                            unit = _brute(scaled, list(ty.levels), len(ty.levels) - 1, a, b,
                                          ty.levels[-1].units)
                        else:
                            if not _fits(layers, a, b, ty, r, on, policy, static):
                                v = math.inf
                            unit = (sum(x.compute_s for x in layers[a:b + 1]) / ty.speed
                                    if ty.profile is None else
                                    sum(sum(row) for row in ty.profile[a:b + 1]))
                        sync = 2 * (r - 1) / r * sum(x.weight_bytes for x in layers[a:b + 1]) / bw
                        v = max(v, max(unit, sync) / r)
                        on -= r * ty.unit_devices
                    best = min(best, v)
    return best


@pytest.mark.parametrize("seed", range(10))
def test_two_types_match_brute_force(seed: int) -> None:
    """2 types x 2 devices, 4 to 6 layers, random speeds; the odd seeds with memory limits
    (they bind on seeds 1, 7 and 9, and leave no plan on 3 and 5), the weight policies in
    turn."""
    rng = random.Random(200 + seed)
    layers = _random_layers(rng, rng.randint(4, 6))
    layers = [replace(x, activation_bytes=rng.uniform(0, 1e9)) for x in layers]
    mem = (lambda: rng.uniform(2e9, 8e9)) if seed % 2 else (lambda: None)
    types = [DeviceType("slow", 2, speed=rng.uniform(0.3, 1.0), memory=mem()),
             DeviceType("fast", 2, speed=rng.uniform(1.0, 3.0), memory=mem())]
    policy = ("stash", "2bw", "pipemare")[seed % 3]
    want = _brute_hetero(layers, types, 1e9, policy, 1e8)
    if not math.isfinite(want):
        with pytest.raises(ConfigError, match="memory: no plan"):
            plan_cluster(layers, types, 1e9, policy=policy, static_bytes=1e8)
        return
    got = plan_cluster(layers, types, 1e9, policy=policy, static_bytes=1e8)
    assert got.period == pytest.approx(want)
    assert [sum(s.replicas for s in got.stages if s.device_type == t) for t in (0, 1)] == [2, 2]
    firsts = [s.first for s in got.stages]
    assert firsts == [0] + [s.last + 1 for s in got.stages[:-1]]
    assert got.stages[-1].last == len(layers) - 1
    # the plan's own period, recomputed from its stages by the brute force's formulas
    on, worst = 4, 0.0
    for s in got.stages:
        ty = types[s.device_type]
        assert _fits(layers, s.first, s.last, ty, s.replicas, on, policy, 1e8)
        w = sum(x.weight_bytes for x in layers[s.first:s.last + 1])
        c = sum(x.compute_s for x in layers[s.first:s.last + 1]) / ty.speed
        worst = max(worst, max(c, 2 * (s.replicas - 1) / s.replicas * w / 1e9) / s.replicas)
        on -= s.replicas
    worst = max(worst, *(layers[s.last].output_bytes / 1e9 for s in got.stages[:-1]))
    assert worst == pytest.approx(got.period)


@pytest.mark.parametrize("seed", range(3))
def test_types_with_inner_levels_match_brute_force(seed: int) -> None:
    """Each type's top-level units are nodes of 2 devices (its own inner bandwidth): the DP
    over the units left of each type composed with each type's own hierarchy."""
    rng = random.Random(300 + seed)
    layers = _random_layers(rng, rng.randint(3, 5))
    types = [DeviceType("a", 1, (Level(2, 1e10),), rng.uniform(0.3, 1.0)),
             DeviceType("b", 2 - seed % 2, (Level(2, 5e9),), rng.uniform(1.0, 3.0))]
    got = plan_cluster(layers, types, 1e9)
    assert got.period == pytest.approx(_brute_hetero(layers, types, 1e9))
    assert got.devices == sum(t.devices for t in types)


def _hand_layers() -> list[Layer]:
    """F + B + W of 1, 1 and 6 s (two light layers, then a heavy one); tiny messages and
    weights; 1 GB of weights on the heavy layer."""
    return [Layer("a", 0.5, 0.25, 0.25, 1.0, 1.0), Layer("b", 0.5, 0.25, 0.25, 1.0, 1.0),
            Layer("heavy", 3.0, 1.5, 1.5, 1.0, 1e9)]


def test_the_fast_device_gets_the_heavy_layer_by_hand() -> None:
    """One slow (speed 1) and one fast device (speed 2), both used. Cut after b: slow runs
    a, b (2 s), fast the heavy layer (6 / 2 = 3 s): period 3. The other choices: fast on a,
    b and slow on heavy: max(1, 6) = 6; cut after a: max(1, 7 / 2) = 3.5 with fast on
    b, heavy, or max(0.5, 7) = 7."""
    types = [DeviceType("slow", 1, speed=1.0), DeviceType("fast", 1, speed=2.0)]
    got = plan_cluster(_hand_layers(), types, 1e3)
    assert got.period == pytest.approx(3.0)
    assert [(s.first, s.last, got.types[s.device_type].name) for s in got.stages] == [
        (0, 1, "slow"), (2, 2, "fast")]
    prob, reps = plan_problem(_hand_layers(), got)
    assert prob.forward == pytest.approx((1.0, 1.5)) and reps == (1, 1)
    assert prob.backward_weight == pytest.approx((0.5, 0.75))
    assert prob.bandwidth[0][1] == 1e3 and prob.message_size == (1.0,)
    found = solve_periodic(prob, replicas=reps)
    assert check_periodic(found) == []
    assert found.period == pytest.approx(3.0)


def test_memory_sends_the_heavy_layer_to_the_slow_device_by_hand() -> None:
    """The fast device holds 1.5 GB: under PipeDream's stashing, the first stage has
    ceil(2 / 1) = 2 micro-batches in flight (2 weight versions), the last 1. The heavy
    layer's 1 GB of weights fits the fast device only as the last stage (1 version), which
    is the plan above; 0.9 GB does not fit it at all, so it goes to the slow one: period 6
    (fast on a, b: 1 s; slow on the heavy layer: 6 s; cut after a: 7 s)."""
    layers = _hand_layers()
    fit = [DeviceType("slow", 1, speed=1.0, memory=1e10),
           DeviceType("fast", 1, speed=2.0, memory=1.5e9)]
    assert plan_cluster(layers, fit, 1e3).period == pytest.approx(3.0)
    small = [fit[0], replace(fit[1], memory=0.9e9)]
    got = plan_cluster(layers, small, 1e3)
    assert got.period == pytest.approx(6.0)
    assert [(s.first, s.last, got.types[s.device_type].name) for s in got.stages] == [
        (0, 1, "fast"), (2, 2, "slow")]
    # The heavy layer first: 2 versions of 1 GB on the first stage under stashing, 1 under
    # PipeMare; 1.5 GB on both devices fits only the latter.
    first = [Layer("heavy", 3.0, 1.5, 1.5, 1.0, 1e9), *layers[:2]]
    both = [replace(fit[0], memory=1.5e9), fit[1]]
    assert plan_cluster(first, both, 1e3, policy="pipemare").period == pytest.approx(3.0)
    with pytest.raises(ConfigError, match="memory: no plan"):
        plan_cluster(first, both, 1e3, policy="stash")
    with pytest.raises(ConfigError, match="memory: no plan"):
        plan_cluster(layers, [replace(fit[0], memory=1e9), replace(fit[1], memory=1e9)],
                     1e3, static_bytes=10.0)
    prob, _ = plan_problem(layers, got, static_bytes=5.0)
    assert prob.memory_limit == (0.9e9, 1e10)
    assert prob.static_memory == (7.0, 5.0 + 1e9)  # one copy of each stage's weights


def test_bad_device_types_are_named() -> None:
    layers = _hand_layers()
    with pytest.raises(ConfigError, match="device_types: the planner needs at least one"):
        plan_cluster(layers, [], 1e9)
    for bad, key in ((DeviceType("x", 1, speed=0.0), r"device_types\[0\]\.speed"),
                     (DeviceType("x", 1, speed=-1.0), r"device_types\[0\]\.speed"),
                     (DeviceType("x", 0), r"device_types\[0\]\.units"),
                     (DeviceType("x", 1, memory=0.0), r"device_types\[0\]\.memory"),
                     (DeviceType("x", 1, (Level(0, 1.0),)), r"device_types\[0\]\.levels\[0\]")):
        with pytest.raises(ConfigError, match=key):
            plan_cluster(layers, [bad], 1e9)
    with pytest.raises(ConfigError, match=r"device_types\[1\]\.name"):
        plan_cluster(layers, [DeviceType("x", 1), DeviceType("x", 1)], 1e9)
    with pytest.raises(ConfigError, match="policy: unknown weight policy"):
        plan_cluster(layers, [DeviceType("x", 1)], 1e9, policy="stale")
    with pytest.raises(ConfigError, match="device_types: 3 layers cannot use every device type"):
        plan_cluster(layers, [DeviceType(n, 1) for n in "abcd"], 1e9)


def _structures(layers: list[Layer], levels: tuple[Level, ...], speed: float, k: int, a: int,
                b: int, m: int) -> list[tuple[float, list[tuple[int, int, int]]]]:
    """Every pipeline of layers a..b on m units of level k (the planner's formulas, each
    unit's inner pipeline chosen freely, no DP): (period, flattened stages as (first, last,
    replicas))."""
    out = []
    bw = levels[k].bandwidth
    n = b - a + 1
    for parts in range(1, min(n, m) + 1):
        for sizes in _compositions(n, parts):
            ends = list(itertools.accumulate(sizes))
            bounds = [(a + e0, a + e1 - 1) for e0, e1 in zip((0, *ends[:-1]), ends, strict=True)]
            comm = max((layers[y].output_bytes / bw for _, y in bounds[:-1]), default=0.0)
            for reps in _compositions(m, parts):
                options = []
                for (x, y), r in zip(bounds, reps, strict=True):
                    sync = 2 * (r - 1) / r * sum(q.weight_bytes for q in layers[x:y + 1]) / bw
                    units = ([(sum(q.compute_s for q in layers[x:y + 1]) / speed, [(x, y, 1)])]
                             if k == 0 else
                             _structures(layers, levels, speed, k - 1, x, y, levels[k - 1].units))
                    options.append([(max(v, sync) / r, [(f, g, q * r) for f, g, q in st])
                                    for v, st in units])
                for combo in itertools.product(*options):
                    out.append((max(comm, *(v for v, _ in combo)),
                                [s for _, st in combo for s in st]))
    return out


@pytest.mark.parametrize("seed", range(9))
def test_memory_with_inner_levels_matches_every_flattened_plan(seed: int) -> None:
    """Types of nodes of 2 devices with memory limits: the DP (the devices after a stage
    carried in its state, through the levels) against every hierarchical plan, each checked
    for memory on its flattened stages (devices from a stage on counted from the list).
    Memory binds on seeds 2, 3, 4 and 8 (the period grows) and leaves no plan on 7."""
    rng = random.Random(400 + seed)
    layers = [replace(x, activation_bytes=rng.uniform(0, 1e9))
              for x in _random_layers(rng, rng.randint(3, 5))]
    types = [DeviceType("a", 1, (Level(2, 1e10),), rng.uniform(0.3, 1.0),
                        rng.uniform(3e9, 9e9)),
             DeviceType("b", 1 + seed % 2, (Level(2, 5e9),), rng.uniform(1.0, 3.0),
                        rng.uniform(3e9, 9e9))]
    policy = ("stash", "2bw", "pipemare")[seed % 3]
    total = sum(t.devices for t in types)
    best = math.inf
    n = len(layers)
    for parts in range(1, n + 1):
        for sizes in _compositions(n, parts):
            ends = list(itertools.accumulate(sizes))
            bounds = [(e0, e1 - 1) for e0, e1 in zip((0, *ends[:-1]), ends, strict=True)]
            comm = max((layers[y].output_bytes / 1e9 for _, y in bounds[:-1]), default=0.0)
            for kinds in itertools.product(range(2), repeat=parts):
                for reps in itertools.product(range(1, 3), repeat=parts):
                    if any(sum(r for q, r in zip(kinds, reps, strict=True) if q == t)
                           != types[t].units for t in range(2)):
                        continue
                    options = []
                    for (x, y), t, r in zip(bounds, kinds, reps, strict=True):
                        ty = types[t]
                        levels = (*ty.levels, Level(ty.units, 1e9))
                        sync = 2 * (r - 1) / r * sum(q.weight_bytes for q in layers[x:y + 1]) / 1e9
                        options.append([(max(v, sync) / r, [(f, g, q * r, t) for f, g, q in st])
                                        for v, st in _structures(layers, levels, ty.speed, 0, x,
                                                                 y, 2)])
                    for combo in itertools.product(*options):
                        flat = [s for _, st in combo for s in st]
                        assert sum(s[2] for s in flat) == total
                        on = total
                        ok = True
                        for f, g, r, t in flat:
                            ok = ok and _fits(layers, f, g, types[t], r, on, policy, 0.0)
                            on -= r
                        if ok:
                            best = min(best, max(comm, *(v for v, _ in combo)))
    if not math.isfinite(best):
        with pytest.raises(ConfigError, match="memory: no plan"):
            plan_cluster(layers, types, 1e9, policy=policy)
        return
    got = plan_cluster(layers, types, 1e9, policy=policy)
    assert got.period == pytest.approx(best)
    on = total
    for s in got.stages:  # the chosen plan's own stages fit
        assert _fits(layers, s.first, s.last, types[s.device_type], s.replicas, on, policy, 0.0)
        on -= s.replicas
    assert on == 0


def test_a_very_slow_device_is_left_idle_when_allowed_by_hand() -> None:
    """Layers of 1, 1 and 6 s on a slow device (speed 0.1) and a fast one (speed 2). Using
    both, the best is the slow device on a (10 s) and the fast on b and the heavy layer
    (3.5 s): 10 s (slow on a, b: 20 s; slow on the heavy layer: 60 or 70 s). The fast one
    alone runs the 8 s of work in 4 s; ``every_node=False`` finds it."""
    types = [DeviceType("slow", 1, speed=0.1), DeviceType("fast", 1, speed=2.0)]
    both = plan_cluster(_hand_layers(), types, 1e3)
    assert both.period == pytest.approx(10.0) and both.devices == 2
    alone = plan_cluster(_hand_layers(), types, 1e3, every_node=False)
    assert alone.period == pytest.approx(4.0) and alone.devices == 1
    assert [(s.first, s.last, alone.types[s.device_type].name) for s in alone.stages] == [
        (0, 2, "fast")]
    # speed 0.5: both (slow on a: 2 s, fast on b + heavy: 3.5 s) beat the fast one alone
    half = [replace(types[0], speed=0.5), types[1]]
    assert plan_cluster(_hand_layers(), half, 1e3, every_node=False).devices == 2


@pytest.mark.parametrize("seed", range(6))
def test_idle_nodes_match_the_best_sub_cluster_by_brute_force(seed: int) -> None:
    """``every_node=False`` is the best plan over every sub-cluster (each type's count from 0
    up), each brute-forced with every device of it in use; memory on the odd seeds."""
    rng = random.Random(500 + seed)
    layers = [replace(x, activation_bytes=rng.uniform(0, 1e9))
              for x in _random_layers(rng, rng.randint(3, 5))]
    mem = (lambda: rng.uniform(2e9, 8e9)) if seed % 2 else (lambda: None)
    types = [DeviceType("slow", 2, speed=rng.uniform(0.1, 0.6), memory=mem()),
             DeviceType("fast", 2, speed=rng.uniform(1.0, 3.0), memory=mem())]
    want = min(_brute_hetero(layers, [replace(t, units=c) for t, c in zip(types, n, strict=True)
                                      if c], 1e9)
               for n in itertools.product(range(3), repeat=2) if any(n))
    if not math.isfinite(want):
        with pytest.raises(ConfigError, match="memory: no plan of the layers fits"):
            plan_cluster(layers, types, 1e9, every_node=False)
        return
    got = plan_cluster(layers, types, 1e9, every_node=False)
    assert got.period == pytest.approx(want)
    try:
        full = plan_cluster(layers, types, 1e9).period
    except ConfigError:  # no plan that uses every device fits memory
        full = math.inf
    assert got.period <= full * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_a_types_own_profile_matches_brute_force(seed: int) -> None:
    """One type with its own per-layer times (as HetPipe profiles each GPU type: some layers
    gain more than others), beside one scaled by a speed; memory on the odd seeds."""
    rng = random.Random(600 + seed)
    layers = [replace(x, activation_bytes=rng.uniform(0, 1e9))
              for x in _random_layers(rng, rng.randint(4, 6))]
    own = tuple((x.forward_s / g, x.backward_input_s / g, x.backward_weight_s / g)
                for x, g in ((x, rng.choice([1.0, 1.5, 4.0])) for x in layers))
    mem = (lambda: rng.uniform(2e9, 8e9)) if seed % 2 else (lambda: None)
    types = [DeviceType("scaled", 2, speed=rng.uniform(0.5, 2.0), memory=mem()),
             DeviceType("own", 2, memory=mem(), profile=own)]
    want = _brute_hetero(layers, types, 1e9)
    if not math.isfinite(want):
        with pytest.raises(ConfigError, match="memory: no plan"):
            plan_cluster(layers, types, 1e9)
        return
    got = plan_cluster(layers, types, 1e9)
    assert got.period == pytest.approx(want)
    prob, _ = plan_problem(layers, got)
    for k, st in enumerate(got.stages):  # the problem's times are the type's own
        if st.device_type == 1:
            assert prob.forward[k] == pytest.approx(sum(own[x][0] for x in
                                                        range(st.first, st.last + 1)))
            assert prob.backward_weight[k] == pytest.approx(sum(own[x][2] for x in
                                                                range(st.first, st.last + 1)))
        else:
            assert prob.forward[k] == pytest.approx(sum(
                x.forward_s for x in layers[st.first:st.last + 1]) / types[0].speed)


def test_bad_profiles_are_named() -> None:
    layers = _hand_layers()
    with pytest.raises(ConfigError, match=r"device_types\[0\]\.profile: expected 3 layers"):
        plan_cluster(layers, [DeviceType("x", 1, profile=((1.0, 1.0, 1.0),))], 1e3)
    with pytest.raises(ConfigError, match=r"device_types\[0\]\.profile\[1\]: must be 3"):
        plan_cluster(layers, [DeviceType("x", 1, profile=((1.0, 1.0, 1.0), (1.0, -1.0, 0.0),
                                                             (1.0, 1.0, 1.0)))], 1e3)
    with pytest.raises(ConfigError, match=r"device_types\[0\]\.speed: not with its own"):
        plan_cluster(layers, [DeviceType("x", 1, speed=2.0, profile=((1.0, 1.0, 1.0),) * 3)],
                     1e3)
