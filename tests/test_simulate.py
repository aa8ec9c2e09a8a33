"""The simulator and the validator: hand-checked cases, deadlocks, and property tests."""

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeopt.problem import Op, Problem, chain_links, uniform_problem
from pipeopt.simulate import (
    DeadlockError,
    ScheduleError,
    _simulate_events,
    check,
    simulate,
    validate,
)
from tests.strategies import inputs, problems, random_orders


def test_two_stages_by_hand():
    # F=1, B=2, W=1 on 2 devices, 1 micro-batch, 0.5 s latency.
    lat, bw = chain_links(2, [0.5], [math.inf])
    prob = Problem(devices=2, microbatches=1, forward=(1, 1), backward_input=(2, 2),
                   backward_weight=(1, 1), latency=lat, bandwidth=bw,
                   activation_memory=(4, 4), weight_grad_memory=(1, 1))
    orders = [[Op("F", 0, 0), Op("B", 0, 0), Op("W", 0, 0)],
              [Op("F", 1, 0), Op("B", 1, 0), Op("W", 1, 0)]]
    s = simulate(prob, orders)
    t = s.op_times()
    assert t[Op("F", 1, 0)] == (1.5, 2.5)
    assert t[Op("B", 1, 0)] == (2.5, 4.5)
    assert t[Op("B", 0, 0)] == (5.0, 7.0)
    assert t[Op("W", 0, 0)] == (7.0, 8.0)
    assert s.makespan == 8.0
    assert s.bubble_ratio == pytest.approx(1 - 8 / 16)
    assert s.peak_memory == (4.0, 4.0)
    # Device 1: 4 from F start (1.5), 3 bytes freed at B end (4.5), last 1 at W end (5.5).
    assert s.memory_timeline[1] == ((0.0, 0.0), (1.5, 4.0), (4.5, 1.0), (5.5, 0.0))


def test_link_serialization_by_hand():
    # Two micro-batches leave stage 0 at t=1 and t=2; each occupies the link for 3 s.
    lat, bw = chain_links(2, [0.25], [1.0])
    prob = Problem(devices=2, microbatches=2, forward=(1, 1), backward_input=(1, 1),
                   backward_weight=(1, 1), latency=lat, bandwidth=bw, message_size=(3.0,))
    orders = [[Op("F", 0, 0), Op("F", 0, 1), Op("B", 0, 0), Op("W", 0, 0), Op("B", 0, 1),
               Op("W", 0, 1)],
              [Op("F", 1, 0), Op("B", 1, 0), Op("W", 1, 0), Op("F", 1, 1), Op("B", 1, 1),
               Op("W", 1, 1)]]
    s = validate(simulate(prob, orders))
    t = s.op_times()
    assert t[Op("F", 1, 0)][0] == 1 + 3 + 0.25
    # The second activation waits for the link: starts at 4, arrives at 7.25.
    assert t[Op("F", 1, 1)][0] == 7.25
    fwd = sorted((m.start, m.end) for m in s.messages if m.kind == "F")
    assert fwd == [(1.0, 4.0), (4.0, 7.0)]
    # The validator catches two messages overlapping on one link.
    bad = list(s.messages)
    i = next(i for i, m in enumerate(bad) if m.kind == "F" and m.start == 4.0)
    bad[i] = bad[i]._replace(start=3.0, end=6.0, arrival=6.25)
    assert any("overlaps" in v for v in check(replace(s, messages=tuple(bad))))


def test_deadlock_names_the_cycle():
    prob = uniform_problem(2, 1)
    orders = [[Op("B", 0, 0), Op("F", 0, 0), Op("W", 0, 0)],
              [Op("F", 1, 0), Op("B", 1, 0), Op("W", 1, 0)]]
    with pytest.raises(DeadlockError) as exc:
        simulate(prob, orders)
    msg = str(exc.value)
    assert "device 0 waits at 0B0 for 0F0" in msg


def test_collector_state_restored_after_simulating():
    """simulate pauses the cyclic garbage collector while it builds the ops; afterwards (also
    after an error) the collector is exactly as the caller left it."""
    import gc

    prob = uniform_problem(2, 1)
    good = [[Op("F", 0, 0), Op("B", 0, 0), Op("W", 0, 0)],
            [Op("F", 1, 0), Op("B", 1, 0), Op("W", 1, 0)]]
    stuck = [[Op("B", 0, 0), Op("F", 0, 0), Op("W", 0, 0)], good[1]]
    assert gc.isenabled()
    simulate(prob, good)
    assert gc.isenabled()
    with pytest.raises(DeadlockError):
        simulate(prob, stuck)
    assert gc.isenabled()
    gc.disable()
    try:
        simulate(prob, good)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_deadlock_across_devices():
    prob = uniform_problem(2, 2)
    # Device 0 wants micro-batch 0's gradient before sending micro-batch 1 forward; device 1
    # wants micro-batch 1's activation before working on micro-batch 0.
    orders = [[Op("F", 0, 0), Op("B", 0, 0), Op("W", 0, 0), Op("F", 0, 1), Op("B", 0, 1),
               Op("W", 0, 1)],
              [Op("F", 1, 1), Op("F", 1, 0), Op("B", 1, 0), Op("W", 1, 0), Op("B", 1, 1),
               Op("W", 1, 1)]]
    with pytest.raises(DeadlockError) as exc:
        simulate(prob, orders)
    assert len(exc.value.cycle) == 2
    assert "device 0 waits at 0B0 for 1B0 (device 1)" in str(exc.value)
    assert "device 1 waits at 1F1 for 0F1 (device 0)" in str(exc.value)


def test_bad_orders_are_named():
    prob = uniform_problem(2, 1)
    with pytest.raises(ScheduleError, match="belongs on device 1"):
        simulate(prob, [[Op("F", 1, 0)], []])
    with pytest.raises(ScheduleError, match="appears twice"):
        simulate(prob, [[Op("F", 0, 0), Op("F", 0, 0)], []])
    with pytest.raises(ScheduleError, match="missing"):
        simulate(prob, [[Op("F", 0, 0)], []])


#: Problems with latency-only links or with links that serialize messages (then the schedule
#: carries timed messages, and a perturbed op must still be caught).
ANY_LINKS = st.booleans().flatmap(lambda contention: problems(contention=contention))


@given(problems(), st.integers(0, 10**6))
def test_simulated_schedules_are_valid(prob, seed):
    s = simulate(prob, random_orders(prob, seed))
    assert check(s) == []
    assert s.makespan >= max(prob.device_work(d) for d in range(prob.devices)) - 1e-9
    assert 0.0 <= s.bubble_ratio < 1.0


@given(problems(contention=True), st.integers(0, 10**6))
def test_simulated_schedules_with_link_contention_are_valid(prob, seed):
    s = simulate(prob, random_orders(prob, seed))
    assert check(s) == []


@given(problems(), st.integers(0, 10**6))
def test_fast_and_event_paths_agree(prob, seed):
    """simulate (the core's fast path on latency-only links) and the core's event path time
    every op alike."""
    orders = random_orders(prob, seed)
    fast = simulate(prob, orders)
    ops, _ = _simulate_events(prob, orders)
    a, b = sorted(fast.ops), sorted(ops)
    assert [o[:4] for o in a] == [o[:4] for o in b]
    assert [t for o in a for t in (o.start, o.end)] == pytest.approx(
        [t for o in b for t in (o.start, o.end)]
    )


@given(ANY_LINKS, st.integers(0, 10**6), st.data())
def test_any_earlier_start_is_caught(prob, seed, data):
    s = simulate(prob, random_orders(prob, seed))
    movable = [i for i, o in enumerate(s.ops) if o.start > 1e-6]
    if not movable:
        return
    i = data.draw(st.sampled_from(movable))
    o = s.ops[i]
    # Less than any op's duration, so the op cannot jump a whole op ahead in its device's
    # order (that would be another valid order, not a perturbation).
    shortest = min(o2.end - o2.start for o2 in s.ops)
    shift = data.draw(st.floats(1e-3, 0.999)) * min(o.start, shortest)
    ops = list(s.ops)
    ops[i] = o._replace(start=o.start - shift, end=o.end - shift)
    # Every op starts as early as its device and inputs allow, so moving one earlier must
    # break a rule.
    assert check(replace(s, ops=tuple(ops))) != []


@given(ANY_LINKS, st.integers(0, 10**6), st.data())
def test_swapping_across_a_dependency_is_caught(prob, seed, data):
    s = simulate(prob, random_orders(prob, seed))
    times = {o.op: o for o in s.ops}
    pairs = [(x, y) for y in times for x in inputs(prob, y)]
    if not pairs:
        return
    x, y = data.draw(st.sampled_from(pairs))
    ops = [o for o in s.ops if o.op not in (x, y)]
    ox, oy = times[x], times[y]
    # y now runs where x ran, x after it.
    ops.append(oy._replace(start=ox.start, end=ox.start + (oy.end - oy.start)))
    ops.append(ox._replace(start=oy.start, end=oy.start + (ox.end - ox.start)))
    assert check(replace(s, ops=tuple(ops))) != []


def test_validator_catches_memory_limit_and_wrong_durations():
    prob = uniform_problem(2, 4, memory_limit=1.5)
    from pipeopt.schedules import GENERATORS

    s = simulate(prob, GENERATORS["gpipe"](prob))
    assert any("peak memory" in v for v in check(s))
    ops = list(s.ops)
    ops[0] = ops[0]._replace(end=ops[0].end + 0.5)
    assert any("duration" in v for v in check(replace(s, ops=tuple(ops))))
    with pytest.raises(ScheduleError):
        validate(replace(s, ops=tuple(ops[1:])))


@given(problems(), st.integers(0, 10**6))
def test_peak_memory_from_the_orders_alone(prob, seed):
    """Ops on a device run one after another, so the order fixes the memory steps: the peak
    computed from the orders equals the timed schedule's."""
    from pipeopt.schedule import order_peak_memory

    orders = random_orders(prob, seed)
    peaks = order_peak_memory(prob, orders)
    timed = simulate(prob, orders).peak_memory
    if min(min(ts) for ts in prob.durations.values()) > 0:
        assert peaks == pytest.approx(timed)
    else:  # a zero-length op's events may be reordered at equal times: an upper bound
        assert all(p >= t - 1e-9 for p, t in zip(peaks, timed, strict=True))


def test_file_without_messages_checked_against_any_sending_order():
    """SPEC files carry no messages: a receiver that runs micro-batch 1 first needs its
    message first, which first-ready-first-served would not send; earliest-deadline does."""
    from pipeopt.schedule import Message, Schedule, TimedOp
    from pipeopt.solvers import solve

    lat, bw = chain_links(2, [0.0], [1.0])
    prob = Problem(devices=2, microbatches=2, forward=(1, 1), backward_input=(1, 1),
                   backward_weight=(0, 0), split_backward=False, latency=lat, bandwidth=bw,
                   message_size=(1.5,))
    ops = (TimedOp(0, 0, 0, "F", 0, 1), TimedOp(0, 0, 1, "F", 1, 2),
           TimedOp(1, 1, 1, "F", 3.5, 4.5), TimedOp(1, 1, 1, "B", 4.5, 5.5),
           TimedOp(1, 1, 0, "F", 5.5, 6.5), TimedOp(1, 1, 0, "B", 6.5, 7.5),
           TimedOp(0, 0, 1, "B", 7, 8), TimedOp(0, 0, 0, "B", 9, 10))
    msgs = (Message(0, 1, 0, 1, 1, "F", 2, 3.5, 3.5), Message(0, 1, 0, 1, 0, "F", 3.5, 5, 5),
            Message(1, 0, 1, 0, 1, "B", 5.5, 7, 7), Message(1, 0, 1, 0, 0, "B", 7.5, 9, 9))
    sched = Schedule(prob, "hand", ops, msgs)
    assert check(sched) == []
    assert check(replace(sched, messages=())) == []
    # One direction slow only: still a contended link (it used to be taken for latency-only).
    one_way = prob.replace(bandwidth=((math.inf, math.inf), (1.0, math.inf)))
    assert one_way.has_link_contention
    for method in ("1f1b", "greedy"):
        validate(solve(one_way, method))
    # A message's kind must match its direction.
    bad = replace(sched, messages=(msgs[0]._replace(kind="B"), *msgs[1:]))
    assert any("carries an activation (kind F)" in v for v in check(bad))


def test_serialized_links_report_faults_as_the_fast_path_does():
    """A bad order or a deadlock is named in the same words (ops, positions) on serialized
    links (the core's event path) as on latency-only links (the core's fast path)."""
    fast = uniform_problem(2, 2)
    lat, bw = chain_links(2, [0.1], [1.0])
    slow = fast.replace(latency=lat, bandwidth=bw, message_size=(0.5,))
    assert slow.has_link_contention and not fast.has_link_contention
    # A delay on an idle link: latency or transmission, in either direction.
    late = fast.replace(latency=chain_links(2, [0.1], [math.inf])[0])
    back = fast.replace(bandwidth=((math.inf, math.inf), (1.0, math.inf)), message_size=(0.5,))
    assert slow.has_link_delay and late.has_link_delay and back.has_link_delay
    assert not fast.has_link_delay and not late.has_link_contention
    good = [[Op("F", 0, 0), Op("F", 0, 1), Op("B", 0, 0), Op("W", 0, 0), Op("B", 0, 1),
             Op("W", 0, 1)],
            [Op("F", 1, 0), Op("B", 1, 0), Op("W", 1, 0), Op("F", 1, 1), Op("B", 1, 1),
             Op("W", 1, 1)]]
    bad_orders = [
        [good[0] + [Op("F", 1, 0)], good[1]],  # misplaced
        [[*good[0][:2], good[0][1], *good[0][2:]], good[1]],  # repeated
        [good[0][:-1], good[1]],  # missing
        [good[0] + [Op("X", 0, 0)], good[1]],  # no such op
        [good[0] + [Op("F", 0, 2)], good[1]],  # no such micro-batch
        [good[0]],  # a device short
        [good[0][::-1], good[1]],  # deadlock
    ]
    for orders in bad_orders:
        with pytest.raises(ScheduleError) as want:
            simulate(fast, orders)
        with pytest.raises(ScheduleError) as got:
            simulate(slow, orders)
        assert type(got.value) is type(want.value)
        assert str(got.value) == str(want.value)
        if isinstance(want.value, DeadlockError):
            assert got.value.cycle == want.value.cycle
    assert check(simulate(slow, good)) == []
