"""``auto``: the best schedule among the hand-made ones and the searches that fit the budget.

Candidates, in order: every hand-made schedule that keeps the memory limits (those published
with a fused backward also re-timed with B and W split, which is never slower; with
micro-batches of different cost each also run longest micro-batch first; CrossPipe's
latency-aware greedies ``crosspipe`` / ``crosspipe-v`` among them, so on slow links the best of
these is usually theirs and the searches start from it), the ``greedy`` list scheduler, then
``cpsat`` warm-started from the best so far when the instance is small enough for it to help
within the time limit (:func:`cpsat_skip_reason`; otherwise the reason is in
``details['skipped_cpsat']``). Where the full model is too large for the time left, CP-SAT runs
as large-neighbourhood search; on instances of at least :data:`RESTART_MIN_OPS` ops, and before
that search where several stages share a device and a link delays messages
(:func:`restarts_first`), the greedy's seeded restarts take most of the time left first
(:data:`RESTART_SHARE`), but for micro-batches of different cost, where its order search
takes that time (:data:`ORDER_SHARE`). On a problem cut into
sub-blocks, before the greedy: ``auto``'s answer for the uncut problem run piece by piece
(:func:`uncut_candidate`), so that cutting never loses to not cutting. The result is the
candidate with the best objective, so it is never worse than the best hand-made schedule under
the same limits, unless another candidate within ``time_tolerance`` of it (relative) needs less
peak memory: then the one with the lowest peak memory (``details['tradeoff']`` says what was
traded; ``details['pareto']`` lists the candidates no other beats on both time and peak memory,
:func:`pareto_set`). Its lower bound is the best proven one among the analytic bound, the
relaxation bound (:func:`_relaxation`), the kept-devices bound (:func:`_kept_devices`: a V
behind a slow link, micro-batches of equal or of different cost, or a large chain paced by
memory, :func:`kept_chain`) and the candidates that minimised the same objective.

Against a time limit: the first hand-made schedule that fits always runs (the floor: ``auto``
never ends without a schedule); the others, in :func:`classic_order` (CrossPipe's greedies
early where links delay), only within :data:`CLASSIC_SHARE` of the limit, the
greedy only while time is left, CP-SAT only when :func:`cpsat_skip_reason` finds none.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from pipeopt.bounds import makespan_lower_bound, memory_bound, stage_memory_bound
from pipeopt.clock import Stopwatch
from pipeopt.problem import Op, Problem, format_memory
from pipeopt.schedule import Schedule, SolverInfo
from pipeopt.schedules import COST_ESTIMATES, GENERATORS, NotApplicable, fused_variant
from pipeopt.simulate import ScheduleError, check, simulate
from pipeopt.solvers.base import (
    LONGEST_FIRST,
    MAX_MODEL_OPS,
    ChainGraphs,
    OutOfTime,
    Progress,
    SolveOptions,
    above,
    checked_known_bound,
    fifo_orders,
    fits_memory,
    known_bound_ignored,
    lower_bound,
    require_memory,
    run_classic,
)
from pipeopt.subblocks import expand_orders, merge

logger = logging.getLogger("pipeopt.auto")
logger.addHandler(logging.NullHandler())

#: Largest instance (number of ops) handed to CP-SAT: this many ops per second of time limit,
#: and never more than CPSAT_MAX_OPS. Measured with 2 workers on 2 cores, warm-started from the
#: greedy: at 384 ops CP-SAT proves optimality in 0.1-11 s; at 768 ops it improved the greedy
#: by 0.3 % in 10 s and 2.2 % in 30 s; at 1536-3072 ops by 0-0.2 % in 10-30 s.
CPSAT_OPS_PER_SECOND = 40.0
CPSAT_MAX_OPS = 4000
#: The least time worth handing to CP-SAT (seconds).
CPSAT_MIN_TIME_S = 1.0
#: The relaxation bound (:mod:`pipeopt.solvers.relaxation`) in auto: at most this share of the
#: time left and these seconds, on models of at most this many pair choices (CP-SAT proves its
#: optimum at 182 pairs, p = 4, m = 16, in 4 s and at 1,238, p = 8, m = 24, in 40 s on a loaded
#: 2-core machine), only where memory paces some stage and the best schedule so far is above
#: the analytic bound. Micro-batches of different cost too, where memory can bind at all, on
#: models of at most RELAX_MAX_VARIED_PAIRS (1.5 m (m - 1) pairs per later stage; text /
#: image mixes at p = 4, memory 1.5 times the largest activation, 10 s on a loaded 2-core
#: machine: 36-54 pairs proved their optimum in 0.3-4 s, 135 and 252 pairs raised the
#: analytic bound by 7.6 and 2.7 s, 405 pairs and p = 4, m = 16 of
#: ``benchmarks/variable_microbatches.py`` (1,080) proved nothing above it).
RELAX_SHARE = 0.2
RELAX_MAX_S = 10.0
RELAX_MAX_PAIRS = 2_000
#: Where the whole relaxation has more pair choices than :data:`RELAX_MAX_PAIRS`: the last
#: micro-batches alone (``relaxation_bound``'s window), as many as fit in this many pair
#: choices. At xdc p = 16, m = 64 that is the last 40 (7,989 pairs): 253.0-254.6 s in its
#: 10 s on a loaded 2-core machine, that model's optimum being 254.6 s; the
#: last 24 (3,256) prove their optimum, 253.8 s, in 5 s (benchmarks/README.md). Only on
#: instances of at least :data:`RESTART_MIN_OPS` ops, where the greedy's restarts, not CP-SAT's
#: full model, make the schedule: at ``search.py --families``' crosspipe p = 8, m = 32, lat8
#: (768 ops, 20 s, quiet machine) the window raised the bound 158.6 -> 160.2 s but took the
#: full model's time: 164.0 s twice against 162.4-163.2 s without it.
RELAX_WINDOW_PAIRS = 8_000
#: The most pair choices of the model for micro-batches of different cost (see above).
RELAX_MAX_VARIED_PAIRS = 300
#: The kept-devices bound (:mod:`pipeopt.solvers.kept_devices`) in auto: at most this share of
#: the time left and these seconds, the last KEPT_WINDOW micro-batches of ``kept_device``'s
#: device, only where a device holds several stages, some link delays messages (none shared)
#: and that device's memory bound is the analytic bound (:func:`_kept_devices`). Measured
#: (benchmarks/README.md, "Whole devices kept exactly"; 2-core machine, load 5-7):
#: ``crosspipe-v`` p = 8, m = 32, latency 8 x T_F, the last 16: 138.0 -> 148.1 s, the model's
#: optimum, in 1-3 s; p = 4, m = 8: 67.3 -> 72.5 s (the problem's optimum) in 0.2 s.
KEPT_SHARE = 0.15
KEPT_MAX_S = 3.0
KEPT_WINDOW = 16
#: The kept-devices bound on a chain (one stage per device) where memory sets the analytic
#: bound and the relaxation would keep only a window (:func:`kept_chain`): it runs instead of
#: that window, with the relaxation's time (:data:`RELAX_SHARE`, :data:`RELAX_MAX_S`), keeping
#: ``kept_device``'s device (the one whose memory paces) and the last KEPT_TAIL devices, the
#: last micro-batches that fit in KEPT_CHAIN_OPS intervals. Why the last devices: a chain's
#: device k must start B(k, i) within its round trip of F(k, i), which is shortest at the end
#: (F alone on the last device), so there F, B and W of consecutive micro-batches meet every
#: T_F + T_B + T_W and the device cannot lend the memory device's micro-batches the idle time
#: the dropped devices' least delays give them for free. Measured at xdc p = 16, m = 64
#: (benchmarks/README.md, "Whole devices kept exactly"; 2 workers, 2-core machine): devices
#: 0, 13, 14, 15 with the last 36 (432 intervals) or 38 prove 255.2 s, the model's optimum,
#: in 3.2-3.6 s at load 5; the last 40 as much in 7.7 s at load 0.5 but 20.5 s at load 5 (the
#: "yes" answers above 255.2 s take the time), the last 32 or 34 254.4 s in 0.3 s; the
#: relaxation's window reaches 254.6 s in its 10 s. Other sets (last 40): devices 0, 14, 15
#: 254.6 s; 0, 12-15 255.2 s not settled in 60 s; 13-15 alone or 0 alone the analytic 253 s.
#: At p = 12, m = 48 (devices 0, 9, 10, 11) both reach 207.4 s in 10 s (analytic 205.8).
KEPT_TAIL = 3
KEPT_CHAIN_OPS = 432
#: Micro-batches of different cost (no window: every micro-batch is kept): only models of at
#: most this many intervals, the size of the window's model on a V (2 stages x 16 x 3).
#: Measured (tests/test_bounds_kept_devices.py; 2 workers, load 5): a V p = 4, m = 8, three
#: images among texts, latency 8 s, device 3 (48 intervals): 54.34 -> 54.92 s, its optimum,
#: in 0.1 s; p = 2, m = 6 (36): 19.16 -> 21.6 s in 10 s, unsettled.
KEPT_VARIED_MAX_OPS = 96
#: Instances of at least this many ops where CP-SAT would run (its full model, or
#: large-neighbourhood search where the full model is too large for the time left):
#: :data:`RESTART_SHARE` of the time left goes to the greedy's seeded restarts
#: (:func:`pipeopt.solvers.greedy.restart_search`) first, and CP-SAT starts from their best
#: (the full model if it still fits the time left, else LNS). Measured on
#: ``benchmarks/search.py``'s cross-datacenter chains (2 cores, load average 10-14): at p = 16,
#: m = 64 (3,072 ops) LNS windows took 4-15 s each and moved the greedy's 270.4 s to 270.2 s in
#: 56 s, where restarts reached 265.8 s in 40 s; at p = 32, m = 128 LNS found nothing in 115 s,
#: restarts 476.0 s from 481.8 s in 60 s. At p = 12, m = 48 (1,728 ops; latency 8 or 5.9 T_F)
#: the full model ran for the whole 60 s and found nothing better than ``crosspipe``'s 215.6 /
#: 200.8 s, restarts alone reached 214.6 / 198.4 s in 45 s. At 1,536 ops and below
#: (``--families --quick``) LNS windows take a fraction of a second and improve the greedy on
#: most instances, and at 768 ops (p = 8, m = 32) CP-SAT and restarts end level (163.4 / 163.6 s
#: at latency 8 T_F, 130.6 / 130.4 s at 3.8 T_F), so those keep all the time for CP-SAT.
#: Below it, V's behind a slow link take the restarts before LNS too (:func:`restarts_first`).
RESTART_MIN_OPS = 1600
RESTART_SHARE = 0.75
#: Micro-batches of different cost on instances where the restarts and LNS would follow the
#: greedy (:data:`RESTART_MIN_OPS` ops or more, CP-SAT's full model too large for the time
#: left, but CP-SAT installed and the instance within its largest model:
#: :func:`_cpsat_can_follow`): the greedy's order search runs until this share of the time
#: left, with its rounds (``order_share`` of :func:`pipeopt.solvers.greedy.solve_greedy`),
#: and the restarts are skipped; LNS gets the rest. There the restarts run the given
#: micro-batch order, trail the greedy and never win. A class apart (as images among texts;
#: the greedy's block orders run): the chains of the greedy alone. ``benchmarks/
#: variable_microbatches.py``'s p = 16, m = 64 text / image (3,072 ops, 30 s, load 4):
#: restarts 213.9 s, LNS 168.6 s from the greedy's 168.6 s; with the greedy's long search
#: (0.85 of the time, longer chains) ``auto`` trailed the greedy alone (167.8 against 164.9 s,
#: quiet machine); with this share it runs the greedy alone's search with more time (the same
#: chains and seeds): 164.73 s in three runs at load 1.2-1.6, against 168.61 s before. Not a
#: class apart: the long search's chains, then rounds from their best order while a round
#: finds a better one. p = 12, m = 48 and p = 16, m = 64 lognormal there (1,728 / 3,072 ops,
#: 30 s, 2 workers, load 0.4-1.0, two pairs back to back): restarts 99.5 / 253.2 s against
#: the greedy's 77.82 / 218.77 s before; now ``auto`` 77.82 -> 77.82 s (the second round
#: finds nothing; LNS has the rest and moves nothing, as with all the time) and 218.77 ->
#: 218.22 s (the rounds improve until 23 s) (benchmarks/README.md).
ORDER_SHARE = 0.95
#: Share of the time limit the hand-made schedules may take before the rest are skipped (once
#: one fits): on huge instances each is a full simulation (1-3 s at 786k ops).
CLASSIC_SHARE = 0.3
#: Hand-made schedules in the order ``auto`` tries them: those that split the backward (usually
#: the best) first, so a time limit that cuts the list short keeps the likely best.
AUTO_ORDER = ("zb-v", "zb-h1", "zb-h2", "interleaved-1f1b", "1f1b", "looped-bfs", "gpipe")
#: Where some link delays its messages, CrossPipe's latency-aware greedies go right after the
#: first two of :data:`AUTO_ORDER` (ZB-V for two chunks, ZB-H1 for one: the floor, cheap at any
#: size), so a short limit that cuts the list keeps them:
#: ``benchmarks/search.py --families --quick`` at a 3 s limit on a loaded machine skipped them
#: and ``auto`` was 0.1-9 % slower than ``crosspipe`` / ``crosspipe-v`` on 4 of its 6
#: cross-datacenter instances; with this order on 3 (the V ones: ``crosspipe-v``'s own
#: estimated time, about 1 s there, is still over the share of a 3 s limit).
LATENCY_AWARE = ("crosspipe", "crosspipe-v")
#: Share of ``auto``'s time limit spent on the uncut problem of a problem cut into sub-blocks
#: (:func:`uncut_candidate`). Its answer, run piece by piece, is a schedule of the cut problem
#: as fast as the uncut one, so cutting never makes ``auto`` slower than not cutting with this
#: share of the time; the searches over the pieces alone, with 5 s, were up to 2.6 % slower
#: than the uncut ``auto`` on CrossPipe's cross-datacenter family (``benchmarks/crosspipe.py
#: --sub-blocks 1,2,4``, 2026-12-04). Half: the other half goes to the searches over the
#: pieces, warm-started from it.
UNCUT_SHARE = 0.5


def classic_order(problem: Problem) -> list[str]:
    """The hand-made schedules in the order ``auto`` tries them (see :data:`AUTO_ORDER` and
    :data:`LATENCY_AWARE`)."""
    order = [n for n in AUTO_ORDER if n in GENERATORS] + [n for n in GENERATORS
                                                         if n not in AUTO_ORDER]
    delayed = any(problem.delay(k, k + 1) > 0 or problem.delay(k + 1, k) > 0
                  for k in range(problem.stages - 1))
    if delayed:
        ahead = [n for n in LATENCY_AWARE if n in order]
        rest = [n for n in order if n not in ahead]
        order = rest[:2] + ahead + rest[2:]
    return order


def _value(schedule: Schedule, objective: str) -> float:
    return schedule.max_span if objective == "span" else schedule.iteration_time


def _pick(cands: list[Schedule], objective: str, problem: Problem) -> Schedule:
    """The best candidate; among those equal up to float rounding, prefer a schedule of
    ``problem`` itself (not its fused-backward variant), then a proven one, then the first."""
    top = min(_value(s, objective) for s in cands)
    tied = [s for s in cands if _value(s, objective) <= top * (1 + 1e-9) + 1e-12]
    return min(tied, key=lambda s: (s.problem.split_backward != problem.split_backward,
                                    s.solver.status != "optimal"))


def _lean(cands: list[Schedule], fastest: Schedule, objective: str,
          tolerance: float) -> Schedule:
    """Among ``cands`` whose objective is within ``tolerance`` (relative) of ``fastest``'s, the
    one with the lowest max peak memory (bytes), the faster on a tie; ``fastest`` unless another
    needs strictly less."""
    if tolerance <= 0:
        return fastest
    limit = _value(fastest, objective) * (1 + tolerance) + 1e-12
    near = [s for s in cands if _value(s, objective) <= limit]
    lean = min(near, key=lambda s: (max(s.peak_memory, default=0.0), _value(s, objective)))
    if max(lean.peak_memory, default=0.0) < max(fastest.peak_memory, default=0.0):
        return lean
    return fastest


def pareto(points: Sequence[tuple[float, float]]) -> list[bool]:
    """For each (time, memory) point, whether it is on the Pareto set: no other point is at
    least as good on both and better on one (equal points do not dominate each other).

    Quadratic in the number of points, which are a handful of candidates or compare rows.
    """
    return [not any(a <= t and b <= m and (a, b) != (t, m) for a, b in points)
            for t, m in points]


def pareto_set(cands: Sequence[Schedule], objective: str = "makespan"
               ) -> tuple[tuple[str, float, float], ...]:
    """The candidates that no other beats on both iteration time (or max span with
    ``objective="span"``, seconds) and max peak memory over devices (the problem's memory unit:
    bytes in the model form), as (method, time, memory), fastest first."""
    points = [(_value(s, objective), max(s.peak_memory, default=0.0)) for s in cands]
    front = {(s.method, *pt) for s, pt, on in zip(cands, points, pareto(points), strict=True)
             if on}
    return tuple(sorted(front, key=lambda x: (x[1], x[2], x[0])))


def _tradeoff(chosen: Schedule, fastest: Schedule, objective: str) -> str:
    """One line: how much slower ``chosen`` is than ``fastest`` and how much memory it saves."""
    top = _value(fastest, objective)
    slower = _value(chosen, objective) / top - 1 if top > 0 else 0.0
    saved = format_memory(max(fastest.peak_memory) - max(chosen.peak_memory), chosen.problem,
                          ".1f")
    return (f"chose {chosen.method}: {slower:.1%} slower, {saved} less peak memory than the "
            f"fastest, {fastest.method} (solver.time_tolerance)")


def best_classic(problem: Problem, objective: str = "makespan") -> Schedule | None:
    """The best hand-made schedule that keeps the memory limits, or None if none does (with
    micro-batches of different cost, each in the given order and longest first)."""
    best: Schedule | None = None
    graphs = ChainGraphs()
    for name, mb_order in ((n, o) for n in GENERATORS for o in fifo_orders(problem)):
        try:
            sched = run_classic(problem, name, order=mb_order, graphs=graphs)
        except (NotApplicable, ScheduleError):
            continue  # ScheduleError: a generator whose orders deadlock here (a bug to report)
        if not fits_memory(sched, problem):
            continue
        if best is None or _value(sched, objective) < _value(best, objective):
            best = sched
    return best


def split_fused(schedule: Schedule, problem: Problem, graphs: ChainGraphs | None = None
                ) -> Schedule | None:
    """A hand-made schedule that was timed with a fused backward, re-timed on ``problem`` with
    each backward split into B then W in place (None when ``problem`` does not split it).
    ``graphs``: the caller's task graphs, when it times several schedules of ``problem``.

    The device orders stay the same; the input gradient leaves after B instead of after B + W,
    so no op starts later and no memory is held longer: never worse than the fused timing.
    """
    if not problem.split_backward or schedule.problem.split_backward:
        return None
    orders = []
    for order in schedule.device_orders():
        out = []
        for op in order:
            out.append(op)
            if op.kind == "B":
                out.append(Op("W", op.stage, op.microbatch))
        orders.append(out)
    sched = simulate(problem, orders, method=f"{schedule.method}+split",
                     graph=None if graphs is None else graphs.of(problem))
    return replace(sched, solver=replace(schedule.solver, details=(
        *schedule.solver.details, ("split_from", schedule.method))))


def cpsat_skip_reason(problem: Problem, time_limit: float) -> str | None:
    """Why CP-SAT is not worth running on ``problem`` with ``time_limit`` seconds, or None."""
    n = problem.num_ops
    if time_limit <= 0:
        return "the time limit is used up"
    cap = min(CPSAT_MAX_OPS, CPSAT_OPS_PER_SECOND * time_limit)
    if n > cap:
        return (f"{n} ops > {cap:g} (CP-SAT handles about {CPSAT_OPS_PER_SECOND:g} ops per "
                f"second of time limit, at most {CPSAT_MAX_OPS}); the greedy covers it")
    if time_limit < CPSAT_MIN_TIME_S:
        return f"{time_limit:.2f} s left < {CPSAT_MIN_TIME_S:g} s"
    return None


def _cpsat_can_follow(problem: Problem) -> bool:
    """Could CP-SAT (its full model or LNS) run on ``problem`` after the greedy: OR-Tools is
    installed (looked up, not imported: the import takes a second of the limit) and the
    instance is within :data:`~pipeopt.solvers.base.MAX_MODEL_OPS`."""
    return (problem.num_ops <= MAX_MODEL_OPS
            and importlib.util.find_spec("ortools") is not None)


def _load(module: str, func: str) -> Callable[..., Schedule] | None:
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError):
        return None


def _relaxation(problem: Problem, obj: str, best: Schedule | None, time_left: float,
                workers: int | None) -> float | None:
    """The relaxation bound on the iteration time (it bounds the makespan, which the
    iteration time includes) where worth its time (see :data:`RELAX_SHARE`), else None."""
    if obj != "makespan" or best is None or problem.num_ops > CPSAT_MAX_OPS:
        return None
    budget = min(RELAX_MAX_S, RELAX_SHARE * time_left)
    if budget < CPSAT_MIN_TIME_S or _value(best, obj) <= lower_bound(problem, obj) * (1 + 1e-9):
        return None
    if problem.uniform_microbatches:
        paced = any(x > 0 for x in stage_memory_bound(problem))  # what the relaxation models
    else:
        # Micro-batches of different cost: the analytic memory bound sees little of what
        # memory forces on them (tests/test_bounds_relaxation.py: 0 where the relaxation
        # proves 40 % more than the analytic bound), so wherever memory can bind at all.
        binds = _load("pipeopt.solvers.relaxation", "memory_can_bind")
        paced = binds is not None and bool(binds(problem))
    if not paced:
        return None
    bound = _load("pipeopt.solvers.relaxation", "relaxation_bound")
    if bound is not None and not problem.uniform_microbatches:  # no window for these
        varied: Any = bound(problem, time_limit=budget, workers=workers,
                            max_pairs=RELAX_MAX_VARIED_PAIRS)
        return None if varied is None else float(varied.value)
    fit: Any = _load("pipeopt.solvers.relaxation", "largest_window")
    if bound is None or fit is None:
        return None
    window = None
    if fit(problem, RELAX_MAX_PAIRS) < problem.microbatches:  # the last rounds alone,
        # only on large instances (below, the time is the full model's: RELAX_WINDOW_PAIRS)
        # and where a stage's own memory sets the makespan's analytic bound (not
        # lower_bound's "makespan", which adds grad_reduce): the window's F starts carry that
        # bound's recursion, and elsewhere the time is the search's (the V's of
        # benchmarks/search.py --families, whose bound is their device work). On a chain
        # the kept-devices bound takes this case (:func:`kept_chain`: more in the same time).
        if not _window_worth_it(problem) or kept_chain(problem) is not None:
            return None
        window = fit(problem, RELAX_WINDOW_PAIRS)
    got: Any = bound(problem, time_limit=budget, workers=workers, window=window,
                     max_pairs=max(RELAX_MAX_PAIRS, RELAX_WINDOW_PAIRS))
    return None if got is None else float(got.value)


def _window_worth_it(problem: Problem) -> bool:
    """Whether a bound over the last micro-batches alone is worth auto's time: a large
    instance (:data:`RESTART_MIN_OPS` ops or more: the greedy's restarts, not CP-SAT's full
    model, make the schedule there) whose makespan's analytic bound some stage's memory sets
    (the window's F starts carry that bound's recursion)."""
    return (problem.num_ops >= RESTART_MIN_OPS and max(stage_memory_bound(problem))
            >= makespan_lower_bound(problem) * (1 - 1e-9))


def kept_chain(problem: Problem) -> tuple[tuple[int, ...], int | None] | None:
    """The devices and window (None: every micro-batch) auto keeps for the kept-devices bound
    on a chain, or None where that case does not apply (:data:`KEPT_TAIL`): one stage per
    device, at least KEPT_TAIL + 2 devices, identical micro-batches and no shared link, memory
    setting the analytic bound on a large instance (:func:`_window_worth_it`) where the
    relaxation's whole model is too large (:data:`RELAX_MAX_PAIRS`). The devices are
    ``kept_device``'s and the last KEPT_TAIL; the window the most micro-batches whose model
    has at most :data:`KEPT_CHAIN_OPS` intervals."""
    if (KEPT_TAIL < 1 or problem.devices < KEPT_TAIL + 2 or not problem.uniform_microbatches
            or problem.has_link_contention
            or any(len(stages) != 1 for stages in problem.device_stages)
            or not _window_worth_it(problem)):
        return None
    pick: Any = _load("pipeopt.solvers.kept_devices", "kept_device")
    fit: Any = _load("pipeopt.solvers.relaxation", "largest_window")
    if pick is None or fit is None or fit(problem, RELAX_MAX_PAIRS) >= problem.microbatches:
        return None
    p = problem.devices
    devices = tuple(sorted({int(pick(problem)), *range(p - KEPT_TAIL, p)}))
    per_mb = len(devices) * (3 if problem.split_backward else 2)  # intervals per micro-batch
    window = max(1, KEPT_CHAIN_OPS // per_mb)
    return devices, (window if window < problem.microbatches else None)


def _known(options: SolveOptions, relaxed: float | None, best: Schedule | None
           ) -> float | None:
    """The larger of auto's own proven bound ``relaxed`` and the caller's
    ``options.known_bound`` (seconds), or None when neither is known. The caller's is refused
    (:class:`~pipeopt.errors.ConfigError` naming it) when ``best``, a real schedule, is already
    below it: it is then no lower bound."""
    given = (checked_known_bound(options, "", None) if best is None else
             checked_known_bound(options, best.method, _value(best, options.objective)))
    return relaxed if given is None else max(given, relaxed or 0.0)


def restarts_first(problem: Problem, lns_only: bool) -> bool:
    """Whether the greedy's seeded restarts run before CP-SAT (``lns_only``: only its
    large-neighbourhood search would run, the full model being too large for the time left).

    From :data:`RESTART_MIN_OPS` ops always; below, only before LNS on problems with several
    model chunks on a device (``virtual_stages > 1``: V's, interleaved; a chain cut into
    sub-blocks alone was not measured) and a link that delays messages (latency or
    transmission; :attr:`Problem.has_link_delay`). The restarts end :data:`CPSAT_MIN_TIME_S`
    before the limit, so CP-SAT's least run still fits in it. Measured at 20 s, 2 workers,
    two runs each (``benchmarks/README.md``, ``wip-vrestart``): ``crosspipe-v`` p = 8,
    m = 32 (1,536 ops: LNS) lat2 / lat8 / bw2 111.6 / 161.3 / 141.4 s without them, 110.9 /
    160.5-160.6 / 140.5 s with them; without a link delay they cost LNS time (V-Half
    106.7-107.0 s against 107.5, V-Min 117.0-118.2 against 117.9-118.1); where the full model
    runs (the p = 4 analogues, 192-384 ops) it did better from the greedy (m = 16 lat8
    120.8-122.0 s, lat2 60.5) than from the restarts (122.3-122.4, 60.8).
    """
    if problem.num_ops >= RESTART_MIN_OPS:
        return True
    return lns_only and problem.virtual_stages > 1 and problem.has_link_delay


def _kept_devices(problem: Problem, obj: str, best: Schedule | None, time_left: float,
                  workers: int | None) -> float | None:
    """The kept-devices bound on the makespan (so on the iteration time, which includes it,
    seconds) where worth its time (see :data:`KEPT_SHARE`), else None.

    The gates: on a chain, :func:`kept_chain`'s devices and window where it applies (instead
    of the relaxation's window, with its time: :data:`KEPT_TAIL`); else a V-like placement
    (some device holds several stages) with a link that delays messages and none shared, and
    either identical micro-batches with the memory of ``kept_device``'s device setting the
    analytic bound (there the device's interleaved chunks and memory hold what the analytic
    recursion misses), or micro-batches of different cost in a model of at most
    :data:`KEPT_VARIED_MAX_OPS` intervals (every micro-batch kept: its device's work is in the
    model, memory binding or not). Everywhere else (among them every chain of micro-batches of
    different cost, so every instance of ``benchmarks/variable_microbatches.py``) this returns
    None at once.
    """
    if obj != "makespan" or best is None:
        return None
    chain = kept_chain(problem) if problem.num_ops <= CPSAT_MAX_OPS else None
    if chain is None and (problem.has_link_contention
                          or all(len(stages) < 2 for stages in problem.device_stages)
                          or not problem.has_link_delay):
        return None
    # A chain's case runs instead of the relaxation's window, with its time.
    budget = (min(RELAX_MAX_S, RELAX_SHARE * time_left) if chain is not None
              else min(KEPT_MAX_S, KEPT_SHARE * time_left))
    bound: Any = _load("pipeopt.solvers.kept_devices", "kept_devices_bound")
    if (bound is None or budget < CPSAT_MIN_TIME_S
            or _value(best, obj) <= lower_bound(problem, obj) * (1 + 1e-9)):
        return None
    extra: dict[str, Any] = {}
    if chain is not None:
        devices, window = chain
    else:
        kept: Any = _load("pipeopt.solvers.kept_devices", "kept_device")
        if kept is None:
            return None
        devices, window = (int(kept(problem)),), None
        if not problem.uniform_microbatches:  # no window: the whole device, if small enough
            extra["max_ops"] = KEPT_VARIED_MAX_OPS
        elif memory_bound(problem)[devices[0]] < makespan_lower_bound(problem) * (1 - 1e-9):
            return None  # the bound is work or warm-up, which the window cannot see
        elif problem.microbatches > KEPT_WINDOW:
            window = KEPT_WINDOW
    got: Any = bound(problem, devices, time_limit=budget, workers=workers, window=window,
                     **extra)
    return None if got is None else float(got.value)


def _restarts(problem: Problem, options: SolveOptions, cands: list[Schedule],
              notes: list[tuple[str, Any]], deadline: float) -> bool:
    """The greedy's seeded restarts until ``deadline`` (a :func:`time.perf_counter` value),
    their best added to ``cands`` (see :data:`RESTART_MIN_OPS`); whether Ctrl-C stopped them."""
    restart = _load("pipeopt.solvers.greedy", "restart_search")
    if restart is None:
        return False
    try:
        got = restart(problem, options, deadline)
    except KeyboardInterrupt:
        return True
    if got is None:
        notes.append(("greedy_restarts", "no run ended in the time given to them"))
        return False
    if fits_memory(got, problem):
        cands.append(got)
    return bool(got.solver.detail("interrupted"))


def uncut_candidate(problem: Problem, options: SolveOptions) -> Schedule | None:
    """For a problem cut into sub-blocks: ``auto`` on its uncut problem
    (:func:`pipeopt.subblocks.merge`) within :data:`UNCUT_SHARE` of the time limit, each op
    then run piece by piece (:func:`pipeopt.subblocks.expand_orders`): the same makespan, a
    schedule of ``problem`` (of its fused variant when the uncut answer fuses the backward).
    Its status is ``heuristic`` and its bound ``problem``'s own: the uncut problem's bound
    does not hold once ops may be cut. None when nothing fits the uncut problem."""
    whole = merge(problem)
    try:
        sched = solve_auto(whole, replace(options, time_limit=UNCUT_SHARE * options.time_limit,
                                          on_progress=None, hint=None))
    except (NotApplicable, OutOfTime):
        return None
    target = problem if sched.problem.split_backward == whole.split_backward else (
        fused_variant(problem))
    orders = expand_orders(target, sched.device_orders())
    label = "uncut-" + sched.method.removeprefix("auto:")
    cut = simulate(target, orders, method=label)
    info = SolverInfo(status="heuristic", lower_bound=lower_bound(problem, options.objective),
                      wall_time=sched.solver.wall_time, objective=options.objective,
                      details=(("uncut_status", sched.solver.status),
                               ("uncut_lower_bound", sched.solver.lower_bound)))
    return replace(cut, solver=info)


def solve_auto(problem: Problem, options: SolveOptions) -> Schedule:
    """Best of: every hand-made schedule that fits, ``greedy``, and ``cpsat`` when it is present
    and the instance is small enough (:func:`cpsat_skip_reason`).

    Method name ``auto:<chosen>``. Status ``optimal`` only when a candidate proved it or the
    best objective meets the lower bound. Raises :class:`NotApplicable` when nothing fits.
    """
    t0 = time.perf_counter()
    watch = Stopwatch(t0, time.process_time())
    require_memory(problem, "auto")  # fail fast, with the least limits that would work
    obj = options.objective
    cands: list[Schedule] = []
    notes: list[tuple[str, Any]] = []
    classics = []
    order = classic_order(problem)
    # Micro-batches of different cost: each hand-made schedule in the given order and longest
    # micro-batch first (the usual remedy: the long ones fill the pipeline while it starts).
    mb_orders = fifo_orders(problem)
    graphs = ChainGraphs()  # built once per problem timed, shared by the hand-made schedules
    for name, mb_order in ((n, o) for n in order for o in mb_orders):
        label = name if mb_order is None else name + LONGEST_FIRST
        if classics and time.perf_counter() - t0 > CLASSIC_SHARE * options.time_limit:
            notes.append((f"classic_{label}", "skipped: time limit"))
            continue
        cost = COST_ESTIMATES[name](problem) if name in COST_ESTIMATES else 0.0
        cost *= watch.slowdown()  # an estimate of CPU work, in this run's wall seconds
        if classics and time.perf_counter() - t0 + cost > CLASSIC_SHARE * options.time_limit:
            notes.append((f"classic_{label}", f"skipped: would take about {cost:.3g} s"))
            continue
        try:
            # Orders over the memory limits are dropped before they are timed; their split
            # re-timing holds the same peak (each W right after its B), so it would not fit
            # either.
            sched = run_classic(problem, name, require_fit=True, order=mb_order,
                                graphs=graphs)
            split = split_fused(sched, problem, graphs)
            classics += [s for s in (split, sched) if s is not None and fits_memory(s, problem)]
        except NotApplicable:
            continue
        except ScheduleError as exc:  # a generator whose orders deadlock: skip it, say so
            notes.append((f"classic_{label}", f"skipped, invalid orders: {exc}"))
            continue
    del graphs  # the searches below hold memory of their own: the graphs go now, not at return
    if classics:
        # The best hand-made schedule, or its split-backward re-timing when that is better (the
        # others stay in ``classics``, for the memory trade-off at the end).
        cands.append(_pick(classics, obj, problem))
        logger.info("auto: %d hand-made schedules fit the memory limits; best %s: %.6g s",
                    len(classics), cands[-1].method, _value(cands[-1], obj))
    else:
        notes.append(("classic", "no hand-made schedule fits the memory limits"))
        logger.info("auto: no hand-made schedule fits the memory limits")

    if problem.sub_blocks > 1:
        # The uncut problem's answer run piece by piece: never slower than not cutting.
        uncut = uncut_candidate(problem, options)
        if uncut is not None and fits_memory(uncut, problem):
            cands.append(uncut)
        else:
            notes.append(("uncut", "no schedule of the uncut problem fits the memory limits"))

    def best_so_far() -> Schedule | None:
        return _pick(cands, obj, problem) if cands else None

    def left() -> float:
        return options.time_limit - (time.perf_counter() - t0)

    def report() -> None:  # the best candidate so far, for a progress display
        best = best_so_far()
        if options.on_progress is not None and best is not None:
            options.on_progress(Progress(time.perf_counter() - t0, _value(best, obj),
                                         lower_bound(problem, obj)))

    report()

    interrupted = order_first = False
    # With a schedule in hand and the limit spent, the greedy would only give up (after
    # building its tables: a second at a million ops); the hand-made schedule is the answer.
    spent = bool(cands) and left() <= 0
    greedy = None if spent else _load("pipeopt.solvers.greedy", "solve_greedy")
    if spent:
        notes.append(("greedy", f"skipped: auto's {options.time_limit:.3g} s were spent on "
                                "the hand-made schedules"))
    if greedy is not None:
        try:
            # With a hand-made schedule in hand the greedy may give up at the time limit.
            # When CP-SAT's full model would not run in the half of the time the greedy
            # leaves, only its neighbourhood search would follow: the greedy's search over
            # micro-batch orders gets most of the time instead (see greedy._LONG_SHARE).
            limit = max(0.1, left())
            long_search = cpsat_skip_reason(problem, 0.5 * limit) is not None
            # Where the restarts (in the given micro-batch order) and LNS would follow, the
            # order search takes ORDER_SHARE of the limit instead (its details say
            # "order_share" where it ran: not where the greedy met the bound first).
            share = (ORDER_SHARE if long_search and not problem.uniform_microbatches
                     and problem.num_ops >= RESTART_MIN_OPS and _cpsat_can_follow(problem)
                     else None)
            cands.append(greedy(problem, replace(options, time_limit=limit),
                                optional=bool(cands), long_search=long_search,
                                order_share=share))
            order_first = cands[-1].solver.detail("order_share") is not None
            interrupted = bool(cands[-1].solver.detail("interrupted"))
        except (NotApplicable, OutOfTime) as exc:
            notes.append(("greedy", str(exc)))
        except KeyboardInterrupt:
            if not any(fits_memory(s, problem) for s in cands):
                raise
            interrupted = True  # Ctrl-C: keep the best so far (a hand-made schedule)
        report()

    relaxed: float | None = None
    if not interrupted:
        try:
            relaxed = _relaxation(problem, obj, best_so_far(), left(), options.workers)
        except KeyboardInterrupt:
            if not any(fits_memory(s, problem) for s in cands):
                raise
            interrupted = True
    if relaxed is not None:
        notes.append(("relaxation_bound", relaxed))
    if not interrupted:
        try:
            kept = _kept_devices(problem, obj, best_so_far(), left(), options.workers)
        except KeyboardInterrupt:
            if not any(fits_memory(s, problem) for s in cands):
                raise
            interrupted, kept = True, None
        if kept is not None:
            notes.append(("kept_devices_bound", kept))
            relaxed = max(kept, relaxed or 0.0)
    # The best bound proven so far beyond the analytic one: auto's own and the caller's.
    known = _known(options, relaxed, best_so_far())
    proved = (known is not None and best_so_far() is not None
              and known >= _value(best_so_far(), obj) * (1 - 1e-9))
    reason = ("interrupted" if interrupted else
              "a relaxation bound proves the best so far optimal" if proved else
              cpsat_skip_reason(problem, left()))

    def model_fits() -> bool:  # CP-SAT is installed and takes a model this size (imports it)
        return problem.num_ops <= (_load("pipeopt.solvers.cpsat", "MAX_MODEL_OPS") or 0)

    # Too large for the full model in the time left but not for a model at all: the remaining
    # time goes to large-neighbourhood search around the best so far (cpsat, full model skipped).
    lns_only = (reason is not None and not interrupted and not proved
                and left() >= CPSAT_MIN_TIME_S and model_fits())
    if lns_only:
        notes.append(("cpsat_full_model", reason))
        reason = None
    # On large instances the greedy's seeded restarts come first, whichever CP-SAT stage (full
    # model or LNS) follows: neither improves the greedy much there in the time a limit gives;
    # so on V's behind a slow link where only LNS would run (restarts_first).
    if order_first and reason is None:
        notes.append(("greedy_restarts", "skipped: the greedy's order search took their time "
                      "(they run the given micro-batch order)"))
    elif (reason is None and restarts_first(problem, lns_only)
            and (lns_only or model_fits())):
        # CP-SAT runs at least CPSAT_MIN_TIME_S: the restarts leave it that much of the limit.
        budget = min(RESTART_SHARE * left(), left() - CPSAT_MIN_TIME_S)
        interrupted = _restarts(problem, options, cands, notes, time.perf_counter() + budget)
        report()
        full = None if lns_only or interrupted else cpsat_skip_reason(problem, left())
        if interrupted:
            reason = "interrupted"
        elif full is not None:  # the full model no longer fits the time left: LNS instead
            notes.append(("cpsat_full_model", full))
            lns_only = True
    # Loaded only when it will run: importing OR-Tools takes a second of the time limit.
    cpsat = (_load("pipeopt.solvers.cpsat", "solve_lns" if lns_only else "solve_cpsat")
             if reason is None else None)
    if interrupted:
        notes.append(("skipped_cpsat", "interrupted"))
    elif reason is None and cpsat is None:
        notes.append(("skipped_cpsat", "pipeopt.solvers.cpsat is not available"))
    else:
        if reason is not None:
            notes.append(("skipped_cpsat", reason))
            logger.info("auto: CP-SAT skipped: %s", reason)
        elif cpsat is not None:
            logger.info("auto: CP-SAT for the remaining %.1f s, warm-started from %s",
                        max(CPSAT_MIN_TIME_S, left()), best_so_far().method
                        if best_so_far() is not None else "nothing")
            # Only bounds proven above (relaxation, kept devices, the caller's): CP-SAT stops
            # as soon as a schedule meets them instead of searching on to the limit.
            try:
                sched = cpsat(problem, replace(options, time_limit=max(CPSAT_MIN_TIME_S, left()),
                                               hint=best_so_far(), known_bound=known))
            except NotApplicable as exc:
                notes.append(("cpsat", str(exc)))
            else:
                problems = check(sched)
                if problems:
                    notes.append(("cpsat", f"rejected an invalid schedule: {problems[0]}"))
                else:
                    cands.append(sched)
                interrupted = bool(sched.solver.detail("interrupted"))
    cands = [s for s in cands if fits_memory(s, problem)]
    if not cands:
        why = "; ".join(f"{k}: {v}" for k, v in notes) or "nothing fits"
        raise NotApplicable(f"auto: no method found a schedule within the memory limits ({why})")

    fastest = _pick(cands, obj, problem)
    own = [s for s in classics if s.problem.split_backward == problem.split_backward]
    pool = list({id(s): s for s in (*cands, *own)}.values())  # the best classic is in both
    best = _lean(pool, fastest, obj, options.time_tolerance)
    if best is not fastest:
        notes.append(("tradeoff", _tradeoff(best, fastest, obj)))
    # Time against memory: what another solver.time_tolerance would pick (the chosen one is
    # on it unless the tolerance is 0 and an equally fast candidate needs less memory).
    notes.append(("pareto", pareto_set(pool, obj)))
    val = _value(best, obj)
    proven = [s.solver.lower_bound for s in cands
              if s.solver.lower_bound is not None and s.solver.objective == obj
              and s.solver.status in ("optimal", "feasible")]
    wrong = options.known_bound is not None and above(options.known_bound, val)
    if wrong:
        # Above a schedule found: the caller's bound was no lower bound (see _known).
        notes.append(known_bound_ignored(options.known_bound, obj, val))
        known = relaxed
        proven = [] if relaxed is None else [relaxed]  # the searches' bounds held it too
    bound = max([lower_bound(problem, obj), *proven, *([known] if known else [])])
    # A search that proved optimality for the same objective bounds it by its own value.
    for s in cands:
        if s.solver.status == "optimal" and s.solver.objective == obj and not wrong:
            bound = max(bound, _value(s, obj))
    bound = min(bound, val) if math.isfinite(bound) else bound
    status = best.solver.status
    if interrupted:
        notes.append(("interrupted", True))
    if bound >= val * (1 - 1e-9):
        status = "optimal"
    elif status == "optimal" and best.solver.objective != obj:
        status = "feasible"
    summary = tuple((s.method, _value(s, obj)) for s in cands)
    logger.info("auto: chose %s, %.6g s (candidates: %s); lower bound %.6g s, %s", best.method,
                val, ", ".join(f"{m} {v:.6g}" for m, v in summary), bound, status)
    for key, note in notes:
        if key.startswith(("classic_", "greedy", "cpsat")):
            logger.info("auto: %s: %s", key, note)
    info = replace(best.solver, lower_bound=bound, status=status,
                   wall_time=time.perf_counter() - t0, objective=obj,
                   details=(*best.solver.details, ("chosen", best.method),
                            ("candidates", summary), *notes))
    return best.relabel(method=f"auto:{best.method}", solver=info)
