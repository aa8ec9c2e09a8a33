"""The memory-aware lower bound (``bounds.memory_bound``): hand-computed values, the instance
where it is strictly stronger than every other bound, and every bound against optima found by
exhaustive search or proven by CP-SAT with the analytic bound taken out of its model."""

from __future__ import annotations

import math
import random
import time

import pytest

import pipeopt.solvers.cpsat as cpsat_mod
from pipeopt import bounds
from pipeopt.bounds import (
    critical_path,
    device_bound,
    iteration_lower_bound,
    makespan_lower_bound,
    memory_bound,
    overtaking_bound,
    passing_bound,
    span_lower_bound,
    warmup_bound,
)
from pipeopt.problem import Problem, chain_links, uniform_problem
from pipeopt.simulate import validate
from pipeopt.solvers import SolveOptions
from pipeopt.solvers.cpsat import solve_cpsat
from tests.test_brute_force import brute_force


def _old_bound(problem: Problem) -> float:
    """The makespan bound without the memory argument."""
    return max(critical_path(problem), *device_bound(problem), *warmup_bound(problem),
               overtaking_bound(problem), passing_bound(problem))


def _one_slot(m: int = 3) -> Problem:
    """Two devices, F = B = 1 s, fused backward, 2 s latency each way, room for one
    activation on device 0."""
    lat, bw = chain_links(2, [2.0], [math.inf])
    return uniform_problem(2, m, 1.0, 0.5, 0.5, split_backward=False).replace(
        latency=lat, bandwidth=bw, memory_limit=(1.0, None))


def _xdc(p: int, m: int) -> Problem:
    """benchmarks/search.py's cross-datacenter chain: F / B / W = 1 / 1.2 / 0.8 s, half the
    activation held from B to W, 8 s latency on the middle link, p activations per device."""
    lat = [0.0] * (p - 1)
    lat[p // 2 - 1] = 8.0
    links, bw = chain_links(p, lat, [math.inf] * (p - 1))
    return uniform_problem(p, m, 1.0, 1.2, 0.8, weight_grad=0.5,
                           memory_limit=float(p)).replace(latency=links, bandwidth=bw)


def test_one_slot_by_hand() -> None:
    # Device 0 holds one activation: F(0, j) waits for B(0, j - 1) to end. A micro-batch's
    # activation is held for F0 + 2 + F1 + B1 + 2 + B0 = 8 s, so F's start at 0, 8, 16 and
    # the last one ends 8 s later: 24 s. The other bounds see 6 s of work plus 6 s of idle
    # before the first B and 6 s after the last F: 18 s.
    prob = _one_slot()
    assert memory_bound(prob) == pytest.approx((24.0, 0.0))
    assert _old_bound(prob) == pytest.approx(18.0)
    assert makespan_lower_bound(prob) == pytest.approx(24.0)
    assert brute_force(prob)[0] == pytest.approx(24.0)
    # Device 0's span is the same 24 s (its first op starts at 0).
    assert span_lower_bound(prob) == pytest.approx(24.0)


def test_headline_instance_by_hand() -> None:
    # Stage 0 of xdc p=16 m=64: an activation is held from F's start to B's end for at least
    # 16 F + 15 B + 2 x 8 s + B = 51.2 s, and half of it until W ends (52 s). 16 fit, and a
    # half beside 16 whole ones does not, so F number i + 16 starts >= 52 s after F number i.
    # F's 1-16 run at 0..15; F 17 at 52; then each F needs one F, B and W (3 s) of device
    # time: F's 17-32 at 52, 55, .., 97; 33-48 at 104 + 3t (F 33 >= F 17 + 52); 49-64 at
    # 156 + 3t, the last at 201; its round trip, B and W take 52 s more: 253 s.
    prob = _xdc(16, 64)
    assert memory_bound(prob)[0] == pytest.approx(253.0)
    assert makespan_lower_bound(prob) == pytest.approx(253.0)
    assert _old_bound(prob) == pytest.approx(245.0)  # 9.6% -> 6.2% below the 268.6 s found


def test_skipped_where_device_time_paces() -> None:
    # p = 32: stage 0 holds an activation for 32 + 31 x 1.2 + 16 + 1.2 + 0.8 = 87.2 s < 32 x
    # 3 s of device work: memory never paces the steady state, the bound is not computed.
    assert max(memory_bound(_xdc(32, 64))) == 0.0
    assert max(memory_bound(uniform_problem(4, 8, 1, 1, 1))) == 0.0  # no memory limit


def test_extrapolation_loses_nothing_here(monkeypatch: pytest.MonkeyPatch) -> None:
    prob = _xdc(16, 256)
    short = memory_bound(prob)
    monkeypatch.setattr(bounds, "_MEMORY_ROUNDS", 10**6)
    assert memory_bound(prob) == pytest.approx(short)
    assert max(short) > 0


def test_cheap_at_p64_m1024() -> None:
    prob = uniform_problem(64, 1024, 1, 1.2, 0.8, weight_grad=0.5, memory_limit=8.0)
    makespan_lower_bound(prob)  # warm the problem's cached columns
    t = time.perf_counter()
    value = makespan_lower_bound(prob)
    # Generous: makespan and span bounds take 3-13 ms there on a shared 2-core machine.
    assert time.perf_counter() - t < 1.0
    # 8 activations per round trip of 64 F + 63 B + B + W = 141.6 s: 17.7 s per micro-batch.
    assert value >= 1016 * 141.6 / 8
    assert value > _old_bound(prob)


def _random_problem(rng: random.Random) -> Problem:
    """p = 1..3, v = 1..2, m = 2..4, tight memory, slow links, variable micro-batches."""
    p = rng.choice([1, 2, 2, 3]) if rng.random() < 0.8 else 2
    v = 2 if p == 1 or rng.random() < 0.2 else 1
    s = p * v
    m = rng.choice([2, 3, 3, 4]) if p * v <= 2 else rng.choice([2, 3])
    split = rng.random() < 0.6
    t = [0.5, 1.0, 1.5, 2.0]
    act = [rng.choice([1.0, 2.0]) for _ in range(s)]
    lat = [rng.choice([0.0, 1.0, 3.0, 6.0]) for _ in range(p - 1)]
    links, bw = chain_links(p, lat, [math.inf] * (p - 1))
    limit = []
    for d in range(p):
        need = max(act[k] for k in range(s) if (k % p == d if v == 1 else True))
        limit.append(need * rng.choice([1, 1, 1.5, 2]) * v if rng.random() < 0.8 else None)
    scale: tuple[float, ...] = ()
    if rng.random() < 0.3:
        scale = tuple(rng.choice([0.5, 1.0, 2.0]) for _ in range(m))
    reduce = [rng.choice([0.0, 0.0, 2.0, 8.0]) for _ in range(s)] if rng.random() < 0.3 else ()
    return Problem(devices=p, microbatches=m, virtual_stages=v, placement="vshape",
                   grad_reduce=reduce,
                   split_backward=split, forward=[rng.choice(t) for _ in range(s)],
                   backward_input=[rng.choice(t) for _ in range(s)],
                   backward_weight=[rng.choice(t) for _ in range(s)],
                   activation_memory=act, weight_grad_memory=[a / 2 for a in act],
                   latency=links, bandwidth=bw, memory_limit=limit,
                   microbatch_scale=scale)


def _proven_optimum(problem: Problem, objective: str,
                    monkeypatch: pytest.MonkeyPatch) -> float | None:
    """CP-SAT's proven optimum with every analytic bound taken out of its model (so the bound
    under test plays no part in the proof); None when not proven in the time."""
    with monkeypatch.context() as mp:
        mp.setattr(cpsat_mod, "lower_bound", lambda *a, **k: 0.0)
        mp.setattr(cpsat_mod, "iteration_lower_bound", lambda *a, **k: 0.0)
        try:
            sched = validate(solve_cpsat(problem, SolveOptions(
                time_limit=20, workers=2, objective=objective)))  # type: ignore[arg-type]
        except Exception:  # no schedule fits the memory limits
            return None
    if sched.solver.status != "optimal":
        return None
    return sched.objective_value


def test_bounds_below_proven_optima(monkeypatch: pytest.MonkeyPatch) -> None:
    """On random tiny instances (tight memory, slow links, different micro-batches, two stages
    per device, gradient reductions): the makespan, iteration and span bounds never exceed
    CP-SAT's proven optima (the iteration time: the makespan objective counts reductions), and
    the memory bound is the strongest one on some of them (so this tests it)."""
    rng = random.Random(12)
    stronger = checked = 0
    for _ in range(40):
        prob = _random_problem(rng)
        best = _proven_optimum(prob, "makespan", monkeypatch)
        if best is None:
            continue
        checked += 1
        assert max(memory_bound(prob)) <= best * (1 + 1e-9), prob
        assert makespan_lower_bound(prob) <= best * (1 + 1e-9), prob
        assert iteration_lower_bound(prob) <= best * (1 + 1e-9), prob  # reductions included
        if max(memory_bound(prob)) > _old_bound(prob) * (1 + 1e-9):
            stronger += 1
            span = _proven_optimum(prob, "span", monkeypatch)
            if span is not None:
                assert span_lower_bound(prob) <= span * (1 + 1e-9), prob
    assert checked >= 30
    assert stronger >= 3


@pytest.mark.parametrize("m", [2, 3])
@pytest.mark.parametrize("latency", [1.0, 4.0])
def test_bound_below_brute_force(m: int, latency: float) -> None:
    """Exhaustive search over every order (no solver involved): split backward, two devices,
    room for one activation (or one and a weight-gradient half) on device 0."""
    lat, bw = chain_links(2, [latency], [math.inf])
    for limit in (1.0, 1.5):
        prob = uniform_problem(2, m, 1.0, 1.5, 0.5, weight_grad=0.5,
                               split_backward=m == 2).replace(
            latency=lat, bandwidth=bw, memory_limit=(limit, None))
        best, _ = brute_force(prob)
        assert max(memory_bound(prob)) <= best * (1 + 1e-9)
        assert makespan_lower_bound(prob) <= best * (1 + 1e-9)
    assert max(memory_bound(prob)) > 0


def test_a_w_that_holds_nothing_need_not_run_first() -> None:
    # Split backward whose W keeps no memory (weight_grad = 0): B's end frees the whole
    # activation, so F(0, 2) may start once B(0, 1) ends at 4 s, before W(0, 1) runs. Device 0:
    # F1 0-1, B1 3-4, F2 4-5, W1 5-6, B2 7-8, W2 8-9: 9 s (the bound once counted W1 before F2
    # and claimed 10 s; found by test_auto's property test).
    prob = uniform_problem(2, 2, 1.0, 1.0, 1.0, weight_grad=0.0).replace(
        activation_memory=(1.0, 0.0), memory_limit=(1.0, 0.0))
    best, _ = brute_force(prob)
    assert best == pytest.approx(9.0)
    assert max(memory_bound(prob)) <= best * (1 + 1e-9)
    assert makespan_lower_bound(prob) == pytest.approx(9.0)  # the warm-up bound: tight


def _slow_link(m: int) -> Problem:
    """Two devices, F = B = W = 1 s, 4-byte messages over a 1 byte/s link (4 s each way)."""
    lat, bw = chain_links(2, [0.0], [1.0])
    return uniform_problem(2, m, 1.0, 1.0, 1.0).replace(latency=lat, bandwidth=bw,
                                                        message_size=(4.0,))


def test_link_bound_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    # Forward link: the first activation is ready at 1 s (F(0, 0) ends), three of them occupy
    # it for 12 s, and after the last one F1 + B1 + 4 s back + B0 + W0 = 8 s remain: 21 s.
    # The backward link alike: first ready at 1 + 4 + 1 + 1 = 7, 12 s, then B0 + W0: 21 s.
    # The other bounds: device 0's 9 s of work and 11 - 3 s of idle before its first B: 17 s.
    # A schedule meets it: F's at 0, 1, 2 on device 0, messages back to back, so F(1, j) at
    # 5, 9, 13, B(1, j) right after, gradients sent at 7, 11, 15, and B(0, 2) + W(0, 2) end
    # at 21.
    prob = _slow_link(3)
    assert bounds.link_bound(prob) == pytest.approx(21.0)
    assert _old_bound(prob) == pytest.approx(17.0)
    assert makespan_lower_bound(prob) == pytest.approx(21.0)
    assert _proven_optimum(prob, "makespan", monkeypatch) == pytest.approx(21.0)
    assert bounds.link_bound(_slow_link(3).replace(message_size=(0.0,))) == 0.0


def test_link_bound_below_proven_optima(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random tiny instances with serialized links (and different micro-batches): the bound
    never exceeds CP-SAT's proven optimum."""
    rng = random.Random(5)
    checked = stronger = 0
    for _ in range(25):
        p, m = rng.choice([2, 3]), rng.choice([2, 3])
        lat, bw = chain_links(p, [rng.choice([0.0, 0.5, 2.0]) for _ in range(p - 1)],
                              [rng.choice([0.5, 1.0, 4.0]) for _ in range(p - 1)])
        prob = Problem(devices=p, microbatches=m, split_backward=rng.random() < 0.5,
                       forward=[rng.choice([0.5, 1.0]) for _ in range(p)],
                       backward_input=[rng.choice([0.5, 1.0, 2.0]) for _ in range(p)],
                       backward_weight=[rng.choice([0.5, 1.0]) for _ in range(p)],
                       latency=lat, bandwidth=bw,
                       message_size=[rng.choice([0.0, 1.0, 3.0]) for _ in range(p - 1)],
                       microbatch_scale=tuple(rng.choice([0.5, 1.0, 2.0]) for _ in range(m))
                       if rng.random() < 0.3 else ())
        best = _proven_optimum(prob, "makespan", monkeypatch)
        if best is None:
            continue
        checked += 1
        assert bounds.link_bound(prob) <= best * (1 + 1e-9), prob
        assert makespan_lower_bound(prob) <= best * (1 + 1e-9), prob
        stronger += bounds.link_bound(prob) > _old_bound(prob) * (1 + 1e-9)
    assert checked >= 20 and stronger >= 3


def test_edge_memory_values() -> None:
    """No room for one activation, static memory over the limit, zero-size weight gradients,
    a fused backward: finite bounds, no error."""
    base = _xdc(4, 8)
    for prob in (base.replace(memory_limit=(0.5,) * 4),
                 base.replace(static_memory=(5.0,) * 4),
                 base.replace(weight_grad_memory=(5e-324,) * 4),
                 base.replace(weight_grad_memory=(0.0,) * 4),
                 base.replace(split_backward=False)):
        assert all(math.isfinite(x) for x in memory_bound(prob))
        assert math.isfinite(makespan_lower_bound(prob))
        assert math.isfinite(span_lower_bound(prob))
    assert memory_bound(base.replace(memory_limit=(0.5,) * 4)) == (0.0,) * 4


def test_iteration_bound_with_reduction_by_hand() -> None:
    # _one_slot with a 5 s reduction of stage 0 after its last B (fused): that B starts no
    # earlier than 16 + 7 and ends at 24, so the iteration takes at least 29 s.
    prob = _one_slot().replace(grad_reduce=(5.0, 0.0))
    assert iteration_lower_bound(prob) == pytest.approx(29.0)
    assert brute_force(prob)[0] == pytest.approx(29.0)


def _nested_v(m: int, latency: float = 2.0) -> Problem:
    """Two devices in a V (device 1 holds stages 1 and 2), F = B = 1 s per stage, fused
    backward, 0.5 activation per stage, room on device 1 for one micro-batch's two."""
    lat, bw = chain_links(2, [latency], [math.inf])
    return uniform_problem(2, m, 2.0, 2.0, 0.0, split_backward=False, virtual_stages=2,
                           placement="vshape").replace(latency=lat, bandwidth=bw,
                                                       memory_limit=(None, 1.0))


def test_nested_stages_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    # From F(2, j)'s start to B(2, j)'s end micro-batch j holds stages 1 and 2 on device 1, a
    # whole 1.0: one at a time. Stage 2 is first reached at F0 + 2 + F1 = 4 s; its round trip
    # is F2 + 2 + F3 + B3 + 2 = 7 s, so F(2, 1) starts 7 + B2 = 8 s after F(2, 0); then the
    # round trip, B2, B1, 2 s back and B0: 12 s. 4 + 8 + 12 = 24 s. After B(2, 0) ends,
    # micro-batch 0 still holds stage 1's 0.5 until B(1, 0) ends, B1 = 1 s later (the
    # tail part, bounds._nested_tail): F(2, 1) starts 7 + B2 + B1 = 9 s after F(2, 0), 25 s.
    # Counting stage 2's own 0.5 alone, two fit and memory bounds nothing (17 s: device 1's
    # arrival at 3 s, 8 s of work and 6 s of warm-up idle, test_nested_warmup_idle_by_hand).
    prob = _nested_v(2)
    assert memory_bound(prob) == pytest.approx((0.0, 25.0))
    assert makespan_lower_bound(prob) == pytest.approx(25.0)
    with monkeypatch.context() as mp:
        mp.setattr(bounds, "_nested_tail", lambda *a: None)
        assert memory_bound(prob) == pytest.approx((0.0, 24.0))
        mp.setattr(bounds, "_nested_activation", lambda p, d, k: p.activation_memory[k])
        assert makespan_lower_bound(prob) == pytest.approx(17.0)
    # Each stage's own activation alone (what the relaxation bound's model keeps): nothing.
    assert bounds.stage_memory_bound(prob) == (0.0, 0.0)
    assert bounds.stage_memory_bound(_xdc(8, 24)) == memory_bound(_xdc(8, 24))  # one a device
    # The optimum is 26 s: F(1, 1) (1 s) must also wait for B(1, 0)'s end.
    best, _ = brute_force(prob)
    assert best == pytest.approx(26.0)
    # Without latency and with 4 s of it, by brute force: 14 and 38 s; bound 13 and 37 s.
    for latency, optimum in ((0.0, 14.0), (4.0, 38.0)):
        prob = _nested_v(2, latency)
        assert max(memory_bound(prob)) == pytest.approx(optimum - 1)
        assert brute_force(prob)[0] == pytest.approx(optimum)


def test_nested_warmup_idle_by_hand() -> None:
    # Device 1 (stages 1, 2): its first B is B(2, j), at least F1 + round_trip(2) = 1 + 7 =
    # 8 s after its first F; meanwhile the F's it runs all hold memory: 1.0 / 0.5 = two F's
    # of 1 s, so 6 s idle. Device 0 (stages 0, 3, no limit): its first B, B(3, j), comes
    # F0 + 2 + F1 + F2 + 2 + F3 = 8 s after F(0, j); it can run at most the 2 F's of each
    # of its stages, 4 s: 4 s idle.
    assert bounds.warmup_idle(_nested_v(2)) == pytest.approx((4.0, 6.0))
    # Micro-batches of different cost: not counted (0).
    assert bounds.warmup_idle(_nested_v(2).replace(microbatch_scale=(1.0, 2.0))) == (0.0, 0.0)


def test_nested_bound_below_proven_optima(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random V's (and loops) of two devices (split or fused backward, slow middle link, room
    for about one or two micro-batches' activations on a device): the memory bound with the device's
    earlier stages counted (and held after the later stage's B, ``_nested_tail``: 13 of the 20
    are stronger with it) and the warm-up bound with a device's several stages never exceed
    CP-SAT's proven optimum, and each is stronger than without on some of them."""
    rng = random.Random(7)
    checked = stronger = warmer = tailed = 0
    for _ in range(20):
        m = rng.choice([2, 3])
        t = [0.5, 1.0, 1.5]
        lat, bw = chain_links(2, [rng.choice([1.0, 3.0, 6.0])], [math.inf])
        act = [rng.choice([0.5, 1.0]) for _ in range(4)]
        placement = rng.choice(["vshape", "vshape", "loop"])
        on = [(0, 3), (1, 2)] if placement == "vshape" else [(0, 2), (1, 3)]
        need = [act[a] + act[b] for a, b in on]
        prob = Problem(devices=2, microbatches=m, virtual_stages=2, placement=placement,
                       split_backward=rng.random() < 0.5,
                       forward=[rng.choice(t) for _ in range(4)],
                       backward_input=[rng.choice(t) for _ in range(4)],
                       backward_weight=[rng.choice(t) for _ in range(4)],
                       activation_memory=act, weight_grad_memory=[a / 2 for a in act],
                       latency=lat, bandwidth=bw,
                       memory_limit=[x * rng.choice([1.0, 1.0, 1.5, 2.0]) for x in need])
        best = _proven_optimum(prob, "makespan", monkeypatch)
        if best is None:
            continue
        checked += 1
        assert max(memory_bound(prob)) <= best * (1 + 1e-9), prob
        assert makespan_lower_bound(prob) <= best * (1 + 1e-9), prob
        assert max(warmup_bound(prob)) <= best * (1 + 1e-9), prob
        with monkeypatch.context() as mp:
            mp.setattr(bounds, "_nested_activation", lambda p, d, k: p.activation_memory[k])
            mp.setattr(bounds, "_nested_warmup_idle", lambda *a: 0.0)
            alone = max(memory_bound(prob))
            idle_alone = max(warmup_bound(prob))
        with monkeypatch.context() as mp:
            mp.setattr(bounds, "_nested_tail", lambda *a: None)
            untailed = max(memory_bound(prob))
        stronger += max(memory_bound(prob)) > alone * (1 + 1e-9)
        warmer += max(warmup_bound(prob)) > idle_alone * (1 + 1e-9)
        tailed += max(memory_bound(prob)) > untailed * (1 + 1e-9)
    assert checked >= 15 and stronger >= 3 and warmer >= 3 and tailed >= 8, (checked, tailed)
