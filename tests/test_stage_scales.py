"""Micro-batches whose cost differs by stage: the scales as tables (one row per stage, one per
stage boundary for messages). The problem's accessors and canonical form, hand-timed
schedules, the bounds against exhaustive search, the searches, the training graph and the
schedule file."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeopt.bounds import iteration_lower_bound, lower_bound, makespan_lower_bound
from pipeopt.io import schedule_from_dict, schedule_json
from pipeopt.problem import Op, Problem, ProblemError, chain_links, uniform_problem
from pipeopt.schedule import order_peak_memory
from pipeopt.simulate import check, simulate, validate
from pipeopt.solvers import SolveOptions, fits_memory, memory_floor
from pipeopt.solvers.cpsat import solve_cpsat
from pipeopt.solvers.greedy import solve_greedy
from tests.strategies import problems, random_orders
from tests.test_brute_force import brute_force, tiny_problems
from tests.test_microbatch_scale import _gpipe_orders

TABLE = ((1.0, 2.0), (3.0, 1.0))  # stage 0: micro-batch 1 is 2x; stage 1: micro-batch 0 is 3x


# ----- the problem -------------------------------------------------------------------------

def test_a_table_scales_each_stage_on_its_own() -> None:
    lat, bw = chain_links(3, [0.5, 0.5], [1.0, 1.0])
    prob = uniform_problem(3, 2, 1.0, 2.0, 0.5, activation=4.0, weight_grad=1.0).replace(
        latency=lat, bandwidth=bw, message_size=(1.0, 1.0),
        microbatch_scale=((1, 2), (3, 1), (1, 1)),
        microbatch_memory_scale=((1, 3), (2, 0.5), (1, 1)),
        microbatch_message_scale=((1, 2), (3, 1)))
    assert prob.stage_scales and not prob.uniform_microbatches
    assert prob.duration(Op("F", 0, 1)) == 2.0 and prob.duration(Op("B", 1, 0)) == 6.0
    assert prob.duration(Op("W", 2, 1)) == 0.5
    assert prob.memory_delta(Op("F", 0, 1)) == (12.0, 0.0)
    assert prob.memory_delta(Op("B", 1, 1)) == (0.0, 1.5)  # (4 - 1) x 0.5
    assert prob.memory_delta(Op("W", 1, 0)) == (0.0, 2.0)
    assert prob.transfer(0, 1, 1) == (2.0, 0.5) and prob.transfer(2, 1, 0) == (3.0, 0.5)
    assert prob.transfer(1, 2) == (1.0, 0.5)  # without a micro-batch: a unit one's
    # Device work: 3.5 s per unit micro-batch per stage, times the row's sum.
    assert [prob.device_work(d) for d in range(3)] == [3.5 * 3, 3.5 * 4, 3.5 * 2]
    # Summaries weight stages by their work (all equal here): the column means.
    assert prob.time_scale == pytest.approx((5 / 3, 4 / 3))
    assert prob.memory_scale == pytest.approx((4 / 3, 1.5))
    assert prob.message_scale == pytest.approx((2.0, 1.5))


def test_table_defaults_follow_row_by_row() -> None:
    """Memory defaults to the time table; messages to the memory table's row of the sending
    stage (boundary k -> k+1: stage k)."""
    lat, bw = chain_links(2, [0.0], [1.0])
    prob = uniform_problem(2, 2).replace(latency=lat, bandwidth=bw, message_size=(1.0,),
                                         microbatch_scale=TABLE)
    assert prob.memory_table == TABLE and prob.message_table == (TABLE[0],)
    assert prob.microbatch_memory_scale == () and prob.microbatch_message_scale == ()
    assert prob.memory_delta(Op("F", 1, 0)) == (3.0, 0.0)
    assert prob.transfer(1, 0, 1)[0] == 2.0


def test_canonical_form_of_tables() -> None:
    base = uniform_problem(2, 2)
    assert base.replace(microbatch_scale=((1, 1), (1, 1))) == base
    rows = base.replace(microbatch_scale=((2, 1), (2, 1)))  # equal rows: stored as the row
    assert rows.microbatch_scale == (2.0, 1.0) and not rows.stage_scales
    assert rows == base.replace(microbatch_scale=(2, 1))
    same = base.replace(microbatch_scale=TABLE, microbatch_memory_scale=TABLE)
    assert same.microbatch_memory_scale == () and same == base.replace(microbatch_scale=TABLE)
    # A list beside a table: the list is every row.
    mixed = base.replace(microbatch_scale=TABLE, microbatch_memory_scale=(1, 5))
    assert mixed.memory_table == ((1.0, 5.0), (1.0, 5.0))
    assert mixed.microbatch_memory_scale == (1.0, 5.0)
    again = Problem.from_dict(json.loads(json.dumps(mixed.to_dict())))
    assert again == mixed and again.time_table == TABLE


@pytest.mark.parametrize(("value", "message"), [
    (((1, 2),), r"microbatch_scale: a table needs 2 rows \(one per stage\), got 1"),
    (((1, 2), (1, 2, 3)), r"microbatch_scale\[1\]: expected 2 values, got 3"),
    (((1, 2), (1, 0)), r"microbatch_scale\[1\]\[1\]: must be > 0, got 0"),
    (((1, 2), 3), r"microbatch_scale\[1\]: a table's rows must all be lists"),
    (((1, math.nan), (1, 1)), r"microbatch_scale\[0\]\[1\]: must be a finite number"),
])
def test_bad_tables_are_named(value: object, message: str) -> None:
    with pytest.raises(ProblemError, match=message):
        uniform_problem(2, 2).replace(microbatch_scale=value)


def test_bad_message_table_counts_boundaries() -> None:
    with pytest.raises(ProblemError, match=r"a table needs 1 rows \(one per stage boundary\)"):
        uniform_problem(2, 2).replace(microbatch_message_scale=TABLE)


def test_permute_microbatches_permutes_columns() -> None:
    prob = uniform_problem(2, 3).replace(microbatch_scale=((1, 2, 3), (4, 5, 6)),
                                         microbatch_memory_scale=(7, 8, 9))
    perm = prob.permute_microbatches([2, 0, 1])
    assert perm.time_table == ((3.0, 1.0, 2.0), (6.0, 4.0, 5.0))
    assert perm.memory_scale == (9.0, 7.0, 8.0)
    assert perm.permute_microbatches([1, 2, 0]) == prob


def test_interchangeable_only_with_equal_columns() -> None:
    prob = uniform_problem(2, 3).replace(microbatch_scale=((1, 1, 1), (2, 2, 3)))
    assert prob.distinct_microbatches == (0, 2)


# ----- simulator and validator: hand timings ---------------------------------------------

def test_gpipe_by_hand_with_a_table() -> None:
    """p=2, m=2, F = B = W = 1 s, time table [[1, 2], [3, 1]]. Device 0: F0 [0,1], F1 [1,3];
    device 1: F0 [1,4], F1 [4,5], B0 [5,8], W0 [8,11], B1 [11,12], W1 [12,13]; device 0: B0
    [8,9], W0 [9,10], B1 [12,14], W1 [14,16]. Memory table [[1, 3], [2, 0.5]], activation 1:
    device 0 holds 1 + 3, device 1 2 + 0.5."""
    prob = uniform_problem(2, 2).replace(microbatch_scale=TABLE,
                                         microbatch_memory_scale=((1, 3), (2, 0.5)))
    sched = validate(simulate(prob, _gpipe_orders(prob, [0, 1])))
    got = {str(o.op): (o.start, o.end) for o in sched.ops}
    assert got["1F0"] == (1.0, 4.0) and got["1W1"] == (12.0, 13.0)
    assert got["0B1"] == (12.0, 14.0) and sched.makespan == 16.0
    assert sched.peak_memory == (4.0, 2.5)
    assert order_peak_memory(prob, sched.device_orders()) == (4.0, 2.5)


def test_validator_checks_durations_per_stage() -> None:
    prob = uniform_problem(2, 2).replace(microbatch_scale=TABLE)
    sched = simulate(prob, _gpipe_orders(prob, [0, 1]))
    # The same orders timed as if stage 1 used stage 0's row: durations are wrong there.
    wrong = simulate(prob.replace(microbatch_scale=TABLE[0]), _gpipe_orders(prob, [0, 1]))
    assert not check(sched)
    assert any(e.startswith("1F0: lasts 1") for e in check(replace(wrong, problem=prob)))


@st.composite
def table_problems(draw, contention: bool = False) -> Problem:
    """Random problems of :mod:`tests.strategies` with a time table and, half the time, a
    memory and a message table of their own."""
    prob = draw(problems(max_devices=3, max_microbatches=5, contention=contention))
    m, s = prob.microbatches, prob.stages
    factor = st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0, 4.0])

    def table(rows: int) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(draw(factor) for _ in range(m)) for _ in range(rows))

    own = draw(st.booleans())
    return prob.replace(microbatch_scale=table(s),
                        microbatch_memory_scale=table(s) if own else (),
                        microbatch_message_scale=table(s - 1) if own and s > 1 else ())


@settings(deadline=None, max_examples=40)
@given(table_problems(contention=True), st.integers(0, 10**6))
def test_simulator_and_validator_agree_with_tables(prob: Problem, seed: int) -> None:
    sched = validate(simulate(prob, random_orders(prob, seed)))
    for o in sched.ops:
        want = prob.duration(o.op)
        assert o.end - o.start == pytest.approx(want, rel=1e-12, abs=1e-12)
        base = prob.durations[o.op.kind][o.op.stage]
        assert want == pytest.approx(base * prob.time_table[o.op.stage][o.op.microbatch])
    assert order_peak_memory(prob, sched.device_orders()) == pytest.approx(sched.peak_memory)


def test_core_graph_times_a_table_problem_as_the_chain() -> None:
    from pipeopt.core.simulate import simulate as core_simulate
    from pipeopt.workloads.training import build, task_orders

    lat, bw = chain_links(3, [0.3, 0.3], [1.0, 1.0])
    prob = uniform_problem(3, 3, 1.0, 1.2, 0.8).replace(
        latency=lat, bandwidth=bw, message_size=(1.0, 2.0),
        microbatch_scale=((1, 2, 0.5), (3, 1, 1), (1, 1, 2)),
        microbatch_message_scale=((1, 2, 1), (2, 1, 0.5)))
    sched = simulate(prob, random_orders(prob, 7))
    graph = build(prob)
    core = core_simulate(graph, task_orders(prob, sched.device_orders()))
    assert core.makespan == pytest.approx(sched.makespan, rel=1e-12)


# ----- bounds: proven on every order (exhaustive search) ---------------------------------

@st.composite
def tiny_table_problems(draw) -> Problem:
    """Two devices (two stages), one to three micro-batches, a time table and sometimes a
    memory table; limits in units of the scaled activations so that they bind."""
    prob = draw(tiny_problems())
    m = prob.microbatches
    factor = st.sampled_from([0.5, 1.0, 2.0, 3.0, 4.0])
    time = tuple(tuple(draw(factor) for _ in range(m)) for _ in range(2))
    mem = (tuple(tuple(draw(factor) for _ in range(m)) for _ in range(2))
           if draw(st.booleans()) else ())
    lim = tuple(None if x is None else x * draw(st.sampled_from([0.75, 1.0, 2.0]))
                for x in prob.memory_limit)
    return prob.replace(microbatch_scale=time, microbatch_memory_scale=mem, memory_limit=lim)


@settings(max_examples=60, deadline=None)
@given(tiny_table_problems())
def test_bounds_hold_with_tables(problem: Problem) -> None:
    best, _ = brute_force(problem)
    if not math.isfinite(best):
        return  # no order fits memory
    assert makespan_lower_bound(problem) <= best * (1 + 1e-9)
    assert iteration_lower_bound(problem) <= best * (1 + 1e-9)
    assert lower_bound(problem, "span") <= best * (1 + 1e-9)


@settings(max_examples=60, deadline=None)
@given(tiny_table_problems())
def test_passing_bound_holds_with_tables(problem: Problem) -> None:
    from pipeopt.bounds import overtaking_bound, passing_bound

    problem = problem.replace(grad_reduce=())  # the iteration time is then the makespan
    best, _ = brute_force(problem)
    if math.isfinite(best):
        assert passing_bound(problem) <= best * (1 + 1e-9)
        assert overtaking_bound(problem) <= best * (1 + 1e-9)


def test_passing_bound_with_a_table_below_cpsat_optimum() -> None:
    lat, bw = chain_links(3, [0.5, 0.5], [math.inf, math.inf])
    prob = uniform_problem(3, 4, 1.0, 1.2, 0.8).replace(
        latency=lat, bandwidth=bw,
        microbatch_scale=((4, 0.5, 0.25, 1), (6, 0.5, 0.5, 1), (2, 1, 0.25, 0.5)))
    from pipeopt.bounds import passing_bound

    sched = validate(solve_cpsat(prob, SolveOptions(time_limit=20, workers=2)))
    assert sched.solver.status == "optimal"
    assert passing_bound(prob) <= sched.makespan * (1 + 1e-9)
    assert makespan_lower_bound(prob) <= sched.makespan * (1 + 1e-9)


def test_bounds_read_the_stage_row() -> None:
    """p=2, m=2, F = B = W = 1 s, time table [[1, 2], [3, 1]]: micro-batch 0's path is
    F 1 + 3, B 3 + 1, W 1 = 9 s, micro-batch 1's 2 + 1 + 1 + 2 + 2 = 8 s; device 1 works
    (3 + 1) x 3 = 12 s after the earliest arrival, 1 s (micro-batch 0's F on stage 0). The
    optimum (brute force) is at least the bound."""
    prob = uniform_problem(2, 2).replace(microbatch_scale=TABLE)
    from pipeopt.bounds import critical_path, device_bound
    assert critical_path(prob) == 9.0
    assert device_bound(prob) == (9.0, 13.0)
    best, _ = brute_force(prob)
    assert makespan_lower_bound(prob) <= best


# ----- the searches ------------------------------------------------------------------------

@settings(deadline=None, max_examples=40)
@given(table_problems(), st.floats(0.0, 2.0))
def test_greedy_valid_and_within_memory_with_tables(prob: Problem, slack: float) -> None:
    need = memory_floor(prob)
    # What any schedule needs: the micro-batch holding the most on the device's stages.
    for d in range(prob.devices):
        held = max(sum(prob.activation_memory[k] * prob.memory_table[k][j]
                       for k in prob.device_stages[d]) for j in range(prob.microbatches))
        assert need[d] == pytest.approx(prob.static_memory[d] + held)
    limited = prob.replace(memory_limit=tuple(x + slack for x in need))
    for p in (prob, limited):
        sched = validate(solve_greedy(p, SolveOptions(time_limit=2.0)))
        assert fits_memory(sched, p)
        assert sched.makespan >= makespan_lower_bound(p) * (1 - 1e-9)


@settings(max_examples=20, deadline=None)
@given(tiny_table_problems())
def test_cpsat_optimum_is_brute_force_with_tables(problem: Problem) -> None:
    best, _ = brute_force(problem)
    if not math.isfinite(best):
        return
    sched = validate(solve_cpsat(problem, SolveOptions(time_limit=10, workers=2)))
    assert sched.solver.status == "optimal"
    assert sched.iteration_time == pytest.approx(best, rel=1e-9)


# ----- the schedule file -------------------------------------------------------------------

def test_schedule_file_carries_the_tables() -> None:
    lat, bw = chain_links(2, [0.5], [2.0])
    prob = uniform_problem(2, 3).replace(
        latency=lat, bandwidth=bw, message_size=(2.0,),
        microbatch_scale=((1, 2, 3), (3, 2, 1)), microbatch_message_scale=((2, 1, 1),))
    sched = validate(solve_greedy(prob, SolveOptions(time_limit=2.0)))
    doc = json.loads(schedule_json(sched))
    assert doc["problem"]["microbatch_scale"] == [[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]]
    back = schedule_from_dict(doc)
    assert back.problem == prob and back.makespan == sched.makespan
    doc["problem"]["microbatch_scale"] = [[1, 2, 3], ["x", 2, 1]]
    with pytest.raises(ValueError, match=r"problem.microbatch_scale\[1\]\[0\]: expected a number"):
        schedule_from_dict(doc)


def test_one_stage_config_has_no_message_rows() -> None:
    """A single-stage pipeline has no stage boundary, so no message table rows: the config's
    overflow check must not trip on the empty table (found by tests/test_fuzz.py)."""
    from pipeopt.config import parse_config

    cfg = parse_config({"pipeline": {"devices": 1, "microbatches": 8},
                        "stages": {"forward": 1.0, "backward_input": 1.0,
                                   "backward_weight": 1.0}})
    assert cfg.problem.stages == 1 and cfg.problem.message_table == ()
