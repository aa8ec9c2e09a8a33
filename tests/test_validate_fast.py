"""The vectorised validator pass agrees with the per-op check (issue 18 item 7).

On valid schedules of every shape (split / fused backward, chunks in loop and V placement,
micro-batches of different cost by micro-batch and by stage, memory limits, latencies) and on
random single breaks of them, ``is_valid`` says True exactly when ``check`` finds nothing.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

import pipeopt
from pipeopt.problem import Problem, uniform_problem
from pipeopt.schedule import TimedOp
from pipeopt.simulate import FAST_CHECK_MIN_OPS, ScheduleError, check, validate
from pipeopt.validate_fast import is_valid


def problems() -> list[tuple[str, Problem]]:
    base = uniform_problem(4, 8, 3.0, 4.0, 2.0, latency=0.5, memory_limit=4.0)
    return [
        ("split", base),
        ("fused", uniform_problem(4, 8, 3.0, 4.0, 2.0, split_backward=False, latency=0.25)),
        ("loop v2", uniform_problem(4, 8, 2.0, 2.0, 2.0, virtual_stages=2, latency=0.1)),
        ("vshape v2", uniform_problem(4, 8, 2.0, 2.0, 2.0, virtual_stages=2, placement="vshape")),
        ("scaled", base.replace(microbatch_scale=(1, 2, 1, 3, 1, 1, 2, 1), memory_limit=())),
        ("table", base.replace(memory_limit=(), microbatch_scale=tuple(
            tuple(1.0 + ((k + j) % 3) for j in range(8)) for k in range(4)))),
    ]


def schedules():
    for name, pr in problems():
        for method in ("1f1b", "gpipe", "zb-h1", "interleaved-1f1b", "zb-v", "greedy"):
            try:
                sched = pipeopt.solve(pr, method, time_limit=2)
            except pipeopt.NotApplicable:
                continue
            yield f"{name}/{method}", sched


CASES = list(schedules())


@pytest.mark.parametrize(("name", "sched"), CASES, ids=[c[0] for c in CASES])
def test_valid_schedules_pass(name, sched):
    assert check(sched) == []
    assert is_valid(sched) is True


def _broken(sched, rng: random.Random):
    """One random break of ``sched`` (it may happen to stay valid: the test compares)."""
    ops = list(sched.ops)
    i = rng.randrange(len(ops))
    o = ops[i]
    how = rng.choice(["shift", "stretch", "device", "drop", "twice", "kind", "stage", "all",
                      "nan", "swap", "early"])
    if how == "shift":
        d = rng.choice([-1.0, -0.3, -1e-6, 1e-12, 0.4, 2.0])
        ops[i] = o._replace(start=o.start + d, end=o.end + d)
    elif how == "stretch":
        ops[i] = o._replace(end=o.end + rng.choice([-0.5, 1e-3, 1.0]))
    elif how == "device":
        ops[i] = o._replace(device=(o.device + 1) % sched.problem.devices)
    elif how == "drop":
        del ops[i]
    elif how == "twice":
        ops.append(o)
    elif how == "kind":
        ops[i] = o._replace(kind=rng.choice(["X", "F", "B", "W"]))
    elif how == "stage":
        ops[i] = o._replace(stage=rng.choice([-1, sched.problem.stages]))
    elif how == "all":
        ops = [x._replace(start=x.start + 1.0, end=x.end + 1.0) for x in ops]
    elif how == "nan":
        ops[i] = o._replace(end=float("nan"))
    elif how == "swap":  # two ops of one device trade their times
        same = [k for k, x in enumerate(ops) if x.device == o.device and k != i]
        k = rng.choice(same)
        x = ops[k]
        ops[i] = o._replace(start=x.start, end=x.start + (o.end - o.start))
        ops[k] = x._replace(start=o.start, end=o.start + (x.end - x.start))
    else:  # an op pulled earlier by its own duration (often before an input)
        ops[i] = o._replace(start=max(0.0, o.start - (o.end - o.start)),
                            end=max(0.0, o.start - (o.end - o.start)) + (o.end - o.start))
    return replace(sched, ops=tuple(TimedOp(*x) for x in ops))


@pytest.mark.parametrize(("name", "sched"), CASES, ids=[c[0] for c in CASES])
def test_agrees_with_check_on_broken_schedules(name, sched):
    rng = random.Random(name)
    invalid = 0
    for _ in range(60):
        bad = _broken(sched, rng)
        want = check(bad) == []
        assert is_valid(bad) is want, (name, check(bad)[:2])
        invalid += not want
    assert invalid >= 40  # the breaks mostly break something


def test_memory_limit():
    pr = uniform_problem(4, 8, 1.0, 1.0, 1.0)
    sched = pipeopt.solve(pr, "gpipe")  # holds all 8 micro-batches on every device
    assert max(sched.peak_memory) == 8.0
    pr = sched.problem  # gpipe is timed with a fused backward
    tight = replace(sched, problem=pr.replace(memory_limit=(7.5,) * 4))
    assert check(tight) and is_valid(tight) is False
    exact = replace(sched, problem=pr.replace(memory_limit=(8.0,) * 4))
    assert check(exact) == [] and is_valid(exact) is True


def test_links_that_serialize_go_to_the_full_check():
    pr = uniform_problem(4, 8, 1.0, 1.0, 1.0)
    slow = pr.replace(message_size=(1.0,) * 3,
                      bandwidth=tuple((1.0,) * 4 for _ in range(4)))
    assert slow.has_link_contention
    assert is_valid(pipeopt.solve(slow, "1f1b")) is None


def test_validate_uses_it_and_still_names_violations():
    pr = uniform_problem(8, FAST_CHECK_MIN_OPS // 8, 1.0, 1.0, 1.0, latency=0.1)
    sched = pipeopt.solve(pr, "1f1b")
    assert sched.problem.num_ops >= FAST_CHECK_MIN_OPS
    assert validate(sched) is sched
    o = sched.ops[5]
    bad = replace(sched, ops=(o._replace(start=o.start + 0.5, end=o.end + 0.5),
                              *sched.ops[:5], *sched.ops[6:]))
    with pytest.raises(ScheduleError, match="invalid schedule: "):
        validate(bad)


@pytest.mark.parametrize(("name", "sched"), CASES, ids=[c[0] for c in CASES])
def test_memory_peaks_match_the_schedules(name, sched):
    """The vectorised peaks are the schedule's own: a limit at a device's peak passes, one a
    little below it fails (on each device in turn; the other devices unlimited)."""
    pr = sched.problem
    peaks = sched.peak_memory
    for d in range(pr.devices):
        if peaks[d] <= 0:
            continue
        for lim, want in ((peaks[d], True), (peaks[d] * (1 - 1e-6), False)):
            limits = tuple(lim if x == d else None for x in range(pr.devices))
            got = replace(sched, problem=pr.replace(memory_limit=limits))
            assert is_valid(got) is want, (name, d, lim)
            assert (check(got) == []) is want


def test_memory_peaks_count_static_memory_and_zero_length_ops():
    """Static memory is added to the peak; with zero-length W ops (a release and the next
    allocation at one time) the peaks are still the schedule's."""
    for w in (1.0, 0.0):
        pr = uniform_problem(2, 4, 1.0, 1.0, w).replace(static_memory=(2.5, 2.5))
        for method in ("1f1b", "zb-h1", "greedy"):
            sched = pipeopt.solve(pr, method)
            peak = max(sched.peak_memory)
            assert peak > 2.5
            own = sched.problem  # 1f1b is timed with a fused backward
            at = replace(sched, problem=own.replace(memory_limit=(peak,) * 2))
            below = replace(sched, problem=own.replace(memory_limit=(peak - 0.5,) * 2))
            assert is_valid(at) is True and is_valid(below) is False, (w, method)


@pytest.mark.parametrize(("name", "sched"), CASES, ids=[c[0] for c in CASES])
def test_memory_peaks_from_the_device_order_are_the_sorted_events(name, sched):
    """With every op lasting > 0 s and none overlapping on its device, the peaks read in the
    device order equal, bit for bit, those of the sorted events and the schedule's own."""
    import numpy as np

    from pipeopt.validate_fast import _peak_memory

    pr = sched.problem
    dev, stage, mb, kind, start, end = (tuple(map(lambda o, f=f: o[f], sched.ops))
                                        for f in range(6))
    code = {k: i for i, k in enumerate(pr.kinds)}
    dv, st, j = (np.asarray(x, np.int64) for x in (dev, stage, mb))
    gid = np.asarray([code[k] for k in kind], np.int64) * pr.stages + st
    t0, t1 = np.asarray(start), np.asarray(end)
    order = np.lexsort((t1, t0, dv))
    assert (t1 > t0).all()
    sorted_events = _peak_memory(pr, np, dv, gid, st, j, t0, t1)
    in_order = _peak_memory(pr, np, dv, gid, st, j, t0, t1, order)
    assert in_order == sorted_events == list(sched.peak_memory), name
