"""TimedOps: the simulator's ops as columns behave as the tuple of the same TimedOps (equality,
hash, indexing, pickling), and every metric read from the columns equals the one read from
the tuple."""

from __future__ import annotations

import copy
import json
import pickle
from dataclasses import replace
from operator import add

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeopt.io import schedule_from_dict, schedule_json
from pipeopt.problem import uniform_problem
from pipeopt.schedule import Schedule, TimedOp, TimedOps
from pipeopt.schedules import GENERATORS
from pipeopt.simulate import simulate, validate
from tests.strategies import problems, random_orders

METRICS = ("makespan", "iteration_time", "busy_time", "bubble_ratio", "spans", "max_span",
           "memory_timeline", "peak_memory", "peak_activations", "microbatch_order")


def _pair(sched: Schedule) -> tuple[Schedule, Schedule]:
    """``sched`` (its ops as columns) and the same schedule with its ops as a plain tuple."""
    assert isinstance(sched.ops, TimedOps)
    return sched, replace(sched, ops=tuple(sched.ops))


def test_columns_behave_as_the_tuple() -> None:
    prob = uniform_problem(3, 4, activation=1.0, weight_grad=0.5)
    cols, plain = _pair(simulate(prob, GENERATORS["zb-h1"](prob)))
    ops, tup = cols.ops, plain.ops
    assert isinstance(tup, tuple) and len(ops) == len(tup) == prob.num_ops
    assert ops == tup and tup == ops and ops == TimedOps(*ops.columns) and ops != tup[1:]
    assert ops != (tup[0], *tup[1:-1])  # one op fewer
    assert hash(ops) == hash(tup) and cols == plain and hash(cols) == hash(plain)
    assert all(type(o) is TimedOp for o in ops) and list(ops) == list(tup)
    assert ops[3] == tup[3] and ops[-1] == tup[-1] and ops[1:4] == tup[1:4]
    assert ops[2] in ops and list(reversed(ops)) == list(reversed(tup))
    one = (tup[0],)
    assert add(ops, one) == add(tup, one) and add(one, ops) == add(one, tup)  # + either side
    assert repr(ops) == repr(tup)
    for other in (pickle.loads(pickle.dumps(ops)), copy.deepcopy(ops)):
        assert isinstance(other, TimedOps) and other == ops
    again = pickle.loads(pickle.dumps(cols))
    assert again == cols and isinstance(again.ops, TimedOps)
    assert ops.columns[4] == tuple(o.start for o in tup)
    assert list(ops.rows()) == [tuple(o) for o in tup]
    with pytest.raises(AttributeError, match="immutable"):
        ops.start = ()  # type: ignore[misc]
    with pytest.raises(ValueError, match="one length"):
        TimedOps((0,), (0,), (0,), ("F",), (0.0, 1.0), (1.0,))


def test_a_changed_op_is_unequal() -> None:
    prob = uniform_problem(2, 3)
    ops = simulate(prob, GENERATORS["1f1b"](prob)).ops
    assert isinstance(ops, TimedOps)
    d, k, j, kind, start, end = ops.columns
    later = TimedOps(d, k, j, kind, start, (*end[:-1], end[-1] + 1.0))
    assert later != ops and later != tuple(ops) and tuple(ops) != later


@settings(max_examples=40, deadline=None)
@given(problems(contention=True), st.integers(0, 10**6))
def test_metrics_from_the_columns_are_the_tuples(prob, seed) -> None:  # type: ignore[no-untyped-def]
    cols, plain = _pair(simulate(prob, random_orders(prob, seed)))
    for name in METRICS:
        assert getattr(cols, name) == getattr(plain, name), name
    assert cols.device_orders() == plain.device_orders()
    assert cols.to_dict() == plain.to_dict()


def test_a_simulated_schedule_validates_and_round_trips() -> None:
    prob = uniform_problem(4, 300, activation=1.0, weight_grad=0.5)  # >= 1,000 ops: fast check
    sched = simulate(prob, GENERATORS["zb-h1"](prob))
    assert validate(sched) is sched
    back = schedule_from_dict(json.loads(schedule_json(sched)))
    assert sorted(back.ops) == sorted(sched.ops) and back.makespan == sched.makespan
    assert back.peak_memory == sched.peak_memory
