"""The greedy list scheduler: valid, memory-safe, and as good as the hand-made baselines."""

import math
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeopt.problem import Op, chain_links, uniform_problem
from pipeopt.schedules import NotApplicable
from pipeopt.simulate import validate
from pipeopt.solvers import SolveOptions, fits_memory, lower_bound, run_classic, solve
from pipeopt.solvers.greedy import (
    min_memory,
    policies_for,
    restart_search,
    sequential_orders,
    solve_greedy,
)
from tests.strategies import problems

OPTS = SolveOptions(time_limit=5.0)


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-9)


@given(problems(max_devices=4, max_microbatches=6))
def test_valid_on_random_problems(prob):
    s = validate(solve_greedy(prob, OPTS))
    assert s.method == "greedy"
    assert s.solver.status == "heuristic"
    assert s.solver.lower_bound == approx(lower_bound(prob))
    assert s.makespan >= lower_bound(prob) * (1 - 1e-9)


@given(problems(max_devices=3, max_microbatches=4, contention=True))
def test_valid_with_link_contention(prob):
    validate(solve_greedy(prob, OPTS))


@given(problems(max_devices=4, max_microbatches=6), st.floats(0.0, 2.0), st.floats(0.0, 3.0))
def test_memory_limit_kept_or_refused(prob, static, slack):
    # A limit between the least any schedule needs and a bit more: the greedy must keep it.
    need = [static + x for x in min_memory(prob)]
    limit = tuple(n + slack for n in need)
    prob = prob.replace(static_memory=(static,) * prob.devices, memory_limit=limit)
    s = validate(solve_greedy(prob, OPTS))
    assert fits_memory(s, prob)


@given(problems(max_devices=4, max_microbatches=4), st.floats(0.01, 0.99))
def test_too_little_memory_is_refused(prob, frac):
    need = min_memory(prob)
    if max(need) < 1e-6:  # nothing to refuse (within the validator's tolerance)
        return
    d = max(range(prob.devices), key=lambda i: need[i])
    limit = [None] * prob.devices
    limit[d] = need[d] * frac
    with pytest.raises(NotApplicable, match=rf"memory\.limit\[{d}\].*device {d} needs at least"):
        solve_greedy(prob.replace(memory_limit=tuple(limit)), OPTS)


def test_refusal_names_device_and_amount():
    prob = uniform_problem(4, 8, activation=2.0, memory_limit=1.5)
    with pytest.raises(NotApplicable) as exc:
        solve(prob, "greedy")
    msg = str(exc.value)
    assert "memory.limit[0] = 1.5" in msg and "needs at least 2" in msg


def test_least_memory_is_enough():
    # Exactly one micro-batch's activations per device: the greedy still finds a schedule.
    prob = uniform_problem(4, 6, 1.0, 1.2, 0.8, virtual_stages=2, placement="vshape",
                           activation=1.0, memory_limit=1.0)
    s = validate(solve_greedy(prob, OPTS))
    assert max(s.peak_memory) <= 1.0 + 1e-9
    # The sequential fallback needs the same memory.
    from pipeopt.simulate import simulate
    seq = simulate(prob, sequential_orders(prob))
    assert max(seq.peak_memory) == approx(1.0)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16), (8, 32)])
@pytest.mark.parametrize("t", [(1.0, 1.0, 1.0), (1.0, 1.2, 0.8), (1.0, 1.5, 0.5)])
def test_beats_1f1b_with_its_memory(p, m, t):
    prob = uniform_problem(p, m, *t, weight_grad=0.5)
    one = run_classic(prob, "1f1b")
    limited = prob.replace(memory_limit=one.peak_memory)  # 1F1B's per-device peak
    s = validate(solve_greedy(limited, OPTS))
    assert fits_memory(s, limited)
    assert s.makespan <= one.makespan * (1 + 1e-9)


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16), (8, 16), (8, 32)])
@pytest.mark.parametrize("t", [(1.0, 1.0, 1.0), (1.0, 1.2, 0.8), (1.0, 1.5, 0.5)])
def test_unlimited_memory_reaches_the_bound(p, m, t):
    prob = uniform_problem(p, m, *t, weight_grad=0.5)
    s = validate(solve_greedy(prob, OPTS))
    if t[2] >= 0.8:
        assert s.makespan == approx(lower_bound(prob))
    else:
        # W too short to fill the cool-down: CP-SAT proves 28 for p=4, m=8 and 58 for p=8,
        # m=16 (bounds 27 and 55); the greedy finds both.
        assert s.makespan <= lower_bound(prob) * 1.06
    if m >= 4 * p and t[2] >= 0.8:
        # Zero span bubble: every device computes without a gap from its first op to its last.
        sp = validate(solve_greedy(prob, SolveOptions(objective="span")))
        assert sp.max_span == approx(m * sum(t))


def test_slow_link_needs_more_in_flight():
    # Two datacenters 4 F apart: with twice 1F1B's memory the greedy hides the latency that
    # stalls 1F1B and ZB-H1.
    p, m = 8, 32
    lat, bw = chain_links(p, [0.0] * 3 + [4.0] + [0.0] * 3, [math.inf] * (p - 1))
    prob = uniform_problem(p, m, 1.0, 1.2, 0.8, weight_grad=0.5).replace(
        latency=lat, bandwidth=bw, memory_limit=(2.0 * p,) * p)
    s = validate(solve_greedy(prob, OPTS))
    assert fits_memory(s, prob)
    assert s.makespan <= 0.8 * run_classic(prob, "zb-h1").makespan
    assert s.makespan <= lower_bound(prob) * 1.05


@pytest.mark.parametrize("placement", ["loop", "vshape"])
def test_virtual_stages_with_tight_memory(placement):
    # Two chunks per device and room for 3 micro-batches' worth of activations.
    prob = uniform_problem(4, 8, 1.0, 1.2, 0.8, virtual_stages=2, placement=placement,
                           weight_grad=0.5, memory_limit=3.0)
    s = validate(solve_greedy(prob, OPTS))
    assert fits_memory(s, prob)
    assert s.makespan <= lower_bound(prob) * 1.25


def test_span_objective():
    prob = uniform_problem(4, 8, 1.0, 1.2, 0.8, weight_grad=0.5, memory_limit=4.0)
    s = validate(solve(prob, "greedy", objective="span"))
    assert s.solver.objective == "span"
    assert s.solver.lower_bound == approx(lower_bound(prob, "span"))


def test_deterministic():
    prob = uniform_problem(6, 12, 1.0, 1.3, 0.7, latency=0.3, memory_limit=5.0)
    a, b = solve_greedy(prob, OPTS), solve_greedy(prob, OPTS)
    assert a.device_orders() == b.device_orders()


@pytest.mark.slow
def test_largest_instance_finishes():
    # p=64, m=1024 (196608 ops): wall time is measured in benchmarks/schedules.py, not here.
    prob = uniform_problem(64, 1024, 1.0, 1.2, 0.8, latency=0.05, weight_grad=0.5,
                           memory_limit=64.0)
    s = solve_greedy(prob, OPTS)
    assert len(s.ops) == prob.num_ops
    assert fits_memory(s, prob)
    assert s.makespan < run_classic(prob, "1f1b").makespan


# ----- the order search for micro-batches of different cost -----------------------------------
_SCALED = uniform_problem(4, 8, 1.0, 1.2, 0.8).replace(
    microbatch_scale=(0.5, 4.0, 0.25, 1.0, 0.25, 2.0, 2.0, 2.0))


def test_neighbour_is_a_permutation_and_swaps_only_different_costs():
    """Every neighbour is a permutation; a swap of two places that are not adjacent (a move
    by one place looks like an adjacent swap) never exchanges two micro-batches within 10 % of
    the larger one's scale (here the two of 0.25 or two of the three of 2.0)."""
    import random

    from pipeopt.solvers.greedy import _differ, _neighbour

    rand = random.Random(1)
    cur = list(range(8))
    seen_swap = False
    for _ in range(2000):
        new = _neighbour(_SCALED, cur, rand)
        if new is None:
            continue
        assert sorted(new) == cur and new != cur
        moved = [i for i in range(8) if new[i] != cur[i]]
        if len(moved) == 2 and moved[1] - moved[0] > 1:  # a swap
            seen_swap = True
            assert _differ(_SCALED, cur[moved[0]], cur[moved[1]])
    assert seen_swap
    assert not _differ(_SCALED, 2, 4) and not _differ(_SCALED, 5, 7)
    assert _differ(_SCALED, 0, 2) and _differ(_SCALED, 1, 3)


def test_order_search_beats_its_start_and_is_seeded():
    """From the given order with the first variant, the search returns a shorter schedule,
    the same for the same seed; its timing is the simulator's."""
    import time

    from pipeopt.simulate import simulate
    from pipeopt.solvers.greedy import POLICIES, _Context, _order_search, _run

    start = tuple(range(8))
    _, value, *_ = _run(_Context(_SCALED), POLICIES[0])
    far = time.perf_counter() + 600
    a = _order_search(_SCALED, [(POLICIES[0], start, value)], 3, far)
    b = _order_search(_SCALED, [(POLICIES[0], start, value)], 3, far)
    assert a is not None and b is not None
    assert a[0] < value - 1e-9 and (a[0], a[2], a[3]) == (b[0], b[2], b[3])
    assert sorted(a[2]) == list(start)
    assert simulate(_SCALED, a[1]).makespan == pytest.approx(a[0])
    assert a[0] >= lower_bound(_SCALED) - 1e-9


# ----- variants: reclaimed headroom, fitted caps, link wait -----------------------------------
def test_reclaim_starts_the_next_microbatch_while_the_last_drains():
    """V on 2 devices (stages 0, 3 on device 0; 1, 2 on device 1), F 0.5 s, B 1 s, W 0.5 s,
    0.5 of activation per stage held until W, memory for one micro-batch (1.0).

    Device 0 runs F0.0, F3.0 [1.5, 2], B3.0, W3.0 [2.5, 3.5]. Then it holds only micro-batch
    0's stage-0 activation (0.5), which B0.0 and W0.0 will free without any other F there. The
    old rule keeps room for a stage-3 activation besides F0.1's (0.5 + 0.5 + 0.5 > 1), so F0.1
    waits for W0.0 (6.5) and the schedule ends at 13. Reclaim counts micro-batch 0's 0.5 as
    free for that headroom: F0.1 starts at 3.5, F1.1 on device 1 at 5.5 (after W1.0), and the
    schedule ends at 12, which CP-SAT proves optimal."""
    from pipeopt.simulate import simulate
    from pipeopt.solvers.greedy import POLICIES, Policy, _Context, _run

    prob = uniform_problem(2, 2, 1.0, 2.0, virtual_stages=2, placement="vshape",
                           memory_limit=1.0)
    assert prob.stage_device == (0, 1, 1, 0) and prob.forward == (0.5,) * 4
    ctx = _Context(prob)
    old = [_run(ctx, pol)[1] for pol in POLICIES
           if not (pol.reclaim or pol.mem_caps or pol.link_wait)]
    assert min(old) == approx(13.0)
    ids, makespan, *_ = _run(ctx, Policy(reclaim=True, fb="alt"))
    assert makespan == approx(12.0)
    s = validate(simulate(prob, ctx.orders(ids)))
    assert s.makespan == approx(12.0) and fits_memory(s, prob)
    assert s.op_times()[Op("F", 0, 1)] == (approx(3.5), approx(4.0))
    assert validate(solve_greedy(prob, OPTS)).makespan == approx(12.0)
    assert solve(prob, "cpsat", time_limit=30).makespan == approx(12.0)


@given(problems(max_devices=3, max_microbatches=5), st.floats(0.0, 1.5),
       st.lists(st.floats(0.25, 3.0), min_size=5, max_size=5))
def test_every_variant_finishes_at_tight_memory(prob, slack, scale):
    """No variant deadlocks (reclaim's argument in ``_run``), on micro-batches of one cost and
    of different costs, at the least memory any schedule needs plus a little; each schedule
    is valid, keeps the limit and ends no later than the greedy's own timing."""
    from pipeopt.simulate import simulate
    from pipeopt.solvers.greedy import POLICIES, _Context, _run

    for pr in (prob, prob.replace(microbatch_scale=tuple(scale[:prob.microbatches]))):
        limit = tuple(x + slack for x in min_memory(pr))
        pr = pr.replace(memory_limit=limit)
        ctx = _Context(pr)
        for pol in POLICIES:
            ids, makespan, *_ = _run(ctx, pol)
            s = validate(simulate(pr, ctx.orders(ids)))
            assert fits_memory(s, pr)
            # The simulator starts each op as early as the order allows, so it never ends
            # later than the greedy's own timing (which may wait on purpose: lookahead).
            assert s.makespan <= makespan * (1 + 1e-9) + 1e-9


@given(problems(max_devices=3, max_microbatches=4, contention=True), st.floats(0.0, 1.5))
def test_every_variant_finishes_with_link_contention(prob, slack):
    from pipeopt.simulate import simulate
    from pipeopt.solvers.greedy import POLICIES, _Context, _run

    prob = prob.replace(memory_limit=tuple(x + slack for x in min_memory(prob)))
    ctx = _Context(prob)
    for pol in POLICIES:
        ids, *_ = _run(ctx, pol)
        assert fits_memory(validate(simulate(prob, ctx.orders(ids))), prob)


def test_fitted_caps_share_memory_by_warm_up():
    """V, p = 4 (8 stages), activation 0.5 per stage, no links: stage k's 1F1B warm-up is
    8 - k; device 0 holds stages 0 and 7 (needs 8 and 1). With room for 6 activations of 0.5
    (3.0) the largest rho with floor(8 rho) + 1 and floor(rho) + 1 in 6 slots is rho = 4/8
    (caps 5 and 1); with unlimited memory rho = 1 (caps 9, at most m = 8, and 2)."""
    from pipeopt.solvers.greedy import Policy, _Context

    prob = uniform_problem(4, 8, 1.0, 1.2, 0.8, virtual_stages=2, placement="vshape",
                           weight_grad=0.5, memory_limit=3.0)
    caps = _Context(prob).caps(Policy(mem_caps="fit"))
    assert caps[0] == 5 and caps[7] == 1
    # Device 3 holds stages 3 and 4 (needs 5 and 4): the caps step at rho = c/5 and c/4, in
    # turn 0.2, 0.25, 0.4, 0.5 (caps 3 and 3: 6 slots); 0.6 would take a seventh.
    assert caps[3] == 3 and caps[4] == 3
    free = _Context(prob.replace(memory_limit=(None,) * 4)).caps(Policy(mem_caps="fit"))
    assert free[0] == 8 and free[7] == 2
    # Shared: every device's warm-ups would hold 0.5 x 9 = 4.5 against its 3.0, rho = 2/3:
    # round(8 x 2/3) = 5, round(2/3) = 1; round(5 x 2/3) = 3, round(4 x 2/3) = 3.
    shared = _Context(prob).caps(Policy(mem_caps="share"))
    assert (shared[0], shared[7], shared[3], shared[4]) == (5, 1, 3, 3)
    assert _Context(prob.replace(memory_limit=(None,) * 4)).caps(
        Policy(mem_caps="share"))[:2] == [8, 7]


def _xdc(p, m, latency_x=8.0):
    """benchmarks/search.py's cross-datacenter chain: a slow middle link, 1F1B's memory."""
    lat = [0.0] * (p - 1)
    lat[p // 2 - 1] = latency_x
    links, bw = chain_links(p, lat, [math.inf] * (p - 1))
    prob = uniform_problem(p, m, 1.0, 1.2, 0.8, weight_grad=0.5, memory_limit=float(p))
    return prob.replace(latency=links, bandwidth=bw)


def test_restarts_beat_the_greedy_and_are_seeded():
    """Each variant once, then noisy restarts of the best: valid, strictly better than the
    greedy here (106.6 s against 106.8 s; the bound is 105 s), and the same orders for the same
    seed and run count."""
    prob = _xdc(6, 18)
    opts = SolveOptions(time_limit=30, seed=3)
    greedy = solve_greedy(prob, opts)
    far = time.perf_counter() + 60
    got = restart_search(prob, opts, far, max_runs=120)
    assert got is not None and got.method == "greedy-restarts"
    validate(got)
    assert fits_memory(got, prob)
    assert got.iteration_time < greedy.iteration_time - 1e-9
    assert got.solver.detail("restart_runs") == 120
    again = restart_search(prob, opts, far, max_runs=120)
    assert again.device_orders() == got.device_orders()


def test_restarts_end_by_their_deadline_or_at_the_bound():
    prob = _xdc(6, 18)
    assert restart_search(prob, SolveOptions(), time.perf_counter() - 1.0) is None
    t = time.perf_counter()
    got = restart_search(prob, SolveOptions(), t + 0.5)
    assert got is not None and time.perf_counter() - t < 2.0
    easy = _xdc(4, 8)  # the second variant meets the bound: no noisy run follows
    got = restart_search(easy, SolveOptions(), time.perf_counter() + 60)
    assert got.iteration_time == pytest.approx(lower_bound(easy, "makespan"))
    assert got.solver.detail("restart_runs") == 2 < len(policies_for(easy))


@given(problems(max_devices=4, max_microbatches=6, contention=True),
       st.sampled_from(["makespan", "span"]))
def test_restarts_valid_on_random_problems(prob, objective):
    """Valid, within memory and not below the lower bound on random problems (one or two chunks,
    fused or split backward, queued links: there the few best are re-timed by the simulator)."""
    opts = SolveOptions(objective=objective)
    got = restart_search(prob, opts, time.perf_counter() + 60, max_runs=40)
    assert got is not None
    validate(got)
    assert fits_memory(got, prob)
    value = got.max_span if objective == "span" else got.iteration_time
    assert value >= lower_bound(prob, objective) * (1 - 1e-9)


@pytest.fixture
def counted_order_search(monkeypatch):
    """For the order-search tests on ``_SCALED``: (run, calls) where ``run(**kw)`` is
    ``_order_search`` from the first variant's start (its value, 3 chains, a far deadline) and
    ``calls[0]`` counts the greedy's timings since it was last reset."""
    import time

    from pipeopt.solvers import greedy
    from pipeopt.solvers.greedy import POLICIES, _Context, _order_search, _run

    start = tuple(range(8))
    _, value, *_ = _run(_Context(_SCALED), POLICIES[0])
    far = time.perf_counter() + 600
    calls = [0]

    def counted(ctx, policy, deadline=math.inf):
        calls[0] += 1
        return _run(ctx, policy, deadline)

    monkeypatch.setattr(greedy, "_run", counted)

    def run(**kw):
        return _order_search(_SCALED, [(POLICIES[0], start, value)], 3, far, **kw)

    return run, calls


def test_long_order_search_extends_the_chains(counted_order_search):
    """``long``: the same seeded chains run further (more kicks, larger caps), so they time
    more orders and end no worse; each mode gives one answer per seed."""
    search, calls = counted_order_search
    runs = {}
    for long in (False, True):
        calls[0] = 0
        a, b = search(long=long), search(long=long)
        assert a is not None and b is not None and (a[0], a[2]) == (b[0], b[2])
        runs[long] = (a[0], calls[0] // 2)
    assert runs[True][1] > runs[False][1]
    assert runs[True][0] <= runs[False][0] + 1e-9


def test_order_search_keeps_only_orders_better_than_every_start():
    """A chain's order that beats its own start but not an earlier, better start is no
    answer: the caller keeps that start (here the first start's value is out of reach)."""
    import time

    from pipeopt.solvers.greedy import POLICIES, _Context, _order_search, _run

    start = tuple(range(8))
    _, value, *_ = _run(_Context(_SCALED), POLICIES[0])
    far = time.perf_counter() + 600
    alone = _order_search(_SCALED, [(POLICIES[0], start, value)], 3, far)
    assert alone is not None and alone[0] < value - 1e-9  # from this start it improves
    out = _order_search(_SCALED, [(POLICIES[0], start, 1.0), (POLICIES[0], start, value)], 3,
                        far)
    assert out is None


def test_reserve_slowdown_probes_only_when_the_limit_is_near():
    """The slowdown that scales the final simulation's reserve: measured once the run has
    used enough CPU; before that MAX_SLOWDOWN without the 50 ms probe when the deadline is far
    off, a probe when it is near and the reserve is worth one, else 1."""
    import time

    from pipeopt.clock import MAX_SLOWDOWN, MIN_CPU_SAMPLE_S, Stopwatch
    from pipeopt.solvers.greedy import _CALIBRATE_CPU_S, _reserve_slowdown

    now = time.perf_counter()
    cpu = time.process_time()
    assert _reserve_slowdown(Stopwatch.start(), 0.5, now + 1000.0, 200_000) == MAX_SLOWDOWN
    assert time.process_time() - cpu < MIN_CPU_SAMPLE_S / 2  # no busy loop
    # Near: a probe (a busy loop of MIN_CPU_SAMPLE_S of CPU) for a large reserve only.
    cpu = time.process_time()
    probed = _reserve_slowdown(Stopwatch.start(), 2 * _CALIBRATE_CPU_S, now, 200_000)
    assert 1.0 <= probed <= MAX_SLOWDOWN
    assert time.process_time() - cpu >= MIN_CPU_SAMPLE_S
    assert _reserve_slowdown(Stopwatch.start(), _CALIBRATE_CPU_S / 2, now, 200_000) == 1.0
    # Enough CPU used: this run's own ratio (2 s of wall per 1 s of CPU here), whatever the
    # deadline.
    watch = Stopwatch(time.perf_counter() - 2.0, time.process_time() - 1.0)
    assert _reserve_slowdown(watch, 0.5, now + 1000.0, 200_000) == pytest.approx(2.0, rel=0.05)


def _v_xdc(p, m, latency_x=8.0):
    """benchmarks/search.py's V with a slow middle link (``xdc_link``, two chunks, 1F1B's
    memory): F 0.5 s, B 0.6 s, W 0.4 s per chunk, 0.5 of activation (0.25 held until W)."""
    lat = [0.0] * (p - 1)
    lat[p // 2 - 1] = latency_x
    links, bw = chain_links(p, lat, [math.inf] * (p - 1))
    prob = uniform_problem(p, m, 1.0, 1.2, 0.8, weight_grad=0.5, virtual_stages=2,
                           placement="vshape", memory_limit=float(p))
    return prob.replace(latency=links, bandwidth=bw, message_size=(1.0,) * (prob.stages - 1))


def test_reserve_counts_the_later_chunks_held_across_the_link():
    """p = 4, latency 8 s between devices 1 and 2; a device cycle is 2 x (0.5 + 0.6 + 0.4) =
    3 s. Device 2 holds stages 2 and 5: from F5's start to B5's end a micro-batch crosses the
    link twice, 0.5 + 8 + (0.5 + 0.5 + 0.6 + 0.6) + 8 + 0.6 = 19.3 s, ceil(19.3 / 3) = 7 of
    them at once. Device 0 turns the V itself: F7 + B7 = 1.1 s, one at a time."""
    from pipeopt.solvers.greedy import _Context

    prob = _v_xdc(4, 8)
    assert prob.stage_device == (0, 1, 2, 3, 3, 2, 1, 0)
    ctx = _Context(prob)
    assert ctx.reserve[2] == ((5, 7, 0.5),) and ctx.reserve[0] == ((7, 1, 0.5),)
    assert ctx.reserve[5] == () and ctx.reserve[7] == ()
    # F0 to F5's input: 5 x 0.5 + 8 s; F7's start to B0's end: 0.5 + 8 x 0.6 + 2 x 8 s.
    assert ctx.reach[5] == approx(10.5) and ctx.ret[0] == approx(21.3)


def test_reserve_keeps_the_slots_behind_a_slow_link_full():
    """The V with latency 8 at p = 4, m = 8 (CP-SAT proves 72.5 s optimal). Without the rule,
    device 2 admits a fifth micro-batch's F2 while the fourth's F5 is on its way (its memory,
    4.0, holds four micro-batches' two chunks), so that F5 waits a round trip: the best variant
    without ``reserve`` ends at 83.6 s. With it, F2.4 waits for F5.3 and the first four
    micro-batches' round finishes first: 72.8 s."""
    from pipeopt.simulate import simulate
    from pipeopt.solvers.greedy import _Context, _run

    prob = _v_xdc(4, 8)
    ctx = _Context(prob)
    pols = policies_for(prob)
    plain = [pol for pol in pols if pol.reserve is None]
    best_plain = min(_run(ctx, pol)[1] for pol in plain)
    assert best_plain == pytest.approx(83.6)
    ids, makespan, *_ = min((_run(ctx, pol) for pol in pols if pol.reserve is not None),
                            key=lambda run: run[1])
    assert makespan == pytest.approx(72.8)
    s = validate(simulate(prob, ctx.orders(ids)))
    assert fits_memory(s, prob) and s.makespan == pytest.approx(72.8)
    at = s.op_times()
    assert at[Op("F", 2, 4)][0] >= at[Op("F", 5, 3)][1] - 1e-9
    g = validate(solve_greedy(prob, OPTS))
    assert g.makespan == pytest.approx(72.8) and "+rs" in g.solver.detail("policy")


def test_reserve_holds_nothing_back_without_a_memory_limit():
    """Without a memory limit every F that passes the other checks has room whatever is held
    back, so each ``reserve`` variant gives its base variant's orders and starts exactly (the
    greedy skips the rule's work there), while with 1F1B's memory the rule changes them."""
    from dataclasses import replace

    from pipeopt.solvers.greedy import POLICIES, _Context, _run

    prob = _v_xdc(4, 8)
    free = _Context(prob.replace(memory_limit=(None,) * prob.devices))
    tight = _Context(prob)
    changed = 0
    for pol in (pol for pol in POLICIES if pol.reserve is not None):
        base = replace(pol, reserve=None)
        assert _run(free, pol) == _run(free, base)
        changed += _run(tight, pol)[0] != _run(tight, base)[0]
    assert changed > 0


def test_reserve_is_tried_only_where_links_delay():
    """``reserve`` holds memory for a later chunk's round trip over a slow link: it is not
    tried on the V without latency, nor on one chunk per device (no later chunk); the one
    with ``link_wait`` only where a link also has a transmission time."""
    with_link = policies_for(_v_xdc(4, 8))
    assert sum(pol.reserve is not None for pol in with_link) == 5
    assert all(pol.reserve is None for pol in policies_for(_v_xdc(4, 8, latency_x=0.0)))
    assert all(pol.reserve is None for pol in policies_for(_xdc(4, 8)))


def test_flips_replay_a_seeded_run():
    """The choices a seeded noisy run flipped, given back as ``flips``, give the same run: the
    restarts' local search toggles a few of them and so stays near its current run."""
    from dataclasses import replace

    from pipeopt.solvers.greedy import Policy, _Context, _run

    prob = _xdc(6, 18)
    ctx = _Context(prob)
    noisy = Policy(mem_caps="fit", wait_w=True, noise=0.1, seed=11)
    flipped: list[int] = []
    ids, makespan, _, _ = _run(ctx, noisy, flipped=flipped)
    choices = flipped.pop()
    assert 0 < len(flipped) < choices and all(0 <= i < choices for i in flipped)
    again = _run(ctx, replace(noisy, flips=frozenset(flipped)))
    assert again[0] == ids and again[1] == makespan
    plain = _run(ctx, replace(noisy, noise=0.0))
    assert _run(ctx, replace(noisy, flips=frozenset()))[0] == plain[0]  # nothing flipped


def test_restarts_local_search_is_seeded_and_valid(monkeypatch):
    """With the local search on (its size gate lowered) the runs after the stall are local
    ones, and the answer is valid, within memory and the same for the same seed."""
    import pipeopt.solvers.greedy as greedy

    monkeypatch.setattr(greedy, "_LOCAL_MIN_OPS", 0)
    monkeypatch.setattr(greedy, "_LOCAL_STALL", 5)
    monkeypatch.setattr(greedy, "_KICK_AFTER", 20)
    monkeypatch.setattr(greedy, "_GUARD_RUNS", 10)
    prob = _xdc(6, 18)
    opts = SolveOptions(time_limit=30, seed=3)
    far = time.perf_counter() + 60
    got = restart_search(prob, opts, far, max_runs=150)
    assert got is not None and got.solver.detail("local_runs") > 0
    validate(got)
    assert fits_memory(got, prob)
    assert got.iteration_time >= lower_bound(prob, "makespan") * (1 - 1e-9)
    again = restart_search(prob, opts, far, max_runs=150)
    assert again.device_orders() == got.device_orders()
    assert again.solver.detail("local_runs") == got.solver.detail("local_runs")


def test_local_search_from_a_noiseless_best_toggles_its_choices(monkeypatch):
    """Where a noiseless variant is the best run (it counted no choices: noise never drew),
    the local search first replays it counting them, then toggles among them: its runs try
    many different flip sets (before the fix every one toggled choice 0, the same run)."""
    import pipeopt.solvers.greedy as greedy

    monkeypatch.setattr(greedy, "_LOCAL_MIN_OPS", 0)
    monkeypatch.setattr(greedy, "_LOCAL_STALL", 30)
    monkeypatch.setattr(greedy, "_KICK_AFTER", 50)
    monkeypatch.setattr(greedy, "_GUARD_RUNS", 0)
    seen: list[tuple[frozenset[int] | None, float, float]] = []
    run = greedy._run

    def spy(ctx, policy, *args):
        got = run(ctx, policy, *args)
        seen.append((policy.flips, policy.noise, got[1]))
        return got

    monkeypatch.setattr(greedy, "_run", spy)
    prob = _xdc(4, 12)
    got = restart_search(prob, SolveOptions(seed=3), time.perf_counter() + 60, max_runs=200)
    assert got is not None
    best_noiseless = min(v for _, noise, v in seen if noise == 0)
    assert got.iteration_time <= best_noiseless + 1e-9
    local = [flips for flips, _, _ in seen if flips]
    assert len(local) > 100 and len(set(local)) > 20


def test_guard_runs_capped_by_ops(monkeypatch):
    """The guard runs stop at ``_GUARD_OPS`` ops in all (a count, so the runs stay seeded):
    at p = 64, m = 1024 2,000 of them would fill any time limit (review, 2026-12-05)."""
    import pipeopt.solvers.greedy as greedy

    monkeypatch.setattr(greedy, "_LOCAL_MIN_OPS", 0)
    prob = _xdc(4, 12)
    monkeypatch.setattr(greedy, "_GUARD_OPS", 5 * prob.num_ops)
    guarded: list[float] = []
    run = greedy._run

    def spy(ctx, policy, *args):
        guarded.append(policy.guard)
        return run(ctx, policy, *args)

    monkeypatch.setattr(greedy, "_run", spy)
    restart_search(prob, SolveOptions(seed=1), time.perf_counter() + 60, max_runs=60)
    assert sum(g > 0 for g in guarded) == 5


def test_guard_keeps_the_device_free_for_an_arriving_b():
    """An idle guard of share g: on a guarded device no F starts at s while a B's input
    arrives in (s, s + g x T_F) (the unguarded run has such F's there); the run is valid;
    an empty device set changes nothing."""
    from dataclasses import replace

    from pipeopt.simulate import simulate
    from pipeopt.solvers.greedy import Policy, _Context, _run

    p, share = 6, 0.6
    prob = _xdc(p, 18)
    ctx = _Context(prob)
    plain = Policy(mem_caps="fit", wait_w=True)
    devices = frozenset(range(1, p - 1))
    guarded = replace(plain, guard=share, guard_devices=devices)
    assert _run(ctx, replace(plain, guard=share))[0] == _run(ctx, plain)[0]

    def crowded(policy):
        """F's on the guarded devices that a B's input reaches within the share."""
        ids, makespan, _, _ = _run(ctx, policy)
        sched = simulate(prob, ctx.orders(ids))
        validate(sched)
        assert fits_memory(sched, prob)
        assert sched.iteration_time == pytest.approx(makespan)
        arrive = {(o.stage - 1, o.microbatch): o.end + prob.latency[o.stage][o.stage - 1]
                  for o in sched.ops if o.kind == "B" and o.stage > 0}
        return sum(1 for o in sched.ops if o.kind == "F" and o.device in devices
                   for (k, _), r in arrive.items()
                   if k == o.stage and 0 < r - o.start < share * (o.end - o.start) - 1e-9)

    assert crowded(plain) > 0
    assert crowded(guarded) == 0


def test_restarts_draw_guards_on_large_instances(monkeypatch):
    """The first restarts after the variants draw an idle guard (seeded): the answer is
    valid and the same for the same seed."""
    import pipeopt.solvers.greedy as greedy

    monkeypatch.setattr(greedy, "_LOCAL_MIN_OPS", 0)
    monkeypatch.setattr(greedy, "_GUARD_RUNS", 40)
    prob = _xdc(6, 18)
    opts = SolveOptions(time_limit=30, seed=1)
    far = time.perf_counter() + 60
    n = len(policies_for(prob)) + 40
    got = restart_search(prob, opts, far, max_runs=n)
    assert got is not None and got.solver.detail("local_runs") == 0
    validate(got)
    assert fits_memory(got, prob)
    again = restart_search(prob, opts, far, max_runs=n)
    assert again.device_orders() == got.device_orders()


def test_order_search_rounds_go_on_from_the_best_order(monkeypatch, counted_order_search):
    """Chains that converge before the deadline start again (other seeds, from the best order
    so far): more timings than one round, never a worse answer, the same for the same seed."""
    from pipeopt.solvers import greedy

    search, calls = counted_order_search
    out = {}
    for rounds in (1, greedy._ORDER_ROUNDS):
        monkeypatch.setattr(greedy, "_ORDER_ROUNDS", rounds)
        calls[0] = 0
        a, b = search(), search()
        assert a is not None and b is not None and (a[0], a[2]) == (b[0], b[2])
        out[rounds] = (a[0], calls[0] // 2)
    one, many = out[1], out[greedy._ORDER_ROUNDS]
    assert many[1] > one[1] and many[0] <= one[0] + 1e-9


def test_wait_w_judges_the_w_the_lookahead_swapped_in():
    """Two devices, F 2 / 1 s, B 1.5 / 2 s, W 0.5 / 1 s, no memory limit, lookahead and
    wait_w. At 7.5 s device 0 has run B0.0; F0.3 (2 s) and W0.0 (0.5 s) are ready and B0.1's
    input arrives at 8 s. The F would still run then, so the lookahead swaps in the W, which
    ends at 8 s: it runs. wait_w judged it on the F's 2 s (a stale duration) and held it
    back, idling the device until 8 s: 19.5 s in all instead of 18 s."""
    from pipeopt.simulate import simulate
    from pipeopt.solvers.greedy import Policy, _Context, _run

    prob = uniform_problem(2, 4).replace(forward=(2.0, 1.0), backward_input=(1.5, 2.0),
                                         backward_weight=(0.5, 1.0))
    ctx = _Context(prob)
    ids, makespan, *_ = _run(ctx, Policy(lookahead=True, wait_w=True))
    s = validate(simulate(prob, ctx.orders(ids)))
    times = s.op_times()
    assert times[Op("B", 0, 0)] == (approx(6.0), approx(7.5))
    assert times[Op("W", 0, 0)] == (approx(7.5), approx(8.0))
    assert times[Op("B", 0, 1)] == (approx(8.0), approx(9.5))
    assert makespan == approx(18.0) and s.makespan == approx(18.0)
