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
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pipeopt.clock import Stopwatch
from pipeopt.problem import Problem, rechunk
from pipeopt.schedule import Schedule
from pipeopt.schedules import GENERATORS, NotApplicable
from pipeopt.simulate import validate
from pipeopt.solvers.auto import pareto
from pipeopt.solvers.base import (
    LONGEST_FIRST,
    ChainGraphs,
    Method,
    Objective,
    OutOfTime,
    Progress,
    SolveOptions,
    fifo_orders,
    fits_memory,
    longest_first,
    lower_bound,
    memory_floor,
    over_limit,
    relabel,
    require_memory,
    run_classic,
)
from pipeopt.subblocks import merge, split

# The shared parts live in pipeopt.solvers.base (the searches import them from there, not from
# this package, which names the searches in its method table); they stay importable from here.
__all__ = [
    "CHUNKED", "INTERRUPTED", "LONGEST_FIRST", "MIN_SEARCH_SHARE", "VALIDATE_FAST_S_PER_OP",
    "VALIDATE_GRACE_SHARE", "VALIDATE_PROBE_S", "VALIDATE_S_PER_OP", "ChainGraphs", "CompareRow",
    "Method",
    "Objective", "OutOfTime", "Progress",
    "SolveOptions", "UnknownMethod", "check_method", "classic_methods", "compare",
    "fifo_orders", "fits_memory", "longest_first", "lower_bound", "memory_floor", "methods",
    "over_limit", "relabel", "require_memory", "run_classic", "solve", "time_left",
    "validate_loose",
]

#: Search methods, imported on first use (module path, function name).
_SEARCH: dict[str, tuple[str, str]] = {
    "greedy": ("pipeopt.solvers.greedy", "solve_greedy"),
    "cpsat": ("pipeopt.solvers.cpsat", "solve_cpsat"),
    "auto": ("pipeopt.solvers.auto", "solve_auto"),
}


class UnknownMethod(ValueError):
    """A method name that pipeopt does not know."""


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
    if name in ASYNC_METHODS:
        raise UnknownMethod(f"{name!r} is an asynchronous method: set pipeline.mode: async "
                            f"(or call pipeopt.solvers.solve_async)")
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise UnknownMethod(f"unknown method {name!r}; {hint}choose one of {', '.join(known)}")


def methods() -> list[str]:
    """Names of every method :func:`solve` accepts (searches whose module is present)."""
    found = [name for name, (module, _) in _SEARCH.items() if importlib.util.find_spec(module)]
    names = [*found, *GENERATORS]
    if importlib.util.find_spec("torch") is not None:
        from pipeopt.schedules.pytorch import torch_names

        names += torch_names()
    return names


def classic_methods() -> list[str]:
    """Names of the hand-made schedules."""
    return list(GENERATORS)


#: CPU seconds per op that validating a schedule takes with the per-op check, reserved out of
#: a search's time limit (measured on the 2-core development machine, 2026-12-03: 1.2-3.3 us
#: per op of CPU from 96 to 921,600 ops; the wall time is this times the run's slowdown,
#: :class:`pipeopt.clock.Stopwatch`).
VALIDATE_S_PER_OP = 3.5e-6
#: The same with the vectorised pass (:mod:`pipeopt.validate_fast`, no link contention):
#: 0.31-0.82 us per op of CPU from 12,288 to 921,600 ops, same machine and day.
VALIDATE_FAST_S_PER_OP = 1.0e-6
#: CPU seconds of validation from which :func:`solve` probes the machine's slowdown before a
#: search (a 50 ms busy loop, :meth:`pipeopt.clock.Stopwatch.slowdown`) to scale its reserve:
#: below it the probe would cost a tenth of what it sizes.
VALIDATE_PROBE_S = 0.5
#: The least share of a time limit left to a search whatever is reserved for later phases.
MIN_SEARCH_SHARE = 0.1
#: Share of its time limit by which ``auto``'s validation may run past it before it is skipped
#: instead: issue 18 asks that a limit hold "within 10% + a fixed few seconds", and the
#: per-op estimate is itself conservative (6-19 us per op measured, 10 us assumed).
VALIDATE_GRACE_SHARE = 0.1


def validation_cost(problem: Problem) -> float:
    """CPU seconds :func:`~pipeopt.simulate.validate` is expected to take on a schedule of
    ``problem`` (:data:`VALIDATE_FAST_S_PER_OP` or :data:`VALIDATE_S_PER_OP` per op)."""
    from pipeopt.simulate import FAST_CHECK_IMPORT_OPS

    n = problem.num_ops
    fast = not problem.has_link_contention and n >= FAST_CHECK_IMPORT_OPS
    return (VALIDATE_FAST_S_PER_OP if fast else VALIDATE_S_PER_OP) * n


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
                objective=sc.objective, relative_gap=sc.relative_gap, resolution=sc.resolution,
                time_tolerance=sc.time_tolerance)
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
            from pipeopt.schedules.pytorch import solve_torch
        except ImportError as exc:
            raise UnknownMethod(f"method: {method} needs the torch extra "
                                f"(pip install 'pipeopt[torch]'): {exc}") from None
        return validate(solve_torch(problem, method.split(":", 1)[1], opts))
    if method in _SEARCH and method in methods():
        module, func = _SEARCH[method]
        fn: Method = getattr(importlib.import_module(module), func)
        # The validation below counts against the time limit too: the search gets the rest,
        # the estimate scaled by how fast this process runs now when it is worth a probe.
        watch = Stopwatch.start()
        need = validation_cost(problem)
        if need > VALIDATE_PROBE_S:
            need *= watch.slowdown(calibrate=True)
        sched = fn(problem, replace(opts, time_limit=time_left(
            opts.time_limit, need + watch.elapsed())))
        if method == "auto":
            return _validate_in_time(sched, opts.time_limit - watch.elapsed(),
                                     opts.time_limit, watch.slowdown())
        return validate(sched)
    try:
        check_method(method)
    except UnknownMethod as exc:
        raise UnknownMethod(f"method: {exc}") from None
    raise UnknownMethod(f"method: {method!r} is not available here")  # pragma: no cover


def _validate_in_time(schedule: Schedule, left_s: float, limit_s: float,
                      slowdown: float = 1.0) -> Schedule:
    """``auto``'s result, validated unless that would overrun the time limit ``limit_s`` by
    more than :data:`VALIDATE_GRACE_SHARE` of it (``left_s`` seconds left, against
    :func:`validation_cost` times ``slowdown``, the wall seconds per CPU second the search
    itself took): then returned unvalidated with the detail ``validation`` saying so. At the
    documented largest sizes the vectorised pass needs about a second of CPU, within the
    grace of a 10 s limit, so only a loaded machine or link contention makes it skip.

    Skipping is safe for ``auto`` only: every candidate it returns was timed by the simulator
    from orders it checked (each op once, on its stage's device; every dependency, link and
    device timed by the same rules the validator checks) and kept only within the memory
    limits, or, from CP-SAT, already passed :func:`~pipeopt.simulate.check` inside ``auto``.
    ``pipeopt simulate`` on the written file runs the full validation.
    """
    need = validation_cost(schedule.problem) * slowdown
    if left_s + VALIDATE_GRACE_SHARE * limit_s >= need:
        return validate(schedule)
    load = f" (this run's wall / CPU time: {slowdown:.1f})" if slowdown > 1 else ""
    note = (f"skipped: {max(left_s, 0.0):.1f} s of the time limit left, about {need:.1f} s "
            f"needed{load}; the schedule was timed by the simulator (or checked inside auto); "
            "`pipeopt simulate FILE` validates it in full")
    # relabel, not replace: keeps the metrics computed so far (peak memory: a second at 1M ops).
    return schedule.relabel(solver=replace(schedule.solver, details=(
        *schedule.solver.details, ("validation", note))))


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
    #: On the Pareto set of the rows that fit: no other such row is at least as fast (``value``)
    #: and as lean (max peak memory over devices), and better on one of the two.
    pareto: bool = False

    @property
    def value(self) -> float | None:
        """The compared quantity of this row's schedule (seconds), None without one."""
        return None if self.schedule is None else getattr(self.schedule, self.ratio_of)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: ``ratio`` (null where undefined) is of the field ``ratio_of``."""
        out: dict[str, Any] = {"method": self.method, "error": self.error, "fits": self.fits,
                               "ratio": self.ratio, "ratio_of": self.ratio_of,
                               "pareto": self.pareto}
        if self.schedule is not None:
            summary = self.schedule.summary()
            # The row's label (e.g. "zb-v (v=2)") names the variant that ran; keep the
            # schedule's own method name (e.g. "auto:cpsat") beside it.
            summary["schedule_method"] = summary.pop("method", self.schedule.method)
            out.update(summary)
        return out


#: Hand-made schedules that need several chunks per device: (chunks, placement) that
#: :func:`compare` uses for them on a problem with one stage per device.
CHUNKED: dict[str, tuple[int, str]] = {
    "interleaved-1f1b": (2, "loop"), "looped-bfs": (2, "loop"), "zb-v": (2, "vshape"),
    "v-half": (2, "vshape"), "v-min": (2, "vshape"), "crosspipe-v": (2, "vshape"),
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
    best one that fits; None where undefined (none fits, or the best is 0 s). ``pareto`` marks
    the rows that fit and that no other such row beats on both that quantity and max peak
    memory (the time / memory trade-off). Each name runs once.
    """
    names = list(dict.fromkeys(names or methods()))  # each method once
    # Micro-batches of different cost: every hand-made schedule also runs longest first.
    orders = fifo_orders(problem)
    runs = [(n, o) for n in names for o in (orders if n in GENERATORS else [None])]
    graphs = ChainGraphs()  # the hand-made schedules of one problem share its task graph
    rows: list[CompareRow] = []
    for i, (name, mb_order) in enumerate(runs):
        prob, label = problem, name
        if name in CHUNKED and problem.virtual_stages == 1 and problem.devices > 1:
            # Run it on the same work cut into equal chunks, and say so in the row's name.
            v, placement = CHUNKED[name]
            # A problem cut into sub-blocks: the chunks of its uncut problem, cut again alike.
            prob = split(rechunk(merge(problem), v, placement), problem.sub_blocks)
            label = f"{name} (v={v})"
        if mb_order is not None:
            label += " (longest first)"
        if on_start is not None:
            on_start(label)
        try:
            if name in GENERATORS:
                sched = validate_loose(run_classic(prob, name, order=mb_order,
                                                        graphs=graphs))
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
    feasible = {i: (r.value, max(r.schedule.peak_memory, default=0.0))
                for i, r in enumerate(rows)
                if r.schedule is not None and r.value is not None and r.fits}
    on_front = {i for i, on in zip(feasible, pareto(list(feasible.values())), strict=True)
                if on}
    out = []
    for i, r in enumerate(rows):
        if r.value is not None and best is not None and best > 0:
            r = replace(r, ratio=r.value / best)
        out.append(replace(r, pareto=i in on_front))
    out.sort(key=lambda r: (r.schedule is None, not r.fits,
                            math.inf if r.value is None else r.value))
    return out


def validate_loose(schedule: Schedule) -> Schedule:
    """Validate everything but the memory limits (hand-made schedules do not know them)."""
    unlimited = schedule.problem.replace(memory_limit=())
    validate(replace(schedule, problem=unlimited))
    return schedule


# ----- asynchronous (periodic) pipelines: pipeline.mode: async ---------------------------------
__all__ += ["ASYNC_METHODS", "AsyncRow", "async_methods", "check_async_method", "compare_async",
            "solve_async"]

#: Asynchronous methods by name: (weight policy, how). ``pattern``: the hand-made 1F1B-async
#: (:mod:`pipeopt.schedules.periodic`); ``search``: the in-flight counts searched for the
#: shortest period within memory (:mod:`pipeopt.solvers.periodic`); ``cpsat``: the cyclic
#: CP-SAT model from the search's answer (:mod:`pipeopt.solvers.periodic_cpsat`). ``auto`` is
#: ``periodic``.
ASYNC_METHODS: dict[str, tuple[str, str]] = {
    "pipedream": ("stash", "pattern"), "pipedream-2bw": ("2bw", "pattern"),
    "pipemare": ("pipemare", "pattern"), "periodic": ("stash", "search"),
    "periodic-2bw": ("2bw", "search"), "periodic-pipemare": ("pipemare", "search"),
    "periodic-cpsat": ("stash", "cpsat"), "periodic-cpsat-2bw": ("2bw", "cpsat"),
    "periodic-cpsat-pipemare": ("pipemare", "cpsat"),
}


def async_methods() -> list[str]:
    """Names of every method :func:`solve_async` accepts (``auto`` is ``periodic``)."""
    return ["auto", *ASYNC_METHODS]


def check_async_method(name: str) -> None:
    """Raise :class:`UnknownMethod` (with a "did you mean") unless :func:`solve_async` knows
    ``name``."""
    known = async_methods()
    if isinstance(name, str) and name in known:
        return
    if isinstance(name, str) and name in methods():
        raise UnknownMethod(f"{name!r} is a synchronous method; pipeline.mode: async takes "
                            f"{', '.join(known)}")
    close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise UnknownMethod(f"unknown asynchronous method {name!r}; {hint}choose one of "
                        f"{', '.join(known)}")


def solve_async(problem: Problem, method: str = "auto", weight_bytes: Any = (), *,
                time_limit: float = 10.0, replicas: Any = (), sync_s: Any = ()) -> Any:
    """The :class:`~pipeopt.workloads.periodic.PeriodicSchedule` of ``method`` on
    ``problem``'s steady state, checked by unrolling it through the core validator.
    ``weight_bytes``: bytes of one copy of each stage's weights; ``time_limit`` in seconds
    (searches only); ``replicas[k]``: devices that run stage k round-robin (default one);
    ``sync_s[k]``: seconds of their gradient all-reduce per round of ``replicas[k]``
    micro-batches (a lower bound on the period). A hand-made pattern over a memory limit
    raises :class:`~pipeopt.schedules.NotApplicable`, as hand-made synchronous schedules
    do."""
    from pipeopt.schedules.periodic import validate_periodic

    check_async_method(method)
    method = "periodic" if method == "auto" else method
    sched = _run_async(problem, method, weight_bytes, time_limit, replicas, sync_s)
    if ASYNC_METHODS[method][1] == "pattern":
        over = sched.over_memory()
        if over:  # hand-made: no memory awareness
            d = over[0]
            raise NotApplicable(
                f"memory.limit[{d}]: {method} needs {sched.peak_memory[d]:g} on device {d} in "
                f"steady state, over its limit {problem.memory_limit[d]:g}; hand-made patterns "
                f"do not adapt to memory: use periodic, or raise memory.limit")
    return validate_periodic(sched)


def _run_async(problem: Problem, method: str, weight_bytes: Any, time_limit: float,
               replicas: Any, sync_s: Any = ()) -> Any:
    """The PeriodicSchedule of one asynchronous method (not yet validated)."""
    from pipeopt.schedules.periodic import async_pattern
    from pipeopt.solvers.periodic import solve_periodic

    policy, how = ASYNC_METHODS[method]
    if how == "pattern":
        return async_pattern(problem, method, weight_bytes, replicas, sync_s)
    if how == "search":
        return solve_periodic(problem, weight_bytes, policy, time_limit=time_limit,
                              replicas=replicas, sync_s=sync_s).replace(method=method)
    from pipeopt.solvers.periodic_cpsat import solve_periodic_cpsat

    return solve_periodic_cpsat(problem, weight_bytes, policy, time_limit=time_limit,
                                replicas=replicas, sync_s=sync_s)


@dataclass(frozen=True)
class AsyncRow:
    """One method's steady state: ``period`` (s per micro-batch; a synchronous schedule's
    iteration time / micro-batches), the largest peak memory (bytes), staleness (updates) and
    weight versions of the worst stage, whether it fits, and ``ratio`` = period / the best
    period that fits. ``schedule``: the PeriodicSchedule or the synchronous Schedule."""

    method: str
    mode: str
    schedule: Any = None
    error: str | None = None
    period: float | None = None
    peak_memory: float | None = None
    staleness: int = 0
    weight_versions: int = 1
    fits: bool = False
    ratio: float | None = None

    @property
    def throughput(self) -> float | None:
        """Micro-batches per second (samples per second = this x samples per micro-batch)."""
        return None if not self.period else 1.0 / self.period

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (no schedule)."""
        return {"method": self.method, "mode": self.mode, "error": self.error,
                "period": self.period, "throughput": self.throughput,
                "peak_memory": self.peak_memory, "staleness": self.staleness,
                "weight_versions": self.weight_versions, "fits": self.fits,
                "ratio": self.ratio}


def compare_async(problem: Problem, weight_bytes: Any = (), names: list[str] | None = None,
                  sync_names: list[str] | None = None, *, time_limit: float = 10.0,
                  replicas: Any = (), sync_s: Any = ()) -> list[AsyncRow]:
    """Rank asynchronous methods ``names`` (default: all) beside synchronous ones
    ``sync_names`` (default: the hand-made schedules and ``greedy``) by period per micro-batch,
    those within memory first; ``time_limit`` per search (s). ``replicas`` apply to the
    asynchronous methods only (the synchronous ones run one device per stage), and so does
    ``sync_s`` (their all-reduce per round, s)."""
    from pipeopt.schedules.periodic import validate_periodic

    rows: list[AsyncRow] = []
    for name in list(dict.fromkeys(names or list(ASYNC_METHODS))):
        check_async_method(name)
        try:
            s = _run_async(problem, "periodic" if name == "auto" else name, weight_bytes,
                           time_limit, replicas, sync_s)
        except NotApplicable as exc:
            rows.append(AsyncRow(name, "async", error=str(exc)))
            continue
        # Judged without the memory limits (hand-made patterns ignore them; ``fits`` says).
        validate_periodic(s.replace(problem=s.problem.replace(memory_limit=())))
        rows.append(AsyncRow(name, "async", s, period=s.period,
                             peak_memory=max(s.peak_memory), staleness=max(s.staleness),
                             weight_versions=max(s.weight_versions), fits=not s.over_memory()))
    sync = sync_names if sync_names is not None else [*GENERATORS, "greedy"]
    m = problem.microbatches
    for r in compare(problem, sync, time_limit=time_limit) if sync else []:
        if r.schedule is None:
            rows.append(AsyncRow(r.method, "sync", error=r.error))
            continue
        rows.append(AsyncRow(r.method, "sync", r.schedule, period=r.schedule.iteration_time / m,
                             peak_memory=max(r.schedule.peak_memory), fits=r.fits))
    best = min((r.period for r in rows if r.period is not None and r.fits), default=None)
    rows = [replace(r, ratio=r.period / best) if r.period is not None and best else r
            for r in rows]
    rows.sort(key=lambda r: (r.period is None, not r.fits,
                             math.inf if r.period is None else r.period))
    return rows
