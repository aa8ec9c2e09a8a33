"""Every scheduling method behind one entry point: :func:`solve` returns a :class:`Schedule`.

Methods are looked up by name: the hand-made schedules of :mod:`pipeopt.schedules`, the
``greedy`` list scheduler, the ``cpsat`` search and ``auto`` (the best of them). Each result is
timed by the simulator or checked by the validator before it is returned.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from pipeopt._gc import cyclic_gc_paused
from pipeopt.bounds import iteration_lower_bound, span_lower_bound
from pipeopt.problem import Problem, rechunk
from pipeopt.schedule import Schedule, SolverInfo, order_peak_memory
from pipeopt.schedules import FUSED_BACKWARD, GENERATORS, NotApplicable, fused_variant
from pipeopt.simulate import simulate, validate

Objective = Literal["makespan", "span"]


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
    the CP-SAT model in seconds (None = chosen from the problem); ``on_progress`` receives
    :class:`Progress` reports; ``hint`` is a schedule to start from. Values are checked as a
    config's ``solver:`` keys are (:class:`~pipeopt.config.ConfigError` naming the option).
    """

    time_limit: float = 60.0
    seed: int = 0
    workers: int | None = None
    objective: Objective = "makespan"
    relative_gap: float = 0.0
    resolution: float | None = None
    on_progress: Callable[[Progress], None] | None = None
    hint: Schedule | None = None
    log: bool = False

    def __post_init__(self) -> None:
        # The rules of a config's solver: section and of the command-line flags, so that
        # pipeopt.solve(..., time_limit=-1) is refused as `--time-limit -1` is.
        from pipeopt.config import check_solver_option

        for name in ("time_limit", "seed", "workers", "objective", "relative_gap",
                     "resolution"):
            check_solver_option(name, getattr(self, name))


Method = Callable[[Problem, SolveOptions], Schedule]

#: Search methods, imported on first use (module path, function name).
_SEARCH: dict[str, tuple[str, str]] = {
    "greedy": ("pipeopt.solvers.greedy", "solve_greedy"),
    "cpsat": ("pipeopt.solvers.cpsat", "solve_cpsat"),
    "auto": ("pipeopt.solvers.auto", "solve_auto"),
}


class UnknownMethod(ValueError):
    """A method name that pipeopt does not know."""


class OutOfTime(RuntimeError):
    """A method reached its time limit before it had any schedule (raised only when its
    caller asked for that, having another schedule to fall back on)."""


#: Problem fields that hand-made schedules name in their "does not apply" reasons, as config
#: key paths (``needs microbatches >= 8`` -> ``needs pipeline.microbatches >= 8``).
_PIPELINE_KEYS = re.compile(r"(?<![.\w])(devices|microbatches|virtual_stages|placement|"
                            r"split_backward)\b")


def check_method(name: str) -> None:
    """Raise :class:`UnknownMethod` (with a "did you mean") unless :func:`solve` knows ``name``.
    """
    if not isinstance(name, str):
        raise UnknownMethod(f"expected a method name, got {name!r}")
    if name.startswith("torch:") and importlib.util.find_spec("torch") is None:
        raise UnknownMethod(f"{name} needs the torch extra (pip install 'pipeopt[torch]')")
    known = methods()
    if name in known:
        return
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise UnknownMethod(f"unknown method {name!r}; {hint}choose one of {', '.join(known)}")


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
    largest = max(problem.memory_scale)
    return tuple(problem.static_memory[d] + largest * sum(problem.activation_memory[k]
                                                          for k in problem.device_stages[d])
                 for d in range(problem.devices))


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


def methods() -> list[str]:
    """Names of every method :func:`solve` accepts (searches whose module is present)."""
    found = [name for name, (module, _) in _SEARCH.items() if importlib.util.find_spec(module)]
    names = [*found, *GENERATORS]
    if importlib.util.find_spec("torch") is not None:
        from pipeopt.executor.torch_schedules import torch_names

        names += torch_names()
    return names


def classic_methods() -> list[str]:
    """Names of the hand-made schedules."""
    return list(GENERATORS)


def lower_bound(problem: Problem, objective: Objective = "makespan") -> float:
    """The analytic lower bound on ``objective`` for ``problem`` (seconds): the largest
    per-device span, or the iteration time (the makespan plus the gradient reduction still
    running after it; the makespan bound when there is none)."""
    return span_lower_bound(problem) if objective == "span" else iteration_lower_bound(problem)


#: Suffix of the method name of a hand-made schedule run longest micro-batch first.
LONGEST_FIRST = "+longest-first"


def longest_first(problem: Problem) -> tuple[int, ...]:
    """Micro-batches by decreasing cost: time factor, then memory, then message factor; equal
    ones keep their order (so the identity when every micro-batch costs the same)."""
    key = problem.microbatch_key
    return tuple(sorted(range(problem.microbatches),
                        key=lambda j: (-key[j][0], -key[j][1], -key[j][2], j)))


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


@cyclic_gc_paused()  # generating orders builds one Op per op and no cycles (pipeopt._gc)
def run_classic(problem: Problem, name: str, *, require_fit: bool = False,
                order: Sequence[int] | None = None) -> Schedule:
    """Generate and time a hand-made schedule (raises :class:`NotApplicable` with the reason).

    Schedules of :data:`FUSED_BACKWARD` run on the fused variant of the problem
    (:func:`~pipeopt.schedules.fused_variant`: at the measured fused backward when known). With
    ``require_fit``, orders whose peak memory (computed from the orders alone, exact when every
    op lasts > 0) exceeds a limit raise :class:`NotApplicable` before they are timed. With
    ``order``, the schedule runs the micro-batches in that order instead of 0, 1, ...
    (hand-made schedules take micro-batches first in, first out); the result is still a
    schedule of ``problem``, its method name ending in :data:`LONGEST_FIRST` when ``order``
    is :func:`longest_first`'s.
    """
    if order is not None and tuple(order) != tuple(range(problem.microbatches)):
        sched = run_classic(problem.permute_microbatches(order), name, require_fit=require_fit)
        suffix = LONGEST_FIRST if tuple(order) == longest_first(problem) else "+reordered"
        return replace(relabel(sched, order), method=sched.method + suffix)
    t0 = time.perf_counter()
    prob = fused_variant(problem) if name in FUSED_BACKWARD else problem
    orders = GENERATORS[name](prob)
    if require_fit and min(min(ts, default=1.0) for ts in prob.durations.values()) > 0:
        over = over_limit(order_peak_memory(prob, orders), problem.memory_limit)
        if over:
            raise NotApplicable(f"{name}: over the memory limit of device {over[0]}")
    sched = simulate(prob, orders, method=name)
    info = SolverInfo(status="heuristic", lower_bound=lower_bound(problem),
                      wall_time=time.perf_counter() - t0)
    return replace(sched, solver=info)


#: Seconds per op that validating a schedule takes, reserved out of a search's time limit
#: (measured with benchmarks/limits.py on the 2-core development machine: 6-19 us per op at
#: 0.8-0.9 million ops, the spread being the machine's other load).
VALIDATE_S_PER_OP = 10e-6
#: The least share of a time limit left to a search whatever is reserved for later phases.
MIN_SEARCH_SHARE = 0.1


def time_left(time_limit: float, reserved: float) -> float:
    """The seconds of ``time_limit`` left for a search once ``reserved`` seconds are kept for
    the phases after it (validation, writing), never below :data:`MIN_SEARCH_SHARE` of it."""
    return max(time_limit - reserved, MIN_SEARCH_SHARE * time_limit)


def solve(problem: Problem | Any, method: str | None = None,
          options: SolveOptions | None = None, **kwargs: Any) -> Schedule:
    """Schedule ``problem`` with ``method`` (default ``auto``); keyword arguments override
    ``options`` fields.

    ``problem`` may also be a loaded :class:`~pipeopt.config.Config`: its problem is solved,
    with its ``solver:`` section (method, time limit, seed, workers, objective, gap,
    resolution) as the defaults that ``method``, ``options`` and keyword arguments override.

    The result has passed the validator, whose time (estimated from the number of ops,
    :data:`VALIDATE_S_PER_OP`) a search's ``time_limit`` includes. Raises
    :class:`UnknownMethod` for an unknown name and :class:`~pipeopt.schedules.NotApplicable`
    when the method cannot express the problem.
    """
    if not isinstance(problem, Problem):
        inner = getattr(problem, "problem", None)
        if not isinstance(inner, Problem):
            raise TypeError(f"solve: expected a Problem or a Config (pipeopt.load_config), got "
                            f"{type(problem).__name__}")
        sc = getattr(problem, "solver", None)
        if sc is not None:
            method = method or sc.method
            options = options or SolveOptions(
                time_limit=sc.time_limit, seed=sc.seed, workers=sc.workers,
                objective=sc.objective, relative_gap=sc.relative_gap, resolution=sc.resolution)
        problem = inner
    method = method or "auto"
    opts = replace(options or SolveOptions(), **kwargs)
    if method in GENERATORS:
        try:
            sched = run_classic(problem, method)
        except NotApplicable as exc:
            raise NotApplicable(_PIPELINE_KEYS.sub(r"pipeline.\1", str(exc))) from None
        over = over_limit(sched.peak_memory, problem.memory_limit)
        if over:
            require_memory(problem, method)
            d = over[0]
            raise NotApplicable(
                f"memory.limit[{d}]: {method} needs {sched.peak_memory[d]:g} on device {d}, "
                f"over its limit {problem.memory_limit[d]:g}; hand-made schedules do not adapt "
                f"to memory limits: use greedy, cpsat or auto, or raise memory.limit")
        return validate(sched)
    if method.startswith("torch:"):
        # PyTorch's built-in schedules, imported as orders and timed by our simulator.
        try:
            from pipeopt.executor.torch_schedules import solve_torch
        except ImportError as exc:
            raise UnknownMethod(f"method: {method} needs the torch extra "
                                f"(pip install 'pipeopt[torch]'): {exc}") from None
        return validate(solve_torch(problem, method.split(":", 1)[1], opts))
    if method in _SEARCH and method in methods():
        module, func = _SEARCH[method]
        fn: Method = getattr(importlib.import_module(module), func)
        # The validation below counts against the time limit too: the search gets the rest.
        return validate(fn(problem, replace(opts, time_limit=time_left(
            opts.time_limit, VALIDATE_S_PER_OP * problem.num_ops))))
    try:
        check_method(method)
    except UnknownMethod as exc:
        raise UnknownMethod(f"method: {exc}") from None
    raise UnknownMethod(f"method: {method!r} is not available here")  # pragma: no cover


@dataclass(frozen=True)
class CompareRow:
    """One method's result on a problem: its schedule, or why it does not apply."""

    method: str
    schedule: Schedule | None
    error: str | None = None
    #: Objective / the best objective among the schedules that fit in memory; None where that
    #: is undefined (no schedule, none fits, or the best is 0 s).
    ratio: float | None = None
    fits: bool = False  # peak memory within every device's limit
    #: The schedule field that ``ratio`` compares, the same for every row: ``iteration_time``
    #: (seconds: the makespan plus any gradient reduction still running after it), or
    #: ``max_span`` when the objective is ``span``.
    ratio_of: str = "iteration_time"

    @property
    def value(self) -> float | None:
        """The compared quantity of this row's schedule (seconds), None without one."""
        return None if self.schedule is None else getattr(self.schedule, self.ratio_of)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: ``ratio`` (null where undefined) is of the field ``ratio_of``."""
        out: dict[str, Any] = {"method": self.method, "error": self.error, "fits": self.fits,
                               "ratio": self.ratio, "ratio_of": self.ratio_of}
        if self.schedule is not None:
            summary = self.schedule.summary()
            # The row's label (e.g. "zb-v (v=2)") names the variant that ran; keep the
            # schedule's own method name (e.g. "auto:cpsat") beside it.
            summary["schedule_method"] = summary.pop("method", self.schedule.method)
            out.update(summary)
        return out


def fits_memory(schedule: Schedule, problem: Problem | None = None) -> bool:
    """True when the schedule's peak memory is within every device's limit of ``problem``."""
    return not over_limit(schedule.peak_memory, (problem or schedule.problem).memory_limit)


#: Hand-made schedules that need several chunks per device: (chunks, placement) that
#: :func:`compare` uses for them on a problem with one stage per device.
CHUNKED: dict[str, tuple[int, str]] = {
    "interleaved-1f1b": (2, "loop"), "looped-bfs": (2, "loop"), "zb-v": (2, "vshape"),
    "v-half": (2, "vshape"), "v-min": (2, "vshape"),
    "torch:Interleaved1F1B": (2, "loop"), "torch:InterleavedZeroBubble": (2, "loop"),
    "torch:ZBVZeroBubble": (2, "vshape"), "torch:DualPipeV": (2, "vshape"),
}


#: The error of the compare rows that Ctrl-C kept from running.
INTERRUPTED = "not run: interrupted (Ctrl-C)"


def compare(problem: Problem, names: list[str] | None = None, *,
            on_start: Callable[[str], None] | None = None,
            **options: Any) -> list[CompareRow]:
    """Run ``names`` (default: every method) on ``problem``; rows that produced a schedule
    first, those within the memory limits before those over them, each group best first.
    ``on_start`` is told each method's name as it starts; ``options`` go to :func:`solve`.
    Ctrl-C stops the comparison: the methods not run get rows with the error
    :data:`INTERRUPTED` (a search that was running keeps its best schedule).

    Hand-made schedules ignore memory limits; ``fits`` says whether each one keeps them.
    ``ratio`` is each row's iteration time (or max span, with ``objective="span"``) over the
    best one that fits; None where undefined (none fits, or the best is 0 s). Each name runs
    once.
    """
    names = list(dict.fromkeys(names or methods()))  # each method once
    # Micro-batches of different cost: every hand-made schedule also runs longest first.
    orders = fifo_orders(problem)
    runs = [(n, o) for n in names for o in (orders if n in GENERATORS else [None])]
    rows: list[CompareRow] = []
    for i, (name, mb_order) in enumerate(runs):
        prob, label = problem, name
        if name in CHUNKED and problem.virtual_stages == 1 and problem.devices > 1:
            # Run it on the same work cut into equal chunks, and say so in the row's name.
            v, placement = CHUNKED[name]
            prob, label = rechunk(problem, v, placement), f"{name} (v={v})"
        if mb_order is not None:
            label += " (longest first)"
        if on_start is not None:
            on_start(label)
        try:
            if name in GENERATORS:
                sched = validate_loose(run_classic(prob, name, order=mb_order))
            elif name.startswith("torch:"):
                # PyTorch's schedules do not know memory limits either: time them without the
                # limit and report whether they fit.
                loose = solve(prob.replace(memory_limit=()), name, **options)
                sched = replace(loose, problem=loose.problem.replace(
                    memory_limit=prob.memory_limit))
            else:
                sched = solve(prob, name, **options)
        except (NotApplicable, UnknownMethod) as exc:
            rows.append(CompareRow(label, None, str(exc)))
            continue
        except KeyboardInterrupt:  # Ctrl-C: keep the rows so far, run nothing more
            rows.extend(CompareRow(n, None, INTERRUPTED) for n, o in runs[i:] if o is None)
            break
        rows.append(CompareRow(label, sched, fits=fits_memory(sched, prob)))
        if sched.solver.detail("interrupted"):  # a search took the Ctrl-C and kept its best
            rows.extend(CompareRow(n, None, INTERRUPTED) for n, o in runs[i + 1:] if o is None)
            break
    # One quantity for every row, hand-made schedules included (they minimise nothing).
    key = "max_span" if options.get("objective") == "span" else "iteration_time"
    rows = [replace(r, ratio_of=key) for r in rows]
    best = min((r.value for r in rows if r.value is not None and r.fits), default=None)
    out = []
    for r in rows:
        if r.value is not None and best is not None and best > 0:
            r = replace(r, ratio=r.value / best)
        out.append(r)
    out.sort(key=lambda r: (r.schedule is None, not r.fits,
                            math.inf if r.value is None else r.value))
    return out


def validate_loose(schedule: Schedule) -> Schedule:
    """Validate everything but the memory limits (hand-made schedules do not know them)."""
    unlimited = schedule.problem.replace(memory_limit=())
    validate(replace(schedule, problem=unlimited))
    return schedule
