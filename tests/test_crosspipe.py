"""CrossPipe's latency-aware greedies (``crosspipe``, ``crosspipe-v``): hand-worked cases, the
published ZB-H1 / ZB-V figures it reaches without link delays, validity under memory limits,
link delays it works around, and ``auto`` starting from it."""

import itertools
import math
import random

import pytest

from pipeopt.problem import Op, Problem, chain_links, uniform_problem
from pipeopt.schedules import GENERATORS, NotApplicable
from pipeopt.schedules.crosspipe import (
    Rule,
    all_rules,
    best_plan,
    crosspipe,
    crosspipe_v,
    plan,
    rules,
)
from pipeopt.simulate import simulate, validate
from pipeopt.solvers import fits_memory, run_classic, solve


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-9)


def names(orders):
    return [" ".join(map(str, o)) for o in orders]


def cross_dc(p, m, v=1, latency=0.0, transmission=0.0, memory=None, times=(1.0, 1.0, 1.0)):
    """Two datacenters: only the link between devices p/2-1 and p/2 has a delay."""
    lat = [0.0] * (p - 1)
    bw = [math.inf] * (p - 1)
    lat[p // 2 - 1] = latency
    if transmission:
        bw[p // 2 - 1] = 1.0 / transmission  # messages of 1 byte
    links, bws = chain_links(p, lat, bw)
    prob = uniform_problem(p, m, *times, virtual_stages=v,
                           placement="vshape" if v == 2 else "loop", memory_limit=memory)
    return prob.replace(latency=links, bandwidth=bws, message_size=(1.0,) * (prob.stages - 1))


def test_registered_as_hand_made_methods():
    assert GENERATORS["crosspipe"] is crosspipe
    assert GENERATORS["crosspipe-v"] is crosspipe_v


def test_two_devices_two_microbatches_by_hand():
    """F = B = W = 1, no delay, no limit. Device 1: F0 [1, 2], B0 [2, 3] (a ready B goes
    first), F1 [3, 4], B1 [4, 5], W0, W1 [5, 7]. Device 0: F0, F1 [0, 2], idle until B0's
    gradient at 3, B0 [3, 4], W0 [4, 5] (it ends when B1's gradient arrives), B1 [5, 6],
    W1 [6, 7]. Makespan 7."""
    prob = uniform_problem(2, 2)
    assert names(crosspipe(prob)) == ["0F0 0F1 0B0 0W0 0B1 0W1", "1F0 1B0 1F1 1B1 1W0 1W1"]
    sched = validate(run_classic(prob, "crosspipe"))
    assert sched.iteration_time == approx(7.0)
    assert best_plan(prob).makespan == approx(7.0)


def test_latency_on_one_microbatch_by_hand():
    """One micro-batch, latency 2 each way: F [0, 1], F [3, 4], B [4, 5], W [5, 6] on device
    1; the gradient reaches device 0 at 7: B [7, 8], W [8, 9]."""
    prob = uniform_problem(2, 1, latency=2.0)
    sched = validate(run_classic(prob, "crosspipe"))
    assert sched.iteration_time == approx(9.0)
    assert sched.op_times()[Op("B", 0, 0)] == (approx(7.0), approx(8.0))


@pytest.mark.parametrize("p,m", [(4, 8), (4, 12), (8, 24), (6, 18)])
def test_one_chunk_reaches_zb_h1_without_delays(p, m):
    """At 1F1B's memory (p activations) and free links the greedy's 1F1B-paced variant is
    ZB-H1: makespan m(F + B + W) + (p - 1)(F + B - W) (Qi et al., ICLR 2024, table 1)."""
    f, b, w = 1.0, 1.0, 1.0
    prob = uniform_problem(p, m, f, b, w, memory_limit=float(p))
    sched = validate(run_classic(prob, "crosspipe"))
    assert sched.iteration_time == approx(m * (f + b + w) + (p - 1) * (f + b - w))
    assert fits_memory(sched, prob)


@pytest.mark.parametrize("p", [4, 6, 8])
def test_v_reaches_zb_v_without_delays(p):
    """Two chunks in a V at 1F1B's memory, F = B = W = 1 per device, m = 3p: makespan
    m(F + B + W) + (p - 1) F / 2, ZB-V's (zero bubble in span; Qi et al., ICLR 2024)."""
    m = 3 * p
    prob = uniform_problem(p, m, virtual_stages=2, placement="vshape", memory_limit=float(p))
    sched = validate(run_classic(prob, "crosspipe-v"))
    assert sched.iteration_time == approx(3 * m + (p - 1) / 2)
    assert sched.iteration_time == approx(run_classic(prob, "zb-v").iteration_time)


def test_latency_aware_beats_the_latency_blind_schedules():
    """Latency 2 F on every link, 1F1B's memory, p = 8, m = 16: the greedy keeps the devices
    busy while messages travel; ZB-H1 (129) and ZB-V (143.5) wait for them."""
    one = uniform_problem(8, 16, latency=2.0, memory_limit=8.0)
    assert run_classic(one, "crosspipe").iteration_time == approx(111.0)
    assert run_classic(one, "zb-h1").iteration_time == approx(129.0)
    vee = uniform_problem(8, 16, virtual_stages=2, placement="vshape", latency=2.0,
                          memory_limit=8.0)
    assert run_classic(vee, "crosspipe-v").iteration_time == approx(142.5)
    assert run_classic(vee, "zb-v").iteration_time == approx(143.5)


@pytest.mark.parametrize("v,latency,transmission",
                         list(itertools.product([1, 2], [0.0, 1.0], [0.0, 0.5, 2.0])))
def test_estimate_is_the_simulators_timing(v, latency, transmission):
    """The greedy times ops as the simulator does (links queue messages first come first
    served), so the plan's makespan is the simulated one."""
    prob = cross_dc(8, 16, v, latency, transmission, memory=8.0)
    best = best_plan(prob)
    sched = simulate(prob, [list(o) for o in best.orders])
    assert sched.iteration_time == approx(best.makespan)
    assert sched.max_span == approx(best.span)


def _random_problem(rng, v):
    p = rng.randint(2, 5)
    m = rng.randint(1, 8)
    s = p * v
    lat = [rng.choice([0.0, 0.3, 2.0]) for _ in range(p - 1)]
    bw = [rng.choice([math.inf, 1.0, 4.0]) for _ in range(p - 1)]
    links, bws = chain_links(p, lat, bw)
    act = [rng.uniform(0.5, 1.5) for _ in range(s)]
    prob = Problem(
        devices=p, microbatches=m, virtual_stages=v,
        placement="vshape" if v == 2 else "loop",
        split_backward=rng.random() < 0.8,
        forward=tuple(rng.uniform(0.5, 1.5) for _ in range(s)),
        backward_input=tuple(rng.uniform(0.5, 2.0) for _ in range(s)),
        backward_weight=tuple(rng.uniform(0.2, 1.0) for _ in range(s)),
        activation_memory=tuple(act), weight_grad_memory=tuple(a / 2 for a in act),
        latency=links, bandwidth=bws, message_size=tuple(rng.uniform(0.5, 2.0)
                                                          for _ in range(s - 1)),
        microbatch_scale=tuple(rng.choice([0.5, 1.0, 2.0]) for _ in range(m))
        if rng.random() < 0.3 else (),
    )
    floor = [max(sum(prob.memory_delta(Op("F", k, j))[0] for k in prob.device_stages[d])
                 for j in range(m)) for d in range(p)]
    factor = rng.choice([1.0, 1.3, 2.0, None])
    limits = tuple(None if factor is None else f * factor for f in floor)
    return prob.replace(memory_limit=limits)


@pytest.mark.parametrize("seed", range(40))
def test_random_problems_valid_within_memory(seed):
    rng = random.Random(seed)
    v = 1 + seed % 2
    prob = _random_problem(rng, v)
    name = "crosspipe-v" if v == 2 else "crosspipe"
    try:
        sched = run_classic(prob, name)
    except NotApplicable as exc:  # every variant deadlocked at this limit: said so
        assert "deadlock" in str(exc)
        return
    validate(sched)
    assert fits_memory(sched, prob)


def test_a_deadlocking_variant_is_dropped():
    """p = 4, m = 8 in a V at 1F1B's memory: filling the first device with chunk-0 forwards
    (no reserve, no warm-up cap) leaves no room for their chunk-1 forwards; the other
    variants still give a valid schedule within the limit."""
    prob = uniform_problem(4, 8, virtual_stages=2, placement="vshape", latency=1.0,
                           memory_limit=4.0)
    with pytest.raises(NotApplicable, match="memory limit blocks"):
        plan(prob, Rule(reserve=0, lead=None))
    sched = validate(run_classic(prob, "crosspipe-v"))
    assert fits_memory(sched, prob)
    assert sched.iteration_time == approx(41.5)


def test_past_the_budget_while_every_variant_deadlocks():
    """p = 16, m = 64 in a V at 1F1B's memory: the budget holds only the first warm-up, whose
    four priorities all deadlock; the next variant of the uncut list that finishes is taken
    (before, crosspipe-v refused every such instance)."""
    prob = uniform_problem(16, 64, virtual_stages=2, placement="vshape", latency=2.0,
                           memory_limit=16.0)
    budget = rules(prob)
    assert len(budget) < len(all_rules(prob))
    for rule in budget:
        with pytest.raises(NotApplicable, match="memory limit blocks"):
            plan(prob, rule)
    first_ok = next(r for r in all_rules(prob)[len(budget):] if _finishes(prob, r))
    best = best_plan(prob, "crosspipe-v")
    assert best.rule == first_ok
    sched = validate(run_classic(prob, "crosspipe-v"))
    assert fits_memory(sched, prob)
    assert sched.iteration_time == approx(best.makespan)


def _finishes(prob, rule) -> bool:
    try:
        plan(prob, rule)
    except NotApplicable:
        return False
    return True


def test_fused_backward_has_no_w():
    prob = uniform_problem(4, 8, split_backward=False, latency=1.0, memory_limit=4.0)
    assert all(r.w_fill is False for r in rules(prob))
    sched = validate(run_classic(prob, "crosspipe"))
    assert not any(o.op.kind == "W" for o in sched.ops)


def test_rules_capped_on_large_problems():
    big = uniform_problem(32, 512, virtual_stages=2, placement="vshape")
    assert 1 <= len(rules(big)) < len(rules(uniform_problem(4, 8, virtual_stages=2,
                                                            placement="vshape")))


def test_not_applicable():
    vee = uniform_problem(4, 8, virtual_stages=2, placement="vshape")
    with pytest.raises(NotApplicable, match="virtual_stages: 1"):
        crosspipe(vee)
    with pytest.raises(NotApplicable, match="placement: vshape"):
        crosspipe_v(uniform_problem(4, 8, virtual_stages=2))
    with pytest.raises(NotApplicable, match="device 0 cannot hold one micro-batch"):
        crosspipe(uniform_problem(4, 8, memory_limit=0.5))


def test_auto_starts_from_the_greedy():
    """p = 4, m = 8, V at twice 1F1B's memory, latency 2 F on the boundary: crosspipe-v is
    the best hand-made schedule, so auto is at least as fast and lists it."""
    prob = cross_dc(4, 8, v=2, latency=2.0, memory=8.0)
    greedy = run_classic(prob, "crosspipe-v").iteration_time
    assert greedy < run_classic(prob, "zb-v").iteration_time
    sched = solve(prob, "auto", time_limit=3, workers=1)
    assert sched.iteration_time <= greedy * (1 + 1e-9)
    assert "crosspipe-v" in dict(sched.solver.detail("candidates"))


def test_auto_skips_the_greedy_when_it_would_overrun(monkeypatch):
    """auto gives its hand-made schedules 30 % of the limit; a generator whose estimate does
    not fit in what is left is skipped, and the note says why. On large problems the greedy
    tries fewer variants, so its estimate grows more slowly than its ops."""
    from pipeopt.schedules import COST_ESTIMATES

    prob = uniform_problem(4, 8, latency=1.0, memory_limit=4.0)
    monkeypatch.setitem(COST_ESTIMATES, "crosspipe", lambda problem: 1e9)
    sched = solve(prob, "auto", time_limit=2.0, workers=1)
    assert "would take about 1e+09 s" in sched.solver.detail("classic_crosspipe")
    small, big = uniform_problem(4, 8), uniform_problem(64, 1024)
    assert COST_ESTIMATES["crosspipe"](big) / COST_ESTIMATES["crosspipe"](small) < (
        big.num_ops / small.num_ops)


def test_compare_runs_the_v_greedy_on_two_chunks():
    """compare cuts one-stage-per-device work into a V for crosspipe-v, as for ZB-V."""
    from pipeopt.solvers import compare

    prob = uniform_problem(4, 8, latency=1.0, memory_limit=4.0)
    rows = {r.method: r for r in compare(prob, ["crosspipe", "crosspipe-v", "zb-v"])}
    assert rows["crosspipe"].schedule is not None
    vee = rows["crosspipe-v (v=2)"].schedule
    assert vee is not None and vee.problem.virtual_stages == 2
    assert vee.iteration_time <= rows["zb-v (v=2)"].schedule.iteration_time * (1 + 1e-9)
