"""Data parallelism as CrossPipe models it (pipeopt.workloads.dataparallel): collectives as
communication tasks over replicas of the training graph."""

from __future__ import annotations

import dataclasses
from itertools import pairwise

import pytest

from pipeopt.core.bounds import lower_bound
from pipeopt.core.cpsat import solve_cpsat
from pipeopt.core.greedy import solve_greedy
from pipeopt.core.simulate import simulate
from pipeopt.core.validate import check
from pipeopt.problem import Op, uniform_problem
from pipeopt.schedules import GENERATORS
from pipeopt.workloads import dataparallel as dpw


def _two_by_two() -> tuple[object, dpw.DataParallel]:
    """2 stages x 2 replicas in two datacenters, one micro-batch: F = 1 s, fused B = 2 s;
    over a 1 GB/s WAN without latency a 2-rank all-gather of 1 GB takes 1/2 * 1e9 / 1e9 =
    0.5 s and a reduce-scatter of 3 GB 1.5 s; both stages' collectives share the WAN."""
    prob = uniform_problem(2, 1, 1.0, 2.0, 0.0, split_backward=False)
    dp = dpw.DataParallel(replicas=2, grad_bytes=(3e9, 3e9), param_bytes=(1e9, 1e9),
                          latency=1e-6, bandwidth=1e11, datacenter=(0, 1), wan_latency=0.0,
                          wan_bandwidth=1e9)
    return prob, dp


def test_graph_shape() -> None:
    prob, dp = _two_by_two()
    g = dpw.build(prob, dp)  # type: ignore[arg-type]
    assert g.devices == 4 and g.num_tasks == 2 * 4 + 4
    assert g.label[8:] == ("AG 0", "RS 0", "AG 1", "RS 1")
    assert g.duration[8:] == pytest.approx((0.5, 1.5, 0.5, 1.5))
    # Stage 0's ring: devices 0 <-> 2 (replica 0 and 1 of device 0), then the WAN.
    ring0 = [(g.link_src[k], g.link_dst[k]) for k in g.holds[8] if k < g.num_links]
    assert sorted(ring0) == [(0, 2), (2, 0)]
    assert g.networks == ("wan",) and g.holds[8][-1] == g.num_links
    # AG 0 feeds stage 0's forward on both replicas; RS 1 waits for stage 1's B on both.
    assert sorted(g.label[b] for a, b in zip(g.src, g.dst, strict=True) if a == 8) == [
        "r0.0F0", "r1.0F0"]
    assert sorted(g.label[a] for a, b in zip(g.src, g.dst, strict=True) if b == 11) == [
        "r0.1B0", "r1.1B0"]
    assert dict(g.meta)["workload"] == "dataparallel"


def test_two_stages_two_replicas_optimum_by_hand() -> None:
    """AG 0 0..0.5, F0 0.5..1.5 (AG 1 0.5..1 on the WAN, in time for F1), F1 1.5..2.5, B1
    2.5..4.5, B0 4.5..6.5; RS 1 4.5..6 runs hidden behind stage 0's backward; RS 0 6.5..8.
    8 is the critical path AG 0 + F0 + F1 + B1 + B0 + RS 0 = 0.5 + 1 + 1 + 2 + 2 + 1.5, so it
    is the optimum."""
    prob, dp = _two_by_two()
    g = dpw.build(prob, dp)  # type: ignore[arg-type]
    assert lower_bound(g) == pytest.approx(8.0)
    best = solve_cpsat(g, time_limit=10, workers=1)
    assert best.objective == pytest.approx(8.0) and best.status == "optimal"
    assert check(best) == []
    rs1, rs0 = g.label.index("RS 1"), g.label.index("RS 0")
    for r in (0, 1):
        b0 = g.label.index(f"r{r}.0B0")
        assert best.start[b0] <= best.start[rs1] and best.end[rs1] <= best.end[b0]  # hidden
    assert best.start[rs0] == pytest.approx(6.5)
    # A hand-made order (1F1B, Megatron-style collectives as early as allowed) meets it too.
    orders = dpw.task_orders(prob, dp, GENERATORS["1f1b"](prob))  # type: ignore[arg-type]
    mega = simulate(g, orders)
    assert mega.objective == pytest.approx(8.0) and check(mega) == []
    assert (mega.start[rs1], mega.end[rs1]) == pytest.approx((4.5, 6.0))


def test_validator_rejects_a_reduction_before_the_last_w() -> None:
    prob = uniform_problem(2, 2, 1.0, 1.0, 1.0)
    dp = dpw.DataParallel(replicas=2, grad_bytes=(2e9, 2e9), latency=0.0, bandwidth=1e9,
                          reduction="all_reduce")
    g = dpw.build(prob, dp)
    orders = dpw.task_orders(prob, dp, GENERATORS["zb-h1"](prob))
    sched = simulate(g, orders)
    assert check(sched) == []
    ar = g.label.index("AR 0")
    last_w = max((i for i in range(g.num_tasks) if g.label[i].startswith("r0.0W")),
                 key=lambda i: sched.end[i])
    assert sched.start[ar] == pytest.approx(max(sched.end[i] for i in range(g.num_tasks)
                                                if "0W" in g.label[i] and g.device[i] >= 0))
    start, end = list(sched.start), list(sched.end)
    start[ar] -= 0.5
    end[ar] -= 0.5
    bad = dataclasses.replace(sched, start=tuple(start), end=tuple(end))
    found = check(bad)
    assert any(v.startswith(f"{g.label[last_w]} -> AR 0: AR 0 starts at") and
               f"before its input from {g.label[last_w]}" in v for v in found)


def test_all_reduce_mode_and_durations() -> None:
    prob = uniform_problem(2, 2, 1.0, 1.0, 1.0)
    # 4 replicas in one datacenter: ring all-reduce of 1 GB at 10 GB/s, 5 us:
    # 2 * 3 * 5e-6 + 2 * 3 / 4 * 1e9 / 1e10 = 3e-5 + 0.15.
    dp = dpw.DataParallel(replicas=4, grad_bytes=(1e9, 1e9), latency=5e-6, bandwidth=1e10,
                          reduction="all_reduce")
    g = dpw.build(prob, dp)
    assert [g.label[i] for i in g.comm_tasks] == ["AR 0", "AR 1"]
    assert g.duration[g.comm_tasks[0]] == pytest.approx(0.15003)
    assert g.networks == ()
    assert len(g.holds[g.comm_tasks[0]]) == 4  # a one-way ring over 4 replicas
    sched = solve_greedy(g)
    assert check(sched) == [] and sched.objective >= lower_bound(g) - 1e-9


def test_cross_datacenter_reductions_take_turns_on_the_wan() -> None:
    prob = uniform_problem(4, 4, 1.0, 1.0, 1.0)
    dp = dpw.DataParallel(replicas=2, grad_bytes=(4e9,) * 4, latency=0.0, bandwidth=1e11,
                          datacenter=(0, 1), wan_latency=0.01, wan_bandwidth=1.25e9)
    g = dpw.build(prob, dp)
    sched = simulate(g, dpw.task_orders(prob, dp, GENERATORS["zb-h1"](prob)))
    assert check(sched) == []
    spans = sorted((sched.start[i], sched.end[i]) for i in g.comm_tasks)
    assert all(a[1] <= b[0] + 1e-12 for a, b in pairwise(spans))
    best = solve_cpsat(g, time_limit=10, workers=1)
    assert check(best) == [] and best.objective <= sched.objective + 1e-9


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"replicas": 1}, "replicas: must be an integer >= 2, got 1"),
    ({"grad_bytes": (1.0, -1.0)}, r"grad_bytes\[1\]: must be a finite number of bytes"),
    ({"param_bytes": (1.0,)}, "param_bytes: expected 2 values"),
    ({"bandwidth": 0.0}, "bandwidth: must be > 0 bytes/s"),
    ({"latency": -1.0}, "latency: must be a finite number of seconds"),
    ({"datacenter": (0,)}, "datacenter: expected 2 integers"),
    ({"reduction": "ring"}, "reduction: must be 'reduce_scatter' or 'all_reduce'"),
])
def test_bad_data_parallel_is_named(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"replicas": 2, "grad_bytes": (1.0, 1.0), "latency": 0.0,
                               "bandwidth": 1.0}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        dpw.DataParallel(**args)  # type: ignore[arg-type]


def test_build_refuses_a_double_count_and_a_wrong_stage_count() -> None:
    prob = uniform_problem(2, 1, 1.0, 1.0, 1.0)
    dp = dpw.DataParallel(replicas=2, grad_bytes=(1.0, 1.0), latency=0.0, bandwidth=1.0)
    with pytest.raises(ValueError, match="grad_reduce: must be 0"):
        dpw.build(prob.replace(grad_reduce=(1.0, 1.0)), dp)
    with pytest.raises(ValueError, match="grad_bytes: expected 4 values"):
        dpw.build(uniform_problem(2, 1, virtual_stages=2), dp)
    assert dpw.task_orders(prob, dp, [[Op("F", 0, 0)], []]) == [[0], [], [6], []]


@pytest.mark.parametrize("seed", range(6))
def test_random_instances_every_method_is_valid(seed: int) -> None:
    """Random small instances: hand-made orders with collectives as early as allowed, the
    greedy and CP-SAT all pass the validator and sit at or above the bound; CP-SAT is no worse
    than the greedy it starts from."""
    import random

    rng = random.Random(seed)
    p, m = rng.choice([(2, 2), (2, 3), (3, 2)])
    prob = uniform_problem(p, m, rng.uniform(0.5, 1.5), rng.uniform(0.5, 1.5),
                           rng.uniform(0.2, 1.0), latency=rng.choice([0.0, 0.05]))
    dp = dpw.DataParallel(replicas=rng.choice([2, 3]),
                          grad_bytes=tuple(rng.uniform(0.5e9, 3e9) for _ in range(p)),
                          latency=1e-5, bandwidth=rng.choice([1e9, 1e10]),
                          reduction=rng.choice(["reduce_scatter", "all_reduce"]))
    if dp.replicas == 2 and rng.random() < 0.5:
        dp = dataclasses.replace(dp, datacenter=(0, 1), wan_latency=0.03, wan_bandwidth=1.25e9)
    g = dpw.build(prob, dp)
    bound = lower_bound(g)
    hand = simulate(g, dpw.task_orders(prob, dp, GENERATORS["zb-h1"](prob)))
    greedy = solve_greedy(g)
    best = solve_cpsat(g, time_limit=5, workers=1)
    for sched in (hand, greedy, best):
        assert check(sched) == []
        assert sched.objective >= bound - 1e-9
    assert best.objective <= greedy.objective + 1e-9

