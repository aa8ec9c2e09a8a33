"""The relaxation bound (pipeopt.solvers.relaxation): never above an optimum found without it
(exhaustive search, CP-SAT's proof with the analytic bounds taken out), above the analytic
bound where the later stages force waits, and the values of small cases."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator

import pytest

from pipeopt.bounds import makespan_lower_bound
from pipeopt.problem import Problem, chain_links, uniform_problem
from pipeopt.solvers.relaxation import relaxation_bound
from tests.test_bounds_memory import _proven_optimum
from tests.test_brute_force import CASES, brute_force


def _xdc(p: int, m: int, latency: float) -> Problem:
    """benchmarks/search.py's instance: latency on the middle link, 1F1B's memory (p
    activations), F / B / W = 1 / 1.2 / 0.8 s, half of the activation held from B until W."""
    lat = [0.0] * (p - 1)
    lat[p // 2 - 1] = latency
    links, bw = chain_links(p, lat, [math.inf] * (p - 1))
    return uniform_problem(p, m, 1.0, 1.2, 0.8, weight_grad=0.5,
                           memory_limit=float(p)).replace(latency=links, bandwidth=bw)


def test_waits_at_the_last_stage_by_hand() -> None:
    """Two devices, F / B = 1 / 2 s on both, fused backward, no memory limit, no link delay,
    m = 2. Stage 0's round trip is R = F + F + B = 4 s; on stage 1, a_1 = 1, c_1 = 2, so
    g_1 = 4 - 1 - 1 - 2 = 0 and gamma_1 = 0 + 1 + 2 = 3. With x_1 >= x_0 + 1 >= 1 the lemma
    says b_0 >= x_1 + 4 >= 5 or b_1 >= x_0 + 7 >= 7. Then either both B(0, .) start at 5 or
    later (device 0 runs them one after the other: done at 5 + 2 + 2 = 9), or B(0, 1) starts
    at 7 or later (done at 9): 9 s. The analytic bounds give 8 s (device 0's work, 6 s, and its
    2 s of warm-up idle); exhaustive search finds 9 s (device 1: F, B, F, B or F, F, B, B, and
    device 0 waits for the second B either way)."""
    prob = uniform_problem(2, 2, 1.0, 2.0, 0.0, split_backward=False)
    got = relaxation_bound(prob, time_limit=10)
    assert got is not None and got.optimal and got.stage == 0 and got.pairs == 1
    assert makespan_lower_bound(prob) == pytest.approx(8.0)
    assert got.value == pytest.approx(9.0)
    assert brute_force(prob)[0] == pytest.approx(9.0)


def test_published_instances() -> None:
    """benchmarks/search.py's --small instances, where CP-SAT proves the optimum:
    xdc p = 4, m = 12 (latency 8 s): analytic 85.8, relaxation 86.6 = the optimum;
    xdc p = 4, m = 16, latency 1.7 s: analytic 61.0, relaxation 62.8, optimum 63.4
    (benchmarks/README.md)."""
    a = relaxation_bound(_xdc(4, 12, 8.0), time_limit=60)
    assert a is not None and a.optimal
    assert makespan_lower_bound(_xdc(4, 12, 8.0)) == pytest.approx(85.8)
    assert a.value == pytest.approx(86.6)
    b = relaxation_bound(_xdc(4, 16, 1.7), time_limit=60)
    assert b is not None and b.optimal
    assert makespan_lower_bound(_xdc(4, 16, 1.7)) == pytest.approx(61.0)
    assert b.value == pytest.approx(62.8)


def _random_tiny(rng: random.Random) -> Problem:
    p = rng.choice([2, 2, 3])
    split = rng.random() < 0.6
    m = 3 if p == 2 and not split and rng.random() < 0.5 else 2  # (brute force: seconds)
    t = [0.5, 1.0, 1.5, 2.0]
    lat = [rng.choice([0.0, 0.0, 1.0, 2.5]) for _ in range(p - 1)]
    bws = [rng.choice([math.inf, math.inf, 1.0]) for _ in range(p - 1)]
    links, bw = chain_links(p, lat, bws)
    return Problem(devices=p, microbatches=m, forward=[rng.choice(t) for _ in range(p)],
                   backward_input=[rng.choice(t) for _ in range(p)],
                   backward_weight=[rng.choice(t) for _ in range(p)],
                   split_backward=split, activation_memory=[1.0] * p,
                   weight_grad_memory=[rng.choice([0.0, 0.5, 1.0]) for _ in range(p)],
                   message_size=[rng.choice([0.5, 1.0]) for _ in range(p - 1)],
                   latency=links, bandwidth=bw,
                   memory_limit=[rng.choice([1.0, 1.5, 2.0, None]) for _ in range(p)])

def _solvable_tiny(seed: int, count: int) -> Iterator[tuple[Problem, float]]:
    """``count`` random tiny instances drawn with ``seed`` and their exhaustive optimum, those
    with no schedule left out."""
    rng = random.Random(seed)
    for _ in range(count):
        prob = _random_tiny(rng)
        best, _ = brute_force(prob)
        if math.isfinite(best):
            yield prob, best



def test_below_brute_force_on_random_tiny_instances() -> None:
    """Every order combination timed (no solver): memory limits, latencies, a serialized link,
    split or fused backward; the bound never exceeds the optimum, and is above the analytic
    bound on some of them (so the lemma is exercised)."""
    checked = stronger = 0
    for prob, best in _solvable_tiny(5, 30):
        got = relaxation_bound(prob, time_limit=10)
        assert got is not None
        checked += 1
        assert got.value <= best * (1 + 1e-9), (prob, got, best)
        stronger += got.value > makespan_lower_bound(prob) * (1 + 1e-9)
    assert checked >= 20
    assert stronger >= 2


def test_below_proven_optima_on_random_small_instances(monkeypatch: pytest.MonkeyPatch) -> None:
    """p = 3..4, m = 4..6, a slow link and tight memory on device 0: never above CP-SAT's
    proven optimum (its analytic bounds taken out, so the bound under test plays no part)."""
    rng = random.Random(7)
    checked = 0
    for _ in range(8):
        p = rng.choice([3, 4])
        m = rng.choice([4, 5, 6])
        lat = [rng.choice([0.0, 1.0, 3.0]) for _ in range(p - 1)]
        links, bw = chain_links(p, lat, [math.inf] * (p - 1))
        prob = uniform_problem(p, m, 1.0, rng.choice([1.0, 1.2, 2.0]), 0.8, weight_grad=0.5,
                               memory_limit=float(rng.choice([2, 3, p]))).replace(
            latency=links, bandwidth=bw)
        best = _proven_optimum(prob, "makespan", monkeypatch)
        if best is None:
            continue
        checked += 1
        got = relaxation_bound(prob, time_limit=20)
        assert got is not None
        assert got.value <= best * (1 + 1e-9), (prob, got, best)
    assert checked >= 5


def test_not_applicable() -> None:
    varied = uniform_problem(2, 3, 1, 1, 1).replace(microbatch_scale=(1.0, 2.0, 1.0))
    assert relaxation_bound(varied, window=2) is None  # windows number identical ones by start
    assert relaxation_bound(varied, max_pairs=8) is None  # 3 * 2 F-B + 3 B-B pairs
    got = relaxation_bound(varied, max_pairs=9)
    assert got is not None and got.pairs == 9 and got.window == 3
    for bad in (2, -1, True):
        with pytest.raises(ValueError, match="stage"):
            relaxation_bound(uniform_problem(2, 2, 1, 1, 1), stage=bad)
        with pytest.raises(ValueError, match="stage"):
            relaxation_bound(varied, stage=bad)


def _text_image(p: int, scales: tuple[float, ...]) -> Problem:
    """benchmarks/variable_microbatches.py's analogue (F / B / W = 1 / 1.2 / 0.8 s, half of the
    activation held until W) with memory 1.5 times the largest micro-batch's activation."""
    prob = uniform_problem(p, len(scales), 1.0, 1.2, 0.8, weight_grad=0.5).replace(
        microbatch_scale=scales)
    return prob.replace(memory_limit=(1.5 * max(prob.memory_scale),) * p)


#: (devices, time factors, the analytic bound, the relaxation's optimum at stage 0, CP-SAT's
#: proven optimum of the problem), seconds; each measured (the optima: solve_cpsat, 20 s,
#: status optimal).
VARIED = [(3, (0.38, 2.06, 0.43, 2.0), 20.262, 28.396, 29.206),
          (3, (0.41, 2.08, 0.35, 2.07), 20.674, 29.046, 29.806),
          (4, (0.29, 2.19, 2.17, 0.25), 26.25, 40.104, 40.644)]


@pytest.mark.parametrize(("p", "scales", "analytic", "relaxed", "optimum"), VARIED)
def test_varied_microbatches_below_optima_and_above_the_analytic_bound(
        p: int, scales: tuple[float, ...], analytic: float, relaxed: float,
        optimum: float) -> None:
    """Micro-batches of different cost, memory tight (two image-like micro-batches among
    text-like ones): the relaxation at every stage is never above the proven optimum nor the
    greedy's schedule, and at stage 0 it proves far more than the analytic bound (within
    3 % of the optimum, where the analytic bound is 30-35 % below it)."""
    from pipeopt.solvers import SolveOptions, solve

    prob = _text_image(p, scales)
    greedy = solve(prob, "greedy", options=SolveOptions(time_limit=2, workers=1))
    assert optimum <= greedy.makespan * (1 + 1e-9)
    assert makespan_lower_bound(prob) == pytest.approx(analytic, abs=1e-3)
    for stage in range(p):
        got = relaxation_bound(prob, time_limit=20, stage=stage, workers=1)
        assert got is not None and got.stage == stage
        assert got.value <= optimum * (1 + 1e-9), (stage, got, optimum)
        if stage == 0:
            assert got.optimal
            assert got.value == pytest.approx(relaxed, abs=1e-3)
            assert got.value > analytic + 5.0


def test_varied_microbatches_below_optima_on_random_instances(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Random small instances of micro-batches of different cost (factors 0.2-2.5, memory
    1-3 times the largest activation, a slow link on some): never above CP-SAT's proven
    optimum, whichever stage is kept."""
    rng = random.Random(11)
    checked = 0
    for _ in range(6):
        p, m = rng.choice([2, 3]), 3
        lat = [rng.choice([0.0, 0.0, 1.5]) for _ in range(p - 1)]
        links, bw = chain_links(p, lat, [math.inf] * (p - 1))
        prob = uniform_problem(p, m, 1.0, rng.choice([1.0, 1.2]), 0.8, weight_grad=0.5).replace(
            microbatch_scale=tuple(round(rng.uniform(0.2, 2.5), 2) for _ in range(m)),
            latency=links, bandwidth=bw)
        prob = prob.replace(memory_limit=(rng.uniform(1.0, 3.0) * max(prob.memory_scale),) * p)
        checked += _never_above_optimum(prob, monkeypatch)
    assert checked >= 4


def _never_above_optimum(prob: Problem, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether CP-SAT proves ``prob``'s optimal makespan; if so, asserts that the relaxation
    bound kept around every stage is never above it."""
    best = _proven_optimum(prob, "makespan", monkeypatch)
    if best is None:
        return False
    for stage in range(prob.stages):
        got = relaxation_bound(prob, time_limit=10, stage=stage, workers=1)
        assert got is not None
        assert got.value <= best * (1 + 1e-9), (prob, stage, got, best)
    return True


def _two_kinds(p: int, scales: tuple[float, ...], memory: float) -> Problem:
    """F / B / W = 1 / 1.2 / 0.8 s, half of the activation held until W, memory ``memory``
    times the largest micro-batch's activation on every device."""
    prob = uniform_problem(p, len(scales), 1.0, 1.2, 0.8, weight_grad=0.5).replace(
        microbatch_scale=scales)
    return prob.replace(memory_limit=(memory * max(prob.memory_scale),) * p)


def test_identical_microbatches_taken_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two kinds of micro-batches, each four times (p = 4, m = 8, factors 0.3 and 2.0, memory
    twice the larger activation): with the identical ones in index order (the default) stage
    0's model proves 45.6 s (in 0.3-0.5 s on a loaded machine), where the analytic bound is
    33.6 s and the model without the order proved only 37.6 s in 10 s; CP-SAT's optimum and
    the greedy's schedule are 46.5 s. Never above either at any stage."""
    from pipeopt.solvers import SolveOptions, solve

    prob = _two_kinds(4, (0.3, 0.3, 2.0, 2.0) * 2, 2.0)
    assert makespan_lower_bound(prob) == pytest.approx(33.6)
    greedy = solve(prob, "greedy", options=SolveOptions(time_limit=2, workers=1)).makespan
    best = _proven_optimum(prob, "makespan", monkeypatch)
    top = greedy if best is None else min(greedy, best)
    for stage in range(prob.stages):
        got = relaxation_bound(prob, time_limit=20, stage=stage, workers=1)
        assert got is not None and got.value <= top * (1 + 1e-9), (stage, got, top)
        if stage == 0:
            assert got.optimal and got.value == pytest.approx(45.6, abs=1e-3)


def test_identical_microbatches_below_optima_on_random_instances(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Random small instances of two kinds of micro-batches (so some are identical; factors
    0.2-2.5, memory 1-3 times the largest activation, a latency on some links): the model
    with the identical ones in order is never above CP-SAT's proven optimum, whichever stage
    is kept."""
    rng = random.Random(5)
    checked = 0
    for _ in range(6):
        p, m = rng.choice([2, 3]), rng.choice([3, 4])
        kinds = [round(rng.uniform(0.2, 2.5), 2) for _ in range(2)]
        scales = tuple(kinds[:2] + [rng.choice(kinds) for _ in range(m - 2)])
        lat = [rng.choice([0.0, 0.0, 1.5]) for _ in range(p - 1)]
        links, bw = chain_links(p, lat, [math.inf] * (p - 1))
        prob = _two_kinds(p, scales, rng.uniform(1.0, 3.0)).replace(latency=links, bandwidth=bw)
        checked += _never_above_optimum(prob, monkeypatch)
    assert checked >= 4


def test_auto_reports_it() -> None:
    """auto counts the relaxation bound: at xdc p = 4, m = 12 it proves the greedy's 86.6 s
    optimal (the analytic bound is 85.8 s), so CP-SAT is skipped and the status is optimal."""
    from pipeopt.solvers import SolveOptions, solve

    prob = _xdc(4, 12, 8.0)
    sched = solve(prob, "auto", options=SolveOptions(time_limit=30, workers=2))
    assert sched.iteration_time == pytest.approx(86.6)
    assert sched.solver.lower_bound == pytest.approx(86.6)
    assert sched.solver.status == "optimal"
    assert sched.solver.detail("relaxation_bound") == pytest.approx(86.6)


def test_auto_reports_it_for_varied_microbatches() -> None:
    """auto runs the relaxation on micro-batches of different cost where memory can bind (here
    the analytic memory bound sees nothing) and counts it in its bound, which stays below the
    proven optimum (29.206 s; analytic 20.262 s); without a memory limit it does not run."""
    from pipeopt.bounds import stage_memory_bound
    from pipeopt.solvers import SolveOptions, solve
    from pipeopt.solvers.relaxation import memory_can_bind

    p, scales, analytic, _, optimum = VARIED[0]
    prob = _text_image(p, scales)
    assert not any(stage_memory_bound(prob)) and memory_can_bind(prob)
    sched = solve(prob, "auto", options=SolveOptions(time_limit=10, workers=2))
    relaxed = sched.solver.detail("relaxation_bound")
    assert relaxed is not None and analytic - 1e-9 <= relaxed <= optimum * (1 + 1e-9)
    assert relaxed - 1e-9 <= sched.solver.lower_bound <= optimum * (1 + 1e-9)
    assert sched.makespan >= optimum * (1 - 1e-9)
    free = solve(prob.replace(memory_limit=(None,) * p), "auto",
                 options=SolveOptions(time_limit=5, workers=2))
    assert free.solver.detail("relaxation_bound") is None


def test_auto_leaves_it_out_where_memory_does_not_pace() -> None:
    prob = uniform_problem(4, 8, 1.0, 1.0, 1.0).replace(
        latency=chain_links(4, [0.0, 3.0, 0.0], [math.inf] * 3)[0])
    from pipeopt.solvers import SolveOptions, solve

    sched = solve(prob, "auto", options=SolveOptions(time_limit=5, workers=2))
    assert sched.solver.detail("relaxation_bound") is None


@pytest.mark.parametrize("name", list(CASES))
def test_below_brute_force_with_every_stage_kept(name: str) -> None:
    """tests/test_brute_force.py's cases (two chunks per device in a V among them), each stage
    in turn kept exactly: never above the exhaustive optimum."""
    prob = CASES[name]
    best, _ = brute_force(prob)
    for stage in range(prob.stages):
        got = relaxation_bound(prob, time_limit=10, stage=stage)
        assert got is not None and got.stage == stage
        assert got.value <= best * (1 + 1e-9), (stage, got, best)


def test_pair_count_by_formula() -> None:
    from pipeopt.solvers.relaxation import _pairs_within

    for m in (1, 2, 5, 9):
        for gap in (0.0, 0.5, 1.0, 2.5, 3.0, 100.0):
            for step in (0.0, 1.0, 1.5):
                want = sum(1 for i in range(m) for j in range(i + 1, m) if (j - i) * step < gap)
                assert _pairs_within(m, gap, step) == want, (m, gap, step)
    # benchmarks/search.py's p = 32, m = 128: 128,889 pair choices, over the cap (no model).
    assert relaxation_bound(_xdc(32, 128, 8.0), time_limit=1) is None


def test_memory_starts_by_hand_and_against_schedules() -> None:
    """bounds.memory_starts at benchmarks/search.py's xdc p = 16, m = 64: F number 17 starts no
    earlier than 52 s after the first (micro-batch 1 held 52 s with its W), F number 64 no
    earlier than 201 s (memory_bound's hand computation, tests/test_bounds_memory.py); and on
    smaller instances every greedy schedule's stage-0 F starts meet it."""
    from pipeopt.bounds import memory_starts
    from pipeopt.solvers import SolveOptions, solve

    lo = memory_starts(_xdc(16, 64, 8.0), 0)
    assert len(lo) == 64 and lo[0] == 0.0
    assert lo[16] == pytest.approx(52.0) and lo[63] == pytest.approx(201.0)
    assert all(b >= a + 1.0 - 1e-9 for a, b in itertools.pairwise(lo))
    for prob in (_xdc(4, 12, 8.0), _xdc(4, 16, 1.7), _xdc(6, 18, 2.75)):
        sched = solve(prob, "greedy", options=SolveOptions(time_limit=10, workers=1))
        starts = sorted(t.start for t in sched.ops if t.op.kind == "F" and t.op.stage == 0)
        bound = memory_starts(prob, 0)
        assert any(x > (i * 1.0) + 1e-9 for i, x in enumerate(bound))  # memory counts here
        for i, x in enumerate(starts):
            assert x - starts[0] >= bound[i] - 1e-9, (prob, i)


def test_window_values_of_small_cases() -> None:
    """The last K micro-batches alone with their F starts from memory_starts: at xdc p = 4,
    m = 16, latency 1.7 s the last 8 prove 62.0 s (the analytic bound: 61.0, the optimum 63.4)
    and all 16 the full model's 62.8; at xdc p = 4, m = 12 the last 6 already prove the
    optimum, 86.6 s."""
    prob = _xdc(4, 16, 1.7)
    got = relaxation_bound(prob, time_limit=30, window=8)
    assert got is not None and got.optimal and got.window == 8
    assert got.value == pytest.approx(62.0)
    assert relaxation_bound(prob, time_limit=30).window == 16  # type: ignore[union-attr]
    six = relaxation_bound(_xdc(4, 12, 8.0), time_limit=30, window=6)
    assert six is not None and six.optimal and six.value == pytest.approx(86.6)
    for bad in (0, 17, 2.5, True):
        with pytest.raises(ValueError, match="window"):
            relaxation_bound(prob, window=bad)  # type: ignore[arg-type]


def test_windows_below_optima() -> None:
    """Every window of every stage kept, on tests/test_brute_force.py's cases and on random
    tiny instances: never above the exhaustive optimum; and above the analytic bound on some
    (so the windowed model is exercised, not only the full one)."""
    rng = random.Random(11)
    probs = list(CASES.values()) + [_random_tiny(rng) for _ in range(16)]
    checked = stronger = 0
    for prob in probs:
        best, _ = brute_force(prob)
        if not math.isfinite(best):
            continue
        analytic = makespan_lower_bound(prob)
        for stage in range(prob.stages):
            for window in range(1, prob.microbatches + 1):
                got = relaxation_bound(prob, time_limit=10, stage=stage, window=window)
                if got is None:
                    continue
                checked += 1
                assert got.value <= best * (1 + 1e-9), (prob, stage, window, got, best)
                stronger += window < prob.microbatches and got.value > analytic * (1 + 1e-9)
    assert checked >= 40
    assert stronger >= 1


def test_windows_below_proven_optima_in_the_memory_regime(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """p = 3..4, m = 6..8 with a slow link and 1F1B's memory or less, where the last rounds
    are paced by memory: every window never above CP-SAT's proven optimum (its analytic
    bounds taken out), and above the analytic bound on some."""
    rng = random.Random(3)
    checked = stronger = 0
    for _ in range(6):
        p = rng.choice([3, 4])
        m = rng.choice([6, 8])
        lat = [0.0] * (p - 1)
        lat[p // 2 - 1] = rng.choice([1.0, 1.7, 3.0])
        links, bw = chain_links(p, lat, [math.inf] * (p - 1))
        prob = uniform_problem(p, m, 1.0, 1.2, 0.8, weight_grad=0.5,
                               memory_limit=float(rng.choice([2, p]))).replace(
            latency=links, bandwidth=bw)
        best = _proven_optimum(prob, "makespan", monkeypatch)
        if best is None:
            continue
        analytic = makespan_lower_bound(prob)
        checked += 1
        for window in range(2, m + 1, 2):
            got = relaxation_bound(prob, time_limit=20, window=window)
            assert got is not None
            assert got.value <= best * (1 + 1e-9), (prob, window, got, best)
            stronger += got.value > analytic * (1 + 1e-9)
    assert checked >= 4
    assert stronger >= 1


@pytest.mark.slow
def test_window_at_p16() -> None:
    """benchmarks/search.py's xdc p = 16, m = 64: the last 24 micro-batches prove 253.8 s
    (CP-SAT's optimum of that model), where the analytic bound and the full model (nothing
    proven in 60 s) give 253 s."""
    prob = _xdc(16, 64, 8.0)
    assert makespan_lower_bound(prob) == pytest.approx(253.0)
    got = relaxation_bound(prob, time_limit=120, window=24)
    assert got is not None and got.optimal
    assert got.value == pytest.approx(253.8)


def test_order_cuts_stronger_on_a_tiny_case() -> None:
    """p = 2, m = 3, fused backward, F = 1.5 / 2 s, B = 1 s, two activations on device 1
    (one of _random_tiny's cases): with the micro-batches taken in one order (module
    docstring, "Order") the relaxation proves the exhaustive optimum, 19 s; without it only
    the analytic bound, 16.5 s."""
    prob = Problem(devices=2, microbatches=3, forward=[1.5, 2.0], backward_input=[1.0, 1.0],
                   backward_weight=[1.5, 2.0], split_backward=False,
                   activation_memory=[1.0, 1.0], weight_grad_memory=[1.0, 0.5],
                   message_size=[0.5], memory_limit=[None, 2.0])
    assert brute_force(prob)[0] == pytest.approx(19.0)
    assert makespan_lower_bound(prob) == pytest.approx(16.5)
    before = relaxation_bound(prob, time_limit=10, fifo=False)
    after = relaxation_bound(prob, time_limit=10)
    assert before is not None and after is not None and after.optimal
    assert before.value == pytest.approx(16.5)
    assert after.value == pytest.approx(19.0)


def test_order_cuts_below_brute_force_on_random_tiny_instances() -> None:
    """More random tiny instances (another seed), every stage kept, the order cuts on: never
    above the exhaustive optimum; stronger than without them on some."""
    checked = stronger = 0
    for prob, best in _solvable_tiny(23, 30):
        for stage in range(prob.stages):
            got = relaxation_bound(prob, time_limit=10, stage=stage)
            assert got is not None
            checked += 1
            assert got.value <= best * (1 + 1e-9), (prob, stage, got, best)
            plain = relaxation_bound(prob, time_limit=10, stage=stage, fifo=False)
            assert plain is not None
            stronger += got.value > plain.value * (1 + 1e-9)
    assert checked >= 30
    assert stronger >= 1


def test_largest_window() -> None:
    """The most micro-batches whose model fits a pair cap (auto's windows): at
    benchmarks/search.py's xdc p = 16, m = 64, 18 within 2,000 pair choices, 24 within
    3,256 (its pair count), 40 within 8,000 and all 64 within 20,000 (16,790 pairs)."""
    from pipeopt.solvers.relaxation import largest_window

    prob = _xdc(16, 64, 8.0)
    assert [largest_window(prob, c) for c in (0, 2000, 3256, 3255, 8000, 20000)] == [
        1, 18, 24, 23, 40, 64]
    got = relaxation_bound(prob, time_limit=0.5, window=24)
    assert got is not None and got.pairs == 3256
    assert largest_window(_xdc(4, 12, 8.0), 2000) == 12


def test_questions_answer_the_least_makespan() -> None:
    """The yes/no questions of _least_span end at the model's optimum where the time allows:
    the published small values (86.6 s, 62.8 s) with the optimum proven and at least two
    questions (one refuted, one answered by a relaxed schedule); and a model with no schedule
    at all (memory for no activation) gives back the analytic bound."""
    got = relaxation_bound(_xdc(4, 12, 8.0), time_limit=60)
    assert got is not None and got.optimal and got.questions >= 2
    assert got.value == pytest.approx(86.6)
    from ortools.sat.python import cp_model

    from pipeopt.solvers.relaxation import _least_span

    model = cp_model.CpModel()
    span = model.new_int_var(0, 100, "span")
    model.add(span >= 37)
    assert _least_span(model, span, 10, 100, 10.0, 1)[:2] == (37, 37)
    model.add(span <= 20)  # no schedule at all: nothing learnt
    assert _least_span(model, span, 10, 100, 10.0, 1)[:2] == (10, None)


def test_auto_takes_a_window_where_the_whole_model_is_too_large(monkeypatch) -> None:
    """xdc p = 8, m = 48: the whole model has 3,736 pair choices (over auto's 2,000), so auto
    keeps the last micro-batches (up to 8,000 pairs: all 48) and reports a bound above the
    analytic 227.4 s (the last 31 alone prove 229.8 s in about 5 s, loaded). The window runs
    from RESTART_MIN_OPS ops (1,152 here: lowered to take that path); below, none. On a chain
    the kept-devices bound takes that case (tests/test_auto_kept_devices.py): switched off
    here (KEPT_TAIL = 0) to reach the relaxation's window."""
    import pipeopt.solvers.auto as auto_mod
    from pipeopt.solvers import SolveOptions, solve
    from pipeopt.solvers.relaxation import largest_window

    prob = _xdc(8, 48, 8.0)
    assert largest_window(prob, 2000) == 31
    assert makespan_lower_bound(prob) == pytest.approx(227.4)
    assert prob.num_ops < auto_mod.RESTART_MIN_OPS
    best = solve(prob, "greedy")
    assert auto_mod._relaxation(prob, "makespan", best, 30.0, 2) is None  # below: none
    monkeypatch.setattr(auto_mod, "RESTART_MIN_OPS", 1000)
    monkeypatch.setattr(auto_mod, "KEPT_TAIL", 0)
    sched = solve(prob, "auto", options=SolveOptions(time_limit=30, workers=2))
    got = sched.solver.detail("relaxation_bound")
    assert got is not None and got > 227.4 + 1e-6
    assert got <= sched.iteration_time * (1 + 1e-9)


@pytest.mark.slow
def test_ordered_window_at_p16() -> None:
    """benchmarks/search.py's xdc p = 16, m = 64 with the order cuts and the questions: the
    last 40 micro-batches prove 254.6 s, that model's optimum (42 s on a loaded 2-core
    machine; without the order cuts CP-SAT proved only 253.2 s in 300 s), where the analytic
    bound is 253 s and the best schedule known 266.0 s."""
    got = relaxation_bound(_xdc(16, 64, 8.0), time_limit=240, window=40)
    assert got is not None and got.optimal
    assert got.value == pytest.approx(254.6)


def test_auto_takes_the_window_with_a_step_tail_too(monkeypatch) -> None:
    """The same instance with a step tail on every stage (``grad_reduce``, as every profile's
    overheads give): the window still runs, since memory sets the *makespan* bound (the
    iteration-time bound adds the tail and is no measure of what memory paces; the chain's
    kept-devices case switched off, as above)."""
    import pipeopt.solvers.auto as auto_mod
    from pipeopt.solvers import solve

    prob = _xdc(8, 48, 8.0).replace(grad_reduce=(2.0,) * 8)
    monkeypatch.setattr(auto_mod, "RESTART_MIN_OPS", 1000)
    monkeypatch.setattr(auto_mod, "KEPT_TAIL", 0)
    best = solve(prob, "greedy")
    got = auto_mod._relaxation(prob, "makespan", best, 20.0, 2)
    assert got is not None and got >= makespan_lower_bound(prob) - 1e-9
    assert got <= best.makespan * (1 + 1e-9)
