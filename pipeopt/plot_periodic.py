"""Drawing a periodic (asynchronous) schedule: the unrolled pattern with one steady-state period
highlighted, and each device's steady-state memory by kind (static, extra weight versions,
activations in flight) against its limit."""

from __future__ import annotations

import math
import os
from typing import Any

from pipeopt.plot import IDLE_COLOR, KIND_CMAPS, KIND_NAMES, LIMIT_COLOR, check_dpi, image_format
from pipeopt.workloads.periodic import PeriodicSchedule, unroll

#: Steady-state periods drawn after the warm-up (the first of them highlighted).
STEADY_PERIODS = 3
#: Colours of the memory kinds (static: grey; weight versions: purple; activations: blue).
MEMORY_COLORS = {"static": "#9e9e9e", "weights": "#7b3294", "activations": "#3a7dc9"}


def steady_window(schedule: PeriodicSchedule) -> tuple[float, float, float]:
    """(end of the drawn window, start and end of the highlighted period), seconds: the first
    whole period after micro-batch 0's span (when every task of the pattern runs), and
    :data:`STEADY_PERIODS` periods in all after the warm-up."""
    T = schedule.period
    q = math.ceil(schedule.span / T - 1e-9)
    return (q + STEADY_PERIODS) * T, q * T, (q + 1) * T


def plot_periodic(schedule: PeriodicSchedule, path: str | os.PathLike[str], *,
                  title: str | None = None, dpi: float = 100.0) -> None:
    """Write the picture of ``schedule`` to ``path`` (.png, .svg or .pdf by its suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import colormaps
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    fmt = image_format(path, "--output")
    g = unroll(schedule, max(schedule_length(schedule), 1))
    graph = g.graph
    end, h0, h1 = steady_window(schedule)
    rows = graph.devices
    size = (12.0, 1.2 + 0.45 * rows + 0.35 * rows + 1.2)
    check_dpi(size, dpi)
    fig, (gantt, mem) = plt.subplots(2, 1, figsize=size, height_ratios=[rows, max(2, rows)])
    gantt.axvspan(h0, h1, color="#fff3b0", zorder=0, label="one steady-state period")
    owner = row_names(schedule)
    for i in range(graph.num_tasks):
        s, e = g.start[i], g.end[i]
        if s >= end or e <= s:
            continue
        kind = graph.label[i].lstrip("0123456789")[0]
        j = int(graph.label[i].split(kind, 1)[1])
        color = colormaps[KIND_CMAPS.get(kind, "Greys")](0.35 + 0.55 * (j % 8) / 8)
        d = graph.device[i]
        gantt.barh(rows - 1 - d, min(e, end) - s, left=s, height=0.8, color=color,
                   edgecolor="white", linewidth=0.5, zorder=2)
        if (min(e, end) - s) / end > 0.02:
            gantt.text((s + min(e, end)) / 2, rows - 1 - d, str(j), ha="center", va="center",
                       fontsize=7, zorder=3)
    gantt.set_xlim(0, end)
    gantt.set_yticks(range(rows), [owner[rows - 1 - r] for r in range(rows)], fontsize=8)
    gantt.set_xlabel("time (s); numbers: micro-batch")
    gantt.set_facecolor(IDLE_COLOR)
    kinds = schedule.problem.kinds
    handles = [Patch(color=colormaps[KIND_CMAPS[k]](0.7), label=KIND_NAMES[k]
                     if schedule.problem.split_backward or k != "B" else "backward")
               for k in kinds]
    handles.append(Patch(color="#fff3b0", label="one steady-state period"))
    gantt.legend(handles=handles, loc="upper left", fontsize=7, ncol=len(handles))
    gantt.set_title(title or _title(schedule), fontsize=10)
    _memory_panel(mem, schedule)
    fig.tight_layout()
    fig.savefig(path, format=fmt, dpi=dpi)
    plt.close(fig)


def schedule_length(schedule: PeriodicSchedule) -> int:
    """Micro-batches to unroll so that the drawn window is full."""
    end, _, _ = steady_window(schedule)
    return math.ceil(end / schedule.period) + 1


def row_names(schedule: PeriodicSchedule) -> list[str]:
    """One name per device of the unrolled graph: ``stage k`` or ``stage k.c`` (replica c)."""
    out = []
    for k, r in enumerate(schedule.replicas):
        out += [f"stage {k}" if r == 1 else f"stage {k}.{c}" for c in range(r)]
    return out


def _title(s: PeriodicSchedule) -> str:
    lb = "" if s.lower_bound is None else f", bound {s.lower_bound:.4g} s"
    return (f"{s.method or 'periodic'} ({s.policy} weights): period {s.period:.4g} s per "
            f"micro-batch{lb}; in flight {list(s.replica_in_flight)}, weight versions "
            f"{list(s.weight_versions)}, staleness {list(s.staleness)}")


def _memory_panel(ax: Any, s: PeriodicSchedule) -> None:
    """Stacked bars per stage: static, extra weight versions, activations (steady-state
    peak); the limit as a red tick."""
    p = s.problem
    names = [f"stage {k}" + (f" (x{s.replicas[k]})" if s.replicas[k] > 1 else "")
             for k in range(p.stages)]
    xs = range(p.stages)
    static = [p.static_memory[p.stage_device[k]] for k in xs]
    weights = [s.weight_memory[p.stage_device[k]] for k in xs]
    acts = [s.activation_memory[p.stage_device[k]] for k in xs]
    ax.bar(xs, static, color=MEMORY_COLORS["static"], label="static (one weight version, ...)")
    ax.bar(xs, weights, bottom=static, color=MEMORY_COLORS["weights"],
           label="extra weight versions")
    ax.bar(xs, acts, bottom=[a + b for a, b in zip(static, weights, strict=True)],
           color=MEMORY_COLORS["activations"], label="activations in flight (peak)")
    labelled = False
    for k in xs:
        lim = p.memory_limit[p.stage_device[k]]
        if lim is not None:
            ax.hlines(lim, k - 0.4, k + 0.4, color=LIMIT_COLOR, linewidth=2,
                      label=None if labelled else "limit")
            labelled = True
    ax.set_xticks(list(xs), names, fontsize=8)
    ax.set_ylabel("steady-state memory per device")
    ax.legend(fontsize=7, loc="upper right")
