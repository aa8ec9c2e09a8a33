"""What every method of :mod:`pipeopt.solvers` shares: the options, progress reports, memory
checks and the timing of hand-made schedules (in the given or another micro-batch order).

The searches (:mod:`~pipeopt.solvers.greedy`, :mod:`~pipeopt.solvers.cpsat`,
:mod:`~pipeopt.solvers.auto`) import these from here, never from the package: the package's
``solve`` names them in its method table, so it sits above them. Every name here is also
importable from :mod:`pipeopt.solvers`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pipeopt._gc import cyclic_gc_paused
from pipeopt.bounds import Objective, lower_bound
from pipeopt.errors import ConfigError, check_solver_option
from pipeopt.problem import Problem
from pipeopt.schedule import Schedule, SolverInfo, order_peak_memory
from pipeopt.schedules import FUSED_BACKWARD, NotApplicable, fused_variant, generate
from pipeopt.simulate import simulate
from pipeopt.workloads.training import ChainGraph, chain_graph

__all__ = [
    "LONGEST_FIRST", "MAX_MODEL_OPS", "ChainGraphs", "Method", "Objective", "OutOfTime",
    "Progress", "SolveOptions", "fifo_orders", "fits_memory", "longest_first", "lower_bound",
    "memory_floor", "over_limit", "relabel", "require_memory", "run_classic",
]

#: Largest instance (ops) handed to CP-SAT (:mod:`pipeopt.solvers.cpsat`) even when asked for
#: by name. Beyond it the model alone takes longer to build than any sensible time limit and
#: gigabytes of memory (measured, 2 cores, 3 s limit: 24576 ops found no solution; p=64,
#: m=1024, 196608 ops took 23 s and 1.2 GB), so the greedy's schedule is returned instead,
#: with a note in ``details``.
MAX_MODEL_OPS = 20_000


@dataclass(frozen=True)
class Progress:
    """One progress report of a search: elapsed seconds, best objective and bound so far."""

    elapsed: float
    objective: float | None
    bound: float | None

    @property
    def gap(self) -> float | None:
        """Relative gap between the best objective and the bound, when both are known."""
        if self.objective is None or self.bound is None or self.objective <= 0:
            return None
        return max(0.0, (self.objective - self.bound) / self.objective)


@dataclass(frozen=True)
class SolveOptions:
    """Settings shared by every method (searches use them; hand-made schedules ignore them).

    ``time_limit`` in seconds; ``workers`` None = all cores; ``resolution`` is the time unit of
    the CP-SAT model in seconds (None = chosen from the problem); ``time_tolerance``: the share
    of time (0.01 = 1%) ``auto`` gives up over its fastest candidate for the one with the lowest
    peak memory (0: the fastest); ``on_progress`` receives
    :class:`Progress` reports; ``hint`` is a schedule to start from; ``known_bound``: a lower
    bound on the objective (seconds) that the caller has *proven* (``auto`` hands its relaxation
    / kept-devices bounds to CP-SAT this way): ``cpsat`` stops as soon as a schedule meets it
    and reports it as its bound (a value above a schedule ``cpsat`` finds is not a lower bound:
    refused when its warm start shows it, ignored with a note in ``details`` when a later
    schedule does). Values are checked as a config's ``solver:`` keys are
    (:class:`~pipeopt.errors.ConfigError` naming the option).
    """

    time_limit: float = 60.0
    seed: int = 0
    workers: int | None = None
    objective: Objective = "makespan"
    relative_gap: float = 0.0
    resolution: float | None = None
    time_tolerance: float = 0.01
    on_progress: Callable[[Progress], None] | None = None
    hint: Schedule | None = None
    log: bool = False
    known_bound: float | None = None

    def __post_init__(self) -> None:
        # The rules of a config's solver: section and of the command-line flags, so that
        # pipeopt.solve(..., time_limit=-1) is refused as `--time-limit -1` is.
        for name in ("time_limit", "seed", "workers", "objective", "relative_gap",
                     "resolution", "time_tolerance", "known_bound"):
            check_solver_option(name, getattr(self, name))


Method = Callable[[Problem, SolveOptions], Schedule]


class OutOfTime(RuntimeError):
    """A method reached its time limit before it had any schedule (raised only when its
    caller asked for that, having another schedule to fall back on)."""


def above(bound: float, value: float) -> bool:
    """Whether ``bound`` lies above ``value``, a real schedule's objective (seconds, float
    round-off allowed): such a bound is no lower bound."""
    return bound > value * (1 + 1e-9) + 1e-12


def checked_known_bound(options: SolveOptions, method: str, value: float | None
                        ) -> float | None:
    """``options.known_bound`` (seconds; None when not given), refused with a
    :class:`~pipeopt.errors.ConfigError` naming it when ``value``, the objective of a real
    schedule made by ``method`` (None: none yet), is already below it."""
    known = options.known_bound
    if known is not None and value is not None and above(known, value):
        raise ConfigError(f"known_bound: {known:g} s is above the {options.objective} of a "
                          f"valid schedule ({method}: {value:g} s), so it is not a lower "
                          "bound; pass only a bound proven for this problem and objective")
    return known


def known_bound_ignored(known: float, objective: str, value: float) -> tuple[str, str]:
    """The ``details`` entry of a search whose schedule (``value``, seconds) came out below the
    caller's ``known`` bound: that bound was ignored."""
    return ("known_bound_ignored", f"known_bound: {known:g} s is above the {objective} of a "
            f"schedule found, {value:g} s: not a lower bound, ignored")


def over_limit(values: Sequence[float], limits: Sequence[float | None]) -> list[int]:
    """Devices whose ``values`` (bytes) exceed their memory limit (``None`` = unlimited),
    with a relative tolerance of 1e-9 for float round-off."""
    return [d for d, (x, lim) in enumerate(zip(values, limits, strict=True))
            if lim is not None and x > lim * (1 + 1e-9) + 1e-12]


def memory_floor(problem: Problem) -> tuple[float, ...]:
    """Per device, the least memory any schedule needs (bytes): static memory plus the largest
    micro-batch's activations on all of the device's stages (all are live when the device's
    last F of that micro-batch starts). Running the micro-batches one at a time needs exactly
    this on every device at once, so it is also enough."""
    act, table = problem.activation_memory, problem.memory_table
    out = []
    for d in range(problem.devices):
        stages = problem.device_stages[d]
        if problem.stage_scales:  # the micro-batch holding the most on this device's stages
            held = max(math.fsum(act[k] * table[k][j] for k in stages)
                       for j in range(problem.microbatches))
        else:
            held = max(problem.memory_scale) * sum(act[k] for k in stages)
        out.append(problem.static_memory[d] + held)
    return tuple(out)


def require_memory(problem: Problem, method: str) -> None:
    """Raise :class:`NotApplicable` when some device's memory limit is below
    :func:`memory_floor`. The message (prefixed with ``method``) names the device, what it needs
    and why, and the limits with which the cheapest schedule (one micro-batch at a time) fits.
    """
    need = memory_floor(problem)
    short = over_limit(need, problem.memory_limit)
    if not short:
        return
    d = short[0]
    act = need[d] - problem.static_memory[d]
    one = "one micro-batch" if problem.uniform_microbatches else "the largest micro-batch"
    others = f"; {len(short) - 1} more devices are short too" if len(short) > 1 else ""
    raise NotApplicable(
        f"{method}: memory.limit[{d}] = {problem.memory_limit[d]:g} is too small for any "
        f"schedule: device {d} needs at least {need[d]:g} (static {problem.static_memory[d]:g} "
        f"+ {act:g} of activations that {one} holds on its stages "
        f"{list(problem.device_stages[d])}){others}; the cheapest schedule, one micro-batch at "
        f"a time, fits with memory.limit >= [{', '.join(f'{x:g}' for x in need)}]")


def fits_memory(schedule: Schedule, problem: Problem | None = None) -> bool:
    """True when the schedule's peak memory is within every device's limit of ``problem``."""
    return not over_limit(schedule.peak_memory, (problem or schedule.problem).memory_limit)


#: Suffix of the method name of a hand-made schedule run longest micro-batch first.
LONGEST_FIRST = "+longest-first"


def longest_first(problem: Problem) -> tuple[int, ...]:
    """Micro-batches by decreasing cost: time factor, then memory, then message factor (the
    per-micro-batch summaries of :class:`Problem` when its scales are tables); equal
    ones keep their order (so the identity when every micro-batch costs the same)."""
    ts, ms, mu = problem.time_scale, problem.memory_scale, problem.message_scale
    return tuple(sorted(range(problem.microbatches),
                        key=lambda j: (-ts[j], -ms[j], -mu[j], j)))


def fifo_orders(problem: Problem) -> list[tuple[int, ...] | None]:
    """The micro-batch orders to run hand-made schedules in: the given one (None) and, when
    micro-batches differ in cost and are not sorted already, :func:`longest_first`."""
    if problem.uniform_microbatches:
        return [None]
    order = longest_first(problem)
    return [None] if order == tuple(range(problem.microbatches)) else [None, order]


def relabel(schedule: Schedule, order: Sequence[int]) -> Schedule:
    """A schedule of ``P.permute_microbatches(order)`` as a schedule of ``P``: its micro-batch
    i is ``P``'s micro-batch ``order[i]``; the times stay as they are."""
    inverse = [0] * len(order)
    for i, j in enumerate(order):
        inverse[j] = i
    ops = tuple(o._replace(microbatch=order[o.microbatch]) for o in schedule.ops)
    msgs = tuple(m._replace(microbatch=order[m.microbatch]) for m in schedule.messages)
    return replace(schedule, problem=schedule.problem.permute_microbatches(inverse), ops=ops,
                   messages=msgs)


class ChainGraphs:
    """The task graphs of the problems one search times (a problem, its fused-backward variant,
    its micro-batches reordered), each built when first asked for and handed to every
    :func:`~pipeopt.simulate.simulate` of that problem: the build is about a sixth of one
    timing at p = 64, m = 1024. A search makes one per run and drops it with the run; it holds
    immutable graphs and is never shared between runs or threads."""

    def __init__(self) -> None:
        self._built: list[ChainGraph] = []

    def of(self, problem: Problem) -> ChainGraph:
        """The graph of ``problem`` (an equal problem's, when one was built already)."""
        for g in self._built:
            if g.problem is problem or g.problem == problem:
                return g
        g = chain_graph(problem)
        self._built.append(g)
        return g


@cyclic_gc_paused()  # generating orders builds one Op per op and no cycles (pipeopt._gc)
def run_classic(problem: Problem, name: str, *, require_fit: bool = False,
                order: Sequence[int] | None = None,
                graphs: ChainGraphs | None = None) -> Schedule:
    """Generate and time a hand-made schedule (raises :class:`NotApplicable` with the reason).

    Schedules of :data:`FUSED_BACKWARD` run on the fused variant of the problem
    (:func:`~pipeopt.schedules.fused_variant`: at the measured fused backward when known). With
    ``require_fit``, orders whose peak memory (computed from the orders alone, exact when every
    op lasts > 0) exceeds a limit raise :class:`NotApplicable` before they are timed. With
    ``order``, the schedule runs the micro-batches in that order instead of 0, 1, ...
    (hand-made schedules take micro-batches first in, first out); the result is still a
    schedule of ``problem``, its method name ending in :data:`LONGEST_FIRST` when ``order``
    is :func:`longest_first`'s. ``graphs``: the caller's :class:`ChainGraphs`, when it times
    several schedules of one problem. On a problem cut into sub-blocks the schedule is
    generated for the uncut problem (:func:`~pipeopt.subblocks.merge`) and runs each op's
    pieces back to back (:func:`~pipeopt.schedules.generate`).
    """
    if order is not None and tuple(order) != tuple(range(problem.microbatches)):
        sched = run_classic(problem.permute_microbatches(order), name, require_fit=require_fit,
                            graphs=graphs)
        suffix = LONGEST_FIRST if tuple(order) == longest_first(problem) else "+reordered"
        return replace(relabel(sched, order), method=sched.method + suffix)
    t0 = time.perf_counter()
    prob = fused_variant(problem) if name in FUSED_BACKWARD else problem
    orders = generate(name, prob)
    if require_fit and min(min(ts, default=1.0) for ts in prob.durations.values()) > 0:
        over = over_limit(order_peak_memory(prob, orders), problem.memory_limit)
        if over:
            raise NotApplicable(f"{name}: over the memory limit of device {over[0]}")
    sched = simulate(prob, orders, method=name,
                     graph=None if graphs is None else graphs.of(prob))
    info = SolverInfo(status="heuristic", lower_bound=lower_bound(problem),
                      wall_time=time.perf_counter() - t0)
    return replace(sched, solver=info)
