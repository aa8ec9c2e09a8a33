"""Sampled op durations through the one simulator (pipeopt.costs.variation): a join of two
noisy paths costs E[max] > max(E), a chain adds up to its mean; the spread's document."""

import itertools
import statistics

import pytest

from pipeopt.costs.variation import OpSpread, sampled_iteration_times, sampled_step
from pipeopt.problem import Op, Problem
from pipeopt.simulate import ScheduleError, simulate

D = 0.5  # half-width of the two-point residuals (seconds)


def _two_stages(split: bool = True) -> tuple[Problem, list[list[Op]]]:
    """2 devices, 1 micro-batch, split backward: F0 -> F1 -> B1, then two paths that join at
    the step's end: B0 -> W0 on device 0 (1 + 1 s) and W1 on device 1 (2 s). Every
    deterministic path is 5 s long."""
    prob = Problem(devices=2, microbatches=1, forward=(1.0, 1.0), backward_input=(1.0, 1.0),
                   backward_weight=(1.0, 2.0), split_backward=split)
    orders = [[Op("F", 0, 0), Op("B", 0, 0)] + ([Op("W", 0, 0)] if split else []),
              [Op("F", 1, 0), Op("B", 1, 0)] + ([Op("W", 1, 0)] if split else [])]
    return prob, orders


def test_a_join_of_two_noisy_paths_costs_the_expected_maximum():
    """B0 and W1 each +-D with probability 1/2, independently: the step is 5 + max(X, Y),
    whose mean is 5 + D/2 (enumerated below: max is +D in 3 of 4 cases), above the 5 s that
    the mean durations (max of the means) give."""
    prob, orders = _two_stages()
    assert simulate(prob, orders).iteration_time == pytest.approx(5.0)
    exact = statistics.fmean(5.0 + max(x, y) for x, y in itertools.product((-D, D), repeat=2))
    assert exact == pytest.approx(5.0 + D / 2)
    spread = OpSpread((("B0", (-D, D)), ("W1", (-D, D))))
    times = sampled_iteration_times(prob, orders, spread, samples=4000, seed=1)
    assert set(times) == {5.0 - D, 5.0 + D}
    # Standard error of the mean of 4000 draws: sqrt(3)/2 D / sqrt(4000) = 0.014 D.
    assert statistics.fmean(times) == pytest.approx(exact, abs=0.06 * D)
    assert sampled_step(prob, orders, spread, samples=4000, seed=1,
                        statistic="mean") == statistics.fmean(times)
    assert sampled_step(prob, orders, spread, samples=401, seed=1) == 5.0 + D  # the median


def test_a_chain_adds_up_to_its_mean():
    """Noise only on F0 and F1, which every path runs through: each draw is 5 + r0 + r1, so
    the median is the deterministic 5 s exactly (r0 + r1 is 0 with probability 1/2, -2D and
    +2D with 1/4 each) and the mean 5 s. With a skewed residual (0, 0, 0.9: mean 0.3) on
    every op of a one-device chain, the step grows by the summed means, 3 x 0.3 s."""
    prob, orders = _two_stages()
    spread = OpSpread({"F0": (-D, D), "F1": (-D, D)})
    times = sampled_iteration_times(prob, orders, spread, samples=2000, seed=3)
    assert set(times) == {5.0 - 2 * D, 5.0, 5.0 + 2 * D}
    assert statistics.median(times) == 5.0
    assert statistics.fmean(times) == pytest.approx(5.0, abs=0.06)
    one = Problem(devices=1, microbatches=1, forward=(1.0,), backward_input=(1.0,),
                  backward_weight=(1.0,))
    chain = [[Op("F", 0, 0), Op("B", 0, 0), Op("W", 0, 0)]]
    skew = (0.0, 0.0, 0.9)
    times = sampled_iteration_times(one, chain, OpSpread({"F0": skew, "B0": skew, "W0": skew}),
                                    samples=4000, seed=0)
    # Standard error: sqrt(3 x 0.18) / sqrt(4000) = 0.012 s.
    assert statistics.fmean(times) == pytest.approx(3.0 + 3 * 0.3, abs=0.05)


def test_no_spread_is_the_simulator_and_tails_and_gaps_count():
    """An empty spread draws the simulator's own iteration time (its step tails included);
    a gap residual adds to every op; a fused problem draws its B from "B{k} fused", never
    from the split B; durations never go below 0."""
    prob, orders = _two_stages()
    prob = prob.replace(grad_reduce=(0.5, 2.0))  # stage 1's tail ends after the makespan
    want = simulate(prob, orders).iteration_time
    assert want == pytest.approx(7.0)
    assert sampled_iteration_times(prob, orders, OpSpread(), samples=3) == (want,) * 3
    # +0.1 s before each of the 4 ops on the path F0 F1 B1 W1, then the tail.
    assert sampled_iteration_times(prob, orders, OpSpread(gap=(0.1,)), samples=2) == (
        pytest.approx(7.4),) * 2
    fused, forders = _two_stages(split=False)
    assert sampled_iteration_times(fused, forders, OpSpread({"B1": (1.0,)}), samples=2) == (
        simulate(fused, forders).iteration_time,) * 2
    assert sampled_iteration_times(fused, forders, OpSpread({"B1 fused": (1.0,)}),
                                   samples=2) == (simulate(fused, forders).iteration_time + 1,) * 2
    # F0 drawn at -5 s lasts 0 s, not -4 s.
    assert sampled_iteration_times(prob, orders, OpSpread({"F0": (-5.0,)}), samples=1) == (
        pytest.approx(6.0),)


def test_draws_are_reproducible_and_arguments_checked():
    prob, orders = _two_stages()
    spread = OpSpread({"B0": (-D, 0.0, D), "W1": (-D, D)})
    a = sampled_iteration_times(prob, orders, spread, samples=50, seed=7)
    assert a == sampled_iteration_times(prob, orders, spread, samples=50, seed=7)
    assert a != sampled_iteration_times(prob, orders, spread, samples=50, seed=8)
    with pytest.raises(ValueError, match="samples: must be an integer >= 1, got 0"):
        sampled_iteration_times(prob, orders, spread, samples=0)
    with pytest.raises(ValueError, match="statistic: must be one of median, mean"):
        sampled_step(prob, orders, spread, statistic="max")
    with pytest.raises(ScheduleError, match="appears twice"):
        sampled_iteration_times(prob, [orders[0] * 2, orders[1]], spread)


def test_spread_document_round_trip_and_errors():
    """Residuals kept as mid-quantiles (all of them when few), written and read back; a bad
    document names the field."""
    spread = OpSpread.from_residuals({"F0": [float(i) for i in range(101)], "W1": [2.0, -1.0]},
                                     gap=[0.5], quantiles=4)
    assert spread.residuals("F0") == pytest.approx((12.5, 37.5, 62.5, 87.5))
    assert spread.residuals("W1") == (-1.0, 2.0) and spread.residuals("B0") == ()
    assert OpSpread.from_dict(spread.to_dict()) == spread
    with pytest.raises(ValueError, match=r"op_spread.ops\['F0'\]\[1\]: must be a finite number"):
        OpSpread.from_dict({"ops": {"F0": [0.0, "x"]}})
    with pytest.raises(ValueError, match="op_spread: unknown field\\(s\\) \\['gaps'\\]"):
        OpSpread.from_dict({"gaps": []})
    with pytest.raises(ValueError, match=r"op_spread\.gap\[0\]: must be a finite number"):
        OpSpread.from_dict({"gap": [float("nan")]})
    with pytest.raises(ValueError, match="quantiles: must be >= 1"):
        OpSpread.from_residuals({}, quantiles=0)
    # A misspelt key would draw nothing: refused, as a key given twice.
    assert OpSpread.from_dict({"ops": {"B12 fused": [1.0], "W0": [0.0]}}).residuals(
        "B12 fused") == (1.0,)
    for bad in ("B1fused", "F", "f0", "F01", "X1", "B1 Fused"):
        with pytest.raises(ValueError, match=rf"ops: keys must be .*got '{bad}'"):
            OpSpread.from_dict({"ops": {bad: [0.0]}})
    with pytest.raises(ValueError, match="ops: key 'F0' given twice"):
        OpSpread((("F0", (1.0,)), ("F0", (2.0,))))


def test_a_message_drawn_at_a_join():
    """Links of 1 s; W1 is 3 s, so both paths after B1 (the gradient message to device 0,
    B0, W0; W1 on device 1) take 3 s: the step is 7 s. A message residual of +-D on each of
    the two messages: the forward one lies on every path (it adds its mean, 0), the backward
    one races W1 at the join, so the mean step is 7 + E[max(r, 0)] = 7 + D/2."""
    from pipeopt.problem import chain_links

    prob, orders = _two_stages()
    lat, bw = chain_links(2, [1.0], [float("inf")])
    prob = prob.replace(latency=lat, bandwidth=bw, backward_weight=(1.0, 3.0))
    assert simulate(prob, orders).iteration_time == pytest.approx(7.0)
    times = sampled_iteration_times(prob, orders, OpSpread(message=(-D, D)), samples=4000,
                                    seed=5)
    assert {round(t, 9) for t in times} == {7.0 - D, 7.0, 7.0 + D, 7.0 + 2 * D}
    assert statistics.fmean(times) == pytest.approx(7.0 + D / 2, abs=0.06 * D)


def test_with_durations_checks_and_keeps_the_graph():
    from pipeopt.core.graph import GraphError
    from pipeopt.workloads.training import graph_of

    prob, _ = _two_stages()
    graph = graph_of(prob)
    lat = [0.5 if k >= 0 else 0.0 for k in graph.edge_link]
    assert 0 < lat.count(0.5) < graph.num_edges  # edges between devices and within one
    other = graph.with_durations([2.0] * graph.num_tasks, lat)
    assert other.duration == (2.0,) * graph.num_tasks and other.src == graph.src
    assert other.edge_latency == tuple(lat)
    inside = graph.edge_link.index(-1)
    with pytest.raises(GraphError, match=rf"edges\.latency\[{inside}\]: 0.5 on an edge within"):
        graph.with_durations(graph.duration, [0.5] * graph.num_edges)
    assert graph.duration != other.duration  # the original is left as it was
    with pytest.raises(GraphError, match=r"tasks\.duration\[0\]: must be >= 0"):
        graph.with_durations([-1.0] + [1.0] * (graph.num_tasks - 1))
    with pytest.raises(GraphError, match=r"edges\.latency: expected"):
        graph.with_durations(graph.duration, [0.0])


def test_a_shared_factor_scales_a_device_as_one():
    """Noise that is all shared per step and rank: each device draws one factor c (1 -+ D/5
    with probability 1/2) for all its ops. On one device's chain the step is c x 5 s in
    every draw; in the two-device join the step is c0 F0 + c1 (F1 + B1) + max(c0 (B0 + W0),
    c1 W1), enumerated over the four (c0, c1): 5 - 5e, 5 + 5e, 5 + 3e (c0 low, c1 high) and
    5 + e (e = D/5), mean 5 + e: the two devices race, each as a whole."""
    e = D / 5
    lo, hi = 1 - e, 1 + e
    one = Problem(devices=1, microbatches=1, forward=(1.0,), backward_input=(2.0,),
                  backward_weight=(2.0,))
    chain = [[Op("F", 0, 0), Op("B", 0, 0), Op("W", 0, 0)]]
    assert {round(t, 9) for t in sampled_iteration_times(one, chain, OpSpread(shared=(lo, hi)),
                                                         samples=200)} == {5 * lo, 5 * hi}
    prob, orders = _two_stages()
    times = sampled_iteration_times(prob, orders, OpSpread(shared=(lo, hi)), samples=4000,
                                    seed=2)
    cases = {(c0, c1): c0 * 1 + c1 * 2 + max(c0 * 2, c1 * 2) for c0 in (lo, hi) for c1 in (lo, hi)}
    assert sorted(cases.values()) == pytest.approx([5 - 5 * e, 5 + e, 5 + 3 * e, 5 + 5 * e])
    assert {round(t, 9) for t in times} == {round(t, 9) for t in cases.values()}
    # Standard error of the mean: below sqrt(E[(x - 5 - e)^2] = 10 e^2) / sqrt(4000) = 0.05 e.
    assert statistics.fmean(times) == pytest.approx(5 + e, abs=0.2 * e)


def test_a_stall_shared_by_a_step_is_drawn_whole():
    """What the shared part fixes: a stall that triples every op of a step on one rank, one
    step in 8. Drawn per device, both devices run at 1 in 49/64 of the draws, so the median
    step is the priced 5 s. The same times split into per-op residuals (each op tripled in
    1 of 8 draws, independently) stall some op of the step's 6 in 1 - (7/8)^6 = 55 % of the
    draws: the median step is then above 5 s, a join cost the runs did not have."""
    prob, orders = _two_stages()
    shared = OpSpread(shared=(1.0,) * 7 + (3.0,))
    times = sampled_iteration_times(prob, orders, shared, samples=1001, seed=4)
    assert statistics.median(times) == 5.0
    assert sum(t == 5.0 for t in times) / len(times) == pytest.approx(49 / 64, abs=0.05)
    per_op = OpSpread({key: (0.0,) * 7 + (2 * t,)
                       for key, t in (("F0", 1.0), ("F1", 1.0), ("B0", 1.0), ("B1", 1.0),
                                      ("W0", 1.0), ("W1", 2.0))})
    times = sampled_iteration_times(prob, orders, per_op, samples=1001, seed=4)
    assert sum(t == 5.0 for t in times) / len(times) == pytest.approx((7 / 8) ** 6, abs=0.05)
    assert statistics.median(times) > 5.0


def _linked(w1: float = 3.0) -> tuple[Problem, list[list[Op]]]:
    """:func:`_two_stages` with 1 s links and W1 of ``w1`` s: F1 and B0 wait for a message,
    the other ops for the op before them on their device."""
    from pipeopt.problem import chain_links

    prob, orders = _two_stages()
    lat, bw = chain_links(2, [1.0], [float("inf")])
    return prob.replace(latency=lat, bandwidth=bw, backward_weight=(1.0, w1)), orders


def test_an_op_held_up_by_a_message_waits_the_delay_not_the_delay_and_a_gap():
    """A message's delay is measured up to its receiver's start, so it holds the receiver's
    gap. Gap residual 0.2 s, message residual 0.3 s: F0, B1, W1 and W0 each pay their gap
    (+0.2 s), F1 and B0 start 1 + 0.3 s after their message's producer ends, not 1.5 s.
    Path by hand: F0 0-1.2, F1 2.5-3.5, B1 3.5-4.7, B0 6.0-7.0, W0 7.0-8.2 (W1 4.7-7.9):
    8.2 s, where a gap drawn on top of the delay gave 8.6 s."""
    prob, orders = _linked()
    assert simulate(prob, orders).iteration_time == pytest.approx(7.0)
    got = sampled_iteration_times(prob, orders, OpSpread(gap=(0.2,), message=(0.3,)),
                                  samples=3)
    assert got == (pytest.approx(8.2),) * 3
    # A message faster than the receiver's gap: the receiver still pays its gap after the
    # producer's end (latency 1 - 1.2 - 0.5 < 0, kept at 0). Ops with their 0.5 s gap:
    # F0 0-1.5, F1 1.5-3.0, B1 3.0-4.5, W1 4.5-8.0, B0 4.5-6.0, W0 6.0-7.5: 8.0 s.
    got = sampled_iteration_times(prob, orders, OpSpread(gap=(0.5,), message=(-1.2,)),
                                  samples=2)
    assert got == (pytest.approx(8.0),) * 2


def test_an_ops_gap_and_its_message_are_drawn_at_one_quantile():
    """Gap residuals (0, 0.4), message residuals (0.1, 0.5): a message-bound op waits 1.1 or
    1.5 s, never 1.5 + 0.4 s. The slowest draw (every quantile high): F0 1.4, F1 after 1.5
    then 1, B1 1.4, B0 after 1.5 then 1, W0 1.4: 9.2 s (W1 3.4 ends at 8.7), where
    independent draws of the gap and the delay reached 10.0 s."""
    prob, orders = _linked()
    times = sampled_iteration_times(prob, orders, OpSpread(gap=(0.0, 0.4), message=(0.1, 0.5)),
                                    samples=2000, seed=6)
    assert max(times) == pytest.approx(9.2)  # 1 in 64 draws: all slow
    low = 1.0 + 1.1 + 1.0 + 1.0 + 1.1 + 1.0 + 1.0  # every quantile low: 7.2 s
    assert min(times) == pytest.approx(low)


def test_the_factor_scales_compute_and_gap_not_the_message():
    """A problem priced with a runtime gap of 0.1 s per op (``with_overheads``) and a shared
    factor of 2: every op pays 2 x (compute + gap), a message-bound op starts its compute
    the priced delay after its message's producer (1 s link + 0.1 s gap), unscaled. On one
    device: 2 x 3.3 s. On two: F0 2.2, then F1's compute 1.1 s after it (2 s), B1 2.2, W1
    2 x 3.1: 13.7 s."""
    from pipeopt.costs.build import with_overheads
    from pipeopt.costs.profile import Overheads

    one = with_overheads(Problem(devices=1, microbatches=1, forward=(1.0,),
                                 backward_input=(1.0,), backward_weight=(1.0,)),
                         Overheads(action_s=0.1), [0.0])
    chain = [[Op("F", 0, 0), Op("B", 0, 0), Op("W", 0, 0)]]
    assert simulate(one, chain).iteration_time == pytest.approx(3.3)
    assert sampled_iteration_times(one, chain, OpSpread(shared=(2.0,)), samples=2) == (
        pytest.approx(6.6),) * 2
    prob, orders = _linked()
    prob = with_overheads(prob, Overheads(action_s=0.1), [0.0, 0.0])
    assert sampled_iteration_times(prob, orders, OpSpread(shared=(2.0,)), samples=2) == (
        pytest.approx(2.2 + 1.1 + 2.0 + 2.2 + 6.2),) * 2


def test_a_spread_without_shared_factors_loads_and_means_none():
    """A document written before the shared part was recorded has no ``shared``: it loads,
    draws factor 1 (the old pooled residuals, all variation per op) and is written back with
    an empty list; factors must be finite and > 0."""
    old = {"ops": {"B0": [-D, D], "W1": [-D, D]}, "gap": [], "message": []}
    spread = OpSpread.from_dict(old)
    assert spread.shared == () and spread.to_dict() == {**old, "shared": [], "joint": []}
    assert OpSpread.from_dict(spread.to_dict()) == spread
    prob, orders = _two_stages()
    times = sampled_iteration_times(prob, orders, spread, samples=4000, seed=1)
    assert statistics.fmean(times) == pytest.approx(5.0 + D / 2, abs=0.06 * D)
    with_shared = OpSpread.from_residuals({"F0": [0.0]}, shared=[1.1, 0.9, 1.0], quantiles=2)
    assert with_shared.shared == pytest.approx((0.95, 1.05))  # mid-quantiles at 0.5, 1.5
    assert OpSpread.from_dict(with_shared.to_dict()) == with_shared
    with pytest.raises(ValueError, match=r"op_spread\.shared\[1\]: must be > 0 \(a factor"):
        OpSpread.from_dict({"shared": [1.0, 0.0]})
    with pytest.raises(ValueError, match=r"op_spread\.shared\[0\]: must be a finite number"):
        OpSpread.from_dict({"shared": [float("inf")]})
    with pytest.raises(ValueError, match=r"shared\[0\]: must be > 0"):
        OpSpread(shared=(-1.0,))


def test_joint_steps_draw_the_ranks_of_one_step_together():
    """Factors recorded per measured step, every rank's together: two steps, one where both
    ranks ran at 1 - e and one where both ran at 1 + e. Drawn together, each draw scales
    the whole two-device step alike, 5 (1 -+ e): none of the mixed races that independent
    draws from the same four factors give (5 + e and 5 + 3e, test above). Steps with another
    number of ranks than the problem's devices fall back to the independent draws."""
    e = D / 5
    lo, hi = 1 - e, 1 + e
    prob, orders = _two_stages()
    together = OpSpread(shared=(lo, lo, hi, hi), joint=((lo, lo), (hi, hi)))
    times = sampled_iteration_times(prob, orders, together, samples=400, seed=2)
    assert {round(t, 9) for t in times} == {round(5 * lo, 9), round(5 * hi, 9)}
    apart = OpSpread(shared=(lo, lo, hi, hi), joint=((lo, lo, lo), (hi, hi, hi)))
    times = sampled_iteration_times(prob, orders, apart, samples=400, seed=2)
    assert {round(t, 9) for t in times} == {round(5 + x * e, 9) for x in (-5, 1, 3, 5)}


def test_joint_steps_document_and_errors():
    """``joint`` round-trips, a document without it loads with none, at most JOINT_STEPS
    steps are kept (evenly spaced by their mean factor), and a ragged or non-positive step
    names the field."""
    from pipeopt.costs.variation import JOINT_STEPS

    spread = OpSpread.from_residuals({}, shared=[1.0, 2.0], joint=[(2.0, 1.5), (1.0, 0.5)])
    assert spread.joint == ((1.0, 0.5), (2.0, 1.5))  # by mean factor
    assert OpSpread.from_dict(spread.to_dict()) == spread
    assert OpSpread.from_dict({"shared": [1.0]}).joint == ()
    many = OpSpread.from_residuals({}, joint=[(1.0 + i / 1000, 1.0) for i in range(1000)])
    assert len(many.joint) == JOINT_STEPS
    firsts = [v[0] for v in many.joint]
    assert firsts == sorted(firsts) and firsts[0] < 1.02 and firsts[-1] > 1.98
    with pytest.raises(ValueError, match=r"op_spread\.joint\[1\]: every step needs one factor "
                       r"per rank, as many as step 0's \(2\), got 1"):
        OpSpread.from_dict({"joint": [[1.0, 1.0], [1.0]]})
    with pytest.raises(ValueError, match=r"op_spread\.joint\[0\]\[1\]: must be > 0"):
        OpSpread.from_dict({"joint": [[1.0, 0.0]]})
    with pytest.raises(ValueError, match=r"op_spread\.joint\[0\]: a step needs a factor per "
                       "rank, got none"):
        OpSpread.from_dict({"joint": [[]]})
    with pytest.raises(ValueError, match=r"op_spread\.joint: must be a list of lists"):
        OpSpread.from_dict({"joint": 3})
