"""The fast paths that cut the fixed cost of a large solve (loading, order checks, writing)
give the same values and the same error messages as the value-by-value walks they skip."""

from __future__ import annotations

import math

import pytest

from pipeopt.io import _BY_DEVICE_AND_TIME, schedule_json
from pipeopt.problem import Op, Problem, ProblemError, chain_links, uniform_problem
from pipeopt.schedule import by_device_and_time
from pipeopt.schedules.classic import one_f_one_b
from pipeopt.simulate import ScheduleError, simulate


def _chain_by_hand(p: int, lat: list[float], bw: list[float]
                   ) -> tuple[list[list[float]], list[list[float]]]:
    """Brute force: the worst link on the chain between a and b, for every pair."""
    lat_m = [[0.0] * p for _ in range(p)]
    bw_m = [[math.inf] * p for _ in range(p)]
    for a in range(p):
        for b in range(p):
            if a != b:
                lo, hi = min(a, b), max(a, b)
                lat_m[a][b] = max(lat[lo:hi])
                bw_m[a][b] = min(bw[lo:hi])
    return lat_m, bw_m


def test_chain_links_is_the_worst_link_between_two_devices() -> None:
    lat, bw = [1e-3, 5e-3, 2e-3, 4e-3], [1e9, math.inf, 3e8, 2e9]
    got_lat, got_bw = chain_links(5, lat, bw)
    want_lat, want_bw = _chain_by_hand(5, lat, bw)
    assert [list(r) for r in got_lat] == want_lat
    assert [list(r) for r in got_bw] == want_bw
    assert got_lat[0][4] == 5e-3 and got_bw[2][4] == 3e8  # by hand
    assert all(type(x) is float for row in got_lat + got_bw for x in row)
    assert chain_links(1, [], []) == (((0.0,),), ((math.inf,),))


def _matrix(p: int, fill: float, at: tuple[int, int], value: float) -> list[list[float]]:
    rows = [[fill] * p for _ in range(p)]
    rows[at[0]][at[1]] = value
    return rows


@pytest.mark.parametrize(("field", "value", "message"), [
    ("latency", math.nan, "latency[2][1]: must be a finite number, got nan"),
    ("latency", math.inf, "latency[2][1]: must be a finite number, got inf"),
    ("latency", -1.0, "latency[2][1]: must be >= 0, got -1.0"),
    ("bandwidth", 0.0, "bandwidth[2][1]: must be > 0, got 0.0"),
    ("bandwidth", -math.inf, "bandwidth[2][1]: must be > 0, got -inf"),
])
def test_a_bad_matrix_value_is_named(field: str, value: float, message: str) -> None:
    base = uniform_problem(3, 2)
    fill = 1e9 if field == "bandwidth" else 0.0
    with pytest.raises(ProblemError, match=message.replace("[", r"\[").replace("]", r"\]")):
        base.replace(**{field: _matrix(3, fill, (2, 1), value)})


def test_a_short_matrix_row_is_named() -> None:
    rows = [[0.0] * 3, [0.0] * 2, [0.0] * 3]
    with pytest.raises(ProblemError, match=r"latency\[1\]: expected 3 values, got 2"):
        uniform_problem(3, 2).replace(latency=rows)


def test_infinite_bandwidth_is_kept_and_written_as_inf() -> None:
    prob = uniform_problem(3, 2).replace(bandwidth=_matrix(3, math.inf, (0, 1), 2e9))
    assert prob.bandwidth[0][1] == 2e9 and prob.bandwidth[1][0] == math.inf
    rows = prob.to_dict()["bandwidth"]
    assert rows == [["inf", 2e9, "inf"], ["inf"] * 3, ["inf"] * 3]
    assert Problem.from_dict(prob.to_dict()) == prob


def test_the_writer_key_is_by_device_and_time() -> None:
    sched = simulate(uniform_problem(3, 4, latency=0.1), one_f_one_b(uniform_problem(3, 4)))
    assert all(_BY_DEVICE_AND_TIME(o) == by_device_and_time(o) for o in sched.ops)
    text = schedule_json(sched)
    assert text.index('"device": 0,') < text.index('"device": 1,') < text.index('"device": 2,')


def _orders(prob: Problem) -> list[list[Op]]:
    return [list(o) for o in one_f_one_b(prob)]


def test_order_faults_are_named_as_before() -> None:
    prob = uniform_problem(2, 2)
    twice = _orders(prob)
    twice[0][1] = twice[0][0]
    with pytest.raises(ScheduleError, match=r"orders\[0\]\[1\]: .* appears twice"):
        simulate(prob, twice)
    moved = _orders(prob)
    moved[0].append(moved[1].pop())
    with pytest.raises(ScheduleError, match=r"belongs on device 1"):
        simulate(prob, moved)
    short = _orders(prob)
    short[1].pop()
    with pytest.raises(ScheduleError, match=r"1 ops missing"):
        simulate(prob, short)
    outside = _orders(prob)
    outside[0][0] = Op("F", 0, 7)
    with pytest.raises(ScheduleError, match=r"orders\[0\]\[0\]: .* is not an op"):
        simulate(prob, outside)
