"""Hand-made schedules against their published analytic makespans and peak memories."""

import itertools

import pytest

from pipeopt.problem import uniform_problem
from pipeopt.simulate import validate
from pipeopt.solvers import run_classic

TIMES = [(1.0, 1.0, 1.0), (1.0, 1.2, 0.8), (1.0, 1.5, 0.5), (2.0, 3.0, 1.0)]
GRID = list(itertools.product([2, 3, 4, 8], [1, 2, 3, 4, 8, 16, 24], TIMES))


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("p,m,t", GRID)
def test_gpipe_and_1f1b(p, m, t):
    f, b, w = t
    prob = uniform_problem(p, m, f, b, w, weight_grad=0.5)
    for name in ("gpipe", "1f1b"):
        s = validate(run_classic(prob, name))
        # (m + p - 1)(F + B + W): the backward is one op, as published.
        assert s.makespan == approx((m + p - 1) * (f + b + w))
    assert max(run_classic(prob, "gpipe").peak_memory) == approx(m)
    assert run_classic(prob, "1f1b").peak_memory == approx(
        tuple(float(min(p - r, m)) for r in range(p)))


@pytest.mark.parametrize("p,m,t", [g for g in GRID if g[1] >= g[0]])
def test_zb_h1(p, m, t):
    f, b, w = t
    s = validate(run_classic(uniform_problem(p, m, f, b, w, weight_grad=0.5), "zb-h1"))
    # Qi et al. 2024: m(F+B+W) + (p-1)(F+B-W) when W <= B.
    assert s.makespan == approx(m * (f + b + w) + (p - 1) * (f + b - w))
    # Stage r holds (p - r) activations until B and r weight-gradient halves until W.
    assert s.peak_memory == approx(tuple((p - r) * 1.0 + r * 0.5 for r in range(p)))


@pytest.mark.parametrize("p,m,t", [g for g in GRID if g[1] >= 2 * g[0] - 1])
def test_zb_h2(p, m, t):
    f, b, w = t
    s = validate(run_classic(uniform_problem(p, m, f, b, w, weight_grad=0.5), "zb-h2"))
    assert s.max_span == approx(m * (f + b + w) + max(0.0, (p - 1) * (f + b - 2 * w)))
    assert max(s.peak_memory) == approx(2 * p - 1)


@pytest.mark.parametrize("p,m,v,t", [
    (p, m, v, t) for p, v, m, t in itertools.product([2, 4, 8], [2, 3, 4], [8, 16, 24], TIMES)
    if m % p == 0])
def test_interleaved(p, m, v, t):
    f, b, w = t
    prob = uniform_problem(p, m, f, b, w, virtual_stages=v)
    s = validate(run_classic(prob, "interleaved-1f1b"))
    # Narayanan et al. SC'21: the bubble shrinks by the number of chunks.
    assert s.makespan == approx(m * (f + b + w) + (p - 1) * (f + b + w) / v)
    # Device 0 holds p + (p - 1)/v micro-batches' worth of activations (notes/schedules.md);
    # device r runs Megatron-LM's warm-up of 2(p - r - 1) + (v - 1)p chunk forwards, then one
    # more before its first backward: (2(p - r - 1) + (v - 1)p + 1) / v = p + (p - 1 - 2r)/v.
    assert s.peak_memory[0] == approx(min(p + (p - 1) / v, m))
    assert s.peak_memory == approx(tuple(min(p + (p - 1 - 2 * r) / v, m) for r in range(p)))


@pytest.mark.parametrize("p,m,v,t", [
    (p, m, v, t) for p, v, m, t in itertools.product([2, 3, 4, 8], [2, 3, 4], [4, 8, 9, 16],
                                                     TIMES) if m >= p])
def test_looped_bfs(p, m, v, t):
    f, b, w = t
    s = validate(run_classic(uniform_problem(p, m, f, b, w, virtual_stages=v), "looped-bfs"))
    # Lamy-Poirier 2023 (breadth-first pipeline parallelism): the bubble of interleaving,
    # (p - 1)(F + B + W)/v, with every micro-batch of a chunk in flight: peak m per device.
    assert s.makespan == approx(m * (f + b + w) + (p - 1) * (f + b + w) / v)
    assert s.peak_memory == approx((float(m),) * p)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12), (8, 16), (8, 24)])
def test_zb_v_equal_times(p, m):
    prob = uniform_problem(p, m, 2.0, 2.0, 2.0, virtual_stages=2, placement="vshape")
    s = validate(run_classic(prob, "zb-v"))
    assert s.max_span == approx(m * 6.0)  # zero bubble in span
    assert s.makespan == approx(m * 6.0 + (p - 1) * 2.0 / 2)  # (p - 1) T_F / 2 start skew
    assert s.peak_memory == approx((float(p),) * p)  # p activations, balanced


def test_reference_figures_from_the_founders():
    """F=B=W=200, p=4, m=8 (shared/README.md)."""
    ref = {("1f1b", 1, "loop"): 6600, ("gpipe", 1, "loop"): 6600,
           ("interleaved-1f1b", 2, "loop"): 5700, ("zb-h1", 1, "loop"): 5400,
           ("zb-v", 2, "vshape"): 5100}
    for (name, v, placement), want in ref.items():
        prob = uniform_problem(4, 8, 200, 200, 200, virtual_stages=v, placement=placement)
        assert run_classic(prob, name).makespan == want, name
    zbv = run_classic(uniform_problem(4, 8, 200, 200, 200, virtual_stages=2,
                                      placement="vshape"), "zb-v")
    assert zbv.max_span == 4800


@pytest.mark.parametrize("t,bubbles,span_bubbles", [
    ((1, 1, 1), {"gpipe": 21, "1f1b": 21, "zb-h1": 7, "i2": 10.5, "i4": 5.25}, (0, 0, 3.5)),
    ((1, 1.2, 0.8), {"gpipe": 21, "1f1b": 21, "zb-h1": 9.8, "i2": 10.5, "i4": 5.25},
     (4.2, 2.8, 4.2)),
    ((1, 1.5, 0.5), {"gpipe": 21, "1f1b": 21, "zb-h1": 14, "i2": 10.5, "i4": 5.25},
     (10.5, 7.0, 7.0)),
])
def test_regression_table_p8_m24(t, bubbles, span_bubbles):
    """notes/schedules.md regression targets (bubble = makespan - m(F+B+W))."""
    p, m = 8, 24
    work = m * sum(t)

    def run(name, v=1, placement="loop"):
        prob = uniform_problem(p, m, *t, virtual_stages=v, placement=placement, weight_grad=0.5)
        return validate(run_classic(prob, name))

    assert run("gpipe").makespan - work == approx(bubbles["gpipe"])
    assert run("1f1b").makespan - work == approx(bubbles["1f1b"])
    assert run("zb-h1").makespan - work == approx(bubbles["zb-h1"])
    assert run("interleaved-1f1b", 2).makespan - work == approx(bubbles["i2"])
    assert run("interleaved-1f1b", 4).makespan - work == approx(bubbles["i4"])
    h2_span, v_span, v_makespan = span_bubbles
    assert run("zb-h2").max_span - work == approx(h2_span)
    zbv = run("zb-v", 2, "vshape")
    assert zbv.max_span - work == approx(v_span)
    assert zbv.makespan - work == approx(v_makespan)
    peaks = {"gpipe": 24, "1f1b": 8, "zb-h1": 8, "zb-h2": 15}
    for name, want in peaks.items():
        assert max(run(name).peak_memory) == approx(want), name
    assert max(run("interleaved-1f1b", 2).peak_memory) == approx(11.5)
    assert max(run("interleaved-1f1b", 4).peak_memory) == approx(9.75)
    assert max(zbv.peak_memory) == approx(8)


def test_gpipe_bubble_with_latency():
    """notes/schedules.md: c = 0.1 per hop, unit times, p=8, m=24: bubble (p-1)(3+2c)."""
    s = run_classic(uniform_problem(8, 24, 1, 1, 1, latency=0.1), "gpipe")
    assert s.makespan - 24 * 3 == approx(7 * (3 + 0.2))
