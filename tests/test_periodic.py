"""Periodic (asynchronous) pipelines: analytic periods, weight versions, staleness, the checker."""

from __future__ import annotations

import itertools
import json
import math
import random

import networkx as nx
import pytest

from pipeopt.problem import Problem, chain_links, uniform_problem
from pipeopt.schedules.base import NotApplicable
from pipeopt.schedules.periodic import (
    ASYNC_METHODS,
    InvalidPeriodic,
    _arcs,
    async_pattern,
    check_periodic,
    cyclic_schedule,
    validate_periodic,
)
from pipeopt.solvers.periodic import solve_periodic
from pipeopt.workloads.periodic import (
    PatternTask,
    PeriodicError,
    max_in_flight,
    memory_period_bound,
    period_lower_bound,
    round_trip,
    unroll,
)


def chain(f: list[float], b: list[float], w: list[float], *, latency: float = 0.0,
          split: bool = True, limit: float | None = None, static: float = 0.0,
          act: float = 1.0) -> Problem:
    p = len(f)
    lat, bw = chain_links(p, [latency] * (p - 1), [math.inf] * (p - 1))
    return Problem(devices=p, microbatches=4, forward=tuple(f), backward_input=tuple(b),
                   backward_weight=tuple(w), split_backward=split,
                   activation_memory=(act,) * p, latency=lat, bandwidth=bw,
                   memory_limit=(limit,) * p, static_memory=(static,) * p)


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("split", [True, False])
def test_uniform_stages_period_is_one_stage_and_stash_counts_are_p_minus_k(p: int,
                                                                          split: bool) -> None:
    prob = uniform_problem(p, 4, 1.0, 2.0, 0.5, split_backward=split)
    for method in ASYNC_METHODS:
        s = async_pattern(prob, method, weight_bytes=(10.0,) * p)
        assert s.period == pytest.approx(3.5)  # F + B + W of one stage
        assert s.lower_bound == pytest.approx(3.5)
        assert s.in_flight == tuple(p - k for k in range(p))
        assert check_periodic(s) == []
    stash = async_pattern(prob, "pipedream", weight_bytes=(10.0,) * p)
    assert stash.weight_versions == tuple(p - k for k in range(p))  # PipeDream: p - k
    assert stash.staleness == tuple(p - k - 1 for k in range(p))
    # Extra versions beyond the one in static memory, plus p - k activations at the peak.
    assert stash.peak_memory == tuple((p - k - 1) * 10.0 + (p - k) for k in range(p))
    two = async_pattern(prob, "pipedream-2bw", weight_bytes=(10.0,) * p)
    assert two.weight_versions == (2,) * p
    assert two.update_every == p  # at least the micro-batches in flight on stage 0
    assert two.staleness == tuple(1 if k < p - 1 else 0 for k in range(p))
    mare = async_pattern(prob, "pipemare", weight_bytes=(10.0,) * p)
    assert mare.weight_versions == (1,) * p
    assert mare.staleness == tuple(p - k - 1 for k in range(p))  # grows toward stage 0
    assert mare.peak_memory == tuple(float(p - k) for k in range(p))


def test_unbalanced_stages_without_links_run_at_the_slowest_stage() -> None:
    rng = random.Random(3)
    for _ in range(20):
        p = rng.randint(2, 7)
        f = [rng.uniform(0.2, 2) for _ in range(p)]
        b = [rng.uniform(0.2, 3) for _ in range(p)]
        w = [rng.uniform(0, 1) for _ in range(p)]
        s = async_pattern(chain(f, b, w), "pipedream")
        assert s.period == pytest.approx(max(map(sum, zip(f, b, w, strict=True))))
        assert check_periodic(s) == []


def test_latency_costs_1f1b_async_by_hand_and_the_search_hides_it() -> None:
    # p = 2, F = 1, B = 2, W = 0.5, latency 0.7 each way. 1F1B-async keeps 2 micro-batches on
    # stage 0, whose round trip F0 F1 B1 B0 W0 = 1 + .7 + 1 + 2 + .7 + 2 + .5 = 7.9 s must fit
    # in 2 periods: T = max(3.5, 3.95) = 3.95.
    prob = chain([1, 1], [2, 2], [0.5, 0.5], latency=0.7)
    s = async_pattern(prob, "pipedream")
    assert s.period == pytest.approx(3.95)
    found = solve_periodic(prob)
    assert found.period == pytest.approx(3.5)  # 3 in flight on stage 0 hide the latency
    assert found.in_flight == (3, 1)
    assert check_periodic(found) == []


def test_period_is_the_largest_cycle_ratio_by_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(12):
        p = rng.randint(2, 3)
        prob = chain([rng.uniform(0.5, 2) for _ in range(p)],
                     [rng.uniform(0.5, 2) for _ in range(p)],
                     [rng.uniform(0, 1) for _ in range(p)], latency=rng.uniform(0, 1.5),
                     split=rng.random() < 0.6)
        counts = sorted((rng.randint(1, 4) for _ in range(p)), reverse=True)
        n, arcs = _arcs(prob, counts)
        g = nx.MultiDiGraph()
        g.add_nodes_from(range(n))
        for a in arcs:
            g.add_edge(a.src, a.dst, w=a.weight, h=a.height)
        best = 0.0
        simple = nx.DiGraph()
        simple.add_nodes_from(range(n))
        simple.add_edges_from((a.src, a.dst) for a in arcs)
        for cyc in nx.simple_cycles(simple):
            pairs = list(zip(cyc, cyc[1:] + cyc[:1], strict=True))
            # Every choice of parallel arc along the cycle.
            choices = [list(g.get_edge_data(u, v).values()) for u, v in pairs]
            for pick in itertools.product(*choices):
                w, h = sum(e["w"] for e in pick), sum(e["h"] for e in pick)
                assert h > 0  # non-increasing counts never deadlock
                best = max(best, w / h)
        s = cyclic_schedule(prob, counts)
        assert s.period == pytest.approx(max(best, period_lower_bound(prob)))
        assert check_periodic(s) == []


def test_more_in_flight_on_a_later_stage_deadlocks() -> None:
    prob = uniform_problem(3, 4)
    with pytest.raises(NotApplicable, match="in_flight"):
        cyclic_schedule(prob, [1, 2, 1])


def test_the_checker_rejects_a_broken_cross_period_dependency_overlap_and_memory() -> None:
    prob = uniform_problem(3, 4, 1.0, 2.0, 0.5)
    good = async_pattern(prob, "pipedream")
    assert check_periodic(good) == []
    # B of stage 1 moved before B of stage 2 (a later period's copy) ends: the gradient
    # message it needs has not arrived.
    tasks = list(good.tasks)
    i = tasks.index(good.task("B", 1))
    tasks[i] = PatternTask("B", 1, good.task("B", 2).start + 1.0)
    bad = good.replace(tasks=tuple(tasks))
    assert any("before its input" in v for v in check_periodic(bad))
    with pytest.raises(InvalidPeriodic, match="before its input"):
        validate_periodic(bad)
    # A period shorter than a stage's work: copies of different micro-batches overlap.
    assert any("while" in v for v in check_periodic(good.replace(period=3.0)))
    # Stage 0 holds 3 activations at its steady-state peak: a limit of 2.5 is exceeded.
    tight = async_pattern(prob.replace(memory_limit=(2.5, None, None)), "pipedream")
    assert tight.over_memory() == [0]
    assert any("device 0: memory 3 exceeds the limit 2.5" in v for v in check_periodic(tight))


@pytest.mark.parametrize("method", list(ASYNC_METHODS))
def test_steady_state_memory_matches_the_unrolled_schedule(method: str) -> None:
    rng = random.Random(11)
    for _ in range(5):
        p = rng.randint(2, 5)
        prob = chain([rng.uniform(0.5, 2) for _ in range(p)],
                     [rng.uniform(0.5, 2) for _ in range(p)],
                     [rng.uniform(0.1, 1) for _ in range(p)], latency=rng.uniform(0, 1))
        prob = prob.replace(weight_grad_memory=(0.25,) * p, static_memory=(3.0,) * p)
        wb = [rng.uniform(0, 4) for _ in range(p)]
        s = async_pattern(prob, method, weight_bytes=wb)
        assert unroll(s).peak_memory == pytest.approx(s.peak_memory)
        # The search's patterns and replicated stages (devices of one stage alike).
        reps = tuple(rng.randint(1, 3) for _ in range(p))
        found = solve_periodic(prob, wb, ASYNC_METHODS[method], replicas=reps)
        per_device = [found.peak_memory[k] for k in range(p) for _ in range(reps[k])]
        assert unroll(found).peak_memory == pytest.approx(per_device)


def test_memory_caps_in_flight_and_the_search_stays_within_it() -> None:
    # Stash: S + n a + (n - 1) w <= limit with S = 1, a = 1, w = 0.5, limit 3: n <= 1.
    prob = chain([1, 1], [2, 2], [0.5, 0.5], limit=3.0, static=1.0)
    assert max_in_flight(prob, (0.5, 0.5), "stash") == (1, 1)
    assert max_in_flight(prob, (0.5, 0.5), "2bw") == (1, 1)  # 1 + n + 0.5 <= 3
    assert max_in_flight(prob, (0.5, 0.5), "pipemare") == (2, 2)
    # One in flight: stage 0's round trip F0 F1 B1 B0 = 6 s bounds the period (Little's law);
    # with W0 after it the cycle is 6.5 s.
    assert round_trip(prob, 0) == pytest.approx(6.0)
    assert memory_period_bound(prob, (0.5, 0.5), "stash") == pytest.approx(6.0)
    s = solve_periodic(prob, (0.5, 0.5))
    assert s.in_flight == (1, 1)
    assert s.period == pytest.approx(6.5)
    assert s.lower_bound == pytest.approx(6.0)
    assert s.over_memory() == [] and check_periodic(s) == []
    # PipeDream's 1F1B-async (2 in flight on stage 0) does not fit that memory.
    assert async_pattern(prob, "pipedream", (0.5, 0.5)).over_memory() == [0]
    # PipeMare keeps no stash: two in flight fit, and the period drops to 3.5 s.
    mare = solve_periodic(prob, (0.5, 0.5), "pipemare")
    assert mare.period == pytest.approx(3.5) and mare.over_memory() == []


def test_search_reaches_the_bound_with_a_slow_link_and_never_loses_to_1f1b_async() -> None:
    rng = random.Random(5)
    for p in (4, 6, 8):
        f = [rng.uniform(0.8, 1.2) for _ in range(p)]
        lat = [0.01] * (p - 1)
        lat[p // 2 - 1] = 2.0
        lt, bw = chain_links(p, lat, [1e9] * (p - 1))
        prob = Problem(devices=p, microbatches=4, forward=tuple(f), backward_input=tuple(f),
                       backward_weight=tuple(f), activation_memory=(1.0,) * p, latency=lt,
                       bandwidth=bw, message_size=(2e8,) * (p - 1), memory_limit=(4.0 * p,) * p)
        base = async_pattern(prob, "pipedream")
        found = solve_periodic(prob)
        assert found.period <= base.period + 1e-9
        assert found.period == pytest.approx(found.lower_bound)
        assert found.lower_bound == pytest.approx(period_lower_bound(prob))
        assert check_periodic(found) == []


def test_bad_inputs_are_named() -> None:
    prob = uniform_problem(2, 4)
    with pytest.raises(PeriodicError, match=r"pipeline\.microbatch_scale"):
        async_pattern(prob.replace(microbatch_scale=(1.0, 2.0, 1.0, 1.0)), "pipedream")
    with pytest.raises(NotApplicable, match=r"pipeline\.virtual_stages"):
        async_pattern(uniform_problem(2, 4, virtual_stages=2), "pipedream")
    good = async_pattern(prob, "pipedream")
    with pytest.raises(PeriodicError, match="period"):
        good.replace(period=-1.0)
    with pytest.raises(PeriodicError, match="weight_bytes"):
        good.replace(weight_bytes=(1.0,))
    with pytest.raises(PeriodicError, match=r"tasks\[0\]"):
        good.replace(tasks=(PatternTask("F", 0, math.nan), *good.tasks[1:]))
    with pytest.raises(PeriodicError, match="update_every"):
        good.replace(policy="2bw", update_every=1)
    with pytest.raises(NotApplicable, match=r"memory.limit\[0\]"):
        solve_periodic(prob.replace(memory_limit=(0.5, None)))


def test_json_document_carries_period_versions_staleness_and_offsets() -> None:
    prob = uniform_problem(3, 4, 1.0, 2.0, 0.5)
    doc = json.loads(json.dumps(async_pattern(prob, "pipedream", (2.0,) * 3).to_dict()))
    assert doc["period"] == 3.5
    assert [st["weight_versions"] for st in doc["stages"]] == [3, 2, 1]
    assert [st["staleness"] for st in doc["stages"]] == [2, 1, 0]
    b0 = next(t for t in doc["tasks"] if t["kind"] == "B" and t["stage"] == 0)
    assert b0["start"] == pytest.approx(b0["offset"] + b0["shift"] * 3.5)
    assert 0 <= b0["offset"] < 3.5


@pytest.mark.parametrize("r", [1, 2, 3, 4, 5])
def test_replicating_a_slow_stage_divides_its_contribution(r: int) -> None:
    # Stages of 3, 12 and 3 s (F + B + W); the middle one on r devices round-robin.
    prob = chain([1, 4, 1], [1, 4, 1], [1, 4, 1])
    reps = (1, r, 1)
    assert period_lower_bound(prob, reps) == pytest.approx(max(3.0, 12.0 / r))
    found = solve_periodic(prob, replicas=reps)
    assert found.period == pytest.approx(max(3.0, 12.0 / r))
    assert check_periodic(found) == []
    assert unroll(found).graph.devices == 2 + r
    assert unroll(found).peak_memory[:2] == pytest.approx(found.peak_memory[:2])


def test_pipedream_with_a_replicated_stage_by_hand() -> None:
    # NOAM of stage k: ceil(devices from stage k on / replicas[k]). Stage 1 on 2 devices:
    # ceil(4 / 1) = 4 in flight on stage 0, ceil(3 / 2) = 2 per replica of stage 1, 1 on
    # stage 2. The slow stage's 12 s over 2 replicas: 6 s per micro-batch.
    prob = chain([1, 4, 1], [1, 4, 1], [1, 4, 1])
    s = async_pattern(prob, "pipedream", (1.0,) * 3, replicas=(1, 2, 1))
    assert s.replica_in_flight == (4, 2, 1)
    assert s.weight_versions == (4, 2, 1)  # stashes per device of the stage
    assert s.period == pytest.approx(6.0)
    assert check_periodic(s) == []
    g = unroll(s)
    # Devices: stage 0, stage 1's two replicas, stage 2; both replicas hold 2 activations and
    # one extra weight copy at their peak.
    assert g.peak_memory == pytest.approx((4.0 + 3.0, 2.0 + 1.0, 2.0 + 1.0, 1.0))
    assert s.peak_memory == pytest.approx((7.0, 3.0, 1.0))


@pytest.mark.parametrize(("sync", "period"), [(0.0, 6.0), (8.0, 6.0), (12.0, 6.0),
                                              (16.0, 8.0), (30.0, 15.0)])
def test_replicas_all_reduce_bounds_the_period(sync: float, period: float) -> None:
    """Stage 1 (12 s of work) on 2 replicas: 6 s per micro-batch from its devices; one
    all-reduce of ``sync`` s among the two every round of 2 micro-batches adds a resource of
    ``sync / 2`` s per micro-batch. The period is the larger of the two, for the search and for
    PipeDream's hand-made pattern (whose own least period here is 6 s), and stays valid."""
    from pipeopt.workloads.periodic import replica_sync_bound

    prob = chain([1, 4, 1], [1, 4, 1], [1, 4, 1])
    reps, sync_s = (1, 2, 1), (0.0, sync, 0.0)
    assert replica_sync_bound(prob, reps, sync_s) == pytest.approx(sync / 2)
    assert period_lower_bound(prob, reps, sync_s) == pytest.approx(period)
    for s in (solve_periodic(prob, replicas=reps, sync_s=sync_s),
              async_pattern(prob, "pipedream", (1.0,) * 3, replicas=reps, sync_s=sync_s)):
        assert s.period == pytest.approx(period), s.method
        assert s.sync_s == sync_s and check_periodic(s) == []
        back = type(s).from_dict(json.loads(json.dumps(s.to_dict())))
        assert back.sync_s == sync_s and back.period == s.period


def test_replicas_all_reduce_is_checked() -> None:
    prob = chain([1, 4, 1], [1, 4, 1], [1, 4, 1])
    s = solve_periodic(prob, replicas=(1, 2, 1))
    with pytest.raises(PeriodicError, match=r"period: 6 s is shorter than stage 1's gradient "
                       r"all-reduce among its 2 replicas per micro-batch \(sync_s 14 s / 2\)"):
        s.replace(sync_s=(0.0, 14.0, 0.0))
    with pytest.raises(PeriodicError, match=r"sync_s\[0\]: stage 0 runs on one device"):
        s.replace(sync_s=(1.0, 0.0, 0.0))
    with pytest.raises(PeriodicError, match=r"sync_s: expected 3 values"):
        s.replace(sync_s=(1.0,))
    doc = s.to_dict()
    for st in doc["stages"]:  # a document written before sync_s reads as none
        del st["sync_s"]
    assert type(s).from_dict(doc).sync_s == (0.0, 0.0, 0.0)


def test_replicated_graph_with_one_replica_is_the_training_graph() -> None:
    from pipeopt.workloads import training
    from pipeopt.workloads.periodic import replicated_graph

    prob = chain([1, 2, 1], [1, 1, 1], [0.5, 0.5, 0.5], latency=0.3).replace(
        message_size=(5.0, 7.0), bandwidth=tuple(tuple(10.0 if a != b else math.inf
                                                       for b in range(3)) for a in range(3)))
    a, b = replicated_graph(prob, (1, 1, 1)), training.build(prob)
    for col in ("device", "duration", "mem_start", "mem_end", "label", "src", "dst", "bytes",
                "link_src", "link_dst", "latency", "bandwidth", "memory_limit",
                "static_memory"):
        assert getattr(a, col) == getattr(b, col), col


def test_bad_replicas_are_named() -> None:
    prob = uniform_problem(3, 4)
    with pytest.raises(PeriodicError, match="replicas: expected 3"):
        async_pattern(prob, "pipedream", replicas=(1, 2))
    with pytest.raises(PeriodicError, match=r"replicas\[1\]: must be an integer >= 1"):
        async_pattern(prob, "pipedream", replicas=(1, 0, 1))


def _brute_force_period(prob: Problem, t_max: int) -> int | None:
    """The least integer period of any pattern with integer starts (durations and delays are
    integers): every task's start tried from its earliest to one period later (a later start
    of the same offset only delays what follows), device offsets disjoint on the circle, and
    each stage's hold within its in-flight cap times T."""
    from pipeopt.problem import Op
    from pipeopt.workloads.periodic import pattern_edges

    s, last = prob.stages, prob.kinds[-1]
    caps = max_in_flight(prob, (0.0,) * s, "stash")
    dur = {(kd, k): prob.duration(Op(kd, k, 0)) for kd in prob.kinds for k in range(s)}
    deps: dict[tuple[str, int], list[tuple[tuple[str, int], float]]] = {t: [] for t in dur}
    for a, b in pattern_edges(prob):
        deps[(b.kind, b.stage)].append(((a.kind, a.stage), prob.delay(a.stage, b.stage)))
    order = [("F", k) for k in range(s)]
    for k in reversed(range(s)):
        order += [(kd, k) for kd in prob.kinds[1:]]
    for period in range(math.ceil(period_lower_bound(prob) - 1e-9), t_max + 1):
        def free(st: dict[tuple[str, int], int], t: tuple[str, int], per: int = period) -> bool:
            b0, db = st[t] % per, dur[t]
            return not any(u[1] == t[1] and u != t and any(
                a0 + sh < b0 + db and b0 < a0 + sh + dur[u]
                for a0 in (st[u] % per,) for sh in (-per, 0, per)) for u in st)

        def dfs(i: int, st: dict[tuple[str, int], int], per: int = period) -> bool:
            if i == len(order):
                return all(caps[k] is None or st[(last, k)] + dur[(last, k)] - st[("F", k)]
                           <= caps[k] * per for k in range(s))
            t = order[i]
            lo = 0 if i == 0 else int(max(st[u] + dur[u] + d for u, d in deps[t]))
            cap = caps[t[1]]
            for x in range(lo, lo + (1 if i == 0 else per)):
                if cap is not None and x + dur[t] - st.get(("F", t[1]), x) > cap * per:
                    break  # the stage's hold only grows with x
                st[t] = x
                if free(st, t) and dfs(i + 1, st):
                    return True
                del st[t]
            return False

        if dfs(0, {}):
            return period
    return None


def test_cyclic_cpsat_finds_the_least_grid_period_by_brute_force() -> None:
    from pipeopt.solvers.periodic_cpsat import solve_periodic_cpsat

    # A case where a free order on each device beats every 1F1B-async-like order (7 < 7.5).
    lat, bw = chain_links(3, [2.0, 2.0], [math.inf] * 2)
    known = Problem(devices=3, microbatches=4, forward=(3.0, 2.0, 1.0),
                    backward_input=(1.0, 1.0, 4.0), backward_weight=(0.0, 3.0, 2.0),
                    activation_memory=(1.0,) * 3, weight_grad_memory=(0.5,) * 3,
                    latency=lat, bandwidth=bw, memory_limit=(3.0,) * 3)
    cases = [known]
    rng = random.Random(2)
    while len(cases) < 10:
        p = rng.choice([2, 3])
        lat, bw = chain_links(p, [float(rng.randint(0, 4))] * (p - 1), [math.inf] * (p - 1))
        cases.append(Problem(
            devices=p, microbatches=4, forward=tuple(float(rng.randint(1, 3)) for _ in range(p)),
            backward_input=tuple(float(rng.randint(1, 4)) for _ in range(p)),
            backward_weight=tuple(float(rng.randint(0, 3)) for _ in range(p)),
            activation_memory=(1.0,) * p, weight_grad_memory=(0.5,) * p, latency=lat,
            bandwidth=bw, memory_limit=(rng.choice([2.0, 3.0, 4.0]),) * p))
    for prob in cases:
        search = solve_periodic(prob)
        found = solve_periodic_cpsat(prob, resolution=1.0, time_limit=3, workers=1)
        brute = _brute_force_period(prob, math.ceil(search.period))
        assert found.period == pytest.approx(min(search.period, brute or math.inf))
        assert found.period >= found.lower_bound - 1e-9
        assert check_periodic(found) == [] and found.over_memory() == []
    assert solve_periodic(known).period == pytest.approx(7.5)
    assert solve_periodic_cpsat(known, resolution=1.0, time_limit=3,
                                workers=1).period == pytest.approx(7)


def test_search_with_a_tight_first_stage_and_replicas_stays_valid() -> None:
    # Stage 0 fits one micro-batch (limit 1 = its activation): its round trip F0..B0 of
    # 4 x 1 + 4 x 2 + 6 x 0.5 = 15 s bounds the period; W0 after it makes the cycle 15.5 s.
    prob = uniform_problem(4, 8, 1, 2, 0.5, latency=0.5).replace(
        memory_limit=(1.0, 3.0, None, None))
    for reps in [(1, 1, 1, 1), (1, 3, 1, 2)]:
        s = solve_periodic(prob, replicas=reps)
        assert s.lower_bound == pytest.approx(15.0)
        assert s.period == pytest.approx(15.5)
        assert s.replica_in_flight[0] == 1
        assert check_periodic(s) == [] and s.over_memory() == []


def test_malformed_pattern_records_are_named() -> None:
    good = async_pattern(uniform_problem(2, 4), "pipedream")
    with pytest.raises(PeriodicError, match=r"tasks\[1\]: expected \(kind, stage, start\)"):
        good.replace(tasks=(good.tasks[0], ("F", 1, "soon"), *good.tasks[2:]))
    with pytest.raises(PeriodicError, match=r"tasks\[0\]: expected"):
        good.replace(tasks=(("F",), *good.tasks[1:]))
