"""The ``pipeopt`` command line: parse, call the API, print. No scheduling logic lives here.

Exit status: 0 success; 1 a run that failed its own check (``run``); 2 bad input (a config,
a schedule file, a command-line flag, or a problem no schedule can solve), reported as one
line ``pipeopt: error: <key path>: <reason>``; 130 interrupted (Ctrl-C). A ``solve`` stopped by
Ctrl-C during a CP-SAT search still writes the best schedule found so far to ``-o`` (with status
``feasible`` and its gap) before it exits with 130. Output files are written atomically: a
failed or interrupted run leaves the previous file as it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from pipeopt.clock import Stopwatch
from pipeopt.config import ConfigError
from pipeopt.io import (
    check_writable,
    dump_schedule,
    input_name,
    refuse_overwriting_input,
    write_output,
)
from pipeopt.problem import ProblemError, format_memory
from pipeopt.schedule import Schedule
from pipeopt.schedules import NotApplicable
from pipeopt.simulate import ScheduleError, retime
from pipeopt.solvers import Progress, UnknownMethod, check_method, compare, time_left
from pipeopt.views_cli import positive_int

#: CPU seconds per op that printing a summary and writing the schedule JSON take, kept out of
#: the search's time once multiplied by the run's slowdown (wall / CPU time so far,
#: :class:`pipeopt.clock.Stopwatch`). Measured on the 2-core development machine, 2026-12-03:
#: 4.8-6.8 us per op of CPU at 0.8-0.9 million ops (10-22 us of wall time under load).
WRITE_S_PER_OP = 7e-6

if TYPE_CHECKING:
    from pipeopt.core.schedule import GraphSchedule

logger = logging.getLogger("pipeopt.cli")
logger.addHandler(logging.NullHandler())

#: Errors caused by the user's input: one clear line and exit status 2, never a traceback.
USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, ScheduleError, ProblemError,
                                            NotApplicable, UnknownMethod)

EXAMPLES = {
    "solve": "pipeopt solve examples/uniform.yaml --method cpsat --time-limit 30 -o out.json",
    "simulate": "pipeopt simulate out.json",
    "compare": "pipeopt compare examples/cross_dc.yaml",
    "plan": "pipeopt plan examples/plan_gpt3.yaml --config-out best.yaml --schedule-out best.json",
}

#: Extra subcommands contributed by other modules: name -> (module, function that adds the
#: subparser). Kept as names so that `pipeopt --help` imports nothing heavy.
PLUGINS: dict[str, tuple[str, str]] = {
    "plot/trace": ("pipeopt.views_cli", "add_commands"),
    "profile": ("pipeopt.costs.cli", "add_commands"),
    "run/export": ("pipeopt.executor.cli", "add_commands"),
}


def _fmt(x: float | None, digits: int = 6) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}g}"


def _status_line(status: str, lower_bound: float | None, gap: float | None) -> str:
    return f"status        {status}" + (
        f" (lower bound {_fmt(lower_bound)}, gap {gap:.2%})" if gap is not None else "")


def print_summary(s: Schedule, out: Any = None) -> None:
    """A short human summary of one schedule."""
    out = out or sys.stdout
    gap = s.gap
    print(f"method        {s.method}", file=out)
    print(_status_line(s.solver.status, s.lower_bound, gap), file=out)
    print(f"makespan      {_fmt(s.makespan)} s", file=out)
    if s.iteration_time != s.makespan:
        print(f"iteration     {_fmt(s.iteration_time)} s (with gradient reduction)", file=out)
    print(f"bubble ratio  {s.bubble_ratio:.2%}", file=out)
    peaks = s.peak_memory
    if len(peaks) <= 16:
        print("peak memory   " + ", ".join(format_memory(x, s.problem) for x in peaks),
              file=out)
    else:  # a line of hundreds of numbers reads as nothing; the JSON has them all
        hi = max(range(len(peaks)), key=peaks.__getitem__)
        lo = min(range(len(peaks)), key=peaks.__getitem__)
        print(f"peak memory   max {format_memory(peaks[hi], s.problem)} (device {hi}), min "
              f"{format_memory(peaks[lo], s.problem)} (device {lo}) over {len(peaks)} devices; "
              "each device's "
              "in the JSON (peak_memory)", file=out)
    order = s.microbatch_order
    if not s.problem.uniform_microbatches and order != tuple(range(len(order))):
        # Micro-batches of different cost: the order the schedule runs them in.
        shown = ", ".join(map(str, order[:32]))
        more = f", ... ({len(order)} in all, see microbatch_order in the JSON)" if len(
            order) > 32 else ""
        print(f"micro-batches {shown}{more} (the order run)", file=out)
    print(f"solve time    {s.solver.wall_time:.2f} s", file=out)


def print_pareto(s: Schedule, front: Sequence[Sequence[Any]], out: Any = None) -> None:
    """``auto``'s time / memory trade-off: its candidates that no other beats on both (time in
    s, max peak memory), fastest first, those with equal figures on one line, the chosen one
    marked ``>``; ``+x%`` over the fastest is the ``solver.time_tolerance`` from which ``auto``
    prefers that line's memory."""
    out = out or sys.stdout
    chosen = s.solver.detail("chosen")
    groups: dict[tuple[float, float], list[str]] = {}
    for m, t, mem in front:
        groups.setdefault((t, mem), []).append(m)
    if len(groups) == 1:
        (t, mem), names = next(iter(groups.items()))
        print(f"pareto        the fastest candidate is also the leanest ({_fmt(t)} s, "
              f"{format_memory(mem, s.problem)}): {', '.join(names)}", file=out)
        return
    what = "max span" if s.solver.objective == "span" else "iteration time"
    print(f"pareto        {what} vs peak memory, candidates no other beats on both "
          "(> chosen; +x% = the time_tolerance that picks it):", file=out)
    top = front[0][1]
    rows = [(">" if chosen in names else " ", f"{_fmt(t)} s",
             f"+{t / top - 1:.1%}" if top > 0 else "n/a", format_memory(mem, s.problem),
             ", ".join(names)) for (t, mem), names in groups.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("              " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
              .rstrip(), file=out)


class ProgressLine:
    """One status line on a terminal's stderr, redrawn in place: elapsed wall time since the
    start, what is running, and the search's best objective, bound and gap (seconds).

    A background thread redraws it every ``tick`` seconds, so the clock moves while a search
    finds nothing new. Use as a context manager; it erases the line when done (a finished solve
    prints its summary instead). Does nothing unless ``enabled``.
    """

    def __init__(self, enabled: bool, tick: float = 0.5, stream: Any = None) -> None:
        import threading
        import time

        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tick = tick
        self._clock = time.perf_counter
        self._t0 = self._clock()
        self._what = "solving"
        self._last: Progress | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._width = 0

    def __enter__(self) -> ProgressLine:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join()
            with self._lock:
                if self._width:
                    self.stream.write("\r" + " " * self._width + "\r")
                    self.stream.flush()

    def report(self, p: Progress) -> None:
        """A search's report (its ``on_progress`` callback)."""
        with self._lock:
            self._last = p
        self._draw()

    def running(self, what: str) -> None:
        """Say what runs now (a method name); the search figures start afresh."""
        with self._lock:
            self._what, self._last = what, None
        self._draw()

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            self._draw()

    def _draw(self) -> None:
        if not self.enabled:
            return
        with self._lock:
            text = f"  {self._clock() - self._t0:7.1f}s  {self._what}"
            p = self._last
            if p is not None:
                gap = p.gap
                text += (f"  best {_fmt(p.objective)}  bound {_fmt(p.bound)}  gap "
                         f"{'-' if gap is None else f'{gap:.2%}'}")
            pad = max(0, self._width - len(text))
            self._width = max(self._width, len(text))
            try:
                self.stream.write("\r" + text + " " * pad)
                self.stream.flush()
            except (OSError, ValueError):  # the terminal went away: stop drawing
                self.enabled = False


def _progress_line(quiet: bool) -> ProgressLine:
    """The progress line of ``solve``/``compare``: on only when stderr is a terminal."""
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    return ProgressLine(enabled=tty and not quiet)


class UsageError(Exception):
    """A command-line mistake found by argparse (one line, exit status 2)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one ``pipeopt: error:`` line (exit 2), not usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def seconds_arg(text: str) -> float:
    """argparse type of ``--time-limit``: a finite number of seconds > 0 (the rule of
    ``solver.time_limit`` and of ``pipeopt.solve(time_limit=...)``)."""
    from pipeopt.config import solver_option_rule

    try:
        val = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    why = solver_option_rule("time_limit", val)
    if why is not None:
        raise argparse.ArgumentTypeError(f"{why}, got {text!r}")
    return val


def seed_arg(text: str) -> int:
    """argparse type of ``--seed``: an integer in 0 .. 2**31 - 1."""
    try:
        val = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= val < 2**31:
        raise argparse.ArgumentTypeError(f"must be in 0..{2**31 - 1}, got {text!r}")
    return val


def _log_to_stderr() -> None:
    """Show the library's INFO log (``pipeopt.*`` loggers: the CP-SAT search log) on stderr."""
    log = logging.getLogger("pipeopt")
    if not any(getattr(h, "pipeopt_cli", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.pipeopt_cli = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.setLevel(logging.INFO)


def _solve_inference(args: argparse.Namespace, data: Any) -> int:
    """``pipeopt solve`` on an inference config (docs/inference.md; ``data``: the file as
    parsed by :func:`pipeopt.workload_config.read_workload`): print the serving metrics,
    write the served plan's schedule JSON v2 with ``-o``."""
    from pipeopt.graphio import dump_graph_schedule
    from pipeopt.inference_config import parse_inference, solve_inference

    for flag in ("method", "objective"):
        if getattr(args, flag, None) is not None:
            raise ConfigError(f"--{flag.replace('_', '-')}: not used with an inference config "
                              "(give workload.method)")
    cfg = parse_inference(data, input_name(args.config))
    # --time-limit (checked by its parser) overrides workload.time_limit; loading counts
    limit = cfg.time_limit if args.time_limit is None else args.time_limit
    spent = time.perf_counter() - args.started
    cfg = dataclasses.replace(cfg, time_limit=max(limit - spent, 1e-3))
    served, met = solve_inference(cfg)
    m = served.metrics
    if args.json:
        print(json.dumps({"method": served.method, "ttft_limit_met": met, **m.as_dict()}))
    else:
        print(f"method        {served.method}")
        if cfg.partition is not None:  # stages: serving | pipeedge chose the pipeline
            p = cfg.partition
            stages = " / ".join(f"{g}: {n} layers" for g, n in zip(cfg.gpus, p.layers,
                                                                   strict=True))
            print(f"partition     {stages} (GPUs {list(p.devices)} of workload.gpu)")
        print(f"throughput    {m.throughput_tokens_per_s:.1f} tokens/s "
              f"({served.plan.output_tokens} tokens in {m.makespan_s:.3f} s)")
        limit = "" if cfg.ttft_limit is None else (
            f" (limit {cfg.ttft_limit:g} s {'met' if met else 'NOT met'})")
        print(f"TTFT          p50 {m.ttft_p50_s:.3f} s, p99 {m.ttft_p99_s:.3f} s{limit}")
        print(f"TPOT          {m.tpot_s * 1e3:.2f} ms")
    if args.output:  # schedule JSON v2: pipeopt plot / trace draw it
        write_output("--output", args.output,
                     lambda path: dump_graph_schedule(served.schedule, path))
        if not args.json:
            print(f"written       {args.output}")
    return 0


def _load_graph(args: argparse.Namespace, data: Any, *, solve: bool) -> Any:
    """The :class:`~pipeopt.graph_config.GraphConfig` of ``data`` with the command's flags."""
    from pipeopt.graph_config import load_graph_config

    if getattr(args, "objective", None) is not None:
        raise ConfigError("--objective: a task-graph config minimises the makespan of its "
                          "iterations (no span objective)")
    overrides = {"time_limit": args.time_limit}
    if solve:
        overrides.update(method=args.method, seed=args.seed)
    return load_graph_config(data, input_name(args.config), overrides)


def _graph_method(args: argparse.Namespace, cfg: Any, name: str, key: str | None = None
                  ) -> None:
    """``name`` as a method of ``cfg``'s workload, or a ConfigError naming ``key`` (default:
    ``--method`` when given, else the config's method key)."""
    from pipeopt.solvers.graph import UnknownGraphMethod, check_graph_method

    try:
        check_graph_method(cfg.work, name)
    except UnknownGraphMethod as exc:
        if key is None:
            key = "--method" if getattr(args, "method", None) is not None else cfg.method_key
        raise ConfigError(f"{key}: {exc}") from None


def print_graph_workload(cfg: Any, s: GraphSchedule, out: Any = None) -> None:
    """The summary of a solved task-graph config: the schedule, per iteration figures and
    bounds (seconds), and the workload's facts."""
    from pipeopt.workloads.dataparallel import iteration_time, iterations_of, periodic_bound

    out = out or sys.stdout
    k = iterations_of(s.graph)
    print_graph_summary(s, out)
    lb = "" if s.lower_bound is None else f" (lower bound {_fmt(s.lower_bound / k)} s)"
    print(f"iteration     {_fmt(iteration_time(s))} s = makespan / {k} iteration"
          f"{'s' if k > 1 else ''}{lb}", file=out)
    print(f"steady state  >= {_fmt(periodic_bound(s.graph))} s per iteration (the busiest "
          "device or network resource's load)", file=out)
    for key, text in cfg.facts:
        print(f"{key:<13} {text}", file=out)


def _solve_graph(args: argparse.Namespace, data: Any) -> int:
    """``pipeopt solve`` on a task-graph config: the schedule's summary; ``-o`` writes it as
    schedule JSON v2 (plot, trace and simulate read it)."""
    from pipeopt.core.validate import InvalidSchedule
    from pipeopt.graphio import dump_graph_schedule
    from pipeopt.solvers.graph import compare_graph, solve_graph
    from pipeopt.workloads.dataparallel import iteration_time, periodic_bound

    cfg = _load_graph(args, data, solve=True)
    sc = cfg.solver
    _graph_method(args, cfg, sc.method)
    spent = time.perf_counter() - args.started
    limit = max(sc.time_limit - spent, 1e-3)
    with _progress_line(args.quiet or args.json or args.verbose) as line:
        line.running(sc.method)
        try:
            sched = solve_graph(cfg.work, sc.method, time_limit=limit, seed=sc.seed,
                                workers=sc.workers, resolution=sc.resolution)
        except ValueError as exc:  # InvalidSchedule (a hand-made schedule over memory),
            # NotApplicable (an own search that found nothing), cpsat
            if not isinstance(exc, InvalidSchedule | NotApplicable) and not str(
                    exc).startswith("cpsat:"):
                raise
            key = "--method" if args.method is not None else cfg.method_key
            raise ConfigError(f"{key}: {sc.method}: {one_line(str(exc))}") from None
    rows = compare_graph(cfg.work, cfg.baselines) if cfg.baselines else []
    if args.json:
        extra = {"baselines": {r.method: {k: v for k, v in r.to_dict().items()
                                          if k not in ("method", "ratio")} for r in rows}
                 } if cfg.baselines else {}
        print(json.dumps({**sched.summary(), "iteration_time": iteration_time(sched),
                          "periodic_bound": periodic_bound(sched.graph), **extra}))
    else:
        print_graph_workload(cfg, sched)
        chosen = iteration_time(sched)
        for r in rows:  # the workload's baselines, measured in this run
            if r.schedule is None or r.value is None:
                print(f"{r.method:<13} n/a ({one_line(r.error or '')})")
                continue
            over = "" if r.fits else " (over the memory limit)"
            print(f"{r.method:<13} {_fmt(r.value)} s/iteration, peak "
                  f"{_fmt(max(r.schedule.peak_memory, default=0.0))} bytes, "
                  f"{r.value / chosen:.2f}x the chosen{over}")
    if args.output:
        sys.stdout.flush()
        write_output("--output", args.output, lambda path: dump_graph_schedule(sched, path))
        if not args.json:
            print(f"written       {args.output}")
    return 0


def _compare_graph(args: argparse.Namespace, data: Any) -> int:
    """``pipeopt compare`` on a task-graph config: every method's seconds per iteration."""
    from pipeopt.solvers.graph import compare_graph

    cfg = _load_graph(args, data, solve=False)
    names = None
    if args.methods is not None:
        names = [n.strip() for n in args.methods.split(",") if n.strip()]
        for n in names:
            _graph_method(args, cfg, n, "--methods")
    with _progress_line(args.quiet or args.json):
        rows = compare_graph(cfg.work, names, time_limit=cfg.solver.time_limit,
                             seed=cfg.solver.seed, workers=cfg.solver.workers)
    if args.json:
        print(json.dumps([r.to_dict() for r in rows]))
        _plot_graph_rows(args, rows)
        return 0
    table = [["method", "s/iteration", "vs best", "makespan", "peak mem (max)", "fits",
              "status"]]
    for r in rows:
        if r.schedule is None:
            table.append([r.method, "-", "-", "-", "-", "-", f"n/a: {r.error}"])
            continue
        s = r.schedule
        table.append([r.method, _fmt(r.value), "n/a" if r.ratio is None else f"{r.ratio:.3f}",
                      _fmt(s.makespan), _fmt(max(s.peak_memory, default=0.0)),
                      "yes" if r.fits else "no", s.status])
    widths = [max(len(row[i]) for row in table if len(row) > i) for i in range(len(table[0]))]
    for i, row in enumerate(table):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    from pipeopt.workloads.dataparallel import iterations_of

    k = max((iterations_of(r.schedule.graph) for r in rows if r.schedule), default=1)
    print(f"(s/iteration = makespan / {k} iteration{'s' if k > 1 else ''}, collectives "
          "included; vs best = s/iteration / the best that fits)")
    _plot_graph_rows(args, rows)
    return 0


def _plot_graph_rows(args: argparse.Namespace, rows: list[Any]) -> None:
    """``compare --plot`` of a task-graph config: the schedules found, after the table (if
    drawing fails, the results are already shown)."""
    if not args.plot:
        return
    from pipeopt.plot import plot_graph_compare

    drawn = [r for r in rows if r.schedule is not None]
    sys.stdout.flush()
    write_output("--plot", args.plot, lambda path: plot_graph_compare(
        [r.schedule for r in drawn], path, fits=[r.fits for r in drawn],
        values=[r.value for r in drawn]))
    if not args.json:
        print(f"written {args.plot}")


def cmd_solve(args: argparse.Namespace) -> int:
    if args.verbose:
        _log_to_stderr()
    refuse_overwriting_input("--output", args.output, args.config)
    if args.output:
        check_writable("--output", args.output)  # before the search, not after it
    from pipeopt.workload_config import chain_config, read_workload

    work = read_workload(args.config)  # read and parsed once; its kind picks the route
    if work.kind == "inference":
        return _solve_inference(args, work.data)
    if work.is_graph:
        return _solve_graph(args, work.data)
    cfg = chain_config(work, method=args.method, time_limit=args.time_limit, seed=args.seed,
                       objective=args.objective)
    if work.kind == "async":
        return _solve_async(args, cfg)
    sc = cfg.solver
    # The time limit covers the whole command: loading (done), the search, its validation
    # (solve() keeps time for it) and writing the result (kept here).
    watch = Stopwatch(args.started, args.started_cpu)
    writing = WRITE_S_PER_OP * cfg.problem.num_ops if args.output else 0.0
    # A quick load says nothing of the machine's load: then a 50 ms probe does, when the
    # writing it scales would take more than a second.
    slowdown = watch.slowdown(calibrate=writing > 1.0)
    spent, writing = watch.elapsed(), writing * slowdown
    limit = time_left(sc.time_limit, spent + writing)
    logger.info("solve: loaded in %.2f s (%d ops, wall / CPU %.1f); %.2f s of the %.3g s time "
                "limit left for the search and its validation, %.2f s kept for writing", spent,
                cfg.problem.num_ops, slowdown, limit, sc.time_limit, writing)
    try:
        check_method(sc.method)
    except UnknownMethod as exc:
        key = "--method" if args.method is not None else "solver.method"
        raise ConfigError(f"{key}: {exc}") from None
    if not args.json:
        from pipeopt.costs import describe_partition

        table = describe_partition(cfg)
        if table:
            print(table)
    with _progress_line(args.quiet or args.json or args.verbose) as line:
        line.running(sc.method)
        t_search = time.perf_counter()
        from pipeopt.costs.chunks import solve_config  # auto may choose the model's chunks

        sched = solve_config(cfg, sc.method, time_limit=limit, seed=sc.seed,
                             objective=sc.objective, workers=sc.workers,
                             relative_gap=sc.relative_gap, resolution=sc.resolution,
                             time_tolerance=sc.time_tolerance, on_progress=line.report,
                             log=args.verbose)
    logger.info("solve: search and validation took %.2f s", time.perf_counter() - t_search)
    # The summary first: if the write then fails, what was found is still on the screen.
    front = sched.solver.detail("pareto")
    if args.json:
        extra: dict[str, Any] = {} if sched.problem.uniform_microbatches else {
            "microbatch_order": list(sched.microbatch_order)}
        # Whether the validator passed the schedule; auto may skip it when it cannot fit the
        # time limit, and then says why here and in the written file's solver.details.
        extra["validated"] = not sched.solver.detail("validation")
        if sched.solver.detail("validation"):
            extra["validation"] = sched.solver.detail("validation")
        if front:
            key = "max_span" if sched.solver.objective == "span" else "iteration_time"
            extra["pareto"] = [{"method": m, key: t, "peak_memory": mem,
                                "chosen": m == sched.solver.detail("chosen")}
                               for m, t, mem in front]
        print(json.dumps({**sched.summary(), **extra}))
    else:
        print_summary(sched)
        if sched.solver.detail("validation"):
            print(f"validation    {sched.solver.detail('validation')}")
        if sched.solver.detail("tradeoff"):
            print(f"trade-off     {sched.solver.detail('tradeoff')}")
        if front:
            print_pareto(sched, front)
        if sched.solver.detail("chunks"):
            print(f"chunks        {sched.solver.detail('chunks')}")
            chosen, given = sched.problem, cfg.problem
            if (chosen.virtual_stages, chosen.placement) != (given.virtual_stages,
                                                             given.placement):
                # The chosen cut's stages (the table above is the configured one's).
                from dataclasses import replace

                from pipeopt.costs import describe_partition

                print(describe_partition(replace(cfg, problem=chosen)))
    if args.output:
        sys.stdout.flush()
        t_write = time.perf_counter()
        write_output("--output", args.output, lambda path: dump_schedule(sched, path))
        if not args.json:
            print(f"written       {args.output}")
        logger.info("solve: schedule written in %.2f s", time.perf_counter() - t_write)
    logger.info("solve: %.2f s in all, time limit %.3g s", time.perf_counter() - args.started,
                sc.time_limit)
    details = dict(sched.solver.details)
    if details.get("fallback"):
        print(f"pipeopt: note: {details['fallback']}", file=sys.stderr)
    if details.get("validation"):
        print(f"pipeopt: note: validation {details['validation']}", file=sys.stderr)
    if details.get("interrupted"):
        kept = f"wrote the best schedule so far to {args.output}" if args.output else (
            "the best schedule so far is above")
        gap = "" if sched.gap is None else f", gap {sched.gap:.2%}"
        print(f"pipeopt: interrupted: {kept} (status {sched.solver.status}{gap})",
              file=sys.stderr)
        return 130
    return 0


def _async_method(args: argparse.Namespace, name: str) -> None:
    """``name`` as an asynchronous method, or a ConfigError naming the key that gave it."""
    from pipeopt.solvers import check_async_method

    try:
        check_async_method(name)
    except UnknownMethod as exc:
        key = "--method" if args.method is not None else "solver.method"
        raise ConfigError(f"{key}: {exc}") from None


def _solve_async(args: argparse.Namespace, cfg: Any) -> int:
    """``solve`` with ``pipeline.mode: async``: a periodic schedule, its summary, its JSON."""
    from pipeopt.io import format_json, write_atomic
    from pipeopt.solvers import solve_async
    from pipeopt.workloads.periodic import PeriodicError

    _async_method(args, cfg.solver.method)
    try:
        s = solve_async(cfg.problem, cfg.solver.method, cfg.extra("weight_bytes"),
                        time_limit=cfg.solver.time_limit, replicas=cfg.extra("replicas", ()),
                        sync_s=cfg.extra("sync_s", ()))
    except PeriodicError as exc:
        raise ConfigError(str(exc)) from None
    doc = s.to_dict()
    planned = cfg.extra("pipedream_plan")
    if args.json:
        extra = {"plan": _plan_doc(planned)} if planned else {}
        print(json.dumps({**{k: v for k, v in doc.items() if k not in ("tasks", "messages",
                                                                       "problem")}, **extra}))
    else:
        if planned:
            print_plan(planned)
        print_async_summary(s)
    if args.output:
        sys.stdout.flush()
        write_output("--output", args.output,
                     lambda path: write_atomic(path, format_json(doc)))
        if not args.json:
            print(f"written       {args.output}")
    return 0


def _plan_doc(planned: Any) -> dict[str, Any]:
    """The JSON of a ``pipedream:`` config's plan (the ``pipedream_plan`` extra); with device
    types, ``types`` (name, devices, speed, memory per device, whether it has its own layer
    times) and each stage's ``type``."""
    d = dict(planned)
    doc = {"config": d["config"], "period": d["period"], "devices": d["devices"],
           "levels": [{"units": u, "bandwidth": b} for u, b in d["levels"]],
           "stages": [{"first": a, "last": b, "replicas": r, **({"type": t} if d["types"]
                                                                  else {})}
                      for a, b, r, t in d["stages"]]}
    if d["types"]:
        doc["types"] = [{"name": n, "devices": c, "speed": v, "memory": m, "own_profile": o}
                        for n, c, v, m, o in d["types"]]
    if d["devices"] != d["cluster_devices"]:
        doc["idle_devices"] = d["cluster_devices"] - d["devices"]
    return doc


def print_plan(planned: Any, out: Any = None) -> None:
    """PipeDream's plan of a ``pipedream:`` config: its notation, estimate and stages (with
    device types: the types, and the type each stage runs on)."""
    out = out or sys.stdout
    d = dict(planned)
    levels = ", then ".join(f"{u} x {_fmt(b / 1e9)} GB/s" for u, b in d["levels"])
    idle = d["cluster_devices"] - d["devices"]
    print(f"plan          pipedream {d['config']} on {d['devices']} "
          f"device{'s' if d['devices'] > 1 else ''} ({levels}"
          f"{f'; {idle} left idle' if idle else ''}): estimated {_fmt(d['period'])} s per "
          "micro-batch (replicas' weight all-reduce counted)", file=out)
    for name, count, speed, memory, own in d["types"]:
        mem = "no memory limit" if memory is None else f"{_fmt(memory / 1e9)} GB each"
        pace = "its own layer times" if own else f"speed {_fmt(speed)}"
        print(f"  type {name}: {count} devices, {pace}, {mem}", file=out)
    for k, (a, b, r, t) in enumerate(d["stages"]):
        on = f" {t}" if d["types"] else ""
        print(f"  stage {k}: layers {a}..{b} on {r}{on} device{'s' if r > 1 else ''}",
              file=out)


def print_async_summary(s: Any, out: Any = None) -> None:
    """A short human summary of one periodic schedule, with a row per stage."""
    out = out or sys.stdout
    prob = s.problem
    lb = s.lower_bound
    gap = "" if not lb else f" (lower bound {_fmt(lb)} s, gap {(s.period - lb) / s.period:.2%})"
    print(f"method        {s.method}", file=out)
    print(f"mode          async (steady state; weights: {s.policy}, updated every "
          f"{s.update_every} micro-batch{'es' if s.update_every > 1 else ''})", file=out)
    print(f"period        {_fmt(s.period)} s per micro-batch{gap}", file=out)
    print(f"throughput    {_fmt(s.throughput)} micro-batches/s", file=out)
    print(f"warm-up       {_fmt(s.warmup)} s (as long again to drain)", file=out)
    print(f"devices       {sum(s.replicas)}" + (" (replicated stages: in flight, versions, "
          "staleness and memory per replica)" if max(s.replicas) > 1 else ""), file=out)
    if any(s.sync_s):
        rows = ", ".join(f"stage {k} {_fmt(x)} s every {s.replicas[k]} micro-batches"
                         for k, x in enumerate(s.sync_s) if x)
        print(f"replica sync  {rows} (the replicas' gradient all-reduce: period >= sync / "
              "replicas)", file=out)
    print("stage  replicas  in flight  weight versions  staleness  peak memory", file=out)
    for k in range(prob.stages):
        d = prob.stage_device[k]
        print(f"{k:>5}  {s.replicas[k]:>8}  {s.replica_in_flight[k]:>9}  "
              f"{s.weight_versions[k]:>15}  {s.staleness[k]:>9}  "
              f"{format_memory(s.peak_memory[d], prob)}", file=out)


def _compare_async(args: argparse.Namespace, cfg: Any) -> int:
    """``compare`` with ``pipeline.mode: async``: the asynchronous methods beside the
    hand-made synchronous schedules and greedy (or ``--methods``, of either kind), by period
    per micro-batch."""
    from pipeopt.solvers import ASYNC_METHODS, async_methods, compare_async

    if args.plot:
        raise ConfigError("--plot: not yet drawn for pipeline.mode: async")
    async_names: list[str] = list(ASYNC_METHODS)
    sync_names: list[str] | None = None
    if args.methods is not None:
        names = [n.strip() for n in args.methods.split(",")]
        async_names = [n for n in names if n in async_methods()]
        sync_names = _method_list(",".join(n for n in names if n not in async_names)) if [
            n for n in names if n not in async_names] else []
    if cfg.extra("pipedream_plan") and not args.json:
        print_plan(cfg.extra("pipedream_plan"))
    rows = compare_async(cfg.problem, cfg.extra("weight_bytes"), async_names, sync_names,
                         time_limit=cfg.solver.time_limit, replicas=cfg.extra("replicas", ()),
                         sync_s=cfg.extra("sync_s", ()))
    if args.json:
        print(json.dumps([r.to_dict() for r in rows]))
        return 0
    table = [["method", "mode", "s/micro-batch", "micro-batches/s", "vs best", "peak memory",
              "staleness", "versions"]]
    for r in rows:
        if r.period is None:
            table.append([r.method, r.mode, "-", "-", "-", "-", "-", f"n/a: {r.error}"])
            continue
        mem = format_memory(r.peak_memory or 0.0, cfg.problem)
        table.append([r.method, r.mode, _fmt(r.period), _fmt(r.throughput),
                      "n/a" if r.ratio is None else f"{r.ratio:.3f}",
                      mem + ("" if r.fits else " (over)"), str(r.staleness),
                      str(r.weight_versions)])
    widths = [max(len(row[i]) for row in table if len(row) > i) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip())
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from pipeopt.graphio import load_any
    from pipeopt.views_cli import load_periodic

    try:
        periodic = load_periodic(args.schedule)  # pipeline.mode: async's own document
    except USER_ERRORS as exc:
        if args.json:
            print(json.dumps({"valid": False, "error": one_line(str(exc))}))
        raise
    if periodic is not None:  # checked by unrolling it through the core validator
        if args.json:
            print(json.dumps({"valid": True, "method": periodic.method,
                              "period": periodic.period, "lower_bound": periodic.lower_bound,
                              "peak_memory": list(periodic.peak_memory)}))
        else:
            print(f"{input_name(args.schedule)}: valid")
            print_async_summary(periodic)
        return 0

    try:
        sched = load_any(args.schedule)
        again = retime(sched) if isinstance(sched, Schedule) else _retime_graph(sched)
    except USER_ERRORS as exc:
        if args.json:  # scripts read the verdict from stdout; the error line still goes out
            print(json.dumps({"valid": False, "error": one_line(str(exc))}))
        raise
    if args.json:
        print(json.dumps({"valid": True, **sched.summary(),
                          "resimulated_makespan": again.makespan}))
    else:
        print(f"{input_name(args.schedule)}: valid")
        if isinstance(sched, Schedule):
            print_summary(sched)
        else:
            print_graph_summary(sched)
        print(f"re-simulated  {_fmt(again.makespan)} s (same device orders, earliest starts)")
    return 0


def _retime_graph(sched: GraphSchedule) -> GraphSchedule:
    """The core simulator's timing of ``sched``'s device orders (a deadlock: ScheduleError)."""
    from pipeopt.core.simulate import OrderError, simulate

    try:
        return simulate(sched.graph, sched.device_orders(), sched.method)
    except OrderError as exc:
        raise ScheduleError(f"re-simulating: {exc}") from None


def print_graph_summary(s: GraphSchedule, out: Any = None) -> None:
    """A short human summary of a task-graph schedule (schedule JSON v2)."""
    out = out or sys.stdout
    g, gap = s.graph, s.gap
    print(f"method        {s.method}", file=out)
    print(f"graph         {g.num_tasks:,} tasks, {g.num_edges:,} edges on {g.devices} devices "
          f"and {g.num_links} links", file=out)
    print(_status_line(s.status, s.lower_bound, gap), file=out)
    print(f"makespan      {_fmt(s.makespan)} s", file=out)
    if s.objective != s.makespan:
        print(f"objective     {_fmt(s.objective)} s (end + tail)", file=out)
    peaks = s.peak_memory
    hi = max(range(len(peaks)), key=peaks.__getitem__)
    print(f"peak memory   max {_fmt(peaks[hi])} bytes (device {hi})", file=out)
    print(f"solve time    {s.wall_time:.2f} s", file=out)


def cmd_compare(args: argparse.Namespace) -> int:
    refuse_overwriting_input("--plot", args.plot, args.config)
    if args.plot:
        from pipeopt.plot import image_format

        image_format(args.plot, "--plot")  # a bad suffix before any method runs
        check_writable("--plot", args.plot)
    from pipeopt.workload_config import chain_config, read_workload

    work = read_workload(args.config)  # read and parsed once; its kind picks the route
    if work.kind == "inference":
        raise ConfigError("workload.kind: inference: compare ranks training schedules; "
                          "pipeopt solve runs a serving config's method (docs/inference.md)")
    if work.is_graph:
        return _compare_graph(args, work.data)
    cfg = chain_config(work, time_limit=args.time_limit)
    if work.kind == "async":
        return _compare_async(args, cfg)
    names = _method_list(args.methods) if args.methods is not None else None
    with _progress_line(args.quiet or args.json) as line:
        sc = cfg.solver
        rows = compare(cfg.problem, names, time_limit=sc.time_limit, seed=sc.seed,
                       objective=sc.objective, workers=sc.workers,
                       relative_gap=sc.relative_gap, resolution=sc.resolution,
                       time_tolerance=sc.time_tolerance,
                       on_progress=line.report, on_start=line.running)
    if args.json:
        print(json.dumps([r.to_dict() for r in rows]))
    else:
        _print_table(rows)
    if args.plot:  # after the table: if drawing fails, the results are already shown
        from pipeopt.plot import plot_compare

        drawn = [r for r in rows if r.schedule is not None]
        sys.stdout.flush()
        write_output("--plot", args.plot, lambda path: plot_compare(
            [r.schedule for r in drawn], path, fits=[r.fits for r in drawn]))
        if not args.json:
            print(f"written {args.plot}")
    return _interrupted_compare(rows)


def _print_table(rows: list[Any]) -> None:
    """The comparison as an aligned text table: the compared quantity (iteration time, or max
    span with ``objective: span``), its ratio to the best that fits ("n/a" where undefined),
    the makespan only when it differs from that quantity somewhere, and whether each row that
    fits is on the time / peak memory Pareto set ("-" for rows over the memory limits)."""
    key = rows[0].ratio_of if rows else "iteration_time"
    what = "max span" if key == "max_span" else "iteration time"
    extra = any(r.value is not None and not math.isclose(r.schedule.makespan, r.value,
                                                         rel_tol=1e-12) for r in rows)
    head = ["method", what, "vs best", *(["makespan"] if extra else []), "bubble",
            "peak mem (max)", "fits", "pareto", "status"]
    table = [head]
    for r in rows:
        if r.schedule is None:
            table.append([r.method, *["-"] * (len(head) - 2), f"n/a: {r.error}"])
            continue
        s = r.schedule
        table.append([r.method, _fmt(r.value), "n/a" if r.ratio is None else f"{r.ratio:.3f}",
                      *([_fmt(s.makespan)] if extra else []), f"{s.bubble_ratio:.1%}",
                      format_memory(max(s.peak_memory), s.problem), "yes" if r.fits else "no",
                      ("yes" if r.pareto else "no") if r.fits else "-", s.solver.status])
    widths = [max(len(str(row[i])) for row in table if i < len(row)) for i in range(len(head))]
    for i, row in enumerate(table):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    if extra:
        print("(times in s; makespan = the last op's end; " + (
            "max span = the longest device's first op start to last op end"
            if key == "max_span" else "iteration time = makespan + the gradient reduction "
            "still running after it") + f"; vs best = {what} / the best that fits)")


def _interrupted_compare(rows: list[Any]) -> int:
    """130 with a note when Ctrl-C cut the comparison short, else 0."""
    from pipeopt.solvers import INTERRUPTED

    skipped = [r.method for r in rows if r.error == INTERRUPTED]
    cut = [r.method for r in rows if r.schedule is not None
           and r.schedule.solver.detail("interrupted")]
    if not skipped and not cut:
        return 0
    print(f"pipeopt: interrupted: {', '.join(cut) or 'a method'} stopped early (best so far "
          f"shown){'; not run: ' + ', '.join(skipped) if skipped else ''}", file=sys.stderr)
    return 130


def _method_list(text: str) -> list[str]:
    """``--methods a,b,c``: known names, each once, in the given order."""
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            raise ConfigError(f"--methods: an empty name in {text!r}; give comma-separated "
                              "method names such as 1f1b,zb-h1,greedy")
        try:
            check_method(name)
        except UnknownMethod as exc:
            raise ConfigError(f"--methods: {exc}") from None
        if name not in names:
            names.append(name)
    return names


class _PlanProgress:
    """``plan``'s progress on stderr: a line when the best step time improves, a round starts,
    or at most every ``every_s`` seconds otherwise."""

    def __init__(self, enabled: bool, every_s: float = 2.0) -> None:
        self.enabled, self.every_s = enabled, every_s
        self._last = -math.inf
        self._seen: tuple[Any, ...] = (None, None)

    def __call__(self, p: Any) -> None:
        if not self.enabled:
            return
        key = (p.round, p.best_s)
        if key == self._seen and p.elapsed_s - self._last < self.every_s:
            return
        self._seen, self._last = key, p.elapsed_s
        best = "-" if p.best_s is None else f"{p.best_s:.6g} s ({p.best.label})"
        print(f"plan: {p.elapsed_s:6.1f}s round {p.round}: {p.done} done, {p.left} left, "
              f"{p.pruned} pruned, {p.scheduled} scheduled; best {best}", file=sys.stderr,
              flush=True)


def cmd_plan(args: argparse.Namespace) -> int:
    outputs = [("--config-out", args.config_out), ("--schedule-out", args.schedule_out),
               ("--plot", args.plot)]
    given = [(flag, path) for flag, path in outputs if path]
    for i, (flag, path) in enumerate(given):
        refuse_overwriting_input(flag, path, args.config)
        for other, opath in given[:i]:
            if os.path.abspath(path) == os.path.abspath(opath):
                raise ConfigError(f"{flag}: {path} is also the file of {other}; give each "
                                  "output its own file")
    if args.plot:
        from pipeopt.plot import image_format

        image_format(args.plot, "--plot")
    for flag, path in given:
        check_writable(flag, path)
    from pipeopt.plan import load_plan, pareto_table, plan, ranked_table

    spec = load_plan(args.config)
    result = plan(spec, time_limit=args.time_limit, jobs=args.jobs,
                  on_progress=_PlanProgress(not args.quiet))
    best = result.best
    if args.json:
        print(json.dumps([r.to_dict() for r in result.results]))
    else:
        print(f"plan          {result.enumerated} configurations, {result.count('scheduled')} "
              f"scheduled, {result.count('pruned', 'memory')} pruned by memory, "
              f"{result.count('pruned', 'bound')} by bound, {result.count('failed')} failed, "
              f"{result.count('skipped')} skipped; {result.wall_time_s:.1f} s")
        print(ranked_table(result, top=args.top))
        print(pareto_table(result, "memory"))
        if spec.prices:
            print(pareto_table(result, "cost"))
        if best is not None:
            print(f"best          {best.candidate.label}: {_fmt(best.step_time_s)} s per step, "
                  f"{best.tokens_per_s:.4g} tokens/s, MFU {best.mfu:.1%} "
                  f"({best.tflops_per_gpu:.4g} TFLOP/s per GPU), method {best.method}")
    if best is None and result.stopped_by == "interrupted":
        print("pipeopt: interrupted: no configuration was scheduled yet", file=sys.stderr)
        return 130
    if best is None:
        raise ConfigError("plan: no configuration could be scheduled (see the reasons above: "
                          "every one is over the memory limit or refused); try more GPUs, "
                          "ZeRO-1 (plan.zero) or recomputation (plan.recompute)")
    if args.config_out:
        import yaml

        from pipeopt.io import write_atomic

        text = (f"# pipeopt plan {input_name(args.config)}: {best.candidate.label}, "
                f"{best.step_time_s:.6g} s per step\n"
                + yaml.safe_dump(result.config(best), sort_keys=False))
        write_output("--config-out", args.config_out,
                     lambda path: write_atomic(path, text))
    if args.schedule_out and best.schedule is not None:
        sched = best.schedule
        write_output("--schedule-out", args.schedule_out,
                     lambda path: dump_schedule(sched, path))
    if args.plot:
        from pipeopt.plan.plot import plot_plan

        write_output("--plot", args.plot, lambda path: plot_plan(result, path))
    if not args.json:
        for flag, path in given:
            print(f"written       {path} ({flag})")
    if result.interrupted:
        what = "Ctrl-C" if result.stopped_by == "interrupted" else "the time limit"
        print(f"pipeopt: {'interrupted' if what == 'Ctrl-C' else 'note'}: {what} stopped the "
              f"plan early; the best configuration so far is shown"
              + (" and written" if given else ""), file=sys.stderr)
        if result.stopped_by == "interrupted":
            return 130
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="pipeopt", description="Schedule search for pipeline-parallel training.",
        epilog="Example: " + EXAMPLES["solve"])
    from pipeopt._version import __version__

    parser.add_argument("--version", action="version", version=f"pipeopt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, description=help_,
                              epilog="Example: " + EXAMPLES.get(name, f"pipeopt {name} --help"))

    p = add("solve", "Find a schedule for a config and write it as JSON.")
    p.add_argument("config", help="config.yaml (explicit problem form, or model/cluster form), or "
                   "a schedule .json whose problem to solve again (e.g. the measured costs of "
                   "pipeopt run --costs-out); - reads either from standard input")
    p.add_argument("--method", help="override solver.method (auto, cpsat, greedy, 1f1b, ...)")
    p.add_argument("--time-limit", type=seconds_arg, help="override solver.time_limit (seconds)")
    p.add_argument("--seed", type=seed_arg, help="override solver.seed")
    p.add_argument("--objective", choices=["makespan", "span"], help="override solver.objective")
    p.add_argument("-o", "--output", help="write the schedule JSON here (atomically)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on the terminal")
    p.add_argument("-v", "--verbose", action="store_true", help="log solver details")
    p.set_defaults(func=cmd_solve)

    p = add("simulate", "Validate a schedule JSON file and re-simulate its device orders.")
    p.add_argument("schedule", help="schedule JSON (pipeopt.schedule/v1, or v2 for any task "
                   "graph); - for standard input")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_simulate)

    p = add("compare", "Run every applicable method on a config and rank them.")
    p.add_argument("config", help="config.yaml, or a schedule .json whose problem to use; - "
                   "reads either from standard input")
    p.add_argument("--methods", help="comma-separated method names (default: all)")
    p.add_argument("--time-limit", type=seconds_arg,
                   help="time limit per search method (seconds)")
    p.add_argument("--plot", help="also draw the schedules one above the other on a common "
                   "time axis into this image (.png, .svg or .pdf by its suffix)")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on the terminal")
    p.set_defaults(func=cmd_compare)

    p = add("plan", "Choose the parallel configuration (TP, PP, DP, micro-batches, virtual "
                    "stages, recompute, ZeRO) of a training run and schedule it.")
    p.add_argument("config", help="plan config .yaml: model:, cluster:, training: "
                   "{global_batch_size} and plan: (docs/plan.md)")
    p.add_argument("--time-limit", type=seconds_arg,
                   help="override plan.time_limit (seconds for the whole plan)")
    p.add_argument("--jobs", type=positive_int, help="override plan.jobs (candidates scheduled at "
                   "once, in worker processes)")
    p.add_argument("--config-out", help="write the best configuration here as a model-form "
                   "config that pipeopt solve takes (atomically)")
    p.add_argument("--schedule-out", help="write the best configuration's schedule JSON here")
    p.add_argument("--plot", help="draw the Pareto front into this image (.png, .svg, .pdf)")
    p.add_argument("--top", type=positive_int, default=15, help="rows of the ranked table "
                   "(default 15)")
    p.add_argument("--json", action="store_true", help="print every candidate as JSON, best "
                   "first")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=cmd_plan)

    import importlib
    import importlib.util

    for _name, (module, func) in PLUGINS.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # its parent package is absent
            found = False
        if found:
            getattr(importlib.import_module(module), func)(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``pipeopt``; returns the exit status (2 for bad input, 130 on Ctrl-C)."""
    pressed: list[bool] = []
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        def on_sigint(signum: int, frame: Any) -> None:
            pressed.append(True)
            raise KeyboardInterrupt

        # SIGTERM (timeout, Slurm, Kubernetes) stops a run as Ctrl-C does: the best schedule
        # so far is kept and written.
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_sigint)
    started, started_cpu = time.perf_counter(), time.process_time()
    try:
        args = build_parser().parse_args(argv)
        args.started = started  # time limits count from here
        args.started_cpu = started_cpu  # and the slowdown of their phases (pipeopt.clock)
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a full or closed standard output fails here, not at exit
        return code
    except (*USER_ERRORS, UsageError) as exc:
        print(f"pipeopt: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pipeopt: interrupted", file=sys.stderr)
        return 130
    except ImportError:
        # Ctrl-C while a C extension initialises (OR-Tools, torch, loaded on first use)
        # surfaces as an ImportError.
        if pressed:
            print("pipeopt: interrupted", file=sys.stderr)
            return 130
        raise
    except BrokenPipeError:
        _quiet_stdout()
        return 0
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EIO, errno.EBADF, errno.EDQUOT):
            # Standard output (or another stream) cannot take what is printed.
            _quiet_stdout()
            print(f"pipeopt: error: cannot write the output: {exc.strerror or exc}",
                  file=sys.stderr)
            return 2
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _quiet_stdout() -> None:
    """Point standard output at /dev/null, so that Python's flush at exit does not fail again
    on the pipe or device that already failed."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real file behind sys.stdout
        pass


def one_line(text: str) -> str:
    """``text`` on one line (a message that quotes a multi-line value stays one line)."""
    return " ".join(text.split()) if "\n" in text or "\r" in text else text


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

