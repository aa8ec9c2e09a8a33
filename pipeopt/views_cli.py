"""``pipeopt plot`` and ``pipeopt trace``: draw a schedule file, or export it for Perfetto."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipeopt.errors import ConfigError
from pipeopt.io import check_writable, refuse_overwriting_input, write_output

#: ``--dpi``'s default: :data:`pipeopt.plot.DEFAULT_DPI`, which the figure sizes are made for
#: (not imported: matplotlib loads on the first plot, not for ``pipeopt --help``).
DEFAULT_DPI = 100


def _positive_float(text: str) -> float:
    try:
        val = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not val > 0 or val == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return val


def positive_int(text: str) -> int:
    """argparse type of a count option (``trace --max-events``, ``plan --jobs`` / ``--top``):
    an integer >= 1."""
    try:
        val = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if val < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return val


def cmd_plot(args: argparse.Namespace) -> int:
    """Draw a schedule JSON file (v1 or v2) as a Gantt chart (PNG, SVG or PDF by the output's
    suffix)."""
    from pipeopt.graphio import load_any
    from pipeopt.plot import image_format, plot_any

    out = args.output or str(Path(args.schedule).with_suffix(".png"))
    refuse_overwriting_input("--output", out, args.schedule)
    image_format(out, "--output")  # a suffix it cannot write is refused before any work
    check_writable("--output", out)
    periodic = load_periodic(args.schedule)
    if periodic is not None:  # pipeline.mode: async writes a document of its own
        from pipeopt.plot_periodic import plot_periodic

        write_output("--output", out, lambda path: plot_periodic(
            periodic, path, title=args.title, dpi=args.dpi))
        print(f"written {out}")
        return 0
    sched = load_any(args.schedule)
    write_output("--output", out, lambda path: plot_any(
        sched, path, title=args.title, show_memory=not args.no_memory, dpi=args.dpi))
    print(f"written {out}")
    return 0


def load_periodic(path: str) -> Any:
    """The checked PeriodicSchedule of a ``pipeopt-periodic`` JSON file, or None for any
    other file (the schedule reader then reads it, with its own messages)."""
    import json

    from pipeopt.config import ConfigError
    from pipeopt.io import MAX_SCHEDULE_BYTES, read_input
    from pipeopt.schedules.periodic import InvalidPeriodic, validate_periodic
    from pipeopt.workloads.periodic import PeriodicError, PeriodicSchedule

    if not str(path).lower().endswith(".json"):
        return None
    try:
        doc = json.loads(read_input(path, MAX_SCHEDULE_BYTES, "a schedule JSON"))
    except Exception:  # unreadable or not JSON: the schedule reader says why
        return None
    if not (isinstance(doc, dict) and doc.get("format") == "pipeopt-periodic"):
        return None
    try:
        return validate_periodic(PeriodicSchedule.from_dict(doc))
    except (PeriodicError, InvalidPeriodic) as exc:
        raise ConfigError(f"{path}: {exc}") from None


def cmd_trace(args: argparse.Namespace) -> int:
    """Export a schedule JSON file (v1 or v2) as Chrome / Perfetto trace events."""
    from pipeopt.graphio import load_any
    from pipeopt.trace import TraceTooSmall, write_trace

    out = args.output or str(Path(args.schedule).with_suffix(".trace.json"))
    refuse_overwriting_input("--output", out, args.schedule)
    check_writable("--output", out)
    periodic = load_periodic(args.schedule)
    if periodic is not None:  # pipeline.mode: async writes a document of its own
        from pipeopt.trace_periodic import write_periodic_trace

        write_output("--output", out, lambda path: write_periodic_trace(periodic, path))
        print(f"written {out} (open it in ui.perfetto.dev or chrome://tracing)")
        return 0
    sched = load_any(args.schedule)
    try:
        write_output("--output", out, lambda path: write_trace(
            sched, path, flows=not args.no_flows, max_events=args.max_events))
    except TraceTooSmall as exc:
        raise ConfigError("--max-events: " + str(exc).removeprefix("max_events: ")) from None
    print(f"written {out} (open it in ui.perfetto.dev or chrome://tracing)")
    return 0


def add_commands(subparsers: Any) -> None:
    """Add ``plot`` and ``trace`` to the ``pipeopt`` command line."""
    help_ = ("Draw a schedule JSON file as a Gantt chart (PNG, SVG or PDF) with memory over "
             "time.")
    p = subparsers.add_parser(
        "plot", help=help_, description=help_,
        epilog="Example: pipeopt plot schedule.json -o schedule.png --dpi 150")
    p.add_argument("schedule", help="schedule JSON (pipeopt.schedule/v1, or v2 for any task "
                                    "graph)")
    p.add_argument("-o", "--output", help="image to write atomically; its suffix picks the "
                                          "format: .png, .svg or .pdf (default: the "
                                          "schedule's name with .png)")
    p.add_argument("--no-memory", action="store_true",
                   help="leave out the memory-over-time panel")
    p.add_argument("--dpi", type=_positive_float, default=float(DEFAULT_DPI),
                   help="pixels per inch (default 100); the image may be at most 20000 pixels "
                        "wide and high")
    p.add_argument("--title", help="replace the title (default: method, makespan, bubble ratio; "
                                   "for a task graph: method, size, makespan, objective)")
    p.set_defaults(func=cmd_plot)

    help_ = ("Export a schedule JSON file as Chrome/Perfetto trace events: one track per device "
             "and per directed link, memory as counters.")
    p = subparsers.add_parser(
        "trace", help="Export a schedule as a Chrome/Perfetto trace (JSON).", description=help_,
        epilog="Example: pipeopt trace schedule.json -o trace.json  (then open it in "
               "ui.perfetto.dev)")
    p.add_argument("schedule", help="schedule JSON (pipeopt.schedule/v1, or v2 for any task "
                                    "graph)")
    p.add_argument("-o", "--output", help="trace JSON to write atomically (default: the "
                                          "schedule's name with .trace.json)")
    p.add_argument("--no-flows", action="store_true",
                   help="leave out the arrows from each op to the op that uses its output "
                        "(about a quarter of a large trace's size)")
    p.add_argument("--max-events", type=positive_int, metavar="N",
                   help="write at most N events: leave out the flows, then the transmission "
                        "slices, then merge the slices of each track that are closest "
                        "together (and the memory changes between them, peaks kept); the "
                        "merge gap is reported in otherData.thinned")
    p.set_defaults(func=cmd_trace)
