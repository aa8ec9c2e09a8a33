"""Buckets, the one-step delayed reduction and several iterations in one graph
(pipeopt.workloads.dataparallel), checked on instances timed by hand."""

from __future__ import annotations

import dataclasses
import random

import pytest

from pipeopt.core.bounds import lower_bound
from pipeopt.core.cpsat import solve_cpsat
from pipeopt.core.greedy import solve_greedy
from pipeopt.core.simulate import simulate
from pipeopt.core.validate import check
from pipeopt.problem import uniform_problem
from pipeopt.schedules import GENERATORS
from pipeopt.workloads import dataparallel as dpw


def _one_stage(iterations: int, delayed: bool) -> tuple[object, dpw.DataParallel]:
    """One device, one micro-batch: F = 1 s, fused B = 1 s; 2 replicas; an all-reduce of
    2 GB at 1 GB/s without latency: 2 (n - 1) / n * 2e9 / 1e9 = 2 s."""
    prob = uniform_problem(1, 1, 1.0, 1.0, 0.0, split_backward=False)
    dp = dpw.DataParallel(replicas=2, grad_bytes=(2e9,), latency=0.0, bandwidth=1e9,
                          reduction="all_reduce", iterations=iterations, delayed=delayed)
    return prob, dp


@pytest.mark.parametrize(("iterations", "delayed", "makespan"), [
    # synchronous: F B AR | F B AR | ...: 4 s per iteration
    (2, False, 8.0), (3, False, 12.0),
    # delayed: F' B' run while AR 0 does (2..4); AR 1 after AR 0 (4..6); iteration 2's
    # forward waits for AR 0 only (F'' 4..5, B'' 5..6), AR 2 6..8
    (2, True, 6.0), (3, True, 8.0),
])
def test_delayed_reduction_by_hand(iterations: int, delayed: bool, makespan: float) -> None:
    prob, dp = _one_stage(iterations, delayed)
    g = dpw.build(prob, dp)  # type: ignore[arg-type]
    assert g.num_tasks == iterations * 5 and dict(g.meta)["iterations"] == iterations
    hand = simulate(g, dpw.task_orders(prob, dp, GENERATORS["1f1b"](prob)))  # type: ignore
    assert check(hand) == [] and hand.makespan == pytest.approx(makespan)
    # the hand-made order is optimal here: the critical path (or the ring's load) meets it
    assert lower_bound(g) == pytest.approx(makespan)
    assert dpw.iteration_time(hand) == pytest.approx(makespan / iterations)
    ends = dpw.iteration_ends(hand)
    assert len(ends) == iterations and ends[-1] == pytest.approx(makespan)
    if not delayed:  # each iteration ends 4 s after the previous one
        assert ends == pytest.approx(tuple(4.0 * (j + 1) for j in range(iterations)))
    # per iteration the ring carries 2 s and the device 2 s: a period of >= 2 s
    assert dpw.periodic_bound(g) == pytest.approx(2.0)


def test_delayed_edges_exactly() -> None:
    """Which dependency moves: iteration 1's forward waits for iteration 0's reduction without
    the delay and not with it; iteration 2's forward waits for iteration 0's (not 1's)."""
    for delayed in (False, True):
        prob, dp = _one_stage(3, delayed)
        g = dpw.build(prob, dp)  # type: ignore[arg-type]
        idx = {x: i for i, x in enumerate(g.label)}
        edges = {(g.label[a], g.label[b]) for a, b in zip(g.src, g.dst, strict=True)}
        assert ("i0.AR 0", "i1.AR 0") in edges and ("i1.AR 0", "i2.AR 0") in edges
        assert (("i0.AR 0", "i1.r0.0F0") in edges) is not delayed
        assert (("i0.AR 0", "i2.r1.0F0") in edges) is delayed
        assert (("i1.AR 0", "i2.r0.0F0") in edges) is not delayed
        # the validator rejects the forward that waits for iteration 0's reduction when it
        # starts before that reduction ends
        sched = simulate(g, dpw.task_orders(prob, dp, GENERATORS["1f1b"](prob)))  # type: ignore
        assert check(sched) == []
        target = "i2.r0.0F0" if delayed else "i1.r0.0F0"
        ar0, f = idx["i0.AR 0"], idx[target]
        start, end = list(sched.start), list(sched.end)
        shift = start[f] + 0.5 - end[ar0]
        start[ar0] += shift
        end[ar0] += shift
        bad = dataclasses.replace(sched, start=tuple(start), end=tuple(end))
        assert any(v.startswith(f"i0.AR 0 -> {target}: {target} starts at")
                   for v in check(bad))


def test_zero1_delay_moves_the_all_gather() -> None:
    """ZeRO-1: iteration j's reduce-scatter feeds iteration j + 1's all-gather, or j + 2's
    with the delay; forwards always wait for their own iteration's all-gather."""
    prob = uniform_problem(2, 2, 1.0, 1.0, 1.0)
    for delayed, target in ((False, "i1.AG 0"), (True, "i2.AG 0")):
        dp = dpw.DataParallel(replicas=2, grad_bytes=(1e9, 1e9), latency=0.0, bandwidth=1e9,
                              iterations=3, delayed=delayed)
        g = dpw.build(prob, dp)
        edges = {(g.label[a], g.label[b]) for a, b in zip(g.src, g.dst, strict=True)}
        assert ("i0.RS 0", target) in edges
        assert ("i1.AG 0", "i1.r1.0F1") in edges
        assert not any(a == "i0.RS 0" and "F" in b for a, b in edges)


def test_buckets_by_hand() -> None:
    """2 stages, 1 micro-batch, F = B = W = 1 s, 2 replicas, all-reduce of 2 GB at 1 GB/s (2 s)
    per stage, rings apart. Device 0: F0 0..1, B0 3..4, W0 4..5; device 1: W1 3..4. One
    bucket: AR 1 4..6, AR 0 5..7: 7 s. Two buckets of 1 GB (1 s each), each half of the last
    W: stage 0's bucket 0 starts when W0's first half ends (4.5), bucket 1 after it
    (5.5..6.5): 6.5 s; stage 1's end at 4.5 + 1 + 1 = 6.5 - 1.0 = 5.5."""
    prob = uniform_problem(2, 1, 1.0, 1.0, 1.0)
    one = dpw.DataParallel(replicas=2, grad_bytes=(2e9, 2e9), latency=0.0, bandwidth=1e9,
                           reduction="all_reduce")
    two = dataclasses.replace(one, bucket_bytes=((1e9, 1e9),) * 2,
                              bucket_share=((0.5, 0.5),) * 2)
    for dp, makespan in ((one, 7.0), (two, 6.5)):
        g = dpw.build(prob, dp)
        sched = simulate(g, dpw.task_orders(prob, dp, GENERATORS["zb-h1"](prob)))
        assert check(sched) == [] and sched.makespan == pytest.approx(makespan)
    g = dpw.build(prob, two)
    idx = {x: i for i, x in enumerate(g.label)}
    assert g.duration[idx["r0.0W0/b0"]] == pytest.approx(0.5)
    assert g.duration[idx["r0.0W0/b1"]] == pytest.approx(0.5)
    assert [g.label[i] for i in g.comm_tasks] == ["AR 0.b0", "AR 0.b1", "AR 1.b0", "AR 1.b1"]
    assert sched.start[idx["AR 0.b0"]] == pytest.approx(4.5)
    assert sched.end[idx["AR 1.b1"]] == pytest.approx(5.5)
    # the W's memory: allocated by the first piece, freed by the last, as the whole W did
    w = dpw.build(prob, one)
    w0 = w.label.index("r0.0W0")
    assert g.mem_start[idx["r0.0W0/b0"]] == w.mem_start[w0]
    assert g.mem_end[idx["r0.0W0/b1"]] == w.mem_end[w0]
    assert sched.peak_memory == simulate(w, dpw.task_orders(
        prob, one, GENERATORS["zb-h1"](prob))).peak_memory


def test_bucket_latency_is_paid_per_bucket() -> None:
    """Every bucket pays the ring's latency: 2 buckets of 1 GB over 2 replicas at 1 GB/s and
    10 ms cost 2 x (0.01 + 0.5) against 0.01 + 1.0 for one."""
    dp = dpw.DataParallel(replicas=2, grad_bytes=(2e9,), latency=0.01, bandwidth=1e9,
                          bucket_bytes=((1e9, 1e9),), bucket_share=((0.5, 0.5),))
    gather, reduce = dp.stage_times([0])
    assert reduce == ((pytest.approx(0.51), pytest.approx(0.51)),)
    assert gather == (pytest.approx(0.01 + 0.5 * 2e9 / 1e9),)


def test_pipelined_orders_need_the_delay() -> None:
    """No flush between iterations: valid and shorter with the delay, 3 iterations, p = 2."""
    prob = uniform_problem(2, 4, 1.0, 1.0, 1.0)
    dp = dpw.DataParallel(replicas=2, grad_bytes=(1e9, 1e9), latency=0.0, bandwidth=1e10,
                          iterations=3, delayed=True)
    g = dpw.build(prob, dp)
    long = prob.replace(microbatches=12)
    flush = simulate(g, dpw.task_orders(prob, dp, GENERATORS["zb-h1"](prob)))
    piped = simulate(g, dpw.task_orders(prob, dp, GENERATORS["zb-h1"](long), pipelined=True))
    assert check(flush) == [] and check(piped) == []
    assert piped.makespan < flush.makespan
    with pytest.raises(ValueError, match="micro-batch 12"):
        dpw.task_orders(prob, dp, GENERATORS["zb-h1"](prob.replace(microbatches=13)),
                        pipelined=True)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"iterations": 0}, "iterations: must be an integer in 1..16"),
    ({"delayed": 1}, "delayed: must be true or false"),
    ({"bucket_bytes": ((1.0,),)}, "bucket_bytes: expected 2 rows"),
    ({"bucket_bytes": ((0.5, 0.5), (1.0,)), "bucket_share": ((1.0,), (1.0,))},
     r"bucket_share\[0\]: expected 2 values"),
    ({"bucket_bytes": ((0.5, 0.4), (1.0,)), "bucket_share": ((0.5, 0.5), (1.0,))},
     r"bucket_bytes\[0\]: must sum to grad_bytes\[0\]"),
    ({"bucket_bytes": ((0.5, 0.5), (1.0,)), "bucket_share": ((0.5, 0.6), (1.0,))},
     r"bucket_share\[0\]: fractions in \[0, 1\] summing to 1"),
    ({"ring_cost": (dpw.LinkCost(0.0, 1.0),)}, "ring_wan: expected 1 values"),
])
def test_bad_options_are_named(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"replicas": 2, "grad_bytes": (1.0, 1.0), "latency": 0.0,
                               "bandwidth": 1.0}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        dpw.DataParallel(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(5))
def test_random_delayed_bucketed_instances(seed: int) -> None:
    """Random small instances with buckets, the delay and 2-3 iterations: hand-made orders
    (flushed and, with the delay, pipelined), the greedy and CP-SAT (hinted by the hand-made
    one) pass the validator, sit at or above the bound, and CP-SAT is no worse than its hint."""
    rng = random.Random(seed)
    p, m = rng.choice([(2, 2), (2, 3), (3, 3)])
    prob = uniform_problem(p, m, rng.uniform(0.5, 1.5), rng.uniform(0.5, 1.5),
                           rng.uniform(0.2, 1.0))
    nb = rng.choice([1, 2, 3])
    grads = tuple(rng.uniform(0.5e9, 3e9) for _ in range(p))
    delayed = rng.random() < 0.7
    dp = dpw.DataParallel(replicas=2, grad_bytes=grads, latency=1e-3, bandwidth=2e9,
                          datacenter=(0, 1), wan_latency=0.01, wan_bandwidth=1.25e9,
                          reduction=rng.choice(["reduce_scatter", "all_reduce"]),
                          bucket_bytes=tuple((x / nb,) * nb for x in grads),
                          bucket_share=((1 / nb,) * nb,) * p, delayed=delayed,
                          iterations=rng.choice([2, 3]))
    g = dpw.build(prob, dp)
    bound = lower_bound(g)
    hand = simulate(g, dpw.task_orders(prob, dp, GENERATORS["zb-h1"](prob)))
    runs = [hand, solve_greedy(g)]
    if delayed:
        long = prob.replace(microbatches=m * dp.iterations)
        runs.append(simulate(g, dpw.task_orders(prob, dp, GENERATORS["zb-h1"](long),
                                                pipelined=True)))
    best = solve_cpsat(g, time_limit=3, workers=1, initial=hand)
    for sched in (*runs, best):
        assert check(sched) == []
        assert sched.objective >= bound - 1e-9
        assert dpw.iteration_time(sched) >= bound / dp.iterations - 1e-9
    assert best.objective <= hand.objective + 1e-9


def test_delay_buffers_count_as_static_memory() -> None:
    """With the delay, each stage's second buffers sit on its device on every replica."""
    prob = uniform_problem(2, 2, 1.0, 1.0, 1.0).replace(static_memory=(1.0, 2.0))
    dp = dpw.DataParallel(replicas=2, grad_bytes=(1.0, 1.0), latency=0.0, bandwidth=1e9,
                          buffer_memory=(0.5, 0.25), iterations=2)
    assert dpw.build(prob, dp).static_memory == (1.0, 2.0, 1.0, 2.0)
    delayed = dpw.build(prob, dataclasses.replace(dp, delayed=True))
    assert delayed.static_memory == (1.5, 2.25, 1.5, 2.25)
    with pytest.raises(ValueError, match="buffer_memory: expected 2 values"):
        dataclasses.replace(dp, buffer_memory=(1.0,))


def test_cpsat_initial_schedule() -> None:
    """An initial schedule hints CP-SAT when it is shorter than the greedy's, and the result
    is never longer than it; a schedule of another graph is refused."""
    prob = uniform_problem(2, 3, 1.0, 1.0, 1.0)
    dp = dpw.DataParallel(replicas=2, grad_bytes=(2e9, 2e9), latency=0.0, bandwidth=1e9,
                          iterations=2, delayed=True)
    g = dpw.build(prob, dp)
    hand = simulate(g, dpw.task_orders(prob, dp, GENERATORS["zb-h1"](prob)), "zb-h1")
    best = solve_cpsat(g, time_limit=2, workers=1, initial=hand)
    assert check(best) == [] and best.objective <= hand.objective + 1e-9
    assert best.method in ("cpsat", "cpsat:zb-h1", "cpsat:greedy")
    other = dpw.build(prob, dataclasses.replace(dp, iterations=1))
    with pytest.raises(ValueError, match="initial: a schedule of another graph"):
        solve_cpsat(other, time_limit=1, workers=1, initial=hand)
