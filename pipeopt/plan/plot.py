"""A plan's Pareto front as an image: step time against peak memory per device (and against
the cost of a step when the cluster has prices), every scheduled candidate a dot, the front
joined by a staircase and the best configuration named."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from matplotlib.figure import Figure

from pipeopt.plot import DEFAULT_DPI, _save, image_format

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from pipeopt.plan.search import CandidateResult, Plan

GIB = 2**30


def _panel(ax: Axes, result: Plan, objective: str) -> None:
    def val(r: CandidateResult) -> float:
        if objective == "memory":
            return (r.peak_memory_bytes or 0.0) / GIB
        return r.cost_per_step or 0.0

    done = result.scheduled
    front = result.pareto("memory" if objective == "memory" else "cost")
    ax.scatter([val(r) for r in done], [r.step_time_s for r in done], s=14, c="0.6",
               label=f"scheduled ({len(done)})", zorder=2)
    xs, ys = [val(r) for r in front], [r.step_time_s or 0.0 for r in front]
    ax.step(xs, ys, where="post", color="tab:blue", zorder=3)
    ax.scatter(xs, ys, s=30, color="tab:blue", label=f"Pareto front ({len(front)})", zorder=4)
    best = result.best
    if best is not None:
        ax.scatter([val(best)], [best.step_time_s], s=90, marker="*", color="tab:red",
                   label="fastest", zorder=5)
        ax.annotate(best.candidate.label, (val(best), best.step_time_s or 0.0), fontsize=7,
                    xytext=(6, 6), textcoords="offset points")
    ax.set_xlabel("peak memory per device (GiB)" if objective == "memory"
                  else "cost per step ($)")
    ax.set_ylabel("step time (s)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")


def plot_plan(result: Plan, path: str | os.PathLike[str], *, dpi: float = DEFAULT_DPI) -> Path:
    """Draw ``result``'s Pareto front(s) into ``path`` (PNG, SVG or PDF by its suffix, written
    atomically); returns the path."""
    image_format(path)
    panels = ["memory", *(["cost"] if result.spec.prices else [])]
    fig = Figure(figsize=(6.0 * len(panels), 4.5), dpi=dpi)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, objective in zip(axes, panels, strict=True):
        _panel(ax, result, objective)
    fig.suptitle(f"plan: {result.count('scheduled')} of {result.enumerated} configurations "
                 "scheduled", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)
