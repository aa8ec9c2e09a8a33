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
