"""Issue 18 item 7: time limits hold at the documented sizes. Loading is O(p^2), the bounds are
O(stages) per call, the greedy gives up at the limit when ``auto`` has another schedule, and the
CLI counts loading, validation and writing against the limit (benchmarks/limits.py measures
the wall times; no test here gates on a machine's speed beyond a tenfold margin)."""

from __future__ import annotations

import logging
import math
import random
import time
from pathlib import Path

import pytest

import pipeopt
from pipeopt.bounds import iteration_lower_bound, round_trip, round_trips
from pipeopt.problem import Problem, chain_links
from pipeopt.solvers import OutOfTime, SolveOptions


def _chain_by_definition(p: int, latency: list[float], bandwidth: list[float]
                         ) -> tuple[tuple[tuple[float, ...], ...], ...]:
    lat = [[0.0] * p for _ in range(p)]
    bw = [[math.inf] * p for _ in range(p)]
    for a in range(p):
        for b in range(a + 1, p):
            lat[a][b] = lat[b][a] = max(latency[a:b])
            bw[a][b] = bw[b][a] = min(bandwidth[a:b])
    return tuple(map(tuple, lat)), tuple(map(tuple, bw))


def test_chain_links_is_the_slowest_tier_between_two_devices() -> None:
    rng = random.Random(3)
    for p in (1, 2, 3, 9, 40):
        lat = [rng.choice([0.0, 1e-6, 5e-3, 0.1]) for _ in range(p - 1)]
        bw = [rng.choice([1e9, 5e10, math.inf]) for _ in range(p - 1)]
        assert chain_links(p, lat, bw) == _chain_by_definition(p, lat, bw)


def test_loading_1024_devices_is_quadratic(tmp_path: Path) -> None:
    """Per-neighbour links at the documented maximum: 63 s before (a min over the chain inside
    the p^2 loop), about 2 s now on the 2-core development machine."""
    p = 1024
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"pipeline: {{devices: {p}, microbatches: 2}}\n"
                   "stages: {forward: 1, backward_input: 1, backward_weight: 1}\n"
                   f"links: {{latency: [{', '.join(['0.001'] * (p - 1))}], "
                   f"bandwidth: [{', '.join(['1.0e9'] * (p - 1))}], message_size: 1.0e6}}\n",
                   encoding="utf-8")
    t0 = time.perf_counter()
    prob = pipeopt.load_config(cfg).problem
    assert time.perf_counter() - t0 < 30
    assert prob.latency[0][p - 1] == 0.001 and prob.bandwidth[0][p - 1] == 1e9
    scalar = tmp_path / "s.yaml"
    scalar.write_text(cfg.read_text().replace(f"latency: [{', '.join(['0.001'] * (p - 1))}]",
                                              "latency: 0.001"), encoding="utf-8")
    t0 = time.perf_counter()
    assert pipeopt.load_config(scalar).problem.bandwidth[3][900] == 1e9
    assert time.perf_counter() - t0 < 30


def test_bounds_look_at_each_link_a_fixed_number_of_times(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """round_trip per stage summed the delays of every later link: O(stages^2) per bound,
    163 s of a 10 s solve at p = 1024."""
    prob = pipeopt.uniform_problem(devices=256, microbatches=4, latency=0.01)
    assert round_trips(prob) == pytest.approx([round_trip(prob, k) for k in range(256)])
    calls = 0
    delay = Problem.delay

    def counted(self: Problem, a: int, b: int, microbatch: int | None = None) -> float:
        nonlocal calls
        calls += 1
        return delay(self, a, b, microbatch)

    monkeypatch.setattr(Problem, "delay", counted)
    iteration_lower_bound(prob)
    assert calls < 20 * prob.stages  # was about 4 * 256^2 = 262,144


def test_greedy_gives_up_at_the_limit_only_when_asked() -> None:
    from pipeopt.solvers.greedy import solve_greedy

    prob = pipeopt.uniform_problem(devices=32, microbatches=512)  # 49,152 ops
    with pytest.raises(OutOfTime, match="ended before its first schedule"):
        solve_greedy(prob, SolveOptions(time_limit=1e-4), optional=True)
    # Alone, it returns a hand-made schedule that fits instead, and says so.
    late = solve_greedy(prob, SolveOptions(time_limit=1e-4))
    assert late.method == "greedy:zb-h1" and "ended before its first" in late.solver.detail(
        "fallback")
    # auto gives the greedy at least 0.1 s: a problem whose first variant takes longer than
    # that on any machine (196,608 ops; the 49,152 above can finish in 0.1 s on an idle one).
    sched = pipeopt.solve(pipeopt.uniform_problem(devices=64, microbatches=1024), "auto",
                          time_limit=1e-3)
    assert sched.method.startswith("auto:zb")  # the hand-made fallback
    # Once the hand-made schedules spent the limit, auto does not start the greedy at all.
    assert sched.solver.detail("greedy").startswith("skipped: auto's")


def _slow_clock(monkeypatch: pytest.MonkeyPatch, step_s: float) -> list[float]:
    """``time.perf_counter`` made a fake clock on which each look is ``step_s`` seconds after
    the one before (a machine where the list scheduler's 4,096 steps between two looks take
    that long); returns the readings as they are taken."""
    readings: list[float] = []

    def fake() -> float:
        readings.append(100.0 + step_s * len(readings))
        return readings[-1]

    monkeypatch.setattr(time, "perf_counter", fake)
    return readings


def test_the_greedys_first_variant_honours_the_deadline(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """Issue 18: the greedy alone (nothing else to return) gives up its first variant at the
    time limit, at its first look at the clock past it, and returns the hand-made ZB-H1
    instead (it fits the memory the greedy must keep), saying so. Before, that variant always
    ran to its end: at p = 1024 a 0.5 s limit took 15 s."""
    from pipeopt.simulate import check
    from pipeopt.solvers.greedy import solve_greedy

    prob = pipeopt.uniform_problem(devices=16, microbatches=1024,
                                   memory_limit=16.0)  # 49,152 ops: 12 looks at the clock
    readings = _slow_clock(monkeypatch, 1.0)
    late = solve_greedy(prob, SolveOptions(time_limit=5))
    assert late.method == "greedy:zb-h1" and late.solver.detail("variants_tried") == 0
    assert late.solver.detail("fallback") == (
        "greedy: the 5 s it was given ended before its first schedule; returned the hand-made "
        "zb-h1 schedule instead")
    assert check(late) == [] and max(late.peak_memory) <= 16.0
    # Stopped at the first look past the deadline (at most a second late on this clock), and
    # the fallback's timing took one more reading or two.
    assert late.solver.wall_time <= 5 + 1 + 2 and len(readings) < 12
    with pytest.raises(OutOfTime, match="ended before its first schedule"):
        solve_greedy(prob, SolveOptions(time_limit=5), optional=True)
    monkeypatch.undo()
    assert solve_greedy(prob, SolveOptions(time_limit=60)).method == "greedy"


@pytest.mark.parametrize(("w", "chain"), [(1.0, 33.0), (0.0, 32.0)])
def test_a_late_greedy_falls_back_to_what_fits(monkeypatch: pytest.MonkeyPatch, w: float,
                                               chain: float) -> None:
    """Below ZB-H1's and 1F1B's peak (p micro-batches on device 0) neither fits: the fallback
    is sequential orders, one micro-batch at a time, which fit any limit the greedy accepts.
    With W ops of no duration the orders' peak is not checked before the timing; the timed
    schedule's is."""
    from pipeopt.simulate import check
    from pipeopt.solvers.greedy import solve_greedy

    prob = pipeopt.uniform_problem(devices=16, microbatches=1024, w=w, memory_limit=2.0)
    _slow_clock(monkeypatch, 1.0)
    late = solve_greedy(prob, SolveOptions(time_limit=5))
    assert late.method == "greedy:sequential"
    assert check(late) == [] and max(late.peak_memory) <= 2.0
    # Sequential, 1 s per op: a micro-batch's 16 F, its 16 B, then device 0's W (the other
    # devices' W run beside the B chain) before the next micro-batch's first F.
    assert late.makespan == pytest.approx(1024 * chain)


def _greedy_limits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record the time limit of every greedy run (the list fills as they run)."""
    from pipeopt.solvers import greedy

    given: list[float] = []
    real = greedy.solve_greedy

    def spy(problem: Problem, options: SolveOptions, **kw: object) -> pipeopt.Schedule:
        given.append(options.time_limit)
        return real(problem, options, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(greedy, "solve_greedy", spy)
    return given


def test_solve_keeps_time_for_validation_and_the_cli_for_loading_and_writing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import pipeopt.solvers as solvers
    from pipeopt.cli import main

    given = _greedy_limits(monkeypatch)
    prob = pipeopt.uniform_problem(devices=4, microbatches=8)
    monkeypatch.setattr("pipeopt.clock.MAX_SLOWDOWN", 1.0)  # whatever the machine's load
    monkeypatch.setattr(solvers, "VALIDATE_S_PER_OP", 0.1)  # 96 ops: 9.6 s kept
    pipeopt.solve(prob, "greedy", time_limit=20)
    assert given == [pytest.approx(20 - 9.6, abs=0.2)]  # less the 50 ms probe of the load
    pipeopt.solve(prob, "greedy", time_limit=5)  # never below a tenth of the limit
    assert given[-1] == pytest.approx(0.5)
    monkeypatch.setattr(solvers, "VALIDATE_S_PER_OP", 0.0)

    import pipeopt.cli as cli

    monkeypatch.setattr(cli, "WRITE_S_PER_OP", 0.05)  # 96 ops: 4.8 s kept for writing
    cfg = tmp_path / "c.yaml"
    cfg.write_text("pipeline: {devices: 4, microbatches: 8}\n"
                   "stages: {forward: 1, backward_input: 1, backward_weight: 1}\n",
                   encoding="utf-8")
    with caplog.at_level(logging.INFO, logger="pipeopt"):
        assert main(["solve", str(cfg), "--method", "greedy", "--time-limit", "10", "-q",
                     "-o", str(tmp_path / "s.json")]) == 0
    assert 10 - 4.8 - 1 < given[-1] < 10 - 4.8
    log = caplog.text
    assert "kept for writing" in log and "schedule written in" in log and "in all" in log


def test_auto_skips_validation_only_when_it_would_overrun_the_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A phase that cannot finish in the time left is skipped with a note: auto's result is
    validated when the estimate fits the limit (with a tenth of it to spare), and returned
    with the detail ``validation`` (never through the validator) when it does not; other
    methods always validate."""
    import pipeopt.solvers as solvers

    calls: list[str] = []
    real = solvers.validate

    def spy(schedule: pipeopt.Schedule) -> pipeopt.Schedule:
        calls.append(schedule.method)
        return real(schedule)

    monkeypatch.setattr(solvers, "validate", spy)
    monkeypatch.setattr("pipeopt.clock.MAX_SLOWDOWN", 1.0)  # whatever the machine's load
    prob = pipeopt.uniform_problem(devices=4, microbatches=8)  # 96 ops
    sched = pipeopt.solve(prob, "auto", time_limit=30)
    assert calls == [sched.method] and sched.solver.detail("validation") is None
    # 31 s needed, 30 s given: within the grace of a tenth of the limit, still validated.
    monkeypatch.setattr(solvers, "VALIDATE_S_PER_OP", 31 / 96)
    sched = pipeopt.solve(prob, "auto", time_limit=30)
    assert len(calls) == 2 and sched.solver.detail("validation") is None
    del calls[1:]
    monkeypatch.setattr(solvers, "VALIDATE_S_PER_OP", 1.0)  # 96 s needed, 30 s given
    sched = pipeopt.solve(prob, "auto", time_limit=30)
    assert len(calls) == 1
    assert sched.solver.detail("validation").startswith("skipped: ")
    assert "pipeopt simulate FILE" in sched.solver.detail("validation")
    assert pipeopt.validate(sched) is sched  # what it skipped would have passed
    pipeopt.solve(prob, "greedy", time_limit=30)
    assert calls[-1] == "greedy"  # a search's own times are always checked


def test_slowdown_is_wall_per_cpu_second_within_bounds() -> None:
    """Issue 18 item 7 under load: a phase's CPU estimate is scaled by the wall seconds per CPU
    second this run got so far, between 1 and MAX_SLOWDOWN."""
    from pipeopt.clock import MAX_SLOWDOWN, MIN_CPU_SAMPLE_S, Stopwatch

    now_wall, now_cpu = time.perf_counter(), time.process_time()
    # 3 s of wall time for 1 s of CPU: a third of a core.
    assert Stopwatch(now_wall - 3.0, now_cpu - 1.0).slowdown() == pytest.approx(3.0, rel=0.05)
    assert Stopwatch(now_wall - 100.0, now_cpu - 1.0).slowdown() == MAX_SLOWDOWN
    # Threads that used more CPU than wall time, and too small a sample, read as 1.
    assert Stopwatch(now_wall - 1.0, now_cpu - 4.0).slowdown() == 1.0
    assert Stopwatch(now_wall - 1.0, now_cpu).slowdown() == 1.0
    watch = Stopwatch.start()
    time.sleep(0.01)
    assert watch.elapsed() >= 0.01
    # Too small a sample, calibrated: a busy loop of MIN_CPU_SAMPLE_S measures the machine.
    t0 = time.process_time()
    assert 1.0 <= Stopwatch.start().slowdown(calibrate=True) <= MAX_SLOWDOWN
    assert time.process_time() - t0 >= MIN_CPU_SAMPLE_S


def test_the_validation_reserve_grows_with_the_slowdown(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """Before a search, solve() probes the machine when validation is worth it and keeps the
    estimate times the slowdown out of the search's time."""
    import pipeopt.solvers as solvers
    from pipeopt.clock import Stopwatch

    given = _greedy_limits(monkeypatch)
    monkeypatch.setattr(Stopwatch, "slowdown", lambda self, calibrate=False: 3.0)
    monkeypatch.setattr(solvers, "VALIDATE_S_PER_OP", 0.02)  # 96 ops: 1.92 s of CPU
    pipeopt.solve(pipeopt.uniform_problem(devices=4, microbatches=8), "greedy", time_limit=20)
    assert given == [pytest.approx(20 - 3 * 1.92, abs=0.1)]


def test_validation_cost_and_the_slowdown_decide_skipping(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """The vectorised validator's per-op cost applies where it runs (no link contention, large
    enough to import numpy for); a measured slowdown multiplies the estimate, and a skip says
    the slowdown that caused it."""
    import pipeopt.solvers as solvers
    from pipeopt.simulate import FAST_CHECK_IMPORT_OPS

    big = pipeopt.uniform_problem(devices=64, microbatches=512)  # 98,304 ops
    assert big.num_ops >= FAST_CHECK_IMPORT_OPS
    assert solvers.validation_cost(big) == pytest.approx(solvers.VALIDATE_FAST_S_PER_OP * 98_304)
    small = pipeopt.uniform_problem(devices=4, microbatches=8)
    assert solvers.validation_cost(small) == pytest.approx(solvers.VALIDATE_S_PER_OP * 96)
    busy = small.replace(message_size=(1.0,) * 3, bandwidth=tuple((1.0,) * 4 for _ in range(4)))
    assert busy.has_link_contention
    assert solvers.validation_cost(busy) == pytest.approx(solvers.VALIDATE_S_PER_OP * 96)

    sched = pipeopt.solve(small, "zb-h1")  # split backward: 96 ops
    monkeypatch.setattr(solvers, "VALIDATE_S_PER_OP", 0.1)  # 9.6 s of CPU
    # 10 s left of a 10 s limit: validated on an idle machine, skipped at a slowdown of 2.
    assert solvers._validate_in_time(sched, 10.0, 10.0, 1.0).solver.detail("validation") is None
    note = solvers._validate_in_time(sched, 10.0, 10.0, 2.0).solver.detail("validation")
    assert note.startswith("skipped: 10.0 s of the time limit left, about 19.2 s needed")
    assert "wall / CPU time: 2.0" in note


def test_cli_says_whether_the_schedule_was_validated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 18 item 7: a skipped validation is never silent: ``--json`` has ``validated``
    (and ``validation``, the reason), the text summary a ``validation`` line, the written
    file its ``solver.details.validation``."""
    import json

    import pipeopt.solvers as solvers
    from pipeopt.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("pipeline: {devices: 4, microbatches: 8}\n"
                   "stages: {forward: 1, backward_input: 1, backward_weight: 1}\n",
                   encoding="utf-8")
    assert main(["solve", str(cfg), "--time-limit", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["validated"] is True and "validation" not in out
    monkeypatch.setattr(solvers, "VALIDATE_S_PER_OP", 1.0)  # 96 s needed, 5 s given
    assert main(["solve", str(cfg), "--time-limit", "5", "--json",
                 "-o", str(tmp_path / "s.json")]) == 0
    got = capsys.readouterr()
    out = json.loads(got.out)
    assert out["validated"] is False and out["validation"].startswith("skipped: ")
    assert "note: validation skipped" in got.err
    saved = json.loads((tmp_path / "s.json").read_text())
    assert saved["solver"]["details"]["validation"] == out["validation"]
    assert main(["solve", str(cfg), "--time-limit", "5"]) == 0
    assert "\nvalidation    skipped: " in capsys.readouterr().out


def test_schedule_json_is_the_generic_layout_of_the_document() -> None:
    """The writer's fast path (records formatted straight from the tuples) gives the text of
    the generic path, messages included; a time that is not a float takes the generic path."""
    from dataclasses import replace

    from pipeopt.io import format_json, schedule_json, schedule_to_dict
    from pipeopt.problem import chain_links
    from pipeopt.solvers import run_classic

    base = pipeopt.uniform_problem(devices=3, microbatches=4, latency=0.25, f=0.1)
    lat, bw = chain_links(3, [0.25, 0.25], [2.0, 2.0])  # messages occupy the links
    prob = base.replace(latency=lat, bandwidth=bw, message_size=(1.0, 1.0))
    for name in ("1f1b", "zb-h1", "gpipe"):
        sched = run_classic(prob, name)
        assert sched.messages
        assert schedule_json(sched) == format_json(schedule_to_dict(sched))
    ints = replace(sched, ops=tuple(o._replace(start=int(o.start)) for o in sched.ops[:1])
                   + sched.ops[1:])
    assert schedule_json(ints) == format_json(schedule_to_dict(ints))
